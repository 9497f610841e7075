/* bico_xcov: the cross-covariance accumulator (add, merge, serialise). */
#include <float.h>
#include <math.h>
#include <string.h>

#include <blis.h>

#include "internal.h"

/* Exact mode: rows converted to double per dgemm.  256 rows keep the
 * scratch a few MB; blocks of up to 4096 rows (24 MB) were measured no
 * faster (docs/performance.md), the C update is not the bottleneck. */
#define EXACT_ROWS 256
/* Fast mode: rows per single-precision GEMM before its result is added to
 * the double accumulator.  Longer blocks run closer to sgemm's rate but add
 * more single-precision rounding; 2048 keeps the added error near 1e-7
 * relative (docs/performance.md). */
#define FAST_ROWS 2048

#define XCOV_MAGIC "BICOXCOV"
#define XCOV_FORMAT_VERSION 1u
/* magic 8, version u32, d_a u64, d_b u64, rows u64, flags u32 */
#define XCOV_HEADER_BYTES 40u
/* Flags that shape the stored statistics (and the serialised layout). */
#define XCOV_ALL_FLAGS ((unsigned)(BICO_XCOV_SUMS | BICO_XCOV_GRAMS))

struct bico_xcov {
  bico_ctx *ctx;
  size_t d_a, d_b;
  unsigned flags;
  int add_mode; /* bico_xcov_add_mode (an option, not stored) */
  uint64_t rows;
  size_t count; /* doubles in data */
  double *data; /* c, then sum_a, sum_b (SUMS), then g_a, g_b (GRAMS) */
  double *c, *sum_a, *sum_b, *g_a, *g_b;
};

/* Number of doubles an accumulator of these dims and flags holds; 1 on
 * overflow. */
static int doubles_needed(size_t d_a, size_t d_b, unsigned flags,
                          size_t *count) {
  size_t n, t;
  if (bico__mul(d_a, d_b, &n)) return 1;
  if (flags & BICO_XCOV_SUMS) {
    if (d_a > SIZE_MAX - d_b) return 1;
    t = d_a + d_b;
    if (n > SIZE_MAX - t) return 1;
    n += t;
  }
  if (flags & BICO_XCOV_GRAMS) {
    size_t ga, gb;
    if (bico__mul(d_a, d_a, &ga) || bico__mul(d_b, d_b, &gb)) return 1;
    if (ga > SIZE_MAX - gb) return 1;
    t = ga + gb;
    if (n > SIZE_MAX - t) return 1;
    n += t;
  }
  if (n > SIZE_MAX / sizeof(double)) return 1;
  *count = n;
  return 0;
}

static void set_views(bico_xcov *xc) {
  double *p = xc->data;
  xc->c = p;
  p += xc->d_a * xc->d_b;
  xc->sum_a = xc->sum_b = xc->g_a = xc->g_b = NULL;
  if (xc->flags & BICO_XCOV_SUMS) {
    xc->sum_a = p;
    p += xc->d_a;
    xc->sum_b = p;
    p += xc->d_b;
  }
  if (xc->flags & BICO_XCOV_GRAMS) {
    xc->g_a = p;
    p += xc->d_a * xc->d_a;
    xc->g_b = p;
  }
}

/* Builds a zeroed accumulator; the caller has validated the arguments. */
static bico_status make(bico_ctx *ctx, const char *fn, size_t d_a, size_t d_b,
                        unsigned flags, bico_xcov **out) {
  size_t count;
  if (doubles_needed(d_a, d_b, flags, &count))
    return bico__fail(ctx, BICO_E_SHAPE,
                      "%s: a %zu x %zu accumulator (flags %u) overflows the "
                      "address space",
                      fn, d_a, d_b, flags);
  bico_xcov *xc = bico__alloc(ctx, sizeof *xc);
  if (xc == NULL) return BICO_E_NOMEM;
  xc->data = bico__calloc(ctx, count, sizeof(double));
  if (xc->data == NULL) {
    bico__free(ctx, xc);
    return BICO_E_NOMEM;
  }
  xc->ctx = ctx;
  xc->d_a = d_a;
  xc->d_b = d_b;
  xc->flags = flags;
  xc->add_mode = BICO_XCOV_ADD_EXACT;
  xc->rows = 0;
  xc->count = count;
  set_views(xc);
  *out = xc;
  return BICO_OK;
}

