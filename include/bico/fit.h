/* libbico: the sequential functional fit (docs/fit.md).
 *
 * Instead of rotating the source's task vector, the fit asks each target
 * linear layer to change its output the way the fine-tune changed the
 * source's, on calibration inputs, in forward order.  For one layer with
 * weight W_B (d_out x d_in, row-major) and bias b_B:
 *
 *   X'  = the layer's inputs on the target with the updates of all earlier
 *         layers applied (n x d_in);
 *   X_B = the layer's inputs on the original target (n x d_in);
 *   D_B = the desired change of the layer's output, in the target's output
 *         coordinates (n x d_out);
 *
 * and, with ~ meaning "a column of ones appended" when the fit has a bias,
 *
 *   [dW db] = argmin ||X~' [W_B+dW, b_B+db]^T - (X~_B [W_B, b_B]^T + D_B)||^2
 *                    + lambda ||dW||^2,     lambda = c tr(X'^T X') / d_in
 *
 * (no penalty on the bias).  The solution needs only the cross-products
 * G = X~'^T X~', K = X~'^T X~_B and E = X~'^T D_B, which bico_fit_add
 * accumulates in double precision from batches of rows (memory is
 * O(d_in (d_in + d_out)) whatever the number of rows), and which add up
 * over shards of the calibration data (bico_fit_merge).  The normal
 * equations are (G + lambda P) Delta = (K - G) Theta + E, with Theta =
 * [W_B, b_B]^T, Delta = [dW, db]^T and P the identity on the weight rows
 * (zero on the bias row).
 *
 * bico_fit_run (below) is the sequential driver: it calls back into the
 * host's own forward pass for each layer's rows, solves, and hands each
 * update back before it asks for the next layer. */
#ifndef BICO_FIT_H
#define BICO_FIT_H

#include <stddef.h>
#include <stdint.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_fit bico_fit;

/* Flags for bico_fit_create (bitwise or). */
typedef enum bico_fit_flag {
  BICO_FIT_BIAS = 1 /* fit a bias too: a column of ones is appended to X'
                       and X_B */
} bico_fit_flag;
/* Names: "bias" (NULL / BICO_E_NOTFOUND otherwise). */
BICO_API const char *bico_fit_flag_name(int flag);
BICO_API bico_status bico_fit_flag_from_name(const char *name, int *flag);

/* Options (bico_fit_set_param):
 *   BICO_FIT_RIDGE     c >= 0, default 1e-2: lambda = c tr(X'^T X') / d_in.
 *                      c = 0 is the plain least-squares fit (minimum-norm
 *                      solution when X' is rank-deficient).
 *   BICO_FIT_RANK_TOL  relative tolerance in [0, 1), default 1e-10: the
 *                      numerical rank of G counts the pivots of a pivoted
 *                      Cholesky factorisation of G above tol * max_i G_ii
 *                      (G holds squares: 1e-10 there is about 1e-5 on the
 *                      singular values of X~').  0 takes LAPACK's default
 *                      (n eps max_i G_ii).  The same tolerance, relative to
 *                      the largest eigenvalue, drops directions in the
 *                      eigen-solve fallback. */
typedef enum bico_fit_param {
  BICO_FIT_RIDGE = 1,
  BICO_FIT_RANK_TOL = 2
} bico_fit_param;

/* Creates an empty fit for a layer with d_out outputs and d_in inputs
 * (docs/api.md's dimension order: a layer's widths as its weight's shape,
 * [d_out, d_in]).  The handle keeps a pointer to ctx (which must outlive
 * it) and reports failures there. */
BICO_API bico_status bico_fit_create(bico_ctx *ctx, size_t d_out, size_t d_in,
                                     unsigned flags, bico_fit **out);
/* Frees the fit; accepts NULL. */
BICO_API void bico_fit_free(bico_fit *f);

BICO_API bico_status bico_fit_set_param(bico_fit *f, int param, double value);
BICO_API bico_status bico_fit_get_param(const bico_fit *f, int param,
                                        double *value);
/* The option grammar of params.h: RIDGE [0, inf) and RANK_TOL [0, 1)
 * (BICO_PARAM_HI_OPEN); BICO_E_ARG for an unknown param.  Names "ridge",
 * "rank_tol" (NULL / BICO_E_NOTFOUND otherwise). */
BICO_API bico_status bico_fit_param_bounds(int param, double *lo, double *hi,
                                           unsigned *flags);
BICO_API const char *bico_fit_param_name(int param);
BICO_API bico_status bico_fit_param_from_name(const char *name, int *param);

