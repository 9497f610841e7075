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

The source's side is computed once per window of the target's tokens
(the window's bytes tokenized again by the source, the source pair run
over them in pieces of its context), kept as the difference
log m_A_ft - log m_A per aligned position; the target's own part is
added by complete(), run on the untouched target when the distillation
starts (bico.llm.distill.run), so the teacher never needs the three
models at once.
"""
import torch

from ..torch import logits as _lg
from ..torch import teacher as _t
from .bpe import bytes_to_unicode

__all__ = ["token_bytes", "groups", "marginals", "align", "ByteTeacher",
           "build", "GROUPS"]

# 256 byte values and one group for tokens without bytes
GROUPS = 257
_TINY = 1e-30


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
    return torch.tensor(ids_a, dtype=torch.int64), pairs


def _model_marginals(model, x, group, chunk):
    """marginals of a decoder's logits over ids x [n, L], a chunk of rows
    through the head at a time (a large vocabulary's logits never whole)."""
    sp = _lg._split(model)
    with torch.no_grad():
        if sp is None:
            z = _lg._logits(model(x))
            return marginals(z, group[:z.shape[-1]] if z.shape[-1] <=
                             group.numel() else _pad(group, z.shape[-1]))
        h = _lg._hidden(sp[0], x)
        flat = h.reshape(-1, h.shape[-1])
        V = sp[1].weight.shape[0]
        g = _pad(group, V)
        out = [marginals(sp[1](flat[s:e]), g)
               for s, e in _lg._chunks(flat.shape[0],
                                      _lg._bounded(chunk, sp[1]))]
        return torch.cat(out).reshape(h.shape[:-1] + (GROUPS,))


def _pad(group, n):
    """group over n outputs: cut, or ids past it in the no-bytes group."""
    if group.numel() >= n:
        return group[:n]
    return torch.cat([group, torch.full((n - group.numel(),), GROUPS - 1,
                                        dtype=group.dtype)])


class ByteTeacher(object):
    """The first-byte teacher of each batch of the target's windows:
    entry i is (log m_A_ft - log m_A [rows, L, 257], mask [rows, L]) until
    complete() adds the untouched target's own log m_B and normalizes;
    get(i, device) gives a bico.torch.teacher.Grouped."""
    k = None
    outputs = None
    bytes_disk = 0

    def __init__(self, entries, group, aligned, positions):
        self.entries, self.group = entries, group
        self.aligned, self.positions = aligned, positions
        self.done = False

    def __len__(self):
        return len(self.entries)

    @property
    def bytes_memory(self):
        return sum(d.numel() * d.element_size() + m.numel()
                   for d, m in self.entries)

    def complete(self, target, inputs, chunk=_lg.TOKEN_CHUNK):
        """The teacher from the untouched target's own first-byte
        distributions on inputs (the batches' ids, in order)."""
        if self.done:
            return
        target.eval()
        for i, x in enumerate(inputs):
            d, m = self.entries[i]
            mb = _model_marginals(target, x, self.group, chunk).cpu()
            self.entries[i] = (torch.log_softmax(mb + d, dim=-1), m)
        self.group = _pad(self.group, _outputs(target, inputs[0]))
        self.done = True

    def get(self, i, device=None):
        if not self.done:
            raise RuntimeError("ByteTeacher.get before complete()")
        d, m = self.entries[i]
        return _t.Grouped(d.to(device), m.to(device), self.group.to(device))

    def close(self):
        self.entries = []


def _outputs(model, x):
    sp = _lg._split(model)
    if sp is not None:
        return sp[1].weight.shape[0]
    with torch.no_grad():
        return _lg._logits(model(x[:1, :1])).shape[-1]


def build(source, tuned, tok_a, tok_b, batches, window, progress=None,
          chunk=_lg.TOKEN_CHUNK, size_a=None, size_b=None):
    """A ByteTeacher of the target's fit batches ([(ids, next ids)]),
    the source pair (source, tuned: decoders of tok_a's ids) run over
    each window's text in the source's tokens, in pieces of at most
    `window` tokens.  progress(i, n) after each batch."""
    tb_a, tb_b = token_bytes(tok_a, size_a), token_bytes(tok_b, size_b)
    g_a, g_b = groups(tb_a), groups(tb_b)
    dev = next(source.parameters()).device
    for m in (source, tuned):
        m.eval()
    entries, aligned, positions = [], 0, 0
    for bi, (x, y) in enumerate(batches):
        rows = torch.cat([x, y[:, -1:]], dim=1)
        delta = torch.zeros(x.shape + (GROUPS,))
        mask = torch.zeros(x.shape, dtype=torch.bool)
        found = [align(r.tolist(), tb_b, tok_a, tb_a) for r in rows]
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
            d = torch.cat([
                _model_marginals(tuned, xs[s:s + len(x)].to(dev), g_a,
                                 chunk) -
                _model_marginals(source, xs[s:s + len(x)].to(dev), g_a,
                                 chunk)
                for s in range(0, len(pieces), len(x))]).cpu()
            first = {}
            for k, (r, s) in enumerate(where):
                first.setdefault(r, []).append((s, k))
            for r, f in enumerate(found):
                if f is None:
                    continue
                for t, j in f[1]:
                    s = (j - 1) // window * window
                    k = dict(first[r])[s]
                    delta[r, t] = d[k, j - 1 - s]
                    mask[r, t] = True
        aligned += int(mask.sum())
        positions += mask.numel()
        entries.append((delta, mask))
        if progress is not None:
            progress(bi + 1, len(batches))
    return ByteTeacher(entries, g_b, aligned, positions)
