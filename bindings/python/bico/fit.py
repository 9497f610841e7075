"""bico.fit (include/bico/fit.h): the per-layer ridge fit of the
sequential functional fit.

    from bico.fit import Fit
    f = Fit(d_in, d_out, bias=True, ridge=1e-2)
    f.add(x_new, x_orig, delta)      # [n, d_in], [n, d_in], [n, d_out]
    dw, db = f.solve(w, b)           # w [d_out, d_in], b [d_out] or None
    f.solve(w, b, want_rank=True); f.rank # the rank only on request
    f.rows

x_new are the layer's inputs on the target with the earlier layers'
updates applied (X'), x_orig its inputs on the original target (X_B), delta
the desired change of its output (D_B).  solve returns the update
[dW, db] minimising ||X~'[W+dW, b+db]^T - (X~_B [W, b]^T + D_B)||^2 +
lambda ||dW||^2 with lambda = ridge * tr(X'^T X') / d_in (docs/fit.md).
Arrays may be NumPy arrays or torch tensors of any float dtype; they are
converted to C-contiguous float32 (a copy only when needed).  Failures of
the library raise bico.BicoError.
"""
import ctypes

import numpy as np

from . import _lib
from ._args import byte_string as _byte_string, plain as _to_numpy
from ._ctx import Context
from ._handle import _Handle
from ._status import BicoError, check as _check
from ._enums import FIT_FLAGS, FIT_PARAMS

__all__ = ["Fit", "run", "FIT_BIAS", "FIT_RIDGE", "FIT_RANK_TOL"]

# include/bico/fit.h (values from the library)
FIT_BIAS = FIT_FLAGS["bias"]
FIT_RIDGE, FIT_RANK_TOL = FIT_PARAMS["ridge"], FIT_PARAMS["rank_tol"]

_S = ctypes.c_int
_P = ctypes.POINTER
_sz, _vp, _d = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_double
_PROTOTYPES = {
    "bico_fit_create": (_S, [_vp, _sz, _sz, ctypes.c_uint, _P(_vp)]),
    "bico_fit_free": (None, [_vp]),
    "bico_fit_set_param": (_S, [_vp, ctypes.c_int, _d]),
    "bico_fit_get_param": (_S, [_vp, ctypes.c_int, _P(_d)]),
    "bico_fit_param_bounds": (_S, [ctypes.c_int, _P(_d), _P(_d),
                                   _P(ctypes.c_uint)]),
    "bico_fit_add": (_S, [_vp, _sz, _vp, _sz, _vp, _sz, _vp, _sz]),
    "bico_fit_merge": (_S, [_vp, _vp]),
    "bico_fit_reset": (_S, [_vp]),
    "bico_fit_info": (_S, [_vp, _P(_sz), _P(_sz), _P(ctypes.c_uint64),
                           _P(ctypes.c_uint)]),
    "bico_fit_solve": (_S, [_vp, _vp, _sz, _vp, _vp, _sz, _vp, _P(_sz)]),
    "bico_fit_run": (_S, [_vp, _vp, _d]),
    # experimental.h (no ABI promise): the statistics as bytes
    "bico_fit_serialized_size": (_S, [_vp, _P(_sz)]),
    "bico_fit_serialize": (_S, [_vp, _vp, _sz, _P(_sz)]),
    "bico_fit_deserialize": (_S, [_vp, ctypes.c_char_p, _sz, _P(_vp)]),
}

# bico_fit_runner's callbacks
_LAYER_FN = ctypes.CFUNCTYPE(_S, _vp, _sz, _P(_sz), _P(_sz), _P(_vp),
                             _P(_sz), _P(_vp))
_ROWS_FN = ctypes.CFUNCTYPE(_S, _vp, _sz, _vp)
_UPDATE_FN = ctypes.CFUNCTYPE(_S, _vp, _sz, _vp, _sz, _vp, _sz)
_BLOCK_BEGIN_FN = ctypes.CFUNCTYPE(_S, _vp, _sz, _sz, _P(_sz))
_BLOCK_END_FN = ctypes.CFUNCTYPE(_S, _vp, _sz)
_GROUP_FN = ctypes.CFUNCTYPE(_S, _vp, _sz, _P(_sz))
_ROWS_GROUP_FN = ctypes.CFUNCTYPE(_S, _vp, _sz, _P(_vp), _sz)
_SOLVE_FN = ctypes.CFUNCTYPE(_S, _vp, _sz, _vp, _vp, _sz, _vp, _P(_sz))

