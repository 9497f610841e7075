/* bico_votes: per-coordinate sign votes of per-sample gradients (votes.h).
 * The masks GradFix builds from them are in gradfix.c. */
#include <math.h>
#include <stdint.h>

#include "internal.h"

/* Votes are int32: capping the sample count at INT32_MAX makes a vote
 * overflow impossible. */
static bico_status check_room(const bico_votes *v, const char *fn,
                              uint64_t more) {
  if (more > (uint64_t)INT32_MAX - v->samples)
    return bico__fail(v->ctx, BICO_E_ARG,
                      "%s: %llu samples so far plus %llu more exceed the "
                      "limit of %ld",
                      fn, (unsigned long long)v->samples,
                      (unsigned long long)more, (long)INT32_MAX);
  return BICO_OK;
}

bico_status bico_votes_create(bico_ctx *ctx, size_t n, unsigned flags,
                              bico_votes **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "votes_create: out is NULL");
  *out = NULL;
  if (n == 0)
    return bico__fail(ctx, BICO_E_SHAPE, "votes_create: n is 0");
  if (flags & ~(unsigned)BICO_VOTES_MEAN)
    return bico__fail(ctx, BICO_E_ARG, "votes_create: unknown flags 0x%x",
                      flags & ~(unsigned)BICO_VOTES_MEAN);
  bico_votes *v = bico__calloc(ctx, 1, sizeof *v);
  if (v == NULL) return BICO_E_NOMEM;
  v->ctx = ctx;
  v->n = n;
  v->flags = flags;
  v->votes = bico__calloc(ctx, n, sizeof *v->votes);
  if (v->votes == NULL) goto nomem;
  if (flags & BICO_VOTES_MEAN) {
    v->sum = bico__calloc(ctx, n, sizeof *v->sum);
    if (v->sum == NULL) goto nomem;
  }
  *out = v;
  return BICO_OK;
nomem:
  bico_votes_free(v);
  return BICO_E_NOMEM;
}

void bico_votes_free(bico_votes *v) {
  if (v == NULL) return;
  bico_ctx *ctx = v->ctx;
  bico__free(ctx, v->votes);
  bico__free(ctx, v->sum);
  bico__free(ctx, v);
}

bico_status bico_votes_add_grad(bico_votes *v, const float *grad) {
  if (v == NULL) return BICO_E_NULL;
  bico__clear(v->ctx);
  const char *fn = "votes_add_grad";
  if (grad == NULL) return bico__fail(v->ctx, BICO_E_NULL, "%s: grad is NULL", fn);
  bico_status st = check_room(v, fn, 1);
  if (st) return st;
  /* Scan first so a bad gradient changes nothing. */
  if ((st = bico__check_finite_f32(v->ctx, fn, "grad", grad, 1, v->n, v->n)))
    return st;
  for (size_t i = 0; i < v->n; i++)
    v->votes[i] += (grad[i] < 0.0f) - (grad[i] > 0.0f);
  if (v->sum != NULL)
    for (size_t i = 0; i < v->n; i++) v->sum[i] -= (double)grad[i];
  v->samples++;
  return BICO_OK;
}

bico_status bico_votes_add_counts(bico_votes *v, const int32_t *votes,
                                  uint32_t samples) {
  if (v == NULL) return BICO_E_NULL;
  bico__clear(v->ctx);
  const char *fn = "votes_add_counts";
  if (votes == NULL)
    return bico__fail(v->ctx, BICO_E_NULL, "%s: votes is NULL", fn);
  if (v->flags & BICO_VOTES_MEAN)
    return bico__fail(v->ctx, BICO_E_STATE,
                      "%s: the accumulator keeps summed gradients "
                      "(BICO_VOTES_MEAN), which counts cannot supply",
                      fn);
  bico_status st = check_room(v, fn, samples);
  if (st) return st;
  for (size_t i = 0; i < v->n; i++) {
    int64_t a = votes[i] < 0 ? -(int64_t)votes[i] : (int64_t)votes[i];
    if (a > (int64_t)samples)
      return bico__fail(v->ctx, BICO_E_ARG,
                        "%s: votes[%zu] = %ld exceeds the %lu samples in "
                        "magnitude",
                        fn, i, (long)votes[i], (unsigned long)samples);
  }
  for (size_t i = 0; i < v->n; i++) v->votes[i] += votes[i];
  v->samples += samples;
  return BICO_OK;
}

bico_status bico_votes_merge(bico_votes *dst, const bico_votes *src) {
  if (dst == NULL) return BICO_E_NULL;
  bico__clear(dst->ctx);
  const char *fn = "votes_merge";
  if (src == NULL) return bico__fail(dst->ctx, BICO_E_NULL, "%s: src is NULL", fn);
  if (dst->n != src->n)
    return bico__fail(dst->ctx, BICO_E_SHAPE,
                      "%s: dst has %zu elements, src %zu", fn, dst->n, src->n);
  if (dst->flags != src->flags)
    return bico__fail(dst->ctx, BICO_E_ARG,
                      "%s: dst has flags 0x%x, src 0x%x", fn, dst->flags,
                      src->flags);
  bico_status st = check_room(dst, fn, src->samples);
  if (st) return st;
  /* dst == src is fine: each element is read before it is written. */
  for (size_t i = 0; i < dst->n; i++) dst->votes[i] += src->votes[i];
  if (dst->sum != NULL)
    for (size_t i = 0; i < dst->n; i++) dst->sum[i] += src->sum[i];
  dst->samples += src->samples;
  return BICO_OK;
}

bico_status bico_votes_info(const bico_votes *v, size_t *n, uint64_t *samples,
                            unsigned *flags) {
  if (v == NULL) return BICO_E_NULL;
  if (n != NULL) *n = v->n;
  if (samples != NULL) *samples = v->samples;
  if (flags != NULL) *flags = v->flags;
  return BICO_OK;
}

bico_status bico_votes_counts(const bico_votes *v, int32_t *out) {
  if (v == NULL) return BICO_E_NULL;
  if (out == NULL)
    return bico__fail(v->ctx, BICO_E_NULL, "votes_counts: out is NULL");
  for (size_t i = 0; i < v->n; i++) out[i] = v->votes[i];
  return BICO_OK;
}
