"""bico.fit.Fit against independent computations: NumPy float64 least
squares on the stacked ridge system, planted updates, shard merges."""
import numpy as np
import pytest
import torch

import bico
from bico.fit import Fit

RNG = np.random.default_rng(2024)


def randn(*shape, scale=1.0):
    return (scale * RNG.standard_normal(shape)).astype(np.float32)


def reference(xn, xo, d, w, b, c):
    """[dW, db] minimising ||X~'(Theta+Delta) - (X~_B Theta + D)||^2 +
    lambda ||dW||^2 by numpy.linalg.lstsq on [X~'; sqrt(lambda) P]."""
    f64 = np.float64
    xn, xo, d, w = (np.asarray(a, f64) for a in (xn, xo, d, w))
    n, di = xn.shape
    bias = b is not None
    one = np.ones((n, 1)) if bias else np.zeros((n, 0))
    xt, xb = np.hstack([xn, one]), np.hstack([xo, one])
    theta = np.vstack([w.T] + ([np.asarray(b, f64)[None, :]] if bias else []))
    t = xb @ theta + d - xt @ theta
    lam = c * np.trace(xn.T @ xn) / di
    pen = np.hstack([np.sqrt(lam) * np.eye(di),
                     np.zeros((di, xt.shape[1] - di))])
    z = np.linalg.lstsq(np.vstack([xt, pen]),
                        np.vstack([t, np.zeros((di, d.shape[1]))]),
                        rcond=None)[0]
    return z[:di].T, (z[di] if bias else None)


