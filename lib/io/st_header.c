/* safetensors: one file's header, validated (the checks listed in
 * include/bico/safetensors.h), read with pread. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fileio.h"
#include "sha256.h"
#include "st_internal.h"

#define HEADER_LIMIT BICO__ST_HEADER_LIMIT
#define MAX_NDIM BICO__ST_MAX_NDIM

typedef bico__st_tensor st_tensor;
#define shortname bico__st_shortname

/* Valid safetensors dtypes that this version does not read. */
static const char *const unsupported_dtypes[] = {
    "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64", NULL};


static int tensor_push(bico_stfile *f, const st_tensor *t) {
  st_tensor *nt = bico__grow(f->ctx, f->tensors, f->count, &f->cap, 64,
                             sizeof *nt);
  if (nt == NULL) return 0;
  f->tensors = nt;
  f->tensors[f->count++] = *t;
  return 1;
}

/* Sorting tensors by offset uses an index array (no global state for
 * qsort, so the comparator sees tensors through pointers). */
static int cmp_offset(const void *a, const void *b) {
  const st_tensor *x = *(st_tensor *const *)a, *y = *(st_tensor *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
  return 0;
}

/* Parses one tensor entry of a header into *t. */
static bico_status parse_entry(bico_stfile *f, const char *path,
                               const char *name, const bico__json *v,
                               st_tensor *t) {
  bico_ctx *ctx = f->ctx;
  char nb[160];
  const char *nm = shortname(name, nb, sizeof nb);
  if (v->type != BICO__JSON_OBJECT)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': entry is not an object "
                      "(%s)",
                      path, nm, bico__json_type_name(v->type));
  const bico__json *jd = NULL, *js = NULL, *jo = NULL;
  for (size_t k = 0; k < v->n; k++) {
    const bico__json_member *m = &v->u.members[k];
    if (strcmp(m->key, "dtype") == 0 && m->key_len == 5)
      jd = &m->value;
    else if (strcmp(m->key, "shape") == 0 && m->key_len == 5)
      js = &m->value;
    else if (strcmp(m->key, "data_offsets") == 0 && m->key_len == 12)
      jo = &m->value;
    else {
      char kb[80];
      return bico__fail(ctx, BICO_E_FORMAT,
                        "stfile_open: %s: tensor '%s': unknown key '%s' in "
                        "its entry",
                        path, nm, shortname(m->key, kb, sizeof kb));
    }
  }
  const char *missing = !jd ? "dtype" : !js ? "shape" : !jo ? "data_offsets"
                                                            : NULL;
  if (missing)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': entry lacks '%s'", path,
                      nm, missing);
  /* dtype */
  if (jd->type != BICO__JSON_STRING)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': dtype is not a string "
                      "(%s)",
                      path, nm, bico__json_type_name(jd->type));
  memset(t, 0, sizeof *t);
  if (bico_dtype_from_name(jd->u.s, &t->dtype) != BICO_OK ||
      strlen(jd->u.s) != jd->n) {
    char db[40];
    for (int k = 0; unsupported_dtypes[k]; k++)
      if (strcmp(jd->u.s, unsupported_dtypes[k]) == 0)
        return bico__fail(ctx, BICO_E_UNSUPPORTED,
                          "stfile_open: %s: tensor '%s': dtype %s is not "
                          "supported by this version",
                          path, nm, jd->u.s);
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': unknown dtype '%s'", path,
                      nm, shortname(jd->u.s, db, sizeof db));
  }
  /* shape */
  if (js->type != BICO__JSON_ARRAY)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': shape is not an array "
                      "(%s)",
                      path, nm, bico__json_type_name(js->type));
  if (js->n > MAX_NDIM)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': shape has %zu "
                      "dimensions, more than %d",
                      path, nm, js->n, MAX_NDIM);
  t->ndim = js->n;
  t->shape = bico__arena_alloc(&f->arena, (js->n ? js->n : 1) * sizeof(size_t));
  if (t->shape == NULL) return BICO_E_NOMEM;
  size_t numel = 1;
  int overflow = 0;
  for (size_t k = 0; k < js->n; k++) {
    const bico__json *e = &js->u.items[k];
    if (e->type != BICO__JSON_INT || e->u.i < 0)
      return bico__fail(ctx, BICO_E_FORMAT,
                        "stfile_open: %s: tensor '%s': shape entry %zu is %s, "
                        "not a non-negative integer",
                        path, nm, k,
                        e->type == BICO__JSON_INT ? "negative"
                                                  : bico__json_type_name(e->type));
    if ((uint64_t)e->u.i > SIZE_MAX) overflow = 1;
    t->shape[k] = (size_t)e->u.i;
    if (!overflow && bico__mul(numel, t->shape[k], &numel)) overflow = 1;
  }
  size_t nbytes = 0;
  if (overflow || bico__mul(numel, bico_dtype_size(t->dtype), &nbytes))
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': shape's byte size "
                      "overflows",
                      path, nm);
  /* A zero anywhere makes the product 0 even after an overflowing prefix;
   * the check above already refused such prefixes, which is what we want
   * (the header is nonsense either way). */
  t->numel = numel;
  t->nbytes = nbytes;
  /* data_offsets */
  if (jo->type != BICO__JSON_ARRAY || jo->n != 2 ||
      jo->u.items[0].type != BICO__JSON_INT ||
      jo->u.items[1].type != BICO__JSON_INT || jo->u.items[0].u.i < 0 ||
      jo->u.items[1].u.i < 0)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': data_offsets must be two "
                      "non-negative integers [begin, end]",
                      path, nm);
  int64_t b0 = jo->u.items[0].u.i, b1 = jo->u.items[1].u.i;
  if (b1 < b0)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': data_offsets [%lld, %lld] "
                      "end before begin",
                      path, nm, (long long)b0, (long long)b1);
  if ((uint64_t)(b1 - b0) != (uint64_t)nbytes)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': data_offsets [%lld, %lld] "
                      "span %lld bytes but dtype %s with %zu elements needs "
                      "%zu (shape/size mismatch)",
                      path, nm, (long long)b0, (long long)b1,
                      (long long)(b1 - b0), bico_dtype_name(t->dtype), numel,
                      nbytes);
  t->begin = (uint64_t)b0;
  t->name = bico__arena_strndup(&f->arena, name, strlen(name));
  if (t->name == NULL) return BICO_E_NOMEM;
  return BICO_OK;
}

