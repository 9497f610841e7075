/* PEFT LoRA adapters on disk: adapter_config.json and
 * adapter_model.safetensors, read with every check and written
 * atomically (both files committed together). */
#include <errno.h>
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "json.h"
#include "lora_impl.h"
#include "lora_internal.h"
#include "report.h"
#include "strindex.h"


/* ==================================================================== */
/* Reading                                                                */

/* adapter_config.json: small, and never a FIFO (lib/io/input.c). */
static bico_status read_text(bico_ctx *ctx, const char *path, char **out,
                             size_t *len) {
  return bico__read_file(ctx, "lora_open", "adapter config", path,
                         (size_t)64 << 20, out, len);
}

typedef struct config {
  size_t r;
  double alpha;
  const bico__json *rank_pattern, *alpha_pattern, *to_save;
  /* target_modules (PEFT's rule for which modules get an adapter): a list
   * of names, a regular expression (re compiled), "all-linear", or NULL
   * (none given: every module with factors). */
  const bico__json *targets;
  int all_linear, have_re;
  regex_t re;
  bico__strindex tix; /* a list's entries, looked up by each dotted suffix
                         of a module's name: linear in the modules (a
                         scan of the list per module made an adapter of 40k
                         modules, which lists them all, quadratic) */
} config;

/* Fields that describe training or provenance, not the weights. */
static const char *const HARMLESS[] = {
    "revision",        "inference_mode",  "init_lora_weights",
    "auto_mapping",    "layers_to_transform", "layers_pattern",
    "exclude_modules", "loftq_config",    "eva_config",    "corda_config",
    "megatron_config", "megatron_core",   "runtime_config", "peft_version",
    /* only read with use_qalora, whose true value is refused */
    "qalora_group_size"};

static int is_empty_value(const bico__json *v) {
  switch (v->type) {
    case BICO__JSON_NULL: return 1;
    case BICO__JSON_BOOL: return !v->u.b;
    case BICO__JSON_ARRAY:
    case BICO__JSON_OBJECT: return v->n == 0;
    default: return 0;
  }
}

static int positive_number(const bico__json *v, double *x) {
  if (v->type == BICO__JSON_INT) *x = (double)v->u.i;
  else if (v->type == BICO__JSON_REAL) *x = v->u.d;
  else return 0;
  return isfinite(*x) && *x > 0;
}

static bico_status check_pattern(bico_ctx *ctx, const char *path,
                                 const char *field, const bico__json *v,
                                 int integral) {
  if (v->type == BICO__JSON_NULL) return BICO_OK;
  if (v->type != BICO__JSON_OBJECT)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "lora_open: %s: field %s should be an object, not %s",
                      path, field, bico__json_type_name(v->type));
  for (size_t i = 0; i < v->n; i++) {
    const bico__json_member *m = &v->u.members[i];
    double x;
    if (strpbrk(m->key, "*+?()[]{}|^$\\") != NULL)
      return bico__fail(ctx, BICO_E_UNSUPPORTED,
                        "lora_open: %s: field %s: key \"%s\" is a regular "
                        "expression; only module names (matched as suffixes) "
                        "are supported",
                        path, field, m->key);
    if (!positive_number(&m->value, &x) ||
        (integral && m->value.type != BICO__JSON_INT))
      return bico__fail(ctx, BICO_E_FORMAT,
                        "lora_open: %s: field %s: value of \"%s\" should be a "
                        "positive %s",
                        path, field, m->key, integral ? "integer" : "number");
  }
  return BICO_OK;
}

/* The size of a target_modules expression once compiled, estimated the
 * way glibc's regcomp builds it: `x+` holds x twice, `x{m,n}` n times,
 * `*` and `?` once; an expression over REGEX_NODES (a nested `((a+)+)+`,
 * a bounded repeat of a bounded repeat) would take memory exponential in
 * its length, so it is refused before regcomp sees it.  A quantifier
 * that follows another (`a++`, `a*{2}`) is refused too: Python reads it
 * as a possessive quantifier or refuses it ("multiple repeat"), POSIX
 * leaves it undefined.  Returns NULL, or what is wrong. */
#define REGEX_NODES (1 << 16)
#define REGEX_DEPTH 64

/* At p, a bound {m}, {m,} or {m,n}: the most times it repeats (m + 1 for
 * {m,}: one more copy and a star), its closing brace in *end; 0 when p is
 * no bound (a literal brace). */
static double bound(const char *p, const char **end) {
  if (*p != '{') return 0;
  char *e;
  const char *q = p + 1;
  if (*q < '0' || *q > '9') return 0;
  double m = (double)strtoul(q, &e, 10), n = m;
  if (*e == ',') {
    if (e[1] == '}') {
      n = m + 1;
      e++;
    } else if (e[1] >= '0' && e[1] <= '9') {
      n = (double)strtoul(e + 1, &e, 10);
    } else {
      return 0;
    }
  }
  if (*e != '}') return 0;
  if (end != NULL) *end = e;
  return n > m ? n : (m > 0 ? m : 1);
}

