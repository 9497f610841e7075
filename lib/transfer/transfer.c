/* bico_transfer: the whole-model driver every front end calls, on top of
 * the transfer files (transfer_internal.h lists them in layer order); this
 * file holds the handle, its options and the run's top level.
 *
 * Data flow: files -> models (bico_model) -> the plan (transfer_plan.c:
 * which target module's maps each tensor takes) -> per target module,
 * maps from calibration or statistics files (transfer_maps.c: bico_xcov,
 * bico_procrustes) -> per target tensor, the update (transfer_update.c:
 * transport, gradfix or baseline kernels) -> the output written tensor by
 * tensor, or handed to the partial-run sink (transfer_output.c).  Maps are
 * computed when the first tensor that needs them comes up and freed after
 * the last, so memory stays near the largest module's needs. */
#include <stdio.h>
#include <string.h>

#include "fileio.h"
#include "transfer_internal.h"

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
  t->param[BICO_TRANSFER_FINGERPRINT] = BICO_FINGERPRINT_SAMPLED;
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
                      bico_transfer_file_name(which));
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

bico_status bico_transfer_set_param(bico_transfer *t, int param,
                                    double value) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  bico_status st = bico__param_set(t->ctx, "transfer_set_param",
                                   bico__xfer_params, BICO__NPARAMS, param,
                                   value);
  if (st != BICO_OK) return st;
  /* 0 asks for the default (a choice's, or config.json's for the
   * structure overrides): with a bridge, the default is the bridge's. */
  int zero_is_default =
      param == BICO_TRANSFER_METHOD || param == BICO_TRANSFER_NORM_MAP ||
      param == BICO_TRANSFER_NULL || param == BICO_TRANSFER_PROC_METHOD ||
      param == BICO_TRANSFER_GRADFIX_MODE || param == BICO_TRANSFER_STRUCTURE ||
      param == BICO_TRANSFER_ROPE || param == BICO_TRANSFER_HEADS ||
      param == BICO_TRANSFER_KV_HEADS || param == BICO_TRANSFER_HEAD_DIM ||
      param == BICO_TRANSFER_FINGERPRINT;
  t->pset[param] = !(zero_is_default && value == 0);
  /* Choices: 0 is the default member (docs/api.md's enum rule), for every
   * choice with a default (ROPE's 0 is itself a setting: from config.json). */
  if (param == BICO_TRANSFER_METHOD && value == 0) value = BICO_METHOD_BICO;
  if (param == BICO_TRANSFER_PROC_METHOD && value == 0) value = BICO_PROC_EIG;
  if (param == BICO_TRANSFER_GRADFIX_MODE && value == 0)
    value = BICO_GRADFIX_MAJORITY;
  if (param == BICO_TRANSFER_NULL && value == 0) value = BICO_NULL_KEEP;
  if (param == BICO_TRANSFER_NORM_MAP && value == 0) value = BICO_NORM_MAP_ACT;
  if (param == BICO_TRANSFER_STRUCTURE && value == 0)
    value = BICO_STRUCTURE_FREE;
  if (param == BICO_TRANSFER_FINGERPRINT && value == 0)
    value = BICO_FINGERPRINT_SAMPLED;
  t->param[param] = value;
  return BICO_OK;
}

