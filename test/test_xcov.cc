// Tests of the cross-covariance accumulator against plain double-precision
// references computed here (test/testutil.h), never against its own output.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

using bt::Mat;

namespace {

bool has(const char *msg, const char *needle) {
  return std::string(msg).find(needle) != std::string::npos;
}

// Rows of a float matrix with row stride ld (padding filled with NaN, so a
// read past the width would be caught as NONFINITE or wrong results).
struct FRows {
  size_t n, d, ld;
  std::vector<float> v;
  FRows(const Mat &m, size_t ld_)
      : n(m.r), d(m.c), ld(ld_),
        v(m.r * ld_, std::numeric_limits<float>::quiet_NaN()) {
    for (size_t i = 0; i < n; i++)
      for (size_t j = 0; j < d; j++) v[i * ld + j] = (float)m(i, j);
  }
  // The exact values the accumulator sees, as doubles.
  Mat exact() const { return Mat::from(v.data(), n, d, ld); }
  const float *row(size_t i) const { return v.data() + i * ld; }
};

Mat get(bico_xcov *xc, int which, int centered, size_t r, size_t c) {
  Mat m(r, c);
  EXPECT_EQ(bico_xcov_matrix(xc, which, centered, m.v.data(), c), BICO_OK);
  return m;
}

std::vector<unsigned char> ser(bico_xcov *xc) {
  size_t n = 0, w = 0;
  EXPECT_EQ(bico_xcov_serialized_size(xc, &n), BICO_OK);
  std::vector<unsigned char> b(n);
  EXPECT_EQ(bico_xcov_serialize(xc, b.data(), b.size(), &w), BICO_OK);
  EXPECT_EQ(w, n);
  return b;
}

Mat colsum(const Mat &x) {
  Mat s(1, x.c);
  for (size_t i = 0; i < x.r; i++)
    for (size_t j = 0; j < x.c; j++) s(0, j) += x(i, j);
  return s;
}

}  // namespace

TEST(XcovTest, MatchesPlainMatmul) {
  bt::Ctx ctx;
  bt::Rng g(1);
  const size_t n = 1000, da = 7, db = 5;  // n spans several internal chunks
  FRows a(bt::randn(g, n, da), da), b(bt::randn(g, n, db), db);
  bico_xcov *xc = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, da, db, BICO_XCOV_SUMS | BICO_XCOV_GRAMS, &xc),
            BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, n, a.v.data(), da, b.v.data(), db), BICO_OK);
  Mat xa = a.exact(), xb = b.exact();
  EXPECT_LT(bt::relerr(get(xc, BICO_XCOV_CROSS, 0, da, db),
                       bt::matmul(bt::transpose(xa), xb)),
            1e-12);
  EXPECT_LT(bt::relerr(get(xc, BICO_XCOV_GRAM_A, 0, da, da),
                       bt::matmul(bt::transpose(xa), xa)),
            1e-12);
  EXPECT_LT(bt::relerr(get(xc, BICO_XCOV_GRAM_B, 0, db, db),
                       bt::matmul(bt::transpose(xb), xb)),
            1e-12);
  Mat sa(1, da), sb(1, db);
  ASSERT_EQ(bico_xcov_sums(xc, sa.v.data(), sb.v.data()), BICO_OK);
  EXPECT_LT(bt::relerr(sa, colsum(xa)), 1e-12);
  EXPECT_LT(bt::relerr(sb, colsum(xb)), 1e-12);
  size_t ra = 0, rb = 0;
  uint64_t rows = 0;
  unsigned flags = 0;
  ASSERT_EQ(bico_xcov_info(xc, &ra, &rb, &rows, &flags), BICO_OK);
  EXPECT_EQ(ra, da);
  EXPECT_EQ(rb, db);
  EXPECT_EQ(rows, n);
  EXPECT_EQ(flags, unsigned(BICO_XCOV_SUMS | BICO_XCOV_GRAMS));
  bico_xcov_free(xc);
}

