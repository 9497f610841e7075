"""Small Llama-style byte-level language models on real English text from
Debian, for the LLM quality benchmark (run.py, docs/llm.md).

Text (both shipped by every Debian system, no download):
- general prose: the release notes and READMEs under /usr/share/doc
  (NEWS*, README*, gzipped or plain; Debian's `copyright` files are left
  out, they are license text);
- the task domain: the license texts of /usr/share/common-licenses
  (base-files), deduplicated by content.  Legal English has its own
  vocabulary and phrasing, so a fine-tune on it has a clear gain to carry.
Text is split in 1 KiB blocks, every 8th block held out.

Tokenizer: bytes (vocabulary 256), saved as a Hugging Face tokenizer.json
(ByteLevel pre-tokenizer and decoder, a BPE model with the 256 byte symbols
and no merges).

Model: an nn.Module whose parameter names are Hugging Face Llama's
(model.embed_tokens, model.layers.i.self_attn.q_proj, ..., tied lm_head),
computing exactly test/e2e/llama.py's forward (checked by check_forward),
so that bico.torch can hook its nn.Linear / RMSNorm modules and llama.py
writes its folders.  Training: AdamW, one CPU thread.
"""
import glob
import gzip
import hashlib
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "test", "e2e"))
import llama  # noqa: E402

CODE_VERSION = 1
BLOCK = 1024
HOLD_EVERY = 8
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj",
                "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------- text

def _read(path):
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rb") as f:
        return f.read()


def _clean(raw):
    """ASCII English only: a file with many non-ASCII bytes is skipped
    (None); form feeds and tabs become spaces."""
    if not raw:
        return None
    bad = sum(1 for b in raw if b > 126 or (b < 32 and b not in (9, 10, 12)))
    if bad > len(raw) // 200:
        return None
    return bytes(32 if b in (9, 12) else b for b in raw if b <= 126)


def general_files():
    pats = ["/usr/share/doc/*/NEWS*", "/usr/share/doc/*/README*"]
    out = sorted(set(p for pat in pats for p in glob.glob(pat)
                     if os.path.isfile(p)))
    return out


def task_files():
    return sorted(p for p in glob.glob("/usr/share/common-licenses/*")
                  if os.path.isfile(p))


def corpus(kind, max_bytes, per_file):
    """The bytes of one corpus: each file's first per_file bytes, files in
    name order (deduplicated by content) until max_bytes."""
    files = general_files() if kind == "general" else task_files()
    seen, parts, n = set(), [], 0
    for p in files:
        try:
            raw = _clean(_read(p)[:per_file])
        except (OSError, EOFError):
            continue
        if raw is None or len(raw) < 2048:
            continue
        h = hashlib.sha256(raw).hexdigest()
        if h in seen:
            continue
        seen.add(h)
        parts.append(raw + b"\n\n")
        n += len(parts[-1])
        if n >= max_bytes:
            break
    return b"".join(parts)[:max_bytes], len(parts)


def split(data):
    """(train, held-out) byte arrays: every HOLD_EVERY-th block held out."""
    a = np.frombuffer(data, np.uint8)
    nb = len(a) // BLOCK
    blocks = a[:nb * BLOCK].reshape(nb, BLOCK)
    held = np.arange(nb) % HOLD_EVERY == HOLD_EVERY - 1
    return blocks[~held].reshape(-1).copy(), blocks[held].reshape(-1).copy()


def windows(arr, T, n=None):
    """Non-overlapping windows of T+1 bytes (input + next byte)."""
    m = (len(arr) - 1) // T
    if n is not None:
        m = min(m, n)
    idx = np.arange(m)[:, None] * T + np.arange(T + 1)[None, :]
    return torch.from_numpy(arr[idx].astype(np.int64))


def sample(arr, T, B, gen):
    st = torch.randint(0, len(arr) - T - 1, (B,), generator=gen).numpy()
    idx = st[:, None] + np.arange(T + 1)[None, :]
    return torch.from_numpy(arr[idx].astype(np.int64))


