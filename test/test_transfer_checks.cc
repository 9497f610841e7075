// Rules the transfer driver applies on every path: vote counts decoded one
// way for checkpoints and LoRA adapters alike, every written value finite,
// and the method and norm-map names from the library.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <string>
#include <sys/stat.h>
#include <utility>
#include <vector>

#include "st_testutil.h"
#include "testutil.h"
#include "transfer_testutil.h"

namespace {

using ttu::Named;
using ttu::write_f32;
using ttu::filled;

// One 4 x 4 linear layer; votes all +1 except element 5, which is `bad`.
struct Votes {
  stt::TempDir dir;
  std::string base = dir / "base.st", tuned = dir / "tuned.st",
              votes = dir / "votes.st", ad = dir / "adapter",
              out = dir / "out.st", out_ad = dir / "out_adapter";
  explicit Votes(float bad) {
    write_f32(base, {{"blocks.0.fc.weight", {4, 4}, filled(16, 0.5f)}});
    write_f32(tuned, {{"blocks.0.fc.weight", {4, 4}, filled(16, 0.75f)}});
    std::vector<float> v = filled(16, 1.0f);
    v[5] = bad;
    write_f32(votes, {{"blocks.0.fc.weight", {4, 4}, v}});
    mkdir(ad.c_str(), 0700);
    stt::write_bytes(ad + "/adapter_config.json",
                     "{\"peft_type\": \"LORA\", \"r\": 1, \"lora_alpha\": 1, "
                     "\"target_modules\": [\"fc\"], \"bias\": \"none\"}");
    write_f32(ad + "/adapter_model.safetensors",
              {{"base_model.model.blocks.0.fc.lora_A.weight", {1, 4}, filled(4, 0.1f)},
               {"base_model.model.blocks.0.fc.lora_B.weight", {4, 1}, filled(4, 0.2f)}});
  }
  // GradFix from a tuned checkpoint (lora false) or from the adapter.
  bico_status run(bico_ctx *ctx, bool lora) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_GRADFIX);
    bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, base.c_str());
    bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, base.c_str());
    bico_transfer_set_file(t, BICO_FILE_TARGET_VOTES, votes.c_str());
    if (lora) {
      bico_transfer_set_file(t, BICO_FILE_LORA, ad.c_str());
      bico_transfer_set_file(t, BICO_FILE_LORA_OUTPUT, out_ad.c_str());
    } else {
      bico_transfer_set_file(t, BICO_FILE_SOURCE_TUNED, tuned.c_str());
      bico_transfer_set_file(t, BICO_FILE_OUTPUT, out.c_str());
    }
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  }
};

// 2147483647.0f rounds to 2^31, which int32 cannot hold: both GradFix
// paths must refuse it (the LoRA path once cast it to int32 unchecked).
TEST(TransferVotes, TwoToThe31IsRefusedOnBothPaths) {
  for (bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "lora" : "checkpoint");
    for (float bad : {2147483648.0f, -2147483648.0f, 2147483647.0f, 1.5f,
                      std::nanf("")}) {
      Votes f(bad);
      bt::Ctx ctx;
      EXPECT_EQ(f.run(ctx, lora), BICO_E_FORMAT) << bad;
      std::string m = bico_ctx_errmsg(ctx);
      EXPECT_NE(m.find("element 5"), std::string::npos) << m;
      EXPECT_NE(m.find("blocks.0.fc.weight"), std::string::npos) << m;
      struct stat sb;
      EXPECT_NE(stat(f.out.c_str(), &sb), 0);
      EXPECT_NE(stat(f.out_ad.c_str(), &sb), 0);
    }
  }
}

// The largest count int32 holds below 2^31 that float32 represents
// exactly (2^31 - 128) is accepted on both paths.
TEST(TransferVotes, LargestRepresentableCountIsAccepted) {
  for (bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "lora" : "checkpoint");
    Votes f(-2147483520.0f);
    bt::Ctx ctx;
    EXPECT_EQ(f.run(ctx, lora), BICO_OK) << bico_ctx_errmsg(ctx);
  }
}

// ---------------------------------------------------------------------------
// Every written value finite.  A naive transfer with alpha = 2e38 of a task
// vector of 2s makes alpha tau = 4e38, past float32's largest value: the
// run must fail naming the tensor and leave every output as it was.

