// Naive and pad baselines against element-wise expectations computed here
// from flat-index arithmetic.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();

using Shape = std::vector<size_t>;

size_t numel(const Shape &s) {
  size_t n = 1;
  for (size_t x : s) n *= x;
  return n;
}

std::vector<float> randv(bt::Rng &g, size_t n) {
  std::vector<float> v(n);
  for (auto &x : v) x = (float)g.normal();
  return v;
}

bool mentions(bico_ctx *ctx, const std::string &s) {
  return std::string(bico_ctx_errmsg(ctx)).find(s) != std::string::npos;
}

TEST(Baseline, NaiveIsScaledTauPlusBetaOut) {
  bt::Rng g(41);
  bt::Ctx ctx;
  const Shape shapes[] = {{7}, {4, 3}, {2, 3, 5}, {2, 1, 3, 2}};
  for (const Shape &s : shapes)
    for (float beta : {0.0f, 1.0f, 0.5f}) {
      size_t n = numel(s);
      auto tau = randv(g, n);
      auto out = beta == 0.0f ? std::vector<float>(n, kNaN) : randv(g, n);
      auto out0 = out;
      ASSERT_EQ(BICO_OK, bico_baseline_naive(ctx, s.size(), s.data(), s.size(),
                                             s.data(), 1.5f, tau.data(), beta,
                                             out.data()));
      for (size_t i = 0; i < n; i++) {
        double want = 1.5 * tau[i] + (beta == 0.0f ? 0.0 : beta * out0[i]);
        ASSERT_NEAR(out[i], want, 1e-6 * (1 + std::fabs(want))) << i;
      }
    }
}

TEST(Baseline, NaiveMismatchNamesBothShapes) {
  bt::Ctx ctx;
  std::vector<float> tau(20, 1.0f), out(20, 3.0f);
  const size_t a[] = {4, 3}, b[] = {4, 5}, c[] = {4, 3, 1};
  EXPECT_EQ(BICO_E_SHAPE, bico_baseline_naive(ctx, 2, a, 2, b, 1, tau.data(),
                                              0, out.data()));
  EXPECT_TRUE(mentions(ctx, "[4, 3] vs [4, 5]")) << bico_ctx_errmsg(ctx);
  EXPECT_TRUE(mentions(ctx, "baseline_naive"));
  EXPECT_EQ(BICO_E_SHAPE, bico_baseline_naive(ctx, 2, a, 3, c, 1, tau.data(),
                                              0, out.data()));
  EXPECT_TRUE(mentions(ctx, "[4, 3] vs [4, 3, 1]")) << bico_ctx_errmsg(ctx);
  for (float x : out) EXPECT_EQ(x, 3.0f);
}

// The expected pad result, by decomposing each flat target index into its
// multi-index and recomposing it in the source's shape.
std::vector<double> pad_reference(const Shape &sa, const Shape &sb,
                                  const std::vector<float> &tau, double alpha,
                                  double beta, const std::vector<float> &out0) {
  size_t nb = numel(sb), nd = sb.size();
  std::vector<double> want(nb);
  for (size_t f = 0; f < nb; f++) {
    std::vector<size_t> idx(nd);
    size_t rest = f;
    for (size_t d = nd; d-- > 0;) {
      idx[d] = rest % sb[d];
      rest /= sb[d];
    }
    bool inside = true;
    size_t fa = 0;
    for (size_t d = 0; d < nd; d++) {
      if (idx[d] >= sa[d]) inside = false;
      fa = fa * sa[d] + idx[d];
    }
    double u = inside ? tau[fa] : 0.0;
    want[f] = alpha * u + (beta == 0 ? 0.0 : beta * out0[f]);
  }
  return want;
}

TEST(Baseline, PadMatchesIndexComputation) {
  bt::Rng g(42);
  bt::Ctx ctx;
  const std::pair<Shape, Shape> cases[] = {
      {{5}, {8}},           {{8}, {5}},          {{6}, {6}},
      {{4, 6}, {6, 3}},     {{6, 3}, {4, 6}},    {{3, 3}, {5, 5}},
      {{5, 5}, {3, 3}},     {{3, 5, 2}, {2, 5, 4}}, {{2, 3, 4}, {4, 2, 6}},
      {{4, 1, 3}, {1, 4, 3}}, {{2, 3, 2, 3}, {3, 2, 3, 2}}};
  for (const auto &c : cases)
    for (float beta : {0.0f, 1.0f}) {
      const Shape &sa = c.first, &sb = c.second;
      auto tau = randv(g, numel(sa));
      auto out = beta == 0.0f ? std::vector<float>(numel(sb), kNaN)
                              : randv(g, numel(sb));
      auto out0 = out;
      ASSERT_EQ(BICO_OK, bico_baseline_pad(ctx, sa.size(), sa.data(),
                                           sb.size(), sb.data(), -0.75f,
                                           tau.data(), beta, out.data()))
          << bico_ctx_errmsg(ctx);
      auto want = pad_reference(sa, sb, tau, -0.75, beta, out0);
      for (size_t i = 0; i < want.size(); i++)
        ASSERT_NEAR(out[i], want[i], 1e-6 * (1 + std::fabs(want[i])))
            << "case " << sa.size() << "-D, element " << i;
    }
}

