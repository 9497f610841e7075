/* Bridge files (docs/formats.md, "Bridge files"): what a bridge records
 * and how a run reads one -- the options that shape the maps (adopted or
 * compared, each within its bounds), the plan and the fingerprints of
 * both bases (verified), the maps' digest and ranges (checked in one pass
 * before any map is used), and the maps themselves (loaded where a run
 * would solve them, checked again as they are read).  A bridge is a file
 * anyone may have edited: nothing read from it reaches the arithmetic (a
 * cast of a rank, a map entry) unchecked.  Making a bridge is
 * transfer_bridge.c's; it writes what this file reads, with the same
 * functions for the options, the plan, the fingerprints and the digest. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "family.h"
#include "fileio.h"
#include "json.h"
#include "sha256.h"
#include "transfer_internal.h"

/* The options that shape the maps or the plan: recorded by a bridge,
 * adopted by a run that sets none of them, compared when it sets one.
 * Their keys are the file format's (docs/formats.md), the words of
 * bico_transfer_param_name.  `absent`: the value of a key that bridges
 * made before it lack (0: every bridge has it, its absence is a
 * malformed bridge). */
static const struct {
  int param;
  const char *key;
  double absent;
} PARAMS[] = {{BICO_TRANSFER_METHOD, "method", 0},
              {BICO_TRANSFER_NORM_MAP, "norm_map", 0},
              {BICO_TRANSFER_NULL, "null", 0},
              {BICO_TRANSFER_RANK_TOL, "rank_tol", 0},
              {BICO_TRANSFER_CENTER, "center", 0},
              {BICO_TRANSFER_WHITEN, "whiten", 0},
              {BICO_TRANSFER_PROC_METHOD, "proc_method", 0},
              {BICO_TRANSFER_STRUCTURE, "structure", 0},
              {BICO_TRANSFER_ROPE, "rope", 0},
              {BICO_TRANSFER_HEADS, "heads", 0},
              {BICO_TRANSFER_KV_HEADS, "kv_heads", 0},
              {BICO_TRANSFER_HEAD_DIM, "head_dim", 0},
              /* how the bases were fingerprinted: the reader recomputes
               * the same kind */
              {BICO_TRANSFER_FINGERPRINT, "fingerprint",
               BICO_FINGERPRINT_SAMPLED}};
#define NPARAMS (sizeof PARAMS / sizeof *PARAMS)
static const int STRINGS[] = {BICO_TRANSFER_BLOCKS, BICO_TRANSFER_SOURCE_BLOCKS,
                              BICO_TRANSFER_TARGET_BLOCKS,
                              BICO_TRANSFER_SOURCE_RENAME};
#define NSTRINGS (sizeof STRINGS / sizeof *STRINGS)
/* Files a run takes from the bridge when the handle names none. */
static const int FILES[] = {BICO_FILE_SOURCE_BASE, BICO_FILE_TARGET_BASE,
                            BICO_FILE_SOURCE_CONFIG, BICO_FILE_TARGET_CONFIG};
#define NFILES (sizeof FILES / sizeof *FILES)
static const char *const FILE_KEY[NFILES] = {"source_base", "target_base",
                                             "source_config", "target_config"};

struct bico__bridge {
  bico_stfile *f;
  bico__json_doc *doc;
  /* What the run took from the bridge, given back by bico__bridge_end. */
  double saved[BICO__NPARAMS];
  unsigned char took_param[BICO__NPARAMS];
  unsigned char took_string[BICO__NSTRINGS];
  unsigned char took_file[BICO__NFILES];
  int took_splits, took_ties;
};

/* ---- What a bridge records (written by transfer_bridge.c) ---- */

void bico__bridge_options(const bico_transfer *t, bico__jw *w) {
  bico__jw_begin_object(w);
  for (size_t i = 0; i < NPARAMS; i++) {
    bico__jw_key(w, PARAMS[i].key);
    bico__jw_double(w, t->param[PARAMS[i].param]);
  }
  for (size_t i = 0; i < NSTRINGS; i++) {
    bico__jw_key(w, bico_transfer_string_name(STRINGS[i]));
    if (t->strings[STRINGS[i]]) bico__jw_string(w, t->strings[STRINGS[i]]);
    else bico__jw_null(w);
  }
  bico__jw_key(w, "splits");
  bico__jw_begin_array(w);
  for (size_t i = 0; i < t->nsplits; i++) {
    bico__jw_begin_array(w);
    bico__jw_string(w, t->splits[i].suffix);
    bico__jw_uint(w, t->splits[i].k);
    bico__jw_end_array(w);
  }
  bico__jw_end_array(w);
  bico__jw_key(w, "ties");
  bico__jw_begin_array(w);
  for (size_t i = 0; i < t->nties; i++) {
    bico__jw_begin_array(w);
    bico__jw_string(w, t->ties[i].tensor);
    bico__jw_string(w, t->ties[i].module);
    bico__jw_end_array(w);
  }
  bico__jw_end_array(w);
  bico__jw_end_object(w);
}

/* Target tensor ti in the plan: its source partner, handling, the module
 * whose maps carry it and which of that module's maps ("in", "out",
 * "in+out" or ""). */
