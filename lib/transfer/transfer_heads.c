/* Structure-aware maps for decoder blocks (Llama, Mistral, Qwen2, Gemma):
 * when both models' families are known (config.json, lib/model/family.c) the
 * output maps of q_proj/k_proj, v_proj/o_proj and gate_proj/up_proj/
 * down_proj are solved together per layer from their combined statistics
 * instead of one free-form Procrustes map per module side.
 *
 * Attention (source heads H_a in G_a key/value groups, target H_b in G_b,
 * one head width hd):
 *   - heads and groups are matched by an assignment (Hungarian) on
 *     head-level scores: a group pair scores its key heads' block plus the
 *     best assignment of its query heads; unmatched target heads (more
 *     heads or groups in the target) get no map, hence no update;
 *   - each matched group pair gets one map on head_dim shared by its key
 *     head and every matched query head: a 2x2 rotation per RoPE frequency
 *     pair, in closed form from the pair's 2x2 statistic summed over the
 *     group's heads (SO(2) commutes with the rotary embedding; a
 *     reflection does not, so none is allowed);
 *   - value and output projection: per matched group pair one orthogonal
 *     map on head_dim (Procrustes of v_proj's block plus o_proj's matched
 *     head blocks), on v_proj's rows and o_proj's columns, with o_proj's
 *     heads matched as the query heads are.
 * SwiGLU: one map of the intermediate space from gate_proj's and up_proj's
 * output statistics plus down_proj's input statistic.
 *
 * A layer's maps are solved once, kept until each of its module sides has
 * taken its copy, and solved in the calling thread (never by the pool). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib.h"
#include "family.h"
#include "fileio.h"
#include "transfer_internal.h"

enum { R_Q = 0, R_K, R_V, R_O, R_GATE, R_UP, R_DOWN, R_COUNT };
static const char *const SUFFIX[R_COUNT] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
    "mlp.down_proj"};
/* The side of each role that the structure decides (1 = output maps). */
static const int SIDE[R_COUNT] = {1, 1, 1, 0, 1, 1, 0};

/* The role of module name n, and the length of its layer prefix. */
static int role_of(const char *n, size_t *plen) {
  size_t len = strlen(n);
  for (int k = 0; k < R_COUNT; k++) {
    size_t sl = strlen(SUFFIX[k]);
    if (len >= sl && strcmp(n + len - sl, SUFFIX[k]) == 0 &&
        (len == sl || n[len - sl - 1] == '.')) {
      *plen = len - sl;
      return k;
    }
  }
  return -1;
}

typedef struct bico__hentry {
  char *prefix; /* target layer prefix with its kind */
  int attn;
  bico__map m[4]; /* attn: q, k, v, o; mlp: the one map in m[0] */
  unsigned taken; /* bit per role slot */
  int fallback;   /* the layer has no structured form: its modules take
                     free-form maps (decided, and logged, once per layer) */
} hentry;

typedef struct bico__hcache {
  hentry *e;
  size_t n, cap;
} hcache;

static void entry_free(bico_ctx *ctx, hentry *e) {
  for (int i = 0; i < 4; i++) bico__free(ctx, e->m[i].r);
  bico__free(ctx, e->prefix);
  memset(e, 0, sizeof *e);
}

void bico__xfer_heads_free(bico__run *r) {
  hcache *c = r->hc;
  if (c == NULL) return;
  for (size_t i = 0; i < c->n; i++) entry_free(r->ctx, &c->e[i]);
  bico__free(r->ctx, c->e);
  bico__free(r->ctx, c);
  r->hc = NULL;
}

int bico__xfer_structured(const bico__run *r, size_t mi, int side) {
  if (!r->structure_on || mi >= r->nm) return 0;
  const bico__modstate *s = &r->mods[mi];
  if (s->src == BICO__NONE || (side && s->k != 1)) return 0;
  size_t pl;
  int role = role_of(bico__xfer_mname(r->mt, mi), &pl);
  if (role < 0 || SIDE[role] != side) return 0;
  size_t spl;
  return role_of(bico__xfer_mname(r->ms, s->src), &spl) == role;
}

