/* Making a bridge (bico_transfer_bridge; docs/formats.md, "Bridge
 * files"): a set-up run without a fine-tune solves every map its plan
 * uses, in the order a run would, and writes each to the bridge file as
 * soon as it is solved (one module side in memory at a time; the solver
 * pool works ahead with BICO_TRANSFER_WORKERS > 1), with the description
 * bridge_file.c reads back: the options, the models and their
 * fingerprints, the statistics it came from, the maps and the plan -- and
 * a digest of the description and of every map and rank as written, put
 * into the header (reserved at its length) once the last map is written,
 * so that a reader can tell a file changed since. */
#define _DEFAULT_SOURCE 1 /* realpath */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "json.h"
#include "sha256.h"
#include "st_internal.h"
#include "transfer_internal.h"

/* One module side the plan uses: its target module, side and map shape. */
typedef struct bside {
  size_t mi;
  int side;
  size_t da, db, k;
} bside;

/* Every module side some target tensor asks for, in the order a run
 * first asks for it (the solver pool's order too). */
static bico_status sides_of(bico__run *r, bside **out, size_t *n) {
  bico_ctx *ctx = r->ctx;
  size_t nt = bico__model_ntensors(r->mt), cap = 0;
  unsigned char *seen = bico__calloc(ctx, 2 * (r->nm ? r->nm : 1), 1);
  bside *s = NULL;
  bico_status st = seen ? BICO_OK : BICO_E_NOMEM;
  *n = 0;
  for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) {
    size_t mi;
    int need[2];
    bico__xfer_predict_sides(r, ti, &mi, need);
    for (int side = 0; side < 2 && st == BICO_OK; side++) {
      if (!need[side] || seen[2 * mi + side]) continue;
      seen[2 * mi + side] = 1;
      size_t dout_a, din_a, dout_b, din_b;
      st = bico_model_module_dims(r->ms, r->mods[mi].src, &dout_a, &din_a);
      if (st == BICO_OK) st = bico_model_module_dims(r->mt, mi, &dout_b, &din_b);
      bside *g = st == BICO_OK ? bico__grow(ctx, s, *n, &cap, 16, sizeof *s)
                               : NULL;
      if (st == BICO_OK && g == NULL) st = BICO_E_NOMEM;
      if (st != BICO_OK) break;
      s = g;
      s[(*n)++] = (bside){mi, side, side ? dout_a : din_a,
                          side ? dout_b : din_b, side ? r->mods[mi].k : 1};
    }
  }
  bico__free(ctx, seen);
  if (st != BICO_OK) {
    bico__free(ctx, s);
    *n = 0;
    s = NULL;
  }
  *out = s;
  return st;
}

/* A model file as recorded: the path as given, its real path (where a
 * later run finds it from another folder) and, for the bases, the
 * fingerprint and tensor count. */
static bico_status model_entry(bico__run *r, bico__jw *w, const char *key,
                               int which, int side) {
  const char *path = r->t->files[which];
  if (path == NULL) return BICO_OK;
  bico__jw_key(w, key);
  bico__jw_begin_object(w);
  bico__jw_key(w, "path");
  bico__jw_string(w, path);
  char *real = realpath(path, NULL);
  bico__jw_key(w, "realpath");
  bico__jw_string(w, real ? real : path);
  free(real);
  bico_status st = BICO_OK;
  if (side >= 0) {
    char hex[65];
    st = bico__bridge_fingerprint(r, side, hex);
    bico__jw_key(w, "fingerprint");
    bico__jw_string(w, st == BICO_OK ? hex : "");
    bico__jw_key(w, "tensors");
    bico__jw_uint(w, bico__stfile_ntensors(side ? r->tb : r->sb));
  }
  bico__jw_end_object(w);
  return st;
}

