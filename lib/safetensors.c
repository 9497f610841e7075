/* safetensors: validating mmap reader, sharded index, atomic writer. */
/* madvise(MADV_DONTNEED) is not in POSIX (posix_madvise's DONTNEED is a
 * no-op in glibc). */
#define _DEFAULT_SOURCE 1
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "internal.h"
#include "modelpath.h"
#include "json.h"
#include "strindex.h"

#define HEADER_LIMIT 100000000u
#define MAX_NDIM 64

/* ---- dtypes ---- */

static const struct {
  const char *name;
  size_t size;
} dtypes[] = {
    {NULL, 0},     {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F64", 8},
    {"I8", 1},     {"I16", 2}, {"I32", 4}, {"I64", 8},  {"U8", 1},
    {"U16", 2},    {"U32", 4}, {"U64", 8}, {"BOOL", 1},
};
#define NDTYPES ((int)(sizeof dtypes / sizeof dtypes[0]))

/* Valid safetensors dtypes that this version does not read. */
static const char *const unsupported_dtypes[] = {
    "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64", NULL};

const char *bico_dtype_name(int dtype) {
  return dtype > 0 && dtype < NDTYPES ? dtypes[dtype].name : NULL;
}

size_t bico_dtype_size(int dtype) {
  return dtype > 0 && dtype < NDTYPES ? dtypes[dtype].size : 0;
}

bico_status bico_dtype_from_name(const char *name, int *dtype) {
  if (name == NULL || dtype == NULL) return BICO_E_NULL;
  for (int d = 1; d < NDTYPES; d++)
    if (strcmp(dtypes[d].name, name) == 0) {
      *dtype = d;
      return BICO_OK;
    }
  return BICO_E_NOTFOUND;
}

static int is_float_dtype(int d) {
  return d == BICO_DTYPE_F32 || d == BICO_DTYPE_F16 || d == BICO_DTYPE_BF16 ||
         d == BICO_DTYPE_F64;
}

/* ---- element conversion (little-endian bytes, any alignment) ---- */

static uint64_t load_le(const unsigned char *p, size_t n) {
  uint64_t v = 0;
  for (size_t k = n; k-- > 0;) v = (v << 8) | p[k];
  return v;
}

static void store_le(unsigned char *p, uint64_t v, size_t n) {
  for (size_t k = 0; k < n; k++) {
    p[k] = (unsigned char)(v & 0xff);
    v >>= 8;
  }
}

static float f32_from_bits(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

static double f64_from_bits(uint64_t b) {
  double d;
  memcpy(&d, &b, 8);
  return d;
}

/* IEEE half to float: exact (every half is a float). */
static float half_to_float(uint32_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f,
           man = h & 0x3ff;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24, exact in float */
    float v = (float)man * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

/* Rounds a double to the nearest value (ties to even) of a binary format
 * with ebits exponent bits and mbits stored mantissa bits, returning its
 * bit pattern; overflow gives Inf, NaN a quiet NaN of the same sign.  One
 * rounding from double (f32 inputs are exact in double), so no double
 * rounding happens on the way to F16 or BF16. */
static uint64_t round_to_format(double x, int ebits, int mbits) {
  uint64_t b;
  memcpy(&b, &x, 8);
  uint64_t sign = (b >> 63) << (ebits + mbits);
  int e = (int)((b >> 52) & 0x7ff);
  uint64_t m = b & 0xfffffffffffffull;
  uint64_t expmax = ((uint64_t)1 << ebits) - 1;
  if (e == 0x7ff) {
    if (m == 0) return sign | (expmax << mbits);
    return sign | (expmax << mbits) | ((uint64_t)1 << (mbits - 1));
  }
  if (e == 0) return sign; /* zero or double subnormal: far below any target */
  m |= (uint64_t)1 << 52;
  int E = e - 1023;
  int bias = (1 << (ebits - 1)) - 1;
  int emin = 1 - bias;
  int qexp = (E >= emin ? E : emin) - mbits; /* exponent of one unit */
  int s = qexp - (E - 52);                    /* right shift of m */
  uint64_t q;
  if (s >= 54) {
    q = 0;
  } else {
    q = m >> s;
    uint64_t rem = m & (((uint64_t)1 << s) - 1), half = (uint64_t)1 << (s - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
  }
  uint64_t bits;
  if (E >= emin)
    bits = ((uint64_t)(E + bias - 1) << mbits) + q; /* carry bumps exp */
  else
    bits = q; /* subnormal, or the smallest normal after rounding up */
  if (bits >= (expmax << mbits)) bits = expmax << mbits;
  return sign | bits;
}

static float double_to_float(double x) {
  return f32_from_bits((uint32_t)round_to_format(x, 8, 23));
}

/* Element k of a buffer of dtype d as double (exact for every dtype but
 * I64/U64 beyond 2^53). */
static double elem_f64(const unsigned char *p, int d) {
  switch (d) {
    case BICO_DTYPE_F32: return f32_from_bits((uint32_t)load_le(p, 4));
    case BICO_DTYPE_F16: return half_to_float((uint32_t)load_le(p, 2));
    case BICO_DTYPE_BF16: return f32_from_bits((uint32_t)load_le(p, 2) << 16);
    case BICO_DTYPE_F64: return f64_from_bits(load_le(p, 8));
    case BICO_DTYPE_I8: return (int8_t)p[0];
    case BICO_DTYPE_I16: return (int16_t)(uint16_t)load_le(p, 2);
    case BICO_DTYPE_I32: return (int32_t)(uint32_t)load_le(p, 4);
    case BICO_DTYPE_I64: return (double)(int64_t)load_le(p, 8);
    case BICO_DTYPE_U8: return p[0];
    case BICO_DTYPE_U16: return (double)load_le(p, 2);
    case BICO_DTYPE_U32: return (double)load_le(p, 4);
    case BICO_DTYPE_U64: return (double)load_le(p, 8);
    case BICO_DTYPE_BOOL: return p[0] != 0;
  }
  return 0;
}

static float elem_f32(const unsigned char *p, int d) {
  switch (d) {
    case BICO_DTYPE_F32: return f32_from_bits((uint32_t)load_le(p, 4));
    case BICO_DTYPE_F16: return half_to_float((uint32_t)load_le(p, 2));
    case BICO_DTYPE_BF16: return f32_from_bits((uint32_t)load_le(p, 2) << 16);
    case BICO_DTYPE_I64: return (float)(int64_t)load_le(p, 8);
    case BICO_DTYPE_U64: return (float)load_le(p, 8);
    default: return double_to_float(elem_f64(p, d));
  }
}

/* ---- reader ---- */

typedef struct st_tensor {
  const char *name;
  int dtype;
  size_t ndim;
  size_t *shape;
  size_t numel, nbytes;
  uint64_t begin; /* offset in the data buffer */
  const unsigned char *data;
  size_t file; /* index into maps */
} st_tensor;

typedef struct st_map {
  char *path;
  void *base;
  size_t size;
} st_map;

typedef struct st_meta {
  const char *key, *value;
} st_meta;

struct bico_stfile {
  bico_ctx *ctx;
  const char *path; /* as opened (the index, for a sharded checkpoint) */
  bico__arena arena; /* names, shapes, metadata, paths */
  st_map *maps;
  size_t nmaps;
  st_tensor *tensors;
  size_t count, cap;
  size_t *by_name; /* tensor indices sorted by name */
  st_meta *meta;
  size_t nmeta;
};

/* A name for messages: cut long ones. */
static const char *shortname(const char *s, char *buf, size_t cap) {
  size_t n = strlen(s);
  if (n < cap) return s;
  snprintf(buf, cap, "%.*s...", (int)(cap - 4), s);
  return buf;
}

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

static int cmp_name(const void *a, const void *b) {
  const st_tensor *x = *(st_tensor *const *)a, *y = *(st_tensor *const *)b;
  return strcmp(x->name, y->name);
}

/* Parses one tensor entry of a header; fills *t (data pointer later). */
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

static bico_status io_fail(bico_ctx *ctx, const char *fn, const char *path,
                           const char *what, int err) {
  return bico__fail(ctx, BICO_E_IO, "%s: %s: %s: %s", fn, path, what,
                    strerror(err));
}

/* Maps a whole file read-only. */
static bico_status map_file(bico_stfile *f, const char *path, st_map *m) {
  bico_ctx *ctx = f->ctx;
  memset(m, 0, sizeof m[0]);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_fail(ctx, "stfile_open", path, "cannot open", errno);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return io_fail(ctx, "stfile_open", path, "cannot stat", e);
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return bico__fail(ctx, BICO_E_IO, "stfile_open: %s: not a regular file",
                      path);
  }
  if ((uint64_t)st.st_size > SIZE_MAX) {
    close(fd);
    return bico__fail(ctx, BICO_E_IO, "stfile_open: %s: file too large to map",
                      path);
  }
  m->size = (size_t)st.st_size;
  m->path = bico__arena_strndup(&f->arena, path, strlen(path));
  if (m->path == NULL) {
    close(fd);
    return BICO_E_NOMEM;
  }
  if (m->size < 8) {
    close(fd);
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: file is %zu bytes, shorter than the "
                      "8-byte header length (truncated)",
                      path, m->size);
  }
  void *base = mmap(NULL, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
  int e = errno;
  close(fd);
  if (base == MAP_FAILED) return io_fail(ctx, "stfile_open", path, "mmap", e);
  m->base = base;
  return BICO_OK;
}

/* Validates and appends the tensors of one mapped safetensors file. */
static bico_status load_one(bico_stfile *f, size_t file, int want_meta) {
  bico_ctx *ctx = f->ctx;
  st_map *m = &f->maps[file];
  const char *path = m->path;
  const unsigned char *p = m->base;
  uint64_t n = load_le(p, 8);
  if (n > HEADER_LIMIT)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: header length %llu exceeds the limit "
                      "of %u bytes",
                      path, (unsigned long long)n, HEADER_LIMIT);
  if (n > m->size - 8)
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: header length %llu exceeds the %zu "
                      "bytes after the length field (truncated file?)",
                      path, (unsigned long long)n, m->size - 8);
  if (n == 0 || p[8] != '{')
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: header does not begin with '{'", path);
  char what[512];
  snprintf(what, sizeof what, "stfile_open: %s: header", path);
  bico__json_doc *doc = NULL;
  bico_status st = bico__json_parse(ctx, what, (const char *)p + 8, (size_t)n,
                                    &doc);
  if (st != BICO_OK) return st;
  const bico__json *root = &doc->root;
  if (root->type != BICO__JSON_OBJECT) {
    bico__json_doc_free(doc);
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: header is not a JSON object (%s)",
                      path, bico__json_type_name(root->type));
  }
  size_t first = f->count;
  const unsigned char *data = p + 8 + n;
  size_t dsize = m->size - 8 - (size_t)n;
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
      const bico__json *md = &mem->value;
      if (md->type != BICO__JSON_OBJECT) {
        st = bico__fail(ctx, BICO_E_FORMAT,
                        "stfile_open: %s: __metadata__ is not an object (%s)",
                        path, bico__json_type_name(md->type));
        break;
      }
      for (size_t j = 0; j < md->n; j++) {
        const bico__json_member *e = &md->u.members[j];
        if (e->value.type != BICO__JSON_STRING) {
          st = bico__fail(ctx, BICO_E_FORMAT,
                          "stfile_open: %s: __metadata__ entry '%s' is not a "
                          "string (%s)",
                          path, shortname(e->key, nb, sizeof nb),
                          bico__json_type_name(e->value.type));
          break;
        }
        if (strlen(e->key) != e->key_len ||
            strlen(e->value.u.s) != e->value.n) {
          st = bico__fail(ctx, BICO_E_FORMAT,
                          "stfile_open: %s: __metadata__ entry '%s' holds a "
                          "NUL byte",
                          path, shortname(e->key, nb, sizeof nb));
          break;
        }
      }
      if (st != BICO_OK || !want_meta) continue;
      f->meta = bico__arena_alloc(&f->arena, (md->n ? md->n : 1) * sizeof *f->meta);
      if (f->meta == NULL) {
        st = BICO_E_NOMEM;
        break;
      }
      for (size_t j = 0; j < md->n; j++) {
        const bico__json_member *e = &md->u.members[j];
        f->meta[j].key = bico__arena_strndup(&f->arena, e->key, e->key_len);
        f->meta[j].value =
            bico__arena_strndup(&f->arena, e->value.u.s, e->value.n);
        if (!f->meta[j].key || !f->meta[j].value) {
          st = BICO_E_NOMEM;
          break;
        }
      }
      f->nmeta = md->n;
      continue;
    }
    st_tensor t;
    st = parse_entry(f, path, mem->key, &mem->value, &t);
    if (st != BICO_OK) break;
    t.file = file;
    if (!tensor_push(f, &t)) st = BICO_E_NOMEM;
  }
  bico__json_doc_free(doc);
  if (st != BICO_OK) return st;
  /* Offsets must tile [0, dsize) exactly. */
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
  for (size_t k = first; k < f->count; k++)
    f->tensors[k].data = data + f->tensors[k].begin;
  return BICO_OK;
}

