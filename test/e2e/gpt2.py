"""A GPT-2 in PyTorch with Hugging Face's tensor names, Conv1D layout and
config.json, and the symmetries of that architecture, for planted tests.

Independent of libbico.  The mathematics follow HF's GPT2LMHeadModel:
learned token (wte) and position (wpe) embeddings summed into the residual
stream, pre-LayerNorm blocks (ln_1, attention, ln_2, MLP with GELU), a
final ln_f and an output head tied to wte (absent from the file, as HF
writes it).  Conv1D weights are stored [in, out] (y = x W + b), and
attn.c_attn fuses q, k, v along its output.

`symmetry()` draws a change of coordinates under which the network
computes the same function, built only from true symmetries:
- the residual stream: a permutation P.  LayerNorm subtracts the mean and
  scales coordinate-wise, so only maps that fix the all-ones vector and
  commute with every diagonal scale qualify: permutations (no signs);
- attention: a permutation of the heads, with per head one orthogonal map
  shared by the query and the key head (scores q.k unchanged; GPT-2 has no
  rotary embedding to commute with) and one orthogonal map of the value
  head, undone by c_proj's input;
- the MLP: a permutation of the intermediate units (GELU is element-wise).
`transform(cfg, sd, sym)` applies it to a state dict or a task vector (the
maps are linear).  prefix "transformer." is HF's save_pretrained layout;
"" is the layout of the original hub checkpoints."""
import math

import torch


def default_config(**kw):
    cfg = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"],
               vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_inner=None,
               n_positions=32, layer_norm_epsilon=1e-5,
               activation_function="gelu_new", tie_word_embeddings=True)
    cfg.update(kw)
    return cfg


def inner(cfg):
    return cfg["n_inner"] or 4 * cfg["n_embd"]


def param_shapes(cfg, prefix="transformer."):
    d, f, V = cfg["n_embd"], inner(cfg), cfg["vocab_size"]
    out = {prefix + "wte.weight": (V, d), prefix + "wpe.weight": (cfg["n_positions"], d)}
    for i in range(cfg["n_layer"]):
        p = f"{prefix}h.{i}."
        out[p + "ln_1.weight"] = (d,)
        out[p + "ln_1.bias"] = (d,)
        out[p + "attn.c_attn.weight"] = (d, 3 * d)   # Conv1D: [in, out]
        out[p + "attn.c_attn.bias"] = (3 * d,)
        out[p + "attn.c_proj.weight"] = (d, d)
        out[p + "attn.c_proj.bias"] = (d,)
        out[p + "ln_2.weight"] = (d,)
        out[p + "ln_2.bias"] = (d,)
        out[p + "mlp.c_fc.weight"] = (d, f)
        out[p + "mlp.c_fc.bias"] = (f,)
        out[p + "mlp.c_proj.weight"] = (f, d)
        out[p + "mlp.c_proj.bias"] = (d,)
    out[prefix + "ln_f.weight"] = (d,)
    out[prefix + "ln_f.bias"] = (d,)
    return out


def random_state(cfg, gen, prefix="transformer.", dtype=torch.float64):
    sd = {}
    for k, s in param_shapes(cfg, prefix).items():
        if len(s) == 1 and ".ln_" in "." + k and k.endswith(".weight"):
            sd[k] = 1.0 + 0.3 * torch.randn(s, generator=gen, dtype=dtype)
        elif len(s) == 1:
            sd[k] = 0.3 * torch.randn(s, generator=gen, dtype=dtype)
        else:
            sd[k] = torch.randn(s, generator=gen, dtype=dtype) / math.sqrt(s[0])
    return sd


def _prefix(sd):
    return "transformer." if "transformer.wte.weight" in sd else ""


