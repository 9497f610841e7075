// GradFix votes and masks against a sign vote computed here, planted ties,
// the first-order descent property, merge/add_counts consistency and errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();

int sgn(double x) { return (x > 0) - (x < 0); }

struct Votes {
  bico_votes *p = nullptr;
  Votes(bico_ctx *ctx, size_t n, unsigned flags) {
    EXPECT_EQ(BICO_OK, bico_votes_create(ctx, n, flags, &p));
  }
  ~Votes() { bico_votes_free(p); }
  operator bico_votes *() const { return p; }
};

// Per-sample gradients, with some exact zeros so sign(0) = 0 matters.
std::vector<std::vector<float>> random_grads(bt::Rng &g, size_t samples,
                                             size_t n) {
  std::vector<std::vector<float>> gs(samples, std::vector<float>(n));
  for (auto &row : gs)
    for (auto &x : row) x = g.uniform() < 0.1 ? 0.0f : (float)g.normal();
  return gs;
}

std::vector<float> random_tau(bt::Rng &g, size_t n) {
  std::vector<float> t(n);
  for (auto &x : t) x = g.uniform() < 0.1 ? 0.0f : (float)g.normal();
  return t;
}

// The mask as the method defines it, computed here from the raw gradients.
std::vector<uint8_t> expected_mask(const std::vector<std::vector<float>> &gs,
                                   const std::vector<float> &tau, int mode) {
  size_t n = tau.size();
  std::vector<uint8_t> m(n);
  for (size_t i = 0; i < n; i++) {
    long vote = 0;
    double sum = 0;
    for (auto &row : gs) {
      vote += sgn(-(double)row[i]);
      sum += -(double)row[i];
    }
    int d = mode == BICO_GRADFIX_MEAN ? sgn(sum) : sgn((double)vote);
    m[i] = sgn(tau[i]) != 0 && sgn(tau[i]) == d;
  }
  return m;
}

size_t count(const std::vector<uint8_t> &m) {
  size_t k = 0;
  for (auto x : m) k += x;
  return k;
}

TEST(Gradfix, MaskMatchesIndependentVoteBothModes) {
  bt::Rng g(31);
  bt::Ctx ctx;
  const size_t n = 500;
  for (size_t samples : {1, 4, 7}) {
    auto gs = random_grads(g, samples, n);
    auto tau = random_tau(g, n);
    Votes v(ctx, n, BICO_VOTES_MEAN);
    for (auto &row : gs) ASSERT_EQ(BICO_OK, bico_votes_add_grad(v, row.data()));
    for (int mode : {BICO_GRADFIX_MAJORITY, BICO_GRADFIX_MEAN}) {
      std::vector<uint8_t> mask(n, 9);
      size_t kept = 12345;
      ASSERT_EQ(BICO_OK, bico_gradfix_mask(v, mode, tau.data(), mask.data(),
                                           &kept));
      auto want = expected_mask(gs, tau, mode);
      EXPECT_EQ(mask, want) << "mode " << mode << " samples " << samples;
      EXPECT_EQ(kept, count(want));
      // Not a degenerate case: some kept, some dropped.
      EXPECT_GT(kept, n / 10);
      EXPECT_LT(kept, n);
    }
    // The counts are the vote computed here.
    std::vector<int32_t> c(n);
    ASSERT_EQ(BICO_OK, bico_votes_counts(v, c.data()));
    for (size_t i = 0; i < n; i++) {
      long vote = 0;
      for (auto &row : gs) vote += sgn(-(double)row[i]);
      ASSERT_EQ(c[i], vote);
    }
    size_t nn = 0;
    uint64_t s = 0;
    unsigned fl = 0;
    ASSERT_EQ(BICO_OK, bico_votes_info(v, &nn, &s, &fl));
    EXPECT_EQ(nn, n);
    EXPECT_EQ(s, samples);
    EXPECT_EQ(fl, (unsigned)BICO_VOTES_MEAN);
    EXPECT_EQ(BICO_OK, bico_votes_info(v, nullptr, nullptr, nullptr));
  }
}

