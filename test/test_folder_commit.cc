// Folder commits (issue 32): the run's lock on an output folder, the carry
// of the old folder's entries (sub-folder attributes, entries that vanish
// or appear during the run), mount points, the working directory, dangling
// links, and the public bico_folder API.  Every test looks at the folder
// from outside: names, inodes, bytes, attributes and times read back with
// the system calls, other processes made with fork.
#include <gtest/gtest.h>

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "st_testutil.h"
#include "testutil.h"

// ---- fault injection: linkat, the carry's one call per file ----
//
// The executable's linkat interposes on the C library's for libbico (the
// linker exports it because the library refers to it).  With g_vanish set,
// the entry of that name is removed just before it is linked (it vanished
// during the carry); with g_change set, the entry of that name is replaced
// by another file right after it was linked (it changed after the carry).
namespace {
std::string g_vanish, g_change;
}

// With g_fail_rename set, a rename onto a file of that name fails (EIO): a
// commit that moves files into place one by one fails half-way.
namespace {
std::string g_fail_rename;
}

extern "C" int rename(const char *from, const char *to) noexcept {
  using fn_t = int (*)(const char *, const char *);
  static fn_t real = (fn_t)dlsym(RTLD_NEXT, "rename");
  const char *b = strrchr(to, '/');
  if (!g_fail_rename.empty() && g_fail_rename == (b ? b + 1 : to)) {
    errno = EIO;
    return -1;
  }
  return real(from, to);
}

extern "C" int linkat(int fd1, const char *from, int fd2, const char *to,
                      int flags) noexcept {
  using fn_t = int (*)(int, const char *, int, const char *, int);
  static fn_t real = (fn_t)dlsym(RTLD_NEXT, "linkat");
  if (!g_vanish.empty() && g_vanish == from) {
    g_vanish.clear();
    unlinkat(fd1, from, 0);
  }
  int r = real(fd1, from, fd2, to, flags);
  if (r == 0 && !g_change.empty() && g_change == from) {
    g_change.clear();
    int fd = openat(fd1, ".swap", O_CREAT | O_WRONLY | O_TRUNC, 0644);
    if (fd >= 0) {
      (void)!write(fd, "changed", 7);
      close(fd);
      renameat(fd1, ".swap", fd1, from);
    }
  }
  return r;
}

