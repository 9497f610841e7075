// BICO_XCOV_FAST (single-precision block products summed in double) and the
// syrk-based Grams: exactness where single precision is exact (small
// integers), error bounds against plain double references computed here,
// and the flag's bookkeeping (info, merge, serialisation, add_matrix).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

using bt::Mat;

namespace {

bool has(const char *msg, const char *needle) {
  return std::string(msg).find(needle) != std::string::npos;
}

// Rows with a stride wider than the width; entries from gen(r, j).
template <class F>
std::vector<float> rows_of(size_t n, size_t d, size_t ld, F gen) {
  std::vector<float> x(n * ld, -1e30f);  // padding must never be read
  for (size_t r = 0; r < n; r++)
    for (size_t j = 0; j < d; j++) x[r * ld + j] = gen(r, j);
  return x;
}

// Plain double reference x_a^T x_b.
Mat cross(const std::vector<float> &xa, size_t lda, const std::vector<float> &xb,
          size_t ldb, size_t n, size_t da, size_t db) {
  Mat c(da, db);
  for (size_t r = 0; r < n; r++)
    for (size_t i = 0; i < da; i++)
      for (size_t j = 0; j < db; j++)
        c(i, j) += double(xa[r * lda + i]) * double(xb[r * ldb + j]);
  return c;
}

Mat get(bico_xcov *xc, int which, size_t r, size_t c) {
  Mat m(r, c);
  EXPECT_EQ(bico_xcov_matrix(xc, which, 0, m.v.data(), c), BICO_OK);
  return m;
}

// An accumulator in the fast add mode (BICO_XCOV_ADD_MODE).
bico_status create_fast(bico_ctx *ctx, size_t da, size_t db, unsigned flags,
                        bico_xcov **out) {
  bico_status st = bico_xcov_create(ctx, da, db, flags, out);
  if (st == BICO_OK) st = bico_xcov_set_param(*out, BICO_XCOV_ADD_MODE, BICO_XCOV_ADD_FAST);
  return st;
}

}  // namespace

// Integers in [-8, 8]: every product and every partial sum of 3000 rows is
// an integer below 2^24, exact in single precision, so the fast mode must
// agree with the exact double reference bit for bit (3000 rows span two
// blocks of the fast path).
TEST(XcovFastTest, ExactOnSmallIntegers) {
  const size_t n = 3000, da = 5, db = 7, lda = 9, ldb = 8;
  bt::Rng g(5);
  auto xa = rows_of(n, da, lda, [&](size_t, size_t) { return float(int(g.next() % 17) - 8); });
  auto xb = rows_of(n, db, ldb, [&](size_t, size_t) { return float(int(g.next() % 17) - 8); });
  bt::Ctx ctx;
  bico_xcov *xc = nullptr;
  ASSERT_EQ(create_fast(ctx, da, db, BICO_XCOV_SUMS | BICO_XCOV_GRAMS, &xc),
            BICO_OK);
  // Two adds, the first not a multiple of the block size.
  ASSERT_EQ(bico_xcov_add(xc, 1234, xa.data(), lda, xb.data(), ldb), BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, n - 1234, xa.data() + 1234 * lda, lda,
                          xb.data() + 1234 * ldb, ldb),
            BICO_OK);
  Mat c = get(xc, BICO_XCOV_CROSS, da, db);
  Mat ga = get(xc, BICO_XCOV_GRAM_A, da, da);
  Mat gb = get(xc, BICO_XCOV_GRAM_B, db, db);
  EXPECT_EQ(c.v, cross(xa, lda, xb, ldb, n, da, db).v);
  EXPECT_EQ(ga.v, cross(xa, lda, xa, lda, n, da, da).v);
  EXPECT_EQ(gb.v, cross(xb, ldb, xb, ldb, n, db, db).v);
  std::vector<double> sa(da), sb(db), ra(da, 0), rb(db, 0);
  ASSERT_EQ(bico_xcov_sums(xc, sa.data(), sb.data()), BICO_OK);
  for (size_t r = 0; r < n; r++) {
    for (size_t j = 0; j < da; j++) ra[j] += xa[r * lda + j];
    for (size_t j = 0; j < db; j++) rb[j] += xb[r * ldb + j];
  }
  EXPECT_EQ(sa, ra);
  EXPECT_EQ(sb, rb);
  uint64_t rows = 0;
  unsigned flags = 0;
  ASSERT_EQ(bico_xcov_info(xc, nullptr, nullptr, &rows, &flags), BICO_OK);
  EXPECT_EQ(rows, n);
  EXPECT_EQ(flags, unsigned(BICO_XCOV_SUMS | BICO_XCOV_GRAMS));
  double mode = 0;
  ASSERT_EQ(bico_xcov_get_param(xc, BICO_XCOV_ADD_MODE, &mode), BICO_OK);
  EXPECT_EQ(mode, BICO_XCOV_ADD_FAST);
  bico_xcov_free(xc);
}

