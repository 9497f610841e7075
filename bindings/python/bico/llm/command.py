"""bico.llm.command: python3 -m bico.llm, which carries a decoder
fine-tune from model folders and task text to a target adapter or a
target folder, with the fit.

    python3 -m bico.llm --source A/ --source-tuned A_ft/ --target B/ \\
        --text task.txt --output-lora B_adapter/ --rank 16
    python3 -m bico.llm --source A/ --lora A_adapter/ --target B/ \\
        --ids ids.npy --output B_ft/

The models are read with bico.torch.load_model (Llama, Mistral, Qwen2,
Gemma folders; one file or shards).  --text is tokenized with the
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
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from .._status import BicoError
from .. import safetensors as _st
from ..torch.choose import pick
from ..torch.tied import _tied_groups
from ..torch.transfer import transfer_model
from .adapters import save_adapter, update_grams
from .families import load_model
from .text import text_batches, next_token_loss, lm_loss

GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)


def _log(quiet, *a):
    if not quiet:
        print(*a, file=sys.stderr, flush=True)


class _FitProgress(object):
    """Counts the fit's per-layer updates (the update callback of
    bico.fit.run, the driver transfer_model's fit runs on) and prints a
    line per layer while transfer_model runs."""

    def __init__(self, total, quiet):
        self.total, self.quiet, self.n = total, quiet, 0

    def line(self, dw, rank):
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
                prog.n += 1
                _log(prog.quiet, "fit: layer %d/%d (d_in %d, d_out %d%s)"
                     % (prog.n, prog.total, dw.shape[1], dw.shape[0],
                        "" if rank is None else ", rank %d" % rank))
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


def _transformers_loader():
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise BicoError(2, "--transformers: the transformers package is not "
                        "installed (pip install transformers), or leave the "
                        "option out to read the folders with "
                        "bico.torch.load_model")

    def load(folder, dtype=None):
        return AutoModelForCausalLM.from_pretrained(
            folder, torch_dtype=dtype or "auto").eval()
    return load


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
    p = argparse.ArgumentParser(
        prog=prog,
        description="Carry a decoder fine-tune to another decoder with the "
        "fit, from model folders and task text, to a PEFT adapter "
        "(--output-lora) or a model folder (--output).")
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
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (16)")
    p.add_argument("--lora-alpha", type=float, default=None,
                   help="PEFT lora_alpha (default: the rank)")
    p.add_argument("--modules-to-save", default="",
                   help="comma list of modules stored whole in the adapter "
                   "(e.g. norm,input_layernorm,post_attention_layernorm,"
                   "embed_tokens); other non-linear updates are left out "
                   "and reported")
    p.add_argument("--base-model-name-or-path", default=None)
    p.add_argument("--window", type=int, default=128,
                   help="tokens per calibration window (128)")
    p.add_argument("--windows", type=int, default=None,
                   help="at most this many windows")
    p.add_argument("--holdout", type=float, default=0.125,
                   help="share of windows held out for alpha/ridge (0.125)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ridge", default="0.01",
                   help="ridge c of the fit, or a comma list to choose "
                   "from on the held-out windows (0.01)")
    p.add_argument("--alpha", default="auto",
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
                   "bico.torch.load_model: for families load_model does "
                   "not know")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for PyTorch and for libbico's statistics, "
                   "maps and fit (default: PyTorch's count)")
    p.add_argument("--in-memory", action="store_true",
                   help="hold the models whole in memory (the route before "
                   "streaming; --transformers implies it); default: run "
                   "the models a block at a time from their folders")
    p.add_argument("--memory-budget", type=float, default=64,
                   help="MB of calibration states and fitted blocks kept in "
                   "memory by the streamed run; beyond it they go to a "
                   "temporary file (64)")
    p.add_argument("--spill-dir", default=None,
                   help="folder for that temporary file (default: the "
                   "output's folder, else $TMPDIR; never an input folder)")
    p.add_argument("--quiet", action="store_true")
    return p


def _load(a, dt, tmp, q):
    """(source, tuned source, target, {target tensor: its files' dtype} or
    None): the three models read (a LoRA merged into the source first)."""
    tuned = a.source_tuned
    if a.lora:
        _log(q, "merging %s into %s" % (a.lora, a.source))
        tuned = _tuned_from_lora(a.source, a.lora, tmp)
    _log(q, "loading %s, %s, %s" % (a.source, a.source_tuned or a.lora,
                                     a.target))
    _warn_tokenizers(a)
    load = _transformers_loader() if a.transformers else load_model
    src, srt, tgt = (load(f, dtype=dt)
                     for f in (a.source, tuned, a.target))
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
    return src, srt, tgt, tdtypes


def _warn_tokenizers(a):
    toks = [os.path.join(f, "tokenizer.json") for f in (a.source,
                                                         a.target)]
    if all(os.path.exists(t) for t in toks):
        with open(toks[0], "rb") as f1, open(toks[1], "rb") as f2:
            if f1.read() != f2.read():
                print("python3 -m bico.llm: warning: %s and %s differ; "
                      "the fit assumes one tokenizer (token ids mean "
                      "the same in both models)" % tuple(toks),
                      file=sys.stderr)


def _calibration(a, q):
    """The windows of --text / --ids (text_batches), some held out."""
    if a.text:
        with open(a.text, encoding="utf-8") as f:
            data = f.read()
        tok = a.tokenizer or a.target
    else:
        data, tok = np.load(a.ids), None
    what = ("--text %s" % a.text) if a.text else ("--ids %s" % a.ids)
    try:
        cal = text_batches(data, a.window, n=a.windows,
                           holdout=a.holdout, tokenizer=tok,
                           batch_size=a.batch_size)
    except BicoError as e:
        raise BicoError(e.status, "%s: %s" % (what, e.message))
    if not cal.held_out:
        raise BicoError(2, "%s makes %d window(s) of %d tokens: too "
                        "few to hold any out; give more text or a "
                        "smaller --window" % (what, cal.windows,
                                              a.window))
    _log(q, "calibration: %d windows of %d tokens (%d batches), %d "
         "held out" % (cal.windows, a.window, len(cal.batches),
                       sum(len(x) for x, _ in cal.held_out)))
    return cal


def _fit_and_choose(a, src, srt, tgt, cal, ridges, alpha_arg, tmp, q):
    """(the target's state dict, the chosen (held-out loss, ridge, alpha,
    update, adapter report, {alpha: loss}, covariances)): one fit per
    ridge, each scaled by its alpha (chosen on the held-out windows, or
    --alpha), the ridge chosen on them too (pick)."""
    base = {k: v.detach().clone() for k, v in tgt.state_dict().items()}
    n_lin = sum(1 for m in tgt.modules() if isinstance(m, torch.nn.Linear)
                and m is not tgt.lm_head)
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
                               return_effective=True)
            eff = rep.pop("effective")
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


def _meta(a, al, ridge, loss, zero, cal):
    """What was chosen, printed and recorded in the output's metadata."""
    meta = {"bico_transfer_method": "fit", "bico_alpha": "%g" % al,
            "bico_ridge": "%g" % ridge,
            "bico_heldout_loss": "%.6g" % loss,
            "bico_heldout_loss_target": "%.6g" % zero,
            "bico_windows": str(cal.windows),
            "bico_window": str(a.window),
            "bico_source": a.source,
            "bico_source_tuned": a.source_tuned or "",
            "bico_lora": a.lora or ""}
    print("chosen: alpha %g, ridge %g (held-out loss %.4f; target "
          "unchanged %.4f)" % (al, ridge, loss, zero), flush=True)
    if al == 0:
        print("note: no scale helped on the held-out windows: the "
              "output is the target unchanged", flush=True)
    return meta


