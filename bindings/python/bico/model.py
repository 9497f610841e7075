"""include/bico/model.h: model graphs (bico_model), tensors grouped into
modules and the pairing of a target's names with a source's.

    m = bico.Model.open("vit.safetensors")
    m.modules()      # [(name, kind, block, [tensor names])]

The whole-model driver is bico.transfer (Transfer, transfer_files) and the
statistics files bico._stats (stats_from_calib, stats_merge); both are
also importable from here, where they were before.
"""
import ctypes

from . import _args as A
from . import safetensors as _st
from ._ctx import Context
from ._enums import (choose, MODULE_KINDS as KINDS, TENSOR_ROLES as ROLES,
                     METHODS, TRANSFER_FILES as FILES,
                     TRANSFER_PARAMS as PARAMS, DTYPE_NAMES)
from ._handle import _Handle
from ._lib import fn, c_size_t, c_int, c_long, c_char_p, c_void_p
from ._stats import stats_from_calib, stats_merge
from ._status import check as _check, count as _count
from .transfer import Transfer, transfer_files

__all__ = ["Model", "Transfer", "transfer_files", "stats_from_calib",
           "stats_merge", "KINDS", "ROLES", "METHODS", "FILES", "PARAMS"]


def _enc(s, name="name"):
    return A.cstr(s, name)


def _dec(b):
    return b.decode("utf-8") if b is not None else None


class Model(_Handle):
    """bico_model: tensors grouped into modules, the block container, and
    the pairing of a target's names with a source's (include/bico/model.h).

    Model.open(path) reads names, shapes and dtypes of a safetensors file
    (or sharded index); Model.from_shapes({name: shape}) registers them."""
    _free = staticmethod(fn.model_free)

    def __init__(self, ctx=None):
        ctx = Context() if ctx is None else ctx
        h = c_void_p()
        _check(fn.model_create(ctx._alive(), ctypes.byref(h)), ctx)
        self._adopt(h.value, ctx)

    @classmethod
    def open(cls, path, ctx=None):
        ctx = Context() if ctx is None else ctx
        with _st.File(path, ctx) as f:
            h = c_void_p()
            _check(fn.model_from_stfile(ctx._alive(), f._ptr,
                                        ctypes.byref(h)), ctx)
        o = cls.__new__(cls)
        o._adopt(h.value, ctx)
        return o

    @classmethod
    def from_shapes(cls, shapes, ctx=None):
        """shapes: {name: shape} (a state dict's {k: v.shape} will do)."""
        m = cls(ctx)
        for name, shape in shapes.items():
            m.add_tensor(name, tuple(getattr(shape, "shape", shape)))
        return m

    def add_tensor(self, name, shape, dtype=0):
        """Registers a tensor: name, shape and dtype (a safetensors dtype
        name or code; 0: unknown)."""
        nm = _enc(name)
        shape = A.sizes(shape, "shape")
        if isinstance(dtype, str) or dtype != 0:
            dtype = choose({v: k for k, v in DTYPE_NAMES.items()}, dtype,
                           "dtype")
        arr = (c_size_t * max(len(shape), 1))(*shape)
        _check(fn.model_add_tensor(self._alive(), nm, dtype, len(shape), arr),
               self.ctx)

    def set_blocks(self, prefix):
        _check(fn.model_set_blocks(self._alive(), None if prefix is None
                                   else _enc(prefix, "prefix")), self.ctx)

    def tensors(self):
        """[(name, shape, module name, role)]."""
        out = []
        for i in range(_count(fn.model_tensor_count, self._alive(),
                              self.ctx)):
            name, nd, shp = c_char_p(), c_size_t(), ctypes.POINTER(c_size_t)()
            _check(fn.model_tensor(self._ptr, i, ctypes.byref(name), None,
                                   ctypes.byref(nd), ctypes.byref(shp)),
                   self.ctx)
            mod, role = c_size_t(), c_int()
            _check(fn.model_tensor_module(self._ptr, i, ctypes.byref(mod),
                                          ctypes.byref(role)), self.ctx)
            out.append((_dec(name.value), tuple(shp[k] for k in range(
                nd.value)), self._module_name(mod.value),
                ROLES.get(role.value, role.value)))
        return out

    def _module_name(self, i):
        name = c_char_p()
        _check(fn.model_module(self._ptr, i, ctypes.byref(name), None, None,
                               None), self.ctx)
        return _dec(name.value)

    def modules(self):
        """[(name, kind, block index or -1, [tensor names])]."""
        out = []
        for i in range(_count(fn.model_module_count, self._alive(),
                              self.ctx)):
            name, kind, block, nt = c_char_p(), c_int(), c_long(), c_size_t()
            _check(fn.model_module(self._ptr, i, ctypes.byref(name),
                                   ctypes.byref(kind), ctypes.byref(block),
                                   ctypes.byref(nt)), self.ctx)
            ts = []
            for k in range(nt.value):
                ti = c_size_t()
                _check(fn.model_module_tensor(self._ptr, i, k,
                                              ctypes.byref(ti)), self.ctx)
                tn = c_char_p()
                _check(fn.model_tensor(self._ptr, ti.value, ctypes.byref(tn),
                                       None, None, None), self.ctx)
                ts.append(_dec(tn.value))
            out.append((_dec(name.value), KINDS.get(kind.value, kind.value),
                        block.value, ts))
        return out

    def module_dims(self, name):
        """(d_out, d_in) of a linear or element-wise module."""
        i = c_size_t()
        _check(fn.model_find_module(self._alive(), _enc(name),
                                    ctypes.byref(i)), self.ctx)
        do, di = c_size_t(), c_size_t()
        _check(fn.model_module_dims(self._ptr, i.value, ctypes.byref(do),
                                    ctypes.byref(di)), self.ctx)
        return do.value, di.value

    def blocks(self):
        """(container prefix or None, block count)."""
        p, n = c_char_p(), c_size_t()
        _check(fn.model_blocks(self._alive(), ctypes.byref(p),
                               ctypes.byref(n)), self.ctx)
        return _dec(p.value), n.value

    def source_name(self, source, name):
        """The source name paired with target name `name` (self is the
        target)."""
        if not isinstance(source, Model):
            raise TypeError("source_name: source must be a bico.model.Model")
        nm = _enc(name)
        n = c_size_t()
        cap = len(nm) + 64
        while True:
            buf = ctypes.create_string_buffer(cap)
            st = fn.model_map_name(self._alive(), source._alive(), nm,
                                   buf, cap, ctypes.byref(n))
            if st == 0:
                return _dec(buf.value)
            if n.value + 1 > cap:
                cap = n.value + 1
                continue
            _check(st, self.ctx)
