"""bico.lora, the ctypes wrappers of lora.h and merge.h, against numpy
references computed here.  Skipped where the binding (bindings/python, the
`py` branch) is not present."""
import json
import os

import numpy as np
import pytest

bico = pytest.importorskip("bico")
bl = pytest.importorskip("bico.lora")


def test_factored_transport_and_truncation():
    g = np.random.default_rng(0)
    B, A = g.normal(size=(6, 3)), g.normal(size=(3, 5))
    Ro, _ = np.linalg.qr(g.normal(size=(9, 9)))
    Ri, _ = np.linalg.qr(g.normal(size=(7, 7)))
    Ro, Ri = Ro[:6], Ri[:5]  # semi-orthogonal 6x9 and 5x7
    b2, a2 = bl.transport(B, A, r_out=Ro, r_in=Ri, alpha=2.0)
    want = 2.0 * Ro.T @ (B @ A) @ Ri
    assert np.linalg.norm(b2 @ a2 - want) / np.linalg.norm(want) < 1e-5
    # qkv: three blocks of B's rows, the middle one by the identity.
    Bq = g.normal(size=(12, 2))
    R0, R2 = Ro[:4, :5], Ro[2:6, 1:6]
    b3, _ = bl.transport(Bq, A[:2], r_out=[R0, None, R2])
    np.testing.assert_allclose(b3[:5], R0.T @ Bq[:4], atol=1e-5)
    np.testing.assert_allclose(b3[5:10], np.vstack([Bq[4:8], np.zeros((1, 2))]), atol=1e-6)
    np.testing.assert_allclose(b3[10:], R2.T @ Bq[8:], atol=1e-5)
    d = g.normal(size=(8, 2)) @ g.normal(size=(2, 6))
    bt_, at_, e = bl.truncate(d, 2, scale=4.0)
    assert e == pytest.approx(1.0)
    np.testing.assert_allclose(4.0 * bt_ @ at_, d, atol=1e-4)


def test_adapter_round_trip_and_refusal(tmp_path):
    g = np.random.default_rng(1)
    ad = bl.Adapter()
    ad.set_flag("rslora", True)
    ad.set_string("task_type", "CAUSAL_LM")
    ad.add_module("layers.0.q", g.normal(size=(4, 2)), g.normal(size=(2, 3)), 8)
    ad.add_module("embed", g.normal(size=(3, 2)), g.normal(size=(2, 10)), 4,
                  kind="embedding")
    ad.add_saved("head.weight", "head", g.normal(size=(2, 3)))
    ad.save(tmp_path / "a")
    back = bl.Adapter.open(tmp_path / "a")
    assert back.flag("rslora") and back.string("task_type") == "CAUSAL_LM"
    m0, m1 = ad.modules(), back.modules()
    assert m0.keys() == m1.keys()
    for k in m0:
        assert m0[k][0] == m1[k][0]
        np.testing.assert_array_equal(m0[k][1], m1[k][1])
        np.testing.assert_array_equal(m0[k][2], m1[k][2])
        assert m1[k][4] == pytest.approx(m1[k][3] / np.sqrt(2))
    np.testing.assert_array_equal(back.saved()["head.weight"][1],
                                  ad.saved()["head.weight"][1])
    cfg = json.load(open(tmp_path / "a" / "adapter_config.json"))
    cfg["use_dora"] = True
    json.dump(cfg, open(tmp_path / "a" / "adapter_config.json", "w"))
    with pytest.raises(bico.BicoError) as e:
        bl.Adapter.open(tmp_path / "a")
    assert e.value.status == bico.E_UNSUPPORTED and "use_dora" in str(e.value)


def test_merge_tensors_linear_and_ties():
    t = [np.array([2, -3, 1, 0], np.float32), np.array([-1, -1, 2, 5], np.float32)]
    np.testing.assert_allclose(bl.merge_tensors(t, [1, 0.5]), [1.5, -3.5, 2, 2.5])
    np.testing.assert_allclose(bl.merge_tensors(t, [1, 0.5], method="ties"),
                               [2, -3.5 / 1.5, 2 / 1.5, 5], rtol=1e-6)


def test_transfer_and_merge_files(tmp_path):
    g = np.random.default_rng(2)
    base = {"fc.weight": g.normal(size=(4, 3)).astype(np.float32)}
    bico.safetensors.write(str(tmp_path / "base.safetensors"), base)
    ad = bl.Adapter()
    B, A = g.normal(size=(4, 2)), g.normal(size=(2, 3))
    ad.add_module("fc", B, A, 4)
    ad.save(tmp_path / "ad")
    bl.transfer(tmp_path / "base.safetensors", tmp_path / "base.safetensors",
                tmp_path / "ad", output_lora=tmp_path / "out",
                merged_output=tmp_path / "m.safetensors", method="naive")
    out = bl.Adapter.open(tmp_path / "out").modules()["fc"]
    np.testing.assert_allclose(out[1] @ out[2], np.float32(B) @ np.float32(A), rtol=1e-5)
    m = bico.safetensors.read(str(tmp_path / "m.safetensors"))["fc.weight"]
    np.testing.assert_allclose(m, base["fc.weight"] + 2 * out[1] @ out[2], atol=1e-5)
    bl.merge(tmp_path / "base.safetensors", [("lora", tmp_path / "out", 0.5, 1.0)],
             tmp_path / "mm.safetensors")
    mm = bico.safetensors.read(str(tmp_path / "mm.safetensors"))["fc.weight"]
    np.testing.assert_allclose(mm, base["fc.weight"] + out[1] @ out[2], atol=1e-5)


def test_merge_takes_max_shard_size_like_bico_merge(tmp_path):
    """bico.lora.merge reaches every merge parameter of the library (its
    table used to lack max_shard_size): an output folder is sharded by it,
    and the shards read back as base + alpha * tau."""
    import json
    g = np.random.default_rng(5)
    base = {"layer.%d.w" % i: g.standard_normal((50, 40)).astype(np.float32)
            for i in range(5)}  # 8000 bytes each
    tau = {k: g.standard_normal(v.shape).astype(np.float32)
           for k, v in base.items()}
    bico.safetensors.write(str(tmp_path / "base.safetensors"), base)
    bico.safetensors.write(str(tmp_path / "tau.safetensors"), tau)
    out = tmp_path / "merged"
    bl.merge(tmp_path / "base.safetensors",
             [("task_vector", tmp_path / "tau.safetensors", 1.0, 1.0)],
             str(out) + "/", alpha=0.5, max_shard_size=17000)
    idx = json.load(open(out / "model.safetensors.index.json"))
    assert len(set(idx["weight_map"].values())) == 3
    back = bico.safetensors.read(str(out))
    for k in base:
        np.testing.assert_allclose(back[k], base[k] + 0.5 * tau[k], atol=1e-5)
    with pytest.raises(bico.BicoError):
        bl.merge(tmp_path / "base.safetensors",
                 [("task_vector", tmp_path / "tau.safetensors", 1.0, 1.0)],
                 str(tmp_path / "bad") + "/", max_shard_size=-1)
