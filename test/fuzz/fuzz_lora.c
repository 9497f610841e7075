/* libFuzzer target: bico_lora_open on a PEFT adapter folder.  The input is
 * split at the first "\n@@@\n": the part before is written as
 * adapter_config.json, the rest as adapter_model.safetensors.  An accepted
 * adapter must answer every accessor consistently (ranks and widths
 * positive, finite factors, alpha > 0 and scale = alpha / r or
 * alpha / sqrt(r)), and saving it and opening the saved folder must give
 * the same modules. */
#include <math.h>

#include "bico/lora.h"
#include "fuzz_util.h"

#define SEP "\n@@@\n"
#define SEP_LEN 5

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_adapter(bico_ctx *ctx, const bico_lora *l) {
  size_t n = 0, ns = 0;
  FUZZ_REQUIRE(bico_lora_module_count(l, &n) == BICO_OK);
  FUZZ_REQUIRE(bico_lora_saved_count(l, &ns) == BICO_OK);
  for (size_t i = 0; i < n; i++) {
    const char *name = NULL;
    int kind = 0;
    double rs = 0;
    size_t rank = 0, d_out = 0, d_in = 0, found = 0;
    double alpha = 0, scale = 0;
    const float *b = NULL, *a = NULL;
    FUZZ_REQUIRE(bico_lora_module(l, i, &name, &kind, &rank, &d_out, &d_in,
                                  &alpha, &scale) == BICO_OK);
    FUZZ_REQUIRE(name != NULL && rank >= 1 && d_out >= 1 && d_in >= 1);
    FUZZ_REQUIRE(kind == BICO_LORA_LINEAR || kind == BICO_LORA_EMBEDDING);
    FUZZ_REQUIRE(isfinite(alpha) && alpha > 0 && isfinite(scale));
    FUZZ_REQUIRE(bico_lora_get_param(l, BICO_LORA_RSLORA, &rs) == BICO_OK);
    {
      double want = rs ? alpha / sqrt((double)rank) : alpha / (double)rank;
      FUZZ_REQUIRE(fabs(scale - want) <= 1e-12 * fabs(want));
    }
    FUZZ_REQUIRE(bico_lora_find_module(l, name, &found) == BICO_OK);
    FUZZ_REQUIRE(bico_lora_factors(l, i, &b, &a) == BICO_OK && b && a);
    for (size_t k = 0; k < d_out * rank; k++) FUZZ_REQUIRE(isfinite(b[k]));
    for (size_t k = 0; k < rank * d_in; k++) FUZZ_REQUIRE(isfinite(a[k]));
    if (d_out * d_in <= 1 << 16) {
      float *dense = malloc(d_out * d_in * sizeof *dense);
      FUZZ_REQUIRE(dense != NULL);
      /* Finite factors may still overflow float in the product: only a
       * clean return is required. */
      bico_status st = bico_lora_dense(l, i, 1.0f, 0.0f, dense, d_in);
      if (st != BICO_OK) fuzz_check_failure(ctx, st);
      free(dense);
    }
  }
  fuzz_check_failure(ctx, bico_lora_module(l, n, NULL, NULL, NULL, NULL,
                                           NULL, NULL, NULL));
  for (size_t i = 0; i < ns; i++) {
    const char *name = NULL, *module = NULL;
    size_t ndim = 0;
    const size_t *shape = NULL;
    const float *d = NULL;
    FUZZ_REQUIRE(bico_lora_saved(l, i, &name, &module, &ndim, &shape, &d) ==
                 BICO_OK);
    FUZZ_REQUIRE(name && module && strncmp(name, module, strlen(module)) == 0);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const uint8_t *sep = NULL;
  for (size_t i = 0; i + SEP_LEN <= size; i++)
    if (memcmp(data + i, SEP, SEP_LEN) == 0) {
      sep = data + i;
      break;
    }
  size_t clen = sep ? (size_t)(sep - data) : size;
  const uint8_t *st_bytes = sep ? sep + SEP_LEN : data + size;
  char cfg[4200], model[4200], dir[4200], saved[4200], p1[4200], p2[4200];
  fuzz_write_file("adapter_config.json", data, clen, cfg, sizeof cfg);
  fuzz_write_file("adapter_model.safetensors", st_bytes,
                  (size_t)(data + size - st_bytes), model, sizeof model);
  snprintf(dir, sizeof dir, "%s", fuzz_dir());
  snprintf(saved, sizeof saved, "%s/saved", fuzz_dir());

  bico_ctx *ctx = fuzz_ctx();
  bico_lora *l = (bico_lora *)(uintptr_t)1; /* must be reset on failure */
  bico_status st = bico_lora_open(ctx, dir, &l);
  if (getenv("BICO_FUZZ_VERBOSE"))
    fprintf(stderr, "lora_open: status %d %s\n", (int)st, bico_ctx_errmsg(ctx));
  if (st != BICO_OK) {
    fuzz_check_failure(ctx, st);
    FUZZ_REQUIRE(l == NULL);
  } else {
    FUZZ_REQUIRE(l != NULL);
    check_adapter(ctx, l);
    /* Save and reopen: the same modules with the same shapes and scales. */
    st = bico_lora_save(l, saved);
    if (st != BICO_OK)
      fprintf(stderr, "saving an accepted adapter failed: %s\n",
              bico_ctx_errmsg(ctx));
    FUZZ_REQUIRE(st == BICO_OK);
    {
      bico_lora *again = NULL;
      st = bico_lora_open(ctx, saved, &again);
      FUZZ_REQUIRE(st == BICO_OK);
      size_t na = 0, nl = 0;
      FUZZ_REQUIRE(bico_lora_module_count(again, &na) == BICO_OK);
      FUZZ_REQUIRE(bico_lora_module_count(l, &nl) == BICO_OK);
      FUZZ_REQUIRE(na == nl);
      for (size_t i = 0; i < nl; i++) {
        const char *n1, *n2;
        size_t r1, r2, o1, o2, i1, i2, j;
        double s1, s2;
        FUZZ_REQUIRE(bico_lora_module(l, i, &n1, NULL, &r1, &o1, &i1, NULL,
                                      &s1) == BICO_OK);
        FUZZ_REQUIRE(bico_lora_find_module(again, n1, &j) == BICO_OK);
        FUZZ_REQUIRE(bico_lora_module(again, j, &n2, NULL, &r2, &o2, &i2,
                                      NULL, &s2) == BICO_OK);
        FUZZ_REQUIRE(r1 == r2 && o1 == o2 && i1 == i2);
        FUZZ_REQUIRE(fabs(s1 - s2) <= 1e-9 * fabs(s1));
      }
      bico_lora_free(again);
    }
    bico_lora_free(l);
  }
  bico_ctx_free(ctx);
  unlink(cfg);
  unlink(model);
  snprintf(p1, sizeof p1, "%s/adapter_config.json", saved);
  snprintf(p2, sizeof p2, "%s/adapter_model.safetensors", saved);
  unlink(p1);
  unlink(p2);
  rmdir(saved);
  return 0;
}
