/* bico_fit: the per-layer ridge fit of the sequential functional fit
 * (streaming statistics in double, merge, closed-form solve with rank). */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include <blis.h>

#include "internal.h"
#include "lapack.h"

/* Rows converted to double per GEMM (as bico_xcov's exact mode). */
#define FIT_ROWS 256
#define FIT_FLAGS ((unsigned)BICO_FIT_BIAS)

struct bico_fit {
  bico_ctx *ctx;
  size_t d_in, d_out;
  size_t a; /* d_in + 1 with the bias column, else d_in */
  unsigned flags;
  double ridge, tol;
  uint64_t rows;
  double *g;  /* X~'^T X~', a x a (upper triangle during add, then full) */
  double *k;  /* X~'^T X~_B, a x a; allocated at the first add (NULL until
                 then, and always in theta mode) */
  double *et; /* D_B^T X~', d_out x a: E^T, so that each output's right-hand
                 side is one contiguous row (a column for LAPACK); in theta
                 mode (D_B + (X~_B - X~') Theta)^T X~', the whole right-hand
                 side */
  double *th; /* theta mode (bico__fit_use_theta): Theta^T = [W_B b_B] in
                 double, d_out x a; NULL otherwise */
};

bico_status bico_fit_create(bico_ctx *ctx, size_t d_out, size_t d_in,
                            unsigned flags, bico_fit **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL) return bico__fail(ctx, BICO_E_NULL, "fit_create: out is NULL");
  if (d_in == 0 || d_out == 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "fit_create: dimensions must be positive, got d_out = "
                      "%zu, d_in = %zu",
                      d_out, d_in);
  if (flags & ~FIT_FLAGS)
    return bico__fail(ctx, BICO_E_ARG,
                      "fit_create: unknown flags 0x%x (known: BICO_FIT_BIAS "
                      "= 1)",
                      flags & ~FIT_FLAGS);
  /* LAPACK takes 32-bit dimensions. */
  if (d_in >= (size_t)INT_MAX || d_out > (size_t)INT_MAX)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "fit_create: d_in = %zu, d_out = %zu exceed what LAPACK "
                      "accepts (%d)",
                      d_in, d_out, INT_MAX - 1);
  const size_t a = d_in + ((flags & BICO_FIT_BIAS) ? 1 : 0);
  size_t aa, ea, total;
  if (bico__mul(a, a, &aa) || bico__mul(d_out, a, &ea) || aa > SIZE_MAX / 2 ||
      2 * aa > SIZE_MAX - ea || (total = 2 * aa + ea) > SIZE_MAX / sizeof(double))
    return bico__fail(ctx, BICO_E_SHAPE,
                      "fit_create: a fit of %zu x %zu overflows the address "
                      "space",
                      d_out, d_in);
  bico_fit *f = bico__alloc(ctx, sizeof *f);
  if (f == NULL) return BICO_E_NOMEM;
  /* G and E^T now; K (a x a) at the first add, so that a fit the driver
   * puts in theta mode never holds it. */
  (void)total;
  f->g = bico__calloc(ctx, aa + ea, sizeof(double));
  if (f->g == NULL) {
    bico__free(ctx, f);
    return BICO_E_NOMEM;
  }
  f->k = NULL;
  f->th = NULL;
  f->et = f->g + aa;
  f->ctx = ctx;
  f->d_in = d_in;
  f->d_out = d_out;
  f->a = a;
  f->flags = flags;
  f->ridge = 1e-2;
  f->tol = 1e-10;
  f->rows = 0;
  *out = f;
  return BICO_OK;
}

void bico_fit_free(bico_fit *f) {
  if (f == NULL) return;
  bico_ctx *ctx = f->ctx;
  bico__free(ctx, f->g);
  bico__free(ctx, f->k);
  bico__free(ctx, f->th);
  bico__free(ctx, f);
}

bico_status bico__fit_use_theta(bico_fit *f, const float *w, size_t ld_w,
                                const float *b) {
  bico_ctx *ctx = f->ctx;
  if (f->rows != 0 || f->k != NULL || f->th != NULL || w == NULL ||
      ld_w < f->d_in || ((f->flags & BICO_FIT_BIAS) != 0) != (b != NULL))
    return bico__fail(ctx, BICO_E_STATE,
                      "fit: theta mode needs an empty fit and W (and b "
                      "exactly when the fit has a bias)");
  const size_t a = f->a, d_in = f->d_in;
  double *th = bico__alloc(ctx, f->d_out * a * sizeof(double));
  if (th == NULL) return BICO_E_NOMEM;
  for (size_t o = 0; o < f->d_out; o++) {
    for (size_t j = 0; j < d_in; j++) th[o * a + j] = w[o * ld_w + j];
    if (a > d_in) th[o * a + d_in] = b[o];
  }
  f->th = th;
  return BICO_OK;
}

