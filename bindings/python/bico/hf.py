"""bico.hf: Hugging Face decoder folders as PyTorch modules, calibration
windows from text, and fitted updates written as PEFT LoRA adapters.
Everything here is re-exported by bico.torch.

    import bico.torch as bt
    src = bt.load_model("Qwen2-0.5B/")              # nn.Module, HF names
    cal = bt.text_batches("task.txt", window=256, tokenizer="Qwen2-0.5B/")
    new_sd = bt.transfer_model(src, src_ft, tgt, cal.batches, method="fit",
                               loss_fn=bt.next_token_loss)
    bt.save_adapter("tgt_adapter/", tgt, new_sd, r=16, covariance=...)

load_model knows the decoder families of test/e2e/llama.py: Llama,
Mistral, Qwen2 and Gemma (config.json's model_type), with RMSNorm (Gemma's
1 + w), half-split rotary embeddings with rope_theta (and Llama 3's or
linear rope_scaling), grouped-query attention, SwiGLU / GeGLU, the q/k/v
(and o / MLP) biases the files hold, a tied or untied head, one file or
shards (model.safetensors.index.json) in BF16/F16/F32, read with libbico's
validating reader.  Its layers are called the Hugging Face way
(layer(h, attention_mask=..., position_embeddings=(cos, sin))), so
transfer_model's fit replays them.  Where `transformers` is installed,
its AutoModelForCausalLM modules may be used instead (their output's
.logits is read).
"""
import json
import math
import os
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._status import BicoError, E_ARG, E_FORMAT, E_NOTFOUND, E_UNSUPPORTED
from . import safetensors as _st

__all__ = ["load_model", "model_config", "DecoderLM", "tokenize",
           "text_batches", "Calibration", "next_token_loss", "lm_loss",
           "save_adapter", "input_covariances", "update_grams", "low_rank"]

FAMILIES = ("llama", "mistral", "qwen2", "gemma")
_TORCH_DT = {"BF16": torch.bfloat16, "F16": torch.float16,
             "F32": torch.float32, "F64": torch.float64}
_ACT = {"silu": F.silu, "swish": F.silu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu": F.gelu}


# ---------------------------------------------------------------- model

class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm (no mean); gemma: scale 1 + weight.  Half
    precision inputs are normalised in float32, as transformers does."""

    def __init__(self, weight, eps, gemma=False):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.eps, self.gemma = eps, gemma

    def forward(self, x):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)
        return self.weight * y.to(x.dtype)


def _linear(w, b=None):
    m = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    m.weight = nn.Parameter(w)
    if b is not None:
        m.bias = nn.Parameter(b)
    return m


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg, t, p):
        super().__init__()
        self.H, self.KV, self.hd = cfg["H"], cfg["KV"], cfg["hd"]
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, n, _linear(t.pop(p + n + ".weight"),
                                     t.pop(p + n + ".bias", None)))

    def forward(self, hidden_states, attention_mask=None,
                position_embeddings=None, **kwargs):
        x = hidden_states
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        cos, sin = position_embeddings
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.H // self.KV
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        if attention_mask is not None:
            s = s + attention_mask.to(s.dtype)
        a = torch.softmax(s.float() if s.dtype != torch.float64 else s,
                          dim=-1).to(v.dtype)
        o = (a @ v).transpose(1, 2).reshape(B, T, self.H * self.hd)
        return self.o_proj(o)


class Mlp(nn.Module):
    def __init__(self, cfg, t, p):
        super().__init__()
        for n in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, n, _linear(t.pop(p + n + ".weight"),
                                     t.pop(p + n + ".bias", None)))
        self.act = _ACT[cfg["act"]]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Called as transformers calls its decoder layers: hidden states and
    keyword arguments; returns a tuple."""

    def __init__(self, cfg, t, p):
        super().__init__()
        g, eps = cfg["gemma"], cfg["eps"]
        self.input_layernorm = RMSNorm(t.pop(p + "input_layernorm.weight"),
                                       eps, g)
        self.self_attn = Attention(cfg, t, p + "self_attn.")
        self.post_attention_layernorm = RMSNorm(
            t.pop(p + "post_attention_layernorm.weight"), eps, g)
        self.mlp = Mlp(cfg, t, p + "mlp.")

    def forward(self, hidden_states, attention_mask=None,
                position_embeddings=None, **kwargs):
        h = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings)
        return (h + self.mlp(self.post_attention_layernorm(h)),)


