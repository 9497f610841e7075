"""Shared by test_binding*.py and test_collector*.py: a small transformer,
its function-preserving change of coordinates, and a plain-PyTorch
reference implementation of BiCo (stored activations, torch.linalg.svd).
Nothing here goes through libbico.  (No tests in this file.)"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def float32_default():
    """These tests build float32 models: pin torch's default dtype while
    they run (another test module may change it process-wide at import),
    and give back whatever was set."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(old)


class RMSNorm(nn.Module):
    """Element-wise like LayerNorm, but without LayerNorm's fixed null
    direction: LayerNorm's input gradients are orthogonal to the ones
    vector, which leaves every residual-stream gradient statistic one rank
    short (METHODS.md) and its Procrustes map undetermined there."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * r * self.weight


class Attn(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).reshape(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2) / (d // h) ** 0.5).softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d, heads, hidden, norm=RMSNorm):
        super().__init__()
        self.norm1 = norm(d)
        self.attn = Attn(d, heads)
        self.norm2 = norm(d)
        self.mlp = Mlp(d, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Tiny(nn.Module):
    """ViT-shaped: patch_embed, cls_token, pos_embed, blocks.{i}.(norm1,
    attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2), norm, head.  Mean-pooled
    so that every token's rows carry gradient (full-rank statistics)."""

    def __init__(self, din=6, d=8, heads=2, hidden=16, depth=2, tokens=5,
                 classes=4, norm=RMSNorm):
        super().__init__()
        self.patch_embed = nn.Linear(din, d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, d) * 0.5)
        self.blocks = nn.ModuleList([Block(d, heads, hidden, norm)
                                     for _ in range(depth)])
        self.norm = norm(d)
        self.head = nn.Linear(d, classes)
        with torch.no_grad():  # generic norms: no zero-sum rows
            for m in self.modules():
                if isinstance(m, (nn.LayerNorm, RMSNorm)):
                    m.weight.uniform_(0.5, 1.5)
                if isinstance(m, nn.LayerNorm):
                    m.bias.normal_(0, 0.3)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x).mean(1))


def mse_loss(out, y):
    """Regression on random targets: output gradients of full rank."""
    return ((out - y) ** 2).sum()


def batches(n_batches=3, size=32, din=6, tokens=5, classes=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, tokens, din, generator=g),
             torch.randn(size, classes, generator=g))
            for _ in range(n_batches)]


def perturbed(model, scale=0.05, seed=7):
    """A 'fine-tuned' copy: every parameter moved by a random amount."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g)
            for k, v in model.state_dict().items()}


def random_orthogonal(n, g):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def planted_transform(sd, d, heads, hidden, depth, seed=3):
    """Returns (T, info): T(state dict) writes the same network in other
    coordinates: residual stream permuted (P), MLP units permuted (Pm),
    each head's q/k space rotated by Q_h (the same for q and k) and its v
    space by O_h.  T is linear in the parameters, so T(A_ft) - T(A) =
    T-applied tau."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(d, generator=g)
    P = torch.eye(d)[perm]
    hd = d // heads
    blk = lambda ms: torch.block_diag(*ms)
    mats = []
    for _ in range(depth):
        Pm = torch.eye(hidden)[torch.randperm(hidden, generator=g)]
        Mq = blk([random_orthogonal(hd, g) for _ in range(heads)])
        Mv = blk([random_orthogonal(hd, g) for _ in range(heads)])
        mats.append((Pm, Mq, Mv))

    def T(s):
        o = {}
        for k, v in s.items():
            parts = k.split(".")
            if k.startswith("patch_embed."):
                o[k] = P @ v
            elif k in ("cls_token", "pos_embed"):
                o[k] = v @ P.T
            elif k.startswith("norm.") or (len(parts) > 2 and
                                           parts[2] in ("norm1", "norm2")):
                o[k] = P @ v
            elif k == "head.weight":
                o[k] = v @ P.T
            elif k == "head.bias":
                o[k] = v.clone()
            else:
                i = int(parts[1])
                Pm, Mq, Mv = mats[i]
                M3 = torch.block_diag(Mq, Mq, Mv)
                name = ".".join(parts[2:])
                o[k] = {"attn.qkv.weight": lambda: M3 @ v @ P.T,
                        "attn.qkv.bias": lambda: M3 @ v,
                        "attn.proj.weight": lambda: P @ v @ Mv.T,
                        "attn.proj.bias": lambda: P @ v,
                        "mlp.fc1.weight": lambda: Pm @ v @ P.T,
                        "mlp.fc1.bias": lambda: Pm @ v,
                        "mlp.fc2.weight": lambda: P @ v @ Pm.T,
                        "mlp.fc2.bias": lambda: P @ v}[name]()
        return o
    return T


# ---- reference BiCo in plain PyTorch ----

