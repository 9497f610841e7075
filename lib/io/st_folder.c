/* safetensors writer: Hugging Face model folders as outputs (the shard
 * plan, the index, the target's other files copied, the user's files of
 * the old folder carried over), built in a temporary sibling folder that
 * the commit swaps in whole (lib/io/fileio.h, lib/io/folder_swap.c).  The tensor
 * side lives in lib/io/st_writer.c; this file owns the folder. */
#define _DEFAULT_SOURCE 1 /* realpath */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "st_internal.h"

#define INDEX_NAME "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"

/* A file of the like folder to copy: its name, the file read (the real
 * path of a link) and its permission bits. */
typedef struct wcopy {
  char *name, *src;
  mode_t mode;
} wcopy;

struct bico__wfolder {
  bico__stage st; /* the output folder, its lock and its new folder */
  bico_stfile *like;  /* the model whose shard layout is followed */
  char *likedir;      /* its folder, whose other files are copied */
  char **likew;       /* the like model's weight files (base names) */
  size_t nlikew;
  wcopy *copies;
  size_t ncopies, copycap;
  uint64_t max_shard; /* bytes; 0: as like (or one file) */
  bico__tmpfile *extra; /* index and copied files */
  size_t nextra, extracap;
  char **made; /* sorted names the writer produces */
  size_t nmade;
  char **drop; /* sorted weight names of the old folder not carried */
  size_t ndrop, dropcap;
  bico__tmpfile **list;
};

static int ends_with(const char *s, const char *suf) {
  size_t n = strlen(s), m = strlen(suf);
  return n >= m && strcmp(s + n - m, suf) == 0;
}

int bico_stwriter_output_is_folder(const char *output, const char *like) {
  if (output == NULL || output[0] == '\0') return 0;
  struct stat st;
  if (stat(output, &st) == 0) return S_ISDIR(st.st_mode);
  if (output[strlen(output) - 1] == '/') return 1;
  return like != NULL && stat(like, &st) == 0 && S_ISDIR(st.st_mode) &&
         !ends_with(output, ".safetensors") && !ends_with(output, ".json");
}

/* Weights and their indexes, in any format a model folder holds them:
 * never copied from the target, since the output replaces them. */
static int is_weight_name(const char *n) {
  static const char *const SUF[] = {".safetensors", ".bin", ".pt", ".pth",
                                    ".ckpt", ".h5", ".msgpack", ".gguf",
                                    ".onnx", ".index.json"};
  for (size_t k = 0; k < sizeof SUF / sizeof *SUF; k++)
    if (ends_with(n, SUF[k])) return 1;
  return 0;
}

/* "model-00001-of-00003.safetensors": the names this writer (and Hugging
 * Face) give shards. */
static int is_shard_name(const char *n) {
  unsigned a, b;
  int end = 0;
  return sscanf(n, "model-%5u-of-%5u.safetensors%n", &a, &b, &end) == 2 &&
         n[end] == '\0';
}

static void free_names(bico_ctx *ctx, char **v, size_t n) {
  for (size_t k = 0; v != NULL && k < n; k++) bico__free(ctx, v[k]);
  bico__free(ctx, v);
}

void bico__wfolder_free(bico_ctx *ctx, bico__wfolder *f) {
  if (f == NULL) return;
  for (size_t k = 0; k < f->nextra; k++) bico__tmp_discard(ctx, &f->extra[k]);
  bico__free(ctx, f->extra);
  for (size_t k = 0; k < f->ncopies; k++) {
    bico__free(ctx, f->copies[k].name);
    bico__free(ctx, f->copies[k].src);
  }
  bico__free(ctx, f->copies);
  free_names(ctx, f->likew, f->nlikew);
  free_names(ctx, f->made, f->nmade);
  free_names(ctx, f->drop, f->ndrop);
  bico__free(ctx, f->list);
  bico_stfile_free(f->like);
  bico__stage_free(ctx, &f->st); /* the new folder, unless committed */
  bico__free(ctx, f->likedir);
  bico__free(ctx, f);
}

static int cmp_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int in_sorted(char *const *v, size_t n, const char *name) {
  return n > 0 && bsearch(&name, v, n, sizeof *v, cmp_name) != NULL;
}

