/* Whole-model transfer of a LoRA adapter: the branch of bico_transfer_run
 * taken when a source adapter is set.  It sits below the driver
 * (transfer.c) and uses the steps every route uses: the maps (solved on
 * demand), the route of each target tensor and the one step that carries a
 * tensor by it (bico__xfer_carry); what it owns is the factor work.
 *
 * Per target module whose paired source module carries an adapter:
 *   bico, bico-in, bico-out   factored: B' = alpha R_out^T B, A' = A R_in
 *                             (block-wise for split outputs), no dense
 *                             d_out x d_in matrix;
 *   naive                     the factors as they are (shapes must match);
 *   pad, gradfix              dense update, the method, then the best
 *                             rank-r factors (truncated SVD; the report
 *                             gives the energy kept).
 * modules_to_save tensors are full weights: their task vector (saved minus
 * the source base) is carried like any tensor of bico_transfer and added to
 * the target base.
 *
 * The words are the checkpoint path's: a module or saved tensor reports
 * the handling its target tensor gets there (bico_transfer_handling_name:
 * linear or tied for factors carried by the maps, naive, padded, masked;
 * unchanged on a dead layer), a rank truncation adds "energy_kept"; the
 * merged checkpoint is written by the checkpoint path's writer
 * (bico__xfer_declare, bico__xfer_write_one: the target's metadata and
 * provenance, theta_B + update summed in double and rounded once). */
#define _DEFAULT_SOURCE 1 /* realpath */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "family.h"
#include "lora_internal.h"
#include "report.h"
#include "transfer_internal.h"

typedef struct lrun {
  bico__run *x; /* the driver's run: models, files, maps, options */
  bico_ctx *ctx;
  bico_lora *src, *out;
  bico__report rep;
  /* modules and saved tensors by handling (unchanged: a dead layer) */
  size_t count[BICO__H_COUNT];
  size_t truncated; /* modules whose update was truncated to its rank */
  float **supd;     /* per output saved tensor: its update for the merged
                       checkpoint (NULL: left unchanged) */
  size_t nsupd;
} lrun;

/* The path the handle's option `which` (a BICO_FILE_*) names, or NULL. */
static const char *file(const lrun *r, int which) {
  return r->x->t->files[which];
}

/* Map `block` of target module mi on `side` (0: input, one block; 1:
 * output, k blocks), solved on first use (bico__xfer_need_side); *rm is
 * da x db row-major; *thin 1 when it was solved from the rows. */
static bico_status map_of(bico__run *x, size_t mi, int side, size_t block,
                          float **rm, size_t *da, size_t *db,
                          size_t *rank, int *thin) {
  bico__modstate *s = &x->mods[mi];
  if (s->src == BICO__NONE)
    return bico__fail(x->ctx, BICO_E_NOTFOUND,
                      "module %s has no partner in the source",
                      bico__xfer_mname(x->mt, mi));
  bico_status st = bico__xfer_need_side(x, mi, side);
  if (st != BICO_OK) return st;
  const bico__map *m = side ? &s->out[block] : &s->in;
  *rm = m->r;
  *da = m->da;
  *db = m->db;
  *rank = m->rank;
  *thin = m->thin;
  return BICO_OK;
}

/* naive, pad or gradfix on a dense update tau (source tensor si's shape)
 * into upd (target tensor ti's shape), scaled by alpha: the checkpoint
 * path's own step (bico__xfer_elementwise); *kept gets GradFix's kept
 * fraction (or -1). */
static bico_status dense_method(lrun *r, size_t ti, size_t si,
                                const float *tau, float *upd, double *kept,
                                int *handling) {
  bico__tinfo info;
  memset(&info, 0, sizeof info);
  info.handling = BICO__H_UNCHANGED;
  info.kept = -1;
  bico_status st = bico__xfer_elementwise(r->x, ti, si, tau, upd, &info);
  *kept = info.kept;
  *handling = info.handling;
  return st;
}

/* A map's rank, route and shape, under `key` (NULL: as an array
 * element), as a checkpoint run's report has them. */
static void report_map(lrun *r, const char *key, size_t da, size_t db,
                       size_t rank, int thin) {
  if (key) bico__report_key(&r->rep, key);
  bico__report_begin_object(&r->rep);
  bico__report_key_number(&r->rep, "rank", (double)rank);
  bico__report_key_string(&r->rep, "solve", thin ? "thin" : "full");
  bico__report_key(&r->rep, "shape");
  bico__report_begin_array(&r->rep);
  bico__report_number(&r->rep, (double)da);
  bico__report_number(&r->rep, (double)db);
  bico__report_end_array(&r->rep);
  bico__report_end_object(&r->rep);
}

/* One adapter module on its way to a target module. */
typedef struct lmod {
  size_t li, mi, ti;   /* adapter module, target module, target weight */
  const char *lname, *tm;
  int kind, tkind, fifo, flip;
  size_t rank, dout_a, din_a, dout_b, din_b;
  double lalpha, scale;
  const float *b, *a;  /* source factors */
  size_t nd_s;         /* the source base weight's shape */
  const size_t *sh_s;
  size_t er_t, ec_t;   /* the target weight's shape */
  char *wname, *sname; /* target and source weight names */
  float *nb, *na;      /* the new factors */
  int handling;        /* bico_transfer_handling */
  double energy, kept;
  size_t k;            /* output split */
  size_t ts;           /* the source base weight's tensor index */
  char reason[192];    /* why it is left unchanged (a dead map) */
} lmod;

/* The dead-map rule (bico__map_dead) on a map m's carry uses: the first
 * dead one names the reason, and m is then left unchanged. */
