"""The binding's layout: one module per header of include/bico/, each
calling only its own header's functions, and modules that import each
other without a cycle (function-level imports included: a lazy import
that closes a cycle is still one)."""
import ast
import glob
import importlib
import os
import re
import shutil

import pytest

bico = pytest.importorskip("bico")

PKG = os.path.dirname(bico.__file__)
INCLUDE = os.path.join(os.path.dirname(__file__), "..", "..", "include",
                       "bico")

# header -> the module that wraps it
HEADER_MODULE = {
    "status.h": "_status", "version.h": "_version", "ctx.h": "_ctx",
    "xcov.h": "_xcov", "procrustes.h": "_procrustes", "votes.h": "_votes",
    "gradfix.h": "_gradfix", "transport.h": "transport",
    "baseline.h": "_baseline", "depthmap.h": "_depthmap",
    "safetensors.h": "safetensors", "model.h": "model", "stats.h": "_stats",
    "transfer.h": "transfer", "lora.h": "lora", "merge.h": "merge",
    "fit.h": "fit", "folder.h": "folder",
    # the dtype codes are safetensors' (bico.safetensors.dtype_name, F32...)
    "dtype.h": "safetensors",
}
# headers without a module of their own, and why
NO_MODULE = {
    "bico.h": "the umbrella header: the package itself",
    "params.h": "flag names only: read into bico._enums",
    "experimental.h": "not part of the stable API, not wrapped",
}
# what any wrapper may call: the context's message, for its errors
SHARED = {"ctx_errmsg"}


def header_functions():
    """{header: {function name without "bico_"}} of the BICO_API
    declarations."""
    out = {}
    for h in glob.glob(os.path.join(INCLUDE, "*.h")):
        src = open(h).read()
        out[os.path.basename(h)] = {
            m[len("bico_"):] for m in re.findall(
                r"BICO_API\s+[^;(]*?\b(bico_\w+)\s*\(", src)}
    return out


def c_calls(path):
    """The library functions a module calls: fn.X (bico._lib's table), or
    _fn.X in bico.fit (its own table of bico_fit_*)."""
    calls = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Attribute) and isinstance(
                node.value, ast.Name) and node.value.id in ("fn", "_fn"):
            calls.add(node.attr)
    return calls


def test_every_header_has_its_module():
    headers = set(header_functions())
    assert headers - set(HEADER_MODULE) - set(NO_MODULE) == set(), \
        "headers without a binding module"
    assert set(HEADER_MODULE) | set(NO_MODULE) <= headers, \
        "mapped headers that no longer exist"
    for h, m in HEADER_MODULE.items():
        assert os.path.exists(os.path.join(PKG, m + ".py")), (h, m)
        doc = ast.get_docstring(ast.parse(open(os.path.join(
            PKG, m + ".py")).read())) or ""
        if h != "dtype.h":
            assert "include/bico/" + h in doc or h in doc, \
                "%s.py's docstring does not name %s" % (m, h)


def test_each_wrapper_calls_only_its_own_header():
    funcs = header_functions()
    owned = {}
    for h, m in HEADER_MODULE.items():
        owned.setdefault(m, set()).update(funcs[h])
    fit_prefix = "fit_"
    for m, mine in sorted(owned.items()):
        calls = c_calls(os.path.join(PKG, m + ".py"))
        if m == "fit":       # _fn.X is bico_fit_X
            calls = {c if c.startswith(fit_prefix) else fit_prefix + c
                     for c in calls}
        foreign = calls - mine - SHARED
        assert not foreign, "%s.py calls other headers' functions: %s" % (
            m, sorted(foreign))
        assert calls, "%s.py wraps nothing" % m
    # and no other module of the package calls the library directly
    # (bico._enums reads the name tables of every header, through names)
    wrappers = set(owned) | {"_enums", "_lib"}
    for f in glob.glob(os.path.join(PKG, "*.py")):
        m = os.path.basename(f)[:-3]
        if m not in wrappers:
            assert not c_calls(f), "%s.py calls the library: %s" % (
                m, sorted(c_calls(f)))


