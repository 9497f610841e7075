"""bico.torch.transfer: transfer_model, the whole-model transfer between
PyTorch models, and transfer_state_dict over a Collector.

transfer_model checks its options (in one order, so that the first wrong
one is named), holds out batches (bico.torch.choose._resolve_heldout) and
hands the run to one function per route: _route_fit (the sequential fit,
one ridge or a list chosen on held-out batches), _route_library (the
library's methods bico, bico-in, bico-out, gradfix, naive, pad),
_route_proxy_fit (bico.torch.proxy) and _route_distill (bico.torch.distill,
the proxy-tuned teacher distilled into the target).  Every scale
or ridge chosen on held-out batches is chosen by bico.torch.choose."""
import math
import os

import numpy as np
import torch
import torch.nn as nn

from .._ctx import Context
from .._names import Pairing
from .._status import BicoError, E_ARG, E_NOTFOUND, E_SHAPE, E_STATE
from ..transfer import transfer_state_dict as _transfer_np
from ._common import _default_forward, _output, _on, _device
from .collect import Collector, collect_statistics, collect_votes, \
    vocabulary_heads
from .choose import (choose_alpha, pick, choose_on_heldout, heldout_scores,
                     HELDOUT, _heldout_loss_fn, _resolve_heldout,
                     _loss_available, _alpha_grid, _batch_losses, _mean_loss)
from .tied import _tied_groups, _untied, _retied, _report_tied
from . import fit as _host
from . import ridge as _ridge
from . import options as _opts
from . import proxy as _proxy
from .proxy import PROXY_GRID

__all__ = ["transfer_state_dict", "transfer_model", "MODEL_METHODS"]


def transfer_state_dict(source_base, source_tuned, target_base, stats=None,
                        method="bico", alpha=1.0, **options):
    """A new target state dict: theta_B + alpha * tau_B.  stats: a
    Collector, a statistics dict, or a statistics file path.  What comes
    out follows bico.transfer.transfer_state_dict's rule: each value has
    the kind of target_base's value (a torch tensor of the same dtype on
    the same device for a torch tensor, so that load_state_dict takes the
    result; a NumPy array for a NumPy array).  See there for the options
    (norm_map, split, ties, votes, rank_tol, null, ...)."""
    if isinstance(stats, Collector):
        options.setdefault("split", stats.split)
        stats = stats.statistics()
    return _transfer_np(source_base, source_tuned, target_base, stats,
                        method=method, alpha=alpha, **options)


# the library's methods, then the fits this module adds
MODEL_METHODS = tuple(_opts.FAMILIES)
_PROCRUSTES_KEYS = ("rank_tol", "null", "center", "whiten", "method",
                    "completion")


