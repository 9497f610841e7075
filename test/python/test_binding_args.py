"""The binding checks every argument before a C call: each case the issue
tracker reproduced (segfaults, writes into immutable memory, reads past
buffers, silent wrap-around) now raises and leaves memory as it was.  The
property-based walk over every wrapper is test_binding_walk.py."""
import json
import struct

import numpy as np
import pytest

bico = pytest.importorskip("bico")
bl = pytest.importorskip("bico.lora")

REFUSED = (bico.BicoError, TypeError, ValueError)


def header(path):
    """The JSON header of a safetensors file, read here independently."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


# ---- outputs that cannot be written ----

def test_read_only_memmap_out_is_refused_and_file_untouched(tmp_path):
    p = str(tmp_path / "out.f32")
    np.arange(6, dtype=np.float32).tofile(p)
    before = open(p, "rb").read()
    out = np.memmap(p, dtype=np.float32, mode="r", shape=(2, 3))
    for call in (lambda: bico.transport.weight(np.ones((2, 3)), out=out),
                 lambda: bico.transport.rows(np.ones((2, 3)), out=out),
                 lambda: bico.naive(np.ones((2, 3)), (2, 3), out=out),
                 lambda: bico.pad(np.ones((2, 3)), (2, 3), out=out),
                 lambda: bico.Votes((2, 3)).apply(np.ones((2, 3)), out=out)):
        with pytest.raises(ValueError, match="read-only"):
            call()
    del out
    assert open(p, "rb").read() == before


def test_out_viewing_immutable_bytes_is_refused():
    raw = bytes(48)
    out = np.frombuffer(raw, np.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="read-only"):
        bico.transport.weight(np.ones((3, 4)), out=out)
    with pytest.raises(ValueError, match="read-only"):
        bico.transport.vector(np.ones(12), out=np.frombuffer(raw, np.float32))
    assert raw == bytes(48)


def test_out_of_the_wrong_kind_is_refused():
    tau = np.ones((2, 3), np.float32)
    for bad in (np.zeros((2, 3)),                      # float64
                np.zeros((2, 3), ">f4"),               # big-endian
                np.zeros((3, 2), np.float32),          # shape
                [[0.0] * 3] * 2):                      # not an array
        with pytest.raises(REFUSED):
            bico.transport.weight(tau, out=bad)


def test_out_overlapping_an_input_gives_the_reference_result():
    g = np.random.default_rng(3)
    tau = g.normal(size=(4, 4)).astype(np.float32)
    r = np.linalg.qr(g.normal(size=(4, 4)))[0].astype(np.float32)
    want = r.T @ tau @ r
    bico.transport.weight(tau, r, r, out=tau)          # in place
    np.testing.assert_allclose(tau, want, atol=1e-5)
    # a non-contiguous out is written through a copy
    big = np.zeros((4, 8), np.float32)
    bico.transport.weight(want, out=big[:, ::2])
    np.testing.assert_allclose(big[:, ::2], want)
    assert not big[:, 1::2].any()


# ---- shapes that read past buffers ----

@pytest.mark.parametrize("call", [
    lambda: bl.transport(np.ones((100, 2)), np.ones((2, 10)),
                         r_out=np.ones((1, 1))),
    lambda: bl.transport(np.ones((10, 1)), np.ones((50, 10))),
    lambda: bl.transport(np.ones((10, 2)), np.ones((2, 10)),
                         r_in=np.ones((3, 4))),
    lambda: bl.transport(np.ones((9, 2)), np.ones((2, 5)),
                         r_out=[np.ones((3, 3)), np.ones((3, 4)), None]),
    lambda: bl.merge_tensors([np.ones(4)] * 3, [1]),
    lambda: bl.merge_tensors([np.ones(10 ** 6), np.ones(2)], [1, 1]),
    lambda: bl.merge_tensors([np.ones(4)] * 2, [1, 1], densities=[0.5]),
    lambda: bl.Adapter().add_module("m", np.ones((4, 1)), np.ones((64, 4)),
                                    1.0),
    lambda: bico.transport.weight(np.ones((4, 3)), r_out=np.ones((2, 2))),
    lambda: bico.transport.weight(np.ones((4, 3)), r_in=np.ones((4, 2))),
    lambda: bico.transport.weight_split(np.ones((6, 2)),
                                        [np.ones((3, 3))] * 3),
    lambda: bico.transport.weight_split(np.ones((7, 2)), None, k=3),
    lambda: bico.transport.vector(np.ones(4), np.ones((3, 3))),
    lambda: bico.transport.vector(np.ones((2, 2)), np.ones((4, 3))),
    lambda: bico.transport.rows(np.ones((2, 4)), np.ones((3, 3))),
    lambda: bico.XCov(3, 2).add(np.ones((5, 3)), np.ones((5, 3))),
    lambda: bico.XCov(3, 2).add_matrix(np.ones((2, 3)), 5),
    lambda: bico.Votes((3, 4)).add(np.ones((4, 3))),
    lambda: bico.Votes((3, 4)).mask(np.ones(11)),
])
def test_mismatched_shapes_are_refused_before_the_call(call, monkeypatch):
    def never(*args):
        raise AssertionError("the C kernel was called")
    for k in KERNELS:
        monkeypatch.setattr(bico._lib.fn, k, never)
    with pytest.raises(bico.BicoError) as e:
        call()
    assert e.value.status == bico.E_SHAPE and e.value.message


KERNELS = ("lora_transport", "merge_tensor", "lora_add_module",
           "transport_weight", "transport_weight_split", "transport_vector",
           "transport_rows", "xcov_add", "xcov_add_matrix", "votes_add_grad",
           "gradfix_mask", "gradfix_apply")


def test_shape_errors_name_both_shapes():
    with pytest.raises(bico.BicoError) as e:
        bl.Adapter().add_module("m", np.ones((4, 1)), np.ones((64, 4)), 1.0)
    assert "[64, 4]" in e.value.message and "[1, *]" in e.value.message


# ---- integers that C would wrap ----

def test_vote_counts_that_do_not_fit_int32_are_refused():
    v = bico.Votes(2)
    with pytest.raises(bico.BicoError) as e:
        v.add_counts([2 ** 40 + 3, 1], 3)
    assert e.value.status == bico.E_ARG and str(2 ** 40 + 3) in e.value.message
    with pytest.raises(bico.BicoError):
        v.add_counts([4, 1], 3)                 # |vote| > samples
    with pytest.raises(bico.BicoError):
        v.add_counts([1, 1], 2 ** 32 + 1)       # samples is a uint32
    with pytest.raises(bico.BicoError):
        v.add_counts([0.5, 1], 3)               # not a count
    assert v.samples == 0 and not v.counts().any()
    v.add_counts(np.array([3.0, -2.0]), 3)      # whole floats are counts
    assert v.counts().tolist() == [3, -2] and v.samples == 3


@pytest.mark.parametrize("args", [(-1, 3), (3, -1), (2 ** 64, 3), (2.5, 3),
                                  (True, 3)])
def test_depth_map_refuses_what_is_no_block_count(args):
    with pytest.raises((bico.BicoError, TypeError)):
        bico.DepthMap(*args)


def test_negative_and_oversized_dimensions_are_refused():
    for call in (lambda: bico.XCov(-1, 3), lambda: bico.Votes((-2, 3)),
                 lambda: bico.naive(np.ones(3), (-3,)),
                 lambda: bico.pad(np.ones(3), (2 ** 64,)),
                 lambda: bico.transport.weight(np.ones((2, 2)), d_out_b=-1),
                 lambda: bico.model.Model().add_tensor("x", (-1, 2)),
                 lambda: bl.truncate(np.ones((3, 3)), -1),
                 lambda: bico.DepthMap(3, 4).source(-1)):
        with pytest.raises(REFUSED):
            call()


def test_scalars_must_be_finite_float32():
    for a in (float("nan"), float("inf"), 1e39):
        with pytest.raises(bico.BicoError):
            bico.transport.weight(np.ones((2, 2)), alpha=a)


# ---- strings ----

def test_names_with_nul_are_refused_not_cut(tmp_path):
    p = tmp_path / "nul.safetensors"
    with pytest.raises(bico.BicoError) as e:
        bico.safetensors.write(str(p), {"a\0b": np.ones(2, np.float32)})
    assert e.value.status == bico.E_ARG and "NUL" in e.value.message
    assert not p.exists()
    with pytest.raises(bico.BicoError):
        bico.safetensors.write(str(p), {"a": np.ones(2)},
                               metadata={"k\0": "v"})
    with pytest.raises(bico.BicoError):
        bico.model.Model().add_tensor("x\0y", (2, 2))
    with pytest.raises(bico.BicoError):
        bl.Adapter().add_module("m\0", np.ones((2, 1)), np.ones((1, 2)), 1.0)
    assert not p.exists()


# ---- safetensors dtypes ----

def test_big_endian_float64_written_as_f64_is_exact(tmp_path):
    p = str(tmp_path / "be.safetensors")
    x = np.array([1 / 3, 1e300, -2.5e-310], dtype=">f8")
    bico.safetensors.write(p, {"x": x, "y": x}, dtypes={"x": "F64"})
    back = bico.safetensors.read(p)
    assert back["x"].dtype == np.float64 and back["y"].dtype == np.float64
    assert back["x"].tolist() == x.tolist() == back["y"].tolist()
    assert header(p)["x"]["dtype"] == "F64"


def test_integer_override_only_when_exact(tmp_path):
    p = str(tmp_path / "i.safetensors")
    with pytest.raises(bico.BicoError):
        bico.safetensors.write(p, {"x": np.array([1.5])}, dtypes={"x": "I32"})
    with pytest.raises(bico.BicoError):
        bico.safetensors.write(p, {"x": np.array([300])}, dtypes={"x": "U8"})
    bico.safetensors.write(p, {"x": np.array([2.0, -7.0])},
                           dtypes={"x": "I32"})
    assert bico.safetensors.read(p)["x"].tolist() == [2, -7]


def test_torch_float16_is_stored_as_f16(tmp_path):
    torch = pytest.importorskip("torch")
    p = str(tmp_path / "t.safetensors")
    t = torch.tensor([1.0, 0.333, 65504.0], dtype=torch.float16)
    bico.safetensors.write(p, {"h": t, "b": t.to(torch.bfloat16),
                               "f": t.float()})
    h = header(p)
    assert (h["h"]["dtype"], h["b"]["dtype"], h["f"]["dtype"]) == \
        ("F16", "BF16", "F32")
    back = bico.safetensors.read(p)
    assert back["h"].dtype == np.float16
    assert back["h"].tobytes() == t.numpy().tobytes()


# ---- option names ----

def test_number_options_given_a_string_say_so():
    t = bico.model.Transfer()
    with pytest.raises(bico.BicoError) as e:
        t.set("alpha", "2")
    assert "alpha takes a number, got '2'" in e.value.message
    with pytest.raises(bico.BicoError) as e:
        t.set("method", "bicoo")
    for name in ("bico", "bico-in", "bico-out", "gradfix", "naive", "pad"):
        assert name in e.value.message
    with pytest.raises(bico.BicoError) as e:
        t.set("proc_method", "qr")
    assert "eig, polar, svd" in e.value.message


def test_procrustes_chooses_its_method():
    g = np.random.default_rng(7)
    q = np.linalg.qr(g.normal(size=(6, 6)))[0]
    c = g.normal(size=(6, 6)) @ np.diag([5, 4, 3, 2, 1.5, 1.0])
    u, _, vt = np.linalg.svd(c @ q)
    want = u @ vt                                  # the polar factor
    from bico._lib import fn
    for name, code in (("svd", 1), ("eig", 2), ("polar", 3)):
        with bico.Procrustes(method=name) as p:
            assert p.get("method") == code
            assert fn.procrustes_method_name(code).decode() == name
            r, rank = p.solve_matrix(c @ q)
        assert rank == 6
        np.testing.assert_allclose(r, want, atol=2e-4)
    with pytest.raises(bico.BicoError) as e:
        bico.Procrustes(method="qr")
    assert "eig, polar, svd" in e.value.message


# ---- constants and module structure ----

def test_dtype_table_comes_from_the_library():
    from bico import _enums
    for name, code in _enums.DTYPES.items():
        assert bico.safetensors.dtype_name(code) == name
    assert len(_enums.DTYPES) == 13


# ---- transfer_state_dict: same kind out as in ----

def _tiny(d, seed):
    g = np.random.default_rng(seed)
    return {"fc.weight": g.normal(size=(d, d)).astype(np.float32),
            "fc.bias": g.normal(size=d).astype(np.float32)}


def test_transfer_state_dict_returns_the_kind_it_was_given():
    torch = pytest.importorskip("torch")
    a0, b0 = _tiny(3, 1), _tiny(3, 2)
    a1 = {k: v + 1 for k, v in a0.items()}
    out = bico.transfer_state_dict(a0, a1, b0, method="naive")
    assert all(type(v) is np.ndarray for v in out.values())
    np.testing.assert_allclose(out["fc.weight"], b0["fc.weight"] + 1,
                               atol=1e-6)
    tb = {"fc.weight": torch.from_numpy(b0["fc.weight"]).half(),
          "fc.bias": b0["fc.bias"]}                   # mixed kinds
    out, delta = bico.transfer_state_dict(a0, a1, tb, method="naive",
                                          return_delta=True)
    assert isinstance(out["fc.weight"], torch.Tensor)
    assert out["fc.weight"].dtype == torch.float16
    assert type(out["fc.bias"]) is np.ndarray
    assert isinstance(delta["fc.weight"], torch.Tensor)
    assert delta["fc.weight"].dtype == torch.float32
    np.testing.assert_allclose(delta["fc.weight"].numpy(), 1.0)
    m = torch.nn.Module()       # names fc.weight, fc.bias: they pair with a0
    m.fc = torch.nn.Linear(3, 3).half()
    import bico.torch as bt
    m.load_state_dict(bt.transfer_state_dict(
        a0, a1, m.state_dict(), method="naive"))


def test_has_is_false_for_what_the_library_lacks():
    assert bico._lib.has("transport_weight")
    assert not bico._lib.has("no_such_function")


def test_driver_refuses_statistics_that_are_no_floats(tmp_path):
    p = str(tmp_path / "stats.safetensors")
    bico.safetensors.write(p, {"fc.in_xcov": np.ones((2, 2), np.int8),
                               "fc.out_xcov": np.eye(2)})
    sd = {"fc.weight": np.ones((2, 2), np.float32)}
    with pytest.raises(bico.BicoError) as e:
        bico.transfer_state_dict(sd, sd, sd, p)
    assert e.value.status == bico.E_FORMAT and "I8" in e.value.message


def test_the_python_engine_is_gone():
    """1.0 has one engine and no engine= option (0.x's is not kept): the
    argument is an unknown option like any other."""
    sd = {"fc.weight": np.ones((2, 2), np.float32)}
    for engine in ("python", "c", "auto"):
        with pytest.raises(TypeError) as e:
            bico.transfer_state_dict(sd, sd, sd, method="naive",
                                     engine=engine)
        assert "engine" in str(e.value)
    import bico.transfer as tr
    for gone in ("classify", "_default_tie", "_Stats", "_bico_tensor"):
        assert not hasattr(tr, gone), gone


def test_method_and_norm_map_names_come_from_the_library():
    import ctypes
    from bico import _enums
    assert set(_enums.METHODS) == {"bico", "bico-in", "bico-out", "gradfix",
                                   "naive", "pad"}
    assert set(_enums.NORM_MAPS) == {"act", "grad"}
    for table, from_name in ((_enums.METHODS, bico._lib.fn.transfer_method_from_name),
                             (_enums.NORM_MAPS,
                              bico._lib.fn.transfer_norm_map_from_name)):
        for name, v in table.items():
            out = ctypes.c_int(-1)
            assert from_name(name.encode(), ctypes.byref(out)) == 0
            assert out.value == v
    assert bico.model.METHODS is _enums.METHODS


def test_transfer_lending_checks_its_arguments():
    t = bico.Transfer()
    x = bico.XCov(2, 2)
    with pytest.raises(bico.BicoError) as e:
        t.set_xcov("fc", "sideways", x)
    assert e.value.status == bico.E_ARG and "in, out" in e.value.message
    with pytest.raises(TypeError):
        t.set_xcov("fc", "in", [np.eye(2)])
    with pytest.raises(bico.BicoError) as e:      # one map on the input side
        t.set_xcov("fc", "in", [x, x])
    assert e.value.status == bico.E_ARG
    with pytest.raises(TypeError):
        t.set_votes("fc.weight", np.ones(4, np.int32))
    t.set_xcov("fc", "out", [x, x])
    t.set_xcov("fc", "out", None)                 # withdraws
    t.set_votes("fc.weight", bico.Votes(4))
    t.set_votes("fc.weight", None)
    t.close()


def test_depth_map_block_out_of_range_is_a_bico_error():
    """j >= l_b: the library's BICO_E_ARG, as a BicoError naming the
    block (the binding once raised NameError on this path)."""
    with pytest.raises(bico.BicoError) as e:
        bico.DepthMap(3, 4).source(4)
    assert e.value.status == bico.E_ARG and "block 4" in str(e.value)


def test_transfer_state_dict_refuses_complex_votes_and_statistics():
    """Votes and statistics given as arrays go through the same check as
    every other array argument: complex values are refused naming the
    tensor, not cast to real (the imaginary part silently dropped)."""
    sd = {"fc.weight": np.ones((2, 2), np.float32)}
    with pytest.raises(TypeError) as e:
        bico.transfer_state_dict(sd, sd, sd, method="gradfix",
                                 votes={"fc.weight": np.ones((2, 2),
                                                             np.complex64)})
    assert "fc.weight" in str(e.value) and "complex" in str(e.value)
    with pytest.raises(TypeError) as e:
        bico.transfer_state_dict(sd, sd, sd, {
            "fc.in_xcov": np.eye(2, dtype=np.complex128),
            "fc.out_xcov": np.eye(2)})
    assert "fc.in_xcov" in str(e.value) and "complex" in str(e.value)
