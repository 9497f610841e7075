/* libbico: statistics files.
 *
 * A statistics file holds, per target module M, the cross-covariances
 * "M.in_xcov" [d_A,in, d_B,in] and "M.out_xcov" [d_A,out, d_B,out] (F64,
 * docs/formats.md) that bico_transfer reads (BICO_FILE_STATS) instead of
 * two calibration files; it is what the `bico stats` command writes. */
#ifndef BICO_STATS_H
#define BICO_STATS_H

#include <stddef.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reduces two calibration files to a statistics file: for every module M
 * of the target calibration file with "M.input"/"M.output_grad", the
 * source's paired module (by the depth map over the two files' own block
 * containers, detected from the calibration names unless blocks is given)
 * provides the other side; writes "M.in_xcov" and "M.out_xcov" (F64).
 * Modules the source lacks are an error naming them. */
BICO_API bico_status bico_stats_from_calib(bico_ctx *ctx,
                                           const char *source_calib,
                                           const char *target_calib,
                                           const char *blocks,
                                           const char *output);
/* Sums n statistics files (same tensors and shapes) into output. */
BICO_API bico_status bico_stats_merge(bico_ctx *ctx, const char *const *inputs,
                                      size_t n, const char *output);

#ifdef __cplusplus
}
#endif
#endif
