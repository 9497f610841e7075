/* bico_procrustes: from a cross-covariance C to R = U V^T (thin SVD in
 * double through LAPACK), with centering, whitening, numerical rank and the
 * completion of a rank-deficient statistic. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include <blis.h>

#include "internal.h"
#include "lapack.h"


/* BICO_PROC_EIG is used only when sigma_min / sigma_max exceeds this (and
 * the rank tolerance): the eigenvalues of C C^T carry absolute errors of
 * about eps * sigma_max^2, so at sigma_min / sigma_max = 1e-4 the smallest
 * singular value is still known to about 1e-8 relative. */
#define EIG_MIN_RATIO 1e-4
/* Rows of R formed per GEMM by the EIG route (a panel of doubles). */
#define EIG_PANEL 256
/* Power steps estimating lambda_max of the Gram for the Cholesky test. */
#define EIG_POWER_STEPS 8
/* Newton-Schulz: stop once ||X X^T - I||_F is below this (one more step
 * then squares it), give up (and use the SVD) after POLAR_MAX_ITER. */
#define POLAR_CONVERGED 1e-7
#define POLAR_MAX_ITER 100

struct bico_procrustes {
  bico_ctx *ctx;
  int center;
  double whiten;
  double eps;
  double tol;
  int null_mode;
  int method;   /* bico_procrustes_method */
  double *spec; /* singular values of the last successful solve */
  size_t spec_count;
};

bico_status bico_procrustes_create(bico_ctx *ctx, bico_procrustes **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "procrustes_create: out is NULL");
  *out = NULL;
  bico_procrustes *p = bico__alloc(ctx, sizeof *p);
  if (p == NULL) return BICO_E_NOMEM;
  p->ctx = ctx;
  p->center = 0;
  p->whiten = 0.0;
  p->eps = 1e-6;
  p->tol = 1e-5;
  p->null_mode = BICO_NULL_KEEP;
  p->method = BICO_PROC_EIG;
  p->spec = NULL;
  p->spec_count = 0;
  *out = p;
  return BICO_OK;
}

void bico_procrustes_free(bico_procrustes *p) {
  if (p == NULL) return;
  bico_ctx *ctx = p->ctx;
  bico__free(ctx, p->spec);
  bico__free(ctx, p);
}

/* In the grammar of params.h (lib/base/params.c).  WHITEN_EPS must be
 * positive and RANK_TOL below 1 (else nothing would count towards the
 * rank): open ends.  NULL and METHOD are choices: 0 is the default
 * (status.h). */
static const bico__param_spec PPARAM[] = {
    [BICO_PROC_CENTER] = {"center", 0, 1, BICO_PARAM_INTEGER},
    [BICO_PROC_WHITEN] = {"whiten", 0, 0.5, 0},
    [BICO_PROC_WHITEN_EPS] = {"whiten_eps", 0, HUGE_VAL,
                              BICO_PARAM_LO_OPEN | BICO_PARAM_HI_OPEN},
    [BICO_PROC_RANK_TOL] = {"rank_tol", 0, 1, BICO_PARAM_HI_OPEN},
    [BICO_PROC_NULL] = {"null", 0, BICO_NULL_DROP, BICO_PARAM_INTEGER},
    [BICO_PROC_METHOD] = {"method", 0, BICO_PROC_POLAR, BICO_PARAM_INTEGER},
};

bico_status bico_procrustes_param_bounds(int param, double *lo, double *hi,
                                         unsigned *flags) {
  return bico__param_bounds(PPARAM, BICO__NSPEC(PPARAM), param, lo, hi, flags);
}

const char *bico_procrustes_param_name(int param) {
  return bico__param_name(PPARAM, BICO__NSPEC(PPARAM), param);
}

bico_status bico_procrustes_param_from_name(const char *name, int *param) {
  return bico__param_from_name(PPARAM, BICO__NSPEC(PPARAM), name, param);
}

bico_status bico_procrustes_set_param(bico_procrustes *p, int param,
                                      double value) {
  if (p == NULL) return BICO_E_NULL;
  bico__clear(p->ctx);
  bico_status st = bico__param_set(p->ctx, "procrustes_set_param", PPARAM,
                                   BICO__NSPEC(PPARAM), param, value);
  if (st != BICO_OK) return st;
  switch (param) {
    case BICO_PROC_CENTER: p->center = (int)value; break;
    case BICO_PROC_WHITEN: p->whiten = value; break;
    case BICO_PROC_WHITEN_EPS: p->eps = value; break;
    case BICO_PROC_RANK_TOL: p->tol = value; break;
    case BICO_PROC_NULL:
      p->null_mode = value == 0 ? BICO_NULL_KEEP : (int)value;
      break;
    case BICO_PROC_METHOD:
      p->method = value == 0 ? BICO_PROC_EIG : (int)value;
      break;
  }
  return BICO_OK;
}

bico_status bico_procrustes_get_param(const bico_procrustes *p, int param,
                                      double *value) {
  if (p == NULL) return BICO_E_NULL;
  bico_status st = bico__param_get(p->ctx, "procrustes_get_param", PPARAM,
                                   BICO__NSPEC(PPARAM), param, value);
  if (st != BICO_OK) return st;
  switch (param) {
    case BICO_PROC_CENTER: *value = p->center; break;
    case BICO_PROC_WHITEN: *value = p->whiten; break;
    case BICO_PROC_WHITEN_EPS: *value = p->eps; break;
    case BICO_PROC_RANK_TOL: *value = p->tol; break;
    case BICO_PROC_NULL: *value = p->null_mode; break;
    default: *value = p->method; break;
  }
  return BICO_OK;
}

