"""Pythonic handles over the C API: contexts, accumulators, solver, kernels."""
import ctypes
import threading

import numpy as np


from ._lib import fn, c_size_t, c_uint64, c_uint, c_long, c_double, c_void_p

# Status codes (frozen in include/bico/status.h).
OK = 0
E_NULL, E_ARG, E_SHAPE, E_NONFINITE, E_NOMEM, E_NUMERIC = 1, 2, 3, 4, 5, 6
E_FORMAT, E_IO, E_VERSION, E_NOTFOUND, E_UNSUPPORTED = 7, 8, 9, 10, 11
E_STATE, E_INTERNAL = 12, 13

# xcov flags / which
XCOV_SUMS, XCOV_GRAMS = 1, 2
XCOV_CROSS, XCOV_GRAM_A, XCOV_GRAM_B = 1, 2, 3
# procrustes params
PROC_CENTER, PROC_WHITEN, PROC_WHITEN_EPS, PROC_RANK_TOL, PROC_NULL = 1, 2, 3, 4, 5
NULL_KEEP, NULL_DROP = 1, 2
# gradfix
VOTES_MEAN = 1
GRADFIX_MAJORITY, GRADFIX_MEAN = 1, 2
# ctx params
CTX_THREADS = 1


def strerror(status):
    """Static text of a status code (bico_strerror)."""
    return fn.strerror(int(status)).decode("utf-8", "replace")


class BicoError(Exception):
    """A libbico call failed.

    status:   the bico_status code (int);
    strerror: bico_strerror(status);
    message:  bico_ctx_errmsg of the context the call reported to (the
              detail, naming the function and the values), or strerror when
              the call had no context to report to.
    """

    def __init__(self, status, message=None):
        self.status = int(status)
        self.strerror = strerror(status)
        self.message = message or self.strerror
        Exception.__init__(self, self.status, self.message)

    def __str__(self):
        if self.message and self.message != self.strerror:
            return "%s (%s, status %d)" % (self.message, self.strerror,
                                          self.status)
        return "%s (status %d)" % (self.strerror, self.status)


def _check(status, ctx=None):
    if status != OK:
        msg = ""
        if ctx is not None and ctx._ptr:
            raw = fn.ctx_errmsg(ctx._ptr)
            msg = raw.decode("utf-8", "replace") if raw else ""
        raise BicoError(status, msg or None)


def version():
    """The linked library's version string, e.g. "1.0.0"."""
    return fn.version_string().decode()


def version_number():
    return int(fn.version_number())


class _Handle(object):
    """Owns one C handle; close() (or the context manager, or garbage
    collection) frees it exactly once.  A handle made with a context keeps
    it alive: the context is freed only after its last handle (garbage
    collection may finalise a context and its handles in any order)."""
    _free = None
    _ptr = None
    ctx = None

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

    One context, and each handle made with it, is used by one thread at a
    time.  Context(threads=4) sets BICO_CTX_THREADS.  close() frees it
    once the last handle made with it is closed.
    """

    def __init__(self, threads=1):
        self._children = 0
        self._closing = False
        h = c_void_p()
        st = fn.ctx_create(ctypes.byref(h))
        if st != OK:
            raise BicoError(st)
        self._ptr = h.value
        if threads != 1:
            self.threads = threads

    @property
    def threads(self):
        v = ctypes.c_double()
        _check(fn.ctx_get_param(self._alive(), CTX_THREADS, ctypes.byref(v)),
               self)
        return int(v.value)

    @threads.setter
    def threads(self, n):
        _check(fn.ctx_set_param(self._alive(), CTX_THREADS, int(n)), self)

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

def _to_numpy(x):
    """NumPy view of x; torch tensors (any device) come through .numpy()."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, no import
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        return t.numpy()
    return np.asarray(x)


def rows_f32(x, name="x"):
    """(array, n, d, ld) for a 2-D float32 block, without a copy when x is
    float32 with unit column stride and a row stride that is a whole number
    of elements >= d (C-contiguous rows, or a column slice of such); any
    other input is copied to a contiguous float32 array."""
    a = _to_numpy(x)
    if a.ndim != 2:
        raise ValueError("%s must be 2-D (rows x d), got shape %s"
                         % (name, a.shape))
    n, d = a.shape
    if a.dtype == np.float32 and a.strides[1] == 4 and n > 0 and d > 0:
        s0 = a.strides[0]
        if n == 1:
            return a, n, d, d
        if s0 > 0 and s0 % 4 == 0 and s0 // 4 >= d:
            return a, n, d, s0 // 4
    a = np.ascontiguousarray(a, dtype=np.float32)
    return a, n, d, max(d, 1)


