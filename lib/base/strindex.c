/* String-keyed index shared by the model registry and the safetensors
 * writer (see strindex.h). */
#include <stdint.h>
#include <string.h>

#include "strindex.h"

/* FNV-1a, 64 bit. */
static size_t hash(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
  return (size_t)h;
}

void bico__strindex_free(bico_ctx *ctx, bico__strindex *ix) {
  bico__free(ctx, ix->slot);
  ix->slot = NULL;
  ix->cap = 0;
}

size_t bico__strindex_find(const bico__strindex *ix, const char *s,
                           size_t len, bico__strindex_key_fn key,
                           const void *owner) {
  if (ix->cap == 0) return SIZE_MAX;
  size_t mask = ix->cap - 1;
  for (size_t h = hash(s, len) & mask;; h = (h + 1) & mask) {
    size_t e = ix->slot[h];
    if (e == 0) return SIZE_MAX;
    const char *k = key(owner, e - 1);
    if (strncmp(k, s, len) == 0 && k[len] == '\0') return e - 1;
  }
}

static void place(size_t *slot, size_t cap, const char *key, size_t e) {
  size_t h = hash(key, strlen(key)) & (cap - 1);
  while (slot[h]) h = (h + 1) & (cap - 1);
  slot[h] = e;
}

bico_status bico__strindex_reserve(bico_ctx *ctx, bico__strindex *ix,
                                   size_t n, bico__strindex_key_fn key,
                                   const void *owner) {
  if (ix->cap != 0 && n <= ix->cap / 2) return BICO_OK;
  size_t cap = ix->cap ? ix->cap * 2 : 64;
  while (cap / 2 < n) cap *= 2;
  size_t *slot = bico__calloc(ctx, cap, sizeof *slot);
  if (slot == NULL) return BICO_E_NOMEM;
  for (size_t k = 0; k < ix->cap; k++)
    if (ix->slot[k])
      place(slot, cap, key(owner, ix->slot[k] - 1), ix->slot[k]);
  bico__free(ctx, ix->slot);
  ix->slot = slot;
  ix->cap = cap;
  return BICO_OK;
}

void bico__strindex_insert(bico__strindex *ix, size_t i,
                           bico__strindex_key_fn key, const void *owner) {
  place(ix->slot, ix->cap, key(owner, i), i + 1);
}

size_t bico__sorted_find(const size_t *order, size_t n, const char *name,
                         bico__strindex_key_fn key, const void *owner) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(key(owner, order[mid]), name);
    if (c == 0) return order[mid];
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return SIZE_MAX;
}