def transfer_model(source, source_tuned, target, batches, method="fit",
                   options=None, loss_fn=None, step=None, forward=None,
                   report=None, show_progress=False):
    """A new state dict for target (torch tensors, the target's names and
    dtypes) carrying the fine-tune source -> source_tuned to target.

    options: the method's options (bico.torch.options): FitOptions for
    fit and proxy-fit, MapOptions for the library's methods (bico,
    bico-in, bico-out, gradfix, naive, pad), DistillOptions for distill
    and proxy-distill; None for the family's defaults, or a dict of its
    fields.  Below, each field by its name (ridge, alpha, holdout, ...;
    DistillOptions' steps, lr, every, rank, augment are the
    distill_steps, distill_lr, ... named there; MapOptions' library holds
    transfer_state_dict's other options).

    source, source_tuned, target: nn.Modules (source and source_tuned of one
    architecture).  batches: the calibration batches, iterated several
    times (a list is safest); a batch is what Collector.collect takes.
    loss_fn / step: the calibration loss, for BiCo's gradient statistics and
    GradFix's votes.  forward(model, batch): the model's output on a batch
    (default: model(x) for (x, y), model(**batch), model(batch)).

    method: bico | bico-in | bico-out (maps from statistics collected here),
    gradfix (votes collected here on the target unless votes= is given),
    naive, pad, or fit: the sequential functional fit (METHODS.md), block by
    block; every nn.Linear of the target with a Linear source partner gets
    its update by the library's fit (bico.fit.run) with ridge c = ridge;
    everything else (norms, tokens, embeddings, nn.MultiheadAttention) is
    carried by BiCo.
    ridge may be a list with alpha="heldout": one fit per value, the
    (ridge, alpha) pair with the least held-out loss is kept (report:
    "ridge", "ridge_losses").  ridge="gcv" (fit): each layer's c chosen
    in closed form by generalised cross-validation (report: per layer
    "ridge").  ridge_prior (fit): "zero" (default) or "bico": the ridge
    pulls each layer's update towards BiCo's update of the layer instead
    of towards zero, so that where the rows say little the fit falls back
    to BiCo.  general_batches (fit): batches of general text (as batches);
    the ridge's identity becomes the second moment of each layer's inputs
    on them (the target's own, scaled to trace d_in), so the penalty is
    the change of the layer's outputs on general text.
    proxy-fit: the fit (at its held-out alpha), then its nn.Linear layers
    moved towards the proxy-tuned distribution softmax(z_B + z_A_ft - z_A)
    (the logits of the three models on the same tokens, one vocabulary):
    per step, each layer's update is the ridge solution (ridge) of X dW =
    -G, G the gradient of KL(proxy || working target) with respect to its
    output, and the step size is the candidate of alpha_grid (default 0,
    0.1, 0.3, 1, 3, 10, 30, 100) with the least held-out loss; at most
    proxy_steps steps, stopping at a step of 0.  Needs held-out batches
    (alpha="heldout", the default); norms and embeddings stay the fit's.
    distill (alias proxy-distill): a copy of the target trained towards
    the proxy-tuned teacher softmax(z_B + z_A_ft - z_A) on the calibration
    batches that are not held out (bico.torch.distill; same outputs
    needed: one vocabulary or label set): Adam (distill_lr; default 1e-3
    dense, 5e-3 factors) on KL(teacher || target), one batch per step,
    distill_steps steps (default: 1500 with augmentation, else 40 passes
    over the batches, 300 to 1500), every distill_every steps the held-out loss (labels where the
    batches carry them, else the KL to the teacher on the held-out
    batches); the best state, the untouched target among the candidates
    (kept unless another beats it by more than the standard error), then
    its update scaled by the one of 0.75, 1, 1.25, 1.5 with the least
    held-out loss (1 unless another beats it clearly), is returned.
    distill_rank: None trains every floating parameter; an integer trains
    LoRA factors of that rank on every nn.Linear (merged into the result).
    distill_augment: "auto" (mixup or cutmix, drawn at every step, then
    shifts of up to 2 pixels for inputs of 4 dimensions, [N, C, H, W]
    images; mixup alone for other floating inputs; none for token ids),
    "mixup", "image" (the images' augmentation for any floating input
    whose last two dimensions are an image's, [N, H, W] greyscale too),
    None, or a callable(batch,
    torch.Generator) -> batch; the teacher is computed on each augmented
    batch.
    threads (fit, bico*): the library's thread count (BICO_CTX_THREADS)
    for the statistics and the fit's solves; None (default): PyTorch's
    (torch.get_num_threads()).
    shared_out (fit): target modules whose outputs are in the same
    coordinates as their source partner's (a classifier head over the same
    classes): D is used as it is, no output map.
    A language model's vocabulary head (the nn.Linear its
    get_output_embeddings() returns, as transformers' models and
    bico.llm's decoders have, or one tied to an nn.Embedding) has rows
    that are tokens on both sides: no output map is made for it (the
    statistics keep only its inputs).  Untied over as many tokens as its
    source partner's, the fit fits it with its logit change kept by
    token id (as the streamed route does); over another vocabulary size
    BiCo carries it (the rows both have, by id).

    Tied weights: state-dict entries of the target that are one tensor (an
    lm_head whose weight is embed_tokens.weight) are carried as one: every
    method sees the first owner that is not an nn.Linear (the embedding),
    and the result holds the same tensor object under every name.  tied
    (fit): "carry" (default) leaves a tied nn.Linear to BiCo's carried
    embedding; "fit" fits it in its segment (tokens kept as tokens: no
    output map; when the vocabularies' sizes differ it stays carried),
    and the fitted weight is also the embedding's.
    alpha: a positive number, "heldout", or "match" / "entropy" to choose
    it without labels (choose_alpha on the calibration batches; "match"
    and "entropy" not for fit, which scales the output change D by alpha
    and sets its own size).  "heldout": the update is computed from the
    calibration batches that are not held out (holdout=), then scaled by
    the candidate of alpha_grid (default ALPHA_GRID: 0, 0.25, ..., 1.5, 2)
    chosen on the held-out batches (choose_on_heldout: the least loss
    among 0, the untouched target, and the scales that beat it clearly),
    so the result is never worse there than doing nothing.
    Default (None): "heldout" for fit, bico, bico-in, bico-out,
    proxy-fit and proxy-distill (which need it) when
    there are at least 3 batches and a held-out loss can be computed
    (loss_fn, step, a dict batch with labels, or token ids: next-token
    cross-entropy of the logits); 1 otherwise.
    holdout: which calibration batches alpha="heldout" holds out: a
    share in (0, 1) of them, the last ones (default None: HOLDOUT, an
    eighth, at least one), or a list of batches to hold out (then every
    batch of batches computes the update).  Held-out batches never compute the
    update.
    alpha_grid: the candidate scales for alpha="heldout" (numbers >= 0).
    The other options (split, ties, norm_map, source_blocks, target_blocks,
    rank_tol, null, center, whiten, ...) are those of transfer_state_dict.
    Model folders: bico.llm.transfer_model (the same options, and the
    streamed fit, output=, spill_dir=, memory_budget=, ranks).
    report: a list that receives one dict per target tensor (fit: one per
    fitted layer, with rows, rank and update_norm; and a dict with "alpha"
    and "rule" when it was chosen; for "heldout" also "losses" {candidate:
    held-out loss}, "zero_shot" (the untouched target's held-out loss),
    "heldout_batches" and "fit_batches").
    """
    _no_folders(source, source_tuned, target)
    batches = _check_models(method, source, source_tuned, target, batches)
    o = _opts.resolve(method, options)
    alpha, holdout, alpha_grid, threads = (o.alpha, o.holdout, o.alpha_grid,
                                           o.threads)
    m = o if isinstance(o, _opts.MapOptions) else _opts.MapOptions()
    modules, split, ties, norm_map = m.modules, m.split, m.ties, m.norm_map
    source_blocks, target_blocks = m.source_blocks, m.target_blocks
    votes, gradfix_mode, options = m.votes, m.gradfix_mode, dict(m.library)
    f = o if isinstance(o, _opts.FitOptions) else _opts.FitOptions()
    ridge, ridge_prior, general_batches = f.ridge, f.ridge_prior, \
        f.general_batches
    tied, shared_out, proxy_steps = f.tied, f.shared_out, f.proxy_steps
    d = o if isinstance(o, _opts.DistillOptions) else _opts.DistillOptions()
    distill_steps, distill_lr, distill_every, distill_rank, \
        distill_augment = d.steps, d.lr, d.every, d.rank, d.augment
    grid = _check_steps(method, alpha_grid, proxy_steps, distill_steps,
                        distill_every, distill_lr)
    loss_of = _heldout_loss_fn(loss_fn, step, forward or _default_forward)
    alpha, fit_b, held_b = _resolve_heldout(method, alpha, holdout, batches,
                                            loss_of, alpha_grid)
    auto = _check_alpha(method, alpha)
    ridges, general_batches = _check_fit_options(
        method, auto, tied, ridge, ridge_prior, general_batches)
    a0, a1 = source.state_dict(), source_tuned.state_dict()
    if set(a0) != set(a1) or any(a0[k].shape != a1[k].shape for k in a0):
        raise BicoError(E_SHAPE, "transfer_model: source and source_tuned "
                        "have different parameters")
    b0 = target.state_dict()
    r = _Route(
        method=method, source=source, source_tuned=source_tuned,
        target=target, batches=batches, fit_b=fit_b, held_b=held_b,
        loss_fn=loss_fn, step=step, forward=forward or _default_forward,
        loss_of=loss_of, alpha=alpha, auto=auto, grid=grid, ridges=ridges,
        fopts=dict(ridge_prior=ridge_prior, general_batches=general_batches),
        modules=modules, split=split, ties=ties, norm_map=norm_map,
        votes=votes, gradfix_mode=gradfix_mode, source_blocks=source_blocks,
        target_blocks=target_blocks, shared_out=shared_out, tied=tied,
        report=report, rep=[] if report is None else report,
        show_progress=show_progress, proxy_steps=proxy_steps,
        distill_steps=distill_steps, distill_lr=distill_lr,
        distill_every=distill_every, distill_rank=distill_rank,
        distill_augment=distill_augment, threads=threads, options=options,
        a0=a0, a1=a1, b0=b0, groups=_tied_groups(target),
        topts=dict(norm_map=norm_map, split=split, ties=ties,
                   source_blocks=source_blocks, target_blocks=target_blocks,
                   gradfix_mode=gradfix_mode, **options))
    route = {"proxy-distill": _route_distill, "distill": _route_distill,
             "proxy-fit": _route_proxy_fit,
             "fit": _route_fit}.get(method, _route_library)
    return route(r)


