// Merging task vectors through the public API: task arithmetic and TIES
// against a hand-worked example and against a reference implemented here
// (from the description of TIES-merging and mergekit's options, not from
// lib/merge/merge.c), then whole checkpoints with every kind of input and the
// refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "st_testutil.h"
#include "testutil.h"
#include "transfer_testutil.h"

namespace {

using Vec = std::vector<float>;

bool mentions(bico_ctx *ctx, const std::string &what) {
  return std::string(bico_ctx_errmsg(ctx)).find(what) != std::string::npos;
}

Vec merge(bico_ctx *ctx, int method, const std::vector<Vec> &taus,
          const std::vector<double> &w, const std::vector<double> &d,
          int normalize, bico_status want = BICO_OK) {
  // Arrays of pointers are T *const * (docs/api.md): a table of const
  // pointers is passed with a cast; the library writes through none.
  std::vector<float *> p;
  for (auto &t : taus) p.push_back(const_cast<float *>(t.data()));
  Vec out(taus[0].size(), -99.0f);
  EXPECT_EQ(bico_merge_tensor(ctx, method, taus.size(), out.size(), p.data(),
                              w.data(), d.empty() ? nullptr : d.data(),
                              normalize, out.data()),
            want)
      << bico_ctx_errmsg(ctx);
  return out;
}

TEST(MergeTensor, HandWorkedExample) {
  bt::Ctx ctx;
  // Weighted: t1 = [2, -3, 1, 0], 0.5 t2 = [-0.5, -0.5, 1, 2.5]; mass
  // [1.5, -3.5, 2, 2.5] elects [+, -, +, +].
  std::vector<Vec> taus = {{2, -3, 1, 0}, {-1, -1, 2, 5}};
  std::vector<double> w = {1.0, 0.5};
  Vec ties = merge(ctx, BICO_MERGE_TIES, taus, w, {}, 1);
  Vec want = {2.0f, (float)(-3.5 / 1.5), (float)(2.0 / 1.5), 5.0f};
  for (size_t i = 0; i < 4; i++) EXPECT_FLOAT_EQ(ties[i], want[i]) << i;
  Vec ties_sum = merge(ctx, BICO_MERGE_TIES, taus, w, {}, 0);
  Vec want_sum = {2.0f, -3.5f, 2.0f, 2.5f};
  for (size_t i = 0; i < 4; i++) EXPECT_FLOAT_EQ(ties_sum[i], want_sum[i]) << i;
  Vec lin = merge(ctx, BICO_MERGE_LINEAR, taus, w, {}, 0);
  Vec want_lin = {1.5f, -3.5f, 2.0f, 2.5f};
  for (size_t i = 0; i < 4; i++) EXPECT_FLOAT_EQ(lin[i], want_lin[i]) << i;
  Vec lin_n = merge(ctx, BICO_MERGE_LINEAR, taus, w, {}, 1);
  for (size_t i = 0; i < 4; i++) EXPECT_FLOAT_EQ(lin_n[i], (float)(want_lin[i] / 1.5)) << i;
  // Density 0.5 keeps 2 of 4: t1 -> [0, -3, 0, 0]... |2| and |-3| kept:
  // [2, -3, 0, 0]; t2 -> [0, 0, 2, 5].  No conflicts remain.
  Vec trimmed = merge(ctx, BICO_MERGE_TIES, taus, w, {0.5, 0.5}, 1);
  Vec want_t = {2.0f, -3.0f, 2.0f, 5.0f};
  for (size_t i = 0; i < 4; i++) EXPECT_FLOAT_EQ(trimmed[i], want_t[i]) << i;
  // Magnitude ties go to the earlier entry: [1, -1, 1] at density 1/3
  // keeps entry 0 only.
  Vec tie = merge(ctx, BICO_MERGE_TIES, {{1, -1, 1}}, {1.0}, {0.34}, 1);
  EXPECT_EQ(tie, (Vec{1, 0, 0}));
}

// TIES as the paper and mergekit describe it, written independently.
Vec ties_reference(const std::vector<Vec> &taus, const std::vector<double> &w,
                   const std::vector<double> &d, bool normalize) {
  size_t n = taus[0].size(), T = taus.size();
  std::vector<std::vector<double>> kept(T, std::vector<double>(n, 0.0));
  for (size_t t = 0; t < T; t++) {
    std::vector<size_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
      return std::fabs(taus[t][a]) > std::fabs(taus[t][b]);
    });
    size_t k = d[t] >= 1 ? n : (size_t)std::floor(d[t] * n);
    for (size_t j = 0; j < k; j++) kept[t][idx[j]] = w[t] * taus[t][idx[j]];
  }
  Vec out(n);
  for (size_t i = 0; i < n; i++) {
    double mass = 0;
    for (size_t t = 0; t < T; t++) mass += kept[t][i];
    double sign = mass >= 0 ? 1 : -1, num = 0, den = 0;
    for (size_t t = 0; t < T; t++)
      if (kept[t][i] * sign > 0) {
        num += kept[t][i];
        den += w[t];
      }
    out[i] = (float)(normalize && den != 0 ? num / den : num);
  }
  return out;
}

