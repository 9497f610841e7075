"""Cost of the sequential fit at LLM scale (issue 23, "Cost at scale").

One decoder block at the Qwen2-1.5B target's widths (bench/llm_scale_gen.py,
size "layer": hidden 1536, MLP 8960, 12/2 heads of 128; source 896/4864):
every linear of the block (q, k, v, o, gate, up, down) is fitted from N
calibration rows (default 2048) of X' (the layer's input on the working
target), X_B (its input on the original target) and D_B (the desired output
change), random but deterministic (bench/benchdata.py), by

  lib    bico.fit.Fit (bico_fit_add / bico_fit_solve: cross-products
         accumulated in double, Cholesky solve of (G + lambda P) Delta =
         (K - G) Theta + E; the rank only on request, as bico.torch's fit
         asks for it only with a report);
  lib+rank  the same with the rank asked for (solve(want_rank=True): a pivoted
         Cholesky of G more, the library's cost before issue 23's change),
         run beside the others for a paired comparison;
  torch  a plain PyTorch fit of the same mathematics in float64 (the
         library's precision): G, K, E by matmul, torch.linalg.cholesky and
         torch.cholesky_solve (no rank).

Layers that read the same input share one accumulation: q/k/v are one fit
with their outputs stacked (d_out 1536 + 256 + 256), gate/up one fit (d_out
2 x 8960).  The solution is the same as three (two) separate fits, column
for column, since G, K and lambda = c tr(G) / d_in do not depend on the
outputs; the C API has no call to share G between handles, so stacking the
outputs is how a host shares it.

Each side runs in its own process under /usr/bin/time -v (wall time, peak
RSS), at each --threads count; the input files are written once beforehand
and are not timed.  The table gives the per-block figures, the extrapolation
to the target's 28 blocks (time x 28; the fit holds one layer's statistics
at a time, so its peak does not grow with depth), the forward passes per
block, the target checkpoint's size (bf16, from the shapes) and one block's
activations, and the relative difference of the two solutions.

Usage: llm_fit_cost.py [--rows N] [--threads 1,2] [--size layer|quick]
                       [--work DIR] [--ridge C] [--no-arch-fix]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import benchdata  # noqa: E402

PY = "/usr/bin/python3"


def groups(s):
    """The block's fits in forward order: (name, d_in, [(layer, d_out)], bias).
    Qwen2: q/k/v have a bias, o/gate/up/down none."""
    d, f, H, KV, hd = s["d"], s["f"], s["H"], s["KV"], s["hd"]
    return [("qkv", d, [("q", H * hd), ("k", KV * hd), ("v", KV * hd)], True),
            ("o", H * hd, [("o", d)], False),
            ("gate_up", d, [("gate", f), ("up", f)], False),
            ("down", f, [("down", d)], False)]


def write_inputs(work, s, n):
    for gi, (g, d_in, outs, bias) in enumerate(groups(s)):
        d_out = sum(o for _, o in outs)
        seed = 1000 + 10 * gi
        xb = benchdata.fill_rows(n, d_in, seed)
        xn = xb + np.float32(0.05) * benchdata.fill_rows(n, d_in, seed + 1)
        de = np.float32(0.1) * benchdata.fill_rows(n, d_out, seed + 2)
        w = np.float32(0.5 / np.sqrt(d_in)) * benchdata.fill_rows(d_out, d_in, seed + 3)
        np.save(os.path.join(work, g + ".xn.npy"), xn)
        np.save(os.path.join(work, g + ".xb.npy"), xb)
        np.save(os.path.join(work, g + ".d.npy"), de)
        np.save(os.path.join(work, g + ".w.npy"), w)
        if bias:
            np.save(os.path.join(work, g + ".b.npy"),
                    np.float32(0.1) * benchdata.uniform(seed + 4, 0, d_out))
        del xb, xn, de, w


def load(work, g, what):
    return np.load(os.path.join(work, "%s.%s.npy" % (g, what)))


def child_lib(work, s, ridge, out, threads, rank=False):
    sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
    import bico
    import bico.fit
    # the library's BLIS calls take their thread count from the context
    # (BICO_CTX_THREADS, default 1), not from BLIS_NUM_THREADS
    ctx = bico.Context(threads=threads)
    for g, d_in, outs, bias in groups(s):
        d_out = sum(o for _, o in outs)
        f = bico.fit.Fit(d_in, d_out, bias=bias, ridge=ridge, ctx=ctx)
        xn, xb, de = load(work, g, "xn"), load(work, g, "xb"), load(work, g, "d")
        f.add(xn, xb, de)
        del xn, xb, de
        w = load(work, g, "w")
        b = load(work, g, "b") if bias else None
        dw, db = f.solve(w, b, want_rank=rank)
        f.close()
        np.save(os.path.join(out, g + ".dw.npy"), dw)
        if bias:
            np.save(os.path.join(out, g + ".db.npy"), db)
        del dw, db, w, b


def child_torch(work, s, ridge, out, threads):
    import torch
    torch.set_num_threads(threads)
    dt = torch.float64
    for g, d_in, outs, bias in groups(s):
        xn = torch.from_numpy(load(work, g, "xn")).to(dt)
        xb = torch.from_numpy(load(work, g, "xb")).to(dt)
        de = torch.from_numpy(load(work, g, "d")).to(dt)
        w = torch.from_numpy(load(work, g, "w")).to(dt)
        if bias:
            one = torch.ones(xn.shape[0], 1, dtype=dt)
            xn, xb = torch.cat([xn, one], 1), torch.cat([xb, one], 1)
            theta = torch.cat([w, torch.from_numpy(load(work, g, "b")).to(dt)[:, None]], 1).T
        else:
            theta = w.T
        G = xn.T @ xn
        K = xn.T @ xb
        E = xn.T @ de
        del xb, de
        rhs = (K - G) @ theta + E
        del K, E
        lam = ridge * float(torch.diagonal(G)[:d_in].sum()) / d_in
        G.diagonal()[:d_in] += lam
        L = torch.linalg.cholesky(G)
        del G
        delta = torch.cholesky_solve(rhs, L)
        np.save(os.path.join(out, g + ".dw.npy"),
                np.ascontiguousarray(delta[:d_in].T.float().numpy()))
        if bias:
            np.save(os.path.join(out, g + ".db.npy"), delta[d_in].float().numpy())
        del xn, w, theta, rhs, L, delta


def block_forward_s(s, n, threads, seq=512):
    """Seconds of one forward pass of a Qwen2-shaped block (float32, n rows
    as n / seq causal sequences; RMSNorm, grouped-query attention without
    the rotary embedding, SiLU MLP): the unit of the passes counted per
    block.  Best of 3, after a warm-up."""
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    d, f, H, KV, hd = s["d"], s["f"], s["H"], s["KV"], s["hd"]
    lin = lambda i, o, b=False: torch.nn.Linear(i, o, bias=b)
    q, k, v, o = lin(d, H * hd, True), lin(d, KV * hd, True), lin(d, KV * hd, True), lin(H * hd, d)
    g, u, dn = lin(d, f), lin(d, f), lin(f, d)
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    seq = min(seq, n)
    x = torch.randn(max(1, n // seq), seq, d)
    mask = torch.full((seq, seq), float("-inf")).triu(1)

    def fwd(x):
        B = x.shape[0]
        h = rms(x)
        qq = q(h).view(B, seq, H, hd).transpose(1, 2)
        kk = k(h).view(B, seq, KV, hd).transpose(1, 2).repeat_interleave(H // KV, 1)
        vv = v(h).view(B, seq, KV, hd).transpose(1, 2).repeat_interleave(H // KV, 1)
        a = torch.softmax(qq @ kk.transpose(-1, -2) / hd ** 0.5 + mask, -1) @ vv
        x = x + o(a.transpose(1, 2).reshape(B, seq, H * hd))
        h = rms(x)
        return x + dn(torch.nn.functional.silu(g(h)) * u(h))
    best = float("inf")
    with torch.no_grad():
        fwd(x)
        for _ in range(3):
            t0 = time.perf_counter()
            fwd(x)
            best = min(best, time.perf_counter() - t0)
    return best


def rel_diff(a_dir, b_dir, s):
    num = den = 0.0
    for g, _, _, bias in groups(s):
        for what in ("dw", "db") if bias else ("dw",):
            x = np.load(os.path.join(a_dir, "%s.%s.npy" % (g, what))).astype(np.float64)
            y = np.load(os.path.join(b_dir, "%s.%s.npy" % (g, what))).astype(np.float64)
            num += float(np.sum((x - y) ** 2))
            den += float(np.sum(y ** 2))
    return (num / max(den, 1e-300)) ** 0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=None, help="calibration rows (default: 2048; quick 256)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--size", choices=("layer", "quick"), default="layer")
    ap.add_argument("--work", default=None)
    ap.add_argument("--ridge", type=float, default=1e-2)
    ap.add_argument("--no-arch-fix", action="store_true")
    ap.add_argument("--child", choices=("lib", "lib+rank", "torch"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # no llm_scale_gen here: it imports torch
        s = json.loads(a.shape)
        if a.child in ("lib", "lib+rank"):
            child_lib(a.work, s, a.ridge, a.out, int(os.environ.get("OMP_NUM_THREADS", "1")),
                      rank=a.child == "lib+rank")
        else:
            child_torch(a.work, s, a.ridge, a.out, int(os.environ.get("OMP_NUM_THREADS", "1")))
        return
    import llm_scale_gen as gen
    cfg = gen.SIZES[a.size]
    s, t_full = cfg["tgt"], gen.SIZES["full"]["tgt"] if a.size == "layer" else cfg["tgt"]
    n = a.rows or cfg["rows"]
    lib = os.environ.get("BICO_LIBRARY") or os.path.join(ROOT, "build", "lib", "libbico.so.1")
    if not os.path.exists(lib):
        print("# fit-cost benchmark skipped: %s not built" % lib)
        return
    base_env = dict(os.environ)
    arch = ""
    if "BLIS_ARCH_TYPE" not in base_env and not a.no_arch_fix:
        # as bench/run.py: BLIS auto-detects 'generic' on this machine's CPU
        from run import cpu_flags
        fl = cpu_flags()
        if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= fl:
            base_env["BLIS_ARCH_TYPE"], arch = "0", "skx"
        elif {"avx2", "fma"} <= fl:
            base_env["BLIS_ARCH_TYPE"], arch = "3", "haswell"
    os.environ.update(base_env)  # this process's torch (fwd s/pass) too
    work = a.work or tempfile.mkdtemp(prefix="bico-fit-cost-")
    os.makedirs(work, exist_ok=True)
    try:
        t0 = time.time()
        write_inputs(work, s, n)
        gs = groups(s)
        print("## Fit cost at LLM scale: one Qwen2-1.5B-shaped block (hidden %d, MLP %d, "
              "%d/%d heads of %d), %d calibration rows, ridge %g"
              % (s["d"], s["f"], s["H"], s["KV"], s["hd"], n, a.ridge))
        print("# fits: " + ", ".join("%s %d -> %d" % (g, d_in, sum(o for _, o in outs))
                                     for g, d_in, outs, _ in gs)
              + " (q/k/v and gate/up share one accumulation each)")
        print("# date: %s; load average at start: %s; %d cores online"
              % (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 " ".join("%.2f" % x for x in os.getloadavg()), os.cpu_count()))
        if arch:
            print("# BLIS_ARCH_TYPE=%s forces '%s' for libbico and PyTorch alike (as bench/run.py; "
                  "--no-arch-fix keeps BLIS's own choice)" % (base_env["BLIS_ARCH_TYPE"], arch))
        print("# inputs written in %.0f s (not timed)" % (time.time() - t0), flush=True)
        ck = sum(int(np.prod(v)) for v in gen.shapes(t_full).values()) * 2 / 2 ** 20
        # one block's activations, float32, one model: the inputs of the
        # four input groups and the outputs of the seven linears.
        acts = 4.0 * n * (sum(d_in for _, d_in, _, _ in gs)
                          + sum(o for _, _, outs, _ in gs for _, o in outs)) / 2 ** 20
        bound = 1.5 * ck + acts
        L, Ls = t_full["L"], (gen.SIZES["full"] if a.size == "layer" else cfg)["src"]["L"]
        # block forward passes per target block (bico.torch's fit_model):
        # B' once per linear (7) and once to advance before issue 23's
        # change, once per input group (q/k/v, o, gate/up, down) and once
        # to advance now; B once, A and A_ft once each plus their advance
        # (Ls / L per target block).
        src = 2 * (1 + Ls / L)
        before, now = 7 + 1 + 1 + src, len(gs) + 1 + 1 + src
        fwd = "%.1f/%.1f" % (before, now)
        cols = ("side", "thr", "block s", "peak RSS MB", "x%d blocks s" % L, "fwd before/now",
                "fwd s/pass", "target ckpt MB", "1 block acts MB", "bound MB", "rel diff")
        widths = (8, 4, 8, 12, 14, 15, 11, 15, 16, 9, 9)
        print(" ".join(c.rjust(w) for c, w in zip(cols, widths)), flush=True)
        for thr in [int(x) for x in a.threads.split(",")]:
            env = dict(base_env)
            env["OMP_NUM_THREADS"] = env["BLIS_NUM_THREADS"] = str(thr)
            env["BICO_LIBRARY"] = lib
            pass_s = "%.2f" % block_forward_s(s, n, thr)
            outs = {}
            for side in ("lib", "lib+rank", "torch"):
                out = os.path.join(work, "%s-%d" % (side, thr))
                os.makedirs(out, exist_ok=True)
                wall, rss, _ = benchdata.timed_run(
                    [PY, os.path.abspath(__file__), "--child", side, "--work", work,
                     "--out", out, "--shape", json.dumps(s), "--ridge", repr(a.ridge)],
                    env, "llm_fit_cost.py")
                outs[side] = out
                d = "%.1e" % rel_diff(outs["lib"], out, s) if side != "lib" else ""
                vals = (side, str(thr), "%.1f" % wall, "%.0f" % rss, "%.0f" % (wall * L), fwd,
                        pass_s, "%.0f" % ck, "%.0f" % acts, "%.0f" % bound, d)
                print(" ".join(v.rjust(w) for v, w in zip(vals, widths)), flush=True)
        print("# one run each; wall time and peak RSS by /usr/bin/time -v (whole process: Python,")
        print("# the library or torch loaded, input files read); x%d blocks = block s x %d (the fit" % (L, L))
        print("# holds one layer's statistics at a time: its peak does not grow with depth);")
        print("# bound = 1.5 x target checkpoint (bf16, tied head, from the shapes) + one block's")
        print("# activations (float32: inputs of the 4 input groups + outputs of the 7 linears, %d rows);" % n)
        print("# fwd before/now: block forward passes per target block in bico.torch's fit_model: B' per")
        print("# linear + advance before, per input group + advance now; B, A and A_ft with their advance,")
        print("# %d/%d source blocks per target block; fwd s/pass: one target-block forward" % (Ls, L))
        print("# (float32, in-process, best of 3), not part of 'block s';")
        print("# rel diff = ||lib - other|| / ||other|| over every dW, db (lib+rank: 0, the same update)")
        print("# lib+rank = lib asked for the rank too (the library's default before issue 23's change)")
        print(flush=True)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
