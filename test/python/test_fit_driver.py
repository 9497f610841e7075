"""fit_model (transfer_model(method="fit")) runs on the library's driver
(bico_fit_run through bico.fit.run, issue 25): checked against a plain
float64 torch computation of the same sequential fit, written here from
the definition (docs/fit.md) without the driver, the capture passes or
the segments; against a planted update; and an exception raised inside
a callback comes back as itself."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import bico
import bico.torch.fit as tf
from bico._names import Pairing

torch.set_num_threads(1)


class Block(nn.Module):
    """q and k read one input (a shared group); up reads their sum, down
    up's activation."""

    def __init__(self, d, h):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.q(x) + self.k(x))))


class Net(nn.Module):
    def __init__(self, d_in=7, d=6, h=8, d_out=4, depth=2):
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(depth))
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def forward(model, batch):
    return model(batch)


def linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def made(seed):
    torch.manual_seed(seed)
    return Net().eval()


def tuned(model, seed, scale):
    g = torch.Generator().manual_seed(seed)
    t = copy.deepcopy(model)
    with torch.no_grad():
        for p in t.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return t


def data(n_batches=3, rows=40, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 7, generator=g) for _ in range(n_batches)]


def io(model, batches, name):
    """(inputs, outputs) of module name over the batches, float64."""
    got = []
    h = model.get_submodule(name).register_forward_hook(
        lambda m, i, o: got.append((i[0].double(), o.double())))
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        h.remove()
    return (torch.cat([x for x, _ in got]), torch.cat([y for _, y in got]))


def reference(a, aft, b, batches, maps, alpha, c):
    """The sequential fit from its definition, in float64: for every
    linear in forward order, X' its input on the working copy (whole
    forward passes, the earlier layers updated), X_B on b, D = alpha
    (Y_aft - Y_a) R_out, and [dW db] solving (G + lambda P) Delta =
    X~'^T (X~_B Theta + D - X~' Theta), lambda = c tr(X'^T X') / d_in."""
    work = copy.deepcopy(b)
    for name in linears(b):
        xn, _ = io(work, batches, name)
        xb, _ = io(b, batches, name)
        _, ya = io(a, batches, name)
        _, yt = io(aft, batches, name)
        d = alpha * (yt - ya) @ torch.from_numpy(maps[name]["out"][0])
        lin = b.get_submodule(name)
        theta = torch.cat([lin.weight.double().T,
                           lin.bias.double()[None, :]])
        one = torch.ones(len(xn), 1, dtype=torch.float64)
        xt, xbt = torch.cat([xn, one], 1), torch.cat([xb, one], 1)
        n_in = xn.shape[1]
        lam = c * float(torch.trace(xn.T @ xn)) / n_in
        p = torch.eye(n_in + 1, dtype=torch.float64)
        p[n_in, n_in] = 0
        delta = torch.linalg.solve(xt.T @ xt + lam * p,
                                   xt.T @ (xbt @ theta + d - xt @ theta))
        wl = work.get_submodule(name)
        with torch.no_grad():
            wl.weight.copy_((theta[:n_in] + delta[:n_in]).T)
            wl.bias.copy_(theta[n_in] + delta[n_in])
    return work.state_dict()


def run_fit(a, aft, b, batches, maps, alpha, ridge, report=None, fwd=forward):
    pairing = Pairing(a.state_dict(), b.state_dict())
    return tf.fit_model(a, aft, b, batches, fwd, maps, pairing,
                        b.state_dict(), alpha, ridge, bico.Context(), report)


def random_maps(model, seed):
    rng = np.random.default_rng(seed)
    maps = {}
    for n in linears(model):
        k = model.get_submodule(n).out_features
        q, _ = np.linalg.qr(rng.standard_normal((k, k)))
        maps[n] = {"out": (q * rng.uniform(0.5, 1.5, k),)}
    return maps


@pytest.mark.parametrize("ridge", [0.0, 0.3])
def test_driver_matches_the_plain_sequential_fit(ridge):
    a, b = made(1), made(2)
    aft = tuned(a, 3, 0.05)
    batches = data()
    maps = random_maps(b, 4)
    rep = []
    got = run_fit(a, aft, b, batches, maps, 0.7, ridge, report=rep)
    want = reference(a, aft, b, batches, maps, 0.7, ridge)
    for k, v in want.items():
        upd = float((v - b.state_dict()[k].double()).abs().max())
        err = float((got[k].double() - v).abs().max())
        assert err <= 1e-4 * upd + 1e-6, (k, err, upd)
    # every linear, in forward order, with its rows and rank
    assert [e["name"] for e in rep] == linears(b)
    assert all(e["rows"] == 120 for e in rep)
    assert all(e["rank"] == b.get_submodule(e["name"]).in_features + 1
               for e in rep)


def test_driver_recovers_a_planted_update():
    """Source = target, tuned = target + U, R_out = I, no ridge: every
    layer's update is U's (the rows come from the updated target, so the
    later layers see the earlier ones' exact inputs)."""
    b = made(5)
    aft = tuned(b, 6, 0.05)
    maps = {n: {"out": (np.eye(b.get_submodule(n).out_features),)}
            for n in linears(b)}
    got = run_fit(b, aft, b, data(rows=60), maps, 1.0, 0.0)
    for k, v in aft.state_dict().items():
        u = v - b.state_dict()[k]
        assert float((got[k] - v).abs().max()) <= 1e-4 * float(
            u.abs().max()), k


def test_callback_exception_comes_back():
    """An exception in the model's forward, raised inside the driver's
    rows callback (C calling Python), stops the run and is raised again
    as itself after bico_fit_run returns."""
    b = made(8)
    aft = tuned(b, 9, 0.05)
    maps = {n: {"out": (np.eye(b.get_submodule(n).out_features),)}
            for n in linears(b)}

    class HostFailure(Exception):
        pass
    calls = []

    def failing(model, batch):
        calls.append(1)
        if len(calls) > 12:
            raise HostFailure("the host's forward failed")
        return model(batch)
    with pytest.raises(HostFailure, match="forward failed"):
        run_fit(b, aft, b, data(), maps, 1.0, 0.1, fwd=failing)
