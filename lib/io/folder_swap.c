/* Folder commits (see lib/io/fileio.h): the swap of a complete new folder for
 * the old one, the removal of a folder tree, the user's own files of the
 * old folder carried into the new one by hard link (sub-folders recreated
 * with their attributes), and the old tree's retirement after the swap. */
#define _GNU_SOURCE 1 /* renameat2's flags, O_NOFOLLOW, O_DIRECTORY */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/xattr.h>
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

static int rename2at(int fd1, const char *from, int fd2, const char *to,
                     unsigned flags) {
#ifdef SYS_renameat2
  return (int)syscall(SYS_renameat2, fd1, from, fd2, to, flags);
#else
  (void)fd1;
  (void)from;
  (void)fd2;
  (void)to;
  (void)flags;
  errno = ENOSYS;
  return -1;
#endif
}

static int rename2(const char *from, const char *to, unsigned flags) {
  return rename2at(AT_FDCWD, from, AT_FDCWD, to, flags);
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
  /* A folder that appeared while the run wrote (none was there when it
   * began): nothing of it is known, so nothing of it is replaced. */
  if (t->carried == NULL && !t->replace) return EEXIST;
  /* The old folder is about to take a temporary name (the exchange, or
   * aside) until the commit retires it: locked first, as the run's own
   * temporaries are, so that another run's scan for leftovers
   * (lib/io/tmpfile.c) leaves it.  Without a lock (none can be taken) the
   * pid in the name still keeps it from the scans of this pid namespace. */
  if (t->oldlock == 0) {
    int fd = open(t->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) == 0) t->oldlock = fd + 1;
    else if (fd >= 0) close(fd);
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

/* Removes name in dfd (any type) and, for a folder on device dev,
 * everything in it; a folder on another device (a mount point) is left
 * with everything in it (EXDEV). */
static int remove_at(int dfd, const char *name, int depth, dev_t dev) {
  if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT) return 0;
  if (errno != EISDIR && errno != EPERM) return errno;
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return errno;
  if (!S_ISDIR(st.st_mode)) return EPERM;
  if (st.st_dev != dev) return EXDEV;
  if (depth > MAX_DEPTH) return ELOOP;
  int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == EACCES && st.st_uid == geteuid() &&
      fchmodat(dfd, name, 0700, 0) == 0)
    fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno;
  struct stat fs; /* what was opened: mounted on since the fstatat? */
  if (fstat(fd, &fs) != 0 || fs.st_dev != dev) {
    close(fd);
    return EXDEV;
  }
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
    int r = remove_at(dirfd(d), e->d_name, depth + 1, dev);
    if (r != 0 && first == 0) first = r;
  }
  closedir(d);
  if (unlinkat(dfd, name, AT_REMOVEDIR) != 0 && first == 0) first = errno;
  return first;
}

int bico__remove_tree(const char *path) {
  struct stat st, ps;
  if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : errno;
  if (!S_ISDIR(st.st_mode)) return unlink(path) == 0 ? 0 : errno;
  /* the folder's own parent: a folder mounted on is another device */
  size_t n = strlen(path);
  char *up = malloc(n + 4);
  if (up == NULL) return ENOMEM;
  snprintf(up, n + 4, "%s/..", path);
  int e = stat(up, &ps) != 0 ? errno : 0;
  free(up);
  if (e != 0) return e;
  if (ps.st_dev != st.st_dev) return EXDEV;
  return remove_at(AT_FDCWD, path, 0, st.st_dev);
}

/* ---- extended attributes ---- */

/* A required attribute (the user's own, ACLs): failing to carry it fails
 * the carry; others (trusted, security) are carried where allowed. */
static int required_xattr(const char *name) {
  return strncmp(name, "user.", 5) == 0 ||
         strncmp(name, "system.posix_acl_", 17) == 0;
}

static int passable(const char *name, int e) {
  return !required_xattr(name) &&
         (e == EPERM || e == EACCES || e == ENOTSUP || e == EOPNOTSUPP ||
          e == ENODATA);
}

/* fd's attribute names (malloc'd, NUL-separated, *len bytes); NULL with
 * *len 0 when it has none or the file system keeps none. */
static char *xattr_names(int fd, ssize_t *len, int *err) {
  *err = 0;
  *len = 0;
  for (int tries = 0; tries < 8; tries++) {
    ssize_t n = flistxattr(fd, NULL, 0);
    if (n < 0) {
      if (errno != ENOTSUP && errno != EOPNOTSUPP) *err = errno;
      return NULL;
    }
    if (n == 0) return NULL;
    char *list = malloc((size_t)n);
    if (list == NULL) {
      *err = ENOMEM;
      return NULL;
    }
    ssize_t m = flistxattr(fd, list, (size_t)n);
    if (m >= 0) {
      *len = m;
      return list;
    }
    free(list);
    if (errno != ERANGE) {
      *err = errno;
      return NULL;
    }
  }
  *err = ERANGE;
  return NULL;
}

