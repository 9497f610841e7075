"""bico.torch.distill: the target trained, without labels, towards the
proxy-tuned teacher p = softmax(z_B + z_A_ft - z_A) (METHODS.md,
"Distillation toward the proxy-tuned teacher").

The teacher needs only logits on shared outputs: language models with one
tokenizer, classifiers over one label set.  Three pieces:

- Teacher: p of every calibration batch, computed once (the source pair
  need not stay in memory while the target trains) and kept compactly --
  every entry when the outputs are few, else the top-k log-probabilities,
  their indices and the log of the rest's mass -- in memory up to a
  budget, spilled to a temporary file beyond it (removed on close, at
  exit and when the object is collected).
- Adapter: LoRA factors on frozen nn.Linear layers, attached by forward
  hooks (the model keeps its names, dtype and device; only the factors
  train): PEFT's start (A random, B zero) or given pairs (a warm start).
- distill(): Adam on the mean KL(p || q) over the fit batches' tokens
  (or samples), in a seeded order; every `every` steps the held-out loss,
  and the best state kept by bico.torch.choose.pick (the untouched target
  is step 0; another step must beat it by more than the standard error
  over the held-out batches).

Logits over a large vocabulary never exist for all tokens at once: for a
decoder with a `model` body and an `lm_head` (the Hugging Face layout),
the teacher and the student's loss are computed in chunks of tokens.
Nothing here calls numpy on a model's tensors in the training loop, and
every tensor is created on the model's device.
"""
import atexit
import errno
from collections import namedtuple
import math
import os
import shutil
import tempfile
import time
import weakref

import numpy as np
import torch
import torch.nn as nn

from .. import _heap
from .._status import BicoError, E_ARG, E_IO, E_NONFINITE, E_SHAPE
from .choose import pick

__all__ = ["Teacher", "NoTeacher", "Grouped", "Adapter", "distill", "kl_to_teacher", "build_teacher",
           "proxy_chunks", "check_finite_logits",
           "distill_model", "window_losses", "mixup", "cutmix", "shift",
           "compose", "one_of", "auto_augment", "image_augment",
           "choose_scale", "SCALES"]

TOKEN_CHUNK = 1024


# ---- the model's body and head (chunked logits) ----

def _split(model):
    """(body, head) of a decoder in the Hugging Face layout -- body(ids)
    gives the final hidden states, head a linear map to the vocabulary --
    or None when the model is not one (then the whole output is used)."""
    body, head = getattr(model, "model", None), getattr(model, "lm_head",
                                                         None)
    if isinstance(body, nn.Module) and isinstance(head, nn.Linear):
        return body, head
    return None


def _hidden(body, x):
    h = body(x)
    if hasattr(h, "last_hidden_state"):
        h = h.last_hidden_state
    elif isinstance(h, (tuple, list)):
        h = h[0]
    return h


def _logits_keep(out):
    """The logits of a model's output (.logits, a tuple's first)."""
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _logits(out):
    return _logits_keep(out).float()


# the logits of one chunk stay under this many bytes (float32): at a
# 151 936-token vocabulary 110 tokens a chunk, at 256 the whole TOKEN_CHUNK
LOGIT_BYTES = 64 << 20


