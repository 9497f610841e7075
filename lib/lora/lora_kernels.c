/* LoRA kernels: a module's dense update, factored transport and
 * truncation to a rank (SVD). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lapack.h"
#include "lora_impl.h"

/* ==================================================================== */
/* Kernels                                                                */

bico_status bico_lora_dense(const bico_lora *l, size_t i, float alpha,
                            float beta, float *out, size_t ld) {
  if (l == NULL) return BICO_E_NULL;
  bico_ctx *ctx = l->ctx;
  bico__clear(ctx);
  if (out == NULL) return bico__fail(ctx, BICO_E_NULL, "lora_dense: out is NULL");
  if (i >= l->nmods)
    return bico__fail(ctx, BICO_E_ARG,
                      "lora_dense: index %zu out of range (%zu modules)", i,
                      l->nmods);
  const lmod *m = &l->mods[i];
  if (ld < m->din)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "lora_dense: ld %zu is below d_in %zu (module %s)", ld,
                      m->din, m->name);
  if (!isfinite(alpha) || !isfinite(beta))
    return bico__fail(ctx, BICO_E_NONFINITE,
                      "lora_dense: alpha %g or beta %g is not finite",
                      (double)alpha, (double)beta);
  bico__sgemm(ctx, 0, 0, m->dout, m->din, m->rank,
              (float)(alpha * bico__lora_scale(l, m)), m->b, m->rank, m->a, m->din,
              beta, out, ld);
  return BICO_OK;
}

bico_status bico_lora_transport(bico_ctx *ctx, size_t rank, size_t k,
                                size_t dout_a, size_t din_a, size_t dout_b,
                                size_t din_b, float alpha, const float *b,
                                const float *a, float *const *r_outs,
                                size_t ld_rout, const float *r_in,
                                size_t ld_rin, float *b_out, float *a_out) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  const char *fn = "lora_transport";
  if (b == NULL || a == NULL || b_out == NULL || a_out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      b == NULL   ? "b"
                      : a == NULL ? "a"
                      : b_out == NULL ? "b_out"
                                      : "a_out");
  if (rank == 0 || k == 0 || dout_a == 0 || din_a == 0 || dout_b == 0 ||
      din_b == 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: rank %zu, k %zu, dout_a %zu, din_a %zu, dout_b %zu, "
                      "din_b %zu must all be at least 1",
                      fn, rank, k, dout_a, din_a, dout_b, din_b);
  if (dout_a % k || dout_b % k)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: output widths %zu and %zu do not split in %zu "
                      "blocks",
                      fn, dout_a, dout_b, k);
  size_t ba = dout_a / k, bb = dout_b / k;
  int any_out = 0;
  for (size_t j = 0; r_outs && j < k; j++) any_out |= r_outs[j] != NULL;
  if (any_out && ld_rout < bb)
    return bico__fail(ctx, BICO_E_SHAPE, "%s: ld_rout %zu is below %zu", fn,
                      ld_rout, bb);
  if (r_in && ld_rin < din_b)
    return bico__fail(ctx, BICO_E_SHAPE, "%s: ld_rin %zu is below din_b %zu",
                      fn, ld_rin, din_b);
  if (!isfinite(alpha))
    return bico__fail(ctx, BICO_E_NONFINITE, "%s: alpha %g is not finite", fn,
                      (double)alpha);
  bico_status st = bico__check_finite_f32(ctx, fn, "b", b, dout_a, rank, rank);
  if (st == BICO_OK) st = bico__check_finite_f32(ctx, fn, "a", a, rank, din_a, din_a);
  for (size_t j = 0; st == BICO_OK && r_outs && j < k; j++)
    if (r_outs[j])
      st = bico__check_finite_f32(ctx, fn, "r_outs[j]", r_outs[j], ba, bb, ld_rout);
  if (st == BICO_OK && r_in)
    st = bico__check_finite_f32(ctx, fn, "r_in", r_in, din_a, din_b, ld_rin);
  if (st != BICO_OK) return st;
  /* B' block j = alpha R_j^T B_j: [bb, ba] x [ba, rank]. */
  for (size_t j = 0; j < k; j++) {
    const float *bj = b + j * ba * rank;
    float *oj = b_out + j * bb * rank;
    const float *rj = r_outs ? r_outs[j] : NULL;
    if (rj) {
      bico__sgemm(ctx, 1, 0, bb, rank, ba, alpha, rj, ld_rout, bj, rank, 0.0f,
                  oj, rank);
    } else {
      size_t m = ba < bb ? ba : bb;
      for (size_t i = 0; i < bb; i++)
        for (size_t c = 0; c < rank; c++)
          oj[i * rank + c] = i < m ? alpha * bj[i * rank + c] : 0.0f;
    }
  }
  /* A' = A R_in: [rank, din_a] x [din_a, din_b]. */
  if (r_in) {
    bico__sgemm(ctx, 0, 0, rank, din_b, din_a, 1.0f, a, din_a, r_in, ld_rin,
                0.0f, a_out, din_b);
  } else {
    size_t m = din_a < din_b ? din_a : din_b;
    for (size_t i = 0; i < rank; i++)
      for (size_t c = 0; c < din_b; c++)
        a_out[i * din_b + c] = c < m ? a[i * din_a + c] : 0.0f;
  }
  return BICO_OK;
}

