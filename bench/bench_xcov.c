/* Statistics accumulation C += X_a^T X_b: libbico's exact (default) and
 * fast (BICO_XCOV_ADD_FAST) modes against BLIS's own sgemm on the same shapes
 * in the same run, with the relative error of each against an all-double
 * reference.
 *
 *   bench_xcov [--reps R] [--threads T] [--rows N] [--big-rows N]
 *              [--machine]
 *
 * Shapes: 768x768, 768x1024 with N rows (default 16384) and 3072x4096 with
 * --big-rows (default N).  --machine prints one "RESULT key=value ..." line
 * per shape (for bench/run.py) after the table. */
#include <math.h>

#include "bico/bico.h"
#include "common.h"

typedef struct {
  size_t n, d_a, d_b;
} shape;

/* ||x - ref||_F / ||ref||_F over count doubles (x float when xf). */
static double rel_err(const double *x, const float *xf, const double *ref,
                      size_t count) {
  double num = 0, den = 0;
  for (size_t i = 0; i < count; i++) {
    double v = xf ? (double)xf[i] : x[i];
    num += (v - ref[i]) * (v - ref[i]);
    den += ref[i] * ref[i];
  }
  return sqrt(num / den);
}

static int run_xcov(bico_ctx *ctx, int mode, const shape *s,
                    const float *xa, const float *xb, int reps, double *t_med,
                    double *out) {
  double t[64];
  for (int r = 0; r < reps; r++) {
    bico_xcov *xc = NULL;
    if (bico_xcov_create(ctx, s->d_a, s->d_b, 0, &xc) != BICO_OK ||
        bico_xcov_set_param(xc, BICO_XCOV_ADD_MODE, mode) != BICO_OK) {
      fprintf(stderr, "xcov_create: %s\n", bico_ctx_errmsg(ctx));
      bico_xcov_free(xc);
      return 1;
    }
    double t0 = bench_now();
    bico_status st = bico_xcov_add(xc, s->n, xa, s->d_a, xb, s->d_b);
    t[r] = bench_now() - t0;
    if (st != BICO_OK) {
      fprintf(stderr, "xcov_add: %s\n", bico_ctx_errmsg(ctx));
      bico_xcov_free(xc);
      return 1;
    }
    if (r == reps - 1)
      bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, out, s->d_b);
    bico_xcov_free(xc);
  }
  *t_med = bench_median(t, reps);
  return 0;
}