def _bounded(chunk, head):
    """chunk, fewer tokens when the head's outputs would make one chunk's
    float32 logits larger than LOGIT_BYTES."""
    w = getattr(head, "weight", None)
    if w is None or w.dim() != 2:
        return chunk
    return max(1, min(chunk, LOGIT_BYTES // (4 * max(1, int(w.shape[0])))))


def _chunks(n, size):
    return [(s, min(n, s + size)) for s in range(0, n, size)]


# ---- the teacher ----

def _why(e):
    """An OSError in words, a full disk said plainly."""
    if getattr(e, "errno", None) == errno.ENOSPC:
        return "no space left on the device"
    if getattr(e, "errno", None) == errno.EDQUOT:
        return "the disk quota is used up"
    return e.strerror or str(e)


class _Spill(object):
    """A temporary folder holding the spilled teacher entries; removed on
    close, at exit, and when its owner is collected."""

    def __init__(self, parent):
        self.dir = tempfile.mkdtemp(prefix=".bico-teacher-", dir=parent)
        self._fin = weakref.finalize(self, shutil.rmtree, self.dir, True)
        atexit.register(self._fin)

    def path(self, i):
        return os.path.join(self.dir, "%06d.npy" % i)

    def close(self):
        self._fin()


class Teacher(object):
    """The proxy-tuned teacher's log-probabilities of each batch.

    k: entries kept per token (None: all); with k < the number of outputs,
    the top k log-probabilities (float32), their indices (int32) and the
    log of the remaining mass.  budget: bytes kept in memory; later
    batches go to a temporary folder in spill_dir (default: $TMPDIR).
    get(i, device) -> the entry of batch i: a tensor of log-probabilities
    [..., V], or a tuple (values [..., k], indices [..., k], log rest
    [...])."""

    def __init__(self, k=None, budget=256 << 20, spill_dir=None):
        if k is not None and not (isinstance(k, int) and k >= 1):
            raise BicoError(E_ARG, "distill: teacher_k must be a positive "
                            "integer or None, got %r" % (k,))
        self.k, self.budget, self.spill_dir = k, int(budget), spill_dir
        self._mem, self._disk, self._spill = {}, {}, None
        self.bytes_memory = self.bytes_disk = 0
        self.outputs = None

    def __len__(self):
        return len(self._mem) + len(self._disk)

    def _compact(self, logp):
        V = logp.shape[-1]
        if self.outputs is None:
            self.outputs = V
        elif V != self.outputs:
            raise BicoError(E_SHAPE, "distill: teacher batches have %d and "
                            "%d outputs" % (self.outputs, V))
        if self.k is None or self.k >= V:
            return (logp.float().cpu(),)
        vals, idx = logp.float().topk(self.k, dim=-1)
        rest = _log_rest(logp.float(), idx)
        return (vals.cpu(), idx.to(torch.int32).cpu(), rest.cpu())

    def put(self, i, logp):
        """Stores the teacher's log-probabilities of batch i."""
        self._store(i, self._compact(logp.detach()))

    def put_chunks(self, i, chunks, lead):
        """Stores batch i's log-probabilities given as chunks of rows
        ([n_c, V] each, in order; lead: the batch's shape without V),
        each kept compactly as it comes: the batch's whole [tokens, V]
        never exists.  The entry is the one put() stores for the
        concatenated rows (every kept value is a function of its row)."""
        got = [self._compact(c.detach()) for c in chunks]
        if not got:
            raise BicoError(E_ARG, "distill: batch %d has no rows" % i)
        parts = tuple(torch.cat(ps).reshape(tuple(lead) + ps[0].shape[1:])
                      for ps in zip(*got))
        del got
        self._store(i, parts)

    def _store(self, i, parts):
        size = sum(p.numel() * p.element_size() for p in parts)
        if self.bytes_memory + size <= self.budget:
            self._mem[i] = parts
            self.bytes_memory += size
            return
        where = self.spill_dir or tempfile.gettempdir()
        try:
            if self._spill is None:
                self._spill = _Spill(self.spill_dir)
            files = []
            for j, p in enumerate(parts):
                path = self._spill.path(i) + ".%d.npy" % j
                np.save(path, p.numpy())
                files.append(path)
        except OSError as e:
            raise BicoError(E_IO, "distill: the teacher's entries beyond its "
                            "memory budget (%.0f MiB) go to %s: %s writing "
                            "%.1f MiB there; free space there, give another "
                            "folder (--spill-dir), or keep more in memory "
                            "(--teacher-memory)" % (
                                self.budget / 2 ** 20, where,
                                _why(e), size / 2 ** 20))
        self._disk[i] = files
        self.bytes_disk += size

    def get(self, i, device=None):
        if i in self._mem:
            parts = self._mem[i]
        else:
            parts = tuple(torch.from_numpy(np.load(f)) for f in self._disk[i])
        parts = tuple(p.to(device) if device is not None else p
                      for p in parts)
        return parts[0] if len(parts) == 1 else parts

    def close(self):
        """Removes the spill folder (if any) and drops the entries."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        self._mem, self._disk = {}, {}

    @property
    def spill_folder(self):
        return None if self._spill is None else self._spill.dir


class NoTeacher(object):
    """No teacher: n batches whose entries are None, for a distillation
    on the text's own next-token loss alone (teacher_weight 0: the
    sequence-level distillation across tokenizers, where the source wrote
    the text, and the text-only control)."""
    k = outputs = None
    bytes_memory = bytes_disk = 0

    def __init__(self, n):
        self.n = int(n)

    def __len__(self):
        return self.n

    def get(self, i, device=None):
        return None

    def close(self):
        pass


# A teacher over groups of the outputs rather than the outputs: logp
# [..., G] the teacher's log-probabilities of G groups, mask [...] the
# rows it speaks for (the others learn nothing from it), group [V] each
# output's group (0 .. G-1).  The student's distribution is summed over
# each group before the KL (bico.llm.across: the next token's first byte,
# the axis two tokenizers share).
Grouped = namedtuple("Grouped", "logp mask group")


def grouped_kl(z, entry):
    """Sum over the rows entry.mask keeps of KL(p || q_grouped), divided
    by all the rows: q_grouped the student's softmax(z) summed over each
    group of entry.group.  z: logits [..., V]."""
    logp, mask, group = entry
    p = torch.softmax(z.float(), dim=-1)
    q = torch.zeros(p.shape[:-1] + (logp.shape[-1],), dtype=p.dtype,
                    device=p.device).index_add_(-1, group.long(), p)
    logq = torch.log(q.clamp_min(1e-30))
    kl = _plogp(logp.float(), logq).sum(-1)
    kl = torch.where(mask, kl, torch.zeros_like(kl))
    return kl.sum() / max(1, kl.numel())


def _log_rest(logp, idx):
    """log of the mass outside the kept entries idx, from full
    log-probabilities (stable: a log-sum-exp over the others)."""
    others = logp.scatter(-1, idx.long(), float("-inf"))
    return torch.logsumexp(others, dim=-1)


def kl_to_teacher(z, entry, outputs=None):
    """Mean over tokens of KL(p || softmax(z)), p the teacher entry (all
    log-probabilities, or top-k with the rest's mass: then the KL of the
    two distributions coarsened to {the k kept outputs, the rest}, exact
    for the kept part).  z: logits [..., V].  outputs: the teacher's
    vocabulary when the student's is wider (a vocabulary that grew: the
    first `outputs` ids shared): the student's distribution over those
    ids, renormalized, is compared (its other ids are left to the text)."""
    if isinstance(entry, Grouped):
        return grouped_kl(z, entry)
    z = z.float()
    if outputs is not None and z.shape[-1] > outputs:
        z = z[..., :outputs]
    logq = torch.log_softmax(z, dim=-1)
    if isinstance(entry, torch.Tensor):
        return _plogp(entry, logq).sum(-1).mean()
    vals, idx, rest = entry
    idx = idx.long()
    kl = _plogp(vals, logq.gather(-1, idx)).sum(-1)
    q_rest = torch.logsumexp(z.scatter(-1, idx, float("-inf")), dim=-1) \
        - torch.logsumexp(z, dim=-1)
    return (kl + _plogp(rest, q_rest)).mean()


def _plogp(logp, logq):
    """p (log p - log q) elementwise, 0 where p is 0 (no 0 * inf)."""
    p = logp.exp()
    safe = torch.where(p > 0, logp, torch.zeros_like(logp))
    return p * (safe - logq)


def proxy_chunks(states, heads, chunk, shared=None):
    """log_softmax(z_B + z_A_ft - z_A) of final hidden states, a chunk of
    rows at a time: states = (h_A, h_A_ft, h_B) [n, d_*] each, heads the
    three output layers (callables, each h -> z); yields [rows, V] pieces
    in order, at most `chunk` rows each.  shared: the source's vocabulary
    when the target's grew past it (its first `shared` columns taken)."""
    for s, e in _chunks(states[0].shape[0], chunk):
        za, zt, zb = (hd(h[s:e]).float() for hd, h in zip(heads, states))
        if shared is not None:
            zb = zb[..., :shared]
        if not (za.shape == zt.shape == zb.shape):
            raise BicoError(E_SHAPE, "distill: the teacher needs the three "
                            "models' outputs on one vocabulary, got %d, %d "
                            "and %d outputs" % (za.shape[-1], zt.shape[-1],
                                                zb.shape[-1]))
        check_finite_logits((za, zt, zb))
        yield torch.log_softmax(zb + zt - za, dim=-1)


