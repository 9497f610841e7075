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
    """The target trained towards the proxy-tuned distribution
    softmax(z_B + z_A_ft - z_A) on the calibration batches that are not
    held out: Adam (lr) on the mean over tokens of KL(proxy || working
    target), one batch per step in a seeded random order; every `every`
    steps the held-out loss is measured and the best state so far (the
    untouched target is step 0) is kept, unless its gain over the target
    is within its standard error over the held-out batches (then the
    target).  loss_of(model, batches) -> per-batch losses.  Returns
    (state dict, {step: mean held-out loss})."""
    work = copy.deepcopy(target).train(False)
    for m in (source, source_tuned, target):
        m.eval()
    params = [p for p in work.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)

    def teacher(b):
        with torch.no_grad():
            return _proxy_logprobs(source, source_tuned, target, b,
                                   logits_of, "proxy-distill")
    # the teachers are kept when they are small (256 MiB), else recomputed
    first = teacher(fit_batches[0])
    keep = first.numel() * 4 * len(fit_batches) <= (256 << 20)
    cache = {0: first} if keep else {}
    opt = torch.optim.Adam(params, lr=lr)
    per = {0: loss_of(work, held_batches)}
    mean = lambda v: float(sum(v) / len(v))  # noqa: E731
    losses = {0: mean(per[0])}
    start = {k: v.detach().clone() for k, v in work.state_dict().items()}
    best = (losses[0], 0, start)
    g = torch.Generator().manual_seed(seed)
    order = []
    for it in range(1, steps + 1):
        if not order:
            order = torch.randperm(len(fit_batches), generator=g).tolist()
        i = order.pop()
        if i in cache:
            t = cache[i]
        else:
            t = teacher(fit_batches[i])
            if keep:
                cache[i] = t
        z = logits_of(work, fit_batches[i]).float()
        ls = torch.log_softmax(z, -1)
        kl = (t.exp() * (t - ls)).sum(-1).mean()
        opt.zero_grad()
        kl.backward()
        opt.step()
        if it % every == 0 or it == steps:
            per[it] = loss_of(work, held_batches)
            losses[it] = mean(per[it])
            if losses[it] < best[0]:
                best = (losses[it], it, {k: v.detach().clone() for k, v
                                         in work.state_dict().items()})
    # the least held-out loss (best, kept while training), or the target
    # where that does not beat it clearly
    if pick(losses, per, rule="least-or-zero", zero=0) != best[1]:
        best = (losses[0], 0, start)   # no clear gain: the target
    if report is not None:
        report.append({"rule": "proxy-distill", "step": best[1],
                       "losses": losses, "zero_shot": losses[0]})
    return best[2], losses
