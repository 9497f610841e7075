"""Whole-model transfer over in-memory state dicts, built on the binding's
kernels (Procrustes, transport, GradFix, baselines).

transfer_state_dict(source_base, source_tuned, target_base, stats,
                    method="bico", alpha=1.0, ...) -> (new state dict)

It follows the rules of the C driver (include/bico/model.h): a tensor's
module is its name without the last component; a module with a "weight" of
2+ dimensions is linear ([d_out, d_in...], a convolution flattened as
[d_out, prod(rest)]); 1-D tensors of a linear module with d_out elements
are its bias (carried by R_out); 1-D tensors of a module without such a
weight are element-wise (norms: carried by the input-activation map,
norm_map="act", or the output-gradient map, "grad"); tensors of 2+
dimensions that are no linear weight (cls_token, pos_embed, embedding
tables) are carried along their last dimension by the output map of the
module named in ties={"cls_token": "patch_embed.proj"}, else left out.
nn.MultiheadAttention's "M.in_proj_weight" / "M.in_proj_bias" belong to the
fused linear module "M.in_proj" (3 blocks: q, k, v); "M.out_proj.*" is an
ordinary linear module.  Target names pair with source names by identical
name outside the repeated blocks and by the depth map inside them.

Statistics are keyed by target module: "M.in_xcov" [d_in,A, d_in,B] and
"M.out_xcov" [d_out,A, d_out,B] (arrays, bico.XCov accumulators, or for a
fused module a list of per-block XCov), or a path to a statistics file.
"""
import numpy as np

from ._core import (BicoError, Procrustes, Votes, XCov, E_NOTFOUND, E_SHAPE,
                    E_ARG, E_FORMAT, weight as _weight, weight_split as _weight_split,
                    vector as _vector, rows as _rows, naive as _naive,
                    pad as _pad)
from ._args import plain as _to_numpy
from ._driver import transfer_via_driver, like_target
from ._enums import METHODS as _METHOD_CODES, DEFAULT_SPLIT, choose
from ._names import Pairing, module_of, split_block, split_for as _split_for

METHODS = tuple(_METHOD_CODES)


def _linear_modules(names_shapes):
    """{module: d_out} of modules whose "weight" has 2+ dimensions (and are
    not embedding tables), plus MHA in_proj pseudo-modules."""
    lin = {}
    for n, shape in names_shapes.items():
        m, p = module_of(n)
        last = m.rsplit(".", 1)[-1]
        if p == "weight" and len(shape) >= 2 and not (
                "embed" in last and "patch" not in last):
            lin[m] = shape[0]
        elif p == "in_proj_weight" and len(shape) == 2:
            lin[(m + "." if m else "") + "in_proj"] = shape[0]
    return lin


def classify(names_shapes):
    """{tensor: (role, module)} with role in weight, bias, vector, token,
    other (the pseudo-module of an MHA in_proj is "M.in_proj")."""
    lin = _linear_modules(names_shapes)
    out = {}
    for n, shape in names_shapes.items():
        m, p = module_of(n)
        if p in ("in_proj_weight", "in_proj_bias"):
            mm = (m + "." if m else "") + "in_proj"
            role = "weight" if p == "in_proj_weight" else "bias"
            out[n] = (role, mm)
        elif m in lin and p == "weight" and len(shape) >= 2:
            out[n] = ("weight", m)
        elif m in lin and len(shape) == 1 and shape[0] == lin[m]:
            out[n] = ("bias", m)
        elif len(shape) == 1 and m not in lin:
            out[n] = ("vector", m)
        elif len(shape) >= 2:
            out[n] = ("token", m)
        else:
            out[n] = ("other", m)
    return out


def _read_stats(path):
    """A statistics file's matrices as float64; the format holds F64 or F32
    (an integer or BOOL tensor is no cross-covariance)."""
    from . import safetensors
    with safetensors.File(path) as f:
        for n in f.keys():
            dt, _ = f.info(n)
            if dt not in ("F64", "F32"):
                raise BicoError(E_FORMAT, "transfer: statistics file %s: "
                                "tensor %s is %s; statistics are F64 or F32"
                                % (f.path, n, dt))
        return {n: f.get(n, np.float64) for n in f.keys()}


