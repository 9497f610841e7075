#!/usr/bin/env python3
"""The streamed LLM routes' memory and time (issue 31): python3 -m bico.llm
run on synthetic model folders in a child process under /usr/bin/time -v
(peak resident set, wall time), the in-memory route beside it on request.

  bench/llm_stream.py depth [--in-memory] [--untied] [--work DIR]
      random float32 Qwen2-shaped folders, 512 wide (MLP 1376, 8/4 heads
      of 64, vocabulary 2048), a 4-layer source, targets of 4 and of 16
      layers, 16 windows of 128 tokens, --output-lora at the defaults:
      the peaks must be within 10 % of each other (memory that does not
      grow with depth).  --untied: both models with a head of their own
      (the target's fitted after the blocks, a piece of vocabulary rows
      at a time).
  bench/llm_stream.py scale [--layers-b N] [--windows W] [--in-memory]
                            [--no-stream]
      the 0.5B -> 1.5B-shaped pair of bench/llm_scale_gen.py (bf16; the
      target's depth N, 28 for the whole 1.5B shape), W windows of 128
      tokens, --output (a model folder): peak against the target
      checkpoint's size, and the time.
  bench/llm_stream.py block [--layers 1,2]
      a 7B-shaped block (hidden 4096, MLP 14336, 32/8 heads of 128) on
      both sides, vocabulary 2048, 16 windows of 128 tokens: the run at 1
      and 2 layers, the difference is one block's cost.

  bench/llm_stream.py ranks [--ranks 1,2] [--layers-b N] [--windows W]
      the depth case's pair (target of N layers, default 4) with --output
      (a model folder), run as R processes of the streamed fit across
      ranks (bico.llm.ranks; torchrun's variables set by this script),
      each with threads/R threads, batches of 2 windows: the wall time,
      each rank's peak and their sum, beside R = 1.

  bench/llm_stream.py kernels [--layers-b N] [--repeat K]
      the depth pair (target of N layers, default 4) with --output,
      run as the command ran before it chose BLIS's kernels and threads
      (bico._blis: BICO_BLIS_ARCH=auto BLIS_NUM_THREADS=1) and with its
      choice, alternated K times (default 2): wall times and their ratio.

  bench/llm_stream.py arith | scaleout
      no runs: what a streamed run holds at each phase's peak
      (docs/performance.md section 8); what the routes across ranks
      would move per block (docs/scale-out.md, designed, not built).

Each case prints one line: case, side, layers, wall s, peak RSS MB,
checkpoint MB, RSS/ckpt; with --phases, before it, the highest resident
set sampled in each phase of the run (its progress lines read).  Files are written once into --work (default
build/llm_stream) and reused.  The child runs the binding of
bindings/python on the library of $BICO_BUILD (default build/)."""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import llm_scale_gen as gen  # noqa: E402

PY = "/usr/bin/python3"

DEPTH = dict(d=512, f=1376, H=8, KV=4, hd=64, V=2048)
BLOCK7B = dict(d=4096, f=14336, H=32, KV=8, hd=128, V=2048)


