/* bico_model: tensor names and shapes -> modules -> blocks -> pairs. */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "internal.h"
#include "naming.h"
#include "strindex.h"

#define MAX_NDIM 64
#define NONE SIZE_MAX

typedef struct tensor_rec {
  char *name;
  int dtype;
  size_t ndim;
  size_t *shape;
  size_t module;
  int role;
} tensor_rec;

typedef struct module_rec {
  char *name;
  int kind;
  long block;
  size_t first, count; /* slice of mod_tensors */
  size_t weight;       /* tensor index of a LINEAR/EMBEDDING weight or NONE */
  size_t d_out, d_in;
} module_rec;

struct bico_model {
  bico_ctx *ctx;
  tensor_rec *t;
  size_t nt, capt;
  bico__strindex by_name; /* tensor name -> index */
  char *override; /* block prefix set by the caller */
  int has_override;
  /* analysis cache */
  int analyzed;
  module_rec *mods;
  size_t nm;
  size_t *mod_tensors;
  size_t *mod_sorted; /* module indices sorted by name */
  char *prefix;       /* NULL: no blocks */
  size_t nblocks;
  const bico__naming *naming; /* handed by the caller (its family's row:
                                 layout, roles, containers); NULL: generic */
  int naming_set;              /* 1: handed; else `namer` decides it */
  bico__namer namer;           /* the constructor's rule for a naming
                                  from the names, or NULL */
  size_t cont_n[8];   /* blocks per container of the family (0: none) */
};

/* A graph built from shapes alone (dtype 0) counts as floating point. */
static int is_float_dtype(int dtype) {
  return dtype == 0 || bico_dtype_is_float(dtype);
}

static const char *tensor_key(const void *m, size_t i) {
  return ((const bico_model *)m)->t[i].name;
}

static const char *module_key(const void *m, size_t i) {
  return ((const bico_model *)m)->mods[i].name;
}

bico_status bico__model_new(bico_ctx *ctx, bico_model **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "model_create: out is NULL");
  bico_model *m = bico__calloc(ctx, 1, sizeof *m);
  if (m == NULL) return BICO_E_NOMEM;
  m->ctx = ctx;
  *out = m;
  return BICO_OK;
}

static void drop_analysis(bico_model *m) {
  bico_ctx *ctx = m->ctx;
  for (size_t i = 0; i < m->nm; i++) bico__free(ctx, m->mods[i].name);
  bico__free(ctx, m->mods);
  bico__free(ctx, m->mod_tensors);
  bico__free(ctx, m->mod_sorted);
  bico__free(ctx, m->prefix);
  m->mods = NULL;
  m->mod_tensors = m->mod_sorted = NULL;
  m->prefix = NULL;
  m->nm = m->nblocks = 0;
  m->analyzed = 0;
}

void bico_model_free(bico_model *m) {
  if (m == NULL) return;
  bico_ctx *ctx = m->ctx;
  drop_analysis(m);
  for (size_t i = 0; i < m->nt; i++) {
    bico__free(ctx, m->t[i].name);
    bico__free(ctx, m->t[i].shape);
  }
  bico__free(ctx, m->t);
  bico__strindex_free(ctx, &m->by_name);
  bico__free(ctx, m->override);
  bico__free(ctx, m);
}

/* NONE (== SIZE_MAX) when absent. */
static size_t hash_find(const bico_model *m, const char *name) {
  return bico__strindex_find(&m->by_name, name, strlen(name), tensor_key, m);
}

