"""bico.llm.command: python3 -m bico.llm, which carries a decoder
fine-tune from model folders and task text to a target adapter or a
target folder, with the fit.

    python3 -m bico.llm --source A/ --source-tuned A_ft/ --target B/ \\
        --text task.txt --output-lora B_adapter/ --rank 16
    python3 -m bico.llm --source A/ --lora A_adapter/ --target B/ \\
        --ids ids.npy --output B_ft/

--method fit and auto (the default; on the CPU, without --in-memory or
--transformers) run the models a block at a time from their folders
(bico.llm.stream.route: memory that does not grow with their depth);
--method distill computes its teacher from the folders a block at a
time, on the CPU or on --device, then trains the target alone there;
--in-memory (and fit or auto on --device cuda) read them whole with
bico.llm.load_model (Llama, Mistral, Qwen2, Gemma folders; one file or
shards). --text is
tokenized with the target folder's tokenizer.json (or --tokenizer): by
Hugging Face's `tokenizers` when installed, natively for a byte-level
tokenizer without merges; --ids takes token ids (.npy) from any
tokenizer. The text is cut into windows (--window tokens); --holdout of
them are held out to choose the scale alpha (and the ridge when --ridge
lists several) by next-token loss, with alpha 0 (the untouched target)
among the candidates, so the result is never worse than the target on
the held-out windows. The fit (bico.torch.transfer_model, method "fit")
needs PyTorch; `bico transfer` is the PyTorch-free route. What was
chosen is printed and recorded in the output: the safetensors metadata
of --output, bico_adapter.json beside the adapter of --output-lora (PEFT
refuses unknown keys in adapter_config.json).

By concern, one module each (this one: main and the routes dispatched,
across ranks too):

  arguments.py       the options (the parser) and their defaults
  inputs.py          the models, tokenizers, windows and outputs read and
                     checked before a route runs
  method_fit.py      --method fit: the fit, its choices, its writing
  method_distill.py  --method distill: the teacher, the written text, the
                     estimate, the student
  method_auto.py     --method auto: the routes in turn, the best written
  scratch.py         the scratch folder and the signals
"""
import shutil
import sys
import time

import torch

from ... import _heap
from ..._status import BicoError, E_IO
from .. import distill as _distill
from .. import options as opts
from ..options import setup as _setup
from .arguments import _log, _parser
from .inputs import (_method_for_tokenizers, _prepare, _prepare_streamed,
                     _streamed, _streamed_teacher)
from .method_auto import (_before_fit, _run_routes, _run_streamed,
                          _teacher_then_target, _write_chosen)
from .scratch import _on_signals, _scratch_of


class _Refused(Exception):
    """A route's preparation refused its inputs (error: what it raised);
    main ends the run with that error's exit status."""

    def __init__(self, error):
        Exception.__init__(self, str(error))
        self.error = error


def _prepared(fn, *args):
    """fn(*args), a route's preparation (the inputs checked, read and
    loaded; every refusal there a user's mistake or an unreadable file,
    before anything is written), its refusals raised as _Refused; after a
    signal, whatever became of its exit, the signal's end."""
    try:
        return fn(*args)
    except (opts.UsageError, BicoError, OSError, MemoryError) as e:
        _distill.check_stop()
        raise _Refused(e)


def _route_streamed(a, dt, q, prog, tmp):
    """--method fit or auto, the models streamed from their folders
    (across the ranks of a.ranks: every rank's preparation must succeed
    before any runs)."""
    try:
        cal, tuned, spill = _prepared(_prepare_streamed, a, tmp, q)
    except _Refused as r:
        a.ranks.agree(_outcome(r.error))
        raise
    other = a.ranks.agree(None)
    if other is not None:      # another rank refused: the same end here
        rank, (usage, status, msg) = other
        msg = "rank %d: %s" % (rank, msg)
        raise _Refused(opts.UsageError(msg) if usage else
                       BicoError(status, msg))
    _run_streamed(a, dt, q, cal, tuned, spill, prog, tmp)


def _outcome(e):
    """A refusal as the other ranks are told it: (a user's mistake,
    status, message)."""
    if isinstance(e, BicoError):
        return False, e.status, e.message
    return isinstance(e, opts.UsageError), E_IO, str(e)


def _ranks(a):
    """The ranks the run is shared among (bico.llm.ranks): one process,
    or under a launcher (WORLD_SIZE > 1) a gloo process group, for the
    streamed routes (the fit, the distillation with its teacher from the
    folders, both) with one tokenizer.  The launcher's variables are checked before
    joining; once joined, every rank's options and inputs are compared
    with rank 0's (_same_run) before any work."""
    from ..ranks import Ranks, world_size, join
    n = world_size()
    if n == 1:
        return Ranks()
    join()
    ranks = Ranks(world=True)
    ranks.same_run(_run_items(a))
    if not (_streamed(a) or _streamed_teacher(a)):
        raise opts.UsageError(
            "under torchrun (WORLD_SIZE %d) only the streamed routes run "
            "across processes: give --method fit, distill or auto without "
            "--in-memory, --transformers or --init warm (and fit or auto "
            "without --device cuda), or "
            "run in one process" % n)
    if a.device != "cpu":
        raise opts.UsageError(
            "under torchrun (WORLD_SIZE %d): --device %s: the runs across "
            "processes are on the CPU (gloo); run on one device in one "
            "process" % (n, a.device))
    if a.method != "fit" and _tokenizers_differ(a):
        raise opts.UsageError(
            "under torchrun (WORLD_SIZE %d): the tokenizers differ, and the "
            "distillation across tokenizers runs in one process" % n)
    return ranks


