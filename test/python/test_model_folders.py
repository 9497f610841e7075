"""Hugging Face model folders as inputs: every command that opens a model
accepts the folder (config.json + model.safetensors, or the sharded index);
folders and files that hold something else are named for what they are."""
import json
import os

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402

from cli import bico, same_bytes  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("folders")
    rng = np.random.default_rng(11)
    shapes = {"l0.weight": (6, 4), "l0.bias": (6,), "l1.weight": (3, 6),
              "l1.bias": (3,)}
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    ft = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
          for k, v in base.items()}
    out = {}
    for name, sd in (("A", base), ("Aft", ft)):
        f = d / f"{name}.safetensors"
        pl.save(str(f), sd, {"format": "pt"})
        out[name] = f
        folder = d / f"{name}_hf"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "mlp"}))
        (folder / "tokenizer.json").write_text("{}")
        pl.save(str(folder / "model.safetensors"), sd, {"format": "pt"})
        out[name + "_hf"] = folder
    # A sharded folder: two shards and the index.
    sh = d / "A_sharded"
    sh.mkdir()
    names = list(base)
    parts = {"model-00001-of-00002.safetensors": names[:2],
             "model-00002-of-00002.safetensors": names[2:]}
    wm = {}
    for fn, keys in parts.items():
        pl.save(str(sh / fn), {k: base[k] for k in keys})
        wm.update({k: fn for k in keys})
    (sh / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": wm}))
    out["A_sharded"] = sh
    return d, out


def test_folders_equal_files_for_transfer(models, tmp_path):
    d, m = models
    bico("transfer", "--method", "naive", "--quiet", "--source-base", m["A"],
         "--source-tuned", m["Aft"], "--target-base", m["A"],
         "--output", tmp_path / "files.safetensors")
    bico("transfer", "--method", "naive", "--quiet", "--source-base", m["A_hf"],
         "--source-tuned", str(m["Aft_hf"]) + "/", "--target-base", m["A_sharded"],
         "--output", tmp_path / "folders.safetensors")
    a, _, _ = pl.load(str(tmp_path / "files.safetensors"))
    b, _, _ = pl.load(str(tmp_path / "folders.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_inspect_and_merge_take_folders(models, tmp_path):
    d, m = models
    r = bico("inspect", m["A_hf"])
    assert "l0" in r.stdout
    bico("merge", "--quiet", "--base", m["A_hf"], "--tuned", m["Aft_hf"],
         "--output", tmp_path / "m1.safetensors")
    bico("merge", "--quiet", "--base", m["A"], "--tuned", m["Aft"],
         "--output", tmp_path / "m2.safetensors")
    t1, meta1, o1 = pl.load(str(tmp_path / "m1.safetensors"))
    t2, meta2, o2 = pl.load(str(tmp_path / "m2.safetensors"))
    assert o1 == o2 and all(np.array_equal(t1[k], t2[k]) for k in t1)
    # the same but for the provenance's file names
    assert meta1["bico.base"] == str(m["A_hf"]) and meta2["bico.base"] == str(m["A"])
    drop = ("bico.base", "bico.input.1")
    assert ({k: v for k, v in meta1.items() if k not in drop}
            == {k: v for k, v in meta2.items() if k not in drop})


def test_folders_that_hold_something_else(models, tmp_path):
    d, m = models
    empty = tmp_path / "empty"
    empty.mkdir()
    r = bico("inspect", empty, ok=False)
    assert r.returncode == 1 and "without model.safetensors" in r.stderr and str(empty) in r.stderr

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    pl.save(str(adapter / "adapter_model.safetensors"), {"x": np.zeros(2, np.float32)})
    r = bico("inspect", adapter, ok=False)
    assert r.returncode == 1 and "PEFT adapter" in r.stderr and "--lora" in r.stderr

    pt = tmp_path / "pt"
    pt.mkdir()
    torch.save({"l0.weight": torch.zeros(2, 2)}, pt / "pytorch_model.bin")
    r = bico("inspect", pt, ok=False)
    assert r.returncode == 1 and "PyTorch pickles" in r.stderr and "bico.convert" in r.stderr


@pytest.mark.parametrize("legacy", [False, True])
def test_pickle_file_is_named_with_the_converter(tmp_path, legacy):
    f = tmp_path / "model.bin"
    kw = dict(_use_new_zipfile_serialization=False) if legacy else {}
    torch.save({"l0.weight": torch.zeros(2, 2)}, f, **kw)
    r = bico("inspect", f, ok=False)
    assert r.returncode == 1
    assert "a PyTorch pickle, not safetensors" in r.stderr, r.stderr
    assert f"python3 -m bico.convert {f}" in r.stderr


def test_a_single_oddly_named_safetensors_in_a_folder(models, tmp_path):
    d, m = models
    folder = tmp_path / "one"
    folder.mkdir()
    a, _, _ = pl.load(str(m["A"]))
    pl.save(str(folder / "weights.safetensors"), a)
    r = bico("inspect", folder)
    assert "l0" in r.stdout
    pl.save(str(folder / "other.safetensors"), a)
    r = bico("inspect", folder, ok=False)
    assert r.returncode == 1 and "without model.safetensors" in r.stderr


def test_output_keeps_target_metadata_and_says_where_it_came_from(models, tmp_path):
    d, m = models
    out = tmp_path / "o.safetensors"
    delta = tmp_path / "d.safetensors"
    bico("transfer", "--method", "naive", "--quiet", "--alpha", "0.5",
         "--source-base", m["A"], "--source-tuned", m["Aft_hf"],
         "--target-base", m["A_hf"], "--delta-output", delta, "--output", out)
    for f in (out, delta):
        _, meta, _ = pl.load(str(f))
        assert meta["format"] == "pt"            # the target's own metadata
        assert meta["bico.method"] == "naive" and meta["bico.alpha"] == "0.5"
        assert meta["bico.source_base"] == str(m["A"])
        assert meta["bico.source_tuned"] == str(m["Aft_hf"])
        assert meta["bico.target_base"] == str(m["A_hf"])
        assert meta["bico.version"].count(".") == 2


def test_a_checkpoint_is_never_written_under_a_json_name(models, tmp_path):
    d, m = models
    for name in ("model.safetensors.index.json", "x.json"):
        out = tmp_path / name
        r = bico("transfer", "--method", "naive", "--quiet", "--source-base", m["A"],
                 "--source-tuned", m["Aft"], "--target-base", m["A"],
                 "--output", out, ok=False)
        assert r.returncode != 0 and "sharded checkpoint's index" in r.stderr, r.stderr
        assert not out.exists()
        assert not [f for f in os.listdir(tmp_path) if "bico-tmp" in f]


def test_a_run_that_pairs_too_little_fails_loudly(tmp_path):
    """A BERT-named source for a ViT-named target pairs nothing: the run
    fails, says why and how much paired, and writes nothing; with
    --allow-partial it runs (and says so in the pairing line)."""
    pl.save(str(tmp_path / "vit.safetensors"),
            {"blocks.0.attn.qkv.weight": np.ones((6, 2), np.float32),
             "head.weight": np.ones((3, 2), np.float32)})
    pl.save(str(tmp_path / "bert.safetensors"),
            {"bert.encoder.layer.0.attention.self.query.weight": np.ones((2, 2), np.float32),
             "classifier.weight": np.ones((3, 2), np.float32)})
    args = ["transfer", "--method", "naive", "--source-base", tmp_path / "bert.safetensors",
            "--source-tuned", tmp_path / "bert.safetensors",
            "--target-base", tmp_path / "vit.safetensors",
            "--output", tmp_path / "o.safetensors"]
    r = bico(*args, ok=False)
    assert r.returncode == 1
    assert "only 0.0 % of the target's parameters pair" in r.stderr
    assert "--allow-partial" in r.stderr and "weights 0/2" in r.stderr
    assert not (tmp_path / "o.safetensors").exists()
    r = bico(*args, "--allow-partial")
    assert "pairing: 0.0 %" in r.stderr
    assert (tmp_path / "o.safetensors").exists()


# ---- output folders ----

def _nbytes(a):
    return a.size * a.dtype.itemsize


def _hf_target(d, sd, shards=None, extra=True):
    """A Hugging Face folder for sd: config, tokenizer, README, generation
    config, a sub-folder and a pickle beside the safetensors weights
    (shards: {file: [names]} with its index, else one model.safetensors)."""
    d.mkdir()
    if extra:
        (d / "config.json").write_text(json.dumps({"model_type": "mlp", "x": 1}))
        (d / "tokenizer.json").write_text('{"version": "1.0"}')
        (d / "generation_config.json").write_text("{}")
        (d / "README.md").write_text("# a model\n")
        (d / "pytorch_model.bin").write_bytes(b"not copied")
        (d / "sub").mkdir()
        (d / "sub" / "x.txt").write_text("sub-folders stay behind")
    if shards is None:
        pl.save(str(d / "model.safetensors"), sd, {"format": "pt"})
        return d
    wm = {}
    for fn, keys in shards.items():
        pl.save(str(d / fn), {k: sd[k] for k in keys}, {"format": "pt"})
        wm.update({k: fn for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(_nbytes(sd[k]) for k in wm)},
         "weight_map": wm}))
    return d


def _read_folder(d):
    """({name: array}, {name: shard file}, [per-shard metadata]) of an output
    folder, read with the test's own reader and the index (if any)."""
    idx = d / "model.safetensors.index.json"
    if idx.exists():
        wm = json.loads(idx.read_text())["weight_map"]
        files = sorted(set(wm.values()))
    else:
        files = ["model.safetensors"]
        wm = None
    tensors, where, metas = {}, {}, []
    for fn in files:
        t, meta, _ = pl.load(str(d / fn))
        metas.append(meta)
        for k, v in t.items():
            assert k not in tensors, k
            tensors[k] = v
            where[k] = fn
    if wm is not None:
        assert wm == where            # the index names every tensor's file
    return tensors, where, metas


def _naive(m, target, out, *extra, ok=True):
    return bico("transfer", "--method", "naive", "--quiet", "--source-base", m["A"],
                "--source-tuned", m["Aft"], "--target-base", target,
                "--output", out, *extra, ok=ok)


@pytest.fixture()
def base_sd():
    rng = np.random.default_rng(11)
    shapes = {"l0.weight": (6, 4), "l0.bias": (6,), "l1.weight": (3, 6),
              "l1.bias": (3,)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def test_output_folder_follows_a_sharded_target(models, tmp_path, base_sd):
    """--output DIR/ with a sharded target folder: the target's files other
    than weights copied byte for byte, the same shard names and
    tensor-to-shard assignment, an index whose total_size is the tensors'
    bytes, the same values as a single-file output."""
    d, m = models
    shards = {"model-00001-of-00002.safetensors": ["l0.weight", "l1.bias"],
              "model-00002-of-00002.safetensors": ["l0.bias", "l1.weight"]}
    tgt = _hf_target(tmp_path / "tgt", base_sd, shards)
    _naive(m, tgt, tmp_path / "ref.safetensors")
    out = tmp_path / "out"
    _naive(m, tgt, str(out) + "/")
    names = sorted(os.listdir(out))
    assert names == sorted(["config.json", "tokenizer.json", "generation_config.json",
                            "README.md", "model.safetensors.index.json", *shards])
    for f in ("config.json", "tokenizer.json", "generation_config.json", "README.md"):
        assert same_bytes(tgt / f, out / f), f
    tensors, where, metas = _read_folder(out)
    ref, _, _ = pl.load(str(tmp_path / "ref.safetensors"))
    assert set(tensors) == set(ref)
    for k in ref:
        assert np.array_equal(tensors[k], ref[k]), k
    assert where == {k: fn for fn, ks in shards.items() for k in ks}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(_nbytes(v) for v in ref.values())
    for meta in metas:
        assert meta["format"] == "pt" and meta["bico.method"] == "naive"
        assert "total_size" not in meta
    # the folder reads back as a model (the reader takes the index)
    _naive(m, out, tmp_path / "again.safetensors")
    again, _, _ = pl.load(str(tmp_path / "again.safetensors"))
    assert set(again) == set(ref)


def test_max_shard_size_fills_shards_greedily_in_order(models, tmp_path, base_sd):
    """Sizes: l0.weight 96 B, l0.bias 24 B, l1.weight 72 B, l1.bias 12 B.
    Greedy in declaration order with a new shard whenever the next tensor
    would pass the limit: 120 B -> [96+24] [72+12]; 100 B -> [96] [24+72]
    [12]; 1KB (1000 B) -> one model.safetensors and no index."""
    d, m = models
    tgt = _hf_target(tmp_path / "tgt", base_sd)
    order = ["l0.weight", "l0.bias", "l1.weight", "l1.bias"]
    cases = {"120": [order[:2], order[2:]],
             "100": [order[:1], order[1:3], order[3:]],
             "1KB": [order]}
    for size, groups in cases.items():
        out = tmp_path / f"out{size}"
        _naive(m, tgt, out, "--max-shard-size", size)   # no suffix: a folder
        tensors, where, _ = _read_folder(out)
        n = len(groups)
        want = {k: ("model.safetensors" if n == 1 else
                    f"model-{i + 1:05d}-of-{n:05d}.safetensors")
                for i, g in enumerate(groups) for k in g}
        assert where == want, size
        assert (out / "model.safetensors.index.json").exists() == (n > 1)
        assert (out / "config.json").exists()
    for bad in ("12XB", "-3", "GB", "1e3", "1.5"):
        r = _naive(m, tgt, tmp_path / "bad", "--max-shard-size", bad, ok=False)
        assert r.returncode == 2 and "--max-shard-size" in r.stderr, bad
    assert not (tmp_path / "bad").exists()


def test_the_output_rule_folder_or_file(models, tmp_path, base_sd):
    """A name without .safetensors is a folder when the target is a folder,
    a file when the target is a file; an existing folder is a folder."""
    d, m = models
    tgt = _hf_target(tmp_path / "tgt", base_sd)
    _naive(m, tgt, tmp_path / "o1")
    assert (tmp_path / "o1" / "model.safetensors").is_file()
    _naive(m, m["A"], tmp_path / "o2")
    assert (tmp_path / "o2").is_file()
    (tmp_path / "o3").mkdir()
    _naive(m, m["A"], tmp_path / "o3")
    assert (tmp_path / "o3" / "model.safetensors").is_file()
    assert not (tmp_path / "o3" / "config.json").exists()  # target was a file


def test_an_existing_output_folder_keeps_other_files_loses_stale_shards(
        models, tmp_path, base_sd):
    d, m = models
    tgt = _hf_target(tmp_path / "tgt", base_sd)
    out = tmp_path / "out"
    _naive(m, tgt, out, "--max-shard-size", "100")       # three shards
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("old config")
    (out / "adapter_model.safetensors").write_bytes(b"not a shard")
    _naive(m, tgt, out)                                   # one file now
    names = set(os.listdir(out))
    assert "model.safetensors" in names
    assert not [n for n in names if n.startswith("model-") or "index" in n], names
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "adapter_model.safetensors").read_bytes() == b"not a shard"
    assert same_bytes(out / "config.json", tgt / "config.json")
    _naive(m, tgt, out, "--max-shard-size", "120")       # two shards
    assert "model.safetensors" not in os.listdir(out)
    assert len(_read_folder(out)[0]) == 4


def test_failed_folder_outputs_leave_nothing(models, tmp_path, base_sd):
    d, m = models
    tgt = _hf_target(tmp_path / "tgt", base_sd)
    # alpha times tau overflows float32: the run fails after the writer began
    big = tmp_path / "big.safetensors"
    pl.save(str(big), {k: v + np.float32(3e38) for k, v in base_sd.items()})

    def run(out):
        return bico("transfer", "--method", "naive", "--quiet", "--alpha", "2",
                    "--source-base", m["A"], "--source-tuned", big,
                    "--target-base", tgt, "--output", out, ok=False)
    r = run(tmp_path / "new")
    assert r.returncode == 1 and "overflow" in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("x")
    r = run(keep)
    assert r.returncode == 1 and os.listdir(keep) == ["notes.txt"]
    assert "bico-tmp" not in r.stderr
    # the target's own folder is refused, and stays as it was
    before = {f: (tgt / f).read_bytes() for f in os.listdir(tgt) if (tgt / f).is_file()}
    r = _naive(m, tgt, tgt, ok=False)
    assert r.returncode != 0 and str(tgt) in r.stderr
    assert {f: (tgt / f).read_bytes() for f in os.listdir(tgt)
            if (tgt / f).is_file()} == before


def test_merge_writes_folders_and_keeps_the_base_metadata(models, tmp_path, base_sd):
    d, m = models
    shards = {"model-00001-of-00002.safetensors": ["l0.weight", "l0.bias"],
              "model-00002-of-00002.safetensors": ["l1.weight", "l1.bias"]}
    tgt = _hf_target(tmp_path / "tgt", base_sd, shards)
    bico("merge", "--quiet", "--base", tgt, "--tuned", m["Aft"], "--weight", "0.5",
         "--output", tmp_path / "ref.safetensors")
    ref, meta, _ = pl.load(str(tmp_path / "ref.safetensors"))
    assert meta["format"] == "pt" and meta["bico.method"] == "merge-linear"
    assert meta["bico.base"] == str(tgt) and meta["bico.input.1"] == str(m["Aft"])
    assert "total_size" not in meta
    bico("merge", "--quiet", "--base", tgt, "--tuned", m["Aft"], "--weight", "0.5",
         "--output", tmp_path / "out")
    tensors, where, metas = _read_folder(tmp_path / "out")
    assert where == {k: fn for fn, ks in shards.items() for k in ks}
    for k in ref:
        assert np.array_equal(tensors[k], ref[k]), k
    assert same_bytes(tgt / "config.json", tmp_path / "out" / "config.json")
    assert all(mt == meta for mt in metas)
    bico("merge", "--quiet", "--base", tgt, "--tuned", m["Aft"],
         "--output", tmp_path / "one", "--max-shard-size", "1GB")
    assert sorted(_read_folder(tmp_path / "one")[1].values()) == ["model.safetensors"] * 4


def _bico_tmp(d):
    return [n for n in os.listdir(d) if ".bico-tmp." in n]


def test_links_out_of_the_target_folder_are_refused(models, tmp_path, base_sd):
    """A target folder's link leading out of it (tokenizer.json ->
    ../secret) is refused before anything is written, naming the file; a
    link inside the folder is copied; copies keep their source's mode."""
    d, m = models
    tgt = _hf_target(tmp_path / "tgt", base_sd)
    secret = tmp_path / "secret"
    secret.write_text("password")
    os.chmod(secret, 0o600)
    (tgt / "tokenizer.json").unlink()
    os.symlink("../secret", tgt / "tokenizer.json")
    r = _naive(m, tgt, tmp_path / "out", ok=False)
    assert r.returncode == 1, r.stderr
    assert "tokenizer.json" in r.stderr and "outside the folder" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and not _bico_tmp(tmp_path)
    (tgt / "tokenizer.json").unlink()
    (tgt / "tok.real.json").write_text("{}")
    os.symlink("tok.real.json", tgt / "tokenizer.json")
    os.chmod(tgt / "config.json", 0o600)
    _naive(m, tgt, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    assert not (tmp_path / "out" / "tokenizer.json").is_symlink()
    assert os.stat(tmp_path / "out" / "config.json").st_mode & 0o7777 == 0o600


def test_target_shards_not_named_safetensors_are_not_copied(models, tmp_path, base_sd):
    """A target whose index names shards part1 and part2: the output's
    part1 and part2 hold the new tensors, not copies of the target's."""
    d, m = models
    shards = {"part1": ["l0.weight", "l1.bias"], "part2": ["l0.bias", "l1.weight"]}
    tgt = _hf_target(tmp_path / "tgt", base_sd, shards)
    _naive(m, tgt, tmp_path / "ref.safetensors")
    _naive(m, tgt, tmp_path / "out")
    tensors, where, _ = _read_folder(tmp_path / "out")
    ref, _, _ = pl.load(str(tmp_path / "ref.safetensors"))
    for k in ref:
        assert np.array_equal(tensors[k], ref[k]), k
    assert where == {k: fn for fn, ks in shards.items() for k in ks}


def test_an_old_index_never_deletes_the_users_files(models, tmp_path, base_sd):
    d, m = models
    tgt = _hf_target(tmp_path / "tgt", base_sd)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"l0.weight": "notes.txt", "l0.bias": "config.json"}}))
    _naive(m, tgt, out)
    assert (out / "notes.txt").read_text() == "mine"
    assert same_bytes(out / "config.json", tgt / "config.json")
    assert "model.safetensors.index.json" not in os.listdir(out)


