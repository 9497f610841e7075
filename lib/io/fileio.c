/* File plumbing: strings, non-blocking inputs, identity, atomic commit. */
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

char *bico__strndup(bico_ctx *ctx, const char *s, size_t n) {
  char *p = bico__alloc(ctx, n + 1);
  if (p == NULL) return NULL;
  memcpy(p, s, n);
  p[n] = '\0';
  return p;
}

char *bico__strdup(bico_ctx *ctx, const char *s) {
  return bico__strndup(ctx, s, strlen(s));
}

char *bico__path_join(bico_ctx *ctx, const char *dir, const char *file) {
  size_t a = strlen(dir), b = strlen(file);
  char *p = bico__alloc(ctx, a + b + 2);
  if (p == NULL) return NULL;
  memcpy(p, dir, a);
  size_t o = a;
  if (a == 0 || dir[a - 1] != '/') p[o++] = '/';
  memcpy(p + o, file, b + 1);
  return p;
}

static const char *kind_of(mode_t m) {
  if (S_ISREG(m)) return "a file";
  if (S_ISDIR(m)) return "a folder";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISLNK(m)) return "a symbolic link";
  return "of another type";
}

bico_status bico__open_input(bico_ctx *ctx, const char *fn, const char *path,
                             int *fd, uint64_t *size) {
  *fd = -1;
  /* O_NONBLOCK: opening a FIFO without a writer would wait forever. */
  int d = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (d < 0)
    return bico__fail(ctx, BICO_E_IO, "%s: %s: cannot open: %s", fn, path,
                      strerror(errno));
  struct stat st;
  if (fstat(d, &st) != 0) {
    int e = errno;
    close(d);
    return bico__fail(ctx, BICO_E_IO, "%s: %s: cannot stat: %s", fn, path,
                      strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(d);
    return bico__fail(ctx, BICO_E_IO, "%s: %s is %s, not a regular file", fn,
                      path, kind_of(st.st_mode));
  }
  int fl = fcntl(d, F_GETFL);
  if (fl >= 0) (void)fcntl(d, F_SETFL, fl & ~O_NONBLOCK);
  *fd = d;
  if (size) *size = (uint64_t)st.st_size;
  return BICO_OK;
}

int bico__pread_all(int fd, void *buf, size_t n, uint64_t off) {
  unsigned char *p = buf;
  while (n > 0) {
    ssize_t r = pread(fd, p, n, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) return EIO;
    p += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return 0;
}

bico_status bico__read_file(bico_ctx *ctx, const char *fn, const char *what,
                            const char *path, size_t limit, char **out,
                            size_t *len) {
  *out = NULL;
  *len = 0;
  int fd;
  uint64_t size;
  bico_status st = bico__open_input(ctx, fn, path, &fd, &size);
  if (st != BICO_OK) return st;
  if (size > (uint64_t)limit) {
    close(fd);
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: %s: %s of %llu bytes exceeds the limit of %zu bytes",
                      fn, path, what, (unsigned long long)size, limit);
  }
  size_t n = (size_t)size;
  char *buf = bico__alloc(ctx, n + 1);
  if (buf == NULL) {
    close(fd);
    return BICO_E_NOMEM;
  }
  int e = bico__pread_all(fd, buf, n, 0);
  close(fd);
  if (e != 0) {
    bico__free(ctx, buf);
    return bico__fail(ctx, BICO_E_IO, "%s: %s: read failed: %s", fn, path,
                      e == EIO ? "the file shrank while being read"
                               : strerror(e));
  }
  buf[n] = '\0';
  *out = buf;
  *len = n;
  return BICO_OK;
}

/* ---- identity ---- */

/* The folder part of path ("." when none; "/" for "/x") into buf. */
static void dir_of(const char *path, char *buf, size_t cap) {
  const char *slash = strrchr(path, '/');
  if (slash == NULL)
    snprintf(buf, cap, ".");
  else if (slash == path)
    snprintf(buf, cap, "/");
  else
    snprintf(buf, cap, "%.*s", (int)(slash - path), path);
}

static const char *base_of(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

typedef struct fid {
  int exists, dir_known;
  dev_t dev, ddev;
  ino_t ino, dino;
  mode_t mode;      /* after following links */
  const char *name; /* base name, inside the path */
} fid;

static void fid_of(const char *path, fid *f) {
  memset(f, 0, sizeof *f);
  struct stat st;
  if (stat(path, &st) == 0) {
    f->exists = 1;
    f->dev = st.st_dev;
    f->ino = st.st_ino;
    f->mode = st.st_mode;
  }
  size_t cap = strlen(path) + 2;
  char *dir = malloc(cap);
  if (dir == NULL) return;
  dir_of(path, dir, cap);
  if (stat(dir, &st) == 0 && S_ISDIR(st.st_mode)) {
    f->dir_known = 1;
    f->ddev = st.st_dev;
    f->dino = st.st_ino;
  }
  free(dir);
  f->name = base_of(path);
}

static int fid_same(const fid *a, const fid *b) {
  if (a->exists && b->exists && a->dev == b->dev && a->ino == b->ino) return 1;
  return a->dir_known && b->dir_known && a->ddev == b->ddev &&
         a->dino == b->dino && strcmp(a->name, b->name) == 0;
}

/* An output's destination: a regular file, a dangling link (replaced) or
 * nothing, in an existing folder. */
static bico_status check_dest(bico_ctx *ctx, const char *fn,
                              const bico__fileuse *u, const fid *f) {
  struct stat ls;
  const char *base = base_of(u->path);
  if (base[0] == '\0' || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
    return bico__fail(ctx, BICO_E_ARG, "%s: the %s '%s' names no file", fn,
                      u->what, u->path);
  if (lstat(u->path, &ls) == 0) {
    mode_t m = S_ISLNK(ls.st_mode) && f->exists ? f->mode : ls.st_mode;
    if (!S_ISREG(m) && !S_ISLNK(m))
      return bico__fail(ctx, BICO_E_ARG,
                        "%s: the %s %s is %s; outputs must be regular files "
                        "(nothing was written)",
                        fn, u->what, u->path, kind_of(m));
  }
  if (!f->dir_known && !u->newdir)
    return bico__fail(ctx, BICO_E_IO,
                      "%s: the %s %s: its folder does not exist (nothing was "
                      "written)",
                      fn, u->what, u->path);
  return BICO_OK;
}

char *bico__trim_slashes(const char *path) {
  size_t n = strlen(path);
  while (n > 1 && path[n - 1] == '/') n--;
  char *p = malloc(n + 1);
  if (p != NULL) {
    memcpy(p, path, n);
    p[n] = '\0';
  }
  return p;
}

/* The folder an entry really lies in: the folder part of its path, after
 * following the path's own final symbolic link (a link elsewhere that
 * leads into a folder lies in that folder).  malloc'd; NULL when out of
 * memory. */
static char *real_parent(const char *path) {
  char *t = bico__trim_slashes(path);
  if (t == NULL) return NULL;
  struct stat ls;
  if (lstat(t, &ls) == 0 && S_ISLNK(ls.st_mode)) {
    char *rp = realpath(t, NULL);
    if (rp != NULL) {
      free(t);
      t = rp;
    }
  }
  size_t cap = strlen(t) + 2;
  char *dir = malloc(cap);
  if (dir != NULL) dir_of(t, dir, cap);
  free(t);
  return dir;
}

/* Bit k set when folder `dir`, or a folder above it, is the existing folder
 * of fo[k] (device and inode; ".." followed by the kernel, so links and
 * mount points are taken as they are).  *start gets dir's own identity
 * (st_ino 0 when it cannot be read). */
static unsigned long within(const char *dir, const fid *const *fo, size_t nfo,
                            struct stat *start) {
  unsigned long m = 0;
  memset(start, 0, sizeof *start);
  size_t len = strlen(dir), cap = len + 3 * 256 + 4;
  char *p = malloc(cap);
  if (p == NULL) return 0;
  memcpy(p, dir, len + 1);
  struct stat st, prev;
  for (int depth = 0; depth < 256; depth++) {
    if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode)) break;
    if (depth == 0) *start = st;
    if (depth > 0 && st.st_dev == prev.st_dev && st.st_ino == prev.st_ino)
      break; /* "/..": the root */
    for (size_t k = 0; k < nfo; k++)
      if (fo[k]->exists && st.st_dev == fo[k]->dev && st.st_ino == fo[k]->ino)
        m |= 1ul << k;
    prev = st;
    memcpy(p + len, "/..", 4);
    len += 3;
  }
  free(p);
  return m;
}

/* Bit k set when the folder path `dir`, which does not exist yet, lies in
 * fo[k], a folder output that does not exist yet either (both are made by
 * the run): the names are compared from the deepest existing folder up,
 * by that folder's identity and the name below it. */
static unsigned long within_new(const char *dir, const fid *const *fo,
                                size_t nfo) {
  unsigned long m = 0;
  int any = 0;
  for (size_t k = 0; k < nfo; k++) any |= !fo[k]->exists;
  if (!any) return 0;
  char *q = bico__trim_slashes(dir);
  for (int depth = 0; q != NULL && depth < 256; depth++) {
    fid f;
    fid_of(q, &f);
    if (f.exists) break;
    for (size_t k = 0; k < nfo; k++)
      if (!fo[k]->exists && fid_same(&f, fo[k])) m |= 1ul << k;
    if (f.dir_known) break; /* the deepest existing folder was reached */
    size_t cap = strlen(q) + 2;
    char *up = malloc(cap);
    if (up != NULL) dir_of(q, up, cap);
    int same = up != NULL && strcmp(up, q) == 0;
    free(q);
    q = up;
    if (same) break;
    char *t = q ? bico__trim_slashes(q) : NULL;
    free(q);
    q = t;
  }
  free(q);
  return m;
}

/* Folder outputs against every other entry: none may be the same folder
 * as another entry, nor hold one (at any depth). */
static bico_status check_folders(bico_ctx *ctx, const char *fn,
                                 const bico__fileuse *u, const fid *ids,
                                 size_t n) {
  enum { MAXF = 8 };
  const fid *fo[MAXF];
  size_t fi[MAXF], nfo = 0;
  for (size_t i = 0; i < n; i++)
    if (u[i].path != NULL && u[i].output && u[i].folder == 1) {
      if (nfo == MAXF)
        return bico__fail(ctx, BICO_E_INTERNAL, "%s: too many output folders",
                          fn);
      fi[nfo] = i;
      fo[nfo++] = &ids[i];
    }
  if (nfo == 0) return BICO_OK;
  /* An existing folder output must be a folder. */
  for (size_t k = 0; k < nfo; k++) {
    const bico__fileuse *o = &u[fi[k]];
    if (fo[k]->exists && !S_ISDIR(fo[k]->mode))
      return bico__fail(ctx, BICO_E_ARG,
                        "%s: the %s folder %s exists and is %s, not a folder "
                        "(nothing was written)",
                        fn, o->what, o->path, kind_of(fo[k]->mode));
  }
  struct stat last;
  unsigned long lastm = 0;
  int have_last = 0;
  for (size_t j = 0; j < n; j++) {
    if (u[j].path == NULL || (u[j].output && u[j].folder == 2)) continue;
    /* The same folder as another entry (an input named by its folder, or
     * a second folder output). */
    for (size_t k = 0; k < nfo; k++) {
      if (fi[k] == j) continue;
      const fid *a = fo[k], *b = &ids[j];
      int same = a->exists && b->exists && a->dev == b->dev && a->ino == b->ino;
      if (!same && !a->exists && u[j].output && u[j].folder == 1 &&
          fi[k] < j)
        same = fid_same(a, b); /* two new folders of one name */
      if (!same) continue;
      const bico__fileuse *o = &u[fi[k]], *x = &u[j];
      return bico__fail(ctx, BICO_E_ARG,
                        "%s: the %s folder %s is the same folder as the %s "
                        "%s; refusing to write into %s (nothing was written)",
                        fn, o->what, o->path, x->what, x->path,
                        x->output ? "one output's folder with another"
                                  : "a folder the run reads");
    }
    /* Inside a folder output: by the real folder the entry lies in. */
    char *dir = real_parent(u[j].path);
    if (dir == NULL) return BICO_E_NOMEM;
    struct stat ds;
    unsigned long m;
    if (have_last && stat(dir, &ds) == 0 && ds.st_dev == last.st_dev &&
        ds.st_ino == last.st_ino) {
      m = lastm; /* the shards of one folder: walked once */
    } else {
      m = within(dir, fo, nfo, &last);
      lastm = m;
      have_last = last.st_ino != 0;
    }
    if (u[j].output) m |= within_new(dir, fo, nfo);
    free(dir);
    for (size_t k = 0; k < nfo && m != 0; k++) {
      if (!(m & (1ul << k)) || fi[k] == j) continue;
      const bico__fileuse *o = &u[fi[k]], *x = &u[j];
      if (x->output)
        return bico__fail(ctx, BICO_E_ARG,
                          "%s: the %s %s lies inside the %s folder %s, which "
                          "the run writes as a whole; write the %s outside "
                          "that folder (nothing was written)",
                          fn, x->what, x->path, o->what, o->path, x->what);
      return bico__fail(ctx, BICO_E_ARG,
                        "%s: the %s folder %s holds the %s %s, an input of "
                        "the run; writing the folder would replace or remove "
                        "it: write to another folder (nothing was written)",
                        fn, o->what, o->path, x->what, x->path);
    }
  }
  return BICO_OK;
}

/* Any output, a file or a folder, lying at any depth inside a folder the
 * run reads (an input given as a folder: a model, an adapter): the run
 * would put its files among the user's inputs.  (A folder output holding
 * an input is check_folders'.)  Input folders in groups of the mask's
 * width. */
static bico_status check_inside_inputs(bico_ctx *ctx, const char *fn,
                                       const bico__fileuse *u,
                                       const fid *ids, size_t n) {
  enum { GROUP = 8 * sizeof(unsigned long) };
  const fid *in[GROUP];
  size_t at[GROUP];
  for (size_t i = 0; i < n;) {
    size_t k = 0;
    for (; i < n && k < GROUP; i++)
      if (u[i].path != NULL && !u[i].output && ids[i].exists &&
          S_ISDIR(ids[i].mode)) {
        in[k] = &ids[i];
        at[k++] = i;
      }
    for (size_t j = 0; j < n && k > 0; j++) {
      if (u[j].path == NULL || !u[j].output || u[j].folder == 2) continue;
      char *dir = real_parent(u[j].path);
      if (dir == NULL) return BICO_E_NOMEM;
      struct stat start;
      unsigned long m = within(dir, in, k, &start);
      free(dir);
      for (size_t b = 0; b < k; b++)
        if (m & (1ul << b))
          return bico__fail(ctx, BICO_E_ARG,
                            "%s: the %s %s lies inside the %s folder %s, "
                            "which the run reads; write the %s outside that "
                            "folder (nothing was written)",
                            fn, u[j].what, u[j].path, u[at[b]].what,
                            u[at[b]].path, u[j].what);
    }
  }
  return BICO_OK;
}

/* Output files lying directly in a model folder the run reads (an input
 * with `folder` 3): its index, config.json, tokenizer, README are the
 * user's model. */
static bico_status check_input_folders(bico_ctx *ctx, const char *fn,
                                       const bico__fileuse *u, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (u[i].path == NULL || u[i].output || u[i].folder != 3) continue;
    struct stat fs;
    if (stat(u[i].path, &fs) != 0) continue;
    if (!S_ISDIR(fs.st_mode)) {
      /* a model given by a Hugging Face folder's index: that folder holds
       * the model (another index name may sit among unrelated files) */
      if (!S_ISREG(fs.st_mode) ||
          strcmp(base_of(u[i].path), "model.safetensors.index.json") != 0)
        continue;
      char *mdir = real_parent(u[i].path);
      if (mdir == NULL) return BICO_E_NOMEM;
      int ok = stat(mdir, &fs) == 0 && S_ISDIR(fs.st_mode);
      free(mdir);
      if (!ok) continue;
    }
    for (size_t j = 0; j < n; j++) {
      if (u[j].path == NULL || !u[j].output || u[j].folder == 1) continue;
      char *dir = real_parent(u[j].path);
      if (dir == NULL) return BICO_E_NOMEM;
      struct stat ds;
      int in = stat(dir, &ds) == 0 && ds.st_dev == fs.st_dev &&
               ds.st_ino == fs.st_ino;
      free(dir);
      if (in)
        return bico__fail(ctx, BICO_E_ARG,
                          "%s: the %s %s lies inside the model folder of the "
                          "%s %s, which the run reads; write the %s outside "
                          "that folder (nothing was written)",
                          fn, u[j].what, u[j].path, u[i].what, u[i].path,
                          u[j].what);
    }
  }
  return BICO_OK;
}

