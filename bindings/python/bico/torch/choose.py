"""bico.torch.choose: the held-out choice, in one place.  Every route of
transfer_model (fit, bico, proxy-fit, proxy-distill) and the command
(python3 -m bico.llm) choose among candidates (a scale alpha, a ridge, a
step size, a checkpoint) by pick: the least mean loss on held-out batches,
the smaller candidate on a tie, and, where the untouched target is a
candidate, the standard-error rule (_helps) that another candidate must
beat it clearly.

Here too: which calibration batches are held out (_resolve_heldout, from
transfer_model's options alpha, holdout and alpha_grid), the loss a batch
gives (_heldout_loss_fn: step, loss_fn, a dict batch's .loss or next-token
cross-entropy on token ids), the per-batch losses of a model
(_batch_losses), and choose_alpha, the scale of an update chosen on
batches ("heldout", "match", "entropy")."""
import math
from collections import namedtuple

import numpy as np
import torch
import torch.nn.functional as F

from .._baseline import naive as _naive
from .._args import plain as _as_numpy
from .._status import BicoError, E_ARG
from ._common import (_to_device, _device, _default_step, _default_forward,
                      _output, _on)

__all__ = ["choose_alpha", "pick", "choose_on_heldout", "Choice",
           "HELDOUT", "HOLDOUT", "ALPHA_GRID", "held_out_count"]

# The held-out choice's one spelling, share and grid: transfer_model's
# alpha="heldout" and holdout, the command's --alpha heldout and
# --holdout, text_batches' holdout, every route's scale candidates.
HELDOUT = "heldout"
HOLDOUT = 0.125
ALPHA_GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


# ---- the choice ----

def _helps(zero, cand):
    """Whether per-batch held-out losses cand beat zero (the untouched
    target's) clearly: a mean gain larger than its standard error (with
    one batch: any mean gain)."""
    d = [z - c for z, c in zip(zero, cand)]
    m = sum(d) / len(d)
    if len(d) < 2:
        return m > 0
    var = sum((x - m) ** 2 for x in d) / (len(d) - 1)
    return m > math.sqrt(var / len(d))


def pick(losses, per=None, rule="least", zero=0.0):
    """The candidate chosen on held-out batches.  losses: {candidate: mean
    held-out loss}, in the order the candidates were tried (increasing:
    scales, steps, indices into a list); per: {candidate: [per-batch
    held-out losses]} (rules "clear" and "least-or-zero"); zero: the
    candidate that is the untouched target (alpha 0, step 0).

    rule "least": the least loss, the earlier candidate on a tie.
    "clear": the same among zero and the candidates whose per-batch losses
    beat zero's clearly (_helps: a mean gain larger than its standard
    error); without zero among the candidates, "least".
    "least-or-zero": the least loss, replaced by zero unless it beats
    zero clearly."""
    cands = list(losses)
    if rule == "clear":
        cands = [c for c in cands if zero not in per or c == zero
                 or _helps(per[zero], per[c])]
    elif rule not in ("least", "least-or-zero"):
        raise BicoError(E_ARG, "pick: rule must be 'least', 'clear' or "
                        "'least-or-zero', got %r" % (rule,))
    best = min(cands, key=lambda c: (losses[c], c))
    if rule == "least-or-zero" and best != zero and \
            not _helps(per[zero], per[best]):
        best = zero
    return best


Choice = namedtuple("Choice", "loss ridge alpha result losses per "
                    "ridge_losses")
Choice.__doc__ = """The held-out choice of choose_on_heldout: loss (the
mean held-out loss at the chosen scale), ridge, alpha, result (what
fit(ridge) returned), losses ({alpha: mean held-out loss}), per ({alpha:
per-batch or per-window losses}), ridge_losses ({ridge: loss at its
chosen alpha})."""


