"""The binding's enumeration tables are the library's (issue 25): every
enumerator of include/bico/*.h has its name in the Python table of its
enumeration, every name Python accepts is one the library accepts, and
bico/_enums.py holds no hand-written table any more.  (Before, MERGE_PARAMS
lacked max_shard_size and GRADFIX_MODES accepted "vote", which the C
library does not know.)"""
import ast
import ctypes
import os
import re

import pytest

import bico
from bico import _enums, _status
from bico._lib import fn

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
HEADERS = os.path.join(ROOT, "include", "bico")

# C enumeration -> (Python table, prefix of its C name functions)
TABLES = {
    "bico_param_flag": ("PARAM_FLAGS", "param_flag"),
    "bico_ctx_param": ("CTX_PARAMS", "ctx_param"),
    "bico_fit_flag": ("FIT_FLAGS", "fit_flag"),
    "bico_fit_param": ("FIT_PARAMS", "fit_param"),
    "bico_folder_policy": ("FOLDER_POLICIES", "folder_policy"),
    "bico_gradfix_mode": ("GRADFIX_MODES", "gradfix_mode"),
    "bico_lora_kind": ("LORA_KINDS", "lora_kind"),
    "bico_lora_param": ("LORA_PARAMS", "lora_param"),
    "bico_lora_string": ("LORA_STRINGS", "lora_string"),
    "bico_merge_method": ("MERGE_METHODS", "merge_method"),
    "bico_merge_input": ("MERGE_INPUTS", "merge_input"),
    "bico_merge_file": ("MERGE_FILES", "merge_file"),
    "bico_merge_param": ("MERGE_PARAMS", "merge_param"),
    # merge.h's levels are bico_transfer_check_level's values and names
    "bico_merge_check_level": ("MERGE_CHECK_LEVELS", "transfer_check_level"),
    "bico_module_kind": ("MODULE_KINDS", "model_module_kind"),
    "bico_tensor_role": ("TENSOR_ROLES", "model_tensor_role"),
    "bico_procrustes_param": ("PROC_PARAMS", "procrustes_param"),
    "bico_procrustes_method": ("PROC_METHOD_NAMES", "procrustes_method"),
    "bico_null_completion": ("PROC_NULL_NAMES", "procrustes_null"),
    "bico_dtype": ("DTYPES", "dtype"),
    "bico_transfer_method": ("METHODS", "transfer_method"),
    "bico_transfer_norm_map": ("NORM_MAPS", "transfer_norm_map"),
    "bico_transfer_file": ("TRANSFER_FILES", "transfer_file"),
    "bico_transfer_param": ("TRANSFER_PARAMS", "transfer_param"),
    "bico_transfer_structure": ("STRUCTURES", "transfer_structure"),
    "bico_transfer_rope": ("ROPES", "transfer_rope"),
    "bico_transfer_fingerprint": ("FINGERPRINTS", "transfer_fingerprint"),
    "bico_transfer_string": ("TRANSFER_STRINGS", "transfer_string"),
    "bico_transfer_side": ("TRANSFER_SIDES", "transfer_side"),
    "bico_transfer_check_level": ("TRANSFER_CHECK_LEVELS",
                                  "transfer_check_level"),
    "bico_transfer_handling": ("HANDLINGS", "transfer_handling"),
    "bico_votes_flag": ("VOTES_FLAGS", "votes_flag"),
    "bico_xcov_flag": ("XCOV_FLAGS", "xcov_flag"),
    "bico_xcov_which": ("XCOV_WHICH", "xcov_which"),
    "bico_xcov_param": ("XCOV_PARAMS", "xcov_param"),
    "bico_xcov_add_mode": ("XCOV_ADD_MODES", "xcov_add_mode"),
}


def header_enums():
    """{typedef name: {enumerator: value}} read from the public headers
    (an independent reading of the C side: the text, not the library)."""
    out = {}
    for h in sorted(os.listdir(HEADERS)):
        text = open(os.path.join(HEADERS, h)).read()
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        text = re.sub(r"//[^\n]*", "", text)
        for m in re.finditer(r"typedef\s+enum\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;",
                             text, re.S):
            members, nxt = {}, 0
            for item in m.group(2).split(","):
                item = item.strip()
                if not item:
                    continue
                name, _, val = item.partition("=")
                nxt = int(val.strip(), 0) if val.strip() else nxt
                members[name.strip()] = nxt
                nxt += 1
            out[m.group(1)] = members
    return out


def as_names(table):
    """{name: value} whatever way round the table is kept."""
    if all(isinstance(k, int) for k in table):
        return {v: k for k, v in table.items()}
    return dict(table)


def test_every_header_enumeration_has_its_python_table():
    enums = header_enums()
    assert len(enums) >= 30, sorted(enums)
    unmapped = sorted(set(enums) - set(TABLES) - {"bico_status"})
    assert not unmapped, "no Python table for " + ", ".join(unmapped)