int main(int argc, char **argv) {
  int reps = 3, machine = 0;
  const char *only = NULL; /* "d_axd_b": run that shape alone */
  long threads = sysconf(_SC_NPROCESSORS_ONLN);
  size_t rows = 16384, big_rows = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atol(argv[++i]);
    else if (!strcmp(argv[i], "--rows") && i + 1 < argc) rows = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--big-rows") && i + 1 < argc) big_rows = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--machine")) machine = 1;
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--reps R] [--threads T] [--rows N] [--big-rows N] [--machine] [--only AxB]\n", argv[0]);
      return 2;
    }
  }
  if (reps < 1 || reps > 64 || threads < 1 || rows < 1) return 2;
  if (big_rows == 0) big_rows = rows;
  shape shapes[] = {{rows, 768, 768}, {rows, 768, 1024}, {big_rows, 3072, 4096}};
  const int nshape = 3;

  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK) return 1;
  bico_ctx_set_param(ctx, BICO_CTX_THREADS, threads);
  rntm_t rntm;
  bli_rntm_init(&rntm);
  bli_rntm_set_num_threads((dim_t)threads, &rntm);

  bench_header("statistics accumulation C += X_a^T X_b (libbico vs BLIS sgemm)", threads);
  printf("# median of %d runs; GFLOP/s counts 2 n d_a d_b; 'of sgemm' is the\n"
         "# fraction of BLIS sgemm's rate on the same shape in this run; error is\n"
         "# ||C - C_ref||_F / ||C_ref||_F against one dgemm in double over the rows\n# in reverse order.\n", reps);
  printf("%-10s %6s | %8s %7s %9s | %8s %7s %7s %9s | %8s %7s %7s %9s\n",
         "d_a x d_b", "rows", "sgemm s", "GF/s", "error",
         "exact s", "GF/s", "of sg", "error", "fast s", "GF/s", "of sg", "error");
  char results[3][512] = {{0}};
  for (int k = 0; k < nshape; k++) {
    const shape *s = &shapes[k];
    char name[64];
    snprintf(name, sizeof name, "%zux%zu", s->d_a, s->d_b);
    if (only && strcmp(only, name)) continue;
    size_t na = s->n * s->d_a, nb = s->n * s->d_b, nc = s->d_a * s->d_b;
    float *xa = malloc(na * sizeof(float)), *xb = malloc(nb * sizeof(float));
    float *cf = malloc(nc * sizeof(float));
    double *ref = malloc(nc * sizeof(double)), *ce = malloc(nc * sizeof(double));
    double *cfast = malloc(nc * sizeof(double));
    if (!xa || !xb || !cf || !ref || !ce || !cfast) {
      fprintf(stderr, "out of memory for %zu x %zu x %zu\n", s->n, s->d_a, s->d_b);
      return 1;
    }
    bench_fill_rows(xa, s->n, s->d_a, 11);
    bench_fill_rows(xb, s->n, s->d_b, 22);

    /* Reference: one dgemm over all rows of the exact double copies. */
    {
      double *ya = malloc(na * sizeof(double)), *yb = malloc(nb * sizeof(double));
      if (!ya || !yb) { fprintf(stderr, "out of memory (reference)\n"); return 1; }
      /* Rows reversed: the same sum in another order, so that the
       * reference does not share libbico's blocking (with the same order
       * BLIS reproduces the exact mode bit for bit). */
      for (size_t r = 0; r < s->n; r++) {
        size_t q = s->n - 1 - r;
        for (size_t j = 0; j < s->d_a; j++) ya[q * s->d_a + j] = xa[r * s->d_a + j];
        for (size_t j = 0; j < s->d_b; j++) yb[q * s->d_b + j] = xb[r * s->d_b + j];
      }
      double one = 1, zero = 0;
      bli_dgemm_ex(BLIS_TRANSPOSE, BLIS_NO_TRANSPOSE, (dim_t)s->d_a, (dim_t)s->d_b,
                   (dim_t)s->n, &one, ya, (inc_t)s->d_a, 1, yb, (inc_t)s->d_b, 1,
                   &zero, ref, (inc_t)s->d_b, 1, NULL, &rntm);
      free(ya);
      free(yb);
    }
    /* BLIS sgemm: one call over all rows, the machine's practical limit. */
    double t[64];
    for (int r = 0; r < reps; r++) {
      float one = 1, zero = 0;
      double t0 = bench_now();
      bli_sgemm_ex(BLIS_TRANSPOSE, BLIS_NO_TRANSPOSE, (dim_t)s->d_a, (dim_t)s->d_b,
                   (dim_t)s->n, &one, xa, (inc_t)s->d_a, 1, xb, (inc_t)s->d_b, 1,
                   &zero, cf, (inc_t)s->d_b, 1, NULL, &rntm);
      t[r] = bench_now() - t0;
    }
    double ts = bench_median(t, reps), te, tf;
    if (run_xcov(ctx, BICO_XCOV_ADD_EXACT, s, xa, xb, reps, &te, ce) ||
        run_xcov(ctx, BICO_XCOV_ADD_FAST, s, xa, xb, reps, &tf, cfast))
      return 1;
    double fl = 2.0 * (double)s->n * (double)s->d_a * (double)s->d_b * 1e-9;
    double es = rel_err(NULL, cf, ref, nc), ee = rel_err(ce, NULL, ref, nc),
           ef = rel_err(cfast, NULL, ref, nc);
    char shp[32];
    snprintf(shp, sizeof shp, "%zux%zu", s->d_a, s->d_b);
    printf("%-10s %6zu | %8.3f %7.1f %9.2e | %8.3f %7.1f %6.0f%% %9.2e | %8.3f %7.1f %6.0f%% %9.2e\n",
           shp, s->n, ts, fl / ts, es, te, fl / te, 100 * ts / te, ee, tf,
           fl / tf, 100 * ts / tf, ef);
    fflush(stdout);
    snprintf(results[k], sizeof results[k],
             "RESULT d_a=%zu d_b=%zu rows=%zu sgemm_s=%.6g sgemm_err=%.4g "
             "exact_s=%.6g exact_err=%.4g fast_s=%.6g fast_err=%.4g",
             s->d_a, s->d_b, s->n, ts, es, te, ee, tf, ef);
    free(xa); free(xb); free(cf); free(ref); free(ce); free(cfast);
  }
  if (machine)
    for (int k = 0; k < nshape; k++)
      if (results[k][0]) printf("%s\n", results[k]);
  bico_ctx_free(ctx);
  return 0;
}
