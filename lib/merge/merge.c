/* Merging task vectors: task arithmetic and TIES (see merge.h). */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "calib.h"
#include "fileio.h"
#include "st_internal.h"
#include "report.h"

static int cmp_desc(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x < y) - (x > y);
}

/* keep[i] = 1 for the k entries of x largest in magnitude (earlier entries
 * first among equals).  mag: n floats of scratch. */
static void top_k(const float *x, size_t n, size_t k, float *mag,
                  unsigned char *keep) {
  if (k >= n) {
    memset(keep, 1, n);
    return;
  }
  memset(keep, 0, n);
  if (k == 0) return;
  for (size_t i = 0; i < n; i++) mag[i] = fabsf(x[i]);
  qsort(mag, n, sizeof *mag, cmp_desc);
  float t = mag[k - 1];
  size_t above = 0;
  for (size_t i = 0; i < n; i++) above += fabsf(x[i]) > t;
  size_t equal_left = k - above;
  for (size_t i = 0; i < n; i++) {
    float a = fabsf(x[i]);
    if (a > t) keep[i] = 1;
    else if (a == t && equal_left > 0) {
      keep[i] = 1;
      equal_left--;
    }
  }
}

bico_status bico_merge_tensor(bico_ctx *ctx, int method, size_t ntasks,
                              size_t n, float *const *taus,
                              const double *weights, const double *densities,
                              int normalize, float *out) {
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  const char *fn = "merge_tensor";
  if (taus == NULL || weights == NULL || out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      taus == NULL ? "taus" : weights == NULL ? "weights" : "out");
  if (method != BICO_MERGE_LINEAR && method != BICO_MERGE_TIES)
    return bico__fail(ctx, BICO_E_ARG, "%s: unknown method %d", fn, method);
  if (normalize != 0 && normalize != 1)
    return bico__fail(ctx, BICO_E_ARG, "%s: normalize is %d, expected 0 or 1",
                      fn, normalize);
  if (ntasks == 0 || n == 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: %zu tasks of %zu elements; both must be at least 1",
                      fn, ntasks, n);
  for (size_t t = 0; t < ntasks; t++) {
    if (taus[t] == NULL)
      return bico__fail(ctx, BICO_E_NULL, "%s: taus[%zu] is NULL", fn, t);
    if (!isfinite(weights[t]))
      return bico__fail(ctx, BICO_E_NONFINITE, "%s: weights[%zu] is %g", fn, t,
                        weights[t]);
    double d = densities ? densities[t] : 1.0;
    if (!(d > 0 && d <= 1))
      return bico__fail(ctx, isnan(d) ? BICO_E_NONFINITE : BICO_E_ARG,
                        "%s: densities[%zu] is %g, outside (0, 1]", fn, t, d);
    if (method == BICO_MERGE_LINEAR && d != 1)
      return bico__fail(ctx, BICO_E_ARG,
                        "%s: densities[%zu] is %g, but density (trimming) "
                        "applies to TIES only",
                        fn, t, d);
    bico_status st = bico__check_finite_f32(ctx, fn, "taus[t]", taus[t], 1, n, n);
    if (st != BICO_OK) return st;
  }
  if (method == BICO_MERGE_LINEAR) {
    double wsum = 0;
    for (size_t t = 0; t < ntasks; t++) wsum += weights[t];
    double div = normalize && fabs(wsum) >= 1e-8 ? wsum : 1.0;
    for (size_t i = 0; i < n; i++) {
      double s = 0;
      for (size_t t = 0; t < ntasks; t++) s += weights[t] * (double)taus[t][i];
      out[i] = (float)(s / div);
    }
    return BICO_OK;
  }
  size_t bytes;
  if (bico__mul(ntasks, n, &bytes))
    return bico__fail(ctx, BICO_E_SHAPE, "%s: %zu x %zu overflows", fn, ntasks, n);
  unsigned char *keep = bico__alloc(ctx, bytes);
  float *mag = bico__alloc(ctx, n * sizeof(float));
  if (keep == NULL || mag == NULL) {
    bico__free(ctx, keep);
    bico__free(ctx, mag);
    return BICO_E_NOMEM;
  }
  for (size_t t = 0; t < ntasks; t++) {
    double d = densities ? densities[t] : 1.0;
    size_t k = d >= 1 ? n : (size_t)floor(d * (double)n);
    top_k(taus[t], n, k, mag, keep + t * n);
  }
  for (size_t i = 0; i < n; i++) {
    double mass = 0;
    for (size_t t = 0; t < ntasks; t++)
      if (keep[t * n + i]) mass += weights[t] * (double)taus[t][i];
    int elected = mass >= 0 ? 1 : -1;
    double num = 0, den = 0;
    for (size_t t = 0; t < ntasks; t++) {
      if (!keep[t * n + i]) continue;
      double v = weights[t] * (double)taus[t][i];
      if ((v > 0 ? 1 : v < 0 ? -1 : 0) != elected) continue;
      num += v;
      den += weights[t];
    }
    if (!normalize || den == 0) den = 1;
    out[i] = (float)(num / den);
  }
  bico__free(ctx, keep);
  bico__free(ctx, mag);
  return BICO_OK;
}

/* ==================================================================== */
/* Whole checkpoints                                                      */