static int in_names(const char *list, ssize_t len, const char *name) {
  for (ssize_t o = 0; o < len; o += (ssize_t)strlen(list + o) + 1)
    if (strcmp(list + o, name) == 0) return 1;
  return 0;
}

/* One attribute k of from onto to: 0 or an errno. */
static int copy_one_xattr(int from, int to, const char *k) {
  for (int tries = 0; tries < 8; tries++) {
    ssize_t v = fgetxattr(from, k, NULL, 0);
    if (v < 0) return errno;
    char *buf = malloc(v > 0 ? (size_t)v : 1);
    if (buf == NULL) return ENOMEM;
    ssize_t got = fgetxattr(from, k, buf, (size_t)v);
    int e = 0;
    if (got < 0) e = errno;
    else if (fsetxattr(to, k, buf, (size_t)got, 0) != 0) e = errno;
    free(buf);
    if (e != ERANGE) return e;
  }
  return ERANGE;
}

int bico__copy_xattrs(int from, int to, char *name, size_t cap) {
  ssize_t ns = 0, nd = 0;
  int e = 0;
  if (cap > 0) name[0] = '\0';
  char *src = xattr_names(from, &ns, &e);
  if (e != 0) {
    snprintf(name, cap, "(the list)");
    return e;
  }
  for (ssize_t o = 0; o < ns && e == 0; o += (ssize_t)strlen(src + o) + 1) {
    int r = copy_one_xattr(from, to, src + o);
    if (r != 0 && !passable(src + o, r)) {
      snprintf(name, cap, "%s", src + o);
      e = r;
    }
  }
  /* what the new entry has and the old one lacks (an ACL inherited from
   * the folder it was made in) */
  char *dst = e == 0 ? xattr_names(to, &nd, &e) : NULL;
  if (e != 0 && name[0] == '\0') snprintf(name, cap, "(the new list)");
  for (ssize_t o = 0; o < nd && e == 0; o += (ssize_t)strlen(dst + o) + 1) {
    if (in_names(src, ns, dst + o)) continue;
    if (fremovexattr(to, dst + o) != 0 && errno != ENODATA &&
        !passable(dst + o, errno)) {
      snprintf(name, cap, "%s", dst + o);
      e = errno;
    }
  }
  free(src);
  free(dst);
  return e;
}

/* ---- carrying the user's files ---- */

typedef struct carry {
  bico_ctx *ctx;
  const char *fn;
  const char *shown; /* the user's name for the old folder */
  int root;
  dev_t dev;           /* the old folder's file system */
  bico__carried *rec;  /* copies recorded for the retirement */
  char rel[4096]; /* the entry's path inside the folder, for messages */
} carry;

/* The entry's path for a message: the whole of it when short, else its
 * start and end around "...". */
static const char *entry_text(const carry *c, const char *name, char *buf,
                              size_t cap) {
  char full[4400];
  snprintf(full, sizeof full, "%s%s%s", c->rel, c->rel[0] ? "/" : "", name);
  size_t n = strlen(full);
  if (n < cap) return memcpy(buf, full, n + 1);
  size_t head = cap / 3, tail = cap - head - 4;
  memcpy(buf, full, head);
  memcpy(buf + head, "...", 3);
  memcpy(buf + head + 3, full + n - tail, tail + 1);
  return buf;
}

/* The reason first: a message cut at the context's buffer loses the end
 * of a long path, never why. */
static bico_status carry_fail(carry *c, const char *name, const char *why,
                              int e) {
  char ent[320];
  return bico__fail(c->ctx, BICO_E_IO,
                    "the output folder %s: cannot keep one of its entries in "
                    "the new folder: %s%s%s; nothing was written (the entry: "
                    "%s)",
                    c->shown, why, e ? ": " : "", e ? strerror(e) : "",
                    entry_text(c, name, ent, sizeof ent));
}

/* Owner (as root), extended attributes, mode and times of the entry st
 * onto the open descriptor out (its copy or its recreated folder);
 * attributes first: setting one needs write permission on out. */
static bico_status give_attrs(carry *c, const char *name, int in, int out,
                              const struct stat *st) {
  char an[256];
  int e = bico__copy_xattrs(in, out, an, sizeof an);
  if (e != 0) {
    char why[400];
    snprintf(why, sizeof why, "cannot carry its extended attribute %s", an);
    return carry_fail(c, name, why, e);
  }
  if (c->root && fchown(out, st->st_uid, st->st_gid) != 0)
    return carry_fail(c, name, "cannot give it its owner", errno);
  if (fchmod(out, st->st_mode & (S_ISDIR(st->st_mode) ? 07777 : 0777)) != 0)
    return carry_fail(c, name, "cannot give it its mode", errno);
  struct timespec tm[2] = {st->st_atim, st->st_mtim};
  if (futimens(out, tm) != 0)
    return carry_fail(c, name, "cannot give it its times", errno);
  return BICO_OK;
}

