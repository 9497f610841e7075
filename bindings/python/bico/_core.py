"""Pythonic handles over the C API: contexts, accumulators, solver, kernels."""
import ctypes
import functools
import threading

import numpy as np


from ._lib import fn, c_size_t, c_uint64, c_uint, c_double, c_void_p

from ._status import OK, E_ARG, E_SHAPE, BicoError, strerror, check as _check
from . import _args as A
from ._args import rows_f32, ptr as _ptr  # noqa: F401
from ._enums import (choose, XCOV_SUMS, XCOV_GRAMS, XCOV_WHICH,
                     XCOV_ADD_MODE, XCOV_ADD_MODES, PROC_PARAMS,
                     PROC_NULL_NAMES, PROC_METHOD_NAMES, VOTES_MEAN,
                     GRADFIX_MODES, CTX_THREADS)

def version():
    """The linked library's version string, e.g. "1.0.0"."""
    return fn.version_string().decode()


def version_number():
    return int(fn.version_number())


def _locks_of(args):
    """The context locks of the handles among args (and in lists of them),
    distinct, in one global order (by id) so that two threads taking the
    same pair cannot deadlock."""
    locks = {}
    for a in args:
        for h in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(h, _Handle):
                c = h if isinstance(h, Context) else h.ctx
                lk = getattr(c, "_lock", None)
                if lk is not None:
                    locks[id(lk)] = lk
    return [locks[k] for k in sorted(locks)]


def _serialised(f):
    """Runs f holding the locks of the handles it is given (self first).
    ctypes releases the GIL during a C call, and a context with its handles
    is used by one thread at a time (the C API's rule): without the lock,
    one XCov fed from 8 Python threads lost updates."""
    @functools.wraps(f)
    def g(*args, **kw):
        locks = _locks_of(list(args) + list(kw.values()))
        for lk in locks:
            lk.acquire()
        try:
            return f(*args, **kw)
        finally:
            for lk in reversed(locks):
                lk.release()
    return g


class _Handle(object):
    """Owns one C handle; close() (or the context manager, or garbage
    collection) frees it exactly once.  A handle made with a context keeps
    it alive: the context is freed only after its last handle (garbage
    collection may finalise a context and its handles in any order).

    Every public method and property of a handle runs holding its
    context's (reentrant) lock, and those of the handles it is passed: the
    handles of one context may be shared between Python threads, their C
    calls then run one at a time."""
    _free = None
    _ptr = None
    ctx = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for name, v in list(cls.__dict__.items()):
            if name.startswith("_") or isinstance(v, (staticmethod, classmethod)):
                continue
            if isinstance(v, property):
                setattr(cls, name, property(
                    v.fget and _serialised(v.fget),
                    v.fset and _serialised(v.fset),
                    v.fdel and _serialised(v.fdel), v.__doc__))
            elif callable(v) and not isinstance(v, type):
                setattr(cls, name, _serialised(v))

    def _adopt(self, ptr, ctx):
        self.ctx = ctx
        ctx._children += 1
        self._ptr = ptr

    def close(self):
        p, self._ptr = self._ptr, None
        if p:
            type(self)._free(p)
            if self.ctx is not None:
                self.ctx._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass

    def _alive(self):
        if not self._ptr:
            raise ValueError("%s is closed" % type(self).__name__)
        return self._ptr


