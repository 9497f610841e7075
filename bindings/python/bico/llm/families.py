"""bico.llm.families: Hugging Face decoder folders as PyTorch modules
(config.json -> DecoderLM).

    import bico.torch as bt          # or: from bico.llm.families import ...
    src = bl.load_model("Qwen2-0.5B/")              # nn.Module, HF names

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

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .._inputs import read_input
from .._status import BicoError, E_FORMAT, E_NOTFOUND, E_UNSUPPORTED
from .. import safetensors as _st
from .config import check_config

__all__ = ["load_model", "model_config", "DecoderLM"]

FAMILIES = ("llama", "mistral", "qwen2", "gemma")
# a config.json larger than this is no model's
CONFIG_LIMIT = 64 << 20
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
        return self.o_proj(self.core(self.q_proj(x), self.k_proj(x),
                                     self.v_proj(x), attention_mask,
                                     position_embeddings))

    def core(self, q, k, v, attention_mask, position_embeddings,
             cache=None):
        """The attention between the projections: q, k, v (the q/k/v
        projections' outputs, [B, T, *]) -> o_proj's input [B, T, H hd]
        (what forward computes; the streamed runner calls it by stage).
        cache: a list [keys, values] of the positions before these
        ([B, KV, T0, hd] each after rotation, or None): the new keys and
        values are appended to it, and attention_mask is then [T, T0 + T]
        (DecoderLM.step: one token at a time with a key-value cache)."""
        B, T, _ = q.shape
        q = q.view(B, T, self.H, self.hd).transpose(1, 2)
        k = k.view(B, T, self.KV, self.hd).transpose(1, 2)
        v = v.view(B, T, self.KV, self.hd).transpose(1, 2)
        cos, sin = position_embeddings
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            if cache[0] is not None:
                k = torch.cat([cache[0], k], dim=2)
                v = torch.cat([cache[1], v], dim=2)
            cache[0], cache[1] = k, v
        rep = self.H // self.KV
        if rep > 1:
            k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        if attention_mask is not None:
            s = s + attention_mask.to(s.dtype)
        a = torch.softmax(s.float() if s.dtype != torch.float64 else s,
                          dim=-1).to(v.dtype)
        return (a @ v).transpose(1, 2).reshape(B, T, self.H * self.hd)


def _repeat_kv(t, rep):
    """[B, KV, T, hd] -> [B, KV * rep, T, hd], each head repeated rep
    times in place (repeat_interleave's result, by a view and one copy:
    repeat_interleave reads its repeat count back from the device)."""
    B, KV, T, hd = t.shape
    return t[:, :, None].expand(B, KV, rep, T, hd).reshape(B, KV * rep, T,
                                                           hd)


class Mlp(nn.Module):
    def __init__(self, cfg, t, p):
        super().__init__()
        for n in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, n, _linear(t.pop(p + n + ".weight"),
                                     t.pop(p + n + ".bias", None)))
        self.act = _ACT[cfg["act"]]

    def forward(self, x):
        return self.down_proj(self.inner(x))

    def inner(self, x):
        """down_proj's input: act(gate(x)) * up(x)."""
        return self.act(self.gate_proj(x)) * self.up_proj(x)


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

    def _embed(self, input_ids, start=0):
        """(embeddings, (cos, sin)) of tokens at positions start, start +
        1, ...: the stem and the rotary angles forward and step share."""
        h = self.embed_tokens(input_ids)
        if self.cfg["gemma"]:
            h = h * torch.tensor(self.cfg["d"] ** 0.5, dtype=h.dtype)
        T = input_ids.shape[-1]
        ft = torch.float64 if h.dtype == torch.float64 else torch.float32
        pos = torch.arange(start, start + T, device=h.device, dtype=ft)
        ang = pos[:, None] * self.inv_freq.to(h.device, ft)[None, :]
        emb = torch.cat([ang, ang], dim=-1)
        return h, (emb.cos().to(h.dtype), emb.sin().to(h.dtype))

    def step(self, input_ids, cache):
        """The final hidden states of the tokens input_ids [B, T] that
        follow the cache's positions (cache: one [keys, values] list a
        layer, both None at first; filled as it goes): generation with
        a key-value cache, each layer's operations those of forward."""
        start = 0 if cache[0][0] is None else cache[0][0].shape[2]
        h, pe = self._embed(input_ids, start)
        T = input_ids.shape[-1]
        i = torch.arange(start, start + T, device=h.device)[:, None]
        j = torch.arange(start + T, device=h.device)[None, :]
        bad = j > i
        if self.cfg.get("window"):
            bad = bad | (i - j >= self.cfg["window"])
        mask = torch.zeros(T, start + T, dtype=h.dtype, device=h.device) \
            .masked_fill(bad, float("-inf"))[None, None]
        for layer, c in zip(self.layers, cache):
            at = layer.self_attn
            x = layer.input_layernorm(h)
            h = h + at.o_proj(at.core(at.q_proj(x), at.k_proj(x),
                                      at.v_proj(x), mask, pe, cache=c))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def forward(self, input_ids, attention_mask=None):
        h, (cos, sin) = self._embed(input_ids)
        T = input_ids.shape[-1]
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
    """The rotary frequencies; cfg's rope_scaling was checked by
    bico.llm.config (known type, factors > 0, high above low)."""
    hd, theta = cfg["hd"], cfg["theta"]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":
        f, lo, hi = rs["factor"], rs["low_freq_factor"], \
            rs["high_freq_factor"]
        old = float(rs["original_max_position_embeddings"])
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > old / lo, inv / f, inv)
        smooth = (old / wl - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / f + smooth * scaled
        is_mid = (wl <= old / lo) & (wl >= old / hi)
        inv = torch.where(is_mid, mid, scaled)
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

    def new_cache(self):
        """An empty key-value cache for step()."""
        return [[None, None] for _ in self.model.layers]

    def step(self, input_ids, cache):
        """The logits of the last of the tokens input_ids [B, T], which
        follow the positions cache holds (new_cache(), filled as it goes):
        one forward over the new tokens only, the earlier ones' keys and
        values read from the cache.  The same logits as forward() over the
        whole sequence."""
        return self.lm_head(self.model.step(input_ids, cache)[:, -1])

    def get_output_embeddings(self):
        """The head (transformers' name for it): what transfer_model's fit
        keeps by token id when untied."""
        return self.lm_head


def model_config(folder):
    """config.json of a model folder as a dict (an error naming the file
    when it is missing or unreadable)."""
    p = os.path.join(str(folder), "config.json")
    try:
        return json.loads(read_input(p, limit=CONFIG_LIMIT).decode("utf-8"))
    except BicoError as e:
        raise BicoError(e.status, "load_model: cannot read %s" % e.message)
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


def _shapes(path):
    """{tensor: (dtype, shape)} of a weights file's headers (no data)."""
    with _st.open(path) as f:
        return {name: f.info(name) for name in f.keys()}


def _family_config(folder):
    """A folder's config.json (raw, its path, its model_type), refused
    unless the type is a family this module runs."""
    raw = model_config(folder)
    cpath = os.path.join(folder, "config.json")
    mt = raw.get("model_type") if isinstance(raw, dict) else None
    if isinstance(raw, dict) and mt not in FAMILIES:
        raise BicoError(E_UNSUPPORTED, "load_model: %s: model_type %r is not "
                        "a decoder family bico.llm.load_model knows (%s); "
                        "load it with transformers' AutoModelForCausalLM "
                        "instead" % (cpath, mt, ", ".join(FAMILIES)))
    return raw, cpath, mt


def load_model(folder, dtype=None):
    """The decoder of a Hugging Face model folder (config.json and
    model.safetensors, or shards with model.safetensors.index.json) as a
    DecoderLM in eval mode.  dtype: None keeps the files' dtype (BF16 stays
    torch.bfloat16), or a torch float dtype.  Unknown model types are
    refused naming config.json and the type; config.json is checked
    against itself and the tensors' shapes before any tensor is read
    (bico.llm.config.check_config: a BicoError naming the file and key)."""
    folder = str(folder)
    raw, cpath, mt = _family_config(folder)
    path = _weights_path(folder)
    info = _shapes(path)
    for name, (dt, _) in info.items():
        if dtype is None and dt not in _TORCH_DT:
            raise BicoError(E_FORMAT, "load_model: %s: tensor %s has "
                            "dtype %s, not a float" % (path, name, dt))
    checked = check_config(raw, cpath, {k: v[1] for k, v in info.items()},
                           path, tuple(_ACT))
    tensors = {}
    with _st.open(path) as f:
        for name in f.keys():
            want = dtype if dtype is not None else _TORCH_DT[info[name][0]]
            a = f.get(name, np.float64 if want == torch.float64 else
                      np.float32)
            tensors[name] = torch.from_numpy(a).to(want)
    if checked["tied"]:
        tensors.pop("lm_head.weight", None)
    cfg = dict(checked, raw=raw, path=folder, type=mt)
    try:
        m = DecoderLM(cfg, tensors)
    except KeyError as e:
        raise BicoError(E_FORMAT, "load_model: %s lacks tensor %s, which a "
                        "%s decoder with %d layers has" % (path, e.args[0],
                                                           mt, cfg["L"]))
    return m.eval()


# ---- one block at a time (the streamed runner, bico.llm.runtime) ----

def stream_config(folder, shapes):
    """The configuration load_model builds for a folder (the same dict a
    loaded model's .model.cfg holds, checked by the same check_config),
    from config.json and the weights' headers alone ({tensor: shape}): for
    running the decoder a block at a time."""
    folder = str(folder)
    raw, cpath, mt = _family_config(folder)
    checked = check_config(raw, cpath, dict(shapes), _weights_path(folder),
                           tuple(_ACT))
    return dict(checked, raw=raw, path=folder, type=mt)


def decoder_layer(cfg, tensors, i):
    """Decoder layer i built from its tensors ({"model.layers.i.<...>":
    tensor}), as load_model builds it; eval mode.  A tensor of another
    layer, or one missing, is an error naming it."""
    t = dict(tensors)
    p = "model.layers.%d." % i
    try:
        layer = DecoderLayer(cfg, t, p)
    except KeyError as e:
        raise BicoError(E_FORMAT, "load_model: %s lacks tensor %s, which a "
                        "%s decoder with %d layers has" % (
                            cfg["path"], e.args[0], cfg["type"], cfg["L"]))
    if t:
        raise BicoError(E_FORMAT, "load_model: %s: layer %d has tensors a %s "
                        "decoder layer does not have: %s" % (
                            cfg["path"], i, cfg["type"],
                            ", ".join(sorted(t)[:5])))
    return layer.eval()


def positions(cfg, T, h, attention_mask=None):
    """((cos, sin), mask) of Model.forward for T tokens and hidden states
    h (their dtype and device): what every layer of a window receives."""
    ft = torch.float64 if h.dtype == torch.float64 else torch.float32
    pos = torch.arange(T, device=h.device, dtype=ft)
    ang = pos[:, None] * _inv_freq(cfg).to(h.device, ft)[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
    mask = _causal_mask(T, cfg.get("window"), h)
    if attention_mask is not None:
        pad = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) \
            * torch.finfo(h.dtype).min
        mask = mask + pad
    return (cos, sin), mask
