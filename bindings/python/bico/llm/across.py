"""bico.llm.across: the proxy-tuned teacher across two tokenizers.

When the source's and the target's tokenizers differ, their logits share
no axis, but the text they read does.  At a byte offset where both
tokenizations start a token, each model's distribution over its next
token, summed by the token's first byte, is a distribution over the 256
byte values (and one group more for the tokens without bytes: special
tokens).  There the teacher is the target's own first-byte distribution
moved as fine-tuning moved the source's,

    log p(c) = log m_B(c) + log m_A_ft(c) - log m_A(c) + const,

proxy tuning on the one axis the two vocabularies share.  The student
(the target with its adapter) learns it through its own distribution
summed the same way (bico.torch.teacher.Grouped); positions where the
tokenizations do not meet learn from the text alone.

Levels along the text (depth > 1): the first byte leaves the rest of the
next token to the text.  Where the source also starts a token at the
next byte (a byte-level source: everywhere), its distribution there says
how fine-tuning moved the byte after the first one, given the text's
first byte.  Level d (2 .. depth) takes the target's outputs that begin
with the text's next d - 1 bytes, in 257 groups (the output that is
exactly those bytes, and one group per byte after them); the teacher of
a level is the target's own distribution over them (conditional on the
prefix) with each byte's group moved by the source pair's difference at
that byte, the output that ends there unmoved, and it weighs in the KL
by the teacher's probability of the prefix, so that the levels add up
to the KL over the partition they refine (bico.torch.teacher.Path).
Where the byte a level reads falls inside one of the source's tokens (a
BPE source: Llama 2's, carried to Llama 3), the source's own outputs
that begin with the text's bytes from that token's start say it: the
source pair's ratio of each byte's group of them (conditional on the
prefix), over the ratio of the output that ends there, moves the
target's group of that byte against the target's output that ends there.

The source's side is computed once per window of the target's tokens
(the window's bytes tokenized again by the source, the source pair run
over them in pieces of its context), kept as the difference
log m_A_ft - log m_A per aligned position; the target's own part is
added by complete(), run on the untouched target when the distillation
starts (bico.llm.distill.run), so the teacher never needs the three
models at once.
"""
import math

import numpy as np
import torch

from ..torch import logits as _lg
from ..torch import teacher as _t
from .bpe import bytes_to_unicode

__all__ = ["token_bytes", "groups", "marginals", "align", "path_index",
           "ByteTeacher", "build", "GROUPS", "DEPTH"]

# 256 byte values and one group for tokens without bytes
GROUPS = 257
_TINY = 1e-30
# a level's group below this log conditional mass holds no outputs
_EMPTY = -60.0
# levels of the teacher along the text: the first byte, then the next
# bytes while the source reads them (bico.torch.teacher.Path)
DEPTH = 2


def token_bytes(tk, size=None):
    """The bytes each id of tokenizer tk (what bico.llm.text's
    load_tokenizer returns) stands for, a list indexed by id; None for
    ids without bytes of their own (special and added tokens, ids the
    tokenizer does not use)."""
    out = {}
    if hasattr(tk, "table"):                          # bytes, no merges
        out = {int(i): bytes([b]) for i, b in tk.inv.items()}
    elif hasattr(tk, "unbyte"):                       # byte-level BPE
        for i, t in tk.inv.items():
            out[int(i)] = None if t in tk.added else \
                bytes(tk.unbyte[c] for c in t)
    elif hasattr(tk, "tk"):                           # `tokenizers`
        out = _hugging_bytes(tk.tk)
    else:
        raise TypeError("token_bytes: an unknown tokenizer object %r" % tk)
    n = max(out, default=-1) + 1 if size is None else int(size)
    return [out.get(i) for i in range(n)]