typedef struct input {
  int kind;
  char *path;
  double weight, density;
  bico_stfile *f;
  bico_lora *l;
  int fifo;
} input;

struct bico_merge {
  bico_ctx *ctx;
  char *files[5];
  double param[5];
  input *in;
  size_t nin;
  void (*log)(void *, const char *);
  void *log_opaque;
  bico_progress_fn progress;
  void *progress_opaque;
};

static const char *const FILE_NAME[5] = {NULL, "base", "output",
                                         "delta output", "report"};


bico_status bico_merge_create(bico_ctx *ctx, bico_merge **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL) return bico__fail(ctx, BICO_E_NULL, "merge_create: out is NULL");
  bico_merge *m = bico__calloc(ctx, 1, sizeof *m);
  if (m == NULL) return BICO_E_NOMEM;
  m->ctx = ctx;
  m->param[BICO_MERGE_METHOD] = BICO_MERGE_LINEAR;
  m->param[BICO_MERGE_ALPHA] = 1.0;
  m->param[BICO_MERGE_NORMALIZE] = -1;
  *out = m;
  return BICO_OK;
}

static void close_inputs(bico_merge *m) {
  for (size_t i = 0; i < m->nin; i++) {
    bico_stfile_free(m->in[i].f);
    bico_lora_free(m->in[i].l);
    m->in[i].f = NULL;
    m->in[i].l = NULL;
  }
}

void bico_merge_free(bico_merge *m) {
  if (m == NULL) return;
  bico_ctx *ctx = m->ctx;
  close_inputs(m);
  for (size_t i = 0; i < m->nin; i++) bico__free(ctx, m->in[i].path);
  bico__free(ctx, m->in);
  for (int i = 0; i < 5; i++) bico__free(ctx, m->files[i]);
  bico__free(ctx, m);
}

bico_status bico_merge_set_file(bico_merge *m, int which, const char *path) {
  if (m == NULL) return BICO_E_NULL;
  bico__clear(m->ctx);
  if (which < 1 || which > 4)
    return bico__fail(m->ctx, BICO_E_ARG, "merge_set_file: unknown file slot %d",
                      which);
  if (path != NULL && path[0] == '\0')
    return bico__fail(m->ctx, BICO_E_ARG, "merge_set_file: empty path for the %s",
                      FILE_NAME[which]);
  char *p = NULL;
  if (path != NULL && (p = bico__strdup(m->ctx, path)) == NULL) return BICO_E_NOMEM;
  bico__free(m->ctx, m->files[which]);
  m->files[which] = p;
  return BICO_OK;
}

/* The option grammar (params.h, lib/base/params.c).  ALPHA is used as a
 * float. */
static const bico__param_spec MPARAM[] = {
    [BICO_MERGE_METHOD] = {"method", 0, BICO_MERGE_TIES, BICO_PARAM_INTEGER},
    [BICO_MERGE_ALPHA] = {"alpha", 0, FLT_MAX, BICO_PARAM_LO_OPEN},
    [BICO_MERGE_NORMALIZE] = {"normalize", -1, 1, BICO_PARAM_INTEGER},
    [BICO_MERGE_MAX_SHARD_SIZE] = {"max_shard_size", 0, 9007199254740992.0,
                                   BICO_PARAM_INTEGER},
};
#define NMPARAM BICO__NSPEC(MPARAM)

bico_status bico_merge_param_bounds(int param, double *lo, double *hi,
                                    unsigned *flags) {
  return bico__param_bounds(MPARAM, NMPARAM, param, lo, hi, flags);
}

const char *bico_merge_param_name(int param) {
  return bico__param_name(MPARAM, NMPARAM, param);
}

bico_status bico_merge_param_from_name(const char *name, int *param) {
  return bico__param_from_name(MPARAM, NMPARAM, name, param);
}

bico_status bico_merge_set_param(bico_merge *m, int param, double value) {
  if (m == NULL) return BICO_E_NULL;
  bico__clear(m->ctx);
  bico_status st = bico__param_set(m->ctx, "merge_set_param", MPARAM, NMPARAM,
                                   param, value);
  if (st != BICO_OK) return st;
  /* 0 is the default member (docs/api.md's enumeration rule). */
  if (param == BICO_MERGE_METHOD && value == 0) value = BICO_MERGE_LINEAR;
  m->param[param] = value;
  return BICO_OK;
}

bico_status bico_merge_get_param(const bico_merge *m, int param,
                                 double *value) {
  if (m == NULL || value == NULL) return BICO_E_NULL;
  bico_status st = bico__param_get(m->ctx, "merge_get_param", MPARAM, NMPARAM,
                                   param, value);
  if (st != BICO_OK) return st;
  *value = m->param[param];
  return BICO_OK;
}

