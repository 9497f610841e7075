"""LoRA adapters and task merging (include/bico/lora.h, merge.h): thin
ctypes wrappers over the C API; see docs/lora.md.

    import bico.lora as bl
    ad = bl.Adapter.open("adapter_dir")          # PEFT folder
    ad.modules()["layers.0.q_proj"]              # kind, B, A, alpha, scale
    b2, a2 = bl.transport(B, A, r_out=R_out, r_in=R_in)   # factored BiCo
    bl.transfer(source_base=..., target_base=..., stats=..., adapter=...,
                output_lora="out_dir")           # what `bico transfer --lora` runs
    bl.merge("B.safetensors", [("lora", "out_dir", 1.0, 0.5),
                               ("task_vector", "tau.safetensors", 0.7, 0.5)],
             "merged.safetensors", method="ties")
"""
import ctypes

import numpy as np

from ._core import BicoError, Context, _Handle, _check, _ctx, E_SHAPE
from . import _args as A
from ._enums import (choose, LORA_KINDS, LORA_PARAMS, LORA_STRINGS,
                     MERGE_METHODS, MERGE_INPUTS, MERGE_FILES, MERGE_PARAMS,
                     TRANSFER_FILES, MERGE_CHECK_LEVELS)
from ._lib import fn, c_size_t, c_int, c_double, c_float, c_char_p, c_void_p

P = ctypes.POINTER

LINEAR, EMBEDDING = LORA_KINDS["linear"], LORA_KINDS["embedding"]
KINDS = {v: k for k, v in LORA_KINDS.items()}
FILE_LORA, FILE_LORA_OUTPUT = TRANSFER_FILES["source adapter"], \
    TRANSFER_FILES["output adapter"]


def _enc(s, name="path"):
    return A.cstr(s, name, path=True)


def _f32(x, name, shape=None, why=""):
    """A C-contiguous 2-D float32 array (of the given shape)."""
    return A.f32(x, name, ndim=2, shape=shape, why=why)


def _p(a):
    return None if a is None else a.ctypes.data_as(c_void_p)


