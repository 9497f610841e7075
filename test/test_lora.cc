// LoRA adapters through the public API: factored transport against the
// planted maps (reference algebra in testutil.h), PEFT folders written here
// by hand (config text composed in the test, tensors through the writer),
// round trips, refusals, SVD truncation against a planted spectrum, the
// whole-model driver on a rotated chain, and the memory of the factored path
// counted through the context's allocator.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "st_testutil.h"
#include "testutil.h"
#include "transfer_testutil.h"

namespace {

using bt::Mat;
using ttu::File;
using ttu::Tensor;

Tensor T(const Mat &m) { return ttu::as_matrix(m); }
Tensor V(const Mat &m) { return ttu::as_vector(m); }

Mat as_mat(const float *p, size_t r, size_t c) { return Mat::from(p, r, c, c); }
Mat as_mat(const Tensor &t, size_t r, size_t c) { return as_mat(t.v.data(), r, c); }

// m as the float32 values a file holds.
Mat f32(const Mat &m) {
  auto v = m.f32();
  return Mat::from(v.data(), m.r, m.c, m.c);
}

Mat scaled(Mat m, double s) {
  for (auto &x : m.v) x *= s;
  return m;
}

// The first `cols` columns of a random orthogonal n x n matrix: orthonormal
// columns (R^T R = I), i.e. a semi-orthogonal map from n to cols dims when
// n >= cols; its transpose when n < cols.
Mat semi_orth(bt::Rng &g, size_t rows, size_t cols) {
  size_t n = rows > cols ? rows : cols;
  Mat q = bt::rand_orth(g, n), m(rows, cols);
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++) m(i, j) = q(i, j);
  return m;
}

// A PEFT adapter folder written by hand: config text as given, tensors by
// name with the "base_model.model." prefix added.
void write_adapter(const std::string &dir, const std::string &config,
                   const File &tensors) {
  stt::write_bytes(dir + "/adapter_config.json", config);
  File f;
  for (auto &e : tensors) f.push_back({"base_model.model." + e.first, e.second});
  ttu::write_file(dir + "/adapter_model.safetensors", f);
}

bool mentions(bico_ctx *ctx, const std::string &what) {
  return std::string(bico_ctx_errmsg(ctx)).find(what) != std::string::npos;
}

// ---------------------------------------------------------------------------
// Factored transport

TEST(LoraTransport, FactorsMultiplyOutToTheRotatedUpdate) {
  bt::Rng g(7);
  const size_t r = 3, dout_a = 6, din_a = 5, dout_b = 9, din_b = 7;
  const double s = 16.0 / r, alpha = 1.5;
  Mat B = bt::randn(g, dout_a, r), A = bt::randn(g, r, din_a);
  Mat Rout = semi_orth(g, dout_a, dout_b), Rin = semi_orth(g, din_a, din_b);
  std::vector<float> bo(dout_b * r), ao(r * din_b);
  auto rout = Rout.f32(), rin = Rin.f32();
  float *routs[1] = {rout.data()};
  bt::Ctx ctx;
  ASSERT_EQ(bico_lora_transport(ctx, r, 1, dout_a, din_a, dout_b, din_b,
                                (float)alpha, B.f32().data(), A.f32().data(),
                                routs, dout_b, rin.data(), din_b, bo.data(),
                                ao.data()),
            BICO_OK)
      << bico_ctx_errmsg(ctx);
  // s B' A' == alpha R_out^T (s B A) R_in, and B', A' are the factors
  // R_out^T B and A R_in themselves.
  Mat got = scaled(bt::matmul(as_mat(bo.data(), dout_b, r), as_mat(ao.data(), r, din_b)), s);
  Mat want = scaled(bt::matmul(bt::matmul(bt::transpose(Rout), scaled(bt::matmul(B, A), s)), Rin), alpha);
  EXPECT_LT(bt::relerr(got, want), 1e-5);
  EXPECT_LT(bt::relerr(as_mat(ao.data(), r, din_b), bt::matmul(A, Rin)), 1e-5);
  EXPECT_LT(bt::relerr(as_mat(bo.data(), dout_b, r),
                       scaled(bt::matmul(bt::transpose(Rout), B), alpha)),
            1e-5);
}

TEST(LoraTransport, PermutedTargetRecoversThePlantedUpdate) {
  // Target = source with permuted outputs and rotated inputs: W_B = P W_A
  // Q^T; the maps are R_out = P^T, R_in = Q^T, and the transferred update
  // must equal P (s B A) Q^T, the update written in the target's
  // coordinates.
  bt::Rng g(11);
  const size_t r = 4, d_out = 10, d_in = 8;
  Mat B = bt::randn(g, d_out, r), A = bt::randn(g, r, d_in);
  Mat P = bt::rand_perm(g, d_out), Q = bt::rand_orth(g, d_in);
  Mat Rout = bt::transpose(P), Rin = bt::transpose(Q);
  auto rout = Rout.f32(), rin = Rin.f32();
  float *routs[1] = {rout.data()};
  std::vector<float> bo(d_out * r), ao(r * d_in);
  bt::Ctx ctx;
  ASSERT_EQ(bico_lora_transport(ctx, r, 1, d_out, d_in, d_out, d_in, 1.0f,
                                B.f32().data(), A.f32().data(), routs, d_out,
                                rin.data(), d_in, bo.data(), ao.data()),
            BICO_OK);
  Mat got = bt::matmul(as_mat(bo.data(), d_out, r), as_mat(ao.data(), r, d_in));
  Mat want = bt::matmul(bt::matmul(P, bt::matmul(B, A)), bt::transpose(Q));
  EXPECT_LT(bt::relerr(got, want), 1e-5);
}

TEST(LoraTransport, FusedSplitActsOnRowBlocksOfB) {
  bt::Rng g(3);
  const size_t r = 2, k = 3, ba = 4, bb = 5, din = 6;
  Mat B = bt::randn(g, k * ba, r), A = bt::randn(g, r, din);
  std::vector<Mat> R;
  std::vector<std::vector<float>> rf;
  Mat Rfull(k * ba, k * bb);  // block-diagonal equivalent
  for (size_t j = 0; j < k; j++) {
    R.push_back(semi_orth(g, ba, bb));
    rf.push_back(R.back().f32());
    for (size_t i = 0; i < ba; i++)
      for (size_t c = 0; c < bb; c++) Rfull(j * ba + i, j * bb + c) = R[j](i, c);
  }
  float *routs[3] = {rf[0].data(), nullptr, rf[2].data()};  // block 1: identity
  for (size_t i = 0; i < ba; i++)
    for (size_t c = 0; c < bb; c++) Rfull(ba + i, bb + c) = i == c ? 1.0 : 0.0;
  std::vector<float> bo(k * bb * r), ao(r * din);
  bt::Ctx ctx;
  ASSERT_EQ(bico_lora_transport(ctx, r, k, k * ba, din, k * bb, din, 1.0f,
                                B.f32().data(), A.f32().data(), routs, bb,
                                nullptr, 0, bo.data(), ao.data()),
            BICO_OK)
      << bico_ctx_errmsg(ctx);
  EXPECT_LT(bt::relerr(as_mat(bo.data(), k * bb, r),
                       bt::matmul(bt::transpose(Rfull), B)),
            1e-6);
  EXPECT_EQ(bt::relerr(as_mat(ao.data(), r, din), f32(A)), 0.0);  // identity: copied
}

TEST(LoraTransport, BadInputIsRefusedWithAMessage) {
  bt::Ctx ctx;
  float b[6] = {1, 2, 3, 4, 5, 6}, a[6] = {1, 2, 3, 4, 5, 6}, bo[6], ao[6];
  EXPECT_EQ(bico_lora_transport(ctx, 2, 1, 3, 3, 3, 3, 1.0f, nullptr, a,
                                nullptr, 0, nullptr, 0, bo, ao),
            BICO_E_NULL);
  EXPECT_TRUE(mentions(ctx, "lora_transport: b is NULL"));
  EXPECT_EQ(bico_lora_transport(ctx, 2, 2, 3, 3, 3, 3, 1.0f, b, a, nullptr, 0,
                                nullptr, 0, bo, ao),
            BICO_E_SHAPE);
  EXPECT_TRUE(mentions(ctx, "do not split in 2 blocks")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_lora_transport(ctx, 0, 1, 3, 3, 3, 3, 1.0f, b, a, nullptr, 0,
                                nullptr, 0, bo, ao),
            BICO_E_SHAPE);
  b[4] = NAN;
  EXPECT_EQ(bico_lora_transport(ctx, 2, 1, 3, 3, 3, 3, 1.0f, b, a, nullptr, 0,
                                nullptr, 0, bo, ao),
            BICO_E_NONFINITE);
  EXPECT_TRUE(mentions(ctx, "b")) << bico_ctx_errmsg(ctx);
}

// ---------------------------------------------------------------------------
// Truncation

TEST(LoraTruncate, PlantedSpectrumGivesKnownEnergyAndBestFactors) {
  bt::Rng g(5);
  const size_t m = 7, n = 6, r = 2;
  Mat U = bt::rand_orth(g, m), W = bt::rand_orth(g, n);
  const double sv[6] = {5, 3, 1, 0.5, 0.25, 0};
  Mat D(m, n), Dr(m, n);
  for (size_t c = 0; c < 6; c++)
    for (size_t i = 0; i < m; i++)
      for (size_t j = 0; j < n; j++) {
        D(i, j) += sv[c] * U(i, c) * W(j, c);
        if (c < r) Dr(i, j) += sv[c] * U(i, c) * W(j, c);
      }
  double all = 0;
  for (double x : sv) all += x * x;
  const double scale = 0.5;
  std::vector<float> bo(m * r), ao(r * n);
  double energy = -1;
  bt::Ctx ctx;
  auto d = D.f32();
  ASSERT_EQ(bico_lora_truncate(ctx, m, n, r, scale, d.data(), n, bo.data(),
                               ao.data(), &energy),
            BICO_OK)
      << bico_ctx_errmsg(ctx);
  EXPECT_NEAR(energy, (25.0 + 9.0) / all, 1e-6);
  Mat got = scaled(bt::matmul(as_mat(bo.data(), m, r), as_mat(ao.data(), r, n)), scale);
  EXPECT_LT(bt::relerr(got, Dr), 1e-5);  // Eckart-Young: the top-2 part

  // A matrix of rank r comes back exactly, with all its energy.
  auto dr = Dr.f32();
  ASSERT_EQ(bico_lora_truncate(ctx, m, n, r, 1.0, dr.data(), n, bo.data(),
                               ao.data(), &energy),
            BICO_OK);
  EXPECT_NEAR(energy, 1.0, 1e-6);
  EXPECT_LT(bt::relerr(bt::matmul(as_mat(bo.data(), m, r), as_mat(ao.data(), r, n)), Dr), 1e-5);

  EXPECT_EQ(bico_lora_truncate(ctx, m, n, r, 0.0, d.data(), n, bo.data(),
                               ao.data(), &energy),
            BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "lora_truncate: scale 0"));
}

// ---------------------------------------------------------------------------
// Reading PEFT folders