bico_status bico_merge_add_input(bico_merge *m, int kind, const char *path,
                                 double weight, double density) {
  if (m == NULL) return BICO_E_NULL;
  bico_ctx *ctx = m->ctx;
  bico__clear(ctx);
  const char *fn = "merge_add_input";
  if (path == NULL) return bico__fail(ctx, BICO_E_NULL, "%s: path is NULL", fn);
  if (kind < BICO_MERGE_TASK_VECTOR || kind > BICO_MERGE_LORA)
    return bico__fail(ctx, BICO_E_ARG, "%s: unknown input kind %d (%s)", fn,
                      kind, path);
  if (path[0] == '\0') return bico__fail(ctx, BICO_E_ARG, "%s: empty path", fn);
  if (!isfinite(weight))
    return bico__fail(ctx, BICO_E_NONFINITE, "%s: the input %s: weight %g is not finite",
                      fn, path, weight);
  if (!(density > 0 && density <= 1))
    return bico__fail(ctx, isnan(density) ? BICO_E_NONFINITE : BICO_E_ARG,
                      "%s: the input %s: density %g is outside (0, 1]", fn, path,
                      density);
  input *p = bico__alloc(ctx, (m->nin + 1) * sizeof *p);
  char *d = bico__strdup(ctx, path);
  if (p == NULL || d == NULL) {
    bico__free(ctx, p);
    bico__free(ctx, d);
    return BICO_E_NOMEM;
  }
  if (m->nin) memcpy(p, m->in, m->nin * sizeof *p);
  memset(&p[m->nin], 0, sizeof *p);
  p[m->nin].kind = kind;
  p[m->nin].path = d;
  p[m->nin].weight = weight;
  p[m->nin].density = density;
  bico__free(ctx, m->in);
  m->in = p;
  m->nin++;
  return BICO_OK;
}

bico_status bico_merge_set_log(bico_merge *m,
                               void (*fn)(void *opaque, const char *line),
                               void *opaque) {
  if (m == NULL) return BICO_E_NULL;
  bico__clear(m->ctx);
  m->log = fn;
  m->log_opaque = opaque;
  return BICO_OK;
}

bico_status bico_merge_set_progress(bico_merge *m, bico_progress_fn fn,
                                    void *opaque) {
  if (m == NULL) return BICO_E_NULL;
  bico__clear(m->ctx);
  m->progress = fn;
  m->progress_opaque = opaque;
  return BICO_OK;
}

/* After base tensor ti of nt: work in elements + 1 per tensor (the reads
 * and writes scale with it), items in tensors. */
static void report_progress(const bico_merge *m, const bico_stfile *base,
                            size_t ti, size_t nt, bico_progress *pg,
                            const struct timespec *t0) {
  if (m->progress == NULL) return;
  size_t n = 0;
  const char *name = NULL;
  bico_stfile_tensor_size(base, ti, &n, NULL);
  bico_stfile_tensor_info(base, ti, &name, NULL, NULL, NULL);
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  pg->done = ti + 1 == nt ? pg->total : pg->done + (double)n + 1;
  pg->tensors_done = ti + 1;
  pg->elapsed = (double)(now.tv_sec - t0->tv_sec) +
                1e-9 * (double)(now.tv_nsec - t0->tv_nsec);
  pg->tensor = name;
  m->progress(m->progress_opaque, pg);
}

static void logf_(const bico_merge *m, const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void logf_(const bico_merge *m, const char *fmt, ...) {
  if (m->log == NULL) return;
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  m->log(m->log_opaque, line);
}

static int same_shape(size_t na, const size_t *a, size_t nb, const size_t *b) {
  return na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0);
}

static const char *const KIND_NAME[4] = {NULL, "task vector", "tuned checkpoint",
                                         "adapter"};