bico_status bico__check_files(bico_ctx *ctx, const char *fn,
                              const bico__fileuse *u, size_t n) {
  if (n == 0) return BICO_OK;
  fid *ids = bico__alloc(ctx, n * sizeof *ids);
  char **trim = bico__calloc(ctx, n, sizeof *trim);
  if (ids == NULL || trim == NULL) {
    bico__free(ctx, ids);
    bico__free(ctx, trim);
    return BICO_E_NOMEM;
  }
  bico_status st = BICO_OK;
  for (size_t i = 0; i < n && st == BICO_OK; i++) {
    if (u[i].path == NULL) continue;
    if (u[i].output && u[i].folder == 1) {
      /* a folder: "o/" is "o" (its name in its parent) */
      if ((trim[i] = bico__trim_slashes(u[i].path)) == NULL) st = BICO_E_NOMEM;
      else fid_of(trim[i], &ids[i]);
    } else {
      fid_of(u[i].path, &ids[i]);
    }
  }
  if (st == BICO_OK) st = check_folders(ctx, fn, u, ids, n);
  for (size_t i = 0; i < n && st == BICO_OK; i++)
    if (u[i].path != NULL && u[i].output && u[i].folder != 1)
      st = check_dest(ctx, fn, &u[i], &ids[i]);
  /* Each file output against every other entry: outputs are few, inputs
   * may be 100k shards, so this stays linear in the inputs. */
  for (size_t i = 0; i < n && st == BICO_OK; i++) {
    if (u[i].path == NULL || !u[i].output || u[i].folder == 1) continue;
    for (size_t j = 0; j < n && st == BICO_OK; j++) {
      if (j == i || u[j].path == NULL || (u[j].output && j < i) ||
          (u[j].output && u[j].folder == 1))
        continue;
      if (!fid_same(&ids[i], &ids[j])) continue;
      const bico__fileuse *o = &u[i], *x = &u[j];
      st = bico__fail(ctx, BICO_E_ARG,
                      "%s: the %s %s is the same file as the %s %s; refusing "
                      "to overwrite %s (nothing was written)",
                      fn, o->what, o->path, x->what, x->path,
                      x->output ? "one output with another" : "an input");
    }
  }
  /* after the file identities: "the same file as" says more */
  if (st == BICO_OK) st = check_input_folders(ctx, fn, u, n);
  if (st == BICO_OK) st = check_inside_inputs(ctx, fn, u, ids, n);
  for (size_t i = 0; i < n; i++) free(trim[i]);
  bico__free(ctx, trim);
  bico__free(ctx, ids);
  return st;
}