struct PeftFixture {
  stt::TempDir dir;
  bt::Rng g{21};
  Mat qA = bt::randn(g, 4, 6), qB = bt::randn(g, 5, 4);   // rank 4 (default)
  Mat vA = bt::randn(g, 2, 6), vB = bt::randn(g, 5, 2);   // rank 2 (pattern)
  Mat eA = bt::randn(g, 4, 10), eB = bt::randn(g, 6, 4);  // embedding 10 x 6
  Mat head = bt::randn(g, 3, 6), head_b = bt::randn(g, 3, 1);
  std::string config(const std::string &extra = "") const {
    return "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": \"SEQ_CLS\",\n"
           "  \"base_model_name_or_path\": \"org/source\",\n"
           "  \"r\": 4,\n  \"lora_alpha\": 8,\n"
           "  \"rank_pattern\": {\"v_proj\": 2},\n"
           "  \"alpha_pattern\": {\"layers.0.v_proj\": 3.5},\n"
           "  \"target_modules\": [\"q_proj\", \"v_proj\", \"embed\"],\n"
           "  \"modules_to_save\": [\"classifier\"],\n"
           "  \"lora_dropout\": 0.05,\n  \"bias\": \"none\",\n"
           "  \"use_dora\": false,\n  \"layer_replication\": null,\n"
           "  \"fan_in_fan_out\": false" +
           extra + "\n}\n";
  }
  File tensors() const {
    return {{"layers.0.q_proj.lora_A.weight", T(qA)},
            {"layers.0.q_proj.lora_B.weight", T(qB)},
            {"layers.0.v_proj.lora_A.weight", T(vA)},
            {"layers.0.v_proj.lora_B.weight", T(vB)},
            {"embed.lora_embedding_A", T(eA)},
            {"embed.lora_embedding_B", T(eB)},
            {"classifier.weight", T(head)},
            {"classifier.bias", V(head_b)}};
  }
};

TEST(LoraRead, EveryFieldOfAHandWrittenAdapter) {
  PeftFixture fx;
  write_adapter(fx.dir.path, fx.config(", \"use_rslora\": true"), fx.tensors());
  bt::Ctx ctx;
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, fx.dir.path.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bt::count(bico_lora_module_count, l), 3u);
  double on = -1;
  ASSERT_EQ(bico_lora_get_param(l, BICO_LORA_RSLORA, &on), BICO_OK);
  EXPECT_EQ(on, 1);
  ASSERT_EQ(bico_lora_get_param(l, BICO_LORA_FAN_IN_FAN_OUT, &on), BICO_OK);
  EXPECT_EQ(on, 0);
  const char *str = nullptr;
  ASSERT_EQ(bico_lora_get_string(l, BICO_LORA_TASK_TYPE, &str), BICO_OK);
  EXPECT_STREQ(str, "SEQ_CLS");
  struct Want {
    const char *name;
    int kind;
    size_t rank, dout, din;
    double alpha;
    const Mat *b, *a;
  } want[3] = {{"layers.0.q_proj", BICO_LORA_LINEAR, 4, 5, 6, 8.0, &fx.qB, &fx.qA},
               {"layers.0.v_proj", BICO_LORA_LINEAR, 2, 5, 6, 3.5, &fx.vB, &fx.vA},
               {"embed", BICO_LORA_EMBEDDING, 4, 6, 10, 8.0, &fx.eB, &fx.eA}};
  for (auto &w : want) {
    size_t i = 99, rank, dout, din;
    int kind;
    double alpha, scale;
    const char *name;
    ASSERT_EQ(bico_lora_find_module(l, w.name, &i), BICO_OK) << w.name;
    ASSERT_EQ(bico_lora_module(l, i, &name, &kind, &rank, &dout, &din, &alpha, &scale), BICO_OK);
    EXPECT_STREQ(name, w.name);
    EXPECT_EQ(kind, w.kind) << w.name;
    EXPECT_EQ(rank, w.rank) << w.name;
    EXPECT_EQ(dout, w.dout) << w.name;
    EXPECT_EQ(din, w.din) << w.name;
    EXPECT_DOUBLE_EQ(alpha, w.alpha) << w.name;
    EXPECT_DOUBLE_EQ(scale, w.alpha / std::sqrt((double)w.rank)) << w.name;  // rsLoRA
    const float *b, *a;
    ASSERT_EQ(bico_lora_factors(l, i, &b, &a), BICO_OK);
    EXPECT_EQ(bt::relerr(as_mat(b, dout, rank), f32(*w.b)), 0.0) << w.name;
    EXPECT_EQ(bt::relerr(as_mat(a, rank, din), f32(*w.a)), 0.0) << w.name;
  }
  // The embedding's dense update is s B A in factor layout (the table delta
  // is its transpose).
  size_t ei;
  ASSERT_EQ(bico_lora_find_module(l, "embed", &ei), BICO_OK);
  std::vector<float> dense(6 * 10);
  ASSERT_EQ(bico_lora_dense(l, ei, 2.0f, 0.0f, dense.data(), 10), BICO_OK);
  EXPECT_LT(bt::relerr(as_mat(dense.data(), 6, 10),
                       scaled(bt::matmul(fx.eB, fx.eA), 2.0 * 8.0 / 2.0)),
            1e-6);
  ASSERT_EQ(bt::count(bico_lora_saved_count, l), 2u);
  for (size_t k = 0; k < 2; k++) {
    const char *name, *module;
    size_t ndim;
    const size_t *shape;
    const float *data;
    ASSERT_EQ(bico_lora_saved(l, k, &name, &module, &ndim, &shape, &data), BICO_OK);
    EXPECT_STREQ(module, "classifier");
    const Mat &m = std::string(name) == "classifier.weight" ? fx.head : fx.head_b;
    EXPECT_EQ(bt::relerr(Mat::from(data, m.r, m.c, m.c), f32(m)), 0.0) << name;
  }
  bico_lora_free(l);
}

TEST(LoraRead, PlainScaleAndFanInFanOut) {
  PeftFixture fx;
  std::string cfg = fx.config();
  cfg.replace(cfg.find("\"fan_in_fan_out\": false"), 23, "\"fan_in_fan_out\": true");
  write_adapter(fx.dir.path, cfg, fx.tensors());
  bt::Ctx ctx;
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, fx.dir.path.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  double on = 0;
  bico_lora_get_param(l, BICO_LORA_FAN_IN_FAN_OUT, &on);
  EXPECT_EQ(on, 1);
  size_t i;
  double scale;
  ASSERT_EQ(bico_lora_find_module(l, "layers.0.v_proj", &i), BICO_OK);
  ASSERT_EQ(bico_lora_module(l, i, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &scale), BICO_OK);
  EXPECT_DOUBLE_EQ(scale, 3.5 / 2);
  bico_lora_free(l);
}

TEST(LoraRead, SaveAndReopenKeepsEveryField) {
  PeftFixture fx;
  write_adapter(fx.dir.path, fx.config(), fx.tensors());
  bt::Ctx ctx;
  bico_lora *l = nullptr, *l2 = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, fx.dir.path.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bico_lora_set_param(l, BICO_LORA_RSLORA, 1), BICO_OK);
  ASSERT_EQ(bico_lora_set_param(l, BICO_LORA_FAN_IN_FAN_OUT, 1), BICO_OK);
  std::string out = fx.dir / "out";
  ASSERT_EQ(bico_lora_save(l, out.c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &l2), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bt::count(bico_lora_module_count, l2), bt::count(bico_lora_module_count, l));
  for (size_t i = 0; i < bt::count(bico_lora_module_count, l); i++) {
    const char *n1, *n2;
    int k1, k2;
    size_t r1, r2, o1, o2, i1, i2, j;
    double a1, a2, s1, s2;
    bico_lora_module(l, i, &n1, &k1, &r1, &o1, &i1, &a1, &s1);
    ASSERT_EQ(bico_lora_find_module(l2, n1, &j), BICO_OK) << n1;
    bico_lora_module(l2, j, &n2, &k2, &r2, &o2, &i2, &a2, &s2);
    EXPECT_EQ(k1, k2);
    EXPECT_EQ(r1, r2);
    EXPECT_EQ(o1, o2);
    EXPECT_EQ(i1, i2);
    EXPECT_DOUBLE_EQ(a1, a2) << n1;
    EXPECT_DOUBLE_EQ(s1, s2) << n1;
    const float *b1, *b2, *x1, *x2;
    bico_lora_factors(l, i, &b1, &x1);
    bico_lora_factors(l2, j, &b2, &x2);
    EXPECT_EQ(std::vector<float>(b1, b1 + o1 * r1), std::vector<float>(b2, b2 + o2 * r2));
    EXPECT_EQ(std::vector<float>(x1, x1 + r1 * i1), std::vector<float>(x2, x2 + r2 * i2));
  }
  EXPECT_EQ(bt::count(bico_lora_saved_count, l2), 2u);
  double on = 0;
  bico_lora_get_param(l2, BICO_LORA_RSLORA, &on);
  EXPECT_EQ(on, 1);
  bico_lora_get_param(l2, BICO_LORA_FAN_IN_FAN_OUT, &on);
  EXPECT_EQ(on, 1);
  const char *tt = nullptr;
  bico_lora_get_string(l2, BICO_LORA_TASK_TYPE, &tt);
  EXPECT_STREQ(tt, "SEQ_CLS");
  // The config names the full module names and the overrides.
  std::string cfg = stt::read_bytes(out + "/adapter_config.json");
  EXPECT_NE(cfg.find("\"layers.0.v_proj\": 2"), std::string::npos) << cfg;
  EXPECT_NE(cfg.find("\"layers.0.v_proj\": 3.5"), std::string::npos) << cfg;
  EXPECT_NE(cfg.find("\"embed\",\n    \"layers.0.q_proj\""), std::string::npos) << cfg;
  EXPECT_NE(cfg.find("\"modules_to_save\": [\n    \"classifier\"\n  ]"), std::string::npos) << cfg;
  // No temporary files are left behind.
  for (auto &e : std::filesystem::directory_iterator(out))
    EXPECT_EQ(e.path().filename().string().find("bico-tmp"), std::string::npos);
  bico_lora_free(l);
  bico_lora_free(l2);
}

struct Refusal {
  const char *what;
  std::string config_extra;
  File extra_tensors;
  bico_status status;
  std::vector<std::string> message;
};

