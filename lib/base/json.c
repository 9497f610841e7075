/* Strict JSON reader and writer (see json.h). */
#include "json.h"

#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena ---- */

struct bico__arena_chunk {
  bico__arena_chunk *next;
  size_t used, cap;
  /* data follows, 16-aligned */
};

#define CHUNK_HDR ((sizeof(bico__arena_chunk) + 15) & ~(size_t)15)
#define CHUNK_MIN 16384

void bico__arena_init(bico__arena *a, bico_ctx *ctx) {
  a->ctx = ctx;
  a->head = NULL;
}

void *bico__arena_alloc(bico__arena *a, size_t size) {
  size_t align = size >= 16 ? 16 : 8;
  bico__arena_chunk *c = a->head;
  if (c != NULL) {
    size_t at = (c->used + align - 1) & ~(align - 1);
    if (at <= c->cap && size <= c->cap - at) {
      c->used = at + size;
      return (char *)c + CHUNK_HDR + at;
    }
  }
  size_t cap = size > CHUNK_MIN ? size : CHUNK_MIN;
  if (cap > SIZE_MAX - CHUNK_HDR) {
    bico__fail(a->ctx, BICO_E_NOMEM, "arena allocation of %zu bytes overflows",
               size);
    return NULL;
  }
  c = bico__alloc(a->ctx, CHUNK_HDR + cap);
  if (c == NULL) return NULL;
  c->next = a->head;
  c->cap = cap;
  c->used = size;
  a->head = c;
  return (char *)c + CHUNK_HDR;
}

char *bico__arena_strndup(bico__arena *a, const char *s, size_t len) {
  if (len == SIZE_MAX) return NULL;
  char *p = bico__arena_alloc(a, len + 1);
  if (p == NULL) return NULL;
  if (len) memcpy(p, s, len);
  p[len] = '\0';
  return p;
}

void bico__arena_free(bico__arena *a) {
  bico__arena_chunk *c = a->head;
  while (c != NULL) {
    bico__arena_chunk *next = c->next;
    bico__free(a->ctx, c);
    c = next;
  }
  a->head = NULL;
}

/* ---- UTF-8 ---- */

/* Length of the valid UTF-8 sequence at s (n bytes available), or 0 with
 * the reason in *why. */
