/* Shared helpers of the libbico benchmarks: timing, medians, the
 * deterministic data generator the Python twins reproduce, and the header
 * every benchmark prints.  Benchmarks print tables; they never pass or
 * fail on timing. */
#ifndef BICO_BENCH_COMMON_H
#define BICO_BENCH_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <blis.h>

static double bench_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int bench_cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Median of n timings (sorts t). */
static double bench_median(double *t, int n) {
  qsort(t, (size_t)n, sizeof *t, bench_cmp);
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

/* splitmix64 of (seed, index): a counter-based generator, so numpy can
 * reproduce any element without running a sequential stream
 * (bench/benchdata.py has the same function). */
static inline uint64_t bench_mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Uniform in [-0.5, 0.5) with 24 random bits: exact in float. */
static inline float bench_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = bench_mix(seed * 0x100000001B3ull + i);
  return (float)((double)(z >> 40) * 0x1p-24 - 0.5);
}

/* Activation-like rows: x[r][j] = u(seed, r d + j) + offset_j, with a
 * per-column offset (nonzero means, as in real activations). */
static inline void bench_fill_rows(float *x, size_t rows, size_t d, uint64_t seed) {
  for (size_t r = 0; r < rows; r++)
    for (size_t j = 0; j < d; j++)
      x[r * d + j] =
          bench_uniform(seed, (uint64_t)(r * d + j)) + 0.25f * (float)(j % 4);
}

static void bench_header(const char *what, long threads) {
  /* BLIS must be initialised before its sub-configuration is queried, or a
   * forced BLIS_ARCH_TYPE aborts (BLIS 0.9.0). */
  bli_init();
  printf("# %s\n", what);
  printf("# cores: %ld online; threads used: %ld\n",
         sysconf(_SC_NPROCESSORS_ONLN), threads);
  const char *at = getenv("BLIS_ARCH_TYPE");
  printf("# BLAS: BLIS %s, sub-configuration '%s'%s%s%s\n",
         bli_info_get_version_str(), bli_arch_string(bli_arch_query_id()),
         at ? " (forced by BLIS_ARCH_TYPE=" : " (auto-detected)",
         at ? at : "", at ? ")" : "");
}

#endif
