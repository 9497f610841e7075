"""bico.llm.adapters: fitted updates written as PEFT LoRA adapters
(save_adapter), by the rank-r reduced-rank regression of each layer's
update (low_rank) weighted by the layer's inputs (input_covariances,
update_grams).

    bt.save_adapter("tgt_adapter/", tgt, new_sd, r=16, covariance=...)
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
                 target_dtypes=None):
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
    and reported.  dtype: of the stored tensors (default the target's, or
    target_dtypes {tensor: torch dtype} when the target was loaded in
    another dtype than its files').  return_effective: the result also
    holds "effective", {tensor: float64 update} of what the adapter
    carries (B A products and saved tensors), for scoring it.
    Returns {"modules": [...], "saved": [...], "left_out": [names],
    "left_out_norm": relative size of what was left out, "rank": r}."""
    sd, linear = _module_names(target)
    if not (isinstance(r, int) and r >= 1):
        raise BicoError(E_ARG, "save_adapter: r must be a positive integer, "
                        "got %r" % (r,))
    alpha = float(r if lora_alpha is None else lora_alpha)
    if not alpha > 0:
        raise BicoError(E_ARG, "save_adapter: lora_alpha must be > 0")
    tied, tied_with = set(), {}
    if isinstance(target, nn.Module):
        for grp in _tied(target):
            tied.update(grp)
            for k in grp:
                tied_with[k] = [t for t in grp if t != k]

    def delta_of(k):
        v = fitted.get(k)
        if v is None:
            return None
        v = torch.as_tensor(np.asarray(v.detach().cpu().float().numpy()
                                       if isinstance(v, torch.Tensor)
                                       else v)).double()
        if is_delta:
            return v
        return v - sd[k].detach().cpu().double()

    def matches(mod, pats):
        return any(mod == p or mod.endswith("." + p) for p in pats)
    changed = {}
    for k in sd:
        dk = delta_of(k)
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
    pairs = sorted(m for m in linear if matches(m, target_modules)
                   and m + ".weight" in sd)
    if not pairs:
        raise BicoError(E_ARG, "save_adapter: no linear layer of the target "
                        "matches target_modules %s (or has an update): an "
                        "adapter needs at least one LoRA pair"
                        % (target_modules,))
    saves = list(modules_to_save or [])
    tensors, done, eff = {}, set(), {}
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
        c = None if covariance is None else covariance.get(m)
        b, a = low_rank(dk, r, c)
        if b.shape[1] < r:  # pad to r (PEFT's rank is one number)
            b = torch.cat([b, b.new_zeros(b.shape[0], r - b.shape[1])], 1)
            a = torch.cat([a, a.new_zeros(r - a.shape[0], a.shape[1])], 0)
        # balance the factors' sizes; PEFT multiplies by lora_alpha / r
        nb, na = float(b.norm()), float(a.norm())
        if nb > 0 and na > 0:
            s = math.sqrt(na / nb)
            b, a = b * s, a / s
        b = b * (r / alpha)
        dt = dtype or (target_dtypes or {}).get(w) or sd[w].dtype
        pre = "base_model.model." + m
        tensors[pre + ".lora_A.weight"] = a.to(dt).contiguous()
        tensors[pre + ".lora_B.weight"] = b.to(dt).contiguous()
        done.add(w)
        report["modules"].append(m)
        if return_effective:
            eff[w] = (b @ a) * (alpha / r)
    saved_mods = set()
    for k, dk in changed.items():
        if k in done:
            continue
        mod = k.rsplit(".", 1)[0]
        if saves and matches(mod, saves):
            v = fitted[k] if not is_delta else sd[k].detach().cpu().double() \
                + dk
            v = torch.as_tensor(np.asarray(v.detach().cpu().float().numpy()
                                           if isinstance(v, torch.Tensor)
                                           else v))
            tensors["base_model.model." + k] = v.to(
                dtype or (target_dtypes or {}).get(k) or sd[k].dtype
            ).contiguous()
            if return_effective:
                eff[k] = dk
                for t in tied_with.get(k, ()):  # one tensor: its aliases too
                    eff[t] = dk
            saved_mods.add(mod)
            report["saved"].append(k)
        else:
            if k in tied and any(t in done or t in report["saved"]
                                 for t in tied if t != k):
                continue
            report["left_out"].append(k)
    tot = sum(float(v.pow(2).sum()) for v in changed.values())
    lost = sum(float(changed[k].pow(2).sum()) for k in report["left_out"])
    report["left_out_norm"] = math.sqrt(lost / tot) if tot > 0 else 0.0
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    if report["left_out"]:
        meta["bico_left_out"] = ",".join(report["left_out"])
    cfg = _peft_config(r, alpha, target_modules, sorted(saved_mods),
                       base_model_name_or_path, task_type, lora_dropout)
    bico_note = {"left_out": report["left_out"],
                 "left_out_norm": report["left_out_norm"],
                 "factorization": "reduced-rank regression (input-weighted)"
                 if covariance is not None else "truncated SVD"}
    bico_note.update(metadata or {})
    report["config"] = cfg
    if return_effective:
        report["effective"] = eff
    write_adapter_folder(folder, tensors, cfg, bico_note, meta)
    return report


