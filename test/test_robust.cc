// Robustness of the whole library in a serving process:
//  - failure paths never touch files they did not create (found by
//    `make leak-check`: bico_stwriter_create's allocation-failure path
//    unlinked an uninitialised temporary name);
//  - many threads, each with its own context, running whole transfers at
//    once give bit-identical outputs to a sequential run (also run under
//    ThreadSanitizer by `make tsan-check`).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bico/bico.h"
#include "bico/safetensors.h"
#include "bico/transfer.h"
#include "st_testutil.h"
#include "testutil.h"

namespace {

// Each allocation is pre-filled with the path of an innocent file, as
// reused heap memory may well be, and each allocation in turn fails; the
// file must survive.
struct StaleAllocator {
  std::string stale;  // what every fresh block holds
  long fail_at = -1;  // index of the allocation that fails (-1: none)
  long count = 0;
};

void *stale_alloc(void *opaque, size_t size) {
  auto *a = static_cast<StaleAllocator *>(opaque);
  if (a->count++ == a->fail_at) return nullptr;
  char *p = static_cast<char *>(std::malloc(size));
  if (p != nullptr && size > 0) {
    size_t n = std::min(size - 1, a->stale.size());
    std::memcpy(p, a->stale.data(), n);
    p[n] = '\0';
  }
  return p;
}

void stale_free(void *opaque, void *p) {
  (void)opaque;
  std::free(p);
}

TEST(RobustFailurePaths, WriterCreateNeverUnlinksWhatItDidNotCreate) {
  stt::TempDir dir;
  const std::string victim = dir / "victim.safetensors";
  const std::string out = dir / "out.safetensors";
  for (long k = 0; k < 12; k++) {
    SCOPED_TRACE("allocation " + std::to_string(k) + " fails");
    stt::write_bytes(victim, "precious");
    StaleAllocator a;
    a.stale = victim;
    a.fail_at = k;
    bico_ctx *ctx = nullptr;
    // Allocation 0 is the context itself.
    if (bico_ctx_create_with_allocator(&ctx, stale_alloc, stale_free, &a) !=
        BICO_OK) {
      EXPECT_EQ(k, 0);
      continue;
    }
    bico_stwriter *w = nullptr;
    bico_status st = bico_stwriter_create(ctx, out.c_str(), &w);
    if (st == BICO_OK) {
      const size_t shape[1] = {2};
      const float v[2] = {1.0f, 2.0f};
      st = bico_stwriter_declare(w, "t", BICO_DTYPE_F32, 1, shape);
      if (st == BICO_OK) st = bico_stwriter_write_f32(w, "t", v, 2);
      if (st == BICO_OK) st = bico_stwriter_commit(w);
      bico_stwriter_free(w);
    } else {
      EXPECT_EQ(st, BICO_E_NOMEM) << bico_ctx_errmsg(ctx);
      EXPECT_EQ(w, nullptr);
    }
    bico_ctx_free(ctx);
    EXPECT_EQ(stt::read_bytes(victim), "precious");
    for (auto &name : dir.list())
      EXPECT_EQ(name.find("bico-tmp"), std::string::npos) << name;
  }
}

using Spec = std::vector<std::pair<std::string, std::vector<size_t>>>;

void write_random(const std::string &path, const Spec &ts, double scale,
                  uint64_t seed) {
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
    std::vector<float> v = bt::randn(g, n, 1, scale).f32();
    ASSERT_EQ(bico_stwriter_write_f32(w, t.first.c_str(), v.data(), n), BICO_OK);
  }
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
}

// One whole BiCo transfer (calibration statistics, centering, Procrustes,
// transport, atomic write) with its own context.
bico_status transfer(const stt::TempDir &dir, const std::string &out,
                     std::string *err) {
  bico_ctx *ctx = nullptr;
  if (bico_ctx_create(&ctx) != BICO_OK) return BICO_E_NOMEM;
  bico_transfer *t = nullptr;
  bico_status st = bico_transfer_create(ctx, &t);
  const std::pair<int, std::string> files[] = {
      {BICO_FILE_SOURCE_BASE, dir / "A.safetensors"},
      {BICO_FILE_TASK_VECTOR, dir / "tau.safetensors"},
      {BICO_FILE_TARGET_BASE, dir / "B.safetensors"},
      {BICO_FILE_SOURCE_CALIB, dir / "calA.safetensors"},
      {BICO_FILE_TARGET_CALIB, dir / "calB.safetensors"},
      {BICO_FILE_OUTPUT, out}};
  for (auto &f : files)
    if (st == BICO_OK) st = bico_transfer_set_file(t, f.first, f.second.c_str());
  if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_CENTER, 1);
  if (st == BICO_OK) st = bico_transfer_run(t);
  if (st != BICO_OK) *err = bico_ctx_errmsg(ctx);
  bico_transfer_free(t);
  bico_ctx_free(ctx);
  return st;
}

