/* Temporary files and folders beside their destination, locked while a run
 * holds them; leftovers of dead runs removed (lib/io/fileio.h). */
#define _DEFAULT_SOURCE 1 /* DT_* names, O_DIRECTORY */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "fileio.h"

/* The base name is cut so that ".<base>.bico-tmp.<pid>.XXXXXX" fits
 * NAME_MAX (255) with room for a 10-digit pid. */
#define TMP_BASE_MAX 200

/* The umask without changing it (umask() is process-wide and racy):
 * Linux reports it in /proc/self/status; elsewhere assume 022. */
mode_t bico__umask(void) {
  mode_t m = 022;
  FILE *fp = fopen("/proc/self/status", "r");
  if (fp == NULL) return m;
  char line[256];
  while (fgets(line, sizeof line, fp)) {
    unsigned v;
    if (sscanf(line, "Umask: %o", &v) == 1) {
      m = (mode_t)(v & 0777);
      break;
    }
  }
  fclose(fp);
  return m;
}

/* The leftover entry n of folder dfd (st: what fstatat saw), opened
 * without following a link or blocking (O_DIRECTORY for a folder) and
 * locked (flock LOCK_EX|LOCK_NB), its name still leading to what was
 * opened: the descriptor, or -1 when it cannot be taken (a live run holds
 * its lock, it cannot be opened, or it changed), and it stays. */
