/* The transfer driver's output: per tensor, the report entry and either
 * the written tensor (whole runs: output and delta output, committed
 * last with the report) or the partial-run sink. */
#include <time.h>
#include <unistd.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "st_internal.h"
#include "transfer_internal.h"
#include "vocab.h"

bico_status bico__xfer_report_tensor(bico__report *rep, const bico_model *mt,
                                     size_t ti, const bico__tinfo *info) {
  const char *name;
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(mt, ti, &name, NULL, &ndim, &shape);
  bico__report_begin_object(rep);
  bico__report_key_string(rep, "name", name);
  bico__report_key_string(rep, "handling", bico_transfer_handling_name(info->handling));
  bico__report_key(rep, "shape");
  bico__report_begin_array(rep);
  for (size_t d = 0; d < ndim; d++) bico__report_number(rep, (double)shape[d]);
  bico__report_end_array(rep);
  if (info->source)
    bico__report_key_string(rep, "source", info->source);
  else
    bico__report_key_null(rep, "source");
  bico__report_key_number(rep, "update_norm", info->norm);
  bico__report_key(rep, "maps");
  bico__report_begin_object(rep);
  for (int i = 0; i < 2; i++)
    if (info->maps[i]) {
      bico__report_key(rep, info->map_names[i]);
      bico__report_begin_object(rep);
      bico__report_key_number(rep, "rank", (double)info->maps[i]->rank);
      bico__report_key_string(rep, "solve", info->maps[i]->thin ? "thin" : "full");
      bico__report_key(rep, "shape");
      bico__report_begin_array(rep);
      bico__report_number(rep, (double)info->maps[i]->da);
      bico__report_number(rep, (double)info->maps[i]->db);
      bico__report_end_array(rep);
      bico__report_end_object(rep);
    }
  if (info->nsplit) {
    bico__report_key(rep, "out_blocks");
    bico__report_begin_array(rep);
    for (size_t b = 0; b < info->nsplit; b++) {
      bico__report_begin_object(rep);
      bico__report_key_number(rep, "rank", (double)info->split_maps[b].rank);
      bico__report_key_string(rep, "solve", info->split_maps[b].thin ? "thin" : "full");
      bico__report_key(rep, "shape");
      bico__report_begin_array(rep);
      bico__report_number(rep, (double)info->split_maps[b].da);
      bico__report_number(rep, (double)info->split_maps[b].db);
      bico__report_end_array(rep);
      bico__report_end_object(rep);
    }
    bico__report_end_array(rep);
  }
  bico__report_end_object(rep);
  if (info->kept >= 0) bico__report_key_number(rep, "kept_fraction", info->kept);
  if (info->vocab) {
    bico__report_key(rep, "vocab");
    bico__report_begin_object(rep);
    bico__report_key_number(rep, "shared", (double)info->vocab_shared);
    bico__report_key_number(rep, "new", (double)info->vocab_new);
    bico__report_end_object(rep);
  }
  if (info->reason[0]) bico__report_key_string(rep, "reason", info->reason);
  bico__report_end_object(rep);
  return bico__report_status(rep);
}

static bico_status nonfinite(bico_ctx *ctx, const char *what,
                             const char *name, size_t e, double x) {
  return bico__fail(ctx, BICO_E_NONFINITE,
                    "%s %s: element %zu of the result is %g (does alpha "
                    "times the task vector overflow float32?); nothing was "
                    "written",
                    what, name, e, x);
}

bico_status bico__xfer_check_finite(bico_ctx *ctx, const float *v, size_t n,
                                    const char *what, const char *name) {
  for (size_t e = 0; e < n; e++)
    if (!isfinite(v[e])) return nonfinite(ctx, what, name, e, (double)v[e]);
  return BICO_OK;
}

bico_status bico__xfer_check_finite_f64(bico_ctx *ctx, const double *v,
                                        size_t n, const char *what,
                                        const char *name) {
  for (size_t e = 0; e < n; e++)
    if (!isfinite(v[e])) return nonfinite(ctx, what, name, e, v[e]);
  return BICO_OK;
}