bico_status bico_procrustes_spectrum(const bico_procrustes *p, double *s,
                                     size_t cap, size_t *count) {
  if (p == NULL) return BICO_E_NULL;
  bico_ctx *ctx = p->ctx;
  if (count == NULL)
    return bico__fail(ctx, BICO_E_NULL, "procrustes_spectrum: count is NULL");
  if (s == NULL && cap > 0)
    return bico__fail(ctx, BICO_E_NULL,
                      "procrustes_spectrum: s is NULL with cap = %zu", cap);
  size_t n = p->spec_count < cap ? p->spec_count : cap;
  if (n > 0) memcpy(s, p->spec, n * sizeof(double));
  *count = p->spec_count;
  return BICO_OK;
}

/* Workspace size from a LAPACK query, as an int LAPACK accepts. */
static int query_to_int(double w, int *out) {
  if (!(w >= 1.0) || w >= (double)INT_MAX) {
    if (w >= 1.0) return 1;
    w = 1.0;
  }
  *out = (int)ceil(w);
  return 0;
}

/* Replaces the symmetric n x n matrix g by (max(g, 0) + eps I)^(-power),
 * through the eigendecomposition g = Q diag(w) Q^T.  Clamping the
 * eigenvalues keeps the tiny negative ones rounding gives a PSD Gram from
 * blowing up. */
static bico_status inverse_power(bico_procrustes *p, const char *fn,
                                 double *g, size_t n, double power) {
  bico_ctx *ctx = p->ctx;
  const int ni = (int)n;
  int info = 0, lwork = -1, liwork = -1, iwq = 0;
  double wq = 0;
  bico_status st = BICO_OK;
  double *w = NULL, *work = NULL, *tmp = NULL, *save = NULL;
  int *iwork = NULL;

  w = bico__calloc(ctx, n, sizeof(double));
  tmp = bico__calloc(ctx, n * n, sizeof(double));
  save = bico__calloc(ctx, n * n, sizeof(double));
  if (w == NULL || tmp == NULL || save == NULL) { st = BICO_E_NOMEM; goto done; }
  memcpy(save, g, n * n * sizeof(double));

  /* g is symmetric, so row- and column-major storage are the same. */
  dsyevd_("V", "U", &ni, g, &ni, w, &wq, &lwork, &iwq, &liwork, &info, 1, 1);
  if (info != 0 || query_to_int(wq, &lwork) || iwq < 1) {
    st = bico__fail(ctx, BICO_E_INTERNAL,
                    "%s: dsyevd workspace query failed (info %d)", fn, info);
    goto done;
  }
  liwork = iwq;
  work = bico__calloc(ctx, (size_t)lwork, sizeof(double));
  iwork = bico__calloc(ctx, (size_t)liwork, sizeof(int));
  if (work == NULL || iwork == NULL) { st = BICO_E_NOMEM; goto done; }
  dsyevd_("V", "U", &ni, g, &ni, w, work, &lwork, iwork, &liwork, &info, 1, 1);
  if (info > 0) {
    /* Divide and conquer failed: retry with the QR algorithm. */
    memcpy(g, save, n * n * sizeof(double));
    bico__free(ctx, work);
    work = NULL;
    lwork = -1;
    dsyev_("V", "U", &ni, g, &ni, w, &wq, &lwork, &info, 1, 1);
    if (info != 0 || query_to_int(wq, &lwork)) {
      st = bico__fail(ctx, BICO_E_INTERNAL,
                      "%s: dsyev workspace query failed (info %d)", fn, info);
      goto done;
    }
    work = bico__calloc(ctx, (size_t)lwork, sizeof(double));
    if (work == NULL) { st = BICO_E_NOMEM; goto done; }
    dsyev_("V", "U", &ni, g, &ni, w, work, &lwork, &info, 1, 1);
    if (info > 0) {
      st = bico__fail(ctx, BICO_E_NUMERIC,
                      "%s: the eigendecomposition of the %zu x %zu Gram "
                      "matrix did not converge (dsyevd, dsyev info %d)",
                      fn, n, n, info);
      goto done;
    }
  }
  if (info < 0) {
    st = bico__fail(ctx, BICO_E_INTERNAL, "%s: dsyevd rejected argument %d",
                    fn, -info);
    goto done;
  }
  /* Column j of the column-major Q is row j of the row-major buffer qt:
   * qt = Q^T.  Result Q f(W) Q^T = qt^T (f(W) qt). */
  for (size_t j = 0; j < n; j++) {
    double f = pow((w[j] > 0 ? w[j] : 0.0) + p->eps, -power);
    for (size_t i = 0; i < n; i++) tmp[j * n + i] = f * g[j * n + i];
  }
  memcpy(save, g, n * n * sizeof(double));
  bico__dgemm(ctx, 1, 0, n, n, n, 1.0, save, n, tmp, n, 0.0, g, n);
done:
  bico__free(ctx, w);
  bico__free(ctx, tmp);
  bico__free(ctx, save);
  bico__free(ctx, work);
  bico__free(ctx, iwork);
  return st;
}

static void store_r(const double *m, size_t d_a, size_t d_b, float *r,
                    size_t ld_r) {
  for (size_t i = 0; i < d_a; i++)
    for (size_t j = 0; j < d_b; j++) r[i * ld_r + j] = (float)m[i * d_b + j];
}

/* The statistic as the EIG route reads it: blocks of C in double. */
typedef struct dense_src {
  const double *c;
  size_t ld;
} dense_src;

static bico_status matrix_block(void *opaque, size_t i0, size_t ni, size_t j0,
                                size_t nj, double *out, size_t ld) {
  const dense_src *m = opaque;
  for (size_t i = 0; i < ni; i++)
    memcpy(out + i * ld, m->c + (i0 + i) * m->ld + j0, nj * sizeof(double));
  return BICO_OK;
}

