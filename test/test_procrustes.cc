// Tests of the Procrustes solver against planted answers, closed forms,
// optimality over random candidates and an independent Jacobi eigensolver
// written here (no LAPACK, no BLIS, no libbico in the references).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
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

// Cyclic Jacobi for a symmetric matrix: a = v diag(w) v^T.
void jacobi(Mat a, std::vector<double> &w, Mat &v) {
  const size_t n = a.r;
  v = bt::eye(n, n);
  for (int sweep = 0; sweep < 100; sweep++) {
    double off = 0, all = 0;
    for (size_t i = 0; i < n; i++)
      for (size_t j = 0; j < n; j++) {
        all += a(i, j) * a(i, j);
        if (i != j) off += a(i, j) * a(i, j);
      }
    if (off <= 1e-32 * all || off == 0) break;
    for (size_t p = 0; p + 1 < n; p++)
      for (size_t q = p + 1; q < n; q++) {
        if (a(p, q) == 0) continue;
        double tau = (a(q, q) - a(p, p)) / (2 * a(p, q));
        double t = (tau >= 0 ? 1.0 : -1.0) / (std::fabs(tau) + std::sqrt(1 + tau * tau));
        double c = 1 / std::sqrt(1 + t * t), s = t * c;
        for (size_t k = 0; k < n; k++) {  // a <- a J
          double akp = a(k, p), akq = a(k, q);
          a(k, p) = c * akp - s * akq;
          a(k, q) = s * akp + c * akq;
        }
        for (size_t k = 0; k < n; k++) {  // a <- J^T a
          double apk = a(p, k), aqk = a(q, k);
          a(p, k) = c * apk - s * aqk;
          a(q, k) = s * apk + c * aqk;
        }
        for (size_t k = 0; k < n; k++) {  // v <- v J
          double vkp = v(k, p), vkq = v(k, q);
          v(k, p) = c * vkp - s * vkq;
          v(k, q) = s * vkp + c * vkq;
        }
      }
  }
  w.resize(n);
  for (size_t i = 0; i < n; i++) w[i] = a(i, i);
}

// (max(a, 0) + eps I)^power for symmetric a, by Jacobi.
Mat sym_pow(const Mat &a, double power, double eps) {
  std::vector<double> w;
  Mat v;
  jacobi(a, w, v);
  Mat d(a.r, a.r);
  for (size_t i = 0; i < a.r; i++) d(i, i) = std::pow(std::max(w[i], 0.0) + eps, power);
  return bt::matmul(bt::matmul(v, d), bt::transpose(v));
}

// Singular values of c, largest first, as square roots of the eigenvalues
// of the smaller of c c^T and c^T c.
std::vector<double> ref_singular(const Mat &c) {
  Mat g = c.r <= c.c ? bt::matmul(c, bt::transpose(c)) : bt::matmul(bt::transpose(c), c);
  std::vector<double> w;
  Mat v;
  jacobi(g, w, v);
  for (auto &x : w) x = std::sqrt(std::max(x, 0.0));
  std::sort(w.begin(), w.end(), [](double x, double y) { return x > y; });
  return w;
}

// Orthogonal polar factor U V^T of a full-rank c.
Mat ref_polar(const Mat &c) {
  if (c.r >= c.c)
    return bt::matmul(c, sym_pow(bt::matmul(bt::transpose(c), c), -0.5, 0.0));
  return bt::matmul(sym_pow(bt::matmul(c, bt::transpose(c)), -0.5, 0.0), c);
}

// Float rows as the library sees them, and their exact double values.
struct Data {
  std::vector<float> fa, fb;
  Mat a, b;
  Data(const Mat &xa, const Mat &xb) : fa(xa.f32()), fb(xb.f32()) {
    a = Mat::from(fa.data(), xa.r, xa.c, xa.c);
    b = Mat::from(fb.data(), xb.r, xb.c, xb.c);
  }
};

bico_xcov *accumulate(bico_ctx *ctx, const Data &d, unsigned flags) {
  bico_xcov *xc = nullptr;
  EXPECT_EQ(bico_xcov_create(ctx, d.a.c, d.b.c, flags, &xc), BICO_OK);
  EXPECT_EQ(bico_xcov_add(xc, d.a.r, d.fa.data(), d.a.c, d.fb.data(), d.b.c),
            BICO_OK);
  return xc;
}

struct Proc {
  bico_procrustes *p = nullptr;
  explicit Proc(bico_ctx *ctx) { EXPECT_EQ(bico_procrustes_create(ctx, &p), BICO_OK); }
  ~Proc() { bico_procrustes_free(p); }
  operator bico_procrustes *() const { return p; }
  void set(int param, double v) { EXPECT_EQ(bico_procrustes_set_param(p, param, v), BICO_OK); }
  Mat solve(const bico_xcov *xc, size_t da, size_t db, size_t *rank = nullptr) {
    std::vector<float> r(da * db);
    EXPECT_EQ(bico_procrustes_solve(p, xc, r.data(), db, rank), BICO_OK);
    return Mat::from(r.data(), da, db, db);
  }
  Mat solve_matrix(const Mat &c, size_t *rank = nullptr) {
    std::vector<float> r(c.r * c.c);
    EXPECT_EQ(bico_procrustes_solve_matrix(p, c.r, c.c, c.v.data(), c.c, r.data(),
                                           c.c, rank),
              BICO_OK);
    return Mat::from(r.data(), c.r, c.c, c.c);
  }
  std::vector<double> spectrum() {
    size_t n = 0;
    EXPECT_EQ(bico_procrustes_spectrum(p, nullptr, 0, &n), BICO_OK);
    std::vector<double> s(n);
    EXPECT_EQ(bico_procrustes_spectrum(p, s.data(), n, &n), BICO_OK);
    return s;
  }
};

