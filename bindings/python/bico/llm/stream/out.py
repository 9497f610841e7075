"""bico.llm.stream.out: what the streamed fit produced, scored and written a
block at a time.

A Result holds one fit's outcome in the run's spill store: for a model
folder, every fitted tensor's new value; for an adapter, each linear's
rank-r pair (computed as the fit leaves the layer, weighted by the inputs
the fit saw: update_grams' statistic) and the sizes of what an adapter
cannot hold.  The carried tensors (norms, embedding: the run's "carry/")
are shared by every fit of a run.

score()  the held-out next-token loss of the target moved by alpha times
         the result, for every candidate alpha at once: each block read
         once, every candidate's hidden states through it; the head built
         a piece of vocabulary rows at a time, the logits a chunk of
         tokens at a time.  No copy of the model per candidate.
write_model() / write_adapter()  the chosen scale applied block by block
         into the library's folder writer (bico.safetensors.Writer: a
         model folder committed in one step), or the adapter's pairs
         into a folder the caller commits (the run's new folder,
         bico.folder.Run.path).  The values are the in-memory route's
         (bico.llm.command): theta_B + alpha * delta in double, rounded
         once to the file's dtype."""
import math
import os

import torch
import torch.nn.functional as F

from ... import safetensors as _st
from .. import families as _fam
from ..adapters import (balanced_pair, balance, tall_low_rank,
                       adapter_meta, adapter_config, adapter_note,
                       write_adapter_json)
from ..runtime import LINEARS, test_point

__all__ = ["Result", "score", "write_model", "write_adapter"]

_TORCH_OF = {"BF16": torch.bfloat16, "F16": torch.float16,
             "F32": torch.float32, "F64": torch.float64}