static void lmod_dead(lmod *m, size_t rank, const char *side) {
  if (m->reason[0] == 0)
    bico__map_dead(rank, side, m->reason, sizeof m->reason);
}

/* Names, shapes and factors of adapter module li and target module mi. */
static bico_status lmod_locate(lrun *r, lmod *m) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  bico_lora_module(r->src, m->li, &m->lname, &m->kind, &m->rank, &m->dout_a,
                   &m->din_a, &m->lalpha, &m->scale);
  bico_model_module(x->mt, m->mi, &m->tm, &m->tkind, NULL, NULL);
  bico_lora_factors(r->src, m->li, &m->b, &m->a);
  double fifo = 0;
  bico_lora_get_param(r->src, BICO_LORA_FAN_IN_FAN_OUT, &fifo);
  m->fifo = fifo != 0;
  bico__clear(ctx);
  m->flip = m->kind == BICO_LORA_EMBEDDING || m->fifo;
  /* The target tensor the adapter updates: <module>.weight. */
  size_t tl = strlen(m->tm) + 8, sl = strlen(m->lname) + 8, ts;
  m->wname = bico__alloc(ctx, tl);
  m->sname = bico__alloc(ctx, sl);
  if (m->wname == NULL || m->sname == NULL) return BICO_E_NOMEM;
  snprintf(m->wname, tl, "%s.weight", m->tm);
  snprintf(m->sname, sl, "%s.weight", m->lname);
  bico_status st = bico_model_find_tensor(x->mt, m->wname, &m->ti);
  if (st == BICO_OK) st = bico_model_find_tensor(x->ms, m->sname, &ts);
  if (st != BICO_OK) return st;
  m->ts = ts;
  size_t nd_t;
  const size_t *sh_t;
  bico_model_tensor(x->mt, m->ti, NULL, NULL, &nd_t, &sh_t);
  bico_model_tensor(x->ms, ts, NULL, NULL, &m->nd_s, &m->sh_s);
  /* The adapter's update in the weight's layout. */
  size_t er = m->flip ? m->din_a : m->dout_a;
  size_t ec = m->flip ? m->dout_a : m->din_a;
  if (m->nd_s != 2 || nd_t != 2 || m->sh_s[0] != er || m->sh_s[1] != ec)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "adapter module %s: its update is [%zu, %zu] but the "
                      "source base's %s is not 2-D of that shape",
                      m->lname, er, ec, m->sname);
  m->er_t = sh_t[0];
  m->ec_t = sh_t[1];
  m->dout_b = m->flip ? m->ec_t : m->er_t;
  m->din_b = m->flip ? m->er_t : m->ec_t;
  size_t nfb = m->dout_b * m->rank, nfa = m->rank * m->din_b;
  m->nb = bico__alloc(ctx, (nfb ? nfb : 1) * sizeof(float));
  m->na = bico__alloc(ctx, (nfa ? nfa : 1) * sizeof(float));
  if (m->nb == NULL || m->na == NULL) return BICO_E_NOMEM;
  return BICO_OK;
}

/* BiCo on a linear adapter: B' = alpha R_out^T B, A' = A R_in (block-wise
 * for a split output), the sides as the target weight's route asks. */
static bico_status carry_linear(lrun *r, lmod *m, const bico__route *rt) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  if (m->tkind != BICO_MODULE_LINEAR || rt->kind != BICO__ROUTE_WEIGHT)
    return bico__fail(ctx, BICO_E_ARG,
                      "adapter module %s: target module %s is not linear",
                      m->lname, m->tm);
  if (rt->vocab)
    return bico__fail(ctx, BICO_E_UNSUPPORTED,
                      "adapter module %s: the tokenizers differ, and an "
                      "adapter on the vocabulary head (%s) is not matched by "
                      "token string; carry it as a full checkpoint",
                      m->lname, m->tm);
  if (rt->tokens && m->dout_a != m->dout_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "adapter module %s: the vocabularies differ (%zu source "
                      "rows, %zu target rows of %s)",
                      m->lname, m->dout_a, m->dout_b, m->tm);
  int do_in = rt->need[0], do_out = rt->need[1];
  m->k = x->mods[m->mi].k;
  float *rin = NULL;
  size_t da, db, mr;
  int thin = 0;
  float **routs = bico__calloc(ctx, m->k, sizeof *routs);
  if (routs == NULL) return BICO_E_NOMEM;
  bico_status st = BICO_OK;
  if (do_in) {
    st = map_of(x, m->mi, 0, 0, &rin, &da, &db, &mr, &thin);
    if (st == BICO_OK) {
      report_map(r, "in", da, db, mr, thin);
      lmod_dead(m, mr, "in");
    }
  }
  if (do_out && m->k > 1) {
    bico__report_key(&r->rep, "out_blocks");
    bico__report_begin_array(&r->rep);
  }
  for (size_t j = 0; j < m->k && st == BICO_OK && do_out; j++) {
    st = map_of(x, m->mi, 1, j, &routs[j], &da, &db, &mr, &thin);
    if (st == BICO_OK) {
      report_map(r, m->k == 1 ? "out" : NULL, da, db, mr, thin);
      lmod_dead(m, mr, "out");
    }
  }
  if (do_out && m->k > 1) bico__report_end_array(&r->rep);
  m->handling = m->reason[0] ? BICO__H_UNCHANGED : bico__xfer_route_handling(rt);
  if (st == BICO_OK && !m->reason[0])
    st = bico_lora_transport(ctx, m->rank, m->k, m->dout_a, m->din_a, m->dout_b,
                             m->din_b, x->alpha, m->b, m->a,
                             do_out ? routs : NULL,
                             m->dout_b / m->k, rin, m->din_b, m->nb, m->na);
  bico__free(ctx, routs);
  return st;
}

