"""Token rows matched by token string (tokenizer.json) when the source and
target vocabularies differ: a planted GPT-2 pair whose target tokenizer is
a permutation of the source's plus new tokens (test/e2e/gpt2.py for the
model, the expected rows from the plant, not from libbico)."""
import json
import os

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
import gpt2  # noqa: E402
import planted as pl  # noqa: E402
from cli import bico  # noqa: E402


def tokenizer(strings, added):
    """A BPE tokenizer.json: strings by id, `added` of them (ids) listed as
    added tokens rather than in model.vocab, as HF writes special tokens."""
    vocab = {s: i for i, s in enumerate(strings) if i not in added}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": strings[i], "special": True,
                              "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False} for i in sorted(added)],
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "vocab": vocab, "merges": []}}


def _pair(tmp_path, n_new=8, seed=31):
    cfg_a = gpt2.default_config(vocab_size=64)
    g = torch.Generator().manual_seed(seed)
    src = [f"t{i}" for i in range(63)] + ["<|endoftext|>"]
    order = torch.randperm(64, generator=g).tolist()     # target id j <- source id order[j]
    tgt = [src[o] for o in order] + [f"n{i}" for i in range(n_new)]
    src_of = order + [None] * n_new
    cfg_b = gpt2.default_config(vocab_size=64 + n_new)
    A = gpt2.random_state(cfg_a, g)
    tau = {k: 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in A.items()}
    sym = gpt2.symmetry(cfg_a, g)
    B = gpt2.transform(cfg_a, A, sym)
    tauB = gpt2.transform(cfg_a, tau, sym)
    W = "transformer.wte.weight"
    fresh = torch.randn(n_new, cfg_a["n_embd"], generator=g, dtype=torch.float64) / 6
    B[W] = torch.cat([B[W][order], fresh])
    tauB[W] = torch.cat([tauB[W][order], torch.zeros_like(fresh)])
    # Calibration on text of shared tokens; the loss weights the new tokens'
    # logits by zero, so B's statistics are A's in B's coordinates.
    ids_a = torch.randint(0, 64, (16, 16), generator=g)
    pos = {o: j for j, o in enumerate(order)}
    ids_b = ids_a.clone().apply_(lambda i: pos[i])
    z_a = torch.randn(16, 16, 64, generator=g, dtype=torch.float64)
    z_b = torch.cat([z_a[..., order], torch.zeros(16, 16, n_new, dtype=torch.float64)], -1)
    for name, cfg, sd, toks, added in (("A", cfg_a, A, src, {63}),
                                       ("Aft", cfg_a, {k: A[k] + tau[k] for k in A}, src, {63}),
                                       ("B", cfg_b, B, tgt, {pos[63], 64 + n_new - 1})):
        gpt2.write_folder(tmp_path / name, cfg, sd)
        json.dump(tokenizer(toks, added), open(tmp_path / name / "tokenizer.json", "w"))
    # Planted check: B computes A's logits on the shared tokens.
    la = gpt2.forward(cfg_a, A, ids_a)
    lb = gpt2.forward(cfg_b, B, ids_b)
    assert (lb[..., :64] - la[..., order]).abs().max() < 1e-9
    pl.save(str(tmp_path / "calA.safetensors"), gpt2.calibrate(cfg_a, A, ids_a, z_a))
    pl.save(str(tmp_path / "calB.safetensors"), gpt2.calibrate(cfg_b, B, ids_b, z_b))
    return dict(B=B, tauB=tauB, src_of=src_of, n_new=n_new)


def _run(t, target="B", extra=()):
    return bico("transfer", "--alpha", "1", "--method", "bico", "--source-base", t / "A",
                "--source-tuned", t / "Aft", "--target-base", t / target,
                "--source-calib", t / "calA.safetensors",
                "--target-calib", t / "calB.safetensors",
                "--output", t / "out.safetensors", "--report", t / "rep.json", *extra)


