/* PEFT LoRA adapters: reading, writing, factored transport, truncation. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "lora_impl.h"
#include "lapack.h"
#include "lora_internal.h"
#include "report.h"
#include "fileio.h"
#include "strindex.h"


bico_status bico_lora_create(bico_ctx *ctx, bico_lora **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "lora_create: out is NULL");
  bico_lora *l = bico__calloc(ctx, 1, sizeof *l);
  if (l == NULL) return BICO_E_NOMEM;
  l->ctx = ctx;
  *out = l;
  return BICO_OK;
}

void bico_lora_free(bico_lora *l) {
  if (l == NULL) return;
  bico_ctx *ctx = l->ctx;
  for (size_t i = 0; i < l->nmods; i++) {
    bico__free(ctx, l->mods[i].name);
    bico__free(ctx, l->mods[i].b);
    bico__free(ctx, l->mods[i].a);
  }
  bico__free(ctx, l->mods);
  bico__strindex_free(ctx, &l->by_name);
  for (size_t i = 0; i < l->nsaved; i++) {
    bico__free(ctx, l->saved[i].name);
    bico__free(ctx, l->saved[i].module);
    bico__free(ctx, l->saved[i].shape);
    bico__free(ctx, l->saved[i].data);
  }
  bico__free(ctx, l->saved);
  for (int i = 0; i < NSTR; i++) bico__free(ctx, l->strings[i]);
  bico__free(ctx, l);
}

/* The option grammar (params.h, lib/base/params.c): the adapter-wide switches
 * are 0/1 parameters like every handle's. */
static const bico__param_spec LPARAM[] = {
    [BICO_LORA_RSLORA] = {"rslora", 0, 1, BICO_PARAM_INTEGER},
    [BICO_LORA_FAN_IN_FAN_OUT] = {"fan_in_fan_out", 0, 1, BICO_PARAM_INTEGER},
};
#define NLPARAM BICO__NSPEC(LPARAM)

bico_status bico_lora_param_bounds(int param, double *lo, double *hi,
                                   unsigned *flags) {
  return bico__param_bounds(LPARAM, NLPARAM, param, lo, hi, flags);
}

const char *bico_lora_param_name(int param) {
  return bico__param_name(LPARAM, NLPARAM, param);
}

bico_status bico_lora_param_from_name(const char *name, int *param) {
  return bico__param_from_name(LPARAM, NLPARAM, name, param);
}

bico_status bico_lora_set_param(bico_lora *l, int param, double value) {
  if (l == NULL) return BICO_E_NULL;
  bico__clear(l->ctx);
  bico_status st = bico__param_set(l->ctx, "lora_set_param", LPARAM, NLPARAM,
                                   param, value);
  if (st != BICO_OK) return st;
  if (param == BICO_LORA_RSLORA) l->rslora = value != 0;
  else l->fifo = value != 0;
  return BICO_OK;
}

bico_status bico_lora_get_param(const bico_lora *l, int param, double *value) {
  if (l == NULL) return BICO_E_NULL;
  bico_status st = bico__param_get(l->ctx, "lora_get_param", LPARAM, NLPARAM,
                                   param, value);
  if (st != BICO_OK) return st;
  *value = param == BICO_LORA_RSLORA ? l->rslora : l->fifo;
  return BICO_OK;
}

bico_status bico_lora_set_string(bico_lora *l, int which, const char *value) {
  if (l == NULL) return BICO_E_NULL;
  bico__clear(l->ctx);
  if (which < 1 || which >= NSTR)
    return bico__fail(l->ctx, BICO_E_ARG, "lora_set_string: unknown option %d",
                      which);
  char *p = NULL;
  if (value != NULL && (p = bico__strdup(l->ctx, value)) == NULL) return BICO_E_NOMEM;
  bico__free(l->ctx, l->strings[which]);
  l->strings[which] = p;
  return BICO_OK;
}

