/* safetensors writer: declare, write (any order), commit atomically. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <locale.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fileio.h"
#include "st_internal.h"
#include "strindex.h"

#define HEADER_LIMIT BICO__ST_HEADER_LIMIT
#define MAX_NDIM BICO__ST_MAX_NDIM
#define shortname bico__st_shortname
#define store_le bico__st_store_le
#define round_to_format bico__st_round

typedef struct wt_tensor {
  char *name;
  int dtype;
  size_t ndim;
  size_t *shape;
  size_t numel, nbytes;
  uint64_t begin; /* offset in its shard's data buffer */
  size_t shard;
  int written;
  size_t done; /* elements written so far by range writes */
} wt_tensor;

struct bico_stwriter {
  bico_ctx *ctx;
  char *path; /* the file, or the folder of a folder writer */
  /* Shards: one for a file writer (its temporary file is created at
   * once); a folder writer's are laid out on the first write. */
  bico__wshard *sh;
  size_t nsh;
  bico__wfolder *folder; /* NULL for a file writer */
  wt_tensor *t;
  size_t count, cap;
  bico__strindex by_name; /* tensor name -> index */
  char **meta; /* key, value pairs */
  size_t nmeta, metacap;
  int laid_out, finished;
  unsigned char *buf; /* conversion buffer */
  bico__tmpfile *one; /* finish_all's list for a file writer */
};

#define WBUF 65536

static const char *w_key(const void *w, size_t i) {
  return ((const bico_stwriter *)w)->t[i].name;
}

/* Index of the tensor named name, or SIZE_MAX. */
static size_t w_lookup(const bico_stwriter *w, const char *name) {
  return bico__strindex_find(&w->by_name, name, strlen(name), w_key, w);
}

static int w_hash_insert(bico_stwriter *w, size_t idx) {
  if (bico__strindex_reserve(w->ctx, &w->by_name, w->count + 1, w_key, w) !=
      BICO_OK)
    return 0;
  bico__strindex_insert(&w->by_name, idx, w_key, w);
  return 1;
}

void bico_stwriter_free(bico_stwriter *w) {
  if (w == NULL) return;
  bico_ctx *ctx = w->ctx;
  for (size_t k = 0; k < w->nsh; k++) {
    bico__tmp_discard(ctx, &w->sh[k].tf);
    bico__free(ctx, w->sh[k].name);
  }
  bico__free(ctx, w->sh);
  bico__wfolder_free(ctx, w->folder);
  for (size_t k = 0; k < w->count; k++) {
    bico__free(ctx, w->t[k].name);
    bico__free(ctx, w->t[k].shape);
  }
  for (size_t k = 0; k < 2 * w->nmeta; k++) bico__free(ctx, w->meta[k]);
  bico__free(ctx, w->meta);
  bico__free(ctx, w->t);
  bico__strindex_free(ctx, &w->by_name);
  bico__free(ctx, w->buf);
  bico__free(ctx, w->path);
  bico__free(ctx, w);
}

/* The writer of one file: its temporary file in the destination's folder
 * (tmp NULL), or made at once at tmp. */
static bico_status create_file(bico_ctx *ctx, const char *path,
                               const char *tmp, bico_stwriter **out) {
  bico_stwriter *w = bico__calloc(ctx, 1, sizeof *w);
  if (w == NULL) return BICO_E_NOMEM;
  w->ctx = ctx;
  w->path = bico__strdup(ctx, path);
  w->buf = bico__alloc(ctx, WBUF);
  w->sh = bico__calloc(ctx, 1, sizeof *w->sh);
  if (!w->path || !w->buf || !w->sh) {
    bico_stwriter_free(w);
    return BICO_E_NOMEM;
  }
  w->sh[0].tf.fd = -1;
  w->nsh = 1;
  bico_status s =
      tmp ? bico__tmp_create_in(ctx, "stwriter_create", "output", path, tmp,
                                &w->sh[0].tf)
          : bico__tmp_create(ctx, "stwriter_create", "output", path,
                             &w->sh[0].tf);
  if (s != BICO_OK) {
    bico_stwriter_free(w);
    return s;
  }
  *out = w;
  return BICO_OK;
}

bico_status bico__stwriter_create_at(bico_ctx *ctx, const char *path,
                                     const char *tmp, bico_stwriter **out) {
  *out = NULL;
  return create_file(ctx, path, tmp, out);
}

