/* libbico: status codes.
 *
 * Every fallible call returns a bico_status.  Values are explicit and frozen:
 * a code is never renumbered or reused; a retired one stays as
 * BICO_E_OBSOLETE<n>.  bico_strerror() gives static text for a code;
 * bico_ctx_errmsg() gives the detail of the last failure on a context. */
#ifndef BICO_STATUS_H
#define BICO_STATUS_H

#include "version.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum bico_status {
  BICO_OK = 0,
  BICO_E_NULL = 1,        /* a required pointer argument was NULL */
  BICO_E_ARG = 2,         /* an argument value is out of its range */
  BICO_E_SHAPE = 3,       /* dimensions are zero, mismatched or overflow */
  BICO_E_NONFINITE = 4,   /* NaN or Inf in input data */
  BICO_E_NOMEM = 5,       /* an allocation failed */
  BICO_E_NUMERIC = 6,     /* a LAPACK routine did not converge */
  BICO_E_FORMAT = 7,      /* malformed file or serialised data */
  BICO_E_IO = 8,          /* a read, write, open or rename failed */
  BICO_E_VERSION = 9,     /* serialised data from an unknown format version */
  BICO_E_NOTFOUND = 10,   /* a named tensor, module or key does not exist */
  BICO_E_UNSUPPORTED = 11,/* valid input that this version cannot handle */
  BICO_E_STATE = 12,      /* the handle is not in a state that allows this */
  BICO_E_INTERNAL = 13    /* a bug in libbico: please report it */
} bico_status;

/* Static, never-NULL English text for a status code (unknown codes give
 * "unknown status"). */
BICO_API const char *bico_strerror(int status);

#ifdef __cplusplus
}
#endif
#endif
