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

/* Refuses an output path that is the same file as `input` or any file an
 * open input reads (shards).  fn names the caller; what names the output
 * option ("output", "delta output", ...). */
bico_status bico__check_distinct(bico_ctx *ctx, const char *fn,
                                 const char *what, const char *output,
                                 const char *input, const bico_stfile *f);

#endif
