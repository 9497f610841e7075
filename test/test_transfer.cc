// bico_transfer and the statistics files, through the public API: a planted
// linear chain whose target is the source in rotated coordinates, with
// calibration computed here; the expected transfer comes from the planted
// rotation (testutil's reference algebra), not from the code under test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

#include "testutil.h"
#include "transfer_testutil.h"

namespace {

using bt::Mat;
using ttu::File;
using ttu::Tensor;

Tensor T(const Mat &m) { return ttu::as_matrix(m); }
Tensor V(const Mat &m) { return ttu::as_vector(m); }  // a vector


Mat as_mat(const Tensor &t, size_t r, size_t c) {
  Mat m(r, c);
  for (size_t i = 0; i < r * c; i++) m.v[i] = t.v[i];
  return m;
}

std::string slurp(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A linear chain y = W1 (W0 x + b0) + b1 in two blocks, and the same chain
// with its hidden space rotated by Q: W0' = Q W0, b0' = Q b0, W1' = W1 Q^T.
struct Chain {
  std::string dir;
  size_t d = 8, n = 96;
  Mat W0, b0, W1, b1, Q, tau0, taub0, tau1, taub1;
  std::string A, Aft, B, calA, calB, tau;

  Chain() {
    char tmpl[] = "/tmp/bico_transfer_XXXXXX";
    dir = mkdtemp(tmpl);
    bt::Rng g(42);
    W0 = bt::randn(g, d, d, 0.5);
    b0 = bt::randn(g, d, 1);
    W1 = bt::randn(g, d, d, 0.5);
    b1 = bt::randn(g, d, 1);
    Q = bt::rand_orth(g, d);
    tau0 = bt::randn(g, d, d, 0.1);
    taub0 = bt::randn(g, d, 1, 0.1);
    tau1 = bt::randn(g, d, d, 0.1);
    taub1 = bt::randn(g, d, 1, 0.1);
    Mat X = bt::randn(g, n, d), Z = bt::randn(g, n, d);
    // Rows: hidden activations H = X W0^T (+ b0), gradient at the hidden
    // layer Z W1; the target's are rotated: H Q^T and Z W1 Q^T.
    Mat H = bt::matmul(X, bt::transpose(W0));
    for (size_t r = 0; r < n; r++)
      for (size_t j = 0; j < d; j++) H(r, j) += b0.v[j];
    Mat G0 = bt::matmul(Z, W1);
    Mat Qt = bt::transpose(Q);
    A = dir + "/A.safetensors";
    Aft = dir + "/Aft.safetensors";
    B = dir + "/B.safetensors";
    calA = dir + "/calA.safetensors";
    calB = dir + "/calB.safetensors";
    tau = dir + "/tau.safetensors";
    ttu::write_file(A, {{"blocks.0.fc.weight", T(W0)}, {"blocks.0.fc.bias", V(b0)},
              {"blocks.1.fc.weight", T(W1)}, {"blocks.1.fc.bias", V(b1)}});
    ttu::write_file(Aft, {{"blocks.0.fc.weight", T(bt::add(W0, tau0))},
                {"blocks.0.fc.bias", V(bt::add(b0, taub0))},
                {"blocks.1.fc.weight", T(bt::add(W1, tau1))},
                {"blocks.1.fc.bias", V(bt::add(b1, taub1))}});
    ttu::write_file(tau, {{"blocks.0.fc.weight", T(tau0)}, {"blocks.0.fc.bias", V(taub0)},
                {"blocks.1.fc.weight", T(tau1)}, {"blocks.1.fc.bias", V(taub1)}});
    ttu::write_file(B, {{"blocks.0.fc.weight", T(bt::matmul(Q, W0))},
              {"blocks.0.fc.bias", V(bt::matmul(Q, b0))},
              {"blocks.1.fc.weight", T(bt::matmul(W1, Qt))},
              {"blocks.1.fc.bias", V(b1)}});
    ttu::write_file(calA, {{"blocks.0.fc.input", T(X)}, {"blocks.0.fc.output_grad", T(G0)},
                 {"blocks.1.fc.input", T(H)}, {"blocks.1.fc.output_grad", T(Z)}});
    ttu::write_file(calB, {{"blocks.0.fc.input", T(X)},
                 {"blocks.0.fc.output_grad", T(bt::matmul(G0, Qt))},
                 {"blocks.1.fc.input", T(bt::matmul(H, Qt))},
                 {"blocks.1.fc.output_grad", T(Z)}});
  }
  ~Chain() {
    for (const char *f : {"A", "Aft", "B", "calA", "calB", "tau", "out", "stats",
                          "delta", "report"}) {
      std::remove((dir + "/" + f + ".safetensors").c_str());
    }
    std::remove((dir + "/report.json").c_str());
    rmdir(dir.c_str());
  }

  // Checks out = B + alpha * (Q tau0, Q taub0, tau1 Q^T, taub1).
  void expect_exact(const std::string &out, double alpha = 1.0) {
    auto o = ttu::read_file(out);
    auto b = ttu::read_file(B);
    ASSERT_EQ(o.size(), 4u);
    Mat want0 = bt::matmul(Q, tau0), wantb0 = bt::matmul(Q, taub0);
    Mat want1 = bt::matmul(tau1, bt::transpose(Q));
    auto upd = [&](const char *name, size_t r, size_t c) {
      return bt::sub(as_mat(o[name], r, c), as_mat(b[name], r, c));
    };
    auto scaled = [&](const Mat &m) {
      Mat s = m;
      for (auto &x : s.v) x *= alpha;
      return s;
    };
    EXPECT_LT(bt::relerr(upd("blocks.0.fc.weight", d, d), scaled(want0)), 1e-4);
    EXPECT_LT(bt::relerr(upd("blocks.0.fc.bias", d, 1), scaled(wantb0)), 1e-4);
    EXPECT_LT(bt::relerr(upd("blocks.1.fc.weight", d, d), scaled(want1)), 1e-4);
    EXPECT_LT(bt::relerr(upd("blocks.1.fc.bias", d, 1), scaled(taub1)), 1e-4);
  }
};

struct Transfer {
  bico_transfer *t = nullptr;
  explicit Transfer(bico_ctx *ctx) { EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK); }
  ~Transfer() { bico_transfer_free(t); }
  void file(int which, const std::string &p) {
    ASSERT_EQ(bico_transfer_set_file(t, which, p.c_str()), BICO_OK);
  }
};

TEST(TransferPlanted, RotatedChainFromCalibrationFiles) {
  Chain c;
  bt::Ctx ctx;
  Transfer tr(ctx);
  tr.file(BICO_FILE_SOURCE_BASE, c.A);
  tr.file(BICO_FILE_SOURCE_TUNED, c.Aft);
  tr.file(BICO_FILE_TARGET_BASE, c.B);
  tr.file(BICO_FILE_SOURCE_CALIB, c.calA);
  tr.file(BICO_FILE_TARGET_CALIB, c.calB);
  tr.file(BICO_FILE_OUTPUT, c.dir + "/out.safetensors");
  tr.file(BICO_FILE_REPORT, c.dir + "/report.json");
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_ALPHA, 2.0), BICO_OK);
  std::vector<std::string> lines;
  ASSERT_EQ(bico_transfer_set_log(
                tr.t,
                [](void *o, const char *line) {
                  static_cast<std::vector<std::string> *>(o)->push_back(line);
                },
                &lines),
            BICO_OK);
  ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  c.expect_exact(c.dir + "/out.safetensors", 2.0);
  size_t updated = 0, unchanged = 9;
  ASSERT_EQ(bico_transfer_counts(tr.t, &updated, &unchanged), BICO_OK);
  EXPECT_EQ(updated, 4u);
  EXPECT_EQ(unchanged, 0u);
  ASSERT_FALSE(lines.empty());
  EXPECT_NE(lines.back().find("4 tensors updated"), std::string::npos) << lines.back();
  std::string rep = slurp(c.dir + "/report.json");
  EXPECT_NE(rep.find("\"handling\": \"linear\""), std::string::npos) << rep;
  EXPECT_NE(rep.find("\"rank\": 8"), std::string::npos) << rep;
}

