"""include/bico/merge.h: task merging, what `bico merge` runs; see
docs/lora.md.

    import bico.merge as bm       # (also bico.lora.merge, ...)
    bm.merge("B.safetensors", [("lora", "out_dir", 1.0, 0.5),
                               ("task_vector", "tau.safetensors", 0.7, 0.5)],
             "merged.safetensors", method="ties")
    bm.merge_tensors([tau_1, tau_2], [0.5, 0.5], method="linear")
"""
import ctypes

import numpy as np

from . import _args as A
from ._ctx import Context, _or_default
from ._enums import (choose, MERGE_METHODS, MERGE_INPUTS, MERGE_FILES,
                     MERGE_PARAMS, MERGE_CHECK_LEVELS)
from ._lib import fn, c_void_p
from ._status import E_SHAPE, BicoError, check as _check

__all__ = ["merge_tensors", "merge", "merge_check"]


def _enc(s, name="path"):
    return A.cstr(s, name, path=True)


def _p(a):
    return None if a is None else a.ctypes.data_as(c_void_p)


def merge_tensors(taus, weights, densities=None, method="linear",
                  normalize=None, ctx=None):
    """bico_merge_tensor over same-shaped arrays (one weight, and one
    density when given, per array); normalize None: the method's default
    (TIES yes, linear no)."""
    ctx = _or_default(ctx)
    m = choose(MERGE_METHODS, method, "merge method")
    if isinstance(taus, np.ndarray) or not hasattr(taus, "__iter__"):
        raise TypeError("merge_tensors: taus must be a list of arrays")
    xs = [A.f32(t, "taus[%d]" % i) for i, t in enumerate(taus)]
    if not xs:
        raise BicoError(E_SHAPE, "merge_tensors: no task vectors")
    shape = xs[0].shape
    for i, x in enumerate(xs):
        if x.shape != shape:
            raise BicoError(E_SHAPE, "merge_tensors: taus[%d] has shape %s, "
                            "taus[0] %s" % (i, A.shape_str(x.shape),
                                            A.shape_str(shape)))
    w = A.f64(weights, "weights", shape=(len(xs),), why="one per task vector")
    d = None if densities is None else A.f64(
        densities, "densities", shape=(len(xs),), why="one per task vector")
    if normalize is None:
        normalize = m == MERGE_METHODS["ties"]
    ptrs = (c_void_p * len(xs))(*[x.ctypes.data for x in xs])
    out = np.empty(shape, np.float32)
    _check(fn.merge_tensor(ctx._alive(), m, len(xs), out.size,
                           ctypes.cast(ptrs, c_void_p), _p(w), _p(d),
                           int(bool(normalize)), _p(out)), ctx)
    return out


def merge(base, inputs, output, method="linear", alpha=1.0, normalize=None,
          delta_output=None, report=None, max_shard_size=None, ctx=None):
    """What `bico merge` runs.  inputs: (kind, path, weight, density) with
    kind "task_vector", "tuned" or "lora".  max_shard_size: bytes per shard
    of an output folder (`--max-shard-size`; None: sharded as the base)."""
    return _merge(base, inputs, output, method, alpha, normalize,
                  delta_output, report, max_shard_size, ctx, fn.merge_run)


def merge_check(base, inputs, output, method="linear", alpha=1.0,
                normalize=None, delta_output=None, report=None,
                max_shard_size=None, ctx=None, level="inputs"):
    """bico_merge_check: merge()'s arguments checked without the run.
    level "options": the base and output given, some input, outputs on
    distinct paths, no density under "linear", the values' ranges, no file
    opened; "inputs" (default): also what needs the files (the base and
    inputs opened, each input's tensors on base tensors of their shape,
    no output that is an input).  Nothing is written.  Raises BicoError as
    merge() would; returns None."""
    lv = choose(MERGE_CHECK_LEVELS, level, "level")
    _merge(base, inputs, output, method, alpha, normalize, delta_output,
           report, max_shard_size, ctx, lambda h: fn.merge_check(h, lv))


def _merge(base, inputs, output, method, alpha, normalize, delta_output,
           report, max_shard_size, ctx, last):
    m = choose(MERGE_METHODS, method, "merge method")
    alpha = A.scalar_f64(alpha, "alpha")
    if max_shard_size is not None:
        max_shard_size = A.scalar_f64(max_shard_size, "max_shard_size")
    files = [(MERGE_FILES[w], _enc(p, w)) for w, p in
             (("base", base), ("output", output),
              ("delta_output", delta_output), ("report", report))
             if p is not None]
    ins = []
    for i, item in enumerate(inputs):
        kind, path, weight, density = item
        ins.append((choose(MERGE_INPUTS, kind, "merge input kind"),
                    _enc(path, "inputs[%d] path" % i),
                    A.scalar_f64(weight, "inputs[%d] weight" % i),
                    A.scalar_f64(density, "inputs[%d] density" % i)))
    ctx = Context() if ctx is None else ctx
    h = c_void_p()
    _check(fn.merge_create(ctx._alive(), ctypes.byref(h)), ctx)
    try:
        for which, path in files:
            _check(fn.merge_set_file(h, which, path), ctx)
        _check(fn.merge_set_param(h, MERGE_PARAMS["method"], m), ctx)
        _check(fn.merge_set_param(h, MERGE_PARAMS["alpha"], alpha), ctx)
        _check(fn.merge_set_param(h, MERGE_PARAMS["normalize"],
                                  -1 if normalize is None
                                  else int(bool(normalize))), ctx)
        if max_shard_size is not None:
            _check(fn.merge_set_param(h, MERGE_PARAMS["max_shard_size"],
                                      max_shard_size), ctx)
        for kind, path, weight, density in ins:
            _check(fn.merge_add_input(h, kind, path, weight, density), ctx)
        _check(last(h), ctx)
    finally:
        fn.merge_free(h)
    return output
