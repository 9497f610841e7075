"""GPT-2 (Conv1D weights stored [in, out], fused c_attn, tied wte,
LayerNorm) through `bico transfer` on Hugging Face folders: a planted pair
(test/e2e/gpt2.py: B = A in other coordinates, from true symmetries only)
recovered exactly with no extra flags, full checkpoints and a PEFT LoRA
adapter on c_attn (fan_in_fan_out).  The expected results come from the
plant, not from libbico."""
import json
import os

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
import gpt2  # noqa: E402
import planted as pl  # noqa: E402
from cli import bico  # noqa: E402


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_symmetry_preserves_function_and_task_vector(prefix):
    cfg = gpt2.default_config()
    g = torch.Generator().manual_seed(3)
    A = gpt2.random_state(cfg, g, prefix)
    tau = {k: 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in A.items()}
    sym = gpt2.symmetry(cfg, g)
    B = gpt2.transform(cfg, A, sym)
    tauB = gpt2.transform(cfg, tau, sym)
    ids = torch.randint(0, cfg["vocab_size"], (3, 12), generator=g)
    la = gpt2.forward(cfg, A, ids)
    assert (gpt2.forward(cfg, B, ids) - la).abs().max() < 1e-10
    lft = gpt2.forward(cfg, {k: A[k] + tau[k] for k in A}, ids)
    assert (gpt2.forward(cfg, {k: B[k] + tauB[k] for k in B}, ids) - lft).abs().max() < 1e-10
    # Not trivial: tau changes the function, and adding it to B unmapped
    # does not compute A_ft's.
    assert (lft - la).abs().max() > 1e-2
    naive = gpt2.forward(cfg, {k: B[k] + tau[k] for k in B}, ids)
    assert (naive - lft).abs().max() > 1e-2


def test_signs_are_no_symmetry_of_layernorm():
    """Why the plant uses permutations: a signed permutation of the
    residual stream changes LayerNorm's mean and so the function."""
    cfg = gpt2.default_config()
    g = torch.Generator().manual_seed(4)
    A = gpt2.random_state(cfg, g)
    sym = gpt2.symmetry(cfg, g)
    sym["P"] = sym["P"] * torch.where(torch.arange(cfg["n_embd"]) % 2 == 0, 1.0, -1.0)[:, None].double()
    B = gpt2.transform(cfg, A, sym)
    ids = torch.randint(0, cfg["vocab_size"], (2, 8), generator=g)
    assert (gpt2.forward(cfg, B, ids) - gpt2.forward(cfg, A, ids)).abs().max() > 1e-3


def _plant(tmp_path, prefix="transformer.", config=True, seed=21):
    cfg = gpt2.default_config()
    g = torch.Generator().manual_seed(seed)
    A = gpt2.random_state(cfg, g, prefix)
    tau = {k: 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in A.items()}
    sym = gpt2.symmetry(cfg, g)
    B = gpt2.transform(cfg, A, sym)
    tauB = gpt2.transform(cfg, tau, sym)
    ids = torch.randint(0, cfg["vocab_size"], (16, 16), generator=g)
    z = torch.randn(16, 16, cfg["vocab_size"], generator=g, dtype=torch.float64)
    gpt2.write_folder(tmp_path / "A", cfg, A, config=config)
    gpt2.write_folder(tmp_path / "Aft", cfg, {k: A[k] + tau[k] for k in A}, config=config)
    gpt2.write_folder(tmp_path / "B", cfg, B, config=config)
    pl.save(str(tmp_path / "calA.safetensors"), gpt2.calibrate(cfg, A, ids, z))
    pl.save(str(tmp_path / "calB.safetensors"), gpt2.calibrate(cfg, B, ids, z))
    return dict(cfg=cfg, A=A, B=B, tau=tau, tauB=tauB, sym=sym, ids=ids)


def _calib(t):
    return ["--source-calib", t / "calA.safetensors", "--target-calib", t / "calB.safetensors"]


@pytest.mark.parametrize("prefix,config", [("transformer.", True), ("", False)])
def test_bico_recovers_planted_gpt2_folders(tmp_path, prefix, config):
    """Every Conv1D weight and bias (c_attn split in q, k, v by default),
    the LayerNorms and the tied wte/wpe come out as the planted T(tau);
    the family is known from config.json, or from the names without it."""
    p = _plant(tmp_path, prefix, config)
    out = tmp_path / "out.safetensors"
    bico("transfer", "--alpha", "1", "--method", "bico", "--source-base", tmp_path / "A",
         "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "B",
         *_calib(tmp_path), "--quiet", "--output", out, "--report", tmp_path / "rep.json")
    got, _, _ = pl.load(str(out))
    for k, t in p["B"].items():
        want = (t + p["tauB"][k]).numpy()
        err = np.abs(got[k] - want).max() / max(np.abs(p["tauB"][k].numpy()).max(), 1e-12)
        assert err < 2e-3, (k, err)
    rep = json.load(open(tmp_path / "rep.json"))
    assert rep["summary"]["unchanged"] == 0, rep["summary"]
    # The result computes A_ft's logits.
    sd = {k: torch.from_numpy(v.astype(np.float64)) for k, v in got.items()}
    Aft = {k: p["A"][k] + p["tau"][k] for k in p["A"]}
    lft = gpt2.forward(p["cfg"], Aft, p["ids"][:2])
    assert (gpt2.forward(p["cfg"], sd, p["ids"][:2]) - lft).abs().max() < 1e-3 * lft.abs().max()


