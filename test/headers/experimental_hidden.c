/* Compile-time check (make header-check): without BICO_EXPERIMENTAL the
 * umbrella header declares nothing of the experimental section.  These
 * lines reuse its names for other things, which would not compile if the
 * section's declarations were visible. */
#include <bico/bico.h>

typedef int bico_block_read_fn;
extern int bico_procrustes_solve_blocks;