bico_status bico__xfer_locate(bico_ctx *ctx, const bico_stfile *tb, size_t i,
                              bico__xfer_tensor *x) {
  (void)ctx;
  bico_status st =
      bico_stfile_tensor_info(tb, i, &x->name, &x->dtype, &x->ndim, &x->shape);
  if (st != BICO_OK) return st;
  x->fi = i;
  x->nb = bico__xfer_numel(x->ndim, x->shape);
  x->fl = bico_dtype_is_float(x->dtype);
  return BICO_OK;
}

/* Target tensor ti of the run, found by its name. */
static bico_status locate(bico__run *r, size_t ti, bico__xfer_tensor *x) {
  size_t fi;
  bico_status st = bico_stfile_find(r->tb, bico__xfer_tname(r->mt, ti), &fi);
  return st == BICO_OK ? bico__xfer_locate(r->ctx, r->tb, fi, x) : st;
}

/* The output keeps the target's "__metadata__" ({"format": "pt"} and the
 * like: loaders read it) and says where it came from: "bico.*" keys with
 * the library version, method, alpha and the input files as given. */
static bico_status provenance(const bico_transfer *t, const bico_stfile *tb,
                              bico_stwriter *w) {
  const char *lora = t->files[BICO_FILE_LORA];
  bico_status st = bico__stwriter_provenance(
      w, tb, bico_transfer_method_name((int)t->param[BICO_TRANSFER_METHOD]),
      t->param[BICO_TRANSFER_ALPHA]);
  static const struct { int file; const char *key; } FILES[] = {
      {BICO_FILE_SOURCE_BASE, "bico.source_base"},
      {BICO_FILE_SOURCE_TUNED, "bico.source_tuned"},
      {BICO_FILE_TASK_VECTOR, "bico.task_vector"},
      {BICO_FILE_TARGET_BASE, "bico.target_base"}};
  for (size_t k = 0; k < sizeof FILES / sizeof *FILES && st == BICO_OK; k++)
    if (t->files[FILES[k].file] != NULL)
      st = bico_stwriter_add_metadata(w, FILES[k].key, t->files[FILES[k].file]);
  if (st == BICO_OK && lora != NULL)
    st = bico_stwriter_add_metadata(w, "bico.source_adapter", lora);
  return st;
}

bico_status bico__xfer_writer(const bico_transfer *t, const char *path,
                              bico_stwriter **w) {
  const char *tb = t->files[BICO_FILE_TARGET_BASE];
  if (!bico_stwriter_output_is_folder(path, tb))
    return bico_stwriter_create(t->ctx, path, w);
  return bico_stwriter_create_folder(
      t->ctx, path, tb, (uint64_t)t->param[BICO_TRANSFER_MAX_SHARD_SIZE], w);
}

bico_status bico__xfer_declare(const bico_transfer *t, const bico_stfile *tb,
                               bico_stwriter **w, bico_stwriter **wd) {
  bico_ctx *ctx = t->ctx;
  const char *path = t->files[BICO_FILE_OUTPUT];
  const char *path_d = t->files[BICO_FILE_DELTA_OUTPUT];
  bico_status st = bico__xfer_writer(t, path, w);
  if (st == BICO_OK && path_d) st = bico__xfer_writer(t, path_d, wd);
  if (st == BICO_OK) st = provenance(t, tb, *w);
  if (st == BICO_OK && path_d) st = provenance(t, tb, *wd);
  size_t nt = bico__stfile_ntensors(tb);
  for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) {
    bico__xfer_tensor x;
    st = bico__xfer_locate(ctx, tb, ti, &x);
    if (st == BICO_OK)
      st = bico_stwriter_declare(*w, x.name, x.dtype, x.ndim, x.shape);
    if (st == BICO_OK && path_d && x.fl)
      st = bico_stwriter_declare(*wd, x.name, x.dtype, x.ndim, x.shape);
  }
  return st;
}

