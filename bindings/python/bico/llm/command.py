"""bico.llm.command: python3 -m bico.llm, which carries a decoder
fine-tune from model folders and task text to a target adapter or a
target folder, with the fit.

    python3 -m bico.llm --source A/ --source-tuned A_ft/ --target B/ \\
        --text task.txt --output-lora B_adapter/ --rank 16
    python3 -m bico.llm --source A/ --lora A_adapter/ --target B/ \\
        --ids ids.npy --output B_ft/

--method fit (on the CPU, without --in-memory or --transformers) runs the
models a block at a time from their folders (bico.llm.stream_route: memory
that does not grow with their depth); --method distill and auto (the
default), and --in-memory, read them whole with bico.llm.load_model
(Llama, Mistral, Qwen2, Gemma folders; one file or shards).  --text is tokenized with the
target folder's tokenizer.json (or --tokenizer): by Hugging Face's
`tokenizers` when installed, natively for a byte-level tokenizer without
merges; --ids takes token ids (.npy) from any tokenizer.  The text is cut
into windows (--window tokens); --holdout of them are held out to choose
the scale alpha (and the ridge when --ridge lists several) by next-token
loss, with alpha 0 (the untouched target) among the candidates, so the
result is never worse than the target on the held-out windows.  The fit
(bico.torch.transfer_model, method "fit") needs PyTorch; `bico transfer`
is the PyTorch-free route.  What was chosen is printed and recorded in the
output: the safetensors metadata of --output, bico_adapter.json beside
the adapter of --output-lora (PEFT refuses unknown keys in
adapter_config.json).  Both models must share the tokenizer.
"""
import math
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from .. import _blis, _heap
from .._status import BicoError, E_ARG, E_IO
from .. import safetensors as _st
from ..torch.choose import pick
from ..torch.tied import _tied_groups
from ..torch.transfer import transfer_model
from . import adapters as _adapters
from .adapters import save_adapter, update_grams, low_rank, write_pairs
from . import distill as _distill
from .distill import LINEAR_MODULES
from .families import load_model, _weights_path
from . import options as opts
from .options import (named as _named, setup as _setup,  # noqa: F401
                      vocab_size as _vocab,
                      transformers_loader as _transformers_loader)
from .text import text_batches, next_token_loss, lm_loss, tokenize

GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
# --generate auto: the teacher writes windows until the distillation has
# this many (docs/llm.md, "A few windows")
GENERATE_TOTAL = 512
# --patience: held-out checks without a better loss before distillation
# stops (docs/llm.md, "A few windows")
PATIENCE = 4
# the distillation's steps when the teacher wrote most of its windows
# (--steps not given): the held-out loss is best after 100-350 steps
# whatever the schedule's length, and a 400-step cosine reaches the
# 1200-step one's quality while patience stops it at a steadier share of
# its steps (a time the estimate can foresee; docs/llm.md, "A few
# windows").  Where the user's windows are the most (512 of them: 448
# fit, 64 written), 400 steps lost 12 points of the gap against the
# default's 1200 (87 % against 99 %): the default runs there.
WRITTEN_STEPS = 400
# the factors' learning rate when the tokenizers differ and the text is
# the only loss (no teacher): 5e-3, the teacher's, overshot on the LLM
# table's BPE cell (no held-out gain at the first check); 2e-3 gained
# most (docs/llm.md, "Across tokenizers")
TEXT_ONLY_LR = 2e-3


def _log(quiet, *a):
    _distill.check_stop()
    if not quiet:
        print(*a, file=sys.stderr, flush=True)


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
        from .. import fit as _fit
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


def _choose_alpha(model, base, delta, held, grid, quiet):
    scores = {}
    for a in grid:
        _apply(model, base, delta, a)
        scores[a] = lm_loss(model, held)
        _log(quiet, "alpha %-5g held-out loss %.4f" % (a, scores[a]))
    model.load_state_dict(base)
    best = pick(scores)
    return best, scores


def _tuned_from_lora(source, adapter, tmp):
    """The source folder with the adapter merged (libbico's own merge)."""
    from ..lora import transfer
    out = os.path.join(tmp, "source_tuned") + "/"
    transfer(source, source, adapter, merged_output=out, method="naive")
    for n in os.listdir(source):
        if n.endswith(".json") and "safetensors" not in n and \
                not os.path.exists(os.path.join(out, n)):
            shutil.copy(os.path.join(source, n), os.path.join(out, n))
    return out



