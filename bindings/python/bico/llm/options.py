"""bico.llm.options: what python3 -m bico.llm (bico-llm) checks before it
works, and its exit status rule.

Exit status, one rule for the command and its stats subcommand:

  0  done;
  2  a user mistake, found before anything is written: an option's value
     (a count below 1, --alpha nan, --ridge ","), an input that is missing
     or unusable (a folder, its config.json or weights, the tokenizer,
     --text that is not UTF-8, --ids that are not token ids of the
     target's vocabulary), inputs that do not fit together (--window above
     max_position_embeddings).  One line on stderr naming the option or
     the file;
  1  a failure while running: the fit, the library, memory, an I/O error,
     writing the output.

The argparse types here refuse a bad value with a message naming the
option (Parser prints it as one line); check_inputs, check_models and
read_data check what the values name.
"""
import argparse
import math
import os
import sys

import numpy as np
import torch

from .._inputs import read_input
from .._status import BicoError, E_ARG, E_IO, E_NOMEM, E_INTERNAL

__all__ = ["UsageError", "exit_status", "Parser", "check_inputs",
           "read_data", "check_ids", "vocab_warning", "estimate", "USAGE",
           "FAILURE", "DEFAULT_WINDOWS"]

USAGE, FAILURE = 2, 1

# BicoError statuses of a failure while running, not of a bad input
_RUNTIME = (E_IO, E_NOMEM, E_INTERNAL)

# the default cap on --windows (all of a long text took minutes)
DEFAULT_WINDOWS = 256


class UsageError(Exception):
    """A user mistake (exit 2); its text is the one line printed."""


def exit_status(err):
    """2 for a user mistake (UsageError, or a BicoError refusing an input
    while the inputs are read), 1 for a failure while running."""
    if isinstance(err, UsageError):
        return USAGE
    if isinstance(err, BicoError):
        return FAILURE if err.status in _RUNTIME else USAGE
    if isinstance(err, (FileNotFoundError, NotADirectoryError,
                        IsADirectoryError, PermissionError,
                        UnicodeDecodeError)):
        return USAGE
    return FAILURE


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (exit 2)."""

    def error(self, message):
        self.exit(USAGE, "%s: error: %s (%s --help lists the options)\n"
                  % (self.prog, message, self.prog))


def _bad(what, s):
    return argparse.ArgumentTypeError("must be %s, got %r" % (what, s))


# Every option that takes a number is bounded: by the machine where that
# is its sense (threads by the CPUs this process may use, memory by the
# machine's), else by a limit far beyond any real use that keeps the
# arithmetic finite; beyond it, one line and exit 2 before anything runs.
COUNT_LIMIT = 1 << 24       # windows, steps, batch size, teacher entries
RANK_LIMIT = 1 << 16        # a LoRA rank (the target's widths bound it too)
WINDOW_LIMIT = 1 << 20      # tokens per window
WAIT_LIMIT = 7 * 86400.0    # seconds of --wait
WEIGHT_LIMIT = 1e4          # --text-weight, --teacher-weight
LR_LIMIT = 10.0             # --lr
ALPHA_LIMIT = 1e4           # --alpha
RIDGE_LIMIT = 1e12          # --ridge (relative: c times the inputs' scale)
SCALE_RANGE = (2.0 ** -20, 2.0 ** 20)   # --lora-alpha / --rank


def cpus():
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_mib():
    """The machine's memory in MiB (None where it cannot be read)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") \
            / float(1 << 20)
    except (AttributeError, ValueError, OSError):
        return None


def _int(s, what):
    try:
        return int(s, 10)
    except (TypeError, ValueError):
        raise _bad(what, s)


def count(s, limit=COUNT_LIMIT):
    """An integer from 1 to limit (--windows, --batch-size, --steps,
    --teacher-k)."""
    what = "an integer from 1 to %d" % limit
    v = _int(s, what)
    if not 1 <= v <= limit:
        raise _bad(what, s)
    return v


def rank(s):
    """A LoRA rank: 1 to RANK_LIMIT (the target's widths are checked
    once its config is read)."""
    return count(s, RANK_LIMIT)


