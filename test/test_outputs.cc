// Output folders (bico_stwriter_create_folder, bico_stwriter_output_is_folder) and
// the transfer's structured progress (bico_transfer_set_progress).  The
// folder tests read the shards back with the reader and the test's own
// JSON look-ups; the progress test compares the reported work with the
// plan's group costs, computed by bico_transfer_plan on another handle.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "st_testutil.h"
#include "testutil.h"

namespace {

using stt::TempDir;
using stt::contains;

std::string slurp(const std::string &p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

bool exists(const std::string &p) { return access(p.c_str(), F_OK) == 0; }

std::vector<std::string> names_in(const std::string &dir) {
  std::vector<std::string> v;
  for (auto &e : std::filesystem::directory_iterator(dir))
    v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

// Four F32 tensors of 6, 2, 3 and 1 elements (24, 8, 12 and 4 bytes).
const char *const NAMES[4] = {"a.weight", "a.bias", "b.weight", "b.bias"};
const size_t NUMEL[4] = {6, 2, 3, 1};

bico_status write_model(bico_stwriter *w) {
  bico_status st = BICO_OK;
  for (int k = 0; k < 4 && st == BICO_OK; k++)
    st = bico_stwriter_declare(w, NAMES[k], BICO_DTYPE_F32, 1, &NUMEL[k]);
  for (int k = 0; k < 4 && st == BICO_OK; k++) {
    std::vector<float> v(NUMEL[k]);
    for (size_t i = 0; i < v.size(); i++) v[i] = 10.0f * k + (float)i;
    st = bico_stwriter_write_f32(w, NAMES[k], v.data(), v.size());
  }
  return st;
}

// The values back through the reader (which takes the folder), and each
// tensor's file.
void read_back(const std::string &dir, std::map<std::string, std::string> *file) {
  bt::Ctx ctx;
  bico_stfile *f = nullptr;
  ASSERT_EQ(bico_stfile_open(ctx, dir.c_str(), &f), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bt::count(bico_stfile_count, f), 4u);
  for (int k = 0; k < 4; k++) {
    size_t i;
    ASSERT_EQ(bico_stfile_find(f, NAMES[k], &i), BICO_OK);
    std::vector<float> v(NUMEL[k]);
    ASSERT_EQ(bico_stfile_read_f32(f, i, v.data(), v.size()), BICO_OK);
    for (size_t e = 0; e < v.size(); e++) EXPECT_EQ(v[e], 10.0f * k + (float)e);
    const char *p = nullptr;
    ASSERT_EQ(bico_stfile_tensor_path(f, i, &p), BICO_OK);
    std::string s(p);
    (*file)[NAMES[k]] = s.substr(s.rfind('/') + 1);
  }
  bico_stfile_free(f);
}

TEST(OutputFolder, GreedyShardsWithIndexAndTheLikeFolderCopied) {
  TempDir d;
  std::string like = d / "like", out = d / "out";
  ASSERT_EQ(mkdir(like.c_str(), 0777), 0);
  std::ofstream(like + "/config.json") << "{\"x\": 1}";
  std::ofstream(like + "/tokenizer.json") << "{}";
  std::ofstream(like + "/pytorch_model.bin") << "weights";
  std::ofstream(like + "/.hidden") << "no";
  bt::Ctx ctx;
  {  // the like folder's weights: one file
    bico_stwriter *w = nullptr;
    ASSERT_EQ(bico_stwriter_create(ctx, (like + "/model.safetensors").c_str(), &w), BICO_OK);
    ASSERT_EQ(write_model(w), BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
    bico_stwriter_free(w);
  }
  EXPECT_EQ(bico_stwriter_output_is_folder(out.c_str(), like.c_str()), 1);
  bico_stwriter *w = nullptr;
  // 30 bytes: [24] [8 + 12] [4] would pass 30 with 4 more: [24] [8+12] ...
  // 24 fits; +8 = 32 > 30: new; 8 + 12 = 20, + 4 = 24 <= 30: same shard.
  ASSERT_EQ(bico_stwriter_create_folder(ctx, out.c_str(), like.c_str(), 30, &w),
            BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bico_stwriter_add_metadata(w, "format", "pt"), BICO_OK);
  ASSERT_EQ(write_model(w), BICO_OK);
  EXPECT_FALSE(exists(out + "/config.json"));  // nothing before the commit
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
  std::map<std::string, std::string> file;
  read_back(out, &file);
  const std::string s1 = "model-00001-of-00002.safetensors",
                    s2 = "model-00002-of-00002.safetensors";
  EXPECT_EQ(file["a.weight"], s1);
  EXPECT_EQ(file["a.bias"], s2);
  EXPECT_EQ(file["b.weight"], s2);
  EXPECT_EQ(file["b.bias"], s2);
  std::string index = slurp(out + "/model.safetensors.index.json");
  EXPECT_NE(index.find("\"total_size\": 48"), std::string::npos) << index;
  EXPECT_EQ(slurp(out + "/config.json"), "{\"x\": 1}");
  EXPECT_TRUE(exists(out + "/tokenizer.json"));
  EXPECT_FALSE(exists(out + "/pytorch_model.bin"));
  EXPECT_FALSE(exists(out + "/.hidden"));
  EXPECT_FALSE(exists(out + "/model.safetensors"));
  // every shard carries the metadata
  for (auto &s : {s1, s2}) {
    bico_stfile *f = nullptr;
    ASSERT_EQ(bico_stfile_open(ctx, (out + "/" + s).c_str(), &f), BICO_OK);
    EXPECT_EQ(bt::count(bico_stfile_metadata_count, f), 1u);
    bico_stfile_free(f);
  }
  // again without a limit: as the like model, one model.safetensors; the
  // shards and the index of the run before are gone
  std::ofstream(out + "/mine.txt") << "stays";
  ASSERT_EQ(bico_stwriter_create_folder(ctx, out.c_str(), like.c_str(), 0, &w), BICO_OK);
  ASSERT_EQ(write_model(w), BICO_OK);
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
  EXPECT_EQ(names_in(out), (std::vector<std::string>{
                                    "config.json", "mine.txt", "model.safetensors",
                                    "tokenizer.json"}));
}

TEST(OutputFolder, FollowsTheLikeModelsShards) {
  TempDir d;
  std::string like = d / "like", out = d / "out";
  ASSERT_EQ(mkdir(like.c_str(), 0777), 0);
  bt::Ctx ctx;
  // a like model in two files of its own naming: a.* and b.bias in
  // p2.safetensors, b.weight in p1.safetensors (not in declaration order)
  const char *files[2] = {"p1.safetensors", "p2.safetensors"};
  for (int s = 0; s < 2; s++) {
    bico_stwriter *w = nullptr;
    ASSERT_EQ(bico_stwriter_create(ctx, (like + "/" + files[s]).c_str(), &w), BICO_OK);
    for (int k = 0; k < 4; k++) {
      if ((k == 2) != (s == 0)) continue;
      ASSERT_EQ(bico_stwriter_declare(w, NAMES[k], BICO_DTYPE_F32, 1, &NUMEL[k]), BICO_OK);
    }
    for (int k = 0; k < 4; k++) {
      if ((k == 2) != (s == 0)) continue;
      std::vector<float> zero(NUMEL[k], 0.0f);
      ASSERT_EQ(bico_stwriter_write_f32(w, NAMES[k], zero.data(), zero.size()), BICO_OK);
    }
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
    bico_stwriter_free(w);
  }
  stt::write_bytes(like + "/model.safetensors.index.json",
                   "{\"metadata\": {}, \"weight_map\": {\"a.weight\": "
                   "\"p2.safetensors\", \"a.bias\": \"p2.safetensors\", "
                   "\"b.weight\": \"p1.safetensors\", \"b.bias\": "
                   "\"p2.safetensors\"}}");
  std::ofstream(like + "/config.json") << "{}";
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create_folder(ctx, out.c_str(), like.c_str(), 0, &w),
            BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(write_model(w), BICO_OK);
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
  std::map<std::string, std::string> file;
  read_back(out, &file);
  EXPECT_EQ(file["a.weight"], "p2.safetensors");
  EXPECT_EQ(file["a.bias"], "p2.safetensors");
  EXPECT_EQ(file["b.weight"], "p1.safetensors");
  EXPECT_EQ(file["b.bias"], "p2.safetensors");
  EXPECT_EQ(names_in(out), (std::vector<std::string>{
                               "config.json", "model.safetensors.index.json",
                               "p1.safetensors", "p2.safetensors"}));
}

TEST(OutputFolder, TheRuleAndBadFolders) {
  TempDir d;
  std::string dir = d / "m", file = d / "f.safetensors";
  ASSERT_EQ(mkdir(dir.c_str(), 0777), 0);
  std::ofstream(file) << "x";
  EXPECT_EQ(bico_stwriter_output_is_folder(dir.c_str(), nullptr), 1);      // exists
  EXPECT_EQ(bico_stwriter_output_is_folder((d / "new/").c_str(), nullptr), 1);
  EXPECT_EQ(bico_stwriter_output_is_folder((d / "new").c_str(), nullptr), 0);
  EXPECT_EQ(bico_stwriter_output_is_folder((d / "new").c_str(), dir.c_str()), 1);
  EXPECT_EQ(bico_stwriter_output_is_folder((d / "n.safetensors").c_str(), dir.c_str()), 0);
  EXPECT_EQ(bico_stwriter_output_is_folder((d / "n.json").c_str(), dir.c_str()), 0);
  EXPECT_EQ(bico_stwriter_output_is_folder((d / "new").c_str(), file.c_str()), 0);
  EXPECT_EQ(bico_stwriter_output_is_folder(file.c_str(), dir.c_str()), 0);  // a file
  EXPECT_EQ(bico_stwriter_output_is_folder(nullptr, nullptr), 0);
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  EXPECT_EQ(bico_stwriter_create_folder(ctx, file.c_str(), nullptr, 0, &w), BICO_E_ARG);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("not a folder"), std::string::npos);
  EXPECT_EQ(bico_stwriter_create_folder(ctx, (d / "no/such").c_str(), nullptr, 0, &w),
            BICO_E_IO);
  EXPECT_EQ(bico_stwriter_create_folder(ctx, dir.c_str(), dir.c_str(), 0, &w), BICO_E_ARG);
  EXPECT_EQ(bico_stwriter_create_folder(ctx, nullptr, nullptr, 0, &w), BICO_E_NULL);
  EXPECT_EQ(w, nullptr);
  // an abandoned writer leaves nothing: the folder is built as a hidden
  // sibling (".fresh.bico-tmp.<pid>.XXXXXX") and removed with its files
  std::string fresh = d / "fresh";
  auto before = names_in(d.path);
  ASSERT_EQ(bico_stwriter_create_folder(ctx, fresh.c_str(), nullptr, 8, &w), BICO_OK);
  ASSERT_EQ(write_model(w), BICO_OK);
  EXPECT_FALSE(exists(fresh));  // never visible before the commit
  std::string stage;
  for (auto &n : names_in(d.path))
    if (n.rfind(".fresh.bico-tmp.", 0) == 0) stage = d / n;
  ASSERT_FALSE(stage.empty());
  EXPECT_GT(names_in(stage).size(), 1u);  // the shards, under their own names
  bico_stwriter_free(w);
  EXPECT_FALSE(exists(fresh));
  EXPECT_EQ(names_in(d.path), before);
}

// A model folder written with the writer (values of write_model).
void write_folder(const std::string &out, const char *like, uint64_t max_shard) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create_folder(ctx, out.c_str(), like, max_shard, &w), BICO_OK)
      << bico_ctx_errmsg(ctx);
  ASSERT_EQ(write_model(w), BICO_OK);
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
}

ino_t inode(const std::string &p) {
  struct stat st;
  return lstat(p.c_str(), &st) == 0 ? st.st_ino : 0;
}

mode_t mode_of(const std::string &p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 ? (st.st_mode & 07777) : 0;
}

TEST(OutputFolder, AnOldIndexNeverDeletesFilesThatAreNotWeights) {
  // The old index of the output folder names notes.txt and config.json as
  // shards: they are the user's and the new config, never removed.
  TempDir d;
  std::string like = d / "like", out = d / "out";
  ASSERT_EQ(mkdir(like.c_str(), 0777), 0);
  ASSERT_EQ(mkdir(out.c_str(), 0777), 0);
  std::ofstream(like + "/config.json") << "{\"new\": 1}";
  write_folder(like, nullptr, 0);  // like/model.safetensors
  std::ofstream(out + "/notes.txt") << "mine";
  std::ofstream(out + "/config.json") << "old config";
  std::ofstream(out + "/p1.safetensors") << "old shard";
  std::ofstream(out + "/adapter_model.safetensors") << "not named by the index";
  stt::write_bytes(out + "/model.safetensors.index.json",
                   "{\"weight_map\": {\"a.weight\": \"notes.txt\", \"a.bias\": "
                   "\"config.json\", \"b.weight\": \"p1.safetensors\", "
                   "\"b.bias\": \"../x.safetensors\"}}");
  write_folder(out, like.c_str(), 0);
  EXPECT_EQ(slurp(out + "/notes.txt"), "mine");
  EXPECT_EQ(slurp(out + "/config.json"), "{\"new\": 1}");
  EXPECT_EQ(slurp(out + "/adapter_model.safetensors"), "not named by the index");
  EXPECT_EQ(names_in(out), (std::vector<std::string>{
                               "adapter_model.safetensors", "config.json",
                               "model.safetensors", "notes.txt"}));
  std::map<std::string, std::string> file;
  read_back(out, &file);
}

TEST(OutputFolder, LikeShardsOfAnyNameAreNeverCopiedOverTheNewOnes) {
  // The like model's index names shards "part1" and "part2": they are its
  // weights, not other files; the output holds the new tensors.
  TempDir d;
  std::string like = d / "like", out = d / "out";
  ASSERT_EQ(mkdir(like.c_str(), 0777), 0);
  bt::Ctx ctx;
  const char *files[2] = {"part1", "part2"};
  for (int s = 0; s < 2; s++) {
    bico_stwriter *w = nullptr;
    ASSERT_EQ(bico_stwriter_create(ctx, (like + "/" + files[s]).c_str(), &w), BICO_OK);
    for (int k = 2 * s; k < 2 * s + 2; k++)
      ASSERT_EQ(bico_stwriter_declare(w, NAMES[k], BICO_DTYPE_F32, 1, &NUMEL[k]), BICO_OK);
    for (int k = 2 * s; k < 2 * s + 2; k++) {
      std::vector<float> v(NUMEL[k], -1.0f);
      ASSERT_EQ(bico_stwriter_write_f32(w, NAMES[k], v.data(), v.size()), BICO_OK);
    }
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
    bico_stwriter_free(w);
  }
  stt::write_bytes(like + "/model.safetensors.index.json",
                   "{\"weight_map\": {\"a.weight\": \"part1\", \"a.bias\": "
                   "\"part1\", \"b.weight\": \"part2\", \"b.bias\": \"part2\"}}");
  std::ofstream(like + "/config.json") << "{}";
  write_folder(out, like.c_str(), 0);
  std::map<std::string, std::string> file;
  read_back(out, &file);  // the new values, not the like model's -1s
  EXPECT_EQ(file["a.weight"], "part1");
  EXPECT_EQ(file["b.bias"], "part2");
}

TEST(OutputFolder, TheUsersFilesAreCarriedIntoTheNewFolder) {
  // Everything of the old folder but the weights the new model replaces
  // lands in the new folder as the same files (hard links): sub-folders,
  // dot files, links; the folder keeps its mode; a link to the folder
  // still leads to it; nothing is left beside it.
  TempDir d;
  std::string out = d / "out", link = d / "link";
  write_folder(out, nullptr, 30);  // two shards and an index
  ASSERT_EQ(mkdir((out + "/sub").c_str(), 0750), 0);
  ASSERT_EQ(mkdir((out + "/sub/deeper").c_str(), 0700), 0);
  std::ofstream(out + "/sub/deeper/x.txt") << "x";
  std::ofstream(out + "/.env") << "secret";
  ASSERT_EQ(chmod((out + "/.env").c_str(), 0600), 0);
  ASSERT_EQ(symlink("sub/deeper/x.txt", (out + "/x.link").c_str()), 0);
  std::ofstream(out + "/model-00009-of-00009.safetensors") << "stale";
  ASSERT_EQ(chmod(out.c_str(), 0750), 0);
  const bool root = geteuid() == 0;  // root keeps the folder's owner
  if (root) {
    ASSERT_EQ(chown(out.c_str(), 65534, 65534), 0);
  }
  ASSERT_EQ(symlink("out", link.c_str()), 0);
  ino_t env = inode(out + "/.env"), x = inode(out + "/sub/deeper/x.txt"),
        dir = inode(out);
  write_folder(link + "/", nullptr, 0);  // one model.safetensors now
  EXPECT_EQ(names_in(out), (std::vector<std::string>{
                               ".env", "model.safetensors", "sub", "x.link"}));
  EXPECT_NE(inode(out), dir);  // a new folder took its place
  EXPECT_EQ(inode(out + "/.env"), env);
  EXPECT_EQ(inode(out + "/sub/deeper/x.txt"), x);
  EXPECT_EQ(slurp(out + "/x.link"), "x");
  EXPECT_EQ(mode_of(out), 0750u);
  struct stat os;
  ASSERT_EQ(stat(out.c_str(), &os), 0);
  if (root) {
    EXPECT_EQ(os.st_uid, 65534u);
  }
  EXPECT_EQ(mode_of(out + "/sub"), 0750u);
  EXPECT_EQ(mode_of(out + "/sub/deeper"), 0700u);
  EXPECT_EQ(mode_of(out + "/.env"), 0600u);
  struct stat ls;
  ASSERT_EQ(lstat(link.c_str(), &ls), 0);
  EXPECT_TRUE(S_ISLNK(ls.st_mode));
  EXPECT_EQ(names_in(d.path), (std::vector<std::string>{"link", "out"}));
  std::map<std::string, std::string> file;
  read_back(link, &file);
}

TEST(OutputFolder, LeftoversOfDeadRunsAreRemovedOnce) {
  TempDir d;
  std::string out = d / "out";
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  ASSERT_GT(dead, 0);
  int status;
  ASSERT_EQ(waitpid(dead, &status, 0), dead);
  std::string left = d / (".out.bico-tmp." + std::to_string(dead) + ".AbCdEf");
  std::string live = d / ".out.bico-tmp.1.AbCdEf";  // init never dies
  for (auto &p : {left, left + "o", live}) {
    ASSERT_EQ(mkdir(p.c_str(), 0700), 0);
    ASSERT_EQ(mkdir((p + "/sub").c_str(), 0500), 0);
    std::ofstream(p + "/model.safetensors") << "half";
  }
  write_folder(out, nullptr, 0);
  EXPECT_EQ(names_in(d.path), (std::vector<std::string>{".out.bico-tmp.1.AbCdEf", "out"}));
}

TEST(OutputFolder, LinksOutOfTheLikeFolderAreRefusedModesKept) {
  TempDir d;
  std::string like = d / "like", out = d / "out";
  ASSERT_EQ(mkdir(like.c_str(), 0777), 0);
  write_folder(like, nullptr, 0);
  std::ofstream(d / "secret") << "password";
  ASSERT_EQ(chmod((d / "secret").c_str(), 0600), 0);
  ASSERT_EQ(symlink("../secret", (like + "/tokenizer.json").c_str()), 0);
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  EXPECT_EQ(bico_stwriter_create_folder(ctx, out.c_str(), like.c_str(), 0, &w), BICO_E_IO);
  std::string msg = bico_ctx_errmsg(ctx);
  EXPECT_NE(msg.find("tokenizer.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("outside the folder"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("stwriter_create_folder:"), std::string::npos) << msg;
  EXPECT_EQ(names_in(d.path), (std::vector<std::string>{"like", "secret"}));
  // a link inside the folder is fine; the modes are the sources' (never
  // setuid); a file the like model's folder cannot read would fail
  ASSERT_EQ(unlink((like + "/tokenizer.json").c_str()), 0);
  std::ofstream(like + "/tok.real") << "{}";
  ASSERT_EQ(chmod((like + "/tok.real").c_str(), 0640), 0);
  ASSERT_EQ(symlink("tok.real", (like + "/tokenizer.json").c_str()), 0);
  std::ofstream(like + "/run.sh") << "#!/bin/sh";
  ASSERT_EQ(chmod((like + "/run.sh").c_str(), 04755), 0);
  write_folder(out, like.c_str(), 0);
  EXPECT_EQ(slurp(out + "/tokenizer.json"), "{}");
  EXPECT_EQ(mode_of(out + "/tokenizer.json"), 0640u);
  EXPECT_EQ(mode_of(out + "/tok.real"), 0640u);
  EXPECT_EQ(mode_of(out + "/run.sh"), 0755u);
}

TEST(OutputFolder, AHubCacheSnapshotsLinksIntoItsBlobsAreCopied) {
  // models--org--name/snapshots/<rev>/ holds links into ../../blobs/.
  TempDir d;
  std::string repo = d / "models--org--name", snap = repo + "/snapshots/abc123";
  std::string out = d / "out";
  ASSERT_EQ(std::filesystem::create_directories(snap), true);
  ASSERT_EQ(mkdir((repo + "/blobs").c_str(), 0777), 0);
  write_folder(repo + "/blobs/w", nullptr, 0);  // a folder: take its file
  ASSERT_EQ(rename((repo + "/blobs/w/model.safetensors").c_str(),
                   (repo + "/blobs/1111").c_str()), 0);
  std::ofstream(repo + "/blobs/2222") << "{\"hub\": 1}";
  ASSERT_EQ(symlink("../../blobs/1111", (snap + "/model.safetensors").c_str()), 0);
  ASSERT_EQ(symlink("../../blobs/2222", (snap + "/config.json").c_str()), 0);
  // a link from a folder not under snapshots/ into the same blobs is out
  write_folder(out, snap.c_str(), 0);
  EXPECT_EQ(slurp(out + "/config.json"), "{\"hub\": 1}");
  std::string other = d / "other";
  ASSERT_EQ(mkdir(other.c_str(), 0777), 0);
  ASSERT_EQ(symlink("../models--org--name/blobs/1111",
                    (other + "/model.safetensors").c_str()), 0);
  ASSERT_EQ(symlink("../models--org--name/blobs/2222",
                    (other + "/config.json").c_str()), 0);
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  EXPECT_EQ(bico_stwriter_create_folder(ctx, (d / "out2").c_str(), other.c_str(), 0, &w),
            BICO_E_IO);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("config.json"), std::string::npos);
}

// ---- progress ----

struct Seen {
  std::vector<bico_progress> calls;
  std::vector<std::string> names;
  static void fn(void *o, const bico_progress *p) {
    Seen *s = static_cast<Seen *>(o);
    s->calls.push_back(*p);
    s->names.push_back(p->tensor ? p->tensor : "");
  }
};

void write_chain(const std::string &path, double shift) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK);
  const char *names[4] = {"blocks.0.fc.weight", "blocks.0.fc.bias",
                          "blocks.1.fc.weight", "blocks.1.fc.bias"};
  size_t shapes[4][2] = {{5, 4}, {5, 0}, {3, 5}, {3, 0}};
  for (int k = 0; k < 4; k++)
    ASSERT_EQ(bico_stwriter_declare(w, names[k], BICO_DTYPE_F32, shapes[k][1] ? 2 : 1,
                                    shapes[k]), BICO_OK);
  for (int k = 0; k < 4; k++) {
    size_t n = shapes[k][0] * (shapes[k][1] ? shapes[k][1] : 1);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = (float)(0.1 * (double)(i + k) + shift);
    ASSERT_EQ(bico_stwriter_write_f32(w, names[k], v.data(), n), BICO_OK);
  }
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
  bico_stwriter_free(w);
}

