"""bico.torch: calibration statistics from PyTorch models, streamed into
libbico accumulators.

    import bico.torch as bt
    col = bt.collect_statistics(source, target, batches, loss_fn,
                                path="stats.safetensors")
    new_sd = bt.transfer_state_dict(source.state_dict(), tuned_sd,
                                    target.state_dict(), col)

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
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ._baseline import naive as _naive
from ._ctx import Context
from ._procrustes import Procrustes
from ._status import BicoError, E_ARG, E_NOTFOUND, E_SHAPE, E_STATE
from ._votes import Votes
from ._xcov import XCov
from ._args import plain as _as_numpy
from ._names import Pairing
from . import safetensors as _st
from ._enums import DEFAULT_SPLIT, METHODS as _C_METHODS
from ._names import split_for as _split_for
from .transfer import transfer_state_dict as _transfer_np

__all__ = ["Collector", "collect_statistics", "collect_votes", "save_votes",
           "transfer_state_dict", "transfer_model", "choose_alpha",
           "default_modules", "progress"]


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
                               dout_b, k)

    def _add_stat(self, mb, ma, din_a, din_b, dout_a, dout_b, k,
                  pre_split=False):
        mk = lambda a, b: XCov(a, b, ctx=self.ctx, **self.flags)
        xin = mk(din_a, din_b)
        self.acc[mb + ".in_xcov"] = xin
        self._taps[mb + ".in"] = (xin, ma + ".in", None)
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


# ---- transfer ----

def transfer_state_dict(source_base, source_tuned, target_base, stats=None,
                        method="bico", alpha=1.0, **options):
    """A new target state dict: theta_B + alpha * tau_B.  stats: a
    Collector, a statistics dict, or a statistics file path.  What comes
    out follows bico.transfer.transfer_state_dict's rule: each value has
    the kind of target_base's value (a torch tensor of the same dtype on
    the same device for a torch tensor, so that load_state_dict takes the
    result; a NumPy array for a NumPy array).  See there for the options
    (norm_map, split, ties, votes, rank_tol, null, ...)."""
    if isinstance(stats, Collector):
        options.setdefault("split", stats.split)
        stats = stats.statistics()
    return _transfer_np(source_base, source_tuned, target_base, stats,
                        method=method, alpha=alpha, **options)


# ---- whole models ----

# the library's methods, then the fits this module adds
MODEL_METHODS = tuple(_C_METHODS) + ("fit", "proxy-fit", "proxy-distill")
_PROCRUSTES_KEYS = ("rank_tol", "null", "center", "whiten", "method",
                    "completion")


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


def transfer_model(source, source_tuned, target, batches, method="fit",
                   loss_fn=None, alpha=None, step=None, forward=None,
                   modules=None, split=None, ties=None, norm_map="act",
                   votes=None, gradfix_mode="majority", source_blocks=None,
                   target_blocks=None, ridge=1e-2, shared_out=(),
                   tied="carry", report=None, show_progress=False,
                   holdout="auto", alpha_grid=None, proxy_steps=8,
                   distill_steps=400, distill_lr=2e-3, distill_every=25,
                   threads=None, ridge_prior="zero", general_batches=None,
                   **options):
    """A new state dict for target (torch tensors, the target's names and
    dtypes) carrying the fine-tune source -> source_tuned to target.

    source, source_tuned, target: nn.Modules (source and source_tuned of one
    architecture).  batches: the calibration batches, iterated several
    times (a list is safest); a batch is what Collector.collect takes.
    loss_fn / step: the calibration loss, for BiCo's gradient statistics and
    GradFix's votes.  forward(model, batch): the model's output on a batch
    (default: model(x) for (x, y), model(**batch), model(batch)).

    method: bico | bico-in | bico-out (maps from statistics collected here),
    gradfix (votes collected here on the target unless votes= is given),
    naive, pad, or fit: the sequential functional fit (METHODS.md), block by
    block; every nn.Linear of the target with a Linear source partner gets
    its update by the library's fit (bico.fit.run) with ridge c = ridge;
    everything else (norms, tokens, embeddings, nn.MultiheadAttention) is
    carried by BiCo.
    ridge may be a list with alpha="heldout": one fit per value, the
    (ridge, alpha) pair with the least held-out loss is kept (report:
    "ridge", "ridge_losses").  ridge="gcv" (fit): each layer's c chosen
    in closed form by generalised cross-validation (report: per layer
    "ridge").  ridge_prior (fit): "zero" (default) or "bico": the ridge
    pulls each layer's update towards BiCo's update of the layer instead
    of towards zero, so that where the rows say little the fit falls back
    to BiCo.  general_batches (fit): batches of general text (as batches);
    the ridge's identity becomes the second moment of each layer's inputs
    on them (the target's own, scaled to trace d_in), so the penalty is
    the change of the layer's outputs on general text.
    proxy-fit: the fit (at its held-out alpha), then its nn.Linear layers
    moved towards the proxy-tuned distribution softmax(z_B + z_A_ft - z_A)
    (the logits of the three models on the same tokens, one vocabulary):
    per step, each layer's update is the ridge solution (ridge) of X dW =
    -G, G the gradient of KL(proxy || working target) with respect to its
    output, and the step size is the candidate of alpha_grid (default 0,
    0.1, 0.3, 1, 3, 10, 30, 100) with the least held-out loss; at most
    proxy_steps steps, stopping at a step of 0.  Needs held-out batches
    (alpha="heldout", the default); norms and embeddings stay the fit's.
    proxy-distill: the target (every floating parameter) trained
    towards the proxy-tuned distribution on the calibration batches that
    are not held out: Adam (distill_lr) on KL(proxy || target), one batch
    per step, at most distill_steps steps; every distill_every steps the
    held-out loss is measured, and the best state (the untouched target
    included) is returned.  Same vocabulary needed.
    threads (fit, bico*): the library's thread count (BICO_CTX_THREADS)
    for the statistics and the fit's solves; None (default): the
    library's context default (1).
    shared_out (fit): target modules whose outputs are in the same
    coordinates as their source partner's (a classifier head over the same
    classes): D is used as it is, no output map.

    Tied weights: state-dict entries of the target that are one tensor (an
    lm_head whose weight is embed_tokens.weight) are carried as one: every
    method sees the first owner that is not an nn.Linear (the embedding),
    and the result holds the same tensor object under every name.  tied
    (fit): "carry" (default) leaves a tied nn.Linear to BiCo's carried
    embedding; "fit" fits it in its segment (tokens kept as tokens: no
    output map when both vocabularies have the same size), and the fitted
    weight is also the embedding's.
    alpha: a positive number, "heldout", or "match" / "entropy" to choose
    it without labels (choose_alpha on the calibration batches; "match"
    and "entropy" not for fit, which scales the output change D by alpha
    and sets its own size).  "heldout": the update is computed from the
    calibration batches that are not held out (holdout=), then scaled by
    the candidate of alpha_grid (default 0, 0.25, 0.5, 0.75, 1, 1.5, 2)
    with the least loss on the held-out batches; 0 (the untouched target)
    is a candidate, so the result is never worse there than doing nothing.
    Default (None): "heldout" for fit, bico, bico-in, bico-out,
    proxy-fit and proxy-distill (which need it) when
    there are at least 3 batches and a held-out loss can be computed
    (loss_fn, step, a dict batch with labels, or token ids: next-token
    cross-entropy of the logits); 1 otherwise.
    holdout: which calibration batches alpha="heldout" holds out: a
    fraction in (0, 1) of them, the last ones (default "auto": 0.25, at
    least one), or a list of batches to hold out (then every batch of
    batches computes the update).  Held-out batches never compute the
    update.
    alpha_grid: the candidate scales for alpha="heldout" (numbers >= 0).
    The other options (split, ties, norm_map, source_blocks, target_blocks,
    rank_tol, null, center, whiten, ...) are those of transfer_state_dict.
    report: a list that receives one dict per target tensor (fit: one per
    fitted layer, with rows, rank and update_norm; and a dict with "alpha"
    and "rule" when it was chosen; for "heldout" also "losses" {candidate:
    held-out loss}, "zero_shot" (the untouched target's held-out loss),
    "heldout_batches" and "fit_batches").
    """
    if method not in MODEL_METHODS:
        raise BicoError(E_ARG, "transfer_model: unknown method %r (known: "
                        "%s)" % (method, ", ".join(MODEL_METHODS)))
    for name, m in (("source", source), ("source_tuned", source_tuned),
                    ("target", target)):
        if not isinstance(m, nn.Module):
            raise BicoError(E_ARG, "transfer_model: %s must be an nn.Module, "
                            "got %s" % (name, type(m).__name__))
    batches = list(batches)
    if not batches:
        raise BicoError(E_ARG, "transfer_model: no calibration batches")
    grid = _alpha_grid(alpha_grid)
    if method == "proxy-fit" and alpha_grid is None:
        from .torch_fit import PROXY_GRID
        grid = list(PROXY_GRID)
    if not (isinstance(proxy_steps, int) and not isinstance(proxy_steps, bool)
            and proxy_steps >= 1):
        raise BicoError(E_ARG, "transfer_model: proxy_steps must be an "
                        "integer >= 1, got %r" % (proxy_steps,))
    for name, v, lo in (("distill_steps", distill_steps, 1),
                        ("distill_every", distill_every, 1)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
            raise BicoError(E_ARG, "transfer_model: %s must be an integer "
                            ">= %d, got %r" % (name, lo, v))
    if not (isinstance(distill_lr, (int, float)) and not isinstance(
            distill_lr, bool) and math.isfinite(distill_lr)
            and distill_lr > 0):
        raise BicoError(E_ARG, "transfer_model: distill_lr must be a "
                        "positive number, got %r" % (distill_lr,))
    loss_of = _heldout_loss_fn(loss_fn, step, forward or _default_forward)
    alpha, fit_b, held_b = _resolve_heldout(method, alpha, holdout, batches,
                                            loss_of, alpha_grid)
    auto = alpha if isinstance(alpha, str) else None
    if auto is not None and auto not in ("match", "entropy", "heldout"):
        raise BicoError(E_ARG, "transfer_model: alpha must be a positive "
                        "number, 'heldout', 'match' or 'entropy', got %r"
                        % (alpha,))
    if auto in ("match", "entropy") and method == "fit":
        raise BicoError(E_ARG, "transfer_model: fit takes a numeric alpha "
                        "or 'heldout' (it fits the size of the output "
                        "change itself)")
    if auto is None and not (isinstance(alpha, (int, float))
                             and not isinstance(alpha, bool)
                             and alpha > 0 and math.isfinite(alpha)):
        raise BicoError(E_ARG, "transfer_model: alpha must be a positive "
                        "number, got %r" % (alpha,))
    if tied not in ("carry", "fit"):
        raise BicoError(E_ARG, "transfer_model: tied must be 'carry' or "
                        "'fit', got %r" % (tied,))
    ridges = list(ridge) if isinstance(ridge, (list, tuple)) else [ridge]
    if not ridges or any(not ((isinstance(r, (int, float))
                               and not isinstance(r, bool)
                               and math.isfinite(r) and r >= 0)
                              or (r == "gcv" and method == "fit"))
                         for r in ridges):
        raise BicoError(E_ARG, "transfer_model: ridge must be >= 0 or, "
                        "for fit, 'gcv' (or, for fit with alpha='heldout', "
                        "a list of such), got %r" % (ridge,))
    if ridge_prior not in ("zero", "bico"):
        raise BicoError(E_ARG, "transfer_model: ridge_prior must be 'zero' "
                        "or 'bico', got %r" % (ridge_prior,))
    if (ridge_prior != "zero" or general_batches is not None) \
            and method != "fit":
        raise BicoError(E_ARG, "transfer_model: ridge_prior and "
                        "general_batches are options of method='fit', not "
                        "of %r" % (method,))
    if general_batches is not None:
        general_batches = list(general_batches)
        if not general_batches:
            raise BicoError(E_ARG, "transfer_model: general_batches is "
                            "empty (give general-text batches, or None for "
                            "the identity penalty)")
    fopts = dict(ridge_prior=ridge_prior, general_batches=general_batches)
    if len(ridges) > 1 and (method != "fit" or auto != "heldout"):
        raise BicoError(E_ARG, "transfer_model: a list of ridge values is "
                        "chosen among on held-out batches: it needs "
                        "method='fit' and alpha='heldout'")
    a0, a1 = source.state_dict(), source_tuned.state_dict()
    if set(a0) != set(a1) or any(a0[k].shape != a1[k].shape for k in a0):
        raise BicoError(E_SHAPE, "transfer_model: source and source_tuned "
                        "have different parameters")
    b0 = target.state_dict()
    groups = _tied_groups(target)
    forward = forward or _default_forward
    topts = dict(norm_map=norm_map, split=split, ties=ties,
                 source_blocks=source_blocks, target_blocks=target_blocks,
                 gradfix_mode=gradfix_mode, **options)
    if method == "proxy-distill":
        from . import torch_fit
        rep = [] if report is None else report
        new, _ = torch_fit.proxy_distill(
            source, source_tuned, target, fit_b, held_b,
            lambda m, b: _output(_on(forward, _device(m))(m, b)),
            lambda m, bs: _batch_losses(m, bs, loss_of), distill_steps,
            distill_lr, distill_every, rep)
        _report_tied(rep, groups)
        out = {k: new[k].cpu() for k in new}
        return _retied(out, b0, groups)
    if method == "proxy-fit":
        from . import torch_fit
        rep = [] if report is None else report
        tied_keys = set(k for o, al in groups for k in [o] + al)
        skip = set(n for n, m in target.named_modules()
                   if isinstance(m, nn.Linear) and any(
                       (n + "." + p) in tied_keys
                       for p, _ in m.named_parameters(recurse=False)))
        # the start: the fit at its held-out alpha (same batches)
        start = transfer_model(
            source, source_tuned, target, fit_b, method="fit",
            loss_fn=loss_fn, step=step, forward=forward, modules=modules,
            split=split, ties=ties, norm_map=norm_map,
            source_blocks=source_blocks, target_blocks=target_blocks,
            ridge=ridges[0], shared_out=shared_out, tied=tied, report=rep,
            show_progress=show_progress, holdout=held_b, threads=threads,
            **options)
        new = torch_fit.proxy_fit(
            source, source_tuned, target, fit_b, held_b, None,
            lambda m, b: _output(_on(forward, _device(m))(m, b)),
            lambda m, bs: _mean_loss(m, bs, loss_of), ridges[0], grid,
            proxy_steps, skip, rep, start=start)
        return _retied({k: v.cpu() for k, v in new.items()}, b0, groups)
    col = None
    if method.startswith("bico") or method == "fit":
        col = collect_statistics(source, target, fit_b, loss_fn,
                                 modules=modules, split=split, step=step,
                                 source_blocks=source_blocks,
                                 target_blocks=target_blocks,
                                 sums=bool(options.get("center")),
                                 grams=bool(options.get("whiten")),
                                 show_progress=show_progress,
                                 **({} if threads is None
                                    else {"threads": threads}))
    if method == "gradfix" and votes is None:
        votes = collect_votes(target, fit_b, loss_fn, step=step,
                              mean=gradfix_mode == "mean",
                              show_progress=show_progress)
    try:
        rep = [] if report is None else report
        a = 1.0 if auto else alpha
        if method == "fit" and len(ridges) > 1:
            # each ridge fitted, (ridge, alpha) chosen together
            tried = []
            for r in ridges:
                frep = [] if report is not None else None
                new = _fit(source, source_tuned, target, fit_b, forward,
                           col, a0, a1, b0, a, r, topts, frep,
                           show_progress, tuple(shared_out or ()), groups,
                           tied, threads, **fopts)
                delta = {k: new[k].float() - b0[k].detach().float().cpu()
                         for k in b0 if k in new
                         and new[k].is_floating_point()}
                best, scores = choose_alpha(
                    source, source_tuned, target, delta, held_b,
                    rule="heldout", forward=forward, grid=grid,
                    loss_fn=loss_fn, step=step)
                tried.append((scores[best], r, best, scores, delta, frep))
            i = min(range(len(tried)), key=lambda j: (tried[j][0], j))
            _, r, best, scores, delta, frep = tried[i]
            if report is not None:
                report.extend(frep)
            rep.append({"alpha": best, "rule": "heldout", "losses": scores,
                        "zero_shot": scores.get(0.0, _mean_loss(
                            target, held_b, loss_of)),
                        "ridge": r, "ridge_losses": {
                            t[1]: t[0] for t in tried},
                        "heldout_batches": len(held_b),
                        "fit_batches": len(fit_b)})
            return _retied(_apply(b0, delta, best), b0, groups)
        if method == "fit":
            new = _fit(source, source_tuned, target, fit_b, forward, col,
                       a0, a1, b0, a, ridges[0], topts, report,
                       show_progress, tuple(shared_out or ()), groups, tied,
                       threads, **fopts)
            if auto is None:
                return new
            delta = {k: new[k].float() - b0[k].detach().float().cpu()
                     for k in b0 if k in new
                     and new[k].is_floating_point()}
        else:
            new, delta = transfer_state_dict(
                *(_untied(d, groups) for d in (a0, a1, b0)), stats=col,
                method=method, alpha=a, votes=votes, report=rep,
                return_delta=True, **topts)
            _report_tied(rep, groups)
            if auto is None:
                return _retied(new, b0, groups)
            delta = _retied(delta, b0, groups)
        if auto == "heldout":
            best, scores = choose_alpha(source, source_tuned, target, delta,
                                        held_b, rule="heldout",
                                        forward=forward, grid=grid,
                                        loss_fn=loss_fn, step=step)
            zero = scores[0.0] if 0.0 in scores else \
                _mean_loss(target, held_b, loss_of)
            rep.append({"alpha": best, "rule": "heldout",
                        "losses": scores, "zero_shot": zero,
                        "heldout_batches": len(held_b),
                        "fit_batches": len(fit_b)})
        else:
            best, _ = choose_alpha(source, source_tuned, target, delta,
                                   batches, rule=auto, forward=forward)
            rep.append({"alpha": best, "rule": auto})
        return _retied(_apply(b0, delta, best), b0, groups)
    finally:
        if col is not None:
            col.close()


def _tied_groups(model):
    """[(owner, [aliases])]: state-dict entries that are one tensor (the
    same Parameter under two names, or views of the same memory with the
    same shape and strides).  The owner is the first entry whose module is
    not an nn.Linear (the embedding of a tied lm_head), else the first."""
    sd = model.state_dict(keep_vars=True)
    linear = set()
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            linear.update((n + "." if n else "") + p
                          for p, _ in m.named_parameters(recurse=False))
    by = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor) or v.numel() == 0 \
                or v.device.type == "meta":
            continue
        key = (str(v.device), v.data_ptr(), tuple(v.shape),
               tuple(v.stride()), v.dtype)
        by.setdefault(key, []).append(k)
    groups = []
    for names in by.values():
        if len(names) > 1:
            owner = next((n for n in names if n not in linear), names[0])
            groups.append((owner, [n for n in names if n != owner]))
    return groups


def _untied(sd, groups):
    """sd without the aliases of tied groups (Hugging Face's file
    convention: a tied lm_head.weight is not written)."""
    drop = set(a for _, al in groups for a in al)
    return {k: v for k, v in sd.items() if k not in drop}


def _retied(out, b0, groups):
    """out with every alias holding its owner's tensor (the same object),
    in b0's order."""
    alias = {a: o for o, al in groups for a in al}
    return {k: out[alias.get(k, k)] for k in b0 if alias.get(k, k) in out}


def _report_tied(rep, groups):
    for owner, al in groups:
        for a in al:
            rep.append({"name": a, "handling": "shared", "shares": owner})


def _apply(b0, delta, alpha):
    out = {}
    for k, v in b0.items():
        if k in delta:
            d = torch.as_tensor(np.asarray(delta[k]))
            out[k] = (v.detach().float().cpu() + alpha * d).to(v.dtype)
        else:
            out[k] = v.detach().cpu().clone()
    return out


def _fit(source, source_tuned, target, batches, forward, col, a0, a1, b0,
         alpha, ridge, topts, report, show_progress, shared_out, groups,
         tied, threads=None, ridge_prior="zero", general_batches=None):
    from . import torch_fit
    names = dict(target.named_modules())
    for n in shared_out:
        if not isinstance(names.get(n), nn.Linear):
            raise BicoError(E_NOTFOUND, "transfer_model: shared_out names "
                            "%r, which is no nn.Linear of the target" % (n,))
    try:
        from .fit import run  # noqa: F401 (the fit's driver)
    except ImportError as e:
        raise BicoError(E_STATE, "transfer_model: method fit needs bico.fit "
                        "(%s)" % e)
    procrustes = {k: v for k, v in topts.items() if k in _PROCRUSTES_KEYS}
    maps = col.maps(**procrustes)
    pairing = Pairing(a0, b0, topts.get("source_blocks"),
                      topts.get("target_blocks"))
    # BiCo carries what the fit does not own (norms, tokens, MHA)
    rep = []
    new_bico = transfer_state_dict(*(_untied(d, groups) for d in (a0, a1, b0)),
                                   stats=col, method="bico", alpha=alpha,
                                   report=rep, **topts)
    new_bico = _retied(new_bico, b0, groups)
    _report_tied(rep, groups)
    # a tied nn.Linear (lm_head sharing the embedding): left to BiCo's
    # carried embedding, or fitted from it (tied="fit") with its rows kept
    # as tokens when both vocabularies have the same size
    tied_keys = set(k for o, al in groups for k in [o] + al)
    smods = dict(source.named_modules())
    skip, shared_out = set(), set(shared_out)
    fitted = set()
    for n, m in target.named_modules():
        if not (isinstance(m, nn.Linear) and n in maps):
            continue
        keys = set((n + "." + p) if n else p
                   for p, _ in m.named_parameters(recurse=False))
        if keys & tied_keys:
            if tied == "carry":
                skip.add(n)
                continue
            s = smods.get(pairing.source_name(n))
            if isinstance(s, nn.Linear) and s.out_features == m.out_features:
                shared_out.add(n)
        fitted.update(keys - tied_keys)
    start = {k: (b0[k] if k in fitted else new_bico[k].to(b0[k].device))
             for k in b0}
    freport = [] if report is not None else None
    prior = None
    if ridge_prior == "bico":
        # BiCo's update of each fitted layer's weight (at this alpha)
        prior = {}
        for n, m in target.named_modules():
            k = (n + ".weight") if n else "weight"
            if isinstance(m, nn.Linear) and k in fitted:
                prior[n] = (new_bico[k].detach().double().cpu()
                            - b0[k].detach().double().cpu()).numpy()
    metric = None
    if general_batches is not None:
        metric = _input_moments(target, general_batches,
                                _on(forward, _device(target)))
    # one context for the layers' fits (made and solved one at a time, on
    # this thread), at the caller's thread count
    ctx = Context() if threads is None else Context(threads=threads)
    out = torch_fit.fit_model(
        source, source_tuned, target, batches, _on(forward, _device(target)),
        maps, pairing, start, alpha, ridge, ctx, freport,
        show_progress, tuple(shared_out), skip, prior=prior, metric=metric)
    if report is not None:
        done = set(e["name"] for e in freport)
        report.extend(e for e in rep if e["name"].rsplit(".", 1)[0]
                      not in done or e.get("handling") == "shared")
        report.extend(freport)
    return _retied({k: v.cpu() for k, v in out.items()}, b0, groups)



def _input_moments(model, batches, forward):
    """{name: X^T X} (float64 NumPy) of every nn.Linear's inputs on the
    batches (one forward pass each, hooks only)."""
    acc, hooks = {}, []
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            def hook(mod, inp, out, n=n):
                x = inp[0].detach().reshape(-1, inp[0].shape[-1]).double() \
                    .cpu()
                g = x.T @ x
                acc[n] = g if n not in acc else acc[n] + g
            hooks.append(m.register_forward_hook(hook))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in batches:
                forward(model, b)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return {n: g.numpy() for n, g in acc.items()}


# ---- alpha on held-out calibration batches ----

HELDOUT_GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
_HELDOUT_METHODS = ("fit", "bico", "bico-in", "bico-out", "proxy-fit",
                    "proxy-distill")
_HOLDOUT_AUTO = 0.25


def _alpha_grid(grid):
    """alpha_grid checked: numbers >= 0, sorted, without repeats."""
    if grid is None:
        return list(HELDOUT_GRID)
    try:
        g = [float(x) for x in grid if not isinstance(x, bool)]
        ok = len(g) == len(list(grid)) and len(g) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok or any(not (math.isfinite(x) and x >= 0) for x in g):
        raise BicoError(E_ARG, "transfer_model: alpha_grid must be a "
                        "non-empty list of finite numbers >= 0, got %r"
                        % (grid,))
    return sorted(set(g))


def _token_ids(batch):
    """The token ids of a batch without labels: an integer tensor of at
    least two dimensions [batch, tokens], or a dict's input_ids."""
    x = batch.get("input_ids") if isinstance(batch, dict) else batch
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and \
            not x.is_floating_point() and not x.is_complex() and \
            x.dtype != torch.bool:
        return x
    return None


def _heldout_loss_fn(loss_fn, step, forward):
    """loss(model, batch) -> float for alpha="heldout", or None where a
    batch gives no loss: step, else loss_fn as the calibration uses it,
    else a dict batch's model(**batch).loss (with labels), else next-token
    cross-entropy of the logits on token ids."""
    def loss(model, batch):
        b = _to_device(batch, _device(model))
        if step is not None:
            out = step(model, b)
        elif loss_fn is not None:
            out = _default_step(loss_fn)(model, b)
        elif isinstance(b, dict) and "labels" in b:
            out = model(**b).loss
        else:
            ids = _token_ids(b)
            if ids is None:
                return None
            logits = _output(forward(model, b)).float()
            out = F.cross_entropy(
                logits[..., :-1, :].reshape(-1, logits.shape[-1]),
                ids[..., 1:].reshape(-1).to(logits.device))
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise BicoError(E_ARG, "transfer_model: the held-out loss must "
                            "be a scalar tensor, got %s"
                            % type(out).__name__)
        return float(out)
    loss.static = (step is not None or loss_fn is not None)
    return loss


def _loss_available(loss_of, batch):
    if loss_of.static:
        return True
    if isinstance(batch, dict) and "labels" in batch:
        return True
    return _token_ids(batch) is not None


def _resolve_heldout(method, alpha, holdout, batches, loss_of, grid):
    """(alpha, batches for the update, held-out batches) from the options
    alpha, holdout and alpha_grid (see transfer_model)."""
    explicit_list = isinstance(holdout, list)
    if explicit_list:
        if not holdout:
            raise BicoError(E_ARG, "transfer_model: holdout is an empty "
                            "list of batches")
    elif holdout != "auto" and not (
            isinstance(holdout, (int, float)) and not isinstance(holdout, bool)
            and math.isfinite(holdout) and 0 <= holdout < 1):
        raise BicoError(E_ARG, "transfer_model: holdout must be 'auto', a "
                        "fraction of the calibration batches in [0, 1) or "
                        "a list of held-out batches, got %r" % (holdout,))
    off = not explicit_list and holdout != "auto" and holdout == 0
    given = explicit_list or (holdout != "auto" and not off)
    if alpha is None:
        if off:
            alpha = 1.0
        elif given or (method in _HELDOUT_METHODS and len(batches) >= 3
                       and _loss_available(loss_of, batches[0])):
            alpha = "heldout"
        else:
            alpha = 1.0
    if method.startswith("proxy") and alpha != "heldout":
        raise BicoError(E_ARG, "transfer_model: %s chooses its steps "
                        "on held-out batches: alpha must be 'heldout' "
                        "(default) and holdout not 0, with a loss" % method)
    if alpha != "heldout":
        if given:
            raise BicoError(E_ARG, "transfer_model: holdout applies to "
                            "alpha='heldout' (default), not to alpha=%r"
                            % (alpha,))
        if grid is not None:
            raise BicoError(E_ARG, "transfer_model: alpha_grid applies to "
                            "alpha='heldout' (default), not to alpha=%r"
                            % (alpha,))
        return alpha, batches, []
    if off:
        raise BicoError(E_ARG, "transfer_model: alpha='heldout' needs "
                        "held-out batches, but holdout is 0")
    if explicit_list:
        held, fit_b = holdout, batches
    else:
        frac = _HOLDOUT_AUTO if holdout == "auto" else holdout
        k = max(1, int(round(frac * len(batches))))
        if len(batches) - k < 1:
            raise BicoError(E_ARG, "transfer_model: holdout=%r leaves no "
                            "calibration batch for the update (%d batches)"
                            % (holdout, len(batches)))
        fit_b, held = batches[:-k], batches[-k:]
    if not _loss_available(loss_of, held[0]):
        raise BicoError(E_ARG, "transfer_model: alpha='heldout' needs a "
                        "loss on the held-out batches: pass loss_fn or "
                        "step, or batches of token ids")
    return alpha, fit_b, held


def _mean_loss(model, batches, loss_of):
    vals = _batch_losses(model, batches, loss_of)
    return float(sum(vals) / len(vals))


def _batch_losses(model, batches, loss_of):
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            vals = [loss_of(model, b) for b in batches]
    finally:
        model.train(was)
    if any(v is None for v in vals):
        raise BicoError(E_ARG, "transfer_model: a held-out batch gives no "
                        "loss: pass loss_fn or step")
    return [float(v) for v in vals]


def _scaled(base, delta, g):
    """The state dict theta + g delta: base's tensors, those named in delta
    moved by g times their update (in float32, then in the tensor's own
    dtype).  A non-empty float tensor held on the CPU goes through the
    library's bico_baseline_naive (which refuses an update whose shape is
    not the tensor's; a 0-d tensor as one of shape [1]); one on an
    accelerator stays there (torch), since a round trip to host memory per
    candidate would cost more than the sum."""
    sd = {}
    for k, v in base.items():
        if k not in delta:
            sd[k] = v
        elif v.device.type == "cpu" and v.is_floating_point() and v.numel():
            out = v.float().numpy().copy()
            d = delta[k]
            if out.ndim == 0:  # the library's shapes have a dimension
                out, d = out.reshape(1), np.reshape(_as_numpy(d), -1)
            try:
                _naive(d, out.shape, alpha=g, out=out, beta=1.0)
            except BicoError as e:
                raise BicoError(e.status, "choose_alpha: the update of %s: "
                                "%s" % (k, e.message))
            sd[k] = torch.from_numpy(out.reshape(v.shape)).to(v.dtype)
        else:
            sd[k] = (v.float() + g * torch.as_tensor(
                np.asarray(delta[k])).float().to(v.device)).to(v.dtype)
    return sd


def choose_alpha(source, source_tuned, target, delta, batches, rule="match",
                 forward=None, grid=None, loss_fn=None, step=None):
    """The scale alpha of an update delta ({target tensor: array}) chosen
    without labels on the calibration batches; returns (alpha, {alpha:
    score}).

    rule "match": the smallest alpha at which the output change on the
    target, ||f(theta_B + alpha delta) - f(theta_B)||, reaches the change
    the fine-tune made to the source, ||f_A_ft - f_A||, on the same inputs
    (or the candidate just below it when that is closer in log ratio; the
    closest overall when it never does).  The change saturates for large
    alpha, so the closest overall would be an arbitrary pick among
    near-ties.  rule "entropy": the alpha with the least mean prediction
    entropy of the updated target.  rule "heldout": the alpha with the
    least mean loss on batches (held-out calibration batches: loss_fn /
    step as transfer_model takes them, or next-token cross-entropy on
    token ids) among 0 and the candidates whose mean gain over 0 exceeds
    its standard error over the batches (any gain with one batch); the
    smaller alpha wins a tie.  grid:
    the candidates (default 0.1 .. 8, geometric; "heldout": 0, 0.25, 0.5,
    0.75, 1, 1.5, 2)."""
    if rule not in ("match", "entropy", "heldout"):
        raise BicoError(E_ARG, "choose_alpha: rule must be 'match', "
                        "'entropy' or 'heldout', got %r" % (rule,))
    forward = forward or _default_forward
    batches = list(batches)
    if rule == "heldout":
        return _choose_heldout(target, delta, batches, _alpha_grid(grid),
                               _heldout_loss_fn(loss_fn, step, forward))
    grid = list(grid) if grid is not None else \
        [float(x) for x in np.round(np.geomspace(0.1, 8.0, 25), 4)]
    if not grid or any(not g > 0 for g in grid):
        raise BicoError(E_ARG, "choose_alpha: the grid must hold positive "
                        "numbers")
    import copy
    work = copy.deepcopy(target).eval()
    base = {k: v.detach().clone() for k, v in target.state_dict().items()}
    fb = _on(forward, _device(target))
    with torch.no_grad():
        ref_b = [_output(fb(target.eval(), b)).float() for b in batches]
        if rule == "match":
            fa = _on(forward, _device(source))
            want = sum(float((_output(fa(source_tuned.eval(), b)).float() -
                              _output(fa(source.eval(), b)).float())
                             .pow(2).sum()) for b in batches)
        scores, signed = {}, {}
        for g in grid:
            sd = _scaled(base, delta, g)
            work.load_state_dict(sd)
            outs = [_output(fb(work, b)).float() for b in batches]
            if rule == "match":
                got = sum(float((o - r).pow(2).sum())
                          for o, r in zip(outs, ref_b))
                signed[g] = math.log((got + 1e-30) / (want + 1e-30))
                scores[g] = abs(signed[g])
            else:
                ent = [-(torch.log_softmax(o, -1).exp() *
                         torch.log_softmax(o, -1)).sum(-1).mean()
                       for o in outs]
                scores[g] = float(sum(ent) / len(ent))
    if rule == "match":
        # the output change saturates (and may wobble) past the right
        # size: take the first candidate where it reaches the source's,
        # or the one before it if that is closer, not the global argmin
        grid = sorted(grid)
        for i, g in enumerate(grid):
            if signed[g] >= 0:
                if i and scores[grid[i - 1]] < scores[g]:
                    return grid[i - 1], scores
                return g, scores
    best = min(grid, key=lambda g: scores[g])
    return best, scores


def _choose_heldout(target, delta, batches, grid, loss_of):
    import copy
    if not batches:
        raise BicoError(E_ARG, "choose_alpha: no held-out batches")
    work = copy.deepcopy(target).eval()
    base = {k: v.detach().clone() for k, v in target.state_dict().items()}
    scores, per = {}, {}
    for g in grid:
        sd = _scaled(base, delta, g)
        work.load_state_dict(sd)
        per[g] = _batch_losses(work, batches, loss_of)
        scores[g] = float(sum(per[g]) / len(per[g]))
    # with 0 among the candidates, another one must beat it clearly
    from .torch_fit import _helps
    ok = [g for g in grid if 0.0 not in per or g == 0.0
          or _helps(per[0.0], per[g])]
    best = min(ok, key=lambda g: (scores[g], g))
    return best, scores


# ---- Hugging Face folders, text and adapters (bico/hf.py) ----

from .hf import (load_model, tokenize, text_batches, next_token_loss,  # noqa
                 lm_loss, save_adapter, input_covariances, update_grams,
                 low_rank)
__all__ += ["load_model", "tokenize", "text_batches", "next_token_loss",
            "lm_loss", "save_adapter", "input_covariances", "update_grams",
            "low_rank"]
