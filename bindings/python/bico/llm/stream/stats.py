"""bico.llm.stream.stats: the streamed runner's first two sweeps over the
calibration windows, a block at a time from the model folders.

  forward_sweep   the source A and the target B run bottom-up in
                  lockstep (target block j beside its source block i(j)):
                  every window's hidden state at every block boundary
                  goes to the spill store; the input statistics of each
                  pair of norms (the map BiCo carries norms and the
                  embedding with, norm_map "act") are accumulated and the
                  library carries that block's norms (and, at block 0,
                  the embedding; at the end the final norm, and an untied
                  head the fit cannot take by its input map) in a partial
                  run on the folders.
  backward_sweep  the loss gradient at the last block's output (the head
                  read whole, the logits a chunk of tokens at a time),
                  then down the blocks: each block's forward recomputed
                  from its saved input with gradients, and its backward
                  from the saved output gradient (block-level
                  checkpointing), every boundary's gradient to the store.

The output-gradient statistics themselves are accumulated later, block by
block, as the fit reaches each block (bico.llm.stream.fit): they need the
gradients at a block's output, which these sweeps leave in the store.
Everything matches the in-memory route (bico.torch.collect): the same
rows, added to the same accumulators in the same order."""
import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

from ..._ctx import Context
from ..._names import Pairing
from ..._status import BicoError, E_ARG, E_SHAPE
from ..._xcov import XCov
from ...transfer import Transfer
from .. import families as _fam
from ..runtime import Folder, SpillStore, embed, stages

__all__ = ["Run", "forward_sweep", "backward_sweep"]

# bytes of logits computed at once (tokens x vocabulary x 4)
LOGITS_BUDGET = 64 << 20


class Run(object):
    """What every streamed sweep works with: the folders (A, At: the tuned
    source, B), their pairing and depth map, the batches ((ids, next ids)
    pairs) and held-out batches (this rank's share, their indices in
    batch_ids and held_ids: bico.llm.ranks), the spill store, the
    library's context (threads), the compute dtype and a log function."""

    def __init__(self, source, tuned, target, batches, held=(),
                 dtype=torch.float32, threads=None, budget=None,
                 spill_dir=None, logits_budget=LOGITS_BUDGET, log=None,
                 alpha=1.0, ranks=None):
        from ..ranks import Ranks
        self.ranks = Ranks() if ranks is None else ranks
        self.dtype = dtype
        self.alpha = float(alpha)  # the scale BiCo carries norms etc. at
        self.A = Folder(source, dtype)
        self.At = Folder(tuned, dtype)
        self.B = Folder(target, dtype)
        if self.A.shapes != self.At.shapes:
            bad = sorted(set(self.A.shapes) ^ set(self.At.shapes)) or sorted(
                n for n in self.A.shapes if self.A.shapes[n] !=
                self.At.shapes[n])
            raise BicoError(E_SHAPE, "%s and %s hold different tensors (%s): "
                            "the tuned source must have the source's "
                            "architecture" % (source, tuned,
                                              ", ".join(bad[:3])))
        self.pairing = Pairing(self.A.shapes, self.B.shapes)
        if not self.pairing.l_a or not self.pairing.l_b:
            raise BicoError(E_ARG, "%s / %s: no decoder blocks found"
                            % (source, target))
        self.depth = self.pairing.depth
        batches = [_check_batch(b, i) for i, b in enumerate(batches)]
        held = [_check_batch(b, i) for i, b in enumerate(held)]
        if not batches:
            raise BicoError(E_ARG, "no calibration batches")
        # this rank's share (all of them in one process), with the
        # batches' indices in the whole list
        mine = self.ranks.share(batches, need_one=True)
        self.batch_ids = [i for i, _ in mine]
        self.batches = [b for _, b in mine]
        mine = self.ranks.share(held)
        self.held_ids = [i for i, _ in mine]
        self.held = [b for _, b in mine]
        kw = {} if budget is None else {"budget": budget}
        self.store = SpillStore(folder=spill_dir, **kw)
        self.threads = threads
        self.ctx = Context() if threads is None else Context(threads=threads)
        self.logits_budget = int(logits_budget)
        self.log = log or (lambda *a: None)
        self._pe = {}
        # an untied head over the source's vocabulary is fitted after the
        # blocks (bico.llm.stream.fit, its rows kept by token id); else
        # BiCo carries it by its input map (the row rule)
        self.fit_head = not self.B.cfg["tied"] and \
            self.A.shapes[self.A.head_name()][0] == \
            self.B.shapes["lm_head.weight"][0]
        self.carried = {}  # target tensor -> store key of its carried value
        self.carry_report = []  # the library's report entries of those

    def close(self):
        self.store.close()
        for f in (self.A, self.At, self.B):
            f.close()

    def check_unchanged(self):
        """The three folders' weight files are still those the run opened
        (runtime.Folder.check_unchanged), else BicoError E_IO naming the
        file: checked before an output is committed."""
        for f in (self.A, self.At, self.B):
            f.check_unchanged()

    def pe(self, folder, T):
        """(position embeddings, mask) of a folder's model for T tokens."""
        key = (id(folder), T)
        if key not in self._pe:
            h = torch.empty(1, T, 1, dtype=self.dtype)
            self._pe[key] = _fam.positions(folder.cfg, T, h)
        return self._pe[key]

    def embed_rows(self, folder, x, table=None):
        """The stem of a batch: embedding rows of ids x [B, T] (from the
        folder, or from the store's `table` key)."""
        ids = x.reshape(-1)
        rows = folder.rows(folder.embed_name(), ids) if table is None \
            else self.store.rows(table, ids)
        return embed(folder.cfg, rows.reshape(x.shape[0], x.shape[1], -1))