class Context(_Handle):
    """bico_ctx: the allocator, the BLIS thread count and the last error.

    The C API uses one context, and each handle made with it, from one
    thread at a time; the binding keeps that rule for you: each handle
    method holds its context's lock (see _Handle).  Context(threads=4) sets BICO_CTX_THREADS.  close() frees it
    once the last handle made with it is closed.
    """

    def __init__(self, threads=1):
        self._lock = threading.RLock()
        self._children = 0
        self._closing = False
        h = c_void_p()
        st = fn.ctx_create(ctypes.byref(h))
        if st != OK:
            raise BicoError(st)
        self._ptr = h.value
        if threads != 1:
            try:
                self.threads = threads
            except Exception:
                self.close()
                raise

    @property
    def threads(self):
        v = c_double()
        _check(fn.ctx_get_param(self._alive(), CTX_THREADS, ctypes.byref(v)),
               self)
        return int(v.value)

    @threads.setter
    def threads(self, n):
        n = A.size(n, "threads", lo=-2 ** 63, hi=2 ** 63 - 1)
        _check(fn.ctx_set_param(self._alive(), CTX_THREADS, n), self)

    @property
    def errmsg(self):
        return fn.ctx_errmsg(self._ptr).decode("utf-8", "replace") \
            if self._ptr else ""

    def _alive(self):
        if not self._ptr or self._closing:
            raise ValueError("Context is closed")
        return self._ptr

    def _release(self):
        self._children -= 1
        if self._closing and self._children <= 0:
            self._free_now()

    def _free_now(self):
        p, self._ptr = self._ptr, None
        if p:
            fn.ctx_free(p)

    def close(self):
        self._closing = True
        if self._children <= 0:
            self._free_now()


_local = threading.local()


def default_context():
    """A context private to the calling thread (for the free functions)."""
    c = getattr(_local, "ctx", None)
    if c is None:
        c = _local.ctx = Context()
    return c


def _ctx(ctx):
    return default_context() if ctx is None else ctx


# ---- array helpers ----
# Every array argument goes through bico._args before a C call; the names
# below stay for the modules that used them.

_to_numpy = A.plain


# ---- cross-covariance ----

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
        if isinstance(data, str) or not isinstance(
                data, (bytes, bytearray, memoryview)):
            raise TypeError("XCov.from_bytes takes bytes, got %s"
                            % type(data).__name__)
        data = bytes(data)
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


# ---- Procrustes ----

class Procrustes(_Handle):
    """bico_procrustes: C -> R = U V^T.

    Procrustes(center=False, whiten=0.0, whiten_eps=1e-6, rank_tol=1e-5,
    null="keep"|"drop", method="eig"|"svd"|"polar", ctx=None);
    solve(xcov) -> (R float32 [d_a, d_b], rank); solve_matrix(C) -> (R,
    rank); spectrum() -> singular values of the last solve.
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


# ---- transport ----

def _map_arg(r, name, rows, why):
    """(array or None, d_a, d_b, ld) for a map of `rows` rows; None is the
    identity."""
    if r is None:
        return None, None, None, 1
    a, ra, rb, ld = rows_f32(r, name)
    if ra != rows:
        raise BicoError(E_SHAPE, "%s has %d rows, expected %d (%s)"
                        % (name, ra, rows, why))
    return a, ra, rb, ld


def _width(given, from_map, default, name):
    """A target width: the map's when there is one (a d_*_b given beside it
    must agree), else the one given, else the source's."""
    if given is not None:
        given = A.size(given, name, lo=1)
        if from_map is not None and given != from_map:
            raise BicoError(E_SHAPE, "%s = %d, but the map is %d wide"
                            % (name, given, from_map))
    if from_map is not None:
        return from_map
    return given if given is not None else default


def weight(tau, r_out=None, r_in=None, alpha=1.0, out=None, beta=0.0,
           d_out_b=None, d_in_b=None, ctx=None):
    """alpha R_out^T tau R_in (+ beta out): tau [dout_a, din_a] -> [dout_b,
    din_b].  A map given as None is the rectangular identity; then the
    target width comes from d_out_b / d_in_b (default: the source's)."""
    ctx = _ctx(ctx)
    t, dout_a, din_a, ldt = rows_f32(tau, "tau")
    ro, ra, rb, ldo = _map_arg(r_out, "r_out", dout_a, "d_out of tau")
    ri, ia, ib, ldi = _map_arg(r_in, "r_in", din_a, "d_in of tau")
    dout_b = _width(d_out_b, rb, dout_a, "d_out_b")
    din_b = _width(d_in_b, ib, din_a, "d_in_b")
    alpha = A.scalar_f32(alpha, "alpha")
    beta = A.scalar_f32(beta, "beta")
    o, back = A.out_f32(out, (dout_b, din_b), beta=beta, inputs=(t, ro, ri))
    _check(fn.transport_weight(ctx._alive(), dout_a, din_a, dout_b, din_b,
                               float(alpha), _ptr(t), ldt, _ptr(ro), ldo, _ptr(ri),
                               ldi, float(beta), _ptr(o), din_b), ctx)
    return A.finish(o, back)


