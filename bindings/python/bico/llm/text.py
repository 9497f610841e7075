"""bico.llm.text: calibration windows for decoders from token ids or text
(tokenizer.json read natively for byte-level tokenizers, or by Hugging
Face's `tokenizers`), and the next-token loss.

    cal = bl.text_batches("task.txt", window=256, tokenizer="Qwen2-0.5B/")
    new_sd = bt.transfer_model(src, src_ft, tgt, cal.batches, method="fit",
                               loss_fn=bl.next_token_loss)
"""
import json
import os
import re
from collections import namedtuple

import numpy as np
import torch
import torch.nn.functional as F

from .._inputs import check_input, open_input, read_input
from .._status import BicoError, E_ARG, E_FORMAT, E_NOTFOUND, E_UNSUPPORTED
from ..torch.choose import HOLDOUT, held_out_count
from .bpe import bytes_to_unicode as _bytes_to_unicode

__all__ = ["tokenize", "detokenize", "load_tokenizer", "text_batches",
           "Calibration", "next_token_loss", "lm_loss", "path_like",
           "read_text", "read_ids"]


def _tokenizer_file(tok):
    p = str(tok)
    if os.path.isdir(p):
        p = os.path.join(p, "tokenizer.json")
    if not os.path.exists(p):
        raise BicoError(E_NOTFOUND, "tokenize: no tokenizer file %s" % p)
    return p


def _byte_level(spec, path):
    """The byte map of a byte-level tokenizer.json without merges (every
    byte one token), or None."""
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    if not (isinstance(model, dict) and isinstance(pre, dict) and
            isinstance(model.get("vocab") or {}, dict)):
        return None
    if model.get("type") != "BPE" or model.get("merges") or \
            pre.get("type") != "ByteLevel":
        return None
    vocab = model.get("vocab") or {}
    m = _bytes_to_unicode()
    try:
        table = np.array([vocab[m[b]] for b in range(256)], dtype=np.int64)
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    return table, bool(pre.get("add_prefix_space"))


class _Bytes(object):
    """The byte-level tokenizer whose vocabulary is the 256 bytes and has
    no merges, read natively (a table)."""

    def __init__(self, table, prefix):
        self.table, self.prefix = table, prefix
        self.inv = {int(i): b for b, i in enumerate(table)}

    def encode(self, text):
        if self.prefix and text and not text.startswith(" "):
            text = " " + text
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return self.table[raw].copy()

    def decode(self, ids):
        return bytes(self.inv[int(i)] for i in ids if int(i) in self.inv) \
            .decode("utf-8", errors="replace")


class _Hugging(object):
    """A tokenizer of Hugging Face's `tokenizers` package."""

    def __init__(self, tk):
        self.tk = tk

    def encode(self, text):
        return np.asarray(self.tk.encode(text).ids, dtype=np.int64)

    def decode(self, ids):
        return self.tk.decode([int(i) for i in ids])


def load_tokenizer(tokenizer):
    """A tokenizer.json file (or the model folder holding it) as an object
    with encode(text) -> ids and decode(ids) -> text: Hugging Face's
    `tokenizers` package when it is installed; without it, natively, the
    byte-level tokenizer without merges (a table) and byte-level BPE
    (bico.llm.bpe); any other is refused (tokenize with your own tokenizer
    and pass the ids)."""
    path = _tokenizer_file(tokenizer)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        Tokenizer = None
    raw = read_input(path, "tokenize:", limit=TOKENIZER_LIMIT)
    if Tokenizer is not None:
        try:
            return _Hugging(Tokenizer.from_str(raw.decode("utf-8")))
        except Exception as e:  # the package's own error type
            raise BicoError(E_FORMAT, "tokenize: %s is not a tokenizer "
                            "file the tokenizers package reads (%s)"
                            % (path, str(e).splitlines()[0][:200]))
    try:
        spec = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise BicoError(E_FORMAT, "tokenize: %s is not a JSON tokenizer "
                        "file (%s)" % (path, e))
    bl = _byte_level(spec, path) if isinstance(spec, dict) else None
    if bl is not None and not spec.get("added_tokens"):
        return _Bytes(*bl)
    if isinstance(spec, dict) and ((spec.get("model") or {}).get("merges")
                                   or bl is not None):
        from .bpe import ByteLevelBPE
        try:
            return ByteLevelBPE.from_spec(spec, path)
        except BicoError as e:
            if e.status != E_UNSUPPORTED:
                raise  # a byte-level BPE, malformed: say where
    raise BicoError(E_UNSUPPORTED, "tokenize: %s needs Hugging Face's "
                    "`tokenizers` package (pip install tokenizers), "
                    "or pass token ids (--ids ids.npy in python3 -m "
                    "bico.llm)" % path)


