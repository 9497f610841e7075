/* Distillation toward the proxy-tuned teacher: the target B is trained, from
 * its pretrained weights, so that its output distribution matches
 * softmax(z_B + z_A_ft - z_A) (B's logits plus what fine-tuning changed in
 * the source's) on the unlabeled calibration images, shifted by a few
 * pixels for more inputs; the state is chosen by the KL to the teacher on
 * held-out calibration images.  No labels anywhere, and no libbico either:
 * this is demo-side training with the trainer of mlp.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "demo.h"

/* dst = src moved by (dx, dy) pixels (right, down), the edge pixels
 * repeated into the uncovered border (white for `invert`, black else). */
static void shift_image(const float *src, int dx, int dy, float *dst) {
  for (int r = 0; r < 28; r++) {
    int sr = r - dy;
    sr = sr < 0 ? 0 : sr > 27 ? 27 : sr;
    for (int c = 0; c < 28; c++) {
      int sc = c - dx;
      sc = sc < 0 ? 0 : sc > 27 ? 27 : sc;
      dst[r * 28 + c] = src[sr * 28 + sc];
    }
  }
}

/* Row-wise softmax of z [n, c] into p, in double for the sums. */
static void softmax_rows(const float *z, size_t n, size_t c, float *p) {
  for (size_t i = 0; i < n; i++) {
    const float *zi = z + i * c;
    float *pi = p + i * c, mx = zi[0];
    for (size_t j = 1; j < c; j++) mx = zi[j] > mx ? zi[j] : mx;
    double s = 0;
    for (size_t j = 0; j < c; j++) s += exp((double)(zi[j] - mx));
    for (size_t j = 0; j < c; j++) pi[j] = (float)(exp((double)(zi[j] - mx)) / s);
  }
}

/* The proxy-tuned teacher z_B + (z_A_ft - z_A): forward passes of the three
 * models on batches of up to `cap` rows; logits in z ([n, DEMO_CLASSES]). */
typedef struct teacher {
  const demo_mlp *a, *a_ft, *b;
  demo_work wa, wf, wb;
  float *z;
} teacher;

static void teacher_free(teacher *t) {
  demo_work_free(&t->wa);
  demo_work_free(&t->wf);
  demo_work_free(&t->wb);
  free(t->z);
  memset(t, 0, sizeof *t);
}

static int teacher_alloc(teacher *t, const demo_mlp *a, const demo_mlp *a_ft,
                         const demo_mlp *b, size_t cap) {
  memset(t, 0, sizeof *t);
  t->a = a;
  t->a_ft = a_ft;
  t->b = b;
  t->z = malloc(cap * DEMO_CLASSES * sizeof *t->z);
  if (t->z == NULL || demo_work_alloc(&t->wa, a, cap) != 0 ||
      demo_work_alloc(&t->wf, a_ft, cap) != 0 ||
      demo_work_alloc(&t->wb, b, cap) != 0) {
    teacher_free(t);
    return -1;
  }
  return 0;
}

static void teacher_logits(teacher *t, size_t n, const float *x) {
  const size_t c = DEMO_CLASSES;
  demo_mlp_forward(t->a, &t->wa, n, x);
  demo_mlp_forward(t->a_ft, &t->wf, n, x);
  demo_mlp_forward(t->b, &t->wb, n, x);
  const float *za = t->wa.z[t->a->nl - 1], *zf = t->wf.z[t->a_ft->nl - 1],
              *zb = t->wb.z[t->b->nl - 1];
  for (size_t i = 0; i < n * c; i++) t->z[i] = zb[i] + (zf[i] - za[i]);
}

int demo_proxy_shift(const demo_mlp *a, const demo_mlp *a_ft,
                     const demo_data *d, float *out) {
  const size_t c = DEMO_CLASSES, cap = 500;
  demo_work wa, wf;
  if (demo_work_alloc(&wa, a, cap) != 0) return -1;
  if (demo_work_alloc(&wf, a_ft, cap) != 0) {
    demo_work_free(&wa);
    return -1;
  }
  for (size_t lo = 0; lo < d->n; lo += cap) {
    size_t n = d->n - lo < cap ? d->n - lo : cap;
    demo_mlp_forward(a, &wa, n, d->x + lo * DEMO_PIX);
    demo_mlp_forward(a_ft, &wf, n, d->x + lo * DEMO_PIX);
    const float *za = wa.z[a->nl - 1], *zf = wf.z[a_ft->nl - 1];
    for (size_t i = 0; i < n * c; i++) out[lo * c + i] = zf[i] - za[i];
  }
  demo_work_free(&wa);
  demo_work_free(&wf);
  return 0;
}

