/* Output folders (lib/io/fileio.h): the run's lock on an output folder, the
 * checks before a folder commit (what it may never replace), and the new
 * folder's own attributes.  The model-folder writer (st_folder.c), the
 * adapter writer (lib/lora/lora_io.c) and bico_folder (folder.c) commit
 * folders through these. */
#define _GNU_SOURCE 1 /* O_NOFOLLOW, O_DIRECTORY, flock */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fileio.h"

/* Lock file names cut the folder's name as temporary names do. */
#define LOCK_BASE_MAX 200
/* Rounds of "take, look again" before a folder that keeps changing is
 * refused. */
#define LOCK_ROUNDS 8
#define MAX_DEPTH 64

struct bico__lock {
  bico_ctx *ctx;
  int fd;
  char *path; /* the lock file */
};

/* parent (malloc'd) and base (inside t) of a trimmed path. */
static char *parent_of(const char *t, const char **base) {
  const char *slash = strrchr(t, '/');
  *base = slash ? slash + 1 : t;
  if (slash == NULL) return strdup(".");
  if (slash == t) return strdup("/");
  return strndup(t, (size_t)(slash - t));
}

enum { OUT_NEW, OUT_DIR, OUT_OTHER, OUT_DANGLING };

/* The real path output folder dir names (malloc'd): an existing folder's
 * (through links), else the real parent and the name.  *kind says what is
 * there.  NULL when the parent cannot be resolved or memory runs out. */
static char *real_of(const char *dir, int *kind) {
  char *t = bico__trim_slashes(dir);
  if (t == NULL) return NULL;
  struct stat st;
  char *r = NULL;
  if (stat(t, &st) == 0) {
    *kind = S_ISDIR(st.st_mode) ? OUT_DIR : OUT_OTHER;
    r = realpath(t, NULL);
  } else {
    *kind = lstat(t, &st) == 0
                ? (S_ISLNK(st.st_mode) ? OUT_DANGLING : OUT_OTHER)
                : OUT_NEW;
    const char *base;
    char *parent = parent_of(t, &base);
    char *rp = parent ? realpath(parent, NULL) : NULL;
    if (rp != NULL && strcmp(base, ".") != 0 && strcmp(base, "..") != 0) {
      size_t n = strlen(rp) + strlen(base) + 2;
      r = malloc(n);
      if (r != NULL)
        snprintf(r, n, "%s%s%s", rp, strcmp(rp, "/") == 0 ? "" : "/", base);
    }
    free(rp);
    free(parent);
  }
  free(t);
  return r;
}

/* The lock file of the folder whose real path is real (malloc'd). */
static char *lock_path(const char *real) {
  const char *base;
  char *parent = parent_of(real, &base);
  if (parent == NULL) return NULL;
  size_t bl = strlen(base) > LOCK_BASE_MAX ? LOCK_BASE_MAX : strlen(base);
  size_t n = strlen(parent) + bl + sizeof BICO__LOCK_SUFFIX + 3;
  char *p = malloc(n);
  if (p != NULL)
    snprintf(p, n, "%s%s.%.*s%s", parent, strcmp(parent, "/") == 0 ? "" : "/",
             (int)bl, base, BICO__LOCK_SUFFIX);
  free(parent);
  return p;
}

/* The holder a lock file names: "<pid>\n<command>\n"; *pid 0 when it
 * names none yet; *age the seconds since it was written. */
static void holder_of(int fd, long *pid, char *cmd, size_t cap, double *age) {
  char buf[600];
  *pid = 0;
  cmd[0] = '\0';
  *age = 0;
  ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return;
  buf[n] = '\0';
  char *end;
  long p = strtol(buf, &end, 10);
  if (end == buf || *end != '\n' || p <= 0) return;
  *pid = p;
  char *nl = strchr(end + 1, '\n');
  if (nl) *nl = '\0';
  snprintf(cmd, cap, "%s", end + 1);
  struct stat st;
  struct timespec now;
  if (fstat(fd, &st) == 0 && clock_gettime(CLOCK_REALTIME, &now) == 0)
    *age = (double)(now.tv_sec - st.st_mtim.tv_sec);
}

/* Writes this process as the holder: its pid and command line (arguments
 * joined by spaces, control characters as '?', cut to 400 bytes). */
