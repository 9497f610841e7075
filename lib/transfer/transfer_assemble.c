/* Dividing a run among processes: the plan (groups of target tensors that
 * share maps, with costs) and the assembler that writes the output from
 * updates handed over by tensor index.  bico-mpi moves the data between
 * them; everything else is the single-process run's code. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "transfer_internal.h"
#include "vocab.h"

struct bico__asm {
  bico_stfile *tb;
  bico_stwriter *w, *wd;
  size_t nt, done;
  char **entries; /* report entry per tensor, once put */
  size_t count[BICO__H_COUNT];
};

void bico__xfer_plan_clear(bico_transfer *t) {
  bico__free(t->ctx, t->plan.tensors);
  bico__free(t->ctx, t->plan.start);
  bico__free(t->ctx, t->plan.cost);
  t->plan.tensors = t->plan.start = NULL;
  t->plan.cost = NULL;
  t->plan.nt = t->plan.ng = 0;
  t->plan.planned = 0;
}

void bico__xfer_asm_free(bico_transfer *t) {
  struct bico__asm *a = t->as;
  if (a == NULL) return;
  bico_stwriter_free(a->w);
  bico_stwriter_free(a->wd);
  bico_stfile_free(a->tb);
  for (size_t i = 0; a->entries && i < a->nt; i++)
    bico__free(t->ctx, a->entries[i]);
  bico__free(t->ctx, a->entries);
  bico__free(t->ctx, a);
  t->as = NULL;
}

/* Groups and costs from a planned run into t. */
static bico_status make_groups(bico__run *r) {
  bico_transfer *t = r->t;
  bico_ctx *ctx = r->ctx;
  size_t nt = bico__model_ntensors(r->mt), nm = r->nm, ng = 0;
  int bico = bico__xfer_is_bico(r->method);
  size_t *gid = bico__alloc(ctx, (nt ? nt : 1) * sizeof *gid);
  size_t *slot = bico__alloc(ctx, (nm + nt + 1) * sizeof *slot);
  int (*need)[2] = bico__calloc(ctx, nm + 1, sizeof *need);
  t->plan.tensors = bico__alloc(ctx, (nt ? nt : 1) * sizeof *t->plan.tensors);
  t->plan.start = bico__calloc(ctx, nt + 2, sizeof *t->plan.start);
  t->plan.cost = bico__calloc(ctx, nt + 1, sizeof *t->plan.cost);
  bico_status st = BICO_OK;
  if (!gid || !slot || !need || !t->plan.tensors || !t->plan.start ||
      !t->plan.cost)
    st = BICO_E_NOMEM;
  for (size_t i = 0; st == BICO_OK && i < nm + nt; i++) slot[i] = BICO__NONE;
  /* Group ids in order of first appearance. */
  for (size_t ti = 0; st == BICO_OK && ti < nt; ti++) {
    size_t key = nm + ti;
    if (bico && r->owner[ti] != BICO__NONE) {
      bico__route rt;
      bico__xfer_route(r, ti, &rt);
      key = r->owner[ti];
      need[key][0] |= rt.need[0];
      need[key][1] |= rt.need[1];
    }
    if (slot[key] == BICO__NONE) slot[key] = ng++;
    gid[ti] = slot[key];
    size_t ndim;
    const size_t *shape;
    bico_model_tensor(r->mt, ti, NULL, NULL, &ndim, &shape);
    /* reading, transporting, adding and sending its elements */
    t->plan.cost[gid[ti]] += 4.0 * (double)bico__xfer_numel(ndim, shape) + 1;
  }
  for (size_t m = 0; st == BICO_OK && m < nm; m++)
    if (slot[m] != BICO__NONE) t->plan.cost[slot[m]] += bico__xfer_maps_cost(r, m, need[m]);
  /* Tensors by group, ascending within each (counting sort). */
  for (size_t ti = 0; st == BICO_OK && ti < nt; ti++) t->plan.start[gid[ti] + 1]++;
  for (size_t g = 0; st == BICO_OK && g < ng; g++)
    t->plan.start[g + 1] += t->plan.start[g];
  if (st == BICO_OK) {
    size_t *fill = slot; /* reused: next free position per group */
    for (size_t g = 0; g < ng; g++) fill[g] = t->plan.start[g];
    for (size_t ti = 0; ti < nt; ti++) t->plan.tensors[fill[gid[ti]]++] = ti;
    t->plan.nt = nt;
    t->plan.ng = ng;
    t->plan.planned = 1;
  }
  bico__free(ctx, gid);
  bico__free(ctx, slot);
  bico__free(ctx, need);
  return st;
}

