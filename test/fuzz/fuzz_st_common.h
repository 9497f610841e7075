/* The checks both safetensors targets run on a file the reader accepted:
 * every accessor answers consistently and from the documented contract,
 * never from the reader's own idea of the data. */
#ifndef BICO_FUZZ_ST_COMMON_H
#define BICO_FUZZ_ST_COMMON_H

#include <math.h>

#include "bico/safetensors.h"
#include "fuzz_util.h"

/* Exercises an open file; returns the total data bytes of its tensors. */
static size_t fuzz_st_exercise(bico_ctx *ctx, const bico_stfile *f) {
  size_t n = 0, total = 0;
  FUZZ_REQUIRE(bico_stfile_count(f, &n) == BICO_OK);
  for (size_t i = 0; i < n; i++) {
    const char *name = NULL, *path = NULL;
    const size_t *shape = NULL;
    size_t ndim = 0, numel = 0, nbytes = 0, prod = 1, found = 0, dn = 0;
    int dtype = 0;
    const void *data = NULL;
    FUZZ_REQUIRE(bico_stfile_tensor_info(f, i, &name, &dtype, &ndim,
                                         &shape) == BICO_OK);
    FUZZ_REQUIRE(name != NULL && bico_dtype_name(dtype) != NULL);
    FUZZ_REQUIRE(ndim == 0 || shape != NULL);
    for (size_t k = 0; k < ndim; k++) prod *= shape[k];
    FUZZ_REQUIRE(bico_stfile_tensor_size(f, i, &numel, &nbytes) == BICO_OK);
    FUZZ_REQUIRE(numel == prod);
    FUZZ_REQUIRE(nbytes == numel * bico_dtype_size(dtype));
    FUZZ_REQUIRE(bico_stfile_data(f, i, &data, &dn) == BICO_OK);
    FUZZ_REQUIRE(dn == nbytes);
    FUZZ_REQUIRE(bico_stfile_tensor_path(f, i, &path) == BICO_OK &&
                 path != NULL);
    FUZZ_REQUIRE(bico_stfile_find(f, name, &found) == BICO_OK);
    {
      const char *fname = NULL;
      FUZZ_REQUIRE(bico_stfile_tensor_info(f, found, &fname, NULL, NULL,
                                           NULL) == BICO_OK);
      FUZZ_REQUIRE(strcmp(fname, name) == 0);
    }
    total += nbytes;

    /* Conversions: the whole read equals the two half reads; the f64 read
     * agrees with the f32 one; check_finite agrees with the f64 values. */
    float *a = malloc((numel ? numel : 1) * sizeof *a);
    float *b = malloc((numel ? numel : 1) * sizeof *b);
    double *d = malloc((numel ? numel : 1) * sizeof *d);
    FUZZ_REQUIRE(a && b && d);
    FUZZ_REQUIRE(bico_stfile_read_f32(f, i, a, numel) == BICO_OK);
    size_t h = numel / 2;
    FUZZ_REQUIRE(bico_stfile_read_f32_range(f, i, 0, b, h) == BICO_OK);
    FUZZ_REQUIRE(bico_stfile_read_f32_range(f, i, h, b + h, numel - h) ==
                 BICO_OK);
    FUZZ_REQUIRE(memcmp(a, b, numel * sizeof *a) == 0);
    FUZZ_REQUIRE(bico_stfile_read_f64(f, i, d, numel) == BICO_OK);
    int finite = 1;
    for (size_t k = 0; k < numel; k++) {
      if (!isfinite(d[k])) finite = 0;
      /* Same value in both precisions (64-bit integers excepted: rounding
       * them to float directly and through double may differ). */
      if (dtype == BICO_DTYPE_I64 || dtype == BICO_DTYPE_U64) continue;
      if (isnan(d[k])) FUZZ_REQUIRE(isnan(a[k]));
      else FUZZ_REQUIRE(a[k] == (float)d[k]);
    }
    bico_status fin = bico_stfile_check_finite(f, i);
    FUZZ_REQUIRE(fin == (finite ? BICO_OK : BICO_E_NONFINITE));
    if (!finite) fuzz_check_failure(ctx, fin);
    /* Wrong counts and ranges are refused, not read. */
    fuzz_check_failure(ctx, bico_stfile_read_f32(f, i, a, numel + 1));
    fuzz_check_failure(ctx,
                       bico_stfile_read_f32_range(f, i, h, b, numel - h + 1));
    fuzz_check_failure(ctx,
                       bico_stfile_read_f64_range(f, i, SIZE_MAX, d, 2));
    free(a);
    free(b);
    free(d);
  }
  /* Out of range. */
  fuzz_check_failure(ctx, bico_stfile_tensor_info(f, n, NULL, NULL, NULL,
                                                  NULL));
  size_t m = 0;
  FUZZ_REQUIRE(bico_stfile_metadata_count(f, &m) == BICO_OK);
  for (size_t i = 0; i < m; i++) {
    const char *key = NULL, *value = NULL, *again = NULL;
    FUZZ_REQUIRE(bico_stfile_metadata_at(f, i, &key, &value) == BICO_OK);
    FUZZ_REQUIRE(key != NULL && value != NULL);
    FUZZ_REQUIRE(bico_stfile_metadata_get(f, key, &again) == BICO_OK);
    FUZZ_REQUIRE(again != NULL);
  }
  return total;
}

#endif
