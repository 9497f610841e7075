/* libbico: model graphs.
 *
 * A bico_model is the structure of a checkpoint seen through its tensor
 * names and shapes (no data): tensors grouped into modules, the container
 * of repeated blocks, and the pairing of a target model's modules and
 * tensors with a source model's.
 *
 * Modules.  A tensor's module is its name without the last dot-separated
 * component ("blocks.3.mlp.fc1.weight" belongs to module "blocks.3.mlp.fc1"
 * as parameter "weight"); a name without a dot belongs to the root module
 * "".  Each module gets a kind from its parameters' names and shapes:
 *   LINEAR       a "weight" of 2 or more dimensions, [d_out, d_in...]
 *                (nn.Linear; a convolution's weight counts as
 *                [d_out, prod(rest)], the order of PyTorch's unfold);
 *   ELEMENTWISE  no such weight, but 1-D parameters (LayerNorm, RMSNorm,
 *                BatchNorm, layer scales): they act coordinate-wise;
 *   EMBEDDING    a 2-D "weight" in a module whose last name component
 *                contains "embed" but not "patch" (nn.Embedding,
 *                "embeddings.word_embeddings", "wte", "wpe"): a table
 *                whose last dimension is the model width;
 *   OTHER        anything else, the root module included.
 * and each tensor a role:
 *   WEIGHT  the weight of a LINEAR module;
 *   BIAS    a 1-D tensor of a LINEAR module with d_out elements (it lives
 *           in the module's output space);
 *   VECTOR  a 1-D tensor of an ELEMENTWISE module;
 *   TOKEN   a tensor of 2 or more dimensions that is not a linear weight
 *           (cls_token [1, 1, D], pos_embed [1, N, D], embedding tables):
 *           its last dimension is the model width;
 *   OTHER   everything else (scalars, counters): no method changes it.
 *
 * Blocks.  The repeated-block container is the prefix P for which the most
 * tensors are named "P.<integer>.<rest>" (P may be empty, as in
 * nn.Sequential's "0.weight"; a tie goes to the shorter prefix); a module
 * inside it has block index <integer> and the block-relative name <rest>.
 * The block count is the largest index plus one.  bico_model_set_blocks
 * overrides the detection.
 *
 * Pairing.  A target name inside the target's blocks, "P_B.<j>.<rest>",
 * pairs with the source name "P_A.<i(j)>.<rest>" where i is the depth map
 * (bico_depthmap_source: i(j) = round(j (L_A - 1) / (L_B - 1))); a name outside
 * the blocks pairs with the identical source name.  The same rule maps
 * tensor names, module names and calibration keys ("<module>.input").
 *
 * The analysis (modules, blocks) is computed on first query after a change
 * and cached in the handle; so even the query functions, which take a
 * const handle, must not be called concurrently on one handle. */
#ifndef BICO_MODEL_H
#define BICO_MODEL_H

#include <stddef.h>
#include "ctx.h"
#include "safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_model bico_model;

typedef enum bico_module_kind {
  BICO_MODULE_LINEAR = 1,
  BICO_MODULE_ELEMENTWISE = 2,
  BICO_MODULE_EMBEDDING = 3,
  BICO_MODULE_OTHER = 4
} bico_module_kind;

typedef enum bico_tensor_role {
  BICO_ROLE_WEIGHT = 1,
  BICO_ROLE_BIAS = 2,
  BICO_ROLE_VECTOR = 3,
  BICO_ROLE_TOKEN = 4,
  BICO_ROLE_OTHER = 5
} bico_tensor_role;

/* Names: kinds ("linear", "elementwise", "embedding", "other") and roles
 * ("weight", "bias", "vector", "token", "other"). */
BICO_API const char *bico_model_module_kind_name(int kind);
BICO_API bico_status bico_model_module_kind_from_name(const char *name,
                                                      int *kind);
BICO_API const char *bico_model_tensor_role_name(int role);
BICO_API bico_status bico_model_tensor_role_from_name(const char *name,
                                                      int *role);

/* An empty model; tensors are then registered with bico_model_add_tensor.
 * The handle keeps a pointer to ctx (which must outlive it).  Names that
 * give a model family away (GPT-2: a module ending in attn.c_attn; CLIP:
 * vision_model/text_model.encoder.layers.N) read as that family does
 * (docs/formats.md): GPT-2's Conv1D weights are stored [in, out], CLIP's
 * two towers are block containers. */
BICO_API bico_status bico_model_create(bico_ctx *ctx, bico_model **out);
/* A model holding every tensor of an open safetensors file (names, shapes
 * and dtypes are copied: the file may be closed afterwards); its names read
 * as bico_model_create says. */