def _parser(prog):
    p = opts.Parser(
        prog=prog, epilog="Exit status: 0 done; 2 a user mistake (an "
        "option's value, a missing or unusable input), one line naming the "
        "option or file, nothing written; 1 a failure while running.  "
        "'%s stats --help': the statistics file `bico transfer --stats` "
        "reads, from the same folders and text.  Across processes (--method "
        "fit under torchrun, or any launcher that sets RANK, WORLD_SIZE, "
        "MASTER_ADDR and MASTER_PORT; docs/scale-out.md): every rank must "
        "be given the same options and inputs (compared before any work: "
        "the options but --threads, --memory-budget, --teacher-memory, "
        "--spill-dir and those of rank 0's output; the input files by "
        "content, sampled for the model folders), else every rank stops "
        "naming what differs; BICO_RANKS_JOIN_TIMEOUT (seconds, default "
        "300) bounds the wait for every rank to join, BICO_RANKS_TIMEOUT "
        "(default 1800) each exchange between ranks (rank 0's solves and "
        "write included): a rank missing or stopped longer ends every "
        "other with one line." % prog,
        description="Carry a decoder fine-tune to another decoder with the "
        "fit, from model folders and task text, to a PEFT adapter "
        "(--output-lora) or a model folder (--output).")
    from .._version import version
    p.add_argument("--version", action="version",
                   version="%(prog)s (libbico) " + version())
    p.add_argument("--source", required=True, help="source base folder")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--source-tuned", help="source fine-tuned folder")
    g.add_argument("--lora", help="PEFT LoRA adapter of the source")
    p.add_argument("--target", required=True, help="target base folder")
    t = p.add_mutually_exclusive_group(required=True)
    t.add_argument("--text", help="task text file (UTF-8)")
    t.add_argument("--ids", help="token ids, a .npy file")
    p.add_argument("--tokenizer", help="tokenizer.json or folder (default: "
                   "the target folder)")
    o = p.add_mutually_exclusive_group(required=True)
    o.add_argument("--output-lora", help="adapter folder to write")
    o.add_argument("--output", help="model folder to write")
    p.add_argument("--replace", action="store_true",
                   help="--output-lora may name a folder that holds files: "
                   "they are replaced by the new adapter (default: such a "
                   "folder is refused)")
    p.add_argument("--wait", type=opts.seconds, default=0,
                   help="seconds to wait for another run writing the "
                   "output folder (default 0: refused at once, naming it)")
    p.add_argument("--rank", type=opts.rank, default=16,
                   help="LoRA rank (16)")
    p.add_argument("--lora-alpha", type=opts.positive, default=None,
                   help="PEFT lora_alpha (default: the rank)")
    p.add_argument("--modules-to-save", default="",
                   help="comma list of modules stored whole in the adapter "
                   "(e.g. norm,input_layernorm,post_attention_layernorm,"
                   "embed_tokens); other non-linear updates are left out "
                   "and reported")
    p.add_argument("--base-model-name-or-path", default=None,
                   help="the adapter's base_model_name_or_path (default: "
                   "the absolute path of --target)")
    p.add_argument("--window", type=opts.window, default=128,
                   help="tokens per calibration window (128; at most the "
                   "models' max_position_embeddings)")
    p.add_argument("--windows", type=opts.count,
                   default=opts.DEFAULT_WINDOWS,
                   help="at most this many windows, spread evenly over the "
                   "text (%d; the time grows with it: the command prints "
                   "an estimate before the fit)" % opts.DEFAULT_WINDOWS)
    p.add_argument("--holdout", type=opts.share, default=0.125,
                   help="share of windows held out for alpha/ridge (0.125)")
    p.add_argument("--batch-size", type=opts.count, default=8)
    p.add_argument("--ridge", type=opts.ridges, default=[0.01],
                   help="ridge c of the fit, or a comma list to choose "
                   "from on the held-out windows (0.01)")
    p.add_argument("--threads", type=opts.threads, default=None,
                   help="threads of PyTorch and of the library (default: "
                   "theirs)")
    p.add_argument("--seed", type=opts.seed, default=0,
                   help="seed of the window order and of any randomness "
                   "(0): one seed, one result")
    p.add_argument("--alpha", type=opts.alpha, default="auto",
                   help="scale of the carried update: auto (held-out "
                   "choice among %s) or a number" % ", ".join(
                       "%g" % a for a in GRID))
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16",
                                       "float16"), default="float32",
                   help="dtype the models are computed in (float32); "
                   "outputs keep the target's dtype")
    p.add_argument("--transformers", action="store_true",
                   help="read the models with transformers' "
                   "AutoModelForCausalLM (when installed) instead of "
                   "bico.llm.load_model: for families load_model does "
                   "not know (implies --in-memory)")
    p.add_argument("--in-memory", action="store_true",
                   help="--method fit: hold the models whole in memory (the "
                   "route before streaming); by default the fit runs the "
                   "models a block at a time from their folders, in memory "
                   "that does not grow with their depth.  --method distill "
                   "and auto: hold the three models while the teacher is "
                   "computed (by default each model runs from its folder a "
                   "block at a time, then the target alone is loaded to "
                   "train).  --init warm and a --device other than cpu "
                   "imply it")
    p.add_argument("--memory-budget", type=opts.mebibytes, default=64,
                   help="MiB of calibration states and fitted blocks the "
                   "streamed fit keeps in memory; beyond it they go to a "
                   "temporary file that has no name (64)")
    p.add_argument("--spill-dir", default=None,
                   help="folder of that temporary file (default: the "
                   "output's parent folder, else $TMPDIR; never an input "
                   "folder)")
    _route_options(p)
    p.add_argument("--quiet", action="store_true")
    return p


def _route_options(p):
    """The parser's "routes" group: the route and distillation's
    options."""
    d = p.add_argument_group(
        "routes", "--method fit: the sequential fit (a dense update, an "
        "adapter by reduced-rank regression); distill: the target "
        "trained towards the proxy-tuned teacher softmax(z_B + z_A_ft - "
        "z_A) (an adapter's factors directly, or every weight for "
        "--output); auto: both, the one with the least held-out loss "
        "kept (the untouched target unless one beats it clearly).  The fit "
        "streams the models from their folders a block at a time; distill "
        "computes its teacher that way, then trains the target alone in "
        "memory")
    d.add_argument("--method", choices=("fit", "distill", "auto"),
                   default="auto", help="route (auto)")
    d.add_argument("--trainable", choices=("lora", "dense"), default=None,
                   help="what distillation trains: LoRA factors (default "
                   "with --output-lora) or every weight (default with "
                   "--output)")
    d.add_argument("--init", choices=("cold", "warm"), default="cold",
                   help="distillation's factors start as PEFT's (cold: A "
                   "random, B zero) or from the fit's rank-r pairs (warm; "
                   "runs the fit first)")
    d.add_argument("--target-modules", default=",".join(LINEAR_MODULES),
                   help="linear layers that get LoRA factors in "
                   "distillation, PEFT names (%s)" % ",".join(
                       LINEAR_MODULES))
    d.add_argument("--steps", type=opts.count, default=None,
                   help="distillation's optimiser steps (default: 20 "
                   "passes over the windows, 200 to 1200)")
    d.add_argument("--lr", type=opts.learning_rate, default=None,
                   help="distillation's learning rate (5e-3 for factors, "
                   "2e-3 for dense weights, and for factors learning the "
                   "text alone when the tokenizers differ)")
    d.add_argument("--text-weight", type=opts.nonnegative,
                   default=_distill.TEXT_WEIGHT,
                   help="distillation's loss adds this times the windows' "
                   "own next-token loss (%g; 0: the teacher alone)"
                   % _distill.TEXT_WEIGHT)
    d.add_argument("--teacher-weight", type=opts.nonnegative, default=1.0,
                   help="distillation's loss: this times the KL to the "
                   "teacher (1; 0 with --text-weight 1 trains the target "
                   "on the text alone, a control that carries nothing "
                   "from the source)")
    d.add_argument("--teacher-k", type=opts.count, default=64,
                   help="teacher entries kept per token: the top k "
                   "log-probabilities and the rest's mass (64; all when "
                   "the vocabulary is not larger)")
    d.add_argument("--teacher-memory", type=opts.mebibytes, default=1024,
                   help="MiB of teacher entries kept in memory; the rest "
                   "go to a temporary folder (1024)")
    d.add_argument("--patience", type=opts.count_or_zero, default=PATIENCE,
                   help="distillation stops once this many held-out checks "
                   "(every 25 steps) in a row found nothing better (%d; 0: "
                   "every step runs)" % PATIENCE)
    d.add_argument("--generate", type=opts.generate_count, default="auto",
                   help="windows of task text the teacher writes for the "
                   "distillation, from prompts cut from the fit windows "
                   "(auto: enough to make %d windows with the user's; 0: "
                   "none); the held-out windows stay the user's"
                   % GENERATE_TOTAL)
    d.add_argument("--generate-mode", choices=("write", "perturb", "both"),
                   default="write",
                   help="how the windows are made: written from prompts "
                   "(write), the user's windows with --perturb-share of their "
                   "tokens resampled from the teacher (perturb), or half of "
                   "each (both)")
    d.add_argument("--perturb-share", type=opts.share_or_one, default=0.15,
                   help="perturb: the share of a window's tokens resampled "
                   "(0.15)")
    d.add_argument("--generate-by", choices=("teacher", "tuned"),
                   default="teacher",
                   help="who writes: the teacher softmax(z_B + z_A_ft - z_A) "
                   "(default) or the fine-tuned source alone (always, when "
                   "the tokenizers differ)")
    d.add_argument("--generate-prompt", type=opts.count, default=None,
                   help="tokens of the user's text each written window "
                   "starts from (default: a quarter of --window)")
    d.add_argument("--generate-temperature", type=opts.temperature,
                   default=1.0, help="the written text's sampling "
                   "temperature (1)")
    d.add_argument("--generate-top-p", type=opts.share_or_one, default=0.95,
                   help="nucleus sampling: the fewest tokens whose "
                   "probability adds up to this (0.95)")
    d.add_argument("--generate-keep", type=opts.share_or_one, default=1.0,
                   help="share of the written windows kept, the most "
                   "likely under the fine-tuned source (1: all)")
    d.add_argument("--across", choices=("byte", "text"), default="byte",
                   help="tokenizers that differ: the teacher on the next "
                   "token's first byte (the axis both vocabularies share) "
                   "beside the text the fine-tuned source writes (byte, "
                   "default), or that text alone (text)")
    d.add_argument("--device", default="cpu",
                   help="torch device the models run on: cpu (default) or "
                   "cuda[:N] when present (implies --in-memory)")