TEST(TransferPlanted, StatisticsFileAndTaskVectorGiveTheSame) {
  Chain c;
  bt::Ctx ctx;
  std::string stats = c.dir + "/stats.safetensors";
  ASSERT_EQ(bico_stats_from_calib(ctx, c.calA.c_str(), c.calB.c_str(), nullptr,
                                  stats.c_str()),
            BICO_OK)
      << bico_ctx_errmsg(ctx);
  // The statistic is X_A^T X_B, computed here independently.
  auto s = ttu::read_file(stats);
  auto ca = ttu::read_file(c.calA), cb = ttu::read_file(c.calB);
  ASSERT_EQ(s["blocks.1.fc.in_xcov"].shape, (std::vector<size_t>{c.d, c.d}));
  Mat want = bt::matmul(bt::transpose(as_mat(ca["blocks.1.fc.input"], c.n, c.d)),
                        as_mat(cb["blocks.1.fc.input"], c.n, c.d));
  EXPECT_LT(bt::relerr(as_mat(s["blocks.1.fc.in_xcov"], c.d, c.d), want), 1e-6);

  // Merging a file with itself doubles it.
  std::string merged = c.dir + "/delta.safetensors";
  const char *ins[2] = {stats.c_str(), stats.c_str()};
  ASSERT_EQ(bico_stats_merge(ctx, ins, 2, merged.c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
  auto m = ttu::read_file(merged);
  Mat twice = as_mat(s["blocks.0.fc.out_xcov"], c.d, c.d);
  for (auto &x : twice.v) x *= 2;
  EXPECT_LT(bt::relerr(as_mat(m["blocks.0.fc.out_xcov"], c.d, c.d), twice), 1e-6);

  Transfer tr(ctx);
  tr.file(BICO_FILE_SOURCE_BASE, c.A);
  tr.file(BICO_FILE_TASK_VECTOR, c.tau);
  tr.file(BICO_FILE_TARGET_BASE, c.B);
  tr.file(BICO_FILE_STATS, merged);
  tr.file(BICO_FILE_OUTPUT, c.dir + "/out.safetensors");
  ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  c.expect_exact(c.dir + "/out.safetensors");
}

TEST(TransferPlanted, NaiveIsNotExactHere) {
  // The same chain through the naive baseline: the rotation is ignored, so
  // the output differs from the planted answer (the test above can fail).
  Chain c;
  bt::Ctx ctx;
  Transfer tr(ctx);
  tr.file(BICO_FILE_SOURCE_BASE, c.A);
  tr.file(BICO_FILE_SOURCE_TUNED, c.Aft);
  tr.file(BICO_FILE_TARGET_BASE, c.B);
  tr.file(BICO_FILE_OUTPUT, c.dir + "/out.safetensors");
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE),
            BICO_OK);
  ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  auto o = ttu::read_file(c.dir + "/out.safetensors");
  auto b = ttu::read_file(c.B);
  Mat upd = bt::sub(as_mat(o["blocks.0.fc.weight"], c.d, c.d),
                    as_mat(b["blocks.0.fc.weight"], c.d, c.d));
  EXPECT_LT(bt::relerr(upd, c.tau0), 1e-6);
  EXPECT_GT(bt::relerr(upd, bt::matmul(c.Q, c.tau0)), 0.1);
}

