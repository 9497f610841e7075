/* bico-demo: libbico's main job end to end on Fashion-MNIST.
 *
 * 1. Pretrain a source MLP A and targets of other seeds, data and shapes.
 * 2. Fine-tune A (the task vectors) and each target (the upper bound) on
 *    downstream tasks.
 * 3. Carry A's task vectors to each target with every method, through
 *    libbico's public API (BiCo, its ablations, the baselines and the
 *    sequential fit), alpha chosen on a validation split; and distil each
 *    target toward the proxy-tuned teacher softmax(z_B + z_A_ft - z_A) on
 *    the same unlabeled calibration images (distill.c, demo-side training).
 * 4. Report test accuracy and the share of the zero-shot -> fine-tuned gap
 *    closed, as text, Markdown and SVG.
 *
 * Trained models are cached in the output folder (fingerprinted by how they
 * were made), so a rerun only redoes the transfers.  `--small` is the quick
 * configuration `make check` runs; it also checks BiCo's exact case. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <blis.h>
#include <bico/bico.h>

#include "demo.h"

typedef struct target_spec {
  const char *name;
  int nl;
  size_t dims[DEMO_MAXL + 1];
  uint64_t seed;
  int perm_of_a; /* 1: A with its hidden units permuted (same function) */
} target_spec;

typedef struct config {
  const char *tag;
  size_t a_dims[DEMO_MAXL + 1];
  int a_nl;
  size_t pre_n;   /* pretraining samples per model */
  int pre_epochs;
  float pre_lr;
  size_t ft_n;    /* fine-tuning samples per task */
  int ft_epochs;
  float ft_lr;
  size_t val_n, test_n;
  int cal_per_class;
  int ntasks;
  int tasks[DEMO_NTASKS];
  int ntargets;
  target_spec targets[DEMO_MAXTARGETS];
} config;

/* The sizes are set so that a first run fits in 10 minutes on 2 cores. */
static const config FULL = {
    "full", {784, 256, 256, 10}, 3, 30000, 4, 0.05f, 8000, 3, 0.02f, 2000,
    10000, 10, 4,
    {DEMO_TASK_ROT90, DEMO_TASK_INVERT, DEMO_TASK_PATCHES, DEMO_TASK_LABELS},
    4,
    {{"B-same", 3, {784, 256, 256, 10}, 2, 0},
     {"B-wide", 3, {784, 384, 384, 10}, 3, 0},
     {"B-deep", 4, {784, 384, 384, 384, 10}, 4, 0},
     {"B-perm", 3, {784, 256, 256, 10}, 5, 1}}};

static const config SMALL = {
    "small", {784, 128, 128, 10}, 3, 6000, 2, 0.05f, 2000, 2, 0.02f, 1000,
    2000, 10, 1, {DEMO_TASK_ROT90}, 2,
    {{"B-wide", 3, {784, 192, 192, 10}, 3, 0},
     {"B-perm", 3, {784, 128, 128, 10}, 5, 1}}};

/* The distillation toward the proxy-tuned teacher (distill.c), the same in
 * both configurations (the seed varies per task and target): every 5th
 * calibration image held out, 32 epochs of 640 draws of the others (each of
 * the default 80 8 times) with a random shift of up to 2 pixels, batches of
 * 64, Adam at 3e-3 cosine-decayed.  docs/demo.md has the measurements. */
static const demo_distill_cfg DISTILL = {32, 640, 2, 64, 3e-3f, 1, 0.9f, 5,
                                         0xd15711};

static const float ALPHAS[] = {0.25f, 0.5f, 0.75f, 1.f, 1.25f, 1.5f,
                               2.f,   2.5f, 3.f};
#define NALPHA (sizeof ALPHAS / sizeof ALPHAS[0])

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int mkdirs(const char *path) {
  char buf[4096];
  snprintf(buf, sizeof buf, "%s", path);
  for (char *p = buf + 1; *p; p++)
    if (*p == '/') {
      *p = '\0';
      if (mkdir(buf, 0777) != 0 && errno != EEXIST) return -1;
      *p = '/';
    }
  if (mkdir(buf, 0777) != 0 && errno != EEXIST) return -1;
  return 0;
}