/* ---- Families at setup ---- */

static void describe(const bico__family *f, char *buf, size_t cap) {
  const char *rope = bico_transfer_rope_name(f->rope);
  snprintf(buf, cap, "%s (%zu heads, %zu key/value, head_dim %zu, rope %s)",
           f->type, f->heads, f->kv_heads, f->head_dim, rope ? rope : "?");
}

bico_status bico__xfer_families(bico__run *r) {
  const bico_transfer *t = r->t;
  r->structure_on = 0;
  if (!bico__xfer_is_bico(r->method) ||
      t->param[BICO_TRANSFER_STRUCTURE] == BICO_STRUCTURE_FREE)
    return BICO_OK;
  static const char *const WHAT[2] = {"source", "target"};
  bico_status st = BICO_OK;
  /* r->fam holds each side's config.json as bico__xfer_load_models read
   * it; here only its attention geometry is checked and overridden. */
  for (int s = 0; s < 2 && st == BICO_OK; s++) {
    st = bico__family_geometry(r->ctx, r->fam_path[s], &r->fam[s]);
    if (st == BICO_OK)
      st = bico__family_override(
          r->ctx, WHAT[s], &r->fam[s], (size_t)t->param[BICO_TRANSFER_HEADS],
          (size_t)t->param[BICO_TRANSFER_KV_HEADS],
          (size_t)t->param[BICO_TRANSFER_HEAD_DIM],
          (int)t->param[BICO_TRANSFER_ROPE]);
  }
  if (st != BICO_OK) return st;
  if (!r->fam[0].known || !r->fam[1].known) {
    bico__xfer_log(r, "bico: free-form maps (no known decoder family in the "
                      "%s's config.json)",
                   !r->fam[0].known ? "source" : "target");
    return BICO_OK;
  }
  if (t->param[BICO_TRANSFER_CENTER] != 0 || t->param[BICO_TRANSFER_WHITEN] > 0) {
    bico__xfer_log(r, "bico: free-form maps (centering and whitening have no "
                      "structure-aware form)");
    return BICO_OK;
  }
  char a[160], b[160];
  describe(&r->fam[0], a, sizeof a);
  describe(&r->fam[1], b, sizeof b);
  bico__xfer_log(r, "bico: structure-aware maps; source %s, target %s", a, b);
  r->structure_on = 1;
  return BICO_OK;
}

/* ---- Statistics ---- */

/* The d_a x d_b statistic of one side of (source module sm, target module
 * tm) into a new double matrix. */
