"""Small ViTs on Fashion-MNIST for the quality benchmark: the model, the
data, the downstream tasks, and cached training.

Everything trained is cached under build/quality/ (override with
BICO_QUALITY_CACHE), one file per trained model, keyed by a hash of its whole
configuration (architecture, seed, data split, schedule, task), so that a
rerun loads instead of training and a changed configuration retrains only
what it touches."""
import gzip
import hashlib
import json
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DATA = os.environ.get("BICO_FMNIST", "/usr/share/datasets/fashion-mnist")
CACHE = os.environ.get("BICO_QUALITY_CACHE", "build/quality")
# bump when the training code changes in a way the configurations miss
CODE_VERSION = 1


# ---- model ----

class Attn(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).reshape(b, n, 3, h, d // h).permute(2, 0, 3, 1,
                                                                   4)
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
    def __init__(self, d, heads, hidden):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = Attn(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = Mlp(d, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch, d):
        super().__init__()
        self.patch = patch
        self.proj = nn.Linear(patch * patch, d)

    def forward(self, img):
        p = self.patch
        b, h, w = img.shape
        x = img.reshape(b, h // p, p, w // p, p).permute(0, 1, 3, 2, 4)
        return self.proj(x.reshape(b, (h // p) * (w // p), p * p))


class ViT(nn.Module):
    """patch_embed.proj (a Linear on flattened 7x7 patches), cls_token,
    pos_embed, blocks.{i}.(norm1, attn.qkv, attn.proj, norm2, mlp.fc1,
    mlp.fc2), norm, head; the head reads the mean of all tokens."""

    def __init__(self, width=64, depth=3, heads=4, mlp=2, patch=7, size=28,
                 classes=10):
        super().__init__()
        n = (size // patch) ** 2
        self.patch_embed = PatchEmbed(patch, width)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, width))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, n + 1, width))
        self.blocks = nn.ModuleList(Block(width, heads, mlp * width)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, img):
        x = self.patch_embed(img)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x).mean(1))


# ---- data ----

def _idx(name):
    with gzip.open(os.path.join(DATA, name), "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[:4], "big")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big")
            for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


_cache = {}


def fashion(split):
    """(images float32 [n, 28, 28] in [0, 1], labels int64) of "train" or
    "test"."""
    if split not in _cache:
        pre = "train" if split == "train" else "t10k"
        x = _idx(pre + "-images-idx3-ubyte.gz").astype(np.float32) / 255.0
        y = _idx(pre + "-labels-idx1-ubyte.gz").astype(np.int64)
        _cache[split] = (torch.from_numpy(x), torch.from_numpy(y))
    return _cache[split]


# Downstream tasks: each maps (images, labels) to the task's (images,
# labels), possibly dropping samples.  Kinds: an input rotation, an input
# intensity inversion, a relabelling of the same images, and a fine-grained
# subset of the classes with its own label ids.
PERM = torch.tensor([3, 7, 0, 9, 5, 1, 8, 2, 6, 4])
UPPER = torch.tensor([0, 2, 4, 6])  # T-shirt, pullover, coat, shirt


def task_data(task, x, y):
    if task == "pretrain":
        return x, y
    if task == "rot90":
        return torch.rot90(x, 1, (1, 2)).contiguous(), y
    if task == "invert":
        return 1.0 - x, y
    if task == "remap":
        return x, PERM[y]
    if task == "upper4":
        keep = (y[:, None] == UPPER[None, :])
        sel = keep.any(1)
        return x[sel], keep[sel].float().argmax(1)
    raise ValueError("unknown task %r" % task)


TASKS = ("rot90", "invert", "remap", "upper4")


def normalise(x):
    return (x - 0.2860) / 0.3530


def split_data(task, which):
    """The benchmark's fixed splits: pretraining halves of the training set
    (pre-a, pre-b), the task's fine-tuning set and calibration pool (both
    from the training set, disjoint), the validation set (labels choose the
    oracle alpha) and the test set (scores), from t10k."""
    if which in ("pre-a", "pre-b"):
        x, y = fashion("train")
        s = slice(0, 30000) if which == "pre-a" else slice(30000, 60000)
        return normalise(x[s]), y[s]
    if which == "tune":
        x, y = fashion("train")
        x, y = x[:12000], y[:12000]
    elif which == "calib":
        x, y = fashion("train")
        x, y = x[56000:60000], y[56000:60000]
    elif which == "val":
        x, y = fashion("test")
        x, y = x[:2000], y[:2000]
    elif which == "test":
        x, y = fashion("test")
        x, y = x[2000:6000], y[2000:6000]
    else:
        raise ValueError(which)
    x, y = task_data(task, x, y)
    return normalise(x), y


# ---- training with a cache ----

def _key(cfg):
    blob = json.dumps(dict(cfg, code=CODE_VERSION), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train(model, x, y, epochs, lr, batch, seed):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * ((len(x) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps,
                                                pct_start=0.1)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            idx = perm[i:i + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    return model


def arch(cfg):
    return ViT(width=cfg["width"], depth=cfg["depth"], heads=cfg["heads"],
               mlp=cfg["mlp"])


def pretrained(cfg, log=print):
    """cfg: width, depth, heads, mlp, seed, split (pre-a | pre-b), epochs,
    lr."""
    return _cached(dict(cfg, kind="pretrain"), lambda: _pretrain(cfg), log)


def _pretrain(cfg):
    torch.manual_seed(cfg["seed"])
    m = arch(cfg)
    x, y = split_data("pretrain", cfg["split"])
    return train(m, x, y, cfg["epochs"], cfg["lr"], 128, cfg["seed"])


def finetuned(cfg, task, ft, log=print):
    """The pretrained model of cfg fine-tuned on task with schedule ft
    (epochs, lr, samples); every parameter trains."""
    key = dict(cfg, kind="finetune", task=task, ft=ft)

    def make():
        m = pretrained(cfg, log)
        x, y = split_data(task, "tune")
        x, y = x[:ft["samples"]], y[:ft["samples"]]
        return train(m, x, y, ft["epochs"], ft["lr"], 64, cfg["seed"] + 100)
    return _cached(key, make, log)


def is_cached(cfg, task=None, ft=None):
    """Whether the pretrained model of cfg (and its fine-tune on task with
    schedule ft, when given) is in the cache."""
    keys = [dict(cfg, kind="pretrain")]
    if task is not None:
        keys.append(dict(cfg, kind="finetune", task=task, ft=ft))
    return all(os.path.exists(os.path.join(CACHE, "model-%s.pt" % _key(k)))
               for k in keys)


def _cached(key, make, log):
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, "model-%s.pt" % _key(key))
    cfg = {k: key[k] for k in ("width", "depth", "heads", "mlp")}
    if os.path.exists(path):
        m = ViT(**{k: cfg[k] for k in cfg})
        m.load_state_dict(torch.load(path))
        m.eval()
        return m
    log("training %s" % json.dumps(key, sort_keys=True))
    m = make()
    tmp = path + ".tmp"
    torch.save(m.state_dict(), tmp)
    os.replace(tmp, path)
    return m


@torch.no_grad()
def accuracy(model, x, y, batch=1000):
    model.eval()
    right = 0
    for i in range(0, len(x), batch):
        right += (model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum()
    return float(right) / len(x)
