"""bico.llm.config: a decoder folder's config.json checked against itself
and against the shapes of its tensors, before anything is allocated.

    cfg = check_config(raw, "B/config.json", shapes, weights="B/model...")

check_config is what bico.llm.families.load_model calls between reading
the tensors' shapes (safetensors headers) and reading their data.  Every
refusal is a BicoError naming the file and the key (or the tensor and
the key it disagrees with), never a KeyError, TypeError or an allocation
sized by an unchecked number:

- types: counts are JSON integers (not true/false, not 4.0, not "4"),
  rms_norm_eps and rope_theta are numbers, flags are true/false, the
  activation and rope type are strings, rope_scaling an object or null;
- ranges: counts >= 1 (num_hidden_layers too), rms_norm_eps > 0,
  rope_theta > 0, finite; rope factors > 0; llama3's high_freq_factor
  above its low_freq_factor; sliding_window >= 1 where it is used;
- divisibility: num_key_value_heads divides num_attention_heads; without
  head_dim, num_attention_heads divides hidden_size; head_dim is even
  (the rotary embedding turns pairs);
- agreement with the tensors: hidden_size and vocab_size are the
  embedding's columns and rows, num_attention_heads x head_dim and
  num_key_value_heads x head_dim the projections' rows, intermediate_size
  the MLP's, num_hidden_layers the layers the files hold; every tensor a
  layer reads has the shape those numbers give it; tie_word_embeddings
  false needs an lm_head.weight.
"""
import math
import re

from .._status import BicoError, E_FORMAT, E_UNSUPPORTED

__all__ = ["check_config", "ROPE_TYPES"]

ROPE_TYPES = ("default", "linear", "llama3")


class _Cfg(object):
    """config.json's values, read with checks that name the file."""

    def __init__(self, raw, path):
        self.raw, self.path = raw, path

    def fail(self, key, why, status=E_FORMAT):
        raise BicoError(status, "load_model: %s: %s %s" % (self.path, key,
                                                           why))

    def int(self, key, default=None, required=False, minimum=1, src=None):
        """An integer >= minimum (not a bool, not 4.0); default when absent
        or null, unless required (True, or the reason it is needed)."""
        src, key = self._where(src, key)
        if key[1] not in src or src[key[1]] is None:
            if required:
                self.fail(key[0], "is missing (%s needs it)" % (
                    required if isinstance(required, str) else
                    "a %s decoder" % self.raw.get("model_type")))
            return default
        v = src[key[1]]
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key[0], "must be an integer, got %s" % _show(v))
        if v < minimum:
            self.fail(key[0], "must be at least %d, got %d" % (minimum, v))
        return v

    def number(self, key, default, src=None):
        """A finite number above 0 (or default when absent or null)."""
        src, key = self._where(src, key)
        if key[1] not in src or src[key[1]] is None:
            return default
        v = src[key[1]]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(key[0], "must be a number, got %s" % _show(v))
        v = float(v)
        if not (math.isfinite(v) and v > 0):
            self.fail(key[0], "must be a finite number above 0, got %r" % v)
        return v

    def _where(self, src, key):
        """(the object holding key, (its dotted name, key)): src is None
        for the top level, else (name of the nested object, object)."""
        if src is None:
            return self.raw, (key, key)
        return src[1], (src[0] + "." + key, key)

    def flag(self, key, default):
        v = self.raw.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.fail(key, "must be true or false, got %s" % _show(v))
        return v

    def text(self, key, default=None):
        v = self.raw.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            self.fail(key, "must be a string, got %s" % _show(v))
        return v


_JSON_TYPES = {dict: "an object", list: "an array", type(None): "null"}