bico_transfer *naive(bico_ctx *ctx, const TempDir &d, const std::string &out) {
  bico_transfer *t = nullptr;
  EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, (d / "a.st").c_str());
  bico_transfer_set_file(t, BICO_FILE_SOURCE_TUNED, (d / "aft.st").c_str());
  bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, (d / "a.st").c_str());
  bico_transfer_set_file(t, BICO_FILE_OUTPUT, out.c_str());
  bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE);
  return t;
}

TEST(TransferProgress, EveryTensorReportedAndTheWorkIsThePlans) {
  TempDir d;
  write_chain(d / "a.st", 0);
  write_chain(d / "aft.st", 0.5);
  bt::Ctx ctx;
  Seen seen;
  bico_transfer *t = naive(ctx, d, d / "o1.st");
  ASSERT_EQ(bico_transfer_set_progress(t, Seen::fn, &seen), BICO_OK);
  ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_transfer_free(t);
  // the plan's costs, on a handle of its own
  t = naive(ctx, d, d / "o2.st");
  ASSERT_EQ(bico_transfer_plan(t), BICO_OK) << bico_ctx_errmsg(ctx);
  size_t nt = 0, ng = 0;
  ASSERT_EQ(bico_transfer_plan_size(t, &nt, &ng), BICO_OK);
  double plan = 0;
  for (size_t g = 0; g < ng; g++) {
    double c = 0;
    ASSERT_EQ(bico_transfer_plan_group(t, g, &c, nullptr, nullptr), BICO_OK);
    plan += c;
  }
  ASSERT_EQ(bico_transfer_run(t), BICO_OK);  // no progress function
  bico_transfer_free(t);
  ASSERT_EQ(seen.calls.size(), 4u);
  double prev = 0, prev_t = 0;
  for (size_t k = 0; k < seen.calls.size(); k++) {
    const bico_progress &p = seen.calls[k];
    EXPECT_EQ(p.size, sizeof(bico_progress));
    EXPECT_EQ(p.tensors_done, k + 1);
    EXPECT_EQ(p.tensors_total, 4u);
    EXPECT_GT(p.done, prev);
    EXPECT_GE(p.elapsed, prev_t);
    EXPECT_DOUBLE_EQ(p.total, plan);
    prev = p.done;
    prev_t = p.elapsed;
  }
  EXPECT_EQ(seen.calls.back().done, seen.calls.back().total);
  EXPECT_EQ(seen.names, (std::vector<std::string>{
                            "blocks.0.fc.weight", "blocks.0.fc.bias",
                            "blocks.1.fc.weight", "blocks.1.fc.bias"}));
  // watching changes nothing
  EXPECT_EQ(slurp(d / "o1.st"), slurp(d / "o2.st"));
  EXPECT_EQ(bico_transfer_set_progress(nullptr, Seen::fn, nullptr), BICO_E_NULL);
}

