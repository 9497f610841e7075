"""Running the `bico` command from the end-to-end tests (one runner for
every test file that drives it)."""
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("BICO_BUILD", os.path.join(HERE, "..", "..", "build"))
BICO = os.path.join(BUILD, "bin", "bico")


def bico(*args, ok=True, timeout=None, input=None):
    """Runs `bico ARGS...`; with ok, a non-zero exit fails the test with
    the command and its stderr.  timeout (seconds) bounds the run: hostile
    inputs must be refused fast, and a test of one must end even when the
    refusal is missing (subprocess.TimeoutExpired fails it)."""
    r = subprocess.run([BICO, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, input=input)
    if ok and r.returncode != 0:
        raise AssertionError(f"bico {' '.join(map(str, args))} failed "
                             f"({r.returncode}):\n{r.stderr}")
    return r


def same_bytes(p, q):
    with open(p, "rb") as f, open(q, "rb") as g:
        return f.read() == g.read()
