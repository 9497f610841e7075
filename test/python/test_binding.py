"""The ctypes binding against independent computations (NumPy / PyTorch
float64 linear algebra, planted answers)."""
import os

import numpy as np
import pytest
import torch

import bico
import bico.torch as bt
from test_binding_models import (float32_default,  # noqa: F401
                                 Tiny, batches, mse_loss, perturbed,
                                 planted_transform, random_orthogonal,
                                 ref_bico, ref_map, stored_statistics)

RNG = np.random.default_rng(12345)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# ---- loading ----

def test_library_is_the_one_asked_for():
    assert os.path.isfile(bico.library_path)
    want = os.environ.get("BICO_LIBRARY")
    if want:
        assert os.path.realpath(want) == os.path.realpath(bico.library_path)
        assert bico.library_source == "$BICO_LIBRARY"
    assert bico.version() == "%d.%d.%d" % divmod_version(
        bico.version_number())


def divmod_version(n):
    return n // 10000, (n // 100) % 100, n % 100


def test_missing_library_lists_every_place_tried(tmp_path):
    import subprocess
    import sys
    env = dict(os.environ, BICO_LIBRARY=str(tmp_path / "nope.so"),
               BICO_BUILD=str(tmp_path), LD_LIBRARY_PATH=str(tmp_path))
    # A copy of the package away from the build tree, so that only the
    # environment can point at a library.
    import shutil
    pkg = tmp_path / "site" / "lib" / "python3" / "dist-packages"
    shutil.copytree(os.path.dirname(bico.__file__), pkg / "bico")
    env["PYTHONPATH"] = str(pkg)
    r = subprocess.run([sys.executable, "-c", "import bico"], env=env,
                       capture_output=True, text=True)
    if r.returncode == 0:
        # the soname resolved through the system's loader (installed copy)
        out = subprocess.run([sys.executable, "-c",
                              "import bico; print(bico.library_source)"],
                             env=env, capture_output=True, text=True)
        assert "soname" in out.stdout or "find_library" in out.stdout
        return
    assert "ImportError" in r.stderr
    assert str(tmp_path / "nope.so") in r.stderr
    assert "$BICO_LIBRARY" in r.stderr and "install prefix" in r.stderr
    assert str(tmp_path / "site" / "lib" / "libbico.so.1") in r.stderr


def test_every_public_function_has_a_prototype():
    """Every BICO_API function of include/bico/*.h is declared to ctypes
    (argtypes and restype) and exported by the loaded library."""
    import glob
    import re
    import bico.fit  # noqa: F401  fit.h's prototypes are declared on import
    inc = os.path.join(os.path.dirname(__file__), "..", "..", "include",
                       "bico")
    names = set()
    for h in glob.glob(os.path.join(inc, "*.h")):
        text = open(h).read()
        names |= set(re.findall(r"BICO_API[^;(]*?\b(bico_\w+)\s*\(", text))
    assert len(names) > 90
    assert names <= set(bico._lib.PROTOTYPES), sorted(
        names - set(bico._lib.PROTOTYPES))
    assert not bico._lib.missing
    for n in names:
        f = getattr(bico._lib.lib, n)
        assert f.argtypes is not None, n


# ---- errors ----

def test_error_carries_status_and_library_message():
    with pytest.raises(bico.BicoError) as e:
        bico.naive(np.ones((2, 3), np.float32), (3, 2))
    assert e.value.status == bico.E_SHAPE
    assert "baseline_naive" in e.value.message
    assert "[2, 3]" in e.value.message and "[3, 2]" in e.value.message
    assert e.value.strerror == bico.strerror(bico.E_SHAPE)


def test_merge_shape_mismatch_names_both_shapes():
    with bico.XCov(5, 4) as a, bico.XCov(3, 3) as b:
        with pytest.raises(bico.BicoError) as e:
            a.merge(b)
    assert e.value.status == bico.E_SHAPE
    assert "5" in e.value.message and "3" in e.value.message


