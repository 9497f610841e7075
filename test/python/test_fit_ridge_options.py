"""The fit's regulariser options (issue 23): a ridge towards BiCo's update
(ridge_prior="bico"), a ridge chosen per layer by generalised
cross-validation (ridge="gcv") and a penalty in the metric of the layer's
inputs on general text (general_batches).  Planted answers and identities:
bico.torch.ridge.RidgeFit against bico.fit.Fit and against the normal equations
written out in NumPy; transfer_model's options against BiCo's update."""
import numpy as np
import pytest
import torch

import bico
import bico.torch as bt
from bico.fit import Fit
from bico.torch.ridge import RidgeFit
from test_binding_models import float32_default  # noqa: F401
from test_hf_decoder import (CFG, DecoderLayer, build, calibration, ce,
                             llama, planted, task)

torch.set_num_threads(1)


def problem(seed, n=60, d_in=12, d_out=5):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(d_out, d_in)).astype(np.float32)
    b = rng.normal(size=d_out).astype(np.float32)
    xn = rng.normal(size=(n, d_in)).astype(np.float32)
    xo = (xn + 0.1 * rng.normal(size=(n, d_in))).astype(np.float32)
    d = rng.normal(size=(n, d_out)).astype(np.float32)
    p0 = rng.normal(size=(d_out, d_in))
    return w, b, xn, xo, d, p0


@pytest.mark.parametrize("bias", [True, False])
def test_ridgefit_without_options_is_the_library_fit(bias):
    w, b, xn, xo, d, _ = problem(1)
    for c in (0.0, 1e-2, 3.0):
        f = Fit(12, 5, bias=bias, ridge=c)
        f.add(xn, xo, d)
        dw, db = f.solve(w, b if bias else None)
        r = RidgeFit(12, 5, w, b if bias else None, ridge=c)
        r.add(xn[:25], xo[:25], d[:25]).add(xn[25:], xo[25:], d[25:])
        dw2, db2 = r.solve()
        assert np.allclose(dw, dw2, atol=1e-4), c
        if bias:
            assert np.allclose(db, db2, atol=1e-4), c
        # the general-text metric M = s I is the plain ridge
        m = RidgeFit(12, 5, w, b if bias else None, ridge=c,
                     metric=7.0 * np.eye(12))
        m.add(xn, xo, d)
        assert np.allclose(m.solve()[0], dw2, atol=1e-4), c


def test_ridge_towards_a_prior_is_the_shifted_ridge_solution():
    """No bias: dW = P0 + (X'^T X' + lam I)^-1 X'^T (Y - X' P0^T) written
    out, Y = X_B W^T + D - X' W^T the output change asked of the layer."""
    w, _, xn, xo, d, p0 = problem(2)
    c = 0.3
    r = RidgeFit(12, 5, w, None, ridge=c, prior=p0)
    r.add(xn, xo, d)
    dw, _ = r.solve()
    x, x0 = xn.astype(np.float64), xo.astype(np.float64)
    y = x0 @ w.T.astype(np.float64) + d - x @ w.T.astype(np.float64)
    g = x.T @ x
    lam = c * np.trace(g) / 12
    want = p0 + np.linalg.solve(g + lam * np.eye(12), x.T @ (y - x @ p0.T)).T
    assert np.allclose(dw, want, atol=1e-4)
    # and it differs from the ridge towards zero (the prior matters)
    z = RidgeFit(12, 5, w, None, ridge=c)
    z.add(xn, xo, d)
    assert not np.allclose(z.solve()[0], dw, atol=1e-2)


@pytest.mark.parametrize("bias", [True, False])
def test_ridge_towards_a_prior_falls_back_to_it(bias):
    """No rows, or an infinite ridge: the weight update is the prior."""
    w, b, xn, xo, d, p0 = problem(3)
    bb = b if bias else None
    empty = RidgeFit(12, 5, w, bb, ridge=1e-2, prior=p0)
    dw, db = empty.solve()
    assert np.array_equal(dw, p0.astype(np.float32))
    assert db is None if not bias else not np.any(db)
    huge = RidgeFit(12, 5, w, bb, ridge=1e12, prior=p0)
    huge.add(xn, xo, d)
    dw, _ = huge.solve()
    assert np.allclose(dw, p0, atol=1e-6)
    # with GCV and no rows it is the prior too
    g = RidgeFit(12, 5, w, bb, ridge="gcv", prior=p0)
    assert np.array_equal(g.solve()[0], p0.astype(np.float32))


@pytest.mark.parametrize("c_true", [1e-3, 1e-1])
def test_gcv_picks_the_planted_ridge_order(c_true):
    """y = X beta + noise, beta ~ N(0, tau^2), noise ~ N(0, sigma^2): the
    best ridge is lambda = sigma^2 / tau^2, i.e. c = sigma^2 / (tau^2 n)
    for unit-variance inputs (tr(X^T X) / d_in ~ n).  GCV lands within a
    factor 10 of it, and the two planted orders are told apart."""
    rng = np.random.default_rng(4)
    n, d_in, d_out = 800, 40, 30
    sigma = np.sqrt(c_true * n)
    x = rng.normal(size=(n, d_in))
    beta = rng.normal(size=(d_out, d_in))
    y = x @ beta.T + sigma * rng.normal(size=(n, d_out))
    w = np.zeros((d_out, d_in), np.float32)
    r = RidgeFit(d_in, d_out, w, np.zeros(d_out, np.float32), ridge="gcv")
    r.add(x.astype(np.float32), x.astype(np.float32), y.astype(np.float32))
    r.solve()
    assert c_true / 10 <= r.chosen <= c_true * 10, (c_true, r.chosen)


