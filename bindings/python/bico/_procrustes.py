"""include/bico/procrustes.h: bico.Procrustes and bico.procrustes."""
import ctypes

import numpy as np

from . import _args as A
from ._args import ptr as _ptr
from ._ctx import Context
from ._enums import choose, PROC_PARAMS, PROC_NULL_NAMES, PROC_METHOD_NAMES
from ._handle import _Handle
from ._lib import fn, c_size_t, c_double, c_void_p
from ._status import check as _check
from ._xcov import XCov


class Procrustes(_Handle):
    """bico_procrustes: C -> R = U V^T.

    Procrustes(center=False, whiten=0.0, whiten_eps=1e-6, rank_tol=1e-5,
    null="keep"|"drop", method="eig"|"svd"|"polar", ctx=None);
    solve(xcov) -> (R float32 [d_a, d_b], rank); solve_matrix(C) -> (R,
    rank); solve_rows(x_a, x_b) -> (R, rank, thin) from the rows (the
    thin solve when they are fewer than both widths); spectrum() ->
    singular values of the last solve.
    """
    _free = staticmethod(fn.procrustes_free)
    _PARAMS = PROC_PARAMS
    _NAMES = {"null": PROC_NULL_NAMES, "method": PROC_METHOD_NAMES}

    def __init__(self, ctx=None, **options):
        self.ctx = Context() if ctx is None else ctx
        h = c_void_p()
        _check(fn.procrustes_create(self.ctx._alive(), ctypes.byref(h)),
               self.ctx)
        self._adopt(h.value, self.ctx)
        for k, v in options.items():
            self.set(k, v)

    def set(self, name, value):
        if name not in self._PARAMS:
            raise TypeError("Procrustes: unknown option %r (known: %s)"
                            % (name, ", ".join(sorted(self._PARAMS))))
        if name in self._NAMES and isinstance(value, str):
            value = choose(self._NAMES[name], value, "Procrustes: " + name)
        value = A.scalar_f64(value, "Procrustes: " + name)
        _check(fn.procrustes_set_param(self._alive(), self._PARAMS[name],
                                       value), self.ctx)

    def get(self, name):
        if name not in self._PARAMS:
            raise TypeError("Procrustes: unknown option %r (known: %s)"
                            % (name, ", ".join(sorted(self._PARAMS))))
        v = c_double()
        _check(fn.procrustes_get_param(self._alive(), self._PARAMS[name],
                                       ctypes.byref(v)), self.ctx)
        return v.value

    def solve(self, xcov):
        """R from an accumulator: (R [d_a, d_b] float32, numerical rank)."""
        if not isinstance(xcov, XCov):
            raise TypeError("Procrustes.solve takes a bico.XCov (use "
                            "solve_matrix for an array), got %s"
                            % type(xcov).__name__)
        da, db = xcov.dims
        r = np.empty((da, db), dtype=np.float32)
        rank = c_size_t()
        _check(fn.procrustes_solve(self._alive(), xcov._alive(), _ptr(r),
                                   max(db, 1), ctypes.byref(rank)), self.ctx)
        return r, rank.value

    def solve_matrix(self, c):
        """R from a cross-covariance given as a 2-D array."""
        c = A.expect_ndim(A.real(c, "C"), 2, "C", "d_a x d_b")
        if not (c.dtype == np.float64 and c.dtype.isnative and c.size
                and c.strides[1] == 8 and c.strides[0] > 0
                and c.strides[0] % 8 == 0 and c.strides[0] // 8 >= c.shape[1]):
            c = np.ascontiguousarray(c, dtype=np.float64)
        da, db = c.shape
        ldc = c.strides[0] // 8 if da > 1 else db
        r = np.empty((da, db), dtype=np.float32)
        rank = c_size_t()
        _check(fn.procrustes_solve_matrix(self._alive(), da, db, _ptr(c),
                                          max(ldc, 1), _ptr(r), max(db, 1),
                                          ctypes.byref(rank)), self.ctx)
        return r, rank.value

    def solve_rows(self, x_a, x_b):
        """R from the rows themselves (bico_procrustes_solve_rows): x_a
        [n, d_a] and x_b [n, d_b] corresponding rows; the thin solve when
        n <= min(d_a, d_b) (and no whitening), else the rows' statistic
        solved.  Returns (R float32 [d_a, d_b], rank, thin)."""
        a, n, da, lda = A.rows_f32(x_a, "x_a")
        b, nb, db, ldb = A.rows_f32(x_b, "x_b")
        if n != nb:
            from ._status import BicoError, E_SHAPE
            raise BicoError(E_SHAPE, "Procrustes.solve_rows: x_a has %d "
                            "rows, x_b %d" % (n, nb))
        r = np.empty((da, db), dtype=np.float32)
        rank, thin = c_size_t(), ctypes.c_int()
        _check(fn.procrustes_solve_rows(self._alive(), n, da, db, _ptr(a),
                                        lda, _ptr(b), ldb, _ptr(r),
                                        max(db, 1), ctypes.byref(rank),
                                        ctypes.byref(thin)), self.ctx)
        return r, rank.value, bool(thin.value)

    def spectrum(self):
        n = c_size_t()
        _check(fn.procrustes_spectrum(self._alive(), None, 0, ctypes.byref(n)),
               self.ctx)
        s = np.empty(n.value, dtype=np.float64)
        _check(fn.procrustes_spectrum(self._ptr, _ptr(s), n.value,
                                      ctypes.byref(n)), self.ctx)
        return s


def procrustes(c, **options):
    """One-shot solve from a matrix or an XCov: (R, rank)."""
    with Procrustes(**options) as p:
        if isinstance(c, XCov):
            return p.solve(c)
        return p.solve_matrix(c)