static const char *regex_too_large(const char *s) {
  double size[REGEX_DEPTH + 1] = {0}; /* each open group's size so far */
  double last = 0;                    /* the last atom's size; 0: none */
  int depth = 0, quantified = 0;
  for (const char *p = s; *p; p++) {
    double add = 0;
    int quant = 0;
    if (*p == '\\') {
      if (p[1]) p++;
      last = 1, add = 1;
    } else if (*p == '[') { /* a bracket expression is one atom */
      const char *q = p + 1;
      if (*q == '^') q++;
      if (*q == ']') q++;
      while (*q && *q != ']') q++;
      if (*q == '\0') return NULL; /* regcomp reports the missing ] */
      p = q;
      last = 1, add = 1;
    } else if (*p == '(') {
      if (depth == REGEX_DEPTH) return "groups nested too deep";
      size[++depth] = 0;
      last = 0;
    } else if (*p == ')' && depth > 0) {
      last = size[depth--] + 1, add = last;
    } else if (*p == '|') {
      last = 0, add = 1;
    } else if (*p == '*' || *p == '?' || *p == '+' || bound(p, NULL)) {
      double times = *p == '+' ? 2 : 1;
      if (*p == '{') {
        const char *end;
        times = bound(p, &end);
        p = end;
      }
      if (quantified) return "a repetition of a repetition";
      quant = 1;
      add = last * (times - 1);
      last *= times;
    } else {
      last = 1, add = 1;
    }
    quantified = quant;
    size[depth] += add;
    if (size[depth] > REGEX_NODES || last > REGEX_NODES)
      return "too large once compiled";
  }
  return NULL;
}

/* target_modules as a string: PEFT takes it as a Python regular
 * expression that must match a module's whole name (re.fullmatch), or as
 * the shorthand "all-linear".  Read here as a POSIX extended expression
 * anchored at both ends, which accepts the same names for the expressions
 * both dialects share; Python's own syntax (\d, \w, \s, \b, (?...),
 * lazy quantifiers) is refused rather than read otherwise. */
static bico_status target_regex(bico_ctx *ctx, const char *path,
                                const char *s, config *c) {
  static const char *const PY[] = {"\\d", "\\D", "\\w", "\\W", "\\s",
                                   "\\S", "\\b", "\\B", "\\A", "\\Z",
                                   "(?",  "*?",  "+?",  "??",  "}?"};
  if (strcmp(s, "all-linear") == 0) {
    c->all_linear = 1;
    return BICO_OK;
  }
  for (size_t i = 0; i < sizeof PY / sizeof *PY; i++)
    if (strstr(s, PY[i]) != NULL)
      return bico__fail(ctx, BICO_E_UNSUPPORTED,
                        "lora_open: %s: target_modules \"%s\" uses %s, a "
                        "Python regular expression feature that POSIX "
                        "extended expressions do not have; list the modules "
                        "instead",
                        path, s, PY[i]);
  const char *large = regex_too_large(s);
  if (large != NULL)
    return bico__fail(ctx, BICO_E_UNSUPPORTED,
                      "lora_open: %s: target_modules \"%.200s%s\": %s (at "
                      "most %d pieces); list the modules instead",
                      path, s, strlen(s) > 200 ? "..." : "", large,
                      REGEX_NODES);
  size_t n = strlen(s);
  char *full = bico__alloc(ctx, n + 5);
  if (full == NULL) return BICO_E_NOMEM;
  snprintf(full, n + 5, "^(%s)$", s);
  int e = regcomp(&c->re, full, REG_EXTENDED | REG_NOSUB);
  bico__free(ctx, full);
  if (e != 0) {
    char why[128];
    regerror(e, NULL, why, sizeof why);
    return bico__fail(ctx, BICO_E_FORMAT,
                      "lora_open: %s: target_modules \"%s\" is not a "
                      "regular expression: %s",
                      path, s, why);
  }
  c->have_re = 1;
  return BICO_OK;
}

static const char *target_key(const void *owner, size_t i) {
  return ((const bico__json *)owner)->u.items[i].u.s;
}

static bico_status parse_targets(bico_ctx *ctx, const char *path,
                                 const bico__json *v, config *c) {
  if (v->type == BICO__JSON_NULL) return BICO_OK;
  if (v->type == BICO__JSON_STRING) {
    c->targets = v;
    return target_regex(ctx, path, v->u.s, c);
  }
  if (v->type != BICO__JSON_ARRAY)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "lora_open: %s: field target_modules should be a list "
                      "of module names or a string, not %s",
                      path, bico__json_type_name(v->type));
  for (size_t j = 0; j < v->n; j++)
    if (v->u.items[j].type != BICO__JSON_STRING || v->u.items[j].n == 0 ||
        strlen(v->u.items[j].u.s) != v->u.items[j].n)
      return bico__fail(ctx, BICO_E_FORMAT,
                        "lora_open: %s: target_modules entry %zu is not a "
                        "module name",
                        path, j);
  c->targets = v;
  bico_status st = bico__strindex_reserve(ctx, &c->tix, v->n, target_key, v);
  for (size_t j = 0; j < v->n && st == BICO_OK; j++)
    if (bico__strindex_find(&c->tix, v->u.items[j].u.s, v->u.items[j].n,
                            target_key, v) == SIZE_MAX)
      bico__strindex_insert(&c->tix, j, target_key, v);
  return st;
}

/* PEFT's rule (check_target_module_exists): a list names a module when
 * an entry equals its name or is a dotted suffix of it; a string is a
 * regular expression its whole name matches; "all-linear" names every
 * linear module but the output layer (lm_head).  No target_modules: every
 * module the file has factors for. */
static int targeted(const config *c, const char *module, int kind) {
  if (c->targets == NULL) return 1;
  if (c->all_linear) {
    const char *last = strrchr(module, '.');
    return kind == BICO_LORA_LINEAR && strcmp(last ? last + 1 : module, "lm_head") != 0;
  }
  if (c->have_re) return regexec(&c->re, module, 0, NULL, 0) == 0;
  /* the name itself, then each suffix after a dot */
  for (const char *s = module; s != NULL;) {
    if (bico__strindex_find(&c->tix, s, strlen(s), target_key, c->targets) !=
        SIZE_MAX)
      return 1;
    s = strchr(s, '.');
    if (s != NULL) s++;
  }
  return 0;
}

