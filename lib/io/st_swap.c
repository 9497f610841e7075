/* Folder commits (see lib/io/fileio.h): the swap of a complete new folder for
 * the old one, the removal of a folder tree, and the user's own files of
 * the old folder carried into the new one by hard link. */
#define _GNU_SOURCE 1 /* renameat2's flags, O_NOFOLLOW, O_DIRECTORY */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fileio.h"
#include "st_internal.h"

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

/* Deeper trees are refused (carry) or left (removal). */
#define MAX_DEPTH 64

static int rename2(const char *from, const char *to, unsigned flags) {
#ifdef SYS_renameat2
  return (int)syscall(SYS_renameat2, AT_FDCWD, from, AT_FDCWD, to, flags);
#else
  (void)from;
  (void)to;
  (void)flags;
  errno = ENOSYS;
  return -1;
#endif
}

int bico__swap_folder(bico__tmpfile *t) {
  t->oldtree = 0;
  struct stat st;
  if (lstat(t->path, &st) != 0) {
    /* a new folder: rename without replacing what may appear meanwhile */
    if (rename2(t->tmp, t->path, RENAME_NOREPLACE) == 0) return 0;
    if (errno == EINVAL || errno == ENOSYS)
      return rename(t->tmp, t->path) == 0 ? 0 : errno;
    if (errno != EEXIST) return errno;
  }
  /* One step: the old folder takes the temporary name. */
  if (rename2(t->tmp, t->path, RENAME_EXCHANGE) == 0) {
    t->oldtree = 1;
    return 0;
  }
  if (errno != EINVAL && errno != ENOSYS) return errno;
  /* The file system refuses the exchange (some network and FUSE ones):
   * two renames, the folder absent (never mixed) between them. */
  if (rename(t->path, t->aside) != 0) return errno;
  if (rename(t->tmp, t->path) != 0) {
    int e = errno;
    (void)rename(t->aside, t->path);
    return e;
  }
  t->oldtree = 2;
  return 0;
}

int bico__sync_folder(const char *path) {
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  int e = 0;
  if (syncfs(fd) != 0) {
    e = errno;
    if (e == ENOSYS) { /* no syncfs: the folder's entries, then all */
      sync();
      e = fsync(fd) == 0 || errno == EINVAL || errno == EROFS ? 0 : errno;
    }
  }
  close(fd);
  return e;
}

/* Removes name in dfd (any type) and, for a folder, everything in it. */
static int remove_at(int dfd, const char *name, int depth) {
  if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT) return 0;
  if (errno != EISDIR && errno != EPERM) return errno;
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return errno;
  if (!S_ISDIR(st.st_mode)) return EPERM;
  if (depth > MAX_DEPTH) return ELOOP;
  int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == EACCES && st.st_uid == geteuid() &&
      fchmodat(dfd, name, 0700, 0) == 0)
    fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno;
  if ((st.st_mode & 0300) != 0300 && st.st_uid == geteuid())
    (void)fchmod(fd, 0700); /* a read-only sub-folder of the old tree */
  int first = 0;
  DIR *d = fdopendir(fd);
  if (d == NULL) {
    int e = errno;
    close(fd);
    return e;
  }
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    int r = remove_at(dirfd(d), e->d_name, depth + 1);
    if (r != 0 && first == 0) first = r;
  }
  closedir(d);
  if (unlinkat(dfd, name, AT_REMOVEDIR) != 0 && first == 0) first = errno;
  return first;
}

int bico__remove_tree(const char *path) {
  return remove_at(AT_FDCWD, path, 0);
}

/* ---- carrying the user's files ---- */

typedef struct carry {
  bico_ctx *ctx;
  const char *fn;
  const char *shown; /* the user's name for the old folder */
  int root;
  char rel[4096]; /* the entry's path inside the folder, for messages */
} carry;

static bico_status carry_fail(carry *c, const char *name, const char *why,
                              int e) {
  return bico__fail(c->ctx, BICO_E_IO,
                    "the output folder %s: cannot keep %s%s%s in the new "
                    "folder: %s%s%s; nothing was written",
                    c->shown, c->rel, c->rel[0] ? "/" : "", name, why,
                    e ? ": " : "", e ? strerror(e) : "");
}

