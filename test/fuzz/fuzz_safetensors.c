/* libFuzzer target: the safetensors reader on arbitrary bytes.
 * The input is written to a file and opened with bico_stfile_open (the
 * reader maps files; it has no open-from-memory entry point).  Accepted
 * files must satisfy the format's own arithmetic: the tensors' byte sizes
 * add up to exactly the bytes after the header. */
#include "fuzz_st_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char path[4200];
  fuzz_write_file("input.safetensors", data, size, path, sizeof path);
  bico_ctx *ctx = fuzz_ctx();
  bico_stfile *f = (bico_stfile *)(uintptr_t)1; /* must be reset on failure */
  bico_status st = bico_stfile_open(ctx, path, &f);
  if (st != BICO_OK) {
    fuzz_check_failure(ctx, st);
    FUZZ_REQUIRE(f == NULL);
    FUZZ_REQUIRE(st == BICO_E_FORMAT || st == BICO_E_UNSUPPORTED ||
                 st == BICO_E_NOMEM);
  } else {
    FUZZ_REQUIRE(f != NULL && size >= 8);
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)data[i] << (8 * i);
    FUZZ_REQUIRE(n <= size - 8);
    size_t total = fuzz_st_exercise(ctx, f);
    FUZZ_REQUIRE(total == size - 8 - n);
    bico_stfile_free(f);
  }
  bico_ctx_free(ctx);
  unlink(path);
  return 0;
}
