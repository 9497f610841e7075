"""bico.llm.agree: what every rank of a run must agree on, as strings
compared across ranks (bico.llm.ranks.Ranks.same_run): an option's value
(value_digest: numbers and strings by repr, tensors and arrays by dtype,
shape and a digest of their bytes), a file's or a model folder's
fingerprint (its size, its first 64 KiB, 16 evenly spaced pieces of 256
bytes and its last 4 KiB: fingerprint_file, fingerprint), --text's
(text_fingerprint: read as the run reads it) and --ids' (whole_fingerprint:
every byte); and the first difference between two ranks' lists, in words
(first_difference)."""
import hashlib
import os
import stat

import numpy as np
import torch

__all__ = ["fingerprint", "fingerprint_file", "text_fingerprint",
           "whole_fingerprint", "value_digest", "first_difference"]

HEAD, PIECES, PIECE, TAIL = 64 << 10, 16, 256, 4 << 10


def _open_regular(path):
    """(fd, size) of a regular file opened without blocking (a FIFO is
    never waited on), or (None, what it is instead)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, "missing"
    except IsADirectoryError:
        return None, "a folder"
    except OSError:
        return None, "unreadable"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None, "not a regular file"
    return fd, st.st_size


def _hashed(path, spans):
    """blake2b (hex) of a regular file's size and the bytes of spans(size)
    ([(offset, length)]), each piece with the count read; a path that is
    not a readable regular file: what it is ("missing", ...)."""
    fd, size = _open_regular(path)
    if fd is None:
        return size
    h = hashlib.blake2b(digest_size=16)
    h.update(b"%d;" % size)
    try:
        for at, n in spans(size):
            while n > 0:
                got = os.pread(fd, min(n, 1 << 20), at)
                if not got:
                    break
                h.update(got)
                at, n = at + len(got), n - len(got)
            h.update(b";%d;" % at)
    except OSError:
        return "unreadable"
    finally:
        os.close(fd)
    return h.hexdigest()


def _sampled(size):
    """The spans of fingerprint_file: the first 64 KiB; beyond it 16
    pieces of 256 bytes evenly spaced over the rest and the last 4 KiB."""
    spans = [(0, min(size, HEAD))]
    if size > HEAD:
        spans += [(HEAD + (size - HEAD) // PIECES * k, PIECE)
                  for k in range(PIECES)]
        spans.append((max(0, size - TAIL), TAIL))
    return [(at, max(0, min(n, size - at))) for at, n in spans]


def fingerprint_file(path):
    """A node-independent fingerprint of a regular file (hex; as
    tools/bico-mpi/common.c's fingerprint_file for the MPI command): its
    size, its first 64 KiB (a safetensors header, a config or a small file
    whole), 16 pieces of 256 bytes evenly spaced over the rest and its
    last 4 KiB.  The content is sampled, not read whole: a copy that
    differs in size, in its first 64 KiB or in a sampled byte is caught,
    one that differs only between samples is not; the device, inode,
    times and path are left out, so that copies of the same file on each
    node agree.  Not a readable regular file: "missing", "unreadable",
    "a folder" or "not a regular file"."""
    return _hashed(path, _sampled)


def fingerprint(path):
    """(path, fingerprint) of an input: a regular file's fingerprint_file,
    or for a folder {name: fingerprint_file} of its regular files (links
    followed; names starting with '.' and subfolders left out); else a
    string saying what the path is ("missing", ...).  None: not given."""
    if path is None:
        return None
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return p, "missing"
    except OSError:
        return p, "unreadable"
    if stat.S_ISREG(st.st_mode):
        return p, fingerprint_file(p)
    if not stat.S_ISDIR(st.st_mode):
        return p, "not a regular file or folder"
    try:
        names = sorted(n for n in os.listdir(p) if not n.startswith("."))
    except OSError:
        return p, "an unreadable folder"
    out = {}
    for n in names:
        f = os.path.join(p, n)
        try:
            if not stat.S_ISREG(os.stat(f).st_mode):
                continue
        except OSError:
            continue
        out[n] = fingerprint_file(f)
    return p, out


def text_fingerprint(path, limit):
    """(path, digest) of --text: its size and every byte the run reads of
    it (bico.llm.text.text_spans: the whole file within limit, else the
    pieces read_text reads), so that any difference in the text the run
    uses is caught.  None: not given."""
    if path is None:
        return None
    from .text import text_spans
    p = os.fspath(path)
    return p, _hashed(p, lambda size: text_spans(size, limit))


def whole_fingerprint(path):
    """(path, digest) of a file read whole (--ids: the windows may come
    from anywhere in it).  None: not given."""
    if path is None:
        return None
    p = os.fspath(path)
    return p, _hashed(p, lambda size: [(0, size)])


def value_digest(v):
    """A string that is the same on every rank exactly when an argument's
    value is: numbers, strings and None by repr; tensors and arrays by
    dtype, shape and a digest of their bytes; lists, tuples and dicts
    item by item; a function by its module and name; another object by
    its type and repr (an address in it left out)."""
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return repr(v)
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        return "tensor %s %s %s" % (v.dtype, tuple(v.shape), hashlib.blake2b(
            t.numpy().tobytes(), digest_size=16).hexdigest())
    if isinstance(v, np.ndarray):
        a = np.ascontiguousarray(v)
        return "array %s %s %s" % (a.dtype.str, a.shape, hashlib.blake2b(
            a.tobytes(), digest_size=16).hexdigest())
    if isinstance(v, (list, tuple)):
        inner = [value_digest(x) for x in v]
        d = hashlib.blake2b("\n".join(inner).encode(), digest_size=16)
        if sum(map(len, inner)) > 200:
            return "%s of %d items %s" % (type(v).__name__, len(v),
                                          d.hexdigest())
        return ("[%s]" if isinstance(v, list) else "(%s)") % ", ".join(inner)
    if isinstance(v, dict):
        return value_digest(sorted((repr(k), value_digest(x))
                                   for k, x in v.items()))
    if callable(v) and hasattr(v, "__qualname__"):
        return "%s.%s" % (getattr(v, "__module__", "?"), v.__qualname__)
    r = repr(v)
    return type(v).__name__ if " at 0x" in r else r[:200]


def first_difference(mine, root, r):
    """What differs between rank r's items and rank 0's (None: nothing)."""
    names = [n for n, _ in root]
    if [n for n, _ in mine] != names:
        return "another kind of run than rank 0's (%s against %s)" % (
            ", ".join(n for n, _ in mine)[:200], ", ".join(names)[:200])
    for (name, v), (_, v0) in zip(mine, root):
        if v == v0 or (isinstance(v, tuple) and isinstance(v0, tuple) and
                       v[1] == v0[1]):      # the paths may differ
            continue
        if v is None or v0 is None:
            return "%s is given on %s only" % (name, "rank 0" if v is None
                                                else "rank %d" % r)
        if not isinstance(v, tuple):     # an option's value
            return "%s differs from rank 0's (%s against %s)" % (
                name, _short(v), _short(v0))
        (p, d), (p0, d0) = v, v0
        if isinstance(d, dict) and isinstance(d0, dict):
            for n in sorted(set(d) | set(d0)):
                f, f0 = os.path.join(p, n), os.path.join(p0, n)
                if n not in d0 or n not in d:
                    return "%s differs from rank 0's: %s is on rank %d " \
                        "only" % (name, f0 if n in d0 else f,
                                  0 if n in d0 else r)
                if d[n] != d0[n]:
                    return "%s differs from rank 0's: %s has another size " \
                        "or content%s (sampled: its size, first 64 KiB, 16 " \
                        "pieces of 256 bytes, last 4 KiB)" % (
                            name, f, "" if f == f0 else " than rank 0's %s"
                            % f0)
        for x, at in ((d0, 0), (d, r)):
            if isinstance(x, str) and len(x) != 32:
                return "%s differs from rank 0's: %s is %s on rank %d" % (
                    name, p0 if at == 0 else p, x, at)
        return "%s differs from rank 0's: %s has another size or content%s" \
            % (name, p, "" if p == p0 else " than rank 0's %s" % p0)
    return None


def _short(v, n=120):
    v = str(v)
    return v if len(v) <= n else v[:n] + "..."