/* Every tensor of every input must land on a base tensor of its shape. */
static bico_status check_input(bico_merge *m, const char *fn,
                               const bico_stfile *base, input *in) {
  bico_ctx *ctx = m->ctx;
  const char *what = KIND_NAME[in->kind];
  if (in->f) {
    size_t n = bico__stfile_ntensors(in->f);
    for (size_t i = 0; i < n; i++) {
      const char *name;
      size_t nd, bi, bnd;
      const size_t *sh, *bsh;
      int bdt;
      bico_stfile_tensor_info(in->f, i, &name, NULL, &nd, &sh);
      if (bico_stfile_find(base, name, &bi) != BICO_OK)
        return bico__fail(ctx, BICO_E_NOTFOUND,
                          "%s: %s %s: tensor %s is not in the base %s", fn,
                          what, in->path, name, m->files[BICO_MERGE_FILE_BASE]);
      bico_stfile_tensor_info(base, bi, NULL, &bdt, &bnd, &bsh);
      char sa[128], sb[128];
      if (!same_shape(nd, sh, bnd, bsh))
        return bico__fail(ctx, BICO_E_SHAPE,
                          "%s: %s %s: tensor %s is %s there but %s in "
                          "the base",
                          fn, what, in->path, name,
                          bico__shape_text(sa, sizeof sa, nd, sh),
                          bico__shape_text(sb, sizeof sb, bnd, bsh));
      if (!bico_dtype_is_float(bdt))
        return bico__fail(ctx, BICO_E_ARG,
                          "%s: %s %s: tensor %s is not floating point "
                          "in the base, so it cannot be merged",
                          fn, what, in->path, name);
      bico_status st = bico_stfile_check_finite(in->f, i);
      if (st != BICO_OK) return st;
    }
    bico__clear(ctx);
    return BICO_OK;
  }
  double fifo = 0;
  bico_lora_get_param(in->l, BICO_LORA_FAN_IN_FAN_OUT, &fifo);
  in->fifo = fifo != 0;
  for (size_t i = 0; i < bico__lora_nmodules(in->l); i++) {
    const char *mod;
    int kind;
    size_t dout, din, bi, bnd;
    const size_t *bsh;
    bico_lora_module(in->l, i, &mod, &kind, NULL, &dout, &din, NULL, NULL);
    size_t len = strlen(mod) + 8;
    char *w = bico__alloc(ctx, len);
    if (w == NULL) return BICO_E_NOMEM;
    snprintf(w, len, "%s.weight", mod);
    int flip = kind == BICO_LORA_EMBEDDING || in->fifo;
    size_t want[2] = {flip ? din : dout, flip ? dout : din};
    bico_status st = BICO_OK;
    if (bico_stfile_find(base, w, &bi) != BICO_OK)
      st = bico__fail(ctx, BICO_E_NOTFOUND,
                      "%s: adapter %s: module %s has no tensor %s in "
                      "the base",
                      fn, in->path, mod, w);
    else {
      bico_stfile_tensor_info(base, bi, NULL, NULL, &bnd, &bsh);
      if (!same_shape(2, want, bnd, bsh))
        st = bico__fail(ctx, BICO_E_SHAPE,
                        "%s: adapter %s: module %s updates [%zu, %zu], "
                        "but the base's %s has another shape",
                        fn, in->path, mod, want[0], want[1], w);
    }
    bico__free(ctx, w);
    if (st != BICO_OK) return st;
  }
  for (size_t i = 0; i < bico__lora_nsaved(in->l); i++) {
    const char *name;
    size_t nd, bi, bnd;
    const size_t *sh, *bsh;
    bico_lora_saved(in->l, i, &name, NULL, &nd, &sh, NULL);
    if (bico_stfile_find(base, name, &bi) != BICO_OK)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "%s: adapter %s: saved tensor %s is not in the "
                        "base",
                        fn, in->path, name);
    bico_stfile_tensor_info(base, bi, NULL, NULL, &bnd, &bsh);
    char sa[128], sb[128];
    if (!same_shape(nd, sh, bnd, bsh))
      return bico__fail(ctx, BICO_E_SHAPE,
                        "%s: adapter %s: saved tensor %s is %s there "
                        "but %s in the base",
                        fn, in->path, name, bico__shape_text(sa, sizeof sa, nd, sh),
                        bico__shape_text(sb, sizeof sb, bnd, bsh));
  }
  bico__clear(ctx);
  return BICO_OK;
}

/* tau of input `in` for base tensor `name` (numel n) into tau; *has = 0
 * when the input does not touch it (tau zeroed). */
static bico_status input_tau(bico_merge *m, input *in, const char *name,
                             const double *base, size_t n, float *tau,
                             int *has) {
  bico_ctx *ctx = m->ctx;
  *has = 0;
  memset(tau, 0, n * sizeof(float));
  size_t idx;
  if (in->f) {
    if (bico_stfile_find(in->f, name, &idx) != BICO_OK) {
      bico__clear(ctx);
      return BICO_OK;
    }
    bico_status st = bico_stfile_read_f32(in->f, idx, tau, n);
    if (st != BICO_OK) return st;
    if (in->kind == BICO_MERGE_TUNED)
      for (size_t e = 0; e < n; e++) tau[e] = (float)((double)tau[e] - base[e]);
    *has = 1;
    return BICO_OK;
  }
  for (size_t k = 0; k < bico__lora_nsaved(in->l); k++) {
    const char *sn;
    const float *data;
    bico_lora_saved(in->l, k, &sn, NULL, NULL, NULL, &data);
    if (strcmp(sn, name) != 0) continue;
    for (size_t e = 0; e < n; e++) tau[e] = (float)((double)data[e] - base[e]);
    *has = 1;
    return BICO_OK;
  }
  size_t len = strlen(name);
  if (len <= 7 || strcmp(name + len - 7, ".weight") != 0) return BICO_OK;
  char *mod = bico__alloc(ctx, len - 6);
  if (mod == NULL) return BICO_E_NOMEM;
  memcpy(mod, name, len - 7);
  mod[len - 7] = '\0';
  size_t li;
  bico_status st = BICO_OK;
  if (bico_lora_find_module(in->l, mod, &li) == BICO_OK) {
    int kind;
    size_t dout, din;
    bico_lora_module(in->l, li, NULL, &kind, NULL, &dout, &din, NULL, NULL);
    int flip = kind == BICO_LORA_EMBEDDING || in->fifo;
    float *d = flip ? bico__alloc(ctx, n * sizeof(float)) : tau;
    if (d == NULL) st = BICO_E_NOMEM;
    if (st == BICO_OK) st = bico_lora_dense(in->l, li, 1.0f, 0.0f, d, din);
    if (st == BICO_OK && flip)
      for (size_t i = 0; i < dout; i++)
        for (size_t j = 0; j < din; j++) tau[j * dout + i] = d[i * din + j];
    if (flip) bico__free(ctx, d);
    *has = st == BICO_OK;
  }
  bico__clear(ctx);
  bico__free(ctx, mod);
  return st;
}

/* An input's update for tensor `name` must be finite: named by the
 * user's file and tensor (never by the merge kernel's arguments). */