/* Adds n corresponding rows: x_new (X', n x d_in, row stride ld_new),
 * x_orig (X_B, n x d_in, ld_orig) and delta (D_B, n x d_out, ld_delta).
 * n = 0 is a no-op.  NaN or Inf in any input is BICO_E_NONFINITE and leaves
 * the fit unchanged. */
BICO_API bico_status bico_fit_add(bico_fit *f, size_t n, const float *x_new,
                                  size_t ld_new, const float *x_orig,
                                  size_t ld_orig, const float *delta,
                                  size_t ld_delta);

/* dst += src (the statistics of disjoint shards add up).  Dimensions and
 * flags must match; dst's options are kept. */
BICO_API bico_status bico_fit_merge(bico_fit *dst, const bico_fit *src);

/* Empties the statistics (options are kept): the handle can then serve the
 * next layer of the same shape. */
BICO_API bico_status bico_fit_reset(bico_fit *f);

/* Dimensions, rows added so far and flags; any out-pointer may be NULL. */
BICO_API bico_status bico_fit_info(const bico_fit *f, size_t *d_out,
                                   size_t *d_in, uint64_t *rows,
                                   unsigned *flags);

/* Solves for the update of W_B (d_out x d_in, row stride ld_w >= d_in) and
 * b_B (d_out floats; must be NULL without BICO_FIT_BIAS, non-NULL with it):
 * writes dW (d_out x d_in, row stride ld_dw >= d_in) and db (d_out floats;
 * NULL exactly when b_b is) and, when rank is not NULL, the numerical rank
 * of G (a pivoted Cholesky of G, as costly as the solve itself: pass NULL
 * when the rank is not needed; dW and db are the same either way).
 * The solve is a Cholesky factorisation of G + lambda P; where that fails
 * (c = 0 and G singular, or too badly conditioned for the factorisation),
 * an eigendecomposition gives the minimum-norm solution.  With no rows,
 * dW and db are zero and the rank is 0.  The statistics are kept: more rows
 * may be added and the fit solved again. */
BICO_API bico_status bico_fit_solve(bico_fit *f, const float *w_b,
                                    size_t ld_w, const float *b_b, float *dw,
                                    size_t ld_dw, float *db, size_t *rank);

/* ---- The sequential driver ----
 *
 * bico_fit_run fits a model's linear layers one after the other, in
 * forward order, calling back into the host for everything that needs the
 * model: the host owns the weights and runs its own forward passes;
 * libbico accumulates, solves and hands each update back before it asks
 * for the next layer's rows, so those rows already see the update.  For
 * layer l the host's callbacks do this:
 *
 *   layer(opaque, l, &d_out, &d_in, &w, &ld_w, &b)
 *       the layer's shape and its current weight W_B (d_out x d_in, row
 *       stride ld_w) and bias b_B (d_out floats, or NULL for a layer
 *       without bias: then no bias is fitted).  The pointers must stay
 *       valid until update returns for this layer.
 *   rows(opaque, l, fit)
 *       runs the calibration data through the target with the updates of
 *       layers 0..l-1 applied (X', the layer's inputs), through the
 *       original target (X_B), and computes the desired output change D_B
 *       (typically D R_out: the source partner's output on the fine-tuned
 *       source minus its output on the source, carried into the target's
 *       output coordinates); passes the rows to bico_fit_add(fit, ...), in
 *       as many batches as it likes.  It may also set the fit's options for
 *       this layer (bico_fit_set_param); each layer's fit starts with
 *       BICO_FIT_RIDGE = ridge and the other options at their defaults.
 *   update(opaque, l, dw, ld_dw, db, rank)
 *       the solved update (dW d_out x d_in with row stride ld_dw, db d_out
 *       floats or NULL without bias) and the numerical rank of X~'^T X~'
 *       when the runner asks for it (want_rank), else BICO_FIT_NO_RANK
 *       (the update is the same either way);
 *       the host applies it (W_B + dW, b_B + db, or a scaled version) to
 *       the model its next forward passes run.  The buffers are valid
 *       during the call only.
 *
 * Optional callbacks (fields appended after 1.0's; NULL or zero: unused):
 *
 *   blocks, block_begin(opaque, k, first, &count), block_end(opaque, k)
 *       the layers come in `blocks` blocks (a model's stem, its repeated
 *       blocks, its tail), in order; `layers` is then not read.  For block
 *       k the runner calls block_begin, which sets count, the number of
 *       layers of the block (0 is allowed), numbered first ..
 *       first+count-1 (first: the layers of the blocks before); then fits
 *       them; then block_end (may be NULL).  The host advances its own
 *       models there (runs the block once more on the updated target to
 *       give the next block its inputs, say).  block_begin is called after
 *       every update of the blocks before, block_end after every update
 *       of its own.
 *   group(opaque, l, &count)
 *       called before layer l's layer() when no group holds l: count >= 1
 *       consecutive layers l .. l+count-1 of the block (or of all layers
 *       without blocks) read the same input X' (q/k/v, gate/up), so that
 *       their rows can come from one forward pass: the runner calls
 *       layer() for each, then asks for the rows of all of them before
 *       any of their updates, then solves and updates them in order.  The
 *       pointers layer() gave stay valid until that layer's update
 *       returns.  NULL: every layer is a group of one.
 *   rows_group(opaque, l, fits, count)
 *       when non-NULL, called once per group (of one, too) instead of
 *       rows: fits[i] is layer l+i's fit (rows may then be NULL).
 *   solve(opaque, l, fit, dw, ld_dw, db, rank)
 *       when non-NULL, replaces bico_fit_solve: the host writes layer l's
 *       update (dW d_out x d_in with row stride ld_dw, db d_out floats or
 *       NULL without bias) and, when rank is not NULL, the rank; fit holds
 *       the rows the host added (a host with its own solver, e.g. a ridge
 *       with a prior, may have kept its own statistics instead).
 *
 * A callback returns BICO_OK to go on; any other status stops the run and
 * is returned, with a message naming the layer and the callback (and the
 * detail of a failed libbico call made inside it, if that is what it
 * returns).  The layers before the failing one have had their updates
 * applied by then. */