static bico_status get_stat(bico__run *r, const char *tm, const char *sm,
                            int side, size_t da, size_t db, double **out) {
  bico_ctx *ctx = r->ctx;
  *out = NULL;
  size_t n;
  if (bico__mul(da, db, &n) || n > SIZE_MAX / sizeof(double))
    return bico__fail(ctx, BICO_E_NOMEM, "a %zu x %zu statistic does not fit",
                      da, db);
  double *m = bico__calloc(ctx, n, sizeof *m);
  if (m == NULL) return BICO_E_NOMEM;
  bico_status st = BICO_OK;
  char ka[512], kb[512];
  if (r->stats != NULL) {
    const char *path = r->t->files[BICO_FILE_STATS];
    size_t idx, ndim;
    const size_t *shape;
    int dt = 0;
    snprintf(kb, sizeof kb, "%s.%s", tm, side ? "out_xcov" : "in_xcov");
    if (bico_stfile_find(r->stats, kb, &idx) != BICO_OK)
      st = bico__fail(ctx, BICO_E_NOTFOUND,
                      "statistics file %s has no tensor %s (module %s)", path,
                      kb, tm);
    if (st == BICO_OK)
      st = bico_stfile_tensor_info(r->stats, idx, NULL, &dt, &ndim, &shape);
    if (st == BICO_OK && dt != BICO_DTYPE_F64 && dt != BICO_DTYPE_F32)
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "statistics file %s: tensor %s is %s; statistics are "
                      "F64 or F32",
                      path, kb, bico_dtype_name(dt));
    if (st == BICO_OK && (ndim != 2 || shape[0] != da || shape[1] != db))
      st = bico__fail(ctx, BICO_E_SHAPE,
                      "statistics file %s: tensor %s should be [%zu, %zu] "
                      "(source %s x target %s widths)",
                      path, kb, da, db, sm, tm);
    if (st == BICO_OK) {
      st = bico_stfile_read_f64_range(r->stats, idx, 0, m, n);
      bico__stfile_drop(r->stats, idx);
    }
  } else {
    const char *pa = r->t->files[BICO_FILE_SOURCE_CALIB];
    const char *pb = r->t->files[BICO_FILE_TARGET_CALIB];
    const char *suffix = side ? "output_grad" : "input";
    size_t ia, ib, rows;
    bico_xcov *xc = NULL;
    snprintf(ka, sizeof ka, "%s.%s", sm, suffix);
    snprintf(kb, sizeof kb, "%s.%s", tm, suffix);
    st = bico__calib_find(ctx, r->sc, pa, ka, da, &ia, &rows);
    if (st == BICO_OK) st = bico__calib_find(ctx, r->tc, pb, kb, db, &ib, &rows);
    if (st == BICO_OK) st = bico_xcov_create(ctx, da, db, 0, &xc);
    if (st == BICO_OK)
      st = bico__calib_accumulate(ctx, tm, r->sc, pa, ia, da, r->tc, pb, ib,
                                  db, 1, &xc);
    if (st == BICO_OK) st = bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, m, db);
    bico_xcov_free(xc);
  }
  if (st != BICO_OK) {
    bico__free(ctx, m);
    return st;
  }
  *out = m;
  return BICO_OK;
}

/* ---- Assignment ---- */

/* Maximum-score assignment of n rows to m columns (Hungarian algorithm with
 * potentials, O(n^2 m)); match[i] is row i's column, or BICO__NONE when
 * n > m leaves it out. */
static bico_status assign(bico_ctx *ctx, size_t n, size_t m,
                          const double *score, size_t *match) {
  int tr = n > m;
  size_t rn = tr ? m : n, rm = tr ? n : m; /* rn <= rm */
  double *u = bico__calloc(ctx, rn + 1, sizeof *u);
  double *v = bico__calloc(ctx, rm + 1, sizeof *v);
  double *minv = bico__calloc(ctx, rm + 1, sizeof *minv);
  size_t *p = bico__calloc(ctx, rm + 1, sizeof *p);
  size_t *way = bico__calloc(ctx, rm + 1, sizeof *way);
  unsigned char *used = bico__calloc(ctx, rm + 1, 1);
  bico_status st = BICO_OK;
  if (!u || !v || !minv || !p || !way || !used) st = BICO_E_NOMEM;
#define COST(i, j) \
  (-(tr ? score[((j) - 1) * m + (i) - 1] : score[((i) - 1) * m + (j) - 1]))
  for (size_t i = 1; i <= rn && st == BICO_OK; i++) {
    p[0] = i;
    size_t j0 = 0;
    for (size_t j = 0; j <= rm; j++) {
      minv[j] = INFINITY;
      used[j] = 0;
    }
    do {
      used[j0] = 1;
      size_t i0 = p[j0], j1 = 0;
      double delta = INFINITY;
      for (size_t j = 1; j <= rm; j++)
        if (!used[j]) {
          double cur = COST(i0, j) - u[i0] - v[j];
          if (cur < minv[j]) {
            minv[j] = cur;
            way[j] = j0;
          }
          if (minv[j] < delta) {
            delta = minv[j];
            j1 = j;
          }
        }
      for (size_t j = 0; j <= rm; j++)
        if (used[j]) {
          u[p[j]] += delta;
          v[j] -= delta;
        } else {
          minv[j] -= delta;
        }
      j0 = j1;
    } while (p[j0] != 0);
    do {
      size_t j1 = way[j0];
      p[j0] = p[j1];
      j0 = j1;
    } while (j0);
  }
#undef COST
  if (st == BICO_OK) {
    for (size_t i = 0; i < n; i++) match[i] = BICO__NONE;
    for (size_t j = 1; j <= rm; j++)
      if (p[j]) {
        if (tr)
          match[j - 1] = p[j] - 1;
        else
          match[p[j] - 1] = j - 1;
      }
  }
  bico__free(ctx, u);
  bico__free(ctx, v);
  bico__free(ctx, minv);
  bico__free(ctx, p);
  bico__free(ctx, way);
  bico__free(ctx, used);
  return st;
}

