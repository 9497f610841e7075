"""The base of every handle class (_Handle) and the context locks its
methods run under.  The binding's one rule for threads: the C API uses a
context, and every handle made with it, from one thread at a time; each
public method of a handle holds its context's reentrant lock (a
Context's `_lock`, bico._ctx) and those of the handles it is given."""
import functools


def _locks_of(args):
    """The context locks of the handles among args (and in lists of them),
    distinct, in one global order (by id) so that two threads taking the
    same pair cannot deadlock."""
    locks = {}
    for a in args:
        for h in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(h, _Handle):
                # a Context has no ctx: it holds the lock itself
                c = h if h.ctx is None else h.ctx
                lk = getattr(c, "_lock", None)
                if lk is not None:
                    locks[id(lk)] = lk
    return [locks[k] for k in sorted(locks)]


def _serialised(f):
    """Runs f holding the locks of the handles it is given (self first).
    ctypes releases the GIL during a C call, and a context with its handles
    is used by one thread at a time (the C API's rule): without the lock,
    one XCov fed from 8 Python threads lost updates."""
    @functools.wraps(f)
    def g(*args, **kw):
        locks = _locks_of(list(args) + list(kw.values()))
        for lk in locks:
            lk.acquire()
        try:
            return f(*args, **kw)
        finally:
            for lk in reversed(locks):
                lk.release()
    return g


class _Handle(object):
    """Owns one C handle; close() (or the context manager, or garbage
    collection) frees it exactly once.  A handle made with a context keeps
    it alive: the context is freed only after its last handle (garbage
    collection may finalise a context and its handles in any order).

    Every public method and property of a handle runs holding its
    context's (reentrant) lock, and those of the handles it is passed: the
    handles of one context may be shared between Python threads, their C
    calls then run one at a time."""
    _free = None
    _ptr = None
    ctx = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for name, v in list(cls.__dict__.items()):
            if name.startswith("_") or isinstance(v, (staticmethod, classmethod)):
                continue
            if isinstance(v, property):
                setattr(cls, name, property(
                    v.fget and _serialised(v.fget),
                    v.fset and _serialised(v.fset),
                    v.fdel and _serialised(v.fdel), v.__doc__))
            elif callable(v) and not isinstance(v, type):
                setattr(cls, name, _serialised(v))

    def _adopt(self, ptr, ctx):
        self.ctx = ctx
        ctx._children += 1
        self._ptr = ptr

    def close(self):
        p, self._ptr = self._ptr, None
        if p:
            type(self)._free(p)
            if self.ctx is not None:
                self.ctx._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass

    def _alive(self):
        if not self._ptr:
            raise ValueError("%s is closed" % type(self).__name__)
        return self._ptr