class Adapter(_Handle):
    """bico_lora: a PEFT LoRA adapter in memory (read, built, saved)."""
    _free = staticmethod(fn.lora_free)

    def __init__(self, ctx=None):
        ctx = Context() if ctx is None else ctx
        h = c_void_p()
        _check(fn.lora_create(ctx._alive(), ctypes.byref(h)), ctx)
        self._adopt(h.value, ctx)

    @classmethod
    def open(cls, folder, ctx=None):
        ctx = Context() if ctx is None else ctx
        h = c_void_p()
        _check(fn.lora_open(ctx._alive(), _enc(folder), ctypes.byref(h)), ctx)
        o = cls.__new__(cls)
        o._adopt(h.value, ctx)
        return o

    def flag(self, name):
        """An adapter-wide switch ("rslora", "fan_in_fan_out"): a 0/1
        parameter of the library's option grammar (bico_lora_get_param)."""
        v = c_double()
        _check(fn.lora_get_param(self._alive(), choose(LORA_PARAMS, name,
                                                       "LoRA flag"),
                                 ctypes.byref(v)), self.ctx)
        return bool(v.value)

    def set_flag(self, name, on):
        _check(fn.lora_set_param(self._alive(), choose(LORA_PARAMS, name,
                                                       "LoRA flag"),
                                 float(bool(on))), self.ctx)

    def string(self, name):
        v = c_char_p()
        _check(fn.lora_get_string(self._alive(), choose(LORA_STRINGS, name,
                                                        "LoRA string"),
                                  ctypes.byref(v)), self.ctx)
        return v.value.decode() if v.value is not None else None

    def set_string(self, name, value):
        which = choose(LORA_STRINGS, name, "LoRA string")
        _check(fn.lora_set_string(self._alive(), which, None if value is None
                                  else A.cstr(value, name)), self.ctx)

    def modules(self):
        """{name: (kind, B [d_out, r], A [r, d_in], alpha, scale)}, copies."""
        out = {}
        for i in range(fn.lora_module_count(self._alive())):
            name, kind = c_char_p(), c_int()
            r, do, di = c_size_t(), c_size_t(), c_size_t()
            alpha, scale = c_double(), c_double()
            _check(fn.lora_module(self._ptr, i, ctypes.byref(name),
                                  ctypes.byref(kind), ctypes.byref(r),
                                  ctypes.byref(do), ctypes.byref(di),
                                  ctypes.byref(alpha), ctypes.byref(scale)),
                   self.ctx)
            pb, pa = P(c_float)(), P(c_float)()
            _check(fn.lora_factors(self._ptr, i, ctypes.byref(pb),
                                   ctypes.byref(pa)), self.ctx)
            b = np.ctypeslib.as_array(pb, (do.value, r.value)).copy()
            a = np.ctypeslib.as_array(pa, (r.value, di.value)).copy()
            out[name.value.decode()] = (KINDS[kind.value], b, a, alpha.value,
                                        scale.value)
        return out

    def saved(self):
        """{tensor name: (module, array)} of the modules_to_save tensors."""
        out = {}
        for i in range(fn.lora_saved_count(self._alive())):
            name, mod = c_char_p(), c_char_p()
            nd, shp, data = c_size_t(), P(c_size_t)(), P(c_float)()
            _check(fn.lora_saved(self._ptr, i, ctypes.byref(name),
                                 ctypes.byref(mod), ctypes.byref(nd),
                                 ctypes.byref(shp), ctypes.byref(data)),
                   self.ctx)
            shape = tuple(shp[k] for k in range(nd.value))
            n = int(np.prod(shape)) if shape else 1
            arr = (np.ctypeslib.as_array(data, (n,)).copy() if n else
                   np.zeros(0, np.float32)).reshape(shape)
            out[name.value.decode()] = (mod.value.decode(), arr)
        return out

    def add_module(self, name, b, a, alpha, kind="linear"):
        """Adds module `name`: b [d_out, r], a [r, d_in], lora_alpha."""
        nm = A.cstr(name, "name")
        k = choose(LORA_KINDS, kind, "LoRA module kind")
        b = _f32(b, "b")
        a = _f32(a, "a", shape=(b.shape[1], None), why="r, the columns of b")
        _check(fn.lora_add_module(self._alive(), nm, k, a.shape[0],
                                  A.scalar_f64(alpha, "alpha"), b.shape[0],
                                  a.shape[1], _p(b), _p(a)), self.ctx)

    def add_saved(self, name, module, array):
        """Adds a modules_to_save tensor (any shape, stored as float32)."""
        nm, mod = A.cstr(name, "name"), A.cstr(module, "module")
        x = A.f32(array, "array")
        shape = (c_size_t * max(x.ndim, 1))(*x.shape)
        _check(fn.lora_add_saved(self._alive(), nm, mod, x.ndim,
                                 ctypes.cast(shape, c_void_p), _p(x)),
               self.ctx)

    def save(self, folder):
        _check(fn.lora_save(self._alive(), _enc(folder)), self.ctx)