// Planted cases with 4 samples: ties, zero gradients, zero tau.
TEST(Gradfix, TiesAndZerosAreMasked) {
  bt::Ctx ctx;
  // Coordinates:     0     1     2     3     4     5      6
  // grads per sample (descent sign = -grad):
  const float g[4][7] = {{1, -1, 0, -1, -1, -2, 1},
                         {1, -1, 0, -1, -1, 1, 1},
                         {-1, -1, 0, -1, -1, 1, 1},
                         {-1, -1, 0, -1, -1, -3, 1}};
  // 0: tie (2 vs 2); 1: all descend +; 2: all-zero grads (vote 0);
  // 3: tau = +0; 4: tau = -0; 5: tie in votes, mean +3 (sum of -g);
  // 6: all descend -, tau negative.
  const float tau[7] = {1, 2, 3, 0.0f, -0.0f, 0.5f, -4};
  Votes v(ctx, 7, BICO_VOTES_MEAN);
  for (auto &row : g) ASSERT_EQ(BICO_OK, bico_votes_add_grad(v, row));
  std::vector<int32_t> c(7);
  ASSERT_EQ(BICO_OK, bico_votes_counts(v, c.data()));
  EXPECT_EQ(c, (std::vector<int32_t>{0, 4, 0, 4, 4, 0, -4}));
  uint8_t m[7];
  size_t kept = 0;
  ASSERT_EQ(BICO_OK, bico_gradfix_mask(v, BICO_GRADFIX_MAJORITY, tau, m, &kept));
  EXPECT_EQ(std::vector<uint8_t>(m, m + 7),
            (std::vector<uint8_t>{0, 1, 0, 0, 0, 0, 1}));
  EXPECT_EQ(kept, 2u);
  ASSERT_EQ(BICO_OK, bico_gradfix_mask(v, BICO_GRADFIX_MEAN, tau, m, &kept));
  EXPECT_EQ(std::vector<uint8_t>(m, m + 7),
            (std::vector<uint8_t>{0, 1, 0, 0, 0, 1, 1}));
  EXPECT_EQ(kept, 3u);
  EXPECT_EQ(BICO_OK, bico_gradfix_mask(v, BICO_GRADFIX_MAJORITY, tau, m, nullptr));
}

TEST(Gradfix, ApplyIsMaskedScaledUpdate) {
  bt::Rng g(32);
  bt::Ctx ctx;
  const size_t n = 300;
  auto gs = random_grads(g, 5, n);
  auto tau = random_tau(g, n);
  Votes v(ctx, n, 0);
  for (auto &row : gs) ASSERT_EQ(BICO_OK, bico_votes_add_grad(v, row.data()));
  auto want = expected_mask(gs, tau, BICO_GRADFIX_MAJORITY);
  // beta = 0: out starts NaN and is not read.
  std::vector<float> out(n, kNaN);
  size_t kept = 0;
  ASSERT_EQ(BICO_OK, bico_gradfix_apply(v, BICO_GRADFIX_MAJORITY, 2.5f,
                                        tau.data(), 0.0f, out.data(), &kept));
  EXPECT_EQ(kept, count(want));
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(out[i], want[i] ? 2.5f * tau[i] : 0.0f) << i;
  // beta = 1 accumulates onto the target weights.
  std::vector<float> theta(n), acc(n);
  for (size_t i = 0; i < n; i++) theta[i] = acc[i] = (float)g.normal();
  ASSERT_EQ(BICO_OK, bico_gradfix_apply(v, BICO_GRADFIX_MAJORITY, 0.5f,
                                        tau.data(), 1.0f, acc.data(), nullptr));
  for (size_t i = 0; i < n; i++)
    ASSERT_FLOAT_EQ(acc[i], theta[i] + (want[i] ? 0.5f * tau[i] : 0.0f)) << i;
}

// To first order the loss cannot rise under the MEAN mask: with G the
// summed gradient, G . delta = alpha sum_kept G_i tau_i and each kept term
// has sign(tau_i) = sign(-G_i).
TEST(Gradfix, MeanModeIsFirstOrderDescent) {
  bt::Rng g(33);
  bt::Ctx ctx;
  const size_t n = 400;
  for (int trial = 0; trial < 5; trial++) {
    auto gs = random_grads(g, 3 + trial, n);
    auto tau = random_tau(g, n);
    Votes v(ctx, n, BICO_VOTES_MEAN);
    for (auto &row : gs) ASSERT_EQ(BICO_OK, bico_votes_add_grad(v, row.data()));
    std::vector<float> delta(n);
    size_t kept = 0;
    ASSERT_EQ(BICO_OK, bico_gradfix_apply(v, BICO_GRADFIX_MEAN, 0.7f,
                                          tau.data(), 0.0f, delta.data(), &kept));
    ASSERT_GT(kept, 0u);
    double dot = 0;
    for (size_t i = 0; i < n; i++) {
      double gi = 0;
      for (auto &row : gs) gi += row[i];
      EXPECT_LE(gi * delta[i], 0.0) << i;
      dot += gi * delta[i];
    }
    EXPECT_LT(dot, 0.0);
  }
}