class Model(nn.Module):
    def __init__(self, cfg, t):
        super().__init__()
        self.cfg = cfg
        emb = t.pop("model.embed_tokens.weight")
        self.embed_tokens = nn.Embedding(emb.shape[0], emb.shape[1],
                                         device="meta")
        self.embed_tokens.weight = nn.Parameter(emb)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, t, "model.layers.%d." % i)
            for i in range(cfg["L"]))
        self.norm = RMSNorm(t.pop("model.norm.weight"), cfg["eps"],
                            cfg["gemma"])
        self.register_buffer("inv_freq", _inv_freq(cfg), persistent=False)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed_tokens(input_ids)
        if self.cfg["gemma"]:
            h = h * torch.tensor(self.cfg["d"] ** 0.5, dtype=h.dtype)
        T = input_ids.shape[-1]
        ft = torch.float64 if h.dtype == torch.float64 else torch.float32
        pos = torch.arange(T, device=h.device, dtype=ft)
        ang = pos[:, None] * self.inv_freq.to(h.device, ft)[None, :]
        emb = torch.cat([ang, ang], dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        mask = _causal_mask(T, self.cfg.get("window"), h)
        if attention_mask is not None:  # [B, T] padding: 1 keep, 0 drop
            pad = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) \
                * torch.finfo(h.dtype).min
            mask = mask + pad
        for layer in self.layers:
            h = layer(h, attention_mask=mask,
                      position_embeddings=(cos, sin))[0]
        return self.norm(h)


def _causal_mask(T, window, h):
    i = torch.arange(T, device=h.device)
    bad = i[None, :] > i[:, None]
    if window:
        bad = bad | (i[:, None] - i[None, :] >= window)
    m = torch.zeros(T, T, dtype=h.dtype, device=h.device)
    return m.masked_fill(bad, float("-inf"))[None, None]


def _inv_freq(cfg):
    hd, theta = cfg["hd"], cfg["theta"]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = cfg.get("rope_scaling")
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "linear":
            inv = inv / float(rs["factor"])
        elif kind == "llama3":
            f, lo, hi = (float(rs["factor"]), float(rs["low_freq_factor"]),
                         float(rs["high_freq_factor"]))
            old = float(rs["original_max_position_embeddings"])
            wl = 2 * math.pi / inv
            scaled = torch.where(wl > old / lo, inv / f, inv)
            smooth = (old / wl - lo) / (hi - lo)
            mid = (1 - smooth) * scaled / f + smooth * scaled
            is_mid = (wl <= old / lo) & (wl >= old / hi)
            inv = torch.where(is_mid, mid, scaled)
        elif kind not in (None, "default"):
            raise BicoError(E_UNSUPPORTED, "load_model: %s: rope_scaling "
                            "type %r is not supported (known: linear, "
                            "llama3)" % (cfg["path"], kind))
    return inv


class DecoderLM(nn.Module):
    """A decoder language model with Hugging Face's tensor names
    (model.embed_tokens, model.layers.N.self_attn.q_proj, ..., lm_head).
    model(input_ids [B, T], attention_mask=None) -> logits [B, T, V] (a
    tensor).  A tied head is an nn.Linear whose weight IS
    model.embed_tokens.weight (its state dict holds both names)."""

    def __init__(self, cfg, tensors):
        super().__init__()
        t = dict(tensors)
        self.config = cfg["raw"]
        self.model = Model(cfg, t)
        head = t.pop("lm_head.weight", None)
        if cfg["tied"]:
            head = self.model.embed_tokens.weight
            self.lm_head = _linear(head.data)
            self.lm_head.weight = head
        else:
            self.lm_head = _linear(head)
        if t:
            raise BicoError(E_FORMAT, "load_model: %s holds tensors a %s "
                            "decoder does not have: %s" % (
                                cfg["path"], cfg["type"],
                                ", ".join(sorted(t)[:5])))

    def forward(self, input_ids, attention_mask=None):
        return self.lm_head(self.model(input_ids, attention_mask))


