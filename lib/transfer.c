/* bico_transfer: the whole-model driver every front end calls; this file
 * holds the handle, its options and the run's top level.
 *
 * Data flow: files -> models (bico_model) -> the plan (transfer_plan.c:
 * which target module's maps each tensor takes) -> per target module,
 * maps from calibration or statistics files (transfer_maps.c: bico_xcov,
 * bico_procrustes) -> per target tensor, the update (transfer_update.c:
 * transport, gradfix or baseline kernels) -> the output written tensor by
 * tensor, or handed to the partial-run sink (transfer_output.c).  Maps are
 * computed when the first tensor that needs them comes up and freed after
 * the last, so memory stays near the largest module's needs. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "fileio.h"
#include "lora_internal.h"
#include "family_names.h"
#include "transfer_internal.h"
#include "vocab.h"

const char *const bico__xfer_file_option[BICO__NFILES] = {
    NULL,           "source base",  "source tuned",  "task vector",
    "target base",  "source calib", "target calib",  "stats",
    "target votes", "output",       "delta output",  "report",
    "source adapter", "output adapter", "source config", "target config"};

bico_status bico_transfer_create(bico_ctx *ctx, bico_transfer **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "transfer_create: out is NULL");
  bico_transfer *t = bico__calloc(ctx, 1, sizeof *t);
  if (t == NULL) return BICO_E_NOMEM;
  t->ctx = ctx;
  t->param[BICO_TRANSFER_METHOD] = BICO_METHOD_BICO;
  t->param[BICO_TRANSFER_ALPHA] = 1.0;
  t->param[BICO_TRANSFER_NORM_MAP] = BICO_NORM_MAP_ACT;
  t->param[BICO_TRANSFER_NULL] = BICO_NULL_KEEP;
  t->param[BICO_TRANSFER_RANK_TOL] = 1e-5;
  t->param[BICO_TRANSFER_CENTER] = 0;
  t->param[BICO_TRANSFER_WHITEN] = 0;
  t->param[BICO_TRANSFER_PROC_METHOD] = BICO_PROC_EIG;
  t->param[BICO_TRANSFER_WORKERS] = 1;
  t->param[BICO_TRANSFER_SOLVE_MEMORY] = 0;
  t->param[BICO_TRANSFER_MIN_PAIRED] = 0.5;
  t->param[BICO_TRANSFER_STRUCTURE] = BICO_STRUCTURE_FREE;
  t->param[BICO_TRANSFER_GRADFIX_MODE] = BICO_GRADFIX_MAJORITY;
  t->param[BICO_TRANSFER_MAX_SHARD_SIZE] = 0;
  *out = t;
  return BICO_OK;
}

void bico_transfer_free(bico_transfer *t) {
  if (t == NULL) return;
  bico_ctx *ctx = t->ctx;
  for (int i = 0; i < BICO__NFILES; i++) bico__free(ctx, t->files[i]);
  for (int i = 0; i < BICO__NSTRINGS; i++) bico__free(ctx, t->strings[i]);
  for (size_t i = 0; i < t->nsplits; i++) bico__free(ctx, t->splits[i].suffix);
  bico__free(ctx, t->splits);
  for (size_t i = 0; i < t->nties; i++) {
    bico__free(ctx, t->ties[i].tensor);
    bico__free(ctx, t->ties[i].module);
  }
  bico__free(ctx, t->ties);
  bico__free(ctx, t->select);
  bico__xfer_asm_free(t);
  bico__xfer_plan_clear(t);
  bico__xfer_explain_free(t);
  bico__xfer_mem_free(t);
  bico__free(ctx, t);
}

bico_status bico_transfer_set_file(bico_transfer *t, int which,
                                   const char *path) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  if (which < 1 || which >= BICO__NFILES)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_set_file: unknown file slot %d", which);
  if (path != NULL && path[0] == '\0')
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_set_file: empty path for the %s",
                      bico__xfer_file_option[which]);
  char *p = NULL;
  if (path != NULL && (p = bico__strdup(t->ctx, path)) == NULL) return BICO_E_NOMEM;
  bico__free(t->ctx, t->files[which]);
  t->files[which] = p;
  return BICO_OK;
}

bico_status bico_transfer_get_file(const bico_transfer *t, int which,
                                   const char **path) {
  if (t == NULL || path == NULL) return BICO_E_NULL;
  if (which < 1 || which >= BICO__NFILES)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_get_file: unknown file slot %d", which);
  *path = t->files[which];
  return BICO_OK;
}

/* The option grammar (params.h, lib/params.c): each parameter's accepted
 * set. */