TEST(XcovTest, StridedInputsAndOutput) {
  bt::Ctx ctx;
  bt::Rng g(2);
  const size_t n = 300, da = 6, db = 9;
  FRows a(bt::randn(g, n, da), da + 3), b(bt::randn(g, n, db), db + 5);
  bico_xcov *xc = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, da, db, BICO_XCOV_GRAMS, &xc), BICO_OK);
  // Two calls, the second starting mid-buffer: row strides carry over.
  ASSERT_EQ(bico_xcov_add(xc, 100, a.row(0), a.ld, b.row(0), b.ld), BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, n - 100, a.row(100), a.ld, b.row(100), b.ld),
            BICO_OK);
  Mat ref = bt::matmul(bt::transpose(a.exact()), b.exact());
  // Output with a row stride: the padding must stay untouched.
  const size_t ld_out = db + 2;
  std::vector<double> out(da * ld_out, -7.0);
  ASSERT_EQ(bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, out.data(), ld_out), BICO_OK);
  Mat got(da, db);
  for (size_t i = 0; i < da; i++)
    for (size_t j = 0; j < ld_out; j++) {
      if (j < db) got(i, j) = out[i * ld_out + j];
      else EXPECT_EQ(out[i * ld_out + j], -7.0);
    }
  EXPECT_LT(bt::relerr(got, ref), 1e-12);
  EXPECT_LT(bt::relerr(get(xc, BICO_XCOV_GRAM_B, 0, db, db),
                       bt::matmul(bt::transpose(b.exact()), b.exact())),
            1e-12);
  bico_xcov_free(xc);
}

TEST(XcovTest, MergedHalvesEqualOnePass) {
  bt::Ctx ctx;
  bt::Rng g(3);
  const size_t n = 777, da = 8, db = 3, half = 400;
  FRows a(bt::randn(g, n, da, 2.0), da), b(bt::randn(g, n, db), db);
  const unsigned fl = BICO_XCOV_SUMS | BICO_XCOV_GRAMS;
  bico_xcov *all = nullptr, *h1 = nullptr, *h2 = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, da, db, fl, &all), BICO_OK);
  ASSERT_EQ(bico_xcov_create(ctx, da, db, fl, &h1), BICO_OK);
  ASSERT_EQ(bico_xcov_create(ctx, da, db, fl, &h2), BICO_OK);
  ASSERT_EQ(bico_xcov_add(all, n, a.row(0), da, b.row(0), db), BICO_OK);
  ASSERT_EQ(bico_xcov_add(h1, half, a.row(0), da, b.row(0), db), BICO_OK);
  ASSERT_EQ(bico_xcov_add(h2, n - half, a.row(half), da, b.row(half), db), BICO_OK);
  ASSERT_EQ(bico_xcov_merge(h1, h2), BICO_OK);
  const int which[3] = {BICO_XCOV_CROSS, BICO_XCOV_GRAM_A, BICO_XCOV_GRAM_B};
  const size_t rs[3] = {da, da, db}, cs[3] = {db, da, db};
  for (int w = 0; w < 3; w++)
    EXPECT_LT(bt::relerr(get(h1, which[w], 1, rs[w], cs[w]),
                         get(all, which[w], 1, rs[w], cs[w])),
              1e-12)
        << "matrix " << w;
  uint64_t r1 = 0, r2 = 0;
  bico_xcov_info(h1, nullptr, nullptr, &r1, nullptr);
  bico_xcov_info(all, nullptr, nullptr, &r2, nullptr);
  EXPECT_EQ(r1, uint64_t(n));
  EXPECT_EQ(r2, uint64_t(n));
  bico_xcov_free(all);
  bico_xcov_free(h1);
  bico_xcov_free(h2);
}

