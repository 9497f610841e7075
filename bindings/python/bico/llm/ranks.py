"""bico.llm.ranks: the streamed runner across processes (docs/scale-out.md,
"The LLM routes across processes").

The calibration windows are shared among the ranks of a torch.distributed
process group (gloo on CPU; started by torchrun): rank r takes the batches
r, r + R, r + 2R, ... whole (each batch keeps the loss normalisation of a
one-process run).  What the batches share are sums over their rows, and
each is brought together before it is used:

  xcov_all     the norms' input statistics (the partial BiCo run carries
               the norms and the embedding from them): rank 0 merges the
               ranks' statistics in rank order and sends the merged bytes
               to every rank, which carries from the same bytes; the
               carried values are then compared across ranks (same()).
  from_root    anything rank 0 computes (an output map from the merged
               gradient statistics, a fit's solve) sent to every rank:
               one rounding everywhere, so the ranks' working targets
               stay bit for bit the same.
  fit_solve    the driver's solve of one layer: the ranks' fit
               statistics (bico_fit_serialize) merged on rank 0
               (bico_fit_merge, rank order), solved there, the update sent
               to every rank.
  gather       per-batch values (held-out losses, gradient rows) in the
               order of the batches' global indices, on every rank.

A failure on rank 0 inside from_root reaches every rank as a BicoError
with its message (no rank waits for a broadcast that never comes); a rank
that dies makes the others' next collective fail (gloo).  With one process
(no process group) every method is the identity and torch.distributed is
not touched.  Results equal the one-process run's up to the order in which
the sums add up."""
import hashlib

import numpy as np
import torch

from .._status import BicoError, E_ARG, E_IO, E_NUMERIC, E_STATE

__all__ = ["Ranks", "world_size", "join", "leave"]


