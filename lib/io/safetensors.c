/* safetensors reader: the public functions over the validated headers
 * (lib/io/st_header.c, lib/io/st_index.c).  Tensor data are read with pread into
 * the caller's buffers, never mapped: a file truncated while open gives an
 * error, not a SIGBUS. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fileio.h"
#include "modelpath.h"
#include "st_internal.h"
#include "strindex.h"

typedef bico__st_tensor st_tensor;
#define shortname bico__st_shortname

static int ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcmp(s + n - k, suffix) == 0;
}

static int cmp_name(const void *a, const void *b) {
  const st_tensor *x = *(st_tensor *const *)a, *y = *(st_tensor *const *)b;
  return strcmp(x->name, y->name);
}

void bico_stfile_free(bico_stfile *f) {
  if (f == NULL) return;
  bico_ctx *ctx = f->ctx;
  for (size_t k = 0; k < f->nfiles; k++)
    if (f->files[k].fd >= 0) close(f->files[k].fd);
  bico__free(ctx, f->files);
  bico__free(ctx, f->raw);
  bico__free(ctx, f->tensors);
  bico__free(ctx, f->by_name);
  bico__arena_free(&f->arena);
  bico__free(ctx, f);
}

bico_status bico_stfile_open(bico_ctx *ctx, const char *path,
                             bico_stfile **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL || path == NULL)
    return bico__fail(ctx, BICO_E_NULL, "stfile_open: %s is NULL",
                      out == NULL ? "out" : "path");
  *out = NULL;
  /* A Hugging Face model folder stands for its weights file. */
  char resolved[4096];
  const char *given = path;
  bico_status rs = bico__model_file(ctx, given, resolved, sizeof resolved, &path);
  if (rs != BICO_OK) return rs;
  bico_stfile *f = bico__calloc(ctx, 1, sizeof *f);
  if (f == NULL) return BICO_E_NOMEM;
  f->ctx = ctx;
  bico__arena_init(&f->arena, ctx);
  bico_status st = BICO_OK;
  f->path = bico__arena_strndup(&f->arena, path, strlen(path));
  if (f->path == NULL)
    st = BICO_E_NOMEM;
  else if (ends_with(path, ".json")) {
    st = bico__st_load_index(f, path);
  } else {
    f->files = bico__calloc(ctx, 1, sizeof *f->files);
    if (f->files == NULL) {
      st = BICO_E_NOMEM;
    } else {
      f->files[0].path = (char *)f->path;
      f->files[0].fd = -1;
      f->nfiles = 1;
      st = bico__st_load_one(f, 0, 1);
    }
  }
  if (st == BICO_OK) {
    f->by_name = bico__alloc(ctx, (f->count ? f->count : 1) * sizeof(size_t));
    st_tensor **tmp = bico__alloc(ctx, (f->count ? f->count : 1) * sizeof *tmp);
    if (f->by_name == NULL || tmp == NULL) {
      st = BICO_E_NOMEM;
    } else {
      for (size_t k = 0; k < f->count; k++) tmp[k] = &f->tensors[k];
      qsort(tmp, f->count, sizeof *tmp, cmp_name);
      for (size_t k = 0; k < f->count; k++) {
        f->by_name[k] = (size_t)(tmp[k] - f->tensors);
        /* JSON rejects duplicate keys and the index pins each name to one
         * shard, so a repeat here is a bug. */
        if (k > 0 && strcmp(tmp[k]->name, tmp[k - 1]->name) == 0 &&
            st == BICO_OK)
          st = bico__fail(ctx, BICO_E_FORMAT,
                          "stfile_open: %s: duplicate tensor '%s'", path,
                          tmp[k]->name);
      }
    }
    bico__free(ctx, tmp);
  }
  if (st != BICO_OK) {
    if (st == BICO_E_NOMEM && bico_ctx_errmsg(ctx)[0] == '\0')
      bico__fail(ctx, st, "stfile_open: %s: out of memory", path);
    else if (st == BICO_E_FORMAT && bico__looks_like_pickle(path))
      bico__fail(ctx, st,
                 "%s: a PyTorch pickle, not safetensors: convert it with "
                 "`python3 -m bico.convert %s OUT.safetensors`",
                 path, given);
    bico_stfile_free(f);
    return st;
  }
  *out = f;
  return BICO_OK;
}