/* BiCo on an embedding adapter: the table's last dimension (B's rows) by
 * the map the target table's route names; the vocabulary (A's columns)
 * stays. */
static bico_status carry_embedding(lrun *r, lmod *m, const bico__route *rt) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  float *rr = NULL;
  size_t da = m->dout_a, db = m->dout_b, mr = 0;
  int thin = 0;
  bico_status st = BICO_OK;
  if (m->din_a != m->din_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "adapter module %s: the vocabularies differ (%zu source "
                      "rows, %zu target rows of %s)",
                      m->lname, m->din_a, m->din_b, m->wname);
  if (rt->kind != BICO__ROUTE_ROWS)
    return bico__fail(ctx, BICO_E_NOTFOUND,
                      "adapter module %s: no map carries its embedding "
                      "adapter: target %s: %s",
                      m->lname, m->wname, rt->reason);
  if (!rt->identity) {
    st = map_of(x, rt->module, rt->side, 0, &rr, &da, &db, &mr, &thin);
    if (st == BICO_OK) {
      report_map(r, rt->side ? "out" : "in", da, db, mr, thin);
      lmod_dead(m, mr, rt->side ? "out" : "in");
    }
  }
  if (st == BICO_OK && (da != m->dout_a || db != m->dout_b))
    st = bico__fail(ctx, BICO_E_SHAPE,
                    "adapter module %s: the map is %zu x %zu but the "
                    "embedding widths are %zu and %zu",
                    m->lname, da, db, m->dout_a, m->dout_b);
  float *rl[1] = {rr};
  m->handling = m->reason[0] ? BICO__H_UNCHANGED : bico__xfer_route_handling(rt);
  if (st == BICO_OK && !m->reason[0])
    st = bico_lora_transport(ctx, m->rank, 1, m->dout_a, m->din_a, m->dout_b,
                             m->din_b, x->alpha, m->b, m->a, rr ? rl : NULL,
                             m->dout_b, NULL, m->din_b, m->nb, m->na);
  return st;
}

/* pad, gradfix: the dense update, the method, back to rank r. */
static bico_status carry_dense(lrun *r, lmod *m) {
  bico_ctx *ctx = r->ctx;
  size_t ns = m->dout_a * m->din_a, nt = m->dout_b * m->din_b;
  float *dense = bico__alloc(ctx, (ns ? ns : 1) * sizeof(float));
  float *upd = bico__alloc(ctx, (nt ? nt : 1) * sizeof(float));
  float *tmp = bico__alloc(ctx, (ns > nt ? ns : nt ? nt : 1) * sizeof(float));
  bico_status st = BICO_OK;
  if (dense == NULL || upd == NULL || tmp == NULL) st = BICO_E_NOMEM;
  if (st == BICO_OK)
    st = bico_lora_dense(r->src, m->li, 1.0f, 0.0f, tmp, m->din_a);
  if (st == BICO_OK) {
    if (m->flip) bico__xfer_transpose(tmp, m->dout_a, m->din_a, dense);
    else memcpy(dense, tmp, ns * sizeof(float));
    st = dense_method(r, m->ti, m->ts, dense, upd, &m->kept, &m->handling);
  }
  if (st == BICO_OK) {
    const float *fo = upd;
    if (m->flip) {
      bico__xfer_transpose(upd, m->er_t, m->ec_t, tmp);
      fo = tmp;
    }
    st = bico_lora_truncate(ctx, m->dout_b, m->din_b, m->rank, m->scale, fo,
                            m->din_b, m->nb, m->na, &m->energy);
  }
  bico__free(ctx, tmp);
  bico__free(ctx, dense);
  bico__free(ctx, upd);
  return st;
}

/* The new factors of m by the run's method. */
static bico_status carry(lrun *r, lmod *m) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  /* fan_in_fan_out: the base weights are stored [in, out]; the maps are
   * right when the models' family says so too (GPT-2's Conv1D: module
   * dims are then [out, in] as the factors are). */
  if (bico__xfer_is_bico(x->method) && m->fifo &&
      !(bico__model_transposed(x->mt, m->ti) &&
        bico__model_transposed(x->ms, m->ts)))
    return bico__fail(ctx, BICO_E_UNSUPPORTED,
                      "adapter module %s: fan_in_fan_out adapters (transposed "
                      "base weights) are carried by the BiCo methods only on "
                      "a family known to store [in, out] weights (GPT-2 "
                      "Conv1D); %s is not one",
                      m->lname, m->wname);
  if (bico__xfer_is_bico(x->method)) {
    bico__route rt;
    bico__xfer_route(x, m->ti, &rt);
    return m->kind == BICO_LORA_LINEAR ? carry_linear(r, m, &rt)
                                       : carry_embedding(r, m, &rt);
  }
  if (x->method == BICO_METHOD_NAIVE) {
    if (m->dout_a != m->dout_b || m->din_a != m->din_b)
      return bico__fail(ctx, BICO_E_SHAPE,
                        "naive transfer needs equal shapes: adapter module %s "
                        "updates [%zu, %zu], target %s is [%zu, %zu]",
                        m->lname, m->sh_s[0], m->sh_s[1], m->wname, m->er_t,
                        m->ec_t);
    for (size_t e = 0; e < m->dout_b * m->rank; e++)
      m->nb[e] = x->alpha * m->b[e];
    memcpy(m->na, m->a, m->rank * m->din_b * sizeof(float));
    m->handling = BICO__H_NAIVE;
    return BICO_OK;
  }
  return carry_dense(r, m);
}

/* Carries adapter module li to target module mi (paired with li's source
 * module), with its report entry. */
