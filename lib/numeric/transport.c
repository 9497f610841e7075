/* Transport kernels: out = alpha R_out^T tau R_in + beta out and its vector,
 * row-wise and fused-split forms.
 *
 * Everything is expressed through one core (transport_core) on row-major
 * blocks with strides: a vector is a dout x 1 matrix carried by r_out, rows
 * are an n x d matrix carried by r_in.  A NULL map is the rectangular
 * identity, handled by copying the overlapping block and zero-padding (never
 * by building an identity matrix and multiplying by it). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "internal.h"

/* Names used in error messages, so each public wrapper reports its own
 * function and argument names. */
typedef struct names {
  const char *fn, *tau, *r_out, *r_in, *out;
} names;

/* dst = beta dst over a rows x cols block; beta = 0 writes zeros without
 * reading dst (it may hold NaN). */
static void scale_block(size_t rows, size_t cols, float beta, float *dst,
                        size_t ld) {
  if (beta == 1.0f) return;
  for (size_t i = 0; i < rows; i++) {
    float *d = dst + i * ld;
    if (beta == 0.0f)
      for (size_t j = 0; j < cols; j++) d[j] = 0.0f;
    else
      for (size_t j = 0; j < cols; j++) d[j] *= beta;
  }
}

/* dst = alpha src + beta dst over a rows x cols block (beta = 0: dst not
 * read). */
static void axpby_block(size_t rows, size_t cols, float alpha,
                        const float *src, size_t lds, float beta, float *dst,
                        size_t ldd) {
  for (size_t i = 0; i < rows; i++) {
    const float *s = src + i * lds;
    float *d = dst + i * ldd;
    if (beta == 0.0f)
      for (size_t j = 0; j < cols; j++) d[j] = alpha * s[j];
    else
      for (size_t j = 0; j < cols; j++) d[j] = alpha * s[j] + beta * d[j];
  }
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* Flop counts (up to the common factor 2) of the two association orders
 * when both maps are present; computed in double so they cannot overflow.
 *   left first:  T = R_out^T tau  (dout_b x din_a), then T R_in
 *   right first: T = tau R_in     (dout_a x din_b), then R_out^T T */
static int left_first(size_t dout_a, size_t din_a, size_t dout_b,
                      size_t din_b) {
  double left = (double)dout_b * (double)din_a *
                ((double)dout_a + (double)din_b);
  double right = (double)dout_a * (double)din_b *
                 ((double)din_a + (double)dout_b);
  return left < right;
}

/* Allocates the workspace transport_core needs (none unless both maps are
 * given; then the intermediate product of the cheaper order).  *work stays
 * NULL when none is needed. */
static bico_status alloc_work(bico_ctx *ctx, const char *fn, int have_out,
                              int have_in, size_t dout_a, size_t din_a,
                              size_t dout_b, size_t din_b, float **work) {
  *work = NULL;
  if (!have_out || !have_in) return BICO_OK;
  size_t r, c, n;
  if (left_first(dout_a, din_a, dout_b, din_b))
    r = dout_b, c = din_a;
  else
    r = dout_a, c = din_b;
  if (bico__mul(r, c, &n))
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: intermediate product %zu x %zu is too large", fn,
                      r, c);
  *work = bico__calloc(ctx, n, sizeof **work);
  return *work != NULL ? BICO_OK : BICO_E_NOMEM;
}

/* The arithmetic, on validated arguments; work comes from alloc_work. */
static void transport_core(const bico_ctx *ctx, size_t dout_a, size_t din_a,
                           const float *tau, size_t ld_tau,
                           const float *r_out, size_t ld_rout, size_t dout_b,
                           const float *r_in, size_t ld_rin, size_t din_b,
                           float alpha, float beta, float *out, size_t ld_out,
                           float *work) {
  if (r_out == NULL && r_in == NULL) {
    /* I^T tau I: the overlapping top-left block, zeros elsewhere. */
    size_t m = min_sz(dout_a, dout_b), c = min_sz(din_a, din_b);
    axpby_block(m, c, alpha, tau, ld_tau, beta, out, ld_out);
    scale_block(m, din_b - c, beta, out + c, ld_out);
    scale_block(dout_b - m, din_b, beta, out + m * ld_out, ld_out);
  } else if (r_out == NULL) {
    /* I^T (tau R_in): the first min(dout_a, dout_b) rows of tau R_in. */
    size_t m = min_sz(dout_a, dout_b);
    bico__sgemm(ctx, 0, 0, m, din_b, din_a, alpha, tau, ld_tau, r_in, ld_rin,
                beta, out, ld_out);
    scale_block(dout_b - m, din_b, beta, out + m * ld_out, ld_out);
  } else if (r_in == NULL) {
    /* R_out^T (tau I): R_out^T times the first min(din_a, din_b) columns. */
    size_t c = min_sz(din_a, din_b);
    bico__sgemm(ctx, 1, 0, dout_b, c, dout_a, alpha, r_out, ld_rout, tau,
                ld_tau, beta, out, ld_out);
    scale_block(dout_b, din_b - c, beta, out + c, ld_out);
  } else if (left_first(dout_a, din_a, dout_b, din_b)) {
    bico__sgemm(ctx, 1, 0, dout_b, din_a, dout_a, 1.0f, r_out, ld_rout, tau,
                ld_tau, 0.0f, work, din_a);
    bico__sgemm(ctx, 0, 0, dout_b, din_b, din_a, alpha, work, din_a, r_in,
                ld_rin, beta, out, ld_out);
  } else {
    bico__sgemm(ctx, 0, 0, dout_a, din_b, din_a, 1.0f, tau, ld_tau, r_in,
                ld_rin, 0.0f, work, din_b);
    bico__sgemm(ctx, 1, 0, dout_b, din_b, dout_a, alpha, r_out, ld_rout, work,
                din_b, beta, out, ld_out);
  }
}

