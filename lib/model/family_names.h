/* Model families known by their tensor names or config.json: GPT-2 and
 * CLIP (lib/model/family_names.c).  Internal.
 *
 * A family changes how names and shapes are read, in three places only:
 * - the storage layout of a tensor (bico__family_transposed: GPT-2's
 *   Conv1D stores a weight [in, out]; every other rule sees it [out, in]);
 * - roles a name settles (bico__family_role: CLIP's class_embedding is a
 *   token, GPT-2's attention mask buffers are nothing to carry);
 * - defaults of the plan (bico__family_split: c_attn holds q, k, v;
 *   bico__family_containers: CLIP's two towers; bico__family_tower: which
 *   tower a name lives in, so a token ties within its own tower). */
#ifndef BICO_FAMILY_NAMES_H
#define BICO_FAMILY_NAMES_H

#include <stddef.h>

#include "internal.h"

enum bico__family_kind {
  BICO__FAMILY_NONE = 0,
  BICO__FAMILY_GPT2 = 1,
  BICO__FAMILY_CLIP = 2
};

/* "gpt2", "clip", or "none". */
const char *bico__family_name(int family);

/* The family of a model: from the config.json beside its weights when
 * path is a model folder (model_type), else from its tensor names (GPT-2:
 * a module ending in attn.c_attn; CLIP: vision_model.encoder.layers.N or
 * text_model.encoder.layers.N).  why gets what decided, e.g.
 * "config.json model_type \"gpt2\"" or "tensor names (h.0.attn.c_attn)".
 * A config.json that cannot be read or parsed counts as absent. */
int bico__family_detect(bico_ctx *ctx, const char *path,
                        const bico_model *m, char *why, size_t cap);

/* 1 when the tensor is stored [in, out] (GPT-2 Conv1D: the 2-D "weight"
 * of a module whose last component is c_attn, c_proj, c_fc or q_attn). */
int bico__family_transposed(int family, const char *tensor, size_t ndim);

/* A role the family's names settle (bico_tensor_role), or 0 when the
 * generic rules decide. */
int bico__family_role(int family, const char *tensor, size_t ndim);

/* The default output split of a linear module (GPT-2 attn.c_attn: 3). */
size_t bico__family_split(int family, const char *module);

/* The family's block containers beyond the one detected (CLIP: both
 * towers), NULL-terminated, or NULL. */
const char *const *bico__family_containers(int family);

/* Length of the tower prefix of name ("vision_model." / "text_model."),
 * 0 when the family has one tower or the name lies in none. */
size_t bico__family_tower(int family, const char *name);

/* The family a model was told (bico__model_set_family), and setting it
 * (drops the model's cached analysis; model.c). */
int bico__model_family(const bico_model *m);
void bico__model_set_family(bico_model *m, int family);
/* 1 when tensor i is stored [in, out] (its family's layout). */
int bico__model_transposed(const bico_model *m, size_t i);

#endif