def model_config(folder):
    """config.json of a model folder as a dict (an error naming the file
    when it is missing or unreadable)."""
    p = os.path.join(str(folder), "config.json")
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BicoError(E_NOTFOUND if isinstance(e, OSError) else E_FORMAT,
                        "load_model: cannot read %s (%s)" % (p, e))


def _weights_path(folder):
    for n in ("model.safetensors.index.json", "model.safetensors"):
        p = os.path.join(folder, n)
        if os.path.exists(p):
            return p
    raise BicoError(E_NOTFOUND, "load_model: %s holds neither "
                    "model.safetensors nor model.safetensors.index.json"
                    % folder)


def load_model(folder, dtype=None):
    """The decoder of a Hugging Face model folder (config.json and
    model.safetensors, or shards with model.safetensors.index.json) as a
    DecoderLM in eval mode.  dtype: None keeps the files' dtype (BF16 stays
    torch.bfloat16), or a torch float dtype.  Unknown model types are
    refused naming config.json and the type."""
    folder = str(folder)
    raw = model_config(folder)
    mt = raw.get("model_type")
    if mt not in FAMILIES:
        raise BicoError(E_UNSUPPORTED, "load_model: %s: model_type %r is not "
                        "a decoder family bico.torch.load_model knows (%s); "
                        "load it with transformers' AutoModelForCausalLM "
                        "instead" % (os.path.join(folder, "config.json"), mt,
                                     ", ".join(FAMILIES)))
    path = _weights_path(folder)
    tensors = {}
    with _st.open(path) as f:
        for name in f.keys():
            dt, _ = f.info(name)
            want = dtype if dtype is not None else _TORCH_DT.get(dt)
            if want is None:
                raise BicoError(E_FORMAT, "load_model: %s: tensor %s has "
                                "dtype %s, not a float" % (path, name, dt))
            a = f.get(name, np.float64 if want == torch.float64 else
                      np.float32)
            tensors[name] = torch.from_numpy(a).to(want)
    gemma = mt == "gemma"
    d = raw["hidden_size"]
    H = raw["num_attention_heads"]
    act = raw.get("hidden_activation") or raw.get("hidden_act") or \
        ("gelu_pytorch_tanh" if gemma else "silu")
    if gemma and act == "gelu":
        act = "gelu_pytorch_tanh"  # transformers' Gemma does the same
    if act not in _ACT:
        raise BicoError(E_UNSUPPORTED, "load_model: %s: hidden_act %r is not "
                        "supported (known: %s)" % (os.path.join(
                            folder, "config.json"), act, ", ".join(_ACT)))
    tied = "lm_head.weight" not in tensors or \
        bool(raw.get("tie_word_embeddings", gemma))
    if tied:
        tensors.pop("lm_head.weight", None)
    window = None
    if mt == "mistral" or (mt == "qwen2" and raw.get("use_sliding_window")):
        window = raw.get("sliding_window")
    cfg = dict(raw=raw, path=folder, type=mt, gemma=gemma, d=d, H=H,
               KV=raw.get("num_key_value_heads") or H,
               hd=raw.get("head_dim") or d // H,
               L=raw["num_hidden_layers"],
               eps=raw.get("rms_norm_eps", 1e-6),
               theta=float(raw.get("rope_theta", 10000.0)),
               rope_scaling=raw.get("rope_scaling"), act=act, tied=tied,
               window=window)
    try:
        m = DecoderLM(cfg, tensors)
    except KeyError as e:
        raise BicoError(E_FORMAT, "load_model: %s lacks tensor %s, which a "
                        "%s decoder with %d layers has" % (path, e.args[0],
                                                           mt, cfg["L"]))
    return m.eval()


