/* A host that runs its own forward passes hands libbico the rows of one
 * layer's inputs and output gradients, from several threads; the
 * accumulators are merged, the Procrustes maps solved, and one tensor of a
 * fine-tune carried from the source model to a wider target
 * (bico_xcov, bico_procrustes, bico_transport).
 *
 * Planted answer: the target's layer sees the source's rows in other
 * coordinates, x_B = x_A P with P a 6 x 8 matrix of orthonormal rows (a
 * wider model), and its output gradients g_B = g_A S.  The maps must come
 * out as P and S, and the carried update as S^T tau P.
 *
 * Threads: a context and the handles made with it are used by one thread
 * at a time, so each worker has its own context and accumulators; the
 * main thread merges them (handles of different contexts may be merged;
 * a failure is reported on the context of the one merged into). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <bico/bico.h>

enum { DA = 6, DB = 8, THREADS = 3, ROWS = 200, BATCH = 32 };
static float P[DA * DB], S[DA * DB]; /* the planted maps (row-major) */

/* A DA x DB matrix with orthonormal rows: the first DA of DB coordinates,
 * signed and permuted.  Its own rows must come back from the solve. */
static void planted(float *m, unsigned seed) {
  for (int i = 0; i < DA * DB; i++) m[i] = 0;
  for (int i = 0; i < DA; i++) m[i * DB + (i * 3 + seed) % DB] = (i + seed) % 2 ? 1 : -1;
}

typedef struct worker {
  int id;
  bico_ctx *ctx;
  bico_xcov *in, *out; /* this thread's statistics of the layer */
  bico_status st;
} worker;

/* The host's forward pass over its shard, a batch at a time: the layer's
 * input rows in both models (x_A, x_B = x_A P) and its output gradients
 * (g_A, g_B = g_A S).  Row values come from a small generator. */
static void *run_shard(void *arg) {
  worker *w = arg;
  float xa[BATCH * DA], xb[BATCH * DB], ga[BATCH * DA], gb[BATCH * DB];
  unsigned s = 12345u + 1000u * (unsigned)w->id;
  w->st = bico_xcov_create(w->ctx, DA, DB, 0, &w->in);
  if (w->st == BICO_OK) w->st = bico_xcov_create(w->ctx, DA, DB, 0, &w->out);
  for (int done = 0; done < ROWS && w->st == BICO_OK; done += BATCH) {
    int n = ROWS - done < BATCH ? ROWS - done : BATCH;
    for (int r = 0; r < n; r++) {
      for (int i = 0; i < DA; i++) {
        s = s * 1103515245u + 12345u;
        xa[r * DA + i] = (float)((s >> 8) % 2001) / 1000.0f - 1.0f;
        ga[r * DA + i] = tanhf(xa[r * DA + i] * (float)(i + 1));
      }
      for (int j = 0; j < DB; j++) {
        xb[r * DB + j] = gb[r * DB + j] = 0;
        for (int i = 0; i < DA; i++) {
          xb[r * DB + j] += xa[r * DA + i] * P[i * DB + j];
          gb[r * DB + j] += ga[r * DA + i] * S[i * DB + j];
        }
      }
    }
    /* rows of the source pair with rows of the target, in order */
    w->st = bico_xcov_add(w->in, (size_t)n, xa, DA, xb, DB);
    if (w->st == BICO_OK) w->st = bico_xcov_add(w->out, (size_t)n, ga, DA, gb, DB);
  }
  return NULL;
}

int main(void) {
  planted(P, 1);
  planted(S, 4);
  worker w[THREADS];
  pthread_t th[THREADS];
  for (int k = 0; k < THREADS; k++) {
    w[k] = (worker){k, NULL, NULL, NULL, BICO_OK};
    if (bico_ctx_create(&w[k].ctx) != BICO_OK) return 1;
    if (pthread_create(&th[k], NULL, run_shard, &w[k]) != 0) return 1;
  }
  int bad = 0;
  for (int k = 0; k < THREADS; k++) {
    pthread_join(th[k], NULL);
    if (w[k].st != BICO_OK) {
      fprintf(stderr, "thread %d: %s\n", k, bico_ctx_errmsg(w[k].ctx));
      bad = 1;
    }
  }
  /* The shards' statistics add up to the whole data's. */
  bico_ctx *ctx = w[0].ctx;
  bico_status st = bad ? BICO_E_INTERNAL : BICO_OK;
  for (int k = 1; k < THREADS && st == BICO_OK; k++) {
    st = bico_xcov_merge(w[0].in, w[k].in);
    if (st == BICO_OK) st = bico_xcov_merge(w[0].out, w[k].out);
  }
  uint64_t rows = 0;
  if (st == BICO_OK) st = bico_xcov_info(w[0].in, NULL, NULL, &rows, NULL);
  /* The maps: R = U V^T of each statistic, and their numerical ranks. */
  float r_in[DA * DB], r_out[DA * DB];
  size_t rank_in = 0, rank_out = 0;
  bico_procrustes *pr = NULL;
  if (st == BICO_OK) st = bico_procrustes_create(ctx, &pr);
  if (st == BICO_OK) st = bico_procrustes_solve(pr, w[0].in, r_in, DB, &rank_in);
  if (st == BICO_OK) st = bico_procrustes_solve(pr, w[0].out, r_out, DB, &rank_out);
  /* One tensor of the fine-tune, tau [d_out, d_in] = [DA, DA], carried to
   * the target's [DB, DB]: out = R_out^T tau R_in. */
  float tau[DA * DA], out[DB * DB];
  for (int i = 0; i < DA * DA; i++) tau[i] = (float)((i * 7) % 11) / 10.0f - 0.5f;
  if (st == BICO_OK)
    st = bico_transport_weight(ctx, DA, DA, DB, DB, 1.0f, tau, DA, r_out, DB,
                               r_in, DB, 0.0f, out, DB);
  if (st != BICO_OK) {
    fprintf(stderr, "host_stats: %s\n", bico_ctx_errmsg(ctx));
    bad = 1;
  } else {
    double err = 0; /* against S^T tau P, computed here */
    for (int a = 0; a < DB; a++)
      for (int b = 0; b < DB; b++) {
        double want = 0;
        for (int i = 0; i < DA; i++)
          for (int j = 0; j < DA; j++)
            want += S[i * DB + a] * tau[i * DA + j] * P[j * DB + b];
        err = fmax(err, fabs(want - out[a * DB + b]));
      }
    for (int i = 0; i < DA * DB; i++)
      err = fmax(err, fmax(fabs(r_in[i] - P[i]), fabs(r_out[i] - S[i])));
    printf("%llu rows from %d threads; ranks %zu, %zu; largest error %.2g\n",
           (unsigned long long)rows, THREADS, rank_in, rank_out, err);
    bad = rows != (uint64_t)THREADS * ROWS || rank_in != DA || err > 1e-4;
  }
  bico_procrustes_free(pr);
  for (int k = 0; k < THREADS; k++) {
    bico_xcov_free(w[k].in);
    bico_xcov_free(w[k].out);
    bico_ctx_free(w[k].ctx);
  }
  printf("host_stats: %s\n", bad ? "WRONG" : "ok");
  return bad;
}
