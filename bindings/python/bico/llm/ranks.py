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
the sums add up.

Joining (join): the launcher's variables are checked first (launcher():
RANK, WORLD_SIZE, LOCAL_RANK integers, 0 <= RANK < WORLD_SIZE; MASTER_ADDR
and MASTER_PORT), then every rank checks in at rank 0's store, waiting at
most BICO_RANKS_JOIN_TIMEOUT seconds (JOIN_TIMEOUT, 300) for all of them:
a rank that never comes (not started, stopped, another port) ends every
rank that came with one line naming it, and a RANK given to two processes
is refused on every rank that sees it.  Only then is the gloo group made,
its timeout BICO_RANKS_TIMEOUT (TIMEOUT, 1800 s), which bounds each
collective (gloo's operations end with an error when a peer sends nothing
for that long: a rank stopped by SIGSTOP, or one slower than that by more
than the timeout).  torch 1.13's own init_process_group(timeout=t) waits
about 2 t when a rank is missing (the store's wait for workers, then
gloo's connection through the store) and one t bounds both joining and
every collective; the check-in here gives each its own bound.

The same run on every rank (Ranks.same_run, right after joining): the
options that shape the result and a fingerprint of every input are
gathered, and a difference stops every rank before any work, naming the
rank and the option or input (the strings of bico.llm.agree)."""
import contextlib
import hashlib
import os
import sys
import time

import numpy as np
import torch

from .._status import BicoError, E_ARG, E_IO, E_NUMERIC, E_STATE
from .agree import first_difference

__all__ = ["Ranks", "world_size", "launcher", "timeouts", "join", "leave",
           "JOIN_TIMEOUT", "TIMEOUT"]

JOIN_TIMEOUT = 300.0     # s: every rank joins (BICO_RANKS_JOIN_TIMEOUT)
TIMEOUT = 1800.0         # s: each collective (BICO_RANKS_TIMEOUT)
TIMEOUT_LIMIT = 7 * 86400.0


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

    def sum_all(self, tensors):
        """Each float tensor of the list replaced in place by its sum over
        the ranks (one all-reduce of them laid end to end, in float32 when
        they all are, else in double: the same sums, bit for bit, on every
        rank, since each piece is added up once and then copied); returns
        the list."""
        if self.size == 1 or not tensors:
            return tensors
        dt = torch.float32 if all(t.dtype == torch.float32
                                  for t in tensors) else torch.float64
        flat = torch.cat([t.detach().reshape(-1).to(dt) for t in tensors])
        _dist().all_reduce(flat, group=self.group)
        k = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[k:k + n].reshape(t.shape).to(t.dtype))
            k += n
        return tensors

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
            dw, db = fit.solve(w, b, want_rank=want_rank)
            return dw, db, fit.rank
        from ..fit import Fit
        merged = self._merged_on_root(
            fit, lambda data: Fit.from_bytes(data, fit.ctx))

        def solve():
            dw, db = merged.solve(w, b, want_rank=want_rank)
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

    def same_run(self, items):
        """Stops every rank (BicoError E_ARG, the same message on each)
        unless every rank was given the same run; called right after
        joining, before any work.  items: [(name, value)] in one order on
        every rank, value an option's value (value_digest()) or an input's
        fingerprint: a string, (path, digest) of a file (text_fingerprint,
        whole_fingerprint, fingerprint of a file), or (path, {file name:
        digest}) of a folder (fingerprint).  The items of every rank are
        gathered on every rank, and each finds the same first difference:
        the lowest rank r whose items differ from rank 0's, and there the
        first item: "rank r: NAME differs from rank 0's: ..." (the file of
        a folder that differs, or is on one rank only)."""
        if self.size == 1:
            return
        items = [(str(n), v) for n, v in items]
        got = self._objects(items)
        for r in range(1, self.size):
            why = first_difference(got[r], got[0], r)
            if why is not None:
                raise BicoError(E_ARG, "rank %d: %s; every rank must be "
                                "given the same options and inputs (copies "
                                "of the same files on each node are fine; "
                                "nothing was done)" % (r, why))


def _variable(name, low, high, default=None):
    """An integer launcher variable in [low, high) (high None: no upper
    bound), or default when it is not set; BicoError E_ARG naming it."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise BicoError(E_ARG, "%s is not set: a launcher (torchrun) "
                            "sets RANK, WORLD_SIZE, MASTER_ADDR and "
                            "MASTER_PORT for each process of a run" % name)
        return default
    try:
        v = int(raw.strip())
    except ValueError:
        v = None
    if v is None or v < low or (high is not None and v >= high):
        raise BicoError(E_ARG, "%s=%r: not an integer %s" % (
            name, raw, "from %d to %d" % (low, high - 1) if high is not None
            else "of at least %d" % low))
    return v


