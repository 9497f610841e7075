// Shared helpers for the GoogleTest suites: a seeded RNG, random orthogonal
// matrices and plain double-precision reference linear algebra that does not
// go through libbico, BLIS or LAPACK (so tests compare against an
// independent computation).
#ifndef BICO_TESTUTIL_H
#define BICO_TESTUTIL_H

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "bico/bico.h"

namespace bt {

// splitmix64 + Box-Muller: deterministic across platforms.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

// Row-major dense matrix of doubles.
struct Mat {
  size_t r = 0, c = 0;
  std::vector<double> v;
  Mat() = default;
  Mat(size_t rows, size_t cols) : r(rows), c(cols), v(rows * cols, 0.0) {}
  double &operator()(size_t i, size_t j) { return v[i * c + j]; }
  double operator()(size_t i, size_t j) const { return v[i * c + j]; }
  std::vector<float> f32() const { return std::vector<float>(v.begin(), v.end()); }
  static Mat from(const float *p, size_t rows, size_t cols, size_t ld) {
    Mat m(rows, cols);
    for (size_t i = 0; i < rows; i++)
      for (size_t j = 0; j < cols; j++) m(i, j) = p[i * ld + j];
    return m;
  }
};

inline Mat randn(Rng &g, size_t r, size_t c, double scale = 1.0) {
  Mat m(r, c);
  for (auto &x : m.v) x = scale * g.normal();
  return m;
}

inline Mat eye(size_t r, size_t c) {
  Mat m(r, c);
  for (size_t i = 0; i < r && i < c; i++) m(i, i) = 1.0;
  return m;
}

inline Mat matmul(const Mat &a, const Mat &b) {
  Mat m(a.r, b.c);
  for (size_t i = 0; i < a.r; i++)
    for (size_t k = 0; k < a.c; k++) {
      double x = a(i, k);
      if (x == 0.0) continue;
      for (size_t j = 0; j < b.c; j++) m(i, j) += x * b(k, j);
    }
  return m;
}

inline Mat transpose(const Mat &a) {
  Mat m(a.c, a.r);
  for (size_t i = 0; i < a.r; i++)
    for (size_t j = 0; j < a.c; j++) m(j, i) = a(i, j);
  return m;
}

inline Mat sub(const Mat &a, const Mat &b) {
  Mat m = a;
  for (size_t i = 0; i < m.v.size(); i++) m.v[i] -= b.v[i];
  return m;
}

inline Mat add(const Mat &a, const Mat &b, double sb = 1.0) {
  Mat m = a;
  for (size_t i = 0; i < m.v.size(); i++) m.v[i] += sb * b.v[i];
  return m;
}

inline double fro(const Mat &a) {
  double s = 0;
  for (double x : a.v) s += x * x;
  return std::sqrt(s);
}

// ||a - b||_F / ||b||_F (or the absolute norm when b is zero).
inline double relerr(const Mat &a, const Mat &b) {
  double nb = fro(b), nd = fro(sub(a, b));
  return nb > 0 ? nd / nb : nd;
}

// A random n x n orthogonal matrix: modified Gram-Schmidt (twice) on a
// Gaussian matrix, done here in double so the test does not rely on LAPACK.
inline Mat rand_orth(Rng &g, size_t n) {
  Mat q = randn(g, n, n);
  for (int pass = 0; pass < 2; pass++)
    for (size_t j = 0; j < n; j++) {
      for (size_t k = 0; k < j; k++) {
        double d = 0;
        for (size_t i = 0; i < n; i++) d += q(i, j) * q(i, k);
        for (size_t i = 0; i < n; i++) q(i, j) -= d * q(i, k);
      }
      double nn = 0;
      for (size_t i = 0; i < n; i++) nn += q(i, j) * q(i, j);
      nn = std::sqrt(nn);
      for (size_t i = 0; i < n; i++) q(i, j) /= nn;
    }
  return q;
}

// A random n x n permutation matrix P (P(i, perm[i]) = 1).
inline Mat rand_perm(Rng &g, size_t n) {
  std::vector<size_t> p(n);
  for (size_t i = 0; i < n; i++) p[i] = i;
  for (size_t i = n; i > 1; i--) {
    size_t j = g.next() % i;
    std::swap(p[i - 1], p[j]);
  }
  Mat m(n, n);
  for (size_t i = 0; i < n; i++) m(i, p[i]) = 1.0;
  return m;
}

// An allocator for allocation-failure sweeps through
// bico_ctx_create_with_allocator: counts allocations, fails the fail_at-th
// one (fail_once_alloc) or every one from the fail_at-th on
// (fail_from_alloc; fail_at 0 never fails), and tracks the blocks still
// live so a test can assert that every failure path freed what it took.
// The counters are atomic: a transfer with solver threads allocates from
// several threads through one allocator.
struct Failing {
  std::atomic<long> count{0}, live{0};
  long fail_at = 0;
};
inline void *fail_once_alloc(void *o, size_t n) {
  auto *f = static_cast<Failing *>(o);
  if (++f->count == f->fail_at) return nullptr;
  f->live++;
  return std::malloc(n);
}
inline void *fail_from_alloc(void *o, size_t n) {
  auto *f = static_cast<Failing *>(o);
  if (++f->count >= f->fail_at && f->fail_at > 0) return nullptr;
  f->live++;
  return std::malloc(n);
}
inline void fail_free(void *o, void *p) {
  if (p == nullptr) return;
  static_cast<Failing *>(o)->live--;
  std::free(p);
}

// RAII owner of a context for tests.
struct Ctx {
  bico_ctx *p = nullptr;
  Ctx() { bico_ctx_create(&p); }
  ~Ctx() { bico_ctx_free(p); }
  operator bico_ctx *() const { return p; }
};

// A handle's count through its bico_X_count (status, out-pointer): the
// count, or 0 with a test failure when the call does not succeed.  H is
// deduced from fn alone, so a wrapper converting to the handle passes.
template <class H>
inline size_t count(bico_status (*fn)(const H *, size_t *),
                    const typename std::common_type<H>::type *h) {
  size_t n = 0;
  bico_status st = fn(h, &n);
  EXPECT_EQ(st, BICO_OK) << bico_status_name(st);
  return st == BICO_OK ? n : 0;
}

}  // namespace bt

#endif