bico_status bico__xfer_write_one(bico_ctx *ctx, const bico_stfile *tb,
                                 const bico__xfer_tensor *x, bico_stwriter *w,
                                 bico_stwriter *wd, const float *upd,
                                 double *norm) {
  bico_status st = BICO_OK;
  *norm = 0;
  if (upd != NULL) {
    double *base = bico__alloc(ctx, (x->nb ? x->nb : 1) * sizeof(double));
    if (base == NULL) return BICO_E_NOMEM;
    st = bico_stfile_read_f64(tb, x->fi, base, x->nb);
    if (st == BICO_OK) st = bico_stfile_check_finite(tb, x->fi);
    double ss = 0;
    for (size_t e = 0; e < x->nb && st == BICO_OK; e++) {
      ss += (double)upd[e] * (double)upd[e];
      base[e] += (double)upd[e];
    }
    *norm = sqrt(ss);
    if (st == BICO_OK) st = bico_stwriter_write_f64(w, x->name, base, x->nb);
    if (st == BICO_OK && wd)
      st = bico_stwriter_write_f32(wd, x->name, upd, x->nb);
    bico__free(ctx, base);
    return st;
  }
  const void *data;
  size_t nbytes;
  st = bico_stfile_data(tb, x->fi, &data, &nbytes);
  if (st == BICO_OK) st = bico_stwriter_write_raw(w, x->name, data, nbytes);
  bico__stfile_drop(tb, x->fi);
  if (st == BICO_OK && wd && x->fl) {
    float *zero = bico__calloc(ctx, x->nb ? x->nb : 1, sizeof *zero);
    if (zero == NULL) return BICO_E_NOMEM;
    st = bico_stwriter_write_f32(wd, x->name, zero, x->nb);
    bico__free(ctx, zero);
  }
  return st;
}

/* Partial runs: the update and its report entry (rendered on its own) go
 * to the sink. */
static bico_status sink_tensor(bico__run *r, size_t ti,
                               const bico__xfer_tensor *a, const float *upd,
                               bico__tinfo *info) {
  bico_ctx *ctx = r->ctx;
  bico_transfer *t = r->t;
  int changed = info->handling != BICO__H_UNCHANGED;
  double ss = 0;
  for (size_t e = 0; changed && e < a->nb; e++)
    ss += (double)upd[e] * (double)upd[e];
  info->norm = sqrt(ss);
  bico__report entry;
  bico__report_init_compact(&entry, ctx);
  bico_status st = bico__xfer_report_tensor(&entry, r->mt, ti, info);
  if (st == BICO_OK) {
    bico_transfer_tensor x;
    memset(&x, 0, sizeof x);
    x.size = sizeof x;
    x.index = ti;
    x.name = a->name;
    x.handling = info->handling;
    x.update = changed ? upd : NULL;
    x.count = changed ? a->nb : 0;
    x.report_entry = entry.buf;
    st = t->sink(t->sink_opaque, &x);
    if (st != BICO_OK && bico_ctx_errmsg(ctx)[0] == '\0')
      st = bico__fail(ctx, st, "transfer_run: the partial run's sink "
                      "refused tensor %s", a->name);
  }
  bico__report_free(&entry);
  return st;
}

/* One selected target tensor: its update, then written or sunk, then its
 * report entry. */
static bico_status one_tensor(bico__run *r, size_t ti) {
  bico_ctx *ctx = r->ctx;
  int partial = r->t->select != NULL;
  bico__xfer_tensor a;
  bico_status st = locate(r, ti, &a);
  if (st != BICO_OK) return st;
  bico__tinfo info;
  memset(&info, 0, sizeof info);
  info.handling = BICO__H_UNCHANGED;
  info.kept = -1;
  float *upd = NULL;
  int streamed = 0;
  if (!partial && a.fl && a.nb > 0) {
    st = bico__xfer_stream_rows(r, ti, &a, &info, &streamed);
    if (st != BICO_OK) return bico__xfer_wrap(ctx, st, "tensor", a.name);
  }
  if (streamed) {
    /* computed, checked and written piece by piece */
  } else if (a.fl && a.nb > 0) {
    upd = bico__alloc(ctx, a.nb * sizeof(float));
    if (upd == NULL) return BICO_E_NOMEM;
    st = bico__xfer_update(r, ti, upd, &info);
    if (st != BICO_OK) st = bico__xfer_wrap(ctx, st, "tensor", a.name);
    /* Every written (or sunk) value finite: an overflowing alpha tau
     * fails the run here, before anything is committed. */
    if (st == BICO_OK && info.handling != BICO__H_UNCHANGED)
      st = bico__xfer_check_finite(ctx, upd, a.nb, "tensor", a.name);
  } else {
    snprintf(info.reason, sizeof info.reason, "%s",
             a.fl ? "empty tensor" : "not a floating-point tensor");
  }
  int changed = info.handling != BICO__H_UNCHANGED;
  if (st == BICO_OK && !streamed)
    st = partial ? sink_tensor(r, ti, &a, upd, &info)
                 : bico__xfer_write_one(ctx, r->tb, &a, r->w, r->wd,
                                        changed ? upd : NULL, &info.norm);
  if (st == BICO_OK) {
    /* (after a failure, no accessor may clear the context's message) */
    int role = BICO_ROLE_OTHER;
    bico_model_tensor_module(r->mt, ti, NULL, &role);
    if (!changed && a.fl && a.nb > 0 && role != BICO_ROLE_OTHER)
      bico__xfer_log(r, "bico: unchanged: %s (%s)", a.name, info.reason);
    r->count[info.handling]++;
    if (!partial) st = bico__xfer_report_tensor(&r->rep, r->mt, ti, &info);
  }
  bico__free(ctx, upd);
  return st;
}