/* ---- Attention ---- */

typedef struct attn_dims {
  size_t ha, ga, hb, gb, hd;
  int rope;
} attn_dims;

/* Dimension pair p of a head (RoPE's frequency pair p). */
static void pair_dims(const attn_dims *a, size_t p, size_t *i, size_t *j) {
  if (a->rope == BICO_ROPE_INTERLEAVED) {
    *i = 2 * p;
    *j = 2 * p + 1;
  } else {
    *i = p;
    *j = p + a->hd / 2;
  }
}

/* The 2x2 block of pair p between source head x and target head y of a
 * statistic with ld columns, added into n[4]. */
static void add_pair(const attn_dims *a, const double *M, size_t ld, size_t x,
                     size_t y, size_t p, double n[4]) {
  size_t i, j;
  pair_dims(a, p, &i, &j);
  const double *rx = M + (x * a->hd + i) * ld + y * a->hd;
  const double *ry = M + (x * a->hd + j) * ld + y * a->hd;
  n[0] += rx[i];
  n[1] += rx[j];
  n[2] += ry[i];
  n[3] += ry[j];
}

/* How well head x matches head y: with RoPE, the sum over pairs of the
 * best rotation's value max_R tr(R^T N) = |(N00 + N11, N10 - N01)|;
 * without, the block's Frobenius norm. */
static double head_score(const attn_dims *a, const double *M, size_t ld,
                         size_t x, size_t y) {
  double s = 0;
  if (a->rope == BICO_ROPE_NONE) {
    for (size_t i = 0; i < a->hd; i++)
      for (size_t j = 0; j < a->hd; j++) {
        double v = M[(x * a->hd + i) * ld + y * a->hd + j];
        s += v * v;
      }
    return sqrt(s);
  }
  for (size_t p = 0; p < a->hd / 2; p++) {
    double n[4] = {0, 0, 0, 0};
    add_pair(a, M, ld, x, y, p, n);
    s += hypot(n[0] + n[3], n[2] - n[1]);
  }
  return s;
}

/* A hd x hd block of a statistic (ld columns) added into blk. */
static void add_block(size_t hd, const double *M, size_t ld, size_t x,
                      size_t y, double *blk) {
  for (size_t i = 0; i < hd; i++)
    for (size_t j = 0; j < hd; j++)
      blk[i * hd + j] += M[(x * hd + i) * ld + y * hd + j];
}

static void put_block(bico__map *m, size_t hd, size_t x, size_t y,
                      const float *blk) {
  for (size_t i = 0; i < hd; i++)
    memcpy(m->r + (x * hd + i) * m->db + y * hd, blk + i * hd,
           hd * sizeof *blk);
}

static bico_status new_map(bico_ctx *ctx, bico__map *m, size_t da, size_t db) {
  m->da = da;
  m->db = db;
  m->rank = 0;
  m->r = bico__calloc(ctx, da * db, sizeof *m->r);
  return m->r ? BICO_OK : BICO_E_NOMEM;
}

/* Widths and names of role k in the layer (prefixes pt / ps). */
static bico_status layer_module(bico__run *r, const char *pt, const char *ps,
                                int k, char *tn, char *sn, size_t cap,
                                size_t dims[4]) {
  size_t it, is;
  snprintf(tn, cap, "%s%s", pt, SUFFIX[k]);
  snprintf(sn, cap, "%s%s", ps, SUFFIX[k]);
  if (bico_model_find_module(r->mt, tn, &it) != BICO_OK ||
      bico_model_find_module(r->ms, sn, &is) != BICO_OK) {
    bico__clear(r->ctx);
    return BICO_E_NOTFOUND;
  }
  bico_status st = bico_model_module_dims(r->mt, it, &dims[0], &dims[1]);
  if (st == BICO_OK) st = bico_model_module_dims(r->ms, is, &dims[2], &dims[3]);
  return st; /* dims: target out, in; source out, in */
}

