"""The enumerations of include/bico/*.h, read from the library at import.

Every table is built by asking the linked libbico for its names
(bico_<prefix>_name over the values, bico_<prefix>_from_name for the
spellings it also accepts, such as mergekit's "task_arithmetic"): the
binding keeps no copy of a name or a value, so it cannot drift from the
library.  Every wrapper imports its table from here.
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


# The values asked for: choices and keys run from 0 or 1 without gaps and
# flags are powers of two (status.h's enumeration rule).
_VALUES = sorted(set(range(256)) | {1 << k for k in range(31)})


class Names(dict):
    """{name: value} of the enumeration whose C functions are
    bico_<prefix>_name and bico_<prefix>_from_name.  Iteration gives the
    library's own names; lookups also take the other spellings its
    _from_name accepts (an alias is never listed, as the C side never
    names it)."""

    def __init__(self, prefix):
        dict.__init__(self)
        self.prefix = prefix
        self._from = getattr(fn, prefix + "_from_name")
        name_of = getattr(fn, prefix + "_name")
        for v in _VALUES:
            raw = name_of(v)
            if raw:
                self[raw.decode()] = v
        if not dict.__len__(self):
            raise ImportError("bico: the library names no %s "
                              "(bico_%s_name)" % (prefix, prefix))

    def __missing__(self, key):
        if isinstance(key, str):
            out = ctypes.c_int()
            if self._from(key.encode(), ctypes.byref(out)) == 0:
                return out.value
        raise KeyError(key)

    def __contains__(self, key):
        try:
            self[key]
        except KeyError:
            return False
        return True

    def get(self, key, default=None):
        return self[key] if key in self else default


# ---- params.h, ctx.h, xcov.h, procrustes.h, votes.h, gradfix.h, fit.h ----
PARAM_FLAGS = Names("param_flag")
CTX_PARAMS = Names("ctx_param")
CTX_THREADS = CTX_PARAMS["threads"]
CTX_FOLDER_WAIT = CTX_PARAMS["folder_wait"]
XCOV_FLAGS = Names("xcov_flag")
XCOV_SUMS, XCOV_GRAMS = XCOV_FLAGS["sums"], XCOV_FLAGS["grams"]
XCOV_WHICH = Names("xcov_which")
XCOV_PARAMS = Names("xcov_param")
XCOV_ADD_MODE = XCOV_PARAMS["add_mode"]
XCOV_ADD_MODES = Names("xcov_add_mode")
PROC_PARAMS = Names("procrustes_param")
PROC_NULL_NAMES = Names("procrustes_null")
NULL_KEEP, NULL_DROP = PROC_NULL_NAMES["keep"], PROC_NULL_NAMES["drop"]
PROC_METHOD_NAMES = Names("procrustes_method")
VOTES_FLAGS = Names("votes_flag")
VOTES_MEAN = VOTES_FLAGS["mean"]
GRADFIX_MODES = Names("gradfix_mode")
FIT_FLAGS = Names("fit_flag")
FIT_PARAMS = Names("fit_param")

# ---- model.h: {value: name} ----
MODULE_KINDS = {v: k for k, v in Names("model_module_kind").items()}
TENSOR_ROLES = {v: k for k, v in Names("model_tensor_role").items()}

# ---- transfer.h ----
METHODS = Names("transfer_method")
NORM_MAPS = Names("transfer_norm_map")
STRUCTURES = Names("transfer_structure")
ROPES = Names("transfer_rope")
FINGERPRINTS = Names("transfer_fingerprint")
HANDLINGS = Names("transfer_handling")
TRANSFER_FILES = Names("transfer_file")   # also takes "source_base"
TRANSFER_PARAMS = Names("transfer_param")
TRANSFER_SIDES = Names("transfer_side")
TRANSFER_STRINGS = Names("transfer_string")
TRANSFER_CHECK_LEVELS = Names("transfer_check_level")
# bico_merge_check_level: the same values and names (merge.h)
MERGE_CHECK_LEVELS = TRANSFER_CHECK_LEVELS
# the parameters that take a name, and their names
TRANSFER_ENUMS = {"method": METHODS, "norm_map": NORM_MAPS,
                  "null": PROC_NULL_NAMES, "proc_method": PROC_METHOD_NAMES,
                  "gradfix_mode": GRADFIX_MODES, "structure": STRUCTURES,
                  "rope": ROPES, "fingerprint": FINGERPRINTS}
# The binding's default splits of fused projections (suffix: blocks); a
# default of the Python front end, not a library table (the C driver
# splits only what it is told to).
DEFAULT_SPLIT = {"qkv": 3, "in_proj": 3}

# ---- lora.h, merge.h ----
LORA_KINDS = Names("lora_kind")
LORA_PARAMS = Names("lora_param")
LORA_STRINGS = Names("lora_string")
MERGE_METHODS = Names("merge_method")   # also takes "task_arithmetic"
MERGE_INPUTS = Names("merge_input")
MERGE_FILES = Names("merge_file")
MERGE_PARAMS = Names("merge_param")

# ---- folder.h ----
FOLDER_POLICIES = Names("folder_policy")

# ---- safetensors.h ----
DTYPES = Names("dtype")                  # {"F32": code, ...}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# NumPy's side of each safetensors dtype (BF16 has none: it reads as
# float32): NumPy's knowledge, not the library's.
_NP_OF_NAME = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
               "I8": np.int8, "I16": np.int16, "I32": np.int32,
               "I64": np.int64, "U8": np.uint8, "U16": np.uint16,
               "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_}
NP_OF_DTYPE = {DTYPES[k]: np.dtype(v) for k, v in _NP_OF_NAME.items()
               if k in DTYPES}
DTYPE_OF_NP = {v: k for k, v in NP_OF_DTYPE.items()}
FLOAT_DTYPES = {v for v in DTYPES.values() if fn.dtype_is_float(v)}