TEST(RobustThreads, ConcurrentTransfersMatchASequentialRunBitForBit) {
  stt::TempDir dir;
  const size_t d_a = 12, d_b = 16, rows = 64, blocks = 3;
  Spec pa, pb, ca, cb;
  for (size_t i = 0; i < blocks; i++) {
    std::string m = "blocks." + std::to_string(i) + ".fc";
    pa.push_back({m + ".weight", {d_a, d_a}});
    pa.push_back({m + ".bias", {d_a}});
    pb.push_back({m + ".weight", {d_b, d_b}});
    pb.push_back({m + ".bias", {d_b}});
    ca.push_back({m + ".input", {rows, d_a}});
    ca.push_back({m + ".output_grad", {rows, d_a}});
    cb.push_back({m + ".input", {rows, d_b}});
    cb.push_back({m + ".output_grad", {rows, d_b}});
  }
  write_random(dir / "A.safetensors", pa, 1.0, 1);
  write_random(dir / "tau.safetensors", pa, 0.1, 2);
  write_random(dir / "B.safetensors", pb, 1.0, 3);
  write_random(dir / "calA.safetensors", ca, 1.0, 4);
  write_random(dir / "calB.safetensors", cb, 1.0, 5);

  std::string err;
  ASSERT_EQ(transfer(dir, dir / "seq.safetensors", &err), BICO_OK) << err;
  const std::string want = stt::read_bytes(dir / "seq.safetensors");
  ASSERT_GT(want.size(), 0u);

  const int nthreads = 8, runs = 3;
  std::vector<std::string> errs(nthreads);
  std::vector<int> failures(nthreads, 0);
  std::vector<std::thread> pool;
  for (int k = 0; k < nthreads; k++)
    pool.emplace_back([&, k] {
      for (int r = 0; r < runs; r++) {
        std::string out = dir / ("t" + std::to_string(k) + "_" +
                                 std::to_string(r) + ".safetensors");
        if (transfer(dir, out, &errs[k]) != BICO_OK) failures[k]++;
      }
    });
  for (auto &th : pool) th.join();
  for (int k = 0; k < nthreads; k++) {
    EXPECT_EQ(failures[k], 0) << "thread " << k << ": " << errs[k];
    for (int r = 0; r < runs; r++) {
      std::string out = dir / ("t" + std::to_string(k) + "_" +
                               std::to_string(r) + ".safetensors");
      EXPECT_TRUE(stt::read_bytes(out) == want)
          << "thread " << k << " run " << r << " differs from the sequential run";
    }
  }
}

// ---- Issue 14: nothing lost, nothing crashes ----

// A naive transfer A + tau -> B with the given files on top.
struct Naive {
  stt::TempDir dir;
  std::string A, tau, B;
  Naive() {
    Spec p = {{"blocks.0.fc.weight", {4, 4}}, {"blocks.0.fc.bias", {4}}};
    A = dir / "A.safetensors";
    tau = dir / "tau.safetensors";
    B = dir / "B.safetensors";
    write_random(A, p, 1.0, 1);
    write_random(tau, p, 0.1, 2);
    write_random(B, p, 1.0, 3);
  }
  bico_status run(bico_ctx *ctx, const std::vector<std::pair<int, std::string>> &extra,
                  double alpha = 1.0) const {
    bico_transfer *t = nullptr;
    bico_status st = bico_transfer_create(ctx, &t);
    std::vector<std::pair<int, std::string>> files = {
        {BICO_FILE_SOURCE_BASE, A}, {BICO_FILE_TASK_VECTOR, tau},
        {BICO_FILE_TARGET_BASE, B}};
    files.insert(files.end(), extra.begin(), extra.end());
    for (auto &f : files)
      if (st == BICO_OK) st = bico_transfer_set_file(t, f.first, f.second.c_str());
    if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE);
    if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, alpha);
    if (st == BICO_OK) st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  }
};

