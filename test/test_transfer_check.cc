// bico_transfer_check: the verdict of a run's checks without the run.
// Which files go together and options that contradict each other are found
// with no file opened (BICO_TRANSFER_CHECK_OPTIONS); the inputs level also
// opens and pairs the models; neither writes anything, and a configuration
// the check passes runs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "st_testutil.h"
#include "testutil.h"
#include "transfer_testutil.h"

namespace {

using ttu::Named;
using ttu::write_f32;

// A naive transfer of one 4 x 4 layer, with its output, delta and report.
struct Config {
  stt::TempDir dir;
  std::string base = dir / "base.st", tuned = dir / "tuned.st",
              other = dir / "other.st", out = dir / "out.st",
              delta = dir / "delta.st", report = dir / "report.json";
  bt::Ctx ctx;
  bico_transfer *t = nullptr;
  Config() {
    write_f32(base, {{"blocks.0.fc.weight", {4, 4}, std::vector<float>(16, 0.5f)}});
    write_f32(tuned, {{"blocks.0.fc.weight", {4, 4}, std::vector<float>(16, 0.75f)}});
    // names that pair with nothing of the base
    write_f32(other, {{"encoder.proj.weight", {4, 4}, std::vector<float>(16, 1.0f)}});
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE);
    set(BICO_FILE_SOURCE_BASE, base);
    set(BICO_FILE_SOURCE_TUNED, tuned);
    set(BICO_FILE_TARGET_BASE, base);
    set(BICO_FILE_OUTPUT, out);
    set(BICO_FILE_DELTA_OUTPUT, delta);
    set(BICO_FILE_REPORT, report);
  }
  ~Config() { bico_transfer_free(t); }
  void set(int which, const std::string &p) {
    ASSERT_EQ(bico_transfer_set_file(t, which, p.c_str()), BICO_OK);
  }
  void unset(int which) {
    ASSERT_EQ(bico_transfer_set_file(t, which, nullptr), BICO_OK);
  }
  std::string msg() const { return bico_ctx_errmsg(ctx); }
};

bool has(const std::string &s, const std::string &w) {
  return s.find(w) != std::string::npos;
}

TEST(TransferCheck, GoodConfigurationPassesWritesNothingAndRuns) {
  Config s;
  const auto before = s.dir.list();
  for (int level : {0, (int)BICO_TRANSFER_CHECK_OPTIONS,
                    (int)BICO_TRANSFER_CHECK_INPUTS}) {
    ASSERT_EQ(bico_transfer_check(s.t, level), BICO_OK) << level << s.msg();
    EXPECT_EQ(s.dir.list(), before) << level;  // no output, no temporary
  }
  // Checking twice changes nothing, and what passed the check runs.
  ASSERT_EQ(bico_transfer_check(s.t, 0), BICO_OK);
  ASSERT_EQ(bico_transfer_run(s.t), BICO_OK) << s.msg();
  auto after = s.dir.list();
  EXPECT_EQ(after.size(), before.size() + 3);
}