def test_c_attn_splits_in_three_by_default(tmp_path):
    """The report shows c_attn's output carried by three maps (q, k, v) by
    default, and one when the user overrides the split; c_proj and c_fc,
    not fused, keep one."""
    _plant(tmp_path)
    for extra, want in (([], 3), (["--split", "attn.c_attn=1"], 1)):
        rep = tmp_path / "rep.json"
        bico("transfer", "--alpha", "1", "--method", "bico", "--source-base", tmp_path / "A",
             "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "B",
             *_calib(tmp_path), *extra, "--quiet", "--output", tmp_path / "o.safetensors",
             "--report", rep)
        ent = {e["name"]: e for e in json.load(open(rep))["tensors"]}
        maps = ent["transformer.h.1.attn.c_attn.weight"]["maps"]
        assert len(maps.get("out_blocks", [maps.get("out")])) == want, maps
        assert maps["in"]["shape"] == [32, 32]
        for m in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert "out_blocks" not in ent[f"transformer.h.1.{m}.weight"]["maps"]
        assert ent["transformer.h.1.mlp.c_fc.weight"]["maps"]["out"]["shape"] == [128, 128]


def test_lora_on_c_attn_with_fan_in_fan_out(tmp_path):
    """PEFT on GPT-2 sets fan_in_fan_out=True (the base weights are Conv1D):
    lora_A [r, in], lora_B [out, r], delta = (B A)^T in the weight's
    layout.  Carried in factored form, the adapter's update is the planted
    T(delta), block-wise over q, k, v."""
    p = _plant(tmp_path)
    cfg, d, r = p["cfg"], p["cfg"]["n_embd"], 4
    g = torch.Generator().manual_seed(8)
    ad = {}
    for i in range(cfg["n_layer"]):
        m = f"transformer.h.{i}.attn.c_attn"
        ad[m] = (0.3 * torch.randn(r, d, generator=g, dtype=torch.float64),
                 0.3 * torch.randn(3 * d, r, generator=g, dtype=torch.float64))
    folder = tmp_path / "ad"
    os.makedirs(folder)
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 8, "fan_in_fan_out": True,
               "target_modules": ["c_attn"], "lora_dropout": 0.0, "bias": "none",
               "base_model_name_or_path": "A", "task_type": "CAUSAL_LM"},
              open(folder / "adapter_config.json", "w"))
    P = "base_model.model."
    tens = {}
    for m, (a, b) in ad.items():
        tens[P + m + ".lora_A.weight"] = a.numpy().astype(np.float32)
        tens[P + m + ".lora_B.weight"] = b.numpy().astype(np.float32)
    pl.save(str(folder / "adapter_model.safetensors"), tens)
    bico("transfer", "--alpha", "1", "--method", "bico", "--source-base", tmp_path / "A",
         "--target-base", tmp_path / "B", *_calib(tmp_path), "--lora", folder,
         "--output-lora", tmp_path / "out", "--quiet")
    got, _, _ = pl.load(str(tmp_path / "out" / "adapter_model.safetensors"))
    scale = 8 / r
    for i in range(cfg["n_layer"]):
        m = f"transformer.h.{i}.attn.c_attn"
        a, b = ad[m]
        delta = {m + ".weight": (scale * b @ a).T}       # [in, out], as stored
        want = gpt2.transform(cfg, delta, p["sym"])[m + ".weight"]
        ga = got[P + m + ".lora_A.weight"].astype(np.float64)
        gb = got[P + m + ".lora_B.weight"].astype(np.float64)
        have = (scale * gb @ ga).T
        err = np.abs(have - want.numpy()).max() / np.abs(want.numpy()).max()
        assert err < 2e-3, (m, err)
    # Merged into the target base instead: the stored [in, out] weight is
    # B + T(delta), the update transposed back into Conv1D's layout.
    merged = tmp_path / "merged.safetensors"
    bico("transfer", "--alpha", "1", "--method", "bico", "--source-base", tmp_path / "A",
         "--target-base", tmp_path / "B", *_calib(tmp_path), "--lora", folder,
         "--merge-into-base", "--output", merged, "--quiet")
    got, _, _ = pl.load(str(merged))
    for i in range(cfg["n_layer"]):
        m = f"transformer.h.{i}.attn.c_attn"
        a, b = ad[m]
        want = gpt2.transform(cfg, {m + ".weight": (scale * b @ a).T}, p["sym"])[m + ".weight"]
        err = np.abs(got[m + ".weight"] - (p["B"][m + ".weight"] + want).numpy()).max()
        assert err < 2e-3 * np.abs(want.numpy()).max(), (m, err)
    k = "transformer.h.0.mlp.c_fc.weight"   # no adapter there: the base's values
    assert np.array_equal(got[k], p["B"][k].numpy().astype(np.float32))
