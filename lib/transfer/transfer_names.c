/* The transfer driver's names: the parameters' names and bounds (the
 * option grammar), the source rename (BICO_TRANSFER_SOURCE_RENAME), the
 * prefix offer when pairing falls short, and the warning for a whole
 * checkpoint given as the task vector. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transfer_internal.h"

/* ---- the parameters' names and bounds ----
 *
 * The option grammar (params.h, lib/base/params.c): each parameter's name
 * and accepted set, for bico_transfer_set_param (transfer.c) and for the
 * options a bridge records (bridge_file.c, which checks them). */
const bico__param_spec bico__xfer_params[BICO__NPARAMS] = {
    [BICO_TRANSFER_METHOD] = {"method", 0, BICO_METHOD_PAD, BICO_PARAM_INTEGER},
    /* used as a float */
    [BICO_TRANSFER_ALPHA] = {"alpha", 0, FLT_MAX, BICO_PARAM_LO_OPEN},
    [BICO_TRANSFER_NORM_MAP] = {"norm_map", 0, BICO_NORM_MAP_GRAD,
                                BICO_PARAM_INTEGER},
    [BICO_TRANSFER_NULL] = {"null", 0, BICO_NULL_DROP, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_RANK_TOL] = {"rank_tol", 0, 1, BICO_PARAM_HI_OPEN},
    [BICO_TRANSFER_CENTER] = {"center", 0, 1, BICO_PARAM_INTEGER},
    [BICO_TRANSFER_WHITEN] = {"whiten", 0, 0.5, 0},
    [BICO_TRANSFER_PROC_METHOD] = {"proc_method", 0, BICO_PROC_POLAR,
                                   BICO_PARAM_INTEGER},
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
    [BICO_TRANSFER_FINGERPRINT] = {"fingerprint", 0, BICO_FINGERPRINT_FULL,
                                   BICO_PARAM_INTEGER},
};

bico_status bico_transfer_param_bounds(int param, double *lo, double *hi,
                                       unsigned *flags) {
  return bico__param_bounds(bico__xfer_params, BICO__NPARAMS, param, lo, hi,
                            flags);
}

const char *bico_transfer_param_name(int param) {
  return bico__param_name(bico__xfer_params, BICO__NPARAMS, param);
}

bico_status bico_transfer_param_from_name(const char *name, int *param) {
  return bico__param_from_name(bico__xfer_params, BICO__NPARAMS, name, param);
}

bico_status bico__xfer_rename_source(const bico_transfer *t, int which,
                                     bico_stfile *f) {
  const char *rule = t->strings[BICO_TRANSFER_SOURCE_RENAME];
  if (rule == NULL || f == NULL) return BICO_OK;
  if (which != BICO_FILE_SOURCE_BASE && which != BICO_FILE_SOURCE_TUNED &&
      which != BICO_FILE_TASK_VECTOR && which != BICO_FILE_SOURCE_CALIB)
    return BICO_OK;
  return bico__stfile_rename_prefix(f, rule);
}

/* ---- the prefix offer ---- */

/* The first dotted component of name with its dot ("module."), or "". */
static size_t lead(const char *name) {
  const char *d = strchr(name, '.');
  return d ? (size_t)(d - name) + 1 : 0;
}

typedef struct pcount {
  char p[64];
  size_t n;
} pcount;

/* The three most frequent leading components of the model's tensors. */
static size_t top_leads(const bico_model *m, pcount *top) {
  pcount c[16];
  size_t nc = 0, nt = bico__model_ntensors(m);
  for (size_t i = 0; i < nt; i++) {
    const char *name;
    bico_model_tensor(m, i, &name, NULL, NULL, NULL);
    size_t l = lead(name);
    if (l == 0 || l >= sizeof c[0].p) continue;
    size_t k;
    for (k = 0; k < nc; k++)
      if (strlen(c[k].p) == l && strncmp(c[k].p, name, l) == 0) break;
    if (k == nc) {
      if (nc == 16) continue;
      memcpy(c[nc].p, name, l);
      c[nc].p[l] = '\0';
      c[nc++].n = 0;
    }
    c[k].n++;
  }
  size_t n = 0;
  for (; n < 3 && n < nc; n++) {
    size_t best = n;
    for (size_t k = n + 1; k < nc; k++)
      if (c[k].n > c[best].n) best = k;
    pcount tmp = c[n];
    c[n] = c[best];
    c[best] = tmp;
    top[n] = c[n];
  }
  return n;
}

/* Target tensors with a source tensor of the same name once the source's
 * names begin with `to` instead of `from`. */