TEST(TransferCheck, FilesThatGoTogetherAreCheckedWithoutOpeningAny) {
  Config s;
  // Inputs that do not exist: the options level opens nothing, so only
  // the combination counts; the inputs level names the missing file.
  s.set(BICO_FILE_SOURCE_TUNED, s.dir / "absent.st");
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_OK)
      << s.msg();
  EXPECT_NE(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_INPUTS), BICO_OK);
  EXPECT_TRUE(has(s.msg(), "absent.st")) << s.msg();
  s.set(BICO_FILE_SOURCE_TUNED, s.tuned);

  // Both sources of the task.
  s.set(BICO_FILE_TASK_VECTOR, s.tuned);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  EXPECT_TRUE(has(s.msg(), "the source tuned file") &&
              has(s.msg(), "the task vector file"))
      << s.msg();
  s.unset(BICO_FILE_TASK_VECTOR);
  // No output.
  s.unset(BICO_FILE_OUTPUT);
  EXPECT_EQ(bico_transfer_check(s.t, 0), BICO_E_ARG);
  EXPECT_TRUE(has(s.msg(), "missing the output file")) << s.msg();
  s.set(BICO_FILE_OUTPUT, s.out);
  // BiCo: one calibration file without its partner, then both kinds.
  bico_transfer_set_param(s.t, BICO_TRANSFER_METHOD, BICO_METHOD_BICO);
  s.set(BICO_FILE_SOURCE_CALIB, s.tuned);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  EXPECT_TRUE(has(s.msg(), "missing the target calib file")) << s.msg();
  s.set(BICO_FILE_TARGET_CALIB, s.tuned);
  s.set(BICO_FILE_STATS, s.tuned);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  EXPECT_TRUE(has(s.msg(), "not both")) << s.msg();
  // A statistics file with centering: the bound the file sets on options.
  s.unset(BICO_FILE_SOURCE_CALIB);
  s.unset(BICO_FILE_TARGET_CALIB);
  ASSERT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_OK)
      << s.msg();
  bico_transfer_set_param(s.t, BICO_TRANSFER_CENTER, 1);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  EXPECT_TRUE(has(s.msg(), "the center parameter")) << s.msg();
  bico_transfer_set_param(s.t, BICO_TRANSFER_CENTER, 0);
  // Votes with a method that ignores them; GradFix without them.
  bico_transfer_set_param(s.t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE);
  s.unset(BICO_FILE_STATS);
  s.set(BICO_FILE_TARGET_VOTES, s.tuned);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  EXPECT_TRUE(has(s.msg(), "the target votes file")) << s.msg();
  s.unset(BICO_FILE_TARGET_VOTES);
  bico_transfer_set_param(s.t, BICO_TRANSFER_METHOD, BICO_METHOD_GRADFIX);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  bico_transfer_set_param(s.t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE);
  // A LoRA adapter replaces the tuned checkpoint; an output adapter needs one.
  s.set(BICO_FILE_LORA, s.dir / "adapter");
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  EXPECT_TRUE(has(s.msg(), "the source adapter file")) << s.msg();
  s.unset(BICO_FILE_LORA);
  s.set(BICO_FILE_LORA_OUTPUT, s.dir / "out_adapter");
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  EXPECT_TRUE(has(s.msg(), "the output adapter file needs")) << s.msg();
  s.unset(BICO_FILE_LORA_OUTPUT);
  // Two outputs on one path.
  s.set(BICO_FILE_REPORT, s.out);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  s.set(BICO_FILE_REPORT, s.report);
  // Every slot's name is the one the messages use, and round-trips.
  for (int f = BICO_FILE_SOURCE_BASE; f <= BICO_FILE_TARGET_CONFIG; f++) {
    const char *n = bico_transfer_file_name(f);
    ASSERT_NE(n, nullptr) << f;
    int back = 0;
    EXPECT_EQ(bico_transfer_file_from_name(n, &back), BICO_OK);
    EXPECT_EQ(back, f);
  }
  EXPECT_EQ(bico_transfer_file_name(0), nullptr);
  EXPECT_EQ(bico_transfer_file_name(BICO_FILE_BRIDGE_OUTPUT + 1), nullptr);
  int w = -7;
  EXPECT_EQ(bico_transfer_file_from_name("sauce base", &w), BICO_E_NOTFOUND);
  EXPECT_EQ(w, -7);
  // The bindings' spelling (an underscore for each space) names the same
  // slot; it is accepted, never listed, and only for a space.
  for (int f = BICO_FILE_SOURCE_BASE; f <= BICO_FILE_TARGET_CONFIG; f++) {
    std::string u = bico_transfer_file_name(f);
    for (char &c : u)
      if (c == ' ') c = '_';
    int back = 0;
    EXPECT_EQ(bico_transfer_file_from_name(u.c_str(), &back), BICO_OK) << u;
    EXPECT_EQ(back, f) << u;
  }
  EXPECT_EQ(bico_transfer_file_from_name("stats_", &w), BICO_E_NOTFOUND);
  EXPECT_EQ(bico_transfer_file_from_name("source_base ", &w), BICO_E_NOTFOUND);
  EXPECT_EQ(bico_transfer_file_from_name("source_base", nullptr), BICO_E_NULL);
  EXPECT_EQ(w, -7);
  // And the good configuration is back: nothing written by any of it.
  EXPECT_EQ(bico_transfer_check(s.t, 0), BICO_OK) << s.msg();
  EXPECT_EQ(s.dir.list(), (std::vector<std::string>{
                              "base.st", "other.st", "tuned.st"}));
}

