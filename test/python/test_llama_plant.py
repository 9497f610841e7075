"""The Llama-family plant (test/e2e/llama.py) that the decoder-LLM tests
build on: B = A in other coordinates, from true symmetries only, computes
A's logits; so does B + transform(tau) against A + tau.  Checked against
the model's own forward pass, independent of libbico."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import llama  # noqa: E402


@pytest.mark.parametrize("kw", [
    dict(),                                                   # GQA 4/2, tied
    dict(num_key_value_heads=4, attention_bias=True,          # MHA, Qwen2 biases,
         tie_word_embeddings=False),                          # untied head
    dict(num_key_value_heads=1, num_hidden_layers=3),         # MQA
    dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=10),
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
