/* Thin solves: the Procrustes map of C = X_a^T X_b from the rows X_a
 * (n x d_a) and X_b (n x d_b) themselves, for n <= min(d_a, d_b), without
 * forming the d_a x d_b statistic or taking its SVD (docs/methods.md,
 * "Thin solves").
 *
 * Householder QR of each side's transposed rows, X_a^T = Q_a [T_a; 0] and
 * X_b^T = Q_b [T_b; 0] (T n x n upper triangular, Q d x d orthogonal, kept
 * as n reflectors), gives C = Q_a [K 0; 0 0] Q_b^T with the core
 * K = T_a T_b^T (n x n).  With K = U S V^T, C's nonzero singular values are
 * S's and its singular vectors Q_a [U; 0] and Q_b [V; 0]; so
 *   R = Q_a M Q_b^T,  M = [U_k V_k^T 0; 0 J]  (d_a x d_b),
 * with k the numerical rank (BICO_NULL_DROP: k pairs, J = 0) or all n
 * pairs and J the rectangular identity of (d_a - n) x (d_b - n)
 * (BICO_NULL_KEEP: a semi-orthogonal completion).  R is formed in panels
 * of rows, each by two applications of the reflectors (dormqr), so the
 * working memory is the rows plus one panel, never a d_a x d_b double. */
#include <limits.h>
#include <math.h>
#include <string.h>

#include "internal.h"
#include "lapack.h"

/* Rows of R formed per panel. */
#define THIN_PANEL 256

static int ceil_int(double w, int *out) {
  if (!(w >= 1.0)) w = 1.0;
  if (w >= (double)INT_MAX) return 1;
  *out = (int)ceil(w);
  return 0;
}

/* rows (n x d, row stride ld, float) into x (n x d row-major double, i.e.
 * the column-major d x n matrix X^T that dgeqrf factors), centered when
 * asked. */
static void load_rows(size_t n, size_t d, const float *rows, size_t ld,
                      int center, double *x) {
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < d; j++) x[i * d + j] = rows[i * ld + j];
  if (!center || n == 0) return;
  for (size_t j = 0; j < d; j++) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += x[i * d + j];
    const double mu = s / (double)n;
    for (size_t i = 0; i < n; i++) x[i * d + j] -= mu;
  }
}

/* QR of the column-major d x n matrix in x; tau receives n scalars. */
static bico_status qr(bico_ctx *ctx, const char *fn, size_t d, size_t n,
                      double *x, double *tau) {
  const int m = (int)d, ni = (int)n;
  int info = 0, lwork = -1;
  double wq = 0;
  dgeqrf_(&m, &ni, x, &m, tau, &wq, &lwork, &info);
  if (info != 0 || ceil_int(wq, &lwork))
    return bico__fail(ctx, BICO_E_INTERNAL,
                      "%s: dgeqrf workspace query failed (info %d)", fn, info);
  double *work = bico__calloc(ctx, (size_t)lwork, sizeof(double));
  if (work == NULL) return BICO_E_NOMEM;
  dgeqrf_(&m, &ni, x, &m, tau, work, &lwork, &info);
  bico__free(ctx, work);
  if (info != 0)
    return bico__fail(ctx, BICO_E_INTERNAL, "%s: dgeqrf failed (info %d)", fn,
                      info);
  return BICO_OK;
}

/* c (column-major m x p, ld m) <- op(Q) c, with Q the d x d product of
 * the n reflectors in qrx (d = m). */
static bico_status apply_q(bico_ctx *ctx, const char *fn, const char *trans,
                           size_t m, size_t p, size_t n, const double *qrx,
                           const double *tau, double *c) {
  const int mi = (int)m, pi = (int)p, ni = (int)n;
  int info = 0, lwork = -1;
  double wq = 0;
  dormqr_("L", trans, &mi, &pi, &ni, qrx, &mi, tau, c, &mi, &wq, &lwork,
          &info, 1, 1);
  if (info != 0 || ceil_int(wq, &lwork))
    return bico__fail(ctx, BICO_E_INTERNAL,
                      "%s: dormqr workspace query failed (info %d)", fn, info);
  double *work = bico__calloc(ctx, (size_t)lwork, sizeof(double));
  if (work == NULL) return BICO_E_NOMEM;
  dormqr_("L", trans, &mi, &pi, &ni, qrx, &mi, tau, c, &mi, work, &lwork,
          &info, 1, 1);
  bico__free(ctx, work);
  if (info != 0)
    return bico__fail(ctx, BICO_E_INTERNAL, "%s: dormqr failed (info %d)", fn,
                      info);
  return BICO_OK;
}

