"""The quality benchmark: carry fine-tunes of a small Fashion-MNIST ViT to
other ViTs and score them on held-out test images.

    make bench-quality            (or: python3 bench/quality/run.py)

For every downstream task and target shape: zero-shot (the pretrained
target), the transfers, and the target fine-tuned on the task itself (the
upper bound).  Score: test accuracy and the share of the zero-shot ->
fine-tuned gap closed, (acc - zs) / (ft - zs).  The scale alpha of BiCo and
the baselines is chosen without labels ("match": the size of the output
change A_ft shows on the calibration images); the fit uses alpha = 1.  The
oracle alpha (best on the labelled validation split) is printed beside it
to show what the label-free choice costs.  Labels are used only for
calibration gradients and GradFix's votes (as those methods are defined)
and for scoring.

Results are cached in build/quality/results.json, keyed by the whole
configuration of each cell, so a rerun prints from the cache.
"""
import argparse
import copy
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))

import config  # noqa: E402
import vit  # noqa: E402

import bico.torch as bt  # noqa: E402
from bico.fit import Fit  # noqa: E402

ORACLE = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0]
RESULTS_VERSION = 3


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def calib_batches(task, n, size=50):
    x, y = vit.split_data(task, "calib")
    x, y = x[:n], y[:n]
    return [(x[i:i + size], y[i:i + size]) for i in range(0, n, size)]


def load_into(model, sd):
    m = copy.deepcopy(model)
    m.load_state_dict(sd)
    return m.eval()


def delta_of(new, base):
    return {k: (new[k].float() - base[k].float()).numpy() for k in base
            if not torch.equal(new[k], base[k])}


def with_alpha(base, delta, a):
    return {k: (v.float() + a * torch.from_numpy(delta[k])).to(v.dtype)
            if k in delta else v for k, v in base.items()}


class Case(object):
    """One task and target shape: models, data, scoring."""

    def __init__(self, task, tname, log):
        self.task, self.tname = task, tname
        self.cfg = config.TARGETS[tname]
        self.A = vit.pretrained(config.SOURCE, log)
        self.Aft = vit.finetuned(config.SOURCE, task, config.FT, log)
        self.B = vit.pretrained(self.cfg, log)
        self.Bft = vit.finetuned(self.cfg, task, config.FT, log)
        self.val = vit.split_data(task, "val")
        self.test = vit.split_data(task, "test")
        self.b0 = {k: v.detach().clone() for k, v in
                   self.B.state_dict().items()}

    def acc(self, sd, split="test"):
        x, y = self.test if split == "test" else self.val
        return vit.accuracy(load_into(self.B, sd), x[:1000] if split == "val"
                            else x, y[:1000] if split == "val" else y)

    def oracle(self, delta):
        """alpha with the best validation accuracy (labels!)."""
        accs = [self.acc(with_alpha(self.b0, delta, a), "val")
                for a in ORACLE]
        return ORACLE[int(np.argmax(accs))]


# ---- variants built outside transfer_model ----

