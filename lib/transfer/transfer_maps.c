/* The transfer driver's maps: each side of each target module is solved
 * once (from a statistics file or from two calibration files) when the
 * first tensor needs it, either in the calling thread or ahead of need by
 * the solver pool (BICO_TRANSFER_WORKERS > 1), and freed after the last
 * tensor that uses it. */
#include <pthread.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib.h"
#include "family.h"
#include "transfer_internal.h"

void bico__xfer_free_maps(bico__run *r, bico__modstate *s) {
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
  bico__map *maps; /* k maps once done, until the calling thread takes them */
} sidejob;

enum { JOB_PENDING = 0, JOB_RUNNING, JOB_DONE, JOB_FAILED };

/* Where a solve gets its context, solver and files. */
typedef struct solver {
  bico_ctx *ctx;
  bico_procrustes *proc;
  bico_stfile *stats, *sc, *tc;
} solver;

static bico_status side_job(bico__run *r, size_t mi, int side, sidejob *j) {
  bico__modstate *s = &r->mods[mi];
  size_t dout_b, din_b, dout_a, din_a;
  memset(j, 0, sizeof *j);
  j->mi = mi;
  j->side = side;
  j->tm = bico__xfer_mname(r->mt, mi);
  j->sm = bico__xfer_mname(r->ms, s->src);
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
    return bico_stfile_read_f64_range(s->f, s->idx, (s->r0 + i0) * s->ld, out,
                                      ni * nj);
  bico_status st = BICO_OK;
  for (size_t i = 0; i < ni && st == BICO_OK; i++)
    st = bico_stfile_read_f64_range(s->f, s->idx,
                                    (s->r0 + i0 + i) * s->ld + s->c0 + j0,
                                    out + i * ld, nj);
  return st;
}

static void stat_release(void *opaque) {
  const stat_src *s = opaque;
  bico__stfile_drop(s->f, s->idx);
}

/* LayerNorm families (GPT-2, CLIP): the gradients that reach the residual
 * stream pass through LayerNorms, which remove their mean, so an
 * output-gradient statistic there says nothing about the all-ones
 * direction and the solver's completion pairs it with either sign.  A map
 * that fixes the all-ones vector is the only kind LayerNorm allows (its
 * mean), so when a rank-deficient square map pairs 1 with -1 exactly, the
 * sign is the completion's and is turned back. */
static void fix_ones(int family, bico__map *m) {
  if (family != BICO__FAMILY_GPT2 && family != BICO__FAMILY_CLIP) return;
  size_t n = m->da;
  if (n == 0 || m->db != n || m->rank >= n) return;
  double s = 0;
  for (size_t e = 0; e < n * n; e++) s += m->r[e];
  s /= (double)n;
  if (s > -(1.0 - 1e-3)) return;
  float add = (float)(2.0 / (double)n);
  for (size_t e = 0; e < n * n; e++) m->r[e] += add;
}

/* The thin route (docs/methods.md, "Thin solves"): with n calibration rows
 * no more than a block's smaller width (and no whitening), each block's
 * map is solved from the rows themselves, bico_procrustes_solve_rows, and
 * no d_a x d_b statistic is formed.  The rows of both sides are read once
 * (n (d_a + d_b) floats); *done is 0 when the route does not apply. */