def launcher():
    """(RANK, WORLD_SIZE, LOCAL_RANK) of this process as a launcher
    (torchrun) set them, checked before anything joins: integers,
    WORLD_SIZE >= 1 (unset: 1, one process), 0 <= RANK < WORLD_SIZE (RANK
    needed when WORLD_SIZE > 1; set alone it must be 0), 0 <= LOCAL_RANK
    < WORLD_SIZE.  A bad value: BicoError E_ARG naming the variable."""
    size = _variable("WORLD_SIZE", 1, None, 1)
    rank = _variable("RANK", 0, size, None if size > 1 else 0)
    local = _variable("LOCAL_RANK", 0, size, 0)
    return rank, size, local


def world_size():
    """The number of processes the launcher started (WORLD_SIZE; 1
    without one), its variables checked (launcher())."""
    return launcher()[1]


def _seconds(name, default):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not 0 < v <= TIMEOUT_LIMIT:
        raise BicoError(E_ARG, "%s=%r: not a number of seconds above 0 "
                        "(at most %d)" % (name, raw, TIMEOUT_LIMIT))
    return v


def timeouts():
    """(joining, each collective), in seconds, of a run across ranks:
    BICO_RANKS_JOIN_TIMEOUT (JOIN_TIMEOUT, 300: every rank of the run
    checks in at rank 0 within it, or every rank that came ends) and
    BICO_RANKS_TIMEOUT (TIMEOUT, 1800: the gloo group's timeout, which
    bounds each exchange between ranks; long enough for rank 0's solves
    and write while the others wait at real model sizes).  A value that
    is not a number above 0 (at most 7 days): BicoError E_ARG."""
    return (_seconds("BICO_RANKS_JOIN_TIMEOUT", JOIN_TIMEOUT),
            _seconds("BICO_RANKS_TIMEOUT", TIMEOUT))


_JOINED = {}      # the timeouts this process joined with (join())


def join():
    """Joins the default process group (gloo, at the rendezvous the
    launcher set in the environment) unless already joined: the
    launcher's variables checked (launcher(), MASTER_ADDR, MASTER_PORT),
    every rank checked in at rank 0's store within the joining timeout
    (timeouts()), then the group made with the collectives' timeout.
    Errors: BicoError, E_ARG for a bad variable or a RANK given twice,
    E_IO for a rank that did not come in time or a rendezvous that
    failed; one line each."""
    dist = _dist()
    if dist is None or not dist.is_gloo_available():
        raise BicoError(E_ARG, "WORLD_SIZE > 1 but this PyTorch has no "
                        "torch.distributed with gloo")
    if dist.is_initialized():
        return
    import datetime
    import torch.distributed as raw
    rank, size, _ = launcher()
    wait, each = timeouts()
    addr = os.environ.get("MASTER_ADDR", "").strip()
    if not addr:
        raise BicoError(E_ARG, "MASTER_ADDR is not set: a launcher "
                        "(torchrun) sets it to rank 0's host")
    port = _variable("MASTER_PORT", 1, 1 << 16)
    end = time.monotonic() + wait
    store = _store(raw, addr, port, rank, size, wait)
    _check_in(store, rank, size, wait, end, addr, port)
    try:
        raw.init_process_group(
            "gloo", store=raw.PrefixStore("default_pg", store), rank=rank,
            world_size=size, timeout=datetime.timedelta(seconds=each))
    except (RuntimeError, OSError, ValueError) as e:
        raise BicoError(E_IO, "ranks: joining the gloo group failed (%s)"
                        % _first_line(e))
    _JOINED.update(join=wait, each=each)