def _mat_f32(x, name):
    """A C-contiguous float32 2-D array (copied only if needed)."""
    a = np.ascontiguousarray(_to_numpy(x), dtype=np.float32)
    if a.ndim != 2:
        raise ValueError("%s must be 2-D, got shape %s" % (name, a.shape))
    return a


def _ptr(a):
    return a.ctypes.data if a is not None else None


# ---- cross-covariance ----

class XCov(_Handle):
    """bico_xcov: C = sum over rows of x_a^T x_b (d_a x d_b, float64).

    XCov(d_a, d_b, sums=False, grams=False, ctx=None).  add(x_a, x_b) takes
    corresponding rows (2-D, float32 without a copy, other dtypes and
    layouts converted); merge(other); to_bytes() / XCov.from_bytes(b);
    matrix(which="cross"|"gram_a"|"gram_b", centered=False).
    """
    _free = staticmethod(fn.xcov_free)

    def __init__(self, d_a, d_b, sums=False, grams=False, flags=None,
                 ctx=None):
        self.ctx = Context() if ctx is None else ctx
        if flags is None:
            flags = (XCOV_SUMS if sums else 0) | (XCOV_GRAMS if grams else 0)
        h = c_void_p()
        _check(fn.xcov_create(self.ctx._alive(), int(d_a), int(d_b),
                              int(flags), ctypes.byref(h)), self.ctx)
        self._adopt(h.value, self.ctx)

    @classmethod
    def _wrap(cls, ptr, ctx):
        o = cls.__new__(cls)
        o._adopt(ptr, ctx)
        return o

    def add(self, x_a, x_b):
        """Adds corresponding rows of x_a (n x d_a) and x_b (n x d_b)."""
        a, na, _, lda = rows_f32(x_a, "x_a")
        b, nb, _, ldb = rows_f32(x_b, "x_b")
        if na != nb:
            # The C call takes one n; check here so the message names both.
            raise BicoError(E_SHAPE, "xcov_add: x_a has %d rows, x_b has %d"
                            % (na, nb))
        # The library checks d_a/d_b against the accumulator through ld;
        # pass the widths explicitly by checking them here too.
        da, db = self.dims
        if a.shape[1] != da or b.shape[1] != db:
            raise BicoError(E_SHAPE, "xcov_add: rows are %d and %d wide, the "
                            "accumulator is %d x %d" % (a.shape[1], b.shape[1],
                                                        da, db))
        _check(fn.xcov_add(self._alive(), na, _ptr(a), lda, _ptr(b), ldb),
               self.ctx)
        return self

    def add_matrix(self, c, rows):
        c = np.ascontiguousarray(_to_numpy(c), dtype=np.float64)
        da, db = self.dims
        if c.shape != (da, db):
            raise BicoError(E_SHAPE, "xcov_add_matrix: matrix is %s, the "
                            "accumulator is %d x %d" % (c.shape, da, db))
        _check(fn.xcov_add_matrix(self._alive(), int(rows), _ptr(c), db),
               self.ctx)
        return self

    def merge(self, other):
        """self += other (same dimensions and flags)."""
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
        w = {"cross": XCOV_CROSS, "gram_a": XCOV_GRAM_A,
             "gram_b": XCOV_GRAM_B}.get(which, which)
        da, db = self.dims
        shape = {XCOV_CROSS: (da, db), XCOV_GRAM_A: (da, da),
                 XCOV_GRAM_B: (db, db)}.get(w, (da, db))
        out = np.empty(shape, dtype=np.float64)
        _check(fn.xcov_matrix(self._alive(), int(w), int(bool(centered)),
                              _ptr(out), shape[1]), self.ctx)
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
        ctx = Context() if ctx is None else ctx
        data = bytes(data)
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

_NULL_NAMES = {"keep": NULL_KEEP, "drop": NULL_DROP}


