// Planted-symmetry tests: the property every BiCo implementation must pass
// (METHODS.md).  B is A written in other coordinates; the test computes the
// networks' activations and output gradients itself (plain double
// arithmetic, no libbico), feeds them to the accumulators, solves the maps
// and transports A's task vector.  The answer is known in closed form:
// tau_B = Q_l tau_A Q_{l-1}^T, and theta_B + tau_B computes theta_A,ft.
#include <gtest/gtest.h>

#include <thread>

#include "testutil.h"

using namespace bt;

namespace {

enum Act { IDENTITY, RELU };

struct Net {
  std::vector<Mat> w;  // w[l]: d[l+1] x d[l]
  std::vector<Mat> b;  // b[l]: d[l+1] x 1
};

struct Trace {
  std::vector<Mat> in;    // in[l]: n x d[l], input of layer l
  std::vector<Mat> grad;  // grad[l]: n x d[l+1], dL/d(output of layer l)
  Mat y;
};

double act(Act a, double z) { return a == RELU ? (z > 0 ? z : 0) : z; }
double dact(Act a, double z) { return a == RELU ? (z > 0 ? 1 : 0) : 1; }

// Forward and backward of an MLP (activation between layers, none after the
// last) with loss 0.5 ||y - t||^2.
Trace run(const Net &net, Act a, const Mat &x, const Mat &t) {
  size_t L = net.w.size(), n = x.r;
  Trace tr;
  std::vector<Mat> z(L);
  Mat h = x;
  for (size_t l = 0; l < L; l++) {
    tr.in.push_back(h);
    z[l] = matmul(h, transpose(net.w[l]));
    for (size_t i = 0; i < n; i++)
      for (size_t j = 0; j < z[l].c; j++) z[l](i, j) += net.b[l](j, 0);
    h = z[l];
    if (l + 1 < L)
      for (auto &v : h.v) v = act(a, v);
  }
  tr.y = h;
  tr.grad.resize(L);
  Mat g = sub(tr.y, t);
  for (size_t l = L; l-- > 0;) {
    tr.grad[l] = g;
    if (l == 0) break;
    g = matmul(g, net.w[l]);
    for (size_t i = 0; i < g.v.size(); i++) g.v[i] *= dact(a, z[l - 1].v[i]);
  }
  return tr;
}

Net random_net(Rng &g, const std::vector<size_t> &d, double scale) {
  Net n;
  for (size_t l = 0; l + 1 < d.size(); l++) {
    n.w.push_back(randn(g, d[l + 1], d[l], scale / std::sqrt((double)d[l])));
    n.b.push_back(randn(g, d[l + 1], 1, 0.1 * scale));
  }
  return n;
}

Net plus(const Net &a, const Net &tau, double alpha = 1.0) {
  Net r = a;
  for (size_t l = 0; l < a.w.size(); l++) {
    r.w[l] = add(a.w[l], tau.w[l], alpha);
    r.b[l] = add(a.b[l], tau.b[l], alpha);
  }
  return r;
}

// B = A in other coordinates: W_B = Q_{l+1} W Q_l^T, b_B = Q_{l+1} b, where
// q[l] is d_B[l] x d_A[l] with orthonormal columns (an orthogonal matrix, or
// an embedding into a wider space followed by a rotation).
Net transform(const Net &a, const std::vector<Mat> &q) {
  Net r;
  for (size_t l = 0; l < a.w.size(); l++) {
    r.w.push_back(matmul(matmul(q[l + 1], a.w[l]), transpose(q[l])));
    r.b.push_back(matmul(q[l + 1], a.b[l]));
  }
  return r;
}

// Procrustes map between two n x d matrices through the public API.
Mat procrustes(bico_ctx *ctx, const Mat &xa, const Mat &xb, size_t *rank) {
  bico_xcov *xc = nullptr;
  bico_procrustes *p = nullptr;
  EXPECT_EQ(BICO_OK, bico_xcov_create(ctx, xa.c, xb.c, 0, &xc));
  auto fa = xa.f32(), fb = xb.f32();
  EXPECT_EQ(BICO_OK, bico_xcov_add(xc, xa.r, fa.data(), xa.c, fb.data(), xb.c))
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(BICO_OK, bico_procrustes_create(ctx, &p));
  std::vector<float> r(xa.c * xb.c);
  EXPECT_EQ(BICO_OK, bico_procrustes_solve(p, xc, r.data(), xb.c, rank))
      << bico_ctx_errmsg(ctx);
  bico_procrustes_free(p);
  bico_xcov_free(xc);
  return Mat::from(r.data(), xa.c, xb.c, xb.c);
}

struct Transfer {
  Net tau_b;
  std::vector<size_t> rank_in, rank_out;
  std::vector<Mat> r_in, r_out;
};

// BiCo on every layer from the traces of the two pretrained models.
Transfer bico(bico_ctx *ctx, const Net &tau, const Trace &ta, const Trace &tb) {
  Transfer t;
  for (size_t l = 0; l < tau.w.size(); l++) {
    size_t ri = 0, ro = 0;
    Mat rin = procrustes(ctx, ta.in[l], tb.in[l], &ri);
    Mat rout = procrustes(ctx, ta.grad[l], tb.grad[l], &ro);
    t.rank_in.push_back(ri);
    t.rank_out.push_back(ro);
    size_t doa = tau.w[l].r, dia = tau.w[l].c, dob = rout.c, dib = rin.c;
    auto ft = tau.w[l].f32(), fo = rout.f32(), fi = rin.f32();
    std::vector<float> out(dob * dib);
    EXPECT_EQ(BICO_OK, bico_transport_weight(ctx, doa, dia, dob, dib,
                                             1.0f, ft.data(), dia, fo.data(),
                                             dob, fi.data(), dib, 0.0f, out.data(),
                                             dib))
        << bico_ctx_errmsg(ctx);
    auto fb = tau.b[l].f32();
    std::vector<float> ob(dob);
    EXPECT_EQ(BICO_OK, bico_transport_vector(ctx, doa, dob, 1.0f,
                                             fb.data(), fo.data(), dob, 0.0f, ob.data()))
        << bico_ctx_errmsg(ctx);
    t.tau_b.w.push_back(Mat::from(out.data(), dob, dib, dib));
    t.tau_b.b.push_back(Mat::from(ob.data(), dob, 1, 1));
    t.r_in.push_back(rin);
    t.r_out.push_back(rout);
  }
  return t;
}

struct Case {
  Net a, tau, b;
  std::vector<Mat> q;
  Trace ta, tb;
};

Case make_case(uint64_t seed, Act a, const std::vector<size_t> &da,
               const std::vector<size_t> &db, bool permute, size_t n) {
  Rng g(seed);
  Case c;
  c.a = random_net(g, da, 1.0);
  c.tau = random_net(g, da, 0.2);
  // Input and output spaces are fixed by the data; hidden spaces move.
  for (size_t l = 0; l < da.size(); l++) {
    bool hidden = l > 0 && l + 1 < da.size();
    if (!hidden) {
      c.q.push_back(eye(da[l], da[l]));
      continue;
    }
    Mat rot = permute ? rand_perm(g, db[l]) : rand_orth(g, db[l]);
    c.q.push_back(matmul(rot, eye(db[l], da[l])));  // d_B x d_A, Q^T Q = I
  }
  c.b = transform(c.a, c.q);
  Mat x = randn(g, n, da.front());
  Mat t = randn(g, n, da.back());
  c.ta = run(c.a, a, x, t);
  c.tb = run(c.b, a, x, t);
  return c;
}

void expect_planted(const Case &c, const Transfer &t, double tol) {
  Net want = transform(c.tau, c.q);
  for (size_t l = 0; l < c.tau.w.size(); l++) {
    EXPECT_LT(relerr(t.tau_b.w[l], want.w[l]), tol) << "weight of layer " << l;
    EXPECT_LT(relerr(t.tau_b.b[l], want.b[l]), tol) << "bias of layer " << l;
  }
}

// max |f(x) - g(x)| / max |g(x)| over fresh inputs.
double function_gap(const Net &f, const Net &g, Act a, size_t d_in, size_t d_out) {
  Rng r(99);
  Mat x = randn(r, 64, d_in), t(64, d_out);
  Mat yf = run(f, a, x, t).y, yg = run(g, a, x, t).y;
  return relerr(yf, yg);
}

}  // namespace

