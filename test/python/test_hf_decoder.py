"""transfer_model on a decoder written in the Hugging Face layout: the model
calls each layer with keyword arguments that have no defaults
(attention_mask, position_embeddings=(cos, sin)), and lm_head is an
nn.Linear whose weight IS embed_tokens.weight (tie_word_embeddings).  The
target is the source in other coordinates (test/e2e/llama.py's planted
symmetries), so the carried fine-tune has an exact answer: T(A_ft) computes
A_ft's logits.  Gap closed, on fresh tokens:
1 - |logits(B carried) - logits(A_ft)| / |logits(B) - logits(A_ft)|."""
import copy
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bico
import bico.torch as bt
from test_binding_models import float32_default  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402

torch.set_num_threads(1)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return llama.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, hd = cfg["hidden_size"], cfg["head_dim"]
        self.H, self.KV, self.hd = (cfg["num_attention_heads"],
                                    cfg["num_key_value_heads"], hd)
        self.q_proj = nn.Linear(d, self.H * hd, bias=False)
        self.k_proj = nn.Linear(d, self.KV * hd, bias=False)
        self.v_proj = nn.Linear(d, self.KV * hd, bias=False)
        self.o_proj = nn.Linear(self.H * hd, d, bias=False)

    def forward(self, x, attention_mask, position_embeddings):
        B, T, _ = x.shape
        cos, sin = position_embeddings
        q = self.q_proj(x).view(B, T, self.H, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        q = q * cos + llama.rotate_half(q) * sin
        k = k * cos + llama.rotate_half(k) * sin
        rep = self.H // self.KV
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.hd) + attention_mask
        o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o)


class Mlp(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """HF's LlamaDecoderLayer: keyword arguments without defaults (the
    defaults variant, keyword arguments that default to None, runs without
    its mask when they are dropped)."""

    def __init__(self, cfg):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = Mlp(cfg)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        h = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), attention_mask,
            position_embeddings)
        return (h + self.mlp(self.post_attention_layernorm(h)),)


class DefaultsLayer(DecoderLayer):
    def forward(self, hidden_states, attention_mask=None,
                position_embeddings=None):
        if attention_mask is None:
            T = hidden_states.shape[1]
            attention_mask = torch.zeros(T, T, dtype=hidden_states.dtype)
        if position_embeddings is None:
            position_embeddings = (1.0, 0.0)
        return DecoderLayer.forward(self, hidden_states, attention_mask,
                                    position_embeddings)


class ByNameLayer(DecoderLayer):
    """Called with every argument by name, hidden_states= included, and a
    use_cache flag (HF's older layers)."""
    by_name = True

    def forward(self, hidden_states, attention_mask, position_embeddings,
                use_cache):
        assert use_cache is False
        return DecoderLayer.forward(self, hidden_states, attention_mask,
                                    position_embeddings)


class Inner(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"],
                                         cfg["hidden_size"])
        self.layers = nn.ModuleList(layer(cfg) for _ in
                                    range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.theta = cfg["rope_theta"]
        self.hd = cfg["head_dim"]

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        T = input_ids.shape[1]
        mask = torch.full((T, T), float("-inf"), dtype=h.dtype).triu(1)
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2,
                                                 dtype=torch.float64)
                                    / self.hd))
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
        emb = torch.cat([ang, ang], dim=-1).to(h.dtype)
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            if getattr(layer, "by_name", False):
                h = layer(hidden_states=h, attention_mask=mask[None, None],
                          position_embeddings=(cos, sin), use_cache=False)[0]
                continue
            h = layer(h, attention_mask=mask[None, None],
                      position_embeddings=(cos, sin))[0]
        return self.norm(h)