double maxabs(const Mat &m) {
  double x = 0;
  for (double v : m.v) x = std::max(x, std::fabs(v));
  return x;
}

double maxdiff(const Mat &a, const Mat &b) { return maxabs(bt::sub(a, b)); }

bool all_finite(const Mat &m) {
  for (double v : m.v)
    if (!std::isfinite(v)) return false;
  return true;
}

// R R^T = I (d_a <= d_b) or R^T R = I (d_a > d_b).
double semi_orth_err(const Mat &r) {
  Mat g = r.r <= r.c ? bt::matmul(r, bt::transpose(r)) : bt::matmul(bt::transpose(r), r);
  return maxdiff(g, bt::eye(g.r, g.c));
}

Mat rows_of(const Mat &m, size_t k) {  // first k rows
  Mat out(k, m.c);
  for (size_t i = 0; i < k; i++)
    for (size_t j = 0; j < m.c; j++) out(i, j) = m(i, j);
  return out;
}

}  // namespace

TEST(ProcrustesTest, PlantedRotationRecovered) {
  bt::Ctx ctx;
  bt::Rng g(11);
  const size_t n = 200, d = 6;
  Mat q = bt::rand_orth(g, d);
  Mat xa = bt::randn(g, n, d);
  Data data(xa, bt::matmul(xa, q));
  bico_xcov *xc = accumulate(ctx, data, 0);
  Proc p(ctx);
  // Output with a row stride: the padding stays untouched.
  const size_t ld = d + 3;
  std::vector<float> r(d * ld, 42.0f);
  size_t rank = 0;
  ASSERT_EQ(bico_procrustes_solve(p, xc, r.data(), ld, &rank), BICO_OK);
  for (size_t i = 0; i < d; i++)
    for (size_t j = d; j < ld; j++) EXPECT_EQ(r[i * ld + j], 42.0f);
  EXPECT_LT(maxdiff(Mat::from(r.data(), d, d, ld), q), 1e-5);
  EXPECT_EQ(rank, d);
  bico_xcov_free(xc);
}

TEST(ProcrustesTest, RectangularIsSemiOrthogonal) {
  bt::Ctx ctx;
  bt::Rng g(12);
  const size_t shapes[][2] = {{4, 7}, {7, 4}, {1, 5}, {5, 1}, {6, 6}};
  for (auto &s : shapes) {
    Data data(bt::randn(g, 50, s[0]), bt::randn(g, 50, s[1]));
    bico_xcov *xc = accumulate(ctx, data, 0);
    Proc p(ctx);
    size_t rank = 0;
    Mat r = p.solve(xc, s[0], s[1], &rank);
    EXPECT_LT(semi_orth_err(r), 1e-5) << s[0] << "x" << s[1];
    EXPECT_EQ(rank, std::min(s[0], s[1]));
    bico_xcov_free(xc);
  }
}

TEST(ProcrustesTest, PlantedEmbeddingRecovered) {
  bt::Ctx ctx;
  bt::Rng g(13);
  const size_t n = 100, lo = 4, hi = 7;
  Mat e = rows_of(bt::rand_orth(g, hi), lo);  // lo x hi, orthonormal rows
  {
    // d_a < d_b: x_b = x_a E embeds the narrow space; R = E.
    Mat xa = bt::randn(g, n, lo);
    Data data(xa, bt::matmul(xa, e));
    bico_xcov *xc = accumulate(ctx, data, 0);
    Proc p(ctx);
    EXPECT_LT(maxdiff(p.solve(xc, lo, hi), e), 1e-5);
    bico_xcov_free(xc);
  }
  {
    // d_a > d_b: x_a = x_b E, so C = E^T x_b^T x_b and R = E^T.
    Mat xb = bt::randn(g, n, lo);
    Data data(bt::matmul(xb, e), xb);
    bico_xcov *xc = accumulate(ctx, data, 0);
    Proc p(ctx);
    EXPECT_LT(maxdiff(p.solve(xc, hi, lo), bt::transpose(e)), 1e-5);
    bico_xcov_free(xc);
  }
}

// R maximises trace(R^T C) over matrices with orthonormal rows/columns.
// For d_a <= d_b that is min ||X_a R - X_b||_F (||X_a R|| is then constant);
// for d_a > d_b it is min ||X_a - X_b R^T||_F (||X_b R^T|| is constant).
TEST(ProcrustesTest, BeatsRandomCandidates) {
  bt::Ctx ctx;
  bt::Rng g(14);
  const size_t shapes[][2] = {{3, 3}, {4, 4}, {3, 5}, {5, 3}, {2, 2}};
  for (auto &s : shapes) {
    const size_t da = s[0], db = s[1];
    Data data(bt::randn(g, 20, da), bt::randn(g, 20, db));
    bico_xcov *xc = accumulate(ctx, data, 0);
    Proc p(ctx);
    Mat r = p.solve(xc, da, db);
    Mat c = bt::matmul(bt::transpose(data.a), data.b);
    auto trace = [&](const Mat &m) {
      double t = 0;
      for (size_t i = 0; i < m.v.size(); i++) t += m.v[i] * c.v[i];
      return t;
    };
    auto loss = [&](const Mat &m) {
      return da <= db ? bt::fro(bt::sub(bt::matmul(data.a, m), data.b))
                      : bt::fro(bt::sub(data.a, bt::matmul(data.b, bt::transpose(m))));
    };
    const double tr = trace(r), lr = loss(r), scale = bt::fro(c);
    int strictly_better = 0;
    for (int k = 0; k < 200; k++) {
      Mat cand;
      if (da == db) cand = bt::rand_orth(g, da);
      else if (da < db) cand = rows_of(bt::rand_orth(g, db), da);
      else cand = bt::transpose(rows_of(bt::rand_orth(g, da), db));
      ASSERT_LT(semi_orth_err(cand), 1e-12);
      EXPECT_GE(tr, trace(cand) - 1e-5 * scale);
      EXPECT_LE(lr, loss(cand) * (1 + 1e-5));
      if (lr < loss(cand) * (1 - 1e-3)) strictly_better++;
    }
    EXPECT_GT(strictly_better, 150) << da << "x" << db;
    bico_xcov_free(xc);
  }
}

