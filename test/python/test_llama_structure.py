"""Structure-aware maps for decoder families (docs/llm.md): bico transfer on
Hugging Face folders of planted Llama-family pairs (test/e2e/llama.py)
with no extra flags, full checkpoints and LoRA adapters on all seven
projections, compared with the planted answer and with A_ft's logits; the
attention structure the maps must keep on pairs that are NOT planted
copies; the RoPE-layout override; bad config.json files."""
import json
import math
import os

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402
import planted as pl  # noqa: E402
from cli import bico  # noqa: E402

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PEFT = "base_model.model."


def t64(a):
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def planted_pair(tmp_path, seed=21, rows=(8, 16), **kw):
    """Folders A, Aft, B (B = A in other coordinates) and calibration files."""
    cfg = llama.default_config(**kw)
    g = torch.Generator().manual_seed(seed)
    A = llama.random_state(cfg, g)
    tau = {k: 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)
           for k, v in A.items()}
    sym = llama.symmetry(cfg, g)
    B = llama.transform(cfg, A, sym)
    ids = torch.randint(0, cfg["vocab_size"], rows, generator=g)
    z = torch.randn(*rows, cfg["vocab_size"], generator=g, dtype=torch.float64)
    llama.write_folder(tmp_path / "A", cfg, A)
    llama.write_folder(tmp_path / "Aft", cfg, {k: A[k] + tau[k] for k in A})
    llama.write_folder(tmp_path / "B", cfg, B)
    pl.save(str(tmp_path / "calA.safetensors"), llama.calibrate(cfg, A, ids, z))
    pl.save(str(tmp_path / "calB.safetensors"), llama.calibrate(cfg, B, ids, z))
    return dict(cfg=cfg, A=A, tau=tau, sym=sym, B=B, g=g)


def calib_args(t):
    return ["--source-calib", t / "calA.safetensors",
            "--target-calib", t / "calB.safetensors"]


def load64(path):
    got, _, _ = pl.load(str(path))
    return {k: t64(v) for k, v in got.items()}


def max_rel(got, want, scale):
    return float((got - want).abs().max() / max(float(scale.abs().max()), 1e-12))


@pytest.mark.parametrize("kw", [
    dict(),                                                   # GQA 4/2, tied
    dict(num_key_value_heads=4, attention_bias=True,          # MHA, Qwen2 biases
         tie_word_embeddings=False, model_type="qwen2"),
    dict(num_key_value_heads=1, num_hidden_layers=3,          # MQA, Mistral
         model_type="mistral"),
    dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
         head_dim=10, intermediate_size=40),
])
def test_planted_checkpoint_recovered_with_structure(tmp_path, kw):
    """No extra flags: the family comes from config.json, the log says the
    structure-aware maps are on, every tensor is the planted T(tau) and the
    result computes A_ft's logits."""
    p = planted_pair(tmp_path, **kw)
    cfg, A, tau, sym, B = p["cfg"], p["A"], p["tau"], p["sym"], p["B"]
    r = bico("transfer", "--alpha", "1", "--method", "bico", "--structure", "heads", "--source-base", tmp_path / "A",
             "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "B",
             *calib_args(tmp_path), "--output", tmp_path / "out.safetensors")
    assert "structure-aware maps" in r.stderr, r.stderr
    tauB = llama.transform(cfg, tau, sym)
    got = load64(tmp_path / "out.safetensors")
    for k, t in B.items():
        assert max_rel(got[k], t + tauB[k], tauB[k]) < 2e-3, k
    ids = torch.randint(0, cfg["vocab_size"], (3, 12), generator=p["g"])
    want = llama.forward(cfg, {k: A[k] + tau[k] for k in A}, ids)
    have = llama.forward(cfg, got, ids)
    assert float((have - want).abs().max()) < 1e-3 * float(want.abs().max())


