"""LLM-scale benchmark: `bico transfer` from a Qwen2-0.5B-shaped source
(896 wide, 24 layers, MLP 4864, 14/2 heads of 64, vocabulary 151936, bf16)
to a Qwen2-1.5B-shaped target (1536, 28 layers, 8960, 12/2 heads of 128),
random weights in Hugging Face model folders, 2048 random calibration rows
per module (bench/llm_scale_gen.py), (a) a rank-16 LoRA adapter on q, k,
v, o, gate, up, down and (b) a full task vector, each side by side with
the PyTorch twin doing the same mathematics (bench/llm_scale_torch.py):
wall time and peak resident memory (/usr/bin/time -v), one run each,
beside the target checkpoint's size, and the difference of the outputs.

--quick runs a scaled-down pair (seconds; for development and
BENCH_FLAGS=--quick); --size layer keeps the full widths and vocabulary
at one layer per side (the per-layer cost and the embedding's memory;
what `make bench` runs unless --full, since the full depth takes hours
on a 2-core machine: docs/performance.md, section 6).  The full size writes about 12 GB of files
(models 5.2 GB, calibration 7 GB) under --work (default: a temporary
folder in $TMPDIR), removed afterwards unless --keep; a --work folder
is kept, and a later run with the same --work and size reuses its files.

Usage: llm_scale.py --bin DIR [--threads T] [--quick | --size S] [--work DIR]
                    [--keep] [--skip-twin | --skip-bico] [--cases lora,full]"""
import argparse
import os
import re
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchdata  # noqa: E402
import llm_scale_gen as gen  # noqa: E402
from llm_scale_torch import ST  # noqa: E402

PY = "/usr/bin/python3"


def timed(cmd, env):
    return benchdata.timed_run(cmd, env, "llm_scale.py")


