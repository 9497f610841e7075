"""include/bico/transfer.h: the whole-model transfer driver (bico_transfer),
the engine behind `bico transfer`, on files and on in-memory state dicts.

    with bico.Transfer() as t: t.set_file("source_base", ...); t.run()
    transfer_files(source_base=..., target_base=..., output=..., ...)

transfer_state_dict(source_base, source_tuned, target_base, stats,
                    method="bico", alpha=1.0, ...) -> (new state dict)

There is one engine: the C driver (bico_transfer, what `bico transfer`
runs), so the rules for which map carries which tensor (include/bico/
model.h, transfer.h), the tie rule for tokens and embeddings, pairing by
name and depth map, and the pairing threshold are the library's.  The
state dicts reach it as temporary safetensors files; the statistics and
GradFix votes are lent from memory (bico_transfer_set_xcov, _set_votes):
no copy, and accumulators keep the sums and Gram matrices centering and
whitening need.

Statistics are keyed by target module: "M.in_xcov" [d_in,A, d_in,B] and
"M.out_xcov" [d_out,A, d_out,B] (arrays, bico.XCov accumulators, or for a
split module a list of per-block ones), or a path to a statistics file.
nn.MultiheadAttention's "M.in_proj_weight" / "M.in_proj_bias" are the
fused linear module "M.in_proj" (split in 3 by default: q, k, v).
"""
import ctypes
import json
import os
import sys
import tempfile

import numpy as np

from . import _args as A
from . import safetensors as _st
from ._args import plain as _to_numpy
from ._ctx import Context
from ._enums import (choose, DEFAULT_SPLIT, METHODS as _METHOD_CODES,
                     TRANSFER_FILES as FILES, TRANSFER_PARAMS as PARAMS,
                     TRANSFER_STRINGS as STRINGS, TRANSFER_ENUMS as _ENUMS,
                     TRANSFER_SIDES as _SIDES,
                     TRANSFER_CHECK_LEVELS as _CHECK_LEVELS)
from ._handle import _Handle
from ._lib import fn, c_size_t, c_void_p, c_double, LOG_FN, PROGRESS_FN
from ._status import E_ARG, E_SHAPE, BicoError, check as _check
from ._votes import Votes
from ._xcov import XCov

METHODS = tuple(_METHOD_CODES)


class _TransferTensor(ctypes.Structure):
    """bico_transfer_tensor (a partial run's tensor)."""
    _fields_ = [("size", c_size_t), ("index", c_size_t),
                ("name", ctypes.c_char_p), ("handling", ctypes.c_int),
                ("update", ctypes.c_void_p), ("count", c_size_t),
                ("report_entry", ctypes.c_char_p)]


_SINK_FN = ctypes.CFUNCTYPE(ctypes.c_int, c_void_p,
                            ctypes.POINTER(_TransferTensor))

__all__ = ["Transfer", "transfer_files", "transfer_state_dict", "METHODS",
           "DEFAULT_SPLIT"]


def _enc(s, name="name"):
    return A.cstr(s, name)