def _check_batch(b, i):
    if not (isinstance(b, (tuple, list)) and len(b) == 2):
        raise BicoError(E_ARG, "batch %d: a streamed run takes (ids, next "
                        "ids) batches of token ids (text_batches)" % i)
    x, y = (torch.as_tensor(t) for t in b)
    if x.dim() != 2 or x.shape != y.shape or x.dtype.is_floating_point:
        raise BicoError(E_ARG, "batch %d: ids and next ids must be integer "
                        "[batch, tokens] tensors of one shape, got %s and "
                        "%s" % (i, tuple(x.shape), tuple(y.shape)))
    return x.long(), y.long()


def _rows(t):
    """A [..., d] tensor as float32 rows [n, d] (NumPy, no copy when it
    already is: the in-memory collector's _rows_np)."""
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    return t.reshape(-1, t.shape[-1]).numpy()


# ---- the forward sweep ----

def _advance(run, folder, key, i):
    """Runs block i of a folder's model on every batch: (key, i+1, b) from
    (key, i, b)."""
    layer = folder.layer(i)
    with torch.no_grad():
        for b, (x, _) in enumerate(run.batches):
            pe, mask = run.pe(folder, x.shape[1])
            h = run.store.get((key, i, b))
            run.store.put((key, i + 1, b), stages(layer, h, pe, mask)["out"])


def forward_sweep(run):
    """Boundary states of A ("hA") and B ("hB") for every batch, and the
    norms, the embedding (and an untied head) carried by BiCo into
    run.carried (store keys "carry/<tensor>")."""
    A, B, store = run.A, run.B, run.store
    for b, (x, _) in enumerate(run.batches):
        store.put(("hA", 0, b), run.embed_rows(A, x))
        store.put(("hB", 0, b), run.embed_rows(B, x))
    at = 0  # A's blocks below `at` have run (hA[at] exists)
    for j in range(B.L):
        s = run.depth[j]
        while at < s:
            _advance(run, A, "hA", at)
            at += 1
        la, lb = A.layer(s), B.layer(j)
        xin = XCov(A.d, B.d, ctx=run.ctx)
        xmid = XCov(A.d, B.d, ctx=run.ctx)
        with torch.no_grad():
            for b, (x, _) in enumerate(run.batches):
                ha, hb = store.get(("hA", s, b)), store.get(("hB", j, b))
                sa = stages(la, ha, *run.pe(A, x.shape[1]))
                sb = stages(lb, hb, *run.pe(B, x.shape[1]))
                if at == s:
                    store.put(("hA", s + 1, b), sa["out"])
                store.put(("hB", j + 1, b), sb["out"])
                xin.add(_rows(ha), _rows(hb))
                xmid.add(_rows(sa["mid"]), _rows(sb["mid"]))
        if at == s:
            at += 1
        p = "model.layers.%d." % j
        xin, xmid = run.ranks.xcov_all(xin), run.ranks.xcov_all(xmid)
        stats = {p + "input_layernorm": xin,
                 p + "post_attention_layernorm": xmid}
        names = [p + "input_layernorm.weight",
                 p + "post_attention_layernorm.weight"]
        if j == 0:
            names.append(B.embed_name())
        carry(run, names, stats)
        run.log("statistics: block %d/%d forward (source block %d)"
                % (j + 1, B.L, s))
    while at < A.L:
        _advance(run, A, "hA", at)
        at += 1
    _carry_tail(run)