/* A copy of the regular file name (linking refused): content, mode. */
static bico_status copy_at(carry *c, int sfd, int dfd, const char *name,
                           const struct stat *st) {
  int in = openat(sfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (in < 0) return carry_fail(c, name, "cannot link or read it", errno);
  int out = openat(dfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (out < 0) {
    int e = errno;
    close(in);
    return carry_fail(c, name, "cannot create its copy", e);
  }
  static const size_t CAP = 1u << 16;
  unsigned char *buf = bico__alloc(c->ctx, CAP);
  bico_status s = buf ? BICO_OK : BICO_E_NOMEM;
  for (uint64_t off = 0; s == BICO_OK;) {
    ssize_t r = pread(in, buf, CAP, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) s = carry_fail(c, name, "cannot read it", errno);
    if (r <= 0) break;
    for (ssize_t w = 0; s == BICO_OK && w < r;) {
      ssize_t k = write(out, buf + w, (size_t)(r - w));
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) s = carry_fail(c, name, "cannot write its copy", errno);
      else w += k;
    }
    off += (uint64_t)r;
  }
  bico__free(c->ctx, buf);
  /* durable with the whole new folder (bico__sync_folder) */
  if (s == BICO_OK && fchmod(out, st->st_mode & 0777) != 0)
    s = carry_fail(c, name, "cannot finish its copy", errno);
  if (s == BICO_OK && c->root) (void)fchown(out, st->st_uid, st->st_gid);
  close(in);
  if (close(out) != 0 && s == BICO_OK)
    s = carry_fail(c, name, "cannot finish its copy", errno);
  return s;
}

static bico_status carry_dir(carry *c, int sfd, int dfd, int depth,
                             bico__keep_fn keep, void *arg);

static bico_status carry_one(carry *c, int sfd, int dfd, const char *name,
                             int depth) {
  struct stat st;
  if (fstatat(sfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
    return errno == ENOENT ? BICO_OK : carry_fail(c, name, "cannot stat it",
                                                  errno);
  if (S_ISDIR(st.st_mode)) {
    if (depth >= MAX_DEPTH)
      return carry_fail(c, name, "sub-folders nested too deeply", 0);
    if (mkdirat(dfd, name, 0700) != 0)
      return carry_fail(c, name, "cannot create the sub-folder", errno);
    int s2 = openat(sfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int d2 = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    bico_status s = BICO_OK;
    if (s2 < 0 || d2 < 0) {
      s = carry_fail(c, name, "cannot open the sub-folder", errno);
    } else {
      size_t len = strlen(c->rel);
      snprintf(c->rel + len, sizeof c->rel - len, "%s%s", len ? "/" : "",
               name);
      s = carry_dir(c, s2, d2, depth + 1, NULL, NULL);
      c->rel[len] = '\0';
    }
    if (s == BICO_OK && d2 >= 0) {
      if (c->root) (void)fchown(d2, st.st_uid, st.st_gid);
      (void)fchmod(d2, st.st_mode & 07777);
    }
    if (s2 >= 0) close(s2);
    if (d2 >= 0) close(d2);
    return s;
  }
  /* One inode in both folders (a symbolic link stays a link). */
  if (linkat(sfd, name, dfd, name, 0) == 0) return BICO_OK;
  int e = errno;
  if (e != EXDEV && e != EPERM && e != EMLINK && e != EACCES &&
      e != ENOTSUP && e != EOPNOTSUPP)
    return carry_fail(c, name, "cannot link it", e);
  if (S_ISREG(st.st_mode)) return copy_at(c, sfd, dfd, name, &st);
  if (S_ISLNK(st.st_mode)) {
    char target[4096];
    ssize_t n = readlinkat(sfd, name, target, sizeof target - 1);
    if (n < 0) return carry_fail(c, name, "cannot read the link", errno);
    target[n] = '\0';
    if (symlinkat(target, dfd, name) != 0)
      return carry_fail(c, name, "cannot recreate the link", errno);
    return BICO_OK;
  }
  return carry_fail(c, name, "it is neither a file nor a link nor a folder, "
                    "and cannot be linked", e);
}

static bico_status carry_dir(carry *c, int sfd, int dfd, int depth,
                             bico__keep_fn keep, void *arg) {
  int fd = dup(sfd);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (d == NULL) {
    if (fd >= 0) close(fd);
    return carry_fail(c, ".", "cannot list the folder", errno);
  }
  bico_status s = BICO_OK;
  struct dirent *e;
  while (s == BICO_OK && (e = readdir(d)) != NULL) {
    const char *n = e->d_name;
    if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0) continue;
    if (keep != NULL && !keep(arg, n)) continue;
    s = carry_one(c, sfd, dfd, n, depth);
  }
  closedir(d);
  return s;
}

bico_status bico__carry_files(bico_ctx *ctx, const char *fn,
                              const char *shown, const char *from,
                              const char *to, bico__keep_fn keep, void *arg) {
  carry *c = bico__calloc(ctx, 1, sizeof *c);
  if (c == NULL) return BICO_E_NOMEM;
  c->ctx = ctx;
  c->fn = fn;
  c->shown = shown;
  c->root = geteuid() == 0;
  int sfd = open(from, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int dfd = open(to, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  bico_status s;
  if (sfd < 0 || dfd < 0)
    s = bico__fail(ctx, BICO_E_IO, "the output folder %s: cannot open it: %s",
                   shown, strerror(errno));
  else
    s = carry_dir(c, sfd, dfd, 0, keep, arg);
  if (dfd >= 0) close(dfd);
  if (sfd >= 0) close(sfd);
  bico__free(ctx, c);
  return s;
}