static const bico__param_spec PARAM[BICO__NPARAMS] = {
    [BICO_TRANSFER_METHOD] = {"method", 1, 6, BICO_PARAM_INTEGER},
    /* used as a float */
    [BICO_TRANSFER_ALPHA] = {"alpha", 0, FLT_MAX, BICO_PARAM_LO_OPEN},
    [BICO_TRANSFER_NORM_MAP] = {"norm_map", 0, BICO_NORM_MAP_GRAD,
                                BICO_PARAM_INTEGER},
    [BICO_TRANSFER_NULL] = {"null", 0, BICO_NULL_DROP, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_RANK_TOL] = {"rank_tol", 0, 1, BICO_PARAM_HI_OPEN},
    [BICO_TRANSFER_CENTER] = {"center", 0, 1, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_WHITEN] = {"whiten", 0, 0.5, 0},
    [BICO_TRANSFER_PROC_METHOD] = {"proc_method", BICO_PROC_SVD,
                                   BICO_PROC_POLAR, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_WORKERS] = {"workers", 1, 1024, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_SOLVE_MEMORY] = {"solve_memory", 0, 9007199254740992.0,
                                    BICO_PARAM_INTEGER},
    [BICO_TRANSFER_MIN_PAIRED] = {"min_paired", 0, 1, 0},
    [BICO_TRANSFER_GRADFIX_MODE] = {"gradfix_mode", 0, BICO_GRADFIX_MEAN,
                                    BICO_PARAM_INTEGER},
    [BICO_TRANSFER_MAX_SHARD_SIZE] = {"max_shard_size", 0, 9007199254740992.0,
                                      BICO_PARAM_INTEGER},
    [BICO_TRANSFER_STRUCTURE] = {"structure", 0, BICO_STRUCTURE_FREE,
                                 BICO_PARAM_INTEGER},
    [BICO_TRANSFER_ROPE] = {"rope", 0, BICO_ROPE_NONE, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_HEADS] = {"heads", 0, 1048576, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_KV_HEADS] = {"kv_heads", 0, 1048576, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_HEAD_DIM] = {"head_dim", 0, 1048576, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_ROW_CHUNK] = {"row_chunk", 0, 9007199254740992.0,
                                 BICO_PARAM_INTEGER},
};

bico_status bico_transfer_param_bounds(int param, double *lo, double *hi,
                                       unsigned *flags) {
  return bico__param_bounds(PARAM, BICO__NPARAMS, param, lo, hi, flags);
}

const char *bico_transfer_param_name(int param) {
  return bico__param_name(PARAM, BICO__NPARAMS, param);
}

bico_status bico_transfer_param_from_name(const char *name, int *param) {
  return bico__param_from_name(PARAM, BICO__NPARAMS, name, param);
}

bico_status bico_transfer_set_param(bico_transfer *t, int param,
                                    double value) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  bico_status st = bico__param_set(t->ctx, "transfer_set_param", PARAM,
                                   BICO__NPARAMS, param, value);
  if (st != BICO_OK) return st;
  /* Choices: 0 is the default member (docs/api.md's enum rule). */
  if (param == BICO_TRANSFER_GRADFIX_MODE && value == 0)
    value = BICO_GRADFIX_MAJORITY;
  if (param == BICO_TRANSFER_NULL && value == 0) value = BICO_NULL_KEEP;
  if (param == BICO_TRANSFER_NORM_MAP && value == 0) value = BICO_NORM_MAP_ACT;
  if (param == BICO_TRANSFER_STRUCTURE && value == 0)
    value = BICO_STRUCTURE_FREE;
  t->param[param] = value;
  return BICO_OK;
}