def _carry_tail(run):
    """The final norm (its input statistic: the last boundary's states)
    and an untied head the fit does not reach (run.fit_head false: the
    vocabularies differ) by its input map (the final norm's outputs)."""
    A, B, store = run.A, run.B, run.store
    xn = XCov(A.d, B.d, ctx=run.ctx)
    xh = None if B.cfg["tied"] or run.fit_head else \
        XCov(A.d, B.d, ctx=run.ctx)
    na = nb = None
    if xh is not None:
        na = _fam.RMSNorm(A.tensor("model.norm.weight"), A.cfg["eps"],
                          A.cfg["gemma"])
        nb = _fam.RMSNorm(B.tensor("model.norm.weight"), B.cfg["eps"],
                          B.cfg["gemma"])
    with torch.no_grad():
        for b in range(len(run.batches)):
            ha, hb = store.get(("hA", A.L, b)), store.get(("hB", B.L, b))
            xn.add(_rows(ha), _rows(hb))
            if xh is not None:
                xh.add(_rows(na(ha)), _rows(nb(hb)))
    xn = run.ranks.xcov_all(xn)
    stats, names = {"model.norm": xn}, ["model.norm.weight"]
    if xh is not None:
        stats["lm_head"] = run.ranks.xcov_all(xh)
        names.append("lm_head.weight")
    carry(run, names, stats)


def carry(run, names, stats):
    """The target tensors `names` carried by the library's BiCo (method
    bico at run.alpha, norm_map "act": a partial run on the folders, the
    statistics lent from memory): each carried value (theta_B + update,
    in double, rounded once to the compute dtype, as the in-memory
    route's state dicts hold it) goes to the store under
    "carry/<name>"; the statistics are closed."""
    B, store = run.B, run.store
    got = {}

    def sink(t):
        name, upd = t["name"], t["update"]
        run.carry_report.append(t["report"])
        key = "carry/" + name
        shape = B.shapes[name]
        if upd is None:
            return
        got[name] = t["handling"]
        if len(shape) == 2:
            _carry_rows(run, key, name, upd.reshape(shape))
        else:
            v = B.tensor(name).double() + torch.from_numpy(
                upd.reshape(shape)).double()
            store.put(key, v.to(run.dtype))
        run.carried[name] = key
    try:
        with Transfer(ctx=run.ctx) as t:
            t.set_file("source_base", run.A.path)
            t.set_file("source_tuned", run.At.path)
            t.set_file("target_base", B.path)
            # a partial run writes nothing, but names an output as a run
            t.set_file("output", os.path.join(
                run.store.folder or tempfile.gettempdir(),
                ".bico-partial-%d.safetensors" % os.getpid()))
            t.set("method", "bico")
            t.set("alpha", run.alpha)
            t.set("norm_map", "act")
            for mod, xc in stats.items():
                t.set_xcov(mod, "in", xc)
            t.set_partial(names, sink)
            t.run()
    finally:
        for xc in stats.values():
            xc.close()
    if run.ranks.size > 1:   # carried from the same bytes on every rank
        run.ranks.same("the carried values of %s" % ", ".join(sorted(got)),
                       [x for n in sorted(got) for x in
                        _pieces(run.store, run.carried[n])])
    return got


def _pieces(store, key, rows=8192):
    """A stored tensor a piece of rows at a time (a table is never read
    whole)."""
    shape = store.shape(key)
    if len(shape) != 2:
        yield store.get(key)
        return
    n = shape[0]
    for r0 in range(0, n, rows):
        yield store.slice(key, r0, min(n, r0 + rows))