def _write(a, tgt, base, best, cal, tdtypes):
    """The chosen update written: an adapter (--output-lora) or a model
    folder (--output), what was chosen printed and recorded."""
    loss, ridge, al, delta, rep, scores, cov = best
    zero = lm_loss(tgt, cal.held_out)
    meta = _meta(a, al, ridge, loss, zero, cal)
    scaled = {k: v * al for k, v in delta.items()}
    if a.output_lora:
        saves = [s for s in a.modules_to_save.split(",") if s]
        rep = save_adapter(
            a.output_lora, tgt, scaled, a.rank, lora_alpha=a.lora_alpha,
            is_delta=True, covariance=cov, modules_to_save=saves,
            base_model_name_or_path=a.base_model_name_or_path or
            os.path.abspath(a.target), metadata=meta,
            target_dtypes=tdtypes)
        print("wrote %s: %d LoRA pairs (rank %d), %d saved tensors; "
              "left out: %s (%.1f %% of the update's norm)" % (
                  a.output_lora, len(rep["modules"]), a.rank,
                  len(rep["saved"]),
                  ", ".join(rep["left_out"]) or "nothing",
                  100 * rep["left_out_norm"]), flush=True)
    else:
        out = {}
        tied = set(al_ for _, als in _tied_groups(tgt) for al_ in als)
        for k, v in base.items():
            if k in tied:
                continue
            w = v.double() + scaled[k] if k in scaled else v.double()
            out[k] = w.to((tdtypes or {}).get(k, v.dtype))
        dest = a.output if a.output.endswith("/") else a.output + "/"
        _st.write(dest, out, metadata=dict(meta, format="pt"),
                  like=a.target)
        print("wrote %s" % a.output, flush=True)


