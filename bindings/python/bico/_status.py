"""Status codes and BicoError (the one Python copy of include/bico/status.h,
whose values are frozen: a code is never renumbered or reused)."""
from ._lib import fn

OK = 0
E_NULL, E_ARG, E_SHAPE, E_NONFINITE, E_NOMEM, E_NUMERIC = 1, 2, 3, 4, 5, 6
E_FORMAT, E_IO, E_VERSION, E_NOTFOUND, E_UNSUPPORTED = 7, 8, 9, 10, 11
E_STATE, E_INTERNAL = 12, 13


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