TEST(TransferErrors, OptionsAreChecked) {
  bt::Ctx ctx;
  bico_transfer *none = nullptr;
  EXPECT_EQ(bico_transfer_create(nullptr, &none), BICO_E_NULL);
  EXPECT_EQ(bico_transfer_create(ctx, nullptr), BICO_E_NULL);
  Transfer tr(ctx);
  double v;
  EXPECT_EQ(bico_transfer_get_param(tr.t, BICO_TRANSFER_ALPHA, &v), BICO_OK);
  EXPECT_EQ(v, 1.0);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_ALPHA, 0.0), BICO_E_ARG);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("alpha = 0 is outside (0, "), std::string::npos);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_ALPHA, -1.0), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_ALPHA, NAN), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_ALPHA, 3.5), BICO_OK);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_METHOD, 7), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_METHOD, 1.5), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_RANK_TOL, 1.0), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WHITEN, 0.6), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, 99, 1), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_file(tr.t, 99, "x"), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_OUTPUT, ""), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_add_split(tr.t, "qkv", 0), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_add_split(tr.t, nullptr, 3), BICO_E_NULL);
  EXPECT_EQ(bico_transfer_add_tie(tr.t, "cls_token", nullptr), BICO_E_NULL);
  EXPECT_EQ(bico_transfer_counts(tr.t, nullptr, nullptr), BICO_E_STATE);
  // No files at all: the message says which is missing.
  EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_ARG);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("source base"), std::string::npos);
  EXPECT_EQ(bico_transfer_run(nullptr), BICO_E_NULL);
  bico_transfer_free(nullptr);
}

TEST(TransferErrors, BadInputsNameTheCulpritAndWriteNothing) {
  Chain c;
  bt::Ctx ctx;
  std::string out = c.dir + "/out.safetensors";
  {
    std::ofstream f(out, std::ios::binary);
    f << "keep me";
  }
  auto base = [&](Transfer &tr) {
    tr.file(BICO_FILE_SOURCE_BASE, c.A);
    tr.file(BICO_FILE_SOURCE_TUNED, c.Aft);
    tr.file(BICO_FILE_TARGET_BASE, c.B);
    tr.file(BICO_FILE_SOURCE_CALIB, c.calA);
    tr.file(BICO_FILE_TARGET_CALIB, c.calB);
    tr.file(BICO_FILE_OUTPUT, out);
  };
  {
    // Output equal to an input.
    Transfer tr(ctx);
    base(tr);
    tr.file(BICO_FILE_OUTPUT, c.B);
    std::string before = slurp(c.B);
    EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_ARG);
    EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("input"), std::string::npos);
    EXPECT_EQ(slurp(c.B), before);
  }
  {
    // Rows mismatch between the calibration files: names the module.
    auto cb = ttu::read_file(c.calB);
    cb["blocks.1.fc.input"].shape[0] -= 1;
    cb["blocks.1.fc.input"].v.resize((c.n - 1) * c.d);
    File f;
    for (auto &e : cb) f.push_back(e);
    std::string bad = c.dir + "/stats.safetensors";
    ttu::write_file(bad, f);
    Transfer tr(ctx);
    base(tr);
    tr.file(BICO_FILE_TARGET_CALIB, bad);
    EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_SHAPE);
    std::string msg = bico_ctx_errmsg(ctx);
    EXPECT_NE(msg.find("blocks.1.fc"), std::string::npos) << msg;
    EXPECT_NE(msg.find("95"), std::string::npos) << msg;
    // A missing module's calibration: NOTFOUND naming the key.
    cb.erase("blocks.1.fc.output_grad");
    File g;
    for (auto &e : ttu::read_file(c.calB))
      if (e.first != "blocks.0.fc.output_grad") g.push_back(e);
    ttu::write_file(bad, g);
    Transfer tr2(ctx);
    base(tr2);
    tr2.file(BICO_FILE_TARGET_CALIB, bad);
    EXPECT_EQ(bico_transfer_run(tr2.t), BICO_E_NOTFOUND);
    EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("blocks.0.fc.output_grad"),
              std::string::npos)
        << bico_ctx_errmsg(ctx);
  }
  {
    // A tie to a module the target lacks.
    Transfer tr(ctx);
    base(tr);
    ASSERT_EQ(bico_transfer_add_tie(tr.t, "blocks.0.fc.bias", "stem"), BICO_OK);
    EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_NOTFOUND);
  }
  EXPECT_EQ(slurp(out), "keep me");
  // No temporary file left behind.
  std::string ls;
  FILE *p = popen(("ls -a " + c.dir).c_str(), "r");
  char buf[256];
  while (p && fgets(buf, sizeof buf, p)) ls += buf;
  if (p) pclose(p);
  EXPECT_EQ(ls.find("bico-tmp"), std::string::npos) << ls;
}

// An allocator that fails the n-th allocation and counts live blocks.
using bt::Failing;
using bt::fail_free;
const bico_alloc_fn fail_alloc = bt::fail_once_alloc;

TEST(TransferOom, EveryAllocationFailureIsReportedAndCleanedUp) {
  Chain c;
  std::string out = c.dir + "/out.safetensors", rep = c.dir + "/report.json";
  bool done = false;
  long k;
  for (k = 1; k < 100000 && !done; k++) {
    Failing f;
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
    f.fail_at = f.count + k;
    bico_transfer *t = nullptr;
    bico_status st = bico_transfer_create(ctx, &t);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, c.A},      {BICO_FILE_SOURCE_TUNED, c.Aft},
        {BICO_FILE_TARGET_BASE, c.B},      {BICO_FILE_SOURCE_CALIB, c.calA},
        {BICO_FILE_TARGET_CALIB, c.calB},  {BICO_FILE_OUTPUT, out},
        {BICO_FILE_REPORT, rep}};
    for (auto &fl : files)
      if (st == BICO_OK) st = bico_transfer_set_file(t, fl.first, fl.second.c_str());
    if (st == BICO_OK) st = bico_transfer_add_split(t, "fc", 2);
    if (st == BICO_OK) st = bico_transfer_run(t);
    if (st == BICO_OK) {
      done = true;
      std::remove(out.c_str());
      std::remove(rep.c_str());
    } else {
      EXPECT_EQ(st, BICO_E_NOMEM) << "allocation " << k << ": " << bico_ctx_errmsg(ctx);
      EXPECT_EQ(access(out.c_str(), F_OK), -1) << "allocation " << k;
      EXPECT_EQ(access(rep.c_str(), F_OK), -1) << "allocation " << k;
    }
    bico_transfer_free(t);
    EXPECT_EQ(f.live, 1) << "leak after failing allocation " << k;
    bico_ctx_free(ctx);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_TRUE(done);
  EXPECT_GT(k, 20);
}

