/* Calibration, statistics and votes files -> accumulators (internal). */
#ifndef BICO_CALIB_H
#define BICO_CALIB_H

#include "internal.h"

/* Looks up `key` in a calibration file and checks it: a float tensor of
 * ndim >= 1 whose last dimension equals `width` (the module's width).
 * Stores its index and its row count (elements / width).  Messages name
 * the file (`path`), the key and `module`. */
bico_status bico__calib_find(bico_ctx *ctx, const bico_stfile *f,
                             const char *path, const char *key, size_t width,
                             size_t *index, size_t *rows);

/* Streams the rows of tensor ia of fa (width da) and ib of fb (width db)
 * into k accumulators: accumulator i gets the columns of block i (da/k and
 * db/k wide).  Rows must agree (else BICO_E_SHAPE naming `module` and both
 * counts).  xcs[0..k) must be created by the caller with the block
 * dimensions. */
bico_status bico__calib_accumulate(bico_ctx *ctx, const char *module,
                                   const bico_stfile *fa, const char *path_a,
                                   size_t ia, size_t da,
                                   const bico_stfile *fb, const char *path_b,
                                   size_t ib, size_t db, size_t k,
                                   bico_xcov **xcs);

/* Reads target tensor `name`'s votes (shape ndim/shape) from a votes
 * file: every element an integer vote count v with |v| < 2^31 (a float
 * that rounds to 2^31 is refused: int32 cannot hold it), the samples the
 * largest |v| (at least 1).  On success *out is a new bico_votes holding
 * the counts.  The one reader of votes files (checkpoint and LoRA GradFix
 * paths alike). */
bico_status bico__calib_votes(bico_ctx *ctx, const bico_stfile *f,
                              const char *path, const char *name, size_t ndim,
                              const size_t *shape, bico_votes **out);

/* Refuses an output path that is the same file as `input` or any file an
 * open input reads (shards).  fn names the caller; what names the output
 * option ("output", "delta output", ...). */
bico_status bico__check_distinct(bico_ctx *ctx, const char *fn,
                                 const char *what, const char *output,
                                 const char *input, const bico_stfile *f);

#endif