static bico_status thin_side(bico__run *r, solver *sv, const sidejob *j,
                             size_t ia, size_t rows_a, size_t ib,
                             size_t rows_b, bico__map *maps, int *done) {
  bico_ctx *ctx = sv->ctx;
  const size_t k = j->k, ba = j->da / k, bb = j->db / k;
  *done = 0;
  if (rows_a != rows_b || rows_a > (ba < bb ? ba : bb) ||
      r->t->param[BICO_TRANSFER_WHITEN] > 0)
    return BICO_OK; /* the accumulator's route, and its messages */
  *done = 1;
  const size_t n = rows_a;
  float *xa = n ? alloc_mat(ctx, n, j->da, sizeof(float)) : NULL;
  float *xb = n ? alloc_mat(ctx, n, j->db, sizeof(float)) : NULL;
  bico_status st = BICO_OK;
  if (n && (xa == NULL || xb == NULL)) st = BICO_E_NOMEM;
  if (st == BICO_OK && n)
    st = bico_stfile_read_f32_range(sv->sc, ia, 0, xa, n * j->da);
  if (st == BICO_OK && n)
    st = bico_stfile_read_f32_range(sv->tc, ib, 0, xb, n * j->db);
  if (st != BICO_OK && st != BICO_E_NOMEM)
    st = bico__fail(ctx, st, "module %s: reading calibration rows: %s", j->tm,
                    bico_ctx_errmsg(ctx));
  for (size_t b = 0; b < k && st == BICO_OK; b++) {
    int thin = 0;
    st = bico_procrustes_solve_rows(sv->proc, n, ba, bb, xa ? xa + b * ba : NULL,
                                    j->da, xb ? xb + b * bb : NULL, j->db,
                                    maps[b].r, bb, &maps[b].rank, &thin);
    maps[b].thin = thin;
    if (st != BICO_OK) st = bico__xfer_wrap(ctx, st, "module", j->tm);
  }
  bico__free(ctx, xa);
  bico__free(ctx, xb);
  return st;
}

/* Job j's maps from accumulators the host lent (transfer_mem.c): one per
 * block, or one for the whole side whose diagonal blocks are carved. */
static bico_status solve_lent(solver *sv, const sidejob *j, size_t nlent,
                              const bico_xcov *const *lent, bico__map *maps) {
  bico_ctx *ctx = sv->ctx;
  size_t k = j->k, ba = j->da / k, bb = j->db / k;
  const char *key = j->side ? "out_xcov" : "in_xcov";
  if (nlent != 1 && nlent != k)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "module %s: %zu lent %s blocks for an output split in "
                      "%zu blocks (give 1 or %zu)",
                      j->tm, nlent, key, k, k);
  size_t wa = nlent == 1 ? j->da : ba, wb = nlent == 1 ? j->db : bb;
  for (size_t b = 0; b < nlent; b++) {
    size_t da = 0, db = 0;
    bico_xcov_info(lent[b], &da, &db, NULL, NULL);
    if (da != wa || db != wb)
      return bico__fail(ctx, BICO_E_SHAPE,
                        "module %s: lent %s block %zu is [%zu, %zu], the "
                        "module needs [%zu, %zu] (source %s x target widths)",
                        j->tm, key, b, da, db, wa, wb, j->sm);
  }
  bico_status st = BICO_OK;
  for (size_t b = 0; b < k && st == BICO_OK; b++) {
    bico_xcov *carved = NULL;
    const bico_xcov *x = lent[nlent == 1 ? 0 : b];
    if (nlent == 1 && k > 1) {
      st = bico__xcov_block(ctx, x, b, k, &carved);
      x = carved;
    }
    if (st == BICO_OK)
      st = bico_procrustes_solve(sv->proc, x, maps[b].r, bb, &maps[b].rank);
    if (st != BICO_OK) st = bico__xfer_wrap(ctx, st, "module", j->tm);
    bico_xcov_free(carved);
  }
  return st;
}

/* Computes the maps of job j (side 0 = input activations, one map; side 1
 * = output gradients, k maps) with solver sv into *out. */
