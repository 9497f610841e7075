// Thin solves (bico_procrustes_solve_rows): against an independent
// reference written here (C formed in plain double, the partial isometry
// C (C^T C)^{+1/2} through a Jacobi eigensolver: no LAPACK, BLIS or
// libbico), against the full solve, planted rotations, rank-deficient
// rows, the n == d edge and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

using bt::Mat;

namespace {

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
    if (off == 0 || off <= 1e-30 * all) break;
    for (size_t p = 0; p + 1 < n; p++)
      for (size_t q = p + 1; q < n; q++) {
        if (a(p, q) == 0) continue;
        double tau = (a(q, q) - a(p, p)) / (2 * a(p, q));
        double t = (tau >= 0 ? 1.0 : -1.0) /
                   (std::fabs(tau) + std::sqrt(1 + tau * tau));
        double c = 1 / std::sqrt(1 + t * t), s = t * c;
        for (size_t k = 0; k < n; k++) {
          double akp = a(k, p), akq = a(k, q);
          a(k, p) = c * akp - s * akq;
          a(k, q) = s * akp + c * akq;
        }
        for (size_t k = 0; k < n; k++) {
          double apk = a(p, k), aqk = a(q, k);
          a(p, k) = c * apk - s * aqk;
          a(q, k) = s * apk + c * aqk;
        }
        for (size_t k = 0; k < n; k++) {
          double vkp = v(k, p), vkq = v(k, q);
          v(k, p) = c * vkp - s * vkq;
          v(k, q) = s * vkp + c * vkq;
        }
      }
  }
  w.resize(n);
  for (size_t i = 0; i < n; i++) w[i] = a(i, i);
}

// The partial isometry U_k V_k^T of c (singular values above rel * s_max)
// as c (c^T c)^{+1/2}; *rank receives k.
Mat partial_isometry(const Mat &c, double rel, size_t *rank) {
  std::vector<double> w;
  Mat v;
  jacobi(bt::matmul(bt::transpose(c), c), w, v);
  double wmax = 0;
  for (double x : w) wmax = std::max(wmax, x);
  Mat p(c.c, c.c);
  size_t k = 0;
  for (size_t i = 0; i < w.size(); i++) {
    if (!(w[i] > rel * rel * wmax)) continue;
    k++;
    const double f = 1 / std::sqrt(w[i]);
    for (size_t a = 0; a < c.c; a++)
      for (size_t b = 0; b < c.c; b++) p(a, b) += f * v(a, i) * v(b, i);
  }
  *rank = k;
  return bt::matmul(c, p);
}

struct Solver {
  bico_ctx *ctx = nullptr;
  bico_procrustes *p = nullptr;
  explicit Solver(int null_mode, int center = 0) {
    EXPECT_EQ(bico_ctx_create(&ctx), BICO_OK);
    EXPECT_EQ(bico_procrustes_create(ctx, &p), BICO_OK);
    EXPECT_EQ(bico_procrustes_set_param(p, BICO_PROC_NULL, null_mode), BICO_OK);
    EXPECT_EQ(bico_procrustes_set_param(p, BICO_PROC_CENTER, center), BICO_OK);
  }
  ~Solver() {
    bico_procrustes_free(p);
    bico_ctx_free(ctx);
  }
  // Thin (or full, as the rows decide) solve from rows; *thin the route.
  Mat rows(const Mat &xa, const Mat &xb, size_t *rank, int *thin) {
    std::vector<float> a = xa.f32(), b = xb.f32(), r(xa.c * xb.c);
    bico_status st = bico_procrustes_solve_rows(p, xa.r, xa.c, xb.c, a.data(),
                                                xa.c, b.data(), xb.c, r.data(),
                                                xb.c, rank, thin);
    EXPECT_EQ(st, BICO_OK) << bico_ctx_errmsg(ctx);
    return Mat::from(r.data(), xa.c, xb.c, xb.c);
  }
  // The full solve of the statistic c (SVD route).
  Mat full(const Mat &c, size_t *rank) {
    EXPECT_EQ(bico_procrustes_set_param(p, BICO_PROC_METHOD, BICO_PROC_SVD),
              BICO_OK);
    std::vector<float> r(c.r * c.c);
    EXPECT_EQ(bico_procrustes_solve_matrix(p, c.r, c.c, c.v.data(), c.c,
                                           r.data(), c.c, rank),
              BICO_OK)
        << bico_ctx_errmsg(ctx);
    return Mat::from(r.data(), c.r, c.c, c.c);
  }
};