def _store(dist, addr, port, rank, size, wait):
    """The rendezvous store: rank 0 serves it (unless a torchrun agent
    does: TORCHELASTIC_USE_AGENT_STORE), the others connect within wait
    seconds.  c10d's own log lines (written to fd 2 by its C++ logging:
    "The client socket has timed out ...") are held back: the failure is
    said in one line."""
    import datetime
    td = datetime.timedelta(seconds=wait)
    try:
        with _fd2_held():
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                st = dist.TCPStore(addr, port, size, False, td)
                return dist.PrefixStore("/worker/attempt_%s" % os.environ.get(
                    "TORCHELASTIC_RESTART_COUNT", "0"), st)
            return dist.TCPStore(addr, port, size, rank == 0, td,
                                 wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, OSError, ValueError) as e:
        if rank == 0:
            why = "address already in use" if "already in use" in str(e) \
                else _first_line(e)[:160]
            raise BicoError(E_IO, "ranks: rank 0 cannot serve the "
                            "rendezvous at MASTER_PORT %d (%s): the port is "
                            "taken (another run, or two processes with "
                            "RANK=0?)" % (port, why))
        raise BicoError(E_IO, "ranks: rank 0's rendezvous at %s:%d "
                        "(MASTER_ADDR, MASTER_PORT) did not answer within "
                        "%g s (BICO_RANKS_JOIN_TIMEOUT): rank 0 not started, "
                        "stopped, or at another address" % (addr, port,
                                                             wait))


@contextlib.contextmanager
def _fd2_held():
    """What the process writes to fd 2 inside the block, dropped."""
    import tempfile
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


_KEY = "bico/join/"
_POLL = 0.05


def _check_in(store, rank, size, wait, end, addr, port):
    """Every rank checks in at the store (a key of its own RANK and a
    count), then waits until all size ranks have, until end (monotonic
    time).  A RANK that two processes have is seen by the second at once
    (and then by every rank still waiting); a rank missing at end ends
    this one naming the missing ranks."""
    try:
        if store.add(_KEY + "rank/%d" % rank, 1) > 1:
            store.set(_KEY + "twice", str(rank))
            store.add(_KEY + "dup", 1)
            raise BicoError(E_ARG, _twice(rank, size))
        store.add(_KEY + "count", 1)
        while True:
            if store.add(_KEY + "dup", 0):
                twice = store.get(_KEY + "twice").decode()
                if rank == 0:     # its store stays up while the others see
                    time.sleep(20 * _POLL)
                raise BicoError(E_ARG, _twice(twice, size))
            if store.add(_KEY + "count", 0) >= size:
                return
            if time.monotonic() >= end:
                gone = [r for r in range(size)
                        if not store.add(_KEY + "rank/%d" % r, 0)]
                raise BicoError(E_IO, "ranks: %s of WORLD_SIZE=%d did not "
                                "join within %g s (BICO_RANKS_JOIN_TIMEOUT): "
                                "not started, stopped, or given another "
                                "MASTER_ADDR/MASTER_PORT than %s:%d" % (
                                    _ranks_named(gone), size, wait, addr,
                                    port))
            time.sleep(_POLL)
    except (RuntimeError, OSError) as e:
        raise BicoError(E_IO, "ranks: rank 0's rendezvous at %s:%d went "
                        "away while joining (%s): rank 0 ended" % (
                            addr, port, _first_line(e)))


def _twice(rank, size):
    return ("RANK=%s: two processes of this run (WORLD_SIZE=%d) were given "
            "it; each needs its own RANK from 0 to %d" % (rank, size,
                                                          size - 1))


def _ranks_named(ranks):
    if len(ranks) == 1:
        return "rank %d" % ranks[0]
    shown = ", ".join(map(str, ranks[:8]))
    return "ranks %s%s" % (shown, ", ..." if len(ranks) > 8 else "")


def _first_line(e):
    return " ".join((str(e).strip().splitlines() or [type(e).__name__])[0]
                    .split())[:300]


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
                first = _first_line(e)
                if "timed out" in first.lower():
                    each = _JOINED.get("each")
                    raise BicoError(E_IO, "torch.distributed %s across the "
                                    "ranks failed: no answer from another "
                                    "rank within %s (BICO_RANKS_TIMEOUT): a "
                                    "rank stopped, or slower than that (%s)"
                                    % (name, "%g s" % each if each else
                                       "the process group's timeout", first))
                raise BicoError(E_IO, "torch.distributed %s across the "
                                "ranks failed (another rank stopped?): %s"
                                % (name, first))
        return call

