/* bico_transfer_explain: the plan of a transfer, tensor by tensor, with
 * the rule behind each decision (what `bico inspect SOURCE TARGET`
 * prints).  Everything comes from the run's own setup functions
 * (families, blocks, pairing, ties, splits, routes, the vocabulary map);
 * this file only puts their answers into words and keeps them. */
#include <stdio.h>
#include <string.h>

#include "family.h"
#include "transfer_internal.h"
#include "vocab.h"

typedef struct xdec {
  char *name, *source, *module, *rule;
  int role, handling, in_map, out_maps, transposed, vocab;
} xdec;

struct bico__explain {
  char *family[2], *from[2], *blocks[2];
  char *model_type[2], *causal_from[2];
  int causal_lm[2];
  size_t nblocks[2], tensors[2];
  xdec *d;
  size_t nt;
  size_t vocab[4];
};

static char *dup(bico_ctx *ctx, const char *s) {
  if (s == NULL) return NULL;
  size_t n = strlen(s);
  char *p = bico__alloc(ctx, n + 1);
  if (p) memcpy(p, s, n + 1);
  return p;
}

void bico__xfer_explain_free(bico_transfer *t) {
  struct bico__explain *e = t->ex;
  if (e == NULL) return;
  bico_ctx *ctx = t->ctx;
  for (int k = 0; k < 2; k++) {
    bico__free(ctx, e->family[k]);
    bico__free(ctx, e->from[k]);
    bico__free(ctx, e->blocks[k]);
    bico__free(ctx, e->model_type[k]);
    bico__free(ctx, e->causal_from[k]);
  }
  for (size_t i = 0; e->d && i < e->nt; i++) {
    bico__free(ctx, e->d[i].name);
    bico__free(ctx, e->d[i].source);
    bico__free(ctx, e->d[i].module);
    bico__free(ctx, e->d[i].rule);
  }
  bico__free(ctx, e->d);
  bico__free(ctx, e);
  t->ex = NULL;
}

static const char *const TIE_RULE[] = {
    "", "--tie",
    "the stem: the linear module outside the blocks, of the token's width, "
    "named embed/stem/patch",
    "the element-wise module outside the blocks named embed*",
    "the first element-wise module of the first block (a pre-norm "
    "decoder's input norm)"};

