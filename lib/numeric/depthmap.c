/* Depth mapping: target block j takes source block
 * round(j (l_a - 1) / (l_b - 1)), halves rounding up, in exact integer
 * arithmetic (no floating point, no overflow for any size_t).  A function,
 * not a handle: the map is the formula of two counts, nothing to keep. */
#include "internal.h"

/* (a + b) mod q for a, b < q, without overflow; *carry = 1 when the sum
 * reached q. */
static size_t addmod(size_t a, size_t b, size_t q, size_t *carry) {
  if (a >= q - b) {
    *carry = 1;
    return a - (q - b);
  }
  *carry = 0;
  return a + b;
}

/* a b = quot q + rem with 0 <= rem < q, for a <= q (so quot <= b), by
 * shift-and-add on (quotient, remainder) pairs: no intermediate exceeds
 * b or q. */
static void muldiv(size_t a, size_t b, size_t q, size_t *quot, size_t *rem) {
  size_t xq = b / q, xr = b % q; /* x = b 2^s as xq q + xr */
  size_t rq = 0, rr = 0, c;
  while (a != 0) {
    if (a & 1) {
      rr = addmod(rr, xr, q, &c);
      rq += xq + c;
    }
    a >>= 1;
    if (a != 0) {
      xr = addmod(xr, xr, q, &c);
      xq = 2 * xq + c;
    }
  }
  *quot = rq;
  *rem = rr;
}

size_t bico__depth_source(size_t l_a, size_t l_b, size_t j) {
  if (l_a == 1 || l_b == 1) return 0;
  size_t p = l_a - 1, q = l_b - 1, quot, rem;
  muldiv(j, p, q, &quot, &rem);
  /* Round half up: add one when rem / q >= 1/2, i.e. rem >= q - rem. */
  return quot + (rem >= q - rem ? 1 : 0);
}

bico_status bico_depthmap_source(size_t l_a, size_t l_b, size_t j,
                                 size_t *i) {
  if (i == NULL) return BICO_E_NULL;
  if (l_a == 0 || l_b == 0) return BICO_E_SHAPE;
  if (j >= l_b) return BICO_E_ARG;
  *i = bico__depth_source(l_a, l_b, j);
  return BICO_OK;
}
