/* libbico: interfaces without an ABI promise.
 *
 * What a front end needs before its shape is settled lives here, behind a
 * macro, as zstd keeps its ZSTD_STATIC_LINKING_ONLY section: define
 * BICO_EXPERIMENTAL before including <bico/bico.h> (or this header) to see
 * the declarations.  They may change or disappear in any release, patch
 * releases included, without a new SONAME.  Their symbols are in the linker
 * version node BICO_EXPERIMENTAL, not in BICO_1.x, so a program that used
 * one that is later removed or changed fails at load time with a missing
 * symbol version instead of misbehaving; make abi-check ignores that node.
 *
 * An interface leaves this section by moving, unchanged or renamed, into
 * its handle's header and into the version node of the release that
 * freezes it (CHANGELOG.md says which). */
#ifndef BICO_EXPERIMENTAL_H
#define BICO_EXPERIMENTAL_H

#include <stddef.h>
#include "status.h"
#include "procrustes.h"
#include "fit.h"

#endif /* BICO_EXPERIMENTAL_H */

/* A separate guard, so that a second inclusion after defining the macro
 * still declares the section. */
#if defined(BICO_EXPERIMENTAL) && !defined(BICO_EXPERIMENTAL_DECLARED)
#define BICO_EXPERIMENTAL_DECLARED

#ifdef __cplusplus
extern "C" {
#endif

/* Reads rows [i0, i0 + ni) x columns [j0, j0 + nj) of a statistic C
 * (d_a x d_b) into out (row stride ld).  Returns BICO_OK or a failure
 * status, which the solve returns unchanged. */
typedef bico_status (*bico_block_read_fn)(void *opaque, size_t i0, size_t ni,
                                          size_t j0, size_t nj, double *out,
                                          size_t ld);
/* Says that one pass over C is over (a file-backed reader may drop its
 * pages); may be NULL. */
typedef void (*bico_block_release_fn)(void *opaque);

/* bico_procrustes_solve_matrix on a statistic that the caller serves block
 * by block instead of holding it in memory (a memory-mapped file, another
 * process's buffer): the EIG route reads it in row panels and never holds a
 * d_a x d_b copy; the SVD reads it whole.  Same results as solve_matrix on
 * the same values, bit for bit.  Centering and whitening are unavailable
 * (BICO_E_STATE), as for solve_matrix. */
BICO_API bico_status bico_procrustes_solve_blocks(
    bico_procrustes *p, size_t d_a, size_t d_b, bico_block_read_fn read,
    bico_block_release_fn release, void *opaque, float *r, size_t ld_r,
    size_t *rank);

/* A fit's statistics as bytes, so that rows added in another process (a
 * rank of a distributed run, a worker) reach the fit that solves:
 * serialise there, deserialise here, bico_fit_merge.  The bytes hold G,
 * the right-hand side, K (or the driver's Theta) and the row count,
 * doubles bit for bit, and the options (ridge, rank_tol): a deserialised
 * fit solves exactly as the original, and merging it equals merging the
 * original.  Explicit little-endian, whatever the host.
 * bico_fit_serialized_size gives the exact byte count (64 + 8 per double:
 * about 16 (d_in + 1)^2 + 8 d_out (d_in + 1) bytes); bico_fit_serialize
 * writes it into buf (cap bytes available; BICO_E_ARG when too small) and
 * stores the count in *written.  bico_fit_deserialize validates everything
 * (magic, version, flags, dimensions, length, finite values, a symmetric
 * G: BICO_E_FORMAT or BICO_E_VERSION naming what) before building a new fit
 * on ctx; *out is NULL on failure. */
BICO_API bico_status bico_fit_serialized_size(const bico_fit *f, size_t *size);
BICO_API bico_status bico_fit_serialize(const bico_fit *f, void *buf,
                                        size_t cap, size_t *written);
BICO_API bico_status bico_fit_deserialize(bico_ctx *ctx, const void *buf,
                                          size_t len, bico_fit **out);

#ifdef __cplusplus
}
#endif
#endif /* BICO_EXPERIMENTAL section */