static int ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* Reads a small whole file (the index) into ctx memory. */
static bico_status read_small(bico_ctx *ctx, const char *path, char **out,
                              size_t *len) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_fail(ctx, "stfile_open", path, "cannot open", errno);
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return bico__fail(ctx, BICO_E_IO, "stfile_open: %s: not a regular file",
                      path);
  }
  if ((uint64_t)st.st_size > HEADER_LIMIT) {
    close(fd);
    return bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: index of %lld bytes exceeds the limit "
                      "of %u bytes",
                      path, (long long)st.st_size, HEADER_LIMIT);
  }
  size_t n = (size_t)st.st_size;
  char *buf = bico__alloc(ctx, n + 1);
  if (buf == NULL) {
    close(fd);
    return BICO_E_NOMEM;
  }
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int e = r < 0 ? errno : EIO;
      close(fd);
      bico__free(ctx, buf);
      return io_fail(ctx, "stfile_open", path, "read", e);
    }
    got += (size_t)r;
  }
  close(fd);
  buf[n] = '\0';
  *out = buf;
  *len = n;
  return BICO_OK;
}

typedef struct wm_entry {
  const char *tensor;
  size_t shard;
} wm_entry;

static int cmp_wm(const void *a, const void *b) {
  return strcmp(((const wm_entry *)a)->tensor, ((const wm_entry *)b)->tensor);
}

