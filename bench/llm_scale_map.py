"""One map, thin against full: bico_procrustes_solve_rows (thin when
n <= min(d_a, d_b)) against the accumulator (bico_xcov_add) and
bico_procrustes_solve on the same random rows; wall times and the
agreement of the identified parts (R C^T).  docs/performance.md, section 6.

Usage: BLIS_NUM_THREADS=1 llm_scale_map.py N D_A D_B [LIBBICO]
(LIBBICO defaults to build/lib/libbico.so.1.0.0)"""
import ctypes
import sys
import time

import numpy as np

n, da, db = (int(x) for x in sys.argv[1:4])
lib = ctypes.CDLL(sys.argv[4] if len(sys.argv) > 4 else "build/lib/libbico.so.1.0.0")
S = ctypes.c_size_t
P = lambda a: a.ctypes.data_as(ctypes.c_void_p)
ctx, p, xc = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
assert lib.bico_ctx_create(ctypes.byref(ctx)) == 0
assert lib.bico_procrustes_create(ctx, ctypes.byref(p)) == 0
g = np.random.default_rng(0)
xa = g.standard_normal((n, da), dtype=np.float32)
xb = g.standard_normal((n, db), dtype=np.float32)
r = np.empty((da, db), np.float32)
rank, thin = S(), ctypes.c_int()
t = time.time()
st = lib.bico_procrustes_solve_rows(p, S(n), S(da), S(db), P(xa), S(da), P(xb), S(db), P(r),
                                    S(db), ctypes.byref(rank), ctypes.byref(thin))
print(f"rows: status {st} thin {thin.value} rank {rank.value} {time.time() - t:.2f} s", flush=True)
t = time.time()
assert lib.bico_xcov_create(ctx, S(da), S(db), ctypes.c_uint(0), ctypes.byref(xc)) == 0
assert lib.bico_xcov_add(xc, S(n), P(xa), S(da), P(xb), S(db)) == 0
t1 = time.time()
r2 = np.empty((da, db), np.float32)
st = lib.bico_procrustes_solve(p, xc, P(r2), S(db), ctypes.byref(rank))
print(f"full: status {st} rank {rank.value} accumulate {t1 - t:.2f} s solve {time.time() - t1:.2f} s")
c = xa.astype(np.float64).T @ xb.astype(np.float64)
A, B = r.astype(np.float64) @ c.T, r2.astype(np.float64) @ c.T
print(f"identified parts (R C^T) agree to {np.linalg.norm(A - B) / np.linalg.norm(B):.1e}")
lib.bico_xcov_free(xc)
lib.bico_procrustes_free(p)
lib.bico_ctx_free(ctx)
