"""Model graphs (bico_model) and the whole-model transfer driver
(bico_transfer), the engine behind `bico transfer`.

    m = bico.Model.open("vit.safetensors")
    m.modules()      # [(name, kind, block, [tensor names])]
    bico.transfer_files(source_base="A.safetensors",
                        source_tuned="A_ft.safetensors",
                        target_base="B.safetensors", stats="S.safetensors",
                        output="B_ft.safetensors", alpha=1.0)
"""
import ctypes
import sys

from ._core import BicoError, Context, _Handle, _check, E_ARG
from . import _args as A
from ._enums import (choose, MODULE_KINDS as KINDS, TENSOR_ROLES as ROLES,
                     METHODS, TRANSFER_FILES as FILES,
                     TRANSFER_PARAMS as PARAMS, TRANSFER_STRINGS as STRINGS,
                     TRANSFER_ENUMS as _ENUMS, TRANSFER_SIDES as _SIDES,
                     TRANSFER_CHECK_LEVELS as _CHECK_LEVELS, DTYPE_NAMES)

__all__ = ["Model", "Transfer", "transfer_files", "stats_from_calib",
           "stats_merge", "KINDS", "ROLES", "METHODS", "FILES", "PARAMS"]
from ._lib import fn, c_size_t, c_int, c_long, c_char_p, c_void_p, c_double
from ._lib import LOG_FN, PROGRESS_FN
from ._status import count as _count
from . import safetensors as _st


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


# ---- the driver ----