# ---- model folders ----

def _is_folder(m):
    return isinstance(m, (str, os.PathLike))


def _no_folders(source, source_tuned, target):
    """bico.torch takes nn.Modules; model folders are bico.llm's."""
    named = [n for n, m in (("source", source), ("source_tuned",
                                                 source_tuned),
                            ("target", target)) if _is_folder(m)]
    if named:
        raise BicoError(E_ARG, "transfer_model: %s %s a model folder: "
                        "bico.torch.transfer_model takes nn.Modules; "
                        "bico.llm.transfer_model takes model folders (the "
                        "same options)" % (", ".join(named),
                                           "is" if len(named) == 1
                                           else "are each"))


# ---- the options, checked (in transfer_model's order) ----

def _check_models(method, source, source_tuned, target, batches):
    """The batches as a list, after the method and the models are
    checked."""
    if method not in MODEL_METHODS:
        raise BicoError(E_ARG, "transfer_model: unknown method %r (known: "
                        "%s)" % (method, ", ".join(MODEL_METHODS)))
    for name, m in (("source", source), ("source_tuned", source_tuned),
                    ("target", target)):
        if not isinstance(m, nn.Module):
            raise BicoError(E_ARG, "transfer_model: %s must be an nn.Module, "
                            "got %s" % (name, type(m).__name__))
    batches = list(batches)
    if not batches:
        raise BicoError(E_ARG, "transfer_model: no calibration batches")
    return batches