def _hugging_bytes(tk):
    vocab = tk.get_vocab(with_added_tokens=True)
    added = getattr(tk, "get_added_tokens_decoder", lambda: {})()
    special = set(int(i) for i in added)
    m = bytes_to_unicode()
    unbyte = {c: b for b, c in m.items()}
    byte_level = all(c in vocab for c in m.values())
    out = {}
    for t, i in vocab.items():
        if i in special:
            out[i] = None
            continue
        if byte_level:
            try:
                out[i] = bytes(unbyte[c] for c in t)
            except KeyError:
                out[i] = None
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            try:                                      # byte fallback
                out[i] = bytes([int(t[3:5], 16)])
            except ValueError:
                out[i] = t.encode("utf-8")
        else:                                         # SentencePiece
            out[i] = t.replace("\u2581", " ").encode("utf-8")
    return out


def groups(tbytes, outputs=None):
    """[outputs] int64: each id's first byte (0-255), 256 for an id
    without bytes (and for ids past the tokenizer's, a model's padded
    vocabulary)."""
    n = len(tbytes) if outputs is None else int(outputs)
    g = torch.full((n,), GROUPS - 1, dtype=torch.int64)
    for i, b in enumerate(tbytes[:n]):
        if b:
            g[i] = b[0]
    return g


def marginals(z, group):
    """log of softmax(z) summed over each group of `group`: [..., 257]."""
    p = torch.softmax(z.float(), dim=-1)
    q = torch.zeros(p.shape[:-1] + (GROUPS,), dtype=p.dtype,
                    device=p.device).index_add_(-1, group.to(p.device), p)
    return torch.log(q.clamp_min(_TINY))


def _utf8_span(raw):
    """(start, end) of the longest span of raw that decodes as UTF-8 once
    the pieces of a character cut at either end are dropped, or None."""
    s = 0
    while s < min(4, len(raw)) and 0x80 <= raw[s] < 0xC0:
        s += 1
    for cut in range(4):
        e = len(raw) - cut
        if e <= s:
            break
        try:
            raw[s:e].decode("utf-8")
            return s, e
        except UnicodeDecodeError:
            continue
    return None


def align(row, tb_b, tok_a, tb_a):
    """How one window of the target's tokens (row: ids, the window and its
    next token) meets the source's tokens of the same text: (the source's
    ids of the window's text, [(t, j)]): the target's position t (which
    predicts the row's token t + 1) and the source's token j >= 1 (which
    the source's position j - 1 predicts) start at the same byte.  None
    when the window's bytes are not text the source's tokenizer gives
    back byte for byte."""
    got = _align(row, tb_b, tok_a, tb_a)
    return None if got is None else got[:2]


def _align(row, tb_b, tok_a, tb_a):
    """align's answer and (the window's bytes, {byte offset: the source's
    token starting there}, the byte offset of each target token, the
    text's span (start, end) in the bytes)."""
    parts = [tb_b[int(i)] if int(i) < len(tb_b) else None for i in row]
    starts, o = [], 0
    for p in parts:
        starts.append(o)
        o += len(p or b"")
    raw = b"".join(p or b"" for p in parts)
    span = _utf8_span(raw)
    if span is None:
        return None
    s, e = span
    text = raw[s:e]
    ids_a = [int(i) for i in tok_a.encode(text.decode("utf-8"))]
    pa = [(tb_a[i] if i < len(tb_a) else None) or b"" for i in ids_a]
    got = b"".join(pa)
    lead = len(got) - len(text)
    # a tokenizer that adds a leading space (SentencePiece's dummy
    # prefix, add_prefix_space) gives it back first
    if lead < 0 or got[lead:] != text or got[:lead].strip():
        return None
    at, o = {}, -lead
    for j, p in enumerate(pa):
        if j >= 1 and o >= 0 and p:
            at[s + o] = j
        o += len(p)
    pairs = [(t, at[starts[t + 1]]) for t in range(len(row) - 1)
             if parts[t + 1] and starts[t + 1] in at]
    return (torch.tensor(ids_a, dtype=torch.int64), pairs, raw, at, starts,
            (s, e))