TEST(ModelOom, EveryAllocationFailureIsReportedAndCleanedUp) {
  bool done = false;
  for (long k = 1; k < 100000 && !done; k++) {
    Failing f;
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
    f.fail_at = f.count + k;
    bico_model *a = nullptr, *b = nullptr;
    bico_status st = bico_model_create(ctx, &a);
    if (st == BICO_OK) st = bico_model_create(ctx, &b);
    for (int i = 0; i < 40 && st == BICO_OK; i++) {
      size_t shape[2] = {4, 4};
      std::string n = "blocks." + std::to_string(i % 4) + ".m" + std::to_string(i) + ".weight";
      st = bico_model_add_tensor(a, n.c_str(), 0, 2, shape);
      if (st == BICO_OK && i < 6) {
        n = "blocks." + std::to_string(i) + ".m.weight";
        st = bico_model_add_tensor(b, n.c_str(), 0, 2, shape);
      }
    }
    const char *prefix = nullptr;
    if (st == BICO_OK) st = bico_model_blocks(b, &prefix, nullptr);
    size_t sm;
    if (st == BICO_OK) st = bico_model_pair_module(b, 0, a, &sm);
    if (st == BICO_OK || st == BICO_E_NOTFOUND)
      done = true;
    else
      EXPECT_EQ(st, BICO_E_NOMEM) << k;
    bico_model_free(a);
    bico_model_free(b);
    EXPECT_EQ(f.live, 1) << "leak after failing allocation " << k;
    bico_ctx_free(ctx);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_TRUE(done);
}

}  // namespace

// ---- The solver pool (BICO_TRANSFER_WORKERS) ----

TEST(TransferPipeline, ParamsDefaultsAndBounds) {
  bt::Ctx ctx;
  Transfer tr(ctx);
  double v = -1;
  ASSERT_EQ(bico_transfer_get_param(tr.t, BICO_TRANSFER_PROC_METHOD, &v), BICO_OK);
  EXPECT_EQ(v, BICO_PROC_EIG);
  ASSERT_EQ(bico_transfer_get_param(tr.t, BICO_TRANSFER_WORKERS, &v), BICO_OK);
  EXPECT_EQ(v, 1);
  ASSERT_EQ(bico_transfer_get_param(tr.t, BICO_TRANSFER_SOLVE_MEMORY, &v), BICO_OK);
  EXPECT_EQ(v, 0);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WORKERS, 0), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WORKERS, 1.5), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WORKERS, 1025), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_PROC_METHOD, BICO_PROC_POLAR + 1), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_SOLVE_MEMORY, -1), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WORKERS, 4), BICO_OK);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_PROC_METHOD, BICO_PROC_SVD), BICO_OK);
}

// Every worker count, with and without a memory cap that forces one solve
// at a time, from calibration files and from a statistics file, and with
// each Procrustes route: the planted answer, and outputs and reports
// byte-identical to the single-threaded run.
TEST(TransferPipeline, WorkersGiveTheSerialBytes) {
  Chain c;
  bt::Ctx ctx;
  std::string stats = c.dir + "/stats.safetensors";
  ASSERT_EQ(bico_stats_from_calib(ctx, c.calA.c_str(), c.calB.c_str(), nullptr,
                                  stats.c_str()),
            BICO_OK)
      << bico_ctx_errmsg(ctx);
  std::string out = c.dir + "/out.safetensors", rep = c.dir + "/report.json";
  for (int from_stats : {0, 1}) {
    for (int method : {BICO_PROC_EIG, BICO_PROC_SVD}) {
      std::string want_out, want_rep;
      for (double workers : {1.0, 2.0, 3.0, 8.0}) {
        for (double cap : {0.0, 1.0}) {
          SCOPED_TRACE(testing::Message() << "stats " << from_stats << " method " << method
                                          << " workers " << workers << " cap " << cap);
          Transfer tr(ctx);
          tr.file(BICO_FILE_SOURCE_BASE, c.A);
          tr.file(BICO_FILE_SOURCE_TUNED, c.Aft);
          tr.file(BICO_FILE_TARGET_BASE, c.B);
          if (from_stats) {
            tr.file(BICO_FILE_STATS, stats);
          } else {
            tr.file(BICO_FILE_SOURCE_CALIB, c.calA);
            tr.file(BICO_FILE_TARGET_CALIB, c.calB);
          }
          tr.file(BICO_FILE_OUTPUT, out);
          tr.file(BICO_FILE_REPORT, rep);
          ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_PROC_METHOD, method), BICO_OK);
          ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WORKERS, workers), BICO_OK);
          ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_SOLVE_MEMORY, cap), BICO_OK);
          ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
          c.expect_exact(out);
          if (want_out.empty()) {
            want_out = slurp(out);
            want_rep = slurp(rep);
          } else {
            EXPECT_EQ(slurp(out), want_out);
            EXPECT_EQ(slurp(rep), want_rep);
          }
        }
      }
    }
  }
}