def _check_steps(method, alpha_grid, proxy_steps, distill_steps,
                 distill_every, distill_lr):
    """The candidate grid (proxy-fit's own by default), after the proxy
    routes' step options are checked."""
    grid = _alpha_grid(alpha_grid)
    if method == "proxy-fit" and alpha_grid is None:
        grid = list(PROXY_GRID)
    if not (isinstance(proxy_steps, int) and not isinstance(proxy_steps, bool)
            and proxy_steps >= 1):
        raise BicoError(E_ARG, "transfer_model: proxy_steps must be an "
                        "integer >= 1, got %r" % (proxy_steps,))
    for name, v, lo in (("steps", distill_steps, 1),
                        ("every", distill_every, 1)):
        if v is None and name == "steps":
            continue
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
            raise BicoError(E_ARG, "transfer_model: DistillOptions.%s must "
                            "be an integer >= %d, got %r" % (name, lo, v))
    if distill_lr is not None and not (
            isinstance(distill_lr, (int, float)) and not isinstance(
                distill_lr, bool) and math.isfinite(distill_lr)
            and distill_lr > 0):
        raise BicoError(E_ARG, "transfer_model: DistillOptions.lr must be "
                        "a positive number, got %r" % (distill_lr,))
    return grid


def _check_alpha(method, alpha):
    """The rule alpha names ("match", "entropy", "heldout"), or None for a
    number."""
    auto = alpha if isinstance(alpha, str) else None
    if auto is not None and auto not in ("match", "entropy", HELDOUT):
        raise BicoError(E_ARG, "transfer_model: alpha must be a positive "
                        "number, 'heldout', 'match' or 'entropy', got %r"
                        % (alpha,))
    if auto in ("match", "entropy") and method == "fit":
        raise BicoError(E_ARG, "transfer_model: fit takes a numeric alpha "
                        "or 'heldout' (it fits the size of the output "
                        "change itself)")
    if auto is None and not (isinstance(alpha, (int, float))
                             and not isinstance(alpha, bool)
                             and alpha > 0 and math.isfinite(alpha)):
        raise BicoError(E_ARG, "transfer_model: alpha must be a positive "
                        "number, got %r" % (alpha,))
    return auto