/* SVD of the column-major n x n core k (destroyed): s, u (column-major),
 * vt (column-major). */
static bico_status core_svd(bico_ctx *ctx, const char *fn, size_t n, double *k,
                            double *s, double *u, double *vt) {
  const int ni = (int)n;
  int info = 0, lwork = -1;
  double wq = 0;
  bico_status st = BICO_OK;
  double *save = bico__calloc(ctx, n * n, sizeof(double));
  int *iwork = bico__calloc(ctx, n, 8 * sizeof(int));
  double *work = NULL;
  if (save == NULL || iwork == NULL) { st = BICO_E_NOMEM; goto done; }
  memcpy(save, k, n * n * sizeof(double));
  dgesdd_("S", &ni, &ni, k, &ni, s, u, &ni, vt, &ni, &wq, &lwork, iwork, &info,
          1);
  if (info != 0 || ceil_int(wq, &lwork)) {
    st = bico__fail(ctx, BICO_E_INTERNAL,
                    "%s: dgesdd workspace query failed (info %d)", fn, info);
    goto done;
  }
  work = bico__calloc(ctx, (size_t)lwork, sizeof(double));
  if (work == NULL) { st = BICO_E_NOMEM; goto done; }
  dgesdd_("S", &ni, &ni, k, &ni, s, u, &ni, vt, &ni, work, &lwork, iwork,
          &info, 1);
  if (info > 0) {
    /* As the full solve: dgesvd when divide and conquer fails. */
    memcpy(k, save, n * n * sizeof(double));
    bico__free(ctx, work);
    work = NULL;
    lwork = -1;
    dgesvd_("S", "S", &ni, &ni, k, &ni, s, u, &ni, vt, &ni, &wq, &lwork, &info,
            1, 1);
    if (info != 0 || ceil_int(wq, &lwork)) {
      st = bico__fail(ctx, BICO_E_INTERNAL,
                      "%s: dgesvd workspace query failed (info %d)", fn, info);
      goto done;
    }
    work = bico__calloc(ctx, (size_t)lwork, sizeof(double));
    if (work == NULL) { st = BICO_E_NOMEM; goto done; }
    dgesvd_("S", "S", &ni, &ni, k, &ni, s, u, &ni, vt, &ni, work, &lwork,
            &info, 1, 1);
    if (info > 0)
      st = bico__fail(ctx, BICO_E_NUMERIC,
                      "%s: the SVD of the %zu x %zu core did not converge", fn,
                      n, n);
  }
  if (st == BICO_OK && info < 0)
    st = bico__fail(ctx, BICO_E_INTERNAL, "%s: LAPACK rejected argument %d",
                    fn, -info);
done:
  bico__free(ctx, save);
  bico__free(ctx, iwork);
  bico__free(ctx, work);
  return st;
}

