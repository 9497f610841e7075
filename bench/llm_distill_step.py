"""The distillation's training step beside what a user would write: the
same loss (KL to the proxy-tuned teacher plus half the next-token loss)
and the same rank-16 adapter on every linear layer of the target, trained
by

  plain   a plain PyTorch loop: PEFT-style LoRA modules replacing the
          target's nn.Linear layers (A kaiming-uniform, B zero, scale
          alpha / r), the teacher's log-probabilities precomputed whole
          ([tokens, vocabulary] float32 per batch), Adam;
  bico    bico.torch.distill.distill, as python3 -m bico.llm runs it: the
          factors attached by hooks (bico.torch.distill.Adapter), the
          teacher kept as its top 64 log-probabilities per token and the
          rest's mass (bico.torch.teacher), the head's logits a chunk of
          tokens at a time; with the layers checkpointed (one layer's
          activations held) and without: the command checkpoints when a
          step's activations would pass 256 MiB
          (bico.llm.distill.CHECKPOINT_BYTES), and the line under each
          size says which it runs there.

Time per optimiser step and per 1 000 tokens (the median of the steps
after two warm-up steps), and the teacher's cost (three forward passes
per batch, paid once before training, not per epoch), side by side in one
run, at two sizes: the 128-wide 4-layer decoder of the benchmark's table
(vocabulary 256) and a Qwen2-0.5B shape (896 wide, 24 layers, vocabulary
151 936; random weights in float32: the figures are time, not quality).

    python3 bench/llm_distill_step.py [--sizes small,0.5b] [--steps 8]
        [--batch B] [--window 64] [--threads N] [--work DIR]

The batch is 8 windows at the small size and 2 at 0.5B (a step there
takes seconds on two cores), unless --batch says.
"""
import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))

import llm_scale_gen as gen  # noqa: E402
from bico.llm.families import load_model  # noqa: E402
from bico.llm.distill import lora_modules, _checkpointed  # noqa: E402
from bico.torch import distill as D  # noqa: E402
from bico.torch.teacher import build_teacher  # noqa: E402

SIZES = {
    "small": dict(d=128, L=4, f=344, H=4, KV=2, hd=32, V=256),
    "0.5b": dict(gen.SIZES["full"]["src"]),
}
BATCH = {"small": 8, "0.5b": 2}
RANK, TEXT_WEIGHT, LR = 16, 0.5, 5e-3


def _models(s, work):
    """Three decoders of shape s (A, A_ft = A + a small change, B), float32,
    from bf16 folders written once under work."""
    out = []
    for name, salt in (("A", 1), ("A_ft", 1), ("B", 2)):
        path = os.path.join(work, name)
        if not os.path.exists(os.path.join(path, "config.json")):
            tweak = 0.01 if name == "A_ft" else 0.0

            def make(n, shape, salt=salt, tweak=tweak, name=name):
                w = gen.weight(n, shape, salt)
                if tweak:
                    w = w + tweak * gen.weight(n, shape, 99)
                return w
            gen.folder(path, s, make)
        out.append(load_model(path, dtype=torch.float32).eval())
    return out


class LoraLinear(nn.Module):
    """PEFT's LoRA layer, written plainly: base(x) + s B (A x)."""

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.A = nn.Parameter(torch.empty(r, base.in_features))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))
        self.s = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.A.t() @ self.B.t()) * self.s


def _plain(target, names, batches, logp, steps):
    """Seconds per step of the plain loop."""
    for p in target.parameters():
        p.requires_grad_(False)
    mods = dict(target.named_modules())
    params = []
    for n in names:
        parent, _, leaf = n.rpartition(".")
        lora = LoraLinear(mods[n], RANK, RANK)
        setattr(mods[parent] if parent else target, leaf, lora)
        params += [lora.A, lora.B]
    opt = torch.optim.Adam(params, lr=LR)
    times = []
    for it in range(steps):
        i = it % len(batches)
        x, y = batches[i]
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        z = target(x).float()
        lq = F.log_softmax(z, -1)
        kl = (logp[i].exp() * (logp[i] - lq)).sum(-1).mean()
        ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1))
        (kl + TEXT_WEIGHT * ce).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    for n in names:        # the target as it was
        parent, _, leaf = n.rpartition(".")
        lora = getattr(mods[parent] if parent else target, leaf)
        setattr(mods[parent] if parent else target, leaf, lora.base)
    return times


