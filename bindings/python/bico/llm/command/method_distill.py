"""bico.llm.command.method_distill: --method distill: the teacher (the
source pair, or the first byte across tokenizers), the text it writes,
the estimate of the time, the student trained.
"""
import math
import time

import numpy as np
import torch

from ... import _heap
from ... import safetensors as _st
from ...torch.distill import Training
from .. import distill as _distill
from ..families import load_model, _weights_path
from .. import options as opts
from ..options import named as _named
from .arguments import GENERATE_TOTAL, TEXT_ONLY_LR, WRITTEN_STEPS, _log
from .inputs import _device


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
    student = _distill.Student(
        mode=mode, rank=a.rank, lora_alpha=a.lora_alpha,
        modules=tuple(m for m in a.target_modules.split(",") if m),
        save=tuple(saves) if mode == "lora" else (), init=init,
        checkpoint={"on": True, "off": False}.get(a.checkpoint, "auto"))
    training = Training(
        steps=_steps(a), seed=a.seed, patience=a.patience or None,
        ema=a.ema or None,
        lr=a.lr if a.lr is not None or a.vocab.kind != "different" or
        mode != "lora" or _byte_teacher_wanted(a) else TEXT_ONLY_LR,
        **_losses(a))
    store = _distill.TeacherStore(
        k=a.teacher_k, budget=int(a.teacher_memory * (1 << 20)),
        spill_dir=tmp, shared=a.vocab.shared)
    if a.method == "distill" and getattr(a, "estimate", None) is None:
        _training_estimate(a, tgt, cal, log, models, student)
    return _distill.run(
        None, None, tgt, cal, log, student=student, training=training,
        store=store, pair=models if "source" in models else None,
        teacher=models.pop("teacher", None),
        own=None if a.vocab.kind == "different"
        else getattr(a, "own_batches", None), ranks=a.ranks)


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
    from .. import across
    from ..text import load_tokenizer
    clock = _distill.Clock("teacher (the source pair on the first byte)",
                           len(cal.batches), log)
    tok_a = load_tokenizer(a.source)
    tok_b = load_tokenizer(a.tokenizer or a.target)
    return across.build(source, tuned, tok_a, tok_b, cal.batches, a.window,
                        progress=lambda i, n: clock(i),
                        depth=a.across_depth)


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
    from ..generate import write
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
    from ..generate import perturb
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


def _training_estimate(a, tgt, cal, log, models, student):
    """--method distill with no written windows (whose estimate,
    _distill_estimate, covers the whole run): the time left, printed
    before the distillation starts: the teacher when it is still to be
    computed (the source pair loaded) and the training, extrapolated
    from a timed forward of each model over a fit batch
    (opts.distill_estimate; a checkpointed step recomputes one forward
    more); recorded as the run's whole time (bico_estimate_seconds)."""
    dev = next(tgt.parameters()).device
    x = cal.batches[0][0].to(dev)
    pair = [models[k] for k in ("source", "tuned") if k in models]
    f = _forward_seconds(pair + [tgt], x)
    held = sum(y.numel() for _, y in cal.held_out)
    per_batch = cal.windows / max(1, len(cal.batches)) / a.ranks.size
    steps, _ = _distill._defaults(_mode(a), _steps(a), a.lr,
                                  len(cal.batches))
    window = x.shape[1]
    ck = _distill._checkpointed(tgt, [x], student.checkpoint)
    t, tr = opts.distill_estimate(sum(f), f[-1], cal.windows, window, steps,
                                  per_batch, held, extra_passes=int(ck))
    t = t / a.ranks.size if pair else 0.0
    so_far = time.time() - getattr(a, "t0", time.time())
    a.estimate = so_far + t + tr
    log("estimate: about %s for the distillation: %sat most %s training "
        "(%d steps, %.3g ms per token of the target's forward%s; --patience "
        "may stop it sooner); the run: about %s in all, %s so far" % (
            opts.duration(t + tr), ("%s the teacher, " % opts.duration(t))
            if pair else "", opts.duration(tr), steps, 1e3 * f[-1],
            ", layers checkpointed" if ck else "",
            opts.duration(a.estimate), opts.duration(so_far)))


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
    from ..generate import writing_seconds
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
    from ..text import detokenize, load_tokenizer
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
    """_generated with the three models read whole for the writing (on
    --device) and freed afterwards (the teacher is then computed from the
    folders a block at a time, as without generation)."""
    if not _generate_count(a, cal):
        return cal
    which = (("--source", a.source), ("--lora" if a.lora else
                                      "--source-tuned", tuned),
             ("--target", a.target))
    if a.vocab.kind == "different" or a.generate_by == "tuned":
        which = which[1:2] * 2          # the fine-tuned source alone
    _log(q, "loading %s to write task text" % ", ".join(
        sorted(set(f for _, f in which), key=[f for _, f in which].index)))
    loaded, dev = {}, _device(a)
    ms = tuple(loaded.setdefault(f, _named(o, f, load_model, f, dtype=dt)
                                 .to(dev))
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
    dev = _device(a)
    src = _named("--source", a.source, load_model, a.source,
                 dtype=dt).to(dev)
    tun = _named("--lora" if a.lora else "--source-tuned", tuned,
                 load_model, tuned, dtype=dt).to(dev)
    try:
        dcal = _generated(a, (tun, tun), cal, q)
        return dcal, {"teacher": _byte_teacher(
            a, src, tun, dcal, lambda *m: _log(q, *m))}
    finally:
        del src, tun
        _heap.trim()


def _teacher_from_folders(a, dt, q, cal, tuned, spill, tmp):
    """The distillation's teacher of the calibration windows, each model
    run from its folder a block at a time (one model, one block in
    memory), with progress lines."""
    from ..stream.teacher import build
    log = lambda *m: _log(q, *m)  # noqa: E731
    what = "teacher (the three models a block at a time)"
    log("%s: started on %d windows" % (what, cal.windows))
    clock = []

    def progress(i, n):
        if not clock:
            clock.append(_distill.Clock(what, n, log))
        clock[0](i)
    dev = _device(a)
    states = int(a.memory_budget * 2 ** 20)
    if dev.type != "cpu":
        # the boundary states stay in the device's memory up to half of
        # what it has free (the blocks run beside them), not in the
        # host's budget
        states = max(states, (_distill._available(dev) or 0) // 2)
        log("teacher: on %s, the boundary states kept there up to %.0f MiB "
            "(beyond it in the spill file)" % (dev, states / 2 ** 20))
    return build(a.source, tuned, a.target, cal.batches, dtype=dt,
                 k=a.teacher_k, budget=int(a.teacher_memory * (1 << 20)),
                 spill_dir=tmp, store_budget=states, store_dir=spill,
                 progress=progress, shared=a.vocab.shared, device=dev)