bico_status bico_lora_get_string(const bico_lora *l, int which,
                                 const char **value) {
  if (l == NULL) return BICO_E_NULL;
  if (value == NULL)
    return bico__fail(l->ctx, BICO_E_NULL, "lora_get_string: value is NULL");
  if (which < 1 || which >= NSTR)
    return bico__fail(l->ctx, BICO_E_ARG, "lora_get_string: unknown option %d",
                      which);
  *value = l->strings[which];
  return BICO_OK;
}

bico_status bico_lora_module_count(const bico_lora *l, size_t *n) {
  if (l == NULL) return BICO_E_NULL;
  if (n == NULL)
    return bico__fail(l->ctx, BICO_E_NULL, "lora_module_count: n is NULL");
  *n = l->nmods;
  return BICO_OK;
}

size_t bico__lora_nmodules(const bico_lora *l) { return l ? l->nmods : 0; }

double bico__lora_scale(const bico_lora *l, const lmod *m) {
  return l->rslora ? m->alpha / sqrt((double)m->rank)
                   : m->alpha / (double)m->rank;
}

bico_status bico_lora_module(const bico_lora *l, size_t i, const char **name,
                             int *kind, size_t *rank, size_t *d_out,
                             size_t *d_in, double *alpha, double *scale) {
  if (l == NULL) return BICO_E_NULL;
  if (i >= l->nmods)
    return bico__fail(l->ctx, BICO_E_ARG,
                      "lora_module: index %zu out of range (%zu modules)", i,
                      l->nmods);
  const lmod *m = &l->mods[i];
  if (name) *name = m->name;
  if (kind) *kind = m->kind;
  if (rank) *rank = m->rank;
  if (d_out) *d_out = m->dout;
  if (d_in) *d_in = m->din;
  if (alpha) *alpha = m->alpha;
  if (scale) *scale = bico__lora_scale(l, m);
  return BICO_OK;
}

static const char *mod_key(const void *owner, size_t i) {
  return ((const bico_lora *)owner)->mods[i].name;
}

static size_t find_mod(const bico_lora *l, const char *name) {
  return bico__strindex_find(&l->by_name, name, strlen(name), mod_key, l);
}

bico_status bico_lora_find_module(const bico_lora *l, const char *name,
                                  size_t *i) {
  if (l == NULL) return BICO_E_NULL;
  if (name == NULL || i == NULL)
    return bico__fail(l->ctx, BICO_E_NULL, "lora_find_module: %s is NULL",
                      name == NULL ? "name" : "i");
  size_t k = find_mod(l, name);
  if (k == SIZE_MAX)
    return bico__fail(l->ctx, BICO_E_NOTFOUND,
                      "lora_find_module: the adapter has no module %s", name);
  *i = k;
  return BICO_OK;
}

bico_status bico_lora_factors(const bico_lora *l, size_t i, const float **b,
                              const float **a) {
  if (l == NULL) return BICO_E_NULL;
  if (i >= l->nmods)
    return bico__fail(l->ctx, BICO_E_ARG,
                      "lora_factors: index %zu out of range (%zu modules)", i,
                      l->nmods);
  if (b) *b = l->mods[i].b;
  if (a) *a = l->mods[i].a;
  return BICO_OK;
}

/* Takes ownership of b and a (freed on failure too). */
bico_status bico__lora_push_module(bico_lora *l, char *name, int kind, size_t rank,
                               double alpha, size_t dout, size_t din, float *b,
                               float *a) {
  bico_ctx *ctx = l->ctx;
  lmod *p = bico__grow(ctx, l->mods, l->nmods, &l->capm, 8, sizeof *p);
  if (p == NULL) {
    bico__free(ctx, name);
    bico__free(ctx, b);
    bico__free(ctx, a);
    return BICO_E_NOMEM;
  }
  l->mods = p;
  if (bico__strindex_reserve(ctx, &l->by_name, l->nmods + 1, mod_key, l) !=
      BICO_OK) {
    bico__free(ctx, name);
    bico__free(ctx, b);
    bico__free(ctx, a);
    return BICO_E_NOMEM;
  }
  lmod *m = &l->mods[l->nmods++];
  m->name = name;
  m->kind = kind;
  m->rank = rank;
  m->alpha = alpha;
  m->dout = dout;
  m->din = din;
  m->b = b;
  m->a = a;
  bico__strindex_insert(&l->by_name, l->nmods - 1, mod_key, l);
  return BICO_OK;
}