def _bico(target, names, batches, teacher, steps, checkpoint):
    """Seconds per step of bico.torch.distill.distill."""
    ad = D.Adapter(target, names, RANK)
    stamps = []
    try:
        D.distill(target, teacher, [x for x, _ in batches], 1,
                  lambda m: [0.0], adapter=ad,
                  training=D.Training(steps=steps, lr=LR, every=10 ** 6,
                                      text_weight=TEXT_WEIGHT),
                  progress=lambda i, n, v: stamps.append(
                      time.perf_counter()),
                  targets=[y for _, y in batches], checkpoint=checkpoint)
    finally:
        ad.remove()
    # each step's time: from the previous step's end (the last step also
    # scores the held-out batches: left out)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _row(what, times, tokens):
    t = statistics.median(times[2:]) if len(times) > 3 else min(times)
    return "%-34s %9.3f s %10.3f s" % (what, t, 1000.0 * t / tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="small,0.5b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", default=None,
                    help="where the model folders are written and kept "
                    "(default: a temporary folder)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tmp = None
    if a.work is None:
        tmp = tempfile.TemporaryDirectory(prefix="bico-distill-step-")
        a.work = tmp.name
    print("distillation step, rank-%d adapter on every linear layer, "
          "windows of %d tokens, %d threads, torch %s" % (
              RANK, a.window, torch.get_num_threads(), torch.__version__))
    for size in a.sizes.split(","):
        s = SIZES[size]
        batch = a.batch or BATCH[size]
        src, tun, tgt = _models(s, os.path.join(a.work, size))
        g = torch.Generator().manual_seed(0)
        n_batches = 4
        ids = torch.randint(0, s["V"], (n_batches, batch, a.window + 1),
                            generator=g)
        batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous())
                   for w in ids]
        tokens = batch * a.window
        names = lora_modules(tgt)
        t = time.perf_counter()
        with torch.no_grad():
            logp = [F.log_softmax(tgt(x).float() + tun(x).float() -
                                  src(x).float(), -1) for x, _ in batches]
        t_plain_teacher = (time.perf_counter() - t) / n_batches
        t = time.perf_counter()
        teacher = build_teacher(src, tun, tgt, [x for x, _ in batches], None,
                                k=64)
        t_bico_teacher = (time.perf_counter() - t) / n_batches
        del src, tun
        print("\n%s (d %d, %d layers, vocabulary %d): %d LoRA layers, "
              "batches of %d x %d tokens" % (size, s["d"], s["L"], s["V"],
                                             len(names), batch, a.window))
        print("%-34s %11s %12s" % ("", "per step", "per 1k tokens"))
        plain = _plain(tgt, names, batches, logp, a.steps)
        print(_row("plain loop", plain, tokens), flush=True)
        del logp
        ck = _bico(tgt, names, batches, teacher, a.steps, True)
        print(_row("bico, layers checkpointed", ck, tokens), flush=True)
        nock = _bico(tgt, names, batches, teacher, a.steps, False)
        print(_row("bico, not checkpointed", nock, tokens), flush=True)
        teacher.close()
        p = statistics.median(plain[2:]) if len(plain) > 3 else min(plain)
        for what, ts in (("checkpointed", ck), ("not checkpointed", nock)):
            b = statistics.median(ts[2:]) if len(ts) > 3 else min(ts)
            print("bico %s / plain: %.2f" % (what, b / p))
        print("the command at this size: %s" % (
            "checkpointed" if _checkpointed(tgt, [x for x, _ in batches])
            else "not checkpointed"))
        print("teacher, once per batch before training (three forwards): "
              "plain %.3f s, bico %.3f s (top 64 kept)"
              % (t_plain_teacher, t_bico_teacher))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