bico_status bico_stwriter_create(bico_ctx *ctx, const char *path,
                                 bico_stwriter **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL || path == NULL)
    return bico__fail(ctx, BICO_E_NULL, "stwriter_create: %s is NULL",
                      out == NULL ? "out" : "path");
  *out = NULL;
  size_t plen = strlen(path);
  if (plen == 0 || path[plen - 1] == '/')
    return bico__fail(ctx, BICO_E_ARG,
                      "stwriter_create: '%s' names no file", path);
  /* The reader takes a *.json path for a sharded checkpoint's index: a
   * checkpoint written under such a name could not be read back. */
  if (plen >= 5 && strcmp(path + plen - 5, ".json") == 0)
    return bico__fail(ctx, BICO_E_ARG,
                      "stwriter_create: %s: a .json name is a sharded "
                      "checkpoint's index; write safetensors under another "
                      "name (e.g. model.safetensors)", path);
  struct stat st;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
    return bico__fail(ctx, BICO_E_ARG,
                      "stwriter_create: %s is a directory", path);
  return create_file(ctx, path, NULL, out);
}

static bico_status w_state(bico_stwriter *w, const char *fn, int need_open) {
  if (w->finished)
    return bico__fail(w->ctx, BICO_E_STATE, "%s: %s: writer already committed (or its "
                      "commit failed)",
                      fn, w->path);
  if (need_open && w->laid_out)
    return bico__fail(w->ctx, BICO_E_STATE,
                      "%s: %s: tensor data already written; declarations and "
                      "metadata must come first",
                      fn, w->path);
  return BICO_OK;
}

bico_status bico_stwriter_add_metadata(bico_stwriter *w, const char *key,
                                       const char *value) {
  if (w == NULL) return BICO_E_NULL;
  bico__clear(w->ctx);
  if (key == NULL || value == NULL)
    return bico__fail(w->ctx, BICO_E_NULL, "stwriter_add_metadata: %s is NULL",
                      key == NULL ? "key" : "value");
  bico_status st = w_state(w, "stwriter_add_metadata", 1);
  if (st != BICO_OK) return st;
  char kb[160];
  if (!bico__utf8_valid(key, strlen(key), NULL) ||
      !bico__utf8_valid(value, strlen(value), NULL))
    return bico__fail(w->ctx, BICO_E_ARG,
                      "stwriter_add_metadata: key or value of '%s' is not "
                      "valid UTF-8",
                      shortname(key, kb, sizeof kb));
  for (size_t k = 0; k < w->nmeta; k++)
    if (strcmp(w->meta[2 * k], key) == 0)
      return bico__fail(w->ctx, BICO_E_ARG,
                        "stwriter_add_metadata: key '%s' added twice",
                        shortname(key, kb, sizeof kb));
  /* key, value pairs: an element is two pointers */
  char **nm = bico__grow(w->ctx, w->meta, w->nmeta, &w->metacap, 8,
                         2 * sizeof *nm);
  if (nm == NULL) return BICO_E_NOMEM;
  w->meta = nm;
  char *k = bico__strdup(w->ctx, key), *v = bico__strdup(w->ctx, value);
  if (!k || !v) {
    bico__free(w->ctx, k);
    bico__free(w->ctx, v);
    return BICO_E_NOMEM;
  }
  w->meta[2 * w->nmeta] = k;
  w->meta[2 * w->nmeta + 1] = v;
  w->nmeta++;
  return BICO_OK;
}