/* The option grammar (params.h, lib/base/params.c): RIDGE [0, inf), RANK_TOL
 * [0, 1) (a tolerance of 1 would count nothing towards the rank). */
static const bico__param_spec FPARAM[] = {
    [BICO_FIT_RIDGE] = {"ridge", 0, HUGE_VAL, BICO_PARAM_HI_OPEN},
    [BICO_FIT_RANK_TOL] = {"rank_tol", 0, 1, BICO_PARAM_HI_OPEN},
};

bico_status bico_fit_param_bounds(int param, double *lo, double *hi,
                                  unsigned *flags) {
  return bico__param_bounds(FPARAM, BICO__NSPEC(FPARAM), param, lo, hi, flags);
}

const char *bico_fit_param_name(int param) {
  return bico__param_name(FPARAM, BICO__NSPEC(FPARAM), param);
}

bico_status bico_fit_param_from_name(const char *name, int *param) {
  return bico__param_from_name(FPARAM, BICO__NSPEC(FPARAM), name, param);
}

bico_status bico_fit_set_param(bico_fit *f, int param, double value) {
  if (f == NULL) return BICO_E_NULL;
  bico__clear(f->ctx);
  bico_status st = bico__param_set(f->ctx, "fit_set_param", FPARAM,
                                   BICO__NSPEC(FPARAM), param, value);
  if (st != BICO_OK) return st;
  if (param == BICO_FIT_RIDGE)
    f->ridge = value;
  else
    f->tol = value;
  return BICO_OK;
}

bico_status bico_fit_get_param(const bico_fit *f, int param, double *value) {
  if (f == NULL) return BICO_E_NULL;
  bico_status st = bico__param_get(f->ctx, "fit_get_param", FPARAM,
                                   BICO__NSPEC(FPARAM), param, value);
  if (st != BICO_OK) return st;
  *value = param == BICO_FIT_RIDGE ? f->ridge : f->tol;
  return BICO_OK;
}

bico_status bico_fit_info(const bico_fit *f, size_t *d_out, size_t *d_in,
                          uint64_t *rows, unsigned *flags) {
  if (f == NULL) return BICO_E_NULL;
  if (d_in) *d_in = f->d_in;
  if (d_out) *d_out = f->d_out;
  if (rows) *rows = f->rows;
  if (flags) *flags = f->flags;
  return BICO_OK;
}

bico_status bico_fit_reset(bico_fit *f) {
  if (f == NULL) return BICO_E_NULL;
  bico__clear(f->ctx);
  memset(f->g, 0, (f->a * f->a + f->d_out * f->a) * sizeof(double));
  if (f->k != NULL) memset(f->k, 0, f->a * f->a * sizeof(double));
  f->rows = 0;
  return BICO_OK;
}

/* The lower triangle of g from its upper one (syrk fills only the upper). */
static void mirror_upper(double *g, size_t d) {
  for (size_t i = 1; i < d; i++)
    for (size_t j = 0; j < i; j++) g[i * d + j] = g[j * d + i];
}

/* Upper triangle of g (d x d) += y^T y, y m x d with row stride ld. */
static void dsyrk_upper(const bico_ctx *ctx, size_t d, size_t m,
                        const double *y, size_t ld, double *g) {
  double one = 1.0;
  rntm_t rntm;
  bli_rntm_init(&rntm);
  bli_rntm_set_num_threads((dim_t)ctx->threads, &rntm);
  bli_dsyrk_ex(BLIS_UPPER, BLIS_TRANSPOSE, (dim_t)d, (dim_t)m, &one,
               (double *)y, (inc_t)ld, 1, &one, g, (inc_t)d, 1, NULL, &rntm);
}

