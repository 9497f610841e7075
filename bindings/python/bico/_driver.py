"""transfer_state_dict through libbico's whole-model driver: the state
dicts go to temporary safetensors files, bico_transfer runs on them, the
output comes back.  nn.MultiheadAttention's "M.in_proj_weight"/"_bias" are
renamed "M.in_proj.weight"/".bias" on the way (so that the driver sees a
linear module "M.in_proj", split in 3 like "qkv") and back."""
import json
import os
import tempfile

import numpy as np

from ._core import XCov, Votes
from ._args import plain as _to_numpy
from ._enums import DEFAULT_SPLIT
from . import safetensors as _st
from .model import transfer_files


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


def _stat_matrix(v):
    if isinstance(v, XCov):
        return v.matrix()
    if isinstance(v, (list, tuple)):
        ms = [x.matrix() if isinstance(x, XCov) else _to_numpy(x)
              for x in v]
        ba, bb = ms[0].shape
        full = np.zeros((ba * len(ms), bb * len(ms)))
        for i, m in enumerate(ms):
            full[i * ba:(i + 1) * ba, i * bb:(i + 1) * bb] = m
        return full
    return np.asarray(_to_numpy(v), dtype=np.float64)


def transfer_via_driver(source_base, source_tuned, target_base, stats,
                        method="bico", alpha=1.0, norm_map="act", split=None,
                        ties=None, votes=None, source_blocks=None,
                        target_blocks=None, report=None, return_delta=False,
                        **procrustes_options):
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
        files = dict(source_base=p("a.safetensors"),
                     source_tuned=p("a_ft.safetensors"),
                     target_base=p("b.safetensors"),
                     output=p("out.safetensors"),
                     report=p("report.json"))
        if return_delta:
            files["delta_output"] = p("delta.safetensors")
        if method.startswith("bico"):
            if isinstance(stats, str) or hasattr(stats, "__fspath__"):
                files["stats"] = os.fspath(stats)
            else:
                mats = {k: _stat_matrix(v) for k, v in (stats or {}).items()}
                _st.write(p("stats.safetensors"), mats)
                files["stats"] = p("stats.safetensors")
        if method == "gradfix":
            vt = {}
            for k, v in (votes or {}).items():
                vt[_rename(k)] = (v.counts() if isinstance(v, Votes)
                                  else np.asarray(_to_numpy(v))
                                  .astype(np.int32))
            _st.write(p("votes.safetensors"), vt)
            files["target_votes"] = p("votes.safetensors")
        opts = dict(norm_map=norm_map)
        for k in ("null", "rank_tol", "center", "whiten", "proc_method",
                  "workers", "solve_memory"):
            if k in procrustes_options:
                opts[k] = procrustes_options.pop(k)
        if procrustes_options:
            raise TypeError("transfer: unknown options %s"
                            % ", ".join(sorted(procrustes_options)))
        if source_blocks is not None:
            opts["source_blocks"] = source_blocks
        if target_blocks is not None:
            opts["target_blocks"] = target_blocks
        transfer_files(method=method, alpha=alpha, split=split,
                       ties={_rename(k): v for k, v in (ties or {}).items()},
                       **files, **opts)
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
