"""bico.torch.transfer_model: the sequential functional fit against planted
answers and an independent layer-by-layer reference, the other methods
against transfer_state_dict, label-free alpha, and bad input."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import bico
import bico.torch as bt
from test_binding_models import (float32_default,  # noqa: F401
                                 Tiny, batches, mse_loss, perturbed,
                                 planted_transform, ref_bico, ref_map,
                                 stored_statistics)

BLOCK_MODS = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1",
              "mlp.fc2")


def depth_pairs(la, lb):
    return [0 if lb == 1 else int(np.floor(j * (la - 1) / (lb - 1) + 0.5))
            for j in range(lb)]


def models(seed=0, **target_shape):
    torch.manual_seed(seed)
    a = Tiny().eval()
    aft = copy.deepcopy(a)
    aft.load_state_dict(perturbed(a, 0.1))
    b = Tiny(**target_shape).eval() if target_shape else copy.deepcopy(a)
    return a, aft, b


def outputs(model, sd, data):
    m = copy.deepcopy(model)
    m.load_state_dict(sd)
    with torch.no_grad():
        return torch.cat([m.eval()(x) for x, _ in data])


def test_fit_on_itself_reproduces_the_tuned_model():
    """target == source: R_out is the identity and every layer's inputs are
    full rank, so with c = 0 each fitted layer takes exactly A_ft's weights
    and the result computes A_ft's function on unseen inputs."""
    a, aft, b = models()
    sd = bt.transfer_model(a, aft, b, batches(), method="fit",
                           options=bt.FitOptions(ridge=0.0, holdout=0),
                           loss_fn=mse_loss)
    want = aft.state_dict()
    for k, v in sd.items():
        scale = float(want[k].abs().max()) + 1e-6
        assert float((v - want[k]).abs().max()) <= 1e-4 * scale, k
    fresh = batches(seed=9)
    assert torch.allclose(outputs(b, sd, fresh),
                          outputs(aft, aft.state_dict(), fresh),
                          atol=1e-4)


def test_shared_out_head_takes_the_change_as_it_is():
    """shared_out=["head"]: the head's D is not mapped.  Under a planted
    permutation of the residual stream the head's outputs (the classes)
    stay put, so the result is still exact; naming a non-linear module or
    one of another width is an error."""
    a, aft, _ = models()
    T = planted_transform(a.state_dict(), 8, 2, 16, 2)
    b = Tiny().eval()
    b.load_state_dict(T(a.state_dict()))
    sd = bt.transfer_model(a, aft, b, batches(), method="fit",
                           options=bt.FitOptions(ridge=0.0,
                                                 shared_out=["head"],
                                                 holdout=0),
                           loss_fn=mse_loss)
    fresh = batches(seed=12)
    got, want = outputs(b, sd, fresh), outputs(aft, aft.state_dict(), fresh)
    assert float((got - want).abs().max()) <= 1e-3 * float(
        want.abs().max())
    with pytest.raises(bico.BicoError, match="no nn.Linear"):
        bt.transfer_model(a, aft, b, batches(), method="fit",
                          options=bt.FitOptions(shared_out=["norm"]),
                          loss_fn=mse_loss)
    wide = Tiny(d=12, heads=2, hidden=24).eval()
    with pytest.raises(bico.BicoError, match="shared_out"):
        bt.transfer_model(a, aft, wide, batches(), method="fit",
                          options=bt.FitOptions(shared_out=["patch_embed"]),
                          loss_fn=mse_loss)


def test_fit_follows_a_change_of_coordinates():
    """B is A written in other coordinates (permuted residual stream and
    MLP units, rotated head spaces): the fit recovers T(A_ft)'s function."""
    a, aft, _ = models()
    T = planted_transform(a.state_dict(), 8, 2, 16, 2)
    b = Tiny().eval()
    b.load_state_dict(T(a.state_dict()))
    sd = bt.transfer_model(a, aft, b, batches(), method="fit",
                           options=bt.FitOptions(ridge=0.0, holdout=0),
                           loss_fn=mse_loss)
    fresh = batches(seed=11)
    got = outputs(b, sd, fresh)
    want = outputs(aft, aft.state_dict(), fresh)
    base = outputs(b, b.state_dict(), fresh)
    assert float((got - want).abs().max()) <= 1e-3 * float(
        (want - base).abs().max())