TEST(MergeProgress, EveryTensorAndTheWorkIsItsElements) {
  TempDir d;
  write_chain(d / "a.st", 0);
  write_chain(d / "aft.st", 0.5);
  bt::Ctx ctx;
  Seen seen;
  bico_merge *m = nullptr;
  ASSERT_EQ(bico_merge_create(ctx, &m), BICO_OK);
  ASSERT_EQ(bico_merge_set_file(m, BICO_MERGE_FILE_BASE, (d / "a.st").c_str()), BICO_OK);
  ASSERT_EQ(bico_merge_set_file(m, BICO_MERGE_FILE_OUTPUT, (d / "o.st").c_str()), BICO_OK);
  ASSERT_EQ(bico_merge_add_input(m, BICO_MERGE_TUNED, (d / "aft.st").c_str(), 1.0, 1.0),
            BICO_OK);
  ASSERT_EQ(bico_merge_set_progress(m, Seen::fn, &seen), BICO_OK);
  ASSERT_EQ(bico_merge_run(m), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_merge_free(m);
  // shapes 5x4, 5, 3x5, 3: elements + 1 each
  const double work[4] = {21, 6, 16, 4};
  ASSERT_EQ(seen.calls.size(), 4u);
  double done = 0;
  for (size_t k = 0; k < 4; k++) {
    const bico_progress &p = seen.calls[k];
    done += work[k];
    EXPECT_EQ(p.size, sizeof(bico_progress));
    EXPECT_EQ(p.tensors_done, k + 1);
    EXPECT_EQ(p.tensors_total, 4u);
    EXPECT_DOUBLE_EQ(p.total, 47.0);
    EXPECT_DOUBLE_EQ(p.done, done);
  }
  EXPECT_EQ(seen.names, (std::vector<std::string>{
                            "blocks.0.fc.weight", "blocks.0.fc.bias",
                            "blocks.1.fc.weight", "blocks.1.fc.bias"}));
  EXPECT_EQ(bico_merge_set_progress(nullptr, Seen::fn, nullptr), BICO_E_NULL);
}

// ---- an input rewritten while the run reads it (issue 45) ----
//
// The runs read their inputs a tensor at a time; a file rewritten in place
// meanwhile (a download or a save into the same folder) gave an output of
// two versions, and the run said it succeeded.  Now the run checks every
// file it reads before it commits (bico_stfile_check_unchanged): BICO_E_IO
// naming the file, the old output left as it was.

// write_chain's tensors as a model folder, one tensor or two per shard,
// every file last written long ago (so that a rewrite moves its mtime,
// whatever the file system's timestamp granularity).
void write_chain_folder(const std::string &dir, double shift) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create_folder(ctx, dir.c_str(), nullptr, 64, &w), BICO_OK);
  const char *names[4] = {"blocks.0.fc.weight", "blocks.0.fc.bias",
                          "blocks.1.fc.weight", "blocks.1.fc.bias"};
  size_t shapes[4][2] = {{5, 4}, {5, 0}, {3, 5}, {3, 0}};
  for (int k = 0; k < 4; k++)
    ASSERT_EQ(bico_stwriter_declare(w, names[k], BICO_DTYPE_F32, shapes[k][1] ? 2 : 1,
                                    shapes[k]), BICO_OK);
  for (int k = 0; k < 4; k++) {
    size_t n = shapes[k][0] * (shapes[k][1] ? shapes[k][1] : 1);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = (float)(0.1 * (double)(i + k) + shift);
    ASSERT_EQ(bico_stwriter_write_f32(w, names[k], v.data(), n), BICO_OK);
  }
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
  struct timespec ts[2] = {{1000000000, 0}, {1000000000, 0}};
  for (const std::string &n : names_in(dir))
    ASSERT_EQ(utimensat(AT_FDCWD, (dir + "/" + n).c_str(), ts, 0), 0);
}

