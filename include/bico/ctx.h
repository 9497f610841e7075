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
#include "params.h"

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

/* Context parameters, in the grammar of params.h. */
typedef enum bico_ctx_param {
  BICO_CTX_THREADS = 1, /* threads for BLIS calls made with this context;
                           integers 1..1024, default 1 */
  BICO_CTX_FOLDER_WAIT = 2 /* seconds a folder commit made with this
                              context waits for another process that is
                              writing the same output folder (the run's
                              lock, folder.h) before it refuses; 0..1e9,
                              default 0: refuse at once */
} bico_ctx_param;

BICO_API bico_status bico_ctx_set_param(bico_ctx *ctx, int param,
                                        double value);
BICO_API bico_status bico_ctx_get_param(const bico_ctx *ctx, int param,
                                        double *value);
BICO_API bico_status bico_ctx_param_bounds(int param, double *lo, double *hi,
                                           unsigned *flags);
/* Parameter names: "threads", "folder_wait". */
BICO_API const char *bico_ctx_param_name(int param);
BICO_API bico_status bico_ctx_param_from_name(const char *name, int *param);

/* ---- The last error ----
 *
 * A context records the status and the detail of the last failure of a
 * call made with it (or with a handle made with it), by these rules:
 *
 *   - A call that acts (it takes a non-const handle or the context itself:
 *     create, set_param, add, solve, transport, ...) clears the record on
 *     entry and, if it fails, records its failure.  After it returns
 *     BICO_OK, bico_ctx_errcode is BICO_OK and bico_ctx_errmsg is "".
 *   - A query (it takes only const handles: *_info, *_get_param, the model
 *     graph's lookups, bico_procrustes_spectrum, ...) records its own
 *     failure but never clears the record when it succeeds, so a caller may
 *     inspect its handles after a failure without losing its message.
 *   - bico_ctx_errcode and bico_ctx_errmsg, and the functions that take no
 *     handle (bico_strerror, *_param_bounds, *_name, *_from_name), never
 *     change the record.
 *
 * A failing call whose own handle argument is NULL has no context to record
 * into: it returns BICO_E_NULL and changes nothing. */

/* The detail of the last failure ("" if none), for example "xcov_add: x_b
 * holds NaN at row 17, column 3".  Valid until the next call that acts with
 * ctx.  Never NULL ("no context (NULL)" for a NULL ctx). */
BICO_API const char *bico_ctx_errmsg(const bico_ctx *ctx);
/* The status of the last failure (BICO_OK if none); BICO_E_NULL for a NULL
 * ctx.  Test this rather than the message's text. */
BICO_API bico_status bico_ctx_errcode(const bico_ctx *ctx);

/* Structured progress of a long run (bico_transfer_set_progress,
 * bico_merge_set_progress), for front ends that draw it: work done and in
 * all (in units the run documents; done reaches total on the last call),
 * items finished and in all, and seconds since the run's loop began.
 * `size` is sizeof(bico_progress) as the library knows it (fields are only
 * ever added at the end: read a field only when size covers it). */
typedef struct bico_progress {
  size_t size;
  double done, total;
  size_t tensors_done, tensors_total;
  double elapsed;
  const char *tensor; /* the item just finished (valid during the call) */
} bico_progress;

typedef void (*bico_progress_fn)(void *opaque, const bico_progress *p);

#ifdef __cplusplus
}
#endif
#endif