struct Overflow {
  stt::TempDir dir;
  std::string base = dir / "base.st", tau = dir / "tau.st",
              out = dir / "out.st", delta = dir / "delta.st",
              report = dir / "report.json", ad = dir / "adapter",
              out_ad = dir / "out_adapter";
  explicit Overflow(float t) {
    write_f32(base, {{"blocks.0.fc.weight", {2, 3}, filled(6, 0.5f)},
                     {"blocks.0.fc.bias", {2}, filled(2, 0.25f)}});
    std::vector<float> w = filled(6, 0.0f);
    w[4] = t;  // one element overflows
    write_f32(tau, {{"blocks.0.fc.weight", {2, 3}, w},
                    {"blocks.0.fc.bias", {2}, filled(2, 0.0f)}});
    mkdir(ad.c_str(), 0700);
    stt::write_bytes(ad + "/adapter_config.json",
                     "{\"peft_type\": \"LORA\", \"r\": 1, \"lora_alpha\": 1, "
                     "\"target_modules\": [\"fc\"], \"bias\": \"none\"}");
    write_f32(ad + "/adapter_model.safetensors",
              {{"base_model.model.blocks.0.fc.lora_A.weight", {1, 3}, filled(3, 1.0f)},
               {"base_model.model.blocks.0.fc.lora_B.weight", {2, 1}, {0.0f, t}}});
  }
  bico_transfer *make(bico_ctx *ctx, double alpha, bool lora) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE), BICO_OK);
    EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, alpha), BICO_OK);
    bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, base.c_str());
    bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, base.c_str());
    bico_transfer_set_file(t, BICO_FILE_OUTPUT, out.c_str());
    bico_transfer_set_file(t, BICO_FILE_REPORT, report.c_str());
    if (lora) {
      bico_transfer_set_file(t, BICO_FILE_LORA, ad.c_str());
      bico_transfer_set_file(t, BICO_FILE_LORA_OUTPUT, out_ad.c_str());
    } else {
      bico_transfer_set_file(t, BICO_FILE_TASK_VECTOR, tau.c_str());
      bico_transfer_set_file(t, BICO_FILE_DELTA_OUTPUT, delta.c_str());
    }
    return t;
  }
};