// The rows as float would give them (the solver reads float rows).
Mat f32(const Mat &m) {
  Mat o = m;
  for (auto &x : o.v) x = (double)(float)x;
  return o;
}

Mat xcov(const Mat &xa, const Mat &xb) {
  return bt::matmul(bt::transpose(xa), xb);
}

// ||R R^T - I|| (d_a <= d_b) or ||R^T R - I||.
double orth_err(const Mat &r) {
  Mat g = r.r <= r.c ? bt::matmul(r, bt::transpose(r))
                     : bt::matmul(bt::transpose(r), r);
  return bt::fro(bt::sub(g, bt::eye(g.r, g.c)));
}

}  // namespace

struct Shape {
  size_t n, da, db;
};

// DROP: the thin solve equals the independent partial isometry and the
// full solve, with the same rank (n for generic rows) and spectrum.
TEST(ThinSolveTest, DropAgreesWithReferenceAndFullSolve) {
  const Shape shapes[] = {{5, 12, 20}, {7, 30, 9}, {10, 16, 16}, {1, 6, 4}};
  bt::Rng g(17);
  for (const Shape &s : shapes) {
    Mat xa = f32(bt::randn(g, s.n, s.da)), xb = f32(bt::randn(g, s.n, s.db));
    Mat c = xcov(xa, xb);
    size_t kref = 0, kthin = 0, kfull = 0;
    Mat ref = partial_isometry(c, 1e-5, &kref);
    Solver sv(BICO_NULL_DROP);
    int thin = -1;
    Mat rt = sv.rows(xa, xb, &kthin, &thin);
    EXPECT_EQ(thin, 1);
    EXPECT_EQ(kthin, s.n);
    EXPECT_EQ(kref, s.n);
    EXPECT_LT(bt::relerr(rt, ref), 1e-5) << s.n << " " << s.da << " " << s.db;
    std::vector<double> spec_thin(s.da < s.db ? s.da : s.db), spec_full(spec_thin.size());
    size_t cnt = 0;
    ASSERT_EQ(bico_procrustes_spectrum(sv.p, spec_thin.data(), spec_thin.size(), &cnt), BICO_OK);
    EXPECT_EQ(cnt, spec_thin.size());
    Mat rf = sv.full(c, &kfull);
    EXPECT_EQ(kfull, kthin);
    EXPECT_LT(bt::relerr(rt, rf), 1e-5);
    ASSERT_EQ(bico_procrustes_spectrum(sv.p, spec_full.data(), spec_full.size(), &cnt), BICO_OK);
    for (size_t i = 0; i < spec_full.size(); i++)
      EXPECT_NEAR(spec_thin[i], spec_full[i], 1e-9 * spec_full[0] + 1e-12) << i;
  }
}

// KEEP: a different completion of the unidentified part than LAPACK's, so
// compare what is identified (R C^T = U S U^T and C^T R = V S V^T for every
// maximiser), semi-orthogonality and the objective trace(R^T C) = sum(S).
TEST(ThinSolveTest, KeepIdentifiedPartMatchesAndIsSemiOrthogonal) {
  const Shape shapes[] = {{6, 14, 22}, {8, 25, 11}, {9, 13, 13}};
  bt::Rng g(5);
  for (const Shape &s : shapes) {
    Mat xa = f32(bt::randn(g, s.n, s.da)), xb = f32(bt::randn(g, s.n, s.db));
    Mat c = xcov(xa, xb);
    Solver sv(BICO_NULL_KEEP);
    size_t kt = 0, kf = 0;
    int thin = -1;
    Mat rt = sv.rows(xa, xb, &kt, &thin);
    Mat rf = sv.full(c, &kf);
    EXPECT_EQ(thin, 1);
    EXPECT_EQ(kt, kf);
    EXPECT_LT(orth_err(rt), 1e-5);
    Mat ct = bt::transpose(c);
    EXPECT_LT(bt::relerr(bt::matmul(rt, ct), bt::matmul(rf, ct)), 1e-5);
    EXPECT_LT(bt::relerr(bt::matmul(ct, rt), bt::matmul(ct, rf)), 1e-5);
    double tt = 0, tf = 0;
    for (size_t i = 0; i < c.v.size(); i++) {
      tt += rt.v[i] * c.v[i];
      tf += rf.v[i] * c.v[i];
    }
    EXPECT_NEAR(tt, tf, 1e-5 * tf);
    // The completion is not the zero map: R has rank min(d_a, d_b).
    EXPECT_GT(bt::fro(bt::sub(rt, partial_isometry(c, 1e-5, &kt))), 1.0);
  }
}

