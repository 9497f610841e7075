"""bico.torch.ridge: the ridge of the sequential fit in PyTorch: a prior (the
update pulled towards BiCo's instead of towards zero), a penalty metric
(the second moment of a layer's inputs on general text,
_input_moments) and a choice of c by generalised cross-validation
(GCV_GRID).  RidgeFit solves a layer's rows as bico.fit.Fit does, with
these; bico.torch.fit's host uses it when one of them is asked for.
"""
import math

import numpy as np
import torch
import torch.nn as nn

from .._status import BicoError, E_ARG, E_SHAPE

__all__ = ["RidgeFit"]

# GCV's candidates: lambda = c tr(X'^T X') / d_in, c on this log grid
GCV_GRID = tuple(10.0 ** (k / 4.0) for k in range(-28, 13))


class RidgeFit(object):
    """One layer's fit with the options bico.fit.Fit does not have
    (docs/METHODS.md, "The fit's regulariser, chosen in closed form"):

      [dW db] = argmin ||X~'[W+dW, b+db]^T - (X~_B [W, b]^T + D_B)||^2
                + lambda ||(dW - P0) M^(1/2)||^2

    prior P0 (d_out x d_in; None: zero) -- with no rows, or lambda -> inf,
    dW = P0 (the bias update is 0 without rows and never penalised);
    metric M (d_in x d_in, symmetric PSD; None: the identity) -- scaled to
    trace d_in, so M = I is the plain ridge; ridge c >= 0 (lambda = c
    tr(X'^T X') / d_in over the weight columns, as bico.fit.Fit) or "gcv":
    c chosen per layer from GCV_GRID by generalised cross-validation
    (RSS / (n (1 - df/n)^2), df counting the bias column).  Streams in
    double: X~'^T X~', X~'^T R, ||R||^2 with R = X~_B Theta^T + D_B -
    X~'(Theta + P0)^T, so the layer's W and b are given at creation."""

    def __init__(self, d_in, d_out, w, b=None, ridge=1e-2, prior=None,
                 metric=None, rank_tol=1e-10):
        self.d_in, self.d_out = int(d_in), int(d_out)
        self.bias = b is not None
        a = self.d_in + (1 if self.bias else 0)
        self.a = a
        if not (ridge == "gcv" or (isinstance(ridge, (int, float))
                                   and math.isfinite(ridge) and ridge >= 0)):
            raise BicoError(E_ARG, "RidgeFit: ridge must be >= 0 or 'gcv', "
                            "got %r" % (ridge,))
        self.ridge = ridge
        self.tol = rank_tol
        w = np.asarray(w, dtype=np.float64)
        theta = np.zeros((self.d_out, a))
        theta[:, :self.d_in] = w
        if self.bias:
            theta[:, self.d_in] = np.asarray(b, dtype=np.float64)
        self.theta = theta
        self.prior = None if prior is None else \
            np.asarray(prior, dtype=np.float64).reshape(self.d_out, self.d_in)
        shifted = theta.copy()
        if self.prior is not None:
            shifted[:, :self.d_in] += self.prior
        self.shifted = shifted
        if metric is not None:
            m = np.asarray(metric, dtype=np.float64)
            if m.shape != (self.d_in, self.d_in):
                raise BicoError(E_SHAPE, "RidgeFit: the penalty metric is "
                                "%s, expected %d x %d" % (
                                    m.shape, self.d_in, self.d_in))
            tr = float(np.trace(m))
            if not (tr > 0 and math.isfinite(tr)):
                raise BicoError(E_ARG, "RidgeFit: the penalty metric has "
                                "trace %r; it must be positive" % tr)
            metric = 0.5 * (m + m.T) * (self.d_in / tr)
        self.metric = metric
        self.g = np.zeros((a, a))
        self.q = np.zeros((a, self.d_out))
        self.rr = 0.0
        self.rows = 0
        self.rank = None
        self.chosen = None   # the c used at the last solve

    def _tilde(self, x):
        x = np.asarray(x, dtype=np.float64)
        if self.bias:
            x = np.hstack([x, np.ones((x.shape[0], 1))])
        return x

    def add(self, x_new, x_orig, delta):
        xn = self._tilde(x_new)
        xo = self._tilde(x_orig)
        r = xo @ self.theta.T + np.asarray(delta, dtype=np.float64) \
            - xn @ self.shifted.T
        self.g += xn.T @ xn
        self.q += xn.T @ r
        self.rr += float(np.sum(r * r))
        self.rows += xn.shape[0]
        return self

    def solve(self, w=None, b=None):
        """(dW, db): the update of W and b (float32; db None without a
        bias).  w, b are ignored (given at creation)."""
        d = self.d_in
        p0 = np.zeros((self.d_out, d)) if self.prior is None else self.prior
        if self.rows == 0:
            self.rank = 0
            return (p0.astype(np.float32),
                    np.zeros(self.d_out, np.float32) if self.bias else None)
        n = float(self.rows)
        gxx, qx = self.g[:d, :d], self.q[:d]
        rss0 = self.rr
        if self.bias:
            gx, qb = self.g[:d, d], self.q[d]
            gc = gxx - np.outer(gx, gx) / n
            zc = qx - np.outer(gx, qb) / n
            rss0 -= float(qb @ qb) / n
        else:
            gc, zc = gxx, qx
        if self.metric is not None:
            mv, mu = np.linalg.eigh(self.metric)
            floor = max(float(mv[-1]), 0.0) * 1e-8
            mv = np.maximum(mv, floor if floor > 0 else 1e-300)
            wh = (mu / np.sqrt(mv)) @ mu.T          # M^(-1/2)
            gc = wh @ gc @ wh
            zc = wh @ zc
        s, v = np.linalg.eigh(0.5 * (gc + gc.T))
        s = np.maximum(s, 0.0)
        smax = float(s[-1]) if s.size else 0.0
        self.rank = int(np.sum(s > self.tol * smax)) if smax > 0 else 0
        z = v.T @ zc
        zz = np.sum(z * z, axis=1)
        scale = float(np.trace(gxx)) / d
        if self.ridge == "gcv":
            best = None
            for c in GCV_GRID:
                lam = c * scale
                den = s + lam
                with np.errstate(divide="ignore", invalid="ignore"):
                    inv = np.where(den > 0, 1.0 / den, 0.0)
                rss = rss0 - float(np.sum((2 * inv - s * inv * inv) * zz))
                df = float(np.sum(s * inv)) + (1 if self.bias else 0)
                if df >= n:
                    continue
                score = max(rss, 0.0) / (n * (1.0 - df / n) ** 2)
                if best is None or score < best[0]:
                    best = (score, c)
            c = GCV_GRID[-1] if best is None else best[1]
        else:
            c = float(self.ridge)
        self.chosen = c
        lam = c * scale
        den = s + lam
        thr = (self.tol * smax) if lam == 0 else 0.0
        inv = np.where(den > thr, 1.0 / np.where(den > 0, den, 1.0), 0.0)
        ex = v @ (inv[:, None] * z)                 # d x d_out
        if self.metric is not None:
            ex = wh @ ex
        dw = p0 + ex.T
        db = None
        if self.bias:
            db = (self.q[d] - gx @ ex) / n
            db = db.astype(np.float32)
        return dw.astype(np.float32), db


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
