/* bico_fit_run: the sequential functional fit over a model the host runs
 * (forward passes through callbacks; docs/fit.md). */
#include <stddef.h>
#include <string.h>

#include "internal.h"

/* The part of bico_fit_runner that 1.0 reads. */
#define RUNNER_1_0 (offsetof(bico_fit_runner, update) + sizeof(void (*)(void)))

/* Whether a runner of `size` bytes holds field f. */
#define HAS(size, f)                                                        \
  ((size) >= offsetof(bico_fit_runner, f) + sizeof(((bico_fit_runner *)0)->f))

/* Fails the run after callback `what` of layer (or block) i returned st:
 * keeps the detail a failed libbico call left in ctx, if any. */
static bico_status callback_failed(bico_ctx *ctx, const char *unit, size_t i,
                                   const char *what, bico_status st) {
  const char *detail = bico_ctx_errmsg(ctx);
  if (detail[0] != '\0')
    return bico__fail(ctx, st, "fit_run: %s %zu: the %s callback failed "
                               "(%s): %s",
                      unit, i, what, bico_strerror(st), detail);
  return bico__fail(ctx, st, "fit_run: %s %zu: the %s callback returned %d "
                             "(%s)",
                    unit, i, what, (int)st, bico_strerror(st));
}

/* One layer of a group: its shape, weights and fit. */
typedef struct member {
  size_t d_in, d_out, ld_w;
  const float *w, *b;
  bico_fit *fit;
} member;

/* Fits layers l .. l+count-1, which read one input: layer() for each, the
 * rows of all of them (before any update), then solve and update in
 * order.  Memory: the group's statistics and one update at a time. */
static bico_status run_group(bico_ctx *ctx, const bico_fit_runner *r,
                             int want_rank, double ridge, size_t l,
                             size_t count) {
  bico_status st = BICO_OK;
  member *m = bico__calloc(ctx, count, sizeof *m);
  bico_fit **fits = bico__calloc(ctx, count, sizeof *fits);
  float *dw = NULL;
  if (m == NULL || fits == NULL) {
    st = BICO_E_NOMEM;
    goto done;
  }
  for (size_t i = 0; i < count; i++) {
    member *q = &m[i];
    bico__clear(ctx);
    st = r->layer(r->opaque, l + i, &q->d_out, &q->d_in, &q->w, &q->ld_w,
                  &q->b);
    if (st != BICO_OK) {
      st = callback_failed(ctx, "layer", l + i, "layer", st);
      goto done;
    }
    if (q->w == NULL) {
      st = bico__fail(ctx, BICO_E_NULL,
                      "fit_run: layer %zu: the layer callback gave no weight",
                      l + i);
      goto done;
    }
    st = bico_fit_create(ctx, q->d_out, q->d_in,
                         q->b != NULL ? BICO_FIT_BIAS : 0, &q->fit);
    if (st == BICO_OK) st = bico_fit_set_param(q->fit, BICO_FIT_RIDGE, ridge);
    /* Fewer outputs than inputs: the right-hand side for this W_B takes
     * d_out x a doubles where K takes a x a (a down projection's K is
     * its largest matrix), and fewer flops. */
    if (st == BICO_OK && q->d_out < q->d_in + (q->b != NULL))
      st = bico__fit_use_theta(q->fit, q->w, q->ld_w, q->b);
    if (st != BICO_OK) {
      st = bico__fail(ctx, st, "fit_run: layer %zu: %s", l + i,
                      bico_ctx_errmsg(ctx));
      goto done;
    }
    fits[i] = q->fit;
  }
  if (r->rows_group != NULL) {
    bico__clear(ctx);
    st = r->rows_group(r->opaque, l, fits, count);
    if (st != BICO_OK) {
      st = callback_failed(ctx, "layer", l, "rows_group", st);
      goto done;
    }
  } else {
    for (size_t i = 0; i < count; i++) {
      bico__clear(ctx);
      st = r->rows(r->opaque, l + i, fits[i]);
      if (st != BICO_OK) {
        st = callback_failed(ctx, "layer", l + i, "rows", st);
        goto done;
      }
    }
  }
  for (size_t i = 0; i < count; i++) {
    member *q = &m[i];
    /* d_out * d_in fits: the fit's statistics of that size exist. */
    dw = bico__alloc(ctx, q->d_out * (q->d_in + 1) * sizeof(float));
    if (dw == NULL) {
      st = BICO_E_NOMEM;
      goto done;
    }
    float *db = q->b != NULL ? dw + q->d_out * q->d_in : NULL;
    size_t rank = BICO_FIT_NO_RANK;
    if (r->solve != NULL) {
      bico__clear(ctx);
      st = r->solve(r->opaque, l + i, q->fit, dw, q->d_in, db,
                    want_rank ? &rank : NULL);
      if (st != BICO_OK) {
        st = callback_failed(ctx, "layer", l + i, "solve", st);
        goto done;
      }
    } else {
      st = bico_fit_solve(q->fit, q->w, q->ld_w, q->b, dw, q->d_in, db,
                          want_rank ? &rank : NULL);
      if (st != BICO_OK) {
        st = bico__fail(ctx, st, "fit_run: layer %zu: %s", l + i,
                        bico_ctx_errmsg(ctx));
        goto done;
      }
    }
    /* The statistics are not needed any more: free them before the
     * host's update (which may run its model). */
    bico_fit_free(q->fit);
    q->fit = NULL;
    bico__clear(ctx);
    st = r->update(r->opaque, l + i, dw, q->d_in, db, rank);
    if (st != BICO_OK) {
      st = callback_failed(ctx, "layer", l + i, "update", st);
      goto done;
    }
    bico__free(ctx, dw);
    dw = NULL;
  }
done:
  bico__free(ctx, dw);
  if (m != NULL)
    for (size_t i = 0; i < count; i++) bico_fit_free(m[i].fit);
  bico__free(ctx, fits);
  bico__free(ctx, m);
  return st;
}

