/* bico_transfer: the whole-model driver every front end calls.
 *
 * Data flow: files -> models (bico_model) -> per target module, maps from
 * calibration or statistics files (bico_xcov, bico_procrustes) -> per target
 * tensor, the update (transport, gradfix or baseline kernels) -> the output
 * written tensor by tensor (bico_stwriter).  Maps are computed when the
 * first tensor that needs them comes up and freed after the last, so memory
 * stays near the largest module's needs. */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "calib.h"
#include "lora_internal.h"
#include "report.h"

#define NONE SIZE_MAX
#define NFILES 14
#define NPARAMS 11
#define NSTRINGS 4

typedef struct split_rec {
  char *suffix;
  size_t k;
} split_rec;

typedef struct tie_rec {
  char *tensor, *module;
} tie_rec;

struct bico_transfer {
  bico_ctx *ctx;
  char *files[NFILES];
  double param[NPARAMS];
  char *strings[NSTRINGS];
  split_rec *splits;
  size_t nsplits;
  tie_rec *ties;
  size_t nties;
  bico_transfer_log_fn log;
  void *log_opaque;
  int ran;
  size_t updated, unchanged;
  unsigned char *select; /* partial runs: tensors to compute, or NULL */
  size_t nselect;
  bico_transfer_sink_fn sink;
  void *sink_opaque;
};

static const char *const FILE_OPTION[NFILES] = {
    NULL,           "source base",  "source tuned",  "task vector",
    "target base",  "source calib", "target calib",  "stats",
    "target votes", "output",       "delta output",  "report",
    "source adapter", "output adapter"};

static char *dupstr(bico_ctx *ctx, const char *s) {
  size_t n = strlen(s);
  char *p = bico__alloc(ctx, n + 1);
  if (p) memcpy(p, s, n + 1);
  return p;
}

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
  *out = t;
  return BICO_OK;
}

void bico_transfer_free(bico_transfer *t) {
  if (t == NULL) return;
  bico_ctx *ctx = t->ctx;
  for (int i = 0; i < NFILES; i++) bico__free(ctx, t->files[i]);
  for (int i = 0; i < NSTRINGS; i++) bico__free(ctx, t->strings[i]);
  for (size_t i = 0; i < t->nsplits; i++) bico__free(ctx, t->splits[i].suffix);
  bico__free(ctx, t->splits);
  for (size_t i = 0; i < t->nties; i++) {
    bico__free(ctx, t->ties[i].tensor);
    bico__free(ctx, t->ties[i].module);
  }
  bico__free(ctx, t->ties);
  bico__free(ctx, t->select);
  bico__free(ctx, t);
}

bico_status bico_transfer_set_file(bico_transfer *t, int which,
                                   const char *path) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  if (which < 1 || which >= NFILES)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_set_file: unknown file slot %d", which);
  if (path != NULL && path[0] == '\0')
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_set_file: empty path for the %s",
                      FILE_OPTION[which]);
  char *p = NULL;
  if (path != NULL && (p = dupstr(t->ctx, path)) == NULL) return BICO_E_NOMEM;
  bico__free(t->ctx, t->files[which]);
  t->files[which] = p;
  return BICO_OK;
}

bico_status bico_transfer_param_bounds(int param, double *lo, double *hi) {
  if (lo == NULL || hi == NULL) return BICO_E_NULL;
  switch (param) {
    case BICO_TRANSFER_METHOD: *lo = 1; *hi = 6; return BICO_OK;
    case BICO_TRANSFER_ALPHA: *lo = 0; *hi = HUGE_VAL; return BICO_OK;
    case BICO_TRANSFER_NULL: *lo = 0; *hi = BICO_NULL_DROP; return BICO_OK;
    case BICO_TRANSFER_NORM_MAP:
    case BICO_TRANSFER_CENTER: *lo = 0; *hi = 1; return BICO_OK;
    case BICO_TRANSFER_RANK_TOL: *lo = 0; *hi = 1; return BICO_OK;
    case BICO_TRANSFER_WHITEN: *lo = 0; *hi = 0.5; return BICO_OK;
    case BICO_TRANSFER_PROC_METHOD:
      *lo = BICO_PROC_SVD;
      *hi = BICO_PROC_POLAR;
      return BICO_OK;
    case BICO_TRANSFER_WORKERS: *lo = 1; *hi = 1024; return BICO_OK;
    case BICO_TRANSFER_SOLVE_MEMORY: *lo = 0; *hi = 9007199254740992.0; return BICO_OK;
    default: return BICO_E_ARG;
  }
}

bico_status bico_transfer_set_param(bico_transfer *t, int param,
                                    double value) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  double lo, hi;
  if (bico_transfer_param_bounds(param, &lo, &hi) != BICO_OK)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_set_param: unknown parameter %d", param);
  int integral = param == BICO_TRANSFER_METHOD ||
                 param == BICO_TRANSFER_NORM_MAP ||
                 param == BICO_TRANSFER_NULL || param == BICO_TRANSFER_CENTER ||
                 param == BICO_TRANSFER_PROC_METHOD ||
                 param == BICO_TRANSFER_WORKERS ||
                 param == BICO_TRANSFER_SOLVE_MEMORY;
  int ok = isfinite(value) && value >= lo && value <= hi;
  if (param == BICO_TRANSFER_ALPHA) ok = isfinite(value) && value > 0;
  if (param == BICO_TRANSFER_RANK_TOL) ok = ok && value < 1;
  if (integral && ok && value != floor(value)) ok = 0;
  if (!ok)
    return bico__fail(t->ctx,
                      isfinite(value) ? BICO_E_ARG : BICO_E_NONFINITE,
                      "transfer_set_param: value %g for parameter %d is "
                      "outside %s%g, %g%s%s",
                      value, param,
                      param == BICO_TRANSFER_ALPHA ? "(" : "[", lo, hi,
                      param == BICO_TRANSFER_RANK_TOL ? ")" : "]",
                      integral ? " (an integer)" : "");
  t->param[param] = value;
  return BICO_OK;
}

bico_status bico_transfer_get_param(const bico_transfer *t, int param,
                                    double *value) {
  if (t == NULL || value == NULL) return BICO_E_NULL;
  double lo, hi;
  if (bico_transfer_param_bounds(param, &lo, &hi) != BICO_OK)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_get_param: unknown parameter %d", param);
  *value = t->param[param];
  return BICO_OK;
}

bico_status bico_transfer_set_string(bico_transfer *t, int which,
                                     const char *value) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  if (which < 1 || which >= NSTRINGS)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_set_string: unknown option %d", which);
  char *p = NULL;
  if (value != NULL && (p = dupstr(t->ctx, value)) == NULL) return BICO_E_NOMEM;
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
  split_rec *s = bico__alloc(t->ctx, (t->nsplits + 1) * sizeof *s);
  char *d = dupstr(t->ctx, suffix);
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
  tie_rec *r = bico__alloc(t->ctx, (t->nties + 1) * sizeof *r);
  char *a = dupstr(t->ctx, tensor), *b = dupstr(t->ctx, module);
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
  bico__clear(t->ctx);
  if (!t->ran)
    return bico__fail(t->ctx, BICO_E_STATE,
                      "transfer_counts: no successful run yet");
  if (updated) *updated = t->updated;
  if (unchanged) *unchanged = t->unchanged;
  return BICO_OK;
}

/* ==================================================================== */
/* The run                                                                */

typedef struct map_t {
  float *r; /* da x db; NULL before computed */
  size_t da, db, rank;
} map_t;

typedef struct modstate {
  size_t src; /* paired source module or NONE */
  size_t k;   /* output split */
  int have_in, have_out;
  map_t in;
  map_t *out; /* k maps */
  size_t refs;
  size_t job[2]; /* solver pool job index + 1 per side, 0 = none */
} modstate;

enum handling {
  H_UNCHANGED = 0, H_LINEAR, H_VECTOR, H_TIED, H_NAIVE, H_PADDED, H_MASKED,
  H_COUNT
};
static const char *const HANDLING[H_COUNT] = {
    "unchanged", "linear", "vector", "tied", "naive", "padded", "masked"};

/* What happened to one tensor, for the report. */
typedef struct tinfo {
  int handling;
  const char *source; /* source tensor name or NULL */
  char reason[256];
  const map_t *maps[2]; /* in/out (or the one map used) */
  const char *map_names[2];
  const map_t *split_maps; /* k output maps of a split module */
  size_t nsplit;
  double kept; /* GradFix kept fraction; < 0 when none */
  double norm;
} tinfo;

typedef struct run {
  bico_transfer *t;
  bico_ctx *ctx;
  int method;
  float alpha;
  bico_stfile *sb, *sft, *tv, *tb, *sc, *tc, *stats, *votes;
  bico_model *ms, *mt;
  bico_procrustes *proc;
  modstate *mods;
  size_t nm;
  size_t *owner; /* per target tensor: the module whose maps it uses */
  bico_stwriter *w, *wd;
  bico__report rep;
  size_t count[H_COUNT];
  struct pool *pool; /* solver threads, or NULL */
} run;