def _check_fit_options(method, auto, tied, ridge, ridge_prior,
                       general_batches):
    """(the ridge values, general_batches as a list or None), after tied,
    ridge, ridge_prior and general_batches are checked."""
    if tied not in ("carry", "fit"):
        raise BicoError(E_ARG, "transfer_model: tied must be 'carry' or "
                        "'fit', got %r" % (tied,))
    ridges = list(ridge) if isinstance(ridge, (list, tuple)) else [ridge]
    if not ridges or any(not ((isinstance(r, (int, float))
                               and not isinstance(r, bool)
                               and math.isfinite(r) and r >= 0)
                              or (r == "gcv" and method == "fit"))
                         for r in ridges):
        raise BicoError(E_ARG, "transfer_model: ridge must be >= 0 or, "
                        "for fit, 'gcv' (or, for fit with alpha='heldout', "
                        "a list of such), got %r" % (ridge,))
    if ridge_prior not in ("zero", "bico"):
        raise BicoError(E_ARG, "transfer_model: ridge_prior must be 'zero' "
                        "or 'bico', got %r" % (ridge_prior,))
    if (ridge_prior != "zero" or general_batches is not None) \
            and method != "fit":
        raise BicoError(E_ARG, "transfer_model: ridge_prior and "
                        "general_batches are options of method='fit', not "
                        "of %r" % (method,))
    if general_batches is not None:
        general_batches = list(general_batches)
        if not general_batches:
            raise BicoError(E_ARG, "transfer_model: general_batches is "
                            "empty (give general-text batches, or None for "
                            "the identity penalty)")
    if len(ridges) > 1 and (method != "fit" or auto != HELDOUT):
        raise BicoError(E_ARG, "transfer_model: a list of ridge values is "
                        "chosen among on held-out batches: it needs "
                        "method='fit' and alpha='heldout'")
    return ridges, general_batches


# ---- the routes ----