def reference_fit(a, aft, b, data, ridge, la, lb):
    """The sequential fit as METHODS.md states it, with nothing shared with
    the package: whole-model forwards for every layer, statistics stored,
    maps by torch SVD, the ridge solved in float64 by torch.linalg.solve."""
    src = {m: m for m in ("patch_embed", "norm", "head")}
    for j, i in enumerate(depth_pairs(la, lb)):
        for m in BLOCK_MODS:
            src["blocks.%d.%s" % (j, m)] = "blocks.%d.%s" % (i, m)
    stats = stored_statistics(a, b, data, mse_loss, src,
                              split={"blocks.%d.attn.qkv" % j: 3
                                     for j in range(lb)})
    pair = lambda n: src[n.rsplit(".", 1)[0]] + "." + n.rsplit(".", 1)[1] \
        if n.rsplit(".", 1)[0] in src else n
    bico_sd = ref_bico(a.state_dict(), aft.state_dict(), b.state_dict(),
                       stats, pair, {"blocks.%d.attn.qkv" % j: 3
                                     for j in range(lb)},
                       {"cls_token": "patch_embed", "pos_embed":
                        "patch_embed"})
    linears = [n for n, m in b.named_modules() if isinstance(m, nn.Linear)]
    work = copy.deepcopy(b)
    start = {k: (v if k.rsplit(".", 1)[0] in linears else bico_sd[k])
             for k, v in b.state_dict().items()}
    work.load_state_dict(start)

    def io(model, name, side):
        rows = []
        mod = dict(model.named_modules())[name]
        h = mod.register_forward_hook(lambda m, i, o: rows.append(
            (i[0] if side == "in" else o).detach().reshape(
                -1, (i[0] if side == "in" else o).shape[-1]).double()))
        with torch.no_grad():
            for x, _ in data:
                model(x)
        h.remove()
        return torch.cat(rows)

    order = ["patch_embed"] + ["blocks.%d.%s" % (j, m) for j in range(lb)
                               for m in ("attn.qkv", "attn.proj", "mlp.fc1",
                                         "mlp.fc2")] + ["head"]
    for name in order:
        s = src[name]
        d = io(aft, s, "out") - io(a, s, "out")
        c = stats[name + ".out_xcov"]
        k = 3 if name.endswith("qkv") else 1
        wa, wb = c.shape[0] // k, c.shape[1] // k
        db = torch.cat([d[:, i * wa:(i + 1) * wa] @ ref_map(
            c[i * wa:(i + 1) * wa, i * wb:(i + 1) * wb]) for i in range(k)],
            1)
        lin = dict(b.named_modules())[name]
        theta = torch.cat([lin.weight.detach().T, lin.bias.detach()[None]]
                          ).double()
        one = lambda x: torch.cat([x, torch.ones(x.shape[0], 1,
                                                 dtype=x.dtype)], 1)
        zn, zo = one(io(work, name, "in")), one(io(b, name, "in"))
        din = lin.in_features
        lam = ridge * float(torch.trace(zn[:, :din].T @ zn[:, :din])) / din
        reg = torch.zeros(din + 1, din + 1, dtype=torch.float64)
        reg[:din, :din] = lam * torch.eye(din, dtype=torch.float64)
        new = torch.linalg.solve(zn.T @ zn + reg,
                                 zn.T @ (zo @ theta + db) + reg @ theta)
        wl = dict(work.named_modules())[name]
        with torch.no_grad():
            wl.weight.copy_(new[:din].T.float())
            wl.bias.copy_(new[din].float())
    return work.state_dict()


@pytest.mark.parametrize("ridge", [0.0, 0.05])
def test_block_sequential_fit_equals_layer_by_layer_reference(ridge):
    """A deeper and wider target (2 -> 3 blocks, 8 -> 12 wide): the
    block-at-a-time engine gives what whole-model reruns per layer give."""
    a, aft, b = models(d=12, heads=2, hidden=24, depth=3)
    data = batches()
    sd = bt.transfer_model(a, aft, b, data, method="fit",
                           options=bt.FitOptions(ridge=ridge, holdout=0),
                           loss_fn=mse_loss)
    want = reference_fit(a, aft, b, data, ridge, 2, 3)
    assert set(sd) == set(want)
    for k, v in sd.items():
        upd = float((want[k] - b.state_dict()[k]).abs().max())
        assert upd > 0, k  # every tensor is moved
        assert float((v - want[k]).abs().max()) <= 2e-3 * upd + 1e-6, k