// For C = [[a, b], [c, d]], trace(R^T C) over rotations
// R = [[cos t, -sin t], [sin t, cos t]] is (a + d) cos t + (c - b) sin t,
// maximal at t = atan2(c - b, a + d) (equivalently, R = [[cos s, sin s],
// [-sin s, cos s]] with s = atan2(b - c, a + d)); it is the optimum over all
// orthogonal R when det C > 0.  Over reflections [[cos t, sin t],
// [sin t, -cos t]] the trace is (a - d) cos t + (b + c) sin t, maximal at
// t = atan2(b + c, a - d): the optimum when det C < 0.
TEST(ProcrustesTest, ClosedForm2x2) {
  bt::Ctx ctx;
  bt::Rng g(15);
  Proc p(ctx);
  int rotations = 0, reflections = 0;
  for (int trial = 0; trial < 40; trial++) {
    Mat c = bt::randn(g, 2, 2);
    const double a = c(0, 0), b = c(0, 1), cc = c(1, 0), d = c(1, 1);
    const double det = a * d - b * cc;
    if (std::fabs(det) < 1e-3) continue;
    Mat expect(2, 2);
    if (det > 0) {
      double t = std::atan2(cc - b, a + d);
      expect(0, 0) = std::cos(t), expect(0, 1) = -std::sin(t);
      expect(1, 0) = std::sin(t), expect(1, 1) = std::cos(t);
      double s = std::atan2(b - cc, a + d);  // the transposed convention
      EXPECT_NEAR(expect(0, 1), std::sin(s), 1e-12);
      rotations++;
    } else {
      double t = std::atan2(b + cc, a - d);
      expect(0, 0) = std::cos(t), expect(0, 1) = std::sin(t);
      expect(1, 0) = std::sin(t), expect(1, 1) = -std::cos(t);
      reflections++;
    }
    size_t rank = 0;
    Mat r = p.solve_matrix(c, &rank);
    EXPECT_LT(maxdiff(r, expect), 1e-6) << "det " << det;
    EXPECT_EQ(rank, size_t(2));
  }
  EXPECT_GT(rotations, 5);
  EXPECT_GT(reflections, 5);
}

TEST(ProcrustesTest, RankDeficientKeepAndDrop) {
  bt::Ctx ctx;
  bt::Rng g(16);
  {
    // n = 3 rows in 6 dimensions, planted rotation: only a 3-d subspace is
    // identified, and there both completions reproduce x_b.
    const size_t n = 3, d = 6;
    Mat q = bt::rand_orth(g, d);
    Mat xa = bt::randn(g, n, d);
    Data data(xa, bt::matmul(xa, q));
    bico_xcov *xc = accumulate(ctx, data, 0);
    Proc keep(ctx), drop(ctx);
    drop.set(BICO_PROC_NULL, BICO_NULL_DROP);
    size_t rk = 0, rd = 0;
    Mat r_keep = keep.solve(xc, d, d, &rk), r_drop = drop.solve(xc, d, d, &rd);
    EXPECT_EQ(rk, n);
    EXPECT_EQ(rd, n);
    EXPECT_LT(semi_orth_err(r_keep), 1e-5);
    Mat rrr = bt::matmul(bt::matmul(r_drop, bt::transpose(r_drop)), r_drop);
    EXPECT_LT(maxdiff(rrr, r_drop), 1e-5);
    EXPECT_NEAR(bt::fro(r_drop) * bt::fro(r_drop), double(n), 1e-5);
    EXPECT_LT(bt::relerr(bt::matmul(data.a, r_keep), data.b), 1e-5);
    EXPECT_LT(bt::relerr(bt::matmul(data.a, r_drop), data.b), 1e-5);
    // The drop map is zero on the unidentified directions (orthogonal to
    // the rows of x_a); both maps agree on the identified ones.
    Mat proj = bt::matmul(bt::transpose(data.a),
                          bt::matmul(sym_pow(bt::matmul(data.a, bt::transpose(data.a)), -1.0, 0.0),
                                     data.a));  // projector onto rowspace(x_a)
    Mat perp = bt::sub(bt::eye(d, d), proj);
    EXPECT_LT(maxabs(bt::matmul(perp, r_drop)), 1e-5);
    EXPECT_LT(maxdiff(bt::matmul(proj, r_keep), r_drop), 1e-5);
    // The spectrum shows the gap.
    std::vector<double> s = keep.spectrum();
    ASSERT_EQ(s.size(), d);
    EXPECT_LT(s[n], 1e-5 * s[0]);
    EXPECT_GT(s[n - 1], 1e-3 * s[0]);
    bico_xcov_free(xc);
  }
  {
    // Rectangular, both ways, with unrelated x_b.
    const size_t shapes[][2] = {{5, 4}, {4, 5}};
    for (auto &sh : shapes) {
      const size_t n = 2, da = sh[0], db = sh[1];
      Data data(bt::randn(g, n, da), bt::randn(g, n, db));
      bico_xcov *xc = accumulate(ctx, data, 0);
      Proc keep(ctx), drop(ctx);
      drop.set(BICO_PROC_NULL, BICO_NULL_DROP);
      size_t rk = 0, rd = 0;
      Mat r_keep = keep.solve(xc, da, db, &rk), r_drop = drop.solve(xc, da, db, &rd);
      EXPECT_EQ(rk, n);
      EXPECT_EQ(rd, n);
      EXPECT_LT(semi_orth_err(r_keep), 1e-5);
      Mat rrr = bt::matmul(bt::matmul(r_drop, bt::transpose(r_drop)), r_drop);
      EXPECT_LT(maxdiff(rrr, r_drop), 1e-5);
      EXPECT_NEAR(bt::fro(r_drop) * bt::fro(r_drop), double(n), 1e-5);
      EXPECT_LT(maxdiff(bt::matmul(data.a, r_keep), bt::matmul(data.a, r_drop)),
                1e-5 * maxabs(data.a));
      bico_xcov_free(xc);
    }
  }
}

