"""bico.llm.text: calibration windows for decoders from token ids or text
(tokenizer.json read natively for byte-level tokenizers, or by Hugging
Face's `tokenizers`), and the next-token loss.

    cal = bt.text_batches("task.txt", window=256, tokenizer="Qwen2-0.5B/")
    new_sd = bt.transfer_model(src, src_ft, tgt, cal.batches, method="fit",
                               loss_fn=bt.next_token_loss)
"""
import json
import os
import re
from collections import namedtuple

import numpy as np
import torch
import torch.nn.functional as F

from .._status import BicoError, E_ARG, E_FORMAT, E_NOTFOUND, E_UNSUPPORTED

__all__ = ["tokenize", "text_batches", "Calibration", "next_token_loss",
           "lm_loss", "path_like"]


def _bytes_to_unicode():
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


def tokenize(text, tokenizer):
    """Token ids (a 1-D int64 tensor) of text.  tokenizer: a callable (text
    -> ids, or an object with .encode(text) giving ids or .ids), or a
    tokenizer.json file / model folder: read with Hugging Face's
    `tokenizers` package when it is installed; without it, the byte-level
    tokenizer whose vocabulary is the 256 bytes and has no merges is read
    natively, and any other is refused (tokenize with your own tokenizer
    and pass the ids)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        path = _tokenizer_file(tokenizer)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None
        if Tokenizer is not None:
            try:
                tk = Tokenizer.from_file(path)
            except Exception as e:  # the package's own error type
                raise BicoError(E_FORMAT, "tokenize: %s is not a tokenizer "
                                "file the tokenizers package reads (%s)"
                                % (path, str(e).splitlines()[0][:200]))
            return torch.tensor(tk.encode(text).ids, dtype=torch.int64)
        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
        except (OSError, ValueError) as e:
            raise BicoError(E_FORMAT, "tokenize: %s is not a JSON tokenizer "
                            "file (%s)" % (path, e))
        bl = _byte_level(spec, path) if isinstance(spec, dict) else None
        if bl is None:
            raise BicoError(E_UNSUPPORTED, "tokenize: %s needs Hugging Face's "
                            "`tokenizers` package (pip install tokenizers), "
                            "or pass token ids (--ids ids.npy in python3 -m "
                            "bico.llm)" % path)
        table, prefix = bl
        if prefix and text and not text.startswith(" "):
            text = " " + text
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return torch.from_numpy(table[raw].copy())
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
            return np.load(p, allow_pickle=False)
        with open(p, "rb") as f:
            raw = f.read()
    except (OSError, ValueError) as e:
        raise BicoError(E_NOTFOUND if isinstance(e, FileNotFoundError)
                        else E_ARG, "text_batches: cannot read %s (%s)"
                        % (p, e))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BicoError(E_ARG, "text_batches: %s is not UTF-8 text (byte "
                        "0x%02x at offset %d); convert it, e.g. iconv -t "
                        "UTF-8" % (p, raw[e.start], e.start))


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
    ids = torch.from_numpy(a.astype(np.int64, copy=False)).reshape(-1)
    if ids.numel() and int(ids.min()) < 0:
        i = int(torch.nonzero(ids < 0)[0])
        raise BicoError(E_ARG, "text_batches: token ids must be >= 0, got "
                        "%d at position %d" % (int(ids[i]), i))
    return ids


Calibration = namedtuple("Calibration", "batches held_out windows")


def text_batches(ids_or_text, window, n=None, holdout=0.125, tokenizer=None,
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
    k-th window, at least one when there are two or more) for the choices
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
    m = (ids.numel() - 1) // window
    if m < 1:
        raise BicoError(E_ARG, "the text has %d tokens, too few for one "
                        "window of %d (+1) tokens" % (ids.numel(), window))
    wins = torch.stack([ids[i * window:(i + 1) * window + 1]
                        for i in range(m)])
    if n is not None and n < m:
        wins = wins[np.linspace(0, m - 1, int(n)).round().astype(int)]
    m = len(wins)
    k = 0 if holdout == 0 or m < 2 else max(1, int(round(m * holdout)))
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