// Rewrites the last 4 bytes of a file in place (its size kept) at the
// first progress call: after the run opened it, before it read it all.
struct RewriteAtFirstTensor {
  std::string path;
  int calls = 0;
  static void fn(void *o, const bico_progress *) {
    auto *r = static_cast<RewriteAtFirstTensor *>(o);
    if (r->calls++ != 0) return;
    struct stat st;
    int fd = open(r->path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) != 0) std::abort();
    float v = 42.0f;
    if (pwrite(fd, &v, 4, st.st_size - 4) != 4) std::abort();
    close(fd);
  }
};

TEST(TransferInputsChanged, ATargetShardRewrittenInPlaceFailsTheRun) {
  TempDir d;
  write_chain(d / "a.st", 0);
  write_chain(d / "aft.st", 0.5);
  std::string B = d / "B";
  write_chain_folder(B, 0);
  std::vector<std::string> shards;
  for (const std::string &n : names_in(B))
    if (n.rfind("model-", 0) == 0) shards.push_back(n);
  ASSERT_GE(shards.size(), 3u);
  std::string shard = B + "/" + shards.back();  // read last
  std::string out = d / "o.st", outdir = d / "B_ft";
  stt::write_bytes(out, "old output");
  ASSERT_EQ(mkdir(outdir.c_str(), 0755), 0);
  stt::write_bytes(outdir + "/old.txt", "old");
  bt::Ctx ctx;
  for (const std::string &o : {out, outdir + "/"}) {
    SCOPED_TRACE(o);
    RewriteAtFirstTensor rw{shard};
    bico_transfer *t = nullptr;
    ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, (d / "a.st").c_str());
    bico_transfer_set_file(t, BICO_FILE_SOURCE_TUNED, (d / "aft.st").c_str());
    bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, B.c_str());
    bico_transfer_set_file(t, BICO_FILE_OUTPUT, o.c_str());
    bico_transfer_set_file(t, BICO_FILE_REPORT, (d / "r.json").c_str());
    bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE);
    ASSERT_EQ(bico_transfer_set_progress(t, RewriteAtFirstTensor::fn, &rw), BICO_OK);
    EXPECT_EQ(bico_transfer_run(t), BICO_E_IO) << "finished with a mixed output";
    std::string m = bico_ctx_errmsg(ctx);
    EXPECT_TRUE(contains(m, shards.back() + " changed while it was being read")) << m;
    EXPECT_TRUE(contains(m, "nothing was written")) << m;
    EXPECT_EQ(rw.calls, 4);
    bico_transfer_free(t);
    EXPECT_EQ(slurp(out), "old output");
    EXPECT_EQ(names_in(outdir), std::vector<std::string>{"old.txt"});
    EXPECT_FALSE(exists(d / "r.json"));
    std::vector<std::string> left;
    for (const std::string &n : names_in(d.path))
      if (n.find(".bico-") != std::string::npos) left.push_back(n);
    EXPECT_EQ(left, std::vector<std::string>{});
    write_chain_folder(B, 0);  // as it was, for the next output
  }
}