TEST(XcovTest, CenteredEqualsIndependentlyCentered) {
  bt::Ctx ctx;
  bt::Rng g(4);
  const size_t n = 500, da = 5, db = 4;
  Mat ma = bt::randn(g, n, da), mb = bt::randn(g, n, db);
  for (size_t i = 0; i < n; i++) {  // nonzero means, so centering matters
    for (size_t j = 0; j < da; j++) ma(i, j) += 3.0 + j;
    for (size_t j = 0; j < db; j++) mb(i, j) -= 2.0 * j;
  }
  FRows a(ma, da), b(mb, db);
  Mat xa = a.exact(), xb = b.exact();
  Mat mua = colsum(xa), mub = colsum(xb);
  for (auto &x : mua.v) x /= n;
  for (auto &x : mub.v) x /= n;
  Mat ca = xa, cb = xb;
  for (size_t i = 0; i < n; i++) {
    for (size_t j = 0; j < da; j++) ca(i, j) -= mua(0, j);
    for (size_t j = 0; j < db; j++) cb(i, j) -= mub(0, j);
  }
  bico_xcov *xc = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, da, db, BICO_XCOV_SUMS | BICO_XCOV_GRAMS, &xc),
            BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, n, a.row(0), da, b.row(0), db), BICO_OK);
  Mat cen = get(xc, BICO_XCOV_CROSS, 1, da, db);
  EXPECT_LT(bt::relerr(cen, bt::matmul(bt::transpose(ca), cb)), 1e-10);
  EXPECT_LT(bt::relerr(get(xc, BICO_XCOV_GRAM_A, 1, da, da),
                       bt::matmul(bt::transpose(ca), ca)),
            1e-10);
  // The uncentered one really differs (the test would catch a no-op).
  EXPECT_GT(bt::relerr(get(xc, BICO_XCOV_CROSS, 0, da, db), cen), 0.5);
  bico_xcov_free(xc);
}

TEST(XcovTest, SerializeRoundTripIsBitExact) {
  bt::Ctx ctx;
  bt::Rng g(5);
  const size_t n = 123, da = 4, db = 6;
  FRows a(bt::randn(g, n, da, 1e3), da), b(bt::randn(g, n, db, 1e-3), db);
  bico_xcov *xc = nullptr, *back = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, da, db, BICO_XCOV_SUMS | BICO_XCOV_GRAMS, &xc),
            BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, n, a.row(0), da, b.row(0), db), BICO_OK);
  std::vector<unsigned char> s = ser(xc);
  // The documented layout: 40-byte header, then the doubles.
  ASSERT_EQ(s.size(), 40 + 8 * (da * db + da + db + da * da + db * db));
  EXPECT_EQ(std::memcmp(s.data(), "BICOXCOV", 8), 0);
  EXPECT_EQ(s[8], 1);  // format version 1, little-endian u32
  EXPECT_EQ(s[9] | s[10] | s[11], 0);
  EXPECT_EQ(s[12], da);  // d_a as little-endian u64
  EXPECT_EQ(s[20], db);
  EXPECT_EQ(s[28], n);   // rows
  EXPECT_EQ(s[36], 3);   // flags
  ASSERT_EQ(bico_xcov_deserialize(ctx, s.data(), s.size(), &back), BICO_OK);
  const int which[3] = {BICO_XCOV_CROSS, BICO_XCOV_GRAM_A, BICO_XCOV_GRAM_B};
  const size_t rs[3] = {da, da, db}, cs[3] = {db, da, db};
  for (int w = 0; w < 3; w++) {
    Mat m1 = get(xc, which[w], 0, rs[w], cs[w]);
    Mat m2 = get(back, which[w], 0, rs[w], cs[w]);
    EXPECT_EQ(std::memcmp(m1.v.data(), m2.v.data(), m1.v.size() * 8), 0);
  }
  std::vector<double> s1(da + db), s2(da + db);
  bico_xcov_sums(xc, s1.data(), s1.data() + da);
  bico_xcov_sums(back, s2.data(), s2.data() + da);
  EXPECT_EQ(std::memcmp(s1.data(), s2.data(), s1.size() * 8), 0);
  std::vector<unsigned char> s_again = ser(back);
  ASSERT_EQ(s_again.size(), s.size());
  EXPECT_EQ(std::memcmp(s_again.data(), s.data(), s.size()), 0);
  // The C payload is IEEE little-endian: the first double decodes to C(0,0).
  uint64_t bits = 0;
  for (int i = 0; i < 8; i++) bits |= uint64_t(s[40 + i]) << (8 * i);
  double c00;
  std::memcpy(&c00, &bits, 8);
  EXPECT_EQ(c00, get(xc, BICO_XCOV_CROSS, 0, da, db)(0, 0));
  bico_xcov_free(back);
  bico_xcov_free(xc);
}

