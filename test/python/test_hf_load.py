"""bico.llm.load_model, text_batches and save_adapter against
independent computations: the logits of test/e2e/llama.py's forward on the
same tensors, byte counts of text, an SVD of the fitted values, and
libbico's own LoRA reader and merge (`bico transfer --method naive --lora
... --merge-into-base`)."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

import bico
import bico.lora as bl
import bico.safetensors as st
import bico.llm as llm

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402
import llm_pair  # noqa: E402

torch.set_num_threads(1)
BICO = os.path.join(os.environ.get("BICO_BUILD", "build"), "bin", "bico")

CASES = {
    "llama-tied": dict(),
    "llama-untied": dict(tie_word_embeddings=False),
    "qwen2-bias": dict(model_type="qwen2", attention_bias=True),
    "gemma": dict(model_type="gemma", head_dim=8, intermediate_size=40),
    "mistral-gqa": dict(model_type="mistral", num_key_value_heads=1,
                        sliding_window=4, rope_theta=500.0),
}


def write(folder, cfg, sd, dtype, shard=0):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    st.write(str(folder) + "/", {k: v.to(dtype) for k, v in sd.items()},
             max_shard_size=shard)


def reference(cfg, sd, ids):
    if cfg["model_type"] == "mistral":
        pytest.skip("llama.py has no sliding window")
    return llama.forward(cfg, sd, ids)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_the_independent_forward(tmp_path, case):
    cfg = llama.default_config(**CASES[case])
    sd = llama.random_state(cfg, torch.Generator().manual_seed(3))
    sd = {k: v.to(torch.bfloat16).double() for k, v in sd.items()}
    write(tmp_path / "m", cfg, sd, torch.bfloat16, shard=3000)
    assert os.path.exists(tmp_path / "m" / "model.safetensors.index.json")
    ids = torch.randint(0, cfg["vocab_size"], (2, 12),
                        generator=torch.Generator().manual_seed(4))
    m64 = llm.load_model(tmp_path / "m", dtype=torch.float64)
    assert set(m64.state_dict()) == set(sd) | {"lm_head.weight"}
    if cfg["tie_word_embeddings"]:
        assert m64.lm_head.weight is m64.model.embed_tokens.weight
    if case == "mistral-gqa":
        # the sliding window: with a window longer than the text the same
        # logits as without; with 4, a different result
        cfg2 = dict(cfg, sliding_window=None)
        write(tmp_path / "nw", cfg2, sd, torch.bfloat16)
        full = llm.load_model(tmp_path / "nw", dtype=torch.float64)
        assert (m64(ids) - full(ids)).abs().max() > 1e-3
        ref = llama.forward(dict(cfg, model_type="llama"), sd, ids)
        np.testing.assert_allclose(full(ids).detach(), ref.detach(),
                                   rtol=0, atol=1e-10)
        return
    ref = reference(cfg, sd, ids).detach()
    np.testing.assert_allclose(m64(ids).detach(), ref, rtol=0, atol=1e-10)
    # the files' dtype kept (BF16), logits within BF16 tolerance
    mb = llm.load_model(tmp_path / "m")
    assert all(v.dtype == torch.bfloat16 for v in mb.state_dict().values())
    err = (mb(ids).double() - ref).abs().max() / ref.abs().max()
    assert err < 0.05, err


def test_float32_file_and_unknown_type(tmp_path):
    cfg = llama.default_config(tie_word_embeddings=False)
    sd = llama.random_state(cfg, torch.Generator().manual_seed(5))
    write(tmp_path / "m", cfg, sd, torch.float32)
    m = llm.load_model(tmp_path / "m")
    assert m.lm_head.weight.dtype == torch.float32
    assert m.lm_head.weight is not m.model.embed_tokens.weight
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(dict(cfg, model_type="gpt_bigcode"), f)
    with pytest.raises(bico.BicoError) as e:
        llm.load_model(tmp_path / "m")
    assert "config.json" in str(e.value) and "gpt_bigcode" in str(e.value)
    os.remove(tmp_path / "m" / "config.json")
    with pytest.raises(bico.BicoError, match="config.json"):
        llm.load_model(tmp_path / "m")


# ---------------------------------------------------------------- text

def test_text_batches_windows_and_holdout(tmp_path):
    text = llm_pair.task_text(60)
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps(llm_pair.tokenizer_json()))
    ids = llm.tokenize(text, str(tok))
    assert ids.tolist() == list(text.encode("utf-8"))
    cal = llm.text_batches(text, 16, holdout=0.25, tokenizer=str(tmp_path),
                          batch_size=4)
    m = (len(ids) - 1) // 16
    fit = torch.cat([x for x, _ in cal.batches])
    held = torch.cat([x for x, _ in cal.held_out])
    assert len(fit) + len(held) == m and cal.windows == len(fit)
    assert len(held) == round(m * 0.25)
    rows = set(tuple(r.tolist()) for r in fit)
    assert not rows & set(tuple(r.tolist()) for r in held)
    for x, y in cal.batches + cal.held_out:
        assert x.shape == y.shape and x.shape[1] == 16
        assert torch.equal(x[:, 1:], y[:, :-1])
    # ids (a list, an .npy file), a callable: the same windows
    np.save(tmp_path / "ids.npy", ids.numpy())
    for src, kw in ((ids.tolist(), {}), (str(tmp_path / "ids.npy"), {}),
                    (text, {"tokenizer": lambda s: list(s.encode())})):
        c2 = llm.text_batches(src, 16, holdout=0.25, batch_size=4, **kw)
        assert torch.equal(torch.cat([x for x, _ in c2.batches]), fit)
    c3 = llm.text_batches(ids, 16, n=10, holdout=0.2)
    assert c3.windows + sum(len(x) for x, _ in c3.held_out) == 10


def test_tokenizer_other_than_bytes_needs_the_tokenizers_package(tmp_path):
    # a SentencePiece-style BPE (Metaspace, no byte symbols): not read natively
    spec = llm_pair.tokenizer_json()
    spec["model"]["vocab"] = {"\u2581a": 0, "b": 1, "\u2581ab": 2}
    spec["model"]["merges"] = ["\u2581a b"]
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    import importlib.util
    if importlib.util.find_spec("tokenizers") is not None:
        pytest.skip("tokenizers is installed")
    with pytest.raises(bico.BicoError, match="tokenizers") as e:
        llm.tokenize("ab", str(tmp_path / "tokenizer.json"))
    assert str(tmp_path / "tokenizer.json") in str(e.value)


@pytest.mark.parametrize("merges, needs", [(["a b"], "'ab'"),
                                           (["a zz"], "'zz'"),
                                           (["a"], "not a pair")])
def test_a_malformed_byte_level_bpe_is_refused_naming_the_merge(
        tmp_path, merges, needs):
    spec = llm_pair.tokenizer_json()  # the 256 byte symbols, no merges
    spec["model"]["type"] = "BPE"
    spec["model"]["merges"] = merges
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    import importlib.util
    if importlib.util.find_spec("tokenizers") is not None:
        pytest.skip("tokenizers is installed")
    with pytest.raises(bico.BicoError, match="merge 0") as e:
        llm.tokenize("ab", str(tmp_path / "tokenizer.json"))
    assert needs in str(e.value)
    assert str(tmp_path / "tokenizer.json") in str(e.value)
    assert e.value.status == bico.E_FORMAT


# ---------------------------------------------------------------- adapters

def test_low_rank_is_reduced_rank_regression():
    g = torch.Generator().manual_seed(0)
    for d_out, d_in in ((6, 10), (10, 6)):
        x = torch.randn(200, d_in, generator=g, dtype=torch.float64) @ \
            torch.randn(d_in, d_in, generator=g, dtype=torch.float64)
        dw = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
        # independent: the fitted values' top-r right singular vectors
        _, _, qh = torch.linalg.svd(x @ dw.T, full_matrices=False)
        for r in (1, 3):
            want = qh[:r].T @ qh[:r] @ dw
            b, a = llm.low_rank(dw, r, x.T @ x)
            assert b.shape == (d_out, r) and a.shape == (r, d_in)
            np.testing.assert_allclose(b @ a, want, atol=1e-9)
            # the output route of update_grams gives the same answer
            if d_out <= d_in:
                y = x @ dw.T
                b2, a2 = llm.low_rank(dw, r, ("out", y.T @ y))
                np.testing.assert_allclose(b2 @ a2, want, atol=1e-9)
            # no weighting: the truncated SVD
            u, s, vh = torch.linalg.svd(dw)
            b3, a3 = llm.low_rank(dw, r)
            np.testing.assert_allclose(b3 @ a3, (u[:, :r] * s[:r]) @ vh[:r],
                                       atol=1e-9)
        b, a = llm.low_rank(dw, 64, x.T @ x)  # full rank: the update itself
        np.testing.assert_allclose(b @ a, dw, atol=1e-9)


def test_tall_low_rank_is_reduced_rank_regression_by_pieces():
    """bico.llm.adapters.tall_low_rank (a head's pair, its update read a
    piece of rows at a time) against the same independent reference: the
    fitted values' top-r right singular vectors; a rank-deficient update
    (rank 2 < r) gives the update itself; pieces of any size agree; the
    pieces are read, never the whole."""
    from bico.llm.adapters import tall_low_rank
    g = torch.Generator().manual_seed(1)
    d_out, d_in = 70, 9
    x = torch.randn(300, d_in, generator=g, dtype=torch.float64) @ \
        torch.randn(d_in, d_in, generator=g, dtype=torch.float64)
    for dw in (torch.randn(d_out, d_in, generator=g, dtype=torch.float64),
               torch.randn(d_out, 2, generator=g, dtype=torch.float64) @
               torch.randn(2, d_in, generator=g, dtype=torch.float64)):
        _, s, qh = torch.linalg.svd(x @ dw.T, full_matrices=False)
        for r in (1, 3, 6):
            k = min(r, int((s > 1e-9 * s[0]).sum()))
            want = qh[:k].T @ qh[:k] @ dw
            for step in (7, 70, 1000):
                seen = []

                def piece(r0, r1):
                    seen.append((r0, r1))
                    return dw[r0:r1].clone()
                b, a = tall_low_rank(piece, d_out, r, x.T @ x, step=step)
                assert b.shape == (d_out, k) and a.shape == (k, d_in)
                np.testing.assert_allclose(b @ a, want, atol=1e-8)
                assert all(r1 - r0 <= step for r0, r1 in seen)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("tgt")
    cfg = llama.default_config(model_type="qwen2", attention_bias=True,
                               vocab_size=48, hidden_size=16,
                               intermediate_size=24)
    sd = llama.random_state(cfg, torch.Generator().manual_seed(7))
    sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    write(d / "B", cfg, sd, torch.bfloat16, shard=2000)
    return d / "B", cfg


def merged_by_bico(tmp_path, target_folder, adapter):
    out = tmp_path / "merged.safetensors"
    subprocess.run([BICO, "transfer", "--alpha", "1", "--method", "naive", "--source-base",
                    str(target_folder), "--target-base", str(target_folder),
                    "--lora", str(adapter), "--output-lora",
                    str(tmp_path / "carried"), "--merge-into-base", "--output",
                    str(out), "--quiet"], check=True)
    return st.read(str(out), dtype=np.float64)


def test_save_adapter_loads_and_merges_to_the_truncated_update(tmp_path,
                                                               target):
    folder, cfg = target
    model = llm.load_model(folder)
    base = {k: v.double() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(8)
    delta = {}
    for k, v in base.items():
        if v.ndim == 2 and "embed" not in k and k != "lm_head.weight":
            delta[k] = 0.1 * torch.randn(v.shape, generator=g,
                                         dtype=torch.float64)
    delta["model.norm.weight"] = 0.1 * torch.ones(cfg["hidden_size"],
                                                  dtype=torch.float64)
    delta["model.layers.0.self_attn.q_proj.bias"] = torch.ones(
        cfg["num_attention_heads"] * cfg["head_dim"], dtype=torch.float64)
    fitted = {k: (base[k] + delta[k]) if k in delta else base[k]
              for k in base}
    for r, save in ((2, []), (64, ["norm"])):
        ad = tmp_path / ("ad%d" % r)
        rep = llm.save_adapter(ad, model, fitted, r, lora_alpha=2 * r,
                              modules_to_save=save,
                              base_model_name_or_path="B")
        cfgj = json.load(open(ad / "adapter_config.json"))
        assert cfgj["peft_type"] == "LORA" and cfgj["r"] == r
        assert cfgj["lora_alpha"] == 2 * r and cfgj["task_type"] == \
            "CAUSAL_LM"
        assert cfgj["base_model_name_or_path"] == "B"
        assert set(cfgj["target_modules"]) == {
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
            "down_proj"}
        names = st.open(str(ad / "adapter_model.safetensors"))
        for m in rep["modules"]:
            w = base[m + ".weight"]
            # one dtype rule: float32 factors (PEFT's), whole tensors in
            # the target's dtype (BF16 here)
            assert names.info("base_model.model.%s.lora_A.weight" % m) == \
                ("F32", (r, w.shape[1]))
            assert names.info("base_model.model.%s.lora_B.weight" % m) == \
                ("F32", (w.shape[0], r))
        if save:
            assert names.info("base_model.model.model.norm.weight")[0] == \
                "BF16"
        # what could not be carried is said
        assert "model.layers.0.self_attn.q_proj.bias" in rep["left_out"]
        assert ("model.norm.weight" in rep["left_out"]) == (not save)
        note = json.load(open(ad / "bico_adapter.json"))
        assert note["left_out"] == rep["left_out"]
        # libbico's reader takes it: names and shapes
        mods = bl.Adapter.open(str(ad)).modules()
        assert sorted(mods) == sorted(rep["modules"])
        merged = merged_by_bico(tmp_path, folder, ad)
        for m in rep["modules"]:
            w = m + ".weight"
            b, a = llm.low_rank(delta[w], r)
            want = base[w] + b @ a
            got = torch.as_tensor(merged[w])
            # BF16 factors and merged weights: relative to the update
            assert (got - want).norm() < 0.03 * delta[w].norm() + \
                0.01 * base[w].norm(), w
            if r == 64:   # full rank: the dense update
                assert (got - base[w] - delta[w]).norm() < \
                    0.03 * delta[w].norm() + 0.01 * base[w].norm()
        if save:
            np.testing.assert_allclose(merged["model.norm.weight"],
                                       fitted["model.norm.weight"],
                                       atol=0.02)


def test_saved_tied_embedding_moves_the_head_too(tmp_path, target):
    """A tied embedding stored whole (modules_to_save) is one tensor with
    the head.  PEFT gives each module of modules_to_save its own copy, so
    the adapter stores the tensor under both names (embed_tokens and
    lm_head, both in modules_to_save): loaded by PEFT's rules
    (test/e2e/peft_rules.py) the model is the target moved by the
    adapter's effective update, head included.  (Saved under the
    embedding's name alone, as before, PEFT moved the embedding copy and
    left the head: the scored model was not the loaded one.)"""
    import peft_rules
    folder, cfg = target
    model = llm.load_model(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    emb = "model.embed_tokens.weight"
    d = {emb: 0.05 * torch.randn(model.model.embed_tokens.weight.shape,
                                 generator=torch.Generator().manual_seed(9),
                                 dtype=torch.float64)}
    q = "model.layers.0.self_attn.q_proj.weight"
    d[q] = 0.05 * torch.ones(model.state_dict()[q].shape, dtype=torch.float64)
    rep = llm.save_adapter(tmp_path / "ad", model, d, 4, is_delta=True,
                          modules_to_save=["embed_tokens"],
                          return_effective=True)
    assert rep["saved"] == [emb, "lm_head.weight"] and not rep["left_out"]
    cfgj = json.load(open(tmp_path / "ad" / "adapter_config.json"))
    assert cfgj["modules_to_save"] == ["lm_head", "model.embed_tokens"]
    assert torch.equal(rep["effective"][emb],
                       rep["effective"]["lm_head.weight"])
    # the effective update is what the stored tensors give, not the
    # float64 request: the BF16 embedding as stored
    stored = model.model.embed_tokens.weight.detach().double() + d[emb]
    assert torch.equal(rep["effective"][emb], stored.to(torch.bfloat16)
                       .double() - model.model.embed_tokens.weight.double())
    ids = torch.randint(0, cfg["vocab_size"], (2, 10),
                        generator=torch.Generator().manual_seed(3))
    want = llm.load_model(folder, dtype=torch.float64)
    sd = want.state_dict()
    for k, v in rep["effective"].items():
        sd[k] = sd[k] + v
    want.load_state_dict(sd)   # tied: one tensor, moved once
    got = llm.load_model(folder, dtype=torch.float64)
    done = peft_rules.load(got, str(tmp_path / "ad"))
    assert sorted(done["saved"]) == ["lm_head", "model.embed_tokens"]
    with torch.no_grad():
        assert torch.allclose(got(ids), want(ids), atol=1e-9)
    rep = llm.save_adapter(tmp_path / "ad2", model, d, 4, is_delta=True)
    assert rep["left_out"] == [emb] and q not in rep["left_out"]
    assert 0 < rep["left_out_norm"] < 1
    with pytest.raises(bico.BicoError, match="no linear"):
        llm.save_adapter(tmp_path / "ad3", model, {emb: d[emb]}, 4,
                        is_delta=True)


def test_formats_recipe_records_rmsnorm_for_bico_transfer(tmp_path):
    """docs/formats.md's calibration-file recipe on a load_model decoder
    records its RMSNorm modules too, so `bico transfer` with those files
    finds model.layers.0.input_layernorm.input (it did not: the recipe
    took nn.LayerNorm only)."""
    import re
    doc = os.path.join(HERE, "..", "..", "docs", "formats.md")
    code = [b for b in re.findall(r"```python\n(.*?)```", open(doc).read(),
                                  re.S) if "def calibration_file" in b][0]
    env = {}
    exec(compile(code, doc, "exec"), env)
    cfg = llama.default_config(vocab_size=48, hidden_size=16,
                               intermediate_size=24)
    for n, seed in (("A", 1), ("A_ft", 2), ("B", 3)):
        sd = llama.random_state(cfg, torch.Generator().manual_seed(seed))
        write(tmp_path / n, cfg, sd, torch.float32)
    ids = torch.randint(0, 48, (64 * 9,),
                        generator=torch.Generator().manual_seed(4))
    cal = llm.text_batches(ids, 8, holdout=0)
    for n in ("A", "B"):
        m = llm.load_model(tmp_path / n)
        env["calibration_file"](m, cal.batches, llm.next_token_loss,
                                str(tmp_path / (n + ".calib.safetensors")))
    got = st.open(str(tmp_path / "B.calib.safetensors"))
    assert "model.layers.0.input_layernorm.input" in got
    r = subprocess.run([BICO, "transfer", "--alpha", "1", "--method", "bico",
                        "--source-base", str(tmp_path / "A"),
                        "--source-tuned", str(tmp_path / "A_ft"),
                        "--target-base", str(tmp_path / "B"),
                        "--source-calib", str(tmp_path / "A.calib.safetensors"),
                        "--target-calib", str(tmp_path / "B.calib.safetensors"),
                        "--output", str(tmp_path / "out") + "/", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
