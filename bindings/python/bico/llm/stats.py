"""bico.llm.stats: `bico-llm stats` (also `python3 -m bico.llm stats`),
the statistics file `bico transfer --stats` reads, from the source and
target folders and the task text, so that the C route needs no Python of
the user's:

    bico-llm stats --source A/ --target B/ --text task.txt \\
        --output stats.safetensors
    bico transfer --method bico --source-base A/ --lora A_adapter/ \\
        --target-base B/ --stats stats.safetensors --alpha 0.5 \\
        --output-lora B_adapter/

The text is cut into windows as the main command cuts it (--window,
--windows, --seed; none held out: `bico transfer` chooses nothing), both
pretrained models run on each window with the next-token loss, and
bico.torch.collect_statistics accumulates one cross-covariance per module
pair (docs/formats.md, "Statistics file").  The same options, checks and
exit status as the command (bico.llm.options: 2 a user mistake, 1 a
failure while running).  --output is checked against every input before
anything is loaded, by the library's rule for output files
(bico_folder_add_file): never an input, a file of an input model folder
(a shard of --target, its config.json), nor anything but a regular file.
"""
import os
import re
import sys
import time

import numpy as np
import torch

from .. import _blis
from .._status import BicoError, E_ARG, E_IO
from ..torch.collect import collect_statistics
from . import options as opts
from .options import (named as _named, setup as _setup,
                      vocab_size as _vocab,
                      transformers_loader as _transformers_loader)
from .families import load_model
from .text import next_token_loss, text_batches, tokenize

__all__ = ["main"]


def _log(quiet, *a):
    if not quiet:
        print(*a, file=sys.stderr, flush=True)


def _parser(prog):
    p = opts.Parser(
        prog=prog,
        description="Write the statistics file `bico transfer --stats` "
        "reads (one cross-covariance per module pair of the source and "
        "target, on windows of the task text), from model folders and "
        "text.",
        epilog="Exit status: 0 done; 2 a user mistake (an option's value, "
        "a missing or unusable input), one line naming the option or file, "
        "nothing written; 1 a failure while running.")
    p.add_argument("--source", required=True, help="source base folder")
    p.add_argument("--target", required=True, help="target base folder")
    t = p.add_mutually_exclusive_group(required=True)
    t.add_argument("--text", help="task text file (UTF-8)")
    t.add_argument("--ids", help="token ids, a .npy file")
    p.add_argument("--tokenizer", help="tokenizer.json or folder (default: "
                   "the target folder)")
    p.add_argument("--output", required=True,
                   help="statistics file to write (.safetensors)")
    p.add_argument("--window", type=opts.window, default=128,
                   help="tokens per window (128)")
    p.add_argument("--windows", type=opts.count,
                   default=opts.DEFAULT_WINDOWS,
                   help="at most this many windows, spread evenly over the "
                   "text (%d)" % opts.DEFAULT_WINDOWS)
    p.add_argument("--batch-size", type=opts.count, default=8)
    p.add_argument("--seed", type=opts.seed, default=0,
                   help="seed of the window order (0)")
    p.add_argument("--threads", type=opts.threads, default=None,
                   help="threads of PyTorch and of the library")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16",
                                       "float16"), default="float32",
                   help="dtype the models are computed in (float32)")
    p.add_argument("--transformers", action="store_true",
                   help="read the models with transformers' "
                   "AutoModelForCausalLM")
    p.add_argument("--quiet", action="store_true")
    return p


def _check_output(a):
    """--output against every input, by the library's rule for output
    files (bico.folder.Run's files, bico_folder_add_file): the same file
    as an input whatever the spelling (links, "B/../B/x", hard links), a
    file directly in an input model folder (a shard, config.json or the
    tokenizer of --target), a destination that is not a regular file (a
    folder, a FIFO), a missing folder.  A user mistake, one line naming
    both options and paths, before anything is loaded or written."""
    from ..folder import Run
    ins = [(o, v) for o, v in (("--source", a.source), ("--target", a.target),
                               ("--text", a.text), ("--ids", a.ids),
                               ("--tokenizer", a.tokenizer)) if v]
    try:
        with Run(inputs=ins, files=[("--output", a.output)]):
            pass
    except BicoError as e:
        msg = re.sub(r"^[a-z_]+: ", "", e.message)    # the function's name
        if e.status in (E_ARG, E_IO):
            raise opts.UsageError(msg)
        raise BicoError(e.status, msg)


def _prepare(a, q):
    """(source, target, windows) read and checked: every refusal a user
    mistake."""
    opts.check_inputs(a, [("--source", a.source), ("--target", a.target)],
                      [("--text", a.text), ("--ids", a.ids)])
    if a.tokenizer is not None and not os.path.exists(a.tokenizer):
        raise opts.UsageError("--tokenizer %s: no such file or folder"
                              % a.tokenizer)
    _check_output(a)
    data, what = opts.read_data(a)
    if a.text:
        tok = a.tokenizer or a.target
        data = _named("--tokenizer" if a.tokenizer else "--target", tok,
                      tokenize, data, tok)
    ids = np.asarray(data).reshape(-1)
    try:
        cal = text_batches(data, a.window, n=a.windows, holdout=0,
                           batch_size=a.batch_size, seed=a.seed)
    except BicoError as e:
        raise BicoError(e.status, "%s: %s" % (what, e.message))
    dt = None if a.dtype == "auto" else getattr(torch, a.dtype)
    load = _transformers_loader() if a.transformers else load_model
    _blis.say(lambda m: _log(q, m))   # its first line, once checked
    _log(q, "loading %s, %s" % (a.source, a.target))
    src, tgt = (_named(o, f, load, f, dtype=dt) for o, f in (
        ("--source", a.source), ("--target", a.target)))
    opts.check_ids(ids, what, [("--source", a.source, _vocab(src)),
                               ("--target", a.target, _vocab(tgt))])
    _log(q, "calibration: %d windows of %d tokens (%d batches)" % (
        cal.windows, a.window, len(cal.batches)))
    return src, tgt, cal


def main(argv=None, prog="python3 -m bico.llm stats"):
    """The subcommand; returns its exit status."""
    a = _parser(prog).parse_args(argv)
    q = a.quiet
    t0 = time.time()
    _setup(a)
    try:
        src, tgt, cal = _prepare(a, q)
    except (opts.UsageError, BicoError, OSError, MemoryError) as e:
        opts.say(prog, e)
        return opts.exit_status(e)
    try:
        col = collect_statistics(src, tgt, cal.batches, next_token_loss,
                                 show_progress=not q,
                                 **({} if a.threads is None
                                    else {"threads": a.threads}))
        try:
            try:
                col.save(a.output)
            except (BicoError, OSError) as e:
                raise BicoError(getattr(e, "status", E_IO), "--output %s: "
                                "cannot write it (%s)" % (
                                    a.output, getattr(e, "message", None)
                                    or e))
            n = len(col.statistics())
        finally:
            col.close()
    except (BicoError, OSError, ValueError, MemoryError) as e:
        opts.say(prog, e)
        return opts.FAILURE
    print("wrote %s: %d statistics of the module pairs, from %d windows of "
          "%d tokens; next: bico transfer --method bico --source-base %s "
          "--target-base %s --stats %s --alpha A (with --source-tuned or "
          "--lora, and --output or --output-lora)" % (
              a.output, n, cal.windows, a.window, a.source, a.target,
              a.output), flush=True)
    _log(q, "done in %.1f s" % (time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
