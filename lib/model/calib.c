/* Calibration and statistics files: streaming rows into accumulators,
 * bico_stats_from_calib and bico_stats_merge. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "calib.h"
#include "fileio.h"

/* Rows per chunk: about 4 M floats per side, so memory stays near the
 * statistics' size whatever the calibration set's. */
#define CHUNK_FLOATS ((size_t)1 << 22)

bico_status bico__calib_find(bico_ctx *ctx, const bico_stfile *f,
                             const char *path, const char *key, size_t width,
                             size_t *index, size_t *rows) {
  size_t i;
  if (bico_stfile_find(f, key, &i) != BICO_OK)
    return bico__fail(ctx, BICO_E_NOTFOUND,
                      "calibration file %s has no tensor %s", path, key);
  int dtype;
  size_t ndim, numel;
  const size_t *shape;
  bico_status st = bico_stfile_tensor_info(f, i, NULL, &dtype, &ndim, &shape);
  if (st == BICO_OK) st = bico_stfile_tensor_size(f, i, &numel, NULL);
  if (st != BICO_OK) return st;
  if (!bico_dtype_is_float(dtype))
    return bico__fail(ctx, BICO_E_FORMAT,
                      "calibration file %s: tensor %s has dtype %s, expected "
                      "a floating-point type",
                      path, key, bico_dtype_name(dtype));
  if (ndim == 0 || shape[ndim - 1] != width)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "calibration file %s: tensor %s has last dimension %zu, "
                      "but the module's width is %zu",
                      path, key, ndim ? shape[ndim - 1] : (size_t)0, width);
  *index = i;
  *rows = numel / width;
  return BICO_OK;
}

/* After a non-finite row in rows [r, r + n): the side (0: a, 1: b) and
 * element of the first value that is finite in the file (F64) but beyond
 * float's range, which the float reader turned into Inf; -1 if none (a
 * genuine NaN or Inf). */
static int beyond_float(const bico_stfile *fa, size_t ia, const bico_stfile *fb,
                        size_t ib, size_t r, size_t n, size_t da, size_t db,
                        size_t *row, size_t *col) {
  for (int side = 0; side < 2; side++) {
    const bico_stfile *f = side ? fb : fa;
    size_t i = side ? ib : ia, d = side ? db : da;
    int dt = 0;
    bico_stfile_tensor_info(f, i, NULL, &dt, NULL, NULL);
    if (dt != BICO_DTYPE_F64) continue;
    for (size_t q = 0; q < n; q++)
      for (size_t c = 0; c < d; c++) {
        double v;
        if (bico_stfile_read_f64_range(f, i, (r + q) * d + c, &v, 1) != BICO_OK)
          return -1;
        /* FLT_MAX plus half an ulp: from there the float reader rounds to
         * Inf. */
        if (isfinite(v) && fabs(v) >= 0x1.ffffffp+127) {
          *row = r + q;
          *col = c;
          return side;
        }
      }
  }
  return -1;
}

static bico_status over(bico_ctx *ctx, const char *module, const char *path,
                        size_t row, size_t col, float *xa, float *xb,
                        const bico_stfile *f, size_t i, size_t d) {
  double v = 0;
  bico_stfile_read_f64_range(f, i, row * d + col, &v, 1);
  bico__free(ctx, xa);
  bico__free(ctx, xb);
  return bico__fail(ctx, BICO_E_NONFINITE,
                    "module %s: calibration file %s, row %zu column %zu: the "
                    "F64 value %g is beyond float's range (+-3.4e38), where "
                    "statistics are accumulated",
                    module, path, row, col, v);
}