def _dec(b):
    return b.decode("utf-8") if b is not None else None


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
        self._sink_cb = None
        self._sink_err = []
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
                                    side, arr, len(xcovs)), self.ctx)
        self._lent[("xcov", module, side)] = xcovs

    def set_votes(self, tensor, votes):
        """Lends GradFix votes (a bico.Votes) for target tensor `tensor`;
        None withdraws.  Kept like set_xcov's accumulators."""
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

    def set_partial(self, names, sink):
        """Makes the next runs partial (bico_transfer_set_partial): only
        the target tensors in `names` are computed, nothing is written,
        and sink(t) receives each, in the target's order, as a dict: name,
        index, handling ("vector", "tied", "unchanged", ...), update (a
        float32 NumPy view of alpha tau_B, valid during the call only:
        copy what you keep; None when unchanged) and report (the tensor's
        report entry, parsed).  An exception in sink stops the run and is
        raised again by run().  names None restores whole runs."""
        if names is None:
            self._sink_cb = None
            _check(fn.transfer_set_partial(self._alive(), None, 0, None,
                                           None), self.ctx)
            return
        with _st.open(self._target_path()) as f:
            order = f.keys()
        want = set(names)
        missing = sorted(want - set(order))
        if missing:
            raise BicoError(E_ARG, "Transfer.set_partial: the target has no "
                            "tensor %s" % ", ".join(missing[:5]))
        sel = (ctypes.c_ubyte * max(len(order), 1))(
            *[1 if n in want else 0 for n in order])
        err = self._sink_err = []

        def call(opaque, tp):
            try:
                x = tp.contents
                upd = None
                if x.update and x.count:
                    upd = np.ctypeslib.as_array(
                        ctypes.cast(x.update, ctypes.POINTER(ctypes.c_float)),
                        shape=(x.count,))
                h = fn.transfer_handling_name(x.handling)
                sink({"name": _dec(x.name), "index": x.index,
                      "handling": _dec(h), "update": upd,
                      "report": json.loads(_dec(x.report_entry) or "{}")})
                return 0
            except BaseException as e:
                err.append(e)
                return 12  # BICO_E_STATE: stops the run
        self._sink_cb = _SINK_FN(call)
        self._sel = sel
        _check(fn.transfer_set_partial(self._alive(), sel, len(order),
                                       ctypes.cast(self._sink_cb, c_void_p),
                                       None), self.ctx)

    def _target_path(self):
        p = ctypes.c_char_p()
        _check(fn.transfer_get_file(self._alive(), FILES["target_base"],
                                    ctypes.byref(p)), self.ctx)
        if p.value is None:
            raise BicoError(E_ARG, "Transfer.set_partial: set the target "
                            "base first")
        path = _dec(p.value)
        if os.path.isdir(path):
            for n in ("model.safetensors.index.json", "model.safetensors"):
                if os.path.exists(os.path.join(path, n)):
                    return os.path.join(path, n)
        return path

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
        self._sink_err = []
        st = fn.transfer_run(self._alive())
        err, self._progress_err = self._progress_err, None
        if self._sink_err:
            raise self._sink_err[0]
        _check(st, self.ctx)
        if err is not None:
            raise err
        return self.counts()

    def bridge(self):
        """bico_transfer_bridge: solves every map a transfer between the
        two bases uses and writes them to the "bridge_output" file, with
        the plan, the map options and both bases' fingerprints (set the
        bases and statistics as for run(), no fine-tune, no output;
        set("fingerprint", "full") fingerprints every byte of the bases
        instead of samples).  A later Transfer with set_file("bridge",
        path) and a fine-tune then reads its maps from it: no
        statistics, the same output bit for bit, after checking the
        bases' fingerprints and the bridge's digest and ranges
        (docs/api.md, docs/formats.md)."""
        self._progress_err = None
        st = fn.transfer_bridge(self._alive())
        err, self._progress_err = self._progress_err, None
        _check(st, self.ctx)
        if err is not None:
            raise err

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
        _configure(t, (("source_base", source_base),
                       ("target_base", target_base), ("output", output),
                       ("source_tuned", source_tuned),
                       ("task_vector", task_vector), ("stats", stats),
                       ("source_calib", source_calib),
                       ("target_calib", target_calib),
                       ("target_votes", target_votes),
                       ("delta_output", delta_output), ("report", report),
                       ("source_config", source_config),
                       ("target_config", target_config)),
                   method, alpha, options, split, ties)
        return t.run()


def _configure(t, files, method, alpha, options, split, ties):
    """A Transfer set up as the file-driven front ends set it (transfer_files
    and bico.lora.transfer): the files given (None left out), method,
    alpha, the other options, the split and tie rules."""
    for k, v in files:
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


# ---- in-memory state dicts through the driver ----
# The state dicts go to temporary safetensors files, statistics and votes
# are lent from memory (bico_transfer_set_xcov, _set_votes), bico_transfer
# runs, the output comes back.  nn.MultiheadAttention's
# "M.in_proj_weight"/"_bias" are renamed "M.in_proj.weight"/".bias" on the
# way (so that the driver sees a linear module "M.in_proj", split in 3 like
# "qkv") and back.

