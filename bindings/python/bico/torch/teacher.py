"""bico.torch.teacher: the proxy-tuned teacher p = softmax(z_B + z_A_ft -
z_A) of every calibration batch, computed once (the source pair need not
stay in memory while the target trains) and kept compactly: every entry
when the outputs are few, else the top-k log-probabilities, their
indices and the log of the rest's mass; in memory up to a budget,
spilled to a temporary file beyond it (removed on close, at exit and
when the object is collected).  Teacher, NoTeacher (the text alone),
Grouped (a teacher over groups of outputs: bico.llm.across), the KL of a
student's logits to an entry (kl_to_teacher, grouped_kl), build_teacher.
"""
import atexit
import errno
from collections import namedtuple
import os
import shutil
import tempfile
import weakref

import numpy as np
import torch

from .._status import BicoError, E_ARG, E_IO, E_NONFINITE, E_SHAPE
from .logits import TOKEN_CHUNK, _bounded, _chunks, _hidden, _logits, _split

__all__ = ["Teacher", "NoTeacher", "Grouped", "Path", "PathIndex",
           "path_logmass", "kl_to_teacher", "build_teacher",
           "proxy_chunks", "check_finite_logits"]


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
# the axis two tokenizers share).  path (optional, a Path): the groups
# refined along each row's own text, level by level.
Grouped = namedtuple("Grouped", "logp mask group path", defaults=(None,))

# Deeper levels of a Grouped teacher, along each row's text (bico.llm.
# across): at level d (2, 3, ..) the outputs whose first d - 1 bytes are
# the text's next d - 1 bytes, in 257 groups: the output that is exactly
# those bytes (group 0), and by its d-th byte (groups 1 .. 256).  logp
# [..., D, 257] the teacher's log-probabilities of each level's groups
# (conditional on the level's prefix), weight [..., D] each level's
# weight in the KL (the teacher's probability of the prefix: the chain
# rule, so that the levels add up to the KL over the finer partition; 0
# where a level has no teacher), base [..., D] int64 each level's first
# key (PathIndex).
Path = namedtuple("Path", "logp weight base index")

# The outputs sorted by their bytes: order [V] the outputs in that order,
# keys [V] int64 their sort keys (the first `depth` bytes b as the digits
# b + 1 of a base-257 number, 0 past the output's end; -1: no bytes),
# steps [D] each level's group width in keys.  Every level's groups are
# then runs of the sorted outputs: a group's mass is a difference of two
# cumulative sums, found by searchsorted.
PathIndex = namedtuple("PathIndex", "order keys steps")


def path_logmass(p, base, index):
    """log of softmax mass p [n, V] summed over each level's 257 groups,
    divided by the level's whole ([n, D, 257]), and how many outputs each
    level holds ([n, D]; a level of none has no distribution: its values
    mean nothing): base [n, D] each row's level bases (Path.base)."""
    n, D = base.shape
    ps = p.index_select(-1, index.order).double()
    cs = torch.cat([torch.zeros(n, 1, dtype=ps.dtype, device=ps.device),
                    torch.cumsum(ps, -1)], dim=-1)
    j = torch.arange(258, device=base.device, dtype=torch.int64)
    edges = base[..., None] + j * index.steps[:, None]
    at = torch.searchsorted(index.keys, edges.reshape(n, -1))
    c = cs.gather(-1, at).reshape(n, D, 258)
    mass = (c[..., 1:] - c[..., :-1]).clamp_min(0)
    whole = (c[..., -1] - c[..., 0]).clamp_min(1e-30)
    return (torch.log(mass.clamp_min(1e-30)) - torch.log(whole)[..., None]
            ).float(), at.reshape(n, D, 258)[..., -1] - \
        at.reshape(n, D, 258)[..., 0]


def grouped_kl(z, entry):
    """Sum over the rows entry.mask keeps of KL(p || q_grouped), divided
    by all the rows: q_grouped the student's softmax(z) summed over each
    group of entry.group; with entry.path, each deeper level's KL of its
    groups' conditional distributions, times the level's weight, added
    (the KL over the partition the levels refine).  z: logits [..., V]."""
    logp, mask, group = entry.logp, entry.mask, entry.group
    p = torch.softmax(z.float(), dim=-1)
    q = torch.zeros(p.shape[:-1] + (logp.shape[-1],), dtype=p.dtype,
                    device=p.device).index_add_(-1, group.long(), p)
    logq = torch.log(q.clamp_min(1e-30))
    kl = _plogp(logp.float(), logq).sum(-1)
    if entry.path is not None:
        pt = entry.path
        lead = p.shape[:-1]
        flat = p.reshape(-1, p.shape[-1])
        base = pt.base.reshape(flat.shape[0], -1)
        lq, _ = path_logmass(flat, base, pt.index)
        deep = _plogp(pt.logp.float().reshape(lq.shape), lq).sum(-1)
        kl = kl + (deep * pt.weight.float().reshape(deep.shape)).sum(-1) \
            .reshape(lead)
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