static bico_status parse_config(bico_lora *l, const char *path,
                                const bico__json *root, config *c) {
  bico_ctx *ctx = l->ctx;
  memset(c, 0, sizeof *c);
  if (root->type != BICO__JSON_OBJECT)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "lora_open: %s: the config is %s, not an object", path,
                      bico__json_type_name(root->type));
  int have_r = 0, have_alpha = 0;
  for (size_t i = 0; i < root->n; i++) {
    const char *k = root->u.members[i].key;
    const bico__json *v = &root->u.members[i].value;
    bico_status st = BICO_OK;
    double x;
    if (strcmp(k, "peft_type") == 0) {
      if (v->type != BICO__JSON_STRING || strcmp(v->u.s, "LORA") != 0)
        return bico__fail(ctx, BICO_E_UNSUPPORTED,
                          "lora_open: %s: peft_type is %s%s%s; only \"LORA\" "
                          "adapters are supported",
                          path, v->type == BICO__JSON_STRING ? "\"" : "",
                          v->type == BICO__JSON_STRING
                              ? v->u.s
                              : bico__json_type_name(v->type),
                          v->type == BICO__JSON_STRING ? "\"" : "");
    } else if (strcmp(k, "r") == 0) {
      if (v->type != BICO__JSON_INT || v->u.i < 1)
        return bico__fail(ctx, BICO_E_FORMAT,
                          "lora_open: %s: field r should be a positive integer",
                          path);
      c->r = (size_t)v->u.i;
      have_r = 1;
    } else if (strcmp(k, "lora_dropout") == 0) {
      /* training only, but a carried adapter keeps it for further tuning */
      if (v->type == BICO__JSON_INT) l->dropout = (double)v->u.i;
      else if (v->type == BICO__JSON_REAL) l->dropout = v->u.d;
      if (!(l->dropout >= 0 && l->dropout < 1)) l->dropout = 0;
    } else if (strcmp(k, "lora_alpha") == 0) {
      if (!positive_number(v, &x))
        return bico__fail(ctx, BICO_E_FORMAT,
                          "lora_open: %s: field lora_alpha should be a "
                          "positive number",
                          path);
      c->alpha = x;
      have_alpha = 1;
    } else if (strcmp(k, "use_rslora") == 0 ||
               strcmp(k, "fan_in_fan_out") == 0) {
      if (v->type != BICO__JSON_BOOL)
        return bico__fail(ctx, BICO_E_FORMAT,
                          "lora_open: %s: field %s should be true or false",
                          path, k);
      if (k[0] == 'u') l->rslora = v->u.b;
      else l->fifo = v->u.b;
    } else if (strcmp(k, "target_modules") == 0) {
      st = parse_targets(ctx, path, v, c);
    } else if (strcmp(k, "rank_pattern") == 0) {
      st = check_pattern(ctx, path, k, v, 1);
      c->rank_pattern = v;
    } else if (strcmp(k, "alpha_pattern") == 0) {
      st = check_pattern(ctx, path, k, v, 0);
      c->alpha_pattern = v;
    } else if (strcmp(k, "modules_to_save") == 0) {
      if (v->type != BICO__JSON_NULL) {
        if (v->type != BICO__JSON_ARRAY)
          return bico__fail(ctx, BICO_E_FORMAT,
                            "lora_open: %s: field modules_to_save should be "
                            "a list of module names",
                            path);
        for (size_t j = 0; j < v->n; j++)
          if (v->u.items[j].type != BICO__JSON_STRING ||
              v->u.items[j].n == 0)
            return bico__fail(ctx, BICO_E_FORMAT,
                              "lora_open: %s: modules_to_save entry %zu is "
                              "not a module name",
                              path, j);
        c->to_save = v;
      }
    } else if (strcmp(k, "use_dora") == 0) {
      if (v->type != BICO__JSON_BOOL || v->u.b)
        return bico__fail(ctx, BICO_E_UNSUPPORTED,
                          "lora_open: %s: field use_dora is true: DoRA "
                          "adapters (magnitude vectors) are not supported",
                          path);
    } else if (strcmp(k, "bias") == 0) {
      if (v->type != BICO__JSON_STRING || strcmp(v->u.s, "none") != 0)
        return bico__fail(ctx, BICO_E_UNSUPPORTED,
                          "lora_open: %s: field bias is %s%s%s: trained bias "
                          "tensors in an adapter are not supported (only "
                          "\"none\")",
                          path, v->type == BICO__JSON_STRING ? "\"" : "",
                          v->type == BICO__JSON_STRING
                              ? v->u.s
                              : bico__json_type_name(v->type),
                          v->type == BICO__JSON_STRING ? "\"" : "");
    } else if (strcmp(k, "task_type") == 0 ||
               strcmp(k, "base_model_name_or_path") == 0) {
      if (v->type == BICO__JSON_STRING) {
        int which = k[0] == 't' ? BICO_LORA_TASK_TYPE : BICO_LORA_BASE_MODEL;
        char *p = bico__strdup(ctx, v->u.s);
        if (p == NULL) return BICO_E_NOMEM;
        bico__free(ctx, l->strings[which]);
        l->strings[which] = p;
      } else if (v->type != BICO__JSON_NULL) {
        return bico__fail(ctx, BICO_E_FORMAT,
                          "lora_open: %s: field %s should be a string or null",
                          path, k);
      }
    } else {
      int harmless = 0;
      for (size_t h = 0; h < sizeof HARMLESS / sizeof *HARMLESS; h++)
        if (strcmp(k, HARMLESS[h]) == 0) harmless = 1;
      /* Anything else may change what the weights mean: only its default
       * (null, false, empty) is safe to pass over. */
      if (!harmless && !is_empty_value(v))
        return bico__fail(ctx, BICO_E_UNSUPPORTED,
                          "lora_open: %s: field %s is set (%s) and this "
                          "version does not implement it; refusing rather "
                          "than ignoring it",
                          path, k, bico__json_type_name(v->type));
    }
    if (st != BICO_OK) return st;
  }
  if (!have_r || !have_alpha)
    return bico__fail(ctx, BICO_E_FORMAT, "lora_open: %s: field %s is missing",
                      path, have_r ? "lora_alpha" : "r");
  return BICO_OK;
}

