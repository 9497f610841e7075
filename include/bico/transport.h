/* libbico: transport kernels.
 *
 * Carry a tensor of the task vector from the source's coordinates into the
 * target's with the maps a Procrustes solve produced:
 *
 *   weight  [dout_a, din_a] -> [dout_b, din_b]:  alpha R_out^T tau R_in
 *   vector  [d_a]           -> [d_b]:            alpha R^T v
 *   rows    [n, d_a]        -> [n, d_b]:         alpha t R   (last dimension:
 *                                                embeddings, tokens)
 *
 * A map passed as NULL is the rectangular identity I (ones on the diagonal,
 * zero elsewhere): it keeps the first min(d_a, d_b) coordinates and pads the
 * rest with zeros.  That gives the one-sided ablations (input map only:
 * r_out = NULL; output map only: r_in = NULL) at any widths.
 *
 * Every kernel computes out = alpha * result + beta * out, so the transported
 * update can be added straight onto the target's weights (beta = 1).  As in
 * BLAS, beta = 0 means out is not read.  All matrices are row-major with the
 * given row strides (ld >= number of columns).
 *
 * Argument order (BLIS's, docs/api.md): the context, the dimensions (source
 * side, then target side), alpha, each input matrix followed by its row
 * stride, then beta and the output with its row stride. */
#ifndef BICO_TRANSPORT_H
#define BICO_TRANSPORT_H

#include <stddef.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* r_out: dout_a x dout_b (or NULL); r_in: din_a x din_b (or NULL);
 * out: dout_b x din_b. */
BICO_API bico_status bico_transport_weight(
    bico_ctx *ctx, size_t dout_a, size_t din_a, size_t dout_b, size_t din_b,
    float alpha, const float *tau, size_t ld_tau, const float *r_out,
    size_t ld_rout, const float *r_in, size_t ld_rin, float beta, float *out,
    size_t ld_out);

/* Fused projections (attention qkv): the output dimension is split into k
 * equal blocks (dout_a and dout_b divisible by k); block i of tau's rows is
 * carried by r_outs[i] ((dout_a/k) x (dout_b/k), row stride ld_rout; NULL
 * for the identity; r_outs itself NULL for all identities) into block i of
 * out's rows.  All blocks share r_in. */
BICO_API bico_status bico_transport_weight_split(
    bico_ctx *ctx, size_t k, size_t dout_a, size_t din_a, size_t dout_b,
    size_t din_b, float alpha, const float *tau, size_t ld_tau,
    float *const *r_outs, size_t ld_rout, const float *r_in,
    size_t ld_rin, float beta, float *out, size_t ld_out);

/* out[d_b] = alpha R^T v + beta out, with R d_a x d_b (or NULL). */
BICO_API bico_status bico_transport_vector(bico_ctx *ctx, size_t d_a,
                                           size_t d_b, float alpha,
                                           const float *v, const float *r,
                                           size_t ld_r, float beta,
                                           float *out);

/* out[n, d_b] = alpha t R + beta out, with t n x d_a, R d_a x d_b (or
 * NULL). */
BICO_API bico_status bico_transport_rows(bico_ctx *ctx, size_t n, size_t d_a,
                                         size_t d_b, float alpha,
                                         const float *t, size_t ld_t,
                                         const float *r, size_t ld_r,
                                         float beta, float *out,
                                         size_t ld_out);

#ifdef __cplusplus
}
#endif
#endif