TEST(TransferFinite, OverflowingUpdateFailsAndWritesNothing) {
  for (bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "lora" : "checkpoint");
    Overflow f(2.0f);
    for (auto &p : {f.out, f.delta, f.report}) stt::write_bytes(p, "before");
    bt::Ctx ctx;
    bico_transfer *t = f.make(ctx, 2e38, lora);
    EXPECT_EQ(bico_transfer_run(t), BICO_E_NONFINITE);
    std::string m = bico_ctx_errmsg(ctx);
    EXPECT_NE(m.find(lora ? "blocks.0.fc" : "blocks.0.fc.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("element"), std::string::npos) << m;
    bico_transfer_free(t);
    for (auto &p : {f.out, f.delta, f.report}) EXPECT_EQ(stt::read_bytes(p), "before") << p;
    struct stat sb;
    EXPECT_NE(stat(f.out_ad.c_str(), &sb), 0);
    // Nothing else was left in the folder (no temporaries).
    std::vector<std::string> want = {"adapter", "base.st", "delta.st", "out.st",
                                     "report.json", "tau.st"};
    EXPECT_EQ(f.dir.list(), want);
  }
}

// The same run with alpha 1e38 fits float32: the output is base + alpha tau
// computed here, so the check refuses only what overflows.
TEST(TransferFinite, LargestFittingUpdateIsWritten) {
  Overflow f(2.0f);
  bt::Ctx ctx;
  bico_transfer *t = f.make(ctx, 1e38, false);
  ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_transfer_free(t);
  bico_stfile *o = nullptr;
  ASSERT_EQ(bico_stfile_open(ctx, f.out.c_str(), &o), BICO_OK);
  size_t i;
  ASSERT_EQ(bico_stfile_find(o, "blocks.0.fc.weight", &i), BICO_OK);
  std::vector<float> got(6);
  ASSERT_EQ(bico_stfile_read_f32(o, i, got.data(), 6), BICO_OK);
  EXPECT_EQ(got[0], 0.5f);
  EXPECT_EQ(got[4], (float)(0.5 + (double)(float)1e38 * 2.0));
  EXPECT_TRUE(std::isfinite(got[4]));
  bico_stfile_free(o);
}

// Partial runs: the sink never sees a non-finite update.
TEST(TransferFinite, PartialRunStopsBeforeTheSink) {
  Overflow f(2.0f);
  bt::Ctx ctx;
  bico_transfer *t = f.make(ctx, 2e38, false);
  unsigned char sel[2] = {1, 1};
  int calls = 0;
  auto sink = [](void *o, const bico_transfer_tensor *x) -> bico_status {
    for (size_t e = 0; e < x->count; e++)
      if (!std::isfinite(x->update[e])) ADD_FAILURE() << "non-finite element " << e;
    ++*static_cast<int *>(o);
    return BICO_OK;
  };
  ASSERT_EQ(bico_transfer_set_partial(t, sel, 2, sink, &calls), BICO_OK);
  EXPECT_EQ(bico_transfer_run(t), BICO_E_NONFINITE);
  EXPECT_LE(calls, 1);  // the bias (index 0 or 1) at most
  bico_transfer_free(t);
}

// alpha is used as a float: the bounds say so and larger values are
// refused when set (bico transfer turns that into a usage error).
TEST(TransferFinite, AlphaBoundsAreFloat32s) {
  double lo, hi;
  unsigned fl = 99;
  ASSERT_EQ(bico_transfer_param_bounds(BICO_TRANSFER_ALPHA, &lo, &hi, &fl), BICO_OK);
  EXPECT_EQ(lo, 0.0);
  EXPECT_EQ(hi, (double)std::numeric_limits<float>::max());
  EXPECT_EQ(fl, (unsigned)BICO_PARAM_LO_OPEN);  // (0, FLT_MAX]
  bt::Ctx ctx;
  bico_transfer *t = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, 1e39), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, 0.0), BICO_E_ARG);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("(0, "), std::string::npos);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, hi), BICO_OK);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, INFINITY), BICO_E_ARG);
  bico_transfer_free(t);
}

// The names the manual gives for --method and --norm-map, both ways.
TEST(TransferNames, MethodsAndNormMapsRoundTrip) {
  const std::pair<int, const char *> methods[] = {
      {BICO_METHOD_BICO, "bico"},       {BICO_METHOD_BICO_IN, "bico-in"},
      {BICO_METHOD_BICO_OUT, "bico-out"}, {BICO_METHOD_GRADFIX, "gradfix"},
      {BICO_METHOD_NAIVE, "naive"},     {BICO_METHOD_PAD, "pad"}};
  for (auto &m : methods) {
    ASSERT_NE(bico_transfer_method_name(m.first), nullptr);
    EXPECT_STREQ(bico_transfer_method_name(m.first), m.second);
    int v = -1;
    EXPECT_EQ(bico_transfer_method_from_name(m.second, &v), BICO_OK);
    EXPECT_EQ(v, m.first);
  }
  const std::pair<int, const char *> handlings[] = {
      {BICO_HANDLING_UNCHANGED, "unchanged"}, {BICO_HANDLING_LINEAR, "linear"},
      {BICO_HANDLING_VECTOR, "vector"},       {BICO_HANDLING_TIED, "tied"},
      {BICO_HANDLING_NAIVE, "naive"},         {BICO_HANDLING_PADDED, "padded"},
      {BICO_HANDLING_MASKED, "masked"}};
  for (auto &h : handlings) {
    EXPECT_STREQ(bico_transfer_handling_name(h.first), h.second);
    int v = -1;
    EXPECT_EQ(bico_transfer_handling_from_name(h.second, &v), BICO_OK) << h.second;
    EXPECT_EQ(v, h.first);
  }
  int v0 = -1;
  EXPECT_EQ(bico_transfer_handling_from_name(nullptr, &v0), BICO_E_NULL);
  EXPECT_EQ(bico_transfer_handling_from_name("linear", nullptr), BICO_E_NULL);
  const std::pair<int, const char *> norms[] = {{BICO_NORM_MAP_ACT, "act"},
                                                {BICO_NORM_MAP_GRAD, "grad"}};
  for (auto &m : norms) {
    EXPECT_STREQ(bico_transfer_norm_map_name(m.first), m.second);
    int v = -1;
    EXPECT_EQ(bico_transfer_norm_map_from_name(m.second, &v), BICO_OK);
    EXPECT_EQ(v, m.first);
  }
}