static bico_status do_module(lrun *r, size_t li, size_t mi) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  lmod m;
  memset(&m, 0, sizeof m);
  m.li = li;
  m.mi = mi;
  m.handling = BICO__H_UNCHANGED;
  m.energy = m.kept = -1;
  m.k = 1;
  bico_status st = lmod_locate(r, &m);
  if (st == BICO_OK) {
    bico__report_begin_object(&r->rep);
    bico__report_key_string(&r->rep, "name", m.tm);
    bico__report_key_string(&r->rep, "source", m.lname);
    bico__report_key_string(&r->rep, "kind", m.kind == BICO_LORA_LINEAR
                                                 ? "linear"
                                                 : "embedding");
    bico__report_key_number(&r->rep, "rank", (double)m.rank);
    bico__report_key(&r->rep, "maps");
    bico__report_begin_object(&r->rep);
    st = carry(r, &m);
    bico__report_end_object(&r->rep);
    bico__report_key_string(&r->rep, "handling",
                            bico_transfer_handling_name(m.handling));
    if (m.reason[0]) bico__report_key_string(&r->rep, "reason", m.reason);
    if (m.energy >= 0)
      bico__report_key_number(&r->rep, "energy_kept", m.energy);
    if (m.kept >= 0) bico__report_key_number(&r->rep, "kept_fraction", m.kept);
    bico__report_end_object(&r->rep);
  }
  /* A module on a dead layer stays out of the output adapter: the target
   * weight is left unchanged, as the checkpoint path leaves it. */
  int dead = st == BICO_OK && m.reason[0] != 0;
  if (st == BICO_OK && !dead)
    st = bico__xfer_check_finite(ctx, m.nb, m.dout_b * m.rank,
                                 "adapter module", m.tm);
  if (st == BICO_OK && !dead)
    st = bico__xfer_check_finite(ctx, m.na, m.rank * m.din_b,
                                 "adapter module", m.tm);
  if (st == BICO_OK && !dead)
    st = bico_lora_add_module(r->out, m.tm, m.kind, m.rank, m.dout_b, m.din_b,
                              m.lalpha, m.nb, m.na);
  if (st == BICO_OK) {
    r->count[dead ? BICO__H_UNCHANGED : m.handling]++;
    if (dead) {
      bico__xfer_log(r->x, "bico: %s <- %s: left unchanged: %s", m.tm,
                     m.lname, m.reason);
    } else if (m.energy >= 0) {
      r->truncated++;
      bico__xfer_log(r->x, "bico: %s <- %s: %s, truncated to rank %zu, "
                           "%.4f of the energy kept",
                     m.tm, m.lname, bico_transfer_handling_name(m.handling),
                     m.rank, m.energy);
    }
  }
  bico__xfer_free_maps(x, &x->mods[mi]);
  bico__free(ctx, m.nb);
  bico__free(ctx, m.na);
  bico__free(ctx, m.wname);
  bico__free(ctx, m.sname);
  if (st != BICO_OK && m.lname != NULL &&
      strstr(bico_ctx_errmsg(ctx), m.lname) == NULL)
    st = bico__fail(ctx, st, "adapter module %s: %s", m.lname,
                    bico_ctx_errmsg(ctx)[0] ? bico_ctx_errmsg(ctx)
                                            : bico_strerror(st));
  return st;
}

/* A saved tensor's update by the maps its target tensor's route names:
 * the checkpoint path's own step (bico__xfer_carry), so that a saved tensor is
 * carried, or left unchanged (reason[cap]: a dead map, shapes the map
 * does not fit), exactly as the same tensor of a checkpoint would be.  A
 * target tensor no route carries fails: the adapter's saved tensor would
 * be lost. */
static bico_status saved_bico(lrun *r, size_t ti, size_t si, const char *sname,
                              const char *tname, float **tau, float *upd,
                              size_t nb, char *reason, size_t cap,
                              int *handling) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  bico__route rt;
  bico__xfer_route(x, ti, &rt);
  if (rt.kind == BICO__ROUTE_NONE)
    return rt.role == BICO_ROLE_OTHER
               ? bico__fail(ctx, BICO_E_UNSUPPORTED,
                            "saved tensor %s: target tensor %s is of a kind "
                            "no method carries",
                            sname, tname)
               : bico__fail(ctx, BICO_E_NOTFOUND,
                            "saved tensor %s: no map carries target tensor "
                            "%s: %s",
                            sname, tname, rt.reason);
  bico__tinfo info;
  memset(&info, 0, sizeof info);
  info.handling = BICO__H_UNCHANGED;
  info.kept = -1;
  bico_status st = bico__xfer_carry(x, ti, si, &rt, tau, upd, &info);
  *handling = info.handling;
  reason[0] = 0;
  if (st == BICO_OK && info.handling == BICO__H_UNCHANGED)
    snprintf(reason, cap, "%s", info.reason[0] ? info.reason : "no map");
  if (st == BICO_OK && reason[0]) memset(upd, 0, nb * sizeof *upd);
  return st;
}

