/* bico_folder (include/bico/folder.h): a front end's output folders,
 * checked by the identity rule of the runs (bico__check_files), locked,
 * built beside and committed in one step through the library's folder
 * commit (lib/io/folder_guard.c, lib/io/folder_swap.c, bico__commit); its output
 * files checked by the same rule (the front end writes them). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fileio.h"

#define MAX_OUTPUTS 8

typedef struct finput {
  char *what, *path;
} finput;

typedef struct foutput {
  char *what, *dir;
  int policy;
  int opened; /* st was opened (begin) */
  bico__stage st;
  char **names; /* CARRY: the new folder's names at the commit, sorted */
  size_t nnames;
} foutput;

enum { ADDING, BEGUN, DONE };

struct bico_folder {
  bico_ctx *ctx;
  int state;
  finput *in;
  size_t nin, incap;
  finput *file; /* output files: checked, never written here */
  size_t nfile, filecap;
  foutput out[MAX_OUTPUTS];
  size_t nout;
};

static void free_names(bico_ctx *ctx, foutput *o) {
  for (size_t k = 0; k < o->nnames; k++) bico__free(ctx, o->names[k]);
  bico__free(ctx, o->names);
  o->names = NULL;
  o->nnames = 0;
}

bico_status bico_folder_create(bico_ctx *ctx, bico_folder **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL)
    return bico__fail(ctx, BICO_E_NULL, "folder_create: out is NULL");
  bico_folder *f = bico__calloc(ctx, 1, sizeof *f);
  if (f == NULL) return BICO_E_NOMEM;
  f->ctx = ctx;
  *out = f;
  return BICO_OK;
}

void bico_folder_free(bico_folder *f) {
  if (f == NULL) return;
  bico_ctx *ctx = f->ctx;
  for (size_t k = 0; k < f->nin; k++) {
    bico__free(ctx, f->in[k].what);
    bico__free(ctx, f->in[k].path);
  }
  bico__free(ctx, f->in);
  for (size_t k = 0; k < f->nfile; k++) {
    bico__free(ctx, f->file[k].what);
    bico__free(ctx, f->file[k].path);
  }
  bico__free(ctx, f->file);
  for (size_t k = 0; k < f->nout; k++) {
    foutput *o = &f->out[k];
    if (o->opened) bico__stage_free(ctx, &o->st);
    free_names(ctx, o);
    bico__free(ctx, o->what);
    bico__free(ctx, o->dir);
  }
  bico__free(ctx, f);
}

/* Copies of what (or dflt) and path; an adding handle, a path given. */
static bico_status add_check(bico_folder *f, const char *fn, const char *what,
                             const char *dflt, const char *path,
                             char **wcopy, char **pcopy) {
  bico_ctx *ctx = f->ctx;
  if (f->state != ADDING)
    return bico__fail(ctx, BICO_E_STATE, "%s: the folder handle has begun; "
                      "inputs and outputs are added before bico_folder_begin",
                      fn);
  if (path == NULL)
    return bico__fail(ctx, BICO_E_NULL, "%s: the path is NULL", fn);
  if (path[0] == '\0')
    return bico__fail(ctx, BICO_E_ARG, "%s: the %s path is empty", fn,
                      what ? what : dflt);
  *wcopy = bico__strdup(ctx, what ? what : dflt);
  *pcopy = bico__strdup(ctx, path);
  if (*wcopy == NULL || *pcopy == NULL) {
    bico__free(ctx, *wcopy);
    bico__free(ctx, *pcopy);
    return BICO_E_NOMEM;
  }
  return BICO_OK;
}

bico_status bico_folder_add_input(bico_folder *f, const char *what,
                                  const char *path) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  bico__clear(ctx);
  finput *g = bico__grow(ctx, f->in, f->nin, &f->incap, 8, sizeof *g);
  if (g == NULL) return BICO_E_NOMEM;
  f->in = g;
  char *w = NULL, *p = NULL;
  bico_status st = add_check(f, "folder_add_input", what, "input", path, &w,
                             &p);
  if (st != BICO_OK) return st;
  g[f->nin].what = w;
  g[f->nin].path = p;
  f->nin++;
  return BICO_OK;
}