def _is_torch(x):
    return hasattr(x, "detach") and hasattr(x, "cpu")


def _like_target(value, ref, keep_dtype=True):
    """value (a NumPy array) in the kind of ref, the target's tensor: a
    torch tensor of ref's dtype on ref's device when ref is one, else a
    NumPy array of ref's dtype (float32 when keep_dtype is False: the
    update alone).  The one rule of transfer_state_dict's output."""
    if _is_torch(ref):
        import torch
        t = torch.from_numpy(np.ascontiguousarray(value))
        return t.to(device=ref.device,
                    dtype=ref.dtype if keep_dtype else torch.float32)
    want = _to_numpy(ref).dtype if keep_dtype else np.float32
    return np.asarray(value, dtype=want)


def _rename(name):
    head, _, last = name.rpartition(".")
    if last in ("in_proj_weight", "in_proj_bias"):
        return (head + "." if head else "") + "in_proj." + last[8:]
    return name


def _unrename(name, originals):
    return originals.get(name, name)


def _arrays(sd, keep_dtype):
    out, dtypes = {}, {}
    for k, v in sd.items():
        bf16 = str(getattr(v, "dtype", "")) == "torch.bfloat16"
        a = _to_numpy(v)
        if not keep_dtype and np.issubdtype(a.dtype, np.floating):
            a = a.astype(np.float32)
        elif bf16:
            dtypes[_rename(k)] = "BF16"
        out[_rename(k)] = a
    return out, dtypes


_OPTIONS = ("null", "rank_tol", "center", "whiten", "proc_method",
            "workers", "solve_memory", "min_paired")


def _as_xcov(v, key):
    """An XCov for a statistics value: itself, or one holding an array
    (bico_xcov_add_matrix with one row: maps do not depend on the scale)."""
    if isinstance(v, XCov):
        return v
    c = np.asarray(A.real(v, "transfer: statistic " + key),
                   dtype=np.float64)
    if c.ndim != 2:
        raise BicoError(E_SHAPE, "transfer: statistic %s has shape %s; a "
                        "cross-covariance is 2-D" % (key, c.shape))
    x = XCov(c.shape[0], c.shape[1])
    x.add_matrix(c, 1)
    return x


def _lend_stats(t, stats, modules=None):
    """Lends the statistics of the dict to the handle t (bico.Transfer):
    every one, or (modules: the target's module names) those of modules
    the target holds.  A collector hooks every module, including ones
    whose weights the state dict does not keep (a tied lm_head); the
    driver refuses statistics lent for a module it does not have."""
    for key, v in stats.items():
        module, _, side = key.rpartition(".")
        if side not in ("in_xcov", "out_xcov") or not module:
            raise BicoError(E_ARG, "transfer: statistics key %r is not "
                            "\"<module>.in_xcov\" or \"<module>.out_xcov\""
                            % (key,))
        if modules is not None and module not in modules:
            continue
        blocks = v if isinstance(v, (list, tuple)) else [v]
        t.set_xcov(module, side[:-5],
                   [_as_xcov(b, "%s[%d]" % (key, i))
                    for i, b in enumerate(blocks)])


def _lend_votes(t, votes):
    for k, v in votes.items():
        if not isinstance(v, Votes):
            counts = np.asarray(A.real(v, "transfer: votes of " + k)
                                ).astype(np.int32)
            vv = Votes(counts.shape if counts.ndim else (1,))
            vv.add_counts(counts.reshape(vv.shape),
                          int(np.abs(counts).max()) if counts.size else 0)
            v = vv
        t.set_votes(_rename(k), v)