/* A trained model from the cache, or trained now and cached. */
static int get_model(demo_mlp *m, const char *dir, const char *name,
                     const char *recipe, const demo_mlp *init_from, int nl,
                     const size_t *dims, uint64_t init_seed,
                     const demo_data *data, const demo_train_cfg *tc) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s.bin", dir, name);
  uint64_t fp = demo_hash(0, recipe);
  if (demo_mlp_load(m, path, fp) == 0) {
    fprintf(stderr, "  %-28s cached (%s)\n", name, path);
    return 0;
  }
  if (init_from) {
    if (demo_mlp_copy(m, init_from) != 0) return -1;
  } else {
    if (demo_mlp_alloc(m, nl, dims) != 0) return -1;
    demo_mlp_init(m, init_seed);
  }
  if (demo_mlp_train(m, data, tc, name) != 0 ||
      demo_mlp_save(m, path, fp) != 0) {
    demo_mlp_free(m);
    return -1;
  }
  return 0;
}

/* B = A with each hidden layer's units permuted: W_l <- P_l W_l P_{l-1}^T. */
static int permute_hidden(const demo_mlp *a, uint64_t seed, demo_mlp *b) {
  if (demo_mlp_copy(b, a) != 0) return -1;
  size_t *perm[DEMO_MAXL + 1] = {0};
  demo_rng r = {seed};
  for (int l = 0; l <= a->nl; l++) {
    perm[l] = malloc(a->dims[l] * sizeof(size_t));
    if (perm[l] == NULL) goto fail;
    if (l == 0 || l == a->nl) /* inputs and classes keep their order */
      for (size_t i = 0; i < a->dims[l]; i++) perm[l][i] = i;
    else
      demo_rng_perm(&r, a->dims[l], perm[l]);
  }
  for (int l = 0; l < a->nl; l++) {
    size_t din = a->dims[l], dout = a->dims[l + 1];
    for (size_t i = 0; i < dout; i++) {
      size_t si = perm[l + 1][i];
      b->b[l][i] = a->b[l][si];
      for (size_t j = 0; j < din; j++)
        b->w[l][i * din + j] = a->w[l][si * din + perm[l][j]];
    }
  }
  for (int l = 0; l <= a->nl; l++) free(perm[l]);
  return 0;
fail:
  for (int l = 0; l <= a->nl; l++) free(perm[l]);
  demo_mlp_free(b);
  return -1;
}

/* The first `per_class` samples of each class, in dataset order. */
static int calib_set(const demo_data *d, int per_class, demo_data *out) {
  int count[DEMO_CLASSES] = {0};
  size_t n = 0, want = (size_t)per_class * DEMO_CLASSES;
  if (demo_data_slice(d, 0, want < d->n ? want : d->n, out) != 0) return -1;
  for (size_t i = 0; i < d->n && n < want; i++)
    if (count[d->y[i]] < per_class) {
      count[d->y[i]]++;
      memcpy(out->x + n * DEMO_PIX, d->x + i * DEMO_PIX, DEMO_PIX * sizeof(float));
      out->y[n++] = d->y[i];
    }
  out->n = n;
  return 0;
}

/* BiCo's exact case: B is A with permuted hidden units, so B + tau_B must
 * compute what A_ft computes, and tau_B must equal P tau P^T.  That holds
 * when the statistics cover every direction the task vector uses.  10
 * samples per class (100 rows) cannot identify maps of width 784 or 256, and
 * units that are silent on the task's images at A but wake up during
 * fine-tuning are unidentified too; so the check calibrates on up to
 * EXACT_ROWS fine-tuning images plus `plain_n` pretraining images. */