static int take_leftover(int dfd, const char *n, const struct stat *st) {
  int dir = S_ISDIR(st->st_mode);
  int fl = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC |
           (dir ? O_DIRECTORY : 0);
  int fd = openat(dfd, n, fl);
  if (fd < 0 && !dir && errno == EACCES) /* a file without read bits */
    fd = openat(dfd, n, (fl & ~O_ACCMODE) | O_WRONLY);
  if (fd < 0) return -1;
  struct stat a, b;
  int r;
  while ((r = flock(fd, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
  }
  if (r != 0 || fstat(fd, &a) != 0 || a.st_dev != st->st_dev ||
      a.st_ino != st->st_ino ||
      fstatat(dfd, n, &b, AT_SYMLINK_NOFOLLOW) != 0 ||
      b.st_dev != a.st_dev || b.st_ino != a.st_ino) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Removes ".<base>.bico-tmp.<pid>.*" files and folders in dir that belong
 * to this user and that no live run holds: the run that makes a temporary
 * holds an exclusive flock(2) on it (bico__tmp_create, bico__tmp_folder;
 * the old folder of a folder swap too) until it is renamed or removed, so
 * an entry is removed only when this scan can take that lock, and it is
 * removed under it.  The pid in the name is never trusted alone: a run in
 * another pid namespace (a container sharing the folder) has a pid this
 * process cannot see, or one that names another process here.  It only
 * adds a reason to keep: an entry whose pid is a live process here stays
 * (a temporary of an older version of the library, which took no lock;
 * a reused pid keeps its files for a later run to remove). */
static void remove_stale(const char *dir, const char *base, size_t blen) {
  DIR *d = opendir(dir);
  if (d == NULL) return;
  int dfd = dirfd(d);
  size_t ml = strlen(BICO__TMP_MARK);
  pid_t self = getpid();
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    const char *n = e->d_name;
    if (n[0] != '.' || strncmp(n + 1, base, blen) != 0 ||
        strncmp(n + 1 + blen, BICO__TMP_MARK, ml) != 0)
      continue;
    const char *p = n + 1 + blen + ml;
    char *end;
    errno = 0;
    long pid = strtol(p, &end, 10);
    if (end == p || *end != '.' || errno != 0 || pid <= 0 ||
        pid == (long)self)
      continue;
    if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
    struct stat st;
    if (fstatat(dfd, n, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        st.st_uid != geteuid() ||
        (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)))
      continue;
    int fd = take_leftover(dfd, n, &st);
    if (fd < 0) continue; /* a live run's */
    if (S_ISREG(st.st_mode)) {
      (void)unlinkat(dfd, n, 0);
    } else {
      /* a folder commit's new or old folder (bico__tmp_folder) */
      size_t cap = strlen(dir) + strlen(n) + 2;
      char *q = malloc(cap);
      if (q != NULL) {
        snprintf(q, cap, "%s/%s", dir, n);
        (void)bico__remove_tree(q);
      }
      free(q);
    }
    close(fd); /* the lock goes once the entry is gone */
  }
  closedir(d);
}

/* Locks the temporary just made at path (fd open on it) as its run's:
 * 0 once locked with path still leading to it; EAGAIN when another
 * process's scan (remove_stale) took it first (the temporary is then
 * removed or left to that scan: the caller makes another); another errno
 * when it cannot be locked for another reason.  A file system without
 * flock (ENOLCK, EOPNOTSUPP, ...) gives 0 with *locked 0: the scans of
 * other runs cannot lock it either, and keep it. */
static int lock_new(int fd, const char *path, int isdir, int *locked) {
  *locked = 0;
  int r;
  while ((r = flock(fd, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
  }
  if (r != 0 && errno == EWOULDBLOCK) {
    /* a scan holds it: it removes it; so does this run, in case */
    if (isdir) (void)rmdir(path);
    else (void)unlink(path);
    return EAGAIN;
  }
  if (r != 0) return 0;
  struct stat a, b;
  if (fstat(fd, &a) != 0) return errno;
  if (lstat(path, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino)
    return EAGAIN; /* a scan removed it before the lock was taken */
  *locked = 1;
  return 0;
}

/* Tries of a new temporary name when scans keep taking them. */
#define TMP_TRIES 16

bico_status bico__tmp_create_in(bico_ctx *ctx, const char *fn,
                                const char *what, const char *path,
                                const char *tmp, bico__tmpfile *t) {
  memset(t, 0, sizeof *t);
  t->fd = -1;
  t->path = bico__strdup(ctx, path);
  t->tmp = bico__strdup(ctx, tmp);
  if (t->path == NULL || t->tmp == NULL) {
    t->gone = 1;
    bico__tmp_discard(ctx, t);
    return BICO_E_NOMEM;
  }
  t->fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
               0600);
  if (t->fd < 0) {
    (void)fn; /* the message names the file, not the caller */
    bico_status s = bico__fail(ctx, BICO_E_IO,
                               "the %s %s: cannot create its new file: %s",
                               what, path, strerror(errno));
    t->gone = 1;
    bico__tmp_discard(ctx, t);
    return s;
  }
  return BICO_OK;
}

bico_status bico__tmp_folder(bico_ctx *ctx, const char *fn, const char *shown,
                             const char *path, bico__tmpfile *t) {
  memset(t, 0, sizeof *t);
  t->fd = -1;
  t->isdir = 1;
  const char *base = bico__base_of(path);
  size_t plen = strlen(path);
  size_t blen = strlen(base) > TMP_BASE_MAX ? TMP_BASE_MAX : strlen(base);
  size_t dcap = plen + 2, tcap = plen + blen + 64;
  char *dir = bico__alloc(ctx, dcap);
  t->path = bico__strdup(ctx, path);
  t->tmp = bico__alloc(ctx, tcap);
  t->aside = bico__alloc(ctx, tcap + 1);
  t->keptname = bico__alloc(ctx, tcap + 2);
  if (dir == NULL || t->path == NULL || t->tmp == NULL || t->aside == NULL ||
      t->keptname == NULL) {
    bico__free(ctx, dir);
    t->gone = 1;
    bico__tmp_discard(ctx, t);
    return BICO_E_NOMEM;
  }
  bico__dir_of(path, dir, dcap);
  remove_stale(dir, base, blen); /* once per folder and run */
  /* Made, then locked (held until the commit or the discard): a scan of
   * another run that takes the lock first removes it, and another is
   * made. */
  int e = EAGAIN;
  for (int tries = 0; tries < TMP_TRIES && e == EAGAIN; tries++) {
    snprintf(t->tmp, tcap, "%s/.%.*s%s%ld.XXXXXX", dir, (int)blen, base,
             BICO__TMP_MARK, (long)getpid());
    if (mkdtemp(t->tmp) == NULL) {
      e = errno;
      break;
    }
    int fd = open(t->tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int locked = 0;
    e = fd < 0 ? errno : lock_new(fd, t->tmp, 1, &locked);
    if (e == 0 && locked) t->lock = fd + 1;
    else if (fd >= 0) close(fd);
    if (e != 0 && e != EAGAIN) (void)rmdir(t->tmp);
  }
  if (e != 0) {
    bico_status s = bico__fail(
        ctx, BICO_E_IO,
        "%s: cannot write the output folder %s: its parent folder %s: %s%s",
        fn, shown, dir, e == ENOENT ? "does not exist" : strerror(e),
        e == ENOENT ? ""
                    : " (a model folder is built beside the output and "
                      "swapped in whole; write into a sub-folder of it, or "
                      "into a folder whose parent you can write)");
    bico__free(ctx, dir);
    t->gone = 1;
    bico__tmp_discard(ctx, t);
    return s;
  }
  /* the same form: a later run's leftover scan recognises it */
  snprintf(t->aside, tcap + 1, "%so", t->tmp);
  /* a kept old tree: a form that scan never removes */
  size_t pre = strlen(dir) + 2 + blen;
  snprintf(t->keptname, tcap + 2, "%.*s%s%s", (int)pre, t->tmp,
           BICO__KEPT_MARK, t->tmp + pre + strlen(BICO__TMP_MARK));
  bico__free(ctx, dir);
  return BICO_OK;
}

bico_status bico__tmp_create(bico_ctx *ctx, const char *fn, const char *what,
                             const char *path, bico__tmpfile *t) {
  memset(t, 0, sizeof *t);
  t->fd = -1;
  size_t plen = strlen(path);
  const char *base = bico__base_of(path);
  if (plen == 0 || base[0] == '\0' || strcmp(base, ".") == 0 ||
      strcmp(base, "..") == 0)
    return bico__fail(ctx, BICO_E_ARG, "%s: the %s '%s' names no file", fn,
                      what, path);
  struct stat st;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
    return bico__fail(ctx, BICO_E_ARG, "%s: the %s %s is a folder", fn, what,
                      path);
  size_t blen = strlen(base) > TMP_BASE_MAX ? TMP_BASE_MAX : strlen(base);
  size_t dcap = plen + 2, tcap = plen + blen + 64;
  char *dir = bico__alloc(ctx, dcap);
  t->path = bico__strdup(ctx, path);
  t->tmp = bico__alloc(ctx, tcap);
  if (dir == NULL || t->path == NULL || t->tmp == NULL) {
    bico__free(ctx, dir);
    bico__free(ctx, t->tmp);
    t->tmp = NULL;
    bico__tmp_discard(ctx, t);
    return BICO_E_NOMEM;
  }
  bico__dir_of(path, dir, dcap);
  remove_stale(dir, base, blen);
  /* Made, then locked on a second descriptor that outlives t->fd (closed
   * by bico__tmp_finish) until the commit or the discard; a scan of
   * another run that takes the lock first removes it, and another is
   * made. */
  int e = EAGAIN;
  for (int tries = 0; tries < TMP_TRIES && e == EAGAIN; tries++) {
    snprintf(t->tmp, tcap, "%s/.%.*s%s%ld.XXXXXX", dir, (int)blen, base,
             BICO__TMP_MARK, (long)getpid());
    t->fd = mkstemp(t->tmp);
    if (t->fd < 0) {
      e = errno;
      break;
    }
    (void)fcntl(t->fd, F_SETFD, FD_CLOEXEC);
    int locked = 0;
    e = lock_new(t->fd, t->tmp, 0, &locked);
    if (e == 0 && locked) {
      int l = fcntl(t->fd, F_DUPFD_CLOEXEC, 0);
      if (l < 0) e = errno;
      else t->lock = l + 1;
    }
    if (e != 0) {
      if (e != EAGAIN) (void)unlink(t->tmp);
      close(t->fd);
      t->fd = -1;
    }
  }
  if (e != 0) {
    bico_status s = bico__fail(ctx, BICO_E_IO,
                               "%s: the %s %s: cannot create a temporary file "
                               "in folder '%s': %s",
                               fn, what, path, dir, strerror(e));
    bico__free(ctx, dir);
    bico__free(ctx, t->tmp);
    t->tmp = NULL;
    bico__tmp_discard(ctx, t);
    return s;
  }
  bico__free(ctx, dir);
  return BICO_OK;
}

bico_status bico__tmp_write(bico_ctx *ctx, const char *fn, bico__tmpfile *t,
                            const void *buf, size_t len) {
  const unsigned char *p = buf;
  while (len > 0) {
    ssize_t w = write(t->fd, p, len);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      return bico__fail(ctx, BICO_E_IO,
                        "%s: %s: write failed: %s", fn, t->path,
                        w < 0 ? strerror(errno) : "no progress");
    p += w;
    len -= (size_t)w;
  }
  return BICO_OK;
}

bico_status bico__tmp_finish(bico_ctx *ctx, const char *fn, bico__tmpfile *t) {
  struct stat old;
  /* Permission bits only: a setuid/setgid/sticky destination must not
   * lend those bits to new content. */
  mode_t mode = t->setmode ? (t->mode & 0777)
                : stat(t->path, &old) == 0 && S_ISREG(old.st_mode)
                    ? (old.st_mode & 0777)
                    : (0666 & ~bico__umask());
  const char *step = NULL;
  if (fchmod(t->fd, mode) != 0)
    step = "chmod";
  else if (!t->nosync && fsync(t->fd) != 0)
    step = "fsync";
  int fd = t->fd;
  t->fd = -1;
  if (close(fd) != 0 && step == NULL) step = "close";
  if (step != NULL)
    return bico__fail(ctx, BICO_E_IO, "%s: %s: %s of the new file failed: %s",
                      fn, t->path, step, strerror(errno));
  return BICO_OK;
}

void bico__tmp_unlock(bico__tmpfile *t) {
  if (t->lock > 0) close(t->lock - 1);
  if (t->oldlock > 0) close(t->oldlock - 1);
  t->lock = t->oldlock = 0;
}

void bico__tmp_discard(bico_ctx *ctx, bico__tmpfile *t) {
  if (t->fd >= 0) close(t->fd);
  t->fd = -1;
  if (t->tmp != NULL && !t->gone) {
    if (t->isdir) (void)bico__remove_tree(t->tmp);
    else unlink(t->tmp);
  }
  bico__tmp_unlock(t); /* once it is gone */
  t->gone = 1;
  bico__free(ctx, t->tmp);
  bico__free(ctx, t->path);
  bico__free(ctx, t->aside);
  bico__free(ctx, t->keptname);
  t->tmp = t->path = t->aside = t->keptname = NULL;
}