def choose_on_heldout(ridges, fit, score, alphas, drop=None, log=None):
    """The held-out choice every route and the command make: for each
    ridge (in order) result = fit(ridge); means, per = score(result,
    alphas), the mean and the per-batch (or per-window) held-out losses at
    each scale; the scale by pick(rule "clear", zero 0.0: a scale other
    than 0 must beat the untouched target clearly where 0 is a
    candidate), the ridge by the least loss at its scale (the earlier on
    a tie).  drop(result) is called on each result not kept; log(line)
    gets each scale's loss.  alphas: the candidates (ALPHA_GRID), or one
    given scale.  Returns a Choice."""
    best, tried = None, {}
    for ridge in ridges:
        res = fit(ridge)
        means, per = score(res, list(alphas))
        if log is not None and len(alphas) > 1:
            for a in alphas:
                log("alpha %-5g held-out loss %.4f" % (a, means[a]))
        al = pick({a: means[a] for a in alphas}, per, rule="clear",
                  zero=0.0)
        tried[ridge] = means[al]
        if best is None or means[al] < best.loss:
            if best is not None and drop is not None:
                drop(best.result)
            best = Choice(means[al], ridge, al, res, means, per, None)
        elif drop is not None:
            drop(res)
    return best._replace(ridge_losses=tried)


def held_out_count(n, share):
    """How many of n calibration items (windows, batches) a share holds
    out: none for share 0 or fewer than 2 items, else at least one."""
    if share == 0 or n < 2:
        return 0
    return max(1, int(round(n * share)))


# ---- the held-out batches and their losses ----

_HELDOUT_METHODS = ("fit", "bico", "bico-in", "bico-out", "proxy-fit",
                    "proxy-distill", "distill")
# these choose on held-out batches even without a loss there (the KL to
# the teacher then)
_TEACHER_METHODS = ("distill", "proxy-distill")


def _alpha_grid(grid):
    """alpha_grid checked: numbers >= 0, sorted, without repeats."""
    if grid is None:
        return list(ALPHA_GRID)
    try:
        g = [float(x) for x in grid if not isinstance(x, bool)]
        ok = len(g) == len(list(grid)) and len(g) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok or any(not (math.isfinite(x) and x >= 0) for x in g):
        raise BicoError(E_ARG, "transfer_model: alpha_grid must be a "
                        "non-empty list of finite numbers >= 0, got %r"
                        % (grid,))
    return sorted(set(g))


def _token_ids(batch):
    """The token ids of a batch without labels: an integer tensor of at
    least two dimensions [batch, tokens], or a dict's input_ids."""
    x = batch.get("input_ids") if isinstance(batch, dict) else batch
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and \
            not x.is_floating_point() and not x.is_complex() and \
            x.dtype != torch.bool:
        return x
    return None


def _heldout_loss_fn(loss_fn, step, forward):
    """loss(model, batch) -> float for alpha="heldout", or None where a
    batch gives no loss: step, else loss_fn as the calibration uses it,
    else a dict batch's model(**batch).loss (with labels), else next-token
    cross-entropy of the logits on token ids."""
    def loss(model, batch):
        b = _to_device(batch, _device(model))
        if step is not None:
            out = step(model, b)
        elif loss_fn is not None:
            out = _default_step(loss_fn)(model, b)
        elif isinstance(b, dict) and "labels" in b:
            out = model(**b).loss
        else:
            ids = _token_ids(b)
            if ids is None:
                return None
            logits = _output(forward(model, b)).float()
            out = F.cross_entropy(
                logits[..., :-1, :].reshape(-1, logits.shape[-1]),
                ids[..., 1:].reshape(-1).to(logits.device))
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise BicoError(E_ARG, "transfer_model: the held-out loss must "
                            "be a scalar tensor, got %s"
                            % type(out).__name__)
        return float(out)
    loss.static = (step is not None or loss_fn is not None)
    return loss


def _loss_available(loss_of, batch):
    if loss_of.static:
        return True
    if isinstance(batch, dict) and "labels" in batch:
        return True
    return _token_ids(batch) is not None