def path_index(tbytes, depth, outputs=None):
    """bico.torch.teacher.PathIndex of a vocabulary (token_bytes'
    list) for levels 2 .. depth: each output's key, its first `depth`
    bytes b as the base-257 digits b + 1 (0 past its end; -1 for an
    output without bytes), the outputs sorted by key."""
    n = len(tbytes) if outputs is None else int(outputs)
    keys = []
    for i in range(n):
        b = tbytes[i] if i < len(tbytes) else None
        if not b:
            keys.append(-1)
            continue
        k = 0
        for d in range(depth):
            k = k * 257 + (b[d] + 1 if d < len(b) else 0)
        keys.append(k)
    keys = torch.tensor(keys, dtype=torch.int64)
    order = torch.from_numpy(np.argsort(keys.numpy(), kind="stable"))
    steps = torch.tensor([257 ** (depth - d) for d in range(2, depth + 1)],
                         dtype=torch.int64)
    return _t.PathIndex(order, keys[order].contiguous(), steps)


def _bases(path, depth):
    """Each level's base key (levels 2 .. depth) for the text's next bytes
    `path` (as many as known, at least depth - 1 for every level)."""
    out, k = [], 0
    for d in range(2, depth + 1):
        k += (path[d - 2] + 1) * 257 ** (depth - d + 1)
        out.append(k)
    return out


def _head_logits(model, x, chunk):
    """A decoder's logits over ids x [n, L] as flat rows [rows, V], a
    chunk of rows through the head at a time (a large vocabulary's logits
    never whole).  Call under torch.no_grad()."""
    sp = _lg._split(model)
    if sp is None:
        z = _lg._logits(model(x))
        yield z.reshape(-1, z.shape[-1])
        return
    h = _lg._hidden(sp[0], x)
    flat = h.reshape(-1, h.shape[-1])
    for s, e in _lg._chunks(flat.shape[0], _lg._bounded(chunk, sp[1])):
        yield sp[1](flat[s:e])


def _pad(group, n):
    """group over n outputs: cut, or ids past it in the no-bytes group."""
    if group.numel() >= n:
        return group[:n]
    return torch.cat([group, torch.full((n - group.numel(),), GROUPS - 1,
                                        dtype=group.dtype)])


class ByteTeacher(object):
    """The first-byte teacher of each batch of the target's windows:
    entry i is (log m_A_ft - log m_A [rows, L, 257], mask [rows, L],
    deeper levels or None) until complete() adds the untouched target's
    own masses and normalizes; get(i, device) gives a
    bico.torch.teacher.Grouped (with its Path when depth > 1).  The
    deeper levels' entry: (the source's difference at each level
    [rows, L, D, 257], which levels it speaks for [rows, L, D], each
    level's base key [rows, L, D], the text's next byte at each level
    [rows, L, D + 1])."""
    k = None
    outputs = None
    bytes_disk = 0

    def __init__(self, entries, group, aligned, positions, index=None,
                 deep=0):
        self.entries, self.group = entries, group
        self.aligned, self.positions = aligned, positions
        self.index, self.deep = index, deep
        self._index_at = {}       # the index on each device get() used
        # positions with a teacher at each deeper level (after complete)
        self.levels = []
        self.done = False

    def __len__(self):
        return len(self.entries)

    @property
    def bytes_memory(self):
        total = 0
        for e in self.entries:
            for t in e[:2] + tuple(e[2] or ()):
                total += t.numel() * t.element_size()
        return total

    def complete(self, target, inputs, chunk=_lg.TOKEN_CHUNK):
        """The teacher from the untouched target's own distributions on
        inputs (the batches' ids, in order)."""
        if self.done:
            return
        target.eval()
        V = _outputs(target, inputs[0])
        self.group = _pad(self.group, V)
        if self.index is not None and self.index.order.numel() != V:
            self.index = _repad_index(self.index, V)
            self._index_at = {}
        for i, x in enumerate(inputs):
            d, m, deep = self.entries[i]
            base = None if deep is None else deep[2]
            mb, lb = _model_levels(target, x, self.group, chunk, base,
                                   self.index)
            first = torch.log_softmax(mb + d, dim=-1)
            if deep is not None:
                delta, avail, base, nxt = deep
                deep = _deep_teacher(first, lb, delta, avail, base, nxt)
            self.entries[i] = (first, m, deep)
            if deep is not None:
                got = (deep[1] > 0).flatten(0, -2).sum(0).tolist()
                self.levels = [a + b for a, b in
                               zip(self.levels or [0] * len(got), got)]
        self.done = True

    def get(self, i, device=None):
        if not self.done:
            raise RuntimeError("ByteTeacher.get before complete()")
        d, m, deep = self.entries[i]
        path = None
        if deep is not None:
            lp, w, base = deep
            key = str(torch.device(device or "cpu"))
            if key not in self._index_at:   # moved once, not every step
                self._index_at[key] = _t.PathIndex(
                    *(v.to(device) for v in self.index))
            path = _t.Path(lp.to(device), w.to(device), base.to(device),
                           self._index_at[key])
        return _t.Grouped(d.to(device), m.to(device), self.group.to(device),
                          path)

    def close(self):
        self.entries = []


