"""The Llama-family plant (test/e2e/llama.py) that the decoder-LLM tests
build on: B = A in other coordinates, from true symmetries only, computes
A's logits; so does B + transform(tau) against A + tau.  Checked against
the model's own forward pass, independent of libbico."""
import json
import os

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402


@pytest.mark.parametrize("kw", [
    dict(),                                                   # GQA 4/2, tied
    dict(num_key_value_heads=4, attention_bias=True,          # MHA, Qwen2 biases,
         tie_word_embeddings=False),                          # untied head
    dict(num_key_value_heads=1, num_hidden_layers=3),         # MQA
    dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=10),
    dict(model_type="gemma", head_dim=16),                   # Gemma: 1 + w, GeGLU
])
def test_symmetry_preserves_function_and_task_vector(kw):
    cfg = llama.default_config(**kw)
    g = torch.Generator().manual_seed(5)
    A = llama.random_state(cfg, g)
    tau = {k: 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in A.items()}
    sym = llama.symmetry(cfg, g)
    B = llama.transform(cfg, A, sym)
    tauB = llama.transform(cfg, tau, sym)
    ids = torch.randint(0, cfg["vocab_size"], (3, 12), generator=g)
    la = llama.forward(cfg, A, ids)
    assert (llama.forward(cfg, B, ids) - la).abs().max() < 1e-10
    Aft = {k: A[k] + tau[k] for k in A}
    Bft = {k: B[k] + tauB[k] for k in B}
    lft = llama.forward(cfg, Aft, ids)
    assert (llama.forward(cfg, Bft, ids) - lft).abs().max() < 1e-10
    # The plant is not trivial: the tuned model differs, and naive addition
    # of tau to B does not compute A_ft's function.
    assert (lft - la).abs().max() > 1e-2
    Bnaive = {k: B[k] + tau[k] for k in B}
    assert (llama.forward(cfg, Bnaive, ids) - lft).abs().max() > 1e-2


def test_norm_scales_move_as_operators_not_vectors():
    """With a signed residual permutation, the vector rule P g flips signs of
    the scale; only |P| g (the diagonal of P diag(g) P^T) keeps the function."""
    cfg = llama.default_config()
    g = torch.Generator().manual_seed(9)
    A = llama.random_state(cfg, g)
    sym = llama.symmetry(cfg, g)
    assert (sym["P"] < 0).any()
    B = llama.transform(cfg, A, sym)
    ids = torch.randint(0, cfg["vocab_size"], (2, 8), generator=g)
    wrong = dict(B)
    for k in B:
        if k.endswith("norm.weight"):
            wrong[k] = sym["P"] @ A[k]
            op = torch.diagonal(sym["P"] @ torch.diag(A[k]) @ sym["P"].T)
            assert torch.allclose(op, B[k])
    assert (llama.forward(cfg, wrong, ids) - llama.forward(cfg, A, ids)).abs().max() > 1e-2


