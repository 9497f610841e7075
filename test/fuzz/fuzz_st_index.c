/* libFuzzer target: sharded safetensors checkpoints (an index JSON plus
 * shard files).  The input is split at each "\n@@@\n": the first part is
 * written as model.safetensors.index.json, part k (k >= 1) as
 * s<k-1>.safetensors, all in one scratch folder, and the index is opened.
 * At most 4 shards; the folder is emptied after each run. */
#include "fuzz_st_common.h"

#define SEP "\n@@@\n"
#define SEP_LEN 5
#define MAX_PARTS 5

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const uint8_t *find_sep(const uint8_t *p, const uint8_t *end) {
  for (; end - p >= SEP_LEN; p++)
    if (memcmp(p, SEP, SEP_LEN) == 0) return p;
  return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char paths[MAX_PARTS][4200];
  int parts = 0;
  const uint8_t *p = data, *end = data + size;
  while (parts < MAX_PARTS) {
    const uint8_t *q = parts < MAX_PARTS - 1 ? find_sep(p, end) : NULL;
    const uint8_t *stop = q ? q : end;
    char name[64];
    if (parts == 0) snprintf(name, sizeof name, "model.safetensors.index.json");
    else snprintf(name, sizeof name, "s%d.safetensors", parts - 1);
    fuzz_write_file(name, p, (size_t)(stop - p), paths[parts],
                    sizeof paths[parts]);
    parts++;
    if (q == NULL) break;
    p = q + SEP_LEN;
  }
  bico_ctx *ctx = fuzz_ctx();
  bico_stfile *f = (bico_stfile *)(uintptr_t)1; /* must be reset on failure */
  bico_status st = bico_stfile_open(ctx, paths[0], &f);
  if (st != BICO_OK) {
    fuzz_check_failure(ctx, st);
    FUZZ_REQUIRE(f == NULL);
    FUZZ_REQUIRE(st == BICO_E_FORMAT || st == BICO_E_UNSUPPORTED ||
                 st == BICO_E_NOMEM || st == BICO_E_IO ||
                 st == BICO_E_NOTFOUND);
  } else {
    FUZZ_REQUIRE(f != NULL);
    size_t total = fuzz_st_exercise(ctx, f);
    /* Every tensor lives in one of the shards written here. */
    FUZZ_REQUIRE(total <= size);
    size_t n = 0;
    FUZZ_REQUIRE(bico_stfile_count(f, &n) == BICO_OK);
    for (size_t i = 0; i < n; i++) {
      const char *path = NULL;
      int ok = 0;
      FUZZ_REQUIRE(bico_stfile_tensor_path(f, i, &path) == BICO_OK);
      for (int k = 1; k < parts; k++) {
        const char *base = strrchr(paths[k], '/') + 1;
        const char *pb = strrchr(path, '/');
        if (strcmp(pb ? pb + 1 : path, base) == 0) ok = 1;
      }
      FUZZ_REQUIRE(ok);
    }
    bico_stfile_free(f);
  }
  bico_ctx_free(ctx);
  for (int k = 0; k < parts; k++) unlink(paths[k]);
  return 0;
}