/* ---- temporary files ---- */

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
  const char *base = base_of(path);
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
  dir_of(path, dir, dcap);
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
  const char *base = base_of(path);
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
  dir_of(path, dir, dcap);
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

static void sync_dir(const char *path) {
  size_t cap = strlen(path) + 2;
  char *dir = malloc(cap);
  if (dir == NULL) return;
  dir_of(path, dir, cap);
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
                        S_ISREG(m) ? "a file" : kind_of(m));
    if (!t[i]->isdir && !S_ISREG(m) && !S_ISLNK(m))
      return bico__fail(ctx, BICO_E_IO,
                        "%s: %s is %s, not a regular file; nothing was written",
                        fn, t[i]->path, kind_of(m));
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

const char *bico__shape_text(char *buf, size_t cap, size_t ndim,
                             const size_t *shape) {
  size_t n = 0;
  if (cap == 0) return buf;
  buf[0] = '\0';
  n += (size_t)snprintf(buf, cap, "[");
  for (size_t d = 0; d < ndim && n < cap; d++)
    n += (size_t)snprintf(buf + n, cap - n, "%s%zu", d ? ", " : "", shape[d]);
  if (n < cap) n += (size_t)snprintf(buf + n, cap - n, "]");
  if (n >= cap && cap > 4) memcpy(buf + cap - 4, "...", 4);
  return buf;
}
