"""The PyTorch twin of `bico transfer --method bico` on the Qwen2-shaped
folders of bench/llm_scale_gen.py: the same mathematics (maps per target
module from the calibration rows, thin solve when rows <= min width, full
SVD otherwise, BICO_NULL_KEEP's completions, depth map, routes: linear
weights R_out^T tau R_in, biases R_out^T tau, norm scales (R o R)^T tau by
their input map, the tied embedding's rows by the first block's
input_layernorm map; LoRA in factored form), written tensor by tensor.

Usage: llm_scale_torch.py --A DIR (--A-ft DIR | --lora DIR) --B DIR
           --calA F --calB F (--output F | --output-lora DIR) [--threads T]"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from llm_scale_gen import PROJ, write_st  # noqa: E402

TOL = 1e-5


class ST:
    """A safetensors file, tensors read on demand (memory-mapped)."""

    def __init__(self, path):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.h = json.loads(f.read(n))
        self.h.pop("__metadata__", None)
        self.base = 8 + n
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")

    def names(self):
        return list(self.h)

    def get(self, name, dtype=torch.float32):
        e = self.h[name]
        a, b = e["data_offsets"]
        raw = self.mm[self.base + a:self.base + b]
        if e["dtype"] == "F32":
            return torch.from_numpy(np.array(raw).view(np.float32)).reshape(e["shape"]).to(dtype)
        assert e["dtype"] == "BF16", e["dtype"]
        t = torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16)
        return t.reshape(e["shape"]).to(dtype)


def depth(j, la, lb):
    return 0 if lb == 1 else int(math.floor(j * (la - 1) / (lb - 1) + 0.5))


def thin_map(xa, xb, keep=True):
    """R = Q_a M Q_b^T from the rows (docs/methods.md, "Thin solves")."""
    n, da = xa.shape
    db = xb.shape[1]
    mn = min(da, db)
    qa, ta = torch.geqrf(xa.T.contiguous())
    qb, tb = torch.geqrf(xb.T.contiguous())
    core = qa[:n].triu() @ qb[:n].triu().T
    u, s, vh = torch.linalg.svd(core)
    k = int((s > TOL * s[0]).sum()) if s[0] > 0 else 0
    kk = n if keep else k
    m = torch.zeros(da, db, dtype=xa.dtype)
    m[:n, :n] = u[:, :kk] @ vh[:kk]
    if keep:
        idx = torch.arange(n, mn)
        m[idx, idx] = 1.0
    r = torch.ormqr(qa, ta, m, left=True, transpose=False)
    r = torch.ormqr(qb, tb, r.T.contiguous(), left=True, transpose=False).T
    return r


def full_map(xa, xb):
    c = xa.T @ xb
    u, s, vh = torch.linalg.svd(c, full_matrices=False)
    return u @ vh


class Maps:
    def __init__(self, calA, calB, la, lb):
        self.ca, self.cb, self.la, self.lb = calA, calB, la, lb
        self.cache = {}
        self.thin = self.full = 0

    def get(self, tmod, side):
        key = (tmod, side)
        if key not in self.cache:
            smod = tmod
            if tmod.startswith("model.layers."):
                parts = tmod.split(".")
                parts[2] = str(depth(int(parts[2]), self.la, self.lb))
                smod = ".".join(parts)
            suf = ".output_grad" if side else ".input"
            xa = self.ca.get(smod + suf, torch.float64)
            xb = self.cb.get(tmod + suf, torch.float64)
            if xa.shape[0] <= min(xa.shape[1], xb.shape[1]):
                r = thin_map(xa, xb)
                self.thin += 1
            else:
                r = full_map(xa, xb)
                self.full += 1
            self.cache[key] = r.to(torch.float32)
        return self.cache[key]

    def drop_layer_except(self, prefix):
        for k in [k for k in self.cache if not k[0].startswith(prefix)]:
            del self.cache[k]


def layer_prefix(name):
    parts = name.split(".")
    return ".".join(parts[:3]) + "." if name.startswith("model.layers.") else name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--A", required=True)
    ap.add_argument("--A-ft")
    ap.add_argument("--lora")
    ap.add_argument("--B", required=True)
    ap.add_argument("--calA", required=True)
    ap.add_argument("--calB", required=True)
    ap.add_argument("--output")
    ap.add_argument("--output-lora")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = lambda d: json.load(open(os.path.join(d, "config.json")))
    ca, cb = cfg(a.A), cfg(a.B)
    la, lb = ca["num_hidden_layers"], cb["num_hidden_layers"]
    maps = Maps(ST(a.calA), ST(a.calB), la, lb)
    B = ST(os.path.join(a.B, "model.safetensors"))
    src = lambda name: name if not name.startswith("model.layers.") else \
        ".".join([*name.split(".")[:2], str(depth(int(name.split(".")[2]), la, lb)),
                  *name.split(".")[3:]])

    if a.lora:
        L = ST(os.path.join(a.lora, "adapter_model.safetensors"))
        specs = []
        for j in range(lb):
            for q in PROJ:
                mod = f"model.layers.{j}.{q}"
                dout, din = B.h[mod + ".weight"]["shape"]
                r = L.h["base_model.model." + src(mod) + ".lora_A.weight"]["shape"][0]
                base = f"base_model.model.{mod}"
                specs.append((base + ".lora_A.weight", (r, din)))
                specs.append((base + ".lora_B.weight", (dout, r)))

        def make(name, shape):
            mod = name[len("base_model.model."):].rsplit(".lora_", 1)[0]
            maps.drop_layer_except(layer_prefix(mod))
            t = L.get("base_model.model." + src(mod) + name[len("base_model.model.") + len(mod):])
            if ".lora_A." in name:
                return t @ maps.get(mod, 0)
            return maps.get(mod, 1).T @ t

        os.makedirs(a.output_lora, exist_ok=True)
        # F32, as bico writes a carried adapter.
        write_st(os.path.join(a.output_lora, "adapter_model.safetensors"), specs, make,
                 dtype="F32")
        conf = json.load(open(os.path.join(a.lora, "adapter_config.json")))
        with open(os.path.join(a.output_lora, "adapter_config.json"), "w") as f:
            json.dump(conf, f, indent=2)
    else:
        A = ST(os.path.join(a.A, "model.safetensors"))
        Aft = ST(os.path.join(a.A_ft, "model.safetensors"))

        def make(name, shape):
            maps.drop_layer_except(layer_prefix(name))
            s = src(name)
            tau = Aft.get(s) - A.get(s)
            mod = name.rsplit(".", 1)[0]
            if name == "model.embed_tokens.weight":
                upd = tau @ maps.get("model.layers.0.input_layernorm", 0)
            elif name.endswith("norm.weight"):
                r = maps.get(mod, 0)
                upd = (r * r).T @ tau
            elif name.endswith(".bias"):
                upd = maps.get(mod, 1).T @ tau
            else:
                upd = maps.get(mod, 1).T @ tau @ maps.get(mod, 0)
            return B.get(name) + upd

        specs = [(n, tuple(B.h[n]["shape"])) for n in B.names()]
        write_st(a.output, specs, make)
    print(f"RESULT thin={maps.thin} full={maps.full}")


if __name__ == "__main__":
    main()
