/* The smallest libbico program: align two random 4-d point clouds that
 * differ by a signed permutation (a rotation) and print the recovered map:
 * a context, an accumulator of the cross-covariance of corresponding rows,
 * and the Procrustes solve.  Built and run by `make check` against the
 * installed library through pkg-config, as every program here is:
 *   cc hello.c $(pkg-config --cflags --libs bico) */
#include <stdio.h>
#include <stdlib.h>
#include <bico/bico.h>

int main(void) {
  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK) return 1;
  printf("libbico %s (header %s)\n", bico_version_string(), BICO_VERSION_STRING);

  enum { N = 64, D = 4 };
  float xa[N * D], xb[N * D];
  /* x_b = x_a Q with Q a signed permutation: a rotation Procrustes must find. */
  static const int perm[D] = {2, 0, 3, 1};
  static const float sign[D] = {1, -1, 1, -1};
  srand(7);
  for (int i = 0; i < N; i++)
    for (int j = 0; j < D; j++) xa[i * D + j] = (float)rand() / RAND_MAX - 0.5f;
  for (int i = 0; i < N; i++)
    for (int j = 0; j < D; j++) xb[i * D + perm[j]] = sign[j] * xa[i * D + j];

  bico_xcov *xc = NULL;
  bico_procrustes *pr = NULL;
  float r[D * D];
  size_t rank = 0;
  int rc = bico_xcov_create(ctx, D, D, 0, &xc);
  if (rc == BICO_OK) rc = bico_xcov_add(xc, N, xa, D, xb, D);
  if (rc == BICO_OK) rc = bico_procrustes_create(ctx, &pr);
  if (rc == BICO_OK) rc = bico_procrustes_solve(pr, xc, r, D, &rank);
  if (rc != BICO_OK) {
    fprintf(stderr, "hello: %s: %s\n", bico_strerror(rc), bico_ctx_errmsg(ctx));
  } else {
    printf("rank %zu, R =\n", rank);
    for (int i = 0; i < D; i++) {
      for (int j = 0; j < D; j++) printf(" %6.3f", r[i * D + j]);
      printf("\n");
    }
    /* R should equal Q: entry (j, perm[j]) = sign[j]. */
    for (int j = 0; j < D; j++)
      if (r[j * D + perm[j]] * sign[j] < 0.999f) rc = BICO_E_INTERNAL;
    if (rc != BICO_OK) fprintf(stderr, "hello: recovered map is wrong\n");
  }
  bico_procrustes_free(pr);
  bico_xcov_free(xc);
  bico_ctx_free(ctx);
  printf("hello: %s\n", rc == BICO_OK ? "ok" : "WRONG");
  return rc == BICO_OK ? 0 : 1;
}
