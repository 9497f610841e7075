/* Peak memory and time of carrying one LoRA module (rank r, d x d) with
 * BiCo maps, two ways:
 *   factored: bico_lora_transport, B' = R_out^T B, A' = A R_in;
 *   dense:    bico_lora_dense (s B A, d x d), bico_transport_weight
 *             (R_out^T dW R_in, d x d), bico_lora_truncate back to rank r.
 * The context gets a counting allocator, so every byte libbico takes is
 * seen; the program's own buffers of each route are added by hand
 * (factored: B' and A', (d_out + d_in) r floats; dense: the two d x d
 * matrices plus B' and A').  The maps (d x d each, which BiCo needs either
 * way) and the adapter (loaded before either route runs) are not counted.
 * BLIS's packing buffers do not pass through the context's allocator.
 *
 *   bench_lora [--reps R] [--threads T] [--only D]
 *
 * Prints a table, never passes or fails. */
#include <stddef.h>

#include "bico/bico.h"
#include "common.h"

/* Counting allocator: a header in front of each block keeps its size;
 * the header is sized to keep the returned pointer aligned for any type. */
typedef union {
  size_t size;
  long double ld;
  void *p;
  long long ll;
} block_head;

typedef struct {
  size_t cur, peak;
} counter;

static void *count_alloc(void *opaque, size_t size) {
  counter *c = opaque;
  block_head *h = malloc(sizeof *h + size);
  if (!h) return NULL;
  h->size = size;
  c->cur += size;
  if (c->cur > c->peak) c->peak = c->cur;
  return h + 1;
}

static void count_free(void *opaque, void *ptr) {
  counter *c = opaque;
  if (!ptr) return;
  block_head *h = (block_head *)ptr - 1;
  c->cur -= h->size;
  free(h);
}

static void fill(float *x, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++) x[i] = bench_uniform(seed, (uint64_t)i);
}

static void die(bico_ctx *ctx, const char *what) {
  fprintf(stderr, "bench_lora: %s: %s\n", what, bico_ctx_errmsg(ctx));
  exit(1);
}

int main(int argc, char **argv) {
  int reps = 5;
  long threads = 1;
  long only = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atol(argv[++i]);
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = atol(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--reps R] [--threads T] [--only D]\n", argv[0]);
      return 2;
    }
  }
  if (reps < 1 || reps > 64) reps = 5;

  counter cnt = {0, 0};
  bico_ctx *ctx = NULL;
  if (bico_ctx_create_with_allocator(&ctx, count_alloc, count_free, &cnt) != BICO_OK) {
    fprintf(stderr, "bench_lora: ctx_create failed\n");
    return 1;
  }
  bico_ctx_set_param(ctx, BICO_CTX_THREADS, threads);
  bench_header("LoRA transport of one module: factored vs dense + truncate", threads);
  printf("# peak = most bytes held at once during the route: through the context's\n"
         "# allocator, plus the program's buffers (factored: B', A' = 2 r d floats;\n"
         "# dense: dW and R_out^T dW R_in = 2 d^2 floats, plus B', A'); maps and the\n"
         "# loaded adapter not counted; seconds: medians of %d runs\n", reps);
  printf("%6s %4s %12s %12s %12s %12s %10s %10s %8s\n", "d", "r", "factored B",
         "of which lib", "dense B", "of which lib", "dense/fact", "fact s", "dense s");

  static const size_t dims[] = {256, 512, 1024, 2048};
  static const size_t ranks[] = {8, 16};
  for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
    size_t d = dims[di];
    if (only && (size_t)only != d) continue;
    float *rout = malloc(d * d * sizeof *rout), *rin = malloc(d * d * sizeof *rin);
    float *dense = malloc(d * d * sizeof *dense), *moved = malloc(d * d * sizeof *moved);
    if (!rout || !rin || !dense || !moved) {
      fprintf(stderr, "bench_lora: out of memory at d = %zu\n", d);
      return 1;
    }
    fill(rout, d * d, 11);
    fill(rin, d * d, 12);
    for (size_t ri = 0; ri < sizeof ranks / sizeof *ranks; ri++) {
      size_t r = ranks[ri];
      float *b = malloc(d * r * sizeof *b), *a = malloc(r * d * sizeof *a);
      float *bo = malloc(d * r * sizeof *bo), *ao = malloc(r * d * sizeof *ao);
      if (!b || !a || !bo || !ao) {
        fprintf(stderr, "bench_lora: out of memory at d = %zu\n", d);
        return 1;
      }
      fill(b, d * r, 21);
      fill(a, r * d, 22);
      bico_lora *l = NULL;
      if (bico_lora_create(ctx, &l) != BICO_OK) die(ctx, "lora_create");
      if (bico_lora_add_module(l, "layer.fc", BICO_LORA_LINEAR, r, d, d,
                               2.0 * (double)r, b, a) != BICO_OK)
        die(ctx, "lora_add_module");
      double scale = 0;
      if (bico_lora_module(l, 0, NULL, NULL, NULL, NULL, NULL, NULL, &scale) != BICO_OK)
        die(ctx, "lora_module");
      const float *lb = NULL, *la = NULL;
      if (bico_lora_factors(l, 0, &lb, &la) != BICO_OK) die(ctx, "lora_factors");

      size_t own_f = 2 * d * r * sizeof(float);
      size_t own_d = 2 * d * d * sizeof(float) + own_f;
      size_t lib_f = 0, lib_d = 0;
      double tf[64], td[64];
      for (int k = 0; k < reps; k++) {
        size_t base = cnt.cur;
        cnt.peak = base;
        double t0 = bench_now();
        if (bico_lora_transport(ctx, r, 1, d, d, d, d, 1.0f, lb, la,
                                &rout, d, rin, d, bo, ao) != BICO_OK)
          die(ctx, "lora_transport");
        tf[k] = bench_now() - t0;
        if (cnt.peak - base > lib_f) lib_f = cnt.peak - base;

        base = cnt.cur;
        cnt.peak = base;
        t0 = bench_now();
        if (bico_lora_dense(l, 0, 1.0f, 0.0f, dense, d) != BICO_OK) die(ctx, "lora_dense");
        if (bico_transport_weight(ctx, d, d, d, d, 1.0f, dense, d, rout, d, rin, d, 0.0f,
                                  moved, d) != BICO_OK)
          die(ctx, "transport_weight");
        if (bico_lora_truncate(ctx, d, d, r, scale, moved, d, bo, ao, NULL) != BICO_OK)
          die(ctx, "lora_truncate");
        td[k] = bench_now() - t0;
        if (cnt.peak - base > lib_d) lib_d = cnt.peak - base;
      }
      double fs = bench_median(tf, reps), ds = bench_median(td, reps);
      size_t pf = own_f + lib_f, pd = own_d + lib_d;
      printf("%6zu %4zu %12zu %12zu %12zu %12zu %10.0f %10.6f %8.3f\n", d, r, pf, lib_f, pd,
             lib_d, (double)pd / (double)pf, fs, ds);
      fflush(stdout);
      bico_lora_free(l);
      free(b);
      free(a);
      free(bo);
      free(ao);
    }
    free(rout);
    free(rin);
    free(dense);
    free(moved);
  }
  bico_ctx_free(ctx);
  return 0;
}