TEST(ProcrustesTest, ZeroStatistic) {
  bt::Ctx ctx;
  const size_t shapes[][2] = {{3, 5}, {5, 3}, {4, 4}};
  for (auto &s : shapes) {
    const size_t da = s[0], db = s[1];
    bico_xcov *xc = nullptr;
    ASSERT_EQ(bico_xcov_create(ctx, da, db, 0, &xc), BICO_OK);
    std::vector<float> za(10 * da, 0.0f), zb(10 * db, 0.0f);  // zero rows
    ASSERT_EQ(bico_xcov_add(xc, 10, za.data(), da, zb.data(), db), BICO_OK);
    Proc keep(ctx), drop(ctx);
    drop.set(BICO_PROC_NULL, BICO_NULL_DROP);
    size_t rk = 9, rd = 9;
    Mat r_keep = keep.solve(xc, da, db, &rk), r_drop = drop.solve(xc, da, db, &rd);
    EXPECT_EQ(rk, size_t(0));
    EXPECT_EQ(rd, size_t(0));
    EXPECT_TRUE(all_finite(r_keep));
    EXPECT_TRUE(all_finite(r_drop));
    EXPECT_EQ(maxdiff(r_keep, bt::eye(da, db)), 0.0);
    EXPECT_EQ(maxabs(r_drop), 0.0);
    std::vector<double> sp = keep.spectrum();
    EXPECT_EQ(sp.size(), std::min(da, db));
    for (double x : sp) EXPECT_EQ(x, 0.0);
    // The same from a matrix given directly, and from an empty accumulator.
    Mat zero(da, db);
    size_t rm = 9;
    EXPECT_EQ(maxdiff(keep.solve_matrix(zero, &rm), bt::eye(da, db)), 0.0);
    EXPECT_EQ(rm, size_t(0));
    bico_xcov *empty = nullptr;
    ASSERT_EQ(bico_xcov_create(ctx, da, db, 3, &empty), BICO_OK);
    keep.set(BICO_PROC_CENTER, 1);
    keep.set(BICO_PROC_WHITEN, 0.5);
    EXPECT_EQ(maxdiff(keep.solve(empty, da, db, &rm), bt::eye(da, db)), 0.0);
    EXPECT_EQ(rm, size_t(0));
    bico_xcov_free(empty);
    bico_xcov_free(xc);
  }
}

TEST(ProcrustesTest, RankTolerance) {
  bt::Ctx ctx;
  bt::Rng g(17);
  const size_t d = 4;
  const double sv[d] = {1.0, 1e-3, 1e-7, 1e-12};
  Mat u = bt::rand_orth(g, d), v = bt::rand_orth(g, d), s(d, d);
  for (size_t i = 0; i < d; i++) s(i, i) = sv[i];
  Mat c = bt::matmul(bt::matmul(u, s), bt::transpose(v));
  Proc p(ctx);
  const struct { double tol; size_t rank; } cases[] = {
      {-1, 2} /* default 1e-5 */, {1e-2, 1}, {1e-5, 2}, {1e-10, 3}, {0.0, 4}};
  for (auto &cs : cases) {
    if (cs.tol >= 0) p.set(BICO_PROC_RANK_TOL, cs.tol);
    size_t rank = 99;
    p.solve_matrix(c, &rank);
    EXPECT_EQ(rank, cs.rank) << "tol " << cs.tol;
  }
  std::vector<double> got = p.spectrum();
  ASSERT_EQ(got.size(), d);
  for (size_t i = 0; i < d; i++) EXPECT_NEAR(got[i], sv[i], 1e-14) << i;
  // A singular value that is exactly zero never counts, even with tol = 0
  // (s_i > tol * s_max is strict).
  Mat diag(3, 3);
  diag(0, 0) = 3, diag(1, 1) = -1;
  size_t rank = 99;
  p.set(BICO_PROC_RANK_TOL, 0.0);
  p.solve_matrix(diag, &rank);
  EXPECT_EQ(rank, size_t(2));
  ASSERT_EQ(p.spectrum().size(), size_t(3));
  EXPECT_EQ(p.spectrum()[2], 0.0);
}

