"""Peak memory of `python3 -m bico.llm --method distill --output-lora` on
a Qwen2-0.5B-shaped target (hidden 896, 24 layers, MLP 4864, 14/2 heads,
vocabulary 151936, tied head), the models computed in bfloat16.

    python3 bench/llm_distill_memory.py WORK [--windows 16] [--window 64]
        [--steps 2] [--rank 16] [--target 0.5b|1.5b] [--device cuda]

WORK receives three synthetic bf16 folders of that shape (A, A_ft = A
plus a small task vector, B; random weights written tensor by tensor by
bench/llm_scale_gen.py, about 1 GB each, kept for reruns) and random
token ids.  The command runs as a child process; its peak resident set
(getrusage of the child) is printed beside what the run must hold by
arithmetic: the target in bf16, the LoRA factors with their gradients,
Adam's two moments, the best state and the moving average (float32;
--ema), the teacher's compact entries, and what the teacher's phase holds (each model runs from its
folder a block at a time, then the three heads make the entries).  Random weights
make a meaningless teacher: the figures are memory and time, not
quality.  Run on a CPU here; the steps are few because a step of a 0.5B
model on two cores takes minutes.

--target 1.5b: the target (B) has Qwen2-1.5B's shape (hidden 1536, 28
layers, MLP 8960, 12/2 heads), the source pair keeps 0.5B's.  --device
cuda: the command runs there (the teacher streamed to the device a block
at a time, the target trained there); the device's peak (PyTorch's
allocated memory, from the command's own memory lines) is printed
beside the host's.
"""
import argparse
import os
import re
import resource
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import llm_scale_gen as gen  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
from bico.torch.logits import LOGIT_BYTES  # noqa: E402

SHAPE = dict(gen.SIZES["full"]["src"])     # Qwen2-0.5B
TARGET = SHAPE                             # --target 1.5b: Qwen2-1.5B
MiB = float(1 << 20)


def params(s):
    return sum(int(np.prod(sh)) for sh in gen.shapes(s).values())


def block_params(s):
    return sum(int(np.prod(sh)) for k, sh in gen.shapes(s).items()
               if ".layers.0." in k)


def lora_params(s, r):
    n = 0
    for q in gen.PROJ:
        dout, din = gen.proj_dims(s, q)
        n += r * (dout + din)
    return n * s["L"]


def saved_per_token(s, window):
    """Elements autograd keeps for the backward of one decoder layer, per
    token (an estimate from the layer's operations, not a measurement):
    the inputs of the two norms and of the seven linears (the normed
    input shared by q/k/v and by gate/up: 5 d with the attention's output
    and the residuals), q, k, v after the rotation, the attention's
    probabilities (heads x window), SiLU's input, its output and up's
    (the product's two factors) and down's input (4 f)."""
    d, f, H, KV, hd = s["d"], s["f"], s["H"], s["KV"], s["hd"]
    return 5 * d + 4 * f + (H + 2 * KV) * hd + H * window