def test_nonfinite_rows_rejected_and_accumulator_unchanged():
    xa, xb = randn(4, 3), randn(4, 2)
    xc = bico.XCov(3, 2).add(xa, xb)
    before = xc.matrix()
    bad = xb.copy()
    bad[2, 1] = np.nan
    with pytest.raises(bico.BicoError) as e:
        xc.add(xa, bad)
    assert e.value.status == bico.E_NONFINITE
    assert "xcov_add" in e.value.message
    assert np.array_equal(xc.matrix(), before)


def test_bad_procrustes_option_value():
    with pytest.raises(bico.BicoError) as e:
        bico.Procrustes(whiten=0.9)
    assert e.value.status == bico.E_ARG and "0.9" in e.value.message
    with pytest.raises(TypeError):
        bico.Procrustes(bogus=1)


def test_use_after_close_is_an_exception_not_a_crash():
    xc = bico.XCov(2, 2)
    xc.close()
    xc.close()
    with pytest.raises(ValueError):
        xc.add(randn(1, 2), randn(1, 2))


def test_bad_file_raises_with_library_message(tmp_path):
    p = tmp_path / "broken.safetensors"
    p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(bico.BicoError) as e:
        bico.safetensors.read(str(p))
    assert e.value.status == bico.E_FORMAT
    assert "broken.safetensors" in e.value.message
    with pytest.raises(bico.BicoError) as e:
        bico.safetensors.read(str(tmp_path / "absent.safetensors"))
    assert e.value.status == bico.E_IO
    assert "absent.safetensors" in e.value.message


def test_missing_tensor_is_notfound(tmp_path):
    p = str(tmp_path / "x.safetensors")
    bico.safetensors.write(p, {"a": randn(2)})
    with bico.safetensors.File(p) as f:
        with pytest.raises(bico.BicoError) as e:
            f["b"]
    assert e.value.status == bico.E_NOTFOUND and "b" in e.value.message


# ---- cross-covariance ----

def test_xcov_equals_float64_product_and_merges_by_shards():
    xa, xb = randn(300, 7), randn(300, 5)
    ref = xa.astype(np.float64).T @ xb.astype(np.float64)
    whole = bico.XCov(7, 5, sums=True, grams=True).add(xa, xb)
    assert np.allclose(whole.matrix(), ref, rtol=1e-12, atol=1e-10)
    assert whole.rows == 300
    parts = [bico.XCov(7, 5, sums=True, grams=True).add(xa[i:i + 100],
                                                          xb[i:i + 100])
             for i in (0, 100, 200)]
    parts[0].merge(parts[1]).merge(parts[2])
    assert np.allclose(parts[0].matrix(), ref, rtol=1e-12, atol=1e-10)
    g = whole.matrix("gram_a")
    assert np.allclose(g, xa.astype(np.float64).T @ xa, rtol=1e-12,
                       atol=1e-10)
    sa, sb = whole.sums()
    assert np.allclose(sa, xa.astype(np.float64).sum(0))
    cen = whole.matrix(centered=True)
    da = xa - xa.astype(np.float64).mean(0)
    db = xb - xb.astype(np.float64).mean(0)
    assert np.allclose(cen, da.T @ db, rtol=1e-9, atol=1e-9)


def test_xcov_add_mode_option():
    """add_mode="fast" (BICO_XCOV_ADD_FAST): single-precision block
    products, error single-precision sized; the mode is not stored, so a
    fast and an exact accumulator merge; unknown modes are refused."""
    xa, xb = randn(3000, 9), randn(3000, 6)
    ref = xa.astype(np.float64).T @ xb.astype(np.float64)
    fast = bico.XCov(9, 6, add_mode="fast").add(xa, xb)
    exact = bico.XCov(9, 6).add(xa, xb)
    err = lambda m: np.linalg.norm(m - ref) / np.linalg.norm(ref)
    assert err(exact.matrix()) < 1e-13
    assert err(fast.matrix()) < 1e-5
    assert err(bico.XCov(9, 6).merge(fast).matrix()) < 1e-5
    with pytest.raises(bico.BicoError) as e:
        bico.XCov(9, 6, add_mode="quick")
    assert "exact" in e.value.message and "fast" in e.value.message