def _show(v):
    s = _JSON_TYPES.get(type(v)) or repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _rope_scaling(c):
    rs = c.raw.get("rope_scaling")
    if rs is None:
        return None
    if not isinstance(rs, dict):
        c.fail("rope_scaling", "must be an object or null, got %s"
               % _show(rs))
    kind = rs.get("rope_type", rs.get("type"))
    if kind is not None and not isinstance(kind, str):
        c.fail("rope_scaling.rope_type", "must be a string, got %s"
               % _show(kind))
    if kind not in (None,) + ROPE_TYPES:
        c.fail("rope_scaling.rope_type", "%r is not supported (known: %s)"
               % (kind, ", ".join(ROPE_TYPES)), E_UNSUPPORTED)
    out = {"rope_type": kind or "default"}
    if kind in ("linear", "llama3"):
        if "factor" not in rs:
            c.fail("rope_scaling.factor", "is missing (rope type %s needs "
                   "it)" % kind)
        out["factor"] = c.number("factor", None, src=("rope_scaling", rs))
    if kind == "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            if k not in rs:
                c.fail("rope_scaling." + k, "is missing (rope type llama3 "
                       "needs it)")
            out[k] = c.number(k, None, src=("rope_scaling", rs))
        if not out["high_freq_factor"] > out["low_freq_factor"]:
            c.fail("rope_scaling.high_freq_factor", "must be above "
                   "low_freq_factor (%g), got %g" % (
                       out["low_freq_factor"], out["high_freq_factor"]))
        out["original_max_position_embeddings"] = c.int(
            "original_max_position_embeddings", required="rope type llama3",
            src=("rope_scaling", rs))
    return out


def _shape_text(s):
    return "[%s]" % ", ".join(str(x) for x in s)


def _layers_in(shapes):
    idx = set()
    for n in shapes:
        m = re.match(r"model\.layers\.(\d+)\.", n)
        if m:
            idx.add(int(m.group(1)))
    return idx


def _expect(shapes, weights, name, want, why):
    """Tensor name has shape want (when it is in the files; missing ones
    are named later, with the layer count)."""
    got = shapes.get(name)
    if got is not None and tuple(got) != tuple(want):
        raise BicoError(E_FORMAT, "load_model: %s: tensor %s is %s, but "
                        "config.json's %s make it %s" % (
                            weights, name, _shape_text(got), why,
                            _shape_text(want)))


def _heads(c, d, shapes):
    """(H, KV, hd), checked against each other and layer 0's projections
    before any of them sizes an allocation."""
    H = c.int("num_attention_heads", required=True)
    KV = c.int("num_key_value_heads", default=H)
    if H % KV:
        c.fail("num_key_value_heads", "(%d) must divide num_attention_heads "
               "(%d)" % (KV, H))
    hd = c.int("head_dim")
    if hd is None:
        if d % H:
            c.fail("num_attention_heads", "(%d) must divide hidden_size (%d) "
                   "when head_dim is not given" % (H, d))
        hd = d // H
    if hd % 2:
        c.fail("head_dim", "must be even (the rotary embedding turns pairs "
               "of dimensions), got %d" % hd)
    for p, n, key in (("q_proj", H, "num_attention_heads"),
                      ("k_proj", KV, "num_key_value_heads"),
                      ("v_proj", KV, "num_key_value_heads")):
        w = shapes.get("model.layers.0.self_attn.%s.weight" % p)
        if w is not None and len(w) == 2 and w[0] != n * hd:
            c.fail("head_dim" if c.raw.get("head_dim") is not None else key,
                   "disagrees with the tensors: model.layers.0.self_attn."
                   "%s.weight has %d rows, but %s (%d) x head_dim (%d) = %d"
                   % (p, w[0], key, n, hd, n * hd))
    return H, KV, hd


def _sizes(c, shapes, weights):
    """(d, V) from the embedding, agreeing with hidden_size and
    vocab_size."""
    emb = shapes.get("model.embed_tokens.weight")
    if emb is None:
        raise BicoError(E_FORMAT, "load_model: %s lacks tensor "
                        "model.embed_tokens.weight" % weights)
    if len(emb) != 2:
        raise BicoError(E_FORMAT, "load_model: %s: tensor model.embed_tokens."
                        "weight is %s, not a matrix" % (weights,
                                                        _shape_text(emb)))
    d = c.int("hidden_size", required=True)
    if d != emb[1]:
        c.fail("hidden_size", "(%d) disagrees with the embedding: model."
               "embed_tokens.weight is %s" % (d, _shape_text(emb)))
    V = c.int("vocab_size", default=emb[0])
    if V != emb[0]:
        c.fail("vocab_size", "(%d) disagrees with the embedding: model."
               "embed_tokens.weight is %s" % (V, _shape_text(emb)))
    return d, V


