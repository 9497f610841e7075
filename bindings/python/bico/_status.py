"""Status codes and BicoError.  The codes of include/bico/status.h are read
from the library (bico_status_from_name), not copied."""
import ctypes

from ._lib import fn


def _code(name):
    v = ctypes.c_int()
    if fn.status_from_name(("BICO_" + name).encode(), ctypes.byref(v)) != 0:
        raise ImportError("bico: the library has no status BICO_%s" % name)
    return v.value


OK = _code("OK")
E_NULL, E_ARG, E_SHAPE = _code("E_NULL"), _code("E_ARG"), _code("E_SHAPE")
E_NONFINITE, E_NOMEM = _code("E_NONFINITE"), _code("E_NOMEM")
E_NUMERIC, E_FORMAT, E_IO = _code("E_NUMERIC"), _code("E_FORMAT"), _code("E_IO")
E_VERSION, E_NOTFOUND = _code("E_VERSION"), _code("E_NOTFOUND")
E_UNSUPPORTED, E_STATE = _code("E_UNSUPPORTED"), _code("E_STATE")
E_INTERNAL = _code("E_INTERNAL")


def strerror(status):
    """Static text of a status code (bico_strerror)."""
    return fn.strerror(int(status)).decode("utf-8", "replace")


class BicoError(Exception):
    """A libbico call failed, or the binding refused its arguments before
    calling (then status is E_ARG or E_SHAPE and the message names the
    argument).

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


def check(status, ctx=None):
    """Raises BicoError when status is not OK, with the context's message."""
    if status != OK:
        msg = ""
        if ctx is not None and ctx._ptr:
            raw = fn.ctx_errmsg(ctx._ptr)
            msg = raw.decode("utf-8", "replace") if raw else ""
        raise BicoError(status, msg or None)


def count(f, handle, ctx=None):
    """A handle's count through its bico_X_count (a status and an
    out-pointer), e.g. count(fn.stfile_count, ptr, ctx); BicoError as check
    raises it when the call fails (a NULL handle: E_NULL)."""
    n = ctypes.c_size_t()
    check(f(handle, ctypes.byref(n)), ctx)
    return n.value