def per_layer_scale(case, delta, batches):
    """Each linear layer's transported update rescaled so that its output
    change on the calibration inputs, ||X_B dW^T + db||, equals the source
    layer's, ||Y_A_ft - Y_A|| (a label-free per-layer alpha)."""
    pairing = bt.Pairing([n for n, _ in case.A.named_parameters()],
                         [n for n, _ in case.B.named_parameters()])
    lin = [n for n, m in case.B.named_modules()
           if isinstance(m, torch.nn.Linear)]
    src = set(pairing.source_name(n) for n in lin)
    def out_norms(model, names, side, dw=None):
        acc = {n: 0.0 for n in names}
        mods = dict(model.named_modules())
        hooks = []
        for n in names:
            def hook(m, i, o, n=n):
                if side == "out":
                    acc[n] += float(o.pow(2).sum())
                else:
                    w, b = dw[n]
                    y = i[0] @ w.T + (b if b is not None else 0)
                    acc[n] += float(y.pow(2).sum())
            hooks.append(mods[n].register_forward_hook(hook))
        return acc, hooks
    # source: ||Y_A_ft - Y_A||^2 needs both outputs on the same batch
    ya, yt = {}, {}
    def grab(model, store):
        mods = dict(model.named_modules())
        hs = [mods[n].register_forward_hook(
            lambda m, i, o, n=n: store.setdefault(n, []).append(o.detach()))
            for n in src]
        return hs
    hs = grab(case.A, ya) + grab(case.Aft, yt)
    with torch.no_grad():
        for x, _ in batches:
            case.A(x)
            case.Aft(x)
    for h in hs:
        h.remove()
    want = {n: sum(float((b - a).pow(2).sum()) for a, b in zip(ya[n], yt[n]))
            for n in src}
    dw = {}
    for n in lin:
        w = delta.get(n + ".weight")
        b = delta.get(n + ".bias")
        dw[n] = (torch.from_numpy(w) if w is not None else
                 torch.zeros_like(dict(case.B.named_modules())[n].weight),
                 torch.from_numpy(b) if b is not None else None)
    got, hooks = out_norms(case.B, lin, "in", dw)
    with torch.no_grad():
        for x, _ in batches:
            case.B(x)
    for h in hooks:
        h.remove()
    out = dict(delta)
    for n in lin:
        s = np.sqrt(want[pairing.source_name(n)] / max(got[n], 1e-30))
        for p in (".weight", ".bias"):
            if n + p in out:
                out[n + p] = out[n + p] * np.float32(s)
    return out


def sign_mask(case, delta, batches):
    """GradFix's mask on a transported update: keep the coordinates whose
    sign agrees with the target's majority descent vote."""
    votes = bt.collect_votes(case.B, batches, loss_fn, show_progress=False)
    out = {}
    for k, d in delta.items():
        upd, _ = votes[k].apply(np.ascontiguousarray(d, np.float32), 1.0)
        out[k] = upd.reshape(d.shape)
    return out


def head_fit(case, batches, ridge):
    """Only the head, fitted to the source head's output change (carried by
    the head's output map) on the original target's features."""
    col = bt.collect_statistics(case.A, case.B, batches, loss_fn,
                                modules=["head"], show_progress=False)
    r_out = col.maps()["head"]["out"][0]
    feats = {}
    def grab(model, key):
        return model.head.register_forward_hook(
            lambda m, i, o: feats.setdefault(key, []).append(
                (i[0].detach(), o.detach())))
    hs = [grab(case.A, "a"), grab(case.Aft, "t"), grab(case.B, "b")]
    with torch.no_grad():
        for x, _ in batches:
            case.A(x), case.Aft(x), case.B(x)
    for h in hs:
        h.remove()
    head = case.B.head
    f = Fit(head.in_features, head.out_features, bias=True, ridge=ridge)
    for (_, ya), (_, yt), (xb, _) in zip(feats["a"], feats["t"], feats["b"]):
        d = (yt - ya).double().numpy() @ r_out
        xb = xb.numpy()
        f.add(xb, xb, d.astype(np.float32))
    dw, db = f.solve(head.weight.detach().numpy(),
                     head.bias.detach().numpy())
    return {"head.weight": dw, "head.bias": db}


# ---- the cells ----

def cell(case, method, variant, calib):
    """{"acc", "alpha", "acc_oracle", "alpha_oracle", ...} of one cell."""
    batches = calib_batches(case.task, calib)
    A, Aft, B = case.A, case.Aft, case.B
    res = {}
    if method == "fit":
        ridge = variant.get("ridge", 1e-2)
        new = bt.transfer_model(A, Aft, B, batches, method="fit",
                                loss_fn=loss_fn, ridge=ridge,
                                shared_out=variant.get("shared_out", ()))
        delta = delta_of(new, case.b0)
        res["alpha"] = 1.0
    elif method == "head-fit":
        delta = head_fit(case, batches, variant.get("ridge", 1e-2))
        res["alpha"] = 1.0
    else:
        opts = {}
        if variant.get("whiten"):
            opts["whiten"] = variant["whiten"]
        new = bt.transfer_model(A, Aft, B, batches, method=method,
                                loss_fn=loss_fn, alpha=1.0, **opts)
        delta = delta_of(new, case.b0)
        if variant.get("mask"):
            delta = sign_mask(case, delta, batches)
        if variant.get("per_layer"):
            delta = per_layer_scale(case, delta, batches)
            res["alpha"] = 1.0
        else:
            a, _ = bt.choose_alpha(A, Aft, B, delta, batches, rule="match")
            res["alpha"] = a
            ae, _ = bt.choose_alpha(A, Aft, B, delta, batches,
                                    rule="entropy")
            res["alpha_entropy"] = ae
            res["acc_entropy"] = case.acc(with_alpha(case.b0, delta, ae))
    res["acc"] = case.acc(with_alpha(case.b0, delta, res["alpha"]))
    ao = case.oracle(delta)
    res["alpha_oracle"] = ao
    res["acc_oracle"] = case.acc(with_alpha(case.b0, delta, ao))
    return res


