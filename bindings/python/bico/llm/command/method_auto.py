"""bico.llm.command.method_auto: --method auto: the routes run in turn and
the one with the least held-out loss written (the untouched target
included); the streamed runs of each.
"""
import os
import sys
import time

import numpy as np
import torch

from ... import _heap
from ..._status import BicoError
from ... import safetensors as _st
from ...torch.choose import pick
from ...torch.tied import _tied_groups
from ..adapters import write_pairs
from .. import distill as _distill
from .. import options as opts
from ..options import vocab_size as _vocab
from ..text import lm_loss
from ...torch.choose import ALPHA_GRID, HELDOUT
from .arguments import _log
from .inputs import _adapter_folder, _load_target
from .method_distill import (_across_from_folders, _byte_teacher_wanted,
                             _distill_target, _generated,
                             _generated_from_folders, _mode,
                             _teacher_from_folders)
from .method_fit import (_FitProgress, _fit_and_choose, _fit_meta,
                         _fit_windows, _summary, _warm_pairs, _write,
                         _write_error)


ROUTES = {0: "target", 1: "fit", 2: "distill"}


def _run_routes(a, models, tgt, cal, ridges, alpha_arg, tmp, q, tdtypes,
                cal_d=None):
    """Runs the routes --method names and returns (chosen route, {route:
    per-window held-out losses}, fit result or None, distillation result
    or None, the target's original state).  cal_d: the distillation's
    windows when its teacher was computed on other windows than cal's
    (the user's and the written ones); by default the written ones are
    added here when the source pair is in models."""
    log = lambda *m: _log(q, *m)  # noqa: E731
    base = _original_state(a, tgt)
    per = {0: _held_windows(a, tgt, cal)}
    fit = res = None
    warm = a.init == "warm" and a.output_lora is not None
    if a.method in ("fit", "auto") or (warm and a.method == "distill"):
        _, fit = _fit_and_choose(a, models["source"], models["tuned"], tgt,
                                 cal, ridges, alpha_arg, tmp, q, tdtypes)
        if a.method != "distill":
            per[1] = _fit_windows(tgt, base, fit, cal)
    if a.method in ("distill", "auto"):
        init = None
        if warm and _mode(a) == "lora" and fit is not None:
            init = _warm_pairs(a, tgt, fit, _distill.lora_modules(
                tgt, [m for m in a.target_modules.split(",") if m]))
        dcal = cal_d if cal_d is not None else _generated(
            a, (models["source"], models["tuned"], tgt), cal, q) \
            if "source" in models else cal
        res = _distill_target(a, tgt, dcal, log, tmp, init, models)
        per[2] = res.per_window
    chosen, means = _choose_route(per, log)
    return chosen, means, fit, res, base


def _held_windows(a, model, cal):
    """model's loss on every held-out window; across ranks each scores
    its rows and every rank gets them all, in order (bico.llm.shard)."""
    if a.ranks.size == 1:
        return _distill._d.window_losses(model, cal.held_out)
    from ..shard import RowShard, window_losses
    return window_losses(model, RowShard(a.ranks, cal.held_out))


def _original_state(a, tgt):
    """The target's weights that a restore after the routes needs: every
    one, or only the saved tensors (--modules-to-save) when the only route
    trains LoRA factors (the frozen weights never change): a 0.5B target
    is 1 GB in bf16, not to be held twice."""
    if a.method == "distill" and _mode(a) == "lora":
        saves = [s for s in a.modules_to_save.split(",") if s]
        keep = set(_distill.saved_parameters(tgt, saves)) if saves else ()
        return {k: v.detach().clone() for k, v in tgt.state_dict().items()
                if k in keep}
    return {k: v.detach().clone() for k, v in tgt.state_dict().items()}


def _choose_route(per, log):
    """(the route kept, {route: mean held-out loss}) from {route:
    per-window held-out losses}: the untouched target unless a route
    beats it clearly (pick, rule "clear")."""
    means = {r: sum(v) / len(v) for r, v in per.items()}
    chosen = pick(means, per, rule="clear", zero=0)
    log("held-out next-token loss on %d windows: %s" % (
        len(per[0]), "; ".join("%s %.4f" % (ROUTES[r], means[r])
                               for r in sorted(means))))
    return chosen, means