def folder(path, s, salt, dtype):
    """A Qwen2-shaped folder (llm_scale_gen's names and config) of random
    weights in dtype ("F32" or "BF16"), written tensor by tensor."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return os.path.getsize(os.path.join(path, "model.safetensors"))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(gen.config(s), f, indent=2)
    make = (lambda n, sh: gen.weight(n, sh, salt)) if salt != "A_ft" else \
        (lambda n, sh: gen.weight(n, sh, "A") + 0.01 * gen.weight(n, sh,
                                                                  "tau"))
    return gen.write_st(os.path.join(path, "model.safetensors"),
                        list(gen.shapes(s).items()), make, dtype=dtype)


def ids(path, n_tokens, vocab, seed=0):
    if not os.path.exists(path):
        g = np.random.default_rng(seed)
        np.save(path, g.integers(0, vocab, n_tokens).astype(np.int64))
    return path


def measure(cmd, env=None):
    """(wall s, peak RSS MB, returncode, stderr tail) of a child process
    under /usr/bin/time -v."""
    t0 = time.time()
    r = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True,
                       text=True, env=env)
    wall = time.time() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    peak = int(m.group(1)) / 1024.0 if m else float("nan")
    return wall, peak, r.returncode, r.stderr[-1500:]


def _vm(pid, key):
    """A process's VmRSS or VmHWM from /proc, MB (0 once it is gone)."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for ln in f:
                if ln.startswith(key + ":"):
                    return int(ln.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def measure_phases(cmd, env=None, every=2.0):
    """measure() with the command's progress lines read as they come: the
    resident set sampled every `every` s and kept per phase (a line's text
    before its first digit: "fit: layer ", "alpha ", ...), each phase's
    highest sample and its start printed; (wall s, peak RSS MB from the
    kernel's high-water mark, returncode, stderr tail)."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env)
    lines = ["(start)"]
    reader = threading.Thread(target=lambda: lines.extend(
        ln.rstrip() for ln in p.stderr))
    reader.start()
    order, high, start, hwm = [], {}, {}, 0.0
    while p.poll() is None:
        key = re.split(r"\d", lines[-1], 1)[0].strip()[:40] or lines[-1][:40]
        if key not in high:
            order.append(key)
            high[key], start[key] = 0.0, time.time() - t0
            # said as it starts: a run stopped early still shows how far
            # it came and what it held until then
            print("#   ... %7.0f s: %-40s (peak so far %6.0f MB)"
                  % (start[key], key, hwm), flush=True)
        high[key] = max(high[key], _vm(p.pid, "VmRSS"))
        hwm = max(hwm, _vm(p.pid, "VmHWM"))
        time.sleep(every)
    reader.join()
    wall = time.time() - t0
    for k in order:
        print("#   phase %-40s from %7.0f s  RSS up to %6.0f MB"
              % (k, start[k], high[k]), flush=True)
    return wall, hwm, p.returncode, "\n".join(lines[-20:])


PHASES = []     # --phases: run() samples the resident set per phase


BLIS_VARS = ("BLIS_ARCH_TYPE", "BLIS_NUM_THREADS", "OMP_NUM_THREADS",
             "BICO_BLIS_ARCH", "BICO_BLIS_ARCH_CHOSEN")


def run(work, name, a, b, args, in_memory, threads, blis=None):
    """One run of the command; blis: None leaves BLIS's variables as this
    process has them, else a dict that replaces all of them (the kernels
    case)."""
    out = os.path.join(work, "out-" + name)
    cmd = [PY, "-m", "bico.llm", "--method", "fit", "--source", a,
           "--source-tuned",
           a + "_ft", "--target", b, "--threads", str(threads),
           "--quiet"] + args + (["--in-memory"] if in_memory else []) + \
        (["--replace"] if "--output-lora" in args else [])  # a rerun
    cmd = [c.replace("OUT", out) for c in cmd]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "bindings",
                                                   "python"),
               BICO_BUILD=os.environ.get("BICO_BUILD") or
               os.path.join(ROOT, "build"))
    if blis is not None:
        env = {k: v for k, v in env.items() if k not in BLIS_VARS}
        env.update(blis)
    if PHASES:
        cmd.remove("--quiet")
        wall, peak, rc, err = measure_phases(cmd, env)
    else:
        wall, peak, rc, err = measure(cmd, env)
    if rc != 0:
        print("# %s failed (%d): %s" % (name, rc, err), flush=True)
    return wall, peak


def line(case, side, layers, wall, peak, ckpt):
    print("%10s %9s %6d %9.1f %12.0f %15.1f %9.2f" % (
        case, side, layers, wall, peak, ckpt / 2 ** 20, peak * 2 ** 20 /
        ckpt), flush=True)


def header():
    print("%10s %9s %6s %9s %12s %15s %9s" % (
        "case", "side", "layers", "wall s", "peak RSS MB", "target ckpt MB",
        "RSS/ckpt"), flush=True)


def pair(work, tag, s_a, s_b, layers_b, dtype):
    sa, sb = dict(s_a), dict(s_b, L=layers_b)
    a = os.path.join(work, "%s-A" % tag)
    folder(a, sa, "A", dtype)
    folder(a + "_ft", sa, "A_ft", dtype)
    b = os.path.join(work, "%s-B%d" % (tag, layers_b))
    size = folder(b, sb, "B", dtype)
    return a, b, size


def depth(work, in_memory, threads, untied=False):
    print("## depth: 512 wide, MLP 1376, vocabulary 2048, F32; source 4 "
          "layers; 16 windows of 128 tokens; --output-lora at the "
          "defaults%s" % ("; untied heads (the target's fitted by token "
                          "id)" if untied else ""))
    header()
    t = ids(os.path.join(work, "ids-2048.npy"), 16 * 128 + 1, DEPTH["V"])
    spec = dict(DEPTH, untied=True) if untied else DEPTH
    src = dict(spec, L=4)
    tag = "depthu" if untied else "depth"
    peaks = {}
    for lb in (4, 16):
        a, b, size = pair(work, tag, src, spec, lb, "F32")
        for side in ("stream",) + (("in-memory",) if in_memory else ()):
            wall, peak = run(work, "%s%d" % (tag, lb), a, b,
                             ["--ids", t, "--output-lora", "OUT"],
                             side == "in-memory", threads)
            peaks[(side, lb)] = peak
            line("depth", side, lb, wall, peak, size)
    for side in ("stream",) + (("in-memory",) if in_memory else ()):
        p4, p16 = peaks[(side, 4)], peaks[(side, 16)]
        print("# %s: peak at 16 layers / at 4 layers = %.3f" % (
            side, p16 / p4), flush=True)


def scale(work, layers_b, windows, in_memory, threads, stream=True):
    full = gen.SIZES["full"]
    print("## scale: Qwen2 0.5B-shaped (896 x 24, MLP 4864) -> 1.5B-shaped "
          "(1536 x %d, MLP 8960), vocabulary 151936, bf16; %d windows of "
          "128 tokens; --output (a model folder)" % (layers_b, windows))
    header()
    t = ids(os.path.join(work, "ids-151936-%d.npy" % windows),
            windows * 128 + 1, full["tgt"]["V"])
    a, b, size = pair(work, "scale", full["src"], full["tgt"], layers_b,
                      "BF16")
    for side in (("stream",) if stream else ()) + \
            (("in-memory",) if in_memory else ()):
        wall, peak = run(work, "scale%d%s" % (
            layers_b, "-mem" if side == "in-memory" else ""), a, b,
                         ["--ids", t, "--output", "OUT/", "--alpha", "heldout",
                          "--dtype", "float32"], side == "in-memory",
                         threads)
        line("scale", side, layers_b, wall, peak, size)


def ranks(work, counts, layers_b, windows, threads):
    """The streamed fit across R ranks on one machine (see the doc)."""
    import socket
    print("## ranks: the depth pair (512 wide, MLP 1376, vocabulary 2048, "
          "F32), source 4 layers, target %d; %d windows of 128 tokens in "
          "batches of 2; --output (a model folder); %d threads in all"
          % (layers_b, windows, threads))
    print("%6s %9s %16s %13s %8s" % ("ranks", "wall s", "peak MB by rank",
                                      "peak MB sum", "speedup"), flush=True)
    t = ids(os.path.join(work, "ids-2048-%d.npy" % windows),
            windows * 128 + 1, DEPTH["V"])
    a, b, size = pair(work, "depth", dict(DEPTH, L=4), DEPTH, layers_b,
                      "F32")
    base = None
    for R in counts:
        out = os.path.join(work, "out-ranks%d" % R)
        cmd = [PY, "-m", "bico.llm", "--method", "fit", "--source", a,
               "--source-tuned", a + "_ft", "--target", b, "--ids", t,
               "--output", out + "/", "--batch-size", "2", "--quiet",
               "--threads", str(max(1, threads // R))]
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            port = so.getsockname()[1]
        procs, t0 = [], time.time()
        for r in range(R):
            env = dict(os.environ, PYTHONPATH=os.path.join(
                ROOT, "bindings", "python"), BICO_BUILD=os.environ.get(
                "BICO_BUILD") or os.path.join(ROOT, "build"))
            if R > 1:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           RANK=str(r), LOCAL_RANK=str(r),
                           WORLD_SIZE=str(R))
            procs.append(subprocess.Popen(
                ["/usr/bin/time", "-v"] + cmd, env=env, text=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        peaks, ok = [], True
        for p in procs:
            err = p.communicate()[1]
            m = re.search(r"Maximum resident set size \(kbytes\): (\d+)",
                          err)
            peaks.append(int(m.group(1)) / 1024.0 if m else float("nan"))
            if p.returncode != 0:
                ok = False
                print("# ranks %d failed (%d): %s" % (R, p.returncode,
                                                      err[-1500:]))
        wall = time.time() - t0
        base = wall if base is None else base
        print("%6d %9.1f %16s %13.0f %8.2f%s" % (
            R, wall, "/".join("%.0f" % x for x in peaks), sum(peaks),
            base / wall, "" if ok else "  (failed)"), flush=True)


def block(work, layers, threads):
    print("## block: a 7B-shaped block (hidden 4096, MLP 14336, 32/8 heads "
          "of 128) on both sides, vocabulary 2048, bf16 folders; 16 "
          "windows of 128 tokens; --output")
    header()
    t = ids(os.path.join(work, "ids-2048.npy"), 16 * 128 + 1, 2048)
    got = {}
    for lb in layers:
        s = dict(BLOCK7B, L=lb)
        a, b, size = pair(work, "block%d" % lb, s, s, lb, "BF16")
        wall, peak = run(work, "block%d" % lb, a, b,
                         ["--ids", t, "--output", "OUT/"], False, threads)
        got[lb] = (wall, peak)
        line("block", "stream", lb, wall, peak, size)
    if len(layers) == 2:
        (l1, (w1, _)), (l2, (w2, _)) = sorted(got.items())
        print("# one 7B-shaped block: %.1f s (difference of the %d- and "
              "%d-layer runs)" % ((w2 - w1) / (l2 - l1), l1, l2), flush=True)


def kernels(work, layers_b, repeat, threads):
    """The command as it ran before it chose BLIS's kernels and threads
    (BICO_BLIS_ARCH=auto: BLIS's own kernels; BLIS_NUM_THREADS=1: what
    BLIS took when nobody set it) against its own choice (bico._blis),
    on the depth pair, alternated `repeat` times."""
    print("## kernels: the depth pair (512 wide, MLP 1376, vocabulary 2048, "
          "F32), source 4 layers, target %d; 16 windows of 128 tokens; "
          "--output (a model folder); 'before': BICO_BLIS_ARCH=auto "
          "BLIS_NUM_THREADS=1, 'chosen': the command's choice" % layers_b)
    header()
    t = ids(os.path.join(work, "ids-2048.npy"), 16 * 128 + 1, DEPTH["V"])
    a, b, size = pair(work, "depth", dict(DEPTH, L=4), DEPTH, layers_b,
                      "F32")
    sides = (("before", {"BICO_BLIS_ARCH": "auto",
                         "BLIS_NUM_THREADS": "1"}), ("chosen", {}))
    walls = {n: [] for n, _ in sides}
    for _ in range(repeat):
        for n, env in sides:
            wall, peak = run(work, "kernels", a, b,
                             ["--ids", t, "--output", "OUT/", "--replace"],
                             False, threads, blis=env)
            walls[n].append(wall)
            line("kernels", n, layers_b, wall, peak, size)
    r = sorted(x / y for x, y in zip(walls["before"], walls["chosen"]))
    print("# before / chosen wall time, per pair of runs: %s (median %.2f)"
          % (" ".join("%.2f" % x for x in r), r[len(r) // 2]), flush=True)


# ---- the arithmetic: what a streamed run holds, by phase ----

# Qwen2-0.5B/1.5B tie their heads; Llama-3-8B/70B (and the 7B-shaped
# source) do not
SHAPES = {
    "0.5B": dict(d=896, f=4864, H=14, KV=2, hd=64, L=24, V=151936,
                 tied=True),
    "1.5B": dict(d=1536, f=8960, H=12, KV=2, hd=128, L=28, V=151936,
                 tied=True),
    "7B": dict(d=4096, f=14336, H=32, KV=8, hd=128, L=32, V=128256,
               tied=False),
    "8B": dict(d=4096, f=14336, H=32, KV=8, hd=128, L=32, V=128256,
               tied=False),
    "70B": dict(d=8192, f=28672, H=64, KV=8, hd=128, L=80, V=128256,
                tied=False),
}


def _lin(s):
    """(name, d_out, d_in) of a block's seven linears."""
    d, f, q, kv = s["d"], s["f"], s["H"] * s["hd"], s["KV"] * s["hd"]
    return [("q", q, d), ("k", kv, d), ("v", kv, d), ("o", d, q),
            ("gate", f, d), ("up", f, d), ("down", d, f)]


def _block_params(s):
    return sum(o * i for _, o, i in _lin(s)) + 2 * s["d"]


def phases(src, tgt, n, cbytes=4, logits_budget=64 << 20):
    """GB held at each phase's peak by the streamed run (beside the
    process itself), n calibration rows, compute dtype of cbytes; an
    untied target head adds the head's fit (bico.llm.stream.fit._HeadFit)
    for a model folder and for an adapter."""
    G = 1e-9
    V = tgt["V"]
    blk = lambda s: _block_params(s) * cbytes
    out = {}
    # the library's partial run carrying the (tied) embedding: its update
    # and task vector whole (float32), our rows a piece at a time
    out["embedding carried"] = (V * tgt["d"] + V * src["d"]) * 4 * G
    # the head while the loss gradient is taken (and while scoring)
    out["head"] = V * tgt["d"] * cbytes * G + 64e6 * G
    # a block's statistics: out maps of the seven linears, accumulated
    # together, then solved one at a time (EIG: the Gram of the smaller
    # side, a copy of C, R in float32)
    st = sum(oa * ob for (_, oa, _), (_, ob, _) in zip(_lin(src), _lin(tgt)))
    big = max(oa * ob for (_, oa, _), (_, ob, _) in zip(_lin(src),
                                                         _lin(tgt)))
    small = max(min(oa, ob) ** 2 for (_, oa, _), (_, ob, _) in
                zip(_lin(src), _lin(tgt)))
    rows = n * (2 * tgt["d"] + tgt["H"] * tgt["hd"] + tgt["f"]) * 4 + \
        n * sum(o for _, o, _ in _lin(src)) * 4
    out["block statistics"] = (st * 8 + big * 8 + small * 8 * 2 + big * 4 +
                               rows) * G + (2 * blk(src) + 2 * blk(tgt)) * G
    # the fit's largest group: statistics of its layers (G and E, and
    # Theta (theta mode) or K), plus the solve of one (A, two d_out x a)
    fit = 0
    for grp in (("q", "k", "v"), ("o",), ("gate", "up"), ("down",)):
        hold, solve = 0, 0
        for name, o, i in _lin(tgt):
            if name not in grp:
                continue
            a = i + 1
            hold += a * a + o * a + (o * a if o < a else a * a)
            solve = max(solve, a * a + 2 * o * a + 256 * a)
        fit = max(fit, (hold + solve) * 8)
    out["fit, largest group"] = fit * G + (2 * blk(tgt) + n * tgt["f"] *
                                           4) * G
    if not tgt.get("tied", True):
        d = tgt["d"]
        p = max(1, min(V, logits_budget // (4 * max(n, d))))
        a = d + 1
        # the head before and after (compute dtype), the final norm's
        # outputs of the four models' rows, one piece: its rows of the
        # two source heads, its logits (two), its fit's statistics and
        # solve (as a linear's above, d_out = p)
        head = (2 * V * d * cbytes + 4 * n * d * cbytes +
                2 * p * src["d"] * cbytes + 2 * n * p * 4 +
                (2 * a * a + 4 * p * a + 256 * a) * 8) * G
        out["head fit (folder)"] = head
        # an adapter: the pair (rank 16, double) and three d x d
        # matrices; the update is read a piece of rows at a time
        # (bico.llm.adapters.tall_low_rank)
        out["head fit (adapter)"] = head + (2 * V * 16 + 3 * d * d +
                                            2 * 8192 * d) * 8 * G
    return out


def arith():
    print("## what a streamed run holds at each phase's peak, GB (beside the "
          "process, about 0.35 GB): float32 compute, 2048 rows; the "
          "checkpoint in bf16")
    for a, b in (("0.5B", "1.5B"), ("7B", "8B"), ("8B", "70B")):
        src, tgt = SHAPES[a], SHAPES[b]
        ph = phases(src, tgt, 2048)
        ckpt = (tgt["L"] * _block_params(tgt) + tgt["V"] * tgt["d"] *
                (1 if tgt["tied"] else 2)) * 2e-9
        print("# %s -> %s: target checkpoint %.1f GB; %s; peak %.1f GB" % (
            a, b, ckpt, "; ".join("%s %.2f" % kv for kv in ph.items()),
            max(ph.values()) + 0.35))


# ---- the scale-out design's arithmetic (docs/scale-out.md) ----

_GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))


def _fit_bytes(o, i):
    """A linear's fit statistics in double: G (a x a), E (a x o), and K
    (a x a) or the right-hand side (o x a) when o < a; a = i + 1."""
    a = i + 1
    return (a * a + o * a + (o * a if o < a else a * a)) * 8


def _collective(src, tgt):
    """Bytes of one target block's sums over rows, and of its float32
    updates and R_out maps."""
    la, lb = _lin(src), _lin(tgt)
    grp = {g: sum(_fit_bytes(o, i) for n, o, i in lb if n in g)
           for g in _GROUPS}
    one_g = sum(_fit_bytes(o, i) for n, o, i in lb) - sum(
        (i + 1) ** 2 * 8 for g in _GROUPS for n, o, i in lb
        if n in g and n != g[0])
    return dict(norms=2 * src["d"] * tgt["d"] * 8,
                rout=sum(oa * ob for (_, oa, _), (_, ob, _) in zip(la, lb))
                * 8, grp=grp, fit=sum(grp.values()), one_g=one_g,
                upd=sum(o * i for _, o, i in lb) * 4,
                rmap=sum(oa * ob for (_, oa, _), (_, ob, _) in zip(la, lb))
                * 4)


def scaleout(n=2048):
    """What the LLM routes across R processes would move per target block
    (docs/scale-out.md: designed, not built), GB."""
    G = 1e-9
    print("## the LLM routes across ranks, per target block, GB (%d "
          "calibration rows in all; statistics in double, updates and "
          "maps float32)" % n)
    for a, b in (("0.5B", "1.5B"), ("7B", "8B"), ("8B", "70B")):
        src, tgt = SHAPES[a], SHAPES[b]
        c = _collective(src, tgt)
        tot = c["norms"] + c["rout"] + c["fit"]
        print("# %s -> %s: norm statistics %.3f; R_out statistics %.2f; "
              "fit statistics %.2f (%s; %.2f with one G per group); total "
              "%.2f, x %d blocks = %.0f" % (
                  a, b, c["norms"] * G, c["rout"] * G, c["fit"] * G,
                  ", ".join("%s %.2f" % ("/".join(k), v * G)
                            for k, v in c["grp"].items()),
                  c["one_g"] * G, tot * G, tgt["L"], tot * tgt["L"] * G))
        print("#   updates dW %.2f; R_out maps %.2f; the embedding's carried "
              "update %.2f (once)" % (c["upd"] * G, c["rmap"] * G,
                                      tgt["V"] * tgt["d"] * 4 * G))
        for R in (2, 4, 8, 16):
            print("#   R=%2d: ring all-reduce, per rank %.2f; reduce into "
                  "rank 0 %.2f + broadcast of dW and R_out %.2f" % (
                      R, 2.0 * (R - 1) / R * tot * G, (R - 1.0) / R * tot *
                      G, (c["upd"] + c["rmap"]) * G))
        hs = n * 4 * (2 * (src["L"] + 1) * src["d"] +
                      2 * (tgt["L"] + 1) * tgt["d"])
        print("#   boundary states and gradients (A: %d+1, B: %d+1 "
              "boundaries): %.2f in all, %.2f per rank at R=8; one B "
              "boundary per rank at R=8 %.3f" % (
                  src["L"], tgt["L"], hs * G, hs / 8 * G,
                  n / 8.0 * tgt["d"] * 4 * G))
        _rows_and_flops(src, tgt, n)


def _rows_and_flops(src, tgt, n):
    G, la, lb = 1e-9, _lin(src), _lin(tgt)
    for rows in (n, 8 * n):
        fit = sum(rows * ((2 * (i + 1) if nm == g[0] else 0) + o) * 4
                  for g in _GROUPS for nm, o, i in lb if nm in g)
        grad = rows * (sum(o for _, o, _ in lb) +
                       sum(o for _, o, _ in la)) * 4
        print("#   %d rows: the block's fit rows (X', X_B once per group, "
              "D R_out per linear) %.2f, gradient rows of both sides %.2f"
              % (rows, fit * G, grad * G))
    print("#   Cholesky a^3/3, Tflop: %s; block %.1f; the block's forward "
          "at %d rows %.1f Tflop; accumulating its fit statistics %.1f "
          "Tflop" % (
              ", ".join("%s %.2f" % (nm, (i + 1) ** 3 / 3e12)
                        for nm, o, i in lb),
              sum((i + 1) ** 3 / 3e12 for _, o, i in lb), n,
              2e-12 * n * _block_params(tgt),
              sum(n * ((i + 1) ** 2 + 2 * o * (i + 1)) for _, o, i in lb)
              * 1e-12))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("case", choices=("depth", "scale", "block", "arith",
                                      "scaleout", "ranks", "kernels"))
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--work", default=os.path.join(ROOT, "build",
                                                  "llm_stream"))
    p.add_argument("--in-memory", action="store_true")
    p.add_argument("--untied", action="store_true",
                   help="depth: Llama-3-like folders whose heads are not "
                   "tied to the embedding")
    p.add_argument("--no-stream", action="store_true",
                   help="scale: leave the streamed run out (with "
                   "--in-memory: that run alone)")
    p.add_argument("--layers-b", type=int, default=28)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--layers", default="1,2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--phases", action="store_true",
                   help="print the resident set per phase of each run "
                   "(its progress lines read; the peak from VmHWM)")
    a = p.parse_args(argv)
    if a.phases:
        PHASES.append(True)
    if a.case == "arith":
        return arith()
    if a.case == "scaleout":
        return scaleout()
    os.makedirs(a.work, exist_ok=True)
    print("# %s; load average %s; %d cores; threads %d" % (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        " ".join("%.2f" % x for x in os.getloadavg()), os.cpu_count(),
        a.threads), flush=True)
    if a.case == "depth":
        depth(a.work, a.in_memory, a.threads, a.untied)
    elif a.case == "scale":
        scale(a.work, a.layers_b, a.windows, a.in_memory, a.threads,
              not a.no_stream)
    elif a.case == "kernels":
        kernels(a.work, 4 if a.layers_b == 28 else a.layers_b, a.repeat,
                a.threads)
    elif a.case == "ranks":
        ranks(a.work, [int(x) for x in a.ranks.split(",")],
              4 if a.layers_b == 28 else a.layers_b, a.windows, a.threads)
    else:
        block(a.work, [int(x) for x in a.layers.split(",")], a.threads)


if __name__ == "__main__":
    main()