TEST(XcovTest, DeserializeRejectsMalformed) {
  bt::Ctx ctx;
  bt::Rng g(6);
  const size_t n = 10, da = 3, db = 2;
  FRows a(bt::randn(g, n, da), da), b(bt::randn(g, n, db), db);
  bico_xcov *xc = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, da, db, BICO_XCOV_SUMS, &xc), BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, n, a.row(0), da, b.row(0), db), BICO_OK);
  const std::vector<unsigned char> good = ser(xc);
  bico_xcov_free(xc);

  struct Case {
    const char *name;
    std::vector<unsigned char> bytes;
    bico_status st;
    const char *needle;
  };
  std::vector<Case> cases;
  cases.push_back({"truncated payload",
                   std::vector<unsigned char>(good.begin(), good.end() - 1),
                   BICO_E_FORMAT, "truncated"});
  cases.push_back({"truncated header",
                   std::vector<unsigned char>(good.begin(), good.begin() + 20),
                   BICO_E_FORMAT, "truncated"});
  cases.push_back({"tiny", std::vector<unsigned char>(good.begin(), good.begin() + 3),
                   BICO_E_FORMAT, "truncated"});
  {
    auto v = good;
    v[0] = 'X';
    cases.push_back({"bad magic", v, BICO_E_FORMAT, "magic"});
  }
  {
    auto v = good;
    v[8] = 2;
    cases.push_back({"unknown version", v, BICO_E_VERSION, "version 2"});
  }
  {
    auto v = good;
    v[12 + 5] = 1;  // d_a = 2^40 + 3
    v[20 + 5] = 1;  // d_b = 2^40 + 2: product overflows 64 bits
    cases.push_back({"dims overflow", v, BICO_E_FORMAT, "overflow"});
  }
  {
    auto v = good;
    v[12] = 4;  // d_a claims 4 rows: more payload than present
    cases.push_back({"dims larger than payload", v, BICO_E_FORMAT, "truncated"});
  }
  {
    auto v = good;
    v[12] = 0;
    cases.push_back({"zero dimension", v, BICO_E_FORMAT, "zero dimension"});
  }
  {
    auto v = good;
    v[36] = 8;
    cases.push_back({"unknown flags", v, BICO_E_FORMAT, "flags"});
  }
  {
    auto v = good;
    v.push_back(0);
    cases.push_back({"trailing byte", v, BICO_E_FORMAT, "trailing"});
  }
  {
    auto v = good;
    double nan = std::numeric_limits<double>::quiet_NaN();
    uint64_t bits;
    std::memcpy(&bits, &nan, 8);
    for (int i = 0; i < 8; i++) v[40 + 8 * 2 + i] = (unsigned char)(bits >> (8 * i));
    cases.push_back({"NaN payload", v, BICO_E_FORMAT, "NaN"});
  }
  {
    auto v = good;
    double inf = std::numeric_limits<double>::infinity();
    uint64_t bits;
    std::memcpy(&bits, &inf, 8);
    for (int i = 0; i < 8; i++) v[v.size() - 8 + i] = (unsigned char)(bits >> (8 * i));
    cases.push_back({"Inf in sums", v, BICO_E_FORMAT, "Inf"});
  }
  for (const Case &c : cases) {
    bico_xcov *out = reinterpret_cast<bico_xcov *>(&ctx);  // must be reset
    EXPECT_EQ(bico_xcov_deserialize(ctx, c.bytes.data(), c.bytes.size(), &out),
              c.st)
        << c.name;
    EXPECT_EQ(out, nullptr) << c.name;
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), c.needle))
        << c.name << ": " << bico_ctx_errmsg(ctx);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "xcov_deserialize")) << c.name;
  }
  // And the untouched bytes still load.
  bico_xcov *ok = nullptr;
  EXPECT_EQ(bico_xcov_deserialize(ctx, good.data(), good.size(), &ok), BICO_OK);
  bico_xcov_free(ok);
}