// A failure inside a worker (a statistic the file lacks, a statistic with
// the wrong shape) reaches the caller with the message a serial run gives,
// and nothing is written.
TEST(TransferPipeline, WorkerFailuresNameTheCulprit) {
  Chain c;
  bt::Ctx ctx;
  std::string stats = c.dir + "/stats.safetensors", bad = c.dir + "/delta.safetensors";
  ASSERT_EQ(bico_stats_from_calib(ctx, c.calA.c_str(), c.calB.c_str(), nullptr,
                                  stats.c_str()),
            BICO_OK);
  std::string out = c.dir + "/out.safetensors";
  auto s = ttu::read_file(stats);
  for (int variant : {0, 1}) {
    File f;
    for (auto &e : s) {
      if (e.first == "blocks.1.fc.out_xcov") {
        if (variant == 0) continue;  // missing
        Tensor t = e.second;         // wrong shape
        t.shape = {c.d / 2, c.d * 2};
        f.push_back({e.first, t});
        continue;
      }
      f.push_back(e);
    }
    ttu::write_file(bad, f);
    std::string serial_msg;
    for (double workers : {1.0, 3.0}) {
      SCOPED_TRACE(testing::Message() << "variant " << variant << " workers " << workers);
      Transfer tr(ctx);
      tr.file(BICO_FILE_SOURCE_BASE, c.A);
      tr.file(BICO_FILE_SOURCE_TUNED, c.Aft);
      tr.file(BICO_FILE_TARGET_BASE, c.B);
      tr.file(BICO_FILE_STATS, bad);
      tr.file(BICO_FILE_OUTPUT, out);
      ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WORKERS, workers), BICO_OK);
      EXPECT_EQ(bico_transfer_run(tr.t), variant == 0 ? BICO_E_NOTFOUND : BICO_E_SHAPE);
      std::string msg = bico_ctx_errmsg(ctx);
      EXPECT_NE(msg.find("blocks.1.fc.out_xcov"), std::string::npos) << msg;
      EXPECT_NE(msg.find(bad), std::string::npos) << msg;
      if (serial_msg.empty()) serial_msg = msg;
      else EXPECT_EQ(msg, serial_msg);
      EXPECT_EQ(access(out.c_str(), F_OK), -1);
    }
  }
}

// Allocation failures anywhere, including inside the solver threads
// (whose contexts share the caller's allocator; bt::Failing counts
// atomically): the run reports BICO_E_NOMEM, writes nothing and frees
// every block, whichever thread hit the failure.
TEST(TransferPipeline, AllocationFailuresInWorkersAreReportedAndCleanedUp) {
  Chain c;
  bt::Ctx plain;
  std::string stats = c.dir + "/stats.safetensors";
  ASSERT_EQ(bico_stats_from_calib(plain, c.calA.c_str(), c.calB.c_str(), nullptr,
                                  stats.c_str()),
            BICO_OK);
  std::string out = c.dir + "/out.safetensors";
  for (int from_stats : {0, 1}) {
    bool done = false;
    long k;
    for (k = 1; k < 100000 && !done; k++) {
      Failing f;
      bico_ctx *ctx = nullptr;
      ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
      f.fail_at = f.count + k;
      bico_transfer *t = nullptr;
      bico_status st = bico_transfer_create(ctx, &t);
      std::vector<std::pair<int, std::string>> files = {
          {BICO_FILE_SOURCE_BASE, c.A}, {BICO_FILE_SOURCE_TUNED, c.Aft},
          {BICO_FILE_TARGET_BASE, c.B}, {BICO_FILE_OUTPUT, out}};
      if (from_stats) {
        files.push_back({BICO_FILE_STATS, stats});
      } else {
        files.push_back({BICO_FILE_SOURCE_CALIB, c.calA});
        files.push_back({BICO_FILE_TARGET_CALIB, c.calB});
      }
      for (auto &fl : files)
        if (st == BICO_OK) st = bico_transfer_set_file(t, fl.first, fl.second.c_str());
      if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_WORKERS, 3);
      if (st == BICO_OK) st = bico_transfer_add_split(t, "fc", 2);
      if (st == BICO_OK) st = bico_transfer_run(t);
      if (st == BICO_OK) {
        done = true;
        std::remove(out.c_str());
      } else {
        EXPECT_EQ(st, BICO_E_NOMEM) << "allocation " << k << ": " << bico_ctx_errmsg(ctx);
        EXPECT_EQ(access(out.c_str(), F_OK), -1) << "allocation " << k;
      }
      bico_transfer_free(t);
      EXPECT_EQ(f.live, 1) << "leak after failing allocation " << k;
      bico_ctx_free(ctx);
      if (::testing::Test::HasFailure()) break;
    }
    std::printf("[ oom      ] %s: succeeded at allocation %ld\n", from_stats ? "stats" : "calib", k - 1);
    EXPECT_TRUE(done);
    EXPECT_GT(k, 20);
  }
}

// ---- Statistics and votes lent from memory (bico_transfer_set_xcov/_votes)