bico_status bico_folder_add_file(bico_folder *f, const char *what,
                                 const char *path) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  bico__clear(ctx);
  finput *g = bico__grow(ctx, f->file, f->nfile, &f->filecap, 4, sizeof *g);
  if (g == NULL) return BICO_E_NOMEM;
  f->file = g;
  char *w = NULL, *p = NULL;
  bico_status st = add_check(f, "folder_add_file", what, "output file", path,
                             &w, &p);
  if (st != BICO_OK) return st;
  g[f->nfile].what = w;
  g[f->nfile].path = p;
  f->nfile++;
  return BICO_OK;
}

bico_status bico_folder_add_output(bico_folder *f, const char *what,
                                   const char *dir, int policy,
                                   size_t *index) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  bico__clear(ctx);
  if (policy == 0) policy = BICO_FOLDER_REFUSE;
  if (bico_folder_policy_name(policy) == NULL)
    return bico__fail(ctx, BICO_E_ARG, "folder_add_output: unknown policy %d "
                      "(refuse 1, replace 2, carry 3)", policy);
  if (f->state == ADDING && f->nout == MAX_OUTPUTS)
    return bico__fail(ctx, BICO_E_ARG, "folder_add_output: at most %d output "
                      "folders", MAX_OUTPUTS);
  char *w = NULL, *p = NULL;
  bico_status st = add_check(f, "folder_add_output", what, "output", dir, &w,
                             &p);
  if (st != BICO_OK) return st;
  foutput *o = &f->out[f->nout];
  memset(o, 0, sizeof *o);
  o->what = w;
  o->dir = p;
  o->policy = policy;
  if (index != NULL) *index = f->nout;
  f->nout++;
  return BICO_OK;
}

/* The first entry of an existing folder (into buf), or "" when empty. */
static void first_entry(const char *dir, char *buf, size_t cap) {
  buf[0] = '\0';
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d != NULL && (e = readdir(d)) != NULL)
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
      snprintf(buf, cap, "%s", e->d_name);
      break;
    }
  if (d != NULL) closedir(d);
}

/* Identity of every output (folders and files) against every input and
 * output (the runs' rule), before any lock: what the caller gave, as
 * given.  An input folder (or a model's index) counts as a model folder
 * the run reads: no output file lies directly in it. */
static bico_status check_identity(bico_folder *f) {
  bico_ctx *ctx = f->ctx;
  size_t n = f->nin + f->nout + f->nfile;
  bico__fileuse *u = bico__calloc(ctx, n ? n : 1, sizeof *u);
  if (u == NULL) return BICO_E_NOMEM;
  for (size_t k = 0; k < f->nin; k++)
    u[k] = (bico__fileuse){f->in[k].what, f->in[k].path, 0, 0, 3};
  for (size_t k = 0; k < f->nout; k++)
    u[f->nin + k] = (bico__fileuse){f->out[k].what, f->out[k].dir, 1, 1, 1};
  for (size_t k = 0; k < f->nfile; k++)
    u[f->nin + f->nout + k] =
        (bico__fileuse){f->file[k].what, f->file[k].path, 1, 0, 0};
  bico_status st = bico__check_files(ctx, "folder_begin", u, n);
  bico__free(ctx, u);
  return st;
}

bico_status bico_folder_begin(bico_folder *f) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  bico__clear(ctx);
  if (f->state != ADDING)
    return bico__fail(ctx, BICO_E_STATE, "folder_begin: the handle has "
                      "begun already");
  f->state = DONE; /* a failure leaves only free */
  bico_status st = check_identity(f);
  for (size_t k = 0; k < f->nout && st == BICO_OK; k++) {
    foutput *o = &f->out[k];
    o->opened = 1;
    st = bico__stage_open(ctx, "folder_begin", o->dir, 0, &o->st);
    char first[256];
    if (st == BICO_OK && o->st.exists && o->policy == BICO_FOLDER_REFUSE &&
        (first_entry(o->st.real, first, sizeof first), first[0] != '\0'))
      st = bico__fail(ctx, BICO_E_ARG,
                      "folder_begin: the %s folder %s is not empty (it holds "
                      "%s, among others); refusing to replace it (nothing "
                      "was written): write to a new or empty folder, or ask "
                      "for it to be replaced", o->what, o->dir, first);
  }
  for (size_t k = 0; k < f->nout && st != BICO_OK; k++)
    if (f->out[k].opened) {
      bico__stage_free(ctx, &f->out[k].st);
      f->out[k].opened = 0;
    }
  if (st == BICO_OK) f->state = BEGUN;
  return st;
}