/* A modules_to_save tensor (source saved index k) -> target tensor ti. */
static bico_status do_saved(lrun *r, size_t k, size_t ti) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  const char *sname, *tname, *tmod;
  size_t nd_a, nd_b, mi;
  const size_t *sa, *sb;
  const float *data;
  int role, dtype;
  bico_lora_saved(r->src, k, &sname, NULL, &nd_a, &sa, &data);
  bico_model_tensor(x->mt, ti, &tname, &dtype, &nd_b, &sb);
  bico_model_tensor_module(x->mt, ti, &mi, &role);
  bico_model_module(x->mt, mi, &tmod, NULL, NULL, NULL);
  size_t na = 1, nb = 1;
  for (size_t d = 0; d < nd_a; d++) na *= sa[d];
  for (size_t d = 0; d < nd_b; d++) nb *= sb[d];
  size_t bi, fi;
  bico_status st = bico_stfile_find(x->sb, sname, &bi);
  size_t nd_base;
  const size_t *sh_base;
  if (st == BICO_OK)
    st = bico_stfile_tensor_info(x->sb, bi, NULL, NULL, &nd_base, &sh_base);
  if (st == BICO_OK &&
      (nd_base != nd_a || memcmp(sh_base, sa, nd_a * sizeof *sa) != 0)) {
    char a[128], b[128];
    st = bico__fail(ctx, BICO_E_SHAPE,
                    "saved tensor %s is %s, but %s in the source base",
                    sname, bico__shape_text(a, sizeof a, nd_a, sa),
                    bico__shape_text(b, sizeof b, nd_base, sh_base));
  }
  float *tau = st == BICO_OK ? bico__alloc(ctx, (na ? na : 1) * sizeof(float)) : NULL;
  float *upd = st == BICO_OK ? bico__calloc(ctx, nb ? nb : 1, sizeof(float)) : NULL;
  float *full = st == BICO_OK ? bico__alloc(ctx, (nb ? nb : 1) * sizeof(float)) : NULL;
  if (st == BICO_OK && (tau == NULL || upd == NULL || full == NULL))
    st = BICO_E_NOMEM;
  if (st == BICO_OK && na) st = bico_stfile_read_f32(x->sb, bi, tau, na);
  if (st == BICO_OK) st = bico_stfile_check_finite(x->sb, bi);
  for (size_t e = 0; e < na && st == BICO_OK; e++) tau[e] = data[e] - tau[e];
  double kept = -1;
  char reason[sizeof ((bico__tinfo *)0)->reason] = "";
  int handling = BICO__H_UNCHANGED;
  size_t si;
  if (st == BICO_OK && na && nb) {
    st = bico_model_find_tensor(x->ms, sname, &si);
    if (st == BICO_OK && !bico__xfer_is_bico(x->method))
      st = dense_method(r, ti, si, tau, upd, &kept, &handling);
    else if (st == BICO_OK)
      st = saved_bico(r, ti, si, sname, tname, &tau, upd, nb, reason,
                      sizeof reason, &handling);
  }
  if (st == BICO_OK && handling == BICO__H_UNCHANGED && !reason[0])
    snprintf(reason, sizeof reason, "%s", nb ? "no update" : "empty tensor");
  if (st == BICO_OK) st = bico_stfile_find(x->tb, tname, &fi);
  if (st == BICO_OK && nb) st = bico_stfile_read_f32(x->tb, fi, full, nb);
  if (st == BICO_OK) st = bico_stfile_check_finite(x->tb, fi);
  for (size_t e = 0; e < nb && st == BICO_OK; e++) full[e] += upd[e];
  if (st == BICO_OK)
    st = bico__xfer_check_finite(ctx, full, nb, "saved tensor", tname);
  if (st == BICO_OK)
    st = bico__xfer_check_finite(ctx, upd, nb, "saved tensor", tname);
  if (st == BICO_OK)
    st = bico_lora_add_saved(r->out, tname, tmod, nd_b, sb, full);
  if (reason[0]) handling = BICO__H_UNCHANGED;
  bico__report_begin_object(&r->rep);
  bico__report_key_string(&r->rep, "name", tname);
  bico__report_key_string(&r->rep, "source", sname);
  bico__report_key_string(&r->rep, "handling",
                          bico_transfer_handling_name(handling));
  if (reason[0]) bico__report_key_string(&r->rep, "reason", reason);
  if (kept >= 0) bico__report_key_number(&r->rep, "kept_fraction", kept);
  bico__report_end_object(&r->rep);
  if (st == BICO_OK) {
    r->count[handling]++;
    if (reason[0])
      bico__xfer_log(r->x, "bico: saved tensor %s <- %s: left unchanged: %s",
                     tname, sname, reason);
    /* The merged checkpoint takes the update, not the float sum the
     * adapter stores: theta_B + update is summed by the one writer. */
    size_t k = bico__lora_nsaved(r->out) - 1;
    if (k < r->nsupd && handling != BICO__H_UNCHANGED) {
      r->supd[k] = upd;
      upd = NULL;
    }
  }
  bico__free(ctx, tau);
  bico__free(ctx, upd);
  bico__free(ctx, full);
  if (st != BICO_OK && strstr(bico_ctx_errmsg(ctx), sname) == NULL)
    st = bico__fail(ctx, st, "saved tensor %s: %s", sname,
                    bico_ctx_errmsg(ctx)[0] ? bico_ctx_errmsg(ctx)
                                            : bico_strerror(st));
  return st;
}

/* The update of target tensor `name` (numel floats, the weight's layout)
 * into *upd, or *upd NULL when nothing changes it: s B' A' where an
 * adapter module landed, the carried task vector of a saved tensor. */