bico_status bico_transfer_get_param(const bico_transfer *t, int param,
                                    double *value) {
  if (t == NULL || value == NULL) return BICO_E_NULL;
  bico_status st = bico__param_get(t->ctx, "transfer_get_param",
                                   bico__xfer_params, BICO__NPARAMS, param,
                                   value);
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

/* What a run refuses after its setup and before any computing: a LoRA
 * adapter in a partial run or written over itself, a partial selection of
 * the wrong size (bico_transfer_run and bico_transfer_check alike). */
static bico_status check_run(bico__run *r) {
  const bico_transfer *t = r->t;
  const char *const *f = (const char *const *)t->files;
  if (f[BICO_FILE_LORA] != NULL) {
    if (t->select != NULL)
      return bico__fail(r->ctx, BICO_E_UNSUPPORTED,
                        "transfer_run: a partial run cannot carry a LoRA "
                        "adapter");
    if (f[BICO_FILE_LORA_OUTPUT] != NULL &&
        strcmp(f[BICO_FILE_LORA_OUTPUT], f[BICO_FILE_LORA]) == 0)
      return bico__fail(r->ctx, BICO_E_ARG,
                        "transfer_run: the output adapter %s is the source "
                        "adapter",
                        f[BICO_FILE_LORA]);
    return BICO_OK;
  }
  size_t nt = bico__model_ntensors(r->mt);
  if (t->select != NULL && t->nselect != nt)
    return bico__fail(r->ctx, BICO_E_SHAPE,
                      "transfer_run: the partial run's selection covers %zu "
                      "tensors, the target base has %zu",
                      t->nselect, nt);
  return BICO_OK;
}

/* The LoRA route (lib/transfer/lora_transfer.c): a planned run whose source is an
 * adapter. */
static bico_status lora_branch(bico__run *r) {
  size_t updated = 0;
  bico_status st = bico__lora_transfer_run(r, &updated);
  if (st == BICO_OK) {
    r->t->updated = updated;
    r->t->unchanged = bico__model_ntensors(r->mt) - updated;
  }
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

static bico_status run_all(bico__run *r) {
  bico_transfer *t = r->t;
  int bico = bico__xfer_is_bico(r->method);
  bico_status st = bico__xfer_setup(r);
  if (st == BICO_OK) st = check_run(r);
  if (st != BICO_OK) return st;
  int partial = t->select != NULL;
  if (t->files[BICO_FILE_LORA] != NULL) return lora_branch(r);
  size_t nt = bico__model_ntensors(r->mt);
  char bsrc[160], btgt[160];
  describe_blocks(r->ms, bsrc, sizeof bsrc);
  describe_blocks(r->mt, btgt, sizeof btgt);
  bico__xfer_log(r, "bico: method %s, alpha %g; source: %s; target: %s; %zu "
                    "target tensors",
                 bico_transfer_method_name(r->method), (double)r->alpha, bsrc, btgt,
                 nt);
  if (bico) st = bico__xfer_pool_start(r, partial ? t->select : NULL);
  if (st == BICO_OK) st = bico__xfer_write_all(r);
  return st;
}

bico_status bico_transfer_check(bico_transfer *t, int level) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  if (level < 0 || level > BICO_TRANSFER_CHECK_INPUTS)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_check: unknown level %d", level);
  bico__run r;
  bico__xfer_run_init(&r, t);
  /* A handle with a bridge output is checked as bico_transfer_bridge
   * would run it. */
  int bridge = t->files[BICO_FILE_BRIDGE_OUTPUT] != NULL;
  r.making_bridge = bridge;
  /* The options alone: which files go together, what the method reads;
   * no file opened. */
  bico_status st = bico__xfer_check_setup(&r);
  /* Everything a run checks before its first map (bico__xfer_setup: the
   * inputs opened, outputs against inputs, the models paired, splits and
   * ties resolved), and what the run itself refuses before computing;
   * nothing is written, no map solved. */
  if (st == BICO_OK && level != BICO_TRANSFER_CHECK_OPTIONS) {
    bico__xfer_run_free(&r);
    bico__xfer_run_init(&r, t);
    r.making_bridge = bridge;
    st = bico__xfer_setup(&r);
    if (st == BICO_OK && !bridge) st = check_run(&r);
  }
  bico__xfer_run_free(&r);
  /* The run's own rules say "transfer_run:"; the caller asked for a check */
  const char *msg = bico_ctx_errmsg(t->ctx);
  if (st != BICO_OK && strncmp(msg, "transfer_run: ", 14) == 0) {
    char rest[BICO_ERRMSG_CAP];
    snprintf(rest, sizeof rest, "%s", msg + 14);
    st = bico__fail(t->ctx, st, "transfer_check: %s", rest);
  }
  if (st != BICO_OK) st = bico__xfer_prefix(t->ctx, st, "transfer_check");
  return st;
}

bico_status bico_transfer_bridge(bico_transfer *t) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  bico__run r;
  bico__xfer_run_init(&r, t);
  r.making_bridge = 1;
  bico_status st = bico__xfer_setup(&r);
  if (st == BICO_OK) st = bico__bridge_write(&r);
  bico__xfer_run_free(&r);
  /* The run's steps say "transfer_run:"; the caller made a bridge. */
  const char *msg = bico_ctx_errmsg(t->ctx);
  if (st != BICO_OK && strncmp(msg, "transfer_run: ", 14) == 0) {
    char rest[BICO_ERRMSG_CAP];
    snprintf(rest, sizeof rest, "%s", msg + 14);
    st = bico__fail(t->ctx, st, "transfer_bridge: %s", rest);
  }
  if (st != BICO_OK) st = bico__xfer_prefix(t->ctx, st, "transfer_bridge");
  return st;
}

/* The run's lock on each folder it writes (lib/io/fileio.h), from before
 * its inputs are read to after the old trees are removed; its writers
 * join it.  A partial run writes nothing of its own. */
static bico_status lock_outputs(bico_transfer *t, bico__lock **locks) {
  const char *tb = t->files[BICO_FILE_TARGET_BASE];
  const char *dirs[3] = {t->files[BICO_FILE_OUTPUT],
                         t->files[BICO_FILE_DELTA_OUTPUT],
                         t->files[BICO_FILE_LORA_OUTPUT]};
  bico_status st = BICO_OK;
  for (int k = 0; k < 3 && st == BICO_OK && t->select == NULL; k++)
    if (dirs[k] != NULL &&
        (k == 2 || bico_stwriter_output_is_folder(dirs[k], tb)))
      st = bico__lock_take(t->ctx, dirs[k], 0, &locks[k]);
  return st;
}

bico_status bico_transfer_run(bico_transfer *t) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  t->ran = 0;
  bico__lock *locks[3] = {NULL, NULL, NULL};
  bico_status st = lock_outputs(t, locks);
  if (st == BICO_OK) {
    bico__run r;
    bico__xfer_run_init(&r, t);
    st = run_all(&r);
    bico__xfer_run_free(&r);
  }
  for (int k = 0; k < 3; k++) bico__lock_release(locks[k]);
  if (st == BICO_OK) t->ran = 1;
  else st = bico__xfer_prefix(t->ctx, st, "transfer_run");
  return st;
}
