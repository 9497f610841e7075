"""bico._blis: BLIS's kernels and threads, chosen for a process that one of
the package's commands owns (python3 -m bico.llm), before BLIS starts.

The `bico` C command does the same (tools/bico/blisarch.c): BLIS 0.9
takes plain C kernels ('generic') on CPUs it does not know (AMD family
26) and AVX2 kernels ('haswell') on AVX-512 Xeons, 1.4-4x slower than
what the CPU runs (docs/performance.md).  BLIS reads BLIS_ARCH_TYPE once,
when it starts, so the command sets it and executes itself again.

Threads: BLIS takes its thread count from BLIS_NUM_THREADS (or
OMP_NUM_THREADS) when it starts, not from torch.set_num_threads, so
PyTorch's matrix products through BLIS (Debian's PyTorch links
libblas.so.3, which is BLIS there) ran on one thread whatever --threads
said.  The command sets BLIS_NUM_THREADS to its thread count when the
user set neither variable.

A user's BLIS_ARCH_TYPE, BLIS_NUM_THREADS or OMP_NUM_THREADS always wins;
BICO_BLIS_ARCH=auto keeps BLIS's own kernels.  A library call in a
user's process changes nothing: that process is the user's."""
import ctypes
import ctypes.util
import os
import sys

__all__ = ["own_process", "best", "threads_arg", "say"]

CHOSEN_ENV = "BICO_BLIS_ARCH_CHOSEN"
AVX512 = ("avx512f", "avx512dq", "avx512bw", "avx512vl")


def cpu_flags(path="/proc/cpuinfo"):
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open(path) as f:
            for ln in f:
                if ln.startswith("flags"):
                    return set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def best(flags):
    """The BLIS sub-configuration whose kernels a CPU with these flags runs
    fastest among those an x86-64 BLIS build carries ('skx', 'haswell'),
    or None (the blisarch.c rule)."""
    if all(f in flags for f in AVX512):
        return "skx"
    if "avx2" in flags and "fma" in flags:
        return "haswell"
    return None


def upgrade(detected, want):
    """Whether BLIS's own choice `detected` gives way to `want`: only
    'generic', or 'haswell' on an AVX-512 CPU (a sub-configuration BLIS
    picked for a CPU it knows is kept)."""
    return want is not None and want != detected and (
        detected == "generic" or (detected == "haswell" and want == "skx"))


def _blis():
    """(the id BLIS detects, {name: id} for ids 0..that id) from the BLIS
    libbico links, or None.  Every x86 sub-configuration's id comes before
    'generic''s, and 'skx''s before 'haswell''s, in BLIS 0.9 and 1.x, so
    the names up to the detected id are the ones the rule can want (and
    no id past BLIS's table is ever read)."""
    name = ctypes.util.find_library("blis")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        query, string = lib.bli_arch_query_id, lib.bli_arch_string
    except (OSError, AttributeError):
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    string.restype, string.argtypes = ctypes.c_char_p, [ctypes.c_int]
    det = query()
    names = {}
    for i in range(det + 1):
        s = string(i)
        if s:
            names[s.decode("ascii", "replace")] = i
    return det, names


def threads_arg(argv):
    """The value of --threads N / --threads=N in argv, or None."""
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            v = argv[i + 1]
        elif a.startswith("--threads="):
            v = a.split("=", 1)[1]
        else:
            continue
        try:
            return max(1, int(v))
        except ValueError:
            return None
    return None


def _argv():
    """The command line that started this process (Python 3.10's
    sys.orig_argv; before it, rebuilt from the main module's spec)."""
    if getattr(sys, "orig_argv", None):
        return [sys.executable] + list(sys.orig_argv[1:])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return [sys.executable, "-m", spec.name] + sys.argv[1:]
    return [sys.executable] + sys.argv


def _reexec(env):
    """Executes this process again with env (POSIX only: elsewhere exec
    starts another process and ends this one); returns only if it could
    not."""
    if os.name != "posix" or not sys.executable:
        return
    try:
        os.execve(sys.executable, _argv(), env)
    except OSError:
        return


def own_process(argv):
    """Called first by a command that owns its process, with its arguments
    (argv, without the program): sets BLIS_NUM_THREADS (the command's
    --threads, else the CPUs this process may run on) and BLIS_ARCH_TYPE
    (the rule above) where the user set none of them, and executes the
    process again with them so that every BLIS in it starts with them.
    Returns in the executed process, or where nothing was to change (or
    exec failed: then unchanged); say() prints what was chosen."""
    env = os.environ
    if env.get(CHOSEN_ENV):
        return                              # this is the executed process
    new = {}
    if "BLIS_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in env:
        n = threads_arg(argv) or (len(os.sched_getaffinity(0))
                                  if hasattr(os, "sched_getaffinity") else
                                  os.cpu_count() or 1)
        new["BLIS_NUM_THREADS"] = str(n)
    why = "BLIS kernels: BLIS's own choice"
    if "BLIS_ARCH_TYPE" not in env and env.get("BICO_BLIS_ARCH") != "auto":
        found = _blis()
        want = best(cpu_flags())
        if found is not None:
            det, names = found
            dname = next((n for n, i in names.items() if i == det), str(det))
            if upgrade(dname, want) and want in names:
                new["BLIS_ARCH_TYPE"] = str(names[want])
                why = ("BLIS kernels: '%s' (chosen by bico: BLIS detected "
                       "'%s' on a CPU that runs '%s'; BICO_BLIS_ARCH=auto "
                       "keeps BLIS's choice)" % (want, dname, want))
    if not new:
        return
    if "BLIS_NUM_THREADS" in new:
        why += "; BLIS_NUM_THREADS=%s" % new["BLIS_NUM_THREADS"]
    _reexec(dict(env, **new, **{CHOSEN_ENV: why}))


def say(log):
    """log(line) with what own_process chose, in the process it executed
    (nothing elsewhere): a command's first progress line."""
    why = os.environ.get(CHOSEN_ENV)
    if why:
        log(why)
