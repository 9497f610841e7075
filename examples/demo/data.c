/* Fashion-MNIST in the IDX format, gzip-compressed, read with zlib. */
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "demo.h"

static int read_all(gzFile f, void *buf, size_t n) {
  unsigned char *p = buf;
  while (n > 0) {
    unsigned chunk = n > (1u << 30) ? (1u << 30) : (unsigned)n;
    int got = gzread(f, p, chunk);
    if (got <= 0) return -1;
    p += got;
    n -= (size_t)got;
  }
  return 0;
}

static uint32_t be32(const unsigned char *b) {
  return ((uint32_t)b[0] << 24) | ((uint32_t)b[1] << 16) |
         ((uint32_t)b[2] << 8) | (uint32_t)b[3];
}

/* Opens an IDX file and checks its magic (unsigned bytes, `ndim`
 * dimensions); fills dims.  Returns the open file or NULL. */
static gzFile idx_open(const char *path, int ndim, uint32_t *dims) {
  gzFile f = gzopen(path, "rb");
  if (f == NULL) {
    fprintf(stderr, "demo: cannot open %s (run `make deps` or install "
                    "dataset-fashion-mnist)\n", path);
    return NULL;
  }
  unsigned char hdr[16];
  if (read_all(f, hdr, 4 + 4 * (size_t)ndim) != 0 || hdr[0] != 0 ||
      hdr[1] != 0 || hdr[2] != 0x08 || hdr[3] != ndim) {
    fprintf(stderr, "demo: %s is not an IDX file of unsigned bytes with %d "
                    "dimensions\n", path, ndim);
    gzclose(f);
    return NULL;
  }
  for (int i = 0; i < ndim; i++) dims[i] = be32(hdr + 4 + 4 * i);
  return f;
}

int demo_data_load(const char *images_gz, const char *labels_gz,
                   demo_data *out) {
  memset(out, 0, sizeof *out);
  uint32_t di[3], dl[1];
  gzFile fi = idx_open(images_gz, 3, di);
  if (fi == NULL) return -1;
  gzFile fl = idx_open(labels_gz, 1, dl);
  if (fl == NULL) {
    gzclose(fi);
    return -1;
  }
  int rc = -1;
  unsigned char *raw = NULL;
  if (di[1] * di[2] != DEMO_PIX || di[0] != dl[0] || di[0] == 0 ||
      di[0] > 1000000) {
    fprintf(stderr, "demo: %s holds %u images of %ux%u, %s %u labels; "
                    "expected 28x28 images, one label each\n",
            images_gz, di[0], di[1], di[2], labels_gz, dl[0]);
    goto done;
  }
  size_t n = di[0];
  raw = malloc(n * DEMO_PIX);
  out->x = malloc(n * DEMO_PIX * sizeof *out->x);
  out->y = malloc(n);
  if (raw == NULL || out->x == NULL || out->y == NULL) {
    fprintf(stderr, "demo: out of memory reading %s\n", images_gz);
    goto done;
  }
  if (read_all(fi, raw, n * DEMO_PIX) != 0 || read_all(fl, out->y, n) != 0) {
    fprintf(stderr, "demo: %s or %s is truncated\n", images_gz, labels_gz);
    goto done;
  }
  for (size_t i = 0; i < n; i++)
    if (out->y[i] >= DEMO_CLASSES) {
      fprintf(stderr, "demo: %s: label %u at %zu is not a class 0..9\n",
              labels_gz, out->y[i], i);
      goto done;
    }
  for (size_t i = 0; i < n * DEMO_PIX; i++) out->x[i] = raw[i] / 255.0f;
  out->n = n;
  rc = 0;
done:
  free(raw);
  gzclose(fi);
  gzclose(fl);
  if (rc != 0) demo_data_free(out);
  return rc;
}

void demo_data_free(demo_data *d) {
  free(d->x);
  free(d->y);
  memset(d, 0, sizeof *d);
}

int demo_data_slice(const demo_data *d, size_t lo, size_t n, demo_data *out) {
  memset(out, 0, sizeof *out);
  if (lo > d->n || n > d->n - lo) return -1;
  out->x = malloc((n ? n : 1) * DEMO_PIX * sizeof *out->x);
  out->y = malloc(n ? n : 1);
  if (out->x == NULL || out->y == NULL) {
    demo_data_free(out);
    return -1;
  }
  memcpy(out->x, d->x + lo * DEMO_PIX, n * DEMO_PIX * sizeof *out->x);
  memcpy(out->y, d->y + lo, n);
  out->n = n;
  return 0;
}