typedef struct plan_entry {
  const char *name, *source, *handling, *module;
  char maps[8];
} plan_entry;

static void plan_entry_of(const bico__run *r, size_t ti, plan_entry *e) {
  bico__route rt;
  size_t si;
  bico__xfer_route(r, ti, &rt);
  e->name = bico__xfer_tname(r->mt, ti);
  e->source = bico_model_pair_tensor(r->mt, ti, r->ms, &si) == BICO_OK
                  ? bico__xfer_tname(r->ms, si)
                  : NULL;
  e->handling = bico_transfer_handling_name(
      e->source ? bico__xfer_route_handling(&rt) : BICO_HANDLING_UNCHANGED);
  e->module = rt.module != BICO__NONE && e->source
                  ? bico__xfer_mname(r->mt, rt.module)
                  : NULL;
  int in = 0, out = 0;
  if (e->module && rt.kind == BICO__ROUTE_ROWS && !rt.identity)
    in = rt.side == 0, out = rt.side == 1;
  else if (e->module && rt.kind != BICO__ROUTE_ROWS)
    in = rt.need[0], out = rt.need[1];
  snprintf(e->maps, sizeof e->maps, "%s%s%s", in ? "in" : "",
           in && out ? "+" : "", out ? "out" : "");
}

void bico__bridge_plan(const bico__run *r, bico__jw *w) {
  size_t nt = bico__model_ntensors(r->mt);
  bico__jw_begin_array(w);
  for (size_t ti = 0; ti < nt; ti++) {
    plan_entry e;
    plan_entry_of(r, ti, &e);
    bico__jw_begin_array(w);
    bico__jw_string(w, e.name);
    if (e.source) bico__jw_string(w, e.source); else bico__jw_null(w);
    bico__jw_string(w, e.handling);
    if (e.module) bico__jw_string(w, e.module); else bico__jw_null(w);
    bico__jw_string(w, e.maps);
    bico__jw_end_array(w);
  }
  bico__jw_end_array(w);
}

/* 1 when path names a folder holding `file` (a regular file). */
static char *in_folder(bico_ctx *ctx, const char *path, const char *file) {
  struct stat s;
  if (path == NULL || stat(path, &s) != 0 || !S_ISDIR(s.st_mode)) return NULL;
  char *p = bico__path_join(ctx, path, file);
  if (p != NULL && (stat(p, &s) != 0 || !S_ISREG(s.st_mode))) {
    bico__free(ctx, p);
    p = NULL;
  }
  return p;
}

bico_status bico__bridge_fingerprint(bico__run *r, int side, char hex[65]) {
  bico_ctx *ctx = r->ctx;
  const char *base = r->t->files[side ? BICO_FILE_TARGET_BASE
                                      : BICO_FILE_SOURCE_BASE];
  const char *given = r->t->files[side ? BICO_FILE_TARGET_CONFIG
                                       : BICO_FILE_SOURCE_CONFIG];
  char *files[2] = {NULL, NULL};
  static const char *const ROLES[2] = {"config.json", "tokenizer.json"};
  /* The kind the handle asks for when making a bridge, the bridge's when
   * reading one (bico__bridge_begin adopted it). */
  int full = r->t->param[BICO_TRANSFER_FINGERPRINT] == BICO_FINGERPRINT_FULL;
  bico_status st = bico__family_config(ctx, given, base, &files[0]);
  if (st == BICO_OK) files[1] = in_folder(ctx, base, "tokenizer.json");
  if (st == BICO_OK && full)
    bico__xfer_log(r, "bico: the full fingerprint of the %s file %s: "
                      "reading all of it",
                   bico_transfer_file_name(side ? BICO_FILE_TARGET_BASE
                                                : BICO_FILE_SOURCE_BASE),
                   base);
  if (st == BICO_OK)
    st = bico__fingerprint(ctx, side ? r->tb : r->sb, full,
                           (const char *const *)files, ROLES, 2, hex);
  bico__free(ctx, files[0]);
  bico__free(ctx, files[1]);
  return st;
}

/* ---- Reading a bridge ---- */

static const char *path_of(const bico__run *r) {
  return r->t->files[BICO_FILE_BRIDGE];
}

static const bico__json *member(const bico__bridge *b, const char *key) {
  return bico__json_get(&b->doc->root, key);
}

static bico_status malformed(bico__run *r, const char *what) {
  return bico__fail(r->ctx, BICO_E_FORMAT,
                    "transfer_run: the bridge file %s: %s", path_of(r), what);
}

/* x within the bounds bico_transfer_set_param would accept for p. */
static int in_bounds(int p, double x) {
  double lo, hi;
  unsigned fl;
  if (bico_transfer_param_bounds(p, &lo, &hi, &fl) != BICO_OK) return 0;
  return x >= lo && x <= hi && !((fl & BICO_PARAM_LO_OPEN) && x == lo) &&
         !((fl & BICO_PARAM_HI_OPEN) && x == hi) &&
         !((fl & BICO_PARAM_INTEGER) && x != floor(x));
}

/* A recorded option against the handle's: adopted when the handle left
 * it unset, else compared.  One outside the option's bounds (a method
 * 99, a rank tolerance of 2) is a malformed bridge: an edited description
 * must not set what bico_transfer_set_param would refuse.  `absent`: the
 * value of a key older bridges lack (0: none).  The values' words for the
 * message. */