def import_graph(pkg_dir, pkg_name="bico"):
    """{module: {modules of the package it imports}}: `from .x import`,
    `from . import x`, `import bico.x`, `from bico(.x) import`, at any
    level of the module (function bodies included)."""
    mods = {os.path.basename(f)[:-3]
            for f in glob.glob(os.path.join(pkg_dir, "*.py"))}
    graph = {}
    for m in mods:
        deps = set()
        tree = ast.parse(open(os.path.join(pkg_dir, m + ".py")).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    base = node.module
                elif node.level == 0 and node.module and (
                        node.module == pkg_name or node.module.startswith(
                            pkg_name + ".")):
                    base = node.module[len(pkg_name) + 1:] or None
                else:
                    continue
                if base:
                    deps.add(base.split(".")[0])
                else:
                    deps.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(pkg_name + "."):
                        deps.add(a.name.split(".")[1])
        graph[m] = (deps & mods) - {"__init__", m}
    graph.pop("__init__", None)
    return graph


def find_cycle(graph):
    """One import cycle as a list of modules (first == last), or None."""
    state = {}

    def visit(m, path):
        if state.get(m) == 1:
            return path[path.index(m):] + [m]
        if state.get(m) == 2:
            return None
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            c = visit(d, path + [m])
            if c:
                return c
        state[m] = 2
        return None
    for m in sorted(graph):
        c = visit(m, [])
        if c:
            return c
    return None


def test_no_import_cycle_inside_the_package():
    graph = import_graph(PKG)
    assert "transfer" in graph and "_handle" in graph["transfer"]
    assert find_cycle(graph) is None, "import cycle: " + " -> ".join(
        find_cycle(graph))


@pytest.mark.parametrize("plant", [
    ("_handle.py", "from .transfer import Transfer\n"),        # top level
    ("_ctx.py", "def _f():\n    from . import lora\n"),         # lazy
    ("_xcov.py", "import bico.transfer\n"),                     # absolute
])
def test_a_planted_cycle_is_found(tmp_path, plant):
    """The check above fails on a cycle: a copy of the package with one
    import added that closes one."""
    pkg = tmp_path / "bico"
    shutil.copytree(PKG, str(pkg),
                    ignore=shutil.ignore_patterns("__pycache__"))
    f, line = plant
    with open(str(pkg / f), "a") as out:
        out.write("\n" + line)
    cycle = find_cycle(import_graph(str(pkg)))
    assert cycle is not None and f[:-3] in cycle


def test_every_module_imports():
    for f in sorted(glob.glob(os.path.join(PKG, "*.py"))):
        m = os.path.basename(f)[:-3]
        if m == "__init__":
            continue
        if m in ("torch", "torch_fit", "hf", "llm"):
            pytest.importorskip("torch")
        importlib.import_module("bico." + m)


def test_old_places_still_work():
    """Names that moved with the split keep their old import paths."""
    import bico.lora
    import bico.merge
    import bico.model
    import bico.transfer
    import bico._stats
    assert bico.model.Transfer is bico.transfer.Transfer is bico.Transfer
    assert bico.model.transfer_files is bico.transfer.transfer_files
    assert bico.model.stats_from_calib is bico._stats.stats_from_calib
    assert bico.model.stats_merge is bico._stats.stats_merge
    for n in ("merge", "merge_check", "merge_tensors"):
        assert getattr(bico.lora, n) is getattr(bico.merge, n)
    for n in ("weight", "weight_split", "vector", "rows"):
        assert callable(getattr(bico.transport, n))
    # functions of the package are not shadowed by modules of one name
    assert callable(bico.depthmap) and callable(bico.procrustes)
    assert callable(bico.naive) and callable(bico.version)
