/* safetensors dtypes and element conversion (little-endian bytes, any
 * alignment), shared by the reader and the writer. */
#include <stdio.h>
#include <string.h>

#include "st_internal.h"


/* ---- dtypes ---- */

/* Element sizes by dtype (the names are lib/base/names.c's). */
static const size_t dtype_sizes[] = {
    [BICO_DTYPE_F32] = 4, [BICO_DTYPE_F16] = 2, [BICO_DTYPE_BF16] = 2,
    [BICO_DTYPE_F64] = 8, [BICO_DTYPE_I8] = 1,  [BICO_DTYPE_I16] = 2,
    [BICO_DTYPE_I32] = 4, [BICO_DTYPE_I64] = 8, [BICO_DTYPE_U8] = 1,
    [BICO_DTYPE_U16] = 2, [BICO_DTYPE_U32] = 4, [BICO_DTYPE_U64] = 8,
    [BICO_DTYPE_BOOL] = 1};

size_t bico_dtype_size(int dtype) {
  return dtype > 0 && (size_t)dtype < sizeof dtype_sizes / sizeof *dtype_sizes
             ? dtype_sizes[dtype]
             : 0;
}

/* The one rule for "is this a floating-point dtype" (what a transfer
 * updates, a merge combines, a calibration file may hold). */
int bico_dtype_is_float(int dtype) {
  return dtype == BICO_DTYPE_F32 || dtype == BICO_DTYPE_F16 ||
         dtype == BICO_DTYPE_BF16 || dtype == BICO_DTYPE_F64;
}


uint64_t bico__st_load_le(const unsigned char *p, size_t n) {
  uint64_t v = 0;
  for (size_t k = n; k-- > 0;) v = (v << 8) | p[k];
  return v;
}

void bico__st_store_le(unsigned char *p, uint64_t v, size_t n) {
  for (size_t k = 0; k < n; k++) {
    p[k] = (unsigned char)(v & 0xff);
    v >>= 8;
  }
}

static float f32_from_bits(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

static double f64_from_bits(uint64_t b) {
  double d;
  memcpy(&d, &b, 8);
  return d;
}

/* IEEE half to float: exact (every half is a float). */
static float half_to_float(uint32_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f,
           man = h & 0x3ff;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24, exact in float */
    float v = (float)man * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

/* Rounds a double to the nearest value (ties to even) of a binary format
 * with ebits exponent bits and mbits stored mantissa bits, returning its
 * bit pattern; overflow gives Inf, NaN a quiet NaN of the same sign.  One
 * rounding from double (f32 inputs are exact in double), so no double
 * rounding happens on the way to F16 or BF16. */
uint64_t bico__st_round(double x, int ebits, int mbits) {
  uint64_t b;
  memcpy(&b, &x, 8);
  uint64_t sign = (b >> 63) << (ebits + mbits);
  int e = (int)((b >> 52) & 0x7ff);
  uint64_t m = b & 0xfffffffffffffull;
  uint64_t expmax = ((uint64_t)1 << ebits) - 1;
  if (e == 0x7ff) {
    if (m == 0) return sign | (expmax << mbits);
    return sign | (expmax << mbits) | ((uint64_t)1 << (mbits - 1));
  }
  if (e == 0) return sign; /* zero or double subnormal: far below any target */
  m |= (uint64_t)1 << 52;
  int E = e - 1023;
  int bias = (1 << (ebits - 1)) - 1;
  int emin = 1 - bias;
  int qexp = (E >= emin ? E : emin) - mbits; /* exponent of one unit */
  int s = qexp - (E - 52);                    /* right shift of m */
  uint64_t q;
  if (s >= 54) {
    q = 0;
  } else {
    q = m >> s;
    uint64_t rem = m & (((uint64_t)1 << s) - 1), half = (uint64_t)1 << (s - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
  }
  uint64_t bits;
  if (E >= emin)
    bits = ((uint64_t)(E + bias - 1) << mbits) + q; /* carry bumps exp */
  else
    bits = q; /* subnormal, or the smallest normal after rounding up */
  if (bits >= (expmax << mbits)) bits = expmax << mbits;
  return sign | bits;
}

static float double_to_float(double x) {
  return f32_from_bits((uint32_t)bico__st_round(x, 8, 23));
}

/* Element k of a buffer of dtype d as double (exact for every dtype but
 * I64/U64 beyond 2^53). */
double bico__st_elem_f64(const unsigned char *p, int d) {
  switch (d) {
    case BICO_DTYPE_F32: return f32_from_bits((uint32_t)bico__st_load_le(p, 4));
    case BICO_DTYPE_F16: return half_to_float((uint32_t)bico__st_load_le(p, 2));
    case BICO_DTYPE_BF16: return f32_from_bits((uint32_t)bico__st_load_le(p, 2) << 16);
    case BICO_DTYPE_F64: return f64_from_bits(bico__st_load_le(p, 8));
    case BICO_DTYPE_I8: return (int8_t)p[0];
    case BICO_DTYPE_I16: return (int16_t)(uint16_t)bico__st_load_le(p, 2);
    case BICO_DTYPE_I32: return (int32_t)(uint32_t)bico__st_load_le(p, 4);
    case BICO_DTYPE_I64: return (double)(int64_t)bico__st_load_le(p, 8);
    case BICO_DTYPE_U8: return p[0];
    case BICO_DTYPE_U16: return (double)bico__st_load_le(p, 2);
    case BICO_DTYPE_U32: return (double)bico__st_load_le(p, 4);
    case BICO_DTYPE_U64: return (double)bico__st_load_le(p, 8);
    case BICO_DTYPE_BOOL: return p[0] != 0;
  }
  return 0;
}

float bico__st_elem_f32(const unsigned char *p, int d) {
  switch (d) {
    case BICO_DTYPE_F32: return f32_from_bits((uint32_t)bico__st_load_le(p, 4));
    case BICO_DTYPE_F16: return half_to_float((uint32_t)bico__st_load_le(p, 2));
    case BICO_DTYPE_BF16: return f32_from_bits((uint32_t)bico__st_load_le(p, 2) << 16);
    case BICO_DTYPE_I64: return (float)(int64_t)bico__st_load_le(p, 8);
    case BICO_DTYPE_U64: return (float)bico__st_load_le(p, 8);
    default: return double_to_float(bico__st_elem_f64(p, d));
  }
}

/* ---- reader ---- */
/* A name for messages: cut long ones. */
const char *bico__st_shortname(const char *s, char *buf, size_t cap) {
  size_t n = strlen(s);
  if (n < cap) return s;
  snprintf(buf, cap, "%.*s...", (int)(cap - 4), s);
  return buf;
}
