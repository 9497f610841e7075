"""PEFT LoRA adapters and merging through the `bico` command, against an
independent PEFT writer and reader written here with json + struct + numpy
(PEFT's file layout and its rank/alpha pattern rule, not libbico's code).

Run by `make check` (BICO_BUILD names the build tree).
"""
import json
import os
import re
import struct

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
from cli import bico  # noqa: E402
P = "base_model.model."


# ---------------------------------------------------------------- files

def write_st(path, tensors):
    """A safetensors file: 8-byte length, JSON header padded to 8, data."""
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr, dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_st(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data, out = raw[8 + n:], {}
    for name, e in header.items():
        assert e["dtype"] == "F32", (name, e["dtype"])
        b, end = e["data_offsets"]
        out[name] = np.frombuffer(data[b:end], "<f4").reshape(e["shape"]).astype(np.float64)
    return out


def write_adapter(folder, config, tensors):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_st(os.path.join(folder, "adapter_model.safetensors"),
             {P + k: v for k, v in tensors.items()})


def pattern_value(pattern, module, default):
    """PEFT's rule: the first key k with re.match(r"(.*\\.)?(k)$", module)."""
    for k, v in (pattern or {}).items():
        if re.match(rf"(.*\.)?({k})$", module):
            return v
    return default


def read_adapter(folder):
    """-> config, {module: (kind, B, A, scale)}, {saved tensor: array}."""
    with open(os.path.join(folder, "adapter_config.json")) as f:
        cfg = json.load(f)
    t = read_st(os.path.join(folder, "adapter_model.safetensors"))
    assert cfg["peft_type"] == "LORA" and not cfg.get("use_dora")
    mods, saved = {}, {}
    for name, arr in t.items():
        assert name.startswith(P), name
        rest = name[len(P):]
        for suf, kind, which in ((".lora_A.weight", "linear", "A"),
                                 (".lora_B.weight", "linear", "B"),
                                 (".lora_embedding_A", "embedding", "A"),
                                 (".lora_embedding_B", "embedding", "B")):
            if rest.endswith(suf):
                mods.setdefault(rest[:-len(suf)], {"kind": kind})[which] = arr
                break
        else:
            saved[rest] = arr
    out = {}
    for m, e in mods.items():
        r = pattern_value(cfg.get("rank_pattern"), m, cfg["r"])
        alpha = pattern_value(cfg.get("alpha_pattern"), m, cfg["lora_alpha"])
        assert e["A"].shape[0] == r and e["B"].shape[1] == r, (m, r)
        scale = alpha / (np.sqrt(r) if cfg.get("use_rslora") else r)
        out[m] = (e["kind"], e["B"], e["A"], scale)
    return cfg, out, saved


def dense(entry, fifo=False):
    """The weight-layout update of a module (PEFT's get_delta_weight)."""
    kind, B, A, s = entry
    d = s * B @ A
    return d.T if kind == "embedding" or fifo else d


def rel(a, b):
    return np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(b), 1e-300)


def f32(x):
    return np.asarray(x, np.float32).astype(np.float64)


# ---------------------------------------------------------------- round trip

