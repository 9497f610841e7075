"""bico.llm.runtime: decoders run a block at a time from their folders.

The pieces every streamed route (bico.llm.stream.fit) is made of:

  Folder      a model folder opened with libbico's reader: config, tensor
              names and shapes, one block's tensors read when the block
              runs (converted to the compute dtype), rows of the
              embedding, the head; nothing else is held.
  SpillStore  tensors kept by key (the calibration windows' hidden states
              at block boundaries, their gradients, fitted blocks): in
              memory up to a budget, beyond it in a temporary file that
              has no name (O_TMPFILE, or unlinked at once), so the kernel
              frees it however the process ends, SIGKILL included.
  stages      a decoder layer's forward in the stages the fit needs (the
              inputs of q/k/v, o, gate/up and down, the residuals, the
              output), the operations of DecoderLayer.forward in its order.

Memory never depends on the depth: what grows with it goes to the store.
"""
import ctypes
import errno
import os
import signal
import tempfile

import numpy as np
import torch

from .._status import BicoError, E_ARG, E_IO, E_NOTFOUND
from .. import safetensors as _st
from . import families as _fam

__all__ = ["Folder", "SpillStore", "stages", "spill_folder",
           "DEFAULT_BUDGET"]

# bytes of spilled tensors kept in memory before the store writes to disk
DEFAULT_BUDGET = 64 << 20


# ---- the spill store ----