static bico_status take_param(bico__run *r, int p, const char *key,
                              const bico__json *v, double absent) {
  bico_transfer *t = r->t;
  double x = absent; /* an older bridge: the value it was made with */
  if (v != NULL || absent == 0) {
    if (v == NULL || (v->type != BICO__JSON_INT && v->type != BICO__JSON_REAL))
      return malformed(r, "options without a number for each map option");
    x = v->type == BICO__JSON_INT ? (double)v->u.i : v->u.d;
  }
  if (!in_bounds(p, x))
    return bico__fail(r->ctx, BICO_E_FORMAT,
                      "transfer_run: the bridge file %s: options: %s %.17g "
                      "is outside that option's bounds",
                      path_of(r), key, x);
  if (!t->pset[p]) {
    r->bridge->saved[p] = t->param[p];
    r->bridge->took_param[p] = 1;
    t->param[p] = x;
    return BICO_OK;
  }
  if (t->param[p] == x) return BICO_OK;
  char a[64], b[64];
  const char *na = NULL, *nb = NULL;
  if (p == BICO_TRANSFER_METHOD)
    na = bico_transfer_method_name((int)x), nb = bico_transfer_method_name((int)t->param[p]);
  if (p == BICO_TRANSFER_FINGERPRINT)
    na = bico_transfer_fingerprint_name((int)x),
    nb = bico_transfer_fingerprint_name((int)t->param[p]);
  if (na == NULL) snprintf(a, sizeof a, "%.17g", x), na = a;
  if (nb == NULL) snprintf(b, sizeof b, "%.17g", t->param[p]), nb = b;
  return bico__fail(r->ctx, BICO_E_ARG,
                    "transfer_run: the bridge file %s was made with %s %s; "
                    "this transfer sets %s (leave it unset to take the "
                    "bridge's, or make a bridge with it)",
                    path_of(r), key, na, nb);
}

static bico_status take_string(bico__run *r, int s, const bico__json *v) {
  bico_transfer *t = r->t;
  const char *x = v && v->type == BICO__JSON_STRING ? v->u.s : NULL;
  if (v == NULL || (v->type != BICO__JSON_STRING && v->type != BICO__JSON_NULL))
    return malformed(r, "options without a string or null for each string");
  if (t->strings[s] == NULL) {
    if (x == NULL) return BICO_OK;
    if ((t->strings[s] = bico__strdup(r->ctx, x)) == NULL) return BICO_E_NOMEM;
    r->bridge->took_string[s] = 1;
    return BICO_OK;
  }
  if (x != NULL && strcmp(x, t->strings[s]) == 0) return BICO_OK;
  return bico__fail(r->ctx, BICO_E_ARG,
                    "transfer_run: the bridge file %s was made with %s %s; "
                    "this transfer sets \"%s\"",
                    path_of(r), bico_transfer_string_name(s),
                    x ? x : "unset", t->strings[s]);
}

/* Splits and ties: the bridge's lists installed when the handle has none,
 * else the same entries (in any order) required. */
static bico_status take_lists(bico__run *r, const bico__json *sp,
                              const bico__json *ti) {
  bico_transfer *t = r->t;
  bico_ctx *ctx = r->ctx;
  if (sp == NULL || sp->type != BICO__JSON_ARRAY || ti == NULL ||
      ti->type != BICO__JSON_ARRAY)
    return malformed(r, "options without the splits and ties");
  for (size_t i = 0; i < sp->n; i++) {
    const bico__json *e = &sp->u.items[i];
    if (e->type != BICO__JSON_ARRAY || e->n != 2 ||
        e->u.items[0].type != BICO__JSON_STRING ||
        e->u.items[1].type != BICO__JSON_INT || e->u.items[1].u.i < 1)
      return malformed(r, "a split that is not [suffix, k]");
  }
  for (size_t i = 0; i < ti->n; i++) {
    const bico__json *e = &ti->u.items[i];
    if (e->type != BICO__JSON_ARRAY || e->n != 2 ||
        e->u.items[0].type != BICO__JSON_STRING ||
        e->u.items[1].type != BICO__JSON_STRING)
      return malformed(r, "a tie that is not [tensor, module]");
  }
  int same = t->nsplits == sp->n && t->nties == ti->n;
  for (size_t i = 0; same && i < sp->n; i++) {
    int found = 0;
    for (size_t j = 0; j < t->nsplits && !found; j++)
      found = strcmp(t->splits[j].suffix, sp->u.items[i].u.items[0].u.s) == 0 &&
              (int64_t)t->splits[j].k == sp->u.items[i].u.items[1].u.i;
    same = found;
  }
  for (size_t i = 0; same && i < ti->n; i++) {
    int found = 0;
    for (size_t j = 0; j < t->nties && !found; j++)
      found = strcmp(t->ties[j].tensor, ti->u.items[i].u.items[0].u.s) == 0 &&
              strcmp(t->ties[j].module, ti->u.items[i].u.items[1].u.s) == 0;
    same = found;
  }
  if (same) return BICO_OK;
  if (t->nsplits > 0 || t->nties > 0)
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: the bridge file %s was made with %zu "
                      "splits and %zu ties; this transfer's differ (leave "
                      "them unset to take the bridge's)",
                      path_of(r), sp->n, ti->n);
  /* Installed in the handle for the run, as bico_transfer_add_split and
   * _add_tie would (bico__bridge_end takes them out again). */
  r->bridge->took_splits = r->bridge->took_ties = 1;
  if (sp->n > 0 && (t->splits = bico__calloc(ctx, sp->n, sizeof *t->splits)) == NULL)
    return BICO_E_NOMEM;
  for (size_t i = 0; i < sp->n; i++, t->nsplits++) {
    t->splits[i].suffix = bico__strdup(ctx, sp->u.items[i].u.items[0].u.s);
    t->splits[i].k = (size_t)sp->u.items[i].u.items[1].u.i;
    if (t->splits[i].suffix == NULL) return BICO_E_NOMEM;
  }
  if (ti->n > 0 && (t->ties = bico__calloc(ctx, ti->n, sizeof *t->ties)) == NULL)
    return BICO_E_NOMEM;
  for (size_t i = 0; i < ti->n; i++) {
    t->ties[i].tensor = bico__strdup(ctx, ti->u.items[i].u.items[0].u.s);
    t->ties[i].module = bico__strdup(ctx, ti->u.items[i].u.items[1].u.s);
    t->nties++; /* freed by bico__bridge_end, partial or not */
    if (t->ties[i].tensor == NULL || t->ties[i].module == NULL)
      return BICO_E_NOMEM;
  }
  return BICO_OK;
}