TEST(ProcrustesTest, CenteringRemovesPlantedOffsets) {
  bt::Ctx ctx;
  bt::Rng g(18);
  const size_t n = 300, d = 5;
  Mat q = bt::rand_orth(g, d);
  Mat z = bt::randn(g, n, d);
  Mat xb = bt::matmul(z, q);
  Mat xa = z;
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < d; j++) {
      xa(i, j) += 4.0 + j;       // mu_a
      xb(i, j) += 3.0 - 2.0 * j; // mu_b
    }
  Data data(xa, xb);
  bico_xcov *xc = accumulate(ctx, data, BICO_XCOV_SUMS);
  Proc p(ctx);
  Mat r_raw = p.solve(xc, d, d);
  p.set(BICO_PROC_CENTER, 1);
  Mat r_cen = p.solve(xc, d, d);
  // Centered rows satisfy x_b - mu_b = (x_a - mu_a) Q exactly (up to float
  // rounding of the inputs): the centered map is Q, the raw one is not.
  EXPECT_LT(maxdiff(r_cen, q), 1e-4);
  EXPECT_GT(maxdiff(r_raw, q), 1e-2);
  // And it equals the map of an independently centered statistic.
  Mat ca = data.a, cb = data.b;
  for (size_t j = 0; j < d; j++) {
    double ma = 0, mb = 0;
    for (size_t i = 0; i < n; i++) ma += ca(i, j), mb += cb(i, j);
    ma /= n, mb /= n;
    for (size_t i = 0; i < n; i++) ca(i, j) -= ma, cb(i, j) -= mb;
  }
  Mat cc = bt::matmul(bt::transpose(ca), cb);
  EXPECT_LT(maxdiff(r_cen, ref_polar(cc)), 1e-5);
  std::vector<double> s = p.spectrum(), ref = ref_singular(cc);
  for (size_t i = 0; i < d; i++) EXPECT_NEAR(s[i], ref[i], 1e-8 * ref[0]);
  bico_xcov_free(xc);
}

TEST(ProcrustesTest, WhiteningMatchesIndependentComputation) {
  bt::Ctx ctx;
  bt::Rng g(19);
  const size_t n = 60;
  const size_t shapes[][2] = {{4, 3}, {3, 4}, {4, 4}};
  for (auto &sh : shapes) {
    const size_t da = sh[0], db = sh[1];
    // Correlated columns, so the Grams are far from a multiple of I.
    Mat xa = bt::matmul(bt::randn(g, n, da), bt::randn(g, da, da));
    Mat xb = bt::add(bt::matmul(xa, bt::randn(g, da, db)), bt::randn(g, n, db), 0.3);
    for (auto &x : xa.v) x += 0.5;  // nonzero means for the centered case
    Data data(xa, xb);
    bico_xcov *xc = accumulate(ctx, data, BICO_XCOV_SUMS | BICO_XCOV_GRAMS);
    for (int center = 0; center <= 1; center++)
      for (double pw : {0.5, 0.25}) {
        Mat a = data.a, b = data.b;
        if (center) {  // with centering the Grams are centered too
          for (Mat *m : {&a, &b})
            for (size_t j = 0; j < m->c; j++) {
              double mu = 0;
              for (size_t i = 0; i < n; i++) mu += (*m)(i, j);
              mu /= n;
              for (size_t i = 0; i < n; i++) (*m)(i, j) -= mu;
            }
        }
        Mat c = bt::matmul(bt::transpose(a), b);
        Mat wa = sym_pow(bt::matmul(bt::transpose(a), a), -pw, 1e-6);
        Mat wb = sym_pow(bt::matmul(bt::transpose(b), b), -pw, 1e-6);
        Mat k = bt::matmul(bt::matmul(wa, c), wb);
        Proc p(ctx);
        p.set(BICO_PROC_WHITEN, pw);
        p.set(BICO_PROC_CENTER, center);
        Mat r = p.solve(xc, da, db);
        EXPECT_LT(maxdiff(r, ref_polar(k)), 1e-5)
            << da << "x" << db << " p " << pw << " center " << center;
        std::vector<double> s = p.spectrum(), ref = ref_singular(k);
        ASSERT_EQ(s.size(), ref.size());
        for (size_t i = 0; i < s.size(); i++) EXPECT_NEAR(s[i], ref[i], 1e-8 * ref[0]);
      }
    bico_xcov_free(xc);
  }
}

// With p = 0.5 and x_b = x_a M (M invertible), the whitened statistic
// G_a^-1/2 G_a M (M^T G_a M)^-1/2 = W (W^T W)^-1/2 with W = G_a^1/2 M is
// itself orthogonal: every singular value is 1 and R is that matrix.  Without
// whitening the singular values spread.
TEST(ProcrustesTest, FullWhiteningOfALinearMapIsOrthogonal) {
  bt::Ctx ctx;
  bt::Rng g(20);
  const size_t n = 200, d = 5;
  Mat m = bt::add(bt::randn(g, d, d), bt::eye(d, d), 2.0);
  Mat xa = bt::matmul(bt::randn(g, n, d), bt::randn(g, d, d));
  Data data(xa, bt::matmul(xa, m));
  bico_xcov *xc = accumulate(ctx, data, BICO_XCOV_GRAMS);
  Proc p(ctx);
  p.set(BICO_PROC_WHITEN, 0.5);
  p.set(BICO_PROC_WHITEN_EPS, 1e-9);
  p.solve(xc, d, d);
  for (double s : p.spectrum()) EXPECT_NEAR(s, 1.0, 1e-4);
  Proc plain(ctx);
  plain.solve(xc, d, d);
  std::vector<double> s0 = plain.spectrum();
  EXPECT_GT(s0.front() / s0.back(), 2.0);
  bico_xcov_free(xc);
}

