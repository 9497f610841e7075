"""bico.torch.fit: the host of the library's sequential fit (bico_fit_run,
through bico.fit.run) over PyTorch models: transfer_model(method="fit")
processed block by block as GPTQ does (fit_model); the ridge with a
prior, a penalty metric or a GCV choice is bico.torch.ridge's (RidgeFit).

Four models run side by side on the calibration batches: the source A, the
tuned source A_ft, the original target B and the working target B' (B with
the updates fitted so far).  Each keeps, per batch, only the input of the
segment being processed: the stem (everything before the first block), one
block, or the tail (everything after the last block).  For every nn.Linear
of a target segment, in the order its forward calls them:

  D   = Y_{A_ft,s} - Y_{A,s}   the source partner's output change, each on
                               its own model's forward pass;
  D_B = alpha D R_out          BiCo's output map (per block of a fused qkv);
  X'  = the layer's input on B', X_B its input on B;

and the library solves the ridge problem for [dW db], which is applied to
B' before the next layer's inputs are taken.  Then the segment runs once
more on B' to give the next segment its inputs.  Layers that read one
input tensor one after the other (q/k/v, gate/up) take X' from one pass
of B'.  The loop is the library's (bico_fit_run through bico.fit.run):
a segment is one of its blocks, a run of layers reading one input one of
its groups; fit_model's callbacks (_FitHost) run the passes and write
the updates.  Memory: one segment's inputs for four models, plus one
segment's layer rows; B' shares B's tensors until its segment comes (it
is made a block at a time, and its tensors are the result).
"""
import copy

import numpy as np
import torch
import torch.nn as nn

from ..transport import _rows_at as _transport_rows_at
from .._status import BicoError, E_ARG, E_SHAPE, E_STATE
from .ridge import RidgeFit

__all__ = ["fit_model"]


class _Stop(Exception):
    pass


