/* The transfer driver's updates: alpha tau_B of one target tensor, by
 * method (BiCo maps, naive, pad, GradFix) and by the tensor's role. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib.h"
#include "family.h"
#include "transfer_internal.h"
#include "vocab.h"

/* Where source tensor si's task vector comes from: a task-vector file, or
 * the tuned checkpoint less the base (diff). */
typedef struct tau_src {
  const bico_stfile *f;
  size_t idx, bi;
  int diff;
} tau_src;

/* Finds source tensor si's task vector, checks its shape against the
 * source base and that every value involved is finite (streamed: no
 * memory of the tensor's size). */
static bico_status tau_open(bico__run *r, size_t si, tau_src *ts) {
  bico_ctx *ctx = r->ctx;
  const char *name;
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(r->ms, si, &name, NULL, &ndim, &shape);
  ts->f = r->tv ? r->tv : r->sft;
  ts->diff = r->tv == NULL;
  const char *path =
      r->t->files[r->tv ? BICO_FILE_TASK_VECTOR : BICO_FILE_SOURCE_TUNED];
  size_t nd2;
  const size_t *sh2;
  if (bico_stfile_find(ts->f, name, &ts->idx) != BICO_OK)
    return bico__fail(ctx, BICO_E_NOTFOUND, "%s %s has no tensor %s",
                      r->tv ? "task vector" : "source tuned", path, name);
  bico_status st = bico_stfile_tensor_info(ts->f, ts->idx, NULL, NULL, &nd2, &sh2);
  if (st != BICO_OK) return st;
  if (nd2 != ndim || (ndim && memcmp(shape, sh2, ndim * sizeof *shape) != 0)) {
    char a[128], b[128];
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s %s: tensor %s is %s there but %s in the source base",
                      r->tv ? "task vector" : "source tuned", path, name,
                      bico__shape_text(a, sizeof a, nd2, sh2),
                      bico__shape_text(b, sizeof b, ndim, shape));
  }
  st = bico_stfile_check_finite(ts->f, ts->idx);
  if (st != BICO_OK || !ts->diff) return st;
  st = bico_stfile_find(r->sb, name, &ts->bi);
  return st == BICO_OK ? bico_stfile_check_finite(r->sb, ts->bi) : st;
}

/* Elements [first, first + count) of the task vector into tau. */
static bico_status tau_read(bico__run *r, const tau_src *ts, size_t first,
                            size_t count, float *tau) {
  bico_ctx *ctx = r->ctx;
  bico_status st = bico_stfile_read_f32_range(ts->f, ts->idx, first, tau, count);
  if (st != BICO_OK || !ts->diff || count == 0) return st;
  float *base = bico__alloc(ctx, count * sizeof(float));
  if (base == NULL) return BICO_E_NOMEM;
  st = bico_stfile_read_f32_range(r->sb, ts->bi, first, base, count);
  for (size_t e = 0; e < count && st == BICO_OK; e++) {
    tau[e] -= base[e];
    /* both finite (tau_open): only the difference can overflow; named by
     * the user's files and tensor, not by the kernel that would meet it */
    if (!isfinite(tau[e])) {
      const char *name = "?";
      bico_stfile_tensor_info(ts->f, ts->idx, &name, NULL, NULL, NULL);
      st = bico__fail(ctx, BICO_E_NONFINITE,
                      "source tuned %s minus source base %s: tensor %s is %s "
                      "at element %zu (a difference beyond float range)",
                      r->t->files[BICO_FILE_SOURCE_TUNED],
                      r->t->files[BICO_FILE_SOURCE_BASE], name,
                      isnan(tau[e]) ? "NaN" : "Inf", first + e);
    }
  }
  bico__free(ctx, base);
  return st;
}

/* Reads the source task vector of source tensor si into tau (numel). */
static bico_status read_tau(bico__run *r, size_t si, float *tau, size_t numel) {
  tau_src ts;
  bico_status st = tau_open(r, si, &ts);
  return st == BICO_OK ? tau_read(r, &ts, 0, numel, tau) : st;
}