/* An entry carried as a copy: recorded, so that the old tree's
 * retirement knows it was carried. */
static bico_status record_copy(carry *c, const struct stat *st) {
  bico__carried *r = c->rec;
  bico__copied *g = bico__grow(c->ctx, r->copies, r->ncopies, &r->capcopies,
                               16, sizeof *g);
  if (g == NULL) return BICO_E_NOMEM;
  r->copies = g;
  g[r->ncopies].dev = st->st_dev;
  g[r->ncopies].ino = st->st_ino;
  g[r->ncopies].size = st->st_size;
  g[r->ncopies].mtime = st->st_mtim;
  r->ncopies++;
  return BICO_OK;
}

/* A copy of the regular file name (linking refused): content, mode,
 * owner (as root), extended attributes and times. */
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
  if (s == BICO_OK) s = give_attrs(c, name, in, out, st);
  if (s == BICO_OK) s = record_copy(c, st);
  close(in);
  if (close(out) != 0 && s == BICO_OK)
    s = carry_fail(c, name, "cannot finish its copy", errno);
  return s;
}

static bico_status carry_dir(carry *c, int sfd, int dfd, int depth,
                             bico__keep_fn keep, void *arg);

/* A sub-folder: recreated, its entries carried, then its attributes (its
 * times last: carrying its entries changed them). */
