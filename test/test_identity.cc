// Identity of model folders through the C API (issue 22): a folder output
// that is, or holds, an input of the run (a model folder, its index or a
// shard, a calibration, statistics or votes file), or holds another output
// of the run, is refused with BICO_E_ARG before anything is written.  The
// CLI spellings (./x, x/, links) are covered by
// test/python/test_file_identity.py; here every input role is.
#include <gtest/gtest.h>
#include <filesystem>
#include <map>
#include <string>
#include <vector>
#include <sys/stat.h>
#include <unistd.h>
#include "bico/bico.h"
#include "bico/merge.h"
#include "bico/safetensors.h"
#include "bico/transfer.h"
#include "st_testutil.h"
#include "testutil.h"

namespace {

using Spec = std::vector<std::pair<std::string, std::vector<size_t>>>;
const Spec kSpec = {{"blocks.0.fc.weight", {4, 4}}, {"blocks.0.fc.bias", {4}}};

void write_random(const std::string &path, const Spec &ts, uint64_t seed) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK);
  for (auto &t : ts)
    ASSERT_EQ(bico_stwriter_declare(w, t.first.c_str(), BICO_DTYPE_F32,
                                    t.second.size(), t.second.data()),
              BICO_OK);
  bt::Rng g(seed);
  for (auto &t : ts) {
    size_t n = 1;
    for (size_t e : t.second) n *= e;
    std::vector<float> v = bt::randn(g, n, 1, 1.0).f32();
    ASSERT_EQ(bico_stwriter_write_f32(w, t.first.c_str(), v.data(), n), BICO_OK);
  }
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
}

// {relative path: bytes} of every file under root.
std::map<std::string, std::string> snapshot(const std::string &root) {
  std::map<std::string, std::string> m;
  for (auto &e : std::filesystem::recursive_directory_iterator(root))
    if (e.is_regular_file())
      m[std::filesystem::relative(e.path(), root).string()] =
          stt::read_bytes(e.path().string());
  return m;
}

// A source base, a task vector and a sharded target folder (index and two
// shards, a config.json), and an existing output folder o/ with a file.
struct Folders {
  stt::TempDir dir;
  std::string A, tau, tgt, o;
  Folders() {
    A = dir / "A.safetensors";
    tau = dir / "tau.safetensors";
    tgt = dir / "tgt";
    o = dir / "o";
    write_random(A, kSpec, 1);
    write_random(tau, kSpec, 2);
    mkdir(tgt.c_str(), 0755);
    write_random(tgt + "/model-00001-of-00002.safetensors", {kSpec[0]}, 3);
    write_random(tgt + "/model-00002-of-00002.safetensors", {kSpec[1]}, 4);
    stt::write_bytes(tgt + "/model.safetensors.index.json",
                     "{\"metadata\": {}, \"weight_map\": {"
                     "\"blocks.0.fc.weight\": \"model-00001-of-00002.safetensors\", "
                     "\"blocks.0.fc.bias\": \"model-00002-of-00002.safetensors\"}}");
    stt::write_bytes(tgt + "/config.json", "{\"model_type\": \"mlp\"}");
    mkdir(o.c_str(), 0755);
    stt::write_bytes(o + "/notes.txt", "the user's notes\n");
  }
  bico_status run(bico_ctx *ctx, int method,
                  const std::vector<std::pair<int, std::string>> &files) const {
    bico_transfer *t = nullptr;
    bico_status st = bico_transfer_create(ctx, &t);
    std::vector<std::pair<int, std::string>> all = {
        {BICO_FILE_SOURCE_BASE, A}, {BICO_FILE_TASK_VECTOR, tau},
        {BICO_FILE_TARGET_BASE, tgt}};
    for (auto &f : files) {
      bool replaced = false;
      for (auto &g : all)
        if (g.first == f.first) g.second = f.second, replaced = true;
      if (!replaced) all.push_back(f);
    }
    for (auto &f : all)
      if (st == BICO_OK) st = bico_transfer_set_file(t, f.first, f.second.c_str());
    if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_METHOD, method);
    if (st == BICO_OK) st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  }
};

bool has(const char *msg, const std::string &s) {
  return std::string(msg).find(s) != std::string::npos;
}

}  // namespace

TEST(FolderIdentity, AFolderOutputThatIsOrHoldsAnInputIsRefused) {
  Folders f;
  bt::Ctx ctx;
  const std::string idx = f.tgt + "/model.safetensors.index.json";
  const std::vector<std::vector<std::pair<int, std::string>>> cases = {
      // the target's own folder, the target given by its index
      {{BICO_FILE_TARGET_BASE, idx}, {BICO_FILE_OUTPUT, f.tgt + "/"}},
      {{BICO_FILE_TARGET_BASE, idx}, {BICO_FILE_OUTPUT, f.tgt + "/."}},
      // the delta output into the target's folder
      {{BICO_FILE_OUTPUT, f.dir / "new/"}, {BICO_FILE_DELTA_OUTPUT, f.tgt}},
      // a source checkpoint inside the output folder
      {{BICO_FILE_TASK_VECTOR, f.o + "/tau.safetensors"}, {BICO_FILE_OUTPUT, f.o}},
  };
  // the task vector moved into o/ for the last case
  write_random(f.o + "/tau.safetensors", kSpec, 2);
  const auto before_o = snapshot(f.dir.path);
  for (size_t k = 0; k < cases.size(); k++) {
    SCOPED_TRACE("case " + std::to_string(k));
    EXPECT_EQ(f.run(ctx, BICO_METHOD_NAIVE, cases[k]), BICO_E_ARG);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "nothing was written")) << bico_ctx_errmsg(ctx);
    EXPECT_EQ(snapshot(f.dir.path), before_o);
    EXPECT_EQ(access((f.dir / "new").c_str(), F_OK), -1);
  }
}