def _peft_config(r, alpha, target_modules, saved_modules, base_model,
                 task_type="CAUSAL_LM", lora_dropout=0.0):
    """adapter_config.json as PEFT writes it for a LoRA adapter."""
    return {"peft_type": "LORA", "task_type": task_type, "r": r,
            "lora_alpha": alpha, "target_modules": target_modules,
            "lora_dropout": lora_dropout, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": list(saved_modules) or None,
            "base_model_name_or_path": base_model,
            "revision": None, "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None, "layers_pattern": None}


def write_adapter_folder(folder, tensors, cfg, note, metadata=None):
    """The one writer of an adapter folder: adapter_model.safetensors
    (tensors, with metadata), adapter_config.json (cfg) and
    bico_adapter.json (note: what PEFT would refuse in its config)."""
    os.makedirs(str(folder), exist_ok=True)
    meta = {"format": "pt"}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    _st.write(os.path.join(str(folder), "adapter_model.safetensors"),
              tensors, metadata=meta)
    # PEFT and libbico refuse fields they do not know in
    # adapter_config.json: the note goes beside it
    with open(os.path.join(str(folder), "bico_adapter.json"), "w") as f:
        json.dump(note, f, indent=2, sort_keys=True)
    tmp = os.path.join(str(folder), "adapter_config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(str(folder), "adapter_config.json"))


def write_pairs(folder, pairs, r, lora_alpha, saved=None,
                base_model_name_or_path=None, metadata=None,
                task_type="CAUSAL_LM", target_modules=None):
    """A PEFT LoRA adapter of trained factors, written as they are.

    pairs: {module: (B [d_out, r], A [r, d_in])} with the update
    lora_alpha / r * B A (PEFT's scale); saved: {tensor name: tensor}
    stored whole (PEFT's modules_to_save: their modules are listed).
    Factors and saved tensors are stored in float32 (PEFT's convention
    for adapter weights).  target_modules: PEFT's list (default: the
    modules' last names).  Returns the config written."""
    tensors = {}
    for m, (b, a) in sorted(pairs.items()):
        pre = "base_model.model." + m
        tensors[pre + ".lora_A.weight"] = a.detach().float().cpu() \
            .contiguous()
        tensors[pre + ".lora_B.weight"] = b.detach().float().cpu() \
            .contiguous()
    mods = set()
    for k, v in sorted((saved or {}).items()):
        tensors["base_model.model." + k] = v.detach().float().cpu() \
            .contiguous()
        mods.add(k.rsplit(".", 1)[0])
    short = sorted(target_modules or set(_short(m) for m in pairs))
    cfg = _peft_config(r, float(lora_alpha), short, sorted(mods),
                       base_model_name_or_path, task_type)
    note = {"factorization": "trained (distillation)", "left_out": []}
    note.update(metadata or {})
    write_adapter_folder(folder, tensors, cfg, note, metadata)
    return cfg