def weight_split(tau, r_outs, r_in=None, alpha=1.0, out=None, beta=0.0,
                 k=None, d_out_b=None, d_in_b=None, ctx=None):
    """Fused projection: tau's rows split into k equal blocks, block i
    carried by r_outs[i] (None: identity), all sharing r_in.  r_outs=None
    means k identities (k then required)."""
    ctx = _ctx(ctx)
    t, dout_a, din_a, ldt = rows_f32(tau, "tau")
    if r_outs is None:
        if k is None:
            raise BicoError(E_ARG, "weight_split: give r_outs or k")
        k = A.size(k, "k", lo=1)
        arrs = [None] * k
    else:
        arrs = list(r_outs)
        if not arrs:
            raise BicoError(E_SHAPE, "weight_split: r_outs is empty")
        if k is not None and A.size(k, "k", lo=1) != len(arrs):
            raise BicoError(E_SHAPE, "weight_split: k=%d but %d maps"
                            % (k, len(arrs)))
        k = len(arrs)
    if dout_a % k:
        raise BicoError(E_SHAPE, "transport_weight_split: tau's %d rows do "
                        "not split into %d blocks" % (dout_a, k))
    ba = dout_a // k
    mats = [None if r is None else A.f32(r, "r_outs[%d]" % i,
                                         shape=(ba, None),
                                         why="d_out of tau / k")
            for i, r in enumerate(arrs)]
    given = [m for m in mats if m is not None]
    shapes = set(m.shape for m in given)
    if len(shapes) > 1:
        raise BicoError(E_SHAPE, "transport_weight_split: block maps differ in "
                        "shape: %s" % sorted(shapes))
    if given:
        bb = given[0].shape[1]
        dout_b = _width(d_out_b, bb * k, dout_a, "d_out_b")
    else:
        dout_b = _width(d_out_b, None, dout_a, "d_out_b")
        if dout_b % k:
            raise BicoError(E_SHAPE, "transport_weight_split: d_out_b = %d "
                            "does not split into %d blocks" % (dout_b, k))
    ldr = max(dout_b // k, 1)
    ri, ia, ib, ldi = _map_arg(r_in, "r_in", din_a, "d_in of tau")
    din_b = _width(d_in_b, ib, din_a, "d_in_b")
    alpha = A.scalar_f32(alpha, "alpha")
    beta = A.scalar_f32(beta, "beta")
    o, back = A.out_f32(out, (dout_b, din_b), beta=beta,
                        inputs=[t, ri] + given)
    if r_outs is None:
        arr_p = None
    else:
        arr_t = ctypes.c_void_p * k
        arr_p = arr_t(*[_ptr(m) for m in mats])
    _check(fn.transport_weight_split(ctx._alive(), k, dout_a, din_a, dout_b,
                                     din_b, float(alpha), _ptr(t), ldt, arr_p, ldr,
                                     _ptr(ri), ldi, float(beta), _ptr(o),
                                     din_b), ctx)
    return A.finish(o, back)


def vector(v, r=None, alpha=1.0, out=None, beta=0.0, d_b=None, ctx=None):
    """alpha R^T v (+ beta out): v [d_a] -> [d_b]."""
    ctx = _ctx(ctx)
    v = A.f32(v, "v", ndim=1)
    rm, ra, rb, ldr = _map_arg(r, "r", v.size, "the length of v")
    db = _width(d_b, rb, v.size, "d_b")
    alpha = A.scalar_f32(alpha, "alpha")
    beta = A.scalar_f32(beta, "beta")
    o, back = A.out_f32(out, (db,), beta=beta, inputs=(v, rm))
    _check(fn.transport_vector(ctx._alive(), v.size, db, float(alpha), _ptr(v), _ptr(rm),
                               ldr, float(beta), _ptr(o)), ctx)
    return A.finish(o, back)


def rows(t, r=None, alpha=1.0, out=None, beta=0.0, d_b=None, ctx=None):
    """alpha t R (+ beta out) along the last dimension: t [..., d_a] ->
    [..., d_b] (embeddings, tokens)."""
    ctx = _ctx(ctx)
    a = A.real(t, "t")
    if a.ndim < 1:
        raise BicoError(E_SHAPE, "t must have a last dimension, got a scalar")
    lead, d_a = a.shape[:-1], a.shape[-1]
    a2 = np.asarray(a, dtype=np.float32, order="C").reshape(-1, d_a) \
        if d_a else np.zeros((int(np.prod(lead)), 0), np.float32)
    n = a2.shape[0]
    rm, ra, rb, ldr = _map_arg(r, "r", d_a, "t's last dimension")
    db = _width(d_b, rb, d_a, "d_b")
    alpha = A.scalar_f32(alpha, "alpha")
    beta = A.scalar_f32(beta, "beta")
    o, back = A.out_f32(out, lead + (db,), beta=beta, inputs=(a2, rm))
    _check(fn.transport_rows(ctx._alive(), n, d_a, db, float(alpha),
                             _ptr(a2), max(d_a, 1), _ptr(rm), ldr, float(beta),
                             _ptr(o), max(db, 1)), ctx)
    return A.finish(o, back)


# ---- baselines ----

def _shape_arr(shape):
    return (ctypes.c_size_t * max(len(shape), 1))(*shape)


def naive(tau, target_shape, alpha=1.0, out=None, beta=0.0, ctx=None):
    """alpha tau (+ beta out); shapes must match (BICO_E_SHAPE otherwise)."""
    return _baseline(fn.baseline_naive, tau, target_shape, alpha, out, beta,
                     ctx)


def pad(tau, target_shape, alpha=1.0, out=None, beta=0.0, ctx=None):
    """tau zero-padded / truncated to target_shape, times alpha."""
    return _baseline(fn.baseline_pad, tau, target_shape, alpha, out, beta, ctx)


def _baseline(f, tau, target_shape, alpha, out, beta, ctx):
    ctx = _ctx(ctx)
    t = A.f32(tau, "tau")
    shape = A.sizes(target_shape, "target_shape")
    alpha = A.scalar_f32(alpha, "alpha")
    beta = A.scalar_f32(beta, "beta")
    o, back = A.out_f32(out, shape, beta=beta, inputs=(t,))
    _check(f(ctx._alive(), t.ndim, _shape_arr(t.shape), len(shape),
             _shape_arr(shape), float(alpha), _ptr(t), float(beta), _ptr(o)),
           ctx)
    return A.finish(o, back)


# ---- GradFix ----

def _mode(m):
    return choose(GRADFIX_MODES, m, "gradfix mode")


class Votes(_Handle):
    """bico_votes: GradFix sign votes for one parameter tensor.

    Votes(shape_or_n, mean=False, ctx=None); add(grad) per sample (v +=
    sign(-g)); add_counts(votes, samples); merge(other); counts();
    mask(tau, mode) -> (uint8 mask, kept); apply(tau, alpha, out, beta,
    mode) -> (update, kept).  Arrays have the shape given at creation (or
    are flat with as many elements); results take that shape.
    """
    _free = staticmethod(fn.votes_free)

    def __init__(self, shape, mean=False, ctx=None):
        self.shape = A.sizes(shape, "shape") if not np.isscalar(shape) \
            else (A.size(shape, "n"),)
        self.size = int(np.prod(self.shape, dtype=object))
        A.size(self.size, "number of elements")
        self.ctx = Context() if ctx is None else ctx
        h = c_void_p()
        _check(fn.votes_create(self.ctx._alive(), self.size,
                               VOTES_MEAN if mean else 0, ctypes.byref(h)),
               self.ctx)
        self._adopt(h.value, self.ctx)

    def _check_shape(self, a, name):
        if a.shape != self.shape and not (a.ndim == 1
                                          and a.size == self.size):
            raise BicoError(E_SHAPE, "votes: %s has shape %s, the "
                            "accumulator %s (or flat, %d elements)"
                            % (name, A.shape_str(a.shape),
                               A.shape_str(self.shape), self.size))

    def _flat(self, x, name):
        a = A.real(x, name)
        self._check_shape(a, name)
        return np.asarray(a, dtype=np.float32, order="C").reshape(-1)

    def add(self, grad):
        g = self._flat(grad, "grad")
        _check(fn.votes_add_grad(self._alive(), _ptr(g)), self.ctx)
        return self

    add_grad = add

    def add_counts(self, votes, samples):
        """Adds vote counts made elsewhere: each the sum of `samples` signs,
        so |vote| <= samples < 2**32."""
        samples = A.size(samples, "samples", hi=0xFFFFFFFF)
        lim = min(samples, 2 ** 31 - 1)
        a = A.real(votes, "votes")
        self._check_shape(a, "votes")
        v = A.int_array(a, "votes", -lim, lim, np.int32).reshape(-1)
        _check(fn.votes_add_counts(self._alive(), _ptr(v), samples),
               self.ctx)
        return self

    def merge(self, other):
        if not isinstance(other, Votes):
            raise TypeError("merge takes a bico.Votes, got %s"
                            % type(other).__name__)
        _check(fn.votes_merge(self._alive(), other._alive()), self.ctx)
        return self

    def info(self):
        """(n, samples, flags)."""
        n, s, f = c_size_t(), c_uint64(), c_uint()
        _check(fn.votes_info(self._alive(), ctypes.byref(n), ctypes.byref(s),
                             ctypes.byref(f)), self.ctx)
        return n.value, s.value, f.value

    @property
    def samples(self):
        return self.info()[1]

    def counts(self):
        out = np.empty(self.size, dtype=np.int32)
        _check(fn.votes_counts(self._alive(), _ptr(out)), self.ctx)
        return out.reshape(self.shape)

    def mask(self, tau, mode="majority"):
        t = self._flat(tau, "tau")
        mode = _mode(mode)
        m = np.empty(self.size, dtype=np.uint8)
        kept = c_size_t()
        _check(fn.gradfix_mask(self._alive(), mode, _ptr(t), _ptr(m),
                               ctypes.byref(kept)), self.ctx)
        return m.reshape(self.shape), kept.value

    def apply(self, tau, alpha=1.0, out=None, beta=0.0, mode="majority"):
        t = self._flat(tau, "tau")
        mode = _mode(mode)
        alpha = A.scalar_f32(alpha, "alpha")
        beta = A.scalar_f32(beta, "beta")
        shape = self.shape
        if isinstance(out, np.ndarray) and out.shape != self.shape:
            self._check_shape(out, "out")  # flat is the other shape taken
            shape = out.shape
        o, back = A.out_f32(out, shape, beta=beta, inputs=(t,))
        kept = c_size_t()
        _check(fn.gradfix_apply(self._alive(), mode, float(alpha),
                                _ptr(t), float(beta), _ptr(o),
                                ctypes.byref(kept)), self.ctx)
        res = A.finish(o, back)
        return (res.reshape(self.shape) if out is None else res), kept.value


# ---- depth map ----

class DepthMap:
    """bico_depthmap_source: target block j -> source block i(j) (a
    function of the two block counts; nothing is held)."""

    def __init__(self, l_a, l_b, ctx=None):
        self.l_a, self.l_b = A.size(l_a, "l_a"), A.size(l_b, "l_b")
        self.ctx = ctx  # kept for callers that pass one; not needed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def source(self, j):
        j = A.size(j, "j")
        i = c_size_t()
        st = fn.depthmap_source(self.l_a, self.l_b, j, ctypes.byref(i))
        if st != 0:
            raise BicoError(st, "depthmap: target block %d of %d blocks "
                            "(source %d): %s" % (j, self.l_b, self.l_a,
                                                 strerror(st)))
        return i.value

    def __getitem__(self, j):
        return self.source(j)

    def __len__(self):
        return self.l_b

    def tolist(self):
        return [self.source(j) for j in range(self.l_b)]


def depthmap(l_a, l_b):
    """[i(0), ..., i(l_b - 1)]: the source block of each target block."""
    with DepthMap(l_a, l_b) as m:
        return m.tolist()
