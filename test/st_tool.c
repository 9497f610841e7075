/* st_tool: a small driver of libbico's safetensors API for the Python
 * interoperability tests (test/python/test_safetensors_interop.py).
 *
 *   st_tool dump FILE      prints the file's metadata and tensors as text
 *   st_tool write FILE     writes the tensors described on stdin
 *
 * Text format, one item a line; names, keys and values are hex-encoded
 * UTF-8 (so any byte survives), numbers are decimal:
 *   M <key-hex> <value-hex>
 *   T <name-hex> <dtype> <ndim> <d1> ... <dn> : <v1> <v2> ...
 * dump prints values as doubles read through bico_stfile_read_f64 ("%.17g";
 * "nan", "inf"); write converts them with bico_stwriter_write_f64 for F64,
 * bico_stwriter_write_f32 for F32/F16/BF16 (the value rounded to float
 * first), and packs integers and BOOL itself for bico_stwriter_write_raw.
 * Errors: the message on stderr, exit status 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bico/bico.h"

static int fail(bico_ctx *ctx, bico_status st) {
  fprintf(stderr, "st_tool: %s (status %d): %s\n", bico_strerror(st), (int)st,
          bico_ctx_errmsg(ctx));
  return 1;
}

static void put_hex(const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p; p++)
    printf("%02x", *p);
  if (*s == '\0') printf("-");
}

static char *from_hex(const char *h) {
  size_t n = strlen(h);
  char *s = malloc(n / 2 + 1);
  if (s == NULL) return NULL;
  if (strcmp(h, "-") == 0) n = 0;
  for (size_t k = 0; k + 1 < n; k += 2) {
    unsigned v;
    sscanf(h + k, "%2x", &v);
    s[k / 2] = (char)v;
  }
  s[n / 2] = '\0';
  return s;
}

static int dump(bico_ctx *ctx, const char *path) {
  bico_stfile *f = NULL;
  bico_status st = bico_stfile_open(ctx, path, &f);
  size_t nmeta = 0, nt = 0;
  if (st == BICO_OK) st = bico_stfile_metadata_count(f, &nmeta);
  if (st == BICO_OK) st = bico_stfile_count(f, &nt);
  if (st != BICO_OK) {
    bico_stfile_free(f);
    return fail(ctx, st);
  }
  for (size_t i = 0; i < nmeta; i++) {
    const char *k, *v;
    bico_stfile_metadata_at(f, i, &k, &v);
    printf("M ");
    put_hex(k);
    printf(" ");
    put_hex(v);
    printf("\n");
  }
  for (size_t i = 0; i < nt; i++) {
    const char *name;
    int dtype;
    size_t ndim, numel;
    const size_t *shape;
    bico_stfile_tensor_info(f, i, &name, &dtype, &ndim, &shape);
    bico_stfile_tensor_size(f, i, &numel, NULL);
    double *v = malloc((numel ? numel : 1) * sizeof *v);
    if (v == NULL) return 1;
    st = bico_stfile_read_f64(f, i, v, numel);
    if (st != BICO_OK) {
      free(v);
      bico_stfile_free(f);
      return fail(ctx, st);
    }
    printf("T ");
    put_hex(name);
    printf(" %s %zu", bico_dtype_name(dtype), ndim);
    for (size_t d = 0; d < ndim; d++) printf(" %zu", shape[d]);
    printf(" :");
    for (size_t k = 0; k < numel; k++) printf(" %.17g", v[k]);
    printf("\n");
    free(v);
  }
  bico_stfile_free(f);
  return 0;
}

typedef struct item {
  char *name;
  int dtype;
  size_t ndim, shape[64], n;
  char **vals;
} item;

static int write_file(bico_ctx *ctx, const char *path) {
  bico_stwriter *w = NULL;
  bico_status st = bico_stwriter_create(ctx, path, &w);
  if (st != BICO_OK) return fail(ctx, st);
  item *items = NULL;
  size_t nitems = 0;
  static char line[1 << 20];
  int rc = 0;
  while (rc == 0 && fgets(line, sizeof line, stdin)) {
    char *save = NULL, *tok = strtok_r(line, " \n", &save);
    if (tok == NULL) continue;
    if (strcmp(tok, "M") == 0) {
      char *k = from_hex(strtok_r(NULL, " \n", &save));
      char *v = from_hex(strtok_r(NULL, " \n", &save));
      st = bico_stwriter_add_metadata(w, k, v);
      free(k);
      free(v);
      if (st != BICO_OK) rc = fail(ctx, st);
      continue;
    }
    item it;
    memset(&it, 0, sizeof it);
    it.name = from_hex(strtok_r(NULL, " \n", &save));
    if (bico_dtype_from_name(strtok_r(NULL, " \n", &save), &it.dtype) !=
        BICO_OK) {
      fprintf(stderr, "st_tool: unknown dtype\n");
      rc = 1;
      break;
    }
    it.ndim = strtoul(strtok_r(NULL, " \n", &save), NULL, 10);
    for (size_t d = 0; d < it.ndim && d < 64; d++)
      it.shape[d] = strtoul(strtok_r(NULL, " \n", &save), NULL, 10);
    strtok_r(NULL, " \n", &save); /* ":" */
    size_t cap = 16;
    it.vals = malloc(cap * sizeof *it.vals);
    while ((tok = strtok_r(NULL, " \n", &save)) != NULL) {
      if (it.n == cap) it.vals = realloc(it.vals, (cap *= 2) * sizeof *it.vals);
      it.vals[it.n++] = strdup(tok);
    }
    st = bico_stwriter_declare(w, it.name, it.dtype, it.ndim, it.shape);
    if (st != BICO_OK) rc = fail(ctx, st);
    items = realloc(items, (nitems + 1) * sizeof *items);
    items[nitems++] = it;
  }
  /* Write in reverse declaration order: the writer allows any order. */
  for (size_t i = nitems; rc == 0 && i-- > 0;) {
    item *it = &items[i];
    size_t es = bico_dtype_size(it->dtype);
    if (it->dtype == BICO_DTYPE_F64) {
      double *v = malloc((it->n ? it->n : 1) * sizeof *v);
      for (size_t k = 0; k < it->n; k++) v[k] = strtod(it->vals[k], NULL);
      st = bico_stwriter_write_f64(w, it->name, v, it->n);
      free(v);
    } else if (it->dtype == BICO_DTYPE_F32 || it->dtype == BICO_DTYPE_F16 ||
               it->dtype == BICO_DTYPE_BF16) {
      float *v = malloc((it->n ? it->n : 1) * sizeof *v);
      for (size_t k = 0; k < it->n; k++) v[k] = strtof(it->vals[k], NULL);
      st = bico_stwriter_write_f32(w, it->name, v, it->n);
      free(v);
    } else {
      unsigned char *b = malloc((it->n ? it->n : 1) * es);
      for (size_t k = 0; k < it->n; k++) {
        unsigned long long u =
            it->vals[k][0] == '-'
                ? (unsigned long long)strtoll(it->vals[k], NULL, 10)
                : strtoull(it->vals[k], NULL, 10);
        for (size_t j = 0; j < es; j++) b[k * es + j] = (unsigned char)(u >> (8 * j));
      }
      st = bico_stwriter_write_raw(w, it->name, b, it->n * es);
      free(b);
    }
    if (st != BICO_OK) rc = fail(ctx, st);
  }
  if (rc == 0) {
    st = bico_stwriter_commit(w);
    if (st != BICO_OK) rc = fail(ctx, st);
  }
  for (size_t i = 0; i < nitems; i++) {
    for (size_t k = 0; k < items[i].n; k++) free(items[i].vals[k]);
    free(items[i].vals);
    free(items[i].name);
  }
  free(items);
  bico_stwriter_free(w);
  return rc;
}

int main(int argc, char **argv) {
  if (argc != 3 || (strcmp(argv[1], "dump") != 0 && strcmp(argv[1], "write") != 0)) {
    fprintf(stderr, "usage: st_tool dump FILE | st_tool write FILE < spec\n");
    return 2;
  }
  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK) return 1;
  int rc = strcmp(argv[1], "dump") == 0 ? dump(ctx, argv[2])
                                        : write_file(ctx, argv[2]);
  bico_ctx_free(ctx);
  return rc;
}
