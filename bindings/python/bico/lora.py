"""include/bico/lora.h: LoRA adapters, thin ctypes wrappers over the C
API; see docs/lora.md.  Task merging (merge.h) is bico.merge; its
merge_tensors, merge and merge_check are importable from here too.

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

from . import _args as A
from ._ctx import Context, _or_default
from ._enums import (choose, LORA_KINDS, LORA_PARAMS, LORA_STRINGS,
                     TRANSFER_FILES)
from ._handle import _Handle
from ._lib import fn, c_size_t, c_int, c_double, c_float, c_char_p, c_void_p
from ._status import E_SHAPE, BicoError, check as _check
from ._status import count as _count
from .merge import merge, merge_check, merge_tensors  # noqa: F401
from .transfer import Transfer, _configure

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
        for i in range(_count(fn.lora_module_count, self._alive(),
                              self.ctx)):
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
        for i in range(_count(fn.lora_saved_count, self._alive(),
                              self.ctx)):
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
                                  b.shape[0], a.shape[1],
                                  A.scalar_f64(alpha, "alpha"), _p(b), _p(a)),
               self.ctx)

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
    ctx = _or_default(ctx)
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
    ctx = _or_default(ctx)
    d = _f32(dense, "dense")
    m, n = d.shape
    rank = A.size(rank, "rank", lo=1)
    scale = A.scalar_f64(scale, "scale")
    bo = np.empty((m, rank), np.float32)
    ao = np.empty((rank, n), np.float32)
    e = c_double()
    _check(fn.lora_truncate(ctx._alive(), m, n, rank, scale, _p(d), max(n, 1),
                            _p(bo), _p(ao), ctypes.byref(e)), ctx)
    return bo, ao, e.value


def transfer(source_base, target_base, adapter, output_lora=None,
             merged_output=None, stats=None, source_calib=None,
             target_calib=None, target_votes=None, report=None, method="bico",
             alpha=1.0, split=None, ties=None, log=None, **options):
    """What `bico transfer --lora` runs: the adapter folder carried to the
    target as a PEFT folder (output_lora) and/or merged into the target
    checkpoint (merged_output)."""
    with Transfer(log=log) as t:
        _configure(t, (("source_base", source_base),
                       ("target_base", target_base), ("stats", stats),
                       ("source_calib", source_calib),
                       ("target_calib", target_calib),
                       ("target_votes", target_votes), ("report", report),
                       ("output", merged_output),
                       ("source_adapter", adapter),
                       ("output_adapter", output_lora)),
                   method, alpha, options, split, ties)
        t.run()
    return output_lora if output_lora is not None else merged_output