TEACHER_MODELS = ("source", "fine-tuned source", "target")


def check_finite_logits(zs, names=TEACHER_MODELS):
    """Refuses (BicoError E_NONFINITE, naming the model) logits of the
    teacher's three models that hold NaN or Inf: a model whose weights are
    not finite, which a teacher would pass on to every step."""
    for name, z in zip(names, zs):
        if not bool(torch.isfinite(z).all()):
            bad = z[~torch.isfinite(z)].flatten()[0].item()
            raise BicoError(E_NONFINITE, "distill: the %s model's outputs "
                            "hold %g: its weights are not all finite (or "
                            "overflow in this dtype); nothing was trained"
                            % (name, bad))


def _teacher_rows(models, x, chunk, shared=None):
    """(lead shape, chunks of proxy_chunks) of one batch of a decoder in
    the Hugging Face layout, or None for another model."""
    splits = [_split(m) for m in models]
    if not all(s is not None for s in splits):
        return None
    hs = [_hidden(s[0], x) for s in splits]
    flat = [h.reshape(-1, h.shape[-1]) for h in hs]
    chunk = min(_bounded(chunk, sp[1]) for sp in splits)
    return hs[0].shape[:-1], proxy_chunks(flat, [sp[1] for sp in splits],
                                          chunk, shared)


