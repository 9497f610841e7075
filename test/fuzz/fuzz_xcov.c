/* libFuzzer target: bico_xcov_deserialize on arbitrary bytes.
 * An accepted byte string must be canonical (serialising the accumulator
 * gives the same bytes back: the format is documented as bit-exact), its
 * matrices must be readable, and the Procrustes solve on it must end in a
 * finite orthogonal-shaped map or a clean error, never NaN. */
#include <math.h>

#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int all_finite(const double *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  bico_ctx *ctx = fuzz_ctx();
  bico_xcov *xc = (bico_xcov *)(uintptr_t)1; /* must be reset on failure */
  bico_status st = bico_xcov_deserialize(ctx, data, size, &xc);
  if (st != BICO_OK) {
    fuzz_check_failure(ctx, st);
    FUZZ_REQUIRE(xc == NULL);
    FUZZ_REQUIRE(st == BICO_E_FORMAT || st == BICO_E_VERSION ||
                 st == BICO_E_NOMEM);
    bico_ctx_free(ctx);
    return 0;
  }
  FUZZ_REQUIRE(xc != NULL);
  size_t d_a = 0, d_b = 0, len = 0, written = 0;
  uint64_t rows = 0;
  unsigned flags = 0;
  FUZZ_REQUIRE(bico_xcov_info(xc, &d_a, &d_b, &rows, &flags) == BICO_OK);
  FUZZ_REQUIRE(d_a >= 1 && d_b >= 1);
  /* Every payload double needs 8 input bytes, so these sizes are bounded
   * by the input's length. */
  FUZZ_REQUIRE(d_a * d_b <= size / 8);

  FUZZ_REQUIRE(bico_xcov_serialized_size(xc, &len) == BICO_OK);
  FUZZ_REQUIRE(len == size);
  uint8_t *buf = malloc(len);
  FUZZ_REQUIRE(buf != NULL);
  FUZZ_REQUIRE(bico_xcov_serialize(xc, buf, len, &written) == BICO_OK);
  FUZZ_REQUIRE(written == size && memcmp(buf, data, size) == 0);
  free(buf);

  double *c = malloc(d_a * d_b * sizeof *c);
  FUZZ_REQUIRE(c != NULL);
  FUZZ_REQUIRE(bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, c, d_b) == BICO_OK);
  FUZZ_REQUIRE(all_finite(c, d_a * d_b));
  /* Centering needs the sums; whatever the stored numbers, the result is
   * finite or the call fails cleanly. */
  st = bico_xcov_matrix(xc, BICO_XCOV_CROSS, 1, c, d_b);
  if (flags & BICO_XCOV_SUMS) {
    if (st == BICO_OK) FUZZ_REQUIRE(all_finite(c, d_a * d_b));
    else fuzz_check_failure(ctx, st);
  } else {
    fuzz_check_failure(ctx, st);
  }
  free(c);

  /* The solver in the configurations the flags allow: plain, centered,
   * whitened, both, and with the rank-dropping completion. */
  for (int config = 0; config < 5; config++) {
    int center = config == 1 || config == 3;
    double whiten = (config == 2 || config == 3) ? 0.5 : 0.0;
    if (center && !(flags & BICO_XCOV_SUMS)) continue;
    if (whiten > 0 && !(flags & BICO_XCOV_GRAMS)) continue;
    bico_procrustes *p = NULL;
    FUZZ_REQUIRE(bico_procrustes_create(ctx, &p) == BICO_OK);
    FUZZ_REQUIRE(bico_procrustes_set_param(p, BICO_PROC_CENTER, center) ==
                 BICO_OK);
    FUZZ_REQUIRE(bico_procrustes_set_param(p, BICO_PROC_WHITEN, whiten) ==
                 BICO_OK);
    if (config == 4)
      FUZZ_REQUIRE(bico_procrustes_set_param(p, BICO_PROC_NULL,
                                             BICO_NULL_DROP) == BICO_OK);
    float *r = malloc(d_a * d_b * sizeof *r);
    FUZZ_REQUIRE(r != NULL);
    size_t rank = 0;
    st = bico_procrustes_solve(p, xc, r, d_b, &rank);
    if (st == BICO_OK) {
      FUZZ_REQUIRE(rank <= (d_a < d_b ? d_a : d_b));
      for (size_t i = 0; i < d_a * d_b; i++) {
        FUZZ_REQUIRE(isfinite(r[i]));
        /* Entries of a matrix with orthonormal rows or columns (or a
         * partial isometry). */
        FUZZ_REQUIRE(fabsf(r[i]) <= 1.0f + 1e-3f);
      }
    } else {
      fuzz_check_failure(ctx, st);
      FUZZ_REQUIRE(st == BICO_E_NUMERIC || st == BICO_E_NONFINITE ||
                   st == BICO_E_NOMEM);
    }
    free(r);
    bico_procrustes_free(p);
  }
  bico_xcov_free(xc);
  bico_ctx_free(ctx);
  return 0;
}
