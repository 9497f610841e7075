/* A run's life (struct bico__run, one per bico_transfer_run,
 * bico_transfer_plan or bico_transfer_explain call): made from the
 * handle's options, set up (checks, inputs, models, the solver, the
 * families, the vocabulary map, the plan) and freed with every step's
 * state.  Above the steps it sets up and frees (plan, maps, heads); below
 * the entry points that run it (transfer.c, transfer_assemble.c,
 * transfer_explain.c). */
#include <stdio.h>
#include <string.h>

#include "family.h"
#include "transfer_internal.h"
#include "vocab.h"

/* Opens every input the setup names (the calibration and statistics files
 * only for the BiCo methods, the votes only for GradFix) and checks that no
 * output names one of them. */
static bico_status open_inputs(bico__run *r) {
  int bico = bico__xfer_is_bico(r->method);
  bico_status st = bico__xfer_open_file(r, BICO_FILE_SOURCE_BASE, &r->sb);
  if (st == BICO_OK) st = bico__xfer_open_file(r, BICO_FILE_SOURCE_TUNED, &r->sft);
  if (st == BICO_OK) st = bico__xfer_open_file(r, BICO_FILE_TASK_VECTOR, &r->tv);
  if (st == BICO_OK) st = bico__xfer_open_file(r, BICO_FILE_TARGET_BASE, &r->tb);
  if (st == BICO_OK && bico)
    st = bico__xfer_open_file(r, BICO_FILE_SOURCE_CALIB, &r->sc);
  if (st == BICO_OK && bico)
    st = bico__xfer_open_file(r, BICO_FILE_TARGET_CALIB, &r->tc);
  if (st == BICO_OK && bico)
    st = bico__xfer_open_file(r, BICO_FILE_STATS, &r->stats);
  if (st == BICO_OK && r->method == BICO_METHOD_GRADFIX)
    st = bico__xfer_open_file(r, BICO_FILE_TARGET_VOTES, &r->votes);
  if (st == BICO_OK) st = bico__xfer_check_outputs(r);
  return st;
}

/* The last dimension of calibration tensor `key` of f, or 0. */
static size_t calib_width(const bico_stfile *f, const char *key) {
  size_t i, ndim;
  const size_t *shape;
  if (f == NULL || bico_stfile_find(f, key, &i) != BICO_OK ||
      bico_stfile_tensor_info(f, i, NULL, NULL, &ndim, &shape) != BICO_OK ||
      ndim == 0)
    return 0;
  return shape[ndim - 1];
}

/* Calibration files given the wrong way round (the source's as the
 * target's): the first paired linear module whose input widths differ
 * between the models tells, before any map is solved, so the message can
 * say what happened instead of a width mismatch deep in the run. */
static bico_status check_calib_sides(bico__run *r) {
  if (r->sc == NULL || r->tc == NULL) return BICO_OK;
  int swapped = 0;
  size_t at = BICO__NONE, w_src = 0, w_tgt = 0;
  char ka[512], kb[512];
  for (size_t mi = 0; mi < r->nm; mi++) {
    size_t src = r->mods[mi].src, dout_a, din_a, dout_b, din_b;
    int kind = 0;
    if (src == BICO__NONE ||
        bico_model_module(r->mt, mi, NULL, &kind, NULL, NULL) != BICO_OK ||
        kind != BICO_MODULE_LINEAR ||
        bico_model_module_dims(r->ms, src, &dout_a, &din_a) != BICO_OK ||
        bico_model_module_dims(r->mt, mi, &dout_b, &din_b) != BICO_OK ||
        din_a == din_b)
      continue;
    snprintf(ka, sizeof ka, "%s.input", bico__xfer_mname(r->ms, src));
    snprintf(kb, sizeof kb, "%s.input", bico__xfer_mname(r->mt, mi));
    size_t wa = calib_width(r->sc, ka), wb = calib_width(r->tc, kb);
    size_t sa = calib_width(r->sc, kb), sb = calib_width(r->tc, ka);
    /* The right files hold each side's width under its own name; swapped
     * ones hold the other side's width (under either name). */
    swapped = (wa == din_b || sa == din_b) && (wb == din_a || sb == din_a) &&
              wa != din_a && wb != din_b;
    at = mi;
    w_src = din_a;
    w_tgt = din_b;
    break; /* one module with differing widths decides */
  }
  bico__clear(r->ctx); /* the lookups' misses are not the run's failure */
  if (!swapped) return BICO_OK;
  return bico__fail(r->ctx, BICO_E_SHAPE,
                    "transfer_run: the source calib file %s and the target "
                    "calib file %s look swapped: at module %s the source "
                    "calib file's rows are %zu wide, the target model's "
                    "width, and the target calib file's %zu, the source "
                    "model's; give each model's calibration on its own side",
                    r->t->files[BICO_FILE_SOURCE_CALIB],
                    r->t->files[BICO_FILE_TARGET_CALIB],
                    bico__xfer_mname(r->mt, at), w_tgt, w_src);
}

