"""What every part of bico.torch shares: the progress line, batches moved
to a model's device, the calibration step (batch -> scalar loss) and the
model's output on a batch without its labels (batch -> logits)."""
import sys

import torch

from .._status import BicoError, E_ARG


# ---- progress ----

def progress(iterable, total=None, desc="bico", enabled=True):
    """tqdm when installed, else a plain line on stderr every ~10 %."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc=desc)
    except ImportError:
        return _plain(iterable, total, desc)


def _plain(iterable, total, desc):
    if total is None:
        try:
            total = len(iterable)
        except TypeError:
            total = None
    every = max(1, total // 10) if total else 10
    n = 0
    for n, x in enumerate(iterable, 1):
        yield x
        if n % every == 0 or n == total:
            sys.stderr.write("%s: %d%s batches\n"
                             % (desc, n, "/%d" % total if total else ""))
            sys.stderr.flush()


def _to_device(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, dict):
        return {k: _to_device(v, dev) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, dev) for v in x)
    return x


def _device(model):
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _default_step(loss_fn):
    def step(model, batch):
        if isinstance(batch, dict):
            out = model(**batch)
            return loss_fn(out, batch) if loss_fn else out.loss
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            x, y = batch
            return loss_fn(model(x), y)
        return loss_fn(model(batch))
    return step


def _default_forward(model, batch):
    """The model's output on a batch without its labels: model(x) for
    (x, y), model(**b) for a dict, model(b) otherwise."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return model(batch[0])
    return model(batch)


def _output(out):
    """Logits of a model output: the tensor, .logits, or a tuple's first."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    raise BicoError(E_ARG, "choose_alpha: cannot read logits from a %s"
                    % type(out).__name__)


def _on(forward, dev):
    return lambda m, b: forward(m, _to_device(b, dev))