@pytest.mark.parametrize("enum", sorted(TABLES))
def test_python_table_holds_exactly_the_header_values(enum):
    members = header_enums()[enum]
    table = as_names(getattr(_enums, TABLES[enum][0]))
    assert sorted(table.values()) == sorted(members.values()), \
        (enum, table, members)
    assert len(set(table)) == len(table)


@pytest.mark.parametrize("enum", sorted(TABLES))
def test_every_python_name_round_trips_through_the_library(enum):
    table = as_names(getattr(_enums, TABLES[enum][0]))
    prefix = TABLES[enum][1]
    name_of = getattr(fn, prefix + "_name")
    from_name = getattr(fn, prefix + "_from_name")
    for name, value in table.items():
        assert name_of(value).decode() == name, (enum, name, value)
        out = ctypes.c_int(-1)
        assert from_name(name.encode(), ctypes.byref(out)) == 0, (enum, name)
        assert out.value == value


def test_status_codes_are_the_librarys():
    members = header_enums()["bico_status"]
    for ident, value in members.items():
        assert getattr(_status, ident[len("BICO_"):]) == value, ident
        assert getattr(bico, ident[len("BICO_"):]) == value, ident


def test_aliases_come_from_the_library_only():
    # mergekit's word is the C library's alias: accepted, never listed
    assert "task_arithmetic" in _enums.MERGE_METHODS
    assert _enums.MERGE_METHODS["task_arithmetic"] == \
        _enums.MERGE_METHODS["linear"]
    assert "task_arithmetic" not in list(_enums.MERGE_METHODS)
    # the binding's former "vote" for majority was never the library's
    assert "vote" not in _enums.GRADFIX_MODES
    with pytest.raises(bico.BicoError):
        _enums.choose(_enums.GRADFIX_MODES, "vote", "gradfix mode")
    assert _enums.choose(_enums.GRADFIX_MODES, "majority", "m") == \
        _enums.GRADFIX_MODES["majority"]


def test_float_dtypes_are_the_librarys_predicate():
    assert {_enums.DTYPE_NAMES[d] for d in _enums.FLOAT_DTYPES} == \
        {"F32", "F16", "BF16", "F64"}
    for name, d in _enums.DTYPES.items():
        assert bool(fn.dtype_is_float(d)) == (d in _enums.FLOAT_DTYPES)


def _hand_tables(path, allowed=()):
    """Dict literals mapping str constants to int constants, and
    module-level NAME = <int> assignments, in a module's source."""
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if target in allowed:
                continue
            v = node.value
            if isinstance(v, ast.Dict) and v.keys and all(
                    isinstance(k, ast.Constant) and isinstance(k.value, str)
                    for k in v.keys) and all(
                    isinstance(x, ast.Constant) and isinstance(x.value, int)
                    for x in v.values):
                found.append(target)
            if isinstance(v, ast.Constant) and isinstance(v.value, int) and \
                    target.isupper():
                found.append(target)
    return found


def test_no_hand_written_enumeration_is_left():
    import bico.fit
    pkg = os.path.dirname(bico.__file__)
    # DEFAULT_SPLIT is the binding's default split policy, not a C table
    assert _hand_tables(_enums.__file__, allowed={"DEFAULT_SPLIT"}) == []
    assert _hand_tables(_status.__file__) == []
    assert _hand_tables(bico.fit.__file__) == []
    for mod in ("lora.py", "merge.py", "model.py", "transfer.py", "_stats.py",
                "_ctx.py", "_xcov.py", "_procrustes.py", "_votes.py",
                "_gradfix.py", "transport.py", "_baseline.py", "_depthmap.py",
                "_version.py", "_handle.py", "safetensors.py"):
        assert _hand_tables(os.path.join(pkg, mod)) == [], mod


def test_torch_methods_are_the_librarys_and_the_fits():
    bt = pytest.importorskip("bico.torch")
    assert set(_enums.METHODS) <= set(bt.MODEL_METHODS)
    assert set(bt.MODEL_METHODS) - set(_enums.METHODS) == \
        {"fit", "proxy-fit", "distill", "proxy-distill"}


def test_transfer_set_file_takes_the_bindings_spelling_of_every_slot():
    # The library names the slots as its messages do ("source base"); the
    # binding's keyword spelling ("source_base") is the library's alias,
    # and both land in the header's slot.
    members = header_enums()["bico_transfer_file"]
    assert _enums.TRANSFER_FILES["source_adapter"] == members["BICO_FILE_LORA"]
    assert _enums.TRANSFER_FILES["output_adapter"] == \
        members["BICO_FILE_LORA_OUTPUT"]
    from bico.model import Transfer
    with Transfer() as t:
        for name, value in _enums.TRANSFER_FILES.items():
            for spelling in (name, name.replace(" ", "_")):
                t.set_file(spelling, "/nonexistent/" + spelling)
                out = ctypes.c_char_p()
                assert fn.transfer_get_file(t._alive(), value,
                                            ctypes.byref(out)) == 0
                assert out.value.decode() == "/nonexistent/" + spelling
        with pytest.raises(bico.BicoError):
            t.set_file("lora", "/x")
