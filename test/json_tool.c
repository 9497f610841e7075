/* json_tool: drives libbico's internal JSON reader and writer (lib/base/json.h)
 * for test/python/test_json_interop.py, which compares them with Python's
 * json module.  Linked against the static library, where the internal
 * symbols are reachable.
 *
 *   json_tool [INDENT] < doc.json
 *
 * Parses stdin strictly, then writes the parsed value back with the JSON
 * writer (INDENT spaces per level; 0 or absent: compact) on stdout.  Invalid
 * input: the parser's message on stderr and exit status 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

static void emit(bico__jw *w, const bico__json *v) {
  switch (v->type) {
    case BICO__JSON_NULL: bico__jw_null(w); break;
    case BICO__JSON_BOOL: bico__jw_bool(w, v->u.b); break;
    case BICO__JSON_INT: bico__jw_int(w, v->u.i); break;
    case BICO__JSON_REAL: bico__jw_double(w, v->u.d); break;
    case BICO__JSON_STRING: bico__jw_string_n(w, v->u.s, v->n); break;
    case BICO__JSON_ARRAY:
      bico__jw_begin_array(w);
      for (size_t k = 0; k < v->n; k++) emit(w, &v->u.items[k]);
      bico__jw_end_array(w);
      break;
    case BICO__JSON_OBJECT:
      bico__jw_begin_object(w);
      for (size_t k = 0; k < v->n; k++) {
        bico__jw_key_n(w, v->u.members[k].key, v->u.members[k].key_len);
        emit(w, &v->u.members[k].value);
      }
      bico__jw_end_object(w);
      break;
  }
}

int main(int argc, char **argv) {
  int indent = argc > 1 ? atoi(argv[1]) : 0;
  size_t cap = 1 << 16, len = 0;
  char *buf = malloc(cap);
  size_t got;
  while (buf && (got = fread(buf + len, 1, cap - len, stdin)) > 0) {
    len += got;
    if (len == cap) buf = realloc(buf, cap *= 2);
  }
  if (buf == NULL) return 3;
  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK) return 3;
  bico__json_doc *doc = NULL;
  bico_status st = bico__json_parse(ctx, "stdin", buf, len, &doc);
  free(buf);
  if (st != BICO_OK) {
    fprintf(stderr, "%s\n", bico_ctx_errmsg(ctx));
    bico_ctx_free(ctx);
    return 1;
  }
  bico__jw w;
  bico__jw_init(&w, ctx, indent);
  emit(&w, &doc->root);
  st = bico__jw_finish(&w);
  if (st == BICO_OK)
    fwrite(w.buf, 1, w.len, stdout);
  else
    fprintf(stderr, "writer: %s\n", bico_ctx_errmsg(ctx));
  bico__jw_free(&w);
  bico__json_doc_free(doc);
  bico_ctx_free(ctx);
  return st == BICO_OK ? 0 : 2;
}