bico_status bico_fit_add(bico_fit *f, size_t n, const float *x_new,
                         size_t ld_new, const float *x_orig, size_t ld_orig,
                         const float *delta, size_t ld_delta) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  bico__clear(ctx);
  if (n == 0) return BICO_OK;
  const char *fn = "fit_add";
  if (x_new == NULL || x_orig == NULL || delta == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL with n = %zu", fn,
                      x_new == NULL ? "x_new"
                      : x_orig == NULL ? "x_orig"
                                       : "delta",
                      n);
  if (ld_new < f->d_in || ld_orig < f->d_in || ld_delta < f->d_out) {
    const char *w = ld_new < f->d_in ? "ld_new"
                    : ld_orig < f->d_in ? "ld_orig"
                                        : "ld_delta";
    size_t v = ld_new < f->d_in ? ld_new
               : ld_orig < f->d_in ? ld_orig
                                   : ld_delta;
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: row stride %s = %zu is below the width %zu", fn, w,
                      v, w[3] == 'd' ? f->d_out : f->d_in);
  }
  if ((uint64_t)n > UINT64_MAX - f->rows)
    return bico__fail(ctx, BICO_E_SHAPE, "%s: row count %llu + %zu overflows",
                      fn, (unsigned long long)f->rows, n);
  bico_status st;
  if ((st = bico__check_finite_f32(ctx, fn, "x_new", x_new, n, f->d_in, ld_new)) ||
      (st = bico__check_finite_f32(ctx, fn, "x_orig", x_orig, n, f->d_in,
                                   ld_orig)) ||
      (st = bico__check_finite_f32(ctx, fn, "delta", delta, n, f->d_out,
                                   ld_delta)))
    return st;

  const size_t a = f->a, d_in = f->d_in, d_out = f->d_out;
  const size_t chunk = n < FIT_ROWS ? n : FIT_ROWS;
  size_t cnt;
  if (bico__mul(chunk, 2 * a + d_out, &cnt) || cnt > SIZE_MAX / sizeof(double))
    return bico__fail(ctx, BICO_E_SHAPE, "%s: scratch overflows", fn);
  if (f->th == NULL && f->k == NULL) {
    f->k = bico__calloc(ctx, a * a, sizeof(double));
    if (f->k == NULL) return BICO_E_NOMEM;
  }
  double *yn = bico__alloc(ctx, cnt * sizeof(double));
  if (yn == NULL) return BICO_E_NOMEM;
  double *yo = yn + chunk * a, *yd = yo + chunk * a;
  /* The ones column is part of the rows, so the GEMMs accumulate the bias
   * blocks (column sums, row count) with everything else. */
  for (size_t r0 = 0; r0 < n; r0 += chunk) {
    const size_t m = n - r0 < chunk ? n - r0 : chunk;
    for (size_t i = 0; i < m; i++) {
      const float *pn = x_new + (r0 + i) * ld_new;
      const float *po = x_orig + (r0 + i) * ld_orig;
      const float *pd = delta + (r0 + i) * ld_delta;
      double *qn = yn + i * a, *qo = yo + i * a, *qd = yd + i * d_out;
      for (size_t j = 0; j < d_in; j++) qn[j] = pn[j];
      if (f->th != NULL) /* X_B - X' (exact in double), the bias column 0 */
        for (size_t j = 0; j < d_in; j++) qo[j] = (double)po[j] - qn[j];
      else
        for (size_t j = 0; j < d_in; j++) qo[j] = po[j];
      if (a > d_in) {
        qn[d_in] = 1.0;
        qo[d_in] = f->th != NULL ? 0.0 : 1.0;
      }
      for (size_t j = 0; j < d_out; j++) qd[j] = pd[j];
    }
    dsyrk_upper(ctx, a, m, yn, a, f->g);
    if (f->th != NULL) /* the rows' residual: D_B + (X~_B - X~') Theta */
      bico__dgemm(ctx, 0, 1, m, d_out, a, 1.0, yo, a, f->th, a, 1.0, yd,
                  d_out);
    else
      bico__dgemm(ctx, 1, 0, a, a, m, 1.0, yn, a, yo, a, 1.0, f->k, a);
    bico__dgemm(ctx, 1, 0, d_out, a, m, 1.0, yd, d_out, yn, a, 1.0, f->et, a);
  }
  bico__free(ctx, yn);
  mirror_upper(f->g, a);
  f->rows += (uint64_t)n;
  return BICO_OK;
}

bico_status bico_fit_merge(bico_fit *dst, const bico_fit *src) {
  if (dst == NULL) return BICO_E_NULL;
  bico_ctx *ctx = dst->ctx;
  bico__clear(ctx);
  if (src == NULL) return bico__fail(ctx, BICO_E_NULL, "fit_merge: src is NULL");
  if (src->d_in != dst->d_in || src->d_out != dst->d_out ||
      src->flags != dst->flags)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "fit_merge: src is %zu -> %zu (flags %u), dst %zu -> "
                      "%zu (flags %u)",
                      src->d_in, src->d_out, src->flags, dst->d_in,
                      dst->d_out, dst->flags);
  if (src->rows > UINT64_MAX - dst->rows)
    return bico__fail(ctx, BICO_E_SHAPE, "fit_merge: row count overflows");
  if ((dst->th != NULL) != (src->th != NULL))
    return bico__fail(ctx, BICO_E_STATE,
                      "fit_merge: one fit accumulates its right-hand side "
                      "for a given weight (theta mode), the other not");
  if (src->th != NULL &&
      memcmp(src->th, dst->th, dst->d_out * dst->a * sizeof(double)) != 0)
    return bico__fail(ctx, BICO_E_STATE,
                      "fit_merge: the fits were given different weights");
  if (dst->th == NULL && src->k != NULL && dst->k == NULL) {
    dst->k = bico__calloc(ctx, dst->a * dst->a, sizeof(double));
    if (dst->k == NULL) return BICO_E_NOMEM;
  }
  const size_t count = dst->a * dst->a + dst->d_out * dst->a;
  const size_t kk = src->k != NULL ? dst->a * dst->a : 0;
  if (src == dst) {
    for (size_t i = 0; i < count; i++) dst->g[i] *= 2.0;
    for (size_t i = 0; i < kk; i++) dst->k[i] *= 2.0;
  } else {
    for (size_t i = 0; i < count; i++) dst->g[i] += src->g[i];
    for (size_t i = 0; i < kk; i++) dst->k[i] += src->k[i];
  }
  dst->rows += src->rows;
  return BICO_OK;
}