// General floats: the fast mode's error is single-precision sized (well
// below 1e-5 relative), the default's double-precision sized; Grams are
// symmetric bit for bit in both modes.
TEST(XcovFastTest, ErrorBoundsAgainstDouble) {
  const size_t n = 5000, da = 24, db = 17;
  bt::Rng g(9);
  auto xa = rows_of(n, da, da, [&](size_t, size_t j) { return float(g.normal() + 0.3 * (j % 3)); });
  auto xb = rows_of(n, db, db, [&](size_t, size_t) { return float(g.normal()); });
  Mat ref = cross(xa, da, xb, db, n, da, db);
  Mat refga = cross(xa, da, xa, da, n, da, da);
  bt::Ctx ctx;
  for (int mode : {0, int(BICO_XCOV_ADD_FAST)}) {
    bico_xcov *xc = nullptr;
    ASSERT_EQ(bico_xcov_create(ctx, da, db, BICO_XCOV_GRAMS, &xc), BICO_OK);
    ASSERT_EQ(bico_xcov_set_param(xc, BICO_XCOV_ADD_MODE, mode), BICO_OK);
    for (size_t r0 = 0; r0 < n; r0 += 700) {
      size_t m = std::min<size_t>(700, n - r0);
      ASSERT_EQ(bico_xcov_add(xc, m, xa.data() + r0 * da, da, xb.data() + r0 * db, db),
                BICO_OK);
    }
    double e = bt::relerr(get(xc, BICO_XCOV_CROSS, da, db), ref);
    Mat ga = get(xc, BICO_XCOV_GRAM_A, da, da);
    double eg = bt::relerr(ga, refga);
    if (mode) {
      EXPECT_LT(e, 1e-5);
      EXPECT_LT(eg, 1e-5);
    } else {
      EXPECT_LT(e, 1e-13);
      EXPECT_LT(eg, 1e-13);
    }
    for (size_t i = 0; i < da; i++)
      for (size_t j = 0; j < i; j++) EXPECT_EQ(ga(i, j), ga(j, i));
    bico_xcov_free(xc);
  }
}

