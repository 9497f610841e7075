"""include/bico/votes.h: bico.Votes, GradFix's sign votes (its mask and
apply, gradfix.h, are in bico._gradfix)."""
import ctypes

import numpy as np

from . import _args as A
from ._args import ptr as _ptr
from ._ctx import Context
from ._enums import VOTES_MEAN
from ._gradfix import apply as _gradfix_apply, mask as _gradfix_mask
from ._handle import _Handle
from ._lib import fn, c_size_t, c_uint64, c_uint, c_void_p
from ._status import E_SHAPE, BicoError, check as _check


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
        """(uint8 mask, kept): where tau's sign agrees with the vote
        (bico_gradfix_mask)."""
        return _gradfix_mask(self, tau, mode)

    def apply(self, tau, alpha=1.0, out=None, beta=0.0, mode="majority"):
        """(alpha * mask * tau (+ beta out), kept) (bico_gradfix_apply)."""
        return _gradfix_apply(self, tau, alpha, out, beta, mode)
