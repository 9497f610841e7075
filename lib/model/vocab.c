/* Vocabularies by token string (see vocab.h): tokenizer.json's ids and
 * strings, read with the library's JSON parser, and the target -> source
 * row map. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"
#include "json.h"
#include "strindex.h"
#include "vocab.h"

#define NONE SIZE_MAX

typedef struct tokens {
  bico__json_doc *doc;
  const char **str; /* per id (NULL: no token has this id) */
  size_t n;
} tokens;

static const char *tok_key(const void *owner, size_t i) {
  const char *s = ((const tokens *)owner)->str[i];
  return s ? s : "";
}

static void tokens_free(bico_ctx *ctx, tokens *t) {
  bico__json_doc_free(t->doc);
  bico__free(ctx, (void *)t->str);
  memset(t, 0, sizeof *t);
}

static int is_dir(const char *p) {
  struct stat s;
  return p != NULL && stat(p, &s) == 0 && S_ISDIR(s.st_mode);
}

static bico_status bad(bico_ctx *ctx, const char *path, const char *what) {
  return bico__fail(ctx, BICO_E_FORMAT, "%s: %s", path, what);
}

/* Sets str[id] = s, growing the table.  The table holds one pointer per
 * id up to the largest, so an id far beyond the number of entries (a
 * 60-byte file naming id 2^31 - 1 would cost 16 GB) is refused: ids may
 * leave gaps, but at most `limit` (twice the entries plus 2^20). */
static bico_status put(bico_ctx *ctx, const char *path, tokens *t, size_t *cap,
                       int64_t id, const char *s, size_t limit) {
  if (id < 0 || id > INT32_MAX || (uint64_t)id >= limit)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: token id %lld is out of range (the file lists "
                      "%zu tokens; ids must be below %zu)",
                      path, (long long)id, (limit - ((size_t)1 << 20)) / 2,
                      limit);
  size_t i = (size_t)id;
  if (i >= *cap) {
    size_t nc = *cap ? *cap : 1024;
    while (nc <= i) nc *= 2;
    const char **p = bico__calloc(ctx, nc, sizeof *p);
    if (p == NULL) return BICO_E_NOMEM;
    if (t->str) memcpy(p, t->str, *cap * sizeof *p);
    bico__free(ctx, (void *)t->str);
    t->str = p;
    *cap = nc;
  }
  t->str[i] = s;
  if (i + 1 > t->n) t->n = i + 1;
  return BICO_OK;
}

/* Reads folder/tokenizer.json; found = 0 when there is none. */
static bico_status load(bico_ctx *ctx, const char *folder, tokens *t,
                        int *found) {
  memset(t, 0, sizeof *t);
  *found = 0;
  if (!is_dir(folder)) return BICO_OK;
  char path[4096];
  int w = snprintf(path, sizeof path, "%s/tokenizer.json", folder);
  struct stat s;
  if (w <= 0 || (size_t)w >= sizeof path || stat(path, &s) != 0)
    return BICO_OK;
  *found = 1;
  char *text = NULL;
  size_t len = 0, cap = 0;
  bico_status st = bico__read_file(ctx, "tokenizer", "tokenizer.json", path,
                                   (size_t)1 << 30, &text, &len);
  if (st == BICO_OK) st = bico__json_parse(ctx, path, text, len, &t->doc);
  bico__free(ctx, text);
  if (st != BICO_OK) return st;
  const bico__json *model = bico__json_get(&t->doc->root, "model");
  const bico__json *vocab = model ? bico__json_get(model, "vocab") : NULL;
  if (vocab == NULL)
    return bad(ctx, path, "no model.vocab (a tokenizer.json without a "
                          "vocabulary)");
  const bico__json *added = bico__json_get(&t->doc->root, "added_tokens");
  size_t entries = (vocab->type == BICO__JSON_OBJECT ||
                    vocab->type == BICO__JSON_ARRAY ? vocab->n : 0) +
                   (added != NULL && added->type == BICO__JSON_ARRAY ? added->n
                                                                     : 0);
  size_t limit = 2 * entries + ((size_t)1 << 20);
  if (vocab->type == BICO__JSON_OBJECT) {
    for (size_t i = 0; i < vocab->n && st == BICO_OK; i++) {
      const bico__json_member *m = &vocab->u.members[i];
      if (m->value.type != BICO__JSON_INT)
        return bad(ctx, path, "model.vocab maps a token to a non-integer");
      st = put(ctx, path, t, &cap, m->value.u.i, m->key, limit);
    }
  } else if (vocab->type == BICO__JSON_ARRAY) { /* Unigram: [piece, score] */
    for (size_t i = 0; i < vocab->n && st == BICO_OK; i++) {
      const bico__json *e = &vocab->u.items[i];
      if (e->type != BICO__JSON_ARRAY || e->n < 1 ||
          e->u.items[0].type != BICO__JSON_STRING)
        return bad(ctx, path, "model.vocab entries must be [piece, score]");
      st = put(ctx, path, t, &cap, (int64_t)i, e->u.items[0].u.s, limit);
    }
  } else {
    return bad(ctx, path, "model.vocab is neither an object nor an array");
  }
  if (added != NULL && added->type == BICO__JSON_ARRAY)
    for (size_t i = 0; i < added->n && st == BICO_OK; i++) {
      const bico__json *id = bico__json_get(&added->u.items[i], "id");
      const bico__json *c = bico__json_get(&added->u.items[i], "content");
      if (id == NULL || id->type != BICO__JSON_INT || c == NULL ||
          c->type != BICO__JSON_STRING)
        return bad(ctx, path, "an added_tokens entry without an integer id "
                              "and a string content");
      st = put(ctx, path, t, &cap, id->u.i, c->u.s, limit);
    }
  return st;
}