static int to_int(size_t v, int *out) {
  if (v > 2147483647u) return 1;
  *out = (int)v;
  return 0;
}

bico_status bico_lora_truncate(bico_ctx *ctx, size_t d_out, size_t d_in,
                               size_t rank, double scale, const float *dense,
                               size_t ld, float *b_out, float *a_out,
                               double *energy) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  const char *fn = "lora_truncate";
  if (dense == NULL || b_out == NULL || a_out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      dense == NULL ? "dense" : b_out == NULL ? "b_out" : "a_out");
  if (d_out == 0 || d_in == 0 || rank == 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: d_out %zu, d_in %zu, rank %zu must all be at least 1",
                      fn, d_out, d_in, rank);
  if (ld < d_in)
    return bico__fail(ctx, BICO_E_SHAPE, "%s: ld %zu is below d_in %zu", fn, ld,
                      d_in);
  if (!isfinite(scale) || !(scale > 0))
    return bico__fail(ctx, isfinite(scale) ? BICO_E_ARG : BICO_E_NONFINITE,
                      "%s: scale %g must be a positive number", fn, scale);
  int mi, ni;
  size_t total;
  if (to_int(d_out, &mi) || to_int(d_in, &ni) || bico__mul(d_out, d_in, &total))
    return bico__fail(ctx, BICO_E_SHAPE, "%s: %zu x %zu is too large for LAPACK",
                      fn, d_out, d_in);
  bico_status st = bico__check_finite_f32(ctx, fn, "dense", dense, d_out, d_in, ld);
  if (st != BICO_OK) return st;
  size_t mn = d_out < d_in ? d_out : d_in;
  const int mni = (int)mn;
  double *m = bico__alloc(ctx, total * sizeof(double));
  double *s = bico__calloc(ctx, mn, sizeof(double));
  double *u = bico__calloc(ctx, mn, d_out * sizeof(double));
  double *vt = bico__calloc(ctx, mn, d_in * sizeof(double));
  int *iwork = bico__calloc(ctx, mn, 8 * sizeof(int));
  double *work = NULL;
  if (m == NULL || s == NULL || u == NULL || vt == NULL || iwork == NULL) {
    st = BICO_E_NOMEM;
    goto done;
  }
  /* Column-major copy for LAPACK. */
  double ss = 0;
  for (size_t i = 0; i < d_out; i++)
    for (size_t j = 0; j < d_in; j++) {
      double x = dense[i * ld + j];
      m[i + j * d_out] = x;
      ss += x * x;
    }
  if (ss > 0) {
    int info = 0, lwork = -1;
    double wq = 0;
    dgesdd_("S", &mi, &ni, m, &mi, s, u, &mi, vt, &mni, &wq, &lwork, iwork,
            &info, 1);
    if (info != 0 || !(wq < 2147483647.0)) {
      st = bico__fail(ctx, BICO_E_INTERNAL,
                      "%s: dgesdd workspace query failed (info %d)", fn, info);
      goto done;
    }
    lwork = (int)wq + 1;
    work = bico__alloc(ctx, (size_t)lwork * sizeof(double));
    if (work == NULL) {
      st = BICO_E_NOMEM;
      goto done;
    }
    dgesdd_("S", &mi, &ni, m, &mi, s, u, &mi, vt, &mni, work, &lwork, iwork,
            &info, 1);
    if (info != 0) {
      st = bico__fail(ctx, info > 0 ? BICO_E_NUMERIC : BICO_E_INTERNAL,
                      "%s: the SVD of the %zu x %zu update failed (dgesdd info "
                      "%d)",
                      fn, d_out, d_in, info);
      goto done;
    }
  }
  double kept = 0, all = 0;
  for (size_t c = 0; c < mn; c++) {
    all += s[c] * s[c];
    if (c < rank) kept += s[c] * s[c];
  }
  if (energy) *energy = all > 0 ? kept / all : 1.0;
  for (size_t c = 0; c < rank; c++) {
    double g = c < mn ? sqrt(s[c] / scale) : 0.0;
    for (size_t i = 0; i < d_out; i++)
      b_out[i * rank + c] = c < mn ? (float)(u[i + c * d_out] * g) : 0.0f;
    for (size_t j = 0; j < d_in; j++)
      a_out[c * d_in + j] = c < mn ? (float)(vt[c + j * mn] * g) : 0.0f;
  }
done:
  bico__free(ctx, m);
  bico__free(ctx, s);
  bico__free(ctx, u);
  bico__free(ctx, vt);
  bico__free(ctx, iwork);
  bico__free(ctx, work);
  return st;
}
