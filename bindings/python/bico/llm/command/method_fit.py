"""bico.llm.command.method_fit: --method fit: the sequential fit run and
its scale and ridge chosen on the held-out windows, then written as a
folder or an adapter.
"""
import os
import re

import torch

from ..._status import BicoError, E_IO
from ... import safetensors as _st
from ...torch.choose import choose_on_heldout, ALPHA_GRID, HELDOUT
from ...torch.tied import _tied_groups
from ...torch.options import FitOptions
from ...torch.transfer import transfer_model
from .. import adapters as _adapters
from ..adapters import save_adapter, update_grams, low_rank
from .. import distill as _distill
from ..text import next_token_loss, lm_loss
from .arguments import _log
from .inputs import _adapter_folder


class _FitProgress(object):
    """Counts the fit's per-layer updates (the update callback of
    bico.fit.run, the driver transfer_model's fit runs on) and prints a
    line per layer while transfer_model runs."""

    def __init__(self, total, quiet):
        self.total, self.quiet, self.n = total, quiet, 0

    def line(self, dw, rank):
        """One layer's line (the streamed route calls it itself)."""
        self.n += 1
        _log(self.quiet, "fit: layer %d/%d (d_in %d, d_out %d%s)"
             % (self.n, self.total, dw.shape[1], dw.shape[0],
                "" if rank is None else ", rank %d" % rank))

    def __enter__(self):
        from ... import fit as _fit
        self._mod, self._orig = _fit, _fit.run
        prog = self
        orig = self._orig

        def run(*a, **kw):
            a = list(a)
            inner = a[3] if len(a) > 3 else kw["update"]

            def update(l, dw, db, rank):
                out = inner(l, dw, db, rank)
                prog.line(dw, rank)
                return out
            if len(a) > 3:
                a[3] = update
            else:
                kw["update"] = update
            return orig(*a, **kw)
        _fit.run = run
        return self

    def __exit__(self, *exc):
        self._mod.run = self._orig
        return False


def _apply(model, base, delta, a):
    sd = {k: ((v.double() + a * delta[k]).to(v.dtype) if k in delta else v)
          for k, v in base.items()}
    model.load_state_dict(sd)


def _fitted_layers(model):
    """The nn.Linear layers the fit updates, one progress line each: all
    but a head tied to the embedding (an untied lm_head is fitted)."""
    tied = set(n for o, al in _tied_groups(model) for n in [o] + al)
    return sum(1 for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and
               (n + ".weight" if n else "weight") not in tied)


def _fit_and_choose(a, src, srt, tgt, cal, ridges, alpha_arg, tmp, q,
                    tdtypes=None):
    """(the target's state dict, the chosen (held-out loss, ridge, alpha,
    update, adapter report, {alpha: loss}, covariances)): one fit per
    ridge, each scaled by its alpha (--alpha, or the held-out choice among
    ALPHA_GRID), the ridge chosen on the held-out windows too: the one
    held-out choice (bico.torch.choose.choose_on_heldout)."""
    base = {k: v.detach().clone() for k, v in tgt.state_dict().items()}
    n_lin = _fitted_layers(tgt)

    def fit(ridge):
        _log(q, "fit: ridge %g, %d layers" % (ridge, n_lin))
        with _FitProgress(n_lin, q):
            # the scale is chosen below, on the text's own held-out
            # windows
            new = transfer_model(src, srt, tgt, cal.batches,
                                 method="fit", options=FitOptions(
                                     ridge=ridge, alpha=1.0, holdout=0,
                                     threads=a.threads),
                                 loss_fn=next_token_loss,
                                 show_progress=not q)
        delta = {k: new[k].double() - base[k].double() for k in base
                 if k in new}
        eff, rep, cov = delta, None, None
        if a.output_lora:
            saves = [s for s in a.modules_to_save.split(",") if s]
            # each layer's inputs as the fit saw them (the earlier
            # layers updated): the reduced-rank regression of the
            # fit's own fitted values
            tgt.load_state_dict(new)
            cov = update_grams(tgt, cal.batches, delta)
            tgt.load_state_dict(base)
            rep = save_adapter(os.path.join(tmp, "probe"), tgt, delta,
                               a.rank, is_delta=True, covariance=cov,
                               modules_to_save=saves,
                               return_effective=True,
                               target_dtypes=tdtypes)
            eff = rep["effective"]
        return delta, rep, cov, eff

    def score(res, alphas):
        means, per = {}, {}
        for al in alphas:
            _apply(tgt, base, res[3], al)
            # the windows are of one length: their mean is lm_loss's
            per[al] = _distill._d.window_losses(tgt, cal.held_out)
            means[al] = sum(per[al]) / len(per[al])
        tgt.load_state_dict(base)
        return means, per

    alphas = ALPHA_GRID if alpha_arg == HELDOUT else (alpha_arg,)
    c = choose_on_heldout(ridges, fit, score, alphas,
                          log=lambda m: _log(q, m))
    delta, rep, cov, _ = c.result
    return base, (c.loss, c.ridge, c.alpha, delta, rep, c.losses, cov)


def _adapter(a, tgt, scaled, cov, rep, tdtypes):
    """The adapter of the scaled update, built in memory (its factors
    float32, saved tensors in the target's dtype), for the pairs the
    probe chose (so that alpha 0 gives zero factors, not no pairs)."""
    saves = [s for s in a.modules_to_save.split(",") if s]
    return _adapters._build(
        tgt, scaled, a.rank, a.lora_alpha,
        rep["config"]["target_modules"],
        a.base_model_name_or_path or os.path.abspath(a.target), saves, cov,
        True, None, "CAUSAL_LM", 0.0, tdtypes, torch.float32, True)


