"""The fit's carried output change alpha D R_out (bico.torch.fit._carry) and
choose_alpha's candidate update theta + alpha delta (torch._scaled) go
through the library's kernels (bico_transport_rows, bico_baseline_naive),
and give what the NumPy / torch expressions give."""
import numpy as np
import pytest
import torch

import bico._lib as core
from bico._status import BicoError
from bico.torch.choose import _scaled
from bico.torch.fit import _carry


def counting(monkeypatch, name):
    calls = []
    f = getattr(core.fn, name)

    def g(*args):
        calls.append(args)
        return f(*args)
    monkeypatch.setattr(core.fn, name, g)
    return calls


def test_carry_single_map_by_the_library(monkeypatch):
    rng = np.random.default_rng(1)
    d = rng.standard_normal((37, 12))
    r = rng.standard_normal((12, 9)).astype(np.float32)
    calls = counting(monkeypatch, "transport_rows")
    got = _carry(d, r, 0.7)
    assert len(calls) == 1
    assert got.dtype == np.float32 and got.shape == (37, 9)
    np.testing.assert_allclose(got, 0.7 * (d @ r.astype(np.float64)),
                               rtol=1e-5, atol=1e-5)


def test_carry_fused_blocks_by_the_library(monkeypatch):
    rng = np.random.default_rng(2)
    k, wa, wb = 3, 8, 5
    d = rng.standard_normal((21, k * wa)).astype(np.float32)
    rs = [rng.standard_normal((wa, wb)).astype(np.float32) for _ in range(k)]
    calls = counting(monkeypatch, "transport_rows")
    got = _carry(d, rs, 1.5)
    assert len(calls) == k
    want = 1.5 * np.hstack([d[:, i * wa:(i + 1) * wa].astype(np.float64)
                            @ rs[i] for i in range(k)])
    assert got.shape == (21, k * wb)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_scaled_cpu_by_the_library(monkeypatch):
    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(6, 4, generator=g),
            "h": torch.randn(5, generator=g).to(torch.bfloat16),
            "ids": torch.arange(4)}
    delta = {"w": np.random.default_rng(4).standard_normal((6, 4)),
             "h": torch.randn(5, generator=g)}
    calls = counting(monkeypatch, "baseline_naive")
    sd = _scaled(base, delta, 0.25)
    assert len(calls) == 2
    assert sd["ids"] is base["ids"]
    assert sd["h"].dtype == torch.bfloat16
    want_w = base["w"].double() + 0.25 * torch.from_numpy(delta["w"])
    assert torch.allclose(sd["w"].double(), want_w, rtol=1e-6, atol=1e-6)
    want_h = (base["h"].float() + 0.25 * delta["h"]).to(torch.bfloat16)
    assert torch.equal(sd["h"], want_h)
    # the base is left as it was
    assert not torch.equal(sd["w"], base["w"])


def test_scaled_refuses_a_misshapen_update_naming_the_tensor():
    base = {"layer.w": torch.zeros(3, 4)}
    with pytest.raises(BicoError) as e:
        _scaled(base, {"layer.w": np.ones((1, 4))}, 1.0)
    assert "layer.w" in str(e.value)


def test_scaled_zero_dim_and_empty_tensors():
    base = {"s": torch.tensor(2.0), "e": torch.zeros(0, 3)}
    sd = _scaled(base, {"s": np.array(1.0, np.float32),
                        "e": np.zeros((0, 3))}, 0.5)
    assert sd["s"].shape == () and float(sd["s"]) == 2.5
    assert sd["e"].shape == (0, 3)


def test_carry_fused_blocks_in_place(monkeypatch):
    """Each fused block's columns go to the kernel in place: the pointer
    into D (and into the result) with the whole row as leading dimension,
    no copy of the slice; a float32 map is passed as it is."""
    rng = np.random.default_rng(5)
    k, wa, wb = 3, 8, 5
    d = rng.standard_normal((21, k * wa)).astype(np.float32)
    rs = [rng.standard_normal((wa, wb)).astype(np.float32) for _ in range(k)]
    calls = counting(monkeypatch, "transport_rows")
    got = _carry(d, rs, 1.0)
    assert len(calls) == k
    for i, c in enumerate(calls):
        assert c[5] == d.ctypes.data + 4 * i * wa and c[6] == k * wa
        assert c[7] == rs[i].ctypes.data
        assert c[11] == k * wb
    np.testing.assert_allclose(
        got, np.hstack([d[:, i * wa:(i + 1) * wa] @ rs[i] for i in range(k)]),
        rtol=1e-5, atol=1e-5)
    with pytest.raises(BicoError, match="output map"):
        _carry(d, rs[:2], 1.0)   # 24 columns are not 2 blocks of 8


def test_fit_converts_each_output_map_once(monkeypatch):
    """In a fit, R_out is made float32 once per layer (_out_map32), not per
    batch: every kernel call reads a map made by that conversion."""
    import bico.torch.fit as tf  # where fit_model looks _out_map32 up
    from test_fit_driver import data, linears, made, run_fit, tuned
    made_maps = []
    conv = tf._out_map32

    def recording(r):
        m = conv(r)
        made_maps.append(m)
        return m
    monkeypatch.setattr(tf, "_out_map32", recording)
    calls = counting(monkeypatch, "transport_rows")
    b = made(11)
    maps = {n: {"out": (np.eye(b.get_submodule(n).out_features),)}
            for n in linears(b)}
    run_fit(b, tuned(b, 12, 0.05), b, data(n_batches=3), maps, 1.0, 0.1)
    assert len(made_maps) == len(linears(b))
    assert len(calls) == 3 * len(linears(b))
    ptrs = set(m.ctypes.data for m in made_maps)
    assert all(c[7] in ptrs for c in calls)
