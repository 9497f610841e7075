"""include/bico/safetensors.h (and dtype.h): safetensors files through
libbico: the validating reader and the atomic writer (bico_stfile_*,
bico_stwriter_*).

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

from . import _args as A
from ._ctx import Context
from ._handle import _Handle
from ._status import E_ARG, BicoError, check as _check
from ._enums import (DTYPES as _NAMES, NP_OF_DTYPE as _NP,
                     DTYPE_OF_NP as _FROM_NP, FLOAT_DTYPES as _FLOATS)
from ._lib import fn, c_size_t, c_int, c_char_p, c_void_p
from ._status import count as _count

# the dtype codes, as the library numbers them (bico_dtype_from_name)
F32, F16, BF16, F64 = (_NAMES[k] for k in ("F32", "F16", "BF16", "F64"))
I8, I16, I32, I64 = (_NAMES[k] for k in ("I8", "I16", "I32", "I64"))
U8, U16, U32, U64 = (_NAMES[k] for k in ("U8", "U16", "U32", "U64"))
BOOL = _NAMES["BOOL"]


def dtype_name(dtype):
    """The safetensors name of a dtype code ("F32", ...)."""
    r = fn.dtype_name(A.size(dtype, "dtype", hi=2 ** 31 - 1))
    return r.decode() if r else None


def _enc(s, name="name"):
    return A.cstr(s, name)


def _native(a):
    """a in native byte order (the plan below compares native dtypes)."""
    if a.dtype.byteorder not in "=|" and not a.dtype.isnative:
        return a.astype(a.dtype.newbyteorder("="))
    return a


def _exact(a, code, name):
    """a converted to the integer or bool dtype `code` when every value
    converts exactly; an error naming the tensor otherwise."""
    want = _NP[code]
    if a.dtype == want:
        return a
    if want == np.bool_:
        if a.size and not np.all((a == 0) | (a == 1)):
            raise BicoError(E_ARG, "safetensors.write: %s holds values other "
                            "than 0 and 1, which BOOL cannot" % name)
        return a.astype(np.bool_)
    info = np.iinfo(want)
    return A.int_array(a, "safetensors.write: " + name, int(info.min),
                       int(info.max), want)


class File(_Handle):
    """An open, validated safetensors file (or sharded checkpoint).

    Mapping-like: keys(), len(), `in`, f[name] (a NumPy copy), f.info(name)
    -> (dtype name, shape), f.metadata (dict).  close() or `with`.
    """

    _free = staticmethod(fn.stfile_free)

    def __init__(self, path, ctx=None):
        path_b = A.cstr(path, "path", path=True)
        self.ctx = Context() if ctx is None else ctx
        self.path = str(path)
        h = c_void_p()
        _check(fn.stfile_open(self.ctx._alive(), path_b, ctypes.byref(h)),
               self.ctx)
        self._adopt(h.value, self.ctx)   # the context outlives the file
        self._index = {}
        self._infos = []
        for i in range(_count(fn.stfile_count, self._ptr, self.ctx)):
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
        for i in range(_count(fn.stfile_metadata_count, self._ptr,
                              self.ctx)):
            k, v = c_char_p(), c_char_p()
            _check(fn.stfile_metadata_at(self._ptr, i, ctypes.byref(k),
                                         ctypes.byref(v)), self.ctx)
            self.metadata[k.value.decode("utf-8")] = v.value.decode("utf-8")

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

    def get_range(self, name, first, count, dtype=np.float32):
        """Elements [first, first + count) of a tensor in row-major order
        as a 1-D float32 (or float64) array, read without the rest of the
        tensor (bico_stfile_read_f32_range): rows of a large table."""
        i = self._find(name)
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise BicoError(E_ARG, "safetensors.get_range: dtype must be "
                            "float32 or float64, got %s" % dt)
        first = A.size(first, "first")
        count = A.size(count, "count")
        out = np.empty(count, dtype=dt)
        f = fn.stfile_read_f32_range if dt == np.float32 else \
            fn.stfile_read_f64_range
        _check(f(self._ptr, i, first, out.ctypes.data, count), self.ctx)
        return out

    def check_finite(self, name):
        _check(fn.stfile_check_finite(self._ptr, self._find(name)), self.ctx)


    def check_unchanged(self):
        """Refuses (BicoError E_IO naming the file and what changed) a
        file that is no longer what it was when opened: its size,
        modification time, identity or header (bico_stfile_check_unchanged:
        a reader of tensors over a long run checks this before it writes
        what it computed from them)."""
        _check(fn.stfile_check_unchanged(self._alive()), self.ctx)


def open(path, ctx=None):  # noqa: A001 (mirrors the C name)
    return File(path, ctx)


def read(path, dtype=None, with_metadata=False, ctx=None):
    """{name: array} of every tensor (and the metadata dict when asked)."""
    with File(path, ctx) as f:
        out = {n: f.get(n, dtype) for n in f.keys()}
        meta = dict(f.metadata)
    return (out, meta) if with_metadata else out


class Writer(_Handle):
    """A safetensors file or model folder written a tensor at a time
    (bico_stwriter): declare every tensor first, then write each once in
    any order, then commit; nothing appears at path until the commit (the
    file or the whole folder is renamed or swapped in), and close() before
    it removes what was written.  The folder rule is write()'s (path an
    existing folder, ending in "/", or like a folder).

        w = Writer("out/", like="B/", metadata={"k": "v"})
        w.declare("model.norm.weight", "BF16", (1536,))
        w.write("model.norm.weight", array)    # converted to the dtype
        w.commit()
    """

    _free = staticmethod(fn.stwriter_free)

    def __init__(self, path, like=None, metadata=None, max_shard_size=0,
                 ctx=None):
        path_b = A.cstr(path, "path", path=True)
        like_b = None if like is None else A.cstr(like, "like", path=True)
        max_shard_size = A.size(max_shard_size, "max_shard_size")
        self.ctx = Context() if ctx is None else ctx
        self._codes = {}
        h = c_void_p()
        if fn.stwriter_output_is_folder(path_b, like_b):
            _check(fn.stwriter_create_folder(self.ctx._alive(), path_b,
                                             like_b, max_shard_size,
                                             ctypes.byref(h)), self.ctx)
        else:
            _check(fn.stwriter_create(self.ctx._alive(), path_b,
                                      ctypes.byref(h)), self.ctx)
        self._adopt(h.value, self.ctx)
        try:
            for k, v in (metadata or {}).items():
                _check(fn.stwriter_add_metadata(
                    self._ptr, A.cstr(str(k), "metadata key"),
                    A.cstr(str(v), "metadata value")), self.ctx)
        except BaseException:
            self.close()
            raise

    def declare(self, name, dtype, shape):
        """A tensor: name, dtype ("F32", "BF16", ... or a code) and shape,
        laid out in declaration order."""
        code = _NAMES.get(dtype) if isinstance(dtype, str) else dtype
        if code is None:
            raise BicoError(E_ARG, "safetensors.Writer: unknown dtype %r for "
                            "%s (known: %s)" % (dtype, name,
                                                ", ".join(sorted(_NAMES))))
        shape = tuple(int(x) for x in shape)
        shp = (c_size_t * max(len(shape), 1))(*shape)
        _check(fn.stwriter_declare(self._alive(), _enc(name, "tensor name"),
                                   code, len(shape), shp), self.ctx)
        self._codes[name] = code

    def write(self, name, t):
        """A declared tensor's values (NumPy or torch; a float tensor is
        converted to the declared float dtype, round to nearest even;
        integers and bool are taken when they convert exactly)."""
        if name not in self._codes:
            raise BicoError(E_ARG, "safetensors.Writer: %s was not declared"
                            % name)
        code = self._codes[name]
        nm = _enc(name, "tensor name")
        a = _native(A.real(t, name))
        a = a if a.flags.c_contiguous else np.array(a, order="C")
        w = self._alive()
        if code in _FLOATS and _FROM_NP.get(a.dtype) == code:
            b = a.astype(a.dtype.newbyteorder("<"), copy=False)
            _check(fn.stwriter_write_raw(w, nm, b.ctypes.data, b.nbytes),
                   self.ctx)
        elif code in _FLOATS:
            if a.dtype == np.float64:
                _check(fn.stwriter_write_f64(w, nm, a.ctypes.data, a.size),
                       self.ctx)
            else:
                b = np.ascontiguousarray(a, dtype=np.float32)
                _check(fn.stwriter_write_f32(w, nm, b.ctypes.data, b.size),
                       self.ctx)
        else:
            b = np.array(_exact(a, code, name),
                         dtype=np.dtype(_NP[code]).newbyteorder("<"),
                         order="C")
            _check(fn.stwriter_write_raw(w, nm, b.ctypes.data, b.nbytes),
                   self.ctx)

    def write_range(self, name, first, t):
        """Elements [first, first + t.size) of a declared float tensor, in
        row-major order (bico_stwriter_write_f32_range / _f64_range:
        pieces go in order, each where the last ended); float64 values
        are converted from double, anything else from float32."""
        if name not in self._codes:
            raise BicoError(E_ARG, "safetensors.Writer: %s was not declared"
                            % name)
        a = _native(A.real(t, name))
        nm = _enc(name, "tensor name")
        first = A.size(first, "first")
        if a.dtype == np.float64:
            b = np.ascontiguousarray(a)
            f = fn.stwriter_write_f64_range
        else:
            b = np.ascontiguousarray(a, dtype=np.float32)
            f = fn.stwriter_write_f32_range
        _check(f(self._alive(), nm, first, b.ctypes.data, b.size), self.ctx)

    def commit(self):
        """Renames (or swaps) the output into place; then close().  close()
        (or garbage collection) before a commit frees the writer and
        removes what was written."""
        _check(fn.stwriter_commit(self._alive()), self.ctx)
        self.close()


def write(path, tensors, metadata=None, dtypes=None, ctx=None, like=None,
          max_shard_size=0):
    """Writes {name: array-like} atomically.  Each tensor is stored in its
    own dtype (torch bfloat16 as BF16, float16 as F16, big-endian arrays
    as their native counterpart); dtypes: {name: "BF16"|"F16"|"F32"|"F64"}
    overrides that for float tensors (converted by the library, round to
    nearest even); an integer or BOOL dtype is taken only when every value
    converts exactly.  Names and metadata may not contain NUL characters.

    A Hugging Face model folder instead of one file when path is an
    existing folder, ends in "/", or like (a model folder or file) is a
    folder and path ends neither in ".safetensors" nor ".json" (the
    library's bico_stwriter_output_is_folder): sharded as like is (its non-weight
    files copied), or greedily by max_shard_size bytes, with
    model.safetensors.index.json; every file committed together."""
    path_b = A.cstr(path, "path", path=True)
    like_b = None if like is None else A.cstr(like, "like", path=True)
    max_shard_size = A.size(max_shard_size, "max_shard_size")
    if not hasattr(tensors, "items"):
        raise TypeError("safetensors.write: tensors must be a mapping "
                        "{name: array}")
    dtypes = dict(dtypes or {})
    meta = [(A.cstr(str(k), "metadata key"), A.cstr(str(v), "metadata value"))
            for k, v in (metadata or {}).items()]
    plan = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError("safetensors.write: tensor names must be str, "
                            "got %r" % (name,))
        nm = _enc(name, "tensor name")
        want = dtypes.pop(name, None)
        is_bf16 = str(getattr(t, "dtype", "")) == "torch.bfloat16"
        a = _native(A.real(t, name))
        # (np.ascontiguousarray would turn a 0-d scalar into shape (1,))
        a = a if a.flags.c_contiguous else np.array(a, order="C")
        if want is not None:
            if want not in _NAMES:
                raise BicoError(E_ARG, "safetensors.write: unknown dtype %r "
                                "for %s (known: %s)"
                                % (want, name, ", ".join(sorted(_NAMES))))
            code = _NAMES[want]
            if a.dtype.kind not in "biuf":
                raise BicoError(E_ARG, "safetensors.write: tensor %s has "
                                "dtype %s, which safetensors cannot hold"
                                % (name, a.dtype))
            if code not in _FLOATS:
                a = _exact(a, code, name)
        elif is_bf16:
            code = BF16
        else:
            if a.dtype not in _FROM_NP:
                raise BicoError(E_ARG, "safetensors.write: tensor %s has "
                                "dtype %s, which safetensors cannot hold"
                                % (name, a.dtype))
            code = _FROM_NP[a.dtype]
        plan.append((name, nm, code, a))
    if dtypes:
        raise BicoError(E_ARG, "safetensors.write: dtypes names tensors not "
                        "written: %s" % ", ".join(sorted(dtypes)))
    ctx = Context() if ctx is None else ctx
    h = c_void_p()
    if fn.stwriter_output_is_folder(path_b, like_b):
        _check(fn.stwriter_create_folder(ctx._alive(), path_b, like_b,
                                         max_shard_size, ctypes.byref(h)), ctx)
    else:
        _check(fn.stwriter_create(ctx._alive(), path_b, ctypes.byref(h)), ctx)
    w = h.value
    try:
        for k, v in meta:
            _check(fn.stwriter_add_metadata(w, k, v), ctx)
        for name, nm, code, a in plan:
            shp = (c_size_t * max(a.ndim, 1))(*a.shape)
            _check(fn.stwriter_declare(w, nm, code, a.ndim, shp), ctx)
        for name, nm, code, a in plan:
            if code in _FLOATS and _FROM_NP.get(a.dtype) == code:
                b = a.astype(a.dtype.newbyteorder("<"), copy=False)
                b = b if b.flags.c_contiguous else np.array(b, order="C")
                _check(fn.stwriter_write_raw(w, nm, b.ctypes.data, b.nbytes),
                       ctx)
            elif code in _FLOATS:
                if a.dtype == np.float64:
                    _check(fn.stwriter_write_f64(w, nm, a.ctypes.data,
                                                 a.size), ctx)
                else:
                    b = np.ascontiguousarray(a, dtype=np.float32)
                    _check(fn.stwriter_write_f32(w, nm, b.ctypes.data,
                                                 b.size), ctx)
            else:
                want = np.dtype(_NP[code]).newbyteorder("<")
                b = np.array(a, dtype=want, order="C")
                _check(fn.stwriter_write_raw(w, nm, b.ctypes.data, b.nbytes),
                       ctx)
        _check(fn.stwriter_commit(w), ctx)
    finally:
        fn.stwriter_free(w)
