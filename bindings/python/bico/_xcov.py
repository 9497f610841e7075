"""include/bico/xcov.h: bico.XCov, the cross-covariance accumulator."""
import ctypes

import numpy as np

from . import _args as A
from ._args import rows_f32, ptr as _ptr
from ._ctx import Context
from ._enums import (choose, XCOV_SUMS, XCOV_GRAMS, XCOV_WHICH,
                     XCOV_ADD_MODE, XCOV_ADD_MODES)
from ._handle import _Handle
from ._lib import fn, c_size_t, c_uint64, c_uint, c_void_p
from ._status import E_SHAPE, BicoError, check as _check


class XCov(_Handle):
    """bico_xcov: C = sum over rows of x_a^T x_b (d_a x d_b, float64).

    XCov(d_a, d_b, sums=False, grams=False, add_mode="exact", ctx=None)
    (add_mode "fast": single-precision block products summed in double,
    BICO_XCOV_ADD_FAST).  add(x_a, x_b) takes
    corresponding rows (2-D, float32 without a copy, other dtypes and
    layouts converted); merge(other); to_bytes() / XCov.from_bytes(b);
    matrix(which="cross"|"gram_a"|"gram_b", centered=False).
    """
    _free = staticmethod(fn.xcov_free)

    def __init__(self, d_a, d_b, sums=False, grams=False, flags=None,
                 ctx=None, add_mode="exact"):
        d_a, d_b = A.size(d_a, "d_a"), A.size(d_b, "d_b")
        if flags is None:
            flags = (XCOV_SUMS if sums else 0) | (XCOV_GRAMS if grams else 0)
        flags = A.size(flags, "flags", hi=0xFFFFFFFF)
        self.ctx = Context() if ctx is None else ctx
        h = c_void_p()
        mode = choose(XCOV_ADD_MODES, add_mode, "XCov: add_mode")
        _check(fn.xcov_create(self.ctx._alive(), d_a, d_b, flags,
                              ctypes.byref(h)), self.ctx)
        self._adopt(h.value, self.ctx)
        _check(fn.xcov_set_param(self._alive(), XCOV_ADD_MODE, mode), self.ctx)

    @classmethod
    def _wrap(cls, ptr, ctx):
        o = cls.__new__(cls)
        o._adopt(ptr, ctx)
        return o

    def add(self, x_a, x_b):
        """Adds corresponding rows of x_a (n x d_a) and x_b (n x d_b)."""
        da, db = self.dims
        a, na, _, lda = rows_f32(x_a, "x_a", da)
        b, nb, _, ldb = rows_f32(x_b, "x_b", db)
        if na != nb:
            # The C call takes one n; check here so the message names both.
            raise BicoError(E_SHAPE, "xcov_add: x_a has %d rows, x_b has %d"
                            % (na, nb))
        _check(fn.xcov_add(self._alive(), na, _ptr(a), lda, _ptr(b), ldb),
               self.ctx)
        return self

    def add_matrix(self, c, rows):
        """Adds a cross-covariance c [d_a, d_b] summed over `rows` rows."""
        da, db = self.dims
        c = A.f64(c, "c", shape=(da, db), why="the accumulator's d_a x d_b")
        rows = A.size(rows, "rows", hi=2 ** 64 - 1)
        _check(fn.xcov_add_matrix(self._alive(), rows, _ptr(c), db),
               self.ctx)
        return self

    def merge(self, other):
        """self += other (same dimensions and flags)."""
        if not isinstance(other, XCov):
            raise TypeError("merge takes a bico.XCov, got %s"
                            % type(other).__name__)
        _check(fn.xcov_merge(self._alive(), other._alive()), self.ctx)
        return self

    def info(self):
        """(d_a, d_b, rows, flags)."""
        da, db, rows, flags = c_size_t(), c_size_t(), c_uint64(), c_uint()
        _check(fn.xcov_info(self._alive(), ctypes.byref(da), ctypes.byref(db),
                            ctypes.byref(rows), ctypes.byref(flags)), self.ctx)
        return da.value, db.value, rows.value, flags.value

    @property
    def dims(self):
        return self.info()[:2]

    @property
    def rows(self):
        return self.info()[2]

    @property
    def flags(self):
        return self.info()[3]

    def matrix(self, which="cross", centered=False):
        """The accumulated matrix as a float64 array."""
        w = choose(XCOV_WHICH, which, "XCov.matrix: which")
        da, db = self.dims
        shape = {XCOV_WHICH["cross"]: (da, db), XCOV_WHICH["gram_a"]: (da, da),
                 XCOV_WHICH["gram_b"]: (db, db)}[w]
        out = np.empty(shape, dtype=np.float64)
        _check(fn.xcov_matrix(self._alive(), w, int(bool(centered)),
                              _ptr(out), max(shape[1], 1)), self.ctx)
        return out

    def sums(self):
        """(sum_a, sum_b): column sums (needs sums=True)."""
        da, db = self.dims
        sa, sb = np.empty(da), np.empty(db)
        _check(fn.xcov_sums(self._alive(), _ptr(sa), _ptr(sb)), self.ctx)
        return sa, sb

    def to_bytes(self):
        n = c_size_t()
        _check(fn.xcov_serialized_size(self._alive(), ctypes.byref(n)),
               self.ctx)
        buf = ctypes.create_string_buffer(n.value)
        w = c_size_t()
        _check(fn.xcov_serialize(self._ptr, buf, n.value, ctypes.byref(w)),
               self.ctx)
        return buf.raw[:w.value]

    save = to_bytes

    @classmethod
    def from_bytes(cls, data, ctx=None):
        data = A.byte_string(data, "XCov.from_bytes")
        ctx = Context() if ctx is None else ctx
        h = c_void_p()
        _check(fn.xcov_deserialize(ctx._alive(), data, len(data),
                                   ctypes.byref(h)), ctx)
        return cls._wrap(h.value, ctx)

    load = from_bytes

    def __repr__(self):
        if not self._ptr:
            return "<bico.XCov closed>"
        da, db, rows, flags = self.info()
        return "<bico.XCov %dx%d rows=%d flags=%d>" % (da, db, rows, flags)