/* Appends a copy of name to *v (n entries, capacity *cap). */
static bico_status push_name(bico_ctx *ctx, char ***v, size_t *n, size_t *cap,
                             const char *name) {
  char **g = bico__grow(ctx, *v, *n, cap, 16, sizeof *g);
  if (g == NULL) return BICO_E_NOMEM;
  *v = g;
  if ((g[*n] = bico__strdup(ctx, name)) == NULL) return BICO_E_NOMEM;
  (*n)++;
  return BICO_OK;
}

/* real lies inside folder (both real paths). */
static int inside(const char *real, const char *folder) {
  size_t n = strlen(folder);
  return strncmp(real, folder, n) == 0 &&
         (real[n] == '/' || (n > 0 && folder[n - 1] == '/'));
}

/* Where links of the like folder may lead besides the folder: a Hugging
 * Face cache snapshot (.../snapshots/<rev>/) links into ../../blobs/. */
static char *blobs_of(bico_ctx *ctx, const char *lreal) {
  const char *s = strrchr(lreal, '/');
  if (s == NULL || s == lreal) return NULL;
  size_t pn = (size_t)(s - lreal); /* lreal[0, pn): .../snapshots */
  static const char SN[] = "/snapshots";
  if (pn < sizeof SN - 1 || memcmp(lreal + pn - (sizeof SN - 1), SN,
                                   sizeof SN - 1) != 0)
    return NULL;
  char *b = bico__alloc(ctx, pn + 8);
  if (b == NULL) return NULL;
  snprintf(b, pn + 8, "%.*sblobs", (int)(pn - (sizeof SN - 2)), lreal);
  char *r = realpath(b, NULL);
  bico__free(ctx, b);
  char *out = r ? bico__strdup(ctx, r) : NULL;
  free(r);
  return out;
}

/* One entry of the like folder: copied (a regular file, or a link whose
 * real path stays inside the folder or in the cache's blobs), skipped
 * (folders, dangling links, special files) or refused (a link out). */
static bico_status plan_one(bico_ctx *ctx, bico__wfolder *f, const char *nm,
                            const char *lreal, const char *blobs) {
  char *p = bico__path_join(ctx, f->likedir, nm);
  if (p == NULL) return BICO_E_NOMEM;
  struct stat ls, ss;
  bico_status st = BICO_OK;
  char *src = NULL;
  if (lstat(p, &ls) != 0) {
  } else if (S_ISLNK(ls.st_mode)) {
    char *r = realpath(p, NULL);
    if (r != NULL && !inside(r, lreal) && (blobs == NULL || !inside(r, blobs)))
      st = bico__fail(ctx, BICO_E_IO,
                      "the model folder %s: %s is a symbolic link to %s, "
                      "outside the folder; refusing to copy it into the "
                      "output (nothing was written)",
                      f->likedir, nm, r);
    else if (r != NULL && stat(r, &ss) == 0 && S_ISREG(ss.st_mode) &&
             (src = bico__strdup(ctx, r)) == NULL)
      st = BICO_E_NOMEM;
    free(r);
  } else if (S_ISREG(ls.st_mode)) {
    ss = ls;
    src = p;
    p = NULL;
  }
  if (st == BICO_OK && src != NULL) {
    wcopy *c = bico__grow(ctx, f->copies, f->ncopies, &f->copycap, 16,
                          sizeof *c);
    if (c == NULL) st = BICO_E_NOMEM;
    else {
      f->copies = c;
      c[f->ncopies].src = src;
      c[f->ncopies].mode = ss.st_mode & 0777; /* never setuid/setgid/sticky */
      c[f->ncopies].name = bico__strdup(ctx, nm);
      src = NULL;
      if (c[f->ncopies++].name == NULL) st = BICO_E_NOMEM;
    }
  }
  bico__free(ctx, src);
  bico__free(ctx, p);
  return st;
}

/* The like folder's files to copy, checked before anything is written:
 * not hidden, not weights, not a file the like model's index names as a
 * shard. */
