/* Procrustes R = U V^T of a cross-covariance C: libbico's solver (SVD by
 * LAPACK dgesdd, the default) next to the other LAPACK routes (dgesvd; the
 * eigendecomposition of the smaller Gram, BICO_PROC_EIG; Newton-Schulz,
 * BICO_PROC_POLAR), with
 * time and the orthogonality error ||R R^T - I||_F (R^T R when d_a > d_b),
 * computed in double from the float R libbico returns.
 *
 *   bench_procrustes [--reps R] [--big-reps R] [--threads T] [--max-d D]
 *                    [--lapack-max-d D] [--dump DIR] [--machine]
 *
 * Sizes: 768, 1024, 768x1024, 3072, 3072x4096, 4096 (up to --max-d);
 * dimensions >= 3072 use --big-reps.  Raw dgesvd runs once, up to
 * --lapack-max-d; POLAR up to --polar-max-d (1024), EIG up to --eig-max-d.  --dump writes libbico's R as raw float32 to
 * DIR/R_<d_a>x<d_b>.f32 for the twin to compare with. */
#include <limits.h>
#include <math.h>

#include "../lib/lapack.h"
#include "bico/bico.h"
#include "common.h"

static rntm_t g_rntm;

/* row-major C = op(A) op(B) in double */
static void dgemm_rm(int ta, int tb, size_t m, size_t n, size_t k,
                     const double *a, size_t lda, const double *b, size_t ldb,
                     double *c, size_t ldc) {
  double one = 1, zero = 0;
  bli_dgemm_ex(ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
               tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, (dim_t)m, (dim_t)n,
               (dim_t)k, &one, (double *)a, (inc_t)lda, 1, (double *)b,
               (inc_t)ldb, 1, &zero, c, (inc_t)ldc, 1, NULL, &g_rntm);
}

/* ||R R^T - I||_F for d_a <= d_b, else ||R^T R - I||_F. */
static double orth_err(const double *r, size_t d_a, size_t d_b) {
  size_t k = d_a <= d_b ? d_a : d_b;
  double *g = malloc(k * k * sizeof(double));
  if (d_a <= d_b) dgemm_rm(0, 1, k, k, d_b, r, d_b, r, d_b, g, k);
  else dgemm_rm(1, 0, k, k, d_a, r, d_b, r, d_b, g, k);
  double s = 0;
  for (size_t i = 0; i < k; i++)
    for (size_t j = 0; j < k; j++) {
      double e = g[i * k + j] - (i == j);
      s += e * e;
    }
  free(g);
  return sqrt(s);
}

static double max_diff(const double *x, const double *y, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; i++) m = fmax(m, fabs(x[i] - y[i]));
  return m;
}

/* R by dgesvd (QR iteration), the library's column-major trick. */
static int r_dgesvd(const double *c, size_t d_a, size_t d_b, double *r) {
  size_t mn = d_a < d_b ? d_a : d_b;
  int mi = (int)d_b, ni = (int)d_a, mni = (int)mn, info = 0, lwork = -1;
  double *m = malloc(d_a * d_b * sizeof(double)), *s = malloc(mn * sizeof(double));
  double *u = malloc(mn * d_b * sizeof(double)), *vt = malloc(mn * d_a * sizeof(double));
  double wq;
  memcpy(m, c, d_a * d_b * sizeof(double));
  dgesvd_("S", "S", &mi, &ni, m, &mi, s, u, &mi, vt, &mni, &wq, &lwork, &info, 1, 1);
  lwork = (int)wq;
  double *work = malloc((size_t)lwork * sizeof(double));
  dgesvd_("S", "S", &mi, &ni, m, &mi, s, u, &mi, vt, &mni, work, &lwork, &info, 1, 1);
  dgemm_rm(0, 0, d_a, d_b, mn, vt, mn, u, d_b, r, d_b);
  free(m); free(s); free(u); free(vt); free(work);
  return info;
}

typedef struct { size_t d_a, d_b; } size2;