/* The bases (and configs) the bridge recorded, for the slots the handle
 * leaves unset. */
static bico_status take_files(bico__run *r) {
  bico_transfer *t = r->t;
  const bico__json *models = member(r->bridge, "models");
  for (size_t i = 0; i < NFILES; i++) {
    const bico__json *m = bico__json_get(models, FILE_KEY[i]);
    const bico__json *p = bico__json_get(m, "realpath");
    if (t->files[FILES[i]] != NULL || p == NULL || p->type != BICO__JSON_STRING)
      continue;
    if ((t->files[FILES[i]] = bico__strdup(r->ctx, p->u.s)) == NULL)
      return BICO_E_NOMEM;
    r->bridge->took_file[FILES[i]] = 1;
  }
  return BICO_OK;
}

static bico_status open_bridge(bico__run *r) {
  bico_ctx *ctx = r->ctx;
  bico__bridge *b = r->bridge;
  const char *path = path_of(r), *v = NULL, *desc = NULL;
  bico_status st = bico_stfile_open(ctx, path, &b->f);
  if (st != BICO_OK)
    return bico__xfer_wrap_file(ctx, st, BICO_FILE_BRIDGE, path);
  if (bico_stfile_metadata_get(b->f, "bico.bridge", &v) != BICO_OK ||
      bico_stfile_metadata_get(b->f, "bico.bridge.json", &desc) != BICO_OK)
    return malformed(r, "no bico.bridge metadata: not a bridge (made by "
                        "bico_transfer_bridge, `bico bridge`)");
  if (strcmp(v, BICO__BRIDGE_FORMAT) != 0)
    return bico__fail(ctx, BICO_E_VERSION,
                      "transfer_run: the bridge file %s has format %s; this "
                      "library reads format %s",
                      path, v, BICO__BRIDGE_FORMAT);
  st = bico__json_parse(ctx, "transfer_run: the bridge file's description",
                        desc, strlen(desc), &b->doc);
  if (st == BICO_OK && b->doc->root.type != BICO__JSON_OBJECT)
    st = malformed(r, "its description is not a JSON object");
  return st;
}

bico_status bico__bridge_begin(bico__run *r) {
  if (r->t->files[BICO_FILE_BRIDGE] == NULL || r->bridge != NULL)
    return BICO_OK;
  r->bridge = bico__calloc(r->ctx, 1, sizeof *r->bridge);
  if (r->bridge == NULL) return BICO_E_NOMEM;
  bico_status st = open_bridge(r);
  const bico__json *opt = st == BICO_OK ? member(r->bridge, "options") : NULL;
  if (st == BICO_OK && (opt == NULL || opt->type != BICO__JSON_OBJECT))
    st = malformed(r, "no options object");
  for (size_t i = 0; i < NPARAMS && st == BICO_OK; i++)
    st = take_param(r, PARAMS[i].param, PARAMS[i].key,
                    bico__json_get(opt, PARAMS[i].key), PARAMS[i].absent);
  for (size_t i = 0; i < NSTRINGS && st == BICO_OK; i++)
    st = take_string(r, STRINGS[i],
                     bico__json_get(opt, bico_transfer_string_name(STRINGS[i])));
  if (st == BICO_OK)
    st = take_lists(r, bico__json_get(opt, "splits"),
                    bico__json_get(opt, "ties"));
  if (st == BICO_OK) st = take_files(r);
  r->method = (int)r->t->param[BICO_TRANSFER_METHOD];
  return st;
}