class Ranks(object):
    """The process group the streamed runner's sums go through (see the
    module doc).  Ranks(): one process.  Ranks(world=True): the
    processes of torch.distributed's default group (join() first), or of
    group, a torch.distributed group; every one of them must then make
    the same calls."""

    def __init__(self, world=False, group=None):
        self.group, self.rank, self.size = group, 0, 1
        dist = _dist()
        if world or group is not None:
            if dist is None or not dist.is_initialized():
                raise BicoError(E_STATE, "Ranks(world=True): "
                                "torch.distributed's process group is not "
                                "initialised (bico.llm.ranks.join)")
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)

    @property
    def root(self):
        """Whether this process is rank 0 (the one that solves, writes and
        prints)."""
        return self.rank == 0

    def share(self, items, need_one=False):
        """[(global index, item)] of this rank's share: every size-th item
        from the rank's own index.  need_one: refused unless every rank
        gets one (the calibration batches)."""
        items = list(items)
        if need_one and len(items) < self.size:
            raise BicoError(E_ARG, "%d calibration batches for %d ranks: "
                            "each rank needs at least one (more windows, "
                            "or fewer ranks)" % (len(items), self.size))
        return [(i, x) for i, x in enumerate(items)
                if i % self.size == self.rank]

    # ---- the collectives ----

    def total(self, n):
        """The sum of an integer over the ranks."""
        if self.size == 1:
            return int(n)
        t = torch.tensor([int(n)], dtype=torch.int64)
        _dist().all_reduce(t, group=self.group)
        return int(t[0])

    def sum_root(self, t):
        """The sum over the ranks of a float64 tensor, on rank 0 (None on
        the others)."""
        if self.size == 1:
            return t
        t = t.detach().contiguous()
        _dist().reduce(t, 0, group=self.group)
        return t if self.root else None

    def _objects(self, obj):
        """Every rank's obj, in rank order, on every rank."""
        out = [None] * self.size
        _dist().all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, indexed):
        """[(global index, value)] of every rank -> the values in the order
        of their indices, on every rank."""
        parts = [list(indexed)] if self.size == 1 else \
            self._objects(list(indexed))
        return _in_order(parts)

    def gather_root(self, indexed):
        """gather() on rank 0 only (None on the others: nothing sent to
        them)."""
        if self.size == 1:
            return _in_order([list(indexed)])
        out = [None] * self.size if self.root else None
        _dist().gather_object(list(indexed), out, 0, group=self.group)
        return _in_order(out) if self.root else None

    def _send_bytes(self, data, dst):
        d = _dist()
        d.send(torch.tensor([len(data)], dtype=torch.int64), dst,
               group=self.group)
        if data:
            d.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst,
                   group=self.group)

    def _bcast_bytes(self, data):
        """Rank 0's bytes (data there; ignored elsewhere) on every rank."""
        d = _dist()
        n = torch.tensor([len(data) if self.root else 0], dtype=torch.int64)
        d.broadcast(n, src=0, group=self.group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) \
            if self.root else torch.empty(int(n[0]), dtype=torch.uint8)
        if buf.numel():
            d.broadcast(buf, src=0, group=self.group)
        return data if self.root else buf.numpy().tobytes()

    def _recv_bytes(self, src):
        d = _dist()
        n = torch.zeros(1, dtype=torch.int64)
        d.recv(n, src, group=self.group)
        buf = torch.empty(int(n[0]), dtype=torch.uint8)
        if buf.numel():
            d.recv(buf, src, group=self.group)
        return buf.numpy().tobytes()

    def from_root(self, fn):
        """fn() run on rank 0 (a tuple of NumPy arrays, None among them
        allowed), its result sent to every rank.  An exception in fn is
        raised on every rank (a BicoError with its message elsewhere)."""
        if self.size == 1:
            return fn()
        d = _dist()
        head, out, err = [None], None, None
        if self.root:
            try:
                out = fn()
                head[0] = ("ok", [None if a is None else
                                  (tuple(a.shape), a.dtype.str)
                                  for a in out])
            except BaseException as e:   # every rank stops with it
                err = e
                head[0] = ("error", (getattr(e, "status", E_STATE),
                                     "rank 0: %s" % (getattr(
                                         e, "message", None) or e,)))
        d.broadcast_object_list(head, src=0, group=self.group)
        kind, info = head[0]
        if kind == "error":
            if err is not None:
                raise err
            raise BicoError(*info)
        res = []
        for i, meta in enumerate(info):
            if meta is None:
                res.append(None)
                continue
            shape, dt = meta
            t = torch.from_numpy(np.ascontiguousarray(out[i])) if self.root \
                else torch.empty(shape, dtype=_TORCH[dt])
            d.broadcast(t, src=0, group=self.group)
            res.append(out[i] if self.root else t.numpy())
        return tuple(res)

    def _merged_on_root(self, local, load):
        """Rank 0: local with every other rank's serialised statistics
        merged into it, in rank order (load(bytes) -> an object with
        merge/close).  Other ranks: their bytes sent, None returned."""
        if not self.root:
            self._send_bytes(local.to_bytes(), 0)
            return None
        for r in range(1, self.size):
            other = load(self._recv_bytes(r))
            try:
                local.merge(other)
            finally:
                other.close()
        return local

    def xcov_root(self, xc):
        """The sum of the ranks' accumulators xc on rank 0 (xc merged into,
        and returned); None on the others."""
        if self.size == 1:
            return xc
        from .._xcov import XCov
        return self._merged_on_root(xc, lambda b: XCov.from_bytes(b, xc.ctx))

    def xcov_all(self, xc):
        """The sum of the ranks' accumulators, the same bytes on every rank
        (xc on rank 0, a new accumulator elsewhere; xc is closed there)."""
        if self.size == 1:
            return xc
        from .._xcov import XCov
        m = self.xcov_root(xc)
        data = self._bcast_bytes(m.to_bytes() if self.root else b"")
        if self.root:
            return m
        ctx = xc.ctx
        xc.close()
        return XCov.from_bytes(data, ctx)

    def fit_solve(self, fit, w, b, want_rank):
        """(dw, db, rank) of one layer from the sum of the ranks' fit
        statistics, solved on rank 0 and sent to every rank (the driver's
        solve callback)."""
        if self.size == 1:
            dw, db = fit.solve(w, b, rank=want_rank)
            return dw, db, fit.rank
        from ..fit import Fit
        merged = self._merged_on_root(
            fit, lambda data: Fit.from_bytes(data, fit.ctx))

        def solve():
            dw, db = merged.solve(w, b, rank=want_rank)
            rk = None if merged.rank is None else \
                np.array([merged.rank], dtype=np.int64)
            return dw, db, rk
        dw, db, rk = self.from_root(solve)
        return dw, db, None if rk is None else int(rk[0])

    def same(self, what, arrays):
        """Stops every rank unless the arrays (tensors or NumPy arrays)
        are bit for bit the same on every rank (a digest compared):
        values each rank computed itself from the same sums."""
        if self.size == 1:
            return
        h = hashlib.blake2b(digest_size=16)
        for a in arrays:
            a = a.detach().cpu().contiguous() if isinstance(a, torch.Tensor) \
                else np.ascontiguousarray(a)
            if isinstance(a, torch.Tensor):
                if a.dtype == torch.bfloat16:
                    a = a.view(torch.int16)
                a = a.numpy()
            h.update(a.tobytes())
        got = self._objects(h.hexdigest())
        if len(set(got)) != 1:
            bad = [r for r, g in enumerate(got) if g != got[0]]
            raise BicoError(E_NUMERIC, "%s differ between ranks (rank %s "
                            "against rank 0): the ranks must run the same "
                            "library build on the same kind of CPU"
                            % (what, ", ".join(map(str, bad))))

    def agree(self, outcome):
        """Every rank's outcome of a step (None: done; else a value
        describing its failure), gathered: None when every rank is done,
        else (rank, outcome) of the first rank that failed.  Called by
        every rank, failed or not, so that none goes on alone."""
        if self.size == 1:
            return None if outcome is None else (0, outcome)
        for r, o in enumerate(self._objects(outcome)):
            if o is not None:
                return r, o
        return None