def test_structure_switch_and_free_form_on_the_plant(tmp_path):
    """--structure free turns the structure off (said in the log); on an
    exact plant both are exact, so both paths are measurable."""
    p = planted_pair(tmp_path)
    tauB = llama.transform(p["cfg"], p["tau"], p["sym"])
    for mode in ("free", "heads"):
        out = tmp_path / ("out_%s.safetensors" % mode)
        r = bico("transfer", "--alpha", "1", "--method", "bico", "--structure", mode,
                 "--source-base", tmp_path / "A", "--source-tuned", tmp_path / "Aft",
                 "--target-base", tmp_path / "B", *calib_args(tmp_path),
                 "--output", out)
        assert ("structure-aware maps" in r.stderr) == (mode == "heads")
        got = load64(out)
        for k, t in p["B"].items():
            assert max_rel(got[k], t + tauB[k], tauB[k]) < 2e-3, (mode, k)
    r = bico("transfer", "--alpha", "1", "--method", "bico", "--structure", "rows",
             "--source-base", tmp_path / "A", "--source-tuned", tmp_path / "Aft",
             "--target-base", tmp_path / "B", *calib_args(tmp_path),
             "--output", tmp_path / "x.safetensors", ok=False)
    assert r.returncode == 2 and "--structure rows" in r.stderr


@pytest.mark.parametrize("flags", [[], ["--structure", "heads"]], ids=["no-flags", "heads"])
def test_planted_lora_on_all_seven_projections(tmp_path, flags):
    """A PEFT adapter on q, k, v, o, gate, up and down of every layer, carried
    in factored form, with no extra flags (the default free-form maps) and
    with the structure-aware maps: each carried module's B A is the planted
    T of the source's, and the merged target computes the logits of the
    source base with the adapter merged."""
    p = planted_pair(tmp_path, seed=3)
    cfg, A, sym, B, g = p["cfg"], p["A"], p["sym"], p["B"], p["g"]
    rank, alpha = 2, 4.0
    fac, dense = {}, {}
    for i in range(cfg["num_hidden_layers"]):
        for proj in PROJ:
            m = "model.layers.%d.%s" % (i, proj)
            dout, din = A[m + ".weight"].shape
            la = torch.randn(rank, din, generator=g, dtype=torch.float64) / math.sqrt(din)
            lb = 0.2 * torch.randn(dout, rank, generator=g, dtype=torch.float64)
            la, lb = la.float().double(), lb.float().double()
            fac[PEFT + m + ".lora_A.weight"] = la.numpy()
            fac[PEFT + m + ".lora_B.weight"] = lb.numpy()
            dense[m + ".weight"] = alpha / rank * lb @ la
    os.makedirs(tmp_path / "ad")
    json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
               "target_modules": list(PROJ), "bias": "none"},
              open(tmp_path / "ad" / "adapter_config.json", "w"))
    pl.save(str(tmp_path / "ad" / "adapter_model.safetensors"),
            {k: v.astype("float32") for k, v in fac.items()})
    r = bico("transfer", "--alpha", "1", "--method", "bico", *flags, "--source-base", tmp_path / "A",
             "--target-base", tmp_path / "B", *calib_args(tmp_path),
             "--lora", tmp_path / "ad", "--output-lora", tmp_path / "out",
             "--merge-into-base", "--output", tmp_path / "merged.safetensors",
             "--report", tmp_path / "rep.json")
    assert ("structure-aware maps" in r.stderr) == bool(flags), r.stderr
    # the report says how each map was solved, by the rule of
    # docs/methods.md: thin when the rows n <= both widths
    rep = json.load(open(tmp_path / "rep.json"))
    calB, _, _ = pl.load(str(tmp_path / "calB.safetensors"))
    n = calB["model.layers.0.self_attn.q_proj.input"].shape[0]
    kinds = set()
    for e in rep["modules"]:
        for m in e["maps"].values():
            if isinstance(m, dict) and not flags:  # (structured maps are per group)
                assert m["solve"] == ("thin" if n <= min(m["shape"]) else "full"), (e, n)
                kinds.add(m["solve"])
    assert flags or kinds, rep["modules"][:1]
    tau = {k: dense.get(k, torch.zeros_like(v)) for k, v in A.items()}
    tauB = llama.transform(cfg, tau, sym)
    out, _, _ = pl.load(str(tmp_path / "out" / "adapter_model.safetensors"))
    ocfg = json.load(open(tmp_path / "out" / "adapter_config.json"))
    scale = ocfg["lora_alpha"] / ocfg["r"]
    for k in dense:
        m = k[:-len(".weight")]
        ob = t64(out[PEFT + m + ".lora_B.weight"])
        oa = t64(out[PEFT + m + ".lora_A.weight"])
        assert oa.shape[0] == rank  # factored: the rank is kept
        assert max_rel(scale * ob @ oa, tauB[k], tauB[k]) < 2e-3, k
    merged = load64(tmp_path / "merged.safetensors")
    ids = torch.randint(0, cfg["vocab_size"], (3, 12), generator=g)
    want = llama.forward(cfg, {k: A[k] + tau[k] for k in A}, ids)
    have = llama.forward(cfg, merged, ids)
    assert float((have - want).abs().max()) < 1e-3 * float(want.abs().max())