/* The two models, with their block containers as the options say. */
bico_status bico__xfer_load_models(bico__run *r) {
  const bico_transfer *t = r->t;
  bico_status st = bico_model_from_stfile(r->ctx, r->sb, &r->ms);
  if (st == BICO_OK) st = bico_model_from_stfile(r->ctx, r->tb, &r->mt);
  const char *bs = t->strings[BICO_TRANSFER_SOURCE_BLOCKS]
                       ? t->strings[BICO_TRANSFER_SOURCE_BLOCKS]
                       : t->strings[BICO_TRANSFER_BLOCKS];
  const char *bt = t->strings[BICO_TRANSFER_TARGET_BLOCKS]
                       ? t->strings[BICO_TRANSFER_TARGET_BLOCKS]
                       : t->strings[BICO_TRANSFER_BLOCKS];
  /* Families first: they change how shapes read (GPT-2's Conv1D). */
  bico_model *ms[2] = {r->ms, r->mt};
  const char *paths[2] = {t->files[BICO_FILE_SOURCE_BASE],
                          t->files[BICO_FILE_TARGET_BASE]};
  const char *given[2] = {t->files[BICO_FILE_SOURCE_CONFIG],
                          t->files[BICO_FILE_TARGET_CONFIG]};
  static const char *const WHAT[2] = {"source", "target"};
  for (int k = 0; k < 2 && st == BICO_OK; k++) {
    /* The one read of each side's config.json (--source-config /
     * --target-config, else the one beside a model folder): naming here,
     * attention geometry in bico__xfer_families. */
    char *path = NULL;
    st = bico__family_config(r->ctx, given[k], paths[k], &path);
    if (st == BICO_OK) st = bico__family_read(r->ctx, path, &r->fam[k]);
    if (st == BICO_OK && path != NULL)
      snprintf(r->fam_path[k], sizeof r->fam_path[k], "%s", path);
    else if (st == BICO_OK)
      snprintf(r->fam_path[k], sizeof r->fam_path[k], "the %s's options",
               WHAT[k]);
    bico__free(r->ctx, path);
    if (st != BICO_OK) break;
    r->kind[k] = bico__family_kind(&r->fam[k], ms[k], r->kind_why[k],
                                   sizeof r->kind_why[k]);
    bico__model_set_naming(ms[k], bico__family_naming(r->kind[k]));
  }
  if (st == BICO_OK && bs) st = bico_model_set_blocks(r->ms, bs);
  if (st == BICO_OK && bt) st = bico_model_set_blocks(r->mt, bt);
  if (st == BICO_OK) st = bico_model_blocks(r->ms, NULL, NULL);
  if (st == BICO_OK) st = bico_model_blocks(r->mt, NULL, NULL);
  return st;
}

/* The calling thread's Procrustes solver, configured from the options
 * (the pool's workers copy its settings). */