namespace {

// Rows as float, row-major.
std::vector<float> rows_f32(const Mat &m) { return m.f32(); }

// An accumulator of rows (a, b) with the given flags, column blocks
// [a0, a0 + wa) x [b0, b0 + wb) of them.
bico_xcov *acc(bico_ctx *ctx, const Mat &a, const Mat &b, unsigned flags,
               size_t a0 = 0, size_t wa = 0, size_t b0 = 0, size_t wb = 0) {
  if (wa == 0) wa = a.c;
  if (wb == 0) wb = b.c;
  bico_xcov *x = nullptr;
  EXPECT_EQ(bico_xcov_create(ctx, wa, wb, flags, &x), BICO_OK);
  std::vector<float> fa = rows_f32(a), fb = rows_f32(b);
  EXPECT_EQ(bico_xcov_add(x, a.r, fa.data() + a0, a.c, fb.data() + b0, b.c), BICO_OK)
      << bico_ctx_errmsg(ctx);
  return x;
}

// The chain's statistics as the calibration files hold them, per module
// side: (source rows, target rows).
struct ChainRows {
  Mat in0a, in0b, out0a, out0b, in1a, in1b, out1a, out1b;
  explicit ChainRows(const Chain &c) {
    auto m = [](const Tensor &t) { return as_mat(t, t.shape[0], t.shape[1]); };
    auto a = ttu::read_file(c.calA), b = ttu::read_file(c.calB);
    in0a = m(a["blocks.0.fc.input"]);
    in0b = m(b["blocks.0.fc.input"]);
    out0a = m(a["blocks.0.fc.output_grad"]);
    out0b = m(b["blocks.0.fc.output_grad"]);
    in1a = m(a["blocks.1.fc.input"]);
    in1b = m(b["blocks.1.fc.input"]);
    out1a = m(a["blocks.1.fc.output_grad"]);
    out1b = m(b["blocks.1.fc.output_grad"]);
  }
};

struct Lent {
  std::vector<bico_xcov *> xs;
  ~Lent() {
    for (auto *x : xs) bico_xcov_free(x);
  }
  // Lends all four module sides of the chain to t.
  void all(bico_ctx *ctx, bico_transfer *t, const ChainRows &r, unsigned flags) {
    struct {
      const char *m;
      int side;
      const Mat *a, *b;
    } sides[] = {{"blocks.0.fc", BICO_SIDE_IN, &r.in0a, &r.in0b},
                 {"blocks.0.fc", BICO_SIDE_OUT, &r.out0a, &r.out0b},
                 {"blocks.1.fc", BICO_SIDE_IN, &r.in1a, &r.in1b},
                 {"blocks.1.fc", BICO_SIDE_OUT, &r.out1a, &r.out1b}};
    for (auto &s : sides) {
      xs.push_back(acc(ctx, *s.a, *s.b, flags));
      bico_xcov *one = xs.back();
      ASSERT_EQ(bico_transfer_set_xcov(t, s.m, s.side, &one, 1), BICO_OK);
    }
  }
};

void set_inputs(Transfer &tr, const Chain &c, const std::string &out) {
  tr.file(BICO_FILE_SOURCE_BASE, c.A);
  tr.file(BICO_FILE_SOURCE_TUNED, c.Aft);
  tr.file(BICO_FILE_TARGET_BASE, c.B);
  tr.file(BICO_FILE_OUTPUT, out);
}

double max_rel(const std::string &p, const std::string &q) {
  auto a = ttu::read_file(p), b = ttu::read_file(q);
  double worst = 0;
  for (auto &e : a) {
    const auto &u = e.second.v, &v = b[e.first].v;
    if (u.size() != v.size()) return 1e30;
    double num = 0, den = 0;
    for (size_t i = 0; i < u.size(); i++) {
      num += (u[i] - v[i]) * (double)(u[i] - v[i]);
      den += (double)v[i] * v[i];
    }
    worst = std::max(worst, std::sqrt(num / (den > 0 ? den : 1)));
  }
  return worst;
}

}  // namespace

// Lent accumulators and no statistics file: the planted answer, and the
// bytes (output and report) of the run from calibration files, serial and
// with solver threads.
TEST(TransferLent, PlantedChainFromLentAccumulators) {
  Chain c;
  bt::Ctx ctx;
  ChainRows rows(c);
  std::string want = c.dir + "/delta.safetensors", out = c.dir + "/out.safetensors";
  {
    Transfer tr(ctx);
    set_inputs(tr, c, want);
    tr.file(BICO_FILE_SOURCE_CALIB, c.calA);
    tr.file(BICO_FILE_TARGET_CALIB, c.calB);
    ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  }
  for (double workers : {1.0, 3.0}) {
    SCOPED_TRACE(testing::Message() << "workers " << workers);
    Transfer tr(ctx);
    Lent lent;
    set_inputs(tr, c, out);
    lent.all(ctx, tr.t, rows, 0);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WORKERS, workers), BICO_OK);
    ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
    c.expect_exact(out);
    EXPECT_LT(max_rel(out, want), 1e-6);
  }
}

// Centering and whitening need the sums and Gram matrices a statistics
// file cannot hold: lent accumulators with them give what the driver
// computes from the raw rows of the calibration files.
TEST(TransferLent, CenterAndWhitenMatchCalibrationFiles) {
  Chain c;
  bt::Ctx ctx;
  ChainRows rows(c);
  std::string want = c.dir + "/delta.safetensors", out = c.dir + "/out.safetensors";
  for (int variant : {0, 1}) {
    SCOPED_TRACE(testing::Message() << "variant " << variant);
    auto options = [&](Transfer &tr) {
      ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_CENTER, 1), BICO_OK);
      if (variant) {
        ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WHITEN, 0.25), BICO_OK);
      }
    };
    {
      Transfer tr(ctx);
      set_inputs(tr, c, want);
      tr.file(BICO_FILE_SOURCE_CALIB, c.calA);
      tr.file(BICO_FILE_TARGET_CALIB, c.calB);
      options(tr);
      ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
    }
    Transfer tr(ctx);
    Lent lent;
    set_inputs(tr, c, out);
    options(tr);
    lent.all(ctx, tr.t, rows, BICO_XCOV_SUMS | BICO_XCOV_GRAMS);
    ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
    EXPECT_LT(max_rel(out, want), 1e-5);
    // target rows are exact rotations of the source's: centered and
    // whitened statistics still give the planted rotation
    c.expect_exact(out);
  }
  // Accumulators without sums cannot be centered: a clear state error.
  Transfer tr(ctx);
  Lent lent;
  set_inputs(tr, c, out);
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_CENTER, 1), BICO_OK);
  lent.all(ctx, tr.t, rows, 0);
  EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_STATE);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("blocks.0.fc"), std::string::npos)
      << bico_ctx_errmsg(ctx);
}

