#!/usr/bin/env python3
"""Carrying N adapters from A to B with and without a bridge (issue 33,
docs/performance.md "Bridges").

Without a bridge every `bico transfer --lora` reads the calibration files
and solves every map the adapter needs; with one, `bico bridge` solves them
once and each transfer reads them.  Prints, for N = 1, 10, 100 adapters,
the wall time of both routes (the bridge's including its making) and
checks that both write the same adapter bytes.  A figure, not a test.

usage: bench/bridge_adapters.py [--bico build/bin/bico] [--n 1,10,100]
       [--width 128] [--blocks 4] [--rows 512] [--rank 8] [--threads 1]
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time

import numpy as np

MODULES = (("attn.q", 1, 1), ("attn.k", 1, 1), ("attn.v", 1, 1),
           ("attn.o", 1, 1), ("mlp.up", 4, 1), ("mlp.down", 1, 4))


def save(path, tensors):
    """A safetensors file of float32 tensors (the format, by hand)."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def model(g, width, blocks):
    return {"blocks.%d.%s.weight" % (b, m): g.standard_normal(
        (o * width, i * width)).astype(np.float32) / np.sqrt(i * width)
        for b in range(blocks) for m, o, i in MODULES}


def calib(g, width, blocks, rows):
    return {"blocks.%d.%s.%s" % (b, m, s): g.standard_normal(
        (rows, (i if s == "input" else o) * width)).astype(np.float32)
        for b in range(blocks) for m, o, i in MODULES
        for s in ("input", "output_grad")}


def adapter(folder, g, width, blocks, rank):
    os.makedirs(folder)
    t = {}
    for b in range(blocks):
        for m, o, i in MODULES:
            p = "base_model.model.blocks.%d.%s." % (b, m)
            t[p + "lora_A.weight"] = 0.01 * g.standard_normal((rank, i * width))
            t[p + "lora_B.weight"] = 0.01 * g.standard_normal((o * width, rank))
    save(os.path.join(folder, "adapter_model.safetensors"), t)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [m.split(".")[1] for m, _, _ in MODULES],
                   "bias": "none"}, f)


def run(bico, *args):
    subprocess.run([bico, *map(str, args), "-q"], check=True)


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--bico", default=os.path.join(here, "..", "build", "bin",
                                                   "bico"))
    ap.add_argument("--n", default="1,10,100")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    ns = [int(x) for x in a.n.split(",")]
    g = np.random.default_rng(0)
    d = tempfile.mkdtemp(prefix="bico-bridge-bench-")
    try:
        wa, wb = a.width, a.width + a.width // 2  # the target is wider
        save(os.path.join(d, "A.safetensors"), model(g, wa, a.blocks))
        save(os.path.join(d, "B.safetensors"), model(g, wb, 2 * a.blocks))
        save(os.path.join(d, "calA.safetensors"), calib(g, wa, a.blocks, a.rows))
        save(os.path.join(d, "calB.safetensors"),
             calib(g, wb, 2 * a.blocks, a.rows))
        for k in range(max(ns)):
            adapter(os.path.join(d, "ad%d" % k), g, wa, a.blocks, a.rank)
        base = ["--source-base", os.path.join(d, "A.safetensors"),
                "--target-base", os.path.join(d, "B.safetensors")]
        cal = ["--source-calib", os.path.join(d, "calA.safetensors"),
               "--target-calib", os.path.join(d, "calB.safetensors")]
        th = ["--threads", a.threads]
        print("# A: %d blocks of width %d; B: %d blocks of width %d; %d "
              "calibration rows; adapters of rank %d on %d modules"
              % (a.blocks, wa, 2 * a.blocks, wb, a.rows, a.rank,
                 len(MODULES) * a.blocks))
        print("%6s %12s %12s %12s %9s %s" % ("N", "direct (s)", "bridge (s)",
                                             "making (s)", "speed-up",
                                             "bytes equal"))
        for n in ns:
            t0 = time.perf_counter()
            for k in range(n):
                out = os.path.join(d, "direct%d" % k)
                shutil.rmtree(out, ignore_errors=True)
                run(a.bico, "transfer", "--method", "bico", *base, *cal, *th,
                    "--alpha", "1", "--lora", os.path.join(d, "ad%d" % k),
                    "--output-lora", out)
            direct = time.perf_counter() - t0
            t0 = time.perf_counter()
            br = os.path.join(d, "A_to_B.bridge")
            run(a.bico, "bridge", *base, *cal, *th, "--output", br)
            making = time.perf_counter() - t0
            for k in range(n):
                out = os.path.join(d, "bridged%d" % k)
                shutil.rmtree(out, ignore_errors=True)
                run(a.bico, "transfer", "--bridge", br, *base, *th,
                    "--alpha", "1", "--lora", os.path.join(d, "ad%d" % k),
                    "--output-lora", out)
            bridged = time.perf_counter() - t0
            same = all(open(os.path.join(d, "direct%d" % k, f), "rb").read()
                       == open(os.path.join(d, "bridged%d" % k, f), "rb").read()
                       for k in range(n) for f in ("adapter_model.safetensors",
                                                   "adapter_config.json"))
            print("%6d %12.2f %12.2f %12.2f %8.1fx %s"
                  % (n, direct, bridged, making, direct / bridged, same))
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
