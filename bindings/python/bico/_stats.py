"""include/bico/stats.h: statistics files from calibration files, and
their sums (bico.model.stats_from_calib, bico.model.stats_merge)."""
import ctypes

from . import _args as A
from ._ctx import Context
from ._lib import fn, c_char_p, c_void_p
from ._status import check as _check


def stats_from_calib(source_calib, target_calib, output, blocks=None,
                     ctx=None):
    """Reduces two calibration files to a statistics file."""
    ctx = Context() if ctx is None else ctx
    args = (A.cstr(source_calib, "source_calib", path=True),
            A.cstr(target_calib, "target_calib", path=True),
            None if blocks is None else A.cstr(blocks, "blocks"),
            A.cstr(output, "output", path=True))
    _check(fn.stats_from_calib(ctx._alive(), *args), ctx)
    return output


def stats_merge(inputs, output, ctx=None):
    """Sums statistics files (same tensors and shapes) into output."""
    enc = [A.cstr(p, "inputs[%d]" % i, path=True)
           for i, p in enumerate(inputs)]
    out = A.cstr(output, "output", path=True)
    ctx = Context() if ctx is None else ctx
    arr = (c_char_p * max(len(enc), 1))(*enc)
    _check(fn.stats_merge(ctx._alive(), ctypes.cast(arr, c_void_p), len(enc),
                          out), ctx)
    return output