// A split module (--split fc=2), centered and whitened: one accumulator
// for the whole output side (its diagonal blocks carved, sums and Grams
// included) and one per block give what the driver computes per block from
// the calibration files' rows.
TEST(TransferLent, SplitSideFromOneOrPerBlockAccumulators) {
  Chain c;
  bt::Ctx ctx;
  ChainRows rows(c);
  std::string want = c.dir + "/delta.safetensors", out = c.dir + "/out.safetensors";
  auto options = [&](Transfer &tr) {
    ASSERT_EQ(bico_transfer_add_split(tr.t, "fc", 2), BICO_OK);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_CENTER, 1), BICO_OK);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WHITEN, 0.25), BICO_OK);
  };
  {
    Transfer tr(ctx);
    set_inputs(tr, c, want);
    tr.file(BICO_FILE_SOURCE_CALIB, c.calA);
    tr.file(BICO_FILE_TARGET_CALIB, c.calB);
    options(tr);
    ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  }
  for (int per_block : {0, 1}) {
    SCOPED_TRACE(testing::Message() << "per block " << per_block);
    Transfer tr(ctx);
    Lent lent;
    set_inputs(tr, c, out);
    options(tr);
    unsigned fl = BICO_XCOV_SUMS | BICO_XCOV_GRAMS;
    lent.all(ctx, tr.t, rows, fl);
    if (per_block) {
      size_t h = c.d / 2;
      std::vector<bico_xcov *> blocks;
      for (size_t b = 0; b < 2; b++) {
        lent.xs.push_back(acc(ctx, rows.out0a, rows.out0b, fl, b * h, h, b * h, h));
        blocks.push_back(lent.xs.back());
      }
      ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.0.fc", BICO_SIDE_OUT, blocks.data(), 2),
                BICO_OK);
    }
    ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
    EXPECT_LT(max_rel(out, want), 1e-5);
  }
  // the split changes the answer (block maps are not the planted rotation)
  auto o = ttu::read_file(want), b = ttu::read_file(c.B);
  Mat upd = bt::sub(as_mat(o["blocks.0.fc.weight"], c.d, c.d),
                    as_mat(b["blocks.0.fc.weight"], c.d, c.d));
  EXPECT_GT(bt::relerr(upd, bt::matmul(c.Q, c.tau0)), 1e-3);
}

TEST(TransferLent, BadAccumulatorsAndArgumentsAreNamed) {
  Chain c;
  bt::Ctx ctx;
  ChainRows rows(c);
  std::string out = c.dir + "/out.safetensors";
  bico_xcov *x = acc(ctx, rows.in0a, rows.in0b, 0);
  bico_xcov *half = acc(ctx, rows.in0a, rows.in0b, 0, 0, c.d / 2, 0, c.d);
  bico_xcov *two[2] = {x, x};
  {
    Transfer tr(ctx);
    EXPECT_EQ(bico_transfer_set_xcov(tr.t, nullptr, BICO_SIDE_IN, two, 1), BICO_E_NULL);
    EXPECT_EQ(bico_transfer_set_xcov(tr.t, "m", 0, two, 1), BICO_E_ARG);
    EXPECT_EQ(bico_transfer_set_xcov(tr.t, "m", 3, two, 1), BICO_E_ARG);
    EXPECT_EQ(bico_transfer_set_xcov(tr.t, "m", BICO_SIDE_IN, two, 2), BICO_E_ARG);
    EXPECT_EQ(bico_transfer_set_xcov(tr.t, "", BICO_SIDE_IN, two, 1), BICO_E_ARG);
    EXPECT_EQ(bico_transfer_set_xcov(tr.t, "m", BICO_SIDE_IN, nullptr, 1), BICO_E_NULL);
    EXPECT_EQ(bico_transfer_set_xcov(nullptr, "m", BICO_SIDE_IN, two, 1), BICO_E_NULL);
    EXPECT_EQ(bico_transfer_set_votes(tr.t, nullptr, nullptr), BICO_E_NULL);
    EXPECT_EQ(bico_transfer_set_xcov(tr.t, "m", BICO_SIDE_IN, nullptr, 0), BICO_OK);
  }
  EXPECT_STREQ(bico_transfer_side_name(BICO_SIDE_IN), "in");
  EXPECT_STREQ(bico_transfer_side_name(BICO_SIDE_OUT), "out");
  EXPECT_EQ(bico_transfer_side_name(0), nullptr);
  int side = 0;
  EXPECT_EQ(bico_transfer_side_from_name("out", &side), BICO_OK);
  EXPECT_EQ(side, BICO_SIDE_OUT);
  EXPECT_EQ(bico_transfer_side_from_name("up", &side), BICO_E_NOTFOUND);
  // A side nobody lent (and no file): NOTFOUND naming its statistics key;
  // a lent one withdrawn counts as never lent.  Wrong widths: SHAPE.
  for (int variant : {0, 1, 2, 3}) {
    SCOPED_TRACE(testing::Message() << "variant " << variant);
    Transfer tr(ctx);
    Lent lent;
    set_inputs(tr, c, out);
    lent.all(ctx, tr.t, rows, 0);
    bico_status want = BICO_E_NOTFOUND;
    const char *needle = "blocks.1.fc.out_xcov";
    if (variant == 0) {
      ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.1.fc", BICO_SIDE_OUT, nullptr, 0), BICO_OK);
    } else if (variant == 1) {
      bico_xcov *h = half;
      ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.0.fc", BICO_SIDE_IN, &h, 1), BICO_OK);
      want = BICO_E_SHAPE;
      needle = "blocks.0.fc";
    } else if (variant == 2) {
      ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.1.fc", BICO_SIDE_OUT, two, 2), BICO_OK);
      want = BICO_E_SHAPE;  // 2 blocks for a module that is not split
      needle = "blocks.1.fc";
    } else {
      ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_WORKERS, 3), BICO_OK);
      ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.1.fc", BICO_SIDE_OUT, nullptr, 0), BICO_OK);
    }
    EXPECT_EQ(bico_transfer_run(tr.t), want);
    EXPECT_EQ(bico_ctx_errcode(ctx), want);
    EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find(needle), std::string::npos)
        << bico_ctx_errmsg(ctx);
    EXPECT_EQ(access(out.c_str(), F_OK), -1);
  }
  bico_xcov_free(x);
  bico_xcov_free(half);
}