# (label, method, variant, calibration images, shapes: "same" or "all")
ROWS = [
    ("naive", "naive", {}, 100, "same"),
    ("gradfix", "gradfix", {}, 100, "same"),
    ("pad", "pad", {}, 100, "same"),
    ("bico", "bico", {}, 100, "all"),
    ("bico-in", "bico-in", {}, 100, "all"),
    ("bico-out", "bico-out", {}, 100, "all"),
    ("fit", "fit", {}, 100, "all"),
    # what else the issue asked to try
    ("bico per-layer scale", "bico", {"per_layer": True}, 100, "all"),
    ("bico + sign mask", "bico", {"mask": True}, 100, "all"),
    ("bico whiten 0.5", "bico", {"whiten": 0.5}, 100, "all"),
    ("bico 400 calib", "bico", {}, 400, "all"),
    ("head fit alone", "head-fit", {}, 100, "all"),
    ("fit shared head", "fit", {"shared_out": ["head"]}, 100, "all"),
    ("fit c=1e-3", "fit", {"ridge": 1e-3}, 100, "all"),
    ("fit c=1e-1", "fit", {"ridge": 1e-1}, 100, "all"),
    ("fit 400 calib", "fit", {}, 400, "all"),
    ("fit 1000 calib", "fit", {}, 1000, "all"),
]


def key_of(*parts):
    blob = json.dumps([RESULTS_VERSION, vit.CODE_VERSION, config.SOURCE,
                       config.TARGETS, config.FT] + list(parts),
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default=",".join(vit.TASKS))
    ap.add_argument("--targets", default=",".join(config.TARGETS))
    ap.add_argument("--rows", default=None,
                    help="comma-separated row labels (default: all)")
    ap.add_argument("--fresh", action="store_true",
                    help="recompute every cell (models stay cached)")
    ap.add_argument("--cached", action="store_true",
                    help="print only the cells already computed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    log = lambda s: print("[%5.0fs] %s" % (time.time() - t0, s),
                          file=sys.stderr, flush=True)
    os.makedirs(vit.CACHE, exist_ok=True)
    rpath = os.path.join(vit.CACHE, "results.json")
    store = {}
    if os.path.exists(rpath) and not args.fresh:
        with open(rpath) as f:
            store = json.load(f)

    def save():
        # merge with what another run may have written meanwhile
        if os.path.exists(rpath):
            with open(rpath) as f:
                disk = json.load(f)
            disk.update(store)
            store.update(disk)
        tmp = rpath + ".tmp.%d" % os.getpid()
        with open(tmp, "w") as f:
            json.dump(store, f, indent=1, sort_keys=True)
        os.replace(tmp, rpath)
    tasks = args.tasks.split(",")
    targets = args.targets.split(",")
    rows = [r for r in ROWS if args.rows is None
            or r[0] in args.rows.split(",")]
    table = {}
    for task in tasks:
        for tname in targets:
            case = None
            cid = "%s/%s" % (task, tname)
            k = key_of(cid, "ends")
            if args.cached and k not in store:
                continue
            if k not in store:
                case = case or Case(task, tname, log)
                store[k] = {"zs": case.acc(case.b0),
                            "ft": case.acc(case.Bft.state_dict()),
                            "src_zs": vit.accuracy(case.A, *case.test),
                            "src_ft": vit.accuracy(case.Aft, *case.test)}
                save()
            table[cid] = {"ends": store[k]}
            for label, method, variant, calib, shapes in rows:
                if shapes == "same" and tname != "same":
                    continue
                # non-fit cells depend on choose_alpha's rule (version 2)
                k = key_of(cid, label, method, variant, calib) \
                    if method in ("fit", "head-fit") or variant.get(
                        "per_layer") else key_of(cid, label, method,
                                                 variant, calib, "match2")
                if args.cached and k not in store:
                    continue
                if k not in store:
                    case = case or Case(task, tname, log)
                    t1 = time.time()
                    store[k] = cell(case, method, variant, calib)
                    store[k]["seconds"] = time.time() - t1
                    log("%s %s: %.3f (alpha %g)" % (cid, label,
                                                    store[k]["acc"],
                                                    store[k]["alpha"]))
                    save()
                table[cid][label] = store[k]
    print_table(table, rows, tasks, targets)


