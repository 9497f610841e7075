"""`bico inspect SOURCE TARGET`: what the rules decided and why, from the
library's plan (bico_transfer_explain).  Checked against what a run of
the same pair then does (its report), and against the plants' known
structure (GPT-2: Conv1D layout, fused c_attn, tied wte; CLIP: two towers
with their own depth maps; a vocabulary change)."""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cli import bico  # noqa: E402
import test_gpt2_plant as g2  # noqa: E402
import test_vocab_map as vm  # noqa: E402
import test_clip_plant as cp  # noqa: E402


def inspect_json(*args):
    return json.loads(bico("inspect", "--json", *args).stdout)


def report_of(t, src, tgt, cal_a, cal_b, extra=()):
    bico("transfer", "--alpha", "1", "--method", "bico", "--source-base", src, "--source-tuned", t / "Aft",
         "--target-base", tgt, "--source-calib", cal_a, "--target-calib", cal_b,
         "--output", t / "o.safetensors", "--report", t / "r.json", "--quiet", *extra)
    return {e["name"]: e for e in json.load(open(t / "r.json"))["tensors"]}


def agree_with_run(decisions, report):
    """Every predicted handling and source is what the run reported; the
    maps named agree with the report's maps."""
    assert set(decisions) == set(report)
    for name, d in decisions.items():
        e = report[name]
        assert d["handling"] == e["handling"], (name, d, e)
        if e["handling"] != "unchanged":   # (the report names no source then)
            assert d["source"] == e["source"], (name, d, e)
        maps = e.get("maps", {})
        outs = len(maps["out_blocks"]) if "out_blocks" in maps else int("out" in maps)
        if d["role"] in ("weight", "bias"):
            assert d["in_map"] == ("in" in maps), (name, d, maps)
            assert d["out_maps"] == outs, (name, d, maps)


def test_gpt2_pair_decisions(tmp_path):
    g2._plant(tmp_path)
    j = inspect_json(tmp_path / "A", tmp_path / "B")
    for side in ("source", "target"):
        assert j[side]["family"] == "gpt2"
        assert j[side]["family_from"] == 'config.json model_type "gpt2"'
        assert j[side]["blocks"] == "transformer.h" and j[side]["nblocks"] == 2
    assert j["vocab"] is None
    d = {e["name"]: e for e in j["tensors"]}
    c = d["transformer.h.0.attn.c_attn.weight"]
    assert c["transposed"] and c["out_maps"] == 3 and c["in_map"]
    assert "family's default" in c["rule"] and "Conv1D" in c["rule"]
    assert not d["transformer.h.0.attn.c_attn.bias"]["transposed"]
    assert d["transformer.wte.weight"]["module"] == "transformer.h.0.ln_1"
    assert "first element-wise module of the first block" in d["transformer.wte.weight"]["rule"]
    assert "(R o R)^T" in d["transformer.h.1.ln_2.weight"]["rule"]
    assert j["pairing"] == {"weights": [8, 8], "biases": [8, 8], "norm vectors": [10, 10],
                            "tokens": [2, 2]}
    agree_with_run(d, report_of(tmp_path, tmp_path / "A", tmp_path / "B",
                                tmp_path / "calA.safetensors", tmp_path / "calB.safetensors"))
    # A user split is named as such, and changes the decision.
    j1 = inspect_json("--split", "attn.c_attn=1", tmp_path / "A", tmp_path / "B")
    c1 = {e["name"]: e for e in j1["tensors"]}["transformer.h.0.attn.c_attn.weight"]
    assert c1["out_maps"] == 1 and "split" not in c1["rule"]
    # Text output names the same decisions.
    txt = bico("inspect", tmp_path / "A", tmp_path / "B").stdout
    assert "family: gpt2 (from config.json" in txt
    assert "transformer.h.1.attn.c_attn: output in 3 blocks" in txt
    assert "transformer.wpe.weight -> transformer.h.0.ln_1" in txt


def test_names_decide_without_config(tmp_path):
    g2._plant(tmp_path, prefix="", config=False)
    j = inspect_json(tmp_path / "A", tmp_path / "B")
    assert j["target"]["family"] == "gpt2"
    assert j["target"]["family_from"].startswith("tensor names (h.0.attn.c_attn")
    assert j["target"]["blocks"] == "h"


def test_vocab_pair(tmp_path):
    vm._pair(tmp_path)
    j = inspect_json(tmp_path / "A", tmp_path / "B")
    assert j["vocab"] == {"source_tokens": 64, "target_tokens": 72, "shared": 64, "new": 8}
    d = {e["name"]: e for e in j["tensors"]}
    assert d["transformer.wte.weight"]["vocab"] and "token string" in d["transformer.wte.weight"]["rule"]
    assert not d["transformer.wpe.weight"]["vocab"]
    # Not a BiCo method: no vocabulary map, tensors by the method.
    jn = inspect_json("--method", "naive", tmp_path / "A", tmp_path / "B")
    assert jn["vocab"] is None
    assert {e["handling"] for e in jn["tensors"]} == {"naive"}


def test_clip_pair_towers(tmp_path):
    import numpy as np
    import planted as pl
    g = np.random.default_rng(7)
    A, tau, B, tauB, ca, cb = cp.plant(g, 3, 3, 4, 2)
    cfg = {"model_type": "clip"}
    cp.write(tmp_path / "A", A, cfg)
    cp.write(tmp_path / "Aft", {k: A[k] + tau[k] for k in A}, cfg)
    cp.write(tmp_path / "B", B, cfg)
    pl.save(str(tmp_path / "ca.safetensors"), {k: v.astype(np.float32) for k, v in sorted(ca.items())})
    pl.save(str(tmp_path / "cb.safetensors"), {k: v.astype(np.float32) for k, v in sorted(cb.items())})
    j = inspect_json(tmp_path / "A", tmp_path / "B")
    assert j["target"]["family"] == "clip"
    d = {e["name"]: e for e in j["tensors"]}
    assert d["text_model.encoder.layers.1.mlp.fc2.weight"]["source"] == \
        "text_model.encoder.layers.2.mlp.fc2.weight"
    assert d["vision_model.embeddings.class_embedding"]["role"] == "token"
    assert d["vision_model.embeddings.class_embedding"]["module"] == \
        "vision_model.embeddings.patch_embedding"
    tok = d["text_model.embeddings.token_embedding.weight"]
    assert tok["module"] == "text_model.encoder.layers.0.layer_norm1"
    assert "within its tower" in tok["rule"]
    assert d["logit_scale"]["handling"] == "unchanged"
    agree_with_run(d, report_of(tmp_path, tmp_path / "A", tmp_path / "B",
                                tmp_path / "ca.safetensors", tmp_path / "cb.safetensors"))


def test_bad_uses(tmp_path):
    g2._plant(tmp_path)
    r = bico("inspect", "--json", tmp_path / "A" / "model.safetensors", ok=False)
    assert r.returncode == 2 and "source and a target" in r.stderr
    r = bico("inspect", tmp_path / "A", tmp_path / "B", tmp_path / "A", ok=False)
    assert r.returncode == 2 and "third" in r.stderr
    r = bico("inspect", "--method", "nope", tmp_path / "A", tmp_path / "B", ok=False)
    assert r.returncode == 2 and "nope" in r.stderr
    r = bico("inspect", "--split", "c_attn", tmp_path / "A", tmp_path / "B", ok=False)
    assert r.returncode == 2 and "--split" in r.stderr
    r = bico("inspect", tmp_path / "A", tmp_path / "missing", ok=False)
    assert r.returncode == 1 and "missing" in r.stderr