static bico_status find_output(const bico_folder *f, const char *fn,
                               size_t index) {
  if (index >= f->nout)
    return bico__fail(f->ctx, BICO_E_ARG, "%s: output %zu of %zu", fn, index,
                      f->nout);
  return BICO_OK;
}

bico_status bico_folder_path(bico_folder *f, size_t index, const char **tmp) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  bico__clear(ctx);
  if (tmp == NULL)
    return bico__fail(ctx, BICO_E_NULL, "folder_path: tmp is NULL");
  *tmp = NULL;
  if (f->state != BEGUN)
    return bico__fail(ctx, BICO_E_STATE, "folder_path: %s",
                      f->state == ADDING ? "call bico_folder_begin first"
                                         : "the handle is committed (or "
                                           "failed)");
  bico_status st = find_output(f, "folder_path", index);
  foutput *o = &f->out[index];
  if (st == BICO_OK && o->st.t.tmp == NULL)
    st = bico__stage_make(ctx, "folder_path", &o->st);
  if (st == BICO_OK) *tmp = o->st.t.tmp;
  return st;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* What the old folder gives the new one: every entry whose name the new
 * folder does not hold (and no temporary of this library's runs). */
static int keep_unless_new(void *arg, const char *n) {
  const foutput *o = arg;
  if (n[0] == '.' && strstr(n, BICO__TMP_MARK) != NULL) return 0;
  return o->nnames == 0 ||
         bsearch(&n, o->names, o->nnames, sizeof *o->names, cmp_str) == NULL;
}

/* The new folder's names, sorted: the carry's rule is fixed before it
 * starts. */
static bico_status list_new(bico_ctx *ctx, foutput *o) {
  DIR *d = opendir(o->st.t.tmp);
  if (d == NULL)
    return bico__fail(ctx, BICO_E_IO, "folder_commit: the %s folder %s: its "
                      "new folder %s is gone: %s", o->what, o->dir,
                      o->st.t.tmp, strerror(errno));
  size_t cap = 0;
  bico_status st = BICO_OK;
  struct dirent *e;
  while (st == BICO_OK && (e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    char **g = bico__grow(ctx, o->names, o->nnames, &cap, 16, sizeof *g);
    if (g == NULL) {
      st = BICO_E_NOMEM;
      break;
    }
    o->names = g;
    if ((g[o->nnames] = bico__strdup(ctx, e->d_name)) == NULL)
      st = BICO_E_NOMEM;
    else
      o->nnames++;
  }
  closedir(d);
  if (st == BICO_OK && o->nnames > 1)
    qsort(o->names, o->nnames, sizeof *o->names, cmp_str);
  return st;
}

bico_status bico_folder_commit(bico_folder *f) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  bico__clear(ctx);
  if (f->state != BEGUN)
    return bico__fail(ctx, BICO_E_STATE, "folder_commit: %s",
                      f->state == ADDING ? "call bico_folder_begin first"
                                         : "the handle is committed (or "
                                           "failed)");
  f->state = DONE;
  bico__tmpfile *list[MAX_OUTPUTS];
  size_t n = 0;
  bico_status st = BICO_OK;
  for (size_t k = 0; k < f->nout && st == BICO_OK; k++) {
    foutput *o = &f->out[k];
    if (o->st.t.tmp == NULL) continue; /* not written through the handle */
    int carry = o->policy != BICO_FOLDER_REPLACE;
    if (carry) st = list_new(ctx, o);
    if (st == BICO_OK)
      st = bico__stage_finish(ctx, "folder_commit", &o->st,
                              carry ? keep_unless_new : NULL, o);
    list[n++] = &o->st.t;
  }
  if (st == BICO_OK) st = bico__commit(ctx, "folder_commit", list, n);
  /* what was not swapped in goes with free */
  return st;
}

bico_status bico_folder_kept(const bico_folder *f, size_t index,
                             const char **path) {
  if (f == NULL) return BICO_E_NULL;
  if (path == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "folder_kept: path is NULL");
  *path = NULL;
  bico_status st = find_output(f, "folder_kept", index);
  if (st == BICO_OK && f->out[index].st.t.kept)
    *path = f->out[index].st.t.keptname;
  return st;
}