static void shape_str(char *buf, size_t cap, size_t ndim, const size_t *shape) {
  size_t o = 0;
  o += (size_t)snprintf(buf + o, cap - o, "[");
  for (size_t d = 0; d < ndim && o < cap; d++)
    o += (size_t)snprintf(buf + o, cap - o, "%s%zu", d ? ", " : "", shape[d]);
  if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* Target tensor ti and its paired source tensor's task vector. */
typedef struct pairing {
  const char *name;   /* target tensor */
  size_t ndim, nb;    /* its rank and numel */
  const size_t *shape;
  size_t nd_a, na;    /* the source tensor's */
  const size_t *sh_a;
  float *tau;         /* na floats */
  int vocab_rows;     /* rows gathered by token string: no output map */
  size_t sh_g[2];     /* the gathered task vector's shape */
} pairing;

/* The source row of target token row j: by token string when the
 * tokenizers differ (lib/model/vocab.c), else the same id; SIZE_MAX when the
 * source has none (a token it lacks, or a row past its padded table). */
static size_t src_row(const bico__run *r, size_t j, size_t rows_a) {
  const bico__vocab *v = r->vocab;
  size_t s = v == NULL ? j : j < v->n_target ? v->src_of[j] : SIZE_MAX;
  return s < rows_a ? s : SIZE_MAX;
}

/* 1 when the rows of target tensor ti and source tensor si are tokens to
 * be matched (src_row) rather than taken in order: both are token tables
 * or vocabulary heads, and the tokenizers differ or the tables have
 * different row counts (Qwen2 pads 151936 or 152064 rows). */
int bico__xfer_token_rows(const bico__run *r, size_t ti, size_t si) {
  const char *na, *nb;
  size_t da, db;
  const size_t *sa, *sb;
  bico_model_tensor(r->mt, ti, &nb, NULL, &db, &sb);
  bico_model_tensor(r->ms, si, &na, NULL, &da, &sa);
  return da == 2 && db == 2 && bico__vocab_tensor(nb, db, sb) &&
         bico__vocab_tensor(na, da, sa) && !bico__model_transposed(r->mt, ti) &&
         !bico__model_transposed(r->ms, si) &&
         (r->vocab != NULL || sa[0] != sb[0]);
}

/* Token rows matched (src_row): the source task vector's rows put in the
 * target's token order, zero for target tokens the source lacks (their
 * rows stay unchanged).  Replaces p->tau. */
static bico_status gather_vocab(bico__run *r, pairing *p, bico__tinfo *info) {
  size_t va = p->sh_a[0], cols = p->sh_a[1], vb = p->shape[0];
  size_t n = vb * cols;
  float *g = bico__calloc(r->ctx, n > 0 ? n : 1, sizeof *g);
  if (g == NULL) return BICO_E_NOMEM;
  info->vocab = 1;
  for (size_t j = 0; j < vb; j++) {
    size_t s = src_row(r, j, va);
    if (s != SIZE_MAX) {
      memcpy(g + j * cols, p->tau + s * cols, cols * sizeof *g);
      info->vocab_shared++;
    } else {
      info->vocab_new++;
    }
  }
  bico__free(r->ctx, p->tau);
  p->tau = g;
  p->sh_g[0] = vb;
  p->sh_g[1] = cols;
  p->sh_a = p->sh_g;
  p->na = vb * cols;
  p->vocab_rows = 1;
  return BICO_OK;
}

static bico_status weight_update_oi(bico__run *r, const bico__route *rt,
                                    const pairing *p, float *upd,
                                    bico__tinfo *info);

/* A weight in either storage layout (bico__model_transposed: GPT-2's
 * Conv1D keeps [in, out]): the maps act on [out, in], so a transposed
 * task vector is turned before and a transposed target after. */
static bico_status weight_update(bico__run *r, const bico__route *rt,
                                 const pairing *p, float *upd,
                                 bico__tinfo *info, size_t ti, size_t si) {
  bico_ctx *ctx = r->ctx;
  int ts = bico__model_transposed(r->ms, si);
  int tt = bico__model_transposed(r->mt, ti);
  if (!ts && !tt) return weight_update_oi(r, rt, p, upd, info);
  pairing q = *p;
  float *tau = NULL, *out = upd;
  if (ts) {
    tau = bico__alloc(ctx, p->na * sizeof(float));
    if (tau == NULL) return BICO_E_NOMEM;
    bico__xfer_transpose(p->tau, p->sh_a[0], p->sh_a[1], tau);
    q.tau = tau;
  }
  if (tt && (out = bico__alloc(ctx, p->nb * sizeof(float))) == NULL) {
    bico__free(ctx, tau);
    return BICO_E_NOMEM;
  }
  bico_status st = weight_update_oi(r, rt, &q, out, info);
  if (st == BICO_OK && tt)
    bico__xfer_transpose(out, p->shape[1], p->shape[0], upd);
  if (tt) bico__free(ctx, out);
  bico__free(ctx, tau);
  return st;
}

static bico_status weight_update_oi(bico__run *r, const bico__route *rt,
                                    const pairing *p, float *upd,
                                    bico__tinfo *info) {
  bico_ctx *ctx = r->ctx;
  size_t mi = rt->module;
  bico__modstate *s = &r->mods[mi];
  int do_in = rt->need[0], do_out = rt->need[1];
  size_t dout_b, din_b, dout_a, din_a;
  bico_model_module_dims(r->mt, mi, &dout_b, &din_b);
  bico_model_module_dims(r->ms, s->src, &dout_a, &din_a);
  if (p->vocab_rows) {
    /* An output head over the vocabulary (lm_head): its rows are tokens,
     * matched by string; only the input map applies. */
    dout_a = p->sh_a[0];
    do_out = 0;
  }
  if (dout_a * din_a != p->na)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "source tensor %s has %zu elements, not its module's "
                      "%zu x %zu",
                      info->source, p->na, dout_a, din_a);
  bico_status st = BICO_OK;
  if (do_in && (st = bico__xfer_need_side(r, mi, 0)) != BICO_OK) return st;
  if (do_out && (st = bico__xfer_need_side(r, mi, 1)) != BICO_OK) return st;
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
    st = bico_transport_weight(ctx, dout_a, din_a, dout_b, din_b, r->alpha, p->tau,
                               din_a, rout, dout_b, rin, din_b, 0.0f, upd,
                               din_b);
  } else {
    float **routs = bico__calloc(ctx, s->k, sizeof *routs);
    if (routs == NULL) return BICO_E_NOMEM;
    for (size_t b = 0; b < s->k; b++) routs[b] = do_out ? s->out[b].r : NULL;
    if (do_out) {
      info->split_maps = s->out;
      info->nsplit = s->k;
    }
    st = bico_transport_weight_split(
        ctx, s->k, dout_a, din_a, dout_b, din_b,
        r->alpha, p->tau, din_a,
        do_out ? routs : NULL, dout_b / s->k, rin, din_b, 0.0f, upd, din_b);
    bico__free(ctx, routs);
  }
  info->handling = bico__xfer_route_handling(rt);
  return st;
}