def _restore(tgt, res, base):
    """The target back to its original weights, the factors detached."""
    if res is not None and res.adapter is not None:
        res.adapter.remove()
    tgt.load_state_dict(base, strict=False)   # base: what can have moved


def _write_distill(a, tgt, res, base, cal, tdtypes, means):
    meta = {"bico_transfer_method": "distill",
            "bico_distill_step": str(res.step),
            "bico_seed": str(a.seed),
            "bico_heldout_loss": "%.6g" % means[2],
            "bico_heldout_loss_target": "%.6g" % means[0],
            "bico_windows": str(cal.windows),
            "bico_window": str(a.window),
            "bico_source": a.source,
            "bico_source_tuned": a.source_tuned or "",
            "bico_lora": a.lora or ""}
    if getattr(a, "estimate", None) is not None:
        meta["bico_estimate_seconds"] = "%.4g" % a.estimate
    bm = a.base_model_name_or_path or os.path.abspath(a.target)
    if a.output_lora and res.adapter is not None:
        cfg = write_pairs(_adapter_folder(a), res.state, res.adapter.r,
                          res.adapter.alpha, saved=res.trained,
                          base_model_name_or_path=bm, metadata=meta,
                          target_modules=[m for m in
                                          a.target_modules.split(",") if m])
        print("wrote %s: %d LoRA pairs (rank %d, trained), %d saved "
              "tensors" % (a.output_lora, len(res.state), res.adapter.r,
                           len(res.trained)), flush=True)
        return cfg
    if res.adapter is not None:          # factors merged into the weights
        ups = {m + ".weight": res.adapter.update(m) for m in res.state}
        res.adapter.remove()
        with torch.no_grad():
            for k, v in tgt.state_dict().items():
                if k in ups:
                    v.copy_((v.double() + ups[k].to(v.device)).to(v.dtype))
    out = {}
    tied = set(al_ for _, als in _tied_groups(tgt) for al_ in als)
    for k, v in tgt.state_dict().items():
        if k not in tied:
            out[k] = v.detach().cpu().to((tdtypes or {}).get(k, v.dtype))
    dest = a.output if a.output.endswith("/") else a.output + "/"
    _st.write(dest, out, metadata=dict(meta, format="pt"), like=a.target)
    print("wrote %s" % a.output, flush=True)


def _write_unchanged(a, tgt, res, cal, tdtypes, means):
    """The untouched target written (distillation did not help): an
    adapter whose factors are zero, or the target's weights."""
    print("note: distillation did not beat the untouched target on the "
          "held-out windows: the output is the target unchanged",
          flush=True)
    zero = res._replace(
        state={m: (torch.zeros_like(b), torch.zeros_like(aa))
               for m, (b, aa) in (res.state or {}).items()},
        trained={k: v.detach().clone() for k, v in
                 tgt.state_dict().items() if k in res.trained},
        adapter=res.adapter if a.output_lora else None)
    return _write_distill(a, tgt, zero, None, cal, tdtypes, means)


def _say_chosen(chosen, means):
    ran = [ROUTES[r] for r in sorted(means) if r]
    why = ("the least held-out loss, and a gain over the untouched target "
           "larger than its standard error" if chosen else
           "no route beat the untouched target clearly on the held-out "
           "windows")
    print("chosen: %s among %s (%s)" % (ROUTES[chosen], ", ".join(ran),
                                        why), flush=True)


def _write_chosen(a, tgt, chosen, means, fit, res, base, cal, tdtypes):
    _say_chosen(chosen, means)
    if chosen == 2:
        return _write_distill(a, tgt, res, base, cal, tdtypes, means)
    _restore(tgt, res, base)
    if fit is None:      # distillation only, and it did not help
        return _write_unchanged(a, tgt, res, cal, tdtypes, means)
    if chosen == 0:
        fit = (means[0],) + tuple(fit[1:2]) + (0.0,) + tuple(fit[3:])
    return _write(a, tgt, base, fit, cal, tdtypes)


