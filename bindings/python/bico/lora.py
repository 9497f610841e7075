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
import os

import numpy as np

from ._core import BicoError, Context, _Handle, _check, _ctx, E_ARG
from ._lib import lib, c_size_t, c_int, c_double, c_float, c_char_p, c_void_p

P = ctypes.POINTER
# The prototypes of lora.h and merge.h live with all others in _lib.
from ._lib import fn  # noqa: E402



LINEAR, EMBEDDING = 1, 2
KINDS = {LINEAR: "linear", EMBEDDING: "embedding"}
_FLAGS = {"rslora": 1, "fan_in_fan_out": 2}
_STRINGS = {"task_type": 1, "base_model": 2}
_MERGE_METHODS = {"linear": 1, "task_arithmetic": 1, "ties": 2}
_MERGE_INPUTS = {"task_vector": 1, "tuned": 2, "lora": 3}
FILE_LORA, FILE_LORA_OUTPUT = 12, 13


def _enc(s):
    return os.fspath(s).encode("utf-8")


def _f32(x, name):
    a = np.ascontiguousarray(np.asarray(x), dtype=np.float32)
    if a.ndim != 2:
        raise BicoError(E_ARG, "%s must be 2-D, got shape %s" % (name, a.shape))
    return a


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
        v = c_int()
        _check(fn.lora_get_flag(self._alive(), _FLAGS[name], ctypes.byref(v)),
               self.ctx)
        return bool(v.value)

    def set_flag(self, name, on):
        _check(fn.lora_set_flag(self._alive(), _FLAGS[name], int(bool(on))),
               self.ctx)

    def string(self, name):
        v = c_char_p()
        _check(fn.lora_get_string(self._alive(), _STRINGS[name],
                                  ctypes.byref(v)), self.ctx)
        return v.value.decode() if v.value is not None else None

    def set_string(self, name, value):
        _check(fn.lora_set_string(self._alive(), _STRINGS[name],
                                  None if value is None else value.encode()),
               self.ctx)

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
        b, a = _f32(b, "b"), _f32(a, "a")
        k = {v: key for key, v in KINDS.items()}[kind]
        _check(fn.lora_add_module(self._alive(), name.encode(), k, a.shape[0],
                                  float(alpha), b.shape[0], a.shape[1], _p(b),
                                  _p(a)), self.ctx)

    def add_saved(self, name, module, array):
        x = np.ascontiguousarray(np.asarray(array), dtype=np.float32)
        shape = (c_size_t * max(x.ndim, 1))(*x.shape)
        _check(fn.lora_add_saved(self._alive(), name.encode(), module.encode(),
                                 x.ndim, ctypes.cast(shape, c_void_p), _p(x)),
               self.ctx)

    def save(self, folder):
        _check(fn.lora_save(self._alive(), _enc(folder)), self.ctx)


def transport(b, a, r_out=None, r_in=None, alpha=1.0, d_out=None, d_in=None,
              ctx=None):
    """Factored BiCo: (alpha R_out^T B, A R_in).  r_out may be a list of k
    block maps (fused qkv); None entries, or None, are the rectangular
    identity (then d_out / d_in give the target widths)."""
    ctx = _ctx(ctx)
    b, a = _f32(b, "b"), _f32(a, "a")
    rank, dout_a, din_a = a.shape[0], b.shape[0], a.shape[1]
    routs = r_out if isinstance(r_out, (list, tuple)) else [r_out]
    routs = [None if r is None else _f32(r, "r_out") for r in routs]
    k = len(routs)
    bb = next((r.shape[1] for r in routs if r is not None), None)
    dout_b = bb * k if bb is not None else (d_out or dout_a)
    ri = None if r_in is None else _f32(r_in, "r_in")
    din_b = ri.shape[1] if ri is not None else (d_in or din_a)
    arr = (c_void_p * k)(*[None if r is None else r.ctypes.data for r in routs])
    bo = np.empty((dout_b, rank), np.float32)
    ao = np.empty((rank, din_b), np.float32)
    _check(fn.lora_transport(ctx._alive(), rank, k, dout_a, din_a, _p(b), _p(a),
                             ctypes.cast(arr, c_void_p), dout_b // k, dout_b,
                             _p(ri), din_b, din_b, float(alpha), _p(bo),
                             _p(ao)), ctx)
    return bo, ao


def truncate(dense, rank, scale=1.0, ctx=None):
    """Best rank-r factors: scale B A ~= dense.  -> (B, A, energy kept)."""
    ctx = _ctx(ctx)
    d = _f32(dense, "dense")
    m, n = d.shape
    bo = np.empty((m, rank), np.float32)
    ao = np.empty((rank, n), np.float32)
    e = c_double()
    _check(fn.lora_truncate(ctx._alive(), m, n, _p(d), n, rank, float(scale),
                            _p(bo), _p(ao), ctypes.byref(e)), ctx)
    return bo, ao, e.value


def merge_tensors(taus, weights, densities=None, method="linear",
                  normalize=None, ctx=None):
    """bico_merge_tensor over same-shaped arrays; normalize None: the
    method's default (TIES yes, linear no)."""
    ctx = _ctx(ctx)
    xs = [np.ascontiguousarray(np.asarray(t), dtype=np.float32) for t in taus]
    shape = xs[0].shape
    m = _MERGE_METHODS[method]
    if normalize is None:
        normalize = m == 2
    ptrs = (c_void_p * len(xs))(*[x.ctypes.data for x in xs])
    w = np.asarray(weights, np.float64)
    d = None if densities is None else np.asarray(densities, np.float64)
    out = np.empty(shape, np.float32)
    _check(fn.merge_tensor(ctx._alive(), m, len(xs), out.size,
                           ctypes.cast(ptrs, c_void_p), _p(w), _p(d),
                           int(bool(normalize)), _p(out)), ctx)
    return out


def merge(base, inputs, output, method="linear", alpha=1.0, normalize=None,
          delta_output=None, report=None, ctx=None):
    """What `bico merge` runs.  inputs: (kind, path, weight, density) with
    kind "task_vector", "tuned" or "lora"."""
    ctx = Context() if ctx is None else ctx
    h = c_void_p()
    _check(fn.merge_create(ctx._alive(), ctypes.byref(h)), ctx)
    try:
        for which, path in ((1, base), (2, output), (3, delta_output),
                            (4, report)):
            if path is not None:
                _check(fn.merge_set_file(h, which, _enc(path)), ctx)
        _check(fn.merge_set_param(h, 1, _MERGE_METHODS[method]), ctx)
        _check(fn.merge_set_param(h, 2, float(alpha)), ctx)
        _check(fn.merge_set_param(h, 3, -1 if normalize is None
                                  else int(bool(normalize))), ctx)
        for kind, path, weight, density in inputs:
            _check(fn.merge_add_input(h, _MERGE_INPUTS[kind], _enc(path),
                                      float(weight), float(density)), ctx)
        _check(fn.merge_run(h), ctx)
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
        for slot, v in ((FILE_LORA, adapter), (FILE_LORA_OUTPUT, output_lora)):
            if v is not None:
                _check(fn.transfer_set_file(t._alive(), slot, _enc(v)), t.ctx)
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