// Planted: x_b = x_a Q (Q orthogonal): the thin map reproduces x_b from
// x_a on the calibration rows (x_a R = x_b) in both completions.
TEST(ThinSolveTest, PlantedRotationOnTheRows) {
  bt::Rng g(9);
  const size_t n = 7, d = 24;
  Mat xa = f32(bt::randn(g, n, d));
  Mat q = bt::rand_orth(g, d);
  Mat xb = bt::matmul(xa, q);
  for (int mode : {BICO_NULL_KEEP, BICO_NULL_DROP}) {
    Solver sv(mode);
    size_t k = 0;
    int thin = -1;
    Mat r = sv.rows(xa, f32(xb), &k, &thin);
    EXPECT_EQ(thin, 1);
    EXPECT_EQ(k, n);
    EXPECT_LT(bt::relerr(bt::matmul(xa, r), xb), 1e-5) << mode;
  }
}

// Rows of rank 3 < n: the rank is 3 and DROP still equals the reference.
TEST(ThinSolveTest, RankDeficientRows) {
  bt::Rng g(23);
  const size_t n = 8, da = 20, db = 15, rk = 3;
  Mat xa = f32(bt::matmul(bt::randn(g, n, rk), bt::randn(g, rk, da)));
  Mat xb = f32(bt::randn(g, n, db));
  Mat c = xcov(xa, xb);
  size_t kref = 0, kt = 0, kf = 0;
  Mat ref = partial_isometry(c, 1e-5, &kref);
  Solver sv(BICO_NULL_DROP);
  int thin = -1;
  Mat rt = sv.rows(xa, xb, &kt, &thin);
  EXPECT_EQ(thin, 1);
  EXPECT_EQ(kref, rk);
  EXPECT_EQ(kt, rk);
  EXPECT_LT(bt::relerr(rt, ref), 1e-4);
  Mat rf = sv.full(c, &kf);
  EXPECT_EQ(kf, rk);
  EXPECT_LT(bt::relerr(rt, rf), 1e-4);
  // KEEP stays semi-orthogonal around a rank-deficient core.
  Solver sk(BICO_NULL_KEEP);
  Mat rk_keep = sk.rows(xa, xb, &kt, &thin);
  EXPECT_EQ(kt, rk);
  EXPECT_LT(orth_err(rk_keep), 1e-5);
}

// n == d: still thin; with n == d_a == d_b the statistic is square and
// full rank, R is unique and KEEP equals the full solve entirely.  One row
// more than the smaller width takes the full route, with the same map.
TEST(ThinSolveTest, RowsEqualWidthEdge) {
  bt::Rng g(31);
  {
    const size_t n = 12;
    Mat xa = f32(bt::randn(g, n, n)), xb = f32(bt::randn(g, n, n));
    Solver sv(BICO_NULL_KEEP);
    size_t kt = 0, kf = 0;
    int thin = -1;
    Mat rt = sv.rows(xa, xb, &kt, &thin);
    EXPECT_EQ(thin, 1);
    Mat rf = sv.full(xcov(xa, xb), &kf);
    EXPECT_EQ(kt, n);
    EXPECT_LT(bt::relerr(rt, rf), 1e-5);
  }
  {
    const size_t n = 10, da = 10, db = 17;
    Mat xa = f32(bt::randn(g, n, da)), xb = f32(bt::randn(g, n, db));
    Solver sv(BICO_NULL_KEEP);
    size_t kt = 0, kf = 0;
    int thin = -1;
    Mat rt = sv.rows(xa, xb, &kt, &thin);
    EXPECT_EQ(thin, 1);
    Mat rf = sv.full(xcov(xa, xb), &kf);
    EXPECT_LT(bt::relerr(rt, rf), 1e-5); // d_a rows identified: unique
  }
  {
    const size_t n = 11, da = 10, db = 17;
    Mat xa = f32(bt::randn(g, n, da)), xb = f32(bt::randn(g, n, db));
    Solver sv(BICO_NULL_DROP);
    size_t kt = 0, kf = 0;
    int thin = -1;
    Mat rt = sv.rows(xa, xb, &kt, &thin);
    EXPECT_EQ(thin, 0);
    size_t kref = 0;
    EXPECT_LT(bt::relerr(rt, partial_isometry(xcov(xa, xb), 1e-5, &kref)), 1e-5);
    Mat rf = sv.full(xcov(xa, xb), &kf);
    EXPECT_EQ(kt, kf);
  }
}