static size_t utf8_seq(const unsigned char *s, size_t n, const char **why) {
  unsigned c = s[0];
  *why = "invalid UTF-8: bad continuation byte";
  if (c < 0x80) return 1;
  if (c < 0xC0) {
    *why = "invalid UTF-8: stray continuation byte";
    return 0;
  }
  if (c < 0xC2) {
    *why = "overlong UTF-8 encoding";
    return 0;
  }
  if (c < 0xE0) {
    if (n < 2 || (s[1] & 0xC0) != 0x80) return 0;
    return 2;
  }
  if (c < 0xF0) {
    if (n < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
    if (c == 0xE0 && s[1] < 0xA0) {
      *why = "overlong UTF-8 encoding";
      return 0;
    }
    if (c == 0xED && s[1] >= 0xA0) {
      *why = "UTF-8-encoded surrogate";
      return 0;
    }
    return 3;
  }
  if (c < 0xF5) {
    if (n < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 ||
        (s[3] & 0xC0) != 0x80)
      return 0;
    if (c == 0xF0 && s[1] < 0x90) {
      *why = "overlong UTF-8 encoding";
      return 0;
    }
    if (c == 0xF4 && s[1] >= 0x90) {
      *why = "UTF-8 code point above U+10FFFF";
      return 0;
    }
    return 4;
  }
  *why = "invalid UTF-8 lead byte";
  return 0;
}

int bico__utf8_valid(const char *s, size_t len, size_t *bad) {
  const unsigned char *p = (const unsigned char *)s;
  size_t i = 0;
  while (i < len) {
    const char *why;
    size_t k = utf8_seq(p + i, len - i, &why);
    if (k == 0) {
      if (bad) *bad = i;
      return 0;
    }
    i += k;
  }
  return 1;
}

/* ---- reader ---- */

typedef struct parser {
  bico_ctx *ctx;
  const char *what;
  const unsigned char *s;
  size_t len, pos;
  bico__arena *arena;
  /* Scratch stack of finished children of the open containers: a container
   * copies its own run into the arena when it closes. */
  bico__json_member *stack;
  size_t top, cap;
  bico_status err;
} parser;

static bico_status perr(parser *p, size_t at, const char *fmt, const char *arg) {
  if (p->err != BICO_OK) return p->err;
  char reason[256];
  snprintf(reason, sizeof reason, fmt, arg ? arg : "");
  p->err = bico__fail(p->ctx, BICO_E_FORMAT, "%s: invalid JSON at byte %zu: %s",
                      p->what, at, reason);
  return p->err;
}

static void skip_ws(parser *p) {
  while (p->pos < p->len) {
    unsigned char c = p->s[p->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->pos++;
  }
}

/* A printable rendering of the byte at pos for messages. */
static const char *show_byte(parser *p, char *buf, size_t cap) {
  if (p->pos >= p->len) return "end of input";
  unsigned char c = p->s[p->pos];
  if (c >= 0x20 && c < 0x7f)
    snprintf(buf, cap, "'%c'", c);
  else
    snprintf(buf, cap, "byte 0x%02x", c);
  return buf;
}

static int push(parser *p, const bico__json_member *m) {
  bico__json_member *ns =
      bico__grow(p->ctx, p->stack, p->top, &p->cap, 64, sizeof *ns);
  if (ns == NULL) {
    p->err = BICO_E_NOMEM;
    return 0;
  }
  p->stack = ns;
  p->stack[p->top++] = *m;
  return 1;
}

static int hexval(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static int read_u4(parser *p, size_t at, unsigned *out) {
  if (p->len - at < 4) return 0;
  unsigned v = 0;
  for (int k = 0; k < 4; k++) {
    int h = hexval(p->s[at + k]);
    if (h < 0) return 0;
    v = v * 16 + (unsigned)h;
  }
  *out = v;
  return 1;
}

static size_t put_utf8(char *o, unsigned cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xC0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xE0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (char)(0xF0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

/* Parses a string starting at the opening quote into the arena. */
static int parse_string(parser *p, const char **out, size_t *out_len) {
  size_t start = p->pos;
  p->pos++; /* opening quote */
  /* Pass 1: find the end and validate; decoded length <= raw length. */
  size_t i = p->pos;
  for (;;) {
    if (i >= p->len) {
      perr(p, start, "unterminated string", NULL);
      return 0;
    }
    unsigned char c = p->s[i];
    if (c == '"') break;
    if (c < 0x20) {
      char b[8];
      snprintf(b, sizeof b, "0x%02x", c);
      perr(p, i, "raw control byte %s in a string (must be escaped)", b);
      return 0;
    }
    if (c == '\\') {
      if (i + 1 >= p->len) {
        perr(p, start, "unterminated string", NULL);
        return 0;
      }
      unsigned char e = p->s[i + 1];
      if (e == 'u') {
        unsigned u;
        if (!read_u4(p, i + 2, &u)) {
          perr(p, i, "bad \\u escape (needs 4 hex digits)", NULL);
          return 0;
        }
        if (u >= 0xD800 && u <= 0xDBFF) {
          unsigned lo;
          if (i + 7 >= p->len || p->s[i + 6] != '\\' || p->s[i + 7] != 'u' ||
              !read_u4(p, i + 8, &lo) || lo < 0xDC00 || lo > 0xDFFF) {
            perr(p, i, "unpaired high surrogate in \\u escape", NULL);
            return 0;
          }
          i += 12;
        } else if (u >= 0xDC00 && u <= 0xDFFF) {
          perr(p, i, "unpaired low surrogate in \\u escape", NULL);
          return 0;
        } else {
          i += 6;
        }
        continue;
      }
      if (strchr("\"\\/bfnrt", e) == NULL || e == '\0') {
        char b[16];
        if (e >= 0x20 && e < 0x7f)
          snprintf(b, sizeof b, "\\%c", e);
        else
          snprintf(b, sizeof b, "\\ + 0x%02x", e);
        perr(p, i, "bad escape %s", b);
        return 0;
      }
      i += 2;
      continue;
    }
    const char *why;
    size_t k = utf8_seq(p->s + i, p->len - i, &why);
    if (k == 0) {
      perr(p, i, "%s in a string", why);
      return 0;
    }
    i += k;
  }
  size_t end = i;
  char *o = bico__arena_alloc(p->arena, end - p->pos + 1);
  if (o == NULL) {
    p->err = BICO_E_NOMEM;
    return 0;
  }
  /* Pass 2: decode (already validated). */
  size_t n = 0;
  for (i = p->pos; i < end;) {
    unsigned char c = p->s[i];
    if (c != '\\') {
      o[n++] = (char)c;
      i++;
      continue;
    }
    unsigned char e = p->s[i + 1];
    switch (e) {
      case 'b': o[n++] = '\b'; i += 2; break;
      case 'f': o[n++] = '\f'; i += 2; break;
      case 'n': o[n++] = '\n'; i += 2; break;
      case 'r': o[n++] = '\r'; i += 2; break;
      case 't': o[n++] = '\t'; i += 2; break;
      case 'u': {
        unsigned u, lo;
        read_u4(p, i + 2, &u);
        i += 6;
        if (u >= 0xD800 && u <= 0xDBFF) {
          read_u4(p, i + 2, &lo);
          i += 6;
          u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00);
        }
        n += put_utf8(o + n, u);
        break;
      }
      default: o[n++] = (char)e; i += 2; break; /* " \ / */
    }
  }
  o[n] = '\0';
  p->pos = end + 1;
  *out = o;
  *out_len = n;
  return 1;
}

static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

static int parse_number(parser *p, bico__json *v) {
  size_t start = p->pos, i = p->pos;
  int neg = 0, integral = 1;
  if (i < p->len && p->s[i] == '-') {
    neg = 1;
    i++;
  }
  if (i >= p->len || !is_digit(p->s[i])) {
    perr(p, start, "'-' not followed by a digit", NULL);
    return 0;
  }
  if (p->s[i] == '0') {
    i++;
    if (i < p->len && is_digit(p->s[i])) {
      perr(p, start, "number with a leading zero", NULL);
      return 0;
    }
  } else {
    while (i < p->len && is_digit(p->s[i])) i++;
  }
  size_t int_end = i;
  if (i < p->len && p->s[i] == '.') {
    integral = 0;
    i++;
    if (i >= p->len || !is_digit(p->s[i])) {
      perr(p, start, "no digit after the decimal point", NULL);
      return 0;
    }
    while (i < p->len && is_digit(p->s[i])) i++;
  }
  if (i < p->len && (p->s[i] == 'e' || p->s[i] == 'E')) {
    integral = 0;
    i++;
    if (i < p->len && (p->s[i] == '+' || p->s[i] == '-')) i++;
    if (i >= p->len || !is_digit(p->s[i])) {
      perr(p, start, "no digit in the exponent", NULL);
      return 0;
    }
    while (i < p->len && is_digit(p->s[i])) i++;
  }
  v->pos = start;
  if (integral) {
    /* Accumulate negatively so INT64_MIN fits. */
    int64_t acc = 0;
    for (size_t k = start + (size_t)neg; k < int_end; k++) {
      int d = p->s[k] - '0';
      if (acc < (INT64_MIN + d) / 10) {
        perr(p, start, "integer out of the int64 range", NULL);
        return 0;
      }
      acc = acc * 10 - d;
    }
    if (!neg) {
      if (acc == INT64_MIN) {
        perr(p, start, "integer out of the int64 range", NULL);
        return 0;
      }
      acc = -acc;
    }
    v->type = BICO__JSON_INT;
    v->u.i = acc;
  } else {
    /* strtod follows LC_NUMERIC: swap '.' for the locale's point. */
    char buf[512];
    size_t n = i - start;
    if (n >= sizeof buf - 8) {
      perr(p, start, "number literal too long", NULL);
      return 0;
    }
    const char *dp = localeconv()->decimal_point;
    size_t dpl = (dp && *dp) ? strlen(dp) : 1;
    size_t o = 0;
    for (size_t k = start; k < i; k++) {
      if (p->s[k] == '.' && dp && *dp && dpl < 8) {
        memcpy(buf + o, dp, dpl);
        o += dpl;
      } else {
        buf[o++] = (char)p->s[k];
      }
    }
    buf[o] = '\0';
    double d = strtod(buf, NULL);
    if (!isfinite(d)) {
      perr(p, start, "number out of the double range", NULL);
      return 0;
    }
    v->type = BICO__JSON_REAL;
    v->u.d = d;
  }
  p->pos = i;
  return 1;
}

static int key_cmp(const void *a, const void *b) {
  const bico__json_member *x = *(bico__json_member *const *)a;
  const bico__json_member *y = *(bico__json_member *const *)b;
  size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
  int c = memcmp(x->key, y->key, n);
  if (c != 0) return c;
  return (x->key_len > y->key_len) - (x->key_len < y->key_len);
}

/* Duplicate keys: pairwise for small objects, sorted for large ones. */
static int check_dups(parser *p, bico__json_member *m, size_t n) {
  const bico__json_member *dup = NULL;
  if (n <= 16) {
    for (size_t a = 0; a < n && !dup; a++)
      for (size_t b = a + 1; b < n; b++)
        if (m[a].key_len == m[b].key_len &&
            memcmp(m[a].key, m[b].key, m[a].key_len) == 0) {
          dup = &m[b];
          break;
        }
  } else {
    bico__json_member **idx = bico__alloc(p->ctx, n * sizeof *idx);
    if (idx == NULL) {
      p->err = BICO_E_NOMEM;
      return 0;
    }
    for (size_t a = 0; a < n; a++) idx[a] = &m[a];
    qsort(idx, n, sizeof *idx, key_cmp);
    for (size_t a = 1; a < n; a++)
      if (key_cmp(&idx[a - 1], &idx[a]) == 0) {
        /* report the later occurrence */
        dup = idx[a - 1] > idx[a] ? idx[a - 1] : idx[a];
        break;
      }
    bico__free(p->ctx, idx);
  }
  if (dup) {
    char shown[128];
    snprintf(shown, sizeof shown, "%.100s%s", dup->key,
             strlen(dup->key) > 100 ? "..." : "");
    /* value.pos of the duplicate's value is the best position we kept */
    perr(p, dup->value.pos, "duplicate key \"%s\"", shown);
    return 0;
  }
  return 1;
}

static int parse_value(parser *p, bico__json *v, int depth);

static int parse_container(parser *p, bico__json *v, int depth, int is_obj) {
  size_t start = p->pos;
  if (depth >= BICO__JSON_MAX_DEPTH) {
    char b[16];
    snprintf(b, sizeof b, "%d", BICO__JSON_MAX_DEPTH);
    perr(p, start, "nesting deeper than %s levels", b);
    return 0;
  }
  unsigned char close = is_obj ? '}' : ']';
  p->pos++;
  size_t base = p->top;
  skip_ws(p);
  if (p->pos < p->len && p->s[p->pos] == close) {
    p->pos++;
  } else {
    for (;;) {
      bico__json_member m;
      memset(&m, 0, sizeof m);
      char b[32];
      if (is_obj) {
        skip_ws(p);
        if (p->pos >= p->len || p->s[p->pos] != '"') {
          if (p->pos < p->len && p->s[p->pos] == '}')
            perr(p, p->pos, "trailing comma before '}'", NULL);
          else
            perr(p, p->pos, "expected a string key, found %s",
                 show_byte(p, b, sizeof b));
          return 0;
        }
        if (!parse_string(p, &m.key, &m.key_len)) return 0;
        skip_ws(p);
        if (p->pos >= p->len || p->s[p->pos] != ':') {
          perr(p, p->pos, "expected ':' after a key, found %s",
               show_byte(p, b, sizeof b));
          return 0;
        }
        p->pos++;
      }
      skip_ws(p);
      if (!is_obj && p->pos < p->len && p->s[p->pos] == ']' &&
          p->top > base) {
        perr(p, p->pos, "trailing comma before ']'", NULL);
        return 0;
      }
      if (!parse_value(p, &m.value, depth + 1)) return 0;
      if (!push(p, &m)) return 0;
      skip_ws(p);
      if (p->pos < p->len && p->s[p->pos] == ',') {
        p->pos++;
        continue;
      }
      if (p->pos < p->len && p->s[p->pos] == close) {
        p->pos++;
        break;
      }
      perr(p, p->pos, is_obj ? "expected ',' or '}', found %s"
                             : "expected ',' or ']', found %s",
           show_byte(p, b, sizeof b));
      return 0;
    }
  }
  size_t n = p->top - base;
  v->pos = start;
  v->n = n;
  if (is_obj) {
    v->type = BICO__JSON_OBJECT;
    if (n > 1 && !check_dups(p, p->stack + base, n)) return 0;
    bico__json_member *m = NULL;
    if (n) {
      m = bico__arena_alloc(p->arena, n * sizeof *m);
      if (m == NULL) {
        p->err = BICO_E_NOMEM;
        return 0;
      }
      memcpy(m, p->stack + base, n * sizeof *m);
    }
    v->u.members = m;
  } else {
    v->type = BICO__JSON_ARRAY;
    bico__json *items = NULL;
    if (n) {
      items = bico__arena_alloc(p->arena, n * sizeof *items);
      if (items == NULL) {
        p->err = BICO_E_NOMEM;
        return 0;
      }
      for (size_t k = 0; k < n; k++) items[k] = p->stack[base + k].value;
    }
    v->u.items = items;
  }
  p->top = base;
  return 1;
}

static int match_word(parser *p, const char *w) {
  size_t n = strlen(w);
  return p->len - p->pos >= n && memcmp(p->s + p->pos, w, n) == 0;
}

static int parse_value(parser *p, bico__json *v, int depth) {
  memset(v, 0, sizeof *v);
  v->pos = p->pos;
  char b[32];
  if (p->pos >= p->len) {
    perr(p, p->pos, "unexpected end of input, expected a value", NULL);
    return 0;
  }
  unsigned char c = p->s[p->pos];
  switch (c) {
    case '{': return parse_container(p, v, depth, 1);
    case '[': return parse_container(p, v, depth, 0);
    case '"':
      v->type = BICO__JSON_STRING;
      return parse_string(p, &v->u.s, &v->n);
    case 't':
      if (match_word(p, "true")) {
        v->type = BICO__JSON_BOOL;
        v->u.b = 1;
        p->pos += 4;
        return 1;
      }
      break;
    case 'f':
      if (match_word(p, "false")) {
        v->type = BICO__JSON_BOOL;
        v->u.b = 0;
        p->pos += 5;
        return 1;
      }
      break;
    case 'n':
      if (match_word(p, "null")) {
        v->type = BICO__JSON_NULL;
        p->pos += 4;
        return 1;
      }
      break;
    case 'N':
    case 'I':
      perr(p, p->pos, "NaN and Infinity are not JSON", NULL);
      return 0;
    default:
      if (c == '-' || is_digit(c)) {
        if (c == '-' && match_word(p, "-Infinity")) {
          perr(p, p->pos, "NaN and Infinity are not JSON", NULL);
          return 0;
        }
        return parse_number(p, v);
      }
      break;
  }
  perr(p, p->pos, "expected a value, found %s", show_byte(p, b, sizeof b));
  return 0;
}

bico_status bico__json_parse(bico_ctx *ctx, const char *what, const char *text,
                             size_t len, bico__json_doc **out) {
  *out = NULL;
  bico__json_doc *doc = bico__alloc(ctx, sizeof *doc);
  if (doc == NULL) return BICO_E_NOMEM;
  memset(doc, 0, sizeof *doc);
  bico__arena_init(&doc->arena, ctx);
  parser p;
  memset(&p, 0, sizeof p);
  p.ctx = ctx;
  p.what = what ? what : "JSON";
  p.s = (const unsigned char *)text;
  p.len = len;
  p.arena = &doc->arena;
  skip_ws(&p);
  if (p.pos >= p.len) {
    perr(&p, p.pos, "empty document", NULL);
  } else if (parse_value(&p, &doc->root, 0)) {
    skip_ws(&p);
    if (p.pos < p.len) {
      char b[32];
      perr(&p, p.pos, "unexpected %s after the top-level value",
           show_byte(&p, b, sizeof b));
    }
  }
  bico__free(ctx, p.stack);
  if (p.err != BICO_OK) {
    bico__json_doc_free(doc);
    return p.err;
  }
  *out = doc;
  return BICO_OK;
}

void bico__json_doc_free(bico__json_doc *doc) {
  if (doc == NULL) return;
  bico_ctx *ctx = doc->arena.ctx;
  bico__arena_free(&doc->arena);
  bico__free(ctx, doc);
}

const bico__json *bico__json_get(const bico__json *v, const char *key) {
  if (v == NULL || v->type != BICO__JSON_OBJECT) return NULL;
  size_t kl = strlen(key);
  for (size_t i = 0; i < v->n; i++)
    if (v->u.members[i].key_len == kl &&
        memcmp(v->u.members[i].key, key, kl) == 0)
      return &v->u.members[i].value;
  return NULL;
}

const char *bico__json_type_name(bico__json_type t) {
  switch (t) {
    case BICO__JSON_NULL: return "null";
    case BICO__JSON_BOOL: return "boolean";
    case BICO__JSON_INT: return "integer";
    case BICO__JSON_REAL: return "number";
    case BICO__JSON_STRING: return "string";
    case BICO__JSON_ARRAY: return "array";
    case BICO__JSON_OBJECT: return "object";
  }
  return "unknown";
}

/* ---- writer ---- */

void bico__jw_init(bico__jw *w, bico_ctx *ctx, int indent) {
  memset(w, 0, sizeof *w);
  w->ctx = ctx;
  w->indent = indent < 0 ? 0 : indent;
  w->wrap = BICO__JSON_MAX_DEPTH;
}

static void jw_fail(bico__jw *w, bico_status st, const char *msg) {
  if (w->err != BICO_OK) return;
  w->err = st;
  if (st != BICO_E_NOMEM) bico__fail(w->ctx, st, "json writer: %s", msg);
}

void bico__jw_raw(bico__jw *w, const char *s, size_t len) {
  if (w->err != BICO_OK) return;
  if (len + 1 > w->cap - w->len || w->buf == NULL) {
    size_t need = w->len + len + 1;
    if (need < w->len) {
      jw_fail(w, BICO_E_NOMEM, "size overflow");
      return;
    }
    size_t ncap = w->cap ? w->cap : 256;
    while (ncap < need) {
      if (ncap > SIZE_MAX / 2) {
        ncap = need;
        break;
      }
      ncap *= 2;
    }
    char *nb = bico__alloc(w->ctx, ncap);
    if (nb == NULL) {
      w->err = BICO_E_NOMEM;
      return;
    }
    if (w->len) memcpy(nb, w->buf, w->len);
    bico__free(w->ctx, w->buf);
    w->buf = nb;
    w->cap = ncap;
  }
  if (len) memcpy(w->buf + w->len, s, len);
  w->len += len;
  w->buf[w->len] = '\0';
}

/* A line break before an entry at `level` (its container's depth), indented
 * to the writer's current depth. */
static void jw_newline(bico__jw *w, int level) {
  if (!w->indent || level > w->wrap) return;
  bico__jw_raw(w, "\n", 1);
  for (int d = 0; d < w->depth; d++)
    for (int k = 0; k < w->indent; k++) bico__jw_raw(w, " ", 1);
}

/* Before a value or key: the comma and line break it needs. */
static void jw_pre(bico__jw *w, int is_key) {
  if (w->after_key) {
    if (is_key) jw_fail(w, BICO_E_INTERNAL, "key after key");
    w->after_key = 0;
    return;
  }
  if (w->depth == 0) {
    if (w->len != 0) jw_fail(w, BICO_E_INTERNAL, "second top-level value");
    return;
  }
  if (w->nonempty[w->depth]) bico__jw_raw(w, ",", 1);
  w->nonempty[w->depth] = 1;
  jw_newline(w, w->depth);
}

static void jw_open(bico__jw *w, const char *c) {
  jw_pre(w, 0);
  bico__jw_raw(w, c, 1);
  if (w->depth >= BICO__JSON_MAX_DEPTH) {
    jw_fail(w, BICO_E_INTERNAL, "nesting too deep");
    return;
  }
  w->depth++;
  w->nonempty[w->depth] = 0;
}

static void jw_close(bico__jw *w, const char *c) {
  if (w->depth == 0 || w->after_key) {
    jw_fail(w, BICO_E_INTERNAL, "unbalanced end");
    return;
  }
  int had = w->nonempty[w->depth];
  w->depth--;
  if (had) jw_newline(w, w->depth + 1);
  bico__jw_raw(w, c, 1);
}

void bico__jw_begin_object(bico__jw *w) { jw_open(w, "{"); }
void bico__jw_end_object(bico__jw *w) { jw_close(w, "}"); }
void bico__jw_begin_array(bico__jw *w) { jw_open(w, "["); }
void bico__jw_end_array(bico__jw *w) { jw_close(w, "]"); }

static void jw_quoted(bico__jw *w, const char *s, size_t len) {
  size_t bad;
  if (!bico__utf8_valid(s, len, &bad)) {
    jw_fail(w, BICO_E_ARG, "string is not valid UTF-8");
    return;
  }
  bico__jw_raw(w, "\"", 1);
  size_t run = 0; /* bytes copied verbatim in one go */
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)s[i];
    const char *esc = NULL;
    char u[8];
    switch (c) {
      case '"': esc = "\\\""; break;
      case '\\': esc = "\\\\"; break;
      case '\n': esc = "\\n"; break;
      case '\r': esc = "\\r"; break;
      case '\t': esc = "\\t"; break;
      case '\b': esc = "\\b"; break;
      case '\f': esc = "\\f"; break;
      default:
        if (c < 0x20) {
          snprintf(u, sizeof u, "\\u%04x", c);
          esc = u;
        }
    }
    if (esc) {
      bico__jw_raw(w, s + i - run, run);
      run = 0;
      bico__jw_raw(w, esc, strlen(esc));
    } else {
      run++;
    }
  }
  bico__jw_raw(w, s + len - run, run);
  bico__jw_raw(w, "\"", 1);
}

void bico__jw_key_n(bico__jw *w, const char *key, size_t len) {
  if (w->depth == 0) {
    jw_fail(w, BICO_E_INTERNAL, "key outside an object");
    return;
  }
  jw_pre(w, 1);
  jw_quoted(w, key, len);
  bico__jw_raw(w, w->indent ? ": " : ":", w->indent ? 2 : 1);
  w->after_key = 1;
}

void bico__jw_key(bico__jw *w, const char *key) {
  bico__jw_key_n(w, key, strlen(key));
}

void bico__jw_string_n(bico__jw *w, const char *s, size_t len) {
  jw_pre(w, 0);
  jw_quoted(w, s, len);
}

void bico__jw_string(bico__jw *w, const char *s) {
  bico__jw_string_n(w, s, strlen(s));
}

void bico__jw_int(bico__jw *w, int64_t v) {
  char b[32];
  int n = snprintf(b, sizeof b, "%lld", (long long)v);
  jw_pre(w, 0);
  bico__jw_raw(w, b, (size_t)n);
}

void bico__jw_uint(bico__jw *w, uint64_t v) {
  char b[32];
  int n = snprintf(b, sizeof b, "%llu", (unsigned long long)v);
  jw_pre(w, 0);
  bico__jw_raw(w, b, (size_t)n);
}

/* b[0..n) with the locale's decimal point made '.', into o (cap bytes, at
 * least n + 1); returns the length. */
static size_t jw_c_locale(const char *b, int n, char *o, size_t cap) {
  const char *dp = localeconv()->decimal_point;
  size_t k = 0;
  size_t dpl = (dp && *dp) ? strlen(dp) : 0;
  for (int i = 0; i < n && k < cap - 1;) {
    if (dpl && strncmp(b + i, dp, dpl) == 0) {
      o[k++] = '.';
      i += (int)dpl;
    } else {
      o[k++] = b[i++];
    }
  }
  o[k] = '\0';
  return k;
}

void bico__jw_double(bico__jw *w, double v) {
  if (!isfinite(v)) {
    bico__jw_null(w);
    return;
  }
  /* The shortest of %.15g..%.17g that reads back exactly. */
  char b[64];
  int n = 0;
  for (int prec = 15; prec <= 17; prec++) {
    n = snprintf(b, sizeof b, "%.*g", prec, v);
    if (strtod(b, NULL) == v) break;
  }
  char o[64];
  size_t k = jw_c_locale(b, n, o, sizeof o);
  /* Integral values keep a fraction ("2.0", "-0.0") so that readers such
   * as Python's json load them as floats, not integers. */
  if (strpbrk(o, ".eEn") == NULL && k + 2 < sizeof o) {
    o[k++] = '.';
    o[k++] = '0';
  }
  jw_pre(w, 0);
  bico__jw_raw(w, o, k);
}

void bico__jw_float(bico__jw *w, double v) {
  if (!isfinite(v)) {
    bico__jw_null(w);
    return;
  }
  char b[64];
  int n;
  if (v == floor(v) && fabs(v) < 9007199254740992.0) {
    n = snprintf(b, sizeof b, "%.0f", v);
  } else {
    float f = (float)v;
    n = 0;
    for (int prec = 6; prec <= 9; prec++) {
      n = snprintf(b, sizeof b, "%.*g", prec, (double)f);
      if ((float)strtod(b, NULL) == f) break;
    }
  }
  char o[64];
  size_t k = jw_c_locale(b, n, o, sizeof o);
  jw_pre(w, 0);
  bico__jw_raw(w, o, k);
}

void bico__jw_value_raw(bico__jw *w, const char *json, size_t len) {
  jw_pre(w, 0);
  bico__jw_raw(w, json, len);
}

void bico__jw_bool(bico__jw *w, int v) {
  jw_pre(w, 0);
  bico__jw_raw(w, v ? "true" : "false", v ? 4 : 5);
}

void bico__jw_null(bico__jw *w) {
  jw_pre(w, 0);
  bico__jw_raw(w, "null", 4);
}

bico_status bico__jw_finish(bico__jw *w) {
  if (w->err == BICO_OK && (w->depth != 0 || w->after_key || w->len == 0))
    jw_fail(w, BICO_E_INTERNAL, "document incomplete");
  if (w->err == BICO_E_NOMEM)
    bico__fail(w->ctx, BICO_E_NOMEM, "json writer: out of memory");
  return w->err;
}

void bico__jw_free(bico__jw *w) {
  bico__free(w->ctx, w->buf);
  w->buf = NULL;
  w->len = w->cap = 0;
}
