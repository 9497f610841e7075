/* Model families: the one table keyed by config.json's model_type and the
 * one reader of config.json (see family.h for the rules).
 *
 * Every decoder family listed here writes its rotary embedding in the
 * half-split layout of HF's rotate_half (dimension i pairs with
 * i + head_dim/2); interleaved pairs (2i, 2i+1), as GPT-J and Meta's
 * original Llama checkpoints use, are chosen with the override.  Naming
 * rules are keyed on name components, so a prefix ("transformer." or
 * none) changes nothing. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "family.h"
#include "fileio.h"
#include "json.h"

/* ---- the table ---- */

static const char *const GPT2_CONV1D[] = {"c_attn", "c_proj", "c_fc",
                                          "q_attn", NULL};
static const bico__role_rule GPT2_ROLES[] = {
    /* the causal mask buffers of old checkpoints */
    {"attn", "bias", 0, BICO_ROLE_OTHER},
    {"attn", "masked_bias", 0, BICO_ROLE_OTHER},
    {NULL, NULL, 0, 0}};
static const bico__naming GPT2_NAMING = {"gpt2", GPT2_CONV1D, NULL,
                                         GPT2_ROLES};

static const char *const CLIP_CONTAINERS[] = {
    "vision_model.encoder.layers", "text_model.encoder.layers", NULL};
static const bico__role_rule CLIP_ROLES[] = {
    /* [d]: added to the stream like a cls token */
    {NULL, "class_embedding", 1, BICO_ROLE_TOKEN},
    {NULL, "position_ids", 0, BICO_ROLE_OTHER},
    {NULL, NULL, 0, 0}};
static const bico__naming CLIP_NAMING = {"clip", NULL, CLIP_CONTAINERS,
                                         CLIP_ROLES};

enum { HALF = BICO_ROPE_HALF };

static const bico__family_row ROWS[] = {
    /* type      prefix kind                naming        fused split
       signature      decoder tie bias rope */
    {"llama", 0, BICO__FAMILY_NONE, NULL, NULL, 1, NULL, 1, 0, 0, HALF},
    {"mistral", 0, BICO__FAMILY_NONE, NULL, NULL, 1, NULL, 1, 0, 0, HALF},
    {"qwen2", 0, BICO__FAMILY_NONE, NULL, NULL, 1, NULL, 1, 0, 1, HALF},
    {"gemma", 0, BICO__FAMILY_NONE, NULL, NULL, 1, NULL, 1, 1, 0, HALF},
    {"gemma2", 0, BICO__FAMILY_NONE, NULL, NULL, 1, NULL, 1, 1, 0, HALF},
    {"gpt2", 0, BICO__FAMILY_GPT2, &GPT2_NAMING, "c_attn", 3, "attn.c_attn",
     0, 1, 1, 0},
    {"clip", 1, BICO__FAMILY_CLIP, &CLIP_NAMING, NULL, 1, NULL, 0, 0, 1, 0},
};
#define NROWS (sizeof ROWS / sizeof *ROWS)

const bico__family_row *bico__family_lookup(const char *model_type) {
  if (model_type == NULL || model_type[0] == '\0') return NULL;
  for (size_t i = 0; i < NROWS; i++) {
    const char *t = ROWS[i].model_type;
    if (ROWS[i].prefix ? strncmp(model_type, t, strlen(t)) == 0
                       : strcmp(model_type, t) == 0)
      return &ROWS[i];
  }
  return NULL;
}

const bico__family_row *bico__family_row_of(int kind) {
  if (kind == BICO__FAMILY_NONE) return NULL;
  for (size_t i = 0; i < NROWS; i++)
    if (ROWS[i].kind == kind) return &ROWS[i];
  return NULL;
}

const bico__naming *bico__family_naming(int kind) {
  const bico__family_row *r = bico__family_row_of(kind);
  return r ? r->naming : NULL;
}

const char *bico__family_name(int kind) {
  const bico__naming *n = bico__family_naming(kind);
  return n ? n->name : "none";
}

const char *bico__family_word(const bico__family *f, int kind) {
  if (f != NULL && f->row != NULL) return f->row->model_type;
  return bico__family_name(kind);
}

int bico__family_transposed(int kind, const char *tensor, size_t ndim) {
  return bico__naming_transposed(bico__family_naming(kind), tensor, ndim);
}

int bico__family_role(int kind, const char *tensor, size_t ndim) {
  return bico__naming_role(bico__family_naming(kind), tensor, ndim);
}

static const char *last_component(const char *s) {
  const char *d = strrchr(s, '.');
  return d ? d + 1 : s;
}