/* The pattern entry for module `name`: a key equal to it or a dotted suffix
 * of it (the first such key, as PEFT takes). */
/* A rank_pattern / alpha_pattern object with a hash of its keys: the
 * entry for a module is the first key (in the object's order) that is the
 * module's name or a '.'-separated suffix of it, as PEFT takes.  Looking
 * up each suffix keeps this linear in the modules; scanning every key per
 * module was quadratic for adapters with large patterns. */
typedef struct patidx {
  const bico__json *p;
  bico__strindex ix;
} patidx;

static const char *pat_key(const void *owner, size_t i) {
  return ((const bico__json *)owner)->u.members[i].key;
}

static bico_status patidx_init(bico_ctx *ctx, const bico__json *p,
                               patidx *x) {
  x->p = p != NULL && p->type == BICO__JSON_OBJECT ? p : NULL;
  x->ix.slot = NULL;
  x->ix.cap = 0;
  if (x->p == NULL || x->p->n == 0) return BICO_OK;
  bico_status st = bico__strindex_reserve(ctx, &x->ix, x->p->n, pat_key, x->p);
  for (size_t i = 0; i < x->p->n && st == BICO_OK; i++)
    if (strlen(x->p->u.members[i].key) == x->p->u.members[i].key_len)
      bico__strindex_insert(&x->ix, i, pat_key, x->p);
  return st;
}

static const bico__json_member *pattern_for(const patidx *x,
                                            const char *name) {
  if (x->p == NULL || x->ix.cap == 0) return NULL;
  size_t best = SIZE_MAX;
  for (const char *s = name; s != NULL;) {
    size_t k = bico__strindex_find(&x->ix, s, strlen(s), pat_key, x->p);
    if (k < best) best = k;
    s = strchr(s, '.');
    if (s != NULL) s++;
  }
  return best == SIZE_MAX ? NULL : &x->p->u.members[best];
}

static int saved_module(const config *c, const char *module) {
  if (c->to_save == NULL) return 0;
  size_t n = strlen(module);
  for (size_t j = 0; j < c->to_save->n; j++) {
    const char *e = c->to_save->u.items[j].u.s;
    size_t k = strlen(e);
    if (k > n || strcmp(module + n - k, e) != 0) continue;
    if (k == n || module[n - k - 1] == '.') return 1;
  }
  return 0;
}

static int ends_with(const char *s, size_t n, const char *suf, size_t *cut) {
  size_t k = strlen(suf);
  if (k >= n || memcmp(s + n - k, suf, k) != 0) return 0;
  *cut = n - k;
  return 1;
}

typedef struct pending {
  char *module;
  int kind;
  size_t ia, ib; /* tensor indices, SIZE_MAX when absent */
} pending;

static const char *pend_key(const void *owner, size_t i) {
  return ((const pending *)owner)[i].module;
}

static bico_status load_factor(bico_lora *l, const bico_stfile *f,
                               const char *path, size_t idx, float **out,
                               size_t numel) {
  bico_ctx *ctx = l->ctx;
  float *p = bico__alloc(ctx, numel * sizeof(float));
  if (p == NULL) return BICO_E_NOMEM;
  bico_status st = bico_stfile_read_f32(f, idx, p, numel);
  if (st == BICO_OK) st = bico_stfile_check_finite(f, idx);
  if (st != BICO_OK) {
    bico__free(ctx, p);
    (void)path;
    return st;
  }
  *out = p;
  return BICO_OK;
}

/* Each module's A and B: present, shapes agreeing with each other and
 * with the config's rank, then loaded. */