bico_status bico_transfer_get_param(const bico_transfer *t, int param,
                                    double *value) {
  if (t == NULL || value == NULL) return BICO_E_NULL;
  bico_status st = bico__param_get(t->ctx, "transfer_get_param", PARAM,
                                   BICO__NPARAMS, param, value);
  if (st != BICO_OK) return st;
  *value = t->param[param];
  return BICO_OK;
}

bico_status bico_transfer_set_string(bico_transfer *t, int which,
                                     const char *value) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  if (which < 1 || which >= BICO__NSTRINGS)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_set_string: unknown option %d", which);
  if (which == BICO_TRANSFER_SOURCE_RENAME && value != NULL &&
      (strchr(value, '=') == NULL || strcmp(value, "=") == 0))
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_set_string: source rename '%s': expected "
                      "OLD=NEW (a prefix and its replacement, not both empty)",
                      value);
  char *p = NULL;
  if (value != NULL && (p = bico__strdup(t->ctx, value)) == NULL) return BICO_E_NOMEM;
  bico__free(t->ctx, t->strings[which]);
  t->strings[which] = p;
  return BICO_OK;
}

bico_status bico_transfer_add_split(bico_transfer *t, const char *suffix,
                                    size_t k) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  if (suffix == NULL)
    return bico__fail(t->ctx, BICO_E_NULL, "transfer_add_split: suffix is NULL");
  if (suffix[0] == '\0' || k == 0)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_add_split: %s (suffix \"%s\", k = %zu)",
                      k == 0 ? "k must be at least 1" : "empty suffix", suffix,
                      k);
  for (size_t i = 0; i < t->nsplits; i++)
    if (strcmp(t->splits[i].suffix, suffix) == 0) {
      t->splits[i].k = k;
      return BICO_OK;
    }
  bico__split_rec *s = bico__alloc(t->ctx, (t->nsplits + 1) * sizeof *s);
  char *d = bico__strdup(t->ctx, suffix);
  if (s == NULL || d == NULL) {
    bico__free(t->ctx, s);
    bico__free(t->ctx, d);
    return BICO_E_NOMEM;
  }
  if (t->nsplits) memcpy(s, t->splits, t->nsplits * sizeof *s);
  s[t->nsplits].suffix = d;
  s[t->nsplits].k = k;
  bico__free(t->ctx, t->splits);
  t->splits = s;
  t->nsplits++;
  return BICO_OK;
}

bico_status bico_transfer_add_tie(bico_transfer *t, const char *tensor,
                                  const char *module) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  if (tensor == NULL || module == NULL)
    return bico__fail(t->ctx, BICO_E_NULL, "transfer_add_tie: %s is NULL",
                      tensor == NULL ? "tensor" : "module");
  if (tensor[0] == '\0')
    return bico__fail(t->ctx, BICO_E_ARG, "transfer_add_tie: empty tensor name");
  bico__tie_rec *r = bico__alloc(t->ctx, (t->nties + 1) * sizeof *r);
  char *a = bico__strdup(t->ctx, tensor), *b = bico__strdup(t->ctx, module);
  if (r == NULL || a == NULL || b == NULL) {
    bico__free(t->ctx, r);
    bico__free(t->ctx, a);
    bico__free(t->ctx, b);
    return BICO_E_NOMEM;
  }
  if (t->nties) memcpy(r, t->ties, t->nties * sizeof *r);
  r[t->nties].tensor = a;
  r[t->nties].module = b;
  bico__free(t->ctx, t->ties);
  t->ties = r;
  t->nties++;
  return BICO_OK;
}

bico_status bico_transfer_set_log(bico_transfer *t, bico_transfer_log_fn fn,
                                  void *opaque) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  t->log = fn;
  t->log_opaque = opaque;
  return BICO_OK;
}