double demo_proxy_accuracy(const demo_mlp *b, demo_work *w, const demo_data *d,
                           const float *shift) {
  const size_t c = DEMO_CLASSES;
  size_t right = 0;
  for (size_t lo = 0; lo < d->n; lo += w->cap) {
    size_t n = d->n - lo < w->cap ? d->n - lo : w->cap;
    demo_mlp_forward(b, w, n, d->x + lo * DEMO_PIX);
    for (size_t i = 0; i < n; i++) {
      const float *z = w->z[b->nl - 1] + i * c, *sh = shift + (lo + i) * c;
      size_t k = 0;
      float best = z[0] + sh[0];
      for (size_t j = 1; j < c; j++)
        if (z[j] + sh[j] > best) {
          best = z[j] + sh[j];
          k = j;
        }
      right += k == d->y[lo + i];
    }
  }
  return d->n ? 100.0 * (double)right / (double)d->n : 0.0;
}

/* Mean KL(p || softmax(student)) over n rows whose teacher is p. */
static double mean_kl(const demo_mlp *s, demo_work *w, size_t n, const float *x,
                      const float *p) {
  const size_t c = DEMO_CLASSES;
  double kl = 0;
  for (size_t lo = 0; lo < n; lo += w->cap) {
    size_t m = n - lo < w->cap ? n - lo : w->cap;
    demo_mlp_forward(s, w, m, x + lo * DEMO_PIX);
    for (size_t i = 0; i < m; i++) {
      const float *z = w->z[s->nl - 1] + i * c, *pi = p + (lo + i) * c;
      float mx = z[0];
      for (size_t j = 1; j < c; j++) mx = z[j] > mx ? z[j] : mx;
      double sum = 0;
      for (size_t j = 0; j < c; j++) sum += exp((double)(z[j] - mx));
      double ls = log(sum);
      for (size_t j = 0; j < c; j++)
        if (pi[j] > 0.f)
          kl += (double)pi[j] * (log((double)pi[j]) - ((double)(z[j] - mx) - ls));
    }
  }
  return n ? kl / (double)n : 0.0;
}