/* A rows x cols block with row stride ld must be addressable: ld >= cols
 * and (rows - 1) ld + cols floats must not overflow. */
static bico_status check_block(bico_ctx *ctx, const names *nm,
                               const char *what, size_t rows, size_t cols,
                               size_t ld, const char *ldname) {
  if (ld < cols)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: %s = %zu is smaller than the %zu columns of %s",
                      nm->fn, ldname, ld, cols, what);
  size_t span;
  if (bico__mul(rows - 1, ld, &span) || span > SIZE_MAX - cols ||
      span + cols > SIZE_MAX / sizeof(float) / 2)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: %s (%zu x %zu, row stride %zu) is too large",
                      nm->fn, what, rows, cols, ld);
  return BICO_OK;
}

static bico_status check_scalars(bico_ctx *ctx, const names *nm, float alpha,
                                 float beta) {
  if (!isfinite(alpha))
    return bico__fail(ctx, BICO_E_ARG, "%s: alpha is %s", nm->fn,
                      isnan(alpha) ? "NaN" : "Inf");
  if (!isfinite(beta))
    return bico__fail(ctx, BICO_E_ARG, "%s: beta is %s", nm->fn,
                      isnan(beta) ? "NaN" : "Inf");
  return BICO_OK;
}

/* Checks shared by every wrapper: NULLs, zero dims, strides, scalars. The
 * finiteness of the maps is checked by the callers (split has many). */