def detokenize(ids, tokenizer):
    """The text of token ids (tokenizer: as tokenize takes it, or an
    object load_tokenizer returned)."""
    tk = tokenizer if hasattr(tokenizer, "decode") else \
        load_tokenizer(tokenizer)
    return tk.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def tokenize(text, tokenizer):
    """Token ids (a 1-D int64 tensor) of text.  tokenizer: a callable (text
    -> ids, or an object with .encode(text) giving ids or .ids), or a
    tokenizer.json file / model folder (load_tokenizer: Hugging Face's
    `tokenizers` package when it is installed; natively, byte-level
    tokenizers with or without merges; any other refused: tokenize with
    your own tokenizer and pass the ids)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tk = load_tokenizer(tokenizer)
        return torch.as_tensor(np.asarray(tk.encode(text), dtype=np.int64))
    if tokenizer is None:
        raise BicoError(E_ARG, "tokenize: text needs a tokenizer (a "
                        "callable, or a tokenizer.json file or folder)")
    out = tokenizer.encode(text) if hasattr(tokenizer, "encode") and \
        not callable(tokenizer) else tokenizer(text)
    if hasattr(out, "ids"):
        out = out.ids
    if isinstance(out, dict) and "input_ids" in out:
        out = out["input_ids"]
    return torch.as_tensor(np.asarray(out), dtype=torch.int64).reshape(-1)


# a tokenizer.json larger than this is no tokenizer's
TOKENIZER_LIMIT = 1 << 30

_EXT = re.compile(r"\.[A-Za-z0-9_]{1,8}$")


def path_like(s):
    """Whether the string s reads as a file name rather than text: one
    line of at most 4096 characters without whitespace that holds a "/"
    (or os.sep) or ends in a dot and 1-8 letters, digits or "_" ("task.md",
    "data/task", "ids.npy").  text_batches refuses such a string when no
    file has that name."""
    return (isinstance(s, str) and 0 < len(s) <= 4096 and
            not any(c.isspace() for c in s) and
            ("/" in s or os.sep in s or bool(_EXT.search(s))))


def _exists(p):
    try:
        return os.path.exists(p)
    except (ValueError, TypeError):   # a NUL in the name
        return False


def _read_source(src):
    """ids_or_text with a path read: a .npy file's array, another file's
    UTF-8 text; other values as they are."""
    if isinstance(src, os.PathLike) or (isinstance(src, str) and
                                        _exists(src)):
        return _read_file(os.fspath(src))
    if path_like(src):
        raise BicoError(E_NOTFOUND, "text_batches: %r names no file (a "
                        "string that looks like a path is never tokenized "
                        "as text: pass the text itself, or its ids)" % src)
    return src


def _read_file(p):
    if os.path.isdir(p):
        raise BicoError(E_ARG, "text_batches: %s is a folder, not a text or "
                        ".npy file" % p)
    try:
        if p.endswith(".npy"):
            return read_ids(p, "text_batches:")
        return read_text(p, "text_batches:")
    except (OSError, ValueError) as e:
        raise BicoError(E_NOTFOUND if isinstance(e, FileNotFoundError)
                        else E_ARG, "text_batches: cannot read %s (%s)"
                        % (p, e))


# Text is read as a stream of at most this many bytes (or what the
# windows need, when that is more): a larger file is read as PIECES
# pieces spread evenly over it, so that its windows still come from the
# whole text while memory stays bounded, and a huge file is never read
# whole before the window cap applies.
TEXT_READ_LIMIT = 64 << 20
PIECES = 1024


def text_spans(size, limit=TEXT_READ_LIMIT):
    """[(offset, length)] of the bytes read_text reads of a file of `size`
    bytes: the whole file within limit, else PIECES pieces of limit /
    PIECES bytes spread evenly over it (before each is cut at character
    boundaries).  bico.llm.agree fingerprints --text by them."""
    if size <= limit:
        return [(0, size)]
    span = max(1, limit // PIECES)
    return [((size - span) * k // (PIECES - 1), span)
            for k in range(PIECES)]


def _utf8_piece(raw, at, first, last):
    """raw (bytes read at file offset `at`) cut to whole UTF-8 characters:
    continuation bytes dropped at its start (unless first) and an
    incomplete character at its end (unless last)."""
    i = 0
    if not first:
        while i < min(4, len(raw)) and 0x80 <= raw[i] < 0xC0:
            i += 1
    j = len(raw)
    if not last:
        k = j
        while k > max(i, j - 4) and 0x80 <= raw[k - 1] < 0xC0:
            k -= 1
        if k > i and raw[k - 1] >= 0xC0:
            need = 2 if raw[k - 1] < 0xE0 else 3 if raw[k - 1] < 0xF0 else 4
            if j - (k - 1) < need:
                j = k - 1
    return raw[i:j], at + i


def read_text(path, what=None, limit=None):
    """The UTF-8 text of a regular file (bico._inputs' rules: a FIFO, a
    device or a socket is refused, never read), as a stream of at most
    `limit` bytes (TEXT_READ_LIMIT): a file within it is read whole; a
    larger one as PIECES pieces of limit / PIECES bytes spread evenly over
    it, each cut at character boundaries, joined by newlines.  Bytes that
    are not UTF-8 are refused naming their offset in the file
    (BicoError E_ARG)."""
    limit = TEXT_READ_LIMIT if limit is None else int(limit)
    pre = "%s %s" % (what, path) if what else str(path)
    with open_input(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        spans = text_spans(size, limit)
        if len(spans) == 1:
            parts = [(f.read(limit + 1)[:limit], 0)]
        else:
            parts = []
            for k, (at, span) in enumerate(spans):
                f.seek(at)
                parts.append(_utf8_piece(f.read(span), at, k == 0,
                                         k == PIECES - 1))
    out = []
    for raw, at in parts:
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise BicoError(E_ARG, "%s: not UTF-8 text (byte 0x%02x at "
                            "offset %d); convert it (iconv -t UTF-8) or pass "
                            "token ids" % (pre, raw[e.start], at + e.start))
    return "\n".join(out)


def read_ids(path, what=None):
    """Token ids of a .npy file (a regular file: bico._inputs' rules),
    mapped rather than read, so that only the windows used are ever read
    (BicoError E_ARG for a file that is not a .npy array)."""
    pre = "%s %s" % (what, path) if what else str(path)
    check_input(path, what)
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise BicoError(E_ARG, "%s: not a .npy file of token ids (%s)"
                        % (pre, str(e).splitlines()[0][:200]))


def _as_ids(src):
    """A 1-D int64 tensor of token ids: integers >= 0, refused otherwise
    (floats, booleans, strings)."""
    try:
        a = np.asarray(src.detach().cpu().numpy() if isinstance(
            src, torch.Tensor) else src)
    except (TypeError, ValueError) as e:
        raise BicoError(E_ARG, "text_batches: token ids must be integers "
                        "(%s)" % e)
    if a.dtype.kind not in "iu":
        raise BicoError(E_ARG, "text_batches: token ids must be integers, "
                        "got %s" % a.dtype)
    a = a.reshape(-1)
    # a piece at a time: a mapped .npy file is read as a stream
    for s in range(0, a.size, _CHUNK):
        part = np.asarray(a[s:s + _CHUNK])
        if part.size and part.min() < 0:
            i = s + int(np.nonzero(part < 0)[0][0])
            raise BicoError(E_ARG, "text_batches: token ids must be >= 0, "
                            "got %d at position %d" % (int(a[i]), i))
    if isinstance(a, np.memmap) or not a.flags.writeable:
        return a          # windows are cut from it (_windows), not copied
    return torch.from_numpy(a.astype(np.int64, copy=False))


_CHUNK = 1 << 20


def _windows(ids, window, idx):
    """The windows idx (each window + 1 tokens from i * window) of ids (a
    tensor, or a mapped array: only these windows are read)."""
    rows = [np.asarray(ids[i * window:(i + 1) * window + 1], dtype=np.int64)
            if not isinstance(ids, torch.Tensor) else
            ids[i * window:(i + 1) * window + 1] for i in idx]
    if rows and not isinstance(rows[0], torch.Tensor):
        return torch.from_numpy(np.stack(rows))
    return torch.stack(rows)


Calibration = namedtuple("Calibration", "batches held_out windows")


def text_batches(ids_or_text, window, n=None, holdout=HOLDOUT, tokenizer=None,
                 batch_size=8, seed=0):
    """Calibration batches for a decoder from token ids or text.

    ids_or_text: token ids (a 1-D tensor, array or list), text (a str), or
    a path (an os.PathLike, or a str naming an existing file): a .npy file
    of ids, any other file read as UTF-8 text.  A str that names no file
    but looks like a path (path_like: one line without spaces that holds
    a "/" or ends in a short extension such as ".md") is refused naming
    it, never tokenized as text.  The ids
    are cut into consecutive windows of window + 1 tokens; each batch is
    (ids [b, window], next ids [b, window]), for model(x) and
    next_token_loss(logits, y).  n: at most this many windows (spread
    evenly over the text); holdout: the share of windows held out (every
    k-th window, at least one when there are two or more; default
    bico.torch.choose.HOLDOUT, an eighth, as every held-out choice) for the choices
    a fit makes (scale, ridge): never use them for the fit itself, nor your
    evaluation text for either.  Returns Calibration(batches, held_out,
    windows) with windows the number of fit windows."""
    if not (isinstance(window, int) and window >= 1):
        raise BicoError(E_ARG, "text_batches: window must be a positive "
                        "integer, got %r" % (window,))
    if not (0 <= holdout < 1):
        raise BicoError(E_ARG, "text_batches: holdout must be in [0, 1), "
                        "got %r" % (holdout,))
    for name, v in (("n", n), ("batch_size", batch_size)):
        if v is not None and (isinstance(v, bool) or not
                              isinstance(v, (int, np.integer)) or v < 1):
            raise BicoError(E_ARG, "text_batches: %s must be a positive "
                            "integer, got %r" % (name, v))
    src = _read_source(ids_or_text)
    if isinstance(src, str):
        ids = tokenize(src, tokenizer)
    else:
        ids = _as_ids(src)
    total = ids.numel() if isinstance(ids, torch.Tensor) else int(ids.size)
    m = (total - 1) // window
    if m < 1:
        raise BicoError(E_ARG, "the text has %d tokens, too few for one "
                        "window of %d (+1) tokens" % (total, window))
    sel = range(m)
    if n is not None and n < m:
        sel = np.linspace(0, m - 1, int(n)).round().astype(int).tolist()
    wins = _windows(ids, window, sel)
    m = len(wins)
    k = held_out_count(m, holdout)
    held_idx = set(np.linspace(0, m - 1, k).round().astype(int).tolist()) \
        if k else set()
    g = torch.Generator().manual_seed(seed)
    fit_idx = [i for i in range(m) if i not in held_idx]
    fit_idx = [fit_idx[int(j)] for j in torch.randperm(len(fit_idx),
                                                       generator=g)]

    def batches(idx):
        out = []
        for s in range(0, len(idx), batch_size):
            w = wins[sorted(idx[s:s + batch_size])]
            out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
        return out
    return Calibration(batches(fit_idx), batches(sorted(held_idx)),
                       len(fit_idx))


def next_token_loss(out, y):
    """Mean cross-entropy of logits (or an output with .logits) against
    the next tokens y: the loss_fn for text_batches' batches."""
    logits = out.logits if hasattr(out, "logits") else \
        (out[0] if isinstance(out, (tuple, list)) else out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                           y.reshape(-1))


def lm_loss(model, batches):
    """Mean next-token loss of model over (x, y) batches (no gradients)."""
    dev = next(model.parameters()).device
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            loss = next_token_loss(model(x.to(dev)), y.to(dev))
            tot += float(loss) * y.numel()
            cnt += y.numel()
    return tot / max(cnt, 1)

