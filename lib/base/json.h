/* Strict JSON (RFC 8259) reader and writer, internal to libbico.
 *
 * Reader: a recursive-descent parser into an arena owned by a document.
 * Strict: no trailing commas, no comments, no NaN/Infinity literals, no
 * leading zeros, only the six JSON whitespace bytes between tokens, escapes
 * checked (\uXXXX with surrogate pairs paired), strings valid UTF-8 without
 * raw control bytes, duplicate object keys rejected, nesting at most
 * BICO__JSON_MAX_DEPTH.  Integral numbers (no fraction or exponent) are
 * int64 and must fit; others are doubles.  Objects keep their key order.
 *
 * Writer: a growable buffer with structural calls (begin/end, key, values)
 * that places commas and escapes strings; errors are sticky and reported
 * once by bico__jw_finish. */
#ifndef BICO_JSON_H
#define BICO_JSON_H

#include <stddef.h>
#include <stdint.h>
#include "internal.h"

#define BICO__JSON_MAX_DEPTH 64

/* ---- arena: bump allocation through the context's allocator ---- */

typedef struct bico__arena_chunk bico__arena_chunk;
typedef struct bico__arena {
  bico_ctx *ctx;
  bico__arena_chunk *head;
} bico__arena;

void bico__arena_init(bico__arena *a, bico_ctx *ctx);
/* size bytes aligned to 8 (or 16 when size >= 16); NULL and a NOMEM failure
 * on ctx when out of memory. */
void *bico__arena_alloc(bico__arena *a, size_t size);
/* A NUL-terminated copy of s[0..len). */
char *bico__arena_strndup(bico__arena *a, const char *s, size_t len);
void bico__arena_free(bico__arena *a);

/* ---- reader ---- */

typedef enum bico__json_type {
  BICO__JSON_NULL = 0,
  BICO__JSON_BOOL = 1,
  BICO__JSON_INT = 2,    /* integral number that fits int64 */
  BICO__JSON_REAL = 3,   /* number with fraction or exponent */
  BICO__JSON_STRING = 4,
  BICO__JSON_ARRAY = 5,
  BICO__JSON_OBJECT = 6
} bico__json_type;

typedef struct bico__json bico__json;
typedef struct bico__json_member bico__json_member;

struct bico__json {
  bico__json_type type;
  size_t pos; /* byte offset of the value in the parsed text */
  size_t n;   /* STRING: bytes (without the NUL); ARRAY/OBJECT: entries */
  union {
    int b;
    int64_t i;
    double d;
    const char *s;               /* NUL-terminated; may hold \u0000 */
    bico__json *items;           /* ARRAY */
    bico__json_member *members;  /* OBJECT, in source order */
  } u;
};

struct bico__json_member {
  const char *key; /* NUL-terminated */
  size_t key_len;  /* bytes; key_len != strlen(key) when it holds \u0000 */
  bico__json value;
};

typedef struct bico__json_doc {
  bico__arena arena;
  bico__json root;
} bico__json_doc;

/* Parses text[0..len) into a new document (*out, freed with
 * bico__json_doc_free).  On failure: BICO_E_FORMAT with the message
 * "<what>: invalid JSON at byte <k>: <reason>" on ctx (or BICO_E_NOMEM). */
bico_status bico__json_parse(bico_ctx *ctx, const char *what, const char *text,
                             size_t len, bico__json_doc **out);
void bico__json_doc_free(bico__json_doc *doc);

/* The member of object v named key (a NUL-free string), or NULL (also when v
 * is not an object).  Linear in the member count. */
const bico__json *bico__json_get(const bico__json *v, const char *key);
/* "null", "boolean", "integer", "number", "string", "array", "object". */
const char *bico__json_type_name(bico__json_type t);

/* 1 if s[0..len) is valid UTF-8 (no overlongs, surrogates or code points
 * above U+10FFFF), else 0; *bad (may be NULL) gets the first bad offset. */
int bico__utf8_valid(const char *s, size_t len, size_t *bad);

/* ---- writer ---- */

typedef struct bico__jw {
  bico_ctx *ctx;
  char *buf;
  size_t len, cap;
  bico_status err;   /* first failure (sticky) */
  int indent;        /* 0: compact; else spaces per level, one entry a line */
  int wrap;          /* with indent: entries at depth <= wrap get their own
                        line, deeper ones stay inline (bico__jw_init: every
                        depth; 0: one line with the indented form's ": ") */
  int depth;
  int after_key;     /* a key was written: the next value follows ':' */
  unsigned char nonempty[BICO__JSON_MAX_DEPTH + 1];
} bico__jw;

void bico__jw_init(bico__jw *w, bico_ctx *ctx, int indent);
void bico__jw_begin_object(bico__jw *w);
void bico__jw_end_object(bico__jw *w);
void bico__jw_begin_array(bico__jw *w);
void bico__jw_end_array(bico__jw *w);
/* Inside an object: the key of the next value (UTF-8, escaped as needed). */
void bico__jw_key(bico__jw *w, const char *key);
void bico__jw_key_n(bico__jw *w, const char *key, size_t len);
void bico__jw_string(bico__jw *w, const char *s);
void bico__jw_string_n(bico__jw *w, const char *s, size_t len);
void bico__jw_int(bico__jw *w, int64_t v);
void bico__jw_uint(bico__jw *w, uint64_t v);
/* The shortest of "%.15g".."%.17g" that reads back exactly, with ".0"
 * added to integral values (so readers keep them floating), independent of
 * the locale; NaN and Inf are written as null (JSON has no literal for
 * them). */
void bico__jw_double(bico__jw *w, double v);
/* A single-precision quantity: integral values below 2^53 in magnitude
 * as integers, others with the fewest significant digits (6 to 9) that
 * read back as the same float; locale-independent; NaN and Inf as null. */
void bico__jw_float(bico__jw *w, double v);
void bico__jw_bool(bico__jw *w, int v);
void bico__jw_null(bico__jw *w);
/* A value given as JSON text (checked by the caller), placed like any
 * other value (comma, line break). */
void bico__jw_value_raw(bico__jw *w, const char *json, size_t len);
/* Appends bytes verbatim (padding, pre-formatted text). */
void bico__jw_raw(bico__jw *w, const char *s, size_t len);
/* BICO_OK when the document is complete and every call succeeded (the
 * buffer, NUL-terminated, stays in w->buf with w->len bytes); else the
 * first failure, with its message on ctx.  Does not free. */
bico_status bico__jw_finish(bico__jw *w);
void bico__jw_free(bico__jw *w);

#endif
