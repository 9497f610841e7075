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

namespace {

struct Named {
  std::string name;
  std::vector<size_t> shape;
  std::vector<float> v;
};

void write_f32(const std::string &path, const std::vector<Named> &f) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK);
  for (auto &e : f)
    ASSERT_EQ(bico_stwriter_declare(w, e.name.c_str(), BICO_DTYPE_F32,
                                    e.shape.size(), e.shape.data()),
              BICO_OK);
  for (auto &e : f)
    ASSERT_EQ(bico_stwriter_write_f32(w, e.name.c_str(), e.v.data(), e.v.size()),
              BICO_OK);
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
}

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
  EXPECT_EQ(bico_transfer_file_name(BICO_FILE_TARGET_CONFIG + 1), nullptr);
  int w = -7;
  EXPECT_EQ(bico_transfer_file_from_name("sauce base", &w), BICO_E_NOTFOUND);
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

}  // namespace