size_t bico__family_split(int kind, const char *module) {
  const bico__family_row *r = bico__family_row_of(kind);
  if (r == NULL || r->fused == NULL || module == NULL) return 1;
  return strcmp(last_component(module), r->fused) == 0 ? r->fused_split : 1;
}

const char *const *bico__family_containers(int kind) {
  const bico__naming *n = bico__family_naming(kind);
  return n ? n->containers : NULL;
}

size_t bico__family_tower(int kind, const char *name) {
  const char *const *c = bico__family_containers(kind);
  if (c == NULL || c[1] == NULL || name == NULL) return 0;
  for (; *c != NULL; c++) {
    const char *dot = strchr(*c, '.');
    size_t n = dot ? (size_t)(dot - *c) + 1 : strlen(*c);
    if (strncmp(name, *c, n) == 0) return n;
  }
  return 0;
}

/* ---- the reader ---- */

bico_status bico__family_config(bico_ctx *ctx, const char *given,
                                const char *base, char **out) {
  *out = NULL;
  if (given != NULL) {
    *out = bico__strdup(ctx, given);
    return *out ? BICO_OK : BICO_E_NOMEM;
  }
  struct stat s;
  if (base == NULL || stat(base, &s) != 0 || !S_ISDIR(s.st_mode))
    return BICO_OK;
  char *p = bico__path_join(ctx, base, "config.json");
  if (p == NULL) return BICO_E_NOMEM;
  if (stat(p, &s) != 0 || !S_ISREG(s.st_mode)) {
    bico__free(ctx, p);
    return BICO_OK;
  }
  *out = p;
  return BICO_OK;
}

/* The count fields, in the order of bico__family's `bad` bits. */
enum { F_HIDDEN, F_HEADS, F_LAYERS, F_INTER, F_KV, F_HEAD_DIM, F_COUNT };
static const char *const FIELD[F_COUNT] = {
    "hidden_size",       "num_attention_heads", "num_hidden_layers",
    "intermediate_size", "num_key_value_heads", "head_dim"};

static size_t *field_of(bico__family *f, int k) {
  size_t *d[F_COUNT] = {&f->hidden,       &f->heads,    &f->layers,
                        &f->intermediate, &f->kv_heads, &f->head_dim};
  return d[k];
}

/* A positive integer member; 0 when absent or null (*bad set when present
 * but not a positive integer). */
static size_t get_count(const bico__json *root, const char *key, int *bad) {
  const bico__json *v = bico__json_get(root, key);
  if (v == NULL || v->type == BICO__JSON_NULL) return 0;
  if (v->type != BICO__JSON_INT || v->u.i <= 0 || v->u.i > (int64_t)1 << 40) {
    *bad = 1;
    return 0;
  }
  return (size_t)v->u.i;
}

static int get_bool(const bico__json *root, const char *key, int dflt) {
  const bico__json *v = bico__json_get(root, key);
  return v != NULL && v->type == BICO__JSON_BOOL ? v->u.b : dflt;
}

static int ends_with(const char *s, const char *tail) {
  size_t n = strlen(s), k = strlen(tail);
  return n >= k && strcmp(s + n - k, tail) == 0;
}

/* f->causal_lm and f->causal_why from "architectures" and the row (f->type
 * and f->row already set). */
static void causal(const bico__json *root, bico__family *f) {
  const bico__json *a = bico__json_get(root, "architectures");
  if (a != NULL && a->type == BICO__JSON_ARRAY)
    for (size_t i = 0; i < a->n && !f->causal_lm; i++) {
      const bico__json *e = &a->u.items[i];
      if (e->type == BICO__JSON_STRING && (ends_with(e->u.s, "ForCausalLM") ||
                                           ends_with(e->u.s, "LMHeadModel"))) {
        f->causal_lm = 1;
        snprintf(f->causal_why, sizeof f->causal_why,
                 "architectures \"%.60s\"", e->u.s);
      }
    }
  if (!f->causal_lm && f->row != NULL && f->row->decoder) {
    f->causal_lm = 1;
    snprintf(f->causal_why, sizeof f->causal_why, "model_type \"%s\"",
             f->type);
  }
}

