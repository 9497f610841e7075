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
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    "experimental.h": "no ABI promise: a function there is wrapped, if at "
                      "all, by the module of the handle it names "
                      "(EXPERIMENTAL_OWNER)",
}
# experimental.h's functions by the prefix of their handle's header
EXPERIMENTAL_OWNER = {"fit_": "fit", "procrustes_": "_procrustes"}
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
    for f in funcs["experimental.h"]:
        owner = [m for p, m in EXPERIMENTAL_OWNER.items() if f.startswith(p)]
        assert len(owner) == 1, "experimental %s has no owning module" % f
        owned[owner[0]].add(f)
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
    for m, f in sorted(package_modules(PKG).items()):
        if m not in wrappers:
            assert not c_calls(f), "%s calls the library: %s" % (
                f, sorted(c_calls(f)))


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
    for m in sorted(package_modules(PKG)):
        if m in ("", "llm.__main__"):  # the package; the command's run
            continue
        if m.split(".")[0] in ("torch", "llm"):
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


# ---- the sub-packages: bico.torch (the PyTorch front end) and bico.llm
# (decoders from model folders, on top of bico.torch) ----

def package_modules(pkg_dir):
    """{dotted name under bico ("" for the package, "torch",
    "torch.collect", ...): path} of every module of the package, the
    sub-packages' included."""
    out = {}
    for dp, dns, fns in os.walk(pkg_dir):
        dns[:] = sorted(d for d in dns if d != "__pycache__")
        rel = os.path.relpath(dp, pkg_dir)
        pkg = "" if rel == "." else rel.replace(os.sep, ".")
        for f in sorted(fns):
            if f.endswith(".py"):
                name = pkg if f == "__init__.py" else \
                    (pkg + "." if pkg else "") + f[:-3]
                out[name] = os.path.join(dp, f)
    return out


def _ancestors(name):
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _dotted(name, here, pkg_name):
    """A module name as a string names it (absolute "bico.llm.text" or
    relative ".text" / "..llm.text", from the package here) -> its name
    under the package, or None."""
    if name == pkg_name or name.startswith(pkg_name + "."):
        return name[len(pkg_name) + 1:]
    dots = len(name) - len(name.lstrip("."))
    if not dots:
        return None
    up = here.split(".") if here else []
    if dots - 1 > len(up):
        return None
    base = ".".join(up[:len(up) - (dots - 1)])
    rest = name[dots:]
    return (base + "." if base and rest else base) + rest


def _named_modules(path, here, pkg_name, mods):
    """The package's modules a module reaches by name rather than by an
    import statement: importlib.import_module("...") / __import__("...")
    with a string, and, in a module that imports importlib at all, every
    string constant that names one of the package's modules (a table of
    names fed to import_module, as a lazy re-export keeps one)."""
    tree = ast.parse(open(path).read())
    uses = any(isinstance(n, (ast.Import, ast.ImportFrom)) and any(
        a.name == "importlib" or a.name.startswith("importlib.")
        for a in n.names) or (isinstance(n, ast.ImportFrom) and
                              (n.module or "").startswith("importlib"))
        for n in ast.walk(tree))
    found = set()
    for node in ast.walk(tree):
        strings = []
        if isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else \
                getattr(f, "id", None)
            if fname in ("import_module", "__import__") and node.args and \
                    isinstance(node.args[0], ast.Constant):
                strings.append(node.args[0].value)
        elif uses and isinstance(node, ast.Constant):
            strings.append(node.value)
        for v in strings:
            if not isinstance(v, str) or not re.match(
                    r"^(\.+|%s\.)?[A-Za-z_][\w.]*$" % re.escape(pkg_name), v):
                continue
            m = _dotted(v, here, pkg_name)
            if m is not None and m in mods:
                found.add(m)
    return found


def full_import_graph(pkg_dir, pkg_name="bico"):
    """{module: {modules it imports}} over package_modules (names as
    there), from every import statement at any level of a module.
    Importing a module of another sub-package runs that sub-package's
    __init__ first: an edge to it too (not to the importer's own
    packages, which are initialised before it)."""
    mods = package_modules(pkg_dir)
    graph = {}
    for m, path in mods.items():
        is_pkg = os.path.basename(path) == "__init__.py"
        here = m if is_pkg else ".".join(m.split(".")[:-1])
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom):
                if node.level:              # from .x / from .. import y
                    up = here.split(".") if here else []
                    if node.level - 1 > len(up):
                        continue
                    base = ".".join(up[:len(up) - (node.level - 1)])
                    if node.module:
                        base = (base + "." if base else "") + node.module
                elif node.module == pkg_name or (node.module or "") \
                        .startswith(pkg_name + "."):
                    base = node.module[len(pkg_name) + 1:]
                else:
                    continue
                targets.add(base)           # a module, or y of base
                targets.update((base + "." if base else "") + a.name
                               for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name[len(pkg_name) + 1:] for a in node.names
                               if a.name.startswith(pkg_name + "."))
        targets.update(_named_modules(path, here, pkg_name, mods))
        own = set(_ancestors(m)) | {m, ""}
        deps = set()
        for t in targets & set(mods):
            deps.update(p for p in [t] + _ancestors(t) if p not in own)
        graph[m] = deps
    return graph


