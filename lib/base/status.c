/* Status codes and versions. */
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
