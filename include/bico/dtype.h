/* libbico: element types of tensors (safetensors' dtypes).
 *
 * Their own header because every file format and model call speaks of
 * them (safetensors.h reads and writes them, model.h and merge.h name
 * them), and the prefix bico_dtype_ says where to look. */
#ifndef BICO_DTYPE_H
#define BICO_DTYPE_H

#include <stddef.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types.  Values are explicit and frozen. */
typedef enum bico_dtype {
  BICO_DTYPE_F32 = 1,
  BICO_DTYPE_F16 = 2,
  BICO_DTYPE_BF16 = 3,
  BICO_DTYPE_F64 = 4,
  BICO_DTYPE_I8 = 5,
  BICO_DTYPE_I16 = 6,
  BICO_DTYPE_I32 = 7,
  BICO_DTYPE_I64 = 8,
  BICO_DTYPE_U8 = 9,
  BICO_DTYPE_U16 = 10,
  BICO_DTYPE_U32 = 11,
  BICO_DTYPE_U64 = 12,
  BICO_DTYPE_BOOL = 13
} bico_dtype;

/* The safetensors name of a dtype ("F32", "BF16", ...); NULL if unknown. */
BICO_API const char *bico_dtype_name(int dtype);
/* Bytes per element (BOOL: 1); 0 if unknown. */
BICO_API size_t bico_dtype_size(int dtype);
/* The dtype whose safetensors name is `name` (exact, case-sensitive) into
 * *dtype; BICO_E_NOTFOUND if none.  No context: returns the status only. */
BICO_API bico_status bico_dtype_from_name(const char *name, int *dtype);
/* 1 for the floating-point dtypes (F32, F16, BF16, F64: the tensors a
 * transfer updates and a merge combines), 0 otherwise. */
BICO_API int bico_dtype_is_float(int dtype);

#ifdef __cplusplus
}
#endif
#endif
