/* Decoder families from Hugging Face config.json.  Only what the
 * structure-aware attention and MLP maps need: head counts, head width,
 * the RoPE layout.  Every family listed here writes its rotary embedding
 * in the half-split layout of HF's rotate_half (dimension i pairs with
 * i + head_dim/2); interleaved pairs (2i, 2i+1), as GPT-J and Meta's
 * original Llama checkpoints use, are chosen with the override. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "family.h"
#include "fileio.h"
#include "json.h"

static const char *const FAMILIES[] = {"llama", "mistral", "qwen2",
                                       "gemma", "gemma2"};

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

/* f->causal_lm and f->causal_why from model_type (already in f->type) and
 * "architectures". */
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
  if (!f->causal_lm && f->known) {
    f->causal_lm = 1;
    snprintf(f->causal_why, sizeof f->causal_why, "model_type \"%s\"",
             f->type);
  }
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
  if (f->rope != BICO__ROPE_NONE && f->head_dim % 2)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: head_dim %zu is odd; rotary embeddings pair "
                      "dimensions",
                      what, f->head_dim);
  return BICO_OK;
}

bico_status bico__family_read(bico_ctx *ctx, const char *path,
                              bico__family *f) {
  memset(f, 0, sizeof *f);
  char *text = NULL;
  size_t len = 0;
  bico_status st = bico__read_file(ctx, "transfer_run", "config.json", path,
                                   (size_t)16 << 20, &text, &len);
  if (st != BICO_OK) return st;
  bico__json_doc *doc = NULL;
  st = bico__json_parse(ctx, path, text, len, &doc);
  bico__free(ctx, text);
  if (st != BICO_OK) return st;
  const bico__json *root = &doc->root;
  if (root->type != BICO__JSON_OBJECT) {
    bico__json_doc_free(doc);
    return bico__fail(ctx, BICO_E_FORMAT, "%s: not a JSON object", path);
  }
  const bico__json *mt = bico__json_get(root, "model_type");
  if (mt != NULL && mt->type == BICO__JSON_STRING)
    snprintf(f->type, sizeof f->type, "%s", mt->u.s);
  for (size_t i = 0; i < sizeof FAMILIES / sizeof *FAMILIES; i++)
    if (strcmp(f->type, FAMILIES[i]) == 0) f->known = 1;
  causal(root, f);
  if (!f->known) {
    bico__json_doc_free(doc);
    return BICO_OK;
  }
  static const char *const REQ[4] = {"hidden_size", "num_attention_heads",
                                     "num_hidden_layers", "intermediate_size"};
  size_t *dst[4] = {&f->hidden, &f->heads, &f->layers, &f->intermediate};
  for (int i = 0; i < 4 && st == BICO_OK; i++) {
    int bad = 0;
    *dst[i] = get_count(root, REQ[i], &bad);
    if (*dst[i] == 0)
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "%s: field %s is %s (model_type \"%s\" needs it as a "
                      "positive integer)",
                      path, REQ[i], bad ? "not a positive integer" : "missing",
                      f->type);
  }
  static const char *const OPT[2] = {"num_key_value_heads", "head_dim"};
  size_t *odst[2] = {&f->kv_heads, &f->head_dim};
  for (int i = 0; i < 2 && st == BICO_OK; i++) {
    int bad = 0;
    *odst[i] = get_count(root, OPT[i], &bad);
    if (bad)
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "%s: field %s is not a positive integer", path, OPT[i]);
  }
  if (st == BICO_OK) {
    /* Gemma ties its embedding unless told otherwise; the others say so. */
    f->tie = get_bool(root, "tie_word_embeddings",
                      strncmp(f->type, "gemma", 5) == 0);
    f->attn_bias = get_bool(root, "attention_bias",
                            strcmp(f->type, "qwen2") == 0);
    f->rope = BICO__ROPE_HALF;
    st = check(ctx, path, f);
  }
  bico__json_doc_free(doc);
  if (st != BICO_OK) f->known = 0;
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
    memset(f, 0, sizeof *f);
    snprintf(f->type, sizeof f->type, "given");
    f->rope = BICO__ROPE_HALF;
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
