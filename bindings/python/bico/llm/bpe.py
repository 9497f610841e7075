"""bico.llm.bpe: byte-level BPE tokenizers (tokenizer.json of the GPT-2,
Llama 3 and Qwen2 kind) read and run natively, and trained, where Hugging
Face's `tokenizers` package is not installed.

    tok = ByteLevelBPE.from_spec(json.load(open("tokenizer.json")))
    ids = tok.encode("some text");  text = tok.decode(ids)
    spec = train(text, vocab_size=512)          # a tokenizer.json dict

The model: every byte is a symbol (the GPT-2 byte-to-unicode map), the text
is split into pieces (the pre-tokenizer: GPT-2's pattern, its letter and
number classes those of Python's `re`, which agree with the `regex`
module's \\p{L} and \\p{N} on the usual scripts), and within each piece the
merges are applied in rank order.  Added tokens (special tokens) are
matched whole before anything else.  When `tokenizers` is installed,
bico.llm.text uses it instead: it is the reference.
"""
import re
from collections import Counter

from .._status import BicoError, E_FORMAT, E_UNSUPPORTED

__all__ = ["ByteLevelBPE", "bytes_to_unicode", "train", "PATTERN"]

# GPT-2's pre-tokenizer, with Python's classes for \p{L} ([^\W\d_]) and
# \p{N} (\d); the last alternatives take every other character (so none is
# ever dropped: "_" is punctuation here, as in GPT-2)
PATTERN = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+|"""
                     r""" ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def bytes_to_unicode():
    """GPT-2's map of the 256 bytes to printable characters."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
          + list(range(0xAE, 0x100)))
    cs = list(bs)
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _merged(syms, a, b):
    """syms with every adjacent (a, b), left to right, made one symbol."""
    out, k = [], 0
    while k < len(syms):
        if k < len(syms) - 1 and syms[k] == a and syms[k + 1] == b:
            out.append(a + b)
            k += 2
        else:
            out.append(syms[k])
            k += 1
    return out


class ByteLevelBPE(object):
    """A byte-level BPE tokenizer: vocab {token string: id}, merges [(a,
    b)] in rank order, added {special token: id}."""

    def __init__(self, vocab, merges, added=None, use_regex=True,
                 prefix_space=False):
        self.vocab = dict(vocab)
        self.ranks = {tuple(m): i for i, m in enumerate(merges)}
        self.added = dict(added or {})
        self.use_regex, self.prefix_space = use_regex, prefix_space
        self.byte = bytes_to_unicode()
        self.unbyte = {c: b for b, c in self.byte.items()}
        self.inv = {i: t for t, i in self.vocab.items()}
        self.inv.update({i: t for t, i in self.added.items()})
        missing = [c for c in self.byte.values() if c not in self.vocab]
        if missing:
            raise BicoError(E_FORMAT, "bpe: the vocabulary lacks %d of the "
                            "256 byte symbols (e.g. %r): not a byte-level "
                            "BPE" % (len(missing), missing[0]))
        self._cache = {}
        self._special = re.compile("(%s)" % "|".join(
            re.escape(t) for t in sorted(self.added, key=len,
                                         reverse=True))) \
            if self.added else None

    @classmethod
    def from_spec(cls, spec, path="tokenizer.json"):
        """From a tokenizer.json dict (model BPE, pre-tokenizer ByteLevel,
        alone or in a Sequence); BicoError E_FORMAT naming path otherwise."""
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise BicoError(E_UNSUPPORTED, "bpe: %s: model type %r, not BPE"
                            % (path, model.get("type")))
        pre = spec.get("pre_tokenizer") or {}
        items = pre.get("pretokenizers", [pre]) if pre.get("type") == \
            "Sequence" else [pre]
        bl = [p for p in items if isinstance(p, dict) and
              p.get("type") == "ByteLevel"]
        if not bl:
            raise BicoError(E_UNSUPPORTED, "bpe: %s: no ByteLevel "
                            "pre-tokenizer: "
                            "not a byte-level BPE" % path)
        split = any(p.get("type") == "Split" for p in items
                    if isinstance(p, dict))
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                  for m in model.get("merges") or []]
        added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []
                 if isinstance(t, dict) and "content" in t and "id" in t}
        vocab = model.get("vocab") or {}
        if not isinstance(vocab, dict) or not all(
                isinstance(t, str) and isinstance(i, int) and
                not isinstance(i, bool) and i >= 0 for t, i in vocab.items()):
            raise BicoError(E_FORMAT, "bpe: %s: model.vocab is not a map of "
                            "token strings to ids >= 0" % path)
        for k, m in enumerate(merges):
            if len(m) != 2 or not all(isinstance(x, str) for x in m):
                raise BicoError(E_FORMAT, "bpe: %s: merge %d (%r) is not a "
                                "pair of symbols" % (path, k, m))
            for x in (m[0], m[1], m[0] + m[1]):
                if x not in vocab:
                    raise BicoError(E_FORMAT, "bpe: %s: merge %d (%r %r) "
                                    "needs %r, which is not in the "
                                    "vocabulary" % (path, k, m[0], m[1], x))
        try:
            return cls(vocab, merges, added,
                       use_regex=bool(bl[0].get("use_regex", True)) or split,
                       prefix_space=bool(bl[0].get("add_prefix_space")))
        except BicoError as e:
            raise BicoError(e.status, e.message.replace(
                "bpe: ", "bpe: %s: " % path, 1))

    def spec(self):
        """The tokenizer.json dict of this tokenizer."""
        inv_rank = sorted(self.ranks, key=self.ranks.get)
        return {
            "version": "1.0",
            "added_tokens": [{"id": i, "content": t, "single_word": False,
                              "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True}
                             for t, i in sorted(self.added.items(),
                                                key=lambda x: x[1])],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel",
                              "add_prefix_space": self.prefix_space,
                              "trim_offsets": True,
                              "use_regex": self.use_regex},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                        "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False,
                      "byte_fallback": False,
                      "vocab": dict(sorted(self.vocab.items(),
                                           key=lambda x: x[1])),
                      "merges": [" ".join(m) for m in inv_rank]}}

    def __len__(self):
        return max(list(self.vocab.values()) + list(self.added.values())) + 1

    def _word(self, piece):
        """The ids of one pre-tokenized piece (its bytes mapped)."""
        got = self._cache.get(piece)
        if got is not None:
            return got
        syms = list(piece)
        while len(syms) > 1:
            best, at = None, -1
            for k in range(len(syms) - 1):
                r = self.ranks.get((syms[k], syms[k + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, k
            if best is None:
                break
            syms = _merged(syms, syms[at], syms[at + 1])
        ids = [self.vocab[s] for s in syms]
        if len(self._cache) < 100000 and len(piece) <= 256:
            self._cache[piece] = ids
        return ids

    def _pieces(self, text):
        if self.prefix_space and text and not text.startswith(" "):
            text = " " + text
        return PATTERN.findall(text) if self.use_regex else [text]

    def encode(self, text):
        """The token ids of text."""
        out = []
        parts = self._special.split(text) if self._special else [text]
        for part in parts:
            if not part:
                continue
            if part in self.added:
                out.append(self.added[part])
                continue
            for piece in self._pieces(part):
                out.extend(self._word("".join(
                    self.byte[b] for b in piece.encode("utf-8"))))
        return out

    def decode(self, ids):
        """The text of token ids (bytes that are not UTF-8 replaced)."""
        raw = bytearray()
        for i in ids:
            t = self.inv.get(int(i))
            if t is None:
                continue
            if t in self.added:
                raw.extend(t.encode("utf-8"))
            else:
                raw.extend(self.unbyte[c] for c in t)
        return raw.decode("utf-8", errors="replace")


def train(text, vocab_size, added=(), order=None):
    """A byte-level BPE tokenizer (ByteLevelBPE) trained on text: the 256
    byte symbols (in `order`, a permutation of range(256) giving each
    byte's id; default: byte value order), then merges of the most frequent
    adjacent pair within pre-tokenized pieces until vocab_size tokens,
    then the added (special) tokens."""
    byte = bytes_to_unicode()
    order = list(range(256)) if order is None else list(order)
    vocab = {byte[b]: i for i, b in enumerate(order)}
    words = Counter("".join(byte[b] for b in p.encode("utf-8"))
                    for p in PATTERN.findall(text))
    words = {tuple(w): c for w, c in words.items()}
    merges = []
    while len(vocab) < vocab_size:
        pairs = Counter()
        for w, c in words.items():
            for k in range(len(w) - 1):
                pairs[(w[k], w[k + 1])] += c
        if not pairs:
            break
        (a, b), n = max(pairs.items(), key=lambda x: (x[1], x[0]))
        if n < 2:
            break
        merges.append((a, b))
        vocab[a + b] = len(vocab)
        nw = {}
        for w, c in words.items():
            t = tuple(_merged(w, a, b))
            nw[t] = nw.get(t, 0) + c
        words = nw
    adds = {t: len(vocab) + k for k, t in enumerate(added)}
    return ByteLevelBPE(vocab, merges, adds)