def _tokenizers_differ(a):
    from ..vocab import relation
    return relation(a.source, a.tokenizer or a.target).kind == "different"


# Options that may differ between ranks: the node's own resources
# (threads, memory, scratch) and what only rank 0 uses (it alone locks,
# writes and prints the output).  The input paths are compared by their
# content instead (node-local copies at other paths are fine).
_PER_RANK = frozenset(("threads", "memory_budget", "teacher_memory",
                       "spill_dir", "quiet", "wait", "replace", "output",
                       "output_lora", "base_model_name_or_path"))
_INPUTS = ("source", "source_tuned", "lora", "target", "tokenizer")


def _run_items(a):
    """What every rank of a run must agree on (Ranks.same_run): every
    parsed option (a.parsed: not what the run sets on a) but _PER_RANK's
    and the inputs' paths, by value; which
    output is written (--output or --output-lora); a fingerprint of each
    input (bico.llm.agree: the model folders, --lora, --tokenizer sampled
    per file, node-independent; --text by every byte the run reads of it,
    --ids read whole)."""
    from .. import agree as R
    skip = _PER_RANK | set(_INPUTS) | {"text", "ids"}
    items = [("--" + k.replace("_", "-"), R.value_digest(getattr(a, k)))
             for k in a.parsed if k not in skip]
    items.append(("the output kind", "--output-lora" if a.output_lora
                  else "--output"))
    items += [("--" + k.replace("_", "-"), R.fingerprint(getattr(a, k)))
              for k in _INPUTS]
    items.append(("--text", R.text_fingerprint(a.text, opts.text_limit(a))))
    items.append(("--ids", R.whole_fingerprint(a.ids)))
    return items


def _route_teacher_streamed(a, dt, q, prog, tmp):
    """--method distill, the teacher streamed from the folders, the target
    loaded alone after it."""
    cal, tuned, spill = _prepared(_prepare_streamed, a, tmp, q)
    models, tgt, tdtypes, dcal = _teacher_then_target(a, dt, q, cal, tuned,
                                                      spill, tmp)
    _before_fit(a, None, tgt, cal, q, prog)
    chosen, means, fit, res, base = _run_routes(
        a, models, tgt, cal, a.ridge, a.alpha, tmp, q, tdtypes, dcal)
    if a.ranks.root:        # the choice is the same on every rank
        _write_chosen(a, tgt, chosen, means, fit, res, base, cal, tdtypes)


def _route_in_memory(a, dt, q, prog, tmp):
    """Every route with the three models loaded whole (--in-memory,
    --transformers, fit or auto on --device cuda, a warm start)."""
    src, srt, tgt, tdtypes, cal = _prepared(_prepare, a, dt, tmp, q, prog)
    _before_fit(a, src, tgt, cal, q, prog)
    models = {"source": src, "tuned": srt}
    del src, srt
    chosen, means, fit, res, base = _run_routes(
        a, models, tgt, cal, a.ridge, a.alpha, tmp, q, tdtypes)
    _write_chosen(a, tgt, chosen, means, fit, res, base, cal, tdtypes)


def main(argv=None, prog="python3 -m bico.llm"):
    """The command; returns its exit status (docs in bico.llm.options:
    0 done, 2 a user mistake, 1 a failure while running)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["stats"]:
        from ..stats import main as stats_main
        return stats_main(argv[1:], prog + " stats")
    p = _parser(prog)
    a = p.parse_args(argv)
    a.parsed = tuple(sorted(vars(a)))   # the options; the rest is the run's
    q = a.quiet
    t0 = a.t0 = time.time()
    dt = None if a.dtype == "auto" else getattr(torch, a.dtype)
    _setup(a)
    # the command's own process: freed tensors go back to the system at
    # once (glibc otherwise keeps about a model's worth: bico._heap)
    _heap.give_back_on_free()
    a.run = None
    _on_signals()
    tmp = None
    try:
        _prepared(_method_for_tokenizers, a, q)
        tmp = _prepared(_scratch_of, a)
        a.ranks = _prepared(_ranks, a)
        if not a.ranks.root:     # rank 0 speaks for the run
            a.quiet = q = True
        route = (_route_streamed if _streamed(a) else
                 _route_teacher_streamed if _streamed_teacher(a) else
                 _route_in_memory)
        route(a, dt, q, prog, tmp)
        # a signal that came while the work ran (its exception possibly
        # swallowed where Python drops exceptions) ends the run here,
        # before the output is swapped in: the old output stays
        _distill.check_stop()
        run, a.run = a.run, None
        if run is not None:                     # (rank 0 of several)
            run.__exit__(None, None, None)      # the output swapped in
        _log(q, "done in %.1f s" % (time.time() - t0))
        return 0
    except _Refused as r:
        opts.say(prog, r.error)
        return opts.exit_status(r.error)
    except RuntimeError:
        # a signal's SystemExit raised inside autograd's backward comes
        # back as a RuntimeError: ended as the signal asked
        _distill.check_stop()
        raise
    except (BicoError, OSError, ValueError, MemoryError) as e:
        # a signal's SystemExit raised inside a library callback (the
        # streamed fit's) comes back as the call's error: ended as the
        # signal asked
        _distill.check_stop()
        opts.say(prog, e)
        return opts.FAILURE
    except Exception:
        # any other error after a signal (its SystemExit swallowed where
        # Python ignores exceptions: finalizers, callbacks) is the signal's
        _distill.check_stop()
        raise
    finally:
        if a.run is not None:       # nothing of the output changes
            a.run.__exit__(RuntimeError, RuntimeError("not done"), None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
