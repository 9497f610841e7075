"""include/bico/transport.h: carrying a task vector through the maps.

    bico.transport.weight(tau, r_out, r_in)   # R_out^T tau R_in
    bico.transport.weight_split(tau, [r_q, r_k, r_v], r_in)
    bico.transport.vector(v, r), bico.transport.rows(t, r)
"""
import ctypes

import numpy as np

from . import _args as A
from ._args import rows_f32, ptr as _ptr
from ._ctx import _or_default
from ._lib import fn
from ._status import E_ARG, E_SHAPE, BicoError, check as _check

__all__ = ["weight", "weight_split", "vector", "rows"]


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
    ctx = _or_default(ctx)
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
    ctx = _or_default(ctx)
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
    ctx = _or_default(ctx)
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
    ctx = _or_default(ctx)
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


def _rows_at(n, d_a, d_b, alpha, t, t_off, ld_t, r, out, out_off, ld_out,
             ctx=None):
    """alpha t R into out, on n rows of column blocks of two C-contiguous
    float32 arrays read and written in place: t's block starts at element
    t_off with row stride ld_t, out's at out_off with row stride ld_out; r
    a C-contiguous float32 d_a x d_b map (the fit's fused-block carry,
    bico.torch.fit._carry; no checks beyond the library's)."""
    ctx = _or_default(ctx)
    _check(fn.transport_rows(ctx._alive(), n, d_a, d_b, float(alpha),
                             t.ctypes.data + 4 * t_off, ld_t,
                             r.ctypes.data, d_b, 0.0,
                             out.ctypes.data + 4 * out_off, ld_out), ctx)
