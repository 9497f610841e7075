"""bico.llm.distill: the command's distillation route for decoders.

The target (its LoRA factors, or every weight) is trained on the task
text's windows towards the proxy-tuned teacher softmax(z_B + z_A_ft -
z_A) (bico.torch.distill): the teacher is computed once per window with
the three models, kept compactly (top-k + the rest's mass for a large
vocabulary, spilled to a temporary folder beyond a memory budget), and
the source pair can then be released; the student trains with Adam, and
its state is chosen on the held-out windows by their next-token loss
(the untouched target among the candidates).  Progress lines say the
elapsed time and an estimate for every phase.
"""
import math
import sys
import time
from collections import namedtuple
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from .. import _heap
from .._status import BicoError, E_ARG
from ..torch import logits as _lg
from ..torch import teacher as _t
from ..torch import distill as _d
from ..torch.tied import _tied_groups

# PEFT's names of a Llama-family decoder's linear layers
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                  "up_proj", "down_proj")

# the windows' own next-token loss beside the teacher's KL (docs/llm.md:
# measured on the LLM table)
TEXT_WEIGHT = 0.5

Result = namedtuple("Result", "step losses held per_window state adapter "
                    "trained report seconds")


# A signal that asked the command to stop (set by its handler): raised
# again at the next step, since a handler's exception raised inside a
# finalizer is dropped by Python
STOP = []


def check_stop():
    if STOP:
        raise SystemExit(128 + STOP[0])


class Clock(object):
    """Prints a phase's progress with the elapsed time and an estimate of
    what is left, at most every `every` seconds (and at the end)."""

    def __init__(self, what, total, log, every=10.0):
        self.what, self.total, self.log, self.every = what, total, log, every
        self.t0 = self.last = time.time()

    def __call__(self, done, extra=""):
        """extra: a string, or a function giving it (called only when the
        line is printed)."""
        check_stop()
        now = time.time()
        if done < self.total and now - self.last < self.every:
            return
        if callable(extra):
            extra = extra()
        self.last = now
        el = now - self.t0
        eta = el / done * (self.total - done) if done else float("nan")
        self.log("%s: %d/%d, %s elapsed, about %s left%s" % (
            self.what, done, self.total, _secs(el), _secs(eta),
            (" (" + extra + ")") if extra else ""))


def memory():
    """"resident N MB, peak M MB": this process's resident set now and its
    peak so far (Linux's VmRSS and VmHWM), for the phases' log lines (what
    remains after each phase); "" where /proc does not say.  Once the
    process has used a GPU, ", on cuda:N now N MB, peak M MB" follows:
    the memory PyTorch's tensors hold there (allocated, not its cache)."""
    return _host_memory() + _device_memory()


def _device_memory():
    try:
        if not torch.cuda.is_initialized():
            return ""
        i = torch.cuda.current_device()
        return ", on cuda:%d now %.0f MB, peak %.0f MB" % (
            i, torch.cuda.memory_allocated(i) / 2 ** 20,
            torch.cuda.max_memory_allocated(i) / 2 ** 20)
    except (RuntimeError, AttributeError):
        return ""


def _host_memory():
    got = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k = line.split(":")[0]
                if k in ("VmRSS", "VmHWM"):
                    got[k] = int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return ""
    if len(got) < 2:
        return ""
    return "resident %.0f MB, peak %.0f MB" % (got["VmRSS"], got["VmHWM"])


def _secs(s):
    if not math.isfinite(s):
        return "?"
    return "%.0f s" % s if s < 120 else "%.1f min" % (s / 60)


def _matches(name, pats):
    return any(name == p or name.endswith("." + p) for p in pats)


def lora_modules(model, names=LINEAR_MODULES):
    """The nn.Linear modules of model that PEFT's target_modules list
    `names` selects (a module matches an entry equal to its name or to a
    dotted suffix of it), in model order; a head tied to the embedding is
    never one (a pair on it would move the embedding in PEFT only)."""
    tied = set(k for o, al in _tied_groups(model) for k in [o] + al)
    out = [n for n, m in model.named_modules()
           if isinstance(m, nn.Linear) and _matches(n, names)
           and n + ".weight" not in tied]
    if not out:
        raise BicoError(E_ARG, "distill: no linear layer of the target "
                        "matches target modules %s" % ", ".join(names))
    return out


def saved_parameters(model, names):
    """{parameter name: parameter} of the modules `names` selects (PEFT's
    modules_to_save: stored whole), tied copies refused."""
    tied = set(k for o, al in _tied_groups(model) for k in [o] + al)
    out = {}
    for n, m in model.named_modules():
        if n and _matches(n, names):
            for pn, p in m.named_parameters(recurse=False):
                full = n + "." + pn
                if full in tied:
                    raise BicoError(E_ARG, "distill: %s is tied to another "
                                    "tensor (the embedding and the head); "
                                    "train it by --output (dense), not as "
                                    "a saved module" % full)
                if p.is_floating_point():
                    out[full] = p
    return out