bico_status bico_xcov_create(bico_ctx *ctx, size_t d_a, size_t d_b,
                             unsigned flags, bico_xcov **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "xcov_create: out is NULL");
  *out = NULL;
  if (d_a == 0 || d_b == 0)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "xcov_create: dimensions must be positive, got d_a = "
                      "%zu, d_b = %zu",
                      d_a, d_b);
  if (flags & ~XCOV_ALL_FLAGS)
    return bico__fail(ctx, BICO_E_ARG,
                      "xcov_create: unknown flags 0x%x (known: "
                      "BICO_XCOV_SUMS = 1, BICO_XCOV_GRAMS = 2; the fast "
                      "mode is the option BICO_XCOV_ADD_MODE)",
                      flags & ~XCOV_ALL_FLAGS);
  return make(ctx, "xcov_create", d_a, d_b, flags, out);
}

/* The option grammar (params.h, lib/base/params.c). */
static const bico__param_spec XPARAM[] = {
    [BICO_XCOV_ADD_MODE] = {"add_mode", 0, BICO_XCOV_ADD_FAST,
                            BICO_PARAM_INTEGER},
};

bico_status bico_xcov_param_bounds(int param, double *lo, double *hi,
                                   unsigned *flags) {
  return bico__param_bounds(XPARAM, BICO__NSPEC(XPARAM), param, lo, hi, flags);
}

const char *bico_xcov_param_name(int param) {
  return bico__param_name(XPARAM, BICO__NSPEC(XPARAM), param);
}

bico_status bico_xcov_param_from_name(const char *name, int *param) {
  return bico__param_from_name(XPARAM, BICO__NSPEC(XPARAM), name, param);
}

bico_status bico_xcov_set_param(bico_xcov *xc, int param, double value) {
  if (xc == NULL) return BICO_E_NULL;
  bico__clear(xc->ctx);
  bico_status st = bico__param_set(xc->ctx, "xcov_set_param", XPARAM,
                                   BICO__NSPEC(XPARAM), param, value);
  if (st != BICO_OK) return st;
  /* A choice: 0 is the default member (status.h). */
  xc->add_mode = value == 0 ? BICO_XCOV_ADD_EXACT : (int)value;
  return BICO_OK;
}

bico_status bico_xcov_get_param(const bico_xcov *xc, int param,
                                double *value) {
  if (xc == NULL) return BICO_E_NULL;
  bico_status st = bico__param_get(xc->ctx, "xcov_get_param", XPARAM,
                                   BICO__NSPEC(XPARAM), param, value);
  if (st != BICO_OK) return st;
  *value = xc->add_mode;
  return BICO_OK;
}

void bico_xcov_free(bico_xcov *xc) {
  if (xc == NULL) return;
  bico_ctx *ctx = xc->ctx;
  bico__free(ctx, xc->data);
  bico__free(ctx, xc);
}

/* Grams are accumulated with syrk (half the work of a GEMM) into the upper
 * triangle; the lower one is restored from it after every add, so the
 * stored matrix stays the full symmetric one. */
static void mirror_upper(double *g, size_t d) {
  for (size_t i = 1; i < d; i++)
    for (size_t j = 0; j < i; j++) g[i * d + j] = g[j * d + i];
}

static void runtime_for(const bico_ctx *ctx, rntm_t *rntm) {
  bli_rntm_init(rntm);
  bli_rntm_set_num_threads((dim_t)ctx->threads, rntm);
}

/* Upper triangle of g (d x d, row-major) += y^T y for y m x d, row stride
 * ld. */