/* The rule of target tensor ti, in words, into buf. */
static void describe(const bico__run *r, size_t ti, const bico__route *rt,
                     int paired, const char *mapped, xdec *d, char *buf,
                     size_t cap) {
  const char *name = bico__xfer_tname(r->mt, ti);
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(r->mt, ti, NULL, NULL, &ndim, &shape);
  int fam = r->kind[1];
  size_t o = 0;
#define ADD(...)                                                      \
  do {                                                                \
    if (o < cap) o += (size_t)snprintf(buf + o, cap - o, __VA_ARGS__); \
  } while (0)
  if (d->role == BICO_ROLE_OTHER) {
    if (bico__family_role(fam, name, ndim) == BICO_ROLE_OTHER)
      ADD("%s family: a buffer, not a parameter; left alone",
          bico__family_name(fam));
    else
      ADD("no method changes this kind of tensor (integer, scalar or "
          "unrecognised)");
    return;
  }
  if (!paired) {
    ADD("no source tensor %s (pairing: %s)", mapped,
        strcmp(mapped, name) == 0 ? "same name outside the blocks"
                                  : "depth map inside the blocks");
    return;
  }
  if (!bico__xfer_is_bico(r->method)) {
    ADD("method %s, tensor by tensor", bico_transfer_method_name(r->method));
    return;
  }
  if (rt->kind == BICO__ROUTE_NONE) {
    ADD("%s", rt->reason);
    return;
  }
  const char *mod = bico__xfer_mname(r->mt, rt->module);
  size_t k = r->mods[rt->module].k;
  int gradmap = rt->side == 0 ? 0 : 1;
  switch (rt->kind) {
    case BICO__ROUTE_WEIGHT:
      if (rt->tokens)
        ADD("vocabulary head %s: tau R_in, its rows tokens (no output map)",
            mod);
      else
        ADD("weight of linear module %s: R_out^T tau R_in", mod);
      break;
    case BICO__ROUTE_BIAS:
      ADD("bias of linear module %s: R_out^T b", mod);
      break;
    default:
      if (d->role == BICO_ROLE_VECTOR)
        ADD("%s of norm %s: %s by its %s map", rt->scale ? "scale" : "vector",
            mod, rt->scale ? "(R o R)^T tau (an operator)" : "R^T tau",
            gradmap ? "output-gradient" : "input-activation");
      else
        ADD("token tied to %s by %s%s: rows by its %s map", mod,
            TIE_RULE[r->tie_rule[ti] < 5 ? r->tie_rule[ti] : 0],
            bico__family_tower(fam, name) ? " (within its tower)" : "",
            rt->side ? "output" : "input");
  }
  if (rt->kind != BICO__ROUTE_ROWS && k > 1) {
    int user = 0;
    for (size_t i = 0; i < r->t->nsplits; i++) {
      const char *suf = r->t->splits[i].suffix;
      size_t n = strlen(mod), sl = strlen(suf);
      if (sl <= n && strcmp(mod + n - sl, suf) == 0 &&
          (sl == n || mod[n - sl - 1] == '.'))
        user = 1;
    }
    ADD("; output split in %zu (%s)", k,
        user ? "--split" : "fused q, k, v: the family's default");
  }
  if (d->transposed)
    ADD("; stored [in, out] (%s Conv1D)", bico__family_name(fam));
  if (d->vocab && r->vocab != NULL)
    ADD("; rows matched by token string (the tokenizers differ)");
  else if (d->vocab)
    ADD("; rows matched by id (the tables' row counts differ: the "
        "target's extra rows stay)");
#undef ADD
}

/* Side k's model_type and whether it is a causal language model, from
 * its config.json as the run read it (bico__xfer_load_models: the one
 * read; none given or beside a folder: nothing to say). */
static bico_status causal(bico__run *r, struct bico__explain *e, int k) {
  bico_ctx *ctx = r->ctx;
  const bico__family *f = &r->fam[k];
  char why[512 + 128] = "";
  if (f->causal_lm)
    snprintf(why, sizeof why, "%s: %s", r->fam_path[k], f->causal_why);
  e->model_type[k] = dup(ctx, f->type);
  e->causal_from[k] = dup(ctx, why);
  e->causal_lm[k] = f->causal_lm;
  return e->model_type[k] && e->causal_from[k] ? BICO_OK : BICO_E_NOMEM;
}