class Transfer(_Handle):
    """bico_transfer: set files and options, then run().

    Transfer(ctx=None, log=None, progress=None): log is a callable taking
    one line of progress/summary text (None: silent; True: lines to
    stderr); progress a callable taking a dict after each target tensor
    (each module of a LoRA run): done, total (work units of the plan),
    tensors_done, tensors_total, elapsed (seconds) and tensor (the name
    just finished), see set_progress."""
    _free = staticmethod(fn.transfer_free)

    def __init__(self, ctx=None, log=None, progress=None):
        ctx = Context() if ctx is None else ctx
        h = c_void_p()
        _check(fn.transfer_create(ctx._alive(), ctypes.byref(h)), ctx)
        self._adopt(h.value, ctx)
        self._log_cb = None
        self._progress_cb = None
        self._progress_err = None
        self._lent = {}  # lent accumulators stay alive with the handle
        if log:
            self.set_log(log)
        if progress is not None:
            self.set_progress(progress)

    def set_file(self, which, path):
        if which not in FILES:
            raise BicoError(E_ARG, "Transfer: unknown file %r (known: %s)"
                            % (which, ", ".join(sorted(FILES))))
        _check(fn.transfer_set_file(self._alive(), FILES[which],
                                    None if path is None
                                    else A.cstr(path, which, path=True)),
               self.ctx)

    def set(self, name, value):
        """An option: a string (blocks, source_blocks, target_blocks), a
        name (method, norm_map, null, proc_method) or a number."""
        if name in STRINGS:
            _check(fn.transfer_set_string(self._alive(), STRINGS[name],
                                          None if value is None
                                          else _enc(value, name)), self.ctx)
            return
        if name not in PARAMS:
            raise BicoError(E_ARG, "Transfer: unknown option %r (known: %s)"
                            % (name, ", ".join(sorted(set(PARAMS) |
                                                      set(STRINGS)))))
        if name in _ENUMS:
            value = choose(_ENUMS[name], value, "Transfer: " + name)
        elif isinstance(value, str):
            raise BicoError(E_ARG, "Transfer: %s takes a number, got %r"
                            % (name, value))
        value = A.scalar_f64(value, "Transfer: " + name)
        _check(fn.transfer_set_param(self._alive(), PARAMS[name], value),
               self.ctx)

    def get(self, name):
        if name not in PARAMS:
            raise BicoError(E_ARG, "Transfer: unknown option %r (known: %s)"
                            % (name, ", ".join(sorted(PARAMS))))
        v = c_double()
        _check(fn.transfer_get_param(self._alive(), PARAMS[name],
                                     ctypes.byref(v)), self.ctx)
        return v.value

    def add_split(self, suffix, k):
        _check(fn.transfer_add_split(self._alive(), _enc(suffix, "suffix"),
                                     A.size(k, "split k")), self.ctx)

    def add_tie(self, tensor, module):
        _check(fn.transfer_add_tie(self._alive(), _enc(tensor, "tensor"),
                                   _enc(module, "module")), self.ctx)

    def set_xcov(self, module, side, xcovs):
        """Lends statistics of one side ("in" or "out") of target module
        `module`: a bico.XCov, or a list of one per output block (a split
        module); None or [] withdraws.  The handle keeps them (and so the
        accumulators stay alive) until it is closed or the side is set
        again; they must not change meanwhile."""
        side = choose(_SIDES, side, "Transfer.set_xcov: side")
        from ._core import XCov
        if xcovs is None:
            xcovs = []
        elif isinstance(xcovs, XCov):
            xcovs = [xcovs]
        xcovs = list(xcovs)
        for x in xcovs:
            if not isinstance(x, XCov):
                raise TypeError("Transfer.set_xcov: %s: expected bico.XCov, "
                                "got %s" % (module, type(x).__name__))
        arr = (c_void_p * max(len(xcovs), 1))(*[x._alive() for x in xcovs])
        _check(fn.transfer_set_xcov(self._alive(), _enc(module, "module"),
                                    side, len(xcovs), arr), self.ctx)
        self._lent[("xcov", module, side)] = xcovs

    def set_votes(self, tensor, votes):
        """Lends GradFix votes (a bico.Votes) for target tensor `tensor`;
        None withdraws.  Kept like set_xcov's accumulators."""
        from ._core import Votes
        if votes is not None and not isinstance(votes, Votes):
            raise TypeError("Transfer.set_votes: %s: expected bico.Votes, "
                            "got %s" % (tensor, type(votes).__name__))
        _check(fn.transfer_set_votes(self._alive(), _enc(tensor, "tensor"),
                                     None if votes is None
                                     else votes._alive()), self.ctx)
        self._lent[("votes", tensor)] = votes

    def set_log(self, log):
        if log is True:
            log = lambda line: sys.stderr.write(line + "\n")
        if log is not None and not callable(log):
            raise TypeError("Transfer: log must be callable, True or None")
        if log is None:
            self._log_cb = None
            _check(fn.transfer_set_log(self._alive(), None, None), self.ctx)
            return
        # the CFUNCTYPE object must live as long as the handle uses it
        self._log_cb = LOG_FN(lambda opaque, line: log(_dec(line)))
        _check(fn.transfer_set_log(self._alive(),
                                   ctypes.cast(self._log_cb, c_void_p), None),
               self.ctx)

    def set_progress(self, progress):
        """progress(dict) after each target tensor of a run (or module of a
        LoRA run), from the library's bico_progress; None removes it.  An
        exception it raises is re-raised by run() after the run ends (the
        library's callback cannot stop a run)."""
        if progress is not None and not callable(progress):
            raise TypeError("Transfer: progress must be callable or None")
        if progress is None:
            self._progress_cb = None
            _check(fn.transfer_set_progress(self._alive(), None, None),
                   self.ctx)
            return

        def call(opaque, p):
            if self._progress_err is not None:
                return
            q = p.contents
            try:
                progress({"done": q.done, "total": q.total,
                          "tensors_done": q.tensors_done,
                          "tensors_total": q.tensors_total,
                          "elapsed": q.elapsed,
                          "tensor": None if q.tensor is None
                          else _dec(q.tensor)})
            except BaseException as e:  # raised again by run()
                self._progress_err = e
        self._progress_cb = PROGRESS_FN(call)
        _check(fn.transfer_set_progress(self._alive(),
                                        ctypes.cast(self._progress_cb,
                                                    c_void_p), None),
               self.ctx)

    def check(self, level="inputs"):
        """bico_transfer_check: the run's checks without the run.  level
        "options": which files go together and contradictions, no file
        opened; "inputs" (default): also every check a run makes before
        its first map (inputs opened, outputs against inputs, models
        paired, ties, the pairing threshold).  Nothing is written; raises
        BicoError as run() would."""
        _check(fn.transfer_check(self._alive(),
                                 choose(_CHECK_LEVELS, level, "level")),
               self.ctx)

    def run(self):
        self._progress_err = None
        st = fn.transfer_run(self._alive())
        err, self._progress_err = self._progress_err, None
        _check(st, self.ctx)
        if err is not None:
            raise err
        return self.counts()

    def counts(self):
        """(updated, unchanged) target tensors of the last run."""
        u, n = c_size_t(), c_size_t()
        _check(fn.transfer_counts(self._alive(), ctypes.byref(u),
                                  ctypes.byref(n)), self.ctx)
        return u.value, n.value


