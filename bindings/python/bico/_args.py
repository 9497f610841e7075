"""Argument checks shared by every wrapper.

Whatever reaches a C call has been checked here first: the dtype (real
numbers only; converted to the dtype the call takes), the shape against
the other arguments, the layout (C-contiguous, or a row stride the call
takes), writability and exact dtype of output arrays, integer arguments
against the range of their C type, scalars against float32, strings
against embedded NUL characters.  A bad argument is therefore an
exception (BicoError with E_SHAPE or E_ARG, TypeError for a wrong type,
ValueError for a read-only output), never a read or write past a buffer.
"""
import ctypes
import math
import operator
import os

import numpy as np

from ._status import BicoError, E_ARG, E_SHAPE

SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
FLT_MAX = float(np.finfo(np.float32).max)
_REAL = "biuf"  # bool, signed and unsigned integers, floats


def plain(x):
    """A NumPy view of x, without checks: torch tensors (any device) through
    .numpy() (bfloat16, which NumPy lacks, as float32: exact), anything else
    through np.asarray."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, no import
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    return np.asarray(x)


def real(x, name):
    """plain(x), refusing what is not an array of real numbers (complex,
    strings, objects, ragged nests)."""
    try:
        a = plain(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError("%s must be an array of numbers: %s" % (name, e))
    if a.dtype.kind not in _REAL:
        raise TypeError("%s must hold real numbers (bool, integer or float), "
                        "got dtype %s" % (name, a.dtype))
    return a


def shape_str(shape):
    return "[%s]" % ", ".join(str(s) for s in shape)


def expect_shape(a, want, name, why=""):
    """want: a tuple of ints or None (any); raises BicoError(E_SHAPE)."""
    ok = a.ndim == len(want) and all(w is None or w == s
                                     for s, w in zip(a.shape, want))
    if not ok:
        raise BicoError(E_SHAPE, "%s has shape %s, expected %s%s"
                        % (name, shape_str(a.shape),
                           shape_str("*" if w is None else w for w in want),
                           (" (%s)" % why) if why else ""))
    return a


def expect_ndim(a, ndim, name, what=""):
    if a.ndim != ndim:
        raise BicoError(E_SHAPE, "%s must be %d-D%s, got shape %s"
                        % (name, ndim, (" (%s)" % what) if what else "",
                           shape_str(a.shape)))
    return a


def f32(x, name, ndim=None, shape=None, why=""):
    """A C-contiguous float32 copy or view of x, of ndim dimensions or of
    the given shape (None entries: any)."""
    a = real(x, name)
    if shape is not None:
        expect_shape(a, shape, name, why)
    elif ndim is not None:
        expect_ndim(a, ndim, name, why)
    return np.asarray(a, dtype=np.float32, order="C")


def f64(x, name, ndim=None, shape=None, why=""):
    a = real(x, name)
    if shape is not None:
        expect_shape(a, shape, name, why)
    elif ndim is not None:
        expect_ndim(a, ndim, name, why)
    return np.asarray(a, dtype=np.float64, order="C")


def rows_f32(x, name="x", width=None):
    """(array, n, d, ld) for a 2-D float32 block of rows, without a copy
    when x is native float32 with unit column stride and a positive row
    stride of a whole number of elements >= d (C-contiguous rows, or a
    column slice of such); anything else is copied to C order."""
    a = real(x, name)
    expect_ndim(a, 2, name, "rows x d")
    n, d = a.shape
    if width is not None and d != width:
        raise BicoError(E_SHAPE, "%s has rows of %d, expected %d"
                        % (name, d, width))
    if a.dtype == np.float32 and a.dtype.isnative and n > 0 and d > 0 \
            and a.strides[1] == 4:
        s0 = a.strides[0]
        if n == 1:
            return a, n, d, d
        if s0 > 0 and s0 % 4 == 0 and s0 // 4 >= d:
            return a, n, d, s0 // 4
    a = np.ascontiguousarray(a, dtype=np.float32)
    return a, n, d, max(d, 1)


def out_f32(out, shape, name="out", beta=0.0, inputs=()):
    """(array the C call writes, array to copy it back into or None).

    out=None: a new zero array (beta must then be 0).  Otherwise out must
    be a writable NumPy float32 array (native byte order) of exactly
    `shape`; when it is not C-contiguous, or overlaps one of `inputs`, the
    call writes a contiguous copy that is copied back afterwards."""
    shape = tuple(int(s) for s in shape)
    if out is None:
        if beta != 0:
            raise BicoError(E_ARG, "beta = %r needs an %s array to add to"
                            % (beta, name))
        return np.zeros(shape, dtype=np.float32), None
    if not isinstance(out, np.ndarray):
        raise TypeError("%s must be a NumPy float32 array, got %s"
                        % (name, type(out).__name__))
    if out.dtype != np.float32 or not out.dtype.isnative:
        raise TypeError("%s must be a native float32 array, got dtype %s"
                        % (name, out.dtype.str))
    if tuple(out.shape) != shape:
        raise BicoError(E_SHAPE, "%s has shape %s, expected %s"
                        % (name, shape_str(out.shape), shape_str(shape)))
    if not out.flags.writeable:
        raise ValueError("%s is read-only (a read-only memmap, a view of "
                         "bytes, or writeable=False)" % name)
    overlaps = any(i is not None and np.may_share_memory(out, i)
                   for i in inputs)
    if out.flags.c_contiguous and not overlaps:
        return out, None
    return np.array(out, dtype=np.float32, order="C"), out


def finish(o, back):
    """The result of a call that wrote o (see out_f32)."""
    if back is None:
        return o
    back[...] = o
    return back


def size(v, name, lo=0, hi=SIZE_MAX):
    """An integer argument in [lo, hi] (a size_t by default).  Floats and
    bools are refused: 2.7 is no dimension, and ctypes would wrap a
    negative or oversized value silently."""
    if isinstance(v, (bool, np.bool_)):
        raise TypeError("%s must be an integer, got %r" % (name, v))
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError("%s must be an integer, got %r" % (name, v))
    if i < lo or i > hi:
        raise BicoError(E_ARG, "%s = %d is out of range [%d, %d]"
                        % (name, i, lo, hi))
    return i


def sizes(shape, name):
    """A tuple of dimensions, each a size_t (an array of them must have an
    integer dtype, even when empty)."""
    if isinstance(shape, np.ndarray) and shape.dtype.kind not in "iu":
        raise TypeError("%s must be integers, got an array of %s"
                        % (name, shape.dtype))
    try:
        items = list(shape)
    except TypeError:
        items = [shape]
    return tuple(size(s, "%s[%d]" % (name, k)) for k, s in enumerate(items))


def scalar_f32(v, name):
    """A finite number that float32 holds (alpha, beta of the kernels)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise TypeError("%s must be a number, got %r" % (name, v))
    if not math.isfinite(f) or abs(f) > FLT_MAX:
        raise BicoError(E_ARG, "%s = %r is not a finite float32" % (name, v))
    return f


