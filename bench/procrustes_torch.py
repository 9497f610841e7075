"""PyTorch/NumPy twin of bench_procrustes.c: R = U V^T of the same C.

torch.linalg.svd(C, full_matrices=False) then U @ Vh, in float64 (what
libbico computes) and float32; numpy.linalg.svd likewise in float64 (both
libraries call LAPACK's gesdd; NumPy only up to --numpy-max-d).  With
--compare DIR, max |R - R_bico| against the R files bench_procrustes
--dump wrote.  Usage: procrustes_torch.py [--reps R] [--big-reps R]
[--threads T] [--max-d D] [--numpy-max-d D] [--compare DIR] [--machine]"""
import argparse
import os
import statistics
import time

import numpy as np
import torch

import benchdata

SIZES = [(768, 768), (1024, 1024), (768, 1024), (3072, 3072), (3072, 4096), (4096, 4096)]


def timed(fn, reps):
    ts, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def orth(r):
    r = torch.as_tensor(r).double()
    g = r @ r.T if r.shape[0] <= r.shape[1] else r.T @ r
    return float(torch.linalg.norm(g - torch.eye(g.shape[0], dtype=torch.float64)))


def polar_torch(c):
    u, _, vh = torch.linalg.svd(c, full_matrices=False)
    return u @ vh


def polar_numpy(c):
    u, _, vh = np.linalg.svd(c, full_matrices=False)
    return u @ vh


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--big-reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-d", type=int, default=4096)
    ap.add_argument("--numpy-max-d", type=int, default=1024)
    ap.add_argument("--f32-max-d", type=int, default=4096)
    ap.add_argument("--compare", default=None)
    ap.add_argument("--machine", action="store_true")
    ap.add_argument("--only", default=None, help="AxB: that shape alone")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    benchdata.header("Procrustes twin (PyTorch, NumPy)", a.threads)
    print(f"# median of {a.reps} runs ({a.big_reps} for d >= 3072); orth = ||R R^T - I||_F; "
          "diff = max |R - R_bico|")
    print(f"{'d_a x d_b':<10} | {'torch64 s':>9} {'orth':>9} {'diff':>9} | {'torch32 s':>9} {'orth':>9} "
          f"{'diff':>9} | {'numpy64 s':>9} {'orth':>9}")
    results = []
    for da, db in SIZES:
        if max(da, db) > a.max_d or (a.only and a.only != f"{da}x{db}"):
            continue
        reps = a.big_reps if max(da, db) >= 3072 else a.reps
        c64 = torch.from_numpy(benchdata.uniform(33, 0, da * db).astype(np.float64).reshape(da, db))
        c32 = c64.float()
        t64, r64 = timed(lambda: polar_torch(c64), reps)
        if max(da, db) <= a.f32_max_d:
            t32, r32 = timed(lambda: polar_torch(c32), reps)
        else:
            t32, r32 = float("nan"), None
        rb = None
        if a.compare:
            path = os.path.join(a.compare, f"R_{da}x{db}.f32")
            if os.path.exists(path):
                rb = torch.from_numpy(np.fromfile(path, dtype=np.float32).reshape(da, db)).double()
        d64 = float((r64 - rb).abs().max()) if rb is not None else float("nan")
        d32 = float((r32.double() - rb).abs().max()) if rb is not None and r32 is not None else float("nan")
        o64 = orth(r64)
        o32 = orth(r32) if r32 is not None else float("nan")
        line = (f"{f'{da}x{db}':<10} | {t64:>9.3f} {o64:>9.2e} {d64:>9.2e} | {t32:>9.3f} {o32:>9.2e} "
                f"{d32:>9.2e} |")
        rec = (f"RESULT d_a={da} d_b={db} torch64_s={t64:.6g} torch64_orth={o64:.4g} torch64_diff={d64:.4g} "
               f"torch32_s={t32:.6g} torch32_orth={o32:.4g} torch32_diff={d32:.4g}")
        if max(da, db) <= a.numpy_max_d:
            cn = c64.numpy()
            tn, rn = timed(lambda: polar_numpy(cn), reps)
            on = orth(rn)
            line += f" {tn:>9.3f} {on:>9.2e}"
            rec += f" numpy64_s={tn:.6g} numpy64_orth={on:.4g}"
        else:
            line += f" {'-':>9} {'-':>9}"
        print(line, flush=True)
        results.append(rec)
    if a.machine:
        print("\n".join(results))


if __name__ == "__main__":
    main()
