"""bico.torch_fit: the former home of the fit's host and the proxy routes,
kept so that old imports work.  The code lives in bico.torch.fit
(fit_model, RidgeFit, GCV_GRID, _Runner, _carry, ...), bico.torch.proxy
(proxy_fit, proxy_distill, PROXY_GRID) and bico.torch.choose (_helps).
Patch a name where the code looks it up (bico.torch.fit.fit_model), not
here."""
from .torch.fit import (  # noqa: F401
    _Stop, _first, _rows, _Runner, _catch_call, _CACHE_ARGS, _replayable,
    _hidden, _with_hidden, _out_map, _maps32, _out_map32, _carry, fit_model,
    _shallow_copy, _materialize, _one_input, GCV_GRID, RidgeFit, _segment_of,
    _stem_linears, _transport_rows_at, BicoError, E_ARG, E_SHAPE, E_STATE)
from .torch.proxy import (  # noqa: F401
    PROXY_GRID, _proxy_logprobs, proxy_fit, proxy_distill)
from .torch.choose import _helps  # noqa: F401
