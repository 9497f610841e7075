/* The option grammar of params.h: one check and one message for every
 * handle's set_param. */
#include <math.h>

#include "internal.h"

int bico__param_ok(double value, double lo, double hi, unsigned flags) {
  if (!isfinite(value)) return 0;
  if (flags & BICO_PARAM_LO_OPEN ? !(value > lo) : !(value >= lo)) return 0;
  if (flags & BICO_PARAM_HI_OPEN ? !(value < hi) : !(value <= hi)) return 0;
  if ((flags & BICO_PARAM_INTEGER) && value != floor(value)) return 0;
  return 1;
}

bico_status bico__param_check(bico_ctx *ctx, const char *fn, const char *name,
                              double value, double lo, double hi,
                              unsigned flags) {
  if (bico__param_ok(value, lo, hi, flags)) return BICO_OK;
  return bico__fail(ctx, BICO_E_ARG, "%s: %s = %g is outside %c%g, %g%c%s",
                    fn, name, value, flags & BICO_PARAM_LO_OPEN ? '(' : '[',
                    lo, hi, flags & BICO_PARAM_HI_OPEN ? ')' : ']',
                    flags & BICO_PARAM_INTEGER ? " (integers)" : "");
}