void bico__bridge_end(bico__run *r) {
  bico__bridge *b = r->bridge;
  if (b == NULL) return;
  bico_transfer *t = r->t;
  bico_ctx *ctx = r->ctx;
  for (int p = 0; p < BICO__NPARAMS; p++)
    if (b->took_param[p]) t->param[p] = b->saved[p];
  for (int s = 0; s < BICO__NSTRINGS; s++)
    if (b->took_string[s]) {
      bico__free(ctx, t->strings[s]);
      t->strings[s] = NULL;
    }
  for (int f = 0; f < BICO__NFILES; f++)
    if (b->took_file[f]) {
      bico__free(ctx, t->files[f]);
      t->files[f] = NULL;
    }
  if (b->took_splits) {
    for (size_t i = 0; i < t->nsplits; i++) bico__free(ctx, t->splits[i].suffix);
    bico__free(ctx, t->splits);
    t->splits = NULL;
    t->nsplits = 0;
  }
  if (b->took_ties) {
    for (size_t i = 0; i < t->nties; i++) {
      bico__free(ctx, t->ties[i].tensor);
      bico__free(ctx, t->ties[i].module);
    }
    bico__free(ctx, t->ties);
    t->ties = NULL;
    t->nties = 0;
  }
  bico_stfile_free(b->f);
  bico__json_doc_free(b->doc);
  bico__free(ctx, b);
  r->bridge = NULL;
}

/* The base of one side against the bridge's fingerprint of it. */
static bico_status verify_side(bico__run *r, int side) {
  static const char *const KEY[2] = {"source_base", "target_base"};
  const bico__json *m = bico__json_get(member(r->bridge, "models"), KEY[side]);
  const bico__json *fp = bico__json_get(m, "fingerprint");
  if (fp == NULL || fp->type != BICO__JSON_STRING || fp->n != 64)
    return malformed(r, "no fingerprint of a base");
  char hex[65];
  bico_status st = bico__bridge_fingerprint(r, side, hex);
  if (st != BICO_OK) return st;
  if (strcmp(hex, fp->u.s) == 0) return BICO_OK;
  const bico__json *p = bico__json_get(m, "path");
  int which = side ? BICO_FILE_TARGET_BASE : BICO_FILE_SOURCE_BASE;
  int full = r->t->param[BICO_TRANSFER_FINGERPRINT] == BICO_FINGERPRINT_FULL;
  return bico__fail(r->ctx, BICO_E_ARG,
                    "transfer_run: the %s file %s is not the model the "
                    "bridge file %s was made for (%s): its fingerprint is "
                    "%.16s..., the bridge's %.16s... (the %s fingerprint "
                    "covers the tensors' names, shapes, dtypes and %s, and "
                    "its config.json and tokenizer.json)",
                    bico_transfer_file_name(which), r->t->files[which],
                    path_of(r),
                    p && p->type == BICO__JSON_STRING ? p->u.s : "?", hex,
                    fp->u.s, full ? "full" : "sampled",
                    full ? "every byte"
                         : "192 sampled bytes of each (make the bridge "
                           "with the full fingerprint to compare every byte)");
}

/* ---- The maps' digest and ranges ---- */

void bico__bridge_digest_begin(struct bico__sha256 *h, const char *desc) {
  char line[64];
  size_t len = strlen(desc);
  int n = snprintf(line, sizeof line, "description\t%zu\n", len);
  bico__sha256_init(h);
  bico__sha256_update(h, "bico-bridge-digest 1\n", 21);
  bico__sha256_update(h, line, (size_t)n);
  bico__sha256_update(h, desc, len);
}

void bico__bridge_digest_tensor(struct bico__sha256 *h, const char *name,
                                size_t nbytes) {
  char line[64];
  int n = snprintf(line, sizeof line, "%zu\n", nbytes);
  bico__sha256_update(h, "tensor\t", 7);
  bico__sha256_update(h, name, strlen(name) + 1); /* with its NUL */
  bico__sha256_update(h, line, (size_t)n);
}

/* The values as the file stores them, little-endian whatever the host. */
void bico__bridge_digest_f32(struct bico__sha256 *h, const float *x,
                             size_t n) {
  unsigned char buf[4096];
  for (size_t i = 0; i < n;) {
    size_t m = 0;
    for (; i < n && m + 4 <= sizeof buf; i++, m += 4) {
      uint32_t bits;
      memcpy(&bits, &x[i], 4);
      bico__put_u32(buf + m, bits);
    }
    bico__sha256_update(h, buf, m);
  }
}

void bico__bridge_digest_f64(struct bico__sha256 *h, const double *x,
                             size_t n) {
  unsigned char buf[4096];
  for (size_t i = 0; i < n;) {
    size_t m = 0;
    for (; i < n && m + 8 <= sizeof buf; i++, m += 8) bico__put_f64(buf + m, x[i]);
    bico__sha256_update(h, buf, m);
  }
}

/* A Procrustes map is orthogonal or semi-orthogonal (a partial isometry
 * with BICO_NULL_DROP; 2x2 rotations and their blocks with structure):
 * no entry exceeds 1 in magnitude.  MAP_TOL is room for float rounding
 * (test/fuzz/fuzz_xcov.c's bound on the solver): an edited entry of 1e30
 * (q_proj weights of 2e30, exit 0, before this check) is far outside. */