def _first(out):
    """A block's hidden-state output: the tensor, or a tuple's first."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0],
                                                             torch.Tensor):
        return out[0]
    raise BicoError(E_ARG, "transfer_model: a block returned %s; fit needs "
                    "a tensor or a tuple whose first element is the hidden "
                    "state" % type(out).__name__)


def _rows(t):
    t = t.detach()
    return t.reshape(-1, t.shape[-1]).float().cpu()


class _Runner(object):
    """One model's walk through its segments on the calibration batches."""

    def __init__(self, model, blocks_name, batches, forward):
        self.model = model
        self.blocks_name = blocks_name
        self.blocks = model.get_submodule(blocks_name) if blocks_name \
            is not None else None
        if self.blocks is not None and not isinstance(
                self.blocks, (nn.ModuleList, nn.Sequential)):
            raise BicoError(E_ARG, "transfer_model: %r is a %s, not an "
                            "nn.ModuleList/Sequential of blocks"
                            % (blocks_name, type(self.blocks).__name__))
        self.n = len(self.blocks) if self.blocks is not None else 0
        self.batches = batches
        self.forward = forward
        self.state = None  # per batch: (args, kwargs) of the next block
        self.pos = -1      # the block whose input self.state holds
        self.runs = 0      # forward passes over the batches so far

    def _capture(self, names, side):
        """Forward hooks storing each named module's input or output rows,
        per call, into self.got[name][-1]."""
        mods = dict(self.model.named_modules())
        hooks = []
        for n in names:
            def hook(m, inp, out, n=n):
                t = inp[0] if side == "in" else out
                self.got[n][-1].append(_rows(t))
            hooks.append(mods[n].register_forward_hook(hook))
        return hooks

    def run(self, segment, names=(), side="in", advance=False, order=None,
            same=None):
        """Runs segment ("stem", block index, "tail" or "all") on every
        batch; returns {name: [per batch: [per call: rows]]}.  advance:
        keep the segment's output as the next block's input.  order: a
        list that receives module names in first-call order.  same: a dict
        that receives, per name of names, [per batch: [per call: token]],
        the token counting the distinct input tensors seen so far (a new
        object, or the same one changed in place, is a new token): two
        modules called one after the other on one tensor get one token."""
        self.runs += 1
        self.got = {n: [] for n in names}
        hooks = self._capture(names, side)
        if same is not None:
            hooks += self._tokens(names, same)
        if order is not None:
            mods = dict(self.model.named_modules())
            for n, m in mods.items():
                if isinstance(m, nn.Linear):
                    hooks.append(m.register_forward_hook(
                        lambda m, i, o, n=n: order.append(n)
                        if n not in order else None))
        new_state = []
        try:
            with torch.no_grad():
                for bi, batch in enumerate(self.batches):
                    for n in names:
                        self.got[n].append([])
                        if same is not None:
                            same[n].append([])
                    if segment == "all":
                        self.forward(self.model, batch)
                    elif segment == "stem":
                        new_state.append(self._stem(batch))
                    elif segment == "tail":
                        self._tail(batch, bi)
                    else:
                        args, kw = self.state[bi]
                        out = self.blocks[segment](*args, **kw)
                        new_state.append(_with_hidden(args, kw,
                                                      _first(out)))
        finally:
            for h in hooks:
                h.remove()
        if advance:
            self.state = new_state
            self.pos = 0 if segment == "stem" else segment + 1
        return self.got

    def _tokens(self, names, same):
        mods = dict(self.model.named_modules())
        last = [None, -1, 0]  # the last input tensor, its version, token

        def hook(m, inp, out, n):
            t = inp[0]
            if last[0] is not t or last[1] != t._version:
                last[0], last[1] = t, t._version
                last[2] += 1
            same[n][-1].append(last[2])
        for n in names:
            same[n] = []
        return [mods[n].register_forward_hook(
            lambda m, i, o, n=n: hook(m, i, o, n)) for n in names]

    def _stem(self, batch):
        box = []

        def catch(args, kwargs):
            box.append((tuple(args), _replayable(dict(kwargs))))
            raise _Stop()
        remove = _catch_call(self.blocks[0], catch)
        try:
            self.forward(self.model, batch)
        except _Stop:
            pass
        finally:
            remove()
        if not box:
            raise BicoError(E_STATE, "transfer_model: the first block never "
                            "ran in the model's forward")
        args, kw = box[0]
        _hidden(args, kw, self.blocks_name + ".0")
        return box[0]

    def _tail(self, batch, bi):
        """The whole forward with the last block's output replaced by the
        stored state (the blocks before it run but nothing reads them)."""
        args, kw = self.state[bi]
        hidden = _hidden(args, kw, self.blocks_name)

        def replace(m, inp, out):
            if isinstance(out, torch.Tensor):
                return hidden
            return (hidden,) + tuple(out[1:])
        h = self.blocks[self.n - 1].register_forward_hook(replace)
        try:
            self.forward(self.model, batch)
        finally:
            h.remove()

    def advance_to(self, j):
        """Runs blocks until self.state holds block j's input."""
        while self.pos < j:
            self.run(self.pos, advance=True)


def _catch_call(module, fn):
    """Calls fn(args, kwargs) with the positional and keyword arguments of
    every call of module, before its forward runs; returns the remover.
    PyTorch >= 2.0: a forward pre-hook with_kwargs=True.  Before (1.13),
    pre-hooks see the positional arguments only, so the instance's forward
    is wrapped instead for the time of the capture."""
    def hook(m, args, kwargs):
        fn(args, kwargs)  # and None: the call goes on unchanged

    try:
        h = module.register_forward_pre_hook(hook, with_kwargs=True)
        return h.remove
    except TypeError:
        pass
    own = module.__dict__.get("forward")
    inner = module.forward

    def forward(*args, **kwargs):
        fn(args, kwargs)
        return inner(*args, **kwargs)
    module.forward = forward

    def remove():
        if own is not None:
            module.forward = own
        elif "forward" in module.__dict__:
            del module.forward
    return remove


# a block's cache arguments (Hugging Face decoders): replaying a block with
# the cache it was first called with would append its keys and values again
_CACHE_ARGS = ("past_key_value", "past_key_values", "layer_past")


