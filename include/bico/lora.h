/* libbico: LoRA adapters (PEFT) in factored form.
 *
 * A LoRA adapter stores, per adapted module, two factors: B [d_out, r] and
 * A [r, d_in], and the update is  dW = s B A  with s = alpha / r (alpha /
 * sqrt(r) with use_rslora).  BiCo is linear on both sides, so an adapter is
 * carried to another model without ever forming dW:
 *
 *   B' = R_out^T B   [d_out,B, r]      A' = A R_in   [r, d_in,B]
 *
 * and  s B' A' = R_out^T (s B A) R_in  exactly.  Rank and alpha are kept.
 *
 * Files.  bico_lora_open reads a PEFT adapter folder: adapter_config.json
 * and adapter_model.safetensors, with tensors
 *   base_model.model.<module>.lora_A.weight          [r, d_in]
 *   base_model.model.<module>.lora_B.weight          [d_out, r]
 *   base_model.model.<module>.lora_embedding_A       [r, num_embeddings]
 *   base_model.model.<module>.lora_embedding_B       [embedding_dim, r]
 *   base_model.model.<module>.<param>                a full tensor of a
 *                                                    module listed in
 *                                                    modules_to_save
 * target_modules says which modules PEFT adapts, by PEFT's rule: a list
 * names a module when an entry equals its name or is a "."-suffix of it; a
 * string is a regular expression the whole name matches (read as a POSIX
 * extended expression; Python-only syntax such as \d, \w, (?...) or lazy
 * quantifiers is refused, BICO_E_UNSUPPORTED), "all-linear" every linear
 * module but lm_head; null or absent: every module with factors.  Factors
 * of a module it does not name are refused (BICO_E_FORMAT naming the file
 * and the module): PEFT would not apply them.
 * The config's r and lora_alpha give the default rank and alpha;
 * rank_pattern and alpha_pattern override them for modules whose name
 * equals a key or ends with "." + key (literal; keys holding regular
 * expression operators are refused); use_rslora switches the scale to
 * alpha / sqrt(r); fan_in_fan_out marks base weights stored transposed
 * ([d_in, d_out], GPT-2's Conv1D): the factors are unchanged, but the dense
 * update of such a module is (s B A)^T.  An embedding adapter's update is
 * the table delta (s B A)^T [num_embeddings, embedding_dim]: its "d_out" is
 * the embedding width (the width a map carries) and its "d_in" the
 * vocabulary.
 *
 * Nothing is silently dropped: a config field this version does not
 * implement is refused (BICO_E_UNSUPPORTED, the message naming the file and
 * the field) unless its value is null, false or empty -- use_dora true
 * (DoRA magnitude vectors), lora_bias true, bias other than "none",
 * layer_replication, target_parameters, trainable_token_indices...; so is
 * a tensor that is none of the above (BICO_E_FORMAT naming it), a factor
 * whose rank disagrees with the config (BICO_E_SHAPE naming the module,
 * both ranks and the pattern), a lora_A without its lora_B, peft_type other
 * than "LORA", and non-finite values.
 *
 * Writing: bico_lora_create gives an empty adapter; modules and saved
 * tensors are added, and bico_lora_save writes the folder (created if
 * absent) in one step, as a model folder is committed (safetensors.h,
 * bico_stwriter_create_folder; folder.h): the whole adapter
 * (adapter_model.safetensors, adapter_config.json, and every other entry of
 * the old folder carried over by hard link, sub-folders with their
 * attributes) is built in a hidden sibling folder and swapped in with one
 * renameat2(RENAME_EXCHANGE), so a reader sees the old adapter or the new
 * one, never new weights beside an old config, and on failure the folder
 * stays as it was.  It takes the folder's lock (folder.h: another process
 * writing the folder is refused, BICO_E_IO naming it; a run of this
 * process that holds it is joined) and refuses what a folder commit
 * refuses: a path that exists and is not a folder (BICO_E_ARG), a dangling
 * link, a mount point or a folder holding one, the working directory or a
 * folder holding it.  The config written has
 * peft_type "LORA", r and lora_alpha (the most common rank and alpha),
 * rank_pattern / alpha_pattern entries (full module names) for modules that
 * differ, target_modules the sorted list of full module names,
 * modules_to_save, use_rslora, fan_in_fan_out, bias "none", use_dora false,
 * and the string options set with bico_lora_set_string (task_type,
 * base_model_name_or_path).  Factors and saved tensors are written as F32
 * (PEFT's convention), whatever the base model's dtype.
 *
 * Names.  Module names are the base model's (the safetensors names without
 * "base_model.model." and without the parameter), as bico_model uses. */