def test_fit_report_and_ridge_shrinks_the_update():
    a, aft, b = models(d=12, heads=2, hidden=24, depth=3)
    data = batches()
    norms = []
    for c in (1e-3, 1e-1, 10.0):
        rep = []
        bt.transfer_model(a, aft, b, data, method="fit",
                          options=bt.FitOptions(ridge=c, holdout=0),
                          loss_fn=mse_loss, report=rep)
        fits = {e["name"]: e for e in rep if e.get("handling") == "fit"}
        assert set(fits) == set(n for n, m in b.named_modules()
                                if isinstance(m, nn.Linear))
        assert fits["head"]["rows"] == 96  # one pooled row per sample
        assert fits["blocks.2.mlp.fc1"]["rows"] == 96 * 6  # every token
        assert fits["blocks.2.mlp.fc1"]["source"] == "blocks.1.mlp.fc1"
        norms.append(fits["blocks.0.attn.proj"]["update_norm"])
    assert norms[0] > norms[1] > norms[2]


@pytest.mark.parametrize("method", ["bico", "bico-in", "bico-out", "pad"])
def test_other_methods_delegate_to_transfer_state_dict(method):
    a, aft, b = models(d=12, heads=2, hidden=24, depth=3)
    data = batches()
    got = bt.transfer_model(a, aft, b, data, method=method,
                            options=bt.options_for(method, alpha=1.5),
                            loss_fn=mse_loss)
    col = bt.collect_statistics(a, b, data, mse_loss, show_progress=False)
    want = bt.transfer_state_dict(a.state_dict(), aft.state_dict(),
                                  b.state_dict(), col, method=method,
                                  alpha=1.5)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_naive_and_gradfix_on_a_same_shape_target():
    a, aft, _ = models()
    b = Tiny().eval()
    data = batches()
    tau = {k: aft.state_dict()[k] - a.state_dict()[k]
           for k in a.state_dict()}
    got = bt.transfer_model(a, aft, b, data, method="naive",
                            options=bt.MapOptions(alpha=0.5))
    for k, v in got.items():
        assert torch.allclose(v, b.state_dict()[k] + 0.5 * tau[k],
                              atol=1e-6), k
    got = bt.transfer_model(a, aft, b, data, method="gradfix",
                            loss_fn=mse_loss)
    votes = bt.collect_votes(b, data, mse_loss, show_progress=False)
    for k, v in got.items():
        counts = votes[k].counts().reshape(tau[k].shape)
        keep = torch.from_numpy(np.sign(counts)) == torch.sign(tau[k])
        want = b.state_dict()[k] + torch.where(keep, tau[k],
                                               torch.zeros_like(tau[k]))
        assert torch.allclose(v, want, atol=1e-6), k


def test_match_alpha_finds_the_planted_scale():
    """target == source and delta = tau / 2: the output change of A_ft is
    matched exactly at alpha = 2, on a grid that does not favour it."""
    a, aft, b = models()
    data = batches()
    delta = {k: 0.5 * (aft.state_dict()[k] - a.state_dict()[k]).numpy()
             for k in a.state_dict()}
    grid = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    best, scores = bt.choose_alpha(a, aft, b, delta, data, grid=grid)
    assert best == 2.0
    assert scores[2.0] < 1e-4 < min(v for g, v in scores.items() if g != 2)
    # through transfer_model: naive with alpha="match" is A_ft
    rep = []
    sd = bt.transfer_model(a, aft, b, data, method="naive",
                           options=bt.MapOptions(alpha="match"), report=rep)
    assert rep[-1]["rule"] == "match" and abs(rep[-1]["alpha"] - 1) < 0.1


def test_entropy_alpha_prefers_confident_outputs():
    """Entropy of softmax(logits) falls as logits grow: scaling the head
    up (delta = head) makes alpha's largest candidate the least entropic."""
    a, aft, b = models()
    delta = {"head.weight": b.state_dict()["head.weight"].numpy(),
             "head.bias": b.state_dict()["head.bias"].numpy()}
    best, scores = bt.choose_alpha(a, aft, b, delta, batches(),
                                   rule="entropy", grid=[0.5, 1, 2, 4])
    assert best == 4
    vals = [scores[g] for g in (0.5, 1, 2, 4)]
    assert vals == sorted(vals, reverse=True)


