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
 * (lib/io/fileio.c). */
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

static int has_mark(const char *name) {
  size_t n = strlen(name), m = strlen(mark);
  if (name[0] != '.') return 0;
  for (size_t i = 0; i + m <= n; i++)
    if (memcmp(name + i, mark, m) == 0) return 1;
  return 0;
}

/* Removes name in dfd and, a folder, everything in it (never following
 * a link); passes over the folder until it is empty or nothing goes. */
static void remove_tree_at(int dfd, const char *name, int depth) {
  if (unlinkat(dfd, name, 0) == 0 || depth > 32) return;
  int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
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
        remove_tree_at(fd, c, depth + 1);
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
  for (;;) {
    ssize_t n = getdents64(fd, buf, sizeof buf);
    if (n <= 0) break;
    for (ssize_t off = 0; off < n;) {
      struct dirent64 *e = (struct dirent64 *)(buf + off);
      if (has_mark(e->d_name)) remove_tree_at(fd, e->d_name, 0);
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
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = SIG_DFL;
  sigaction(sig, &sa, NULL);
  raise(sig);
}

void cli_cleanup_install(void) {
  snprintf(mark, sizeof mark, ".bico-tmp.%ld.", (long)getpid());
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
 * the swap, holding an immutable or otherwise protected file).  The new
 * output is complete; the user is told where the old files wait. */
int cli_cleanup_warn_leftovers(const char *cmd) {
  int left = 0;
  for (int i = 0; i < ndirs && mark[0]; i++) {
    DIR *d = opendir(dirs[i]);
    struct dirent *e;
    while (d != NULL && (e = readdir(d)) != NULL)
      if (has_mark(e->d_name)) {
        fprintf(stderr, "%s: warning: %s/%s could not be removed (the "
                "previous files it holds are protected, e.g. chattr +i); "
                "the output is complete: remove it by hand\n",
                cmd, dirs[i], e->d_name);
        left++;
      }
    if (d != NULL) closedir(d);
  }
  return left;
}