static bico_status pair_factors(bico_lora *l, const char *path,
                                const bico_stfile *f, const config *c,
                                const pending *pend, size_t np) {
  bico_ctx *ctx = l->ctx;
  patidx pats[2];
  bico_status st = patidx_init(ctx, c->rank_pattern, &pats[0]);
  bico_status s2 = patidx_init(ctx, c->alpha_pattern, &pats[1]);
  if (st == BICO_OK) st = s2;
  for (size_t p = 0; p < np && st == BICO_OK; p++) {
    const pending *e = &pend[p];
    const char *an = e->kind == BICO_LORA_LINEAR ? "lora_A" : "lora_embedding_A";
    const char *bn = e->kind == BICO_LORA_LINEAR ? "lora_B" : "lora_embedding_B";
    if (!targeted(c, e->module, e->kind)) {
      /* PEFT adapts only the modules target_modules names and passes over
       * other factors; applying them would change what the adapter does,
       * dropping them would lose weights without a word. */
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "lora_open: %s: module %s has LoRA factors but "
                      "target_modules does not name it (PEFT would not apply "
                      "them): name it in target_modules, or remove its "
                      "factors",
                      path, e->module);
      break;
    }
    if (e->ia == SIZE_MAX || e->ib == SIZE_MAX) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "lora_open: %s: module %s has %s but no %s", path,
                      e->module, e->ia == SIZE_MAX ? bn : an,
                      e->ia == SIZE_MAX ? an : bn);
      break;
    }
    const size_t *sa, *sb;
    bico_stfile_tensor_info(f, e->ia, NULL, NULL, NULL, &sa);
    bico_stfile_tensor_info(f, e->ib, NULL, NULL, NULL, &sb);
    size_t r = sa[0], din = sa[1], dout = sb[0];
    if (sb[1] != r || r == 0 || din == 0 || dout == 0) {
      st = bico__fail(ctx, BICO_E_SHAPE,
                      "lora_open: %s: module %s: %s is [%zu, %zu] and %s "
                      "[%zu, %zu]; their ranks must agree and be non-zero",
                      path, e->module, an, sa[0], sa[1], bn, sb[0], sb[1]);
      break;
    }
    const bico__json_member *rp = pattern_for(&pats[0], e->module);
    const bico__json_member *ap = pattern_for(&pats[1], e->module);
    size_t rc = rp ? (size_t)rp->value.u.i : c->r;
    double alpha = c->alpha;
    if (ap) positive_number(&ap->value, &alpha);
    if (rc != r) {
      st = bico__fail(ctx, BICO_E_SHAPE,
                      "lora_open: %s: module %s: the factors have rank %zu but "
                      "the config gives r = %zu%s%s%s",
                      path, e->module, r, rc,
                      rp ? " (rank_pattern key \"" : "",
                      rp ? rp->key : "", rp ? "\")" : "");
      break;
    }
    float *a = NULL, *b = NULL;
    st = load_factor(l, f, path, e->ia, &a, r * din);
    if (st == BICO_OK) st = load_factor(l, f, path, e->ib, &b, dout * r);
    char *nm = st == BICO_OK ? bico__strdup(ctx, e->module) : NULL;
    if (st == BICO_OK && nm == NULL) st = BICO_E_NOMEM;
    if (st != BICO_OK) {
      bico__free(ctx, a);
      bico__free(ctx, b);
      break;
    }
    st = bico__lora_push_module(l, nm, e->kind, r, alpha, dout, din, b, a);
  }
  bico__strindex_free(ctx, &pats[0].ix);
  bico__strindex_free(ctx, &pats[1].ix);
  return st;
}

static bico_status load_tensors(bico_lora *l, const char *path,
                                const bico_stfile *f, const config *c) {
  bico_ctx *ctx = l->ctx;
  size_t nt = bico__stfile_ntensors(f), np = 0;
  pending *pend = bico__calloc(ctx, nt ? nt : 1, sizeof *pend);
  if (pend == NULL) return BICO_E_NOMEM;
  bico__strindex ix = {NULL, 0};
  bico_status st = BICO_OK;
  static const struct {
    const char *suffix;
    int kind, is_a;
  } FACT[4] = {{".lora_A.weight", BICO_LORA_LINEAR, 1},
               {".lora_B.weight", BICO_LORA_LINEAR, 0},
               {".lora_embedding_A", BICO_LORA_EMBEDDING, 1},
               {".lora_embedding_B", BICO_LORA_EMBEDDING, 0}};
  for (size_t t = 0; t < nt && st == BICO_OK; t++) {
    const char *name;
    size_t ndim, numel;
    const size_t *shape;
    st = bico_stfile_tensor_info(f, t, &name, NULL, &ndim, &shape);
    if (st == BICO_OK) st = bico_stfile_tensor_size(f, t, &numel, NULL);
    if (st != BICO_OK) break;
    if (strncmp(name, PREFIX, PREFIX_LEN) != 0 || name[PREFIX_LEN] == '\0') {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "lora_open: %s: tensor %s does not start with \"%s\"",
                      path, name, PREFIX);
      break;
    }
    const char *rest = name + PREFIX_LEN;
    size_t n = strlen(rest), cut = 0;
    if (strstr(rest, "lora_magnitude_vector") != NULL) {
      st = bico__fail(ctx, BICO_E_UNSUPPORTED,
                      "lora_open: %s: tensor %s is a DoRA magnitude vector; "
                      "DoRA adapters are not supported",
                      path, name);
      break;
    }
    int fi = -1;
    for (int q = 0; q < 4 && fi < 0; q++)
      if (ends_with(rest, n, FACT[q].suffix, &cut)) fi = q;
    if (fi < 0) {
      const char *dot = strrchr(rest, '.');
      char *module = dot ? bico__strndup(ctx, rest, (size_t)(dot - rest)) : NULL;
      if (dot != NULL && module == NULL) {
        st = BICO_E_NOMEM;
        break;
      }
      if (module == NULL || strstr(rest, ".lora_") != NULL ||
          !saved_module(c, module)) {
        st = bico__fail(ctx, BICO_E_FORMAT,
                        "lora_open: %s: tensor %s is neither a LoRA factor "
                        "nor part of a module in modules_to_save",
                        path, name);
        bico__free(ctx, module);
        break;
      }
      float *data = NULL;
      if (numel == 0) {
        data = bico__calloc(ctx, 1, sizeof(float));
        if (data == NULL) st = BICO_E_NOMEM;
      } else {
        st = load_factor(l, f, path, t, &data, numel);
      }

      if (st == BICO_OK)
        st = bico__lora_push_saved(l, rest, module, ndim, shape, numel, data);
      bico__free(ctx, module);
      continue;
    }
    if (ndim != 2) {
      st = bico__fail(ctx, BICO_E_SHAPE,
                      "lora_open: %s: factor %s has %zu dimensions, expected 2",
                      path, name, ndim);
      break;
    }
    /* A hash of the modules seen: a linear search made 40k modules
     * quadratic. */
    size_t p = bico__strindex_find(&ix, rest, cut, pend_key, pend);
    if (p == SIZE_MAX) {
      p = np;
      pend[np].module = bico__strndup(ctx, rest, cut);
      if (pend[np].module == NULL) {
        st = BICO_E_NOMEM;
        break;
      }
      pend[np].kind = FACT[fi].kind;
      pend[np].ia = pend[np].ib = SIZE_MAX;
      np++;
      st = bico__strindex_reserve(ctx, &ix, np, pend_key, pend);
      if (st != BICO_OK) break;
      bico__strindex_insert(&ix, p, pend_key, pend);
    }
    if (pend[p].kind != FACT[fi].kind) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "lora_open: %s: module %s has both linear and embedding "
                      "factors",
                      path, pend[p].module);
      break;
    }
    if (FACT[fi].is_a) pend[p].ia = t;
    else pend[p].ib = t;
  }
  if (st == BICO_OK) st = pair_factors(l, path, f, c, pend, np);
  for (size_t p = 0; p < np; p++) bico__free(ctx, pend[p].module);
  bico__free(ctx, pend);
  bico__strindex_free(ctx, &ix);
  return st;
}

#define join bico__path_join

/* An adapter is a folder: a file given in its place (its weights file, its
 * config, a checkpoint) is named with the folder to give instead. */
static bico_status not_a_folder(bico_ctx *ctx, const char *dir) {
  struct stat sb;
  if (stat(dir, &sb) != 0 || S_ISDIR(sb.st_mode)) return BICO_OK;
  const char *base = strrchr(dir, '/');
  base = base ? base + 1 : dir;
  if (strcmp(base, "adapter_model.safetensors") == 0 ||
      strcmp(base, "adapter_config.json") == 0 ||
      strcmp(base, "adapter_model.bin") == 0) {
    size_t n = (size_t)(base - dir); /* "ad/x": the folder is "ad" */
    return bico__fail(ctx, BICO_E_IO,
                      "lora_open: %s is a file of an adapter: give its "
                      "folder, %.*s",
                      dir, (int)(n > 1 ? n - 1 : 1), n ? dir : ".");
  }
  return bico__fail(ctx, BICO_E_IO,
                    "lora_open: %s is a file, not an adapter folder: give "
                    "the folder that holds adapter_config.json and "
                    "adapter_model.safetensors",
                    dir);
}

bico_status bico_lora_open(bico_ctx *ctx, const char *dir, bico_lora **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (dir == NULL || out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "lora_open: %s is NULL",
                      dir == NULL ? "dir" : "out");
  if (dir[0] == '\0')
    return bico__fail(ctx, BICO_E_ARG, "lora_open: empty folder name");
  bico_status bad = not_a_folder(ctx, dir);
  if (bad != BICO_OK) return bad;
  bico_lora *l = NULL;
  bico_status st = bico_lora_create(ctx, &l);
  if (st != BICO_OK) return st;
  char *cpath = join(ctx, dir, "adapter_config.json");
  char *tpath = join(ctx, dir, "adapter_model.safetensors");
  char *text = NULL;
  size_t len = 0;
  bico__json_doc *doc = NULL;
  bico_stfile *f = NULL;
  config c;
  memset(&c, 0, sizeof c);
  if (cpath == NULL || tpath == NULL) st = BICO_E_NOMEM;
  if (st == BICO_OK) st = read_text(ctx, cpath, &text, &len);
  if (st == BICO_OK) {
    char what[600];
    snprintf(what, sizeof what, "lora_open: %s", cpath);
    st = bico__json_parse(ctx, what, text, len, &doc);
  }
  if (st == BICO_OK) st = parse_config(l, cpath, &doc->root, &c);
  if (st == BICO_OK) {
    st = bico_stfile_open(ctx, tpath, &f);
    if (st != BICO_OK && strstr(bico_ctx_errmsg(ctx), tpath) == NULL)
      st = bico__fail(ctx, st, "lora_open: %s: %s", tpath,
                      bico_ctx_errmsg(ctx));
  }
  if (st == BICO_OK) st = load_tensors(l, tpath, f, &c);
  if (st == BICO_OK && l->nmods == 0)
    st = bico__fail(ctx, BICO_E_FORMAT,
                    "lora_open: %s holds no LoRA factors", tpath);
  bico_stfile_free(f);
  if (c.have_re) regfree(&c.re);
  bico__strindex_free(ctx, &c.tix);
  bico__json_doc_free(doc);
  bico__free(ctx, text);
  bico__free(ctx, cpath);
  bico__free(ctx, tpath);
  if (st != BICO_OK) {
    bico_lora_free(l);
    return st;
  }
  *out = l;
  return BICO_OK;
}

/* ==================================================================== */
/* Writing                                                                */

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The most common value among v[0..n) (ties: the smallest), n > 0; sorts
 * v.  O(n log n): counting pairs took 25 s for 40k modules. */
static double mode_of(double *v, size_t n) {
  qsort(v, n, sizeof *v, cmp_double);
  double best = v[0];
  size_t bc = 0;
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j < n && v[j] == v[i]) j++;
    if (j - i > bc) {
      best = v[i];
      bc = j - i;
    }
    i = j;
  }
  return best;
}