# BICO_FIT_NO_RANK: the rank update() receives when it was not asked for
FIT_NO_RANK = ctypes.c_size_t(-1).value


class _Runner(ctypes.Structure):
    _fields_ = [("size", _sz), ("opaque", _vp), ("layers", _sz),
                ("layer", _LAYER_FN), ("rows", _ROWS_FN),
                ("update", _UPDATE_FN), ("want_rank", ctypes.c_int),
                ("blocks", _sz), ("block_begin", _BLOCK_BEGIN_FN),
                ("block_end", _BLOCK_END_FN), ("group", _GROUP_FN),
                ("rows_group", _ROWS_GROUP_FN), ("solve", _SOLVE_FN)]


# Declared here, not in _lib.PROTOTYPES' literal, but registered there so
# that the binding's inventory of the C API stays complete.
_lib.PROTOTYPES.update(_PROTOTYPES)


class _Fns(object):
    pass


_fn = _Fns()
for _name, (_res, _args) in _PROTOTYPES.items():
    _f = getattr(_lib.lib, _name, None)
    if _f is None:
        _f = _lib._Missing(_name)
    else:
        _f.restype = _res
        _f.argtypes = _args
    setattr(_fn, _name[len("bico_fit_"):], _f)


def _f32(x, name, cols=None):
    """A C-contiguous float32 2-D array of x (copied only if needed), its
    dtype, shape and width checked before any C call."""
    a = _to_numpy(x)
    if not isinstance(a, np.ndarray):
        raise TypeError("%s must be an array, got %s" % (name, type(x)))
    if a.dtype.kind not in "fiu":
        raise TypeError("%s must hold real numbers, got dtype %s"
                        % (name, a.dtype))
    if a.ndim != 2:
        raise ValueError("%s must be 2-D, got shape %s" % (name, a.shape))
    if cols is not None and a.shape[1] != cols:
        raise ValueError("%s has %d columns, expected %d"
                         % (name, a.shape[1], cols))
    return np.ascontiguousarray(a, dtype=np.float32)


def _vec32(x, name, n):
    a = _to_numpy(x)
    if a.dtype.kind not in "fiu":
        raise TypeError("%s must hold real numbers, got dtype %s"
                        % (name, a.dtype))
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError("%s must have shape (%d,), got %s"
                         % (name, n, a.shape))
    return np.ascontiguousarray(a, dtype=np.float32)


