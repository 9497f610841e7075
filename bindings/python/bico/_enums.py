"""The enumerations of include/bico/*.h, in one module.

Where the library offers a name lookup (bico_dtype_from_name,
bico_transfer_method_name, bico_transfer_norm_map_name), the tables are read from the
library at import, so the binding cannot drift from it; the other values
are frozen in the headers and written here once.  Every wrapper imports
its table from here.
"""
import ctypes

import numpy as np

from ._lib import fn
from ._status import BicoError, E_ARG


def choose(table, value, what):
    """table[value] for a name; a clear error listing the names otherwise.
    Integers that are values of the table pass through."""
    if isinstance(value, str):
        if value in table:
            return table[value]
        raise BicoError(E_ARG, "%s must be one of %s, got %r"
                        % (what, ", ".join(sorted(table)), value))
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) \
            and int(value) in set(table.values()):
        return int(value)
    raise BicoError(E_ARG, "%s must be one of %s, got %r"
                    % (what, ", ".join(sorted(table)), value))


# ---- ctx.h, xcov.h, procrustes.h, gradfix.h ----
CTX_THREADS = 1
XCOV_SUMS, XCOV_GRAMS = 1, 2
XCOV_WHICH = {"cross": 1, "gram_a": 2, "gram_b": 3}
PROC_PARAMS = {"center": 1, "whiten": 2, "whiten_eps": 3, "rank_tol": 4,
               "null": 5, "method": 6}
NULL_KEEP, NULL_DROP = 1, 2
PROC_NULL_NAMES = {"keep": NULL_KEEP, "drop": NULL_DROP}
PROC_METHOD_NAMES = {"svd": 1, "eig": 2, "polar": 3}
VOTES_MEAN = 1
GRADFIX_MODES = {"majority": 1, "vote": 1, "mean": 2}

# ---- model.h ----
MODULE_KINDS = {1: "linear", 2: "elementwise", 3: "embedding", 4: "other"}
TENSOR_ROLES = {1: "weight", 2: "bias", 3: "vector", 4: "token", 5: "other"}

# ---- transfer.h: method and norm-map names from the library ----

def _names_from_library(name_fn, what):
    """{name: value} of an enumeration whose bico_*_name gives NULL for an
    unknown value (the values are small: see the enum rule in the
    headers)."""
    out = {}
    for v in range(256):
        raw = name_fn(v)
        if raw:
            out[raw.decode()] = v
    if not out:
        raise ImportError("bico: the library names no %s" % what)
    return out


METHODS = _names_from_library(fn.transfer_method_name, "method")
XCOV_ADD_MODE = 1
XCOV_ADD_MODES = _names_from_library(fn.xcov_add_mode_name, "xcov add mode")
NORM_MAPS = _names_from_library(fn.transfer_norm_map_name, "norm map")
STRUCTURES = _names_from_library(fn.transfer_structure_name, "structure")
ROPES = _names_from_library(fn.transfer_rope_name, "RoPE layout")
TRANSFER_FILES = {"source_base": 1, "source_tuned": 2, "task_vector": 3,
                  "target_base": 4, "source_calib": 5, "target_calib": 6,
                  "stats": 7, "target_votes": 8, "output": 9,
                  "delta_output": 10, "report": 11, "lora": 12,
                  "lora_output": 13, "source_config": 14,
                  "target_config": 15}
TRANSFER_PARAMS = _names_from_library(fn.transfer_param_name,
                                     "transfer parameter")
TRANSFER_SIDES = _names_from_library(fn.transfer_side_name, "transfer side")
TRANSFER_STRINGS = {"blocks": 1, "source_blocks": 2, "target_blocks": 3,
                    "source_rename": 4}
# the parameters that take a name, and their names
TRANSFER_ENUMS = {"method": METHODS, "norm_map": NORM_MAPS,
                  "null": PROC_NULL_NAMES, "proc_method": PROC_METHOD_NAMES,
                  "gradfix_mode": GRADFIX_MODES, "structure": STRUCTURES,
                  "rope": ROPES}
# the fused projections split by default (suffix: blocks)
DEFAULT_SPLIT = {"qkv": 3, "in_proj": 3}

# ---- lora.h, merge.h ----
LORA_KINDS = {"linear": 1, "embedding": 2}
LORA_PARAMS = _names_from_library(fn.lora_param_name, "LoRA parameter")
LORA_STRINGS = {"task_type": 1, "base_model": 2}
MERGE_METHODS = _names_from_library(fn.merge_method_name, "merge method")
MERGE_METHODS["task_arithmetic"] = MERGE_METHODS["linear"]  # mergekit's word
MERGE_INPUTS = {"task_vector": 1, "tuned": 2, "lora": 3}
MERGE_FILES = {"base": 1, "output": 2, "delta_output": 3, "report": 4}
MERGE_PARAMS = {"method": 1, "alpha": 2, "normalize": 3}

# ---- safetensors.h: dtype codes from the library ----
# NumPy's side of each safetensors dtype name (BF16 has none: float32).
_NP_OF_NAME = {"F32": np.float32, "F16": np.float16, "BF16": None,
               "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64, "U8": np.uint8,
               "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
               "BOOL": np.bool_}


def _dtype_codes():
    out = {}
    for name in _NP_OF_NAME:
        code = ctypes.c_int()
        if fn.dtype_from_name(name.encode(), ctypes.byref(code)) == 0:
            out[name] = code.value
    return out


DTYPES = _dtype_codes()                      # {"F32": code, ...}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
NP_OF_DTYPE = {DTYPES[k]: np.dtype(v) for k, v in _NP_OF_NAME.items()
               if v is not None and k in DTYPES}
DTYPE_OF_NP = {v: k for k, v in NP_OF_DTYPE.items()}
FLOAT_DTYPES = {DTYPES[k] for k in ("F32", "F16", "BF16", "F64")
                if k in DTYPES}