bico_status bico_stfile_check_unchanged(const bico_stfile *f) {
  if (f == NULL) return BICO_E_NULL;
  bico_ctx *ctx = f->ctx;
  bico__clear(ctx);
  for (size_t k = 0; k < f->nfiles; k++) {
    const bico__st_file *m = &f->files[k];
    if (m->fd < 0) continue;
    struct stat now, there;
    const char *what = NULL;
    if (fstat(m->fd, &now) != 0)
      return bico__fail(ctx, BICO_E_IO, "stfile_check_unchanged: %s: %s",
                        m->path, strerror(errno));
    if ((uint64_t)now.st_size != m->size)
      what = "its size";
    else if ((int64_t)now.st_mtim.tv_sec != m->mtime_sec ||
             (int64_t)now.st_mtim.tv_nsec != m->mtime_nsec)
      what = "its modification time (it was written to)";
    else if (stat(m->path, &there) != 0 ||
             (uint64_t)there.st_dev != m->dev ||
             (uint64_t)there.st_ino != m->ino)
      what = "the file its name leads to (it was replaced or removed)";
    if (what == NULL) {
      unsigned char lenb[8];
      int e = bico__pread_all(m->fd, lenb, 8, 0);
      uint64_t n = e == 0 ? bico__st_load_le(lenb, 8) : 0;
      char *buf = NULL, hex[65];
      if (e == 0 && n <= m->size - 8) {
        buf = bico__alloc(ctx, (size_t)n + 1);
        if (buf == NULL) return BICO_E_NOMEM;
        e = bico__pread_all(m->fd, buf, (size_t)n, 8);
      }
      if (e != 0 || buf == NULL) {
        what = "its header (it cannot be read again)";
      } else {
        bico__st_header_digest(lenb, buf, (size_t)n, hex);
        if (strcmp(hex, m->head) != 0) what = "its header";
      }
      bico__free(ctx, buf);
    }
    if (what != NULL)
      return bico__fail(ctx, BICO_E_IO,
                        "%s changed while it was being read: %s is not what "
                        "it was when it was opened; nothing was written "
                        "(run again once nothing else writes it)",
                        m->path, what);
  }
  return BICO_OK;
}

bico_status bico_stfile_count(const bico_stfile *f, size_t *n) {
  if (f == NULL) return BICO_E_NULL;
  if (n == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "stfile_count: n is NULL");
  *n = f->count;
  return BICO_OK;
}

size_t bico__stfile_ntensors(const bico_stfile *f) {
  return f == NULL ? 0 : f->count;
}

/* Entry checks shared by the per-tensor accessors. */
static bico_status check_index(const bico_stfile *f, const char *fn,
                               size_t index) {
  if (f == NULL) return BICO_E_NULL;
  if (index >= f->count)
    return bico__fail(f->ctx, BICO_E_ARG,
                      "%s: tensor index %zu out of range (file has %zu)", fn,
                      index, f->count);
  return BICO_OK;
}

bico_status bico_stfile_tensor_info(const bico_stfile *f, size_t index,
                                    const char **name, int *dtype,
                                    size_t *ndim, const size_t **shape) {
  bico_status st = check_index(f, "stfile_tensor_info", index);
  if (st != BICO_OK) return st;
  const st_tensor *t = &f->tensors[index];
  if (name) *name = t->name;
  if (dtype) *dtype = t->dtype;
  if (ndim) *ndim = t->ndim;
  if (shape) *shape = t->shape;
  return BICO_OK;
}

bico_status bico_stfile_tensor_size(const bico_stfile *f, size_t index,
                                    size_t *numel, size_t *nbytes) {
  bico_status st = check_index(f, "stfile_tensor_size", index);
  if (st != BICO_OK) return st;
  if (numel) *numel = f->tensors[index].numel;
  if (nbytes) *nbytes = f->tensors[index].nbytes;
  return BICO_OK;
}

bico_status bico_stfile_tensor_path(const bico_stfile *f, size_t index,
                                    const char **path) {
  bico_status st = check_index(f, "stfile_tensor_path", index);
  if (st != BICO_OK) return st;
  if (path == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "stfile_tensor_path: path is NULL");
  *path = f->files[f->tensors[index].file].path;
  return BICO_OK;
}

static const char *f_key(const void *f, size_t i) {
  return ((const bico_stfile *)f)->tensors[i].name;
}

