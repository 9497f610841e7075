/* safetensors writer: Hugging Face model folders as outputs (the shard
 * plan, the index, the target's other files copied, stale weights).  The
 * tensor side lives in lib/st_writer.c; this file owns the folder. */
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

struct bico__wfolder {
  char *dir;
  int made_dir;  /* created by this writer: removed again unless committed */
  int committed;
  bico_stfile *like;  /* the model whose shard layout is followed */
  char *likedir;      /* its folder, whose other files are copied */
  uint64_t max_shard; /* bytes; 0: as like (or one file) */
  bico__tmpfile *extra; /* index and copied files */
  size_t nextra, extracap;
  char **stale; /* weight files of an earlier model in dir, to remove */
  size_t nstale, stalecap;
  bico__tmpfile **list;
};

static int ends_with(const char *s, const char *suf) {
  size_t n = strlen(s), m = strlen(suf);
  return n >= m && strcmp(s + n - m, suf) == 0;
}

int bico_output_is_folder(const char *output, const char *like) {
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

void bico__wfolder_free(bico_ctx *ctx, bico__wfolder *f) {
  if (f == NULL) return;
  for (size_t k = 0; k < f->nextra; k++) bico__tmp_discard(ctx, &f->extra[k]);
  bico__free(ctx, f->extra);
  for (size_t k = 0; k < f->nstale; k++) bico__free(ctx, f->stale[k]);
  bico__free(ctx, f->stale);
  bico__free(ctx, f->list);
  bico_stfile_close(f->like);
  if (f->made_dir && !f->committed) (void)rmdir(f->dir);
  bico__free(ctx, f->likedir);
  bico__free(ctx, f->dir);
  bico__free(ctx, f);
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
  f->dir = bico__strdup(ctx, dir);
  if (f->dir == NULL) {
    bico__wfolder_free(ctx, f);
    return BICO_E_NOMEM;
  }
  bico_status st = BICO_OK;
  struct stat ds, ls;
  if (stat(dir, &ds) == 0) {
    if (!S_ISDIR(ds.st_mode))
      st = bico__fail(ctx, BICO_E_ARG,
                      "%s: the output folder %s exists and is not a folder",
                      fn, dir);
  } else if (mkdir(dir, 0777) != 0) {
    st = bico__fail(ctx, BICO_E_IO, "%s: cannot create the output folder %s: "
                    "%s", fn, dir, strerror(errno));
  } else {
    f->made_dir = 1;
    if (stat(dir, &ds) != 0)
      st = bico__fail(ctx, BICO_E_IO, "%s: %s: %s", fn, dir, strerror(errno));
  }
  if (st == BICO_OK && access(dir, W_OK | X_OK) != 0)
    st = bico__fail(ctx, BICO_E_IO, "%s: cannot write into the output folder "
                    "%s: %s", fn, dir, strerror(errno));
  if (st == BICO_OK && like != NULL && stat(like, &ls) == 0 &&
      S_ISDIR(ls.st_mode)) {
    if (ls.st_dev == ds.st_dev && ls.st_ino == ds.st_ino)
      st = bico__fail(ctx, BICO_E_ARG,
                      "%s: the output folder %s is the model folder %s it "
                      "copies; write to another folder (nothing was written)",
                      fn, dir, like);
    else if ((f->likedir = bico__strdup(ctx, like)) == NULL)
      st = BICO_E_NOMEM;
  }
  if (st == BICO_OK && like != NULL) st = bico_stfile_open(ctx, like, &f->like);
  if (st != BICO_OK) {
    bico__wfolder_free(ctx, f);
    return st;
  }
  *out = f;
  return BICO_OK;
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
    size_t lc = bico_stfile_count(f->like);
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
    char *path = bico__path_join(ctx, f->dir, sh[s].name);
    if (path == NULL) st = BICO_E_NOMEM;
    else st = bico__tmp_create(ctx, fn, "output shard", path, &sh[s].tf);
    bico__free(ctx, path);
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
  bico_stfile_close(f->like);
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
  char *path = bico__path_join(ctx, f->dir, name);
  bico_status st = t && path ? BICO_OK : BICO_E_NOMEM;
  if (st == BICO_OK) st = bico__tmp_create(ctx, fn, what, path, t);
  if (st == BICO_OK) st = bico__tmp_write(ctx, fn, t, buf, len);
  if (st == BICO_OK) st = bico__tmp_finish(ctx, fn, t);
  bico__free(ctx, path);
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

/* One of the like folder's other files, copied byte for byte. */
static bico_status copy_file(bico_ctx *ctx, const char *fn, bico__wfolder *f,
                             const char *name, unsigned char *buf,
                             size_t cap) {
  char *src = bico__path_join(ctx, f->likedir, name);
  char *dst = bico__path_join(ctx, f->dir, name);
  bico__tmpfile *t = new_extra(ctx, f);
  int fd = -1;
  uint64_t size = 0;
  bico_status st = src && dst && t ? BICO_OK : BICO_E_NOMEM;
  if (st == BICO_OK) st = bico__open_input(ctx, fn, src, &fd, &size);
  if (st == BICO_OK) st = bico__tmp_create(ctx, fn, "copied file", dst, t);
  for (uint64_t off = 0; st == BICO_OK && off < size;) {
    size_t k = size - off < cap ? (size_t)(size - off) : cap;
    int e = bico__pread_all(fd, buf, k, off);
    if (e != 0)
      st = bico__fail(ctx, BICO_E_IO, "%s: reading %s: %s", fn, src,
                      strerror(e));
    else st = bico__tmp_write(ctx, fn, t, buf, k);
    off += k;
  }
  if (st == BICO_OK) st = bico__tmp_finish(ctx, fn, t);
  if (fd >= 0) close(fd);
  bico__free(ctx, src);
  bico__free(ctx, dst);
  return st;
}

static bico_status add_stale(bico_ctx *ctx, bico__wfolder *f,
                             const char *name, const bico__wshard *sh,
                             size_t nsh, int index) {
  if (index && strcmp(name, INDEX_NAME) == 0) return BICO_OK;
  for (size_t s = 0; s < nsh; s++)
    if (strcmp(sh[s].name, name) == 0) return BICO_OK;
  if (strchr(name, '/') != NULL || name[0] == '.' ||
      find_name(f->stale, f->nstale, name) < f->nstale)
    return BICO_OK;
  char **v = bico__grow(ctx, f->stale, f->nstale, &f->stalecap, 8, sizeof *v);
  if (v == NULL) return BICO_E_NOMEM;
  f->stale = v;
  if ((v[f->nstale] = bico__strdup(ctx, name)) == NULL) return BICO_E_NOMEM;
  f->nstale++;
  return BICO_OK;
}

/* The weights of the model the folder held before, which the new files do
 * not replace: the old index's shards, model.safetensors, the index
 * itself and model-NNNNN-of-NNNNN.safetensors files.  Other files stay. */
static bico_status find_stale(bico_ctx *ctx, bico__wfolder *f,
                              const bico__wshard *sh, size_t nsh, int index) {
  bico_status st = BICO_OK;
  char *ip = bico__path_join(ctx, f->dir, INDEX_NAME);
  if (ip == NULL) return BICO_E_NOMEM;
  struct stat s;
  if (stat(ip, &s) == 0 && S_ISREG(s.st_mode)) {
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
           k++)
        if (wm->u.members[k].value.type == BICO__JSON_STRING)
          st = add_stale(ctx, f, wm->u.members[k].value.u.s, sh, nsh, index);
    }
    bico__json_doc_free(doc);
    bico__free(ctx, text);
    bico__clear(ctx);
  }
  bico__free(ctx, ip);
  DIR *d = st == BICO_OK ? opendir(f->dir) : NULL;
  struct dirent *e;
  while (d != NULL && st == BICO_OK && (e = readdir(d)) != NULL)
    if (strcmp(e->d_name, SINGLE_NAME) == 0 ||
        strcmp(e->d_name, INDEX_NAME) == 0 || is_shard_name(e->d_name))
      st = add_stale(ctx, f, e->d_name, sh, nsh, index);
  if (d != NULL) closedir(d);
  return st;
}