bico_status bico__calib_accumulate(bico_ctx *ctx, const char *module,
                                   const bico_stfile *fa, const char *path_a,
                                   size_t ia, size_t da,
                                   const bico_stfile *fb, const char *path_b,
                                   size_t ib, size_t db, size_t k,
                                   bico_xcov **xcs) {
  size_t na, nb;
  bico_status st = bico_stfile_tensor_size(fa, ia, &na, NULL);
  if (st == BICO_OK) st = bico_stfile_tensor_size(fb, ib, &nb, NULL);
  if (st != BICO_OK) return st;
  size_t rows_a = na / da, rows_b = nb / db;
  if (rows_a != rows_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "module %s: source calibration (%s) has %zu rows, target "
                      "calibration (%s) has %zu",
                      module, path_a, rows_a, path_b, rows_b);
  if (k == 0 || da % k || db % k)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "module %s: widths %zu and %zu do not split in %zu "
                      "blocks",
                      module, da, db, k);
  size_t wide = da > db ? da : db;
  size_t chunk = CHUNK_FLOATS / wide;
  if (chunk == 0) chunk = 1;
  if (chunk > rows_a) chunk = rows_a ? rows_a : 1;
  float *xa = bico__alloc(ctx, chunk * da * sizeof(float));
  float *xb = bico__alloc(ctx, chunk * db * sizeof(float));
  if (xa == NULL || xb == NULL) {
    bico__free(ctx, xa);
    bico__free(ctx, xb);
    return BICO_E_NOMEM;
  }
  for (size_t r = 0; r < rows_a && st == BICO_OK; r += chunk) {
    size_t n = rows_a - r < chunk ? rows_a - r : chunk;
    st = bico_stfile_read_f32_range(fa, ia, r * da, xa, n * da);
    if (st == BICO_OK) st = bico_stfile_read_f32_range(fb, ib, r * db, xb,
                                                       n * db);
    for (size_t b = 0; b < k && st == BICO_OK; b++) {
      st = bico_xcov_add(xcs[b], n, xa + b * (da / k), da, xb + b * (db / k),
                         db);
      if (st == BICO_E_NONFINITE) {
        size_t row, col;
        int side = beyond_float(fa, ia, fb, ib, r, n, da, db, &row, &col);
        if (side >= 0)
          return over(ctx, module, side ? path_b : path_a, row, col, xa, xb,
                      side ? fb : fa, side ? ib : ia, side ? db : da);
      }
      if (st != BICO_OK) {
        /* Keep xcov's detail (which row holds NaN) and add the module. */
        char detail[512];
        snprintf(detail, sizeof detail, "%s", bico_ctx_errmsg(ctx));
        bico__fail(ctx, st, "module %s, calibration rows %zu..%zu: %s", module,
                   r, r + n - 1, detail);
      }
    }
  }
  bico__free(ctx, xa);
  bico__free(ctx, xb);
  return st;
}

bico_status bico__check_distinct(bico_ctx *ctx, const char *fn,
                                 const char *what, const char *output,
                                 const char *input, const bico_stfile *f) {
  if (output == NULL) return BICO_OK;
  size_t nt = bico__stfile_ntensors(f), n = 0;
  bico__fileuse *u = bico__alloc(ctx, (nt + 2) * sizeof *u);
  if (u == NULL) return BICO_E_NOMEM;
  u[n++] = (bico__fileuse){what, output, 1, 0, 0};
  if (input != NULL) u[n++] = (bico__fileuse){"input file", input, 0, 0, 0};
  const char *last = input;
  for (size_t i = 0; i < nt; i++) {
    const char *p;
    if (bico_stfile_tensor_path(f, i, &p) != BICO_OK) continue;
    if (last != NULL && strcmp(p, last) == 0) continue;
    u[n++] = (bico__fileuse){"input file", p, 0, 0, 0};
    last = p;
  }
  bico_status st = bico__check_files(ctx, fn, u, n);
  bico__free(ctx, u);
  return st;
}

/* ---- The statistics plan (bico_stats_plan_*) and bico_stats_from_calib ---- */

/* One statistic: a target module's side, its calibration tensors and
 * their rows in every pair of files. */
typedef struct stat_item {
  size_t module;       /* target calibration model's module */
  size_t da, db;
  char *name;          /* output tensor name: "<module>.in_xcov" ... */
  char *key_a, *key_b; /* source and target calibration tensors */
  size_t *ia, *ib;     /* their indices, per pair */
  size_t *rows;        /* per pair */
} stat_item;

struct bico_stats_plan {
  bico_ctx *ctx;
  size_t npairs;
  bico_stfile **fa, **fb;
  char **pa, **pb;     /* the paths, as given */
  bico_model *ma, *mb; /* from the first pair */
  stat_item *items;
  size_t nitems;
};

static const char *const SIDES[2][2] = {{"input", "in_xcov"},
                                        {"output_grad", "out_xcov"}};