TEST(LoraRead, UnsupportedOrInconsistentAdaptersAreRefused) {
  bt::Rng g(1);
  Mat mag = bt::randn(g, 5, 1);
  std::vector<Refusal> cases = {
      {"dora config", ", \"use_dora\": true", {}, BICO_E_UNSUPPORTED,
       {"adapter_config.json", "use_dora", "DoRA"}},
      {"dora tensor", "", {{"layers.0.q_proj.lora_magnitude_vector", V(mag)}},
       BICO_E_UNSUPPORTED, {"adapter_model.safetensors", "lora_magnitude_vector", "DoRA"}},
      {"bias all", ", \"bias\": \"all\"", {}, BICO_E_UNSUPPORTED, {"bias", "\"all\""}},
      {"replication", ", \"layer_replication\": [[0, 2]]", {}, BICO_E_UNSUPPORTED,
       {"layer_replication", "refusing"}},
      {"lora bias", ", \"lora_bias\": true", {}, BICO_E_UNSUPPORTED, {"lora_bias"}},
      {"regex", ", \"rank_pattern\": {\"^layers.*v_proj\": 2}", {}, BICO_E_UNSUPPORTED,
       {"rank_pattern", "regular expression"}},
      {"peft type", ", \"peft_type\": \"IA3\"", {}, BICO_E_UNSUPPORTED, {"IA3"}},
      {"stray tensor", "", {{"layers.0.k_proj.weight", V(mag)}}, BICO_E_FORMAT,
       {"layers.0.k_proj.weight", "modules_to_save"}},
  };
  for (auto &c : cases) {
    PeftFixture fx;
    std::string cfg = fx.config();
    // A repeated key would be invalid JSON: replace the existing one.
    if (c.config_extra.find("\"use_dora\"") != std::string::npos)
      cfg.replace(cfg.find("\"use_dora\": false"), 17, "\"use_dora\": true");
    else if (c.config_extra.find("\"bias\"") != std::string::npos)
      cfg.replace(cfg.find("\"bias\": \"none\""), 14, "\"bias\": \"all\"");
    else if (c.config_extra.find("\"layer_replication\"") != std::string::npos)
      cfg.replace(cfg.find("\"layer_replication\": null"), 25, "\"layer_replication\": [[0, 2]]");
    else if (c.config_extra.find("\"rank_pattern\"") != std::string::npos)
      cfg.replace(cfg.find("\"rank_pattern\": {\"v_proj\": 2}"), 29, c.config_extra.substr(2));
    else if (c.config_extra.find("\"peft_type\"") != std::string::npos)
      cfg.replace(cfg.find("\"peft_type\": \"LORA\""), 19, "\"peft_type\": \"IA3\"");
    else
      cfg = fx.config(c.config_extra);
    File t = fx.tensors();
    for (auto &e : c.extra_tensors) t.push_back(e);
    write_adapter(fx.dir.path, cfg, t);
    bt::Ctx ctx;
    bico_lora *l = reinterpret_cast<bico_lora *>(1);
    EXPECT_EQ(bico_lora_open(ctx, fx.dir.path.c_str(), &l), c.status) << c.what << ": " << bico_ctx_errmsg(ctx);
    EXPECT_EQ(l, nullptr) << c.what;
    for (auto &m : c.message) EXPECT_TRUE(mentions(ctx, m)) << c.what << ": " << bico_ctx_errmsg(ctx);
  }
}

TEST(LoraRead, MissingConfigRankMismatchAndUnpairedFactor) {
  PeftFixture fx;
  bt::Ctx ctx;
  bico_lora *l = nullptr;
  // Missing config.
  ttu::write_file(fx.dir / "adapter_model.safetensors",
           {{"base_model.model.x.lora_A.weight", T(fx.qA)}});
  EXPECT_EQ(bico_lora_open(ctx, fx.dir.path.c_str(), &l), BICO_E_IO);
  EXPECT_TRUE(mentions(ctx, fx.dir / "adapter_config.json")) << bico_ctx_errmsg(ctx);
  // Config r = 4 but v_proj's factors have rank 2 and no pattern says so.
  std::string cfg = fx.config();
  cfg.replace(cfg.find("\"rank_pattern\": {\"v_proj\": 2}"), 29, "\"rank_pattern\": {}");
  write_adapter(fx.dir.path, cfg, fx.tensors());
  EXPECT_EQ(bico_lora_open(ctx, fx.dir.path.c_str(), &l), BICO_E_SHAPE);
  EXPECT_TRUE(mentions(ctx, "layers.0.v_proj")) << bico_ctx_errmsg(ctx);
  EXPECT_TRUE(mentions(ctx, "rank 2")) << bico_ctx_errmsg(ctx);
  EXPECT_TRUE(mentions(ctx, "r = 4")) << bico_ctx_errmsg(ctx);
  // The pattern claims rank 3: named in the message.
  cfg = fx.config();
  cfg.replace(cfg.find("\"rank_pattern\": {\"v_proj\": 2}"), 29, "\"rank_pattern\": {\"v_proj\": 3}");
  write_adapter(fx.dir.path, cfg, fx.tensors());
  EXPECT_EQ(bico_lora_open(ctx, fx.dir.path.c_str(), &l), BICO_E_SHAPE);
  EXPECT_TRUE(mentions(ctx, "rank_pattern key \"v_proj\"")) << bico_ctx_errmsg(ctx);
  // A lora_A without its lora_B.
  File t = fx.tensors();
  t.erase(t.begin() + 1);
  write_adapter(fx.dir.path, fx.config(), t);
  EXPECT_EQ(bico_lora_open(ctx, fx.dir.path.c_str(), &l), BICO_E_FORMAT);
  EXPECT_TRUE(mentions(ctx, "layers.0.q_proj has lora_A but no lora_B")) << bico_ctx_errmsg(ctx);
  // Missing r.
  cfg = fx.config();
  cfg.replace(cfg.find("\"r\": 4,"), 7, "");
  write_adapter(fx.dir.path, cfg, fx.tensors());
  EXPECT_EQ(bico_lora_open(ctx, fx.dir.path.c_str(), &l), BICO_E_FORMAT);
  EXPECT_TRUE(mentions(ctx, "field r is missing")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(l, nullptr);
}

TEST(LoraWrite, FailedSaveLeavesExistingFilesAlone) {
  stt::TempDir dir;
  bt::Ctx ctx;
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_create(ctx, &l), BICO_OK);
  std::string out = dir / "adapter";
  EXPECT_EQ(bico_lora_save(l, out.c_str()), BICO_E_STATE);  // no modules
  float b[2] = {1, 2}, a[3] = {1, 2, 3};
  EXPECT_EQ(bico_lora_add_module(l, "m", BICO_LORA_LINEAR, 1, 2, 3, 0.0, b, a), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "alpha 0"));
  ASSERT_EQ(bico_lora_add_module(l, "m", BICO_LORA_LINEAR, 1, 2, 3, 2.0, b, a), BICO_OK);
  EXPECT_EQ(bico_lora_add_module(l, "m", BICO_LORA_LINEAR, 1, 2, 3, 2.0, b, a), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "module m added twice"));
  EXPECT_EQ(bico_lora_add_saved(l, "other.weight", "m", 1, nullptr, b), BICO_E_NULL);
  size_t sh[1] = {2};
  EXPECT_EQ(bico_lora_add_saved(l, "other.weight", "m", 1, sh, b), BICO_E_ARG);
  // An unwritable place: nothing is created, and an existing folder's
  // files stay byte-identical.
  ASSERT_EQ(bico_lora_save(l, out.c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
  std::string before = stt::read_bytes(out + "/adapter_config.json");
  std::string st_before = stt::read_bytes(out + "/adapter_model.safetensors");
  ASSERT_EQ(bico_lora_add_module(l, "n", BICO_LORA_LINEAR, 1, 2, 3, 2.0, b, a), BICO_OK);
  stt::write_bytes(out + "/blocker", "");
  if (geteuid() != 0) {
    chmod(out.c_str(), 0500);
    EXPECT_EQ(bico_lora_save(l, out.c_str()), BICO_E_IO);
    chmod(out.c_str(), 0700);
    EXPECT_EQ(stt::read_bytes(out + "/adapter_config.json"), before);
    EXPECT_EQ(stt::read_bytes(out + "/adapter_model.safetensors"), st_before);
  }
  std::string file_path = dir / "plainfile";
  stt::write_bytes(file_path, "x");
  EXPECT_EQ(bico_lora_save(l, file_path.c_str()), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "is not a folder")) << bico_ctx_errmsg(ctx);
  bico_lora_free(l);
}

// ---------------------------------------------------------------------------
// Memory of the factored path, counted through the context's allocator.

struct Counting {
  size_t live = 0, peak = 0;
};
void *count_alloc(void *o, size_t n) {
  auto *c = static_cast<Counting *>(o);
  auto *p = static_cast<size_t *>(std::malloc(n + 16));
  if (p == nullptr) return nullptr;
  p[0] = n;
  c->live += n;
  if (c->live > c->peak) c->peak = c->live;
  return reinterpret_cast<char *>(p) + 16;
}
void count_free(void *o, void *q) {
  if (q == nullptr) return;
  auto *p = reinterpret_cast<size_t *>(static_cast<char *>(q) - 16);
  static_cast<Counting *>(o)->live -= p[0];
  std::free(p);
}

TEST(LoraMemory, FactoredPathAllocatesNoDenseMatrix) {
  // d = 512, r = 8: a dense update would be 1 MiB of floats.  The
  // factored transport allocates nothing through the context (its outputs
  // are the caller's, O(r d)); the dense route (truncation) needs d^2
  // doubles.  Figures are printed for docs/lora.md.
  const size_t d = 512, r = 8;
  bt::Rng g(2);
  std::vector<float> b(d * r), a(r * d), bo(d * r), ao(r * d), rin(d * d), rout(d * d);
  for (auto &x : b) x = (float)g.normal();
  for (auto &x : a) x = (float)g.normal();
  for (size_t i = 0; i < d; i++) rin[i * d + (i * 7) % d] = rout[i * d + (i * 5) % d] = 1.0f;
  Counting c;
  bico_ctx *ctx = nullptr;
  ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, count_alloc, count_free, &c), BICO_OK);
  size_t base = c.peak;
  float *routs[1] = {rout.data()};
  ASSERT_EQ(bico_lora_transport(ctx, r, 1, d, d, d, d, 1.0f, b.data(), a.data(),
                                routs, d, rin.data(), d, bo.data(), ao.data()),
            BICO_OK);
  size_t factored = c.peak - base;
  EXPECT_EQ(factored, 0u);
  // Adapter in and out of a handle: its own size, 2 r d floats, plus names.
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_create(ctx, &l), BICO_OK);
  size_t before = c.live;
  ASSERT_EQ(bico_lora_add_module(l, "m", BICO_LORA_LINEAR, r, d, d, 16, bo.data(), ao.data()), BICO_OK);
  size_t held = c.live - before;
  // + the module-name index (a 64-slot table) and the name itself.
  EXPECT_LT(held, 2 * r * d * sizeof(float) + 2048);
  std::vector<float> dense(d * d);
  ASSERT_EQ(bico_lora_dense(l, 0, 1.0f, 0.0f, dense.data(), d), BICO_OK);
  c.peak = c.live;
  base = c.peak;
  ASSERT_EQ(bico_lora_truncate(ctx, d, d, r, 2.0, dense.data(), d, bo.data(), ao.data(), nullptr),
            BICO_OK);
  size_t dense_path = c.peak - base;
  EXPECT_GT(dense_path, d * d * sizeof(double));
  std::printf("[ figures  ] d = %zu, r = %zu: factored transport allocates %zu bytes; "
              "the adapter module holds %zu bytes (2 r d floats = %zu); "
              "the dense/truncate route peaks at %zu bytes (dense d^2 floats = %zu)\n",
              d, r, factored, held, 2 * r * d * sizeof(float), dense_path,
              d * d * sizeof(float));
  bico_lora_free(l);
  bico_ctx_free(ctx);
}

// ---------------------------------------------------------------------------
// The whole-model driver: a rotated chain, an adapter on both layers.

