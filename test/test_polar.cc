// BICO_PROC_METHOD: the EIG (dsyevd of the smaller Gram) and POLAR
// (Newton-Schulz) routes against planted factorisations C = U diag(s) V^T
// built here, whose Procrustes answer U V^T and spectrum s are known
// without any solver; and the fallback contract: wherever a route cannot
// certify a full, well-separated rank, the result is the SVD route's, bit
// for bit (rank, completion, spectrum).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

using bt::Mat;

namespace {

bool has(const char *msg, const char *needle) {
  return std::string(msg).find(needle) != std::string::npos;
}

// First k columns of a random orthogonal n x n matrix.
Mat orth_cols(bt::Rng &g, size_t n, size_t k) {
  Mat q = bt::rand_orth(g, n), out(n, k);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < k; j++) out(i, j) = q(i, j);
  return out;
}

struct Planted {
  Mat c, r;  // C = U diag(s) V^T and its answer U V^T
  std::vector<double> s;
};

Planted plant(bt::Rng &g, size_t da, size_t db, std::vector<double> s) {
  size_t k = std::min(da, db);
  Mat u = orth_cols(g, da, k), v = orth_cols(g, db, k), us = u;
  for (size_t i = 0; i < da; i++)
    for (size_t j = 0; j < k; j++) us(i, j) *= s[j];
  Planted p;
  p.c = bt::matmul(us, bt::transpose(v));
  p.r = bt::matmul(u, bt::transpose(v));
  p.s = s;
  return p;
}

struct Result {
  Mat r;
  size_t rank = 0;
  std::vector<double> spec;
};

Result solve(bico_ctx *ctx, int method, int null_mode, const Mat &c) {
  bico_procrustes *p = nullptr;
  EXPECT_EQ(bico_procrustes_create(ctx, &p), BICO_OK);
  EXPECT_EQ(bico_procrustes_set_param(p, BICO_PROC_METHOD, method), BICO_OK);
  EXPECT_EQ(bico_procrustes_set_param(p, BICO_PROC_NULL, null_mode), BICO_OK);
  std::vector<float> r(c.r * c.c);
  Result out;
  EXPECT_EQ(bico_procrustes_solve_matrix(p, c.r, c.c, c.v.data(), c.c, r.data(), c.c,
                                         &out.rank),
            BICO_OK)
      << bico_ctx_errmsg(ctx);
  out.r = Mat::from(r.data(), c.r, c.c, c.c);
  size_t count = 0;
  EXPECT_EQ(bico_procrustes_spectrum(p, nullptr, 0, &count), BICO_OK);
  out.spec.resize(count);
  EXPECT_EQ(bico_procrustes_spectrum(p, out.spec.data(), count, &count), BICO_OK);
  bico_procrustes_free(p);
  return out;
}

std::vector<double> geometric(size_t k, double hi, double lo) {
  std::vector<double> s(k);
  for (size_t i = 0; i < k; i++)
    s[i] = hi * std::pow(lo / hi, k > 1 ? double(i) / double(k - 1) : 0.0);
  return s;
}

}  // namespace

TEST(PolarTest, ParamDefaultBoundsAndErrors) {
  bt::Ctx ctx;
  bico_procrustes *p = nullptr;
  ASSERT_EQ(bico_procrustes_create(ctx, &p), BICO_OK);
  double v = -1, lo = -1, hi = -1;
  unsigned fl = 0;
  ASSERT_EQ(bico_procrustes_get_param(p, BICO_PROC_METHOD, &v), BICO_OK);
  EXPECT_EQ(v, BICO_PROC_EIG);
  ASSERT_EQ(bico_procrustes_param_bounds(BICO_PROC_METHOD, &lo, &hi, &fl), BICO_OK);
  EXPECT_EQ(fl, unsigned(BICO_PARAM_INTEGER));
  EXPECT_EQ(lo, 0);  // 0: the default (status.h)
  EXPECT_EQ(hi, BICO_PROC_POLAR);
  EXPECT_EQ(bico_procrustes_set_param(p, BICO_PROC_METHOD, BICO_PROC_POLAR + 1),
            BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "method = 4"));
  EXPECT_EQ(bico_procrustes_set_param(p, BICO_PROC_METHOD, -1), BICO_E_ARG);
  EXPECT_EQ(bico_procrustes_set_param(p, BICO_PROC_METHOD, 1.5), BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "(integers)"));
  ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_METHOD, BICO_PROC_POLAR), BICO_OK);
  ASSERT_EQ(bico_procrustes_get_param(p, BICO_PROC_METHOD, &v), BICO_OK);
  EXPECT_EQ(v, BICO_PROC_POLAR);
  // 0 asks for the default and reads back as the member it resolved to.
  ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_METHOD, 0), BICO_OK);
  ASSERT_EQ(bico_procrustes_get_param(p, BICO_PROC_METHOD, &v), BICO_OK);
  EXPECT_EQ(v, BICO_PROC_EIG);
  ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_NULL, BICO_NULL_DROP), BICO_OK);
  ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_NULL, 0), BICO_OK);
  ASSERT_EQ(bico_procrustes_get_param(p, BICO_PROC_NULL, &v), BICO_OK);
  EXPECT_EQ(v, BICO_NULL_KEEP);
  bico_procrustes_free(p);
}

