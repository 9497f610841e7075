"""bico.llm.command.inputs: what the command reads before a route runs:
the models (whole, or a block at a time from the folders), the
tokenizers' relation, the calibration windows, the outputs checked.
"""
import os
import re
import shutil
import sys

import numpy as np
import torch

from ... import _blis
from ..._status import BicoError, E_ARG
from ... import safetensors as _st
from ..families import load_model, _weights_path
from .. import options as opts
from ..options import (named as _named, vocab_size as _vocab,
                       transformers_loader as _transformers_loader)
from ..text import text_batches, tokenize
from .arguments import _log


def _tuned_from_lora(source, adapter, tmp):
    """The source folder with the adapter merged (libbico's own merge)."""
    from ...lora import transfer
    out = os.path.join(tmp, "source_tuned") + "/"
    transfer(source, source, adapter, merged_output=out, method="naive")
    for n in os.listdir(source):
        if n.endswith(".json") and "safetensors" not in n and \
                not os.path.exists(os.path.join(out, n)):
            shutil.copy(os.path.join(source, n), os.path.join(out, n))
    return out


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
    """(the target read and moved to --device, {target tensor: its files'
    dtype} or None): the streamed teacher's route, which never holds the
    source pair."""
    dev = _device(a)
    _log(q, "loading %s%s" % (a.target, "" if dev.type == "cpu" else
                              " onto %s" % dev))
    tgt = _named("--target", a.target, load_model, a.target, dtype=dt)
    return tgt.to(dev), _target_dtypes(a, dt)


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
    from ..vocab import relation
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
    from ..vocab import relation
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
                                 "bytes (the axis both vocabularies "
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
    from ...folder import Run
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
    block at a time (bico.llm.stream.teacher) and then loads the target
    alone: on any --device (the blocks, then the target, moved there),
    without --in-memory or --transformers, and not for a warm start
    (which runs the in-memory fit first)."""
    warm = a.init == "warm" and a.output_lora is not None
    return a.method == "distill" and not (a.in_memory or a.transformers or
                                          warm)


def _prepare_streamed(a, tmp, q):
    """_prepare without loading the models: the inputs checked, the output
    locked, the windows read, the folders' configs read (the ids checked
    against their vocabularies); (calibration, the tuned source folder, the
    spill folder)."""
    from ..runtime import spill_folder
    opts.routes(a)
    _device(a)
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
    from ..runtime import Folder
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