static bico_status explain(bico__run *r, struct bico__explain *e) {
  bico_ctx *ctx = r->ctx;
  /* A bridge's bases and options, as a run would take them. */
  bico_status st = bico__bridge_begin(r);
  if (st == BICO_OK) st = bico__xfer_open_file(r, BICO_FILE_SOURCE_BASE, &r->sb);
  if (st == BICO_OK)
    st = bico__xfer_open_file(r, BICO_FILE_TARGET_BASE, &r->tb);
  if (st == BICO_OK && (r->sb == NULL || r->tb == NULL))
    st = bico__fail(ctx, BICO_E_ARG,
                    "transfer_explain: set the source base and the target "
                    "base");
  if (st == BICO_OK) st = bico__xfer_load_models(r);
  if (st == BICO_OK && bico__xfer_is_bico(r->method))
    st = bico__vocab_map(ctx, r->t->files[BICO_FILE_SOURCE_BASE],
                         r->t->files[BICO_FILE_TARGET_BASE], &r->vocab);
  if (st == BICO_OK) st = bico__xfer_plan(r);
  if (st != BICO_OK) return st;
  const bico_model *ms[2] = {r->ms, r->mt};
  for (int k = 0; k < 2; k++) {
    const char *p;
    bico_model_blocks(ms[k], &p, &e->nblocks[k]);
    /* One family for inspect and a run: config.json's model_type when the
     * library knows it (a decoder family too), else the tensor names'. */
    char from[256];
    if (r->fam[k].row != NULL)
      snprintf(from, sizeof from, "config.json model_type \"%s\"",
               r->fam[k].type);
    else
      snprintf(from, sizeof from, "%s", r->kind_why[k]);
    e->family[k] = dup(ctx, bico__family_word(&r->fam[k], r->kind[k]));
    e->from[k] = dup(ctx, from);
    e->blocks[k] = p ? dup(ctx, p) : NULL;
    e->tensors[k] = bico__model_ntensors(ms[k]);
    if (!e->family[k] || !e->from[k] || (p && !e->blocks[k]))
      return BICO_E_NOMEM;
    if ((st = causal(r, e, k)) != BICO_OK) return st;
  }
  if (r->vocab) {
    e->vocab[0] = r->vocab->n_source;
    e->vocab[1] = r->vocab->n_target;
    e->vocab[2] = r->vocab->shared;
    e->vocab[3] = r->vocab->fresh;
  }
  size_t nt = bico__model_ntensors(r->mt);
  e->d = bico__calloc(ctx, nt ? nt : 1, sizeof *e->d);
  if (e->d == NULL) return BICO_E_NOMEM;
  e->nt = nt;
  int bico = bico__xfer_is_bico(r->method);
  for (size_t ti = 0; ti < nt; ti++) {
    xdec *d = &e->d[ti];
    const char *name;
    int dtype;
    size_t ndim;
    const size_t *shape;
    bico_model_tensor(r->mt, ti, &name, &dtype, &ndim, &shape);
    bico_model_tensor_module(r->mt, ti, NULL, &d->role);
    size_t si;
    char mapped[1024];
    if (bico_model_map_name(r->mt, r->ms, name, mapped, sizeof mapped, NULL) !=
        BICO_OK)
      snprintf(mapped, sizeof mapped, "%s", name);
    int paired = bico_model_pair_tensor(r->mt, ti, r->ms, &si) == BICO_OK;
    bico__clear(ctx);
    bico__route rt;
    memset(&rt, 0, sizeof rt);
    if (bico) bico__xfer_route(r, ti, &rt);
    else rt.module = BICO__NONE;
    d->transposed = bico__model_transposed(r->mt, ti);
    if (paired && bico && rt.kind != BICO__ROUTE_NONE) {
      d->module = dup(ctx, bico__xfer_mname(r->mt, rt.module));
      if (d->module == NULL) return BICO_E_NOMEM;
      size_t k = r->mods[rt.module].k;
      d->in_map = rt.need[0];
      d->out_maps = rt.need[1] ? (rt.kind == BICO__ROUTE_ROWS ? 1 : (int)k) : 0;
      d->vocab = bico__xfer_token_rows(r, ti, si);
      d->handling = bico__xfer_route_handling(&rt);
    } else if (paired && !bico && d->role != BICO_ROLE_OTHER) {
      d->handling = r->method == BICO_METHOD_NAIVE ? BICO_HANDLING_NAIVE
                    : r->method == BICO_METHOD_PAD ? BICO_HANDLING_PADDED
                                                   : BICO_HANDLING_MASKED;
    } else {
      d->handling = BICO_HANDLING_UNCHANGED;
    }
    char rule[2048];
    describe(r, ti, &rt, paired, mapped, d, rule, sizeof rule);
    d->name = dup(ctx, name);
    d->source = paired ? dup(ctx, bico__xfer_tname(r->ms, si)) : NULL;
    d->rule = dup(ctx, rule);
    if (!d->name || !d->rule || (paired && !d->source)) return BICO_E_NOMEM;
  }
  return BICO_OK;
}

bico_status bico_transfer_explain(bico_transfer *t) {
  if (t == NULL) return BICO_E_NULL;
  bico__clear(t->ctx);
  bico__xfer_explain_free(t);
  struct bico__explain *e = bico__calloc(t->ctx, 1, sizeof *e);
  if (e == NULL) return BICO_E_NOMEM;
  bico__run r;
  bico__xfer_run_init(&r, t);
  t->ex = e;
  bico_status st = explain(&r, e);
  bico__xfer_run_free(&r);
  if (st != BICO_OK) bico__xfer_explain_free(t);
  return st;
}