/* The panels of C (scaled by sc when sc != 0) that the EIG route reads:
 * left, k x n panels of columns t0..t0+n (row stride n); right, n x k
 * panels of rows (row stride k). */
static bico_status eig_panel(const bico__creader *rd, int left, size_t k,
                             size_t t0, size_t n, double sc, double *cp) {
  bico_status st = left ? rd->block(rd->opaque, 0, k, t0, n, cp, n)
                        : rd->block(rd->opaque, t0, n, 0, k, cp, k);
  if (st == BICO_OK && sc != 0)
    for (size_t i = 0; i < k * n; i++) cp[i] *= sc;
  return st;
}

/* Pass 0: C must be finite; *amax gets its largest magnitude. */
static bico_status eig_scan(bico_ctx *ctx, const char *fn,
                            const bico__creader *rd, int left, size_t k,
                            size_t o, size_t pw, double *cp, double *amax) {
  *amax = 0;
  for (size_t t0 = 0; t0 < o; t0 += pw) {
    const size_t n = o - t0 < pw ? o - t0 : pw;
    bico_status st = eig_panel(rd, left, k, t0, n, 0, cp);
    if (st != BICO_OK) return st;
    const size_t rows = left ? k : n, cols = left ? n : k;
    for (size_t i = 0; i < rows; i++)
      for (size_t j = 0; j < cols; j++) {
        const double v = cp[i * cols + j];
        if (!isfinite(v))
          return bico__fail(ctx, BICO_E_NONFINITE,
                            "%s: c holds %s at row %zu, column %zu", fn,
                            isnan(v) ? "NaN" : "Inf", left ? i : t0 + i,
                            left ? t0 + j : j);
        if (fabs(v) > *amax) *amax = fabs(v);
      }
  }
  return BICO_OK;
}

/* Pass 1: G (k x k, lower, row-major) = sum over panels of Cp Cp^T (left)
 * or Cp^T Cp (right), Cp = sc C's panel. */
static bico_status eig_gram(const bico__creader *rd, int left, size_t k,
                            size_t o, size_t pw, double sc, double *cp,
                            double *g, rntm_t *rntm) {
  double one = 1.0, zero = 0.0;
  for (size_t t0 = 0; t0 < o; t0 += pw) {
    const size_t n = o - t0 < pw ? o - t0 : pw;
    bico_status st = eig_panel(rd, left, k, t0, n, sc, cp);
    if (st != BICO_OK) return st;
    double *beta = t0 == 0 ? &zero : &one;
    if (left)
      bli_dsyrk_ex(BLIS_LOWER, BLIS_NO_TRANSPOSE, (dim_t)k, (dim_t)n, &one, cp,
                   (inc_t)n, 1, beta, g, (inc_t)k, 1, NULL, rntm);
    else
      bli_dsyrk_ex(BLIS_LOWER, BLIS_NO_TRANSPOSE, (dim_t)k, (dim_t)n, &one, cp,
                   1, (inc_t)k, beta, g, (inc_t)k, 1, NULL, rntm);
  }
  return BICO_OK;
}

/* lambda_max of G from below: a few power steps from the all-ones vector
 * (pv: 2k doubles for the iterates).  A low estimate only lets more
 * statistics through to the eigensolver, whose eigenvalues decide. */
static double eig_lmax(const double *g, size_t k, double *pv, rntm_t *rntm) {
  double one = 1.0, zero = 0.0, lmax = 0;
  double *x = pv, *y = pv + k;
  for (size_t i = 0; i < k; i++) x[i] = 1.0 / sqrt((double)k);
  for (int it = 0; it < EIG_POWER_STEPS; it++) {
    bli_dsymv_ex(BLIS_LOWER, BLIS_NO_CONJUGATE, BLIS_NO_CONJUGATE, (dim_t)k,
                 &one, (double *)g, (inc_t)k, 1, x, 1, &zero, y, 1, NULL,
                 rntm);
    double xy = 0, yy = 0;
    for (size_t i = 0; i < k; i++) {
      xy += x[i] * y[i];
      yy += y[i] * y[i];
    }
    if (xy > lmax) lmax = xy; /* Rayleigh quotient <= lambda_max */
    if (!(yy > 0) || !isfinite(yy)) break;
    const double f = 1.0 / sqrt(yy);
    for (size_t i = 0; i < k; i++) x[i] = y[i] * f;
  }
  return lmax;
}

/* Pass 2: R panel by panel with P (k x k, full, in g): left R[:, t] =
 * P Cp, right R[t, :] = Cp P. */
static bico_status eig_apply(bico_ctx *ctx, const bico__creader *rd, int left,
                             size_t k, size_t o, size_t pw, double sc,
                             const double *g, double *cp, double *op, float *r,
                             size_t ld_r) {
  for (size_t t0 = 0; t0 < o; t0 += pw) {
    const size_t n = o - t0 < pw ? o - t0 : pw;
    bico_status st = eig_panel(rd, left, k, t0, n, sc, cp);
    if (st != BICO_OK) return st;
    if (left) {
      bico__dgemm(ctx, 0, 0, k, n, k, 1.0, g, k, cp, n, 0.0, op, n);
      store_r(op, k, n, r + t0, ld_r);
    } else {
      bico__dgemm(ctx, 0, 0, n, k, k, 1.0, cp, k, g, k, 0.0, op, k);
      store_r(op, n, k, r + t0 * ld_r, ld_r);
    }
  }
  return BICO_OK;
}