/* Numerical rank of g (a x a, PSD) by pivoted Cholesky on a copy. */
static bico_status rank_of(bico_fit *f, double *work, int *piv, size_t *rank) {
  const size_t a = f->a;
  memcpy(work, f->g, a * a * sizeof(double));
  double maxd = 0;
  for (size_t i = 0; i < a; i++)
    if (f->g[i * a + i] > maxd) maxd = f->g[i * a + i];
  if (maxd == 0) {
    *rank = 0;
    return BICO_OK;
  }
  const int na = (int)a;
  int r = 0, info = 0;
  const double tol = f->tol > 0 ? f->tol * maxd : -1.0;
  double *w2 = work + a * a;
  dpstrf_("U", &na, work, &na, piv, &r, &tol, w2, &info, 1);
  if (info < 0)
    return bico__fail(f->ctx, BICO_E_INTERNAL,
                      "fit_solve: dpstrf rejected argument %d", -info);
  *rank = (size_t)r;
  return BICO_OK;
}

/* Minimum-norm solve of A X = B^T (A a x a symmetric, in place; B^T is bt,
 * nrhs x a row-major, overwritten with X^T) through A's eigendecomposition,
 * dropping eigenvalues at or below tol * lambda_max. */
static bico_status eig_solve(bico_fit *f, double *amat, double *bt,
                             size_t nrhs) {
  bico_ctx *ctx = f->ctx;
  const size_t a = f->a;
  const int na = (int)a;
  int info = 0, lwork = -1, liwork = -1, iq = 0;
  double wq = 0;
  double *w = bico__alloc(ctx, a * sizeof(double));
  if (w == NULL) return BICO_E_NOMEM;
  dsyevd_("V", "U", &na, amat, &na, w, &wq, &lwork, &iq, &liwork, &info, 1, 1);
  bico_status st = BICO_OK;
  double *work = NULL, *t = NULL;
  int *iwork = NULL;
  if (info != 0 || !(wq >= 1.0) || wq >= (double)INT_MAX || iq < 1) {
    st = bico__fail(ctx, BICO_E_INTERNAL, "fit_solve: dsyevd workspace query "
                                          "failed (info %d)",
                    info);
    goto done;
  }
  lwork = (int)wq;
  liwork = iq;
  work = bico__alloc(ctx, (size_t)lwork * sizeof(double));
  iwork = work ? bico__alloc(ctx, (size_t)liwork * sizeof(int)) : NULL;
  if (iwork == NULL) {
    st = BICO_E_NOMEM;
    goto done;
  }
  dsyevd_("V", "U", &na, amat, &na, w, work, &lwork, iwork, &liwork, &info, 1,
          1);
  if (info != 0) {
    st = bico__fail(ctx, BICO_E_NUMERIC,
                    "fit_solve: the eigendecomposition (dsyevd) of the %zu x "
                    "%zu normal matrix did not converge (info %d)",
                    a, a, info);
    goto done;
  }
  /* Eigenvalues ascending; amat holds the eigenvectors column-major, i.e.
   * row-major V^T (row i = eigenvector i). */
  const double wmax = w[a - 1];
  const double rel = f->tol > 0 ? f->tol : (double)a * DBL_EPSILON;
  const double thr = wmax > 0 ? rel * wmax : 0;
  t = bico__alloc(ctx, nrhs * a * sizeof(double));
  if (t == NULL) {
    st = BICO_E_NOMEM;
    goto done;
  }
  /* X^T = B^T V diag(1/w) V^T */
  bico__dgemm(ctx, 0, 1, nrhs, a, a, 1.0, bt, a, amat, a, 0.0, t, a);
  for (size_t j = 0; j < a; j++) {
    const double s = w[j] > thr && w[j] > 0 ? 1.0 / w[j] : 0.0;
    for (size_t i = 0; i < nrhs; i++) t[i * a + j] *= s;
  }
  bico__dgemm(ctx, 0, 0, nrhs, a, a, 1.0, t, a, amat, a, 0.0, bt, a);
done:
  bico__free(ctx, t);
  bico__free(ctx, iwork);
  bico__free(ctx, work);
  bico__free(ctx, w);
  return st;
}

/* Block size of chol_upper: the trailing update is a rank-FIT_NB syrk,
 * big enough for BLIS to run near its GEMM speed. */
#define FIT_NB 256

