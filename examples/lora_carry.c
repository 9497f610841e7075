/* Carry a PEFT LoRA adapter to a wider target model, and merge it into the
 * target's weights (bico_lora, bico_transfer).
 *
 * BiCo moves the adapter's factors, never the dense update: B' = R_out^T B,
 * A' = A R_in, so s B' A' = R_out^T (s B A) R_in with the rank kept.  The
 * maps come from calibration files: each module's input rows and output
 * gradients on the same samples in both models.  Planted here: the target
 * (width 6) sees the source's (width 4) rows as x P and gradients as g S,
 * P and S with orthonormal rows, so the carried update must be
 * S^T (s B A) P, in the output adapter and in the merged checkpoint. */
/* mkdtemp is POSIX.1-2008, not C99: ask for it before any header */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <bico/bico.h>

enum { DA = 4, DB = 6, R = 2, N = 16 };
static char dir[] = "/tmp/bico-example-XXXXXX";

static void ok(bico_ctx *ctx, bico_status st, const char *what) {
  if (st == BICO_OK) return;
  fprintf(stderr, "%s: %s\n", what, bico_ctx_errmsg(ctx));
  exit(1);
}

/* dir/file with tensors a and b (b's name NULL: a alone), F32. */
static const char *save(bico_ctx *ctx, const char *file, const char *na,
                        size_t ra, size_t ca, const float *a, const char *nb,
                        size_t rb, size_t cb, const float *b) {
  static char path[8][96];
  static int k;
  char *p = path[k++ % 8];
  bico_stwriter *w = NULL;
  size_t sa[2] = {ra, ca}, sb[2] = {rb, cb};
  snprintf(p, 96, "%s/%s", dir, file);
  ok(ctx, bico_stwriter_create(ctx, p, &w), file);
  ok(ctx, bico_stwriter_declare(w, na, BICO_DTYPE_F32, 2, sa), file);
  if (nb) ok(ctx, bico_stwriter_declare(w, nb, BICO_DTYPE_F32, 2, sb), file);
  ok(ctx, bico_stwriter_write_f32(w, na, a, ra * ca), file);
  if (nb) ok(ctx, bico_stwriter_write_f32(w, nb, b, rb * cb), file);
  ok(ctx, bico_stwriter_commit(w), file);
  bico_stwriter_free(w);
  return p;
}

/* y [n, DB] = x [n, DA] m [DA, DB] */
static void times(const float *x, int n, const float *m, float *y) {
  for (int r = 0; r < n; r++)
    for (int j = 0; j < DB; j++) {
      y[r * DB + j] = 0;
      for (int i = 0; i < DA; i++) y[r * DB + j] += x[r * DA + i] * m[i * DB + j];
    }
}