def _run_streamed(a, dt, tmp, q, ridges, alpha_arg):
    """The fit with the models run a block at a time from their folders
    (bico.llm.stream_route): the statistics, one fit per ridge, the
    held-out choice and the output, in memory that does not grow with
    the models' depth; the same choices, lines and outputs as the
    in-memory route."""
    from .runtime import spill_folder
    from .stream_route import StreamedFit, lm_loss_of
    tuned = a.source_tuned
    if a.lora:
        _log(q, "merging %s into %s" % (a.lora, a.source))
        tuned = _tuned_from_lora(a.source, a.lora, tmp)
    from .families import model_config, _weights_path
    for f in (a.source, tuned, a.target):  # as loading them would
        model_config(f)
        _weights_path(f)
    _warn_tokenizers(a)
    cal = _calibration(a, q)
    spill = spill_folder(a.output or a.output_lora,
                         [a.source, a.source_tuned, a.target, a.lora],
                         a.spill_dir)
    kind = "adapter" if a.output_lora else "model"
    saves = [x for x in a.modules_to_save.split(",") if x]
    grid = GRID if alpha_arg == "auto" else [alpha_arg]
    with StreamedFit(a.source, tuned, a.target, cal.batches, cal.held_out,
                     dtype=dt, threads=a.threads,
                     budget=int(a.memory_budget * 2 ** 20), spill_dir=spill,
                     log=lambda line: _log(q, line)) as sf:
        n_lin = 7 * sf.run.B.L
        best, losses = None, {}
        for j, ridge in enumerate(ridges):
            _log(q, "fit: ridge %g, %d layers" % (ridge, n_lin))
            prog = _FitProgress(n_lin, q)
            res = sf.fit(ridge, kind=kind, rank=a.rank, saves=saves,
                         progress=lambda n, dw, rk: prog.line(dw, rk))
            scores = {al: lm_loss_of(v) for al, v in
                      sf.score(res, grid).items()}
            for al in (grid if alpha_arg == "auto" else ()):
                _log(q, "alpha %-5g held-out loss %.4f" % (al, scores[al]))
            al = pick(scores) if alpha_arg == "auto" else alpha_arg
            losses[j] = scores[al]
            if pick(losses) == j:   # the least held-out loss so far
                if best is not None:
                    best[3].drop()
                best = (scores[al], ridge, al, res, scores)
            else:
                res.drop()
        loss, ridge, al, res, scores = best
        zero = scores[0.0] if 0.0 in scores else \
            lm_loss_of(sf.score(res, [0.0])[0.0])
        meta = _meta(a, al, ridge, loss, zero, cal)
        if a.output_lora:
            rep = sf.write_adapter(
                res, a.output_lora, al, lora_alpha=a.lora_alpha,
                metadata=meta, base_model=a.base_model_name_or_path or
                os.path.abspath(a.target))
            print("wrote %s: %d LoRA pairs (rank %d), %d saved tensors; "
                  "left out: %s (%.1f %% of the update's norm)" % (
                      a.output_lora, len(rep["modules"]), a.rank,
                      len(rep["saved"]), ", ".join(rep["left_out"])
                      or "nothing", 100 * rep["left_out_norm"]), flush=True)
        else:
            dest = a.output if a.output.endswith("/") else a.output + "/"
            sf.write_model(res, dest, al, dict(meta, format="pt"))
            print("wrote %s" % a.output, flush=True)


def _tmp_folder():
    """The command's temporary folder (a merged LoRA source): named with
    the process id; those of processes that no longer run (a SIGKILL)
    are removed first."""
    from .runtime import _alive
    base = tempfile.gettempdir()
    try:
        for n in os.listdir(base):
            pid = n[len("bico-llm-"):].split("-", 1)[0]
            if n.startswith("bico-llm-") and pid.isdigit() and \
                    not _alive(int(pid)):
                shutil.rmtree(os.path.join(base, n), ignore_errors=True)
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="bico-llm-%d-" % os.getpid())


def main(argv=None, prog="python3 -m bico.llm"):
    p = _parser(prog)
    a = p.parse_args(argv)
    q = a.quiet
    t0 = time.time()
    dt = None if a.dtype == "auto" else getattr(torch, a.dtype)
    try:
        ridges = [float(x) for x in a.ridge.split(",") if x.strip()]
        alpha_arg = a.alpha
        if alpha_arg != "auto":
            alpha_arg = float(alpha_arg)
    except ValueError as e:
        p.error("--ridge / --alpha: %s" % e)
    if a.threads is not None:
        if a.threads < 1:
            p.error("--threads must be at least 1")
        torch.set_num_threads(a.threads)
    from .runtime import signals, Killed
    tmp = _tmp_folder()
    try:
        with signals():
            if a.in_memory or a.transformers:
                src, srt, tgt, tdtypes = _load(a, dt, tmp, q)
                cal = _calibration(a, q)
                base, best = _fit_and_choose(a, src, srt, tgt, cal, ridges,
                                             alpha_arg, tmp, q)
                _write(a, tgt, base, best, cal, tdtypes)
            else:
                _run_streamed(a, dt, tmp, q, ridges, alpha_arg)
        _log(q, "done in %.1f s" % (time.time() - t0))
        return 0
    except Killed as e:  # SIGTERM / SIGHUP: clean up, then die of it
        shutil.rmtree(tmp, ignore_errors=True)
        signals.reraise(e)
        raise
    except BicoError as e:
        print("python3 -m bico.llm: %s" % e, file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # unreadable --text / --ids
        print("python3 -m bico.llm: %s" % e, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