static bico_status build_config(const bico_lora *l, bico__jw *w) {
  bico_ctx *ctx = l->ctx;
  size_t n = l->nmods;
  double *ranks = bico__alloc(ctx, n * sizeof(double));
  double *alphas = bico__alloc(ctx, n * sizeof(double));
  const char **names = bico__alloc(ctx, (n + l->nsaved + 1) * sizeof *names);
  if (ranks == NULL || alphas == NULL || names == NULL) {
    bico__free(ctx, ranks);
    bico__free(ctx, alphas);
    bico__free(ctx, names);
    return BICO_E_NOMEM;
  }
  for (size_t i = 0; i < n; i++) {
    ranks[i] = (double)l->mods[i].rank;
    alphas[i] = l->mods[i].alpha;
  }
  double r = mode_of(ranks, n), alpha = mode_of(alphas, n);
  for (size_t i = 0; i < n; i++) {
    ranks[i] = (double)l->mods[i].rank;
    alphas[i] = l->mods[i].alpha;
  }
  bico__jw_begin_object(w);
  bico__jw_key(w, "peft_type");
  bico__jw_string(w, "LORA");
  bico__jw_key(w, "task_type");
  if (l->strings[BICO_LORA_TASK_TYPE]) bico__jw_string(w, l->strings[BICO_LORA_TASK_TYPE]);
  else bico__jw_null(w);
  bico__jw_key(w, "base_model_name_or_path");
  if (l->strings[BICO_LORA_BASE_MODEL]) bico__jw_string(w, l->strings[BICO_LORA_BASE_MODEL]);
  else bico__jw_null(w);
  bico__jw_key(w, "r");
  bico__jw_uint(w, (uint64_t)r);
  bico__jw_key(w, "lora_alpha");
  if (alpha == floor(alpha) && alpha < 9e15) bico__jw_int(w, (int64_t)alpha);
  else bico__jw_double(w, alpha);
  bico__jw_key(w, "rank_pattern");
  bico__jw_begin_object(w);
  for (size_t i = 0; i < n; i++)
    if (ranks[i] != r) {
      bico__jw_key(w, l->mods[i].name);
      bico__jw_uint(w, (uint64_t)l->mods[i].rank);
    }
  bico__jw_end_object(w);
  bico__jw_key(w, "alpha_pattern");
  bico__jw_begin_object(w);
  for (size_t i = 0; i < n; i++)
    if (alphas[i] != alpha) {
      bico__jw_key(w, l->mods[i].name);
      double a = l->mods[i].alpha;
      if (a == floor(a) && a < 9e15) bico__jw_int(w, (int64_t)a);
      else bico__jw_double(w, a);
    }
  bico__jw_end_object(w);
  for (size_t i = 0; i < n; i++) names[i] = l->mods[i].name;
  qsort(names, n, sizeof *names, cmp_str);
  bico__jw_key(w, "target_modules");
  bico__jw_begin_array(w);
  for (size_t i = 0; i < n; i++) bico__jw_string(w, names[i]);
  bico__jw_end_array(w);
  bico__jw_key(w, "modules_to_save");
  /* Distinct saved modules, sorted (sort, then drop repeats). */
  size_t ns = 0;
  for (size_t i = 0; i < l->nsaved; i++) names[i] = l->saved[i].module;
  qsort(names, l->nsaved, sizeof *names, cmp_str);
  for (size_t i = 0; i < l->nsaved; i++)
    if (ns == 0 || strcmp(names[ns - 1], names[i]) != 0) names[ns++] = names[i];
  if (ns == 0) {
    bico__jw_null(w);
  } else {
    bico__jw_begin_array(w);
    for (size_t i = 0; i < ns; i++) bico__jw_string(w, names[i]);
    bico__jw_end_array(w);
  }
  bico__jw_key(w, "use_rslora");
  bico__jw_bool(w, l->rslora);
  bico__jw_key(w, "fan_in_fan_out");
  bico__jw_bool(w, l->fifo);
  bico__jw_key(w, "bias");
  bico__jw_string(w, "none");
  bico__jw_key(w, "use_dora");
  bico__jw_bool(w, 0);
  bico__jw_key(w, "lora_dropout");
  bico__jw_double(w, l->dropout);
  bico__jw_key(w, "inference_mode");
  bico__jw_bool(w, 1);
  bico__jw_end_object(w);
  bico__jw_raw(w, "\n", 1);
  bico__free(ctx, ranks);
  bico__free(ctx, alphas);
  bico__free(ctx, names);
  return bico__jw_finish(w);
}

static bico_status write_tensors(const bico_lora *l, bico_stwriter *w) {
  bico_ctx *ctx = l->ctx;
  size_t cap = 64;
  for (size_t i = 0; i < l->nmods; i++)
    if (strlen(l->mods[i].name) + 64 > cap) cap = strlen(l->mods[i].name) + 64;
  for (size_t i = 0; i < l->nsaved; i++)
    if (strlen(l->saved[i].name) + 64 > cap) cap = strlen(l->saved[i].name) + 64;
  char *nm = bico__alloc(ctx, cap);
  if (nm == NULL) return BICO_E_NOMEM;
  bico_status st = bico_stwriter_add_metadata(w, "format", "pt");
  /* Declare everything, then write: the writer's order. */
  for (int pass = 0; pass < 2 && st == BICO_OK; pass++) {
    for (size_t i = 0; i < l->nmods && st == BICO_OK; i++) {
      const lmod *m = &l->mods[i];
      int lin = m->kind == BICO_LORA_LINEAR;
      size_t sa[2] = {m->rank, m->din}, sb[2] = {m->dout, m->rank};
      snprintf(nm, cap, PREFIX "%s.%s", m->name, lin ? "lora_A.weight" : "lora_embedding_A");
      st = pass ? bico_stwriter_write_f32(w, nm, m->a, m->rank * m->din)
                : bico_stwriter_declare(w, nm, BICO_DTYPE_F32, 2, sa);
      snprintf(nm, cap, PREFIX "%s.%s", m->name, lin ? "lora_B.weight" : "lora_embedding_B");
      if (st == BICO_OK)
        st = pass ? bico_stwriter_write_f32(w, nm, m->b, m->dout * m->rank)
                  : bico_stwriter_declare(w, nm, BICO_DTYPE_F32, 2, sb);
    }
    for (size_t i = 0; i < l->nsaved && st == BICO_OK; i++) {
      const lsaved *s = &l->saved[i];
      snprintf(nm, cap, PREFIX "%s", s->name);
      if (pass == 0)
        st = bico_stwriter_declare(w, nm, BICO_DTYPE_F32, s->ndim, s->shape);
      else if (s->numel > 0)
        st = bico_stwriter_write_f32(w, nm, s->data, s->numel);
    }
  }
  bico__free(ctx, nm);
  return st;
}

