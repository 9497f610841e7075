/* libbico: the cross-covariance accumulator.
 *
 * Accumulates C = sum over rows of x_a^T x_b (d_a x d_b) from batches of
 * corresponding rows of two activation (or gradient) matrices, in double
 * precision.  Memory is O(d_a d_b) whatever the number of rows.  Optionally
 * it also keeps the column sums of both sides (for centering) and the two
 * Gram matrices x_a^T x_a, x_b^T x_b (for whitening).
 *
 * Accumulators over disjoint shards of the calibration data merge into the
 * accumulator of the whole; they serialise to a versioned little-endian
 * byte string and back, bit-exactly. */
#ifndef BICO_XCOV_H
#define BICO_XCOV_H

#include <stddef.h>
#include <stdint.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_xcov bico_xcov;

/* Flags for bico_xcov_create (bitwise or). */
typedef enum bico_xcov_flag {
  BICO_XCOV_SUMS = 1,  /* keep column sums of x_a and x_b: enables centering */
  BICO_XCOV_GRAMS = 2  /* keep x_a^T x_a and x_b^T x_b: enables whitening */
} bico_xcov_flag;

/* Which matrix bico_xcov_matrix returns. */
typedef enum bico_xcov_which {
  BICO_XCOV_CROSS = 1,  /* x_a^T x_b, d_a x d_b */
  BICO_XCOV_GRAM_A = 2, /* x_a^T x_a, d_a x d_a (needs BICO_XCOV_GRAMS) */
  BICO_XCOV_GRAM_B = 3  /* x_b^T x_b, d_b x d_b (needs BICO_XCOV_GRAMS) */
} bico_xcov_which;     /* no default: 0 is BICO_E_ARG */

/* Options (bico_xcov_set_param; the grammar of params.h).  Options do
 * not change what is stored: serialisation does not keep them, merge
 * ignores them, and a deserialised accumulator starts with the defaults. */
typedef enum bico_xcov_param {
  BICO_XCOV_ADD_MODE = 1 /* bico_xcov_add_mode; default EXACT */
} bico_xcov_param;

/* How bico_xcov_add forms the products. */
typedef enum bico_xcov_add_mode { /* 0 = default: EXACT */
  /* Every product exact (float times float fits a double) and summed in
   * double. */
  BICO_XCOV_ADD_EXACT = 1,
  /* Opt-in fast accumulation: each block of rows is multiplied in single
   * precision (BLIS sgemm straight on the caller's floats, no conversion)
   * and only the block results are summed in double.  Up to about twice
   * the speed of EXACT, but the sum carries single-precision rounding
   * (relative error around 1e-7 instead of 1e-16; docs/performance.md). */
  BICO_XCOV_ADD_FAST = 2
} bico_xcov_add_mode;

/* Names of the flags ("sums", "grams"; one flag, not a combination), of
 * the matrices ("cross", "gram_a", "gram_b"), of the options ("add_mode")
 * and of the add modes ("exact", "fast"). */
BICO_API const char *bico_xcov_flag_name(int flag);
BICO_API bico_status bico_xcov_flag_from_name(const char *name, int *flag);
BICO_API const char *bico_xcov_which_name(int which);
BICO_API bico_status bico_xcov_which_from_name(const char *name, int *which);
BICO_API const char *bico_xcov_param_name(int param);
BICO_API bico_status bico_xcov_param_from_name(const char *name, int *param);
BICO_API const char *bico_xcov_add_mode_name(int mode);
BICO_API bico_status bico_xcov_add_mode_from_name(const char *name, int *mode);

/* ADD_MODE takes a bico_xcov_add_mode (0: the default, EXACT; get_param
 * reports the member it resolved to).  Bounds: [0, 2], BICO_PARAM_INTEGER;
 * BICO_E_ARG for an unknown param. */
BICO_API bico_status bico_xcov_set_param(bico_xcov *xc, int param,
                                         double value);
BICO_API bico_status bico_xcov_get_param(const bico_xcov *xc, int param,
                                         double *value);
BICO_API bico_status bico_xcov_param_bounds(int param, double *lo, double *hi,
                                            unsigned *flags);

/* Creates an empty accumulator for d_a x d_b statistics.  The handle keeps
 * a pointer to ctx (which must outlive it) and reports failures there. */
BICO_API bico_status bico_xcov_create(bico_ctx *ctx, size_t d_a, size_t d_b,
                                      unsigned flags, bico_xcov **out);
/* Frees the accumulator; accepts NULL. */
BICO_API void bico_xcov_free(bico_xcov *xc);

/* Adds n corresponding rows: row r of x_a (n x d_a, row stride ld_a >= d_a)
 * pairs with row r of x_b (n x d_b, row stride ld_b >= d_b).  n = 0 is a
 * no-op.  NaN or Inf in either input is BICO_E_NONFINITE and leaves the
 * accumulator unchanged. */
BICO_API bico_status bico_xcov_add(bico_xcov *xc, size_t n,
                                   const float *x_a, size_t ld_a,
                                   const float *x_b, size_t ld_b);

/* Adds a cross-covariance computed elsewhere (d_a x d_b, row stride ld_c)
 * covering `rows` rows.  Only for accumulators created without flags (sums
 * and Grams cannot be recovered from C alone): else BICO_E_STATE. */
BICO_API bico_status bico_xcov_add_matrix(bico_xcov *xc, uint64_t rows,
                                          const double *c, size_t ld_c);

/* dst += src.  Dimensions and flags must match. */
BICO_API bico_status bico_xcov_merge(bico_xcov *dst, const bico_xcov *src);

/* Dimensions, rows seen so far and flags; any out-pointer may be NULL. */
BICO_API bico_status bico_xcov_info(const bico_xcov *xc, size_t *d_a,
                                    size_t *d_b, uint64_t *rows,
                                    unsigned *flags);

/* Copies one of the accumulated matrices into out (row stride ld_out).
 * centered != 0 subtracts the outer product of the means times the row
 * count (needs BICO_XCOV_SUMS). */
BICO_API bico_status bico_xcov_matrix(const bico_xcov *xc, int which,
                                      int centered, double *out,
                                      size_t ld_out);

/* Copies the column sums (d_a and d_b doubles); needs BICO_XCOV_SUMS. */
BICO_API bico_status bico_xcov_sums(const bico_xcov *xc, double *sum_a,
                                    double *sum_b);

/* Serialisation.  bico_xcov_serialized_size gives the exact byte count;
 * bico_xcov_serialize writes it into buf (cap bytes available) and stores
 * the count in *written.  bico_xcov_deserialize validates everything
 * (magic, version, dimensions, lengths, finiteness) before building a new
 * accumulator with ctx. */
BICO_API bico_status bico_xcov_serialized_size(const bico_xcov *xc,
                                               size_t *size);
BICO_API bico_status bico_xcov_serialize(const bico_xcov *xc, void *buf,
                                         size_t cap, size_t *written);
BICO_API bico_status bico_xcov_deserialize(bico_ctx *ctx, const void *buf,
                                           size_t len, bico_xcov **out);

#ifdef __cplusplus
}
#endif
#endif