def _repad_index(index, V):
    """The index over V outputs: ids past the tokenizer's (a padded
    vocabulary) have no bytes (key -1); ids past V dropped."""
    keys = torch.empty_like(index.keys)
    keys[index.order] = index.keys
    keys = torch.cat([keys, torch.full((max(0, V - keys.numel()),), -1,
                                       dtype=keys.dtype)])[:V]
    order = torch.from_numpy(np.argsort(keys.numpy(), kind="stable"))
    return _t.PathIndex(order, keys[order].contiguous(), index.steps)


def _deep_teacher(first, lb, delta, avail, base, nxt):
    """The deeper levels' teacher: at level d the target's own masses of
    the level's groups (lb: log, conditional on the level's prefix) moved
    by the source's difference (the byte groups; the output that ends at
    the prefix unmoved), normalized; each level's weight the teacher's
    probability of the level's prefix (the first byte's, then each
    level's group of the text's next byte), 0 where the level has no
    teacher.  Returns (logp [.., D, 257], weight [.., D], base)."""
    D = delta.shape[-2]
    shift = torch.cat([torch.zeros(delta.shape[:-1] + (1,)),
                       delta[..., :256]], dim=-1)
    lp = torch.log_softmax(lb + shift, dim=-1)
    # the prefix's log-probability: level 1's group of the next byte, then
    # each level's group of the byte after
    reach = first.gather(-1, nxt[..., :1]).squeeze(-1)
    w = []
    ok = torch.ones_like(avail[..., 0])
    empty = torch.isnan(lb[..., 0])
    lp = torch.where(empty[..., None], torch.zeros_like(lp), lp)
    for k in range(D):
        ok = ok & avail[..., k] & ~empty[..., k]
        w.append(torch.where(ok, reach.exp(), torch.zeros_like(reach)))
        reach = reach + lp[..., k, :].gather(
            -1, nxt[..., k + 1:k + 2] + 1).squeeze(-1)
    return lp, torch.stack(w, dim=-1), base


def _outputs(model, x):
    sp = _lg._split(model)
    if sp is not None:
        return sp[1].weight.shape[0]
    with torch.no_grad():
        return _lg._logits(model(x[:1, :1])).shape[-1]


