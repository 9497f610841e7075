/* What every step of the transfer driver uses (the bottom of the
 * transfer layer; it calls nothing above it): the run's log line, error
 * wrapping and the small helpers on tensor and module names (the names of
 * the file slots, methods and handlings are lib/base/names.c's).  No run state is made or
 * freed here (transfer_setup.c). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "transfer_internal.h"

void bico__xfer_log(bico__run *r, const char *fmt, ...) {
  if (r->t->log == NULL) return;
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  r->t->log(r->t->log_opaque, line);
}

/* Prefixes ctx's message with context ("tensor X: ..."). */
bico_status bico__xfer_wrap(bico_ctx *ctx, bico_status st, const char *what,
                        const char *name) {
  char detail[BICO_ERRMSG_CAP];
  snprintf(detail, sizeof detail, "%s", bico_ctx_errmsg(ctx));
  if (strstr(detail, name) != NULL)
    return st; /* already names it */
  return bico__fail(ctx, st, "%s %s: %s", what, name,
                    detail[0] ? detail : bico_strerror(st));
}

/* Length of a library function's name and ": " at the start of msg
 * ("stfile_open: "): lowercase words joined by '_', at least two; 0 when
 * there is none. */
static size_t api_prefix(const char *msg) {
  size_t i = 0, us = 0;
  if (!(msg[0] >= 'a' && msg[0] <= 'z')) return 0;
  while ((msg[i] >= 'a' && msg[i] <= 'z') || (msg[i] >= '0' && msg[i] <= '9') ||
         msg[i] == '_')
    us += msg[i++] == '_';
  if (us == 0 || msg[i - 1] == '_' || msg[i] != ':' || msg[i + 1] != ' ')
    return 0;
  return i + 2;
}

bico_status bico__xfer_wrap_file(bico_ctx *ctx, bico_status st, int which,
                                 const char *path) {
  char detail[BICO_ERRMSG_CAP];
  const char *m = bico_ctx_errmsg(ctx);
  m += api_prefix(m);
  size_t n = strlen(path);
  const char *sep = ": ";
  if (strncmp(m, path, n) == 0 && m[n] == ':' && m[n + 1] == ' ') {
    m += n + 2; /* "PATH: reason" */
  } else if (strncmp(m, path, n) == 0 && m[n] == ' ') {
    m += n; /* "PATH is a file, ..." */
    sep = "";
  }
  snprintf(detail, sizeof detail, "%s", m[0] ? m : bico_strerror(st));
  return bico__fail(ctx, st, "the %s file %s%s%s",
                    bico_transfer_file_name(which), path, sep, detail);
}

bico_status bico__xfer_prefix(bico_ctx *ctx, bico_status st, const char *fn) {
  const char *m = bico_ctx_errmsg(ctx);
  size_t n = strlen(fn);
  if (strncmp(m, fn, n) == 0 && m[n] == ':' && m[n + 1] == ' ') return st;
  char detail[BICO_ERRMSG_CAP];
  m += api_prefix(m);
  snprintf(detail, sizeof detail, "%s", m[0] ? m : bico_strerror(st));
  return bico__fail(ctx, st, "%s: %s", fn, detail);
}

const char *bico__xfer_tname(const bico_model *m, size_t i) {
  const char *n = "";
  bico_model_tensor(m, i, &n, NULL, NULL, NULL);
  return n;
}

const char *bico__xfer_mname(const bico_model *m, size_t i) {
  const char *n = "";
  bico_model_module(m, i, &n, NULL, NULL, NULL);
  return n;
}

size_t bico__xfer_numel(size_t ndim, const size_t *shape) {
  size_t n = 1;
  for (size_t d = 0; d < ndim; d++) n *= shape[d];
  return n;
}

int bico__xfer_is_bico(int method) {
  return method == BICO_METHOD_BICO || method == BICO_METHOD_BICO_IN ||
         method == BICO_METHOD_BICO_OUT;
}

void bico__xfer_transpose(const float *src, size_t rows, size_t cols,
                          float *dst) {
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++) dst[j * rows + i] = src[i * cols + j];
}
