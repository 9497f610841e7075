"""PyTorch/NumPy twin of bench_xcov.c: C = X_a^T X_b on the same data.

Columns: torch float32 matmul, torch float64 (convert, then matmul: the
exact-products path), numpy float32 matmul; each with its relative error
against a float64 matmul over the rows in reverse order (as in the C
program).  Usage: xcov_torch.py [--reps R] [--threads T] [--rows N]
[--big-rows N] [--machine]"""
import argparse
import os
import statistics
import time

import numpy as np
import torch

import benchdata


def timed(fn, reps):
    ts, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def rel(x, ref):
    x = torch.as_tensor(x).double()
    return float(torch.linalg.norm(x - ref) / torch.linalg.norm(ref))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--big-rows", type=int, default=0)
    ap.add_argument("--machine", action="store_true")
    ap.add_argument("--only", default=None, help="AxB: that shape alone")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    big = a.big_rows or a.rows
    benchdata.header("statistics accumulation twin (PyTorch, NumPy)", a.threads)
    print(f"# median of {a.reps} runs")
    print(f"{'d_a x d_b':<10} {'rows':>6} | {'torch32 s':>9} {'GF/s':>7} {'error':>9} | "
          f"{'torch64 s':>9} {'GF/s':>7} {'error':>9} | {'numpy32 s':>9} {'GF/s':>7} {'error':>9}")
    results = []
    for n, da, db in [(a.rows, 768, 768), (a.rows, 768, 1024), (big, 3072, 4096)]:
        if a.only and a.only != f"{da}x{db}":
            continue
        xa = torch.from_numpy(benchdata.fill_rows(n, da, 11))
        xb = torch.from_numpy(benchdata.fill_rows(n, db, 22))
        ref = torch.flip(xa, [0]).double().T @ torch.flip(xb, [0]).double()
        t32, c32 = timed(lambda: xa.T @ xb, a.reps)
        t64, c64 = timed(lambda: xa.double().T @ xb.double(), a.reps)
        na, nb = xa.numpy(), xb.numpy()
        tnp, cnp = timed(lambda: na.T @ nb, a.reps)
        gf = 2.0 * n * da * db * 1e-9
        e32, e64, enp = rel(c32, ref), rel(c64, ref), rel(cnp, ref)
        print(f"{f'{da}x{db}':<10} {n:>6} | {t32:>9.3f} {gf / t32:>7.1f} {e32:>9.2e} | "
              f"{t64:>9.3f} {gf / t64:>7.1f} {e64:>9.2e} | {tnp:>9.3f} {gf / tnp:>7.1f} {enp:>9.2e}",
              flush=True)
        results.append(f"RESULT d_a={da} d_b={db} rows={n} torch32_s={t32:.6g} torch32_err={e32:.4g} "
                       f"torch64_s={t64:.6g} torch64_err={e64:.4g} numpy32_s={tnp:.6g} numpy32_err={enp:.4g}")
        del xa, xb, ref, c32, c64, cnp, na, nb
    if a.machine:
        print("\n".join(results))


if __name__ == "__main__":
    main()
