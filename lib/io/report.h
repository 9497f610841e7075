/* The transfer and merge reports (internal): JSON written through the one
 * JSON writer of lib/base/json.c, with the reports' layout (top-level keys and
 * the entries of top-level arrays one per line, anything deeper inline)
 * and numbers at single precision (bico__jw_float).  Errors are sticky, as
 * in the writer: the first failure is kept and later calls do nothing. */
#ifndef BICO_REPORT_H
#define BICO_REPORT_H

#include "internal.h"
#include "json.h"

/* A report is a JSON writer: buf/len hold the text, err the first failure. */
typedef bico__jw bico__report;

/* A report with the layout above, ending in a newline. */
void bico__report_init(bico__report *r, bico_ctx *ctx);
/* One line, no newline, spelled as inside a whole report: a report entry
 * handed to a partial run's sink. */
void bico__report_init_compact(bico__report *r, bico_ctx *ctx);
void bico__report_free(bico__report *r);
/* The first failure of any call so far (BICO_OK if none). */
bico_status bico__report_status(const bico__report *r);
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
 * outputs (lib/io/fileio.h). */
struct bico__tmpfile;
bico_status bico__report_tmp(bico_ctx *ctx, const char *fn, const char *what,
                            const char *text, size_t len, const char *path,
                            struct bico__tmpfile *t);

#endif