def window(s):
    """Tokens per window: 1 to WINDOW_LIMIT (and at most the models'
    max_position_embeddings, checked with the inputs)."""
    return count(s, WINDOW_LIMIT)


def threads(s):
    """1 to the CPUs this process may use (more threads than CPUs only
    wait for each other)."""
    n = cpus()
    what = "an integer from 1 to %d (the CPUs this process may use)" % n
    v = _int(s, what)
    if not 1 <= v <= n:
        raise _bad(what, s)
    return v


def seed(s):
    try:
        v = int(s, 10)
    except (TypeError, ValueError):
        raise _bad("an integer from 0 to 2^63 - 1", s)
    if not 0 <= v < 2 ** 63:
        raise _bad("an integer from 0 to 2^63 - 1", s)
    return v


def _number(s):
    try:
        return float(s)
    except (TypeError, ValueError):
        return float("nan")


def positive(s):
    """A finite number > 0 (--lora-alpha: its ratio to --rank is checked
    with the route's options)."""
    v = _number(s)
    if not (math.isfinite(v) and v > 0):
        raise _bad("a finite number above 0", s)
    return v


def nonnegative(s, limit=WEIGHT_LIMIT):
    """A finite number from 0 to limit (--text-weight,
    --teacher-weight)."""
    v = _number(s)
    if not (math.isfinite(v) and 0 <= v <= limit):
        raise _bad("a number from 0 to %g" % limit, s)
    return v


def seconds(s):
    """Seconds to wait: 0 to WAIT_LIMIT (--wait)."""
    return nonnegative(s, WAIT_LIMIT)


def learning_rate(s):
    """A learning rate above 0, at most LR_LIMIT (--lr)."""
    v = _number(s)
    if not (math.isfinite(v) and 0 < v <= LR_LIMIT):
        raise _bad("a number above 0 and at most %g" % LR_LIMIT, s)
    return v


def mebibytes(s):
    """MiB of memory: 0 to the machine's memory (--memory-budget,
    --teacher-memory)."""
    mem = memory_mib()
    limit = mem if mem is not None else float(1 << 40)
    v = _number(s)
    if not (math.isfinite(v) and 0 <= v <= limit):
        raise _bad("a number of MiB from 0 to %d (the machine's memory)"
                   % limit, s)
    return v


def routes(a):
    """The route options of the command, checked together."""
    if a.lora_alpha is not None:
        lo, hi = SCALE_RANGE
        sc = a.lora_alpha / a.rank
        if not lo <= sc <= hi:
            raise UsageError(
                "--lora-alpha %g with --rank %d: the factors' scale "
                "lora_alpha / r = %g is outside [2^-20, 2^20], where the "
                "factors of a real update stay finite and nonzero in "
                "float32" % (a.lora_alpha, a.rank, sc))
    if a.trainable == "dense" and a.output_lora:
        raise UsageError("--trainable dense trains every weight: it writes "
                         "a model folder (--output), not --output-lora")
    if a.init == "warm" and not (a.output_lora or a.trainable == "lora"):
        raise UsageError("--init warm starts LoRA factors: give "
                         "--output-lora (or --trainable lora)")
    if a.method == "fit" and (a.trainable or a.init != "cold"):
        raise UsageError("--trainable and --init are options of the "
                         "distillation: --method distill or auto")
    if not (a.text_weight or a.teacher_weight):
        raise UsageError("--text-weight and --teacher-weight are both 0: "
                         "distillation would learn nothing")


def share(s):
    """A number strictly between 0 and 1 (--holdout)."""
    v = _number(s)
    if not 0 < v < 1:
        raise _bad("a number above 0 and below 1", s)
    return v


def decay(s):
    """A number from 0 (off) to below 1 (--ema)."""
    v = _number(s)
    if not (math.isfinite(v) and 0 <= v < 1):
        raise _bad("a number from 0 to below 1", s)
    return v


def across_depth(s):
    """An integer from 1 to 7 (--across-depth: the teacher's sort keys
    hold that many bytes in 64 bits)."""
    return count(s, 7)


