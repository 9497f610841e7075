/* Temporary files on SIGINT, SIGTERM and SIGHUP: the library writes each
 * output to ".<base>.bico-tmp.<pid>.XXXXXX" in the output's folder (see
 * include/bico/safetensors.h) and renames it at the end.  A signal would
 * leave those behind, so the handler removes this process's ones from the
 * registered folders and then dies of the signal as it would have.  Only
 * async-signal-safe calls run in the handler (open, getdents64, unlinkat,
 * close, sigaction, raise); the names it matches are built beforehand.
 * An output folder that did not exist when the command started is removed
 * too once it is empty (rmdir: a folder holding anything else stays), so
 * an interrupted run leaves no empty folder behind.  An output model
 * folder is built as a temporary sibling folder of the same name form
 * (".<folder>.bico-tmp.<pid>.XXXXXX", lib/io/fileio.h), so its parent is
 * registered too and a marked folder is removed with everything in it.
 * Files and folders left by a kill -9 are removed by the next run
 * (lib/io/tmpfile.c: those whose flock no live run holds).  The lock file of an output folder
 * (".<folder>.bico-lock" in its real parent, lib/io/folder_guard.c) is removed
 * too when it names this process as its holder; one that names another
 * process is that process's and stays.  Removal never enters a folder on
 * another file system (a mount point). */
#define _GNU_SOURCE 1
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

#define MAX_DIRS 8
#define DIR_CAP 4096

static char dirs[MAX_DIRS][DIR_CAP];
static int created[MAX_DIRS]; /* an output folder absent at the start */
static int ndirs;
static char mark[64]; /* ".bico-tmp.<pid>." */
static char kept[64]; /* ".bico-kept.<pid>.": an old tree kept */
static char locks[MAX_DIRS][DIR_CAP]; /* output folders' lock files */
static int nlocks;

/* The lock file the library takes for output folder path: the real
 * parent of the folder (through a link) and ".<name>.bico-lock", the name
 * cut to 200 bytes (lib/io/folder_guard.c). */
static void add_lock(const char *path) {
  if (nlocks == MAX_DIRS) return;
  char real[DIR_CAP];
  char *r = realpath(path, NULL);
  if (r != NULL) {
    snprintf(real, sizeof real, "%s", r);
    free(r);
  } else {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    char tmp[DIR_CAP];
    snprintf(tmp, sizeof tmp, "%.*s", (int)n, path);
    char *slash = strrchr(tmp, '/');
    const char *base = slash ? slash + 1 : tmp;
    if (slash == tmp) r = realpath("/", NULL);
    else if (slash != NULL) *slash = '\0', r = realpath(tmp, NULL);
    else r = realpath(".", NULL);
    if (r == NULL) return;
    size_t rl = strcmp(r, "/") ? strlen(r) : 0, bl = strlen(base);
    if (rl + bl + 2 > sizeof real) bl = 0; /* too long: no lock file named */
    memcpy(real, r, rl);
    real[rl] = '/';
    memcpy(real + rl + 1, base, bl);
    real[rl + 1 + bl] = '\0';
    free(r);
    if (bl == 0) return;
  }
  char *slash = strrchr(real, '/');
  if (slash == NULL) return;
  *slash = '\0';
  size_t dl = strlen(real), bl = strlen(slash + 1);
  if (bl > 200) bl = 200;
  if (dl + bl + sizeof ".bico-lock" + 2 > DIR_CAP) return;
  char *d = locks[nlocks++];
  memcpy(d, real, dl);
  memcpy(d + dl, "/.", 2);
  memcpy(d + dl + 2, slash + 1, bl);
  memcpy(d + dl + 2 + bl, ".bico-lock", sizeof ".bico-lock");
}

/* In the handler: the lock file names this process (its first line is
 * our pid): ours to remove. */
static void remove_our_lock(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return;
  char buf[24];
  ssize_t n = read(fd, buf, sizeof buf);
  close(fd);
  long pid = 0;
  ssize_t i = 0;
  for (; i < n && buf[i] >= '0' && buf[i] <= '9'; i++)
    pid = pid * 10 + (buf[i] - '0');
  if (i > 0 && i < n && buf[i] == '\n' && pid == (long)getpid())
    (void)unlink(path);
}

static void add_dir(const char *d, int made) {
  if (ndirs == MAX_DIRS) return;
  for (int i = 0; i < ndirs; i++)
    if (strcmp(dirs[i], d) == 0) return;
  snprintf(dirs[ndirs], DIR_CAP, "%s", d);
  created[ndirs++] = made;
}

/* The folder where an output folder's temporary sibling is made: the
 * real parent of the folder (a link to a folder stands for it). */
static void add_parent(const char *path) {
  char *r = realpath(path, NULL);
  if (r == NULL) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    char tmp[DIR_CAP];
    snprintf(tmp, sizeof tmp, "%.*s", (int)n, path);
    char *slash = strrchr(tmp, '/');
    if (slash == NULL) snprintf(tmp, sizeof tmp, ".");
    else if (slash == tmp) tmp[1] = '\0';
    else *slash = '\0';
    r = realpath(tmp, NULL);
    if (r != NULL) add_dir(r, 0);
    free(r);
    return;
  }
  char *slash = strrchr(r, '/');
  if (slash == r) r[1] = '\0';
  else if (slash != NULL) *slash = '\0';
  add_dir(r, 0);
  free(r);
}