static bico_status bias_update(bico__run *r, const bico__route *rt,
                               const pairing *p, float *upd,
                               bico__tinfo *info) {
  bico_ctx *ctx = r->ctx;
  size_t mi = rt->module;
  bico__modstate *s = &r->mods[mi];
  int do_out = rt->need[1];
  bico_status st = BICO_OK;
  if (do_out && (st = bico__xfer_need_side(r, mi, 1)) != BICO_OK) return st;
  size_t k = s->k, ba = p->na / k, bb = p->nb / k;
  if (p->na % k || p->nb % k)
    return bico__fail(ctx, BICO_E_SHAPE, "bias %s does not split in %zu",
                      p->name, k);
  for (size_t b = 0; b < k && st == BICO_OK; b++)
    st = bico_transport_vector(ctx, ba, bb,
                               r->alpha, p->tau + b * ba, do_out ? s->out[b].r : NULL, bb,
                               0.0f, upd + b * bb);
  if (do_out && k == 1) {
    info->maps[1] = &s->out[0];
    info->map_names[1] = "out";
  } else if (do_out) {
    info->split_maps = s->out;
    info->nsplit = k;
  }
  info->handling = bico__xfer_route_handling(rt);
  return st;
}

/* out[j] = alpha sum_i r[i ld_r + j]^2 tau[i] for j < d_b: the diagonal
 * of R^T diag(tau) R for R [d_a, d_b] (a norm's scale under a
 * residual-stream map). */