class Result(object):
    """One fit's outcome (see the module doc).  kind "model" or "adapter";
    prefix: its keys in the store; rank, saves (modules_to_save) for an
    adapter."""

    def __init__(self, run, prefix, kind="model", rank=16, saves=()):
        self.run, self.prefix, self.kind = run, prefix, kind
        self.rank, self.saves = rank, list(saves)
        self.new = {}    # tensor -> store key of its new value (fitted)
        self.pairs = {}  # module -> (store key of B, of A)
        self.ss = {}     # tensor -> sum of squared update (adapter)

    def sink(self, name, info):
        """bico.llm.stream.fit's sink: one fitted layer."""
        store, p = self.run.store, self.prefix
        w, old = info["weight"], info["old"]
        if self.kind == "model":
            store.put(p + "new/" + name + ".weight", w)
            self.new[name + ".weight"] = p + "new/" + name + ".weight"
            if info["bias"] is not None:
                store.put(p + "new/" + name + ".bias", info["bias"])
                self.new[name + ".bias"] = p + "new/" + name + ".bias"
            return
        if name == "lm_head":
            return self._tall_sink(name, w, old, info["inputs"])
        delta = w.double() - old.double()
        self.ss[name + ".weight"] = float(delta.pow(2).sum())
        if info["bias"] is not None:
            ob = self.run.B.tensor(name + ".bias")
            self.ss[name + ".bias"] = float(
                (info["bias"].double() - ob.double()).pow(2).sum())
        ranks = self.run.ranks
        kind, g = _gram(delta, info["inputs"])
        g = ranks.sum_root(g)   # over every rank's rows
        b, a = ranks.from_root(lambda: tuple(
            t.numpy() for t in balanced_pair(delta, self.rank, (kind, g))))
        b, a = torch.from_numpy(b), torch.from_numpy(a)
        store.put(p + "pairB/" + name, b)
        store.put(p + "pairA/" + name, a)
        self.pairs[name] = (p + "pairB/" + name, p + "pairA/" + name)

    def _tall_sink(self, name, w, old, inputs):
        """An untied head's pair (vocabulary x width): its update read a
        piece of rows at a time, never whole in double
        (adapters.tall_low_rank)."""
        piece = lambda r0, r1: w[r0:r1].double() - old[r0:r1].double()
        rows = w.shape[0]
        self.ss[name + ".weight"] = sum(
            float(piece(r0, min(rows, r0 + 8192)).pow(2).sum())
            for r0 in range(0, rows, 8192))
        ranks = self.run.ranks
        g = ranks.sum_root(_input_gram(inputs))   # _gram's "in" statistic

        def pair():
            if self.ss[name + ".weight"] == 0.0:   # PEFT's no-op
                z = torch.zeros(rows, 0, dtype=torch.float64)
                b, a = balance(z, z.new_zeros(0, w.shape[1]), self.rank)
            else:
                b, a = balance(*tall_low_rank(piece, rows, self.rank, g),
                               self.rank)
            return b.numpy(), a.numpy()
        b, a = (torch.from_numpy(t) for t in ranks.from_root(pair))
        store, p = self.run.store, self.prefix
        store.put(p + "pairB/" + name, b)
        store.put(p + "pairA/" + name, a)
        self.pairs[name] = (p + "pairB/" + name, p + "pairA/" + name)

    def drop(self):
        for k in list(self.new.values()) + [x for v in self.pairs.values()
                                            for x in v]:
            self.run.store.pop(k)
        self.new, self.pairs = {}, {}

    def saved(self, name):
        """Whether carried tensor name is stored whole in an adapter
        (modules_to_save, PEFT's suffix rule)."""
        return any(mod == s or mod.endswith("." + s) for s in self.saves
                   for mod in (n.rsplit(".", 1)[0] for n in
                               self.names_of(name)))

    def names_of(self, name):
        """The names a saved tensor is stored under: a tied embedding
        also as lm_head.weight (PEFT gives each module of
        modules_to_save its own copy: a head not saved beside its
        embedding would not move)."""
        B = self.run.B
        if B.cfg["tied"] and name == B.embed_name():
            return [name, "lm_head.weight"]
        return [name]

    def delta(self, name, base, rows=None):
        """The update of tensor name (float64) scored at alpha 1: the
        in-memory route's delta (model) or the adapter's effective update
        (its pair's product, a saved tensor's delta; None: left out or
        unchanged).  rows (r0, r1): the update of those rows of a 2-D
        tensor only, base those rows (read from the store's rows only:
        a head or a table a piece at a time)."""
        src = self._source(name)
        if src is None:
            return None
        store = self.run.store
        get = store.get if rows is None else \
            (lambda k: store.slice(k, rows[0], rows[1]))
        if src[0] == "pair":
            kb, ka = src[1]
            return (get(kb) * 1.0) @ store.get(ka) * 1.0
        return get(src[1]).double() - base.double()

    def changes(self, name):
        """Whether delta(name, ...) is an update (not None)."""
        return self._source(name) is not None

    def _source(self, name):
        """Where the update of tensor name comes from: ("pair", (store key
        of B, of A)) of an adapter's module, ("value", store key of the new
        value), or None (left out or unchanged)."""
        key = self.new.get(name) or self.run.carried.get(name)
        if self.kind == "adapter":
            mod = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and mod in self.pairs:
                return "pair", self.pairs[mod]
            if name in self.run.carried and self.saved(name):
                return "value", key
            return None
        return None if key is None else ("value", key)


def _gram(delta, inputs):
    """update_grams' statistic of one layer from the rows the fit used:
    ("out", sum (dW x)(dW x)^T) when d_out <= d_in, else ("in", X^T X)."""
    if delta.shape[0] > delta.shape[1]:
        return "in", _input_gram(inputs)
    acc = None
    for x in inputs:
        y = _rows64(x) @ delta.T
        acc = y.T @ y if acc is None else acc.add_(y.T @ y)
    return "out", acc


def _input_gram(inputs):
    """X^T X (float64) of a layer's input rows, batch by batch."""
    acc = None
    for x in inputs:
        x = _rows64(x)
        acc = x.T @ x if acc is None else acc.add_(x.T @ x)
    return acc


def _rows64(x):
    return x.detach().reshape(-1, x.shape[-1]).double()


def _at(base, d, a):
    """theta_B + a * delta, rounded once to base's dtype (the in-memory
    route's _apply)."""
    if d is None:
        return base
    return (base.double() + a * d).to(base.dtype)


# ---- held-out scoring ----