def layer_norm(x, g, b, eps):
    m = x.mean(-1, keepdim=True)
    v = (x - m).pow(2).mean(-1, keepdim=True)
    return (x - m) / torch.sqrt(v + eps) * g + b


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def forward(cfg, sd, ids, rec=None):
    """Logits [batch, seq, vocab] of token ids [batch, seq] (causal).  With
    rec a dict, each Conv1D and LayerNorm module's input rows go under
    "<module>.input" and its output (retaining its gradient) under
    "<module>.output"."""
    P = _prefix(sd)
    d, H, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    hd = d // H
    B, T = ids.shape
    h = sd[P + "wte.weight"][ids] + sd[P + "wpe.weight"][:T][None]
    mask = torch.full((T, T), float("-inf"), dtype=h.dtype).triu(1)

    def keep(name, x, y):
        if rec is not None:
            rec[name + ".input"] = x.detach().reshape(-1, x.shape[-1])
            y.retain_grad()
            rec[name + ".output"] = y
        return y

    def conv1d(x, name):
        return keep(name, x, x @ sd[name + ".weight"] + sd[name + ".bias"])

    def ln(x, name):
        return keep(name, x, layer_norm(x, sd[name + ".weight"], sd[name + ".bias"], eps))

    for i in range(cfg["n_layer"]):
        p = f"{P}h.{i}."
        x = ln(h, p + "ln_1")
        qkv = conv1d(x, p + "attn.c_attn")
        q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in qkv.split(d, dim=-1))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        o = (att @ v).transpose(1, 2).reshape(B, T, d)
        h = h + conv1d(o, p + "attn.c_proj")
        x = ln(h, p + "ln_2")
        h = h + conv1d(gelu_new(conv1d(x, p + "mlp.c_fc")), p + "mlp.c_proj")
    h = ln(h, P + "ln_f")
    return h @ sd[P + "wte.weight"].T


def calibrate(cfg, sd, ids, z):
    """A calibration file's tensors (docs/formats.md): every module's input
    rows and the gradient of sum(logits * z) with respect to its output,
    float32 [rows, width]."""
    sd = {k: v.detach().clone().requires_grad_(True) for k, v in sd.items()}
    rec = {}
    (forward(cfg, sd, ids, rec) * z).sum().backward()
    out = {}
    for k in sorted(rec):
        if k.endswith(".input"):
            out[k] = rec[k].numpy().astype("float32")
        else:
            g = rec[k].grad
            out[k[:-len(".output")] + ".output_grad"] = \
                g.reshape(-1, g.shape[-1]).numpy().astype("float32")
    return out


def _perm(gen, n):
    P = torch.zeros(n, n, dtype=torch.float64)
    P[torch.arange(n), torch.randperm(n, generator=gen)] = 1.0
    return P


def _orth(gen, n):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def symmetry(cfg, gen):
    """Maps written new = M @ old for each space."""
    d, H, f = cfg["n_embd"], cfg["n_head"], inner(cfg)
    hd = d // H
    sym = {"P": _perm(gen, d), "layers": []}
    for _ in range(cfg["n_layer"]):
        hperm = torch.randperm(H, generator=gen)   # new head h <- old hperm[h]
        QK = torch.zeros(d, d, dtype=torch.float64)
        V = torch.zeros(d, d, dtype=torch.float64)
        for h in range(H):
            o = int(hperm[h])
            QK[h * hd:(h + 1) * hd, o * hd:(o + 1) * hd] = _orth(gen, hd)
            V[h * hd:(h + 1) * hd, o * hd:(o + 1) * hd] = _orth(gen, hd)
        sym["layers"].append(dict(QK=QK, V=V, F=_perm(gen, f)))
    return sym


def transform(cfg, sd, sym):
    """The state dict (or task vector) in the new coordinates.  A Conv1D
    weight W [in, out] with maps M_in, M_out becomes M_in W M_out^T."""
    P = sym["P"]
    out = {}
    for name, t in sd.items():
        t = t.to(torch.float64)
        parts = name.split(".")
        if parts[-2] in ("wte", "wpe"):
            out[name] = t @ P.T
            continue
        if parts[-2] == "ln_f" or parts[-2] in ("ln_1", "ln_2"):
            out[name] = P @ t
            continue
        i = int(parts[parts.index("h") + 1])
        L = sym["layers"][i]
        w = parts[-1] == "weight"
        mod = ".".join(parts[-3:-1])
        if mod == "attn.c_attn":
            Q3 = torch.block_diag(L["QK"], L["QK"], L["V"])
            out[name] = P @ t @ Q3.T if w else Q3 @ t
        elif mod == "attn.c_proj":
            out[name] = L["V"] @ t @ P.T if w else P @ t
        elif mod == "mlp.c_fc":
            out[name] = P @ t @ L["F"].T if w else L["F"] @ t
        elif mod == "mlp.c_proj":
            out[name] = L["F"] @ t @ P.T if w else P @ t
        else:
            raise KeyError(name)
    return out


def write_folder(path, cfg, sd, dtype=torch.float32, config=True):
    """A Hugging Face model folder (planted.write_folder)."""
    import planted as pl
    pl.write_folder(path, cfg, sd, dtype, config)