static void transport_scale(size_t d_a, size_t d_b, const float *tau,
                            const float *r, size_t ld_r, float alpha,
                            float *out) {
  for (size_t j = 0; j < d_b; j++) out[j] = 0.0f;
  for (size_t i = 0; i < d_a; i++) {
    const float *ri = r + i * ld_r;
    float t = alpha * tau[i];
    for (size_t j = 0; j < d_b; j++) out[j] += ri[j] * ri[j] * t;
  }
}

/* A norm's vector or a token, row by row along its last dimension. */
static bico_status rows_update(bico__run *r, const bico__route *rt,
                               const pairing *p, float *upd,
                               bico__tinfo *info) {
  size_t owner = rt->module;
  int side = rt->side, identity = rt->identity;
  bico__modstate *s = &r->mods[owner];
  size_t da_last = p->nd_a ? p->sh_a[p->nd_a - 1] : 1;
  size_t db_last = p->ndim ? p->shape[p->ndim - 1] : 1;
  if (p->na / da_last != p->nb / db_last) {
    snprintf(info->reason, sizeof info->reason,
             "leading dimensions differ from the source's (%zu rows "
             "against %zu)",
             p->na / da_last, p->nb / db_last);
    return BICO_OK;
  }
  const bico__map *mp = NULL;
  if (!identity) {
    bico_status st = bico__xfer_need_side(r, owner, side);
    if (st != BICO_OK) return st;
    mp = side ? &s->out[0] : &s->in;
    if (mp->da != da_last || mp->db != db_last) {
      snprintf(info->reason, sizeof info->reason,
               "the map of module %s is %zu x %zu, the tensor's last "
               "dimensions are %zu (source) and %zu",
               bico__xfer_mname(r->mt, owner), mp->da, mp->db, da_last,
               db_last);
      return BICO_OK;
    }
    info->maps[0] = mp;
    info->map_names[0] = side ? "out" : "in";
  }
  info->handling = bico__xfer_route_handling(rt);
  if (rt->scale && mp != NULL && p->na == da_last) {
    transport_scale(da_last, db_last, p->tau, mp->r, db_last, r->alpha,
                          upd);
    return BICO_OK;
  }
  return bico_transport_rows(r->ctx, p->na / da_last, da_last, db_last,
                             r->alpha, p->tau, da_last, mp ? mp->r : NULL,
                             db_last, 0.0f, upd, db_last);
}

int bico__map_dead(size_t rank, const char *side, char *reason, size_t cap) {
  if (rank != 0) return 0;
  snprintf(reason, cap,
           "the statistic of its %s map is all zero (a dead layer)", side);
  return 1;
}

/* The dead-map rule (bico__map_dead) on every map the update used: the
 * tensor is left unchanged and the report says why. */
static void refuse_dead_maps(bico__tinfo *info) {
  int dead = 0;
  for (int m = 0; m < 2 && !dead; m++)
    if (info->maps[m] != NULL)
      dead = bico__map_dead(info->maps[m]->rank, info->map_names[m],
                            info->reason, sizeof info->reason);
  for (size_t b = 0; b < info->nsplit && !dead; b++)
    dead = bico__map_dead(info->split_maps[b].rank, "out", info->reason,
                          sizeof info->reason);
  if (dead) info->handling = BICO__H_UNCHANGED;
}

