/* Compile-time check (make header-check): defining BICO_EXPERIMENTAL after
 * a first inclusion of the umbrella header and including experimental.h
 * again declares the section (its guard is separate from the include
 * guard), with the documented signature. */
#include <bico/bico.h>
#define BICO_EXPERIMENTAL
#include <bico/experimental.h>

typedef bico_status (*solve_blocks_type)(bico_procrustes *, size_t, size_t,
                                         bico_block_read_fn,
                                         bico_block_release_fn, void *,
                                         float *, size_t, size_t *);
solve_blocks_type experimental_solve_blocks(void);
solve_blocks_type experimental_solve_blocks(void) {
  return bico_procrustes_solve_blocks;
}
