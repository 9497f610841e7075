/* Names of the public enumerators, both ways (libsodium style: an FFI
 * caller cannot read the headers' enums, so it asks the library).  One
 * table per enumeration; the tables are the only place the words are
 * written, so a front end that parses "--proc-method eig" or writes
 * "keep" into a report calls these instead of keeping its own copy.
 * Parameter names are the exception: each handle's parameter table
 * (name and accepted set together, lib/base/params.c's grammar) holds them. */
#include <string.h>

#include "internal.h"

typedef struct name_entry {
  int value;
  const char *name;
} name_entry;

static const char *name_of(const name_entry *t, size_t n, int value) {
  for (size_t i = 0; i < n; i++)
    if (t[i].value == value) return t[i].name;
  return NULL;
}

static bico_status value_of(const name_entry *t, size_t n, const char *name,
                            int *value) {
  if (name == NULL || value == NULL) return BICO_E_NULL;
  for (size_t i = 0; i < n; i++)
    if (strcmp(t[i].name, name) == 0) {
      *value = t[i].value;
      return BICO_OK;
    }
  return BICO_E_NOTFOUND;
}

/* One pair of public functions, <prefix>_name and <prefix>_from_name, over
 * the table of the same prefix. */
#define NAME_PAIR(prefix)                                                   \
  const char *prefix##_name(int value) {                                   \
    return name_of(prefix##_names,                                         \
                   sizeof prefix##_names / sizeof prefix##_names[0], value); \
  }                                                                        \
  bico_status prefix##_from_name(const char *name, int *value) {           \
    return value_of(prefix##_names,                                        \
                    sizeof prefix##_names / sizeof prefix##_names[0], name, \
                    value);                                                \
  }

static const name_entry bico_status_names[] = {
    {BICO_OK, "BICO_OK"},
    {BICO_E_NULL, "BICO_E_NULL"},
    {BICO_E_ARG, "BICO_E_ARG"},
    {BICO_E_SHAPE, "BICO_E_SHAPE"},
    {BICO_E_NONFINITE, "BICO_E_NONFINITE"},
    {BICO_E_NOMEM, "BICO_E_NOMEM"},
    {BICO_E_NUMERIC, "BICO_E_NUMERIC"},
    {BICO_E_FORMAT, "BICO_E_FORMAT"},
    {BICO_E_IO, "BICO_E_IO"},
    {BICO_E_VERSION, "BICO_E_VERSION"},
    {BICO_E_NOTFOUND, "BICO_E_NOTFOUND"},
    {BICO_E_UNSUPPORTED, "BICO_E_UNSUPPORTED"},
    {BICO_E_STATE, "BICO_E_STATE"},
    {BICO_E_INTERNAL, "BICO_E_INTERNAL"}};
NAME_PAIR(bico_status)

static const name_entry bico_param_flag_names[] = {
    {BICO_PARAM_LO_OPEN, "lo_open"},
    {BICO_PARAM_HI_OPEN, "hi_open"},
    {BICO_PARAM_INTEGER, "integer"}};
NAME_PAIR(bico_param_flag)

static const name_entry bico_xcov_flag_names[] = {
    {BICO_XCOV_SUMS, "sums"}, {BICO_XCOV_GRAMS, "grams"}};
NAME_PAIR(bico_xcov_flag)

static const name_entry bico_xcov_add_mode_names[] = {
    {BICO_XCOV_ADD_EXACT, "exact"}, {BICO_XCOV_ADD_FAST, "fast"}};
NAME_PAIR(bico_xcov_add_mode)

static const name_entry bico_xcov_which_names[] = {
    {BICO_XCOV_CROSS, "cross"},
    {BICO_XCOV_GRAM_A, "gram_a"},
    {BICO_XCOV_GRAM_B, "gram_b"}};
NAME_PAIR(bico_xcov_which)

static const name_entry bico_procrustes_method_names[] = {
    {BICO_PROC_SVD, "svd"}, {BICO_PROC_EIG, "eig"}, {BICO_PROC_POLAR, "polar"}};
NAME_PAIR(bico_procrustes_method)

static const name_entry bico_procrustes_null_names[] = {
    {BICO_NULL_KEEP, "keep"}, {BICO_NULL_DROP, "drop"}};
NAME_PAIR(bico_procrustes_null)

static const name_entry bico_votes_flag_names[] = {{BICO_VOTES_MEAN, "mean"}};
NAME_PAIR(bico_votes_flag)

static const name_entry bico_gradfix_mode_names[] = {
    {BICO_GRADFIX_MAJORITY, "majority"}, {BICO_GRADFIX_MEAN, "mean"}};
NAME_PAIR(bico_gradfix_mode)

static const name_entry bico_model_module_kind_names[] = {
    {BICO_MODULE_LINEAR, "linear"},
    {BICO_MODULE_ELEMENTWISE, "elementwise"},
    {BICO_MODULE_EMBEDDING, "embedding"},
    {BICO_MODULE_OTHER, "other"}};
NAME_PAIR(bico_model_module_kind)

static const name_entry bico_model_tensor_role_names[] = {
    {BICO_ROLE_WEIGHT, "weight"}, {BICO_ROLE_BIAS, "bias"},
    {BICO_ROLE_VECTOR, "vector"}, {BICO_ROLE_TOKEN, "token"},
    {BICO_ROLE_OTHER, "other"}};
NAME_PAIR(bico_model_tensor_role)

static const name_entry bico_merge_method_names[] = {
    {BICO_MERGE_LINEAR, "linear"}, {BICO_MERGE_TIES, "ties"}};

const char *bico_merge_method_name(int method) {
  return name_of(bico_merge_method_names,
                 sizeof bico_merge_method_names / sizeof *bico_merge_method_names,
                 method);
}

/* mergekit calls the linear merge of task vectors "task_arithmetic". */
bico_status bico_merge_method_from_name(const char *name, int *method) {
  if (name != NULL && method != NULL && strcmp(name, "task_arithmetic") == 0) {
    *method = BICO_MERGE_LINEAR;
    return BICO_OK;
  }
  return value_of(bico_merge_method_names,
                  sizeof bico_merge_method_names / sizeof *bico_merge_method_names,
                  name, method);
}
