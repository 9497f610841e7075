"""bico.llm.stream.teacher: the distillation's teacher computed from the
model folders, one model and one block in memory at a time.

The proxy-tuned teacher log_softmax(z_B + z_A_ft - z_A) needs the three
models' logits on the same tokens, not the three models at once: each
model runs from its folder a block at a time (bico.llm.runtime: the
block's tensors read when it runs, the windows' hidden states kept at
the block boundary in a spill store), its final normalised states are
kept, and the model is closed before the next one runs.  The three heads
then turn those states into the teacher's entries a chunk of tokens at
a time (bico.torch.teacher.proxy_chunks), each chunk compacted as it
comes (top-k and the rest's mass).  Peak: one block, the boundary
states (in memory up to a budget, then on disk), the three heads while
the entries are made, one chunk of logits; the entries equal the
in-memory teacher's (the same operations on the same tensors).

On a device (a GPU) the same code runs there: each block's tensors are
read on the host and moved to the device when the block runs, the
boundary states stay on the device within the store's budget (beyond it
they go to the host's spill file), the heads and logits are the
device's, and the compacted entries (top-k and the rest's mass) come
back to the host once, chunk by chunk, where the Teacher keeps them.
"""
import torch
import torch.nn.functional as F

from ... import _heap
from ..._status import BicoError, E_SHAPE
from ...torch import logits as _lg
from ...torch import teacher as _t
from .. import families as _fam
from ..runtime import Folder, SpillStore, embed, DEFAULT_BUDGET

__all__ = ["build"]


def build(source, tuned, target, batches, dtype=None, k=None,
          budget=256 << 20, spill_dir=None, store_budget=DEFAULT_BUDGET,
          store_dir=None, chunk=_lg.TOKEN_CHUNK, progress=None, shared=None,
          device=None):
    """A bico.torch.teacher.Teacher of the windows `batches` ((ids, next
    ids) pairs, or ids alone) from the folders source, tuned (the tuned
    source) and target, run at `dtype` (None: the files').  k, budget,
    spill_dir: the Teacher's (entries kept, bytes in memory, folder of
    the spilled entries); store_budget, store_dir: the boundary states'
    spill store.  progress(done, total): after each block run.  shared:
    the source's vocabulary when the target's grew past it (the target's
    head is read for those ids only).  device: where the blocks run
    (None: the CPU)."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    xs = [b[0] if isinstance(b, (tuple, list)) else b for b in batches]
    paths = (source, tuned, target)
    vocab = _vocabularies(paths, shared)
    total = sum(v[1] for v in vocab)
    done = [0]

    def tick():
        done[0] += 1
        if progress is not None:
            progress(done[0], total)
    with SpillStore(store_budget, store_dir) as store:
        heads = []
        for tag, path in enumerate(paths):
            f = Folder(path, dtype)
            try:
                _final_states(f, tag, xs, store, tick, dev)
                head = f.tensor(f.head_name())
                head = (head[:shared] if shared is not None else
                        head).to(dev)
                heads.append(head)
                del head
                # a block at a time: what was read is one version
                f.check_unchanged()
            finally:
                f.close()
            _heap.trim()      # this model's blocks, before the next one
        return _entries(heads, xs, store, k, budget, spill_dir, chunk)


def _vocabularies(paths, shared=None):
    """[(head rows, layers)] of the three folders (headers only), refused
    unless the heads share one vocabulary (shared: the source's, which the
    target's head extends)."""
    out = []
    for p in paths:
        f = Folder(p)
        try:
            out.append((f.shapes[f.head_name()][0], f.L))
        except KeyError:
            raise BicoError(E_SHAPE, "%s has no output head (%s)" % (
                p, f.head_name()))
        finally:
            f.close()
    if shared is not None and out[2][0] >= shared == out[0][0] == out[1][0]:
        return out
    if len(set(v for v, _ in out)) != 1:
        raise BicoError(E_SHAPE, "distill: the teacher needs one vocabulary: "
                        "%s" % ", ".join("%s has %d outputs" % (p, v) for p,
                                         (v, _) in zip(paths, out)))
    return out


def _take(store, key):
    """The stored tensor of key, removed from the store."""
    t = store.get(key)
    store.pop(key)
    return t


def _final_states(f, tag, xs, store, tick, dev):
    """Runs folder f's decoder on every batch, a block at a time: the
    final norm's output of batch b kept in store under (tag, "n", b).
    The blocks run on dev (each moved there when it runs)."""
    cfg = f.cfg
    with torch.no_grad():
        for b, x in enumerate(xs):
            rows = f.rows(f.embed_name(), x.reshape(-1))
            store.put((tag, 0, b), embed(cfg, rows.reshape(
                x.shape[0], x.shape[1], -1).to(dev)))
        pos = {}
        for i in range(f.L):
            layer = f.layer(i).to(dev)
            for b, x in enumerate(xs):
                h = _take(store, (tag, i, b)).to(dev)
                T = x.shape[1]
                if T not in pos:
                    pos[T] = _fam.positions(cfg, T, h)
                pe, mask = pos[T]
                store.put((tag, i + 1, b), layer(
                    h, attention_mask=mask, position_embeddings=pe)[0])
            del layer
            tick()
        norm = _fam.RMSNorm(f.tensor("model.norm.weight").to(dev),
                            cfg["eps"], cfg["gemma"])
        for b in range(len(xs)):
            store.put((tag, "n", b), norm(_take(store, (tag, f.L, b))
                                          .to(dev)))


def _entries(heads, xs, store, k, budget, spill_dir, chunk):
    """The Teacher from the three models' final states and heads."""
    t = _t.Teacher(k=k, budget=budget, spill_dir=spill_dir)
    V = heads[0].shape[0]
    rows = max(1, min(chunk, _lg.LOGIT_BYTES // (4 * V)))
    fns = [(lambda h, w=w: F.linear(h, w)) for w in heads]
    try:
        with torch.no_grad():
            for b, x in enumerate(xs):
                hs = [_take(store, (tag, "n", b)).to(heads[0].device)
                      for tag in range(3)]
                flat = [h.reshape(-1, h.shape[-1]) for h in hs]
                t.put_chunks(b, _t.proxy_chunks(flat, fns, rows),
                             hs[0].shape[:-1])
    except BaseException:
        t.close()
        raise
    return t
