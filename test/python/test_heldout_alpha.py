"""transfer_model's default scale on held-out calibration batches
(alpha="heldout"): the update is computed from the calibration batches
that are not held out, then scaled by the candidate of alpha_grid (0
included) with the least loss on the held-out ones.  Label-free in the
sense of the issue: the loss is the calibration text's own next-token
loss, never evaluation text.  Models: test_hf_decoder's Hugging Face
layout decoder (keyword arguments, tied head)."""
import copy

import pytest
import torch

import bico
import bico.torch as bt
from test_binding_models import float32_default  # noqa: F401
from test_hf_decoder import (CFG, V, DecoderLayer, build, calibration, ce,
                             llama, planted, task, task_loss)

torch.set_num_threads(1)


def rule_task(n, seed, mul, add):
    """Windows where every second token is mul t + add of the one before."""
    x = torch.randint(0, V, (n, 17), generator=torch.Generator()
                      .manual_seed(seed))
    x[:, 1::2] = (x[:, 0:-1:2] * mul + add) % V
    return x[:, :-1], x[:, 1:]


def other_task(n, seed):
    """The calibration text of the target: every second token 5 t + 2."""
    return rule_task(n, seed, 5, 2)


_MISLEADING = []


def misleading_pair():
    """(A, A_ft): A_ft is A fine-tuned (Adam, 100 steps) on a rule that
    contradicts the target's text (7 t + 3 where the text has 5 t + 2), so
    the carried fine-tune makes confident wrong predictions there."""
    if not _MISLEADING:
        a = planted(DecoderLayer)[0]
        aft = copy.deepcopy(a).train()
        torch.manual_seed(0)
        opt = torch.optim.Adam(aft.parameters(), lr=1e-2)
        for i in range(100):
            x, y = rule_task(16, 2000 + i, 7, 3)
            opt.zero_grad()
            ce(aft(x), y).backward()
            opt.step()
        _MISLEADING.append((a, aft.eval()))
    return _MISLEADING[0]


def mean_loss(model, sd, data):
    return sum(task_loss(model, sd, d) for d in data) / len(data)


@pytest.mark.parametrize("method", ["fit", "bico"])
def test_default_is_never_worse_than_zero_shot_on_held_out_batches(method):
    """A target unrelated to the source, calibrated on text where the
    carried fine-tune (misleading_pair) hurts (alpha 1 raises the held-out loss): the default
    run holds out the last eighth of the batches (one), does not take alpha 1,
    and its loss on those held-out batches is at most the untouched
    target's.  The report says what was chosen."""
    a, aft = misleading_pair()
    b = build(CFG, llama.random_state(CFG, torch.Generator().manual_seed(8)))
    cal = [other_task(8, 60 + i) for i in range(4)]
    held = cal[-1:]
    zero = mean_loss(b, None, held)
    one = bt.transfer_model(a, aft, b, cal[:-1], method=method,
                            options=bt.options_for(method, alpha=1.0),
                            loss_fn=ce)
    assert mean_loss(b, one, held) > zero + 0.05  # alpha 1 hurts here
    rep = []
    sd = bt.transfer_model(a, aft, b, cal, method=method, loss_fn=ce,
                           report=rep)
    got = mean_loss(b, sd, held)
    assert got <= zero + 1e-6, (got, zero)
    chosen = [e for e in rep if e.get("rule") == "heldout"]
    assert len(chosen) == 1
    c = chosen[0]
    assert c["alpha"] != 1.0 and c["alpha"] == min(
        c["losses"], key=lambda g: (c["losses"][g], g))
    assert c["heldout_batches"] == 1 and c["fit_batches"] == 3
    assert abs(c["zero_shot"] - zero) < 1e-4
    assert abs(c["losses"][c["alpha"]] - got) < 1e-4
    # the chosen scale applied to the update from the first three batches
    m = copy.deepcopy(b)
    base = b.state_dict()
    m.load_state_dict({k: base[k] + c["alpha"] * (one[k] - base[k])
                       for k in base})
    assert abs(mean_loss(m, None, held) - got) < 1e-4