struct LoraChain {
  stt::TempDir dir;
  size_t d = 8, n = 96, r = 2;
  Mat W0, W1, Q, B0, A0, B1, A1;
  std::string A, B, calA, calB, ad;
  LoraChain() {
    bt::Rng g(42);
    W0 = bt::randn(g, d, d, 0.5);
    W1 = bt::randn(g, d, d, 0.5);
    Q = bt::rand_orth(g, d);
    B0 = bt::randn(g, d, r, 0.3);
    A0 = bt::randn(g, r, d, 0.3);
    B1 = bt::randn(g, d, r, 0.3);
    A1 = bt::randn(g, r, d, 0.3);
    Mat X = bt::randn(g, n, d), Z = bt::randn(g, n, d);
    Mat H = bt::matmul(X, bt::transpose(W0));
    Mat G0 = bt::matmul(Z, W1), Qt = bt::transpose(Q);
    A = dir / "A.safetensors";
    B = dir / "B.safetensors";
    calA = dir / "calA.safetensors";
    calB = dir / "calB.safetensors";
    ad = dir / "adapter";
    ttu::write_file(A, {{"blocks.0.fc.weight", T(W0)}, {"blocks.1.fc.weight", T(W1)}});
    ttu::write_file(B, {{"blocks.0.fc.weight", T(bt::matmul(Q, W0))},
                 {"blocks.1.fc.weight", T(bt::matmul(W1, Qt))}});
    ttu::write_file(calA, {{"blocks.0.fc.input", T(X)}, {"blocks.0.fc.output_grad", T(G0)},
                    {"blocks.1.fc.input", T(H)}, {"blocks.1.fc.output_grad", T(Z)}});
    ttu::write_file(calB, {{"blocks.0.fc.input", T(X)},
                    {"blocks.0.fc.output_grad", T(bt::matmul(G0, Qt))},
                    {"blocks.1.fc.input", T(bt::matmul(H, Qt))},
                    {"blocks.1.fc.output_grad", T(Z)}});
    mkdir(ad.c_str(), 0700);
    write_adapter(ad,
                  "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                  "\"target_modules\": [\"fc\"], \"bias\": \"none\"}",
                  {{"blocks.0.fc.lora_A.weight", T(A0)},
                   {"blocks.0.fc.lora_B.weight", T(B0)},
                   {"blocks.1.fc.lora_A.weight", T(A1)},
                   {"blocks.1.fc.lora_B.weight", T(B1)}});
  }
};

TEST(LoraTransfer, RotatedChainGivesTheRotatedAdapterAndCheckpoint) {
  LoraChain c;
  bt::Ctx ctx;
  bico_transfer *t = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  std::string out = c.dir / "out", ckpt = c.dir / "merged.safetensors", rep = c.dir / "r.json";
  const std::pair<int, std::string> files[] = {
      {BICO_FILE_SOURCE_BASE, c.A},     {BICO_FILE_TARGET_BASE, c.B},
      {BICO_FILE_SOURCE_CALIB, c.calA}, {BICO_FILE_TARGET_CALIB, c.calB},
      {BICO_FILE_LORA, c.ad},           {BICO_FILE_LORA_OUTPUT, out},
      {BICO_FILE_OUTPUT, ckpt},         {BICO_FILE_REPORT, rep}};
  for (auto &f : files) ASSERT_EQ(bico_transfer_set_file(t, f.first, f.second.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
  size_t updated = 0, unchanged = 9;
  ASSERT_EQ(bico_transfer_counts(t, &updated, &unchanged), BICO_OK);
  EXPECT_EQ(updated, 2u);
  EXPECT_EQ(unchanged, 0u);
  bico_transfer_free(t);
  // The planted answer: block 0's output space and block 1's input space
  // are rotated by Q, so dW0' = Q dW0, dW1' = dW1 Q^T (s = 4 / 2).
  const double s = 2.0;
  Mat want0 = bt::matmul(c.Q, scaled(bt::matmul(c.B0, c.A0), s));
  Mat want1 = bt::matmul(scaled(bt::matmul(c.B1, c.A1), s), bt::transpose(c.Q));
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bt::count(bico_lora_module_count, l), 2u);
  const Mat *wants[2] = {&want0, &want1};
  for (int k = 0; k < 2; k++) {
    size_t i, rank;
    double alpha, scale;
    std::string name = "blocks." + std::to_string(k) + ".fc";
    ASSERT_EQ(bico_lora_find_module(l, name.c_str(), &i), BICO_OK);
    bico_lora_module(l, i, nullptr, nullptr, &rank, nullptr, nullptr, &alpha, &scale);
    EXPECT_EQ(rank, c.r);
    EXPECT_EQ(alpha, 4.0);
    std::vector<float> dense(c.d * c.d);
    ASSERT_EQ(bico_lora_dense(l, i, 1.0f, 0.0f, dense.data(), c.d), BICO_OK);
    EXPECT_LT(bt::relerr(as_mat(dense.data(), c.d, c.d), *wants[k]), 1e-5) << name;
  }
  bico_lora_free(l);
  // --merge-into-base: the target base plus the same updates.
  auto m = ttu::read_file(ckpt), b = ttu::read_file(c.B);
  EXPECT_LT(bt::relerr(bt::sub(as_mat(m["blocks.0.fc.weight"], c.d, c.d),
                               as_mat(b["blocks.0.fc.weight"], c.d, c.d)),
                       want0),
            1e-5);
  EXPECT_LT(bt::relerr(bt::sub(as_mat(m["blocks.1.fc.weight"], c.d, c.d),
                               as_mat(b["blocks.1.fc.weight"], c.d, c.d)),
                       want1),
            1e-5);
  std::string r = stt::read_bytes(rep);
  // The modules report the handling their weights get on the checkpoint
  // path (bico_transfer_explain says the same), in the one table's words.
  int lin = 0;
  ASSERT_EQ(bico_transfer_handling_from_name("linear", &lin), BICO_OK);
  EXPECT_EQ(lin, BICO_HANDLING_LINEAR);
  EXPECT_NE(r.find("\"handling\": \"linear\""), std::string::npos) << r;
  EXPECT_NE(r.find("\"linear\": 2"), std::string::npos) << r;
  EXPECT_EQ(r.find("factored"), std::string::npos) << r;
  std::string cfg = stt::read_bytes(out + "/adapter_config.json");
  EXPECT_NE(cfg.find("\"blocks.0.fc\""), std::string::npos) << cfg;
  EXPECT_NE(cfg.find("\"lora_alpha\": 4"), std::string::npos) << cfg;
}

// Issue 25: a module on a dead layer (its calibration gradients all zero:
// the output statistic is zero and its map is an arbitrary completion) is
// left unchanged by the checkpoint path; the LoRA path must do the same for
// an adapter module and for a saved (modules_to_save) tensor, not carry it
// through the arbitrary map.
TEST(LoraTransfer, DeadLayerIsLeftUnchangedAsTheCheckpointPathLeavesIt) {
  LoraChain c;
  bt::Rng g(5);
  // Block 1's output gradients all zero in both models; block 0 alive.
  Mat X = bt::randn(g, c.n, c.d), G0 = bt::randn(g, c.n, c.d);
  Mat H = bt::matmul(X, bt::transpose(c.W0)), Qt = bt::transpose(c.Q);
  Mat Z0(c.n, c.d);
  std::string calA = c.dir / "deadA.safetensors", calB = c.dir / "deadB.safetensors";
  ttu::write_file(calA, {{"blocks.0.fc.input", T(X)}, {"blocks.0.fc.output_grad", T(G0)},
                  {"blocks.1.fc.input", T(H)}, {"blocks.1.fc.output_grad", T(Z0)}});
  ttu::write_file(calB, {{"blocks.0.fc.input", T(X)},
                  {"blocks.0.fc.output_grad", T(bt::matmul(G0, Qt))},
                  {"blocks.1.fc.input", T(bt::matmul(H, Qt))},
                  {"blocks.1.fc.output_grad", T(Z0)}});
  const double s = 2.0;
  Mat d0 = scaled(bt::matmul(c.B0, c.A0), s), d1 = scaled(bt::matmul(c.B1, c.A1), s);
  auto b = ttu::read_file(c.B);
  bt::Ctx ctx;
  auto run = [&](int slot, const std::string &in, const std::string &out,
                 const std::string &ckpt, const std::string &rep) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, c.A},   {BICO_FILE_TARGET_BASE, c.B},
        {BICO_FILE_SOURCE_CALIB, calA}, {BICO_FILE_TARGET_CALIB, calB},
        {slot, in},                     {BICO_FILE_REPORT, rep}};
    for (auto &f : files)
      EXPECT_EQ(bico_transfer_set_file(t, f.first, f.second.c_str()), BICO_OK);
    if (!out.empty()) bico_transfer_set_file(t, BICO_FILE_LORA_OUTPUT, out.c_str());
    if (!ckpt.empty()) bico_transfer_set_file(t, BICO_FILE_OUTPUT, ckpt.c_str());
    bico_status st = bico_transfer_run(t);
    size_t updated = 0;
    bico_transfer_counts(t, &updated, nullptr);
    bico_transfer_free(t);
    return std::make_pair(st, updated);
  };
  // The checkpoint path (the adapter's dense update as a tuned checkpoint):
  // block 1 unchanged, block 0 carried, the report says why.
  std::string tuned = c.dir / "tuned.safetensors", o1 = c.dir / "o1.safetensors",
              r1 = c.dir / "r1.json";
  ttu::write_file(tuned, {{"blocks.0.fc.weight", T(bt::add(c.W0, d0))},
                   {"blocks.1.fc.weight", T(bt::add(c.W1, d1))}});
  auto res = run(BICO_FILE_SOURCE_TUNED, tuned, "", o1, r1);
  ASSERT_EQ(res.first, BICO_OK) << bico_ctx_errmsg(ctx);
  auto o = ttu::read_file(o1);
  EXPECT_EQ(o["blocks.1.fc.weight"].v, b["blocks.1.fc.weight"].v);
  EXPECT_NE(o["blocks.0.fc.weight"].v, b["blocks.0.fc.weight"].v);
  EXPECT_NE(stt::read_bytes(r1).find("dead layer"), std::string::npos);
  // The LoRA path: the same rule.  Block 1's module is not in the output
  // adapter, the merged checkpoint keeps the target's weight, block 0 is
  // the planted Q d0, and the report names the dead layer.
  std::string out = c.dir / "out", ckpt = c.dir / "m.safetensors", rep = c.dir / "r.json";
  res = run(BICO_FILE_LORA, c.ad, out, ckpt, rep);
  ASSERT_EQ(res.first, BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(res.second, 1u);
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bt::count(bico_lora_module_count, l), 1u);
  size_t i;
  EXPECT_EQ(bico_lora_find_module(l, "blocks.1.fc", &i), BICO_E_NOTFOUND);
  ASSERT_EQ(bico_lora_find_module(l, "blocks.0.fc", &i), BICO_OK);
  std::vector<float> dense(c.d * c.d);
  ASSERT_EQ(bico_lora_dense(l, i, 1.0f, 0.0f, dense.data(), c.d), BICO_OK);
  EXPECT_LT(bt::relerr(as_mat(dense.data(), c.d, c.d), bt::matmul(c.Q, d0)), 1e-4);
  bico_lora_free(l);
  auto m = ttu::read_file(ckpt);
  EXPECT_EQ(m["blocks.1.fc.weight"].v, b["blocks.1.fc.weight"].v);
  std::string r = stt::read_bytes(rep);
  EXPECT_NE(r.find("\"handling\": \"unchanged\""), std::string::npos) << r;
  EXPECT_NE(r.find("dead layer"), std::string::npos) << r;
  // A saved (modules_to_save) tensor on the dead layer: the output's saved
  // tensor is the target's weight, unchanged, and the report says why.
  std::string sv = c.dir / "saved", out2 = c.dir / "out2", rep2 = c.dir / "r2.json";
  mkdir(sv.c_str(), 0700);
  write_adapter(sv,
                "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                "\"target_modules\": [\"fc\"], \"modules_to_save\": "
                "[\"blocks.1.fc\"], \"bias\": \"none\"}",
                {{"blocks.0.fc.lora_A.weight", T(c.A0)},
                 {"blocks.0.fc.lora_B.weight", T(c.B0)},
                 {"blocks.1.fc.weight", T(bt::add(c.W1, d1))}});
  res = run(BICO_FILE_LORA, sv, out2, "", rep2);
  ASSERT_EQ(res.first, BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bico_lora_open(ctx, out2.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bt::count(bico_lora_saved_count, l), 1u);
  const char *sn;
  const float *data;
  bico_lora_saved(l, 0, &sn, nullptr, nullptr, nullptr, &data);
  EXPECT_STREQ(sn, "blocks.1.fc.weight");
  EXPECT_EQ(std::vector<float>(data, data + c.d * c.d), b["blocks.1.fc.weight"].v);
  bico_lora_free(l);
  r = stt::read_bytes(rep2);
  EXPECT_NE(r.find("dead layer"), std::string::npos) << r;
}

