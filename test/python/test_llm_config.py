"""bico.llm.load_model on hostile config.json files (issue 32): a table
of edits to a valid llama folder's config.json, each refused at load with
a BicoError naming config.json and the key (never a raw KeyError,
TypeError, AttributeError or MemoryError, never a 4 TB allocation), and
a table of unusual but valid configs, each loaded and run: its logits on
a few tokens are finite and equal those of test/e2e/llama.py's
independent forward where that forward knows the config."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import bico
import bico.safetensors as st
import bico.llm as bl

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402

torch.set_num_threads(1)


def folder(tmp, cfg, raw=None, drop_head=None):
    """A single-file F32 folder of cfg's random tensors, with config.json
    raw (default cfg itself)."""
    sd = llama.random_state(cfg, torch.Generator().manual_seed(1))
    if drop_head or (drop_head is None and cfg.get("tie_word_embeddings")):
        sd.pop("lm_head.weight", None)
    os.makedirs(tmp, exist_ok=True)
    st.write(os.path.join(str(tmp), "model.safetensors"),
             {k: v.float().numpy() for k, v in sd.items()})
    with open(os.path.join(str(tmp), "config.json"), "w") as f:
        if isinstance(raw, str):
            f.write(raw)
        else:
            json.dump(cfg if raw is None else raw, f)
    return sd


def edited(**kw):
    """An edit: keys set (None: removed)."""
    def f(c):
        for k, v in kw.items():
            if v is None:
                c.pop(k, None)
            else:
                c[k] = v
        return c
    return f


L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# (case, base config edits before the tensors are drawn, config.json edit,
# the key the message names)
HOSTILE = [
    ("hidden_size missing", {}, edited(hidden_size=None), "hidden_size"),
    ("heads missing", {}, edited(num_attention_heads=None),
     "num_attention_heads"),
    ("layers missing", {}, edited(num_hidden_layers=None),
     "num_hidden_layers"),
    ("hidden_size a string", {}, edited(hidden_size="32"), "hidden_size"),
    ("hidden_size 32.0", {}, edited(hidden_size=32.0), "hidden_size"),
    ("hidden_size true", {}, edited(hidden_size=True), "hidden_size"),
    ("hidden_size disagrees with the embedding", {}, edited(hidden_size=48),
     "hidden_size"),
    ("heads true", {}, edited(num_attention_heads=True),
     "num_attention_heads"),
    ("heads 4.0", {}, edited(num_attention_heads=4.0), "num_attention_heads"),
    ("heads 0", {}, edited(num_attention_heads=0), "num_attention_heads"),
    ("heads -4", {}, edited(num_attention_heads=-4), "num_attention_heads"),
    ("heads do not divide hidden_size", {"num_key_value_heads": 1},
     edited(num_attention_heads=5, head_dim=None), "num_attention_heads"),
    ("key/value heads 0", {}, edited(num_key_value_heads=0),
     "num_key_value_heads"),
    ("key/value heads do not divide heads", {}, edited(num_key_value_heads=3),
     "num_key_value_heads"),
    ("key/value heads above heads", {}, edited(num_key_value_heads=8),
     "num_key_value_heads"),
    ("key/value heads a string", {}, edited(num_key_value_heads="2"),
     "num_key_value_heads"),
    ("key/value heads disagree with k_proj", {},
     edited(num_key_value_heads=4, head_dim=None), "num_key_value_heads"),
    ("head_dim 1e12 (a float)", {}, edited(head_dim=1e12), "head_dim"),
    ("head_dim 10^12 (4 TB of frequencies)", {}, edited(head_dim=10 ** 12),
     "head_dim"),
    ("head_dim disagrees with the tensors", {}, edited(head_dim=16),
     "head_dim"),
    ("head_dim odd", {"head_dim": 6, "num_key_value_heads": 4},
     edited(head_dim=7), "head_dim"),
    ("head_dim -8", {}, edited(head_dim=-8), "head_dim"),
    ("layers 0", {}, edited(num_hidden_layers=0), "num_hidden_layers"),
    ("layers above the tensors", {}, edited(num_hidden_layers=3),
     "num_hidden_layers"),
    ("layers below the tensors", {}, edited(num_hidden_layers=1),
     "num_hidden_layers"),
    ("layers 2.5", {}, edited(num_hidden_layers=2.5), "num_hidden_layers"),
    ("rope_theta 0", {}, edited(rope_theta=0), "rope_theta"),
    ("rope_theta -10000", {}, edited(rope_theta=-10000.0), "rope_theta"),
    ("rope_theta a string", {}, edited(rope_theta="10000"), "rope_theta"),
    ("rope_theta NaN", {}, edited(rope_theta=float("nan")), "rope_theta"),
    ("rope_theta Infinity", {}, edited(rope_theta=float("inf")),
     "rope_theta"),
    ("rms_norm_eps negative", {}, edited(rms_norm_eps=-1e-6),
     "rms_norm_eps"),
    ("rms_norm_eps 0", {}, edited(rms_norm_eps=0), "rms_norm_eps"),
    ("rms_norm_eps a string", {}, edited(rms_norm_eps="1e-6"),
     "rms_norm_eps"),
    ("rope_scaling a list", {}, edited(rope_scaling=[]), "rope_scaling"),
    ("rope_scaling a string", {}, edited(rope_scaling="linear"),
     "rope_scaling"),
    ("rope factor missing", {}, edited(rope_scaling={"type": "linear"}),
     "rope_scaling.factor"),
    ("rope factor 0", {}, edited(rope_scaling={"type": "linear",
                                               "factor": 0}),
     "rope_scaling.factor"),
    ("rope factor -2", {}, edited(rope_scaling={"rope_type": "linear",
                                                "factor": -2.0}),
     "rope_scaling.factor"),
    ("rope factor a string", {}, edited(rope_scaling={"type": "linear",
                                                      "factor": "2"}),
     "rope_scaling.factor"),
    ("rope type unknown", {}, edited(rope_scaling={"rope_type": "yarn",
                                                   "factor": 2.0}),
     "rope_scaling.rope_type"),
    ("rope type a number", {}, edited(rope_scaling={"rope_type": 3}),
     "rope_scaling.rope_type"),
    ("llama3 high equal to low", {},
     edited(rope_scaling=dict(L3, high_freq_factor=1.0)),
     "rope_scaling.high_freq_factor"),
    ("llama3 low factor 0", {},
     edited(rope_scaling=dict(L3, low_freq_factor=0)),
     "rope_scaling.low_freq_factor"),
    ("llama3 original positions missing", {},
     edited(rope_scaling={k: v for k, v in L3.items()
                          if k != "original_max_position_embeddings"}),
     "rope_scaling.original_max_position_embeddings"),
    ("vocab_size disagrees with the embedding", {}, edited(vocab_size=100),
     "vocab_size"),
    ("vocab_size 0", {}, edited(vocab_size=0), "vocab_size"),
    ("intermediate_size disagrees with the MLP", {},
     edited(intermediate_size=40), "intermediate_size"),
    ("intermediate_size -1", {}, edited(intermediate_size=-1),
     "intermediate_size"),
    ("tie_word_embeddings a string", {}, edited(tie_word_embeddings="yes"),
     "tie_word_embeddings"),
    ("untied without lm_head.weight", {},
     edited(tie_word_embeddings=False), "tie_word_embeddings"),
    ("hidden_act unknown", {}, edited(hidden_act="relu2"), "hidden_act"),
    ("hidden_act a number", {}, edited(hidden_act=3), "hidden_act"),
    ("sliding_window negative", {"model_type": "mistral"},
     edited(sliding_window=-4), "sliding_window"),
    ("sliding_window 0", {"model_type": "mistral"},
     edited(sliding_window=0), "sliding_window"),
    ("sliding_window a string", {"model_type": "mistral"},
     edited(sliding_window="4096"), "sliding_window"),
    ("use_sliding_window a string", {"model_type": "qwen2"},
     edited(use_sliding_window="yes", sliding_window=4),
     "use_sliding_window"),
    ("max_position_embeddings 0", {}, edited(max_position_embeddings=0),
     "max_position_embeddings"),
    ("max_position_embeddings true", {},
     edited(max_position_embeddings=True), "max_position_embeddings"),
    ("a list, not an object", {}, lambda c: [c], None),
    ("null", {}, lambda c: "null", None),
    ("a number", {}, lambda c: 7, None),
]


@pytest.mark.parametrize("case,base,edit,key", HOSTILE,
                         ids=[c[0] for c in HOSTILE])
def test_hostile_config_is_refused_naming_file_and_key(tmp_path, case, base,
                                                       edit, key):
    cfg = llama.default_config(**base)
    raw = edit(json.loads(json.dumps(cfg)))
    folder(tmp_path / "m", cfg, raw)
    path = str(tmp_path / "m" / "config.json")
    with pytest.raises(bico.BicoError) as e:
        bl.load_model(tmp_path / "m")
    msg = str(e.value)
    assert path in msg, msg
    if key is not None:
        assert key in msg, msg


def test_the_table_counts_the_issues_cases():
    assert len(HOSTILE) >= 38


def test_config_that_is_not_json(tmp_path):
    folder(tmp_path / "m", llama.default_config(), raw="{\"hidden_size\": ")
    with pytest.raises(bico.BicoError, match="config.json"):
        bl.load_model(tmp_path / "m")


def test_a_4_tb_head_dim_allocates_nothing(tmp_path):
    """head_dim 10^12 used to size the rotary frequencies (4 TB): under an
    address-space limit of 6 GiB the refusal comes before any
    allocation.  Under AddressSanitizer (make check-python-asan) the
    runtime reserves terabytes of shadow address space at start, so no
    such limit can hold there: the refusal alone is checked."""
    cfg = llama.default_config()
    folder(tmp_path / "m", cfg, dict(cfg, head_dim=10 ** 12))
    limit = ("" if "asan" in os.environ.get("LD_PRELOAD", "") else
             "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n")
    code = ("import resource, sys, bico, bico.llm as bl\n" + limit +
            "try:\n    bl.load_model(sys.argv[1])\n"
            "except bico.BicoError as e:\n    print(e); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "head_dim" in r.stdout, r.stderr[-2000:]


# (case, config of the tensors, config.json written (None: the same))
ACCEPTED = [
    ("key/value heads null", dict(num_key_value_heads=4),
     lambda c: dict(c, num_key_value_heads=None)),
    ("head_dim absent", {}, lambda c: {k: v for k, v in c.items()
                                       if k != "head_dim"}),
    ("one key/value head", dict(num_key_value_heads=1), None),
    ("rope_scaling null", dict(rope_scaling=None), None),
    ("rope type default", {}, lambda c: dict(c, rope_scaling={
        "rope_type": "default"})),
    ("linear rope factor 0.5", {}, lambda c: dict(c, rope_scaling={
        "type": "linear", "factor": 0.5})),
    ("linear rope factor 8", {}, lambda c: dict(c, rope_scaling={
        "type": "linear", "factor": 8})),
    ("llama3 rope", {}, lambda c: dict(c, rope_scaling=L3)),
    ("rope_theta 1", dict(rope_theta=1.0), None),
    ("rope_theta an integer 10^12", dict(rope_theta=10 ** 12), None),
    ("rms_norm_eps 1e-12", dict(rms_norm_eps=1e-12), None),
    ("rms_norm_eps 1", dict(rms_norm_eps=1.0), None),
    ("vocab_size absent", {}, lambda c: {k: v for k, v in c.items()
                                         if k != "vocab_size"}),
    ("intermediate_size absent", {}, lambda c: {
        k: v for k, v in c.items() if k != "intermediate_size"}),
    ("max_position_embeddings absent", {}, lambda c: {
        k: v for k, v in c.items() if k != "max_position_embeddings"}),
    ("tie_word_embeddings absent, no head", {}, lambda c: {
        k: v for k, v in c.items() if k != "tie_word_embeddings"}),
    ("untied head", dict(tie_word_embeddings=False), None),
    ("mistral without a window", dict(model_type="mistral",
                                      sliding_window=None), None),
    ("mistral window 1", dict(model_type="mistral", sliding_window=1), None),
    ("mistral window 10^9", dict(model_type="mistral",
                                 sliding_window=10 ** 9), None),
    ("qwen2 unused window -1", dict(model_type="qwen2",
                                    use_sliding_window=False,
                                    sliding_window=-1), None),
    ("gemma gelu", dict(model_type="gemma", head_dim=8,
                        hidden_activation="gelu"), None),
    ("unknown extra keys", {}, lambda c: dict(c, foo={"bar": [1, 2]},
                                              torch_dtype="float32")),
]


@pytest.mark.parametrize("case,base,edit", ACCEPTED,
                         ids=[c[0] for c in ACCEPTED])
def test_accepted_edge_case_runs_finite(tmp_path, case, base, edit):
    cfg = llama.default_config(**base)
    raw = edit(dict(cfg)) if edit else cfg
    sd = folder(tmp_path / "m", cfg, raw)
    m = bl.load_model(tmp_path / "m", dtype=torch.float64)
    ids = torch.randint(0, cfg["vocab_size"], (2, 12),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = m(ids)
    assert got.shape == (2, 12, cfg["vocab_size"])
    assert torch.isfinite(got).all()
    plain = cfg["model_type"] in ("llama", "qwen2", "gemma") and \
        not (raw.get("rope_scaling") or {}).get("factor")
    if plain:   # llama.py's forward knows these: the same logits
        if "lm_head.weight" not in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        want = llama.forward(cfg, {k: v.float().double()
                                   for k, v in sd.items()}, ids)
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)


def test_linear_rope_factor_is_positions_divided():
    """The linear rope factor scales every frequency by 1 / factor (a
    planted check of the checked path, not only its finiteness)."""
    from bico.llm.families import _inv_freq
    base = _inv_freq({"hd": 8, "theta": 10000.0, "rope_scaling": None})
    lin = _inv_freq({"hd": 8, "theta": 10000.0, "rope_scaling": {
        "rope_type": "linear", "factor": 4.0}})
    assert torch.allclose(lin * 4.0, base)
    assert math.isclose(float(base[0]), 1.0)