TEST(TransferCheck, InputsLevelFindsWhatOnlyTheFilesTell) {
  Config s;
  // An output that is an input: the options cannot tell, the files can;
  // the input stays byte-identical.
  const std::string bytes = stt::read_bytes(s.tuned);
  s.set(BICO_FILE_OUTPUT, s.tuned);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_OK);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_INPUTS), BICO_E_ARG);
  EXPECT_TRUE(has(s.msg(), "same file")) << s.msg();
  // The check's messages are the check's, not the run's (the run's own
  // rules wrote "transfer_run:").
  EXPECT_EQ(s.msg().rfind("transfer_check: ", 0), 0u) << s.msg();
  EXPECT_EQ(stt::read_bytes(s.tuned), bytes);
  s.set(BICO_FILE_OUTPUT, s.out);
  // A source whose names pair with none of the target's: below the
  // MIN_PAIRED bound, refused; allowed with the bound at 0.
  s.set(BICO_FILE_SOURCE_BASE, s.other);
  s.set(BICO_FILE_SOURCE_TUNED, s.other);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_OK);
  EXPECT_EQ(bico_transfer_check(s.t, 0), BICO_E_NOTFOUND);
  EXPECT_TRUE(has(s.msg(), "blocks.0.fc.weight")) << s.msg();
  ASSERT_EQ(bico_transfer_set_param(s.t, BICO_TRANSFER_MIN_PAIRED, 0), BICO_OK);
  EXPECT_EQ(bico_transfer_check(s.t, 0), BICO_OK) << s.msg();
  s.set(BICO_FILE_SOURCE_BASE, s.base);
  s.set(BICO_FILE_SOURCE_TUNED, s.tuned);
  // A tie to a tensor that is not a token.
  ASSERT_EQ(bico_transfer_add_tie(s.t, "blocks.0.fc.weight", "blocks.0.fc"),
            BICO_OK);
  bico_transfer_set_param(s.t, BICO_TRANSFER_METHOD, BICO_METHOD_BICO);
  s.set(BICO_FILE_STATS, s.tuned);
  EXPECT_EQ(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_OK);
  EXPECT_NE(bico_transfer_check(s.t, BICO_TRANSFER_CHECK_INPUTS), BICO_OK);
  EXPECT_TRUE(has(s.msg(), "--tie blocks.0.fc.weight")) << s.msg();
  // A partial selection of the wrong size.
  Config p;
  unsigned char sel[3] = {1, 1, 1};
  ASSERT_EQ(bico_transfer_set_partial(
                p.t, sel, 3,
                [](void *, const bico_transfer_tensor *) { return BICO_OK; },
                nullptr),
            BICO_OK);
  EXPECT_EQ(bico_transfer_check(p.t, 0), BICO_E_SHAPE);
  // Unknown levels and NULL.
  EXPECT_EQ(bico_transfer_check(p.t, 3), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_check(p.t, -1), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_check(nullptr, 0), BICO_E_NULL);
  EXPECT_EQ(s.dir.list(), (std::vector<std::string>{
                              "base.st", "other.st", "tuned.st"}));
}

// ---- The statistics plan: what bico_stats_from_calib computes ----

