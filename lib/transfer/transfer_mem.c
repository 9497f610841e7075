/* In-memory statistics and votes lent to a transfer handle by its host
 * (bico_transfer_set_xcov, bico_transfer_set_votes).
 *
 * Why lend accumulators rather than copy them or go through a temporary
 * file: a binding that collected statistics in memory (Python's
 * Collector) already holds bico_xcov handles, with the sums and Gram
 * matrices that centering and whitening need, which a statistics file
 * cannot carry; copying a d_a x d_b double per module side would double
 * the peak memory of a run that is bounded by exactly those matrices.  So
 * the handle keeps pointers, and the caller keeps the accumulators alive
 * and unchanged until the handle is freed (transfer.h says so). */
#include <stdio.h>
#include <string.h>

#include "fileio.h"
#include "transfer_internal.h"

typedef struct mem_xcov {
  char *module;
  int side; /* BICO_SIDE_IN or BICO_SIDE_OUT */
  size_t n;
  const bico_xcov **x;
} mem_xcov;

typedef struct mem_votes {
  char *tensor;
  const bico_votes *v;
} mem_votes;

struct bico__mem {
  mem_xcov *xs;
  size_t nx, capx;
  mem_votes *vs;
  size_t nv, capv;
};

void bico__xfer_mem_free(bico_transfer *t) {
  struct bico__mem *m = t->mem;
  if (m == NULL) return;
  for (size_t i = 0; i < m->nx; i++) {
    bico__free(t->ctx, m->xs[i].module);
    bico__free(t->ctx, m->xs[i].x);
  }
  for (size_t i = 0; i < m->nv; i++) bico__free(t->ctx, m->vs[i].tensor);
  bico__free(t->ctx, m->xs);
  bico__free(t->ctx, m->vs);
  bico__free(t->ctx, m);
  t->mem = NULL;
}

static bico_status mem_get(bico_transfer *t) {
  if (t->mem == NULL) t->mem = bico__calloc(t->ctx, 1, sizeof *t->mem);
  return t->mem ? BICO_OK : BICO_E_NOMEM;
}

/* Room for one more element in *arr (of *cap, `size` bytes each). */
static bico_status grow(bico_ctx *ctx, void **arr, size_t n, size_t *cap,
                        size_t size) {
  if (n < *cap) return BICO_OK;
  size_t nc = *cap ? 2 * *cap : 8;
  void *p = bico__calloc(ctx, nc, size);
  if (p == NULL) return BICO_E_NOMEM;
  if (n) memcpy(p, *arr, n * size);
  bico__free(ctx, *arr);
  *arr = p;
  *cap = nc;
  return BICO_OK;
}

static size_t find_xcov(const struct bico__mem *m, const char *module,
                        int side) {
  for (size_t i = 0; m && i < m->nx; i++)
    if (m->xs[i].side == side && strcmp(m->xs[i].module, module) == 0)
      return i;
  return BICO__NONE;
}

static size_t find_votes(const struct bico__mem *m, const char *tensor) {
  for (size_t i = 0; m && i < m->nv; i++)
    if (strcmp(m->vs[i].tensor, tensor) == 0) return i;
  return BICO__NONE;
}

bico_status bico_transfer_set_xcov(bico_transfer *t, const char *module,
                                   int side, bico_xcov *const *blocks,
                                   size_t nblocks) {
  static const char fn[] = "transfer_set_xcov";
  if (t == NULL) return BICO_E_NULL;
  bico_ctx *ctx = t->ctx;
  bico__clear(ctx);
  if (module == NULL || (nblocks > 0 && blocks == NULL))
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      module == NULL ? "module" : "blocks");
  if (module[0] == '\0')
    return bico__fail(ctx, BICO_E_ARG, "%s: empty module name", fn);
  if (bico_transfer_side_name(side) == NULL)
    return bico__fail(ctx, BICO_E_ARG,
                      "%s: side %d is neither BICO_SIDE_IN (1) nor "
                      "BICO_SIDE_OUT (2)",
                      fn, side);
  if (side == BICO_SIDE_IN && nblocks > 1)
    return bico__fail(ctx, BICO_E_ARG,
                      "%s: module %s: the input side has one map, not %zu "
                      "blocks",
                      fn, module, nblocks);
  for (size_t b = 0; b < nblocks; b++)
    if (blocks[b] == NULL)
      return bico__fail(ctx, BICO_E_NULL, "%s: module %s: blocks[%zu] is "
                        "NULL", fn, module, b);
  bico_status st = mem_get(t);
  if (st != BICO_OK) return st;
  struct bico__mem *m = t->mem;
  size_t i = find_xcov(m, module, side);
  const bico_xcov **copy = NULL;
  if (nblocks > 0) {
    copy = bico__calloc(ctx, nblocks, sizeof *copy);
    if (copy == NULL) return BICO_E_NOMEM;
    memcpy(copy, blocks, nblocks * sizeof *copy);
  }
  if (i != BICO__NONE) { /* replace or withdraw */
    bico__free(ctx, m->xs[i].x);
    if (nblocks == 0) {
      bico__free(ctx, m->xs[i].module);
      m->xs[i] = m->xs[--m->nx];
      return BICO_OK;
    }
    m->xs[i].x = copy;
    m->xs[i].n = nblocks;
    return BICO_OK;
  }
  if (nblocks == 0) return BICO_OK;
  char *name = bico__strdup(ctx, module);
  st = name ? grow(ctx, (void **)&m->xs, m->nx, &m->capx, sizeof *m->xs)
            : BICO_E_NOMEM;
  if (st != BICO_OK) {
    bico__free(ctx, name);
    bico__free(ctx, copy);
    return st;
  }
  m->xs[m->nx++] = (mem_xcov){name, side, nblocks, copy};
  return BICO_OK;
}