void bico__vocab_free(bico_ctx *ctx, bico__vocab *v) {
  if (v == NULL) return;
  bico__free(ctx, v->src_of);
  bico__free(ctx, v);
}

bico_status bico__vocab_map(bico_ctx *ctx, const char *source_path,
                            const char *target_path, bico__vocab **out) {
  *out = NULL;
  tokens a, b;
  int fa, fb;
  bico_status st = load(ctx, source_path, &a, &fa);
  if (st == BICO_OK) st = load(ctx, target_path, &b, &fb);
  else memset(&b, 0, sizeof b);
  int same = st == BICO_OK && a.n == b.n;
  for (size_t i = 0; same && i < a.n; i++)
    same = (a.str[i] == NULL) == (b.str[i] == NULL) &&
           (a.str[i] == NULL || strcmp(a.str[i], b.str[i]) == 0);
  if (st != BICO_OK || !fa || !fb || same) {
    tokens_free(ctx, &a);
    tokens_free(ctx, &b);
    return st;
  }
  /* Source ids by string; a string given two ids keeps its first. */
  bico__strindex ix = {NULL, 0};
  st = bico__strindex_reserve(ctx, &ix, a.n, tok_key, &a);
  for (size_t i = 0; i < a.n && st == BICO_OK; i++)
    if (a.str[i] != NULL &&
        bico__strindex_find(&ix, a.str[i], strlen(a.str[i]), tok_key, &a) ==
            NONE)
      bico__strindex_insert(&ix, i, tok_key, &a);
  bico__vocab *v = st == BICO_OK ? bico__calloc(ctx, 1, sizeof *v) : NULL;
  if (st == BICO_OK && v == NULL) st = BICO_E_NOMEM;
  if (st == BICO_OK) {
    v->n_source = a.n;
    v->n_target = b.n;
    v->src_of = bico__alloc(ctx, (b.n ? b.n : 1) * sizeof *v->src_of);
    if (v->src_of == NULL) st = BICO_E_NOMEM;
  }
  for (size_t j = 0; j < b.n && st == BICO_OK; j++) {
    v->src_of[j] = b.str[j] == NULL
                       ? NONE
                       : bico__strindex_find(&ix, b.str[j], strlen(b.str[j]),
                                             tok_key, &a);
    if (v->src_of[j] != NONE) v->shared++;
    else v->fresh++;
  }
  bico__strindex_free(ctx, &ix);
  tokens_free(ctx, &a);
  tokens_free(ctx, &b);
  if (st != BICO_OK) {
    bico__vocab_free(ctx, v);
    return st;
  }
  *out = v;
  return BICO_OK;
}

int bico__vocab_tensor(const char *name, size_t ndim, const size_t *shape) {
  (void)shape;
  if (name == NULL || ndim != 2) return 0;
  const char *dot = strrchr(name, '.');
  if (dot == NULL) return 0;
  size_t mlen = (size_t)(dot - name), s = mlen;
  while (s > 0 && name[s - 1] != '.') s--;
  static const char *const KNOWN[] = {"embed_tokens", "wte", "word_embeddings",
                                      "token_embedding", "lm_head", "embed_in",
                                      "embed_out"};
  for (size_t k = 0; k < sizeof KNOWN / sizeof *KNOWN; k++)
    if (mlen - s == strlen(KNOWN[k]) && memcmp(name + s, KNOWN[k], mlen - s) == 0)
      return 1;
  return 0;
}