@pytest.mark.parametrize("method", ["fit", "bico"])
def test_planted_pair_keeps_its_gap_and_picks_about_one(method):
    """On the planted pair (exact answer T(A_ft)) the default run still
    closes >= 98 % of the task gap, and the held-out choice is about 1."""
    a, aft, b, bft = planted(DecoderLayer)
    lb, lft = task_loss(b), task_loss(bft)
    rep = []
    sd = bt.transfer_model(a, aft, b, calibration(), method=method,
                           loss_fn=ce, report=rep)
    assert (lb - task_loss(b, sd)) / (lb - lft) >= 0.98
    c = [e for e in rep if e.get("rule") == "heldout"][0]
    assert 0.75 <= c["alpha"] <= 1.5, c


def test_explicit_held_out_batches_and_token_id_batches():
    """holdout=[batches]: every calibration batch makes the update, the
    given ones choose alpha; batches of token ids without a loss_fn are
    scored by next-token cross-entropy of the logits (naive needs no
    calibration loss)."""
    a, aft, _, _ = planted(DecoderLayer)
    b = build(CFG, llama.random_state(CFG, torch.Generator().manual_seed(8)))
    ids = [task(8, 70 + i)[0] for i in range(2)]
    rep = []
    sd = bt.transfer_model(a, aft, b, ids[:1], method="naive",
                           options=bt.MapOptions(holdout=ids[1:],
                                                 alpha="heldout",
                                                 alpha_grid=[0, 0.5, 1]),
                           report=rep)
    c = rep[-1]
    assert c["rule"] == "heldout" and c["fit_batches"] == 1
    assert set(c["losses"]) == {0.0, 0.5, 1.0}
    x = ids[1]
    with torch.no_grad():
        logits = b(x)
    want = float(ce(logits[:, :-1], x[:, 1:]))
    assert abs(c["zero_shot"] - want) < 1e-5
    tau = {k: aft.state_dict()[k] - a.state_dict()[k] for k in sd}
    for k, v in sd.items():
        assert torch.allclose(v, b.state_dict()[k] + c["alpha"] * tau[k],
                              atol=1e-6), k
    # without a loss there is nothing to hold out: the old default, alpha 1
    cal = [(torch.randn(4, 3), torch.randn(4, 3)) for _ in range(3)]
    lin = torch.nn.Linear(3, 3)
    lin2 = copy.deepcopy(lin)
    with torch.no_grad():
        lin2.weight.add_(1.0)
    out = bt.transfer_model(lin, lin2, lin, cal, method="naive")
    assert torch.allclose(out["weight"], lin2.weight)


def test_ridge_list_is_chosen_with_alpha_on_held_out_batches():
    """ridge=[...] with the default alpha: one fit per value, the pair
    (ridge, alpha) with the least held-out loss kept and reported; the
    result is that ridge's fit at that alpha."""
    a, aft = misleading_pair()
    b = build(CFG, llama.random_state(CFG, torch.Generator().manual_seed(8)))
    cal = [task(8, 80 + i) for i in range(4)]
    rep = []
    sd = bt.transfer_model(a, aft, b, cal, method="fit",
                           options=bt.FitOptions(ridge=[1e-2, 10.0]),
                           loss_fn=ce, report=rep)
    c = [e for e in rep if e.get("rule") == "heldout"][0]
    assert set(c["ridge_losses"]) == {1e-2, 10.0}
    assert c["ridge_losses"][c["ridge"]] == min(c["ridge_losses"].values())
    one = bt.transfer_model(a, aft, b, cal[:-1], method="fit",
                            options=bt.FitOptions(alpha=1.0, ridge=c["ridge"]),
                            loss_fn=ce)
    base = b.state_dict()
    for k in base:
        assert torch.allclose(sd[k], base[k] + c["alpha"] * (one[k] -
                                                             base[k]),
                              atol=1e-5), k
    assert abs(task_loss(b, sd, cal[-1]) - c["losses"][c["alpha"]]) < 1e-4
    # the report lists the kept fit's layers once
    rep1 = []
    bt.transfer_model(a, aft, b, cal, method="fit", loss_fn=ce, report=rep1)
    fits = [e["name"] for e in rep if e.get("handling") == "fit"]
    assert fits and fits == [e["name"] for e in rep1
                             if e.get("handling") == "fit"]


