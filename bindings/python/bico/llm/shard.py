"""bico.llm.shard: the distillation's windows divided among processes
(docs/scale-out.md, "The distillation across processes").

Every rank holds the same list of batches (the user's windows, then the
written ones: rank 0 writes them and sends them to the others) and keeps
rows r, r + R, r + 2R, ... of each (R ranks, this one r): its share of
the teacher's entries is computed and kept by it alone.  A training step
takes the same batch on every rank (the one seeded order); each rank's
loss on its rows is weighted by its share of the batch (rows / batch
rows: the windows are of one length), the gradients summed over the
ranks (one all-reduce), so every rank takes the step one process takes
on the whole batch, to float rounding.  The held-out windows are divided
the same way and their losses gathered back in order: every choice (the
step kept, the route) is made on the same numbers by every rank.

RowShard(ranks, batches) is the division; it is the `parallel` of
bico.torch.distill.distill (weight, reduce, total).  ShardedTeacher
gives a Teacher built on a rank's own rows the batches' global indices;
window_losses is bico.torch.distill.window_losses over every rank's
share, gathered."""
import torch

from .._status import BicoError, E_ARG
from ..torch import distill as _d

__all__ = ["RowShard", "ShardedTeacher", "window_losses"]


class RowShard(object):
    """This rank's rows of each batch of batches ((ids, next ids) pairs,
    or ids alone): local, the non-empty ones, and where (global batch
    index -> position in local)."""

    def __init__(self, ranks, batches):
        self.ranks = ranks
        self.n = len(batches)
        self.local, self.where, self.weights, self.first = [], {}, [], []
        size, rank, start = ranks.size, ranks.rank, 0
        for i, b in enumerate(batches):
            x, y = (b[0], b[1]) if isinstance(b, (tuple, list)) else (b, None)
            rows = list(range(rank, x.shape[0], size))
            self.weights.append(len(rows) / max(1, x.shape[0]))
            self.first.append((start, rows))
            start += x.shape[0]
            if rows:
                self.where[i] = len(self.local)
                idx = torch.tensor(rows)
                self.local.append((x[idx], None if y is None else y[idx]))
        if not self.local and ranks.size > 1 and self.n:
            raise BicoError(E_ARG, "rank %d holds no window (%d windows for "
                            "%d ranks): more windows, or fewer ranks"
                            % (rank, start, size))

    def inputs(self):
        """The ids of this rank's rows of every batch (None where it holds
        none)."""
        return [self.local[self.where[i]][0] if i in self.where else None
                for i in range(self.n)]

    def targets(self):
        """The next ids of this rank's rows of every batch (None where it
        holds none)."""
        return [self.local[self.where[i]][1] if i in self.where else None
                for i in range(self.n)]

    # ---- bico.torch.distill.distill's parallel ----

    def weight(self, i):
        return self.weights[i]

    def reduce(self, tensors):
        self.ranks.sum_all(tensors)

    def total(self, value):
        t = torch.tensor([float(value)], dtype=torch.float64)
        self.ranks.sum_all([t])
        return float(t[0])


class ShardedTeacher(object):
    """A Teacher of a rank's local batches (RowShard.local, in order) seen
    by the batches' global indices: get(i) is None for a batch of which
    the rank holds no row; len() the number of batches."""

    def __init__(self, teacher, shard):
        self.teacher, self.shard = teacher, shard

    def __len__(self):
        return self.shard.n

    def get(self, i, device=None):
        j = self.shard.where.get(i)
        return None if j is None else self.teacher.get(j, device)

    def close(self):
        self.teacher.close()

    def __getattr__(self, name):        # k, outputs, bytes_memory, ...
        if name in ("teacher", "shard"):
            raise AttributeError(name)
        return getattr(self.teacher, name)


def window_losses(model, shard, chunk=_d.TOKEN_CHUNK):
    """Every window's held-out loss of shard's batches (a RowShard of the
    held-out batches), each rank scoring its rows, gathered in the
    windows' order on every rank."""
    mine = []
    for i, (start, rows) in enumerate(shard.first):
        if i not in shard.where:
            continue
        v = _d.window_losses(model, [shard.local[shard.where[i]]], chunk)
        mine += [(start + r, float(x)) for r, x in zip(rows, v)]
    return shard.ranks.gather(mine)