static void write_holder(int fd) {
  char line[512], cmd[420] = "";
  int c = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
  if (c >= 0) {
    ssize_t n = read(c, cmd, sizeof cmd - 1);
    close(c);
    if (n < 0) n = 0;
    cmd[n] = '\0';
    while (n > 0 && cmd[n - 1] == '\0') n--;
    for (ssize_t k = 0; k < n; k++)
      if (cmd[k] == '\0') cmd[k] = ' ';
      else if ((unsigned char)cmd[k] < 0x20 || cmd[k] == 0x7f) cmd[k] = '?';
    cmd[n] = '\0';
  }
  int len = snprintf(line, sizeof line, "%ld\n%s\n", (long)getpid(), cmd);
  if (len < 0) return;
  if (ftruncate(fd, 0) == 0)
    (void)!pwrite(fd, line, (size_t)len < sizeof line ? (size_t)len
                                                      : sizeof line - 1, 0);
}

static double seconds_since(const struct timespec *t0) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)(t.tv_sec - t0->tv_sec) +
         1e-9 * (double)(t.tv_nsec - t0->tv_nsec);
}

/* flock, waiting up to the context's folder_wait: 0 taken, 1 joined (this
 * process holds it and join allows), 2 the file system keeps no locks,
 * else a failure status (message set). */
static int wait_lock(bico_ctx *ctx, const char *dir, int fd, int join,
                     const struct timespec *t0, bico_status *st) {
  /* a holder writes its name right after taking the lock: a moment for
   * it to do so, so that the message can name it */
  int unnamed = 0;
  for (;;) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) return 0;
    int e = errno;
    if (e == EINTR) continue;
    if (e == ENOLCK || e == EINVAL || e == ENOSYS || e == EOPNOTSUPP)
      return 2;
    if (e != EWOULDBLOCK) {
      *st = bico__fail(ctx, BICO_E_IO, "the output folder %s: cannot lock "
                       "it: %s", dir, strerror(e));
      return -1;
    }
    long pid;
    char cmd[420];
    double age;
    holder_of(fd, &pid, cmd, sizeof cmd, &age);
    if (pid == 0 && unnamed++ < 100) {
      struct timespec ts = {0, 10000000}; /* 10 ms, at most 1 s in all */
      nanosleep(&ts, NULL);
      continue;
    }
    if (pid == (long)getpid()) {
      if (join) return 1;
      *st = bico__fail(ctx, BICO_E_IO,
                       "the output folder %s is already being written by this "
                       "process (pid %ld: another run or bico_folder holds its "
                       "lock); refusing to write it twice at once (nothing was "
                       "written)", dir, pid);
      return -1;
    }
    double waited = seconds_since(t0);
    if (waited < ctx->folder_wait) {
      double left = ctx->folder_wait - waited, step = left < 0.1 ? left : 0.1;
      struct timespec ts = {0, (long)(step * 1e9)};
      nanosleep(&ts, NULL);
      continue;
    }
    char w[64] = "";
    if (ctx->folder_wait > 0) snprintf(w, sizeof w, ", waited %.0f s", waited);
    char who[64] = "pid unknown: it has not written its name yet";
    if (pid > 0) snprintf(who, sizeof who, "pid %ld, for %.0f s", pid, age);
    *st = bico__fail(ctx, BICO_E_IO,
                     "the output folder %s is being written by another run "
                     "(%s%s); refusing to write it at the same time: nothing "
                     "was written (run again when it has finished, or let "
                     "this run wait for it: the context's folder_wait); that "
                     "run's command: %s",
                     dir, who, w, cmd[0] ? cmd : "(unknown)");
    return -1;
  }
}

/* The lock file still names fd's file, and dir still the folder real. */
static int still_same(int fd, const char *lp, const char *dir,
                      const char *real) {
  struct stat a, b;
  if (fstat(fd, &a) != 0 || lstat(lp, &b) != 0 || a.st_dev != b.st_dev ||
      a.st_ino != b.st_ino)
    return 0;
  int kind;
  char *again = real_of(dir, &kind);
  int same = again != NULL && strcmp(again, real) == 0 &&
             (kind == OUT_NEW || kind == OUT_DIR);
  free(again);
  return same;
}

/* Opens the lock file: fd, -2 when none can be made there (no lock, no
 * error), -1 after a failure (message set). */