TEST(XcovTest, SerializeBufferTooSmall) {
  bt::Ctx ctx;
  bico_xcov *xc = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, 2, 2, 0, &xc), BICO_OK);
  size_t need = 0, w = 99;
  ASSERT_EQ(bico_xcov_serialized_size(xc, &need), BICO_OK);
  EXPECT_EQ(need, size_t(40 + 8 * 4));
  std::vector<unsigned char> b(need - 1);
  EXPECT_EQ(bico_xcov_serialize(xc, b.data(), b.size(), &w), BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "too small"));
  EXPECT_EQ(bico_xcov_serialize(xc, nullptr, need, &w), BICO_E_NULL);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "buf"));
  bico_xcov_free(xc);
}

TEST(XcovTest, AddMatrix) {
  bt::Ctx ctx;
  bt::Rng g(7);
  const size_t da = 3, db = 4, n = 50, ldc = db + 3;
  FRows a(bt::randn(g, n, da), da), b(bt::randn(g, n, db), db);
  Mat ext = bt::randn(g, da, db);  // "computed elsewhere"
  std::vector<double> cbuf(da * ldc, std::numeric_limits<double>::quiet_NaN());
  for (size_t i = 0; i < da; i++)
    for (size_t j = 0; j < db; j++) cbuf[i * ldc + j] = ext(i, j);
  bico_xcov *xc = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, da, db, 0, &xc), BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, n, a.row(0), da, b.row(0), db), BICO_OK);
  ASSERT_EQ(bico_xcov_add_matrix(xc, 1000, cbuf.data(), ldc), BICO_OK);
  Mat ref = bt::add(bt::matmul(bt::transpose(a.exact()), b.exact()), ext);
  EXPECT_LT(bt::relerr(get(xc, BICO_XCOV_CROSS, 0, da, db), ref), 1e-12);
  uint64_t rows = 0;
  bico_xcov_info(xc, nullptr, nullptr, &rows, nullptr);
  EXPECT_EQ(rows, uint64_t(1050));
  // Errors: stride, NULL, NaN (accumulator unchanged).
  EXPECT_EQ(bico_xcov_add_matrix(xc, 1, cbuf.data(), db - 1), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "ld_c"));
  EXPECT_EQ(bico_xcov_add_matrix(xc, 1, nullptr, db), BICO_E_NULL);
  cbuf[1 * ldc + 2] = std::numeric_limits<double>::infinity();
  EXPECT_EQ(bico_xcov_add_matrix(xc, 1, cbuf.data(), ldc), BICO_E_NONFINITE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "row 1, column 2"));
  EXPECT_LT(bt::relerr(get(xc, BICO_XCOV_CROSS, 0, da, db), ref), 1e-12);
  bico_xcov_free(xc);
  // With sums or Grams it is refused.
  ASSERT_EQ(bico_xcov_create(ctx, da, db, BICO_XCOV_GRAMS, &xc), BICO_OK);
  EXPECT_EQ(bico_xcov_add_matrix(xc, 1, ext.v.data(), db), BICO_E_STATE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "BICO_XCOV_GRAMS"));
  bico_xcov_free(xc);
}

TEST(XcovTest, NonFiniteRejectedAndAccumulatorUnchanged) {
  bt::Ctx ctx;
  bt::Rng g(8);
  const size_t n = 40, da = 3, db = 5;
  FRows a(bt::randn(g, n, da), da), b(bt::randn(g, n, db), db);
  bico_xcov *xc = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, da, db, BICO_XCOV_SUMS | BICO_XCOV_GRAMS, &xc),
            BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, 20, a.row(0), da, b.row(0), db), BICO_OK);
  const std::vector<unsigned char> before = ser(xc);
  FRows bad_b = b;
  bad_b.v[(20 + 17) * db + 4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(bico_xcov_add(xc, 20, a.row(20), da, bad_b.row(20), db),
            BICO_E_NONFINITE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "x_b holds NaN at row 17, column 4"))
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(ser(xc), before);
  FRows bad_a = a;
  bad_a.v[(20 + 19) * da + 0] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(bico_xcov_add(xc, 20, bad_a.row(20), da, b.row(20), db),
            BICO_E_NONFINITE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "x_a holds Inf")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(ser(xc), before);
  // A clean call afterwards works and clears the message.
  EXPECT_EQ(bico_xcov_add(xc, 20, a.row(20), da, b.row(20), db), BICO_OK);
  EXPECT_STREQ(bico_ctx_errmsg(ctx), "");
  bico_xcov_free(xc);
}