def transfer_files(source_base, target_base, output, source_tuned=None,
                   task_vector=None, stats=None, source_calib=None,
                   target_calib=None, target_votes=None, delta_output=None,
                   report=None, method="bico", alpha=1.0, split=None,
                   ties=None, log=None, source_config=None,
                   target_config=None, progress=None, **options):
    """Runs the C driver on files: what `bico transfer` does.  options:
    norm_map ("act"|"grad"), null ("keep"|"drop"), rank_tol, center,
    whiten, proc_method ("eig"|"svd"|"polar"), workers (solver threads),
    solve_memory (bytes), blocks, source_blocks, target_blocks; decoder
    families (docs/llm.md): structure ("free" default | "heads"), rope
    ("half"|"interleaved"|"none"; default from config.json), heads, kv_heads, head_dim (0:
    from config.json), source_config/target_config (config.json paths);
    source_rename ("OLD=NEW", a prefix rename of the source's tensor
    names), max_shard_size (bytes; an output folder's shards), row_chunk
    (rows per streamed piece of a token table).  split {suffix: k}, ties
    {tensor: module}; progress a callable (Transfer.set_progress).
    Returns (updated, unchanged) tensor counts."""
    with Transfer(log=log, progress=progress) as t:
        for k, v in (("source_base", source_base),
                     ("target_base", target_base), ("output", output),
                     ("source_tuned", source_tuned),
                     ("task_vector", task_vector), ("stats", stats),
                     ("source_calib", source_calib),
                     ("target_calib", target_calib),
                     ("target_votes", target_votes),
                     ("delta_output", delta_output), ("report", report),
                     ("source_config", source_config),
                     ("target_config", target_config)):
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
        return t.run()


def stats_from_calib(source_calib, target_calib, output, blocks=None,
                     ctx=None):
    """Reduces two calibration files to a statistics file."""
    ctx = Context() if ctx is None else ctx
    args = (A.cstr(source_calib, "source_calib", path=True),
            A.cstr(target_calib, "target_calib", path=True),
            None if blocks is None else _enc(blocks, "blocks"),
            A.cstr(output, "output", path=True))
    _check(fn.stats_from_calib(ctx._alive(), *args), ctx)
    return output


def stats_merge(inputs, output, ctx=None):
    """Sums statistics files (same tensors and shapes) into output."""
    enc = [A.cstr(p, "inputs[%d]" % i, path=True)
           for i, p in enumerate(inputs)]
    out = A.cstr(output, "output", path=True)
    ctx = Context() if ctx is None else ctx
    arr = (c_char_p * max(len(enc), 1))(*enc)
    _check(fn.stats_merge(ctx._alive(), ctypes.cast(arr, c_void_p), len(enc),
                          out), ctx)
    return output
