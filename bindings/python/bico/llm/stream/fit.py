"""bico.llm.stream.fit: the sequential fit over decoders streamed a block at
a time from their folders (the third sweep of the streamed runner).

The library's driver (bico.fit.run, i.e. bico_fit_run) runs the loop: a
block per target decoder layer, a group per run of linears that read one
input (q/k/v, o, gate/up, down).  _StreamHost's callbacks do what
bico.torch.fit's _FitHost does for nn.Modules, block by block:

  block_begin  reads target block j, its source block i(j) and the tuned
               source's; recomputes the source's and the target's block
               forward and backward from the saved boundary states and
               output gradients (bico.llm.stream.stats) for BiCo's output
               statistics of the block's seven linears, solves their maps
               (R_out) and frees the statistics; keeps the block's rows:
               X_B (the target's inputs) per group and D = Y_At - Y_A
               (the source linears' output change);
  rows_group   advances the working target B' (B with the updates so
               far, the norms BiCo carried) by one stage of the layer's
               forward and adds the group's rows (X', X_B, D R_out);
  update       W + dW into B', handed to the route's sink (the result's
               writer, or the adapter's pair); the library's solve runs on
               the run's context (its thread count);
  block_end    B' runs its last stage: the next block's input.

An untied head over the source's vocabulary (run.fit_head) is one more
block after the decoder's: its inputs are the final norm's outputs (X'
through the carried norm from B''s last states, X_B from B's), its
output change the source pair's logits' (D = z_At - z_A), kept by token
id (the output map the identity: the vocabulary is one coordinate system
on both sides, as BiCo's row rule keeps the embedding's rows; a
Procrustes map of vocabulary x vocabulary gradient statistics, which the
in-memory route solves, is neither affordable at real vocabularies nor
defined for the tokens the calibration text never shows).  The fit
separates over output rows, so the head is fitted a piece of vocabulary
rows at a time (run.logits_budget bytes of logits per batch): one piece's
statistics and logits in memory, never tokens x vocabulary.

B' is computed once per block, a stage per group (no group's input is
recomputed), the source pair once per target block, the target twice
(the forward of the statistics, with its backward, gives X_B).  Rows and
results are those of the in-memory host on the same batches: the fit's
updates equal its updates bit for bit when the maps do."""
import numpy as np
import torch
import torch.nn.functional as F

from ..._procrustes import Procrustes
from ..._xcov import XCov
from ...torch.fit import _carry, _out_map32
from .. import families as _fam
from ..runtime import GROUPS, LINEARS, NORMS, step, test_point
from .stats import _rows, block_backward

__all__ = ["fit_blocks"]


def fit_blocks(run, ridge, alpha=1.0, sink=None, report=None, want_rank=False,
               progress=None):
    """The sequential fit of every target block's linears (bico.fit.run
    over the folders of run, a bico.llm.stream.stats.Run whose sweeps have
    run).  sink(name, info) receives each layer's result: info holds
    "weight" (the new weight, compute dtype), "bias" (or None), "old"
    (the weight before), "inputs" (the X' rows the fit used, per batch,
    float32 tensors).  report: a list receiving one dict per layer (as
    transfer_model's).  progress(name, dw, rank) after each layer."""
    from ...fit import run as _fit_run
    host = _StreamHost(run, alpha, sink, report, progress)
    try:
        _fit_run(0, host.layer, None, host.update, ridge=ridge, ctx=run.ctx,
                 want_rank=want_rank, blocks=run.B.L + (1 if run.fit_head else 0),
                 block_begin=host.block_begin,
                 block_end=host.block_end, group=host.group,
                 rows_group=host.rows_group,
                 solve=host.solve if run.ranks.size > 1 else None)
    finally:
        host.close()
    return host