/* Upper Cholesky factor of a (n x n, column-major, lda n) in place, A =
 * U^T U; the strict lower triangle is left alone.  Right-looking blocked:
 * reference LAPACK's dpotrf on each diagonal block, then the panel solve
 * and the trailing syrk through BLIS with the context's thread count
 * (reference dpotrf's own BLAS calls go through the BLAS API, which takes
 * BLIS's global thread count, and its 64-wide panels run well below GEMM
 * speed).  Returns 0, or LAPACK's info: the order of the first leading
 * minor that is not positive definite. */
static int chol_upper(const bico_ctx *ctx, int n, double *a) {
  double one = 1.0, minus_one = -1.0;
  rntm_t rntm;
  bli_rntm_init(&rntm);
  bli_rntm_set_num_threads((dim_t)ctx->threads, &rntm);
  const size_t ld = (size_t)n;
  for (int k = 0; k < n; k += FIT_NB) {
    int b = n - k < FIT_NB ? n - k : FIT_NB, info = 0;
    double *a11 = a + (size_t)k * ld + (size_t)k;
    dpotrf_("U", &b, a11, &n, &info, 1);
    if (info != 0) return info < 0 ? info : k + info;
    const int n2 = n - k - b;
    if (n2 == 0) break;
    double *a12 = a + (size_t)(k + b) * ld + (size_t)k;
    double *a22 = a12 + (size_t)b;
    bli_dtrsm_ex(BLIS_LEFT, BLIS_UPPER, BLIS_TRANSPOSE, BLIS_NONUNIT_DIAG,
                 (dim_t)b, (dim_t)n2, &one, a11, 1, (inc_t)ld, a12, 1,
                 (inc_t)ld, NULL, &rntm);
    bli_dsyrk_ex(BLIS_UPPER, BLIS_TRANSPOSE, (dim_t)n2, (dim_t)b, &minus_one,
                 a12, 1, (inc_t)ld, &one, a22, 1, (inc_t)ld, NULL, &rntm);
  }
  return 0;
}

/* X = A^{-1} B with A = U^T U (u from chol_upper), B n x nrhs
 * column-major (lda n), in place: two triangular solves through BLIS with
 * the context's thread count (what dpotrs does through the BLAS API). */
static void chol_solve(const bico_ctx *ctx, int n, int nrhs, const double *u,
                       double *b) {
  double one = 1.0;
  rntm_t rntm;
  bli_rntm_init(&rntm);
  bli_rntm_set_num_threads((dim_t)ctx->threads, &rntm);
  bli_dtrsm_ex(BLIS_LEFT, BLIS_UPPER, BLIS_TRANSPOSE, BLIS_NONUNIT_DIAG,
               (dim_t)n, (dim_t)nrhs, &one, (double *)u, 1, (inc_t)n, b, 1,
               (inc_t)n, NULL, &rntm);
  bli_dtrsm_ex(BLIS_LEFT, BLIS_UPPER, BLIS_NO_TRANSPOSE, BLIS_NONUNIT_DIAG,
               (dim_t)n, (dim_t)nrhs, &one, (double *)u, 1, (inc_t)n, b, 1,
               (inc_t)n, NULL, &rntm);
}

/* Rows of K - G per GEMM of the right-hand side (K mode). */
#define FIT_PANEL 256

/* amat = G + lambda P (a x a). */
static void normal_matrix(const bico_fit *f, double lambda, double *amat) {
  memcpy(amat, f->g, f->a * f->a * sizeof(double));
  for (size_t j = 0; j < f->d_in; j++) amat[j * f->a + j] += lambda;
}

