"""bico._blis: the commands that own their process choose BLIS's kernels
and threads before BLIS starts (as tools/bico/blisarch.c does for the C
command).  The rule on planted CPU flags and detections; in child
processes, what BLIS itself reports after the choice (asked through
ctypes directly, not through bico._blis), that a user's variables win,
and that the process is executed again at most once."""
import ctypes
import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

from bico import _blis

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
PKG = os.path.join(ROOT, "bindings", "python")

BLIS = ctypes.util.find_library("blis")


def test_the_best_kernels_for_planted_flags():
    assert _blis.best({"avx512f", "avx512dq", "avx512bw", "avx512vl",
                       "avx2", "fma"}) == "skx"
    # one AVX-512 subset missing: AVX2 kernels
    assert _blis.best({"avx512f", "avx512dq", "avx512vl", "avx2",
                       "fma"}) == "haswell"
    assert _blis.best({"avx2", "fma"}) == "haswell"
    assert _blis.best({"avx2"}) is None and _blis.best(set()) is None


def test_only_generic_or_haswell_on_avx512_give_way():
    assert _blis.upgrade("generic", "skx")
    assert _blis.upgrade("generic", "haswell")
    assert _blis.upgrade("haswell", "skx")
    assert not _blis.upgrade("skx", "skx")
    assert not _blis.upgrade("zen3", "skx")       # a choice BLIS knows
    assert not _blis.upgrade("generic", None)


def test_the_threads_option_is_read_before_the_parser():
    assert _blis.threads_arg(["--threads", "3", "--quiet"]) == 3
    assert _blis.threads_arg(["--x", "--threads=4"]) == 4
    assert _blis.threads_arg(["--threads", "zero"]) is None
    assert _blis.threads_arg(["--threads"]) is None
    assert _blis.threads_arg([]) is None


def test_cpu_flags_of_a_planted_file(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n\n"
                 "processor\t: 1\nflags\t\t: fpu avx2 fma\n")
    assert _blis.cpu_flags(str(p)) == {"fpu", "avx2", "fma"}
    assert _blis.cpu_flags(str(tmp_path / "none")) == set()


# A child that records each start, lets bico._blis choose, then asks BLIS
# (through ctypes, not bico._blis) which kernels it runs.
CHILD = textwrap.dedent("""
    import ctypes, ctypes.util, os, sys
    with open(sys.argv[1], "a") as f:
        f.write("start\\n")
    from bico import _blis
    _blis.own_process(["--threads", sys.argv[2]] if sys.argv[2] != "-"
                      else [])
    lib = ctypes.CDLL(ctypes.util.find_library("blis"))
    lib.bli_init()   # (BLIS aborts on a query before it with BLIS_ARCH_TYPE)
    lib.bli_arch_query_id.restype = ctypes.c_int
    lib.bli_arch_string.restype = ctypes.c_char_p
    lib.bli_arch_string.argtypes = [ctypes.c_int]
    print(lib.bli_arch_string(lib.bli_arch_query_id()).decode())
    print(os.environ.get("BLIS_NUM_THREADS", "-"))
    print(os.environ.get("BLIS_ARCH_TYPE", "-"))
    print(os.environ.get("BICO_BLIS_ARCH_CHOSEN", "-"))
""")