TEST(Planted, RotatedLinearNetworkIsRecoveredExactly) {
  Ctx ctx;
  // Identity activations: every hidden space may be rotated.  Widths chosen
  // so that activations and gradients have full rank (d1 = d2, d0 >= d1,
  // d3 >= d2): a linear network's hidden gradients live in W3's row space.
  std::vector<size_t> d = {10, 8, 8, 12};
  Case c = make_case(1, IDENTITY, d, d, false, 200);
  Transfer t = bico(ctx, c.tau, c.ta, c.tb);
  for (size_t l = 0; l < 3; l++) {
    EXPECT_EQ(t.rank_in[l], d[l]) << "layer " << l;
    EXPECT_EQ(t.rank_out[l], d[l + 1]) << "layer " << l;
  }
  expect_planted(c, t, 1e-4);
  // theta_B + tau_B computes the fine-tuned A; naive addition does not.
  Net aft = plus(c.a, c.tau);
  EXPECT_LT(function_gap(plus(c.b, t.tau_b), aft, IDENTITY, 10, 12), 1e-4);
  EXPECT_GT(function_gap(plus(c.b, c.tau), aft, IDENTITY, 10, 12), 1e-2);
}

TEST(Planted, PermutedReluNetworkIsRecoveredExactly) {
  Ctx ctx;
  // ReLU: permutations are the symmetry of the hidden spaces.
  std::vector<size_t> d = {12, 16, 10, 6};
  Case c = make_case(2, RELU, d, d, true, 400);
  Transfer t = bico(ctx, c.tau, c.ta, c.tb);
  expect_planted(c, t, 1e-4);
  // The maps themselves are the planted permutations (R_in of layer l is
  // Q_l^T in the A -> B convention).
  EXPECT_LT(relerr(t.r_in[1], transpose(c.q[1])), 1e-5);
  EXPECT_LT(relerr(t.r_in[2], transpose(c.q[2])), 1e-5);
  Net aft = plus(c.a, c.tau);
  EXPECT_LT(function_gap(plus(c.b, t.tau_b), aft, RELU, 12, 6), 1e-4);
  EXPECT_GT(function_gap(plus(c.b, c.tau), aft, RELU, 12, 6), 1e-2);
}

