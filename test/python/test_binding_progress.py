"""Python's Transfer: progress callbacks (bico_transfer_set_progress) and
source_rename, checked against what the run did (the output's tensors,
the counts) rather than against the binding's own arithmetic."""
import os

import numpy as np
import pytest

bico = pytest.importorskip("bico")
HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402

NAMES = ["blocks.%d.fc.weight" % i for i in range(3)] + ["head.weight"]


def files(tmp_path, prefix=""):
    rng = np.random.default_rng(4)
    a = {n: rng.standard_normal((6, 5)).astype(np.float32) for n in NAMES}
    tau = {n: 0.1 * rng.standard_normal((6, 5)).astype(np.float32) for n in NAMES}
    pl.save(str(tmp_path / "A.safetensors"), {prefix + n: v for n, v in a.items()})
    pl.save(str(tmp_path / "Aft.safetensors"),
            {prefix + n: a[n] + tau[n] for n in NAMES})
    pl.save(str(tmp_path / "B.safetensors"), a)
    return a, tau


def test_progress_reaches_every_tensor_once(tmp_path):
    a, tau = files(tmp_path)
    seen = []
    out = tmp_path / "out.safetensors"
    got = bico.transfer_files(tmp_path / "A.safetensors", tmp_path / "B.safetensors", out,
                              source_tuned=tmp_path / "Aft.safetensors", method="naive",
                              progress=seen.append)
    assert got == (len(NAMES), 0)
    assert [p["tensors_done"] for p in seen] == list(range(1, len(NAMES) + 1))
    assert all(p["tensors_total"] == len(NAMES) for p in seen)
    assert sorted(p["tensor"] for p in seen) == sorted(NAMES)
    dones = [p["done"] for p in seen]
    assert dones == sorted(dones) and dones[-1] == pytest.approx(seen[-1]["total"])
    assert all(p["elapsed"] >= 0 for p in seen)
    o, _, _ = pl.load(str(out))
    for n in NAMES:  # and the run did what it reported
        np.testing.assert_allclose(o[n], a[n] + tau[n], rtol=1e-6, atol=1e-6)


def test_an_exception_in_the_callback_is_raised_by_run(tmp_path):
    files(tmp_path)
    calls = []

    def boom(p):
        calls.append(p)
        raise KeyError("from the callback")

    t = bico.Transfer(progress=boom)
    t.set_file("source_base", tmp_path / "A.safetensors")
    t.set_file("source_tuned", tmp_path / "Aft.safetensors")
    t.set_file("target_base", tmp_path / "B.safetensors")
    t.set_file("output", tmp_path / "out.safetensors")
    t.set("method", "naive")
    with pytest.raises(KeyError, match="from the callback"):
        t.run()
    assert len(calls) == 1  # not called again once it failed
    t.set_progress(None)
    assert t.run() == (len(NAMES), 0)  # and the handle is usable again
    with pytest.raises(TypeError):
        t.set_progress(42)
    t.close()


def test_source_rename_pairs_a_prefixed_source(tmp_path):
    a, tau = files(tmp_path, prefix="net.")
    args = (tmp_path / "A.safetensors", tmp_path / "B.safetensors", tmp_path / "out.safetensors")
    kw = dict(source_tuned=tmp_path / "Aft.safetensors", method="naive")
    lines = []
    # the blocks pair by their container; head.weight has no partner, and
    # the run names the rename that pairs everything
    assert bico.transfer_files(*args, log=lines.append, **kw) == (len(NAMES) - 1, 1)
    assert any("'net.='" in line for line in lines), lines
    assert bico.transfer_files(*args, source_rename="net.=", **kw) == (len(NAMES), 0)
    o, _, _ = pl.load(str(args[2]))
    for n in NAMES:
        np.testing.assert_allclose(o[n], a[n] + tau[n], rtol=1e-6, atol=1e-6)


def test_safetensors_write_makes_a_sharded_model_folder(tmp_path):
    """bico.safetensors.write into a folder: shards by max_shard_size, an
    index whose weight_map covers every tensor once, and the tensors read
    back (by the library and by a plain reader of each shard)."""
    import json
    from bico import safetensors as st
    rng = np.random.default_rng(8)
    t = {"layer.%d.w" % i: rng.standard_normal((50, 40)).astype(np.float32)
         for i in range(5)}  # 8000 bytes each
    out = tmp_path / "model"
    st.write(str(out) + "/", t, metadata={"format": "pt"}, max_shard_size=17000)
    idx = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) == 3 and sorted(idx["weight_map"]) == sorted(t)
    assert idx["metadata"]["total_size"] == 5 * 8000
    seen = {}
    for s in shards:
        got, meta, _ = pl.load(str(out / s))
        assert os.path.getsize(out / s) <= 17000 + 1024  # header aside
        seen.update(got)
    assert sorted(seen) == sorted(t)
    back = st.read(str(out))
    for n, v in t.items():
        np.testing.assert_array_equal(seen[n], v)
        np.testing.assert_array_equal(back[n], v)
    # sharded as `like` is: same names, same tensor -> file assignment
    out2 = tmp_path / "again"
    st.write(str(out2), t, like=str(out))
    assert json.load(open(out2 / "model.safetensors.index.json"))["weight_map"] == \
        idx["weight_map"]
    with pytest.raises(TypeError):
        st.write(str(tmp_path / "x") + "/", t, max_shard_size=1.5)