bico_status bico__xfer_check_unchanged(bico__run *r) {
  /* the statistics and calibration files are read in panels by the
   * workers, the bridge's maps on demand: all of them, not only the
   * models (the workers' own handles opened after these, so a change
   * since is a change here too) */
  const bico_stfile *read[] = {r->sb,    r->sft,   r->tv,
                               r->tb,    r->sc,    r->tc,
                               r->stats, r->votes, bico__bridge_file(r)};
  bico_status st = BICO_OK;
  for (size_t k = 0; k < sizeof read / sizeof *read && st == BICO_OK; k++)
    if (read[k] != NULL) st = bico_stfile_check_unchanged(read[k]);
  return st;
}

/* Every output complete in its temporary file, then all destinations
 * checked and committed together (lib/io/commit.c): a failure before the
 * renames leaves nothing new. */
bico_status bico__xfer_commit(bico_ctx *ctx, const bico__report *rep,
                              const char *report, bico_stwriter *w,
                              bico_stwriter *wd) {
  bico__tmpfile rt = {.fd = -1}, **l1 = NULL, **l2 = NULL;
  size_t n1 = 0, n2 = 0;
  bico_status st = bico__stwriter_finish_all(w, &l1, &n1);
  if (st == BICO_OK && wd) st = bico__stwriter_finish_all(wd, &l2, &n2);
  if (st == BICO_OK && report)
    st = bico__report_tmp(ctx, "transfer_run", "report", rep->buf, rep->len,
                          report, &rt);
  st = bico__commit_lists(ctx, "transfer_run", st, l1, n1, l2, n2,
                          report ? &rt : NULL);
  if (st == BICO_OK) bico__stwriter_committed(w);
  if (st == BICO_OK) bico__stwriter_committed(wd);
  bico__tmp_discard(ctx, &rt);
  return st;
}

void bico__xfer_report_head(bico__report *rep, int method, float alpha) {
  bico__report_begin_object(rep);
  bico__report_key_string(rep, "method", bico_transfer_method_name(method));
  bico__report_key_number(rep, "alpha", (double)alpha);
  bico__report_key(rep, "tensors");
  bico__report_begin_array(rep);
}

void bico__xfer_report_tail_vocab(bico__report *rep, const size_t *count,
                                  const struct bico__vocab *vocab) {
  bico__report_end_array(rep);
  bico__report_key(rep, "summary");
  bico__report_begin_object(rep);
  for (int h = BICO__H_FIRST; h < BICO__H_COUNT; h++)
    bico__report_key_number(rep, bico_transfer_handling_name(h),
                            (double)count[h]);
  if (vocab != NULL) {
    /* Token ids of the target's tokenizer: with a source token of the same
     * string (their rows carried) or without (left unchanged). */
    bico__report_key(rep, "vocab");
    bico__report_begin_object(rep);
    bico__report_key_number(rep, "source_tokens", (double)vocab->n_source);
    bico__report_key_number(rep, "target_tokens", (double)vocab->n_target);
    bico__report_key_number(rep, "shared", (double)vocab->shared);
    bico__report_key_number(rep, "new", (double)vocab->fresh);
    bico__report_end_object(rep);
  }
  bico__report_end_object(rep);
  bico__report_end_object(rep);
}