bico_status bico_model_add_tensor(bico_model *m, const char *name, int dtype,
                                  size_t ndim, const size_t *shape) {
  if (m == NULL) return BICO_E_NULL;
  bico_ctx *ctx = m->ctx;
  bico__clear(ctx);
  if (name == NULL || (ndim > 0 && shape == NULL))
    return bico__fail(ctx, BICO_E_NULL, "model_add_tensor: %s is NULL",
                      name == NULL ? "name" : "shape");
  if (name[0] == '\0')
    return bico__fail(ctx, BICO_E_ARG, "model_add_tensor: empty name");
  if (ndim > MAX_NDIM)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "model_add_tensor: tensor %s has %zu dimensions (at "
                      "most %d)",
                      name, ndim, MAX_NDIM);
  if (dtype != 0 && bico_dtype_size(dtype) == 0)
    return bico__fail(ctx, BICO_E_ARG,
                      "model_add_tensor: tensor %s has unknown dtype %d", name,
                      dtype);
  if (hash_find(m, name) != NONE)
    return bico__fail(ctx, BICO_E_ARG,
                      "model_add_tensor: tensor %s registered twice", name);
  tensor_rec *t = bico__grow(ctx, m->t, m->nt, &m->capt, 32, sizeof *t);
  if (t == NULL) return BICO_E_NOMEM;
  m->t = t;
  bico_status st = bico__strindex_reserve(ctx, &m->by_name, m->nt + 1,
                                          tensor_key, m);
  if (st != BICO_OK) return st;
  tensor_rec *r = &m->t[m->nt];
  memset(r, 0, sizeof *r);
  r->name = bico__strdup(ctx, name);
  r->shape = bico__alloc(ctx, (ndim ? ndim : 1) * sizeof(size_t));
  if (r->name == NULL || r->shape == NULL) {
    bico__free(ctx, r->name);
    bico__free(ctx, r->shape);
    return BICO_E_NOMEM;
  }
  if (ndim) memcpy(r->shape, shape, ndim * sizeof(size_t));
  r->ndim = ndim;
  r->dtype = dtype;
  bico__strindex_insert(&m->by_name, m->nt, tensor_key, m);
  m->nt++;
  drop_analysis(m);
  return BICO_OK;
}

bico_status bico_model_set_blocks(bico_model *m, const char *prefix) {
  if (m == NULL) return BICO_E_NULL;
  bico__clear(m->ctx);
  char *p = NULL;
  if (prefix != NULL) {
    p = bico__strdup(m->ctx, prefix);
    if (p == NULL) return BICO_E_NOMEM;
  }
  bico__free(m->ctx, m->override);
  m->override = p;
  m->has_override = prefix != NULL;
  drop_analysis(m);
  return BICO_OK;
}

/* ---- naming (naming.h) ---- */

static const char *last_of(const char *s, size_t len) {
  for (size_t i = len; i-- > 0;)
    if (s[i] == '.') return s + i + 1;
  return s;
}

/* The last component of name's module into buf ("" when none or longer
 * than cap). */
static void module_tail(const char *name, char *buf, size_t cap) {
  const char *dot = strrchr(name, '.');
  buf[0] = '\0';
  if (dot == NULL) return;
  size_t mlen = (size_t)(dot - name);
  const char *c = last_of(name, mlen);
  size_t n = (size_t)(name + mlen - c);
  if (n >= cap) return;
  memcpy(buf, c, n);
  buf[n] = '\0';
}

int bico__naming_transposed(const bico__naming *n, const char *name,
                            size_t ndim) {
  if (n == NULL || n->conv1d == NULL || ndim != 2 || name == NULL) return 0;
  size_t len = strlen(name);
  if (len < 7 || strcmp(name + len - 7, ".weight") != 0) return 0;
  char mod[64];
  module_tail(name, mod, sizeof mod);
  for (const char *const *c = n->conv1d; *c != NULL; c++)
    if (strcmp(mod, *c) == 0) return 1;
  return 0;
}

int bico__naming_role(const bico__naming *n, const char *name, size_t ndim) {
  if (n == NULL || n->roles == NULL || name == NULL) return 0;
  const char *last = last_of(name, strlen(name));
  char mod[64];
  module_tail(name, mod, sizeof mod);
  for (const bico__role_rule *r = n->roles; r->last != NULL; r++)
    if (strcmp(last, r->last) == 0 && ndim >= r->min_ndim &&
        (r->module == NULL || strcmp(mod, r->module) == 0))
      return r->role;
  return 0;
}

const bico__naming *bico__model_naming(const bico_model *m) {
  return m ? m->naming : NULL;
}

void bico__model_set_naming(bico_model *m, const bico__naming *n) {
  if (m == NULL) return;
  m->naming = n;
  m->naming_set = 1;
  drop_analysis(m);
}

void bico__model_set_namer(bico_model *m, bico__namer namer) {
  if (m == NULL) return;
  m->namer = namer;
  drop_analysis(m);
}