bico_status bico_stfile_find(const bico_stfile *f, const char *name,
                             size_t *index) {
  if (f == NULL) return BICO_E_NULL;
  if (name == NULL || index == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "stfile_find: %s is NULL",
                      name == NULL ? "name" : "index");
  size_t k = bico__sorted_find(f->by_name, f->count, name, f_key, f);
  if (k != SIZE_MAX) {
    *index = k;
    return BICO_OK;
  }
  char nb[160];
  return bico__fail(f->ctx, BICO_E_NOTFOUND, "stfile_find: %s: no tensor '%s'",
                    f->path,
                    shortname(name, nb, sizeof nb));
}

/* pread of tensor bytes [at, at + n) from its file; a file that shrank
 * since it was opened fails cleanly (a mapping would raise SIGBUS and kill
 * the host process). */
static bico_status read_bytes(const bico_stfile *f, const char *fn,
                              const st_tensor *t, uint64_t at, void *buf,
                              size_t n) {
  const bico__st_file *m = &f->files[t->file];
  int e = bico__pread_all(m->fd, buf, n, t->off + at);
  if (e == 0) return BICO_OK;
  char nb[160];
  return bico__fail(f->ctx, BICO_E_IO, "%s: %s: tensor '%s': read failed: %s",
                    fn, m->path, shortname(t->name, nb, sizeof nb),
                    e == EIO ? "the file is shorter than when it was opened "
                               "(truncated while in use?)"
                             : strerror(e));
}

bico_status bico_stfile_data(const bico_stfile *f, size_t index,
                             const void **data, size_t *nbytes) {
  bico_status st = check_index(f, "stfile_data", index);
  if (st != BICO_OK) return st;
  if (data == NULL || nbytes == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "stfile_data: %s is NULL",
                      data == NULL ? "data" : "nbytes");
  /* The copy lives in the handle (logically const: a cache). */
  bico_stfile *mf = (bico_stfile *)f;
  const st_tensor *t = &f->tensors[index];
  if (t->nbytes > mf->rawcap || mf->raw == NULL) {
    void *p = bico__alloc(f->ctx, t->nbytes ? t->nbytes : 1);
    if (p == NULL) return BICO_E_NOMEM;
    bico__free(f->ctx, mf->raw);
    mf->raw = p;
    mf->rawcap = t->nbytes ? t->nbytes : 1;
  }
  st = read_bytes(f, "stfile_data", t, 0, mf->raw, t->nbytes);
  if (st != BICO_OK) return st;
  *data = mf->raw;
  *nbytes = t->nbytes;
  return BICO_OK;
}

