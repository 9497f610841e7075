"""Hugging Face model folders as inputs: every command that opens a model
accepts the folder (config.json + model.safetensors, or the sharded index);
folders and files that hold something else are named for what they are."""
import json
import os
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
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
    assert same_bytes(tmp_path / "m1.safetensors", tmp_path / "m2.safetensors")


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
