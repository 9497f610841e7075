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
#include "transfer_internal.h"

const char *const bico__xfer_handling[BICO__H_COUNT] = {
    "unchanged", "linear", "vector", "tied", "naive", "padded", "masked"};

bico_status bico__xfer_report_tensor(bico__report *rep, const bico_model *mt,
                                     size_t ti, const bico__tinfo *info) {
  const char *name;
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(mt, ti, &name, NULL, &ndim, &shape);
  bico__report_begin_object(rep);
  bico__report_key_string(rep, "name", name);
  bico__report_key_string(rep, "handling", bico__xfer_handling[info->handling]);
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
  if (info->reason[0]) bico__report_key_string(rep, "reason", info->reason);
  bico__report_end_object(rep);
  return rep->status;
}


static int is_float(int dtype) {
  return dtype == BICO_DTYPE_F32 || dtype == BICO_DTYPE_F16 ||
         dtype == BICO_DTYPE_BF16 || dtype == BICO_DTYPE_F64;
}

/* Target tensor ti as the target base's file holds it. */
typedef struct tensor_at {
  const char *name;
  int dtype, fl;
  size_t ndim, nb, fi;
  const size_t *shape;
} tensor_at;

static bico_status locate(bico__run *r, size_t ti, tensor_at *a) {
  bico_model_tensor(r->mt, ti, &a->name, NULL, &a->ndim, &a->shape);
  bico_status st = bico_stfile_find(r->tb, a->name, &a->fi);
  if (st == BICO_OK)
    st = bico_stfile_tensor_info(r->tb, a->fi, NULL, &a->dtype, NULL, NULL);
  a->nb = bico__xfer_numel(a->ndim, a->shape);
  a->fl = is_float(a->dtype);
  return st;
}

/* Whole runs: the writers, with every tensor declared up front in the
 * target's order (the delta output holds the floating-point ones). */
static bico_status declare_outputs(bico__run *r) {
  bico_ctx *ctx = r->ctx;
  const bico_transfer *t = r->t;
  bico_status st = bico_stwriter_create(ctx, t->files[BICO_FILE_OUTPUT], &r->w);
  if (st == BICO_OK && t->files[BICO_FILE_DELTA_OUTPUT])
    st = bico_stwriter_create(ctx, t->files[BICO_FILE_DELTA_OUTPUT], &r->wd);
  size_t nt = bico_model_tensor_count(r->mt);
  for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) {
    tensor_at a;
    st = locate(r, ti, &a);
    if (st == BICO_OK)
      st = bico_stwriter_declare(r->w, a.name, a.dtype, a.ndim, a.shape);
    if (st == BICO_OK && r->wd && a.fl)
      st = bico_stwriter_declare(r->wd, a.name, a.dtype, a.ndim, a.shape);
  }
  return st;
}

/* Whole runs: theta_B + upd where the tensor changed (and upd to the delta
 * output), the target base's bytes as they are elsewhere. */
static bico_status write_tensor(bico__run *r, const tensor_at *a, float *upd,
                                bico__tinfo *info) {
  bico_ctx *ctx = r->ctx;
  bico_status st = BICO_OK;
  if (info->handling != BICO__H_UNCHANGED) {
    double *base = bico__alloc(ctx, a->nb * sizeof(double));
    if (base == NULL) return BICO_E_NOMEM;
    st = bico_stfile_read_f64(r->tb, a->fi, base, a->nb);
    if (st == BICO_OK) st = bico_stfile_check_finite(r->tb, a->fi);
    double ss = 0;
    for (size_t e = 0; e < a->nb && st == BICO_OK; e++) {
      ss += (double)upd[e] * (double)upd[e];
      base[e] += (double)upd[e];
    }
    info->norm = sqrt(ss);
    if (st == BICO_OK) st = bico_stwriter_write_f64(r->w, a->name, base, a->nb);
    if (st == BICO_OK && r->wd)
      st = bico_stwriter_write_f32(r->wd, a->name, upd, a->nb);
    bico__free(ctx, base);
    return st;
  }
  const void *data;
  size_t nbytes;
  st = bico_stfile_data(r->tb, a->fi, &data, &nbytes);
  if (st == BICO_OK) st = bico_stwriter_write_raw(r->w, a->name, data, nbytes);
  bico__stfile_drop(r->tb, a->fi);
  if (st == BICO_OK && r->wd && a->fl) {
    if (upd) memset(upd, 0, a->nb * sizeof(float));
    static const float zero = 0.0f;
    st = bico_stwriter_write_f32(r->wd, a->name, upd ? upd : &zero, a->nb);
  }
  return st;
}

/* Partial runs: the update and its report entry (rendered on its own) go
 * to the sink. */