bico_status bico_transfer_set_progress(bico_transfer *t,
                                       bico_progress_fn fn,
                                       void *opaque) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  t->progress = fn;
  t->progress_opaque = opaque;
  return BICO_OK;
}

bico_status bico_transfer_set_partial(bico_transfer *t,
                                      const unsigned char *select, size_t n,
                                      bico_transfer_sink_fn sink,
                                      void *opaque) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  if (select != NULL && sink == NULL)
    return bico__fail(t->ctx, BICO_E_NULL, "transfer_set_partial: sink is NULL");
  if (select != NULL && n == 0)
    return bico__fail(t->ctx, BICO_E_SHAPE,
                      "transfer_set_partial: n is 0 (the target base's "
                      "tensor count)");
  unsigned char *copy = NULL;
  if (select != NULL) {
    copy = bico__alloc(t->ctx, n);
    if (copy == NULL) return BICO_E_NOMEM;
    memcpy(copy, select, n);
  }
  bico__free(t->ctx, t->select);
  t->select = copy;
  t->nselect = select ? n : 0;
  t->sink = select ? sink : NULL;
  t->sink_opaque = select ? opaque : NULL;
  return BICO_OK;
}

bico_status bico_transfer_counts(const bico_transfer *t, size_t *updated,
                                 size_t *unchanged) {
  if (t == NULL) return BICO_E_NULL;
  if (!t->ran)
    return bico__fail(t->ctx, BICO_E_STATE,
                      "transfer_counts: no successful run yet");
  if (updated) *updated = t->updated;
  if (unchanged) *unchanged = t->unchanged;
  return BICO_OK;
}

/* ---- The LoRA branch (lib/lora_transfer.c) reaches the maps through
 * these callbacks. ---- */

static size_t lora_split(void *opaque, size_t mi) {
  return ((bico__run *)opaque)->mods[mi].k;
}

static bico_status lora_map(void *opaque, size_t mi, int side, size_t block,
                            const float **rm, size_t *da, size_t *db,
                            size_t *rank, int *thin) {
  bico__run *r = opaque;
  bico__modstate *s = &r->mods[mi];
  if (s->src == BICO__NONE)
    return bico__fail(r->ctx, BICO_E_NOTFOUND,
                      "module %s has no partner in the source",
                      bico__xfer_mname(r->mt, mi));
  bico_status st = bico__xfer_need_side(r, mi, side);
  if (st != BICO_OK) return st;
  const bico__map *m = side ? &s->out[block] : &s->in;
  *rm = m->r;
  *da = m->da;
  *db = m->db;
  *rank = m->rank;
  *thin = m->thin;
  return BICO_OK;
}

static bico_status lora_carry(void *opaque, size_t ti, size_t si,
                              float **tau, float *upd, char *reason,
                              size_t cap) {
  bico__run *r = opaque;
  bico__route rt;
  bico__xfer_route(r, ti, &rt);
  bico__tinfo info;
  memset(&info, 0, sizeof info);
  info.kept = -1;
  bico_status st = bico__xfer_carry(r, ti, si, &rt, tau, upd, &info);
  reason[0] = 0;
  if (st == BICO_OK && info.handling == BICO__H_UNCHANGED)
    snprintf(reason, cap, "%s", info.reason[0] ? info.reason : "no map");
  return st;
}

static void lora_route(void *opaque, size_t ti, bico__route *out) {
  bico__xfer_route(opaque, ti, out);
}

static void lora_release(void *opaque, size_t mi) {
  bico__run *r = opaque;
  bico__xfer_free_maps(r, &r->mods[mi]);
}

static void lora_log(void *opaque, const char *line) {
  bico__run *r = opaque;
  if (r->t->log) r->t->log(r->t->log_opaque, line);
}