def _run_streamed(a, dt, q, cal, tuned, spill, prog, tmp=None):
    """--method fit (and auto, with tmp: the distillation beside it) with
    the models run a block at a time from their folders
    (bico.llm.stream.route): the same choices, lines and outputs as the
    in-memory route (the recorded losses at the compute dtype), in memory
    that does not grow with the models' depth."""
    from ..stream.route import StreamedFit, command_fit
    log = lambda *m: _log(q, *m)  # noqa: E731
    kind = "adapter" if a.output_lora else "model"
    saves = [x for x in a.modules_to_save.split(",") if x]

    def progress(n):
        p = _FitProgress(n, q)
        return lambda i, dw, rank: p.line(dw, rank)
    with StreamedFit(a.source, tuned, a.target, cal.batches, cal.held_out,
                     dtype=dt, threads=a.threads,
                     budget=int(a.memory_budget * 2 ** 20), spill_dir=spill,
                     log=log, ranks=a.ranks) as sf:
        if a.ranks.size > 1:
            _log(q, "ranks: %d processes (gloo), the %d calibration batches "
                 "and %d held out shared among them; rank 0 writes"
                 % (a.ranks.size, len(cal.batches), len(cal.held_out)))
        _streamed_estimate(a, q, sf, cal)
        best, per = command_fit(sf, a.ridge, a.alpha, kind, a.rank,
                                saves, log, progress)
        dist = None
        if a.method == "auto":
            dist = _streamed_distill(a, dt, q, cal, tuned, spill, tmp)
            per[2] = dist[2].per_window
        chosen, means = _choose_route(per, log)
        if not a.ranks.root:      # the choice is the same on every rank
            return
        w = opts.vocab_warning(means[0], sf.run.B.cfg["V"], (
            "--text %s" % a.text) if a.text else ("--ids %s" % a.ids), prog)
        if w:
            print(w, file=sys.stderr, flush=True)
        _say_chosen(chosen, means)
        if chosen == 2:
            tgt, tdtypes, res = dist
            return _write_distill(a, tgt, res, None, cal, tdtypes, means)
        dist = None                       # the target is not written
        _write_streamed_fit(a, sf, best, chosen, means, cal)


def _streamed_estimate(a, q, sf, cal):
    """The fit's time, extrapolated from the statistics' forward sweep
    (both models, every fit window) as the in-memory route extrapolates
    from the target's forward pass."""
    if q:
        return
    per = sf.times.get("forward", 0.0) / max(1, cal.windows)
    est = opts.estimate(per, cal, len(a.ridge), a.output_lora,
                        a.alpha == HELDOUT, len(ALPHA_GRID))
    _log(q, "estimate: about %s for the fit of %d windows and %d held out "
         "(%.3f s per window of the forward sweep; --windows sets how "
         "many)" % (opts.duration(est), cal.windows,
                    sum(len(x) for x, _ in cal.held_out), per))


def _streamed_distill(a, dt, q, cal, tuned, spill, tmp):
    """The distillation route of a streamed run: the teacher from the
    folders a block at a time, then the target loaded alone and trained;
    (target, its files' dtypes, bico.llm.distill.Result)."""
    log = lambda *m: _log(q, *m)  # noqa: E731
    models, tgt, tdtypes, dcal = _teacher_then_target(a, dt, q, cal, tuned,
                                                      spill, tmp)
    return tgt, tdtypes, _distill_target(a, tgt, dcal, log, tmp, None,
                                         models)


def _teacher_then_target(a, dt, q, cal, tuned, spill, tmp):
    """The windows the teacher writes added (--generate), the teacher
    computed from the folders, its models freed, then the target loaded
    alone: ({"teacher": ...}, target, its files' dtypes, the
    distillation's windows)."""
    if _byte_teacher_wanted(a):
        dcal, models = _across_from_folders(a, dt, q, cal, tuned)
    elif a.ranks.size > 1:
        dcal, models = _teacher_across_ranks(a, dt, q, cal, tuned, spill,
                                             tmp)
    else:
        dcal = _generated_from_folders(a, dt, q, cal, tuned)
        models = {} if a.vocab.kind == "different" else {
            "teacher": _teacher_from_folders(a, dt, q, dcal, tuned, spill,
                                             tmp)}
    _heap.trim()
    _log(q, "memory after the teacher (its models freed): %s"
         % _distill.memory())
    tgt, tdtypes = _load_target(a, dt, q)
    _heap.trim()
    _log(q, "memory with the target loaded: %s" % _distill.memory())
    return models, tgt, tdtypes, dcal