BICO_API bico_status bico_model_from_stfile(bico_ctx *ctx,
                                            const bico_stfile *f,
                                            bico_model **out);
/* Accepts NULL. */
BICO_API void bico_model_free(bico_model *m);

/* Registers a tensor: a non-empty name (unique: else BICO_E_ARG), ndim in
 * 0..64 extents (a 0-D tensor is a scalar).  dtype is a bico_dtype, or 0
 * for "floating point, unspecified"; integer and boolean tensors always get
 * role OTHER. */
BICO_API bico_status bico_model_add_tensor(bico_model *m, const char *name,
                                           int dtype, size_t ndim,
                                           const size_t *shape);

/* Overrides the block container: prefix is "P" for names "P.<int>.rest"
 * ("" for names starting with the integer); NULL restores detection.  A
 * prefix that no tensor name uses is BICO_E_NOTFOUND at the next query
 * that needs the analysis. */
BICO_API bico_status bico_model_set_blocks(bico_model *m, const char *prefix);

/* ---- Tensors ---- */

/* The number of tensors into *n; BICO_E_NULL for a NULL model or n. */
BICO_API bico_status bico_model_tensor_count(const bico_model *m, size_t *n);
/* Name, dtype, shape of tensor i (in registration order); any out-pointer
 * may be NULL.  Pointers stay valid until the model is freed. */
BICO_API bico_status bico_model_tensor(const bico_model *m, size_t i,
                                       const char **name, int *dtype,
                                       size_t *ndim, const size_t **shape);
/* BICO_E_NOTFOUND (with a message naming it) when absent. */
BICO_API bico_status bico_model_find_tensor(const bico_model *m,
                                            const char *name, size_t *i);
/* Module index and role (bico_tensor_role) of tensor i; either may be
 * NULL. */
BICO_API bico_status bico_model_tensor_module(const bico_model *m, size_t i,
                                              size_t *module, int *role);

/* ---- Modules ---- */

/* The number of modules into *n; BICO_E_NULL for a NULL model or n, and
 * the analysis's failure (a block prefix no tensor uses: BICO_E_NOTFOUND)
 * as for every query that needs it. */
BICO_API bico_status bico_model_module_count(const bico_model *m, size_t *n);
/* Module i (ordered by first tensor): name ("" for the root), kind
 * (bico_module_kind), block index (-1 outside the blocks) and the number
 * of tensors it owns; any out-pointer may be NULL. */
BICO_API bico_status bico_model_module(const bico_model *m, size_t i,
                                       const char **name, int *kind,
                                       long *block, size_t *ntensors);
/* The k-th tensor (0 <= k < ntensors) of module i, as a tensor index. */
BICO_API bico_status bico_model_module_tensor(const bico_model *m, size_t i,
                                              size_t k, size_t *tensor);
BICO_API bico_status bico_model_find_module(const bico_model *m,
                                            const char *name, size_t *i);
/* Input and output widths of a LINEAR module (d_out = weight.shape[0],
 * d_in = the product of the rest), or for an ELEMENTWISE module the length
 * of its 1-D parameters (both); BICO_E_ARG for other kinds. */
BICO_API bico_status bico_model_module_dims(const bico_model *m, size_t i,
                                            size_t *d_out, size_t *d_in);

/* ---- Blocks ---- */

/* The container prefix (NULL when the model has no repeated blocks) and
 * the block count (0 then). */
BICO_API bico_status bico_model_blocks(const bico_model *m,
                                       const char **prefix, size_t *count);

/* ---- Pairing ---- */

/* The source name for a target name (tensor, module or any dotted key that
 * starts with one), by the rule above, into buf (cap bytes, NUL included;
 * BICO_E_ARG if too small).  *len (may be NULL) gets the length. */
BICO_API bico_status bico_model_map_name(const bico_model *target,
                                         const bico_model *source,
                                         const char *name, char *buf,
                                         size_t cap, size_t *len);
/* The source module paired with target module i; BICO_E_NOTFOUND (message
 * naming both names) when the source has no such module. */
BICO_API bico_status bico_model_pair_module(const bico_model *target,
                                            size_t i,
                                            const bico_model *source,
                                            size_t *source_module);
/* The same for tensors. */
BICO_API bico_status bico_model_pair_tensor(const bico_model *target,
                                            size_t i,
                                            const bico_model *source,
                                            size_t *source_tensor);

#ifdef __cplusplus
}
#endif
#endif
