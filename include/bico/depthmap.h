/* libbico: depth-index mapping.
 *
 * With l_a source blocks and l_b target blocks, target block j takes source
 * block i(j) = round(j (l_a - 1) / (l_b - 1)) (halves round up), and i = 0
 * when l_b = 1.  l_a = 1 maps every target block to source block 0. */
#ifndef BICO_DEPTHMAP_H
#define BICO_DEPTHMAP_H

#include <stddef.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The source block i of target block j (0 <= j < l_b) with l_a source and
 * l_b target blocks.  A pure function of its arguments (no context, no
 * handle), so it returns the status only: BICO_E_NULL when i is NULL,
 * BICO_E_SHAPE when l_a or l_b is 0, BICO_E_ARG when j >= l_b; *i is left
 * alone on failure. */
BICO_API bico_status bico_depthmap_source(size_t l_a, size_t l_b, size_t j,
                                          size_t *i);

#ifdef __cplusplus
}
#endif
#endif