static int open_lock(bico_ctx *ctx, const char *dir, const char *lp,
                     bico_status *st) {
  int fd = open(lp, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK,
                0666);
  if (fd < 0 && errno == EACCES)
    fd = open(lp, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    int e = errno;
    if (e == EACCES || e == EROFS || e == ENOENT || e == ENOTDIR ||
        e == EPERM)
      return -2;
    *st = bico__fail(ctx, BICO_E_IO, "the output folder %s: cannot open its "
                     "lock file %s: %s", dir, lp,
                     e == ELOOP ? "it is a symbolic link" : strerror(e));
    return -1;
  }
  struct stat fs;
  if (fstat(fd, &fs) != 0 || !S_ISREG(fs.st_mode)) {
    close(fd);
    *st = bico__fail(ctx, BICO_E_IO, "the output folder %s: its lock file %s "
                     "is not a regular file; remove it", dir, lp);
    return -1;
  }
  return fd;
}

bico_status bico__lock_take(bico_ctx *ctx, const char *dir, int join,
                            bico__lock **out) {
  *out = NULL;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  bico_status st = BICO_OK;
  for (int round = 0; round < LOCK_ROUNDS; round++) {
    int kind = OUT_NEW;
    char *real = real_of(dir, &kind);
    /* something not a folder, or no parent: the checks say why */
    if (real == NULL || kind == OUT_OTHER || kind == OUT_DANGLING) {
      free(real);
      return BICO_OK;
    }
    char *lp = lock_path(real);
    int fd = lp ? open_lock(ctx, dir, lp, &st) : -2;
    int r = fd >= 0 ? wait_lock(ctx, dir, fd, join, &t0, &st) : fd;
    if (r == 0 && !still_same(fd, lp, dir, real)) {
      /* its holder let it go (and removed it), or dir now names another
       * folder: take the lock again */
      struct stat a, b;
      if (fstat(fd, &a) == 0 && lstat(lp, &b) == 0 && a.st_dev == b.st_dev &&
          a.st_ino == b.st_ino)
        (void)unlink(lp);
      close(fd);
      free(lp);
      free(real);
      continue;
    }
    free(real);
    if (r == 0) {
      bico__lock *l = bico__calloc(ctx, 1, sizeof *l);
      char *keep = l ? bico__strdup(ctx, lp) : NULL;
      if (keep == NULL) {
        bico__free(ctx, l);
        (void)unlink(lp); /* ours: taken, not yet let go */
        free(lp);
        close(fd);
        return BICO_E_NOMEM;
      }
      free(lp);
      write_holder(fd);
      l->ctx = ctx;
      l->fd = fd;
      l->path = keep;
      *out = l;
      return BICO_OK;
    }
    if (fd >= 0) close(fd);
    free(lp);
    /* joined (1), no locks here (2, -2): nothing of our own to hold */
    return r == -1 ? st : BICO_OK;
  }
  return bico__fail(ctx, BICO_E_IO, "the output folder %s kept changing "
                    "while its lock was taken (%d tries); nothing was "
                    "written", dir, LOCK_ROUNDS);
}

void bico__lock_release(bico__lock *l) {
  if (l == NULL) return;
  struct stat a, b;
  /* removed while held: a waiter then finds it gone and takes a new one */
  if (fstat(l->fd, &a) == 0 && lstat(l->path, &b) == 0 &&
      a.st_dev == b.st_dev && a.st_ino == b.st_ino)
    (void)unlink(l->path);
  close(l->fd);
  bico_ctx *ctx = l->ctx;
  bico__free(ctx, l->path);
  bico__free(ctx, l);
}

/* ---- the checks ---- */

/* The first sub-folder under fd (at any depth) on another device than
 * dev: its path relative to the folder into rel; 1 when found. */
static int find_mount(int fd, dev_t dev, int depth, char *rel, size_t cap,
                      size_t len) {
  int d2 = dup(fd);
  DIR *d = d2 >= 0 ? fdopendir(d2) : NULL;
  if (d == NULL) {
    if (d2 >= 0) close(d2);
    return 0;
  }
  int found = 0;
  struct dirent *e;
  while (!found && (e = readdir(d)) != NULL) {
    const char *n = e->d_name;
    if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0) continue;
    if (e->d_type != DT_DIR && e->d_type != DT_UNKNOWN) continue;
    struct stat st;
    if (fstatat(fd, n, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode))
      continue;
    int k = snprintf(rel + len, cap - len, "%s%s", len ? "/" : "", n);
    size_t nl = k < 0 || (size_t)k >= cap - len ? cap - 1 : len + (size_t)k;
    if (st.st_dev != dev) {
      found = 1;
      break;
    }
    if (depth + 1 < MAX_DEPTH) {
      /* O_NOATIME: looking must not change the access times the carry
       * keeps (allowed to the owner and root; else an ordinary open) */
      int sub = openat(fd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC |
                                  O_NOATIME);
      if (sub < 0 && errno == EPERM)
        sub = openat(fd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub >= 0) {
        found = find_mount(sub, dev, depth + 1, rel, cap, nl);
        close(sub);
      }
    }
    if (!found) rel[len] = '\0';
  }
  closedir(d);
  return found;
}