static bico_status solve_side(bico__run *r, solver *sv, const sidejob *j,
                              bico__map **out) {
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
  bico__map *maps = bico__calloc(ctx, k, sizeof *maps);
  if (maps == NULL) return BICO_E_NOMEM;
  for (size_t b = 0; b < k && st == BICO_OK; b++) {
    maps[b].da = ba;
    maps[b].db = bb;
    maps[b].r = alloc_mat(ctx, ba, bb, sizeof(float));
    if (maps[b].r == NULL) st = BICO_E_NOMEM;
  }
  const char *suffix = j->side ? "output_grad" : "input";
  const bico_xcov *const *lent = NULL;
  size_t nlent = bico__xfer_mem_xcov(r->t, tm,
                                     j->side ? BICO_SIDE_OUT : BICO_SIDE_IN,
                                     &lent);
  if (st == BICO_OK && nlent > 0) {
    st = solve_lent(sv, j, nlent, lent, maps);
  } else if (st == BICO_OK && sv->stats == NULL && sv->sc == NULL) {
    st = bico__fail(ctx, BICO_E_NOTFOUND,
                    "no statistics for module %s (%s.%s): none held in "
                    "memory, and no stats file or calibration files",
                    tm, tm, j->side ? "out_xcov" : "in_xcov");
  } else if (st == BICO_OK && sv->stats != NULL) {
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
      int dt = 0;
      st = bico_stfile_tensor_info(sv->stats, idx, NULL, &dt, &ndim, &shape);
      /* docs/formats.md: statistics are F64 (or F32); a BOOL or I8 tensor
       * under that name is not one. */
      if (st == BICO_OK && dt != BICO_DTYPE_F64 && dt != BICO_DTYPE_F32)
        st = bico__fail(ctx, BICO_E_FORMAT,
                        "statistics file %s: tensor %s is %s; statistics are "
                        "F64 or F32",
                        path, key, bico_dtype_name(dt));
      if (st == BICO_OK && (ndim != 2 || shape[0] != da || shape[1] != db))
        st = bico__fail(ctx, BICO_E_SHAPE,
                        "statistics file %s: tensor %s should be [%zu, %zu] "
                        "(source %s x target %s widths)%s",
                        path, key, da, db, sm, tm,
                        ndim == 2 && shape[0] == db && shape[1] == da
                            ? "; it is [target, source]: made from "
                              "calibration files given the wrong way round "
                              "(bico stats --source-calib takes the source "
                              "model's)?"
                            : "");
    }
    for (size_t b = 0; b < k && st == BICO_OK; b++) {
      /* Block b's statistic is the diagonal block (b, b) of the full one,
       * read from the file panel by panel (no d_a x d_b copy in memory). */
      stat_src src = {sv->stats, idx, db, b * ba, b * bb};
      const bico__creader rd = {stat_block, stat_release, &src};
      st = bico__procrustes_solve_reader(sv->proc, ba, bb, &rd, maps[b].r, bb,
                                         &maps[b].rank);
      if (st != BICO_OK) st = bico__xfer_wrap(ctx, st, "statistic", key);
    }
    bico__free(ctx, key);
  } else if (st == BICO_OK) {
    const char *pa = r->t->files[BICO_FILE_SOURCE_CALIB];
    const char *pb = r->t->files[BICO_FILE_TARGET_CALIB];
    size_t la = strlen(sm) + 16, lb = strlen(tm) + 16, ia, ib, rows, rows_a = 0;
    int thin = 0;
    char *ka = bico__alloc(ctx, la), *kb = bico__alloc(ctx, lb);
    bico_xcov **xcs = bico__calloc(ctx, k, sizeof *xcs);
    if (ka == NULL || kb == NULL || xcs == NULL) st = BICO_E_NOMEM;
    if (st == BICO_OK) {
      snprintf(ka, la, "%s.%s", sm, suffix);
      snprintf(kb, lb, "%s.%s", tm, suffix);
      st = bico__calib_find(ctx, sv->sc, pa, ka, da, &ia, &rows_a);
      if (st == BICO_OK) st = bico__calib_find(ctx, sv->tc, pb, kb, db, &ib, &rows);
    }
    if (st == BICO_OK)
      st = thin_side(r, sv, j, ia, rows_a, ib, rows, maps, &thin);
    unsigned flags = 0;
    if (r->t->param[BICO_TRANSFER_CENTER] != 0) flags |= BICO_XCOV_SUMS;
    if (r->t->param[BICO_TRANSFER_WHITEN] > 0) flags |= BICO_XCOV_GRAMS;
    for (size_t b = 0; b < k && st == BICO_OK && !thin; b++)
      st = bico_xcov_create(ctx, ba, bb, flags, &xcs[b]);
    if (st == BICO_OK && !thin)
      st = bico__calib_accumulate(ctx, tm, sv->sc, pa, ia, da, sv->tc, pb, ib,
                                  db, k, xcs);
    for (size_t b = 0; b < k && st == BICO_OK && !thin; b++) {
      st = bico_procrustes_solve(sv->proc, xcs[b], maps[b].r, bb,
                                 &maps[b].rank);
      if (st != BICO_OK) st = bico__xfer_wrap(ctx, st, "module", tm);
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
  for (size_t b = 0; b < k; b++) fix_ones(r->kind[1], &maps[b]);
  *out = maps;
  return BICO_OK;
}

/* Hands job maps to module mi's state. */
static void publish(bico__run *r, size_t mi, int side, bico__map *maps) {
  bico__modstate *s = &r->mods[mi];
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
  struct bico__pool *pool;
  solver sv;
  pthread_t th;
  int started;
} worker;

typedef struct bico__pool {
  bico__run *r;
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
    bico__map *maps = NULL;
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
  bico_stfile_free(sv->stats);
  bico_stfile_free(sv->sc);
  bico_stfile_free(sv->tc);
  bico_ctx_free(sv->ctx);
  memset(sv, 0, sizeof *sv);
}

/* A worker's context, solver and file handles, configured like the run's. */
static bico_status solver_open(bico__run *r, solver *sv, long threads) {
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
      if (st == BICO_OK) st = bico__xfer_rename_source(r->t, which[i], *fs[i]);
      if (st != BICO_OK)
        st = bico__xfer_wrap(sv->ctx, st, bico_transfer_file_name(which[i]),
                             r->t->files[which[i]]);
    }
  if (st != BICO_OK) {
    st = bico__fail(c, st, "transfer_run: worker setup: %s",
                    bico_ctx_errmsg(sv->ctx));
    solver_close(sv);
  }
  return st;
}