// Well-conditioned planted statistics (condition 1e3), square and both
// rectangular orientations: every method returns U V^T to single precision,
// full rank; EIG's spectrum is the planted one; POLAR leaves none.
TEST(PolarTest, PlantedWellConditioned) {
  bt::Ctx ctx;
  bt::Rng g(17);
  const size_t shapes[][2] = {{30, 30}, {20, 33}, {33, 20}};
  for (auto &sh : shapes) {
    size_t da = sh[0], db = sh[1], k = std::min(da, db);
    Planted pl = plant(g, da, db, geometric(k, 50.0, 0.05));
    for (int method : {BICO_PROC_SVD, BICO_PROC_EIG, BICO_PROC_POLAR}) {
      SCOPED_TRACE(testing::Message() << da << "x" << db << " method " << method);
      Result res = solve(ctx, method, BICO_NULL_KEEP, pl.c);
      EXPECT_LT(bt::fro(bt::sub(res.r, pl.r)), 1e-5);
      EXPECT_EQ(res.rank, k);
      if (method == BICO_PROC_POLAR) {
        EXPECT_TRUE(res.spec.empty());
      } else {
        ASSERT_EQ(res.spec.size(), k);
        for (size_t i = 0; i < k; i++) EXPECT_NEAR(res.spec[i], pl.s[i], 1e-8 * pl.s[0]);
      }
    }
  }
}

// Rank-deficient (three zero singular values) and ill-conditioned (1e-7,
// below the rank tolerance; and 1e-4.5, between the tolerance and EIG's
// 1e-4 certificate) statistics: EIG and POLAR hand over to the SVD, so
// rank, R (KEEP and DROP) and spectrum are the SVD route's, bit for bit.
TEST(PolarTest, UncertifiedFallsBackToSvd) {
  bt::Ctx ctx;
  bt::Rng g(23);
  std::vector<std::vector<double>> spectra;
  auto deficient = geometric(16, 10.0, 1.0);
  for (size_t i = 13; i < 16; i++) deficient[i] = 0.0;
  spectra.push_back(deficient);
  spectra.push_back(geometric(16, 1.0, 1e-7));
  spectra.push_back(geometric(16, 1.0, std::pow(10.0, -4.5)));
  for (size_t t = 0; t < spectra.size(); t++) {
    Planted pl = plant(g, 16, 21, spectra[t]);
    for (int null_mode : {BICO_NULL_KEEP, BICO_NULL_DROP}) {
      Result svd = solve(ctx, BICO_PROC_SVD, null_mode, pl.c);
      for (int method : {BICO_PROC_EIG, BICO_PROC_POLAR}) {
        SCOPED_TRACE(testing::Message() << "spectrum " << t << " null " << null_mode
                                        << " method " << method);
        Result res = solve(ctx, method, null_mode, pl.c);
        if (t == 2 && method == BICO_PROC_POLAR) {
          // 10^-4.5 exceeds tol 1e-5 * ||C||_F here: POLAR may certify it;
          // then it must still be the planted answer, at full rank.
          EXPECT_EQ(res.rank, 16u);
          EXPECT_LT(bt::fro(bt::sub(res.r, pl.r)), 1e-4);
          continue;
        }
        EXPECT_EQ(res.rank, svd.rank);
        EXPECT_EQ(res.r.v, svd.r.v);
        EXPECT_EQ(res.spec, svd.spec);
      }
    }
    if (t == 0) {
      Result svd = solve(ctx, BICO_PROC_SVD, BICO_NULL_KEEP, pl.c);
      EXPECT_EQ(svd.rank, 13u);
    }
  }
}