def _load(a, dt, tmp, q):
    """(source, tuned source, target, {target tensor: its files' dtype} or
    None): the three models read (a LoRA merged into the source first)."""
    tuned = a.source_tuned
    if a.lora:
        _log(q, "merging %s into %s" % (a.lora, a.source))
        tuned = _named("--lora", a.lora, _tuned_from_lora, a.source, a.lora,
                       tmp)
    _log(q, "loading %s, %s, %s" % (a.source, a.source_tuned or a.lora,
                                     a.target))
    _warn_tokenizers(a)
    load = _transformers_loader() if a.transformers else load_model
    src, srt, tgt = (_named(o, f, load, f, dtype=dt) for o, f in (
        ("--source", a.source), ("--lora" if a.lora else "--source-tuned",
                                 tuned), ("--target", a.target)))
    return src, srt, tgt, _target_dtypes(a, dt)


def _load_target(a, dt, q):
    """(the target read, {target tensor: its files' dtype} or None): the
    streamed teacher's route, which never holds the source pair."""
    _log(q, "loading %s" % a.target)
    tgt = _named("--target", a.target, load_model, a.target, dtype=dt)
    return tgt, _target_dtypes(a, dt)


def _target_dtypes(a, dt):
    """{target tensor: its files' dtype} when the models are computed at
    another dtype dt (the outputs keep the target's), else None."""
    tdtypes = None
    if dt is not None:
        tf = os.path.join(a.target, "model.safetensors.index.json")
        if not os.path.exists(tf):
            tf = os.path.join(a.target, "model.safetensors")
        with _st.open(tf) as f:
            files = {k: f.info(k)[0] for k in f.keys()}
        names = {"BF16": torch.bfloat16, "F16": torch.float16,
                 "F32": torch.float32, "F64": torch.float64}
        tdtypes = {k: names[v] for k, v in files.items() if v in names}
    return tdtypes


def _warn_tokenizers(a):
    """The fit (and BiCo) take token ids to mean the same in both models:
    said when the tokenizers differ and a route of theirs runs."""
    if a.vocab.kind != "same" and a.method in ("fit", "auto"):
        print("python3 -m bico.llm: warning: %s and %s differ; the fit "
              "assumes one tokenizer (token ids mean the same in both "
              "models)" % (a.vocab.source, a.vocab.target),
              file=sys.stderr)


def _method_for_tokenizers(a, q):
    """The routes two tokenizers leave: the fit (and the warm start that
    runs it) takes token ids to mean the same in both models, so with
    tokenizers that differ --method auto runs the distillation alone
    (said), and --method fit or --init warm is refused (exit 2); decided
    before a route is chosen, from the tokenizer files alone."""
    if a.method == "distill" and a.init != "warm":
        return
    from .vocab import relation
    tok = a.tokenizer or a.target
    rel = _named("--tokenizer" if a.tokenizer else "--target", tok,
                 relation, a.source, tok)
    if rel.kind != "different":
        return
    if a.method == "fit" or a.init == "warm":
        raise opts.UsageError(
            "%s: the tokenizers differ (%s, %s): the fit needs one "
            "tokenizer (token ids that mean the same in both models); "
            "--method distill carries the task as text"
            % ("--method fit" if a.method == "fit" else "--init warm",
               rel.source, rel.target))
    a.method = "distill"
    _log(q, "--method auto: the tokenizers differ (%s, %s) and the fit "
         "needs one: the distillation alone" % (rel.source, rel.target))