TEST(TransferNames, UnknownValuesAndNamesAreRefused) {
  for (int bad : {-1, 0, 7, 1000}) EXPECT_EQ(bico_transfer_method_name(bad), nullptr) << bad;
  for (int bad : {-1, 0, 3, 1000}) EXPECT_EQ(bico_transfer_norm_map_name(bad), nullptr) << bad;
  int v = 42;
  for (const char *bad : {"", "BICO", "bico ", "bicoin", "gradfix\n", "ACT"}) {
    // Unknown names: BICO_E_NOTFOUND, as every lookup of status.h.
    EXPECT_EQ(bico_transfer_method_from_name(bad, &v), BICO_E_NOTFOUND) << bad;
    EXPECT_EQ(bico_transfer_norm_map_from_name(bad, &v), BICO_E_NOTFOUND) << bad;
    EXPECT_EQ(bico_transfer_handling_from_name(bad, &v), BICO_E_NOTFOUND) << bad;
  }
  EXPECT_EQ(v, 42);  // untouched on failure
  // Choices count from 1; 0 sets the default and get_param reports it.
  EXPECT_EQ(BICO_NORM_MAP_ACT, 1);
  bt::Ctx ctx;
  bico_transfer *t = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  double got = -1;
  ASSERT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_NORM_MAP, BICO_NORM_MAP_GRAD), BICO_OK);
  ASSERT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_NORM_MAP, 0), BICO_OK);
  ASSERT_EQ(bico_transfer_get_param(t, BICO_TRANSFER_NORM_MAP, &got), BICO_OK);
  EXPECT_EQ(got, (double)BICO_NORM_MAP_ACT);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_NORM_MAP, 3), BICO_E_ARG);
  bico_transfer_free(t);
  EXPECT_EQ(bico_transfer_method_from_name(nullptr, &v), BICO_E_NULL);
  EXPECT_EQ(bico_transfer_method_from_name("bico", nullptr), BICO_E_NULL);
  EXPECT_EQ(bico_transfer_norm_map_from_name(nullptr, &v), BICO_E_NULL);
  EXPECT_EQ(bico_transfer_norm_map_from_name("act", nullptr), BICO_E_NULL);
}

}  // namespace

// status.h's enumeration rule for every choice of transfer.h: 0 is no
// member, and a binding that asks for the names of 1, 2, ... until NULL
// (docs/api.md) lists every member once, each name mapping back to it.
TEST(TransferNames, EveryEnumerationCountsFromOne) {
  struct E {
    const char *what;
    const char *(*name)(int);
    bico_status (*from)(const char *, int *);
    int members;
  } enums[] = {
      {"method", bico_transfer_method_name, bico_transfer_method_from_name, 6},
      {"norm_map", bico_transfer_norm_map_name, bico_transfer_norm_map_from_name, 2},
      {"structure", bico_transfer_structure_name, bico_transfer_structure_from_name, 2},
      {"rope", bico_transfer_rope_name, bico_transfer_rope_from_name, 3},
      {"fingerprint", bico_transfer_fingerprint_name,
       bico_transfer_fingerprint_from_name, 2},
      {"handling", bico_transfer_handling_name, bico_transfer_handling_from_name, 7},
      {"side", bico_transfer_side_name, bico_transfer_side_from_name, 2}};
  for (const E &e : enums) {
    EXPECT_EQ(e.name(0), nullptr) << e.what << ": 0 is reserved";
    int n = 0;
    while (e.name(n + 1) != nullptr) {
      int v = -1;
      EXPECT_EQ(e.from(e.name(n + 1), &v), BICO_OK) << e.what;
      EXPECT_EQ(v, n + 1) << e.what;
      n++;
    }
    EXPECT_EQ(n, e.members) << e.what;
  }
  // The handling every unchanged tensor reports is listed too.
  int v = -1;
  ASSERT_EQ(bico_transfer_handling_from_name("unchanged", &v), BICO_OK);
  EXPECT_EQ(v, BICO_HANDLING_UNCHANGED);
  EXPECT_GE(v, 1);
}