bico_status bico_stwriter_declare(bico_stwriter *w, const char *name,
                                  int dtype, size_t ndim,
                                  const size_t *shape) {
  if (w == NULL) return BICO_E_NULL;
  bico_ctx *ctx = w->ctx;
  bico__clear(ctx);
  if (name == NULL || (shape == NULL && ndim > 0))
    return bico__fail(ctx, BICO_E_NULL, "stwriter_declare: %s is NULL",
                      name == NULL ? "name" : "shape");
  bico_status st = w_state(w, "stwriter_declare", 1);
  if (st != BICO_OK) return st;
  char nb[160];
  const char *nm = shortname(name, nb, sizeof nb);
  if (strcmp(name, "__metadata__") == 0)
    return bico__fail(ctx, BICO_E_ARG,
                      "stwriter_declare: '__metadata__' is reserved, not a "
                      "tensor name");
  if (!bico__utf8_valid(name, strlen(name), NULL))
    return bico__fail(ctx, BICO_E_ARG,
                      "stwriter_declare: tensor name '%s' is not valid UTF-8",
                      nm);
  if (bico_dtype_size(dtype) == 0)
    return bico__fail(ctx, BICO_E_ARG,
                      "stwriter_declare: tensor '%s': unknown dtype %d", nm,
                      dtype);
  if (ndim > MAX_NDIM)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "stwriter_declare: tensor '%s': %zu dimensions, more "
                      "than %d",
                      nm, ndim, MAX_NDIM);
  size_t numel = 1, nbytes;
  for (size_t k = 0; k < ndim; k++)
    if ((uint64_t)shape[k] > (uint64_t)INT64_MAX ||
        bico__mul(numel, shape[k], &numel))
      return bico__fail(ctx, BICO_E_SHAPE,
                        "stwriter_declare: tensor '%s': shape overflows", nm);
  if (bico__mul(numel, bico_dtype_size(dtype), &nbytes) ||
      nbytes > (size_t)INT64_MAX)
    return bico__fail(ctx, BICO_E_SHAPE,
                      "stwriter_declare: tensor '%s': byte size overflows",
                      nm);
  if (w_lookup(w, name) != SIZE_MAX)
    return bico__fail(ctx, BICO_E_ARG,
                      "stwriter_declare: tensor '%s' declared twice", nm);
  wt_tensor *nt = bico__grow(ctx, w->t, w->count, &w->cap, 64, sizeof *nt);
  if (nt == NULL) return BICO_E_NOMEM;
  w->t = nt;
  wt_tensor *t = &w->t[w->count];
  memset(t, 0, sizeof *t);
  t->name = bico__strdup(ctx, name);
  t->shape = bico__alloc(ctx, (ndim ? ndim : 1) * sizeof(size_t));
  if (!t->name || !t->shape) {
    bico__free(ctx, t->name);
    bico__free(ctx, t->shape);
    return BICO_E_NOMEM;
  }
  if (ndim) memcpy(t->shape, shape, ndim * sizeof(size_t));
  t->dtype = dtype;
  t->ndim = ndim;
  t->numel = numel;
  t->nbytes = nbytes;
  if (!w_hash_insert(w, w->count)) {
    bico__free(ctx, t->name);
    bico__free(ctx, t->shape);
    return BICO_E_NOMEM;
  }
  w->count++;
  return BICO_OK;
}