/* BICO_PROC_EIG: for d_a <= d_b, C C^T = Q L Q^T and R = P C with
 * P = Q L^-1/2 Q^T; for d_a > d_b, C^T C = Q L Q^T and R = C P.  C is
 * read through rd in panels of EIG_PANEL columns (d_a <= d_b) or rows
 * (d_a > d_b), three times: for its scale, for the Gram, for R.  Besides the panels
 * it needs two k x k matrices (k = min(d_a, d_b)): the Gram, destroyed by
 * the eigensolver and reused for P, and the eigenvectors; no d_a x d_b
 * double buffer.
 *
 * Test first: a Cholesky factor of G - ratio^2 lambda_est I, with
 * lambda_est <= lambda_max from a few power steps, exists whenever the
 * certificate below can hold, and costs a third of a GEMM: a rank-deficient
 * or badly conditioned statistic hands over to the SVD before the
 * eigendecomposition is paid for.  The certificate itself is on the
 * computed eigenvalues: lambda_min > ratio^2 lambda_max.  Sets *done = 0
 * without touching r or the spectrum when either test fails (the caller
 * runs the SVD); a non-finite entry of C fails the solve
 * (BICO_E_NONFINITE). */
static bico_status eig_core(bico_procrustes *p, const char *fn, size_t d_a,
                            size_t d_b, const bico__creader *rd, float *r,
                            size_t ld_r, size_t *rank, int *done) {
  bico_ctx *ctx = p->ctx;
  const int left = d_a <= d_b;
  const size_t k = left ? d_a : d_b, o = left ? d_b : d_a;
  const size_t pw = EIG_PANEL < o ? EIG_PANEL : o;
  const int ki = (int)k;
  int info = 0, lwork = -1, liwork = -1, iwq = 0, found = 0, il = 0, iu = 0;
  double wq = 0, vl = 0, vu = 0, abstol = 0, one = 1.0, zero = 0.0;
  bico_status st = BICO_OK;
  double *g = NULL, *z = NULL, *w = NULL, *work = NULL, *s = NULL,
         *cp = NULL, *op = NULL, *pv = NULL;
  int *iwork = NULL, *isuppz = NULL;
  rntm_t rntm;
  bli_rntm_init(&rntm);
  bli_rntm_set_num_threads((dim_t)ctx->threads, &rntm);
  *done = 0;

  const double ratio = p->tol * (1.0 + 1e-3) > EIG_MIN_RATIO
                           ? p->tol * (1.0 + 1e-3)
                           : EIG_MIN_RATIO;
  g = bico__calloc(ctx, k, k * sizeof(double));
  z = bico__calloc(ctx, k, k * sizeof(double));
  w = bico__calloc(ctx, k, sizeof(double));
  isuppz = bico__calloc(ctx, k, 2 * sizeof(int));
  cp = bico__calloc(ctx, k, pw * sizeof(double));
  op = bico__calloc(ctx, k, pw * sizeof(double));
  pv = bico__calloc(ctx, k, 2 * sizeof(double));
  if (g == NULL || z == NULL || w == NULL || isuppz == NULL || cp == NULL ||
      op == NULL || pv == NULL) {
    st = BICO_E_NOMEM;
    goto done;
  }
  /* Pass 0: C must be finite, and its largest magnitude sets a power of
   * two sc with sc max|C| in [0.5, 1).  The Gram squares magnitudes: at
   * either end of the double range it would overflow or lose its bits to
   * underflow (found by fuzzing: a centred 1 x 1 statistic near 1e-160
   * gave |R| = 1.002).  R does not depend on the scale, so the passes
   * below work on sc C, exactly. */
  double amax = 0;
  st = eig_scan(ctx, fn, rd, left, k, o, pw, cp, &amax);
  if (st != BICO_OK) goto done;
  if (rd->release) rd->release(rd->opaque);
  if (!(amax > 0)) goto done; /* all zero: the SVD route's completion */
  int ex;
  (void)frexp(amax, &ex);
  const double sc = ldexp(1.0, -ex);
  /* Pass 1, then lambda_max from below. */
  st = eig_gram(rd, left, k, o, pw, sc, cp, g, &rntm);
  if (st != BICO_OK) goto done;
  if (rd->release) rd->release(rd->opaque);
  const double lmax = eig_lmax(g, k, pv, &rntm);
  if (!(lmax > 0) || !isfinite(lmax)) goto done;
  /* z = G - ratio^2 lambda_est I must have a Cholesky factor. */
  memcpy(z, g, k * k * sizeof(double));
  for (size_t i = 0; i < k; i++) z[i * k + i] -= ratio * ratio * lmax;
  dpotrf_("U", &ki, z, &ki, &info, 1);
  if (info != 0) goto done; /* not certified: the SVD */

  dsyevr_("V", "A", "U", &ki, g, &ki, &vl, &vu, &il, &iu, &abstol, &found, w,
          z, &ki, isuppz, &wq, &lwork, &iwq, &liwork, &info, 1, 1, 1);
  if (info != 0 || query_to_int(wq, &lwork) || iwq < 1) {
    st = bico__fail(ctx, BICO_E_INTERNAL,
                    "%s: dsyevr workspace query failed (info %d)", fn, info);
    goto done;
  }
  liwork = iwq;
  work = bico__calloc(ctx, (size_t)lwork, sizeof(double));
  iwork = bico__calloc(ctx, (size_t)liwork, sizeof(int));
  if (work == NULL || iwork == NULL) { st = BICO_E_NOMEM; goto done; }
  dsyevr_("V", "A", "U", &ki, g, &ki, &vl, &vu, &il, &iu, &abstol, &found, w,
          z, &ki, isuppz, work, &lwork, iwork, &liwork, &info, 1, 1, 1);
  if (info < 0) {
    st = bico__fail(ctx, BICO_E_INTERNAL, "%s: dsyevr rejected argument %d",
                    fn, -info);
    goto done;
  }
  /* Eigenvalues ascending.  Not converged or not certified: the SVD. */
  if (info > 0 || found != ki || !(w[k - 1] > 0) ||
      !(w[0] > ratio * ratio * w[k - 1]))
    goto done;
  s = bico__calloc(ctx, k, sizeof(double));
  if (s == NULL) { st = BICO_E_NOMEM; goto done; }
  /* Row j of the row-major z is eigenvector j (z = Q^T).  Scale it by
   * lambda_j^-1/4: then P = z^T z, one SYRK into g (lower), mirrored. */
  for (size_t j = 0; j < k; j++) {
    const double f = 1.0 / sqrt(sqrt(w[j]));
    for (size_t i = 0; i < k; i++) z[j * k + i] *= f;
  }
  /* z^T is k x k with row stride 1, column stride k. */
  bli_dsyrk_ex(BLIS_LOWER, BLIS_NO_TRANSPOSE, (dim_t)k, (dim_t)k, &one, z, 1,
               (inc_t)k, &zero, g, (inc_t)k, 1, NULL, &rntm);
  for (size_t i = 0; i < k; i++)
    for (size_t j = 0; j < i; j++) g[j * k + i] = g[i * k + j];
  st = eig_apply(ctx, rd, left, k, o, pw, sc, g, cp, op, r, ld_r);
  if (st != BICO_OK) goto done;
  if (rd->release) rd->release(rd->opaque);
  for (size_t i = 0; i < k; i++) s[i] = sqrt(w[k - 1 - i]) / sc;
  bico__free(ctx, p->spec);
  p->spec = s;
  p->spec_count = k;
  s = NULL;
  if (rank) *rank = k; /* every s_i exceeds ratio * s_max >= tol * s_max */
  *done = 1;
done:
  if (rd->release) rd->release(rd->opaque);
  bico__free(ctx, g);
  bico__free(ctx, z);
  bico__free(ctx, w);
  bico__free(ctx, work);
  bico__free(ctx, iwork);
  bico__free(ctx, isuppz);
  bico__free(ctx, s);
  bico__free(ctx, cp);
  bico__free(ctx, op);
  bico__free(ctx, pv);
  return st;
}