def record(model, names, data, loss_fn):
    """Input activations and output gradients of the named modules over
    the whole calibration set, as float64 [rows, d] tensors."""
    acts = {n: [] for n in names}
    grads = {n: [] for n in names}
    hs = []
    mods = dict(model.named_modules())
    for n in names:
        hs.append(mods[n].register_forward_hook(
            lambda m, i, o, n=n: acts[n].append(i[0].detach())))
        def on_out(m, i, o, n=n):
            o.register_hook(lambda g: grads[n].append(g.detach()))
        hs.append(mods[n].register_forward_hook(on_out))
    model.eval()
    for x, y in data:
        xr = x.clone()
        out = model(xr)
        loss = loss_fn(out, y)
        torch.autograd.grad(loss, [p for p in model.parameters()])
    for h in hs:
        h.remove()
    cat = lambda ts: torch.cat([t.reshape(-1, t.shape[-1]).double()
                                for t in ts])
    return ({n: cat(v) for n, v in acts.items()},
            {n: cat(v) for n, v in grads.items()})



def stored_statistics(source, target, data, loss_fn, modules, split=None):
    """Stores every input activation and output gradient of the named
    modules for the whole calibration set (the memory-hungry way), then
    forms C = X_A^T X_B in float64.  Same-named modules pair (depth mapping
    done by the caller through `pair`)."""
    split = split or {}

    names_b = list(modules)
    names_a = [modules[n] for n in names_b]
    acts_a, grads_a = record(source, sorted(set(names_a)), data, loss_fn)
    acts_b, grads_b = record(target, names_b, data, loss_fn)
    stats = {}
    for nb, na in modules.items():
        stats[nb + ".in_xcov"] = acts_a[na].T @ acts_b[nb]
        ga, gb = grads_a[na], grads_b[nb]
        k = split.get(nb, 1)
        if k == 1:
            stats[nb + ".out_xcov"] = ga.T @ gb
        else:
            wa, wb = ga.shape[1] // k, gb.shape[1] // k
            full = torch.zeros(ga.shape[1], gb.shape[1], dtype=torch.float64)
            for i in range(k):
                full[i * wa:(i + 1) * wa, i * wb:(i + 1) * wb] = \
                    ga[:, i * wa:(i + 1) * wa].T @ gb[:, i * wb:(i + 1) * wb]
            stats[nb + ".out_xcov"] = full
    return stats


def ref_map(c):
    u, _, vh = torch.linalg.svd(c.double(), full_matrices=False)
    return u @ vh


def ref_bico(source_base, source_tuned, target_base, stats, pair, split,
             ties, alpha=1.0):
    """theta_B + alpha R_out^T tau R_in per linear module (fused ones block
    by block), biases R_out^T b, norms by the input-activation map (scales
    as operators, diag(R^T diag(tau) R); biases R^T b), tied tokens t R_out."""
    out = {}

    def maps(m):
        r_in = ref_map(stats[m + ".in_xcov"])
        c = stats[m + ".out_xcov"]
        k = split.get(m, 1)
        wa, wb = c.shape[0] // k, c.shape[1] // k
        r_outs = [ref_map(c[i * wa:(i + 1) * wa, i * wb:(i + 1) * wb])
                  for i in range(k)]
        return r_in, r_outs

    for name, tb in target_base.items():
        src = pair(name)
        tau = (source_tuned[src] - source_base[src]).double()
        mod, p = name.rsplit(".", 1) if "." in name else ("", name)
        if name in ties:
            _, r_outs = maps(ties[name])
            upd = tau @ r_outs[0]
        elif mod + ".in_xcov" in stats and p == "weight" and tb.dim() == 2:
            r_in, r_outs = maps(mod)
            k = len(r_outs)
            wa = tau.shape[0] // k
            upd = torch.cat([r_outs[i].T @ tau[i * wa:(i + 1) * wa] @ r_in
                             for i in range(k)])
        elif mod + ".in_xcov" in stats and isinstance(
                stats.get(mod + ".out_xcov"), torch.Tensor) and p == "bias" \
                and "norm" not in mod:
            _, r_outs = maps(mod)
            k = len(r_outs)
            wa = tau.shape[0] // k
            upd = torch.cat([r_outs[i].T @ tau[i * wa:(i + 1) * wa]
                             for i in range(k)])
        elif mod + ".in_xcov" in stats:  # norms: activation map
            r_in, _ = maps(mod)
            # a scale is the operator diag(g): diag(R^T diag(tau) R);
            # a bias is a vector: R^T tau
            upd = torch.diagonal(r_in.T @ torch.diag(tau) @ r_in) \
                if p == "weight" else r_in.T @ tau
        else:
            upd = torch.zeros_like(tb, dtype=torch.float64)
        out[name] = (tb.double() + alpha * upd).float()
    return out