bico_status bico__family_read(bico_ctx *ctx, const char *path,
                              bico__family *f) {
  memset(f, 0, sizeof *f);
  if (path == NULL) return BICO_OK;
  char *text = NULL;
  size_t len = 0;
  bico_status st = bico__read_file(ctx, "config", "config.json", path,
                                   (size_t)16 << 20, &text, &len);
  if (st != BICO_OK) return st;
  bico__json_doc *doc = NULL;
  st = bico__json_parse(ctx, path, text, len, &doc);
  bico__free(ctx, text);
  if (st != BICO_OK) return st;
  const bico__json *root = &doc->root;
  const bico__json *mt = bico__json_get(root, "model_type");
  if (root->type != BICO__JSON_OBJECT)
    st = bico__fail(ctx, BICO_E_FORMAT, "%s: not a JSON object", path);
  else if (mt != NULL && mt->type != BICO__JSON_STRING &&
           mt->type != BICO__JSON_NULL)
    st = bico__fail(ctx, BICO_E_FORMAT, "%s: field model_type is not a string",
                    path);
  if (st != BICO_OK) {
    bico__json_doc_free(doc);
    return st;
  }
  if (mt != NULL && mt->type == BICO__JSON_STRING)
    snprintf(f->type, sizeof f->type, "%s", mt->u.s);
  f->row = bico__family_lookup(f->type);
  causal(root, f);
  if (f->row != NULL) {
    for (int k = 0; k < F_COUNT; k++) {
      int bad = 0;
      *field_of(f, k) = get_count(root, FIELD[k], &bad);
      if (bad) f->bad |= 1u << k;
    }
    f->tie = get_bool(root, "tie_word_embeddings", f->row->tie);
    f->attn_bias = get_bool(root, "attention_bias", f->row->attn_bias);
    f->rope = f->row->rope;
  }
  bico__json_doc_free(doc);
  return BICO_OK;
}

/* Widths are products of the counts; a product past 2^40 (or past 2^64,
 * where it would wrap and match a small tensor) describes no tensor. */
#define MAX_WIDTH ((size_t)1 << 40)

static bico_status too_wide(bico_ctx *ctx, const char *what, const char *ka,
                            size_t a, const char *kb, size_t b) {
  if (a == 0 || b == 0 || b <= MAX_WIDTH / a) return BICO_OK;
  return bico__fail(ctx, BICO_E_FORMAT,
                    "%s: %s %zu x %s %zu is above 2^40 (no tensor is that "
                    "wide; a config.json describing another model?)",
                    what, ka, a, kb, b);
}

static bico_status check(bico_ctx *ctx, const char *what, bico__family *f) {
  if (f->kv_heads == 0) f->kv_heads = f->heads;
  bico_status st = too_wide(ctx, what, "num_attention_heads", f->heads,
                            "head_dim", f->head_dim);
  if (st == BICO_OK)
    st = too_wide(ctx, what, "num_key_value_heads", f->kv_heads, "head_dim",
                  f->head_dim);
  if (st == BICO_OK)
    st = too_wide(ctx, what, "hidden_size", f->hidden, "intermediate_size",
                  f->intermediate);
  if (st != BICO_OK) return st;
  if (f->heads % f->kv_heads)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: num_attention_heads %zu is not a multiple of "
                      "num_key_value_heads %zu",
                      what, f->heads, f->kv_heads);
  if (f->head_dim == 0) {
    if (f->hidden == 0 || f->hidden % f->heads)
      return bico__fail(ctx, BICO_E_FORMAT,
                        "%s: hidden_size %zu is not a multiple of "
                        "num_attention_heads %zu (and head_dim is not given)",
                        what, f->hidden, f->heads);
    f->head_dim = f->hidden / f->heads;
  }
  if (f->rope != BICO_ROPE_NONE && f->head_dim % 2)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: head_dim %zu is odd; rotary embeddings pair "
                      "dimensions",
                      what, f->head_dim);
  return BICO_OK;
}

bico_status bico__family_geometry(bico_ctx *ctx, const char *path,
                                  bico__family *f) {
  f->known = 0;
  if (f->row == NULL || !f->row->decoder) return BICO_OK;
  bico_status st = BICO_OK;
  for (int k = 0; k < F_COUNT && st == BICO_OK; k++) {
    int required = k < F_KV;
    if (f->bad & (1u << k))
      st = bico__fail(ctx, BICO_E_FORMAT,
                      required ? "%s: field %s is not a positive integer "
                                 "(model_type \"%s\" needs it as a positive "
                                 "integer)"
                               : "%s: field %s is not a positive integer",
                      path, FIELD[k], f->type);
    else if (required && *field_of(f, k) == 0)
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "%s: field %s is missing (model_type \"%s\" needs it "
                      "as a positive integer)",
                      path, FIELD[k], f->type);
  }
  if (st == BICO_OK) st = check(ctx, path, f);
  if (st == BICO_OK) f->known = 1;
  return st;
}