static void logf_(run *r, const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void logf_(run *r, const char *fmt, ...) {
  if (r->t->log == NULL) return;
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  r->t->log(r->t->log_opaque, line);
}

/* Prefixes ctx's message with context ("tensor X: ..."). */
static bico_status wrap(bico_ctx *ctx, bico_status st, const char *what,
                        const char *name) {
  char detail[BICO_ERRMSG_CAP];
  snprintf(detail, sizeof detail, "%s", bico_ctx_errmsg(ctx));
  if (strstr(detail, name) != NULL)
    return st; /* already names it */
  return bico__fail(ctx, st, "%s %s: %s", what, name,
                    detail[0] ? detail : bico_strerror(st));
}

static int ends_with_component(const char *name, const char *suffix) {
  size_t n = strlen(name), s = strlen(suffix);
  if (s > n || strcmp(name + n - s, suffix) != 0) return 0;
  return s == n || name[n - s - 1] == '.';
}

static size_t split_for(const bico_transfer *t, const char *module) {
  for (size_t i = t->nsplits; i-- > 0;)
    if (ends_with_component(module, t->splits[i].suffix)) return t->splits[i].k;
  return 1;
}

static const char *tname(const bico_model *m, size_t i) {
  const char *n = "";
  bico_model_tensor(m, i, &n, NULL, NULL, NULL);
  return n;
}

static const char *mname(const bico_model *m, size_t i) {
  const char *n = "";
  bico_model_module(m, i, &n, NULL, NULL, NULL);
  return n;
}

static size_t numel_of(size_t ndim, const size_t *shape) {
  size_t n = 1;
  for (size_t d = 0; d < ndim; d++) n *= shape[d];
  return n;
}

static bico_status open_file(run *r, int which, bico_stfile **f) {
  const char *path = r->t->files[which];
  if (path == NULL) return BICO_OK;
  bico_status st = bico_stfile_open(r->ctx, path, f);
  if (st != BICO_OK) return wrap(r->ctx, st, FILE_OPTION[which], path);
  return BICO_OK;
}

static void free_maps(run *r, modstate *s) {
  bico__free(r->ctx, s->in.r);
  s->in.r = NULL;
  s->have_in = 0;
  if (s->out) {
    for (size_t b = 0; b < s->k; b++) bico__free(r->ctx, s->out[b].r);
    bico__free(r->ctx, s->out);
    s->out = NULL;
  }
  s->have_out = 0;
}

/* rows x cols elements of `size` bytes, with the product overflow-checked. */
static void *alloc_mat(bico_ctx *ctx, size_t rows, size_t cols, size_t size) {
  size_t n, bytes;
  if (bico__mul(rows, cols, &n) || bico__mul(n, size, &bytes)) {
    bico__fail(ctx, BICO_E_NOMEM, "a %zu x %zu matrix does not fit in memory",
               rows, cols);
    return NULL;
  }
  return bico__alloc(ctx, bytes);
}

/* Module widths: (d_out, d_in); an element-wise module has both equal. */
static bico_status dims(const bico_model *m, size_t mi, size_t *dout,
                        size_t *din) {
  return bico_model_module_dims(m, mi, dout, din);
}

/* What solving one side of one target module needs: its names and widths,
 * taken from the models by the calling thread, so that a worker never
 * touches the models (or the caller's context). */
typedef struct sidejob {
  size_t mi;
  int side;   /* 0 = input activations (one map), 1 = output gradients */
  const char *tm, *sm;
  size_t da, db, k;
  size_t cost; /* estimated working set in bytes */
  int state;   /* JOB_* */
  bico_status st;
  char *msg;   /* a failed job's message */
  map_t *maps; /* k maps once done, until the calling thread takes them */
} sidejob;

enum { JOB_PENDING = 0, JOB_RUNNING, JOB_DONE, JOB_FAILED };

/* Where a solve gets its context, solver and files. */
typedef struct solver {
  bico_ctx *ctx;
  bico_procrustes *proc;
  bico_stfile *stats, *sc, *tc;
} solver;

static bico_status side_job(run *r, size_t mi, int side, sidejob *j) {
  modstate *s = &r->mods[mi];
  size_t dout_b, din_b, dout_a, din_a;
  memset(j, 0, sizeof *j);
  j->mi = mi;
  j->side = side;
  j->tm = mname(r->mt, mi);
  j->sm = mname(r->ms, s->src);
  bico_status st = dims(r->mt, mi, &dout_b, &din_b);
  if (st == BICO_OK) st = dims(r->ms, s->src, &dout_a, &din_a);
  if (st != BICO_OK) return st;
  j->da = side ? dout_a : din_a;
  j->db = side ? dout_b : din_b;
  j->k = side ? s->k : 1;
  /* An estimate: a d_a x d_b double (the accumulator from calibration
   * files, or the SVD's copy of the statistic; the EIG route reads a
   * statistics file in panels instead), two k x k eigen matrices, the
   * maps in float. */
  size_t mn = j->da < j->db ? j->da : j->db;
  j->cost = 8 * j->da * j->db + 16 * mn * mn / (j->k ? j->k : 1) +
            4 * j->da * j->db / (j->k ? j->k : 1);
  return BICO_OK;
}

/* A statistic tensor of a statistics file, as the Procrustes solver reads
 * it: element (i, j) of the block at (r0, c0) is row r0 + i, column c0 + j
 * of the [.., ld] tensor. */
typedef struct stat_src {
  bico_stfile *f;
  size_t idx, ld, r0, c0;
} stat_src;

static bico_status stat_block(void *opaque, size_t i0, size_t ni, size_t j0,
                              size_t nj, double *out, size_t ld) {
  const stat_src *s = opaque;
  if (nj == s->ld && ld == nj) /* whole rows: one contiguous range */
    return bico_stfile_read_f64_range(s->f, s->idx, (s->r0 + i0) * s->ld,
                                      ni * nj, out);
  bico_status st = BICO_OK;
  for (size_t i = 0; i < ni && st == BICO_OK; i++)
    st = bico_stfile_read_f64_range(s->f, s->idx,
                                    (s->r0 + i0 + i) * s->ld + s->c0 + j0, nj,
                                    out + i * ld);
  return st;
}

static void stat_release(void *opaque) {
  const stat_src *s = opaque;
  bico__stfile_drop(s->f, s->idx);
}

/* Computes the maps of job j (side 0 = input activations, one map; side 1
 * = output gradients, k maps) with solver sv into *out. */
static bico_status solve_side(run *r, solver *sv, const sidejob *j,
                              map_t **out) {
  bico_ctx *ctx = sv->ctx;
  const char *tm = j->tm, *sm = j->sm;
  size_t da = j->da, db = j->db, k = j->k;
  bico_status st = BICO_OK;
  *out = NULL;
  if (da % k || db % k)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "module %s: output widths %zu (source %s) and %zu do not "
                      "split in %zu blocks (--split)",
                      tm, da, sm, db, k);
  size_t ba = da / k, bb = db / k;
  map_t *maps = bico__calloc(ctx, k, sizeof *maps);
  if (maps == NULL) return BICO_E_NOMEM;
  for (size_t b = 0; b < k && st == BICO_OK; b++) {
    maps[b].da = ba;
    maps[b].db = bb;
    maps[b].r = alloc_mat(ctx, ba, bb, sizeof(float));
    if (maps[b].r == NULL) st = BICO_E_NOMEM;
  }
  const char *suffix = j->side ? "output_grad" : "input";
  if (st == BICO_OK && sv->stats != NULL) {
    /* Statistics file, keyed by the target module. */
    const char *path = r->t->files[BICO_FILE_STATS];
    size_t klen = strlen(tm) + 16, idx;
    char *key = bico__alloc(ctx, klen);
    if (key == NULL) st = BICO_E_NOMEM;
    if (st == BICO_OK) {
      snprintf(key, klen, "%s.%s", tm, j->side ? "out_xcov" : "in_xcov");
      if (bico_stfile_find(sv->stats, key, &idx) != BICO_OK)
        st = bico__fail(ctx, BICO_E_NOTFOUND,
                        "statistics file %s has no tensor %s (module %s)", path,
                        key, tm);
    }
    if (st == BICO_OK) {
      size_t ndim;
      const size_t *shape;
      st = bico_stfile_tensor_info(sv->stats, idx, NULL, NULL, &ndim, &shape);
      if (st == BICO_OK && (ndim != 2 || shape[0] != da || shape[1] != db))
        st = bico__fail(ctx, BICO_E_SHAPE,
                        "statistics file %s: tensor %s should be [%zu, %zu] "
                        "(source %s x target %s widths)",
                        path, key, da, db, sm, tm);
    }
    for (size_t b = 0; b < k && st == BICO_OK; b++) {
      /* Block b's statistic is the diagonal block (b, b) of the full one,
       * read from the file panel by panel (no d_a x d_b copy in memory). */
      stat_src src = {sv->stats, idx, db, b * ba, b * bb};
      const bico__creader rd = {stat_block, stat_release, &src};
      st = bico__procrustes_solve_reader(sv->proc, ba, bb, &rd, maps[b].r, bb,
                                         &maps[b].rank);
      if (st != BICO_OK) st = wrap(ctx, st, "statistic", key);
    }
    bico__free(ctx, key);
  } else if (st == BICO_OK) {
    const char *pa = r->t->files[BICO_FILE_SOURCE_CALIB];
    const char *pb = r->t->files[BICO_FILE_TARGET_CALIB];
    size_t la = strlen(sm) + 16, lb = strlen(tm) + 16, ia, ib, rows;
    char *ka = bico__alloc(ctx, la), *kb = bico__alloc(ctx, lb);
    bico_xcov **xcs = bico__calloc(ctx, k, sizeof *xcs);
    if (ka == NULL || kb == NULL || xcs == NULL) st = BICO_E_NOMEM;
    if (st == BICO_OK) {
      snprintf(ka, la, "%s.%s", sm, suffix);
      snprintf(kb, lb, "%s.%s", tm, suffix);
      st = bico__calib_find(ctx, sv->sc, pa, ka, da, &ia, &rows);
      if (st == BICO_OK) st = bico__calib_find(ctx, sv->tc, pb, kb, db, &ib, &rows);
    }
    unsigned flags = 0;
    if (r->t->param[BICO_TRANSFER_CENTER] != 0) flags |= BICO_XCOV_SUMS;
    if (r->t->param[BICO_TRANSFER_WHITEN] > 0) flags |= BICO_XCOV_GRAMS;
    for (size_t b = 0; b < k && st == BICO_OK; b++)
      st = bico_xcov_create(ctx, ba, bb, flags, &xcs[b]);
    if (st == BICO_OK)
      st = bico__calib_accumulate(ctx, tm, sv->sc, pa, ia, da, sv->tc, pb, ib,
                                  db, k, xcs);
    for (size_t b = 0; b < k && st == BICO_OK; b++) {
      st = bico_procrustes_solve(sv->proc, xcs[b], maps[b].r, bb,
                                 &maps[b].rank);
      if (st != BICO_OK) st = wrap(ctx, st, "module", tm);
    }
    if (xcs)
      for (size_t b = 0; b < k; b++) bico_xcov_free(xcs[b]);
    bico__free(ctx, xcs);
    bico__free(ctx, ka);
    bico__free(ctx, kb);
  }
  if (st != BICO_OK) {
    for (size_t b = 0; b < k; b++) bico__free(ctx, maps[b].r);
    bico__free(ctx, maps);
    return st;
  }
  *out = maps;
  return BICO_OK;
}