bico_status bico_lora_add_module(bico_lora *l, const char *name, int kind,
                                 size_t rank, size_t d_out, size_t d_in,
                                 double alpha, const float *b, const float *a) {
  if (l == NULL) return BICO_E_NULL;
  bico_ctx *ctx = l->ctx;
  bico__clear(ctx);
  const char *fn = "lora_add_module";
  if (name == NULL || b == NULL || a == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      name == NULL ? "name" : b == NULL ? "b" : "a");
  if (name[0] == '\0')
    return bico__fail(ctx, BICO_E_ARG, "%s: empty module name", fn);
  if (kind != BICO_LORA_LINEAR && kind != BICO_LORA_EMBEDDING)
    return bico__fail(ctx, BICO_E_ARG, "%s: module %s: unknown kind %d", fn,
                      name, kind);
  if (rank == 0 || d_out == 0 || d_in == 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: module %s: rank %zu, d_out %zu, d_in %zu must all "
                      "be at least 1",
                      fn, name, rank, d_out, d_in);
  if (!isfinite(alpha) || !(alpha > 0))
    return bico__fail(ctx, isfinite(alpha) ? BICO_E_ARG : BICO_E_NONFINITE,
                      "%s: module %s: alpha %g must be a positive number", fn,
                      name, alpha);
  if (find_mod(l, name) != SIZE_MAX)
    return bico__fail(ctx, BICO_E_ARG, "%s: module %s added twice", fn, name);
  size_t nb, na;
  if (bico__mul(d_out, rank, &nb) || bico__mul(rank, d_in, &na) ||
      bico__mul(nb, sizeof(float), &nb) || bico__mul(na, sizeof(float), &na))
    return bico__fail(ctx, BICO_E_SHAPE, "%s: module %s: sizes overflow", fn,
                      name);
  bico_status st = bico__check_finite_f32(ctx, fn, "b", b, d_out, rank, rank);
  if (st == BICO_OK)
    st = bico__check_finite_f32(ctx, fn, "a", a, rank, d_in, d_in);
  if (st != BICO_OK) return st;
  char *n = bico__strdup(ctx, name);
  float *bc = bico__alloc(ctx, nb), *ac = bico__alloc(ctx, na);
  if (n == NULL || bc == NULL || ac == NULL) {
    bico__free(ctx, n);
    bico__free(ctx, bc);
    bico__free(ctx, ac);
    return BICO_E_NOMEM;
  }
  memcpy(bc, b, nb);
  memcpy(ac, a, na);
  return bico__lora_push_module(l, n, kind, rank, alpha, d_out, d_in, bc, ac);
}

bico_status bico_lora_saved_count(const bico_lora *l, size_t *n) {
  if (l == NULL) return BICO_E_NULL;
  if (n == NULL)
    return bico__fail(l->ctx, BICO_E_NULL, "lora_saved_count: n is NULL");
  *n = l->nsaved;
  return BICO_OK;
}

size_t bico__lora_nsaved(const bico_lora *l) { return l ? l->nsaved : 0; }

bico_status bico_lora_saved(const bico_lora *l, size_t i, const char **name,
                            const char **module, size_t *ndim,
                            const size_t **shape, const float **data) {
  if (l == NULL) return BICO_E_NULL;
  if (i >= l->nsaved)
    return bico__fail(l->ctx, BICO_E_ARG,
                      "lora_saved: index %zu out of range (%zu saved tensors)",
                      i, l->nsaved);
  const lsaved *s = &l->saved[i];
  if (name) *name = s->name;
  if (module) *module = s->module;
  if (ndim) *ndim = s->ndim;
  if (shape) *shape = s->shape;
  if (data) *data = s->data;
  return BICO_OK;
}

