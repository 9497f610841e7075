/* libbico: the baselines every comparison needs.
 *
 * Tensors are contiguous, row-major, with shapes given as arrays of ndim
 * extents (each >= 1).  Both kernels compute out = alpha * update + beta *
 * out in the target's shape (beta = 0: out is not read). */
#ifndef BICO_BASELINE_H
#define BICO_BASELINE_H

#include <stddef.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Naive transfer: the update is tau itself.  The shapes must be identical,
 * else BICO_E_SHAPE naming both. */
BICO_API bico_status bico_baseline_naive(bico_ctx *ctx, size_t ndim_a,
                                         const size_t *shape_a,
                                         size_t ndim_b, const size_t *shape_b,
                                         float alpha, const float *tau,
                                         float beta, float *out);

/* Zero padding / truncation: each dimension of tau is cut or zero-extended
 * to the target's extent (ndim_a == ndim_b, else BICO_E_SHAPE). */
BICO_API bico_status bico_baseline_pad(bico_ctx *ctx, size_t ndim_a,
                                       const size_t *shape_a, size_t ndim_b,
                                       const size_t *shape_b,
                                       float alpha, const float *tau,
                                       float beta, float *out);

#ifdef __cplusplus
}
#endif
#endif