static bico_status merged_update(lrun *r, const char *name, size_t numel,
                                 float **upd) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  *upd = NULL;
  for (size_t k = 0; k < bico__lora_nsaved(r->out); k++) {
    const char *sn;
    bico_lora_saved(r->out, k, &sn, NULL, NULL, NULL, NULL);
    if (strcmp(sn, name) != 0) continue;
    if (k >= r->nsupd || r->supd[k] == NULL) return BICO_OK;
    *upd = r->supd[k];
    r->supd[k] = NULL;
    return BICO_OK;
  }
  size_t ti, mi, li;
  const char *mod;
  if (bico_model_find_tensor(x->mt, name, &ti) != BICO_OK) {
    bico__clear(ctx);
    return BICO_OK;
  }
  bico_model_tensor_module(x->mt, ti, &mi, NULL);
  bico_model_module(x->mt, mi, &mod, NULL, NULL, NULL);
  size_t ml = strlen(mod);
  if (strncmp(name, mod, ml) != 0 ||
      strcmp(name + ml, ml ? ".weight" : "weight") != 0 ||
      bico_lora_find_module(r->out, mod, &li) != BICO_OK) {
    bico__clear(ctx);
    return BICO_OK;
  }
  int kind;
  size_t dout, din;
  double fifo = 0;
  bico_lora_get_param(r->out, BICO_LORA_FAN_IN_FAN_OUT, &fifo);
  bico_lora_module(r->out, li, NULL, &kind, NULL, &dout, &din, NULL, NULL);
  if (dout * din != numel)
    return bico__fail(ctx, BICO_E_INTERNAL,
                      "tensor %s: the adapter module's update has %zu "
                      "elements, the tensor %zu",
                      name, dout * din, numel);
  int flip = kind == BICO_LORA_EMBEDDING || fifo != 0;
  float *d = bico__alloc(ctx, (numel ? numel : 1) * sizeof(float));
  float *u = flip ? bico__alloc(ctx, (numel ? numel : 1) * sizeof(float)) : d;
  bico_status st = d == NULL || u == NULL ? BICO_E_NOMEM : BICO_OK;
  if (st == BICO_OK) st = bico_lora_dense(r->out, li, 1.0f, 0.0f, d, din);
  if (st == BICO_OK && flip) bico__xfer_transpose(d, dout, din, u);
  if (flip) bico__free(ctx, d);
  if (st == BICO_OK) st = bico__xfer_check_finite(ctx, u, numel, "tensor", name);
  if (st != BICO_OK) {
    bico__free(ctx, u);
    return st;
  }
  *upd = u;
  return BICO_OK;
}

/* The full target checkpoint by the checkpoint path's writer: every
 * tensor of the target base declared in its order with the target's
 * metadata and the run's provenance, theta_B + update where an adapter
 * module or a saved tensor changed it, the base's bytes elsewhere. */
static bico_status write_checkpoint(lrun *r, bico_stwriter **w) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  bico_stwriter *wd = NULL; /* no delta output on this route */
  bico_status st = bico__xfer_declare(x->t, x->tb, w, &wd);
  size_t nt = bico__stfile_ntensors(x->tb);
  for (size_t fi = 0; fi < nt && st == BICO_OK; fi++) {
    bico__xfer_tensor a;
    float *upd = NULL;
    double norm;
    st = bico__xfer_locate(ctx, x->tb, fi, &a);
    if (st == BICO_OK) st = merged_update(r, a.name, a.nb, &upd);
    if (st == BICO_OK)
      st = bico__xfer_write_one(ctx, x->tb, &a, *w, NULL, upd, &norm);
    bico__free(ctx, upd);
    if (st != BICO_OK && strstr(bico_ctx_errmsg(ctx), a.name) == NULL)
      st = bico__fail(ctx, st, "tensor %s: %s", a.name, bico_ctx_errmsg(ctx));
  }
  return st;
}

/* An adapter module or saved tensor the source base does not have means
 * the adapter belongs to another model: stop rather than drop it. */
static bico_status check_adapter_names(lrun *r, size_t nl, size_t ns) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  bico_status st = BICO_OK;
  for (size_t i = 0; i < nl + ns && st == BICO_OK; i++) {
    const char *n;
    size_t idx;
    if (i < nl) {
      bico_lora_module(r->src, i, &n, NULL, NULL, NULL, NULL, NULL, NULL);
      if (bico_model_find_module(x->ms, n, &idx) != BICO_OK)
        st = bico__fail(ctx, BICO_E_NOTFOUND,
                        "adapter %s: module %s is not a module of the source "
                        "base (is the adapter for another model?)",
                        file(r, BICO_FILE_LORA), n);
    } else {
      bico_lora_saved(r->src, i - nl, &n, NULL, NULL, NULL, NULL);
      if (bico_model_find_tensor(x->ms, n, &idx) != BICO_OK)
        st = bico__fail(ctx, BICO_E_NOTFOUND,
                        "adapter %s: saved tensor %s is not in the source base",
                        file(r, BICO_FILE_LORA), n);
    }
  }
  return st;
}

/* Outputs: every file complete in its temporary file first, then all
 * destinations checked and committed together (lib/io/commit.c); a failure
 * before leaves nothing new. */
