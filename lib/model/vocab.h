/* Vocabularies from tokenizer.json and the row map between two of them
 * (lib/model/vocab.c).  Internal.
 *
 * A model folder's tokenizer.json names each token id's string: the
 * model's "vocab" (BPE and WordPiece: an object string -> id; Unigram: an
 * array of [piece, score] whose position is the id) plus "added_tokens"
 * ({"id", "content"}).  Two models whose strings differ at some id have
 * different vocabularies; the rows of their token tensors (embed_tokens,
 * lm_head, wte, word_embeddings, token_embedding) are then matched by
 * string: a target row whose token the source also has takes that source
 * row's update, the others stay unchanged. */
#ifndef BICO_VOCAB_H
#define BICO_VOCAB_H

#include <stddef.h>

#include "internal.h"

typedef struct bico__vocab {
  size_t n_source, n_target; /* ids in each tokenizer (largest id + 1) */
  size_t *src_of;            /* per target id: source id or SIZE_MAX */
  size_t shared, fresh;      /* target ids with / without a source token */
} bico__vocab;

/* The row map from the source folder's tokenizer.json to the target's,
 * into *out; *out stays NULL when either path is not a folder with a
 * tokenizer.json, or when the two vocabularies are identical (nothing to
 * map).  A tokenizer.json that is there but unreadable or malformed is an
 * error naming it. */
bico_status bico__vocab_map(bico_ctx *ctx, const char *source_path,
                            const char *target_path, bico__vocab **out);
void bico__vocab_free(bico_ctx *ctx, bico__vocab *v);

/* 1 when a tensor's rows are the vocabulary: a 2-D tensor of a module whose
 * last name component is embed_tokens, wte, word_embeddings,
 * token_embedding or lm_head, with n_rows rows. */
int bico__vocab_tensor(const char *name, size_t ndim, const size_t *shape);

#endif