/* Checks "__metadata__" (strings only, no NUL) and keeps it if want. */
static bico_status load_meta(bico_stfile *f, const char *path,
                             const bico__json *md, int want_meta) {
  bico_ctx *ctx = f->ctx;
  char nb[160];
  if (md->type != BICO__JSON_OBJECT)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: __metadata__ is not an object (%s)",
                      path, bico__json_type_name(md->type));
  for (size_t j = 0; j < md->n; j++) {
    const bico__json_member *e = &md->u.members[j];
    if (e->value.type != BICO__JSON_STRING)
      return bico__fail(ctx, BICO_E_FORMAT,
                        "stfile_open: %s: __metadata__ entry '%s' is not a "
                        "string (%s)",
                        path, shortname(e->key, nb, sizeof nb),
                        bico__json_type_name(e->value.type));
    if (strlen(e->key) != e->key_len || strlen(e->value.u.s) != e->value.n)
      return bico__fail(ctx, BICO_E_FORMAT,
                        "stfile_open: %s: __metadata__ entry '%s' holds a "
                        "NUL byte",
                        path, shortname(e->key, nb, sizeof nb));
  }
  if (!want_meta) return BICO_OK;
  f->meta = bico__arena_alloc(&f->arena, (md->n ? md->n : 1) * sizeof *f->meta);
  if (f->meta == NULL) return BICO_E_NOMEM;
  for (size_t j = 0; j < md->n; j++) {
    const bico__json_member *e = &md->u.members[j];
    f->meta[j].key = bico__arena_strndup(&f->arena, e->key, e->key_len);
    f->meta[j].value = bico__arena_strndup(&f->arena, e->value.u.s, e->value.n);
    if (!f->meta[j].key || !f->meta[j].value) return BICO_E_NOMEM;
  }
  f->nmeta = md->n;
  return BICO_OK;
}

/* The offsets of tensors [first, f->count) must tile [0, dsize) exactly. */
static bico_status check_tiling(bico_stfile *f, const char *path, size_t first,
                                size_t dsize) {
  bico_ctx *ctx = f->ctx;
  bico_status st = BICO_OK;
  size_t nt = f->count - first;
  if (nt == 0) {
    if (dsize != 0)
      return bico__fail(ctx, BICO_E_FORMAT,
                        "stfile_open: %s: %zu trailing bytes after the header "
                        "of a file with no tensors",
                        path, dsize);
    return BICO_OK;
  }
  st_tensor **ord = bico__alloc(ctx, nt * sizeof *ord);
  if (ord == NULL) return BICO_E_NOMEM;
  for (size_t k = 0; k < nt; k++) ord[k] = &f->tensors[first + k];
  qsort(ord, nt, sizeof *ord, cmp_offset);
  uint64_t expect = 0;
  const st_tensor *prev = NULL;
  for (size_t k = 0; k < nt && st == BICO_OK; k++) {
    const st_tensor *t = ord[k];
    char nb[160], pb[160];
    uint64_t end = t->begin + t->nbytes;
    if (t->begin < expect) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': data_offsets [%llu, %llu] "
                      "overlap tensor '%s' ending at %llu",
                      path, shortname(t->name, nb, sizeof nb),
                      (unsigned long long)t->begin, (unsigned long long)end,
                      shortname(prev->name, pb, sizeof pb),
                      (unsigned long long)expect);
    } else if (t->begin > expect) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': gap of %llu bytes in the "
                      "data buffer before its data_offsets [%llu, %llu]",
                      path, shortname(t->name, nb, sizeof nb),
                      (unsigned long long)(t->begin - expect),
                      (unsigned long long)t->begin, (unsigned long long)end);
    } else if (end > dsize) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': data_offsets end %llu "
                      "beyond the %zu-byte data buffer (truncated file)",
                      path, shortname(t->name, nb, sizeof nb),
                      (unsigned long long)end, dsize);
    }
    expect = end;
    prev = t;
  }
  bico__free(ctx, ord);
  if (st != BICO_OK) return st;
  if (expect < dsize)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: %llu trailing bytes after the last "
                      "tensor (data buffer %zu bytes, tensors cover %llu)",
                      path, (unsigned long long)(dsize - expect), dsize,
                      (unsigned long long)expect);
  return BICO_OK;
}

