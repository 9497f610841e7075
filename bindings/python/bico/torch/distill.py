"""bico.torch.distill: the target trained, without labels, towards the
proxy-tuned teacher p = softmax(z_B + z_A_ft - z_A) (METHODS.md,
"Distillation toward the proxy-tuned teacher").

The teacher needs only logits on shared outputs: language models with one
tokenizer, classifiers over one label set.  The teacher itself, kept
compactly, is bico.torch.teacher's; the augmentations bico.torch.augment's;
the chunked logits bico.torch.logits'.  Here:

- Adapter: LoRA factors on frozen nn.Linear layers, attached by forward
  hooks (the model keeps its names, dtype and device; only the factors
  train): PEFT's start (A random, B zero) or given pairs (a warm start).
- distill(): Adam on the mean KL(p || q) over the fit batches' tokens
  (or samples), in a seeded order; every `every` steps the held-out loss,
  and the best state kept by bico.torch.choose.pick (the untouched target
  is step 0; another step must beat it by more than the standard error
  over the held-out batches).
- distill_model(): transfer_model's route for any nn.Module, with
  augmented views and the scale chosen on the held-out batches.

Nothing here calls numpy on a model's tensors in the training loop, and
every tensor is created on the model's device.
"""
import math
from dataclasses import dataclass
import time

import torch
import torch.nn as nn

from .. import _heap
from .._status import BicoError, E_ARG, E_NONFINITE, E_SHAPE
from .choose import pick
from .augment import _augmentation
from .logits import (TOKEN_CHUNK, _bounded, _chunks, _hidden, _logits,
                     _logits_keep, _split)
from .teacher import (Grouped, NoTeacher, _teacher_logprobs, build_teacher,
                      kl_to_teacher)

__all__ = ["Adapter", "Training", "distill", "distill_model",
           "window_losses", "choose_scale", "SCALES"]