# ---------------------------------------------------------------- text

def _bytes_to_unicode():
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


def _tokenizer_file(tok):
    p = str(tok)
    if os.path.isdir(p):
        p = os.path.join(p, "tokenizer.json")
    if not os.path.exists(p):
        raise BicoError(E_NOTFOUND, "tokenize: no tokenizer file %s" % p)
    return p


def _byte_level(spec, path):
    """The byte map of a byte-level tokenizer.json without merges (every
    byte one token), or None."""
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("merges") or \
            pre.get("type") != "ByteLevel":
        return None
    vocab = model.get("vocab") or {}
    m = _bytes_to_unicode()
    try:
        table = np.array([vocab[m[b]] for b in range(256)], dtype=np.int64)
    except KeyError:
        return None
    return table, bool(pre.get("add_prefix_space"))


def tokenize(text, tokenizer):
    """Token ids (a 1-D int64 tensor) of text.  tokenizer: a callable (text
    -> ids, or an object with .encode(text) giving ids or .ids), or a
    tokenizer.json file / model folder: read with Hugging Face's
    `tokenizers` package when it is installed; without it, the byte-level
    tokenizer whose vocabulary is the 256 bytes and has no merges is read
    natively, and any other is refused (tokenize with your own tokenizer
    and pass the ids)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        path = _tokenizer_file(tokenizer)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None
        if Tokenizer is not None:
            ids = Tokenizer.from_file(path).encode(text).ids
            return torch.tensor(ids, dtype=torch.int64)
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        bl = _byte_level(spec, path)
        if bl is None:
            raise BicoError(E_UNSUPPORTED, "tokenize: %s needs Hugging Face's "
                            "`tokenizers` package (pip install tokenizers), "
                            "or pass token ids (--ids ids.npy in python3 -m "
                            "bico.llm)" % path)
        table, prefix = bl
        if prefix and text and not text.startswith(" "):
            text = " " + text
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return torch.from_numpy(table[raw].copy())
    if tokenizer is None:
        raise BicoError(E_ARG, "tokenize: text needs a tokenizer (a "
                        "callable, or a tokenizer.json file or folder)")
    out = tokenizer.encode(text) if hasattr(tokenizer, "encode") and \
        not callable(tokenizer) else tokenizer(text)
    if hasattr(out, "ids"):
        out = out.ids
    if isinstance(out, dict) and "input_ids" in out:
        out = out["input_ids"]
    return torch.as_tensor(np.asarray(out), dtype=torch.int64).reshape(-1)


Calibration = namedtuple("Calibration", "batches held_out windows")


def text_batches(ids_or_text, window, n=None, holdout=0.125, tokenizer=None,
                 batch_size=8, seed=0):
    """Calibration batches for a decoder from token ids or text.

    ids_or_text: token ids (a 1-D tensor, array or list), text (a str), or
    a path to a .txt file (read as UTF-8) or a .npy file of ids.  The ids
    are cut into consecutive windows of window + 1 tokens; each batch is
    (ids [b, window], next ids [b, window]), for model(x) and
    next_token_loss(logits, y).  n: at most this many windows (spread
    evenly over the text); holdout: the share of windows held out (every
    k-th window, at least one when there are two or more) for the choices
    a fit makes (scale, ridge): never use them for the fit itself, nor your
    evaluation text for either.  Returns Calibration(batches, held_out,
    windows) with windows the number of fit windows."""
    if not (isinstance(window, int) and window >= 1):
        raise BicoError(E_ARG, "text_batches: window must be a positive "
                        "integer, got %r" % (window,))
    if not (0 <= holdout < 1):
        raise BicoError(E_ARG, "text_batches: holdout must be in [0, 1), "
                        "got %r" % (holdout,))
    src = ids_or_text
    if isinstance(src, os.PathLike) or (isinstance(src, str) and
                                        src.endswith((".txt", ".npy"))
                                        and os.path.exists(src)):
        p = str(src)
        if p.endswith(".npy"):
            src = np.load(p)
        else:
            with open(p, encoding="utf-8") as f:
                src = f.read()
    if isinstance(src, str):
        ids = tokenize(src, tokenizer)
    else:
        ids = torch.as_tensor(np.asarray(src)).reshape(-1)
        if ids.dtype.is_floating_point:
            raise BicoError(E_ARG, "text_batches: token ids must be "
                            "integers, got %s" % ids.dtype)
        ids = ids.to(torch.int64)
    m = (ids.numel() - 1) // window
    if m < 1:
        raise BicoError(E_ARG, "the text has %d tokens, too few for one "
                        "window of %d (+1) tokens" % (ids.numel(), window))
    wins = torch.stack([ids[i * window:(i + 1) * window + 1]
                        for i in range(m)])
    if n is not None and n < m:
        wins = wins[np.linspace(0, m - 1, int(n)).round().astype(int)]
    m = len(wins)
    k = 0 if holdout == 0 or m < 2 else max(1, int(round(m * holdout)))
    held_idx = set(np.linspace(0, m - 1, k).round().astype(int).tolist()) \
        if k else set()
    g = torch.Generator().manual_seed(seed)
    fit_idx = [i for i in range(m) if i not in held_idx]
    fit_idx = [fit_idx[int(j)] for j in torch.randperm(len(fit_idx),
                                                       generator=g)]

    def batches(idx):
        out = []
        for s in range(0, len(idx), batch_size):
            w = wins[sorted(idx[s:s + batch_size])]
            out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
        return out
    return Calibration(batches(fit_idx), batches(sorted(held_idx)),
                       len(fit_idx))


def next_token_loss(out, y):
    """Mean cross-entropy of logits (or an output with .logits) against
    the next tokens y: the loss_fn for text_batches' batches."""
    logits = out.logits if hasattr(out, "logits") else \
        (out[0] if isinstance(out, (tuple, list)) else out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                           y.reshape(-1))


