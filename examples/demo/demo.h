/* The libbico demo: a tiny MLP trainer over BLIS, Fashion-MNIST loading,
 * downstream tasks, the transfers through libbico's public API, and the
 * report.  Example code: none of it is part of the library. */
#ifndef BICO_DEMO_H
#define BICO_DEMO_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define DEMO_PIX 784
#define DEMO_CLASSES 10
#define DEMO_MAXL 8

/* ---- data.c ---- */

/* n images of DEMO_PIX floats in [0, 1] and their labels. */
typedef struct demo_data {
  size_t n;
  float *x;
  uint8_t *y;
} demo_data;

/* Reads a gzip-compressed IDX image file and its label file; returns 0 or
 * prints why not and returns -1. */
int demo_data_load(const char *images_gz, const char *labels_gz,
                   demo_data *out);
void demo_data_free(demo_data *d);
/* Copies rows [lo, lo + n) into a new dataset. */
int demo_data_slice(const demo_data *d, size_t lo, size_t n, demo_data *out);

/* ---- rng (mlp.c) ---- */

typedef struct demo_rng {
  uint64_t s;
} demo_rng;
uint64_t demo_rng_next(demo_rng *r);
double demo_rng_uniform(demo_rng *r);
double demo_rng_normal(demo_rng *r);
/* A uniformly random permutation of 0..n-1 (Fisher-Yates). */
void demo_rng_perm(demo_rng *r, size_t n, size_t *p);

/* ---- mlp.c ---- */

/* A multilayer perceptron: nl linear layers, ReLU between them.
 * Layer l maps dims[l] -> dims[l+1]; w[l] is [dims[l+1], dims[l]] row-major
 * (the PyTorch layout), b[l] is [dims[l+1]]. */
typedef struct demo_mlp {
  int nl;
  size_t dims[DEMO_MAXL + 1];
  float *w[DEMO_MAXL];
  float *b[DEMO_MAXL];
} demo_mlp;

int demo_mlp_alloc(demo_mlp *m, int nl, const size_t *dims);
void demo_mlp_free(demo_mlp *m);
int demo_mlp_copy(demo_mlp *dst, const demo_mlp *src);
int demo_mlp_same_shape(const demo_mlp *a, const demo_mlp *b);
/* He-normal weights, zero biases. */
void demo_mlp_init(demo_mlp *m, uint64_t seed);
/* dst = a + alpha * (b - c), all of one shape (c may be NULL: dst = a + alpha b). */
void demo_mlp_axpy(demo_mlp *dst, const demo_mlp *a, float alpha,
                   const demo_mlp *b, const demo_mlp *c);
size_t demo_mlp_params(const demo_mlp *m);
void demo_mlp_shape_str(const demo_mlp *m, char *buf, size_t cap);

/* Forward/backward workspace for batches of up to `cap` rows. */
typedef struct demo_work {
  size_t cap;
  int nl;
  float *a[DEMO_MAXL + 1]; /* a[l]: input of layer l (a[0] = x), [n, dims[l]] */
  float *z[DEMO_MAXL];     /* z[l]: pre-activation output of layer l */
  float *dz[DEMO_MAXL];    /* gradient of the summed loss w.r.t. z[l] */
  float *da;               /* scratch */
} demo_work;

int demo_work_alloc(demo_work *w, const demo_mlp *m, size_t cap);
void demo_work_free(demo_work *w);

/* Forward pass on n rows of x (n <= cap); logits in w->z[nl-1]. */
void demo_mlp_forward(const demo_mlp *m, demo_work *w, size_t n,
                      const float *x);
/* After a forward pass: dz[l] for every layer from the gradient of the
 * summed softmax cross-entropy with labels y; returns the summed loss. */
double demo_mlp_backward(const demo_mlp *m, demo_work *w, size_t n,
                         const uint8_t *y);
/* The same with soft targets p ([n, classes], rows summing to 1): the
 * gradient w.r.t. the logits is softmax(z) - p; returns the summed
 * cross-entropy -sum p log softmax(z). */
double demo_mlp_backward_soft(const demo_mlp *m, demo_work *w, size_t n,
                              const float *p);
/* After backward: g = gradient w.r.t. the parameters, scaled by `scale`
 * (g has m's shape). */
void demo_mlp_param_grad(const demo_mlp *m, const demo_work *w, size_t n,
                         float scale, demo_mlp *g);

/* Accuracy (percent) on a dataset. */
double demo_mlp_accuracy(const demo_mlp *m, demo_work *w, const demo_data *d);

/* Accuracies of m + alphas[k] u for k < nalpha (one pass over d; the
 * first layer, linear in alpha, is computed once).  Returns 0 or -1. */
int demo_mlp_line_accuracy(const demo_mlp *m, const demo_mlp *u,
                           const float *alphas, size_t nalpha,
                           const demo_data *d, double *acc);

typedef struct demo_train_cfg {
  int epochs;
  size_t batch;
  float lr;       /* SGD learning rate, cosine-decayed to zero */
  float momentum; /* heavy-ball momentum */
  uint64_t seed;  /* minibatch order */
} demo_train_cfg;

/* The optimizer state of one model: heavy-ball SGD (v = beta1 v + g,
 * x -= lr v) or Adam (beta1, beta2 = 0.999, eps = 1e-8, bias-corrected). */
typedef struct demo_opt {
  int adam;
  float beta1, beta2, eps;
  size_t t;        /* steps taken */
  demo_mlp m1, m2; /* velocity / first moment; second moment (Adam) */
} demo_opt;
int demo_opt_init(demo_opt *o, const demo_mlp *m, int adam, float beta1);
void demo_opt_free(demo_opt *o);
/* m -= the step for gradient g at learning rate lr. */
void demo_opt_step(demo_opt *o, demo_mlp *m, const demo_mlp *g, float lr);

