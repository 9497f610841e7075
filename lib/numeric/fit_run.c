/* bico_fit_run: the sequential functional fit over a model the host runs
 * (forward passes through callbacks; docs/fit.md). */
#include <stddef.h>
#include <string.h>

#include "internal.h"

/* The part of bico_fit_runner that 1.0 reads. */
#define RUNNER_1_0 (offsetof(bico_fit_runner, update) + sizeof(void (*)(void)))

/* Whether the runner (of the caller's size) holds field f. */
#define HAS(r, f) \
  ((r)->size >= offsetof(bico_fit_runner, f) + sizeof((r)->f))

/* Fails the run after callback `what` of layer l returned st: keeps the
 * detail a failed libbico call left in ctx, if any. */
static bico_status callback_failed(bico_ctx *ctx, size_t l, const char *what,
                                   bico_status st) {
  const char *detail = bico_ctx_errmsg(ctx);
  if (detail[0] != '\0')
    return bico__fail(ctx, st, "fit_run: layer %zu: the %s callback failed "
                               "(%s): %s",
                      l, what, bico_strerror(st), detail);
  return bico__fail(ctx, st, "fit_run: layer %zu: the %s callback returned %d "
                             "(%s)",
                    l, what, (int)st, bico_strerror(st));
}

bico_status bico_fit_run(bico_ctx *ctx, const bico_fit_runner *runner,
                         double ridge) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (runner == NULL)
    return bico__fail(ctx, BICO_E_NULL, "fit_run: runner is NULL");
  if (runner->size < RUNNER_1_0)
    return bico__fail(ctx, BICO_E_ARG,
                      "fit_run: runner->size = %zu is below the %zu bytes of "
                      "bico_fit_runner 1.0 (set it to sizeof(bico_fit_runner))",
                      runner->size, (size_t)RUNNER_1_0);
  if (runner->layers > 0 &&
      (runner->layer == NULL || runner->rows == NULL || runner->update == NULL))
    return bico__fail(ctx, BICO_E_NULL, "fit_run: runner->%s is NULL",
                      runner->layer == NULL  ? "layer"
                      : runner->rows == NULL ? "rows"
                                             : "update");
  double lo, hi;
  unsigned flags;
  bico_fit_param_bounds(BICO_FIT_RIDGE, &lo, &hi, &flags);
  if (bico__param_check(ctx, "fit_run", "ridge", ridge, lo, hi, flags) !=
      BICO_OK)
    return BICO_E_ARG;

  /* A runner sized before want_rank was compiled to receive the rank. */
  const int want_rank = HAS(runner, want_rank) ? runner->want_rank != 0 : 1;

  bico_status st = BICO_OK;
  bico_fit *fit = NULL;
  float *dw = NULL;
  for (size_t l = 0; l < runner->layers; l++) {
    size_t d_in = 0, d_out = 0, ld_w = 0;
    const float *w = NULL, *b = NULL;
    bico__clear(ctx);
    st = runner->layer(runner->opaque, l, &d_in, &d_out, &w, &ld_w, &b);
    if (st != BICO_OK) {
      st = callback_failed(ctx, l, "layer", st);
      break;
    }
    if (w == NULL) {
      st = bico__fail(ctx, BICO_E_NULL,
                      "fit_run: layer %zu: the layer callback gave no weight",
                      l);
      break;
    }
    st = bico_fit_create(ctx, d_in, d_out, b != NULL ? BICO_FIT_BIAS : 0, &fit);
    if (st == BICO_OK) st = bico_fit_set_param(fit, BICO_FIT_RIDGE, ridge);
    if (st != BICO_OK) {
      st = bico__fail(ctx, st, "fit_run: layer %zu: %s", l,
                      bico_ctx_errmsg(ctx));
      break;
    }
    /* d_out * d_in fits: the fit's statistics of that size exist. */
    dw = bico__alloc(ctx, d_out * (d_in + 1) * sizeof(float));
    if (dw == NULL) {
      st = BICO_E_NOMEM;
      break;
    }
    float *db = b != NULL ? dw + d_out * d_in : NULL;
    bico__clear(ctx);
    st = runner->rows(runner->opaque, l, fit);
    if (st != BICO_OK) {
      st = callback_failed(ctx, l, "rows", st);
      break;
    }
    size_t rank = BICO_FIT_NO_RANK;
    st = bico_fit_solve(fit, w, ld_w, b, dw, d_in, db,
                        want_rank ? &rank : NULL);
    if (st != BICO_OK) {
      st = bico__fail(ctx, st, "fit_run: layer %zu: %s", l,
                      bico_ctx_errmsg(ctx));
      break;
    }
    bico__clear(ctx);
    st = runner->update(runner->opaque, l, dw, d_in, db, rank);
    if (st != BICO_OK) {
      st = callback_failed(ctx, l, "update", st);
      break;
    }
    bico__free(ctx, dw);
    dw = NULL;
    bico_fit_free(fit);
    fit = NULL;
  }
  bico__free(ctx, dw);
  bico_fit_free(fit);
  if (st == BICO_OK) bico__clear(ctx);
  return st;
}
