"""bico.llm.generate: task text written by the proxy-tuned teacher.

A user holds a fine-tune and a few windows of its task, not a corpus.  The
teacher the distillation learns from, softmax(z_B + z_A_ft - z_A), can
write more of that text: prompts are cut from the user's fit windows (a
span at a seeded position of each), and each is continued by sampling the
teacher's next token, with a temperature and nucleus (top-p) sampling,
until the window is full.  The three models run one new token at a time
with a key-value cache each (DecoderLM.step: the earlier tokens are never
run again; a transformers model's past_key_values likewise), a batch of
prompts at once, so that writing a window costs about one forward pass of
the three models over it: what computing the teacher on it costs anyway.

The windows come back as the distillation's own batches ((ids, next ids),
the calibration's shape), to be trained on beside the user's windows; the
held-out windows stay the user's alone (nothing is chosen on generated
text).  With a filter, each written window is scored by the fine-tuned
source's mean next-token log-likelihood and the least likely share is
dropped (as Trans-LoRA filters its synthetic data).
"""
import math
import time

import torch

from .._status import BicoError, E_ARG, E_SHAPE
from ..torch.teacher import check_finite_logits

__all__ = ["write", "perturb", "prompts", "sample_next", "Writer",
           "writing_seconds"]


def prompts(batches, n, length, seed=0):
    """n prompts of `length` tokens cut from the windows of batches
    ((ids [b, T], next ids) pairs: the user's fit windows, never the
    held-out ones): the windows taken in turn, each at a seeded start (a
    window read whole is window + 1 tokens: ids and its last next id)."""
    wins = [torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]
    wins = torch.cat(wins) if wins else torch.empty(0, 0, dtype=torch.long)
    if wins.shape[0] == 0:
        raise BicoError(E_ARG, "generate: no fit windows to cut prompts from")
    T = wins.shape[1]
    if not 1 <= length <= T:
        raise BicoError(E_ARG, "generate: a prompt of %d tokens does not fit "
                        "a window of %d" % (length, T))
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(wins.shape[0], generator=g)
    starts = torch.randint(0, T - length + 1, (n,), generator=g)
    rows = [wins[order[i % len(order)], int(starts[i]):int(starts[i]) +
                 length] for i in range(n)]
    return torch.stack(rows)


