"""include/bico/ctx.h: bico.Context and the per-thread default context."""
import ctypes
import threading

from . import _args as A
from ._enums import CTX_THREADS, CTX_FOLDER_WAIT
from ._handle import _Handle
from ._lib import fn, c_double, c_void_p
from ._status import OK, BicoError, check as _check


class Context(_Handle):
    """bico_ctx: the allocator, the BLIS thread count and the last error.

    The C API uses one context, and each handle made with it, from one
    thread at a time; the binding keeps that rule for you: each handle
    method holds its context's lock (see _Handle).  Context(threads=4) sets BICO_CTX_THREADS.  close() frees it
    once the last handle made with it is closed.
    """

    def __init__(self, threads=1):
        self._lock = threading.RLock()
        self._children = 0
        self._closing = False
        h = c_void_p()
        st = fn.ctx_create(ctypes.byref(h))
        if st != OK:
            raise BicoError(st)
        self._ptr = h.value
        if threads != 1:
            try:
                self.threads = threads
            except Exception:
                self.close()
                raise

    @property
    def threads(self):
        v = c_double()
        _check(fn.ctx_get_param(self._alive(), CTX_THREADS, ctypes.byref(v)),
               self)
        return int(v.value)

    @threads.setter
    def threads(self, n):
        n = A.size(n, "threads", lo=-2 ** 63, hi=2 ** 63 - 1)
        _check(fn.ctx_set_param(self._alive(), CTX_THREADS, n), self)

    @property
    def folder_wait(self):
        """BICO_CTX_FOLDER_WAIT: seconds a folder commit made with this
        context waits for another process writing the same output folder
        before it refuses (0, the default: refuse at once; bico.folder)."""
        v = c_double()
        _check(fn.ctx_get_param(self._alive(), CTX_FOLDER_WAIT,
                                ctypes.byref(v)), self)
        return v.value

    @folder_wait.setter
    def folder_wait(self, seconds):
        seconds = A.scalar_f64(seconds, "folder_wait")
        _check(fn.ctx_set_param(self._alive(), CTX_FOLDER_WAIT, seconds), self)

    @property
    def errmsg(self):
        return fn.ctx_errmsg(self._ptr).decode("utf-8", "replace") \
            if self._ptr else ""

    def _alive(self):
        if not self._ptr or self._closing:
            raise ValueError("Context is closed")
        return self._ptr

    def _release(self):
        self._children -= 1
        if self._closing and self._children <= 0:
            self._free_now()

    def _free_now(self):
        p, self._ptr = self._ptr, None
        if p:
            fn.ctx_free(p)

    def close(self):
        self._closing = True
        if self._children <= 0:
            self._free_now()


_local = threading.local()


def default_context():
    """A context private to the calling thread (for the free functions)."""
    c = getattr(_local, "ctx", None)
    if c is None:
        c = _local.ctx = Context()
    return c


def _or_default(ctx):
    """ctx, or the calling thread's default context when it is None."""
    return default_context() if ctx is None else ctx