def _replayable(kw):
    """A captured block's keyword arguments made safe to replay: no cache
    (the fit runs whole windows), use_cache off."""
    for k in _CACHE_ARGS:
        if k in kw:
            kw[k] = None
    if "use_cache" in kw:
        kw["use_cache"] = False
    return kw


def _hidden(args, kw, where):
    """The hidden state among a block's arguments: the first positional
    one, or the keyword argument hidden_states."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if not args and isinstance(kw.get("hidden_states"), torch.Tensor):
        return kw["hidden_states"]
    raise BicoError(E_ARG, "transfer_model: block %s was called without a "
                    "hidden-state tensor as its first argument or as "
                    "hidden_states=; fit needs one" % where)


def _with_hidden(args, kw, h):
    """(args, kw) of the next block: the same arguments, hidden state h."""
    if args:
        return (h,) + tuple(args[1:]), kw
    kw = dict(kw)
    kw["hidden_states"] = h
    return (), kw


def _out_map(maps, module):
    """R_out of a target module: a matrix, or a list per fused block."""
    r = maps[module]["out"]
    if isinstance(r, list):
        return [x[0] for x in r]
    return r[0]


def _maps32(r):
    if isinstance(r, list):
        return [np.ascontiguousarray(x, dtype=np.float32) for x in r]
    return np.ascontiguousarray(r, dtype=np.float32)


def _out_map32(r):
    """R_out as _carry takes it, made once per layer: a C-contiguous
    float32 matrix, or a list of them per fused block (None: none)."""
    return None if r is None else _maps32(r)


def _carry(d, r, alpha=1.0):
    """alpha D R_out: D [n, d_out,A] -> [n, d_out,B] float32, by the
    library's rows transport (bico_transport_rows); r a matrix or a list
    for fused blocks, block i of D's columns carried by r[i] into block i
    of the result's.  Each block's columns are read in place and written
    in place (the kernel's row strides), with no copy of a slice; r is
    converted to float32 only when it is not already (_out_map32 does it
    once per layer); r None: outputs in the source's coordinates
    (shared_out), alpha D without an identity map (out_features^2
    entries: 185 GB in double at a 151936-token vocabulary)."""
    d = np.ascontiguousarray(d, dtype=np.float32)
    if r is None:
        return d * np.float32(alpha) if alpha != 1.0 else d
    rs = _maps32(r if isinstance(r, list) else [r])  # no copy if float32
    k = len(rs)
    n, da = d.shape
    w = da // k if k else 0
    wb = rs[0].shape[1] if rs[0].ndim == 2 else -1
    for i, x in enumerate(rs):
        if x.ndim != 2 or x.shape != (w, wb) or w * k != da:
            raise BicoError(E_SHAPE, "transfer_model: the output map %s is "
                            "%s; the output change has %d columns in %d "
                            "block(s), each needs a %d x %d map"
                            % ("" if k == 1 else "of block %d" % i,
                               "x".join(str(s) for s in x.shape), da, k, w,
                               wb if wb >= 0 else 0))
    out = np.empty((n, wb * k), dtype=np.float32)
    if n == 0 or w == 0 or wb == 0:
        out[...] = 0
        return out
    for i in range(k):
        _transport_rows_at(n, w, wb, alpha, d, i * w, da, rs[i], out,
                           i * wb, wb * k)
    return out


def fit_model(source, source_tuned, target, batches, forward, maps,
              pairing, start_state, alpha, ridge, ctx, report,
              show_progress=False, shared_out=(), skip=(),
              share_passes=True, want_rank=None, prior=None, metric=None):
    """Returns the working target's state dict after the fit.  maps: from
    Collector.maps() (R_out per target module); start_state: the target
    state dict to start from (BiCo's carried norms/tokens, original linear
    weights); skip: target linears left as start_state has them; ctx: the
    bico.Context of the layers' fits (None: a new one).
    share_passes: layers fitted one after the other that read one input
    tensor (q/k/v, gate/up) take their working-target inputs X' from one
    forward pass (the earlier ones' updates cannot change that input).
    want_rank: compute each layer's rank for the report (default: when there
    is a report).  prior {name: dW0} (the ridge's centre), metric {name: M}
    (the penalty's metric) or ridge="gcv": each layer is solved by RidgeFit
    instead of the library's solve.

    The loop is the library's (bico.fit.run, i.e. bico_fit_run): a block
    per segment (block_begin runs the segment's capture passes and says
    how many of its linears ran, block_end advances the working target),
    a group per run of linears reading one input (one capture pass of the
    working target for all of them), rows() adding each layer's rows,
    update() writing W + dW into the working target (_FitHost's
    callbacks)."""
    from ..fit import run as _fit_run
    if want_rank is None:
        want_rank = report is not None
    host = _FitHost(source, source_tuned, target, batches, forward, maps,
                    pairing, start_state, alpha, ridge, report, shared_out,
                    skip, share_passes, prior, metric)
    c_ridge = 1e-2 if ridge == "gcv" else ridge
    use_ridgefit = host.use_ridgefit
    _fit_run(0, host.layer, None, host.update, ridge=c_ridge, ctx=ctx,
             want_rank=want_rank and not use_ridgefit, blocks=len(host.segments),
             block_begin=host.block_begin, block_end=host.block_end,
             group=host.group, rows_group=host.rows_group,
             solve=host.solve if use_ridgefit else None)
    # every tensor of work is its own by now (no clone needed)
    return {k: v.detach() for k, v in host.work.state_dict().items()}


class _FitHost(object):
    """fit_model's side of bico_fit_run: the four models' walks through
    their segments, and the driver's callbacks (block_begin, block_end,
    group, layer, rows_group, solve, update)."""

    def __init__(self, source, source_tuned, target, batches, forward, maps,
                 pairing, start_state, alpha, ridge, report, shared_out,
                 skip, share_passes, prior, metric):
        self.batches, self.maps, self.pairing = batches, maps, pairing
        self.start_state, self.alpha, self.ridge = start_state, alpha, ridge
        self.report, self.shared_out = report, shared_out
        self.share_passes, self.prior, self.metric = share_passes, prior, \
            metric
        self.use_ridgefit = bool(prior) or bool(metric) or ridge == "gcv"
        work = self.work = _shallow_copy(target)
        for m in (source, source_tuned, target, work):
            m.eval()
        tmods = self.tmods = dict(target.named_modules())
        smods = self.smods = dict(source.named_modules())
        self.wmods = dict(work.named_modules())
        self.linear = [n for n, m in tmods.items()
                       if isinstance(m, nn.Linear)
                       and pairing.source_name(n) in smods
                       and isinstance(smods[pairing.source_name(n)],
                                      nn.Linear)
                       and n in maps and n not in skip and
                       ("out" in maps[n] or n in self.shared_out)]
        pb, pa = pairing.prefix_b, pairing.prefix_a
        self.pb = pb
        self.runners = [_Runner(m, p, batches, forward) for m, p in
                        ((source, pa), (source_tuned, pa), (target, pb),
                         (work, pb))]
        ra, rt, rb, rw = self.runners
        self.rw = rw
        # the working copy is made a block at a time: what is outside the
        # blocks now, each block when its segment comes (until then the
        # blocks share the target's tensors, and nothing reads their
        # outputs)
        self.own_of = {}
        _materialize(work, start_state, self.own_of,
                     skip=list(rw.blocks) if rw.blocks is not None else [])
        if (rb.n == 0) != (ra.n == 0):
            raise BicoError(E_ARG, "transfer_model: one model has repeated "
                            "blocks and the other not")
        if rb.n == 0:
            self.segments = ["all"]
        else:
            self.segments = ["stem"] + list(range(rb.n)) + ["tail"]
        self.depth = pairing.depth
        self.stem = _stem_linears(target, rb, batches[0], forward) \
            if rb.n else set()
        self.cur = {}   # the segment being fitted: its captures and order
        self.info = {}  # per layer: name, source, W, b, R_out, its outcome

    def block_begin(self, k, first):
        seg = self.segments[k]
        pairing, pb = self.pairing, self.pb
        ra, rt, rb, rw = self.runners
        if isinstance(seg, int):
            _materialize(rw.blocks[seg], self.start_state, self.own_of,
                         prefix=pb + "." + str(seg))
        # this segment's target linears, and their source partners
        own = [n for n in self.linear
               if _segment_of(n, pb, rb.n, self.stem) == seg]
        src = sorted(set(pairing.source_name(n) for n in own))
        if seg in ("stem", "all"):
            sseg = seg
        elif seg == "tail":
            for r in (ra, rt):
                r.advance_to(ra.n)
            sseg = "tail"
        else:
            sseg = self.depth[seg]
            for r in (ra, rt):
                r.advance_to(sseg)
        ya = ra.run(sseg, src, side="out", advance=sseg == "stem")
        yt = rt.run(sseg, src, side="out", advance=sseg == "stem")
        order, same = [], {}
        xb = rb.run(seg, own, side="in", advance=seg not in ("tail", "all"),
                    order=order, same=same)
        fit_order = [n for n in order if n in own]
        # runs of layers that read one input: one pass of B' for each
        groups, i = {}, 0
        while i < len(fit_order):
            n = 1
            while self.share_passes and i + n < len(fit_order) and \
                    _one_input(same, fit_order[i + n - 1], fit_order[i + n]):
                n += 1
            groups[first + i] = n
            i += n
        self.cur.clear()
        self.cur.update(seg=seg, first=first, order=fit_order, groups=groups,
                        ya=ya, yt=yt, xb=xb)
        return len(fit_order)

    def block_end(self, k):
        seg = self.segments[k]
        if seg not in ("tail", "all"):
            self.rw.run(seg, advance=True)
        for r in self.runners:
            r.got = {}
        self.cur.clear()

    def group(self, l):
        return self.cur["groups"][l]

    def layer(self, l):
        cur, smods = self.cur, self.smods
        name = cur["order"][l - cur["first"]]
        s = self.pairing.source_name(name)
        lin = self.tmods[name]
        if name in self.shared_out:
            if lin.out_features != smods[s].out_features:
                raise BicoError(E_SHAPE, "transfer_model: shared_out "
                                "module %s has %d outputs, its source "
                                "%s %d" % (name, lin.out_features, s,
                                           smods[s].out_features))
            r_out = None    # D as it is (no output map)
        else:
            r_out = _out_map(self.maps, name)
        w = lin.weight.detach().float().cpu().numpy()
        b = lin.bias.detach().float().cpu().numpy() \
            if lin.bias is not None else None
        self.info[l] = {"name": name, "source": s, "w": w, "b": b,
                        "r_out": _out_map32(r_out)}
        return w, b

    def rows_group(self, l, fits):
        cur, info = self.cur, self.info
        seg = cur["seg"]
        names = [info[l + i]["name"] for i in range(len(fits))]
        xw_group = self.rw.run(seg, names, side="in")
        for i, f in enumerate(fits):
            it = info[l + i]
            name, s = it["name"], it["source"]
            if self.use_ridgefit:
                f = it["ridgefit"] = RidgeFit(
                    f.d_in, f.d_out, it["w"], it["b"], ridge=self.ridge,
                    prior=(self.prior or {}).get(name),
                    metric=(self.metric or {}).get(name))
            xw = xw_group.pop(name)
            xb, ya, yt = cur["xb"][name], cur["ya"][s], cur["yt"][s]
            for bi in range(len(self.batches)):
                calls = (xw[bi], xb[bi], ya[bi], yt[bi])
                if len(set(len(c) for c in calls)) != 1:
                    raise BicoError(E_STATE, "transfer_model: %s ran %d "
                                    "times in the target, its source %s %d "
                                    "times (batch %d)" % (name, len(calls[0]),
                                                          s, len(calls[2]),
                                                          bi))
                for x1, x0, y0, y1 in zip(*calls):
                    if y0.shape[0] != x1.shape[0]:
                        raise BicoError(E_SHAPE, "transfer_model: %s has %d "
                                        "rows in the target, %s %d in the "
                                        "source (batch %d): source and "
                                        "target must see the same tokens"
                                        % (name, x1.shape[0], s, y0.shape[0],
                                           bi))
                    db_ = _carry((y1 - y0).float().numpy(), it["r_out"],
                                 self.alpha)
                    f.add(np.ascontiguousarray(x1.numpy()),
                          np.ascontiguousarray(x0.numpy()), db_)
            it["rows"] = int(f.rows)

    def solve(self, l, f, want_rank):
        # RidgeFit's solve (a prior, a metric or GCV); it always has the
        # rank (an eigendecomposition it needs anyway)
        it = self.info[l]
        rf = it.pop("ridgefit")
        dw, db = rf.solve(it["w"], it["b"])
        it["rank"], it["ridge"] = rf.rank, rf.chosen
        return dw, db, rf.rank

    def update(self, l, dw, dbias, rk):
        it = self.info.pop(l)
        name, w, b = it["name"], it["w"], it["b"]
        wl = self.wmods[name]
        with torch.no_grad():
            wl.weight.copy_(torch.from_numpy(w + dw).to(wl.weight))
            if b is not None:
                wl.bias.copy_(torch.from_numpy(b + dbias).to(wl.bias))
        report = self.report
        if report is not None:
            r = it.get("rank", rk)
            report.append({"name": name, "source": it["source"],
                           "handling": "fit", "rows": it["rows"],
                           "rank": None if r is None else int(r),
                           "update_norm": float(np.sqrt(
                               np.sum(np.square(dw)) + (
                                   0.0 if dbias is None else
                                   np.sum(np.square(dbias)))))})
            if self.use_ridgefit:
                report[-1]["ridge"] = it["ridge"]


def _shallow_copy(model):
    """A copy of model's module tree that shares its parameters and
    buffers (no memory for them); _materialize gives it its own."""
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        memo[id(t)] = t
    return copy.deepcopy(model, memo)


def _materialize(root, state, done, prefix="", skip=()):
    """Gives every parameter and buffer under module root (named prefix in
    the whole model) its own tensor with state's value (the target's where
    state lacks the key), except under the modules in skip.  done maps
    id(shared tensor) -> its replacement and id(replacement) -> itself,
    so that a tensor owned twice (a tied head) stays one."""
    skip = set(id(m) for m in skip)

    def walk(m, name):
        if id(m) in skip:
            return
        for kind in ("_parameters", "_buffers"):
            table = getattr(m, kind)
            for pn, t in list(table.items()):
                if t is None:
                    continue
                if id(t) in done:  # shared with one made before, or own
                    table[pn] = done[id(t)]
                    continue
                key = name + "." + pn if name else pn
                v = state.get(key, t).detach()
                new = v.to(device=t.device, dtype=t.dtype).clone()
                if kind == "_parameters":
                    new = nn.Parameter(new, requires_grad=t.requires_grad)
                table[pn] = new
                done[id(t)] = done[id(new)] = new
        for cn, c in m._modules.items():
            if c is not None:
                walk(c, name + "." + cn if name else cn)
    walk(root, prefix)


def _one_input(same, a, b):
    """Whether modules a and b (b called after a) read the same input
    tensor at every call on every batch (Runner.run's tokens)."""
    ta, tb = same.get(a), same.get(b)
    return bool(ta) and ta == tb and all(ta)


def _segment_of(module, prefix, n_blocks, stem):
    from .._names import split_block
    if n_blocks == 0:
        return "all"
    sb = split_block(module, prefix)
    if sb is not None:
        return sb[0]
    return "stem" if module in stem else "tail"


def _stem_linears(model, runner, batch, forward):
    """Names of the linears outside the blocks that run before the first
    block (the others run after the last one)."""
    seen, started = set(), []
    hooks = [m.register_forward_hook(
        lambda m, i, o, n=n: seen.add(n) if not started else None)
        for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    hooks.append(runner.blocks[0].register_forward_pre_hook(
        lambda m, a: started.append(1)))
    try:
        with torch.no_grad():
            forward(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return seen
