"""bico._heap: the C heap's free memory given back to the system.

PyTorch's CPU tensors come from malloc.  glibc keeps what a thread frees
in that thread's arena, and a tensor under the dynamic mmap threshold
(up to 32 MiB: most of a decoder's per-layer tensors) is freed into the
heap, not unmapped.  A long run that allocates from several threads
(the intra-op pool) therefore keeps, as resident memory it no longer
uses, about a model's worth of freed blocks: measured on a Qwen2-0.5B
shape in bf16, one forward of the LoRA-hooked target grew the resident
set by 0.9 GB that malloc_trim(0) gave back at once
(docs/performance.md section 9).  trim() is malloc_trim(0) where the C
library has it (glibc) and a no-op elsewhere; the routes that hold
large models call it between phases and after each training step.
"""
import ctypes
import ctypes.util

__all__ = ["trim", "give_back_on_free"]


def _libc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        f = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_size_t]
    f.restype = ctypes.c_int
    return f


_TRIM = _libc_trim()


def trim():
    """Returns the heap's free pages to the system (glibc's malloc_trim(0):
    every arena); True when that was done."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def _libc_mallopt():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        f = libc.mallopt
        libc.malloc_trim    # glibc's (another C library's mallopt differs)
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


_MALLOPT = _libc_mallopt()
M_TRIM_THRESHOLD = -1     # glibc's malloc.h


def give_back_on_free():
    """Makes every free() that leaves free memory at the top of a heap
    give it back (glibc's M_TRIM_THRESHOLD 0, as MALLOC_TRIM_THRESHOLD_=0
    does; it also stops the mmap threshold's growth).  Process-wide: for
    the command's own process, not for a library call in a user's.
    Measured on the Qwen2-0.5B shape: one forward of the LoRA-hooked
    target grew the resident set by 0.9 GB without it, 0.07 GB with it.
    True when set."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(M_TRIM_THRESHOLD, 0))
