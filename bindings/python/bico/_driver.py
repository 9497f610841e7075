"""transfer_state_dict through libbico's whole-model driver: the state
dicts go to temporary safetensors files, statistics and votes are lent
from memory (bico_transfer_set_xcov, _set_votes), bico_transfer runs, the
output comes back.  nn.MultiheadAttention's "M.in_proj_weight"/"_bias" are
renamed "M.in_proj.weight"/".bias" on the way (so that the driver sees a
linear module "M.in_proj", split in 3 like "qkv") and back."""
import json
import os
import tempfile

import numpy as np

from ._core import XCov, Votes, BicoError, E_ARG, E_SHAPE
from ._args import plain as _to_numpy
from ._enums import DEFAULT_SPLIT
from . import safetensors as _st
from .model import Transfer


def _is_torch(x):
    return hasattr(x, "detach") and hasattr(x, "cpu")


def like_target(value, ref, keep_dtype=True):
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
    c = np.asarray(_to_numpy(v), dtype=np.float64)
    if c.ndim != 2:
        raise BicoError(E_SHAPE, "transfer: statistic %s has shape %s; a "
                        "cross-covariance is 2-D" % (key, c.shape))
    x = XCov(c.shape[0], c.shape[1])
    x.add_matrix(c, 1)
    return x


def _lend_stats(t, stats):
    """Lends every statistic of the dict to the handle t (bico.Transfer)."""
    for key, v in stats.items():
        module, _, side = key.rpartition(".")
        if side not in ("in_xcov", "out_xcov") or not module:
            raise BicoError(E_ARG, "transfer: statistics key %r is not "
                            "\"<module>.in_xcov\" or \"<module>.out_xcov\""
                            % (key,))
        blocks = v if isinstance(v, (list, tuple)) else [v]
        t.set_xcov(module, side[:-5],
                   [_as_xcov(b, "%s[%d]" % (key, i))
                    for i, b in enumerate(blocks)])


def _lend_votes(t, votes):
    for k, v in votes.items():
        if not isinstance(v, Votes):
            counts = np.asarray(_to_numpy(v)).astype(np.int32)
            vv = Votes(counts.shape if counts.ndim else (1,))
            vv.add_counts(counts.reshape(vv.shape),
                          int(np.abs(counts).max()) if counts.size else 0)
            v = vv
        t.set_votes(_rename(k), v)


def transfer_via_driver(source_base, source_tuned, target_base, stats,
                        method="bico", alpha=1.0, norm_map="act", split=None,
                        ties=None, votes=None, gradfix_mode="majority",
                        source_blocks=None, target_blocks=None, report=None,
                        return_delta=False, **options):
    """bico.transfer_state_dict's body: see there."""
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
                    _lend_stats(t, stats or {})
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
    new = {k: like_target(new[k], target_base[k]) for k in target_base}
    if return_delta:
        delta = {_unrename(k, originals): v for k, v in delta.items()}
        delta = {k: like_target(v, target_base[k], keep_dtype=False)
                 for k, v in delta.items()}
        return new, delta
    return new