def _teacher_logprobs(models, x, forward, chunk, shared=None):
    """log_softmax(z_B + z_A_ft - z_A) of one batch: models = (source,
    source_tuned, target)."""
    with torch.no_grad():
        rows = _teacher_rows(models, x, chunk, shared) if forward is None \
            else None
        if rows is not None:
            lead, chunks = rows
            return torch.cat(list(chunks)).reshape(*lead, -1)
        za, zt, zb = (_logits(forward(m, x) if forward is not None
                              else m(x)) for m in models)
        if shared is not None:
            zb = zb[..., :shared]
        if not (za.shape == zt.shape == zb.shape):
            raise BicoError(E_SHAPE, "distill: the teacher needs the three "
                            "models' outputs on one set of outputs (one "
                            "vocabulary or label set), got %s, %s and %s"
                            % (tuple(za.shape), tuple(zt.shape),
                               tuple(zb.shape)))
        check_finite_logits((za, zt, zb))
        return torch.log_softmax(zb + zt - za, dim=-1)


def build_teacher(source, source_tuned, target, inputs, forward, k=None,
                  budget=256 << 20, spill_dir=None, chunk=TOKEN_CHUNK,
                  progress=None, shared=None):
    """A Teacher holding log_softmax(z_B + z_A_ft - z_A) for each input of
    `inputs` (what forward(model, x) takes).  progress(i, n) after each.
    shared: the source's vocabulary when the target's grew past it (the
    teacher is over those ids)."""
    t = Teacher(k=k, budget=budget, spill_dir=spill_dir)
    models = (source, source_tuned, target)
    for m in models:
        m.eval()
    try:
        for i, x in enumerate(inputs):
            with torch.no_grad():
                rows = _teacher_rows(models, x, chunk, shared) \
                    if forward is None else None
                if rows is not None:      # compacted a chunk at a time
                    t.put_chunks(i, rows[1], rows[0])
                else:
                    t.put(i, _teacher_logprobs(models, x, forward, chunk,
                                               shared))
            if progress is not None:
                progress(i + 1, len(inputs))
    except BaseException:
        t.close()
        raise
    return t


# ---- LoRA factors on frozen linear layers ----

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


# ---- training ----

