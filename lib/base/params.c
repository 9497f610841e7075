/* The option grammar of params.h: one check, one message and one
 * table-driven implementation of set_param's checks, param_bounds,
 * param_name and param_from_name for every handle (internal.h). */
#include <math.h>
#include <string.h>

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

const bico__param_spec *bico__param_find(const bico__param_spec *spec, int n,
                                         int param) {
  return param >= 0 && param < n && spec[param].name != NULL ? &spec[param]
                                                             : NULL;
}

bico_status bico__param_bounds(const bico__param_spec *spec, int n, int param,
                               double *lo, double *hi, unsigned *flags) {
  if (lo == NULL || hi == NULL || flags == NULL) return BICO_E_NULL;
  const bico__param_spec *e = bico__param_find(spec, n, param);
  if (e == NULL) return BICO_E_ARG;
  *lo = e->lo;
  *hi = e->hi;
  *flags = e->flags;
  return BICO_OK;
}

const char *bico__param_name(const bico__param_spec *spec, int n, int param) {
  const bico__param_spec *e = bico__param_find(spec, n, param);
  return e ? e->name : NULL;
}

bico_status bico__param_from_name(const bico__param_spec *spec, int n,
                                  const char *name, int *param) {
  if (name == NULL || param == NULL) return BICO_E_NULL;
  for (int i = 0; i < n; i++)
    if (spec[i].name != NULL && strcmp(name, spec[i].name) == 0) {
      *param = i;
      return BICO_OK;
    }
  return BICO_E_NOTFOUND;
}

bico_status bico__param_set(bico_ctx *ctx, const char *fn,
                            const bico__param_spec *spec, int n, int param,
                            double value) {
  const bico__param_spec *e = bico__param_find(spec, n, param);
  if (e == NULL)
    return bico__fail(ctx, BICO_E_ARG, "%s: unknown parameter %d", fn, param);
  return bico__param_check(ctx, fn, e->name, value, e->lo, e->hi, e->flags);
}

bico_status bico__param_get(const bico_ctx *ctx, const char *fn,
                            const bico__param_spec *spec, int n, int param,
                            const double *value) {
  bico_ctx *c = (bico_ctx *)ctx;
  if (value == NULL) return bico__fail(c, BICO_E_NULL, "%s: value is NULL", fn);
  if (bico__param_find(spec, n, param) == NULL)
    return bico__fail(c, BICO_E_ARG, "%s: unknown parameter %d", fn, param);
  return BICO_OK;
}