TEST(MergeTensor, TiesMatchesAnIndependentReference) {
  bt::Ctx ctx;
  bt::Rng g(17);
  for (int trial = 0; trial < 20; trial++) {
    size_t T = 1 + trial % 4, n = 50 + trial * 7;
    std::vector<Vec> taus(T, Vec(n));
    std::vector<double> w(T), d(T);
    for (size_t t = 0; t < T; t++) {
      // Quantised values: many exact magnitude ties and zeros.
      for (auto &x : taus[t]) x = (float)std::round(g.normal() * 3) / 2;
      w[t] = trial % 3 == 0 ? 1.0 : 0.2 + g.uniform() * 1.5;
      if (trial % 5 == 4 && t == 0) w[t] = -0.7;  // a subtracted task
      d[t] = 0.1 + 0.9 * g.uniform();
    }
    int norm = trial % 2;
    Vec got = merge(ctx, BICO_MERGE_TIES, taus, w, d, norm);
    Vec want = ties_reference(taus, w, d, norm);
    for (size_t i = 0; i < n; i++)
      ASSERT_NEAR(got[i], want[i], 1e-5 * (1 + std::fabs(want[i])))
          << "trial " << trial << " entry " << i;
  }
}

TEST(MergeTensor, BadInputIsRefused) {
  bt::Ctx ctx;
  std::vector<Vec> taus = {{1, 2}, {3, 4}};
  merge(ctx, BICO_MERGE_LINEAR, taus, {1, 1}, {0.5, 1}, 0, BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "TIES only")) << bico_ctx_errmsg(ctx);
  merge(ctx, BICO_MERGE_TIES, taus, {1, 1}, {0.0, 1}, 0, BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "densities[0] is 0")) << bico_ctx_errmsg(ctx);
  merge(ctx, BICO_MERGE_TIES, taus, {1, NAN}, {}, 0, BICO_E_NONFINITE);
  EXPECT_TRUE(mentions(ctx, "weights[1]")) << bico_ctx_errmsg(ctx);
  merge(ctx, 7, taus, {1, 1}, {}, 0, BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "unknown method 7"));
  merge(ctx, BICO_MERGE_TIES, {{1, NAN}}, {1}, {}, 0, BICO_E_NONFINITE);
  float out[1];
  EXPECT_EQ(bico_merge_tensor(ctx, BICO_MERGE_TIES, 0, 1, nullptr, nullptr,
                              nullptr, 0, out),
            BICO_E_NULL);
}

// ---------------------------------------------------------------------------
// Whole checkpoints

using ttu::File;
using ttu::Tensor;

Vec randv(bt::Rng &g, size_t n, double s = 1.0) {
  Vec v(n);
  for (auto &x : v) x = (float)(s * g.normal());
  return v;
}