// Issue 25, one driver: a saved (modules_to_save) tensor is carried by the
// checkpoint path's own step, so it comes out as the same tensor of a
// checkpoint transfer does (the planted answer dW1 Q^T on a live layer).
TEST(LoraTransfer, SavedTensorIsCarriedAsTheCheckpointPathCarriesIt) {
  LoraChain c;
  const double s = 2.0;
  Mat d1 = scaled(bt::matmul(c.B1, c.A1), s);
  bt::Ctx ctx;
  auto run = [&](int slot, const std::string &in, int out_slot,
                 const std::string &out) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, c.A},     {BICO_FILE_TARGET_BASE, c.B},
        {BICO_FILE_SOURCE_CALIB, c.calA}, {BICO_FILE_TARGET_CALIB, c.calB},
        {slot, in},                       {out_slot, out}};
    for (auto &f : files)
      EXPECT_EQ(bico_transfer_set_file(t, f.first, f.second.c_str()), BICO_OK);
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  };
  std::string tuned = c.dir / "tuned.safetensors", o1 = c.dir / "o1.safetensors";
  ttu::write_file(tuned, {{"blocks.0.fc.weight", T(c.W0)},
                   {"blocks.1.fc.weight", T(bt::add(c.W1, d1))}});
  ASSERT_EQ(run(BICO_FILE_SOURCE_TUNED, tuned, BICO_FILE_OUTPUT, o1), BICO_OK)
      << bico_ctx_errmsg(ctx);
  std::string sv = c.dir / "saved", out = c.dir / "out";
  mkdir(sv.c_str(), 0700);
  write_adapter(sv,
                "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                "\"target_modules\": [\"fc\"], \"modules_to_save\": "
                "[\"blocks.1.fc\"], \"bias\": \"none\"}",
                {{"blocks.0.fc.lora_A.weight", T(c.A0)},
                 {"blocks.0.fc.lora_B.weight", T(c.B0)},
                 {"blocks.1.fc.weight", T(bt::add(c.W1, d1))}});
  ASSERT_EQ(run(BICO_FILE_LORA, sv, BICO_FILE_LORA_OUTPUT, out), BICO_OK)
      << bico_ctx_errmsg(ctx);
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bt::count(bico_lora_saved_count, l), 1u);
  const float *data;
  bico_lora_saved(l, 0, nullptr, nullptr, nullptr, nullptr, &data);
  Mat saved = as_mat(data, c.d, c.d);
  bico_lora_free(l);
  auto o = ttu::read_file(o1), b = ttu::read_file(c.B);
  Mat ck = as_mat(o["blocks.1.fc.weight"], c.d, c.d);
  EXPECT_LT(bt::relerr(saved, ck), 1e-6);
  Mat base = as_mat(b["blocks.1.fc.weight"], c.d, c.d);
  EXPECT_LT(bt::relerr(bt::sub(saved, base), bt::matmul(d1, bt::transpose(c.Q))), 1e-4);
}

// Issue 25 (one writer): the merged checkpoint of a LoRA transfer is
// written by the checkpoint path's writer.  A target base stored in F64,
// with values float32 cannot hold, and carrying its own metadata: the saved
// (modules_to_save) tensor must come out bit for bit as the checkpoint path
// writes the same tensor (theta_B + update summed in double, rounded once,
// not through float32), every base tensor as the base has it, and the
// output keeps the target's metadata with the run's provenance.
TEST(LoraTransfer, MergedCheckpointIsWrittenByTheCheckpointPathsWriter) {
  LoraChain c;
  const double s = 2.0;
  Mat d1 = scaled(bt::matmul(c.B1, c.A1), s);
  bt::Rng g(77);
  // The target base in F64: Q W0, W1 Q^T plus detail below float32's grain.
  std::string B64 = c.dir / "B64.safetensors";
  {
    Mat w0 = bt::matmul(c.Q, c.W0), w1 = bt::matmul(c.W1, bt::transpose(c.Q));
    Mat fine = bt::randn(g, c.d, c.d, 1e-9);
    w0 = bt::add(w0, fine);
    w1 = bt::add(w1, fine);
    bt::Ctx wctx;
    bico_stwriter *w = nullptr;
    size_t sh[2] = {c.d, c.d};
    ASSERT_EQ(bico_stwriter_create(wctx, B64.c_str(), &w), BICO_OK);
    ASSERT_EQ(bico_stwriter_add_metadata(w, "format", "pt"), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "blocks.0.fc.weight", BICO_DTYPE_F64, 2, sh), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "blocks.1.fc.weight", BICO_DTYPE_F64, 2, sh), BICO_OK);
    ASSERT_EQ(bico_stwriter_write_f64(w, "blocks.0.fc.weight", w0.v.data(), w0.v.size()), BICO_OK);
    ASSERT_EQ(bico_stwriter_write_f64(w, "blocks.1.fc.weight", w1.v.data(), w1.v.size()), BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(wctx);
    bico_stwriter_free(w);
  }
  bt::Ctx ctx;
  auto run = [&](int slot, const std::string &in, const std::string &out) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, c.A},     {BICO_FILE_TARGET_BASE, B64},
        {BICO_FILE_SOURCE_CALIB, c.calA}, {BICO_FILE_TARGET_CALIB, c.calB},
        {slot, in},                       {BICO_FILE_OUTPUT, out}};
    for (auto &f : files)
      EXPECT_EQ(bico_transfer_set_file(t, f.first, f.second.c_str()), BICO_OK);
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  };
  // Only block 1 changes in the checkpoint run, as the saved tensor.
  std::string tuned = c.dir / "tuned.safetensors", o1 = c.dir / "o1.safetensors";
  ttu::write_file(tuned, {{"blocks.0.fc.weight", T(c.W0)},
                   {"blocks.1.fc.weight", T(bt::add(c.W1, d1))}});
  ASSERT_EQ(run(BICO_FILE_SOURCE_TUNED, tuned, o1), BICO_OK) << bico_ctx_errmsg(ctx);
  std::string sv = c.dir / "saved", merged = c.dir / "merged.safetensors";
  mkdir(sv.c_str(), 0700);
  write_adapter(sv,
                "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                "\"target_modules\": [\"fc\"], \"modules_to_save\": "
                "[\"blocks.1.fc\"], \"bias\": \"none\"}",
                {{"blocks.0.fc.lora_A.weight", T(c.A0)},
                 {"blocks.0.fc.lora_B.weight", T(c.B0)},
                 {"blocks.1.fc.weight", T(bt::add(c.W1, d1))}});
  ASSERT_EQ(run(BICO_FILE_LORA, sv, merged), BICO_OK) << bico_ctx_errmsg(ctx);
  auto f64 = [&](const std::string &path, const char *name, std::string *meta,
                 std::string *adapter) {
    bico_stfile *f = nullptr;
    std::vector<double> v(c.d * c.d);
    EXPECT_EQ(bico_stfile_open(ctx, path.c_str(), &f), BICO_OK) << bico_ctx_errmsg(ctx);
    if (f == nullptr) return v;
    size_t i;
    int dtype = 0;
    EXPECT_EQ(bico_stfile_find(f, name, &i), BICO_OK);
    bico_stfile_tensor_info(f, i, nullptr, &dtype, nullptr, nullptr);
    EXPECT_EQ(dtype, BICO_DTYPE_F64) << path << " " << name;
    EXPECT_EQ(bico_stfile_read_f64(f, i, v.data(), v.size()), BICO_OK);
    const char *m = nullptr;
    if (meta && bico_stfile_metadata_get(f, "format", &m) == BICO_OK) *meta = m;
    if (adapter && bico_stfile_metadata_get(f, "bico.source_adapter", &m) == BICO_OK)
      *adapter = m;
    bico_stfile_free(f);
    return v;
  };
  std::string fmt, src;
  auto ck = f64(o1, "blocks.1.fc.weight", nullptr, nullptr);
  auto lo = f64(merged, "blocks.1.fc.weight", &fmt, &src);
  auto base = f64(B64, "blocks.1.fc.weight", nullptr, nullptr);
  EXPECT_EQ(std::memcmp(ck.data(), lo.data(), ck.size() * sizeof(double)), 0)
      << "the saved tensor differs from the checkpoint path's";
  EXPECT_NE(std::memcmp(base.data(), lo.data(), base.size() * sizeof(double)), 0);
  EXPECT_EQ(fmt, "pt");
  EXPECT_EQ(src, sv);
  // Block 0 (the factored module): theta_B + s B' A' with theta_B's own
  // detail kept (a float32 sum would lose it).
  auto m0 = f64(merged, "blocks.0.fc.weight", nullptr, nullptr);
  auto b0 = f64(B64, "blocks.0.fc.weight", nullptr, nullptr);
  Mat want0 = bt::matmul(c.Q, scaled(bt::matmul(c.B0, c.A0), s)), got0(c.d, c.d);
  for (size_t e = 0; e < m0.size(); e++) got0.v[e] = m0[e] - b0[e];
  EXPECT_LT(bt::relerr(got0, want0), 1e-5);
}