def _relation(a, text, q):
    """How the source's and the target's tokenizers relate
    (bico.llm.vocab.relation), said when they differ; "different" with
    --ids is the user's mistake (ids of one tokenizer mean nothing to the
    other)."""
    from .vocab import relation
    tok = a.tokenizer or a.target
    rel = _named("--tokenizer" if a.tokenizer else "--target", tok,
                 relation, a.source, tok, text)
    if rel.kind == "grown":
        _log(q, "tokenizers: %s extends %s (its first %d ids are the "
             "source's, and the task text tokenizes the same with both): "
             "the teacher on the shared ids, the new ones left to the "
             "text" % (rel.target, rel.source, rel.shared))
    elif rel.kind == "different":
        if a.method != "distill" or a.init == "warm":
            # the tokenizers alone looked alike (_method_for_tokenizers),
            # the text tokenizes otherwise with each
            raise opts.UsageError(
                "--text %s tokenizes differently with %s and %s: the fit "
                "needs one tokenizer; --method distill carries the task "
                "as text" % (a.text, rel.source, rel.target))
        if not a.text:
            raise opts.UsageError(
                "--ids %s: the source's and the target's tokenizers differ "
                "(%s, %s): ids of one mean nothing to the other; give the "
                "task as --text" % (a.ids, rel.source, rel.target))
        _log(q, "tokenizers: %s and %s differ: the fine-tuned source "
             "writes task text in its own tokens and the target learns it "
             "with its own%s" % (rel.source, rel.target,
                                 ", with the teacher on the next token's "
                                 "first byte (the axis both vocabularies "
                                 "share)" if a.across != "text" and
                                 a.teacher_weight > 0 else
                                 " (sequence-level distillation)"))
    return rel


def _source_windows(a, text):
    """The task text in the source's tokens, as windows (text_batches of
    the command's options): the fine-tuned source's prompts when the
    tokenizers differ."""
    ids = _named("--source", a.source, tokenize, text, a.source)
    a.source_tokens = max(1, int(ids.numel()))
    try:
        return text_batches(ids, a.window, n=a.windows, holdout=a.holdout,
                            batch_size=a.batch_size, seed=a.seed)
    except BicoError as e:
        raise BicoError(e.status, "--text %s in the source's tokens: %s"
                        % (a.text, e.message))


