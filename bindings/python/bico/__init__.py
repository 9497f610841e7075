"""bico: Python binding of libbico (ctypes), and its PyTorch front end:
bico.torch (statistics, transfer_model, the held-out choice, the fit's
host, for any nn.Module) and bico.llm (decoder folders, text windows,
adapters, the command python3 -m bico.llm), packages by concern.

    import bico
    print(bico.library_path)           # which libbico.so was loaded
    xc = bico.XCov(d_a, d_b); xc.add(x_a, x_b)
    R, rank = bico.Procrustes(rank_tol=1e-5).solve(xc)
    tau_b = bico.transport.weight(tau_a, R_out, R_in)

Failures of the library raise bico.BicoError(status, message), message being
bico_ctx_errmsg of the call.  See docs/python.md.

One module per header of include/bico/: _status (status.h), _version,
_ctx, _xcov, _procrustes, _votes, _gradfix, transport, _baseline,
_depthmap, safetensors, model, _stats, transfer, lora, merge, fit, folder (the
private ones hold what this package re-exports: bico.XCov is
bico._xcov.XCov).
"""
try:
    import numpy as _numpy  # noqa: F401 (every wrapper needs it)
except ImportError as _e:
    import sys as _sys
    from . import _deps
    if _sys.argv[:1] == ["-m"]:   # python3 -m bico.X: one line, no trace
        _deps.missing(_e, _deps.module_prog())
    raise ImportError(_deps.message(_e, "bico"), name=_e.name) from _e
from . import _lib
from ._baseline import naive, pad
from ._ctx import Context, default_context
from ._depthmap import DepthMap, depthmap
from ._procrustes import Procrustes, procrustes
from ._status import (BicoError, OK, E_NULL, E_ARG, E_SHAPE, E_NONFINITE,
                      E_NOMEM, E_NUMERIC, E_FORMAT, E_IO, E_VERSION,
                      E_NOTFOUND, E_UNSUPPORTED, E_STATE, E_INTERNAL,
                      strerror)
from ._version import version, version_number
from ._votes import Votes
from ._xcov import XCov
from ._enums import NULL_KEEP, NULL_DROP
from . import transport
from . import safetensors
# bico.fit (ctypes prototypes of its own) is imported on first use (below)
from . import model
from .model import Model
from .transfer import Transfer, transfer_files, transfer_state_dict
from ._names import Pairing, detect_blocks

library_path = _lib.library_path
library_source = _lib.library_source
__version__ = version()

__all__ = ["BicoError", "Context", "XCov", "Procrustes", "Votes", "DepthMap",
           "depthmap", "procrustes", "transport", "naive", "pad",
           "safetensors", "transfer_state_dict", "library_path", "version",
           "strerror", "Pairing", "model", "Model", "Transfer",
           "transfer_files", "default_context", "version_number",
           "detect_blocks", "NULL_KEEP", "NULL_DROP", "OK", "E_NULL", "E_ARG",
           "E_SHAPE", "E_NONFINITE", "E_NOMEM", "E_NUMERIC", "E_FORMAT",
           "E_IO", "E_VERSION", "E_NOTFOUND", "E_UNSUPPORTED", "E_STATE",
           "E_INTERNAL"]


def __getattr__(name):  # PEP 562: bico.fit on first use
    if name == "fit":
        import importlib
        return importlib.import_module(".fit", __name__)
    raise AttributeError("module 'bico' has no attribute %r" % (name,))
