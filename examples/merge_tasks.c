/* Merge two tasks into one model (bico_merge): task arithmetic over whole
 * checkpoints, and TIES on one tensor.
 *
 * Once each task's update is in the target's coordinates (a carried
 * adapter, a delta from `bico transfer --delta-output`, a fine-tuned
 * target), theta = theta_base + alpha * sum_t w_t tau_t (LINEAR), or TIES:
 * trim each tau_t to its largest entries (density), elect a sign per entry
 * by the weighted sum, and average the entries that agree with it.  The
 * handle runs over files and writes the result atomically, with a report;
 * bico_merge_tensor is the kernel for one tensor. */
/* mkdtemp is POSIX.1-2008, not C99: ask for it before any header */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <bico/bico.h>

enum { N = 6 };
static char dir[] = "/tmp/bico-example-XXXXXX";

static void ok(bico_ctx *ctx, bico_status st, const char *what) {
  if (st == BICO_OK) return;
  fprintf(stderr, "%s: %s\n", what, bico_ctx_errmsg(ctx));
  exit(1);
}

static void save(bico_ctx *ctx, const char *path, const float *v) {
  bico_stwriter *w = NULL;
  size_t shape[2] = {2, 3};
  ok(ctx, bico_stwriter_create(ctx, path, &w), path);
  ok(ctx, bico_stwriter_declare(w, "fc.weight", BICO_DTYPE_F32, 2, shape), path);
  ok(ctx, bico_stwriter_write_f32(w, "fc.weight", v, N), path);
  ok(ctx, bico_stwriter_commit(w), path);
  bico_stwriter_free(w);
}

int main(void) {
  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK || mkdtemp(dir) == NULL) return 1;
  float base[N] = {1, 2, 3, 4, 5, 6};
  float t1[N] = {0.5f, -1, 0, 2, 0.25f, -0.5f};
  float t2[N] = {-0.5f, -1, 1, -1, 0.75f, 0.5f};
  char p[4][96];
  const char *names[4] = {"base", "task1", "task2", "merged"};
  for (int k = 0; k < 4; k++) snprintf(p[k], 96, "%s/%s.safetensors", dir, names[k]);
  save(ctx, p[0], base);
  save(ctx, p[1], t1);
  save(ctx, p[2], t2);

  /* Task arithmetic: base + 1.0 * (t1 + 0.5 t2). */
  bico_merge *m = NULL;
  ok(ctx, bico_merge_create(ctx, &m), "merge_create");
  ok(ctx, bico_merge_set_file(m, BICO_MERGE_FILE_BASE, p[0]), "set_file");
  ok(ctx, bico_merge_set_file(m, BICO_MERGE_FILE_OUTPUT, p[3]), "set_file");
  ok(ctx, bico_merge_add_input(m, BICO_MERGE_TASK_VECTOR, p[1], 1.0, 1.0), "add_input");
  ok(ctx, bico_merge_add_input(m, BICO_MERGE_TASK_VECTOR, p[2], 0.5, 1.0), "add_input");
  ok(ctx, bico_merge_check(m, BICO_MERGE_CHECK_INPUTS), "merge_check"); /* nothing written */
  ok(ctx, bico_merge_run(m), "merge_run");
  bico_merge_free(m);
  float got[N];
  bico_stfile *f = NULL;
  ok(ctx, bico_stfile_open(ctx, p[3], &f), "stfile_open");
  ok(ctx, bico_stfile_read_f32(f, 0, got, N), "read_f32");
  bico_stfile_free(f);
  double err = 0;
  for (int i = 0; i < N; i++) err = fmax(err, fabs(got[i] - (base[i] + t1[i] + 0.5f * t2[i])));

  /* TIES on one tensor, densities 1: the elected sign of each entry is
   * that of t1 + t2; the entries of that sign are averaged. */
  float *taus[2] = {t1, t2}; /* arrays of pointers: T *const * (docs/api.md) */
  const double weights[2] = {1, 1};
  float ties[N];
  ok(ctx, bico_merge_tensor(ctx, BICO_MERGE_TIES, 2, N, taus, weights, NULL, 1, ties),
     "merge_tensor");
  printf("linear: ");
  for (int i = 0; i < N; i++) printf(" %5.2f", got[i]);
  printf("\nties:   ");
  for (int i = 0; i < N; i++) {
    float sum = t1[i] + t2[i], want = 0;
    int agree = 0;
    for (int k = 0; k < 2; k++)
      if (taus[k][i] != 0 && (taus[k][i] > 0) == (sum >= 0)) want += taus[k][i], agree++;
    want = agree ? want / agree : 0;
    err = fmax(err, fabs(ties[i] - want));
    printf(" %5.2f", ties[i]);
  }
  printf("\n");
  for (int k = 0; k < 4; k++) unlink(p[k]);
  rmdir(dir);
  bico_ctx_free(ctx);
  printf("merge_tasks: %s\n", err < 1e-6 ? "ok" : "WRONG");
  return err < 1e-6 ? 0 : 1;
}