/* Hands job maps to module mi's state. */
static void publish(run *r, size_t mi, int side, map_t *maps) {
  modstate *s = &r->mods[mi];
  if (side) {
    s->out = maps;
    s->have_out = 1;
  } else {
    s->in = maps[0];
    bico__free(r->ctx, maps);
    s->have_in = 1;
  }
}

/* ---- The solver pool (BICO_TRANSFER_WORKERS > 1) ---- */

typedef struct worker {
  struct pool *pool;
  solver sv;
  pthread_t th;
  int started;
} worker;

typedef struct pool {
  run *r;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  sidejob *jobs;
  size_t njobs, next; /* next job to start */
  size_t want;        /* highest job index the writer has asked for */
  size_t ahead;       /* how far past `want` workers may start */
  size_t inflight, budget;
  size_t running;
  int stop;
  worker *w;
  size_t nw;
} pool;

static int can_start(const pool *P) {
  if (P->next >= P->njobs || P->next > P->want + P->ahead) return 0;
  if (P->budget == 0 || P->running == 0) return 1;
  return P->inflight + P->jobs[P->next].cost <= P->budget;
}

static void *worker_main(void *arg) {
  worker *w = arg;
  pool *P = w->pool;
  pthread_mutex_lock(&P->mu);
  for (;;) {
    while (!P->stop && P->next < P->njobs && !can_start(P))
      pthread_cond_wait(&P->cv, &P->mu);
    if (P->stop || P->next >= P->njobs) break;
    sidejob *j = &P->jobs[P->next++];
    j->state = JOB_RUNNING;
    P->inflight += j->cost;
    P->running++;
    pthread_mutex_unlock(&P->mu);
    map_t *maps = NULL;
    bico_status st = solve_side(P->r, &w->sv, j, &maps);
    char *msg = NULL;
    if (st != BICO_OK) {
      /* The message travels with the job (the worker's context is
       * reused); out of memory here leaves the bare status. */
      const char *m = bico_ctx_errmsg(w->sv.ctx);
      msg = malloc(strlen(m) + 1);
      if (msg) strcpy(msg, m);
    }
    pthread_mutex_lock(&P->mu);
    P->inflight -= j->cost;
    P->running--;
    j->maps = maps;
    j->st = st;
    j->msg = msg;
    j->state = st == BICO_OK ? JOB_DONE : JOB_FAILED;
    pthread_cond_broadcast(&P->cv);
  }
  pthread_mutex_unlock(&P->mu);
  return NULL;
}

static void solver_close(solver *sv) {
  bico_procrustes_free(sv->proc);
  bico_stfile_close(sv->stats);
  bico_stfile_close(sv->sc);
  bico_stfile_close(sv->tc);
  bico_ctx_free(sv->ctx);
  memset(sv, 0, sizeof *sv);
}

/* A worker's context, solver and file handles, configured like the run's. */
static bico_status solver_open(run *r, solver *sv, long threads) {
  bico_ctx *c = r->ctx;
  bico_status st = bico_ctx_create_with_allocator(&sv->ctx, c->alloc,
                                                  c->release, c->opaque);
  if (st != BICO_OK)
    return bico__fail(c, st, "transfer_run: cannot create a worker context");
  st = bico_ctx_set_param(sv->ctx, BICO_CTX_THREADS, threads);
  if (st == BICO_OK) st = bico_procrustes_create(sv->ctx, &sv->proc);
  static const int pp[5] = {BICO_PROC_RANK_TOL, BICO_PROC_NULL,
                            BICO_PROC_CENTER, BICO_PROC_WHITEN,
                            BICO_PROC_METHOD};
  for (int i = 0; i < 5 && st == BICO_OK; i++) {
    double v;
    st = bico_procrustes_get_param(r->proc, pp[i], &v);
    if (st == BICO_OK) st = bico_procrustes_set_param(sv->proc, pp[i], v);
  }
  static const int which[3] = {BICO_FILE_STATS, BICO_FILE_SOURCE_CALIB,
                               BICO_FILE_TARGET_CALIB};
  bico_stfile **fs[3] = {&sv->stats, &sv->sc, &sv->tc};
  bico_stfile *have[3] = {r->stats, r->sc, r->tc};
  for (int i = 0; i < 3 && st == BICO_OK; i++)
    if (have[i] != NULL) {
      st = bico_stfile_open(sv->ctx, r->t->files[which[i]], fs[i]);
      if (st != BICO_OK) st = wrap(sv->ctx, st, FILE_OPTION[which[i]],
                                   r->t->files[which[i]]);
    }
  if (st != BICO_OK) {
    st = bico__fail(c, st, "transfer_run: worker setup: %s",
                    bico_ctx_errmsg(sv->ctx));
    solver_close(sv);
  }
  return st;
}

static void pool_stop(run *r) {
  pool *P = r->pool;
  if (P == NULL) return;
  pthread_mutex_lock(&P->mu);
  P->stop = 1;
  pthread_cond_broadcast(&P->cv);
  pthread_mutex_unlock(&P->mu);
  for (size_t i = 0; i < P->nw; i++) {
    if (P->w[i].started) pthread_join(P->w[i].th, NULL);
    solver_close(&P->w[i].sv);
  }
  for (size_t i = 0; i < P->njobs; i++) {
    sidejob *j = &P->jobs[i];
    if (j->maps) {
      for (size_t b = 0; b < j->k; b++) bico__free(r->ctx, j->maps[b].r);
      bico__free(r->ctx, j->maps);
    }
    free(j->msg);
  }
  pthread_mutex_destroy(&P->mu);
  pthread_cond_destroy(&P->cv);
  bico__free(r->ctx, P->w);
  bico__free(r->ctx, P->jobs);
  bico__free(r->ctx, P);
  r->pool = NULL;
}

/* Which sides of which module target tensor ti will ask for: bico_update's
 * decisions up to its need_side calls, from the models alone.  A wrong
 * guess costs time, never correctness: an unneeded job's result (or
 * failure) is dropped, and a side without a job is solved when asked. */
static void predict_sides(run *r, size_t ti, size_t *mod, int need[2]) {
  need[0] = need[1] = 0;
  *mod = NONE;
  size_t mi, si, owner = r->owner[ti];
  int role;
  if (owner == NONE) return;
  if (bico_model_tensor_module(r->mt, ti, &mi, &role) != BICO_OK) return;
  if (bico_model_pair_tensor(r->mt, ti, r->ms, &si) != BICO_OK) return;
  int do_in = r->method != BICO_METHOD_BICO_OUT;
  int do_out = r->method != BICO_METHOD_BICO_IN;
  if (role == BICO_ROLE_WEIGHT) {
    *mod = mi;
    need[0] = do_in;
    need[1] = do_out;
  } else if (role == BICO_ROLE_BIAS) {
    *mod = mi;
    need[1] = do_out;
  } else if (role == BICO_ROLE_VECTOR || role == BICO_ROLE_TOKEN) {
    int kind;
    bico_model_module(r->mt, owner, NULL, &kind, NULL, NULL);
    int side = kind == BICO_MODULE_ELEMENTWISE
                   ? (r->t->param[BICO_TRANSFER_NORM_MAP] == BICO_NORM_MAP_GRAD)
                   : 1;
    if (role == BICO_ROLE_TOKEN && kind == BICO_MODULE_LINEAR && !do_out)
      return;
    if (side == 1 && r->mods[owner].k != 1) return;
    *mod = owner;
    need[side] = 1;
  }
}

/* Plans the jobs in the order the tensors need them and starts the
 * workers.  Runs only for BiCo methods with more than one worker. */