class Fit(_Handle):
    """bico_fit: streaming statistics and closed-form solve for one layer.

    Fit(d_in, d_out, bias=True, ridge=1e-2, rank_tol=None, ctx=None).
    add(x_new, x_orig, delta); merge(other); reset(); solve(w, b,
    want_rank=False) -> (dw, db) (float32; db is None without bias); rank (of
    X~'^T X~' at the last solve made with want_rank=True, else None: the rank is
    a pivoted Cholesky as costly as the solve, and the update is the same
    without it); rows; ridge and rank_tol (read/write).
    to_bytes() / Fit.from_bytes(data, ctx=None): the statistics and
    options as bytes (experimental.h, no ABI promise), so that rows added
    in another process merge here: Fit.from_bytes(b) solves as the
    original, bit for bit, and merges as it would.
    """
    _free = staticmethod(_fn.free)

    def __init__(self, d_in, d_out, bias=True, ridge=1e-2, rank_tol=None,
                 ctx=None):
        self.ctx = Context() if ctx is None else ctx
        d_in, d_out = int(d_in), int(d_out)
        if d_in <= 0 or d_out <= 0:
            raise ValueError("Fit: d_in and d_out must be positive, got %d, %d"
                             % (d_in, d_out))
        h = ctypes.c_void_p()
        # The C call takes the weight's shape order, [d_out, d_in].
        _check(_fn.create(self.ctx._alive(), d_out, d_in,
                          FIT_BIAS if bias else 0, ctypes.byref(h)), self.ctx)
        self._adopt(h.value, self.ctx)
        self.d_in, self.d_out, self.bias = d_in, d_out, bool(bias)
        self.rank = None
        if ridge is not None:
            self.ridge = ridge
        if rank_tol is not None:
            self.rank_tol = rank_tol

    def _get(self, param):
        v = ctypes.c_double()
        _check(_fn.get_param(self._alive(), param, ctypes.byref(v)), self.ctx)
        return v.value

    def _set(self, param, value):
        _check(_fn.set_param(self._alive(), param, float(value)), self.ctx)

    @property
    def ridge(self):
        """c in lambda = c tr(X'^T X') / d_in (BICO_FIT_RIDGE)."""
        return self._get(FIT_RIDGE)

    @ridge.setter
    def ridge(self, c):
        self._set(FIT_RIDGE, c)

    @property
    def rank_tol(self):
        return self._get(FIT_RANK_TOL)

    @rank_tol.setter
    def rank_tol(self, t):
        self._set(FIT_RANK_TOL, t)

    @property
    def rows(self):
        """Rows added so far (over merges too)."""
        r = ctypes.c_uint64()
        _check(_fn.info(self._alive(), None, None, ctypes.byref(r), None),
               self.ctx)
        return int(r.value)

    def add(self, x_new, x_orig, delta):
        """Adds corresponding rows: x_new (X') and x_orig (X_B) [n, d_in],
        delta (D_B) [n, d_out]."""
        xn = _f32(x_new, "x_new", self.d_in)
        xo = _f32(x_orig, "x_orig", self.d_in)
        de = _f32(delta, "delta", self.d_out)
        n = xn.shape[0]
        if xo.shape[0] != n or de.shape[0] != n:
            raise ValueError("Fit.add: x_new, x_orig and delta must have the "
                             "same number of rows, got %d, %d, %d"
                             % (n, xo.shape[0], de.shape[0]))
        if n == 0:
            return self
        _check(_fn.add(self._alive(), n, xn.ctypes.data, self.d_in,
                       xo.ctypes.data, self.d_in, de.ctypes.data, self.d_out),
               self.ctx)
        return self

    def merge(self, other):
        """self += other (statistics of a disjoint shard)."""
        if not isinstance(other, Fit):
            raise TypeError("Fit.merge takes a Fit, got %s" % type(other))
        _check(_fn.merge(self._alive(), other._alive()), self.ctx)
        return self

    def reset(self):
        """Empties the statistics; the options stay."""
        _check(_fn.reset(self._alive()), self.ctx)
        self.rank = None
        return self

    def solve(self, w, b=None, want_rank=False):
        """(dw, db): float32 [d_out, d_in] and [d_out] (None without bias)
        for the layer's current weight w [d_out, d_in] and bias b.  want_rank:
        also compute the numerical rank of X~'^T X~' into self.rank (else
        self.rank is None); dw and db do not depend on it."""
        wa = _f32(w, "w", self.d_in)
        if wa.shape[0] != self.d_out:
            raise ValueError("w has %d rows, expected d_out = %d"
                             % (wa.shape[0], self.d_out))
        if self.bias:
            if b is None:
                raise ValueError("Fit.solve: b is required (the fit has a "
                                 "bias)")
            ba = _vec32(b, "b", self.d_out)
        elif b is not None:
            raise ValueError("Fit.solve: b given but the fit has no bias "
                             "(Fit(..., bias=True))")
        dw = np.empty((self.d_out, self.d_in), dtype=np.float32)
        db = np.empty(self.d_out, dtype=np.float32) if self.bias else None
        rk = ctypes.c_size_t()
        self.rank = None
        _check(_fn.solve(self._alive(), wa.ctypes.data, self.d_in,
                         ba.ctypes.data if self.bias else None,
                         dw.ctypes.data, self.d_in,
                         db.ctypes.data if self.bias else None,
                         ctypes.byref(rk) if want_rank else None), self.ctx)
        if want_rank:
            self.rank = int(rk.value)
        return dw, db

    def to_bytes(self):
        """The statistics (G, the right-hand side, K, the row count) and
        the options, bit for bit (bico_fit_serialize)."""
        n = ctypes.c_size_t()
        _check(_fn.serialized_size(self._alive(), ctypes.byref(n)), self.ctx)
        buf = ctypes.create_string_buffer(n.value)
        w = ctypes.c_size_t()
        _check(_fn.serialize(self._ptr, buf, n.value, ctypes.byref(w)),
               self.ctx)
        return buf.raw[:w.value]

    @classmethod
    def from_bytes(cls, data, ctx=None):
        """A new Fit from to_bytes()'s output (bico_fit_deserialize: every
        field checked, BicoError naming what is wrong)."""
        data = _byte_string(data, "Fit.from_bytes")
        ctx = Context() if ctx is None else ctx
        h = ctypes.c_void_p()
        _check(_fn.deserialize(ctx._alive(), data, len(data),
                               ctypes.byref(h)), ctx)
        o = cls.__new__(cls)
        o._adopt(h.value, ctx)
        d_out, d_in = ctypes.c_size_t(), ctypes.c_size_t()
        fl = ctypes.c_uint()
        _check(_fn.info(h.value, ctypes.byref(d_out), ctypes.byref(d_in),
                        None, ctypes.byref(fl)), ctx)
        o.d_in, o.d_out = int(d_in.value), int(d_out.value)
        o.bias, o.rank = bool(fl.value & FIT_BIAS), None
        return o

    @staticmethod
    def param_bounds(param):
        """(lo, hi, flags): params.h's grammar (flags: BICO_PARAM_LO_OPEN
        1, HI_OPEN 2, INTEGER 4)."""
        lo, hi = ctypes.c_double(), ctypes.c_double()
        fl = ctypes.c_uint()
        st = _fn.param_bounds(int(param), ctypes.byref(lo), ctypes.byref(hi),
                              ctypes.byref(fl))
        if st != 0:
            raise BicoError(st)
        return lo.value, hi.value, fl.value


