"""A Llama-family decoder in PyTorch with Hugging Face's tensor names and
config.json, and the symmetries of that architecture, for planted tests.

Independent of libbico.  The model follows HF's LlamaForCausalLM
mathematics: RMSNorm (no mean), rotary position embeddings in the
half-split `rotate_half` layout, grouped-query attention
(`num_key_value_heads` <= `num_attention_heads`), SwiGLU MLP, optional
q/k/v biases (Qwen2), optional tied embedding (`tie_word_embeddings`: then
`lm_head.weight` is absent from the file, as HF writes it).  With
`model_type` "gemma" it follows GemmaForCausalLM instead: RMSNorm scales
stored as w for a scale of 1 + w, the embedding multiplied by
sqrt(hidden_size), GeGLU (tanh GELU) in place of SwiGLU.  The symmetries
below are the same: a signed permutation fixes the all-ones vector, so
1 + w moving as |P| g means w moves as |P| w.

`symmetry()` draws a change of coordinates under which the network computes
exactly the same function, built only from true symmetries:
- the residual stream: a signed permutation P (RMSNorm has no mean, so
  signs are allowed; its scale vectors move as operators, |P|^T g);
- attention: per key/value group, a map commuting with RoPE (a 2x2
  rotation per frequency pair, the same for the key head and every query
  head of the group) and a permutation of the query heads inside the
  group; a permutation of the groups themselves; per group an orthogonal
  map of the value space, undone by the output projection;
- the MLP: a permutation of the intermediate units (gate, up rows; down
  columns).
`transform(sd, sym)` applies it to a state dict (a model or a task vector:
the maps are linear)."""
import math
import os

import torch


def default_config(**kw):
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"],
               vocab_size=64, hidden_size=32, intermediate_size=48,
               num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=None, rms_norm_eps=1e-6,
               rope_theta=10000.0, tie_word_embeddings=True,
               attention_bias=False, max_position_embeddings=64)
    cfg.update(kw)
    if cfg["head_dim"] is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg


def rms_norm(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rope(x, theta):
    """x [batch, heads, seq, hd]: HF Llama's rotary embedding."""
    hd, seq = x.shape[-1], x.shape[-2]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1).to(x.dtype)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def param_shapes(cfg):
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    H, KV, V = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    out = {"model.embed_tokens.weight": (V, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "self_attn.q_proj.weight"] = (H * hd, d)
        out[p + "self_attn.k_proj.weight"] = (KV * hd, d)
        out[p + "self_attn.v_proj.weight"] = (KV * hd, d)
        if cfg["attention_bias"]:
            out[p + "self_attn.q_proj.bias"] = (H * hd,)
            out[p + "self_attn.k_proj.bias"] = (KV * hd,)
            out[p + "self_attn.v_proj.bias"] = (KV * hd,)
        out[p + "self_attn.o_proj.weight"] = (d, H * hd)
        out[p + "post_attention_layernorm.weight"] = (d,)
        out[p + "mlp.gate_proj.weight"] = (f, d)
        out[p + "mlp.up_proj.weight"] = (f, d)
        out[p + "mlp.down_proj.weight"] = (d, f)
    out["model.norm.weight"] = (d,)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, d)
    return out


def random_state(cfg, gen, dtype=torch.float64):
    sd = {}
    for k, s in param_shapes(cfg).items():
        if k.endswith("norm.weight") or k.endswith("layernorm.weight"):
            one = 0.0 if cfg["model_type"] == "gemma" else 1.0  # 1 + w
            sd[k] = one + 0.3 * torch.randn(s, generator=gen, dtype=dtype)
        elif len(s) == 1:
            sd[k] = 0.3 * torch.randn(s, generator=gen, dtype=dtype)
        else:
            sd[k] = torch.randn(s, generator=gen, dtype=dtype) / math.sqrt(s[-1])
    return sd