def test_every_field_round_trips_through_a_naive_transfer(tmp_path):
    """Source = target: a naive transfer must give the adapter back, every
    field intact (rsLoRA, patterns, fan_in_fan_out, embeddings, saved)."""
    g = np.random.default_rng(0)
    base = {"embed.weight": g.normal(size=(11, 6)),
            "layers.0.attn.c_attn.weight": g.normal(size=(6, 18)),  # Conv1D: [in, out]
            "layers.0.mlp.c_fc.weight": g.normal(size=(6, 8)),
            "score.weight": g.normal(size=(3, 6)), "score.bias": g.normal(size=3)}
    base = {k: f32(v) for k, v in base.items()}
    write_st(tmp_path / "base.safetensors", base)
    fac = {"embed.lora_embedding_A": g.normal(size=(4, 11)),
           "embed.lora_embedding_B": g.normal(size=(6, 4)),
           "layers.0.attn.c_attn.lora_A.weight": g.normal(size=(4, 6)),
           "layers.0.attn.c_attn.lora_B.weight": g.normal(size=(18, 4)),
           "layers.0.mlp.c_fc.lora_A.weight": g.normal(size=(2, 6)),
           "layers.0.mlp.c_fc.lora_B.weight": g.normal(size=(8, 2)),
           "score.weight": base["score.weight"] + g.normal(size=(3, 6)),
           "score.bias": base["score.bias"] + g.normal(size=3)}
    fac = {k: f32(v) for k, v in fac.items()}
    cfg = {"peft_type": "LORA", "task_type": "SEQ_CLS", "r": 4, "lora_alpha": 16,
           "use_rslora": True, "fan_in_fan_out": True,
           "rank_pattern": {"c_fc": 2}, "alpha_pattern": {"mlp.c_fc": 3},
           "target_modules": ["c_attn", "c_fc", "embed"],
           "modules_to_save": ["score"], "bias": "none", "use_dora": False,
           "lora_dropout": 0.1, "init_lora_weights": True,
           "layers_to_transform": None, "revision": None}
    write_adapter(tmp_path / "in", cfg, fac)
    bico("transfer", "--method", "naive", "--source-base", tmp_path / "base.safetensors",
         "--target-base", tmp_path / "base.safetensors", "--lora", tmp_path / "in",
         "--output-lora", tmp_path / "out", "--merge-into-base",
         "--output", tmp_path / "merged.safetensors", "--quiet")
    cfg_in, mods_in, saved_in = read_adapter(tmp_path / "in")
    cfg_out, mods_out, saved_out = read_adapter(tmp_path / "out")
    assert cfg_out["use_rslora"] is True and cfg_out["fan_in_fan_out"] is True
    assert cfg_out["task_type"] == "SEQ_CLS"
    # An adapter for the target, which keeps the source's training dropout.
    assert cfg_out["base_model_name_or_path"] == str(tmp_path / "base.safetensors")
    assert cfg_out["lora_dropout"] == pytest.approx(0.1)
    assert sorted(cfg_out["target_modules"]) == sorted(mods_in)
    assert cfg_out["modules_to_save"] == ["score"]
    assert sorted(mods_out) == sorted(mods_in)
    for m, e in mods_in.items():
        o = mods_out[m]
        assert o[0] == e[0], m
        assert o[1].shape == e[1].shape and o[2].shape == e[2].shape, m
        assert o[3] == pytest.approx(e[3]), m  # same rank, alpha, scale rule
        np.testing.assert_array_equal(o[1], e[1])
        np.testing.assert_array_equal(o[2], e[2])
    assert sorted(saved_out) == sorted(saved_in)
    for k in saved_in:
        np.testing.assert_allclose(saved_out[k], saved_in[k], rtol=0, atol=1e-6)
    # The merged checkpoint is PEFT's merge: W + delta (transposed for
    # Conv1D and embeddings), the saved modules replaced.
    merged = read_st(tmp_path / "merged.safetensors")
    for m, e in mods_in.items():
        w = m + ".weight"
        want = base[w] + dense(e, fifo=e[0] == "linear")
        assert rel(merged[w], want) < 1e-6, m
    for k in saved_in:
        np.testing.assert_allclose(merged[k], saved_in[k], atol=1e-6)


# ---------------------------------------------------------------- BiCo

@pytest.fixture
def chain(tmp_path):
    """Two blocks and a head; the target renames the blocks ("layers") and
    rotates the hidden space between them by Q."""
    g = np.random.default_rng(1)
    d, n, c = 8, 128, 3
    W0, W1, Wh = (g.normal(size=(d, d)) * 0.5, g.normal(size=(d, d)) * 0.5,
                  g.normal(size=(c, d)))
    Q, _ = np.linalg.qr(g.normal(size=(d, d)))
    X, Z, Y = g.normal(size=(n, d)), g.normal(size=(n, d)), g.normal(size=(n, c))
    H = X @ W0.T
    G0 = Z @ W1
    O = H @ W1.T
    A = {"blocks.0.fc.weight": W0, "blocks.1.fc.weight": W1, "head.weight": Wh}
    B = {"layers.0.fc.weight": Q @ W0, "layers.1.fc.weight": W1 @ Q.T,
         "head.weight": Wh}
    write_st(tmp_path / "A.safetensors", A)
    write_st(tmp_path / "B.safetensors", B)
    write_st(tmp_path / "calA.safetensors", {
        "blocks.0.fc.input": X, "blocks.0.fc.output_grad": G0,
        "blocks.1.fc.input": H, "blocks.1.fc.output_grad": Z,
        "head.input": O, "head.output_grad": Y})
    write_st(tmp_path / "calB.safetensors", {
        "layers.0.fc.input": X, "layers.0.fc.output_grad": G0 @ Q.T,
        "layers.1.fc.input": H @ Q.T, "layers.1.fc.output_grad": Z,
        "head.input": O, "head.output_grad": Y})
    fac = {"blocks.0.fc.lora_A.weight": g.normal(size=(2, d)),
           "blocks.0.fc.lora_B.weight": g.normal(size=(d, 2)),
           "blocks.1.fc.lora_A.weight": g.normal(size=(3, d)),
           "blocks.1.fc.lora_B.weight": g.normal(size=(d, 3)),
           "head.weight": Wh + 0.1 * g.normal(size=(c, d))}
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "use_rslora": True,
           "rank_pattern": {"1.fc": 3}, "alpha_pattern": {"blocks.0.fc": 5},
           "target_modules": ["fc"], "modules_to_save": ["head"], "bias": "none"}
    write_adapter(tmp_path / "ad", cfg, {k: f32(v) for k, v in fac.items()})
    return dict(dir=tmp_path, Q=Q, A={k: f32(v) for k, v in A.items()},
                B={k: f32(v) for k, v in B.items()})