/* BICO_PROC_POLAR: Newton-Schulz X <- 1.5 X - 0.5 (X X^T) X (the smaller
 * Gram on the side it fits) from X0 = C / ||C||_F, whose singular values
 * lie in (0, 1]: each step maps s to 1.5 s - 0.5 s^3, growing small ones
 * by 1.5 and converging quadratically near 1.  Only GEMMs.  Certified when
 * it converges and H = C R^T (R^T C when d_a > d_b; H = U S U^T) minus
 * tol ||C||_F I has a Cholesky factor: then every singular value exceeds
 * tol ||C||_F >= tol s_max, the rank is full and R is unique (KEEP and DROP
 * agree).  Else *done = 0 and m is untouched. */
static bico_status polar_core(bico_procrustes *p, size_t d_a,
                              size_t d_b, double *m, float *r, size_t ld_r,
                              size_t *rank, int *done) {
  bico_ctx *ctx = p->ctx;
  const int left = d_a <= d_b;
  const size_t k = left ? d_a : d_b, total = d_a * d_b;
  bico_status st = BICO_OK;
  double *x = NULL, *y = NULL, *a = NULL;
  *done = 0;

  double fro = 0;
  for (size_t i = 0; i < total; i++) fro += m[i] * m[i];
  fro = sqrt(fro);
  if (!(fro > 0) || !isfinite(fro)) return BICO_OK;
  x = bico__calloc(ctx, total, sizeof(double));
  y = bico__calloc(ctx, total, sizeof(double));
  a = bico__calloc(ctx, k, k * sizeof(double));
  if (x == NULL || y == NULL || a == NULL) { st = BICO_E_NOMEM; goto done; }
  for (size_t i = 0; i < total; i++) x[i] = m[i] / fro;
  int converged = 0;
  for (int it = 0; it < POLAR_MAX_ITER && !converged; it++) {
    if (left)
      bico__dgemm(ctx, 0, 1, k, k, d_b, 1.0, x, d_b, x, d_b, 0.0, a, k);
    else
      bico__dgemm(ctx, 1, 0, k, k, d_a, 1.0, x, d_b, x, d_b, 0.0, a, k);
    double dev = 0;
    for (size_t i = 0; i < k; i++)
      for (size_t j = 0; j < k; j++) {
        const double e = a[i * k + j] - (i == j);
        dev += e * e;
      }
    if (!isfinite(dev)) break;
    converged = sqrt(dev) < POLAR_CONVERGED;
    /* y = 1.5 x - 0.5 a x (left) or 1.5 x - 0.5 x a */
    memcpy(y, x, total * sizeof(double));
    if (left)
      bico__dgemm(ctx, 0, 0, d_a, d_b, k, -0.5, a, k, x, d_b, 1.5, y, d_b);
    else
      bico__dgemm(ctx, 0, 0, d_a, d_b, k, -0.5, x, d_b, a, k, 1.5, y, d_b);
    double *sw = x;
    x = y;
    y = sw;
  }
  if (!converged) goto done;
  /* Certificate: a = H - tol ||C||_F I must be positive definite. */
  if (left)
    bico__dgemm(ctx, 0, 1, k, k, d_b, 1.0, m, d_b, x, d_b, 0.0, a, k);
  else
    bico__dgemm(ctx, 1, 0, k, k, d_a, 1.0, x, d_b, m, d_b, 0.0, a, k);
  for (size_t i = 0; i < k; i++) {
    for (size_t j = 0; j < i; j++) {
      const double h = 0.5 * (a[i * k + j] + a[j * k + i]);
      a[i * k + j] = a[j * k + i] = h;
    }
    a[i * k + i] -= p->tol * fro;
  }
  const int ki = (int)k;
  int info = 0;
  dpotrf_("U", &ki, a, &ki, &info, 1);
  if (info != 0) goto done;
  store_r(x, d_a, d_b, r, ld_r);
  bico__free(ctx, p->spec);
  p->spec = NULL;
  p->spec_count = 0;
  if (rank) *rank = k;
  *done = 1;
done:
  bico__free(ctx, x);
  bico__free(ctx, y);
  bico__free(ctx, a);
  return st;
}