static bico_status check_tau(bico_merge *m, const input *in, const char *name,
                             const float *tau, size_t n) {
  size_t e = 0;
  while (e < n && isfinite(tau[e])) e++;
  if (e == n) return BICO_OK;
  const char *v = isnan(tau[e]) ? "NaN" : "Inf";
  if (in->kind == BICO_MERGE_TUNED)
    return bico__fail(m->ctx, BICO_E_NONFINITE,
                      "merge_run: the input %s: tensor %s minus the base's is "
                      "%s at element %zu (a non-finite value in the input, or "
                      "a difference beyond float range)",
                      in->path, name, v, e);
  if (in->kind == BICO_MERGE_LORA)
    return bico__fail(m->ctx, BICO_E_NONFINITE,
                      "merge_run: the input adapter %s: its update of tensor "
                      "%s is %s at element %zu",
                      in->path, name, v, e);
  return bico__fail(m->ctx, BICO_E_NONFINITE,
                    "merge_run: the input %s: tensor %s holds %s at element "
                    "%zu",
                    in->path, name, v, e);
}

/* A model folder (like the base, bico_stwriter_output_is_folder) or a file. */
static bico_status merge_writer(bico_merge *m, const char *path,
                                bico_stwriter **w) {
  const char *base = m->files[BICO_MERGE_FILE_BASE];
  if (!bico_stwriter_output_is_folder(path, base))
    return bico_stwriter_create(m->ctx, path, w);
  return bico_stwriter_create_folder(
      m->ctx, path, base, (uint64_t)m->param[BICO_MERGE_MAX_SHARD_SIZE], w);
}

/* Like a transfer's output: the base's "__metadata__" kept (the index's
 * total_size aside: it describes the base's files) with "format": "pt"
 * added when absent (transformers refuses metadata without it), then
 * "bico.*" provenance: version, method, alpha, base and inputs. */
static bico_status provenance(bico_merge *m, const bico_stfile *base,
                              int method, float alpha, bico_stwriter *w) {
  bico_status st = bico__stwriter_provenance(
      w, base, method == BICO_MERGE_TIES ? "merge-ties" : "merge-linear",
      (double)alpha);
  if (st == BICO_OK)
    st = bico_stwriter_add_metadata(w, "bico.base", m->files[BICO_MERGE_FILE_BASE]);
  for (size_t i = 0; i < m->nin && st == BICO_OK; i++) {
    char key[48];
    snprintf(key, sizeof key, "bico.input.%zu", i + 1);
    st = bico_stwriter_add_metadata(w, key, m->in[i].path);
  }
  return st;
}

/* Every input (base, checkpoints with their shards, adapters with both
 * files) and every output compared by identity (lib/io/identity.c). */
static bico_status check_files(bico_merge *m, const char *fn,
                               const bico_stfile *base) {
  bico_ctx *ctx = m->ctx;
  const char *const *f = (const char *const *)m->files;
  size_t cap = 10 + bico__stfile_ntensors(base);
  for (size_t i = 0; i < m->nin; i++)
    cap += 3 + (m->in[i].f ? bico__stfile_ntensors(m->in[i].f) : 0);
  bico__fileuse *u = bico__alloc(ctx, cap * sizeof *u);
  char **lp = bico__calloc(ctx, 2 * m->nin + 1, sizeof *lp);
  bico_status st = u && lp ? BICO_OK : BICO_E_NOMEM;
  size_t n = 0;
  const bico_stfile *fs = base;
  for (size_t i = 0; i <= m->nin && st == BICO_OK; i++) {
    const char *what = i == 0 ? "base" : "input";
    const char *path = i == 0 ? f[BICO_MERGE_FILE_BASE] : m->in[i - 1].path;
    if (i > 0) fs = m->in[i - 1].f;
    if (i > 0 && m->in[i - 1].kind == BICO_MERGE_LORA) {
      lp[2 * i - 2] = bico__path_join(ctx, path, "adapter_model.safetensors");
      lp[2 * i - 1] = bico__path_join(ctx, path, "adapter_config.json");
      if (!lp[2 * i - 2] || !lp[2 * i - 1]) st = BICO_E_NOMEM;
      u[n++] = (bico__fileuse){"input adapter weights", lp[2 * i - 2], 0, 0, 0};
      u[n++] = (bico__fileuse){"input adapter config", lp[2 * i - 1], 0, 0, 0};
      u[n++] = (bico__fileuse){"input adapter", path, 0, 0, 3};
      continue;
    }
    u[n++] = (bico__fileuse){what, path, 0, 0, 0};
    /* a model folder (or the folder of an index): no output file in it */
    u[n++] = (bico__fileuse){what, path, 0, 0, 3};
    const char *last = path;
    size_t nt = fs ? bico__stfile_ntensors(fs) : 0;
    for (size_t k = 0; k < nt; k++) {
      const char *p;
      if (bico_stfile_tensor_path(fs, k, &p) != BICO_OK || strcmp(p, last) == 0)
        continue;
      u[n++] = (bico__fileuse){what, p, 0, 0, 0};
      last = p;
    }
  }
  /* an output folder: its weights file stands for it (the folder may be
   * created by the run) */
  char *fo[5] = {NULL, NULL, NULL, NULL, NULL};
  for (int o = 2; o <= 4 && st == BICO_OK; o++) {
    if (f[o] == NULL) continue;
    int dir = o != BICO_MERGE_FILE_REPORT &&
              bico_stwriter_output_is_folder(f[o], f[BICO_MERGE_FILE_BASE]);
    if (dir && (fo[o] = bico__path_join(ctx, f[o], "model.safetensors")) == NULL)
      st = BICO_E_NOMEM;
    else
      u[n++] = (bico__fileuse){FILE_NAME[o], dir ? fo[o] : f[o], 1, dir,
                               dir ? 2 : 0};
    /* ... and the folder itself: it may neither be nor hold any other file
     * of the run */
    if (dir && st == BICO_OK)
      u[n++] = (bico__fileuse){FILE_NAME[o], f[o], 1, 1, 1};
  }
  if (st == BICO_OK) st = bico__check_files(ctx, fn, u, n);
  for (int o = 0; o < 5; o++) bico__free(ctx, fo[o]);
  for (size_t i = 0; lp && i < 2 * m->nin; i++) bico__free(ctx, lp[i]);
  bico__free(ctx, lp);
  bico__free(ctx, u);
  return st;
}