static bico_status last_dim(const bico_stfile *f, size_t i, size_t *d) {
  size_t ndim;
  const size_t *shape;
  bico_status st = bico_stfile_tensor_info(f, i, NULL, NULL, &ndim, &shape);
  if (st != BICO_OK) return st;
  *d = ndim ? shape[ndim - 1] : 0;
  return BICO_OK;
}

static char *joined(bico_ctx *ctx, const char *a, const char *b) {
  size_t n = strlen(a) + strlen(b) + 2;
  char *p = bico__alloc(ctx, n);
  if (p != NULL) snprintf(p, n, "%s%s%s", a, *a ? "." : "", b);
  return p;
}

void bico_stats_plan_free(bico_stats_plan *p) {
  if (p == NULL) return;
  bico_ctx *ctx = p->ctx;
  for (size_t i = 0; i < p->nitems; i++) {
    stat_item *it = &p->items[i];
    bico__free(ctx, it->name);
    bico__free(ctx, it->key_a);
    bico__free(ctx, it->key_b);
    bico__free(ctx, it->ia);
    bico__free(ctx, it->ib);
    bico__free(ctx, it->rows);
  }
  bico__free(ctx, p->items);
  bico_model_free(p->ma);
  bico_model_free(p->mb);
  for (size_t k = 0; k < p->npairs; k++) {
    if (p->fa) bico_stfile_free(p->fa[k]);
    if (p->fb) bico_stfile_free(p->fb[k]);
    if (p->pa) bico__free(ctx, p->pa[k]);
    if (p->pb) bico__free(ctx, p->pb[k]);
  }
  bico__free(ctx, p->fa);
  bico__free(ctx, p->fb);
  bico__free(ctx, p->pa);
  bico__free(ctx, p->pb);
  bico__free(ctx, p);
}

/* Target module m's side s when the first target file has it: a new item
 * with its partner, widths, and indices and rows in every pair. */
static bico_status plan_side(bico_stats_plan *p, const char *fn, size_t m,
                             const char *mname, int s) {
  bico_ctx *ctx = p->ctx;
  char *key = joined(ctx, mname, SIDES[s][0]);
  if (key == NULL) return BICO_E_NOMEM;
  size_t ib;
  if (bico_stfile_find(p->fb[0], key, &ib) != BICO_OK) {
    bico__free(ctx, key);
    return BICO_OK;
  }
  stat_item *it = &p->items[p->nitems++];
  it->module = m;
  it->key_b = key;
  size_t cap = strlen(key) + 4096;
  it->key_a = bico__alloc(ctx, cap);
  it->name = joined(ctx, mname, SIDES[s][1]);
  it->ia = bico__calloc(ctx, p->npairs, sizeof *it->ia);
  it->ib = bico__calloc(ctx, p->npairs, sizeof *it->ib);
  it->rows = bico__calloc(ctx, p->npairs, sizeof *it->rows);
  if (!it->key_a || !it->name || !it->ia || !it->ib || !it->rows)
    return BICO_E_NOMEM;
  bico_status st = bico_model_map_name(p->mb, p->ma, key, it->key_a, cap, NULL);
  size_t ia;
  if (st == BICO_OK && bico_stfile_find(p->fa[0], it->key_a, &ia) != BICO_OK)
    return bico__fail(ctx, BICO_E_NOTFOUND,
                      "%s: target calibration %s has %s, but source "
                      "calibration %s lacks its partner %s",
                      fn, p->pb[0], key, p->pa[0], it->key_a);
  if (st == BICO_OK) st = last_dim(p->fa[0], ia, &it->da);
  if (st == BICO_OK) st = last_dim(p->fb[0], ib, &it->db);
  /* every pair: dtype and width, with messages naming file and tensor;
   * rows that correspond */
  for (size_t k = 0; k < p->npairs && st == BICO_OK; k++) {
    size_t ra, rb;
    st = bico__calib_find(ctx, p->fa[k], p->pa[k], it->key_a, it->da,
                          &it->ia[k], &ra);
    if (st == BICO_OK)
      st = bico__calib_find(ctx, p->fb[k], p->pb[k], key, it->db, &it->ib[k],
                            &rb);
    if (st == BICO_OK && ra != rb)
      st = bico__fail(ctx, BICO_E_SHAPE,
                      "module %s: source calibration (%s) has %zu rows, "
                      "target calibration (%s) has %zu",
                      mname, p->pa[k], ra, p->pb[k], rb);
    if (st == BICO_OK) it->rows[k] = ra;
  }
  return st;
}