def test_shared_rows_carried_new_rows_unchanged(tmp_path):
    p = _pair(tmp_path)
    r = _run(tmp_path)
    got, _, _ = pl.load(str(tmp_path / "out.safetensors"))
    W = "transformer.wte.weight"
    scale = np.abs(p["tauB"][W].numpy()).max()
    for j, s in enumerate(p["src_of"]):
        want = (p["B"][W][j] + p["tauB"][W][j]).numpy()
        if s is None:   # a new token: exactly the target's row
            assert np.array_equal(got[W][j], p["B"][W][j].numpy().astype(np.float32)), j
        else:
            assert np.abs(got[W][j] - want).max() < 2e-3 * scale, j
    # Everything else carried as without a vocabulary change.
    for k, t in p["B"].items():
        if k != W:
            err = np.abs(got[k] - (t + p["tauB"][k]).numpy()).max()
            assert err < 2e-3 * max(np.abs(p["tauB"][k].numpy()).max(), 1e-12), k
    rep = json.load(open(tmp_path / "rep.json"))
    assert rep["summary"]["vocab"] == {"source_tokens": 64, "target_tokens": 72,
                                       "shared": 64, "new": 8}
    ent = {e["name"]: e for e in rep["tensors"]}
    assert ent[W]["vocab"] == {"shared": 64, "new": 8}
    assert "vocab" not in ent["transformer.wpe.weight"]
    assert "64 of the target's 72 tokens shared" in r.stderr, r.stderr
    assert "8 new" in r.stderr


def test_identical_vocabularies_need_no_map(tmp_path):
    """Same tokenizer on both sides (and a target that is A itself): no
    vocabulary entry anywhere, no summary line."""
    _pair(tmp_path)
    r = bico("transfer", "--alpha", "1", "--method", "bico", "--source-base", tmp_path / "A",
             "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "A",
             "--source-calib", tmp_path / "calA.safetensors",
             "--target-calib", tmp_path / "calA.safetensors",
             "--output", tmp_path / "o.safetensors", "--report", tmp_path / "r.json")
    rep = json.load(open(tmp_path / "r.json"))
    assert "vocab" not in rep["summary"]
    assert all("vocab" not in e for e in rep["tensors"])
    assert "tokens shared" not in r.stderr


def test_malformed_tokenizer_is_named(tmp_path):
    _pair(tmp_path)
    with open(tmp_path / "B" / "tokenizer.json", "w") as f:
        f.write('{"model": {"vocab": {"a": "x"}}}')
    r = bico(
        "transfer", "--alpha", "1", "--method", "bico", "--source-base", tmp_path / "A",
        "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "B",
        "--source-calib", tmp_path / "calA.safetensors",
        "--target-calib", tmp_path / "calB.safetensors",
        "--output", tmp_path / "o.safetensors", ok=False)
    assert r.returncode != 0
    assert "tokenizer.json" in r.stderr and "non-integer" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_a_token_id_far_beyond_the_vocabulary_is_refused_fast(tmp_path):
    """issue 22: a 60-byte tokenizer.json naming id 2^31 - 1 cost 68 s and
    16.8 GB before "out of memory"; it is refused at once, naming the file
    and the id.  The same with the id among added_tokens."""
    _pair(tmp_path)
    for doc in ({"model": {"vocab": {"a": 0, "b": 2147483647}}},
                {"model": {"vocab": {"a": 0}},
                 "added_tokens": [{"id": 1 << 30, "content": "<x>"}]}):
        with open(tmp_path / "B" / "tokenizer.json", "w") as f:
            json.dump(doc, f)
        r = bico(
            "transfer", "--alpha", "1", "--method", "bico", "--source-base", tmp_path / "A",
            "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "B",
            "--source-calib", tmp_path / "calA.safetensors",
            "--target-calib", tmp_path / "calB.safetensors",
            "--output", tmp_path / "o.safetensors", ok=False, timeout=20)
        assert r.returncode == 1, r.stderr
        bad = max(v for v in doc["model"]["vocab"].values()) \
            if "added_tokens" not in doc else doc["added_tokens"][0]["id"]
        assert str(tmp_path / "B" / "tokenizer.json") in r.stderr, r.stderr
        assert f"token id {bad}" in r.stderr and "out of memory" not in r.stderr, r.stderr
        assert not os.path.exists(tmp_path / "o.safetensors")
