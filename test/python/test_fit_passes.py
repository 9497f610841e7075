"""The cost of transfer_model(method="fit") (issue 23, "Cost at scale"):
layers that read one input (q/k/v, gate/up) share one forward pass of the
working target, with the same result; the Fits run at the caller's thread
count; the rank is computed only when a report asks for it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bico
import bico.fit as bfit
import bico.torch as bt
import bico.torch.fit as tf  # the fit's host: patched where it is looked up
from test_binding_models import float32_default  # noqa: F401
from test_hf_decoder import CFG, HEAD, calibration, ce, planted

torch.set_num_threads(1)

N_BLOCKS = CFG["num_hidden_layers"]


def counted(monkeypatch, share):
    """Patches fit_model to share passes or not, and _Runner.run to count
    the forward passes; returns the list of (model id, segment) runs."""
    runs = []
    run = tf._Runner.run

    def counting(self, segment, *a, **kw):
        runs.append((id(self.model), segment))
        return run(self, segment, *a, **kw)
    fit_model = tf.fit_model

    def patched(*a, **kw):
        kw["share_passes"] = share
        return fit_model(*a, **kw)
    monkeypatch.setattr(tf._Runner, "run", counting)
    monkeypatch.setattr(tf, "fit_model", patched)
    return runs


def fit(model, data=None, report=None, **kw):
    a, aft, b, _ = model
    return bt.transfer_model(a, aft, b, data or calibration(), method="fit",
                             options=bt.FitOptions(alpha=1.0, **kw),
                             loss_fn=ce, report=report)


def test_shared_passes_same_update_fewer_passes(monkeypatch):
    """HF decoder layers (q/k/v read one normed input, gate/up another):
    the shared passes give the same state dict within float tolerance and
    3 passes fewer per block (q/k/v: 3 -> 1, gate/up: 2 -> 1)."""
    model = planted(__import__("test_hf_decoder").DecoderLayer)
    b0 = model[2].state_dict()
    got = {}
    counts = {}
    for share in (False, True):
        with monkeypatch.context() as mp:
            runs = counted(mp, share)
            got[share] = fit(model)
            counts[share] = len(runs)
    assert counts[False] - counts[True] == 3 * N_BLOCKS, counts
    moved = 0
    for k, v in got[False].items():
        if not v.is_floating_point():
            continue
        upd = float((v - b0[k]).abs().max())
        moved += upd > 0
        err = float((got[True][k] - v).abs().max())
        assert err <= 1e-5 * upd + 1e-7, (k, err, upd)
    assert moved > 0


class InPlace(nn.Module):
    """A block whose k reads the tensor q's output was added to in place:
    one object, but not one input; it must not share q's pass."""

    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, h):
        x = h * 1.0
        a = self.q(x)
        if torch.is_grad_enabled():  # the statistics' backward pass
            x = x + a
        else:  # the fit's passes (no_grad): one object, changed in place
            x += a
        return h + self.k(x) + self.v(x)


class Net(nn.Module):
    def __init__(self, d=6, depth=2):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(InPlace(d) for _ in range(depth))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def test_inplace_change_is_not_a_shared_input(monkeypatch):
    """k and v read one tensor (shared), q's input was that tensor before
    an in-place change (not shared): one pass saved per block, and the
    result is the unshared one."""
    torch.manual_seed(3)
    a, b = Net().eval(), Net().eval()
    aft = Net().eval()
    aft.load_state_dict({k: v + 0.1 * torch.randn_like(v)
                         for k, v in a.state_dict().items()})
    data = [(torch.randn(5, 7, 4), torch.randn(5, 7, 3)) for _ in range(3)]
    got, counts = {}, {}
    for share in (False, True):
        with monkeypatch.context() as mp:
            runs = counted(mp, share)
            got[share] = bt.transfer_model(a, aft, b, data, method="fit",
                                           options=bt.FitOptions(alpha=1.0),
                                           loss_fn=lambda o, y: F.mse_loss(o, y))
            counts[share] = len(runs)
    assert counts[False] - counts[True] == 2, counts
    for k, v in got[False].items():
        upd = float((v - b.state_dict()[k]).abs().max())
        assert float((got[True][k] - v).abs().max()) <= 1e-5 * upd + 1e-7, k


def recorded(monkeypatch):
    """Patches bico.fit.run (the driver fit_model hands its layers to) to
    record the threads of the context its fits are made in and whether it
    asks for the rank; and each update's rank as the driver gives it."""
    seen = {"threads": [], "rank": [], "ranks": []}
    run = bfit.run

    def rec(*a, **kw):
        seen["threads"].append(kw["ctx"].threads)
        seen["rank"].append(kw.get("want_rank", False))
        upd = a[3]

        def update(l, dw, db, rank):
            seen["ranks"].append(rank)
            return upd(l, dw, db, rank)
        return run(*(a[:3] + (update,) + a[4:]), **kw)
    monkeypatch.setattr(bfit, "run", rec)
    return seen


def test_fits_use_the_thread_count(monkeypatch):
    model = planted(__import__("test_hf_decoder").DecoderLayer)
    seen = recorded(monkeypatch)
    one = fit(model)
    default = bico.Context().threads
    assert seen["threads"] and set(seen["threads"]) == {default}
    seen["threads"].clear()
    two = fit(model, threads=2)
    assert seen["threads"] and set(seen["threads"]) == {2}
    for k, v in one.items():
        if v.is_floating_point():
            assert torch.allclose(two[k], v, rtol=1e-5, atol=1e-6), k
    with pytest.raises((bico.BicoError, ValueError)):
        fit(model, threads=0)


def test_rank_only_with_a_report(monkeypatch):
    model = planted(__import__("test_hf_decoder").DecoderLayer)
    seen = recorded(monkeypatch)
    fit(model)
    assert seen["rank"] and not any(seen["rank"])
    assert seen["ranks"] and all(r is None for r in seen["ranks"])
    seen["rank"].clear()
    seen["ranks"].clear()
    rep = []
    fit(model, report=rep)
    assert seen["rank"] and all(seen["rank"])
    assert seen["ranks"] and all(isinstance(r, int) for r in seen["ranks"])
    fits = [e for e in rep if e.get("handling") == "fit"]
    assert fits and all(isinstance(e["rank"], int) and e["rank"] > 0
                        for e in fits)
    assert all(e["name"] != HEAD for e in fits)  # tied head carried


def test_working_copy_is_made_a_block_at_a_time(monkeypatch):
    """While block 0 is fitted, the working model's later blocks are still
    the target's own tensors (no second copy of them yet); the target is
    left untouched and the result shares no tensor with it."""
    model = planted(__import__("test_hf_decoder").DecoderLayer)
    b = model[2]
    before = {k: v.clone() for k, v in b.state_dict().items()}
    tgt = set(id(p) for p in b.parameters())
    seen = []
    run = tf._Runner.run

    def spy(self, segment, *a, **kw):
        if self.model is not b and segment == 0 and \
                self.model is not model[0] and self.model is not model[1]:
            later = [p for blk in list(self.blocks)[1:]
                     for p in blk.parameters()]
            first = list(self.blocks[0].parameters())
            seen.append((all(id(p) in tgt for p in later),
                         not any(id(p) in tgt for p in first)))
        return run(self, segment, *a, **kw)
    monkeypatch.setattr(tf._Runner, "run", spy)
    sd = fit(model)
    assert seen and all(s == (True, True) for s in seen), seen
    for k, v in b.state_dict().items():
        assert torch.equal(v, before[k]), k
    ptrs = set(p.data_ptr() for p in b.parameters())
    assert not any(v.data_ptr() in ptrs for v in sd.values())