bico_status bico_fit_solve(bico_fit *f, const float *w_b, size_t ld_w,
                           const float *b_b, float *dw, size_t ld_dw,
                           float *db, size_t *rank) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  bico__clear(ctx);
  const char *fn = "fit_solve";
  const int bias = (f->flags & BICO_FIT_BIAS) != 0;
  if (w_b == NULL || dw == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      w_b == NULL ? "w_b" : "dw");
  if (bias && (b_b == NULL || db == NULL))
    return bico__fail(ctx, BICO_E_NULL,
                      "%s: %s is NULL but the fit has a bias (BICO_FIT_BIAS)",
                      fn, b_b == NULL ? "b_b" : "db");
  if (!bias && (b_b != NULL || db != NULL))
    return bico__fail(ctx, BICO_E_ARG,
                      "%s: %s is given but the fit has no bias column (create "
                      "it with BICO_FIT_BIAS)",
                      fn, b_b != NULL ? "b_b" : "db");
  const size_t a = f->a, d_in = f->d_in, d_out = f->d_out;
  if (ld_w < d_in || ld_dw < d_in)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: row stride %s = %zu is below d_in = %zu", fn,
                      ld_w < d_in ? "ld_w" : "ld_dw",
                      ld_w < d_in ? ld_w : ld_dw, d_in);
  bico_status st;
  if ((st = bico__check_finite_f32(ctx, fn, "w_b", w_b, d_out, d_in, ld_w)))
    return st;
  if (bias && (st = bico__check_finite_f32(ctx, fn, "b_b", b_b, 1, d_out, d_out)))
    return st;
  if (f->rows == 0) {
    for (size_t o = 0; o < d_out; o++) {
      memset(dw + o * ld_dw, 0, d_in * sizeof(float));
      if (bias) db[o] = 0.0f;
    }
    if (rank) *rank = 0;
    return BICO_OK;
  }

  /* Workspace: A (a x a; the dpstrf copy needs a x a + 2a, and the
   * Cholesky factor overwrites A, which the fallback rebuilds from G),
   * Theta^T and the right-hand sides (d_out x a each), a panel of K - G
   * (FIT_PANEL x a), pivots. */
  size_t aa = a * a, ea = d_out * a; /* both fit: create checked them */
  const size_t panel = a < FIT_PANEL ? a : FIT_PANEL;
  double *amat = bico__alloc(
      ctx, (aa + 2 * a + 2 * ea + (f->th ? 0 : panel * a)) * sizeof(double));
  int *piv = amat ? bico__alloc(ctx, a * sizeof(int)) : NULL;
  if (piv == NULL) {
    bico__free(ctx, amat);
    return BICO_E_NOMEM;
  }
  double *tht = amat + aa + 2 * a, *rhs = tht + ea, *mm = rhs + ea;
  size_t rk = 0;
  /* The rank only when the caller asks for it (a pointer) or the solve
   * needs it (no ridge: a singular G goes to the eigendecomposition).
   * With a ridge it does not change the solution, and its pivoted
   * Cholesky costs about as much as the solve itself. */
  double trace = 0;
  for (size_t j = 0; j < d_in; j++) trace += f->g[j * a + j];
  const double lambda = f->ridge * trace / (double)d_in;
  const int need_rank = rank != NULL || lambda == 0;
  if (need_rank && (st = rank_of(f, amat, piv, &rk))) goto done;

  /* Right-hand sides, stored transposed (d_out x a): E in theta mode (it
   * holds the whole right-hand side), else (K - G) Theta + E, K - G taken
   * a panel of rows at a time. */
  memcpy(rhs, f->et, ea * sizeof(double));
  if (f->th == NULL) {
    for (size_t o = 0; o < d_out; o++) {
      for (size_t j = 0; j < d_in; j++) tht[o * a + j] = w_b[o * ld_w + j];
      if (bias) tht[o * a + d_in] = b_b[o];
    }
    for (size_t i0 = 0; i0 < a; i0 += panel) {
      const size_t p = a - i0 < panel ? a - i0 : panel;
      for (size_t e = 0; e < p * a; e++)
        mm[e] = f->k[i0 * a + e] - f->g[i0 * a + e];
      /* columns i0 .. i0+p of Theta^T (K - G)^T */
      bico__dgemm(ctx, 0, 1, d_out, p, a, 1.0, tht, a, mm, a, 1.0, rhs + i0,
                  a);
    }
  }

  /* Cholesky unless it is known to fail (no ridge and G singular). */
  int solved = 0;
  const int na = (int)a, nr = (int)d_out;
  if (!(lambda == 0 && rk < a)) {
    normal_matrix(f, lambda, amat);
    int info = chol_upper(ctx, na, amat);
    if (info == 0) {
      memcpy(tht, rhs, ea * sizeof(double)); /* keep rhs for the fallback */
      chol_solve(ctx, na, nr, amat, tht);
      if (
          bico__check_finite_f64(NULL, fn, "solution", tht, 1, ea, ea) ==
              BICO_OK) {
        memcpy(rhs, tht, ea * sizeof(double));
        solved = 1;
      }
    }
  }
  if (!solved) {
    normal_matrix(f, lambda, amat); /* (again: the factor overwrote it) */
    if ((st = eig_solve(f, amat, rhs, d_out))) goto done;
  }

  for (size_t o = 0; o < d_out; o++) {
    for (size_t j = 0; j < d_in; j++) dw[o * ld_dw + j] = (float)rhs[o * a + j];
    if (bias) db[o] = (float)rhs[o * a + d_in];
  }
  if ((st = bico__check_finite_f32(ctx, fn, "dw", dw, d_out, d_in, ld_dw)) ||
      (bias && (st = bico__check_finite_f32(ctx, fn, "db", db, 1, d_out, d_out)))) {
    st = bico__fail(ctx, BICO_E_NUMERIC,
                    "%s: the update overflows single precision (%s)", fn,
                    bico_ctx_errmsg(ctx));
    goto done;
  }
  if (rank) *rank = rk;
done:
  bico__free(ctx, piv);
  bico__free(ctx, amat);
  return st;
}

