/* Identity: every input and output of a run compared by device and inode
 * whatever the spelling, and the destinations a run may never write (an
 * input, a folder holding one, ...), checked before anything is written
 * (bico__check_files, lib/io/fileio.h). */
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
  bico__dir_of(path, dir, cap);
  if (stat(dir, &st) == 0 && S_ISDIR(st.st_mode)) {
    f->dir_known = 1;
    f->ddev = st.st_dev;
    f->dino = st.st_ino;
  }
  free(dir);
  f->name = bico__base_of(path);
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
  const char *base = bico__base_of(u->path);
  if (base[0] == '\0' || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
    return bico__fail(ctx, BICO_E_ARG, "%s: the %s '%s' names no file", fn,
                      u->what, u->path);
  if (lstat(u->path, &ls) == 0) {
    mode_t m = S_ISLNK(ls.st_mode) && f->exists ? f->mode : ls.st_mode;
    if (!S_ISREG(m) && !S_ISLNK(m))
      return bico__fail(ctx, BICO_E_ARG,
                        "%s: the %s %s is %s; outputs must be regular files "
                        "(nothing was written)",
                        fn, u->what, u->path, bico__kind_of(m));
  }
  if (!f->dir_known && !u->newdir)
    return bico__fail(ctx, BICO_E_IO,
                      "%s: the %s %s: its folder does not exist (nothing was "
                      "written)",
                      fn, u->what, u->path);
  return BICO_OK;
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
  if (dir != NULL) bico__dir_of(t, dir, cap);
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
    if (up != NULL) bico__dir_of(q, up, cap);
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
                        fn, o->what, o->path, bico__kind_of(fo[k]->mode));
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
          strcmp(bico__base_of(u[i].path), "model.safetensors.index.json") != 0)
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
