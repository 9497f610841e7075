"""bico.torch.tied: tied weights, found once for every route and the
adapter writer.  State-dict entries that are one tensor (an lm_head whose
weight is embed_tokens.weight) are carried as one: every method sees the
owner (the first entry whose module is not an nn.Linear), the files hold
the owner only (Hugging Face's convention), and the result holds the same
tensor object under every name."""
import torch
import torch.nn as nn


def _shared_tensors(model):
    """Lists of state-dict names that are one tensor (the same Parameter
    under two names, or views of the same memory with the same shape and
    strides), in state-dict order."""
    by = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if isinstance(v, torch.Tensor) and v.numel() and \
                v.device.type != "meta":
            key = (str(v.device), v.data_ptr(), tuple(v.shape),
                   tuple(v.stride()), v.dtype)
            by.setdefault(key, []).append(k)
    return [names for names in by.values() if len(names) > 1]


def _tied_groups(model):
    """[(owner, [aliases])]: the lists of _shared_tensors.  The owner is
    the first entry whose module is not an nn.Linear (the embedding of a
    tied lm_head), else the first."""
    linear = set()
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            linear.update((n + "." if n else "") + p
                          for p, _ in m.named_parameters(recurse=False))
    groups = []
    for names in _shared_tensors(model):
        owner = next((n for n in names if n not in linear), names[0])
        groups.append((owner, [n for n in names if n != owner]))
    return groups


def _untied(sd, groups):
    """sd without the aliases of tied groups (Hugging Face's file
    convention: a tied lm_head.weight is not written)."""
    drop = set(a for _, al in groups for a in al)
    return {k: v for k, v in sd.items() if k not in drop}


def _retied(out, b0, groups):
    """out with every alias holding its owner's tensor (the same object),
    in b0's order."""
    alias = {a: o for o, al in groups for a in al}
    return {k: out[alias.get(k, k)] for k in b0 if alias.get(k, k) in out}


def _report_tied(rep, groups):
    for owner, al in groups:
        for a in al:
            rep.append({"name": a, "handling": "shared", "shares": owner})