@pytest.mark.parametrize("stats", [False, True])
def test_bico_transfer_writes_the_rotated_adapter(chain, stats):
    t = chain["dir"]
    if stats:
        bico("stats", "--source-calib", t / "calA.safetensors", "--target-calib",
             t / "calB.safetensors", "--output", t / "S.safetensors")
        data = ["--stats", t / "S.safetensors"]
    else:
        data = ["--source-calib", t / "calA.safetensors",
                "--target-calib", t / "calB.safetensors"]
    bico("transfer", "--method", "bico", "--source-base", t / "A.safetensors",
         "--target-base", t / "B.safetensors", *data, "--lora", t / "ad",
         "--output-lora", t / "out", "--report", t / "rep.json", "--quiet")
    _, src, saved = read_adapter(t / "ad")
    cfg, out, saved_out = read_adapter(t / "out")
    Q = chain["Q"]
    # Renamed to the target's modules, ranks and alphas kept per module.
    assert sorted(cfg["target_modules"]) == ["layers.0.fc", "layers.1.fc"]
    assert cfg["use_rslora"] is True and cfg["modules_to_save"] == ["head"]
    for k in ("0", "1"):
        s, o = src["blocks.%s.fc" % k], out["layers.%s.fc" % k]
        assert o[1].shape == s[1].shape and o[2].shape == s[2].shape
        assert o[3] == pytest.approx(s[3])
    # The factors multiply out to the update in the target's coordinates.
    want0 = Q @ dense(src["blocks.0.fc"])
    want1 = dense(src["blocks.1.fc"]) @ Q.T
    assert rel(dense(out["layers.0.fc"]), want0) < 1e-5
    assert rel(dense(out["layers.1.fc"]), want1) < 1e-5
    # The head's saved weight: the target base plus the carried task vector
    # (identity maps here).
    want_h = chain["B"]["head.weight"] + (saved["head.weight"] - chain["A"]["head.weight"])
    assert rel(saved_out["head.weight"], want_h) < 1e-5
    rep = json.load(open(t / "rep.json"))
    # The checkpoint path's words: both modules and the head's saved weight
    # are linear weights carried by their maps.
    assert [m["handling"] for m in rep["modules"]] == ["linear", "linear"]
    assert [m["handling"] for m in rep["saved"]] == ["linear"]
    assert rep["summary"]["linear"] == 3 and rep["summary"]["unchanged"] == 0


