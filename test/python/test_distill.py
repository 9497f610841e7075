"""bico.torch.distill: the teacher's compact form, the LoRA factors on
frozen layers, the chunked loss and the held-out choice, each against an
independent computation or a planted answer."""
import gc
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bico
from bico.torch import distill as D

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
    assert abs(float(D.kl_to_teacher(z, p)) - float(want)) < 1e-6


def test_kl_top_k_is_the_kl_of_the_coarsened_distributions():
    V, k = 13, 4
    p = _logp((3, 7), V, 2)
    z = torch.randn(3, 7, V, generator=torch.Generator().manual_seed(3))
    t = D.Teacher(k=k)
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
    assert abs(float(D.kl_to_teacher(z, entry)) - tot / 21) < 1e-5
    # the coarsened KL never exceeds the full one (data processing)
    assert float(D.kl_to_teacher(z, entry)) <= \
        float(D.kl_to_teacher(z, p)) + 1e-6


def test_k_at_least_the_outputs_keeps_everything():
    p = _logp((2, 3), 6, 4)
    for k in (6, 10, None):
        t = D.Teacher(k=k)
        t.put(0, p)
        assert torch.equal(t.get(0), p)


def test_a_teacher_that_puts_no_mass_outside_the_top_k_gives_no_nan():
    p = torch.full((2, 8), float("-inf"))
    p[:, 0] = 0.0                        # all mass on output 0
    z = torch.randn(2, 8, requires_grad=True)
    t = D.Teacher(k=2)
    t.put(0, p)
    loss = D.kl_to_teacher(z, t.get(0))
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(z.grad).all()


def test_spilled_entries_come_back_equal_and_the_folder_goes(tmp_path):
    t = D.Teacher(k=3, budget=0, spill_dir=str(tmp_path))
    ps = [_logp((2, 4), 9, s) for s in range(3)]
    for i, p in enumerate(ps):
        t.put(i, p)
    assert t.bytes_memory == 0 and t.bytes_disk > 0
    folder = t.spill_folder
    assert os.path.dirname(folder) == str(tmp_path) and os.listdir(folder)
    ref = D.Teacher(k=3)
    for i, p in enumerate(ps):
        ref.put(i, p)
        for a, b in zip(t.get(i), ref.get(i)):
            assert torch.equal(a, b)
    t.close()
    assert not os.path.exists(folder)
    # dropped without close: removed when collected
    t2 = D.Teacher(budget=0, spill_dir=str(tmp_path))
    t2.put(0, ps[0])
    folder2 = t2.spill_folder
    del t2
    gc.collect()
    assert not os.path.exists(folder2)


def test_a_budget_keeps_the_first_batches_in_memory(tmp_path):
    p = _logp((2, 4), 5, 0)
    size = p.numel() * 4
    t = D.Teacher(budget=2 * size, spill_dir=str(tmp_path))
    for i in range(4):
        t.put(i, p)
    assert t.bytes_memory == 2 * size and t.bytes_disk == 2 * size
    t.close()


def test_bad_teacher_settings_are_refused():
    with pytest.raises(bico.BicoError, match="teacher_k"):
        D.Teacher(k=0)
    t = D.Teacher()
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
    t = D.build_teacher(a, aft, b, xs, lambda m, x: m(x))
    th = D.build_teacher(a, aft, b, held, lambda m, x: m(x))

    def held_losses(m):
        with torch.no_grad():
            return [float(D.kl_to_teacher(m(x), th.get(i)))
                    for i, x in enumerate(held)]
    start = held_losses(b)
    ad = D.Adapter(b, ["fc1"], r=2, seed=1)
    step, losses = D.distill(b, t, xs, len(held), held_losses, adapter=ad,
                             steps=1500, lr=2e-2, every=50)
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
    t = D.build_teacher(a, aft, b, xs, lambda m, x: m(x))

    def held_losses(m):
        with torch.no_grad():
            return [float(F.cross_entropy(m(x), y)) for x, y in held]
    params = [p for p in b.parameters()]
    rep = []
    step, _ = D.distill(b, t, xs, 4, held_losses, params=params, steps=200,
                        lr=1e-2, every=20, report=rep)
    assert step == 0 and rep[0]["step"] == 0
    for k, v in b.state_dict().items():
        assert torch.equal(v, w0[k])


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
    p = D._teacher_logprobs((a, aft, b), x, None, 5)      # chunked
    with torch.no_grad():
        want = torch.log_softmax(b(x) + aft(x) - a(x), -1)
    assert torch.allclose(p, want, atol=1e-5)
    for k in (None, 7):
        t = D.Teacher(k=k)
        t.put(0, p)
        e = t.get(0)
        b.zero_grad()
        whole = D.kl_to_teacher(b(x), e)
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
    t = D.Teacher()
    t.put(0, torch.log_softmax(torch.randn(2, 5), -1))
    xs = [torch.randn(2, 6)]
    ps = list(b.parameters())
    for kw, msg in ((dict(steps=0), "steps"), (dict(every=0), "every"),
                    (dict(lr=float("nan")), "lr"), (dict(lr=-1.0), "lr")):
        with pytest.raises(bico.BicoError, match=msg):
            D.distill(b, t, xs, 1, lambda m: [0.0], params=ps, **kw)
    with pytest.raises(bico.BicoError, match="params"):
        D.distill(b, t, xs, 1, lambda m: [0.0])
    with pytest.raises(bico.BicoError, match="teacher entries"):
        D.distill(b, t, xs + xs, 1, lambda m: [0.0], params=ps)


def test_checkpointed_layers_give_the_same_gradients(tmp_path):
    """Gradient checkpointing of a Hugging Face decoder's layers (keyword
    arguments, a tied head), LoRA factors the only trainable tensors, a
    chunked loss with the text's own tokens: the same loss and factor
    gradients as without."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
    import llm_pair
    import bico.torch as bt
    llm_pair.write_model(str(tmp_path / "B"), llm_pair.CFG_B,
                         llm_pair.target_of(llm_pair.source()))
    m = bt.load_model(tmp_path / "B", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, llm_pair.V, (2, 12), generator=g)
    y = torch.randint(0, llm_pair.V, (2, 12), generator=g)
    t = D.Teacher(k=8)
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
    LOGIT_BYTES (110 tokens at 151 936 outputs; the whole TOKEN_CHUNK at
    256), and the chunked per-window losses equal a direct computation."""
    assert D._bounded(1024, nn.Linear(8, 151936, bias=False)) == 110
    assert D._bounded(1024, nn.Linear(8, 256, bias=False)) == 1024
    assert D._bounded(1024, nn.Identity()) == 1024

    class LM(nn.Module):
        def __init__(self, v):
            super().__init__()
            self.model = nn.Embedding(v, 4)
            self.lm_head = nn.Linear(4, v, bias=False)

        def forward(self, x):
            return self.lm_head(self.model(x))
    g = torch.Generator().manual_seed(5)
    v = 70000                      # 239 tokens a chunk: 3 chunks below
    m = LM(v)
    assert D._bounded(D.TOKEN_CHUNK, m.lm_head) == 239
    x = torch.randint(0, v, (3, 200), generator=g)
    y = torch.randint(0, v, (3, 200), generator=g)
    got = D.window_losses(m, [(x, y)])
    with torch.no_grad():
        want = F.cross_entropy(m(x).double().reshape(-1, v), y.reshape(-1),
                               reduction="none").reshape(3, 200).mean(-1)
    assert max(abs(a - b) for a, b in zip(got, want.tolist())) < 1e-5
