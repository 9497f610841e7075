/* libbico: the orthogonal Procrustes solver.
 *
 * From a cross-covariance C = X_a^T X_b (d_a x d_b) to R = U V^T, where
 * C = U S V^T is the thin SVD.  R maximises trace(R^T C) over matrices with
 * orthonormal rows (d_a <= d_b: R R^T = I) or orthonormal columns
 * (d_a >= d_b: R^T R = I).  For d_a <= d_b that is the minimiser of
 * ||X_a R - X_b||_F; for d_a >= d_b, of ||X_a - X_b R^T||_F (there
 * ||X_a R||_F depends on R, so the first form is not what is solved).
 *
 * Options (bico_procrustes_set_param):
 *   BICO_PROC_CENTER      0 (default) or 1: use the centered statistic
 *                         C - n mu_a mu_b^T (needs BICO_XCOV_SUMS).
 *   BICO_PROC_WHITEN      p in [0, 0.5], default 0: use
 *                         (G_a + eps I)^-p C (G_b + eps I)^-p with the Gram
 *                         matrices G (needs BICO_XCOV_GRAMS when p > 0).
 *   BICO_PROC_WHITEN_EPS  eps > 0, default 1e-6.
 *   BICO_PROC_RANK_TOL    relative tolerance in [0, 1), default 1e-5: a
 *                         singular value s_i counts towards the numerical
 *                         rank when s_i > tol * s_max.
 *   BICO_PROC_NULL        completion of a rank-deficient statistic:
 *                         BICO_NULL_KEEP (default; the reference behaviour:
 *                         all min(d_a, d_b) singular pairs, the unidentified
 *                         ones an arbitrary but valid orthonormal basis) or
 *                         BICO_NULL_DROP (the partial isometry U_k V_k^T: the
 *                         unidentified directions map to zero).
 *
 *   BICO_PROC_METHOD      how U V^T is computed (bico_procrustes_method):
 *                         BICO_PROC_EIG (default): eigendecomposition
 *                         (dsyevr) of the smaller Gram matrix C C^T or
 *                         C^T C, then R = (C C^T)^-1/2 C; two to three times
 *                         faster than the SVD and about half its memory,
 *                         used only when it certifies sigma_min / sigma_max
 *                         above max(1e-4, RANK_TOL) (a Cholesky test before
 *                         the eigensolver, the eigenvalues after it); then
 *                         the rank is full, KEEP and DROP agree, and R and
 *                         the spectrum equal the SVD's to about 1e-8
 *                         relative.  Otherwise (rank-deficient or badly
 *                         conditioned statistics) the solve is the SVD's,
 *                         bit for bit, at the extra cost of one Gram matrix
 *                         and its Cholesky test;
 *                         BICO_PROC_SVD: always the thin SVD by LAPACK
 *                         dgesdd (dgesvd if it fails);
 *                         BICO_PROC_POLAR: GEMM-only scaled Newton-Schulz
 *                         polar iteration in double, used only when it
 *                         converges and a Cholesky test certifies
 *                         sigma_min > RANK_TOL * ||C||_F, otherwise the SVD;
 *                         after a polar solve the spectrum is not known
 *                         (bico_procrustes_spectrum reports count 0).
 *                         docs/performance.md has the timings.
 *
 * Rank: every solve reports the numerical rank k.  A statistic of rank 0
 * (all zero) gives, with KEEP, the rectangular identity, and with DROP, the
 * zero matrix. */
#ifndef BICO_PROCRUSTES_H
#define BICO_PROCRUSTES_H

#include <stddef.h>
#include "ctx.h"
#include "xcov.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_procrustes bico_procrustes;

typedef enum bico_procrustes_param {
  BICO_PROC_CENTER = 1,
  BICO_PROC_WHITEN = 2,
  BICO_PROC_WHITEN_EPS = 3,
  BICO_PROC_RANK_TOL = 4,
  BICO_PROC_NULL = 5,
  BICO_PROC_METHOD = 6
} bico_procrustes_param;

/* Choices: 0 asks for the default (EIG, KEEP); get_param reports the
 * member. */
typedef enum bico_procrustes_method {
  BICO_PROC_SVD = 1,
  BICO_PROC_EIG = 2,
  BICO_PROC_POLAR = 3
} bico_procrustes_method;

