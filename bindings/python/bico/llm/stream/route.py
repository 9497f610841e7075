"""bico.llm.stream.route: the streamed runner as the routes use it
(python3 -m bico.llm --method fit, and bico.llm.transfer_model given
model folders).

    sf = StreamedFit("A/", "A_ft/", "B/", cal.batches, cal.held_out)
    res = sf.fit(1e-2)                       # a stream.out.Result
    per = sf.score(res, [0, 0.5, 1])         # {alpha: [(loss, tokens)]}
    sf.write_model(res, "B_ft/", 0.5, {"k": "v"})
    sf.close()

StreamedFit runs the two statistics sweeps once (stream.stats: boundary
states, norms and embedding carried by BiCo, gradients), then each fit is
a third sweep (stream.fit) whose result stays in the spill store until it
is scored (stream.out.score) and written.  Memory: the blocks in flight,
one block's rows and statistics, the head while the loss is taken; the
rest is in the store (its budget in memory, beyond it in a nameless
temporary file)."""
import contextlib
import time

import torch

from ...torch.choose import HELDOUT
from ..runtime import DEFAULT_BUDGET
from . import out as _out
from .fit import fit_blocks
from .stats import Run, forward_sweep, backward_sweep

__all__ = ["StreamedFit", "lm_loss_of", "mean_loss_of", "command_fit"]


class StreamedFit(object):
    """The statistics of a source pair and a target folder on calibration
    batches, ready for fits (see the module doc).  dtype: the compute
    dtype (None: the files'); threads: the library's and torch's thread
    count (None: torch's current one); budget: bytes of spilled tensors
    kept in memory; spill_dir: where the temporary file goes (None:
    $TMPDIR); log: a function of one line; alpha: the scale BiCo carries
    the norms and the embedding at (the fit's own scale is fit()'s)."""

    def __init__(self, source, tuned, target, batches, held=(),
                 dtype=torch.float32, threads=None, budget=DEFAULT_BUDGET,
                 spill_dir=None, log=None, alpha=1.0, ranks=None):
        if threads is None:
            threads = torch.get_num_threads()
        torch.set_num_threads(int(threads))
        self.log = log or (lambda line: None)
        self.run = Run(source, tuned, target, batches, held, dtype=dtype,
                       threads=threads, budget=budget, spill_dir=spill_dir,
                       log=self.log, alpha=alpha, ranks=ranks)
        self.fits = 0
        self.times = {}
        try:
            t0 = time.time()
            forward_sweep(self.run)
            t1 = time.time()
            backward_sweep(self.run, self.run.A, "hA", "gA")
            backward_sweep(self.run, self.run.B, "hB", "gB")
            self.times.update(forward=t1 - t0, backward=time.time() - t1)
        except BaseException:
            self.close()
            raise

    def fit(self, ridge, alpha=1.0, kind="model", rank=16, saves=(),
            report=None, progress=None):
        """One fit (ridge c, the output change scaled by alpha) kept as a
        stream.out.Result: new tensors (kind "model") or rank-r pairs
        ("adapter", with the modules_to_save `saves`)."""
        res = _out.Result(self.run, "fit%d/" % self.fits, kind, rank, saves)
        self.fits += 1
        t0 = time.time()
        fit_blocks(self.run, ridge, alpha, sink=res.sink, report=report,
                   want_rank=report is not None, progress=progress)
        self.times["fit"] = self.times.get("fit", 0) + time.time() - t0
        return res

    def score(self, result, grid, held=None, windows=None):
        """{alpha: [(mean next-token loss, tokens) per held-out batch]};
        windows (a dict) gets each alpha's per-window losses.  Across
        ranks, each scores its share of the batches and every rank gets
        all of them, in order."""
        t0 = time.time()
        ranks = self.run.ranks
        if held is None:
            ids, held = self.run.held_ids, self.run.held
        else:
            mine = ranks.share(held)
            ids, held = [i for i, _ in mine], [b for _, b in mine]
        win = {}
        out = _out.score(result, held, grid, windows=win)
        for a in list(out):
            # each batch's loss with its windows', in the batches' order
            per, k = [], 0
            for loss, (x, _) in zip(out[a], held):
                per.append((loss, win[a][k:k + x.shape[0]]))
                k += x.shape[0]
            per = ranks.gather(list(zip(ids, per)))
            out[a] = [loss for loss, _ in per]
            win[a] = [w for _, ws in per for w in ws]
        if windows is not None:
            windows.update(win)
        self.times["score"] = self.times.get("score", 0) + time.time() - t0
        return out

    def write_model(self, result, dest, alpha, metadata):
        _out.write_model(result, dest, alpha, metadata)

    def write_adapter(self, result, folder, alpha, **kw):
        return _out.write_adapter(result, folder, alpha, **kw)

    def close(self):
        if getattr(self, "run", None) is not None:
            self.run.close()
            self.run = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def lm_loss_of(per):
    """lm_loss over the held-out batches (token-weighted), as
    bico.llm.text.lm_loss sums it."""
    tot, cnt = 0.0, 0
    for loss, n in per:
        tot += loss * n
        cnt += n
    return tot / max(cnt, 1)


