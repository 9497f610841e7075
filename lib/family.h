/* Decoder families from Hugging Face config.json (lib/family.c): what the
 * structure-aware maps need to know about a model's attention. */
#ifndef BICO_FAMILY_H
#define BICO_FAMILY_H

#include <stddef.h>

#include "internal.h"

/* RoPE layouts (bico_rope: BICO_TRANSFER_ROPE; 0 = from the config). */
enum { BICO__ROPE_HALF = 1, BICO__ROPE_INTERLEAVED = 2, BICO__ROPE_NONE = 3 };

typedef struct bico__family {
  int known;         /* a decoder family whose attention we can structure */
  char type[32];     /* model_type, or "" */
  size_t layers, hidden, heads, kv_heads, head_dim, intermediate;
  int tie, attn_bias, rope;
  /* A causal language model: model_type one of the families above, or an
   * "architectures" entry ending in ForCausalLM or LMHeadModel (any
   * model_type); causal_why says which, in words ("" when not). */
  int causal_lm;
  char causal_why[96];
} bico__family;

/* Reads config.json at `path` into *f.  A model_type outside the known
 * decoder families (llama, mistral, qwen2, gemma, gemma2) leaves
 * f->known 0 and succeeds (causal_lm is set for any model_type).  For a
 * known family the fields are checked:
 * a missing or ill-typed required field (hidden_size, num_attention_heads,
 * num_hidden_layers, intermediate_size), head counts that do not divide
 * (num_attention_heads by num_key_value_heads, hidden_size by
 * num_attention_heads when head_dim is absent) fail with BICO_E_FORMAT
 * naming the file and the field. */
bico_status bico__family_read(bico_ctx *ctx, const char *path,
                              bico__family *f);

/* Applies overrides (0 = keep): heads, kv_heads, head_dim, rope.  With
 * heads given, a model without a known config becomes known (its widths
 * are checked against the tensors later).  Checks the result again;
 * `what` names the model in messages. */
bico_status bico__family_override(bico_ctx *ctx, const char *what,
                                  bico__family *f, size_t heads,
                                  size_t kv_heads, size_t head_dim, int rope);

#endif
