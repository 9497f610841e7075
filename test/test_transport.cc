// Transport kernels against plain double-precision matrix products computed
// here (testutil), with explicit rectangular identities for NULL maps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

namespace {

using bt::Mat;

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();
// Written into the padding between a row's last column and the next row, so
// a kernel that reads or writes past the columns shows up.
const float kGuard = -12345.0f;

// A row-major float matrix with row stride ld >= c.
struct Buf {
  size_t r = 0, c = 0, ld = 0;
  std::vector<float> v;
  Buf() = default;
  Buf(const Mat &m, size_t pad) : r(m.r), c(m.c), ld(m.c + pad) {
    v.assign(r * ld, kGuard);
    for (size_t i = 0; i < r; i++)
      for (size_t j = 0; j < c; j++) v[i * ld + j] = (float)m(i, j);
  }
  static Buf filled(size_t r, size_t c, size_t pad, float x) {
    Buf b(Mat(r, c), pad);
    for (size_t i = 0; i < r; i++)
      for (size_t j = 0; j < c; j++) b.v[i * b.ld + j] = x;
    return b;
  }
  float *p() { return v.data(); }
  const float *p() const { return v.data(); }
  float &at(size_t i, size_t j) { return v[i * ld + j]; }
  // The values as stored (float-rounded), for the reference computation.
  Mat m() const { return Mat::from(v.data(), r, c, ld); }
  bool guards_intact() const {
    for (size_t i = 0; i < r; i++)
      for (size_t j = c; j < ld; j++)
        if (v[i * ld + j] != kGuard) return false;
    return true;
  }
};

Mat scaled_sum(const Mat &a, double alpha, const Mat &b, double beta) {
  Mat m(a.r, a.c);
  for (size_t i = 0; i < m.v.size(); i++)
    m.v[i] = alpha * a.v[i] + (beta == 0 ? 0.0 : beta * b.v[i]);
  return m;
}

// Expected alpha R_out^T tau R_in + beta out0 in double; NULL maps are
// explicit rectangular identities here.
Mat reference(const Mat &tau, const Mat *r_out, size_t dout_b,
              const Mat *r_in, size_t din_b, double alpha, double beta,
              const Mat &out0) {
  Mat ro = r_out ? *r_out : bt::eye(tau.r, dout_b);
  Mat ri = r_in ? *r_in : bt::eye(tau.c, din_b);
  Mat res = bt::matmul(bt::matmul(bt::transpose(ro), tau), ri);
  return scaled_sum(res, alpha, out0, beta);
}

struct Dims {
  size_t a, b;
};

TEST(Transport, WeightMatchesReferenceInEveryShapeCombination) {
  bt::Rng g(11);
  bt::Ctx ctx;
  const Dims outs[] = {{5, 5}, {4, 7}, {7, 4}};
  const Dims ins[] = {{6, 6}, {3, 9}, {9, 3}};
  const float betas[] = {0.0f, 1.0f, -0.5f};
  for (Dims o : outs)
    for (Dims in : ins)
      for (int maps = 0; maps < 4; maps++)
        for (size_t pad : {0, 3})
          for (float beta : betas) {
            SCOPED_TRACE("dout " + std::to_string(o.a) + "->" +
                         std::to_string(o.b) + " din " +
                         std::to_string(in.a) + "->" + std::to_string(in.b) +
                         " maps " + std::to_string(maps) + " pad " +
                         std::to_string(pad) + " beta " +
                         std::to_string(beta));
            bool has_out = maps & 1, has_in = maps & 2;
            Buf tau(bt::randn(g, o.a, in.a), pad);
            Buf rout(bt::randn(g, o.a, o.b), pad + 1);
            Buf rin(bt::randn(g, in.a, in.b), pad + 2);
            // beta = 0: out starts as NaN and must not be read.
            Buf out = beta == 0.0f ? Buf::filled(o.b, in.b, pad, kNaN)
                                   : Buf(bt::randn(g, o.b, in.b), pad);
            Mat out0 = out.m(), rom = rout.m(), rim = rin.m();
            const float alpha = 1.75f;
            ASSERT_EQ(BICO_OK,
                      bico_transport_weight(
                          ctx, o.a, in.a, o.b, in.b,
                          alpha, tau.p(), tau.ld,
                          has_out ? rout.p() : nullptr, rout.ld, has_in ? rin.p() : nullptr, rin.ld,
                          beta, out.p(), out.ld))
                << bico_ctx_errmsg(ctx);
            Mat want = reference(tau.m(), has_out ? &rom : nullptr, o.b,
                                 has_in ? &rim : nullptr, in.b, alpha, beta,
                                 out0);
            EXPECT_LT(bt::relerr(out.m(), want), 1e-5);
            EXPECT_TRUE(out.guards_intact());
          }
}

// A NULL map must give the same result as passing the rectangular identity
// explicitly (which goes through the GEMM path).
TEST(Transport, NullMapEqualsExplicitRectangularIdentity) {
  bt::Rng g(12);
  bt::Ctx ctx;
  const Dims outs[] = {{5, 5}, {4, 7}, {7, 4}};
  const Dims ins[] = {{6, 6}, {3, 9}, {9, 3}};
  for (Dims o : outs)
    for (Dims in : ins)
      for (int which = 1; which < 4; which++) {
        SCOPED_TRACE(std::to_string(o.a) + "x" + std::to_string(in.a) +
                     " -> " + std::to_string(o.b) + "x" +
                     std::to_string(in.b) + " null " + std::to_string(which));
        bool null_out = which & 1, null_in = which & 2;
        Buf tau(bt::randn(g, o.a, in.a), 1);
        Buf rout(null_out ? bt::eye(o.a, o.b) : bt::randn(g, o.a, o.b), 0);
        Buf rin(null_in ? bt::eye(in.a, in.b) : bt::randn(g, in.a, in.b), 0);
        Mat init = bt::randn(g, o.b, in.b);
        Buf out_null(init, 2), out_eye(init, 2);
        ASSERT_EQ(BICO_OK,
                  bico_transport_weight(ctx, o.a, in.a, o.b, in.b,
                                        0.5f,
                                        tau.p(), tau.ld,
                                        null_out ? nullptr : rout.p(), rout.ld,
                                        null_in ? nullptr : rin.p(), rin.ld, 2.0f, out_null.p(),
                                        out_null.ld));
        ASSERT_EQ(BICO_OK, bico_transport_weight(
                               ctx, o.a, in.a, o.b, in.b, 0.5f,
                               tau.p(), tau.ld, rout.p(), rout.ld, rin.p(), rin.ld,
                               2.0f, out_eye.p(), out_eye.ld));
        EXPECT_LT(bt::relerr(out_null.m(), out_eye.m()), 1e-6);
        EXPECT_TRUE(out_null.guards_intact());
      }
}

// Shapes where one association order is far cheaper than the other: the
// answer is right either way.
TEST(Transport, WeightLopsidedShapes) {
  bt::Rng g(13);
  bt::Ctx ctx;
  const size_t shapes[][4] = {{4, 64, 64, 4}, {64, 4, 4, 64}, {3, 40, 50, 2},
                              {50, 2, 3, 40}};
  for (auto &s : shapes) {
    Buf tau(bt::randn(g, s[0], s[1]), 0);
    Buf rout(bt::randn(g, s[0], s[2]), 0), rin(bt::randn(g, s[1], s[3]), 0);
    Buf out = Buf::filled(s[2], s[3], 0, kNaN);
    ASSERT_EQ(BICO_OK, bico_transport_weight(ctx, s[0], s[1], s[2], s[3],
                                             -2.0f, tau.p(), tau.ld, rout.p(),
                                             rout.ld, rin.p(), rin.ld, 0.0f,
                                             out.p(), out.ld));
    Mat rom = rout.m(), rim = rin.m();
    EXPECT_LT(bt::relerr(out.m(), reference(tau.m(), &rom, s[2], &rim, s[3],
                                            -2.0, 0.0, out.m())),
              1e-5);
  }
}

// Counting allocator: records the largest request.
struct Track {
  size_t live = 0, largest = 0, allocs = 0;
};
void *track_alloc(void *o, size_t n) {
  Track *t = static_cast<Track *>(o);
  t->live++;
  t->allocs++;
  if (n > t->largest) t->largest = n;
  return std::malloc(n);
}
void track_free(void *o, void *p) {
  if (p != nullptr) static_cast<Track *>(o)->live--;
  std::free(p);
}

// With both maps the kernel forms one intermediate product; it must be the
// one of the order with fewer flops.  Order "left": (R_out^T tau) R_in costs
// dout_b din_a (dout_a + din_b) and holds dout_b x din_a; order "right":
// R_out^T (tau R_in) costs dout_a din_b (din_a + dout_b) and holds
// dout_a x din_b.
TEST(Transport, TemporaryBelongsToTheCheaperOrder) {
  bt::Rng g(14);
  const size_t shapes[][4] = {{4, 64, 64, 4}, {64, 4, 4, 64}, {8, 30, 60, 5},
                              {60, 5, 8, 30}};
  for (auto &s : shapes) {
    size_t dout_a = s[0], din_a = s[1], dout_b = s[2], din_b = s[3];
    double left = (double)dout_b * din_a * (dout_a + din_b);
    double right = (double)dout_a * din_b * (din_a + dout_b);
    ASSERT_NE(left, right);
    size_t want = (left < right ? dout_b * din_a : dout_a * din_b) *
                  sizeof(float);
    Track t;
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(BICO_OK, bico_ctx_create_with_allocator(&ctx, track_alloc,
                                                      track_free, &t));
    Buf tau(bt::randn(g, dout_a, din_a), 0);
    Buf rout(bt::randn(g, dout_a, dout_b), 0), rin(bt::randn(g, din_a, din_b), 0);
    Buf out = Buf::filled(dout_b, din_b, 0, 0.0f);
    t.largest = 0;
    size_t before = t.allocs;
    ASSERT_EQ(BICO_OK, bico_transport_weight(ctx, dout_a, din_a, dout_b,
                                             din_b, 1.0f, tau.p(), tau.ld,
                                             rout.p(), rout.ld, rin.p(), rin.ld,
                                             0.0f, out.p(), out.ld));
    EXPECT_EQ(t.allocs, before + 1);
    EXPECT_EQ(t.largest, want);
    bico_ctx_free(ctx);
    EXPECT_EQ(t.live, 0u);
  }
}

TEST(Transport, OrthogonalMapsPreserveFrobeniusNorm) {
  bt::Rng g(15);
  bt::Ctx ctx;
  for (size_t n : {3, 8, 33}) {
    size_t m = n + 5;
    Buf tau(bt::randn(g, m, n), 0);
    Buf rout(bt::rand_orth(g, m), 0), rin(bt::rand_orth(g, n), 0);
    Buf out = Buf::filled(m, n, 0, kNaN);
    ASSERT_EQ(BICO_OK, bico_transport_weight(ctx, m, n, m, n,
                                             1.0f, tau.p(), tau.ld, rout.p(),
                                             rout.ld, rin.p(), rin.ld, 0.0f, out.p(),
                                             out.ld));
    double a = bt::fro(out.m()), b = bt::fro(tau.m());
    EXPECT_NEAR(a / b, 1.0, 1e-5);
    // And it is not the identity: the maps really did something.
    EXPECT_GT(bt::relerr(out.m(), tau.m()), 0.1);
  }
}

// Block-diagonal matrix from k blocks (NULL block: rectangular identity).
Mat block_diag(const std::vector<const Mat *> &blocks, size_t ba, size_t bb) {
  size_t k = blocks.size();
  Mat m(k * ba, k * bb);
  for (size_t i = 0; i < k; i++) {
    Mat b = blocks[i] ? *blocks[i] : bt::eye(ba, bb);
    for (size_t r = 0; r < ba; r++)
      for (size_t c = 0; c < bb; c++) m(i * ba + r, i * bb + c) = b(r, c);
  }
  return m;
}

TEST(Transport, SplitEqualsBlockwiseAndBlockDiagonal) {
  bt::Rng g(16);
  bt::Ctx ctx;
  const size_t k = 3;
  const Dims blocks[] = {{3, 4}, {4, 3}, {2, 2}};
  for (Dims bd : blocks)
    for (int variant = 0; variant < 4; variant++) {
      // variant 0: all maps; 1: block 1 identity; 2: r_outs NULL;
      // 3: all maps, r_in NULL.
      SCOPED_TRACE("blocks " + std::to_string(bd.a) + "->" +
                   std::to_string(bd.b) + " variant " +
                   std::to_string(variant));
      size_t dout_a = k * bd.a, dout_b = k * bd.b, din_a = 5, din_b = 7;
      size_t pad = 2;
      Buf tau(bt::randn(g, dout_a, din_a), pad);
      std::vector<Buf> rs;
      for (size_t i = 0; i < k; i++) rs.emplace_back(bt::randn(g, bd.a, bd.b), pad);
      std::vector<float *> ptrs(k);
      std::vector<Mat> rm(k);
      std::vector<const Mat *> blk(k);
      for (size_t i = 0; i < k; i++) {
        ptrs[i] = rs[i].p();
        rm[i] = rs[i].m();
        blk[i] = &rm[i];
      }
      if (variant == 1) ptrs[1] = nullptr, blk[1] = nullptr;
      if (variant == 2)
        for (auto &b : blk) b = nullptr;
      Buf rin(bt::randn(g, din_a, din_b), 1);
      const float *rin_p = variant == 3 ? nullptr : rin.p();
      Mat rinm = rin.m();
      Mat init = bt::randn(g, dout_b, din_b);
      Buf out(init, 1);
      ASSERT_EQ(BICO_OK,
                bico_transport_weight_split(
                    ctx, k, dout_a, din_a, dout_b, din_b,
                    1.5f, tau.p(), tau.ld,
                    variant == 2 ? nullptr : ptrs.data(), rs[0].ld, rin_p, rin.ld, 0.25f, out.p(), out.ld))
          << bico_ctx_errmsg(ctx);
      EXPECT_TRUE(out.guards_intact());

      // Block-wise reference in double.
      Mat taum = tau.m(), want(dout_b, din_b);
      for (size_t i = 0; i < k; i++) {
        Mat ti(bd.a, din_a);
        for (size_t r = 0; r < bd.a; r++)
          for (size_t c = 0; c < din_a; c++) ti(r, c) = taum(i * bd.a + r, c);
        Mat oi(bd.b, din_b);
        for (size_t r = 0; r < bd.b; r++)
          for (size_t c = 0; c < din_b; c++) oi(r, c) = init(i * bd.b + r, c);
        Mat wi = reference(ti, blk[i], bd.b, variant == 3 ? nullptr : &rinm,
                           din_b, 1.5, 0.25, oi);
        for (size_t r = 0; r < bd.b; r++)
          for (size_t c = 0; c < din_b; c++) want(i * bd.b + r, c) = wi(r, c);
      }
      EXPECT_LT(bt::relerr(out.m(), want), 1e-5);

      // The unsplit kernel with the block-diagonal R_out.
      Buf diag(block_diag(blk, bd.a, bd.b), 0);
      Buf out2(init, 0);
      ASSERT_EQ(BICO_OK, bico_transport_weight(
                             ctx, dout_a, din_a, dout_b, din_b, 1.5f,
                             tau.p(), tau.ld, diag.p(), diag.ld, rin_p, rin.ld,
                             0.25f, out2.p(), out2.ld));
      EXPECT_LT(bt::relerr(out.m(), out2.m()), 1e-5);
    }
}

TEST(Transport, SplitWithOneBlockEqualsWeight) {
  bt::Rng g(17);
  bt::Ctx ctx;
  Buf tau(bt::randn(g, 6, 4), 0), rout(bt::randn(g, 6, 5), 0),
      rin(bt::randn(g, 4, 3), 0);
  Buf a = Buf::filled(5, 3, 0, kNaN), b = Buf::filled(5, 3, 0, kNaN);
  float *rs[] = {rout.p()};
  ASSERT_EQ(BICO_OK, bico_transport_weight_split(ctx, 1, 6, 4, 5, 3, 1.0f,
                                                 tau.p(), 4, rs, 5, rin.p(), 3,
                                                 0.0f, a.p(), 3));
  ASSERT_EQ(BICO_OK, bico_transport_weight(ctx, 6, 4, 5, 3, 1.0f, tau.p(),
                                           4, rout.p(), 5, rin.p(), 3, 0.0f, b.p(),
                                           3));
  EXPECT_LT(bt::relerr(a.m(), b.m()), 1e-6);
}

TEST(Transport, VectorMatchesMatmul) {
  bt::Rng g(18);
  bt::Ctx ctx;
  const Dims dims[] = {{6, 6}, {4, 9}, {9, 4}};
  for (Dims d : dims)
    for (bool null_r : {false, true})
      for (float beta : {0.0f, 1.0f}) {
        Mat v = bt::randn(g, d.a, 1);
        Buf r(bt::randn(g, d.a, d.b), 2);
        Buf vb(v, 0);
        Buf out = beta == 0.0f ? Buf::filled(d.b, 1, 0, kNaN)
                               : Buf(bt::randn(g, d.b, 1), 0);
        Mat out0 = out.m(), rm = r.m();
        ASSERT_EQ(BICO_OK,
                  bico_transport_vector(ctx, d.a, d.b,
                                        -0.5f, vb.p(), null_r ? nullptr : r.p(),
                                        r.ld, beta, out.p()));
        Mat rr = null_r ? bt::eye(d.a, d.b) : rm;
        Mat want = scaled_sum(bt::matmul(bt::transpose(rr), vb.m()), -0.5,
                              out0, beta);
        EXPECT_LT(bt::relerr(out.m(), want), 1e-5);
      }
}

TEST(Transport, RowsMatchesMatmul) {
  bt::Rng g(19);
  bt::Ctx ctx;
  const Dims dims[] = {{6, 6}, {4, 9}, {9, 4}};
  for (Dims d : dims)
    for (bool null_r : {false, true})
      for (float beta : {0.0f, 1.0f}) {
        size_t n = 7;
        Buf t(bt::randn(g, n, d.a), 3);
        Buf r(bt::randn(g, d.a, d.b), 1);
        Buf out = beta == 0.0f ? Buf::filled(n, d.b, 2, kNaN)
                               : Buf(bt::randn(g, n, d.b), 2);
        Mat out0 = out.m();
        ASSERT_EQ(BICO_OK,
                  bico_transport_rows(ctx, n, d.a, d.b, 2.0f,
                                      t.p(), t.ld, null_r ? nullptr : r.p(),
                                      r.ld, beta, out.p(), out.ld));
        Mat rr = null_r ? bt::eye(d.a, d.b) : r.m();
        Mat want = scaled_sum(bt::matmul(t.m(), rr), 2.0, out0, beta);
        EXPECT_LT(bt::relerr(out.m(), want), 1e-5);
        EXPECT_TRUE(out.guards_intact());
      }
}

// ---- errors ----

bool mentions(bico_ctx *ctx, const char *s) {
  return std::string(bico_ctx_errmsg(ctx)).find(s) != std::string::npos;
}

struct TransportErrors : ::testing::Test {
  bt::Ctx ctx;
  bt::Rng g{20};
  Buf tau{bt::randn(g, 4, 3), 0}, rout{bt::randn(g, 4, 5), 0},
      rin{bt::randn(g, 3, 2), 0};
  Buf out = Buf::filled(5, 2, 0, 7.0f);
  bico_status weight(size_t ld_tau = 3, size_t ld_rout = 5, size_t ld_rin = 2,
                     size_t ld_out = 2, float alpha = 1.0f) {
    return bico_transport_weight(ctx, 4, 3, 5, 2, alpha,
                                 tau.p(), ld_tau, rout.p(), ld_rout, rin.p(), ld_rin, 1.0f,
                                 out.p(), ld_out);
  }
  bool out_untouched() const {
    for (float x : out.v)
      if (x != 7.0f) return false;
    return true;
  }
};

TEST_F(TransportErrors, NullArguments) {
  EXPECT_EQ(BICO_E_NULL,
            bico_transport_weight(nullptr, 4, 3, 5, 2, 1.0f, tau.p(), 3,
                                  nullptr, 5, nullptr, 2, 0.0f, out.p(), 2));
  EXPECT_EQ(BICO_E_NULL,
            bico_transport_weight(ctx, 4, 3, 5, 2, 1.0f, nullptr, 3,
                                  nullptr, 5, nullptr, 2, 0.0f, out.p(), 2));
  EXPECT_TRUE(mentions(ctx, "transport_weight") && mentions(ctx, "tau"));
  EXPECT_EQ(BICO_E_NULL,
            bico_transport_weight(ctx, 4, 3, 5, 2, 1.0f, tau.p(), 3,
                                  nullptr, 5, nullptr, 2, 0.0f, nullptr, 2));
  EXPECT_TRUE(mentions(ctx, "out"));
  EXPECT_EQ(BICO_E_NULL, bico_transport_vector(ctx, 4, 4, 1.0f, nullptr, nullptr,
                                               4, 0.0f, out.p()));
  EXPECT_TRUE(mentions(ctx, "transport_vector"));
  EXPECT_EQ(BICO_E_NULL, bico_transport_rows(ctx, 4, 3, 2, 1.0f, tau.p(),
                                             3, nullptr, 2, 0.0f, nullptr, 2));
  EXPECT_TRUE(mentions(ctx, "transport_rows"));
  EXPECT_EQ(BICO_E_NULL, bico_transport_weight_split(
                             ctx, 1, 4, 3, 5, 2, 1.0f, nullptr, 3, nullptr,
                             5, nullptr, 2, 0.0f, out.p(), 2));
  EXPECT_TRUE(out_untouched());
}

TEST_F(TransportErrors, ZeroDimensions) {
  EXPECT_EQ(BICO_E_SHAPE,
            bico_transport_weight(ctx, 0, 3, 5, 2, 1.0f, tau.p(), 3,
                                  nullptr, 5, nullptr, 2, 0.0f, out.p(), 2));
  EXPECT_TRUE(mentions(ctx, "zero dimension"));
  EXPECT_EQ(BICO_E_SHAPE,
            bico_transport_weight(ctx, 4, 3, 5, 0, 1.0f, tau.p(), 3,
                                  nullptr, 5, nullptr, 2, 0.0f, out.p(), 2));
  EXPECT_EQ(BICO_E_SHAPE, bico_transport_vector(ctx, 4, 0, 1.0f, tau.p(),
                                                nullptr, 4, 0.0f, out.p()));
  EXPECT_EQ(BICO_E_SHAPE, bico_transport_rows(ctx, 0, 3, 2, 1.0f, tau.p(),
                                              3, nullptr, 2, 0.0f, out.p(), 2));
  EXPECT_TRUE(out_untouched());
}

TEST_F(TransportErrors, StridesTooSmall) {
  ASSERT_EQ(BICO_OK, weight());  // the fixture itself is valid
  std::fill(out.v.begin(), out.v.end(), 7.0f);
  EXPECT_EQ(BICO_E_SHAPE, weight(2, 5, 2, 2));
  EXPECT_TRUE(mentions(ctx, "ld_tau = 2")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(BICO_E_SHAPE, weight(3, 4, 2, 2));
  EXPECT_TRUE(mentions(ctx, "ld_rout = 4")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(BICO_E_SHAPE, weight(3, 5, 1, 2));
  EXPECT_TRUE(mentions(ctx, "ld_rin = 1")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(BICO_E_SHAPE, weight(3, 5, 2, 1));
  EXPECT_TRUE(mentions(ctx, "ld_out = 1")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(BICO_E_SHAPE, bico_transport_vector(ctx, 4, 5, 1.0f, tau.p(),
                                                rout.p(), 4, 0.0f, out.p()));
  EXPECT_EQ(BICO_E_SHAPE, bico_transport_rows(ctx, 4, 3, 2, 1.0f, tau.p(),
                                              2, nullptr, 2, 0.0f, out.p(), 2));
  EXPECT_TRUE(out_untouched());
}

TEST_F(TransportErrors, SplitBlocksMustDivide) {
  float *rs[] = {nullptr, nullptr, nullptr};
  Buf t6 = Buf::filled(6, 3, 0, 1.0f), o = Buf::filled(7, 3, 0, 7.0f);
  EXPECT_EQ(BICO_E_SHAPE,
            bico_transport_weight_split(ctx, 3, 6, 3, 7, 3, 1.0f, t6.p(), 3,
                                        rs, 2, nullptr, 3, 0.0f, o.p(), 3));
  EXPECT_TRUE(mentions(ctx, "k = 3") && mentions(ctx, "dout_b = 7"))
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(BICO_E_SHAPE,
            bico_transport_weight_split(ctx, 4, 6, 3, 4, 3, 1.0f, t6.p(),
                                        3, nullptr, 2, nullptr, 3, 0.0f, o.p(),
                                        3));
  EXPECT_TRUE(mentions(ctx, "dout_a = 6")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(BICO_E_ARG,
            bico_transport_weight_split(ctx, 0, 6, 3, 6, 3, 1.0f, t6.p(),
                                        3, nullptr, 2, nullptr, 3, 0.0f, o.p(),
                                        3));
  EXPECT_TRUE(mentions(ctx, "k is 0"));
  for (float x : o.v) EXPECT_EQ(x, 7.0f);
}

TEST_F(TransportErrors, NonFiniteInputs) {
  tau.at(2, 1) = kNaN;
  EXPECT_EQ(BICO_E_NONFINITE, weight());
  EXPECT_TRUE(mentions(ctx, "tau") && mentions(ctx, "NaN") &&
              mentions(ctx, "row 2, column 1"))
      << bico_ctx_errmsg(ctx);
  tau.at(2, 1) = 0.0f;
  rin.at(1, 0) = kInf;
  EXPECT_EQ(BICO_E_NONFINITE, weight());
  EXPECT_TRUE(mentions(ctx, "r_in") && mentions(ctx, "Inf"));
  rin.at(1, 0) = 0.0f;
  rout.at(3, 4) = -kInf;
  EXPECT_EQ(BICO_E_NONFINITE, weight());
  EXPECT_TRUE(mentions(ctx, "r_out"));
  rout.at(3, 4) = 0.0f;
  EXPECT_EQ(BICO_E_ARG, weight(3, 5, 2, 2, kNaN));
  EXPECT_TRUE(mentions(ctx, "alpha"));
  EXPECT_TRUE(out_untouched());

  // Split names the offending block; vector and rows name their arguments.
  Buf r0 = Buf::filled(2, 2, 0, 1.0f), r1 = Buf::filled(2, 2, 0, 1.0f);
  r1.at(0, 1) = kNaN;
  float *rs[] = {r0.p(), r1.p()};
  Buf o = Buf::filled(4, 3, 0, 0.0f);
  EXPECT_EQ(BICO_E_NONFINITE,
            bico_transport_weight_split(ctx, 2, 4, 3, 4, 3, 1.0f, tau.p(), 3,
                                        rs, 2, nullptr, 3, 0.0f, o.p(), 3));
  EXPECT_TRUE(mentions(ctx, "r_outs[1]")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(BICO_E_NONFINITE, bico_transport_vector(ctx, 2, 2, 1.0f, r0.p(),
                                                    r1.p(), 2, 0.0f, o.p()));
  EXPECT_TRUE(mentions(ctx, "transport_vector: r holds NaN"))
      << bico_ctx_errmsg(ctx);
  r0.at(1, 1) = kInf;
  EXPECT_EQ(BICO_E_NONFINITE, bico_transport_rows(ctx, 2, 2, 2, 1.0f,
                                                  r0.p(), 2, nullptr, 2, 0.0f,
                                                  o.p(), 3));
  EXPECT_TRUE(mentions(ctx, "transport_rows: t holds Inf"))
      << bico_ctx_errmsg(ctx);
}

}  // namespace