/* R from the statistic m (d_a x d_b, row-major, contiguous; destroyed).
 *
 * LAPACK is column-major: the row-major m is, as LAPACK sees it, the
 * d_b x d_a matrix M^T.  Its thin SVD M^T = U' S V'^T gives M = V' S U'^T,
 * so U = V' and V = U', and R = U V^T = V' U'^T.  Read back row-major, the
 * column-major U' buffer (d_b x mn, ld d_b) is U'^T (mn x d_b) and the
 * column-major V'^T buffer (mn x d_a, ld mn) is V' (d_a x mn): R is the
 * plain row-major product of those two buffers. */
static bico_status solve_core(bico_procrustes *p, const char *fn,
                              size_t d_a, size_t d_b, double *m, float *r,
                              size_t ld_r, size_t *rank, int try_alt) {
  bico_ctx *ctx = p->ctx;
  const size_t mn = d_a < d_b ? d_a : d_b;
  bico_status st = BICO_OK;
  double *s = NULL, *u = NULL, *vt = NULL, *work = NULL, *save = NULL;
  int *iwork = NULL;
  size_t k = 0;

  if (d_a > INT_MAX || d_b > INT_MAX || (d_a * d_b) / d_a != d_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: %zu x %zu exceeds what LAPACK can index", fn, d_a,
                      d_b);
  const size_t total = d_a * d_b;
  /* The input was checked finite; only whitening can overflow here. */
  for (size_t i = 0; i < total; i++)
    if (!isfinite(m[i]))
      return bico__fail(ctx, BICO_E_NUMERIC,
                        "%s: the whitened statistic overflowed at row %zu, "
                        "column %zu",
                        fn, i / d_b, i % d_b);

  s = bico__calloc(ctx, mn, sizeof(double));
  if (s == NULL) return BICO_E_NOMEM;

  int zero = 1;
  for (size_t i = 0; i < total && zero; i++) zero = m[i] == 0.0;

  if (!zero && try_alt && p->method != BICO_PROC_SVD) {
    int done = 0;
    dense_src src = {m, d_b};
    const bico__creader rd = {matrix_block, NULL, &src};
    st = p->method == BICO_PROC_EIG
             ? eig_core(p, fn, d_a, d_b, &rd, r, ld_r, rank, &done)
             : polar_core(p, d_a, d_b, m, r, ld_r, rank, &done);
    if (st != BICO_OK || done) {
      bico__free(ctx, s);
      return st;
    }
  }

  if (!zero) {
    const int mi = (int)d_b, ni = (int)d_a, mni = (int)mn;
    int info = 0, lwork = -1;
    double wq = 0;
    u = bico__calloc(ctx, mn, d_b * sizeof(double));
    vt = bico__calloc(ctx, mn, d_a * sizeof(double));
    save = bico__calloc(ctx, total, sizeof(double));
    iwork = bico__calloc(ctx, mn, 8 * sizeof(int));
    if (u == NULL || vt == NULL || save == NULL || iwork == NULL) {
      st = BICO_E_NOMEM;
      goto done;
    }
    memcpy(save, m, total * sizeof(double)); /* dgesdd destroys its input */
    dgesdd_("S", &mi, &ni, m, &mi, s, u, &mi, vt, &mni, &wq, &lwork, iwork,
            &info, 1);
    if (info != 0 || query_to_int(wq, &lwork)) {
      st = bico__fail(ctx, BICO_E_INTERNAL,
                      "%s: dgesdd workspace query failed (info %d)", fn, info);
      goto done;
    }
    work = bico__calloc(ctx, (size_t)lwork, sizeof(double));
    if (work == NULL) { st = BICO_E_NOMEM; goto done; }
    dgesdd_("S", &mi, &ni, m, &mi, s, u, &mi, vt, &mni, work, &lwork, iwork,
            &info, 1);
    if (info > 0) {
      /* dgesdd did not converge: the slower QR-based dgesvd usually does. */
      memcpy(m, save, total * sizeof(double));
      bico__free(ctx, work);
      work = NULL;
      lwork = -1;
      dgesvd_("S", "S", &mi, &ni, m, &mi, s, u, &mi, vt, &mni, &wq, &lwork,
              &info, 1, 1);
      if (info != 0 || query_to_int(wq, &lwork)) {
        st = bico__fail(ctx, BICO_E_INTERNAL,
                        "%s: dgesvd workspace query failed (info %d)", fn,
                        info);
        goto done;
      }
      work = bico__calloc(ctx, (size_t)lwork, sizeof(double));
      if (work == NULL) { st = BICO_E_NOMEM; goto done; }
      dgesvd_("S", "S", &mi, &ni, m, &mi, s, u, &mi, vt, &mni, work, &lwork,
              &info, 1, 1);
      if (info > 0) {
        st = bico__fail(ctx, BICO_E_NUMERIC,
                        "%s: the SVD of the %zu x %zu statistic did not "
                        "converge (dgesdd, then dgesvd info %d)",
                        fn, d_a, d_b, info);
        goto done;
      }
    }
    if (info < 0) {
      st = bico__fail(ctx, BICO_E_INTERNAL, "%s: LAPACK rejected argument %d",
                      fn, -info);
      goto done;
    }
    const double cut = p->tol * s[0];
    for (size_t i = 0; i < mn; i++)
      if (s[i] > cut) k++;
  }

  /* m is free now: it receives R in double. */
  if (zero || s[0] == 0.0) {
    k = 0;
    memset(m, 0, total * sizeof(double));
    /* No direction is identified: KEEP falls back to the rectangular
     * identity (a valid semi-orthogonal map), DROP maps everything to 0. */
    if (p->null_mode == BICO_NULL_KEEP)
      for (size_t i = 0; i < mn; i++) m[i * d_b + i] = 1.0;
  } else {
    size_t kk = p->null_mode == BICO_NULL_KEEP ? mn : k;
    bico__dgemm(ctx, 0, 0, d_a, d_b, kk, 1.0, vt, mn, u, d_b, 0.0, m, d_b);
  }
  for (size_t i = 0; i < d_a; i++)
    for (size_t j = 0; j < d_b; j++) r[i * ld_r + j] = (float)m[i * d_b + j];

  bico__free(ctx, p->spec);
  p->spec = s;
  p->spec_count = mn;
  s = NULL;
  if (rank) *rank = k;
done:
  bico__free(ctx, s);
  bico__free(ctx, u);
  bico__free(ctx, vt);
  bico__free(ctx, save);
  bico__free(ctx, work);
  bico__free(ctx, iwork);
  return st;
}