void bico__xfer_pool_stop(bico__run *r) {
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

/* Plans the jobs in the order the tensors need them and starts the
 * workers.  Runs only for BiCo methods with more than one worker. */
bico_status bico__xfer_pool_start(bico__run *r, const unsigned char *select) {
  bico_ctx *ctx = r->ctx;
  size_t nw = (size_t)r->t->param[BICO_TRANSFER_WORKERS];
  size_t nt = bico__model_ntensors(r->mt), cap = 0;
  if (nw < 2 || r->nm == 0 || r->bridge != NULL) return BICO_OK;
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
    bico__xfer_predict_sides(r, ti, &mi, need);
    for (int side = 0; side < 2 && st == BICO_OK; side++) {
      if (!need[side] || r->mods[mi].job[side] != 0 ||
          bico__xfer_structured(r, mi, side))
        continue; /* structure-aware sides: solved per layer, in order */
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
    bico__xfer_log(r, "bico: %zu maps to solve, %zu solver threads", P->njobs, P->nw);
  return st;
}

/* Computes the maps of one side of target module mi in the calling thread. */
static bico_status compute_side(bico__run *r, size_t mi, int side) {
  sidejob j;
  bico_status st = side_job(r, mi, side, &j);
  if (st != BICO_OK) return st;
  solver sv = {r->ctx, r->proc, r->stats, r->sc, r->tc};
  bico__map *maps = NULL;
  st = solve_side(r, &sv, &j, &maps);
  if (st == BICO_OK) publish(r, mi, side, maps);
  return st;
}

bico_status bico__xfer_need_side(bico__run *r, size_t mi, int side) {
  bico__modstate *s = &r->mods[mi];
  if (side ? s->have_out : s->have_in) return BICO_OK;
  if (r->bridge != NULL) { /* the maps were solved when the bridge was made */
    bico__map *maps = NULL;
    bico_status st = bico__bridge_load(r, mi, side, &maps);
    if (st == BICO_OK) publish(r, mi, side, maps);
    return st;
  }
  if (bico__xfer_structured(r, mi, side)) {
    bico__map *maps = NULL;
    int fallback = 0;
    bico_status st = bico__xfer_struct_solve(r, mi, side, &maps, &fallback);
    if (st != BICO_OK) return st;
    if (!fallback) {
      publish(r, mi, side, maps);
      return BICO_OK;
    }
  }
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
  bico__map *maps = j->maps;
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


void bico__xfer_release(bico__run *r, size_t ti) {
  size_t owner = r->owner[ti];
  if (owner != BICO__NONE && --r->mods[owner].refs == 0)
    bico__xfer_free_maps(r, &r->mods[owner]);
}