def _folder(tgt, base, scaled, tdtypes):
    """(the output folder's tensors in the target's dtypes, the update
    they carry as written, aliases of tied tensors included)."""
    groups = _tied_groups(tgt)
    alias = {al_: o for o, als in groups for al_ in als}
    out, eff = {}, {}
    for k, v in base.items():
        if k in alias:
            continue
        w = v.double() + scaled[k] if k in scaled else v.double()
        out[k] = w.to((tdtypes or {}).get(k, v.dtype))
        if k in scaled:
            eff[k] = out[k].double() - v.double()
    for al_, o in alias.items():
        if o in eff:
            eff[al_] = eff[o]
    return out, eff


def _summary(a, rep):
    tied = [k for k in rep["saved"] if k == "lm_head.weight" and
            "model.embed_tokens.weight" in rep["saved"]]
    return ("wrote %s: %d LoRA pairs (rank %d, float32%s), %d saved "
            "tensors%s; left out: %s (%.1f %% of the update's norm)" % (
                a.output_lora, len(rep["modules"]), a.rank,
                "; one on the untied lm_head" if "lm_head" in rep["modules"]
                else "", len(rep["saved"]),
                " (lm_head.weight beside the tied model.embed_tokens.weight:"
                " PEFT loads each saved module as its own copy)" if tied
                else "", _brief(rep["left_out"]) or "nothing",
                100 * rep["left_out_norm"]))


def _brief(names, most=8):
    """names for one line: a name that repeats over the layers said once,
    with the count ("model.layers.*.input_layernorm.weight x24"), in
    the order they first come; at most `most` entries, then how many
    more (the adapter's note keeps every name)."""
    groups = {}
    for n in names:
        k = re.sub(r"\.layers\.\d+\.", ".layers.*.", n)
        groups[k] = groups.get(k, 0) + 1
    items = [k + (" x%d" % c if c > 1 else "") for k, c in groups.items()]
    if len(items) > most:
        rest = sum(list(groups.values())[most:])
        items = items[:most] + ["%d more" % rest]
    return ", ".join(items)


def _write(a, tgt, base, best, cal, tdtypes):
    """The chosen update written: an adapter (--output-lora) or a model
    folder (--output), what was chosen printed and recorded.  The held-out
    loss printed and recorded is that of the output as written (factors,
    saved tensors and weights at their stored precision; a tied head as
    PEFT or load_model will have it), scored before the write."""
    _, ridge, al, delta, rep, scores, cov = best
    zero = lm_loss(tgt, cal.held_out)
    scaled = {k: v * al for k, v in delta.items()}
    if a.output_lora:
        built = _adapter(a, tgt, scaled, cov, rep, tdtypes)
        eff = built["effective"]
    else:
        out, eff = _folder(tgt, base, scaled, tdtypes)
    _apply(tgt, base, eff, 1.0)
    loss = lm_loss(tgt, cal.held_out)
    tgt.load_state_dict(base)
    meta = _fit_meta(a, al, ridge, loss, zero, cal)
    try:
        if a.output_lora:
            _adapters._write(_adapter_folder(a), built, meta)
        else:
            dest = a.output if a.output.endswith("/") else a.output + "/"
            _st.write(dest, out, metadata=dict(meta, format="pt"),
                      like=a.target)
    except (BicoError, OSError) as e:
        raise _write_error(a, e)
    if a.output_lora:
        print(_summary(a, built["report"]), flush=True)
    else:
        print("wrote %s" % a.output, flush=True)


def _write_error(a, e):
    opt = "--output-lora" if a.output_lora else "--output"
    return BicoError(getattr(e, "status", E_IO), "%s %s: cannot write it "
                     "(%s)" % (opt, a.output_lora or a.output,
                               getattr(e, "message", None) or e))


def _fit_meta(a, al, ridge, loss, zero, cal):
    """The fit's choice printed, and recorded in the output's metadata."""
    meta = {"bico_transfer_method": "fit", "bico_alpha": "%g" % al,
            "bico_ridge": "%g" % ridge,
            "bico_heldout_loss": "%.6g" % loss,
            "bico_heldout_loss_target": "%.6g" % zero,
            "bico_windows": str(cal.windows),
            "bico_window": str(a.window),
            "bico_seed": str(a.seed),
            "bico_source": a.source,
            "bico_source_tuned": a.source_tuned or "",
            "bico_lora": a.lora or ""}
    print("chosen: alpha %g, ridge %g (held-out loss %.4f; target "
          "unchanged %.4f)" % (al, ridge, loss, zero), flush=True)
    if al == 0:
        print("note: no scale helped on the held-out windows: the "
              "output is the target unchanged", flush=True)
    return meta


def _fit_windows(tgt, base, best, cal):
    """The held-out windows' losses of the fit's chosen update."""
    loss, ridge, al, delta, rep, scores, cov = best
    eff = delta if rep is None else rep["effective"]
    _apply(tgt, base, eff, al)
    per = _distill._d.window_losses(tgt, cal.held_out)
    tgt.load_state_dict(base)
    return per


def _warm_pairs(a, tgt, best, names):
    """The fit's rank-r pairs at its chosen alpha, the distillation's warm
    start ({module: (B, A)}, B A the update); modules whose update is zero
    keep PEFT's start."""
    loss, ridge, al, delta, rep, scores, cov = best
    out = {}
    for m in names:
        d = delta.get(m + ".weight")
        if d is None or al == 0 or not float(d.abs().max()) > 0:
            continue
        b, aa = low_rank(d * al, a.rank, None if cov is None
                         else cov.get(m))
        if b.shape[1] < a.rank:
            continue
        out[m] = (b, aa)
    return out