static bico_status load_index(bico_stfile *f, const char *path) {
  bico_ctx *ctx = f->ctx;
  char *text = NULL;
  size_t len = 0;
  bico_status st = read_small(ctx, path, &text, &len);
  if (st != BICO_OK) return st;
  char what[512];
  snprintf(what, sizeof what, "stfile_open: %s", path);
  bico__json_doc *doc = NULL;
  st = bico__json_parse(ctx, what, text, len, &doc);
  bico__free(ctx, text);
  if (st != BICO_OK) return st;
  const bico__json *root = &doc->root, *wm = bico__json_get(root, "weight_map");
  const bico__json *md = bico__json_get(root, "metadata");
  wm_entry *ents = NULL;
  const char **shards = NULL;
  size_t nshards = 0;
  if (root->type != BICO__JSON_OBJECT || wm == NULL ||
      wm->type != BICO__JSON_OBJECT) {
    st = bico__fail(ctx, BICO_E_FORMAT,
                    "stfile_open: %s: index lacks a \"weight_map\" object",
                    path);
    goto done;
  }
  if (md != NULL && md->type != BICO__JSON_OBJECT) {
    st = bico__fail(ctx, BICO_E_FORMAT,
                    "stfile_open: %s: index \"metadata\" is not an object "
                    "(%s)",
                    path, bico__json_type_name(md->type));
    goto done;
  }
  /* Index metadata: strings as they are, numbers as their JSON text. */
  if (md != NULL && md->n > 0) {
    f->meta = bico__arena_alloc(&f->arena, md->n * sizeof *f->meta);
    if (f->meta == NULL) {
      st = BICO_E_NOMEM;
      goto done;
    }
    for (size_t k = 0; k < md->n; k++) {
      const bico__json_member *e = &md->u.members[k];
      char num[64];
      const char *val = NULL;
      if (e->value.type == BICO__JSON_STRING)
        val = e->value.u.s;
      else if (e->value.type == BICO__JSON_INT) {
        snprintf(num, sizeof num, "%lld", (long long)e->value.u.i);
        val = num;
      } else if (e->value.type == BICO__JSON_REAL) {
        /* render through the JSON writer: locale-independent */
        bico__jw jw;
        bico__jw_init(&jw, ctx, 0);
        bico__jw_double(&jw, e->value.u.d);
        if (jw.err == BICO_OK && jw.len < sizeof num) {
          memcpy(num, jw.buf, jw.len + 1);
          val = num;
        }
        bico__jw_free(&jw);
      }
      if (val == NULL) continue;
      st_meta *mm = &f->meta[f->nmeta];
      mm->key = bico__arena_strndup(&f->arena, e->key, strlen(e->key));
      mm->value = bico__arena_strndup(&f->arena, val, strlen(val));
      if (!mm->key || !mm->value) {
        st = BICO_E_NOMEM;
        goto done;
      }
      f->nmeta++;
    }
  }
  /* The folder of the index holds the shards. */
  const char *slash = strrchr(path, '/');
  size_t dirlen = slash ? (size_t)(slash - path) + 1 : 0;
  size_t nw = wm->n;
  ents = bico__alloc(ctx, (nw ? nw : 1) * sizeof *ents);
  shards = bico__alloc(ctx, (nw ? nw : 1) * sizeof *shards);
  if (ents == NULL || shards == NULL) {
    st = BICO_E_NOMEM;
    goto done;
  }
  for (size_t k = 0; k < nw; k++) {
    const bico__json_member *e = &wm->u.members[k];
    char nb[160];
    const char *sh = e->value.u.s;
    if (e->value.type != BICO__JSON_STRING) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: weight_map entry for tensor '%s' is "
                      "not a file name (%s)",
                      path, shortname(e->key, nb, sizeof nb),
                      bico__json_type_name(e->value.type));
      goto done;
    }
    if (e->value.n == 0 || strlen(sh) != e->value.n || strchr(sh, '/') ||
        strcmp(sh, ".") == 0 || strcmp(sh, "..") == 0 ||
        strlen(e->key) != e->key_len) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: weight_map entry for tensor '%s' names "
                      "shard '%s', not a file in the index's folder",
                      path, shortname(e->key, nb, sizeof nb), sh);
      goto done;
    }
    size_t s = 0;
    while (s < nshards && strcmp(shards[s], sh) != 0) s++;
    if (s == nshards) shards[nshards++] = sh;
    ents[k].tensor = e->key;
    ents[k].shard = s;
  }
  f->maps = bico__calloc(ctx, nshards ? nshards : 1, sizeof *f->maps);
  if (f->maps == NULL) {
    st = BICO_E_NOMEM;
    goto done;
  }
  for (size_t s = 0; s < nshards; s++) {
    size_t sl = strlen(shards[s]);
    char *sp = bico__arena_alloc(&f->arena, dirlen + sl + 1);
    if (sp == NULL) {
      st = BICO_E_NOMEM;
      goto done;
    }
    memcpy(sp, path, dirlen);
    memcpy(sp + dirlen, shards[s], sl + 1);
    st = map_file(f, sp, &f->maps[s]);
    f->nmaps = s + 1;
    if (st == BICO_OK) st = load_one(f, s, 0);
    if (st != BICO_OK) {
      /* say which index referred to the shard */
      char msg[BICO_ERRMSG_CAP];
      snprintf(msg, sizeof msg, "%s", bico_ctx_errmsg(ctx));
      bico__fail(ctx, st, "%s (shard '%s' of index %s)", msg, shards[s], path);
      goto done;
    }
  }
  /* Every weight_map entry must be in its shard and every shard tensor in
   * the weight_map under that shard. */
  qsort(ents, nw, sizeof *ents, cmp_wm);
  for (size_t k = 0; k < f->count; k++) {
    const st_tensor *t = &f->tensors[k];
    wm_entry key = {t->name, 0};
    const wm_entry *hit = bsearch(&key, ents, nw, sizeof *ents, cmp_wm);
    char nb[160];
    if (hit == NULL) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: shard '%s' holds tensor '%s' that the "
                      "weight_map does not list",
                      path, shards[t->file], shortname(t->name, nb, sizeof nb));
      goto done;
    }
    if (hit->shard != t->file) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s' is in shard '%s' but the "
                      "weight_map assigns it to '%s'",
                      path, shortname(t->name, nb, sizeof nb),
                      shards[t->file], shards[hit->shard]);
      goto done;
    }
  }
  if (f->count != nw) {
    /* Some listed tensor is missing: find it for the message. */
    st_tensor **byname = bico__alloc(ctx, (f->count ? f->count : 1) * sizeof *byname);
    if (byname == NULL) {
      st = BICO_E_NOMEM;
      goto done;
    }
    for (size_t k = 0; k < f->count; k++) byname[k] = &f->tensors[k];
    qsort(byname, f->count, sizeof *byname, cmp_name);
    for (size_t k = 0; k < nw; k++) {
      st_tensor probe;
      probe.name = ents[k].tensor;
      st_tensor *pp = &probe;
      if (bsearch(&pp, byname, f->count, sizeof *byname, cmp_name) == NULL) {
        char nb[160];
        st = bico__fail(ctx, BICO_E_FORMAT,
                        "stfile_open: %s: weight_map lists tensor '%s' in "
                        "shard '%s', which does not hold it",
                        path, shortname(ents[k].tensor, nb, sizeof nb),
                        shards[ents[k].shard]);
        break;
      }
    }
    bico__free(ctx, byname);
    if (st == BICO_OK)
      st = bico__fail(ctx, BICO_E_INTERNAL,
                      "stfile_open: %s: tensor count mismatch", path);
  }