def forward(cfg, sd, ids, rec=None):
    """Logits [batch, seq, vocab] of token ids [batch, seq] (causal).  With
    rec a dict, each linear and norm module's input rows are stored under
    "<module>.input" and its output tensor (retaining its gradient) under
    "<module>.output" (see calibrate)."""
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    B, T = ids.shape
    gemma = cfg["model_type"] == "gemma"
    h = sd["model.embed_tokens.weight"][ids]
    if gemma:
        h = h * math.sqrt(d)
    mask = torch.full((T, T), float("-inf"), dtype=h.dtype).triu(1)

    def keep(name, x, y):
        if rec is not None:
            rec[name + ".input"] = x.detach().reshape(-1, x.shape[-1])
            y.retain_grad()
            rec[name + ".output"] = y
        return y

    def lin(x, name):
        y = x @ sd[name + ".weight"].T
        b = sd.get(name + ".bias")
        return keep(name, x, y if b is None else y + b)

    def norm(x, name):
        w = sd[name + ".weight"]
        return keep(name, x, rms_norm(x, 1.0 + w if gemma else w, eps))

    def act(x):
        if gemma:
            return torch.nn.functional.gelu(x, approximate="tanh")
        return torch.nn.functional.silu(x)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = norm(h, p + "input_layernorm")
        q = lin(x, p + "self_attn.q_proj").view(B, T, H, hd).transpose(1, 2)
        k = lin(x, p + "self_attn.k_proj").view(B, T, KV, hd).transpose(1, 2)
        v = lin(x, p + "self_attn.v_proj").view(B, T, KV, hd).transpose(1, 2)
        q, k = rope(q, theta), rope(k, theta)
        rep = H // KV
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        o = (att @ v).transpose(1, 2).reshape(B, T, H * hd)
        h = h + lin(o, p + "self_attn.o_proj")
        x = norm(h, p + "post_attention_layernorm")
        g = lin(x, p + "mlp.gate_proj")
        u = lin(x, p + "mlp.up_proj")
        h = h + lin(act(g) * u, p + "mlp.down_proj")
    h = norm(h, "model.norm")
    if "lm_head.weight" in sd:  # untied: a linear module of its own
        return lin(h, "lm_head")
    return h @ sd["model.embed_tokens.weight"].T


def calibrate(cfg, sd, ids, z):
    """A calibration file's tensors (docs/formats.md): every module's input
    rows and the gradient of the loss sum(logits * z) with respect to its
    output, as float32 [rows, width] arrays."""
    sd = {k: v.detach().clone().requires_grad_(True) for k, v in sd.items()}
    rec = {}
    logits = forward(cfg, sd, ids, rec)
    (logits * z).sum().backward()
    out = {}
    for k in sorted(rec):
        if k.endswith(".input"):
            out[k] = rec[k].numpy().astype("float32")
        else:
            g = rec[k].grad
            out[k[:-len(".output")] + ".output_grad"] = \
                g.reshape(-1, g.shape[-1]).numpy().astype("float32")
    return dict(sorted(out.items()))


def _signed_perm(gen, n):
    P = torch.zeros(n, n, dtype=torch.float64)
    idx = torch.randperm(n, generator=gen)
    s = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
    P[torch.arange(n), idx] = s
    return P


def _perm(gen, n):
    P = torch.zeros(n, n, dtype=torch.float64)
    P[torch.arange(n), torch.randperm(n, generator=gen)] = 1.0
    return P


def _rope_rotation(gen, hd):
    """An hd x hd map commuting with HF's rotary embedding: dims i and
    i + hd/2 form pair i; each pair gets its own 2x2 rotation."""
    half = hd // 2
    R = torch.zeros(hd, hd, dtype=torch.float64)
    for i in range(half):
        a = float(torch.rand(1, generator=gen, dtype=torch.float64)) * 2 * math.pi
        c, s = math.cos(a), math.sin(a)
        R[i, i], R[i, i + half] = c, -s
        R[i + half, i], R[i + half, i + half] = s, c
    return R