def score(result, held, grid, chunk_rows=8192, windows=None):
    """{alpha: [(mean next-token loss, tokens) per held-out batch]} of the
    target moved by alpha times the result (each batch's loss as
    bico.llm.text.lm_loss computes it); windows, a dict, gets {alpha:
    [mean loss of each held-out window]} (bico.torch.distill.
    window_losses' values)."""
    run, B, store = result.run, result.run.B, result.run.store
    grid = list(grid)
    emb = B.embed_name()
    for b, (x, _) in enumerate(held):
        ids = x.reshape(-1)
        base = B.rows(emb, ids)
        d = _rows_delta(result, emb, ids, base) if _rowwise(result, emb) \
            else None
        for a in grid:
            store.put(("hS", a, b), _fam_embed(B, _at(base, d, a), x))
    for j in range(B.L):
        tensors = B.block(j)
        deltas = {n: result.delta(n, v) for n, v in tensors.items()}
        for a in grid:
            layer = _fam.decoder_layer(B.cfg, {n: _at(v, deltas[n], a)
                                               for n, v in tensors.items()},
                                       j)
            with torch.no_grad():
                for b, (x, _) in enumerate(held):
                    pe, mask = run.pe(B, x.shape[1])
                    h = store.get(("hS", a, b))
                    store.put(("hS", a, b), layer(h, attention_mask=mask,
                                                  position_embeddings=pe)[0])
        del tensors, deltas
    return _score_head(result, held, grid, chunk_rows, windows)


def _rowwise(result, name):
    return name in result.run.carried and (result.kind == "model" or
                                           result.saved(name))


def _rows_delta(result, name, ids, base):
    """The update of the rows ids of a carried table (read from the
    store's rows only)."""
    return result.run.store.rows(result.run.carried[name], ids).double() - \
        base.double()


def _fam_embed(B, rows, x):
    from ..runtime import embed
    return embed(B.cfg, rows.reshape(x.shape[0], x.shape[1], -1))


def _score_head(result, held, grid, chunk_rows, windows):
    run, B, store = result.run, result.run.B, result.run.store
    nw = B.tensor("model.norm.weight")
    dn = result.delta("model.norm.weight", nw)
    hname = B.head_name()
    scores = {}
    for a in grid:
        w = _head_at(result, hname, a, chunk_rows)
        norm = _fam.RMSNorm(_at(nw, dn, a), B.cfg["eps"], B.cfg["gemma"])
        per, win = [], []
        with torch.no_grad():
            for b, (x, y) in enumerate(held):
                h = store.get(("hS", a, b))
                store.pop(("hS", a, b))
                per.append((_batch_loss(norm, w, h, y, run.logits_budget,
                                        win), y.numel()))
        scores[a] = per
        if windows is not None:
            windows[a] = win
        del w
    return scores


def _head_at(result, name, a, chunk_rows):
    """The head at scale a (rows of the table built a piece at a time)."""
    B = result.run.B
    V, d = B.shapes[name]
    if not result.changes(name):
        return B.tensor(name)
    want = B._want(name)
    out = torch.empty((V, d), dtype=want)
    for r0 in range(0, V, chunk_rows):
        r1 = min(V, r0 + chunk_rows)
        base = torch.from_numpy(B.file.get_range(
            name, r0 * d, (r1 - r0) * d)).reshape(r1 - r0, d).to(want)
        out[r0:r1] = _at(base, result.delta(name, base, (r0, r1)), a)
    return out