// Centering: the thin solve of centered rows equals the centered statistic's
// reference (rank n - 1: the centered rows sum to zero).
TEST(ThinSolveTest, CenteredRows) {
  bt::Rng g(41);
  const size_t n = 6, da = 15, db = 18;
  Mat xa = f32(bt::randn(g, n, da)), xb = f32(bt::randn(g, n, db));
  Mat ca = xa, cb = xb;
  for (Mat *m : {&ca, &cb})
    for (size_t j = 0; j < m->c; j++) {
      double s = 0;
      for (size_t i = 0; i < n; i++) s += (*m)(i, j);
      for (size_t i = 0; i < n; i++) (*m)(i, j) -= s / n;
    }
  size_t kref = 0, kt = 0;
  Mat ref = partial_isometry(xcov(ca, cb), 1e-5, &kref);
  Solver sv(BICO_NULL_DROP, 1);
  int thin = -1;
  Mat rt = sv.rows(xa, xb, &kt, &thin);
  EXPECT_EQ(thin, 1);
  EXPECT_EQ(kref, n - 1);
  EXPECT_EQ(kt, n - 1);
  EXPECT_LT(bt::relerr(rt, ref), 1e-4);
}

// No rows: the zero statistic (rank 0; KEEP the rectangular identity, DROP
// zero), as the full solve gives it.
TEST(ThinSolveTest, NoRows) {
  std::vector<float> r(4 * 6, 7.0f);
  for (int mode : {BICO_NULL_KEEP, BICO_NULL_DROP}) {
    Solver sv(mode);
    size_t k = 99;
    int thin = -1;
    ASSERT_EQ(bico_procrustes_solve_rows(sv.p, 0, 4, 6, nullptr, 4, nullptr, 6,
                                         r.data(), 6, &k, &thin),
              BICO_OK);
    EXPECT_EQ(k, 0u);
    for (size_t i = 0; i < 4; i++)
      for (size_t j = 0; j < 6; j++)
        EXPECT_EQ(r[i * 6 + j], mode == BICO_NULL_KEEP && i == j ? 1.0f : 0.0f);
  }
}

TEST(ThinSolveTest, BadInput) {
  Solver sv(BICO_NULL_KEEP);
  std::vector<float> a(3 * 5, 1.0f), b(3 * 6, 1.0f), r(5 * 6);
  size_t k;
  EXPECT_EQ(bico_procrustes_solve_rows(nullptr, 3, 5, 6, a.data(), 5, b.data(),
                                       6, r.data(), 6, &k, nullptr),
            BICO_E_NULL);
  EXPECT_EQ(bico_procrustes_solve_rows(sv.p, 3, 5, 6, nullptr, 5, b.data(), 6,
                                       r.data(), 6, &k, nullptr),
            BICO_E_NULL);
  EXPECT_EQ(bico_procrustes_solve_rows(sv.p, 3, 5, 6, a.data(), 4, b.data(), 6,
                                       r.data(), 6, &k, nullptr),
            BICO_E_SHAPE);
  EXPECT_EQ(bico_procrustes_solve_rows(sv.p, 3, 0, 6, a.data(), 5, b.data(), 6,
                                       r.data(), 6, &k, nullptr),
            BICO_E_SHAPE);
  b[7] = NAN;
  EXPECT_EQ(bico_procrustes_solve_rows(sv.p, 3, 5, 6, a.data(), 5, b.data(), 6,
                                       r.data(), 6, &k, nullptr),
            BICO_E_NONFINITE);
  EXPECT_NE(std::string(bico_ctx_errmsg(sv.ctx)).find("x_b"), std::string::npos);
}