bico_status bico__xfer_carry(bico__run *r, size_t ti, size_t si,
                             const bico__route *rt, float **tau, float *upd,
                             bico__tinfo *info) {
  pairing p;
  memset(&p, 0, sizeof p);
  bico_model_tensor(r->mt, ti, &p.name, NULL, &p.ndim, &p.shape);
  bico_model_tensor(r->ms, si, NULL, NULL, &p.nd_a, &p.sh_a);
  p.na = bico__xfer_numel(p.nd_a, p.sh_a);
  p.nb = bico__xfer_numel(p.ndim, p.shape);
  p.tau = *tau;
  info->source = bico__xfer_tname(r->ms, si);
  bico_status st = BICO_OK;
  if (bico__xfer_token_rows(r, ti, si)) st = gather_vocab(r, &p, info);
  *tau = p.tau;
  if (st == BICO_OK && rt->kind == BICO__ROUTE_WEIGHT)
    st = weight_update(r, rt, &p, upd, info, ti, si);
  else if (st == BICO_OK && rt->kind == BICO__ROUTE_BIAS)
    st = bias_update(r, rt, &p, upd, info);
  else if (st == BICO_OK && rt->kind == BICO__ROUTE_ROWS)
    st = rows_update(r, rt, &p, upd, info);
  if (st == BICO_OK && info->handling != BICO__H_UNCHANGED)
    refuse_dead_maps(info);
  return st;
}

/* Computes the update (alpha tau_B) of target tensor ti into upd, or
 * leaves info->handling BICO__H_UNCHANGED with a reason. */
static bico_status bico_update(bico__run *r, size_t ti, float *upd,
                               bico__tinfo *info) {
  bico_ctx *ctx = r->ctx;
  bico__route rt;
  bico__xfer_route(r, ti, &rt);
  if (rt.kind == BICO__ROUTE_NONE) {
    snprintf(info->reason, sizeof info->reason, "%s", rt.reason);
    return BICO_OK;
  }
  size_t si;
  bico_status st = bico_model_pair_tensor(r->mt, ti, r->ms, &si);
  if (st == BICO_E_NOTFOUND) {
    snprintf(info->reason, sizeof info->reason,
             "the source has no paired tensor");
    bico__clear(ctx);
    return BICO_OK;
  }
  if (st != BICO_OK) return st;
  info->source = bico__xfer_tname(r->ms, si);
  size_t nd_a;
  const size_t *sh_a;
  bico_model_tensor(r->ms, si, NULL, NULL, &nd_a, &sh_a);
  size_t na = bico__xfer_numel(nd_a, sh_a);
  float *tau = bico__alloc(ctx, (na ? na : 1) * sizeof(float));
  if (tau == NULL) return BICO_E_NOMEM;
  st = read_tau(r, si, tau, na);
  if (st == BICO_OK) st = bico__xfer_carry(r, ti, si, &rt, &tau, upd, info);
  bico__free(ctx, tau);
  return st;
}

/* naive and gradfix need equal shapes (pad does not): the check before
 * anything is read. */
static bico_status check_shapes(bico__run *r, size_t ti, size_t si) {
  const char *name;
  size_t ndim, nd_a;
  const size_t *shape, *sh_a;
  bico_model_tensor(r->mt, ti, &name, NULL, &ndim, &shape);
  bico_model_tensor(r->ms, si, NULL, NULL, &nd_a, &sh_a);
  int same = nd_a == ndim &&
             (ndim == 0 || memcmp(sh_a, shape, ndim * sizeof *shape) == 0);
  if (same || r->method == BICO_METHOD_PAD) return BICO_OK;
  char a[128], b[128];
  shape_str(a, sizeof a, nd_a, sh_a);
  shape_str(b, sizeof b, ndim, shape);
  return bico__fail(r->ctx, BICO_E_SHAPE,
                    "%s transfer needs equal shapes: target tensor %s is %s, "
                    "source tensor %s is %s",
                    r->method == BICO_METHOD_NAIVE ? "naive" : "gradfix", name,
                    b, bico__xfer_tname(r->ms, si), a);
}

