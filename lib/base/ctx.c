/* bico_ctx: allocator, BLIS thread count, last-error message. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <blis.h>

#include "internal.h"

static void *default_alloc(void *opaque, size_t size) {
  (void)opaque;
  return malloc(size);
}

static void default_free(void *opaque, void *p) {
  (void)opaque;
  free(p);
}

bico_status bico_ctx_create_with_allocator(bico_ctx **out, bico_alloc_fn alloc,
                                           bico_free_fn release,
                                           void *opaque) {
  if (out != NULL) *out = NULL;
  if (out == NULL || alloc == NULL || release == NULL) return BICO_E_NULL;
  bico_ctx *ctx = alloc(opaque, sizeof *ctx);
  if (ctx == NULL) return BICO_E_NOMEM;
  memset(ctx, 0, sizeof *ctx);
  ctx->alloc = alloc;
  ctx->release = release;
  ctx->opaque = opaque;
  ctx->threads = 1;
  *out = ctx;
  return BICO_OK;
}

bico_status bico_ctx_create(bico_ctx **out) {
  return bico_ctx_create_with_allocator(out, default_alloc, default_free, NULL);
}

void bico_ctx_free(bico_ctx *ctx) {
  if (ctx == NULL) return;
  ctx->release(ctx->opaque, ctx);
}

/* The option grammar (params.h, lib/base/params.c). */
static const bico__param_spec CPARAM[] = {
    [BICO_CTX_THREADS] = {"threads", 1, 1024, BICO_PARAM_INTEGER},
    [BICO_CTX_FOLDER_WAIT] = {"folder_wait", 0, 1e9, 0},
};

bico_status bico_ctx_param_bounds(int param, double *lo, double *hi,
                                  unsigned *flags) {
  return bico__param_bounds(CPARAM, BICO__NSPEC(CPARAM), param, lo, hi, flags);
}

const char *bico_ctx_param_name(int param) {
  return bico__param_name(CPARAM, BICO__NSPEC(CPARAM), param);
}

bico_status bico_ctx_param_from_name(const char *name, int *param) {
  return bico__param_from_name(CPARAM, BICO__NSPEC(CPARAM), name, param);
}

bico_status bico_ctx_set_param(bico_ctx *ctx, int param, double value) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  bico_status st = bico__param_set(ctx, "ctx_set_param", CPARAM,
                                   BICO__NSPEC(CPARAM), param, value);
  if (st != BICO_OK) return st;
  if (param == BICO_CTX_THREADS) ctx->threads = (long)value;
  else ctx->folder_wait = value;
  return BICO_OK;
}

/* A query: records its own failures, leaves the last error alone on
 * success (ctx.h). */
bico_status bico_ctx_get_param(const bico_ctx *ctx, int param,
                               double *value) {
  if (ctx == NULL) return BICO_E_NULL;
  bico_status st = bico__param_get(ctx, "ctx_get_param", CPARAM,
                                   BICO__NSPEC(CPARAM), param, value);
  if (st != BICO_OK) return st;
  *value = param == BICO_CTX_THREADS ? (double)ctx->threads : ctx->folder_wait;
  return BICO_OK;
}

const char *bico_ctx_errmsg(const bico_ctx *ctx) {
  if (ctx == NULL) return "no context (NULL)";
  return ctx->errmsg;
}

bico_status bico_ctx_errcode(const bico_ctx *ctx) {
  if (ctx == NULL) return BICO_E_NULL;
  return ctx->errcode;
}

/* ---- internal helpers ---- */

void *bico__alloc(bico_ctx *ctx, size_t size) {
  void *p = ctx->alloc(ctx->opaque, size ? size : 1);
  if (p == NULL)
    bico__fail(ctx, BICO_E_NOMEM, "out of memory allocating %zu bytes", size);
  return p;
}

void *bico__calloc(bico_ctx *ctx, size_t count, size_t size) {
  size_t bytes;
  if (bico__mul(count, size, &bytes)) {
    bico__fail(ctx, BICO_E_NOMEM, "allocation of %zu x %zu bytes overflows",
               count, size);
    return NULL;
  }
  void *p = bico__alloc(ctx, bytes);
  if (p != NULL) memset(p, 0, bytes);
  return p;
}