/* The bridge's description (metadata "bico.bridge.json"). */
static bico_status describe(bico__run *r, const bside *s, size_t n,
                            bico__jw *w) {
  const bico_transfer *t = r->t;
  bico__jw_begin_object(w);
  bico__jw_key(w, "format");
  bico__jw_uint(w, 1);
  bico__jw_key(w, "library");
  bico__jw_string(w, bico_version_string());
  bico__jw_key(w, "method");
  bico__jw_string(w, bico_transfer_method_name(r->method));
  bico__jw_key(w, "options");
  bico__bridge_options(t, w);
  bico__jw_key(w, "models");
  bico__jw_begin_object(w);
  bico_status st = model_entry(r, w, "source_base", BICO_FILE_SOURCE_BASE, 0);
  if (st == BICO_OK) st = model_entry(r, w, "target_base", BICO_FILE_TARGET_BASE, 1);
  if (st == BICO_OK) st = model_entry(r, w, "source_config", BICO_FILE_SOURCE_CONFIG, -1);
  if (st == BICO_OK) st = model_entry(r, w, "target_config", BICO_FILE_TARGET_CONFIG, -1);
  bico__jw_end_object(w);
  bico__jw_key(w, "statistics");
  bico__jw_begin_object(w);
  static const int STATS[3] = {BICO_FILE_SOURCE_CALIB, BICO_FILE_TARGET_CALIB,
                               BICO_FILE_STATS};
  static const char *const KEY[3] = {"source_calib", "target_calib", "stats"};
  for (int k = 0; k < 3; k++) {
    bico__jw_key(w, KEY[k]);
    if (t->files[STATS[k]]) bico__jw_string(w, t->files[STATS[k]]);
    else bico__jw_null(w);
  }
  bico__jw_key(w, "lent");
  bico__jw_uint(w, bico__xfer_mem_nxcov(t));
  bico__jw_end_object(w);
  bico__jw_key(w, "maps");
  bico__jw_begin_array(w);
  for (size_t i = 0; i < n; i++) {
    bico__jw_begin_array(w);
    bico__jw_string(w, bico__xfer_mname(r->mt, s[i].mi));
    bico__jw_string(w, s[i].side ? "out" : "in");
    bico__jw_string(w, bico__xfer_mname(r->ms, r->mods[s[i].mi].src));
    bico__jw_uint(w, s[i].da);
    bico__jw_uint(w, s[i].db);
    bico__jw_uint(w, s[i].k);
    bico__jw_end_array(w);
  }
  bico__jw_end_array(w);
  bico__jw_key(w, "plan");
  bico__bridge_plan(r, w);
  bico__jw_end_object(w);
  bico_status jst = bico__jw_finish(w);
  return st != BICO_OK ? st : jst;
}

/* The file: metadata, then every map and its ranks declared, in order:
 * "<module>:in" [d_a, d_b] or "<module>:out" [d_a, d_b] (or [k, d_a/k,
 * d_b/k] for a split output), F32; "<...>:rank" [k, 2] F64 (rank, thin).
 * The digest's place is held by as many zeros as it has digits. */
static bico_status declare(bico__run *r, bico_stwriter *w, const bside *s,
                           size_t n, const char *desc) {
  char zeros[65];
  memset(zeros, '0', 64);
  zeros[64] = '\0';
  bico_status st = bico_stwriter_add_metadata(w, "bico.bridge",
                                              BICO__BRIDGE_FORMAT);
  if (st == BICO_OK)
    st = bico_stwriter_add_metadata(w, "bico.version", bico_version_string());
  if (st == BICO_OK) st = bico_stwriter_add_metadata(w, "bico.bridge.json", desc);
  if (st == BICO_OK)
    st = bico_stwriter_add_metadata(w, BICO__BRIDGE_DIGEST_KEY, zeros);
  char key[1100];
  for (size_t i = 0; i < n && st == BICO_OK; i++) {
    const char *tm = bico__xfer_mname(r->mt, s[i].mi);
    size_t k = s[i].k, sh[3] = {k, s[i].da / k, s[i].db / k}, rs[2] = {k, 2};
    if (s[i].da % k || s[i].db % k)
      return bico__fail(r->ctx, BICO_E_SHAPE,
                        "module %s: output widths %zu and %zu do not split "
                        "in %zu blocks (--split)",
                        tm, s[i].da, s[i].db, k);
    bico__bridge_key(key, sizeof key, tm, s[i].side, 0);
    st = bico_stwriter_declare(w, key, BICO_DTYPE_F32, k > 1 ? 3 : 2,
                               k > 1 ? sh : sh + 1);
    bico__bridge_key(key, sizeof key, tm, s[i].side, 1);
    if (st == BICO_OK) st = bico_stwriter_declare(w, key, BICO_DTYPE_F64, 2, rs);
  }
  return st;
}

/* Solves (or takes from the pool) one module side, writes it (and adds
 * it to the digest h, as written), frees it. */