bico_status bico_transfer_set_votes(bico_transfer *t, const char *tensor,
                                    const bico_votes *votes) {
  static const char fn[] = "transfer_set_votes";
  if (t == NULL) return BICO_E_NULL;
  bico_ctx *ctx = t->ctx;
  bico__clear(ctx);
  if (tensor == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: tensor is NULL", fn);
  if (tensor[0] == '\0')
    return bico__fail(ctx, BICO_E_ARG, "%s: empty tensor name", fn);
  bico_status st = mem_get(t);
  if (st != BICO_OK) return st;
  struct bico__mem *m = t->mem;
  size_t i = find_votes(m, tensor);
  if (i != BICO__NONE) {
    if (votes != NULL) {
      m->vs[i].v = votes;
    } else {
      bico__free(ctx, m->vs[i].tensor);
      m->vs[i] = m->vs[--m->nv];
    }
    return BICO_OK;
  }
  if (votes == NULL) return BICO_OK;
  char *name = bico__strdup(ctx, tensor);
  st = name ? grow(ctx, (void **)&m->vs, m->nv, &m->capv, sizeof *m->vs)
            : BICO_E_NOMEM;
  if (st != BICO_OK) {
    bico__free(ctx, name);
    return st;
  }
  m->vs[m->nv++] = (mem_votes){name, votes};
  return BICO_OK;
}

size_t bico__xfer_mem_nxcov(const bico_transfer *t) {
  return t->mem ? t->mem->nx : 0;
}

size_t bico__xfer_mem_nvotes(const bico_transfer *t) {
  return t->mem ? t->mem->nv : 0;
}

size_t bico__xfer_mem_xcov(const bico_transfer *t, const char *module,
                           int side, const bico_xcov *const **blocks) {
  size_t i = find_xcov(t->mem, module, side);
  if (i == BICO__NONE) return 0;
  *blocks = t->mem->xs[i].x;
  return t->mem->xs[i].n;
}

const bico_votes *bico__xfer_mem_votes(const bico_transfer *t,
                                       const char *tensor) {
  size_t i = find_votes(t->mem, tensor);
  return i == BICO__NONE ? NULL : t->mem->vs[i].v;
}

/* A lent name that is a tensor of the target ("M.weight") rather than its
 * module: the hint for the message (buf gets "" when it is not). */
static void tensor_hint(const bico_model *mt, const char *name, char *buf,
                        size_t cap) {
  size_t ti, mi;
  const char *mod;
  buf[0] = '\0';
  if (bico_model_find_tensor(mt, name, &ti) == BICO_OK &&
      bico_model_tensor_module(mt, ti, &mi, NULL) == BICO_OK &&
      bico_model_module(mt, mi, &mod, NULL, NULL, NULL) == BICO_OK)
    snprintf(buf, cap, " (%s is a tensor: lend its module's statistics as "
                       "\"%s\")", name, mod);
}

/* What a run refuses in the lent statistics and votes before its first
 * map (bico_transfer_check at the inputs level and every run): a name
 * that is no module (no tensor) of the target base, which the run would
 * otherwise never look up, and an accumulator without rows (no sample
 * reached it: its map would be an arbitrary completion, every layer
 * "dead").  Runs after the models are loaded. */
bico_status bico__xfer_mem_check(bico__run *r) {
  const struct bico__mem *m = r->t->mem;
  bico_ctx *ctx = r->ctx;
  const char *tb = r->t->files[BICO_FILE_TARGET_BASE];
  char hint[320];
  for (size_t i = 0; m && i < m->nx; i++) {
    const mem_xcov *x = &m->xs[i];
    const char *side = bico_transfer_side_name(x->side);
    size_t mi;
    if (bico_model_find_module(r->mt, x->module, &mi) != BICO_OK) {
      tensor_hint(r->mt, x->module, hint, sizeof hint);
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "transfer_run: statistics lent for module %s (side "
                        "%s) name no module of the target base %s%s",
                        x->module, side, tb, hint);
    }
    for (size_t b = 0; b < x->n; b++) {
      uint64_t rows = 0;
      bico_xcov_info(x->x[b], NULL, NULL, &rows, NULL);
      char block[40] = "";
      if (x->n > 1) snprintf(block, sizeof block, ", block %zu", b);
      if (rows == 0)
        return bico__fail(ctx, BICO_E_STATE,
                          "transfer_run: statistics lent for module %s (side "
                          "%s%s) hold no rows: no sample reached the "
                          "accumulator, and its map would be arbitrary",
                          x->module, side, block);
    }
  }
  for (size_t i = 0; m && i < m->nv; i++) {
    const mem_votes *v = &m->vs[i];
    size_t ti;
    uint64_t samples = 0;
    if (bico_model_find_tensor(r->mt, v->tensor, &ti) != BICO_OK)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "transfer_run: votes lent for tensor %s name no "
                        "tensor of the target base %s",
                        v->tensor, tb);
    bico_votes_info(v->v, NULL, &samples, NULL);
    if (samples == 0)
      return bico__fail(ctx, BICO_E_STATE,
                        "transfer_run: votes lent for tensor %s hold no "
                        "samples",
                        v->tensor);
  }
  return BICO_OK;
}
