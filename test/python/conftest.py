"""pytest hooks of test/python: the tests that reach the C library.

make check SANITIZE=1 runs the Python tests again against the sanitized
library and programs; a test that never reaches C would run the same
PyTorch code a second time for nothing.  So the plain `make check` records
which tests reach C, and the sanitized run runs those:

  BICO_REACH_RECORD=FILE   (plain run) each test that reached C appends
                           its node id to FILE, one a line;
  BICO_REACH_ONLY=FILE     (sanitized run) only the tests FILE lists run;
                           the others are deselected, and their number said.
                           FILE's first line is a digest of the Python
                           sources (the binding's and these tests'): a
                           record of other sources, or none, runs them all.

A test reaches C when, while it runs (setup, call, teardown), the process
calls a function of the binding's table (bico._lib.fn: every call into
libbico goes through it), or it starts a process that does: a program of
the build tree ($BICO_BUILD: bico, bico-mpi, st_tool, json_tool, the
examples) or a Python child that runs bico (its command line names a
bico module or a script that imports bico).  The record is written fresh by
every plain run, so a test that starts reaching C moves with it; the split
is decided by behaviour, not by a list kept by hand.
"""
import os
import subprocess
import sys

import pytest

# the end-to-end helpers every test file may import by name (llm_pair,
# planted, peft_rules, cli, ...): test/e2e on the path, once, here
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "e2e"))

_BUILD = os.path.realpath(os.environ.get("BICO_BUILD") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build"))
_RECORD = os.environ.get("BICO_REACH_RECORD")
_ONLY = os.environ.get("BICO_REACH_ONLY")

_SOURCES = [os.path.join(os.path.dirname(os.path.abspath(__file__))),
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                         "..", "bindings", "python", "bico")]

_calls = [0]          # calls through bico._lib.fn in this process
_children = [0]       # processes started that reach C
_counting = [False]


def _count_library_calls():
    """Counts attribute reads of bico._lib.fn (each is a call into the
    library), once bico._lib is imported (never imported here: a sanitized
    library loads only under its preloaded runtime)."""
    if _counting[0]:
        return
    import sys
    lib = sys.modules.get("bico._lib")
    if lib is None:
        return
    cls = type(lib.fn)
    orig = cls.__getattribute__

    def counted(self, name):
        if not name.startswith("__"):
            _calls[0] += 1
        return orig(self, name)
    cls.__getattribute__ = counted
    _counting[0] = True


def _script_imports_bico(path):
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 20)
    except OSError:
        return False
    return b"import bico" in text or b"from bico" in text


def _reaches_c(args):
    """Whether a command line runs the library: a program of the build
    tree, or a Python child that runs bico."""
    if isinstance(args, (str, bytes, os.PathLike)):
        words = [os.fsdecode(args)]
    else:
        words = [os.fsdecode(a) for a in args]
    text = " ".join(words)
    if _BUILD in text or "/build/" in text:
        return True
    for w in words:
        if w.startswith("bico") or "bico." in w or "-m bico" in w:
            return True
        if w.endswith(".py") and os.path.isfile(w) and \
                _script_imports_bico(w):
            return True
        first = w.split()[0] if w.split() else ""
        if first and os.path.isfile(first):
            real = os.path.realpath(first)
            if real.startswith(_BUILD + os.sep):
                return True
    return False


_popen_init = subprocess.Popen.__init__


def _popen(self, args, *a, **kw):
    try:
        if _reaches_c(args):
            _children[0] += 1
    except Exception:     # never let the bookkeeping fail a test
        _children[0] += 1
    return _popen_init(self, args, *a, **kw)


if _RECORD:
    subprocess.Popen.__init__ = _popen


def _digest():
    """A digest of the Python sources that decide which tests reach C."""
    import hashlib
    h = hashlib.sha256()
    for top in _SOURCES:
        for d, dns, fns in sorted(os.walk(top)):
            dns[:] = sorted(x for x in dns if x != "__pycache__")
            for n in sorted(fns):
                if n.endswith(".py"):
                    p = os.path.join(d, n)
                    h.update(os.path.relpath(p, top).encode() + b"\0")
                    with open(p, "rb") as f:
                        h.update(f.read())
    return "# python sources " + h.hexdigest()


def pytest_configure(config):
    worker = hasattr(config, "workerinput")
    # the controller (not an xdist worker) starts the record
    if _RECORD and not worker:
        with open(_RECORD, "w") as f:
            f.write(_digest() + "\n")
    # and says what the record holds (its workers deselect)
    if _ONLY and not worker:
        try:
            with open(_ONLY) as f:
                lines = [ln.rstrip("\n") for ln in f if ln.strip()]
        except OSError:
            lines = []
        config._bico_reach = (
            "the record lists %d tests that reach the C library; only "
            "those run here" % (len(lines) - 1) if lines and
            lines[0] == _digest() else
            "no record of these Python sources: every test runs")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _RECORD:
        yield
        return
    _count_library_calls()
    before = (_calls[0], _children[0])
    yield
    _count_library_calls()
    if (_calls[0], _children[0]) != before:
        with open(_RECORD, "a") as f:     # O_APPEND: one line, one write
            f.write(item.nodeid + "\n")


def pytest_collection_modifyitems(config, items):
    if not _ONLY:
        return
    try:
        with open(_ONLY) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except OSError:
        lines = []
    if not lines or lines[0] != _digest():
        config._bico_reach = "no record of these sources: every test runs"
        return
    keep = set(lines[1:])
    chosen = [it for it in items if it.nodeid in keep]
    dropped = [it for it in items if it.nodeid not in keep]
    config._bico_reach = "%d tests reach the C library, %d do not (not " \
        "run again here)" % (len(chosen), len(dropped))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = chosen


def pytest_terminal_summary(terminalreporter, config):
    msg = getattr(config, "_bico_reach", None)
    if msg:
        terminalreporter.write_line("reach: " + msg)


def pytest_report_header(config):
    if _ONLY:
        return ("the tests that reached the C library in the plain run "
                "(%s)" % _ONLY)
    if _RECORD:
        return "recording the tests that reach the C library in %s" % _RECORD
    return None