#define MAP_TOL 1e-3f

/* Entries [first, first + n) of map tensor `key` ([ba, bb], or [k, ba,
 * bb] for a split output): finite and at most 1 + MAP_TOL in magnitude,
 * else BICO_E_FORMAT naming the element and its value. */
static bico_status check_entries(bico__run *r, const char *key,
                                 const float *x, size_t n, size_t first,
                                 size_t k, size_t ba, size_t bb) {
  for (size_t i = 0; i < n; i++) {
    if (fabsf(x[i]) <= 1.0f + MAP_TOL) continue; /* NaN fails here too */
    size_t e = first + i, bs = ba * bb;
    char at[96];
    if (k > 1)
      snprintf(at, sizeof at, "[%zu, %zu, %zu]", e / bs, e % bs / bb, e % bb);
    else
      snprintf(at, sizeof at, "[%zu, %zu]", e / bb, e % bb);
    return bico__fail(r->ctx, BICO_E_FORMAT,
                      "transfer_run: the bridge file %s: tensor %s: element "
                      "%s is %g, not a map entry (a map is orthogonal: its "
                      "entries are finite and at most 1 in magnitude)",
                      path_of(r), key, at, (double)x[i]);
  }
  return BICO_OK;
}

/* The [k, 2] (rank, thin) pairs of rank tensor `key`, each block's map
 * ba x bb: a rank is an integer in [0, min(ba, bb)] (it is cast to size_t,
 * and rank 0 drops the layer), a thin flag 0 or 1. */
static bico_status check_ranks(bico__run *r, const char *key,
                               const double *rk, size_t k, size_t ba,
                               size_t bb) {
  size_t most = ba < bb ? ba : bb;
  for (size_t b = 0; b < k; b++) {
    double rank = rk[2 * b], thin = rk[2 * b + 1];
    if (!(rank >= 0 && rank <= (double)most && rank == floor(rank)))
      return bico__fail(r->ctx, BICO_E_FORMAT,
                        "transfer_run: the bridge file %s: tensor %s: "
                        "element [%zu, 0] is %g, not a rank (an integer in "
                        "[0, %zu] for a %zu x %zu map)",
                        path_of(r), key, b, rank, most, ba, bb);
    if (thin != 0 && thin != 1)
      return bico__fail(r->ctx, BICO_E_FORMAT,
                        "transfer_run: the bridge file %s: tensor %s: "
                        "element [%zu, 1] is %g, not a thin flag (0 or 1)",
                        path_of(r), key, b, thin);
  }
  return BICO_OK;
}

/* The map tensor and rank tensor of one entry of the description's maps
 * ([target module, side, source module, d_A, d_B, k]): found, of the
 * shapes the entry gives, read, range-checked and added to the digest
 * (map, then ranks).  buf holds cap floats. */
static bico_status check_entry(bico__run *r, const bico__json *e,
                               struct bico__sha256 *h, float *buf,
                               size_t cap) {
  const bico_stfile *f = r->bridge->f;
  const bico__json *it = e->type == BICO__JSON_ARRAY && e->n == 6
                             ? e->u.items
                             : NULL;
  if (it == NULL || it[0].type != BICO__JSON_STRING ||
      it[1].type != BICO__JSON_STRING || it[3].type != BICO__JSON_INT ||
      it[4].type != BICO__JSON_INT || it[5].type != BICO__JSON_INT ||
      (strcmp(it[1].u.s, "in") != 0 && strcmp(it[1].u.s, "out") != 0) ||
      it[3].u.i < 0 || it[4].u.i < 0 || it[5].u.i < 1 ||
      it[3].u.i % it[5].u.i != 0 || it[4].u.i % it[5].u.i != 0)
    return malformed(r, "a maps entry that is not [target module, side, "
                        "source module, d_A, d_B, k] (k dividing both)");
  size_t k = (size_t)it[5].u.i, ba = (size_t)it[3].u.i / k,
         bb = (size_t)it[4].u.i / k;
  int side = strcmp(it[1].u.s, "out") == 0;
  size_t want[3] = {k, ba, bb}, rwant[2] = {k, 2}, idx, ridx, nd;
  const size_t *sh;
  int dt;
  char key[1100], rkey[1100];
  bico__bridge_key(key, sizeof key, it[0].u.s, side, 0);
  bico__bridge_key(rkey, sizeof rkey, it[0].u.s, side, 1);
  for (int t = 0; t < 2; t++) {
    const char *name = t ? rkey : key;
    size_t *at = t ? &ridx : &idx;
    const size_t *w = t ? rwant : k > 1 ? want : want + 1;
    size_t wn = t ? 2 : k > 1 ? 3 : 2;
    if (bico_stfile_find(f, name, at) != BICO_OK ||
        bico_stfile_tensor_info(f, *at, NULL, &dt, &nd, &sh) != BICO_OK ||
        dt != (t ? BICO_DTYPE_F64 : BICO_DTYPE_F32) || nd != wn ||
        memcmp(sh, w, wn * sizeof *sh) != 0) {
      bico__clear(r->ctx); /* the lookup's miss is said below */
      return bico__fail(r->ctx, BICO_E_FORMAT,
                        "transfer_run: the bridge file %s: tensor %s is "
                        "missing or not %s of the shape its description "
                        "gives",
                        path_of(r), name, t ? "F64" : "F32");
    }
  }
  size_t total = k * ba * bb;
  bico__bridge_digest_tensor(h, key, total * 4);
  bico_status st = BICO_OK;
  for (size_t at = 0; at < total && st == BICO_OK; at += cap) {
    size_t n = total - at < cap ? total - at : cap;
    st = bico_stfile_read_f32_range(f, idx, at, buf, n);
    if (st == BICO_OK) st = check_entries(r, key, buf, n, at, k, ba, bb);
    if (st == BICO_OK) bico__bridge_digest_f32(h, buf, n);
  }
  double *rk = st == BICO_OK ? bico__alloc(r->ctx, 2 * k * sizeof *rk) : NULL;
  if (st == BICO_OK && rk == NULL) st = BICO_E_NOMEM;
  if (st == BICO_OK) st = bico_stfile_read_f64(f, ridx, rk, 2 * k);
  if (st == BICO_OK) st = check_ranks(r, rkey, rk, k, ba, bb);
  if (st == BICO_OK) {
    bico__bridge_digest_tensor(h, rkey, 2 * k * 8);
    bico__bridge_digest_f64(h, rk, 2 * k);
  }
  bico__free(r->ctx, rk);
  return st;
}