static bico_status lora_branch(bico__run *r) {
  const char *const *f = (const char *const *)r->t->files;
  if (f[BICO_FILE_LORA_OUTPUT] != NULL &&
      strcmp(f[BICO_FILE_LORA_OUTPUT], f[BICO_FILE_LORA]) == 0)
    return bico__fail(r->ctx, BICO_E_ARG,
                      "transfer_run: the output adapter %s is the source "
                      "adapter",
                      f[BICO_FILE_LORA]);
  bico__lora_hook h;
  memset(&h, 0, sizeof h);
  h.ctx = r->ctx;
  h.ms = r->ms;
  h.mt = r->mt;
  h.sb = r->sb;
  h.tb = r->tb;
  h.votes = r->votes;
  h.votes_path = f[BICO_FILE_TARGET_VOTES];
  h.method = r->method;
  h.alpha = r->alpha;
  h.adapter_dir = f[BICO_FILE_LORA];
  h.target_path = f[BICO_FILE_TARGET_BASE];
  h.out_dir = f[BICO_FILE_LORA_OUTPUT];
  h.out_ckpt = f[BICO_FILE_OUTPUT];
  h.report_path = f[BICO_FILE_REPORT];
  h.opaque = r;
  h.split = lora_split;
  h.map = lora_map;
  h.route = lora_route;
  h.carry = lora_carry;
  h.release = lora_release;
  h.log = lora_log;
  h.progress = r->t->progress;
  h.progress_opaque = r->t->progress_opaque;
  bico_status st = bico__lora_transfer_run(&h);
  if (st == BICO_OK) {
    r->t->updated = h.updated;
    r->t->unchanged = bico_model_tensor_count(r->mt) - h.updated;
  }
  return st;
}


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
  for (int k = 0; k < 2 && st == BICO_OK; k++) {
    r->kind[k] = bico__family_detect(r->ctx, paths[k], ms[k], r->kind_why[k],
                                    sizeof r->kind_why[k]);
    bico__model_set_family(ms[k], r->kind[k]);
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

static void describe_blocks(const bico_model *m, char *buf, size_t cap) {
  const char *p;
  size_t n;
  bico_model_blocks(m, &p, &n);
  if (p)
    snprintf(buf, cap, "%zu blocks %s%s<i>", n, p, p[0] ? "." : "");
  else
    snprintf(buf, cap, "no blocks");
}

bico_status bico__xfer_setup(bico__run *r) {
  bico_status st = bico__xfer_check_setup(r);
  if (st == BICO_OK) st = open_inputs(r);
  if (st == BICO_OK) st = bico__xfer_load_models(r);
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
  return st;
}

static bico_status run_all(bico__run *r) {
  bico_transfer *t = r->t;
  bico_ctx *ctx = r->ctx;
  int bico = bico__xfer_is_bico(r->method);
  bico_status st = bico__xfer_setup(r);
  if (st != BICO_OK) return st;
  int partial = t->select != NULL;
  if (t->files[BICO_FILE_LORA] != NULL) {
    if (partial)
      return bico__fail(ctx, BICO_E_UNSUPPORTED,
                        "transfer_run: a partial run cannot carry a LoRA "
                        "adapter");
    return lora_branch(r);
  }
  size_t nt = bico_model_tensor_count(r->mt);
  if (partial && t->nselect != nt)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "transfer_run: the partial run's selection covers %zu "
                      "tensors, the target base has %zu",
                      t->nselect, nt);
  char bsrc[160], btgt[160];
  describe_blocks(r->ms, bsrc, sizeof bsrc);
  describe_blocks(r->mt, btgt, sizeof btgt);
  bico__xfer_log(r, "bico: method %s, alpha %g; source: %s; target: %s; %zu "
                    "target tensors",
                 bico_method_name(r->method), (double)r->alpha, bsrc, btgt,
                 nt);
  if (bico) st = bico__xfer_pool_start(r, partial ? t->select : NULL);
  if (st == BICO_OK) st = bico__xfer_write_all(r);
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
  for (int i = 0; i < 8; i++) bico_stfile_close(fs[i]);
  bico__report_free(&r->rep);
}

bico_status bico_transfer_run(bico_transfer *t) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  t->ran = 0;
  bico__run r;
  bico__xfer_run_init(&r, t);
  bico_status st = run_all(&r);
  bico__xfer_run_free(&r);
  if (st == BICO_OK) t->ran = 1;
  return st;
}