/* Checks a model's attention widths against its family. */
static bico_status check_widths(bico__run *r, int s, const char *mod,
                                size_t width, size_t heads, const char *field) {
  const bico__family *f = &r->fam[s];
  if (width == heads * f->head_dim) return BICO_OK;
  return bico__fail(r->ctx, BICO_E_SHAPE,
                    "%s: %s %zu x head_dim %zu = %zu, but %s module %s is %zu "
                    "wide",
                    r->fam_path[s], field, heads, f->head_dim,
                    heads * f->head_dim, s ? "target" : "source", mod, width);
}

/* Group x's map onto target group y commuting with RoPE (fblk, hd x hd):
 * per frequency pair the rotation maximising tr(R^T N), N the pair's 2x2
 * statistic summed over the key head and the group's matched query heads
 * (hm: source query head -> target query head or BICO__NONE). */
static void rope_rotations(const attn_dims *a, const double *mk, size_t ldk,
                           const double *mq, size_t ldq, size_t x, size_t y,
                           const size_t *hm, float *fblk) {
  const size_t hd = a->hd, ra = a->ha / a->ga;
  memset(fblk, 0, hd * hd * sizeof *fblk);
  for (size_t p = 0; p < hd / 2; p++) {
    double n[4] = {0, 0, 0, 0};
    add_pair(a, mk, ldk, x, y, p, n);
    for (size_t i = 0; i < ra; i++)
      if (hm[x * ra + i] != BICO__NONE)
        add_pair(a, mq, ldq, x * ra + i, hm[x * ra + i], p, n);
    /* argmax over SO(2) of tr(R^T N): (cos, sin) along
     * (N00 + N11, N10 - N01); an empty statistic keeps the identity. */
    double c = n[0] + n[3], s = n[2] - n[1], h = hypot(c, s);
    c = h > 0 ? c / h : 1;
    s = h > 0 ? s / h : 0;
    size_t i, j;
    pair_dims(a, p, &i, &j);
    fblk[i * hd + i] = (float)c;
    fblk[i * hd + j] = (float)-s;
    fblk[j * hd + i] = (float)s;
    fblk[j * hd + j] = (float)c;
  }
}

