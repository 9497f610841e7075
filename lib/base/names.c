/* Names of the public enumerators, both ways (libsodium style: an FFI
 * caller cannot read the headers' enums, so it asks the library).  One
 * table per enumeration; the tables are the only place the words are
 * written, so a front end that parses "--proc-method eig" or writes
 * "keep" into a report calls these instead of keeping its own copy (the
 * transfer driver, the report writer, bico inspect and the Python binding,
 * which builds its tables from these functions at import).
 * Parameter names are the exception: each handle's parameter table
 * (name and accepted set together, lib/base/params.c's grammar) holds them.
 * The dtype sizes live beside the element conversion (lib/io/st_convert.c). */
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

/* ---- fit.h ---- */

static const name_entry bico_fit_flag_names[] = {{BICO_FIT_BIAS, "bias"}};
NAME_PAIR(bico_fit_flag)

/* ---- transfer.h ---- */

static const name_entry bico_transfer_method_names[] = {
    {BICO_METHOD_BICO, "bico"},       {BICO_METHOD_BICO_IN, "bico-in"},
    {BICO_METHOD_BICO_OUT, "bico-out"}, {BICO_METHOD_GRADFIX, "gradfix"},
    {BICO_METHOD_NAIVE, "naive"},     {BICO_METHOD_PAD, "pad"}};
NAME_PAIR(bico_transfer_method)

static const name_entry bico_transfer_norm_map_names[] = {
    {BICO_NORM_MAP_ACT, "act"}, {BICO_NORM_MAP_GRAD, "grad"}};
NAME_PAIR(bico_transfer_norm_map)

static const name_entry bico_transfer_structure_names[] = {
    {BICO_STRUCTURE_HEADS, "heads"}, {BICO_STRUCTURE_FREE, "free"}};
NAME_PAIR(bico_transfer_structure)

static const name_entry bico_transfer_rope_names[] = {
    {BICO_ROPE_HALF, "half"},
    {BICO_ROPE_INTERLEAVED, "interleaved"},
    {BICO_ROPE_NONE, "none"}};
NAME_PAIR(bico_transfer_rope)

static const name_entry bico_transfer_fingerprint_names[] = {
    {BICO_FINGERPRINT_SAMPLED, "sampled"}, {BICO_FINGERPRINT_FULL, "full"}};
NAME_PAIR(bico_transfer_fingerprint)

static const name_entry bico_transfer_handling_names[] = {
    {BICO_HANDLING_UNCHANGED, "unchanged"}, {BICO_HANDLING_LINEAR, "linear"},
    {BICO_HANDLING_VECTOR, "vector"},       {BICO_HANDLING_TIED, "tied"},
    {BICO_HANDLING_NAIVE, "naive"},         {BICO_HANDLING_PADDED, "padded"},
    {BICO_HANDLING_MASKED, "masked"}};
NAME_PAIR(bico_transfer_handling)

static const name_entry bico_transfer_side_names[] = {
    {BICO_SIDE_IN, "in"}, {BICO_SIDE_OUT, "out"}};
NAME_PAIR(bico_transfer_side)

/* The file slots, as the library's messages name them ("the <name>
 * file"; a front end may put its own spelling of the option in its
 * place).  _from_name also takes the bindings' spelling, an underscore for
 * each space ("source_base"). */
static const name_entry bico_transfer_file_names[] = {
    {BICO_FILE_SOURCE_BASE, "source base"},
    {BICO_FILE_SOURCE_TUNED, "source tuned"},
    {BICO_FILE_TASK_VECTOR, "task vector"},
    {BICO_FILE_TARGET_BASE, "target base"},
    {BICO_FILE_SOURCE_CALIB, "source calib"},
    {BICO_FILE_TARGET_CALIB, "target calib"},
    {BICO_FILE_STATS, "stats"},
    {BICO_FILE_TARGET_VOTES, "target votes"},
    {BICO_FILE_OUTPUT, "output"},
    {BICO_FILE_DELTA_OUTPUT, "delta output"},
    {BICO_FILE_REPORT, "report"},
    {BICO_FILE_LORA, "source adapter"},
    {BICO_FILE_LORA_OUTPUT, "output adapter"},
    {BICO_FILE_SOURCE_CONFIG, "source config"},
    {BICO_FILE_TARGET_CONFIG, "target config"},
    {BICO_FILE_BRIDGE, "bridge"},
    {BICO_FILE_BRIDGE_OUTPUT, "bridge output"}};