def rel(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("c", [1e-3, 1e-2, 1e-1])
@pytest.mark.parametrize("di,do", [(6, 3), (3, 8)])
def test_sequential_fit_matches_lstsq(bias, c, di, do):
    n = 250
    xo = randn(n, di, scale=2.0)
    xn = (xo + randn(n, di, scale=0.5) + 1.0).astype(np.float32)
    d, w, b = randn(n, do), randn(do, di), randn(do)
    f = Fit(di, do, bias=bias, ridge=c)
    f.add(xn, xo, d)
    dw, db = f.solve(w, b if bias else None, want_rank=True)
    assert dw.dtype == np.float32 and dw.shape == (do, di)
    rdw, rdb = reference(xn, xo, d, w, b if bias else None, c)
    assert rel(dw, rdw) < 1e-5
    if bias:
        assert db.dtype == np.float32 and db.shape == (do,)
        assert rel(db, rdb) < 1e-5
    else:
        assert db is None
    assert f.rank == di + bias and f.rows == n
    assert f.ridge == c


def test_planted_update_recovered_as_ridge_vanishes():
    n, di, do = 400, 8, 5
    x = randn(n, di)
    pdw, pdb = randn(do, di, scale=0.3), randn(do, scale=0.3)
    d = (x.astype(np.float64) @ pdw.T + pdb).astype(np.float32)
    errs = []
    for c in (1e-1, 1e-3, 1e-6, 0.0):
        f = Fit(di, do, ridge=c)
        f.add(x, x, d)
        dw, db = f.solve(randn(do, di), randn(do))
        errs.append(rel(dw, pdw) + rel(db, pdb))
    assert all(a >= b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 1e-5


def test_torch_inputs_and_other_dtypes_are_converted():
    n, di, do = 120, 5, 4
    xo, xn, d = randn(n, di), randn(n, di), randn(n, do)
    w, b = randn(do, di), randn(do)
    f1 = Fit(di, do)
    f1.add(xn, xo, d)
    f2 = Fit(di, do)
    # float64 torch, a transposed (non-contiguous) view, a torch delta
    f2.add(torch.from_numpy(xn.astype(np.float64)),
           torch.from_numpy(np.ascontiguousarray(xo.T)).t(),
           torch.from_numpy(d))
    a1, b1 = f1.solve(w, b)
    a2, b2 = f2.solve(torch.from_numpy(w), torch.from_numpy(b))
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(b1, b2)


def test_merged_shards_equal_one_pass():
    n, di, do, cut = 500, 7, 3, 180
    xo, d = randn(n, di), randn(n, do)
    xn = (xo * 1.1).astype(np.float32)
    w, b = randn(do, di), randn(do)
    whole = Fit(di, do)
    whole.add(xn, xo, d)
    s1, s2 = Fit(di, do), Fit(di, do)
    s1.add(xn[:cut], xo[:cut], d[:cut])
    s2.add(xn[cut:], xo[cut:], d[cut:])
    s1.merge(s2)
    assert s1.rows == n
    a1, b1 = whole.solve(w, b)
    a2, b2 = s1.solve(w, b)
    assert rel(a2, a1) < 1e-6 and rel(b2, b1) < 1e-6
    s1.reset()
    assert s1.rows == 0
    z, zb = s1.solve(w, b, want_rank=True)
    assert not z.any() and not zb.any() and s1.rank == 0


def test_rank_deficient_rows_report_rank():
    n, di, do = 200, 6, 2
    x = randn(n, di)
    x[:, 3] = x[:, 0]
    x[:, 5] = 0
    f = Fit(di, do, bias=False, ridge=0.0)
    f.add(x, x, randn(n, do))
    dw, _ = f.solve(randn(do, di), want_rank=True)
    assert f.rank == 4
    np.testing.assert_allclose(dw[:, 0], dw[:, 3], atol=1e-5)
    np.testing.assert_allclose(dw[:, 5], 0, atol=1e-6)
    few = Fit(10, 2)
    few.add(randn(3, 10), randn(3, 10), randn(3, 2))
    few.solve(randn(2, 10), randn(2), want_rank=True)
    assert few.rank == 3


def test_bad_input():
    f = Fit(4, 3)
    x, d = randn(10, 4), randn(10, 3)
    with pytest.raises(ValueError, match="columns"):
        f.add(randn(10, 5), x, d)
    with pytest.raises(ValueError, match="same number of rows"):
        f.add(x, x[:9], d)
    with pytest.raises(ValueError, match="2-D"):
        f.add(x[0], x, d)
    with pytest.raises(TypeError):
        f.add(x.astype(np.complex64), x, d)
    bad = x.copy()
    bad[2, 1] = np.nan
    with pytest.raises(bico.BicoError) as e:
        f.add(x, bad, d)
    assert e.value.status == bico.E_NONFINITE and "x_orig" in e.value.message
    assert f.rows == 0
    f.add(x, x, d)
    with pytest.raises(ValueError, match="rows"):
        f.solve(randn(2, 4), randn(3))
    with pytest.raises(ValueError, match="b is required"):
        f.solve(randn(3, 4))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        f.solve(randn(3, 4), randn(4))
    with pytest.raises(ValueError, match="no bias"):
        Fit(4, 3, bias=False).solve(randn(3, 4), randn(3))
    with pytest.raises(bico.BicoError) as e:
        f.ridge = -1
    assert e.value.status == bico.E_ARG and "ridge = -1 is outside [0, inf)" in e.value.message
    with pytest.raises(bico.BicoError):
        f.merge(Fit(4, 2))
    with pytest.raises(TypeError):
        f.merge(object())
    with pytest.raises(ValueError):
        Fit(0, 3)
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.add(x, x, d)


def test_run_recovers_planted_update_of_a_relu_net():
    """bico.fit.run over a 3-layer ReLU net whose fine-tuned twin is the
    same net plus a known update: the sequential fit recovers it."""
    dims = [5, 8, 7, 3]
    w = [randn(dims[i + 1], dims[i], scale=0.5) for i in range(3)]
    b = [randn(dims[i + 1], scale=0.2) for i in range(3)]
    uw = [randn(*m.shape, scale=0.2) for m in w]
    ub = [randn(*v.shape, scale=0.2) for v in b]
    x = randn(300, dims[0])

    def forward(ws, bs):
        ins, outs, a = [], [], x.astype(np.float64)
        for i in range(3):
            ins.append(a)
            z = a @ np.asarray(ws[i], np.float64).T + bs[i]
            outs.append(z)
            a = np.maximum(z, 0)
        return ins, outs

    cur_w, cur_b = [m.copy() for m in w], [v.copy() for v in b]
    ft_w = [w[i] + uw[i] for i in range(3)]
    ft_b = [b[i] + ub[i] for i in range(3)]
    got, ranks = {}, {}

    def rows(l, fit):
        xn = forward(cur_w, cur_b)[0][l]
        xo = forward(w, b)[0][l]
        d = forward(ft_w, ft_b)[1][l] - forward(w, b)[1][l]
        fit.add(xn[:100], xo[:100], d[:100])  # in two batches
        fit.add(xn[100:], xo[100:], d[100:])

    def update(l, dw, db, rank):
        got[l] = (dw, db)
        ranks[l] = rank
        cur_w[l] = cur_w[l] + dw
        cur_b[l] = cur_b[l] + db

    bico.fit.run(3, lambda l: (cur_w[l], cur_b[l]), rows, update, ridge=0.0,
                 want_rank=True)
    for l in range(3):
        assert rel(got[l][0], uw[l]) < 1e-4, l
        assert rel(got[l][1], ub[l]) < 1e-4, l
        assert ranks[l] == dims[l] + 1
    # the rank only on request: the same updates, rank None
    first = {l: got[l] for l in range(3)}
    cur_w[:], cur_b[:] = [m.copy() for m in w], [v.copy() for v in b]
    bico.fit.run(3, lambda l: (cur_w[l], cur_b[l]), rows, update, ridge=0.0)
    for l in range(3):
        assert np.array_equal(got[l][0], first[l][0]), l
        assert ranks[l] is None

    # A failing callback: its exception comes back, the run stops.
    seen = []

    def bad_rows(l, fit):
        seen.append(l)
        if l == 1:
            raise KeyError("host failure")
        rows(l, fit)

    with pytest.raises(KeyError, match="host failure"):
        bico.fit.run(3, lambda l: (cur_w[l], cur_b[l]), bad_rows,
                     lambda *a: None)
    assert seen == [0, 1]
    # A library failure inside the rows callback (NaN rows).
    def nan_rows(l, fit):
        fit.add(np.full((4, dims[l]), np.nan), np.zeros((4, dims[l])),
                np.zeros((4, dims[l + 1])))

    with pytest.raises(bico.BicoError) as e:
        bico.fit.run(3, lambda l: (cur_w[l], cur_b[l]), nan_rows,
                     lambda *a: None)
    assert e.value.status == bico.E_NONFINITE


BAD = {
    "complex": lambda: np.ones((2, 2), np.complex64),
    "object": lambda: np.array([[object(), 1], [2, 3]], dtype=object),
    "strings": lambda: np.array([["a", "b"], ["c", "d"]]),
    "ragged": lambda: [[1.0, 2.0], [3.0]],
    "mapping": lambda: {"a": 1},
    "3-D": lambda: np.ones((2, 2, 2), np.float32),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_every_array_argument_refuses_bad_arrays(kind):
    ok = np.ones((2, 2), np.float32)
    calls = [lambda x: Fit(2, 2).add(x, ok, ok),
             lambda x: Fit(2, 2).add(ok, x, ok),
             lambda x: Fit(2, 2).add(ok, ok, x),
             lambda x: Fit(2, 2).solve(x, np.ones(2)),
             lambda x: Fit(2, 2).solve(ok, x)]
    for call in calls:
        with pytest.raises((bico.BicoError, TypeError, ValueError)):
            call(BAD[kind]())


@pytest.mark.parametrize("c", [1e-2, 0.0])
@pytest.mark.parametrize("bias", [True, False])
def test_rank_only_on_request_same_update(c, bias):
    """The rank is computed only with solve(want_rank=True); the update is
    bit-identical either way, and the rank is the planted one."""
    n, di, do, r = 150, 8, 3, 3
    m = randn(r, di)
    z = randn(n, r)
    xo = (z @ m).astype(np.float32)
    xn = ((z + randn(n, r)) @ m).astype(np.float32)
    f = Fit(di, do, bias=bias, ridge=c)
    f.add(xn, xo, randn(n, do))
    w, b = randn(do, di), (randn(do) if bias else None)
    dw0, db0 = f.solve(w, b)
    assert f.rank is None
    dw1, db1 = f.solve(w, b, want_rank=True)
    assert f.rank == r + bias
    np.testing.assert_array_equal(dw0, dw1)
    if bias:
        np.testing.assert_array_equal(db0, db1)


_SHARD_CHILD = r"""
import sys
import numpy as np
from bico.fit import Fit
rng = np.random.default_rng(int(sys.argv[1]))
n, di, do, cut = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
xo = rng.standard_normal((n, di)).astype(np.float32)
xn = (xo * 1.1 + 0.05).astype(np.float32)
d = rng.standard_normal((n, do)).astype(np.float32)
f = Fit(di, do, ridge=0.02)
f.add(xn[cut:], xo[cut:], d[cut:])
sys.stdout.buffer.write(f.to_bytes())
"""


def test_a_shard_from_another_process_merges_as_in_process():
    # The rows after `cut` are added in a child process and come back as
    # bytes: merged here, the solve is the in-process merge's bit for bit,
    # and the one-pass fit's to rounding (the statistics add over rows).
    import os
    import subprocess
    import sys
    seed, n, di, do, cut = 7, 400, 6, 4, 150
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(bico.__file__))]
        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = subprocess.run([sys.executable, "-c", _SHARD_CHILD] + [
        str(v) for v in (seed, n, di, do, cut)], env=env, check=True,
        stdout=subprocess.PIPE).stdout
    rng = np.random.default_rng(seed)
    xo = rng.standard_normal((n, di)).astype(np.float32)
    xn = (xo * 1.1 + 0.05).astype(np.float32)
    d = rng.standard_normal((n, do)).astype(np.float32)
    w, b = randn(do, di), randn(do)
    here, here2, there = Fit(di, do, ridge=0.02), Fit(di, do, ridge=0.02), \
        Fit(di, do, ridge=0.02)
    here.add(xn[:cut], xo[:cut], d[:cut])
    here2.add(xn[:cut], xo[:cut], d[:cut])
    there.add(xn[cut:], xo[cut:], d[cut:])
    assert out == there.to_bytes()      # the same statistics, bit for bit
    child = Fit.from_bytes(out)
    assert (child.d_in, child.d_out, child.bias, child.rows) == \
        (di, do, True, n - cut)
    assert child.ridge == 0.02
    here.merge(child)
    here2.merge(there)
    assert here.rows == n
    a1, b1 = here.solve(w, b)
    a2, b2 = here2.solve(w, b)
    assert a1.tobytes() == a2.tobytes() and b1.tobytes() == b2.tobytes()
    ra, rb = reference(xn, xo, d, w, b, 0.02)
    assert rel(a1, ra) < 1e-5 and rel(b1, rb) < 1e-5


def test_fit_bytes_are_checked():
    f = Fit(3, 2, bias=False)
    f.add(randn(10, 3), randn(10, 3), randn(10, 2))
    good = f.to_bytes()
    back = Fit.from_bytes(bytearray(good))
    assert back.bias is False and back.rows == 10
    for bad, says in ((good[:-1], "bytes"), (b"BICOXCOV" + good[8:], "magic"),
                      (good[:64 + 8] + b"\xff" * 8 + good[80:], "NaN")):
        with pytest.raises(bico.BicoError, match=says):
            Fit.from_bytes(bad)
    with pytest.raises(TypeError):
        Fit.from_bytes("not bytes")