@dataclass
class Student(object):
    """What the distillation trains: mode "lora", factors of rank `rank`
    (lora_alpha: PEFT's scale, None: rank) on the linear layers `modules`
    (PEFT names; init: {module: (B, A)} warm-start pairs, None for PEFT's
    start) and the parameters of the `save` modules trained whole; mode
    "dense": every floating parameter of the target.  checkpoint: whether
    the target's layers recompute their forward in the backward pass
    (one layer's activations held, about 40 % more time a step): True,
    False, or "auto" (when a step's activations would pass a quarter of
    the memory available, at least CHECKPOINT_BYTES; _checkpointed)."""
    mode: str = "lora"
    rank: int = 16
    lora_alpha: object = None
    modules: tuple = tuple(LINEAR_MODULES)
    save: tuple = ()
    init: object = None
    checkpoint: object = "auto"


@dataclass
class TeacherStore(object):
    """How the teacher is kept: the top k log-probabilities a token, up
    to budget bytes in memory, beyond it in a nameless file in spill_dir;
    logits chunk tokens at a time; shared: the source's vocabulary when
    the target's grew past it (the teacher over those ids,
    bico.llm.vocab "grown")."""
    k: int = 64
    budget: int = 1 << 30
    spill_dir: object = None
    chunk: int = _lg.TOKEN_CHUNK
    shared: object = None


def run(source, source_tuned, target, cal, log, student=None,
        training=None, store=None, release=None, pair=None, teacher=None,
        own=None, ranks=None):
    """Distils target towards the proxy-tuned teacher on cal (a
    Calibration: batches of (ids, next ids), held_out the same).

    student: a Student (what trains; None: rank-16 factors on the linear
    layers); training: a bico.torch.distill.Training (steps / lr None:
    the measured defaults, docs/llm.md; None: text_weight TEXT_WEIGHT);
    store: a TeacherStore (how the teacher is kept).  release(): called once
    the teacher is computed (the source pair is no longer needed).
    pair: a dict {"source": model, "tuned": model} to take the pair from
    (source and source_tuned None), emptied once the teacher is computed:
    nothing of the caller's then holds the pair while the target trains
    (arguments of a call can outlive the release).
    teacher: a Teacher of cal's batches already computed (for example
    from the folders a block at a time, bico.llm.stream.teacher; source
    and source_tuned are then not used), closed by this call.
    training.text_weight: the loss adds this times the windows' own
    next-token cross-entropy (0: the teacher alone); teacher_weight scales
    the teacher's KL (0: the text alone, a control).  training.patience:
    training stops once that many held-out checks (every `every` steps) in
    a row found nothing better (None: every step runs).  own: how many of
    cal's batches, the first ones, are the user's own text, whose next
    tokens the text loss learns (None: all); the others (the teacher's
    written text, its next tokens samples) are learnt from the teacher's KL
    alone, unless there is no teacher.  ranks: a bico.llm.ranks.Ranks of
    several processes (every one making this call on the same cal): each
    keeps its rows of every batch (bico.llm.shard) and computes the teacher
    of those alone (a teacher given is then that of its rows:
    RowShard(ranks, cal.batches).local), the gradients summed over the
    ranks: every rank ends with the factors one process trains on cal, to
    float rounding; the held-out losses are every window's, gathered.
    Returns a Result; target is left in the chosen state (the factors still
    attached in mode "lora": result.adapter.remove() detaches)."""
    st = Student() if student is None else student
    tr = _d.Training(text_weight=TEXT_WEIGHT) if training is None \
        else training
    ts = TeacherStore() if store is None else store
    mode = st.mode
    if st.checkpoint not in ("auto", True, False):
        raise BicoError(E_ARG, "distill: Student.checkpoint must be 'auto', "
                        "True or False, got %r" % (st.checkpoint,))
    teacher_k, budget, spill_dir, chunk, shared = (
        ts.k, ts.budget, ts.spill_dir, ts.chunk, ts.shared)
    if mode not in ("lora", "dense"):
        raise BicoError(E_ARG, "distill: mode must be 'lora' or 'dense', "
                        "got %r" % (mode,))
    t0 = time.time()
    if pair is not None:
        source, source_tuned = pair["source"], pair["tuned"]
    dev = next(target.parameters()).device
    shard = held = None
    if ranks is not None and ranks.size > 1:
        from .shard import RowShard
        shard, held = RowShard(ranks, cal.batches), \
            RowShard(ranks, cal.held_out)
        inputs = [x for x, _ in shard.local]
    else:
        inputs = [x for x, _ in cal.batches]
    inputs = [x.to(dev) for x in inputs]
    if teacher is None and not tr.teacher_weight:   # the text alone
        teacher = _t.NoTeacher(len(inputs))
    if teacher is None:
        clock = Clock("teacher (three models per window)", len(inputs), log)
        teacher = _t.build_teacher(source, source_tuned, target, inputs,
                                   None, k=teacher_k, budget=budget,
                                   spill_dir=spill_dir, chunk=chunk,
                                   progress=lambda i, n: clock(i),
                                   shared=shared)
    try:
        if isinstance(teacher, _t.NoTeacher):
            log("teacher: none: %d batches learnt by their own next-token "
                "loss" % len(teacher))
        elif hasattr(teacher, "complete"):      # bico.llm.across
            teacher.complete(target, inputs, chunk)
            deeper = getattr(teacher, "levels", [])
            log("teacher: the next token's first byte (the tokenizers "
                "differ), at %d of %d positions (%.0f %%: where both "
                "tokenizations start a token)%s, %.1f MB" % (
                    teacher.aligned, teacher.positions,
                    100.0 * teacher.aligned / max(1, teacher.positions),
                    "".join("; its byte %d at %d (where the target has "
                            "outputs to tell apart there)" % (k + 2, c)
                            for k, c in enumerate(deeper)),
                    teacher.bytes_memory / 1e6))
        else:
            log("teacher: %d batches, %.1f MB in memory, %.1f MB "
                "spilled%s" % (
                    len(teacher), teacher.bytes_memory / 1e6,
                    teacher.bytes_disk / 1e6, "" if teacher.k is None or
                    teacher.k >= (teacher.outputs or 0) else
                    " (top %d of %d outputs kept per token)" % (
                        teacher.k, teacher.outputs)))
        if release is not None:
            release()
        if pair is not None:
            pair.clear()
        # this frame's own references too: the pair is freed only when no
        # one holds it (a 0.5B pair is 2 GB in bf16)
        del source, source_tuned
        _heap.trim()
        log("memory before training (the teacher kept, the source pair "
            "released): %s" % memory())
        ys = [y for _, y in cal.batches] if shard is None else \
            shard.targets()
        targets = [y.to(dev) if y is not None and (
            own is None or i < own or isinstance(teacher, _t.NoTeacher))
            else None for i, y in enumerate(ys)]
        if shard is not None:
            from .shard import ShardedTeacher
            teacher = ShardedTeacher(teacher, shard)
            inputs = [None if x is None else x.to(dev)
                      for x in shard.inputs()]
        return _train(target, teacher, inputs, cal, log, st, tr, chunk, t0,
                      targets, (shard, held))
    finally:
        teacher.close()