/* The rank update() receives when the runner did not ask for it. */
#define BICO_FIT_NO_RANK ((size_t)-1)

/* The host's side of bico_fit_run.  `size` must be set to
 * sizeof(bico_fit_runner) as the caller compiled it: later versions may
 * append fields and read them only when size covers them.  The callbacks
 * are called from the thread that called bico_fit_run. */
typedef struct bico_fit_runner {
  size_t size;   /* sizeof(bico_fit_runner) */
  void *opaque;  /* passed to every callback */
  size_t layers; /* number of linear layers to fit, in forward order */
  bico_status (*layer)(void *opaque, size_t l, size_t *d_out, size_t *d_in,
                       const float **w, size_t *ld_w, const float **b);
  bico_status (*rows)(void *opaque, size_t l, bico_fit *fit);
  bico_status (*update)(void *opaque, size_t l, const float *dw,
                        size_t ld_dw, const float *db, size_t rank);
  /* ---- Appended after 1.0's first fields: read only when size covers
   * them (a runner sized before them runs without them). ---- */
  /* Nonzero: compute each layer's rank (a pivoted Cholesky of G, as costly
   * as the solve) and pass it to update; 0: update receives
   * BICO_FIT_NO_RANK.  A runner whose size ends before this field gets the
   * rank (what it was compiled for). */
  int want_rank;
  /* Blocks, shared inputs and the host's solve (see above); NULL or 0 in
   * a runner that does not use them. */
  size_t blocks;
  bico_status (*block_begin)(void *opaque, size_t k, size_t first,
                             size_t *count);
  bico_status (*block_end)(void *opaque, size_t k);
  bico_status (*group)(void *opaque, size_t l, size_t *count);
  bico_status (*rows_group)(void *opaque, size_t l, bico_fit *const *fits,
                            size_t count);
  bico_status (*solve)(void *opaque, size_t l, bico_fit *fit, float *dw,
                       size_t ld_dw, float *db, size_t *rank);
} bico_fit_runner;

/* Runs the sequential fit over runner->layers layers (0 is a no-op), or
 * over runner->blocks blocks, with ridge c = `ridge` (BICO_FIT_RIDGE's
 * range) for every layer unless the rows callback changes it.  Memory: one
 * group's statistics (one layer's without the group callback) and one
 * update at a time (through ctx's allocator); a layer's statistics are
 * freed before its update is handed back.  A layer with fewer outputs
 * than inputs (d_out < d_in, plus one with a bias) is given its W_B and
 * b_B before its rows, and its fit accumulates the right-hand side
 * (D_B + (X~_B - X~') Theta)^T X~' for that weight instead of K =
 * X~'^T X~_B: d_out x (d_in + 1) doubles instead of (d_in + 1)^2, and
 * fewer flops; the update is the same up to rounding.  The rows callback
 * must therefore add rows for the weight layer() gave (it always does:
 * the driver applies the update only afterwards). */
BICO_API bico_status bico_fit_run(bico_ctx *ctx,
                                  const bico_fit_runner *runner,
                                  double ridge);

#ifdef __cplusplus
}
#endif
#endif