TEST(LoraTransfer, PadTruncatesAndReportsEnergy) {
  LoraChain c;
  bt::Ctx ctx;
  bico_transfer *t = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  std::string out = c.dir / "out", rep = c.dir / "r.json";
  ASSERT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_PAD), BICO_OK);
  const std::pair<int, std::string> files[] = {
      {BICO_FILE_SOURCE_BASE, c.A}, {BICO_FILE_TARGET_BASE, c.B},
      {BICO_FILE_LORA, c.ad},       {BICO_FILE_LORA_OUTPUT, out},
      {BICO_FILE_REPORT, rep}};
  for (auto &f : files) ASSERT_EQ(bico_transfer_set_file(t, f.first, f.second.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_transfer_free(t);
  // Same shapes: pad is the identity, the update has rank r, so truncation
  // keeps all of it.
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  size_t i;
  ASSERT_EQ(bico_lora_find_module(l, "blocks.1.fc", &i), BICO_OK);
  std::vector<float> dense(c.d * c.d);
  ASSERT_EQ(bico_lora_dense(l, i, 1.0f, 0.0f, dense.data(), c.d), BICO_OK);
  EXPECT_LT(bt::relerr(as_mat(dense.data(), c.d, c.d), scaled(bt::matmul(c.B1, c.A1), 2.0)), 1e-5);
  bico_lora_free(l);
  std::string r = stt::read_bytes(rep);
  // pad's handling, as a checkpoint run names it; the truncation to rank r
  // is told by energy_kept and the summary's count.
  EXPECT_NE(r.find("\"handling\": \"padded\""), std::string::npos) << r;
  EXPECT_NE(r.find("\"truncated\": 2"), std::string::npos) << r;
  EXPECT_NE(r.find("\"energy_kept\": 1"), std::string::npos) << r;
}

TEST(LoraTransfer, EmbeddingAdapterFollowsItsTiedMap) {
  // The table's width is block 0's output space (rotated by Q in the
  // target): E_B = E Q^T, so the table delta must come out as dE Q^T.
  LoraChain c;
  bt::Rng g(8);
  const size_t V = 5;
  Mat E = bt::randn(g, V, c.d), eA = bt::randn(g, c.r, V), eB = bt::randn(g, c.d, c.r);
  std::string A2 = c.dir / "A2.safetensors", B2 = c.dir / "B2.safetensors", ad = c.dir / "emb";
  ttu::write_file(A2, {{"embed.weight", T(E)}, {"blocks.0.fc.weight", T(c.W0)},
                {"blocks.1.fc.weight", T(c.W1)}});
  ttu::write_file(B2, {{"embed.weight", T(bt::matmul(E, bt::transpose(c.Q)))},
                {"blocks.0.fc.weight", T(bt::matmul(c.Q, c.W0))},
                {"blocks.1.fc.weight", T(bt::matmul(c.W1, bt::transpose(c.Q)))}});
  mkdir(ad.c_str(), 0700);
  write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2}",
                {{"embed.lora_embedding_A", T(eA)}, {"embed.lora_embedding_B", T(eB)}});
  bt::Ctx ctx;
  std::string out = c.dir / "out", ckpt = c.dir / "m.safetensors";
  for (int tie = 0; tie < 2; tie++) {
    bico_transfer *t = nullptr;
    ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, A2},      {BICO_FILE_TARGET_BASE, B2},
        {BICO_FILE_SOURCE_CALIB, c.calA}, {BICO_FILE_TARGET_CALIB, c.calB},
        {BICO_FILE_LORA, ad},             {BICO_FILE_LORA_OUTPUT, out},
        {BICO_FILE_OUTPUT, ckpt}};
    for (auto &f : files) ASSERT_EQ(bico_transfer_set_file(t, f.first, f.second.c_str()), BICO_OK);
    if (tie) {
      ASSERT_EQ(bico_transfer_add_tie(t, "embed.weight", "blocks.0.fc"), BICO_OK);
    }
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    if (!tie) {
      // No map for the table: refused, naming the module, nothing written.
      EXPECT_EQ(st, BICO_E_NOTFOUND);
      EXPECT_TRUE(mentions(ctx, "adapter module embed")) << bico_ctx_errmsg(ctx);
      EXPECT_TRUE(mentions(ctx, "--tie")) << bico_ctx_errmsg(ctx);
      EXPECT_EQ(access(out.c_str(), F_OK), -1);
      EXPECT_EQ(access(ckpt.c_str(), F_OK), -1);
      continue;
    }
    ASSERT_EQ(st, BICO_OK) << bico_ctx_errmsg(ctx);
  }
  Mat want = bt::matmul(bt::transpose(bt::matmul(eB, eA)), bt::transpose(c.Q));  // s = 1
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  size_t i, dout, din;
  int kind;
  ASSERT_EQ(bico_lora_find_module(l, "embed", &i), BICO_OK);
  bico_lora_module(l, i, nullptr, &kind, nullptr, &dout, &din, nullptr, nullptr);
  EXPECT_EQ(kind, BICO_LORA_EMBEDDING);
  EXPECT_EQ(dout, c.d);
  EXPECT_EQ(din, V);
  std::vector<float> dense(c.d * V);
  ASSERT_EQ(bico_lora_dense(l, i, 1.0f, 0.0f, dense.data(), V), BICO_OK);
  EXPECT_LT(bt::relerr(bt::transpose(as_mat(dense.data(), c.d, V)), want), 1e-5);
  bico_lora_free(l);
  // Merged: the table delta is the transpose of the factor product.
  auto m = ttu::read_file(ckpt), b = ttu::read_file(B2);
  EXPECT_LT(bt::relerr(bt::sub(as_mat(m["embed.weight"], V, c.d), as_mat(b["embed.weight"], V, c.d)), want),
            1e-5);
}

TEST(LoraTransfer, GradfixMasksTheDenseUpdateAndTruncates) {
  // Source = target.  Votes agreeing with every sign of the update keep it
  // all (exactly rank r again); a random vote pattern keeps the fraction
  // counted here.
  LoraChain c;
  bt::Ctx ctx;
  const double s = 2.0;
  Mat d0 = scaled(bt::matmul(c.B0, c.A0), s), d1 = scaled(bt::matmul(c.B1, c.A1), s);
  bt::Rng g(4);
  Mat rv = bt::randn(g, c.d, c.d);
  size_t agree = 0;
  for (size_t e = 0; e < c.d * c.d; e++) agree += (rv.v[e] > 0) == (d1.v[e] > 0);
  auto signs = [](const Mat &m, double k) {
    Mat v = m;
    for (auto &x : v.v) x = x > 0 ? k : -k;
    return v;
  };
  std::string votes = c.dir / "votes.safetensors", out = c.dir / "out", rep = c.dir / "r.json";
  ttu::write_file(votes, {{"blocks.0.fc.weight", T(signs(d0, 3))},
                   {"blocks.1.fc.weight", T(signs(rv, 1))}});
  bico_transfer *t = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  ASSERT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_GRADFIX), BICO_OK);
  const std::pair<int, std::string> files[] = {
      {BICO_FILE_SOURCE_BASE, c.A}, {BICO_FILE_TARGET_BASE, c.A},
      {BICO_FILE_TARGET_VOTES, votes}, {BICO_FILE_LORA, c.ad},
      {BICO_FILE_LORA_OUTPUT, out}, {BICO_FILE_REPORT, rep}};
  for (auto &f : files) ASSERT_EQ(bico_transfer_set_file(t, f.first, f.second.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_transfer_free(t);
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  size_t i;
  std::vector<float> dense(c.d * c.d);
  ASSERT_EQ(bico_lora_find_module(l, "blocks.0.fc", &i), BICO_OK);
  ASSERT_EQ(bico_lora_dense(l, i, 1.0f, 0.0f, dense.data(), c.d), BICO_OK);
  EXPECT_LT(bt::relerr(as_mat(dense.data(), c.d, c.d), d0), 1e-5);
  bico_lora_free(l);
  std::string r = stt::read_bytes(rep);
  EXPECT_NE(r.find("\"kept_fraction\": 1"), std::string::npos) << r;
  char frac[64];
  std::snprintf(frac, sizeof frac, "\"kept_fraction\": %.9g", (double)agree / (c.d * c.d));
  EXPECT_NE(r.find(frac), std::string::npos) << frac << "\n" << r;
  EXPECT_NE(r.find("\"truncated\": 2"), std::string::npos) << r;
}

// Issue 25 (one driver): naive, pad and GradFix on the LoRA route take
// the checkpoint path's own per-tensor step, votes lent with
// bico_transfer_set_votes first as for a checkpoint.  A saved tensor
// (modules_to_save) under lent votes that disagree with the votes file
// must come out exactly as the same tensor of a checkpoint run.
TEST(LoraTransfer, GradfixSavedTensorTakesTheCheckpointPathsVotes) {
  LoraChain c;
  bt::Ctx ctx;
  Mat d1 = scaled(bt::matmul(c.B1, c.A1), 2.0);
  bt::Rng g(7);
  Mat file_v = bt::randn(g, c.d, c.d), lent_v = bt::randn(g, c.d, c.d);
  auto signs = [](const Mat &m) {
    Mat v = m;
    for (auto &x : v.v) x = x > 0 ? 1 : -1;
    return v;
  };
  std::string votes = c.dir / "votes.safetensors", tuned = c.dir / "tuned.safetensors";
  ttu::write_file(votes, {{"blocks.0.fc.weight", T(signs(file_v))},
                   {"blocks.1.fc.weight", T(signs(file_v))}});
  ttu::write_file(tuned, {{"blocks.0.fc.weight", T(c.W0)},
                   {"blocks.1.fc.weight", T(bt::add(c.W1, d1))}});
  std::string sv = c.dir / "saved";
  mkdir(sv.c_str(), 0700);
  write_adapter(sv,
                "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                "\"target_modules\": [\"fc\"], \"modules_to_save\": "
                "[\"blocks.1.fc\"], \"bias\": \"none\"}",
                {{"blocks.0.fc.lora_A.weight", T(c.A0)},
                 {"blocks.0.fc.lora_B.weight", T(c.B0)},
                 {"blocks.1.fc.weight", T(bt::add(c.W1, d1))}});
  std::vector<int32_t> counts(c.d * c.d);
  for (size_t e = 0; e < counts.size(); e++) counts[e] = lent_v.v[e] > 0 ? 1 : -1;
  bico_votes *lent = nullptr;
  ASSERT_EQ(bico_votes_create(ctx, counts.size(), 0, &lent), BICO_OK);
  ASSERT_EQ(bico_votes_add_counts(lent, counts.data(), 1), BICO_OK);
  auto run = [&](int slot, const std::string &in, int out_slot,
                 const std::string &out) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_GRADFIX),
              BICO_OK);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, c.A}, {BICO_FILE_TARGET_BASE, c.A},
        {BICO_FILE_TARGET_VOTES, votes}, {slot, in}, {out_slot, out}};
    for (auto &f : files)
      EXPECT_EQ(bico_transfer_set_file(t, f.first, f.second.c_str()), BICO_OK);
    EXPECT_EQ(bico_transfer_set_votes(t, "blocks.1.fc.weight", lent), BICO_OK);
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  };
  std::string o1 = c.dir / "o1.safetensors", out = c.dir / "out";
  ASSERT_EQ(run(BICO_FILE_SOURCE_TUNED, tuned, BICO_FILE_OUTPUT, o1), BICO_OK)
      << bico_ctx_errmsg(ctx);
  ASSERT_EQ(run(BICO_FILE_LORA, sv, BICO_FILE_LORA_OUTPUT, out), BICO_OK)
      << bico_ctx_errmsg(ctx);
  bico_votes_free(lent);
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &l), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bt::count(bico_lora_saved_count, l), 1u);
  const float *data;
  bico_lora_saved(l, 0, nullptr, nullptr, nullptr, nullptr, &data);
  Mat saved = as_mat(data, c.d, c.d);
  bico_lora_free(l);
  auto o = ttu::read_file(o1), a = ttu::read_file(c.A);
  Mat ck = as_mat(o["blocks.1.fc.weight"], c.d, c.d);
  EXPECT_LT(bt::relerr(saved, ck), 1e-6);
  // The planted mask: the lent votes' signs keep d1 where they agree.
  Mat want = d1;
  for (size_t e = 0; e < want.v.size(); e++)
    if ((lent_v.v[e] > 0) != (d1.v[e] > 0)) want.v[e] = 0;
  Mat base = as_mat(a["blocks.1.fc.weight"], c.d, c.d);
  EXPECT_LT(bt::relerr(bt::sub(saved, base), want), 1e-5);
}

