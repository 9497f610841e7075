"""`make help` names targets the Makefile has: each target it lists is
one make knows (`make -n` finds a rule for it, whatever its recipe), and
the version it prints is include/bico/version.h's."""
import os
import re
import subprocess

ROOT = os.path.normpath(os.path.join(os.path.dirname(
    os.path.abspath(__file__)), "..", ".."))


def _make(*args):
    return subprocess.run(["make", "--no-print-directory", "-C", ROOT] +
                          list(args), capture_output=True, text=True,
                          timeout=120)


def test_make_help_lists_real_targets():
    r = _make("help")
    assert r.returncode == 0, r.stderr
    h = open(os.path.join(ROOT, "include", "bico", "version.h")).read()
    ver = ".".join(re.search(r"BICO_VERSION_%s (\d+)" % k, h).group(1)
                   for k in ("MAJOR", "MINOR", "PATCH"))
    assert r.stdout.startswith("libbico %s: make" % ver)
    names = []
    for line in r.stdout.splitlines():
        m = re.match(r"  ([a-z][a-z-]*)(?: \(default\))? {2,}", line)
        if m:
            names.append(m.group(1))
        names += re.findall(r"; ([a-z][a-z-]*):", line)
    assert {"all", "check", "install", "help", "clean"} - {"help"} <= \
        set(names)
    for t in names:
        # -n: print, run nothing; "No rule to make target" is status 2
        r = _make("-n", t)
        assert "No rule to make target" not in r.stderr, (t, r.stderr)