// The majority vote can disagree with the mean gradient's sign, so majority
// mode does not guarantee first-order descent: one coordinate, two samples
// with a small gradient of one sign and one with a large gradient of the
// other.
TEST(Gradfix, MajorityModeNeedNotDescend) {
  bt::Ctx ctx;
  const float g[3][1] = {{-1.0f}, {-1.0f}, {10.0f}};
  const float tau[1] = {1.0f};
  Votes v(ctx, 1, BICO_VOTES_MEAN);
  for (auto &row : g) ASSERT_EQ(BICO_OK, bico_votes_add_grad(v, row));
  float delta[1];
  ASSERT_EQ(BICO_OK, bico_gradfix_apply(v, BICO_GRADFIX_MAJORITY, 1.0f, tau,
                                        0.0f, delta, nullptr));
  double gsum = -1.0 - 1.0 + 10.0;
  EXPECT_GT(gsum * delta[0], 0.0);  // the loss rises to first order
  ASSERT_EQ(BICO_OK, bico_gradfix_apply(v, BICO_GRADFIX_MEAN, 1.0f, tau, 0.0f,
                                        delta, nullptr));
  EXPECT_EQ(delta[0], 0.0f);  // the mean mode drops that coordinate
}

TEST(Gradfix, MergeOfHalvesEqualsOnePass) {
  bt::Rng g(34);
  bt::Ctx ctx;
  const size_t n = 250;
  for (unsigned flags : {0u, (unsigned)BICO_VOTES_MEAN}) {
    auto gs = random_grads(g, 9, n);
    auto tau = random_tau(g, n);
    Votes all(ctx, n, flags), a(ctx, n, flags), b(ctx, n, flags);
    for (size_t k = 0; k < gs.size(); k++) {
      ASSERT_EQ(BICO_OK, bico_votes_add_grad(all, gs[k].data()));
      ASSERT_EQ(BICO_OK, bico_votes_add_grad(k < 4 ? a : b, gs[k].data()));
    }
    ASSERT_EQ(BICO_OK, bico_votes_merge(a, b));
    std::vector<int32_t> ca(n), cb(n);
    ASSERT_EQ(BICO_OK, bico_votes_counts(all, ca.data()));
    ASSERT_EQ(BICO_OK, bico_votes_counts(a, cb.data()));
    EXPECT_EQ(ca, cb);
    uint64_t s = 0;
    ASSERT_EQ(BICO_OK, bico_votes_info(a, nullptr, &s, nullptr));
    EXPECT_EQ(s, 9u);
    std::vector<int> modes = {BICO_GRADFIX_MAJORITY};
    if (flags) modes.push_back(BICO_GRADFIX_MEAN);
    for (int mode : modes) {
      std::vector<uint8_t> ma(n), mb(n);
      ASSERT_EQ(BICO_OK, bico_gradfix_mask(all, mode, tau.data(), ma.data(), nullptr));
      ASSERT_EQ(BICO_OK, bico_gradfix_mask(a, mode, tau.data(), mb.data(), nullptr));
      EXPECT_EQ(ma, mb);
      EXPECT_EQ(ma, expected_mask(gs, tau, mode));
    }
  }
}

TEST(Gradfix, AddCountsEqualsAddGradOfSameSigns) {
  bt::Rng g(35);
  bt::Ctx ctx;
  const size_t n = 200;
  auto gs = random_grads(g, 6, n);
  Votes by_grad(ctx, n, 0), by_count(ctx, n, 0);
  for (auto &row : gs) ASSERT_EQ(BICO_OK, bico_votes_add_grad(by_grad, row.data()));
  // Counted elsewhere in two batches of 2 and 4 samples.
  for (auto range : {std::make_pair(0, 2), std::make_pair(2, 6)}) {
    std::vector<int32_t> c(n, 0);
    for (int k = range.first; k < range.second; k++)
      for (size_t i = 0; i < n; i++) c[i] += sgn(-(double)gs[k][i]);
    ASSERT_EQ(BICO_OK, bico_votes_add_counts(by_count, c.data(),
                                             (uint32_t)(range.second - range.first)));
  }
  std::vector<int32_t> a(n), b(n);
  ASSERT_EQ(BICO_OK, bico_votes_counts(by_grad, a.data()));
  ASSERT_EQ(BICO_OK, bico_votes_counts(by_count, b.data()));
  EXPECT_EQ(a, b);
  uint64_t sa = 0, sb = 0;
  bico_votes_info(by_grad, nullptr, &sa, nullptr);
  bico_votes_info(by_count, nullptr, &sb, nullptr);
  EXPECT_EQ(sa, sb);
}