def _calibration(a, q):
    """(the windows of --text / --ids (text_batches), some held out, at
    most --windows of them, in --seed's order; all the token ids)."""
    data, what = opts.read_data(a)
    a.vocab = _relation(a, data if a.text else None, q)
    a.source_cal = None
    if a.text:
        tok = a.tokenizer or a.target
        text = data
        data = _named("--tokenizer" if a.tokenizer else "--target", tok,
                      tokenize, text, tok)
        if a.vocab.kind == "different":     # the source's own windows
            a.source_cal = _source_windows(a, text)
            # target tokens per source token of the text: the written
            # windows' count once tokenized again (the estimate)
            a.token_ratio = int(np.asarray(data).size) / a.source_tokens
    ids = np.asarray(data).reshape(-1)
    total = (int(ids.size) - 1) // a.window
    try:
        cal = text_batches(data, a.window, n=a.windows,
                           holdout=a.holdout, batch_size=a.batch_size,
                           seed=a.seed)
    except BicoError as e:
        raise BicoError(e.status, "%s: %s" % (what, e.message))
    if not cal.held_out:
        raise opts.UsageError(
            "%s makes %d window(s) of %d tokens: too few to hold any out; "
            "give more text or a smaller --window" % (what, cal.windows,
                                                      a.window))
    held = sum(len(x) for x, _ in cal.held_out)
    _blis.say(lambda m: _log(q, m))   # its first line, once checked
    _log(q, "calibration: %d windows of %d tokens (%d batches), %d held "
         "out%s" % (cal.windows, a.window, len(cal.batches), held,
                    "; %d of the %d windows the text makes (--windows "
                    "raises the cap)" % (cal.windows + held, total)
                    if total > cal.windows + held else ""))
    return cal, ids


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
    ridge, each scaled by its alpha (chosen on the held-out windows, or
    --alpha), the ridge chosen on them too (pick)."""
    base = {k: v.detach().clone() for k, v in tgt.state_dict().items()}
    n_lin = _fitted_layers(tgt)
    best, losses = None, {}
    for j, ridge in enumerate(ridges):
        _log(q, "fit: ridge %g, %d layers" % (ridge, n_lin))
        with _FitProgress(n_lin, q):
            new = transfer_model(src, srt, tgt, cal.batches,
                                 method="fit",
                                 loss_fn=next_token_loss, ridge=ridge,
                                 # the scale is chosen below, on
                                 # the text's own held-out windows
                                 alpha=1.0, holdout=0,
                                 show_progress=not q, threads=a.threads)
        delta = {k: new[k].double() - base[k].double() for k in base
                 if k in new}
        eff, rep = delta, None
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
        if alpha_arg == "auto":
            al, scores = _choose_alpha(tgt, base, eff, cal.held_out,
                                       GRID, q)
        else:
            al = alpha_arg
            _apply(tgt, base, eff, al)
            scores = {al: lm_loss(tgt, cal.held_out)}
            tgt.load_state_dict(base)
        cand = (scores[al], ridge, al, delta, rep, scores,
                cov if a.output_lora else None)
        losses[j] = cand[0]
        if pick(losses) == j:   # the least held-out loss so far
            best = cand
    return base, best


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


ROUTES = {0: "target", 1: "fit", 2: "distill"}


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
    per = {0: _distill._d.window_losses(tgt, cal.held_out)}
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


def _mode(a):
    """What distillation trains: "lora" (factors) or "dense"."""
    return a.trainable or ("lora" if a.output_lora else "dense")


def _distill_target(a, tgt, cal, log, tmp, init, models):
    """The distillation route on the loaded target (bico.llm.distill.run
    with the command's options): the teacher given in models["teacher"]
    (taken out of the dict), else computed from models["source"] and
    ["tuned"] (the dict emptied once it is)."""
    mode = _mode(a)
    saves = [s for s in a.modules_to_save.split(",") if s]
    if _byte_teacher_wanted(a) and "source" in models:
        models["teacher"] = _byte_teacher(a, models["source"],
                                          models["tuned"], cal, log)
        for k in ("source", "tuned"):
            models.pop(k, None)
    return _distill.run(
        None, None, tgt, cal, log, mode=mode,
        pair=models if "source" in models else None,
        teacher=models.pop("teacher", None),
        rank=a.rank, lora_alpha=a.lora_alpha,
        modules=[m for m in a.target_modules.split(",") if m],
        save=saves if mode == "lora" else (), init=init, steps=_steps(a),
        lr=a.lr if a.lr is not None or a.vocab.kind != "different" or
        mode != "lora" or _byte_teacher_wanted(a) else TEXT_ONLY_LR,
        teacher_k=a.teacher_k,
        budget=int(a.teacher_memory * (1 << 20)), spill_dir=tmp,
        seed=a.seed, **_losses(a), patience=a.patience or None,
        shared=a.vocab.shared, own=None if a.vocab.kind == "different"
        else getattr(a, "own_batches", None))


def _steps(a):
    """--steps, or WRITTEN_STEPS when the teacher wrote more windows than
    the user gave, or None (bico.llm.distill's default from the number of
    batches)."""
    if a.steps is None and getattr(a, "written_most", False):
        return WRITTEN_STEPS
    return a.steps


def _byte_teacher_wanted(a):
    return a.vocab.kind == "different" and a.across != "text" and \
        a.teacher_weight > 0


def _byte_teacher(a, source, tuned, cal, log):
    """The first-byte teacher (bico.llm.across) of cal's fit batches, the
    source pair run over each window's text in the source's tokens."""
    from . import across
    from .text import load_tokenizer
    clock = _distill.Clock("teacher (the source pair on the first byte)",
                           len(cal.batches), log)
    tok_a = load_tokenizer(a.source)
    tok_b = load_tokenizer(a.tokenizer or a.target)
    return across.build(source, tuned, tok_a, tok_b, cal.batches, a.window,
                        progress=lambda i, n: clock(i))


def _losses(a):
    """The distillation's weights: the command's, or, when the tokenizers
    differ, the text alone (the source wrote it: sequence-level
    distillation; the logits have no common axis for a teacher)."""
    if a.vocab.kind == "different" and not _byte_teacher_wanted(a):
        return {"text_weight": 1.0, "teacher_weight": 0.0}
    return {"text_weight": a.text_weight,
            "teacher_weight": a.teacher_weight}


def _generate_count(a, cal):
    """How many windows the teacher writes: --generate, or auto's
    GENERATE_TOTAL less the user's fit windows (none beyond it), counted
    in the target's tokens: when the tokenizers differ, the source writes
    windows of its own tokens, as many more as the target's tokenizer
    makes fewer tokens of the same text (a.token_ratio; at most 4 times
    as many; docs/llm.md, "Across tokenizers": measured)."""
    if a.generate == "auto":
        n = max(0, GENERATE_TOTAL - cal.windows)
        if a.vocab.kind == "different":
            n = int(math.ceil(n / min(1.0, max(0.25, a.token_ratio))))
        return n
    return a.generate


def _generated(a, models, cal, q):
    """cal with the windows the teacher (models: source, fine-tuned
    source, target, loaded) writes appended to its fit batches (the
    held-out batches unchanged), or cal itself when none are asked for.
    Tokenizers that differ: models[1], the fine-tuned source, writes in
    its own tokens from prompts of the text in them (a.source_cal), and
    the text is tokenized again with the target's tokenizer."""
    n = _generate_count(a, cal)
    if not n:
        return cal
    from .generate import write
    a.own_batches = len(cal.batches)    # the text loss: these alone
    window = cal.batches[0][0].shape[1]
    diff = a.vocab.kind == "different"
    a.written_most = (int(n * getattr(a, "token_ratio", 1.0)) if diff
                      else n) > cal.windows
    src_cal = a.source_cal if diff else cal
    ms = (models[1],) if diff or a.generate_by == "tuned" else models
    dev = next(ms[-1].parameters()).device
    _log(q, "generate: the %s writes %d windows of %d tokens from prompts "
         "of the %d fit windows (temperature %g, top-p %g%s)"
         % ("fine-tuned source" if len(ms) == 1 else "teacher", n, window,
            src_cal.windows, a.generate_temperature, a.generate_top_p,
            "" if a.generate_keep >= 1 else
            ", the likeliest %g kept" % a.generate_keep))
    from .generate import perturb
    nw = {"write": n, "perturb": 0, "both": n - n // 2}[a.generate_mode]
    _distill_estimate(a, ms, models[2] if len(models) > 2 and
                      models[2] is not models[1] else None, src_cal, cal,
                      n, nw, window, q)
    gen = write(ms, src_cal.batches, nw, window,
                prompt_tokens=a.generate_prompt,
                temperature=a.generate_temperature, top_p=a.generate_top_p,
                batch_size=a.batch_size, seed=a.seed, keep=a.generate_keep,
                log=lambda m: _log(q, m), device=dev,
                shared=a.vocab.shared) if nw else []
    if n - nw:
        gen += perturb(ms, src_cal.batches, n - nw, a.perturb_share,
                       temperature=a.generate_temperature,
                       top_p=a.generate_top_p, batch_size=a.batch_size,
                       seed=a.seed, shared=a.vocab.shared, device=dev)
    if diff:
        gen = _in_target_tokens(a, gen, window)
        _log(q, "generate: %d windows of the target's tokens from the "
             "written text" % sum(len(x) for x, _ in gen))
    return cal._replace(batches=list(cal.batches) + gen)


def _forward_seconds(models, x):
    """Seconds per token of a forward of each model over x, timed (the
    faster of two, after a first pass that warms the caches)."""
    out = []
    with torch.no_grad():
        for m in models:
            m(x[:1, :8])
            best = None
            for _ in range(2):          # the faster of two: less noise
                t = time.time()
                m(x)
                el = time.time() - t
                best = el if best is None else min(best, el)
            out.append(best / x.numel())
    return out


def _folder_weights(folder):
    """The number of weights in a model folder's safetensors headers."""
    with _st.open(_weights_path(folder)) as f:
        return sum(int(np.prod(f.info(n)[1])) for n in f.keys())


def _distill_estimate(a, writers, target, src_cal, cal, n, nw, window, q):
    """The distillation's time, printed before it starts (writing the
    windows, the teacher on them and the user's, the training at most:
    --patience may end it sooner), extrapolated from a forward of each
    writer over a batch of its fit windows (opts.distill_estimate) and
    the writing from a timed start of it (generate.writing_seconds), the
    target's cost timed the same way when it is loaded, else scaled from
    a writer's by the weights in the folders; the run's whole time (what
    ran so far and this) recorded in the output's metadata
    (bico_estimate_seconds)."""
    dev = next(writers[0].parameters()).device
    f = _forward_seconds(writers, src_cal.batches[0][0].to(dev))
    f_all = sum(f)
    if target is not None:
        f_tgt = _forward_seconds([target], cal.batches[0][0].to(dev))[0]
    else:
        mine = sum(p.numel() for p in writers[0].parameters())
        f_tgt = f[0] * _folder_weights(a.target) / max(1, mine)
    diff = a.vocab.kind == "different"
    # the written windows in the target's tokens (fewer or more windows
    # when the tokenizers differ)
    n_t = int(n * getattr(a, "token_ratio", 1.0)) if diff else n
    total = len(cal.batches) + -(-n_t // a.batch_size)
    steps, _ = _distill._defaults(_mode(a), _steps(a), a.lr, total)
    held = sum(y.numel() for _, y in cal.held_out)
    byte = _byte_teacher_wanted(a)
    t, tr = opts.distill_estimate(
        f_all, f_tgt, cal.windows + n, window, steps, a.batch_size, held,
        text_only=diff)
    from .generate import writing_seconds
    w = writing_seconds(writers, src_cal.batches, nw, window,
                        prompt_tokens=a.generate_prompt, device=dev,
                        shared=a.vocab.shared)
    if byte:
        # the source pair over every fit window's text in its tokens, the
        # target once over the windows in its own (bico.llm.across)
        ratio = getattr(a, "token_ratio", 1.0)
        t = 2 * f_all * (n + cal.windows / ratio) * window + \
            f_tgt * (cal.windows + n_t) * window
    elif diff:
        t = 0.0                      # the text alone: no teacher
    so_far = time.time() - getattr(a, "t0", time.time())
    if not a.patience:
        share = 1.0
    elif _steps(a) == WRITTEN_STEPS and a.steps is None:
        share = opts.WRITTEN_STOP
    else:
        share = opts.stop_share(cal.windows, cal.windows + n_t)
    likely = tr * share
    a.estimate = so_far + w + t + likely
    _log(q, "estimate: about %s for the distillation: %s writing %d "
         "windows, %s the teacher, about %s training (at most %s for all "
         "%d steps; --patience stops it once the held-out loss stops "
         "improving); the run: about %s in all, %s so far" % (
             opts.duration(w + t + likely), opts.duration(w), n,
             opts.duration(t), opts.duration(likely), opts.duration(tr),
             steps, opts.duration(a.estimate), opts.duration(so_far)))


def _in_target_tokens(a, gen, window):
    """The windows the source wrote (its token ids), decoded to text and
    tokenized again with the target's tokenizer, cut into windows of
    `window` + 1 target tokens, in batches of --batch-size."""
    from .text import detokenize, load_tokenizer
    tok_a = load_tokenizer(a.source)
    tok_b = load_tokenizer(a.tokenizer or a.target)
    texts = [detokenize(torch.cat([x[i], y[i, -1:]]), tok_a)
             for x, y in gen for i in range(len(x))]
    ids = torch.as_tensor(np.asarray(tok_b.encode("\n".join(texts)),
                                     dtype=np.int64))
    m = (len(ids) - 1) // window
    if m < 1:
        return []
    wins = torch.stack([ids[k * window:(k + 1) * window + 1]
                        for k in range(m)])
    bs = a.batch_size
    return [(wins[s:s + bs, :-1].contiguous(), wins[s:s + bs, 1:]
             .contiguous()) for s in range(0, m, bs)]


def _generated_from_folders(a, dt, q, cal, tuned):
    """_generated with the three models read whole for the writing and
    freed afterwards (the teacher is then computed from the folders a
    block at a time, as without generation)."""
    if not _generate_count(a, cal):
        return cal
    which = (("--source", a.source), ("--lora" if a.lora else
                                      "--source-tuned", tuned),
             ("--target", a.target))
    if a.vocab.kind == "different" or a.generate_by == "tuned":
        which = which[1:2] * 2          # the fine-tuned source alone
    _log(q, "loading %s to write task text" % ", ".join(
        sorted(set(f for _, f in which), key=[f for _, f in which].index)))
    loaded = {}
    ms = tuple(loaded.setdefault(f, _named(o, f, load_model, f, dtype=dt))
               if f not in loaded else loaded[f] for o, f in which)
    try:
        return _generated(a, ms, cal, q)
    finally:
        del ms
        _heap.trim()


def _across_from_folders(a, dt, q, cal, tuned):
    """Tokenizers that differ, the first-byte teacher asked for: the source
    pair read whole once, the fine-tuned source writing task text
    (_generated) and the pair then giving the teacher of every window
    (_byte_teacher), both freed afterwards: (the distillation's windows,
    {"teacher": ...})."""
    _log(q, "loading %s and %s for the written text and the first-byte "
         "teacher" % (a.source, tuned))
    src = _named("--source", a.source, load_model, a.source, dtype=dt)
    tun = _named("--lora" if a.lora else "--source-tuned", tuned,
                 load_model, tuned, dtype=dt)
    try:
        dcal = _generated(a, (tun, tun), cal, q)
        return dcal, {"teacher": _byte_teacher(
            a, src, tun, dcal, lambda *m: _log(q, *m))}
    finally:
        del src, tun
        _heap.trim()


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


def _device(a):
    try:
        dev = torch.device(a.device)
    except (RuntimeError, ValueError) as e:
        raise opts.UsageError("--device %s: %s" % (a.device, e))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise opts.UsageError("--device %s: CUDA is not available to this "
                              "PyTorch" % a.device)
    return dev


def _outputs(a):
    """The run's output folder, checked and locked before anything is
    read (bico.folder: the library's rules, as `bico transfer`'s): an
    output that is, holds or lies inside an input, whatever the spelling,
    is refused; so is an adapter folder that holds anything unless
    --replace (a model folder keeps the files the new one lacks, as the
    library's folder writer does); another run writing it is named.  The
    adapter is built whole in a hidden sibling folder and swapped in at
    the end; a model folder is written by the library's writer under the
    same lock."""
    from ..folder import Run
    ins = [(o, v) for o, v in (("--source", a.source),
                               ("--source-tuned", a.source_tuned),
                               ("--lora", a.lora), ("--target", a.target),
                               ("--text", a.text), ("--ids", a.ids),
                               ("--tokenizer", a.tokenizer)) if v]
    if a.output_lora:
        out = ("--output-lora", a.output_lora,
               "replace" if a.replace else "refuse")
    else:
        out = ("--output", a.output, "carry")
    try:
        return Run(inputs=ins, outputs=[out], wait=a.wait).__enter__()
    except BicoError as e:
        # the library's words, without its function's name; the option
        # that lifts the refusal of a folder that holds files
        msg = re.sub(r"^[a-z_]+: ", "", e.message)
        msg = msg.replace("or ask for it to be replaced", "or give --replace")
        if out[0] not in msg and not any(o in msg for o, _ in ins):
            msg = "%s: %s" % (out[0], msg)
        raise opts.UsageError(msg) if e.status == E_ARG else \
            BicoError(e.status, msg)


def _adapter_folder(a):
    """Where the adapter's files go: the run's new folder, swapped in for
    --output-lora when the command ends well."""
    return a.run.path(0)


def _prepare(a, dt, tmp, q, prog):
    """The inputs checked, read and loaded (every refusal here is a user
    mistake, exit 2, before anything is written): (src, srt, tgt,
    tdtypes, cal)."""
    opts.routes(a)
    dev = _device(a)
    opts.check_inputs(a, [("--source", a.source),
                          ("--source-tuned", a.source_tuned),
                          ("--lora", a.lora), ("--target", a.target)],
                      [("--text", a.text), ("--ids", a.ids)])
    if a.tokenizer is not None and not os.path.exists(a.tokenizer):
        raise opts.UsageError("--tokenizer %s: no such file or folder"
                              % a.tokenizer)
    a.run = _outputs(a)
    cal, ids = _calibration(a, q)
    src, srt, tgt, tdtypes = _load(a, dt, tmp, q)
    for m in (src, srt, tgt):
        m.to(dev)
    what = ("--text %s" % a.text) if a.text else ("--ids %s" % a.ids)
    opts.check_ids(ids, what, [(o, f, _vocab(m)) for o, f, m in (
        ("--source", a.source, src), ("--target", a.target, tgt))
        if o == "--target" or a.vocab.kind != "different"])
    if a.output_lora or a.trainable == "lora":
        opts.check_rank(a.rank, [w for m in tgt.modules()
                                 if isinstance(m, torch.nn.Linear)
                                 for w in (m.in_features, m.out_features)],
                        a.target)
    if a.output_lora:
        opts.check_modules_to_save(
            [s for s in a.modules_to_save.split(",") if s], tgt, a.target)
    return src, srt, tgt, tdtypes, cal


def _streamed(a):
    """Whether the run streams the models from their folders: --method
    fit or auto on the CPU, without --in-memory or --transformers, and
    not auto's warm start (the in-memory fit's pairs)."""
    warm = a.init == "warm" and a.output_lora is not None
    return a.method in ("fit", "auto") and not (
        a.in_memory or a.transformers or warm) and a.device == "cpu"


def _streamed_teacher(a):
    """Whether --method distill computes its teacher from the folders a
    block at a time (bico.llm.stream_teacher) and then loads the target
    alone: on the CPU, without --in-memory or --transformers, and not for
    a warm start (which runs the in-memory fit first)."""
    warm = a.init == "warm" and a.output_lora is not None
    return a.method == "distill" and not (a.in_memory or a.transformers or
                                          warm) and a.device == "cpu"


def _teacher_from_folders(a, dt, q, cal, tuned, spill, tmp):
    """The distillation's teacher of the calibration windows, each model
    run from its folder a block at a time (one model, one block in
    memory), with progress lines."""
    from .stream_teacher import build
    log = lambda *m: _log(q, *m)  # noqa: E731
    what = "teacher (the three models a block at a time)"
    log("%s: started on %d windows" % (what, cal.windows))
    clock = []

    def progress(i, n):
        if not clock:
            clock.append(_distill.Clock(what, n, log))
        clock[0](i)
    return build(a.source, tuned, a.target, cal.batches, dtype=dt,
                 k=a.teacher_k, budget=int(a.teacher_memory * (1 << 20)),
                 spill_dir=tmp, store_budget=int(a.memory_budget * 2 ** 20),
                 store_dir=spill, progress=progress, shared=a.vocab.shared)


def _prepare_streamed(a, tmp, q):
    """_prepare without loading the models: the inputs checked, the output
    locked, the windows read, the folders' configs read (the ids checked
    against their vocabularies); (calibration, the tuned source folder, the
    spill folder)."""
    from .runtime import spill_folder
    opts.routes(a)
    ins = [("--source", a.source), ("--source-tuned", a.source_tuned),
           ("--lora", a.lora), ("--target", a.target)]
    opts.check_inputs(a, ins, [("--text", a.text), ("--ids", a.ids)])
    if a.tokenizer is not None and not os.path.exists(a.tokenizer):
        raise opts.UsageError("--tokenizer %s: no such file or folder"
                              % a.tokenizer)
    spill = _named("--spill-dir", a.spill_dir, spill_folder,
                   a.output or a.output_lora, [f for _, f in ins],
                   a.spill_dir) if a.spill_dir else None
    # across ranks, rank 0 alone locks and writes the output
    a.run = _outputs(a) if a.ranks.root else None
    cal, ids = _calibration(a, q)
    tuned = a.source_tuned
    if a.lora:
        _log(q, "merging %s into %s" % (a.lora, a.source))
        tuned = _named("--lora", a.lora, _tuned_from_lora, a.source, a.lora,
                       tmp)
    cfg = {}
    for o, f in (("--source", a.source), ("--source-tuned", a.source_tuned),
                 ("--target", a.target)):
        if f is not None:
            _named(o, f, _weights_path, f)
            cfg[o] = _named(o, f, _checked_config, f)
    _warn_tokenizers(a)
    what = ("--text %s" % a.text) if a.text else ("--ids %s" % a.ids)
    opts.check_ids(ids, what, [(o, f, cfg[o].get("vocab_size")) for o, f in
                               (("--source", a.source),
                                ("--target", a.target))
                               if o == "--target" or
                               a.vocab.kind != "different"])
    if a.output_lora or a.trainable == "lora":
        t = cfg["--target"]
        opts.check_rank(a.rank, [t.get("hidden_size"),
                                 t.get("intermediate_size")], a.target)
    if a.output_lora:
        opts.check_modules_to_save(
            [s for s in a.modules_to_save.split(",") if s],
            _st_modules(a.target), a.target)
    if spill is None:
        spill = spill_folder(a.output or a.output_lora,
                             [f for _, f in ins], None)
    return cal, tuned, spill


def _checked_config(folder):
    """A folder's config.json, checked against its weights' headers as
    load_model checks it (a hostile or inconsistent config is the user's
    mistake, said before anything runs)."""
    from .runtime import Folder
    f = Folder(folder)
    try:
        return f.cfg["raw"]
    finally:
        f.close()


def _st_modules(folder):
    """The module names of a model folder's tensors (every dotted prefix
    of a tensor's name), for check_modules_to_save."""
    with _st.open(_weights_path(folder)) as f:
        names = list(f.keys())
    return sorted(set(n.rsplit(".", k)[0] for n in names
                      for k in range(1, n.count(".") + 1)))


def _run_streamed(a, dt, q, cal, tuned, spill, prog, tmp=None):
    """--method fit (and auto, with tmp: the distillation beside it) with
    the models run a block at a time from their folders
    (bico.llm.stream_route): the same choices, lines and outputs as the
    in-memory route (the recorded losses at the compute dtype), in memory
    that does not grow with the models' depth."""
    from .stream_route import StreamedFit, command_fit
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
        best, per = command_fit(sf, a.ridge, a.alpha, GRID, kind, a.rank,
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
                        a.alpha == "auto", len(GRID))
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
    else:
        dcal = _generated_from_folders(a, dt, q, cal, tuned)
        models = {} if a.vocab.kind == "different" else {
            "teacher": _teacher_from_folders(a, dt, q, dcal, tuned, spill,
                                             tmp)}
    _heap.trim()
    tgt, tdtypes = _load_target(a, dt, q)
    _heap.trim()
    return models, tgt, tdtypes, dcal


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
    if not q:
        est = opts.estimate(per, cal, len(a.ridge), a.output_lora,
                            a.alpha == "auto", len(GRID))
        _log(q, "estimate: about %s for %d fit windows and %d held out "
             "(%.3f s per window of the target's forward pass; --windows "
             "sets how many)" % (opts.duration(est), cal.windows,
                                 sum(len(x) for x, _ in cal.held_out), per))
    return zero


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
    streamed fit only.  The launcher's variables are checked before
    joining; once joined, every rank's options and inputs are compared
    with rank 0's (_same_run) before any work."""
    from .ranks import Ranks, world_size, join
    n = world_size()
    if n == 1:
        return Ranks()
    join()
    ranks = Ranks(world=True)
    ranks.same_run(_run_items(a))
    if not (_streamed(a) and a.method == "fit"):
        raise opts.UsageError(
            "under torchrun (WORLD_SIZE %d) only the streamed fit runs "
            "across processes: give --method fit (without --in-memory, "
            "--transformers or --device cuda), or run in one process"
            % n)
    return ranks


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
    from . import agree as R
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
    _write_chosen(a, tgt, chosen, means, fit, res, base, cal, tdtypes)


def _route_in_memory(a, dt, q, prog, tmp):
    """Every route with the three models loaded whole (--in-memory,
    --transformers, --device cuda, a warm start)."""
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
        from .stats import main as stats_main
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


def _scratch_of(a):
    """The run's scratch folder (the teacher's spill, the merged source of
    a LoRA): in --spill-dir when given (checked as the streamed fit's
    spill folder: it exists, lies in no input), else in $TMPDIR."""
    root = None
    if a.spill_dir is not None:
        from .runtime import spill_folder
        ins = [f for f in (a.source, a.source_tuned, a.lora, a.target) if f]
        root = _named("--spill-dir", a.spill_dir, spill_folder,
                      a.output or a.output_lora, ins, a.spill_dir)
    try:
        return _scratch(root)
    except OSError as e:
        raise BicoError(E_IO, "%s: cannot make the run's scratch folder "
                        "there (%s)%s" % (root or tempfile.gettempdir(),
                                          e.strerror or e,
                                          "" if root else "; give "
                                          "--spill-dir"))


_LIVE = ".live"      # the lock file a run's scratch folder holds


def _scratch(root=None):
    """The run's temporary folder (<root>/bico-llm-<pid>-*, root: --spill-dir
    or $TMPDIR: the merged source of a LoRA, the teacher's spill), after
    removing those of runs that were killed (a SIGKILL leaves no time to
    clean up).  A run holds an exclusive flock(2) on its folder's .live
    file for as long as it runs; a leftover is a folder whose lock nobody
    holds.  A process id is never trusted: a run in another PID namespace
    (a container sharing the folder) has a pid this process cannot see,
    or one that names another process here.  A folder without the lock
    file (a run still starting) is left alone."""
    import fcntl
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for n in names:
        if not re.match(r"bico-llm-\d+-", n):
            continue
        d = os.path.join(root, n)
        try:
            fd = os.open(os.path.join(d, _LIVE), os.O_RDONLY | os.O_CLOEXEC |
                         os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue                   # starting, not ours, or not a run's
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue               # another user's
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue                   # its run goes on
        finally:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
    d = tempfile.mkdtemp(prefix="bico-llm-%d-" % os.getpid(), dir=root)
    # locked under another name, then named .live: a scan never finds the
    # lock file of a live run unlocked
    fd = os.open(os.path.join(d, _LIVE + ".new"), os.O_RDWR | os.O_CREAT |
                 os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(os.path.join(d, _LIVE + ".new"), os.path.join(d, _LIVE))
    _SCRATCH_LOCKS.append(fd)          # held until the process ends
    return d


_SCRATCH_LOCKS = []


def _on_signals():
    """SIGINT, SIGTERM and SIGHUP end the command as an exception would:
    the output left as it was, the temporary folders (teacher spill,
    merged source) removed, exit status 128 + the signal, no traceback.
    The signal is remembered (bico.llm.distill.STOP) and raised again at
    the next step and before the output is swapped in, since Python drops
    an exception raised inside a finalizer or a library's callback (a
    KeyboardInterrupt there let a run finish and replace its output)."""
    import signal

    def stop(sig, frame):
        _distill.STOP.append(sig)   # raised again at the next step
        raise SystemExit(128 + sig)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, stop)
        except (ValueError, OSError):   # not the main thread
            pass