def _immutable(path, on):
    import subprocess
    r = subprocess.run(["chattr", "+i" if on else "-i", str(path)],
                       capture_output=True)
    return r.returncode == 0


def test_stale_weights_that_cannot_be_removed_never_stay_beside_new_ones(
        models, tmp_path, base_sd):
    """An old model.safetensors that cannot be removed (chattr +i, root on
    a file system that has the flag): the new sharded folder never holds
    it; the old tree it stays in is a recognisable temporary beside the
    folder."""
    d, m = models
    tgt = _hf_target(tmp_path / "tgt", base_sd)
    out = tmp_path / "out"
    _naive(m, tgt, out)
    old = out / "model.safetensors"
    (out / "notes.txt").write_text("mine")
    os.chmod(out / "notes.txt", 0o640)
    if not _immutable(old, True):
        pytest.skip("chattr +i is not available here (needs root and ext4 or alike)")
    try:
        # an immutable file cannot be hard-linked (EPERM): the user's
        # notes.txt is carried as a copy, mode kept
        assert _immutable(out / "notes.txt", True)
        r = _naive(m, tgt, out, "--max-shard-size", "100", ok=False)
        names = sorted(os.listdir(out))
        assert r.returncode == 0, r.stderr
        assert "model.safetensors" not in names, names
        assert len(_read_folder(out)[0]) == 4
        assert (out / "notes.txt").read_text() == "mine"
        assert os.stat(out / "notes.txt").st_mode & 0o7777 == 0o640
        left = _bico_tmp(tmp_path)
        assert all(n.startswith(".out.bico-tmp.") for n in left), left
        # and the user is told where the old files wait
        assert left and all(n in r.stderr for n in left), r.stderr
        assert "could not be removed" in r.stderr, r.stderr
    finally:
        for dirpath, _, files in os.walk(tmp_path):
            for f in files:
                _immutable(os.path.join(dirpath, f), False)


def test_a_report_inside_the_output_folder_is_refused(
        models, tmp_path, base_sd):
    """--report OUT/report.json with --output OUT/ (an existing folder, or
    a sub-folder of it spelt with ..): the run writes the folder as a
    whole, so another output inside it is refused before anything is
    written; the folder, the user's file in it, stays as it was and no
    temporary is left beside or inside it."""
    d, m = models
    tgt = _hf_target(tmp_path / "tgt", base_sd)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "runs").mkdir()
    for rep in (out / "report.json", out / "runs" / ".." / "runs" / "r.json"):
        r = _naive(m, tgt, str(out) + "/", "--report", rep, ok=False)
        assert r.returncode != 0 and "--report" in r.stderr, r.stderr
        assert "inside the output folder" in r.stderr, r.stderr
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "runs"]
        assert (out / "notes.txt").read_text() == "mine"
        assert not _bico_tmp(tmp_path) and not _bico_tmp(out)