bool no_temporaries(const std::string &dir) {
  for (auto &e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().find("bico-tmp") != std::string::npos) return false;
  return true;
}

TEST(RobustIdentity, OutputsThatAreInputsOrEachOtherUnderAnotherSpelling) {
  Naive n;
  bt::Ctx ctx;
  const std::string b0 = stt::read_bytes(n.B), a0 = stt::read_bytes(n.A);
  // The working folder is the fixture's, so "./x" and "x" are spellings.
  char cwd[4096];
  ASSERT_NE(getcwd(cwd, sizeof cwd), nullptr);
  ASSERT_EQ(chdir(n.dir.path.c_str()), 0);
  std::string hard = n.dir / "hard.safetensors", soft = n.dir / "soft.safetensors";
  ASSERT_EQ(link(n.A.c_str(), hard.c_str()), 0);
  ASSERT_EQ(symlink(n.B.c_str(), soft.c_str()), 0);
  const std::vector<std::vector<std::pair<int, std::string>>> cases = {
      {{BICO_FILE_OUTPUT, "o.st"}, {BICO_FILE_REPORT, "./o.st"}},
      {{BICO_FILE_OUTPUT, "o.st"}, {BICO_FILE_DELTA_OUTPUT, n.dir / "./o.st"}},
      {{BICO_FILE_OUTPUT, "./B.safetensors"}},
      {{BICO_FILE_OUTPUT, "o.st"}, {BICO_FILE_REPORT, "../" + n.dir.path.substr(n.dir.path.rfind('/') + 1) + "/A.safetensors"}},
      {{BICO_FILE_OUTPUT, hard}},
      {{BICO_FILE_OUTPUT, soft}},
      {{BICO_FILE_OUTPUT, "o.st"}, {BICO_FILE_DELTA_OUTPUT, "tau.safetensors"}},
  };
  for (size_t k = 0; k < cases.size(); k++) {
    SCOPED_TRACE("case " + std::to_string(k));
    EXPECT_EQ(n.run(ctx, cases[k]), BICO_E_ARG);
    EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("is the same file as"), std::string::npos)
        << bico_ctx_errmsg(ctx);
    EXPECT_EQ(access("o.st", F_OK), -1);
  }
  EXPECT_EQ(stt::read_bytes(n.B), b0);
  EXPECT_EQ(stt::read_bytes(n.A), a0);
  EXPECT_TRUE(no_temporaries(n.dir.path));
  ASSERT_EQ(chdir(cwd), 0);
}

TEST(RobustIdentity, MergeOutputInsideItsLoraInputIsRefused) {
  Naive n;
  bt::Ctx ctx;
  // An adapter folder whose weights file is the merge's output.
  std::string ad = n.dir / "outad";
  mkdir(ad.c_str(), 0755);
  stt::write_bytes(ad + "/adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": 1, \"lora_alpha\": 1}");
  stt::write_bytes(ad + "/adapter_model.safetensors", "precious");
  bico_merge *m = nullptr;
  ASSERT_EQ(bico_merge_create(ctx, &m), BICO_OK);
  bico_merge_set_file(m, BICO_MERGE_FILE_BASE, n.B.c_str());
  bico_merge_set_file(m, BICO_MERGE_FILE_OUTPUT, (ad + "/./adapter_model.safetensors").c_str());
  bico_merge_add_input(m, BICO_MERGE_TASK_VECTOR, n.tau.c_str(), 1.0, 1.0);
  bico_merge_add_input(m, BICO_MERGE_LORA, ad.c_str(), 1.0, 1.0);
  // The adapter is not valid, so the refusal must come before it is read...
  bico_status st = bico_merge_run(m);
  EXPECT_NE(st, BICO_OK);
  EXPECT_EQ(stt::read_bytes(ad + "/adapter_model.safetensors"), "precious");
  bico_merge_free(m);
  // ... and with a task vector spelled differently as the output.
  ASSERT_EQ(bico_merge_create(ctx, &m), BICO_OK);
  bico_merge_set_file(m, BICO_MERGE_FILE_BASE, n.B.c_str());
  bico_merge_set_file(m, BICO_MERGE_FILE_OUTPUT, (n.dir / "o.st").c_str());
  bico_merge_set_file(m, BICO_MERGE_FILE_REPORT, (n.dir / "./tau.safetensors").c_str());
  bico_merge_add_input(m, BICO_MERGE_TASK_VECTOR, n.tau.c_str(), 1.0, 1.0);
  const std::string tau0 = stt::read_bytes(n.tau);
  EXPECT_EQ(bico_merge_run(m), BICO_E_ARG);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("same file"), std::string::npos)
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(stt::read_bytes(n.tau), tau0);
  EXPECT_EQ(access((n.dir / "o.st").c_str(), F_OK), -1);
  bico_merge_free(m);
}