def test_xcov_strided_views_and_other_layouts():
    big = randn(50, 12)
    xa = big[:, 2:9]            # a column slice: row stride 12, no copy
    xb = randn(50, 4)
    ref = xa.astype(np.float64).T @ xb.astype(np.float64)
    assert np.allclose(bico.XCov(7, 4).add(xa, xb).matrix(), ref)
    assert np.allclose(bico.XCov(7, 4).add(np.asfortranarray(xa),
                                           xb.astype(np.float64)).matrix(),
                       ref)
    assert np.allclose(bico.XCov(7, 4).add(xa[::-1], xb[::-1]).matrix(), ref)
    assert np.allclose(bico.XCov(7, 4).add(torch.from_numpy(big)[:, 2:9],
                                           torch.from_numpy(xb)).matrix(), ref)
    arr, n, d, ld = bico._args.rows_f32(xa)
    assert arr is xa and ld == 12  # zero-copy path taken


def test_xcov_rejects_wrong_widths_and_row_counts():
    xc = bico.XCov(3, 2)
    with pytest.raises(bico.BicoError) as e:
        xc.add(randn(4, 3), randn(5, 2))
    assert e.value.status == bico.E_SHAPE and "4" in str(e.value)
    with pytest.raises(bico.BicoError):
        xc.add(randn(4, 4), randn(4, 2))


def test_xcov_bytes_round_trip_is_bit_exact():
    xc = bico.XCov(6, 3, sums=True).add(randn(40, 6), randn(40, 3))
    back = bico.XCov.from_bytes(xc.to_bytes())
    assert back.info() == xc.info()
    assert np.array_equal(back.matrix(), xc.matrix())
    assert back.to_bytes() == xc.to_bytes()
    with pytest.raises(bico.BicoError) as e:
        bico.XCov.from_bytes(xc.to_bytes()[:-5])
    assert e.value.status == bico.E_FORMAT


# ---- Procrustes ----

@pytest.mark.parametrize("da,db", [(6, 6), (4, 7), (7, 4)])
def test_procrustes_equals_torch_svd_reference(da, db):
    c = RNG.standard_normal((da, db))
    r, rank = bico.procrustes(c)
    ref = ref_map(torch.from_numpy(c)).numpy()
    assert rank == min(da, db)
    assert np.allclose(r, ref, atol=1e-5)
    if da <= db:
        assert np.allclose(r @ r.T, np.eye(da), atol=1e-5)
    else:
        assert np.allclose(r.T @ r, np.eye(db), atol=1e-5)


def test_procrustes_from_accumulator_recovers_planted_rotation():
    g = torch.Generator().manual_seed(5)
    q = random_orthogonal(9, g).numpy()
    xa = randn(200, 9)
    xb = xa @ q                       # X_B = X_A Q: the answer is Q
    with bico.Procrustes() as p:
        r, rank = p.solve(bico.XCov(9, 9).add(xa, xb))
        assert rank == 9
        assert np.allclose(r, q, atol=1e-5)
        s = p.spectrum()
        ref_s = np.linalg.svd(xa.astype(np.float64).T @ xb, compute_uv=False)
        assert np.allclose(s, ref_s, rtol=1e-6)


def test_procrustes_rank_and_drop_completion():
    u = RNG.standard_normal((6, 2))
    v = RNG.standard_normal((5, 2))
    c = u @ v.T                       # rank 2
    r_keep, k1 = bico.procrustes(c)
    r_drop, k2 = bico.procrustes(c, null="drop")
    assert k1 == k2 == 2
    uu, s, vh = np.linalg.svd(c, full_matrices=False)
    assert np.allclose(r_drop, uu[:, :2] @ vh[:2], atol=1e-5)
    assert np.allclose(r_keep.T @ r_keep, np.eye(5), atol=1e-5)


# ---- transport, baselines, depth map ----