bico_status bico__family_override(bico_ctx *ctx, const char *what,
                                  bico__family *f, size_t heads,
                                  size_t kv_heads, size_t head_dim, int rope) {
  if (heads == 0 && kv_heads == 0 && head_dim == 0 && rope == 0)
    return BICO_OK;
  if (!f->known && heads == 0)
    return BICO_OK; /* nothing to structure: the override needs heads */
  if (!f->known) {
    const bico__family_row *row = f->row;
    memset(f, 0, sizeof *f);
    f->row = row; /* naming stays what the config said */
    snprintf(f->type, sizeof f->type, "given");
    f->rope = BICO_ROPE_HALF;
    f->known = 1;
  }
  if (heads) {
    f->heads = heads;
    if (!kv_heads && f->kv_heads && heads % f->kv_heads) f->kv_heads = 0;
  }
  if (kv_heads) f->kv_heads = kv_heads;
  if (head_dim) f->head_dim = head_dim;
  if (rope) f->rope = rope;
  if (f->head_dim == 0 && f->hidden == 0)
    return bico__fail(ctx, BICO_E_ARG,
                      "%s: --heads without a config.json needs --head-dim",
                      what);
  return check(ctx, what, f);
}

/* ---- naming kind of a model ---- */

/* 1 when name is a tensor of module path `sig` (matched by whole
 * components: "attn.c_attn" in "h.0.attn.c_attn.weight"). */
static int shows_module(const char *name, const char *sig) {
  const char *c = strstr(name, sig);
  size_t n = strlen(sig);
  return c != NULL && (c == name || c[-1] == '.') && c[n] == '.' &&
         strchr(c + n + 1, '.') == NULL;
}

/* 1 when name lies in block N of one of the containers. */
static int in_blocks(const char *name, const char *const *cont) {
  for (; cont != NULL && *cont != NULL; cont++) {
    size_t k = strlen(*cont);
    if (strncmp(name, *cont, k) == 0 && name[k] == '.' &&
        name[k + 1] >= '0' && name[k + 1] <= '9')
      return 1;
  }
  return 0;
}

static int from_names(const bico_model *m, char *why, size_t cap) {
  size_t n = bico__model_ntensors(m);
  for (size_t i = 0; i < n; i++) {
    const char *name;
    if (bico_model_tensor(m, i, &name, NULL, NULL, NULL) != BICO_OK) continue;
    for (size_t r = 0; r < NROWS; r++) {
      const bico__family_row *row = &ROWS[r];
      if (row->naming == NULL) continue;
      if ((row->signature != NULL && shows_module(name, row->signature)) ||
          (row->signature == NULL && row->naming->containers != NULL &&
           in_blocks(name, row->naming->containers))) {
        snprintf(why, cap, "tensor names (%s)", name);
        return row->kind;
      }
    }
  }
  return BICO__FAMILY_NONE;
}

int bico__family_kind(const bico__family *f, const bico_model *m, char *why,
                      size_t cap) {
  why[0] = '\0';
  if (f != NULL && f->row != NULL && f->row->naming != NULL) {
    snprintf(why, cap, "config.json model_type \"%s\"", f->type);
    return f->row->kind;
  }
  return m != NULL ? from_names(m, why, cap) : BICO__FAMILY_NONE;
}

/* ---- the public constructors: each model gets the table's namer ---- */

static const bico__naming *namer(const bico_model *m) {
  char why[8];
  return bico__family_naming(from_names(m, why, sizeof why));
}

bico_status bico_model_create(bico_ctx *ctx, bico_model **out) {
  bico_status st = bico__model_new(ctx, out);
  if (st == BICO_OK) bico__model_set_namer(*out, namer);
  return st;
}

bico_status bico_model_from_stfile(bico_ctx *ctx, const bico_stfile *f,
                                   bico_model **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (f == NULL || out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "model_from_stfile: %s is NULL",
                      f == NULL ? "f" : "out");
  bico_model *m;
  bico_status st = bico_model_create(ctx, &m);
  if (st != BICO_OK) return st;
  size_t n = bico__stfile_ntensors(f);
  for (size_t i = 0; i < n; i++) {
    const char *name;
    int dtype;
    size_t ndim;
    const size_t *shape;
    st = bico_stfile_tensor_info(f, i, &name, &dtype, &ndim, &shape);
    if (st == BICO_OK) st = bico_model_add_tensor(m, name, dtype, ndim, shape);
    if (st != BICO_OK) {
      bico_model_free(m);
      return st;
    }
  }
  *out = m;
  return BICO_OK;
}