/* Minibatch SGD with momentum on softmax cross-entropy.  `label` prefixes the
 * progress lines. */
int demo_mlp_train(demo_mlp *m, const demo_data *d, const demo_train_cfg *cfg,
                   const char *label);

/* Binary model files: magic, format version, a fingerprint of how the model
 * was made (a stale cache is retrained), layer dims, then the f32 tensors. */
int demo_mlp_save(const demo_mlp *m, const char *path, uint64_t fingerprint);
/* Returns 0 when the file exists with this fingerprint and loads. */
int demo_mlp_load(demo_mlp *m, const char *path, uint64_t fingerprint);
uint64_t demo_hash(uint64_t h, const char *s);

/* ---- tasks.c ---- */

enum { DEMO_TASK_ROT90, DEMO_TASK_INVERT, DEMO_TASK_PATCHES, DEMO_TASK_LABELS,
       DEMO_NTASKS };
const char *demo_task_name(int task);
/* A transformed copy of d for the task (fixed seeds inside). */
int demo_task_apply(int task, const demo_data *d, demo_data *out);

/* ---- transfer.c ---- */

enum { DEMO_M_ZERO, DEMO_M_NAIVE, DEMO_M_PAD, DEMO_M_GRADFIX, DEMO_M_BICO,
       DEMO_M_BICO_IN, DEMO_M_BICO_OUT, DEMO_M_FIT, DEMO_M_DISTILL, DEMO_M_FT,
       DEMO_NMETHODS };
const char *demo_method_name(int method);

/* The update each method proposes for target b: upd[method] gets b's shape
 * (valid[method] = 0 where a method does not apply; always for distill and
 * fine-tuned, which are trained, not transferred).  a, a_ft: source
 * pretrained and fine-tuned; cal: calibration samples of the task.
 * ranks gets a short text with the numerical rank of each map.  bico_only:
 * skip the baselines and the fit (the exact-case check needs BiCo alone).
 * fit_ridge: the sequential fit's c (BICO_FIT_RIDGE); fit_orig_inputs: the
 * ablation that takes every layer's inputs from the original target (no
 * recalibration). */
typedef struct demo_updates {
  int valid[DEMO_NMETHODS];
  demo_mlp upd[DEMO_NMETHODS];
  char ranks[768];
} demo_updates;

int demo_transfer(const demo_mlp *a, const demo_mlp *a_ft, const demo_mlp *b,
                  const demo_data *cal, int null_mode, int bico_only,
                  double fit_ridge, int fit_orig_inputs, demo_updates *out);
void demo_updates_free(demo_updates *u);

/* ---- distill.c ---- */

/* For the report only: z_A_ft - z_A on every row of d (out: [d->n,
 * DEMO_CLASSES]), the same for every target; then the teacher's accuracy
 * (percent), that of argmax(z_B + shift), on the labelled set d. */
int demo_proxy_shift(const demo_mlp *a, const demo_mlp *a_ft,
                     const demo_data *d, float *out);
double demo_proxy_accuracy(const demo_mlp *b, demo_work *w, const demo_data *d,
                           const float *shift);

#define DEMO_DISTILL_MAXEPOCHS 64
typedef struct demo_distill_cfg {
  int epochs;       /* checkpoints: the held-out KL is measured after each */
  size_t per_epoch; /* images an epoch draws, cycling through the training
                     * part of the calibration set (all once at least) */
  int shift;        /* augmentation: random shifts of up to this many pixels */
  size_t batch;
  float lr;         /* cosine-decayed to zero over all epochs */
  int adam;         /* 1: Adam, 0: SGD with `momentum` */
  float momentum;
  int holdout;      /* every holdout-th calibration image is held out */
  uint64_t seed;    /* order and shifts */
} demo_distill_cfg;

typedef struct demo_distill_info {
  size_t ntrain, nheld;
  int epochs;
  int epoch; /* the state kept: 0 is the untouched target */
  double kl[DEMO_DISTILL_MAXEPOCHS + 1];   /* held-out KL after each epoch */
  double loss[DEMO_DISTILL_MAXEPOCHS + 1]; /* mean training cross-entropy */
} demo_distill_info;

/* out = b trained toward softmax(z_B + z_A_ft - z_A) on the calibration
 * images (labels unused), the epoch with the least held-out KL to the
 * teacher (b itself when none beats it).  Returns 0 or -1. */
int demo_distill(const demo_mlp *a, const demo_mlp *a_ft, const demo_mlp *b,
                 const demo_data *cal, const demo_distill_cfg *cfg,
                 demo_mlp *out, demo_distill_info *info);

/* ---- report.c ---- */

#define DEMO_MAXTARGETS 6
typedef struct demo_result {
  int ntargets;
  int ntasks;
  int tasks[DEMO_NTASKS];
  char target_names[DEMO_MAXTARGETS][64];
  char target_shapes[DEMO_MAXTARGETS][64];
  /* acc < 0: not applicable */
  double acc[DEMO_MAXTARGETS][DEMO_NTASKS][DEMO_NMETHODS];
  double alpha[DEMO_MAXTARGETS][DEMO_NTASKS][DEMO_NMETHODS];
  double source_ft[DEMO_NTASKS]; /* A fine-tuned on each task */
  /* distill: the proxy-tuned teacher's test accuracy, the epoch kept */
  double teacher[DEMO_MAXTARGETS][DEMO_NTASKS];
  int distill_epoch[DEMO_MAXTARGETS][DEMO_NTASKS];
  char source_shape[64];
} demo_result;

void demo_report_text(FILE *f, const demo_result *r, int markdown);
int demo_report_svg(const demo_result *r, const char *path);

#endif
