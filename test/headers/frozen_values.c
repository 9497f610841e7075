/* Compile-time check (C99 and C++11, run by `make header-check`) that the
 * public enumerators keep their released values.  abidiff only sees the
 * enums that appear in function signatures; most options travel as int, so
 * their values are pinned here.  A new enumerator is added below; an
 * existing line never changes. */
#include <bico/bico.h>
#include <bico/safetensors.h>

#define FROZEN(name, value) \
  typedef char frozen_##name[((int)(name) == (value)) ? 1 : -1]

FROZEN(BICO_OK, 0);
FROZEN(BICO_E_NULL, 1);
FROZEN(BICO_E_ARG, 2);
FROZEN(BICO_E_SHAPE, 3);
FROZEN(BICO_E_NONFINITE, 4);
FROZEN(BICO_E_NOMEM, 5);
FROZEN(BICO_E_NUMERIC, 6);
FROZEN(BICO_E_FORMAT, 7);
FROZEN(BICO_E_IO, 8);
FROZEN(BICO_E_VERSION, 9);
FROZEN(BICO_E_NOTFOUND, 10);
FROZEN(BICO_E_UNSUPPORTED, 11);
FROZEN(BICO_E_STATE, 12);
FROZEN(BICO_E_INTERNAL, 13);

FROZEN(BICO_CTX_THREADS, 1);

FROZEN(BICO_XCOV_SUMS, 1);
FROZEN(BICO_XCOV_GRAMS, 2);
FROZEN(BICO_XCOV_CROSS, 0);
FROZEN(BICO_XCOV_GRAM_A, 1);
FROZEN(BICO_XCOV_GRAM_B, 2);

FROZEN(BICO_PROC_CENTER, 1);
FROZEN(BICO_PROC_WHITEN, 2);
FROZEN(BICO_PROC_WHITEN_EPS, 3);
FROZEN(BICO_PROC_RANK_TOL, 4);
FROZEN(BICO_PROC_NULL, 5);
FROZEN(BICO_NULL_KEEP, 0);
FROZEN(BICO_NULL_DROP, 1);

FROZEN(BICO_VOTES_MEAN, 1);
FROZEN(BICO_GRADFIX_MAJORITY, 0);
FROZEN(BICO_GRADFIX_MEAN, 1);

FROZEN(BICO_DTYPE_F32, 1);
FROZEN(BICO_DTYPE_F16, 2);
FROZEN(BICO_DTYPE_BF16, 3);
FROZEN(BICO_DTYPE_F64, 4);
FROZEN(BICO_DTYPE_I8, 5);
FROZEN(BICO_DTYPE_I16, 6);
FROZEN(BICO_DTYPE_I32, 7);
FROZEN(BICO_DTYPE_I64, 8);
FROZEN(BICO_DTYPE_U8, 9);
FROZEN(BICO_DTYPE_U16, 10);
FROZEN(BICO_DTYPE_U32, 11);
FROZEN(BICO_DTYPE_U64, 12);
FROZEN(BICO_DTYPE_BOOL, 13);

/* The version macros agree with each other. */
typedef char frozen_version_number[
    (BICO_VERSION_NUMBER == BICO_VERSION_MAJOR * 10000 +
                                BICO_VERSION_MINOR * 100 +
                                BICO_VERSION_PATCH) ? 1 : -1];
