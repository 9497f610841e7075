#!/usr/bin/env python3
"""The Python package's public names and their signatures, one line each:
what 1.x promises (abi/python-1.txt is the frozen listing; `make
python-api-check` compares the package with it, `make python-api-baseline`
rewrites it, as abi-check and abi-baseline do for the C library).

A line is "module.name kind signature": kind is function, class (the
signature its constructor's), method (module.Class.name), or value (a
constant: its repr, for the enumerations and grids).  Public: each
module's __all__ (without one, its own functions and classes whose names
do not start with "_"), for the modules of PUBLIC_MODULES (the ones
docs/python.md documents; sub-modules of a command are not public).

The compatibility rule (compare): every frozen name is still there, of
the same kind; a function or method keeps its parameters in order, with
the same names, kinds and defaults, and may only append parameters that
have a default (or are keyword-only with one); a value keeps its repr.
Additions are allowed and listed (the next release's baseline takes
them).

Usage: python3 scripts/python-api.py            # the listing, on stdout
       python3 scripts/python-api.py --check F  # compared with F; exit 1
                                                # on a break
"""
import importlib
import inspect
import os
import re
import sys

PUBLIC_MODULES = (
    "bico", "bico.convert", "bico.fit", "bico.folder", "bico.lora",
    "bico.merge", "bico.model", "bico.safetensors", "bico.transfer",
    "bico.transport",
    "bico.torch", "bico.torch.choose", "bico.torch.collect",
    "bico.torch.fit", "bico.torch.proxy", "bico.torch.transfer",
    "bico.torch.options", "bico.torch.distill", "bico.torch.teacher",
    "bico.torch.augment",
    "bico.llm", "bico.llm.across", "bico.llm.adapters", "bico.llm.bpe",
    "bico.llm.config", "bico.llm.distill", "bico.llm.families",
    "bico.llm.generate",
    "bico.llm.options", "bico.llm.runtime", "bico.llm.stats",
    "bico.llm.text", "bico.llm.vocab", "bico.llm.stream.route",
)


def public(mod):
    names = getattr(mod, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(mod).items() if not n.startswith("_") and
            (inspect.isfunction(v) or inspect.isclass(v)) and
            getattr(v, "__module__", "") == mod.__name__]


def _sig(obj):
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def entries(modules=PUBLIC_MODULES):
    """{"module.name": (kind, signature or repr)}."""
    out = {}
    for mname in modules:
        mod = importlib.import_module(mname)
        for n in public(mod):
            v = getattr(mod, n)
            key = "%s.%s" % (mname, n)
            if inspect.isclass(v):
                init = getattr(v.__init__, "__module__", None) or ""
                # a constructor inherited from the standard library (an
                # argparse parser, an exception) varies with Python's
                # version: not the package's promise
                out[key] = ("class", _sig(v) if init.startswith("bico")
                            else "(...)")
                for mn, mv in sorted(vars(v).items()):
                    if mn.startswith("_"):
                        continue
                    if isinstance(mv, (staticmethod, classmethod)):
                        mv = mv.__func__
                    if inspect.isfunction(mv):
                        out["%s.%s" % (key, mn)] = ("method", _sig(mv))
            elif callable(v) and not inspect.ismodule(v):
                out[key] = ("function", _sig(v))
            elif inspect.ismodule(v):
                out[key] = ("module", v.__name__)
            elif isinstance(v, str) and os.path.isabs(v):
                out[key] = ("value", "(a path)")   # library_path
            else:
                out[key] = ("value", repr(v))
    return out


def listing(ent):
    return "".join("%s %s %s\n" % (k, kind, s)
                   for k, (kind, s) in sorted(ent.items()))


def parse(text):
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, kind, rest = line.split(" ", 2)
        out[key] = (kind, rest)
    return out


def _params(sig_text):
    """[(name, kind, default text or None)] of a signature's text, through
    inspect on a stub function of that signature (the defaults' reprs as
    text)."""
    import ast
    # a default shown as <class 'x'> or <function f>: a placeholder
    text = re.sub(r"<[^<>]*>", "'<object>'", sig_text.split(" -> ")[0])
    tree = ast.parse("def f%s: pass" % text)
    a = tree.body[0].args
    out = []
    pos = a.posonlyargs + a.args
    dflt = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    for p, d in zip(pos, dflt):
        out.append((p.arg, "positional",
                    None if d is None else ast.unparse(d)))
    if a.vararg is not None:
        out.append((a.vararg.arg, "*args", None))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, "keyword", None if d is None else ast.unparse(d)))
    if a.kwarg is not None:
        out.append((a.kwarg.arg, "**kwargs", None))
    return out


def _compatible(old, new):
    """Why new's signature breaks callers of old's, or None."""
    if old == "(...)" or old == new:
        return None
    try:
        po, pn = _params(old), _params(new)
    except SyntaxError:
        return "signature changed from %s to %s" % (old, new)
    keep = [p for p in pn if p[0] in {q[0] for q in po}]
    if keep != po[:len(keep)] or len(keep) != len(po):
        gone = [p[0] for p in po if p not in pn]
        return "parameters changed (%s): %s -> %s" % (
            ", ".join(gone) or "order", old, new)
    if [p[0] for p in pn[:len(po)]] != [p[0] for p in po]:
        return "a parameter inserted before the frozen ones: %s -> %s" % (
            old, new)
    for p in pn[len(po):]:
        if p[2] is None and p[1] in ("positional", "keyword"):
            return "new parameter %s without a default: %s -> %s" % (
                p[0], old, new)
    return None


def compare(frozen, now):
    """(breaks, additions): lines naming what breaks the frozen API, and
    the names added since."""
    breaks = []
    for key, (kind, s) in sorted(frozen.items()):
        if key not in now:
            breaks.append("%s: removed (a %s)" % (key, kind))
            continue
        k2, s2 = now[key]
        if k2 != kind:
            breaks.append("%s: was a %s, now a %s" % (key, kind, k2))
        elif kind in ("function", "method", "class"):
            why = _compatible(s, s2)
            if why:
                breaks.append("%s: %s" % (key, why))
        elif s != s2:
            breaks.append("%s: value changed from %s to %s" % (key, s, s2))
    added = sorted(k for k in now if k not in frozen)
    return breaks, added


def main(argv):
    ent = entries()
    if len(argv) >= 2 and argv[0] == "--check":
        frozen = parse(open(argv[1]).read())
        breaks, added = compare(frozen, ent)
        for b in breaks:
            print("python-api: " + b)
        if added:
            print("python-api: %d names added since %s (the next release's "
                  "baseline takes them): %s" % (len(added), argv[1],
                                                ", ".join(added)))
        if breaks:
            print("python-api: %d incompatible changes against %s"
                  % (len(breaks), argv[1]))
            return 1
        print("python-api: compatible with %s (%d names)"
              % (argv[1], len(frozen)))
        return 0
    sys.stdout.write("# libbico's Python API, frozen for 1.x "
                     "(scripts/python-api.py; make python-api-baseline)\n")
    sys.stdout.write(listing(ent))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