static bico_status pool_start(run *r, const unsigned char *select) {
  bico_ctx *ctx = r->ctx;
  size_t nw = (size_t)r->t->param[BICO_TRANSFER_WORKERS];
  size_t nt = bico_model_tensor_count(r->mt), cap = 0;
  if (nw < 2 || r->nm == 0) return BICO_OK;
  pool *P = bico__calloc(ctx, 1, sizeof *P);
  if (P == NULL) return BICO_E_NOMEM;
  P->r = r;
  pthread_mutex_init(&P->mu, NULL);
  pthread_cond_init(&P->cv, NULL);
  r->pool = P;
  bico_status st = BICO_OK;
  for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) {
    if (select && !select[ti]) continue;
    size_t mi;
    int need[2];
    predict_sides(r, ti, &mi, need);
    for (int side = 0; side < 2 && st == BICO_OK; side++) {
      if (!need[side] || r->mods[mi].job[side] != 0) continue;
      sidejob j;
      st = side_job(r, mi, side, &j);
      if (st != BICO_OK) {
        /* Widths the models cannot give: the writer finds out itself. */
        bico__clear(ctx);
        st = BICO_OK;
        continue;
      }
      sidejob *grown = bico__grow(ctx, P->jobs, P->njobs, &cap, 16, sizeof *P->jobs);
      if (grown == NULL) {
        st = BICO_E_NOMEM;
        break;
      }
      P->jobs = grown;
      P->jobs[P->njobs++] = j;
      r->mods[mi].job[side] = P->njobs; /* index + 1 */
    }
  }
  bico__clear(ctx);
  if (st == BICO_OK && P->njobs < 2) return BICO_OK; /* nothing to overlap */
  if (nw > P->njobs) nw = P->njobs;
  P->ahead = nw;
  P->budget = (size_t)r->t->param[BICO_TRANSFER_SOLVE_MEMORY];
  if (st == BICO_OK) {
    P->w = bico__calloc(ctx, nw, sizeof *P->w);
    if (P->w == NULL) st = BICO_E_NOMEM;
  }
  const long bt = ctx->threads;
  for (size_t i = 0; i < nw && st == BICO_OK; i++) {
    P->w[i].pool = P;
    st = solver_open(r, &P->w[i].sv, bt);
    if (st == BICO_OK) P->nw = i + 1;
  }
  for (size_t i = 0; i < P->nw && st == BICO_OK; i++) {
    if (pthread_create(&P->w[i].th, NULL, worker_main, &P->w[i]) != 0)
      st = bico__fail(ctx, BICO_E_INTERNAL,
                      "transfer_run: cannot start solver thread %zu of %zu",
                      i + 1, P->nw);
    else
      P->w[i].started = 1;
  }
  if (st == BICO_OK)
    logf_(r, "bico: %zu maps to solve, %zu solver threads", P->njobs, P->nw);
  return st;
}

/* Computes the maps of one side of target module mi in the calling thread. */
static bico_status compute_side(run *r, size_t mi, int side) {
  sidejob j;
  bico_status st = side_job(r, mi, side, &j);
  if (st != BICO_OK) return st;
  solver sv = {r->ctx, r->proc, r->stats, r->sc, r->tc};
  map_t *maps = NULL;
  st = solve_side(r, &sv, &j, &maps);
  if (st == BICO_OK) publish(r, mi, side, maps);
  return st;
}

static bico_status need_side(run *r, size_t mi, int side) {
  modstate *s = &r->mods[mi];
  if (side ? s->have_out : s->have_in) return BICO_OK;
  pool *P = r->pool;
  if (P == NULL || s->job[side] == 0) return compute_side(r, mi, side);
  size_t idx = s->job[side] - 1;
  sidejob *j = &P->jobs[idx];
  pthread_mutex_lock(&P->mu);
  if (idx > P->want) {
    P->want = idx;
    pthread_cond_broadcast(&P->cv);
  }
  while (j->state == JOB_PENDING || j->state == JOB_RUNNING)
    pthread_cond_wait(&P->cv, &P->mu);
  map_t *maps = j->maps;
  j->maps = NULL;
  pthread_mutex_unlock(&P->mu);
  if (j->state == JOB_FAILED)
    return j->msg ? bico__fail(r->ctx, j->st, "%s", j->msg)
                  : bico__fail(r->ctx, j->st, "transfer_run: solving the %s "
                               "maps of module %s failed",
                               side ? "output" : "input", j->tm);
  publish(r, mi, side, maps);
  return BICO_OK;
}

/* Reads the source task vector of source tensor si into tau (numel). */
static bico_status read_tau(run *r, size_t si, float *tau, size_t numel) {
  bico_ctx *ctx = r->ctx;
  const char *name;
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(r->ms, si, &name, NULL, &ndim, &shape);
  bico_stfile *f = r->tv ? r->tv : r->sft;
  const char *path =
      r->t->files[r->tv ? BICO_FILE_TASK_VECTOR : BICO_FILE_SOURCE_TUNED];
  size_t idx, nd2;
  const size_t *sh2;
  if (bico_stfile_find(f, name, &idx) != BICO_OK)
    return bico__fail(ctx, BICO_E_NOTFOUND, "%s %s has no tensor %s",
                      r->tv ? "task vector" : "source tuned", path, name);
  bico_status st = bico_stfile_tensor_info(f, idx, NULL, NULL, &nd2, &sh2);
  if (st != BICO_OK) return st;
  if (nd2 != ndim || (ndim && memcmp(shape, sh2, ndim * sizeof *shape) != 0))
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s %s: tensor %s has a different shape than in the "
                      "source base",
                      r->tv ? "task vector" : "source tuned", path, name);
  st = bico_stfile_read_f32(f, idx, tau, numel);
  if (st == BICO_OK) st = bico_stfile_check_finite(f, idx);
  if (st != BICO_OK || r->tv) return st;
  size_t bi;
  st = bico_stfile_find(r->sb, name, &bi);
  if (st == BICO_OK) st = bico_stfile_check_finite(r->sb, bi);
  float *base = st == BICO_OK ? bico__alloc(ctx, numel * sizeof(float)) : NULL;
  if (st == BICO_OK && base == NULL) st = BICO_E_NOMEM;
  if (st == BICO_OK) st = bico_stfile_read_f32(r->sb, bi, base, numel);
  if (st == BICO_OK)
    for (size_t e = 0; e < numel; e++) tau[e] -= base[e];
  bico__free(ctx, base);
  return st;
}