def sample_next(logits, temperature=1.0, top_p=1.0, generator=None):
    """Token ids [B] drawn from softmax(logits / temperature) restricted to
    its nucleus: the fewest most likely tokens whose probability adds up
    to top_p (the most likely one always kept).  temperature 0: the most
    likely token."""
    z = logits.float()
    if temperature == 0:
        return z.argmax(-1)
    p = torch.softmax(z / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = p.sort(dim=-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < top_p   # the mass before each < p
        sp = sp * keep
        p = torch.zeros_like(p).scatter_(-1, si, sp)
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


class _Stepper(object):
    """One model's next-token logits a token at a time: DecoderLM.step
    with its cache; a transformers model through past_key_values; any
    other model on the whole sequence each step."""

    def __init__(self, model):
        self.m = model
        self.cache = model.new_cache() if hasattr(model, "new_cache") \
            else None
        self.past = None
        self.hf = self.cache is None and _takes_past(model)
        self.seq = None

    def __call__(self, new):
        """Logits [B, V] after the tokens `new` [B, t] (the prompt first,
        then one token at a time)."""
        if self.cache is not None:
            return self.m.step(new, self.cache)
        if self.hf:
            out = self.m(new, past_key_values=self.past, use_cache=True)
            self.past = out.past_key_values
            return out.logits[:, -1]
        self.seq = new if self.seq is None else torch.cat([self.seq, new], 1)
        out = self.m(self.seq)
        return getattr(out, "logits", out)[:, -1]


def _takes_past(model):
    import inspect
    try:
        return "past_key_values" in inspect.signature(
            model.forward).parameters
    except (TypeError, ValueError):
        return False


class Writer(object):
    """Windows written by the teacher softmax(z_B + z_A_ft - z_A):
    models = (source, fine-tuned source, target) on one vocabulary (shared:
    the source's, when the target's grew past it: the target's first
    `shared` columns); or models = (fine-tuned source,) alone, the source
    side writing in its own tokens when the tokenizers differ."""

    def __init__(self, models, temperature=1.0, top_p=0.95, seed=0,
                 shared=None):
        if not (isinstance(temperature, (int, float)) and
                0 <= temperature <= 100):
            raise BicoError(E_ARG, "generate: temperature must be a number "
                            "from 0 to 100, got %r" % (temperature,))
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise BicoError(E_ARG, "generate: top_p must be above 0 and at "
                            "most 1, got %r" % (top_p,))
        self.models, self.shared = models, shared
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.g = torch.Generator().manual_seed(seed)

    def batch(self, prompt, total):
        """The prompts [B, P] continued to `total` tokens each."""
        steppers = [_Stepper(m) for m in self.models]
        out = [prompt]
        new = prompt
        with torch.no_grad():
            for _ in range(total - prompt.shape[1]):
                if len(steppers) == 1:          # the source side alone
                    zt = steppers[0](new).float()
                    check_finite_logits((zt,), ("fine-tuned source",))
                    new = sample_next(zt, self.temperature, self.top_p,
                                      self.g)[:, None].to(prompt.device)
                    out.append(new)
                    continue
                za, zt, zb = (s(new).float() for s in steppers)
                if self.shared is not None:
                    zb = zb[..., :self.shared]
                if not (za.shape == zt.shape == zb.shape):
                    raise BicoError(E_SHAPE, "generate: the teacher needs "
                                    "the three models on one vocabulary, got "
                                    "%d, %d and %d outputs" % (
                                        za.shape[-1], zt.shape[-1],
                                        zb.shape[-1]))
                check_finite_logits((za, zt, zb))
                nxt = sample_next(zb + zt - za, self.temperature,
                                  self.top_p, self.g)
                new = nxt[:, None].to(prompt.device)
                out.append(new)
        return torch.cat(out, dim=1)


# windows written at once (the three models' forward passes over a batch
# of new tokens: larger batches use the matrix products better)
WRITE_BATCH = 64


def writing_seconds(models, batches, n, window, prompt_tokens=None,
                    device=None, shared=None, write_batch=WRITE_BATCH):
    """Seconds write() will take for n windows, timed: the writers
    continue write_batch prompts by 2 and by 8 tokens, and the
    difference is six steps (the prompts' own pass cancels), each step
    then counted for every token of every batch (a model's per-step
    overhead included: what a forward over whole windows does not show
    on small models).  The prompts are as long as the written windows'
    middle (a step's attention grows with what precedes it).  Nothing of
    the run's sampling is touched (a Writer of its own)."""
    if n <= 0:
        return 0.0
    P = prompt_tokens or max(1, window // 4)
    mid = max(1, min(window - 7, (P + window) // 2))
    pr = prompts(batches, min(n, write_batch), mid, seed=0)
    if device is not None:
        pr = pr.to(device)
    w = Writer(models, seed=0, shared=shared)
    times = []
    for k in (2, 8):
        t = time.time()
        w.batch(pr, mid + k)
        times.append(time.time() - t)
    step = max(0.0, times[1] - times[0]) / 6
    return math.ceil(n / write_batch) * (window + 1 - P) * step


def write(models, batches, n, window, prompt_tokens=None, temperature=1.0,
          top_p=0.95, batch_size=16, seed=0, keep=1.0, log=None,
          device=None, shared=None, write_batch=WRITE_BATCH):
    """n windows of window + 1 tokens written by the teacher (Writer),
    from prompts of prompt_tokens (default: a quarter of the window)
    cut from batches (the user's fit windows), write_batch at a time, as
    batches of (ids, next ids) of batch_size windows.  keep < 1: every window scored by the
    fine-tuned source's mean next-token log-likelihood, the least likely
    share dropped (n * keep windows kept).  log(line): progress.
    models: as Writer takes them (one model: the fine-tuned source
    writing alone); shared: Writer's."""
    if not (isinstance(n, int) and n >= 0):
        raise BicoError(E_ARG, "generate: n must be an integer >= 0, got %r"
                        % (n,))
    if not 0 < keep <= 1:
        raise BicoError(E_ARG, "generate: keep must be above 0 and at most "
                        "1, got %r" % (keep,))
    if n == 0:
        return []
    P = prompt_tokens or max(1, window // 4)
    pr = prompts(batches, n, P, seed)
    if device is not None:
        pr = pr.to(device)
    w = Writer(models, temperature, top_p, seed + 1, shared)
    t0, done, rows = time.time(), 0, []
    for s in range(0, n, write_batch):
        rows.append(w.batch(pr[s:s + write_batch], window + 1))
        done += len(rows[-1])
        if log is not None:
            el = time.time() - t0
            log("generate: %d/%d windows written, %.0f s elapsed, about "
                "%.0f s left" % (done, n, el, el / done * (n - done)))
    wins = torch.cat(rows)
    if keep < 1:
        wins = _filtered(models[1 if len(models) > 1 else 0], wins, keep,
                         write_batch)
    return [(wins[s:s + batch_size, :-1].contiguous(),
             wins[s:s + batch_size, 1:].contiguous())
            for s in range(0, len(wins), batch_size)]


def perturb(models, batches, n, share, temperature=1.0, top_p=0.95,
            batch_size=16, seed=0, write_batch=WRITE_BATCH, shared=None,
            device=None):
    """n windows that are the user's fit windows (taken in turn) with a
    share of their tokens (each but the first, independently) replaced by
    the teacher's sample there given the window's own text before it (the
    three models run once over each window): text that stays close to the
    user's while every window is a new one.  Batches of (ids, next ids) of
    batch_size windows."""
    if not 0 <= share <= 1:
        raise BicoError(E_ARG, "generate: share must be from 0 to 1, got %r"
                        % (share,))
    wins = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches])
    if device is not None:
        wins = wins.to(device)
    g = torch.Generator().manual_seed(seed + 2)
    w = Writer(models, temperature, top_p, seed + 3, shared)
    order = torch.randperm(len(wins), generator=g)
    rows = []
    with torch.no_grad():
        for s in range(0, n, write_batch):
            k = min(write_batch, n - s)
            src = wins[order[torch.arange(s, s + k) % len(wins)]]
            z = [_logits(m, src[:, :-1]) for m in models]
            if len(z) == 1:
                zt = z[0].float()
            else:
                za, zt, zb = (t.float() for t in z)
                if shared is not None:
                    zb = zb[..., :shared]
                zt = zb + zt - za
            flat = zt.reshape(-1, zt.shape[-1])
            new = sample_next(flat, w.temperature, w.top_p, w.g) \
                .view(k, -1).to(src.device)
            hit = torch.rand(new.shape, generator=g) < share
            out = src.clone()
            out[:, 1:] = torch.where(hit.to(src.device), new, src[:, 1:])
            rows.append(out)
    wins = torch.cat(rows)
    return [(wins[s:s + batch_size, :-1].contiguous(),
             wins[s:s + batch_size, 1:].contiguous())
            for s in range(0, len(wins), batch_size)]


def _logits(model, x):
    out = model(x)
    return getattr(out, "logits", out)


def _filtered(tuned, wins, keep, batch_size):
    """The windows whose mean next-token log-likelihood under the
    fine-tuned source is in the top `keep` share, in their order."""
    scores = []
    with torch.no_grad():
        for s in range(0, len(wins), batch_size):
            w = wins[s:s + batch_size]
            z = tuned(w[:, :-1])
            z = getattr(z, "logits", z).float()
            lp = torch.log_softmax(z, -1).gather(-1, w[:, 1:, None])
            scores.append(lp.squeeze(-1).mean(-1))
    sc = torch.cat(scores)
    k = max(1, int(math.ceil(len(wins) * keep)))
    idx = sc.topk(k).indices.sort().values
    return wins[idx]