def layer_of(m):
    """binding (the wrappers and the package), torch or llm."""
    top = m.split(".")[0]
    return top if top in ("torch", "llm") else "binding"


# what each layer may import: bico.llm builds on bico.torch (the transfer,
# the held-out choice, tied weights), never the other way round
MAY_IMPORT = {"binding": {"binding"}, "torch": {"binding", "torch"},
              "llm": {"binding", "torch", "llm"}}


def layer_breaches(graph):
    return sorted((m, d) for m, ds in graph.items() for d in ds
                  if layer_of(d) not in MAY_IMPORT[layer_of(m)])


def test_sub_packages_import_one_way_without_cycles():
    graph = full_import_graph(PKG)
    assert {"torch", "torch.collect", "torch.choose", "torch.transfer",
            "llm", "llm.command", "llm.families"} <= set(graph)
    # a few edges the graph must see (relative imports of two levels,
    # lazy imports, another sub-package's __init__)
    assert "torch.choose" in graph["torch.transfer"]
    assert "_status" in graph["torch.collect"]
    assert "fit" in graph["llm.command.method_fit"]  # bico.fit, lazy
    assert {"torch.tied", "torch"} <= graph["llm.adapters"]
    assert not layer_breaches(graph), layer_breaches(graph)
    assert find_cycle(graph) is None, "import cycle: " + " -> ".join(
        find_cycle(graph))