def _student_loss(model, x, entry, forward, chunk, y=None, text_weight=0.0,
                  teacher_weight=1.0, outputs=None):
    """KL(teacher || model) on one batch, plus text_weight times the
    next-token cross-entropy against y (the text's own next tokens) when
    given, backpropagated; returns its value.  A decoder called on token
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
        loss.backward()
        return float(loss)
    body, head = sp
    h = _hidden(body, x)
    flat = h.reshape(-1, h.shape[-1])
    n = flat.shape[0]
    hd = flat.detach().requires_grad_(True)
    total = 0.0
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
        loss = loss * ((e - s) / n)
        loss.backward()
        total += float(loss)
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
        return Grouped(entry.logp.reshape(n, entry.logp.shape[-1]),
                       entry.mask.reshape(n), entry.group)
    vals, idx, rest = entry
    return (vals.reshape(n, vals.shape[-1]), idx.reshape(n, idx.shape[-1]),
            rest.reshape(n))


def _rows(entry, s, e):
    if isinstance(entry, torch.Tensor):
        return entry[s:e]
    if isinstance(entry, Grouped):
        return Grouped(entry.logp[s:e], entry.mask[s:e], entry.group)
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


def distill(model, teacher, inputs, held, held_losses, params=None,
            adapter=None, steps=1200, lr=5e-3, every=25, schedule="cosine",
            warmup=0, seed=0, forward=None, chunk=TOKEN_CHUNK,
            progress=None, report=None, targets=None, text_weight=0.0,
            teacher_weight=1.0, checkpoint=False, patience=None):
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
    at a time; the same gradients, about a third more compute).  Adam (lr) with a cosine schedule (or "constant"),
    one batch per step in a seeded random order; every `every` steps and
    at the last, the held-out losses; the state kept is chosen by
    bico.torch.choose.pick (rule "least-or-zero": the least mean loss,
    unless it does not beat the untouched target clearly).  patience:
    training stops once that many held-out checks in a row found no loss
    below the least so far (None: it runs every step).  progress(step,
    steps, loss) after each step.  Returns (chosen step, {step: mean
    held-out loss})."""
    if (params is None) == (adapter is None):
        raise BicoError(E_ARG, "distill: give params (dense) or an adapter")
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
    for it in range(1, steps + 1):
        if not order:
            order = torch.randperm(len(inputs), generator=g).tolist()
        i = order.pop()
        opt.zero_grad(set_to_none=True)
        x = teacher.draw(i) if hasattr(teacher, "draw") else inputs[i]
        y = None if targets is None or targets[i] is None else \
            targets[i].to(dev)
        with _Checkpointed(model, checkpoint):
            value = _student_loss(model, x, teacher.get(i, dev), forward,
                                  chunk, y, text_weight, teacher_weight,
                                  getattr(teacher, "outputs", None))
        if not math.isfinite(value):
            raise BicoError(E_NONFINITE, "distill: the loss at step %d is "
                            "%g: the trained model's outputs are not finite "
                            "(its weights, or a learning rate too large); "
                            "nothing was kept" % (it, value))
        opt.step()
        _heap.trim()      # the step's freed tensors back to the system
        if sch is not None:
            sch.step()
        if it % every == 0 or it == steps:
            per[it] = held_losses(model)
            m = {s: sum(v) / len(v) for s, v in per.items()}
            best = pick(m, per, rule="least")
            # keep only the best state and the untouched one
            if best == it:
                states = {0: states[0], it: snap()}
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


# ---- held-out next-token losses, chunked ----

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


# ---- transfer_model's route: any nn.Module over shared outputs ----

