/* libbico internals shared by the library's sources; never installed. */
#ifndef BICO_INTERNAL_H
#define BICO_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
/* The library sees its experimental section (experimental.h). */
#define BICO_EXPERIMENTAL
#include "bico/bico.h"

#define BICO_ERRMSG_CAP 1024

struct bico_ctx {
  bico_alloc_fn alloc;
  bico_free_fn release;
  void *opaque;
  long threads;
  double folder_wait; /* BICO_CTX_FOLDER_WAIT, seconds */
  bico_status errcode; /* the status of the last failure, BICO_OK if none */
  char errmsg[BICO_ERRMSG_CAP];
};

/* Sign votes (votes.c), read by the masks of gradfix.c. */
struct bico_votes {
  bico_ctx *ctx;
  size_t n;
  unsigned flags;
  uint64_t samples;
  int32_t *votes; /* sum_k sign(-g_k); |votes[i]| <= samples <= INT32_MAX */
  double *sum;    /* sum_k -g_k, only with BICO_VOTES_MEAN */
};

/* The fit's theta mode (lib/numeric/fit.c), for bico_fit_run: an empty fit
 * given its layer's W_B (and b_B exactly when it has a bias) accumulates
 * the whole right-hand side (D_B + (X~_B - X~') Theta)^T X~' instead of
 * K = X~'^T X~_B (a x a); memory d_out x a for Theta instead, and fewer
 * flops when d_out < a.  The rows added and the solve must then use that
 * W_B and b_B (the driver's pointers do).  BICO_E_STATE for a fit with
 * rows, already in theta mode, or W/b missing. */
bico_status bico__fit_use_theta(bico_fit *f, const float *w, size_t ld_w,
                                const float *b);

/* Explicit little-endian bytes, whatever the host: the serialised forms of
 * bico_xcov (xcov.c) and bico_fit (fit.c). */
static inline void bico__put_u32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline void bico__put_u64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint32_t bico__get_u32(const unsigned char *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static inline uint64_t bico__get_u64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}
/* Doubles as their IEEE-754 bits in those bytes; the array forms return
 * the byte after the last. */
static inline void bico__put_f64(unsigned char *p, double x) {
  uint64_t bits;
  memcpy(&bits, &x, 8);
  bico__put_u64(p, bits);
}
static inline double bico__get_f64(const unsigned char *p) {
  const uint64_t bits = bico__get_u64(p);
  double x;
  memcpy(&x, &bits, 8);
  return x;
}
static inline unsigned char *bico__put_f64s(unsigned char *p, const double *x,
                                            size_t n) {
  for (size_t i = 0; i < n; i++, p += 8) bico__put_f64(p, x[i]);
  return p;
}
static inline const unsigned char *bico__get_f64s(const unsigned char *q,
                                                  double *x, size_t n) {
  for (size_t i = 0; i < n; i++, q += 8) x[i] = bico__get_f64(q);
  return q;
}

/* Memory through the context's allocator.  bico__alloc fails the call with
 * BICO_E_NOMEM and a message (naming `what`) when it returns NULL. */
void *bico__alloc(bico_ctx *ctx, size_t size);
void *bico__calloc(bico_ctx *ctx, size_t count, size_t size);
void bico__free(bico_ctx *ctx, void *p);

/* Dynamic arrays: when count == *cap, moves the first count elements of p
 * (elem bytes each) into a new block of 2 * *cap elements (first when *cap
 * is 0), frees p and returns the new block; otherwise returns p.  On
 * failure returns NULL (BICO_E_NOMEM, message set) and leaves p and *cap
 * as they were.  A new block rather than realloc: the context's allocator
 * has no realloc. */
void *bico__grow(bico_ctx *ctx, void *p, size_t count, size_t *cap,
                 size_t first, size_t elem);

/* Records status and "detail" as ctx's last error and returns status (ctx
 * may be NULL: then only the status is returned). printf-style; an argument
 * may be bico_ctx_errmsg(ctx) itself (to prefix the previous message). */