// The mode is not part of the statistics: merge ignores it, serialisation
// stores only the layout flags, add_matrix works when only FAST is set.
TEST(XcovFastTest, FlagBookkeeping) {
  bt::Ctx ctx;
  bico_xcov *f = nullptr, *e = nullptr, *s = nullptr, *d = nullptr;
  ASSERT_EQ(create_fast(ctx, 2, 3, BICO_XCOV_SUMS, &f), BICO_OK);
  ASSERT_EQ(bico_xcov_create(ctx, 2, 3, BICO_XCOV_SUMS, &e), BICO_OK);
  ASSERT_EQ(create_fast(ctx, 2, 3, 0, &s), BICO_OK);
  const float xa[] = {1, 2, 3, 4}, xb[] = {1, 0, 2, 0, 1, 3};
  ASSERT_EQ(bico_xcov_add(f, 2, xa, 2, xb, 3), BICO_OK);
  ASSERT_EQ(bico_xcov_add(e, 2, xa, 2, xb, 3), BICO_OK);
  ASSERT_EQ(bico_xcov_merge(e, f), BICO_OK);
  Mat c = get(e, BICO_XCOV_CROSS, 2, 3);
  // 2 x (x_a^T x_b): row 0 = 2*(1*[1 0 2] + 3*[0 1 3]) = [2 6 22]
  EXPECT_EQ(c(0, 0), 2);
  EXPECT_EQ(c(0, 1), 6);
  EXPECT_EQ(c(0, 2), 22);
  EXPECT_EQ(bico_xcov_merge(s, f), BICO_E_ARG);  // layouts differ
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "flags"));

  const double m[] = {1, 2, 3, 4, 5, 6};
  EXPECT_EQ(bico_xcov_add_matrix(s, 10, m, 3), BICO_OK);
  EXPECT_EQ(bico_xcov_add_matrix(f, 10, m, 3), BICO_E_STATE);

  size_t size = 0, written = 0;
  ASSERT_EQ(bico_xcov_serialized_size(f, &size), BICO_OK);
  std::vector<unsigned char> buf(size);
  ASSERT_EQ(bico_xcov_serialize(f, buf.data(), size, &written), BICO_OK);
  EXPECT_EQ(buf[36], unsigned(BICO_XCOV_SUMS));
  ASSERT_EQ(bico_xcov_deserialize(ctx, buf.data(), written, &d), BICO_OK);
  unsigned flags = 0;
  ASSERT_EQ(bico_xcov_info(d, nullptr, nullptr, nullptr, &flags), BICO_OK);
  EXPECT_EQ(flags, unsigned(BICO_XCOV_SUMS));
  EXPECT_EQ(get(d, BICO_XCOV_CROSS, 2, 3).v, get(f, BICO_XCOV_CROSS, 2, 3).v);
  double mode = -1;  // a deserialised accumulator adds in the default mode
  ASSERT_EQ(bico_xcov_get_param(d, BICO_XCOV_ADD_MODE, &mode), BICO_OK);
  EXPECT_EQ(mode, BICO_XCOV_ADD_EXACT);

  // The mode is an option, not a create flag: 8 (once the fast flag) and
  // other unknown bits are refused with a message naming the option.
  bico_xcov *bad = nullptr;
  for (unsigned fl : {4u, 8u, 16u}) {
    EXPECT_EQ(bico_xcov_create(ctx, 2, 3, fl, &bad), BICO_E_ARG) << fl;
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "BICO_XCOV_ADD_MODE")) << bico_ctx_errmsg(ctx);
    EXPECT_EQ(bad, nullptr);
  }
  for (auto *x : {f, e, s, d}) bico_xcov_free(x);
}

// NaN in the fast mode is rejected before anything is added.
TEST(XcovFastTest, NonFiniteLeavesUnchanged) {
  bt::Ctx ctx;
  bico_xcov *xc = nullptr;
  ASSERT_EQ(create_fast(ctx, 2, 2, BICO_XCOV_GRAMS, &xc), BICO_OK);
  const float a[] = {1, 2, 3, 4}, b[] = {1, NAN, 0, 1};
  EXPECT_EQ(bico_xcov_add(xc, 2, a, 2, b, 2), BICO_E_NONFINITE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "x_b"));
  uint64_t rows = 7;
  ASSERT_EQ(bico_xcov_info(xc, nullptr, nullptr, &rows, nullptr), BICO_OK);
  EXPECT_EQ(rows, 0u);
  EXPECT_EQ(get(xc, BICO_XCOV_GRAM_A, 2, 2).v, std::vector<double>(4, 0.0));
  bico_xcov_free(xc);
}