struct Checkpoints {
  stt::TempDir dir;
  bt::Rng g{5};
  Vec W = randv(g, 12), b = randv(g, 3), t1W = randv(g, 12, 0.1),
      t1b = randv(g, 3, 0.1), t2W = randv(g, 12, 0.1), ftW = randv(g, 12, 0.1),
      ftb = randv(g, 3, 0.1), loB = randv(g, 3 * 2), loA = randv(g, 2 * 4);
  std::string base = dir / "base.safetensors", tv1 = dir / "tv1.safetensors",
              tv2 = dir / "tv2.safetensors", ft = dir / "ft.safetensors",
              ad = dir / "adapter", out = dir / "out.safetensors";
  Checkpoints() {
    ttu::write_file(base, {{"fc.weight", {{3, 4}, W}}, {"fc.bias", {{3}, b}}});
    ttu::write_file(tv1, {{"fc.weight", {{3, 4}, t1W}}, {"fc.bias", {{3}, t1b}}});
    ttu::write_file(tv2, {{"fc.weight", {{3, 4}, t2W}}});  // no bias: zero for this task
    Vec ftw(12), ftbv(3);
    for (size_t i = 0; i < 12; i++) ftw[i] = W[i] + ftW[i];
    for (size_t i = 0; i < 3; i++) ftbv[i] = b[i] + ftb[i];
    ttu::write_file(ft, {{"fc.weight", {{3, 4}, ftw}}, {"fc.bias", {{3}, ftbv}}});
    mkdir(ad.c_str(), 0700);
    stt::write_bytes(ad + "/adapter_config.json",
                     "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 3}");
    ttu::write_file(ad + "/adapter_model.safetensors",
             {{"base_model.model.fc.lora_A.weight", {{2, 4}, loA}},
              {"base_model.model.fc.lora_B.weight", {{3, 2}, loB}}});
  }
  // The adapter's dense update 1.5 B A, computed here.
  Vec lora_dense() const {
    Vec d(12, 0.0f);
    for (size_t i = 0; i < 3; i++)
      for (size_t j = 0; j < 4; j++) {
        double s = 0;
        for (size_t k = 0; k < 2; k++) s += (double)loB[i * 2 + k] * loA[k * 4 + j];
        d[i * 4 + j] = (float)(1.5 * s);
      }
    return d;
  }
};

struct Merger {
  bico_merge *m = nullptr;
  explicit Merger(bico_ctx *ctx) { EXPECT_EQ(bico_merge_create(ctx, &m), BICO_OK); }
  ~Merger() { bico_merge_free(m); }
};

TEST(MergeRun, EveryInputKindAgainstTheReference) {
  Checkpoints c;
  bt::Ctx ctx;
  for (int method : {BICO_MERGE_LINEAR, BICO_MERGE_TIES}) {
    Merger mg(ctx);
    std::string delta = c.dir / "delta.safetensors", rep = c.dir / "rep.json";
    ASSERT_EQ(bico_merge_set_file(mg.m, BICO_MERGE_FILE_BASE, c.base.c_str()), BICO_OK);
    ASSERT_EQ(bico_merge_set_file(mg.m, BICO_MERGE_FILE_OUTPUT, c.out.c_str()), BICO_OK);
    ASSERT_EQ(bico_merge_set_file(mg.m, BICO_MERGE_FILE_DELTA_OUTPUT, delta.c_str()), BICO_OK);
    ASSERT_EQ(bico_merge_set_file(mg.m, BICO_MERGE_FILE_REPORT, rep.c_str()), BICO_OK);
    ASSERT_EQ(bico_merge_set_param(mg.m, BICO_MERGE_METHOD, method), BICO_OK);
    ASSERT_EQ(bico_merge_set_param(mg.m, BICO_MERGE_ALPHA, 0.8), BICO_OK);
    double d = method == BICO_MERGE_TIES ? 0.5 : 1.0;
    ASSERT_EQ(bico_merge_add_input(mg.m, BICO_MERGE_TASK_VECTOR, c.tv1.c_str(), 1.0, d), BICO_OK);
    ASSERT_EQ(bico_merge_add_input(mg.m, BICO_MERGE_TASK_VECTOR, c.tv2.c_str(), 0.5, d), BICO_OK);
    ASSERT_EQ(bico_merge_add_input(mg.m, BICO_MERGE_TUNED, c.ft.c_str(), 0.7, d), BICO_OK);
    ASSERT_EQ(bico_merge_add_input(mg.m, BICO_MERGE_LORA, c.ad.c_str(), 1.2, d), BICO_OK);
    ASSERT_EQ(bico_merge_run(mg.m), BICO_OK) << bico_ctx_errmsg(ctx);
    auto o = ttu::read_file(c.out), dl = ttu::read_file(delta);
    // Weight: four tasks; bias: tv1 and ft only (tv2 and the adapter lack it).
    std::vector<Vec> tw = {c.t1W, c.t2W, c.ftW, c.lora_dense()};
    std::vector<double> ww = {1.0, 0.5, 0.7, 1.2}, dw(4, d);
    std::vector<Vec> tb = {c.t1b, c.ftb};
    std::vector<double> wb = {1.0, 0.7}, db(2, d);
    Vec mw(12), mb(3);
    if (method == BICO_MERGE_TIES) {
      mw = ties_reference(tw, ww, dw, true);
      mb = ties_reference(tb, wb, db, true);
    } else {
      for (size_t i = 0; i < 12; i++)
        for (size_t t = 0; t < 4; t++) mw[i] += (float)(ww[t] * tw[t][i]);
      for (size_t i = 0; i < 3; i++) mb[i] = (float)(c.t1b[i] + 0.7 * c.ftb[i]);
    }
    for (size_t i = 0; i < 12; i++) {
      EXPECT_NEAR(o["fc.weight"].v[i], c.W[i] + 0.8 * mw[i], 1e-5) << method << " " << i;
      EXPECT_NEAR(dl["fc.weight"].v[i], 0.8 * mw[i], 1e-5) << method << " " << i;
    }
    for (size_t i = 0; i < 3; i++)
      EXPECT_NEAR(o["fc.bias"].v[i], c.b[i] + 0.8 * mb[i], 1e-5) << method << " " << i;
    std::string r = stt::read_bytes(rep);
    EXPECT_NE(r.find("\"tasks\": 4"), std::string::npos) << r;
    EXPECT_NE(r.find("\"tasks\": 2"), std::string::npos) << r;
  }
}

