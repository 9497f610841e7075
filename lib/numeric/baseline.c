/* Baselines: naive transfer (tau as is) and zero padding / truncation. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Enough for every layer shape in practice (conv kernels have 4). */
#define MAX_NDIM 8

/* "[4, 3]" into buf (truncated with "..." if it does not fit). */
static const char *shape_str(char *buf, size_t cap, size_t ndim,
                             const size_t *shape) {
  size_t len = 0;
  buf[0] = '\0';
  len += (size_t)snprintf(buf, cap, "[");
  for (size_t d = 0; d < ndim && len < cap; d++)
    len += (size_t)snprintf(buf + len, cap - len, d ? ", %zu" : "%zu",
                            shape[d]);
  if (len < cap) len += (size_t)snprintf(buf + len, cap - len, "]");
  if (len >= cap && cap > 4) memcpy(buf + cap - 4, "...", 4);
  return buf;
}

/* NULLs, ndim in 1..MAX_NDIM, extents >= 1, element count without
 * overflow; *count gets the number of elements. */
static bico_status check_shape(bico_ctx *ctx, const char *fn, const char *nm,
                               size_t ndim, const size_t *shape,
                               size_t *count) {
  if (shape == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn, nm);
  if (ndim == 0)
    return bico__fail(ctx, BICO_E_SHAPE, "%s: %s has 0 dimensions", fn, nm);
  if (ndim > MAX_NDIM)
    return bico__fail(ctx, BICO_E_UNSUPPORTED,
                      "%s: %s has %zu dimensions; at most %d are supported",
                      fn, nm, ndim, MAX_NDIM);
  size_t n = 1;
  for (size_t d = 0; d < ndim; d++) {
    char buf[256];
    if (shape[d] == 0)
      return bico__fail(ctx, BICO_E_SHAPE, "%s: %s %s has a zero extent", fn,
                        nm, shape_str(buf, sizeof buf, ndim, shape));
    if (bico__mul(n, shape[d], &n) || n > SIZE_MAX / sizeof(float))
      return bico__fail(ctx, BICO_E_SHAPE,
                        "%s: %s %s has too many elements", fn, nm,
                        shape_str(buf, sizeof buf, ndim, shape));
  }
  *count = n;
  return BICO_OK;
}

/* The checks both kernels share, shapes first, then data. */
static bico_status check_common(bico_ctx *ctx, const char *fn, size_t ndim_a,
                                const size_t *shape_a, size_t ndim_b,
                                const size_t *shape_b, const float *tau,
                                float alpha, float beta, const float *out,
                                size_t *na, size_t *nb) {
  if (tau == NULL) return bico__fail(ctx, BICO_E_NULL, "%s: tau is NULL", fn);
  if (out == NULL) return bico__fail(ctx, BICO_E_NULL, "%s: out is NULL", fn);
  bico_status st;
  if ((st = check_shape(ctx, fn, "shape_a", ndim_a, shape_a, na))) return st;
  if ((st = check_shape(ctx, fn, "shape_b", ndim_b, shape_b, nb))) return st;
  if (!isfinite(alpha) || !isfinite(beta))
    return bico__fail(ctx, BICO_E_ARG, "%s: %s is not finite", fn,
                      isfinite(alpha) ? "beta" : "alpha");
  return BICO_OK;
}

static bico_status shape_mismatch(bico_ctx *ctx, const char *fn,
                                  const char *why, size_t ndim_a,
                                  const size_t *shape_a, size_t ndim_b,
                                  const size_t *shape_b) {
  char a[256], b[256];
  return bico__fail(ctx, BICO_E_SHAPE, "%s: %s: %s vs %s", fn, why,
                    shape_str(a, sizeof a, ndim_a, shape_a),
                    shape_str(b, sizeof b, ndim_b, shape_b));
}

bico_status bico_baseline_naive(bico_ctx *ctx, size_t ndim_a,
                                const size_t *shape_a, size_t ndim_b,
                                const size_t *shape_b, float alpha,
                                const float *tau, float beta, float *out) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  const char *fn = "baseline_naive";
  size_t na, nb;
  bico_status st = check_common(ctx, fn, ndim_a, shape_a, ndim_b, shape_b,
                                tau, alpha, beta, out, &na, &nb);
  if (st) return st;
  if (ndim_a != ndim_b ||
      memcmp(shape_a, shape_b, ndim_a * sizeof *shape_a) != 0)
    return shape_mismatch(ctx, fn, "shapes differ (source vs target)", ndim_a,
                          shape_a, ndim_b, shape_b);
  if ((st = bico__check_finite_f32(ctx, fn, "tau", tau, 1, na, na)))
    return st;
  for (size_t i = 0; i < na; i++)
    out[i] = beta == 0.0f ? alpha * tau[i] : alpha * tau[i] + beta * out[i];
  return BICO_OK;
}

bico_status bico_baseline_pad(bico_ctx *ctx, size_t ndim_a,
                              const size_t *shape_a, size_t ndim_b,
                              const size_t *shape_b, float alpha,
                              const float *tau, float beta, float *out) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  const char *fn = "baseline_pad";
  size_t na, nb;
  bico_status st = check_common(ctx, fn, ndim_a, shape_a, ndim_b, shape_b,
                                tau, alpha, beta, out, &na, &nb);
  if (st) return st;
  if (ndim_a != ndim_b)
    return shape_mismatch(ctx, fn, "numbers of dimensions differ", ndim_a,
                          shape_a, ndim_b, shape_b);
  if ((st = bico__check_finite_f32(ctx, fn, "tau", tau, 1, na, na)))
    return st;

  /* Walk the target's rows (all dimensions but the last) with an odometer;
   * a row whose outer index lies inside the source copies the overlapping
   * prefix of the source row, everything else is padding. */
  size_t nd = ndim_b, last_a = shape_a[nd - 1], last_b = shape_b[nd - 1];
  size_t keep = last_a < last_b ? last_a : last_b;
  size_t stride_a[MAX_NDIM], idx[MAX_NDIM] = {0};
  stride_a[nd - 1] = 1;
  for (size_t d = nd - 1; d > 0; d--) stride_a[d - 1] = stride_a[d] * shape_a[d];
  size_t rows_b = nb / last_b;
  for (size_t r = 0; r < rows_b; r++) {
    float *o = out + r * last_b;
    int inside = 1;
    size_t off = 0;
    for (size_t d = 0; d + 1 < nd; d++) {
      if (idx[d] >= shape_a[d]) inside = 0;
      off += idx[d] * stride_a[d];
    }
    size_t j = 0;
    if (inside) {
      const float *t = tau + off;
      for (; j < keep; j++)
        o[j] = beta == 0.0f ? alpha * t[j] : alpha * t[j] + beta * o[j];
    }
    for (; j < last_b; j++) o[j] = beta == 0.0f ? 0.0f : beta * o[j];
    for (size_t d = nd - 1; d > 0; d--) {
      if (++idx[d - 1] < shape_b[d - 1]) break;
      idx[d - 1] = 0;
    }
  }
  return BICO_OK;
}