/* Fits layers first .. first+n-1 in groups (r->group, else one by one). */
static bico_status run_layers(bico_ctx *ctx, const bico_fit_runner *r,
                              int want_rank, double ridge, size_t first,
                              size_t n) {
  size_t l = first;
  while (l < first + n) {
    size_t count = 1;
    if (r->group != NULL) {
      bico__clear(ctx);
      bico_status st = r->group(r->opaque, l, &count);
      if (st != BICO_OK) return callback_failed(ctx, "layer", l, "group", st);
      if (count == 0 || count > first + n - l)
        return bico__fail(ctx, BICO_E_ARG,
                          "fit_run: layer %zu: the group callback gave %zu "
                          "layers; a group holds 1 to %zu (the layers left in "
                          "its block)",
                          l, count, first + n - l);
    }
    bico_status st = run_group(ctx, r, want_rank, ridge, l, count);
    if (st != BICO_OK) return st;
    l += count;
  }
  return BICO_OK;
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
                      "bico_fit_runner 1.0: set it to sizeof(bico_fit_runner)",
                      runner->size, (size_t)RUNNER_1_0);
  /* The fields the caller's struct holds; the later ones read as zero. */
  bico_fit_runner r;
  memset(&r, 0, sizeof r);
  memcpy(&r, runner, runner->size < sizeof r ? runner->size : sizeof r);
  /* A runner sized before want_rank was compiled to receive the rank. */
  const int want_rank =
      HAS(runner->size, want_rank) ? runner->want_rank != 0 : 1;

  if (r.blocks > 0 && r.block_begin == NULL)
    return bico__fail(ctx, BICO_E_NULL,
                      "fit_run: runner->blocks = %zu but runner->block_begin "
                      "is NULL",
                      r.blocks);
  if ((r.layers > 0 || r.blocks > 0) &&
      (r.layer == NULL || (r.rows == NULL && r.rows_group == NULL) ||
       r.update == NULL))
    return bico__fail(ctx, BICO_E_NULL, "fit_run: runner->%s is NULL",
                      r.layer == NULL   ? "layer"
                      : r.update == NULL ? "update"
                                         : "rows");
  double lo, hi;
  unsigned flags;
  bico_fit_param_bounds(BICO_FIT_RIDGE, &lo, &hi, &flags);
  if (bico__param_check(ctx, "fit_run", "ridge", ridge, lo, hi, flags) !=
      BICO_OK)
    return BICO_E_ARG;

  bico_status st = BICO_OK;
  if (r.blocks == 0) {
    st = run_layers(ctx, &r, want_rank, ridge, 0, r.layers);
  } else {
    size_t l = 0;
    for (size_t k = 0; k < r.blocks && st == BICO_OK; k++) {
      size_t count = 0;
      bico__clear(ctx);
      st = r.block_begin(r.opaque, k, l, &count);
      if (st != BICO_OK) {
        st = callback_failed(ctx, "block", k, "block_begin", st);
        break;
      }
      st = run_layers(ctx, &r, want_rank, ridge, l, count);
      if (st != BICO_OK) break;
      l += count;
      if (r.block_end != NULL) {
        bico__clear(ctx);
        st = r.block_end(r.opaque, k);
        if (st != BICO_OK)
          st = callback_failed(ctx, "block", k, "block_end", st);
      }
    }
  }
  if (st == BICO_OK) bico__clear(ctx);
  return st;
}