namespace {

using stt::TempDir;

bool exists(const std::string &p) {
  struct stat st;
  return lstat(p.c_str(), &st) == 0;
}

ino_t inode(const std::string &p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 ? st.st_ino : 0;
}

std::vector<std::string> names_in(const std::string &dir) {
  std::vector<std::string> v;
  for (auto &e : std::filesystem::directory_iterator(dir))
    v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

bool contains(const std::string &s, const std::string &part) {
  return s.find(part) != std::string::npos;
}

// A one-tensor model folder written at dir by the library's folder writer
// (value v); the status of the first failing call.
bico_status write_model(bico_ctx *ctx, const std::string &dir, float v = 1) {
  bico_stwriter *w = nullptr;
  bico_status st = bico_stwriter_create_folder(ctx, dir.c_str(), nullptr, 0, &w);
  size_t n = 3;
  float x[3] = {v, v, v};
  if (st == BICO_OK) st = bico_stwriter_declare(w, "w", BICO_DTYPE_F32, 1, &n);
  if (st == BICO_OK) st = bico_stwriter_write_f32(w, "w", x, 3);
  if (st == BICO_OK) st = bico_stwriter_commit(w);
  bico_stwriter_free(w);
  return st;
}

// n small files "u<k>.txt" holding their own names, and a sub-folder.
void user_files(const std::string &dir, int n) {
  mkdir(dir.c_str(), 0755);
  mkdir((dir + "/sub").c_str(), 0755);
  for (int k = 0; k < n; k++) {
    std::string name = "u" + std::to_string(k) + ".txt";
    stt::write_bytes(dir + "/" + (k % 2 ? "sub/" : "") + name, name);
  }
}

int count_user_files(const std::string &dir, int n) {
  int ok = 0;
  for (int k = 0; k < n; k++) {
    std::string name = "u" + std::to_string(k) + ".txt";
    ok += stt::read_bytes(dir + "/" + (k % 2 ? "sub/" : "") + name) == name;
  }
  return ok;
}

// Names in dir that a run left behind: temporaries, kept trees, locks.
std::vector<std::string> leftovers(const std::string &dir) {
  std::vector<std::string> v;
  for (const std::string &n : names_in(dir))
    if (contains(n, ".bico-")) v.push_back(n);
  return v;
}

// A child process: runs f, exits with its value (0 success).
template <class F>
pid_t spawn(F f) {
  pid_t pid = fork();
  if (pid == 0) _exit(f());
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

// ---- the run's lock ----

TEST(FolderLock, ASecondWriterIsRefusedNamingTheHolder) {
  TempDir d;
  std::string out = d / "out", link = d / "link";
  user_files(out, 4);
  ASSERT_EQ(symlink("out", link.c_str()), 0);
  int ready[2], go[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(go), 0);
  // Another process holds the folder through a bico_folder.
  pid_t holder = spawn([&] {
    bico_ctx *ctx = nullptr;
    bico_folder *f = nullptr;
    if (bico_ctx_create(&ctx) != BICO_OK || bico_folder_create(ctx, &f) ||
        bico_folder_add_output(f, "output", out.c_str(), BICO_FOLDER_CARRY,
                               nullptr) ||
        bico_folder_begin(f))
      return 2;
    char c = 'r';
    if (write(ready[1], &c, 1) != 1 || read(go[0], &c, 1) != 1) return 3;
    bico_folder_free(f);
    bico_ctx_free(ctx);
    return 0;
  });
  char c;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  std::string lock = d / ".out.bico-lock";
  EXPECT_EQ(stt::read_bytes(lock).rfind(std::to_string(holder) + "\n", 0), 0u)
      << "the lock file names its holder";
  bt::Ctx ctx;
  for (const std::string &spelling :
       {out, out + "/", d.path + "/./out", link, link + "/"}) {
    SCOPED_TRACE(spelling);
    EXPECT_EQ(write_model(ctx, spelling), BICO_E_IO);
    std::string m = bico_ctx_errmsg(ctx);
    EXPECT_TRUE(contains(m, "being written by another run")) << m;
    EXPECT_TRUE(contains(m, "pid " + std::to_string(holder))) << m;
    EXPECT_TRUE(contains(m, "bico_tests")) << m;  // the holder's command
    EXPECT_TRUE(contains(m, "nothing was written")) << m;
    bico_folder *f = nullptr;
    ASSERT_EQ(bico_folder_create(ctx, &f), BICO_OK);
    ASSERT_EQ(bico_folder_add_output(f, nullptr, spelling.c_str(),
                                     BICO_FOLDER_CARRY, nullptr), BICO_OK);
    EXPECT_EQ(bico_folder_begin(f), BICO_E_IO);
    EXPECT_TRUE(contains(bico_ctx_errmsg(ctx), "being written by another run"));
    bico_folder_free(f);
  }
  EXPECT_EQ(count_user_files(out, 4), 4);
  EXPECT_FALSE(exists(out + "/model.safetensors"));
  ASSERT_EQ(write(go[1], "g", 1), 1);
  EXPECT_EQ(wait_exit(holder), 0);
  EXPECT_FALSE(exists(lock)) << "the holder removes the lock file";
  // Free again: the writer goes through and keeps the user's files.
  EXPECT_EQ(write_model(ctx, link), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(count_user_files(out, 4), 4);
  EXPECT_TRUE(exists(out + "/model.safetensors"));
  EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
  for (int fd : {ready[0], ready[1], go[0], go[1]}) close(fd);
}

TEST(FolderLock, ConcurrentWritersNeverLoseTheUsersFiles) {
  // Three processes write one output folder holding 3000 files of the
  // user's (half in a sub-folder) at once: without waiting, each either
  // writes or is refused naming a holder; with a wait, all write, one
  // after another.  Every file of the user's survives, byte for byte.
  TempDir d;
  std::string out = d / "out";
  const int N = 3000;
  user_files(out, N);
  for (double wait : {0.0, 600.0}) {
    SCOPED_TRACE(wait);
    int gate[2];
    ASSERT_EQ(pipe(gate), 0);
    std::vector<pid_t> kids;
    for (int k = 0; k < 3; k++)
      kids.push_back(spawn([&, k] {
        close(gate[1]);
        char c;
        if (read(gate[0], &c, 1) != 0) return 9;  // all start together
        bico_ctx *ctx = nullptr;
        if (bico_ctx_create(&ctx) != BICO_OK ||
            bico_ctx_set_param(ctx, BICO_CTX_FOLDER_WAIT, wait) != BICO_OK)
          return 8;
        bico_status st = write_model(ctx, out, (float)k);
        std::string m = bico_ctx_errmsg(ctx);
        bico_ctx_free(ctx);
        if (st == BICO_OK) return 0;
        return st == BICO_E_IO && contains(m, "being written by another run")
                   ? 1 : 7;
      }));
    close(gate[0]);
    close(gate[1]);  // go
    int wrote = 0;
    for (pid_t p : kids) {
      int rc = wait_exit(p);
      EXPECT_TRUE(rc == 0 || (rc == 1 && wait == 0)) << rc;
      wrote += rc == 0;
    }
    EXPECT_GE(wrote, 1);
    if (wait > 0) {
      EXPECT_EQ(wrote, 3);
    }
    EXPECT_EQ(count_user_files(out, N), N);
    EXPECT_EQ(names_in(out).size(), (size_t)N / 2 + 2);  // + sub, model
    EXPECT_EQ(names_in(out + "/sub").size(), (size_t)N / 2);
    EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
  }
}

TEST(FolderLock, InOneProcessWritersJoinARunAndRunsRefuse) {
  TempDir d;
  std::string out = d / "out";
  user_files(out, 2);
  bt::Ctx ctx, other;
  bico_folder *run = nullptr;
  ASSERT_EQ(bico_folder_create(ctx, &run), BICO_OK);
  ASSERT_EQ(bico_folder_add_output(run, "output", out.c_str(),
                                   BICO_FOLDER_CARRY, nullptr), BICO_OK);
  ASSERT_EQ(bico_folder_begin(run), BICO_OK) << bico_ctx_errmsg(ctx);
  // The model folder writer joins the run's lock (another context too):
  // no deadlock, no refusal.
  EXPECT_EQ(write_model(other, out), BICO_OK) << bico_ctx_errmsg(other);
  EXPECT_TRUE(exists(d / ".out.bico-lock")) << "still the run's";
  // A second run of this process is refused.
  bico_folder *second = nullptr;
  ASSERT_EQ(bico_folder_create(other, &second), BICO_OK);
  ASSERT_EQ(bico_folder_add_output(second, nullptr, (out + "/").c_str(), 0,
                                   nullptr), BICO_OK);
  EXPECT_EQ(bico_folder_begin(second), BICO_E_IO);
  EXPECT_TRUE(contains(bico_ctx_errmsg(other), "already being written by this "
                                               "process")) << bico_ctx_errmsg(other);
  bico_folder_free(second);
  bico_folder_free(run);
  EXPECT_FALSE(exists(d / ".out.bico-lock"));
  EXPECT_EQ(count_user_files(out, 2), 2);
  EXPECT_TRUE(exists(out + "/model.safetensors"));
}

// ---- the carry ----

TEST(FolderCarry, AnEntryThatVanishesDuringTheCarryFailsTheCommit) {
  TempDir d;
  std::string out = d / "out";
  user_files(out, 4);
  stt::write_bytes(out + "/victim.txt", "v");
  bt::Ctx ctx;
  ASSERT_EQ(write_model(ctx, out, 1), BICO_OK);
  std::string before = stt::read_bytes(out + "/model.safetensors");
  g_vanish = "victim.txt";
  EXPECT_EQ(write_model(ctx, out, 2), BICO_E_IO);
  g_vanish.clear();
  std::string m = bico_ctx_errmsg(ctx);
  EXPECT_TRUE(contains(m, "vanished")) << m;
  EXPECT_TRUE(contains(m, "victim.txt")) << m;
  EXPECT_TRUE(contains(m, "nothing was written")) << m;
  // The old folder as it was (but for the file that vanished).
  EXPECT_EQ(stt::read_bytes(out + "/model.safetensors"), before);
  EXPECT_EQ(count_user_files(out, 4), 4);
  EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
}

TEST(FolderCarry, FilesMadeInASubFolderDuringCommitsAreKept) {
  // A thread makes files in out/sub (by path, as a training loop writing
  // checkpoints would) while five commits replace the folder: every file
  // it made is afterwards in out/sub, or in an old tree kept beside it.
  TempDir d;
  std::string out = d / "out";
  user_files(out, 10);
  bt::Ctx ctx;
  ASSERT_EQ(write_model(ctx, out), BICO_OK);
  std::atomic<bool> stop{false};
  std::vector<std::string> made;
  std::thread maker([&] {
    // at least 50 files, at most 3000 (each commit carries all of them)
    for (int i = 0; (!stop.load() || made.size() < 50) && made.size() < 3000;
         i++) {
      std::string name = "f" + std::to_string(i);
      int fd = open((out + "/sub/" + name).c_str(),
                    O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
      if (fd < 0) continue;
      (void)!write(fd, name.data(), name.size());
      close(fd);
      made.push_back(name);
    }
  });
  for (int k = 0; k < 5; k++) EXPECT_EQ(write_model(ctx, out, (float)k), BICO_OK);
  stop = true;
  maker.join();
  std::vector<std::string> homes = {out + "/sub"};
  for (const std::string &n : leftovers(d.path)) {
    EXPECT_TRUE(contains(n, ".bico-kept.")) << n;
    homes.push_back(d / n + "/sub");
  }
  size_t found = 0;
  for (const std::string &n : made)
    for (const std::string &h : homes)
      if (stt::read_bytes(h + "/" + n) == n) {
        found++;
        break;
      }
  EXPECT_EQ(found, made.size()) << made.size() << " made";
  EXPECT_EQ(count_user_files(out, 10), 10);
}

TEST(FolderCarry, AnEntryChangedAfterItWasCarriedKeepsTheOldTree) {
  // sub/x is replaced by another file right after it was carried: the new
  // folder holds the carried x, and the changed one stays in the old tree,
  // kept beside the folder (never removed by a later run), which
  // bico_folder_kept names.
  TempDir d;
  std::string out = d / "out";
  user_files(out, 4);
  stt::write_bytes(out + "/sub/x", "original");
  bt::Ctx ctx;
  bico_folder *f = nullptr;
  ASSERT_EQ(bico_folder_create(ctx, &f), BICO_OK);
  size_t k = 9;
  ASSERT_EQ(bico_folder_add_output(f, "output", out.c_str(), BICO_FOLDER_CARRY,
                                   &k), BICO_OK);
  EXPECT_EQ(k, 0u);
  ASSERT_EQ(bico_folder_begin(f), BICO_OK) << bico_ctx_errmsg(ctx);
  const char *tmp = nullptr;
  ASSERT_EQ(bico_folder_path(f, 0, &tmp), BICO_OK);
  stt::write_bytes(std::string(tmp) + "/new.txt", "new");
  g_change = "x";
  ASSERT_EQ(bico_folder_commit(f), BICO_OK) << bico_ctx_errmsg(ctx);
  g_change.clear();
  const char *kept = nullptr;
  ASSERT_EQ(bico_folder_kept(f, 0, &kept), BICO_OK);
  ASSERT_NE(kept, nullptr);
  std::string keptdir = kept;
  EXPECT_TRUE(contains(keptdir, "/.out.bico-kept.")) << keptdir;
  EXPECT_EQ(stt::read_bytes(out + "/sub/x"), "original");
  EXPECT_EQ(stt::read_bytes(keptdir + "/sub/x"), "changed");
  EXPECT_EQ(stt::read_bytes(out + "/new.txt"), "new");
  EXPECT_EQ(count_user_files(out, 4), 4);
  bico_folder_free(f);
  // A later commit's scan for dead runs' leftovers leaves it.
  EXPECT_EQ(write_model(ctx, out), BICO_OK);
  EXPECT_EQ(stt::read_bytes(keptdir + "/sub/x"), "changed");
}

namespace {
// A POSIX ACL as the kernel's xattr blob: version 2, then (tag, perm, id)
// entries, little-endian (linux/posix_acl_xattr.h).
std::string acl_blob(const std::vector<std::array<uint32_t, 3>> &entries) {
  std::string b(4, '\0');
  b[0] = 2;
  for (auto &e : entries) {
    char x[8] = {(char)(e[0] & 0xff), (char)(e[0] >> 8), (char)(e[1] & 0xff),
                 (char)(e[1] >> 8),   (char)(e[2] & 0xff), (char)((e[2] >> 8) & 0xff),
                 (char)((e[2] >> 16) & 0xff), (char)(e[2] >> 24)};
    b.append(x, 8);
  }
  return b;
}
const uint32_t NOID = 0xffffffffu;

std::string xattr(const std::string &path, const char *name) {
  char buf[256];
  ssize_t n = getxattr(path.c_str(), name, buf, sizeof buf);
  return n < 0 ? std::string("<none>") : std::string(buf, (size_t)n);
}
}  // namespace

TEST(FolderCarry, SubFoldersKeepAttributesTimesModeAndOwner) {
  TempDir d;
  std::string out = d / "out";
  user_files(out, 2);
  std::string sub = out + "/sub", deeper = sub + "/deeper";
  ASSERT_EQ(mkdir(deeper.c_str(), 0700), 0);
  stt::write_bytes(deeper + "/x.txt", "x");
  if (setxattr(sub.c_str(), "user.note", "hello", 5, 0) != 0)
    GTEST_SKIP() << "this file system refuses user extended attributes: "
                 << strerror(errno);
  ASSERT_EQ(setxattr(out.c_str(), "user.top", "t", 1, 0), 0);
  ASSERT_EQ(setxattr(deeper.c_str(), "user.deep", "d", 1, 0), 0);
  // An access ACL granting uid 65534 read and search, and a default ACL.
  std::string acl = acl_blob({{0x01, 7, NOID}, {0x02, 5, 65534}, {0x04, 5, NOID},
                              {0x10, 5, NOID}, {0x20, 0, NOID}});
  std::string dacl = acl_blob({{0x01, 7, NOID}, {0x04, 5, NOID}, {0x20, 5, NOID}});
  bool acls = setxattr(sub.c_str(), "system.posix_acl_access", acl.data(),
                       acl.size(), 0) == 0 &&
              setxattr(sub.c_str(), "system.posix_acl_default", dacl.data(),
                       dacl.size(), 0) == 0;
  std::string sub_acl = xattr(sub, "system.posix_acl_access");
  ASSERT_EQ(chmod(sub.c_str(), 0750), 0);
  const bool root = geteuid() == 0;
  if (root) {
    ASSERT_EQ(chown(deeper.c_str(), 65534, 65534), 0);
  }
  // Times in the past, set last (the entries above changed them).
  struct timespec sub_t[2] = {{1000000000, 123}, {1200000000, 456}};
  struct timespec deep_t[2] = {{1100000000, 7}, {1300000000, 8}};
  ASSERT_EQ(utimensat(AT_FDCWD, deeper.c_str(), deep_t, 0), 0);
  ASSERT_EQ(utimensat(AT_FDCWD, sub.c_str(), sub_t, 0), 0);
  // The parent gets a default ACL: the new folder, made in it, inherits
  // one that the old folder never had.
  if (acls) {
    ASSERT_EQ(setxattr(d.path.c_str(), "system.posix_acl_default", dacl.data(),
                       dacl.size(), 0), 0);
  }
  ino_t old_sub = inode(sub);
  bt::Ctx ctx;
  ASSERT_EQ(write_model(ctx, out), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_NE(inode(sub), old_sub) << "the sub-folder was recreated";
  EXPECT_EQ(xattr(sub, "user.note"), "hello");
  EXPECT_EQ(xattr(deeper, "user.deep"), "d");
  EXPECT_EQ(xattr(out, "user.top"), "t");
  if (acls) {
    EXPECT_EQ(xattr(sub, "system.posix_acl_access"), sub_acl);
    EXPECT_EQ(xattr(sub, "system.posix_acl_default"), dacl);
    EXPECT_EQ(xattr(out, "system.posix_acl_default"), "<none>")
        << "an ACL the old folder did not have is not added";
  }
  struct stat st;
  ASSERT_EQ(stat(sub.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0750u);
  EXPECT_EQ(st.st_mtim.tv_sec, sub_t[1].tv_sec);
  EXPECT_EQ(st.st_mtim.tv_nsec, sub_t[1].tv_nsec);
  EXPECT_EQ(st.st_atim.tv_sec, sub_t[0].tv_sec);
  ASSERT_EQ(stat(deeper.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  EXPECT_EQ(st.st_mtim.tv_sec, deep_t[1].tv_sec);
  EXPECT_EQ(st.st_atim.tv_sec, deep_t[0].tv_sec);
  if (root) {
    EXPECT_EQ(st.st_uid, 65534u);
  }
  EXPECT_EQ(stt::read_bytes(deeper + "/x.txt"), "x");
  if (!acls) GTEST_SKIP() << "ACLs not checked: this file system refuses them";
}

// ---- what a folder commit refuses ----

TEST(FolderRefusals, MountPointsInsideTheOutputOrALeftoverAreNeverEntered) {
  // In a private mount namespace (root; skipped elsewhere): a tmpfs inside
  // the output folder is refused before anything is written, and one
  // inside a dead run's leftover keeps its files when the leftover goes.
  TempDir d;
  std::string out = d / "out", mnt = out + "/sub/mnt";
  user_files(out, 2);
  ASSERT_EQ(mkdir(mnt.c_str(), 0755), 0);
  pid_t dead = spawn([] { return 0; });
  ASSERT_EQ(wait_exit(dead), 0);
  std::string left = d / (".out.bico-tmp." + std::to_string(dead) + ".AbCdEf");
  ASSERT_EQ(mkdir(left.c_str(), 0700), 0);
  ASSERT_EQ(mkdir((left + "/m").c_str(), 0700), 0);
  pid_t pid = spawn([&] {
    if (unshare(CLONE_NEWNS) != 0) return 77;
    if (mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 77;
    if (mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=64k") != 0) return 77;
    if (mount("tmpfs", (left + "/m").c_str(), "tmpfs", 0, "size=64k") != 0)
      return 77;
    stt::write_bytes(mnt + "/keep.txt", "keep");
    stt::write_bytes(left + "/m/keep.txt", "keep");
    bico_ctx *ctx = nullptr;
    bico_ctx_create(&ctx);
    bico_status st = write_model(ctx, out);
    std::string m = bico_ctx_errmsg(ctx);
    if (st != BICO_E_IO) return 10;
    if (!contains(m, "holds a mount point, sub/mnt")) return 11;
    if (!contains(m, "nothing was written")) return 12;
    if (stt::read_bytes(mnt + "/keep.txt") != "keep") return 13;
    if (exists(out + "/model.safetensors")) return 14;
    // Unmounted, the run goes through; the leftover's scan stops at its
    // mount point: the tmpfs keeps its file.
    if (umount2(mnt.c_str(), 0) != 0) return 15;
    st = write_model(ctx, out);
    bico_ctx_free(ctx);
    if (st != BICO_OK) return 16;
    if (stt::read_bytes(left + "/m/keep.txt") != "keep") return 17;
    umount2((left + "/m").c_str(), MNT_DETACH);
    return 0;
  });
  int rc = wait_exit(pid);
  if (rc == 77) GTEST_SKIP() << "cannot mount a private tmpfs here (needs root)";
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(count_user_files(out, 2), 2);
}

TEST(FolderRefusals, TheWorkingDirectoryOrAFolderHoldingItIsRefused) {
  TempDir d;
  std::string out = d / "out";
  user_files(out, 2);
  int rc = wait_exit(spawn([&] {
    if (chdir((out + "/sub").c_str()) != 0) return 2;
    bico_ctx *ctx = nullptr;
    bico_ctx_create(&ctx);
    int bad = 0;
    for (const char *dir : {".", "./", "..", "../sub"}) {
      bico_status st = write_model(ctx, dir);
      std::string m = bico_ctx_errmsg(ctx);
      bad |= st != BICO_E_ARG || !contains(m, "the working directory");
    }
    bico_ctx_free(ctx);
    return bad ? 3 : 0;
  }));
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(count_user_files(out, 2), 2);
  EXPECT_FALSE(exists(out + "/model.safetensors"));
}

TEST(FolderRefusals, ADanglingLinkIsNamedWithWhereItPoints) {
  TempDir d;
  std::string dl = d / "dl";
  ASSERT_EQ(symlink("nowhere/at-all", dl.c_str()), 0);
  bt::Ctx ctx;
  EXPECT_EQ(write_model(ctx, dl), BICO_E_ARG);
  std::string m = bico_ctx_errmsg(ctx);
  EXPECT_TRUE(contains(m, "dangling symbolic link")) << m;
  EXPECT_TRUE(contains(m, "nowhere/at-all")) << m;
  EXPECT_FALSE(contains(m, "another type")) << m;
  EXPECT_EQ(names_in(d.path), std::vector<std::string>{"dl"});
}

TEST(FolderRefusals, ADeepTreesMessageKeepsItsReason) {
  // 70 levels of 50-byte names: the message names why before the path,
  // so the context's 1024-byte message never loses the reason.
  TempDir d;
  std::string out = d / "out";
  ASSERT_EQ(mkdir(out.c_str(), 0755), 0);
  int fd = open(out.c_str(), O_RDONLY | O_DIRECTORY);
  std::string name(50, 'n');
  for (int k = 0; k < 70 && fd >= 0; k++) {
    ASSERT_EQ(mkdirat(fd, name.c_str(), 0755), 0);
    int next = openat(fd, name.c_str(), O_RDONLY | O_DIRECTORY);
    close(fd);
    fd = next;
  }
  close(fd);
  bt::Ctx ctx;
  EXPECT_EQ(write_model(ctx, out), BICO_E_IO);
  std::string m = bico_ctx_errmsg(ctx);
  EXPECT_TRUE(contains(m, "nested too deeply")) << m;
  EXPECT_TRUE(contains(m, "nothing was written")) << m;
  EXPECT_TRUE(contains(m, out)) << m;
  EXPECT_LT(m.size(), 1023u) << "cut: " << m;
  EXPECT_FALSE(exists(out + "/model.safetensors"));
  EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
}

// ---- bico_folder ----

TEST(FolderApi, OutputsThatAreOrHoldAnInputAreRefusedWhateverTheSpelling) {
  TempDir d;
  std::string src = d / "src", in = d / "in.st", link = d / "srclink";
  user_files(src, 2);
  stt::write_bytes(in, "input");
  ASSERT_EQ(symlink("src", link.c_str()), 0);
  bt::Ctx ctx;
  struct Case {
    std::string out;
    bico_status st;
    const char *words;
  };
  const Case cases[] = {
      {src, BICO_E_ARG, "is the same folder as the source model"},
      {src + "/", BICO_E_ARG, "is the same folder as the source model"},
      {d.path + "/./src", BICO_E_ARG, "is the same folder as the source model"},
      {link, BICO_E_ARG, "is the same folder as the source model"},
      {d.path, BICO_E_ARG, "holds the source model"},
      {in, BICO_E_ARG, "is a file, not a folder"},
      {src + "/sub/../..", BICO_E_ARG, "holds"},
      // inside a folder the run reads, at any depth, however spelled
      {src + "/adapter", BICO_E_ARG, "lies inside the source model folder"},
      {link + "/a", BICO_E_ARG, "lies inside the source model folder"},
      {d.path + "/./src/x/", BICO_E_ARG,
       "lies inside the source model folder"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.out);
    bico_folder *f = nullptr;
    ASSERT_EQ(bico_folder_create(ctx, &f), BICO_OK);
    ASSERT_EQ(bico_folder_add_input(f, "source model", src.c_str()), BICO_OK);
    ASSERT_EQ(bico_folder_add_input(f, "text", in.c_str()), BICO_OK);
    ASSERT_EQ(bico_folder_add_output(f, "output adapter", c.out.c_str(),
                                     BICO_FOLDER_REPLACE, nullptr), BICO_OK);
    EXPECT_EQ(bico_folder_begin(f), c.st);
    std::string m = bico_ctx_errmsg(ctx);
    EXPECT_TRUE(contains(m, c.words)) << m;
    EXPECT_TRUE(contains(m, "nothing was written")) << m;
    // nothing held after a failed begin
    EXPECT_EQ(bico_folder_path(f, 0, nullptr), BICO_E_NULL);
    const char *tmp = nullptr;
    EXPECT_EQ(bico_folder_path(f, 0, &tmp), BICO_E_STATE);
    bico_folder_free(f);
  }
  // Two outputs of one name.
  bico_folder *f = nullptr;
  ASSERT_EQ(bico_folder_create(ctx, &f), BICO_OK);
  ASSERT_EQ(bico_folder_add_output(f, "output", (d / "o").c_str(), 0, nullptr),
            BICO_OK);
  ASSERT_EQ(bico_folder_add_output(f, "output adapter", (d / "o/").c_str(), 0,
                                   nullptr), BICO_OK);
  EXPECT_EQ(bico_folder_begin(f), BICO_E_ARG);
  bico_folder_free(f);
  EXPECT_EQ(count_user_files(src, 2), 2);
  EXPECT_EQ(stt::read_bytes(in), "input");
  EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
  EXPECT_FALSE(exists(d / "o"));
}

TEST(FolderApi, OutputFilesAreCheckedByTheRunsRuleAndNeverWritten) {
  // bico_folder_add_file: a front end's output file (a statistics file)
  // checked at begin against the inputs and output folders, whatever the
  // spelling; the handle never creates it.
  TempDir d;
  std::string m = d / "m", shard = m + "/model-00001-of-00002.safetensors";
  std::string idx = d / "n/model.safetensors.index.json";
  ASSERT_EQ(mkdir(m.c_str(), 0755), 0);
  ASSERT_EQ(mkdir((d / "n").c_str(), 0755), 0);
  stt::write_bytes(shard, "shard");
  stt::write_bytes(m + "/config.json", "{}");
  stt::write_bytes(idx, "{}");
  stt::write_bytes(d / "n/config.json", "{}");
  std::string text = d / "task.txt", hard = d / "hard.txt";
  stt::write_bytes(text, "text");
  ASSERT_EQ(link(text.c_str(), hard.c_str()), 0);
  ASSERT_EQ(symlink(shard.c_str(), (d / "shardlink").c_str()), 0);
  ASSERT_EQ(mkfifo((d / "fifo").c_str(), 0600), 0);
  ASSERT_EQ(mkdir((d / "afolder").c_str(), 0755), 0);
  bt::Ctx ctx;
  struct Case {
    std::string file;
    bico_status st;
    const char *words;
  };
  const Case cases[] = {
      {shard, BICO_E_ARG, "lies inside the model folder of the --target"},
      {d / "shardlink", BICO_E_ARG, "inside the model folder of the --target"},
      {d.path + "/m/../m/model-00001-of-00002.safetensors", BICO_E_ARG,
       "inside the model folder of the --target"},
      {m + "/config.json", BICO_E_ARG, "inside the model folder"},
      {m + "/new.safetensors", BICO_E_ARG, "inside the model folder"},
      {m + "/sub/deep.safetensors", BICO_E_ARG, "inside the --target folder"},
      {d / "n/config.json", BICO_E_ARG, "model folder of the --source"},
      {text, BICO_E_ARG, "is the same file as the --text"},
      {hard, BICO_E_ARG, "is the same file as the --text"},
      {d.path + "/./task.txt", BICO_E_ARG, "is the same file as the --text"},
      {d / "fifo", BICO_E_ARG, "is a FIFO"},
      {d / "afolder", BICO_E_ARG, "is a folder"},
      {d / "out/stats.st", BICO_E_ARG, "lies inside the --output-lora folder"},
      {d / "nowhere/stats.st", BICO_E_IO, "its folder does not exist"},
  };
  ASSERT_EQ(mkdir((m + "/sub").c_str(), 0755), 0);
  for (const Case &c : cases) {
    SCOPED_TRACE(c.file);
    bico_folder *f = nullptr;
    ASSERT_EQ(bico_folder_create(ctx, &f), BICO_OK);
    ASSERT_EQ(bico_folder_add_input(f, "--target", m.c_str()), BICO_OK);
    ASSERT_EQ(bico_folder_add_input(f, "--source", idx.c_str()), BICO_OK);
    ASSERT_EQ(bico_folder_add_input(f, "--text", text.c_str()), BICO_OK);
    ASSERT_EQ(bico_folder_add_output(f, "--output-lora", (d / "out").c_str(),
                                     0, nullptr), BICO_OK);
    ASSERT_EQ(bico_folder_add_file(f, "--output", c.file.c_str()), BICO_OK);
    EXPECT_EQ(bico_folder_begin(f), c.st);
    std::string msg = bico_ctx_errmsg(ctx);
    EXPECT_TRUE(contains(msg, c.words)) << msg;
    EXPECT_TRUE(contains(msg, c.file)) << msg;
    EXPECT_TRUE(contains(msg, "nothing was written")) << msg;
    bico_folder_free(f);
  }
  EXPECT_EQ(stt::read_bytes(shard), "shard");
  EXPECT_EQ(stt::read_bytes(m + "/config.json"), "{}");
  EXPECT_EQ(stt::read_bytes(text), "text");
  // Two output files of one name.
  bico_folder *f = nullptr;
  ASSERT_EQ(bico_folder_create(ctx, &f), BICO_OK);
  ASSERT_EQ(bico_folder_add_file(f, "--output", (d / "s.st").c_str()), BICO_OK);
  ASSERT_EQ(bico_folder_add_file(f, "--report", (d.path + "/./s.st").c_str()),
            BICO_OK);
  EXPECT_EQ(bico_folder_begin(f), BICO_E_ARG);
  EXPECT_TRUE(contains(bico_ctx_errmsg(ctx), "is the same file as the --report"))
      << bico_ctx_errmsg(ctx);
  bico_folder_free(f);
  // A good one: begun and committed, never created by the handle; states.
  ASSERT_EQ(bico_folder_create(ctx, &f), BICO_OK);
  EXPECT_EQ(bico_folder_add_file(f, nullptr, nullptr), BICO_E_NULL);
  EXPECT_EQ(bico_folder_add_file(f, nullptr, ""), BICO_E_ARG);
  ASSERT_EQ(bico_folder_add_input(f, "--target", m.c_str()), BICO_OK);
  ASSERT_EQ(bico_folder_add_file(f, nullptr, (d / "stats.st").c_str()),
            BICO_OK);
  ASSERT_EQ(bico_folder_begin(f), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_folder_add_file(f, nullptr, (d / "t.st").c_str()),
            BICO_E_STATE);
  EXPECT_EQ(bico_folder_commit(f), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_folder_free(f);
  EXPECT_FALSE(exists(d / "stats.st"));
  EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
  EXPECT_EQ(bico_folder_add_file(nullptr, nullptr, "x"), BICO_E_NULL);
}

TEST(FolderApi, PoliciesRefuseReplaceCarry) {
  TempDir d;
  std::string out = d / "out";
  bt::Ctx ctx;
  auto commit = [&](int policy, const std::string &file,
                    const std::string &text) {
    bico_folder *f = nullptr;
    bico_status s = bico_folder_create(ctx, &f);
    if (s == BICO_OK) s = bico_folder_add_output(f, "output adapter",
                                                 out.c_str(), policy, nullptr);
    if (s == BICO_OK) s = bico_folder_begin(f);
    const char *tmp = nullptr;
    if (s == BICO_OK) s = bico_folder_path(f, 0, &tmp);
    if (s == BICO_OK) {
      stt::write_bytes(std::string(tmp) + "/" + file, text);
      struct stat st;
      EXPECT_EQ(stat(tmp, &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0700u) << "private while it is built";
      s = bico_folder_commit(f);
    }
    bico_folder_free(f);
    return s;
  };
  // a new folder: refuse (the default) is fine
  ASSERT_EQ(commit(0, "adapter_config.json", "one"), BICO_OK)
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(names_in(out), std::vector<std::string>{"adapter_config.json"});
  struct stat os;
  ASSERT_EQ(stat(out.c_str(), &os), 0);
  mode_t um = umask(0);
  umask(um);
  EXPECT_EQ(os.st_mode & 0777, 0777u & ~um);
  EXPECT_EQ(commit(BICO_FOLDER_REFUSE, "adapter_config.json", "two"),
            BICO_E_ARG);
  EXPECT_TRUE(contains(bico_ctx_errmsg(ctx), "is not empty (it holds "
                                             "adapter_config.json"));
  EXPECT_EQ(stt::read_bytes(out + "/adapter_config.json"), "one");
  stt::write_bytes(out + "/notes.txt", "mine");
  ASSERT_EQ(commit(BICO_FOLDER_CARRY, "adapter_config.json", "three"), BICO_OK)
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(stt::read_bytes(out + "/adapter_config.json"), "three");
  EXPECT_EQ(stt::read_bytes(out + "/notes.txt"), "mine");
  ASSERT_EQ(commit(BICO_FOLDER_REPLACE, "adapter_model.safetensors", "four"),
            BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(names_in(out), std::vector<std::string>{"adapter_model.safetensors"});
  EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
}

TEST(FolderApi, WithoutACommitNothingChangesAndStatesAreChecked) {
  TempDir d;
  std::string out = d / "out";
  user_files(out, 2);
  bt::Ctx ctx;
  bico_folder *f = nullptr;
  EXPECT_EQ(bico_folder_create(nullptr, &f), BICO_E_NULL);
  EXPECT_EQ(bico_folder_create(ctx, nullptr), BICO_E_NULL);
  ASSERT_EQ(bico_folder_create(ctx, &f), BICO_OK);
  const char *tmp = nullptr;
  EXPECT_EQ(bico_folder_path(f, 0, &tmp), BICO_E_STATE);
  EXPECT_EQ(bico_folder_commit(f), BICO_E_STATE);
  EXPECT_EQ(bico_folder_add_output(f, nullptr, out.c_str(), 7, nullptr), BICO_E_ARG);
  EXPECT_TRUE(contains(bico_ctx_errmsg(ctx), "unknown policy 7"));
  EXPECT_EQ(bico_folder_add_output(f, nullptr, "", 0, nullptr), BICO_E_ARG);
  EXPECT_EQ(bico_folder_add_input(f, nullptr, nullptr), BICO_E_NULL);
  size_t k = 5;
  ASSERT_EQ(bico_folder_add_output(f, nullptr, out.c_str(), BICO_FOLDER_REPLACE,
                                   &k), BICO_OK);
  EXPECT_EQ(k, 0u);
  ASSERT_EQ(bico_folder_begin(f), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_folder_begin(f), BICO_E_STATE);
  EXPECT_EQ(bico_folder_add_input(f, nullptr, "x"), BICO_E_STATE);
  EXPECT_EQ(bico_folder_path(f, 1, &tmp), BICO_E_ARG);
  ASSERT_EQ(bico_folder_path(f, 0, &tmp), BICO_OK);
  std::string t = tmp;
  const char *again = nullptr;
  ASSERT_EQ(bico_folder_path(f, 0, &again), BICO_OK);
  EXPECT_EQ(t, again) << "one new folder per output";
  EXPECT_EQ(t[0], '/');
  EXPECT_TRUE(contains(t, "/.out.bico-tmp.")) << t;
  stt::write_bytes(t + "/half.json", "{");
  bico_folder_free(f);  // no commit
  EXPECT_FALSE(exists(t));
  EXPECT_EQ(count_user_files(out, 2), 2);
  EXPECT_FALSE(exists(out + "/half.json"));
  EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
  bico_folder_free(nullptr);
  int p = 0;
  for (const char *n : {"refuse", "replace", "carry"}) {
    ASSERT_EQ(bico_folder_policy_from_name(n, &p), BICO_OK);
    EXPECT_STREQ(bico_folder_policy_name(p), n);
  }
  EXPECT_EQ(bico_folder_policy_name(0), nullptr);
  EXPECT_EQ(bico_folder_policy_from_name("keep", &p), BICO_E_NOTFOUND);
  double w = -1;
  EXPECT_EQ(bico_ctx_get_param(ctx, BICO_CTX_FOLDER_WAIT, &w), BICO_OK);
  EXPECT_EQ(w, 0.0);
  EXPECT_EQ(bico_ctx_set_param(ctx, BICO_CTX_FOLDER_WAIT, -1), BICO_E_ARG);
  EXPECT_STREQ(bico_ctx_param_name(BICO_CTX_FOLDER_WAIT), "folder_wait");
}

// ---- bico_lora_save ----

namespace {
struct Failing {
  long left;
};
void *failing_alloc(void *opaque, size_t size) {
  Failing *fa = (Failing *)opaque;
  if (fa->left-- <= 0) return nullptr;
  return std::malloc(size);
}
void failing_free(void *, void *p) { std::free(p); }

// An adapter of one module of rank r (all factors v).
bico_status make_adapter(bico_ctx *ctx, size_t r, float v, bico_lora **l) {
  std::vector<float> b(4 * r, v), a(r * 3, v);
  bico_status st = bico_lora_create(ctx, l);
  if (st == BICO_OK)
    st = bico_lora_add_module(*l, "m", BICO_LORA_LINEAR, r, 4, 3,
                              2.0 * (double)r, b.data(), a.data());
  return st;
}
}  // namespace

TEST(FolderLoraSave, AFailureAtAnyStepLeavesTheOldAdapterWhole) {
  // A rank-4 adapter and a user's file; a rank-8 save failing at every
  // allocation in turn: the folder holds the old adapter byte for byte (or,
  // once the save goes through, the new one), never new weights beside
  // the old config.
  TempDir d;
  std::string out = d / "ad";
  {
    bt::Ctx ctx;
    bico_lora *l = nullptr;
    ASSERT_EQ(make_adapter(ctx, 4, 0.5f, &l), BICO_OK);
    ASSERT_EQ(bico_lora_save(l, out.c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
    bico_lora_free(l);
  }
  stt::write_bytes(out + "/README.md", "mine");
  std::string cfg = stt::read_bytes(out + "/adapter_config.json");
  std::string wts = stt::read_bytes(out + "/adapter_model.safetensors");
  bool done = false;
  long failures = 0;
  for (long budget = 0; budget < 2000 && !done; budget++) {
    Failing fa = {1 << 30};
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, failing_alloc, failing_free,
                                             &fa), BICO_OK);
    bico_lora *l = nullptr;
    ASSERT_EQ(make_adapter(ctx, 8, 0.25f, &l), BICO_OK);
    fa.left = budget;
    bico_status st = bico_lora_save(l, out.c_str());
    fa.left = 1 << 30;
    if (st == BICO_OK) {
      done = true;
      EXPECT_NE(stt::read_bytes(out + "/adapter_config.json"), cfg);
      EXPECT_NE(stt::read_bytes(out + "/adapter_model.safetensors"), wts);
      bico_lora *back = nullptr;
      ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &back), BICO_OK)
          << bico_ctx_errmsg(ctx);
      bico_lora_free(back);
    } else {
      failures++;
      EXPECT_EQ(st, BICO_E_NOMEM) << bico_ctx_errmsg(ctx);
      EXPECT_EQ(stt::read_bytes(out + "/adapter_config.json"), cfg);
      EXPECT_EQ(stt::read_bytes(out + "/adapter_model.safetensors"), wts);
    }
    EXPECT_EQ(stt::read_bytes(out + "/README.md"), "mine");
    EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
    bico_lora_free(l);
    bico_ctx_free(ctx);
  }
  EXPECT_TRUE(done);
  EXPECT_GT(failures, 20) << "the save allocates at that many steps";
  std::printf("bico_lora_save: %ld allocation failures, each clean\n", failures);
}

TEST(FolderLoraSave, AFailureAtTheConfigsStepNeverLeavesNewWeightsBesideIt) {
  // Before: the weights were renamed into place, then the config; a
  // failure between (here: the config's rename) left rank-8 factors beside
  // an r = 4 config.  The folder now goes in whole: old or new, never
  // mixed, whichever step fails.
  TempDir d;
  std::string out = d / "ad";
  bt::Ctx ctx;
  bico_lora *l4 = nullptr, *l8 = nullptr;
  ASSERT_EQ(make_adapter(ctx, 4, 0.5f, &l4), BICO_OK);
  ASSERT_EQ(bico_lora_save(l4, out.c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
  std::string cfg = stt::read_bytes(out + "/adapter_config.json");
  std::string wts = stt::read_bytes(out + "/adapter_model.safetensors");
  ASSERT_EQ(make_adapter(ctx, 8, 0.25f, &l8), BICO_OK);
  g_fail_rename = "adapter_config.json";
  bico_status st = bico_lora_save(l8, out.c_str());
  g_fail_rename.clear();
  bool old_cfg = stt::read_bytes(out + "/adapter_config.json") == cfg;
  bool old_wts = stt::read_bytes(out + "/adapter_model.safetensors") == wts;
  EXPECT_EQ(old_cfg, old_wts) << "config and weights from different saves";
  EXPECT_EQ(old_cfg, st != BICO_OK) << bico_ctx_errmsg(ctx);
  bico_lora *back = nullptr;
  EXPECT_EQ(bico_lora_open(ctx, out.c_str(), &back), BICO_OK)
      << bico_ctx_errmsg(ctx);
  bico_lora_free(back);
  bico_lora_free(l4);
  bico_lora_free(l8);
  EXPECT_EQ(leftovers(d.path), std::vector<std::string>{});
}
