"""bico-llm, the installed command (scripts/bico-llm.in, make install):
its shebang is the absolute path of the interpreter `make install` used,
it runs the same options as python3 -m bico.llm, make uninstall removes
it; without numpy or torch, it and python3 -m bico.llm print one line
naming the interpreter instead of a traceback (numpy and torch are hidden
by stand-in packages that fail to import, first on PYTHONPATH)."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
PKG = os.path.join(ROOT, "bindings", "python")


def hide(tmp_path, name):
    """A folder whose package `name` raises ModuleNotFoundError."""
    d = tmp_path / ("no_" + name)
    (d / name).mkdir(parents=True, exist_ok=True)
    (d / name / "__init__.py").write_text(
        "raise ModuleNotFoundError(%r, name=%r)\n"
        % ("No module named %r" % name, name))
    return str(d)


def render(tmp_path, python=sys.executable):
    s = open(os.path.join(ROOT, "scripts", "bico-llm.in")).read()
    s = s.replace("@PYTHON@", python).replace("@PYTHONDIR@", PKG)
    p = tmp_path / "bico-llm"
    p.write_text(s)
    p.chmod(0o755)
    return str(p)


def run(cmd, pythonpath=None, cwd="/"):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        ([pythonpath] if pythonpath else []) + [PKG])
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_the_script_runs_the_command(tmp_path):
    script = render(tmp_path)
    assert open(script).readline() == "#!%s\n" % sys.executable
    r = run([script, "--help"])
    assert r.returncode == 0 and "usage: bico-llm" in r.stdout and \
        "--output-lora" in r.stdout, r.stderr
    r = run([script, "stats", "--help"])
    assert r.returncode == 0 and "bico-llm stats" in r.stdout, r.stderr
    # every installed command answers --version, alone (no other option
    # asked for), with the library's version (the C tool's `bico
    # --version` says the same number)
    import bico
    r = run([script, "--version"])
    assert r.returncode == 0 and r.stdout.strip() == \
        "bico-llm (libbico) %s" % bico.__version__, (r.stdout, r.stderr)
    r = run([script, "--batch-size", "0"])
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_missing_dependencies_are_one_line(tmp_path, name):
    hidden = hide(tmp_path, name)
    for cmd, prog in (([render(tmp_path), "--help"], "bico-llm:"),
                      ([sys.executable, "-m", "bico.llm", "--help"],
                       "python3 -m bico.llm:")):
        r = run(cmd, hidden)
        lines = r.stderr.splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert lines[0].startswith(prog) and name in lines[0] and \
            sys.executable in lines[0], lines[0]
        assert "Traceback" not in r.stderr
    # a program importing bico gets an ImportError that says the same
    r = run([sys.executable, "-c", "import bico"], hide(tmp_path, "numpy"))
    assert "ImportError" in r.stderr and "cannot import numpy" in r.stderr


def test_the_installed_python_is_named(tmp_path):
    """Run by another interpreter than the one make install recorded, the
    line names both."""
    import bico._deps as deps
    msg = deps.message(ModuleNotFoundError("x", name="numpy"), "p")
    assert "cannot import numpy" in msg
    old = deps.installed_python
    deps.installed_python = lambda: "/opt/py/bin/python3"
    try:
        msg = deps.message(ModuleNotFoundError("x", name="torch"), "p")
    finally:
        deps.installed_python = old
    assert "/opt/py/bin/python3" in msg and sys.executable in msg


def test_make_install_and_uninstall(tmp_path):
    dest = str(tmp_path / "stage")
    r = subprocess.run(["make", "-C", ROOT, "--no-print-directory",
                        "install-python", "DESTDIR=" + dest,
                        "PREFIX=/opt/bico", "PYTHON=" + sys.executable],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    script = os.path.join(dest, "opt", "bico", "bin", "bico-llm")
    assert os.access(script, os.X_OK)
    head = open(script).read()
    assert head.startswith("#!%s\n" % os.path.realpath(sys.executable)) or \
        head.startswith("#!%s\n" % sys.executable)
    assert "@PYTHON" not in head and "/opt/bico/" in head
    r = subprocess.run(["make", "-C", ROOT, "--no-print-directory",
                        "uninstall-python", "DESTDIR=" + dest,
                        "PREFIX=/opt/bico", "PYTHON=" + sys.executable],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not os.path.exists(script), r.stderr