def test_transport_kernels_equal_reference():
    tau = randn(6, 5)
    r_out = np.linalg.qr(RNG.standard_normal((6, 6)))[0][:, :4].astype(
        np.float32)                                    # 6 x 4
    r_in = np.linalg.qr(RNG.standard_normal((5, 5)))[0][:, :3].astype(
        np.float32)                                    # 5 x 3
    ref = r_out.T.astype(np.float64) @ tau @ r_in
    assert np.allclose(bico.transport.weight(tau, r_out, r_in, alpha=2.0),
                       2 * ref, atol=1e-5)
    acc = np.ones((4, 3), np.float32)
    bico.transport.weight(tau, r_out, r_in, out=acc, beta=1.0)
    assert np.allclose(acc, 1 + ref, atol=1e-5)
    # None is the rectangular identity (one-sided ablations)
    one = bico.transport.weight(tau, None, r_in, d_out_b=8)
    assert one.shape == (8, 3)
    assert np.allclose(one[:6], tau @ r_in, atol=1e-5) and not one[6:].any()
    v = randn(6)
    assert np.allclose(bico.transport.vector(v, r_out), r_out.T @ v,
                       atol=1e-5)
    t = randn(2, 3, 6)
    assert np.allclose(bico.transport.rows(t, r_out), t @ r_out, atol=1e-5)
    blocks = [np.linalg.qr(RNG.standard_normal((2, 2)))[0].astype(np.float32)
              for _ in range(3)]
    sp = bico.transport.weight_split(tau, blocks, r_in)
    ref_sp = np.concatenate([blocks[i].T @ tau[2 * i:2 * i + 2] @ r_in
                             for i in range(3)])
    assert np.allclose(sp, ref_sp, atol=1e-5)


def test_baselines_and_depthmap():
    tau = randn(2, 3)
    assert np.allclose(bico.naive(tau, (2, 3), alpha=3.0), 3 * tau)
    p = bico.pad(tau, (3, 2))
    assert np.allclose(p[:2], tau[:, :2]) and not p[2].any()
    for la, lb in ((4, 6), (12, 6), (1, 3), (5, 1), (3, 3)):
        want = [0] if lb == 1 else [int(np.floor(j * (la - 1) / (lb - 1)
                                                 + 0.5)) for j in range(lb)]
        assert bico.depthmap(la, lb) == want


# ---- GradFix ----

def test_gradfix_mask_equals_reference():
    grads = [randn(4, 5) for _ in range(7)]
    tau = randn(4, 5)
    tau[0, 0] = 0.0
    v = bico.Votes((4, 5), mean=True)
    for g in grads:
        v.add(g)
    votes = sum(np.sign(-g) for g in grads).astype(np.int32)
    assert np.array_equal(v.counts(), votes)
    ref_mask = (np.sign(tau) == np.sign(votes)) & (votes != 0)
    mask, kept = v.mask(tau)
    assert np.array_equal(mask.astype(bool), ref_mask)
    assert kept == ref_mask.sum()
    upd, _ = v.apply(tau, alpha=0.5)
    assert np.allclose(upd, 0.5 * tau * ref_mask)
    mean_dir = np.sign(-sum(g.astype(np.float64) for g in grads))
    ref_mean = (np.sign(tau) == mean_dir) & (mean_dir != 0)
    assert np.array_equal(v.mask(tau, "mean")[0].astype(bool), ref_mean)
    with pytest.raises(bico.BicoError) as e:
        v.add(randn(3))
    assert e.value.status == bico.E_SHAPE


# ---- safetensors ----