TEST(TransferInputsChanged, AStatisticsFileRewrittenInPlaceFailsTheRun) {
  // The statistics are read in panels by the map solvers, module by
  // module, not with the models: the check covers them (and the
  // calibration, votes and bridge files) too.
  TempDir d;
  write_chain(d / "a.st", 0);
  write_chain(d / "aft.st", 0.5);
  std::string stats = d / "s.st";
  {
    bt::Ctx ctx;
    bico_stwriter *w = nullptr;
    ASSERT_EQ(bico_stwriter_create(ctx, stats.c_str(), &w), BICO_OK);
    const char *names[4] = {"blocks.0.fc.in_xcov", "blocks.0.fc.out_xcov",
                            "blocks.1.fc.in_xcov", "blocks.1.fc.out_xcov"};
    size_t dims[4] = {4, 5, 5, 3};
    for (int k = 0; k < 4; k++) {
      size_t sh[2] = {dims[k], dims[k]};
      ASSERT_EQ(bico_stwriter_declare(w, names[k], BICO_DTYPE_F64, 2, sh), BICO_OK);
    }
    for (int k = 0; k < 4; k++) {
      size_t n = dims[k];
      std::vector<double> v(n * n);
      for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < n; j++)
          v[i * n + j] = (i == j ? 2.0 : 0.0) + 0.1 * std::sin(1.0 + (double)(3 * i + j + k));
      ASSERT_EQ(bico_stwriter_write_f64(w, names[k], v.data(), n * n), BICO_OK);
    }
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
    bico_stwriter_free(w);
    struct timespec ts[2] = {{1000000000, 0}, {1000000000, 0}};
    ASSERT_EQ(utimensat(AT_FDCWD, stats.c_str(), ts, 0), 0);
  }
  bt::Ctx ctx;
  auto run = [&](RewriteAtFirstTensor *rw) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, (d / "a.st").c_str());
    bico_transfer_set_file(t, BICO_FILE_SOURCE_TUNED, (d / "aft.st").c_str());
    bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, (d / "a.st").c_str());
    bico_transfer_set_file(t, BICO_FILE_STATS, stats.c_str());
    bico_transfer_set_file(t, BICO_FILE_OUTPUT, (d / "o.st").c_str());
    bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_BICO);
    if (rw) bico_transfer_set_progress(t, RewriteAtFirstTensor::fn, rw);
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  };
  ASSERT_EQ(run(nullptr), BICO_OK) << bico_ctx_errmsg(ctx);
  std::string before = slurp(d / "o.st");
  RewriteAtFirstTensor rw{stats};
  EXPECT_EQ(run(&rw), BICO_E_IO) << "finished with maps of two statistics";
  std::string m = bico_ctx_errmsg(ctx);
  EXPECT_TRUE(contains(m, stats + " changed while it was being read")) << m;
  EXPECT_EQ(slurp(d / "o.st"), before);
}