static size_t same_names(const bico_model *mt, const bico_model *ms,
                         const char *from, const char *to) {
  size_t nt = bico__model_ntensors(mt), hits = 0;
  size_t fl = strlen(from), tl = strlen(to);
  char buf[1024];
  for (size_t i = 0; i < nt; i++) {
    const char *name;
    bico_model_tensor(mt, i, &name, NULL, NULL, NULL);
    /* the source name this target name asks for: to... -> from... */
    size_t len = strlen(name);
    if (len < tl || strncmp(name, to, tl) != 0) continue;
    if (fl + len - tl + 1 > sizeof buf) continue;
    memcpy(buf, from, fl);
    memcpy(buf + fl, name + tl, len - tl + 1);
    size_t si;
    if (bico_model_find_tensor(ms, buf, &si) == BICO_OK) hits++;
  }
  return hits;
}

void bico__xfer_prefix_offer(bico__run *r, char *buf, size_t cap) {
  buf[0] = '\0';
  if (r->t->strings[BICO_TRANSFER_SOURCE_RENAME] != NULL) return;
  pcount ls[3], lt[3];
  size_t ns = top_leads(r->ms, ls), ntl = top_leads(r->mt, lt);
  size_t now = same_names(r->mt, r->ms, "", "");
  size_t best = now;
  char from[64] = "", to[64] = "";
  /* strip a source prefix, add a target prefix, or swap one for another */
  for (size_t a = 0; a <= ns; a++)
    for (size_t b = 0; b <= ntl; b++) {
      const char *f = a < ns ? ls[a].p : "", *t = b < ntl ? lt[b].p : "";
      if (strcmp(f, t) == 0) continue;
      size_t n = same_names(r->mt, r->ms, f, t);
      if (n > best) {
        best = n;
        snprintf(from, sizeof from, "%s", f);
        snprintf(to, sizeof to, "%s", t);
      }
    }
  bico__clear(r->ctx);
  if (best == now) return;
  snprintf(buf, cap,
           "; the names differ by a prefix: --source-rename '%s=%s' "
           "(BICO_TRANSFER_SOURCE_RENAME) gives %zu of the target's %zu "
           "tensors a source tensor of the same name (%zu now)",
           from, to, best, bico__model_ntensors(r->mt), now);
}

/* ---- a checkpoint given as the task vector ---- */

void bico__xfer_check_task_vector(bico__run *r) {
  if (r->tv == NULL || r->sb == NULL) return;
  /* A task vector is small next to the weights; a fine-tuned checkpoint
   * is the weights plus a small change.  Up to 16 floating-point tensors
   * of both files: nearer the source base than zero means a checkpoint. */
  size_t n = bico__stfile_ntensors(r->tv), looked = 0, near_base = 0;
  double tv2 = 0, base2 = 0;
  for (size_t i = 0; i < n && looked < 16; i++) {
    const char *name;
    int dtype;
    size_t ndim, si;
    const size_t *shape;
    if (bico_stfile_tensor_info(r->tv, i, &name, &dtype, &ndim, &shape) != BICO_OK)
      continue;
    if (!bico_dtype_is_float(dtype))
      continue;
    if (bico_stfile_find(r->sb, name, &si) != BICO_OK) continue;
    size_t nb = bico__xfer_numel(ndim, shape), bn;
    const size_t *bshape;
    size_t bnd;
    int bd;
    if (bico_stfile_tensor_info(r->sb, si, NULL, &bd, &bnd, &bshape) != BICO_OK)
      continue;
    bn = bico__xfer_numel(bnd, bshape);
    if (nb == 0 || bn != nb || nb > ((size_t)1 << 24)) continue;
    double *a = bico__alloc(r->ctx, nb * sizeof *a);
    double *b = bico__alloc(r->ctx, nb * sizeof *b);
    if (a != NULL && b != NULL && bico_stfile_read_f64(r->tv, i, a, nb) == BICO_OK &&
        bico_stfile_read_f64(r->sb, si, b, nb) == BICO_OK) {
      double d2 = 0, t2 = 0, b2 = 0;
      for (size_t e = 0; e < nb; e++) {
        d2 += (a[e] - b[e]) * (a[e] - b[e]);
        t2 += a[e] * a[e];
        b2 += b[e] * b[e];
      }
      looked++;
      tv2 += t2;
      base2 += b2;
      if (b2 > 0 && d2 < t2) near_base++;
    }
    bico__free(r->ctx, a);
    bico__free(r->ctx, b);
  }
  bico__clear(r->ctx);
  if (looked > 0 && 2 * near_base > looked)
    bico__xfer_log(r,
                   "bico: warning: the task vector %s looks like a whole "
                   "checkpoint: %zu of %zu of its tensors lie nearer the "
                   "source base's than zero (norm %.3g against the base's "
                   "%.3g); a fine-tuned checkpoint goes with "
                   "--source-tuned (BICO_FILE_SOURCE_TUNED)",
                   r->t->files[BICO_FILE_TASK_VECTOR], near_base, looked,
                   sqrt(tv2), sqrt(base2));
}
