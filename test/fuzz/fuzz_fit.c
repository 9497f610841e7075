/* libFuzzer target: bico_fit_deserialize (experimental.h) on arbitrary
 * bytes.  An accepted byte string must be canonical (serialising the fit
 * gives the same bytes back: the format is bit for bit), merge with itself,
 * and solve to a finite update or a clean error, never NaN. */
#define BICO_EXPERIMENTAL
#include <math.h>

#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  bico_ctx *ctx = fuzz_ctx();
  bico_fit *f = (bico_fit *)(uintptr_t)1; /* must be reset on failure */
  bico_status st = bico_fit_deserialize(ctx, data, size, &f);
  if (st != BICO_OK) {
    fuzz_check_failure(ctx, st);
    FUZZ_REQUIRE(f == NULL);
    FUZZ_REQUIRE(st == BICO_E_FORMAT || st == BICO_E_VERSION ||
                 st == BICO_E_NOMEM);
    bico_ctx_free(ctx);
    return 0;
  }
  FUZZ_REQUIRE(f != NULL);
  size_t d_out = 0, d_in = 0, len = 0, written = 0;
  uint64_t rows = 0;
  unsigned flags = 0;
  FUZZ_REQUIRE(bico_fit_info(f, &d_out, &d_in, &rows, &flags) == BICO_OK);
  FUZZ_REQUIRE(d_out >= 1 && d_in >= 1);
  /* Every payload double needs 8 input bytes. */
  FUZZ_REQUIRE(d_in * d_in + d_out * d_in <= size / 8);

  FUZZ_REQUIRE(bico_fit_serialized_size(f, &len) == BICO_OK);
  FUZZ_REQUIRE(len == size);
  uint8_t *buf = malloc(len);
  FUZZ_REQUIRE(buf != NULL);
  FUZZ_REQUIRE(bico_fit_serialize(f, buf, len, &written) == BICO_OK);
  FUZZ_REQUIRE(written == size && memcmp(buf, data, size) == 0);
  free(buf);

  const int bias = (flags & BICO_FIT_BIAS) != 0;
  float *w = calloc(d_out * d_in + d_out, sizeof *w);
  float *dw = malloc((d_out * d_in + d_out) * sizeof *dw);
  FUZZ_REQUIRE(w != NULL && dw != NULL);
  for (int pass = 0; pass < 2; pass++) {
    size_t rank = 0;
    st = bico_fit_solve(f, w, d_in, bias ? w + d_out * d_in : NULL, dw, d_in,
                        bias ? dw + d_out * d_in : NULL, &rank);
    if (st == BICO_OK) {
      FUZZ_REQUIRE(rank <= d_in + (size_t)bias);
      for (size_t i = 0; i < d_out * d_in + (bias ? d_out : 0); i++)
        FUZZ_REQUIRE(isfinite(dw[i]));
    } else {
      fuzz_check_failure(ctx, st);
      FUZZ_REQUIRE(st == BICO_E_NUMERIC || st == BICO_E_NOMEM);
    }
    /* the second pass on the fit merged with itself (twice the rows) */
    st = bico_fit_merge(f, f);
    if (st != BICO_OK) {
      fuzz_check_failure(ctx, st);
      FUZZ_REQUIRE(st == BICO_E_SHAPE);  /* the row count overflows */
      break;
    }
  }
  free(w);
  free(dw);
  bico_fit_free(f);
  bico_ctx_free(ctx);
  return 0;
}
