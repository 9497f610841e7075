/* Prototypes of the Fortran LAPACK routines libbico calls (reference LAPACK,
 * -llapack, 32-bit integers).  gfortran passes the length of every
 * CHARACTER argument as a hidden trailing size_t (GCC >= 8); declaring them
 * keeps the calls correct instead of relying on the callee ignoring them.
 * Internal; never installed. */
#ifndef BICO_LAPACK_H
#define BICO_LAPACK_H

#include <stddef.h>

/* Thin/full SVD by divide and conquer. */
void dgesdd_(const char *jobz, const int *m, const int *n, double *a,
             const int *lda, double *s, double *u, const int *ldu, double *vt,
             const int *ldvt, double *work, const int *lwork, int *iwork,
             int *info, size_t jobz_len);

/* SVD by QR iteration: slower, the fallback when dgesdd does not converge. */
void dgesvd_(const char *jobu, const char *jobvt, const int *m, const int *n,
             double *a, const int *lda, double *s, double *u, const int *ldu,
             double *vt, const int *ldvt, double *work, const int *lwork,
             int *info, size_t jobu_len, size_t jobvt_len);

/* Symmetric eigendecomposition by divide and conquer. */
void dsyevd_(const char *jobz, const char *uplo, const int *n, double *a,
             const int *lda, double *w, double *work, const int *lwork,
             int *iwork, const int *liwork, int *info, size_t jobz_len,
             size_t uplo_len);

/* Symmetric eigendecomposition by QR iteration (fallback for dsyevd). */
void dsyev_(const char *jobz, const char *uplo, const int *n, double *a,
            const int *lda, double *w, double *work, const int *lwork,
            int *info, size_t jobz_len, size_t uplo_len);

/* Symmetric eigendecomposition by relatively robust representations (the
 * EIG route: eigenvectors into a separate array, small workspace). */
void dsyevr_(const char *jobz, const char *range, const char *uplo,
             const int *n, double *a, const int *lda, const double *vl,
             const double *vu, const int *il, const int *iu,
             const double *abstol, int *m, double *w, double *z,
             const int *ldz, int *isuppz, double *work, const int *lwork,
             int *iwork, const int *liwork, int *info, size_t jobz_len,
             size_t range_len, size_t uplo_len);

/* Cholesky factorisation (the certificates of the EIG and polar routes;
 * the fit's blocked Cholesky on its diagonal blocks). */
void dpotrf_(const char *uplo, const int *n, double *a, const int *lda,
             int *info, size_t uplo_len);

/* Cholesky factorisation with complete pivoting of a positive semidefinite
 * matrix: its rank (the fit's numerical rank of X'^T X'). */
void dpstrf_(const char *uplo, const int *n, double *a, const int *lda,
             int *piv, int *rank, const double *tol, double *work, int *info,
             size_t uplo_len);

/* Householder QR (the thin solves' factorisation of each side's rows). */
void dgeqrf_(const int *m, const int *n, double *a, const int *lda,
             double *tau, double *work, const int *lwork, int *info);

/* Applies the orthogonal factor of dgeqrf (as reflectors) to a matrix. */
void dormqr_(const char *side, const char *trans, const int *m, const int *n,
             const int *k, const double *a, const int *lda, const double *tau,
             double *c, const int *ldc, double *work, const int *lwork,
             int *info, size_t side_len, size_t trans_len);

#endif