# ------------------------------------------------------- structure kept

def rope_matrix(hd, delta, theta, layout):
    """The rotary map between positions delta apart, as a hd x hd matrix."""
    R = torch.zeros(hd, hd, dtype=torch.float64)
    for p in range(hd // 2):
        a = delta / theta ** (2 * p / hd)
        i, j = (p, p + hd // 2) if layout == "half" else (2 * p, 2 * p + 1)
        R[i, i], R[i, j], R[j, i], R[j, j] = (math.cos(a), -math.sin(a),
                                              math.sin(a), math.cos(a))
    return R


def score_spectra(cfg, tq, tk, layout="half", deltas=(0, 1, 3, 7)):
    """Per query head h: the singular values of tq_h^T Rope(delta) tk_g(h)
    for each delta, the bilinear form of attention scores that the update
    adds.  Orthogonal maps on the input side leave them unchanged; maps on
    the head side leave them unchanged only when they commute with RoPE and
    are shared by a query head and its key head."""
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rep = H // KV
    out = []
    for h in range(H):
        q = tq[h * hd:(h + 1) * hd]
        k = tk[(h // rep) * hd:(h // rep + 1) * hd]
        out.append(torch.cat([torch.linalg.svdvals(
            q.T @ rope_matrix(hd, d, cfg["rope_theta"], layout) @ k) for d in deltas]))
    return out


def unplanted_pair(tmp_path, seed=11, **kw):
    """Two unrelated random models of one config and their own calibration:
    no map makes B equal A, so only the structure can keep the scores."""
    cfg = llama.default_config(**kw)
    g = torch.Generator().manual_seed(seed)
    A, B = llama.random_state(cfg, g), llama.random_state(cfg, g)
    tau = {k: 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)
           for k, v in A.items()}
    ids = torch.randint(0, cfg["vocab_size"], (8, 16), generator=g)
    z = torch.randn(8, 16, cfg["vocab_size"], generator=g, dtype=torch.float64)
    llama.write_folder(tmp_path / "A", cfg, A)
    pl.save(str(tmp_path / "tau.safetensors"),
            {k: v.float().numpy() for k, v in tau.items()})
    llama.write_folder(tmp_path / "B", cfg, B)
    pl.save(str(tmp_path / "calA.safetensors"), llama.calibrate(cfg, A, ids, z))
    pl.save(str(tmp_path / "calB.safetensors"), llama.calibrate(cfg, B, ids, z))
    return cfg, {k: v.float().double() for k, v in tau.items()}


def matched(spec_b, spec_a, tol):
    """Every target head's spectra equal some source head's."""
    return all(min(float((sb - sa).abs().max() / sa.abs().max()) for sa in spec_a) < tol
               for sb in spec_b)


@pytest.mark.parametrize("kw", [dict(), dict(num_key_value_heads=4),
                                dict(num_key_value_heads=1)])
def test_structured_maps_keep_attention_scores_on_unplanted_pairs(tmp_path, kw):
    """On a pair that is not a planted copy, the carried q/k update keeps
    each head's attention-score form up to orthogonal maps of the residual
    stream (same singular values at every relative position), which needs
    per-group maps commuting with RoPE; free-form maps break it."""
    cfg, tau = unplanted_pair(tmp_path, **kw)
    res = {}
    for mode in ("heads", "free"):
        d = tmp_path / ("d_%s.safetensors" % mode)
        bico("transfer", "--alpha", "1", "--method", "bico", "--structure", mode,
             "--source-base", tmp_path / "A", "--task-vector", tmp_path / "tau.safetensors",
             "--target-base", tmp_path / "B", *calib_args(tmp_path),
             "--output", tmp_path / ("o_%s.safetensors" % mode), "--delta-output", d,
             "--quiet")
        res[mode] = load64(d)
    for i in range(cfg["num_hidden_layers"]):
        q, k = ("model.layers.%d.self_attn.%s_proj.weight" % (i, s) for s in "qk")
        sa = score_spectra(cfg, tau[q], tau[k])
        assert matched(score_spectra(cfg, res["heads"][q], res["heads"][k]), sa, 1e-4), i
        assert not matched(score_spectra(cfg, res["free"][q], res["free"][k]), sa, 1e-2), i
        # The value/output pair: per group one map, so each head's
        # o_h v_g(h) product keeps its singular values too.
        v, o = ("model.layers.%d.self_attn.%s_proj.weight" % (i, s) for s in "vo")
        H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

        def ov(t):
            return [torch.linalg.svdvals(t[o][:, h * hd:(h + 1) * hd] @
                                         t[v][(h // (H // KV)) * hd:(h // (H // KV) + 1) * hd])
                    for h in range(H)]
        assert matched(ov(res["heads"]), ov(tau), 1e-4), i


def to_interleaved(cfg, sd):
    """The same network with RoPE in the interleaved layout: each q/k head's
    rows permuted so that half-split pair (p, p + hd/2) becomes (2p, 2p+1)."""
    hd = cfg["head_dim"]
    perm = torch.empty(hd, dtype=torch.long)
    perm[0::2] = torch.arange(hd // 2)
    perm[1::2] = torch.arange(hd // 2) + hd // 2
    out = dict(sd)
    for k, t in sd.items():
        if ".q_proj." in k or ".k_proj." in k:
            n = t.shape[0] // hd
            idx = torch.cat([h * hd + perm for h in range(n)])
            out[k] = t[idx]
    return out


def test_rope_override_interleaved(tmp_path):
    """A plant whose q/k heads are in the interleaved layout: with --rope
    interleaved the maps pair dims (2p, 2p+1) and recover it exactly; with
    the config's half-split pairing the q/k maps are wrong.  Files without
    config.json plus --heads/--kv-heads/--head-dim also switch the structure
    on."""
    p = planted_pair(tmp_path)
    cfg, A, tau, sym, B = p["cfg"], p["A"], p["tau"], p["sym"], p["B"]
    Ai, Bi = to_interleaved(cfg, A), to_interleaved(cfg, B)
    taui = to_interleaved(cfg, tau)
    tauBi = to_interleaved(cfg, llama.transform(cfg, tau, sym))
    for name, sd in (("A", Ai), ("Aft", {k: Ai[k] + taui[k] for k in Ai}), ("B", Bi)):
        pl.save(str(tmp_path / ("%s_i.safetensors" % name)),
                {k: v.float().numpy() for k, v in sd.items()})
    # Calibration: q/k outputs' gradients move with the rows.
    for s in ("A", "B"):
        cal, _, _ = pl.load(str(tmp_path / ("cal%s.safetensors" % s)))
        hd = cfg["head_dim"]
        perm = np.empty(hd, dtype=int)
        perm[0::2], perm[1::2] = np.arange(hd // 2), np.arange(hd // 2) + hd // 2
        for k in list(cal):
            if (".q_proj." in k or ".k_proj." in k) and k.endswith("output_grad"):
                n = cal[k].shape[1] // hd
                cal[k] = cal[k][:, np.concatenate([h * hd + perm for h in range(n)])]
        pl.save(str(tmp_path / ("cal%s_i.safetensors" % s)), cal)
    common = ["--heads", "4", "--kv-heads", "2", "--head-dim", "8",
              "--source-base", tmp_path / "A_i.safetensors",
              "--source-tuned", tmp_path / "Aft_i.safetensors",
              "--target-base", tmp_path / "B_i.safetensors",
              "--source-calib", tmp_path / "calA_i.safetensors",
              "--target-calib", tmp_path / "calB_i.safetensors"]
    errs = {}
    for rope in ("interleaved", "half"):
        out = tmp_path / ("out_%s.safetensors" % rope)
        r = bico("transfer", "--alpha", "1", "--method", "bico", "--structure", "heads", "--rope", rope, *common, "--output", out)
        assert "structure-aware maps" in r.stderr and "rope %s" % rope in r.stderr
        got = load64(out)
        errs[rope] = max(max_rel(got[k], Bi[k] + tauBi[k], tauBi[k])
                         for k in Bi if ".q_proj." in k or ".k_proj." in k)
    assert errs["interleaved"] < 2e-3
    assert errs["half"] > 0.1


# ------------------------------------------------------- bad config.json

@pytest.mark.parametrize("edit,field", [
    (lambda c: c.pop("num_attention_heads"), "num_attention_heads"),
    (lambda c: c.pop("hidden_size"), "hidden_size"),
    (lambda c: c.update(num_attention_heads=5, num_key_value_heads=5,
                        head_dim=None), "hidden_size"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c.update(num_attention_heads="4"), "num_attention_heads"),
    (lambda c: c.update(head_dim=6), "head_dim"),
    # Products that wrap past 2^64 onto the tensors' widths (issue 22):
    # heads x head_dim = 2^64 + 32, key/value heads x head_dim = 2^64 + 16.
    (lambda c: c.update(num_attention_heads=2 * 8 * 4562284561,
                        num_key_value_heads=8 * 4562284561,
                        head_dim=2 * 17 * 241 * 61681), "head_dim"),
    (lambda c: c.update(num_attention_heads=48 * 1824726041,
                        num_key_value_heads=48 * 1824726041,
                        head_dim=2 * 2833 * 37171), "num_attention_heads"),
])
def test_bad_config_names_file_and_field(tmp_path, edit, field):
    planted_pair(tmp_path)
    path = tmp_path / "B" / "config.json"
    cfg = json.load(open(path))
    edit(cfg)
    json.dump(cfg, open(path, "w"))
    out = tmp_path / "out.safetensors"
    r = bico("transfer", "--alpha", "1", "--method", "bico", "--structure", "heads", "--source-base", tmp_path / "A",
             "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "B",
             *calib_args(tmp_path), "--output", out, ok=False, timeout=60)
    assert r.returncode == 1, r.stderr
    assert str(path) in r.stderr and field in r.stderr, r.stderr
    assert not out.exists()
    # Free-form maps do not read the config: the run succeeds.
    bico("transfer", "--alpha", "1", "--method", "bico", "--structure", "free", "--quiet",
         "--source-base", tmp_path / "A", "--source-tuned", tmp_path / "Aft",
         "--target-base", tmp_path / "B", *calib_args(tmp_path), "--output", out)
    assert out.exists()


# ------------------------------------------------------- unequal shapes

def pair_of_configs(tmp_path, cfg_a, cfg_b, seed=13):
    g = torch.Generator().manual_seed(seed)
    A, B = llama.random_state(cfg_a, g), llama.random_state(cfg_b, g)
    tau = {k: (0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)).float().double()
           for k, v in A.items()}
    ids = torch.randint(0, cfg_a["vocab_size"], (8, 16), generator=g)
    z = torch.randn(8, 16, cfg_a["vocab_size"], generator=g, dtype=torch.float64)
    llama.write_folder(tmp_path / "A", cfg_a, A)
    pl.save(str(tmp_path / "tau.safetensors"), {k: v.float().numpy() for k, v in tau.items()})
    llama.write_folder(tmp_path / "B", cfg_b, B)
    pl.save(str(tmp_path / "calA.safetensors"), llama.calibrate(cfg_a, A, ids, z))
    pl.save(str(tmp_path / "calB.safetensors"), llama.calibrate(cfg_b, B, ids, z))
    r = bico("transfer", "--alpha", "1", "--method", "bico", "--structure", "heads", "--source-base", tmp_path / "A",
             "--task-vector", tmp_path / "tau.safetensors", "--target-base", tmp_path / "B",
             *calib_args(tmp_path), "--output", tmp_path / "o.safetensors",
             "--delta-output", tmp_path / "d.safetensors")
    return tau, load64(tmp_path / "d.safetensors"), r.stderr


def test_more_target_heads_unmatched_get_no_update(tmp_path):
    """Source 4 query / 2 key-value heads, target 6 / 3 (head_dim 8 both):
    two target groups are matched and keep the source heads' score forms;
    the third group's query and key rows get no update."""
    cfg_a = llama.default_config()
    cfg_b = llama.default_config(num_attention_heads=6, num_key_value_heads=3, head_dim=8)
    tau, d, log = pair_of_configs(tmp_path, cfg_a, cfg_b)
    assert "structure-aware maps" in log and "free-form attention" not in log
    hd = 8
    for i in range(cfg_a["num_hidden_layers"]):
        q, k = ("model.layers.%d.self_attn.%s_proj.weight" % (i, s) for s in "qk")
        zero_groups = [gi for gi in range(3)
                       if float(d[k][gi * hd:(gi + 1) * hd].abs().max()) == 0.0]
        assert len(zero_groups) == 1, i
        z = zero_groups[0]
        assert float(d[q][2 * z * hd:2 * (z + 1) * hd].abs().max()) == 0.0
        sb = score_spectra(cfg_b, d[q], d[k])
        sa = score_spectra(cfg_a, tau[q], tau[k])
        live = [s for h, s in enumerate(sb) if h // 2 != z]
        assert len(live) == 4 and matched(live, sa, 1e-4), i


def test_head_dim_mismatch_falls_back_to_free_form(tmp_path):
    cfg_a = llama.default_config()
    cfg_b = llama.default_config(head_dim=16)
    _, d, log = pair_of_configs(tmp_path, cfg_a, cfg_b)
    assert "structure-aware maps" in log and "free-form attention maps" in log
    assert d["model.layers.0.self_attn.q_proj.weight"].shape == (64, 32)
    assert float(d["model.layers.0.self_attn.q_proj.weight"].abs().max()) > 0


def test_planted_checkpoint_from_a_statistics_file(tmp_path):
    """The structured maps read a statistics file (bico stats) as well."""
    p = planted_pair(tmp_path, seed=8)
    bico("stats", *calib_args(tmp_path), "--output", tmp_path / "S.safetensors")
    r = bico("transfer", "--alpha", "1", "--method", "bico", "--structure", "heads", "--source-base", tmp_path / "A",
             "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "B",
             "--stats", tmp_path / "S.safetensors", "--output", tmp_path / "o.safetensors")
    assert "structure-aware maps" in r.stderr
    tauB = llama.transform(p["cfg"], p["tau"], p["sym"])
    got = load64(tmp_path / "o.safetensors")
    for k, t in p["B"].items():
        assert max_rel(got[k], t + tauB[k], tauB[k]) < 2e-3, k


def test_python_switch(tmp_path):
    """bico.transfer_files(structure=..., rope=...): the same switch from
    Python, with names from the library."""
    bico_py = pytest.importorskip("bico")
    from bico import _enums
    assert _enums.STRUCTURES == {"heads": 1, "free": 2}
    assert _enums.ROPES == {"half": 1, "interleaved": 2, "none": 3}
    p = planted_pair(tmp_path, seed=4)
    tauB = llama.transform(p["cfg"], p["tau"], p["sym"])
    for mode in ("heads", "free"):
        lines = []
        out = tmp_path / ("py_%s.safetensors" % mode)
        bico_py.transfer_files(str(tmp_path / "A"), str(tmp_path / "B"), str(out),
                               source_tuned=str(tmp_path / "Aft"),
                               source_calib=str(tmp_path / "calA.safetensors"),
                               target_calib=str(tmp_path / "calB.safetensors"),
                               structure=mode, rope="half", log=lines.append)
        assert any("structure-aware maps" in x for x in lines) == (mode == "heads")
        got = load64(out)
        for k, t in p["B"].items():
            assert max_rel(got[k], t + tauB[k], tauB[k]) < 2e-3, (mode, k)
    with pytest.raises(bico_py.BicoError):
        bico_py.transfer_files(str(tmp_path / "A"), str(tmp_path / "B"),
                               str(tmp_path / "x.safetensors"),
                               source_tuned=str(tmp_path / "Aft"),
                               source_calib=str(tmp_path / "calA.safetensors"),
                               target_calib=str(tmp_path / "calB.safetensors"),
                               structure="rows")


def test_solver_pool_leaves_structured_sides_to_the_writer(tmp_path):
    """--workers 2: the pool solves the free-form sides, the structured ones
    are solved in order by the writing thread; the output is the same bytes
    as a one-worker run."""
    from cli import same_bytes
    planted_pair(tmp_path, seed=6)
    outs = []
    for w in ("1", "2"):
        out = tmp_path / ("w%s.safetensors" % w)
        bico("transfer", "--alpha", "1", "--method", "bico", "--structure", "heads", "--workers", w, "--threads", w,
             "--source-base", tmp_path / "A", "--source-tuned", tmp_path / "Aft",
             "--target-base", tmp_path / "B", *calib_args(tmp_path), "--quiet",
             "--output", out)
        outs.append(out)
    assert same_bytes(*outs)