TEST(Planted, WiderTargetIsExactOnTheSourceSubspace) {
  Ctx ctx;
  // B embeds the linear A into wider hidden layers (extra units fed and read
  // by zero weights), then rotates the whole hidden spaces.
  std::vector<size_t> da = {10, 8, 8, 12}, db = {10, 11, 13, 12};
  Case c = make_case(3, IDENTITY, da, db, false, 200);
  Transfer t = bico(ctx, c.tau, c.ta, c.tb);
  for (size_t l = 0; l < 3; l++) {
    // d_A <= d_B: R R^T = I.
    for (const Mat *r : {&t.r_in[l], &t.r_out[l]}) {
      Mat rrt = matmul(*r, transpose(*r));
      EXPECT_LT(fro(sub(rrt, eye(r->r, r->r))), 1e-5) << "layer " << l;
    }
  }
  expect_planted(c, t, 1e-4);
  Net aft = plus(c.a, c.tau);
  EXPECT_LT(function_gap(plus(c.b, t.tau_b), aft, IDENTITY, 10, 12), 1e-4);
}

TEST(Planted, NarrowerTargetGivesOrthonormalColumns) {
  Ctx ctx;
  // The same pair the other way round: A wide, B narrow.  R^T R = I, and the
  // transported update is the wide update restricted to B's coordinates.
  std::vector<size_t> dn = {10, 8, 8, 12}, dw = {10, 11, 13, 12};
  Case c = make_case(4, IDENTITY, dn, dw, false, 200);
  // Swap roles: source = wide B, target = narrow A.
  Rng g(5);
  Net tau_w = random_net(g, dw, 0.2);
  Transfer t = bico(ctx, tau_w, c.tb, c.ta);
  for (size_t l = 0; l < 3; l++)
    for (const Mat *r : {&t.r_in[l], &t.r_out[l]}) {
      Mat rtr = matmul(transpose(*r), *r);
      EXPECT_LT(fro(sub(rtr, eye(r->c, r->c))), 1e-5) << "layer " << l;
    }
  // Expected: Q^T tau_w Q (projection of the wide update onto A's subspace).
  for (size_t l = 0; l < 3; l++) {
    Mat want = matmul(matmul(transpose(c.q[l + 1]), tau_w.w[l]), c.q[l]);
    EXPECT_LT(relerr(t.tau_b.w[l], want), 1e-4) << "layer " << l;
  }
}

TEST(Planted, TwoContextsInTwoThreadsMatchSequentialRuns) {
  // No global mutable state: the same work on two contexts at once gives
  // bit-identical results to running it twice in sequence.
  std::vector<size_t> d = {12, 16, 10, 6};
  Case c1 = make_case(6, RELU, d, d, true, 300);
  Case c2 = make_case(7, RELU, d, d, false, 300);
  auto work = [](const Case *c, Transfer *out) {
    Ctx ctx;
    *out = bico(ctx, c->tau, c->ta, c->tb);
  };
  Transfer s1, s2, p1, p2;
  work(&c1, &s1);
  work(&c2, &s2);
  std::thread t1(work, &c1, &p1), t2(work, &c2, &p2);
  t1.join();
  t2.join();
  for (size_t l = 0; l < 3; l++) {
    EXPECT_EQ(s1.tau_b.w[l].v, p1.tau_b.w[l].v) << "layer " << l;
    EXPECT_EQ(s2.tau_b.w[l].v, p2.tau_b.w[l].v) << "layer " << l;
    EXPECT_EQ(s1.tau_b.b[l].v, p1.tau_b.b[l].v) << "layer " << l;
  }
}
