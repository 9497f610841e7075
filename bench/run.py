"""`make bench`: every libbico benchmark next to its PyTorch/NumPy twin.

For each shape the C program and its Python twin run one after the other
(the machine may be shared: interleaving by shape keeps both sides under
the same conditions), and one table per benchmark puts their medians side
by side.  Tables only, never pass/fail.

BLIS 0.9.0 does not recognise every CPU (AMD family 26 gets the slow
'generic' kernels); unless BLIS_ARCH_TYPE is already set, or --no-arch-fix
is given, a recognised AVX-512 (skx) or AVX2 (haswell) sub-configuration is
forced through BLIS_ARCH_TYPE, for both sides alike (PyTorch and NumPy use
the same BLIS through libblas.so.3).

Usage: run.py --bin DIR [--threads T] [--quick] [--full] [--no-arch-fix]
              [--skip-model] [--sections xcov,procrustes,model,lora,llm]"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = "/usr/bin/python3"


def parse(out):
    rows = []
    for line in out.splitlines():
        if line.startswith("RESULT "):
            rows.append({k: v for k, v in (kv.split("=", 1) for kv in line.split()[1:])})
    return rows


def run(cmd, env):
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stdout.write(p.stdout)
        sys.stderr.write(p.stderr)
        raise SystemExit(f"run.py: {' '.join(cmd)} failed with status {p.returncode}")
    return p.stdout, time.time() - t0


def header_lines(out):
    return [l for l in out.splitlines() if l.startswith("#")]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def f(x, spec):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "-"
    if v != v:
        return "-"
    return format(v, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    ap.add_argument("--no-arch-fix", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--sections", default="xcov,procrustes,model,lora,llm",
                    help="comma-separated subset of xcov, procrustes, model, lora, llm")
    ap.add_argument("--full", action="store_true", help="also the 4096 x 4096 Procrustes and the scaling rows at full depth (beyond 15 minutes)")
    a = ap.parse_args()
    env = dict(os.environ)
    env["BLIS_NUM_THREADS"] = str(a.threads)
    env["OMP_NUM_THREADS"] = str(a.threads)
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    xb = os.path.join(a.bin, "bench_xcov")
    pb = os.path.join(a.bin, "bench_procrustes")

    # Which sub-configuration would BLIS pick on its own?
    probe, _ = run([xb, "--only", "none"], env)
    auto = re.search(r"sub-configuration '([^']+)'", probe)
    auto = auto.group(1) if auto else "?"
    note = ""
    if "BLIS_ARCH_TYPE" not in env and not a.no_arch_fix and auto == "generic":
        fl = cpu_flags()
        if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= fl:
            env["BLIS_ARCH_TYPE"], name = "0", "skx"
        elif {"avx2", "fma"} <= fl:
            env["BLIS_ARCH_TYPE"], name = "3", "haswell"
        else:
            name = None
        if name:
            note = (f"# BLIS auto-detects 'generic' on this CPU; BLIS_ARCH_TYPE={env['BLIS_ARCH_TYPE']} "
                    f"forces '{name}' for libbico, PyTorch and NumPy alike (--no-arch-fix keeps generic)")
    t_start = time.time()
    print("# libbico benchmarks (make bench)")
    print(f"# date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"# machine: {cpu_model()}; {os.cpu_count()} cores online; threads used: {a.threads}")
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          "(other work on the machine inflates and scatters timings)")
    if os.getloadavg()[0] > os.cpu_count():
        print(f"# WARNING: load average above the core count: multi-threaded BLIS teams stall when a thread"
              " is descheduled; compare columns within a row, not across runs")
    if note:
        print(note)
    hdr, _ = run([xb, "--only", "none", "--threads", str(a.threads)], env)
    for l in header_lines(hdr):
        if l.startswith("# BLAS"):
            print(l)
    print("# LAPACK: reference LAPACK 3.11 (liblapack.so.3) on BLIS's BLAS (libblas.so.3); "
          "PyTorch and NumPy link the same two libraries")
    print()

    sections = set(a.sections.split(","))
    if a.skip_model:
        sections.discard("model")
    # ---- 1. statistics accumulation ----
    rows = "4096" if a.quick else "16384"
    big_rows = "1024" if a.quick else "16384"
    reps = "3"
    shapes = ["768x768", "768x1024", "3072x4096"] if "xcov" in sections else []
    if shapes:
        print("## 1. Statistics accumulation C += X_a^T X_b (f32 rows, f64 statistics)")
        print(f"# medians of {reps} runs; rows = {rows} ({big_rows} for 3072x4096); GF/s counts 2 n d_a d_b;")
        print("# '% sg' = fraction of BLIS sgemm's rate on the same shape in this run;")
        print("# err = ||C - C_ref||_F / ||C_ref||_F, C_ref = dgemm in double over the rows reversed.")
        cols = ("shape", "rows", "sgemm GF/s", "sg err", "exact GF/s", "% sg", "exact err",
                "fast GF/s", "% sg", "fast err", "torch32 GF/s", "t32 err", "torch64 GF/s",
                "t64 err", "numpy32 GF/s")
        widths = (9, 6, 10, 8, 10, 5, 9, 9, 5, 8, 12, 8, 12, 8, 12)
        print(" ".join(c.rjust(w) for c, w in zip(cols, widths)))
        for sh in shapes:
            common = ["--reps", reps, "--threads", str(a.threads), "--rows", rows, "--big-rows",
                      big_rows, "--only", sh, "--machine"]
            oc, _ = run([xb] + common, env)
            op, _ = run([PY, os.path.join(HERE, "xcov_torch.py")] + common, env)
            c, p = parse(oc)[0], parse(op)[0]
            n, da, db = int(c["rows"]), int(c["d_a"]), int(c["d_b"])
            gf = 2.0 * n * da * db * 1e-9
            ts = float(c["sgemm_s"])
            vals = (sh, str(n), f(gf / ts, ".1f"), f(c["sgemm_err"], ".1e"),
                    f(gf / float(c["exact_s"]), ".1f"), f(100 * ts / float(c["exact_s"]), ".0f"),
                    f(c["exact_err"], ".1e"), f(gf / float(c["fast_s"]), ".1f"),
                    f(100 * ts / float(c["fast_s"]), ".0f"), f(c["fast_err"], ".1e"),
                    f(gf / float(p["torch32_s"]), ".1f"), f(p["torch32_err"], ".1e"),
                    f(gf / float(p["torch64_s"]), ".1f"), f(p["torch64_err"], ".1e"),
                    f(gf / float(p["numpy32_s"]), ".1f"))
            print(" ".join(v.rjust(w) for v, w in zip(vals, widths)), flush=True)
        print("# exact = libbico default (every product exact, summed in double);"
              " fast = BICO_XCOV_ADD_FAST (sgemm blocks of 2048 rows, summed in double);")
        print("# torch64 = X.double().T @ Y.double() (conversion included), torch32/numpy32 = one f32 matmul")
        print()

    # ---- 2. Procrustes ----
    sizes = ["768x768", "1024x1024", "768x1024"] + ([] if a.quick else ["3072x3072", "3072x4096"])
    if a.full:
        sizes.append("4096x4096")
    if "procrustes" not in sections:
        sizes = []
    if sizes:
        print("## 2. Procrustes R = U V^T (C: uniform [-0.5, 0.5) entries, f64)")
        print("# seconds: medians of 3 runs below d = 3072, single runs from 3072 up;")
        print("# orth = ||R R^T - I||_F (R^T R when d_a > d_b); libbico's R is float32, so ~1e-6 is its storage floor;")
        print("# diff = max |R - R_bico SVD|. SVD = BICO_PROC_SVD (dgesdd), EIG = BICO_PROC_EIG, the default (dsyevr of the")
        print("# smaller Gram after a Cholesky certificate),")
        print("# POLAR = BICO_PROC_POLAR (Newton-Schulz, GEMM only); '*' = not certified, fell back to the SVD.")
        cols = ("shape", "SVD s", "orth", "EIG s", "orth", "diff", "POLAR s", "orth", "torch64 s",
                "orth", "diff", "torch32 s", "orth", "numpy64 s", "gesvd s")
        widths = (9, 7, 8, 7, 8, 8, 8, 8, 9, 8, 8, 9, 8, 9, 8)
        print(" ".join(c.rjust(w) for c, w in zip(cols, widths)))
        with tempfile.TemporaryDirectory() as dump:
            for sh in sizes:
                common = ["--reps", "3", "--big-reps", "1", "--threads", str(a.threads), "--only", sh,
                          "--machine"]
                extra_c = ["--polar-max-d", "1024", "--eig-max-d", "3072" if sh == "4096x4096" else "4096"]
                oc, _ = run([pb] + common + extra_c + ["--dump", dump], env)
                extra = ["--f32-max-d", "3072"]
                op, _ = run([PY, os.path.join(HERE, "procrustes_torch.py")] + common + extra
                            + ["--compare", dump], env)
                c, p = parse(oc)[0], parse(op)[0]
                star = "" if c.get("polar_certified") == "1" else "*"
                vals = (sh, f(c["bico_s"], ".3f"), f(c["bico_orth"], ".1e"), f(c["eig_s"], ".3f"),
                        f(c["eig_orth"], ".1e"), f(c["eig_diff"], ".1e"), f(c["polar_s"], ".3f") + star,
                        f(c["polar_orth"], ".1e"), f(p["torch64_s"], ".3f"), f(p["torch64_orth"], ".1e"),
                        f(p["torch64_diff"], ".1e"), f(p.get("torch32_s"), ".3f"),
                        f(p.get("torch32_orth"), ".1e"), f(p.get("numpy64_s"), ".3f"),
                        f(c.get("gesvd_s"), ".3f"))
                print(" ".join(v.rjust(w) for v, w in zip(vals, widths)), flush=True)
        print("# time budget: POLAR and numpy64 run up to d = 1024, torch32 up to 3072, raw dgesvd (one run)"
              " at 768 only,")
        print("# EIG not at 4096x4096, 4096x4096 only with --full; '-' = not run")
        print()

    model = os.path.join(HERE, "bench_model.py")
    if "model" in sections and os.path.exists(model):
        cmd = ([PY, model, "--bin", a.bin, "--threads", str(a.threads)] + (["--quick"] if a.quick else [])
               + (["--full"] if a.full else []))
        p = subprocess.run(cmd, env=env)
        if p.returncode != 0:
            raise SystemExit(f"run.py: bench_model.py failed with status {p.returncode}")
    # ---- 5. LoRA: factored transport against dense + truncate (C only) ----
    lb = os.path.join(a.bin, "bench_lora")
    if "lora" in sections and os.path.exists(lb):
        print("## 5. LoRA module transport: peak memory, factored vs dense + truncate")
        out, _ = run([lb, "--threads", str(a.threads), "--reps", "1" if a.quick else "5"], env)
        print("\n".join(l for l in out.splitlines()
                        if not l.startswith(("# LoRA transport", "# cores", "# BLAS"))))
        print(flush=True)
    # ---- 6. LLM scale: 0.5B-shaped -> 1.5B-shaped, thin solves (bench/llm_scale.py) ----
    llm = os.path.join(HERE, "llm_scale.py")
    if "llm" in sections and os.path.exists(llm):
        # Full depth only with --full: on 2 cores it takes hours (docs/performance.md,
        # section 6); by default full widths and vocabulary at one layer per side.
        size = "quick" if a.quick else "full" if a.full else "layer"
        cmd = [PY, llm, "--bin", a.bin, "--threads", str(a.threads), "--size", size]
        p = subprocess.run(cmd, env=env)
        if p.returncode != 0:
            raise SystemExit(f"run.py: llm_scale.py failed with status {p.returncode}")
    print(f"# total wall time of make bench's runs: {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