def _bytes_to_unicode():
    """GPT-2's reversible map of bytes to printable characters (the
    ByteLevel pre-tokenizer's alphabet)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
          + list(range(0xAE, 0x100)))
    cs = list(bs)
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_json():
    """A Hugging Face tokenizer.json for bytes: token id = byte value."""
    m = _bytes_to_unicode()
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                          "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False,
                    "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": {m[b]: b for b in range(256)}, "merges": []},
    }


# ---------------------------------------------------------------- model

class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return llama.rms_norm(x, self.weight, self.eps)


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus PEFT's LoRA: y = W x + s B A x."""

    def __init__(self, base, r, alpha, gen):
        super().__init__()
        self.base = base
        self.r, self.scale = r, alpha / r
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features,
                                               generator=gen)
                                   / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.lora_A.T) @ self.lora_B.T


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, hd = cfg["hidden_size"], cfg["head_dim"]
        H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.cfg = cfg
        self.q_proj = nn.Linear(d, H * hd, bias=False)
        self.k_proj = nn.Linear(d, KV * hd, bias=False)
        self.v_proj = nn.Linear(d, KV * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)

    def forward(self, x):
        c = self.cfg
        B, T, _ = x.shape
        H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = self.q_proj(x).view(B, T, H, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, KV, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, KV, hd).transpose(1, 2)
        q, k = llama.rope(q, c["rope_theta"]), llama.rope(k, c["rope_theta"])
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        mask = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, H * hd))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"],
                                                cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Layer(cfg) for _ in
                                    range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class LM(nn.Module):
    """LlamaForCausalLM's mathematics with a tied head (no lm_head
    parameter: the state dict is what HF writes for tie_word_embeddings)."""

    def __init__(self, cfg, seed):
        super().__init__()
        assert cfg["tie_word_embeddings"]
        self.cfg = cfg
        torch.manual_seed(seed)
        self.model = Body(cfg)
        for n, p in self.named_parameters():
            if n.endswith("norm.weight"):
                continue
            # weights: 1/sqrt(fan in); embedding rows: 1/sqrt(width)
            nn.init.normal_(p, 0.0, 1.0 / math.sqrt(p.shape[-1]))
        for layer in self.model.layers:   # residual branches start small
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                lin.weight.data /= math.sqrt(2 * cfg["num_hidden_layers"])

    def forward(self, ids):
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h)
        h = self.model.norm(h)
        return h @ self.model.embed_tokens.weight.T


def config(width, depth, ffn, heads=4, kv=2, ctx=64, vocab=256):
    return llama.default_config(vocab_size=vocab, hidden_size=width,
                                intermediate_size=ffn,
                                num_hidden_layers=depth,
                                num_attention_heads=heads,
                                num_key_value_heads=kv,
                                max_position_embeddings=ctx,
                                tie_word_embeddings=True)


def check_forward(model):
    """The module computes llama.py's forward (the folders' meaning)."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(ids)
        b = llama.forward(model.cfg, {k: v.double() for k, v in
                                      model.state_dict().items()}, ids)
    err = float((a.double() - b).abs().max())
    assert err < 1e-3, "module and llama.forward disagree: %g" % err


def loss_sum(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           y.reshape(-1), reduction="sum")


def mean_loss(model, win, batch=32, nbytes=None):
    """Mean next-byte cross-entropy (nats) over windows [n, T+1]: of a
    token, with nbytes (each token id's length in bytes) the windows'
    summed loss over the bytes their next tokens cover (nats per byte, so
    that models of other tokenizers compare)."""
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(win), batch):
            w = win[i:i + batch]
            tot += float(loss_sum(model(w[:, :-1]), w[:, 1:]))
            n += w[:, 1:].numel() if nbytes is None else \
                int(nbytes[w[:, 1:]].sum())
    return tot / n


def grown_tokenizer_json(extra):
    """The byte tokenizer with `extra` added (special) tokens after the
    256 bytes: a vocabulary that grew (the text tokenizes the same)."""
    tok = tokenizer_json()
    tok["added_tokens"] = [{"id": 256 + k, "content": "<|extra_%d|>" % k,
                            "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False,
                            "special": True} for k in range(extra)]
    return tok


def train(model, params, data, steps, lr, batch, T, seed, log=None,
          warmup=50):
    """AdamW with linear warmup and cosine decay on random windows."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0,
                            betas=(0.9, 0.98))
    model.train()
    for s in range(steps):
        f = min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
        for g in opt.param_groups:
            g["lr"] = lr * max(f, 0.05)
        w = sample(data, T, batch, gen)
        loss = loss_sum(model(w[:, :-1]), w[:, 1:]) / w[:, 1:].numel()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if log and (s % 200 == 0 or s == steps - 1):
            log("  step %d/%d loss %.3f" % (s, steps, float(loss)))
    model.eval()
    return model