class _StreamHost(object):
    """fit_blocks' side of bico_fit_run (see the module's doc)."""

    def __init__(self, run, alpha, sink, report, progress):
        self.run, self.alpha, self.sink = run, alpha, sink
        self.report, self.progress = report, progress
        self.proc = Procrustes(ctx=run.ctx)
        self.cur, self.info = {}, {}
        self.at = 0  # the tuned source's states hold block `at`'s input
        emb = run.carried.get(run.B.embed_name())
        for b, (x, _) in enumerate(run.batches):
            run.store.put(("hAt", b), run.embed_rows(run.At, x))
            run.store.put(("hW", b), run.embed_rows(run.B, x, emb))

    def close(self):
        self.proc.close()
        for b in range(len(self.run.batches)):
            self.run.store.pop(("hAt", b))
            self.run.store.pop(("hW", b))
        self.cur.clear()

    def _advance_tuned(self, s):
        run, At = self.run, self.run.At
        while self.at < s:
            layer = At.layer(self.at)
            with torch.no_grad():
                for b, (x, _) in enumerate(run.batches):
                    st = {"h": run.store.get(("hAt", b))}
                    pe, mask = run.pe(At, x.shape[1])
                    for g in range(5):
                        step(layer, st, g, pe, mask)
                    run.store.put(("hAt", b), st["out"])
            self.at += 1

    def block_begin(self, k, first):
        if k == self.run.B.L:
            self.cur = _HeadFit(self.run, first, self._advance_tuned)
            return len(self.cur.pieces)
        run, A, At, B = self.run, self.run.A, self.run.At, self.run.B
        j, s = k, run.depth[k]
        self._advance_tuned(s)
        la, lt, lb = A.layer(s), At.layer(s), B.layer(j)
        pb, pa = "model.layers.%d." % j, "model.layers.%d." % s
        ga = {n: [] for n in LINEARS}
        gb = {n: [] for n in LINEARS}
        d = {n: [] for n in LINEARS}
        xb = {g: [] for g in range(len(GROUPS))}
        for b, (x, _) in enumerate(run.batches):
            T = x.shape[1]
            ka, kb, kt = {}, {}, {}
            block_backward(la, run.store.get(("hA", s, b)), *run.pe(A, T),
                           run.store.get(("gA", s + 1, b)), keep=ka)
            block_backward(lb, run.store.get(("hB", j, b)), *run.pe(B, T),
                           run.store.get(("gB", j + 1, b)), keep=kb)
            with torch.no_grad():
                st = {"h": run.store.get(("hAt", b))}
                for g in range(5):
                    step(lt, st, g, *run.pe(At, T), keep=kt)
            for n in LINEARS:
                ga[n].append(_rows(ka["grad"][n]))
                gb[n].append(_rows(kb["grad"][n]))
                d[n].append(torch.from_numpy(_rows(kt[n])) -
                            torch.from_numpy(_rows(ka["out"][n])))
            for g in range(len(GROUPS)):
                xb[g].append(torch.from_numpy(_rows(kb["stages"]["x%d" % g])))
            del ka, kb, kt, st
        r_out = {n: self._map(ga.pop(n), gb.pop(n)) for n in LINEARS}
        del la, lt
        tensors = lb.state_dict()
        for nm in NORMS:
            key = run.carried.get(pb + nm + ".weight")
            if key is not None:
                tensors[nm + ".weight"] = run.store.get(key)
        work = _fam.decoder_layer(run.B.cfg, {pb + n: v for n, v in
                                              tensors.items()}, j)
        groups, l = {}, first
        for g in GROUPS:
            groups[l] = len(g)
            l += len(g)
        self.cur = dict(j=j, s=s, first=first, pb=pb, pa=pa, d=d, xb=xb,
                        r_out=r_out, work=work, groups=groups,
                        st=[{"h": run.store.get(("hW", b))}
                            for b in range(len(run.batches))], done=0)
        return len(LINEARS)

    def _map(self, ga, gb):
        """R_out of one linear from its gradient rows on both sides: the
        rows' statistic solved (the in-memory collector's route, added a
        batch at a time as it adds them) when the rows outnumber a width,
        else the library's thin solve from the rows (never the d_A x d_B
        statistic, nor its solve's workspace: its identified part is the
        statistic's map, its completion the rows' QR basis)."""
        ranks = self.run.ranks
        n = ranks.total(sum(len(a) for a in ga))
        da, db = ga[0].shape[1], gb[0].shape[1]
        if n > min(da, db):
            xc = XCov(da, db, ctx=self.run.ctx)
            try:
                for a, b in zip(ga, gb):
                    xc.add(a, b)
                m = ranks.xcov_root(xc)   # the ranks' sum, on rank 0
                return ranks.from_root(
                    lambda: (_out_map32(self.proc.solve(m)[0]),))[0]
            finally:
                xc.close()
        # every rank's rows, in the batches' order, solved on rank 0
        pairs = ranks.gather_root(list(zip(self.run.batch_ids,
                                           zip(ga, gb))))
        del ga[:], gb[:]
        return ranks.from_root(lambda: (_out_map32(self.proc.solve_rows(
            np.concatenate([a for a, _ in pairs]),
            np.concatenate([b for _, b in pairs]))[0]),))[0]

    def group(self, l):
        if isinstance(self.cur, _HeadFit):
            return 1
        return self.cur["groups"][l]

    def solve(self, l, fit, want_rank):
        """The driver's solve across ranks: the ranks' statistics summed
        and solved on rank 0, the update sent to every rank
        (bico.llm.ranks)."""
        it = self.info[l]
        return self.run.ranks.fit_solve(fit, it["w"], it["b"], want_rank)

    def layer(self, l):
        cur = self.cur
        if isinstance(cur, _HeadFit):
            self.info[l] = cur.layer(l)
            return self.info[l]["w"], None
        n = LINEARS[l - cur["first"]]
        lin = cur["work"].get_submodule(n)
        w = lin.weight.detach().float().numpy()
        b = lin.bias.detach().float().numpy() if lin.bias is not None \
            else None
        self.info[l] = {"name": cur["pb"] + n, "short": n,
                        "source": cur["pa"] + n, "w": w, "b": b}
        return w, b

    def rows_group(self, l, fits):
        cur, run = self.cur, self.run
        if isinstance(cur, _HeadFit):
            cur.rows(fits[0], self.alpha)
            self.info[l]["rows"] = run.ranks.total(int(fits[0].rows))
            return
        g = [i for i, grp in enumerate(GROUPS)
             if LINEARS[l - cur["first"]] == grp[0]][0]
        with torch.no_grad():  # B' one stage further (this group's input)
            for b, (x, _) in enumerate(run.batches):
                pe, mask = run.pe(run.B, x.shape[1])
                for i in range(cur["done"], g + 1):
                    step(cur["work"], cur["st"][b], i, pe, mask)
            cur["done"] = max(cur["done"], g + 1)
        xs = [_rows(st["x%d" % g]) for st in cur["st"]]
        for i, f in enumerate(fits):
            it = self.info[l + i]
            n = it["short"]
            for bi in range(len(run.batches)):
                x1, x0 = xs[bi], cur["xb"][g][bi].numpy()
                dd = cur["d"][n][bi]
                if dd.shape[0] != x1.shape[0]:
                    raise_rows(it, x1, dd, bi)
                db_ = _carry(dd.numpy(), cur["r_out"][n], self.alpha)
                f.add(np.ascontiguousarray(x1), np.ascontiguousarray(x0),
                      db_)
            it["rows"] = run.ranks.total(int(f.rows))   # every rank's
            it["group"] = g
            cur["d"][n] = None
            cur["r_out"][n] = None
        cur["xb"][g] = None

    def update(self, l, dw, dbias, rk):
        test_point("fit", l)
        it = self.info.pop(l)
        cur = self.cur
        if isinstance(cur, _HeadFit):
            done = cur.update(it, dw, rk)
            if done is not None:
                self._head_done(it, done)
            return
        lin = cur["work"].get_submodule(it["short"])
        old = lin.weight.detach()
        with torch.no_grad():
            lin.weight = torch.nn.Parameter(torch.from_numpy(
                it["w"] + dw).to(old.dtype), requires_grad=False)
            if it["b"] is not None:
                lin.bias = torch.nn.Parameter(torch.from_numpy(
                    it["b"] + dbias).to(lin.bias.dtype), requires_grad=False)
        if self.sink is not None:
            g = it["group"]
            self.sink(it["name"], {
                "weight": lin.weight.detach(), "old": old,
                "bias": None if lin.bias is None else lin.bias.detach(),
                "inputs": [st["x%d" % g] for st in cur["st"]]})
        if self.report is not None:
            self.report.append({
                "name": it["name"], "source": it["source"], "handling": "fit",
                "rows": it["rows"], "rank": None if rk is None else int(rk),
                "update_norm": float(np.sqrt(
                    np.sum(np.square(dw)) + (0.0 if dbias is None else
                                             np.sum(np.square(dbias)))))})
        if self.progress is not None:
            self.progress(it["name"], dw, rk)

    def _head_done(self, it, head):
        """The head's pieces all fitted: the sink, the report and the
        progress line see it as one layer."""
        if self.sink is not None:
            self.sink(it["name"], {"weight": head.new, "old": head.old,
                                   "bias": None, "inputs": head.xw})
        if self.report is not None:
            self.report.append({
                "name": it["name"], "source": it["source"], "handling": "fit",
                "rows": it["rows"], "rank": head.rank, "outputs": "by id",
                "update_norm": float(np.sqrt(head.ss))})
        if self.progress is not None:
            # the shape is what a progress line reads (no copy of dW)
            self.progress(it["name"], np.broadcast_to(
                np.float32(0), tuple(head.old.shape)), head.rank)
        head.close()

    def block_end(self, k):
        cur, run = self.cur, self.run
        if isinstance(cur, _HeadFit):
            self.cur = {}
            return
        with torch.no_grad():
            for b, (x, _) in enumerate(run.batches):
                st = cur["st"][b]
                pe, mask = run.pe(run.B, x.shape[1])
                for g in range(cur["done"], 5):
                    step(cur["work"], st, g, pe, mask)
                run.store.put(("hW", b), st["out"])
        self.cur = {}