// Issue 25 (one driver): the LoRA route's merged checkpoint goes through
// the checkpoint path's writer, so a folder output is sharded by
// BICO_TRANSFER_MAX_SHARD_SIZE as a checkpoint run's is.
TEST(LoraTransfer, MergedFolderIsShardedAsTheCheckpointPathShardsIt) {
  LoraChain c;
  bt::Ctx ctx;
  Mat d0 = scaled(bt::matmul(c.B0, c.A0), 2.0), d1 = scaled(bt::matmul(c.B1, c.A1), 2.0);
  std::string tuned = c.dir / "tuned.safetensors";
  ttu::write_file(tuned, {{"blocks.0.fc.weight", T(bt::add(c.W0, d0))},
                   {"blocks.1.fc.weight", T(bt::add(c.W1, d1))}});
  auto run = [&](int slot, const std::string &in, const std::string &out) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE), BICO_OK);
    // one 8 x 8 float tensor fits a shard, two do not
    EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_MAX_SHARD_SIZE, 300), BICO_OK);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, c.A}, {BICO_FILE_TARGET_BASE, c.A}, {slot, in},
        {BICO_FILE_OUTPUT, out}};
    for (auto &f : files)
      EXPECT_EQ(bico_transfer_set_file(t, f.first, f.second.c_str()), BICO_OK);
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  };
  auto listing = [](const std::string &dir) {
    std::vector<std::string> v;
    for (auto &e : std::filesystem::directory_iterator(dir))
      v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  };
  std::string o1 = c.dir / "ck/", o2 = c.dir / "lora/";
  ASSERT_EQ(run(BICO_FILE_SOURCE_TUNED, tuned, o1), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(run(BICO_FILE_LORA, c.ad, o2), BICO_OK) << bico_ctx_errmsg(ctx);
  auto l1 = listing(o1), l2 = listing(o2);
  EXPECT_GT(l1.size(), 2u);  // two shards and their index
  EXPECT_EQ(l1, l2);
}

TEST(LoraTransfer, ErrorsNameTheCulpritAndWriteNothing) {
  LoraChain c;
  bt::Ctx ctx;
  std::string out = c.dir / "out";
  auto run = [&](const std::string &adapter, int extra_slot = 0,
                 const std::string &extra = "") {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, c.A},     {BICO_FILE_TARGET_BASE, c.B},
        {BICO_FILE_SOURCE_CALIB, c.calA}, {BICO_FILE_TARGET_CALIB, c.calB},
        {BICO_FILE_LORA, adapter},        {BICO_FILE_LORA_OUTPUT, out}};
    for (auto &f : files) bico_transfer_set_file(t, f.first, f.second.c_str());
    if (extra_slot) bico_transfer_set_file(t, extra_slot, extra.c_str());
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  };
  // DoRA adapter.
  std::string dora = c.dir / "dora";
  mkdir(dora.c_str(), 0700);
  write_adapter(dora, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"use_dora\": true}",
                {{"blocks.0.fc.lora_A.weight", T(c.A0)}, {"blocks.0.fc.lora_B.weight", T(c.B0)}});
  EXPECT_EQ(run(dora), BICO_E_UNSUPPORTED);
  EXPECT_TRUE(mentions(ctx, "use_dora")) << bico_ctx_errmsg(ctx);
  // Adapter whose factors do not fit the source module.
  std::string bad = c.dir / "bad";
  mkdir(bad.c_str(), 0700);
  bt::Rng g(3);
  write_adapter(bad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4}",
                {{"blocks.0.fc.lora_A.weight", T(bt::randn(g, 2, 5))},
                 {"blocks.0.fc.lora_B.weight", T(c.B0)}});
  EXPECT_EQ(run(bad), BICO_E_SHAPE);
  EXPECT_TRUE(mentions(ctx, "blocks.0.fc")) << bico_ctx_errmsg(ctx);
  // An adapter for another model (a module the source base lacks).
  std::string other = c.dir / "other";
  mkdir(other.c_str(), 0700);
  write_adapter(other, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4}",
                {{"model.layers.0.fc.lora_A.weight", T(c.A0)},
                 {"model.layers.0.fc.lora_B.weight", T(c.B0)}});
  EXPECT_EQ(run(other), BICO_E_NOTFOUND);
  EXPECT_TRUE(mentions(ctx, "module model.layers.0.fc is not a module of the source base"))
      << bico_ctx_errmsg(ctx);
  // Missing adapter folder.
  EXPECT_EQ(run(c.dir / "nowhere"), BICO_E_IO);
  EXPECT_TRUE(mentions(ctx, "nowhere/adapter_config.json")) << bico_ctx_errmsg(ctx);
  // A task vector and an adapter at once.
  EXPECT_EQ(run(c.ad, BICO_FILE_TASK_VECTOR, c.A), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "task vector")) << bico_ctx_errmsg(ctx);
  // Output onto the input adapter.
  bico_transfer *t = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  for (auto &f : std::vector<std::pair<int, std::string>>{
           {BICO_FILE_SOURCE_BASE, c.A}, {BICO_FILE_TARGET_BASE, c.B},
           {BICO_FILE_SOURCE_CALIB, c.calA}, {BICO_FILE_TARGET_CALIB, c.calB},
           {BICO_FILE_LORA, c.ad}, {BICO_FILE_LORA_OUTPUT, c.ad}})
    bico_transfer_set_file(t, f.first, f.second.c_str());
  EXPECT_EQ(bico_transfer_run(t), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "is the same file as the source adapter")) << bico_ctx_errmsg(ctx);
  bico_transfer_free(t);
  EXPECT_EQ(access(out.c_str(), F_OK), -1);
}

// Issue 14: an output that is an input under another spelling was written
// over it with exit 0.  Every spelling must be refused, with the source
// adapter and the target base byte-identical afterwards.
TEST(LoraTransfer, OutputsThatAreInputsUnderAnotherSpellingAreRefused) {
  LoraChain c;
  bt::Ctx ctx;
  const std::string ad_w = c.ad + "/adapter_model.safetensors";
  const std::string ad_c = c.ad + "/adapter_config.json";
  const std::string before_w = stt::read_bytes(ad_w), before_c = stt::read_bytes(ad_c);
  const std::string before_b = stt::read_bytes(c.B);
  std::string link = c.dir / "adlink";
  ASSERT_EQ(symlink(c.ad.c_str(), link.c_str()), 0);
  std::string cwd_rel;  // "./<dir>/adapter" from the folder above
  auto run = [&](int slot, const std::string &path, int slot2 = 0,
                 const std::string &path2 = "") {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, c.A},     {BICO_FILE_TARGET_BASE, c.B},
        {BICO_FILE_SOURCE_CALIB, c.calA}, {BICO_FILE_TARGET_CALIB, c.calB},
        {BICO_FILE_LORA, c.ad}};
    for (auto &f : files) bico_transfer_set_file(t, f.first, f.second.c_str());
    bico_transfer_set_file(t, slot, path.c_str());
    if (slot2) bico_transfer_set_file(t, slot2, path2.c_str());
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  };
  for (const std::string &spelling :
       {c.ad + "/", c.ad + "/.", c.dir / "./adapter", link, link + "/"}) {
    SCOPED_TRACE("--output-lora " + spelling);
    EXPECT_EQ(run(BICO_FILE_LORA_OUTPUT, spelling), BICO_E_ARG);
    EXPECT_TRUE(mentions(ctx, "same file as the source adapter")) << bico_ctx_errmsg(ctx);
  }
  // --merge-into-base style: the checkpoint written onto the adapter's
  // weights, or onto the target base through a symbolic link.
  EXPECT_EQ(run(BICO_FILE_OUTPUT, c.ad + "//adapter_model.safetensors"), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "source adapter weights")) << bico_ctx_errmsg(ctx);
  std::string blink = c.dir / "B-link.safetensors";
  ASSERT_EQ(symlink(c.B.c_str(), blink.c_str()), 0);
  EXPECT_EQ(run(BICO_FILE_OUTPUT, blink), BICO_E_ARG);
  // The report onto the output adapter's config (an existing, empty
  // folder; a missing one fails too, for the report's missing folder).
  std::string out = c.dir / "out";
  EXPECT_EQ(run(BICO_FILE_LORA_OUTPUT, out, BICO_FILE_REPORT,
                out + "/./adapter_config.json"),
            BICO_E_IO);
  mkdir(out.c_str(), 0755);
  EXPECT_EQ(run(BICO_FILE_LORA_OUTPUT, out, BICO_FILE_REPORT,
                out + "/./adapter_config.json"),
            BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "output adapter config")) << bico_ctx_errmsg(ctx);
  EXPECT_TRUE(std::filesystem::is_empty(out));
  EXPECT_EQ(stt::read_bytes(ad_w), before_w);
  EXPECT_EQ(stt::read_bytes(ad_c), before_c);
  EXPECT_EQ(stt::read_bytes(c.B), before_b);
}

