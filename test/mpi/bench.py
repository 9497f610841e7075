"""Scale-out figures for docs/scale-out.md: `make bench-mpi MPI=1`.

A synthetic pair of transformer-like checkpoints (source width DA, target
width DB, MLP ratio 4, LA and LB blocks) with a statistics file, and a
calibration set, are written to a temporary folder; then the whole-model
transfer (bico, --stats) runs at 1, 2 and 4 ranks, and the statistics
reduction (bico-mpi stats) at 1, 2 and 4 ranks.  Prints one line per run:
wall time, and each rank's time and peak memory from its log lines.  Sizes
come from the environment (BENCH_DA, BENCH_DB, BENCH_LA, BENCH_LB,
BENCH_ROWS, BENCH_RANKS, BENCH_WHAT="transfer stats").  Numbers depend on the machine: the ranks share its cores."""
import re
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import planted as pl  # noqa: E402

BUILD = os.environ.get("BICO_BUILD", os.path.join(HERE, "..", "..", "build"))
BICO_MPI = os.environ.get("BICO_MPI", os.path.join(BUILD, "bin", "bico-mpi"))
MPIRUN = os.environ.get("MPIRUN", "mpirun")
DA = int(os.environ.get("BENCH_DA", 384))
DB = int(os.environ.get("BENCH_DB", 512))
LA = int(os.environ.get("BENCH_LA", 4))
LB = int(os.environ.get("BENCH_LB", 6))
ROWS = int(os.environ.get("BENCH_ROWS", 2048))
RANKS = [int(x) for x in os.environ.get("BENCH_RANKS", "1 2 4").split()]
WHAT = os.environ.get("BENCH_WHAT", "transfer stats").split()


def model(d, L, rng):
    t = {"embed.weight": rng.standard_normal((d, 48), np.float32) * 0.1}
    for i in range(L):
        p = f"blocks.{i}."
        t[p + "norm.weight"] = np.ones(d, np.float32)
        t[p + "norm.bias"] = np.zeros(d, np.float32)
        t[p + "fc1.weight"] = rng.standard_normal((4 * d, d), np.float32) / np.sqrt(d)
        t[p + "fc1.bias"] = np.zeros(4 * d, np.float32)
        t[p + "fc2.weight"] = rng.standard_normal((d, 4 * d), np.float32) / np.sqrt(4 * d)
        t[p + "fc2.bias"] = np.zeros(d, np.float32)
    return t


def widths(name, d):
    if name.startswith("embed"):
        return 48, d
    if name.endswith("fc1"):
        return d, 4 * d
    if name.endswith("fc2"):
        return 4 * d, d
    return d, d  # norm


def mpirun(n, *args):
    e = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
             OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_btl_vader_single_copy_mechanism="none")
    t = time.time()
    r = subprocess.run([MPIRUN, "--oversubscribe", "-np", str(n), BICO_MPI,
                        *map(str, args)], capture_output=True, text=True, env=e)
    if r.returncode != 0:
        sys.exit(r.stdout + r.stderr)
    return time.time() - t, r.stderr


def main():
    rng = np.random.default_rng(0)
    d = tempfile.mkdtemp(prefix="bico_bench_")
    A, B = model(DA, LA, rng), model(DB, LB, rng)
    tau = {k: 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in A.items()}
    f = {k: os.path.join(d, k + ".safetensors") for k in ("A", "B", "tau", "stats", "calA", "calB")}
    pl.save(f["A"], A)
    pl.save(f["B"], B)
    pl.save(f["tau"], tau)
    stats, calA, calB = {}, {}, {}
    mods = sorted({k.rsplit(".", 1)[0] for k in B})
    for m in mods:
        if m.startswith("blocks."):
            j = int(m.split(".")[1])
            i = round(j * (LA - 1) / (LB - 1))
            sm = f"blocks.{i}." + m.split(".", 2)[2]
        else:
            sm = m
        ia, oa = widths(sm, DA)
        ib, ob = widths(m, DB)
        stats[m + ".in_xcov"] = rng.standard_normal((ia, ib))
        stats[m + ".out_xcov"] = rng.standard_normal((oa, ob))
        if m.endswith("fc1"):  # a calibration set for the reduction figure
            calA[sm + ".input"] = rng.standard_normal((ROWS, ia), np.float32)
            calB[m + ".input"] = rng.standard_normal((ROWS, ib), np.float32)
    pl.save(f["stats"], stats)
    pl.save(f["calA"], calA)
    pl.save(f["calB"], calB)
    nparam = sum(v.size for v in B.values())
    print(f"# target: {nparam / 1e6:.1f} M parameters, {len(B)} tensors; "
          f"source width {DA} x {LA} blocks, target {DB} x {LB}; "
          f"{os.cpu_count()} cores")
    cpu1 = 0.0
    for n in RANKS if "transfer" in WHAT else []:
        out, rep = os.path.join(d, f"out{n}.st"), os.path.join(d, f"rep{n}.json")
        wall, err = mpirun(n, "transfer", "--method", "bico", "--source-base", f["A"],
                           "--task-vector", f["tau"], "--target-base", f["B"],
                           "--stats", f["stats"], "--output", out, "--report", rep)
        # One line per rank: "bico: rank R (host): N tensors (U updated),
        # estimated cost C, S s (CPU S s), peak RSS M MB".
        per, cpus = [], []
        for line in err.splitlines():
            m = re.search(r"bico: rank (\d+) \(.*?\): (\d+) tensors .*?, "
                          r"([0-9.]+) s \(CPU ([0-9.]+) s\), peak RSS ([0-9.]+) MB",
                          line)
            if m:
                cpus.append(float(m.group(4)))
                per.append(f"r{m.group(1)} {m.group(2)} t {float(m.group(3)):.2f} s "
                           f"cpu {float(m.group(4)):.2f} s {float(m.group(5)):.0f} MB")
        if not per:  # one rank: the whole run's own figures
            per = ["single process"]
        per = ", ".join(per)
        # On a shared machine wall time follows the other jobs; the busiest
        # rank's CPU seconds against one rank's say what the division gave.
        if n == 1 and cpus:
            cpu1 = cpus[0]
        ratio = (f"; busiest rank's CPU {max(cpus) / cpu1:.2f} of 1 rank's"
                 if cpus and n > 1 and cpu1 else "")
        print(f"transfer  np={n}: wall {wall:.2f} s  [{per}]{ratio}")
    for n in RANKS if "stats" in WHAT else []:
        wall, err = mpirun(n, "stats", "--source-calib", f["calA"], "--target-calib",
                           f["calB"], "--output", os.path.join(d, f"s{n}.st"))
        line = [l for l in err.splitlines() if "reduction" in l][0]
        print(f"stats     np={n}: wall {wall:.2f} s  [{line.split(': ', 1)[1]}]")
        for l in err.splitlines():
            if "rows (all statistics)" in l:
                print("            " + l.split(": ", 1)[1])
    for p in os.listdir(d):
        os.remove(os.path.join(d, p))
    os.rmdir(d)


if __name__ == "__main__":
    main()