class _HeadFit(object):
    """The untied head's block of the fit (see the module's doc): its
    pieces of vocabulary rows are the block's layers, a group each."""

    def __init__(self, run, first, advance_tuned):
        A, At, B = run.A, run.At, run.B
        self.run, self.first = run, first
        advance_tuned(A.L)   # the tuned source's final states
        norm_of = lambda f, w=None: _fam.RMSNorm(  # noqa: E731
            f.tensor("model.norm.weight") if w is None else w,
            f.cfg["eps"], f.cfg["gemma"])
        key = run.carried.get("model.norm.weight")
        nw = norm_of(B, None if key is None else run.store.get(key))
        nb, na, nt = norm_of(B), norm_of(A), norm_of(At)
        self.xw, self.xb, self.ya, self.yt = [], [], [], []
        with torch.no_grad():
            for b in range(len(run.batches)):
                self.xw.append(nw(run.store.get(("hW", b))))
                self.xb.append(nb(run.store.get(("hB", B.L, b))))
                self.ya.append(na(run.store.get(("hA", A.L, b))))
                self.yt.append(nt(run.store.get(("hAt", b))))
        self.name_a, self.name_t = A.head_name(), At.head_name()
        self.old = B.tensor("lm_head.weight")
        self.new = torch.empty_like(self.old)
        V, d = self.old.shape
        n = max([x.shape[0] * x.shape[1] for x, _ in run.batches] + [d])
        step_rows = max(1, min(V, run.logits_budget // (4 * n)))
        self.pieces = [(r0, min(V, r0 + step_rows))
                       for r0 in range(0, V, step_rows)]
        self.ss, self.rank, self.cur = 0.0, None, None

    def layer(self, l):
        r0, r1 = self.pieces[l - self.first]
        self.cur = (r0, r1)
        return {"name": "lm_head", "short": "lm_head",
                "source": self.name_a[:-len(".weight")],
                "w": self.old[r0:r1].float().numpy(), "b": None}

    def rows(self, fit, alpha):
        """One piece's rows: X', X_B and alpha (z_At - z_A) over the
        piece's vocabulary rows, batch by batch."""
        r0, r1 = self.cur
        ids = torch.arange(r0, r1)
        wa = self.run.A.rows(self.name_a, ids)
        wt = self.run.At.rows(self.name_t, ids)
        with torch.no_grad():
            for b in range(len(self.xw)):
                d = _rows(F.linear(self.yt[b], wt)) - \
                    _rows(F.linear(self.ya[b], wa))
                if alpha != 1.0:
                    d = d * np.float32(alpha)
                fit.add(np.ascontiguousarray(_rows(self.xw[b])),
                        np.ascontiguousarray(_rows(self.xb[b])), d)

    def update(self, it, dw, rk):
        """The piece's new rows; the whole head when it was the last."""
        r0, r1 = self.cur
        self.new[r0:r1] = torch.from_numpy(it["w"] + dw).to(self.new.dtype)
        self.ss += float(np.sum(np.square(dw, dtype=np.float64)))
        if rk is not None:
            self.rank = max(int(rk), self.rank or 0)
        return self if r1 == self.pieces[-1][1] else None

    def close(self):
        self.xb = self.ya = self.yt = None


def raise_rows(it, x1, dd, bi):
    from ..._status import BicoError, E_SHAPE
    raise BicoError(E_SHAPE, "streamed fit: %s has %d rows in the target, "
                    "its source %s %d (batch %d): source and target must "
                    "see the same tokens" % (it["name"], x1.shape[0],
                                             it["source"], dd.shape[0], bi))