/* ---- serialisation (experimental.h): the statistics of one process's rows
 * carried to another, where bico_fit_merge adds them ----
 *
 * magic 8, version u32, flags u32, d_out u64, d_in u64, rows u64, parts u32
 * (bit 0: K, bit 1: Theta), reserved u32 (0), ridge f64, rank_tol f64; then
 * G (a x a), E^T (d_out x a), K (a x a) if present, Theta^T (d_out x a) if
 * present, doubles as their IEEE-754 bits, little-endian. */
#define FIT_MAGIC "BICOFIT\0"
#define FIT_FORMAT_VERSION 1u
#define FIT_HEADER_BYTES 64u
#define FIT_PART_K 1u
#define FIT_PART_THETA 2u

/* Doubles of the payload; 0 when they overflow size_t (with the header). */
static size_t fit_doubles(size_t d_out, size_t a, unsigned parts) {
  size_t aa, ea, n;
  if (bico__mul(a, a, &aa) || bico__mul(d_out, a, &ea)) return 0;
  n = aa;
  if (ea > SIZE_MAX - n) return 0;
  n += ea;
  if (parts & FIT_PART_K) {
    if (aa > SIZE_MAX - n) return 0;
    n += aa;
  }
  if (parts & FIT_PART_THETA) {
    if (ea > SIZE_MAX - n) return 0;
    n += ea;
  }
  if (n > (SIZE_MAX - FIT_HEADER_BYTES) / 8) return 0;
  return n;
}

static unsigned fit_parts(const bico_fit *f) {
  return (f->k != NULL ? FIT_PART_K : 0u) | (f->th != NULL ? FIT_PART_THETA : 0u);
}

bico_status bico_fit_serialized_size(const bico_fit *f, size_t *size) {
  if (f == NULL) return BICO_E_NULL;
  if (size == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "fit_serialized_size: size is NULL");
  /* The fit exists, so its arrays fit in memory: no overflow here. */
  *size = FIT_HEADER_BYTES + 8 * fit_doubles(f->d_out, f->a, fit_parts(f));
  return BICO_OK;
}

bico_status bico_fit_serialize(const bico_fit *f, void *buf, size_t cap,
                               size_t *written) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  size_t need;
  bico_status st = bico_fit_serialized_size(f, &need);
  if (st != BICO_OK) return st;
  if (buf == NULL || written == NULL)
    return bico__fail(ctx, BICO_E_NULL, "fit_serialize: %s is NULL",
                      buf == NULL ? "buf" : "written");
  if (cap < need)
    return bico__fail(ctx, BICO_E_ARG,
                      "fit_serialize: buffer of %zu bytes is too small, %zu "
                      "needed",
                      cap, need);
  const size_t a = f->a, aa = a * a, ea = f->d_out * a;
  const unsigned parts = fit_parts(f);
  unsigned char *p = buf;
  memcpy(p, FIT_MAGIC, 8);
  bico__put_u32(p + 8, FIT_FORMAT_VERSION);
  bico__put_u32(p + 12, f->flags);
  bico__put_u64(p + 16, (uint64_t)f->d_out);
  bico__put_u64(p + 24, (uint64_t)f->d_in);
  bico__put_u64(p + 32, f->rows);
  bico__put_u32(p + 40, parts);
  bico__put_u32(p + 44, 0);
  bico__put_f64(p + 48, f->ridge);
  bico__put_f64(p + 56, f->tol);
  p += FIT_HEADER_BYTES;
  p = bico__put_f64s(p, f->g, aa);
  p = bico__put_f64s(p, f->et, ea);
  if (parts & FIT_PART_K) p = bico__put_f64s(p, f->k, aa);
  if (parts & FIT_PART_THETA) p = bico__put_f64s(p, f->th, ea);
  *written = need;
  return BICO_OK;
}

/* The header's checks of bico_fit_deserialize; *count gets the payload's
 * doubles. */
