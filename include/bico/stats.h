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
/* What bico_stats_from_calib computes, as a plan a front end that divides
 * the work (bico-mpi stats) distributes instead of re-deriving it: over
 * npairs pairs of calibration files (source_calib[k] with target_calib[k],
 * shards of one calibration set whose rows add up), the statistics
 * planned from the first pair's names exactly as bico_stats_from_calib
 * plans them (its modules, their partners by the depth map, blocks as
 * there), each checked in every pair (a floating-point dtype, the widths of
 * the first pair, as many source rows as target rows).  Opens and reads
 * headers only; the failures are bico_stats_from_calib's, naming the file
 * and tensor.  Statistic i (< stats): its output tensor name
 * ("<module>.in_xcov" / ".out_xcov", [d_source, d_target] F64: the sum over
 * all rows of every pair of x_source x_target^T), the calibration tensors
 * it reads ("<module>.input" / ".output_grad" in each file, rows of width
 * d_source and d_target), and its rows in pair k.  Strings are valid until
 * bico_stats_plan_free; any out-pointer may be NULL. */
typedef struct bico_stats_plan bico_stats_plan;
BICO_API bico_status bico_stats_plan_create(bico_ctx *ctx,
                                            const char *const *source_calib,
                                            const char *const *target_calib,
                                            size_t npairs, const char *blocks,
                                            bico_stats_plan **out);
/* Accepts NULL. */
BICO_API void bico_stats_plan_free(bico_stats_plan *p);
BICO_API bico_status bico_stats_plan_size(const bico_stats_plan *p,
                                          size_t *stats, size_t *pairs);
BICO_API bico_status bico_stats_plan_item(const bico_stats_plan *p, size_t i,
                                          const char **name,
                                          const char **source_key,
                                          const char **target_key,
                                          size_t *d_source, size_t *d_target);
BICO_API bico_status bico_stats_plan_rows(const bico_stats_plan *p, size_t i,
                                          size_t pair, size_t *rows);
/* Sums n statistics files (same tensors and shapes) into output. */
BICO_API bico_status bico_stats_merge(bico_ctx *ctx, const char *const *inputs,
                                      size_t n, const char *output);

#ifdef __cplusplus
}
#endif
#endif