static void dsyrk_upper(const bico_ctx *ctx, size_t d, size_t m,
                        const double *y, size_t ld, double *g) {
  double one = 1.0;
  rntm_t rntm;
  runtime_for(ctx, &rntm);
  bli_dsyrk_ex(BLIS_UPPER, BLIS_TRANSPOSE, (dim_t)d, (dim_t)m, &one,
               (double *)y, (inc_t)ld, 1, &one, g, (inc_t)d, 1, NULL, &rntm);
}

/* Upper triangle of f (d x d) = y^T y in single precision. */
static void ssyrk_upper(const bico_ctx *ctx, size_t d, size_t m,
                        const float *y, size_t ld, float *f) {
  float one = 1.0f, zero = 0.0f;
  rntm_t rntm;
  runtime_for(ctx, &rntm);
  bli_ssyrk_ex(BLIS_UPPER, BLIS_TRANSPOSE, (dim_t)d, (dim_t)m, &one,
               (float *)y, (inc_t)ld, 1, &zero, f, (inc_t)d, 1, NULL, &rntm);
}

/* Default mode.  float -> double is exact, and so is every product of two
 * such values: only the summation order separates this from an exact
 * result. */
static bico_status add_exact(bico_xcov *xc, size_t n, const float *x_a,
                             size_t ld_a, const float *x_b, size_t ld_b) {
  bico_ctx *ctx = xc->ctx;
  const size_t d_a = xc->d_a, d_b = xc->d_b;
  const size_t per_row = d_a + d_b; /* cannot overflow: both index memory */
  const size_t chunk = n < EXACT_ROWS ? n : EXACT_ROWS;
  size_t cnt;
  if (bico__mul(chunk, per_row, &cnt) || cnt > SIZE_MAX / sizeof(double))
    return bico__fail(ctx, BICO_E_SHAPE,
                      "xcov_add: scratch of %zu rows x %zu overflows", chunk,
                      per_row);
  double *scratch = bico__alloc(ctx, cnt * sizeof(double));
  if (scratch == NULL) return BICO_E_NOMEM;
  double *ya = scratch, *yb = scratch + chunk * d_a;

  for (size_t r0 = 0; r0 < n; r0 += chunk) {
    size_t m = n - r0 < chunk ? n - r0 : chunk;
    for (size_t i = 0; i < m; i++) {
      const float *pa = x_a + (r0 + i) * ld_a;
      const float *pb = x_b + (r0 + i) * ld_b;
      double *qa = ya + i * d_a, *qb = yb + i * d_b;
      for (size_t j = 0; j < d_a; j++) qa[j] = pa[j];
      for (size_t j = 0; j < d_b; j++) qb[j] = pb[j];
    }
    bico__dgemm(ctx, 1, 0, d_a, d_b, m, 1.0, ya, d_a, yb, d_b, 1.0, xc->c,
                d_b);
    if (xc->flags & BICO_XCOV_SUMS) {
      for (size_t i = 0; i < m; i++) {
        const double *qa = ya + i * d_a, *qb = yb + i * d_b;
        for (size_t j = 0; j < d_a; j++) xc->sum_a[j] += qa[j];
        for (size_t j = 0; j < d_b; j++) xc->sum_b[j] += qb[j];
      }
    }
    if (xc->flags & BICO_XCOV_GRAMS) {
      dsyrk_upper(ctx, d_a, m, ya, d_a, xc->g_a);
      dsyrk_upper(ctx, d_b, m, yb, d_b, xc->g_b);
    }
  }
  bico__free(ctx, scratch);
  return BICO_OK;
}

/* dst (rows x cols, contiguous) += src; upper != 0 adds only the upper
 * triangle of a square block. */
static void add_block(double *dst, const float *src, size_t rows, size_t cols,
                      int upper) {
  for (size_t i = 0; i < rows; i++)
    for (size_t j = upper ? i : 0; j < cols; j++)
      dst[i * cols + j] += (double)src[i * cols + j];
}

/* BICO_XCOV_ADD_FAST: sgemm straight on the caller's rows (strides, no copy),
 * FAST_ROWS rows at a time, each block result added in double. */