def scalar_f64(v, name):
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise TypeError("%s must be a number, got %r" % (name, v))
    if not math.isfinite(f):
        raise BicoError(E_ARG, "%s = %r is not finite" % (name, v))
    return f


def int_array(x, name, lo, hi, dtype):
    """x as a C-contiguous integer array of `dtype`, every value in
    [lo, hi]; floats only when every value is a whole number.  (astype
    would wrap 2**40 + 3 to 3 in int32.)"""
    a = real(x, name)
    if a.dtype.kind == "f":
        if a.size and not (np.all(np.isfinite(a)) and
                           np.all(a == np.floor(a))):
            raise BicoError(E_ARG, "%s must hold whole numbers" % name)
    if a.size:
        mn, mx = a.min(), a.max()
        if mn < lo or mx > hi:
            bad = mn if mn < lo else mx
            raise BicoError(E_ARG, "%s holds %s, out of range [%d, %d]"
                            % (name, bad, lo, hi))
    return np.asarray(a, dtype=dtype, order="C")


def cstr(s, name, path=False):
    """UTF-8 bytes of a str (or of a path when path=True), refusing an
    embedded NUL, which C would read as the end of the string."""
    if path:
        s = os.fspath(s)
    if isinstance(s, bytes):
        b = s
    elif isinstance(s, str):
        b = s.encode("utf-8")
    else:
        raise TypeError("%s must be a string, got %s" % (name,
                                                         type(s).__name__))
    if b"\0" in b:
        raise BicoError(E_ARG, "%s contains a NUL character: %r" % (name, s))
    return b


def byte_string(data, who):
    """data (bytes, bytearray or a memoryview) as bytes; TypeError naming
    who for anything else (a str included: text is not a serialised
    handle)."""
    if isinstance(data, str) or not isinstance(
            data, (bytes, bytearray, memoryview)):
        raise TypeError("%s takes bytes, got %s" % (who,
                                                    type(data).__name__))
    return bytes(data)


def ptr(a):
    return a.ctypes.data if a is not None else None