// A Gram matrix with an exactly zero direction and the smallest eps the
// bounds allow makes (G + eps I)^-p astronomically large: the solve may
// report BICO_E_NUMERIC, but never hands back NaN or Inf.
TEST(ProcrustesTest, ExtremeWhiteningNeverNaN) {
  bt::Ctx ctx;
  bt::Rng g(23);
  const size_t n = 40, d = 4;
  Mat xa = bt::randn(g, n, d), xb = bt::randn(g, n, d);
  for (size_t i = 0; i < n; i++) xa(i, 1) = 0.0, xb(i, 2) = 0.0;
  Data data(xa, xb);
  bico_xcov *xc = accumulate(ctx, data, BICO_XCOV_GRAMS);
  double lo, hi;
  unsigned fl;
  ASSERT_EQ(bico_procrustes_param_bounds(BICO_PROC_WHITEN_EPS, &lo, &hi, &fl), BICO_OK);
  ASSERT_TRUE(fl & BICO_PARAM_LO_OPEN);
  Proc p(ctx);
  p.set(BICO_PROC_WHITEN, 0.5);
  p.set(BICO_PROC_WHITEN_EPS, std::nextafter(lo, 1.0));  // the smallest allowed
  std::vector<float> r(d * d);
  size_t rank = 0;
  bico_status st = bico_procrustes_solve(p, xc, r.data(), d, &rank);
  if (st == BICO_OK) {
    EXPECT_TRUE(all_finite(Mat::from(r.data(), d, d, d)));
    EXPECT_LT(semi_orth_err(Mat::from(r.data(), d, d, d)), 1e-5);
  } else {
    EXPECT_EQ(st, BICO_E_NUMERIC);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "overflow")) << bico_ctx_errmsg(ctx);
  }
  bico_xcov_free(xc);
}

TEST(ProcrustesTest, SpectrumMatchesIndependentSingularValues) {
  bt::Ctx ctx;
  bt::Rng g(21);
  const size_t shapes[][2] = {{5, 3}, {3, 5}, {6, 6}, {1, 4}};
  for (auto &sh : shapes) {
    Mat c = bt::randn(g, sh[0], sh[1], 3.0);
    Proc p(ctx);
    p.solve_matrix(c);
    std::vector<double> s = p.spectrum(), ref = ref_singular(c);
    ASSERT_EQ(s.size(), std::min(sh[0], sh[1]));
    for (size_t i = 0; i < s.size(); i++) EXPECT_NEAR(s[i], ref[i], 1e-10 * ref[0]);
    // cap below the count copies a prefix and still reports the count.
    double first[1] = {-1};
    size_t count = 0;
    ASSERT_EQ(bico_procrustes_spectrum(p, first, 1, &count), BICO_OK);
    EXPECT_EQ(count, s.size());
    EXPECT_EQ(first[0], s[0]);
    // R is the polar factor of C.
    EXPECT_LT(maxdiff(p.solve_matrix(c), ref_polar(c)), 1e-5);
  }
  Proc fresh(ctx);
  EXPECT_EQ(fresh.spectrum().size(), size_t(0));
}