void cli_cleanup_add(const char *path, int is_dir) {
  if (path == NULL || ndirs == MAX_DIRS) return;
  if (is_dir) add_lock(path);
  if (is_dir) add_parent(path);
  if (ndirs == MAX_DIRS) return;
  const char *slash = is_dir ? NULL : strrchr(path, '/');
  char *d = dirs[ndirs];
  if (is_dir)
    snprintf(d, DIR_CAP, "%s", path);
  else if (slash == NULL)
    snprintf(d, DIR_CAP, ".");
  else if (slash == path)
    snprintf(d, DIR_CAP, "/");
  else
    snprintf(d, DIR_CAP, "%.*s", (int)(slash - path), path);
  for (int i = 0; i < ndirs; i++)
    if (strcmp(dirs[i], d) == 0) return;
  created[ndirs] = is_dir && access(d, F_OK) != 0;
  ndirs++;
}

static int has_mark(const char *name, const char *mark) {
  size_t n = strlen(name), m = strlen(mark);
  if (name[0] != '.') return 0;
  for (size_t i = 0; i + m <= n; i++)
    if (memcmp(name + i, mark, m) == 0) return 1;
  return 0;
}

/* Removes name in dfd and, a folder on device dev, everything in it
 * (never following a link, never entering another file system); passes
 * over the folder until it is empty or nothing goes. */
static void remove_tree_at(int dfd, const char *name, int depth, dev_t dev) {
  if (unlinkat(dfd, name, 0) == 0 || depth > 32) return;
  int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_dev != dev) {
    close(fd);
    return;
  }
  char buf[4096];
  for (int pass = 0; pass < 64; pass++) {
    int seen = 0;
    (void)lseek(fd, 0, SEEK_SET);
    for (;;) {
      ssize_t n = getdents64(fd, buf, sizeof buf);
      if (n <= 0) break;
      for (ssize_t off = 0; off < n;) {
        struct dirent64 *e = (struct dirent64 *)(buf + off);
        off += e->d_reclen;
        const char *c = e->d_name;
        if (c[0] == '.' && (c[1] == '\0' || (c[1] == '.' && c[2] == '\0')))
          continue;
        seen = 1;
        remove_tree_at(fd, c, depth + 1, dev);
      }
    }
    if (!seen || unlinkat(dfd, name, AT_REMOVEDIR) == 0) break;
  }
  close(fd);
  (void)unlinkat(dfd, name, AT_REMOVEDIR);
}

static void remove_ours(const char *dir) {
  static char buf[32768];
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return;
  }
  for (;;) {
    ssize_t n = getdents64(fd, buf, sizeof buf);
    if (n <= 0) break;
    for (ssize_t off = 0; off < n;) {
      struct dirent64 *e = (struct dirent64 *)(buf + off);
      if (has_mark(e->d_name, mark)) remove_tree_at(fd, e->d_name, 0, st.st_dev);
      off += e->d_reclen;
    }
  }
  close(fd);
}

static void on_signal(int sig) {
  for (int i = 0; i < ndirs; i++) {
    remove_ours(dirs[i]);
    if (created[i]) (void)rmdir(dirs[i]);
  }
  for (int i = 0; i < nlocks; i++) remove_our_lock(locks[i]);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = SIG_DFL;
  sigaction(sig, &sa, NULL);
  raise(sig);
}

void cli_cleanup_install(void) {
  snprintf(mark, sizeof mark, ".bico-tmp.%ld.", (long)getpid());
  snprintf(kept, sizeof kept, ".bico-kept.%ld.", (long)getpid());
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
  for (int i = 0; i < 3; i++) sigaddset(&sa.sa_mask, sigs[i]);
  for (int i = 0; i < 3; i++) {
    struct sigaction old;
    /* A signal the caller ignores (nohup) stays ignored. */
    if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN)
      continue;
    sigaction(sigs[i], &sa, NULL);
  }
}

/* After a successful run: this process's temporaries still present are
 * what could not be removed (the previous folder's tree, moved aside by
 * the swap, holding a protected file); a kept tree holds entries of the
 * previous output that appeared or changed during the run and could not
 * be placed in the new folder (lib/io/folder_swap.c).  The new output is
 * complete; the user is told where the old files wait, and why. */
int cli_cleanup_warn_leftovers(const char *cmd) {
  int left = 0;
  for (int i = 0; i < ndirs && mark[0]; i++) {
    DIR *d = opendir(dirs[i]);
    struct dirent *e;
    while (d != NULL && (e = readdir(d)) != NULL) {
      if (has_mark(e->d_name, mark)) {
        fprintf(stderr, "bico %s: warning: %s/%s could not be removed: some "
                "of the previous output's files in it are protected (for "
                "example chattr +i, or a folder this user cannot change); "
                "the output is complete: remove it by hand\n",
                cmd, dirs[i], e->d_name);
        left++;
      } else if (has_mark(e->d_name, kept)) {
        fprintf(stderr, "bico %s: warning: entries of the previous output "
                "that appeared or changed while this run wrote it could not "
                "be placed in the new folder (their names are taken there); "
                "they are kept in %s/%s: look through it, move what you "
                "need, then remove it\n", cmd, dirs[i], e->d_name);
        left++;
      }
    }
    if (d != NULL) closedir(d);
  }
  return left;
}