TEST(XcovTest, NullPointersAndZeroDims) {
  bt::Ctx ctx;
  bico_xcov *xc = nullptr;
  EXPECT_EQ(bico_xcov_create(nullptr, 2, 2, 0, &xc), BICO_E_NULL);
  EXPECT_EQ(bico_xcov_create(ctx, 2, 2, 0, nullptr), BICO_E_NULL);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "out"));
  EXPECT_EQ(bico_xcov_create(ctx, 0, 5, 0, &xc), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "d_a = 0"));
  EXPECT_EQ(xc, nullptr);
  EXPECT_EQ(bico_xcov_create(ctx, 5, 0, 0, &xc), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "d_b = 0"));
  EXPECT_EQ(bico_xcov_create(ctx, 2, 2, 4, &xc), BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "flags"));
  const size_t huge = size_t(1) << 40;
  EXPECT_EQ(bico_xcov_create(ctx, huge, huge, 0, &xc), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "overflow"));

  ASSERT_EQ(bico_xcov_create(ctx, 2, 3, 0, &xc), BICO_OK);
  float xa[4] = {1, 2, 3, 4}, xb[6] = {1, 2, 3, 4, 5, 6};
  EXPECT_EQ(bico_xcov_add(nullptr, 1, xa, 2, xb, 3), BICO_E_NULL);
  EXPECT_EQ(bico_xcov_add(xc, 0, nullptr, 2, nullptr, 3), BICO_OK);  // no-op
  EXPECT_EQ(bico_xcov_add(xc, 1, nullptr, 2, xb, 3), BICO_E_NULL);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "x_a is NULL"));
  EXPECT_EQ(bico_xcov_add(xc, 1, xa, 2, nullptr, 3), BICO_E_NULL);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "x_b is NULL"));
  EXPECT_EQ(bico_xcov_add(xc, 2, xa, 1, xb, 3), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "ld_a = 1"));
  EXPECT_EQ(bico_xcov_add(xc, 1, xa, 2, xb, 2), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "ld_b = 2"));
  uint64_t rows = 1;
  bico_xcov_info(xc, nullptr, nullptr, &rows, nullptr);
  EXPECT_EQ(rows, uint64_t(0));
  EXPECT_EQ(bico_xcov_info(nullptr, nullptr, nullptr, nullptr, nullptr), BICO_E_NULL);
  double out[6], s[3];
  EXPECT_EQ(bico_xcov_matrix(nullptr, BICO_XCOV_CROSS, 0, out, 3), BICO_E_NULL);
  EXPECT_EQ(bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, nullptr, 3), BICO_E_NULL);
  EXPECT_EQ(bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, out, 2), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "ld_out = 2"));
  EXPECT_EQ(bico_xcov_matrix(xc, 7, 0, out, 3), BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "which = 7"));
  EXPECT_EQ(bico_xcov_matrix(xc, BICO_XCOV_GRAM_A, 0, out, 3), BICO_E_STATE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "BICO_XCOV_GRAMS"));
  EXPECT_EQ(bico_xcov_matrix(xc, BICO_XCOV_CROSS, 1, out, 3), BICO_E_STATE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "BICO_XCOV_SUMS"));
  EXPECT_EQ(bico_xcov_sums(xc, s, s + 2), BICO_E_STATE);
  EXPECT_EQ(bico_xcov_sums(xc, nullptr, s), BICO_E_NULL);
  size_t sz;
  EXPECT_EQ(bico_xcov_serialized_size(nullptr, &sz), BICO_E_NULL);
  EXPECT_EQ(bico_xcov_serialized_size(xc, nullptr), BICO_E_NULL);
  bico_xcov *dummy = xc;
  EXPECT_EQ(bico_xcov_deserialize(nullptr, xa, 4, &dummy), BICO_E_NULL);
  EXPECT_EQ(dummy, nullptr);  // a failed create writes NULL, even without a context
  EXPECT_EQ(bico_xcov_deserialize(ctx, nullptr, 4, &dummy), BICO_E_NULL);
  EXPECT_EQ(bico_xcov_merge(nullptr, xc), BICO_E_NULL);
  EXPECT_EQ(bico_xcov_merge(xc, nullptr), BICO_E_NULL);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "src"));
  bico_xcov_free(xc);
  bico_xcov_free(nullptr);
}