def test_bad_heldout_options_are_refused_naming_the_option():
    a, aft, b, _ = planted(DecoderLayer)
    cal = calibration()
    for bad in (1.0, 1.5, -0.1, float("nan"), "half", True, []):
        with pytest.raises(bico.BicoError, match="holdout"):
            bt.transfer_model(a, aft, b, cal, method="fit",
                              options=bt.FitOptions(holdout=bad), loss_fn=ce)
    for bad in ([], [-1.0], [0.5, float("inf")], ["a"], 3):
        with pytest.raises(bico.BicoError, match="alpha_grid"):
            bt.transfer_model(a, aft, b, cal, method="fit",
                              options=bt.FitOptions(alpha_grid=bad),
                              loss_fn=ce)
    with pytest.raises(bico.BicoError, match="holdout=0.9 leaves no"):
        bt.transfer_model(a, aft, b, cal, method="fit",
                          options=bt.FitOptions(holdout=0.9), loss_fn=ce)
    with pytest.raises(bico.BicoError, match="holdout applies to"):
        bt.transfer_model(a, aft, b, cal, method="fit",
                          options=bt.FitOptions(alpha=1.0, holdout=0.5),
                          loss_fn=ce)
    with pytest.raises(bico.BicoError, match="alpha_grid applies to"):
        bt.transfer_model(a, aft, b, cal, method="bico",
                          options=bt.MapOptions(alpha=1.0, alpha_grid=[0, 1]),
                          loss_fn=ce)
    with pytest.raises(bico.BicoError, match="holdout is 0"):
        bt.transfer_model(a, aft, b, cal, method="fit",
                          options=bt.FitOptions(alpha="heldout", holdout=0),
                          loss_fn=ce)
    for bad in ([], [0.1, -1.0], [0.1, float("nan")]):
        with pytest.raises(bico.BicoError, match="ridge"):
            bt.transfer_model(a, aft, b, cal, method="fit",
                              options=bt.FitOptions(ridge=bad), loss_fn=ce)
    with pytest.raises(bico.BicoError, match="list of ridge"):
        bt.transfer_model(a, aft, b, cal, method="fit",
                          options=bt.FitOptions(ridge=[0.1, 1.0], alpha=1.0),
                          loss_fn=ce)
    with pytest.raises(bico.BicoError, match="ridge is not an option"):
        bt.transfer_model(a, aft, b, cal, method="bico",
                          options=dict(ridge=[0.1, 1.0]), loss_fn=ce)
    lin = torch.nn.Linear(3, 3)
    data = [(torch.randn(4, 3), torch.randn(4, 3)) for _ in range(3)]
    with pytest.raises(bico.BicoError, match="loss_fn"):
        bt.transfer_model(lin, lin, lin, data, method="naive",
                          options=bt.MapOptions(alpha="heldout"))


def test_proxy_fit_refines_the_fit_and_never_loses_on_held_out():
    """method="proxy-fit": the fit at its held-out alpha, then steps
    towards the proxy-tuned distribution, each chosen on the held-out
    batches (0 a candidate): its held-out loss is at most the fit's, the
    planted pair still closes >= 98 %, and the tied pair stays one."""
    a, aft, b, bft = planted(DecoderLayer)
    lb, lft = task_loss(b), task_loss(bft)
    cal = [task(8, 40 + i) for i in range(8)]
    rep = []
    sd = bt.transfer_model(a, aft, b, cal, method="proxy-fit", loss_fn=ce,
                           report=rep)
    assert (lb - task_loss(b, sd)) / (lb - lft) >= 0.98
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    fit = [e for e in rep if e.get("rule") == "heldout"][0]
    steps = [e for e in rep if e.get("rule") == "proxy-fit"]
    assert steps and all(e["alpha"] == min(e["losses"], key=lambda g: (
        e["losses"][g], g)) for e in steps)
    held = cal[-1:]   # an eighth of 8 batches (bt.HOLDOUT)
    got = mean_loss(b, sd, held)
    assert got <= fit["losses"][fit["alpha"]] + 1e-5
    assert abs(got - steps[-1]["losses"][steps[-1]["alpha"]]) < 1e-4
    for bad in (0, -1, 1.5, True):
        with pytest.raises(bico.BicoError, match="proxy_steps"):
            bt.transfer_model(a, aft, b, cal, method="proxy-fit",
                              options=bt.FitOptions(proxy_steps=bad),
                              loss_fn=ce)
    with pytest.raises(bico.BicoError, match="proxy-fit chooses"):
        bt.transfer_model(a, aft, b, cal, method="proxy-fit",
                          options=bt.FitOptions(alpha=1.0), loss_fn=ce)


