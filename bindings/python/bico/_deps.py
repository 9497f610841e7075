"""What to say when the interpreter lacks numpy or torch: one line naming
the interpreter that ran and the one `make install` used (recorded in
bico/_install.py as PYTHON), instead of a traceback.  Imports nothing
beyond the standard library, so that it works where numpy is missing."""
import os
import sys


def installed_python():
    """The interpreter `make install` recorded, or None (a source tree,
    a pip install)."""
    try:
        from ._install import PYTHON
        return PYTHON
    except ImportError:
        return None


def module_prog():
    """"python3 -m bico.X" for the module python3 -m is running."""
    argv = list(getattr(sys, "orig_argv", ()))
    if "-m" in argv[:-1]:
        return "python3 -m " + argv[argv.index("-m") + 1]
    return "python3 -m bico"


def message(err, prog):
    """One line: prog, the interpreter, the missing module, what to do."""
    name = getattr(err, "name", None) or str(err)
    here = sys.executable or "this interpreter"
    inst = installed_python()
    if inst and os.path.realpath(inst) != os.path.realpath(here):
        fix = ("run it with %s, the interpreter `make install` used (or "
               "the bico-llm command), or install numpy and torch for %s"
               % (inst, here))
    else:
        fix = "install numpy and torch for it"
    return "%s: %s cannot import %s, which bico needs; %s" % (
        prog, here, name, fix)


def missing(err, prog):
    """Prints message(err, prog) on stderr and exits with status 1."""
    sys.stderr.write(message(err, prog) + "\n")
    sys.exit(1)