done:
  bico__free(ctx, ents);
  bico__free(ctx, shards);
  bico__json_doc_free(doc);
  return st;
}

void bico_stfile_close(bico_stfile *f) {
  if (f == NULL) return;
  bico_ctx *ctx = f->ctx;
  for (size_t k = 0; k < f->nmaps; k++)
    if (f->maps[k].base) munmap(f->maps[k].base, f->maps[k].size);
  bico__free(ctx, f->maps);
  bico__free(ctx, f->tensors);
  bico__free(ctx, f->by_name);
  bico__arena_free(&f->arena);
  bico__free(ctx, f);
}

bico_status bico_stfile_open(bico_ctx *ctx, const char *path,
                             bico_stfile **out) {
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
    st = load_index(f, path);
  } else {
    f->maps = bico__calloc(ctx, 1, sizeof *f->maps);
    if (f->maps == NULL) {
      st = BICO_E_NOMEM;
    } else {
      st = map_file(f, path, &f->maps[0]);
      f->nmaps = 1;
      if (st == BICO_OK) st = load_one(f, 0, 1);
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
    bico_stfile_close(f);
    return st;
  }
  *out = f;
  return BICO_OK;
}

size_t bico_stfile_count(const bico_stfile *f) {
  return f == NULL ? 0 : f->count;
}