def world_size():
    """The number of processes torchrun started (WORLD_SIZE; 1 without
    torchrun)."""
    import os
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise BicoError(E_ARG, "WORLD_SIZE=%r is not a number"
                        % os.environ.get("WORLD_SIZE"))


def join():
    """Joins the default process group (gloo, the rendezvous torchrun set
    in the environment) unless already joined."""
    dist = _dist()
    if dist is None or not dist.is_gloo_available():
        raise BicoError(E_ARG, "WORLD_SIZE > 1 but this PyTorch has no "
                        "torch.distributed with gloo")
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def leave(outcome):
    """Ends a process that joined a process group of several ranks at once
    (os._exit, after its output is flushed and an exception's traceback
    printed): torch.distributed's threads, torn down by the interpreter's
    exit while a peer is gone, can abort the process ("terminate called
    without an active exception", seen once in CI after a refusal).
    outcome: the exit status, or the exception that ends the command.
    Returns (nothing done) in a process that did not join."""
    import os
    import sys
    import traceback
    dist = _dist()
    if dist is None or not dist.is_initialized() or \
            dist.get_world_size() < 2:
        return
    if isinstance(outcome, BaseException):
        if isinstance(outcome, SystemExit):
            code = outcome.code if isinstance(outcome.code, int) else 1
        else:
            traceback.print_exception(type(outcome), outcome,
                                      outcome.__traceback__)
            code = 1
    else:
        code = int(outcome or 0)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _in_order(parts):
    """The values of [(global index, value)] lists in index order."""
    return [v for _, v in sorted((p for part in parts for p in part),
                                 key=lambda p: p[0])]


_TORCH = {np.dtype(np.float32).str: torch.float32,
          np.dtype(np.float64).str: torch.float64,
          np.dtype(np.int64).str: torch.int64}


def _dist():
    """torch.distributed, its calls' failures (a rank that stopped: the
    peer's connection closed, a timeout) raised as BicoError; None
    without it."""
    try:
        import torch.distributed as dist
    except ImportError:   # a PyTorch built without it
        return None
    return _Guarded(dist) if dist.is_available() else None


class _Guarded(object):
    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name):
        f = getattr(self._mod, name)
        if not callable(f):
            return f

        def call(*a, **kw):
            try:
                return f(*a, **kw)
            except RuntimeError as e:
                first = (str(e).strip().splitlines() or [""])[0]
                raise BicoError(E_IO, "torch.distributed %s across the "
                                "ranks failed (another rank stopped?): %s"
                                % (name, first))
        return call