def gap(acc, e):
    return (acc - e["zs"]) / (e["ft"] - e["zs"])


def print_table(table, rows, tasks, targets):
    cids = [c for c in ("%s/%s" % (t, s) for t in tasks for s in targets)
            if c in table]
    w = 14
    print("Test accuracy (%%) and share of the zero-shot -> fine-tuned gap "
          "closed (%%), alpha without labels; source width %d depth %d"
          % (config.SOURCE["width"], config.SOURCE["depth"]))
    print("targets: " + ", ".join("%s = width %d depth %d" % (
        n, c["width"], c["depth"]) for n, c in config.TARGETS.items()))
    head = "%-22s" % "method" + "".join("%*s" % (w, c) for c in cids)
    print(head + "%*s%*s%*s" % (10, "mean gap", 10, "oracle-a", 10,
                                  "bico same"))
    def line(label, vals, mean, extra="", ref=""):
        print("%-22s" % label + "".join("%*s" % (w, v) for v in vals)
              + "%*s%*s%*s" % (10, mean, 10, extra, 10, ref))
    line("zero-shot", ["%.1f" % (100 * table[c]["ends"]["zs"])
                       for c in cids], "0")
    rows = [r for r in rows if any(r[0] in table[c] for c in cids)]
    for label, *_ in rows:
        vals, gaps, gapso, ref = [], [], [], []
        for c in cids:
            r = table[c].get(label)
            if r is None:
                vals.append("-")
                continue
            g = gap(r["acc"], table[c]["ends"])
            gaps.append(g)
            gapso.append(gap(r["acc_oracle"], table[c]["ends"]))
            if "bico" in table[c]:
                ref.append(gap(table[c]["bico"]["acc"], table[c]["ends"]))
            vals.append("%.1f %4.0f%%" % (100 * r["acc"], 100 * g))
        pc = lambda v: "%.0f%%" % (100 * np.mean(v)) if v else "-"
        line(label, vals, pc(gaps), pc(gapso), pc(ref))
    line("fine-tuned", ["%.1f" % (100 * table[c]["ends"]["ft"])
                        for c in cids], "100%")
    print()
    print("alpha chosen without labels (match) / by validation labels / "
          "by entropy:")
    print("%-22s" % "method" + "".join("%*s" % (w, c) for c in cids))
    for label, *_ in rows:
        al = [table[c].get(label) for c in cids]
        print("%-22s" % label + "".join(
            "%*s" % (w, "-" if r is None else "%.2g/%.2g/%s" % (
                r["alpha"], r["alpha_oracle"], "%.2g" % r["alpha_entropy"]
                if "alpha_entropy" in r else "-"))
            for r in al))
    ent = [(label, [gap(table[c][label]["acc_entropy"], table[c]["ends"])
                    for c in cids if label in table[c]
                    and "acc_entropy" in table[c][label]])
           for label, *_ in rows]
    print()
    print("mean gap closed with alpha by entropy: " + ", ".join(
        "%s %.0f%%" % (l, 100 * np.mean(g)) for l, g in ent if g))
    print("source: zero-shot / fine-tuned accuracy per task: " + ", ".join(
        "%s %.1f/%.1f" % (t, 100 * table[c]["ends"]["src_zs"],
                          100 * table[c]["ends"]["src_ft"])
        for t in tasks for c in cids if c.startswith(t + "/")
        and c.endswith("/" + targets[0])))


if __name__ == "__main__":
    main()