// GradFix from lent votes: majority and mean modes against masks computed
// here from the gradients (sign of the vote / of the summed descent
// direction, tau's sign equal and nonzero).
TEST(TransferLent, GradfixVotesFromMemoryInBothModes) {
  Chain c;
  bt::Ctx ctx;
  std::string out = c.dir + "/out.safetensors";
  auto a = ttu::read_file(c.A), aft = ttu::read_file(c.Aft);
  bt::Rng g(7);
  std::map<std::string, std::vector<std::vector<float>>> grads;
  std::vector<bico_votes *> all;
  for (int mode : {BICO_GRADFIX_MAJORITY, BICO_GRADFIX_MEAN}) {
    SCOPED_TRACE(testing::Message() << "mode " << mode);
    Transfer tr(ctx);
    tr.file(BICO_FILE_SOURCE_BASE, c.A);
    tr.file(BICO_FILE_SOURCE_TUNED, c.Aft);
    tr.file(BICO_FILE_TARGET_BASE, c.A);
    tr.file(BICO_FILE_OUTPUT, out);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_METHOD, BICO_METHOD_GRADFIX), BICO_OK);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_GRADFIX_MODE, mode), BICO_OK);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_ALPHA, 0.5), BICO_OK);
    std::map<std::string, std::vector<float>> want;
    for (auto &e : a) {
      size_t n = e.second.v.size();
      bico_votes *v = nullptr;
      ASSERT_EQ(bico_votes_create(ctx, n, BICO_VOTES_MEAN, &v), BICO_OK);
      all.push_back(v);
      std::vector<int> vote(n, 0);
      std::vector<double> sum(n, 0);
      for (int s = 0; s < 5; s++) {
        std::vector<float> gr(n);
        for (auto &x : gr) x = (float)(g.normal() + (s == 0 ? 3 * g.normal() : 0));
        ASSERT_EQ(bico_votes_add_grad(v, gr.data()), BICO_OK);
        for (size_t i = 0; i < n; i++) {
          vote[i] += gr[i] < 0 ? 1 : gr[i] > 0 ? -1 : 0;
          sum[i] -= gr[i];
        }
      }
      ASSERT_EQ(bico_transfer_set_votes(tr.t, e.first.c_str(), v), BICO_OK);
      std::vector<float> w(n);
      for (size_t i = 0; i < n; i++) {
        double tau = (double)aft[e.first].v[i] - e.second.v[i];
        double dir = mode == BICO_GRADFIX_MEAN ? sum[i] : vote[i];
        bool keep = tau != 0 && dir != 0 && (tau > 0) == (dir > 0);
        w[i] = (float)(e.second.v[i] + (keep ? 0.5 * tau : 0.0));
      }
      want[e.first] = w;
    }
    ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
    auto o = ttu::read_file(out);
    for (auto &e : want)
      for (size_t i = 0; i < e.second.size(); i++)
        EXPECT_NEAR(o[e.first].v[i], e.second[i], 1e-6) << e.first << " " << i;
  }
  // Mean mode with votes that count signs only: a state error naming the
  // tensor; a tensor without votes: NOTFOUND.
  for (int variant : {0, 1}) {
    Transfer tr(ctx);
    tr.file(BICO_FILE_SOURCE_BASE, c.A);
    tr.file(BICO_FILE_SOURCE_TUNED, c.Aft);
    tr.file(BICO_FILE_TARGET_BASE, c.A);
    tr.file(BICO_FILE_OUTPUT, out);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_METHOD, BICO_METHOD_GRADFIX), BICO_OK);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_GRADFIX_MODE, BICO_GRADFIX_MEAN),
              BICO_OK);
    std::remove(out.c_str());
    for (auto &e : a) {
      if (variant == 1 && e.first == "blocks.1.fc.bias") continue;
      bico_votes *v = nullptr;
      ASSERT_EQ(bico_votes_create(ctx, e.second.v.size(), variant ? BICO_VOTES_MEAN : 0, &v),
                BICO_OK);
      all.push_back(v);
      std::vector<float> g(e.second.v.size(), 1.0f);  // one sample (none is refused)
      ASSERT_EQ(bico_votes_add_grad(v, g.data()), BICO_OK);
      ASSERT_EQ(bico_transfer_set_votes(tr.t, e.first.c_str(), v), BICO_OK);
    }
    EXPECT_EQ(bico_transfer_run(tr.t), variant ? BICO_E_NOTFOUND : BICO_E_STATE);
    std::string msg = bico_ctx_errmsg(ctx);
    EXPECT_NE(msg.find(variant ? "blocks.1.fc.bias" : "mean"), std::string::npos) << msg;
    EXPECT_EQ(access(out.c_str(), F_OK), -1);
  }
  for (auto *v : all) bico_votes_free(v);
  double v;
  bt::Ctx c2;
  Transfer tr(c2);
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_GRADFIX_MODE, 0), BICO_OK);
  ASSERT_EQ(bico_transfer_get_param(tr.t, BICO_TRANSFER_GRADFIX_MODE, &v), BICO_OK);
  EXPECT_EQ(v, (double)BICO_GRADFIX_MAJORITY);  // 0 resolves to the default
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_GRADFIX_MODE, 3), BICO_E_ARG);
}