def test_general_metric_keeps_general_outputs():
    """General-text inputs in a 3-dimensional subspace: the penalty in
    their metric changes the layer's outputs there far less than the
    identity ridge of the same c (less than half)."""
    w, b, xn, xo, d, _ = problem(5, n=200)
    rng = np.random.default_rng(6)
    xg = rng.normal(size=(300, 3)) @ rng.normal(size=(3, 12))
    for c in (1.0, 10.0):
        out = {}
        for name, m in (("identity", None), ("general", xg.T @ xg)):
            r = RidgeFit(12, 5, w, b, ridge=c, metric=m)
            r.add(xn, xo, d)
            out[name] = r.solve()[0]
        gen = {k: np.linalg.norm(xg @ v.T) for k, v in out.items()}
        assert gen["general"] < 0.5 * gen["identity"], (c, gen)


def test_bad_ridgefit_options_are_refused():
    w, b, _, _, _, _ = problem(7)
    with pytest.raises(bico.BicoError, match="ridge"):
        RidgeFit(12, 5, w, b, ridge="loo")
    with pytest.raises(bico.BicoError, match="metric"):
        RidgeFit(12, 5, w, b, metric=np.eye(11))
    with pytest.raises(bico.BicoError, match="trace"):
        RidgeFit(12, 5, w, b, metric=np.zeros((12, 12)))


def test_transfer_model_ridge_towards_bico_falls_back_to_bico():
    """method="fit", ridge_prior="bico" and a huge ridge: every fitted
    linear's weight is BiCo's (same statistics, same alpha); the default
    prior (zero) leaves the target's weight instead."""
    a, aft, b, _ = planted(DecoderLayer)
    b = build(CFG, llama.random_state(CFG, torch.Generator().manual_seed(8)))
    cal = calibration()
    rep = []
    fit = bt.transfer_model(a, aft, b, cal, method="fit",
                            options=bt.FitOptions(alpha=1.0, ridge=1e12,
                                                  ridge_prior="bico"),
                            loss_fn=ce, report=rep)
    zero = bt.transfer_model(a, aft, b, cal, method="fit",
                             options=bt.FitOptions(alpha=1.0, ridge=1e12),
                             loss_fn=ce)
    bico_sd = bt.transfer_model(a, aft, b, cal, method="bico",
                                options=bt.MapOptions(alpha=1.0), loss_fn=ce)
    names = [e["name"] for e in rep if e.get("handling") == "fit"]
    assert names
    base = b.state_dict()
    for n in names:
        k = n + ".weight"
        assert torch.allclose(fit[k], bico_sd[k], atol=1e-5), k
        assert torch.allclose(zero[k], base[k], atol=1e-5), k
        assert not torch.allclose(bico_sd[k], base[k], atol=1e-4), k


def test_transfer_model_gcv_and_general_batches_run_and_report():
    a, aft, b, _ = planted(DecoderLayer)
    cal = calibration()
    gen = [task(8, 900 + i) for i in range(2)]
    rep = []
    sd = bt.transfer_model(a, aft, b, cal, method="fit",
                           options=bt.FitOptions(alpha=1.0, ridge="gcv",
                                                 ridge_prior="bico",
                                                 general_batches=gen),
                           loss_fn=ce, report=rep)
    fits = [e for e in rep if e.get("handling") == "fit"]
    assert fits and all(e["ridge"] in bico.torch.ridge.GCV_GRID for e in fits)
    assert all(torch.isfinite(v).all() for v in sd.values()
               if v.is_floating_point())
    # the options' defaults are the plain fit
    plain = bt.transfer_model(a, aft, b, cal, method="fit",
                              options=bt.FitOptions(alpha=1.0, ridge=1e-2,
                                                    ridge_prior="zero",
                                                    general_batches=None),
                              loss_fn=ce)
    default = bt.transfer_model(a, aft, b, cal, method="fit",
                                options=bt.FitOptions(alpha=1.0), loss_fn=ce)
    for k in plain:
        assert torch.equal(plain[k], default[k]), k


def test_bad_fit_options_are_refused_naming_the_option():
    a, aft, b, _ = planted(DecoderLayer)
    cal = calibration()
    with pytest.raises(bico.BicoError, match="ridge_prior"):
        bt.transfer_model(a, aft, b, cal, method="fit",
                          options=bt.FitOptions(ridge_prior="source"),
                          loss_fn=ce)
    # a fit's option given to another method: refused, naming its family
    with pytest.raises(bico.BicoError, match="ridge_prior is not an option "
                       "of method 'bico' .MapOptions.; it is FitOptions's"):
        bt.transfer_model(a, aft, b, cal, method="bico",
                          options=dict(ridge_prior="bico"), loss_fn=ce)
    with pytest.raises(bico.BicoError, match="general_batches"):
        bt.transfer_model(a, aft, b, cal, method="fit",
                          options=bt.FitOptions(general_batches=[]),
                          loss_fn=ce)
    with pytest.raises(bico.BicoError, match="ridge is not an option"):
        bt.transfer_model(a, aft, b, cal, method="bico",
                          options=bt.options_for("bico", ridge="gcv"),
                          loss_fn=ce)
    with pytest.raises(bico.BicoError, match="method 'fit' takes "
                       "FitOptions, got DistillOptions"):
        bt.transfer_model(a, aft, b, cal, method="fit",
                          options=bt.DistillOptions(), loss_fn=ce)