def _input(batch):
    """The floating input of a batch (its first element, or itself)."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _with_input(batch, x):
    """batch with its input replaced by x (the rest kept)."""
    if isinstance(batch, (tuple, list)):
        return type(batch)([x] + list(batch[1:]))
    return x


def mixup(alpha=1.0):
    """An augmentation for batches whose input is a floating tensor (the
    first element of a tuple batch, or the batch itself): each sample
    replaced by lam x_i + (1 - lam) x_j, j a random other sample of the
    batch, lam ~ Beta(alpha, alpha).  The teacher is computed on the mixed
    inputs, so no label is involved."""
    def aug(batch, g):
        x = _input(batch)
        n = x.shape[0]
        j = torch.randperm(n, generator=g).to(x.device)
        lam = torch.distributions.Beta(alpha, alpha).sample((n,))
        lam = lam.to(x.device, x.dtype).view(-1, *([1] * (x.dim() - 1)))
        return _with_input(batch, lam * x + (1 - lam) * x[j])
    return aug


def cutmix(alpha=1.0):
    """An augmentation for image batches ([..., H, W] floating inputs):
    one box of every sample replaced by the same box of a random sample
    of the batch (sample i takes sample j(i)'s pixels, j a random
    permutation, which may keep a sample its own).  The box's sides are
    sqrt(1 - lam) of the image's, lam ~ Beta(alpha, alpha), its centre
    uniform over the image and the box clipped at the edges.  Like
    mixup, the teacher labels the pasted images, so no label is
    involved."""
    def aug(batch, g):
        x = _input(batch)
        H, W = x.shape[-2], x.shape[-1]
        j = torch.randperm(x.shape[0], generator=g).to(x.device)
        lam = float(torch.distributions.Beta(alpha, alpha).sample())
        h, w = int(H * (1 - lam) ** 0.5), int(W * (1 - lam) ** 0.5)
        cy = int(torch.randint(0, H, (1,), generator=g))
        cx = int(torch.randint(0, W, (1,), generator=g))
        y0, y1 = max(cy - h // 2, 0), min(cy + h // 2, H)
        x0, x1 = max(cx - w // 2, 0), min(cx + w // 2, W)
        xs = x.clone()
        xs[..., y0:y1, x0:x1] = x[..., y0:y1, x0:x1][j]
        return _with_input(batch, xs)
    return aug


def shift(pixels=2):
    """An augmentation for image batches ([..., H, W] floating inputs):
    the whole batch rolled by a random offset in [-pixels, pixels] along
    each of the last two dimensions.  Part of distill_augment="auto" for
    inputs of 4 dimensions ([N, C, H, W], auto_augment) only: it would
    scramble inputs that are not images."""
    def aug(batch, g):
        x = _input(batch)
        dy, dx = (int(v) for v in torch.randint(-pixels, pixels + 1, (2,),
                                                generator=g))
        return _with_input(batch, torch.roll(x, shifts=(dy, dx),
                                             dims=(-2, -1)))
    return aug


def compose(*augs):
    """Augmentations applied in order."""
    def aug(batch, g):
        for a in augs:
            batch = a(batch, g)
        return batch
    return aug


def one_of(*augs):
    """One of the augmentations, drawn uniformly at every call."""
    def aug(batch, g):
        k = int(torch.randint(0, len(augs), (1,), generator=g))
        return augs[k](batch, g)
    return aug


def _float_input(batch):
    x = _input(batch)
    return isinstance(x, torch.Tensor) and x.is_floating_point() and \
        x.dim() >= 2 and x.shape[0] >= 2


def auto_augment(batch):
    """distill_augment="auto" for batches like this one: for image batches
    (a floating input of 4 dimensions, PyTorch's [N, C, H, W]) mixup or
    cutmix, drawn at every step, then shifts of up to 2 pixels; mixup
    alone for other floating inputs (features, sequences of features, and
    [N, H, W] greyscale images, which cannot be told from them: pass
    "image" for those); None for the rest (token ids).  Measured on the
    ViT table's greyscale images (docs/quality.md): see image_augment."""
    if not _float_input(batch):
        return None
    return image_augment() if _input(batch).dim() == 4 else mixup()


def image_augment():
    """distill_augment="image": mixup or cutmix (one of them, drawn at
    every step), then shifts of up to 2 pixels.  On the ViT table
    (docs/quality.md, one seed) the distillation closes 86.0 % of the gap
    with it, 84.6 % with mixup and shifts alone, 78 % with mixup alone."""
    return compose(one_of(mixup(), cutmix()), shift(2))


def _augmentation(augment, batch):
    """distill_model's augment as a callable or None (checked)."""
    named = {"auto": lambda: auto_augment(batch), "mixup": mixup,
             "image": image_augment}
    if isinstance(augment, str) and augment in named:
        return named[augment]()
    if augment is None or (callable(augment) and
                           not isinstance(augment, str)):
        return augment
    raise BicoError(E_ARG, "distill_augment must be \"auto\", \"mixup\", "
                    "\"image\", None or a callable(batch, generator) -> "
                    "batch, got %r" % (augment,))


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
                          params=params, adapter=adapter, steps=steps, lr=lr,
                          every=every, seed=seed, forward=forward, report=rep)
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