@pytest.mark.parametrize("plant,line,breach,cycle", [
    ("torch/collect.py", "def _f():\n    from ..llm import text\n",
     ("torch.collect", "llm.text"), True),   # lazy, wrong way (a circle
    # through bico.llm's package, whose names reach its modules lazily)
    ("torch/choose.py", "from .transfer import transfer_model\n",
     None, True),                                      # a circle inside
    ("torch/tied.py", "import bico.llm.adapters\n",
     ("torch.tied", "llm.adapters"), True),            # across
    ("_xcov.py", "from .torch import tied\n",
     ("_xcov", "torch.tied"), True),  # a wrapper upwards (torch uses it)
    ("torch/tied.py", "def _g():\n    import importlib\n    return "
     "importlib.import_module('bico.llm.text')\n",
     ("torch.tied", "llm.text"), True),                # by name, absolute
    ("torch/collect.py", "import importlib\n_WHERE = {'x': '..llm.text'}\n"
     "def _h(n):\n    return importlib.import_module(_WHERE[n], "
     "__package__)\n", ("torch.collect", "llm.text"), True),  # a table
])
def test_a_planted_breach_or_cycle_is_found(tmp_path, plant, line, breach,
                                            cycle):
    pkg = tmp_path / "bico"
    shutil.copytree(PKG, str(pkg),
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(str(pkg / plant), "a") as out:
        out.write("\n" + line)
    graph = full_import_graph(str(pkg))
    if breach:
        assert breach in layer_breaches(graph)
    else:
        assert not layer_breaches(graph)
    assert (find_cycle(graph) is not None) == cycle


def _fresh(code):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_bico_torch_does_not_load_bico_llm():
    """Importing bico.torch, and running its transfer on modules, loads no
    bico.llm module; bico.llm's names are not bico.torch's."""
    pytest.importorskip("torch")
    out = _fresh("import sys, torch, bico.torch as bt\n"
                 "m = [torch.nn.Linear(3, 2) for _ in range(3)]\n"
                 "x = [(torch.randn(4, 3), torch.randn(4, 2))]\n"
                 "bt.transfer_model(*m, x, method='naive',\n"
                 "                  options=bt.MapOptions(alpha=1.0))\n"
                 "print(sorted(n for n in sys.modules if 'llm' in n))\n"
                 "print(hasattr(bt, 'load_model'))\n")
    assert out.splitlines() == ["[]", "False"], out


@pytest.mark.parametrize("first", [
    "bico.llm.adapters", "bico.llm.command", "bico.llm.families",
    "bico.llm.folders", "bico.torch.tied", "bico.torch.fit"])
def test_any_module_may_be_imported_first(first):
    """Imported first in a fresh interpreter, each module loads (no
    half-initialised module on the way)."""
    pytest.importorskip("torch")
    _fresh("import %s\nimport bico.torch as bt, bico.llm as bl\n"
           "assert callable(bl.save_adapter) and callable(bl.main)\n"
           % first)


# the public names of the former homes that 1.0 removed (re-exports of
# bico.llm's names from bico.torch, the shim modules bico.hf and
# bico.torch_fit, the command's grid: a name of its own, below): old path ->
# {new home: names}
REMOVED = {
    "bico.torch": {
        "bico.llm": "load_model tokenize text_batches next_token_loss "
        "lm_loss save_adapter input_covariances update_grams low_rank",
        "bico": "BicoError Context E_ARG E_NOTFOUND E_SHAPE E_STATE Pairing "
        "Procrustes Votes XCov",
        "bico.torch.collect": "DEFAULT_SPLIT"},
    "bico.torch_fit": {
        "bico.torch.fit": "fit_model",
        "bico.torch.ridge": "GCV_GRID RidgeFit",
        "bico.torch.proxy": "PROXY_GRID proxy_distill proxy_fit"},
    "bico.hf": {
        "bico.llm": "load_model model_config DecoderLM tokenize "
        "text_batches Calibration next_token_loss lm_loss save_adapter "
        "input_covariances update_grams low_rank",
        "bico.llm.families": "FAMILIES Attention DecoderLayer Mlp Model "
        "RMSNorm"},
    "bico.llm.stream_route": {"bico.llm.stream.route": "StreamedFit"},
    "bico.torch.distill": {
        "bico.torch.teacher": "Teacher NoTeacher Grouped kl_to_teacher "
        "build_teacher proxy_chunks check_finite_logits",
        "bico.torch.augment": "mixup cutmix shift compose one_of "
        "auto_augment image_augment"},
}


def _release_notes():
    """The 1.0.0 release's entries (one string each, a sub-entry its own,
    lines joined): the release that removed these names."""
    text = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    section = [s for s in text.split("\n## ") if s.startswith("1.0.0 ")][0]
    return [" ".join(e.split()) for e in re.split(r"\n *- ", section)]


@pytest.mark.parametrize("old", sorted(REMOVED))
def test_removed_names_are_gone_and_the_release_notes_say_where(old):
    """Each public name of a removed home is gone from there, lives in its
    new home, and the newest release's notes name both (the line that
    names `old.name` names its new home)."""
    pytest.importorskip("torch")
    notes = _release_notes()
    try:
        mod = importlib.import_module(old)
    except ImportError:
        mod = None
    for home, names in REMOVED[old].items():
        new = importlib.import_module(home)
        for n in names.split():
            assert hasattr(new, n), (home, n)
            if mod is not None:     # a package: no such attribute; a
                # module that still uses the name: not in its __all__
                assert n not in getattr(mod, "__all__", ()), (old, n)
                assert not hasattr(mod, "__path__") or \
                    not hasattr(mod, n), (old, n)
            lines = [ln for ln in notes
                     if "`%s.%s`" % (old, n) in ln or
                     ("`%s`" % old in ln and "`%s`" % n in ln)]
            assert lines, "release notes do not name %s.%s" % (old, n)
            assert any(home in ln for ln in lines), (old, n, home, lines)
    if old in ("bico.hf", "bico.torch_fit"):
        assert mod is None


# ---- the package's size limits before 1.0 freezes its names ----

def _public_functions(pkg_dir):
    """(parameter count, module, name) of every public function and method
    (no leading underscore) of the package's modules; self / cls not
    counted, *args and **kwargs one each."""
    out = []
    for m, path in package_modules(pkg_dir).items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and not node.name.startswith("_"):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + \
                    (a.vararg is not None) + (a.kwarg is not None)
                if a.args and a.args[0].arg in ("self", "cls"):
                    n -= 1
                out.append((n, m, node.name))
    return out


def test_no_public_function_over_20_parameters_and_no_module_over_800():
    """Signatures a user can hold: no public function over 20 parameters,
    transfer_model (both homes) at most 12 with its options grouped; no
    module of the package over 800 lines."""
    funcs = _public_functions(PKG)
    assert len(funcs) > 200, len(funcs)
    over = [f for f in funcs if f[0] > 20]
    assert not over, over
    tm = [f for f in funcs if f[2] == "transfer_model"]
    assert {m for _, m, _ in tm} == {"torch.transfer", "llm.folders"}, tm
    assert all(n <= 12 for n, _, _ in tm), tm
    long = [(m, n) for m, p in package_modules(PKG).items()
            for n in [sum(1 for _ in open(p))] if n > 800]
    assert not long, long


def test_the_size_checks_fail_on_a_planted_breach(tmp_path):
    pkg = tmp_path / "bico"
    shutil.copytree(PKG, str(pkg),
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(str(pkg / "fit.py"), "a") as out:
        out.write("\n\ndef wide(%s):\n    pass\n"
                  % ", ".join("a%d" % i for i in range(21)))
    assert (21, "fit", "wide") in _public_functions(str(pkg))