int bico__model_transposed(const bico_model *m, size_t i) {
  if (m == NULL || i >= m->nt) return 0;
  return bico__naming_transposed(m->naming, m->t[i].name, m->t[i].ndim);
}

static const char *const *containers_of(const bico_model *m) {
  return m->naming ? m->naming->containers : NULL;
}

/* ---- analysis ---- */

typedef struct cand {
  const char *s;
  size_t len;
} cand;

static int cand_cmp(const void *a, const void *b) {
  const cand *x = a, *y = b;
  size_t n = x->len < y->len ? x->len : y->len;
  int c = memcmp(x->s, y->s, n);
  if (c != 0) return c;
  return (x->len > y->len) - (x->len < y->len);
}

/* If name = prefix(plen) "." digits "." rest (or digits "." rest when
 * plen == 0), stores the block index and the offset of rest (or of the end
 * for a module "P.<j>" itself) and returns 1. */
static int split_block(const char *name, const char *prefix, size_t plen,
                       long *block, size_t *rest) {
  const char *p = name;
  if (plen > 0) {
    if (strncmp(name, prefix, plen) != 0 || name[plen] != '.') return 0;
    p = name + plen + 1;
  }
  if (!isdigit((unsigned char)*p)) return 0;
  const char *q = p;
  long v = 0;
  while (isdigit((unsigned char)*q)) {
    if (v > 100000000L) return 0;
    v = v * 10 + (*q - '0');
    q++;
  }
  if (*q != '.' && *q != '\0') return 0;
  if (q - p > 1 && *p == '0') return 0; /* "01" is not a block index */
  *block = v;
  *rest = (size_t)(q - name) + (*q == '.' ? 1 : 0);
  return 1;
}

static bico_status detect_blocks(bico_model *m) {
  bico_ctx *ctx = m->ctx;
  if (m->has_override) {
    size_t plen = strlen(m->override);
    long maxb = -1;
    for (size_t i = 0; i < m->nt; i++) {
      long b;
      size_t rest;
      if (split_block(m->t[i].name, m->override, plen, &b, &rest) &&
          m->t[i].name[rest] != '\0' && b > maxb)
        maxb = b;
    }
    if (maxb < 0)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "model: no tensor is named \"%s.<int>.<rest>\" (block "
                        "container given by the caller)",
                        m->override);
    m->prefix = bico__strndup(ctx, m->override, plen);
    if (m->prefix == NULL) return BICO_E_NOMEM;
    m->nblocks = (size_t)maxb + 1;
    return BICO_OK;
  }
  /* Every (tensor, prefix) where the component after the prefix is an
   * integer and something follows it. */
  size_t ncand = 0, cap = 0;
  for (size_t i = 0; i < m->nt; i++)
    for (const char *c = m->t[i].name; *c; c++)
      if (*c == '.') cap++;
  cand *cs = bico__alloc(ctx, (cap + 1) * sizeof *cs);
  if (cs == NULL) return BICO_E_NOMEM;
  for (size_t i = 0; i < m->nt; i++) {
    const char *name = m->t[i].name;
    size_t start = 0; /* start of the current component */
    for (size_t k = 0;; k++) {
      if (name[k] == '.' || name[k] == '\0') {
        int digits = k > start;
        for (size_t z = start; z < k; z++)
          if (!isdigit((unsigned char)name[z])) digits = 0;
        if (digits && name[k] == '.' && (k - start == 1 || name[start] != '0')) {
          cs[ncand].s = name;
          cs[ncand].len = start == 0 ? 0 : start - 1;
          ncand++;
        }
        if (name[k] == '\0') break;
        start = k + 1;
      }
    }
  }
  qsort(cs, ncand, sizeof *cs, cand_cmp);
  size_t best = NONE, bestn = 0;
  for (size_t i = 0; i < ncand;) {
    size_t j = i + 1;
    while (j < ncand && cand_cmp(&cs[i], &cs[j]) == 0) j++;
    size_t n = j - i;
    if (n > bestn || (n == bestn && best != NONE && cs[i].len < cs[best].len)) {
      best = i;
      bestn = n;
    }
    i = j;
  }
  bico_status st = BICO_OK;
  if (best != NONE) {
    m->prefix = bico__strndup(ctx, cs[best].s, cs[best].len);
    if (m->prefix == NULL) {
      st = BICO_E_NOMEM;
    } else {
      long maxb = -1;
      for (size_t i = 0; i < m->nt; i++) {
        long b;
        size_t rest;
        if (split_block(m->t[i].name, m->prefix, cs[best].len, &b, &rest) &&
            m->t[i].name[rest] != '\0' && b > maxb)
          maxb = b;
      }
      m->nblocks = (size_t)(maxb + 1);
    }
  }
  bico__free(ctx, cs);
  return st;
}