def mean_loss_of(per):
    """The mean of the per-batch losses (bico.torch.choose._mean_loss)."""
    return float(sum(v for v, _ in per) / len(per))


def command_fit(sf, ridges, alpha, kind, rank, saves, log, progress):
    """python3 -m bico.llm --method fit's choices on a StreamedFit, as the
    in-memory route makes them (bico.llm.command.method_fit): the one
    held-out choice (bico.torch.choose.choose_on_heldout) of alpha (among
    ALPHA_GRID, or the given number) and ridge.  Returns (held-out loss,
    ridge, alpha, Result, {alpha: loss}) of the fit kept and {0: the
    target's per-window losses, 1: the fit's}; the other fits are
    dropped from the store."""
    from ...torch.choose import choose_on_heldout, ALPHA_GRID, HELDOUT
    n_lin = 7 * sf.run.B.L + (1 if sf.run.fit_head else 0)

    def fit(ridge):
        log("fit: ridge %g, %d layers" % (ridge, n_lin))
        return sf.fit(ridge, kind=kind, rank=rank, saves=saves,
                      progress=progress(n_lin))

    def score(res, alphas):
        win = {}
        means = {al: lm_loss_of(v) for al, v in
                 sf.score(res, sorted(set(alphas) | {0.0}),
                          windows=win).items()}
        return means, win

    alphas = ALPHA_GRID if alpha == HELDOUT else (alpha,)
    c = choose_on_heldout(ridges, fit, score, alphas,
                          drop=lambda res: res.drop(), log=log)
    return ((c.loss, c.ridge, c.alpha, c.result,
             {g: c.losses[g] for g in alphas}),
            {0: c.per[0.0], 1: c.per[c.alpha]})