TEST(XcovTest, MergeMismatch) {
  bt::Ctx ctx;
  bico_xcov *a = nullptr, *b = nullptr, *c = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, 3, 4, BICO_XCOV_SUMS, &a), BICO_OK);
  ASSERT_EQ(bico_xcov_create(ctx, 4, 3, BICO_XCOV_SUMS, &b), BICO_OK);
  ASSERT_EQ(bico_xcov_create(ctx, 3, 4, 0, &c), BICO_OK);
  EXPECT_EQ(bico_xcov_merge(a, b), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "3 x 4")) << bico_ctx_errmsg(ctx);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "4 x 3"));
  EXPECT_EQ(bico_xcov_merge(a, c), BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "flags"));
  bico_xcov_free(a);
  bico_xcov_free(b);
  bico_xcov_free(c);
}

namespace {
struct Counting {
  long live = 0, total = 0;
};
void *count_alloc(void *o, size_t n) {
  auto *c = static_cast<Counting *>(o);
  c->live++;
  c->total++;
  return std::malloc(n);
}
void count_free(void *o, void *p) {
  if (p == nullptr) return;
  static_cast<Counting *>(o)->live--;
  std::free(p);
}
}  // namespace

TEST(XcovTest, EveryAllocationThroughTheContext) {
  Counting cnt;
  bico_ctx *ctx = nullptr;
  ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, count_alloc, count_free, &cnt),
            BICO_OK);
  bt::Rng g(9);
  FRows a(bt::randn(g, 600, 4), 4), b(bt::randn(g, 600, 3), 3);
  bico_xcov *xc = nullptr, *back = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, 4, 3, 3, &xc), BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, 600, a.row(0), 4, b.row(0), 3), BICO_OK);
  std::vector<unsigned char> s = ser(xc);
  ASSERT_EQ(bico_xcov_deserialize(ctx, s.data(), s.size(), &back), BICO_OK);
  EXPECT_GT(cnt.total, 4);  // the handles and add()'s scratch
  bico_xcov_free(xc);
  bico_xcov_free(back);
  EXPECT_EQ(cnt.live, 1);  // the context itself
  bico_ctx_free(ctx);
  EXPECT_EQ(cnt.live, 0);
}

namespace {
using bt::Failing;
using bt::fail_free;
const bico_alloc_fn fail_alloc = bt::fail_from_alloc;
}  // namespace

// Allocation failures in create, add and deserialize: BICO_E_NOMEM, nothing
// leaked, and add leaves the accumulator as it was.
TEST(XcovTest, OutOfMemory) {
  Failing f;
  bico_ctx *ctx = nullptr;
  ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
  bico_xcov *xc = nullptr;
  for (long k = 1; k <= 2; k++) {  // the handle, then its data
    f.fail_at = f.count + k;
    EXPECT_EQ(bico_xcov_create(ctx, 3, 2, 3, &xc), BICO_E_NOMEM);
    EXPECT_EQ(xc, nullptr);
    EXPECT_EQ(f.live, 1);
  }
  f.fail_at = 0;
  ASSERT_EQ(bico_xcov_create(ctx, 3, 2, 3, &xc), BICO_OK);
  bt::Rng g(10);
  FRows a(bt::randn(g, 5, 3), 3), b(bt::randn(g, 5, 2), 2);
  const std::vector<unsigned char> before = ser(xc);
  f.fail_at = f.count + 1;
  EXPECT_EQ(bico_xcov_add(xc, 5, a.row(0), 3, b.row(0), 2), BICO_E_NOMEM);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "out of memory"));
  f.fail_at = 0;
  EXPECT_EQ(ser(xc), before);
  for (long k = 1; k <= 2; k++) {
    bico_xcov *back = nullptr;
    f.fail_at = f.count + k;
    EXPECT_EQ(bico_xcov_deserialize(ctx, before.data(), before.size(), &back),
              BICO_E_NOMEM);
    EXPECT_EQ(back, nullptr);
    f.fail_at = 0;
  }
  bico_xcov_free(xc);
  EXPECT_EQ(f.live, 1);
  bico_ctx_free(ctx);
}