static bico_status plan_create(bico_ctx *ctx, const char *fn,
                               const char *const *source_calib,
                               const char *const *target_calib, size_t npairs,
                               const char *blocks, bico_stats_plan **out) {
  *out = NULL;
  if (source_calib == NULL || target_calib == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      source_calib == NULL ? "source_calib" : "target_calib");
  if (npairs == 0)
    return bico__fail(ctx, BICO_E_ARG, "%s: no calibration files", fn);
  for (size_t k = 0; k < npairs; k++)
    if (source_calib[k] == NULL || target_calib[k] == NULL)
      return bico__fail(ctx, BICO_E_NULL, "%s: %s[%zu] is NULL", fn,
                        source_calib[k] == NULL ? "source_calib"
                                                : "target_calib",
                        k);
  bico_stats_plan *p = bico__calloc(ctx, 1, sizeof *p);
  if (p == NULL) return BICO_E_NOMEM;
  p->ctx = ctx;
  p->npairs = npairs;
  p->fa = bico__calloc(ctx, npairs, sizeof *p->fa);
  p->fb = bico__calloc(ctx, npairs, sizeof *p->fb);
  p->pa = bico__calloc(ctx, npairs, sizeof *p->pa);
  p->pb = bico__calloc(ctx, npairs, sizeof *p->pb);
  bico_status st = p->fa && p->fb && p->pa && p->pb ? BICO_OK : BICO_E_NOMEM;
  for (size_t k = 0; k < npairs && st == BICO_OK; k++) {
    p->pa[k] = bico__strdup(ctx, source_calib[k]);
    p->pb[k] = bico__strdup(ctx, target_calib[k]);
    if (p->pa[k] == NULL || p->pb[k] == NULL) st = BICO_E_NOMEM;
    if (st == BICO_OK) st = bico_stfile_open(ctx, source_calib[k], &p->fa[k]);
    if (st == BICO_OK) st = bico_stfile_open(ctx, target_calib[k], &p->fb[k]);
  }
  /* Modules and their pairing from the first pair's names. */
  if (st == BICO_OK) st = bico_model_from_stfile(ctx, p->fa[0], &p->ma);
  if (st == BICO_OK) st = bico_model_from_stfile(ctx, p->fb[0], &p->mb);
  if (st == BICO_OK && blocks != NULL) st = bico_model_set_blocks(p->ma, blocks);
  if (st == BICO_OK && blocks != NULL) st = bico_model_set_blocks(p->mb, blocks);
  size_t nmod = 0;
  if (st == BICO_OK) st = bico_model_module_count(p->mb, &nmod);
  if (st == BICO_OK) {
    p->items = bico__calloc(ctx, 2 * (nmod ? nmod : 1), sizeof *p->items);
    if (p->items == NULL) st = BICO_E_NOMEM;
  }
  /* Every (module, side) of the target file with a partner. */
  for (size_t m = 0; m < nmod && st == BICO_OK; m++) {
    const char *mname;
    st = bico_model_module(p->mb, m, &mname, NULL, NULL, NULL);
    for (int s = 0; s < 2 && st == BICO_OK; s++)
      st = plan_side(p, fn, m, mname, s);
  }
  if (st == BICO_OK && p->nitems == 0)
    st = bico__fail(ctx, BICO_E_NOTFOUND,
                    "%s: target calibration %s holds no \"<module>.input\" or "
                    "\"<module>.output_grad\" tensor",
                    fn, target_calib[0]);
  if (st != BICO_OK) {
    bico_stats_plan_free(p);
    return st;
  }
  *out = p;
  return BICO_OK;
}

bico_status bico_stats_plan_create(bico_ctx *ctx,
                                   const char *const *source_calib,
                                   const char *const *target_calib,
                                   size_t npairs, const char *blocks,
                                   bico_stats_plan **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "stats_plan_create: out is NULL");
  return plan_create(ctx, "stats_plan_create", source_calib, target_calib,
                     npairs, blocks, out);
}