static bico_status sink_tensor(bico__run *r, size_t ti, const tensor_at *a,
                               const float *upd, bico__tinfo *info) {
  bico_ctx *ctx = r->ctx;
  bico_transfer *t = r->t;
  int changed = info->handling != BICO__H_UNCHANGED;
  double ss = 0;
  for (size_t e = 0; changed && e < a->nb; e++)
    ss += (double)upd[e] * (double)upd[e];
  info->norm = sqrt(ss);
  bico__report entry;
  bico__report_init(&entry, ctx);
  entry.compact = 1;
  bico_status st = bico__xfer_report_tensor(&entry, r->mt, ti, info);
  if (st == BICO_OK) {
    st = t->sink(t->sink_opaque, ti, a->name,
                 bico__xfer_handling[info->handling], changed ? upd : NULL,
                 changed ? a->nb : 0, entry.buf);
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
  tensor_at a;
  bico_status st = locate(r, ti, &a);
  if (st != BICO_OK) return st;
  bico__tinfo info;
  memset(&info, 0, sizeof info);
  info.kept = -1;
  float *upd = NULL;
  if (a.fl && a.nb > 0) {
    upd = bico__alloc(ctx, a.nb * sizeof(float));
    if (upd == NULL) return BICO_E_NOMEM;
    st = bico__xfer_update(r, ti, upd, &info);
    if (st != BICO_OK) st = bico__xfer_wrap(ctx, st, "tensor", a.name);
  } else {
    snprintf(info.reason, sizeof info.reason, "%s",
             a.fl ? "empty tensor" : "not a floating-point tensor");
  }
  if (st == BICO_OK)
    st = partial ? sink_tensor(r, ti, &a, upd, &info)
                 : write_tensor(r, &a, upd, &info);
  if (st == BICO_OK) {
    /* (after a failure, no accessor may clear the context's message) */
    int role = BICO_ROLE_OTHER;
    bico_model_tensor_module(r->mt, ti, NULL, &role);
    if (info.handling == BICO__H_UNCHANGED && a.fl && a.nb > 0 &&
        role != BICO_ROLE_OTHER)
      bico__xfer_log(r, "bico: unchanged: %s (%s)", a.name, info.reason);
    r->count[info.handling]++;
    if (!partial) st = bico__xfer_report_tensor(&r->rep, r->mt, ti, &info);
  }
  bico__free(ctx, upd);
  return st;
}

/* Every output complete in its temporary file, then all destinations
 * checked and committed together (lib/fileio.c): a failure before the
 * renames leaves nothing new. */
static bico_status commit(bico__run *r) {
  bico_ctx *ctx = r->ctx;
  const char *report = r->t->files[BICO_FILE_REPORT];
  bico__tmpfile rep = {NULL, NULL, -1, 0}, *outs[3];
  size_t n = 0;
  bico_status st = bico__stwriter_finish(r->w, &outs[n]);
  if (st == BICO_OK) n++;
  if (st == BICO_OK && r->wd) {
    st = bico__stwriter_finish(r->wd, &outs[n]);
    if (st == BICO_OK) n++;
  }
  if (st == BICO_OK && report) {
    st = bico__report_tmp(ctx, "transfer_run", "report", r->rep.buf,
                          r->rep.len, report, &rep);
    if (st == BICO_OK) outs[n++] = &rep;
  }
  if (st == BICO_OK) st = bico__commit(ctx, "transfer_run", outs, n);
  bico__tmp_discard(ctx, &rep);
  return st;
}

static void report_summary(bico__run *r) {
  bico__report_end_array(&r->rep);
  bico__report_key(&r->rep, "summary");
  bico__report_begin_object(&r->rep);
  for (int h = 0; h < BICO__H_COUNT; h++)
    bico__report_key_number(&r->rep, bico__xfer_handling[h],
                            (double)r->count[h]);
  bico__report_end_object(&r->rep);
  bico__report_end_object(&r->rep);
}

bico_status bico__xfer_write_all(bico__run *r) {
  bico_transfer *t = r->t;
  int partial = t->select != NULL;
  size_t nt = bico_model_tensor_count(r->mt);
  bico_status st = partial ? BICO_OK : declare_outputs(r);
  bico__report_begin_object(&r->rep);
  bico__report_key_string(&r->rep, "method", bico_method_name(r->method));
  bico__report_key_number(&r->rep, "alpha", (double)r->alpha);
  bico__report_key(&r->rep, "tensors");
  bico__report_begin_array(&r->rep);
  /* Progress only on long runs: at most every 5 seconds. */
  time_t last = time(NULL);
  for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) {
    /* Another process's tensor (partial runs): only the map reference
     * goes. */
    if (!partial || t->select[ti]) st = one_tensor(r, ti);
    if (st == BICO_OK) bico__xfer_release(r, ti);
    if (st == BICO_OK && ti + 1 < nt && time(NULL) - last >= 5) {
      last = time(NULL);
      bico__xfer_log(r, "bico: %zu/%zu tensors done (%s)", ti + 1, nt,
                     bico__xfer_tname(r->mt, ti));
    }
  }
  report_summary(r);
  if (st == BICO_OK) st = r->rep.status;
  if (st == BICO_OK && !partial) st = commit(r);
  if (st != BICO_OK) return st;
  size_t updated = 0;
  for (int h = 0; h < BICO__H_COUNT; h++)
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
  return BICO_OK;
}