static bico_status solve_attn(bico__run *r, const char *pt, const char *ps,
                              hentry *e, int *fallback) {
  bico_ctx *ctx = r->ctx;
  char tn[4][512], sn[4][512];
  size_t d[4][4];
  bico_status st = BICO_OK;
  for (int k = R_Q; k <= R_O && st == BICO_OK; k++)
    st = layer_module(r, pt, ps, k, tn[k], sn[k], sizeof tn[k], d[k]);
  if (st == BICO_E_NOTFOUND) {
    *fallback = 1;
    bico__xfer_log(r, "bico: layer %s: attention modules incomplete; "
                      "free-form maps", pt);
    return BICO_OK;
  }
  if (st != BICO_OK) return st;
  const bico__family *fa = &r->fam[0], *fb = &r->fam[1];
  static const char *const FIELD[4] = {
      "num_attention_heads", "num_key_value_heads", "num_key_value_heads",
      "num_attention_heads"};
  for (int k = R_Q; k <= R_O && st == BICO_OK; k++) {
    int in = k == R_O; /* o_proj: the heads are its input */
    size_t hs = k == R_Q || k == R_O ? fa->heads : fa->kv_heads;
    size_t ht = k == R_Q || k == R_O ? fb->heads : fb->kv_heads;
    st = check_widths(r, 0, sn[k], d[k][2 + in], hs, FIELD[k]);
    if (st == BICO_OK) st = check_widths(r, 1, tn[k], d[k][in], ht, FIELD[k]);
  }
  if (st != BICO_OK) return st;
  if (fa->head_dim != fb->head_dim || fa->rope != fb->rope) {
    *fallback = 1;
    bico__xfer_log(r, "bico: layer %s: head_dim %zu/%zu or RoPE layouts "
                      "differ; free-form attention maps", pt, fa->head_dim,
                   fb->head_dim);
    return BICO_OK;
  }
  attn_dims a = {fa->heads, fa->kv_heads, fb->heads, fb->kv_heads,
                 fa->head_dim, fa->rope};
  size_t ra = a.ha / a.ga, rb = a.hb / a.gb, hd = a.hd;
  double *M[4] = {NULL, NULL, NULL, NULL};
  for (int k = R_Q; k <= R_O && st == BICO_OK; k++) {
    int side = k == R_O ? 0 : 1;
    st = get_stat(r, tn[k], sn[k], side, d[k][2 + !side], d[k][!side], &M[k]);
  }
  size_t ldq = a.hb * hd, ldk = a.gb * hd;
  double *G = NULL, *sub = NULL, *blk = NULL;
  size_t *gmatch = NULL, *qmatch = NULL, *hm = NULL;
  float *fblk = NULL;
  if (st == BICO_OK) {
    G = bico__calloc(ctx, a.ga * a.gb, sizeof *G);
    sub = bico__calloc(ctx, ra * rb, sizeof *sub);
    gmatch = bico__calloc(ctx, a.ga, sizeof *gmatch);
    qmatch = bico__calloc(ctx, ra, sizeof *qmatch);
    hm = bico__calloc(ctx, a.ha, sizeof *hm); /* source head -> target head */
    blk = bico__calloc(ctx, hd * hd, sizeof *blk);
    fblk = bico__calloc(ctx, hd * hd, sizeof *fblk);
    if (!G || !sub || !gmatch || !qmatch || !hm || !blk || !fblk)
      st = BICO_E_NOMEM;
  }
  /* Group pairs score their key heads plus their best query assignment. */
  for (size_t x = 0; x < a.ga && st == BICO_OK; x++)
    for (size_t y = 0; y < a.gb && st == BICO_OK; y++) {
      for (size_t i = 0; i < ra; i++)
        for (size_t j = 0; j < rb; j++)
          sub[i * rb + j] = head_score(&a, M[R_Q], ldq, x * ra + i, y * rb + j);
      st = assign(ctx, ra, rb, sub, qmatch);
      double s = head_score(&a, M[R_K], ldk, x, y);
      for (size_t i = 0; i < ra && st == BICO_OK; i++)
        if (qmatch[i] != BICO__NONE) s += sub[i * rb + qmatch[i]];
      G[x * a.gb + y] = s;
    }
  if (st == BICO_OK) st = assign(ctx, a.ga, a.gb, G, gmatch);
  for (size_t i = 0; i < a.ha; i++) hm[i] = BICO__NONE;
  for (size_t x = 0; x < a.ga && st == BICO_OK; x++) {
    size_t y = gmatch[x];
    if (y == BICO__NONE) continue;
    for (size_t i = 0; i < ra; i++)
      for (size_t j = 0; j < rb; j++)
        sub[i * rb + j] = head_score(&a, M[R_Q], ldq, x * ra + i, y * rb + j);
    st = assign(ctx, ra, rb, sub, qmatch);
    for (size_t i = 0; i < ra && st == BICO_OK; i++)
      if (qmatch[i] != BICO__NONE) hm[x * ra + i] = y * rb + qmatch[i];
  }
  if (st == BICO_OK) st = new_map(ctx, &e->m[0], a.ha * hd, a.hb * hd);
  if (st == BICO_OK) st = new_map(ctx, &e->m[1], a.ga * hd, a.gb * hd);
  if (st == BICO_OK) st = new_map(ctx, &e->m[2], a.ga * hd, a.gb * hd);
  if (st == BICO_OK) st = new_map(ctx, &e->m[3], a.ha * hd, a.hb * hd);
  for (size_t x = 0; x < a.ga && st == BICO_OK; x++) {
    size_t y = gmatch[x];
    if (y == BICO__NONE) continue;
    /* q/k: one map per group, commuting with RoPE. */
    if (a.rope == BICO_ROPE_NONE) {
      memset(blk, 0, hd * hd * sizeof *blk);
      add_block(hd, M[R_K], ldk, x, y, blk);
      for (size_t i = 0; i < ra; i++)
        if (hm[x * ra + i] != BICO__NONE)
          add_block(hd, M[R_Q], ldq, x * ra + i, hm[x * ra + i], blk);
      st = bico_procrustes_solve_matrix(r->proc, hd, hd, blk, hd, fblk, hd,
                                        NULL);
    } else {
      rope_rotations(&a, M[R_K], ldk, M[R_Q], ldq, x, y, hm, fblk);
    }
    if (st != BICO_OK) break;
    put_block(&e->m[1], hd, x, y, fblk);
    e->m[1].rank += hd;
    for (size_t i = 0; i < ra; i++)
      if (hm[x * ra + i] != BICO__NONE) {
        put_block(&e->m[0], hd, x * ra + i, hm[x * ra + i], fblk);
        e->m[0].rank += hd;
      }
    /* v/o: one orthogonal map per group on head_dim. */
    memset(blk, 0, hd * hd * sizeof *blk);
    add_block(hd, M[R_V], ldk, x, y, blk);
    for (size_t i = 0; i < ra; i++)
      if (hm[x * ra + i] != BICO__NONE)
        add_block(hd, M[R_O], ldq, x * ra + i, hm[x * ra + i], blk);
    st = bico_procrustes_solve_matrix(r->proc, hd, hd, blk, hd, fblk, hd, NULL);
    if (st != BICO_OK) break;
    put_block(&e->m[2], hd, x, y, fblk);
    e->m[2].rank += hd;
    for (size_t i = 0; i < ra; i++)
      if (hm[x * ra + i] != BICO__NONE) {
        put_block(&e->m[3], hd, x * ra + i, hm[x * ra + i], fblk);
        e->m[3].rank += hd;
      }
  }
  for (int k = 0; k < 4; k++) bico__free(ctx, M[k]);
  bico__free(ctx, G);
  bico__free(ctx, sub);
  bico__free(ctx, gmatch);
  bico__free(ctx, qmatch);
  bico__free(ctx, hm);
  bico__free(ctx, blk);
  bico__free(ctx, fblk);
  if (st != BICO_OK) st = bico__xfer_wrap(ctx, st, "layer", pt);
  return st;
}