static double max_abs(const float *x, size_t n, size_t d, size_t ld) {
  double m = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < d; j++) {
      const double v = fabs((double)x[i * ld + j]);
      if (v > m) m = v;
    }
  return m;
}

static bico_status add_fast(bico_xcov *xc, size_t n, const float *x_a,
                            size_t ld_a, const float *x_b, size_t ld_b) {
  bico_ctx *ctx = xc->ctx;
  const size_t d_a = xc->d_a, d_b = xc->d_b;
  /* A block sum is at most FAST_ROWS times the largest product.  Where
   * that could overflow single precision (finite inputs beyond ~1e17),
   * the whole call takes the exact path, whose products cannot. */
  const double ma = max_abs(x_a, n, d_a, ld_a), mb = max_abs(x_b, n, d_b, ld_b);
  double big = ma * mb;
  if (xc->flags & BICO_XCOV_GRAMS) {
    if (ma * ma > big) big = ma * ma;
    if (mb * mb > big) big = mb * mb;
  }
  if (!(big * FAST_ROWS < 0.5 * (double)FLT_MAX))
    return add_exact(xc, n, x_a, ld_a, x_b, ld_b);
  size_t cnt = d_a * d_b, sq; /* d_a * d_b fits: the accumulator exists */
  if (xc->flags & BICO_XCOV_GRAMS) {
    size_t d = d_a > d_b ? d_a : d_b;
    if (bico__mul(d, d, &sq))
      return bico__fail(ctx, BICO_E_SHAPE, "xcov_add: %zu x %zu overflows",
                        d, d);
    if (sq > cnt) cnt = sq;
  }
  if (cnt > SIZE_MAX / sizeof(float))
    return bico__fail(ctx, BICO_E_SHAPE, "xcov_add: scratch overflows");
  float *f = bico__alloc(ctx, cnt * sizeof(float));
  if (f == NULL) return BICO_E_NOMEM;

  for (size_t r0 = 0; r0 < n; r0 += FAST_ROWS) {
    size_t m = n - r0 < FAST_ROWS ? n - r0 : FAST_ROWS;
    const float *pa = x_a + r0 * ld_a, *pb = x_b + r0 * ld_b;
    bico__sgemm(ctx, 1, 0, d_a, d_b, m, 1.0f, pa, ld_a, pb, ld_b, 0.0f, f,
                d_b);
    add_block(xc->c, f, d_a, d_b, 0);
    if (xc->flags & BICO_XCOV_GRAMS) {
      ssyrk_upper(ctx, d_a, m, pa, ld_a, f);
      add_block(xc->g_a, f, d_a, d_a, 1);
      ssyrk_upper(ctx, d_b, m, pb, ld_b, f);
      add_block(xc->g_b, f, d_b, d_b, 1);
    }
  }
  /* Column sums are exact in double whatever the mode: they are cheap. */
  if (xc->flags & BICO_XCOV_SUMS) {
    for (size_t i = 0; i < n; i++) {
      const float *qa = x_a + i * ld_a, *qb = x_b + i * ld_b;
      for (size_t j = 0; j < d_a; j++) xc->sum_a[j] += qa[j];
      for (size_t j = 0; j < d_b; j++) xc->sum_b[j] += qb[j];
    }
  }
  bico__free(ctx, f);
  return BICO_OK;
}