bico_status bico__thin_solve(bico_ctx *ctx, const char *fn, size_t n,
                             size_t d_a, size_t d_b, const float *x_a,
                             size_t ld_a, const float *x_b, size_t ld_b,
                             int center, double tol, int keep, float *r,
                             size_t ld_r, size_t *rank, double **spec) {
  const size_t mn = d_a < d_b ? d_a : d_b;
  bico_status st = BICO_OK;
  double *xa = NULL, *xb = NULL, *ta = NULL, *tb = NULL, *k = NULL, *s = NULL,
         *u = NULL, *vt = NULL, *uv = NULL, *w = NULL, *y = NULL;
  size_t rk = 0;
  *spec = NULL;
  if (n > mn || d_a > INT_MAX || d_b > INT_MAX)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: a thin solve needs rows n = %zu <= min(%zu, %zu)",
                      fn, n, d_a, d_b);
  s = bico__calloc(ctx, mn, sizeof(double));
  if (s == NULL) return BICO_E_NOMEM;
  const size_t p = THIN_PANEL < d_a ? THIN_PANEL : d_a;
  if (n > 0) {
    xa = bico__calloc(ctx, n * d_a, sizeof(double));
    xb = bico__calloc(ctx, n * d_b, sizeof(double));
    ta = bico__calloc(ctx, n, sizeof(double));
    tb = bico__calloc(ctx, n, sizeof(double));
    k = bico__calloc(ctx, n * n, sizeof(double));
    u = bico__calloc(ctx, n * n, sizeof(double));
    vt = bico__calloc(ctx, n * n, sizeof(double));
    if (!xa || !xb || !ta || !tb || !k || !u || !vt) {
      st = BICO_E_NOMEM;
      goto done;
    }
    load_rows(n, d_a, x_a, ld_a, center, xa);
    load_rows(n, d_b, x_b, ld_b, center, xb);
    st = qr(ctx, fn, d_a, n, xa, ta);
    if (st == BICO_OK) st = qr(ctx, fn, d_b, n, xb, tb);
    if (st != BICO_OK) goto done;
    /* The core in column-major order: K (col-major) = K^T (row-major)
     * = T_b T_a^T, and the triangles (upper, column-major) read row-major
     * are T^T, so K^T = (T_b^T)^T (T_a^T).  Zero the reflectors below the
     * diagonal in copies. */
    double *la = u, *lb = vt; /* scratch until the SVD */
    for (size_t i = 0; i < n; i++)
      for (size_t j = 0; j < n; j++) {
        la[i * n + j] = j <= i ? xa[i * d_a + j] : 0.0;
        lb[i * n + j] = j <= i ? xb[i * d_b + j] : 0.0;
      }
    bico__dgemm(ctx, 1, 0, n, n, n, 1.0, lb, n, la, n, 0.0, k, n);
    st = core_svd(ctx, fn, n, k, s, u, vt);
    if (st != BICO_OK) goto done;
    const double cut = tol * s[0];
    for (size_t i = 0; i < n; i++)
      if (s[i] > cut) rk++;
  }
  if (n == 0 || s[0] == 0.0) {
    /* As the full solve: nothing identified; KEEP gives the rectangular
     * identity, DROP zero. */
    rk = 0;
    for (size_t i = 0; i < d_a; i++) {
      memset(r + i * ld_r, 0, d_b * sizeof(float));
      if (keep && i < d_b) r[i * ld_r + i] = 1.0f;
    }
    goto done_ok;
  }
  {
    const size_t kk = keep ? n : rk;
    /* UV = U_kk V_kk^T, row-major n x n: U's columns are the rows of the
     * column-major buffer u read row-major, V's rows those of vt's. */
    uv = bico__calloc(ctx, n * n, sizeof(double));
    w = bico__calloc(ctx, p * d_a, sizeof(double));
    y = bico__calloc(ctx, p * d_b, sizeof(double));
    if (!uv || !w || !y) { st = BICO_E_NOMEM; goto done; }
    if (kk > 0)
      bico__dgemm(ctx, 1, 1, n, n, kk, 1.0, u, n, vt, n, 0.0, uv, n);
    for (size_t i0 = 0; i0 < d_a && st == BICO_OK; i0 += p) {
      const size_t pp = d_a - i0 < p ? d_a - i0 : p;
      /* W = Q_a^T E (E the unit columns i0..i0+pp): column j of W, read
       * row-major as row j, is row i0 + j of Q_a. */
      memset(w, 0, pp * d_a * sizeof(double));
      for (size_t j = 0; j < pp; j++) w[j * d_a + i0 + j] = 1.0;
      st = apply_q(ctx, fn, "T", d_a, pp, n, xa, ta, w);
      if (st != BICO_OK) break;
      /* Y = Q_a[rows, :] M (pp x d_b, row-major). */
      memset(y, 0, pp * d_b * sizeof(double));
      bico__dgemm(ctx, 0, 0, pp, n, n, 1.0, w, d_a, uv, n, 0.0, y, d_b);
      if (keep)
        for (size_t j = 0; j < pp; j++)
          for (size_t t = n; t < mn; t++) y[j * d_b + t] = w[j * d_a + t];
      /* R[rows, :] = Y Q_b^T: row-major Y is column-major Y^T, and
       * (Q_b Y^T)^T = Y Q_b^T. */
      st = apply_q(ctx, fn, "N", d_b, pp, n, xb, tb, y);
      for (size_t j = 0; j < pp && st == BICO_OK; j++)
        for (size_t c = 0; c < d_b; c++)
          r[(i0 + j) * ld_r + c] = (float)y[j * d_b + c];
    }
    if (st != BICO_OK) goto done;
  }
