"""include/bico/baseline.h: bico.naive and bico.pad."""
import ctypes

from . import _args as A
from ._args import ptr as _ptr
from ._ctx import _or_default
from ._lib import fn
from ._status import check as _check


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
    ctx = _or_default(ctx)
    t = A.f32(tau, "tau")
    shape = A.sizes(target_shape, "target_shape")
    alpha = A.scalar_f32(alpha, "alpha")
    beta = A.scalar_f32(beta, "beta")
    o, back = A.out_f32(out, shape, beta=beta, inputs=(t,))
    _check(f(ctx._alive(), t.ndim, _shape_arr(t.shape), len(shape),
             _shape_arr(shape), float(alpha), _ptr(t), float(beta), _ptr(o)),
           ctx)
    return A.finish(o, back)