typedef struct mscratch {
  float **taus;
  double *ws, *ds;
} mscratch;

/* Base tensor ti: the merged update written (and its report entry), or the
 * base's bytes as they are. */
static bico_status merge_one(bico_merge *m, const bico_stfile *base, size_t ti,
                             mscratch *sc, bico_stwriter *w, bico_stwriter *wd,
                             bico__report *rep, size_t *merged_count) {
  bico_ctx *ctx = m->ctx;
  int method = (int)m->param[BICO_MERGE_METHOD];
  int normalize = m->param[BICO_MERGE_NORMALIZE] < 0
                      ? method == BICO_MERGE_TIES
                      : (int)m->param[BICO_MERGE_NORMALIZE];
  float alpha = (float)m->param[BICO_MERGE_ALPHA];
  bico_status st = BICO_OK;
  const char *name;
  int dtype;
  size_t n;
  bico_stfile_tensor_info(base, ti, &name, &dtype, NULL, NULL);
  bico_stfile_tensor_size(base, ti, &n, NULL);
  size_t used = 0;
  double *b = NULL;
  float *out = NULL;
  if (bico_dtype_is_float(dtype) && n > 0) {
    b = bico__alloc(ctx, n * sizeof(double));
    out = bico__alloc(ctx, n * sizeof(float));
    if (b == NULL || out == NULL) st = BICO_E_NOMEM;
    if (st == BICO_OK) st = bico_stfile_read_f64(base, ti, b, n);
    if (st == BICO_OK) st = bico_stfile_check_finite(base, ti);
    for (size_t i = 0; i < m->nin && st == BICO_OK; i++) {
      float *tau = bico__alloc(ctx, n * sizeof(float));
      int has = 0;
      if (tau == NULL) st = BICO_E_NOMEM;
      if (st == BICO_OK) st = input_tau(m, &m->in[i], name, b, n, tau, &has);
      if (st == BICO_OK && has) st = check_tau(m, &m->in[i], name, tau, n);
      if (st == BICO_OK && has) {
        sc->taus[used] = tau;
        sc->ws[used] = m->in[i].weight;
        sc->ds[used] = m->in[i].density;
        used++;
      } else {
        bico__free(ctx, tau);
      }
    }
    if (st == BICO_OK && used > 0)
      st = bico_merge_tensor(ctx, method, used, n, sc->taus,
                             sc->ws, sc->ds, normalize, out);
    if (st != BICO_OK && strstr(bico_ctx_errmsg(ctx), name) == NULL)
      st = bico__fail(ctx, st, "merge_run: tensor %s: %s", name,
                      bico_ctx_errmsg(ctx));
  }
  double ss = 0;
  if (st == BICO_OK && used > 0) {
    for (size_t e = 0; e < n; e++) {
      out[e] *= alpha;
      ss += (double)out[e] * out[e];
      b[e] += out[e];
    }
    st = bico_stwriter_write_f64(w, name, b, n);
    if (st == BICO_OK && wd) st = bico_stwriter_write_f32(wd, name, out, n);
    (*merged_count)++;
  } else if (st == BICO_OK) {
    const void *data;
    size_t nbytes;
    st = bico_stfile_data(base, ti, &data, &nbytes);
    if (st == BICO_OK && nbytes) st = bico_stwriter_write_raw(w, name, data, nbytes);
    if (st == BICO_OK && wd && bico_dtype_is_float(dtype) && n > 0) {
      memset(out, 0, n * sizeof(float));
      st = bico_stwriter_write_f32(wd, name, out, n);
    }
  }
  if (st == BICO_OK) {
    bico__report_begin_object(rep);
    bico__report_key_string(rep, "name", name);
    bico__report_key_number(rep, "tasks", (double)used);
    bico__report_key_number(rep, "update_norm", sqrt(ss));
    bico__report_end_object(rep);
  }
  for (size_t i = 0; i < used; i++) {
    bico__free(ctx, sc->taus[i]);
    sc->taus[i] = NULL;
  }
  bico__free(ctx, b);
  bico__free(ctx, out);
  return st;
}