// Finite inputs whose products overflow single precision (1e20 squared):
// the fast mode must still give the finite double-precision statistics.
TEST(XcovFastTest, LargeValuesStayFinite) {
  const size_t n = 6, da = 3, db = 2;
  bt::Rng g(41);
  auto xa = rows_of(n, da, da, [&](size_t, size_t) { return float(1e20 * g.normal()); });
  auto xb = rows_of(n, db, db, [&](size_t, size_t) { return float(1e20 * g.normal()); });
  bt::Ctx ctx;
  bico_xcov *xc = nullptr;
  ASSERT_EQ(create_fast(ctx, da, db, BICO_XCOV_GRAMS, &xc), BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, n, xa.data(), da, xb.data(), db), BICO_OK);
  Mat c = get(xc, BICO_XCOV_CROSS, da, db), ref = cross(xa, da, xb, db, n, da, db);
  for (double v : c.v) EXPECT_TRUE(std::isfinite(v));
  EXPECT_LT(bt::relerr(c, ref), 1e-14);
  Mat ga = get(xc, BICO_XCOV_GRAM_A, da, da);
  EXPECT_LT(bt::relerr(ga, cross(xa, da, xa, da, n, da, da)), 1e-14);
  bico_xcov_free(xc);
}

// The option grammar (params.h): ADD_MODE is an integer choice in [0, 2],
// 0 resolving to EXACT; names both ways from the library.
TEST(XcovFastTest, AddModeOption) {
  bt::Ctx ctx;
  bico_xcov *xc = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, 2, 2, 0, &xc), BICO_OK);
  double v = -1;
  ASSERT_EQ(bico_xcov_get_param(xc, BICO_XCOV_ADD_MODE, &v), BICO_OK);
  EXPECT_EQ(v, BICO_XCOV_ADD_EXACT);
  ASSERT_EQ(bico_xcov_set_param(xc, BICO_XCOV_ADD_MODE, BICO_XCOV_ADD_FAST), BICO_OK);
  ASSERT_EQ(bico_xcov_set_param(xc, BICO_XCOV_ADD_MODE, 0), BICO_OK);
  ASSERT_EQ(bico_xcov_get_param(xc, BICO_XCOV_ADD_MODE, &v), BICO_OK);
  EXPECT_EQ(v, BICO_XCOV_ADD_EXACT);
  for (double bad : {-1.0, 3.0, 1.5, double(NAN)}) {
    EXPECT_EQ(bico_xcov_set_param(xc, BICO_XCOV_ADD_MODE, bad), BICO_E_ARG) << bad;
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "add_mode")) << bico_ctx_errmsg(ctx);
  }
  EXPECT_EQ(bico_xcov_set_param(xc, 2, 1), BICO_E_ARG);
  EXPECT_EQ(bico_xcov_get_param(xc, 0, &v), BICO_E_ARG);
  double lo, hi;
  unsigned flags;
  ASSERT_EQ(bico_xcov_param_bounds(BICO_XCOV_ADD_MODE, &lo, &hi, &flags), BICO_OK);
  EXPECT_EQ(lo, 0);
  EXPECT_EQ(hi, 2);
  EXPECT_EQ(flags, unsigned(BICO_PARAM_INTEGER));
  EXPECT_EQ(bico_xcov_param_bounds(7, &lo, &hi, &flags), BICO_E_ARG);
  int k = 0;
  ASSERT_EQ(bico_xcov_param_from_name("add_mode", &k), BICO_OK);
  EXPECT_EQ(k, BICO_XCOV_ADD_MODE);
  ASSERT_EQ(bico_xcov_add_mode_from_name("fast", &k), BICO_OK);
  EXPECT_EQ(k, BICO_XCOV_ADD_FAST);
  EXPECT_STREQ(bico_xcov_add_mode_name(BICO_XCOV_ADD_EXACT), "exact");
  EXPECT_EQ(bico_xcov_add_mode_name(0), nullptr);
  EXPECT_EQ(bico_xcov_flag_from_name("fast", &k), BICO_E_NOTFOUND);
  bico_xcov_free(xc);
}