TEST(Baseline, PadWithEqualShapesEqualsNaive) {
  bt::Rng g(43);
  bt::Ctx ctx;
  const Shape s = {3, 4, 5};
  auto tau = randv(g, 60);
  std::vector<float> a(60, kNaN), b(60, kNaN);
  ASSERT_EQ(BICO_OK, bico_baseline_pad(ctx, 3, s.data(), 3, s.data(),
                                       2.0f, tau.data(), 0.0f, a.data()));
  ASSERT_EQ(BICO_OK, bico_baseline_naive(ctx, 3, s.data(), 3, s.data(),
                                         2.0f, tau.data(), 0.0f, b.data()));
  EXPECT_EQ(a, b);
}

TEST(BaselineErrors, Arguments) {
  bt::Ctx ctx;
  std::vector<float> tau(64, 1.0f), out(64, 3.0f);
  const size_t s[] = {4, 4}, z[] = {4, 0};
  EXPECT_EQ(BICO_E_NULL, bico_baseline_naive(nullptr, 2, s, 2, s, 1,
                                             tau.data(), 0, out.data()));
  EXPECT_EQ(BICO_E_NULL, bico_baseline_naive(ctx, 2, nullptr, 2, s,
                                             1, tau.data(), 0, out.data()));
  EXPECT_TRUE(mentions(ctx, "shape_a is NULL"));
  EXPECT_EQ(BICO_E_NULL,
            bico_baseline_pad(ctx, 2, s, 2, s, 1, nullptr, 0, out.data()));
  EXPECT_TRUE(mentions(ctx, "baseline_pad: tau is NULL"));
  EXPECT_EQ(BICO_E_NULL,
            bico_baseline_pad(ctx, 2, s, 2, s, 1, tau.data(), 0, nullptr));
  EXPECT_EQ(BICO_E_SHAPE,
            bico_baseline_pad(ctx, 0, s, 2, s, 1, tau.data(), 0, out.data()));
  EXPECT_TRUE(mentions(ctx, "0 dimensions"));
  EXPECT_EQ(BICO_E_SHAPE,
            bico_baseline_pad(ctx, 2, s, 2, z, 1, tau.data(), 0, out.data()));
  EXPECT_TRUE(mentions(ctx, "shape_b [4, 0] has a zero extent"))
      << bico_ctx_errmsg(ctx);
  const size_t s3[] = {4, 4, 1};
  EXPECT_EQ(BICO_E_SHAPE,
            bico_baseline_pad(ctx, 2, s, 3, s3, 1, tau.data(), 0, out.data()));
  EXPECT_TRUE(mentions(ctx, "[4, 4] vs [4, 4, 1]")) << bico_ctx_errmsg(ctx);
  const size_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_EQ(BICO_E_UNSUPPORTED, bico_baseline_pad(ctx, 9, nine, 9, nine,
                                                  1, tau.data(), 0,
                                                  out.data()));
  EXPECT_TRUE(mentions(ctx, "9 dimensions"));
  const size_t eight[8] = {1, 2, 1, 2, 1, 2, 1, 2};
  EXPECT_EQ(BICO_OK, bico_baseline_pad(ctx, 8, eight, 8, eight, 1,
                                       tau.data(), 0, out.data()));
  const size_t huge[] = {size_t(1) << 40, size_t(1) << 40};
  EXPECT_EQ(BICO_E_SHAPE, bico_baseline_naive(ctx, 2, huge, 2, huge,
                                              1, tau.data(), 0, out.data()));
  EXPECT_TRUE(mentions(ctx, "too many elements")) << bico_ctx_errmsg(ctx);
  std::fill(out.begin(), out.end(), 3.0f);
  tau[5] = kNaN;
  EXPECT_EQ(BICO_E_NONFINITE,
            bico_baseline_naive(ctx, 2, s, 2, s, 1, tau.data(), 0, out.data()));
  EXPECT_TRUE(mentions(ctx, "tau holds NaN"));
  EXPECT_EQ(BICO_E_NONFINITE,
            bico_baseline_pad(ctx, 2, s, 2, s, 1, tau.data(), 0, out.data()));
  tau[5] = 0.0f;
  EXPECT_EQ(BICO_E_ARG,
            bico_baseline_pad(ctx, 2, s, 2, s, std::numeric_limits<float>::infinity(),
                              tau.data(), 0,
                              out.data()));
  EXPECT_TRUE(mentions(ctx, "alpha"));
  for (float x : out) EXPECT_EQ(x, 3.0f);
}

}  // namespace