def planted_transfer(tmp_path, cfg, A, tau, cfgB, B, ids, z, zB, *extra):
    """Writes A, A + tau and B as model folders with their calibration files
    (loss sum(logits * z), zB on B) and runs bico transfer --method bico
    with no other flags: (the completed process, the output path)."""
    import subprocess
    import planted as pl
    build = os.environ.get("BICO_BUILD", os.path.join(HERE, "..", "..", "build"))
    llama.write_folder(tmp_path / "A", cfg, A)
    llama.write_folder(tmp_path / "Aft", cfg, {k: A[k] + tau[k] for k in A})
    llama.write_folder(tmp_path / "B", cfgB, B)
    pl.save(str(tmp_path / "calA.safetensors"), llama.calibrate(cfg, A, ids, z))
    pl.save(str(tmp_path / "calB.safetensors"), llama.calibrate(cfgB, B, ids, zB))
    out = tmp_path / "out.safetensors"
    r = subprocess.run([os.path.join(build, "bin", "bico"), "transfer", "--alpha", "1", "--method", "bico",
                        "--source-base", tmp_path / "A", "--source-tuned", tmp_path / "Aft",
                        "--target-base", tmp_path / "B",
                        "--source-calib", tmp_path / "calA.safetensors",
                        "--target-calib", tmp_path / "calB.safetensors",
                        "--output", out, *extra], capture_output=True, text=True)
    return r, out


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_bico_on_planted_llama_folders(tmp_path, family):
    """bico transfer on Hugging Face folders of a planted Llama pair (B = A
    in other coordinates, tied embedding, generic full-rank statistics):
    every linear weight and the tied embedding come out as the planted
    T(tau), with no extra flags (free-form maps, the default: exact on a
    planted pair; the structure-aware maps, --structure heads, are in
    test_llama_structure.py; the embedding through the first block's
    input_layernorm map), and the RMSNorm scales too: under signed residual
    permutations only the operator rule (R o R)^T tau is right (the vector
    rule R^T tau flips their signs).  Gemma's variant (scales stored as
    1 + w, embedding times sqrt(d), GeGLU) takes the same rules; both
    compute A_ft's logits after the transfer."""
    import numpy as np
    import planted as pl
    cfg = llama.default_config(**({} if family == "llama" else dict(
        model_type="gemma", architectures=["GemmaForCausalLM"])))
    g = torch.Generator().manual_seed(21)
    A = llama.random_state(cfg, g)
    tau = {k: 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in A.items()}
    sym = llama.symmetry(cfg, g)
    B = llama.transform(cfg, A, sym)
    tauB = llama.transform(cfg, tau, sym)
    ids = torch.randint(0, cfg["vocab_size"], (8, 16), generator=g)
    z = torch.randn(8, 16, cfg["vocab_size"], generator=g, dtype=torch.float64)
    r, out = planted_transfer(tmp_path, cfg, A, tau, cfg, B, ids, z, z)
    assert r.returncode == 0, r.stderr
    assert "structure-aware maps" not in r.stderr, r.stderr
    got, _, _ = pl.load(str(out))
    for k, t in B.items():
        want = (t + tauB[k]).numpy()
        err = np.abs(got[k] - want).max() / max(np.abs(tauB[k].numpy()).max(), 1e-12)
        assert err < 2e-3, (k, err)
    merged = {k: torch.from_numpy(v).double() for k, v in got.items()}
    want = llama.forward(cfg, {k: A[k] + tau[k] for k in A}, ids)
    have = llama.forward(cfg, merged, ids)
    assert float((have - want).abs().max()) < 1e-3 * float(want.abs().max())
    assert float((llama.forward(cfg, B, ids) - want).abs().max()) > 1e-2  # not trivial


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("pad", [0, 5], ids=["same-rows", "padded"])
def test_token_rows_are_tokens_not_a_map(tmp_path, tied, pad):
    """The vocabulary side of the token table and of an untied lm_head is
    the token's identity, never a map fitted over the vocabulary space: B's
    table may be padded with rows A lacks (Qwen2 releases pad 151936 or
    152064 rows, one tokenizer).  Token rows present in both carry T(tau),
    the extra target rows are left exactly as they were, and the result
    computes A_ft's logits on every token A knows."""
    import subprocess
    import numpy as np
    import planted as pl
    build = os.environ.get("BICO_BUILD", os.path.join(HERE, "..", "..", "build"))
    cfg = llama.default_config(tie_word_embeddings=tied)
    V = cfg["vocab_size"]
    g = torch.Generator().manual_seed(33)
    A = llama.random_state(cfg, g)
    tau = {k: 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in A.items()}
    sym = llama.symmetry(cfg, g)
    B = llama.transform(cfg, A, sym)
    tauB = llama.transform(cfg, tau, sym)
    heads = [k for k in ("model.embed_tokens.weight", "lm_head.weight") if k in B]
    assert len(heads) == (1 if tied else 2)
    cfgB = dict(cfg, vocab_size=V + pad)
    for k in heads:  # rows A lacks
        B[k] = torch.cat([B[k], torch.randn(pad, B[k].shape[1], generator=g,
                                            dtype=B[k].dtype)])
    ids = torch.randint(0, V, (8, 16), generator=g)
    z = torch.randn(8, 16, V, generator=g, dtype=torch.float64)
    zB = torch.cat([z, torch.zeros(8, 16, pad, dtype=z.dtype)], dim=-1)
    r, out = planted_transfer(tmp_path, cfg, A, tau, cfgB, B, ids, z, zB,
                              "--report", tmp_path / "rep.json")
    assert r.returncode == 0, r.stderr
    got, _, _ = pl.load(str(out))
    for k in heads:
        assert got[k].shape == (V + pad, cfg["hidden_size"]), k
        want = (B[k][:V] + tauB[k]).numpy()
        err = np.abs(got[k][:V] - want).max() / np.abs(tauB[k].numpy()).max()
        assert err < 2e-3, (k, err)
        assert np.array_equal(got[k][V:], B[k][V:].float().numpy()), k
    rep = json.load(open(tmp_path / "rep.json"))
    by = {e["name"]: e for e in rep["tensors"]}
    for k in heads:
        maps = by[k].get("maps", {})
        assert "out" not in maps, (k, maps)  # no map over the vocabulary
        if pad:
            assert by[k]["vocab"] == {"shared": V, "new": pad}, by[k]
    # bico inspect says the same before any run
    r = subprocess.run([os.path.join(build, "bin", "bico"), "inspect", tmp_path / "A",
                        tmp_path / "B", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    plan = {e["name"]: e for e in json.loads(r.stdout)["tensors"]}
    for k in heads:
        assert plan[k]["out_maps"] == 0 and plan[k]["vocab"] == bool(pad), plan[k]
    merged = {k: torch.from_numpy(v).double() for k, v in got.items()}
    Aft = {k: A[k] + tau[k] for k in A}
    want = llama.forward(cfg, Aft, ids)
    have = llama.forward(cfgB, merged, ids)[..., :V]
    assert float((have - want).abs().max()) < 1e-3 * float(want.abs().max())