class Adapter(object):
    """LoRA factors on nn.Linear layers of model, attached by forward
    hooks: the layer computes W x + b + s B (A x), s = alpha / r (PEFT's
    scale), with B [d_out, r] and A [r, d_in] float32 parameters on the
    layer's device; the model's own parameters are frozen.

    modules: names of nn.Linear modules of model.  init: None for PEFT's
    start (A uniform in +-1/sqrt(d_in), the bound of kaiming_uniform with
    a = sqrt(5); B zero: the model starts unchanged), or {module: (B, A)}
    pairs whose product s B A is the starting update (a warm start; a
    module missing there starts as PEFT's)."""

    def __init__(self, model, modules, r, alpha=None, init=None, seed=0):
        if not (isinstance(r, int) and r >= 1):
            raise BicoError(E_ARG, "distill: the adapter's rank must be a "
                            "positive integer, got %r" % (r,))
        self.r = r
        self.alpha = float(r if alpha is None else alpha)
        self.scale = self.alpha / r
        named = dict(model.named_modules())
        g = torch.Generator().manual_seed(seed)
        self.factors, self._hooks, self._frozen = {}, [], []
        for p in model.parameters():
            if p.requires_grad:
                self._frozen.append(p)
                p.requires_grad_(False)
        for name in modules:
            m = named.get(name)
            if not isinstance(m, nn.Linear):
                raise BicoError(E_ARG, "distill: %r is not an nn.Linear of "
                                "the model" % (name,))
            dev = m.weight.device
            dout, din = m.weight.shape
            pair = (init or {}).get(name)
            if pair is not None:
                b, a = (torch.as_tensor(v).float() for v in pair)
                if b.shape != (dout, r) or a.shape != (r, din):
                    raise BicoError(E_SHAPE, "distill: warm-start pair of "
                                    "%s has shapes %s and %s, not %s and "
                                    "%s" % (name, tuple(b.shape),
                                            tuple(a.shape), (dout, r),
                                            (r, din)))
                b, a = b / self.scale, a
            else:
                bound = 1.0 / math.sqrt(din)
                a = (torch.rand(r, din, generator=g) * 2 - 1) * bound
                b = torch.zeros(dout, r)
            A = nn.Parameter(a.to(dev).contiguous())
            B = nn.Parameter(b.to(dev).contiguous())
            self.factors[name] = (B, A)
            self._hooks.append(m.register_forward_hook(self._hook(B, A)))

    def _hook(self, B, A):
        s = self.scale

        def f(m, args, out):
            x = args[0]
            d = (x.to(A.dtype) @ A.t()) @ B.t()
            return out + (d * s).to(out.dtype)
        return f

    def parameters(self):
        return [p for pair in self.factors.values() for p in pair]

    def state(self):
        """A copy of the factors {module: (B, A)} (B without the scale)."""
        return {n: (b.detach().clone(), a.detach().clone())
                for n, (b, a) in self.factors.items()}

    def load(self, state):
        with torch.no_grad():
            for n, (b, a) in state.items():
                self.factors[n][0].copy_(b)
                self.factors[n][1].copy_(a)

    def update(self, name):
        """The module's update s B A (float64, on the CPU)."""
        b, a = self.factors[name]
        return (b.detach().double() @ a.detach().double()).cpu() * self.scale

    def remove(self):
        """Detaches the hooks and unfreezes what was trainable before."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []


def _student_loss(model, x, entry, forward, chunk, y=None, text_weight=0.0,
                  teacher_weight=1.0, outputs=None, scale=1.0):
    """KL(teacher || model) on one batch, plus text_weight times the
    next-token cross-entropy against y (the text's own next tokens) when
    given, times scale (this process's share of a batch divided among
    ranks), backpropagated; returns its value as a detached 0-dim tensor
    on the model's device (read it with float() where the host needs it:
    nothing here waits for the device).  A decoder called on token
    ids (forward None) has its logits computed chunk by chunk: the hidden
    states' gradient is gathered over the chunks, then sent through the
    body once."""
    sp = _split(model) if forward is None else None
    if sp is None:
        z = _logits_keep(forward(model, x) if forward is not None
                         else model(x))
        loss = teacher_weight * kl_to_teacher(z, entry, outputs) \
            if entry is not None else z.sum() * 0.0
        if y is not None and text_weight:
            loss = loss + text_weight * torch.nn.functional.cross_entropy(
                z.reshape(-1, z.shape[-1]).float(), y.reshape(-1))
        loss = loss * scale
        loss.backward()
        return loss.detach()
    body, head = sp
    h = _hidden(body, x)
    flat = h.reshape(-1, h.shape[-1])
    n = flat.shape[0]
    hd = flat.detach().requires_grad_(True)
    total = None
    flat_entry = _flat_entry(entry, n) if entry is not None else None
    yf = None if y is None or not text_weight else y.reshape(-1)
    for s, e in _chunks(n, _bounded(chunk, head)):
        z = head(hd[s:e])
        loss = teacher_weight * kl_to_teacher(
            z, _rows(flat_entry, s, e), outputs) if entry is not None \
            else z.sum() * 0.0
        if yf is not None:
            loss = loss + text_weight * torch.nn.functional.cross_entropy(
                z.float(), yf[s:e])
        loss = loss * ((e - s) / n * scale)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    flat.backward(hd.grad)
    return total


class _Checkpointed(object):
    """Gradient checkpointing of a decoder's layers (model.model.layers):
    each layer keeps only its input for the backward pass and recomputes
    its forward there, so the activations held for a step are those of
    one layer, not of every layer (memory that does not grow with depth).
    A no-op for models without such layers."""

    def __init__(self, model, on=True):
        layers = getattr(getattr(model, "model", None), "layers", None)
        self.layers = list(layers) if on and isinstance(
            layers, nn.ModuleList) else []
        self.saved = []

    def __enter__(self):
        from torch.utils.checkpoint import checkpoint

        def wrap(f):
            return lambda *a, **kw: checkpoint(f, *a, use_reentrant=False,
                                               **kw)
        for layer in self.layers:
            self.saved.append(vars(layer).get("forward"))
            layer.forward = wrap(layer.forward)
        return self

    def __exit__(self, *exc):
        for layer, f in zip(self.layers, self.saved):
            if f is None:        # the class's forward again
                del layer.forward
            else:
                layer.forward = f
        self.saved = []
        return False


def _flat_entry(entry, n):
    """A teacher entry with its token dimensions flattened to n rows."""
    if isinstance(entry, torch.Tensor):
        return entry.reshape(n, entry.shape[-1])
    if isinstance(entry, Grouped):
        pt = entry.path
        if pt is not None:
            pt = pt._replace(logp=pt.logp.reshape((n,) + pt.logp.shape[-2:]),
                             weight=pt.weight.reshape(n, -1),
                             base=pt.base.reshape(n, -1))
        return Grouped(entry.logp.reshape(n, entry.logp.shape[-1]),
                       entry.mask.reshape(n), entry.group, pt)
    vals, idx, rest = entry
    return (vals.reshape(n, vals.shape[-1]), idx.reshape(n, idx.shape[-1]),
            rest.reshape(n))


def _rows(entry, s, e):
    if isinstance(entry, torch.Tensor):
        return entry[s:e]
    if isinstance(entry, Grouped):
        pt = entry.path
        if pt is not None:
            pt = pt._replace(logp=pt.logp[s:e], weight=pt.weight[s:e],
                             base=pt.base[s:e])
        return Grouped(entry.logp[s:e], entry.mask[s:e], entry.group, pt)
    return tuple(t[s:e] for t in entry)


def _schedule(opt, steps, kind, warmup):
    if kind == "constant":
        return None

    def f(s):
        if warmup and s < warmup:
            return (s + 1) / warmup
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        return 1.0
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


@dataclass
class Training(object):
    """How distill() trains: steps (None: 1200), lr (None: 5e-3), every
    (held-out checks every that many steps), schedule ("cosine" or
    "constant"), warmup (steps), seed (the batches' order, the factors'
    start), patience (checks without a better held-out loss before it
    stops; None: every step runs), text_weight (the next-token loss's
    weight, targets needed), teacher_weight (the teacher's KL's), ema
    (None, or a decay in (0, 1): the held-out checks score and keep the
    trained tensors' exponential moving average, ema * average + (1 -
    ema) * weights after each step from an average of zero, divided by
    1 - ema^step: the steps' weights averaged, recent ones weighing
    more, not the weights of that step)."""
    steps: object = None
    lr: object = None
    every: int = 25
    schedule: str = "cosine"
    warmup: int = 0
    seed: int = 0
    patience: object = None
    text_weight: float = 0.0
    teacher_weight: float = 1.0
    ema: object = None


def distill(model, teacher, inputs, held, held_losses, params=None,
            adapter=None, training=None, forward=None, chunk=TOKEN_CHUNK,
            progress=None, report=None, targets=None, checkpoint=False,
            parallel=None):
    """Trains model towards the teacher (a Teacher whose batch i is
    inputs[i]) and leaves it in the best held-out state.

    params: the parameters to train (dense distillation), or adapter: an
    Adapter attached to model (only its factors train).  held_losses(model)
    -> per-batch held-out losses (the criterion; held: how many batches,
    for the report).  targets: the next tokens of each input (decoders'
    windows) and text_weight > 0: the loss adds text_weight times their
    cross-entropy (the task text's own tokens besides the teacher; an
    input whose entry is None has none: text the teacher wrote, whose
    next tokens are samples);
    teacher_weight scales the KL (0: the text alone, a control).
    checkpoint: a decoder's layers recompute their forward in the
    backward pass (gradient checkpointing: one layer's activations held
    at a time; the same gradients, about a third more compute).
    parallel: the batches divided among processes (bico.llm.shard: each
    holds some rows of every batch; inputs[i] None where it holds none):
    parallel.weight(i) is this process's share of batch i's loss,
    parallel.reduce(grads) sums the gradients over the processes in
    place, parallel.total(value) the loss; every process then takes the
    same step, the one a single process takes on whole batches.  Adam
    (lr) with a cosine schedule (or "constant"), one batch per step in a
    seeded random order; every `every` steps and at the last, the
    held-out losses; the state kept is chosen by bico.torch.choose.pick
    (rule "least-or-zero": the least mean loss, unless it does not beat
    the untouched target clearly).  patience:
    training stops once that many held-out checks in a row found no loss
    below the least so far (None: it runs every step).  progress(step,
    steps, loss) after each step, loss a 0-dim tensor on the model's
    device (float(loss) reads it, waiting for the device: a progress
    function that prints now and then should read it only then).  The
    steps between held-out checks read nothing back from the device (a
    loss that is not finite is refused at the next check, naming its
    step).  Returns (chosen step, {step: mean held-out loss})."""
    if (params is None) == (adapter is None):
        raise BicoError(E_ARG, "distill: give params (dense) or an adapter")
    t = Training() if training is None else training
    if not isinstance(t, Training):
        raise BicoError(E_ARG, "distill: training must be a Training, got "
                        "%s" % type(t).__name__)
    steps = 1200 if t.steps is None else t.steps
    lr = 5e-3 if t.lr is None else t.lr
    every, schedule, warmup, seed = t.every, t.schedule, t.warmup, t.seed
    patience, text_weight, teacher_weight = t.patience, t.text_weight, \
        t.teacher_weight
    for name, v in (("steps", steps), ("every", every)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise BicoError(E_ARG, "distill: %s must be an integer >= 1, "
                            "got %r" % (name, v))
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise BicoError(E_ARG, "distill: lr must be a positive number, got "
                        "%r" % (lr,))
    if not (isinstance(text_weight, (int, float)) and
            math.isfinite(text_weight) and text_weight >= 0):
        raise BicoError(E_ARG, "distill: text_weight must be a number >= "
                        "0, got %r" % (text_weight,))
    if not (isinstance(teacher_weight, (int, float)) and
            math.isfinite(teacher_weight) and teacher_weight >= 0) or \
            not (teacher_weight or text_weight):
        raise BicoError(E_ARG, "distill: teacher_weight must be a number "
                        ">= 0, and not 0 with text_weight 0, got %r"
                        % (teacher_weight,))
    decay = t.ema
    if decay is not None and not (isinstance(decay, (int, float)) and
                                  not isinstance(decay, bool) and
                                  0 < decay < 1):
        raise BicoError(E_ARG, "distill: ema must be None or a decay "
                        "above 0 and below 1, got %r" % (decay,))
    if patience is not None and not (isinstance(patience, int) and
                                     not isinstance(patience, bool) and
                                     patience >= 1):
        raise BicoError(E_ARG, "distill: patience must be an integer >= 1 "
                        "or None, got %r" % (patience,))
    if text_weight and (targets is None or len(targets) != len(inputs)):
        raise BicoError(E_ARG, "distill: text_weight needs the next tokens "
                        "of every input (targets)")
    if isinstance(teacher, NoTeacher) and (teacher_weight or not
                                           text_weight):
        raise BicoError(E_ARG, "distill: without a teacher, teacher_weight "
                        "must be 0 and text_weight above 0")
    if len(teacher) != len(inputs) or not inputs:
        raise BicoError(E_ARG, "distill: %d fit batches for %d teacher "
                        "entries" % (len(inputs), len(teacher)))
    train = params if adapter is None else adapter.parameters()
    for p in train:
        p.requires_grad_(True)
    snap = (lambda: adapter.state()) if adapter is not None else \
        (lambda: [p.detach().clone() for p in train])
    opt = torch.optim.Adam(train, lr=lr)
    sch = _schedule(opt, steps, schedule, warmup)
    model.eval()
    dev = train[0].device
    per = {0: held_losses(model)}
    states = {0: snap()}
    g = torch.Generator().manual_seed(seed)
    order, t0 = [], time.time()
    stale = 0
    # the first step whose loss was not finite and that loss, kept on the
    # device and read at the held-out checks: a step never waits for it
    bad = _Nonfinite(dev)
    # the weights' exponential moving average, the state every check
    # scores and keeps (the live weights train on); it starts at zero and
    # is divided by 1 - decay^step when scored (as Adam's moments are):
    # an average of the steps' weights alone, not pulled towards the
    # start, so a run of a few steps keeps what it learnt
    ema = [torch.zeros_like(p) for p in train] if decay else None
    for it in range(1, steps + 1):
        if not order:
            order = torch.randperm(len(inputs), generator=g).tolist()
        i = order.pop()
        opt.zero_grad(set_to_none=True)
        value = _step(model, teacher, inputs, targets, i, dev, forward,
                      chunk, checkpoint, text_weight, teacher_weight,
                      parallel)
        if parallel is not None:
            for p in train:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            parallel.reduce([p.grad for p in train])
            value = torch.as_tensor(parallel.total(float(value)),
                                    dtype=torch.float32, device=dev)
        bad.note(it, value)
        opt.step()
        if sch is not None:
            sch.step()
        if ema is not None:
            _average(ema, train, decay)
        if it % every == 0 or it == steps:
            bad.check()
            # the steps' freed tensors back to the system (a trim costs
            # about a tenth of a small model's step: not after each)
            _heap.trim()
            if ema is not None:          # the average scored and kept
                _scale(ema, 1.0 / (1.0 - decay ** it))
                _swap(train, ema)
            per[it] = held_losses(model)
            m = {s: sum(v) / len(v) for s, v in per.items()}
            best = pick(m, per, rule="least")
            # keep only the best state and the untouched one
            if best == it:
                states = {0: states[0], it: snap()}
            if ema is not None:          # the weights back to train on
                _swap(train, ema)
                _scale(ema, 1.0 - decay ** it)
            stale = 0 if m[it] < min(v for s, v in m.items() if s != it) \
                else stale + 1
        if progress is not None:
            progress(it, steps, value)
        if patience is not None and stale >= patience:
            break
    means = {s: sum(v) / len(v) for s, v in per.items()}
    chosen = pick(means, per, rule="least-or-zero", zero=0)
    state = states[chosen] if chosen in states else states[0]
    if adapter is not None:
        adapter.load(state)
    else:
        with torch.no_grad():
            for p, v in zip(train, state):
                p.copy_(v)
    for p in train:
        p.requires_grad_(False)
    if report is not None:
        report.append({"rule": "distill", "step": chosen, "steps": steps,
                       "steps_run": max(per),
                       "text_weight": text_weight,
                       "teacher_weight": teacher_weight,
                       "losses": means, "zero_shot": means[0],
                       "heldout_batches": held,
                       "fit_batches": len(inputs),
                       "seconds": time.time() - t0})
    return chosen, means


def _average(ema, train, decay):
    """ema <- decay * ema + (1 - decay) * the trained tensors (on their
    device: nothing read back)."""
    with torch.no_grad():
        for e, p in zip(ema, train):
            e.mul_(decay).add_(p.detach(), alpha=1 - decay)


def _scale(tensors, c):
    with torch.no_grad():
        for t in tensors:
            t.mul_(c)


def _swap(train, held):
    """Exchanges the trained tensors' storage with held's tensors (no
    copy: the optimizer's state stays with the parameters)."""
    for i, p in enumerate(train):
        held[i], p.data = p.data, held[i]


def _step(model, teacher, inputs, targets, i, dev, forward, chunk,
           checkpoint, text_weight, teacher_weight, parallel):
    """One training step's forward and backward on batch i (the gradients
    accumulated into the trained tensors): its loss, a detached 0-dim
    tensor on dev.  Nothing here reads a value back to the host: on a GPU
    the step is queued whole."""
    x = teacher.draw(i) if hasattr(teacher, "draw") else inputs[i]
    if x is None:          # another process holds this batch's rows
        return torch.zeros((), dtype=torch.float32, device=dev)
    y = None if targets is None or targets[i] is None else \
        targets[i].to(dev, non_blocking=True)
    with _Checkpointed(model, checkpoint):
        return _student_loss(
            model, x, teacher.get(i, dev), forward, chunk, y, text_weight,
            teacher_weight, getattr(teacher, "outputs", None),
            1.0 if parallel is None else parallel.weight(i)).float()


class _Nonfinite(object):
    """The first training step whose loss is not finite, noted on the
    device (note: no host read) and refused at check (one read)."""

    def __init__(self, dev):
        self.step = torch.zeros((), dtype=torch.int64, device=dev)
        self.value = torch.zeros((), dtype=torch.float32, device=dev)

    def note(self, it, value):
        first = (~torch.isfinite(value)) & (self.step == 0)
        self.step = torch.where(first, torch.full_like(self.step, it),
                                self.step)
        self.value = torch.where(first, value, self.value)

    def check(self):
        it = int(self.step)
        if it:
            raise BicoError(E_NONFINITE, "distill: the loss at step %d is "
                            "%g: the trained model's outputs are not finite "
                            "(its weights, or a learning rate too large); "
                            "nothing was kept" % (it, float(self.value)))


def window_losses(model, batches, chunk=TOKEN_CHUNK):
    """The mean next-token cross-entropy of every window of (ids [b, T],
    next ids [b, T]) batches, one float per window, without gradients;
    a decoder's logits are computed chunk by chunk (never b T x V at
    once)."""
    out = []
    sp = _split(model)
    dev = next(model.parameters()).device
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(dev), y.to(dev)
            if sp is None:
                z = model(x)
                z = getattr(z, "logits", z)
                ce = torch.nn.functional.cross_entropy(
                    z.reshape(-1, z.shape[-1]).float(), y.reshape(-1),
                    reduction="none")
            else:
                h = _hidden(sp[0], x)
                flat = h.reshape(-1, h.shape[-1])
                yf = y.reshape(-1)
                ce = torch.cat([torch.nn.functional.cross_entropy(
                    sp[1](flat[s:e]).float(), yf[s:e], reduction="none")
                    for s, e in _chunks(flat.shape[0],
                                        _bounded(chunk, sp[1]))])
            out.extend(ce.reshape(y.shape).mean(-1).tolist())
    return out


# the scales of the distilled update tried on the held-out batches: on the
# ViT table the distilled update undershoots (the labelled oracle scales
# it by 1.2 on nine of twelve cells, docs/quality.md)
SCALES = (0.75, 1.0, 1.25, 1.5)


def choose_scale(model, base, per, scales=SCALES):
    """The distilled state of model moved to base + s (model - base) for
    the scale s in scales of least held-out loss (per(model) -> per-batch
    losses), kept at 1 unless another scale beats it clearly (pick's rule
    "least-or-zero" with 1 as the reference: with one held-out batch, any
    gain).  Floating entries are scaled in double; the others (integer
    buffers) are the model's.  Leaves model in the chosen state; returns
    (s, {s: mean held-out loss})."""
    scales = sorted(set(float(s) for s in scales) | {1.0})
    live = model.state_dict()     # the model's own tensors
    new = {k: v.detach().clone() for k, v in live.items()
           if v.is_floating_point()}
    per_s, means = {}, {}
    try:
        for s in scales:
            _move(live, base, new, s)
            per_s[s] = per(model)
            means[s] = sum(per_s[s]) / len(per_s[s])
        best = pick(means, per_s, rule="least-or-zero", zero=1.0)
    except BaseException:
        _move(live, base, new, 1.0)
        raise
    _move(live, base, new, best)
    return best, means


def _move(live, base, new, s):
    """The model's floating tensors (live) set to base + s (new - base),
    computed in double a tensor at a time (new itself at s = 1)."""
    with torch.no_grad():
        for k, v in new.items():
            if s == 1.0:
                live[k].copy_(v)
                continue
            b = base[k].to(v.device, torch.float64)
            live[k].copy_((b + s * (v.double() - b)).to(v.dtype))


class _Live(object):
    """A teacher computed on each step's augmented batch (the source pair
    stays in memory): get(i) after draw(i) gives the entry of the batch
    drawn last."""

    def __init__(self, models, batches, forward, augment, seed):
        self.models, self.batches = models, batches
        self.forward, self.augment = forward, augment
        self.g = torch.Generator().manual_seed(seed + 1)
        self.cur = None

    def __len__(self):
        return len(self.batches)

    def draw(self, i):
        torch.manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,),
                                            generator=self.g)))
        b = self.augment(self.batches[i], self.g)
        self.cur = (b, _teacher_logprobs(self.models, b, self.forward,
                                         TOKEN_CHUNK))
        return b

    def get(self, i, device=None):
        return self.cur[1] if device is None else self.cur[1].to(device)