/* Block counts of the family's containers (CLIP's two towers); the
 * detected container stays the one bico_model_blocks reports. */
static void count_containers(bico_model *m) {
  const char *const *c = containers_of(m);
  for (size_t k = 0; k < 8; k++) m->cont_n[k] = 0;
  for (size_t k = 0; c != NULL && c[k] != NULL && k < 8; k++) {
    size_t plen = strlen(c[k]);
    for (size_t i = 0; i < m->nt; i++) {
      long b;
      size_t rest;
      if (split_block(m->t[i].name, c[k], plen, &b, &rest) &&
          m->t[i].name[rest] != '\0' && (size_t)b + 1 > m->cont_n[k])
        m->cont_n[k] = (size_t)b + 1;
    }
  }
}

/* The family container k whose blocks hold name (block index, offset of
 * the rest), or -1. */
static int in_container(const bico_model *m, const char *name, long *b,
                        size_t *rest) {
  const char *const *c = containers_of(m);
  for (int k = 0; c != NULL && c[k] != NULL && k < 8; k++)
    if (m->cont_n[k] > 0 && split_block(name, c[k], strlen(c[k]), b, rest))
      return k;
  return -1;
}

static const char *last_component(const char *s) {
  const char *d = strrchr(s, '.');
  return d ? d + 1 : s;
}

static int embedding_name(const char *module) {
  const char *c = last_component(module);
  if (strcmp(c, "wte") == 0 || strcmp(c, "wpe") == 0) return 1;
  return strstr(c, "embed") != NULL && strstr(c, "patch") == NULL;
}

static int mod_cmp_ctx_sort(const module_rec *mods, size_t a, size_t b) {
  return strcmp(mods[a].name, mods[b].name);
}

/* Sorts module indices by name (insertion into a merge sort would need a
 * context pointer that qsort lacks: a plain bottom-up merge sort). */
static bico_status sort_modules(bico_model *m) {
  size_t n = m->nm;
  m->mod_sorted = bico__alloc(m->ctx, (n ? n : 1) * sizeof(size_t));
  size_t *tmp = bico__alloc(m->ctx, (n ? n : 1) * sizeof(size_t));
  if (m->mod_sorted == NULL || tmp == NULL) {
    bico__free(m->ctx, tmp);
    return BICO_E_NOMEM;
  }
  size_t *a = m->mod_sorted, *b = tmp;
  for (size_t i = 0; i < n; i++) a[i] = i;
  for (size_t w = 1; w < n; w *= 2) {
    for (size_t lo = 0; lo < n; lo += 2 * w) {
      size_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
      size_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi)
        b[k++] = mod_cmp_ctx_sort(m->mods, a[i], a[j]) <= 0 ? a[i++] : a[j++];
      while (i < mid) b[k++] = a[i++];
      while (j < hi) b[k++] = a[j++];
    }
    size_t *s = a;
    a = b;
    b = s;
  }
  if (a != m->mod_sorted) {
    memcpy(m->mod_sorted, a, n * sizeof(size_t));
    bico__free(m->ctx, a);
  } else {
    bico__free(m->ctx, b);
  }
  return BICO_OK;
}

static size_t module_len(const char *name) {
  const char *d = strrchr(name, '.');
  return d ? (size_t)(d - name) : 0;
}