class _Route(object):
    """What a route of transfer_model works with: the options as checked
    (attributes of the same names), fit_b / held_b (the batches that
    compute the update / choose on held-out batches), loss_of (a held-out
    batch's loss), auto (the rule alpha names, or None), grid (the
    candidate scales), ridges, fopts (the fit's ridge_prior and
    general_batches), a0 / a1 / b0 (the state dicts), groups (the target's
    tied weights), topts (transfer_state_dict's options) and rep (report,
    or a list nobody reads)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _route_distill(r):
    from .distill import distill_model
    held = r.loss_of if _loss_available(r.loss_of, r.held_b[0]) else None
    rep = []
    new = distill_model(
        r.source, r.source_tuned, r.target, r.fit_b, r.held_b,
        _on(r.forward, _device(r.target)), held, steps=r.distill_steps,
        lr=r.distill_lr, every=r.distill_every, rank=r.distill_rank,
        augment=r.distill_augment, report=rep)
    for e in rep:        # the report says the method as it was asked for
        e["rule"] = r.method
    r.rep.extend(rep)
    _report_tied(r.rep, r.groups)
    out = {k: new[k].cpu() for k in new}
    return _retied(out, r.b0, r.groups)


def _route_proxy_fit(r):
    tied_keys = set(k for o, al in r.groups for k in [o] + al)
    skip = set(n for n, m in r.target.named_modules()
               if isinstance(m, nn.Linear) and any(
                   (n + "." + p) in tied_keys
                   for p, _ in m.named_parameters(recurse=False)))
    # the start: the fit at its held-out alpha (same batches)
    start = transfer_model(
        r.source, r.source_tuned, r.target, r.fit_b, method="fit",
        options=_opts.FitOptions(
            modules=r.modules, split=r.split, ties=r.ties,
            norm_map=r.norm_map, source_blocks=r.source_blocks,
            target_blocks=r.target_blocks, ridge=r.ridges[0],
            shared_out=r.shared_out, tied=r.tied, holdout=r.held_b,
            threads=r.threads, library=dict(r.options)),
        loss_fn=r.loss_fn, step=r.step, forward=r.forward, report=r.rep,
        show_progress=r.show_progress)
    new = _proxy.proxy_fit(
        r.source, r.source_tuned, r.target, r.fit_b, r.held_b, None,
        lambda m, b: _output(_on(r.forward, _device(m))(m, b)),
        lambda m, bs: _mean_loss(m, bs, r.loss_of), r.ridges[0], r.grid,
        r.proxy_steps, skip, r.rep, start=start)
    return _retied({k: v.cpu() for k, v in new.items()}, r.b0, r.groups)


def _statistics(r):
    """The statistics BiCo's maps (bico*, fit) need, on the update's
    batches; None for the other methods."""
    if not (r.method.startswith("bico") or r.method == "fit"):
        return None
    return collect_statistics(r.source, r.target, r.fit_b, r.loss_fn,
                              modules=r.modules, split=r.split, step=r.step,
                              source_blocks=r.source_blocks,
                              target_blocks=r.target_blocks,
                              sums=bool(r.options.get("center")),
                              grams=bool(r.options.get("whiten")),
                              show_progress=r.show_progress,
                              threads=torch.get_num_threads()
                              if r.threads is None else r.threads)


def _route_fit(r):
    col = _statistics(r)
    try:
        a = 1.0 if r.auto else r.alpha
        if len(r.ridges) > 1:
            return _fit_ridges(r, col, a)
        new = _fit(r.source, r.source_tuned, r.target, r.fit_b, r.forward,
                   col, r.a0, r.a1, r.b0, a, r.ridges[0], r.topts, r.report,
                   r.show_progress, tuple(r.shared_out or ()), r.groups,
                   r.tied, r.threads, **r.fopts)
        if r.auto is None:
            return new
        return _scale_chosen(r, _delta(new, r.b0))
    finally:
        col.close()


def _fit_ridges(r, col, a):
    """Each ridge fitted, (ridge, alpha) chosen together on the held-out
    batches (choose_on_heldout)."""
    def fit(ridge):
        frep = [] if r.report is not None else None
        new = _fit(r.source, r.source_tuned, r.target, r.fit_b, r.forward,
                   col, r.a0, r.a1, r.b0, a, ridge, r.topts, frep,
                   r.show_progress, tuple(r.shared_out or ()), r.groups,
                   r.tied, r.threads, **r.fopts)
        return _delta(new, r.b0), frep

    c = choose_on_heldout(r.ridges, fit, lambda res, alphas: heldout_scores(
        r.target, res[0], r.held_b, alphas, r.loss_of), r.grid)
    delta, frep = c.result
    if r.report is not None:
        r.report.extend(frep)
    r.rep.append({"alpha": c.alpha, "rule": HELDOUT, "losses": c.losses,
                  "zero_shot": c.losses.get(0.0, _mean_loss(
                      r.target, r.held_b, r.loss_of)),
                  "ridge": c.ridge, "ridge_losses": c.ridge_losses,
                  "heldout_batches": len(r.held_b),
                  "fit_batches": len(r.fit_b)})
    return _retied(_apply(r.b0, delta, c.alpha), r.b0, r.groups)


def _route_library(r):
    """The library's methods (bico, bico-in, bico-out, gradfix, naive,
    pad) through transfer_state_dict."""
    col = _statistics(r)
    votes = r.votes
    if r.method == "gradfix" and votes is None:
        votes = collect_votes(r.target, r.fit_b, r.loss_fn, step=r.step,
                              mean=r.gradfix_mode == "mean",
                              show_progress=r.show_progress)
    try:
        a = 1.0 if r.auto else r.alpha
        new, delta = transfer_state_dict(
            *(_untied(d, r.groups) for d in (r.a0, r.a1, r.b0)), stats=col,
            method=r.method, alpha=a, votes=votes, report=r.rep,
            return_delta=True, **r.topts)
        _report_tied(r.rep, r.groups)
        if r.auto is None:
            return _retied(new, r.b0, r.groups)
        return _scale_chosen(r, _retied(delta, r.b0, r.groups))
    finally:
        if col is not None:
            col.close()


def _scale_chosen(r, delta):
    """The target moved by delta at the scale the rule r.auto chooses
    (choose_alpha), the choice reported."""
    if r.auto == HELDOUT:
        best, scores = choose_alpha(r.source, r.source_tuned, r.target,
                                    delta, r.held_b, rule=HELDOUT,
                                    forward=r.forward, grid=r.grid,
                                    loss_fn=r.loss_fn, step=r.step)
        zero = scores[0.0] if 0.0 in scores else \
            _mean_loss(r.target, r.held_b, r.loss_of)
        r.rep.append({"alpha": best, "rule": HELDOUT,
                      "losses": scores, "zero_shot": zero,
                      "heldout_batches": len(r.held_b),
                      "fit_batches": len(r.fit_b)})
    else:
        best, _ = choose_alpha(r.source, r.source_tuned, r.target, delta,
                               r.batches, rule=r.auto, forward=r.forward)
        r.rep.append({"alpha": best, "rule": r.auto})
    return _retied(_apply(r.b0, delta, best), r.b0, r.groups)


def _delta(new, b0):
    """The update new - b0 of the floating tensors (float32, on the
    CPU)."""
    return {k: new[k].float() - b0[k].detach().float().cpu()
            for k in b0 if k in new and new[k].is_floating_point()}


def _apply(b0, delta, alpha):
    out = {}
    for k, v in b0.items():
        if k in delta:
            d = torch.as_tensor(np.asarray(delta[k]))
            out[k] = (v.detach().float().cpu() + alpha * d).to(v.dtype)
        else:
            out[k] = v.detach().cpu().clone()
    return out



def _fit(source, source_tuned, target, batches, forward, col, a0, a1, b0,
         alpha, ridge, topts, report, show_progress, shared_out, groups,
         tied, threads=None, ridge_prior="zero", general_batches=None):
    names = dict(target.named_modules())
    for n in shared_out:
        if not isinstance(names.get(n), nn.Linear):
            raise BicoError(E_NOTFOUND, "transfer_model: shared_out names "
                            "%r, which is no nn.Linear of the target" % (n,))
    try:
        from ..fit import run  # noqa: F401 (the fit's driver)
    except ImportError as e:
        raise BicoError(E_STATE, "transfer_model: method fit needs bico.fit "
                        "(%s)" % e)
    procrustes = {k: v for k, v in topts.items() if k in _PROCRUSTES_KEYS}
    maps = col.maps(**procrustes)
    pairing = Pairing(a0, b0, topts.get("source_blocks"),
                      topts.get("target_blocks"))
    # BiCo carries what the fit does not own (norms, tokens, MHA)
    rep = []
    new_bico = transfer_state_dict(*(_untied(d, groups) for d in (a0, a1, b0)),
                                   stats=col, method="bico", alpha=alpha,
                                   report=rep, **topts)
    new_bico = _retied(new_bico, b0, groups)
    _report_tied(rep, groups)
    # a tied nn.Linear (lm_head sharing the embedding): left to BiCo's
    # carried embedding, or fitted from it (tied="fit") with its rows kept
    # as tokens when both vocabularies have the same size
    tied_keys = set(k for o, al in groups for k in [o] + al)
    smods = dict(source.named_modules())
    skip, shared_out = set(), set(shared_out)
    fitted = set()
    heads = vocabulary_heads(target)
    for n, m in target.named_modules():
        if not (isinstance(m, nn.Linear) and n in maps):
            continue
        keys = set((n + "." + p) if n else p
                   for p, _ in m.named_parameters(recurse=False))
        if keys & tied_keys and tied == "carry":
            skip.add(n)
            continue
        if keys & tied_keys or n in heads:
            # a vocabulary's rows are tokens on both sides: fitted with
            # its logit change kept by id when both vocabularies have one
            # size, as the streamed route does; else left to BiCo's carry
            # (the rows both have, by id, for the library's vocabulary
            # names)
            s = smods.get(pairing.source_name(n))
            if not (isinstance(s, nn.Linear) and
                    s.out_features == m.out_features):
                skip.add(n)
                continue
            shared_out.add(n)
        fitted.update(keys - tied_keys)
    start = {k: (b0[k] if k in fitted else new_bico[k].to(b0[k].device))
             for k in b0}
    freport = [] if report is not None else None
    prior = None
    if ridge_prior == "bico":
        # BiCo's update of each fitted layer's weight (at this alpha)
        prior = {}
        for n, m in target.named_modules():
            k = (n + ".weight") if n else "weight"
            if isinstance(m, nn.Linear) and k in fitted:
                prior[n] = (new_bico[k].detach().double().cpu()
                            - b0[k].detach().double().cpu()).numpy()
    metric = None
    if general_batches is not None:
        metric = _ridge._input_moments(target, general_batches,
                                      _on(forward, _device(target)))
    # one context for the layers' fits (made and solved one at a time, on
    # this thread), at the caller's thread count
    ctx = Context(threads=torch.get_num_threads() if threads is None
                  else threads)
    out = _host.fit_model(
        source, source_tuned, target, batches, _on(forward, _device(target)),
        maps, pairing, start, alpha, ridge, ctx, freport,
        show_progress, tuple(shared_out), skip, prior=prior, metric=metric)
    if report is not None:
        done = set(e["name"] for e in freport)
        report.extend(e for e in rep if e["name"].rsplit(".", 1)[0]
                      not in done or e.get("handling") == "shared")
        report.extend(freport)
    return _retied({k: v.cpu() for k, v in out.items()}, b0, groups)