static bico_status plan_copies(bico_ctx *ctx, bico__wfolder *f) {
  size_t cap = 0;
  for (size_t k = 0; k < f->like->nfiles; k++) {
    const char *p = f->like->files[k].path, *b = strrchr(p, '/');
    bico_status st = push_name(ctx, &f->likew, &f->nlikew, &cap, b ? b + 1 : p);
    if (st != BICO_OK) return st;
  }
  if (f->nlikew > 1) qsort(f->likew, f->nlikew, sizeof *f->likew, cmp_name);
  char *lreal = realpath(f->likedir, NULL);
  if (lreal == NULL)
    return bico__fail(ctx, BICO_E_IO, "the model folder %s: %s", f->likedir,
                      strerror(errno));
  char *blobs = blobs_of(ctx, lreal);
  DIR *d = opendir(f->likedir);
  bico_status st = BICO_OK;
  if (d == NULL)
    st = bico__fail(ctx, BICO_E_IO, "cannot list the model folder %s: %s",
                    f->likedir, strerror(errno));
  struct dirent *e;
  while (st == BICO_OK && (e = readdir(d)) != NULL) {
    const char *nm = e->d_name;
    if (nm[0] == '.' || is_weight_name(nm) ||
        in_sorted(f->likew, f->nlikew, nm))
      continue;
    st = plan_one(ctx, f, nm, lreal, blobs);
  }
  if (d != NULL) closedir(d);
  free(lreal);
  bico__free(ctx, blobs);
  return st;
}

bico_status bico__wfolder_open(bico_ctx *ctx, const char *fn, const char *dir,
                               const char *like, uint64_t max_shard,
                               bico__wfolder **out) {
  *out = NULL;
  if (dir[0] == '\0')
    return bico__fail(ctx, BICO_E_ARG, "%s: the output folder name is empty",
                      fn);
  bico__wfolder *f = bico__calloc(ctx, 1, sizeof *f);
  if (f == NULL) return BICO_E_NOMEM;
  f->max_shard = max_shard;
  /* the lock (joining the run's that holds it) and the checks */
  bico_status st = bico__stage_open(ctx, fn, dir, 1, &f->st);
  struct stat ls, rs;
  if (st == BICO_OK && like != NULL && stat(like, &ls) == 0 &&
      S_ISDIR(ls.st_mode)) {
    if (stat(f->st.real, &rs) == 0 && ls.st_dev == rs.st_dev &&
        ls.st_ino == rs.st_ino)
      st = bico__fail(ctx, BICO_E_ARG,
                      "the output folder %s is the model folder %s it "
                      "copies; write to another folder (nothing was written)",
                      dir, like);
    else if ((f->likedir = bico__strdup(ctx, like)) == NULL)
      st = BICO_E_NOMEM;
  }
  if (st == BICO_OK && like != NULL) st = bico_stfile_open(ctx, like, &f->like);
  if (st == BICO_OK && f->likedir != NULL) st = plan_copies(ctx, f);
  if (st == BICO_OK) st = bico__stage_make(ctx, fn, &f->st);
  if (st != BICO_OK) {
    bico__wfolder_free(ctx, f);
    return st;
  }
  *out = f;
  return BICO_OK;
}

/* A file of the new folder: written as stage/name, named dir/name in
 * messages (whose mode an existing dir/name lends). */