static bico_status validate(bico_ctx *ctx, const names *nm, size_t dout_a,
                            size_t din_a, const float *tau, size_t ld_tau,
                            size_t dout_b, size_t din_b, float alpha,
                            float beta, const float *out, size_t ld_out) {
  if (tau == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", nm->fn, nm->tau);
  if (out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", nm->fn, nm->out);
  if (dout_a == 0 || din_a == 0 || dout_b == 0 || din_b == 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: zero dimension (source %zu x %zu, target %zu x "
                      "%zu)",
                      nm->fn, dout_a, din_a, dout_b, din_b);
  bico_status st;
  if ((st = check_block(ctx, nm, nm->tau, dout_a, din_a, ld_tau, "ld_tau")))
    return st;
  if ((st = check_block(ctx, nm, nm->out, dout_b, din_b, ld_out, "ld_out")))
    return st;
  return check_scalars(ctx, nm, alpha, beta);
}

static bico_status check_map(bico_ctx *ctx, const names *nm, const char *what,
                             const float *r, size_t rows, size_t cols,
                             size_t ld, const char *ldname) {
  if (r == NULL) return BICO_OK;
  bico_status st = check_block(ctx, nm, what, rows, cols, ld, ldname);
  if (st) return st;
  return bico__check_finite_f32(ctx, nm->fn, what, r, rows, cols, ld);
}

/* Validation, finiteness, workspace and the core for the single-block
 * forms. */
static bico_status transport_one(bico_ctx *ctx, const names *nm,
                                 size_t dout_a, size_t din_a, const float *tau,
                                 size_t ld_tau, const float *r_out,
                                 size_t ld_rout, size_t dout_b,
                                 const float *r_in, size_t ld_rin,
                                 size_t din_b, float alpha, float beta,
                                 float *out, size_t ld_out) {
  bico_status st = validate(ctx, nm, dout_a, din_a, tau, ld_tau, dout_b,
                            din_b, alpha, beta, out, ld_out);
  if (st) return st;
  if ((st = check_map(ctx, nm, nm->r_out, r_out, dout_a, dout_b, ld_rout,
                      "ld_rout")))
    return st;
  if ((st = check_map(ctx, nm, nm->r_in, r_in, din_a, din_b, ld_rin,
                      "ld_rin")))
    return st;
  if ((st = bico__check_finite_f32(ctx, nm->fn, nm->tau, tau, dout_a, din_a,
                                   ld_tau)))
    return st;
  float *work;
  if ((st = alloc_work(ctx, nm->fn, r_out != NULL, r_in != NULL, dout_a,
                       din_a, dout_b, din_b, &work)))
    return st;
  transport_core(ctx, dout_a, din_a, tau, ld_tau, r_out, ld_rout, dout_b,
                 r_in, ld_rin, din_b, alpha, beta, out, ld_out, work);
  bico__free(ctx, work);
  return BICO_OK;
}

bico_status bico_transport_weight(bico_ctx *ctx, size_t dout_a, size_t din_a,
                                  size_t dout_b, size_t din_b, float alpha,
                                  const float *tau, size_t ld_tau,
                                  const float *r_out, size_t ld_rout,
                                  const float *r_in, size_t ld_rin, float beta,
                                  float *out, size_t ld_out) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  static const names nm = {"transport_weight", "tau", "r_out", "r_in", "out"};
  return transport_one(ctx, &nm, dout_a, din_a, tau, ld_tau, r_out, ld_rout,
                       dout_b, r_in, ld_rin, din_b, alpha, beta, out, ld_out);
}

bico_status bico_transport_vector(bico_ctx *ctx, size_t d_a, size_t d_b,
                                  float alpha, const float *v, const float *r,
                                  size_t ld_r, float beta, float *out) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  static const names nm = {"transport_vector", "v", "r", "(none)", "out"};
  /* v is a d_a x 1 matrix carried on its row side. */
  return transport_one(ctx, &nm, d_a, 1, v, 1, r, ld_r, d_b, NULL, 1, 1,
                       alpha, beta, out, 1);
}

bico_status bico_transport_rows(bico_ctx *ctx, size_t n, size_t d_a,
                                size_t d_b, float alpha, const float *t,
                                size_t ld_t, const float *r, size_t ld_r,
                                float beta, float *out, size_t ld_out) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  static const names nm = {"transport_rows", "t", "(none)", "r", "out"};
  /* t is carried on its column side; its rows map one to one. */
  return transport_one(ctx, &nm, n, d_a, t, ld_t, NULL, 1, n, r, ld_r, d_b,
                       alpha, beta, out, ld_out);
}

bico_status bico_transport_weight_split(
    bico_ctx *ctx, size_t k, size_t dout_a, size_t din_a, size_t dout_b,
    size_t din_b, float alpha, const float *tau, size_t ld_tau,
    float *const *r_outs, size_t ld_rout, const float *r_in,
    size_t ld_rin, float beta, float *out, size_t ld_out) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  static const names nm = {"transport_weight_split", "tau", "r_outs", "r_in",
                           "out"};
  const char *fn = nm.fn;
  if (k == 0) return bico__fail(ctx, BICO_E_ARG, "%s: k is 0", fn);
  bico_status st = validate(ctx, &nm, dout_a, din_a, tau, ld_tau, dout_b,
                            din_b, alpha, beta, out, ld_out);
  if (st) return st;
  if (dout_a % k != 0 || dout_b % k != 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: k = %zu blocks do not divide dout_a = %zu and "
                      "dout_b = %zu",
                      fn, k, dout_a, dout_b);
  size_t ba = dout_a / k, bb = dout_b / k;
  int any_out = 0;
  if (r_outs != NULL)
    for (size_t i = 0; i < k; i++) {
      char what[48];
      snprintf(what, sizeof what, "r_outs[%zu]", i);
      if ((st = check_map(ctx, &nm, what, r_outs[i], ba, bb, ld_rout,
                          "ld_rout")))
        return st;
      any_out |= r_outs[i] != NULL;
    }
  if ((st = check_map(ctx, &nm, "r_in", r_in, din_a, din_b, ld_rin,
                      "ld_rin")))
    return st;
  if ((st = bico__check_finite_f32(ctx, fn, "tau", tau, dout_a, din_a,
                                   ld_tau)))
    return st;
  /* Every block has the same shape, so one workspace serves all. */
  float *work;
  if ((st = alloc_work(ctx, fn, any_out, r_in != NULL, ba, din_a, bb, din_b,
                       &work)))
    return st;
  for (size_t i = 0; i < k; i++) {
    const float *ro = r_outs != NULL ? r_outs[i] : NULL;
    transport_core(ctx, ba, din_a, tau + i * ba * ld_tau, ld_tau, ro, ld_rout,
                   bb, r_in, ld_rin, din_b, alpha, beta,
                   out + i * bb * ld_out, ld_out, work);
  }
  bico__free(ctx, work);
  return BICO_OK;
}