def add_lora(model, r, alpha, seed):
    """Wraps every projection in LoRA; only the factors train."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LORA_MODULES:
                if hasattr(parent, name):
                    ll = LoraLinear(getattr(parent, name), r, alpha, gen)
                    setattr(parent, name, ll)
                    wrapped.append(ll)
    return [p for ll in wrapped for p in (ll.lora_A, ll.lora_B)]


def lora_tensors(model):
    """PEFT's tensor names and the merged state dict of a LoRA model."""
    tensors, merged = {}, {}
    for n, m in model.named_modules():
        if isinstance(m, LoraLinear):
            tensors["base_model.model.%s.lora_A.weight" % n] = m.lora_A.detach().clone()
            tensors["base_model.model.%s.lora_B.weight" % n] = m.lora_B.detach().clone()
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        merged[k.replace(".base.", ".")] = v.detach().clone()
    for n, m in model.named_modules():
        if isinstance(m, LoraLinear):
            merged[n + ".weight"] = merged[n + ".weight"] + m.scale * (
                m.lora_B @ m.lora_A).detach()
    return tensors, merged


def lora_config(r, alpha, base):
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
            "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": LORA_MODULES, "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "rank_pattern": {},
            "alpha_pattern": {}, "base_model_name_or_path": base,
            "inference_mode": True}


def load(cfg, sd):
    m = LM(cfg, 0)
    m.load_state_dict({k: torch.as_tensor(v).float() for k, v in sd.items()})
    return m.eval()


# ---------------------------------------------------------------- files

def write_model_folder(path, model, tok):
    llama.write_folder(path, model.cfg, {k: v.detach() for k, v in
                                         model.state_dict().items()})
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f)


def calibration(model, wins):
    """A calibration file's tensors for the `bico` command: each linear and
    RMSNorm module's input rows and the gradient of the next-byte
    cross-entropy (summed) with respect to its output (docs/formats.md)."""
    rec, hooks = {}, []
    for n, m in model.named_modules():
        if isinstance(m, (nn.Linear, RMSNorm)):
            def fh(mod, inp, out, n=n):
                rec.setdefault(n + ".input", []).append(
                    inp[0].detach().reshape(-1, inp[0].shape[-1]))
                out.register_hook(lambda g, n=n: rec.setdefault(
                    n + ".output_grad", []).append(
                        g.detach().reshape(-1, g.shape[-1])))
            hooks.append(m.register_forward_hook(fh))
    for i in range(0, len(wins), 16):
        w = wins[i:i + 16]
        model.zero_grad()
        loss_sum(model(w[:, :-1]), w[:, 1:]).backward()
    for h in hooks:
        h.remove()
    model.zero_grad()
    # gradients arrive in reverse order within a batch: one tensor per batch
    return {k: torch.cat(v).numpy().astype(np.float32)
            for k, v in sorted(rec.items())}


def votes(model, wins):
    """GradFix votes (docs/formats.md): per parameter, sum over the windows
    of sign(-gradient of the window's loss), int32."""
    v = {n: torch.zeros_like(p, dtype=torch.int32)
         for n, p in model.named_parameters()}
    for i in range(len(wins)):
        w = wins[i:i + 1]
        model.zero_grad()
        loss_sum(model(w[:, :-1]), w[:, 1:]).backward()
        for n, p in model.named_parameters():
            v[n] += torch.sign(-p.grad).to(torch.int32)
    model.zero_grad()
    return {n: t.numpy() for n, t in v.items()}