/* What a new adapter folder takes from the old one: everything but the
 * two files it writes (and temporaries of this library's runs). */
static int keep_old_entry(void *arg, const char *n) {
  (void)arg;
  if (n[0] == '.' && strstr(n, BICO__TMP_MARK) != NULL) return 0;
  return strcmp(n, "adapter_model.safetensors") != 0 &&
         strcmp(n, "adapter_config.json") != 0;
}

/* adapter_config.json of the new folder: made at its final name there,
 * named dir/adapter_config.json in messages. */
static bico_status write_config(const bico_lora *l, const char *fn,
                                const char *cpath, const char *at) {
  bico_ctx *ctx = l->ctx;
  bico__jw jw;
  bico__jw_init(&jw, ctx, 2);
  bico__tmpfile t;
  bico_status st = build_config(l, &jw);
  if (st == BICO_OK)
    st = bico__tmp_create_in(ctx, fn, "output adapter config", cpath, at, &t);
  if (st == BICO_OK) {
    t.nosync = 1; /* the new folder is synced once */
    st = bico__tmp_write(ctx, fn, &t, jw.buf, jw.len);
    if (st == BICO_OK) st = bico__tmp_finish(ctx, fn, &t);
    t.gone = 1; /* it stays in the new folder, which goes as a whole */
    bico__tmp_discard(ctx, &t);
  }
  bico__jw_free(&jw);
  return st;
}

bico_status bico__lora_save_begin(const bico_lora *l, const char *fn,
                                  const char *dir, bico__lora_out *o) {
  bico_ctx *ctx = l->ctx;
  memset(o, 0, sizeof *o);
  o->st.t.fd = -1;
  o->st.t.gone = 1;
  if (l->nmods == 0)
    return bico__fail(ctx, BICO_E_STATE,
                      "%s: the adapter has no modules (%s not written)", fn,
                      dir);
  char *cpath = join(ctx, dir, "adapter_config.json");
  char *tpath = join(ctx, dir, "adapter_model.safetensors");
  bico_status st = cpath && tpath ? BICO_OK : BICO_E_NOMEM;
  bico__fileuse use[2] = {{"output adapter weights", tpath, 1, 1, 0},
                          {"output adapter config", cpath, 1, 1, 0}};
  if (st == BICO_OK) st = bico__check_files(ctx, fn, use, 2);
  if (st == BICO_OK) {
    o->ctx = ctx;
    st = bico__stage_open(ctx, fn, dir, 1, &o->st);
  }
  if (st == BICO_OK) st = bico__stage_make(ctx, fn, &o->st);
  char *cat = st == BICO_OK ? join(ctx, o->st.t.tmp, "adapter_config.json")
                            : NULL;
  char *tat = st == BICO_OK
                  ? join(ctx, o->st.t.tmp, "adapter_model.safetensors")
                  : NULL;
  if (st == BICO_OK && (cat == NULL || tat == NULL)) st = BICO_E_NOMEM;
  if (st == BICO_OK) st = write_config(l, fn, cpath, cat);
  bico_stwriter *w = NULL;
  if (st == BICO_OK) st = bico__stwriter_create_at(ctx, tpath, tat, &w);
  if (st == BICO_OK) st = write_tensors(l, w);
  bico__tmpfile *wt = NULL;
  if (st == BICO_OK) st = bico__stwriter_finish(w, &wt);
  if (st == BICO_OK) wt->gone = 1; /* in the new folder, which goes whole */
  bico_stwriter_free(w);
  if (st == BICO_OK)
    st = bico__stage_finish(ctx, fn, &o->st, keep_old_entry, NULL);
  if (st == BICO_OK) o->st.t.gone = 0; /* for bico__commit */
  bico__free(ctx, cat);
  bico__free(ctx, tat);
  bico__free(ctx, cpath);
  bico__free(ctx, tpath);
  return st;
}

void bico__lora_save_end(bico__lora_out *o, int committed) {
  if (o->ctx == NULL) return;
  if (committed) o->st.t.gone = 1;
  bico__stage_free(o->ctx, &o->st);
  memset(o, 0, sizeof *o);
}

/* The whole adapter folder is built beside the old one and swapped in at
 * once: a failure anywhere leaves the folder as it was, and a reader sees
 * the old adapter or the new one, never the new weights beside the old
 * config. */
bico_status bico_lora_save(const bico_lora *l, const char *dir) {
  if (l == NULL) return BICO_E_NULL;
  bico_ctx *ctx = l->ctx;
  bico__clear(ctx);
  if (dir == NULL)
    return bico__fail(ctx, BICO_E_NULL, "lora_save: dir is NULL");
  if (dir[0] == '\0')
    return bico__fail(ctx, BICO_E_ARG, "lora_save: empty folder name");
  bico__lora_out o;
  bico_status st = bico__lora_save_begin(l, "lora_save", dir, &o);
  if (st == BICO_OK) {
    bico__tmpfile *outs[1] = {&o.st.t};
    st = bico__commit(ctx, "lora_save", outs, 1);
  }
  bico__lora_save_end(&o, st == BICO_OK);
  return st;
}