// Issue 14: with --output-lora D where D/adapter_config.json is a folder,
// the weights were replaced and then the run failed, calling the config a
// "report".  Now every destination is checked first: nothing changes.
TEST(LoraTransfer, AFailedDestinationLeavesEveryOutputAsItWas) {
  LoraChain c;
  bt::Ctx ctx;
  std::string out = c.dir / "out", ck = c.dir / "ck.safetensors";
  mkdir(out.c_str(), 0755);
  const std::string old_w = "old weights", old_ck = "old checkpoint";
  stt::write_bytes(out + "/adapter_model.safetensors", old_w);
  stt::write_bytes(ck, old_ck);
  auto run = [&](const std::string &report) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, c.A},     {BICO_FILE_TARGET_BASE, c.B},
        {BICO_FILE_SOURCE_CALIB, c.calA}, {BICO_FILE_TARGET_CALIB, c.calB},
        {BICO_FILE_LORA, c.ad},           {BICO_FILE_LORA_OUTPUT, out},
        {BICO_FILE_OUTPUT, ck}};
    for (auto &f : files) bico_transfer_set_file(t, f.first, f.second.c_str());
    if (!report.empty()) bico_transfer_set_file(t, BICO_FILE_REPORT, report.c_str());
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  };
  // The config's place is a folder.
  mkdir((out + "/adapter_config.json").c_str(), 0755);
  EXPECT_NE(run(""), BICO_OK);
  EXPECT_TRUE(mentions(ctx, "adapter config")) << bico_ctx_errmsg(ctx);
  EXPECT_FALSE(mentions(ctx, "report")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(stt::read_bytes(out + "/adapter_model.safetensors"), old_w);
  EXPECT_EQ(stt::read_bytes(ck), old_ck);
  rmdir((out + "/adapter_config.json").c_str());
  // The report names a folder.
  std::string rdir = c.dir / "rdir";
  mkdir(rdir.c_str(), 0755);
  EXPECT_NE(run(rdir), BICO_OK);
  EXPECT_EQ(stt::read_bytes(out + "/adapter_model.safetensors"), old_w);
  EXPECT_EQ(stt::read_bytes(ck), old_ck);
  EXPECT_EQ(access((out + "/adapter_config.json").c_str(), F_OK), -1);
  // The report is a FIFO: refused, and still a FIFO.
  std::string fifo = c.dir / "fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  EXPECT_EQ(run(fifo), BICO_E_ARG);
  struct stat sb;
  ASSERT_EQ(lstat(fifo.c_str(), &sb), 0);
  EXPECT_TRUE(S_ISFIFO(sb.st_mode));
  EXPECT_EQ(stt::read_bytes(ck), old_ck);
  // All destinations fine: everything lands, no temporary left.
  EXPECT_EQ(run(c.dir / "report.json"), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_NE(stt::read_bytes(ck), old_ck);
  EXPECT_NE(stt::read_bytes(out + "/adapter_model.safetensors"), old_w);
  for (const std::string &d : {c.dir.path, out})
    for (auto &e : std::filesystem::directory_iterator(d))
      EXPECT_EQ(e.path().filename().string().find("bico-tmp"), std::string::npos);
}

// Issue 14: an adapter with 40k modules took 25 s to save (mode_of counted
// pairs) and its lookups were linear.  Near-linear now: 40k modules, each
// added, looked up and saved, well inside a generous bound.
TEST(LoraScale, FortyThousandModulesAreNearLinear) {
  stt::TempDir dir;
  bt::Ctx ctx;
  bico_lora *l = nullptr;
  ASSERT_EQ(bico_lora_create(ctx, &l), BICO_OK);
  const size_t n = 40000;
  const float b[2] = {0.5f, -0.25f}, a[2] = {1.0f, 2.0f};
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < n; i++) {
    std::string name = "layers." + std::to_string(i) + ".q";
    // Ranks all 1; alphas 1..3 in thirds: the mode is the one kept in r /
    // lora_alpha, the rest go to alpha_pattern.
    ASSERT_EQ(bico_lora_add_module(l, name.c_str(), BICO_LORA_LINEAR, 1, 2, 1,
                                   1.0 + (double)(i % 3 == 0), b, a),
              BICO_OK);
  }
  size_t k = 0;
  ASSERT_EQ(bico_lora_find_module(l, "layers.39999.q", &k), BICO_OK);
  EXPECT_EQ(k, n - 1);
  std::string ad = dir / "ad";
  ASSERT_EQ(bico_lora_save(l, ad.c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 10.0) << "40k modules took " << secs << " s";
  std::string cfg = stt::read_bytes(ad + "/adapter_config.json");
  // 2/3 of the modules have alpha 1: that is the mode.
  EXPECT_NE(cfg.find("\"lora_alpha\": 1,"), std::string::npos) << cfg.substr(0, 300);
  bico_lora_free(l);
  bico_lora *back = nullptr;
  t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(bico_lora_open(ctx, ad.c_str(), &back), BICO_OK) << bico_ctx_errmsg(ctx);
  secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 10.0) << "opening 40k modules took " << secs << " s";
  EXPECT_EQ(bt::count(bico_lora_module_count, back), n);
  bico_lora_free(back);
}

}  // namespace

// ---------------------------------------------------------------------------
// Allocation failures: every one is BICO_E_NOMEM, leaks nothing and writes
// nothing.

namespace {

using bt::Failing;
using bt::fail_free;
const bico_alloc_fn fail_alloc = bt::fail_once_alloc;

// Runs body(ctx) failing allocation k = 1, 2, ... until it succeeds.
template <class F>
void sweep(F body, const std::vector<std::string> &outputs) {
  bool done = false;
  long k;
  for (k = 1; k < 100000 && !done; k++) {
    Failing f;
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
    f.fail_at = f.count + k;
    bico_status st = body(ctx);
    if (st == BICO_OK) {
      done = true;
    } else {
      EXPECT_EQ(st, BICO_E_NOMEM) << "allocation " << k << ": " << bico_ctx_errmsg(ctx);
      for (auto &o : outputs)
        EXPECT_EQ(access(o.c_str(), F_OK), -1) << "allocation " << k << ": " << o;
    }
    EXPECT_EQ(f.live, 1) << "leak after failing allocation " << k;
    bico_ctx_free(ctx);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_TRUE(done);
  EXPECT_GT(k, 10);
}

TEST(LoraOom, OpenAndSave) {
  PeftFixture fx;
  write_adapter(fx.dir.path, fx.config(), fx.tensors());
  std::string out = fx.dir / "out";
  sweep(
      [&](bico_ctx *ctx) {
        bico_lora *l = nullptr;
        bico_status st = bico_lora_open(ctx, fx.dir.path.c_str(), &l);
        if (st == BICO_OK) st = bico_lora_save(l, out.c_str());
        bico_lora_free(l);
        if (st == BICO_OK) {
          std::remove((out + "/adapter_config.json").c_str());
          std::remove((out + "/adapter_model.safetensors").c_str());
        }
        rmdir(out.c_str());
        return st;
      },
      {out + "/adapter_config.json", out + "/adapter_model.safetensors"});
}

TEST(LoraOom, WholeModelTransfer) {
  LoraChain c;
  std::string out = c.dir / "out", ckpt = c.dir / "m.safetensors", rep = c.dir / "r.json";
  sweep(
      [&](bico_ctx *ctx) {
        bico_transfer *t = nullptr;
        bico_status st = bico_transfer_create(ctx, &t);
        const std::pair<int, std::string> files[] = {
            {BICO_FILE_SOURCE_BASE, c.A},     {BICO_FILE_TARGET_BASE, c.B},
            {BICO_FILE_SOURCE_CALIB, c.calA}, {BICO_FILE_TARGET_CALIB, c.calB},
            {BICO_FILE_LORA, c.ad},           {BICO_FILE_LORA_OUTPUT, out},
            {BICO_FILE_OUTPUT, ckpt},         {BICO_FILE_REPORT, rep}};
        for (auto &f : files)
          if (st == BICO_OK) st = bico_transfer_set_file(t, f.first, f.second.c_str());
        if (st == BICO_OK) st = bico_transfer_add_split(t, "fc", 2);
        if (st == BICO_OK) st = bico_transfer_run(t);
        bico_transfer_free(t);
        if (st == BICO_OK)
          for (auto &p : {out + "/adapter_config.json", out + "/adapter_model.safetensors", ckpt, rep})
            std::remove(p.c_str());
        rmdir(out.c_str());
        return st;
      },
      {out + "/adapter_config.json", out + "/adapter_model.safetensors", ckpt, rep});
}

// target_modules by PEFT's rules (issue 32): a module's factors are read
// when target_modules names it -- a list entry equal to its name or a
// dotted suffix of it, a regular expression its whole name matches,
// "all-linear" (every linear module but lm_head), or no target_modules --
// and refused, naming the file and the module, when it does not (PEFT
// would not apply them).  Python-only regular expression syntax is refused.
TEST(LoraOpen, TargetModulesByPeftsRules) {
  stt::TempDir dir;
  bt::Ctx ctx;
  bt::Rng g(8);
  Mat a = bt::randn(g, 1, 3), b = bt::randn(g, 2, 1);
  const File factors = {{"model.layers.0.self_attn.q_proj.lora_A.weight", T(a)},
                        {"model.layers.0.self_attn.q_proj.lora_B.weight", T(b)},
                        {"model.layers.0.mlp.up_proj.lora_A.weight", T(a)},
                        {"model.layers.0.mlp.up_proj.lora_B.weight", T(b)},
                        {"lm_head.lora_A.weight", T(a)},
                        {"lm_head.lora_B.weight", T(b)}};
  struct Case {
    const char *targets;  // the JSON value, or nullptr: absent
    bico_status want;
    const char *refused;  // the module the message names
  } cases[] = {
      {nullptr, BICO_OK, nullptr},
      {"null", BICO_OK, nullptr},
      {"[\"q_proj\", \"up_proj\", \"lm_head\"]", BICO_OK, nullptr},
      {"[\"self_attn.q_proj\", \"mlp.up_proj\", \"lm_head\"]", BICO_OK, nullptr},
      // "proj" is no dotted suffix of q_proj: a suffix must end at a dot
      {"[\"proj\", \"lm_head\"]", BICO_E_FORMAT, "model.layers.0.self_attn.q_proj"},
      {"[\"q_proj\", \"lm_head\"]", BICO_E_FORMAT, "model.layers.0.mlp.up_proj"},
      {"\".*(q_proj|up_proj)|lm_head\"", BICO_OK, nullptr},
      // a full match: "q_proj" alone matches no whole name
      {"\"q_proj|.*up_proj|lm_head\"", BICO_E_FORMAT, "model.layers.0.self_attn.q_proj"},
      {"\"all-linear\"", BICO_E_FORMAT, "lm_head"},
      {"\".*\\\\.(q|up)_proj\\\\d*|lm_head\"", BICO_E_UNSUPPORTED, "\\d"},
      {"\"(?:.*q_proj)|.*\"", BICO_E_UNSUPPORTED, "(?"},
      {"\"[\"", BICO_E_FORMAT, "not a regular expression"},
      // expressions whose compiled form would be exponential in their
      // length (glibc's regcomp copies x for x+ and x{n}): refused first
      {"\"ti+++++++++++++++++++++++++++++++ny\"", BICO_E_UNSUPPORTED,
       "a repetition of a repetition"},
      {"\"(.*q_proj){9}{9}|lm_head\"", BICO_E_UNSUPPORTED,
       "a repetition of a repetition"},
      {"\"((((((((((((((((((.*_proj+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+|lm_head\"",
       BICO_E_UNSUPPORTED, "too large once compiled"},
      {"\"((.*(q|up)_proj|x){300}){300}|lm_head\"", BICO_E_UNSUPPORTED,
       "too large once compiled"},
      // a bound, a bracket and a nested plus of a sane size are read
      {"\".*(q|up)_pro[j]{1}(_[0-9]+)?|lm_he{1,2}ad\"", BICO_OK, nullptr},
      {"42", BICO_E_FORMAT, "target_modules"},
  };
  int k = 0;
  for (auto &c : cases) {
    SCOPED_TRACE(c.targets ? c.targets : "(absent)");
    std::string ad = dir / ("ad" + std::to_string(k++));
    mkdir(ad.c_str(), 0700);
    std::string cfg = "{\"peft_type\": \"LORA\", \"r\": 1, \"lora_alpha\": 1";
    if (c.targets) cfg += std::string(", \"target_modules\": ") + c.targets;
    write_adapter(ad, cfg + "}", factors);
    bico_lora *l = reinterpret_cast<bico_lora *>(&ctx);
    EXPECT_EQ(bico_lora_open(ctx, ad.c_str(), &l), c.want) << bico_ctx_errmsg(ctx);
    if (c.want == BICO_OK) {
      EXPECT_EQ(bt::count(bico_lora_module_count, l), 3u);
    } else {
      EXPECT_EQ(l, nullptr);
      EXPECT_TRUE(mentions(ctx, c.refused)) << bico_ctx_errmsg(ctx);
      EXPECT_TRUE(mentions(ctx, ad + "/adapter_")) << bico_ctx_errmsg(ctx);
    }
    bico_lora_free(l);
  }
}

}  // namespace