bico_status bico_xcov_add(bico_xcov *xc, size_t n, const float *x_a,
                          size_t ld_a, const float *x_b, size_t ld_b) {
  if (xc == NULL) return BICO_E_NULL;
  bico_ctx *ctx = xc->ctx;
  bico__clear(ctx);
  if (n == 0) return BICO_OK;
  if (x_a == NULL || x_b == NULL)
    return bico__fail(ctx, BICO_E_NULL, "xcov_add: %s is NULL with n = %zu",
                      x_a == NULL ? "x_a" : "x_b", n);
  if (ld_a < xc->d_a || ld_b < xc->d_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "xcov_add: row stride %s = %zu is below the width %zu",
                      ld_a < xc->d_a ? "ld_a" : "ld_b",
                      ld_a < xc->d_a ? ld_a : ld_b,
                      ld_a < xc->d_a ? xc->d_a : xc->d_b);
  if ((uint64_t)n > UINT64_MAX - xc->rows)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "xcov_add: row count %llu + %zu overflows",
                      (unsigned long long)xc->rows, n);
  /* Validate everything before touching the accumulator. */
  bico_status st =
      bico__check_finite_f32(ctx, "xcov_add", "x_a", x_a, n, xc->d_a, ld_a);
  if (st != BICO_OK) return st;
  st = bico__check_finite_f32(ctx, "xcov_add", "x_b", x_b, n, xc->d_b, ld_b);
  if (st != BICO_OK) return st;

  st = xc->add_mode == BICO_XCOV_ADD_FAST
           ? add_fast(xc, n, x_a, ld_a, x_b, ld_b)
           : add_exact(xc, n, x_a, ld_a, x_b, ld_b);
  if (st != BICO_OK) return st;
  if (xc->flags & BICO_XCOV_GRAMS) {
    mirror_upper(xc->g_a, xc->d_a);
    mirror_upper(xc->g_b, xc->d_b);
  }
  xc->rows += (uint64_t)n;
  return BICO_OK;
}

bico_status bico_xcov_add_matrix(bico_xcov *xc, uint64_t rows, const double *c,
                                 size_t ld_c) {
  if (xc == NULL) return BICO_E_NULL;
  bico_ctx *ctx = xc->ctx;
  bico__clear(ctx);
  if (c == NULL) return bico__fail(ctx, BICO_E_NULL, "xcov_add_matrix: c is NULL");
  if (xc->flags & XCOV_ALL_FLAGS)
    return bico__fail(ctx, BICO_E_STATE,
                      "xcov_add_matrix: the accumulator keeps %s%s%s, which "
                      "cannot be recovered from a cross-covariance alone; "
                      "create it without flags",
                      (xc->flags & BICO_XCOV_SUMS) ? "sums (BICO_XCOV_SUMS)" : "",
                      (xc->flags & XCOV_ALL_FLAGS) == XCOV_ALL_FLAGS ? " and "
                                                                   : "",
                      (xc->flags & BICO_XCOV_GRAMS) ? "Grams (BICO_XCOV_GRAMS)"
                                                    : "");
  if (ld_c < xc->d_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "xcov_add_matrix: row stride ld_c = %zu is below d_b = "
                      "%zu",
                      ld_c, xc->d_b);
  if (rows > UINT64_MAX - xc->rows)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "xcov_add_matrix: row count %llu + %llu overflows",
                      (unsigned long long)xc->rows, (unsigned long long)rows);
  bico_status st = bico__check_finite_f64(ctx, "xcov_add_matrix", "c", c,
                                          xc->d_a, xc->d_b, ld_c);
  if (st != BICO_OK) return st;
  for (size_t i = 0; i < xc->d_a; i++)
    for (size_t j = 0; j < xc->d_b; j++)
      if (!isfinite(xc->c[i * xc->d_b + j] + c[i * ld_c + j]))
        return bico__fail(ctx, BICO_E_NONFINITE,
                          "xcov_add_matrix: the sum overflows at row %zu, "
                          "column %zu",
                          i, j);
  for (size_t i = 0; i < xc->d_a; i++)
    for (size_t j = 0; j < xc->d_b; j++) xc->c[i * xc->d_b + j] += c[i * ld_c + j];
  xc->rows += rows;
  return BICO_OK;
}

