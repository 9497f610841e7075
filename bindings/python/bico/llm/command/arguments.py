"""bico.llm.command.arguments: the command's options (the parser) and
the defaults they hold, and its one-line log.
"""
import sys

from .. import distill as _distill
from ..distill import LINEAR_MODULES
from .. import across as _across
from .. import options as opts
from ...torch.choose import ALPHA_GRID, HELDOUT, HOLDOUT


# --generate auto: the teacher writes windows until the distillation has
# this many (docs/llm.md, "A few windows")
GENERATE_TOTAL = 512
# --patience: held-out checks without a better loss before distillation
# stops (docs/llm.md, "A few windows")
PATIENCE = 4
# --ema: the decay of the factors' moving average that the held-out
# checks score and keep (docs/llm.md, "A few windows")
EMA = 0.99
# the distillation's steps when the teacher wrote most of its windows
# (--steps not given): the held-out loss is best after 100-350 steps
# whatever the schedule's length, and a 400-step cosine reaches the
# 1200-step one's quality while patience stops it at a steadier share of
# its steps (a time the estimate can foresee; docs/llm.md, "A few
# windows").  Where the user's windows are the most (512 of them: 448
# fit, 64 written), 400 steps lost 12 points of the gap against the
# default's 1200 (87 % against 99 %): the default runs there.  With the
# moving average (--ema) 800 steps closed 4 points more of the gap from
# 32 and 64 windows (2026-12-08), but from 32 windows on the wide cell
# took longer than the default from 512 (127 s against 120 s): kept at
# 400, --steps 800 the choice of a user with the time.
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
    from ..._version import version
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
    p.add_argument("--holdout", type=opts.share, default=HOLDOUT,
                   help="share of windows held out for every choice: "
                   "alpha, ridge, route, step (%g)" % HOLDOUT)
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
    p.add_argument("--alpha", type=opts.alpha, default=HELDOUT,
                   help="scale of the carried update: heldout (the "
                   "held-out choice among %s) or a number" % ", ".join(
                       "%g" % a for a in ALPHA_GRID))
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
    d.add_argument("--ema", type=opts.decay, default=EMA, metavar="DECAY",
                   help="the held-out checks score and keep the factors' "
                   "moving average (each step: DECAY x average + (1 - "
                   "DECAY) x factors), not the last step's factors (%g; "
                   "0: the factors themselves)" % EMA)
    d.add_argument("--checkpoint", choices=("auto", "on", "off"),
                   default="auto",
                   help="recompute the target's layers in the backward pass "
                   "(one layer's activations held, about 40 %% more time a "
                   "step): on, off, or auto (when a step's activations would "
                   "pass a quarter of the memory available)")
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
                   "token's bytes (the axis both vocabularies share: its "
                   "first byte, and the next ones to --across-depth) "
                   "beside the text the fine-tuned source writes (byte, "
                   "default), or that text alone (text)")
    d.add_argument("--across-depth", type=opts.across_depth,
                   default=_across.DEPTH,
                   metavar="N",
                   help="tokenizers that differ, --across byte: the "
                   "teacher's levels along the text (1: the next token's "
                   "first byte; N: its next N - 1 bytes too, where the "
                   "source reads them; default %d)" % _across.DEPTH)
    d.add_argument("--device", default="cpu",
                   help="torch device the models run on: cpu (default) or "
                   "cuda[:N] when present; --method distill streams its "
                   "teacher there a block at a time and trains the target "
                   "there alone; fit and auto load the three models whole "
                   "there (as --in-memory)")