def rss_mib(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def make(work, target_name):
    made = []
    for name, salt, tau in (("A", "A", 0.0), ("A_ft", "A", 0.01),
                            (target_name, "B", 0.0)):
        path = os.path.join(work, name)
        if os.path.exists(os.path.join(path, "model.safetensors")):
            continue
        t = time.time()
        shape = TARGET if name == target_name else SHAPE
        gen.folder(path, shape, lambda n, sh, salt=salt, tau=tau: (
            gen.weight(n, sh, salt) + (tau * gen.weight(n, sh, "tau")
                                       if tau else 0.0)))
        made.append("%s (%.0f s)" % (name, time.time() - t))
    return made


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--method", choices=("distill", "auto"),
                    default="distill", help="auto: the command's default "
                    "route (the streamed fit, then the distillation)")
    ap.add_argument("--size", choices=("full", "quick"), default="full",
                    help="quick: bench/llm_scale_gen.py's small shape, to "
                    "try the script")
    ap.add_argument("--target", choices=("0.5b", "1.5b"), default="0.5b",
                    help="the target's shape (1.5b: Qwen2-1.5B's; the "
                    "source pair is 0.5B-shaped either way)")
    ap.add_argument("--device", default="cpu",
                    help="the command's --device (cuda: a GPU)")
    ap.add_argument("--checkpoint", choices=("auto", "on", "off"),
                    default="auto")
    args = ap.parse_args()
    global TARGET
    SHAPE.update(gen.SIZES[args.size]["src"])
    TARGET = dict(gen.SIZES[args.size]["tgt"]) if args.target == "1.5b" \
        else SHAPE
    tname = "B" if args.target == "0.5b" else "B15"
    os.makedirs(args.work, exist_ok=True)
    made = make(args.work, tname)
    if made:
        print("wrote " + ", ".join(made), flush=True)
    ids = os.path.join(args.work, "ids.npy")
    rng = np.random.default_rng(0)
    np.save(ids, rng.integers(0, SHAPE["V"], args.windows * args.window,
                              dtype=np.int64))
    out = os.path.join(args.work, "adapter")
    cmd = [sys.executable, "-m", "bico.llm", "--source",
           os.path.join(args.work, "A"), "--source-tuned",
           os.path.join(args.work, "A_ft"), "--target",
           os.path.join(args.work, tname), "--ids", ids, "--output-lora",
           out, "--device", args.device, "--checkpoint", args.checkpoint,
           "--replace", "--method", args.method, "--dtype", "bfloat16",
           "--rank", str(args.rank), "--steps", str(args.steps),
           "--windows", str(args.windows), "--window", str(args.window),
           "--threads", str(args.threads)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "bindings", "python") + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # the resident set after the imports (VmRSS: a child's high-water mark
    # starts from the parent's at the fork)
    base = float(subprocess.run(
        [sys.executable, "-c", "import torch, bico.llm.command; "
         "print([ln.split()[1] for ln in open('/proc/self/status') "
         "if ln.startswith('VmRSS:')][0])"],
        env=env, capture_output=True, text=True, check=True).stdout) / 1024
    t = time.time()
    lines, phase = [], {"fit": 0.0, "teacher": 0.0, "train": 0.0}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=lambda: lines.extend(p.stdout))
    reader.start()
    while p.poll() is None:
        # the resident set sampled, per phase: auto's streamed fit until
        # the teacher's first line, the teacher's until the training's
        # ("distill: LoRA rank ...", after the three models are released)
        k = "fit" if args.method == "auto" else "teacher"
        for marker, name in (("teacher (", "teacher"),
                             ("distill: LoRA rank", "train")):
            if any(ln.startswith(marker) for ln in lines):
                k = name
        phase[k] = max(phase[k], rss_mib(p.pid))
        time.sleep(0.2)
    reader.join()
    secs = time.time() - t
    if p.returncode != 0:
        sys.exit("bico.llm failed (%d):\n%s" % (p.returncode,
                                               "".join(lines)[-3000:]))
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    n, nl = params(TARGET), lora_params(TARGET, args.rank)
    tokens = args.windows * args.window
    print("target: %s shape, %.0f M parameters; --method %s, %d windows "
          "of %d tokens, %d steps, rank %d, bfloat16, %d threads, --device "
          "%s, --checkpoint %s"
          % ("Qwen2-%s" % args.target.upper() if args.size == "full"
             else "small", n / 1e6, args.method, args.windows, args.window,
             args.steps, args.rank, args.threads, args.device,
             args.checkpoint))
    print("%-58s %9s" % ("", "MiB"))
    rows = [
        ("one model in bf16 (the target while it trains)", 2 * n),
        ("teacher's phase: three heads and one block in bf16",
         2 * (SHAPE["V"] * (2 * SHAPE["d"] + TARGET["d"]) +
              max(block_params(SHAPE), block_params(TARGET)))),
        ("(before: the three models in bf16)",
         2 * (n + 2 * params(SHAPE))),
        ("LoRA factors, grads, Adam moments, best, --ema avg (f32)",
         6 * 4 * nl),
        ("teacher entries (top 64 + rest, f32 values, i32 indices)",
         tokens * (64 * 8 + 4)),
        ("one chunk of logits (f32, at most bico.torch.logits.LOGIT_BYTES)",
         min(LOGIT_BYTES, 1024 * SHAPE["V"] * 4)),
        ("a step's saved activations (bf16, 8 windows; estimate)",
         2 * 8 * args.window * TARGET["L"] *
         saved_per_token(TARGET, args.window)),
    ]
    for what, b in rows:
        print("%-58s %9.0f" % (what, b / MiB))
    print("%-58s %9.0f" % ("measured: the interpreter, PyTorch and bico loaded",
                           base))
    if args.method == "auto":
        print("%-58s %9.0f" % ("measured: resident set, streamed fit "
                               "(sampled)", phase["fit"]))
    print("%-58s %9.0f" % ("measured: resident set, teacher phase (sampled)",
                           phase["teacher"]))
    print("%-58s %9.0f" % ("measured: resident set, training (sampled)",
                           phase["train"]))
    print("%-58s %9.0f" % ("measured: peak resident set of the command",
                           peak))
    dev = [float(m.group(1)) for ln in lines for m in [re.search(
        r"on cuda:\d+ now \d+ MB, peak (\d+) MB", ln)] if m]
    if dev:
        print("%-58s %9.0f" % ("measured: peak of the device's tensors "
                               "(the command's lines)", max(dev)))
    elif args.device != "cpu":
        print("the device's peak: not in the command's lines")
    print("wall time %.0f s" % secs)
    for line in lines[-4:]:
        print("  | " + line.rstrip())


if __name__ == "__main__":
    main()