int main(void) {
  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK || mkdtemp(dir) == NULL) return 1;
  float P[DA * DB] = {0}, S[DA * DB] = {0}, wa[DA * DA], wb[DB * DB];
  float x[N * DA], g[N * DA], xb[N * DB], gb[N * DB], B[DA * R], A[R * DA];
  for (int i = 0; i < DA; i++) P[i * DB + (i + 1) % DB] = 1, S[i * DB + 5 - i] = -1;
  unsigned s = 3;
  float *all[6] = {wa, wb, x, g, B, A};
  const int len[6] = {DA * DA, DB * DB, N * DA, N * DA, DA * R, R * DA};
  for (int k = 0; k < 6; k++)
    for (int i = 0; i < len[k]; i++)
      all[k][i] = (float)((s = s * 1103515245u + 12345u) >> 8 & 1023) / 512.0f - 1;
  times(x, N, P, xb);
  times(g, N, S, gb);
  const char *a = save(ctx, "A.safetensors", "layer.fc.weight", DA, DA, wa, NULL, 0, 0, NULL);
  const char *b = save(ctx, "B.safetensors", "layer.fc.weight", DB, DB, wb, NULL, 0, 0, NULL);
  const char *ca = save(ctx, "A.calib.safetensors", "layer.fc.input", N, DA, x,
                        "layer.fc.output_grad", N, DA, g);
  const char *cb = save(ctx, "B.calib.safetensors", "layer.fc.input", N, DB, xb,
                        "layer.fc.output_grad", N, DB, gb);
  /* The source's adapter: rank 2, lora_alpha 4 (scale s = alpha / r = 2). */
  char ad[64], ad_b[64], merged[64];
  snprintf(ad, sizeof ad, "%s/adapter_A", dir);
  snprintf(ad_b, sizeof ad_b, "%s/adapter_B", dir);
  snprintf(merged, sizeof merged, "%s/B_merged.safetensors", dir);
  bico_lora *l = NULL;
  ok(ctx, bico_lora_create(ctx, &l), "lora_create");
  ok(ctx, bico_lora_add_module(l, "layer.fc", BICO_LORA_LINEAR, R, DA, DA, 4.0, B, A), "add");
  ok(ctx, bico_lora_save(l, ad), "lora_save"); /* a PEFT adapter folder */
  bico_lora_free(l);

  bico_transfer *t = NULL;
  ok(ctx, bico_transfer_create(ctx, &t), "transfer_create");
  const int slot[6] = {BICO_FILE_SOURCE_BASE, BICO_FILE_TARGET_BASE, BICO_FILE_SOURCE_CALIB,
                       BICO_FILE_TARGET_CALIB, BICO_FILE_LORA, BICO_FILE_LORA_OUTPUT};
  const char *path[6] = {a, b, ca, cb, ad, ad_b};
  for (int k = 0; k < 6; k++) ok(ctx, bico_transfer_set_file(t, slot[k], path[k]), "set_file");
  ok(ctx, bico_transfer_set_file(t, BICO_FILE_OUTPUT, merged), "set_file"); /* and merged */
  ok(ctx, bico_transfer_run(t), "transfer_run");
  bico_transfer_free(t);

  /* The target's adapter as PEFT would load it, and the merged weight. */
  float dense[DB * DB], want[DB * DB], got[DB * DB];
  ok(ctx, bico_lora_open(ctx, ad_b, &l), "lora_open");
  ok(ctx, bico_lora_dense(l, 0, 1.0f, 0.0f, dense, DB), "lora_dense");
  size_t rank = 0;
  ok(ctx, bico_lora_module(l, 0, NULL, NULL, &rank, NULL, NULL, NULL, NULL), "module");
  bico_lora_free(l);
  bico_stfile *f = NULL;
  ok(ctx, bico_stfile_open(ctx, merged, &f), "stfile_open");
  ok(ctx, bico_stfile_read_f32(f, 0, got, DB * DB), "read_f32");
  bico_stfile_free(f);
  double err = 0; /* S^T (2 B A) P, computed here */
  for (int p = 0; p < DB; p++)
    for (int q = 0; q < DB; q++) {
      want[p * DB + q] = 0;
      for (int i = 0; i < DA; i++)
        for (int j = 0; j < DA; j++)
          for (int k = 0; k < R; k++)
            want[p * DB + q] += S[i * DB + p] * 2 * B[i * R + k] * A[k * DA + j] * P[j * DB + q];
      err = fmax(err, fabs(dense[p * DB + q] - want[p * DB + q]));
      err = fmax(err, fabs(got[p * DB + q] - wb[p * DB + q] - want[p * DB + q]));
    }
  printf("adapter carried to width %d at rank %zu; largest error %.2g\n", DB, rank, err);
  const char *files[] = {"A.safetensors", "B.safetensors", "A.calib.safetensors",
                         "B.calib.safetensors", "B_merged.safetensors",
                         "adapter_A/adapter_model.safetensors", "adapter_A/adapter_config.json",
                         "adapter_B/adapter_model.safetensors", "adapter_B/adapter_config.json",
                         "adapter_A", "adapter_B", ""};
  for (int k = 0; k < 12; k++) { /* files, then folders, then dir itself */
    char p[128];
    snprintf(p, sizeof p, "%s/%s", dir, files[k]);
    if (unlink(p) != 0) rmdir(p);
  }
  bico_ctx_free(ctx);
  printf("lora_carry: %s\n", err < 1e-4 && rank == R ? "ok" : "WRONG");
  return err < 1e-4 && rank == R ? 0 : 1;
}