class SpillStore(object):
    """put(key, tensor) / get(key) / pop(key): tensors (any dtype) kept
    in memory while the total stays within budget bytes (a device's
    tensor on its device: get returns it there), the rest in
    one temporary file in `folder` (None: $TMPDIR) that never has a name:
    opened with O_TMPFILE where the file system allows it, else created
    and unlinked at once (tempfile.TemporaryFile), so nothing is left
    behind by a success, a failure or any signal.  Space freed by pop is
    reused by the next entry of the same size.  get returns a tensor the
    caller owns (a new one for a spilled entry; the stored one otherwise:
    do not modify it in place; a spilled entry comes back on the CPU)."""

    def __init__(self, budget=DEFAULT_BUDGET, folder=None):
        self.budget = int(budget)
        self.folder = folder
        self.mem = {}     # key -> tensor
        self.disk = {}    # key -> (offset, nbytes, dtype, shape)
        self.free = {}    # nbytes -> [offsets]
        self.used = 0     # bytes held in memory
        self.end = 0      # file size
        self.written = 0  # bytes written to the file, in all
        self.peak_file = 0
        self._f = None

    def _file(self):
        if self._f is None:
            try:
                self._f = tempfile.TemporaryFile(dir=self.folder,
                                                 prefix=".bico-spill-")
            except OSError as e:
                raise BicoError(E_IO, "spill: cannot create a temporary file "
                                "in %s (%s); give another folder (--spill-dir)"
                                % (self.folder or tempfile.gettempdir(), e))
        return self._f.fileno()

    def __contains__(self, key):
        return key in self.mem or key in self.disk

    def put(self, key, t):
        """Keeps t under key (replacing what was there)."""
        self.pop(key)
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        nb = t.numel() * t.element_size()
        if self.used + nb <= self.budget:
            self.mem[key] = t
            self.used += nb
            return
        off = self._slot(nb)
        _pwrite_all(self._file(), _bytes_view(t.cpu()), off, self.folder)
        self.written += nb
        self.disk[key] = (off, nb, t.dtype, tuple(t.shape))

    def _slot(self, nb):
        """The file offset of nb bytes: a freed slot of that size, else
        the end of the file (which grows)."""
        slots = self.free.get(nb)
        if slots:
            return slots.pop()
        off, self.end = self.end, self.end + nb
        self.peak_file = max(self.peak_file, self.end)
        return off

    def reserve(self, key, shape, dtype):
        """Room for a tensor written a piece of rows at a time
        (write_rows), in memory or in the file as put would place it."""
        self.pop(key)
        shape = tuple(int(x) for x in shape)
        nb = int(np.prod(shape, dtype=np.int64)) * \
            torch.empty((), dtype=dtype).element_size()
        if self.used + nb <= self.budget:
            self.mem[key] = torch.empty(shape, dtype=dtype)
            self.used += nb
            return
        self.disk[key] = (self._slot(nb), nb, dtype, shape)

    def write_rows(self, key, r0, t):
        """Rows r0 .. r0+len(t) of a reserved (or stored) 2-D tensor."""
        if key in self.mem:
            self.mem[key][r0:r0 + len(t)] = t
            return
        off, nb, dt, shape = self.disk[key]
        t = t.detach().to("cpu", dt).contiguous()
        width = shape[1] * t.element_size()
        _pwrite_all(self._file(), _bytes_view(t), off + r0 * width,
                    self.folder)
        self.written += t.numel() * t.element_size()

    def slice(self, key, r0, r1):
        """Rows r0 .. r1 of a stored 2-D tensor (reading only those)."""
        if key in self.mem:
            return self.mem[key][r0:r1]
        off, nb, dt, shape = self.disk[key]
        out = torch.empty((r1 - r0, shape[1]), dtype=dt)
        width = shape[1] * out.element_size()
        _pread_all(self._f.fileno(), _bytes_view(out), off + r0 * width)
        return out

    def get(self, key):
        if key in self.mem:
            return self.mem[key]
        if key not in self.disk:
            raise KeyError(key)
        off, nb, dt, shape = self.disk[key]
        out = torch.empty(shape, dtype=dt)
        _pread_all(self._f.fileno(), _bytes_view(out), off)
        return out

    def rows(self, key, ids):
        """Rows ids (a 1-D int tensor) of a stored 2-D tensor, reading only
        those rows of a spilled one."""
        if key in self.mem:
            return self.mem[key][ids]
        off, nb, dt, shape = self.disk[key]
        width = shape[1] * torch.empty((), dtype=dt).element_size()
        out = torch.empty((len(ids), shape[1]), dtype=dt)
        view = _bytes_view(out)
        fd = self._f.fileno()
        for j, i in enumerate(ids.tolist()):
            _pread_all(fd, view[j * width:(j + 1) * width], off + i * width)
        return out

    def pop(self, key):
        if key in self.mem:
            t = self.mem.pop(key)
            self.used -= t.numel() * t.element_size()
        elif key in self.disk:
            off, nb, _, _ = self.disk.pop(key)
            self.free.setdefault(nb, []).append(off)

    def keys(self):
        return list(self.mem) + list(self.disk)

    def shape(self, key):
        """The shape of a stored tensor (nothing read)."""
        if key in self.mem:
            return tuple(self.mem[key].shape)
        return self.disk[key][3]

    def close(self):
        self.mem.clear()
        self.disk.clear()
        self.free.clear()
        self.used = 0
        f, self._f = self._f, None
        if f is not None:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _bytes_view(t):
    """A writable byte view of a contiguous CPU tensor's storage."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    buf = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    return memoryview(buf).cast("B")


def _pwrite_all(fd, view, off, folder=None):
    while len(view):
        try:
            n = os.pwrite(fd, view, off)
        except OSError as e:
            n, err = -1, e
        else:
            err = OSError(errno.EIO, os.strerror(errno.EIO))
        if n <= 0:
            why = "no space left on the device" if err.errno == \
                errno.ENOSPC else "the disk quota is used up" if \
                err.errno == errno.EDQUOT else err.strerror or str(err)
            raise BicoError(E_IO, "spill: the streamed run's data beyond "
                            "its memory budget (--memory-budget) go to a "
                            "temporary file in %s: %s; free space there, or "
                            "give another folder (--spill-dir)"
                            % (folder or tempfile.gettempdir(), why))
        view, off = view[n:], off + n


def _pread_all(fd, view, off):
    while len(view):
        n = os.preadv(fd, [view], off)
        if n <= 0:
            raise BicoError(E_IO, "spill: the temporary file ended early")
        view, off = view[n:], off + n


def spill_folder(output, inputs, given=None):
    """Where spilled data go: `given` (--spill-dir), else the folder that
    holds the output (same file system as the result), else $TMPDIR;
    never inside an input folder."""
    def inside(p, folder):
        p, folder = os.path.realpath(p), os.path.realpath(folder)
        return p == folder or p.startswith(folder.rstrip(os.sep) + os.sep)
    if given is not None:
        if not os.path.exists(given):
            raise BicoError(E_NOTFOUND, "no such folder (the spill folder "
                            "must exist)")
        if not os.path.isdir(given):
            raise BicoError(E_ARG, "not a folder (the spill folder holds "
                            "temporary files)")
        if not os.access(given, os.W_OK | os.X_OK):
            raise BicoError(E_ARG, "this user cannot write in it")
        for f in inputs:
            if f and inside(given, f):
                raise BicoError(E_ARG, "lies inside the input folder %s: "
                                "temporary files never go into an input; "
                                "give another folder" % f)
        return given
    cands = []
    if output:
        cands.append(os.path.dirname(os.path.abspath(
            str(output).rstrip(os.sep))) or ".")
    cands.append(tempfile.gettempdir())
    for c in cands:
        if os.path.isdir(c) and os.access(c, os.W_OK | os.X_OK) and \
                not any(f and inside(c, f) for f in inputs):
            return c
    return tempfile.gettempdir()


# ---- a model folder, read a block at a time ----

_NP_OF = {torch.float64: np.float64}


class Folder(object):
    """A Hugging Face decoder folder (load_model's families) read through
    libbico's reader: .cfg (stream_config), .shapes {name: shape},
    .dtypes {name: file dtype name}, .names (the reader's order); block(i)
    reads layer i's tensors, tensor(name) one tensor, rows(name, ids)
    rows of a 2-D one, all converted to the compute dtype as load_model
    converts them (dtype None: the file's)."""

    def __init__(self, path, dtype=None, ctx=None):
        self.path = str(path)
        self.dtype = dtype
        self.file = _st.open(_fam._weights_path(self.path), ctx)
        self.names = list(self.file.keys())
        self.shapes, self.dtypes = {}, {}
        for n in self.names:
            dt, shape = self.file.info(n)
            self.dtypes[n], self.shapes[n] = dt, tuple(shape)
        self.cfg = _fam.stream_config(self.path, self.shapes)
        self.L = self.cfg["L"]
        self.d = self.cfg["d"]

    def close(self):
        self.file.close()

    def check_unchanged(self):
        """Refuses (BicoError E_IO) a folder whose weight files changed
        since they were opened (bico.safetensors.File.check_unchanged): a
        run that reads them a block at a time checks this before it
        writes what it computed from them."""
        self.file.check_unchanged()

    def _want(self, name):
        dt = self.dtypes[name]
        want = self.dtype if self.dtype is not None else \
            _fam._TORCH_DT.get(dt)
        if want is None:
            raise BicoError(_fam.E_FORMAT, "load_model: %s: tensor %s has "
                            "dtype %s, not a float" % (self.path, name, dt))
        return want

    def tensor(self, name):
        if name not in self.shapes:
            raise BicoError(E_NOTFOUND, "%s has no tensor %s"
                            % (self.path, name))
        want = self._want(name)
        a = self.file.get(name, _NP_OF.get(want, np.float32))
        return torch.from_numpy(a).to(want)

    def rows(self, name, ids):
        """Rows ids (1-D int64) of 2-D tensor name, reading those rows
        only (one range read per run of consecutive ids)."""
        want = self._want(name)
        rows, width = self.shapes[name]
        npdt = _NP_OF.get(want, np.float32)
        uniq = torch.unique(ids)
        out = np.empty((len(uniq), width), dtype=npdt)
        u = uniq.tolist()
        if u and (u[0] < 0 or u[-1] >= rows):
            raise BicoError(E_ARG, "%s: token id %d is outside the "
                            "vocabulary of %d rows" % (
                                self.path, u[0] if u[0] < 0 else u[-1],
                                rows))
        j = 0
        while j < len(u):
            k = j + 1
            while k < len(u) and u[k] == u[k - 1] + 1:
                k += 1
            out[j:k] = self.file.get_range(name, u[j] * width,
                                           (k - j) * width, npdt) \
                .reshape(k - j, width)
            j = k
        table = torch.from_numpy(out).to(want)
        return table[torch.searchsorted(uniq, ids)]

    def block_names(self, i):
        p = "model.layers.%d." % i
        return [n for n in self.names if n.startswith(p)]

    def block(self, i):
        return {n: self.tensor(n) for n in self.block_names(i)}

    def layer(self, i, tensors=None):
        """DecoderLayer i (eval mode) from tensors (default: read)."""
        return _fam.decoder_layer(self.cfg, self.block(i) if tensors is None
                                  else tensors, i)

    def embed_name(self):
        return "model.embed_tokens.weight"

    def head_name(self):
        return self.embed_name() if self.cfg["tied"] else "lm_head.weight"


def embed(cfg, table_rows):
    """The stem: embedding rows (Gemma's sqrt(d) scale as Model.forward)."""
    h = table_rows
    if cfg["gemma"]:
        h = h * torch.tensor(cfg["d"] ** 0.5, dtype=h.dtype)
    return h


# ---- a layer's forward by stage ----

# the fit's input groups of a decoder layer, in forward order
GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"),
          ("mlp.down_proj",))
LINEARS = tuple(n for g in GROUPS for n in g)
NORMS = ("input_layernorm", "post_attention_layernorm")


def stages(layer, h, pe, mask, upto=None, keep=None):
    """DecoderLayer.forward(h) computed stage by stage: returns a dict with
    the input of each group g (x0: q/k/v, x1: o, x2: gate/up, x3: down),
    "mid" (the residual after attention) and "out" (the layer's output),
    computed up to group `upto` (None: all).  The operations and their
    order are those of DecoderLayer.forward, so each value equals the
    tensor the whole layer computes there.  keep: a dict that receives
    the linears' outputs (their names in the layer) for gradients."""
    st = {"h": h}
    for g in range(5 if upto is None else upto + 1):
        step(layer, st, g, pe, mask, keep)
    return st


def step(layer, st, g, pe, mask, keep=None):
    """Stage g of a layer's forward into st (which holds "h" and the
    stages before g), with the layer's current weights: g = 0..3 the
    input of group g ("x<g>"; 2 also "mid"), 4 the output ("out")."""
    at, mlp = layer.self_attn, layer.mlp
    if g == 0:
        st["x0"] = layer.input_layernorm(st["h"])
    elif g == 1:
        x = st["x0"]
        q, k, v = at.q_proj(x), at.k_proj(x), at.v_proj(x)
        if keep is not None:
            keep.update({"self_attn.q_proj": q, "self_attn.k_proj": k,
                         "self_attn.v_proj": v})
        st["x1"] = at.core(q, k, v, mask, pe)
    elif g == 2:
        o = at.o_proj(st["x1"])
        if keep is not None:
            keep["self_attn.o_proj"] = o
        st["mid"] = st["h"] + o
        st["x2"] = layer.post_attention_layernorm(st["mid"])
    elif g == 3:
        gt, u = mlp.gate_proj(st["x2"]), mlp.up_proj(st["x2"])
        if keep is not None:
            keep.update({"mlp.gate_proj": gt, "mlp.up_proj": u})
        st["x3"] = mlp.act(gt) * u
    else:
        dn = mlp.down_proj(st["x3"])
        if keep is not None:
            keep["mlp.down_proj"] = dn
        st["out"] = st["mid"] + dn
    return st


# ---- a test hook ----

def test_point(point, i):
    """A test hook (as the C front ends' BICO_MPI_TEST_KILL): with
    BICO_STREAM_TEST_KILL=POINT:K[:SIGNAL] in the environment, the
    process sends itself SIGNAL (KILL by default, or TERM) at the K-th
    (from 1) passage of POINT ("fit": a layer's update, "write": a
    tensor written, "step": a distillation step), so that tests can stop a run where they want."""
    spec = os.environ.get("BICO_STREAM_TEST_KILL")
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] == point and int(parts[1]) == i + 1:
        sig = getattr(signal, "SIG" + (parts[2] if len(parts) > 2
                                       else "KILL"))
        os.kill(os.getpid(), sig)