int main(int argc, char **argv) {
  int reps = 3, big_reps = 1, machine = 0;
  const char *only = NULL; /* "d_axd_b": run that shape alone */
  long threads = sysconf(_SC_NPROCESSORS_ONLN);
  size_t max_d = 4096, lapack_max_d = 768, polar_max_d = 1024, eig_max_d = 4096;
  const char *dump = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--big-reps") && i + 1 < argc) big_reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atol(argv[++i]);
    else if (!strcmp(argv[i], "--max-d") && i + 1 < argc) max_d = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--lapack-max-d") && i + 1 < argc) lapack_max_d = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--dump") && i + 1 < argc) dump = argv[++i];
    else if (!strcmp(argv[i], "--polar-max-d") && i + 1 < argc) polar_max_d = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--eig-max-d") && i + 1 < argc) eig_max_d = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--machine")) machine = 1;
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--reps R] [--big-reps R] [--threads T] [--max-d D] "
                      "[--lapack-max-d D] [--polar-max-d D] [--eig-max-d D] [--dump DIR] [--machine] [--only AxB]\n", argv[0]);
      return 2;
    }
  }
  if (reps < 1 || reps > 64 || big_reps < 1 || big_reps > 64 || threads < 1) return 2;
  bli_rntm_init(&g_rntm);
  bli_rntm_set_num_threads((dim_t)threads, &g_rntm);
  bico_ctx *ctx = NULL;
  bico_procrustes *p = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK) return 1;
  bico_ctx_set_param(ctx, BICO_CTX_THREADS, threads);
  if (bico_procrustes_create(ctx, &p) != BICO_OK) return 1;

  bench_header("Procrustes R = U V^T (libbico and LAPACK routes)", threads);
  printf("# LAPACK: reference LAPACK (liblapack.so.3) whose BLAS is libblas.so.3;\n"
         "# LAPACK-internal BLAS threads come from BLIS_NUM_THREADS=%s.\n"
         "# C: uniform [-0.5, 0.5) entries (seed 33); time = median of %d runs (%d for d >= 3072);\n"
         "# orth = ||R R^T - I||_F (R^T R if d_a > d_b); diff = max |R - R_bico|.\n",
         getenv("BLIS_NUM_THREADS") ? getenv("BLIS_NUM_THREADS") : "(unset)", reps, big_reps);
  printf("# columns: SVD = BICO_PROC_SVD (default, dgesdd); EIG = BICO_PROC_EIG\n"
         "# (dsyevd of the smaller Gram); POLAR = BICO_PROC_POLAR (Newton-Schulz,\n"
         "# GEMMs only; '*' = not certified, fell back to the SVD); gesvd = raw\n"
         "# LAPACK dgesvd + GEMM (only up to --lapack-max-d); diff vs the SVD column.\n");
  printf("%-10s | %8s %9s | %8s %9s %9s | %8s %9s %9s  | %8s %9s %9s\n", "d_a x d_b",
         "SVD s", "orth", "EIG s", "orth", "diff", "POLAR s", "orth", "diff",
         "gesvd s", "orth", "diff");
  size2 sizes[] = {{768, 768}, {1024, 1024}, {768, 1024}, {3072, 3072}, {3072, 4096}, {3072, 3584}, {4096, 4096}};
  char results[6][600];
  int nres = 0;
  for (int k = 0; k < 6; k++) {
    size_t d_a = sizes[k].d_a, d_b = sizes[k].d_b, tot = d_a * d_b;
    char name[64];
    snprintf(name, sizeof name, "%zux%zu", d_a, d_b);
    if (d_a > max_d || d_b > max_d || (only && strcmp(only, name))) continue;
    int rr = (d_a >= 3072 || d_b >= 3072) ? big_reps : reps;
    double *c = malloc(tot * sizeof(double)), *rd = malloc(tot * sizeof(double));
    double *r2 = malloc(tot * sizeof(double));
    float *r = malloc(tot * sizeof(float));
    for (size_t i = 0; i < tot; i++) c[i] = bench_uniform(33, i);
    double t[64];
    size_t rank = 0, rank_m[3] = {0, 0, 0};
    double tm[3], om[3], dm[3] = {0, 0, 0};
    int certified[3] = {1, 1, 1};
    size_t dmax = d_a > d_b ? d_a : d_b;
    for (int meth = 0; meth < 3; meth++) {
      if ((meth == 1 && dmax > eig_max_d) || (meth == 2 && dmax > polar_max_d)) {
        tm[meth] = om[meth] = dm[meth] = NAN;
        continue;
      }
      bico_procrustes_set_param(p, BICO_PROC_METHOD, meth);
      for (int q = 0; q < rr; q++) {
        double t0 = bench_now();
        if (bico_procrustes_solve_matrix(p, d_a, d_b, c, d_b, r, d_b, &rank) != BICO_OK) {
          fprintf(stderr, "solve: %s\n", bico_ctx_errmsg(ctx));
          return 1;
        }
        t[q] = bench_now() - t0;
      }
      tm[meth] = bench_median(t, rr);
      rank_m[meth] = rank;
      size_t cnt = 0;
      bico_procrustes_spectrum(p, NULL, 0, &cnt);
      /* EIG and POLAR fall back to the SVD when uncertified; the spectrum
       * tells (POLAR leaves none, EIG's differs from the SVD's). */
      if (meth == 2) certified[2] = cnt == 0;
      double *dst = meth == 0 ? rd : r2;
      for (size_t i = 0; i < tot; i++) dst[i] = r[i];
      om[meth] = orth_err(dst, d_a, d_b);
      if (meth > 0) dm[meth] = max_diff(r2, rd, tot);
      if (meth == 0 && dump) {
        char path[4096];
        snprintf(path, sizeof path, "%s/R_%zux%zu.f32", dump, d_a, d_b);
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(r, sizeof(float), tot, f) != tot) { perror(path); return 1; }
        fclose(f);
      }
    }
    bico_procrustes_set_param(p, BICO_PROC_METHOD, BICO_PROC_SVD);
    char shp[32];
    snprintf(shp, sizeof shp, "%zux%zu", d_a, d_b);
    printf("%-10s | %8.3f %9.2e | %8.3f %9.2e %9.2e | %8.3f %9.2e %9.2e%s |", shp,
           tm[0], om[0], tm[1], om[1], dm[1], tm[2], om[2], dm[2],
           certified[2] ? "" : "*");
    fflush(stdout);
    int n = snprintf(results[nres], sizeof results[nres],
                     "RESULT d_a=%zu d_b=%zu bico_s=%.6g bico_orth=%.4g rank=%zu "
                     "eig_s=%.6g eig_orth=%.4g eig_diff=%.4g polar_s=%.6g "
                     "polar_orth=%.4g polar_diff=%.4g polar_certified=%d",
                     d_a, d_b, tm[0], om[0], rank_m[0], tm[1], om[1], dm[1], tm[2],
                     om[2], dm[2], certified[2]);
    if (d_a <= lapack_max_d && d_b <= lapack_max_d) {
      /* One run: dgesvd is an order of magnitude slower than dgesdd. */
      double t0 = bench_now();
      r_dgesvd(c, d_a, d_b, r2);
      double tg = bench_now() - t0;
      double og = orth_err(r2, d_a, d_b), dg = max_diff(r2, rd, tot);
      printf(" %8.3f %9.2e %9.2e\n", tg, og, dg);
      snprintf(results[nres] + n, sizeof results[nres] - (size_t)n,
               " gesvd_s=%.6g gesvd_orth=%.4g", tg, og);
    } else {
      printf(" %8s %9s %9s\n", "-", "-", "-");
    }
    nres++;
    fflush(stdout);
    free(c); free(rd); free(r2); free(r);
  }
  if (machine)
    for (int k = 0; k < nres; k++) printf("%s\n", results[k]);
  bico_procrustes_free(p);
  bico_ctx_free(ctx);
  return 0;
}
