"""Can `bico transfer` choose alpha from the calibration file alone?

A measurement, not part of `make bench-quality`: for each real cell of the
LLM bench (the models cached by run.py, BICO_LLM_CACHE), the `bico`
command's update dW (alpha 1) is scored with what the target's calibration
file holds (input rows x_i, output gradients g_i of the summed next-byte
loss), per row s_i = sum over modules of g_i^T dW x_i (linear modules and
RMSNorm scales), and a quadratic model of the loss change

    dL(alpha) ~ alpha b + alpha^2 a / 2,   b = sum_i s_i,
    a = sum_i s_i^2 (per row), sum_w (sum_{i in w} s_i)^2 (per window), or
    sum_i (s_i - mean s)^2 (per row, centred)

(an empirical-Fisher curvature; the tied embedding's change is not seen by
the file: no module records the head's or the embedding's rows).  The maps
are solved on the first 6 windows' rows, b and a on the last 2 (held out).
Printed beside the true next-byte loss (held-out task text) at the alpha it
picks, at alpha 1 and at zero-shot.

    BICO_LLM_CACHE=/work/llmcache python3 bench/quality_llm/alpha_quadratic.py
"""
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
from run import lm, pl  # noqa: E402

T = 64          # rows per window
FIT_W = 6       # windows for the maps
ALL_W = 8


def cut(src, dst, rows):
    t, _, _ = pl.load(src)
    pl.save(dst, {k: np.ascontiguousarray(v[:rows]) for k, v in t.items()})


def transfer(bench, tname, kind, scalib, tcalib, out):
    spec = run.TARGETS[tname]
    cmd = [run.BICO, "transfer", "--method", "bico",
           "--source-base", bench.pretrained(run.SOURCE),
           "--target-base", bench.pretrained(spec), "--threads", "1",
           "--quiet", "--alpha", "1", "--output", out, "--source-calib", scalib,
           "--target-calib", tcalib]
    if kind == "full":
        cmd += ["--source-tuned", bench.finetuned(run.SOURCE)]
    else:
        cmd += ["--lora", bench.lora(run.SOURCE)[0], "--merge-into-base"]
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    sd, _, _ = pl.load(out)
    return sd


def rows_s(calib, b0, delta, lo, hi):
    """s_i over rows lo..hi: sum over modules of g_i^T dW x_i."""
    s = np.zeros(hi - lo)
    for k, d in delta.items():
        if not k.endswith(".weight"):
            continue
        m = k[:-len(".weight")]
        if m + ".input" not in calib:
            continue
        X = calib[m + ".input"][lo:hi].astype(np.float64)
        G = calib[m + ".output_grad"][lo:hi].astype(np.float64)
        d = d.astype(np.float64)
        if d.ndim == 2:
            s += np.einsum("ij,ij->i", G @ d, X)
        else:   # RMSNorm: y = w * x / rms(x)
            xh = X / np.sqrt((X * X).mean(1, keepdims=True) + 1e-6)
            s += (G * xh) @ d
    return s


def main():
    torch.set_num_threads(1)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    bench = run.Bench(log)
    tmp = tempfile.mkdtemp(prefix="alphaq-")
    cells = [(t, k) for t in ("planted", "same", "narrow", "wide")
             for k in ("full", "lora")]
    if len(sys.argv) > 1:
        cells = [tuple(c.split("/")) for c in sys.argv[1].split(",")]
    print("%-14s %7s %7s %7s %7s | %6s %6s %6s %6s | %7s %7s %7s %7s %7s "
          "%7s" % ("cell", "b_ho", "se_b", "a_row", "a_win", "a*row",
                   "a*win", "a*all", "a*cen", "zs", "a=1", "a*row", "a*win",
                   "a*cen", "best"))
    for tname, kind in cells:
        spec = run.TARGETS[tname]
        sc = bench.calib_file(run.SOURCE, ALL_W)
        tc = bench.calib_file(spec, ALL_W)
        scut = os.path.join(tmp, "s.safetensors")
        tcut = os.path.join(tmp, "t.safetensors")
        cut(sc, scut, FIT_W * T)
        cut(tc, tcut, FIT_W * T)
        sd = transfer(bench, tname, kind, scut, tcut,
                      os.path.join(tmp, "out.safetensors"))
        b = bench.model(bench.pretrained(spec))
        b0 = {k: v.detach().numpy().copy() for k, v in b.state_dict().items()}
        delta = {k: np.asarray(sd[k], np.float64) - b0[k] for k in b0}
        calib, _, _ = pl.load(tc)
        s = rows_s(calib, b0, delta, FIT_W * T, ALL_W * T)
        sw = s.reshape(-1, T).sum(1)
        bh = s.sum()
        se = np.sqrt(len(s)) * s.std()
        a_row, a_win = (s * s).sum(), (sw * sw).sum()
        s_all = rows_s(calib, b0, delta, 0, ALL_W * T)
        a_all = (s_all * s_all).sum()
        pick = lambda bb, aa: float(np.clip(-bb / aa, 0, 2)) if aa > 0 else 0.
        arow, awin, aall = pick(bh, a_row), pick(bh, a_win), \
            pick(s_all.sum(), a_all)
        # centred: the rows' covariance (the mean gradient is no curvature)
        acen = pick(bh, ((s - s.mean()) ** 2).sum())

        def loss(a):
            m = lm.load(b.cfg, {k: b0[k] + a * delta[k] for k in b0})
            return lm.mean_loss(m, bench.eval_task)
        grid = {a: loss(a) for a in (0.0, 0.25, 0.5, 0.75, 1.0)}
        best = min(grid, key=grid.get)
        print("%-14s %7.2f %7.2f %7.1f %7.1f | %6.3f %6.3f %6.3f %6.3f | "
              "%7.4f %7.4f %7.4f %7.4f %7.4f %4.2f:%.4f"
              % ("%s/%s" % (tname, kind), bh, se, a_row, a_win, arow, awin,
                 aall, acen, grid[0.0], grid[1.0], loss(arow), loss(awin),
                 loss(acen), best, grid[best]), flush=True)


if __name__ == "__main__":
    main()