def _batch_loss(norm, w, h, y, budget, win):
    """One batch's mean next-token loss (the whole batch's logits at once
    when they fit in budget bytes, as lm_loss computes them; else summed
    a chunk of tokens at a time); each window's mean loss appended to
    win."""
    V = w.shape[0]
    n = y.numel()
    rows = max(1, budget // max(1, V * 4))
    if rows >= n:
        logits = F.linear(norm(h), w).reshape(-1, V).float()
        ce = F.cross_entropy(logits, y.reshape(-1), reduction="none")
        win.extend(ce.reshape(y.shape).mean(-1).tolist())
        return float(F.cross_entropy(logits, y.reshape(-1)))
    hf, yf = h.reshape(n, -1), y.reshape(-1)
    tot, ces = 0.0, []
    for r0 in range(0, n, rows):
        lc = F.linear(norm(hf[r0:r0 + rows]), w)
        ce = F.cross_entropy(lc.float(), yf[r0:r0 + rows], reduction="none")
        tot += float(ce.sum())
        ces.append(ce)
    win.extend(torch.cat(ces).reshape(y.shape).mean(-1).tolist())
    return tot / n


# ---- writing ----

def _order(B):
    """The target's tensors in its state dict's order (load_model's), the
    tied head left out (Hugging Face's files omit it)."""
    out = [B.embed_name()]
    for j in range(B.L):
        p = "model.layers.%d." % j
        names = set(B.block_names(j))
        for n in ["input_layernorm.weight"] + \
                ["%s.%s" % (m, t) for m in LINEARS[:4] for t in
                 ("weight", "bias")] + ["post_attention_layernorm.weight"] + \
                ["%s.%s" % (m, t) for m in LINEARS[4:] for t in
                 ("weight", "bias")]:
            if p + n in names:
                out.append(p + n)
        out += sorted(names - set(out))  # anything else, as it comes
    out.append("model.norm.weight")
    if not B.cfg["tied"]:
        out.append("lm_head.weight")
    return out


def write_model(result, dest, alpha, metadata, chunk_rows=8192):
    """The target moved by alpha times the result, written as a model
    folder through the library's writer (like the target: its sharding,
    config and tokenizer; committed in one step), each tensor in its
    file's dtype: theta_B + alpha * delta in double, rounded once."""
    B = result.run.B
    order = _order(B)
    missing = set(B.names) - set(order)
    order += [n for n in B.names if n in missing]
    with _st.Writer(dest, like=B.path, metadata=metadata) as w:
        for n in order:
            w.declare(n, B.dtypes[n], B.shapes[n])
        for i, n in enumerate(order):
            test_point("write", i)
            if len(B.shapes[n]) == 2 and n in (B.embed_name(),
                                               "lm_head.weight"):
                _write_rows(result, w, n, alpha, chunk_rows)
                continue
            base = B.tensor(n)
            d = result.delta(n, base)
            out = base.double() if d is None else base.double() + d * alpha
            w.write(n, _to_file(out, B.dtypes[n]))
        result.run.check_unchanged()
        w.commit()


def _to_file(v, dt):
    """v (float64) in the file's dtype as torch converts (float32 values
    for the writer: exact)."""
    t = v.to(_TORCH_OF.get(dt, torch.float32))
    return t if t.dtype == torch.float64 else t.float()


def _write_rows(result, w, name, alpha, chunk_rows):
    B = result.run.B
    V, d = B.shapes[name]
    want = B._want(name)
    for r0 in range(0, V, chunk_rows):
        r1 = min(V, r0 + chunk_rows)
        base = torch.from_numpy(B.file.get_range(
            name, r0 * d, (r1 - r0) * d)).reshape(r1 - r0, d).to(want)
        out = base.double()
        dw = result.delta(name, base, (r0, r1))
        if dw is not None:
            out = out + dw * alpha
        w.write_range(name, r0 * d, _to_file(out, B.dtypes[name]))


def write_adapter(result, folder, alpha, lora_alpha=None, metadata=None,
                  base_model=None):
    """The result scaled by alpha as a PEFT adapter written into folder
    (an existing, empty folder: the run's new folder, which the caller
    commits), as save_adapter writes it: the factors float32, saved
    tensors in the target's dtypes.  Returns save_adapter's report."""
    r = result.rank
    la = float(r if lora_alpha is None else lora_alpha)
    s = math.sqrt(alpha)
    mods = sorted(result.pairs)
    report = {"modules": mods, "saved": [], "left_out": [], "rank": r}
    tot, lost = _left_out(result, report)
    report["left_out_norm"] = math.sqrt(lost / tot) if tot > 0 and \
        alpha > 0 else 0.0
    meta = adapter_meta(metadata, report["left_out"])
    path = os.path.join(str(folder), "adapter_model.safetensors")
    with _st.Writer(path, metadata=meta) as w:
        _adapter_tensors(result, w, mods, s, r / la, alpha)
        result.run.check_unchanged()
        w.commit()
    short = sorted(set(m.rsplit(".", 1)[-1] for m in mods))
    saved_mods = set(k.rsplit(".", 1)[0] for k in report["saved"])
    cfg = adapter_config(r, la, short, saved_mods, base_model)
    report["config"] = cfg
    note = adapter_note(report, True)
    note.update(metadata or {})
    write_adapter_json(folder, cfg, note)
    return report


def _left_out(result, report):
    """Fills report's saved / left_out as save_adapter does, in the
    target's order (a tied head follows its embedding); returns the
    update's squared size and the part left out (at alpha 1)."""
    run, B = result.run, result.run.B
    tot = lost = 0.0
    tied = B.cfg["tied"]
    for name in _order(B) + (["lm_head.weight"] if tied else []):
        mod = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and mod in result.pairs:
            tot += result.ss.get(name, 0.0)
            continue
        src = B.embed_name() if (tied and name == "lm_head.weight") \
            else name
        sq = result.ss.get(name)
        if sq is None and src in run.carried:
            sq = _carried_sq(result, src)
        if not sq:
            continue
        tot += sq
        if src in run.carried and result.saved(src):
            report["saved"].append(name)
            continue
        report["left_out"].append(name)
        lost += sq
    return tot, lost


def _carried_sq(result, name, chunk_rows=8192):
    """||carried - theta_B||^2 of a carried tensor (a table a piece of rows
    at a time)."""
    run, B = result.run, result.run.B
    key = run.carried[name]
    if len(B.shapes[name]) != 2:
        base = B.tensor(name)
        return float((run.store.get(key).double() - base.double())
                     .pow(2).sum())
    V, d = B.shapes[name]
    want, tot = B._want(name), 0.0
    for r0 in range(0, V, chunk_rows):
        r1 = min(V, r0 + chunk_rows)
        base = torch.from_numpy(B.file.get_range(
            name, r0 * d, (r1 - r0) * d)).reshape(r1 - r0, d).to(want)
        tot += float((run.store.slice(key, r0, r1).double() -
                      base.double()).pow(2).sum())
    return tot


def _adapter_tensors(result, w, mods, s, scale, alpha, chunk_rows=8192):
    """Declares and writes the pairs (scaled by sqrt(alpha) each, B by
    r / lora_alpha; float32, PEFT's convention) and the saved tensors
    (theta_B + alpha delta in the target's dtype, a table a piece of rows
    at a time; a tied embedding under the head's name too)."""
    run, B, store = result.run, result.run.B, result.run.store
    pairs = []
    for m in mods:
        kb, ka = result.pairs[m]
        pairs.append(("base_model.model.%s.lora_A.weight" % m,
                      (store.get(ka) * s).float()))
        pairs.append(("base_model.model.%s.lora_B.weight" % m,
                      (store.get(kb) * s * scale).float()))
    saved = [n for n in _order(B) if n in run.carried and result.saved(n)]
    for k, t in pairs:
        w.declare(k, "F32", tuple(t.shape))
    for n in saved:
        for k in result.names_of(n):
            w.declare("base_model.model." + k, B.dtypes[n], B.shapes[n])
    for i, (k, t) in enumerate(pairs):
        test_point("write", i)
        w.write(k, t.contiguous())
    for n in saved:
        _write_saved(result, w, n, alpha, chunk_rows)


def _write_saved(result, w, n, alpha, chunk_rows):
    """theta_B + alpha delta of carried tensor n under each of its names
    (a table a piece of rows at a time)."""
    run, B, store = result.run, result.run.B, result.run.store
    for k in result.names_of(n):
        key, dt = run.carried[n], _TORCH_OF[B.dtypes[n]]
        if len(B.shapes[n]) != 2:
            base = B.tensor(n)
            v = base.double() + (store.get(key).double() - base.double()) \
                * alpha
            w.write("base_model.model." + k, v.float().to(dt))
            continue
        V, d = B.shapes[n]
        for r0 in range(0, V, chunk_rows):
            r1 = min(V, r0 + chunk_rows)
            base = torch.from_numpy(B.file.get_range(
                n, r0 * d, (r1 - r0) * d)).reshape(r1 - r0, d).to(B._want(n))
            v = base.double() + (store.slice(key, r0, r1).double() -
                                 base.double()) * alpha
            w.write_range("base_model.model." + k, r0 * d,
                          v.float().to(dt).float())