#ifndef BICO_LORA_H
#define BICO_LORA_H

#include <stddef.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_lora bico_lora;

typedef enum bico_lora_kind {
  BICO_LORA_LINEAR = 1,    /* lora_A / lora_B */
  BICO_LORA_EMBEDDING = 2  /* lora_embedding_A / lora_embedding_B */
} bico_lora_kind;

/* Adapter-wide switches: the option grammar of params.h
 * (bico_lora_set_param and its three companions), values 0 or 1. */
typedef enum bico_lora_param {
  BICO_LORA_RSLORA = 1,        /* "rslora": scale alpha / sqrt(r) */
  BICO_LORA_FAN_IN_FAN_OUT = 2 /* "fan_in_fan_out": base weights stored
                                  [d_in, d_out] */
} bico_lora_param;

/* String options carried into the written config. */
typedef enum bico_lora_string {
  BICO_LORA_TASK_TYPE = 1,
  BICO_LORA_BASE_MODEL = 2 /* base_model_name_or_path */
} bico_lora_string;
/* Names of the kinds ("linear", "embedding") and strings ("task_type",
 * "base_model"), as the bindings spell them (the switches' names are
 * bico_lora_param_name's); NULL / BICO_E_NOTFOUND otherwise. */
BICO_API const char *bico_lora_kind_name(int kind);
BICO_API bico_status bico_lora_kind_from_name(const char *name, int *kind);
BICO_API const char *bico_lora_string_name(int which);
BICO_API bico_status bico_lora_string_from_name(const char *name,
                                                int *which);

/* Reads and validates a PEFT adapter folder (see above).  The factors are
 * read into memory (the adapter's size); the files are closed on return. */
BICO_API bico_status bico_lora_open(bico_ctx *ctx, const char *dir,
                                    bico_lora **out);
/* An empty adapter to fill and save. */
BICO_API bico_status bico_lora_create(bico_ctx *ctx, bico_lora **out);
/* Accepts NULL. */
BICO_API void bico_lora_free(bico_lora *l);

BICO_API bico_status bico_lora_set_param(bico_lora *l, int param,
                                         double value);
BICO_API bico_status bico_lora_get_param(const bico_lora *l, int param,
                                         double *value);
BICO_API bico_status bico_lora_param_bounds(int param, double *lo, double *hi,
                                            unsigned *flags);
/* "rslora", "fan_in_fan_out"; NULL / BICO_E_NOTFOUND otherwise. */
BICO_API const char *bico_lora_param_name(int param);
BICO_API bico_status bico_lora_param_from_name(const char *name, int *param);
/* String options have their own verbs (params.h), as bico_transfer's:
 * NULL unsets; a value read from a config is kept for saving. */
BICO_API bico_status bico_lora_set_string(bico_lora *l, int which,
                                          const char *value);
BICO_API bico_status bico_lora_get_string(const bico_lora *l, int which,
                                          const char **value);

/* ---- Adapted modules ---- */

/* The number of modules into *n; BICO_E_NULL for a NULL adapter or n. */
BICO_API bico_status bico_lora_module_count(const bico_lora *l, size_t *n);
/* Module i (in the order of the file, or of addition): name, kind
 * (bico_lora_kind), rank, d_out (rows of B), d_in (columns of A), alpha
 * and the scale s; any out-pointer may be NULL. */
BICO_API bico_status bico_lora_module(const bico_lora *l, size_t i,
                                      const char **name, int *kind,
                                      size_t *rank, size_t *d_out,
                                      size_t *d_in, double *alpha,
                                      double *scale);
