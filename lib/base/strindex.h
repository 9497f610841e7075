/* String-keyed index (name -> position in the owner's array), open
 * addressing with linear probing through the context's allocator.  The
 * table stores positions only: keys stay in the owner's records and are
 * read back through a callback, so one table serves any record layout. */
#ifndef BICO_STRINDEX_H
#define BICO_STRINDEX_H

#include <stddef.h>

#include "internal.h"

/* The key (a NUL-terminated string) of the owner's entry i. */
typedef const char *(*bico__strindex_key_fn)(const void *owner, size_t i);

typedef struct bico__strindex {
  size_t *slot; /* entry index + 1; 0 = empty */
  size_t cap;   /* power of two; 0 until the first reserve */
} bico__strindex;

/* A zeroed bico__strindex is empty (and allocates nothing).  The key
 * function and its owner are passed to every call rather than stored, so
 * the index costs its owner no more than a bare table would. */
void bico__strindex_free(bico_ctx *ctx, bico__strindex *ix);

/* The entry whose key equals the first len bytes of s (and is len long),
 * or SIZE_MAX. */
size_t bico__strindex_find(const bico__strindex *ix, const char *s,
                           size_t len, bico__strindex_key_fn key,
                           const void *owner);

/* Room for n entries at load at most 1/2: the first table has 64 slots,
 * then it doubles.  On BICO_E_NOMEM (message set) the index is unchanged. */
bico_status bico__strindex_reserve(bico_ctx *ctx, bico__strindex *ix,
                                   size_t n, bico__strindex_key_fn key,
                                   const void *owner);

/* Adds entry i, whose key must be absent; call reserve first. */
void bico__strindex_insert(bico__strindex *ix, size_t i,
                           bico__strindex_key_fn key, const void *owner);

/* Binary search for name among the owner's entries order[0..n-1], sorted
 * by key (strcmp); the entry (a value of order), or SIZE_MAX.  For the
 * read-only indices that keep a sorted permutation instead of a table. */
size_t bico__sorted_find(const size_t *order, size_t n, const char *name,
                         bico__strindex_key_fn key, const void *owner);

#endif