static void shape_str(char *buf, size_t cap, size_t ndim, const size_t *shape) {
  size_t o = 0;
  o += (size_t)snprintf(buf + o, cap - o, "[");
  for (size_t d = 0; d < ndim && o < cap; d++)
    o += (size_t)snprintf(buf + o, cap - o, "%s%zu", d ? ", " : "", shape[d]);
  if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* The tie module of target tensor ti (role TOKEN): explicit or the stem. */
static bico_status tie_module(run *r, size_t ti, size_t *mi) {
  const char *name = tname(r->mt, ti);
  *mi = NONE;
  for (size_t i = r->t->nties; i-- > 0;)
    if (strcmp(r->t->ties[i].tensor, name) == 0) {
      bico_status st = bico_model_find_module(r->mt, r->t->ties[i].module, mi);
      if (st != BICO_OK)
        return bico__fail(r->ctx, BICO_E_NOTFOUND,
                          "--tie %s=%s: the target has no module %s", name,
                          r->t->ties[i].module, r->t->ties[i].module);
      int kind;
      bico_model_module(r->mt, *mi, NULL, &kind, NULL, NULL);
      if (kind != BICO_MODULE_LINEAR && kind != BICO_MODULE_ELEMENTWISE)
        return bico__fail(r->ctx, BICO_E_ARG,
                          "--tie %s=%s: module %s is neither linear nor "
                          "element-wise, so it has no map",
                          name, r->t->ties[i].module, r->t->ties[i].module);
      return BICO_OK;
    }
  /* Default: the stem, a linear module outside the blocks whose output has
   * the token's width and whose name says so. */
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(r->mt, ti, NULL, NULL, &ndim, &shape);
  size_t width = ndim ? shape[ndim - 1] : 0;
  for (size_t m = 0; m < r->nm; m++) {
    const char *n;
    int kind;
    long block;
    bico_model_module(r->mt, m, &n, &kind, &block, NULL);
    if (kind != BICO_MODULE_LINEAR || block >= 0) continue;
    size_t dout;
    bico_model_module_dims(r->mt, m, &dout, NULL);
    if (dout != width) continue;
    if (strstr(n, "embed") || strstr(n, "stem") || strstr(n, "patch")) {
      *mi = m;
      break;
    }
  }
  return BICO_OK;
}

/* Computes the update (alpha tau_B) of target tensor ti into upd, or
 * leaves info->handling H_UNCHANGED with a reason. */
static bico_status bico_update(run *r, size_t ti, float *upd, tinfo *info) {
  bico_ctx *ctx = r->ctx;
  const char *name;
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(r->mt, ti, &name, NULL, &ndim, &shape);
  size_t mi;
  int role;
  bico_status st = bico_model_tensor_module(r->mt, ti, &mi, &role);
  if (st != BICO_OK) return st;
  if (role == BICO_ROLE_OTHER) {
    snprintf(info->reason, sizeof info->reason,
             "no method changes this kind of tensor");
    return BICO_OK;
  }
  size_t owner = r->owner[ti];
  if (owner == NONE) {
    snprintf(info->reason, sizeof info->reason,
             role == BICO_ROLE_TOKEN
                 ? "no module is tied to it (see --tie)"
                 : "its module has no partner in the source");
    return BICO_OK;
  }
  size_t si;
  st = bico_model_pair_tensor(r->mt, ti, r->ms, &si);
  if (st == BICO_E_NOTFOUND) {
    snprintf(info->reason, sizeof info->reason,
             "the source has no paired tensor");
    bico__clear(ctx);
    return BICO_OK;
  }
  if (st != BICO_OK) return st;
  info->source = tname(r->ms, si);
  size_t nd_a;
  const size_t *sh_a;
  bico_model_tensor(r->ms, si, NULL, NULL, &nd_a, &sh_a);
  size_t na = numel_of(nd_a, sh_a), nb = numel_of(ndim, shape);
  float *tau = bico__alloc(ctx, (na ? na : 1) * sizeof(float));
  if (tau == NULL) return BICO_E_NOMEM;
  st = read_tau(r, si, tau, na);
  modstate *s = &r->mods[owner];
  int do_in = r->method != BICO_METHOD_BICO_OUT;
  int do_out = r->method != BICO_METHOD_BICO_IN;
  if (st != BICO_OK) goto done;
  if (role == BICO_ROLE_WEIGHT) {
    size_t dout_b, din_b, dout_a, din_a;
    bico_model_module_dims(r->mt, mi, &dout_b, &din_b);
    bico_model_module_dims(r->ms, s->src, &dout_a, &din_a);
    if (dout_a * din_a != na) {
      st = bico__fail(ctx, BICO_E_SHAPE,
                      "source tensor %s does not have its module's shape",
                      info->source);
      goto done;
    }
    if (do_in && (st = need_side(r, mi, 0)) != BICO_OK) goto done;
    if (do_out && (st = need_side(r, mi, 1)) != BICO_OK) goto done;
    const float *rin = do_in ? s->in.r : NULL;
    if (do_in) {
      info->maps[0] = &s->in;
      info->map_names[0] = "in";
    }
    if (s->k == 1) {
      const float *rout = do_out ? s->out[0].r : NULL;
      if (do_out) {
        info->maps[1] = &s->out[0];
        info->map_names[1] = "out";
      }
      st = bico_transport_weight(ctx, dout_a, din_a, dout_b, din_b, r->alpha, tau,
                                 din_a, rout, dout_b, rin, din_b, 0.0f,
                                 upd, din_b);
    } else {
      const float **routs = bico__calloc(ctx, s->k, sizeof *routs);
      if (routs == NULL) {
        st = BICO_E_NOMEM;
        goto done;
      }
      for (size_t b = 0; b < s->k; b++) routs[b] = do_out ? s->out[b].r : NULL;
      if (do_out) {
        info->split_maps = s->out;
        info->nsplit = s->k;
      }
      st = bico_transport_weight_split(
          ctx, s->k, dout_a, din_a, dout_b, din_b,
          r->alpha, tau, din_a,
          do_out ? (const float *const *)routs : NULL, dout_b / s->k, rin, din_b, 0.0f, upd, din_b);
      bico__free(ctx, routs);
    }
    info->handling = H_LINEAR;
  } else if (role == BICO_ROLE_BIAS) {
    if (do_out && (st = need_side(r, mi, 1)) != BICO_OK) goto done;
    size_t k = s->k, ba = na / k, bb = nb / k;
    if (na % k || nb % k) {
      st = bico__fail(ctx, BICO_E_SHAPE, "bias %s does not split in %zu", name,
                      k);
      goto done;
    }
    for (size_t b = 0; b < k && st == BICO_OK; b++)
      st = bico_transport_vector(ctx, ba, bb,
                                 r->alpha, tau + b * ba, do_out ? s->out[b].r : NULL, bb,
                                 0.0f, upd + b * bb);
    if (do_out && k == 1) {
      info->maps[1] = &s->out[0];
      info->map_names[1] = "out";
    } else if (do_out) {
      info->split_maps = s->out;
      info->nsplit = k;
    }
    info->handling = H_VECTOR;
  } else if (role == BICO_ROLE_VECTOR || role == BICO_ROLE_TOKEN) {
    /* A norm's vector by its norm map; a token by its tie module's map. */
    int kind;
    bico_model_module(r->mt, owner, NULL, &kind, NULL, NULL);
    int side = kind == BICO_MODULE_ELEMENTWISE
                   ? (r->t->param[BICO_TRANSFER_NORM_MAP] == BICO_NORM_MAP_GRAD)
                   : 1;
    int identity = role == BICO_ROLE_TOKEN && kind == BICO_MODULE_LINEAR &&
                   !do_out;
    size_t da_last = nd_a ? sh_a[nd_a - 1] : 1, db_last = ndim ? shape[ndim - 1] : 1;
    if (na / da_last != nb / db_last) {
      snprintf(info->reason, sizeof info->reason,
               "leading dimensions differ from the source's (%zu rows "
               "against %zu)",
               na / da_last, nb / db_last);
      goto done;
    }
    if (side == 1 && s->k != 1 && !identity) {
      snprintf(info->reason, sizeof info->reason,
               "its map's module %s has a split output",
               mname(r->mt, owner));
      goto done;
    }
    const map_t *mp = NULL;
    if (!identity) {
      if ((st = need_side(r, owner, side)) != BICO_OK) goto done;
      mp = side ? &s->out[0] : &s->in;
      if (mp->da != da_last || mp->db != db_last) {
        snprintf(info->reason, sizeof info->reason,
                 "the map of module %s is %zu x %zu, the tensor's last "
                 "dimensions are %zu (source) and %zu",
                 mname(r->mt, owner), mp->da, mp->db, da_last, db_last);
        goto done;
      }
      info->maps[0] = mp;
      info->map_names[0] = side ? "out" : "in";
    }
    st = bico_transport_rows(ctx, na / da_last, da_last, db_last, r->alpha,
                             tau, da_last, mp ? mp->r : NULL, db_last,
                             0.0f, upd, db_last);
    info->handling = role == BICO_ROLE_VECTOR ? H_VECTOR : H_TIED;
  }
  /* A map fitted on an all-zero statistic (a dead layer: no activation or
   * no gradient reached it) identifies nothing; its completion would move
   * the update arbitrarily, so the tensor is left unchanged and the report
   * says why. */
  if (st == BICO_OK && info->handling != H_UNCHANGED) {
    const char *dead = NULL;
    for (int m = 0; m < 2 && dead == NULL; m++)
      if (info->maps[m] != NULL && info->maps[m]->rank == 0)
        dead = info->map_names[m];
    for (size_t b = 0; b < info->nsplit && dead == NULL; b++)
      if (info->split_maps[b].rank == 0) dead = "out";
    if (dead != NULL) {
      snprintf(info->reason, sizeof info->reason,
               "the statistic of its %s map is all zero (a dead layer)",
               dead);
      info->handling = H_UNCHANGED;
    }
  }
done:
  bico__free(ctx, tau);
  return st;
}

/* naive, pad and gradfix: tensor by tensor. */
static bico_status elementwise_update(run *r, size_t ti, float *upd,
                                      tinfo *info) {
  bico_ctx *ctx = r->ctx;
  const char *name;
  size_t ndim;
  const size_t *shape;
  int dtype;
  bico_model_tensor(r->mt, ti, &name, &dtype, &ndim, &shape);
  size_t si;
  bico_status pst = bico_model_pair_tensor(r->mt, ti, r->ms, &si);
  if (pst == BICO_E_NOTFOUND) {
    bico__clear(ctx);
    snprintf(info->reason, sizeof info->reason,
             "the source has no paired tensor");
    return BICO_OK;
  }
  if (pst != BICO_OK) return pst;
  info->source = tname(r->ms, si);
  size_t nd_a;
  const size_t *sh_a;
  bico_model_tensor(r->ms, si, NULL, NULL, &nd_a, &sh_a);
  int same = nd_a == ndim && (ndim == 0 || memcmp(sh_a, shape, ndim * sizeof *shape) == 0);
  if (!same && r->method != BICO_METHOD_PAD) {
    char a[128], b[128];
    shape_str(a, sizeof a, nd_a, sh_a);
    shape_str(b, sizeof b, ndim, shape);
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s transfer needs equal shapes: target tensor %s is %s, "
                      "source tensor %s is %s",
                      r->method == BICO_METHOD_NAIVE ? "naive" : "gradfix",
                      name, b, info->source, a);
  }
  size_t na = numel_of(nd_a, sh_a), nb = numel_of(ndim, shape);
  float *tau = bico__alloc(ctx, (na ? na : 1) * sizeof(float));
  if (tau == NULL) return BICO_E_NOMEM;
  bico_status st = read_tau(r, si, tau, na);
  if (st == BICO_OK && na > 0 && r->method == BICO_METHOD_NAIVE) {
    st = bico_baseline_naive(ctx, nd_a, sh_a, ndim, shape, r->alpha, tau, 0.0f,
                             upd);
    info->handling = H_NAIVE;
  } else if (st == BICO_OK && na > 0 && nb > 0 && r->method == BICO_METHOD_PAD) {
    if (nd_a != ndim) {
      char a[128], b[128];
      shape_str(a, sizeof a, nd_a, sh_a);
      shape_str(b, sizeof b, ndim, shape);
      st = bico__fail(ctx, BICO_E_SHAPE,
                      "pad transfer needs the same number of dimensions: "
                      "target tensor %s is %s, source tensor %s is %s",
                      name, b, info->source, a);
    } else {
      st = bico_baseline_pad(ctx, nd_a, sh_a, ndim, shape, r->alpha, tau, 0.0f,
                             upd);
      info->handling = H_PADDED;
    }
  } else if (st == BICO_OK && na > 0 && r->method == BICO_METHOD_GRADFIX) {
    const char *vpath = r->t->files[BICO_FILE_TARGET_VOTES];
    size_t vi, vnd;
    const size_t *vsh;
    int32_t *counts = NULL;
    float *v = NULL;
    bico_votes *votes = NULL;
    if (bico_stfile_find(r->votes, name, &vi) != BICO_OK) {
      st = bico__fail(ctx, BICO_E_NOTFOUND,
                      "votes file %s has no tensor %s", vpath, name);
    } else {
      st = bico_stfile_tensor_info(r->votes, vi, NULL, NULL, &vnd, &vsh);
      if (st == BICO_OK &&
          (vnd != ndim || (ndim && memcmp(vsh, shape, ndim * sizeof *vsh))))
        st = bico__fail(ctx, BICO_E_SHAPE,
                        "votes file %s: tensor %s has a different shape than "
                        "the target's",
                        vpath, name);
    }
    if (st == BICO_OK) {
      v = bico__alloc(ctx, nb * sizeof(float));
      counts = bico__alloc(ctx, nb * sizeof(int32_t));
      if (v == NULL || counts == NULL) st = BICO_E_NOMEM;
    }
    if (st == BICO_OK) st = bico_stfile_read_f32(r->votes, vi, v, nb);
    uint32_t samples = 1;
    for (size_t e = 0; e < nb && st == BICO_OK; e++) {
      float x = v[e];
      /* 2147483647.0f rounds up to 2^31, which int32 cannot hold (found by
       * fuzzing: test/fuzz/regressions/fuzz_calib_stats). */
      if (!isfinite(x) || x != floorf(x) || fabsf(x) >= 2147483648.0f)
        st = bico__fail(ctx, BICO_E_FORMAT,
                        "votes file %s: tensor %s element %zu is %g, not an "
                        "integer vote count",
                        vpath, name, e, (double)x);
      else {
        counts[e] = (int32_t)x;
        uint32_t a = (uint32_t)(counts[e] < 0 ? -(int64_t)counts[e] : counts[e]);
        if (a > samples) samples = a;
      }
    }
    if (st == BICO_OK) st = bico_votes_create(ctx, nb, 0, &votes);
    if (st == BICO_OK) st = bico_votes_add_counts(votes, counts, samples);
    size_t kept = 0;
    if (st == BICO_OK)
      st = bico_gradfix_apply(votes, BICO_GRADFIX_MAJORITY, r->alpha, tau, 0.0f,
                              upd, &kept);
    if (st == BICO_OK) {
      info->kept = nb ? (double)kept / (double)nb : 0.0;
      info->handling = H_MASKED;
    }
    bico_votes_free(votes);
    bico__free(ctx, v);
    bico__free(ctx, counts);
  }
  bico__free(ctx, tau);
  return st;
}

