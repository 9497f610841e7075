/* JSON text for the reports (transfer, merge), written through the
 * temporary-file commit of lib/fileio.c. */
#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "json.h"
#include "report.h"

void bico__report_init(bico__report *r, bico_ctx *ctx) {
  memset(r, 0, sizeof *r);
  r->ctx = ctx;
}

void bico__report_free(bico__report *r) {
  bico__free(r->ctx, r->buf);
  r->buf = NULL;
  r->len = r->cap = 0;
}

static void put(bico__report *r, const char *s, size_t n) {
  if (r->status != BICO_OK) return;
  if (r->len + n + 1 > r->cap) {
    size_t cap = r->cap ? r->cap : 4096;
    while (r->len + n + 1 > cap) cap *= 2;
    char *b = bico__alloc(r->ctx, cap);
    if (b == NULL) {
      r->status = BICO_E_NOMEM;
      return;
    }
    if (r->len) memcpy(b, r->buf, r->len);
    bico__free(r->ctx, r->buf);
    r->buf = b;
    r->cap = cap;
  }
  memcpy(r->buf + r->len, s, n);
  r->len += n;
  r->buf[r->len] = '\0';
}

static void puts_(bico__report *r, const char *s) { put(r, s, strlen(s)); }

static void sep(bico__report *r) {
  if (r->after_key) {
    r->after_key = 0;
    return;
  }
  if (r->need_comma) puts_(r, ",");
  if (!r->compact && r->depth > 0 && r->depth <= 2) {
    puts_(r, "\n");
    for (int i = 0; i < r->depth; i++) puts_(r, "  ");
  }
}

void bico__report_begin_object(bico__report *r) {
  sep(r);
  puts_(r, "{");
  r->need_comma = 0;
  r->depth++;
}

void bico__report_end_object(bico__report *r) {
  r->depth--;
  puts_(r, "}");
  r->need_comma = 1;
  if (r->depth == 0 && !r->compact) puts_(r, "\n");
}

void bico__report_raw(bico__report *r, const char *json) {
  sep(r);
  puts_(r, json);
  r->need_comma = 1;
}

void bico__report_begin_array(bico__report *r) {
  sep(r);
  puts_(r, "[");
  r->need_comma = 0;
  r->depth++;
}

void bico__report_end_array(bico__report *r) {
  r->depth--;
  puts_(r, "]");
  r->need_comma = 1;
}

static void quoted(bico__report *r, const char *s) {
  puts_(r, "\"");
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    char esc[8];
    if (*p == '"' || *p == '\\') {
      esc[0] = '\\';
      esc[1] = (char)*p;
      put(r, esc, 2);
    } else if (*p < 0x20) {
      snprintf(esc, sizeof esc, "\\u%04x", *p);
      puts_(r, esc);
    } else {
      put(r, (const char *)p, 1);
    }
  }
  puts_(r, "\"");
}

void bico__report_key(bico__report *r, const char *key) {
  /* Keys inside deep objects stay on one line. */
  int d = r->depth;
  if (d > 2) r->depth = 3;
  sep(r);
  r->depth = d;
  quoted(r, key);
  puts_(r, ": ");
  r->after_key = 1;
}

void bico__report_string(bico__report *r, const char *s) {
  sep(r);
  quoted(r, s);
  r->need_comma = 1;
}

void bico__report_number(bico__report *r, double x) {
  int d = r->depth;
  r->depth = 3; /* array elements inline */
  sep(r);
  r->depth = d;
  char b[40];
  if (!isfinite(x)) {
    puts_(r, "null");
  } else if (x == floor(x) && fabs(x) < 9e15) {
    snprintf(b, sizeof b, "%.0f", x);
    puts_(r, b);
  } else {
    /* Nine significant digits (float precision, as bico-mpi writes them)
     * with '.' whatever the locale: a bare %g wrote "0,5" under a German
     * LC_NUMERIC, which is not JSON. */
    int n = snprintf(b, sizeof b, "%.9g", x);
    const char *dp = localeconv()->decimal_point;
    size_t dl = dp ? strlen(dp) : 0;
    char o[48];
    size_t k = 0;
    for (int i = 0; i < n && k + 1 < sizeof o;) {
      if (dl && strncmp(b + i, dp, dl) == 0) {
        o[k++] = '.';
        i += (int)dl;
      } else {
        o[k++] = b[i++];
      }
    }
    put(r, o, k);
  }
  r->need_comma = 1;
}

void bico__report_key_string(bico__report *r, const char *key, const char *s) {
  bico__report_key(r, key);
  bico__report_string(r, s);
}

void bico__report_key_number(bico__report *r, const char *key, double x) {
  bico__report_key(r, key);
  bico__report_number(r, x);
}

void bico__report_key_null(bico__report *r, const char *key) {
  bico__report_key(r, key);
  r->after_key = 0;
  puts_(r, "null");
  r->need_comma = 1;
}

bico_status bico__report_tmp(bico_ctx *ctx, const char *fn, const char *what,
                            const char *text, size_t len, const char *path,
                            bico__tmpfile *t) {
  bico_status st = bico__tmp_create(ctx, fn, what, path, t);
  if (st == BICO_OK) st = bico__tmp_write(ctx, fn, t, text, len);
  if (st == BICO_OK) st = bico__tmp_finish(ctx, fn, t);
  if (st != BICO_OK) bico__tmp_discard(ctx, t);
  return st;
}