// Through an accumulator with centering and whitening: EIG gives the SVD
// route's map to single precision on generic data.
TEST(PolarTest, EigThroughAccumulatorMatchesSvd) {
  bt::Ctx ctx;
  bt::Rng g(31);
  const size_t n = 400, da = 12, db = 9;
  Mat xa = bt::randn(g, n, da), mix = bt::randn(g, da, db);
  Mat xb = bt::add(bt::matmul(xa, mix), bt::randn(g, n, db), 0.5);
  auto fa = xa.f32(), fb = xb.f32();
  bico_xcov *xc = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, da, db, BICO_XCOV_SUMS | BICO_XCOV_GRAMS, &xc), BICO_OK);
  ASSERT_EQ(bico_xcov_add(xc, n, fa.data(), da, fb.data(), db), BICO_OK);
  std::vector<Mat> rs;
  for (int method : {BICO_PROC_SVD, BICO_PROC_EIG}) {
    bico_procrustes *p = nullptr;
    ASSERT_EQ(bico_procrustes_create(ctx, &p), BICO_OK);
    ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_METHOD, method), BICO_OK);
    ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_CENTER, 1), BICO_OK);
    ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_WHITEN, 0.5), BICO_OK);
    std::vector<float> r(da * db);
    size_t rank = 0;
    ASSERT_EQ(bico_procrustes_solve(p, xc, r.data(), db, &rank), BICO_OK);
    EXPECT_EQ(rank, db);
    rs.push_back(Mat::from(r.data(), da, db, db));
    bico_procrustes_free(p);
  }
  EXPECT_LT(bt::fro(bt::sub(rs[0], rs[1])), 1e-5);
  EXPECT_GT(bt::fro(rs[0]), 1.0);  // not trivially zero
  bico_xcov_free(xc);
}

namespace {
// Fails the allocation numbered `fail_at` (1-based) and every later one.
using bt::Failing;
using bt::fail_free;
const bico_alloc_fn fail_alloc = bt::fail_from_alloc;
}  // namespace

// EIG and POLAR (on a statistic they certify) and the fast accumulator:
// every allocation failure is BICO_E_NOMEM, frees what it took, and leaves
// an accumulator unchanged.
TEST(PolarTest, OutOfMemoryAtEveryAllocation) {
  bt::Rng g(47);
  Planted pl = plant(g, 6, 5, geometric(5, 4.0, 1.0));
  for (int method : {BICO_PROC_EIG, BICO_PROC_POLAR}) {
    bool succeeded = false;
    for (long k = 1; k < 100 && !succeeded; k++) {
      Failing f;
      bico_ctx *ctx = nullptr;
      ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
      bico_procrustes *p = nullptr;
      ASSERT_EQ(bico_procrustes_create(ctx, &p), BICO_OK);
      ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_METHOD, method), BICO_OK);
      const long base_live = f.live;
      f.fail_at = f.count + k;
      std::vector<float> r(6 * 5);
      size_t rank = 0;
      bico_status st = bico_procrustes_solve_matrix(p, 6, 5, pl.c.v.data(), 5, r.data(), 5, &rank);
      if (st == BICO_OK) {
        succeeded = true;
        EXPECT_EQ(rank, 5u);
        // EIG keeps the spectrum; POLAR has none to keep.
        EXPECT_EQ(f.live, base_live + (method == BICO_PROC_EIG ? 1 : 0));
        EXPECT_LT(bt::fro(bt::sub(Mat::from(r.data(), 6, 5, 5), pl.r)), 1e-5);
      } else {
        EXPECT_EQ(st, BICO_E_NOMEM) << "method " << method << " allocation " << k;
        EXPECT_EQ(f.live, base_live) << "leak when allocation " << k << " fails";
      }
      f.fail_at = 0;
      bico_procrustes_free(p);
      EXPECT_EQ(f.live, 1);  // the context itself
      bico_ctx_free(ctx);
    }
    EXPECT_TRUE(succeeded);
  }
  // The fast accumulator.
  std::vector<float> xa(40 * 3), xb(40 * 2);
  for (auto &v : xa) v = float(g.normal());
  for (auto &v : xb) v = float(g.normal());
  bool succeeded = false;
  for (long k = 1; k < 50 && !succeeded; k++) {
    Failing f;
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
    bico_xcov *xc = nullptr;
    ASSERT_EQ(bico_xcov_create(ctx, 3, 2, BICO_XCOV_GRAMS | BICO_XCOV_SUMS, &xc), BICO_OK);
    ASSERT_EQ(bico_xcov_set_param(xc, BICO_XCOV_ADD_MODE, BICO_XCOV_ADD_FAST), BICO_OK);
    const long base_live = f.live;
    f.fail_at = f.count + k;
    bico_status st = bico_xcov_add(xc, 40, xa.data(), 3, xb.data(), 2);
    uint64_t rows = 99;
    ASSERT_EQ(bico_xcov_info(xc, nullptr, nullptr, &rows, nullptr), BICO_OK);
    if (st == BICO_OK) {
      succeeded = true;
      EXPECT_EQ(rows, 40u);
    } else {
      EXPECT_EQ(st, BICO_E_NOMEM);
      EXPECT_EQ(rows, 0u);
      std::vector<double> c(6, 1.0);
      ASSERT_EQ(bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, c.data(), 2), BICO_OK);
      EXPECT_EQ(c, std::vector<double>(6, 0.0));
    }
    EXPECT_EQ(f.live, base_live);
    f.fail_at = 0;
    bico_xcov_free(xc);
    bico_ctx_free(ctx);
  }
  EXPECT_TRUE(succeeded);
}