/* Which module's maps each target tensor uses (NONE: none), and the
 * reference counts that free them after the last user. */
static bico_status plan(run *r) {
  bico_ctx *ctx = r->ctx;
  size_t nt = bico_model_tensor_count(r->mt);
  r->nm = bico_model_module_count(r->mt);
  r->mods = bico__calloc(ctx, r->nm ? r->nm : 1, sizeof *r->mods);
  r->owner = bico__alloc(ctx, (nt ? nt : 1) * sizeof *r->owner);
  if (r->mods == NULL || r->owner == NULL) return BICO_E_NOMEM;
  for (size_t m = 0; m < r->nm; m++) {
    size_t src;
    bico_status st = bico_model_pair_module(r->mt, m, r->ms, &src);
    if (st != BICO_OK && st != BICO_E_NOTFOUND) return st;
    r->mods[m].src = st == BICO_OK ? src : NONE;
    r->mods[m].k = split_for(r->t, mname(r->mt, m));
  }
  bico__clear(ctx);
  /* A split that matches no linear module is a typo worth stopping for. */
  for (size_t i = 0; i < r->t->nsplits; i++) {
    int hit = 0;
    for (size_t m = 0; m < r->nm && !hit; m++) {
      int kind;
      bico_model_module(r->mt, m, NULL, &kind, NULL, NULL);
      hit = kind == BICO_MODULE_LINEAR &&
            ends_with_component(mname(r->mt, m), r->t->splits[i].suffix);
    }
    if (!hit)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "--split %s=%zu: no linear module of the target base "
                        "ends in %s",
                        r->t->splits[i].suffix, r->t->splits[i].k,
                        r->t->splits[i].suffix);
  }
  int bico = r->method == BICO_METHOD_BICO || r->method == BICO_METHOD_BICO_IN ||
             r->method == BICO_METHOD_BICO_OUT;
  for (size_t ti = 0; ti < nt; ti++) {
    r->owner[ti] = NONE;
    if (!bico) continue;
    size_t mi;
    int role, dtype;
    bico_status st = bico_model_tensor_module(r->mt, ti, &mi, &role);
    if (st != BICO_OK) return st;
    bico_model_tensor(r->mt, ti, NULL, &dtype, NULL, NULL);
    size_t owner = NONE;
    if (role == BICO_ROLE_WEIGHT || role == BICO_ROLE_BIAS ||
        role == BICO_ROLE_VECTOR)
      owner = mi;
    else if (role == BICO_ROLE_TOKEN && (st = tie_module(r, ti, &owner)) != BICO_OK)
      return st;
    if (owner != NONE && r->mods[owner].src == NONE) owner = NONE;
    r->owner[ti] = owner;
    if (owner != NONE) r->mods[owner].refs++;
  }
  /* Ties that name nothing, or a tensor that is not a token, are mistakes
   * worth stopping for. */
  for (size_t i = 0; i < r->t->nties; i++) {
    const tie_rec *tie = &r->t->ties[i];
    size_t ti, mi;
    int role;
    if (bico_model_find_tensor(r->mt, tie->tensor, &ti) != BICO_OK)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "--tie %s=%s: the target base has no tensor %s",
                        tie->tensor, tie->module, tie->tensor);
    if (bico_model_find_module(r->mt, tie->module, &mi) != BICO_OK)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "--tie %s=%s: the target base has no module %s",
                        tie->tensor, tie->module, tie->module);
    bico_model_tensor_module(r->mt, ti, NULL, &role);
    if (role != BICO_ROLE_TOKEN)
      return bico__fail(ctx, BICO_E_ARG,
                        "--tie %s=%s: %s is not a token or embedding tensor "
                        "(it is carried by its own module's maps)",
                        tie->tensor, tie->module, tie->tensor);
  }
  return BICO_OK;
}

static bico_status report_tensor(run *r, size_t ti, const tinfo *info) {
  bico__report *rep = &r->rep;
  const char *name;
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(r->mt, ti, &name, NULL, &ndim, &shape);
  bico__report_begin_object(rep);
  bico__report_key_string(rep, "name", name);
  bico__report_key_string(rep, "handling", HANDLING[info->handling]);
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

static const char *const METHOD_NAME[7] = {
    NULL, "bico", "bico-in", "bico-out", "gradfix", "naive", "pad"};

static bico_status check_setup(run *r) {
  bico_transfer *t = r->t;
  bico_ctx *ctx = r->ctx;
  const char *const *f = (const char *const *)t->files;
  int lora = f[BICO_FILE_LORA] != NULL;
  if (lora && f[BICO_FILE_SOURCE_BASE] != NULL &&
      f[BICO_FILE_TARGET_BASE] != NULL &&
      (f[BICO_FILE_OUTPUT] != NULL || f[BICO_FILE_LORA_OUTPUT] != NULL)) {
    if (f[BICO_FILE_SOURCE_TUNED] != NULL || f[BICO_FILE_TASK_VECTOR] != NULL ||
        f[BICO_FILE_DELTA_OUTPUT] != NULL)
      return bico__fail(ctx, BICO_E_ARG,
                        "transfer_run: with a source adapter, give no %s",
                        f[BICO_FILE_DELTA_OUTPUT] != NULL
                            ? "delta output"
                            : "source tuned checkpoint or task vector");
  } else if (f[BICO_FILE_LORA_OUTPUT] != NULL && !lora) {
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: an output adapter needs a source "
                      "adapter");
  } else if (f[BICO_FILE_SOURCE_BASE] == NULL ||
             f[BICO_FILE_TARGET_BASE] == NULL || f[BICO_FILE_OUTPUT] == NULL)
    return bico__fail(ctx, BICO_E_ARG, "transfer_run: missing the %s file",
                      f[BICO_FILE_SOURCE_BASE] == NULL   ? "source base"
                      : f[BICO_FILE_TARGET_BASE] == NULL ? "target base"
                                                         : "output");
  if (!lora &&
      (f[BICO_FILE_SOURCE_TUNED] == NULL) == (f[BICO_FILE_TASK_VECTOR] == NULL))
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: give exactly one of the source tuned "
                      "checkpoint and the task vector");
  int bico = r->method <= BICO_METHOD_BICO_OUT;
  if (bico) {
    int calib = f[BICO_FILE_SOURCE_CALIB] != NULL || f[BICO_FILE_TARGET_CALIB] != NULL;
    if (calib && (f[BICO_FILE_SOURCE_CALIB] == NULL ||
                  f[BICO_FILE_TARGET_CALIB] == NULL))
      return bico__fail(ctx, BICO_E_ARG,
                        "transfer_run: the %s calibration file is missing "
                        "(source and target go together)",
                        f[BICO_FILE_SOURCE_CALIB] == NULL ? "source" : "target");
    if (calib == (f[BICO_FILE_STATS] != NULL))
      return bico__fail(ctx, BICO_E_ARG,
                        "transfer_run: method %s needs either calibration "
                        "files (source and target) or a statistics file%s",
                        METHOD_NAME[r->method],
                        calib ? ", not both" : "");
    if (f[BICO_FILE_STATS] != NULL &&
        (t->param[BICO_TRANSFER_CENTER] != 0 || t->param[BICO_TRANSFER_WHITEN] > 0))
      return bico__fail(ctx, BICO_E_ARG,
                        "transfer_run: centering and whitening need "
                        "calibration files; a statistics file holds only the "
                        "cross-covariances");
  }
  if (r->method == BICO_METHOD_GRADFIX && f[BICO_FILE_TARGET_VOTES] == NULL)
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: method gradfix needs the target votes "
                      "file");
  /* Outputs must be distinct from each other. */
  const int outs[3] = {BICO_FILE_OUTPUT, BICO_FILE_DELTA_OUTPUT, BICO_FILE_REPORT};
  for (int i = 0; i < 3; i++)
    for (int j = i + 1; j < 3; j++)
      if (f[outs[i]] && f[outs[j]] && strcmp(f[outs[i]], f[outs[j]]) == 0)
        return bico__fail(ctx, BICO_E_ARG,
                          "transfer_run: the %s and the %s are the same path "
                          "%s",
                          FILE_OPTION[outs[i]], FILE_OPTION[outs[j]], f[outs[i]]);
  return BICO_OK;
}