def _resolve_heldout(method, alpha, holdout, batches, loss_of, grid):
    """(alpha, batches for the update, held-out batches) from the options
    alpha, holdout and alpha_grid (see transfer_model).  holdout: None
    (HOLDOUT of the batches where the scale is chosen), a share in [0,
    1), or a list of held-out batches."""
    explicit_list = isinstance(holdout, list)
    if explicit_list:
        if not holdout:
            raise BicoError(E_ARG, "transfer_model: holdout is an empty "
                            "list of batches")
    elif holdout is not None and not (
            isinstance(holdout, (int, float)) and not isinstance(holdout, bool)
            and math.isfinite(holdout) and 0 <= holdout < 1):
        raise BicoError(E_ARG, "transfer_model: holdout must be None (an "
                        "eighth of the batches), a share of the "
                        "calibration batches in [0, 1) or a list of "
                        "held-out batches, got %r" % (holdout,))
    off = not explicit_list and holdout is not None and holdout == 0
    given = explicit_list or (holdout is not None and not off)
    if alpha is None:
        if off:
            alpha = 1.0
        elif given or (method in _HELDOUT_METHODS and len(batches) >= 3
                       and (_loss_available(loss_of, batches[0])
                            or method in _TEACHER_METHODS)):
            alpha = HELDOUT
        else:
            alpha = 1.0
    if (method.startswith("proxy") or method in _TEACHER_METHODS) and \
            alpha != HELDOUT:
        raise BicoError(E_ARG, "transfer_model: %s chooses its steps "
                        "on held-out batches: alpha must be 'heldout' "
                        "(default) and holdout not 0, with a loss" % method)
    if alpha != HELDOUT:
        if given:
            raise BicoError(E_ARG, "transfer_model: holdout applies to "
                            "alpha='heldout' (default), not to alpha=%r"
                            % (alpha,))
        if grid is not None:
            raise BicoError(E_ARG, "transfer_model: alpha_grid applies to "
                            "alpha='heldout' (default), not to alpha=%r"
                            % (alpha,))
        return alpha, batches, []
    if off:
        raise BicoError(E_ARG, "transfer_model: alpha='heldout' needs "
                        "held-out batches, but holdout is 0")
    if explicit_list:
        held, fit_b = holdout, batches
    else:
        k = held_out_count(len(batches),
                           HOLDOUT if holdout is None else holdout)
        if k < 1 or len(batches) - k < 1:
            raise BicoError(E_ARG, "transfer_model: holdout=%r leaves no "
                            "%s (%d batches)" % (
                                holdout, "held-out batch" if k < 1 else
                                "calibration batch for the update",
                                len(batches)))
        fit_b, held = batches[:-k], batches[-k:]
    if not _loss_available(loss_of, held[0]) and \
            method not in _TEACHER_METHODS:
        raise BicoError(E_ARG, "transfer_model: alpha='heldout' needs a "
                        "loss on the held-out batches: pass loss_fn or "
                        "step, or batches of token ids")
    return alpha, fit_b, held


def _mean_loss(model, batches, loss_of):
    vals = _batch_losses(model, batches, loss_of)
    return float(sum(vals) / len(vals))


def _batch_losses(model, batches, loss_of):
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            vals = [loss_of(model, b) for b in batches]
    finally:
        model.train(was)
    if any(v is None for v in vals):
        raise BicoError(E_ARG, "transfer_model: a held-out batch gives no "
                        "loss: pass loss_fn or step")
    return [float(v) for v in vals]


def _scaled(base, delta, g):
    """The state dict theta + g delta: base's tensors, those named in delta
    moved by g times their update (in float32, then in the tensor's own
    dtype).  A non-empty float tensor held on the CPU goes through the
    library's bico_baseline_naive (which refuses an update whose shape is
    not the tensor's; a 0-d tensor as one of shape [1]); one on an
    accelerator stays there (torch), since a round trip to host memory per
    candidate would cost more than the sum."""
    sd = {}
    for k, v in base.items():
        if k not in delta:
            sd[k] = v
        elif v.device.type == "cpu" and v.is_floating_point() and v.numel():
            out = v.float().numpy().copy()
            d = delta[k]
            if out.ndim == 0:  # the library's shapes have a dimension
                out, d = out.reshape(1), np.reshape(_as_numpy(d), -1)
            try:
                _naive(d, out.shape, alpha=g, out=out, beta=1.0)
            except BicoError as e:
                raise BicoError(e.status, "choose_alpha: the update of %s: "
                                "%s" % (k, e.message))
            sd[k] = torch.from_numpy(out.reshape(v.shape)).to(v.dtype)
        else:
            sd[k] = (v.float() + g * torch.as_tensor(
                np.asarray(delta[k])).float().to(v.device)).to(v.dtype)
    return sd