def child(tmp_path, threads, **env):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    starts = tmp_path / "starts"
    if starts.exists():
        starts.unlink()
    e = {k: v for k, v in os.environ.items()
         if k not in ("BLIS_ARCH_TYPE", "BLIS_NUM_THREADS",
                      "OMP_NUM_THREADS", "BICO_BLIS_ARCH",
                      "BICO_BLIS_ARCH_CHOSEN")}
    e["PYTHONPATH"] = PKG
    e.update(env)
    r = subprocess.run([sys.executable, str(script), str(starts),
                        str(threads) if threads else "-"], env=e,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    arch, nthr, forced, why = r.stdout.splitlines()
    return arch, nthr, forced, why, len(starts.read_text().splitlines())


def blis_own_choice():
    """What BLIS detects in a process with none of the variables."""
    code = ("import ctypes, ctypes.util; "
            "lib = ctypes.CDLL(ctypes.util.find_library('blis')); "
            "lib.bli_arch_query_id.restype = ctypes.c_int; "
            "lib.bli_arch_string.restype = ctypes.c_char_p; "
            "lib.bli_arch_string.argtypes = [ctypes.c_int]; "
            "print(lib.bli_arch_string(lib.bli_arch_query_id()).decode())")
    e = {k: v for k, v in os.environ.items() if k != "BLIS_ARCH_TYPE"}
    return subprocess.run([sys.executable, "-c", code], env=e, check=True,
                          capture_output=True, text=True).stdout.strip()


needs_blis = pytest.mark.skipif(BLIS is None, reason="no libblis found")


@needs_blis
def test_the_command_runs_the_kernels_the_cpu_runs(tmp_path):
    own = blis_own_choice()
    want = _blis.best(_blis.cpu_flags())
    arch, nthr, forced, why, starts = child(tmp_path, 3)
    assert nthr == "3"                    # threads set: executed once again
    assert starts == 2
    if _blis.upgrade(own, want):
        assert arch == want and forced != "-", (own, want, arch)
        assert "BLIS detected '%s'" % own in why and want in why
    else:
        assert arch == own and forced == "-", (own, want, arch)


@needs_blis
def test_the_users_variables_win(tmp_path):
    own = blis_own_choice()
    # the user's kernels (BLIS's own, by id) and threads: nothing changed,
    # the process not executed again
    e = {k: v for k, v in os.environ.items() if k != "BLIS_ARCH_TYPE"}
    code = ("import ctypes, ctypes.util; lib = ctypes.CDLL(%r); "
            "lib.bli_init(); lib.bli_arch_query_id.restype = ctypes.c_int; "
            "print(lib.bli_arch_query_id())" % BLIS)
    own_id = subprocess.run([sys.executable, "-c", code], env=e, check=True,
                            capture_output=True, text=True).stdout.strip()
    arch, nthr, forced, why, starts = child(
        tmp_path, 3, BLIS_ARCH_TYPE=own_id, BLIS_NUM_THREADS="1")
    assert (arch, nthr, forced, why, starts) == (own, "1", own_id, "-", 1)
    # OMP_NUM_THREADS counts as the user's threads; auto keeps BLIS's
    # kernels
    arch, nthr, forced, why, starts = child(
        tmp_path, None, OMP_NUM_THREADS="1", BICO_BLIS_ARCH="auto")
    assert (arch, nthr, forced, why, starts) == (own, "-", "-", "-", 1)
    # auto with threads left to the command: executed once, BLIS's kernels
    arch, nthr, forced, why, starts = child(tmp_path, None,
                                            BICO_BLIS_ARCH="auto")
    assert arch == own and forced == "-" and starts == 2
    assert nthr == str(len(os.sched_getaffinity(0)))


@needs_blis
def test_the_llm_command_says_what_it_chose(tmp_path):
    import llm_pair
    e = {k: v for k, v in os.environ.items()
         if k not in ("BLIS_ARCH_TYPE", "BLIS_NUM_THREADS",
                      "OMP_NUM_THREADS", "BICO_BLIS_ARCH",
                      "BICO_BLIS_ARCH_CHOSEN")}
    e["PYTHONPATH"] = PKG
    # a refusal stays one line
    r = subprocess.run(
        [sys.executable, "-m", "bico.llm", "--method", "fit", "--threads",
         "2", "--source", str(tmp_path / "a"), "--source-tuned",
         str(tmp_path / "b"), "--target", str(tmp_path / "c"), "--ids",
         str(tmp_path / "ids.npy"), "--output", str(tmp_path / "out/")],
        env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "no such folder" in r.stderr
    # a run says what it chose first
    pair = tmp_path / "pair"
    pair.mkdir()
    llm_pair.make(str(pair))
    r = subprocess.run(
        [sys.executable, "-m", "bico.llm", "stats", "--source", "A",
         "--target", "B", "--text", "task.txt", "--window", "32",
         "--windows", "4", "--threads", "2", "--output",
         str(tmp_path / "s.safetensors")], cwd=str(pair), env=e,
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    first = r.stderr.splitlines()[0]
    assert first.startswith("BLIS kernels: ") and \
        first.endswith("BLIS_NUM_THREADS=2"), r.stderr