static bico_status stage_file(bico_ctx *ctx, const char *fn, bico__wfolder *f,
                              const char *what, const char *name,
                              bico__tmpfile *t) {
  memset(t, 0, sizeof *t);
  t->fd = -1;
  t->gone = 1;
  if (name[0] == '\0' || strchr(name, '/') != NULL ||
      strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
    return bico__fail(ctx, BICO_E_ARG, "the output folder %s: '%s' is not a "
                      "file name", f->st.dir, name);
  char *path = bico__path_join(ctx, f->st.dir, name);
  char *tmp = bico__path_join(ctx, f->st.t.tmp, name);
  bico_status st = path && tmp ? BICO_OK : BICO_E_NOMEM;
  if (st == BICO_OK) st = bico__tmp_create_in(ctx, fn, what, path, tmp, t);
  bico__free(ctx, path);
  bico__free(ctx, tmp);
  return st;
}

/* Index of name in v[0..n), or n. */
static size_t find_name(char *const *v, size_t n, const char *name) {
  for (size_t k = 0; k < n; k++)
    if (strcmp(v[k], name) == 0) return k;
  return n;
}

bico_status bico__wfolder_layout(bico_ctx *ctx, const char *fn,
                                 bico__wfolder *f, size_t n,
                                 const char *const *names,
                                 const uint64_t *sizes, size_t *of,
                                 bico__wshard **shp, size_t *nshp) {
  char **sn = bico__calloc(ctx, n + 1, sizeof *sn); /* shard names */
  size_t ns = 0;
  bico_status st = sn == NULL ? BICO_E_NOMEM : BICO_OK;
  int follow = 0;
  if (st == BICO_OK && f->max_shard == 0 && f->like != NULL) {
    /* The like model's files, by tensor: its shard layout when it has
     * more than one file or an index. */
    const char *first = NULL;
    size_t lc = bico__stfile_ntensors(f->like);
    for (size_t i = 0; i < lc; i++) {
      const char *p;
      if (bico_stfile_tensor_path(f->like, i, &p) != BICO_OK) continue;
      if (first == NULL) first = p;
      if (strcmp(p, first) != 0) follow = 1;
    }
    if (f->like->nfiles > 1 || ends_with(f->like->path, ".json")) follow = 1;
  }
  if (st == BICO_OK && follow) {
    /* Each tensor in the like model's shard of that name; a tensor it
     * lacks goes with the tensor before it (the first shard at the
     * start). */
    size_t prev = SIZE_MAX;
    for (size_t k = 0; k < n && st == BICO_OK; k++) {
      size_t li;
      const char *p;
      if (bico_stfile_find(f->like, names[k], &li) != BICO_OK ||
          bico_stfile_tensor_path(f->like, li, &p) != BICO_OK) {
        bico__clear(ctx);
        of[k] = prev;
        continue;
      }
      const char *b = strrchr(p, '/');
      b = b ? b + 1 : p;
      size_t s = find_name(sn, ns, b);
      if (s == ns) {
        if ((sn[ns] = bico__strdup(ctx, b)) == NULL) st = BICO_E_NOMEM;
        else ns++;
      }
      of[k] = prev = s;
    }
    for (size_t k = 0; k < n; k++)
      if (of[k] == SIZE_MAX) of[k] = 0;
  } else if (st == BICO_OK) {
    /* Greedy in declaration order (Hugging Face's rule): a new shard when
     * the next tensor would take the current one past the limit; a
     * tensor larger than the limit gets a shard of its own. */
    uint64_t fill = 0;
    size_t cur = 0;
    for (size_t k = 0; k < n; k++) {
      if (f->max_shard > 0 && fill > 0 && fill + sizes[k] > f->max_shard) {
        cur++;
        fill = 0;
      }
      fill += sizes[k];
      of[k] = cur;
    }
    ns = n > 0 ? cur + 1 : 1;
    for (size_t s = 0; s < ns && st == BICO_OK; s++) {
      char b[64];
      if (ns == 1) snprintf(b, sizeof b, "%s", SINGLE_NAME);
      else snprintf(b, sizeof b, "model-%05zu-of-%05zu.safetensors", s + 1, ns);
      if ((sn[s] = bico__strdup(ctx, b)) == NULL) st = BICO_E_NOMEM;
    }
  }
  if (st == BICO_OK && ns == 0) {
    if ((sn[0] = bico__strdup(ctx, SINGLE_NAME)) == NULL) st = BICO_E_NOMEM;
    else ns = 1;
  }
  bico__wshard *sh = NULL;
  if (st == BICO_OK) {
    sh = bico__calloc(ctx, ns, sizeof *sh);
    if (sh == NULL) st = BICO_E_NOMEM;
  }
  for (size_t s = 0; s < ns && st == BICO_OK; s++) {
    sh[s].tf.fd = -1;
    sh[s].name = sn[s];
    sn[s] = NULL;
    st = stage_file(ctx, fn, f, "output shard", sh[s].name, &sh[s].tf);
  }
  for (size_t s = 0; s < ns; s++) bico__free(ctx, sn[s]);
  bico__free(ctx, sn);
  if (st != BICO_OK) {
    for (size_t s = 0; sh != NULL && s < ns; s++) {
      bico__tmp_discard(ctx, &sh[s].tf);
      bico__free(ctx, sh[s].name);
    }
    bico__free(ctx, sh);
    return st;
  }
  *shp = sh;
  *nshp = ns;
  /* the layout is fixed: the like model is no longer needed */
  bico_stfile_free(f->like);
  f->like = NULL;
  return BICO_OK;
}

static bico__tmpfile *new_extra(bico_ctx *ctx, bico__wfolder *f) {
  bico__tmpfile *e = bico__grow(ctx, f->extra, f->nextra, &f->extracap, 8,
                                sizeof *e);
  if (e == NULL) return NULL;
  f->extra = e;
  memset(&e[f->nextra], 0, sizeof *e);
  e[f->nextra].fd = -1;
  return &e[f->nextra++];
}

/* A temporary file for dir/name holding len bytes of buf. */
static bico_status write_extra(bico_ctx *ctx, const char *fn, bico__wfolder *f,
                               const char *what, const char *name,
                               const void *buf, size_t len) {
  bico__tmpfile *t = new_extra(ctx, f);
  bico_status st = t ? BICO_OK : BICO_E_NOMEM;
  if (st == BICO_OK) st = stage_file(ctx, fn, f, what, name, t);
  if (st == BICO_OK) st = bico__tmp_write(ctx, fn, t, buf, len);
  if (st == BICO_OK) st = bico__tmp_finish(ctx, fn, t);
  return st;
}

/* model.safetensors.index.json: metadata.total_size (the tensors' bytes)
 * and weight_map (tensor -> shard file), in declaration order. */
static bico_status write_index(bico_ctx *ctx, const char *fn,
                               bico__wfolder *f, size_t n,
                               const char *const *names, const uint64_t *sizes,
                               const size_t *of, const bico__wshard *sh) {
  uint64_t total = 0;
  for (size_t k = 0; k < n; k++) total += sizes[k];
  bico__jw jw;
  bico__jw_init(&jw, ctx, 2);
  bico__jw_begin_object(&jw);
  bico__jw_key(&jw, "metadata");
  bico__jw_begin_object(&jw);
  bico__jw_key(&jw, "total_size");
  bico__jw_uint(&jw, total);
  bico__jw_end_object(&jw);
  bico__jw_key(&jw, "weight_map");
  bico__jw_begin_object(&jw);
  for (size_t k = 0; k < n; k++) {
    bico__jw_key(&jw, names[k]);
    bico__jw_string(&jw, sh[of[k]].name);
  }
  bico__jw_end_object(&jw);
  bico__jw_end_object(&jw);
  bico__jw_raw(&jw, "\n", 1);
  bico_status st = bico__jw_finish(&jw);
  if (st == BICO_OK)
    st = write_extra(ctx, fn, f, "output index", INDEX_NAME, jw.buf, jw.len);
  bico__jw_free(&jw);
  return st;
}

/* One of the like folder's other files, copied byte for byte with its
 * permission bits. */
static bico_status copy_file(bico_ctx *ctx, const char *fn, bico__wfolder *f,
                             const wcopy *c, unsigned char *buf, size_t cap) {
  bico__tmpfile *t = new_extra(ctx, f);
  int fd = -1;
  uint64_t size = 0;
  bico_status st = t ? BICO_OK : BICO_E_NOMEM;
  if (st == BICO_OK) st = bico__open_input(ctx, fn, c->src, &fd, &size);
  if (st == BICO_OK) st = stage_file(ctx, fn, f, "copied file", c->name, t);
  for (uint64_t off = 0; st == BICO_OK && off < size;) {
    size_t k = size - off < cap ? (size_t)(size - off) : cap;
    int e = bico__pread_all(fd, buf, k, off);
    if (e != 0)
      st = bico__fail(ctx, BICO_E_IO, "the model folder %s: reading %s: %s",
                      f->likedir, c->name, strerror(e));
    else st = bico__tmp_write(ctx, fn, t, buf, k);
    off += k;
  }
  if (st == BICO_OK) {
    t->setmode = 1;
    t->mode = c->mode;
    t->nosync = 1; /* bico__stage_finish syncs the new folder once */
    st = bico__tmp_finish(ctx, fn, t);
  }
  if (fd >= 0) close(fd);
  return st;
}

/* The old folder's weights the new model replaces, not carried over:
 * model.safetensors, the index, model-NNNNN-of-NNNNN.safetensors, and the
 * files the old index names that have a weight suffix.  Never a file of
 * another name, whatever the old index says. */
static bico_status find_drop(bico_ctx *ctx, bico__wfolder *f) {
  bico_status st = BICO_OK;
  char *ip = bico__path_join(ctx, f->st.real, INDEX_NAME);
  if (ip == NULL) return BICO_E_NOMEM;
  struct stat s;
  if (lstat(ip, &s) == 0 && S_ISREG(s.st_mode)) {
    char *text = NULL;
    size_t len = 0;
    bico__json_doc *doc = NULL;
    /* an unreadable old index only loses its shard list */
    if (bico__read_file(ctx, "wfolder", "index", ip, 64u << 20, &text,
                        &len) == BICO_OK &&
        bico__json_parse(ctx, "index", text, len, &doc) == BICO_OK) {
      const bico__json *wm = bico__json_get(&doc->root, "weight_map");
      for (size_t k = 0; wm && wm->type == BICO__JSON_OBJECT && k < wm->n &&
                         st == BICO_OK;
           k++) {
        const bico__json *v = &wm->u.members[k].value;
        if (v->type == BICO__JSON_STRING && is_weight_name(v->u.s) &&
            strchr(v->u.s, '/') == NULL)
          st = push_name(ctx, &f->drop, &f->ndrop, &f->dropcap, v->u.s);
      }
    }
    bico__json_doc_free(doc);
    bico__free(ctx, text);
    bico__clear(ctx);
  }
  bico__free(ctx, ip);
  if (f->ndrop > 1) qsort(f->drop, f->ndrop, sizeof *f->drop, cmp_name);
  return st;
}

/* What the new folder takes from the old one. */
static int keep_old(void *arg, const char *n) {
  const bico__wfolder *f = arg;
  if (n[0] == '.' && strstr(n, BICO__TMP_MARK) != NULL) return 0; /* ours */
  if (in_sorted(f->made, f->nmade, n)) return 0; /* the new file wins */
  if (strcmp(n, SINGLE_NAME) == 0 || strcmp(n, INDEX_NAME) == 0 ||
      is_shard_name(n))
    return 0;
  return !in_sorted(f->drop, f->ndrop, n);
}

/* The sorted names of every file the writer produces. */
static bico_status list_made(bico_ctx *ctx, bico__wfolder *f,
                             const bico__wshard *sh, size_t nsh, int index) {
  size_t cap = 0;
  bico_status st = BICO_OK;
  for (size_t s = 0; s < nsh && st == BICO_OK; s++)
    st = push_name(ctx, &f->made, &f->nmade, &cap, sh[s].name);
  if (st == BICO_OK && index)
    st = push_name(ctx, &f->made, &f->nmade, &cap, INDEX_NAME);
  if (st == BICO_OK && f->nmade > 1)
    qsort(f->made, f->nmade, sizeof *f->made, cmp_name);
  return st;
}

bico_status bico__wfolder_finish(bico_ctx *ctx, const char *fn,
                                 bico__wfolder *f, size_t n,
                                 const char *const *names,
                                 const uint64_t *sizes, const size_t *of,
                                 const bico__wshard *sh, size_t nsh) {
  int index = nsh > 1 || strcmp(sh[0].name, SINGLE_NAME) != 0;
  bico_status st = list_made(ctx, f, sh, nsh, index);
  if (st == BICO_OK && index)
    st = write_index(ctx, fn, f, n, names, sizes, of, sh);
  size_t cap = 1u << 20;
  unsigned char *buf = f->ncopies > 0 ? bico__alloc(ctx, cap) : NULL;
  if (f->ncopies > 0 && buf == NULL) st = BICO_E_NOMEM;
  for (size_t k = 0; k < f->ncopies && st == BICO_OK; k++) {
    /* a copy never takes the name of a file the writer produces */
    if (in_sorted(f->made, f->nmade, f->copies[k].name)) continue;
    st = copy_file(ctx, fn, f, &f->copies[k], buf, cap);
  }
  bico__free(ctx, buf);
  /* the copies are produced too: the old folder's files of their names
   * are replaced */
  size_t mcap = f->nmade;
  for (size_t k = 0; k < f->ncopies && st == BICO_OK; k++)
    st = push_name(ctx, &f->made, &f->nmade, &mcap, f->copies[k].name);
  if (st == BICO_OK && f->nmade > 1)
    qsort(f->made, f->nmade, sizeof *f->made, cmp_name);
  if (st == BICO_OK && f->st.exists) st = find_drop(ctx, f);
  /* the user's files carried, the folder's attributes, one sync */
  if (st == BICO_OK) st = bico__stage_finish(ctx, fn, &f->st, keep_old, f);
  return st;
}

bico_status bico__wfolder_files(bico_ctx *ctx, bico__wfolder *f,
                                bico__wshard *sh, size_t nsh,
                                bico__tmpfile ***list, size_t *n) {
  (void)sh;
  (void)nsh;
  bico__free(ctx, f->list);
  f->list = bico__alloc(ctx, sizeof *f->list);
  if (f->list == NULL) return BICO_E_NOMEM;
  f->st.t.gone = 0;
  f->list[0] = &f->st.t;
  *list = f->list;
  *n = 1;
  return BICO_OK;
}

void bico__wfolder_committed(bico__wfolder *f) {
  /* the files went with the folder: nothing of theirs to remove */
  for (size_t k = 0; k < f->nextra; k++) f->extra[k].gone = 1;
  f->st.t.gone = 1;
  bico__stage_unlock(&f->st); /* the old tree is retired: let go */
}