class _Stats(object):
    """Maps solved lazily from a statistics dict, cached per module."""

    def __init__(self, stats, split, procrustes_options):
        if isinstance(stats, str) or hasattr(stats, "__fspath__"):
            stats = _read_stats(stats)
        self.stats = stats or {}
        self.split = split
        self.opts = procrustes_options
        self.cache = {}

    def _solve(self, stat, proc):
        if isinstance(stat, XCov):
            return proc.solve(stat)
        return proc.solve_matrix(_to_numpy(stat).astype(np.float64,
                                                        copy=False))

    def get(self, module, side):
        """(R or [R per block], ranks list); raises when absent."""
        key = "%s.%s_xcov" % (module, side)
        if key in self.cache:
            return self.cache[key]
        if key not in self.stats:
            raise BicoError(E_NOTFOUND, "transfer: no statistics for module "
                            "%s (key %s missing)" % (module, key))
        stat = self.stats[key]
        k = _split_for(module, self.split) if side == "out" else 1
        with Procrustes(**self.opts) as proc:
            if isinstance(stat, (list, tuple)):
                res = [self._solve(s, proc) for s in stat]
            elif k > 1:
                c = _to_numpy(stat) if not isinstance(stat, XCov) \
                    else stat.matrix()
                da, db = c.shape
                if da % k or db % k:
                    raise BicoError(E_SHAPE, "transfer: %s is %dx%d, not "
                                    "divisible into %d blocks" % (key, da, db,
                                                                  k))
                ba, bb = da // k, db // k
                res = [self._solve(c[i * ba:(i + 1) * ba, i * bb:(i + 1) * bb],
                                   proc) for i in range(k)]
            else:
                res = self._solve(stat, proc)
        if isinstance(res, list):
            val = ([r for r, _ in res], [rk for _, rk in res])
        else:
            val = (res[0], [res[1]])
        self.cache[key] = val
        return val


def _default_tie(width, target, prefix):
    """As the C driver: a linear module outside the blocks whose output has
    the token's width and whose name contains embed, stem or patch."""
    for m, dout in _linear_modules({n: v.shape for n, v in
                                    target.items()}).items():
        if dout != width or split_block(m, prefix) is not None:
            continue
        if "embed" in m or "stem" in m or "patch" in m:
            return m
    return None


def _np(sd):
    return {k: _to_numpy(v) for k, v in sd.items()}


