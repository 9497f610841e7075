/* libFuzzer target: the strict JSON reader and writer (lib/base/json.h; the
 * library's sources are compiled into the fuzzer, so the internal API is
 * reachable).  An accepted document must survive a round trip: written
 * back with the writer and parsed again it gives the same tree (numbers
 * compared by value, since 5.0 is written as 5), compact and indented. */
#include <math.h>

#include "fuzz_util.h"
#include "json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int is_number(const bico__json *v) {
  return v->type == BICO__JSON_INT || v->type == BICO__JSON_REAL;
}
static double number(const bico__json *v) {
  return v->type == BICO__JSON_INT ? (double)v->u.i : v->u.d;
}

static int has_nul_key(const bico__json *v) {
  if (v->type == BICO__JSON_ARRAY) {
    for (size_t i = 0; i < v->n; i++)
      if (has_nul_key(&v->u.items[i])) return 1;
  } else if (v->type == BICO__JSON_OBJECT) {
    for (size_t i = 0; i < v->n; i++) {
      if (strlen(v->u.members[i].key) != v->u.members[i].key_len) return 1;
      if (has_nul_key(&v->u.members[i].value)) return 1;
    }
  }
  return 0;
}

static void emit(bico__jw *w, const bico__json *v) {
  switch (v->type) {
    case BICO__JSON_NULL: bico__jw_null(w); break;
    case BICO__JSON_BOOL: bico__jw_bool(w, v->u.b); break;
    case BICO__JSON_INT: bico__jw_int(w, v->u.i); break;
    case BICO__JSON_REAL: bico__jw_double(w, v->u.d); break;
    case BICO__JSON_STRING: bico__jw_string_n(w, v->u.s, v->n); break;
    case BICO__JSON_ARRAY:
      bico__jw_begin_array(w);
      for (size_t i = 0; i < v->n; i++) emit(w, &v->u.items[i]);
      bico__jw_end_array(w);
      break;
    case BICO__JSON_OBJECT:
      bico__jw_begin_object(w);
      for (size_t i = 0; i < v->n; i++) {
        bico__jw_key(w, v->u.members[i].key);
        emit(w, &v->u.members[i].value);
      }
      bico__jw_end_object(w);
      break;
  }
}

static int same(const bico__json *a, const bico__json *b) {
  if (is_number(a) && is_number(b)) {
    if (a->type == b->type && a->type == BICO__JSON_INT)
      return a->u.i == b->u.i;
    return number(a) == number(b);
  }
  if (a->type != b->type || a->n != b->n) return 0;
  switch (a->type) {
    case BICO__JSON_NULL: return 1;
    case BICO__JSON_BOOL: return !a->u.b == !b->u.b;
    case BICO__JSON_STRING: return memcmp(a->u.s, b->u.s, a->n) == 0;
    case BICO__JSON_ARRAY:
      for (size_t i = 0; i < a->n; i++)
        if (!same(&a->u.items[i], &b->u.items[i])) return 0;
      return 1;
    case BICO__JSON_OBJECT:
      for (size_t i = 0; i < a->n; i++) {
        const bico__json_member *x = &a->u.members[i], *y = &b->u.members[i];
        if (x->key_len != y->key_len ||
            memcmp(x->key, y->key, x->key_len) != 0 ||
            !same(&x->value, &y->value))
          return 0;
        /* bico__json_get finds the first (and only) member of that name. */
        if (strlen(x->key) == x->key_len &&
            bico__json_get(a, x->key) != &x->value)
          return 0;
      }
      return 1;
    default: return 0;
  }
}

static void check_values(const bico__json *v) {
  FUZZ_REQUIRE(bico__json_type_name(v->type) != NULL);
  if (v->type == BICO__JSON_REAL) FUZZ_REQUIRE(isfinite(v->u.d));
  if (v->type == BICO__JSON_STRING) {
    FUZZ_REQUIRE(v->u.s[v->n] == '\0');
    FUZZ_REQUIRE(bico__utf8_valid(v->u.s, v->n, NULL));
  }
  if (v->type == BICO__JSON_ARRAY)
    for (size_t i = 0; i < v->n; i++) check_values(&v->u.items[i]);
  if (v->type == BICO__JSON_OBJECT)
    for (size_t i = 0; i < v->n; i++) {
      FUZZ_REQUIRE(bico__utf8_valid(v->u.members[i].key,
                                    v->u.members[i].key_len, NULL));
      check_values(&v->u.members[i].value);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  bico_ctx *ctx = fuzz_ctx();
  bico__json_doc *doc = NULL, *doc2 = NULL, *doc3 = NULL;
  bico_status st = bico__json_parse(ctx, "fuzz", (const char *)data, size,
                                    &doc);
  if (st != BICO_OK) {
    fuzz_check_failure(ctx, st);
    FUZZ_REQUIRE(st == BICO_E_FORMAT || st == BICO_E_NOMEM);
    FUZZ_REQUIRE(strncmp(bico_ctx_errmsg(ctx), "fuzz: ", 6) == 0);
    bico_ctx_free(ctx);
    return 0;
  }
  FUZZ_REQUIRE(doc != NULL);
  check_values(&doc->root);
  if (!has_nul_key(&doc->root)) {
    bico__jw w, w2;
    bico__jw_init(&w, ctx, 0);
    emit(&w, &doc->root);
    FUZZ_REQUIRE(bico__jw_finish(&w) == BICO_OK);
    FUZZ_REQUIRE(bico__json_parse(ctx, "again", w.buf, w.len, &doc2) ==
                 BICO_OK);
    FUZZ_REQUIRE(same(&doc->root, &doc2->root));
    bico__jw_init(&w2, ctx, 2);
    emit(&w2, &doc2->root);
    FUZZ_REQUIRE(bico__jw_finish(&w2) == BICO_OK);
    FUZZ_REQUIRE(bico__json_parse(ctx, "indented", w2.buf, w2.len, &doc3) ==
                 BICO_OK);
    FUZZ_REQUIRE(same(&doc2->root, &doc3->root));
    bico__jw_free(&w);
    bico__jw_free(&w2);
    bico__json_doc_free(doc2);
    bico__json_doc_free(doc3);
  }
  bico__json_doc_free(doc);
  bico_ctx_free(ctx);
  return 0;
}