bico_status bico_xcov_merge(bico_xcov *dst, const bico_xcov *src) {
  if (dst == NULL) return BICO_E_NULL;
  bico_ctx *ctx = dst->ctx;
  bico__clear(ctx);
  if (src == NULL) return bico__fail(ctx, BICO_E_NULL, "xcov_merge: src is NULL");
  if (dst->d_a != src->d_a || dst->d_b != src->d_b)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "xcov_merge: dst is %zu x %zu but src is %zu x %zu",
                      dst->d_a, dst->d_b, src->d_a, src->d_b);
  if (dst->flags != src->flags)
    return bico__fail(ctx, BICO_E_ARG,
                      "xcov_merge: dst has flags %u but src has flags %u",
                      dst->flags, src->flags);
  if (src->rows > UINT64_MAX - dst->rows)
    return bico__fail(ctx, BICO_E_SHAPE, "xcov_merge: row count %llu + %llu overflows",
                      (unsigned long long)dst->rows,
                      (unsigned long long)src->rows);
  /* Same dims and flags: the data blocks have the same layout. */
  for (size_t i = 0; i < dst->count; i++)
    if (!isfinite(dst->data[i] + src->data[i]))
      return bico__fail(ctx, BICO_E_NONFINITE,
                        "xcov_merge: the sum overflows at element %zu", i);
  for (size_t i = 0; i < dst->count; i++) dst->data[i] += src->data[i];
  dst->rows += src->rows;
  return BICO_OK;
}

bico_status bico_xcov_info(const bico_xcov *xc, size_t *d_a, size_t *d_b,
                           uint64_t *rows, unsigned *flags) {
  if (xc == NULL) return BICO_E_NULL;
  if (d_a) *d_a = xc->d_a;
  if (d_b) *d_b = xc->d_b;
  if (rows) *rows = xc->rows;
  if (flags) *flags = xc->flags;
  return BICO_OK;
}

bico_status bico_xcov_matrix(const bico_xcov *xc, int which, int centered,
                             double *out, size_t ld_out) {
  if (xc == NULL) return BICO_E_NULL;
  bico_ctx *ctx = xc->ctx;
  if (out == NULL) return bico__fail(ctx, BICO_E_NULL, "xcov_matrix: out is NULL");
  const double *m, *u, *v;
  size_t rows, cols;
  switch (which) {
    case BICO_XCOV_CROSS:
      m = xc->c, rows = xc->d_a, cols = xc->d_b, u = xc->sum_a, v = xc->sum_b;
      break;
    case BICO_XCOV_GRAM_A:
    case BICO_XCOV_GRAM_B:
      if (!(xc->flags & BICO_XCOV_GRAMS))
        return bico__fail(ctx, BICO_E_STATE,
                          "xcov_matrix: the Gram matrix needs an accumulator "
                          "created with BICO_XCOV_GRAMS");
      if (which == BICO_XCOV_GRAM_A)
        m = xc->g_a, rows = cols = xc->d_a, u = v = xc->sum_a;
      else
        m = xc->g_b, rows = cols = xc->d_b, u = v = xc->sum_b;
      break;
    default:
      return bico__fail(ctx, BICO_E_ARG,
                        "xcov_matrix: which = %d is not BICO_XCOV_CROSS (1), "
                        "GRAM_A (2) or GRAM_B (3)",
                        which);
  }
  if (centered && !(xc->flags & BICO_XCOV_SUMS))
    return bico__fail(ctx, BICO_E_STATE,
                      "xcov_matrix: centering needs an accumulator created "
                      "with BICO_XCOV_SUMS");
  if (ld_out < cols)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "xcov_matrix: row stride ld_out = %zu is below the "
                      "width %zu",
                      ld_out, cols);
  if (centered && xc->rows > 0) {
    /* sum (x_a - mu_a)^T (x_b - mu_b) = C - s_a s_b^T / n */
    const double inv_n = 1.0 / (double)xc->rows;
    for (size_t i = 0; i < rows; i++) {
      const double ui = u[i] * inv_n;
      for (size_t j = 0; j < cols; j++)
        out[i * ld_out + j] = m[i * cols + j] - ui * v[j];
    }
    /* Finite inputs near DBL_MAX (deserialised data) can overflow here;
     * found by fuzzing (test/fuzz/regressions/fuzz_xcov). */
    bico_status st = bico__check_finite_f64(ctx, "xcov_matrix",
                                            "the centered matrix", out, rows,
                                            cols, ld_out);
    if (st != BICO_OK) return st;
  } else {
    for (size_t i = 0; i < rows; i++)
      memcpy(out + i * ld_out, m + i * cols, cols * sizeof(double));
  }
  return BICO_OK;
}

