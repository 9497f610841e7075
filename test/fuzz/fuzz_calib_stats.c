/* libFuzzer target: the transfer driver's readers of calibration,
 * statistics and votes files, and bico_stats_from_calib.
 *
 * Byte 0 of the input (bits 0-2, modulo 5) chooses which input of a small, otherwise valid
 * transfer is replaced by the rest of the bytes (written as a file):
 *   0 statistics file (method bico)       1 target calibration file
 *   2 source calibration file             3 target votes file (gradfix)
 *   4 target calibration for bico_stats_from_calib
 * bit 3 turns centering on and bit 4 whitening (calibration modes).  The
 * fixed files (two-block models of width 4, calibration of 8 rows) are
 * written once per process.  A run that succeeds must write an output that
 * opens and holds only finite numbers; one that fails must leave neither
 * the output nor a temporary file behind, and say why. */
#include <dirent.h>
#include <math.h>

#include "bico/safetensors.h"
#include "bico/transfer.h"
#include "bico/stats.h"
#include "fuzz_util.h"

#define D 4
#define ROWS 8

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint32_t lcg = 12345u;
static float rnd(void) {
  lcg = lcg * 1664525u + 1013904223u;
  return (float)((lcg >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* A safetensors file of F32 tensors with the given names and shapes. */
static void write_st(const char *name, size_t count, const char *const *names,
                     const size_t (*shapes)[2], const size_t *ndims,
                     float scale) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", fuzz_dir(), name);
  bico_ctx *ctx = fuzz_ctx();
  bico_stwriter *w = NULL;
  FUZZ_REQUIRE(bico_stwriter_create(ctx, path, &w) == BICO_OK);
  for (size_t i = 0; i < count; i++)
    FUZZ_REQUIRE(bico_stwriter_declare(w, names[i], BICO_DTYPE_F32, ndims[i],
                                       shapes[i]) == BICO_OK);
  for (size_t i = 0; i < count; i++) {
    size_t n = ndims[i] == 1 ? shapes[i][0] : shapes[i][0] * shapes[i][1];
    float v[ROWS * D];
    for (size_t k = 0; k < n; k++)
      v[k] = scale * rnd();
    FUZZ_REQUIRE(bico_stwriter_write_f32(w, names[i], v, n) == BICO_OK);
  }
  FUZZ_REQUIRE(bico_stwriter_commit(w) == BICO_OK);
  bico_stwriter_free(w);
  bico_ctx_free(ctx);
}

static void setup(void) {
  static int done = 0;
  if (done) return;
  done = 1;
  static const char *const params[] = {"blocks.0.fc.weight",
                                       "blocks.0.fc.bias",
                                       "blocks.1.fc.weight",
                                       "blocks.1.fc.bias"};
  static const size_t pshape[4][2] = {{D, D}, {D, 0}, {D, D}, {D, 0}};
  static const size_t pnd[4] = {2, 1, 2, 1};
  write_st("A.safetensors", 4, params, pshape, pnd, 1.0f);
  write_st("tau.safetensors", 4, params, pshape, pnd, 0.1f);
  write_st("B.safetensors", 4, params, pshape, pnd, 1.0f);
  static const char *const cal[] = {"blocks.0.fc.input",
                                    "blocks.0.fc.output_grad",
                                    "blocks.1.fc.input",
                                    "blocks.1.fc.output_grad"};
  static const size_t cshape[4][2] = {{ROWS, D}, {ROWS, D}, {ROWS, D},
                                      {ROWS, D}};
  static const size_t cnd[4] = {2, 2, 2, 2};
  write_st("calA.safetensors", 4, cal, cshape, cnd, 1.0f);
  write_st("calB.safetensors", 4, cal, cshape, cnd, 1.0f);
}

static void path_of(const char *name, char *path, size_t cap) {
  snprintf(path, cap, "%s/%s", fuzz_dir(), name);
}

/* No temporary file of the atomic writer may survive a run. */
static void check_no_temporaries(void) {
  DIR *d = opendir(fuzz_dir());
  FUZZ_REQUIRE(d != NULL);
  struct dirent *e;
  while ((e = readdir(d)) != NULL) FUZZ_REQUIRE(strstr(e->d_name, "bico-tmp") == NULL);
  closedir(d);
}

/* The output exists, opens and holds only finite numbers. */
static void check_output(const char *path, size_t want_count) {
  bico_ctx *ctx = fuzz_ctx();
  bico_stfile *f = NULL;
  FUZZ_REQUIRE(bico_stfile_open(ctx, path, &f) == BICO_OK);
  size_t n = 0;
  FUZZ_REQUIRE(bico_stfile_count(f, &n) == BICO_OK);
  FUZZ_REQUIRE(want_count == 0 || n == want_count);
  for (size_t i = 0; i < n; i++)
    FUZZ_REQUIRE(bico_stfile_check_finite(f, i) == BICO_OK);
  bico_stfile_free(f);
  bico_ctx_free(ctx);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  setup();
  int mode = (data[0] & 7) % 5, center = (data[0] >> 3) & 1,
      whiten = (data[0] >> 4) & 1;
  char fz[4200], a[4200], tau[4200], b[4200], ca[4200], cb[4200], out[4200];
  fuzz_write_file("fuzzed.safetensors", data + 1, size - 1, fz, sizeof fz);
  path_of("A.safetensors", a, sizeof a);
  path_of("tau.safetensors", tau, sizeof tau);
  path_of("B.safetensors", b, sizeof b);
  path_of("calA.safetensors", ca, sizeof ca);
  path_of("calB.safetensors", cb, sizeof cb);
  path_of("out.safetensors", out, sizeof out);
  unlink(out);

  bico_ctx *ctx = fuzz_ctx();
  bico_status st;
  if (mode == 4) {
    st = bico_stats_from_calib(ctx, ca, fz, NULL, out);
  } else {
    bico_transfer *t = NULL;
    FUZZ_REQUIRE(bico_transfer_create(ctx, &t) == BICO_OK);
    FUZZ_REQUIRE(bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, a) == BICO_OK);
    FUZZ_REQUIRE(bico_transfer_set_file(t, BICO_FILE_TASK_VECTOR, tau) == BICO_OK);
    FUZZ_REQUIRE(bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, b) == BICO_OK);
    FUZZ_REQUIRE(bico_transfer_set_file(t, BICO_FILE_OUTPUT, out) == BICO_OK);
    if (mode == 0) {
      FUZZ_REQUIRE(bico_transfer_set_file(t, BICO_FILE_STATS, fz) == BICO_OK);
    } else if (mode == 1 || mode == 2) {
      FUZZ_REQUIRE(bico_transfer_set_file(t, BICO_FILE_SOURCE_CALIB,
                                          mode == 2 ? fz : ca) == BICO_OK);
      FUZZ_REQUIRE(bico_transfer_set_file(t, BICO_FILE_TARGET_CALIB,
                                          mode == 1 ? fz : cb) == BICO_OK);
      FUZZ_REQUIRE(bico_transfer_set_param(t, BICO_TRANSFER_CENTER, center) ==
                   BICO_OK);
      FUZZ_REQUIRE(bico_transfer_set_param(t, BICO_TRANSFER_WHITEN,
                                           whiten ? 0.5 : 0.0) == BICO_OK);
    } else {
      FUZZ_REQUIRE(bico_transfer_set_param(t, BICO_TRANSFER_METHOD,
                                           BICO_METHOD_GRADFIX) == BICO_OK);
      FUZZ_REQUIRE(bico_transfer_set_file(t, BICO_FILE_TARGET_VOTES, fz) ==
                   BICO_OK);
    }
    st = bico_transfer_run(t);
    bico_transfer_free(t);
  }
  if (getenv("BICO_FUZZ_VERBOSE"))
    fprintf(stderr, "mode %d center %d whiten %d: status %d %s\n", mode,
            center, whiten, (int)st, bico_ctx_errmsg(ctx));
  if (st == BICO_OK) {
    check_output(out, mode == 4 ? 0 : 4);
  } else {
    fuzz_check_failure(ctx, st);
    FUZZ_REQUIRE(access(out, F_OK) != 0);
  }
  check_no_temporaries();
  bico_ctx_free(ctx);
  unlink(out);
  unlink(fz);
  return 0;
}