static bico_status build_modules(bico_model *m) {
  bico_ctx *ctx = m->ctx;
  size_t cap = m->nt ? m->nt : 1;
  m->mods = bico__calloc(ctx, cap, sizeof *m->mods);
  m->mod_tensors = bico__alloc(ctx, cap * sizeof(size_t));
  size_t *count = bico__calloc(ctx, cap, sizeof(size_t));
  if (m->mods == NULL || m->mod_tensors == NULL || count == NULL) {
    bico__free(ctx, count);
    return BICO_E_NOMEM;
  }
  /* Group: a small index from module name to module index. */
  bico__strindex h = {NULL, 0};
  bico_status st = bico__strindex_reserve(ctx, &h, cap, module_key, m);
  if (st != BICO_OK) {
    bico__free(ctx, count);
    return st;
  }
  for (size_t i = 0; i < m->nt && st == BICO_OK; i++) {
    const char *name = m->t[i].name;
    size_t len = module_len(name);
    size_t k = bico__strindex_find(&h, name, len, module_key, m);
    if (k == NONE) {
      module_rec *r = &m->mods[m->nm];
      r->name = bico__strndup(ctx, name, len);
      if (r->name == NULL) {
        st = BICO_E_NOMEM;
        break;
      }
      r->weight = NONE;
      r->block = -1;
      k = m->nm++;
      bico__strindex_insert(&h, k, module_key, m);
    }
    m->t[i].module = k;
    count[k]++;
  }
  bico__strindex_free(ctx, &h);
  if (st != BICO_OK) {
    bico__free(ctx, count);
    return st;
  }
  size_t off = 0;
  for (size_t i = 0; i < m->nm; i++) {
    m->mods[i].first = off;
    off += count[i];
    count[i] = 0;
  }
  for (size_t i = 0; i < m->nt; i++) {
    module_rec *r = &m->mods[m->t[i].module];
    m->mod_tensors[r->first + count[m->t[i].module]++] = i;
  }
  for (size_t i = 0; i < m->nm; i++) m->mods[i].count = count[i];
  bico__free(ctx, count);

  /* Kinds and roles. */
  size_t plen = m->prefix ? strlen(m->prefix) : 0;
  for (size_t i = 0; i < m->nm; i++) {
    module_rec *r = &m->mods[i];
    const int root = r->name[0] == '\0';
    size_t vec_len = 0;
    for (size_t k = 0; k < r->count; k++) {
      tensor_rec *t = &m->t[m->mod_tensors[r->first + k]];
      if (!is_float_dtype(t->dtype)) continue;
      if (bico__naming_role(m->naming, t->name, t->ndim) != 0) continue;
      if (!root && t->ndim >= 2 &&
          strcmp(last_component(t->name), "weight") == 0)
        r->weight = m->mod_tensors[r->first + k];
      if (t->ndim == 1 && vec_len == 0) vec_len = t->shape[0];
    }
    if (r->weight != NONE) {
      tensor_rec *w = &m->t[r->weight];
      r->kind = (w->ndim == 2 && embedding_name(r->name))
                    ? BICO_MODULE_EMBEDDING
                    : BICO_MODULE_LINEAR;
      if (bico__naming_transposed(m->naming, w->name, w->ndim)) {
        r->d_out = w->shape[1]; /* Conv1D: stored [in, out] */
        r->d_in = w->shape[0];
      } else {
        r->d_out = w->shape[0];
        r->d_in = 1;
        for (size_t d = 1; d < w->ndim; d++) r->d_in *= w->shape[d];
      }
    } else if (!root && vec_len > 0) {
      r->kind = BICO_MODULE_ELEMENTWISE;
      r->d_out = r->d_in = vec_len;
    } else {
      r->kind = BICO_MODULE_OTHER;
    }
    for (size_t k = 0; k < r->count; k++) {
      size_t ti = m->mod_tensors[r->first + k];
      tensor_rec *t = &m->t[ti];
      int role = BICO_ROLE_OTHER;
      int fam = bico__naming_role(m->naming, t->name, t->ndim);
      if (!is_float_dtype(t->dtype)) {
        role = BICO_ROLE_OTHER;
      } else if (fam != 0) {
        role = fam;
      } else if (ti == r->weight) {
        role = r->kind == BICO_MODULE_LINEAR ? BICO_ROLE_WEIGHT
                                             : BICO_ROLE_TOKEN;
      } else if (t->ndim >= 2) {
        role = BICO_ROLE_TOKEN;
      } else if (t->ndim == 1) {
        if (r->kind == BICO_MODULE_LINEAR && t->shape[0] == r->d_out)
          role = BICO_ROLE_BIAS;
        else if (r->kind == BICO_MODULE_ELEMENTWISE)
          role = BICO_ROLE_VECTOR;
      }
      t->role = role;
    }
    long b;
    size_t rest;
    if (m->prefix && split_block(r->name, m->prefix, plen, &b, &rest))
      r->block = b;
    else if (in_container(m, r->name, &b, &rest) >= 0)
      r->block = b;
  }
  return sort_modules(m);
}