static bico_status carry_subdir(carry *c, int sfd, int dfd, const char *name,
                                const struct stat *st, int depth) {
  if (depth >= MAX_DEPTH)
    return carry_fail(c, name, "sub-folders nested too deeply (more than 64 "
                      "levels)", 0);
  if (st->st_dev != c->dev)
    return carry_fail(c, name, "it is a mount point (another file system), "
                      "which a folder commit never moves or removes", 0);
  if (mkdirat(dfd, name, 0700) != 0)
    return carry_fail(c, name, "cannot create the sub-folder", errno);
  int s2 = openat(sfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  int e2 = errno;
  int d2 = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  bico_status s = BICO_OK;
  struct stat now;
  if (s2 < 0 || d2 < 0) {
    s = carry_fail(c, name, s2 < 0 && e2 == ENOENT
                                ? "it vanished while it was carried (another "
                                  "process is changing the folder)"
                                : "cannot open the sub-folder",
                   s2 < 0 && e2 == ENOENT ? 0 : s2 < 0 ? e2 : errno);
  } else if (fstat(s2, &now) != 0 || now.st_dev != st->st_dev ||
             now.st_ino != st->st_ino) {
    s = carry_fail(c, name, "it was replaced while it was carried (another "
                   "process is changing the folder)", 0);
  } else {
    size_t len = strlen(c->rel);
    snprintf(c->rel + len, sizeof c->rel - len, "%s%s", len ? "/" : "", name);
    s = carry_dir(c, s2, d2, depth + 1, NULL, NULL);
    c->rel[len] = '\0';
  }
  if (s == BICO_OK) s = give_attrs(c, name, s2, d2, st); /* times as found */
  if (s2 >= 0) close(s2);
  if (d2 >= 0) close(d2);
  return s;
}

static bico_status carry_one(carry *c, int sfd, int dfd, const char *name,
                             int depth) {
  struct stat st;
  if (fstatat(sfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
    return errno == ENOENT
               ? carry_fail(c, name, "it vanished while it was carried "
                            "(another process is changing the folder)", 0)
               : carry_fail(c, name, "cannot stat it", errno);
  if (S_ISDIR(st.st_mode)) return carry_subdir(c, sfd, dfd, name, &st, depth);
  /* One inode in both folders (a symbolic link stays a link). */
  if (linkat(sfd, name, dfd, name, 0) == 0) return BICO_OK;
  int e = errno;
  if (e == ENOENT)
    return carry_fail(c, name, "it vanished while it was carried (another "
                      "process is changing the folder)", 0);
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
    return record_copy(c, &st);
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

void bico__carried_free(bico_ctx *ctx, bico__carried *r) {
  if (r == NULL) return;
  bico__free(ctx, r->copies);
  memset(r, 0, sizeof *r);
}

bico_status bico__carry_files(bico_ctx *ctx, const char *fn,
                              const char *shown, const char *from,
                              const char *to, bico__keep_fn keep, void *arg,
                              bico__carried *rec) {
  carry *c = bico__calloc(ctx, 1, sizeof *c);
  if (c == NULL) return BICO_E_NOMEM;
  c->ctx = ctx;
  c->fn = fn;
  c->shown = shown;
  c->root = geteuid() == 0;
  c->rec = rec;
  rec->keep = keep;
  rec->arg = arg;
  int sfd = open(from, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int dfd = open(to, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  bico_status s;
  if (sfd < 0 || dfd < 0 || fstat(sfd, &st) != 0) {
    s = bico__fail(ctx, BICO_E_IO, "the output folder %s: cannot open it: %s",
                   shown, strerror(errno));
  } else {
    c->dev = rec->dev = st.st_dev;
    s = carry_dir(c, sfd, dfd, 0, keep, arg);
  }
  if (dfd >= 0) close(dfd);
  if (sfd >= 0) close(sfd);
  bico__free(ctx, c);
  return s;
}

/* ---- the old tree after the swap ---- */

typedef struct retire {
  const bico__carried *rec;
  dev_t dev;
  int left; /* entries of the user's that stay */
} retire;

/* st was carried as a copy and has not changed since. */
static int copied_unchanged(const bico__carried *r, const struct stat *st) {
  for (size_t k = 0; k < r->ncopies; k++) {
    const bico__copied *g = &r->copies[k];
    if (g->dev == st->st_dev && g->ino == st->st_ino)
      return g->size == st->st_size &&
             g->mtime.tv_sec == st->st_mtim.tv_sec &&
             g->mtime.tv_nsec == st->st_mtim.tv_nsec;
  }
  return 0;
}

/* Moves name from ofd into nfd unless nfd holds that name: 1 when moved. */
static int move_in(int ofd, int nfd, const char *name) {
  if (rename2at(ofd, name, nfd, name, RENAME_NOREPLACE) == 0) return 1;
  if (errno != EINVAL && errno != ENOSYS) return 0;
  struct stat st; /* no RENAME_NOREPLACE here: look, then rename */
  if (fstatat(nfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 || errno != ENOENT)
    return 0;
  return renameat(ofd, name, nfd, name) == 0;
}

/* The old folder ofd's entries against the new folder nfd. */
static void retire_dir(retire *R, int ofd, int nfd, int depth) {
  int fd = dup(ofd);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (d == NULL) {
    if (fd >= 0) close(fd);
    R->left++;
    return;
  }
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    const char *n = e->d_name;
    if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0) continue;
    if (depth == 0 && R->rec->keep != NULL && !R->rec->keep(R->rec->arg, n)) {
      /* dropped on purpose (the weights the new folder replaces); what
       * cannot be removed (chattr +i) stays in the old tree */
      (void)remove_at(ofd, n, 1, R->dev);
      continue;
    }
    struct stat os, ns;
    if (fstatat(ofd, n, &os, AT_SYMLINK_NOFOLLOW) != 0) continue;
    int have = fstatat(nfd, n, &ns, AT_SYMLINK_NOFOLLOW) == 0;
    if (S_ISDIR(os.st_mode) && os.st_dev == R->dev && have &&
        S_ISDIR(ns.st_mode) && depth < MAX_DEPTH) {
      int so = openat(ofd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      int sn = openat(nfd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (so >= 0 && sn >= 0) retire_dir(R, so, sn, depth + 1);
      else R->left++;
      if (so >= 0) close(so);
      if (sn >= 0) close(sn);
      if (unlinkat(ofd, n, AT_REMOVEDIR) != 0) R->left++;
      continue;
    }
    if (!S_ISDIR(os.st_mode) && have &&
        ((ns.st_dev == os.st_dev && ns.st_ino == os.st_ino) ||
         copied_unchanged(R->rec, &os))) {
      (void)unlinkat(ofd, n, 0); /* carried: the new folder has it */
      continue;
    }
    /* Made (or changed) during the run: into the new folder when the
     * name is free there; else it stays. */
    if (!(S_ISDIR(os.st_mode) && os.st_dev != R->dev) && !have &&
        move_in(ofd, nfd, n))
      continue;
    R->left++;
  }
  closedir(d);
}

void bico__retire_tree(bico__tmpfile *t, const char *old) {
  retire R = {t->carried, 0, 0};
  struct stat os;
  if (lstat(old, &os) != 0) return;
  R.dev = os.st_dev;
  for (int pass = 0; pass < 4; pass++) {
    int ofd = open(old, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int nfd = open(t->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (ofd >= 0 && nfd >= 0) retire_dir(&R, ofd, nfd, 0);
    else R.left++;
    if (ofd >= 0) close(ofd);
    if (nfd >= 0) close(nfd);
    if (R.left > 0 || rmdir(old) == 0 || errno != ENOTEMPTY) break;
    /* an entry appeared after the scan, or a protected one stays: once
     * more (a protected file stays in the old tree under its temporary
     * name: the next run's leftover scan tries it again) */
  }
  if (R.left > 0 && t->keptname != NULL && rename(old, t->keptname) == 0)
    t->kept = 1;
}