/* One pass over the bridge before any map is used: every map and rank
 * tensor the description lists checked (check_entry), no other tensor in
 * the file, and the digest of description, maps and ranks equal to the
 * one recorded ("bico.bridge.sha256"; bridges made before it have none
 * and get the range checks alone).  The digest catches what the ranges
 * cannot: an entry or a rank edited within its range (a rank set to 0
 * drops a layer). */
static bico_status check_maps(bico__run *r) {
  bico_ctx *ctx = r->ctx;
  const bico_stfile *f = r->bridge->f;
  const bico__json *maps = member(r->bridge, "maps");
  const char *desc = NULL, *want = NULL;
  size_t count = 0;
  if (maps == NULL || maps->type != BICO__JSON_ARRAY)
    return malformed(r, "no maps list");
  bico_status st = bico_stfile_metadata_get(f, "bico.bridge.json", &desc);
  if (st == BICO_OK) st = bico_stfile_count(f, &count);
  if (st != BICO_OK) return st;
  if (count != 2 * maps->n)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "transfer_run: the bridge file %s holds %zu tensors; "
                      "its description lists %zu maps (a map and its ranks "
                      "each)",
                      path_of(r), count, maps->n);
  if (bico_stfile_metadata_get(f, BICO__BRIDGE_DIGEST_KEY, &want) != BICO_OK) {
    bico__clear(ctx);
    want = NULL;
  }
  struct bico__sha256 h;
  bico__bridge_digest_begin(&h, desc);
  size_t cap = (size_t)1 << 16;
  float *buf = bico__alloc(ctx, cap * sizeof *buf);
  if (buf == NULL) return BICO_E_NOMEM;
  for (size_t i = 0; i < maps->n && st == BICO_OK; i++)
    st = check_entry(r, &maps->u.items[i], &h, buf, cap);
  bico__free(ctx, buf);
  if (st != BICO_OK) return st;
  if (want == NULL) {
    bico__xfer_log(r, "bico: the bridge file %s records no digest (made "
                      "before bridges had one): its maps are range-checked "
                      "only",
                   path_of(r));
    return BICO_OK;
  }
  char got[65];
  bico__sha256_final_hex(&h, got);
  if (strcmp(got, want) == 0) return BICO_OK;
  return bico__fail(ctx, BICO_E_FORMAT,
                    "transfer_run: the bridge file %s changed after it was "
                    "written: the digest of its description, maps and "
                    "ranks is %.16s..., the one it records %.16s... (make "
                    "the bridge again)",
                    path_of(r), got, want);
}

const bico_stfile *bico__bridge_file(const bico__run *r) {
  return r->bridge ? r->bridge->f : NULL;
}

static int same_str(const char *a, const bico__json *v) {
  if (v->type == BICO__JSON_NULL) return a == NULL;
  return v->type == BICO__JSON_STRING && a != NULL && strcmp(a, v->u.s) == 0;
}

bico_status bico__bridge_verify(bico__run *r) {
  if (r->bridge == NULL) return BICO_OK;
  bico_status st = verify_side(r, 0);
  if (st == BICO_OK) st = verify_side(r, 1);
  if (st != BICO_OK) return st;
  const bico__json *plan = member(r->bridge, "plan");
  size_t nt = bico__model_ntensors(r->mt);
  if (plan == NULL || plan->type != BICO__JSON_ARRAY)
    return malformed(r, "no plan");
  if (plan->n != nt)
    return bico__fail(r->ctx, BICO_E_ARG,
                      "transfer_run: the bridge file %s plans %zu target "
                      "tensors; this target has %zu",
                      path_of(r), plan->n, nt);
  for (size_t ti = 0; ti < nt; ti++) {
    const bico__json *e = &plan->u.items[ti];
    plan_entry x;
    plan_entry_of(r, ti, &x);
    if (e->type != BICO__JSON_ARRAY || e->n != 5)
      return malformed(r, "a plan entry that is not [tensor, source, "
                          "handling, module, maps]");
    const char *got[5] = {x.name, x.source, x.handling, x.module, x.maps};
    for (int k = 0; k < 5; k++)
      if (!same_str(got[k], &e->u.items[k]))
        return bico__fail(
            r->ctx, BICO_E_ARG,
            "transfer_run: the bridge file %s plans target tensor %s "
            "otherwise (%s %s; this run: %s): the models or options differ "
            "from the bridge's",
            path_of(r), x.name,
            (const char *const[5]){"tensor", "source", "handling", "module",
                                   "maps"}[k],
            e->u.items[k].type == BICO__JSON_STRING ? e->u.items[k].u.s
                                                    : "none",
            got[k] ? got[k] : "none");
  }
  return check_maps(r);
}

