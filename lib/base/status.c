/* Status codes, versions, and the one primitive that sets a context's
 * last error (bico__fail, bico__clear).  The lowest file of lib/: it
 * calls nothing else in the library, so every file may fail through it
 * (ctx.c, params.c, ...) without the arrows turning back. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

const char *bico_strerror(int status) {
  switch (status) {
    case BICO_OK: return "success";
    case BICO_E_NULL: return "a required pointer argument is NULL";
    case BICO_E_ARG: return "an argument is out of range";
    case BICO_E_SHAPE: return "dimensions are zero, mismatched or too large";
    case BICO_E_NONFINITE: return "input holds NaN or Inf";
    case BICO_E_NOMEM: return "out of memory";
    case BICO_E_NUMERIC: return "a numerical routine did not converge";
    case BICO_E_FORMAT: return "malformed file or data";
    case BICO_E_IO: return "input/output error";
    case BICO_E_VERSION: return "unsupported format version";
    case BICO_E_NOTFOUND: return "no such tensor, module or key";
    case BICO_E_UNSUPPORTED: return "not supported by this version";
    case BICO_E_STATE: return "the handle does not allow this now";
    case BICO_E_INTERNAL: return "internal error in libbico";
    default: return "unknown status";
  }
}

const char *bico_version_string(void) { return BICO_VERSION_STRING; }
unsigned bico_version_number(void) { return BICO_VERSION_NUMBER; }

bico_status bico__fail(bico_ctx *ctx, bico_status status, const char *fmt,
                       ...) {
  if (ctx == NULL) return status;
  /* Format into a copy first: callers prefix the previous message by
   * passing bico_ctx_errmsg(ctx) as an argument, and vsnprintf into the
   * buffer it reads from is undefined (found by make leak-check). */
  char buf[BICO_ERRMSG_CAP];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  memcpy(ctx->errmsg, buf, sizeof buf);
  ctx->errcode = status;
  return status;
}

void bico__clear(bico_ctx *ctx) {
  if (ctx == NULL) return;
  ctx->errcode = BICO_OK;
  ctx->errmsg[0] = '\0';
}
