"""include/bico/depthmap.h: bico.DepthMap and bico.depthmap."""
import ctypes

from . import _args as A
from ._lib import fn, c_size_t
from ._status import BicoError, strerror


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