bico_status bico_stats_plan_size(const bico_stats_plan *p, size_t *stats,
                                 size_t *pairs) {
  if (p == NULL) return BICO_E_NULL;
  if (stats) *stats = p->nitems;
  if (pairs) *pairs = p->npairs;
  return BICO_OK;
}

bico_status bico_stats_plan_item(const bico_stats_plan *p, size_t i,
                                 const char **name, const char **source_key,
                                 const char **target_key, size_t *d_source,
                                 size_t *d_target) {
  if (p == NULL) return BICO_E_NULL;
  if (i >= p->nitems)
    return bico__fail(p->ctx, BICO_E_ARG,
                      "stats_plan_item: statistic %zu of %zu", i, p->nitems);
  const stat_item *it = &p->items[i];
  if (name) *name = it->name;
  if (source_key) *source_key = it->key_a;
  if (target_key) *target_key = it->key_b;
  if (d_source) *d_source = it->da;
  if (d_target) *d_target = it->db;
  return BICO_OK;
}

bico_status bico_stats_plan_rows(const bico_stats_plan *p, size_t i,
                                 size_t pair, size_t *rows) {
  if (p == NULL || rows == NULL) return BICO_E_NULL;
  if (i >= p->nitems || pair >= p->npairs)
    return bico__fail(p->ctx, BICO_E_ARG,
                      "stats_plan_rows: statistic %zu of %zu, pair %zu of %zu",
                      i, p->nitems, pair, p->npairs);
  *rows = p->items[i].rows[pair];
  return BICO_OK;
}

bico_status bico_stats_from_calib(bico_ctx *ctx, const char *source_calib,
                                  const char *target_calib, const char *blocks,
                                  const char *output) {
  static const char fn[] = "stats_from_calib";
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (source_calib == NULL || target_calib == NULL || output == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      source_calib == NULL   ? "source_calib"
                      : target_calib == NULL ? "target_calib"
                                             : "output");
  bico_stats_plan *p = NULL;
  bico_stwriter *w = NULL;
  double *c = NULL;
  bico_status st =
      plan_create(ctx, fn, &source_calib, &target_calib, 1, blocks, &p);
  if (st == BICO_OK)
    st = bico__check_distinct(ctx, fn, "output", output, source_calib, p->fa[0]);
  if (st == BICO_OK)
    st = bico__check_distinct(ctx, fn, "output", output, target_calib, p->fb[0]);
  if (st == BICO_OK) st = bico_stwriter_create(ctx, output, &w);
  if (st == BICO_OK) st = bico_stwriter_add_metadata(w, "format", "bico-stats");
  size_t nitems = p ? p->nitems : 0;
  for (size_t i = 0; i < nitems && st == BICO_OK; i++) {
    size_t shape[2] = {p->items[i].da, p->items[i].db};
    st = bico_stwriter_declare(w, p->items[i].name, BICO_DTYPE_F64, 2, shape);
  }
  for (size_t i = 0; i < nitems && st == BICO_OK; i++) {
    stat_item *it = &p->items[i];
    const char *mname;
    bico_xcov *xc = NULL;
    if (st == BICO_OK) st = bico_xcov_create(ctx, it->da, it->db, 0, &xc);
    if (st == BICO_OK) {
      bico_model_module(p->mb, it->module, &mname, NULL, NULL, NULL);
      st = bico__calib_accumulate(ctx, mname, p->fa[0], source_calib,
                                  it->ia[0], it->da, p->fb[0], target_calib,
                                  it->ib[0], it->db, 1, &xc);
    }
    if (st == BICO_OK) {
      size_t n;
      c = bico__mul(it->da, it->db, &n) || n > SIZE_MAX / sizeof(double)
              ? NULL
              : bico__alloc(ctx, n * sizeof(double));
      if (c == NULL)
        st = bico__fail(ctx, BICO_E_NOMEM,
                        "%s: no memory for the statistic %s (%zu x %zu)", fn,
                        it->name, it->da, it->db);
    }
    if (st == BICO_OK) st = bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, c, it->db);
    if (st == BICO_OK)
      st = bico_stwriter_write_f64(w, it->name, c, it->da * it->db);
    bico__free(ctx, c);
    c = NULL;
    bico_xcov_free(xc);
  }
  if (st == BICO_OK) st = bico_stwriter_commit(w);
  bico_stwriter_free(w);
  bico_stats_plan_free(p);
  return st;
}