void bico__free(bico_ctx *ctx, void *p) {
  if (p != NULL) ctx->release(ctx->opaque, p);
}

void *bico__grow(bico_ctx *ctx, void *p, size_t count, size_t *cap,
                 size_t first, size_t elem) {
  if (count < *cap) return p;
  size_t ncap = *cap ? *cap * 2 : first, bytes;
  if (ncap < *cap || bico__mul(ncap, elem, &bytes)) {
    bico__fail(ctx, BICO_E_NOMEM, "allocation of %zu x %zu bytes overflows",
               ncap, elem);
    return NULL;
  }
  void *q = bico__alloc(ctx, bytes);
  if (q == NULL) return NULL;
  if (count) memcpy(q, p, count * elem);
  bico__free(ctx, p);
  *cap = ncap;
  return q;
}

bico_status bico__check_finite_f32(bico_ctx *ctx, const char *fn,
                                   const char *what, const float *x,
                                   size_t rows, size_t cols, size_t ld) {
  for (size_t i = 0; i < rows; i++) {
    const float *row = x + i * ld;
    for (size_t j = 0; j < cols; j++)
      if (!isfinite(row[j]))
        return bico__fail(ctx, BICO_E_NONFINITE,
                          "%s: %s holds %s at row %zu, column %zu", fn, what,
                          isnan(row[j]) ? "NaN" : "Inf", i, j);
  }
  return BICO_OK;
}

bico_status bico__check_finite_f64(bico_ctx *ctx, const char *fn,
                                   const char *what, const double *x,
                                   size_t rows, size_t cols, size_t ld) {
  for (size_t i = 0; i < rows; i++) {
    const double *row = x + i * ld;
    for (size_t j = 0; j < cols; j++)
      if (!isfinite(row[j]))
        return bico__fail(ctx, BICO_E_NONFINITE,
                          "%s: %s holds %s at row %zu, column %zu", fn, what,
                          isnan(row[j]) ? "NaN" : "Inf", i, j);
  }
  return BICO_OK;
}

bico_status bico__check_finite_bytes(bico_ctx *ctx, const char *fn,
                                     const unsigned char *q, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const double x = bico__get_f64(q + 8 * i);
    if (!isfinite(x))
      return bico__fail(ctx, BICO_E_FORMAT, "%s: value %zu of the payload is %s",
                        fn, i, isnan(x) ? "NaN" : "Inf");
  }
  return BICO_OK;
}

/* BLIS takes both strides of every operand, so a row-major matrix (row
 * stride ld, column stride 1) needs no copy or transpose; op(A) is expressed
 * through the trans flag. */
static void runtime_for(const bico_ctx *ctx, rntm_t *rntm) {
  bli_rntm_init(rntm);
  bli_rntm_set_num_threads((dim_t)ctx->threads, rntm);
}

void bico__sgemm(const bico_ctx *ctx, int ta, int tb, size_t m, size_t n,
                 size_t k, float alpha, const float *a, size_t lda,
                 const float *b, size_t ldb, float beta, float *c,
                 size_t ldc) {
  if (m == 0 || n == 0) return;
  rntm_t rntm;
  runtime_for(ctx, &rntm);
  bli_sgemm_ex(ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
               tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, (dim_t)m, (dim_t)n,
               (dim_t)k, &alpha, (float *)a, (inc_t)lda, 1, (float *)b,
               (inc_t)ldb, 1, &beta, c, (inc_t)ldc, 1, NULL, &rntm);
}

void bico__dgemm(const bico_ctx *ctx, int ta, int tb, size_t m, size_t n,
                 size_t k, double alpha, const double *a, size_t lda,
                 const double *b, size_t ldb, double beta, double *c,
                 size_t ldc) {
  if (m == 0 || n == 0) return;
  rntm_t rntm;
  runtime_for(ctx, &rntm);
  bli_dgemm_ex(ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
               tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, (dim_t)m, (dim_t)n,
               (dim_t)k, &alpha, (double *)a, (inc_t)lda, 1, (double *)b,
               (inc_t)ldb, 1, &beta, c, (inc_t)ldc, 1, NULL, &rntm);
}