bico_status bico__xfer_elementwise(bico__run *r, size_t ti, size_t si,
                                   const float *tau, float *upd,
                                   bico__tinfo *info) {
  bico_ctx *ctx = r->ctx;
  const char *name;
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(r->mt, ti, &name, NULL, &ndim, &shape);
  size_t nd_a;
  const size_t *sh_a;
  bico_model_tensor(r->ms, si, NULL, NULL, &nd_a, &sh_a);
  info->source = bico__xfer_tname(r->ms, si);
  size_t na = bico__xfer_numel(nd_a, sh_a), nb = bico__xfer_numel(ndim, shape);
  bico_status st = check_shapes(r, ti, si);
  if (st == BICO_OK && na > 0 && r->method == BICO_METHOD_NAIVE) {
    st = bico_baseline_naive(ctx, nd_a, sh_a, ndim, shape, r->alpha, tau, 0.0f,
                             upd);
    info->handling = BICO__H_NAIVE;
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
      info->handling = BICO__H_PADDED;
    }
  } else if (st == BICO_OK && na > 0 && r->method == BICO_METHOD_GRADFIX) {
    bico_votes *votes = NULL;
    const bico_votes *use = bico__xfer_mem_votes(r->t, name);
    if (use != NULL) {
      size_t n = 0;
      unsigned fl = 0;
      bico_votes_info(use, &n, NULL, &fl);
      if (r->t->param[BICO_TRANSFER_GRADFIX_MODE] == BICO_GRADFIX_MEAN &&
          !(fl & BICO_VOTES_MEAN))
        st = bico__fail(ctx, BICO_E_STATE,
                        "target tensor %s: gradfix mode mean needs votes "
                        "made with BICO_VOTES_MEAN; the lent ones count "
                        "signs only",
                        name);
      else if (n != nb)
        st = bico__fail(ctx, BICO_E_SHAPE,
                        "target tensor %s has %zu elements, its lent votes "
                        "%zu",
                        name, nb, n);
    } else if (r->votes == NULL) {
      st = bico__fail(ctx, BICO_E_NOTFOUND,
                      "gradfix has no votes for target tensor %s (none lent, "
                      "no votes file)",
                      name);
    } else {
      st = bico__calib_votes(ctx, r->votes,
                             r->t->files[BICO_FILE_TARGET_VOTES], name, ndim,
                             shape, &votes);
      use = votes;
    }
    size_t kept = 0;
    if (st == BICO_OK) {
      st = bico_gradfix_apply(use, (int)r->t->param[BICO_TRANSFER_GRADFIX_MODE],
                              r->alpha, tau, 0.0f, upd, &kept);
      if (st != BICO_OK) st = bico__xfer_wrap(ctx, st, "tensor", name);
    }
    if (st == BICO_OK) {
      info->kept = nb ? (double)kept / (double)nb : 0.0;
      info->handling = BICO__H_MASKED;
    }
    bico_votes_free(votes);
  }
  return st;
}

/* naive, pad and gradfix: tensor by tensor. */
static bico_status elementwise_update(bico__run *r, size_t ti, float *upd,
                                      bico__tinfo *info) {
  bico_ctx *ctx = r->ctx;
  size_t si;
  bico_status pst = bico_model_pair_tensor(r->mt, ti, r->ms, &si);
  if (pst == BICO_E_NOTFOUND) {
    bico__clear(ctx);
    snprintf(info->reason, sizeof info->reason,
             "the source has no paired tensor");
    return BICO_OK;
  }
  if (pst != BICO_OK) return pst;
  info->source = bico__xfer_tname(r->ms, si);
  bico_status st = check_shapes(r, ti, si);
  if (st != BICO_OK) return st;
  size_t nd_a;
  const size_t *sh_a;
  bico_model_tensor(r->ms, si, NULL, NULL, &nd_a, &sh_a);
  size_t na = bico__xfer_numel(nd_a, sh_a);
  float *tau = bico__alloc(ctx, (na ? na : 1) * sizeof(float));
  if (tau == NULL) return BICO_E_NOMEM;
  st = read_tau(r, si, tau, na);
  if (st == BICO_OK) st = bico__xfer_elementwise(r, ti, si, tau, upd, info);
  bico__free(ctx, tau);
  return st;
}

bico_status bico__xfer_update(bico__run *r, size_t ti, float *upd,
                              bico__tinfo *info) {
  return bico__xfer_is_bico(r->method) ? bico_update(r, ti, upd, info)
                                       : elementwise_update(r, ti, upd, info);
}

/* ---- Row-wise tensors streamed ----
 *
 * A token table (the tied input embedding: 151936 x 1536 in a 1.5B Qwen2,
 * by far an LLM's largest tensor) is carried row by row: every row by
 * the same map, rows independent.  Held whole it would need its task
 * vector and update in float and the target's rows in double, about six
 * times the bf16 tensor; streamed in pieces of rows it needs one piece
 * (BICO_TRANSFER_ROW_CHUNK rows, by default about 64 MiB of work space),
 * read with the range readers and written with the range writers.  Rows
 * gathered by token string (lib/model/vocab.c) stream the same way. */