TEST(ProcrustesTest, Params) {
  bt::Ctx ctx;
  Proc p(ctx);
  double v = -1;
  const struct { int param; double def; } defs[] = {
      {BICO_PROC_CENTER, 0}, {BICO_PROC_WHITEN, 0}, {BICO_PROC_WHITEN_EPS, 1e-6},
      {BICO_PROC_RANK_TOL, 1e-5}, {BICO_PROC_NULL, BICO_NULL_KEEP}};
  for (auto &d : defs) {
    ASSERT_EQ(bico_procrustes_get_param(p, d.param, &v), BICO_OK);
    EXPECT_EQ(v, d.def) << d.param;
  }
  p.set(BICO_PROC_WHITEN, 0.5);
  ASSERT_EQ(bico_procrustes_get_param(p, BICO_PROC_WHITEN, &v), BICO_OK);
  EXPECT_EQ(v, 0.5);
  double lo, hi;
  unsigned fl;
  ASSERT_EQ(bico_procrustes_param_bounds(BICO_PROC_WHITEN, &lo, &hi, &fl), BICO_OK);
  EXPECT_EQ(lo, 0.0);
  EXPECT_EQ(hi, 0.5);
  EXPECT_EQ(fl, 0u);  // [0, 0.5], real
  // RANK_TOL is [0, 1): the open end is said, not approximated.
  ASSERT_EQ(bico_procrustes_param_bounds(BICO_PROC_RANK_TOL, &lo, &hi, &fl), BICO_OK);
  EXPECT_EQ(lo, 0.0);
  EXPECT_EQ(hi, 1.0);
  EXPECT_EQ(fl, unsigned(BICO_PARAM_HI_OPEN));
  // WHITEN_EPS is (0, inf).
  ASSERT_EQ(bico_procrustes_param_bounds(BICO_PROC_WHITEN_EPS, &lo, &hi, &fl), BICO_OK);
  EXPECT_EQ(lo, 0.0);
  EXPECT_TRUE(std::isinf(hi));
  EXPECT_EQ(fl, unsigned(BICO_PARAM_LO_OPEN | BICO_PARAM_HI_OPEN));
  ASSERT_EQ(bico_procrustes_param_bounds(BICO_PROC_NULL, &lo, &hi, &fl), BICO_OK);
  EXPECT_EQ(fl, unsigned(BICO_PARAM_INTEGER));
  EXPECT_EQ(bico_procrustes_param_bounds(99, &lo, &hi, &fl), BICO_E_ARG);
  EXPECT_EQ(bico_procrustes_param_bounds(BICO_PROC_NULL, nullptr, &hi, &fl), BICO_E_NULL);
  EXPECT_EQ(bico_procrustes_param_bounds(BICO_PROC_NULL, &lo, &hi, nullptr), BICO_E_NULL);
  // Every parameter: set_param accepts exactly what the bounds describe,
  // probed at and just beyond each end (an independent reading of the
  // grammar of params.h).
  for (int param = BICO_PROC_CENTER; param <= BICO_PROC_METHOD; param++) {
    ASSERT_EQ(bico_procrustes_param_bounds(param, &lo, &hi, &fl), BICO_OK);
    Proc q(ctx);
    const bool integer = fl & BICO_PARAM_INTEGER;
    const double below = integer ? lo - 1 : std::nextafter(lo, -HUGE_VAL);
    const double above = integer ? hi + 1 : std::nextafter(hi, HUGE_VAL);
    EXPECT_EQ(bico_procrustes_set_param(q, param, below), BICO_E_ARG) << param;
    if (!std::isinf(hi)) {
      EXPECT_EQ(bico_procrustes_set_param(q, param, above), BICO_E_ARG) << param;
    }
    EXPECT_EQ(bico_procrustes_set_param(q, param, lo),
              (fl & BICO_PARAM_LO_OPEN) ? BICO_E_ARG : BICO_OK) << param;
    EXPECT_EQ(bico_procrustes_set_param(q, param, hi),
              (fl & BICO_PARAM_HI_OPEN) ? BICO_E_ARG : BICO_OK) << param;
    if (fl & BICO_PARAM_LO_OPEN) {
      EXPECT_EQ(bico_procrustes_set_param(q, param, std::nextafter(lo, HUGE_VAL)), BICO_OK) << param;
    }
    if ((fl & BICO_PARAM_HI_OPEN) && !std::isinf(hi)) {
      EXPECT_EQ(bico_procrustes_set_param(q, param, std::nextafter(hi, -HUGE_VAL)), BICO_OK) << param;
    }
    if (integer && lo + 0.5 < hi) {
      EXPECT_EQ(bico_procrustes_set_param(q, param, lo + 0.5), BICO_E_ARG) << param;
    }
  }

  const struct { int param; double value; const char *needle; } bad[] = {
      {BICO_PROC_WHITEN, 0.7, "whiten = 0.7"},
      {BICO_PROC_WHITEN, -0.1, "whiten = -0.1"},
      {BICO_PROC_WHITEN, std::nan(""), "whiten = nan"},
      {BICO_PROC_WHITEN_EPS, 0.0, "whiten_eps = 0"},
      {BICO_PROC_RANK_TOL, 1.0, "rank_tol = 1 is outside [0, 1)"},
      {BICO_PROC_RANK_TOL, -1e-3, "rank_tol"},
      {BICO_PROC_CENTER, 2, "center = 2"},
      {BICO_PROC_CENTER, 0.5, "(integers)"},
      {BICO_PROC_NULL, 3, "null = 3"},
      {77, 0, "unknown parameter 77"}};
  for (auto &b : bad) {
    EXPECT_EQ(bico_procrustes_set_param(p, b.param, b.value), BICO_E_ARG) << b.needle;
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), b.needle)) << bico_ctx_errmsg(ctx);
  }
  // Rejected values leave the setting alone.
  ASSERT_EQ(bico_procrustes_get_param(p, BICO_PROC_WHITEN, &v), BICO_OK);
  EXPECT_EQ(v, 0.5);
  EXPECT_EQ(bico_procrustes_get_param(p, 77, &v), BICO_E_ARG);
  EXPECT_EQ(bico_procrustes_get_param(p, BICO_PROC_NULL, nullptr), BICO_E_NULL);
  EXPECT_EQ(bico_procrustes_get_param(nullptr, BICO_PROC_NULL, &v), BICO_E_NULL);
  EXPECT_EQ(bico_procrustes_set_param(nullptr, BICO_PROC_NULL, 0), BICO_E_NULL);
}

