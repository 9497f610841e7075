/* libbico: sign votes, the statistic GradFix reads.
 *
 * For each parameter tensor of the target (n elements), a bico_votes
 * accumulator takes one per-sample gradient g_k at a time and keeps the
 * integer vote v = sum_k sign(-g_k) (and, with BICO_VOTES_MEAN, the double
 * sum of -g_k).  Accumulators over disjoint samples merge.  The masks built
 * from them are in gradfix.h. */
#ifndef BICO_VOTES_H
#define BICO_VOTES_H

#include <stddef.h>
#include <stdint.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_votes bico_votes;

typedef enum bico_votes_flag {
  BICO_VOTES_MEAN = 1 /* also keep the summed gradient (enables MEAN mode) */
} bico_votes_flag;

/* Names of the flags: "mean". */
BICO_API const char *bico_votes_flag_name(int flag);
BICO_API bico_status bico_votes_flag_from_name(const char *name, int *flag);

/* Creates an accumulator for a tensor of n elements (flags: bico_votes_flag).
 * The handle keeps a pointer to ctx, which must outlive it. */
BICO_API bico_status bico_votes_create(bico_ctx *ctx, size_t n, unsigned flags,
                                       bico_votes **out);
/* Accepts NULL. */
BICO_API void bico_votes_free(bico_votes *v);

/* Adds the gradient of one sample (n floats): vote += sign(-g).  NaN or Inf
 * is BICO_E_NONFINITE and changes nothing. */
BICO_API bico_status bico_votes_add_grad(bico_votes *v, const float *grad);

/* Adds votes counted elsewhere (n integers, each the sum of `samples` signs,
 * so |vote| <= samples).  Only for accumulators without BICO_VOTES_MEAN. */
BICO_API bico_status bico_votes_add_counts(bico_votes *v, const int32_t *votes,
                                           uint32_t samples);

/* dst += src; sizes and flags must match. */
BICO_API bico_status bico_votes_merge(bico_votes *dst, const bico_votes *src);

/* Size, samples so far, flags; any out-pointer may be NULL. */
BICO_API bico_status bico_votes_info(const bico_votes *v, size_t *n,
                                     uint64_t *samples, unsigned *flags);

/* Copies the n integer votes. */
BICO_API bico_status bico_votes_counts(const bico_votes *v, int32_t *out);

#ifdef __cplusplus
}
#endif
#endif