/* ---- bico_stats_merge ---- */

bico_status bico_stats_merge(bico_ctx *ctx, const char *const *inputs,
                             size_t n, const char *output) {
  static const char fn[] = "stats_merge";
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (inputs == NULL || output == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      inputs == NULL ? "inputs" : "output");
  if (n == 0)
    return bico__fail(ctx, BICO_E_ARG, "%s: no input statistics files", fn);
  for (size_t i = 0; i < n; i++)
    if (inputs[i] == NULL)
      return bico__fail(ctx, BICO_E_NULL, "%s: inputs[%zu] is NULL", fn, i);
  bico_stfile **fs = bico__calloc(ctx, n, sizeof *fs);
  if (fs == NULL) return BICO_E_NOMEM;
  bico_status st = BICO_OK;
  for (size_t i = 0; i < n && st == BICO_OK; i++) {
    st = bico_stfile_open(ctx, inputs[i], &fs[i]);
    if (st == BICO_OK)
      st = bico__check_distinct(ctx, fn, "output", output, inputs[i], fs[i]);
  }
  size_t nt = st == BICO_OK ? bico__stfile_ntensors(fs[0]) : 0;
  /* Same tensor set and shapes in every file. */
  for (size_t i = 1; i < n && st == BICO_OK; i++) {
    if (bico__stfile_ntensors(fs[i]) != nt)
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "%s: %s holds %zu tensors, %s holds %zu", fn, inputs[i],
                      bico__stfile_ntensors(fs[i]), inputs[0], nt);
    for (size_t t = 0; t < nt && st == BICO_OK; t++) {
      const char *name;
      size_t nd0, nd1, j;
      const size_t *s0, *s1;
      int dt;
      st = bico_stfile_tensor_info(fs[0], t, &name, &dt, &nd0, &s0);
      if (st != BICO_OK) break;
      if (!bico_dtype_is_float(dt)) {
        st = bico__fail(ctx, BICO_E_FORMAT,
                        "%s: %s: tensor %s is not floating point", fn,
                        inputs[0], name);
        break;
      }
      if (bico_stfile_find(fs[i], name, &j) != BICO_OK) {
        st = bico__fail(ctx, BICO_E_FORMAT, "%s: %s lacks tensor %s (in %s)",
                        fn, inputs[i], name, inputs[0]);
        break;
      }
      st = bico_stfile_tensor_info(fs[i], j, NULL, &dt, &nd1, &s1);
      if (st != BICO_OK) break;
      if (!bico_dtype_is_float(dt) || nd0 != nd1 ||
          (nd0 && memcmp(s0, s1, nd0 * sizeof *s0) != 0)) {
        char a[128], b[128];
        st = bico__fail(ctx, BICO_E_SHAPE,
                        "%s: tensor %s differs in shape or type between %s "
                        "(%s) and %s (%s %s)",
                        fn, name, inputs[0], bico__shape_text(a, sizeof a, nd0, s0),
                        inputs[i], bico_dtype_name(dt),
                        bico__shape_text(b, sizeof b, nd1, s1));
      }
    }
  }
  bico_stwriter *w = NULL;
  if (st == BICO_OK) st = bico_stwriter_create(ctx, output, &w);
  if (st == BICO_OK) st = bico_stwriter_add_metadata(w, "format", "bico-stats");
  for (size_t t = 0; t < nt && st == BICO_OK; t++) {
    const char *name;
    size_t nd;
    const size_t *s;
    st = bico_stfile_tensor_info(fs[0], t, &name, NULL, &nd, &s);
    if (st == BICO_OK) st = bico_stwriter_declare(w, name, BICO_DTYPE_F64, nd, s);
  }
  for (size_t t = 0; t < nt && st == BICO_OK; t++) {
    const char *name;
    size_t numel;
    st = bico_stfile_tensor_info(fs[0], t, &name, NULL, NULL, NULL);
    if (st == BICO_OK) st = bico_stfile_tensor_size(fs[0], t, &numel, NULL);
    if (st != BICO_OK) break;
    double *acc = bico__calloc(ctx, numel ? numel : 1, sizeof(double));
    double *tmp = bico__alloc(ctx, (numel ? numel : 1) * sizeof(double));
    if (acc == NULL || tmp == NULL) st = BICO_E_NOMEM;
    for (size_t i = 0; i < n && st == BICO_OK; i++) {
      size_t j;
      st = bico_stfile_find(fs[i], name, &j);
      if (st == BICO_OK) st = bico_stfile_read_f64(fs[i], j, tmp, numel);
      if (st == BICO_OK)
        st = bico__check_finite_f64(ctx, fn, name, tmp, 1, numel, numel);
      for (size_t e = 0; e < numel && st == BICO_OK; e++) acc[e] += tmp[e];
    }
    if (st == BICO_OK) st = bico_stwriter_write_f64(w, name, acc, numel);
    bico__free(ctx, acc);
    bico__free(ctx, tmp);
  }
  if (st == BICO_OK) st = bico_stwriter_commit(w);
  bico_stwriter_free(w);
  for (size_t i = 0; i < n; i++) bico_stfile_free(fs[i]);
  bico__free(ctx, fs);
  return st;
}