/* Computes the cache on first use; the handle is logically const. */
static bico_status analyze(const bico_model *cm) {
  bico_model *m = (bico_model *)cm;
  if (m->analyzed) return BICO_OK;
  drop_analysis(m);
  /* A naming not handed in comes from the rule the constructor handed
   * (bico_model_create: the family table's name signatures), asked again
   * whenever the tensors change. */
  if (!m->naming_set) m->naming = m->namer ? m->namer(m) : NULL;
  bico_status st = detect_blocks(m);
  if (st == BICO_OK) count_containers(m);
  if (st == BICO_OK) st = build_modules(m);
  if (st != BICO_OK) {
    drop_analysis(m);
    return st;
  }
  m->analyzed = 1;
  return BICO_OK;
}

/* ---- queries ---- */

bico_status bico_model_tensor_count(const bico_model *m, size_t *n) {
  if (m == NULL) return BICO_E_NULL;
  if (n == NULL)
    return bico__fail(m->ctx, BICO_E_NULL, "model_tensor_count: n is NULL");
  *n = m->nt;
  return BICO_OK;
}

size_t bico__model_ntensors(const bico_model *m) { return m ? m->nt : 0; }

static bico_status check_tensor(const bico_model *m, const char *fn,
                                size_t i) {
  if (i >= m->nt)
    return bico__fail(m->ctx, BICO_E_ARG,
                      "%s: tensor index %zu out of range (model has %zu)", fn,
                      i, m->nt);
  return BICO_OK;
}

bico_status bico_model_tensor(const bico_model *m, size_t i, const char **name,
                              int *dtype, size_t *ndim, const size_t **shape) {
  if (m == NULL) return BICO_E_NULL;
  bico_status st = check_tensor(m, "model_tensor", i);
  if (st != BICO_OK) return st;
  if (name) *name = m->t[i].name;
  if (dtype) *dtype = m->t[i].dtype;
  if (ndim) *ndim = m->t[i].ndim;
  if (shape) *shape = m->t[i].shape;
  return BICO_OK;
}

bico_status bico_model_find_tensor(const bico_model *m, const char *name,
                                   size_t *i) {
  if (m == NULL) return BICO_E_NULL;
  if (name == NULL || i == NULL)
    return bico__fail(m->ctx, BICO_E_NULL, "model_find_tensor: %s is NULL",
                      name == NULL ? "name" : "i");
  size_t k = hash_find(m, name);
  if (k == NONE)
    return bico__fail(m->ctx, BICO_E_NOTFOUND,
                      "model_find_tensor: no tensor named %s", name);
  *i = k;
  return BICO_OK;
}

bico_status bico_model_tensor_module(const bico_model *m, size_t i,
                                     size_t *module, int *role) {
  if (m == NULL) return BICO_E_NULL;
  bico_status st = check_tensor(m, "model_tensor_module", i);
  if (st == BICO_OK) st = analyze(m);
  if (st != BICO_OK) return st;
  if (module) *module = m->t[i].module;
  if (role) *role = m->t[i].role;
  return BICO_OK;
}

bico_status bico_model_module_count(const bico_model *m, size_t *n) {
  if (m == NULL) return BICO_E_NULL;
  if (n == NULL)
    return bico__fail(m->ctx, BICO_E_NULL, "model_module_count: n is NULL");
  bico_status st = analyze(m);
  if (st == BICO_OK) *n = m->nm;
  return st;
}

static bico_status check_module(const bico_model *m, const char *fn,
                                size_t i) {
  bico_status st = analyze(m);
  if (st != BICO_OK) return st;
  if (i >= m->nm)
    return bico__fail(m->ctx, BICO_E_ARG,
                      "%s: module index %zu out of range (model has %zu)", fn,
                      i, m->nm);
  return BICO_OK;
}