static bico_status make_solver(bico__run *r) {
  static const int pp[5][2] = {
      {BICO_PROC_RANK_TOL, BICO_TRANSFER_RANK_TOL},
      {BICO_PROC_NULL, BICO_TRANSFER_NULL},
      {BICO_PROC_CENTER, BICO_TRANSFER_CENTER},
      {BICO_PROC_WHITEN, BICO_TRANSFER_WHITEN},
      {BICO_PROC_METHOD, BICO_TRANSFER_PROC_METHOD}};
  bico_status st = bico_procrustes_create(r->ctx, &r->proc);
  for (int i = 0; i < 5 && st == BICO_OK; i++)
    st = bico_procrustes_set_param(r->proc, pp[i][0], r->t->param[pp[i][1]]);
  return st;
}

bico_status bico__xfer_setup(bico__run *r) {
  /* A bridge's options and bases count as set from here on. */
  bico_status st = r->making_bridge ? BICO_OK : bico__bridge_begin(r);
  if (st == BICO_OK) st = bico__xfer_check_setup(r);
  if (st == BICO_OK) st = open_inputs(r);
  if (st == BICO_OK) st = bico__xfer_load_models(r);
  if (st == BICO_OK) st = bico__xfer_mem_check(r);
  if (st == BICO_OK && bico__xfer_is_bico(r->method)) st = make_solver(r);
  if (st == BICO_OK) st = bico__xfer_families(r);
  /* Token rows by token string when both folders have a tokenizer.json
   * and the vocabularies differ (BiCo methods: the maps carry the rest). */
  if (st == BICO_OK && bico__xfer_is_bico(r->method)) {
    st = bico__vocab_map(r->ctx, r->t->files[BICO_FILE_SOURCE_BASE],
                         r->t->files[BICO_FILE_TARGET_BASE], &r->vocab);
    if (st == BICO_OK && r->vocab != NULL)
      bico__xfer_log(r, "bico: the tokenizers differ (%zu source, %zu target "
                        "tokens): token rows matched by string, %zu shared, "
                        "%zu new",
                     r->vocab->n_source, r->vocab->n_target, r->vocab->shared,
                     r->vocab->fresh);
  }
  if (st == BICO_OK) st = bico__xfer_plan(r);
  if (st == BICO_OK) st = bico__xfer_check_pairing(r);
  if (st == BICO_OK && bico__xfer_is_bico(r->method))
    st = check_calib_sides(r);
  if (st == BICO_OK) st = bico__bridge_verify(r);
  return st;
}

void bico__xfer_run_init(bico__run *r, bico_transfer *t) {
  memset(r, 0, sizeof *r);
  r->t = t;
  r->ctx = t->ctx;
  r->method = (int)t->param[BICO_TRANSFER_METHOD];
  r->alpha = (float)t->param[BICO_TRANSFER_ALPHA];
  bico__report_init(&r->rep, t->ctx);
}

void bico__xfer_run_free(bico__run *r) {
  bico_ctx *ctx = r->ctx;
  bico__xfer_pool_stop(r);
  bico__xfer_heads_free(r);
  for (size_t m = 0; m < r->nm && r->mods; m++)
    bico__xfer_free_maps(r, &r->mods[m]);
  bico__free(ctx, r->mods);
  bico__free(ctx, r->owner);
  bico__free(ctx, r->tie_rule);
  bico_stwriter_free(r->w);
  bico_stwriter_free(r->wd);
  bico_procrustes_free(r->proc);
  bico_model_free(r->ms);
  bico_model_free(r->mt);
  bico__vocab_free(ctx, r->vocab);
  bico_stfile *fs[8] = {r->sb, r->sft,  r->tv,    r->tb,
                        r->sc, r->tc, r->stats, r->votes};
  for (int i = 0; i < 8; i++) bico_stfile_free(fs[i]);
  bico__report_free(&r->rep);
  bico__bridge_end(r); /* the handle's options and files as they were */
}

