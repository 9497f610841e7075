/* A small JSON emitter for the transfer report (internal).  Errors are
 * sticky: the first failure is kept in `status` and later calls do
 * nothing. */
#ifndef BICO_REPORT_H
#define BICO_REPORT_H

#include "internal.h"

typedef struct bico__report {
  bico_ctx *ctx;
  char *buf;
  size_t len, cap;
  bico_status status;
  int need_comma, after_key, depth;
  int compact; /* one line, no trailing newline (set after init) */
} bico__report;

void bico__report_init(bico__report *r, bico_ctx *ctx);
void bico__report_free(bico__report *r);
void bico__report_begin_object(bico__report *r);
void bico__report_end_object(bico__report *r);
void bico__report_begin_array(bico__report *r);
void bico__report_end_array(bico__report *r);
void bico__report_key(bico__report *r, const char *key);
void bico__report_string(bico__report *r, const char *s);
void bico__report_number(bico__report *r, double x);
void bico__report_key_string(bico__report *r, const char *key, const char *s);
void bico__report_key_number(bico__report *r, const char *key, double x);
void bico__report_key_null(bico__report *r, const char *key);
/* A value given as JSON text (one line), e.g. a stored report entry. */
void bico__report_raw(bico__report *r, const char *json);

/* Writes text[0..len) to a finished temporary file for `path` (role
 * `what` in messages), ready for bico__commit with the run's other
 * outputs (lib/fileio.h). */
struct bico__tmpfile;
bico_status bico__report_tmp(bico_ctx *ctx, const char *fn, const char *what,
                            const char *text, size_t len, const char *path,
                            struct bico__tmpfile *t);

#endif