bico_status bico_model_module(const bico_model *m, size_t i, const char **name,
                              int *kind, long *block, size_t *ntensors) {
  if (m == NULL) return BICO_E_NULL;
  bico_status st = check_module(m, "model_module", i);
  if (st != BICO_OK) return st;
  const module_rec *r = &m->mods[i];
  if (name) *name = r->name;
  if (kind) *kind = r->kind;
  if (block) *block = r->block;
  if (ntensors) *ntensors = r->count;
  return BICO_OK;
}

bico_status bico_model_module_tensor(const bico_model *m, size_t i, size_t k,
                                     size_t *tensor) {
  if (m == NULL) return BICO_E_NULL;
  if (tensor == NULL)
    return bico__fail(m->ctx, BICO_E_NULL,
                      "model_module_tensor: tensor is NULL");
  bico_status st = check_module(m, "model_module_tensor", i);
  if (st != BICO_OK) return st;
  if (k >= m->mods[i].count)
    return bico__fail(m->ctx, BICO_E_ARG,
                      "model_module_tensor: module %s has %zu tensors, asked "
                      "for number %zu",
                      m->mods[i].name, m->mods[i].count, k);
  *tensor = m->mod_tensors[m->mods[i].first + k];
  return BICO_OK;
}

bico_status bico_model_find_module(const bico_model *m, const char *name,
                                   size_t *i) {
  if (m == NULL) return BICO_E_NULL;
  if (name == NULL || i == NULL)
    return bico__fail(m->ctx, BICO_E_NULL, "model_find_module: %s is NULL",
                      name == NULL ? "name" : "i");
  bico_status st = analyze(m);
  if (st != BICO_OK) return st;
  size_t k = bico__sorted_find(m->mod_sorted, m->nm, name, module_key, m);
  if (k != NONE) {
    *i = k;
    return BICO_OK;
  }
  return bico__fail(m->ctx, BICO_E_NOTFOUND,
                    "model_find_module: no module named %s", name);
}

bico_status bico_model_module_dims(const bico_model *m, size_t i,
                                   size_t *d_out, size_t *d_in) {
  if (m == NULL) return BICO_E_NULL;
  bico_status st = check_module(m, "model_module_dims", i);
  if (st != BICO_OK) return st;
  const module_rec *r = &m->mods[i];
  if (r->kind != BICO_MODULE_LINEAR && r->kind != BICO_MODULE_ELEMENTWISE)
    return bico__fail(m->ctx, BICO_E_ARG,
                      "model_module_dims: module %s is neither linear nor "
                      "element-wise",
                      r->name);
  if (d_out) *d_out = r->d_out;
  if (d_in) *d_in = r->d_in;
  return BICO_OK;
}

bico_status bico_model_blocks(const bico_model *m, const char **prefix,
                              size_t *count) {
  if (m == NULL) return BICO_E_NULL;
  bico_status st = analyze(m);
  if (st != BICO_OK) return st;
  if (prefix) *prefix = m->prefix;
  if (count) *count = m->prefix ? m->nblocks : 0;
  return BICO_OK;
}