// The EIG route reads the caller's matrix in place: row strides on C and R
// (both orientations, more than one R panel of 256 rows) give the planted
// answer, and the padding between rows is neither read into the result
// nor written.
TEST(PolarTest, EigStridedInPlace) {
  bt::Ctx ctx;
  bt::Rng g(41);
  const size_t shapes[][2] = {{300, 310}, {310, 300}};
  for (auto &sh : shapes) {
    size_t da = sh[0], db = sh[1], k = std::min(da, db);
    SCOPED_TRACE(testing::Message() << da << "x" << db);
    Planted pl = plant(g, da, db, geometric(k, 4.0, 0.5));
    const size_t ldc = db + 5, ldr = db + 3;
    std::vector<double> c(da * ldc, std::nan(""));
    for (size_t i = 0; i < da; i++)
      for (size_t j = 0; j < db; j++) c[i * ldc + j] = pl.c(i, j);
    const std::vector<double> c0 = c;
    std::vector<float> r(da * ldr, -7.0f);
    bico_procrustes *p = nullptr;
    ASSERT_EQ(bico_procrustes_create(ctx, &p), BICO_OK);
    size_t rank = 0;
    ASSERT_EQ(bico_procrustes_solve_matrix(p, da, db, c.data(), ldc, r.data(), ldr, &rank),
              BICO_OK)
        << bico_ctx_errmsg(ctx);
    EXPECT_EQ(rank, k);
    double err = 0;
    for (size_t i = 0; i < da; i++) {
      for (size_t j = 0; j < db; j++) err = std::max(err, std::fabs(r[i * ldr + j] - pl.r(i, j)));
      for (size_t j = db; j < ldr; j++) {
        EXPECT_EQ(r[i * ldr + j], -7.0f);
      }
    }
    EXPECT_LT(err, 1e-5);
    for (size_t i = 0; i < c.size(); i++) {
      if (!std::isnan(c0[i])) {
        EXPECT_EQ(c[i], c0[i]);
      }
    }
    bico_procrustes_free(p);
  }
}

// The EIG route squares magnitudes in its Gram: at the ends of the double
// range (entries near 1e-160 or 1e+160) that would underflow or overflow.
// It works on a power-of-two rescaling of C, so planted statistics at those
// scales give the planted answer and the planted (scaled) spectrum.
TEST(PolarTest, EigAtExtremeScales) {
  bt::Ctx ctx;
  bt::Rng g(53);
  for (double scale : {1e-160, 1e160}) {
    for (auto sh : {std::pair<size_t, size_t>{12, 17}, {17, 12}, {1, 1}}) {
      size_t da = sh.first, db = sh.second, k = std::min(da, db);
      SCOPED_TRACE(testing::Message() << da << "x" << db << " scale " << scale);
      Planted pl = plant(g, da, db, geometric(k, 3.0, 0.5));
      Mat c = pl.c;
      for (auto &x : c.v) x *= scale;
      Result res = solve(ctx, BICO_PROC_EIG, BICO_NULL_KEEP, c);
      EXPECT_EQ(res.rank, k);
      EXPECT_LT(bt::fro(bt::sub(res.r, pl.r)), 1e-5);
      ASSERT_EQ(res.spec.size(), k);
      for (size_t i = 0; i < k; i++)
        EXPECT_NEAR(res.spec[i] / scale, pl.s[i], 1e-8 * pl.s[0]);
    }
  }
}