def _defaults(mode, steps, lr, n_batches):
    """The measured defaults (docs/llm.md): Adam with a cosine schedule,
    about 20 passes over the fit batches (at least 200 steps, at most
    1200), lr 5e-3 for factors and 2e-3 for dense weights."""
    if steps is None:
        steps = int(min(1200, max(200, 20 * n_batches)))
    if lr is None:
        lr = 5e-3 if mode == "lora" else 2e-3
    return steps, lr


def _train(target, teacher, inputs, cal, log, student, training, chunk, t0,
           targets, shards=(None, None)):
    """The training of run(): the Student's adapter (or its dense
    weights) trained as the Training says, its steps and lr resolved
    here (_defaults) when None."""
    mode, rank, seed = student.mode, student.rank, training.seed
    steps, lr = _defaults(mode, training.steps, training.lr, len(inputs))
    tr = replace(training, steps=steps, lr=lr)
    patience = tr.patience
    ck = _checkpointed(target, inputs, student.checkpoint)
    adapter, params, trained = None, None, {}
    if mode == "lora":
        names = lora_modules(target, student.modules)
        save, init = student.save, student.init
        trained = saved_parameters(target, save) if save else {}
        adapter = _d.Adapter(target, names, rank, student.lora_alpha,
                             init=init, seed=seed)
        extra = list(trained.values())
        for p in extra:
            p.requires_grad_(True)
        log("distill: LoRA rank %d on %d layers (%s start)%s, %d steps" % (
            rank, len(names), "warm" if init else "cold",
            (", %d saved tensors" % len(extra)) if extra else "", steps))
    else:
        params = [p for p in target.parameters() if p.is_floating_point()]
        log("distill: every weight of the target (%d tensors), %d steps"
            % (len(params), steps))
    nwin = sum(len(x) for x, _ in cal.held_out)
    per_window = {}
    shard, held = shards

    def windows(m):
        if held is None:
            return _d.window_losses(m, cal.held_out, chunk)
        from .shard import window_losses
        return window_losses(m, held, chunk)

    def held_losses(m):
        v = windows(m)
        per_window[len(per_window)] = v
        return v
    clock = Clock("distill steps", steps, log)
    rep = []
    if adapter is not None and trained:
        step, losses = _with_saved(target, teacher, inputs, nwin,
                                   held_losses, adapter, trained, tr,
                                   chunk, clock, rep, targets, shard, ck)
    else:
        step, losses = _d.distill(
            target, teacher, inputs, nwin, held_losses, params=params,
            adapter=adapter, training=tr, chunk=chunk,
            progress=lambda i, n, v: _stepped(clock, i, v),
            report=rep, targets=targets, checkpoint=ck, parallel=shard)
    per = windows(target)
    ran = max(losses)
    log("distill: kept step %d of %d (held-out loss %.4f; untouched "
        "target %.4f)%s" % (step, steps, losses[step], losses[0],
                            "" if ran >= steps else
                            "; stopped at step %d: %d checks without a "
                            "better held-out loss" % (ran, patience)))
    log("memory after training (%s): %s" % (
        "layers checkpointed" if ck else "layers not checkpointed",
        memory()))
    state = adapter.state() if adapter is not None else None
    return Result(step, losses, nwin, per, state, adapter,
                  {k: p.detach().clone() for k, p in trained.items()},
                  rep[0] if rep else None, time.time() - t0)