/* A bare statistic (checked arguments, total = d_a d_b) read through rd:
 * the EIG route straight from the reader, in panels; otherwise (another
 * method, or EIG not certified) the whole matrix into one buffer, which
 * the SVD destroys. */
static bico_status solve_read(bico_procrustes *p, const char *fn, size_t d_a,
                              size_t d_b, size_t total,
                              const bico__creader *rd, float *r, size_t ld_r,
                              size_t *rank) {
  bico_ctx *ctx = p->ctx;
  int try_alt = 1;
  bico_status st;
  if (p->method == BICO_PROC_EIG && d_a <= INT_MAX && d_b <= INT_MAX) {
    int done = 0;
    st = eig_core(p, fn, d_a, d_b, rd, r, ld_r, rank, &done);
    if (st != BICO_OK || done) return st;
    try_alt = 0;
  }
  double *m = bico__calloc(ctx, total, sizeof(double));
  if (m == NULL) return BICO_E_NOMEM;
  st = rd->block(rd->opaque, 0, d_a, 0, d_b, m, d_b);
  if (rd->release) rd->release(rd->opaque);
  if (st == BICO_OK) st = bico__check_finite_f64(ctx, fn, "c", m, d_a, d_b, d_b);
  if (st == BICO_OK) st = solve_core(p, fn, d_a, d_b, m, r, ld_r, rank, try_alt);
  bico__free(ctx, m);
  return st;
}

bico_status bico_procrustes_solve(bico_procrustes *p, const bico_xcov *xc,
                                  float *r, size_t ld_r, size_t *rank) {
  static const char fn[] = "procrustes_solve";
  if (p == NULL) return BICO_E_NULL;
  bico_ctx *ctx = p->ctx;
  bico__clear(ctx);
  if (xc == NULL || r == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      xc == NULL ? "xc" : "r");
  size_t d_a = 0, d_b = 0;
  unsigned flags = 0;
  bico_xcov_info(xc, &d_a, &d_b, NULL, &flags);
  if (p->center && !(flags & BICO_XCOV_SUMS))
    return bico__fail(ctx, BICO_E_STATE,
                      "%s: centering (BICO_PROC_CENTER = 1) needs an "
                      "accumulator created with BICO_XCOV_SUMS",
                      fn);
  if (p->whiten > 0 && !(flags & BICO_XCOV_GRAMS))
    return bico__fail(ctx, BICO_E_STATE,
                      "%s: whitening (BICO_PROC_WHITEN = %g) needs an "
                      "accumulator created with BICO_XCOV_GRAMS",
                      fn, p->whiten);
  if (ld_r < d_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: row stride ld_r = %zu is below d_b = %zu", fn, ld_r,
                      d_b);
  size_t total;
  if (bico__mul(d_a, d_b, &total))
    return bico__fail(ctx, BICO_E_SHAPE, "%s: %zu x %zu overflows", fn, d_a,
                      d_b);
  bico_status st = BICO_OK;
  double *m = NULL, *ga = NULL, *gb = NULL, *t = NULL;
  m = bico__calloc(ctx, total, sizeof(double));
  if (m == NULL) return BICO_E_NOMEM;
  /* Flags and strides were checked above; the one failure left is overflow
   * in centering extreme (finite) statistics (found by fuzzing): the
   * caller's data, not a bug, so say so on ctx. */
  st = bico_xcov_matrix(xc, BICO_XCOV_CROSS, p->center, m, d_b);
  if (st != BICO_OK) {
    st = bico__fail(ctx, st, "%s: the centered statistic overflows double "
                    "(values too large)", fn);
    goto done;
  }
  if (p->whiten > 0) {
    /* With centering on, the Grams are centered too, so that C and its
     * whitening describe the same (mean-free) data. */
    ga = bico__calloc(ctx, d_a, d_a * sizeof(double));
    gb = bico__calloc(ctx, d_b, d_b * sizeof(double));
    t = bico__calloc(ctx, total, sizeof(double));
    if (ga == NULL || gb == NULL || t == NULL) { st = BICO_E_NOMEM; goto done; }
    st = bico_xcov_matrix(xc, BICO_XCOV_GRAM_A, p->center, ga, d_a);
    if (st == BICO_OK)
      st = bico_xcov_matrix(xc, BICO_XCOV_GRAM_B, p->center, gb, d_b);
    if (st != BICO_OK) {
      st = bico__fail(ctx, st, "%s: the centered Gram matrices overflow "
                      "double (values too large)", fn);
      goto done;
    }
    st = inverse_power(p, fn, ga, d_a, p->whiten);
    if (st == BICO_OK) st = inverse_power(p, fn, gb, d_b, p->whiten);
    if (st != BICO_OK) goto done;
    bico__dgemm(ctx, 0, 0, d_a, d_b, d_a, 1.0, ga, d_a, m, d_b, 0.0, t, d_b);
    bico__dgemm(ctx, 0, 0, d_a, d_b, d_b, 1.0, t, d_b, gb, d_b, 0.0, m, d_b);
  }
  st = solve_core(p, fn, d_a, d_b, m, r, ld_r, rank, 1);
done:
  bico__free(ctx, m);
  bico__free(ctx, ga);
  bico__free(ctx, gb);
  bico__free(ctx, t);
  return st;
}