bico_status bico__fail(bico_ctx *ctx, bico_status status, const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* Clears ctx's last error (code and message).  The rule of ctx.h: every
 * entry point that acts (takes a non-const handle or a context) calls it
 * first; queries (const handles only) never call it, they only record their
 * own failures. */
void bico__clear(bico_ctx *ctx);

/* a * b into *out; returns 0 on success, 1 on overflow. */
static inline int bico__mul(size_t a, size_t b, size_t *out) {
  if (a != 0 && b > SIZE_MAX / a) return 1;
  *out = a * b;
  return 0;
}

/* Scans a rows x cols row-major block (row stride ld) for NaN/Inf; returns
 * BICO_OK or fails with BICO_E_NONFINITE naming `what`, the row and column. */
bico_status bico__check_finite_f32(bico_ctx *ctx, const char *fn,
                                   const char *what, const float *x,
                                   size_t rows, size_t cols, size_t ld);
bico_status bico__check_finite_f64(bico_ctx *ctx, const char *fn,
                                   const char *what, const double *x,
                                   size_t rows, size_t cols, size_t ld);
/* n little-endian doubles of a serialised payload (bico__put_f64s' form):
 * BICO_OK, or BICO_E_FORMAT naming the first value that is NaN or Inf. */
bico_status bico__check_finite_bytes(bico_ctx *ctx, const char *fn,
                                     const unsigned char *q, size_t n);

/* Row-major GEMMs through BLIS with the context's thread count:
 * C = alpha op(A) op(B) + beta C, where op is a transpose when ta/tb != 0.
 * A is stored m x k (or k x m when ta), B k x n (or n x k when tb), all
 * with row strides; beta = 0 means C is not read. */
void bico__sgemm(const bico_ctx *ctx, int ta, int tb, size_t m, size_t n,
                 size_t k, float alpha, const float *a, size_t lda,
                 const float *b, size_t ldb, float beta, float *c,
                 size_t ldc);
void bico__dgemm(const bico_ctx *ctx, int ta, int tb, size_t m, size_t n,
                 size_t k, double alpha, const double *a, size_t lda,
                 const double *b, size_t ldb, double beta, double *c,
                 size_t ldc);

/* The option grammar (params.h), table-driven: one implementation of
 * every handle's set_param checks, param_bounds, param_name and
 * param_from_name.  A handle keeps one table indexed by its public
 * enumerator (entries with a NULL name are holes) and calls these, so that
 * every handle accepts, refuses and words alike: an unknown param and any
 * value outside the set (NaN and the infinities included) are BICO_E_ARG,
 * "fn: unknown parameter 7" or "fn: name = v is outside [lo, hi)", the
 * parameter by its lower-case name. */
typedef struct bico__param_spec {
  const char *name; /* lower case, the name _param_name returns */
  double lo, hi;
  unsigned flags;   /* bico_param_flag */
} bico__param_spec;
/* The entry of param in spec[0..n), or NULL when there is none. */
const bico__param_spec *bico__param_find(const bico__param_spec *spec, int n,
                                         int param);
bico_status bico__param_bounds(const bico__param_spec *spec, int n, int param,
                               double *lo, double *hi, unsigned *flags);
const char *bico__param_name(const bico__param_spec *spec, int n, int param);
bico_status bico__param_from_name(const bico__param_spec *spec, int n,
                                  const char *name, int *param);
/* set_param's checks (the caller then stores the value): BICO_OK, or
 * BICO_E_ARG recorded in ctx. */
bico_status bico__param_set(bico_ctx *ctx, const char *fn,
                            const bico__param_spec *spec, int n, int param,
                            double value);
/* get_param's checks: BICO_E_NULL for a NULL value, BICO_E_ARG for an
 * unknown param, recorded in ctx (a const handle's error record is not
 * part of its observable value). */
bico_status bico__param_get(const bico_ctx *ctx, const char *fn,
                            const bico__param_spec *spec, int n, int param,
                            const double *value);
#define BICO__NSPEC(t) ((int)(sizeof(t) / sizeof((t)[0])))
/* The check itself, for a value checked outside a handle (bico_fit_run's
 * ridge): 1 iff value lies in the set lo, hi and flags describe; check
 * fails with BICO_E_ARG and the message above otherwise. */
int bico__param_ok(double value, double lo, double hi, unsigned flags);
bico_status bico__param_check(bico_ctx *ctx, const char *fn, const char *name,
                              double value, double lo, double hi,
                              unsigned flags);

/* Diagonal block b of k of accumulator x as a new accumulator (in ctx):
 * cross block (b, b), sums' and Gram matrices' block b, the same rows.  A
 * split module's block statistic from one lent for the whole module. */
bico_status bico__xcov_block(bico_ctx *ctx, const bico_xcov *x, size_t b,
                             size_t k, bico_xcov **out);

/* The depth map of depthmap.h without a handle: the source block of target
 * block j < l_b (l_a, l_b >= 1).  For queries, which must not create
 * handles (creating one clears the context's last error). */
size_t bico__depth_source(size_t l_a, size_t l_b, size_t j);

/* A handle's counts for the library's own loops over handles it holds: a
 * size_t, 0 for NULL.  Callers outside use the public bico_X_count (a
 * status and an out-pointer: none is told from a bad handle). */
size_t bico__stfile_ntensors(const bico_stfile *f);
size_t bico__stfile_nmeta(const bico_stfile *f);
size_t bico__model_ntensors(const bico_model *m);
size_t bico__lora_nmodules(const bico_lora *l);
size_t bico__lora_nsaved(const bico_lora *l);

/* Frees the copy bico_stfile_data made (after its pointer has been used;
 * a later bico_stfile_data reads again). */
void bico__stfile_drop(const bico_stfile *f, size_t index);

/* "[4, 3]" for a shape, into buf (cut with "..." when cap is short);
 * returns buf.  For messages that state both shapes (lib/io/strings.c). */
const char *bico__shape_text(char *buf, size_t cap, size_t ndim,
                             const size_t *shape);

/* Renames f's tensors that begin with OLD to begin with NEW (rule
 * "OLD=NEW", lib/io/st_index.c); two tensors of one name after it is
 * BICO_E_ARG. */
bico_status bico__stfile_rename_prefix(bico_stfile *f, const char *rule);

/* bico_stwriter_commit without the rename: the temporary file is complete,
 * fsynced and closed, and *tf (owned by w) goes to bico__commit
 * (lib/io/fileio.h) together with a run's other outputs. */
struct bico__tmpfile;
bico_status bico__stwriter_finish(bico_stwriter *w, struct bico__tmpfile **tf);
/* The same for any writer (a folder writer has several files: shards,
 * index, copied files): *tf (owned by w) lists n temporary files for
 * bico__commit (a folder writer: one entry, its new folder, swapped in
 * whole); after a successful commit, bico__stwriter_committed marks the
 * files as gone with it. */
bico_status bico__stwriter_finish_all(bico_stwriter *w,
                                      struct bico__tmpfile ***tf, size_t *n);
void bico__stwriter_committed(bico_stwriter *w);
/* A file writer whose file is made at once under its final name `tmp`
 * (inside a new folder that a folder commit will swap in: O_EXCL, mode
 * 0600 until finished); `path` is the destination named in messages.
 * bico__stwriter_finish leaves the file complete there. */
bico_status bico__stwriter_create_at(bico_ctx *ctx, const char *path,
                                     const char *tmp, bico_stwriter **out);

/* A statistic read block by block: rows [i0, i0 + ni) x columns
 * [j0, j0 + nj) of C into out (row stride ld); release (may be NULL) says
 * a pass over C is over (a file-backed reader drops its pages). */
typedef struct bico__creader {
  bico_status (*block)(void *opaque, size_t i0, size_t ni, size_t j0,
                       size_t nj, double *out, size_t ld);
  void (*release)(void *opaque);
  void *opaque;
} bico__creader;

/* bico_procrustes_solve_matrix on a statistic that is read, not held: the
 * EIG route reads it in panels (never a d_a x d_b double copy); the SVD
 * reads it whole.  Same results as solve_matrix on the same values. */
bico_status bico__procrustes_solve_reader(bico_procrustes *p, size_t d_a,
                                          size_t d_b, const bico__creader *rd,
                                          float *r, size_t ld_r, size_t *rank);

/* The thin solve (lib/numeric/thin.c) of the map of C = x_a^T x_b (centered when
 * center) from the rows, n <= min(d_a, d_b); keep: BICO_NULL_KEEP's
 * completion, else DROP's.  *spec receives min(d_a, d_b) singular values
 * (allocated on ctx) on success. */
bico_status bico__thin_solve(bico_ctx *ctx, const char *fn, size_t n,
                             size_t d_a, size_t d_b, const float *x_a,
                             size_t ld_a, const float *x_b, size_t ld_b,
                             int center, double tol, int keep, float *r,
                             size_t ld_r, size_t *rank, double **spec);
/* A solver's context, and the hand-over of a spectrum (count values
 * allocated on that context) computed outside procrustes.c. */
bico_ctx *bico__procrustes_ctx(const bico_procrustes *p);
void bico__procrustes_take_spectrum(bico_procrustes *p, double *s,
                                    size_t count);

#endif