def rel_diff(p, q, base=None):
    """||x - y|| / ||y - base|| over all tensors (base: the target, so that
    the difference is measured against the update, not the weights)."""
    a, b = ST(p), ST(q)
    assert sorted(a.names()) == sorted(b.names()), set(a.names()) ^ set(b.names())
    B = ST(base) if base else None
    num = den = 0.0
    for n in a.names():
        x, y = a.get(n, torch.float64), b.get(n, torch.float64)
        num += float(((x - y) ** 2).sum())
        if B is not None:
            y = y - B.get(n, torch.float64)
        den += float((y ** 2).sum())
    return (num / max(den, 1e-300)) ** 0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="the build's bench folder (bico is ../bin/bico)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", choices=sorted(gen.SIZES), default=None,
                    help="full (default), quick (= --quick), or layer: full widths and "
                         "vocabulary, one layer per side")
    ap.add_argument("--work", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--skip-twin", action="store_true")
    ap.add_argument("--cases", default="lora,full",
                    help="which cases, in this order (lora, full)")
    ap.add_argument("--skip-bico", action="store_true",
                    help="the twin alone (reads bico's outputs of an earlier run "
                         "with the same --work for the difference)")
    a = ap.parse_args()
    bico = os.path.join(os.path.dirname(os.path.abspath(a.bin)), "bin", "bico")
    if not os.path.exists(bico):
        print(f"# LLM-scale benchmark skipped: {bico} not built")
        return
    size = a.size or ("quick" if a.quick else "full")
    cfg = gen.SIZES[size]
    s, t = cfg["src"], cfg["tgt"]
    work = a.work or tempfile.mkdtemp(prefix="bico-llm-scale-")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["BLIS_NUM_THREADS"] = str(a.threads)
    try:
        print(f"## 6. LLM scale: Qwen2-shaped {s['d']} x {s['L']} (MLP {s['f']}) -> "
              f"{t['d']} x {t['L']} (MLP {t['f']}), vocab {t['V']}, bf16, "
              f"{cfg['rows']} calibration rows per module ({size})", flush=True)
        t0 = time.time()
        import json
        marker = os.path.join(work, f"sizes-{size}.json")
        if a.work and os.path.exists(marker):  # --work of an earlier run
            sizes = json.load(open(marker))
        else:
            sizes = gen.generate(work, size)
            json.dump(sizes, open(marker, "w"))
        mb = lambda b: b / 2 ** 20
        ckpt = mb(sizes["B"])
        print(f"# files: source {mb(sizes['A']):.0f} MB, target {ckpt:.0f} MB, adapter "
              f"{mb(sizes['lora']):.1f} MB, calibration {mb(sizes['calA']):.0f} + "
              f"{mb(sizes['calB']):.0f} MB; generated in {time.time() - t0:.0f} s", flush=True)
        W = lambda *p: os.path.join(work, *p)
        common = ["--source-base", W("A"), "--target-base", W("B"), "--source-calib",
                  W("calA.safetensors"), "--target-calib", W("calB.safetensors")]
        tcommon = ["--A", W("A"), "--B", W("B"), "--calA", W("calA.safetensors"),
                   "--calB", W("calB.safetensors"), "--threads", str(a.threads)]
        cols = ("case", "side", "wall s", "peak RSS MB", "target ckpt MB", "RSS/ckpt",
                "maps thin/full", "rel diff")
        widths = (10, 8, 8, 12, 15, 9, 15, 9)
        print(" ".join(c.rjust(w) for c, w in zip(cols, widths)), flush=True)
        cases = [("LoRA r16", ["--lora", W("lora"), "--output-lora", W("out_lora"),
                               "--report", W("rep_lora.json")],
                  ["--lora", W("lora"), "--output-lora", W("twin_lora")],
                  (W("out_lora", "adapter_model.safetensors"),
                   W("twin_lora", "adapter_model.safetensors"), None)),
                 ("full", ["--source-tuned", W("A_ft"), "--output", W("out.safetensors"),
                           "--report", W("rep.json")],
                  ["--A-ft", W("A_ft"), "--output", W("twin.safetensors")],
                  (W("out.safetensors"), W("twin.safetensors"),
                   W("B", "model.safetensors")))]
        keys = {"lora": cases[0], "full": cases[1]}
        for key in a.cases.split(","):
            if key not in keys:
                raise SystemExit(f"llm_scale.py: --cases: unknown case {key!r} (lora, full)")
        for name, bargs, targs, (ob, ot, base) in [keys[k] for k in a.cases.split(",")]:
            if not a.skip_bico:
                wall, rss, _ = timed([bico, "transfer", "--alpha", "1", "--method", "bico", "--quiet",
                                      "--threads", str(a.threads)] + common + bargs, env)
                rep = json.load(open(bargs[bargs.index("--report") + 1]))
                nthin = nfull = 0
                for e in rep.get("tensors", []) + rep.get("modules", []):
                    for m in e.get("maps", {}).values():
                        nthin += m.get("solve") == "thin"
                        nfull += m.get("solve") == "full"
                tf = f"{nthin}/{nfull} uses" if nthin + nfull else "-"
                vals = (name, "bico", f"{wall:.1f}", f"{rss:.0f}", f"{ckpt:.0f}",
                        f"{rss / ckpt:.2f}", tf, "")
                print(" ".join(v.rjust(w) for v, w in zip(vals, widths)), flush=True)
            if a.skip_twin:
                continue
            wall, rss, out = timed([PY, os.path.join(HERE, "llm_scale_torch.py")] + tcommon + targs, env)
            m = re.search(r"RESULT thin=(\d+) full=(\d+)", out)
            tf = f"{m.group(1)}/{m.group(2)} maps" if m else "-"
            d = rel_diff(ob, ot, base)
            vals = (name, "torch", f"{wall:.1f}", f"{rss:.0f}", f"{ckpt:.0f}", f"{rss / ckpt:.2f}", tf, f"{d:.1e}")
            print(" ".join(v.rjust(w) for v, w in zip(vals, widths)), flush=True)
        print("# one run each; peak RSS by /usr/bin/time -v; goal: bico's peak <= 1.5 x the target checkpoint")
        print("# maps thin/full: bico counts the report's map uses per tensor (a map serves several tensors),")
        print("# the twin counts maps solved; rel diff = ||bico - torch|| / ||torch update|| over all tensors")
        print("# (bf16 outputs: both round theta_B + update once, so ~1e-3 is the rounding floor)")
        print(flush=True)
    finally:
        if not a.keep and a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
