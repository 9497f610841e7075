"""The plain PyTorch twin of `bico transfer --method bico --stats` on the
checkpoints of bench/vit_synth.py: the same mathematics, written the way a
user would in a few lines of PyTorch.

For target block j (source block i(j) by the depth formula of bico(1)):
linear modules  tau_B = R_out^T tau R_in, bias R_out^T tau_b, with
R = U V^T from torch.linalg.svd of the float64 statistic; norms carried by
the map of their input statistic, R^T tau.  Output theta_B + tau_B, f32
safetensors.  Tensors are read through numpy.memmap (only what is in use is
resident).

Usage: transfer_torch.py A A_ft B S OUT [--threads T]"""
import argparse
import json
import warnings

import numpy as np
import torch

from vit_synth import src_block, write_st


def read_st(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, e in header.items():
        assert e["dtype"] == "F32", name
        b, t = e["data_offsets"]
        out[name] = mm[b:t].view("<f4").reshape(e["shape"])
    return out


def polar(c):
    u, _, vh = torch.linalg.svd(torch.from_numpy(np.asarray(c)).double(), full_matrices=False)
    return (u @ vh).float()


def main():
    ap = argparse.ArgumentParser()
    for f in ("a", "a_ft", "b", "s", "out"):
        ap.add_argument(f)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    # read-only memmaps are only ever read here
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    torch.set_num_threads(a.threads)
    A, Aft, B, S = read_st(a.a), read_st(a.a_ft), read_st(a.b), read_st(a.s)
    la = 1 + max(int(k.split(".")[1]) for k in A)
    lb = 1 + max(int(k.split(".")[1]) for k in B)
    out = []
    for j in range(lb):
        i = src_block(j, la, lb)
        maps = {}
        for key in sorted(k for k in S if k.startswith(f"blocks.{j}.")):
            maps[key[len(f"blocks.{j}."):]] = polar(S[key])
        for name in [k for k in B if k.startswith(f"blocks.{j}.")]:
            rest = name[len(f"blocks.{j}."):]
            mod, kind = rest.rsplit(".", 1)
            src = f"blocks.{i}.{rest}"
            tau = torch.from_numpy(np.asarray(Aft[src])) - torch.from_numpy(np.asarray(A[src]))
            if mod.startswith("norm"):
                upd = maps[mod + ".in_xcov"].T @ tau
            elif kind == "weight":
                upd = maps[mod + ".out_xcov"].T @ tau @ maps[mod + ".in_xcov"]
            else:
                upd = maps[mod + ".out_xcov"].T @ tau
            out.append((name, (torch.from_numpy(np.asarray(B[name])) + upd).numpy()))
    write_st(a.out, out)


if __name__ == "__main__":
    main()