class Procrustes(_Handle):
    """bico_procrustes: C -> R = U V^T.

    Procrustes(center=False, whiten=0.0, whiten_eps=1e-6, rank_tol=1e-5,
    null="keep"|"drop", ctx=None); solve(xcov) -> (R float32 [d_a, d_b],
    rank); solve_matrix(C) -> (R, rank); spectrum() -> singular values of
    the last solve.
    """
    _free = staticmethod(fn.procrustes_free)
    _PARAMS = {"center": PROC_CENTER, "whiten": PROC_WHITEN,
               "whiten_eps": PROC_WHITEN_EPS, "rank_tol": PROC_RANK_TOL,
               "null": PROC_NULL}

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
        if name == "null" and isinstance(value, str):
            if value not in _NULL_NAMES:
                raise ValueError("Procrustes: null must be 'keep' or 'drop', "
                                 "got %r" % value)
            value = _NULL_NAMES[value]
        _check(fn.procrustes_set_param(self._alive(), self._PARAMS[name],
                                       float(value)), self.ctx)

    def get(self, name):
        v = c_double()
        _check(fn.procrustes_get_param(self._alive(), self._PARAMS[name],
                                       ctypes.byref(v)), self.ctx)
        return v.value

    def solve(self, xcov):
        """R from an accumulator: (R [d_a, d_b] float32, numerical rank)."""
        da, db = xcov.dims
        r = np.empty((da, db), dtype=np.float32)
        rank = c_size_t()
        _check(fn.procrustes_solve(self._alive(), xcov._alive(), _ptr(r), db,
                                   ctypes.byref(rank)), self.ctx)
        return r, rank.value

    def solve_matrix(self, c):
        """R from a cross-covariance given as a 2-D array."""
        c = _to_numpy(c)
        if c.ndim != 2:
            raise ValueError("solve_matrix: C must be 2-D, got shape %s"
                             % (c.shape,))
        if not (c.dtype == np.float64 and c.strides[1] == 8
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

def _map_arg(r, name):
    """(array or None, d_a, d_b, ld) for a map; None is the identity."""
    if r is None:
        return None, None, None, 1
    return rows_f32(r, name)


def _out_arg(out, shape, beta, name="out"):
    if out is None:
        if beta != 0:
            raise ValueError("beta != 0 needs an out array to add to")
        return np.zeros(shape, dtype=np.float32), None
    if not isinstance(out, np.ndarray) or out.dtype != np.float32:
        raise TypeError("%s must be a float32 NumPy array" % name)
    if tuple(out.shape) != tuple(shape):
        raise BicoError(E_SHAPE, "%s has shape %s, expected %s"
                        % (name, tuple(out.shape), tuple(shape)))
    if out.flags.c_contiguous:
        return out, None
    tmp = np.ascontiguousarray(out)
    return tmp, out


def weight(tau, r_out=None, r_in=None, alpha=1.0, out=None, beta=0.0,
           d_out_b=None, d_in_b=None, ctx=None):
    """alpha R_out^T tau R_in (+ beta out): tau [dout_a, din_a] -> [dout_b,
    din_b].  A map given as None is the rectangular identity; then the
    target width comes from d_out_b / d_in_b (default: the source's)."""
    ctx = _ctx(ctx)
    t, dout_a, din_a, ldt = rows_f32(tau, "tau")
    ro, ra, rb, ldo = _map_arg(r_out, "r_out")
    ri, ia, ib, ldi = _map_arg(r_in, "r_in")
    dout_b = rb if ro is not None else (d_out_b or dout_a)
    din_b = ib if ri is not None else (d_in_b or din_a)
    o, back = _out_arg(out, (dout_b, din_b), beta)
    if ro is not None and ra != dout_a:
        raise BicoError(E_SHAPE, "transport_weight: r_out has %d rows, tau has "
                        "%d (d_out of the source)" % (ra, dout_a))
    if ri is not None and ia != din_a:
        raise BicoError(E_SHAPE, "transport_weight: r_in has %d rows, tau has "
                        "%d columns (d_in of the source)" % (ia, din_a))
    _check(fn.transport_weight(ctx._alive(), dout_a, din_a, dout_b, din_b,
                               float(alpha), _ptr(t), ldt, _ptr(ro), ldo, _ptr(ri),
                               ldi, float(beta), _ptr(o), din_b), ctx)
    if back is not None:
        back[...] = o
        return back
    return o


def weight_split(tau, r_outs, r_in=None, alpha=1.0, out=None, beta=0.0,
                 k=None, d_out_b=None, d_in_b=None, ctx=None):
    """Fused projection: tau's rows split into k equal blocks, block i
    carried by r_outs[i] (None: identity), all sharing r_in.  r_outs=None
    means k identities (k then required)."""
    ctx = _ctx(ctx)
    t, dout_a, din_a, ldt = rows_f32(tau, "tau")
    if r_outs is None:
        if k is None:
            raise ValueError("weight_split: give r_outs or k")
        arrs = [None] * int(k)
    else:
        arrs = list(r_outs)
        if k is not None and int(k) != len(arrs):
            raise ValueError("weight_split: k=%d but %d maps" % (k, len(arrs)))
        k = len(arrs)
    mats = [None if r is None else _mat_f32(r, "r_outs[%d]" % i)
            for i, r in enumerate(arrs)]
    given = [m for m in mats if m is not None]
    shapes = set(m.shape for m in given)
    if len(shapes) > 1:
        raise BicoError(E_SHAPE, "transport_weight_split: block maps differ in "
                        "shape: %s" % sorted(shapes))
    if given:
        ba, bb = given[0].shape
        if ba * k != dout_a:
            raise BicoError(E_SHAPE, "transport_weight_split: %d blocks of %d "
                            "rows do not make tau's %d rows" % (k, ba, dout_a))
        dout_b = bb * k
        ldr = bb
    else:
        dout_b = d_out_b or dout_a
        ldr = max(dout_b // max(k, 1), 1)
    ri, ia, ib, ldi = _map_arg(r_in, "r_in")
    din_b = ib if ri is not None else (d_in_b or din_a)
    o, back = _out_arg(out, (dout_b, din_b), beta)
    if r_outs is None:
        arr_p = None
    else:
        arr_t = ctypes.c_void_p * k
        arr_p = arr_t(*[_ptr(m) for m in mats])
    _check(fn.transport_weight_split(ctx._alive(), k, dout_a, din_a, dout_b,
                                     din_b, float(alpha), _ptr(t), ldt, arr_p, ldr,
                                     _ptr(ri), ldi, float(beta), _ptr(o),
                                     din_b), ctx)
    if back is not None:
        back[...] = o
        return back
    return o


def vector(v, r=None, alpha=1.0, out=None, beta=0.0, d_b=None, ctx=None):
    """alpha R^T v (+ beta out): v [d_a] -> [d_b]."""
    ctx = _ctx(ctx)
    v = np.ascontiguousarray(_to_numpy(v), dtype=np.float32).reshape(-1)
    rm, ra, rb, ldr = _map_arg(r, "r")
    if rm is not None and ra != v.size:
        raise BicoError(E_SHAPE, "transport_vector: r has %d rows, v has %d "
                        "elements" % (ra, v.size))
    db = rb if rm is not None else (d_b or v.size)
    o, back = _out_arg(out, (db,), beta)
    _check(fn.transport_vector(ctx._alive(), v.size, db, float(alpha), _ptr(v), _ptr(rm),
                               ldr, float(beta), _ptr(o)), ctx)
    if back is not None:
        back[...] = o
        return back
    return o


def rows(t, r=None, alpha=1.0, out=None, beta=0.0, d_b=None, ctx=None):
    """alpha t R (+ beta out) along the last dimension: t [..., d_a] ->
    [..., d_b] (embeddings, tokens)."""
    ctx = _ctx(ctx)
    a = _to_numpy(t)
    lead, d_a = a.shape[:-1], a.shape[-1]
    a2 = np.array(a, dtype=np.float32, order="C", copy=False).reshape(-1, d_a)
    n = a2.shape[0]
    rm, ra, rb, ldr = _map_arg(r, "r")
    if rm is not None and ra != d_a:
        raise BicoError(E_SHAPE, "transport_rows: r has %d rows, t's last "
                        "dimension is %d" % (ra, d_a))
    db = rb if rm is not None else (d_b or d_a)
    o, back = _out_arg(out, lead + (db,), beta)
    _check(fn.transport_rows(ctx._alive(), n, d_a, db, float(alpha), _ptr(a2), d_a,
                             _ptr(rm), ldr, float(beta), _ptr(o), db), ctx)
    if back is not None:
        back[...] = o
        return back
    return o


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
    t = np.array(_to_numpy(tau), dtype=np.float32, order="C", copy=False)
    shape = tuple(int(s) for s in target_shape)
    o, back = _out_arg(out, shape, beta)
    _check(f(ctx._alive(), t.ndim, _shape_arr(t.shape), len(shape),
             _shape_arr(shape), float(alpha), _ptr(t), float(beta), _ptr(o)),
           ctx)
    if back is not None:
        back[...] = o
        return back
    return o


# ---- GradFix ----

_MODES = {"majority": GRADFIX_MAJORITY, "vote": GRADFIX_MAJORITY,
          "mean": GRADFIX_MEAN}


def _mode(m):
    if isinstance(m, str):
        if m not in _MODES:
            raise ValueError("gradfix mode must be 'majority' or 'mean', got %r"
                             % m)
        return _MODES[m]
    return int(m)


class Votes(_Handle):
    """bico_votes: GradFix sign votes for one parameter tensor.

    Votes(shape_or_n, mean=False, ctx=None); add(grad) per sample (v +=
    sign(-g)); add_counts(votes, samples); merge(other); counts();
    mask(tau, mode) -> (uint8 mask, kept); apply(tau, alpha, out, beta,
    mode) -> (update, kept).  Results take the shape given at creation.
    """
    _free = staticmethod(fn.votes_free)

    def __init__(self, shape, mean=False, ctx=None):
        self.ctx = Context() if ctx is None else ctx
        self.shape = (int(shape),) if np.isscalar(shape) else \
            tuple(int(s) for s in shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        h = c_void_p()
        _check(fn.votes_create(self.ctx._alive(), self.size,
                               VOTES_MEAN if mean else 0, ctypes.byref(h)),
               self.ctx)
        self._adopt(h.value, self.ctx)

    def _flat(self, x, dtype, name):
        a = np.ascontiguousarray(_to_numpy(x), dtype=dtype).reshape(-1)
        if a.size != self.size:
            raise BicoError(E_SHAPE, "votes: %s has %d elements, the "
                            "accumulator %d (shape %s)" % (name, a.size,
                                                           self.size,
                                                           self.shape))
        return a

    def add(self, grad):
        g = self._flat(grad, np.float32, "grad")
        _check(fn.votes_add_grad(self._alive(), _ptr(g)), self.ctx)
        return self

    add_grad = add

    def add_counts(self, votes, samples):
        v = self._flat(votes, np.int32, "votes")
        _check(fn.votes_add_counts(self._alive(), _ptr(v), int(samples)),
               self.ctx)
        return self

    def merge(self, other):
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
        t = self._flat(tau, np.float32, "tau")
        m = np.empty(self.size, dtype=np.uint8)
        kept = c_size_t()
        _check(fn.gradfix_mask(self._alive(), _mode(mode), _ptr(t), _ptr(m),
                               ctypes.byref(kept)), self.ctx)
        return m.reshape(self.shape), kept.value

    def apply(self, tau, alpha=1.0, out=None, beta=0.0, mode="majority"):
        t = self._flat(tau, np.float32, "tau")
        if out is None:
            if beta != 0:
                raise ValueError("beta != 0 needs an out array")
            o = np.zeros(self.size, dtype=np.float32)
        else:
            if not (isinstance(out, np.ndarray) and out.dtype == np.float32
                    and out.flags.c_contiguous and out.size == self.size):
                raise TypeError("out must be a C-contiguous float32 array of "
                                "%d elements" % self.size)
            o = out.reshape(-1)
        kept = c_size_t()
        _check(fn.gradfix_apply(self._alive(), _mode(mode), float(alpha),
                                _ptr(t), float(beta), _ptr(o),
                                ctypes.byref(kept)), self.ctx)
        return (o.reshape(self.shape) if out is None else out), kept.value


# ---- depth map ----

class DepthMap(_Handle):
    """bico_depthmap: target block j -> source block i(j)."""
    _free = staticmethod(fn.depthmap_free)

    def __init__(self, l_a, l_b, ctx=None):
        self.ctx = Context() if ctx is None else ctx
        self.l_a, self.l_b = int(l_a), int(l_b)
        h = c_void_p()
        _check(fn.depthmap_create(self.ctx._alive(), self.l_a, self.l_b,
                                  ctypes.byref(h)), self.ctx)
        self._adopt(h.value, self.ctx)

    def source(self, j):
        i = c_size_t()
        _check(fn.depthmap_source(self._alive(), int(j), ctypes.byref(i)),
               self.ctx)
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
