"""bico.torch.collect: calibration statistics from PyTorch models, streamed
into libbico accumulators (Collector, collect_statistics), and GradFix's
votes (collect_votes, save_votes).

Each calibration batch runs through the source, then through the target
(both in eval mode, gradients of the loss taken with respect to every
parameter without touching .grad).  Forward hooks take each aligned module's
input activations, full backward hooks the gradient of the loss with respect
to its output; [batch, tokens, d] is flattened to rows.  The source's rows
are held for the current batch only; the target's go straight into the
accumulator C += X_A^T X_B of the pair, so memory is O(d_A d_B) per module
plus one batch of activations.

Aligned modules (default): every nn.Linear, every LayerNorm-like module (a
leaf whose class name contains "Norm", except batch/group/instance norms,
which normalise the channel dimension rather than the last one, with a 1-D
weight) and every nn.MultiheadAttention.  Target modules pair with source
modules by name, inside the repeated blocks by the depth map.  Modules whose
name ends in a key of `split` ({"qkv": 3} by default) are fused projections:
their output gradients are split into equal column blocks, one accumulator
each.

nn.MultiheadAttention calls its projections through
F.multi_head_attention_forward, so hooks on its out_proj never fire.  While
collecting, the module's forward is replaced by an equivalent explicit
computation (checked against the original on the first batch) that exposes
the fused input projection (statistics "M.in_proj", 3 blocks q/k/v) and the
output projection ("M.out_proj").  Supported: batched and unbatched input,
batch_first, attn_mask and key_padding_mask (boolean or additive),
need_weights/average_attn_weights; not supported (an error names the
module): separate kdim/vdim projections, add_bias_kv, add_zero_attn.
"""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .._ctx import Context
from .._procrustes import Procrustes
from .._status import BicoError, E_ARG, E_NOTFOUND, E_SHAPE, E_STATE
from .._votes import Votes
from .._xcov import XCov
from .._names import Pairing
from .. import safetensors as _st
from .._enums import DEFAULT_SPLIT
from .._names import split_for as _split_for, is_vocabulary
from ._common import progress, _to_device, _device, _default_step

__all__ = ["Collector", "collect_statistics", "collect_votes", "save_votes",
           "default_modules"]


# ---- module selection ----

_NOT_LAST_DIM = ("Batch", "Group", "Instance")


def _is_norm(m):
    name = type(m).__name__
    if isinstance(m, nn.LayerNorm):
        return m.elementwise_affine
    if "Norm" not in name or any(s in name for s in _NOT_LAST_DIM):
        return False
    if any(True for _ in m.children()):
        return False
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 1


def _norm_width(m):
    return int(m.weight.numel())


def default_modules(model):
    """Names of the modules aligned by default (see the module doc)."""
    mods = dict(model.named_modules())
    mha_children = set()
    out = []
    for name, m in mods.items():
        if isinstance(m, nn.MultiheadAttention):
            mha_children.update(name + "." + c for c, _ in m.named_modules()
                                if c)
    for name, m in mods.items():
        if name in mha_children:
            continue
        if isinstance(m, (nn.Linear, nn.MultiheadAttention)) or _is_norm(m):
            out.append(name)
    return out


def vocabulary_heads(model):
    """Names of the model's nn.Linear modules whose outputs are a
    vocabulary: the one its get_output_embeddings() returns (transformers'
    convention) and any whose weight is an nn.Embedding's (a tied head).
    Their rows are tokens on both sides.  Those the library also takes as
    a vocabulary by name (lm_head, embed_out, ...: _names.is_vocabulary)
    are never mapped there (docs/formats.md), so the collector takes only
    their input statistics: an output statistic would be V_A x V_B
    doubles, 185 GB at Qwen2's 151936 tokens."""
    emb = set(id(m.weight) for m in model.modules()
              if isinstance(m, nn.Embedding))
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return set(n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and
               (m is head or id(m.weight) in emb))


def _kind(m):
    if isinstance(m, nn.MultiheadAttention):
        return "mha"
    if isinstance(m, nn.Linear):
        return "linear"
    if _is_norm(m):
        return "norm"
    return None