bico_status bico_xcov_sums(const bico_xcov *xc, double *sum_a, double *sum_b) {
  if (xc == NULL) return BICO_E_NULL;
  bico_ctx *ctx = xc->ctx;
  if (sum_a == NULL || sum_b == NULL)
    return bico__fail(ctx, BICO_E_NULL, "xcov_sums: %s is NULL",
                      sum_a == NULL ? "sum_a" : "sum_b");
  if (!(xc->flags & BICO_XCOV_SUMS))
    return bico__fail(ctx, BICO_E_STATE,
                      "xcov_sums: the accumulator was created without "
                      "BICO_XCOV_SUMS");
  memcpy(sum_a, xc->sum_a, xc->d_a * sizeof(double));
  memcpy(sum_b, xc->sum_b, xc->d_b * sizeof(double));
  return BICO_OK;
}

/* ---- serialisation: explicit little-endian bytes, whatever the host ---- */

bico_status bico_xcov_serialized_size(const bico_xcov *xc, size_t *size) {
  if (xc == NULL) return BICO_E_NULL;
  if (size == NULL)
    return bico__fail(xc->ctx, BICO_E_NULL, "xcov_serialized_size: size is NULL");
  if (xc->count > (SIZE_MAX - XCOV_HEADER_BYTES) / 8)
    return bico__fail(xc->ctx, BICO_E_SHAPE,
                      "xcov_serialized_size: %zu doubles overflow size_t",
                      xc->count);
  *size = XCOV_HEADER_BYTES + 8 * xc->count;
  return BICO_OK;
}

bico_status bico_xcov_serialize(const bico_xcov *xc, void *buf, size_t cap,
                                size_t *written) {
  if (xc == NULL) return BICO_E_NULL;
  bico_ctx *ctx = xc->ctx;
  size_t need;
  bico_status st = bico_xcov_serialized_size(xc, &need);
  if (st != BICO_OK) return st;
  if (buf == NULL || written == NULL)
    return bico__fail(ctx, BICO_E_NULL, "xcov_serialize: %s is NULL",
                      buf == NULL ? "buf" : "written");
  if (cap < need)
    return bico__fail(ctx, BICO_E_ARG,
                      "xcov_serialize: buffer of %zu bytes is too small, %zu "
                      "needed",
                      cap, need);
  unsigned char *p = buf;
  memcpy(p, XCOV_MAGIC, 8);
  bico__put_u32(p + 8, XCOV_FORMAT_VERSION);
  bico__put_u64(p + 12, (uint64_t)xc->d_a);
  bico__put_u64(p + 20, (uint64_t)xc->d_b);
  bico__put_u64(p + 28, xc->rows);
  bico__put_u32(p + 36, (uint32_t)(xc->flags & XCOV_ALL_FLAGS));
  p += XCOV_HEADER_BYTES;
  bico__put_f64s(p, xc->data, xc->count);
  *written = need;
  return BICO_OK;
}