def lm_loss(model, batches):
    """Mean next-token loss of model over (x, y) batches (no gradients)."""
    dev = next(model.parameters()).device
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            loss = next_token_loss(model(x.to(dev)), y.to(dev))
            tot += float(loss) * y.numel()
            cnt += y.numel()
    return tot / max(cnt, 1)


# ---------------------------------------------------------------- adapters

def input_covariances(model, batches, names=None, forward=None):
    """{linear module name: X^T X} (float64, [d_in, d_in]) of each
    nn.Linear's inputs over the batches (modules reading the same input
    share one matrix).  names: the modules (default: every nn.Linear)."""
    mods = {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and (names is None or n in names)}
    acc, seen, hooks = {}, {}, []

    def hook(name):
        def f(m, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            key = (args[0].data_ptr(), tuple(args[0].shape))
            if key in seen:
                acc[name] = acc[seen[key]]
                return
            c = x.T @ x
            if name in acc:
                acc[name] += c
            else:
                acc[name] = c
            seen[key] = name
        return f
    for n, m in mods.items():
        hooks.append(m.register_forward_hook(hook(n)))
    dev = next(model.parameters()).device
    try:
        with torch.no_grad():
            for b in batches:
                seen.clear()
                x = b[0] if isinstance(b, (tuple, list)) else b
                (forward or (lambda m, x: m(x)))(model, x.to(dev))
    finally:
        for h in hooks:
            h.remove()
    return {k: v.cpu() for k, v in acc.items()}


def update_grams(model, batches, delta, forward=None):
    """What low_rank needs to weight each linear update by its inputs, at
    the smaller of its two sizes: {module: ("out", G)} with G = sum over
    rows of (dW x)(dW x)^T [d_out, d_out] when d_out <= d_in, else
    {module: ("in", X^T X)} [d_in, d_in].  delta: {tensor name: update}
    (modules without a 2-D weight update are skipped); the inputs are
    those of model on the batches: the fitted target gives each layer
    the inputs the fit saw (earlier layers updated), the original target
    those of the untouched model.  float64."""
    ws = {}
    for n, m in model.named_modules():
        w = n + ".weight"
        if isinstance(m, nn.Linear) and w in delta:
            ws[n] = torch.as_tensor(delta[w]).double()
    acc, hooks = {}, []

    def hook(name):
        dw = ws[name]

        def f(m, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            if dw.shape[0] <= dw.shape[1]:
                y = x @ dw.T.to(x.device)
                c = ("out", (y.T @ y).cpu())
            else:
                c = ("in", (x.T @ x).cpu())
            if name in acc:
                acc[name][1].add_(c[1])
            else:
                acc[name] = c
        return f
    mods = dict(model.named_modules())
    for n in ws:
        hooks.append(mods[n].register_forward_hook(hook(n)))
    dev = next(model.parameters()).device
    try:
        with torch.no_grad():
            for b in batches:
                x = b[0] if isinstance(b, (tuple, list)) else b
                (forward or (lambda m, x: m(x)))(model, x.to(dev))
    finally:
        for h in hooks:
            h.remove()
    return acc


def low_rank(delta, r, gram=None):
    """(B [d_out, r'], A [r', d_in]), B @ A the rank-r' approximation of
    the update delta [d_out, d_in] (float64), r' = min(r, d_out, d_in).

    gram None: delta's truncated SVD (least squares in the weights).
    gram X^T X [d_in, d_in] of the layer's inputs (or ("in", X^T X), or
    ("out", sum (delta x)(delta x)^T) from update_grams): reduced-rank
    regression of the fitted values, B A = U_r U_r^T delta with U_r the
    top-r left singular vectors of delta (X^T X)^(1/2), i.e. the outputs
    X delta^T projected on their top-r right singular vectors: the rank-r
    update closest to delta's effect on those inputs.  When delta is
    itself a least-squares fit on X this is the reduced-rank regression
    solution of the same problem."""
    d = torch.as_tensor(delta).double()
    r = min(int(r), d.shape[0], d.shape[1])
    if gram is None:
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        return u[:, :r] * s[:r], vh[:r]
    kind, g = gram if isinstance(gram, tuple) else ("in", gram)
    g = torch.as_tensor(g).double()
    if kind == "in" and d.shape[0] <= d.shape[1]:
        kind, g = "out", d @ g @ d.T
    if kind == "out":
        w, u = torch.linalg.eigh((g + g.T) / 2)
        u = u[:, torch.argsort(w, descending=True)[:r]]
    else:
        w, v = torch.linalg.eigh((g + g.T) / 2)
        half = (v * w.clamp_min(0).sqrt()) @ v.T
        u, _, _ = torch.linalg.svd(d @ half, full_matrices=False)
        u = u[:, :r]
    return u, u.T @ d


def _module_names(model):
    if isinstance(model, nn.Module):
        sd = model.state_dict()
        lin = set(n for n, m in model.named_modules()
                  if isinstance(m, nn.Linear))
        return sd, lin
    sd = dict(model)
    lin = set(k[:-len(".weight")] for k, v in sd.items()
              if k.endswith(".weight") and getattr(v, "ndim", 0) == 2
              and "embed" not in k)
    return sd, lin


def _tied(model):
    """Lists of state-dict names that are one tensor (a tied head and its
    embedding), as bico.torch.transfer_model finds them."""
    by = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if isinstance(v, torch.Tensor) and v.numel() and \
                v.device.type != "meta":
            key = (str(v.device), v.data_ptr(), tuple(v.shape),
                   tuple(v.stride()), v.dtype)
            by.setdefault(key, []).append(k)
    return [names for names in by.values() if len(names) > 1]


def _short(name):
    return name.rsplit(".", 1)[-1]


def save_adapter(folder, target, fitted, r, lora_alpha=None,
                 target_modules=None, base_model_name_or_path=None,
                 modules_to_save=None, covariance=None, is_delta=False,
                 dtype=None, task_type="CAUSAL_LM", metadata=None,
                 lora_dropout=0.0, return_effective=False,
                 target_dtypes=None):
    """Writes the update of target's weights as a PEFT LoRA adapter folder
    (adapter_model.safetensors, adapter_config.json) and returns a dict
    saying what it holds and what it left out.

    target: the target nn.Module (or its state dict); fitted: the new state
    dict (what transfer_model returns), or the update itself with
    is_delta=True.  r: the rank; lora_alpha: PEFT's lora_alpha (default r,
    scale 1; the factors are stored so that lora_alpha / r * B A is the
    update).  target_modules: names (PEFT's suffix rule: "q_proj" matches
    every layer's) of the nn.Linear modules that get a pair (default: every
    nn.Linear with an update, except a head tied to the embedding).  Each
    pair is the rank-r reduced-rank regression of the layer's update
    (low_rank): covariance {module: X^T X} weights it by the layer's inputs
    (input_covariances or update_grams on calibration batches), else a
    plain truncated SVD.
    A bias update cannot sit in a LoRA pair: it is left out (reported).
    modules_to_save: modules (full names or PEFT suffixes, e.g. "norm",
    "input_layernorm", "embed_tokens") whose updated tensors are stored
    whole (PEFT's modules_to_save); updates of other tensors are left out
    and reported.  dtype: of the stored tensors (default the target's, or
    target_dtypes {tensor: torch dtype} when the target was loaded in
    another dtype than its files').  return_effective: the result also
    holds "effective", {tensor: float64 update} of what the adapter
    carries (B A products and saved tensors), for scoring it.
    Returns {"modules": [...], "saved": [...], "left_out": [names],
    "left_out_norm": relative size of what was left out, "rank": r}."""
    sd, linear = _module_names(target)
    if not (isinstance(r, int) and r >= 1):
        raise BicoError(E_ARG, "save_adapter: r must be a positive integer, "
                        "got %r" % (r,))
    alpha = float(r if lora_alpha is None else lora_alpha)
    if not alpha > 0:
        raise BicoError(E_ARG, "save_adapter: lora_alpha must be > 0")
    tied, tied_with = set(), {}
    if isinstance(target, nn.Module):
        for grp in _tied(target):
            tied.update(grp)
            for k in grp:
                tied_with[k] = [t for t in grp if t != k]

    def delta_of(k):
        v = fitted.get(k)
        if v is None:
            return None
        v = torch.as_tensor(np.asarray(v.detach().cpu().float().numpy()
                                       if isinstance(v, torch.Tensor)
                                       else v)).double()
        if is_delta:
            return v
        return v - sd[k].detach().cpu().double()

    def matches(mod, pats):
        return any(mod == p or mod.endswith("." + p) for p in pats)
    changed = {}
    for k in sd:
        dk = delta_of(k)
        if dk is not None and float(dk.abs().max() if dk.numel() else 0) > 0:
            changed[k] = dk
    if target_modules is None:
        mods = sorted(set(k[:-len(".weight")] for k in changed
                          if k.endswith(".weight")
                          and k[:-len(".weight")] in linear
                          and k not in tied))
        target_modules = sorted(set(_short(m) for m in mods))
    else:
        target_modules = [target_modules] if isinstance(target_modules, str) \
            else list(target_modules)
    pairs = sorted(m for m in linear if matches(m, target_modules)
                   and m + ".weight" in sd)
    if not pairs:
        raise BicoError(E_ARG, "save_adapter: no linear layer of the target "
                        "matches target_modules %s (or has an update): an "
                        "adapter needs at least one LoRA pair"
                        % (target_modules,))
    saves = list(modules_to_save or [])
    tensors, done, eff = {}, set(), {}
    report = {"modules": [], "saved": [], "left_out": [], "rank": r}
    for m in pairs:
        w = m + ".weight"
        if w in tied:
            raise BicoError(E_ARG, "save_adapter: %s is tied to the "
                            "embedding; a LoRA pair on it would move only "
                            "the head in PEFT: leave it out of "
                            "target_modules (or save the embedding with "
                            "modules_to_save)" % m)
        dk = changed.get(w)
        if dk is None:
            dk = torch.zeros(tuple(sd[w].shape), dtype=torch.float64)
        c = None if covariance is None else covariance.get(m)
        b, a = low_rank(dk, r, c)
        if b.shape[1] < r:  # pad to r (PEFT's rank is one number)
            b = torch.cat([b, b.new_zeros(b.shape[0], r - b.shape[1])], 1)
            a = torch.cat([a, a.new_zeros(r - a.shape[0], a.shape[1])], 0)
        # balance the factors' sizes; PEFT multiplies by lora_alpha / r
        nb, na = float(b.norm()), float(a.norm())
        if nb > 0 and na > 0:
            s = math.sqrt(na / nb)
            b, a = b * s, a / s
        b = b * (r / alpha)
        dt = dtype or (target_dtypes or {}).get(w) or sd[w].dtype
        pre = "base_model.model." + m
        tensors[pre + ".lora_A.weight"] = a.to(dt).contiguous()
        tensors[pre + ".lora_B.weight"] = b.to(dt).contiguous()
        done.add(w)
        report["modules"].append(m)
        if return_effective:
            eff[w] = (b @ a) * (alpha / r)
    saved_mods = set()
    for k, dk in changed.items():
        if k in done:
            continue
        mod = k.rsplit(".", 1)[0]
        if saves and matches(mod, saves):
            v = fitted[k] if not is_delta else sd[k].detach().cpu().double() \
                + dk
            v = torch.as_tensor(np.asarray(v.detach().cpu().float().numpy()
                                           if isinstance(v, torch.Tensor)
                                           else v))
            tensors["base_model.model." + k] = v.to(
                dtype or (target_dtypes or {}).get(k) or sd[k].dtype
            ).contiguous()
            if return_effective:
                eff[k] = dk
                for t in tied_with.get(k, ()):  # one tensor: its aliases too
                    eff[t] = dk
            saved_mods.add(mod)
            report["saved"].append(k)
        else:
            if k in tied and any(t in done or t in report["saved"]
                                 for t in tied if t != k):
                continue
            report["left_out"].append(k)
    tot = sum(float(v.pow(2).sum()) for v in changed.values())
    lost = sum(float(changed[k].pow(2).sum()) for k in report["left_out"])
    report["left_out_norm"] = math.sqrt(lost / tot) if tot > 0 else 0.0
    os.makedirs(str(folder), exist_ok=True)
    meta = {"format": "pt"}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    if report["left_out"]:
        meta["bico_left_out"] = ",".join(report["left_out"])
    _st.write(os.path.join(str(folder), "adapter_model.safetensors"),
              tensors, metadata=meta)
    cfg = {"peft_type": "LORA", "task_type": task_type, "r": r,
           "lora_alpha": alpha, "target_modules": target_modules,
           "lora_dropout": lora_dropout, "bias": "none",
           "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
           "init_lora_weights": True, "inference_mode": True,
           "modules_to_save": sorted(saved_mods) or None,
           "base_model_name_or_path": base_model_name_or_path,
           "revision": None, "rank_pattern": {}, "alpha_pattern": {},
           "layers_to_transform": None, "layers_pattern": None}
    bico_note = {"left_out": report["left_out"],
                 "left_out_norm": report["left_out_norm"],
                 "factorization": "reduced-rank regression (input-weighted)"
                 if covariance is not None else "truncated SVD"}
    bico_note.update(metadata or {})
    report["config"] = cfg
    if return_effective:
        report["effective"] = eff
    # PEFT and libbico refuse fields they do not know in
    # adapter_config.json: the note goes beside it
    with open(os.path.join(str(folder), "bico_adapter.json"), "w") as f:
        json.dump(bico_note, f, indent=2, sort_keys=True)
    tmp = os.path.join(str(folder), "adapter_config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(str(folder), "adapter_config.json"))
    return report