def _dims(m, kind):
    if kind == "linear":
        return m.in_features, m.out_features
    if kind == "norm":
        return _norm_width(m), _norm_width(m)
    return m.embed_dim, m.embed_dim


# ---- helpers ----

def _rows_np(t, copy):
    """A [..., d] tensor as a float32 [rows, d] NumPy array."""
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    if t.device.type != "cpu":
        t = t.cpu()
        copy = False
    t = t.reshape(-1, t.shape[-1])
    a = t.numpy()
    return np.array(a) if copy else a



class _GradMode(object):
    """While collecting: eval mode, every floating parameter requires grad
    (so that every module's backward hook fires); restored afterwards."""

    def __init__(self, *models):
        self.models = models

    def __enter__(self):
        self.training = [(m, m.training) for mod in self.models
                         for m in mod.modules()]
        self.req = [(p, p.requires_grad) for mod in self.models
                    for p in mod.parameters()]
        for mod in self.models:
            mod.eval()
        for p, _ in self.req:
            if p.is_floating_point():
                p.requires_grad_(True)
        return self

    def __exit__(self, *exc):
        for m, t in self.training:
            m.training = t
        for p, r in self.req:
            p.requires_grad_(r)
        return False


def _grads(loss, model):
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise BicoError(E_ARG, "collect: the loss must be a scalar tensor, "
                        "got %s" % (getattr(loss, "shape", type(loss)),))
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


# ---- nn.MultiheadAttention, made visible ----