def test_bad_input():
    a, aft, b = models()
    data = batches()
    with pytest.raises(bico.BicoError, match="unknown method"):
        bt.transfer_model(a, aft, b, data, method="theseus")
    with pytest.raises(bico.BicoError, match="positive"):
        bt.transfer_model(a, aft, b, data, method="naive",
                          options=bt.MapOptions(alpha=-1))
    with pytest.raises(bico.BicoError, match="positive"):
        bt.transfer_model(a, aft, b, data, method="naive",
                          options=bt.MapOptions(alpha=float("nan")))
    with pytest.raises(bico.BicoError, match="alpha"):
        bt.transfer_model(a, aft, b, data, method="naive",
                          options=bt.MapOptions(alpha="labels"))
    with pytest.raises(bico.BicoError, match="fit takes a numeric"):
        bt.transfer_model(a, aft, b, data, method="fit",
                          options=bt.FitOptions(alpha="match"),
                          loss_fn=mse_loss)
    with pytest.raises(bico.BicoError, match="ridge"):
        bt.transfer_model(a, aft, b, data, method="fit",
                          options=bt.FitOptions(ridge=-1), loss_fn=mse_loss)
    with pytest.raises(bico.BicoError, match="nn.Module"):
        bt.transfer_model(a.state_dict(), aft, b, data)
    with pytest.raises(bico.BicoError, match="no calibration"):
        bt.transfer_model(a, aft, b, [], loss_fn=mse_loss)
    with pytest.raises(bico.BicoError, match="different parameters"):
        bt.transfer_model(a, Tiny(d=12, heads=2, hidden=24), b, data)
    with pytest.raises(bico.BicoError, match="norm"):
        bt.transfer_model(a, aft, b, data,
                          options=bt.FitOptions(source_blocks="blocks",
                                                target_blocks="norm"),
                          loss_fn=mse_loss)
    with pytest.raises(bico.BicoError, match="rule"):
        bt.choose_alpha(a, aft, b, {}, data, rule="labels")
    with pytest.raises(bico.BicoError, match="grid"):
        bt.choose_alpha(a, aft, b, {}, data, grid=[0.0, 1.0])


def test_centering_and_whitening_options_reach_the_statistics():
    """center/whiten need sums/Grams in the accumulators: transfer_model
    collects them and gives what transfer_state_dict gives on a Collector
    built with them."""
    a, aft, b = models(d=12, heads=2, hidden=24, depth=3)
    data = batches()
    got = bt.transfer_model(a, aft, b, data, method="bico",
                            options=bt.MapOptions(holdout=0,
                                                  library={"whiten": 0.5, "center": True}),
                            loss_fn=mse_loss)
    col = bt.collect_statistics(a, b, data, mse_loss, sums=True, grams=True,
                                show_progress=False)
    want = bt.transfer_state_dict(a.state_dict(), aft.state_dict(),
                                  b.state_dict(), col, method="bico",
                                  whiten=0.5, center=True)
    plain = bt.transfer_model(a, aft, b, data, method="bico",
                              options=bt.MapOptions(holdout=0),
                              loss_fn=mse_loss)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert any(not torch.allclose(got[k], plain[k]) for k in want)


def test_match_alpha_takes_the_first_crossing():
    """An output change 1.5 sin(theta w) (sin theta = 2/3: change 1 at
    w = 1, a peak of 1.5, back to 1 at w = 3.305): the closest candidate
    overall is the late near-tie 3.3; match takes the first crossing
    (between 0.9 and 1.2), and of those two the closer, 0.9."""
    theta = float(np.arcsin(2.0 / 3.0))

    class Sat(nn.Module):
        def __init__(self, w=0.0):
            super().__init__()
            self.w = nn.Parameter(torch.tensor(w))

        def forward(self, x):
            return x * (1.0 + 1.5 * torch.sin(theta * self.w))
    a, aft, b = Sat(), Sat(1.0), Sat()
    data = [torch.ones(1, 4)]
    delta = {"w": np.array(1.0, np.float32)}
    best, scores = bt.choose_alpha(a, aft, b, delta, data,
                                   grid=[0.5, 0.9, 1.2, 3.3])
    assert min(scores, key=scores.get) == 3.3
    assert best == 0.9
