"""The benchmarks' deterministic data, bit-identical to bench/common.h.

splitmix64 of (seed, index), vectorised in numpy's wrapping uint64
arithmetic, so the C programs and their PyTorch/NumPy twins work on the
same matrices without exchanging files."""
import os
import platform
import re
import subprocess
import sys

import numpy as np

M1 = np.uint64(0x9E3779B97F4A7C15)
M2 = np.uint64(0xBF58476D1CE4E5B9)
M3 = np.uint64(0x94D049BB133111EB)
SEEDMUL = np.uint64(0x100000001B3)


def mix(z):
    z = z + M1
    z = (z ^ (z >> np.uint64(30))) * M2
    z = (z ^ (z >> np.uint64(27))) * M3
    return z ^ (z >> np.uint64(31))


def uniform(seed, start, count):
    """bench_uniform(seed, i) for i in [start, start + count), float32."""
    with np.errstate(over="ignore"):
        i = np.arange(start, start + count, dtype=np.uint64)
        z = mix(np.uint64(seed) * SEEDMUL + i)
    return ((z >> np.uint64(40)).astype(np.float64) * 2.0**-24 - 0.5).astype(np.float32)


def fill_rows(rows, d, seed):
    """bench_fill_rows: rows x d float32."""
    out = np.empty((rows, d), dtype=np.float32)
    step = max(1, (1 << 24) // d)
    off = (0.25 * (np.arange(d) % 4)).astype(np.float32)
    for r0 in range(0, rows, step):
        m = min(step, rows - r0)
        out[r0:r0 + m] = uniform(seed, r0 * d, m * d).reshape(m, d) + off
    return out


def header(what, threads):
    import torch
    print(f"# {what}")
    print(f"# cores: {os.cpu_count()} online; threads used: {threads}")
    print(f"# python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}")
    print(f"# BLIS_ARCH_TYPE={os.environ.get('BLIS_ARCH_TYPE', '(unset)')}, "
          f"BLIS_NUM_THREADS={os.environ.get('BLIS_NUM_THREADS', '(unset)')}")


def timed_run(cmd, env, who):
    """Runs cmd under /usr/bin/time -v: (wall seconds, peak RSS in MB,
    stdout); a failure prints its output and exits naming `who`."""
    p = subprocess.run(["/usr/bin/time", "-v"] + cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"{who}: {os.path.basename(cmd[0])} failed with status {p.returncode}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", p.stderr).group(1)
    secs = 0.0
    for part in wall.split(":"):
        secs = secs * 60 + float(part)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    return secs, rss / 1024.0, p.stdout