def test_safetensors_round_trip_every_dtype(tmp_path):
    p = str(tmp_path / "t.safetensors")
    tensors = {"f32": randn(3, 4), "f16": randn(5).astype(np.float16),
               "f64": RNG.standard_normal((2, 2)),
               "i8": np.arange(-3, 3, dtype=np.int8),
               "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
               "i64": np.array([-(2 ** 40), 7], np.int64),
               "u8": np.arange(4, dtype=np.uint8),
               "b": np.array([True, False]),
               "scalar": np.array(2.5, np.float32),
               "empty": np.zeros((0, 3), np.float32)}
    bf = randn(4)
    bico.safetensors.write(p, dict(tensors, bf16=bf), metadata={"k": "v"},
                           dtypes={"bf16": "BF16"})
    back, meta = bico.safetensors.read(p, with_metadata=True)
    assert meta == {"k": "v"}
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert np.array_equal(back[k], v), k
    # BF16 keeps the top 16 bits (round to nearest even)
    as_bf = torch.from_numpy(bf).to(torch.bfloat16).float().numpy()
    assert np.array_equal(back["bf16"], as_bf)
    # an independent reader: the header is JSON after an 8-byte length
    import json
    import struct
    raw = open(p, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    assert hdr["f32"]["dtype"] == "F32" and hdr["f32"]["shape"] == [3, 4]
    b, e = hdr["f32"]["data_offsets"]
    assert np.array_equal(np.frombuffer(raw[8 + n + b:8 + n + e], "<f4")
                          .reshape(3, 4), tensors["f32"])


def test_failed_write_leaves_existing_file_untouched(tmp_path):
    p = str(tmp_path / "keep.safetensors")
    bico.safetensors.write(p, {"a": randn(3)})
    before = open(p, "rb").read()
    with pytest.raises(bico.BicoError) as e:  # 70000 overflows F16
        bico.safetensors.write(p, {"a": np.array([70000.0], np.float32)},
                               dtypes={"a": "F16"})
    assert e.value.status == bico.E_NONFINITE and "a" in e.value.message
    assert open(p, "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["keep.safetensors"]


def test_model_graph_and_pairing(tmp_path):
    a, b = Tiny(depth=4), Tiny(d=12, hidden=20, depth=6)
    p = str(tmp_path / "b.safetensors")
    bico.safetensors.write(p, b.state_dict())
    mb = bico.Model.open(p)
    ma = bico.Model.from_shapes({k: v.shape for k, v in
                                 a.state_dict().items()})
    assert mb.blocks() == ("blocks", 6) and ma.blocks() == ("blocks", 4)
    mods = {m[0]: m for m in mb.modules()}
    assert mods["blocks.2.attn.qkv"][1:3] == ("linear", 2)
    assert mods["blocks.2.norm1"][1] == "elementwise"
    assert mods["head"][2] == -1
    assert mb.module_dims("blocks.0.mlp.fc1") == (20, 12)
    roles = {t[0]: t[3] for t in mb.tensors()}
    assert roles["cls_token"] == "token" and roles["head.bias"] == "bias"
    for j in range(6):
        i = int(np.floor(j * 3 / 5 + 0.5))
        assert mb.source_name(ma, "blocks.%d.mlp.fc2.weight" % j) == \
            "blocks.%d.mlp.fc2.weight" % i
    assert mb.source_name(ma, "head.weight") == "head.weight"
    with pytest.raises(bico.BicoError) as e:
        mb.module_dims("blocks.9.mlp.fc1")
    assert e.value.status == bico.E_NOTFOUND


# ---- BiCo end to end on a small transformer ----

MODS = ["patch_embed", "norm", "head"] + [
    "blocks.%d.%s" % (i, m) for i in range(2)
    for m in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1",
              "mlp.fc2")]
SPLIT = {"blocks.%d.attn.qkv" % i: 3 for i in range(2)}
TIES = {"cls_token": "patch_embed", "pos_embed": "patch_embed"}


def test_bico_equals_torch_reference_on_small_transformer():
    torch.manual_seed(0)
    a = Tiny(d=8, heads=2, hidden=16, depth=2)
    b = Tiny(d=12, heads=2, hidden=20, depth=2)
    data = batches()
    stats = stored_statistics(a, b, data, mse_loss, {m: m for m in MODS},
                              SPLIT)
    a_ft = perturbed(a)
    sa, sb = a.state_dict(), b.state_dict()
    ref = ref_bico(sa, a_ft, sb, stats, lambda n: n, SPLIT, TIES, alpha=1.5)
    got = bico.transfer_state_dict(
        sa, a_ft, sb, {k: v.numpy() for k, v in stats.items()},
        alpha=1.5, ties=TIES)
    for k in sb:
        assert got[k].dtype == sb[k].dtype and got[k].shape == sb[k].shape
        assert torch.allclose(got[k], ref[k], atol=1e-4, rtol=1e-4), k
        if k not in ("head.bias",):
            assert not torch.equal(got[k], sb[k]), k  # every tensor moved


def test_planted_rotated_permuted_copy_recovered_exactly():
    torch.manual_seed(0)
    d, heads, hidden, depth = 8, 2, 16, 2
    a = Tiny(d=d, heads=heads, hidden=hidden, depth=depth)
    T = planted_transform(a.state_dict(), d, heads, hidden, depth)
    b = Tiny(d=d, heads=heads, hidden=hidden, depth=depth)
    b.load_state_dict(T(a.state_dict()))
    data = batches()
    x = data[0][0]
    assert torch.allclose(a(x), b(x), atol=1e-4)  # B computes what A does
    a_ft = perturbed(a, scale=0.02)
    col = bt.collect_statistics(a, b, data, mse_loss, show_progress=False)
    report = []
    got = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(), col,
                                 report=report)
    assert len(report) == len(want := T(a_ft))
    ranks = [(m, x.info()[:2], p.solve(x)[1]) for m, v in
             col.statistics().items() for x in (v if isinstance(v, list)
                                                 else [v])
             for p in [bico.Procrustes()]]
    # every map the transfer uses has full rank (norms are carried by their
    # input map; the final norm's output gradients only span the head's
    # row space)
    assert all(r == min(d) for m, d, r in ranks
               if not ("norm" in m and m.endswith("out_xcov"))), ranks
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-4), k
    # naive transfer is not the same thing
    naive = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(),
                                   method="naive")
    assert not torch.allclose(naive["blocks.0.mlp.fc1.weight"],
                              want["blocks.0.mlp.fc1.weight"], atol=1e-3)
    ft_a = Tiny(d=d, heads=heads, hidden=hidden, depth=depth)
    ft_a.load_state_dict(a_ft)
    b.load_state_dict(got)
    with torch.no_grad():
        assert torch.allclose(b(x), ft_a(x), atol=1e-4)