static bico_status check_outputs(run *r) {
  static const int ins[8] = {BICO_FILE_SOURCE_BASE,  BICO_FILE_SOURCE_TUNED,
                             BICO_FILE_TASK_VECTOR,  BICO_FILE_TARGET_BASE,
                             BICO_FILE_SOURCE_CALIB, BICO_FILE_TARGET_CALIB,
                             BICO_FILE_STATS,        BICO_FILE_TARGET_VOTES};
  bico_stfile *fs[8] = {r->sb, r->sft, r->tv, r->tb, r->sc, r->tc, r->stats,
                        r->votes};
  const int outs[3] = {BICO_FILE_OUTPUT, BICO_FILE_DELTA_OUTPUT, BICO_FILE_REPORT};
  for (int o = 0; o < 3; o++)
    for (int i = 0; i < 8; i++) {
      if (r->t->files[outs[o]] == NULL || r->t->files[ins[i]] == NULL) continue;
      bico_status st = bico__check_distinct(r->ctx, "transfer_run",
                                            FILE_OPTION[outs[o]],
                                            r->t->files[outs[o]],
                                            r->t->files[ins[i]], fs[i]);
      if (st != BICO_OK) return st;
    }
  return BICO_OK;
}

/* ---- The LoRA branch (lib/lora_transfer.c) reaches the maps through
 * these callbacks. ---- */

static size_t lora_split(void *opaque, size_t mi) {
  return ((run *)opaque)->mods[mi].k;
}

static bico_status lora_map(void *opaque, size_t mi, int side, size_t block,
                            const float **rm, size_t *da, size_t *db,
                            size_t *rank) {
  run *r = opaque;
  modstate *s = &r->mods[mi];
  if (s->src == NONE)
    return bico__fail(r->ctx, BICO_E_NOTFOUND,
                      "module %s has no partner in the source",
                      mname(r->mt, mi));
  bico_status st = need_side(r, mi, side);
  if (st != BICO_OK) return st;
  const map_t *m = side ? &s->out[block] : &s->in;
  *rm = m->r;
  *da = m->da;
  *db = m->db;
  *rank = m->rank;
  return BICO_OK;
}

static bico_status lora_vector_map(void *opaque, size_t ti, size_t *mi,
                                   int *side, int *identity) {
  run *r = opaque;
  size_t owner = r->owner[ti];
  if (owner == NONE) return BICO_E_NOTFOUND;
  int kind, role;
  bico_model_module(r->mt, owner, NULL, &kind, NULL, NULL);
  bico_model_tensor_module(r->mt, ti, NULL, &role);
  *mi = owner;
  *side = kind == BICO_MODULE_ELEMENTWISE
              ? r->t->param[BICO_TRANSFER_NORM_MAP] == BICO_NORM_MAP_GRAD
              : 1;
  *identity = role == BICO_ROLE_TOKEN && kind == BICO_MODULE_LINEAR &&
              r->method == BICO_METHOD_BICO_IN;
  return BICO_OK;
}

static void lora_release(void *opaque, size_t mi) {
  run *r = opaque;
  free_maps(r, &r->mods[mi]);
}

static void lora_log(void *opaque, const char *line) {
  run *r = opaque;
  if (r->t->log) r->t->log(r->t->log_opaque, line);
}

static bico_status lora_branch(run *r) {
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
  h.out_dir = f[BICO_FILE_LORA_OUTPUT];
  h.out_ckpt = f[BICO_FILE_OUTPUT];
  h.report_path = f[BICO_FILE_REPORT];
  h.opaque = r;
  h.split = lora_split;
  h.map = lora_map;
  h.vector_map = lora_vector_map;
  h.release = lora_release;
  h.log = lora_log;
  bico_status st = bico__lora_transfer_run(&h);
  if (st == BICO_OK) {
    r->t->updated = h.updated;
    r->t->unchanged = bico_model_tensor_count(r->mt) - h.updated;
  }
  return st;
}