TEST(ProcrustesTest, Errors) {
  bt::Ctx ctx;
  bico_procrustes *raw = nullptr;
  EXPECT_EQ(bico_procrustes_create(nullptr, &raw), BICO_E_NULL);
  EXPECT_EQ(bico_procrustes_create(ctx, nullptr), BICO_E_NULL);
  bico_procrustes_free(nullptr);
  Proc p(ctx);
  bico_xcov *plain = nullptr, *sums = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, 3, 4, 0, &plain), BICO_OK);
  ASSERT_EQ(bico_xcov_create(ctx, 3, 4, BICO_XCOV_SUMS, &sums), BICO_OK);
  std::vector<float> r(3 * 4);
  std::vector<double> c(3 * 4, 1.0);
  size_t rank;
  EXPECT_EQ(bico_procrustes_solve(nullptr, plain, r.data(), 4, &rank), BICO_E_NULL);
  EXPECT_EQ(bico_procrustes_solve(p, nullptr, r.data(), 4, &rank), BICO_E_NULL);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "xc is NULL"));
  EXPECT_EQ(bico_procrustes_solve(p, plain, nullptr, 4, &rank), BICO_E_NULL);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "r is NULL"));
  EXPECT_EQ(bico_procrustes_solve(p, plain, r.data(), 3, &rank), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "ld_r = 3")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_procrustes_solve(p, plain, r.data(), 4, nullptr), BICO_OK);  // rank optional

  EXPECT_EQ(bico_procrustes_solve_matrix(p, 0, 4, c.data(), 4, r.data(), 4, &rank),
            BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "d_a = 0"));
  EXPECT_EQ(bico_procrustes_solve_matrix(p, 3, 0, c.data(), 4, r.data(), 4, &rank),
            BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "d_b = 0"));
  EXPECT_EQ(bico_procrustes_solve_matrix(p, 3, 4, c.data(), 2, r.data(), 4, &rank),
            BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "ld_c = 2"));
  EXPECT_EQ(bico_procrustes_solve_matrix(p, 3, 4, c.data(), 4, r.data(), 1, &rank),
            BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "ld_r = 1"));
  EXPECT_EQ(bico_procrustes_solve_matrix(p, 3, 4, nullptr, 4, r.data(), 4, &rank),
            BICO_E_NULL);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "c is NULL"));
  c[6] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(bico_procrustes_solve_matrix(p, 3, 4, c.data(), 4, r.data(), 4, &rank),
            BICO_E_NONFINITE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "NaN at row 1, column 2"));
  c[6] = 1.0;

  p.set(BICO_PROC_CENTER, 1);
  EXPECT_EQ(bico_procrustes_solve(p, plain, r.data(), 4, &rank), BICO_E_STATE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "BICO_XCOV_SUMS")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_procrustes_solve_matrix(p, 3, 4, c.data(), 4, r.data(), 4, &rank),
            BICO_E_STATE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "BICO_PROC_CENTER"));
  EXPECT_EQ(bico_procrustes_solve(p, sums, r.data(), 4, &rank), BICO_OK);
  p.set(BICO_PROC_CENTER, 0);
  p.set(BICO_PROC_WHITEN, 0.5);
  EXPECT_EQ(bico_procrustes_solve(p, sums, r.data(), 4, &rank), BICO_E_STATE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "BICO_XCOV_GRAMS")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_procrustes_solve_matrix(p, 3, 4, c.data(), 4, r.data(), 4, &rank),
            BICO_E_STATE);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "BICO_PROC_WHITEN"));

  double s[2];
  size_t count;
  EXPECT_EQ(bico_procrustes_spectrum(nullptr, s, 2, &count), BICO_E_NULL);
  EXPECT_EQ(bico_procrustes_spectrum(p, s, 2, nullptr), BICO_E_NULL);
  EXPECT_EQ(bico_procrustes_spectrum(p, nullptr, 2, &count), BICO_E_NULL);
  bico_xcov_free(plain);
  bico_xcov_free(sums);
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

TEST(ProcrustesTest, EveryAllocationThroughTheContext) {
  Counting cnt;
  bico_ctx *ctx = nullptr;
  ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, count_alloc, count_free, &cnt),
            BICO_OK);
  bt::Rng g(22);
  Data data(bt::randn(g, 30, 5), bt::randn(g, 30, 4));
  bico_xcov *xc = accumulate(ctx, data, 3);
  bico_procrustes *p = nullptr;
  ASSERT_EQ(bico_procrustes_create(ctx, &p), BICO_OK);
  ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_WHITEN, 0.5), BICO_OK);
  ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_CENTER, 1), BICO_OK);
  std::vector<float> r(5 * 4);
  const long before = cnt.total;
  ASSERT_EQ(bico_procrustes_solve(p, xc, r.data(), 4, nullptr), BICO_OK);
  EXPECT_GT(cnt.total - before, 8);  // LAPACK work arrays come from ctx
  ASSERT_EQ(bico_procrustes_solve(p, xc, r.data(), 4, nullptr), BICO_OK);
  bico_procrustes_free(p);
  bico_xcov_free(xc);
  EXPECT_EQ(cnt.live, 1);
  bico_ctx_free(ctx);
  EXPECT_EQ(cnt.live, 0);
}

namespace {
// Fails the allocation numbered `fail_at` (1-based) and every later one.
using bt::Failing;
using bt::fail_free;
const bico_alloc_fn fail_alloc = bt::fail_from_alloc;
}  // namespace

// Every allocation failure inside a solve is BICO_E_NOMEM, and that path
// frees everything it took.
TEST(ProcrustesTest, OutOfMemoryAtEveryAllocation) {
  bt::Rng g(24);
  Data data(bt::randn(g, 30, 5), bt::randn(g, 30, 4));
  bool succeeded = false;
  for (long k = 1; k < 200 && !succeeded; k++) {
    Failing f;
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
    bico_xcov *xc = accumulate(ctx, data, 3);
    bico_procrustes *p = nullptr;
    ASSERT_EQ(bico_procrustes_create(ctx, &p), BICO_OK);
    ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_WHITEN, 0.5), BICO_OK);
    const long base_live = f.live;
    f.fail_at = f.count + k;
    std::vector<float> r(5 * 4);
    bico_status st = bico_procrustes_solve(p, xc, r.data(), 4, nullptr);
    if (st == BICO_OK) {
      succeeded = true;
      EXPECT_EQ(f.live, base_live + 1);  // the stored spectrum
    } else {
      EXPECT_EQ(st, BICO_E_NOMEM) << "allocation " << k;
      EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "out of memory")) << bico_ctx_errmsg(ctx);
      EXPECT_EQ(f.live, base_live) << "leak when allocation " << k << " fails";
    }
    f.fail_at = 0;
    bico_procrustes_free(p);
    bico_xcov_free(xc);
    EXPECT_EQ(f.live, 1);
    bico_ctx_free(ctx);
  }
  EXPECT_TRUE(succeeded);
}
