"""A stand-in for bico.fit.Fit (the C solver's Python wrapper) with the same
interface, used only until that lands in main.  float64 NumPy."""
import numpy as np


class Fit(object):
    def __init__(self, d_in, d_out, bias=True, ridge=1e-2):
        self.d_in, self.d_out, self.bias, self.ridge = d_in, d_out, bias, ridge
        k = d_in + (1 if bias else 0)
        self.g = np.zeros((k, k))      # Z'^T Z'
        self.c = np.zeros((k, k))      # Z'^T Z_B
        self.e = np.zeros((k, d_out))  # Z'^T D
        self.rows = 0
        self.rank = 0

    def _z(self, x):
        x = np.asarray(x, np.float64)
        if self.bias:
            x = np.hstack([x, np.ones((x.shape[0], 1))])
        return x

    def add(self, x_new, x_orig, delta):
        zn, zo = self._z(x_new), self._z(x_orig)
        self.g += zn.T @ zn
        self.c += zn.T @ zo
        self.e += zn.T @ np.asarray(delta, np.float64)
        self.rows += zn.shape[0]

    def merge(self, other):
        self.g += other.g
        self.c += other.c
        self.e += other.e
        self.rows += other.rows

    def solve(self, w, b=None):
        d = self.d_in
        theta = np.asarray(w, np.float64).T
        if self.bias:
            theta = np.vstack([theta, np.asarray(b, np.float64)[None, :]])
        lam = self.ridge * np.trace(self.g[:d, :d]) / d
        a = self.g.copy()
        a[np.arange(d), np.arange(d)] += lam
        rhs = self.c @ theta + self.e - self.g @ theta
        s = np.linalg.svd(self.g, compute_uv=False)
        self.rank = int((s > s[0] * 1e-10).sum()) if s.size and s[0] > 0 \
            else 0
        delta = np.linalg.lstsq(a, rhs, rcond=None)[0]
        dw = delta[:d].T.astype(np.float32)
        db = delta[d].astype(np.float32) if self.bias else None
        return dw, db