/* Vote counts as floats -> int32, refusing what is not an integer below
 * 2^31 in magnitude.  2147483647.0f rounds up to 2^31, which int32 cannot
 * hold (found by fuzzing: test/fuzz/regressions/fuzz_calib_stats), hence
 * the comparison with 2^31 itself. */
static bico_status decode_votes(bico_ctx *ctx, const char *path,
                                const char *name, const float *v, size_t n,
                                int32_t *counts, uint32_t *samples) {
  *samples = 1;
  for (size_t e = 0; e < n; e++) {
    float x = v[e];
    if (!isfinite(x) || x != floorf(x) || fabsf(x) >= 2147483648.0f)
      return bico__fail(ctx, BICO_E_FORMAT,
                        "votes file %s: tensor %s element %zu is %g, not an "
                        "integer vote count",
                        path, name, e, (double)x);
    counts[e] = (int32_t)x;
    uint32_t a = (uint32_t)(counts[e] < 0 ? -(int64_t)counts[e] : counts[e]);
    if (a > *samples) *samples = a;
  }
  return BICO_OK;
}

bico_status bico__calib_votes(bico_ctx *ctx, const bico_stfile *f,
                              const char *path, const char *name, size_t ndim,
                              const size_t *shape, bico_votes **out) {
  *out = NULL;
  size_t vi, vnd, n = 1;
  const size_t *vsh;
  for (size_t d = 0; d < ndim; d++) n *= shape[d];
  if (bico_stfile_find(f, name, &vi) != BICO_OK)
    return bico__fail(ctx, BICO_E_NOTFOUND, "votes file %s has no tensor %s",
                      path, name);
  bico_status st = bico_stfile_tensor_info(f, vi, NULL, NULL, &vnd, &vsh);
  if (st == BICO_OK &&
      (vnd != ndim || (ndim && memcmp(vsh, shape, ndim * sizeof *vsh) != 0))) {
    char a[128], b[128];
    return bico__fail(ctx, BICO_E_SHAPE,
                      "votes file %s: tensor %s is %s there but %s in the "
                      "target",
                      path, name, bico__shape_text(a, sizeof a, vnd, vsh),
                      bico__shape_text(b, sizeof b, ndim, shape));
  }
  if (st != BICO_OK) return st;
  float *v = bico__alloc(ctx, (n ? n : 1) * sizeof(float));
  int32_t *counts = bico__alloc(ctx, (n ? n : 1) * sizeof(int32_t));
  uint32_t samples = 1;
  if (v == NULL || counts == NULL) st = BICO_E_NOMEM;
  if (st == BICO_OK) st = bico_stfile_read_f32(f, vi, v, n);
  if (st == BICO_OK) st = decode_votes(ctx, path, name, v, n, counts, &samples);
  if (st == BICO_OK) st = bico_votes_create(ctx, n, 0, out);
  if (st == BICO_OK) st = bico_votes_add_counts(*out, counts, samples);
  if (st != BICO_OK) {
    bico_votes_free(*out);
    *out = NULL;
  }
  bico__free(ctx, v);
  bico__free(ctx, counts);
  return st;
}