static bico_status lora_commit(lrun *r, size_t unused) {
  bico_ctx *ctx = r->ctx;
  const char *report = file(r, BICO_FILE_REPORT);
  const char *ckpt = file(r, BICO_FILE_OUTPUT);
  const char *out_dir = file(r, BICO_FILE_LORA_OUTPUT);
  bico_status st = BICO_OK;
  bico__tmpfile rep = {.fd = -1}, *outs[3], **ck = NULL;
  size_t nout = 0, nck = 0;
  bico_stwriter *w = NULL;
  bico__lora_out lo;
  memset(&lo, 0, sizeof lo);
  if (report)
    st = bico__report_tmp(ctx, "transfer_run", "report", r->rep.buf,
                          r->rep.len, report, &rep);
  if (st == BICO_OK && ckpt) {
    /* a file or a model folder, sharded, by the checkpoint path's writer */
    st = write_checkpoint(r, &w);
    if (st == BICO_OK) st = bico__stwriter_finish_all(w, &ck, &nck);
  }
  if (st == BICO_OK && out_dir) {
    st = bico__lora_save_begin(r->out, "transfer_run", out_dir, &lo);
    if (st == BICO_OK) outs[nout++] = &lo.st.t; /* the folder, whole */
  }
  if (st == BICO_OK && report) outs[nout++] = &rep;
  /* the files read a tensor at a time are still the files opened (the
   * bridge the maps came from the one whose digest was checked) */
  if (st == BICO_OK) st = bico__xfer_check_unchanged(r->x);
  st = bico__commit_lists(ctx, "transfer_run", st, ck, nck, outs, nout, NULL);
  if (st == BICO_OK) bico__stwriter_committed(w);
  bico__lora_save_end(&lo, st == BICO_OK);
  bico_stwriter_free(w);
  bico__tmp_discard(ctx, &rep);
  if (st == BICO_OK) {
    /* the counts by the one handling table, as a checkpoint run logs */
    char by[256] = "";
    size_t n = 0, updated = 0;
    for (int h = BICO__H_FIRST; h < BICO__H_COUNT; h++) {
      if (h == BICO__H_UNCHANGED || r->count[h] == 0) continue;
      updated += r->count[h];
      n += (size_t)snprintf(by + n, n < sizeof by ? sizeof by - n : 0,
                            "%s%s %zu", n ? ", " : "",
                            bico_transfer_handling_name(h), r->count[h]);
      if (n >= sizeof by) n = sizeof by - 1;
    }
    bico__xfer_log(r->x, "bico: %zu adapter modules and saved tensors "
                         "updated (%s), %zu truncated to their rank, %zu "
                         "unused, %zu left unchanged (dead layers); wrote "
                         "%s%s%s",
                   updated, by, r->truncated, unused,
                   r->count[BICO__H_UNCHANGED], out_dir ? out_dir : "",
                   out_dir && ckpt ? " and " : "", ckpt ? ckpt : "");
  }
  return st;
}

/* Progress after target module mi (one unit per module). */
static void module_progress(const lrun *r, size_t mi, bico_progress *pg,
                            const struct timespec *t0) {
  bico__run *x = r->x;
  if (x->t->progress == NULL) return;
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  pg->done = (double)(mi + 1);
  pg->tensors_done = mi + 1;
  pg->elapsed = (double)(now.tv_sec - t0->tv_sec) +
                1e-9 * (double)(now.tv_nsec - t0->tv_nsec);
  pg->tensor = NULL;
  bico_model_module(x->mt, mi, &pg->tensor, NULL, NULL, NULL);
  x->t->progress(x->t->progress_opaque, pg);
}

/* The source adapter opened, and the output adapter made with its
 * switches, task type and dropout, and the target as its base. */
static bico_status open_adapters(lrun *r) {
  bico_ctx *ctx = r->ctx;
  const char *ad = file(r, BICO_FILE_LORA);
  bico_status st = bico_lora_open(ctx, ad, &r->src);
  /* A message about the folder itself ("ad is a file, not an adapter
   * folder") names its slot; one about a file inside names that file. */
  const char *m = strstr(bico_ctx_errmsg(ctx), ": ");
  size_t n = strlen(ad);
  if (st != BICO_OK && m != NULL && strncmp(m + 2, ad, n) == 0 &&
      (m[2 + n] == ' ' || m[2 + n] == ':'))
    st = bico__xfer_wrap_file(ctx, st, BICO_FILE_LORA, ad);
  if (st == BICO_OK) st = bico_lora_create(ctx, &r->out);
  if (st != BICO_OK) return st;
  double on = 0;
  bico_lora_get_param(r->src, BICO_LORA_RSLORA, &on);
  bico_lora_set_param(r->out, BICO_LORA_RSLORA, on);
  bico_lora_get_param(r->src, BICO_LORA_FAN_IN_FAN_OUT, &on);
  bico_lora_set_param(r->out, BICO_LORA_FAN_IN_FAN_OUT, on);
  const char *tt = NULL;
  bico_lora_get_string(r->src, BICO_LORA_TASK_TYPE, &tt);
  st = bico_lora_set_string(r->out, BICO_LORA_TASK_TYPE, tt);
  /* The output adapter is for the target: its base_model_name_or_path is
   * the target base's absolute path (the same however the path was typed,
   * from whatever folder, or taken from a bridge), never the source's.  It
   * keeps the source's dropout. */
  char *real = realpath(file(r, BICO_FILE_TARGET_BASE), NULL);
  if (st == BICO_OK)
    st = bico_lora_set_string(r->out, BICO_LORA_BASE_MODEL,
                              real ? real : file(r, BICO_FILE_TARGET_BASE));
  free(real);
  bico__lora_set_dropout(r->out, bico__lora_dropout(r->src));
  return st;
}

