/* GradFix: the masks that keep the task-vector coordinates agreeing with
 * the descent sign the votes (votes.c) estimate. */
#include <math.h>
#include <stdint.h>

#include "internal.h"

/* Checks shared by mask and apply; tau must be finite. */
static bico_status check_mask_args(const bico_votes *v, const char *fn,
                                   int mode, const float *tau) {
  if (tau == NULL) return bico__fail(v->ctx, BICO_E_NULL, "%s: tau is NULL", fn);
  if (mode != 0 && mode != BICO_GRADFIX_MAJORITY && mode != BICO_GRADFIX_MEAN)
    return bico__fail(v->ctx, BICO_E_ARG, "%s: unknown mode %d", fn, mode);
  if (mode == BICO_GRADFIX_MEAN && v->sum == NULL)
    return bico__fail(v->ctx, BICO_E_STATE,
                      "%s: mode BICO_GRADFIX_MEAN needs an accumulator created "
                      "with BICO_VOTES_MEAN",
                      fn);
  return bico__check_finite_f32(v->ctx, fn, "tau", tau, 1, v->n, v->n);
}

/* 1 iff sign(tau_i) == sign(descent estimate_i) != 0. */
static int keep(const bico_votes *v, int mode, size_t i, float t) {
  int st = (t > 0.0f) - (t < 0.0f);
  int sd = mode == BICO_GRADFIX_MEAN
               ? (v->sum[i] > 0.0) - (v->sum[i] < 0.0)
               : (v->votes[i] > 0) - (v->votes[i] < 0);
  return st != 0 && st == sd;
}

bico_status bico_gradfix_mask(const bico_votes *v, int mode, const float *tau,
                              uint8_t *mask, size_t *kept) {
  if (v == NULL) return BICO_E_NULL;
  const char *fn = "gradfix_mask";
  if (mask == NULL)
    return bico__fail(v->ctx, BICO_E_NULL, "%s: mask is NULL", fn);
  bico_status st = check_mask_args(v, fn, mode, tau);
  if (st) return st;
  size_t count = 0;
  for (size_t i = 0; i < v->n; i++) {
    mask[i] = (uint8_t)keep(v, mode, i, tau[i]);
    count += mask[i];
  }
  if (kept != NULL) *kept = count;
  return BICO_OK;
}

bico_status bico_gradfix_apply(const bico_votes *v, int mode, float alpha,
                               const float *tau, float beta, float *out,
                               size_t *kept) {
  if (v == NULL) return BICO_E_NULL;
  const char *fn = "gradfix_apply";
  if (out == NULL) return bico__fail(v->ctx, BICO_E_NULL, "%s: out is NULL", fn);
  if (!isfinite(alpha) || !isfinite(beta))
    return bico__fail(v->ctx, BICO_E_ARG, "%s: %s is not finite", fn,
                      isfinite(alpha) ? "beta" : "alpha");
  bico_status st = check_mask_args(v, fn, mode, tau);
  if (st) return st;
  size_t count = 0;
  for (size_t i = 0; i < v->n; i++) {
    int k = keep(v, mode, i, tau[i]);
    float u = k ? alpha * tau[i] : 0.0f;
    out[i] = beta == 0.0f ? u : u + beta * out[i];
    count += (size_t)k;
  }
  if (kept != NULL) *kept = count;
  return BICO_OK;
}