// Calibration rows of two blocks: fc's input and output gradient, widths
// per side (source 4/3 and 3/2, target 5/6 and 6/2).
void write_calib(const std::string &path, size_t rows, bool target,
                 float seed, bool drop_last = false) {
  const size_t w[4] = {target ? 5u : 4u, target ? 6u : 3u, target ? 6u : 3u,
                       2u};
  const char *keys[4] = {"blocks.0.fc.input", "blocks.0.fc.output_grad",
                         "blocks.1.fc.input", "blocks.1.fc.output_grad"};
  std::vector<Named> f;
  for (int k = 0; k < (drop_last ? 3 : 4); k++) {
    std::vector<float> v(rows * w[k]);
    for (size_t i = 0; i < v.size(); i++)
      v[i] = seed + 0.01f * (float)((i * 7 + (size_t)k) % 13);
    f.push_back({keys[k], {rows, w[k]}, v});
  }
  write_f32(path, f);
}

TEST(StatsPlan, PlansExactlyWhatStatsFromCalibWrites) {
  stt::TempDir dir;
  const std::string a = dir / "a.st", b = dir / "b.st", out = dir / "s.st";
  write_calib(a, 7, false, 0.1f);
  write_calib(b, 7, true, 0.2f);
  bt::Ctx ctx;
  ASSERT_EQ(bico_stats_from_calib(ctx, a.c_str(), b.c_str(), nullptr,
                                  out.c_str()),
            BICO_OK)
      << bico_ctx_errmsg(ctx);
  const char *pa[1] = {a.c_str()}, *pb[1] = {b.c_str()};
  bico_stats_plan *p = nullptr;
  ASSERT_EQ(bico_stats_plan_create(ctx, pa, pb, 1, nullptr, &p), BICO_OK)
      << bico_ctx_errmsg(ctx);
  bico_stfile *f = nullptr;
  ASSERT_EQ(bico_stfile_open(ctx, out.c_str(), &f), BICO_OK);
  size_t n = 0, pairs = 0;
  ASSERT_EQ(bico_stats_plan_size(p, &n, &pairs), BICO_OK);
  EXPECT_EQ(pairs, 1u);
  ASSERT_EQ(n, bt::count(bico_stfile_count, f));
  ASSERT_GT(n, 0u);
  for (size_t i = 0; i < n; i++) {
    const char *name, *ka, *kb;
    size_t da, db, rows = 0;
    ASSERT_EQ(bico_stats_plan_item(p, i, &name, &ka, &kb, &da, &db), BICO_OK);
    size_t j, ndim;
    const size_t *shape;
    int dtype;
    ASSERT_EQ(bico_stfile_find(f, name, &j), BICO_OK) << name;
    bico_stfile_tensor_info(f, j, nullptr, &dtype, &ndim, &shape);
    EXPECT_EQ(dtype, BICO_DTYPE_F64);
    ASSERT_EQ(ndim, 2u);
    EXPECT_EQ(shape[0], da) << name;
    EXPECT_EQ(shape[1], db) << name;
    // the calibration tensors it reads, with those widths
    std::string nm = name, stem = nm.substr(0, nm.rfind('.'));
    const bool in = nm.substr(nm.rfind('.') + 1) == "in_xcov";
    EXPECT_EQ(std::string(kb), stem + (in ? ".input" : ".output_grad"));
    EXPECT_EQ(std::string(ka), std::string(kb));  // same names pair here
    ASSERT_EQ(bico_stats_plan_rows(p, i, 0, &rows), BICO_OK);
    EXPECT_EQ(rows, 7u);
  }
  const char *name;
  EXPECT_EQ(bico_stats_plan_item(p, n, &name, nullptr, nullptr, nullptr,
                                 nullptr),
            BICO_E_ARG);
  size_t rows;
  EXPECT_EQ(bico_stats_plan_rows(p, 0, 1, &rows), BICO_E_ARG);
  bico_stfile_free(f);
  bico_stats_plan_free(p);
  bico_stats_plan_free(nullptr);
}