static bico_status solve_mlp(bico__run *r, const char *pt, const char *ps,
                             hentry *e, int *fallback) {
  bico_ctx *ctx = r->ctx;
  char tn[512], sn[512];
  size_t d[4], fa = 0, fb = 0;
  double *sum = NULL;
  bico_status st = BICO_OK;
  for (int k = R_GATE; k <= R_DOWN && st == BICO_OK; k++) {
    if (layer_module(r, pt, ps, k, tn, sn, sizeof tn, d) != BICO_OK) {
      bico__clear(ctx);
      continue; /* a SwiGLU without one of its parts: use the rest */
    }
    int side = SIDE[k];
    size_t da = d[2 + !side], db = d[!side];
    if (sum != NULL && (da != fa || db != fb))
      return bico__fail(ctx, BICO_E_SHAPE,
                        "layer %s: %s's intermediate width %zu x %zu differs "
                        "from gate_proj/up_proj's %zu x %zu",
                        pt, tn, da, db, fa, fb);
    double *m = NULL;
    st = get_stat(r, tn, sn, side, da, db, &m);
    if (st != BICO_OK) break;
    if (sum == NULL) {
      sum = m;
      fa = da;
      fb = db;
    } else {
      for (size_t i = 0; i < da * db; i++) sum[i] += m[i];
      bico__free(ctx, m);
    }
  }
  if (st == BICO_OK && sum == NULL) *fallback = 1;
  if (st == BICO_OK && sum != NULL) st = new_map(ctx, &e->m[0], fa, fb);
  if (st == BICO_OK && sum != NULL)
    st = bico_procrustes_solve_matrix(r->proc, fa, fb, sum, fb, e->m[0].r, fb,
                                      &e->m[0].rank);
  bico__free(ctx, sum);
  if (st != BICO_OK) st = bico__xfer_wrap(ctx, st, "layer", pt);
  return st;
}