def transfer_state_dict(source_base, source_tuned, target_base, stats=None,
                        method="bico", alpha=1.0, norm_map="act",
                        split=None, ties=None, votes=None,
                        gradfix_mode="majority", source_blocks=None,
                        target_blocks=None, report=None, return_delta=False,
                        allow_partial=False, **options):
    """A new target state dict: theta_B + alpha * tau_B for every tensor a
    method carries, theta_B unchanged otherwise, with target_base's names,
    shapes and dtypes.

    The rule for what comes out: each value has the kind of target_base's
    value of that name; a torch tensor gives a torch tensor (same dtype,
    same device), anything else a NumPy array (same dtype).  So a torch
    state dict gives one that load_state_dict takes, a NumPy one (e.g. from
    bico.safetensors.read) gives NumPy arrays.  With return_delta=True the
    update alone comes as a second dict, float32, of the same kinds.

    method: bico | bico-in | bico-out (needs stats), naive, pad, gradfix
    (needs votes: {target tensor: bico.Votes or int vote array};
    gradfix_mode "majority" or "mean", which needs Votes made with
    mean=True).
    options: rank_tol, null ("keep"|"drop"), center, whiten (these two
    need XCov statistics created with sums/grams), proc_method, workers,
    solve_memory, min_paired (default 0.5: fewer paired target parameters
    is an error, as with `bico transfer`); allow_partial=True is
    min_paired=0 (`--allow-partial`).
    report: a list to append one dict per target tensor to (the driver's
    JSON report entries).
    """
    choose(_METHOD_CODES, method, "transfer: method")
    if allow_partial:
        options["min_paired"] = 0
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError("transfer: unknown options %s" % ", ".join(unknown))
    split = dict(DEFAULT_SPLIT if split is None else split)
    with tempfile.TemporaryDirectory(prefix="bico-") as d:
        p = lambda n: os.path.join(d, n)
        a0, _ = _arrays(source_base, False)
        a1, _ = _arrays(source_tuned, False)
        b0, b_dtypes = _arrays(target_base, True)
        originals = {_rename(k): k for k in target_base}
        # The driver refuses a split that matches no module (a typo); the
        # default entries (qkv, in_proj) apply only where the target has
        # such a module, anything else the caller named is passed on.
        mods = {k.rsplit(".", 1)[0] for k in b0 if k.endswith(".weight")}
        split = {s: n for s, n in split.items()
                 if DEFAULT_SPLIT.get(s) != n
                 or any(m == s or m.endswith("." + s) for m in mods)}
        _st.write(p("a.safetensors"), a0)
        _st.write(p("a_ft.safetensors"), a1)
        _st.write(p("b.safetensors"), b0, dtypes=b_dtypes)
        with Transfer() as t:
            t.set_file("source_base", p("a.safetensors"))
            t.set_file("source_tuned", p("a_ft.safetensors"))
            t.set_file("target_base", p("b.safetensors"))
            t.set_file("output", p("out.safetensors"))
            t.set_file("report", p("report.json"))
            if return_delta:
                t.set_file("delta_output", p("delta.safetensors"))
            if method.startswith("bico"):
                if isinstance(stats, str) or hasattr(stats, "__fspath__"):
                    t.set_file("stats", os.fspath(stats))
                else:
                    _lend_stats(t, stats or {},
                                {k.rpartition(".")[0] for k in b0})
            if method == "gradfix":
                _lend_votes(t, votes or {})
                t.set("gradfix_mode", gradfix_mode)
            t.set("method", method)
            t.set("alpha", alpha)
            t.set("norm_map", norm_map)
            for k, v in options.items():
                t.set(k, v)
            for name, v in (("source_blocks", source_blocks),
                            ("target_blocks", target_blocks)):
                if v is not None:
                    t.set(name, v)
            for suffix, k in split.items():
                t.add_split(suffix, k)
            for tensor, module in (ties or {}).items():
                t.add_tie(_rename(tensor), module)
            t.run()
        out = _st.read(p("out.safetensors"))
        delta = _st.read(p("delta.safetensors")) if return_delta else None
        if report is not None:
            with open(p("report.json")) as f:
                rep = json.load(f)
            report.extend(rep.get("tensors", rep) if isinstance(rep, dict)
                          else rep)
    new = {_unrename(k, originals): v for k, v in out.items()}
    new = {k: _like_target(new[k], target_base[k]) for k in target_base}
    if return_delta:
        delta = {_unrename(k, originals): v for k, v in delta.items()}
        delta = {k: _like_target(v, target_base[k], keep_dtype=False)
                 for k, v in delta.items()}
        return new, delta
    return new

