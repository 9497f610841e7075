"""safetensors files through libbico: the validating reader and the atomic
writer (bico_stfile_*, bico_stwriter_*).

    tensors = bico.safetensors.read("model.safetensors")      # name -> array
    bico.safetensors.write("out.safetensors", tensors, metadata={"k": "v"})

read() returns NumPy arrays in the file's dtype (copies, so they outlive the
file); BF16 has no NumPy dtype and reads as float32 (exact).  A path ending
in ".json" is a sharded checkpoint's index.  write() declares every tensor
in the dtype of its array (float32, float16, float64, integers, bool) or the
one named in dtypes={"name": "BF16"}, writes into a temporary file and
renames it into place only when complete: on any error an existing file at
the path is left as it was.
"""
import ctypes

import numpy as np

from ._core import BicoError, Context, _check, _to_numpy, E_ARG
from ._lib import fn, c_size_t, c_int, c_char_p, c_void_p

F32, F16, BF16, F64, I8, I16, I32, I64, U8, U16, U32, U64, BOOL = range(1, 14)

_NP = {F32: np.float32, F16: np.float16, F64: np.float64, I8: np.int8,
       I16: np.int16, I32: np.int32, I64: np.int64, U8: np.uint8,
       U16: np.uint16, U32: np.uint32, U64: np.uint64, BOOL: np.bool_}
_FROM_NP = {np.dtype(v): k for k, v in _NP.items()}
_NAMES = {"F32": F32, "F16": F16, "BF16": BF16, "F64": F64, "I8": I8,
          "I16": I16, "I32": I32, "I64": I64, "U8": U8, "U16": U16,
          "U32": U32, "U64": U64, "BOOL": BOOL}


def dtype_name(dtype):
    """The safetensors name of a dtype code ("F32", ...)."""
    r = fn.dtype_name(int(dtype))
    return r.decode() if r else None


def _enc(s):
    return s.encode("utf-8")


class File(object):
    """An open, validated safetensors file (or sharded checkpoint).

    Mapping-like: keys(), len(), `in`, f[name] (a NumPy copy), f.info(name)
    -> (dtype name, shape), f.metadata (dict).  close() or `with`.
    """

    def __init__(self, path, ctx=None):
        self.ctx = Context() if ctx is None else ctx
        self.path = str(path)
        self._ptr = None
        h = c_void_p()
        _check(fn.stfile_open(self.ctx._alive(), _enc(self.path),
                              ctypes.byref(h)), self.ctx)
        self._ptr = h.value
        self.ctx._children += 1  # the context outlives the file
        self._index = {}
        self._infos = []
        for i in range(fn.stfile_count(self._ptr)):
            name, dt, nd, shp = (c_char_p(), c_int(), c_size_t(),
                                 ctypes.POINTER(c_size_t)())
            _check(fn.stfile_tensor_info(self._ptr, i, ctypes.byref(name),
                                         ctypes.byref(dt), ctypes.byref(nd),
                                         ctypes.byref(shp)), self.ctx)
            shape = tuple(shp[k] for k in range(nd.value))
            n = name.value.decode("utf-8")
            self._index[n] = i
            self._infos.append((n, dt.value, shape))
        self.metadata = {}
        for i in range(fn.stfile_metadata_count(self._ptr)):
            k, v = c_char_p(), c_char_p()
            _check(fn.stfile_metadata_at(self._ptr, i, ctypes.byref(k),
                                         ctypes.byref(v)), self.ctx)
            self.metadata[k.value.decode("utf-8")] = v.value.decode("utf-8")

    def close(self):
        p, self._ptr = self._ptr, None
        if p:
            fn.stfile_close(p)
            self.ctx._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def keys(self):
        return [n for n, _, _ in self._infos]

    __iter__ = lambda self: iter(self.keys())

    def __len__(self):
        return len(self._infos)

    def __contains__(self, name):
        return name in self._index

    def _find(self, name):
        if not self._ptr:
            raise ValueError("safetensors file %s is closed" % self.path)
        i = c_size_t()
        _check(fn.stfile_find(self._ptr, _enc(name), ctypes.byref(i)),
               self.ctx)
        return i.value

    def info(self, name):
        """(dtype name, shape) of a tensor."""
        _, dt, shape = self._infos[self._find(name)]
        return dtype_name(dt), shape

    def __getitem__(self, name):
        return self.get(name)

    def get(self, name, dtype=None):
        """A tensor as a NumPy array: its own dtype (BF16 as float32), or
        dtype=np.float32 / np.float64 converted by the library."""
        i = self._find(name)
        _, dt, shape = self._infos[i]
        numel = int(np.prod(shape, dtype=np.int64))
        if dtype is not None and np.dtype(dtype) in (np.dtype(np.float32),
                                                     np.dtype(np.float64)):
            out = np.empty(numel, dtype=dtype)
            f = fn.stfile_read_f32 if out.dtype == np.float32 else \
                fn.stfile_read_f64
            _check(f(self._ptr, i, out.ctypes.data, numel), self.ctx)
            return out.reshape(shape)
        if dt == BF16 or dt not in _NP:
            out = np.empty(numel, dtype=np.float32)
            _check(fn.stfile_read_f32(self._ptr, i, out.ctypes.data, numel),
                   self.ctx)
            out = out.reshape(shape)
        else:
            data, nbytes = c_void_p(), c_size_t()
            _check(fn.stfile_data(self._ptr, i, ctypes.byref(data),
                                  ctypes.byref(nbytes)), self.ctx)
            raw = ctypes.string_at(data.value, nbytes.value) if nbytes.value \
                else b""
            out = np.frombuffer(raw, dtype=np.dtype(_NP[dt]).newbyteorder("<"))
            out = out.astype(_NP[dt]).reshape(shape)
        return out if dtype is None else out.astype(dtype)

    def check_finite(self, name):
        _check(fn.stfile_check_finite(self._ptr, self._find(name)), self.ctx)