def count_or_zero(s):
    """An integer from 0 to COUNT_LIMIT (--patience)."""
    what = "an integer from 0 to %d" % COUNT_LIMIT
    v = _int(s, what)
    if not 0 <= v <= COUNT_LIMIT:
        raise _bad(what, s)
    return v


def generate_count(s):
    """"auto" or an integer from 0 to COUNT_LIMIT (--generate)."""
    if s == "auto":
        return s
    what = "auto or an integer from 0 to %d" % COUNT_LIMIT
    v = _int(s, what)
    if not 0 <= v <= COUNT_LIMIT:
        raise _bad(what, s)
    return v


def temperature(s):
    """A sampling temperature from 0 (the most likely token) to 100."""
    v = _number(s)
    if not (math.isfinite(v) and 0 <= v <= 100):
        raise _bad("a number from 0 to 100", s)
    return v


def share_or_one(s):
    """A number above 0 and at most 1 (--generate-top-p,
    --generate-keep)."""
    v = _number(s)
    if not 0 < v <= 1:
        raise _bad("a number above 0 and at most 1", s)
    return v


def alpha(s):
    """"heldout" or a number from 0 to ALPHA_LIMIT (--alpha)."""
    if s == "heldout":
        return s
    v = _number(s)
    if not (math.isfinite(v) and 0 <= v <= ALPHA_LIMIT):
        raise _bad("heldout or a number from 0 to %g" % ALPHA_LIMIT, s)
    return v


def ridges(s):
    """A comma list of numbers from 0 to RIDGE_LIMIT, at least one
    (--ridge)."""
    items = [x.strip() for x in str(s).split(",")]
    vals = [_number(x) for x in items if x]
    if not vals or len(vals) != len(items) or len(vals) > 64 or \
            not all(math.isfinite(v) and 0 <= v <= RIDGE_LIMIT
                    for v in vals):
        raise _bad("a number from 0 to %g or a comma list of at most 64 "
                   "(0.01 or 0.01,0.1)" % RIDGE_LIMIT, s)
    return vals


def _path(opt, path, kind):
    if path is None:
        return
    if not os.path.exists(path):
        raise UsageError("%s %s: no such %s" % (opt, path, kind))
    if kind == "folder" and not os.path.isdir(path):
        raise UsageError("%s %s: not a folder" % (opt, path))
    if kind == "file" and os.path.isdir(path):
        raise UsageError("%s %s: a folder, not a file" % (opt, path))


