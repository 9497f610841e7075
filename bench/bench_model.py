"""Whole-model benchmark: `bico transfer --method bico --stats` against the
plain PyTorch twin (bench/transfer_torch.py) on synthetic ViT-shaped
checkpoints (bench/vit_synth.py), each under /usr/bin/time -v: wall time,
peak resident memory, and the largest difference between their outputs.

Runs (full depth by default):
  3. ViT-B/16 (12 blocks, 768, MLP 3072) -> ViT-B/16-plus-like (12 blocks,
     896, MLP 3584), --threads T, libbico and the PyTorch twin;
  4. scaling, libbico alone: the same with --threads 1, and the target
     widened and deepened to ViT-L/14 shapes (twice the source's depth,
     1024, MLP 4096) with --threads T; at a third of the depth (4 -> 4 and
     4 -> 8 blocks) unless --full (12 -> 12 and 12 -> 24).
--blocks N runs N source and N target blocks (scaling rows N/3) instead.

Usage: bench_model.py --bin DIR [--threads T] [--blocks N] [--quick]
                      [--full] [--keep DIR]"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchdata  # noqa: E402
from transfer_torch import read_st  # noqa: E402

PY = "/usr/bin/python3"


def timed(cmd, env):
    secs, rss, _ = benchdata.timed_run(cmd, env, "bench_model.py")
    return secs, rss


def max_diff(x, y):
    a, b = read_st(x), read_st(y)
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full", action="store_true", help="the scaling rows at full depth")
    ap.add_argument("--keep", default=None, help="keep the generated files in this directory")
    a = ap.parse_args()
    bico = os.path.join(os.path.dirname(os.path.abspath(a.bin)), "bin", "bico")
    if not os.path.exists(bico):
        print(f"# whole-model benchmark skipped: {bico} not built")
        return
    ap_threads = max(1, a.threads)
    nb = a.blocks
    # The scaling rows run a third of the depth unless --full: at full depth
    # they take 6 minutes more than the 15 of make bench (docs/performance.md
    # has both).  Per-block cost does not depend on depth (blocks are
    # independent), so the short rows still show the growth.
    sb = nb if a.full else max(1, nb // 3)
    # (name, d_a, mlp_a, blocks_a, d_b, mlp_b, blocks_b, threads, with torch)
    configs = [("B/16 -> B/16+", 768, 3072, nb, 896, 3584, nb, ap_threads, True),
               ("B/16 -> B/16+", 768, 3072, sb, 896, 3584, sb, 1, False),
               ("B/16 -> L/14", 768, 3072, sb, 1024, 4096, 2 * sb, ap_threads, False)]
    if ap_threads == 1:
        configs[1] = configs[1][:7] + (2, False)
    if a.quick:
        configs = [(n, da // 8, ma // 8, la, db // 8, mb // 8, lb, t, True)
                   for n, da, ma, la, db, mb, lb, t, _ in configs]
    print("## 3./4. Whole model: bico transfer --method bico --stats vs the PyTorch twin")
    print("# synthetic f32 checkpoints (blocks: norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2);")
    print("# wall s and peak RSS from /usr/bin/time -v; diff = max |out_bico - out_torch| over all tensors;")
    print("# B size = the target checkpoint's bytes on disk")
    cols = ("config", "blocks", "thr", "bico s", "bico MB", "torch s", "torch MB", "speedup",
            "B MB", "RSS/B", "diff")
    widths = (14, 7, 3, 8, 8, 8, 8, 7, 7, 6, 8)
    print(" ".join(c.rjust(w) for c, w in zip(cols, widths)), flush=True)
    root = a.keep or tempfile.mkdtemp(prefix="bico-bench-")
    try:
        made = {}
        for name, da, ma, la, db, mb, lb, thr, torch in configs:
            d = os.path.join(root, f"{da}-{ma}-{la}-{db}-{mb}-{lb}")
            if d not in made:
                if not os.path.exists(os.path.join(d, "S.safetensors")):
                    subprocess.run([PY, os.path.join(HERE, "vit_synth.py"), d, "--src-width", str(da),
                                    "--src-mlp", str(ma), "--src-blocks", str(la),
                                    "--dst-width", str(db), "--dst-mlp", str(mb),
                                    "--dst-blocks", str(lb)], check=True)
                made[d] = True
            f = {k: os.path.join(d, k + ".safetensors") for k in ("A", "A_ft", "B", "S")}
            env = dict(os.environ)
            env["BLIS_NUM_THREADS"] = str(thr)
            env["OMP_NUM_THREADS"] = str(thr)
            out_c, out_t = os.path.join(d, "out_bico.safetensors"), os.path.join(d, "out_torch.safetensors")
            tc, mc = timed([bico, "transfer", "--method", "bico", "--source-base", f["A"],
                            "--source-tuned", f["A_ft"], "--target-base", f["B"], "--stats", f["S"],
                            "--threads", str(thr), "--quiet", "--output", out_c], env)
            size_b = os.path.getsize(f["B"]) / 2**20
            if torch:
                tt, mt = timed([PY, os.path.join(HERE, "transfer_torch.py"), f["A"], f["A_ft"], f["B"],
                                f["S"], out_t, "--threads", str(thr)], env)
                diff = max_diff(out_c, out_t)
                os.remove(out_t)
                tv = (f"{tt:.1f}", f"{mt:.0f}", f"{tt / tc:.2f}x")
            else:
                diff, tv = None, ("-", "-", "-")
            vals = ((name, f"{la}->{lb}", str(thr), f"{tc:.1f}", f"{mc:.0f}") + tv
                    + (f"{size_b:.0f}", f"{mc / size_b:.2f}", "-" if diff is None else f"{diff:.1e}"))
            print(" ".join(v.rjust(w) for v, w in zip(vals, widths)), flush=True)
            os.remove(out_c)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("# RSS/B = bico's peak RSS over the target checkpoint's size (target <= 1.5); '-' = twin not run")
    print("# scaling rows: libbico alone, at a third of the depth unless --full; blocks = source -> target depth")
    print()


if __name__ == "__main__":
    main()