#define STREAM_BYTES ((size_t)64 << 20)

/* The source rows of target rows [j0, j0 + n): the same rows, or by
 * token string (zero rows for target tokens the source lacks). */
static bico_status stream_tau(bico__run *r, const tau_src *ts, int vocab,
                              size_t rows_a, size_t j0, size_t n, size_t da,
                              float *tau, bico__tinfo *info) {
  if (!vocab) return tau_read(r, ts, j0 * da, n * da, tau);
  memset(tau, 0, n * da * sizeof *tau);
  bico_status st = BICO_OK;
  for (size_t j = 0; j < n && st == BICO_OK;) {
    size_t s = src_row(r, j0 + j, rows_a);
    if (s == SIZE_MAX) {
      info->vocab_new++;
      j++;
      continue;
    }
    size_t run = 1; /* consecutive source rows: one read */
    while (j + run < n && src_row(r, j0 + j + run, rows_a) == s + run) run++;
    st = tau_read(r, ts, s * da, run * da, tau + j * da);
    info->vocab_shared += run;
    j += run;
  }
  return st;
}

typedef struct stream_plan {
  size_t si, da, db, rows_a, rows_b;
  int vocab, side, weight;
  const bico__map *mp; /* NULL: identity */
} stream_plan;

/* 1 when target tensor ti streams: a BiCo method's row route over a
 * table of rows (not a norm's single vector), or a vocabulary head (its
 * rows tokens, only its input map applies), every check the whole-tensor
 * path makes already passed, so a streamed tensor is always changed. */
static int stream_plan_of(bico__run *r, size_t ti, stream_plan *sp,
                          bico_status *st) {
  *st = BICO_OK;
  if (!bico__xfer_is_bico(r->method)) return 0;
  bico__route rt;
  bico__xfer_route(r, ti, &rt);
  sp->weight = rt.kind == BICO__ROUTE_WEIGHT;
  if (sp->weight) {
    /* a vocabulary head: rows by token, the input map on every row */
    if (!rt.tokens || r->mods[rt.module].k != 1) return 0;
    rt.identity = !rt.need[0];
    rt.side = 0;
  } else if (rt.kind != BICO__ROUTE_ROWS) {
    return 0;
  }
  const char *name;
  size_t ndim, nd_a;
  const size_t *shape, *sh_a;
  bico_model_tensor(r->mt, ti, &name, NULL, &ndim, &shape);
  if (ndim < 2 || bico__model_transposed(r->mt, ti)) return 0;
  if (bico_model_pair_tensor(r->mt, ti, r->ms, &sp->si) != BICO_OK) {
    bico__clear(r->ctx);
    return 0;
  }
  bico_model_tensor(r->ms, sp->si, NULL, NULL, &nd_a, &sh_a);
  if (nd_a < 2 || bico__model_transposed(r->ms, sp->si)) return 0;
  sp->da = sh_a[nd_a - 1];
  sp->db = shape[ndim - 1];
  sp->rows_a = bico__xfer_numel(nd_a, sh_a) / (sp->da ? sp->da : 1);
  sp->rows_b = bico__xfer_numel(ndim, shape) / (sp->db ? sp->db : 1);
  sp->vocab = bico__xfer_token_rows(r, ti, sp->si);
  if (sp->da == 0 || sp->db == 0 || (!sp->vocab && sp->rows_a != sp->rows_b))
    return 0;
  sp->mp = NULL;
  sp->side = rt.side;
  if (rt.identity) return sp->da == sp->db;
  *st = bico__xfer_need_side(r, rt.module, rt.side);
  if (*st != BICO_OK) return 0;
  bico__modstate *s = &r->mods[rt.module];
  sp->mp = rt.side ? &s->out[0] : &s->in;
  return sp->mp->da == sp->da && sp->mp->db == sp->db && sp->mp->rank > 0;
}