def choose_alpha(source, source_tuned, target, delta, batches, rule="match",
                 forward=None, grid=None, loss_fn=None, step=None):
    """The scale alpha of an update delta ({target tensor: array}) chosen
    without labels on the calibration batches; returns (alpha, {alpha:
    score}).

    rule "match": the smallest alpha at which the output change on the
    target, ||f(theta_B + alpha delta) - f(theta_B)||, reaches the change
    the fine-tune made to the source, ||f_A_ft - f_A||, on the same inputs
    (or the candidate just below it when that is closer in log ratio; the
    closest overall when it never does).  The change saturates for large
    alpha, so the closest overall would be an arbitrary pick among
    near-ties.  rule "entropy": the alpha with the least mean prediction
    entropy of the updated target.  rule "heldout": the alpha with the
    least mean loss on batches (held-out calibration batches: loss_fn /
    step as transfer_model takes them, or next-token cross-entropy on
    token ids) among 0 and the candidates whose mean gain over 0 exceeds
    its standard error over the batches (any gain with one batch); the
    smaller alpha wins a tie.  grid:
    the candidates (default 0.1 .. 8, geometric; "heldout": ALPHA_GRID,
    0 to 2)."""
    if rule not in ("match", "entropy", HELDOUT):
        raise BicoError(E_ARG, "choose_alpha: rule must be 'match', "
                        "'entropy' or 'heldout', got %r" % (rule,))
    forward = forward or _default_forward
    batches = list(batches)
    if rule == HELDOUT:
        return _choose_heldout(target, delta, batches, _alpha_grid(grid),
                               _heldout_loss_fn(loss_fn, step, forward))
    grid = list(grid) if grid is not None else \
        [float(x) for x in np.round(np.geomspace(0.1, 8.0, 25), 4)]
    if not grid or any(not g > 0 for g in grid):
        raise BicoError(E_ARG, "choose_alpha: the grid must hold positive "
                        "numbers")
    import copy
    work = copy.deepcopy(target).eval()
    base = {k: v.detach().clone() for k, v in target.state_dict().items()}
    fb = _on(forward, _device(target))
    with torch.no_grad():
        ref_b = [_output(fb(target.eval(), b)).float() for b in batches]
        if rule == "match":
            fa = _on(forward, _device(source))
            want = sum(float((_output(fa(source_tuned.eval(), b)).float() -
                              _output(fa(source.eval(), b)).float())
                             .pow(2).sum()) for b in batches)
        scores, signed = {}, {}
        for g in grid:
            sd = _scaled(base, delta, g)
            work.load_state_dict(sd)
            outs = [_output(fb(work, b)).float() for b in batches]
            if rule == "match":
                got = sum(float((o - r).pow(2).sum())
                          for o, r in zip(outs, ref_b))
                signed[g] = math.log((got + 1e-30) / (want + 1e-30))
                scores[g] = abs(signed[g])
            else:
                ent = [-(torch.log_softmax(o, -1).exp() *
                         torch.log_softmax(o, -1)).sum(-1).mean()
                       for o in outs]
                scores[g] = float(sum(ent) / len(ent))
    if rule == "match":
        # the output change saturates (and may wobble) past the right
        # size: take the first candidate where it reaches the source's,
        # or the one before it if that is closer, not the global argmin
        grid = sorted(grid)
        for i, g in enumerate(grid):
            if signed[g] >= 0:
                if i and scores[grid[i - 1]] < scores[g]:
                    return grid[i - 1], scores
                return g, scores
    best = min(grid, key=lambda g: scores[g])
    return best, scores


def _choose_heldout(target, delta, batches, grid, loss_of):
    """(alpha, {alpha: mean held-out loss}) of one update: the held-out
    choice (choose_on_heldout) among the scales of grid."""
    c = choose_on_heldout([None], lambda _: delta,
                          lambda d, alphas: heldout_scores(
                              target, d, batches, alphas, loss_of), grid)
    return c.alpha, c.losses


def heldout_scores(target, delta, batches, grid, loss_of):
    """({alpha: mean loss}, {alpha: per-batch losses}) on the held-out
    batches of target moved by alpha times delta, for each alpha of
    grid."""
    import copy
    if not batches:
        raise BicoError(E_ARG, "choose_alpha: no held-out batches")
    work = copy.deepcopy(target).eval()
    base = {k: v.detach().clone() for k, v in target.state_dict().items()}
    scores, per = {}, {}
    for g in grid:
        sd = _scaled(base, delta, g)
        work.load_state_dict(sd)
        per[g] = _batch_losses(work, batches, loss_of)
        scores[g] = float(sum(per[g]) / len(per[g]))
    return scores, per
