// bico_transfer and the statistics files, through the public API: a planted
// linear chain whose target is the source in rotated coordinates, with
// calibration computed here; the expected transfer comes from the planted
// rotation (testutil's reference algebra), not from the code under test.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

#include "testutil.h"

namespace {

using bt::Mat;

struct Tensor {
  std::vector<size_t> shape;
  std::vector<float> v;
};
using File = std::vector<std::pair<std::string, Tensor>>;

Tensor T(const Mat &m) { return Tensor{{m.r, m.c}, m.f32()}; }
Tensor V(const Mat &m) { return Tensor{{m.r * m.c}, m.f32()}; }  // a vector

void write(const std::string &path, const File &f) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK) << bico_ctx_errmsg(ctx);
  for (auto &e : f)
    ASSERT_EQ(bico_stwriter_declare(w, e.first.c_str(), BICO_DTYPE_F32,
                                    e.second.shape.size(), e.second.shape.data()),
              BICO_OK);
  for (auto &e : f)
    ASSERT_EQ(bico_stwriter_write_f32(w, e.first.c_str(), e.second.v.data(),
                                      e.second.v.size()),
              BICO_OK);
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
}

std::map<std::string, Tensor> read(const std::string &path) {
  bt::Ctx ctx;
  bico_stfile *f = nullptr;
  std::map<std::string, Tensor> out;
  EXPECT_EQ(bico_stfile_open(ctx, path.c_str(), &f), BICO_OK) << bico_ctx_errmsg(ctx);
  if (f == nullptr) return out;
  for (size_t i = 0; i < bico_stfile_count(f); i++) {
    const char *name;
    size_t ndim, numel;
    const size_t *shape;
    bico_stfile_tensor_info(f, i, &name, nullptr, &ndim, &shape);
    bico_stfile_tensor_size(f, i, &numel, nullptr);
    Tensor t{std::vector<size_t>(shape, shape + ndim), std::vector<float>(numel)};
    EXPECT_EQ(bico_stfile_read_f32(f, i, t.v.data(), numel), BICO_OK);
    out[name] = t;
  }
  bico_stfile_close(f);
  return out;
}

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
    write(A, {{"blocks.0.fc.weight", T(W0)}, {"blocks.0.fc.bias", V(b0)},
              {"blocks.1.fc.weight", T(W1)}, {"blocks.1.fc.bias", V(b1)}});
    write(Aft, {{"blocks.0.fc.weight", T(bt::add(W0, tau0))},
                {"blocks.0.fc.bias", V(bt::add(b0, taub0))},
                {"blocks.1.fc.weight", T(bt::add(W1, tau1))},
                {"blocks.1.fc.bias", V(bt::add(b1, taub1))}});
    write(tau, {{"blocks.0.fc.weight", T(tau0)}, {"blocks.0.fc.bias", V(taub0)},
                {"blocks.1.fc.weight", T(tau1)}, {"blocks.1.fc.bias", V(taub1)}});
    write(B, {{"blocks.0.fc.weight", T(bt::matmul(Q, W0))},
              {"blocks.0.fc.bias", V(bt::matmul(Q, b0))},
              {"blocks.1.fc.weight", T(bt::matmul(W1, Qt))},
              {"blocks.1.fc.bias", V(b1)}});
    write(calA, {{"blocks.0.fc.input", T(X)}, {"blocks.0.fc.output_grad", T(G0)},
                 {"blocks.1.fc.input", T(H)}, {"blocks.1.fc.output_grad", T(Z)}});
    write(calB, {{"blocks.0.fc.input", T(X)},
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
    auto o = read(out);
    auto b = read(B);
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
  auto s = read(stats);
  auto ca = read(c.calA), cb = read(c.calB);
  ASSERT_EQ(s["blocks.1.fc.in_xcov"].shape, (std::vector<size_t>{c.d, c.d}));
  Mat want = bt::matmul(bt::transpose(as_mat(ca["blocks.1.fc.input"], c.n, c.d)),
                        as_mat(cb["blocks.1.fc.input"], c.n, c.d));
  EXPECT_LT(bt::relerr(as_mat(s["blocks.1.fc.in_xcov"], c.d, c.d), want), 1e-6);

  // Merging a file with itself doubles it.
  std::string merged = c.dir + "/delta.safetensors";
  const char *ins[2] = {stats.c_str(), stats.c_str()};
  ASSERT_EQ(bico_stats_merge(ctx, ins, 2, merged.c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
  auto m = read(merged);
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
  auto o = read(c.dir + "/out.safetensors");
  auto b = read(c.B);
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
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("value 0"), std::string::npos);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_ALPHA, -1.0), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_ALPHA, NAN), BICO_E_NONFINITE);
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
    auto cb = read(c.calB);
    cb["blocks.1.fc.input"].shape[0] -= 1;
    cb["blocks.1.fc.input"].v.resize((c.n - 1) * c.d);
    File f;
    for (auto &e : cb) f.push_back(e);
    std::string bad = c.dir + "/stats.safetensors";
    write(bad, f);
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
    for (auto &e : read(c.calB))
      if (e.first != "blocks.0.fc.output_grad") g.push_back(e);
    write(bad, g);
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
  auto s = read(stats);
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
    write(bad, f);
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