def _model_levels(model, x, group, chunk, base=None, index=None):
    """The first-byte log-marginals [n, L, 257] of a decoder's logits
    over ids x [n, L], and with base [n, L, D] (else None) its deeper
    levels' conditional log-masses [n, L, D, 257]
    (bico.torch.teacher.path_logmass over the PathIndex `index`), on the
    CPU.  The group (one per output) is cut or padded to the logits'
    width (ids past it: the no-bytes group)."""
    bf = None if base is None else base.reshape(-1, base.shape[-1])
    firsts, deeps, hi, idx = [], [], 0, None
    with torch.no_grad():
        for z in _head_logits(model, x, chunk):
            firsts.append(marginals(z, _pad(group, z.shape[-1])
                                    .to(z.device)).cpu())
            lo, hi = hi, hi + z.shape[0]
            if bf is None:
                continue
            p = torch.softmax(z.float(), dim=-1)
            if idx is None:
                idx = _t.PathIndex(*(v.to(p.device) for v in index))
            lm, count = _t.path_logmass(p, bf[lo:hi].to(p.device), idx)
            # a level of fewer than two outputs teaches nothing
            deeps.append(torch.where(count[..., None] >= 2, lm,
                                     torch.full_like(lm, math.nan)).cpu())
    lead = tuple(x.shape)
    first = torch.cat(firsts).reshape(lead + (GROUPS,))
    if bf is None:
        return first, None
    return first, torch.cat(deeps).reshape(lead + tuple(base.shape[-1:]) +
                                           (GROUPS,))


def _source_bases(found, where, shape, D):
    """The source's level bases [pieces, L, D] for its pieces (where:
    each piece's (row, first token)): at the position before the
    source's token j, the bases of the text's bytes from where j starts
    (missing bytes past the text read as 0: only the levels whose prefix
    the text holds are used)."""
    out = torch.zeros(tuple(shape) + (D,), dtype=torch.int64)
    starts_of = {}
    for k, (r, s0) in enumerate(where):
        if r not in starts_of:
            starts_of[r] = {j: o for o, j in found[r][3].items()}
        raw, span = found[r][2], found[r][5]
        for p in range(shape[1]):
            o = starts_of[r].get(s0 + p + 1)
            if o is None:
                continue
            nb = list(raw[o:min(o + D, span[1])])
            out[k, p] = torch.tensor(_bases(nb + [0] * (D - len(nb)),
                                            D + 1))
    return out