class _Borrowed(Fit):
    """The fit bico_fit_run passes to the rows callback: not owned, valid
    during the callback only."""

    def __init__(self, ptr, ctx, d_in, d_out, bias):
        self._ptr, self.ctx = ptr, ctx
        self.d_in, self.d_out, self.bias, self.rank = d_in, d_out, bias, None

    def close(self):
        self._ptr = None


def run(layers, layer, rows, update, ridge=1e-2, ctx=None, want_rank=False,
        blocks=0, block_begin=None, block_end=None, group=None,
        rows_group=None, solve=None):
    """The sequential driver (bico_fit_run) over a model the caller runs.

    layers: number of linear layers, in forward order (not read when
        blocks > 0).
    layer(l) -> (w, b): layer l's current weight [d_out, d_in] and bias
        [d_out] (None: no bias is fitted);
    rows(l, fit): runs the calibration data through the target with the
        updates of layers < l applied and through the original target, and
        calls fit.add(x_new, x_orig, delta) as often as it likes (it may
        set fit.ridge for this layer); may be None when rows_group is given;
    update(l, dw, db, rank): applies the update (float32 arrays, copies)
        before the next layer's rows are asked for; rank is the numerical
        rank of X~'^T X~' when want_rank=True, else None (it costs as much as
        the solve).
    Optional (fit.h's appended runner fields):
    blocks, block_begin(k, first) -> count, block_end(k): the layers come
        in `blocks` blocks; block_begin says how many layers block k has
        (numbered from first), block_end is called after its last update.
    group(l) -> count: layers l .. l+count-1 read the same input: their
        rows are all asked for before any of their updates.
    rows_group(l, fits): called once per group instead of rows, fits[i]
        layer l+i's fit.
    solve(l, fit, want_rank) -> (dw, db, rank): the caller's own solve in
        place of the library's (rank None when not wanted).
    An exception in a callback stops the run and is raised again here.
    """
    ctx = Context() if ctx is None else ctx
    keep = {}  # arrays handed to C stay alive until update returns
    shapes = {}
    failure = []

    def guard(f):
        def g(*args):
            try:
                return f(*args)
            except BaseException as e:  # re-raised after the C call returns
                failure.append(e)
                return 12  # BICO_E_STATE: stops the run
        return g

    @guard
    def c_layer(_o, l, d_out, d_in, w_out, ld_out, b_out):
        w, b = layer(l)
        wa = _f32(w, "w")
        do, di = wa.shape
        ba = None if b is None else _vec32(b, "b", do)
        keep[l] = (wa, ba)
        shapes[l] = (di, do, ba is not None)
        d_in[0], d_out[0], ld_out[0] = di, do, di
        w_out[0] = wa.ctypes.data
        b_out[0] = ba.ctypes.data if ba is not None else None
        return 0

    def borrowed(l, fptr):
        di, do, bias = shapes[l]
        return _Borrowed(fptr, ctx, di, do, bias)

    @guard
    def c_rows(_o, l, fptr):
        f = borrowed(l, fptr)
        try:
            rows(l, f)
        finally:
            f.close()
        return 0

    @guard
    def c_rows_group(_o, l, fptrs, count):
        fs = [borrowed(l + i, fptrs[i]) for i in range(count)]
        try:
            rows_group(l, fs)
        finally:
            for f in fs:
                f.close()
        return 0

    @guard
    def c_update(_o, l, dw, ld, db, rk):
        di, do, bias = shapes[l]
        w = np.ctypeslib.as_array(ctypes.cast(dw, _P(ctypes.c_float)),
                                  shape=(do, ld))[:, :di].copy()
        b = (np.ctypeslib.as_array(ctypes.cast(db, _P(ctypes.c_float)),
                                   shape=(do,)).copy() if bias else None)
        update(l, w, b, None if rk == FIT_NO_RANK else int(rk))
        keep.pop(l, None)
        return 0

    @guard
    def c_block_begin(_o, k, first, count):
        count[0] = int(block_begin(k, first))
        return 0

    @guard
    def c_block_end(_o, k):
        block_end(k)
        return 0

    @guard
    def c_group(_o, l, count):
        count[0] = int(group(l))
        return 0

    @guard
    def c_solve(_o, l, fptr, dw_out, ld, db_out, rk):
        di, do, bias = shapes[l]
        f = borrowed(l, fptr)
        try:
            dw, db, r = solve(l, f, bool(rk))
        finally:
            f.close()
        out = np.ctypeslib.as_array(ctypes.cast(dw_out, _P(ctypes.c_float)),
                                    shape=(do, ld))
        out[:, :di] = _f32(dw, "dw", di)
        if bias:
            np.ctypeslib.as_array(ctypes.cast(db_out, _P(ctypes.c_float)),
                                  shape=(do,))[:] = _vec32(db, "db", do)
        if rk:
            rk[0] = FIT_NO_RANK if r is None else int(r)
        return 0

    r = _Runner()
    r.size = ctypes.sizeof(_Runner)
    r.layers = int(layers)
    cbs = []  # the ctypes thunks live until the C call returns

    def put(field, fn_type, fn):
        if fn is not None:
            cbs.append(fn_type(fn))
            setattr(r, field, cbs[-1])
    put("layer", _LAYER_FN, c_layer)
    put("rows", _ROWS_FN, c_rows if rows is not None else None)
    put("update", _UPDATE_FN, c_update)
    r.want_rank = 1 if want_rank else 0
    r.blocks = int(blocks)
    put("block_begin", _BLOCK_BEGIN_FN,
        c_block_begin if block_begin is not None else None)
    put("block_end", _BLOCK_END_FN,
        c_block_end if block_end is not None else None)
    put("group", _GROUP_FN, c_group if group is not None else None)
    put("rows_group", _ROWS_GROUP_FN,
        c_rows_group if rows_group is not None else None)
    put("solve", _SOLVE_FN, c_solve if solve is not None else None)
    st = _fn.run(ctx._alive(), ctypes.byref(r), float(ridge))
    if failure:
        raise failure[0]
    _check(st, ctx)