/* Takes ownership of data. */
bico_status bico__lora_push_saved(bico_lora *l, const char *name,
                              const char *module, size_t ndim,
                              const size_t *shape, size_t numel, float *data) {
  bico_ctx *ctx = l->ctx;
  lsaved *p = bico__grow(ctx, l->saved, l->nsaved, &l->caps, 4, sizeof *p);
  if (p == NULL) {
    bico__free(ctx, data);
    return BICO_E_NOMEM;
  }
  l->saved = p;
  lsaved s;
  s.name = bico__strdup(ctx, name);
  s.module = bico__strdup(ctx, module);
  s.shape = bico__alloc(ctx, (ndim ? ndim : 1) * sizeof(size_t));
  s.ndim = ndim;
  s.numel = numel;
  s.data = data;
  if (s.name == NULL || s.module == NULL || s.shape == NULL) {
    bico__free(ctx, s.name);
    bico__free(ctx, s.module);
    bico__free(ctx, s.shape);
    bico__free(ctx, data);
    return BICO_E_NOMEM;
  }
  if (ndim) memcpy(s.shape, shape, ndim * sizeof(size_t));
  l->saved[l->nsaved++] = s;
  return BICO_OK;
}

static int find_saved(const bico_lora *l, const char *name) {
  for (size_t i = 0; i < l->nsaved; i++)
    if (strcmp(l->saved[i].name, name) == 0) return 1;
  return 0;
}

bico_status bico_lora_add_saved(bico_lora *l, const char *name,
                                const char *module, size_t ndim,
                                const size_t *shape, const float *data) {
  if (l == NULL) return BICO_E_NULL;
  bico_ctx *ctx = l->ctx;
  bico__clear(ctx);
  const char *fn = "lora_add_saved";
  if (name == NULL || module == NULL || data == NULL ||
      (ndim > 0 && shape == NULL))
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      name == NULL     ? "name"
                      : module == NULL ? "module"
                      : data == NULL   ? "data"
                                       : "shape");
  size_t ml = strlen(module);
  if (module[0] == '\0' || strncmp(name, module, ml) != 0 || name[ml] != '.' ||
      name[ml + 1] == '\0')
    return bico__fail(ctx, BICO_E_ARG,
                      "%s: tensor name \"%s\" does not start with its module "
                      "\"%s\" and a dot",
                      fn, name, module);
  if (ndim > 64)
    return bico__fail(ctx, BICO_E_SHAPE, "%s: %s has %zu dimensions (max 64)",
                      fn, name, ndim);
  if (find_saved(l, name))
    return bico__fail(ctx, BICO_E_ARG, "%s: tensor %s added twice", fn, name);
  size_t numel = 1;
  for (size_t d = 0; d < ndim; d++)
    if (bico__mul(numel, shape[d], &numel))
      return bico__fail(ctx, BICO_E_SHAPE, "%s: %s: size overflows", fn, name);
  size_t bytes;
  if (bico__mul(numel, sizeof(float), &bytes))
    return bico__fail(ctx, BICO_E_SHAPE, "%s: %s: size overflows", fn, name);
  bico_status st = bico__check_finite_f32(ctx, fn, name, data, 1, numel, numel);
  if (st != BICO_OK) return st;
  float *copy = bico__alloc(ctx, bytes ? bytes : 1);
  if (copy == NULL) return BICO_E_NOMEM;
  if (bytes) memcpy(copy, data, bytes);
  return bico__lora_push_saved(l, name, module, ndim, shape, numel, copy);
}

double bico__lora_dropout(const bico_lora *l) { return l->dropout; }
void bico__lora_set_dropout(bico_lora *l, double dropout) {
  l->dropout = dropout;
}
