"""include/bico/gradfix.h: GradFix's mask and update from a bico.Votes
(what Votes.mask and Votes.apply run).  `votes` is a bico.Votes: tau, and
out, have its shape or are flat with as many elements."""
import ctypes

import numpy as np

from . import _args as A
from ._args import ptr as _ptr
from ._enums import choose, GRADFIX_MODES
from ._handle import _serialised
from ._lib import fn, c_size_t
from ._status import check as _check


def _mode(m):
    return choose(GRADFIX_MODES, m, "gradfix mode")


@_serialised
def mask(votes, tau, mode="majority"):
    """(uint8 mask of votes' shape, kept): bico_gradfix_mask."""
    t = votes._flat(tau, "tau")
    mode = _mode(mode)
    m = np.empty(votes.size, dtype=np.uint8)
    kept = c_size_t()
    _check(fn.gradfix_mask(votes._alive(), mode, _ptr(t), _ptr(m),
                           ctypes.byref(kept)), votes.ctx)
    return m.reshape(votes.shape), kept.value


@_serialised
def apply(votes, tau, alpha=1.0, out=None, beta=0.0, mode="majority"):
    """(alpha * mask * tau (+ beta out), kept): bico_gradfix_apply."""
    t = votes._flat(tau, "tau")
    mode = _mode(mode)
    alpha = A.scalar_f32(alpha, "alpha")
    beta = A.scalar_f32(beta, "beta")
    shape = votes.shape
    if isinstance(out, np.ndarray) and out.shape != votes.shape:
        votes._check_shape(out, "out")  # flat is the other shape taken
        shape = out.shape
    o, back = A.out_f32(out, shape, beta=beta, inputs=(t,))
    kept = c_size_t()
    _check(fn.gradfix_apply(votes._alive(), mode, float(alpha),
                            _ptr(t), float(beta), _ptr(o),
                            ctypes.byref(kept)), votes.ctx)
    res = A.finish(o, back)
    return (res.reshape(votes.shape) if out is None else res), kept.value