TEST(RobustSpecialFiles, FifoAndSocketOutputsAreRefusedAndKept) {
  Naive n;
  bt::Ctx ctx;
  std::string fifo = n.dir / "fifo", sock = n.dir / "sock";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  int sfd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(sfd, 0);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  ASSERT_LT(sock.size(), sizeof sa.sun_path);
  strcpy(sa.sun_path, sock.c_str());
  ASSERT_EQ(bind(sfd, (struct sockaddr *)&sa, sizeof sa), 0);
  for (int slot : {BICO_FILE_OUTPUT, BICO_FILE_REPORT})
    for (const std::string &special : {fifo, sock}) {
      std::vector<std::pair<int, std::string>> files = {{BICO_FILE_OUTPUT, n.dir / "o.st"}};
      if (slot == BICO_FILE_OUTPUT) files[0].second = special;
      else files.push_back({slot, special});
      EXPECT_EQ(n.run(ctx, files), BICO_E_ARG) << special;
      struct stat sb;
      ASSERT_EQ(lstat(special.c_str(), &sb), 0);
      EXPECT_TRUE(special == fifo ? S_ISFIFO(sb.st_mode) : S_ISSOCK(sb.st_mode)) << special;
    }
  // bico stats --output: the statistics writer refuses it too.
  EXPECT_NE(bico_stats_merge(ctx, std::vector<const char *>{n.A.c_str()}.data(), 1,
                             fifo.c_str()),
            BICO_OK);
  struct stat sb;
  ASSERT_EQ(lstat(fifo.c_str(), &sb), 0);
  EXPECT_TRUE(S_ISFIFO(sb.st_mode));
  close(sfd);
  EXPECT_TRUE(no_temporaries(n.dir.path));
}