TEST(MergeRun, RefusalsNameTheProblemAndWriteNothing) {
  Checkpoints c;
  bt::Ctx ctx;
  auto run = [&](const std::string &input, int kind, double density, int method,
                 const std::string &out) {
    Merger mg(ctx);
    bico_merge_set_file(mg.m, BICO_MERGE_FILE_BASE, c.base.c_str());
    bico_merge_set_file(mg.m, BICO_MERGE_FILE_OUTPUT, out.c_str());
    bico_merge_set_param(mg.m, BICO_MERGE_METHOD, method);
    bico_merge_add_input(mg.m, BICO_MERGE_TASK_VECTOR, c.tv1.c_str(), 1.0, density);
    bico_merge_add_input(mg.m, kind, input.c_str(), 1.0, density);
    return bico_merge_run(mg.m);
  };
  std::string extra = c.dir / "extra.safetensors", shape = c.dir / "shape.safetensors",
              nan = c.dir / "nan.safetensors";
  ttu::write_file(extra, {{"head.weight", {{2}, {1, 2}}}});
  ttu::write_file(shape, {{"fc.bias", {{4}, {1, 2, 3, 4}}}});
  ttu::write_file(nan, {{"fc.bias", {{3}, {1, NAN, 3}}}});
  EXPECT_EQ(run(extra, BICO_MERGE_TASK_VECTOR, 1, BICO_MERGE_LINEAR, c.out), BICO_E_NOTFOUND);
  EXPECT_TRUE(mentions(ctx, "head.weight is not in the base")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(run(shape, BICO_MERGE_TASK_VECTOR, 1, BICO_MERGE_LINEAR, c.out), BICO_E_SHAPE);
  // both shapes named
  EXPECT_TRUE(mentions(ctx, "fc.bias is [4] there but [3] in the base")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(run(nan, BICO_MERGE_TASK_VECTOR, 1, BICO_MERGE_LINEAR, c.out), BICO_E_NONFINITE);
  EXPECT_TRUE(mentions(ctx, "fc.bias")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(run(c.tv2, BICO_MERGE_TASK_VECTOR, 0.5, BICO_MERGE_LINEAR, c.out), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "TIES only")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(run(c.tv2, BICO_MERGE_TASK_VECTOR, 1, BICO_MERGE_LINEAR, c.tv1), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, c.tv1)) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(run(c.dir / "none", BICO_MERGE_LORA, 1, BICO_MERGE_LINEAR, c.out), BICO_E_IO);
  EXPECT_TRUE(mentions(ctx, "none/adapter_config.json")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(access(c.out.c_str(), F_OK), -1);
  // An existing output stays byte-identical after a failed run.
  stt::write_bytes(c.out, "keep me");
  EXPECT_EQ(run(extra, BICO_MERGE_TASK_VECTOR, 1, BICO_MERGE_LINEAR, c.out), BICO_E_NOTFOUND);
  EXPECT_EQ(stt::read_bytes(c.out), "keep me");
  Merger mg(ctx);
  EXPECT_EQ(bico_merge_add_input(mg.m, BICO_MERGE_TUNED, "x", 1.0, 1.5), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "density 1.5")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_merge_set_param(mg.m, BICO_MERGE_ALPHA, 0.0), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "alpha = 0 is outside (0, ")) << bico_ctx_errmsg(ctx);
  // The option grammar: bounds say what set_param takes, names both ways.
  double lo, hi, v;
  unsigned fl;
  ASSERT_EQ(bico_merge_param_bounds(BICO_MERGE_ALPHA, &lo, &hi, &fl), BICO_OK);
  EXPECT_EQ(fl, (unsigned)BICO_PARAM_LO_OPEN);
  EXPECT_EQ(bico_merge_set_param(mg.m, BICO_MERGE_ALPHA, hi), BICO_OK);
  EXPECT_EQ(bico_merge_set_param(mg.m, BICO_MERGE_ALPHA, 1e39), BICO_E_ARG);  // no float
  ASSERT_EQ(bico_merge_param_bounds(BICO_MERGE_NORMALIZE, &lo, &hi, &fl), BICO_OK);
  EXPECT_EQ(lo, -1.0);
  EXPECT_EQ(fl, (unsigned)BICO_PARAM_INTEGER);
  EXPECT_EQ(bico_merge_set_param(mg.m, BICO_MERGE_NORMALIZE, 0.5), BICO_E_ARG);
  EXPECT_EQ(bico_merge_param_bounds(9, &lo, &hi, &fl), BICO_E_ARG);
  ASSERT_EQ(bico_merge_set_param(mg.m, BICO_MERGE_ALPHA, 0.25), BICO_OK);
  ASSERT_EQ(bico_merge_get_param(mg.m, BICO_MERGE_ALPHA, &v), BICO_OK);
  EXPECT_EQ(v, 0.25);
  EXPECT_STREQ(bico_merge_param_name(BICO_MERGE_NORMALIZE), "normalize");
  int pk = 0;
  EXPECT_EQ(bico_merge_param_from_name("method", &pk), BICO_OK);
  EXPECT_EQ(pk, BICO_MERGE_METHOD);
  EXPECT_EQ(bico_merge_param_from_name("lambda", &pk), BICO_E_NOTFOUND);
  bico_merge_set_file(mg.m, BICO_MERGE_FILE_BASE, c.base.c_str());
  bico_merge_set_file(mg.m, BICO_MERGE_FILE_OUTPUT, c.out.c_str());
  EXPECT_EQ(bico_merge_run(mg.m), BICO_E_ARG);
  EXPECT_TRUE(mentions(ctx, "no inputs")) << bico_ctx_errmsg(ctx);
}

// bico_merge_check: the run's option rules without the run.  A good
// configuration passes and leaves the folder as it was; each broken rule
// fails with BICO_E_ARG and a message naming the file slot or the input,
// and the same configuration's run fails with the same status.
TEST(MergeCheck, RulesOfTheRunWithoutTheRun) {
  Checkpoints c;
  bt::Ctx ctx;
  std::string rep = c.dir / "rep.json", missing = c.dir / "missing.safetensors";
  struct Config {
    bool base = true, output = true, inputs = true;
    double density = 1;
    int method = BICO_MERGE_LINEAR;
    std::string report;
  };
  auto make = [&](Merger &mg, const Config &k) {
    if (k.base) bico_merge_set_file(mg.m, BICO_MERGE_FILE_BASE, c.base.c_str());
    if (k.output) bico_merge_set_file(mg.m, BICO_MERGE_FILE_OUTPUT, c.out.c_str());
    if (!k.report.empty())
      bico_merge_set_file(mg.m, BICO_MERGE_FILE_REPORT, k.report.c_str());
    bico_merge_set_param(mg.m, BICO_MERGE_METHOD, k.method);
    if (k.inputs) {
      EXPECT_EQ(bico_merge_add_input(mg.m, BICO_MERGE_TASK_VECTOR, c.tv1.c_str(), 1.0,
                                     1.0),
                BICO_OK);
      EXPECT_EQ(bico_merge_add_input(mg.m, BICO_MERGE_TUNED, c.ft.c_str(), 0.5,
                                     k.density),
                BICO_OK);
    }
  };
  auto check = [&](const Config &k, int level = BICO_MERGE_CHECK_OPTIONS) {
    Merger mg(ctx);
    make(mg, k);
    return bico_merge_check(mg.m, level);
  };
  auto runs = [&](const Config &k) {
    Merger mg(ctx);
    make(mg, k);
    return bico_merge_run(mg.m);
  };
  EXPECT_EQ(bico_merge_check(nullptr, 0), BICO_E_NULL);
  Config good;
  good.report = rep;
  EXPECT_EQ(check(good), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(check(good, BICO_MERGE_CHECK_INPUTS), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(check(good, 0), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(access(c.out.c_str(), F_OK), -1);  // nothing written
  EXPECT_EQ(access(rep.c_str(), F_OK), -1);
  Config ties = good;
  ties.method = BICO_MERGE_TIES;
  ties.density = 0.5;
  EXPECT_EQ(check(ties), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(access(c.out.c_str(), F_OK), -1);

  struct Bad {
    Config k;
    std::vector<std::string> says;
  };
  std::vector<Bad> bad;
  bad.push_back({good, {"missing the base file"}});
  bad.back().k.base = false;
  bad.push_back({good, {"missing the output file"}});
  bad.back().k.output = false;
  bad.push_back({good, {"no inputs"}});
  bad.back().k.inputs = false;
  bad.push_back({good, {"the output file and the report file", c.out}});
  bad.back().k.report = c.out;
  bad.push_back({good, {c.ft, "density 0.5", "TIES only"}});
  bad.back().k.density = 0.5;
  for (const Bad &b : bad)
    for (int level : {BICO_MERGE_CHECK_OPTIONS, BICO_MERGE_CHECK_INPUTS}) {
      EXPECT_EQ(check(b.k, level), BICO_E_ARG) << b.says[0];
      std::string msg = bico_ctx_errmsg(ctx);
      EXPECT_EQ(msg.rfind("merge_check: ", 0), 0u) << msg;
      for (const std::string &w : b.says) EXPECT_TRUE(mentions(ctx, w)) << msg;
      EXPECT_EQ(access(c.out.c_str(), F_OK), -1);
      EXPECT_EQ(runs(b.k), BICO_E_ARG) << b.says[0];  // the run's own rule
    }
  // An unknown level is refused.
  {
    Merger mg(ctx);
    make(mg, good);
    EXPECT_EQ(bico_merge_check(mg.m, 3), BICO_E_ARG);
    EXPECT_TRUE(mentions(ctx, "level 3")) << bico_ctx_errmsg(ctx);
  }
  // What needs the files: the options level passes, the inputs level
  // refuses as the run does (a missing input, an input tensor of another
  // shape than the base's, an output that is an input), writing nothing
  // and leaving the inputs as they were.
  std::string odd = c.dir / "odd.safetensors";
  ttu::write_file(odd, {{"fc.weight", {{4, 3}, c.W}}});
  std::string ft_bytes = stt::read_bytes(c.ft);
  struct FileCase {
    std::string input, output;
    bico_status st;
    std::vector<std::string> says;
  };
  const FileCase files[] = {
      {missing, c.out, BICO_E_IO, {missing}},
      {odd, c.out, BICO_E_SHAPE, {odd, "fc.weight", "[4, 3]", "[3, 4]"}},
      {c.ft, (c.dir / ".") + "/ft.safetensors", BICO_E_ARG, {"output"}},
  };
  for (const FileCase &fc : files) {
    auto setup = [&](Merger &mg) {
      bico_merge_set_file(mg.m, BICO_MERGE_FILE_BASE, c.base.c_str());
      bico_merge_set_file(mg.m, BICO_MERGE_FILE_OUTPUT, fc.output.c_str());
      ASSERT_EQ(bico_merge_add_input(mg.m, BICO_MERGE_TUNED, fc.input.c_str(), 1, 1),
                BICO_OK);
    };
    Merger mg(ctx);
    setup(mg);
    EXPECT_EQ(bico_merge_check(mg.m, BICO_MERGE_CHECK_OPTIONS), BICO_OK)
        << bico_ctx_errmsg(ctx);
    EXPECT_EQ(bico_merge_check(mg.m, BICO_MERGE_CHECK_INPUTS), fc.st) << fc.input;
    std::string msg = bico_ctx_errmsg(ctx);
    if (fc.st != BICO_E_IO) {  // (an unopenable file: the reader's message)
      EXPECT_EQ(msg.rfind("merge_check: ", 0), 0u) << msg;
    }
    for (const std::string &w : fc.says) EXPECT_TRUE(mentions(ctx, w)) << msg;
    EXPECT_EQ(access(c.out.c_str(), F_OK), -1);
    EXPECT_EQ(stt::read_bytes(c.ft), ft_bytes);
    // The same handle checked twice gives the same answer (files closed
    // after each check), and its run fails alike.
    EXPECT_EQ(bico_merge_check(mg.m, 0), fc.st) << fc.input;
    EXPECT_EQ(bico_merge_run(mg.m), fc.st) << fc.input;
    EXPECT_TRUE(mentions(ctx, fc.says[0])) << bico_ctx_errmsg(ctx);
    EXPECT_EQ(stt::read_bytes(c.ft), ft_bytes);
  }
  // The good configuration then runs.
  EXPECT_EQ(runs(good), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(access(c.out.c_str(), F_OK), 0);
}

}  // namespace

namespace {

using bt::Failing;
using bt::fail_free;
const bico_alloc_fn fail_alloc = bt::fail_once_alloc;

TEST(MergeOom, EveryAllocationFailureIsReportedAndCleanedUp) {
  Checkpoints c;
  std::string rep = c.dir / "rep.json", delta = c.dir / "delta.safetensors";
  bool done = false;
  long k;
  for (k = 1; k < 100000 && !done; k++) {
    Failing f;
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
    f.fail_at = f.count + k;
    bico_merge *m = nullptr;
    bico_status st = bico_merge_create(ctx, &m);
    if (st == BICO_OK) st = bico_merge_set_file(m, BICO_MERGE_FILE_BASE, c.base.c_str());
    if (st == BICO_OK) st = bico_merge_set_file(m, BICO_MERGE_FILE_OUTPUT, c.out.c_str());
    if (st == BICO_OK) st = bico_merge_set_file(m, BICO_MERGE_FILE_DELTA_OUTPUT, delta.c_str());
    if (st == BICO_OK) st = bico_merge_set_file(m, BICO_MERGE_FILE_REPORT, rep.c_str());
    if (st == BICO_OK) st = bico_merge_set_param(m, BICO_MERGE_METHOD, BICO_MERGE_TIES);
    if (st == BICO_OK) st = bico_merge_add_input(m, BICO_MERGE_TASK_VECTOR, c.tv1.c_str(), 1, 0.5);
    if (st == BICO_OK) st = bico_merge_add_input(m, BICO_MERGE_TUNED, c.ft.c_str(), 1, 0.5);
    if (st == BICO_OK) st = bico_merge_add_input(m, BICO_MERGE_LORA, c.ad.c_str(), 1, 0.5);
    if (st == BICO_OK) st = bico_merge_run(m);
    bico_merge_free(m);
    if (st == BICO_OK) {
      done = true;
    } else {
      EXPECT_EQ(st, BICO_E_NOMEM) << "allocation " << k << ": " << bico_ctx_errmsg(ctx);
      for (auto &o : {c.out, rep, delta})
        EXPECT_EQ(access(o.c_str(), F_OK), -1) << "allocation " << k << ": " << o;
    }
    EXPECT_EQ(f.live, 1) << "leak after failing allocation " << k;
    bico_ctx_free(ctx);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_TRUE(done);
  EXPECT_GT(k, 20);
}

}  // namespace

// mergekit's name for the linear merge of task vectors is accepted, and
// names the library's LINEAR; the canonical name stays "linear".
TEST(MergeNames, TaskArithmeticIsLinear) {
  int m = 0;
  ASSERT_EQ(bico_merge_method_from_name("task_arithmetic", &m), BICO_OK);
  EXPECT_EQ(m, BICO_MERGE_LINEAR);
  EXPECT_STREQ(bico_merge_method_name(m), "linear");
  EXPECT_EQ(bico_merge_method_from_name("dare", &m), BICO_E_NOTFOUND);
  EXPECT_EQ(bico_merge_method_from_name(nullptr, &m), BICO_E_NULL);
}
