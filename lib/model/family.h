/* Model families: the one table keyed by config.json's model_type, and the
 * one reader of a model's config.json (lib/model/family.c).  Internal.
 *
 * A row of the table holds everything a family changes:
 * - naming (naming.h: GPT-2's Conv1D layout and mask buffers, CLIP's two
 *   towers and class_embedding), the default output split of a fused
 *   module (GPT-2's attn.c_attn: q, k, v), and the tensor names that give
 *   the family away when no config.json says it;
 * - attention geometry for the structure-aware maps (decoder families:
 *   which fields of config.json it needs), the RoPE layout (public
 *   bico_transfer_rope values), and the defaults of tie_word_embeddings and
 *   attention_bias.
 *
 * Errors, one rule wherever a config is read: a config.json that is
 * absent (no file given and none beside a model folder) is "unknown
 * family", never an error; one that is present but unreadable, not JSON,
 * not a JSON object or with a model_type that is not a string fails the
 * call (BICO_E_IO or BICO_E_FORMAT) naming the file and the reason.  The
 * fields a decoder family needs for its attention geometry are checked
 * only where the geometry is used (bico__family_geometry), naming the file
 * and the field.
 *
 * Arrows: family.c calls model.c (the model graph) and never the reverse;
 * the graph gets its naming handed in (bico__model_set_naming). */
#ifndef BICO_FAMILY_H
#define BICO_FAMILY_H

#include <stddef.h>

#include "internal.h"
#include "naming.h"

/* Naming kinds (the families whose names read differently). */
enum bico__family_kind {
  BICO__FAMILY_NONE = 0,
  BICO__FAMILY_GPT2 = 1,
  BICO__FAMILY_CLIP = 2
};

typedef struct bico__family_row {
  const char *model_type; /* config.json's model_type */
  int prefix;             /* 1: matches any model_type starting so (clip…) */
  int kind;               /* BICO__FAMILY_*: naming */
  const bico__naming *naming; /* NULL: generic names */
  const char *fused;      /* last component of a fused module, or NULL */
  size_t fused_split;     /* its default output split (c_attn: 3) */
  const char *signature;  /* module path (by components) whose presence in
                             the tensor names gives the family away */
  int decoder;            /* attention geometry read for structured maps */
  int tie;                /* tie_word_embeddings when config.json omits it */
  int attn_bias;          /* attention_bias when config.json omits it */
  int rope;               /* bico_transfer_rope of the family (0: none known) */
} bico__family_row;

/* What one model's config.json says (bico__family_read), and its attention
 * geometry once checked (bico__family_geometry / _override). */
typedef struct bico__family {
  const bico__family_row *row; /* NULL: unknown model_type or no config */
  char type[32];     /* model_type, or "" */
  int known;         /* geometry checked: a decoder whose attention we can
                        structure */
  size_t layers, hidden, heads, kv_heads, head_dim, intermediate;
  int tie, attn_bias, rope;
  unsigned bad;      /* bit per count field present but not a positive
                        integer (checked by bico__family_geometry) */
  /* A causal language model: a decoder row of the table, or an
   * "architectures" entry ending in ForCausalLM or LMHeadModel (any
   * model_type); causal_why says which, in words ("" when not). */
  int causal_lm;
  char causal_why[96];
} bico__family;

/* The row of model_type, or NULL. */
const bico__family_row *bico__family_lookup(const char *model_type);
/* The row of a naming kind, or NULL for BICO__FAMILY_NONE. */
const bico__family_row *bico__family_row_of(int kind);

/* The config.json of a model: `given` (--source-config/--target-config)
 * when set, else base/config.json when base is a folder holding one, else
 * none (*out NULL: unknown family).  *out is ctx memory. */
bico_status bico__family_config(bico_ctx *ctx, const char *given,
                                const char *base, char **out);

/* Reads config.json at path into *f (path NULL: unknown family, BICO_OK).
 * Errors as the header says. */
bico_status bico__family_read(bico_ctx *ctx, const char *path,
                              bico__family *f);

/* Checks the attention geometry of a decoder family read from `path` and
 * sets f->known: a missing or ill-typed required field (hidden_size,
 * num_attention_heads, num_hidden_layers, intermediate_size), head counts
 * that do not divide (num_attention_heads by num_key_value_heads,
 * hidden_size by num_attention_heads when head_dim is absent) fail with
 * BICO_E_FORMAT naming the file and the field.  A family without geometry
 * (not a decoder, or unknown) leaves f->known 0 and succeeds. */
bico_status bico__family_geometry(bico_ctx *ctx, const char *path,
                                  bico__family *f);

/* Applies overrides (0 = keep): heads, kv_heads, head_dim, rope.  With
 * heads given, a model without a known config becomes known (its widths
 * are checked against the tensors later).  Checks the result again;
 * `what` names the model in messages. */
bico_status bico__family_override(bico_ctx *ctx, const char *what,
                                  bico__family *f, size_t heads,
                                  size_t kv_heads, size_t head_dim, int rope);

/* The naming kind of a model: its config's row when that row has one
 * (why: "config.json model_type \"gpt2\""), else the first row whose
 * signature its tensor names show (why: "tensor names (h.0.attn.c_attn…)"),
 * else BICO__FAMILY_NONE (why ""). */
int bico__family_kind(const bico__family *f, const bico_model *m, char *why,
                      size_t cap);

/* The naming of a kind (NULL for none), handed to bico__model_set_naming. */
const bico__naming *bico__family_naming(int kind);

/* "gpt2", "clip", or "none". */
const char *bico__family_name(int kind);
/* The one name of a model's family, for every front end (bico inspect,
 * bico_transfer_explain, a run's log): its config.json's row of the table
 * when it has one ("llama", "qwen2", "gpt2", "clip", ...: the decoder
 * families too, whose names read as any model's), else the naming kind
 * its tensor names give away (bico__family_name). */
const char *bico__family_word(const bico__family *f, int kind);
/* 1 when the tensor is stored [in, out] under the kind's naming. */
int bico__family_transposed(int kind, const char *tensor, size_t ndim);
/* A role the kind's names settle (bico_tensor_role), or 0. */
int bico__family_role(int kind, const char *tensor, size_t ndim);
/* The default output split of a linear module (GPT-2 attn.c_attn: 3). */
size_t bico__family_split(int kind, const char *module);
/* The kind's block containers, NULL-terminated, or NULL. */
const char *const *bico__family_containers(int kind);
/* Length of the container-tower prefix of name ("vision_model." /
 * "text_model."), 0 when the kind has one tower or the name lies in none. */
size_t bico__family_tower(int kind, const char *name);

#endif