TEST(FolderIdentity, CalibrationStatisticsAndVotesInsideTheOutputFolder) {
  Folders f;
  bt::Ctx ctx;
  // Valid safetensors files (their content is refused later, if ever:
  // the identity check comes first).
  for (const char *n : {"s.safetensors", "ca.safetensors", "cb.safetensors",
                        "v.safetensors"})
    write_random(f.o + "/" + n, kSpec, 5);
  const auto before = snapshot(f.dir.path);
  struct Case {
    int method;
    std::vector<std::pair<int, std::string>> files;
    const char *role;
  };
  const std::vector<Case> cases = {
      {BICO_METHOD_BICO, {{BICO_FILE_STATS, f.o + "/s.safetensors"}}, "stats"},
      {BICO_METHOD_BICO,
       {{BICO_FILE_SOURCE_CALIB, f.o + "/ca.safetensors"},
        {BICO_FILE_TARGET_CALIB, f.dir / "A.safetensors"}},
       "source calib"},
      {BICO_METHOD_GRADFIX, {{BICO_FILE_TARGET_VOTES, f.o + "/v.safetensors"}},
       "target votes"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.role);
    auto files = c.files;
    files.push_back({BICO_FILE_OUTPUT, f.o + "/"});
    EXPECT_EQ(f.run(ctx, c.method, files), BICO_E_ARG) << bico_ctx_errmsg(ctx);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), c.role)) << bico_ctx_errmsg(ctx);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "holds")) << bico_ctx_errmsg(ctx);
    EXPECT_EQ(snapshot(f.dir.path), before);
  }
}

TEST(FolderIdentity, OtherOutputsInsideTheOutputFolderAreRefused) {
  Folders f;
  bt::Ctx ctx;
  const auto before = snapshot(f.dir.path);
  for (const std::pair<int, std::string> &other :
       std::vector<std::pair<int, std::string>>{
           {BICO_FILE_REPORT, f.o + "/config.json"},
           {BICO_FILE_REPORT, f.o + "/model.safetensors.index.json"},
           {BICO_FILE_DELTA_OUTPUT, f.o + "/model-00001-of-00002.safetensors"},
           {BICO_FILE_DELTA_OUTPUT, f.o + "/sub/"}}) {
    SCOPED_TRACE(other.second);
    EXPECT_EQ(f.run(ctx, BICO_METHOD_NAIVE, {{BICO_FILE_OUTPUT, f.o}, other}),
              BICO_E_ARG);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "lies inside the output folder"))
        << bico_ctx_errmsg(ctx);
    EXPECT_EQ(snapshot(f.dir.path), before);
    EXPECT_EQ(access((f.o + "/sub").c_str(), F_OK), -1);
  }
  // the same report beside the folder is written
  EXPECT_EQ(f.run(ctx, BICO_METHOD_NAIVE,
                  {{BICO_FILE_OUTPUT, f.o}, {BICO_FILE_REPORT, f.dir / "r.json"}}),
            BICO_OK)
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(access((f.o + "/model.safetensors.index.json").c_str(), F_OK), 0);
}

TEST(FolderIdentity, MergeIntoItsBaseOrTunedFolderIsRefused) {
  Folders f;
  bt::Ctx ctx;
  const auto before = snapshot(f.dir.path);
  const std::string idx = f.tgt + "/model.safetensors.index.json";
  for (const std::vector<std::string> &c : std::vector<std::vector<std::string>>{
           {idx, f.A, f.tgt + "/"},            // base by its index, output its folder
           {f.A, f.tgt, f.tgt + "//"}}) {      // a tuned folder as the output
    bico_merge *m = nullptr;
    ASSERT_EQ(bico_merge_create(ctx, &m), BICO_OK);
    bico_merge_set_file(m, BICO_MERGE_FILE_BASE, c[0].c_str());
    bico_merge_set_file(m, BICO_MERGE_FILE_OUTPUT, c[2].c_str());
    bico_merge_add_input(m, BICO_MERGE_TUNED, c[1].c_str(), 1.0, 1.0);
    EXPECT_EQ(bico_merge_run(m), BICO_E_ARG) << bico_ctx_errmsg(ctx);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "nothing was written")) << bico_ctx_errmsg(ctx);
    bico_merge_free(m);
    EXPECT_EQ(snapshot(f.dir.path), before);
  }
}
