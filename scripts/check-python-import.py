"""The installed Python binding holds every module of the source tree and
imports from where it was installed (make check-python-install,
check-python-pip):

    python3 check-python-import.py SOURCE_PACKAGE_DIR INSTALL_ROOT

Run from outside the source tree, with the installed copy the only bico on
sys.path.  Every .py of bindings/python/bico and of its sub-packages
(bico.torch, bico.llm) must be in the installed package; where PyTorch is
installed, every module is imported (bico.llm.__main__, which runs the
command, excepted) and must come from INSTALL_ROOT."""
import importlib
import importlib.util
import os
import sys


def source_modules(src):
    """[(module name, path relative to the package)] of the source tree."""
    out = []
    for dp, dns, fns in os.walk(src):
        dns[:] = sorted(d for d in dns if d != "__pycache__")
        rel = os.path.relpath(dp, src)
        pkg = "bico" if rel == "." else "bico." + rel.replace(os.sep, ".")
        for f in sorted(fns):
            if f.endswith(".py") and f != "_install.py":
                name = pkg if f == "__init__.py" else pkg + "." + f[:-3]
                out.append((name, os.path.normpath(os.path.join(rel, f))))
    return out


def main(src, root):
    root = os.path.realpath(root) + os.sep
    spec = importlib.util.find_spec("bico")
    if spec is None or not os.path.realpath(spec.origin).startswith(root):
        sys.exit("check-python-import: bico comes from %s, not from %s"
                 % (spec and spec.origin, root))
    pkg = os.path.dirname(spec.origin)
    mods = source_modules(src)
    missing = [rel for _, rel in mods
               if not os.path.isfile(os.path.join(pkg, rel))]
    if missing:
        sys.exit("check-python-import: the installed package %s lacks %s"
                 % (pkg, ", ".join(missing)))
    try:
        import torch  # noqa: F401
    except ImportError:
        print("check-python-import: %d modules installed in %s (PyTorch "
              "is not installed: bico.torch and bico.llm not imported)"
              % (len(mods), pkg))
        return
    for name, _ in mods:
        if name.endswith(".__main__"):
            continue
        m = importlib.import_module(name)
        if not os.path.realpath(m.__file__).startswith(root):
            sys.exit("check-python-import: %s comes from %s, not from %s"
                     % (name, m.__file__, root))
    print("check-python-import: %d modules imported from %s"
          % (len(mods) - 1, pkg))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
