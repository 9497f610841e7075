/* libbico: the option grammar every handle uses.
 *
 * A handle X with options has exactly these four calls:
 *
 *   bico_status bico_X_set_param(bico_X *h, int param, double value);
 *   bico_status bico_X_get_param(const bico_X *h, int param, double *value);
 *   bico_status bico_X_param_bounds(int param, double *lo, double *hi,
 *                                   unsigned *flags);
 *   const char *bico_X_param_name(int param);   (and _from_name, status.h)
 *
 * Values travel as double: a double holds every integer up to 2^53 exactly,
 * so counts, switches (0/1) and choices (status.h's enumeration rule) use
 * the same call as real-valued options.  bico_X_param_bounds describes the
 * accepted set without a handle: the interval from *lo to *hi, each end
 * included unless *flags says it is open, and only integers when
 * BICO_PARAM_INTEGER is set; an unbounded end is +-HUGE_VAL (infinity)
 * with its OPEN flag.  set_param accepts exactly the finite values in that
 * set and refuses any other with BICO_E_ARG and a message that prints the
 * set ("rank_tol = 1 is outside [0, 1)"); an unknown param is BICO_E_ARG.
 * A refused value leaves the handle unchanged.
 *
 * Options that take a string or a file have their own verbs (for example
 * bico_model_set_blocks); structural choices that fix a handle's size are
 * create-time arguments (bico_xcov_create's flags). */
#ifndef BICO_PARAMS_H
#define BICO_PARAMS_H

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Flags of *_param_bounds (bitwise or). */
typedef enum bico_param_flag {
  BICO_PARAM_LO_OPEN = 1, /* lo itself is refused: the set starts above it */
  BICO_PARAM_HI_OPEN = 2, /* hi itself is refused: the set ends below it */
  BICO_PARAM_INTEGER = 4  /* only integral values */
} bico_param_flag;

/* Names: "lo_open", "hi_open", "integer". */
BICO_API const char *bico_param_flag_name(int flag);
BICO_API bico_status bico_param_flag_from_name(const char *name, int *flag);

#ifdef __cplusplus
}
#endif
#endif
