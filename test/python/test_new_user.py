"""What a new user of `bico` met (issue 33), each a test: `bico inspect`
and `bico transfer` name one family for a Qwen2 folder; the structure-aware
fallback is said once per layer; `--lora` given the adapter's file says to
give its folder; swapped calibration files are named as such; an output
adapter's base_model_name_or_path is the target's absolute path, however
it was typed."""
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402
import planted as pl  # noqa: E402
from cli import BICO, bico  # noqa: E402
from test_bridge import write_adapter  # noqa: E402


def folders(t, kb=None, seed=5):
    """Decoder folders A and B (B's config: default plus kb) with
    calibration files and an adapter of A."""
    ca = llama.default_config(model_type="qwen2", attention_bias=True,
                              architectures=["Qwen2ForCausalLM"])
    cb = llama.default_config(model_type="qwen2", attention_bias=True,
                              architectures=["Qwen2ForCausalLM"],
                              **(kb or {}))
    g = torch.Generator().manual_seed(seed)
    A, B = llama.random_state(ca, g), llama.random_state(cb, g)
    ids = torch.randint(0, ca["vocab_size"], (4, 8), generator=g)
    z = torch.randn(4, 8, ca["vocab_size"], generator=g, dtype=torch.float64)
    llama.write_folder(t / "A", ca, A)
    llama.write_folder(t / "B", cb, B)
    pl.save(str(t / "calA.safetensors"), llama.calibrate(ca, A, ids, z))
    pl.save(str(t / "calB.safetensors"), llama.calibrate(cb, B, ids, z))
    write_adapter(t / "ad", ca, A, g)


def test_inspect_and_transfer_name_one_family(tmp_path):
    folders(tmp_path)
    r = bico("inspect", "--json", tmp_path / "A", tmp_path / "B")
    j = json.loads(r.stdout)
    for side in ("source", "target"):
        assert j[side]["family"] == "qwen2", j[side]
        assert 'model_type "qwen2"' in j[side]["family_from"]
    r = bico("inspect", tmp_path / "A", tmp_path / "B")
    assert "family: qwen2" in r.stdout and "family: none" not in r.stdout
    # the run takes the same family: its structure-aware maps are on
    r = bico("transfer", "--method", "bico", "--structure", "heads",
             "--alpha", "1", "--source-base", tmp_path / "A", "--target-base",
             tmp_path / "B", "--source-calib", tmp_path / "calA.safetensors",
             "--target-calib", tmp_path / "calB.safetensors", "--lora",
             tmp_path / "ad", "--output-lora", tmp_path / "out")
    assert "structure-aware maps" in r.stderr, r.stderr


def test_structure_fallback_is_said_once_per_layer(tmp_path):
    # other head widths: every attention layer falls back to free-form maps
    folders(tmp_path, dict(hidden_size=48, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=3))
    r = bico("transfer", "--method", "bico", "--structure", "heads",
             "--alpha", "1", "--source-base", tmp_path / "A", "--target-base",
             tmp_path / "B", "--source-calib", tmp_path / "calA.safetensors",
             "--target-calib", tmp_path / "calB.safetensors", "--lora",
             tmp_path / "ad", "--output-lora", tmp_path / "out")
    lines = [ln for ln in r.stderr.splitlines() if "free-form attention" in ln]
    layers = ["model.layers.%d." % i for i in range(3)]
    for layer in layers:
        said = [ln for ln in lines if layer in ln]
        assert len(said) == 1, (layer, said)


def test_lora_given_the_adapter_file_names_its_folder(tmp_path):
    folders(tmp_path)
    base = ["transfer", "--method", "bico", "--alpha", "1",
            "--source-base", tmp_path / "A", "--target-base", tmp_path / "B",
            "--source-calib", tmp_path / "calA.safetensors",
            "--target-calib", tmp_path / "calB.safetensors",
            "--output-lora", tmp_path / "out"]
    f = tmp_path / "ad" / "adapter_model.safetensors"
    r = bico(*base, "--lora", f, ok=False)
    assert r.returncode == 1
    assert "--lora %s is a file of an adapter: give its folder, %s" % (
        f, tmp_path / "ad") in r.stderr, r.stderr
    r = bico(*base, "--lora", tmp_path / "calA.safetensors", ok=False)
    assert r.returncode == 1
    assert "not an adapter folder" in r.stderr and \
        "adapter_config.json" in r.stderr, r.stderr
    assert "Not a directory" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_swapped_calibration_files_are_named(tmp_path):
    folders(tmp_path, dict(hidden_size=48, num_attention_heads=4,
                           num_key_value_heads=2))
    r = bico("transfer", "--method", "bico", "--alpha", "1",
             "--source-base", tmp_path / "A", "--target-base", tmp_path / "B",
             "--source-calib", tmp_path / "calB.safetensors",
             "--target-calib", tmp_path / "calA.safetensors",
             "--lora", tmp_path / "ad", "--output-lora", tmp_path / "out",
             ok=False)
    assert r.returncode == 1
    assert "look swapped" in r.stderr, r.stderr
    assert "--source-calib %s" % (tmp_path / "calB.safetensors") in r.stderr
    # the right way round: no such word
    r = bico("transfer", "--method", "bico", "--alpha", "1",
             "--source-base", tmp_path / "A", "--target-base", tmp_path / "B",
             "--source-calib", tmp_path / "calA.safetensors",
             "--target-calib", tmp_path / "calB.safetensors",
             "--lora", tmp_path / "ad", "--output-lora", tmp_path / "out")
    assert "look swapped" not in r.stderr
    # a statistics file made from swapped calibration files: its tensors
    # are [target, source], and the message says what that means
    bico("stats", "--source-calib", tmp_path / "calB.safetensors",
         "--target-calib", tmp_path / "calA.safetensors",
         "--output", tmp_path / "swapped.stats.safetensors")
    r = bico("transfer", "--method", "bico", "--alpha", "1",
             "--source-base", tmp_path / "A", "--target-base", tmp_path / "B",
             "--stats", tmp_path / "swapped.stats.safetensors",
             "--lora", tmp_path / "ad", "--output-lora", tmp_path / "out2",
             ok=False)
    assert r.returncode == 1
    assert "wrong way round" in r.stderr, r.stderr
    assert not (tmp_path / "out2").exists()


def test_output_adapter_names_the_target_by_its_absolute_path(tmp_path):
    import subprocess
    folders(tmp_path)
    r = subprocess.run([BICO, "transfer", "--method", "bico", "--alpha", "1",
                        "--source-base", "A", "--target-base", "./B/",
                        "--source-calib", "calA.safetensors",
                        "--target-calib", "calB.safetensors",
                        "--lora", "ad", "--output-lora", "out", "-q"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == os.path.realpath(tmp_path / "B")
    # the source adapter's own value named the source
    src = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert src["base_model_name_or_path"] == "A"
    # and its factors are float32, PEFT's convention, whatever B's dtype
    from test_bridge import header
    h, _ = header(tmp_path / "out" / "adapter_model.safetensors")
    assert {e["dtype"] for k, e in h.items() if k != "__metadata__"} == {"F32"}
