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


def count(s):
    """An integer >= 1 (--window, --windows, --batch-size, --rank,
    --threads)."""
    try:
        v = int(s, 10)
    except (TypeError, ValueError):
        raise _bad("a positive integer", s)
    if v < 1:
        raise _bad("a positive integer", s)
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
    """A finite number > 0 (--lora-alpha)."""
    v = _number(s)
    if not (math.isfinite(v) and v > 0):
        raise _bad("a finite number above 0", s)
    return v


def nonnegative(s):
    """A finite number >= 0 (--text-weight, --teacher-weight,
    --teacher-memory)."""
    v = _number(s)
    if not (math.isfinite(v) and v >= 0):
        raise _bad("a finite number >= 0", s)
    return v


def routes(a):
    """The route options of the command, checked together."""
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


def alpha(s):
    """"auto" or a finite number >= 0 (--alpha)."""
    if s == "auto":
        return s
    v = _number(s)
    if not (math.isfinite(v) and v >= 0):
        raise _bad("auto or a finite number >= 0", s)
    return v


def ridges(s):
    """A comma list of finite numbers >= 0, at least one (--ridge)."""
    items = [x.strip() for x in str(s).split(",")]
    vals = [_number(x) for x in items if x]
    if not vals or len(vals) != len(items) or \
            not all(math.isfinite(v) and v >= 0 for v in vals):
        raise _bad("a finite number >= 0 or a comma list of them "
                   "(0.01 or 0.01,0.1)", s)
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
    try:
        import json
        with open(os.path.join(folder, "config.json")) as f:
            v = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
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


def read_data(a):
    """(--text's text or --ids' ids, what): read and checked here, each
    refusal naming the option."""
    if getattr(a, "text", None):
        what = "--text %s" % a.text
        try:
            with open(a.text, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise UsageError("%s: cannot read it (%s)" % (what, e.strerror
                                                          or e))
        try:
            return raw.decode("utf-8"), what
        except UnicodeDecodeError as e:
            raise UsageError("%s: not UTF-8 text (byte 0x%02x at offset "
                             "%d); convert it (iconv -t UTF-8) or pass "
                             "token ids with --ids" % (what, raw[e.start],
                                                        e.start))
    what = "--ids %s" % a.ids
    try:
        ids = np.load(a.ids, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UsageError("%s: not a .npy file of token ids (%s)"
                         % (what, str(e).splitlines()[0][:200]))
    if ids.dtype.kind not in "iu":
        raise UsageError("%s: token ids must be integers, the file holds "
                         "%s" % (what, ids.dtype))
    return ids, what


def check_ids(ids, what, models):
    """Every token id of the input (a 1-D array) is below the vocabulary
    size of each model (models: [(option, folder, vocabulary size)])."""
    if not ids.size:
        return
    for opt, folder, vocab in models:
        if vocab is None:
            continue
        bad = np.nonzero(ids >= vocab)[0]
        if bad.size:
            raise UsageError(
                "%s: token id %d (at position %d) is not below the "
                "vocabulary size %d of %s %s; the ids must come from that "
                "model's tokenizer" % (what, int(ids[bad[0]]), int(bad[0]),
                                       vocab, opt, folder))


def check_modules_to_save(names, model, target):
    """Each --modules-to-save entry names a module of the target (PEFT's
    rule: the name, or a dotted suffix of it)."""
    mods = [n for n, _ in model.named_modules() if n]
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
# window (measured: docs/llm-quickstart.md, "How long it takes")
FIT_PASSES = 22.0
GRAM_PASSES = 1.5


def estimate(per, cal, ridges, lora, auto, grid):
    """Seconds the fit and choice will take, from per: seconds of the
    target's forward pass per window (timed on the held-out windows)."""
    held = sum(len(x) for x, _ in cal.held_out)
    one = FIT_PASSES * cal.windows + (GRAM_PASSES * cal.windows if lora
                                      else 0) + held * (grid if auto else 1)
    return per * one * ridges


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
                        "bico.torch.load_model")

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
