"""bico.llm.stream_route: the streamed runner as the routes use it
(python3 -m bico.llm, and bico.torch.transfer_model given model folders).

    sf = StreamedFit("A/", "A_ft/", "B/", cal.batches, cal.held_out)
    res = sf.fit(1e-2)                       # a stream_out.Result
    per = sf.score(res, [0, 0.5, 1])         # {alpha: [(loss, tokens)]}
    sf.write_model(res, "B_ft/", 0.5, {"k": "v"})
    sf.close()

StreamedFit runs the two statistics sweeps once (stream_stats: boundary
states, norms and embedding carried by BiCo, gradients), then each fit is
a third sweep (stream_fit) whose result stays in the spill store until it
is scored (stream_out.score) and written.  Memory: the blocks in flight,
one block's rows and statistics, the head while the loss is taken; the
rest is in the store (its budget in memory, beyond it in a nameless
temporary file)."""
import time

import torch

from .runtime import DEFAULT_BUDGET
from . import stream_out as _out
from .stream_fit import fit_blocks
from .stream_stats import Run, forward_sweep, backward_sweep

__all__ = ["StreamedFit", "lm_loss_of", "mean_loss_of"]


class StreamedFit(object):
    """The statistics of a source pair and a target folder on calibration
    batches, ready for fits (see the module doc).  dtype: the compute
    dtype (None: the files'); threads: the library's and torch's thread
    count (None: torch's current one); budget: bytes of spilled tensors
    kept in memory; spill_dir: where the temporary file goes (None:
    $TMPDIR); log: a function of one line."""

    def __init__(self, source, tuned, target, batches, held=(),
                 dtype=torch.float32, threads=None, budget=DEFAULT_BUDGET,
                 spill_dir=None, log=None):
        if threads is None:
            threads = torch.get_num_threads()
        torch.set_num_threads(int(threads))
        self.log = log or (lambda line: None)
        self.run = Run(source, tuned, target, batches, held, dtype=dtype,
                       threads=threads, budget=budget, spill_dir=spill_dir,
                       log=self.log)
        self.fits = 0
        self.times = {}
        try:
            t0 = time.time()
            forward_sweep(self.run)
            t1 = time.time()
            backward_sweep(self.run, self.run.A, "hA", "gA")
            backward_sweep(self.run, self.run.B, "hB", "gB")
            self.times.update(forward=t1 - t0, backward=time.time() - t1)
        except BaseException:
            self.close()
            raise

    def fit(self, ridge, alpha=1.0, kind="model", rank=16, saves=(),
            report=None, progress=None):
        """One fit (ridge c, the output change scaled by alpha) kept as a
        stream_out.Result: new tensors (kind "model") or rank-r pairs
        ("adapter", with the modules_to_save `saves`)."""
        res = _out.Result(self.run, "fit%d/" % self.fits, kind, rank, saves)
        self.fits += 1
        t0 = time.time()
        fit_blocks(self.run, ridge, alpha, sink=res.sink, report=report,
                   rank=report is not None, progress=progress)
        self.times["fit"] = self.times.get("fit", 0) + time.time() - t0
        return res

    def score(self, result, grid, held=None):
        """{alpha: [(mean next-token loss, tokens) per held-out batch]}."""
        t0 = time.time()
        out = _out.score(result, held if held is not None else self.run.held,
                         grid)
        self.times["score"] = self.times.get("score", 0) + time.time() - t0
        return out

    def write_model(self, result, dest, alpha, metadata):
        _out.write_model(result, dest, alpha, metadata)

    def write_adapter(self, result, dest, alpha, **kw):
        return _out.write_adapter(result, dest, alpha, **kw)

    def close(self):
        if getattr(self, "run", None) is not None:
            self.run.close()
            self.run = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def lm_loss_of(per):
    """lm_loss over the held-out batches (token-weighted), as
    bico.llm.text.lm_loss sums it."""
    tot, cnt = 0.0, 0
    for loss, n in per:
        tot += loss * n
        cnt += n
    return tot / max(cnt, 1)


def mean_loss_of(per):
    """The mean of the per-batch losses (bico.torch.choose._mean_loss)."""
    return float(sum(v for v, _ in per) / len(per))