def test_proxy_distill_keeps_the_best_held_out_state():
    """method="proxy-distill": the target trained towards the proxy-tuned
    distribution on the calibration batches that are not held out, the
    state with the least held-out loss kept (the untouched target is a
    candidate), its update then scaled on the same batches: its held-out
    loss is the one reported for that scale, at most the chosen step's
    and the zero-shot's; on the planted pair (the proxy is A_ft's distribution
    exactly) it closes most of the gap on fresh windows."""
    a, aft, b, bft = planted(DecoderLayer)
    lb, lft = task_loss(b), task_loss(bft)
    cal = [task(8, 40 + i) for i in range(8)]
    rep = []
    sd = bt.transfer_model(a, aft, b, cal, method="proxy-distill",
                           options=bt.DistillOptions(steps=200, lr=1e-2,
                                                     every=20),
                           loss_fn=ce, report=rep)
    r = [e for e in rep if e.get("rule") == "proxy-distill"][0]
    got = mean_loss(b, sd, cal[-1:])   # an eighth of 8 (bt.HOLDOUT)
    # the chosen step's update at the scale chosen after it
    assert abs(min(r["losses"].values()) - r["losses"][r["step"]]) < 1e-9
    assert abs(got - r["scale_losses"][r["scale"]]) < 1e-4
    assert got <= r["losses"][r["step"]] + 1e-4
    assert got <= r["zero_shot"] + 1e-6 and r["step"] > 0
    assert (lb - task_loss(b, sd)) / (lb - lft) >= 0.5
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    for opt, bad in (("steps", 0), ("every", 1.5), ("lr", -1.0),
                     ("lr", float("nan"))):
        with pytest.raises(bico.BicoError, match="DistillOptions." + opt):
            bt.transfer_model(a, aft, b, cal, method="proxy-distill",
                              options=bt.DistillOptions(**{opt: bad}),
                              loss_fn=ce)
    with pytest.raises(bico.BicoError, match="proxy-distill chooses"):
        bt.transfer_model(a, aft, b, cal, method="proxy-distill",
                          options=bt.DistillOptions(holdout=0), loss_fn=ce)


def test_heldout_choice_needs_a_gain_beyond_its_standard_error():
    """choose_alpha(rule="heldout"): a candidate whose mean gain over 0 is
    within its standard error over the held-out batches (one batch helped,
    the other hurt nearly as much) is not taken; a consistent gain is."""
    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.zero_()
    delta = {"weight": torch.ones(1, 1).numpy()}
    mse = torch.nn.functional.mse_loss
    x = torch.ones(1, 1)
    mixed = [(x, torch.full((1, 1), 1.0)), (x, torch.full((1, 1), -0.9))]
    best, scores = bt.choose_alpha(lin, lin, lin, delta, mixed,
                                   rule="heldout", grid=[0, 0.05],
                                   loss_fn=mse)
    assert scores[0.05] < scores[0.0] and best == 0.0
    same = [(x, torch.full((1, 1), 1.0)), (x, torch.full((1, 1), 0.9))]
    best, _ = bt.choose_alpha(lin, lin, lin, delta, same, rule="heldout",
                              grid=[0, 0.5, 1], loss_fn=mse)
    assert best == 1.0