def test_merge_of_transferred_adapter_and_task_vector(chain):
    t = chain["dir"]
    bico("transfer", "--method", "bico", "--source-base", t / "A.safetensors",
         "--target-base", t / "B.safetensors", "--source-calib", t / "calA.safetensors",
         "--target-calib", t / "calB.safetensors", "--lora", t / "ad",
         "--output-lora", t / "out", "--quiet")
    _, out, saved = read_adapter(t / "out")
    g = np.random.default_rng(9)
    tv = {"layers.0.fc.weight": f32(g.normal(size=(8, 8)) * 0.1)}
    write_st(t / "tv.safetensors", tv)
    B = chain["B"]
    tau_ad = {"layers.0.fc.weight": dense(out["layers.0.fc"]),
              "layers.1.fc.weight": dense(out["layers.1.fc"]),
              "head.weight": saved["head.weight"] - B["head.weight"]}
    # Task arithmetic: B + alpha (0.6 tau_adapter + 1.5 tau_tv).
    bico("merge", "--base", t / "B.safetensors", "--lora", t / "out", "--weight", 0.6,
         "--task-vector", t / "tv.safetensors", "--weight", 1.5, "--alpha", 0.5,
         "--output", t / "lin.safetensors", "--quiet")
    lin = read_st(t / "lin.safetensors")
    for k in B:
        want = B[k] + 0.5 * (0.6 * tau_ad[k] + 1.5 * tv.get(k, 0 * B[k]))
        np.testing.assert_allclose(lin[k], want, atol=1e-5, err_msg=k)
    # TIES with density 0.5 on both: trim, elect by mass, disjoint mean.
    bico("merge", "--method", "ties", "--base", t / "B.safetensors",
         "--lora", t / "out", "--weight", 0.6, "--density", 0.5,
         "--task-vector", t / "tv.safetensors", "--weight", 1.5, "--density", 0.5,
         "--output", t / "ties.safetensors", "--quiet")
    ties = read_st(t / "ties.safetensors")
    for k in B:
        taus = [(0.6, tau_ad[k])] + ([(1.5, tv[k])] if k in tv else [])
        kept = []
        for w, x in taus:
            flat = x.ravel()
            order = sorted(range(flat.size), key=lambda i: (-abs(np.float32(flat[i])), i))
            m = np.zeros(flat.size)
            m[order[:int(np.floor(0.5 * flat.size))]] = 1
            kept.append((w, (w * flat * m)))
        mass = sum(v for _, v in kept)
        sign = np.where(mass >= 0, 1.0, -1.0)
        num = sum(np.where(v * sign > 0, v, 0) for _, v in kept)
        den = sum(np.where(v * sign > 0, w, 0) for w, v in kept)
        merged = np.where(den != 0, num / np.where(den != 0, den, 1), num)
        np.testing.assert_allclose(ties[k].ravel(), B[k].ravel() + merged, atol=1e-5,
                                   err_msg=k)


def test_lora_usage_and_refusals(chain):
    t = chain["dir"]
    common = ["--source-base", t / "A.safetensors", "--target-base", t / "B.safetensors",
              "--source-calib", t / "calA.safetensors",
              "--target-calib", t / "calB.safetensors"]
    r = bico("transfer", "--method", "bico", *common, "--lora", t / "ad",
             "--output", t / "x.safetensors", ok=False)
    assert r.returncode == 2 and "--merge-into-base" in r.stderr
    r = bico("transfer", "--method", "bico", *common, "--lora", t / "ad",
             "--task-vector", t / "A.safetensors", "--output-lora", t / "o", ok=False)
    assert r.returncode == 2 and "--lora replaces" in r.stderr
    r = bico("transfer", "--method", "bico", *common, "--output-lora", t / "o",
             "--output", t / "x.safetensors", "--task-vector", t / "A.safetensors",
             ok=False)
    assert r.returncode == 2 and "needs --lora" in r.stderr
    # DoRA: refused, naming the file and the field; nothing written.
    cfg = json.load(open(t / "ad" / "adapter_config.json"))
    cfg["use_dora"] = True
    json.dump(cfg, open(t / "ad" / "adapter_config.json", "w"))
    r = bico("transfer", "--method", "bico", *common, "--lora", t / "ad",
             "--output-lora", t / "o", ok=False)
    assert r.returncode == 1
    assert "adapter_config.json" in r.stderr and "use_dora" in r.stderr
    assert not os.path.exists(t / "o")
    r = bico("merge", "--base", t / "B.safetensors", "--weight", 2, ok=False)
    assert r.returncode == 2 and "before any input" in r.stderr
    r = bico("merge", "--base", t / "B.safetensors", "--task-vector", t / "A.safetensors",
             "--output", t / "m.safetensors", ok=False)
    assert r.returncode == 1 and "blocks.0.fc.weight is not in the base" in r.stderr
    assert not os.path.exists(t / "m.safetensors")


def test_split_report_is_valid_json_with_block_maps(chain):
    t = chain["dir"]
    bico("transfer", "--method", "bico", "--source-base", t / "A.safetensors",
         "--target-base", t / "B.safetensors", "--source-calib", t / "calA.safetensors",
         "--target-calib", t / "calB.safetensors", "--lora", t / "ad", "--split", "fc=2",
         "--output-lora", t / "out", "--report", t / "rep.json", "--quiet")
    rep = json.load(open(t / "rep.json"))
    mods = {m["name"]: m for m in rep["modules"]}
    assert len(mods["layers.0.fc"]["maps"]["out_blocks"]) == 2
    assert mods["layers.0.fc"]["maps"]["out_blocks"][0]["shape"] == [4, 4]
    # Block-wise output maps act on B's row blocks: rank and alpha kept.
    _, out, _ = read_adapter(t / "out")
    assert out["layers.1.fc"][1].shape == (8, 3)
