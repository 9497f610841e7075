/* The reports' vocabulary over lib/base/json.c's writer, and their temporary
 * file for the run's commit (lib/io/commit.c). */
#include <string.h>

#include "fileio.h"
#include "report.h"

void bico__report_init(bico__report *r, bico_ctx *ctx) {
  bico__jw_init(r, ctx, 2);
  r->wrap = 2;
}

void bico__report_init_compact(bico__report *r, bico_ctx *ctx) {
  /* Spelled as the entry reads inside a whole report (": " after keys), so
   * that an assembled report equals a single run's byte for byte. */
  bico__jw_init(r, ctx, 2);
  r->wrap = 0;
}

void bico__report_free(bico__report *r) { bico__jw_free(r); }

bico_status bico__report_status(const bico__report *r) { return r->err; }

void bico__report_begin_object(bico__report *r) { bico__jw_begin_object(r); }

void bico__report_end_object(bico__report *r) {
  bico__jw_end_object(r);
  /* A whole report ends its last line, as text files do. */
  if (r->depth == 0 && r->wrap > 0) bico__jw_raw(r, "\n", 1);
}

void bico__report_begin_array(bico__report *r) { bico__jw_begin_array(r); }
void bico__report_end_array(bico__report *r) { bico__jw_end_array(r); }
void bico__report_key(bico__report *r, const char *key) { bico__jw_key(r, key); }
void bico__report_string(bico__report *r, const char *s) { bico__jw_string(r, s); }
void bico__report_number(bico__report *r, double x) { bico__jw_float(r, x); }

void bico__report_raw(bico__report *r, const char *json) {
  bico__jw_value_raw(r, json, strlen(json));
}

void bico__report_key_string(bico__report *r, const char *key, const char *s) {
  bico__jw_key(r, key);
  bico__jw_string(r, s);
}

void bico__report_key_number(bico__report *r, const char *key, double x) {
  bico__jw_key(r, key);
  bico__jw_float(r, x);
}

void bico__report_key_null(bico__report *r, const char *key) {
  bico__jw_key(r, key);
  bico__jw_null(r);
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