def _layer_shapes(shapes, weights, L, d, H, KV, hd, inter):
    for i in range(L):
        p = "model.layers.%d." % i
        at = p + "self_attn."
        for n, rows, why in (("q_proj", H * hd, "num_attention_heads x "
                              "head_dim"),
                             ("k_proj", KV * hd, "num_key_value_heads x "
                              "head_dim"),
                             ("v_proj", KV * hd, "num_key_value_heads x "
                              "head_dim")):
            _expect(shapes, weights, at + n + ".weight", (rows, d),
                    why + " and hidden_size")
            _expect(shapes, weights, at + n + ".bias", (rows,), why)
        _expect(shapes, weights, at + "o_proj.weight", (d, H * hd),
                "hidden_size and num_attention_heads x head_dim")
        _expect(shapes, weights, at + "o_proj.bias", (d,), "hidden_size")
        for n in ("input_layernorm", "post_attention_layernorm"):
            _expect(shapes, weights, p + n + ".weight", (d,), "hidden_size")
        m = p + "mlp."
        for n in ("gate_proj", "up_proj"):
            _expect(shapes, weights, m + n + ".weight", (inter, d),
                    "intermediate_size and hidden_size")
            _expect(shapes, weights, m + n + ".bias", (inter,),
                    "intermediate_size")
        _expect(shapes, weights, m + "down_proj.weight", (d, inter),
                "hidden_size and intermediate_size")
        _expect(shapes, weights, m + "down_proj.bias", (d,), "hidden_size")


def _window(c, mt):
    if not (mt == "mistral" or (mt == "qwen2" and
                                c.flag("use_sliding_window", False))):
        return None
    return c.int("sliding_window")


def check_config(raw, path, shapes, weights, acts):
    """The checked configuration of a decoder folder as load_model's cfg
    dict (H, KV, hd, L, eps, theta, rope_scaling, act, tied, window, d,
    V, max_pos).  raw: config.json's object; path: its file (named in
    every message); shapes: {tensor: shape} of the weights' headers;
    weights: the weights file named for a tensor's shape; acts: the
    activation names load_model knows."""
    if not isinstance(raw, dict):
        raise BicoError(E_FORMAT, "load_model: %s: must hold a JSON object, "
                        "got %s" % (path, _show(raw)))
    c = _Cfg(raw, path)
    mt = raw.get("model_type")
    gemma = mt == "gemma"
    d, V = _sizes(c, shapes, weights)
    H, KV, hd = _heads(c, d, shapes)
    L = c.int("num_hidden_layers", required=True)
    have = _layers_in(shapes)
    if have and max(have) >= L:
        c.fail("num_hidden_layers", "(%d) disagrees with the tensors: %s "
               "holds model.layers.%d" % (L, weights, max(have)))
    if len(have) < L:
        missing = min(set(range(L)) - have)
        c.fail("num_hidden_layers", "(%d) disagrees with the tensors: %s "
               "holds no model.layers.%d" % (L, weights, missing))
    gate = shapes.get("model.layers.0.mlp.gate_proj.weight")
    inter = c.int("intermediate_size",
                  default=gate[0] if gate is not None and len(gate) == 2
                  else None)
    if inter is None:
        raise BicoError(E_FORMAT, "load_model: %s lacks tensor model.layers."
                        "0.mlp.gate_proj.weight" % weights)
    if gate is not None and tuple(gate) != (inter, d):
        c.fail("intermediate_size", "(%d) disagrees with the tensors: "
               "model.layers.0.mlp.gate_proj.weight is %s" % (
                   inter, _shape_text(gate)))
    _layer_shapes(shapes, weights, L, d, H, KV, hd, inter)
    _expect(shapes, weights, "model.norm.weight", (d,), "hidden_size")
    act = c.text("hidden_activation") or c.text("hidden_act") or \
        ("gelu_pytorch_tanh" if gemma else "silu")
    if gemma and act == "gelu":
        act = "gelu_pytorch_tanh"  # transformers' Gemma does the same
    if act not in acts:
        c.fail("hidden_act", "%r is not supported (known: %s)"
               % (act, ", ".join(acts)), E_UNSUPPORTED)
    tie = c.flag("tie_word_embeddings", None)
    head = shapes.get("lm_head.weight")
    if tie is False and head is None:
        c.fail("tie_word_embeddings", "is false, but %s holds no "
               "lm_head.weight" % weights)
    tied = head is None or bool(gemma if tie is None else tie)
    if not tied:
        _expect(shapes, weights, "lm_head.weight", (V, d),
                "vocab_size and hidden_size")
    return dict(gemma=gemma, d=d, V=V, H=H, KV=KV, hd=hd, L=L,
                eps=c.number("rms_norm_eps", 1e-6),
                theta=c.number("rope_theta", 10000.0),
                rope_scaling=_rope_scaling(c), act=act, tied=tied,
                window=_window(c, mt),
                max_pos=c.int("max_position_embeddings"))

