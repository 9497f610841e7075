/* libbico: the context.
 *
 * A bico_ctx carries what every call needs and nothing global: the memory
 * allocator, the number of threads BLIS may use for this context's work, and
 * the message describing the last failure of a call made with it.
 *
 * Threads: libbico has no global mutable state.  Different contexts (and
 * the handles made with them) may be used concurrently from different
 * threads; one context, and each handle, by one thread at a time.
 *
 * Memory: every buffer libbico keeps goes through the context's allocator.
 * Workspaces that BLIS and LAPACK allocate internally do not (BLIS uses its
 * own pools; LAPACK's work arrays are, however, allocated by libbico). */
#ifndef BICO_CTX_H
#define BICO_CTX_H

#include <stddef.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_ctx bico_ctx;

/* Allocator hooks: alloc(opaque, size) returns memory aligned for any type
 * (or NULL); release(opaque, ptr) frees it and accepts NULL. */
typedef void *(*bico_alloc_fn)(void *opaque, size_t size);
typedef void (*bico_free_fn)(void *opaque, void *ptr);

/* Creates a context with the C library's malloc/free and one thread. */
BICO_API bico_status bico_ctx_create(bico_ctx **out);
/* Same, with caller-supplied allocator hooks (both non-NULL). */
BICO_API bico_status bico_ctx_create_with_allocator(bico_ctx **out,
                                                    bico_alloc_fn alloc,
                                                    bico_free_fn release,
                                                    void *opaque);
/* Frees the context; accepts NULL.  Handles made with it must be freed
 * first. */
BICO_API void bico_ctx_free(bico_ctx *ctx);

/* Context parameters, set with bico_ctx_set_param. */
typedef enum bico_ctx_param {
  BICO_CTX_THREADS = 1 /* threads for BLIS calls made with this context;
                          1..1024, default 1 */
} bico_ctx_param;

BICO_API bico_status bico_ctx_set_param(bico_ctx *ctx, int param, long value);
BICO_API bico_status bico_ctx_get_param(const bico_ctx *ctx, int param,
                                        long *value);
BICO_API bico_status bico_ctx_param_bounds(int param, long *lo, long *hi);

/* The detail of the last failure of a call made with ctx ("" if none), for
 * example "xcov_add: row 17 of x_b holds NaN".  Valid until the next call
 * with ctx.  Never NULL for a non-NULL ctx. */
BICO_API const char *bico_ctx_errmsg(const bico_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif
