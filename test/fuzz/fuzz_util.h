/* Helpers shared by the libFuzzer targets: a private scratch folder, files
 * written into it, a context, and the contract checks every target applies.
 * A broken contract calls abort() so that libFuzzer records the input. */
#ifndef BICO_FUZZ_UTIL_H
#define BICO_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bico/bico.h"

#define FUZZ_REQUIRE(cond)                                                  \
  do {                                                                      \
    if (!(cond)) {                                                          \
      fprintf(stderr, "fuzz contract broken at %s:%d: %s\n", __FILE__,      \
              __LINE__, #cond);                                             \
      abort();                                                              \
    }                                                                       \
  } while (0)

/* The scratch folder: one per process, made on first use under $TMPDIR
 * (scripts/fuzz.sh points it into /dev/shm, or build/fuzz/<target>/tmp). */
static const char *fuzz_dir(void) {
  static char dir[4096];
  if (dir[0] == '\0') {
    const char *t = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/bico-fuzz-XXXXXX", t && *t ? t : "/tmp");
    if (mkdtemp(dir) == NULL) {
      perror("mkdtemp");
      abort();
    }
  }
  return dir;
}

/* Writes `size` bytes to <scratch>/<name>; the full path goes to path. */
static void fuzz_write_file(const char *name, const uint8_t *data,
                            size_t size, char *path, size_t cap) {
  snprintf(path, cap, "%s/%s", fuzz_dir(), name);
  FILE *f = fopen(path, "wb");
  if (f == NULL || (size && fwrite(data, 1, size, f) != size) ||
      fclose(f) != 0) {
    perror(path);
    abort();
  }
}

static bico_ctx *fuzz_ctx(void) {
  bico_ctx *ctx = NULL;
  FUZZ_REQUIRE(bico_ctx_create(&ctx) == BICO_OK && ctx != NULL);
  return ctx;
}

/* A failed call: a status other than OK, an errmsg that says something, and
 * (for the readers) one of the statuses a malformed input may give. */
static void fuzz_check_failure(bico_ctx *ctx, bico_status st) {
  FUZZ_REQUIRE(st != BICO_OK);
  FUZZ_REQUIRE(st != BICO_E_INTERNAL);
  FUZZ_REQUIRE(bico_ctx_errmsg(ctx) != NULL && bico_ctx_errmsg(ctx)[0] != 0);
}

#endif
