"""bico.torch.distill: the teacher's compact form, the LoRA factors on
frozen layers, the chunked loss and the held-out choice, each against an
independent computation or a planted answer."""
import copy
import gc
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bico
from bico.torch import logits as _lg
from bico.torch import teacher as _t
from bico.torch import augment as _aug
from bico.torch import distill as D
from bico._status import BicoError

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _float32():
    """These tests build float32 models and tensors: another test module
    of the same pytest process may have set float64 as the default."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(old)


def _logp(shape, V, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(*shape, V, generator=g) * 3, -1)


def test_kl_full_entry_is_the_kl():
    p = _logp((4, 5), 11, 0)
    z = torch.randn(4, 5, 11, generator=torch.Generator().manual_seed(1))
    want = F.kl_div(torch.log_softmax(z.double(), -1), p.double(),
                    log_target=True, reduction="none").sum(-1).mean()
    assert abs(float(_t.kl_to_teacher(z, p)) - float(want)) < 1e-6


def test_kl_top_k_is_the_kl_of_the_coarsened_distributions():
    V, k = 13, 4
    p = _logp((3, 7), V, 2)
    z = torch.randn(3, 7, V, generator=torch.Generator().manual_seed(3))
    t = _t.Teacher(k=k)
    t.put(0, p)
    entry = t.get(0)
    assert isinstance(entry, tuple) and entry[0].shape == (3, 7, k)
    # independently: partition {each kept output, the rest} in float64
    pd, qd = p.double().exp(), torch.softmax(z.double(), -1)
    tot = 0.0
    for i in range(3):
        for j in range(7):
            keep = torch.topk(pd[i, j], k).indices
            mask = torch.zeros(V, dtype=torch.bool)
            mask[keep] = True
            pk, qk = pd[i, j][mask], qd[i, j][mask]
            pr, qr = pd[i, j][~mask].sum(), qd[i, j][~mask].sum()
            tot += float((pk * (pk / qk).log()).sum() + pr * (pr / qr).log())
    assert abs(float(_t.kl_to_teacher(z, entry)) - tot / 21) < 1e-5
    # the coarsened KL never exceeds the full one (data processing)
    assert float(_t.kl_to_teacher(z, entry)) <= \
        float(_t.kl_to_teacher(z, p)) + 1e-6


def test_k_at_least_the_outputs_keeps_everything():
    p = _logp((2, 3), 6, 4)
    for k in (6, 10, None):
        t = _t.Teacher(k=k)
        t.put(0, p)
        assert torch.equal(t.get(0), p)


def test_a_teacher_that_puts_no_mass_outside_the_top_k_gives_no_nan():
    p = torch.full((2, 8), float("-inf"))
    p[:, 0] = 0.0                        # all mass on output 0
    z = torch.randn(2, 8, requires_grad=True)
    t = _t.Teacher(k=2)
    t.put(0, p)
    loss = _t.kl_to_teacher(z, t.get(0))
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(z.grad).all()


def test_spilled_entries_come_back_equal_and_the_folder_goes(tmp_path):
    t = _t.Teacher(k=3, budget=0, spill_dir=str(tmp_path))
    ps = [_logp((2, 4), 9, s) for s in range(3)]
    for i, p in enumerate(ps):
        t.put(i, p)
    assert t.bytes_memory == 0 and t.bytes_disk > 0
    folder = t.spill_folder
    assert os.path.dirname(folder) == str(tmp_path) and os.listdir(folder)
    ref = _t.Teacher(k=3)
    for i, p in enumerate(ps):
        ref.put(i, p)
        for a, b in zip(t.get(i), ref.get(i)):
            assert torch.equal(a, b)
    t.close()
    assert not os.path.exists(folder)
    # dropped without close: removed when collected
    t2 = _t.Teacher(budget=0, spill_dir=str(tmp_path))
    t2.put(0, ps[0])
    folder2 = t2.spill_folder
    del t2
    gc.collect()
    assert not os.path.exists(folder2)


def test_a_budget_keeps_the_first_batches_in_memory(tmp_path):
    p = _logp((2, 4), 5, 0)
    size = p.numel() * 4
    t = _t.Teacher(budget=2 * size, spill_dir=str(tmp_path))
    for i in range(4):
        t.put(i, p)
    assert t.bytes_memory == 2 * size and t.bytes_disk == 2 * size
    t.close()


def test_bad_teacher_settings_are_refused():
    with pytest.raises(bico.BicoError, match="teacher_k"):
        _t.Teacher(k=0)
    t = _t.Teacher()
    t.put(0, _logp((2,), 5, 0))
    with pytest.raises(bico.BicoError, match="outputs"):
        t.put(1, _logp((2,), 6, 0))


class Net(nn.Module):
    def __init__(self, seed, d=6, h=8, c=5):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, c)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def test_adapter_cold_start_changes_nothing_and_warm_start_is_the_update():
    net = Net(0)
    x = torch.randn(7, 6)
    before = net(x).detach()
    ad = D.Adapter(net, ["fc1", "fc2"], r=2, alpha=4)
    assert torch.allclose(net(x), before)
    assert all(not p.requires_grad for p in net.parameters())
    ad.remove()
    g = torch.Generator().manual_seed(5)
    pairs = {"fc1": (torch.randn(8, 2, generator=g),
                     torch.randn(2, 6, generator=g))}
    ad = D.Adapter(net, ["fc1"], r=2, alpha=4, init=pairs)
    got = net(x)
    ref = Net(0)
    with torch.no_grad():
        ref.fc1.weight += pairs["fc1"][0] @ pairs["fc1"][1]
    assert torch.allclose(got, ref(x), atol=1e-5)
    upd = ad.update("fc1")
    assert torch.allclose(upd.float(), pairs["fc1"][0] @ pairs["fc1"][1],
                          atol=1e-5)
    ad.remove()
    assert torch.allclose(net(x), before)
    assert all(p.requires_grad for p in net.parameters())


def test_adapter_refuses_what_is_not_a_linear_and_bad_pairs():
    net = Net(0)
    with pytest.raises(bico.BicoError, match="not an nn.Linear"):
        D.Adapter(net, ["fc9"], r=2)
    with pytest.raises(bico.BicoError, match="warm-start pair"):
        D.Adapter(net, ["fc1"], r=2,
                  init={"fc1": (torch.zeros(8, 3), torch.zeros(3, 6))})
    with pytest.raises(bico.BicoError, match="rank"):
        D.Adapter(net, ["fc1"], r=0)


def _planted(rank=2, seed=0):
    """B, and A_ft = A + a rank-`rank` update of fc1 with A = B: the
    teacher z_B + z_A_ft - z_A is exactly the planted student."""
    b = Net(seed)
    a = Net(seed)
    aft = Net(seed)
    g = torch.Generator().manual_seed(seed + 1)
    delta = torch.randn(8, rank, generator=g) @ torch.randn(
        rank, 6, generator=g)
    with torch.no_grad():
        aft.fc1.weight += delta
    return a, aft, b, delta


def test_lora_distillation_recovers_a_planted_low_rank_update():
    a, aft, b, delta = _planted()
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(32, 6, generator=g) for _ in range(8)]
    held = [torch.randn(32, 6, generator=g) for _ in range(2)]
    t = _t.build_teacher(a, aft, b, xs, lambda m, x: m(x))
    th = _t.build_teacher(a, aft, b, held, lambda m, x: m(x))

    def held_losses(m):
        with torch.no_grad():
            return [float(_t.kl_to_teacher(m(x), th.get(i)))
                    for i, x in enumerate(held)]
    start = held_losses(b)
    ad = D.Adapter(b, ["fc1"], r=2, seed=1)
    step, losses = D.distill(b, t, xs, len(held), held_losses, adapter=ad,
                             training=D.Training(steps=1500, lr=2e-2,
                                                 every=50))
    assert step > 0 and losses[step] < 1e-3 * sum(start) / len(start)
    # the function of the planted student: logits equal on new inputs
    x = torch.randn(64, 6, generator=g)
    with torch.no_grad():
        assert (b(x) - aft(x)).abs().max() < 0.05


def test_a_teacher_that_only_hurts_leaves_the_target_untouched():
    b = Net(0)
    a, aft = Net(1), Net(2)          # unrelated pair: a harmful teacher
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, 6, generator=g) for _ in range(4)]
    held = [(torch.randn(16, 6, generator=g),
             torch.randint(0, 5, (16,), generator=g)) for _ in range(4)]
    # the held-out labels are what the untouched target predicts
    with torch.no_grad():
        held = [(x, b(x).argmax(-1)) for x, _ in held]
    w0 = {k: v.clone() for k, v in b.state_dict().items()}
    t = _t.build_teacher(a, aft, b, xs, lambda m, x: m(x))

    def held_losses(m):
        with torch.no_grad():
            return [float(F.cross_entropy(m(x), y)) for x, y in held]
    params = [p for p in b.parameters()]
    rep = []
    step, _ = D.distill(b, t, xs, 4, held_losses, params=params,
                        training=D.Training(steps=200, lr=1e-2, every=20),
                        report=rep)
    assert step == 0 and rep[0]["step"] == 0
    for k, v in b.state_dict().items():
        assert torch.equal(v, w0[k])


def test_patience_stops_when_the_held_out_loss_stops_improving():
    """A harmful teacher: no check ever beats the untouched target, so
    with patience 3 training stops after three checks (60 steps of 200),
    keeping the untouched target; without patience every step runs.  A
    check that improves resets the count (a planted sequence of held-out
    losses)."""
    b = Net(0)
    a, aft = Net(1), Net(2)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, 6, generator=g) for _ in range(4)]
    t = _t.build_teacher(a, aft, b, xs, lambda m, x: m(x))
    params = [p for p in b.parameters()]
    rep = []
    D.distill(b, t, xs, 1, lambda m: [1.0], params=params,
              training=D.Training(steps=200, lr=1e-2, every=20, patience=3),
              report=rep)
    assert rep[0]["steps_run"] == 60 and rep[0]["step"] == 0
    rep = []
    D.distill(b, t, xs, 1, lambda m: [1.0], params=params,
              training=D.Training(steps=200, lr=1e-2, every=20), report=rep)
    assert rep[0]["steps_run"] == 200
    seq = iter([5.0, 4.0, 4.5, 3.0, 3.5, 3.6, 3.7, 0.1])
    rep = []
    D.distill(b, t, xs, 1, lambda m: [next(seq)], params=params,
              training=D.Training(steps=200, lr=1e-2, every=20, patience=3),
              report=rep)
    # checks at 20 (4.0 best), 40 (4.5), 60 (3.0 best), 80, 100, 120: stop
    assert rep[0]["steps_run"] == 120 and rep[0]["step"] == 60
    with pytest.raises(BicoError, match="patience"):
        D.distill(b, t, xs, 1, lambda m: [1.0], params=params,
                  training=D.Training(patience=0))


def test_ema_keeps_the_moving_average_of_the_same_trajectory():
    """Training(ema=d): the steps train the same weights as without it
    (the average only watches), and the state kept at a check is the
    average d * avg + (1 - d) * weights after each step from zero,
    divided by 1 - d^step, computed here from the weights a run without
    it went through; the held-out losses are the average's.  Bad decays
    are refused."""
    a, aft, b0, _ = _planted()
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(32, 6, generator=g) for _ in range(4)]
    t = _t.build_teacher(a, aft, b0, xs, lambda m, x: m(x))
    d, steps = 0.9, 30
    runs = {}
    for ema in (None, d):
        b = copy.deepcopy(b0)
        ad = D.Adapter(b, ["fc1"], r=2, seed=1)
        seen = []

        def progress(i, n, v, ad=ad, seen=seen):
            seen.append([p.detach().clone() for p in ad.parameters()])
        # the held-out loss falls with the step count: the last check wins
        checks = iter([5.0, 2.0, 1.0])
        step, _ = D.distill(b, t, xs, 1, lambda m: [next(checks)],
                            adapter=ad, progress=progress,
                            training=D.Training(steps=steps, lr=1e-2,
                                                every=15, ema=ema))
        assert step == steps
        runs[ema] = ([p.detach().clone() for p in ad.parameters()], seen)
    plain, ema_run = runs[None], runs[d]
    for u, v in zip(plain[1], ema_run[1]):        # the same trajectory
        for x, y in zip(u, v):
            assert torch.allclose(x, y, atol=1e-6)
    avg = [torch.zeros_like(p) for p in ema_run[0]]
    for w in plain[1]:
        avg = [d * m + (1 - d) * x for m, x in zip(avg, w)]
    # from zero, divided by 1 - d^steps: the weights' own average, the
    # start not in it (a constant trajectory would be kept as it is)
    for x, y in zip(ema_run[0], avg):
        assert torch.allclose(x, y / (1 - d ** steps), atol=1e-6)
    assert not all(torch.allclose(x, y, atol=1e-4)
                   for x, y in zip(ema_run[0], plain[0]))
    # a short run at a slow decay keeps what it learnt: an average of the
    # steps' weights (an average from the start would hold 0.99^20 = 82 %
    # of the untouched factors)
    b = copy.deepcopy(b0)
    ad = D.Adapter(b, ["fc1"], r=2, seed=1)
    ref = copy.deepcopy(b0)
    ad_ref = D.Adapter(ref, ["fc1"], r=2, seed=1)
    for model, adapter, ema in ((b, ad, 0.99), (ref, ad_ref, None)):
        checks = iter([5.0, 1.0])
        D.distill(model, t, xs, 1, lambda m: [next(checks)], adapter=adapter,
                  training=D.Training(steps=20, lr=1e-2, every=20, ema=ema))
    kept, live = ad.factors["fc1"][0], ad_ref.factors["fc1"][0]  # B
    assert float(kept.norm()) > 0.3 * float(live.norm()) > 0
    for bad in (0, 1, 1.5, -0.1, True, "0.9"):
        with pytest.raises(BicoError, match="ema"):
            D.distill(b0, t, xs, 1, lambda m: [1.0],
                      params=list(b0.parameters()),
                      training=D.Training(ema=bad))


class TinyLM(nn.Module):
    """A decoder in the Hugging Face layout: a body (`model`) giving
    hidden states and an `lm_head`."""

    def __init__(self, seed, V=37, d=8):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Embedding(V, d), nn.Linear(d, d),
                                   nn.Tanh())
        self.lm_head = nn.Linear(d, V, bias=False)

    def forward(self, x):
        return self.lm_head(self.model(x))


def test_chunked_loss_gives_the_whole_loss_and_gradients():
    a, aft, b = TinyLM(0), TinyLM(1), TinyLM(2)
    x = torch.randint(0, 37, (3, 11), generator=torch.Generator()
                      .manual_seed(0))
    p = _t._teacher_logprobs((a, aft, b), x, None, 5)      # chunked
    with torch.no_grad():
        want = torch.log_softmax(b(x) + aft(x) - a(x), -1)
    assert torch.allclose(p, want, atol=1e-5)
    for k in (None, 7):
        t = _t.Teacher(k=k)
        t.put(0, p)
        e = t.get(0)
        b.zero_grad()
        whole = _t.kl_to_teacher(b(x), e)
        whole.backward()
        g1 = [q.grad.clone() for q in b.parameters()]
        b.zero_grad()
        got = D._student_loss(b, x, e, None, 4)
        g2 = [q.grad.clone() for q in b.parameters()]
        assert abs(got - float(whole)) < 1e-5
        for u, v in zip(g1, g2):
            assert torch.allclose(u, v, atol=1e-5)


def test_distill_refuses_bad_options():
    b = Net(0)
    t = _t.Teacher()
    t.put(0, torch.log_softmax(torch.randn(2, 5), -1))
    xs = [torch.randn(2, 6)]
    ps = list(b.parameters())
    for kw, msg in ((dict(steps=0), "steps"), (dict(every=0), "every"),
                    (dict(lr=float("nan")), "lr"), (dict(lr=-1.0), "lr")):
        with pytest.raises(bico.BicoError, match=msg):
            D.distill(b, t, xs, 1, lambda m: [0.0], params=ps,
                      training=D.Training(**kw))
    with pytest.raises(bico.BicoError, match="params"):
        D.distill(b, t, xs, 1, lambda m: [0.0])
    with pytest.raises(bico.BicoError, match="teacher entries"):
        D.distill(b, t, xs + xs, 1, lambda m: [0.0], params=ps)


def test_checkpointed_layers_give_the_same_gradients(tmp_path):
    """Gradient checkpointing of a Hugging Face decoder's layers (keyword
    arguments, a tied head), LoRA factors the only trainable tensors, a
    chunked loss with the text's own tokens: the same loss and factor
    gradients as without."""
    import llm_pair
    import bico.llm as bl
    llm_pair.write_model(str(tmp_path / "B"), llm_pair.CFG_B,
                         llm_pair.target_of(llm_pair.source()))
    m = bl.load_model(tmp_path / "B", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, llm_pair.V, (2, 12), generator=g)
    y = torch.randint(0, llm_pair.V, (2, 12), generator=g)
    t = _t.Teacher(k=8)
    t.put(0, torch.log_softmax(torch.randn(2, 12, llm_pair.V,
                                           generator=g), -1))
    names = [n for n, mm in m.named_modules()
             if isinstance(mm, nn.Linear) and n != "lm_head"]
    ad = D.Adapter(m, names, 2, seed=3)
    with torch.no_grad():
        for b, _ in ad.factors.values():
            b.normal_(0, 0.1, generator=g)
    grads = []
    for on in (False, True):
        for p in ad.parameters():
            p.grad = None
            p.requires_grad_(True)
        with D._Checkpointed(m, on) as c:
            assert len(c.layers) == (llm_pair.CFG_B["num_hidden_layers"]
                                     if on else 0)
            v = D._student_loss(m, x, t.get(0), None, 5, y, 0.5)
        grads.append((v, [p.grad.clone() for p in ad.parameters()]))
    assert abs(grads[0][0] - grads[1][0]) < 1e-6
    for u, w in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(u, w, atol=1e-6)
    # the layers' own forward is back
    assert all("forward" not in vars(layer) for layer in m.model.layers)


def test_chunks_shrink_with_the_vocabulary_and_change_nothing():
    """A head of V outputs gets chunks whose float32 logits stay under
    LOGIT_BYTES (55 tokens at 151 936 outputs; the whole TOKEN_CHUNK at
    256), and the chunked per-window losses equal a direct computation."""
    assert _lg._bounded(1024, nn.Linear(8, 151936, bias=False)) == \
        _lg.LOGIT_BYTES // (4 * 151936)
    assert 4 * 151936 * _lg._bounded(1024, nn.Linear(8, 151936)) <= \
        _lg.LOGIT_BYTES
    assert _lg._bounded(1024, nn.Linear(8, 256, bias=False)) == 1024
    assert _lg._bounded(1024, nn.Identity()) == 1024

    class LM(nn.Module):
        def __init__(self, v):
            super().__init__()
            self.model = nn.Embedding(v, 4)
            self.lm_head = nn.Linear(4, v, bias=False)

        def forward(self, x):
            return self.lm_head(self.model(x))
    g = torch.Generator().manual_seed(5)
    v = 70000                      # 119 tokens a chunk: 6 chunks below
    m = LM(v)
    assert _lg._bounded(_lg.TOKEN_CHUNK, m.lm_head) == \
        _lg.LOGIT_BYTES // (4 * v) < 600
    x = torch.randint(0, v, (3, 200), generator=g)
    y = torch.randint(0, v, (3, 200), generator=g)
    got = D.window_losses(m, [(x, y)])
    with torch.no_grad():
        want = F.cross_entropy(m(x).double().reshape(-1, v), y.reshape(-1),
                               reduction="none").reshape(3, 200).mean(-1)
    assert max(abs(a - b) for a, b in zip(got, want.tolist())) < 1e-5


# ---- transfer_model's route: the augmentation and the update's scale ----

def _same_samples(shape, seed):
    """A batch whose samples are all one random sample: mixup of it is
    the sample itself, whatever the mixing weights."""
    g = torch.Generator().manual_seed(seed)
    one = torch.randn(1, *shape[1:], generator=g)
    return one.expand(*shape).contiguous(), one


def test_auto_augment_shifts_images_only():
    """distill_augment="auto": a floating batch of 4 dimensions ([N, C, H,
    W]) is mixed and rolled by at most 2 pixels along H and W; a floating
    batch of 3 dimensions (sequences of features) is mixed only; token
    ids are not augmented.  Checked on batches of one repeated sample,
    where mixing changes nothing and the roll is visible."""
    img, one = _same_samples((6, 2, 9, 11), 0)
    rolls = [torch.roll(one, (dy, dx), (-2, -1))
             for dy in range(-2, 3) for dx in range(-2, 3)]
    moved = 0
    for seed in range(20):
        out = _aug.auto_augment((img, None))((img, None),
                                          torch.Generator().manual_seed(seed))
        x = out[0]
        assert x.shape == img.shape and out[1] is None
        hit = [r for r in rolls if torch.allclose(x, r.expand_as(x),
                                                  atol=1e-6)]
        assert len(hit) >= 1, "not a roll of the sample by <= 2 pixels"
        moved += not torch.allclose(x, img, atol=1e-6)
    assert moved > 0          # some draws do shift
    seq, _ = _same_samples((6, 5, 7), 1)
    for seed in range(5):
        x = _aug.auto_augment(seq)(seq, torch.Generator().manual_seed(seed))
        assert torch.allclose(x, seq, atol=1e-6)
    # mixup does mix distinct samples: every output is within the convex
    # hull's box of the batch, and not all equal to the inputs
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(8, 5, 7, generator=g)
    x = _aug.auto_augment(feats)(feats, torch.Generator().manual_seed(3))
    assert not torch.allclose(x, feats)
    assert (x <= feats.max(0).values + 1e-6).all()
    assert (x >= feats.min(0).values - 1e-6).all()
    ids = torch.randint(0, 10, (4, 6), generator=g)
    assert _aug.auto_augment(ids) is None
    assert _aug.auto_augment(torch.randn(1, 3, 4, 4)) is None   # nothing to mix
    # "image": greyscale [N, H, W] batches are shifted too
    grey, one = _same_samples((6, 9, 11), 4)
    rolls = [torch.roll(one, (dy, dx), (-2, -1))
             for dy in range(-2, 3) for dx in range(-2, 3)]
    outs = [_aug._augmentation("image", grey)(
        grey, torch.Generator().manual_seed(s)) for s in range(20)]
    assert all(any(torch.allclose(x, r.expand_as(x), atol=1e-6)
                   for r in rolls) for x in outs)
    assert any(not torch.allclose(x, grey, atol=1e-6) for x in outs)


def test_cutmix_pastes_one_box_of_another_sample():
    """cutmix: in every sample the changed pixels lie in one box, the same
    for the whole batch, and inside it every pixel of sample i is the same
    pixel of one other sample j(i), j a permutation; outside it nothing
    moves.  Samples are distinct constants (k + 1 for sample k), so each
    pasted pixel names its donor."""
    n, c, H, W = 6, 2, 9, 11
    x = (torch.arange(n, dtype=torch.float32) + 1).view(n, 1, 1, 1) \
        .expand(n, c, H, W).contiguous()
    areas = []
    for seed in range(30):
        y = _aug.cutmix()((x, "labels"), torch.Generator().manual_seed(seed))
        assert y[1] == "labels"
        y = y[0]
        changed = (y != x).any(0).any(0)           # [H, W]
        if not changed.any():
            continue
        rows = changed.any(1).nonzero().flatten()
        cols = changed.any(0).nonzero().flatten()
        box = torch.zeros(H, W, dtype=torch.bool)
        box[rows.min():rows.max() + 1, cols.min():cols.max() + 1] = True
        inside = y[:, :, box]                      # [n, c, cells]
        donors = inside[:, 0, 0].round().long() - 1
        assert sorted(donors.tolist()) == list(range(n))   # a permutation
        assert torch.equal(inside, donors.view(n, 1, 1).float().add(1)
                           .expand_as(inside))
        assert torch.equal(y[:, :, ~box], x[:, :, ~box])
        # changed pixels fill the box (a sample that drew itself keeps
        # its pixels, others change all of them)
        assert torch.equal(changed, box) or (donors == torch.arange(n)).all()
        areas.append(int(box.sum()))
    assert len(areas) >= 20 and len(set(areas)) > 3   # boxes of many sizes
    assert max(areas) <= H * W


def test_one_of_draws_each_augmentation():
    """one_of: every call applies exactly one of its augmentations, each
    drawn over calls, reproducibly for a given generator."""
    add = [lambda b, g, k=k: b + k for k in (10.0, 20.0, 30.0)]
    aug = _aug.one_of(*add)
    x = torch.zeros(3)
    got = [float(aug(x, torch.Generator().manual_seed(s))[0])
           for s in range(60)]
    assert set(got) == {10.0, 20.0, 30.0}
    again = [float(aug(x, torch.Generator().manual_seed(s))[0])
             for s in range(60)]
    assert got == again


def test_image_augment_is_mixup_or_cutmix_then_a_shift():
    """"image" on greyscale [N, H, W] batches: for batches of one repeated
    sample (mixing and pasting change nothing) a roll by at most 2 pixels;
    for distinct constant samples, some draws paste boxes (values of one
    sample exactly, in part of the image) and some mix (values between
    samples' constants): both augmentations are used."""
    grey, one = _same_samples((6, 9, 11), 5)
    rolls = [torch.roll(one, (dy, dx), (-2, -1))
             for dy in range(-2, 3) for dx in range(-2, 3)]
    for s in range(10):
        y = _aug._augmentation("image", grey)(grey,
                                           torch.Generator().manual_seed(s))
        assert any(torch.allclose(y, r.expand_as(y), atol=1e-6)
                   for r in rolls)
    x = (torch.arange(6, dtype=torch.float32) + 1).view(6, 1, 1) \
        .expand(6, 9, 11).contiguous()
    kinds = set()
    for s in range(40):
        torch.manual_seed(s)
        y = _aug.image_augment()(x, torch.Generator().manual_seed(s))
        whole = torch.isclose(y, y.round()).all()
        kinds.add("cut" if whole else "mix")
    assert kinds == {"cut", "mix"}


def test_bad_augmentations_are_refused():
    b = Net(0)
    xs = [torch.randn(4, 6) for _ in range(4)]
    for bad in ("mixp", "", 3, ["mixup"]):
        with pytest.raises(bico.BicoError, match="distill_augment"):
            D.distill_model(Net(1), Net(2), b, xs[:3], xs[3:],
                            lambda m, x: m(x), None, steps=1,
                            augment=bad)


class _WithCount(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("count", torch.tensor(7, dtype=torch.long))


def test_choose_scale_finds_the_planted_scale_and_keeps_one_otherwise():
    """choose_scale moves the model to base + s (model - base) for the
    scale s of least held-out loss: a loss whose minimum is planted at
    1.25 x the update gives 1.25 and those weights; one at the update
    itself keeps the model bit for bit; a gain within its standard error
    over two batches does not move it; integer buffers stay the
    model's."""
    torch.manual_seed(0)
    m = _WithCount()
    base = {k: v.clone() for k, v in m.state_dict().items()}
    base["count"] = torch.tensor(0, dtype=torch.long)
    d = {k: torch.randn_like(v) for k, v in base.items()
         if v.is_floating_point()}
    with torch.no_grad():
        m.lin.weight.add_(d["lin.weight"])
        m.lin.bias.add_(d["lin.bias"])
    trained = {k: v.clone() for k, v in m.state_dict().items()}

    def planted(s):
        want = base["lin.weight"].double() + s * d["lin.weight"].double()

        def per(model):
            return [float(((model.lin.weight.double() - want) ** 2).sum())]
        return per
    s, losses = D.choose_scale(m, base, planted(1.25))
    assert s == 1.25 and set(losses) == {0.75, 1.0, 1.25, 1.5}
    assert losses[1.25] == min(losses.values())
    want = base["lin.weight"] + 1.25 * d["lin.weight"]
    assert torch.allclose(m.lin.weight, want, atol=1e-6)
    assert torch.allclose(m.lin.bias, base["lin.bias"] +
                          1.25 * d["lin.bias"], atol=1e-6)
    assert int(m.count) == 7

    m.load_state_dict(trained)
    s, _ = D.choose_scale(m, base, planted(1.0))
    assert s == 1.0
    for k, v in m.state_dict().items():
        assert torch.equal(v, trained[k])

    # two batches: 1.5 gains on one and loses almost as much on the other
    def noisy(model):
        w = float(model.lin.weight[0, 0] - base["lin.weight"][0, 0])
        s_ = w / float(d["lin.weight"][0, 0])
        return [1.0 - 0.1 * s_, 1.0 + 0.1 * s_ - 0.01 * s_ * s_]
    s, losses = D.choose_scale(m, base, noisy)
    assert min(losses, key=losses.get) != 1.0 and s == 1.0
    for k, v in m.state_dict().items():
        assert torch.equal(v, trained[k])


def test_distill_model_reports_and_returns_the_chosen_scale():
    """distill_model: the state returned has the held-out loss that its
    report gives for the chosen scale, no more than the trained step's;
    scales=() returns the trained state."""
    b = Net(0)
    a, aft = Net(1), Net(2)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(16, 6, generator=g) for _ in range(3)]
    held = [(torch.randn(16, 6, generator=g), None)]
    with torch.no_grad():   # labels: what the proxy-tuned teacher says
        held = [(x, (b(x) + aft(x) - a(x)).argmax(-1)) for x, _ in held]

    def loss(m, batch):
        x, y = batch
        with torch.no_grad():
            return float(F.cross_entropy(m(x), y))
    fwd = (lambda m, x: m(x[0]) if isinstance(x, tuple) else m(x))
    rep = []
    sd = D.distill_model(a, aft, b, xs, held, fwd, loss, steps=60, lr=1e-2,
                         every=20, augment=None, report=rep)
    r = rep[-1]
    assert r["step"] > 0 and r["scale"] in D.SCALES
    m = Net(0)
    m.load_state_dict(sd)
    got = loss(m, held[0])
    assert abs(got - r["scale_losses"][r["scale"]]) < 1e-5
    assert got <= r["losses"][r["step"]] + 1e-6
    rep2 = []
    sd2 = D.distill_model(a, aft, b, xs, held, fwd, loss, steps=60, lr=1e-2,
                          every=20, augment=None, report=rep2, scales=())
    assert rep2[-1]["scale"] == 1.0 and rep2[-1]["scale_losses"] == {}
    m.load_state_dict(sd2)
    assert abs(loss(m, held[0]) - rep2[-1]["losses"][rep2[-1]["step"]]) \
        < 1e-5