/* The entry of target layer prefix pt and kind attn, solved if new. */
static bico_status get_entry(bico__run *r, const char *pt, size_t ptl,
                             const char *ps, size_t psl, int attn,
                             hentry **out, int *fallback) {
  bico_ctx *ctx = r->ctx;
  hcache *c = r->hc;
  *out = NULL;
  if (c == NULL) {
    c = r->hc = bico__calloc(ctx, 1, sizeof *c);
    if (c == NULL) return BICO_E_NOMEM;
  }
  for (size_t i = 0; i < c->n; i++)
    if (c->e[i].attn == attn && strlen(c->e[i].prefix) == ptl &&
        memcmp(c->e[i].prefix, pt, ptl) == 0) {
      *fallback = c->e[i].fallback;
      *out = c->e[i].fallback ? NULL : &c->e[i];
      return BICO_OK;
    }
  hentry *grown = bico__grow(ctx, c->e, c->n, &c->cap, 8, sizeof *c->e);
  if (grown == NULL) return BICO_E_NOMEM;
  c->e = grown;
  hentry *e = &c->e[c->n];
  memset(e, 0, sizeof *e);
  e->attn = attn;
  char *tp = bico__alloc(ctx, ptl + 1), *sp = bico__alloc(ctx, psl + 1);
  if (tp == NULL || sp == NULL) {
    bico__free(ctx, tp);
    bico__free(ctx, sp);
    return BICO_E_NOMEM;
  }
  memcpy(tp, pt, ptl);
  tp[ptl] = '\0';
  memcpy(sp, ps, psl);
  sp[psl] = '\0';
  e->prefix = tp;
  bico_status st = attn ? solve_attn(r, tp, sp, e, fallback)
                        : solve_mlp(r, tp, sp, e, fallback);
  bico__free(ctx, sp);
  if (st != BICO_OK) {
    entry_free(ctx, e);
    return st;
  }
  /* A fallback is kept too: the layer's other modules ask again, and the
   * decision (and its log line) is made once. */
  e->fallback = *fallback;
  for (int i = 0; i < 4 && e->fallback; i++) {
    bico__free(ctx, e->m[i].r);
    e->m[i].r = NULL;
  }
  c->n++;
  *out = e->fallback ? NULL : e;
  return BICO_OK;
}

bico_status bico__xfer_struct_solve(bico__run *r, size_t mi, int side,
                                    bico__map **out, int *fallback) {
  bico_ctx *ctx = r->ctx;
  const char *tn = bico__xfer_mname(r->mt, mi);
  const char *sn = bico__xfer_mname(r->ms, r->mods[mi].src);
  size_t ptl, psl;
  int role = role_of(tn, &ptl);
  role_of(sn, &psl);
  int attn = role <= R_O;
  *out = NULL;
  *fallback = 0;
  hentry *e = NULL;
  bico_status st = get_entry(r, tn, ptl, sn, psl, attn, &e, fallback);
  if (st != BICO_OK || *fallback) return st;
  int slot = attn ? role : 0;
  unsigned bit = 1u << (attn ? role : role - R_GATE);
  const bico__map *src = &e->m[slot];
  bico__map *maps = bico__calloc(ctx, 1, sizeof *maps);
  if (maps == NULL) return BICO_E_NOMEM;
  *maps = *src;
  maps->r = bico__alloc(ctx, src->da * src->db * sizeof *maps->r);
  if (maps->r == NULL) {
    bico__free(ctx, maps);
    return BICO_E_NOMEM;
  }
  memcpy(maps->r, src->r, src->da * src->db * sizeof *maps->r);
  (void)side;
  e->taken |= bit;
  if (e->taken == (attn ? 0xFu : 0x7u)) {
    hcache *c = r->hc;
    size_t i = (size_t)(e - c->e);
    entry_free(ctx, e);
    c->e[i] = c->e[--c->n];
  }
  *out = maps;
  return BICO_OK;
}