def _teacher_across_ranks(a, dt, q, cal, tuned, spill, tmp):
    """The distillation's windows and teacher across ranks: rank 0
    writes the task text (--generate) and sends it to every rank; each
    rank computes the teacher of its rows of every batch
    (bico.llm.shard.RowShard) from the folders, a block at a time:
    (the distillation's windows, {"teacher": this rank's})."""
    from ..shard import RowShard

    def written():
        d = _generated_from_folders(a, dt, q, cal, tuned)
        gen = d.batches[len(cal.batches):]
        w = cal.batches[0][0].shape[1]
        xs = [x.numpy() for x, _ in gen] or [np.zeros((0, w), np.int64)]
        ys = [y.numpy() for _, y in gen] or [np.zeros((0, w), np.int64)]
        return (np.concatenate(xs), np.concatenate(ys),
                np.array([x.shape[0] for x, _ in gen], np.int64),
                np.array([getattr(a, "own_batches", -1),
                          int(getattr(a, "written_most", False))], np.int64))
    xs, ys, sizes, flags = a.ranks.from_root(written)
    gen, k = [], 0
    for n in sizes.tolist():
        gen.append((torch.from_numpy(np.array(xs[k:k + n])),
                    torch.from_numpy(np.array(ys[k:k + n]))))
        k += n
    if gen:
        a.own_batches, a.written_most = int(flags[0]), bool(flags[1])
    dcal = cal._replace(batches=list(cal.batches) + gen)
    local = RowShard(a.ranks, dcal.batches).local
    _log(q, "ranks: %d processes (gloo): each keeps its rows of the %d "
         "batches (their teacher, their gradients, summed); rank 0 writes"
         % (a.ranks.size, len(dcal.batches)))
    teacher = _teacher_from_folders(
        a, dt, q, dcal._replace(batches=local, windows=sum(
            x.shape[0] for x, _ in local)), tuned, spill, tmp)
    return dcal, {"teacher": teacher}


def _write_streamed_fit(a, sf, best, chosen, means, cal):
    """The streamed fit's output (the untouched target, alpha 0, when it
    was not chosen)."""
    loss, ridge, al, res, _ = best
    if not chosen:
        loss, al = means[0], 0.0
    meta = _fit_meta(a, al, ridge, loss, means[0], cal)
    try:
        if a.output_lora:
            rep = sf.write_adapter(
                res, _adapter_folder(a), al, lora_alpha=a.lora_alpha,
                metadata=meta, base_model=a.base_model_name_or_path or
                os.path.abspath(a.target))
        else:
            dest = a.output if a.output.endswith("/") else a.output + "/"
            sf.write_model(res, dest, al, dict(meta, format="pt"))
    except (BicoError, OSError) as e:
        raise _write_error(a, e)
    print(_summary(a, rep) if a.output_lora else "wrote %s" % a.output,
          flush=True)


def _before_fit(a, src, tgt, cal, q, prog):
    """The untouched target's held-out loss, a warning when it is above
    ln(vocabulary) (ids that do not match the target's tokenizer), and
    the time the fit will take, extrapolated from that forward pass."""
    t = time.time()
    zero = lm_loss(tgt, cal.held_out)
    per = (time.time() - t) / max(1, sum(len(x) for x, _ in cal.held_out))
    what = ("--text %s" % a.text) if a.text else ("--ids %s" % a.ids)
    w = opts.vocab_warning(zero, _vocab(tgt), what, prog)
    if w:
        print(w, file=sys.stderr, flush=True)
    if not q and a.method != "distill":     # (its own: _training_estimate)
        est = opts.estimate(per, cal, len(a.ridge), a.output_lora,
                            a.alpha == HELDOUT, len(ALPHA_GRID))
        _log(q, "estimate: about %s for %d fit windows and %d held out "
             "(%.3f s per window of the target's forward pass; --windows "
             "sets how many)" % (opts.duration(est), cal.windows,
                                 sum(len(x) for x, _ in cal.held_out), per))
    return zero