#define EXACT_ROWS 2000
static int exact_case(const demo_mlp *a, const demo_mlp *a_ft,
                      const demo_mlp *b, uint64_t perm_seed,
                      const demo_data *ft, const demo_data *plain,
                      size_t plain_n, const demo_data *tst, demo_work *w,
                      double a_ft_acc) {
  demo_updates up;
  demo_mlp cand, want;
  demo_data cal;
  int ret = -1;
  size_t ft_n = ft->n < EXACT_ROWS ? ft->n : EXACT_ROWS;
  if (plain_n > plain->n) plain_n = plain->n;
  if (demo_data_slice(ft, 0, ft_n, &cal) != 0) return -1;
  cal.n = ft_n + plain_n;
  float *x = realloc(cal.x, cal.n * DEMO_PIX * sizeof *x);
  uint8_t *y = realloc(cal.y, cal.n);
  if (x) cal.x = x;
  if (y) cal.y = y;
  if (x == NULL || y == NULL) goto out_cal;
  memcpy(cal.x + ft_n * DEMO_PIX, plain->x, plain_n * DEMO_PIX * sizeof *x);
  memcpy(cal.y + ft_n, plain->y, plain_n);
  if (demo_transfer(a, a_ft, b, &cal, BICO_NULL_KEEP, 1, 0.0, 0, &up) != 0) goto out_cal;
  if (demo_mlp_copy(&cand, b) != 0) goto out_up;
  if (permute_hidden(a_ft, perm_seed, &want) != 0) goto out_cand;
  demo_mlp_axpy(&want, &want, -1.f, b, NULL); /* the planted answer P tau P^T */
  const demo_mlp *u = &up.upd[DEMO_M_BICO];
  double e = 0, n = 0;
  for (int l = 0; l < b->nl; l++) {
    size_t nw = b->dims[l + 1] * b->dims[l], nb = b->dims[l + 1];
    for (size_t i = 0; i < nw; i++) {
      e += (double)(u->w[l][i] - want.w[l][i]) * (u->w[l][i] - want.w[l][i]);
      n += (double)want.w[l][i] * want.w[l][i];
    }
    for (size_t i = 0; i < nb; i++) {
      e += (double)(u->b[l][i] - want.b[l][i]) * (u->b[l][i] - want.b[l][i]);
      n += (double)want.b[l][i] * want.b[l][i];
    }
  }
  demo_mlp_axpy(&cand, b, 1.f, u, NULL);
  double acc = demo_mlp_accuracy(&cand, w, tst);
  int ok = fabs(acc - a_ft_acc) <= 0.5;
  fprintf(stderr, "  exact case (calibrated on %zu images, alpha 1): bico %.2f%% vs "
                  "A fine-tuned %.2f%%, |tau_B - P tau P^T| / |P tau P^T| = %.1e: %s\n",
          cal.n, acc, a_ft_acc, sqrt(e / (n > 0 ? n : 1)),
          ok ? "ok" : "CHECK FAILED (more than 0.5 points apart)");
  ret = ok ? 0 : -1;
  demo_mlp_free(&want);
out_cand:
  demo_mlp_free(&cand);
out_up:
  demo_updates_free(&up);
out_cal:
  demo_data_free(&cal);
  return ret;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: bico-demo [--small] [--out DIR] [--data DIR]\n"
          "  --small     the quick configuration `make check` runs (one task,\n"
          "              one trained target and the exact case); exits 1 if a\n"
          "              property that must hold fails\n"
          "  --out DIR   cache and results folder (default build/demo)\n"
          "  --data DIR  Fashion-MNIST *.gz folder\n"
          "              (default /usr/share/datasets/fashion-mnist)\n"
          "  --threads N BLIS threads (default 1; results do not depend on it)\n"
          "  --null keep|drop\n"
          "              completion of rank-deficient maps for the transfers\n"
          "              (default keep, libbico's default; docs/demo.md)\n"
          "  --cal-per-class N\n"
          "              calibration samples per class (default 10, as in the\n"
          "              papers; more than the fine-tuning set holds is capped)\n"
          "  --fit-ridge C\n"
          "              the sequential fit's ridge c (BICO_FIT_RIDGE, default\n"
          "              1e-2; docs/fit.md)\n"
          "  --fit-inputs updated|original\n"
          "              the fit's layer inputs: from the target with the\n"
          "              earlier layers' updates applied (default), or from\n"
          "              the original target (the ablation without\n"
          "              recalibration)\n");
}

