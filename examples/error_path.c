/* The error path: what a caller gets when an input is bad, and what it
 * does not get -- a half-written output.
 *
 * Every call returns a bico_status (BICO_OK is 0); bico_strerror(status)
 * is its fixed text, bico_status_name(status) its identifier, and the
 * context keeps the detail of the last failure: bico_ctx_errmsg(ctx)
 * names the file, tensor or option and the reason, and bico_ctx_errcode
 * (ctx) the status (test it, not the text).  Outputs are written to a
 * temporary file and renamed into place only when complete, so a failed
 * run leaves an existing output byte for byte as it was. */
/* mkdtemp is POSIX.1-2008, not C99: ask for it before any header */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <bico/bico.h>

static char dir[] = "/tmp/bico-example-XXXXXX";

static int save(bico_ctx *ctx, const char *path, size_t rows, size_t cols) {
  static const float v[16] = {0};
  bico_stwriter *w = NULL;
  size_t shape[2] = {rows, cols};
  bico_status st = bico_stwriter_create(ctx, path, &w);
  if (st == BICO_OK) st = bico_stwriter_declare(w, "fc.weight", BICO_DTYPE_F32, 2, shape);
  if (st == BICO_OK) st = bico_stwriter_write_f32(w, "fc.weight", v, rows * cols);
  if (st == BICO_OK) st = bico_stwriter_commit(w);
  bico_stwriter_free(w);
  return st;
}

int main(void) {
  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK || mkdtemp(dir) == NULL) return 1;
  char a[80], aft[80], b[80], out[80];
  snprintf(a, sizeof a, "%s/A.safetensors", dir);
  snprintf(aft, sizeof aft, "%s/A_ft.safetensors", dir);
  snprintf(b, sizeof b, "%s/B.safetensors", dir);
  snprintf(out, sizeof out, "%s/out.safetensors", dir);
  /* A [2, 3] and its fine-tune; B [3, 3]: naive addition cannot apply. */
  if (save(ctx, a, 2, 3) || save(ctx, aft, 2, 3) || save(ctx, b, 3, 3)) return 1;
  FILE *old = fopen(out, "w"); /* an output from an earlier run */
  if (old == NULL) return 1;
  fputs("an earlier result", old);
  fclose(old);

  bico_transfer *t = NULL;
  if (bico_transfer_create(ctx, &t) != BICO_OK) return 1;
  bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, a);
  bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, b);
  bico_transfer_set_file(t, BICO_FILE_OUTPUT, out);
  bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE);
  int bad = 0;

  /* 1. A usage error, found without opening a file: no fine-tune given. */
  bico_status st = bico_transfer_check(t, BICO_TRANSFER_CHECK_OPTIONS);
  printf("check: %s: %s\n", bico_status_name(st), bico_ctx_errmsg(ctx));
  bad |= st != BICO_E_ARG || strstr(bico_ctx_errmsg(ctx), "source tuned") == NULL;

  /* 2. A file that does not exist: named by its slot and its path. */
  bico_transfer_set_file(t, BICO_FILE_SOURCE_TUNED, "/nonexistent/A_ft.safetensors");
  st = bico_transfer_run(t);
  printf("run:   %s: %s\n", bico_status_name(st), bico_ctx_errmsg(ctx));
  bad |= st != BICO_E_IO;

  /* 3. Bad data: the shapes differ; the message names the tensor and both
   * shapes, and bico_ctx_errcode says the same status. */
  bico_transfer_set_file(t, BICO_FILE_SOURCE_TUNED, aft);
  st = bico_transfer_run(t);
  printf("run:   %s (%s): %s\n", bico_status_name(st), bico_strerror(st),
         bico_ctx_errmsg(ctx));
  bad |= st != BICO_E_SHAPE || bico_ctx_errcode(ctx) != BICO_E_SHAPE;
  bad |= strstr(bico_ctx_errmsg(ctx), "fc.weight") == NULL;

  /* Nothing written: the earlier output is intact, no temporary left. */
  char text[64] = "";
  FILE *f = fopen(out, "r");
  if (f == NULL || fgets(text, sizeof text, f) == NULL) bad = 1;
  if (f) fclose(f);
  bad |= strcmp(text, "an earlier result") != 0;
  printf("the output after the failures: \"%s\"\n", text);

  /* A call that succeeds clears the record. */
  bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, 0.5);
  bad |= bico_ctx_errcode(ctx) != BICO_OK || bico_ctx_errmsg(ctx)[0] != '\0';
  bico_transfer_free(t);
  const char *files[] = {a, aft, b, out};
  for (int k = 0; k < 4; k++) unlink(files[k]);
  bad |= rmdir(dir) != 0; /* fails if anything else was left in the folder */
  bico_ctx_free(ctx);
  printf("error_path: %s\n", bad ? "WRONG" : "ok");
  return bad;
}