def distill_model(source, source_tuned, target, fit_b, held_b, forward,
                  held_loss, steps=None, lr=None, every=25, rank=None,
                  augment="auto", seed=0, report=None, scales=SCALES):
    """transfer_model's distillation: a copy of target trained towards
    the proxy-tuned teacher on the batches fit_b, its state chosen on
    held_b, returned as a state dict.

    held_loss(model, batch) -> float, or None to use the KL to the
    teacher on the held-out batches.  rank: None trains every floating
    parameter; an integer trains LoRA factors of that rank on every
    nn.Linear (merged into the returned weights).  augment: "auto"
    (auto_augment: image_augment for [N, C, H, W] batches, mixup for
    other floating inputs, none for token ids), "mixup", "image"
    (image_augment: mixup or cutmix, then shifts, for any floating batch
    whose last two dimensions are an image's: [N, H, W] greyscale too),
    None, or a callable(batch,
    generator) -> batch; the teacher is then computed on
    each step's augmented batch.  steps / lr: None takes the measured
    defaults (docs/quality.md).  scales: the distilled update's scale is
    then chosen among them on the held-out batches (choose_scale; the
    report's "scale"); () keeps the update as trained."""
    import copy
    work = copy.deepcopy(target).eval()
    models = (source, source_tuned, target)
    for m in models:
        m.eval()
    augment = _augmentation(augment, fit_b[0])
    if augment is not None:
        teacher = _Live(models, fit_b, forward, augment, seed)
    else:
        teacher = build_teacher(source, source_tuned, target, fit_b,
                                forward)
    if held_loss is None:
        held_t = build_teacher(source, source_tuned, target, held_b, forward)

        def per(m):
            with torch.no_grad():
                return [float(kl_to_teacher(_logits(forward(m, b)),
                                            held_t.get(i)))
                        for i, b in enumerate(held_b)]
    else:
        def per(m):
            with torch.no_grad():
                return [held_loss(m, b) for b in held_b]
    if steps is None:
        # augmented batches do not run out: the ViT table gained from 600
        # to 1500 steps (docs/quality.md); without augmentation 40 passes
        steps = 1500 if augment is not None else \
            int(min(1500, max(300, 40 * len(fit_b))))
    if lr is None:
        lr = 1e-3 if rank is None else 5e-3
    adapter = params = None
    if rank is None:
        params = [p for p in work.parameters() if p.is_floating_point()]
    else:
        names = [n for n, m in work.named_modules()
                 if isinstance(m, nn.Linear)]
        adapter = Adapter(work, names, rank, seed=seed)
    rep = []
    try:
        step, _ = distill(work, teacher, fit_b, len(held_b), per,
                          params=params, adapter=adapter,
                          training=Training(steps=steps, lr=lr, every=every,
                                            seed=seed),
                          forward=forward, report=rep)
    finally:
        if hasattr(teacher, "close"):
            teacher.close()
    if adapter is not None:
        ups = {n + ".weight": adapter.update(n) for n in adapter.factors}
        adapter.remove()
        with torch.no_grad():
            for k, v in work.state_dict().items():
                if k in ups:
                    v.copy_((v.double() + ups[k].to(v.device)).to(v.dtype))
    scale, losses = 1.0, {}
    if step != 0 and scales:
        scale, losses = choose_scale(work, target.state_dict(), per, scales)
    rep[-1]["scale"], rep[-1]["scale_losses"] = scale, losses
    if report is not None:
        report.extend(rep)
    return {k: v.detach().clone() for k, v in work.state_dict().items()}