bico_status bico_xcov_deserialize(bico_ctx *ctx, const void *buf, size_t len,
                                  bico_xcov **out) {
  static const char fn[] = "xcov_deserialize";
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (buf == NULL || out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: %s is NULL", fn,
                      buf == NULL ? "buf" : "out");
  *out = NULL;
  const unsigned char *p = buf;
  if (len < 8)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: truncated: %zu bytes, the header alone has %u", fn,
                      len, XCOV_HEADER_BYTES);
  if (memcmp(p, XCOV_MAGIC, 8) != 0)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: bad magic: the data does not start with \"%s\"", fn,
                      XCOV_MAGIC);
  if (len < 12)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: truncated: %zu bytes, the header alone has %u", fn,
                      len, XCOV_HEADER_BYTES);
  uint32_t version = bico__get_u32(p + 8);
  if (version != XCOV_FORMAT_VERSION)
    return bico__fail(ctx, BICO_E_VERSION,
                      "%s: unknown format version %u (this library reads "
                      "version %u)",
                      fn, version, XCOV_FORMAT_VERSION);
  if (len < XCOV_HEADER_BYTES)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: truncated: %zu bytes, the header alone has %u", fn,
                      len, XCOV_HEADER_BYTES);
  uint64_t d_a64 = bico__get_u64(p + 12), d_b64 = bico__get_u64(p + 20);
  uint64_t rows = bico__get_u64(p + 28);
  uint32_t flags = bico__get_u32(p + 36);
  if (flags & ~XCOV_ALL_FLAGS)
    return bico__fail(ctx, BICO_E_FORMAT, "%s: unknown flags 0x%x", fn,
                      (unsigned)(flags & ~XCOV_ALL_FLAGS));
  if (d_a64 == 0 || d_b64 == 0)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: zero dimension (d_a = %llu, d_b = %llu)", fn,
                      (unsigned long long)d_a64, (unsigned long long)d_b64);
  size_t count;
  if (d_a64 > SIZE_MAX || d_b64 > SIZE_MAX ||
      doubles_needed((size_t)d_a64, (size_t)d_b64, flags, &count) ||
      count > (SIZE_MAX - XCOV_HEADER_BYTES) / 8)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: dimensions %llu x %llu overflow the address space",
                      fn, (unsigned long long)d_a64, (unsigned long long)d_b64);
  size_t need = XCOV_HEADER_BYTES + 8 * count;
  if (len < need)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: truncated: %zu bytes, a %llu x %llu accumulator "
                      "(flags %u) needs %zu",
                      fn, len, (unsigned long long)d_a64,
                      (unsigned long long)d_b64, (unsigned)flags, need);
  if (len > need)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: %zu trailing bytes after the %zu the header "
                      "describes",
                      fn, len - need, need);
  const unsigned char *q = p + XCOV_HEADER_BYTES;
  bico_status st = bico__check_finite_bytes(ctx, fn, q, count);
  if (st != BICO_OK) return st;
  bico_xcov *xc = NULL;
  st = make(ctx, fn, (size_t)d_a64, (size_t)d_b64, flags, &xc);
  if (st != BICO_OK) return st;
  bico__get_f64s(q, xc->data, count);
  xc->rows = rows;
  *out = xc;
  return BICO_OK;
}

bico_status bico__xcov_block(bico_ctx *ctx, const bico_xcov *x, size_t b,
                             size_t k, bico_xcov **out) {
  *out = NULL;
  if (k == 0 || b >= k || x->d_a % k || x->d_b % k)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "a %zu x %zu statistic does not split in %zu blocks",
                      x->d_a, x->d_b, k);
  size_t ba = x->d_a / k, bb = x->d_b / k, ia = b * ba, ib = b * bb;
  bico_xcov *y = NULL;
  bico_status st = bico_xcov_create(ctx, ba, bb, x->flags & XCOV_ALL_FLAGS,
                                    &y);
  if (st != BICO_OK) return st;
  y->rows = x->rows;
  for (size_t i = 0; i < ba; i++)
    memcpy(y->c + i * bb, x->c + (ia + i) * x->d_b + ib, bb * sizeof(double));
  if (x->flags & BICO_XCOV_SUMS) {
    memcpy(y->sum_a, x->sum_a + ia, ba * sizeof(double));
    memcpy(y->sum_b, x->sum_b + ib, bb * sizeof(double));
  }
  if (x->flags & BICO_XCOV_GRAMS) {
    for (size_t i = 0; i < ba; i++)
      memcpy(y->g_a + i * ba, x->g_a + (ia + i) * x->d_a + ia,
             ba * sizeof(double));
    for (size_t i = 0; i < bb; i++)
      memcpy(y->g_b + i * bb, x->g_b + (ib + i) * x->d_b + ib,
             bb * sizeof(double));
  }
  *out = y;
  return BICO_OK;
}