def _orth(gen, n):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def symmetry(cfg, gen):
    """Maps written as new = M @ old for each space (rows of a weight in
    that output space are mixed by M; columns reading it by M)."""
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rep = H // KV
    sym = {"P": _signed_perm(gen, d), "layers": []}
    for _ in range(cfg["num_hidden_layers"]):
        gperm = torch.randperm(KV, generator=gen)      # new group g <- old gperm[g]
        rot = [_rope_rotation(gen, hd) for _ in range(KV)]  # per new group
        vmap = [_orth(gen, hd) for _ in range(KV)]
        qperm = [torch.randperm(rep, generator=gen) for _ in range(KV)]
        Q = torch.zeros(H * hd, H * hd, dtype=torch.float64)
        K = torch.zeros(KV * hd, KV * hd, dtype=torch.float64)
        Vm = torch.zeros(KV * hd, KV * hd, dtype=torch.float64)
        O = torch.zeros(H * hd, H * hd, dtype=torch.float64)  # o_proj input space
        for g in range(KV):
            og = int(gperm[g])
            K[g * hd:(g + 1) * hd, og * hd:(og + 1) * hd] = rot[g]
            Vm[g * hd:(g + 1) * hd, og * hd:(og + 1) * hd] = vmap[g]
            for j in range(rep):
                nh, oh = g * rep + j, og * rep + int(qperm[g][j])
                Q[nh * hd:(nh + 1) * hd, oh * hd:(oh + 1) * hd] = rot[g]
                O[nh * hd:(nh + 1) * hd, oh * hd:(oh + 1) * hd] = vmap[g]
        sym["layers"].append(dict(Q=Q, K=K, V=Vm, O=O, F=_perm(gen, f)))
    return sym


def transform(cfg, sd, sym):
    """The state dict (or task vector) in the new coordinates."""
    P = sym["P"]
    absP = P.abs()
    out = {}
    for name, t in sd.items():
        t = t.to(torch.float64)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = t @ P.T
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = absP @ t
        else:
            i = int(name.split(".")[2])
            L = sym["layers"][i]
            w = name.endswith(".weight")
            if ".q_proj." in name:
                out[name] = L["Q"] @ t @ P.T if w else L["Q"] @ t
            elif ".k_proj." in name:
                out[name] = L["K"] @ t @ P.T if w else L["K"] @ t
            elif ".v_proj." in name:
                out[name] = L["V"] @ t @ P.T if w else L["V"] @ t
            elif ".o_proj." in name:
                out[name] = P @ t @ L["O"].T
            elif ".gate_proj." in name or ".up_proj." in name:
                out[name] = L["F"] @ t @ P.T
            elif ".down_proj." in name:
                out[name] = P @ t @ L["F"].T
            else:
                raise KeyError(name)
    return out


def write_folder(path, cfg, sd, dtype=torch.float32, config=True):
    """A Hugging Face model folder (planted.write_folder)."""
    import planted as pl
    pl.write_folder(path, cfg, sd, dtype, config)


def random_pair(d, gen, V, a=(16, 24, 3), b=(24, 40, 2), tied=False,
                batches=(6, 4, 17), scale=0.05):
    """Folders d/A, d/A_ft (A plus scale x noise in every tensor) and d/B
    of random Llama models (F32, GQA 4/2 heads, no biases; a and b:
    hidden size, MLP size, layers), and calibration batches of random
    ids (n batches x windows x tokens, as (ids, next ids) pairs)."""
    cfg = [default_config(vocab_size=V, hidden_size=h, intermediate_size=f,
                          num_hidden_layers=L, num_attention_heads=4,
                          num_key_value_heads=2, tie_word_embeddings=tied)
           for h, f, L in (a, b)]
    sa = random_state(cfg[0], gen)
    sft = {k: v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype)
           for k, v in sa.items()}
    for name, c, sd in (("A", cfg[0], sa), ("A_ft", cfg[0], sft),
                        ("B", cfg[1], random_state(cfg[1], gen))):
        write_folder(os.path.join(str(d), name), c, sd)
    ids = torch.randint(0, V, batches, generator=gen)
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in ids]