static bico_status write_side(bico__run *r, bico_stwriter *w, const bside *s,
                              struct bico__sha256 *h) {
  bico_ctx *ctx = r->ctx;
  bico__modstate *m = &r->mods[s->mi];
  const char *tm = bico__xfer_mname(r->mt, s->mi);
  bico_status st = bico__xfer_need_side(r, s->mi, s->side);
  if (st != BICO_OK) return st;
  char key[1100];
  double ranks[2 * 64], *rk = s->k <= 64 ? ranks : bico__alloc(ctx, 2 * s->k * sizeof *rk);
  if (rk == NULL) return BICO_E_NOMEM;
  bico__bridge_key(key, sizeof key, tm, s->side, 0);
  size_t bs = (s->da / s->k) * (s->db / s->k);
  bico__bridge_digest_tensor(h, key, s->k * bs * 4);
  for (size_t b = 0; b < s->k && st == BICO_OK; b++) {
    const bico__map *mp = s->side ? &m->out[b] : &m->in;
    rk[2 * b] = (double)mp->rank;
    rk[2 * b + 1] = mp->thin;
    st = bico_stwriter_write_f32_range(w, key, b * bs, mp->r, bs);
    if (st == BICO_OK) bico__bridge_digest_f32(h, mp->r, bs);
  }
  bico__bridge_key(key, sizeof key, tm, s->side, 1);
  if (st == BICO_OK) st = bico_stwriter_write_f64(w, key, rk, 2 * s->k);
  if (st == BICO_OK) {
    bico__bridge_digest_tensor(h, key, 2 * s->k * 8);
    bico__bridge_digest_f64(h, rk, 2 * s->k);
  }
  if (rk != ranks) bico__free(ctx, rk);
  /* This side is written: its memory goes before the next is solved. */
  if (s->side) {
    for (size_t b = 0; m->out && b < m->k; b++) bico__free(ctx, m->out[b].r);
    bico__free(ctx, m->out);
    m->out = NULL;
    m->have_out = 0;
  } else {
    bico__free(ctx, m->in.r);
    m->in.r = NULL;
    m->have_in = 0;
  }
  return st;
}

bico_status bico__bridge_write(bico__run *r) {
  bico_ctx *ctx = r->ctx;
  const char *path = r->t->files[BICO_FILE_BRIDGE_OUTPUT];
  bside *s = NULL;
  size_t n = 0;
  bico__jw desc;
  bico__jw_init(&desc, ctx, 0);
  bico_stwriter *w = NULL;
  bico_status st = sides_of(r, &s, &n);
  if (st == BICO_OK && n == 0)
    st = bico__fail(ctx, BICO_E_NOTFOUND,
                    "transfer_run: no target tensor is carried by a map: a "
                    "bridge would hold nothing");
  if (st == BICO_OK) st = describe(r, s, n, &desc);
  if (st == BICO_OK) {
    st = bico_stwriter_create(ctx, path, &w);
    if (st != BICO_OK) st = bico__xfer_wrap_file(ctx, st, BICO_FILE_BRIDGE_OUTPUT, path);
  }
  if (st == BICO_OK) st = declare(r, w, s, n, desc.buf);
  if (st == BICO_OK) st = bico__xfer_pool_start(r, NULL);
  bico__xfer_log(r, "bico: bridge: %zu maps of %zu target modules to solve",
                 n, r->nm);
  /* The digest follows the description's maps, which are s in order. */
  struct bico__sha256 h;
  bico__sha256_init(&h);
  if (st == BICO_OK) bico__bridge_digest_begin(&h, desc.buf);
  for (size_t i = 0; i < n && st == BICO_OK; i++) {
    st = write_side(r, w, &s[i], &h);
    if (st == BICO_OK && r->t->progress) {
      bico_progress p = {sizeof p, (double)(i + 1), (double)n, i + 1, n, 0,
                         bico__xfer_mname(r->mt, s[i].mi)};
      r->t->progress(r->t->progress_opaque, &p);
    }
  }
  if (st == BICO_OK) {
    char hex[65];
    bico__sha256_final_hex(&h, hex);
    st = bico__stwriter_set_metadata(w, BICO__BRIDGE_DIGEST_KEY, hex);
  }
  if (st == BICO_OK) {
    st = bico_stwriter_commit(w);
    if (st != BICO_OK) st = bico__xfer_wrap_file(ctx, st, BICO_FILE_BRIDGE_OUTPUT, path);
  }
  if (st == BICO_OK)
    bico__xfer_log(r, "bico: wrote the bridge %s: %zu maps", path, n);
  bico_stwriter_free(w);
  bico__jw_free(&desc);
  bico__free(ctx, s);
  return st;
}
