/* The commit: every output of a run renamed into place together, after
 * the inputs are checked unchanged, or none (lib/io/fileio.h). */
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

static void sync_dir(const char *path) {
  size_t cap = strlen(path) + 2;
  char *dir = malloc(cap);
  if (dir == NULL) return;
  bico__dir_of(path, dir, cap);
  int dfd = open(dir, O_RDONLY | O_CLOEXEC | O_DIRECTORY);
  free(dir);
  if (dfd < 0) return;
  (void)fsync(dfd); /* EINVAL/EROFS on some file systems: nothing to do */
  close(dfd);
}

/* Where a file path lies in folder d (device and inode), at any depth:
 * the offset of its part relative to d ("sub/r.json" of "out/sub/r.json"),
 * -1 when outside d, -2 without memory. */
static long rel_in(const char *file, const struct stat *d) {
  size_t n = strlen(file);
  char *p = malloc(n + 1);
  if (p == NULL) return -2;
  memcpy(p, file, n + 1);
  long off = -1;
  struct stat s;
  for (char *slash; off < 0 && (slash = strrchr(p, '/')) != NULL;) {
    *slash = '\0';
    if (stat(slash == p ? "/" : p, &s) == 0 && s.st_dev == d->st_dev &&
        s.st_ino == d->st_ino)
      off = (long)(slash - p) + 1;
    if (slash == p) break;
  }
  if (off < 0 && strchr(file, '/') == NULL && stat(".", &s) == 0 &&
      s.st_dev == d->st_dev && s.st_ino == d->st_ino)
    off = 0;
  free(p);
  return off;
}

/* A file entry whose destination lies in a folder entry's folder (or in
 * one of its sub-folders, carried into the new folder): moved (invisibly)
 * into the new folder, so that the swap brings it in. */
static bico_status into_folder(bico_ctx *ctx, const char *fn,
                               bico__tmpfile *const *t, size_t n) {
  for (size_t j = 0; j < n; j++) {
    struct stat ds;
    if (!t[j]->isdir || stat(t[j]->path, &ds) != 0 || !S_ISDIR(ds.st_mode))
      continue;
    for (size_t i = 0; i < n; i++) {
      if (t[i]->isdir || t[i]->gone) continue;
      long r = rel_in(t[i]->path, &ds);
      if (r == -2) return BICO_E_NOMEM;
      if (r < 0) continue;
      int dfd = open(t[j]->tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (dfd < 0 || renameat(AT_FDCWD, t[i]->tmp, dfd, t[i]->path + r) != 0) {
        int e = errno;
        if (dfd >= 0) close(dfd);
        return bico__fail(ctx, BICO_E_IO, "%s: %s: cannot move the new file "
                          "into the new folder %s: %s; nothing was written",
                          fn, t[i]->path, t[j]->path, strerror(e));
      }
      close(dfd);
      t[i]->gone = 1;
    }
  }
  return BICO_OK;
}

/* Every destination checked before anything is renamed. */
static bico_status commit_check(bico_ctx *ctx, const char *fn,
                                bico__tmpfile *const *t, size_t n) {
  for (size_t i = 0; i < n; i++) {
    struct stat ls, ts;
    if (t[i]->tmp == NULL || t[i]->gone || t[i]->fd >= 0)
      return bico__fail(ctx, BICO_E_INTERNAL, "%s: %s: temporary file not "
                        "finished", fn, t[i]->path);
    if (lstat(t[i]->path, &ls) != 0) continue;
    mode_t m = ls.st_mode;
    if (S_ISLNK(m) && stat(t[i]->path, &ts) == 0) m = ts.st_mode;
    if (t[i]->isdir && !S_ISDIR(m))
      return bico__fail(ctx, BICO_E_IO, "%s: the output folder %s is now %s, "
                        "not a folder; nothing was written", fn, t[i]->path,
                        S_ISREG(m) ? "a file" : bico__kind_of(m));
    if (!t[i]->isdir && !S_ISREG(m) && !S_ISLNK(m))
      return bico__fail(ctx, BICO_E_IO,
                        "%s: %s is %s, not a regular file; nothing was written",
                        fn, t[i]->path, bico__kind_of(m));
  }
  return BICO_OK;
}

bico_status bico__commit(bico_ctx *ctx, const char *fn, bico__tmpfile *const *t,
                         size_t n) {
  bico_status st = commit_check(ctx, fn, t, n);
  if (st == BICO_OK) st = into_folder(ctx, fn, t, n);
  for (size_t i = 0; i < n && st == BICO_OK; i++) {
    if (t[i]->gone) continue; /* moved into a new folder */
    int e = 0;
    if (t[i]->isdir) e = bico__swap_folder(t[i]);
    else if (rename(t[i]->tmp, t[i]->path) != 0) e = errno;
    if (e == EEXIST && t[i]->isdir) {
      st = bico__fail(ctx, BICO_E_IO, "the output folder %s appeared while "
                      "the run wrote it (there was none when it began); it "
                      "is left as it is and nothing was written", t[i]->path);
      break;
    }
    if (e != 0) {
      st = bico__fail(ctx, BICO_E_IO, "%s: %s: cannot move the new %s into "
                      "place: %s", fn, t[i]->path,
                      t[i]->isdir ? "folder" : "file", strerror(e));
      break;
    }
    t[i]->gone = 1;
    sync_dir(t[i]->path);
  }
  for (size_t i = 0; i < n; i++) {
    if (t[i]->isdir && t[i]->oldtree) {
      const char *old = t[i]->oldtree == 1 ? t[i]->tmp : t[i]->aside;
      /* carried: only what went into the new folder or was dropped on
       * purpose goes; replaced: everything (never another file system) */
      if (t[i]->carried != NULL) bico__retire_tree(t[i], old);
      else (void)bico__remove_tree(old);
    }
    t[i]->oldtree = 0;
    if (t[i]->tmp != NULL && !t[i]->gone) {
      if (t[i]->isdir) (void)bico__remove_tree(t[i]->tmp);
      else unlink(t[i]->tmp);
      t[i]->gone = 1;
    }
    /* nothing of this run is left under a temporary name */
    bico__tmp_unlock(t[i]);
  }
  return st;
}

bico_status bico__commit_lists(bico_ctx *ctx, const char *fn, bico_status st,
                               bico__tmpfile *const *a, size_t na,
                               bico__tmpfile *const *b, size_t nb,
                               bico__tmpfile *c) {
  if (st != BICO_OK) return st;
  bico__tmpfile **all = bico__alloc(ctx, (na + nb + 1) * sizeof *all);
  if (all == NULL) return BICO_E_NOMEM;
  size_t n = 0;
  for (size_t k = 0; k < na; k++) all[n++] = a[k];
  for (size_t k = 0; k < nb; k++) all[n++] = b[k];
  if (c != NULL) all[n++] = c;
  st = bico__commit(ctx, fn, all, n);
  bico__free(ctx, all);
  return st;
}