BICO_API bico_status bico_lora_find_module(const bico_lora *l,
                                           const char *name, size_t *i);
/* Pointers to module i's factors, valid until the adapter is freed:
 * b [d_out, rank], a [rank, d_in], row-major.  Either may be NULL. */
BICO_API bico_status bico_lora_factors(const bico_lora *l, size_t i,
                                       const float **b, const float **a);
/* Adds a module (name unique, else BICO_E_ARG; rank, d_out, d_in >= 1;
 * alpha > 0 finite) with factors b [d_out, rank] and a [rank, d_in]; the
 * factors are copied.  The sizes in bico_lora_module's order, then the
 * scalar, then the arrays (docs/api.md). */
BICO_API bico_status bico_lora_add_module(bico_lora *l, const char *name,
                                          int kind, size_t rank, size_t d_out,
                                          size_t d_in, double alpha,
                                          const float *b, const float *a);

/* ---- Full tensors (modules_to_save) ---- */

/* The number of saved tensors into *n; BICO_E_NULL for a NULL adapter or
 * n. */
BICO_API bico_status bico_lora_saved_count(const bico_lora *l, size_t *n);
/* Saved tensor i: its base-model name ("classifier.weight"), module
 * ("classifier"), shape and data (valid until the adapter is freed). */
BICO_API bico_status bico_lora_saved(const bico_lora *l, size_t i,
                                     const char **name, const char **module,
                                     size_t *ndim, const size_t **shape,
                                     const float **data);
/* Adds a full tensor of module `module` (its name must start with
 * module + "."); copied. */
BICO_API bico_status bico_lora_add_saved(bico_lora *l, const char *name,
                                         const char *module, size_t ndim,
                                         const size_t *shape,
                                         const float *data);

/* Writes the adapter folder (see above). */
BICO_API bico_status bico_lora_save(const bico_lora *l, const char *dir);

/* ---- Kernels ---- */

/* The dense update of a module into out [d_out, d_in] (row stride ld):
 * out = alpha s B A + beta out (beta = 0: out is not read). */
BICO_API bico_status bico_lora_dense(const bico_lora *l, size_t i,
                                     float alpha, float beta, float *out,
                                     size_t ld);

/* Factored transport of one module (docs/api.md's argument order: sizes,
 * source side first, then alpha, then the inputs each with its row stride,
 * then the outputs): b_out = alpha R_out^T b (block-wise
 * when k > 1: block j of b's rows by r_outs[j], fused qkv), a_out = a R_in.
 *   b      [dout_a, rank]       r_outs[j] [dout_a/k, dout_b/k] (row stride
 *                               ld_rout; NULL entries, or r_outs NULL: the
 *                               rectangular identity)
 *   a      [rank, din_a]        r_in [din_a, din_b] (NULL: identity)
 *   b_out  [dout_b, rank]       a_out [rank, din_b]
 * All contiguous row-major.  Memory: no buffer beyond the outputs. */
BICO_API bico_status bico_lora_transport(
    bico_ctx *ctx, size_t rank, size_t k, size_t dout_a, size_t din_a,
    size_t dout_b, size_t din_b, float alpha, const float *b, const float *a,
    float *const *r_outs, size_t ld_rout, const float *r_in,
    size_t ld_rin, float *b_out, float *a_out);

/* Best rank-`rank` factors of a dense update (truncated SVD, LAPACK):
 * scale * b_out a_out ~= dense [d_out, d_in] (row stride ld), split
 * evenly (b_out = U_r sqrt(S_r / scale), a_out = sqrt(S_r / scale) V_r^T).
 * *energy (may be NULL) gets sum_{i<r} s_i^2 / sum_i s_i^2 (1 for a zero
 * matrix).  scale > 0. */
BICO_API bico_status bico_lora_truncate(bico_ctx *ctx, size_t d_out,
                                        size_t d_in, size_t rank,
                                        double scale, const float *dense,
                                        size_t ld, float *b_out, float *a_out,
                                        double *energy);

#ifdef __cplusplus
}
#endif
#endif
