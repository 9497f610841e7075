"""bico.llm.adapters: fitted updates written as PEFT LoRA adapters
(save_adapter), by the rank-r reduced-rank regression of each layer's
update (low_rank) weighted by the layer's inputs (input_covariances,
update_grams).

    bl.save_adapter("tgt_adapter/", tgt, new_sd, r=16, covariance=...)
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn as nn

from .._status import BicoError, E_ARG
from .. import safetensors as _st
from ..torch.tied import _shared_tensors as _tied

__all__ = ["save_adapter", "input_covariances", "update_grams", "low_rank"]


def input_covariances(model, batches, names=None, forward=None):
    """{linear module name: X^T X} (float64, [d_in, d_in]) of each
    nn.Linear's inputs over the batches (modules reading the same input
    share one matrix).  names: the modules (default: every nn.Linear)."""
    mods = {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and (names is None or n in names)}
    acc, seen, hooks = {}, {}, []

    def hook(name):
        def f(m, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            key = (args[0].data_ptr(), tuple(args[0].shape))
            if key in seen:
                acc[name] = acc[seen[key]]
                return
            c = x.T @ x
            if name in acc:
                acc[name] += c
            else:
                acc[name] = c
            seen[key] = name
        return f
    for n, m in mods.items():
        hooks.append(m.register_forward_hook(hook(n)))
    dev = next(model.parameters()).device
    try:
        with torch.no_grad():
            for b in batches:
                seen.clear()
                x = b[0] if isinstance(b, (tuple, list)) else b
                (forward or (lambda m, x: m(x)))(model, x.to(dev))
    finally:
        for h in hooks:
            h.remove()
    return {k: v.cpu() for k, v in acc.items()}


def update_grams(model, batches, delta, forward=None):
    """What low_rank needs to weight each linear update by its inputs, at
    the smaller of its two sizes: {module: ("out", G)} with G = sum over
    rows of (dW x)(dW x)^T [d_out, d_out] when d_out <= d_in, else
    {module: ("in", X^T X)} [d_in, d_in].  delta: {tensor name: update}
    (modules without a 2-D weight update are skipped); the inputs are
    those of model on the batches: the fitted target gives each layer
    the inputs the fit saw (earlier layers updated), the original target
    those of the untouched model.  float64."""
    ws = {}
    for n, m in model.named_modules():
        w = n + ".weight"
        if isinstance(m, nn.Linear) and w in delta:
            ws[n] = torch.as_tensor(delta[w]).double()
    acc, hooks = {}, []

    def hook(name):
        dw = ws[name]

        def f(m, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            if dw.shape[0] <= dw.shape[1]:
                y = x @ dw.T.to(x.device)
                c = ("out", (y.T @ y).cpu())
            else:
                c = ("in", (x.T @ x).cpu())
            if name in acc:
                acc[name][1].add_(c[1])
            else:
                acc[name] = c
        return f
    mods = dict(model.named_modules())
    for n in ws:
        hooks.append(mods[n].register_forward_hook(hook(n)))
    dev = next(model.parameters()).device
    try:
        with torch.no_grad():
            for b in batches:
                x = b[0] if isinstance(b, (tuple, list)) else b
                (forward or (lambda m, x: m(x)))(model, x.to(dev))
    finally:
        for h in hooks:
            h.remove()
    return acc


def low_rank(delta, r, gram=None):
    """(B [d_out, r'], A [r', d_in]), B @ A the rank-r' approximation of
    the update delta [d_out, d_in] (float64), r' = min(r, d_out, d_in).

    gram None: delta's truncated SVD (least squares in the weights).
    gram X^T X [d_in, d_in] of the layer's inputs (or ("in", X^T X), or
    ("out", sum (delta x)(delta x)^T) from update_grams): reduced-rank
    regression of the fitted values, B A = U_r U_r^T delta with U_r the
    top-r left singular vectors of delta (X^T X)^(1/2), i.e. the outputs
    X delta^T projected on their top-r right singular vectors: the rank-r
    update closest to delta's effect on those inputs.  When delta is
    itself a least-squares fit on X this is the reduced-rank regression
    solution of the same problem."""
    d = torch.as_tensor(delta).double()
    r = min(int(r), d.shape[0], d.shape[1])
    if gram is None:
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        return u[:, :r] * s[:r], vh[:r]
    kind, g = gram if isinstance(gram, tuple) else ("in", gram)
    g = torch.as_tensor(g).double()
    if kind == "in" and d.shape[0] <= d.shape[1]:
        kind, g = "out", d @ g @ d.T
    if kind == "out":
        w, u = torch.linalg.eigh((g + g.T) / 2)
        u = u[:, torch.argsort(w, descending=True)[:r]]
    else:
        w, v = torch.linalg.eigh((g + g.T) / 2)
        half = (v * w.clamp_min(0).sqrt()) @ v.T
        u, _, _ = torch.linalg.svd(d @ half, full_matrices=False)
        u = u[:, :r]
    return u, u.T @ d


def _module_names(model):
    if isinstance(model, nn.Module):
        sd = model.state_dict()
        lin = set(n for n, m in model.named_modules()
                  if isinstance(m, nn.Linear))
        return sd, lin
    sd = dict(model)
    lin = set(k[:-len(".weight")] for k, v in sd.items()
              if k.endswith(".weight") and getattr(v, "ndim", 0) == 2
              and "embed" not in k)
    return sd, lin


def _short(name):
    return name.rsplit(".", 1)[-1]


def save_adapter(folder, target, fitted, r, lora_alpha=None,
                 target_modules=None, base_model_name_or_path=None,
                 modules_to_save=None, covariance=None, is_delta=False,
                 dtype=None, task_type="CAUSAL_LM", metadata=None,
                 lora_dropout=0.0, return_effective=False,
                 target_dtypes=None, factor_dtype=torch.float32):
    """Writes the update of target's weights as a PEFT LoRA adapter folder
    (adapter_model.safetensors, adapter_config.json) and returns a dict
    saying what it holds and what it left out.

    target: the target nn.Module (or its state dict); fitted: the new state
    dict (what transfer_model returns), or the update itself with
    is_delta=True.  r: the rank; lora_alpha: PEFT's lora_alpha (default r,
    scale 1; the factors are stored so that lora_alpha / r * B A is the
    update).  target_modules: names (PEFT's suffix rule: "q_proj" matches
    every layer's) of the nn.Linear modules that get a pair (default: every
    nn.Linear with an update, except a head tied to the embedding).  Each
    pair is the rank-r reduced-rank regression of the layer's update
    (low_rank): covariance {module: X^T X} weights it by the layer's inputs
    (input_covariances or update_grams on calibration batches), else a
    plain truncated SVD.
    A bias update cannot sit in a LoRA pair: it is left out (reported).
    modules_to_save: modules (full names or PEFT suffixes, e.g. "norm",
    "input_layernorm", "embed_tokens") whose updated tensors are stored
    whole (PEFT's modules_to_save); updates of other tensors are left out
    and reported.  A saved tensor tied to another module (an embedding
    whose lm_head is the same tensor) is stored under both names, both
    modules in modules_to_save: PEFT gives each module of modules_to_save
    its own copy, so a head not saved beside its embedding would stay as
    it was (report "saved" lists both).
    Dtypes (one rule, PEFT's convention): the LoRA factors are
    factor_dtype (float32); saved whole tensors keep the target's dtype
    (target_dtypes {tensor: torch dtype} when the target was loaded in
    another dtype than its files'); dtype, when given, is that of every
    stored tensor.  return_effective: the result also holds "effective",
    {tensor: float64 update} of what the adapter carries as stored (the
    factors' product at their stored precision times lora_alpha / r, the
    saved tensors as stored minus the target's), for scoring it.
    Returns {"modules": [...], "saved": [...], "left_out": [names],
    "left_out_norm": relative size of what was left out, "rank": r}."""
    built = _build(target, fitted, r, lora_alpha, target_modules,
                   base_model_name_or_path, modules_to_save, covariance,
                   is_delta, dtype, task_type, lora_dropout, target_dtypes,
                   factor_dtype, return_effective)
    _write(folder, built, metadata)
    report = built["report"]
    if return_effective:
        report["effective"] = built["effective"]
    return report


def _delta_of(fitted, sd, k, is_delta):
    v = fitted.get(k)
    if v is None:
        return None
    v = torch.as_tensor(np.asarray(v.detach().cpu().float().numpy()
                                   if isinstance(v, torch.Tensor)
                                   else v)).double()
    if is_delta:
        return v
    return v - sd[k].detach().cpu().double()


def _matches(mod, pats):
    return any(mod == p or mod.endswith("." + p) for p in pats)


def tall_low_rank(piece, rows, r, gram, step=8192):
    """low_rank(delta, r, ("in", gram)) of a tall update (rows x d_in,
    rows > d_in) that is never held whole: piece(r0, r1) gives its rows
    r0:r1 (float64).  The top-r left singular vectors of M = delta
    gram^(1/2) are M V_r / s_r, V_r and s_r^2 the top eigenpairs of
    M^T M = gram^(1/2) (delta^T delta) gram^(1/2), a d_in x d_in matrix
    summed over pieces; B = M V_r / s_r and A = B^T delta are built a
    piece at a time.  B A is low_rank's (the projector on the same
    subspace; the pair may differ from it in sign); directions of less
    than 1e-6 of the largest singular value are dropped (their
    eigenvalues are rounding there).  Memory: three d_in x d_in
    matrices, the pair, a piece."""
    g = torch.as_tensor(gram).double()
    w, v = torch.linalg.eigh((g + g.T) / 2)
    half = (v * w.clamp_min(0).sqrt()) @ v.T
    dtd = None
    for r0 in range(0, rows, step):
        p = piece(r0, min(rows, r0 + step))
        dtd = p.T @ p if dtd is None else dtd.add_(p.T @ p)
    m = half @ dtd @ half
    s2, vr = torch.linalg.eigh((m + m.T) / 2)
    top = torch.argsort(s2, descending=True)[:min(int(r), m.shape[0])]
    s2, vr = s2[top], vr[:, top]
    # a direction below 1e-6 of the largest in weight is rounding
    # there (the eigenvalues' error is ~1e-16 of the largest)
    keep = s2 > float(s2[0].clamp_min(0)) * 1e-12
    s2, vr = s2[keep], vr[:, keep]
    proj = half @ vr / s2.sqrt()   # d_in x r': delta @ proj = M V_r / s_r
    b = torch.empty(rows, proj.shape[1], dtype=torch.float64)
    a = torch.zeros(proj.shape[1], m.shape[0], dtype=torch.float64)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        p = piece(r0, r1)
        b[r0:r1] = p @ proj
        a += b[r0:r1].T @ p
    return b, a


def balanced_pair(dk, r, c=None):
    """The rank-r pair (B [d_out, r], A [r, d_in], float64) of update dk
    (low_rank with gram c), padded with zeros to rank r and balanced (B
    and A of equal norm), before PEFT's lora_alpha / r scale; both zero
    for a zero update (PEFT's no-op, B = 0)."""
    if not bool(dk.any()):
        return dk.new_zeros(dk.shape[0], r), dk.new_zeros(r, dk.shape[1])
    return balance(*low_rank(dk, r, c), r)


def balance(b, a, r):
    """A pair padded with zeros to rank r and balanced (balanced_pair)."""
    if b.shape[1] < r:  # pad to r (PEFT's rank is one number)
        b = torch.cat([b, b.new_zeros(b.shape[0], r - b.shape[1])], 1)
        a = torch.cat([a, a.new_zeros(r - a.shape[0], a.shape[1])], 0)
    nb, na = float(b.norm()), float(a.norm())
    if nb > 0 and na > 0:
        s = math.sqrt(na / nb)
        b, a = b * s, a / s
    return b, a


def _pair(dk, r, alpha, c):
    """(B, A) of the update dk (balanced_pair), B scaled so that
    lora_alpha / r * B A is the update."""
    b, a = balanced_pair(dk, r, c)
    return b * (r / alpha), a


def adapter_meta(metadata, left_out):
    """adapter_model.safetensors' metadata."""
    meta = {"format": "pt"}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    if left_out:
        meta["bico_left_out"] = ",".join(left_out)
    return meta


def adapter_config(r, alpha, target_modules, saved_mods,
                   base_model_name_or_path, task_type="CAUSAL_LM",
                   lora_dropout=0.0):
    """PEFT's adapter_config.json of a LoRA adapter."""
    return {"peft_type": "LORA", "task_type": task_type, "r": r,
            "lora_alpha": alpha, "target_modules": target_modules,
            "lora_dropout": lora_dropout, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": sorted(saved_mods) or None,
            "base_model_name_or_path": base_model_name_or_path,
            "revision": None, "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None, "layers_pattern": None}


def adapter_note(report, weighted):
    """bico_adapter.json's own fields: what was left out, the
    factorization (the choices recorded are added by the writer)."""
    return {"left_out": report["left_out"],
            "left_out_norm": report["left_out_norm"],
            "factorization": "reduced-rank regression (input-weighted)"
            if weighted else "truncated SVD"}


def write_adapter_json(folder, cfg, note):
    """bico_adapter.json and adapter_config.json (last) into folder: PEFT
    and libbico refuse fields they do not know in adapter_config.json, so
    the note goes beside it."""
    with open(os.path.join(str(folder), "bico_adapter.json"), "w") as f:
        json.dump(note, f, indent=2, sort_keys=True)
    tmp = os.path.join(str(folder), "adapter_config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(str(folder), "adapter_config.json"))


def _build(target, fitted, r, lora_alpha, target_modules, base_name,
           modules_to_save, covariance, is_delta, dtype, task_type,
           lora_dropout, target_dtypes, factor_dtype, effective=True):
    """What save_adapter writes, in memory: {"tensors", "config",
    "report", "effective" (None unless effective), "note"}."""
    sd, linear = _module_names(target)
    if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
        raise BicoError(E_ARG, "save_adapter: r must be a positive integer, "
                        "got %r" % (r,))
    alpha = float(r if lora_alpha is None else lora_alpha)
    if not (math.isfinite(alpha) and alpha > 0):
        raise BicoError(E_ARG, "save_adapter: lora_alpha must be a finite "
                        "number > 0, got %r" % (lora_alpha,))
    tied, tied_with = set(), {}
    if isinstance(target, nn.Module):
        for grp in _tied(target):
            tied.update(grp)
            for k in grp:
                tied_with[k] = [t for t in grp if t != k]
    changed = {}
    for k in sd:
        dk = _delta_of(fitted, sd, k, is_delta)
        if dk is not None and float(dk.abs().max() if dk.numel() else 0) > 0:
            changed[k] = dk
    if target_modules is None:
        mods = sorted(set(k[:-len(".weight")] for k in changed
                          if k.endswith(".weight")
                          and k[:-len(".weight")] in linear
                          and k not in tied))
        target_modules = sorted(set(_short(m) for m in mods))
    else:
        target_modules = [target_modules] if isinstance(target_modules, str) \
            else list(target_modules)
    pairs = sorted(m for m in linear if _matches(m, target_modules)
                   and m + ".weight" in sd)
    if not pairs:
        raise BicoError(E_ARG, "save_adapter: no linear layer of the target "
                        "matches target_modules %s (or has an update): an "
                        "adapter needs at least one LoRA pair"
                        % (target_modules,))
    tensors, eff = {}, {}
    report = {"modules": [], "saved": [], "left_out": [], "rank": r}
    for m in pairs:
        w = m + ".weight"
        if w in tied:
            raise BicoError(E_ARG, "save_adapter: %s is tied to the "
                            "embedding; a LoRA pair on it would move only "
                            "the head in PEFT: leave it out of "
                            "target_modules (or save the embedding with "
                            "modules_to_save)" % m)
        dk = changed.get(w)
        if dk is None:
            dk = torch.zeros(tuple(sd[w].shape), dtype=torch.float64)
        b, a = _pair(dk, r, alpha, None if covariance is None
                     else covariance.get(m))
        dt = dtype or factor_dtype
        pre = "base_model.model." + m
        tensors[pre + ".lora_A.weight"] = a.to(dt).contiguous()
        tensors[pre + ".lora_B.weight"] = b.to(dt).contiguous()
        report["modules"].append(m)
        # what PEFT adds: the stored factors' product, times alpha / r
        if effective:
            eff[w] = (tensors[pre + ".lora_B.weight"].double() @
                      tensors[pre + ".lora_A.weight"].double()) * \
                (alpha / r)
    saved_mods = _saved(changed, sd, fitted, is_delta, list(
        modules_to_save or []), tied, tied_with,
        set(m + ".weight" for m in report["modules"]),
        dtype, target_dtypes, tensors, eff, report)
    tot = sum(float(v.pow(2).sum()) for v in changed.values())
    lost = sum(float(changed[k].pow(2).sum()) for k in report["left_out"])
    report["left_out_norm"] = math.sqrt(lost / tot) if tot > 0 else 0.0
    cfg = adapter_config(r, alpha, target_modules, saved_mods, base_name,
                         task_type, lora_dropout)
    report["config"] = cfg
    note = adapter_note(report, covariance is not None)
    return {"tensors": tensors, "config": cfg, "report": report,
            "effective": eff if effective else None, "note": note}


def _saved(changed, sd, fitted, is_delta, saves, tied, tied_with, done,
           dtype, target_dtypes, tensors, eff, report):
    """The whole tensors of modules_to_save (a tied tensor under every
    name it has) into tensors / eff / report; the other updates not in a
    pair into report["left_out"].  Returns the saved modules."""
    saved_mods = set()
    for k, dk in changed.items():
        if k in done or k in report["saved"]:
            continue
        names = [k] + [t for t in tied_with.get(k, ()) if t not in done]
        if saves and any(_matches(n.rsplit(".", 1)[0], saves)
                         for n in names):
            v = fitted[k] if not is_delta else sd[k].detach().cpu().double() \
                + dk
            v = torch.as_tensor(np.asarray(v.detach().cpu().float().numpy()
                                           if isinstance(v, torch.Tensor)
                                           else v))
            stored = v.to(dtype or (target_dtypes or {}).get(k) or
                          sd[k].dtype).contiguous()
            # PEFT loads each module of modules_to_save as its own copy: a
            # tied head not saved beside its embedding would not move
            for n in names:
                tensors["base_model.model." + n] = stored
                eff[n] = stored.double() - sd[k].detach().cpu().double()
                saved_mods.add(n.rsplit(".", 1)[0])
                report["saved"].append(n)
        elif k in tied and any(t in done or t in report["left_out"]
                               for t in tied_with.get(k, ())):
            continue   # one tensor: named once
        else:
            report["left_out"].append(k)
    report["left_out"] = [k for k in report["left_out"]
                          if k not in report["saved"]]
    return saved_mods


def _write(folder, built, metadata):
    """The built adapter written into folder: adapter_model.safetensors,
    bico_adapter.json (the note: PEFT and libbico refuse fields they do
    not know in adapter_config.json), adapter_config.json last."""
    report = built["report"]
    os.makedirs(str(folder), exist_ok=True)
    _st.write(os.path.join(str(folder), "adapter_model.safetensors"),
              built["tensors"], metadata=adapter_meta(metadata,
                                                      report["left_out"]))
    note = dict(built["note"])
    note.update(metadata or {})
    write_adapter_json(folder, built["config"], note)


def write_pairs(folder, pairs, r, lora_alpha, saved=None,
                base_model_name_or_path=None, metadata=None,
                task_type="CAUSAL_LM", target_modules=None):
    """A PEFT LoRA adapter of trained factors, written as they are
    (distillation's adapters; save_adapter factors a dense update).

    pairs: {module: (B [d_out, r], A [r, d_in])}, the update lora_alpha /
    r * B A (PEFT's scale); saved: {tensor name: tensor} stored whole
    (PEFT's modules_to_save: their modules are listed).  Factors are
    stored in float32 (PEFT's convention, as save_adapter's), saved
    tensors as given.  target_modules: PEFT's list (default: the modules'
    last names).  Returns the config written."""
    tensors = {}
    for m, (b, a) in sorted(pairs.items()):
        pre = "base_model.model." + m
        tensors[pre + ".lora_A.weight"] = a.detach().float().cpu() \
            .contiguous()
        tensors[pre + ".lora_B.weight"] = b.detach().float().cpu() \
            .contiguous()
    mods = set()
    for k, v in sorted((saved or {}).items()):
        tensors["base_model.model." + k] = v.detach().cpu().contiguous()
        mods.add(k.rsplit(".", 1)[0])
    names = sorted(target_modules or set(_short(m) for m in pairs))
    cfg = adapter_config(r, float(lora_alpha), names, mods,
                         base_model_name_or_path, task_type)
    built = {"tensors": tensors, "config": cfg,
             "report": {"left_out": []},
             "note": {"factorization": "trained (distillation)",
                      "left_out": []}}
    _write(folder, built, metadata)
    return cfg