TEST(RobustSpecialFiles, SetuidSetgidStickyBitsAreNeverCarried) {
  Naive n;
  bt::Ctx ctx;
  std::string out = n.dir / "o.st";
  stt::write_bytes(out, "old");
  ASSERT_EQ(chmod(out.c_str(), 07755), 0);
  ASSERT_EQ(n.run(ctx, {{BICO_FILE_OUTPUT, out}}), BICO_OK) << bico_ctx_errmsg(ctx);
  struct stat sb;
  ASSERT_EQ(stat(out.c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 07777, 0755u);
}

// Runs fn in a child process with a time limit: a hang or a crash there is
// a test failure here, not a hung or killed test binary.
int in_child(const std::function<int()> &fn, unsigned seconds) {
  pid_t pid = fork();
  if (pid == 0) {
    alarm(seconds);
    _exit(fn());
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return 1000 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

TEST(RobustSpecialFiles, AFifoAsAnyInputDoesNotHang) {
  stt::TempDir dir;
  std::string fifo = dir / "in.safetensors", ad = dir / "ad";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  mkdir(ad.c_str(), 0755);
  ASSERT_EQ(mkfifo((ad + "/adapter_config.json").c_str(), 0644), 0);
  std::string index = dir / "m.safetensors.index.json";
  ASSERT_EQ(mkfifo(index.c_str(), 0644), 0);
  int rc = in_child([&] {
    bico_ctx *ctx = nullptr;
    bico_ctx_create(&ctx);
    bico_stfile *f = nullptr;
    bico_lora *l = nullptr;
    int bad = 0;
    bad |= bico_stfile_open(ctx, fifo.c_str(), &f) != BICO_E_IO;
    bad |= strstr(bico_ctx_errmsg(ctx), "FIFO") == nullptr;
    bad |= (bico_stfile_open(ctx, index.c_str(), &f) != BICO_E_IO) << 1;
    bad |= (bico_lora_open(ctx, ad.c_str(), &l) != BICO_E_IO) << 2;
    bico_ctx_free(ctx);
    return bad;
  }, 10);
  EXPECT_EQ(rc, 0) << "exit 1014 = SIGALRM: open() blocked on a FIFO";
}

TEST(RobustCrash, AnInputTruncatedWhileOpenFailsInsteadOfSigbus) {
  stt::TempDir dir;
  std::string path = dir / "big.safetensors";
  const size_t n = 1 << 20;  // 4 MiB of floats
  write_random(path, {{"w", {n}}}, 1.0, 9);
  int rc = in_child([&] {
    bico_ctx *ctx = nullptr;
    bico_ctx_create(&ctx);
    bico_stfile *f = nullptr;
    if (bico_stfile_open(ctx, path.c_str(), &f) != BICO_OK) return 2;
    if (truncate(path.c_str(), 4096) != 0) return 3;
    std::vector<float> out(n);
    const void *data;
    size_t nb;
    int bad = bico_stfile_read_f32(f, 0, out.data(), n) != BICO_E_IO;
    bad |= (bico_stfile_data(f, 0, &data, &nb) != BICO_E_IO) << 1;
    bad |= (bico_stfile_check_finite(f, 0) != BICO_E_IO) << 2;
    bad |= (strstr(bico_ctx_errmsg(ctx), "shorter") == nullptr) << 3;
    bico_stfile_free(f);
    bico_ctx_free(ctx);
    return bad;
  }, 20);
  EXPECT_EQ(rc, 0) << "1007 = SIGBUS, 1011 = SIGSEGV";
}

TEST(RobustScale, IndexWithOneHundredThousandShardsIsRejectedQuickly) {
  stt::TempDir dir;
  std::string idx = dir / "m.safetensors.index.json";
  std::string text = "{\"weight_map\": {";
  for (int i = 0; i < 100000; i++)
    text += (i ? ", " : "") + std::string("\"t") + std::to_string(i) + "\": \"s" +
            std::to_string(i) + ".safetensors\"";
  text += "}}";
  stt::write_bytes(idx, text);
  bt::Ctx ctx;
  bico_stfile *f = nullptr;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(bico_stfile_open(ctx, idx.c_str(), &f), BICO_E_IO);  // s0 missing
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 5.0) << "27 s before the shard lookup was hashed";
}

TEST(RobustTemporaries, StaleOnesOfDeadProcessesGoLiveOnesStay) {
  stt::TempDir dir;
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  std::string stale = dir / (".o.st.bico-tmp." + std::to_string(dead) + ".AbCdEf");
  std::string live = dir / ".o.st.bico-tmp.1.AbCdEf";  // init never dies
  std::string other = dir / (".p.st.bico-tmp." + std::to_string(dead) + ".AbCdEf");
  for (auto &p : {stale, live, other}) stt::write_bytes(p, "x");
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, (dir / "o.st").c_str(), &w), BICO_OK);
  bico_stwriter_free(w);
  EXPECT_EQ(access(stale.c_str(), F_OK), -1);
  EXPECT_EQ(access(live.c_str(), F_OK), 0);
  EXPECT_EQ(access(other.c_str(), F_OK), 0) << "another output's temporaries";
}

namespace {

// A pid no process has (a child that ended): what a live run in another
// pid namespace looks like from here.
pid_t dead_pid() {
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  return dead;
}

// A child process that opens `path` (a file or a folder) and holds an
// exclusive flock on it, as a live run holds its temporaries, until
// release(); ready() once the lock is taken.
struct LockHolder {
  pid_t pid = -1;
  int go[2] = {-1, -1}, up[2] = {-1, -1};
  explicit LockHolder(const std::string &path) {
    if (pipe(go) != 0 || pipe(up) != 0) return;
    pid = fork();
    if (pid == 0) {
      int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
      char c = fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) == 0 ? 'y' : 'n';
      (void)!write(up[1], &c, 1);
      (void)!read(go[0], &c, 1);  // until the parent lets go
      _exit(0);
    }
  }
  bool ready() {
    char c = 0;
    return pid > 0 && read(up[0], &c, 1) == 1 && c == 'y';
  }
  void release() {  // a byte, not an EOF: other children hold go[1] too
    if (pid <= 0) return;
    (void)!write(go[1], "x", 1);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
  ~LockHolder() {
    release();
    for (int fd : {go[0], go[1], up[0], up[1]})
      if (fd >= 0) close(fd);
  }
};

// Whether another open file description can take path's lock now.
bool lockable(const std::string &path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = flock(fd, LOCK_EX | LOCK_NB) == 0;
  close(fd);
  return ok;
}

std::vector<std::string> temporaries_in(const std::string &dir) {
  std::vector<std::string> v;
  for (auto &e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().find(".bico-tmp.") != std::string::npos)
      v.push_back(e.path().string());
  return v;
}

}  // namespace