def transfer_state_dict(source_base, source_tuned, target_base, stats=None,
                        method="bico", alpha=1.0, norm_map="act",
                        split=None, ties=None, votes=None,
                        gradfix_mode="majority", source_blocks=None,
                        target_blocks=None, report=None, return_delta=False,
                        engine="auto", **procrustes_options):
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
    (needs votes: {target tensor: bico.Votes or int vote array}).
    procrustes_options: rank_tol, null ("keep"|"drop"), center, whiten (the
    last two need XCov statistics created with sums/grams).
    report: a list to append one dict per target tensor to.
    engine: "c" runs libbico's whole-model driver (bico_transfer, what
    `bico transfer` runs) on temporary safetensors files; "python" composes
    the binding's kernels here (needed for centering/whitening from XCov
    accumulators); "auto" (default) takes "c" when the library has it and
    the options allow.
    """
    if engine not in ("auto", "c", "python"):
        raise BicoError(E_ARG, "transfer: engine must be auto, c or python, "
                        "got %r" % (engine,))
    choose(_METHOD_CODES, method, "transfer: method")
    needs_py = bool(procrustes_options.get("center")) or bool(
        procrustes_options.get("whiten")) or gradfix_mode != "majority"
    from ._lib import has
    if engine == "c" or (engine == "auto" and not needs_py
                         and has("transfer_run")):
        return transfer_via_driver(
            source_base, source_tuned, target_base, stats, method=method,
            alpha=alpha, norm_map=norm_map, split=split, ties=ties,
            votes=votes, source_blocks=source_blocks,
            target_blocks=target_blocks, report=report,
            return_delta=return_delta, **procrustes_options)
    if norm_map not in ("act", "grad"):
        raise BicoError(E_ARG, "transfer: norm_map must be 'act' or 'grad', "
                        "got %r" % (norm_map,))
    if not alpha > 0:
        raise BicoError(E_ARG, "transfer: alpha must be positive, got %r"
                        % (alpha,))
    a0, a1, b0 = _np(source_base), _np(source_tuned), _np(target_base)
    for n in a0:
        if n not in a1:
            raise BicoError(E_NOTFOUND, "transfer: tensor %s of the source "
                            "base is missing from the tuned source" % n)
    split = dict(DEFAULT_SPLIT if split is None else split)
    ties = dict(ties or {})
    pairing = Pairing(a0.keys(), b0.keys(), source_blocks, target_blocks)
    roles = classify({n: v.shape for n, v in b0.items()})
    for n, (role, _) in roles.items():
        if role == "token" and n not in ties:
            stem = _default_tie(b0[n].shape[-1], b0, pairing.prefix_b)
            if stem is not None:
                ties[n] = stem
    st = _Stats(stats, split, procrustes_options) if method.startswith(
        "bico") else None
    use_in = method in ("bico", "bico-in")
    use_out = method in ("bico", "bico-out")
    new, delta = {}, {}
    rep = report if report is not None else []
    for name, tb in b0.items():
        src = pairing.source_name(name)
        role, module = roles[name]
        # the keys of the C driver's JSON report
        entry = {"name": name, "shape": list(tb.shape), "source": src,
                 "handling": "unchanged"}
        upd = None
        floating = np.issubdtype(tb.dtype, np.floating) or tb.dtype.kind == "V"
        if src in a0 and floating:
            tau = (a1[src].astype(np.float32) - a0[src].astype(np.float32))
            if method == "naive":
                upd = _naive(tau, tb.shape, alpha)
                entry["handling"] = "naive"
            elif method == "pad":
                if tau.ndim != tb.ndim:
                    raise BicoError(E_SHAPE, "transfer: pad needs equal ranks;"
                                    " %s is %s, %s is %s" % (src, tau.shape,
                                                             name, tb.shape))
                upd = _pad(tau, tb.shape, alpha)
                entry["handling"] = "padded"
            elif method == "gradfix":
                upd, entry = _gradfix(name, tau, tb, votes, alpha,
                                      gradfix_mode, entry)
            else:
                upd = _bico_tensor(name, role, module, tau, tb, st, use_in,
                                   use_out, norm_map, ties, alpha, entry,
                                   pairing)
        elif src not in a0:
            entry["note"] = "no source tensor %s" % src
        if upd is not None:
            entry["update_norm"] = float(np.linalg.norm(upd))
            delta[name] = upd
            res = (tb.astype(np.float32) + upd).astype(tb.dtype)
        else:
            res = tb.copy()
        new[name] = res
        rep.append(entry)
    new = {k: like_target(v, target_base[k]) for k, v in new.items()}
    if return_delta:
        delta = {k: like_target(v, target_base[k], keep_dtype=False)
                 for k, v in delta.items()}
        return new, delta
    return new


def _gradfix(name, tau, tb, votes, alpha, mode, entry):
    if votes is None or name not in votes:
        raise BicoError(E_NOTFOUND, "transfer: gradfix has no votes for %s"
                        % name)
    if tau.shape != tb.shape:
        raise BicoError(E_SHAPE, "transfer: gradfix needs identical shapes; "
                        "%s is %s in the source, %s in the target"
                        % (entry["source"], tau.shape, tb.shape))
    v = votes[name]
    if not isinstance(v, Votes):
        counts = np.asarray(_to_numpy(v)).astype(np.int32)
        vv = Votes(tb.shape)
        vv.add_counts(counts, int(np.abs(counts).max()) if counts.size else 0)
        v = vv
    upd, kept = v.apply(tau, alpha, mode=mode)
    entry["handling"] = "masked"
    entry["kept"] = kept / float(max(tau.size, 1))
    return upd, entry


def _bico_tensor(name, role, module, tau, tb, st, use_in, use_out, norm_map,
                 ties, alpha, entry, pairing):
    if role == "weight":
        r_in, rk_in = st.get(module, "in") if use_in else (None, [])
        r_out, rk_out = st.get(module, "out") if use_out else (None, [])
        t2 = tau.reshape(tau.shape[0], -1)
        dout_b, din_b = tb.shape[0], int(np.prod(tb.shape[1:]))
        if isinstance(r_out, list) and len(r_out) > 1:
            upd = _weight_split(t2, r_out, r_in, alpha, d_out_b=dout_b,
                                d_in_b=din_b)
        elif r_out is None and _split_for(module, st.split) > 1:
            # block-wise identities, as the driver does
            upd = _weight_split(t2, None, r_in, alpha,
                                k=_split_for(module, st.split),
                                d_out_b=dout_b, d_in_b=din_b)
        else:
            ro = r_out[0] if isinstance(r_out, list) else r_out
            upd = _weight(t2, ro, r_in, alpha, d_out_b=dout_b, d_in_b=din_b)
        entry.update(handling="linear", rank_in=rk_in, rank_out=rk_out)
        return upd.reshape(tb.shape)
    if role == "bias":
        entry["handling"] = "vector"
        if not use_out:
            k = _split_for(module, st.split)
            pa, pb = tau.shape[0] // k, tb.shape[0] // k
            return np.concatenate([_vector(tau[i * pa:(i + 1) * pa], None,
                                           alpha, d_b=pb) for i in range(k)])
        r_out, rk = st.get(module, "out")
        entry.update(handling="vector", rank_out=rk)
        if isinstance(r_out, list) and len(r_out) > 1:
            k = len(r_out)
            pa = tau.shape[0] // k
            return np.concatenate([_vector(tau[i * pa:(i + 1) * pa], r_out[i],
                                           alpha) for i in range(k)])
        ro = r_out[0] if isinstance(r_out, list) else r_out
        return _vector(tau, ro, alpha, d_b=tb.shape[0])
    if role == "vector":
        # for all three BiCo methods, norms follow norm_map (as the driver)
        side = "in" if norm_map == "act" else "out"
        r, rk = st.get(module, side)
        r = r[0] if isinstance(r, list) else r
        entry.update(handling="vector", map=side, rank=rk)
        if name.rsplit(".", 1)[-1] == "weight" and r is not None:
            # a norm's scale is the operator diag(g): (R o R)^T tau, as the
            # driver's route says (bico__route.scale)
            r64 = np.asarray(r, np.float64)
            return (alpha * ((r64 * r64).T @ np.asarray(tau, np.float64))
                    ).astype(np.float32)
        return _vector(tau, r, alpha, d_b=tb.shape[0])
    if role == "token":
        tie = ties.get(name)
        if tie is None:
            entry["note"] = "no map for its last dimension: left out " \
                "(give ties={%r: module})" % name
            return None
        if use_out:
            r, rk = st.get(tie, "out")
            r = r[0] if isinstance(r, list) else r
        else:
            r, rk = None, []
        entry.update(handling="tied", tie=tie, rank=rk)
        return _rows(tau, r, alpha, d_b=tb.shape[-1]).reshape(
            tau.shape[:-1] + (tb.shape[-1],)) if tau.shape[:-1] == \
            tb.shape[:-1] else _tie_mismatch(name, tau, tb)
    return None


def _tie_mismatch(name, tau, tb):
    raise BicoError(E_SHAPE, "transfer: tied tensor %s has leading shape %s "
                    "in the source and %s in the target" % (name,
                                                             tau.shape[:-1],
                                                             tb.shape[:-1]))