def open(path, ctx=None):  # noqa: A001 (mirrors the C name)
    return File(path, ctx)


def read(path, dtype=None, with_metadata=False, ctx=None):
    """{name: array} of every tensor (and the metadata dict when asked)."""
    with File(path, ctx) as f:
        out = {n: f.get(n, dtype) for n in f.keys()}
        meta = dict(f.metadata)
    return (out, meta) if with_metadata else out


def write(path, tensors, metadata=None, dtypes=None, ctx=None):
    """Writes {name: array-like} atomically.  dtypes: {name: "BF16"|"F16"|
    "F32"|"F64"} overrides the stored dtype of float tensors (converted by
    the library, round to nearest even)."""
    ctx = Context() if ctx is None else ctx
    dtypes = dict(dtypes or {})
    plan = []
    for name, t in tensors.items():
        want = dtypes.pop(name, None)
        is_bf16 = str(getattr(t, "dtype", "")) == "torch.bfloat16"
        a = _to_numpy(t)
        # (np.ascontiguousarray would turn a 0-d scalar into shape (1,))
        a = a if a.flags.c_contiguous else np.array(a, order="C")
        if want is not None:
            if want not in _NAMES:
                raise BicoError(E_ARG, "safetensors.write: unknown dtype %r "
                                "for %s" % (want, name))
            code = _NAMES[want]
        elif is_bf16:
            code = BF16
        else:
            if a.dtype not in _FROM_NP:
                raise BicoError(E_ARG, "safetensors.write: tensor %s has "
                                "dtype %s, which safetensors cannot hold"
                                % (name, a.dtype))
            code = _FROM_NP[a.dtype]
        plan.append((name, code, a))
    if dtypes:
        raise BicoError(E_ARG, "safetensors.write: dtypes names tensors not "
                        "written: %s" % ", ".join(sorted(dtypes)))
    h = c_void_p()
    _check(fn.stwriter_create(ctx._alive(), _enc(str(path)), ctypes.byref(h)),
           ctx)
    w = h.value
    try:
        for k, v in (metadata or {}).items():
            _check(fn.stwriter_add_metadata(w, _enc(str(k)), _enc(str(v))), ctx)
        for name, code, a in plan:
            shp = (c_size_t * max(a.ndim, 1))(*a.shape)
            _check(fn.stwriter_declare(w, _enc(name), code, a.ndim, shp), ctx)
        for name, code, a in plan:
            if code in (F32, F16, F64) and _FROM_NP.get(a.dtype) == code:
                b = a.astype(a.dtype.newbyteorder("<"), copy=False)
                b = b if b.flags.c_contiguous else np.array(b, order="C")
                _check(fn.stwriter_write_raw(w, _enc(name), b.ctypes.data,
                                             b.nbytes), ctx)
            elif code in (F32, F16, BF16, F64):
                if a.dtype == np.float64:
                    b = a
                    _check(fn.stwriter_write_f64(w, _enc(name), b.ctypes.data,
                                                 b.size), ctx)
                else:
                    b = np.ascontiguousarray(a, dtype=np.float32)
                    _check(fn.stwriter_write_f32(w, _enc(name), b.ctypes.data,
                                                 b.size), ctx)
            else:
                want = np.dtype(_NP[code]).newbyteorder("<")
                b = np.array(a, dtype=want, order="C")
                _check(fn.stwriter_write_raw(w, _enc(name), b.ctypes.data,
                                             b.nbytes), ctx)
        _check(fn.stwriter_commit(w), ctx)
    finally:
        fn.stwriter_free(w)