def transport(b, a, r_out=None, r_in=None, alpha=1.0, d_out=None, d_in=None,
              ctx=None):
    """Factored BiCo: (alpha R_out^T B, A R_in).  r_out may be a list of k
    block maps (fused qkv); None entries, or None, are the rectangular
    identity (then d_out / d_in give the target widths)."""
    ctx = _ctx(ctx)
    b = _f32(b, "b")
    a = _f32(a, "a", shape=(b.shape[1], None), why="the rank, b's columns")
    rank, dout_a, din_a = a.shape[0], b.shape[0], a.shape[1]
    routs = list(r_out) if isinstance(r_out, (list, tuple)) else [r_out]
    k = len(routs)
    if k == 0:
        raise BicoError(E_SHAPE, "lora.transport: r_out is an empty list")
    if dout_a % k:
        raise BicoError(E_SHAPE, "lora.transport: b's %d rows do not split "
                        "into %d blocks" % (dout_a, k))
    routs = [None if r is None else
             _f32(r, "r_out[%d]" % i if k > 1 else "r_out",
                  shape=(dout_a // k, None), why="b's rows / %d" % k)
             for i, r in enumerate(routs)]
    widths = set(r.shape[1] for r in routs if r is not None)
    if len(widths) > 1:
        raise BicoError(E_SHAPE, "lora.transport: block maps differ in "
                        "width: %s" % sorted(widths))
    if widths:
        dout_b = widths.pop() * k
        if d_out is not None and A.size(d_out, "d_out") != dout_b:
            raise BicoError(E_SHAPE, "lora.transport: d_out = %d, the maps "
                            "give %d" % (d_out, dout_b))
    else:
        dout_b = dout_a if d_out is None else A.size(d_out, "d_out", lo=1)
        if dout_b % k:
            raise BicoError(E_SHAPE, "lora.transport: d_out = %d does not "
                            "split into %d blocks" % (dout_b, k))
    ri = None if r_in is None else _f32(r_in, "r_in", shape=(din_a, None),
                                        why="a's columns")
    if ri is not None:
        din_b = ri.shape[1]
        if d_in is not None and A.size(d_in, "d_in") != din_b:
            raise BicoError(E_SHAPE, "lora.transport: d_in = %d, r_in gives "
                            "%d" % (d_in, din_b))
    else:
        din_b = din_a if d_in is None else A.size(d_in, "d_in", lo=1)
    alpha = A.scalar_f32(alpha, "alpha")
    arr = (c_void_p * k)(*[None if r is None else r.ctypes.data for r in routs])
    bo = np.empty((dout_b, rank), np.float32)
    ao = np.empty((rank, din_b), np.float32)
    _check(fn.lora_transport(ctx._alive(), rank, k, dout_a, din_a, dout_b,
                             din_b, float(alpha), _p(b), _p(a),
                             ctypes.cast(arr, c_void_p), dout_b // k, _p(ri),
                             din_b, _p(bo), _p(ao)), ctx)
    return bo, ao


def truncate(dense, rank, scale=1.0, ctx=None):
    """Best rank-r factors: scale B A ~= dense.  -> (B, A, energy kept)."""
    ctx = _ctx(ctx)
    d = _f32(dense, "dense")
    m, n = d.shape
    rank = A.size(rank, "rank", lo=1)
    scale = A.scalar_f64(scale, "scale")
    bo = np.empty((m, rank), np.float32)
    ao = np.empty((rank, n), np.float32)
    e = c_double()
    _check(fn.lora_truncate(ctx._alive(), m, n, _p(d), max(n, 1), rank, scale,
                            _p(bo), _p(ao), ctypes.byref(e)), ctx)
    return bo, ao, e.value


def merge_tensors(taus, weights, densities=None, method="linear",
                  normalize=None, ctx=None):
    """bico_merge_tensor over same-shaped arrays (one weight, and one
    density when given, per array); normalize None: the method's default
    (TIES yes, linear no)."""
    ctx = _ctx(ctx)
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


def transfer(source_base, target_base, adapter, output_lora=None,
             merged_output=None, stats=None, source_calib=None,
             target_calib=None, target_votes=None, report=None, method="bico",
             alpha=1.0, split=None, ties=None, log=None, **options):
    """What `bico transfer --lora` runs: the adapter folder carried to the
    target as a PEFT folder (output_lora) and/or merged into the target
    checkpoint (merged_output)."""
    from .model import Transfer
    with Transfer(log=log) as t:
        for k, v in (("source_base", source_base), ("target_base", target_base),
                     ("stats", stats), ("source_calib", source_calib),
                     ("target_calib", target_calib),
                     ("target_votes", target_votes), ("report", report),
                     ("output", merged_output)):
            if v is not None:
                t.set_file(k, v)
        for k, v in (("source_adapter", adapter),
                     ("output_adapter", output_lora)):
            if v is not None:
                t.set_file(k, v)
        t.set("method", method)
        t.set("alpha", alpha)
        for k, v in options.items():
            t.set(k, v)
        for suffix, k in (split or {}).items():
            t.add_split(suffix, k)
        for tensor, module in (ties or {}).items():
            t.add_tie(tensor, module)
        t.run()
    return output_lora if output_lora is not None else merged_output