/* What a run refuses before opening any file (bico_merge_run and
 * bico_merge_check alike): the base and the output given, some input, no
 * two outputs on one path, no density below 1 for LINEAR.  fn: the API
 * name the messages start with. */
static bico_status check_options(bico_merge *m, const char *fn) {
  bico_ctx *ctx = m->ctx;
  const char *const *f = (const char *const *)m->files;
  if (f[BICO_MERGE_FILE_BASE] == NULL || f[BICO_MERGE_FILE_OUTPUT] == NULL)
    return bico__fail(ctx, BICO_E_ARG, "%s: missing the %s file", fn,
                      f[BICO_MERGE_FILE_BASE] == NULL ? "base" : "output");
  if (m->nin == 0)
    return bico__fail(ctx, BICO_E_ARG,
                      "%s: no inputs to merge (a task vector, a tuned "
                      "checkpoint or a LoRA adapter)",
                      fn);
  for (int a = 2; a <= 4; a++)
    for (int b = a + 1; b <= 4; b++)
      if (f[a] && f[b] && strcmp(f[a], f[b]) == 0)
        return bico__fail(ctx, BICO_E_ARG,
                          "%s: the %s file and the %s file are the same path "
                          "%s",
                          fn, FILE_NAME[a], FILE_NAME[b], f[a]);
  for (size_t i = 0; i < m->nin; i++)
    if ((int)m->param[BICO_MERGE_METHOD] == BICO_MERGE_LINEAR &&
        m->in[i].density != 1)
      return bico__fail(ctx, BICO_E_ARG,
                        "%s: the input %s has density %g, but density "
                        "(trimming) applies to TIES only (the ties method)",
                        fn, m->in[i].path, m->in[i].density);
  return BICO_OK;
}

/* What a run checks on the files before it writes anything: the base
 * and every input opened, each input's tensors on base tensors of their
 * shape (floating point, finite), inputs and outputs compared by file
 * identity.  The opened files stay with m (*basep and the inputs) for
 * the run, or for close_inputs. */
static bico_status open_inputs(bico_merge *m, const char *fn,
                               bico_stfile **basep) {
  bico_ctx *ctx = m->ctx;
  bico_status st = bico_stfile_open(ctx, m->files[BICO_MERGE_FILE_BASE], basep);
  for (size_t i = 0; i < m->nin && st == BICO_OK; i++) {
    input *in = &m->in[i];
    if (in->kind == BICO_MERGE_LORA) st = bico_lora_open(ctx, in->path, &in->l);
    else st = bico_stfile_open(ctx, in->path, &in->f);
    if (st == BICO_OK) st = check_input(m, fn, *basep, in);
  }
  if (st == BICO_OK) st = check_files(m, fn, *basep);
  return st;
}

bico_status bico_merge_check(bico_merge *m, int level) {
  if (m == NULL) return BICO_E_NULL;
  bico_ctx *ctx = m->ctx;
  bico__clear(ctx);
  if (level == 0) level = BICO_MERGE_CHECK_INPUTS;
  if (level != BICO_MERGE_CHECK_OPTIONS && level != BICO_MERGE_CHECK_INPUTS)
    return bico__fail(ctx, BICO_E_ARG,
                      "merge_check: level %d is not a check level (1 "
                      "options, 2 inputs)",
                      level);
  bico_status st = check_options(m, "merge_check");
  if (st != BICO_OK || level == BICO_MERGE_CHECK_OPTIONS) return st;
  bico_stfile *base = NULL;
  st = open_inputs(m, "merge_check", &base);
  bico_stfile_free(base);
  close_inputs(m);
  return st;
}