/* Target rows [j0, j0 + n): update, added to the target's rows, written. */
static bico_status stream_piece(bico__run *r, const bico__xfer_tensor *a,
                                const stream_plan *sp, const tau_src *ts,
                                size_t j0, size_t n, float *tau, float *upd,
                                double *base, double *ss, bico__tinfo *info) {
  bico_ctx *ctx = r->ctx;
  size_t m = n * sp->db, first = j0 * sp->db;
  bico_status st = stream_tau(r, ts, sp->vocab, sp->rows_a, j0, n, sp->da,
                              tau, info);
  if (st == BICO_OK)
    st = bico_transport_rows(ctx, n, sp->da, sp->db, r->alpha, tau, sp->da,
                             sp->mp ? sp->mp->r : NULL, sp->db, 0.0f, upd,
                             sp->db);
  for (size_t e = 0; e < m && st == BICO_OK; e++)
    if (!isfinite(upd[e]))
      st = bico__fail(ctx, BICO_E_NONFINITE,
                      "tensor %s: element %zu of the result is %g (does "
                      "alpha times the task vector overflow float32?); "
                      "nothing was written",
                      a->name, first + e, (double)upd[e]);
  if (st == BICO_OK) st = bico_stfile_read_f64_range(r->tb, a->fi, first, base,
                                                     m);
  for (size_t e = 0; e < m && st == BICO_OK; e++) {
    *ss += (double)upd[e] * (double)upd[e];
    base[e] += (double)upd[e];
  }
  if (st == BICO_OK)
    st = bico_stwriter_write_f64_range(r->w, a->name, first, base, m);
  if (st == BICO_OK && r->wd)
    st = bico_stwriter_write_f32_range(r->wd, a->name, first, upd, m);
  return st;
}

bico_status bico__xfer_stream_rows(bico__run *r, size_t ti,
                                   const bico__xfer_tensor *a,
                                   bico__tinfo *info, int *streamed) {
  bico_ctx *ctx = r->ctx;
  stream_plan sp;
  bico_status st;
  *streamed = stream_plan_of(r, ti, &sp, &st);
  if (!*streamed) return st;
  tau_src ts;
  st = tau_open(r, sp.si, &ts);
  if (st == BICO_OK) st = bico_stfile_check_finite(r->tb, a->fi);
  if (st != BICO_OK) return st;
  size_t chunk = (size_t)r->t->param[BICO_TRANSFER_ROW_CHUNK];
  if (chunk == 0)
    chunk = STREAM_BYTES / (4 * sp.da + 12 * sp.db);
  if (chunk == 0) chunk = 1;
  if (chunk > sp.rows_b) chunk = sp.rows_b;
  float *tau = bico__alloc(ctx, chunk * sp.da * sizeof *tau);
  float *upd = bico__alloc(ctx, chunk * sp.db * sizeof *upd);
  double *base = bico__alloc(ctx, chunk * sp.db * sizeof *base);
  if (tau == NULL || upd == NULL || base == NULL) st = BICO_E_NOMEM;
  double ss = 0;
  for (size_t j0 = 0; j0 < sp.rows_b && st == BICO_OK; j0 += chunk) {
    size_t n = sp.rows_b - j0 < chunk ? sp.rows_b - j0 : chunk;
    st = stream_piece(r, a, &sp, &ts, j0, n, tau, upd, base, &ss, info);
  }
  bico__free(ctx, tau);
  bico__free(ctx, upd);
  bico__free(ctx, base);
  if (st != BICO_OK) return st;
  int role = BICO_ROLE_OTHER;
  bico_model_tensor_module(r->mt, ti, NULL, &role);
  info->source = bico__xfer_tname(r->ms, sp.si);
  bico__route hr;
  memset(&hr, 0, sizeof hr);
  hr.kind = sp.weight ? BICO__ROUTE_WEIGHT : BICO__ROUTE_ROWS;
  hr.role = role;
  info->handling = bico__xfer_route_handling(&hr);
  info->vocab = sp.vocab;
  if (sp.mp) {
    info->maps[0] = sp.mp;
    info->map_names[0] = sp.side ? "out" : "in";
  }
  info->norm = sqrt(ss);
  return BICO_OK;
}