/* Reads the 8-byte length and the header text of files[file]. */
void bico__st_header_digest(const unsigned char lenb[8], const char *json,
                            size_t n, char hex[65]) {
  bico__sha256 h;
  bico__sha256_init(&h);
  bico__sha256_update(&h, lenb, 8);
  bico__sha256_update(&h, json, n);
  bico__sha256_final_hex(&h, hex);
}

static bico_status read_header(bico_stfile *f, size_t file, char **text,
                               uint64_t *len) {
  bico_ctx *ctx = f->ctx;
  bico__st_file *m = &f->files[file];
  const char *path = m->path;
  *text = NULL;
  bico_status st = bico__open_input(ctx, "stfile_open", path, &m->fd, &m->size);
  if (st != BICO_OK) return st;
  if (m->size < 8)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: file is %llu bytes, shorter than the "
                      "8-byte header length (truncated)",
                      path, (unsigned long long)m->size);
  unsigned char lenb[8];
  int e = bico__pread_all(m->fd, lenb, 8, 0);
  uint64_t n = bico__st_load_le(lenb, 8);
  if (e == 0 && n > HEADER_LIMIT)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: header length %llu exceeds the limit "
                      "of %u bytes",
                      path, (unsigned long long)n, HEADER_LIMIT);
  if (e == 0 && n > m->size - 8)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: header length %llu exceeds the %llu "
                      "bytes after the length field (truncated file?)",
                      path, (unsigned long long)n,
                      (unsigned long long)(m->size - 8));
  char *buf = e == 0 ? bico__alloc(ctx, (size_t)n + 1) : NULL;
  if (e == 0 && buf == NULL) return BICO_E_NOMEM;
  if (e == 0) e = bico__pread_all(m->fd, buf, (size_t)n, 8);
  if (e != 0) {
    bico__free(ctx, buf);
    return bico__fail(ctx, BICO_E_IO, "stfile_open: %s: read failed: %s", path,
                      e == EIO ? "the file shrank while being read"
                               : strerror(e));
  }
  buf[n] = '\0';
  struct stat sb;
  if (fstat(m->fd, &sb) == 0) {
    m->dev = (uint64_t)sb.st_dev;
    m->ino = (uint64_t)sb.st_ino;
    m->mtime_sec = (int64_t)sb.st_mtim.tv_sec;
    m->mtime_nsec = (int64_t)sb.st_mtim.tv_nsec;
  }
  bico__st_header_digest(lenb, buf, (size_t)n, m->head);
  if (n == 0 || buf[0] != '{') {
    bico__free(ctx, buf);
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: header does not begin with '{'", path);
  }
  *text = buf;
  *len = n;
  return BICO_OK;
}

bico_status bico__st_load_one(bico_stfile *f, size_t file, int want_meta) {
  bico_ctx *ctx = f->ctx;
  const char *path = f->files[file].path;
  char *text = NULL;
  uint64_t n = 0;
  bico_status st = read_header(f, file, &text, &n);
  if (st != BICO_OK) return st;
  char what[512];
  snprintf(what, sizeof what, "stfile_open: %s: header", path);
  bico__json_doc *doc = NULL;
  st = bico__json_parse(ctx, what, text, (size_t)n, &doc);
  bico__free(ctx, text);
  if (st != BICO_OK) return st;
  const bico__json *root = &doc->root;
  if (root->type != BICO__JSON_OBJECT) {
    bico__json_doc_free(doc);
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: header is not a JSON object (%s)",
                      path, bico__json_type_name(root->type));
  }
  size_t first = f->count;
  uint64_t start = 8 + n;
  for (size_t k = 0; k < root->n && st == BICO_OK; k++) {
    const bico__json_member *mem = &root->u.members[k];
    char nb[160];
    if (strlen(mem->key) != mem->key_len) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s': name holds a NUL byte",
                      path, shortname(mem->key, nb, sizeof nb));
      break;
    }
    if (strcmp(mem->key, "__metadata__") == 0) {
      st = load_meta(f, path, &mem->value, want_meta);
      continue;
    }
    st_tensor t;
    st = parse_entry(f, path, mem->key, &mem->value, &t);
    if (st != BICO_OK) break;
    t.file = file;
    t.off = start + t.begin;
    if (!tensor_push(f, &t)) st = BICO_E_NOMEM;
  }
  bico__json_doc_free(doc);
  if (st != BICO_OK) return st;
  return check_tiling(f, path, first, (size_t)(f->files[file].size - start));
}