TEST(StatsPlan, EveryPairIsCheckedAndItsRowsCounted) {
  stt::TempDir dir;
  const std::string a0 = dir / "a0.st", b0 = dir / "b0.st", a1 = dir / "a1.st",
                    b1 = dir / "b1.st", bad = dir / "bad.st",
                    short_b = dir / "short.st", lack = dir / "lack.st";
  write_calib(a0, 3, false, 0.1f);
  write_calib(b0, 3, true, 0.2f);
  write_calib(a1, 5, false, 0.3f);
  write_calib(b1, 5, true, 0.4f);
  write_calib(short_b, 4, true, 0.4f);         // rows that do not correspond
  write_f32(bad, {{"blocks.0.fc.input", {5, 5}, std::vector<float>(25, 1)},
                  {"blocks.0.fc.output_grad", {5, 3}, std::vector<float>(15, 1)},
                  {"blocks.1.fc.input", {5, 3}, std::vector<float>(15, 1)},
                  {"blocks.1.fc.output_grad", {5, 2}, std::vector<float>(10, 1)}});
  write_calib(lack, 5, false, 0.3f, true);     // no blocks.1.fc.output_grad
  bt::Ctx ctx;
  bico_stats_plan *p = nullptr;
  {
    const char *pa[2] = {a0.c_str(), a1.c_str()}, *pb[2] = {b0.c_str(), b1.c_str()};
    ASSERT_EQ(bico_stats_plan_create(ctx, pa, pb, 2, nullptr, &p), BICO_OK)
        << bico_ctx_errmsg(ctx);
    size_t n = 0, pairs = 0;
    bico_stats_plan_size(p, &n, &pairs);
    EXPECT_EQ(pairs, 2u);
    EXPECT_EQ(n, 4u);
    for (size_t i = 0; i < n; i++) {
      size_t r0 = 0, r1 = 0;
      ASSERT_EQ(bico_stats_plan_rows(p, i, 0, &r0), BICO_OK);
      ASSERT_EQ(bico_stats_plan_rows(p, i, 1, &r1), BICO_OK);
      EXPECT_EQ(r0, 3u);
      EXPECT_EQ(r1, 5u);
    }
    bico_stats_plan_free(p);
  }
  struct Case {
    std::string a1, b1;
    bico_status st;
    std::string word;
  } cases[] = {{a1, short_b, BICO_E_SHAPE, "short.st"},
               {bad, b1, BICO_E_SHAPE, "bad.st"},
               {lack, b1, BICO_E_NOTFOUND, "lack.st"}};
  for (auto &c : cases) {
    const char *pa[2] = {a0.c_str(), c.a1.c_str()},
               *pb[2] = {b0.c_str(), c.b1.c_str()};
    p = reinterpret_cast<bico_stats_plan *>(&ctx);  // overwritten with NULL
    EXPECT_EQ(bico_stats_plan_create(ctx, pa, pb, 2, nullptr, &p), c.st)
        << c.word;
    EXPECT_EQ(p, nullptr);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), c.word)) << bico_ctx_errmsg(ctx);
  }
  // A target module the source lacks: the same failure as
  // bico_stats_from_calib's, and nothing written by either.
  const char *pa[1] = {lack.c_str()}, *pb[1] = {b1.c_str()};
  EXPECT_EQ(bico_stats_plan_create(ctx, pa, pb, 1, nullptr, &p),
            BICO_E_NOTFOUND);
  std::string plan_msg = bico_ctx_errmsg(ctx);
  EXPECT_TRUE(has(plan_msg, "lacks its partner blocks.1.fc.output_grad"))
      << plan_msg;
  EXPECT_EQ(bico_stats_from_calib(ctx, lack.c_str(), b1.c_str(), nullptr,
                                  (dir / "s.st").c_str()),
            BICO_E_NOTFOUND);
  std::string from_msg = bico_ctx_errmsg(ctx);
  EXPECT_EQ(plan_msg.substr(plan_msg.find(':')), from_msg.substr(from_msg.find(':')));
  EXPECT_FALSE(std::filesystem::exists(dir / "s.st"));
  EXPECT_EQ(bico_stats_plan_create(ctx, pa, pb, 0, nullptr, &p), BICO_E_ARG);
}

}  // namespace