// ---- errors ----

bool mentions(bico_ctx *ctx, const char *s) {
  return std::string(bico_ctx_errmsg(ctx)).find(s) != std::string::npos;
}

TEST(GradfixErrors, Create) {
  bt::Ctx ctx;
  bico_votes *v = reinterpret_cast<bico_votes *>(1);
  EXPECT_EQ(BICO_E_NULL, bico_votes_create(nullptr, 3, 0, &v));
  EXPECT_EQ(BICO_E_NULL, bico_votes_create(ctx, 3, 0, nullptr));
  EXPECT_EQ(BICO_E_SHAPE, bico_votes_create(ctx, 0, 0, &v));
  EXPECT_EQ(v, nullptr);
  EXPECT_TRUE(mentions(ctx, "votes_create: n is 0"));
  EXPECT_EQ(BICO_E_ARG, bico_votes_create(ctx, 3, 6, &v));
  EXPECT_TRUE(mentions(ctx, "flags"));
  EXPECT_EQ(v, nullptr);
  bico_votes_free(nullptr);
}

TEST(GradfixErrors, NonFiniteGradChangesNothing) {
  bt::Ctx ctx;
  Votes v(ctx, 3, BICO_VOTES_MEAN);
  const float good[3] = {1, -1, 0}, bad[3] = {-5, kNaN, 2};
  ASSERT_EQ(BICO_OK, bico_votes_add_grad(v, good));
  EXPECT_EQ(BICO_E_NONFINITE, bico_votes_add_grad(v, bad));
  EXPECT_TRUE(mentions(ctx, "grad") && mentions(ctx, "NaN") &&
              mentions(ctx, "column 1"))
      << bico_ctx_errmsg(ctx);
  std::vector<int32_t> c(3);
  ASSERT_EQ(BICO_OK, bico_votes_counts(v, c.data()));
  EXPECT_EQ(c, (std::vector<int32_t>{-1, 1, 0}));
  uint64_t s = 0;
  bico_votes_info(v, nullptr, &s, nullptr);
  EXPECT_EQ(s, 1u);
  // The mean sum is untouched too: a mean mask still sees only sample 1.
  const float tau[3] = {-1, 1, 1};
  uint8_t m[3];
  ASSERT_EQ(BICO_OK, bico_gradfix_mask(v, BICO_GRADFIX_MEAN, tau, m, nullptr));
  EXPECT_EQ(std::vector<uint8_t>(m, m + 3), (std::vector<uint8_t>{1, 1, 0}));
  EXPECT_EQ(BICO_E_NULL, bico_votes_add_grad(v, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_votes_add_grad(nullptr, good));
}

TEST(GradfixErrors, AddCounts) {
  bt::Ctx ctx;
  Votes mean(ctx, 4, BICO_VOTES_MEAN), plain(ctx, 4, 0);
  const int32_t ok[4] = {3, -3, 0, 1};
  EXPECT_EQ(BICO_E_STATE, bico_votes_add_counts(mean, ok, 3));
  EXPECT_TRUE(mentions(ctx, "BICO_VOTES_MEAN"));
  const int32_t too_big[4] = {3, -3, 0, -4};
  EXPECT_EQ(BICO_E_ARG, bico_votes_add_counts(plain, too_big, 3));
  EXPECT_TRUE(mentions(ctx, "votes[3] = -4")) << bico_ctx_errmsg(ctx);
  const int32_t most_negative[4] = {0, INT32_MIN, 0, 0};
  EXPECT_EQ(BICO_E_ARG, bico_votes_add_counts(plain, most_negative, 3));
  EXPECT_TRUE(mentions(ctx, "votes[1]"));
  std::vector<int32_t> c(4);
  ASSERT_EQ(BICO_OK, bico_votes_counts(plain, c.data()));
  EXPECT_EQ(c, (std::vector<int32_t>(4, 0)));  // nothing was added
  EXPECT_EQ(BICO_E_NULL, bico_votes_add_counts(plain, nullptr, 3));
  EXPECT_EQ(BICO_OK, bico_votes_add_counts(plain, ok, 3));
  EXPECT_STREQ(bico_ctx_errmsg(ctx), "");
}

// Votes are int32, so the sample count is capped at INT32_MAX.
TEST(GradfixErrors, SampleCountOverflow) {
  bt::Ctx ctx;
  Votes v(ctx, 2, 0), w(ctx, 2, 0);
  const int32_t zero[2] = {0, 0};
  EXPECT_EQ(BICO_E_ARG, bico_votes_add_counts(v, zero, UINT32_MAX));
  EXPECT_TRUE(mentions(ctx, "2147483647")) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(BICO_OK, bico_votes_add_counts(v, zero, (uint32_t)INT32_MAX));
  const float grad[2] = {1, -1};
  EXPECT_EQ(BICO_E_ARG, bico_votes_add_grad(v, grad));
  ASSERT_EQ(BICO_OK, bico_votes_add_grad(w, grad));
  EXPECT_EQ(BICO_E_ARG, bico_votes_merge(w, v));
  EXPECT_EQ(BICO_E_ARG, bico_votes_merge(v, w));
  uint64_t s = 0;
  bico_votes_info(v, nullptr, &s, nullptr);
  EXPECT_EQ(s, (uint64_t)INT32_MAX);
}

TEST(GradfixErrors, MergeChecksSizeAndFlags) {
  bt::Ctx ctx;
  Votes a(ctx, 3, 0), b(ctx, 4, 0), c(ctx, 3, BICO_VOTES_MEAN);
  EXPECT_EQ(BICO_E_SHAPE, bico_votes_merge(a, b));
  EXPECT_TRUE(mentions(ctx, "3") && mentions(ctx, "4"));
  EXPECT_EQ(BICO_E_ARG, bico_votes_merge(a, c));
  EXPECT_TRUE(mentions(ctx, "flags"));
  EXPECT_EQ(BICO_E_NULL, bico_votes_merge(a, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_votes_merge(nullptr, a));
}

TEST(GradfixErrors, MaskAndApply) {
  bt::Ctx ctx;
  Votes plain(ctx, 2, 0);
  const float grad[2] = {1, -1}, tau[2] = {-1, 1}, bad[2] = {1, kNaN};
  ASSERT_EQ(BICO_OK, bico_votes_add_grad(plain, grad));
  uint8_t m[2];
  float out[2] = {5, 5};
  EXPECT_EQ(BICO_E_STATE, bico_gradfix_mask(plain, BICO_GRADFIX_MEAN, tau, m, nullptr));
  EXPECT_TRUE(mentions(ctx, "BICO_VOTES_MEAN"));
  EXPECT_EQ(BICO_E_STATE, bico_gradfix_apply(plain, BICO_GRADFIX_MEAN, 1, tau,
                                             0, out, nullptr));
  EXPECT_EQ(BICO_E_ARG, bico_gradfix_mask(plain, 7, tau, m, nullptr));
  EXPECT_TRUE(mentions(ctx, "mode 7"));
  EXPECT_EQ(BICO_E_NONFINITE, bico_gradfix_mask(plain, 0, bad, m, nullptr));
  EXPECT_TRUE(mentions(ctx, "gradfix_mask: tau holds NaN"));
  EXPECT_EQ(BICO_E_NONFINITE, bico_gradfix_apply(plain, 0, 1, bad, 0, out, nullptr));
  EXPECT_EQ(BICO_E_ARG, bico_gradfix_apply(plain, 0, kNaN, tau, 0, out, nullptr));
  EXPECT_TRUE(mentions(ctx, "alpha"));
  EXPECT_EQ(out[0], 5.0f);
  EXPECT_EQ(out[1], 5.0f);
  EXPECT_EQ(BICO_E_NULL, bico_gradfix_mask(plain, 0, nullptr, m, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_gradfix_mask(plain, 0, tau, nullptr, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_gradfix_mask(nullptr, 0, tau, m, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_gradfix_apply(plain, 0, 1, tau, 0, nullptr, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_votes_counts(plain, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_votes_counts(nullptr, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_votes_info(nullptr, nullptr, nullptr, nullptr));
}

}  // namespace