TEST(RobustTemporaries, HeldOnesOfPidsThisProcessCannotSeeStay) {
  // A run in another pid namespace (a container sharing the folder) names
  // its temporaries with a pid that is no process here; what it holds
  // (its flock) is what keeps them, a file or a folder.  The old scan
  // trusted kill(pid, 0) and removed them mid-run.
  stt::TempDir dir;
  std::string pid = std::to_string(dead_pid());
  std::string held = dir / (".o.st.bico-tmp." + pid + ".HeLdFi");
  std::string heldd = dir / (".o.st.bico-tmp." + pid + ".HeLdDi");
  std::string stale = dir / (".o.st.bico-tmp." + pid + ".StAlFi");
  std::string staled = dir / (".o.st.bico-tmp." + pid + ".StAlDi");
  for (auto &p : {held, stale}) stt::write_bytes(p, "half");
  for (auto &p : {heldd, staled}) {
    ASSERT_EQ(mkdir(p.c_str(), 0700), 0);
    stt::write_bytes(p + "/model.safetensors", "half");
  }
  LockHolder a(held), b(heldd);
  ASSERT_TRUE(a.ready());
  ASSERT_TRUE(b.ready());
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, (dir / "o.st").c_str(), &w), BICO_OK);
  bico_stwriter_free(w);
  EXPECT_EQ(stt::read_bytes(held), "half") << "a live run's file went";
  EXPECT_EQ(stt::read_bytes(heldd + "/model.safetensors"), "half")
      << "a live run's folder went";
  EXPECT_EQ(access(stale.c_str(), F_OK), -1) << "nobody holds it";
  EXPECT_EQ(access(staled.c_str(), F_OK), -1) << "nobody holds it";
  // Once the holders are gone, the next run removes them.
  a.release();
  b.release();
  ASSERT_EQ(bico_stwriter_create(ctx, (dir / "o.st").c_str(), &w), BICO_OK);
  bico_stwriter_free(w);
  EXPECT_EQ(access(held.c_str(), F_OK), -1);
  EXPECT_EQ(access(heldd.c_str(), F_OK), -1);
}

TEST(RobustTemporaries, ARunHoldsTheLockOfItsOwnUntilTheCommit) {
  // The writer's temporary file (and a folder writer's new folder) is
  // locked from its creation until the commit or the free: seen from
  // another run as a temporary of a pid it cannot see, it is kept.
  stt::TempDir dir;
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, (dir / "o.st").c_str(), &w), BICO_OK);
  size_t sh[1] = {2};
  float v[2] = {1, 2};
  ASSERT_EQ(bico_stwriter_declare(w, "t", BICO_DTYPE_F32, 1, sh), BICO_OK);
  ASSERT_EQ(bico_stwriter_write_f32(w, "t", v, 2), BICO_OK);
  auto tmps = temporaries_in(dir.path);
  ASSERT_EQ(tmps.size(), 1u);
  EXPECT_FALSE(lockable(tmps[0]));
  // As another namespace's run would see it: a pid that is no process.
  std::string moved = dir / (".o.st.bico-tmp." + std::to_string(dead_pid()) +
                             ".MoVeD0");
  ASSERT_EQ(rename(tmps[0].c_str(), moved.c_str()), 0);
  bico_stwriter *w2 = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, (dir / "o.st").c_str(), &w2), BICO_OK);
  bico_stwriter_free(w2);
  EXPECT_EQ(access(moved.c_str(), F_OK), 0) << "a live writer's file went";
  bico_stwriter_free(w);
  EXPECT_TRUE(lockable(moved)) << "the lock goes with the writer";
  unlink(moved.c_str());

  // A folder writer's new folder: locked too, and let go at the commit.
  ASSERT_EQ(bico_stwriter_create_folder(ctx, (dir / "m").c_str(), nullptr, 0,
                                        &w),
            BICO_OK);
  ASSERT_EQ(bico_stwriter_declare(w, "t", BICO_DTYPE_F32, 1, sh), BICO_OK);
  ASSERT_EQ(bico_stwriter_write_f32(w, "t", v, 2), BICO_OK);
  tmps = temporaries_in(dir.path);
  ASSERT_EQ(tmps.size(), 1u);
  EXPECT_FALSE(lockable(tmps[0]));
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
  EXPECT_TRUE(temporaries_in(dir.path).empty());
  EXPECT_TRUE(lockable(dir / "m"));
}