def transfer_folders(kw):
    """bico.llm.transfer_model(method="fit") on model folders (kw: its
    arguments): the streamed fit, alpha and ridge chosen on held-out
    batches as transfer_model chooses them (choose_on_heldout, the mean
    of the per-batch losses), the result returned as a state dict or
    written to kw["output"]."""
    from ..._status import BicoError, E_ARG
    from ...torch.choose import _resolve_heldout, _alpha_grid
    from ...torch.transfer import _check_alpha, _check_fit_options
    from ..text import next_token_loss
    kw["batches"] = list(kw["batches"])      # an iterator read once
    ranks = _launcher_ranks(kw)
    if kw["loss_fn"] not in (None, next_token_loss) or kw["step"] is not None:
        raise BicoError(E_ARG, "transfer_model: model folders run with the "
                        "next-token loss on token-id batches; pass "
                        "loss_fn=None (or next_token_loss), or load the "
                        "models (load_model) for another loss")
    batches = list(kw["batches"])
    if not batches:
        raise BicoError(E_ARG, "transfer_model: no calibration batches")
    if kw["spill_dir"] is not None:
        # the command's rule (--spill-dir): a folder that exists, that
        # this user can write in, inside no input
        from ..runtime import spill_folder
        try:
            spill_folder(kw["output"], [kw[k] for k in _FOLDERS],
                         str(kw["spill_dir"]))
        except BicoError as e:
            raise BicoError(e.status, "transfer_model: spill_dir %s: %s"
                            % (kw["spill_dir"], e.message))

    def loss_of(m, b):
        return None
    loss_of.static = True
    alpha, fit_b, held = _resolve_heldout("fit", kw["alpha"], kw["holdout"],
                                          batches, loss_of,
                                          kw["alpha_grid"])
    auto = _check_alpha("fit", alpha)
    ridges, _ = _check_fit_options("fit", auto, kw["tied"], kw["ridge"],
                                   kw["ridge_prior"], kw["general_batches"])
    if kw["ridge_prior"] != "zero" or kw["general_batches"] is not None or \
            "gcv" in ridges or kw["shared_out"] or kw["tied"] != "carry":
        raise BicoError(E_ARG, "transfer_model: ridge_prior, "
                        "general_batches, ridge='gcv', shared_out and "
                        "tied='fit' need the models in memory (stream=False)")
    grid = _alpha_grid(kw["alpha_grid"])
    a = 1.0 if auto else alpha
    budget = kw["memory_budget"] or DEFAULT_BUDGET
    if kw["output"] is None:
        return _folders_fit(kw, fit_b, held, ridges, auto, alpha, grid, a,
                            budget, ranks)
    # the folder rules of the command: an output inside an input refused,
    # the output locked before the inputs are read (by rank 0, which
    # writes it; every rank learns a refusal)
    args = (kw, fit_b, held, ridges, auto, alpha, grid, a, budget, ranks)
    if not ranks.root:
        _agreed(ranks, None)        # rank 0 checked and locked the output
        out = _folders_fit(*args)
        _agreed(ranks, None)        # rank 0 wrote and committed it
        return out
    run = _locked(kw, ranks)    # a refusal was raised on every rank
    out, err = None, None
    try:
        with contextlib.ExitStack() as stack:
            stack.push(run)     # committed, or discarded on an error
            out = _folders_fit(*args)
    except Exception as e:
        err = e
    _agreed(ranks, err)
    return out


def _launcher_ranks(kw):
    """bico.llm.ranks.Ranks of the processes the launcher started
    (WORLD_SIZE > 1: the default gloo group, joined unless it is already;
    then every rank's arguments compared with rank 0's, _run_items), else
    one process."""
    from ..ranks import Ranks, world_size, join
    if world_size() > 1:
        join()
        ranks = Ranks(world=True)
        ranks.same_run(_run_items(kw))
        return ranks
    return Ranks()


# transfer_model's arguments that may differ between ranks: the node's
# own resources, what only rank 0 uses (output's path: whether one is
# given is compared), what receives the report, the progress display;
# the folders are compared by their content.
_PER_RANK = frozenset(("threads", "spill_dir", "memory_budget", "output",
                       "report", "show_progress"))
_FOLDERS = ("source", "source_tuned", "target")


def _run_items(kw):
    """What every rank of transfer_model on folders must agree on
    (Ranks.same_run): every argument but _PER_RANK's and the folders' paths
    by value (bico.llm.agree.value_digest: the batches and held-out
    batches by their tensors' bytes, functions by name), whether an output
    is written, whether a report is asked for, and each folder's
    fingerprint (each regular file's size, first 64 KiB, 16 evenly spaced
    pieces of 256 bytes and last 4 KiB: node-local copies agree)."""
    from .. import agree as R
    skip = _PER_RANK | set(_FOLDERS)
    items = [(k, R.value_digest(v)) for k, v in sorted(kw.items())
             if k not in skip]
    items.append(("output given", repr(kw.get("output") is not None)))
    items.append(("report given", repr(kw.get("report") is not None)))
    items += [(k, R.fingerprint(kw[k])) for k in _FOLDERS]
    return items


def _locked(kw, ranks):
    """The output's folder.Run, entered (on rank 0); its refusal raised on
    every rank."""
    from ...folder import Run
    run, err = Run(inputs=[("source", kw["source"]),
                           ("source_tuned", kw["source_tuned"]),
                           ("target", kw["target"])],
                   outputs=[("output", kw["output"], "carry")]), None
    try:
        run.__enter__()
    except Exception as e:
        err = e
    _agreed(ranks, err)
    return run


