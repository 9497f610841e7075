"""Synthetic Qwen2-shaped checkpoints for bench/llm_scale.py, written
tensor by tensor (never a whole model in memory): random bf16 weights with
Hugging Face Qwen2 names and config.json in model folders, a tuned copy (a
full task vector), a PEFT LoRA adapter (rank r on q, k, v, o, gate, up,
down), and calibration files (random rows, `M.input` / `M.output_grad`,
docs/formats.md) for every module the driver solves maps for."""
import json
import os
import struct
import zlib

import numpy as np
import torch

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")

SIZES = {
    # 0.5B-shaped source and 1.5B-shaped target (Qwen2-0.5B / -1.5B shapes).
    "full": dict(src=dict(d=896, L=24, f=4864, H=14, KV=2, hd=64, V=151936),
                 tgt=dict(d=1536, L=28, f=8960, H=12, KV=2, hd=128, V=151936),
                 rows=2048),
    # Full widths and vocabulary at one layer on each side: a per-layer
    # time and the embedding's memory, when the full depth is out of reach.
    "layer": dict(src=dict(d=896, L=1, f=4864, H=14, KV=2, hd=64, V=151936),
                  tgt=dict(d=1536, L=1, f=8960, H=12, KV=2, hd=128, V=151936),
                  rows=2048),
    # The same structure scaled down for development (thin solves still
    # apply to the MLP maps: rows < f).
    "quick": dict(src=dict(d=128, L=4, f=512, H=4, KV=2, hd=32, V=4096),
                  tgt=dict(d=192, L=5, f=768, H=3, KV=1, hd=64, V=4096),
                  rows=256),
}


def config(s):
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "hidden_size": s["d"], "intermediate_size": s["f"],
            "num_hidden_layers": s["L"], "num_attention_heads": s["H"],
            "num_key_value_heads": s["KV"], "head_dim": s["hd"],
            "vocab_size": s["V"], "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "tie_word_embeddings": not s.get("untied"),
            "torch_dtype": "bfloat16",
            "max_position_embeddings": 4096, "hidden_act": "silu"}


def proj_dims(s, p):
    """(d_out, d_in) of projection p."""
    d, f, H, KV, hd = s["d"], s["f"], s["H"], s["KV"], s["hd"]
    return {"self_attn.q_proj": (H * hd, d), "self_attn.k_proj": (KV * hd, d),
            "self_attn.v_proj": (KV * hd, d), "self_attn.o_proj": (d, H * hd),
            "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
            "mlp.down_proj": (d, f)}[p]


def shapes(s):
    out = {"model.embed_tokens.weight": (s["V"], s["d"])}
    for i in range(s["L"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (s["d"],)
        for q in PROJ:
            out[p + q + ".weight"] = proj_dims(s, q)
            if q in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                out[p + q + ".bias"] = (proj_dims(s, q)[0],)  # Qwen2: q/k/v biases
            if q == "self_attn.o_proj":
                out[p + "post_attention_layernorm.weight"] = (s["d"],)
    out["model.norm.weight"] = (s["d"],)
    if s.get("untied"):     # a head of its own (Llama-3's layout)
        out["lm_head.weight"] = (s["V"], s["d"])
    return out


def gen(name, salt):
    return torch.Generator().manual_seed(zlib.crc32(f"{salt}:{name}".encode()))


def weight(name, shape, salt):
    g = gen(name, salt)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if len(shape) == 1:
        return 0.02 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / float(np.sqrt(shape[-1]))


def bf16_bytes(t):
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()


def write_st(path, specs, make, metadata=None, dtype="BF16"):
    """A safetensors file of BF16 (or F32) tensors `specs` [(name, shape)],
    each made by make(name, shape) -> float tensor when its turn comes."""
    header, off = {}, 0
    esize = 2 if dtype == "BF16" else 4
    for name, shape in specs:
        n = esize * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = metadata or {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name, shape in specs:
            t = make(name, shape)
            b = bf16_bytes(t) if dtype == "BF16" else \
                t.to(torch.float32).contiguous().numpy().tobytes()
            assert len(b) == header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            f.write(b)
    os.replace(tmp, path)
    return off + 8 + len(h)


def folder(path, s, make):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config(s), f, indent=2)
    return write_st(os.path.join(path, "model.safetensors"), list(shapes(s).items()), make)


def calib_specs(s, rows):
    specs = []
    for i in range(s["L"]):
        p = f"model.layers.{i}."
        for nm in NORMS:
            specs.append((p + nm + ".input", (rows, s["d"])))
        for q in PROJ:
            dout, din = proj_dims(s, q)
            specs.append((p + q + ".input", (rows, din)))
            specs.append((p + q + ".output_grad", (rows, dout)))
    specs.append(("model.norm.input", (rows, s["d"])))
    return sorted(specs)


def generate(work, size, rank=16):
    """Writes A/, A_ft/, B/ (model folders), lora/ (PEFT adapter) and
    calA/calB.safetensors under work; returns their sizes in bytes."""
    cfg = SIZES[size]
    src, tgt, rows = cfg["src"], cfg["tgt"], cfg["rows"]
    sizes = {}
    sizes["A"] = folder(os.path.join(work, "A"), src, lambda n, sh: weight(n, sh, "A"))
    sizes["A_ft"] = folder(os.path.join(work, "A_ft"), src,
                           lambda n, sh: weight(n, sh, "A") + 0.01 * weight(n, sh, "tau"))
    sizes["B"] = folder(os.path.join(work, "B"), tgt, lambda n, sh: weight(n, sh, "B"))
    # The LoRA adapter (PEFT names; B nonzero, as after training).
    lspecs = []
    for i in range(src["L"]):
        for q in PROJ:
            dout, din = proj_dims(src, q)
            base = f"base_model.model.model.layers.{i}.{q}"
            lspecs.append((base + ".lora_A.weight", (rank, din)))
            lspecs.append((base + ".lora_B.weight", (dout, rank)))
    ld = os.path.join(work, "lora")
    os.makedirs(ld, exist_ok=True)
    sizes["lora"] = write_st(os.path.join(ld, "adapter_model.safetensors"), sorted(lspecs),
                             lambda n, sh: torch.randn(sh, generator=gen(n, "lora")) / float(np.sqrt(sh[-1])))
    with open(os.path.join(ld, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [q.split(".")[1] for q in PROJ], "lora_dropout": 0.0,
                   "bias": "none", "fan_in_fan_out": False, "task_type": "CAUSAL_LM",
                   "base_model_name_or_path": "A"}, f, indent=2)
    calib = lambda n, sh: torch.randn(sh, generator=gen(n, "calib"))
    sizes["calA"] = write_st(os.path.join(work, "calA.safetensors"), calib_specs(src, rows), calib)
    sizes["calB"] = write_st(os.path.join(work, "calB.safetensors"), calib_specs(tgt, rows),
                             lambda n, sh: torch.randn(sh, generator=gen(n, "calibB")))
    return sizes
