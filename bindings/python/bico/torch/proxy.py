"""bico.torch.proxy: the proxy-tuned distribution (Liu et al., 2024) as
the target of a transfer: transfer_model's methods "proxy-fit" (the fit's
nn.Linear layers moved towards softmax(z_B + z_A_ft - z_A) by ridge steps)
and "proxy-distill" (the target trained towards it).  Both choose on
held-out batches through bico.torch.choose.pick."""
import copy

import torch
import torch.nn as nn

from .._status import BicoError, E_ARG, E_SHAPE
from .choose import pick

__all__ = ["proxy_fit", "proxy_distill"]


PROXY_GRID = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def _proxy_logprobs(source, source_tuned, target, b, logits_of, method):
    """The proxy-tuned distribution on batch b (Liu et al., 2024): log
    softmax of z_B + z_A_ft - z_A, which needs one vocabulary."""
    zb = logits_of(target, b).float()
    za = logits_of(source, b).float()
    zt = logits_of(source_tuned, b).float()
    if za.shape != zb.shape:
        raise BicoError(E_SHAPE, "transfer_model: %s needs the source's and "
                        "the target's logits on the same tokens and "
                        "vocabulary, got %s and %s"
                        % (method, tuple(za.shape), tuple(zb.shape)))
    return torch.log_softmax(zb + zt - za, -1)


def proxy_fit(source, source_tuned, target, fit_batches, held_batches,
              forward, logits_of, loss_of, ridge, grid, steps, skip,
              report=None, start=None):
    """The target moved towards the proxy-tuned distribution (Liu et al.,
    2024): softmax(z_B + z_A_ft - z_A), z the logits of each model on the
    same tokens, B's logits those of the untouched target.  Each step: one
    forward and backward pass per calibration batch gives, for every
    nn.Linear of the working target, its inputs X and G = d KL(proxy ||
    working) / d output; the layer's update is the ridge solution of
    X dW = -G (lambda = ridge tr(X^T X) / d_in, a bias column when it has
    one), all layers at once; the step size is the candidate of grid (0
    included) with the least loss on the held-out batches, and the walk
    stops at a step of 0.  Returns the working target's state dict."""
    work = copy.deepcopy(target).eval()
    if start is not None:
        work.load_state_dict(start)
    for m in (source, source_tuned, target):
        m.eval()
    mods = [(n, m) for n, m in work.named_modules()
            if isinstance(m, nn.Linear) and n not in skip]
    if not mods:
        raise BicoError(E_ARG, "transfer_model: proxy-fit found no "
                        "nn.Linear of the target to fit")
    with torch.no_grad():
        teacher = []
        for b in fit_batches:
            teacher.append(_proxy_logprobs(source, source_tuned, target, b,
                                           logits_of, "proxy-fit"))
    base = {k: v.detach().clone() for k, v in work.state_dict().items()}
    for it in range(steps):
        stats = {n: None for n, _ in mods}
        cur = {}

        def hook(m, inp, out, n=None):
            cur[n] = (inp[0], out)
        hooks = [m.register_forward_hook(
            lambda m, i, o, n=n: hook(m, i, o, n)) for n, m in mods]
        try:
            for b, t in zip(fit_batches, teacher):
                cur.clear()
                z = logits_of(work, b).float()
                ls = torch.log_softmax(z, -1)
                kl = (t.exp() * (t - ls)).sum()
                names = [n for n, _ in mods if n in cur]
                gs = torch.autograd.grad(kl, [cur[n][1] for n in names],
                                         allow_unused=True)
                for n, g in zip(names, gs):
                    if g is None:
                        continue
                    x = cur[n][0].detach()
                    x = x.reshape(-1, x.shape[-1]).double()
                    g = g.detach().reshape(-1, g.shape[-1]).double()
                    m = dict(mods)[n]
                    if m.bias is not None:
                        x = torch.cat([x, torch.ones(len(x), 1,
                                                     dtype=x.dtype)], 1)
                    xx, xg = x.T @ x, x.T @ (-g)
                    if stats[n] is None:
                        stats[n] = [xx, xg]
                    else:
                        stats[n][0] += xx
                        stats[n][1] += xg
        finally:
            for h in hooks:
                h.remove()
        delta = {}
        for n, m in mods:
            if stats[n] is None:
                continue
            xx, xg = stats[n]
            d = m.in_features
            lam = ridge * float(torch.trace(xx[:d, :d])) / d
            reg = torch.eye(len(xx), dtype=xx.dtype) * lam
            if m.bias is not None:
                reg[d, d] = 0.0
            sol = torch.linalg.lstsq(xx + reg, xg).solution  # [d(+1), out]
            delta[n + ".weight"] = sol[:d].T.float()
            if m.bias is not None:
                delta[n + ".bias"] = sol[d].float()
        cur_sd = {k: v.detach().clone() for k, v in work.state_dict().items()}
        scores = {}
        for s in grid:
            with torch.no_grad():
                for k, v in work.state_dict().items():
                    if k in delta:
                        v.copy_(cur_sd[k] + s * delta[k].to(v))
            scores[s] = loss_of(work, held_batches)
        best = pick(scores)
        with torch.no_grad():
            for k, v in work.state_dict().items():
                if k in delta:
                    v.copy_(cur_sd[k] + best * delta[k].to(v))
        if report is not None:
            report.append({"step": it, "rule": "proxy-fit", "alpha": best,
                           "losses": scores})
        if best == 0:
            break
    del base
    return {k: v.detach().clone() for k, v in work.state_dict().items()}



def proxy_distill(source, source_tuned, target, fit_batches, held_batches,
                  logits_of, loss_of, steps, lr, every, report=None,
                  seed=0):
    """The target trained towards the proxy-tuned distribution (kept for
XX
    engine (distill_model) on the batches as they are, no augmentation,
    every floating parameter trained.  logits_of(model, batch) -> logits;
    loss_of(model, batches) -> per-batch held-out losses.  Returns (state
    dict, {step: mean held-out loss})."""
    from .distill import distill_model
    rep = [] if report is None else report
    sd = distill_model(source, source_tuned, target, list(fit_batches),
                       list(held_batches), logits_of,
                       lambda m, b: loss_of(m, [b])[0], steps=steps, lr=lr,
                       every=every, augment=None, seed=seed, report=rep,
                       scales=())
    return sd, rep[-1]["losses"]