bico_status bico_transfer_plan(bico_transfer *t) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  bico__xfer_plan_clear(t);
  bico__run r;
  bico__xfer_run_init(&r, t);
  bico_status st = bico__xfer_setup(&r);
  if (st == BICO_OK && t->files[BICO_FILE_LORA] != NULL)
    st = bico__fail(t->ctx, BICO_E_UNSUPPORTED,
                    "transfer_plan: a LoRA adapter's run is not divided");
  if (st == BICO_OK) st = make_groups(&r);
  bico__xfer_run_free(&r);
  if (st != BICO_OK) bico__xfer_plan_clear(t);
  return st;
}

bico_status bico_transfer_plan_size(const bico_transfer *t, size_t *tensors,
                                    size_t *groups) {
  if (t == NULL) return BICO_E_NULL;
  if (!t->plan.planned)
    return bico__fail(t->ctx, BICO_E_STATE,
                      "transfer_plan_size: no successful plan yet");
  if (tensors) *tensors = t->plan.nt;
  if (groups) *groups = t->plan.ng;
  return BICO_OK;
}

bico_status bico_transfer_plan_group(const bico_transfer *t, size_t g,
                                     double *cost, size_t *count,
                                     const size_t **tensors) {
  if (t == NULL) return BICO_E_NULL;
  if (!t->plan.planned)
    return bico__fail(t->ctx, BICO_E_STATE,
                      "transfer_plan_group: no successful plan yet");
  if (g >= t->plan.ng)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_plan_group: group %zu of %zu", g, t->plan.ng);
  if (cost) *cost = t->plan.cost[g];
  if (count) *count = t->plan.start[g + 1] - t->plan.start[g];
  if (tensors) *tensors = t->plan.tensors + t->plan.start[g];
  return BICO_OK;
}

bico_status bico_transfer_assemble_begin(bico_transfer *t) {
  if (t == NULL) return BICO_E_NULL;
  bico_ctx *ctx = t->ctx;
  bico__clear(ctx);
  bico__xfer_asm_free(t);
  if (!t->plan.planned)
    return bico__fail(ctx, BICO_E_STATE,
                      "transfer_assemble_begin: plan the run first "
                      "(bico_transfer_plan)");
  if (t->files[BICO_FILE_SOURCE_BASE] == NULL ||
      t->files[BICO_FILE_TARGET_BASE] == NULL)
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_assemble_begin: set the source base and the "
                      "target base (the assembler takes no bases from a "
                      "bridge file)");
  struct bico__asm *a = bico__calloc(ctx, 1, sizeof *a);
  if (a == NULL) return BICO_E_NOMEM;
  t->as = a;
  a->nt = t->plan.nt;
  a->entries = bico__calloc(ctx, a->nt ? a->nt : 1, sizeof *a->entries);
  if (a->entries == NULL) return BICO_E_NOMEM;
  bico_status st = bico_stfile_open(ctx, t->files[BICO_FILE_TARGET_BASE], &a->tb);
  if (st == BICO_OK)
    st = bico__xfer_declare(t, a->tb, &a->w, &a->wd);
  if (st != BICO_OK) bico__xfer_asm_free(t);
  return st;
}