static bico_status fit_header(bico_ctx *ctx, const unsigned char *p,
                              size_t len, size_t *count) {
  static const char fn[] = "fit_deserialize";
  if (len >= 8 && memcmp(p, FIT_MAGIC, 8) != 0)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: bad magic: the data is not a serialised fit (%zu "
                      "bytes)",
                      fn, len);
  if (len < 12)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: truncated: %zu bytes, the header alone has %u", fn,
                      len, FIT_HEADER_BYTES);
  const uint32_t version = bico__get_u32(p + 8);
  if (version != FIT_FORMAT_VERSION)
    return bico__fail(ctx, BICO_E_VERSION,
                      "%s: unknown format version %u (this library reads "
                      "version %u)",
                      fn, version, FIT_FORMAT_VERSION);
  if (len < FIT_HEADER_BYTES)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: truncated: %zu bytes, the header alone has %u", fn,
                      len, FIT_HEADER_BYTES);
  const uint32_t flags = bico__get_u32(p + 12);
  const uint32_t parts = bico__get_u32(p + 40);
  const uint64_t d_out = bico__get_u64(p + 16), d_in = bico__get_u64(p + 24);
  const double ridge = bico__get_f64(p + 48), tol = bico__get_f64(p + 56);
  if (flags & ~FIT_FLAGS)
    return bico__fail(ctx, BICO_E_FORMAT, "%s: unknown flags 0x%x", fn,
                      (unsigned)(flags & ~FIT_FLAGS));
  if ((parts & ~(FIT_PART_K | FIT_PART_THETA)) || parts == 3 ||
      bico__get_u32(p + 44) != 0)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: unknown parts 0x%x (K, Theta or neither) or a "
                      "reserved field set",
                      fn, (unsigned)parts);
  /* Every add of a fit without Theta makes K: rows without either are
   * not a fit's. */
  if (parts == 0 && bico__get_u64(p + 32) != 0)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: %llu rows but neither K nor Theta", fn,
                      (unsigned long long)bico__get_u64(p + 32));
  if (d_in == 0 || d_out == 0 || d_in >= (uint64_t)INT_MAX ||
      d_out > (uint64_t)INT_MAX)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: dimensions d_out = %llu, d_in = %llu (each from 1 "
                      "to %d)",
                      fn, (unsigned long long)d_out, (unsigned long long)d_in,
                      INT_MAX - 1);
  if (!(ridge >= 0 && ridge < HUGE_VAL) || !(tol >= 0 && tol < 1))
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: options out of range: ridge %g (0 to inf), "
                      "rank_tol %g (0 to 1)",
                      fn, ridge, tol);
  const size_t a = (size_t)d_in + ((flags & BICO_FIT_BIAS) ? 1 : 0);
  const size_t n = fit_doubles((size_t)d_out, a, parts);
  if (n == 0)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: a fit of %llu x %llu overflows the address space",
                      fn, (unsigned long long)d_out, (unsigned long long)d_in);
  if (len != FIT_HEADER_BYTES + 8 * n)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: %zu bytes, a %llu x %llu fit (flags %u, parts %u) "
                      "has %zu",
                      fn, len, (unsigned long long)d_out,
                      (unsigned long long)d_in, (unsigned)flags,
                      (unsigned)parts, FIT_HEADER_BYTES + 8 * n);
  *count = n;
  return BICO_OK;
}

/* The payload's checks: finite, G symmetric (what every add leaves). */
static bico_status fit_payload(bico_ctx *ctx, const unsigned char *q,
                               size_t count, size_t a) {
  static const char fn[] = "fit_deserialize";
  bico_status st = bico__check_finite_bytes(ctx, fn, q, count);
  if (st != BICO_OK) return st;
  for (size_t i = 1; i < a; i++)
    for (size_t j = 0; j < i; j++)
      if (memcmp(q + 8 * (i * a + j), q + 8 * (j * a + i), 8) != 0)
        return bico__fail(ctx, BICO_E_FORMAT,
                          "%s: G is not symmetric (entry %zu, %zu)", fn, i, j);
  return BICO_OK;
}

bico_status bico_fit_deserialize(bico_ctx *ctx, const void *buf, size_t len,
                                 bico_fit **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (buf == NULL || out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "fit_deserialize: %s is NULL",
                      buf == NULL ? "buf" : "out");
  const unsigned char *p = buf;
  size_t count = 0;
  bico_status st = fit_header(ctx, p, len, &count);
  if (st != BICO_OK) return st;
  const unsigned flags = bico__get_u32(p + 12), parts = bico__get_u32(p + 40);
  const size_t d_out = (size_t)bico__get_u64(p + 16);
  const size_t d_in = (size_t)bico__get_u64(p + 24);
  const size_t a = d_in + ((flags & BICO_FIT_BIAS) ? 1 : 0);
  const unsigned char *q = p + FIT_HEADER_BYTES;
  if ((st = fit_payload(ctx, q, count, a)) != BICO_OK) return st;
  bico_fit *f = NULL;
  if ((st = bico_fit_create(ctx, d_out, d_in, flags, &f)) != BICO_OK) return st;
  const size_t aa = a * a, ea = d_out * a;
  if (parts & FIT_PART_K) f->k = bico__alloc(ctx, aa * sizeof(double));
  if (parts & FIT_PART_THETA) f->th = bico__alloc(ctx, ea * sizeof(double));
  if (((parts & FIT_PART_K) && f->k == NULL) ||
      ((parts & FIT_PART_THETA) && f->th == NULL)) {
    bico_fit_free(f);
    return BICO_E_NOMEM;
  }
  q = bico__get_f64s(q, f->g, aa);
  q = bico__get_f64s(q, f->et, ea);
  if (parts & FIT_PART_K) q = bico__get_f64s(q, f->k, aa);
  if (parts & FIT_PART_THETA) (void)bico__get_f64s(q, f->th, ea);
  f->rows = bico__get_u64(p + 32);
  f->ridge = bico__get_f64(p + 48);
  f->tol = bico__get_f64(p + 56);
  *out = f;
  return BICO_OK;
}
