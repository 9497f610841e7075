"""Synthetic ViT-shaped checkpoints and statistics for the whole-model
benchmark (bench/bench_model.py).

Writes, as f32 safetensors (json + numpy, no safetensors package needed):
  A.safetensors, A_ft.safetensors  source, e.g. ViT-B/16 blocks (768, 3072)
  B.safetensors                    target, e.g. ViT-B/16-plus-like (896, 3584)
  S.safetensors                    statistics: M.in_xcov / M.out_xcov per
                                   target linear module, M.in_xcov per norm
Each block holds norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2 (the
transformer blocks that carry almost all of a ViT's parameters; the stem,
tokens and head are left out to keep the PyTorch twin's mathematics
short).  Statistics are generic full-rank random matrices: the benchmark
measures speed and agreement, not transfer quality.

Usage: vit_synth.py OUTDIR --src-width 768 --src-mlp 3072 --src-blocks 12
         --dst-width 896 --dst-mlp 3584 --dst-blocks 12 [--seed 1]"""
import argparse
import json
import os

import numpy as np


def write_st(path, tensors, meta=None):
    """tensors: list of (name, float32 array)."""
    header, off = {}, 0
    for name, a in tensors:
        n = a.size * 4
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + n]}
        off += n
    if meta:
        header["__metadata__"] = meta
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for _, a in tensors:
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())
    os.replace(tmp, path)


def block_shapes(d, mlp):
    return [("norm1.weight", (d,)), ("norm1.bias", (d,)),
            ("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
            ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)),
            ("norm2.weight", (d,)), ("norm2.bias", (d,)),
            ("mlp.fc1.weight", (mlp, d)), ("mlp.fc1.bias", (mlp,)),
            ("mlp.fc2.weight", (d, mlp)), ("mlp.fc2.bias", (d,))]


def model(rng, d, mlp, blocks, scale=0.02):
    out = []
    for b in range(blocks):
        for name, shape in block_shapes(d, mlp):
            if name.startswith("norm") and name.endswith("weight"):
                a = (1.0 + scale * rng.standard_normal(shape, dtype=np.float32))
            else:
                a = scale * rng.standard_normal(shape, dtype=np.float32)
            out.append((f"blocks.{b}.{name}", a.astype(np.float32)))
    return out


def src_block(j, la, lb):
    """The depth formula of bico(1): round half up of j (L_A - 1) / (L_B - 1)."""
    if lb == 1:
        return 0
    num = j * (la - 1)
    return (2 * num + (lb - 1)) // (2 * (lb - 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--src-width", type=int, default=768)
    ap.add_argument("--src-mlp", type=int, default=3072)
    ap.add_argument("--src-blocks", type=int, default=12)
    ap.add_argument("--dst-width", type=int, default=896)
    ap.add_argument("--dst-mlp", type=int, default=3584)
    ap.add_argument("--dst-blocks", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    src = model(rng, a.src_width, a.src_mlp, a.src_blocks)
    write_st(os.path.join(a.outdir, "A.safetensors"), src)
    write_st(os.path.join(a.outdir, "A_ft.safetensors"),
             [(n, t + 0.01 * rng.standard_normal(t.shape, dtype=np.float32)) for n, t in src])
    del src
    write_st(os.path.join(a.outdir, "B.safetensors"),
             model(rng, a.dst_width, a.dst_mlp, a.dst_blocks))
    da, ma, db, mb = a.src_width, a.src_mlp, a.dst_width, a.dst_mlp
    dims = {"attn.qkv": ((da, db), (3 * da, 3 * db)), "attn.proj": ((da, db), (da, db)),
            "mlp.fc1": ((da, db), (ma, mb)), "mlp.fc2": ((ma, mb), (da, db))}
    stats = []
    for j in range(a.dst_blocks):
        for norm in ("norm1", "norm2"):
            stats.append((f"blocks.{j}.{norm}.in_xcov",
                          rng.standard_normal((da, db), dtype=np.float32)))
        for mod, (din, dout) in dims.items():
            stats.append((f"blocks.{j}.{mod}.in_xcov", rng.standard_normal(din, dtype=np.float32)))
            stats.append((f"blocks.{j}.{mod}.out_xcov", rng.standard_normal(dout, dtype=np.float32)))
    write_st(os.path.join(a.outdir, "S.safetensors"), stats, {"format": "bico-stats"})


if __name__ == "__main__":
    main()
