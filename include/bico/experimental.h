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

#ifdef __cplusplus
}
#endif
#endif /* BICO_EXPERIMENTAL section */