/* An existing output folder: a mount point, one holding a mount point, or
 * the working directory or a folder above it is refused. */
static bico_status check_existing(bico_ctx *ctx, const bico__stage *s) {
  char *up = bico__path_join(ctx, s->real, "..");
  if (up == NULL) return BICO_E_NOMEM;
  struct stat ps;
  int mount = stat(up, &ps) == 0 && ps.st_dev != s->old.st_dev;
  bico__free(ctx, up);
  /* a mount point cannot be swapped (EBUSY, EXDEV): say so first */
  if (mount)
    return bico__fail(ctx, BICO_E_IO,
                      "the output folder %s is a mount point: a model folder "
                      "is built beside the output and swapped in whole; "
                      "write into a sub-folder of it (nothing was written)",
                      s->dir);
  int fd = open(s->real, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  char rel[1024] = "";
  int holds = fd >= 0 && find_mount(fd, s->old.st_dev, 0, rel, sizeof rel, 0);
  if (fd >= 0) close(fd);
  if (holds)
    return bico__fail(ctx, BICO_E_IO,
                      "the output folder %s holds a mount point, %s (another "
                      "file system): a folder commit moves the folder's "
                      "entries into a new folder and removes the old one, "
                      "which must never reach into another file system; "
                      "unmount it or write to another folder (nothing was "
                      "written)", s->dir, rel);
  char *cwd = getcwd(NULL, 0);
  size_t n = strlen(s->real);
  int in = cwd != NULL && strncmp(cwd, s->real, n) == 0 &&
           (cwd[n] == '\0' || cwd[n] == '/' || strcmp(s->real, "/") == 0);
  bico_status st = BICO_OK;
  if (in)
    st = bico__fail(ctx, BICO_E_ARG,
                    "the output folder %s %s the working directory (%s): the "
                    "commit swaps a new folder in for it and removes the old "
                    "one, which would leave this process in a removed folder; "
                    "write to another folder, or run from outside it "
                    "(nothing was written)", s->dir,
                    cwd[n] == '\0' ? "is" : "holds", cwd);
  free(cwd);
  return st;
}

/* An existing output folder (through links). */
static bico_status open_existing(bico_ctx *ctx, bico__stage *s,
                                 const struct stat *ds) {
  if (!S_ISDIR(ds->st_mode))
    return bico__fail(ctx, BICO_E_ARG,
                      "the output folder %s exists and is not a folder",
                      s->dir);
  if (access(s->dir, W_OK | X_OK) != 0)
    return bico__fail(ctx, BICO_E_IO,
                      "cannot write into the output folder %s: %s", s->dir,
                      strerror(errno));
  char *r = realpath(s->dir, NULL);
  if (r == NULL)
    return bico__fail(ctx, BICO_E_IO, "the output folder %s: %s", s->dir,
                      strerror(errno));
  s->real = bico__strdup(ctx, r);
  free(r);
  s->exists = 1;
  s->old = *ds;
  if (s->real == NULL) return BICO_E_NOMEM;
  return check_existing(ctx, s);
}

/* A folder the commit creates: its real parent and its name. */
static bico_status open_new(bico_ctx *ctx, bico__stage *s) {
  struct stat ls;
  if (lstat(s->dir, &ls) == 0 && S_ISLNK(ls.st_mode)) {
    char to[1024];
    ssize_t k = readlink(s->dir, to, sizeof to - 1);
    to[k > 0 ? k : 0] = '\0';
    return bico__fail(ctx, BICO_E_ARG,
                      "the output folder %s is a dangling symbolic link (to "
                      "%s, which does not exist); remove the link, or create "
                      "the folder it leads to (nothing was written)",
                      s->dir, to);
  }
  const char *slash = strrchr(s->dir, '/');
  const char *base = slash ? slash + 1 : s->dir;
  if (strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
    return bico__fail(ctx, BICO_E_ARG, "the output folder '%s' names no "
                      "folder", s->dir);
  char *parent = slash == NULL ? bico__strdup(ctx, ".")
                 : slash == s->dir ? bico__strdup(ctx, "/")
                 : bico__strndup(ctx, s->dir, (size_t)(slash - s->dir));
  if (parent == NULL) return BICO_E_NOMEM;
  char *r = realpath(parent, NULL);
  struct stat ds;
  bico_status st = BICO_OK;
  if (r == NULL || stat(r, &ds) != 0 || !S_ISDIR(ds.st_mode))
    st = bico__fail(ctx, BICO_E_IO, "cannot create the output folder %s: its "
                    "parent folder %s %s", s->dir, parent,
                    r == NULL && errno == ENOENT ? "does not exist"
                                                 : "is not a folder");
  else if ((s->real = bico__path_join(ctx, r, base)) == NULL)
    st = BICO_E_NOMEM;
  free(r);
  bico__free(ctx, parent);
  return st;
}

bico_status bico__stage_open(bico_ctx *ctx, const char *fn, const char *dir,
                             int join, bico__stage *s) {
  memset(s, 0, sizeof *s);
  s->t.fd = -1;
  s->t.gone = 1;
  if (dir[0] == '\0')
    return bico__fail(ctx, BICO_E_ARG, "%s: the output folder name is empty",
                      fn);
  size_t dl = strlen(dir);
  while (dl > 1 && dir[dl - 1] == '/') dl--;
  s->dir = bico__strndup(ctx, dir, dl);
  if (s->dir == NULL) return BICO_E_NOMEM;
  bico_status st = bico__lock_take(ctx, s->dir, join, &s->lock);
  struct stat ds;
  if (st == BICO_OK)
    st = stat(s->dir, &ds) == 0 ? open_existing(ctx, s, &ds)
                                : open_new(ctx, s);
  return st;
}

bico_status bico__stage_make(bico_ctx *ctx, const char *fn, bico__stage *s) {
  return bico__tmp_folder(ctx, fn, s->dir, s->real, &s->t);
}

/* The new folder's own mode (and owner, as root) and extended attributes:
 * the old folder's, or what mkdir would give. */
static bico_status stage_attrs(bico_ctx *ctx, bico__stage *s) {
  int fd = open(s->t.tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return bico__fail(ctx, BICO_E_IO, "the output folder %s: its new folder "
                      "is gone: %s", s->dir, strerror(errno));
  int bad = 0;
  char an[256] = "";
  const char *what = "mode";
  if (s->exists) {
    int ofd = open(s->real, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (ofd < 0) bad = errno;
    if (!bad && (bad = bico__copy_xattrs(ofd, fd, an, sizeof an)) != 0)
      what = "extended attributes";
    if (ofd >= 0) close(ofd);
    if (!bad && geteuid() == 0 &&
        fchown(fd, s->old.st_uid, s->old.st_gid) != 0)
      bad = errno;
    if (!bad && fchmod(fd, s->old.st_mode & 07777) != 0) bad = errno;
  } else if (fchmod(fd, 0777 & ~bico__umask()) != 0) {
    bad = errno;
  }
  close(fd);
  if (bad)
    return bico__fail(ctx, BICO_E_IO, "the output folder %s: cannot give the "
                      "new folder the old one's %s%s%s: %s", s->dir, what,
                      an[0] ? " " : "", an, strerror(bad));
  return BICO_OK;
}

bico_status bico__stage_finish(bico_ctx *ctx, const char *fn, bico__stage *s,
                               bico__keep_fn keep, void *arg) {
  bico_status st = BICO_OK;
  if (s->exists && keep != NULL) {
    st = bico__carry_files(ctx, fn, s->dir, s->real, s->t.tmp, keep, arg,
                           &s->rec);
    if (st == BICO_OK) s->t.carried = &s->rec;
  } else if (s->exists) {
    s->t.replace = 1; /* a folder that was not there stays refused */
  }
  if (st == BICO_OK) st = stage_attrs(ctx, s);
  /* the files in it were not synced one by one */
  int e = st == BICO_OK ? bico__sync_folder(s->t.tmp) : 0;
  if (e != 0 && e != EINVAL && e != EROFS)
    st = bico__fail(ctx, BICO_E_IO, "the output folder %s: cannot make the "
                    "new files durable: %s", s->dir, strerror(e));
  return st;
}

void bico__stage_unlock(bico__stage *s) {
  bico__lock_release(s->lock);
  s->lock = NULL;
}

void bico__stage_free(bico_ctx *ctx, bico__stage *s) {
  bico__tmp_discard(ctx, &s->t); /* the new folder, unless committed */
  bico__carried_free(ctx, &s->rec);
  bico__stage_unlock(s);
  bico__free(ctx, s->real);
  bico__free(ctx, s->dir);
  s->real = s->dir = NULL;
}