int main(int argc, char **argv) {
  const char *out_dir = NULL, *data_dir = "/usr/share/datasets/fashion-mnist";
  int small = 0, threads = 1, null_mode = BICO_NULL_KEEP, cal_pc = 0;
  double fit_ridge = 1e-2;
  int fit_orig = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--small") == 0) small = 1;
    else if (strcmp(argv[i], "--out") == 0 && i + 1 < argc) out_dir = argv[++i];
    else if (strcmp(argv[i], "--data") == 0 && i + 1 < argc) data_dir = argv[++i];
    else if (strcmp(argv[i], "--null") == 0 && i + 1 < argc) {
      const char *v = argv[++i];
      if (strcmp(v, "keep") == 0) null_mode = BICO_NULL_KEEP;
      else if (strcmp(v, "drop") == 0) null_mode = BICO_NULL_DROP;
      else {
        fprintf(stderr, "bico-demo: --null wants keep or drop, not '%s'\n", v);
        return 2;
      }
    } else if (strcmp(argv[i], "--cal-per-class") == 0 && i + 1 < argc) {
      cal_pc = atoi(argv[++i]);
      if (cal_pc < 1 || cal_pc > 5000) {
        fprintf(stderr, "bico-demo: --cal-per-class wants 1..5000, not '%s'\n", argv[i]);
        return 2;
      }
    } else if (strcmp(argv[i], "--fit-ridge") == 0 && i + 1 < argc) {
      char *end = NULL;
      fit_ridge = strtod(argv[++i], &end);
      if (end == argv[i] || *end != '\0' || !(fit_ridge >= 0 && fit_ridge <= 1e6)) {
        fprintf(stderr, "bico-demo: --fit-ridge wants a number in [0, 1e6], not '%s'\n",
                argv[i]);
        return 2;
      }
    } else if (strcmp(argv[i], "--fit-inputs") == 0 && i + 1 < argc) {
      const char *v = argv[++i];
      if (strcmp(v, "updated") == 0) fit_orig = 0;
      else if (strcmp(v, "original") == 0) fit_orig = 1;
      else {
        fprintf(stderr, "bico-demo: --fit-inputs wants updated or original, not '%s'\n", v);
        return 2;
      }
    } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = atoi(argv[++i]);
      if (threads < 1 || threads > 256) {
        fprintf(stderr, "bico-demo: --threads wants 1..256, not '%s'\n", argv[i]);
        return 2;
      }
    }
    else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    } else {
      fprintf(stderr, "bico-demo: unknown argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  config cfv = small ? SMALL : FULL;
  if (cal_pc > 0) cfv.cal_per_class = cal_pc;
  const config *cf = &cfv;
  if (out_dir == NULL) out_dir = small ? "build/demo-test" : "build/demo";
  if (mkdirs(out_dir) != 0) {
    fprintf(stderr, "bico-demo: cannot create %s\n", out_dir);
    return 1;
  }
  /* BLIS splits a GEMM's rows and columns among threads, never its inner
   * (reduction) dimension, so every sum runs in the same order whatever the
   * thread count: results do not depend on it.  One thread by default:
   * BLIS's threads spin at barriers, which costs dearly on a busy machine */
  bli_thread_set_num_threads(threads);
  double t0 = now(), distill_s = 0;
  int failed = 0;

  char pi[4096], pl[4096];
  demo_data train = {0}, test = {0};
  snprintf(pi, sizeof pi, "%s/train-images-idx3-ubyte.gz", data_dir);
  snprintf(pl, sizeof pl, "%s/train-labels-idx1-ubyte.gz", data_dir);
  if (demo_data_load(pi, pl, &train) != 0) return 1;
  snprintf(pi, sizeof pi, "%s/t10k-images-idx3-ubyte.gz", data_dir);
  snprintf(pl, sizeof pl, "%s/t10k-labels-idx1-ubyte.gz", data_dir);
  if (demo_data_load(pi, pl, &test) != 0) return 1;
  fprintf(stderr, "bico-demo (%s configuration), libbico %s: Fashion-MNIST "
                  "%zu train / %zu test images, %d threads, output in %s\n",
          cf->tag, bico_version_string(), train.n, test.n, threads, out_dir);

  /* Splits of the 60000 training images: A pretrains on the first half,
   * the targets on the second; the downstream tasks fine-tune on a slice
   * and choose alpha on the last val_n images; the test split is t10k. */
  size_t half = train.n / 2;
  demo_data pre_a, pre_b, ft_base, val_base, test_base;
  if (demo_data_slice(&train, 0, cf->pre_n, &pre_a) ||
      demo_data_slice(&train, half, cf->pre_n, &pre_b) ||
      demo_data_slice(&train, train.n - cf->val_n - cf->ft_n, cf->ft_n, &ft_base) ||
      demo_data_slice(&train, train.n - cf->val_n, cf->val_n, &val_base) ||
      demo_data_slice(&test, 0, cf->test_n, &test_base)) {
    fprintf(stderr, "bico-demo: out of memory\n");
    return 1;
  }

  char recipe[1024], name[128];
  demo_train_cfg pre_tc = {cf->pre_epochs, 128, cf->pre_lr, 0.9f, 11};
  demo_train_cfg ft_tc = {cf->ft_epochs, 128, cf->ft_lr, 0.9f, 12};

  fprintf(stderr, "[1/4] pretraining (%zu images, %d epochs each)\n",
          cf->pre_n, cf->pre_epochs);
  demo_mlp a;
  snprintf(recipe, sizeof recipe, "v1 pretrain A nl=%d %zu-%zu-%zu-%zu seed=1 "
           "data=[0,%zu) ep=%d lr=%g", cf->a_nl, cf->a_dims[0], cf->a_dims[1],
           cf->a_dims[2], cf->a_dims[3], cf->pre_n, cf->pre_epochs, cf->pre_lr);
  if (get_model(&a, out_dir, "A", recipe, NULL, cf->a_nl, cf->a_dims, 1,
                &pre_a, &pre_tc) != 0)
    return 1;
  uint64_t a_fp = demo_hash(0, recipe);
  demo_mlp b[DEMO_MAXTARGETS];
  uint64_t b_fp[DEMO_MAXTARGETS];
  for (int t = 0; t < cf->ntargets; t++) {
    const target_spec *ts = &cf->targets[t];
    if (ts->perm_of_a) {
      if (permute_hidden(&a, ts->seed, &b[t]) != 0) return 1;
      fprintf(stderr, "  %-28s A with its hidden units permuted\n", ts->name);
      continue;
    }
    size_t off = 0;
    off += (size_t)snprintf(recipe, sizeof recipe, "v1 pretrain %s seed=%llu "
                            "data=[%zu,+%zu) ep=%d lr=%g dims", ts->name,
                            (unsigned long long)ts->seed, half, cf->pre_n,
                            cf->pre_epochs, cf->pre_lr);
    for (int l = 0; l <= ts->nl && off < sizeof recipe; l++)
      off += (size_t)snprintf(recipe + off, sizeof recipe - off, " %zu", ts->dims[l]);
    if (get_model(&b[t], out_dir, ts->name, recipe, NULL, ts->nl, ts->dims,
                  ts->seed, &pre_b, &pre_tc) != 0)
      return 1;
    b_fp[t] = demo_hash(0, recipe);
  }

  { /* how good the pretrained models are on the plain task */
    demo_work pw;
    for (int t = -1; t < cf->ntargets; t++) {
      const demo_mlp *m = t < 0 ? &a : &b[t];
      if (demo_work_alloc(&pw, m, 500) != 0) return 1;
      fprintf(stderr, "  %-28s plain test accuracy %.1f%%\n",
              t < 0 ? "A" : cf->targets[t].name, demo_mlp_accuracy(m, &pw, &test_base));
      demo_work_free(&pw);
    }
  }

  demo_result *res = calloc(1, sizeof *res);
  if (res == NULL) return 1;
  res->ntargets = cf->ntargets;
  res->ntasks = cf->ntasks;
  demo_mlp_shape_str(&a, res->source_shape, sizeof res->source_shape);
  for (int t = 0; t < cf->ntargets; t++) {
    snprintf(res->target_names[t], sizeof res->target_names[t], "%s",
             cf->targets[t].name);
    demo_mlp_shape_str(&b[t], res->target_shapes[t], sizeof res->target_shapes[t]);
  }
  demo_work w;

  for (int k = 0; k < cf->ntasks; k++) {
    int task = cf->tasks[k];
    res->tasks[k] = task;
    const char *tn = demo_task_name(task);
    demo_data ft, val, tst, cal;
    if (demo_task_apply(task, &ft_base, &ft) || demo_task_apply(task, &val_base, &val) ||
        demo_task_apply(task, &test_base, &tst) || calib_set(&ft, cf->cal_per_class, &cal)) {
      fprintf(stderr, "bico-demo: out of memory\n");
      return 1;
    }
    fprintf(stderr, "[2/4] task %s: fine-tuning (%zu images, %d epochs)\n", tn,
            cf->ft_n, cf->ft_epochs);
    demo_mlp a_ft;
    demo_train_cfg tc = ft_tc;
    tc.seed = ft_tc.seed + (uint64_t)task;
    snprintf(name, sizeof name, "A-ft-%s", tn);
    snprintf(recipe, sizeof recipe, "v1 finetune base=%llx task=%s data=[-%zu,+%zu) "
             "ep=%d lr=%g", (unsigned long long)a_fp, tn, cf->val_n + cf->ft_n,
             cf->ft_n, cf->ft_epochs, cf->ft_lr);
    if (get_model(&a_ft, out_dir, name, recipe, &a, 0, NULL, 0, &ft, &tc) != 0)
      return 1;
    if (demo_work_alloc(&w, &a_ft, 500) != 0) {
      fprintf(stderr, "bico-demo: out of memory\n");
      return 1;
    }
    res->source_ft[k] = demo_mlp_accuracy(&a_ft, &w, &tst);
    /* z_A_ft - z_A on the test images: the teacher's accuracy per target */
    float *tshift = malloc(tst.n * DEMO_CLASSES * sizeof *tshift);
    if (tshift == NULL || demo_proxy_shift(&a, &a_ft, &tst, tshift) != 0) {
      fprintf(stderr, "bico-demo: out of memory\n");
      return 1;
    }
    fprintf(stderr, "  A zero-shot %.1f%%, A fine-tuned %.1f%% (test)\n",
            demo_mlp_accuracy(&a, &w, &tst), res->source_ft[k]);
    demo_work_free(&w);

    for (int t = 0; t < cf->ntargets; t++) {
      const target_spec *ts = &cf->targets[t];
      demo_mlp b_ft, cand;
      if (ts->perm_of_a) {
        /* its fine-tuned twin: A_ft in the same permuted coordinates */
        if (permute_hidden(&a_ft, ts->seed, &b_ft) != 0) return 1;
      } else {
        snprintf(name, sizeof name, "%s-ft-%s", ts->name, tn);
        snprintf(recipe, sizeof recipe, "v1 finetune base=%llx task=%s "
                 "data=[-%zu,+%zu) ep=%d lr=%g", (unsigned long long)b_fp[t],
                 tn, cf->val_n + cf->ft_n, cf->ft_n, cf->ft_epochs, cf->ft_lr);
        if (get_model(&b_ft, out_dir, name, recipe, &b[t], 0, NULL, 0, &ft, &tc) != 0)
          return 1;
      }
      fprintf(stderr, "[3/4] task %s, target %s: transfers\n", tn, ts->name);
      demo_updates up;
      double tt = now();
      if (demo_transfer(&a, &a_ft, &b[t], &cal, null_mode, 0, fit_ridge, fit_orig,
                        &up) != 0)
        return 1;
      double te = now();
      fprintf(stderr, "  %s (%.1f s)\n", up.ranks, te - tt);
      /* the distillation toward the proxy-tuned teacher (label-free) */
      demo_mlp stud;
      demo_distill_info di;
      demo_distill_cfg dc = DISTILL;
      dc.seed = DISTILL.seed + 16 * (uint64_t)task + (uint64_t)t;
      double td = now();
      if (demo_distill(&a, &a_ft, &b[t], &cal, &dc, &stud, &di) != 0) {
        fprintf(stderr, "bico-demo: distillation failed\n");
        return 1;
      }
      td = now() - td;
      distill_s += td;
      te = now();
      if (demo_work_alloc(&w, &b[t], 500) != 0) {
        fprintf(stderr, "bico-demo: out of memory\n");
        return 1;
      }
      res->teacher[t][k] = demo_proxy_accuracy(&b[t], &w, &tst, tshift);
      res->distill_epoch[t][k] = di.epoch;
      fprintf(stderr, "  distill (%.1f s): %zu images, %zu held out; KL to the "
              "teacher there %.4f (target) -> %.4f (epoch %d of %d kept); "
              "teacher test %.1f%%\n", td, di.ntrain, di.nheld, di.kl[0],
              di.kl[di.epoch], di.epoch, di.epochs, res->teacher[t][k]);
      if (demo_mlp_copy(&cand, &b[t]) != 0) {
        demo_work_free(&w);
        fprintf(stderr, "bico-demo: out of memory\n");
        return 1;
      }
      for (int m = 0; m < DEMO_NMETHODS; m++) {
        double *acc = &res->acc[t][k][m];
        res->alpha[t][k][m] = 0;
        *acc = -1;
        if (m == DEMO_M_FT) {
          *acc = demo_mlp_accuracy(&b_ft, &w, &tst);
        } else if (m == DEMO_M_DISTILL) {
          *acc = demo_mlp_accuracy(&stud, &w, &tst);
        } else if (m == DEMO_M_ZERO) {
          *acc = demo_mlp_accuracy(&b[t], &w, &tst);
        } else if (up.valid[m]) {
          /* alpha from the grid by validation accuracy (first best wins) */
          double best = -1, vacc[NALPHA];
          float best_alpha = ALPHAS[0];
          if (demo_mlp_line_accuracy(&b[t], &up.upd[m], ALPHAS, NALPHA, &val, vacc) != 0)
            return 1;
          for (size_t i = 0; i < NALPHA; i++)
            if (vacc[i] > best) {
              best = vacc[i];
              best_alpha = ALPHAS[i];
            }
          demo_mlp_axpy(&cand, &b[t], best_alpha, &up.upd[m], NULL);
          *acc = demo_mlp_accuracy(&cand, &w, &tst);
          res->alpha[t][k][m] = best_alpha;
        }
        if (*acc >= 0)
          fprintf(stderr, "  %-11s test %5.1f%%", demo_method_name(m), *acc);
        if (*acc >= 0 && res->alpha[t][k][m] > 0)
          fprintf(stderr, "  (alpha %g)", res->alpha[t][k][m]);
        if (*acc >= 0) fprintf(stderr, "\n");
      }
      /* the transferred model as a file: it must load and evaluate alike */
      demo_mlp_axpy(&cand, &b[t], (float)res->alpha[t][k][DEMO_M_BICO],
                    &up.upd[DEMO_M_BICO], NULL);
      snprintf(name, sizeof name, "%s/%s-bico-%s.bin", out_dir, ts->name, tn);
      demo_mlp back;
      if (demo_mlp_save(&cand, name, 1) != 0 || demo_mlp_load(&back, name, 1) != 0) {
        fprintf(stderr, "CHECK FAILED: transferred model %s does not load\n", name);
        failed = 1;
      } else {
        double acc = demo_mlp_accuracy(&back, &w, &tst);
        if (acc != res->acc[t][k][DEMO_M_BICO]) {
          fprintf(stderr, "CHECK FAILED: %s evaluates to %.2f%%, in memory %.2f%%\n",
                  name, acc, res->acc[t][k][DEMO_M_BICO]);
          failed = 1;
        }
        demo_mlp_free(&back);
      }
      if (ts->perm_of_a && exact_case(&a, &a_ft, &b[t], ts->seed, &ft, &pre_a,
                                      EXACT_ROWS, &tst, &w, res->source_ft[k]) != 0)
        failed = 1;
      fprintf(stderr, "  (evaluation %.1f s)\n", now() - te);
      demo_mlp_free(&cand);
      demo_mlp_free(&stud);
      demo_work_free(&w);
      demo_updates_free(&up);
      demo_mlp_free(&b_ft);
    }
    free(tshift);
    demo_mlp_free(&a_ft);
    demo_data_free(&ft);
    demo_data_free(&val);
    demo_data_free(&tst);
    demo_data_free(&cal);
  }

  fprintf(stderr, "[4/4] report (%.1f s so far, %.1f s of it distilling)\n",
          now() - t0, distill_s);
  demo_report_text(stdout, res, 0);
  char path[4096];
  snprintf(path, sizeof path, "%s/results.md", out_dir);
  FILE *f = fopen(path, "w");
  if (f == NULL) {
    fprintf(stderr, "bico-demo: cannot write %s\n", path);
    return 1;
  }
  fprintf(f, "# libbico demo results (%s configuration)\n\nTest accuracy (%%) "
             "on Fashion-MNIST downstream tasks; in parentheses the share of "
             "the zero-shot -> fine-tuned gap closed.\n", cf->tag);
  demo_report_text(f, res, 1);
  fclose(f);
  snprintf(path, sizeof path, "%s/results.svg", out_dir);
  if (demo_report_svg(res, path) != 0) failed = 1;
  fprintf(stderr, "wrote %s/results.md and %s/results.svg (%.1f s)\n", out_dir,
          out_dir, now() - t0);

  for (int t = 0; t < cf->ntargets; t++) demo_mlp_free(&b[t]);
  demo_mlp_free(&a);
  free(res);
  demo_data_free(&pre_a);
  demo_data_free(&pre_b);
  demo_data_free(&ft_base);
  demo_data_free(&val_base);
  demo_data_free(&test_base);
  demo_data_free(&train);
  demo_data_free(&test);
  return failed;
}