/* Entry checks shared by the per-tensor accessors. */
static bico_status check_index(const bico_stfile *f, const char *fn,
                               size_t index) {
  if (f == NULL) return BICO_E_NULL;
  bico__clear(f->ctx);
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
  *path = f->maps[f->tensors[index].file].path;
  return BICO_OK;
}

static const char *f_key(const void *f, size_t i) {
  return ((const bico_stfile *)f)->tensors[i].name;
}

bico_status bico_stfile_find(const bico_stfile *f, const char *name,
                             size_t *index) {
  if (f == NULL) return BICO_E_NULL;
  bico__clear(f->ctx);
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

bico_status bico_stfile_data(const bico_stfile *f, size_t index,
                             const void **data, size_t *nbytes) {
  bico_status st = check_index(f, "stfile_data", index);
  if (st != BICO_OK) return st;
  if (data == NULL || nbytes == NULL)
    return bico__fail(f->ctx, BICO_E_NULL, "stfile_data: %s is NULL",
                      data == NULL ? "data" : "nbytes");
  *data = f->tensors[index].data;
  *nbytes = f->tensors[index].nbytes;
  return BICO_OK;
}

static int host_little_endian(void) {
  const uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

/* Releases the resident pages that lie wholly inside [p, p + n) of a
 * read-only mapping: after a tensor has been copied out or scanned, its
 * pages need not stay in the process's resident set (a later access reads
 * them again from the page cache).  This keeps a run that streams through
 * checkpoints larger than memory at the size of its working buffers. */
static void drop_pages(const unsigned char *p, size_t n) {
  static long page = 0;
  if (page == 0) page = sysconf(_SC_PAGESIZE);
  if (page <= 0 || n < (size_t)page) return;
  uintptr_t a = ((uintptr_t)p + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
  uintptr_t b = ((uintptr_t)p + n) & ~((uintptr_t)page - 1);
  if (b > a) (void)madvise((void *)a, b - a, MADV_DONTNEED);
}

void bico__stfile_drop(const bico_stfile *f, size_t index) {
  if (f != NULL && index < f->count)
    drop_pages(f->tensors[index].data, f->tensors[index].nbytes);
}

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
  const unsigned char *p = t->data + first * es;
  if (!to_f64) {
    float *o = out;
    if (t->dtype == BICO_DTYPE_F32 && host_little_endian()) {
      memcpy(o, p, count * 4);
    } else {
      for (size_t k = 0; k < count; k++) o[k] = elem_f32(p + k * es, t->dtype);
    }
  } else {
    double *o = out;
    if (t->dtype == BICO_DTYPE_F64 && host_little_endian()) {
      memcpy(o, p, count * 8);
    } else {
      for (size_t k = 0; k < count; k++) o[k] = elem_f64(p + k * es, t->dtype);
    }
  }
  drop_pages(p, count * es);
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
                                       size_t first, size_t count,
                                       float *out) {
  return read_range(f, "stfile_read_f32_range", index, first, count, out, 0);
}

bico_status bico_stfile_read_f64(const bico_stfile *f, size_t index,
                                 double *out, size_t count) {
  return read_all(f, "stfile_read_f64", index, out, count, 1);
}

bico_status bico_stfile_read_f64_range(const bico_stfile *f, size_t index,
                                       size_t first, size_t count,
                                       double *out) {
  return read_range(f, "stfile_read_f64_range", index, first, count, out, 1);
}

bico_status bico_stfile_check_finite(const bico_stfile *f, size_t index) {
  bico_status st = check_index(f, "stfile_check_finite", index);
  if (st != BICO_OK) return st;
  const st_tensor *t = &f->tensors[index];
  if (!is_float_dtype(t->dtype)) return BICO_OK;
  size_t es = bico_dtype_size(t->dtype);
  for (size_t k = 0; k < t->numel; k++) {
    double v = elem_f64(t->data + k * es, t->dtype);
    if (!isfinite(v)) {
      char nb[160];
      return bico__fail(f->ctx, BICO_E_NONFINITE,
                        "stfile_check_finite: %s: tensor '%s' holds %s at "
                        "element %zu",
                        f->maps[t->file].path,
                        shortname(t->name, nb, sizeof nb),
                        isnan(v) ? "NaN" : "Inf", k);
    }
  }
  drop_pages(t->data, t->nbytes);
  return BICO_OK;
}

size_t bico_stfile_metadata_count(const bico_stfile *f) {
  return f == NULL ? 0 : f->nmeta;
}

bico_status bico_stfile_metadata_at(const bico_stfile *f, size_t i,
                                    const char **key, const char **value) {
  if (f == NULL) return BICO_E_NULL;
  bico__clear(f->ctx);
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
  bico__clear(f->ctx);
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

/* ---- writer ---- */

typedef struct wt_tensor {
  char *name;
  int dtype;
  size_t ndim;
  size_t *shape;
  size_t numel, nbytes;
  uint64_t begin;
  int written;
} wt_tensor;

struct bico_stwriter {
  bico_ctx *ctx;
  char *path, *tmp, *dir;
  int fd;
  wt_tensor *t;
  size_t count, cap;
  bico__strindex by_name; /* tensor name -> index */
  char **meta; /* key, value pairs */
  size_t nmeta, metacap;
  uint64_t data_start; /* 8 + padded header length once laid out */
  int laid_out, finished;
  unsigned char *buf; /* conversion buffer */
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

static char *w_strdup(bico_ctx *ctx, const char *s) {
  size_t n = strlen(s);
  char *p = bico__alloc(ctx, n + 1);
  if (p) memcpy(p, s, n + 1);
  return p;
}

/* The umask without changing it (umask() is process-wide and racy):
 * Linux reports it in /proc/self/status; elsewhere assume 022. */
static mode_t current_umask(void) {
  mode_t m = 022;
  FILE *fp = fopen("/proc/self/status", "re");
  if (fp == NULL) fp = fopen("/proc/self/status", "r");
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

void bico_stwriter_free(bico_stwriter *w) {
  if (w == NULL) return;
  bico_ctx *ctx = w->ctx;
  if (w->fd >= 0) close(w->fd);
  if (w->tmp != NULL && !w->finished) unlink(w->tmp);
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
  bico__free(ctx, w->tmp);
  bico__free(ctx, w->dir);
  bico__free(ctx, w);
}

bico_status bico_stwriter_create(bico_ctx *ctx, const char *path,
                                 bico_stwriter **out) {
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
  struct stat st;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
    return bico__fail(ctx, BICO_E_ARG,
                      "stwriter_create: %s is a directory", path);
  bico_stwriter *w = bico__calloc(ctx, 1, sizeof *w);
  if (w == NULL) return BICO_E_NOMEM;
  w->ctx = ctx;
  w->fd = -1;
  const char *slash = strrchr(path, '/');
  const char *base = slash ? slash + 1 : path;
  size_t dirlen = slash ? (size_t)(slash - path) : 0;
  w->path = w_strdup(ctx, path);
  w->dir = bico__alloc(ctx, dirlen + 2);
  /* ".<base>.bico-tmp.XXXXXX", the base cut so the name fits NAME_MAX */
  size_t blen = strlen(base) > 200 ? 200 : strlen(base);
  w->tmp = bico__alloc(ctx, dirlen + blen + 32);
  w->buf = bico__alloc(ctx, WBUF);
  if (!w->path || !w->dir || !w->tmp || !w->buf) {
    /* w->tmp holds no name yet (uninitialised, possibly a stale path from
     * reused memory): free must not unlink it.  Found by valgrind
     * (make leak-check). */
    bico__free(ctx, w->tmp);
    w->tmp = NULL;
    bico_stwriter_free(w);
    return BICO_E_NOMEM;
  }
  if (slash == path) {
    strcpy(w->dir, "/");
  } else if (slash) {
    memcpy(w->dir, path, dirlen);
    w->dir[dirlen] = '\0';
  } else {
    strcpy(w->dir, ".");
  }
  if (slash)
    snprintf(w->tmp, dirlen + blen + 32, "%.*s/.%.*s.bico-tmp.XXXXXX",
             (int)dirlen, path, (int)blen, base);
  else
    snprintf(w->tmp, dirlen + blen + 32, ".%.*s.bico-tmp.XXXXXX", (int)blen,
             base);
  w->fd = mkstemp(w->tmp);
  if (w->fd < 0) {
    int e = errno;
    bico__free(ctx, w->tmp);
    w->tmp = NULL; /* nothing to remove */
    bico_status s = bico__fail(ctx, BICO_E_IO,
                               "stwriter_create: %s: cannot create a temporary "
                               "file in folder '%s': %s",
                               path, w->dir, strerror(e));
    bico_stwriter_free(w);
    return s;
  }
  (void)fcntl(w->fd, F_SETFD, FD_CLOEXEC);
  *out = w;
  return BICO_OK;
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
  char *k = w_strdup(w->ctx, key), *v = w_strdup(w->ctx, value);
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
  t->name = w_strdup(ctx, name);
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
static bico_status w_pwrite(bico_stwriter *w, const char *fn, const void *buf,
                            size_t n, uint64_t off) {
  const unsigned char *p = buf;
  while (n > 0) {
    ssize_t r = pwrite(w->fd, p, n, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      return bico__fail(w->ctx, BICO_E_IO,
                        "%s: %s: write to temporary file %s failed: %s", fn,
                        w->path, w->tmp, strerror(errno));
    if (r == 0)
      return bico__fail(w->ctx, BICO_E_IO,
                        "%s: %s: write to temporary file %s made no progress",
                        fn, w->path, w->tmp);
    p += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return BICO_OK;
}

/* Fixes the layout and writes the header: after this the set of tensors is
 * frozen. */
static bico_status w_layout(bico_stwriter *w, const char *fn) {
  if (w->laid_out) return BICO_OK;
  bico_ctx *ctx = w->ctx;
  uint64_t off = 0;
  for (size_t k = 0; k < w->count; k++) {
    w->t[k].begin = off;
    off += w->t[k].nbytes;
  }
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
                            w->path)
               : st;
  }
  if (jw.len > HEADER_LIMIT) {
    size_t n = jw.len;
    bico__jw_free(&jw);
    return bico__fail(ctx, BICO_E_ARG,
                      "%s: %s: header of %zu bytes exceeds the %u-byte limit "
                      "readers accept",
                      fn, w->path, n, HEADER_LIMIT);
  }
  unsigned char lenb[8];
  store_le(lenb, jw.len, 8);
  st = w_pwrite(w, fn, lenb, 8, 0);
  if (st == BICO_OK) st = w_pwrite(w, fn, jw.buf, jw.len, 8);
  uint64_t start = 8 + (uint64_t)jw.len;
  bico__jw_free(&jw);
  if (st != BICO_OK) return st;
  /* Reserve the space now: a full disk fails here, before any data. */
  uint64_t total = start + off;
  if (total > 0) {
    int e = posix_fallocate(w->fd, 0, (off_t)total);
    if (e == ENOSPC || e == EFBIG || e == EIO)
      return bico__fail(ctx, BICO_E_IO,
                        "%s: %s: cannot reserve %llu bytes for temporary file "
                        "%s: %s",
                        fn, w->path, (unsigned long long)total, w->tmp,
                        strerror(e));
  }
  w->data_start = start;
  w->laid_out = 1;
  return BICO_OK;
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
 * writes them in WBUF-sized pieces. */
static bico_status w_convert(bico_stwriter *w, const char *fn, size_t k,
                             const float *fs, const double *ds) {
  wt_tensor *t = &w->t[k];
  char nb[160];
  if (!is_float_dtype(t->dtype))
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
    for (size_t i = 0; i < t->numel; i++) {
      double v = fs ? (double)fs[i] : ds[i];
      if (isfinite(v) && fabs(v) >= maxv + halfulp)
        return bico__fail(w->ctx, BICO_E_NONFINITE,
                          "%s: %s: tensor '%s': element %zu = %g overflows "
                          "%s",
                          fn, w->path, shortname(t->name, nb, sizeof nb), i, v,
                          bico_dtype_name(t->dtype));
    }
  }
  bico_status st = w_layout(w, fn);
  if (st != BICO_OK) return st;
  size_t es = bico_dtype_size(t->dtype), per = WBUF / es;
  uint64_t off = w->data_start + t->begin;
  for (size_t i = 0; i < t->numel; i += per) {
    size_t n = t->numel - i < per ? t->numel - i : per;
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
    st = w_pwrite(w, fn, w->buf, n * es, off);
    if (st != BICO_OK) return st;
    off += n * es;
  }
  t->written = 1;
  return BICO_OK;
}

bico_status bico_stwriter_write_f32(bico_stwriter *w, const char *name,
                                    const float *data, size_t count) {
  if (w == NULL) return BICO_E_NULL;
  size_t k;
  bico_status st = w_prepare(w, "stwriter_write_f32", name, data, &k);
  if (st == BICO_OK) st = w_count(w, "stwriter_write_f32", k, count);
  if (st == BICO_OK) st = w_convert(w, "stwriter_write_f32", k, data, NULL);
  return st;
}

bico_status bico_stwriter_write_f64(bico_stwriter *w, const char *name,
                                    const double *data, size_t count) {
  if (w == NULL) return BICO_E_NULL;
  size_t k;
  bico_status st = w_prepare(w, "stwriter_write_f64", name, data, &k);
  if (st == BICO_OK) st = w_count(w, "stwriter_write_f64", k, count);
  if (st == BICO_OK) st = w_convert(w, "stwriter_write_f64", k, NULL, data);
  return st;
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
    st = w_pwrite(w, fn, data, nbytes, w->data_start + t->begin);
  if (st == BICO_OK) t->written = 1;
  return st;
}

bico_status bico_stwriter_commit(bico_stwriter *w) {
  if (w == NULL) return BICO_E_NULL;
  bico_ctx *ctx = w->ctx;
  const char *fn = "stwriter_commit";
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
  if (st != BICO_OK) goto fail;
  struct stat old;
  mode_t mode = stat(w->path, &old) == 0 ? (old.st_mode & 07777)
                                         : (0666 & ~current_umask());
  if (fchmod(w->fd, mode) != 0) {
    st = io_fail(ctx, fn, w->path, "chmod of the temporary file", errno);
    goto fail;
  }
  if (fsync(w->fd) != 0) {
    st = io_fail(ctx, fn, w->path, "fsync of the temporary file", errno);
    goto fail;
  }
  int fd = w->fd;
  w->fd = -1;
  if (close(fd) != 0) {
    st = io_fail(ctx, fn, w->path, "close of the temporary file", errno);
    goto fail;
  }
  if (rename(w->tmp, w->path) != 0) {
    st = bico__fail(ctx, BICO_E_IO, "%s: %s: cannot rename %s into place: %s",
                    fn, w->path, w->tmp, strerror(errno));
    goto fail;
  }
  /* The rename is durable only once the folder is synced. */
  int dfd = open(w->dir, O_RDONLY | O_CLOEXEC);
  if (dfd >= 0) {
    if (fsync(dfd) != 0 && errno != EINVAL && errno != EROFS) {
      int e = errno;
      close(dfd);
      return io_fail(ctx, fn, w->path, "fsync of the folder", e);
    }
    close(dfd);
  }
  return BICO_OK;
fail:
  if (w->fd >= 0) {
    close(w->fd);
    w->fd = -1;
  }
  unlink(w->tmp);
  bico__free(ctx, w->tmp);
  w->tmp = NULL;
  return st;
}
