"""Planted models for the end-to-end tests of the `bico` command.

Everything here is independent of libbico: safetensors files are written and
read with json + struct + numpy, models and their calibration statistics are
computed with PyTorch in double precision, and the expected transfers are
derived from the planted symmetries, not from the code under test.
"""
import json
import math
import struct

import numpy as np
import torch

# ---------------------------------------------------------------- safetensors

_DT = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
       "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8}
_NAME = {np.dtype(v): k for k, v in _DT.items()}


def save(path, tensors, metadata=None):
    """Writes {name: ndarray} (insertion order) as a safetensors file."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NAME[arr.dtype], "shape": list(arr.shape),
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


def write_folder(path, cfg, sd, dtype=torch.float32, config=True):
    """A Hugging Face model folder: config.json (cfg; none when config is
    False) and model.safetensors (the state dict sd in dtype, with the
    {"format": "pt"} metadata that transformers writes)."""
    import os
    os.makedirs(path, exist_ok=True)
    if config:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    save(os.path.join(path, "model.safetensors"),
         {k: v.to(dtype).numpy() for k, v in sd.items()}, {"format": "pt"})


def load(path):
    """Reads a safetensors file into ({name: ndarray}, metadata, order)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode())
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        arr = np.frombuffer(raw[base + b:base + end],
                            dtype=np.dtype(_DT[e["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(e["shape"]).copy()
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    return out, meta, order


def to_numpy(sd, dtype=np.float32):
    return {k: v.detach().cpu().numpy().astype(dtype) for k, v in sd.items()}


# ---------------------------------------------------------------- the ViT

class Block(torch.nn.Module):
    def __init__(self, d, heads, hidden):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(d, eps=1e-6)
        self.attn = torch.nn.Module()
        self.attn.qkv = torch.nn.Linear(d, 3 * d)
        self.attn.proj = torch.nn.Linear(d, d)
        self.norm2 = torch.nn.LayerNorm(d, eps=1e-6)
        self.mlp = torch.nn.Module()
        self.mlp.fc1 = torch.nn.Linear(d, hidden)
        self.mlp.fc2 = torch.nn.Linear(hidden, d)

    def forward(self, h):
        s, t, d = h.shape
        dh = d // self.heads
        qkv = self.attn.qkv(self.norm1(h)).reshape(s, t, 3, self.heads, dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [s, heads, t, dh]
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)
        o = (a @ v).transpose(1, 2).reshape(s, t, d)
        h = h + self.attn.proj(o)
        return h + self.mlp.fc2(torch.nn.functional.gelu(self.mlp.fc1(self.norm2(h))))


class ViT(torch.nn.Module):
    """Pre-norm ViT on pre-flattened patches: x [samples, patches, p]."""

    def __init__(self, p=12, n=6, d=24, heads=3, hidden=48, depth=2, classes=5):
        super().__init__()
        self.patch_embed = torch.nn.Module()
        self.patch_embed.proj = torch.nn.Linear(p, d)
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, d))
        self.pos_embed = torch.nn.Parameter(torch.randn(1, n + 1, d))
        self.blocks = torch.nn.ModuleList(Block(d, heads, hidden) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(d, eps=1e-6)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x):
        t = self.patch_embed.proj(x)
        t = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), t], dim=1)
        h = t + self.pos_embed
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h[:, 0]))