# Student(checkpoint="auto"): the layers are checkpointed (each keeps its
# input and recomputes its forward in the backward pass: one layer's
# activations held, about 40 % more time a step) when a step's activations
# (autograd's saved tensors, estimated) would pass a quarter of the memory
# available (the device's free memory, or the system's MemAvailable), and
# at least CHECKPOINT_BYTES; below, memory is not the constraint and the
# step runs as fast as a plain loop's (docs/performance.md, "The
# distillation's step").
CHECKPOINT_BYTES = 256 << 20


def _available(device):
    """Bytes of memory available to the step: the accelerator's free
    memory, or the system's MemAvailable; None when unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, RuntimeError, AttributeError):
        pass
    return None


def _checkpointed(target, inputs, mode="auto"):
    """Whether the distillation checkpoints the target's layers: mode
    True or False, or "auto": when a step's activations (about 12 d + 4 f
    floats per token per layer, d the width, f the MLP's) would pass
    max(CHECKPOINT_BYTES, a quarter of the memory available); a model
    whose size is not known is checkpointed."""
    if mode is not True and mode is not False:
        mode = None
    if mode is not None:
        return mode
    cfg = getattr(target, "config", None)

    def field(k):       # a config.json dict, or transformers' config
        return cfg.get(k) if isinstance(cfg, dict) else getattr(cfg, k, None)
    d, f = field("hidden_size"), field("intermediate_size")
    layers = field("num_hidden_layers")
    if not (d and f and layers):
        return True
    tokens = max((x.numel() for x in inputs if x is not None), default=0)
    ps = getattr(target, "parameters", None)
    p = next(ps(), None) if ps is not None else None
    avail = _available(p.device) if p is not None else \
        _available(torch.device("cpu"))
    limit = max(CHECKPOINT_BYTES, (avail or 0) // 4)
    return 4 * tokens * layers * (12 * d + 4 * f) > limit


def _stepped(clock, i, value):
    """After training step i (from 1): the progress line, and the test
    hook's point "step" (bico.llm.runtime.test_point)."""
    from .runtime import test_point
    test_point("step", i - 1)
    # read from the device only when the line is printed
    clock(i, lambda: "loss %.4f" % float(value))


def _with_saved(target, teacher, inputs, nwin, held_losses, adapter, saved,
                training, chunk, clock, rep, targets, shard=None,
                checkpoint=True):
    """distill with the factors and whole saved tensors training together
    (one Adam over both; the saved tensors' state kept with the
    factors')."""
    params = list(saved.values())

    class _Both(object):
        def parameters(self):
            return adapter.parameters() + params

        def state(self):
            return (adapter.state(), [p.detach().clone() for p in params])

        def load(self, st):
            adapter.load(st[0])
            with torch.no_grad():
                for p, v in zip(params, st[1]):
                    p.copy_(v)
    both = _Both()
    out = _d.distill(target, teacher, inputs, nwin, held_losses,
                     adapter=both, training=training, chunk=chunk,
                     progress=lambda i, n, v: _stepped(clock, i, v),
                     report=rep, targets=targets, checkpoint=checkpoint,
                     parallel=shard)
    return out


def warn(msg):
    print("python3 -m bico.llm: warning: %s" % msg, file=sys.stderr)