bico_status bico_procrustes_solve_matrix(bico_procrustes *p, size_t d_a,
                                         size_t d_b, const double *c,
                                         size_t ld_c, float *r, size_t ld_r,
                                         size_t *rank) {
  static const char fn[] = "procrustes_solve_matrix";
  if (p == NULL) return BICO_E_NULL;
  bico_ctx *ctx = p->ctx;
  bico__clear(ctx);
  if (c == NULL || r == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      c == NULL ? "c" : "r");
  if (p->center || p->whiten > 0)
    return bico__fail(ctx, BICO_E_STATE,
                      "%s: %s needs an accumulator (use procrustes_solve); a "
                      "bare matrix carries no sums or Grams",
                      fn,
                      p->center ? "centering (BICO_PROC_CENTER)"
                                : "whitening (BICO_PROC_WHITEN)");
  if (d_a == 0 || d_b == 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: dimensions must be positive, got d_a = %zu, d_b = "
                      "%zu",
                      fn, d_a, d_b);
  if (ld_c < d_b || ld_r < d_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: row stride %s = %zu is below d_b = %zu", fn,
                      ld_c < d_b ? "ld_c" : "ld_r", ld_c < d_b ? ld_c : ld_r,
                      d_b);
  size_t total;
  if (bico__mul(d_a, d_b, &total))
    return bico__fail(ctx, BICO_E_SHAPE, "%s: %zu x %zu overflows", fn, d_a,
                      d_b);
  /* Every route checks C for NaN and Inf as it reads it. */
  dense_src src = {c, ld_c};
  const bico__creader rd = {matrix_block, NULL, &src};
  return solve_read(p, fn, d_a, d_b, total, &rd, r, ld_r, rank);
}

bico_status bico__procrustes_solve_reader(bico_procrustes *p, size_t d_a,
                                          size_t d_b, const bico__creader *rd,
                                          float *r, size_t ld_r,
                                          size_t *rank) {
  static const char fn[] = "procrustes_solve_matrix";
  if (p == NULL) return BICO_E_NULL;
  bico_ctx *ctx = p->ctx;
  bico__clear(ctx);
  if (p->center || p->whiten > 0)
    return bico__fail(ctx, BICO_E_STATE,
                      "%s: centering and whitening need an accumulator", fn);
  size_t total;
  if (d_a == 0 || d_b == 0 || ld_r < d_b || bico__mul(d_a, d_b, &total) ||
      d_a > INT_MAX || d_b > INT_MAX)
    return bico__fail(ctx, BICO_E_SHAPE, "%s: bad shape %zu x %zu", fn, d_a,
                      d_b);
  return solve_read(p, fn, d_a, d_b, total, rd, r, ld_r, rank);
}

bico_ctx *bico__procrustes_ctx(const bico_procrustes *p) { return p->ctx; }

void bico__procrustes_take_spectrum(bico_procrustes *p, double *s,
                                    size_t count) {
  bico__free(p->ctx, p->spec);
  p->spec = s;
  p->spec_count = count;
}

/* ---- experimental.h ---- */

typedef struct caller_reader {
  bico_ctx *ctx;
  bico_block_read_fn read;
  bico_block_release_fn release;
  void *opaque;
} caller_reader;

/* The caller's failure comes back unchanged, and on record (ctx.h). */
static bico_status caller_block(void *o, size_t i0, size_t ni, size_t j0,
                                size_t nj, double *out, size_t ld) {
  caller_reader *c = o;
  bico_status st = c->read(c->opaque, i0, ni, j0, nj, out, ld);
  if (st != BICO_OK)
    return bico__fail(c->ctx, st,
                      "procrustes_solve_blocks: reading rows %zu..%zu, "
                      "columns %zu..%zu of C failed: %s",
                      i0, i0 + ni, j0, j0 + nj, bico_strerror(st));
  return BICO_OK;
}

static void caller_release(void *o) {
  caller_reader *c = o;
  if (c->release != NULL) c->release(c->opaque);
}

bico_status bico_procrustes_solve_blocks(bico_procrustes *p, size_t d_a,
                                         size_t d_b, bico_block_read_fn read,
                                         bico_block_release_fn release,
                                         void *opaque, float *r, size_t ld_r,
                                         size_t *rank) {
  if (p == NULL) return BICO_E_NULL;
  if (read == NULL) {
    bico__clear(p->ctx);
    return bico__fail(p->ctx, BICO_E_NULL,
                      "procrustes_solve_blocks: read is NULL");
  }
  caller_reader c = {p->ctx, read, release, opaque};
  const bico__creader rd = {caller_block, caller_release, &c};
  return bico__procrustes_solve_reader(p, d_a, d_b, &rd, r, ld_r, rank);
}