# ---- threads (issue 22) ----

def test_one_xcov_from_eight_threads_equals_the_serial_sum():
    """ctypes releases the GIL during each C call: one XCov fed from 8
    Python threads gave a matrix off by 1.2 %.  The binding serialises the
    calls on a handle (and on its context), so the result is the planted
    sum of x_a^T x_b over every batch, as the serial run gives."""
    import threading
    rng = np.random.default_rng(22)
    batches = [(rng.standard_normal((256, 192)).astype(np.float32),
                rng.standard_normal((256, 160)).astype(np.float32))
               for _ in range(8 * 12)]
    want = sum(a.astype(np.float64).T @ b.astype(np.float64) for a, b in batches)
    xc = bico.XCov(192, 160, sums=True, grams=True)
    errors = []

    def work(k):
        try:
            for a, b in batches[k::8]:
                xc.add(a, b)
                xc.rows  # a read between the writes, as a progress bar would
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in ts)
    assert xc.rows == 256 * len(batches)
    got = xc.matrix()
    serial = bico.XCov(192, 160, sums=True, grams=True)
    for a, b in batches:
        serial.add(a, b)
    np.testing.assert_allclose(serial.matrix(), want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(xc.matrix("gram_a"), serial.matrix("gram_a"),
                               rtol=1e-9, atol=1e-9)


def test_procrustes_solve_rows_against_the_statistic_and_numpy():
    """Procrustes.solve_rows: with more rows than widths it equals the
    statistic's solve; with fewer (the thin solve) its identified part is
    U_r V_r^T of X_a^T X_b (NumPy's SVD, independent); rows that do not
    correspond are refused."""
    g = np.random.default_rng(7)
    xa, xb = g.standard_normal((40, 6)), g.standard_normal((40, 5))
    with bico.Procrustes() as p, bico.XCov(6, 5) as xc:
        xc.add(xa.astype(np.float32), xb.astype(np.float32))
        full, rank = p.solve(xc)
        r, rank_r, thin = p.solve_rows(xa, xb)
        assert not thin and rank_r == rank == 5
        np.testing.assert_allclose(r, full, atol=1e-6)
        ya, yb = g.standard_normal((3, 6)), g.standard_normal((3, 5))
        r, rank_r, thin = p.solve_rows(ya, yb)
        assert thin and rank_r == 3 and r.shape == (6, 5)
        u, s, vt = np.linalg.svd(ya.astype(np.float32).astype(np.float64).T
                                 @ yb.astype(np.float32).astype(np.float64))
        u, v = u[:, :3], vt[:3].T
        np.testing.assert_allclose(u @ u.T @ r @ v @ v.T, u @ v.T,
                                   atol=1e-5)
        with pytest.raises(bico.BicoError):
            p.solve_rows(ya, yb[:2])
