"""`bico transfer` onto a causal language model needs --alpha (issue 23):
on decoder LMs the whole update (alpha 1) left the target worse than
untouched in most real cells of docs/llm.md, and the command runs no model
to choose alpha on text.  Without --alpha the command refuses (usage error,
nothing written) and says where alpha is chosen on held-out text; with
--alpha (command line or --config) it runs at that alpha; a target that is
not a causal LM keeps the default alpha 1."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402
import planted as pl  # noqa: E402

BUILD = os.environ.get("BICO_BUILD", os.path.join(HERE, "..", "..", "build"))
BICO = os.path.join(BUILD, "bin", "bico")


def bico(*args):
    return subprocess.run([BICO] + [str(a) for a in args], capture_output=True,
                          text=True)


def folders(tmp, cfg):
    """A, A + tau and B (B = A here: naive addition is then exact)."""
    g = torch.Generator().manual_seed(3)
    A = llama.random_state(cfg, g)
    tau = {k: 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)
           for k, v in A.items()}
    llama.write_folder(tmp / "A", cfg, A)
    llama.write_folder(tmp / "Aft", cfg, {k: A[k] + tau[k] for k in A})
    llama.write_folder(tmp / "B", cfg, A)
    return A, tau


def naive(tmp, *extra):
    return bico("transfer", "--method", "naive", "--quiet",
                "--source-base", tmp / "A", "--source-tuned", tmp / "Aft",
                "--target-base", tmp / "B", "--output", tmp / "out", *extra)


@pytest.mark.parametrize("kw, why", [
    (dict(), 'architectures "LlamaForCausalLM"'),
    (dict(architectures=[]), 'model_type "llama"'),
    (dict(model_type="mylm", architectures=["BertModel", "MyLMForCausalLM"]),
     'architectures "MyLMForCausalLM"'),
    (dict(model_type="mylm", architectures=["GPT2LMHeadModel"]),
     'architectures "GPT2LMHeadModel"'),
])
def test_causal_lm_target_without_alpha_is_refused(tmp_path, kw, why):
    cfg = llama.default_config(**kw)
    folders(tmp_path, cfg)
    r = naive(tmp_path)
    assert r.returncode == 2, r.stderr
    err = r.stderr
    # names the target's file, what made it a causal LM, the option and
    # where alpha is chosen on text
    assert str(tmp_path / "B" / "config.json") in err, err
    assert "causal language model" in err and "--alpha" in err, err
    assert "bico.llm" in err and "transfer_model" in err, err
    assert why in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["flag", "config"])
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_causal_lm_target_with_alpha_runs_at_that_alpha(tmp_path, how, alpha):
    cfg = llama.default_config()
    A, tau = folders(tmp_path, cfg)
    if how == "flag":
        r = naive(tmp_path, "--alpha", alpha)
    else:
        (tmp_path / "t.yaml").write_text("alpha: %g\n" % alpha)
        r = naive(tmp_path, "--config", tmp_path / "t.yaml")
    assert r.returncode == 0, r.stderr
    got, _, _ = pl.load(str(tmp_path / "out" / "model.safetensors"))
    for k in A:
        want = (A[k] + alpha * tau[k]).numpy()
        assert np.abs(got[k] - want).max() < 1e-5, k


@pytest.mark.parametrize("config", [None, dict(
    model_type="vit", architectures=["ViTForImageClassification"])])
def test_other_targets_keep_alpha_1(tmp_path, config):
    """A target that is not a causal LM by its config.json (none, or an
    image classifier) runs without --alpha, at alpha 1."""
    cfg = llama.default_config()
    A, tau = folders(tmp_path, cfg)
    for d in ("A", "Aft", "B"):
        p = tmp_path / d / "config.json"
        if config is None:
            os.remove(p)
        else:
            p.write_text(json.dumps(dict(cfg, **config)))
    r = naive(tmp_path)
    assert r.returncode == 0, r.stderr
    got, _, _ = pl.load(str(tmp_path / "out" / "model.safetensors"))
    for k in A:
        assert np.abs(got[k] - (A[k] + tau[k]).numpy()).max() < 1e-5, k


def test_onto_its_own_base_keeps_alpha_1(tmp_path):
    """The source base itself as the target (merging that model's own
    fine-tune or adapter, docs/llm-quickstart.md): nothing is carried
    between models, so no --alpha is needed and the result is A_ft."""
    cfg = llama.default_config()
    A, tau = folders(tmp_path, cfg)
    r = bico("transfer", "--method", "naive", "--quiet",
             "--source-base", tmp_path / "A", "--source-tuned", tmp_path / "Aft",
             "--target-base", str(tmp_path / "A") + "/", "--output", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    got, _, _ = pl.load(str(tmp_path / "out" / "model.safetensors"))
    for k in A:
        assert np.abs(got[k] - (A[k] + tau[k]).numpy()).max() < 1e-5, k