def build(source, tuned, tok_a, tok_b, batches, window, progress=None,
          chunk=_lg.TOKEN_CHUNK, size_a=None, size_b=None, depth=DEPTH):
    """A ByteTeacher of the target's fit batches ([(ids, next ids)]),
    the source pair (source, tuned: decoders of tok_a's ids) run over
    each window's text in the source's tokens, in pieces of at most
    `window` tokens.  depth > 1: levels 2 .. depth along the text too,
    wherever the source starts a token at each of the next bytes (a
    byte-level source: everywhere) or reads it inside its own token
    (a source of tokens of several bytes).  progress(i, n) after each
    batch."""
    if not (isinstance(depth, int) and depth >= 1):
        raise ValueError("across.build: depth must be an integer >= 1, "
                         "got %r" % (depth,))
    tb_a, tb_b = token_bytes(tok_a, size_a), token_bytes(tok_b, size_b)
    g_a, g_b = groups(tb_a), groups(tb_b)
    D = depth - 1
    index = path_index(tb_b, depth) if D else None
    dev = next(source.parameters()).device
    # a source with tokens of several bytes carries the deeper levels
    # inside its own tokens too (where it starts no token at the byte)
    index_a = None
    if D and any(b is not None and len(b) > 1 for b in tb_a):
        index_a = path_index(tb_a, depth)
    for m in (source, tuned):
        m.eval()
    entries, aligned, positions = [], 0, 0
    for bi, (x, y) in enumerate(batches):
        rows = torch.cat([x, y[:, -1:]], dim=1)
        delta = torch.zeros(x.shape + (GROUPS,))
        mask = torch.zeros(x.shape, dtype=torch.bool)
        if D:
            ddelta = torch.zeros(x.shape + (D, GROUPS))
            avail = torch.zeros(x.shape + (D,), dtype=torch.bool)
            base = torch.zeros(x.shape + (D,), dtype=torch.int64)
            nxt = torch.zeros(x.shape + (D + 1,), dtype=torch.int64)
        found = [_align(r.tolist(), tb_b, tok_a, tb_a) for r in rows]
        pieces, where = [], []
        for r, f in enumerate(found):
            if f is None or not f[1]:
                continue
            ids = f[0]
            for s in range(0, len(ids) - 1, window):
                pieces.append(ids[s:s + window])
                where.append((r, s))
        if pieces:
            L = max(len(p) for p in pieces)
            xs = torch.zeros(len(pieces), L, dtype=torch.int64)
            for k, p in enumerate(pieces):
                xs[k, :len(p)] = p        # right-padded: causal
            sb = None
            if index_a is not None:
                sb = _source_bases(found, where, xs.shape, D)
                V_a = _outputs(source, xs[:1].to(dev))
                if index_a.order.numel() != V_a:
                    index_a = _repad_index(index_a, V_a)
            d, dd = [], []
            for s in range(0, len(pieces), len(x)):
                xb = xs[s:s + len(x)].to(dev)
                bb = None if sb is None else sb[s:s + len(x)]
                ft, ftd = _model_levels(tuned, xb, g_a, chunk, bb, index_a)
                at0, at0d = _model_levels(source, xb, g_a, chunk, bb,
                                          index_a)
                d.append(ft - at0)
                if bb is not None:
                    # a group neither model gives mass to says nothing
                    # (its conditional held, not moved by the whole's)
                    dd.append(torch.where((ftd < _EMPTY) & (at0d < _EMPTY),
                                          torch.zeros_like(ftd),
                                          ftd - at0d))
            d = torch.cat(d)
            dd = torch.cat(dd) if dd else None
            first = {}          # row -> {piece's start: piece}
            for k, (r, s) in enumerate(where):
                first.setdefault(r, {})[s] = k

            def row_of(r, j, of=d):
                """The source's difference before its token j."""
                s = (j - 1) // window * window
                return of[first[r][s], j - 1 - s]
            for r, f in enumerate(found):
                if f is None:
                    continue
                _, pairs, raw, at, starts, span = f
                for t, j in pairs:
                    delta[r, t] = row_of(r, j)
                    mask[r, t] = True
                    if not D:
                        continue
                    o = starts[t + 1]
                    nb = list(raw[o:min(o + D + 1, span[1])])
                    nxt[r, t, :len(nb)] = torch.tensor(nb, dtype=torch.int64)
                    if len(nb) < D:
                        continue      # base keys need D bytes: level off
                    base[r, t] = torch.tensor(_bases(nb, depth))
                    for k in range(D):
                        b = o + k + 1           # the byte level k + 2 reads
                        if b >= span[1]:
                            break
                        jk = at.get(b)
                        if jk is not None:      # the source starts a token
                            ddelta[r, t, k] = row_of(r, jk)
                            avail[r, t, k] = True
                            continue
                        if dd is None:
                            break
                        # inside the source's token that starts at sk
                        # (o at the latest): its level b - sk + 1
                        sk = max(q for q in range(o, b) if q in at)
                        v = row_of(r, at[sk], dd)[b - sk - 1]
                        if bool(torch.isnan(v).any()):
                            break
                        # the pair's difference on [ends there, bytes],
                        # as the byte groups' shift against the end's
                        ddelta[r, t, k, :256] = v[1:] - v[0]
                        avail[r, t, k] = True
        aligned += int(mask.sum())
        positions += mask.numel()
        entries.append((delta, mask, (ddelta, avail, base, nxt)
                        if D else None))
        if progress is not None:
            progress(bi + 1, len(batches))
    return ByteTeacher(entries, g_b, aligned, positions, index, D)