bico_status bico__wfolder_finish(bico_ctx *ctx, const char *fn,
                                 bico__wfolder *f, size_t n,
                                 const char *const *names,
                                 const uint64_t *sizes, const size_t *of,
                                 const bico__wshard *sh, size_t nsh) {
  int index = nsh > 1 || strcmp(sh[0].name, SINGLE_NAME) != 0;
  bico_status st = BICO_OK;
  if (index) st = write_index(ctx, fn, f, n, names, sizes, of, sh);
  if (st == BICO_OK && f->likedir != NULL) {
    DIR *d = opendir(f->likedir);
    if (d == NULL)
      st = bico__fail(ctx, BICO_E_IO, "%s: cannot list %s: %s", fn,
                      f->likedir, strerror(errno));
    size_t cap = 1u << 20;
    unsigned char *buf = d ? bico__alloc(ctx, cap) : NULL;
    if (d != NULL && buf == NULL) st = BICO_E_NOMEM;
    struct dirent *e;
    while (st == BICO_OK && (e = readdir(d)) != NULL) {
      const char *nm = e->d_name;
      if (nm[0] == '.' || is_weight_name(nm)) continue;
      char *p = bico__path_join(ctx, f->likedir, nm);
      struct stat s;
      if (p == NULL) st = BICO_E_NOMEM;
      else if (stat(p, &s) == 0 && S_ISREG(s.st_mode))
        st = copy_file(ctx, fn, f, nm, buf, cap);
      bico__free(ctx, p);
    }
    bico__free(ctx, buf);
    if (d != NULL) closedir(d);
  }
  if (st == BICO_OK) st = find_stale(ctx, f, sh, nsh, index);
  return st;
}

bico_status bico__wfolder_files(bico_ctx *ctx, bico__wfolder *f,
                                bico__wshard *sh, size_t nsh,
                                bico__tmpfile ***list, size_t *n) {
  bico__free(ctx, f->list);
  f->list = bico__alloc(ctx, (nsh + f->nextra) * sizeof *f->list);
  if (f->list == NULL) return BICO_E_NOMEM;
  size_t k = 0;
  for (size_t s = 0; s < nsh; s++) f->list[k++] = &sh[s].tf;
  for (size_t s = 0; s < f->nextra; s++) f->list[k++] = &f->extra[s];
  *list = f->list;
  *n = k;
  return BICO_OK;
}

void bico__wfolder_committed(bico__wfolder *f) {
  f->committed = 1;
  int dfd = open(f->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return;
  for (size_t k = 0; k < f->nstale; k++) (void)unlinkat(dfd, f->stale[k], 0);
  if (f->nstale > 0) (void)fsync(dfd);
  close(dfd);
}
