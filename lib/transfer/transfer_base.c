/* What every step of the transfer driver uses (the bottom of the
 * transfer layer; it calls nothing above it): the names of the file
 * slots, methods and handlings, the run's log line, error wrapping and the
 * small helpers on tensor and module names.  No run state is made or
 * freed here (transfer_setup.c). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "transfer_internal.h"

const char *const bico__xfer_file_option[BICO__NFILES] = {
    NULL,           "source base",  "source tuned",  "task vector",
    "target base",  "source calib", "target calib",  "stats",
    "target votes", "output",       "delta output",  "report",
    "source adapter", "output adapter", "source config", "target config"};

static const char *const METHOD_NAME[] = {
    NULL, "bico", "bico-in", "bico-out", "gradfix", "naive", "pad"};
static const char *const NORM_MAP_NAME[] = {NULL, "act", "grad"};
#define COUNT(a) (sizeof(a) / sizeof *(a))

const char *bico_transfer_method_name(int method) {
  return method >= 0 && (size_t)method < COUNT(METHOD_NAME)
             ? METHOD_NAME[method]
             : NULL;
}

static bico_status from_name(const char *const *names, size_t n,
                             const char *name, int *out);

bico_status bico_transfer_method_from_name(const char *name, int *method) {
  return from_name(METHOD_NAME, COUNT(METHOD_NAME), name, method);
}

const char *bico_transfer_norm_map_name(int norm_map) {
  return norm_map >= 0 && (size_t)norm_map < COUNT(NORM_MAP_NAME)
             ? NORM_MAP_NAME[norm_map]
             : NULL;
}

bico_status bico_transfer_norm_map_from_name(const char *name, int *norm_map) {
  return from_name(NORM_MAP_NAME, COUNT(NORM_MAP_NAME), name, norm_map);
}

static const char *const STRUCTURE_NAME[] = {NULL, "heads", "free"};
static const char *const ROPE_NAME[] = {NULL, "half", "interleaved", "none"};

static const char *name_of(const char *const *names, size_t n, int v) {
  return v >= 0 && (size_t)v < n ? names[v] : NULL;
}

static bico_status from_name(const char *const *names, size_t n,
                             const char *name, int *out) {
  if (name == NULL || out == NULL) return BICO_E_NULL;
  for (size_t i = 1; i < n; i++)
    if (strcmp(name, names[i]) == 0) {
      *out = (int)i;
      return BICO_OK;
    }
  return BICO_E_NOTFOUND;
}

const char *bico_transfer_file_name(int which) {
  return which >= 1 && which < BICO__NFILES ? bico__xfer_file_option[which]
                                            : NULL;
}

bico_status bico_transfer_file_from_name(const char *name, int *which) {
  return from_name(bico__xfer_file_option, BICO__NFILES, name, which);
}

const char *bico_transfer_structure_name(int structure) {
  return name_of(STRUCTURE_NAME, COUNT(STRUCTURE_NAME), structure);
}

bico_status bico_transfer_structure_from_name(const char *name, int *structure) {
  return from_name(STRUCTURE_NAME, COUNT(STRUCTURE_NAME), name, structure);
}

const char *bico_transfer_rope_name(int rope) {
  return name_of(ROPE_NAME, COUNT(ROPE_NAME), rope);
}

bico_status bico_transfer_rope_from_name(const char *name, int *rope) {
  return from_name(ROPE_NAME, COUNT(ROPE_NAME), name, rope);
}

const char *bico_transfer_handling_name(int handling) {
  return handling >= BICO__H_FIRST && handling < BICO__H_COUNT
             ? bico__xfer_handling[handling]
             : NULL;
}

bico_status bico_transfer_handling_from_name(const char *name, int *handling) {
  if (name == NULL || handling == NULL) return BICO_E_NULL;
  for (int i = BICO__H_FIRST; i < BICO__H_COUNT; i++)
    if (strcmp(name, bico__xfer_handling[i]) == 0) {
      *handling = i;
      return BICO_OK;
    }
  return BICO_E_NOTFOUND;
}

const char *const bico__xfer_handling[BICO__H_COUNT] = {
    NULL,   "unchanged", "linear", "vector",
    "tied", "naive",     "padded", "masked"};

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