TEST(RobustTemporaries, LongBasenamesForTheReportToo) {
  Naive n;
  bt::Ctx ctx;
  std::string base(240, 'r');
  std::string rep = n.dir / (base + ".json"), out = n.dir / (base + ".st");
  ASSERT_EQ(n.run(ctx, {{BICO_FILE_OUTPUT, out}, {BICO_FILE_REPORT, rep}}), BICO_OK)
      << bico_ctx_errmsg(ctx);
  EXPECT_NE(stt::read_bytes(rep).find("\"method\""), std::string::npos);
  EXPECT_TRUE(no_temporaries(n.dir.path));
}

TEST(RobustInputs, StatisticsMustBeFloatAndF64CalibrationBeyondFloatIsNamed) {
  stt::TempDir dir;
  bt::Ctx ctx;
  const size_t d = 4, rows = 8;
  Spec p = {{"blocks.0.fc.weight", {d, d}}};
  write_random(dir / "A.st", p, 1.0, 1);
  write_random(dir / "tau.st", p, 0.1, 2);
  write_random(dir / "B.st", p, 1.0, 3);
  // A BOOL statistic of the right shape.
  {
    bico_stwriter *w = nullptr;
    ASSERT_EQ(bico_stwriter_create(ctx, (dir / "stats.st").c_str(), &w), BICO_OK);
    size_t sh[2] = {d, d};
    std::string ones(d * d, '\1');
    for (const char *k : {"blocks.0.fc.in_xcov", "blocks.0.fc.out_xcov"})
      ASSERT_EQ(bico_stwriter_declare(w, k, BICO_DTYPE_BOOL, 2, sh), BICO_OK);
    for (const char *k : {"blocks.0.fc.in_xcov", "blocks.0.fc.out_xcov"})
      ASSERT_EQ(bico_stwriter_write_raw(w, k, ones.data(), ones.size()), BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
    bico_stwriter_free(w);
  }
  auto run = [&](std::vector<std::pair<int, std::string>> extra) {
    bico_transfer *t = nullptr;
    bico_transfer_create(ctx, &t);
    std::vector<std::pair<int, std::string>> files = {
        {BICO_FILE_SOURCE_BASE, dir / "A.st"}, {BICO_FILE_TASK_VECTOR, dir / "tau.st"},
        {BICO_FILE_TARGET_BASE, dir / "B.st"}, {BICO_FILE_OUTPUT, dir / "o.st"}};
    files.insert(files.end(), extra.begin(), extra.end());
    for (auto &f : files) bico_transfer_set_file(t, f.first, f.second.c_str());
    bico_status st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  };
  EXPECT_EQ(run({{BICO_FILE_STATS, dir / "stats.st"}}), BICO_E_FORMAT) << bico_ctx_errmsg(ctx);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("BOOL"), std::string::npos)
      << bico_ctx_errmsg(ctx);
  // F64 calibration holding 1e200: finite, but beyond float's range.
  for (const char *which : {"calA.st", "calB.st"}) {
    bico_stwriter *w = nullptr;
    ASSERT_EQ(bico_stwriter_create(ctx, (dir / which).c_str(), &w), BICO_OK);
    size_t sh[2] = {rows, d};
    std::vector<double> x(rows * d, 0.5);
    if (std::string(which) == "calA.st") x[2 * d + 1] = 1e200;
    for (const char *k : {"blocks.0.fc.input", "blocks.0.fc.output_grad"})
      ASSERT_EQ(bico_stwriter_declare(w, k, BICO_DTYPE_F64, 2, sh), BICO_OK);
    for (const char *k : {"blocks.0.fc.input", "blocks.0.fc.output_grad"})
      ASSERT_EQ(bico_stwriter_write_f64(w, k, x.data(), x.size()), BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
    bico_stwriter_free(w);
  }
  EXPECT_EQ(run({{BICO_FILE_SOURCE_CALIB, dir / "calA.st"},
                 {BICO_FILE_TARGET_CALIB, dir / "calB.st"}}),
            BICO_E_NONFINITE);
  std::string msg = bico_ctx_errmsg(ctx);
  EXPECT_NE(msg.find("1e+200"), std::string::npos) << msg;
  EXPECT_NE(msg.find("beyond float"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("Inf"), std::string::npos) << msg;
}

}  // namespace