bico_status bico__xfer_write_all(bico__run *r) {
  bico_transfer *t = r->t;
  int partial = t->select != NULL;
  size_t nt = bico__model_ntensors(r->mt);
  bico_status st = partial ? BICO_OK
                           : bico__xfer_declare(t, r->tb, &r->w, &r->wd);
  bico__xfer_report_head(&r->rep, r->method, r->alpha);
  /* Structured progress for the front end, when it asked */
  bico_progress pg;
  memset(&pg, 0, sizeof pg);
  pg.size = sizeof pg;
  pg.tensors_total = nt;
  double *cost = NULL;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  if (st == BICO_OK && t->progress != NULL && !partial) {
    cost = bico__alloc(r->ctx, (nt + 1) * sizeof *cost);
    st = cost == NULL ? BICO_E_NOMEM : bico__xfer_tensor_costs(r, cost);
    for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) pg.total += cost[ti];
  }
  /* Else text progress, only on long runs: at most every 5 seconds. */
  time_t last = time(NULL);
  for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) {
    /* Another process's tensor (partial runs): only the map reference
     * goes. */
    if (!partial || t->select[ti]) st = one_tensor(r, ti);
    if (st == BICO_OK) bico__xfer_release(r, ti);
    if (st == BICO_OK && cost != NULL) {
      struct timespec now;
      clock_gettime(CLOCK_MONOTONIC, &now);
      pg.done += cost[ti];
      if (ti + 1 == nt) pg.done = pg.total; /* exact at the end */
      pg.tensors_done = ti + 1;
      pg.elapsed = (double)(now.tv_sec - t0.tv_sec) +
                   1e-9 * (double)(now.tv_nsec - t0.tv_nsec);
      pg.tensor = bico__xfer_tname(r->mt, ti);
      t->progress(t->progress_opaque, &pg);
      continue;
    }
    if (st == BICO_OK && ti + 1 < nt && time(NULL) - last >= 5) {
      last = time(NULL);
      bico__xfer_log(r, "bico: %zu/%zu tensors done (%s)", ti + 1, nt,
                     bico__xfer_tname(r->mt, ti));
    }
  }
  bico__free(r->ctx, cost);
  bico__xfer_report_tail_vocab(&r->rep, r->count, r->vocab);
  if (st == BICO_OK) st = bico__report_status(&r->rep);
  /* the inputs read a tensor at a time are still the files opened: a
   * shard rewritten meanwhile would give an output of two versions (the
   * bridge's maps, too, are the ones its digest was checked on) */
  if (st == BICO_OK) st = bico__xfer_check_unchanged(r);
  if (st == BICO_OK && !partial)
    st = bico__xfer_commit(r->ctx, &r->rep, t->files[BICO_FILE_REPORT], r->w,
                           r->wd);
  if (st != BICO_OK) return st;
  size_t updated = 0;
  for (int h = BICO__H_FIRST; h < BICO__H_COUNT; h++)
    if (h != BICO__H_UNCHANGED) updated += r->count[h];
  t->updated = updated;
  t->unchanged = r->count[BICO__H_UNCHANGED];
  if (partial)
    bico__xfer_log(r, "bico: partial run: %zu tensors updated, %zu unchanged",
                   updated, r->count[BICO__H_UNCHANGED]);
  else
    bico__xfer_log(r, "bico: %zu tensors updated (linear %zu, vector %zu, "
                      "tied %zu, naive %zu, padded %zu, masked %zu), %zu "
                      "unchanged; wrote %s",
                   updated, r->count[BICO__H_LINEAR], r->count[BICO__H_VECTOR],
                   r->count[BICO__H_TIED], r->count[BICO__H_NAIVE],
                   r->count[BICO__H_PADDED], r->count[BICO__H_MASKED],
                   r->count[BICO__H_UNCHANGED], t->files[BICO_FILE_OUTPUT]);
  if (!partial && r->vocab != NULL)
    bico__xfer_log(r, "bico: vocabulary: %zu of the target's %zu tokens "
                      "shared with the source (their rows carried), %zu new "
                      "(left unchanged)",
                   r->vocab->shared, r->vocab->n_target, r->vocab->fresh);
  return BICO_OK;
}