class CausalLM(nn.Module):
    def __init__(self, cfg, layer=DecoderLayer):
        super().__init__()
        self.model = Inner(cfg, layer)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"],
                                 bias=False)
        if cfg["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))

    def get_output_embeddings(self):
        return self.lm_head


def build(cfg, sd, layer=DecoderLayer):
    m = CausalLM(cfg, layer).eval()
    m.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    return m


CFG = llama.default_config(hidden_size=16, intermediate_size=32,
                           num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=32)
V = CFG["vocab_size"]
EMB, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def task(n, seed):
    """Windows of 16 tokens where every second token is 3 t + 1 of the one
    before it (mod V): a next-token task the pretrained model knows
    nothing of."""
    x = torch.randint(0, V, (n, 17), generator=torch.Generator()
                      .manual_seed(seed))
    x[:, 1::2] = (x[:, 0:-1:2] * 3 + 1) % V
    return x[:, :-1], x[:, 1:]


def ce(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def task_loss(model, sd=None, data=None):
    m = model
    if sd is not None:
        m = copy.deepcopy(model)
        m.load_state_dict(sd)
    x, y = data or task(32, 99)
    with torch.no_grad():
        return float(ce(m.eval()(x), y))


_PAIRS = {}


def planted(layer):
    """(A, A_ft, B, B_ft): A random, A_ft A fine-tuned on the task (Adam,
    the tied weight moving as one), B = T(A) and B_ft = T(A_ft) for a
    planted change of coordinates T (llama.symmetry), so B_ft is what a
    transfer should reach and computes A_ft's function exactly."""
    if layer in _PAIRS:
        return _PAIRS[layer]
    g = torch.Generator().manual_seed(5)
    A = llama.random_state(CFG, g)
    sym = llama.symmetry(CFG, g)
    a = build(CFG, A, layer)
    aft = copy.deepcopy(a).train()
    torch.manual_seed(0)
    opt = torch.optim.Adam(aft.parameters(), lr=3e-3)
    for i in range(60):
        x, y = task(16, 1000 + i)
        opt.zero_grad()
        ce(aft(x), y).backward()
        opt.step()
    aft.eval()
    assert aft.lm_head.weight is aft.model.embed_tokens.weight
    Aft = {k: v.double() for k, v in aft.state_dict().items() if k != HEAD}
    b = build(CFG, llama.transform(CFG, A, sym), layer)
    bft = build(CFG, llama.transform(CFG, Aft, sym), layer)
    _PAIRS[layer] = (a, aft, b, bft)
    return _PAIRS[layer]


def calibration():
    return [task(8, 40 + i) for i in range(3)]


@pytest.mark.parametrize("method,layer", [
    ("fit", DecoderLayer), ("bico", DecoderLayer), ("fit", DefaultsLayer),
    ("fit", ByNameLayer)],
    ids=["fit", "bico", "fit-kwargs-with-defaults", "fit-hidden-by-name"])
def test_planted_hf_decoder_closes_the_gap(method, layer):
    """Layers called with keyword arguments (without defaults: dropping them
    is a TypeError; with defaults: the layer runs without its causal mask)
    and a tied lm_head: the default transfer closes >= 98 % of the task
    loss gap between B and the planted B_ft = T(A_ft), and returns the
    tied pair as one tensor."""
    a, aft, b, bft = planted(layer)
    lb, lft = task_loss(b), task_loss(bft)
    assert lb - lft > 0.3  # the fine-tune matters
    sd = bt.transfer_model(a, aft, b, calibration(), method=method,
                           loss_fn=ce)
    gap = (lb - task_loss(b, sd)) / (lb - lft)
    assert gap >= 0.98, gap
    assert sd[HEAD] is sd[EMB]


def test_tied_pair_is_one_tensor_in_every_method():
    """On a target unrelated to the source (B's own random weights: the map
    through the first layer's norm and the one through the final norm
    differ), every method returns one tensor for embed_tokens.weight and
    lm_head.weight; the default fit carries it as BiCo does, tied="fit"
    fits it (another value), and load_state_dict keeps the model tied."""
    a, aft, _, _ = planted(DecoderLayer)
    b = build(CFG, llama.random_state(CFG, torch.Generator().manual_seed(8)))
    cal = calibration()
    got = {}
    for method, kw in (("bico", {}), ("bico-in", {}), ("naive", {}),
                       ("naive", dict(alpha="match")), ("fit", {}),
                       ("fit", dict(tied="fit"))):
        rep = []
        # holdout=0: alpha 1, the carried update itself (the default
        # would choose alpha on held-out batches, 0 on this unrelated pair)
        sd = bt.transfer_model(a, aft, b, cal, method=method,
                               options=bt.options_for(method, holdout=0,
                                                      **kw),
                               loss_fn=ce, report=rep)
        assert sd[HEAD] is sd[EMB], (method, kw)
        assert not torch.equal(sd[EMB], b.state_dict()[EMB]), (method, kw)
        assert {"name": HEAD, "handling": "shared", "shares": EMB} in rep
        got[method + str(kw)] = sd[EMB]
        m = copy.deepcopy(b)
        m.load_state_dict(sd)
        assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(got["fit{}"], got["bico{}"])
    assert not torch.allclose(got["fit{'tied': 'fit'}"], got["bico{}"],
                              atol=1e-4)
    with pytest.raises(bico.BicoError, match="tied"):
        bt.transfer_model(a, aft, b, cal, method="fit",
                          options=bt.FitOptions(tied="train"), loss_fn=ce)


def _untied(m, seed):
    u = copy.deepcopy(m)
    g = torch.Generator().manual_seed(seed)
    w = u.lm_head.weight.detach().clone()
    u.lm_head.weight = nn.Parameter(w + 0.01 * torch.randn(w.shape,
                                                           generator=g))
    return u


def test_a_vocabulary_head_keeps_only_input_statistics():
    """A head tied to the embedding and an untied one that
    get_output_embeddings() names: the collector keeps their input
    statistics only (an output statistic is V_A x V_B doubles, 185 GB at
    Qwen2's vocabulary).  The library maps no vocabulary's rows
    (docs/formats.md), so BiCo's result is the same to the bit as from
    the statistics with the head's output statistic, which a model that
    names no head still gets."""
    a, aft, b, _ = planted(DecoderLayer)
    bu = _untied(b, 3)
    cal = calibration()

    def stats(tgt):
        return bt.collect_statistics(a, tgt, cal, ce,
                                     show_progress=False).statistics()
    for tgt in (b, bu):
        st = stats(tgt)
        assert "lm_head.in_xcov" in st and "lm_head.out_xcov" not in st
        assert "model.layers.0.mlp.down_proj.out_xcov" in st
    bare = copy.deepcopy(bu)
    bare.get_output_embeddings = None
    full = stats(bare)
    assert full["lm_head.out_xcov"].rows > 0
    sd = [bt.transfer_state_dict(a.state_dict(), aft.state_dict(),
                                 bu.state_dict(), stats=st)
          for st in (stats(bu), full)]
    for k in sd[0]:
        assert torch.equal(sd[0][k], sd[1][k]), k
    assert not torch.equal(sd[0][HEAD], bu.state_dict()[HEAD])


def test_the_vocabulary_names_are_the_librarys():
    """bico._names.VOCABULARY_MODULES is the library's list: under each
    of those names the head transfers with its input statistic alone
    (its rows moved), under another name the driver asks for the output
    statistic the collector would not have kept."""
    from bico._names import VOCABULARY_MODULES
    a, aft, b, _ = planted(DecoderLayer)
    bu = _untied(b, 3)
    st = bt.collect_statistics(a, bu, calibration(), ce,
                               show_progress=False).statistics()
    assert "lm_head.out_xcov" not in st
    for name in VOCABULARY_MODULES + ("output",):
        ren = lambda d: {k.replace("lm_head", name): v for k, v in d.items()}
        sa, sf, sb = (ren(m.state_dict()) for m in (a, aft, bu))
        if name == "output":
            with pytest.raises(bico.BicoError, match="output.out_xcov"):
                bt.transfer_state_dict(sa, sf, sb, stats=ren(st))
            continue
        out = bt.transfer_state_dict(sa, sf, sb, stats=ren(st))
        assert not torch.equal(out[name + ".weight"], sb[name + ".weight"])


def test_an_untied_head_is_fitted_by_id_or_carried():
    """The in-memory fit of an untied vocabulary head: with the source's
    vocabulary size, its rows fitted with the logit change kept by id (the
    closed-form ridge solution with the identity output map, computed
    here from the head's inputs and the source pair's logits); when the
    model names no head, BiCo's output map (V x V) is used instead, and
    the results differ."""
    a, aft, b, _ = planted(DecoderLayer)
    bu = _untied(b, 4)
    cal = calibration()
    got = bt.transfer_model(a, aft, bu, cal, method="fit",
                            options=bt.FitOptions(alpha=1.0), loss_fn=ce)
    work = copy.deepcopy(bu)
    work.load_state_dict(dict(got, **{HEAD: bu.lm_head.weight}))

    def head_io(m):
        xs, ys = [], []
        h = m.lm_head.register_forward_hook(
            lambda mod, i, o: (xs.append(i[0].reshape(-1, i[0].shape[-1])),
                               ys.append(o.reshape(-1, o.shape[-1]))))
        with torch.no_grad():
            for x, _ in cal:
                m(x)
        h.remove()
        return torch.cat(xs).double(), torch.cat(ys).double()
    x1, _ = head_io(work)
    x0, _ = head_io(bu)
    d = head_io(aft)[1] - head_io(a)[1]
    w = bu.lm_head.weight.detach().double()
    lam = 1e-2 * torch.trace(x1.T @ x1) / x1.shape[1]
    dw = torch.linalg.solve(x1.T @ x1 + lam * torch.eye(x1.shape[1],
                                                        dtype=torch.float64),
                            x1.T @ (x0 @ w.T + d - x1 @ w.T)).T
    ref = w + dw
    err = (got[HEAD].double() - ref).abs().max()
    assert err < 1e-5 * ref.abs().max(), err
    bare = copy.deepcopy(bu)
    bare.get_output_embeddings = None
    mapped = bt.transfer_model(a, aft, bare, cal, method="fit",
                               options=bt.FitOptions(alpha=1.0), loss_fn=ce)
    assert (mapped[HEAD] - got[HEAD]).abs().max() > 1e-3


def test_block_calls_are_captured_with_keyword_arguments():
    """The capture used by the fit sees a block's positional and keyword
    arguments on this PyTorch (1.13: the forward is wrapped for the time
    of the capture and put back), and a cache argument is not replayed."""
    from bico.torch.fit import _catch_call, _replayable
    layer = DecoderLayer(CFG)
    seen = []
    remove = _catch_call(layer, lambda a, k: seen.append((a, k)))
    h = torch.randn(1, 3, CFG["hidden_size"])
    mask = torch.zeros(1, 1, 3, 3)
    pe = (torch.ones(3, CFG["head_dim"]), torch.zeros(3, CFG["head_dim"]))
    layer(h, attention_mask=mask, position_embeddings=pe)
    remove()
    assert "forward" not in layer.__dict__
    layer(h, attention_mask=mask, position_embeddings=pe)
    assert len(seen) == 1
    args, kw = seen[0]
    assert args[0] is h and kw["attention_mask"] is mask
    assert kw["position_embeddings"] is pe
    kw = _replayable(dict(kw, past_key_value=[1], use_cache=True))
    assert kw["past_key_value"] is None and kw["use_cache"] is False


class _Handle(object):
    def __init__(self, hooks, key):
        self.hooks, self.key = hooks, key

    def remove(self):
        self.hooks.pop(self.key, None)


class KwHookLayer(DecoderLayer):
    """PyTorch 2's register_forward_pre_hook(hook, with_kwargs=True) on any
    PyTorch: the real one where it exists, else the same contract (hook(m,
    args, kwargs) before forward, None or new (args, kwargs) back), so the
    2.x path of the capture runs here too."""

    def register_forward_pre_hook(self, hook, *, prepend=False,
                                  with_kwargs=False):
        if not with_kwargs:
            return super().register_forward_pre_hook(hook)
        try:
            return super().register_forward_pre_hook(hook, with_kwargs=True)
        except TypeError:  # PyTorch < 2.0
            pass
        self.__dict__.setdefault("_kw_hooks", {})
        key = len(self._kw_hooks)
        self._kw_hooks[key] = hook
        return _Handle(self._kw_hooks, key)

    def __call__(self, *args, **kwargs):
        for hook in list(self.__dict__.get("_kw_hooks", {}).values()):
            r = hook(self, args, kwargs)
            if r is not None:
                args, kwargs = r
        return super().__call__(*args, **kwargs)


def test_capture_through_a_keyword_pre_hook():
    """The path PyTorch >= 2.0 takes (a with_kwargs pre-hook), run on this
    PyTorch through a layer that offers that contract: the same capture,
    the hook removed afterwards, and the fit closes the planted gap."""
    from bico.torch.fit import _catch_call
    layer = KwHookLayer(CFG)
    seen = []
    remove = _catch_call(layer, lambda a, k: seen.append((a, k)))
    assert "forward" not in layer.__dict__  # no wrapping on this path
    h = torch.randn(1, 3, CFG["hidden_size"])
    mask = torch.zeros(1, 1, 3, 3)
    pe = (torch.ones(3, CFG["head_dim"]), torch.zeros(3, CFG["head_dim"]))
    out = layer(h, attention_mask=mask, position_embeddings=pe)[0]
    remove()
    layer(h, attention_mask=mask, position_embeddings=pe)
    assert len(seen) == 1 and seen[0][0][0] is h
    assert seen[0][1]["attention_mask"] is mask
    assert torch.equal(out, DecoderLayer.forward(layer, h, mask, pe)[0])
    a, aft, b, bft = planted(KwHookLayer)
    lb = task_loss(b)
    sd = bt.transfer_model(a, aft, b, calibration(), method="fit",
                           loss_fn=ce)
    gap = (lb - task_loss(b, sd)) / (lb - task_loss(bft))
    assert gap >= 0.98, gap
