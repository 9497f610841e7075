/* Fingerprints of models (docs/formats.md, "Bridge files"): a SHA-256
 * that names a model's weights and the files that shape how they read.
 * The sampled kind is cheap on a model of any size: every tensor's name,
 * dtype, shape and byte size, three samples of its bytes, and whole small
 * files (config.json, tokenizer.json); a change confined to unsampled
 * bytes passes it.  The full kind hashes every byte of every tensor
 * instead of the samples (it reads the whole model), for whoever wants a
 * proof that the weights are the same.  Its first line differs, so the
 * two kinds never give the same digest.  Tensors are taken in name order,
 * so a model re-sharded or re-ordered keeps its fingerprint. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "sha256.h"
#include "st_internal.h"

/* Bytes sampled at each of a tensor's start, middle and end. */
#define SAMPLE 64
/* A config.json or tokenizer.json larger than this is not a model's. */
#define SMALL_FILE_LIMIT ((size_t)1 << 30)
/* The full kind reads a tensor in pieces of this many bytes. */
#define PIECE ((size_t)1 << 20)

/* Every byte of tensor t (the full kind), a piece at a time. */
static bico_status add_all_bytes(bico_ctx *ctx, bico__sha256 *h,
                                 const bico__st_file *m,
                                 const bico__st_tensor *t) {
  size_t cap = t->nbytes < PIECE ? t->nbytes : PIECE;
  unsigned char *buf = bico__alloc(ctx, cap ? cap : 1);
  if (buf == NULL) return BICO_E_NOMEM;
  int e = 0;
  for (size_t done = 0; done < t->nbytes && e == 0;) {
    size_t n = t->nbytes - done < cap ? t->nbytes - done : cap;
    e = bico__pread_all(m->fd, buf, n, t->off + done);
    if (e == 0) bico__sha256_update(h, buf, n);
    done += n;
  }
  bico__free(ctx, buf);
  if (e != 0)
    return bico__fail(ctx, BICO_E_IO, "%s: tensor %s: read failed", m->path,
                      t->name);
  return BICO_OK;
}

static bico_status add_tensor(bico_ctx *ctx, bico__sha256 *h,
                              const bico_stfile *f, size_t i, int full) {
  const bico__st_tensor *t = &f->tensors[i];
  char line[128];
  bico__sha256_update(h, "tensor\t", 7);
  bico__sha256_update(h, t->name, strlen(t->name) + 1); /* with its NUL */
  int n = snprintf(line, sizeof line, "%s\t%zu\t", bico_dtype_name(t->dtype),
                   t->ndim);
  bico__sha256_update(h, line, (size_t)n);
  for (size_t d = 0; d < t->ndim; d++) {
    n = snprintf(line, sizeof line, "%zu,", t->shape[d]);
    bico__sha256_update(h, line, (size_t)n);
  }
  n = snprintf(line, sizeof line, "\t%zu\n", t->nbytes);
  bico__sha256_update(h, line, (size_t)n);
  if (full) return add_all_bytes(ctx, h, &f->files[t->file], t);
  /* The samples: every byte of a small tensor, else SAMPLE bytes at 0,
   * at (nbytes - SAMPLE) / 2 and at nbytes - SAMPLE. */
  unsigned char buf[3 * SAMPLE];
  size_t take = t->nbytes <= 3 * SAMPLE ? t->nbytes : 3 * SAMPLE;
  uint64_t at[3] = {0, (t->nbytes - SAMPLE) / 2, t->nbytes - SAMPLE};
  const bico__st_file *m = &f->files[t->file];
  int e = 0;
  if (take < 3 * SAMPLE) {
    if (take) e = bico__pread_all(m->fd, buf, take, t->off);
  } else {
    for (int k = 0; k < 3 && e == 0; k++)
      e = bico__pread_all(m->fd, buf + k * SAMPLE, SAMPLE, t->off + at[k]);
  }
  if (e != 0)
    return bico__fail(ctx, BICO_E_IO, "%s: tensor %s: read failed", m->path,
                      t->name);
  bico__sha256_update(h, buf, take);
  return BICO_OK;
}

bico_status bico__fingerprint(bico_ctx *ctx, const bico_stfile *f, int full,
                              const char *const *files,
                              const char *const *roles, size_t nfiles,
                              char hex[65]) {
  bico__sha256 h;
  bico__sha256_init(&h);
  if (full) bico__sha256_update(&h, "bico-fingerprint full 1\n", 24);
  else bico__sha256_update(&h, "bico-fingerprint 1\n", 19);
  /* f->by_name is the tensors in name order (the reader's index). */
  bico_status st = BICO_OK;
  for (size_t k = 0; k < f->count && st == BICO_OK; k++)
    st = add_tensor(ctx, &h, f, f->by_name[k], full);
  for (size_t k = 0; k < nfiles && st == BICO_OK; k++) {
    if (files[k] == NULL) continue;
    char *text = NULL;
    size_t len = 0;
    st = bico__read_file(ctx, "fingerprint", roles[k], files[k],
                         SMALL_FILE_LIMIT, &text, &len);
    if (st != BICO_OK) break;
    char line[64];
    int n = snprintf(line, sizeof line, "file\t%zu\n", len);
    bico__sha256_update(&h, line, (size_t)n);
    bico__sha256_update(&h, roles[k], strlen(roles[k]) + 1);
    bico__sha256_update(&h, text, len);
    bico__free(ctx, text);
  }
  if (st == BICO_OK) bico__sha256_final_hex(&h, hex);
  return st;
}