int demo_distill(const demo_mlp *a, const demo_mlp *a_ft, const demo_mlp *b,
                 const demo_data *cal, const demo_distill_cfg *cfg,
                 demo_mlp *out, demo_distill_info *info) {
  const size_t c = DEMO_CLASSES, bs = cfg->batch;
  const size_t k = cfg->holdout > 1 ? (size_t)cfg->holdout : 2;
  size_t nh = cal->n / k, nt = cal->n - nh;
  /* an epoch: per_epoch draws of the training images (each at least once) */
  size_t nitems = cfg->per_epoch > nt ? cfg->per_epoch : nt;
  int epochs = cfg->epochs < DEMO_DISTILL_MAXEPOCHS ? cfg->epochs
                                                    : DEMO_DISTILL_MAXEPOCHS;
  teacher t = {0};
  demo_work ws = {0};
  demo_mlp s = {0}, g = {0};
  demo_opt opt = {0};
  int ret = -1;
  memset(info, 0, sizeof *info);
  memset(out, 0, sizeof *out);
  info->ntrain = nt;
  info->nheld = nh;
  float *xh = malloc((nh ? nh : 1) * DEMO_PIX * sizeof *xh);
  float *ph = malloc((nh ? nh : 1) * c * sizeof *ph);
  float *xb = malloc(bs * DEMO_PIX * sizeof *xb);
  float *pb = malloc(bs * c * sizeof *pb);
  size_t *train_idx = malloc((nt ? nt : 1) * sizeof *train_idx);
  size_t *order = malloc((nitems ? nitems : 1) * sizeof *order);
  /* the teacher of each (image, shift) pair, computed the first time a
   * batch holds it: the shifts are few, so most steps need no teacher pass */
  const int sh = cfg->shift > 0 ? cfg->shift : 0, side = 2 * sh + 1;
  const size_t nshift = (size_t)side * (size_t)side;
  int *shifts = malloc((nitems ? nitems : 1) * sizeof *shifts);
  float *pcache = malloc((nt ? nt : 1) * nshift * c * sizeof *pcache);
  uint8_t *have = calloc((nt ? nt : 1) * nshift, 1);
  size_t *miss = malloc(bs * sizeof *miss), *keys = malloc(bs * sizeof *keys);
  float *xm = malloc(bs * DEMO_PIX * sizeof *xm);
  if (!xh || !ph || !xb || !pb || !train_idx || !order || !shifts ||
      !pcache || !have || !miss || !keys || !xm ||
      teacher_alloc(&t, a, a_ft, b, bs) != 0 ||
      demo_work_alloc(&ws, b, bs) != 0 || demo_mlp_copy(&s, b) != 0 ||
      demo_mlp_copy(out, b) != 0 || demo_mlp_alloc(&g, b->nl, b->dims) != 0 ||
      demo_opt_init(&opt, b, cfg->adam, cfg->adam ? 0.9f : cfg->momentum) != 0)
    goto done;

  /* every k-th calibration image is held out (whatever its class: the
   * split, like everything here, sees no label) */
  size_t ih = 0, it = 0;
  for (size_t i = 0; i < cal->n; i++) {
    if (i % k == k - 1 && ih < nh)
      memcpy(xh + ih++ * DEMO_PIX, cal->x + i * DEMO_PIX, DEMO_PIX * sizeof *xh);
    else
      train_idx[it++] = i;
  }
  for (size_t lo = 0; lo < nh; lo += bs) { /* the held-out teacher, once */
    size_t n = nh - lo < bs ? nh - lo : bs;
    teacher_logits(&t, n, xh + lo * DEMO_PIX);
    softmax_rows(t.z, n, c, ph + lo * c);
  }
  double best = mean_kl(&s, &ws, nh, xh, ph);
  info->kl[0] = best;
  info->epoch = 0;

  demo_rng r = {cfg->seed};
  size_t steps_per = (nitems + bs - 1) / bs, total = steps_per * (size_t)epochs;
  size_t step = 0;
  for (int e = 1; e <= epochs; e++) {
    demo_rng_perm(&r, nitems, order);
    for (size_t i = 0; i < nitems; i++) /* a fresh shift per item and epoch */
      shifts[i] = (int)(demo_rng_next(&r) % nshift);
    double loss = 0;
    for (size_t lo = 0; lo < nitems; lo += bs, step++) {
      size_t n = nitems - lo < bs ? nitems - lo : bs, nmiss = 0;
      for (size_t i = 0; i < n; i++) {
        size_t item = order[lo + i], si = (size_t)shifts[item];
        size_t key = (item % nt) * nshift + si;
        shift_image(cal->x + train_idx[item % nt] * DEMO_PIX,
                    (int)(si % (size_t)side) - sh, (int)(si / (size_t)side) - sh,
                    xb + i * DEMO_PIX);
        if (!have[key]) {
          have[key] = 1; /* a key twice in one batch is computed once */
          miss[nmiss++] = i;
        }
        keys[i] = key;
      }
      if (nmiss > 0) { /* the teacher on the new pairs, in one pass */
        for (size_t j = 0; j < nmiss; j++)
          memcpy(xm + j * DEMO_PIX, xb + miss[j] * DEMO_PIX, DEMO_PIX * sizeof *xm);
        teacher_logits(&t, nmiss, xm);
        for (size_t j = 0; j < nmiss; j++)
          softmax_rows(t.z + j * c, 1, c, pcache + keys[miss[j]] * c);
      }
      for (size_t i = 0; i < n; i++)
        memcpy(pb + i * c, pcache + keys[i] * c, c * sizeof *pb);
      demo_mlp_forward(&s, &ws, n, xb);
      loss += demo_mlp_backward_soft(&s, &ws, n, pb);
      demo_mlp_param_grad(&s, &ws, n, 1.f / (float)n, &g);
      float lr = cfg->lr * 0.5f *
                 (1.f + (float)cos(3.141592653589793 * (double)step / (double)total));
      demo_opt_step(&opt, &s, &g, lr);
    }
    double kl = mean_kl(&s, &ws, nh, xh, ph);
    info->kl[e] = kl;
    info->loss[e] = nitems ? loss / (double)nitems : 0.0;
    if (kl < best) { /* a strictly better state replaces the kept one */
      best = kl;
      info->epoch = e;
      for (int l = 0; l < s.nl; l++) {
        memcpy(out->w[l], s.w[l], s.dims[l + 1] * s.dims[l] * sizeof(float));
        memcpy(out->b[l], s.b[l], s.dims[l + 1] * sizeof(float));
      }
    }
  }
  info->epochs = epochs;
  ret = 0;
done:
  if (ret != 0) demo_mlp_free(out);
  demo_opt_free(&opt);
  demo_mlp_free(&g);
  demo_mlp_free(&s);
  demo_work_free(&ws);
  teacher_free(&t);
  free(xh);
  free(ph);
  free(xb);
  free(pb);
  free(train_idx);
  free(order);
  free(shifts);
  free(pcache);
  free(have);
  free(miss);
  free(keys);
  free(xm);
  return ret;
}
