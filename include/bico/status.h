/* libbico: status codes.
 *
 * Every fallible call returns a bico_status.  Values are explicit and frozen:
 * a code is never renumbered or reused; a retired one stays as
 * BICO_E_OBSOLETE<n>.  bico_strerror() gives static text for a code;
 * bico_ctx_errmsg() gives the detail of the last failure on a context.
 *
 * Enumerations.  Every public enumerator has an explicit value, frozen once
 * released, by one rule (docs/api.md):
 *   - status codes: BICO_OK = 0, failures from 1;
 *   - parameter keys (the `param` of *_set_param) from 1; 0 is never a key;
 *   - choices (the values of a parameter or argument that picks one of
 *     several) from 1, without gaps.  0 is reserved: where the choice has a
 *     default, 0 asks for that default (and *_get_param reports the member
 *     it resolved to); where it has none, 0 is BICO_E_ARG;
 *   - flags are distinct powers of two; 0 is "none".
 * Each enumeration has a pair of functions, so that bindings read the names
 * from the library rather than copying them: <prefix>_name(value) gives the
 * name (static text; NULL for a value that is not a member) and
 * <prefix>_from_name(name, &value) the value (BICO_E_NULL, or
 * BICO_E_NOTFOUND for an unknown name).  The names are the lowercase words
 * that command lines, reports and Python use ("eig", "keep", "weight");
 * status codes are named by their identifiers ("BICO_E_SHAPE"). */
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

/* "BICO_OK", "BICO_E_SHAPE", ... (NULL for an unknown code), and back. */
BICO_API const char *bico_status_name(int status);
BICO_API bico_status bico_status_from_name(const char *name, int *status);

#ifdef __cplusplus
}
#endif
#endif
