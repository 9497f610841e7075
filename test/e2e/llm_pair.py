"""Two tiny byte-level decoder folders and a task for the LLM user's path
(python3 -m bico.llm, docs/llm-quickstart.md): a source A (width 16, 2
layers), a LoRA fine-tune of A on the task text written as a PEFT adapter,
and a target B of another width and depth (32, 3 layers, head_dim 4, more
MLP units) that computes A's function up to a small perturbation: A's
residual stream zero-padded (RMSNorm scales divided by sqrt(2) for the
wider mean), extra MLP units and the extra layer writing nothing to the
stream.  Folders are sharded BF16 with a tied head and a byte-level
tokenizer.json.  Independent of libbico (planted.save writes the files)."""
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama  # noqa: E402
import planted  # noqa: E402

V = 256
CFG_A = llama.default_config(model_type="qwen2", vocab_size=V, hidden_size=16,
                             intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             attention_bias=True, tie_word_embeddings=True,
                             max_position_embeddings=256)
CFG_B = llama.default_config(model_type="qwen2", vocab_size=V, hidden_size=32,
                             intermediate_size=48, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2,
                             head_dim=4, attention_bias=True,
                             tie_word_embeddings=True,
                             max_position_embeddings=256)
LORA_MODULES = ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")


def task_text(n_lines=400, seed=0):
    """Lines of a small formal language: 'key=value;' records whose value
    is the key's letters shifted by one, a pattern random models lack."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n_lines):
        k = "".join(chr(97 + int(c)) for c in g.integers(0, 25, 3))
        out.append("%s=%s;" % (k, "".join(chr(ord(c) + 1) for c in k)))
    return "\n".join(out) + "\n"


def byte_ids(text):
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def tokenizer_json():
    sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "quality_llm"))
    import lm  # noqa: E402 (the benchmark's byte-level tokenizer.json)
    return lm.tokenizer_json()


def source(seed=1):
    return llama.random_state(CFG_A, torch.Generator().manual_seed(seed))


def target_of(sa, seed=2, noise=0.02):
    """B's state: A's function in a wider, deeper model, perturbed."""
    g = torch.Generator().manual_seed(seed)
    sb = llama.random_state(CFG_B, g)
    da, fa = CFG_A["hidden_size"], CFG_A["intermediate_size"]
    s2 = math.sqrt(CFG_B["hidden_size"] / da)
    out = {}
    for k, v in sb.items():
        v = v.clone()
        parts = k.split(".")
        layer = int(parts[2]) if parts[1] == "layers" else None
        if layer is not None and layer >= CFG_A["num_hidden_layers"]:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                v.zero_()  # the extra layer writes nothing
            out[k] = v
            continue
        a = sa[k]
        if k == "model.embed_tokens.weight":
            v.zero_()
            v[:, :da] = a
        elif k.endswith("norm.weight"):
            v[:da] = a / s2
        elif k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            v[:, :da] = a
        elif k.endswith("_proj.bias"):
            v[:] = a
        elif k.endswith("o_proj.weight"):
            v.zero_()
            v[:da] = a
        elif k.endswith(("gate_proj.weight", "up_proj.weight")):
            v[:fa, :da] = a
        elif k.endswith("down_proj.weight"):
            v.zero_()
            v[:da, :fa] = a
        else:
            raise KeyError(k)
        out[k] = v
    return {k: v + noise * torch.randn(v.shape, generator=g, dtype=v.dtype)
            * (v.std() if v.numel() > 1 else 1.0) for k, v in out.items()}


def windows(ids, T):
    m = (len(ids) - 1) // T
    return torch.stack([ids[i * T:i * T + T + 1] for i in range(m)])


def train_lora(cfg, sd, ids, r=4, steps=150, lr=3e-2, seed=3, T=32):
    """A PEFT-style LoRA (scale lora_alpha / r = 2) on LORA_MODULES trained
    on the task windows with AdamW; returns {module: (A [r, in], B [out, r])}
    and the scale."""
    g = torch.Generator().manual_seed(seed)
    base = {k: v.double() for k, v in sd.items()}
    fac = {}
    for k, v in base.items():
        mod = k[:-len(".weight")]
        if k.endswith(".weight") and mod.rsplit(".", 1)[-1] in LORA_MODULES:
            fac[mod] = (torch.randn(r, v.shape[1], generator=g,
                                    dtype=torch.float64) / math.sqrt(v.shape[1]),
                        torch.zeros(v.shape[0], r, dtype=torch.float64))
    params = [t.requires_grad_(True) for ab in fac.values() for t in ab]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    w = windows(ids, T)
    scale = 2.0
    for step in range(steps):
        idx = torch.randint(0, len(w), (16,), generator=g)
        b = w[idx]
        cur = dict(base)
        for mod, (A, B) in fac.items():
            cur[mod + ".weight"] = base[mod + ".weight"] + scale * B @ A
        logits = llama.forward(cfg, cur, b[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), b[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {m: (A.detach(), B.detach()) for m, (A, B) in fac.items()}, scale


def merged(sd, fac, scale):
    out = {k: v.double().clone() for k, v in sd.items()}
    for mod, (A, B) in fac.items():
        out[mod + ".weight"] += scale * B @ A
    return out


def loss(cfg, sd, ids, T=32):
    w = windows(ids, T)
    with torch.no_grad():
        logits = llama.forward(cfg, {k: v.double() for k, v in sd.items()},
                               w[:, :-1])
        return float(F.cross_entropy(logits.reshape(-1, V),
                                     w[:, 1:].reshape(-1)))


def write_model(path, cfg, sd, shard_bytes=6000, tokenizer=None):
    """A sharded BF16 Hugging Face folder (tied head: no lm_head.weight),
    with the byte-level tokenizer.json (or the tokenizer.json dict
    given)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(cfg, torch_dtype="bfloat16"), f, indent=2)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tokenizer or tokenizer_json(), f)
    names = [k for k in sd if k != "lm_head.weight"]
    shards, cur, size = [], {}, 0
    for k in names:
        a = sd[k].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if cur and size + a.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = a
        size += a.nbytes
    shards.append(cur)
    index = {"metadata": {}, "weight_map": {}}
    for i, sh in enumerate(shards):
        fn = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        _save_bf16(os.path.join(path, fn), sh)
        for k in sh:
            index["weight_map"][k] = fn
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def _save_bf16(path, tensors):
    import struct
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for k, a in tensors.items():
        data = np.ascontiguousarray(a).astype("<u2").tobytes()
        header[k] = {"dtype": "BF16", "shape": list(a.shape),
                     "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def write_adapter(path, fac, scale, r):
    """PEFT's adapter folder for the LoRA factors (F32)."""
    os.makedirs(path, exist_ok=True)
    t = {}
    for mod, (A, B) in fac.items():
        t["base_model.model.%s.lora_A.weight" % mod] = A.float().numpy()
        t["base_model.model.%s.lora_B.weight" % mod] = B.float().numpy()
    planted.save(os.path.join(path, "adapter_model.safetensors"), t,
                 {"format": "pt"})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
           "lora_alpha": scale * r, "target_modules": list(LORA_MODULES),
           "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
           "use_rslora": False, "use_dora": False, "modules_to_save": None,
           "base_model_name_or_path": "A"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def bf16(sd):
    return {k: v.to(torch.bfloat16).double() for k, v in sd.items()}


def make(folder, seed=0):
    """Writes folder/A, folder/A_adapter, folder/A_ft, folder/B,
    folder/task.txt (calibration) and folder/eval.txt (held-out task text);
    returns a dict of the states (BF16-rounded, float64) and losses."""
    torch.set_num_threads(1)
    text, ev = task_text(400, seed), task_text(100, seed + 100)
    sa = bf16(source(seed + 1))
    sb = bf16(target_of(sa, seed + 2))
    fac, scale = train_lora(CFG_A, sa, byte_ids(text), seed=seed + 3)
    sft = bf16(merged(sa, fac, scale))
    write_model(os.path.join(folder, "A"), CFG_A, sa)
    write_model(os.path.join(folder, "A_ft"), CFG_A, sft)
    write_model(os.path.join(folder, "B"), CFG_B, sb)
    write_adapter(os.path.join(folder, "A_adapter"), fac, scale, 4)
    with open(os.path.join(folder, "task.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(folder, "eval.txt"), "w") as f:
        f.write(ev)
    eids = byte_ids(ev)
    return dict(sa=sa, sb=sb, sft=sft, fac=fac, scale=scale,
                loss_a=loss(CFG_A, sa, eids), loss_ft=loss(CFG_A, sft, eids),
                loss_b=loss(CFG_B, sb, eids))


def train_full(cfg, sd, ids, steps=150, lr=3e-3, seed=4, T=32):
    """A full fine-tune (every tensor, norms and the tied embedding
    included) on the task windows with AdamW."""
    g = torch.Generator().manual_seed(seed)
    cur = {k: v.double().clone().requires_grad_(True) for k, v in sd.items()}
    opt = torch.optim.AdamW(list(cur.values()), lr=lr, weight_decay=0.0)
    w = windows(ids, T)
    for step in range(steps):
        b = w[torch.randint(0, len(w), (16,), generator=g)]
        logits = llama.forward(cfg, cur, b[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), b[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in cur.items()}


def grown_target(folder, info, extra=8):
    """folder/B_grown: B with a vocabulary that grew past the source's, as
    Mistral's 32 000 -> 32 768: the byte-level tokenizer plus `extra`
    added tokens (ids 256 ...), and extra random embedding rows; on the
    shared ids it computes B's function exactly."""
    cfg = dict(CFG_B, vocab_size=V + extra)
    sd = dict(info["sb"])
    g = torch.Generator().manual_seed(11)
    emb = sd["model.embed_tokens.weight"]
    sd["model.embed_tokens.weight"] = torch.cat(
        [emb, 0.1 * torch.randn(extra, emb.shape[1], generator=g,
                                dtype=emb.dtype)])
    tok = tokenizer_json()
    tok["added_tokens"] = [{"id": V + k, "content": "<|extra_%d|>" % k,
                            "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False,
                            "special": True} for k in range(extra)]
    write_model(os.path.join(folder, "B_grown"), cfg, bf16(sd), tokenizer=tok)
    return cfg


def bpe_target(folder, merges=64, seed=12):
    """folder/B_bpe: a target with a byte-level BPE tokenizer of its own
    (trained on other text than the task's: general English-like words)
    of 256 + `merges` tokens, its weights random (B's shape): the
    tokenizers differ, the task text tokenizes to other ids."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))
    from bico.llm.bpe import train
    g = np.random.default_rng(seed)
    words = ["the", "of", "and", "to", "in", "key", "value", "record",
             "line", "shift", "letter", "model", "text", "data"]
    general = " ".join(words[int(i)] for i in g.integers(0, len(words), 4000))
    tok = train(general + "\n" + task_text(50, seed), V + merges)
    cfg = dict(CFG_B, vocab_size=len(tok))
    sd = llama.random_state(cfg, torch.Generator().manual_seed(seed))
    sd.pop("lm_head.weight", None)
    write_model(os.path.join(folder, "B_bpe"), cfg, bf16(sd),
                tokenizer=tok.spec())
    return tok