typedef enum bico_null_completion {
  BICO_NULL_KEEP = 1,
  BICO_NULL_DROP = 2
} bico_null_completion;

/* Names: parameters ("center", "whiten", "whiten_eps", "rank_tol", "null",
 * "method"), methods ("svd", "eig", "polar"), completions ("keep",
 * "drop"). */
BICO_API const char *bico_procrustes_param_name(int param);
BICO_API bico_status bico_procrustes_param_from_name(const char *name,
                                                     int *param);
BICO_API const char *bico_procrustes_method_name(int method);
BICO_API bico_status bico_procrustes_method_from_name(const char *name,
                                                      int *method);
BICO_API const char *bico_procrustes_null_name(int completion);
BICO_API bico_status bico_procrustes_null_from_name(const char *name,
                                                    int *completion);

BICO_API bico_status bico_procrustes_create(bico_ctx *ctx,
                                            bico_procrustes **out);
/* Accepts NULL. */
BICO_API void bico_procrustes_free(bico_procrustes *p);

BICO_API bico_status bico_procrustes_set_param(bico_procrustes *p, int param,
                                               double value);
BICO_API bico_status bico_procrustes_get_param(const bico_procrustes *p,
                                               int param, double *value);
BICO_API bico_status bico_procrustes_param_bounds(int param, double *lo,
                                                  double *hi, unsigned *flags);

/* Solves from an accumulator: writes R (d_a x d_b, row stride ld_r >= d_b)
 * and the numerical rank (rank may be NULL). */
BICO_API bico_status bico_procrustes_solve(bico_procrustes *p,
                                           const bico_xcov *xc, float *r,
                                           size_t ld_r, size_t *rank);

/* Solves from a cross-covariance matrix given directly (d_a x d_b, row
 * stride ld_c).  Centering and whitening are unavailable here
 * (BICO_E_STATE if set). */
BICO_API bico_status bico_procrustes_solve_matrix(bico_procrustes *p,
                                                  size_t d_a, size_t d_b,
                                                  const double *c,
                                                  size_t ld_c, float *r,
                                                  size_t ld_r, size_t *rank);

/* Solves from the rows themselves: x_a (n x d_a, row stride ld_a) and x_b
 * (n x d_b, ld_b) are corresponding rows, and R is the map of
 * C = x_a^T x_b (centered with BICO_PROC_CENTER) under every option above.
 * When n <= min(d_a, d_b) and BICO_PROC_WHITEN is 0 it is a thin solve
 * (docs/methods.md, "Thin solves"): QR of each side's rows and the SVD of
 * an n x n core, O(n^2 (d_a + d_b) + n d_a d_b) flops and O(n (d_a + d_b))
 * doubles besides R, never the d_a x d_b statistic.  Its rank, spectrum
 * and BICO_NULL_DROP map equal the full solve's; with BICO_NULL_KEEP the
 * identified part (R's action on C's row and column spaces) is the same,
 * and the unidentified part is the completion Q_a [0 0; 0 J] Q_b^T (Q the
 * orthogonal factors of the rows' QR, J the rectangular identity), where
 * the full solve keeps LAPACK's arbitrary basis: both are semi-orthogonal
 * and both maximise trace(R^T C).  Otherwise (more rows, or whitening)
 * the rows go through an accumulator and bico_procrustes_solve.  BICO_PROC_METHOD
 * does not apply to the thin solve (it is exact for every rank).  *thin
 * (may be NULL) receives 1 for a thin solve, 0 otherwise.  n = 0 is the
 * zero statistic (rank 0).  NaN or Inf in the rows: BICO_E_NONFINITE. */
BICO_API bico_status bico_procrustes_solve_rows(
    bico_procrustes *p, size_t n, size_t d_a, size_t d_b, const float *x_a,
    size_t ld_a, const float *x_b, size_t ld_b, float *r, size_t ld_r,
    size_t *rank, int *thin);

/* The singular values of the last solved statistic, largest first: copies
 * min(count, cap) of them into s and stores count in *count. */
BICO_API bico_status bico_procrustes_spectrum(const bico_procrustes *p,
                                              double *s, size_t cap,
                                              size_t *count);

#ifdef __cplusplus
}
#endif
#endif
