/* How a model family's tensor names read, as data the model graph
 * interprets (lib/model/model.c).  Internal.
 *
 * The rows themselves live in the one family table (lib/model/family.c); the
 * caller that knows a model's family (the transfer driver, from
 * config.json or the names) hands the row's naming to the graph with
 * bico__model_set_naming; the public constructors (bico_model_create,
 * bico_model_from_stfile, in lib/model/family.c) hand it a namer, the table's
 * rule from the tensor names, which the analysis asks while no naming was
 * handed.  model.c never names a family: the arrows run family.c ->
 * model.c, never back.
 *
 * A naming changes how names and shapes are read in three places only:
 * - the storage layout of a tensor (conv1d: GPT-2's Conv1D stores the 2-D
 *   "weight" of those modules [in, out]; every other rule sees [out, in]);
 * - roles a name settles (roles: CLIP's class_embedding is a token, GPT-2's
 *   attention mask buffers are nothing to carry);
 * - block containers beyond the one detected (containers: CLIP's towers,
 *   each paired by its own depth map). */
#ifndef BICO_NAMING_H
#define BICO_NAMING_H

#include <stddef.h>

#include "internal.h"

/* A role a name settles: a tensor whose last name component is `last`,
 * whose module's last component is `module` (NULL: any module), with at
 * least min_ndim dimensions, has `role` (bico_tensor_role). */
typedef struct bico__role_rule {
  const char *module;
  const char *last;
  size_t min_ndim;
  int role;
} bico__role_rule;

typedef struct bico__naming {
  const char *name;              /* "gpt2", "clip" */
  const char *const *conv1d;     /* module last components stored [in, out],
                                    NULL-terminated, or NULL */
  const char *const *containers; /* block containers, NULL-terminated, or
                                    NULL */
  const bico__role_rule *roles;  /* ends at last == NULL; NULL: none */
} bico__naming;

/* ---- model.c: the graph's side ---- */

/* 1 when tensor `name` with ndim dimensions is stored [in, out] under
 * naming n (NULL: never). */
int bico__naming_transposed(const bico__naming *n, const char *name,
                            size_t ndim);
/* The role n's rules give tensor `name`, or 0 when the generic rules
 * decide. */
int bico__naming_role(const bico__naming *n, const char *name, size_t ndim);

/* A rule that gives a model's naming from its tensor names (lib/model/family.c
 * hands one to every model it constructs). */
typedef const bico__naming *(*bico__namer)(const bico_model *m);

/* An empty model with no naming and no namer: the body of
 * bico_model_create, which lib/model/family.c defines (it hands the namer). */
bico_status bico__model_new(bico_ctx *ctx, bico_model **out);

/* The naming a model reads by (NULL: generic names), and handing it one
 * (fixed from then on; drops the model's cached analysis). */
const bico__naming *bico__model_naming(const bico_model *m);
void bico__model_set_naming(bico_model *m, const bico__naming *n);
/* Hands a model the rule its analysis asks for a naming while none was
 * handed (bico__model_set_naming). */
void bico__model_set_namer(bico_model *m, bico__namer namer);
/* 1 when tensor i is stored [in, out] (its naming's layout). */
int bico__model_transposed(const bico_model *m, size_t i);

#endif