TEST(TransferProgress, LoraRunsReportEveryTargetModule) {
  TempDir d;
  write_chain(d / "a.st", 0);
  write_chain(d / "aft.st", 0.5);
  bt::Ctx ctx;
  {  // an adapter on blocks.1.fc only (rank 2)
    bico_lora *l = nullptr;
    ASSERT_EQ(bico_lora_create(ctx, &l), BICO_OK);
    std::vector<float> b(3 * 2, 0.25f), a(2 * 5, 0.5f);
    ASSERT_EQ(bico_lora_add_module(l, "blocks.1.fc", BICO_LORA_LINEAR, 2, 3, 5, 2.0,
                                   b.data(), a.data()),
              BICO_OK) << bico_ctx_errmsg(ctx);
    ASSERT_EQ(bico_lora_save(l, (d / "ad").c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
    bico_lora_free(l);
  }
  Seen seen;
  bico_transfer *t = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, (d / "a.st").c_str());
  bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, (d / "a.st").c_str());
  bico_transfer_set_file(t, BICO_FILE_LORA, (d / "ad").c_str());
  bico_transfer_set_file(t, BICO_FILE_LORA_OUTPUT, (d / "out").c_str());
  bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE);
  ASSERT_EQ(bico_transfer_set_progress(t, Seen::fn, &seen), BICO_OK);
  ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_transfer_free(t);
  // one call per target module, in order, the last with done == total
  ASSERT_EQ(seen.calls.size(), 2u);
  EXPECT_EQ(seen.names, (std::vector<std::string>{"blocks.0.fc", "blocks.1.fc"}));
  for (size_t k = 0; k < 2; k++) {
    EXPECT_EQ(seen.calls[k].tensors_done, k + 1);
    EXPECT_EQ(seen.calls[k].tensors_total, 2u);
    EXPECT_DOUBLE_EQ(seen.calls[k].done, double(k + 1));
    EXPECT_DOUBLE_EQ(seen.calls[k].total, 2.0);
  }
}

}  // namespace