def _agreed(ranks, err):
    """Raises err here, or another rank's failure (its status, its
    message with its rank), after every rank has said how its step
    ended (err None: this rank's went well)."""
    from ..._status import BicoError, E_IO
    mine = None if err is None else (getattr(err, "status", E_IO),
                                     getattr(err, "message", str(err)))
    other = ranks.agree(mine)
    if err is not None:
        raise err
    if other is not None:
        rank, (status, msg) = other
        raise BicoError(status, "rank %d: %s" % (rank, msg))


def _folders_fit(kw, fit_b, held, ridges, auto, alpha, grid, a, budget,
                 ranks):
    from ...torch.choose import choose_on_heldout
    with StreamedFit(kw["source"], kw["source_tuned"], kw["target"], fit_b,
                     held, threads=kw["threads"], budget=budget,
                     spill_dir=kw["spill_dir"], alpha=a,
                     ranks=ranks) as sf:
        def fit(ridge):
            frep = [] if kw["report"] is not None else None
            return sf.fit(ridge, alpha=a, report=frep), frep

        def score(res, alphas):
            per = {g: [v for v, _ in pb] for g, pb in
                   sf.score(res[0], alphas).items()}
            return ({g: mean_loss_of([(v, 0) for v in per[g]])
                     for g in alphas}, per)

        if auto:
            c = choose_on_heldout(ridges, fit, score, grid)
            (res, frep), scale, scores = c.result, c.alpha, c.losses
            ridge, ridge_losses = c.ridge, c.ridge_losses
        else:           # the given scale, applied by the fit: one ridge
            (res, frep), scale, scores = fit(ridges[0]), 1.0, None
            ridge, ridge_losses = ridges[0], None
        _report(kw, sf, frep, scale, scores, ridge, ridges, ridge_losses,
                res, fit_b, held)
        if kw["output"] is not None:
            if ranks.root:     # the others wait for it (transfer_folders)
                sf.write_model(res, kw["output"], scale, {
                    "format": "pt", "bico_transfer_method": "fit",
                    "bico_alpha": "%g" % (scale if auto else alpha),
                    "bico_ridge": "%g" % ridge})
            return {"output": kw["output"], "alpha": scale if auto else
                    alpha, "ridge": ridge, "losses": scores}
        return _state_dict(res, scale)


def _report(kw, sf, frep, scale, scores, ridge, ridges, ridge_losses,
            res, fit_b, held):
    rep = kw["report"]
    if rep is None:
        return
    B = sf.run.B
    rep.extend(sf.run.carry_report)
    if B.cfg["tied"]:
        rep.append({"name": "lm_head.weight", "handling": "shared",
                    "shares": B.embed_name()})
    rep.extend(frep or [])
    if scores is None:
        return
    zero = scores.get(0.0)
    if zero is None:
        zero = mean_loss_of(sf.score(res, [0.0])[0.0])
    entry = {"alpha": scale, "rule": HELDOUT, "losses": scores,
             "zero_shot": zero, "heldout_batches": len(held),
             "fit_batches": len(fit_b)}
    if len(ridges) > 1:
        entry.update(ridge=ridge, ridge_losses=ridge_losses)
    rep.append(entry)


def _state_dict(res, scale):
    """The target's state dict moved by scale times the result (compute
    dtype; a tied head the same tensor as the embedding), in float32 as
    transfer_model's in-memory routes apply a chosen scale (_apply)."""
    from .out import _order
    B = res.run.B
    out = {}
    for n in _order(B):
        base = B.tensor(n)
        d = res.delta(n, base)
        if d is None or scale == 1.0:
            out[n] = base if d is None else (base.double() + d).to(
                base.dtype)
            continue
        d32 = (base.double() + d).to(base.dtype).float() - base.float()
        out[n] = (base.float() + scale * d32).to(base.dtype)
    if B.cfg["tied"]:
        out["lm_head.weight"] = out[B.embed_name()]
    return out