static bico_status ready(const bico_transfer *t, const char *fn) {
  if (t->ex == NULL)
    return bico__fail(t->ctx, BICO_E_STATE, "%s: no successful explain yet",
                      fn);
  return BICO_OK;
}

/* Copies at most size bytes of the library's struct (its size field set
 * to the library's sizeof) into the caller's. */
static bico_status fill(bico_ctx *ctx, const char *fn, void *out,
                        const void *full, size_t fsize) {
  size_t want;
  memcpy(&want, out, sizeof want);
  if (want < sizeof(size_t))
    return bico__fail(ctx, BICO_E_ARG, "%s: out->size is %zu (set it to "
                                       "sizeof the struct)", fn, want);
  memcpy(out, full, want < fsize ? want : fsize);
  return BICO_OK;
}

bico_status bico_transfer_explain_model(const bico_transfer *t, int side,
                                        bico_transfer_model_info *out) {
  if (t == NULL) return BICO_E_NULL;
  if (out == NULL)
    return bico__fail(t->ctx, BICO_E_NULL, "transfer_explain_model: out is "
                                           "NULL");
  bico_status st = ready(t, "transfer_explain_model");
  if (st != BICO_OK) return st;
  if (side != 0 && side != 1)
    return bico__fail(t->ctx, BICO_E_ARG, "transfer_explain_model: side %d "
                                          "(0 source, 1 target)", side);
  const struct bico__explain *e = t->ex;
  bico_transfer_model_info m = {sizeof m,           e->family[side],
                                e->from[side],      e->blocks[side],
                                e->nblocks[side],   e->tensors[side],
                                e->model_type[side], e->causal_lm[side],
                                e->causal_from[side]};
  return fill(t->ctx, "transfer_explain_model", out, &m, sizeof m);
}

bico_status bico_transfer_explain_count(const bico_transfer *t, size_t *n) {
  if (t == NULL) return BICO_E_NULL;
  if (n == NULL)
    return bico__fail(t->ctx, BICO_E_NULL, "transfer_explain_count: n is NULL");
  bico_status st = ready(t, "transfer_explain_count");
  if (st == BICO_OK) *n = t->ex->nt;
  return st;
}

bico_status bico_transfer_explain_tensor(const bico_transfer *t, size_t i,
                                         bico_transfer_decision *out) {
  if (t == NULL) return BICO_E_NULL;
  if (out == NULL)
    return bico__fail(t->ctx, BICO_E_NULL,
                      "transfer_explain_tensor: out is NULL");
  bico_status st = ready(t, "transfer_explain_tensor");
  if (st != BICO_OK) return st;
  if (i >= t->ex->nt)
    return bico__fail(t->ctx, BICO_E_ARG,
                      "transfer_explain_tensor: index %zu out of range (%zu "
                      "tensors)", i, t->ex->nt);
  const xdec *d = &t->ex->d[i];
  bico_transfer_decision x = {sizeof x, d->name, d->source, d->role,
                              d->handling, d->module, d->in_map, d->out_maps,
                              d->transposed, d->vocab, d->rule};
  return fill(t->ctx, "transfer_explain_tensor", out, &x, sizeof x);
}

bico_status bico_transfer_explain_vocab(const bico_transfer *t,
                                        size_t *source_tokens,
                                        size_t *target_tokens, size_t *shared,
                                        size_t *fresh) {
  if (t == NULL) return BICO_E_NULL;
  bico_status st = ready(t, "transfer_explain_vocab");
  if (st != BICO_OK) return st;
  if (source_tokens) *source_tokens = t->ex->vocab[0];
  if (target_tokens) *target_tokens = t->ex->vocab[1];
  if (shared) *shared = t->ex->vocab[2];
  if (fresh) *fresh = t->ex->vocab[3];
  return BICO_OK;
}