#define NFILE_NAMES (sizeof bico_transfer_file_names / sizeof *bico_transfer_file_names)

const char *bico_transfer_file_name(int which) {
  return name_of(bico_transfer_file_names, NFILE_NAMES, which);
}

bico_status bico_transfer_file_from_name(const char *name, int *which) {
  if (name == NULL || which == NULL) return BICO_E_NULL;
  for (size_t i = 0; i < NFILE_NAMES; i++) {
    const char *w = bico_transfer_file_names[i].name;
    size_t k = 0;
    while (w[k] != '\0' && (name[k] == w[k] || (w[k] == ' ' && name[k] == '_')))
      k++;
    if (w[k] == '\0' && name[k] == '\0') {
      *which = bico_transfer_file_names[i].value;
      return BICO_OK;
    }
  }
  return BICO_E_NOTFOUND;
}

static const name_entry bico_transfer_check_level_names[] = {
    {BICO_TRANSFER_CHECK_OPTIONS, "options"},
    {BICO_TRANSFER_CHECK_INPUTS, "inputs"}};
NAME_PAIR(bico_transfer_check_level)

static const name_entry bico_transfer_string_names[] = {
    {BICO_TRANSFER_BLOCKS, "blocks"},
    {BICO_TRANSFER_SOURCE_BLOCKS, "source_blocks"},
    {BICO_TRANSFER_TARGET_BLOCKS, "target_blocks"},
    {BICO_TRANSFER_SOURCE_RENAME, "source_rename"}};
NAME_PAIR(bico_transfer_string)

/* ---- merge.h ---- */

static const name_entry bico_merge_input_names[] = {
    {BICO_MERGE_TASK_VECTOR, "task_vector"},
    {BICO_MERGE_TUNED, "tuned"},
    {BICO_MERGE_LORA, "lora"}};
NAME_PAIR(bico_merge_input)

static const name_entry bico_merge_file_names[] = {
    {BICO_MERGE_FILE_BASE, "base"},
    {BICO_MERGE_FILE_OUTPUT, "output"},
    {BICO_MERGE_FILE_DELTA_OUTPUT, "delta_output"},
    {BICO_MERGE_FILE_REPORT, "report"}};
NAME_PAIR(bico_merge_file)

/* ---- lora.h ---- */

static const name_entry bico_lora_kind_names[] = {
    {BICO_LORA_LINEAR, "linear"}, {BICO_LORA_EMBEDDING, "embedding"}};
NAME_PAIR(bico_lora_kind)


static const name_entry bico_lora_string_names[] = {
    {BICO_LORA_TASK_TYPE, "task_type"}, {BICO_LORA_BASE_MODEL, "base_model"}};
NAME_PAIR(bico_lora_string)

/* ---- folder.h ---- */

static const name_entry bico_folder_policy_names[] = {
    {BICO_FOLDER_REFUSE, "refuse"},
    {BICO_FOLDER_REPLACE, "replace"},
    {BICO_FOLDER_CARRY, "carry"}};
NAME_PAIR(bico_folder_policy)

/* ---- safetensors.h ---- */

static const name_entry bico_dtype_names[] = {
    {BICO_DTYPE_F32, "F32"}, {BICO_DTYPE_F16, "F16"}, {BICO_DTYPE_BF16, "BF16"},
    {BICO_DTYPE_F64, "F64"}, {BICO_DTYPE_I8, "I8"},   {BICO_DTYPE_I16, "I16"},
    {BICO_DTYPE_I32, "I32"}, {BICO_DTYPE_I64, "I64"}, {BICO_DTYPE_U8, "U8"},
    {BICO_DTYPE_U16, "U16"}, {BICO_DTYPE_U32, "U32"}, {BICO_DTYPE_U64, "U64"},
    {BICO_DTYPE_BOOL, "BOOL"}};
NAME_PAIR(bico_dtype)