static bico_status merge_all(bico_merge *m, bico_stfile **basep,
                             bico_stwriter **wp, bico_stwriter **wdp,
                             bico__report *rep) {
  bico_ctx *ctx = m->ctx;
  const char *const *f = (const char *const *)m->files;
  bico_status st = check_options(m, "merge_run");
  if (st != BICO_OK) return st;
  int method = (int)m->param[BICO_MERGE_METHOD];
  int normalize = m->param[BICO_MERGE_NORMALIZE] < 0
                      ? method == BICO_MERGE_TIES
                      : (int)m->param[BICO_MERGE_NORMALIZE];
  float alpha = (float)m->param[BICO_MERGE_ALPHA];
  st = open_inputs(m, "merge_run", basep);
  bico_stfile *base = *basep;
  if (st != BICO_OK) return st;
  logf_(m, "bico merge: %s of %zu inputs, alpha %g%s", bico_merge_method_name(method), m->nin,
        (double)alpha, normalize ? ", normalised" : "");
  size_t nt = bico__stfile_ntensors(base);
  st = merge_writer(m, f[BICO_MERGE_FILE_OUTPUT], wp);
  if (st == BICO_OK && f[BICO_MERGE_FILE_DELTA_OUTPUT])
    st = merge_writer(m, f[BICO_MERGE_FILE_DELTA_OUTPUT], wdp);
  if (st == BICO_OK) st = provenance(m, base, method, alpha, *wp);
  if (st == BICO_OK && *wdp) st = provenance(m, base, method, alpha, *wdp);
  for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) {
    const char *name;
    int dtype;
    size_t nd;
    const size_t *sh;
    bico_stfile_tensor_info(base, ti, &name, &dtype, &nd, &sh);
    st = bico_stwriter_declare(*wp, name, dtype, nd, sh);
    if (st == BICO_OK && *wdp && bico_dtype_is_float(dtype))
      st = bico_stwriter_declare(*wdp, name, dtype, nd, sh);
  }
  bico__report_begin_object(rep);
  bico__report_key_string(rep, "method", bico_merge_method_name(method));
  bico__report_key_number(rep, "alpha", (double)alpha);
  bico__report_key_number(rep, "normalize", normalize);
  bico__report_key(rep, "inputs");
  bico__report_begin_array(rep);
  for (size_t i = 0; i < m->nin; i++) {
    bico__report_begin_object(rep);
    bico__report_key_string(rep, "path", m->in[i].path);
    bico__report_key_string(rep, "kind", KIND_NAME[m->in[i].kind]);
    bico__report_key_number(rep, "weight", m->in[i].weight);
    bico__report_key_number(rep, "density", m->in[i].density);
    bico__report_end_object(rep);
  }
  bico__report_end_array(rep);
  bico__report_key(rep, "tensors");
  bico__report_begin_array(rep);
  mscratch sc;
  sc.taus = bico__calloc(ctx, m->nin, sizeof *sc.taus);
  sc.ws = bico__alloc(ctx, m->nin * sizeof(double));
  sc.ds = bico__alloc(ctx, m->nin * sizeof(double));
  if (sc.taus == NULL || sc.ws == NULL || sc.ds == NULL) st = BICO_E_NOMEM;
  size_t merged_count = 0;
  bico_progress pg;
  memset(&pg, 0, sizeof pg);
  pg.size = sizeof pg;
  pg.tensors_total = nt;
  for (size_t ti = 0; ti < nt; ti++) {
    size_t n = 0;
    bico_stfile_tensor_size(base, ti, &n, NULL);
    pg.total += (double)n + 1;
  }
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) {
    st = merge_one(m, base, ti, &sc, *wp, *wdp, rep, &merged_count);
    if (st == BICO_OK) report_progress(m, base, ti, nt, &pg, &t0);
  }
  bico__free(ctx, sc.taus);
  bico__free(ctx, sc.ws);
  bico__free(ctx, sc.ds);
  bico__report_end_array(rep);
  bico__report_key_number(rep, "merged_tensors", (double)merged_count);
  bico__report_end_object(rep);
  if (st == BICO_OK) st = bico__report_status(rep);
  if (st == BICO_OK)
    logf_(m, "bico merge: %zu of %zu tensors updated; writing %s",
          merged_count, nt, f[BICO_MERGE_FILE_OUTPUT]);
  return st;
}

bico_status bico_merge_run(bico_merge *m) {
  if (m == NULL) return BICO_E_NULL;
  bico_ctx *ctx = m->ctx;
  bico__clear(ctx);
  bico_stfile *base = NULL;
  bico_stwriter *w = NULL, *wd = NULL;
  bico__report rep;
  bico__report_init(&rep, ctx);
  /* the run's lock on each folder it writes, before anything is read
   * (its writers join it) */
  bico__lock *locks[2] = {NULL, NULL};
  const char *bp = m->files[BICO_MERGE_FILE_BASE];
  bico_status st = BICO_OK;
  for (int k = 0; k < 2 && st == BICO_OK; k++) {
    const char *o = m->files[k ? BICO_MERGE_FILE_DELTA_OUTPUT
                               : BICO_MERGE_FILE_OUTPUT];
    if (o != NULL && bico_stwriter_output_is_folder(o, bp))
      st = bico__lock_take(ctx, o, 0, &locks[k]);
  }
  if (st == BICO_OK) st = merge_all(m, &base, &w, &wd, &rep);
  /* the inputs read a tensor at a time are still the files opened */
  if (st == BICO_OK && base != NULL) st = bico_stfile_check_unchanged(base);
  for (size_t i = 0; i < m->nin && st == BICO_OK; i++)
    if (m->in[i].f != NULL) st = bico_stfile_check_unchanged(m->in[i].f);
  /* Every output complete in its temporary file, then all destinations
   * checked and committed together (lib/io/commit.c). */
  const char *rp = m->files[BICO_MERGE_FILE_REPORT];
  bico__tmpfile rt = {.fd = -1}, **l1 = NULL, **l2 = NULL;
  size_t n1 = 0, n2 = 0;
  if (st == BICO_OK) st = bico__stwriter_finish_all(w, &l1, &n1);
  if (st == BICO_OK && wd) st = bico__stwriter_finish_all(wd, &l2, &n2);
  if (st == BICO_OK && rp)
    st = bico__report_tmp(ctx, "merge_run", "report", rep.buf, rep.len, rp,
                          &rt);
  st = bico__commit_lists(ctx, "merge_run", st, l1, n1, l2, n2,
                          rp ? &rt : NULL);
  if (st == BICO_OK) bico__stwriter_committed(w);
  if (st == BICO_OK) bico__stwriter_committed(wd);
  bico__tmp_discard(ctx, &rt);
  bico_stwriter_free(w);
  bico_stwriter_free(wd);
  bico__report_free(&rep);
  bico_stfile_free(base);
  close_inputs(m);
  for (int k = 0; k < 2; k++) bico__lock_release(locks[k]);
  return st;
}