static bico_status run_lora(lrun *r) {
  bico__run *x = r->x;
  bico_ctx *ctx = r->ctx;
  bico_status st = open_adapters(r);
  if (st != BICO_OK) return st;
  size_t nl = bico__lora_nmodules(r->src), ns = bico__lora_nsaved(r->src);
  if (st == BICO_OK) st = check_adapter_names(r, nl, ns);
  if (st != BICO_OK) return st;
  bico__clear(ctx);
  unsigned char *used = bico__calloc(ctx, nl + ns + 1, 1);
  if (used == NULL) return BICO_E_NOMEM;
  if (file(r, BICO_FILE_OUTPUT) != NULL && ns > 0) {
    r->supd = bico__calloc(ctx, ns, sizeof *r->supd);
    if (r->supd == NULL) {
      bico__free(ctx, used);
      return BICO_E_NOMEM;
    }
    r->nsupd = ns;
  }
  bico__xfer_log(x, "bico: adapter %s: %zu modules, %zu saved tensors; "
                    "method %s",
                 file(r, BICO_FILE_LORA), nl, ns, bico_transfer_method_name(x->method));
  bico__report_begin_object(&r->rep);
  bico__report_key_string(&r->rep, "method", bico_transfer_method_name(x->method));
  bico__report_key_number(&r->rep, "alpha", (double)x->alpha);
  bico__report_key_string(&r->rep, "adapter", file(r, BICO_FILE_LORA));
  bico__report_key(&r->rep, "modules");
  bico__report_begin_array(&r->rep);
  size_t nm = 0;
  st = bico_model_module_count(x->mt, &nm);
  bico_progress pg;
  memset(&pg, 0, sizeof pg);
  pg.size = sizeof pg;
  pg.total = (double)nm;
  pg.tensors_total = nm;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (size_t mi = 0; mi < nm && st == BICO_OK; mi++) {
    if (mi > 0) module_progress(r, mi - 1, &pg, &t0);
    size_t si, li;
    bico_status ps = bico_model_pair_module(x->mt, mi, x->ms, &si);
    if (ps == BICO_E_NOTFOUND) {
      bico__clear(ctx);
      continue;
    }
    if (ps != BICO_OK) {
      st = ps;
      break;
    }
    const char *sm;
    bico_model_module(x->ms, si, &sm, NULL, NULL, NULL);
    if (bico_lora_find_module(r->src, sm, &li) != BICO_OK) {
      bico__clear(ctx);
      continue;
    }
    used[li] = 1;
    st = do_module(r, li, mi);
  }
  if (st == BICO_OK && nm > 0) module_progress(r, nm - 1, &pg, &t0);
  bico__report_end_array(&r->rep);
  bico__report_key(&r->rep, "saved");
  bico__report_begin_array(&r->rep);
  size_t nt = bico__model_ntensors(x->mt);
  for (size_t ti = 0; ti < nt && st == BICO_OK && ns; ti++) {
    size_t si;
    bico_status ps = bico_model_pair_tensor(x->mt, ti, x->ms, &si);
    if (ps == BICO_E_NOTFOUND) {
      bico__clear(ctx);
      continue;
    }
    if (ps != BICO_OK) {
      st = ps;
      break;
    }
    const char *sn;
    bico_model_tensor(x->ms, si, &sn, NULL, NULL, NULL);
    for (size_t k = 0; k < ns && st == BICO_OK; k++) {
      const char *kn;
      bico_lora_saved(r->src, k, &kn, NULL, NULL, NULL, NULL);
      if (strcmp(kn, sn) != 0) continue;
      used[nl + k] = 1;
      st = do_saved(r, k, ti);
    }
  }
  bico__report_end_array(&r->rep);
  /* What the target has no place for is reported, never silently lost. */
  bico__report_key(&r->rep, "unused");
  bico__report_begin_array(&r->rep);
  size_t unused = 0;
  for (size_t i = 0; i < nl + ns && st == BICO_OK; i++) {
    if (used[i]) continue;
    const char *n;
    if (i < nl) bico_lora_module(r->src, i, &n, NULL, NULL, NULL, NULL, NULL, NULL);
    else bico_lora_saved(r->src, i - nl, &n, NULL, NULL, NULL, NULL);
    bico__report_string(&r->rep, n);
    bico__xfer_log(x, "bico: unused: adapter %s %s has no partner in the "
                      "target",
                   i < nl ? "module" : "saved tensor", n);
    unused++;
  }
  bico__report_end_array(&r->rep);
  bico__report_key(&r->rep, "summary");
  bico__report_begin_object(&r->rep);
  for (int h = BICO__H_FIRST; h < BICO__H_COUNT; h++)
    bico__report_key_number(&r->rep, bico_transfer_handling_name(h),
                            (double)r->count[h]);
  bico__report_key_number(&r->rep, "truncated", (double)r->truncated);
  bico__report_key_number(&r->rep, "unused", (double)unused);
  bico__report_end_object(&r->rep);
  bico__report_end_object(&r->rep);
  bico__free(ctx, used);
  if (st == BICO_OK) st = bico__report_status(&r->rep);
  if (st == BICO_OK && bico__lora_nmodules(r->out) == 0 &&
      r->count[BICO__H_UNCHANGED])
    st = bico__fail(ctx, BICO_E_NOTFOUND,
                    "adapter %s: every module it pairs with is on a dead "
                    "layer (its calibration statistic is all zero), so "
                    "nothing would be carried",
                    file(r, BICO_FILE_LORA));
  else if (st == BICO_OK && bico__lora_nmodules(r->out) == 0)
    st = bico__fail(ctx, BICO_E_NOTFOUND,
                    "adapter %s: none of its modules pairs with a target "
                    "module",
                    file(r, BICO_FILE_LORA));
  if (st != BICO_OK) return st;

  return lora_commit(r, unused);
}

bico_status bico__lora_transfer_run(bico__run *x, size_t *updated) {
  lrun r;
  memset(&r, 0, sizeof r);
  r.x = x;
  r.ctx = x->ctx;
  bico__report_init(&r.rep, x->ctx);
  bico_status st = run_lora(&r);
  *updated = 0;
  for (int h = BICO__H_FIRST; h < BICO__H_COUNT; h++)
    if (h != BICO__H_UNCHANGED) *updated += r.count[h];
  for (size_t k = 0; k < r.nsupd; k++) bico__free(x->ctx, r.supd[k]);
  bico__free(x->ctx, r.supd);
  bico__report_free(&r.rep);
  bico_lora_free(r.src);
  bico_lora_free(r.out);
  return st;
}