bico_status bico_transfer_assemble_put(bico_transfer *t, size_t index,
                                       int handling, const float *update,
                                       size_t count,
                                       const char *report_entry) {
  if (t == NULL) return BICO_E_NULL;
  bico_ctx *ctx = t->ctx;
  bico__clear(ctx);
  struct bico__asm *a = t->as;
  if (a == NULL)
    return bico__fail(ctx, BICO_E_STATE,
                      "transfer_assemble_put: no assembly begun");
  if (report_entry == NULL)
    return bico__fail(ctx, BICO_E_NULL,
                      "transfer_assemble_put: report_entry is NULL");
  if (index >= a->nt || a->entries[index] != NULL || handling < BICO__H_FIRST ||
      handling >= BICO__H_COUNT ||
      (update == NULL) != (handling == BICO__H_UNCHANGED))
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_assemble_put: tensor %zu (of %zu) put twice, "
                      "out of range, or with handling %d %s an update",
                      index, a->nt, handling, update ? "and" : "without");
  bico__xfer_tensor x;
  bico_status st = bico__xfer_locate(ctx, a->tb, index, &x);
  if (st == BICO_OK && update != NULL && count != x.nb)
    st = bico__fail(ctx, BICO_E_SHAPE,
                    "transfer_assemble_put: tensor %s has %zu elements, the "
                    "update %zu",
                    x.name, x.nb, count);
  if (st == BICO_OK && update != NULL)
    st = bico__xfer_check_finite(ctx, update, count, "tensor", x.name);
  double norm;
  if (st == BICO_OK)
    st = bico__xfer_write_one(ctx, a->tb, &x, a->w, a->wd, update, &norm);
  size_t n = strlen(report_entry);
  char *e = st == BICO_OK ? bico__alloc(ctx, n + 1) : NULL;
  if (st == BICO_OK && e == NULL) st = BICO_E_NOMEM;
  if (st != BICO_OK) return st;
  memcpy(e, report_entry, n + 1);
  a->entries[index] = e;
  a->count[handling]++;
  a->done++;
  return BICO_OK;
}

bico_status bico_transfer_assemble_commit(bico_transfer *t) {
  if (t == NULL) return BICO_E_NULL;
  bico_ctx *ctx = t->ctx;
  bico__clear(ctx);
  struct bico__asm *a = t->as;
  if (a == NULL)
    return bico__fail(ctx, BICO_E_STATE,
                      "transfer_assemble_commit: no assembly begun");
  if (a->done != a->nt)
    return bico__fail(ctx, BICO_E_STATE,
                      "transfer_assemble_commit: %zu of %zu tensors put",
                      a->done, a->nt);
  bico__report rep;
  bico__report_init(&rep, ctx);
  int method = (int)t->param[BICO_TRANSFER_METHOD];
  bico__xfer_report_head(&rep, method, (float)t->param[BICO_TRANSFER_ALPHA]);
  for (size_t i = 0; i < a->nt; i++) bico__report_raw(&rep, a->entries[i]);
  /* The vocabulary counts, as a single run's summary has them (the
   * partial runs read the same tokenizers and succeeded). */
  bico__vocab *vocab = NULL;
  if (bico__xfer_is_bico(method) &&
      bico__vocab_map(ctx, t->files[BICO_FILE_SOURCE_BASE],
                      t->files[BICO_FILE_TARGET_BASE], &vocab) != BICO_OK)
    bico__clear(ctx);
  bico__xfer_report_tail_vocab(&rep, a->count, vocab);
  bico__vocab_free(ctx, vocab);
  bico_status st = bico__report_status(&rep);
  if (st == BICO_OK)
    st = bico__xfer_commit(ctx, &rep, t->files[BICO_FILE_REPORT], a->w, a->wd);
  bico__report_free(&rep);
  size_t updated = a->nt - a->count[BICO__H_UNCHANGED];
  if (st == BICO_OK) {
    t->updated = updated;
    t->unchanged = a->count[BICO__H_UNCHANGED];
    t->ran = 1;
  }
  bico__xfer_asm_free(t);
  return st;
}