static int host_little_endian(void) {
  const uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

void bico__stfile_drop(const bico_stfile *f, size_t index) {
  /* Frees bico_stfile_data's copy once the caller is done with it. */
  (void)index;
  if (f == NULL) return;
  bico_stfile *mf = (bico_stfile *)f;
  bico__free(f->ctx, mf->raw);
  mf->raw = NULL;
  mf->rawcap = 0;
}

/* Bytes converted per pread: small enough for the stack of a solver
 * thread, large enough that the system call costs little. */
#define CHUNK 32768

static bico_status read_range(const bico_stfile *f, const char *fn,
                              size_t index, size_t first, size_t count,
                              void *out, int to_f64) {
  bico_status st = check_index(f, fn, index);
  if (st != BICO_OK) return st;
  const st_tensor *t = &f->tensors[index];
  if (first > t->numel || count > t->numel - first) {
    char nb[160];
    return bico__fail(f->ctx, BICO_E_SHAPE,
                      "%s: tensor '%s' has %zu elements; range [%zu, +%zu) "
                      "does not fit",
                      fn, shortname(t->name, nb, sizeof nb), t->numel, first,
                      count);
  }
  if (count == 0) return BICO_OK;
  if (out == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "%s: out is NULL", fn);
  size_t es = bico_dtype_size(t->dtype);
  uint64_t at = (uint64_t)first * es;
  /* Same layout: straight into the caller's buffer. */
  if (host_little_endian() && ((!to_f64 && t->dtype == BICO_DTYPE_F32) ||
                               (to_f64 && t->dtype == BICO_DTYPE_F64)))
    return read_bytes(f, fn, t, at, out, count * es);
  unsigned char buf[CHUNK];
  size_t per = CHUNK / es;
  for (size_t k = 0; k < count; k += per) {
    size_t n = count - k < per ? count - k : per;
    st = read_bytes(f, fn, t, at + (uint64_t)k * es, buf, n * es);
    if (st != BICO_OK) return st;
    if (to_f64) {
      double *o = (double *)out + k;
      for (size_t j = 0; j < n; j++) o[j] = bico__st_elem_f64(buf + j * es, t->dtype);
    } else {
      float *o = (float *)out + k;
      for (size_t j = 0; j < n; j++) o[j] = bico__st_elem_f32(buf + j * es, t->dtype);
    }
  }
  return BICO_OK;
}

static bico_status read_all(const bico_stfile *f, const char *fn,
                            size_t index, void *out, size_t count,
                            int to_f64) {
  bico_status st = check_index(f, fn, index);
  if (st != BICO_OK) return st;
  const st_tensor *t = &f->tensors[index];
  if (count != t->numel) {
    char nb[160];
    return bico__fail(f->ctx, BICO_E_SHAPE,
                      "%s: tensor '%s' has %zu elements, count is %zu", fn,
                      shortname(t->name, nb, sizeof nb), t->numel, count);
  }
  return read_range(f, fn, index, 0, count, out, to_f64);
}

bico_status bico_stfile_read_f32(const bico_stfile *f, size_t index,
                                 float *out, size_t count) {
  return read_all(f, "stfile_read_f32", index, out, count, 0);
}

bico_status bico_stfile_read_f32_range(const bico_stfile *f, size_t index,
                                       size_t first, float *out,
                                       size_t count) {
  return read_range(f, "stfile_read_f32_range", index, first, count, out, 0);
}

bico_status bico_stfile_read_f64(const bico_stfile *f, size_t index,
                                 double *out, size_t count) {
  return read_all(f, "stfile_read_f64", index, out, count, 1);
}

bico_status bico_stfile_read_f64_range(const bico_stfile *f, size_t index,
                                       size_t first, double *out,
                                       size_t count) {
  return read_range(f, "stfile_read_f64_range", index, first, count, out, 1);
}

bico_status bico_stfile_check_finite(const bico_stfile *f, size_t index) {
  bico_status st = check_index(f, "stfile_check_finite", index);
  if (st != BICO_OK) return st;
  const st_tensor *t = &f->tensors[index];
  if (!bico_dtype_is_float(t->dtype)) return BICO_OK;
  size_t es = bico_dtype_size(t->dtype), per = CHUNK / es;
  unsigned char buf[CHUNK];
  for (size_t k = 0; k < t->numel; k += per) {
    size_t n = t->numel - k < per ? t->numel - k : per;
    st = read_bytes(f, "stfile_check_finite", t, (uint64_t)k * es, buf, n * es);
    if (st != BICO_OK) return st;
    for (size_t j = 0; j < n; j++) {
      double v = bico__st_elem_f64(buf + j * es, t->dtype);
      if (isfinite(v)) continue;
      char nb[160];
      return bico__fail(f->ctx, BICO_E_NONFINITE,
                        "%s: tensor '%s' holds %s at element %zu",
                        f->files[t->file].path,
                        shortname(t->name, nb, sizeof nb),
                        isnan(v) ? "NaN" : "Inf", k + j);
    }
  }
  return BICO_OK;
}

bico_status bico_stfile_metadata_count(const bico_stfile *f, size_t *n) {
  if (f == NULL) return BICO_E_NULL;
  if (n == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "stfile_metadata_count: n is NULL");
  *n = f->nmeta;
  return BICO_OK;
}

size_t bico__stfile_nmeta(const bico_stfile *f) {
  return f == NULL ? 0 : f->nmeta;
}

bico_status bico_stfile_metadata_at(const bico_stfile *f, size_t i,
                                    const char **key, const char **value) {
  if (f == NULL) return BICO_E_NULL;
  if (i >= f->nmeta)
    return bico__fail(f->ctx, BICO_E_ARG,
                      "stfile_metadata_at: index %zu out of range (%zu "
                      "entries)",
                      i, f->nmeta);
  if (key) *key = f->meta[i].key;
  if (value) *value = f->meta[i].value;
  return BICO_OK;
}

bico_status bico_stfile_metadata_get(const bico_stfile *f, const char *key,
                                     const char **value) {
  if (f == NULL) return BICO_E_NULL;
  if (key == NULL || value == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "stfile_metadata_get: %s is NULL",
                      key == NULL ? "key" : "value");
  for (size_t i = 0; i < f->nmeta; i++)
    if (strcmp(f->meta[i].key, key) == 0) {
      *value = f->meta[i].value;
      return BICO_OK;
    }
  char kb[160];
  return bico__fail(f->ctx, BICO_E_NOTFOUND,
                    "stfile_metadata_get: no metadata key '%s'",
                    shortname(key, kb, sizeof kb));
}