def _mha_forward(m, tap, check):
    """A forward for module m computing what nn.MultiheadAttention computes,
    with tap(kind, tensor) called on the input-projection inputs ("in"),
    their output gradients ("q", "k", "v"), the output projection's input
    ("o") and output gradient ("og").  Tapped tensors are passed in
    [batch, tokens, E] order."""
    orig = type(m).forward

    def forward(query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        if not m._qkv_same_embed_dim or m.bias_k is not None \
                or m.add_zero_attn:
            raise BicoError(E_ARG, "collect: nn.MultiheadAttention with "
                            "separate kdim/vdim, add_bias_kv or add_zero_attn "
                            "is not supported")
        unbatched = query.dim() == 2
        q_in, k_in, v_in = query, key, value
        if unbatched:
            q_in, k_in, v_in = (x.unsqueeze(1) for x in (q_in, k_in, v_in))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif m.batch_first:
            q_in, k_in, v_in = (x.transpose(0, 1) for x in (q_in, k_in, v_in))
        # [L, N, E] from here on (PyTorch's internal layout)
        E, H = m.embed_dim, m.num_heads
        hd = E // H
        bf = lambda t: t.transpose(0, 1)  # [L, N, E] -> [N, L, E]
        same = lambda t: t is query or (
            t.data_ptr() == query.data_ptr() and t.shape == query.shape
            and t.stride() == query.stride())
        same_kv = same(key) and same(value)
        tap("in", bf(q_in))
        if not same_kv:
            tap("in", bf(k_in))
            tap("in", bf(v_in))
        W, b = m.in_proj_weight, m.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        q = F.linear(q_in, W[:E], bq)
        k = F.linear(k_in, W[E:2 * E], bk)
        v = F.linear(v_in, W[2 * E:], bv)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.requires_grad:
                t.register_hook(lambda g, name=name: tap(name, bf(g)))
        L, N, S = q.shape[0], q.shape[1], k.shape[0]
        qh = q.reshape(L, N * H, hd).transpose(0, 1)
        kh = k.reshape(S, N * H, hd).transpose(0, 1)
        vh = v.reshape(S, N * H, hd).transpose(0, 1)
        scores = torch.bmm(qh, kh.transpose(1, 2)) / math.sqrt(hd)
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(L, S, dtype=torch.bool,
                                   device=q.device).triu(1)
        if attn_mask is not None:
            am = attn_mask if attn_mask.dim() == 3 else attn_mask.unsqueeze(0)
            if am.dtype == torch.bool:
                scores = scores.masked_fill(am, float("-inf"))
            else:
                scores = scores + am
        if key_padding_mask is not None:
            kp = key_padding_mask.view(N, 1, 1, S).expand(N, H, 1, S)
            kp = kp.reshape(N * H, 1, S)
            if kp.dtype == torch.bool:
                scores = scores.masked_fill(kp, float("-inf"))
            else:
                scores = scores + kp
        attn = torch.softmax(scores, dim=-1)
        if m.training and m.dropout > 0:
            attn = F.dropout(attn, p=m.dropout)
        o = torch.bmm(attn, vh).transpose(0, 1).reshape(L, N, E)
        tap("o", bf(o))
        out = F.linear(o, m.out_proj.weight, m.out_proj.bias)
        if out.requires_grad:
            out.register_hook(lambda g: tap("og", bf(g)))
        weights = None
        if need_weights:
            weights = attn.view(N, H, L, S)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if unbatched:
                weights = weights.squeeze(0)
        if unbatched:
            out = out.squeeze(1)
        elif m.batch_first:
            out = out.transpose(0, 1)
        if check[0]:
            check[0] = False
            with torch.no_grad():
                kw = dict(key_padding_mask=key_padding_mask if not unbatched
                          else (None if key_padding_mask is None else
                                key_padding_mask.squeeze(0)),
                          need_weights=False, attn_mask=attn_mask)
                ref = orig(m, query, key, value, **kw)[0]
            err = (ref - out.detach()).abs().max().item()
            scale = ref.abs().max().item() + 1e-12
            if not err <= 1e-4 * scale + 1e-6:
                raise BicoError(E_STATE, "collect: the explicit attention "
                                "for this nn.MultiheadAttention differs from "
                                "its forward by %g (unsupported "
                                "configuration)" % err)
        return out, weights

    return forward


# ---- the collector ----

class _Site(object):
    """One aligned pair: target module name_b with source module name_a."""

    def __init__(self, name_b, name_a, kind, mod_b, mod_a):
        self.name_b, self.name_a, self.kind = name_b, name_a, kind
        self.mod_b, self.mod_a = mod_b, mod_a


class Collector(object):
    """Streams calibration statistics of aligned module pairs into XCov
    accumulators.

    Collector(source, target, modules=None, split=None, sums=False,
              grams=False, threads=1, source_blocks=None, target_blocks=None)

    modules: target module names (default: default_modules(target)), or a
    callable (name, module) -> bool.  split: {suffix: k} of fused
    projections ({"qkv": 3} by default; MHA in_proj always has 3).
    sums/grams: keep what centering/whitening need.  collect(batches,
    loss_fn) may be called several times (statistics add up).
    """

    def __init__(self, source, target, modules=None, split=None, sums=False,
                 grams=False, threads=1, source_blocks=None,
                 target_blocks=None):
        self.source, self.target = source, target
        self.split = dict(DEFAULT_SPLIT if split is None else split)
        self.flags = dict(sums=sums, grams=grams)
        self.ctx = Context(threads=threads)
        mods_a = dict(source.named_modules())
        mods_b = dict(target.named_modules())
        self.pairing = Pairing(dict(source.named_parameters()),
                               dict(target.named_parameters()),
                               source_blocks, target_blocks)
        if modules is None:
            names = default_modules(target)
        elif callable(modules):
            names = [n for n, m in mods_b.items() if modules(n, m)]
        else:
            names = list(modules)
        self.sites = []
        # input statistics only (vocabulary_heads)
        self.vocabulary = set(n for n in vocabulary_heads(target)
                              if is_vocabulary(n))
        mha = [n for n, m in mods_b.items()
               if isinstance(m, nn.MultiheadAttention)]
        for nb in names:
            if nb not in mods_b:
                raise BicoError(E_NOTFOUND, "collect: module %r does not "
                                "exist in the target model" % nb)
            owner = [n for n in mha if nb.startswith(n + ".")]
            if owner:
                raise BicoError(E_ARG, "collect: %r is inside "
                                "nn.MultiheadAttention %r, whose forward "
                                "bypasses its hooks; name %r instead (it "
                                "yields %s.in_proj and %s.out_proj)"
                                % (nb, owner[0], owner[0], owner[0],
                                   owner[0]))
            kb = _kind(mods_b[nb])
            if kb is None:
                raise BicoError(E_ARG, "collect: module %r is a %s, not a "
                                "Linear, norm or MultiheadAttention"
                                % (nb, type(mods_b[nb]).__name__))
            na = self.pairing.source_name(nb)
            if na not in mods_a:
                raise BicoError(E_NOTFOUND, "collect: target module %r pairs "
                                "with source module %r, which does not exist"
                                % (nb, na))
            ka = _kind(mods_a[na])
            if ka != kb:
                raise BicoError(E_ARG, "collect: target module %r is %s but "
                                "its source %r is %s" % (nb, kb, na, ka))
            self.sites.append(_Site(nb, na, kb, mods_b[nb], mods_a[na]))
        self._make_accumulators()
        self.batches = 0

    # accumulators: stat key (e.g. "blocks.0.attn.qkv.out_xcov") -> XCov or
    # [XCov per block]; taps: target tap key -> (XCov, source tap key,
    # column block (i, k) or None)
    def _make_accumulators(self):
        self.acc = {}
        self._taps = {}
        for s in self.sites:
            din_a, dout_a = _dims(s.mod_a, s.kind)
            din_b, dout_b = _dims(s.mod_b, s.kind)
            if s.kind == "mha":
                parts = [(s.name_b + ".in_proj", s.name_a + ".in_proj",
                          din_a, din_b, 3, ("in", "qkv")),
                         (s.name_b + ".out_proj", s.name_a + ".out_proj",
                          din_a, din_b, 1, ("o", "og"))]
                for mb, ma, da, db, k, (tin, tout) in parts:
                    # the q/k/v gradients arrive one block at a time
                    self._add_stat(mb, ma, da, db, da * k, db * k, k,
                                   pre_split=True)
            else:
                k = _split_for(s.name_b, self.split) if s.kind == "linear" \
                    else 1
                self._add_stat(s.name_b, s.name_a, din_a, din_b, dout_a,
                               dout_b, k, out=s.name_b not in self.vocabulary)

    def _add_stat(self, mb, ma, din_a, din_b, dout_a, dout_b, k,
                  pre_split=False, out=True):
        mk = lambda a, b: XCov(a, b, ctx=self.ctx, **self.flags)
        xin = mk(din_a, din_b)
        self.acc[mb + ".in_xcov"] = xin
        self._taps[mb + ".in"] = (xin, ma + ".in", None)
        if not out:
            return
        if k > 1:
            if dout_a % k or dout_b % k:
                raise BicoError(E_SHAPE, "collect: module %s splits into %d "
                                "blocks but its outputs are %d (source) and "
                                "%d (target) wide" % (mb, k, dout_a, dout_b))
            blocks = [mk(dout_a // k, dout_b // k) for _ in range(k)]
            self.acc[mb + ".out_xcov"] = blocks
            for i, x in enumerate(blocks):
                self._taps["%s.out#%d" % (mb, i)] = (
                    x, "%s.out#%d" % (ma, i), None if pre_split else (i, k))
        else:
            xout = mk(dout_a, dout_b)
            self.acc[mb + ".out_xcov"] = xout
            self._taps[mb + ".out"] = (xout, ma + ".out", None)

    # ---- hooks ----

    def _src_tap(self, key, t, cols=None):
        a = _rows_np(t, copy=True)
        if cols is not None:
            i, k = cols
            w = a.shape[1] // k
            a = np.ascontiguousarray(a[:, i * w:(i + 1) * w])
        self._store.setdefault(key, []).append(a)

    def _tgt_tap(self, key, t):
        xc, skey, cols = self._taps[key]
        b = _rows_np(t, copy=False)
        if cols is not None:
            i, k = cols
            w = b.shape[1] // k
            b = b[:, i * w:(i + 1) * w]  # a strided view: no copy
        c = self._count.get(key, 0)
        self._count[key] = c + 1
        src = self._store.get(skey, [])
        if c >= len(src):
            raise BicoError(E_STATE, "collect: %s ran %d times in the target "
                            "but its source %s only %d times in batch %d"
                            % (key, c + 1, skey, len(src), self.batches))
        a = src[c]
        if a.shape[0] != b.shape[0]:
            raise BicoError(E_SHAPE, "collect: %s: the source gave %d rows, "
                            "the target %d (batch %d): source and target must "
                            "see the same tokens" % (key.split("#")[0],
                                                     a.shape[0], b.shape[0],
                                                     self.batches))
        xc.add(a, b)

    def _install(self, model_side):
        hooks, patched = [], []
        seen = set()
        for s in self.sites:
            mod = s.mod_a if model_side == "a" else s.mod_b
            base = s.name_a if model_side == "a" else s.name_b
            if model_side == "a":
                if base in seen:
                    continue  # a source module shared by several targets
                seen.add(base)
            if s.kind == "mha":
                k_in, k_out = base + ".in_proj", base + ".out_proj"
                taps = {"in": [(k_in + ".in", None)],
                        "q": [(k_in + ".out#0", None)],
                        "k": [(k_in + ".out#1", None)],
                        "v": [(k_in + ".out#2", None)],
                        "o": [(k_out + ".in", None)],
                        "og": [(k_out + ".out", None)]}
                fn = self._make_tap(model_side, taps)
                mod.forward = _mha_forward(mod, fn, self._mha_check
                                           .setdefault(id(mod), [True]))
                patched.append(mod)
                continue
            k = _split_for(s.name_b, self.split) if s.kind == "linear" else 1
            outs = [("%s.out#%d" % (base, i), (i, k)) for i in range(k)] \
                if k > 1 else [(base + ".out", None)]
            fn = self._make_tap(model_side, {"in": [(base + ".in", None)],
                                             "out": outs})
            hooks.append(mod.register_forward_hook(
                lambda m, inp, out, fn=fn: fn("in", inp[0])))
            if s.name_b in self.vocabulary:
                continue    # no output statistic: no gradient rows kept
            hooks.append(mod.register_full_backward_hook(
                lambda m, gin, gout, fn=fn: fn("out", gout[0])))
        return hooks, patched

    def _make_tap(self, side, table):
        def fn(kind, t):
            if t is None:
                return
            for key, cols in table[kind]:
                if side == "a":
                    self._src_tap(key, t, cols)
                else:
                    self._tgt_tap(key, t)
        return fn

    def collect(self, batches, loss_fn=None, step=None, show_progress=True,
                total=None):
        """Runs every batch through source then target.  A batch is (x, y)
        (loss = loss_fn(model(x), y)), a dict (loss = loss_fn(model(**b), b),
        or model(**b).loss without loss_fn), or anything step(model, batch)
        -> scalar loss understands."""
        step = step or _default_step(loss_fn)
        dev_a, dev_b = _device(self.source), _device(self.target)
        self._mha_check = getattr(self, "_mha_check", {})
        hooks, patched = [], []
        try:
            with _GradMode(self.source, self.target):
                for side in ("a", "b"):
                    h, p = self._install(side)
                    hooks += h
                    patched += p
                for batch in progress(batches, total, "bico collect",
                                      show_progress):
                    self._store, self._count = {}, {}
                    _grads(step(self.source, _to_device(batch, dev_a)),
                           self.source)
                    _grads(step(self.target, _to_device(batch, dev_b)),
                           self.target)
                    self._check_consumed()
                    self.batches += 1
        finally:
            for h in hooks:
                h.remove()
            for m in patched:
                del m.forward
            self._store, self._count = {}, {}
        self._check_fed()
        return self

    def _check_consumed(self):
        for key, (_, skey, _) in self._taps.items():
            n_src = len(self._store.get(skey, []))
            n_tgt = self._count.get(key, 0)
            if n_src != n_tgt:
                raise BicoError(E_STATE, "collect: %s ran %d times in the "
                                "target, its source %s %d times (batch %d)"
                                % (key, n_tgt, skey, n_src, self.batches))

    def _check_fed(self):
        for key, v in self.acc.items():
            for x in (v if isinstance(v, list) else [v]):
                if x.rows == 0:
                    raise BicoError(E_STATE, "collect: no rows reached %s: "
                                    "the module's hooks never fired (is it "
                                    "used in forward, and does the loss "
                                    "depend on it?)" % key)

    # ---- results ----

    def statistics(self):
        """{"M.in_xcov": XCov, "M.out_xcov": XCov or [XCov per block]}."""
        return dict(self.acc)

    def matrices(self):
        """The statistics as float64 arrays; a split module's out_xcov is
        block-diagonal (its off-diagonal blocks are not accumulated)."""
        out = {}
        for key, v in self.acc.items():
            if isinstance(v, list):
                ms = [x.matrix() for x in v]
                ba, bb = ms[0].shape
                full = np.zeros((ba * len(ms), bb * len(ms)))
                for i, m in enumerate(ms):
                    full[i * ba:(i + 1) * ba, i * bb:(i + 1) * bb] = m
                out[key] = full
            else:
                out[key] = v.matrix()
        return out

    def save(self, path):
        """Writes the statistics file (F64 "M.in_xcov", "M.out_xcov" per
        target module) through libbico's atomic writer."""
        meta = {"bico.format": "statistics", "bico.batches": str(self.batches)}
        for key, v in self.acc.items():
            if isinstance(v, list):
                meta["bico.split." + key[:-len(".out_xcov")]] = str(len(v))
            x = v[0] if isinstance(v, list) else v
            meta["bico.rows." + key] = str(x.rows)
        _st.write(path, self.matrices(), metadata=meta, ctx=self.ctx)
        return path

    def maps(self, **procrustes_options):
        """{module: {"in": (R, rank), "out": (R, rank) or [(R, rank) per
        block]}} solved with bico.Procrustes(**procrustes_options)."""
        res = {}
        with Procrustes(ctx=self.ctx, **procrustes_options) as p:
            for key, v in self.acc.items():
                mod, side = key.rsplit(".", 1)
                side = side[:-len("_xcov")]
                val = [p.solve(x) for x in v] if isinstance(v, list) \
                    else p.solve(v)
                res.setdefault(mod, {})[side] = val
        return res

    def close(self):
        for v in self.acc.values():
            for x in (v if isinstance(v, list) else [v]):
                x.close()


def collect_statistics(source, target, batches, loss_fn=None, path=None,
                       modules=None, split=None, step=None,
                       show_progress=True, **options):
    """Collector(source, target, modules, split, **options).collect(...);
    writes the statistics file when path is given.  Returns the Collector
    (statistics(), matrices(), maps())."""
    col = Collector(source, target, modules=modules, split=split, **options)
    col.collect(batches, loss_fn, step=step, show_progress=show_progress)
    if path is not None:
        col.save(path)
    return col


# ---- GradFix votes ----

def _samples(batch):
    """Splits a batch into single-sample batches (dim 0 of every tensor)."""
    def n_of(x):
        if isinstance(x, torch.Tensor):
            return x.shape[0]
        if isinstance(x, dict):
            return n_of(next(iter(x.values())))
        if isinstance(x, (list, tuple)):
            return n_of(x[0])
        raise BicoError(E_ARG, "collect_votes: cannot split a batch of %s"
                        % type(x).__name__)

    def take(x, i):
        if isinstance(x, torch.Tensor):
            return x[i:i + 1]
        if isinstance(x, dict):
            return {k: take(v, i) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(take(v, i) for v in x)
        return x
    for i in range(n_of(batch)):
        yield take(batch, i)


def collect_votes(model, batches, loss_fn=None, step=None, mean=False,
                  show_progress=True):
    """GradFix votes: for every sample of every batch, the gradient g of the
    loss at the (pretrained target) model's parameters; per parameter
    v += sign(-g).  Returns {parameter name: bico.Votes}."""
    step = step or _default_step(loss_fn)
    dev = _device(model)
    ctx = Context()
    with _GradMode(model):
        named = [(n, p) for n, p in model.named_parameters()
                 if p.requires_grad]
        votes = {n: Votes(tuple(p.shape), mean=mean, ctx=ctx)
                 for n, p in named}
        for batch in progress(batches, None, "bico votes", show_progress):
            for sample in _samples(batch):
                loss = step(model, _to_device(sample, dev))
                grads = _grads(loss, model)
                for (n, p), g in zip(named, grads):
                    if g is None:
                        g = torch.zeros_like(p)
                    votes[n].add(g.detach().float().cpu().numpy())
    return votes


def save_votes(path, votes):
    """Writes a votes file: per parameter, its I32 vote counts."""
    tensors = {n: v.counts() for n, v in votes.items()}
    samples = max((v.samples for v in votes.values()), default=0)
    _st.write(path, tensors, metadata={"bico.format": "votes",
                                       "bico.samples": str(samples)})
    return path