/* The name of a map tensor: "<module>:in", "<module>:out", and with
 * ":rank" its ranks. */
void bico__bridge_key(char *buf, size_t cap, const char *module, int side,
                      int rank) {
  snprintf(buf, cap, "%s:%s%s", module, side ? "out" : "in",
           rank ? ":rank" : "");
}

static bico_status find_map(bico__run *r, const char *key, int dtype,
                            size_t ndim, const size_t *want, size_t *idx) {
  const bico_stfile *f = r->bridge->f;
  int dt;
  size_t nd;
  const size_t *sh;
  if (bico_stfile_find(f, key, idx) != BICO_OK)
    return bico__fail(r->ctx, BICO_E_NOTFOUND,
                      "transfer_run: the bridge file %s has no tensor %s (a "
                      "map this run needs)",
                      path_of(r), key);
  bico_status st = bico_stfile_tensor_info(f, *idx, NULL, &dt, &nd, &sh);
  if (st == BICO_OK &&
      (nd != ndim || memcmp(sh, want, nd * sizeof *sh) != 0 || dt != dtype))
    st = bico__fail(r->ctx, BICO_E_SHAPE,
                    "transfer_run: the bridge file %s: tensor %s has another "
                    "shape or dtype than this run's models give",
                    path_of(r), key);
  return st;
}

bico_status bico__bridge_load(bico__run *r, size_t mi, int side,
                              bico__map **out) {
  bico_ctx *ctx = r->ctx;
  bico__modstate *s = &r->mods[mi];
  const char *tm = bico__xfer_mname(r->mt, mi);
  size_t dout_a, din_a, dout_b, din_b, k = side ? s->k : 1, idx, ridx;
  bico_status st = bico_model_module_dims(r->ms, s->src, &dout_a, &din_a);
  if (st == BICO_OK) st = bico_model_module_dims(r->mt, mi, &dout_b, &din_b);
  if (st != BICO_OK) return st;
  size_t da = side ? dout_a : din_a, db = side ? dout_b : din_b;
  if (da % k || db % k)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "module %s: output widths %zu and %zu do not split in "
                      "%zu blocks", tm, da, db, k);
  size_t ba = da / k, bb = db / k;
  size_t shape[3] = {k, ba, bb}, rshape[2] = {k, 2};
  char key[1100], rkey[1100];
  bico__bridge_key(key, sizeof key, tm, side, 0);
  bico__bridge_key(rkey, sizeof rkey, tm, side, 1);
  st = find_map(r, key, BICO_DTYPE_F32, k > 1 ? 3 : 2,
                k > 1 ? shape : shape + 1, &idx);
  if (st == BICO_OK) st = find_map(r, rkey, BICO_DTYPE_F64, 2, rshape, &ridx);
  if (st != BICO_OK) return st;
  bico__map *maps = bico__calloc(ctx, k, sizeof *maps);
  double *rank = bico__alloc(ctx, 2 * k * sizeof *rank);
  if (maps == NULL || rank == NULL) st = BICO_E_NOMEM;
  if (st == BICO_OK) st = bico_stfile_read_f64(r->bridge->f, ridx, rank, 2 * k);
  /* check_maps saw these bytes; what is read now is checked again, so
   * that no cast or product depends on the file staying as it was. */
  if (st == BICO_OK) st = check_ranks(r, rkey, rank, k, ba, bb);
  for (size_t b = 0; b < k && st == BICO_OK; b++) {
    maps[b].da = ba;
    maps[b].db = bb;
    maps[b].rank = (size_t)rank[2 * b];
    maps[b].thin = rank[2 * b + 1] != 0;
    maps[b].r = bico__alloc(ctx, ba * bb * sizeof(float));
    if (maps[b].r == NULL) st = BICO_E_NOMEM;
    if (st == BICO_OK)
      st = bico_stfile_read_f32_range(r->bridge->f, idx, b * ba * bb,
                                      maps[b].r, ba * bb);
    if (st == BICO_OK)
      st = check_entries(r, key, maps[b].r, ba * bb, b * ba * bb, k, ba, bb);
  }
  bico__free(ctx, rank);
  if (st != BICO_OK) {
    for (size_t b = 0; maps && b < k; b++) bico__free(ctx, maps[b].r);
    bico__free(ctx, maps);
    return st;
  }
  *out = maps;
  return BICO_OK;
}