def _carry_rows(run, key, name, upd, chunk_bytes=64 << 20):
    """theta_B + update of a 2-D table (the embedding), a piece of rows at
    a time into the store (never two copies of the table)."""
    B = run.B
    rows, width = upd.shape
    n = max(1, chunk_bytes // max(1, width * 8))
    run.store.reserve(key, (rows, width), run.dtype)
    for r0 in range(0, rows, n):
        r1 = min(rows, r0 + n)
        base = torch.from_numpy(B.file.get_range(
            name, r0 * width, (r1 - r0) * width, np.float64)).reshape(
                r1 - r0, width)
        if run.dtype != torch.float64:
            base = base.to(B._want(name)).double()
        v = base + torch.from_numpy(upd[r0:r1]).double()
        run.store.write_rows(key, r0, v.to(run.dtype))


# ---- the backward sweep ----

def head_grads(run, folder, hkey, gkey):
    """The loss gradient at the last block's output of every batch (the
    head and the final norm read whole, the logits in chunks of tokens):
    (gkey, L, b)."""
    L = folder.L
    w = folder.tensor(folder.head_name())
    norm = _fam.RMSNorm(folder.tensor("model.norm.weight"),
                        folder.cfg["eps"], folder.cfg["gemma"])
    for b, (x, y) in enumerate(run.batches):
        h = run.store.get((hkey, L, b))
        run.store.put((gkey, L, b), top_grad(norm, w, h, y,
                                             run.logits_budget))
    del w


def top_grad(norm, w, h, y, budget=LOGITS_BUDGET):
    """d(mean next-token loss)/dh for final hidden states h [B, T, d]:
    the loss of the in-memory route (next_token_loss on the whole batch)
    when its logits fit in budget bytes, else the same sum a chunk of
    tokens at a time (the logits' rows do not depend on each other)."""
    V = w.shape[0]
    n = h.shape[0] * h.shape[1]
    rows = max(1, budget // max(1, V * 4))
    if rows >= n:
        hh = h.detach().requires_grad_(True)
        logits = F.linear(norm(hh), w)
        loss = F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1))
        return torch.autograd.grad(loss, hh)[0]
    hf, yf = h.detach().reshape(n, -1), y.reshape(-1)
    out = torch.empty_like(hf)
    for r0 in range(0, n, rows):
        hc = hf[r0:r0 + rows].clone().requires_grad_(True)
        lc = F.linear(norm(hc), w)
        loss = F.cross_entropy(lc.float(), yf[r0:r0 + rows],
                               reduction="sum") / n
        out[r0:r0 + rows] = torch.autograd.grad(loss, hc)[0]
    return out.reshape(h.shape)


def block_backward(layer, h, pe, mask, g, keep=None, hooked=True):
    """(gradient at the block's input, ...): the block's forward
    recomputed from its input h with gradients, then its backward from
    g, the gradient at its output.  keep (a dict) receives "grad" {linear:
    its output's gradient}, "out" {linear: its output} and "stages" (all
    detached).  The gradients are taken as the in-memory collector takes
    them (bico.torch.collect): full backward hooks on every linear and
    norm (the nodes they add decide the order in which autograd sums the
    contributions to a shared input, q/k/v's), so that the values agree
    bit for bit; the parameters' gradients are not computed.  hooked
    False: a source block no target block pairs with, which the collector
    does not hook (keep must then be None)."""
    hh = h.detach().requires_grad_(True)
    outs, grads, hooks = {}, {}, []
    for n, m in layer.named_modules() if hooked else ():
        if isinstance(m, torch.nn.Linear) or isinstance(m, _fam.RMSNorm):
            hooks.append(m.register_full_backward_hook(
                lambda m, gi, go, n=n: grads.__setitem__(n, go[0])))
    try:
        with torch.enable_grad():
            st = stages(layer, hh, pe, mask, keep=outs)
            gh = torch.autograd.grad(st["out"], hh, g)[0]
    finally:
        for x in hooks:
            x.remove()
    if keep is not None:
        keep["grad"] = {n: grads[n] for n in outs}
        keep["out"] = {n: outs[n].detach() for n in outs}
        keep["stages"] = {k: v.detach() for k, v in st.items()}
    return gh


def backward_sweep(run, folder, hkey, gkey):
    """Gradients at every block output of a model (gkey, i, b) for i =
    L .. 1: the head's, then each block's backward from its saved input
    (the block read once, the batches through it)."""
    head_grads(run, folder, hkey, gkey)
    partners = set(run.depth) if folder is run.A else None
    for i in range(folder.L - 1, 0, -1):
        layer = folder.layer(i)
        for b, (x, _) in enumerate(run.batches):
            pe, mask = run.pe(folder, x.shape[1])
            g = block_backward(layer, run.store.get((hkey, i, b)), pe, mask,
                               run.store.get((gkey, i + 1, b)),
                               hooked=partners is None or i in partners)
            run.store.put((gkey, i, b), g)
        del layer
    run.log("statistics: gradients of %s (%d blocks)" % (folder.path,
                                                          folder.L))