def randomize(model, gen, scale=1.0):
    """Generic weights: random everywhere, norms and biases included, so that
    every calibration statistic has full rank."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") \
                    or name == "norm.weight":
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif p.dim() >= 2 and "token" not in name and "pos" not in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype)
                        / math.sqrt(p.shape[-1]))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def orth(gen, n):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def perm(gen, n):
    return torch.eye(n, dtype=torch.float64)[torch.randperm(n, generator=gen)]


def blockdiag(mats):
    return torch.block_diag(*mats)


def vit_symmetry(cfg, gen):
    """A function-preserving change of coordinates of the ViT: the residual
    stream permuted (P), each block's MLP units permuted, and inside each
    attention head the q/k space rotated (same Q for q and k keeps q.k) and
    the v space rotated (undone in proj)."""
    d, heads, hidden, depth = cfg["d"], cfg["heads"], cfg["hidden"], cfg["depth"]
    dh = d // heads
    return {
        "P": perm(gen, d),
        "blocks": [{
            "Qqk": blockdiag([orth(gen, dh) for _ in range(heads)]),
            "Qv": blockdiag([orth(gen, dh) for _ in range(heads)]),
            "Pi": perm(gen, hidden),
        } for _ in range(depth)],
    }


def vit_transform(sd, sym, depth):
    """Applies the symmetry to a state dict (weights or a task vector: the
    map is linear in the parameters, so tau transforms the same way)."""
    P = sym["P"]
    out = {}
    for k, v in sd.items():
        out[k] = v.clone()
    out["patch_embed.proj.weight"] = P @ sd["patch_embed.proj.weight"]
    out["patch_embed.proj.bias"] = P @ sd["patch_embed.proj.bias"]
    out["cls_token"] = sd["cls_token"] @ P.T
    out["pos_embed"] = sd["pos_embed"] @ P.T
    for i in range(depth):
        b, s = f"blocks.{i}.", sym["blocks"][i]
        Q, V, Pi = s["Qqk"], s["Qv"], s["Pi"]
        for n in ("norm1", "norm2"):
            out[b + n + ".weight"] = P @ sd[b + n + ".weight"]
            out[b + n + ".bias"] = P @ sd[b + n + ".bias"]
        W, bias = sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"]
        d = W.shape[1]
        L = blockdiag([Q, Q, V])
        out[b + "attn.qkv.weight"] = L @ W @ P.T
        out[b + "attn.qkv.bias"] = L @ bias
        out[b + "attn.proj.weight"] = P @ sd[b + "attn.proj.weight"] @ V.T
        out[b + "attn.proj.bias"] = P @ sd[b + "attn.proj.bias"]
        out[b + "mlp.fc1.weight"] = Pi @ sd[b + "mlp.fc1.weight"] @ P.T
        out[b + "mlp.fc1.bias"] = Pi @ sd[b + "mlp.fc1.bias"]
        out[b + "mlp.fc2.weight"] = P @ sd[b + "mlp.fc2.weight"] @ Pi.T
        out[b + "mlp.fc2.bias"] = P @ sd[b + "mlp.fc2.bias"]
        assert d == P.shape[0]
    out["norm.weight"] = P @ sd["norm.weight"]
    out["norm.bias"] = P @ sd["norm.bias"]
    out["head.weight"] = sd["head.weight"] @ P.T
    return out


# ---------------------------------------------------------------- calibration

def calibrate(model, x, loss_fn, modules=None):
    """The docs/formats.md recipe: forward hooks record each module's input,
    full backward hooks the gradient of the loss with respect to its output;
    rows are flattened to [rows, width].  Returns {key: float32 ndarray}."""
    rec = {}
    handles = []
    for name, m in model.named_modules():
        if not isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm)):
            continue
        if modules is not None and name not in modules:
            continue

        def fwd(mod, inp, out, name=name):
            rec[name + ".input"] = inp[0].detach().reshape(-1, inp[0].shape[-1])

        def bwd(mod, gin, gout, name=name):
            rec[name + ".output_grad"] = gout[0].detach().reshape(-1, gout[0].shape[-1])

        handles.append(m.register_forward_hook(fwd))
        handles.append(m.register_full_backward_hook(bwd))
    model.zero_grad()
    x = x.clone().requires_grad_(True)  # full backward hooks want a grad path
    loss = loss_fn(model(x))
    loss.backward()
    for h in handles:
        h.remove()
    return {k: v.cpu().numpy().astype(np.float32) for k, v in sorted(rec.items())}


# ---------------------------------------------------------------- the MLP

def mlp_widened(gen, d_a=12, d_b=16, h_a=24, h_b=32, c_a=6, c_b=8):
    """Source MLP y = W2 gelu(W1 x + b1) + b2 and a wider target that equals
    it on the source's subspace: inputs embedded by E (d_b x d_a, orthonormal
    columns: a rotation into a wider space), hidden units permuted and
    extended by extra units that are silent on E's range, outputs embedded by
    F (c_b x c_a).  Returns the weights, the maps and the tensor names."""
    f64 = torch.float64
    A = {
        "mlp.fc1.weight": torch.randn(h_a, d_a, generator=gen, dtype=f64) / math.sqrt(d_a),
        "mlp.fc1.bias": 0.5 * torch.randn(h_a, generator=gen, dtype=f64),
        "mlp.fc2.weight": torch.randn(c_a, h_a, generator=gen, dtype=f64) / math.sqrt(h_a),
        "mlp.fc2.bias": 0.5 * torch.randn(c_a, generator=gen, dtype=f64),
    }
    E = orth(gen, d_b)[:, :d_a]
    F = orth(gen, c_b)[:, :c_a]
    Pi = torch.zeros(h_b, h_a, dtype=f64)
    Pi[:h_a] = perm(gen, h_a)
    Pi = Pi[torch.randperm(h_b, generator=gen)]  # extra units interleaved
    extra = Pi.sum(1) == 0
    # Extra units read only the orthogonal complement of E (so they are zero
    # on A's subspace: gelu(0) = 0) and write nothing.
    comp = torch.eye(d_b, dtype=f64) - E @ E.T
    W1x = torch.randn(h_b, d_b, generator=gen, dtype=f64) @ comp
    B = {
        "mlp.fc1.weight": Pi @ A["mlp.fc1.weight"] @ E.T + W1x * extra[:, None],
        "mlp.fc1.bias": Pi @ A["mlp.fc1.bias"],
        "mlp.fc2.weight": F @ A["mlp.fc2.weight"] @ Pi.T,
        "mlp.fc2.bias": F @ A["mlp.fc2.bias"],
    }
    return A, B, {"E": E, "F": F, "Pi": Pi}


def mlp_forward(w, x):
    h = torch.nn.functional.gelu(x @ w["mlp.fc1.weight"].T + w["mlp.fc1.bias"])
    return h @ w["mlp.fc2.weight"].T + w["mlp.fc2.bias"], h


def mlp_calib(w, x, gy):
    """Calibration tensors of the MLP for given output gradients gy."""
    xx = x.clone().requires_grad_(True)
    pre = xx @ w["mlp.fc1.weight"].T + w["mlp.fc1.bias"]
    pre.retain_grad()
    h = torch.nn.functional.gelu(pre)
    h.retain_grad()
    y = h @ w["mlp.fc2.weight"].T + w["mlp.fc2.bias"]
    (y * gy).sum().backward()
    f = lambda t: t.detach().numpy().astype(np.float32)
    return {"mlp.fc1.input": f(x), "mlp.fc1.output_grad": f(pre.grad),
            "mlp.fc2.input": f(h), "mlp.fc2.output_grad": f(gy)}