/* pwrite all of buf at off, retrying short writes and EINTR. */
static bico_status w_pwrite(bico_stwriter *w, const char *fn, size_t shard,
                            const void *buf, size_t n, uint64_t off) {
  const unsigned char *p = buf;
  const bico__tmpfile *tf = &w->sh[shard].tf;
  while (n > 0) {
    ssize_t r = pwrite(tf->fd, p, n, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      return bico__fail(w->ctx, BICO_E_IO,
                        "%s: %s: write failed: %s", fn, tf->path,
                        strerror(errno));
    if (r == 0)
      return bico__fail(w->ctx, BICO_E_IO, "%s: %s: write made no progress",
                        fn, tf->path);
    p += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return BICO_OK;
}

/* Shard s's header (the metadata, then its tensors in declaration order)
 * written, and its space reserved. */
static bico_status w_header(bico_stwriter *w, const char *fn, size_t s) {
  bico_ctx *ctx = w->ctx;
  bico__wshard *sh = &w->sh[s];
  const char *where = sh->tf.path;
  bico__jw jw;
  bico__jw_init(&jw, ctx, 0);
  bico__jw_begin_object(&jw);
  if (w->nmeta > 0) {
    bico__jw_key(&jw, "__metadata__");
    bico__jw_begin_object(&jw);
    for (size_t k = 0; k < w->nmeta; k++) {
      bico__jw_key(&jw, w->meta[2 * k]);
      bico__jw_string(&jw, w->meta[2 * k + 1]);
    }
    bico__jw_end_object(&jw);
  }
  for (size_t k = 0; k < w->count; k++) {
    const wt_tensor *t = &w->t[k];
    if (t->shard != s) continue;
    bico__jw_key(&jw, t->name);
    bico__jw_begin_object(&jw);
    bico__jw_key(&jw, "dtype");
    bico__jw_string(&jw, bico_dtype_name(t->dtype));
    bico__jw_key(&jw, "shape");
    bico__jw_begin_array(&jw);
    for (size_t d = 0; d < t->ndim; d++) bico__jw_uint(&jw, t->shape[d]);
    bico__jw_end_array(&jw);
    bico__jw_key(&jw, "data_offsets");
    bico__jw_begin_array(&jw);
    bico__jw_uint(&jw, t->begin);
    bico__jw_uint(&jw, t->begin + t->nbytes);
    bico__jw_end_array(&jw);
    bico__jw_end_object(&jw);
  }
  bico__jw_end_object(&jw);
  /* Spaces up to a multiple of 8, so the data buffer starts aligned. */
  while (jw.err == BICO_OK && jw.len % 8 != 0) bico__jw_raw(&jw, " ", 1);
  bico_status st = bico__jw_finish(&jw);
  if (st != BICO_OK) {
    bico__jw_free(&jw);
    return st == BICO_E_NOMEM
               ? bico__fail(ctx, st, "%s: %s: out of memory for the header", fn,
                            where)
               : st;
  }
  if (jw.len > HEADER_LIMIT) {
    size_t n = jw.len;
    bico__jw_free(&jw);
    return bico__fail(ctx, BICO_E_ARG,
                      "%s: %s: header of %zu bytes exceeds the %u-byte limit "
                      "readers accept",
                      fn, where, n, HEADER_LIMIT);
  }
  unsigned char lenb[8];
  store_le(lenb, jw.len, 8);
  st = w_pwrite(w, fn, s, lenb, 8, 0);
  if (st == BICO_OK) st = w_pwrite(w, fn, s, jw.buf, jw.len, 8);
  uint64_t start = 8 + (uint64_t)jw.len;
  bico__jw_free(&jw);
  if (st != BICO_OK) return st;
  /* Reserve the space now: a full disk fails here, before any data. */
  uint64_t total = start + sh->bytes;
  if (total > 0) {
    int e = posix_fallocate(sh->tf.fd, 0, (off_t)total);
    if (e == ENOSPC || e == EFBIG || e == EIO)
      return bico__fail(ctx, BICO_E_IO,
                        "%s: %s: cannot reserve %llu bytes: %s", fn, where,
                        (unsigned long long)total, strerror(e));
  }
  sh->data_start = start;
  return BICO_OK;
}

/* The tensors' names, byte sizes and shards as the folder writer
 * (lib/io/st_folder.c) takes them: parallel arrays over w->t. */
typedef struct w_tables {
  const char **names;
  uint64_t *sizes;
  size_t *of;
} w_tables;

static bico_status w_tables_make(bico_stwriter *w, w_tables *tb) {
  tb->names = bico__alloc(w->ctx, (w->count + 1) * sizeof *tb->names);
  tb->sizes = bico__alloc(w->ctx, (w->count + 1) * sizeof *tb->sizes);
  tb->of = bico__alloc(w->ctx, (w->count + 1) * sizeof *tb->of);
  if (!tb->names || !tb->sizes || !tb->of) return BICO_E_NOMEM;
  for (size_t k = 0; k < w->count; k++) {
    tb->names[k] = w->t[k].name;
    tb->sizes[k] = w->t[k].nbytes;
    tb->of[k] = w->t[k].shard;
  }
  return BICO_OK;
}

static void w_tables_free(bico_stwriter *w, w_tables *tb) {
  bico__free(w->ctx, tb->names);
  bico__free(w->ctx, tb->sizes);
  bico__free(w->ctx, tb->of);
}

/* Fixes the layout (a folder writer's shards first) and writes the
 * headers: after this the set of tensors is frozen. */
static bico_status w_layout(bico_stwriter *w, const char *fn) {
  if (w->laid_out) return BICO_OK;
  bico_ctx *ctx = w->ctx;
  bico_status st = BICO_OK;
  if (w->folder != NULL) {
    w_tables tb;
    st = w_tables_make(w, &tb);
    if (st == BICO_OK)
      st = bico__wfolder_layout(ctx, fn, w->folder, w->count, tb.names,
                                tb.sizes, tb.of, &w->sh, &w->nsh);
    for (size_t k = 0; k < w->count && st == BICO_OK; k++)
      w->t[k].shard = tb.of[k];
    w_tables_free(w, &tb);
    if (st != BICO_OK) return st;
  }
  for (size_t s = 0; s < w->nsh; s++) w->sh[s].bytes = 0;
  for (size_t k = 0; k < w->count; k++) {
    bico__wshard *sh = &w->sh[w->t[k].shard];
    w->t[k].begin = sh->bytes;
    sh->bytes += w->t[k].nbytes;
  }
  for (size_t s = 0; s < w->nsh && st == BICO_OK; s++) st = w_header(w, fn, s);
  if (st == BICO_OK) w->laid_out = 1;
  return st;
}

/* Checks for a write of tensor `name`; returns its index in *idx. */
static bico_status w_prepare(bico_stwriter *w, const char *fn,
                             const char *name, const void *data,
                             size_t *idx) {
  bico__clear(w->ctx);
  if (name == NULL)
    return bico__fail(w->ctx, BICO_E_NULL, "%s: name is NULL", fn);
  bico_status st = w_state(w, fn, 0);
  if (st != BICO_OK) return st;
  char nb[160];
  size_t k = w_lookup(w, name);
  if (k == SIZE_MAX)
    return bico__fail(w->ctx, BICO_E_NOTFOUND,
                      "%s: %s: tensor '%s' was not declared", fn, w->path,
                      shortname(name, nb, sizeof nb));
  if (w->t[k].written)
    return bico__fail(w->ctx, BICO_E_STATE,
                      "%s: %s: tensor '%s' already written", fn, w->path,
                      shortname(name, nb, sizeof nb));
  if (data == NULL && w->t[k].nbytes > 0)
    return bico__fail(w->ctx, BICO_E_NULL, "%s: data is NULL", fn);
  *idx = k;
  return BICO_OK;
}

static bico_status w_count(bico_stwriter *w, const char *fn, size_t k,
                           size_t count) {
  if (count != w->t[k].numel) {
    char nb[160];
    return bico__fail(w->ctx, BICO_E_SHAPE,
                      "%s: %s: tensor '%s' has %zu elements, count is %zu", fn,
                      w->path, shortname(w->t[k].name, nb, sizeof nb),
                      w->t[k].numel, count);
  }
  return BICO_OK;
}

/* Converts doubles (or floats, widened exactly) into the declared dtype and
 * writes them, elements [first, first + count) of tensor k, in WBUF-sized
 * pieces. */
static bico_status w_convert(bico_stwriter *w, const char *fn, size_t k,
                             const float *fs, const double *ds, size_t first,
                             size_t count) {
  wt_tensor *t = &w->t[k];
  char nb[160];
  if (!bico_dtype_is_float(t->dtype))
    return bico__fail(w->ctx, BICO_E_ARG,
                      "%s: %s: tensor '%s' is declared %s; float data convert "
                      "only to F32, F16, BF16 or F64 (use write_raw)",
                      fn, w->path, shortname(t->name, nb, sizeof nb),
                      bico_dtype_name(t->dtype));
  /* Overflow check first, so a refused tensor leaves nothing behind. */
  int eb = 0, mb = 0;
  switch (t->dtype) {
    case BICO_DTYPE_F32: eb = 8; mb = 23; break;
    case BICO_DTYPE_F16: eb = 5; mb = 10; break;
    case BICO_DTYPE_BF16: eb = 8; mb = 7; break;
    default: break;
  }
  if (eb && !(fs != NULL && t->dtype == BICO_DTYPE_F32)) {
    double maxv = ldexp(2.0 - ldexp(1.0, -mb), (1 << (eb - 1)) - 1);
    double halfulp = ldexp(1.0, (1 << (eb - 1)) - 1 - mb - 1);
    for (size_t i = 0; i < count; i++) {
      double v = fs ? (double)fs[i] : ds[i];
      if (isfinite(v) && fabs(v) >= maxv + halfulp)
        return bico__fail(w->ctx, BICO_E_NONFINITE,
                          "%s: %s: tensor '%s': element %zu = %g overflows "
                          "%s",
                          fn, w->path, shortname(t->name, nb, sizeof nb),
                          first + i, v,
                          bico_dtype_name(t->dtype));
    }
  }
  bico_status st = w_layout(w, fn);
  if (st != BICO_OK) return st;
  size_t es = bico_dtype_size(t->dtype), per = WBUF / es;
  uint64_t off = w->sh[t->shard].data_start + t->begin + (uint64_t)first * es;
  for (size_t i = 0; i < count; i += per) {
    size_t n = count - i < per ? count - i : per;
    for (size_t j = 0; j < n; j++) {
      double v = fs ? (double)fs[i + j] : ds[i + j];
      unsigned char *o = w->buf + j * es;
      uint64_t bits;
      switch (t->dtype) {
        case BICO_DTYPE_F32:
          if (fs) {
            uint32_t b32;
            memcpy(&b32, &fs[i + j], 4);
            bits = b32;
          } else {
            bits = round_to_format(v, 8, 23);
          }
          break;
        case BICO_DTYPE_F16: bits = round_to_format(v, 5, 10); break;
        case BICO_DTYPE_BF16: bits = round_to_format(v, 8, 7); break;
        default: memcpy(&bits, &v, 8); break;
      }
      store_le(o, bits, es);
    }
    st = w_pwrite(w, fn, t->shard, w->buf, n * es, off);
    if (st != BICO_OK) return st;
    off += n * es;
  }
  return BICO_OK;
}

bico_status bico_stwriter_write_f32(bico_stwriter *w, const char *name,
                                    const float *data, size_t count) {
  if (w == NULL) return BICO_E_NULL;
  size_t k;
  bico_status st = w_prepare(w, "stwriter_write_f32", name, data, &k);
  if (st == BICO_OK) st = w_count(w, "stwriter_write_f32", k, count);
  if (st == BICO_OK)
    st = w_convert(w, "stwriter_write_f32", k, data, NULL, 0, count);
  if (st == BICO_OK) w->t[k].written = 1;
  return st;
}

bico_status bico_stwriter_write_f64(bico_stwriter *w, const char *name,
                                    const double *data, size_t count) {
  if (w == NULL) return BICO_E_NULL;
  size_t k;
  bico_status st = w_prepare(w, "stwriter_write_f64", name, data, &k);
  if (st == BICO_OK) st = w_count(w, "stwriter_write_f64", k, count);
  if (st == BICO_OK)
    st = w_convert(w, "stwriter_write_f64", k, NULL, data, 0, count);
  if (st == BICO_OK) w->t[k].written = 1;
  return st;
}

/* Range writes: elements [first, first + count) in order, each range
 * starting where the last ended; the tensor is written with its last. */
static bico_status w_range(bico_stwriter *w, const char *fn, const char *name,
                           size_t first, const float *fs, const double *ds,
                           size_t count) {
  if (w == NULL) return BICO_E_NULL;
  size_t k;
  const void *data = fs ? (const void *)fs : (const void *)ds;
  bico_status st = w_prepare(w, fn, name, count ? data : "", &k);
  if (st != BICO_OK) return st;
  if (count > 0 && data == NULL)
    return bico__fail(w->ctx, BICO_E_NULL, "%s: data is NULL", fn);
  wt_tensor *t = &w->t[k];
  char nb[160];
  if (first > t->numel || count > t->numel - first)
    return bico__fail(w->ctx, BICO_E_SHAPE,
                      "%s: %s: tensor '%s' has %zu elements; range [%zu, "
                      "+%zu) does not fit",
                      fn, w->path, shortname(t->name, nb, sizeof nb),
                      t->numel, first, count);
  if (first != t->done)
    return bico__fail(w->ctx, BICO_E_STATE,
                      "%s: %s: tensor '%s': ranges are written in order; "
                      "the next starts at element %zu, not %zu",
                      fn, w->path, shortname(t->name, nb, sizeof nb), t->done,
                      first);
  st = count ? w_convert(w, fn, k, fs, ds, first, count) : w_layout(w, fn);
  if (st != BICO_OK) return st;
  t->done += count;
  if (t->done == t->numel) t->written = 1;
  return BICO_OK;
}

bico_status bico_stwriter_write_f32_range(bico_stwriter *w, const char *name,
                                          size_t first, const float *data,
                                          size_t count) {
  return w_range(w, "stwriter_write_f32_range", name, first, data, NULL,
                 count);
}

bico_status bico_stwriter_write_f64_range(bico_stwriter *w, const char *name,
                                          size_t first, const double *data,
                                          size_t count) {
  return w_range(w, "stwriter_write_f64_range", name, first, NULL, data,
                 count);
}

bico_status bico_stwriter_write_raw(bico_stwriter *w, const char *name,
                                    const void *data, size_t nbytes) {
  if (w == NULL) return BICO_E_NULL;
  const char *fn = "stwriter_write_raw";
  size_t k;
  bico_status st = w_prepare(w, fn, name, data, &k);
  if (st != BICO_OK) return st;
  wt_tensor *t = &w->t[k];
  if (nbytes != t->nbytes) {
    char nb[160];
    return bico__fail(w->ctx, BICO_E_SHAPE,
                      "%s: %s: tensor '%s' needs %zu bytes, got %zu", fn,
                      w->path, shortname(t->name, nb, sizeof nb), t->nbytes,
                      nbytes);
  }
  st = w_layout(w, fn);
  if (st == BICO_OK && nbytes > 0)
    st = w_pwrite(w, fn, t->shard, data, nbytes,
                  w->sh[t->shard].data_start + t->begin);
  if (st == BICO_OK) t->written = 1;
  return st;
}

/* Everything but the rename: the headers, the mode, fsync and close (and
 * a folder writer's index and copied files). */
static bico_status w_finish(bico_stwriter *w, const char *fn) {
  bico_ctx *ctx = w->ctx;
  bico__clear(ctx);
  bico_status st = w_state(w, fn, 0);
  if (st != BICO_OK) return st;
  for (size_t k = 0; k < w->count; k++)
    if (!w->t[k].written && w->t[k].nbytes > 0) {
      char nb[160];
      return bico__fail(ctx, BICO_E_STATE,
                        "%s: %s: tensor '%s' was declared but not written", fn,
                        w->path, shortname(w->t[k].name, nb, sizeof nb));
    }
  /* From here any failure ends the writer: only free remains. */
  w->finished = 1;
  st = w_layout(w, fn);
  for (size_t s = 0; s < w->nsh && st == BICO_OK; s++)
    st = bico__tmp_finish(ctx, fn, &w->sh[s].tf);
  if (st == BICO_OK && w->folder != NULL) {
    w_tables tb;
    st = w_tables_make(w, &tb);
    if (st == BICO_OK)
      st = bico__wfolder_finish(ctx, fn, w->folder, w->count, tb.names,
                                tb.sizes, tb.of, w->sh, w->nsh);
    w_tables_free(w, &tb);
  }
  return st;
}

/* A value JSON writes as it is (printable ASCII, no quote or backslash):
 * its length in the header is its length. */
static int plain(const char *s) {
  for (; *s; s++)
    if (*s < 0x20 || *s > 0x7e || *s == '"' || *s == '\\') return 0;
  return 1;
}

bico_status bico__stwriter_set_metadata(bico_stwriter *w, const char *key,
                                        const char *value) {
  const char *fn = "stwriter_set_metadata";
  bico_status st = w_state(w, fn, 0);
  if (st != BICO_OK) return st;
  size_t k = 0;
  while (k < w->nmeta && strcmp(w->meta[2 * k], key) != 0) k++;
  char *old = k < w->nmeta ? w->meta[2 * k + 1] : NULL;
  /* The header is written already: a value of another length would move
   * the data under it. */
  if (old == NULL || strlen(old) != strlen(value) || !plain(old) ||
      !plain(value))
    return bico__fail(w->ctx, BICO_E_STATE,
                      "%s: %s: metadata '%s' was not added with a value of "
                      "this length",
                      fn, w->path, key);
  memcpy(old, value, strlen(value));
  for (size_t s = 0; w->laid_out && s < w->nsh && st == BICO_OK; s++) {
    uint64_t start = w->sh[s].data_start;
    st = w_header(w, fn, s);
    if (st == BICO_OK && w->sh[s].data_start != start)
      st = bico__fail(w->ctx, BICO_E_STATE, "%s: %s: the header moved", fn,
                      w->path);
  }
  return st;
}

bico_status bico__stwriter_finish(bico_stwriter *w, bico__tmpfile **tf) {
  if (w == NULL) return BICO_E_NULL;
  if (w->folder != NULL)
    return bico__fail(w->ctx, BICO_E_STATE,
                      "stwriter_commit: %s: a folder writer commits several "
                      "files (bico__stwriter_finish_all)", w->path);
  bico_status st = w_finish(w, "stwriter_commit");
  *tf = st == BICO_OK ? &w->sh[0].tf : NULL;
  return st;
}

bico_status bico__stwriter_finish_all(bico_stwriter *w, bico__tmpfile ***tf,
                                      size_t *n) {
  if (w == NULL) return BICO_E_NULL;
  *tf = NULL;
  *n = 0;
  bico_status st = w_finish(w, "stwriter_commit");
  if (st != BICO_OK) return st;
  if (w->folder == NULL) {
    w->one = &w->sh[0].tf;
    *tf = &w->one;
    *n = 1;
    return BICO_OK;
  }
  return bico__wfolder_files(w->ctx, w->folder, w->sh, w->nsh, tf, n);
}

void bico__stwriter_committed(bico_stwriter *w) {
  if (w == NULL || w->folder == NULL) return;
  /* the shards went with the new folder */
  for (size_t k = 0; k < w->nsh; k++) w->sh[k].tf.gone = 1;
  bico__wfolder_committed(w->folder);
}

bico_status bico_stwriter_commit(bico_stwriter *w) {
  if (w == NULL) return BICO_E_NULL;
  bico__tmpfile **tf = NULL;
  size_t n = 0;
  bico_status st = bico__stwriter_finish_all(w, &tf, &n);
  if (st == BICO_OK) st = bico__commit(w->ctx, "stwriter_commit", tf, n);
  if (st == BICO_OK) bico__stwriter_committed(w);
  return st;
}

bico_status bico_stwriter_create_folder(bico_ctx *ctx, const char *dir,
                                        const char *like,
                                        uint64_t max_shard_size,
                                        bico_stwriter **out) {
  if (out != NULL) *out = NULL;
  if (ctx == NULL) return BICO_E_NULL;
  bico__clear(ctx);
  if (out == NULL || dir == NULL)
    return bico__fail(ctx, BICO_E_NULL, "stwriter_create_folder: %s is NULL",
                      out == NULL ? "out" : "dir");
  *out = NULL;
  bico_stwriter *w = bico__calloc(ctx, 1, sizeof *w);
  if (w == NULL) return BICO_E_NOMEM;
  w->ctx = ctx;
  w->path = bico__strdup(ctx, dir);
  w->buf = bico__alloc(ctx, WBUF);
  if (!w->path || !w->buf) {
    bico_stwriter_free(w);
    return BICO_E_NOMEM;
  }
  bico_status st = bico__wfolder_open(ctx, "stwriter_create_folder", dir,
                                      like, max_shard_size, &w->folder);
  if (st != BICO_OK) {
    bico_stwriter_free(w);
    return st;
  }
  *out = w;
  return BICO_OK;
}

bico_status bico__stwriter_provenance(bico_stwriter *w,
                                      const bico_stfile *base,
                                      const char *method, double alpha) {
  bico_status st = BICO_OK;
  int format = 0;
  size_t nm = bico__stfile_nmeta(base);
  for (size_t i = 0; i < nm && st == BICO_OK; i++) {
    const char *k, *v;
    st = bico_stfile_metadata_at(base, i, &k, &v);
    if (st != BICO_OK || strncmp(k, "bico.", 5) == 0 ||
        strcmp(k, "total_size") == 0)
      continue;
    if (strcmp(k, "format") == 0) format = 1;
    st = bico_stwriter_add_metadata(w, k, v);
  }
  if (st == BICO_OK && !format) st = bico_stwriter_add_metadata(w, "format", "pt");
  char num[64];
  snprintf(num, sizeof num, "%.9g", alpha);
  const char *dp = localeconv()->decimal_point;
  char *c = dp && dp[0] && dp[0] != '.' ? strchr(num, dp[0]) : NULL;
  if (c != NULL) *c = '.';
  if (st == BICO_OK)
    st = bico_stwriter_add_metadata(w, "bico.version", bico_version_string());
  if (st == BICO_OK && method != NULL)
    st = bico_stwriter_add_metadata(w, "bico.method", method);
  if (st == BICO_OK) st = bico_stwriter_add_metadata(w, "bico.alpha", num);
  return st;
}