done_ok:
  if (rank) *rank = rk;
  *spec = s;
  s = NULL;
done:
  bico__free(ctx, xa);
  bico__free(ctx, xb);
  bico__free(ctx, ta);
  bico__free(ctx, tb);
  bico__free(ctx, k);
  bico__free(ctx, s);
  bico__free(ctx, u);
  bico__free(ctx, vt);
  bico__free(ctx, uv);
  bico__free(ctx, w);
  bico__free(ctx, y);
  return st;
}

bico_status bico_procrustes_solve_rows(bico_procrustes *p, size_t n,
                                       size_t d_a, size_t d_b,
                                       const float *x_a, size_t ld_a,
                                       const float *x_b, size_t ld_b,
                                       float *r, size_t ld_r, size_t *rank,
                                       int *thin) {
  static const char fn[] = "procrustes_solve_rows";
  if (p == NULL) return BICO_E_NULL;
  bico_ctx *ctx = bico__procrustes_ctx(p);
  bico__clear(ctx);
  if (r == NULL || (n > 0 && (x_a == NULL || x_b == NULL)))
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      r == NULL ? "r" : x_a == NULL ? "x_a" : "x_b");
  if (d_a == 0 || d_b == 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: dimensions must be positive, got d_a = %zu, d_b = "
                      "%zu",
                      fn, d_a, d_b);
  if (ld_a < d_a || ld_b < d_b || ld_r < d_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: a row stride is below its width (ld_a = %zu, d_a = "
                      "%zu, ld_b = %zu, d_b = %zu, ld_r = %zu)",
                      fn, ld_a, d_a, ld_b, d_b, ld_r);
  size_t total;
  if (bico__mul(d_a, d_b, &total) || bico__mul(n, ld_a, &total) ||
      bico__mul(n, ld_b, &total))
    return bico__fail(ctx, BICO_E_SHAPE, "%s: sizes overflow", fn);
  bico_status st = BICO_OK;
  if (n > 0) st = bico__check_finite_f32(ctx, fn, "x_a", x_a, n, d_a, ld_a);
  if (st == BICO_OK && n > 0)
    st = bico__check_finite_f32(ctx, fn, "x_b", x_b, n, d_b, ld_b);
  if (st != BICO_OK) return st;
  double center = 0, whiten = 0, tol = 0, null_mode = 0;
  bico_procrustes_get_param(p, BICO_PROC_CENTER, &center);
  bico_procrustes_get_param(p, BICO_PROC_WHITEN, &whiten);
  bico_procrustes_get_param(p, BICO_PROC_RANK_TOL, &tol);
  bico_procrustes_get_param(p, BICO_PROC_NULL, &null_mode);
  const size_t mn = d_a < d_b ? d_a : d_b;
  if (n <= mn && whiten == 0) {
    double *spec = NULL;
    st = bico__thin_solve(ctx, fn, n, d_a, d_b, x_a, ld_a, x_b, ld_b,
                          center != 0, tol, null_mode != BICO_NULL_DROP, r,
                          ld_r, rank, &spec);
    if (st == BICO_OK) bico__procrustes_take_spectrum(p, spec, mn);
    if (thin) *thin = 1;
    return st;
  }
  /* More rows than the smaller width, or whitening: the statistic. */
  bico_xcov *xc = NULL;
  unsigned flags = (center != 0 ? BICO_XCOV_SUMS : 0) |
                   (whiten > 0 ? BICO_XCOV_GRAMS : 0);
  st = bico_xcov_create(ctx, d_a, d_b, flags, &xc);
  if (st == BICO_OK && n > 0) st = bico_xcov_add(xc, n, x_a, ld_a, x_b, ld_b);
  if (st == BICO_OK) st = bico_procrustes_solve(p, xc, r, ld_r, rank);
  bico_xcov_free(xc);
  if (st == BICO_OK && thin) *thin = 0;
  return st;
}