bico_status bico_model_map_name(const bico_model *target,
                                const bico_model *source, const char *name,
                                char *buf, size_t cap, size_t *len) {
  if (target == NULL) return BICO_E_NULL;
  bico_ctx *ctx = target->ctx;
  if (source == NULL || name == NULL || buf == NULL)
    return bico__fail(ctx, BICO_E_NULL, "model_map_name: %s is NULL",
                      source == NULL ? "source" : name == NULL ? "name" : "buf");
  bico_status st = analyze(target);
  if (st == BICO_OK) st = analyze(source);
  if (st != BICO_OK) return st;
  long j;
  size_t rest;
  size_t n;
  int k = in_container(target, name, &j, &rest);
  if (k >= 0 && containers_of(source) == containers_of(target)) {
    /* A family with several containers (CLIP's towers): each maps by the
     * depth map of its own block counts. */
    const char *cp = containers_of(target)[k];
    if (source->cont_n[k] == 0)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "model_map_name: %s lies in the target's blocks (%s) "
                        "but the source has none there",
                        name, cp);
    if ((size_t)j >= target->cont_n[k])
      return bico__fail(ctx, BICO_E_ARG,
                        "model_map_name: %s names target block %ld, out of "
                        "range (%zu blocks)",
                        name, j, target->cont_n[k]);
    size_t i = bico__depth_source(source->cont_n[k], target->cont_n[k],
                                  (size_t)j);
    const char *tail = name + rest;
    n = (size_t)snprintf(buf, cap, "%s.%zu%s%s", cp, i, *tail ? "." : "",
                         tail);
  } else if (target->prefix &&
      split_block(name, target->prefix, strlen(target->prefix), &j, &rest)) {
    if (source->prefix == NULL)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "model_map_name: %s lies in the target's blocks (%s) "
                        "but the source has no repeated blocks",
                        name, target->prefix);
    if ((size_t)j >= target->nblocks)
      return bico__fail(ctx, BICO_E_ARG,
                        "model_map_name: %s names target block %ld, out of "
                        "range (%zu blocks)",
                        name, j, target->nblocks);
    size_t i = bico__depth_source(source->nblocks, target->nblocks, (size_t)j);
    const char *tail = name + rest;
    int w;
    if (source->prefix[0] == '\0')
      w = snprintf(buf, cap, "%zu%s%s", i, *tail ? "." : "", tail);
    else
      w = snprintf(buf, cap, "%s.%zu%s%s", source->prefix, i, *tail ? "." : "",
                   tail);
    n = (size_t)w;
  } else {
    n = strlen(name);
    if (n < cap) memcpy(buf, name, n + 1);
  }
  if (n >= cap) {
    if (cap > 0) buf[0] = '\0';
    return bico__fail(ctx, BICO_E_ARG,
                      "model_map_name: buffer of %zu bytes too small for the "
                      "source name of %s (%zu bytes)",
                      cap, name, n + 1);
  }
  if (len) *len = n;
  return BICO_OK;
}

/* Maps `name` into a fresh heap buffer (NULL and a status on failure). */
static bico_status map_alloc(const bico_model *target, const bico_model *source,
                             const char *name, char **out) {
  size_t cap = strlen(name) + 64;
  char *buf = bico__alloc(target->ctx, cap);
  if (buf == NULL) return BICO_E_NOMEM;
  bico_status st = bico_model_map_name(target, source, name, buf, cap, NULL);
  if (st != BICO_OK) {
    bico__free(target->ctx, buf);
    return st;
  }
  *out = buf;
  return BICO_OK;
}

bico_status bico_model_pair_module(const bico_model *target, size_t i,
                                   const bico_model *source,
                                   size_t *source_module) {
  if (target == NULL) return BICO_E_NULL;
  if (source == NULL || source_module == NULL)
    return bico__fail(target->ctx, BICO_E_NULL,
                      "model_pair_module: %s is NULL",
                      source == NULL ? "source" : "source_module");
  bico_status st = check_module(target, "model_pair_module", i);
  if (st != BICO_OK) return st;
  char *name;
  st = map_alloc(target, source, target->mods[i].name, &name);
  if (st != BICO_OK) return st;
  st = bico_model_find_module(source, name, source_module);
  if (st == BICO_E_NOTFOUND)
    bico__fail(target->ctx, st,
               "model_pair_module: target module %s pairs with source module "
               "%s, which the source lacks",
               target->mods[i].name, name);
  bico__free(target->ctx, name);
  return st;
}

bico_status bico_model_pair_tensor(const bico_model *target, size_t i,
                                   const bico_model *source,
                                   size_t *source_tensor) {
  if (target == NULL) return BICO_E_NULL;
  if (source == NULL || source_tensor == NULL)
    return bico__fail(target->ctx, BICO_E_NULL,
                      "model_pair_tensor: %s is NULL",
                      source == NULL ? "source" : "source_tensor");
  bico_status st = check_tensor(target, "model_pair_tensor", i);
  if (st != BICO_OK) return st;
  char *name;
  st = map_alloc(target, source, target->t[i].name, &name);
  if (st != BICO_OK) return st;
  size_t k = hash_find(source, name);
  if (k == NONE)
    st = bico__fail(target->ctx, BICO_E_NOTFOUND,
                    "model_pair_tensor: target tensor %s pairs with source "
                    "tensor %s, which the source lacks",
                    target->t[i].name, name);
  else
    *source_tensor = k;
  bico__free(target->ctx, name);
  return st;
}
