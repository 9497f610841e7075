/* libbico: depth-index mapping.
 *
 * With l_a source blocks and l_b target blocks, target block j takes source
 * block i(j) = round(j (l_a - 1) / (l_b - 1)) (halves round up), and i = 0
 * when l_b = 1.  l_a = 1 maps every target block to source block 0. */
#ifndef BICO_DEPTHMAP_H
#define BICO_DEPTHMAP_H

#include <stddef.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_depthmap bico_depthmap;

/* l_a, l_b >= 1.  The handle keeps a pointer to ctx. */
BICO_API bico_status bico_depthmap_create(bico_ctx *ctx, size_t l_a,
                                          size_t l_b, bico_depthmap **out);
/* Accepts NULL. */
BICO_API void bico_depthmap_free(bico_depthmap *m);

/* The source block for target block j (0 <= j < l_b). */
BICO_API bico_status bico_depthmap_source(const bico_depthmap *m, size_t j,
                                          size_t *i);

#ifdef __cplusplus
}
#endif
#endif