def _max_positions(folder):
    """config.json's max_position_embeddings when it is a usable integer
    (a bad one is refused by load_model, naming the file and key)."""
    import json
    try:
        v = json.loads(read_input(os.path.join(folder, "config.json"),
                                  limit=64 << 20).decode("utf-8")).get(
                                      "max_position_embeddings")
    except (BicoError, OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 \
        else None


def check_inputs(a, folders, files):
    """Every input path exists and is a folder or a file as its option
    says (folders, files: [(option, path)]); --window fits the models'
    max_position_embeddings (read from config.json)."""
    for opt, p in folders:
        _path(opt, p, "folder")
    for opt, p in files:
        _path(opt, p, "file")
    window = getattr(a, "window", None)
    for opt, p in folders:
        if opt not in ("--source", "--target") or window is None:
            continue
        mp = _max_positions(p)
        if mp is not None and window > mp:
            raise UsageError("--window %d: above max_position_embeddings "
                             "(%d) of %s %s (config.json): a window longer "
                             "than the model's positions" % (window, mp,
                                                              opt, p))


def text_limit(a):
    """Bytes of --text read at most: what the windows need (a token is
    rarely more than 16 bytes; 64 allowed), at least the reader's own
    limit (bico.llm.text.TEXT_READ_LIMIT)."""
    from .text import TEXT_READ_LIMIT
    share = getattr(a, "holdout", 0.0) or 0.0
    wins = int(a.windows / (1.0 - share)) + 2
    return max(TEXT_READ_LIMIT, 64 * wins * (a.window + 1))


def read_data(a):
    """(--text's text or --ids' ids, what): read and checked here, each
    refusal naming the option.  Both are read as a stream: --text up to
    what the windows need (bico.llm.text.read_text), --ids mapped (only
    the windows used are copied); neither may be a FIFO, a device or a
    socket (refused at once, never read)."""
    from .text import read_ids, read_text
    if getattr(a, "text", None):
        what = "--text %s" % a.text
        try:
            return read_text(a.text, "--text", limit=text_limit(a)), what
        except BicoError as e:
            if e.status in _RUNTIME:
                raise UsageError("%s: cannot read it (%s)" % (
                    what, e.message.split(": ", 1)[-1]))
            raise UsageError(e.message + ("; or pass token ids with --ids"
                                          if "UTF-8" in e.message else ""))
    what = "--ids %s" % a.ids
    try:
        ids = read_ids(a.ids, "--ids")
    except BicoError as e:
        raise UsageError(e.message)
    if ids.dtype.kind not in "iu":
        raise UsageError("%s: token ids must be integers, the file holds "
                         "%s" % (what, ids.dtype))
    return ids, what


def check_ids(ids, what, models):
    """Every token id of the input (a 1-D array) is below the vocabulary
    size of each model (models: [(option, folder, vocabulary size)])."""
    if not ids.size:
        return
    chunk = 1 << 20        # a piece at a time: ids may be a mapped file
    for opt, folder, vocab in models:
        if vocab is None:
            continue
        for s in range(0, ids.size, chunk):
            part = np.asarray(ids[s:s + chunk])
            bad = np.nonzero(part >= vocab)[0]
            if bad.size:
                i = s + int(bad[0])
                raise UsageError(
                    "%s: token id %d (at position %d) is not below the "
                    "vocabulary size %d of %s %s; the ids must come from "
                    "that model's tokenizer" % (what, int(ids[i]), i, vocab,
                                                opt, folder))


def check_rank(rank, widths, target):
    """--rank at most the target's widest layer (widths: its linear
    layers' widths, or its config's hidden and intermediate sizes): a
    rank beyond every width gives factors no wider than the layers,
    only larger; refused before anything runs."""
    widths = [int(w) for w in widths if isinstance(w, int) and
              not isinstance(w, bool) and w > 0]
    if widths and rank > max(widths):
        raise UsageError("--rank %d: above the widest layer of --target %s "
                         "(%d); a LoRA rank is at most a layer's width"
                         % (rank, target, max(widths)))


def check_modules_to_save(names, model, target):
    """Each --modules-to-save entry names a module of the target (PEFT's
    rule: the name, or a dotted suffix of it); model: the target, or its
    module names (a folder the streamed fit does not load)."""
    mods = [n for n, _ in model.named_modules() if n] if \
        hasattr(model, "named_modules") else list(model)
    for s in names:
        if not any(n == s or n.endswith("." + s) for n in mods):
            raise UsageError("--modules-to-save: %r names no module of "
                             "--target %s (e.g. norm, input_layernorm, "
                             "embed_tokens)" % (s, target))


def vocab_warning(zero, vocab, what, prog):
    """A warning line when the untouched target's held-out loss is above
    ln(vocab), a uniform guess's: the token ids likely do not match the
    target's tokenizer.  None when it is not."""
    if vocab is None or vocab < 2 or not zero > math.log(vocab):
        return None
    return ("%s: warning: the untouched target's held-out loss %.4f is "
            "above ln(vocabulary size %d) = %.4f, a uniform guess's: the "
            "token ids of %s likely do not match the target's tokenizer "
            "(tokenize with it, or pass --text)" % (
                prog, zero, vocab, math.log(vocab), what))


def say(prog, err):
    """The one line of an error."""
    msg = str(err) if not isinstance(err, BicoError) else err.message
    sys.stderr.write("%s: %s\n" % (prog, " ".join(msg.split("\n"))))


# the fit's cost per fit window, in forward passes of the target over one
# window (measured: docs/llm.md, "The one command in detail")
FIT_PASSES = 22.0
GRAM_PASSES = 1.5


def estimate(per, cal, ridges, lora, auto, grid):
    """Seconds the fit and choice will take, from per: seconds of the
    target's forward pass per window (timed on the held-out windows)."""
    held = sum(len(x) for x, _ in cal.held_out)
    one = FIT_PASSES * cal.windows + (GRAM_PASSES * cal.windows if lora
                                      else 0) + held * (grid if auto else 1)
    return per * one * ridges


# the distillation's costs in forward passes (measured on the LLM table's
# cells, docs/performance.md "The distillation's phases"): a training
# token (forward, backward, the teacher's KL and the text loss, Adam)
# against a forward one (the writing is timed itself:
# bico.llm.generate.writing_seconds)
TRAIN_PASSES = 8.0
# the same with the text alone (tokenizers that differ: no teacher's KL),
# and with the first-byte teacher (bico.llm.across: its KL is over 257
# groups, as cheap as the text's loss)
TEXT_PASSES = 5.0
# The share of its WRITTEN_STEPS (400) a distillation on written text
# runs before --patience stops it: its best step 100-400 on the LLM
# table's ten cells at the defaults (2026-12-07), then 100 steps of
# patience: 0.5-1, 0.85 on average
WRITTEN_STOP = 0.85


def stop_share(own, total):
    """The share of its steps a distillation runs before --patience stops
    it, from the share of its windows that are the user's own (own of
    total; the rest written by the teacher): the written text stops
    helping sooner.  Fitted to the LLM table's cells at the defaults
    (docs/llm.md, "A few windows"): 28 own windows of 512 stopped at 0.17
    to 0.56 of the steps (mean 0.30), 56 at 0.21 to 0.65 (0.38), 448 at
    0.9 to 1."""
    return min(1.0, 0.25 + 0.8 * own / max(1, total))


def distill_estimate(f_all, f_target, windows, window, steps, batch,
                     held_tokens, every=25, text_only=False, extra_passes=0):
    """Seconds the distillation will take, from f_all / f_target: seconds
    per token of a forward of the teacher's models together / of the
    target alone (timed on a batch of fit windows): (teacher, training)
    for the teacher on `windows` windows of `window` tokens, `steps`
    steps of `batch` windows and the held-out checks every `every` steps
    (all the steps: --patience usually stops sooner, stop_share);
    text_only: no teacher's KL (the text's loss, or the first byte's);
    extra_passes: forwards a step adds (1: its layers checkpointed)."""
    teacher = windows * window * f_all
    passes = (TEXT_PASSES if text_only else TRAIN_PASSES) + extra_passes
    train = steps * batch * window * f_target * passes + \
        (steps // every + 1) * held_tokens * f_target
    return teacher, train


def duration(sec):
    if sec < 90:
        return "%.0f s" % max(sec, 1)
    if sec < 5400:
        return "%.0f min" % (sec / 60)
    return "%.1f h" % (sec / 3600)

def transformers_loader():
    """load(folder, dtype) by transformers' AutoModelForCausalLM, or a
    refusal naming --transformers when the package is missing."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise BicoError(E_ARG, "--transformers: the transformers package "
                        "is not installed (pip install transformers), or "
                        "leave the option out to read the folders with "
                        "bico.llm.load_model")

    def load(folder, dtype=None):
        return AutoModelForCausalLM.from_pretrained(
            folder, torch_dtype=dtype or "auto").eval()
    return load


def named(opt, path, fn, *args, **kw):
    """fn(*args, **kw), its BicoError prefixed with the option and path
    it concerns."""
    try:
        return fn(*args, **kw)
    except BicoError as e:
        raise BicoError(e.status, "%s %s: %s" % (opt, path, e.message))


def vocab_size(model):
    """The model's vocabulary: its input embedding's rows (None when
    it has no nn.Embedding there)."""
    emb = model.get_input_embeddings() if hasattr(
        model, "get_input_embeddings") else getattr(
            getattr(model, "model", None), "embed_tokens", None)
    return getattr(emb, "num_embeddings", None)


def setup(a):
    """--threads and --seed: PyTorch's threads (the library's go to
    transfer_model), and every random generator seeded."""
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed % 2 ** 32)