static bico_status run_all(run *r) {
  bico_transfer *t = r->t;
  bico_ctx *ctx = r->ctx;
  bico_status st = check_setup(r);
  if (st == BICO_OK) st = open_file(r, BICO_FILE_SOURCE_BASE, &r->sb);
  if (st == BICO_OK) st = open_file(r, BICO_FILE_SOURCE_TUNED, &r->sft);
  if (st == BICO_OK) st = open_file(r, BICO_FILE_TASK_VECTOR, &r->tv);
  if (st == BICO_OK) st = open_file(r, BICO_FILE_TARGET_BASE, &r->tb);
  int bico = r->method <= BICO_METHOD_BICO_OUT;
  if (st == BICO_OK && bico) st = open_file(r, BICO_FILE_SOURCE_CALIB, &r->sc);
  if (st == BICO_OK && bico) st = open_file(r, BICO_FILE_TARGET_CALIB, &r->tc);
  if (st == BICO_OK && bico) st = open_file(r, BICO_FILE_STATS, &r->stats);
  if (st == BICO_OK && r->method == BICO_METHOD_GRADFIX)
    st = open_file(r, BICO_FILE_TARGET_VOTES, &r->votes);
  if (st == BICO_OK) st = check_outputs(r);
  if (st == BICO_OK) st = bico_model_from_stfile(ctx, r->sb, &r->ms);
  if (st == BICO_OK) st = bico_model_from_stfile(ctx, r->tb, &r->mt);
  const char *bs = t->strings[BICO_TRANSFER_SOURCE_BLOCKS]
                       ? t->strings[BICO_TRANSFER_SOURCE_BLOCKS]
                       : t->strings[BICO_TRANSFER_BLOCKS];
  const char *bt = t->strings[BICO_TRANSFER_TARGET_BLOCKS]
                       ? t->strings[BICO_TRANSFER_TARGET_BLOCKS]
                       : t->strings[BICO_TRANSFER_BLOCKS];
  if (st == BICO_OK && bs) st = bico_model_set_blocks(r->ms, bs);
  if (st == BICO_OK && bt) st = bico_model_set_blocks(r->mt, bt);
  if (st == BICO_OK) st = bico_model_blocks(r->ms, NULL, NULL);
  if (st == BICO_OK) st = bico_model_blocks(r->mt, NULL, NULL);
  if (st == BICO_OK && bico) {
    st = bico_procrustes_create(ctx, &r->proc);
    if (st == BICO_OK)
      st = bico_procrustes_set_param(r->proc, BICO_PROC_RANK_TOL,
                                     t->param[BICO_TRANSFER_RANK_TOL]);
    if (st == BICO_OK)
      st = bico_procrustes_set_param(r->proc, BICO_PROC_NULL,
                                     t->param[BICO_TRANSFER_NULL]);
    if (st == BICO_OK)
      st = bico_procrustes_set_param(r->proc, BICO_PROC_CENTER,
                                     t->param[BICO_TRANSFER_CENTER]);
    if (st == BICO_OK)
      st = bico_procrustes_set_param(r->proc, BICO_PROC_WHITEN,
                                     t->param[BICO_TRANSFER_WHITEN]);
    if (st == BICO_OK)
      st = bico_procrustes_set_param(r->proc, BICO_PROC_METHOD,
                                     t->param[BICO_TRANSFER_PROC_METHOD]);
  }
  if (st == BICO_OK) st = plan(r);
  if (st != BICO_OK) return st;
  int partial = t->select != NULL;
  if (t->files[BICO_FILE_LORA] != NULL) {
    if (partial)
      return bico__fail(ctx, BICO_E_UNSUPPORTED,
                        "transfer_run: a partial run cannot carry a LoRA "
                        "adapter");
    return lora_branch(r);
  }
  if (partial && t->nselect != bico_model_tensor_count(r->mt))
    return bico__fail(ctx, BICO_E_SHAPE,
                      "transfer_run: the partial run's selection covers %zu "
                      "tensors, the target base has %zu",
                      t->nselect, bico_model_tensor_count(r->mt));

  const char *sp, *tp;
  size_t sl, tl;
  bico_model_blocks(r->ms, &sp, &sl);
  bico_model_blocks(r->mt, &tp, &tl);
  size_t nt = bico_model_tensor_count(r->mt);
  char bsrc[160], btgt[160];
  if (sp)
    snprintf(bsrc, sizeof bsrc, "%zu blocks %s%s<i>", sl, sp, sp[0] ? "." : "");
  else
    snprintf(bsrc, sizeof bsrc, "no blocks");
  if (tp)
    snprintf(btgt, sizeof btgt, "%zu blocks %s%s<i>", tl, tp, tp[0] ? "." : "");
  else
    snprintf(btgt, sizeof btgt, "no blocks");
  logf_(r, "bico: method %s, alpha %g; source: %s; target: %s; %zu target "
           "tensors",
        METHOD_NAME[r->method], (double)r->alpha, bsrc, btgt, nt);

  if (bico) st = pool_start(r, partial ? t->select : NULL);

  /* Writers: declare every tensor up front, in the target's order. */
  if (st == BICO_OK && !partial)
    st = bico_stwriter_create(ctx, t->files[BICO_FILE_OUTPUT], &r->w);
  if (st == BICO_OK && !partial && t->files[BICO_FILE_DELTA_OUTPUT])
    st = bico_stwriter_create(ctx, t->files[BICO_FILE_DELTA_OUTPUT], &r->wd);
  for (size_t ti = 0; ti < nt && st == BICO_OK && !partial; ti++) {
    const char *name;
    int dtype = 0;
    size_t ndim;
    const size_t *shape;
    size_t fi;
    bico_model_tensor(r->mt, ti, &name, NULL, &ndim, &shape);
    st = bico_stfile_find(r->tb, name, &fi);
    if (st == BICO_OK) st = bico_stfile_tensor_info(r->tb, fi, NULL, &dtype, NULL, NULL);
    if (st == BICO_OK) st = bico_stwriter_declare(r->w, name, dtype, ndim, shape);
    int fl = dtype == BICO_DTYPE_F32 || dtype == BICO_DTYPE_F16 ||
             dtype == BICO_DTYPE_BF16 || dtype == BICO_DTYPE_F64;
    if (st == BICO_OK && r->wd && fl)
      st = bico_stwriter_declare(r->wd, name, dtype, ndim, shape);
  }
  bico__report_begin_object(&r->rep);
  bico__report_key_string(&r->rep, "method", METHOD_NAME[r->method]);
  bico__report_key_number(&r->rep, "alpha", (double)r->alpha);
  bico__report_key(&r->rep, "tensors");
  bico__report_begin_array(&r->rep);

  /* Progress only on long runs: at most every 5 seconds. */
  time_t last = time(NULL);
  for (size_t ti = 0; ti < nt && st == BICO_OK; ti++) {
    if (partial && !t->select[ti]) {
      /* Another process's tensor: only the map reference goes. */
      if (r->owner[ti] != NONE && --r->mods[r->owner[ti]].refs == 0)
        free_maps(r, &r->mods[r->owner[ti]]);
      continue;
    }
    const char *name;
    int dtype;
    size_t ndim;
    const size_t *shape;
    bico_model_tensor(r->mt, ti, &name, &dtype, &ndim, &shape);
    size_t fi;
    bico_stfile_find(r->tb, name, &fi);
    bico_stfile_tensor_info(r->tb, fi, NULL, &dtype, NULL, NULL);
    size_t nb = numel_of(ndim, shape);
    int fl = dtype == BICO_DTYPE_F32 || dtype == BICO_DTYPE_F16 ||
             dtype == BICO_DTYPE_BF16 || dtype == BICO_DTYPE_F64;
    tinfo info;
    memset(&info, 0, sizeof info);
    info.kept = -1;
    float *upd = NULL;
    if (fl && nb > 0) {
      upd = bico__alloc(ctx, nb * sizeof(float));
      if (upd == NULL) st = BICO_E_NOMEM;
      if (st == BICO_OK)
        st = bico ? bico_update(r, ti, upd, &info)
                  : elementwise_update(r, ti, upd, &info);
      if (st != BICO_OK) st = wrap(ctx, st, "tensor", name);
    } else {
      snprintf(info.reason, sizeof info.reason, "%s",
               fl ? "empty tensor" : "not a floating-point tensor");
    }
    if (st == BICO_OK && partial) {
      double ss = 0;
      if (info.handling != H_UNCHANGED)
        for (size_t e = 0; e < nb; e++) ss += (double)upd[e] * (double)upd[e];
      info.norm = sqrt(ss);
      int role = BICO_ROLE_OTHER;
      bico_model_tensor_module(r->mt, ti, NULL, &role);
      if (info.handling == H_UNCHANGED && fl && nb > 0 && role != BICO_ROLE_OTHER)
        logf_(r, "bico: unchanged: %s (%s)", name, info.reason);
    } else if (st == BICO_OK && info.handling != H_UNCHANGED) {
      double *base = bico__alloc(ctx, nb * sizeof(double));
      if (base == NULL) st = BICO_E_NOMEM;
      if (st == BICO_OK) st = bico_stfile_read_f64(r->tb, fi, base, nb);
      if (st == BICO_OK) st = bico_stfile_check_finite(r->tb, fi);
      double ss = 0;
      for (size_t e = 0; e < nb && st == BICO_OK; e++) {
        ss += (double)upd[e] * (double)upd[e];
        base[e] += (double)upd[e];
      }
      info.norm = sqrt(ss);
      if (st == BICO_OK) st = bico_stwriter_write_f64(r->w, name, base, nb);
      if (st == BICO_OK && r->wd) st = bico_stwriter_write_f32(r->wd, name, upd, nb);
      bico__free(ctx, base);
    } else if (st == BICO_OK) {
      const void *data;
      size_t nbytes;
      st = bico_stfile_data(r->tb, fi, &data, &nbytes);
      if (st == BICO_OK) st = bico_stwriter_write_raw(r->w, name, data, nbytes);
      bico__stfile_drop(r->tb, fi);
      if (st == BICO_OK && r->wd && fl) {
        if (upd) memset(upd, 0, nb * sizeof(float));
        static const float zero = 0.0f;
        st = bico_stwriter_write_f32(r->wd, name, upd ? upd : &zero, nb);
      }
      int role = BICO_ROLE_OTHER;
      bico_model_tensor_module(r->mt, ti, NULL, &role);
      if (st == BICO_OK && fl && nb > 0 && role != BICO_ROLE_OTHER)
        logf_(r, "bico: unchanged: %s (%s)", name, info.reason);
    }
    if (st == BICO_OK) {
      r->count[info.handling]++;
      size_t at = r->rep.len;
      st = report_tensor(r, ti, &info);
      if (st == BICO_OK && partial) {
        /* The entry alone, without the separator before it. */
        const char *e = r->rep.buf + at;
        while (*e == ',' || *e == '\n' || *e == ' ') e++;
        int changed = info.handling != H_UNCHANGED;
        st = t->sink(t->sink_opaque, ti, name, HANDLING[info.handling],
                     changed ? upd : NULL, changed ? nb : 0, e);
        if (st != BICO_OK && bico_ctx_errmsg(ctx)[0] == '\0')
          st = bico__fail(ctx, st, "transfer_run: the partial run's sink "
                          "refused tensor %s", name);
        /* Entries are handed over one by one: keep the buffer small. */
        r->rep.len = at;
        r->rep.buf[at] = '\0';
      }
    }
    bico__free(ctx, upd);
    if (st == BICO_OK && r->owner[ti] != NONE &&
        --r->mods[r->owner[ti]].refs == 0)
      free_maps(r, &r->mods[r->owner[ti]]);
    if (st == BICO_OK && ti + 1 < nt && time(NULL) - last >= 5) {
      last = time(NULL);
      logf_(r, "bico: %zu/%zu tensors done (%s)", ti + 1, nt, name);
    }
  }
  bico__report_end_array(&r->rep);
  bico__report_key(&r->rep, "summary");
  bico__report_begin_object(&r->rep);
  size_t updated = 0;
  for (int h = 0; h < H_COUNT; h++) {
    bico__report_key_number(&r->rep, HANDLING[h], (double)r->count[h]);
    if (h != H_UNCHANGED) updated += r->count[h];
  }
  bico__report_end_object(&r->rep);
  bico__report_end_object(&r->rep);
  if (st == BICO_OK) st = r->rep.status;
  /* Commit order: report to its temporary file, then the outputs, then the
   * report's rename; a failure before the last commit leaves nothing. */
  char *rep_tmp = NULL;
  if (partial) {
    if (st == BICO_OK) {
      t->updated = updated;
      t->unchanged = r->count[H_UNCHANGED];
      logf_(r, "bico: partial run: %zu tensors updated, %zu unchanged",
            updated, r->count[H_UNCHANGED]);
    }
    return st;
  }
  if (st == BICO_OK && t->files[BICO_FILE_REPORT])
    st = bico__report_write_tmp(ctx, &r->rep, t->files[BICO_FILE_REPORT],
                                &rep_tmp);
  if (st == BICO_OK && r->wd) st = bico_stwriter_commit(r->wd);
  if (st == BICO_OK) st = bico_stwriter_commit(r->w);
  if (rep_tmp != NULL) {
    if (st == BICO_OK) st = bico__report_commit(ctx, rep_tmp, t->files[BICO_FILE_REPORT]);
    else unlink(rep_tmp);
    bico__free(ctx, rep_tmp);
  }
  if (st == BICO_OK) {
    t->updated = updated;
    t->unchanged = r->count[H_UNCHANGED];
    logf_(r, "bico: %zu tensors updated (linear %zu, vector %zu, tied %zu, "
             "naive %zu, padded %zu, masked %zu), %zu unchanged; wrote %s",
          updated, r->count[H_LINEAR], r->count[H_VECTOR], r->count[H_TIED],
          r->count[H_NAIVE], r->count[H_PADDED], r->count[H_MASKED],
          r->count[H_UNCHANGED], t->files[BICO_FILE_OUTPUT]);
  }
  return st;
}

bico_status bico_transfer_run(bico_transfer *t) {
  if (t == NULL) return BICO_E_NULL;
  bico_ctx *ctx = t->ctx;
  bico__clear(ctx);
  t->ran = 0;
  run r;
  memset(&r, 0, sizeof r);
  r.t = t;
  r.ctx = ctx;
  r.method = (int)t->param[BICO_TRANSFER_METHOD];
  r.alpha = (float)t->param[BICO_TRANSFER_ALPHA];
  bico__report_init(&r.rep, ctx);
  bico_status st = run_all(&r);
  pool_stop(&r);
  for (size_t m = 0; m < r.nm && r.mods; m++) free_maps(&r, &r.mods[m]);
  bico__free(ctx, r.mods);
  bico__free(ctx, r.owner);
  bico_stwriter_free(r.w);
  bico_stwriter_free(r.wd);
  bico_procrustes_free(r.proc);
  bico_model_free(r.ms);
  bico_model_free(r.mt);
  bico_stfile *fs[8] = {r.sb, r.sft, r.tv, r.tb, r.sc, r.tc, r.stats, r.votes};
  for (int i = 0; i < 8; i++) bico_stfile_close(fs[i]);
  bico__report_free(&r.rep);
  if (st == BICO_OK) t->ran = 1;
  return st;
}
