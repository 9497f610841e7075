/* A small multilayer-perceptron trainer over BLIS: forward and backward for
 * ReLU MLPs, softmax cross-entropy (hard or soft targets), minibatch SGD
 * with momentum or Adam, and model files.  Deterministic: a seeded RNG and
 * sequential reductions (BLIS runs with one thread, set in main). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <blis.h>

#include "demo.h"

/* ---- rng: splitmix64 + Box-Muller ---- */

uint64_t demo_rng_next(demo_rng *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double demo_rng_uniform(demo_rng *r) {
  return (demo_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

double demo_rng_normal(demo_rng *r) {
  double u1 = demo_rng_uniform(r), u2 = demo_rng_uniform(r);
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void demo_rng_perm(demo_rng *r, size_t n, size_t *p) {
  for (size_t i = 0; i < n; i++) p[i] = i;
  for (size_t i = n; i > 1; i--) {
    size_t j = (size_t)(demo_rng_next(r) % i);
    size_t t = p[i - 1];
    p[i - 1] = p[j];
    p[j] = t;
  }
}

uint64_t demo_hash(uint64_t h, const char *s) {
  if (h == 0) h = 0xcbf29ce484222325ull; /* FNV-1a */
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}

/* Row-major C = alpha op(A) op(B) + beta C; A stored m x k (k x m when ta),
 * B stored k x n (n x k when tb).  BLIS takes strides, so a transpose is
 * only a swap of them. */
static void sgemm(int ta, int tb, size_t m, size_t n, size_t k, float alpha,
                  const float *a, size_t lda, const float *b, size_t ldb,
                  float beta, float *c, size_t ldc) {
  inc_t rsa = ta ? 1 : (inc_t)lda, csa = ta ? (inc_t)lda : 1;
  inc_t rsb = tb ? 1 : (inc_t)ldb, csb = tb ? (inc_t)ldb : 1;
  bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, (dim_t)m, (dim_t)n,
            (dim_t)k, &alpha, (float *)a, rsa, csa, (float *)b, rsb, csb,
            &beta, c, (inc_t)ldc, 1);
}

/* ---- the model ---- */

int demo_mlp_alloc(demo_mlp *m, int nl, const size_t *dims) {
  memset(m, 0, sizeof *m);
  if (nl < 1 || nl > DEMO_MAXL) return -1;
  m->nl = nl;
  for (int l = 0; l <= nl; l++) m->dims[l] = dims[l];
  for (int l = 0; l < nl; l++) {
    m->w[l] = calloc(dims[l + 1] * dims[l], sizeof(float));
    m->b[l] = calloc(dims[l + 1], sizeof(float));
    if (m->w[l] == NULL || m->b[l] == NULL) {
      demo_mlp_free(m);
      return -1;
    }
  }
  return 0;
}

void demo_mlp_free(demo_mlp *m) {
  for (int l = 0; l < DEMO_MAXL; l++) {
    free(m->w[l]);
    free(m->b[l]);
  }
  memset(m, 0, sizeof *m);
}

int demo_mlp_copy(demo_mlp *dst, const demo_mlp *src) {
  if (demo_mlp_alloc(dst, src->nl, src->dims) != 0) return -1;
  for (int l = 0; l < src->nl; l++) {
    memcpy(dst->w[l], src->w[l], src->dims[l + 1] * src->dims[l] * sizeof(float));
    memcpy(dst->b[l], src->b[l], src->dims[l + 1] * sizeof(float));
  }
  return 0;
}

int demo_mlp_same_shape(const demo_mlp *a, const demo_mlp *b) {
  if (a->nl != b->nl) return 0;
  for (int l = 0; l <= a->nl; l++)
    if (a->dims[l] != b->dims[l]) return 0;
  return 1;
}

void demo_mlp_init(demo_mlp *m, uint64_t seed) {
  demo_rng r = {seed};
  for (int l = 0; l < m->nl; l++) {
    double sd = sqrt(2.0 / (double)m->dims[l]);
    size_t n = m->dims[l + 1] * m->dims[l];
    for (size_t i = 0; i < n; i++) m->w[l][i] = (float)(sd * demo_rng_normal(&r));
    memset(m->b[l], 0, m->dims[l + 1] * sizeof(float));
  }
}

void demo_mlp_axpy(demo_mlp *dst, const demo_mlp *a, float alpha,
                   const demo_mlp *b, const demo_mlp *c) {
  for (int l = 0; l < a->nl; l++) {
    size_t nw = a->dims[l + 1] * a->dims[l], nb = a->dims[l + 1];
    for (size_t i = 0; i < nw; i++)
      dst->w[l][i] = a->w[l][i] + alpha * (b->w[l][i] - (c ? c->w[l][i] : 0.f));
    for (size_t i = 0; i < nb; i++)
      dst->b[l][i] = a->b[l][i] + alpha * (b->b[l][i] - (c ? c->b[l][i] : 0.f));
  }
}

size_t demo_mlp_params(const demo_mlp *m) {
  size_t n = 0;
  for (int l = 0; l < m->nl; l++) n += m->dims[l + 1] * (m->dims[l] + 1);
  return n;
}

void demo_mlp_shape_str(const demo_mlp *m, char *buf, size_t cap) {
  size_t off = 0;
  buf[0] = '\0';
  for (int l = 0; l <= m->nl && off < cap; l++)
    off += (size_t)snprintf(buf + off, cap - off, "%s%zu", l ? "-" : "",
                            m->dims[l]);
}

/* ---- forward / backward ---- */

int demo_work_alloc(demo_work *w, const demo_mlp *m, size_t cap) {
  memset(w, 0, sizeof *w);
  w->cap = cap;
  w->nl = m->nl;
  size_t widest = 0;
  for (int l = 0; l <= m->nl; l++)
    if (m->dims[l] > widest) widest = m->dims[l];
  int bad = 0;
  for (int l = 0; l < m->nl; l++) {
    w->a[l] = malloc(cap * m->dims[l] * sizeof(float));
    w->z[l] = malloc(cap * m->dims[l + 1] * sizeof(float));
    w->dz[l] = malloc(cap * m->dims[l + 1] * sizeof(float));
    bad |= !w->a[l] || !w->z[l] || !w->dz[l];
  }
  w->da = malloc(cap * widest * sizeof(float));
  if (bad || w->da == NULL) {
    demo_work_free(w);
    return -1;
  }
  return 0;
}

void demo_work_free(demo_work *w) {
  for (int l = 0; l <= DEMO_MAXL; l++) free(w->a[l]);
  for (int l = 0; l < DEMO_MAXL; l++) {
    free(w->z[l]);
    free(w->dz[l]);
  }
  free(w->da);
  memset(w, 0, sizeof *w);
}

void demo_mlp_forward(const demo_mlp *m, demo_work *w, size_t n,
                      const float *x) {
  memcpy(w->a[0], x, n * m->dims[0] * sizeof(float));
  for (int l = 0; l < m->nl; l++) {
    size_t din = m->dims[l], dout = m->dims[l + 1];
    float *z = w->z[l];
    for (size_t i = 0; i < n; i++) memcpy(z + i * dout, m->b[l], dout * sizeof(float));
    sgemm(0, 1, n, dout, din, 1.f, w->a[l], din, m->w[l], din, 1.f, z, dout);
    if (l + 1 < m->nl) {
      float *a = w->a[l + 1];
      for (size_t i = 0; i < n * dout; i++) a[i] = z[i] > 0.f ? z[i] : 0.f;
    }
  }
}

/* dz[l] for l < last from dz[last]: back through the layers and ReLUs. */
static void backward_hidden(const demo_mlp *m, demo_work *w, size_t n) {
  for (int l = m->nl - 1; l > 0; l--) {
    size_t din = m->dims[l], dout = m->dims[l + 1];
    sgemm(0, 0, n, din, dout, 1.f, w->dz[l], dout, m->w[l], din, 0.f, w->da, din);
    const float *zp = w->z[l - 1];
    float *dzp = w->dz[l - 1];
    for (size_t i = 0; i < n * din; i++) dzp[i] = zp[i] > 0.f ? w->da[i] : 0.f;
  }
}

double demo_mlp_backward(const demo_mlp *m, demo_work *w, size_t n,
                         const uint8_t *y) {
  int last = m->nl - 1;
  size_t c = m->dims[m->nl];
  double loss = 0;
  for (size_t i = 0; i < n; i++) {
    const float *z = w->z[last] + i * c;
    float *g = w->dz[last] + i * c;
    float mx = z[0];
    for (size_t j = 1; j < c; j++) mx = z[j] > mx ? z[j] : mx;
    double s = 0;
    for (size_t j = 0; j < c; j++) s += exp((double)(z[j] - mx));
    for (size_t j = 0; j < c; j++) g[j] = (float)(exp((double)(z[j] - mx)) / s);
    g[y[i]] -= 1.f;
    loss += log(s) - (double)(z[y[i]] - mx);
  }
  backward_hidden(m, w, n);
  return loss;
}

double demo_mlp_backward_soft(const demo_mlp *m, demo_work *w, size_t n,
                              const float *p) {
  int last = m->nl - 1;
  size_t c = m->dims[m->nl];
  double loss = 0;
  for (size_t i = 0; i < n; i++) {
    const float *z = w->z[last] + i * c, *pi = p + i * c;
    float *g = w->dz[last] + i * c;
    float mx = z[0];
    for (size_t j = 1; j < c; j++) mx = z[j] > mx ? z[j] : mx;
    double s = 0;
    for (size_t j = 0; j < c; j++) s += exp((double)(z[j] - mx));
    double ls = log(s);
    for (size_t j = 0; j < c; j++) {
      g[j] = (float)(exp((double)(z[j] - mx)) / s) - pi[j];
      loss -= (double)pi[j] * ((double)(z[j] - mx) - ls);
    }
  }
  backward_hidden(m, w, n);
  return loss;
}

void demo_mlp_param_grad(const demo_mlp *m, const demo_work *w, size_t n,
                         float scale, demo_mlp *g) {
  for (int l = 0; l < m->nl; l++) {
    size_t din = m->dims[l], dout = m->dims[l + 1];
    sgemm(1, 0, dout, din, n, scale, w->dz[l], dout, w->a[l], din, 0.f,
          g->w[l], din);
    for (size_t j = 0; j < dout; j++) {
      double s = 0;
      for (size_t i = 0; i < n; i++) s += w->dz[l][i * dout + j];
      g->b[l][j] = (float)(scale * s);
    }
  }
}

static size_t argmax(const float *z, size_t c) {
  size_t k = 0;
  for (size_t j = 1; j < c; j++)
    if (z[j] > z[k]) k = j;
  return k;
}

double demo_mlp_accuracy(const demo_mlp *m, demo_work *w, const demo_data *d) {
  size_t right = 0, c = m->dims[m->nl];
  for (size_t lo = 0; lo < d->n; lo += w->cap) {
    size_t n = d->n - lo < w->cap ? d->n - lo : w->cap;
    demo_mlp_forward(m, w, n, d->x + lo * DEMO_PIX);
    for (size_t i = 0; i < n; i++)
      right += argmax(w->z[m->nl - 1] + i * c, c) == d->y[lo + i];
  }
  return d->n ? 100.0 * (double)right / (double)d->n : 0.0;
}

/* Forward from layer `start` on, with w->a[start] already filled. */
static void forward_from(const demo_mlp *m, demo_work *w, size_t n, int start) {
  for (int l = start; l < m->nl; l++) {
    size_t din = m->dims[l], dout = m->dims[l + 1];
    float *z = w->z[l];
    for (size_t i = 0; i < n; i++) memcpy(z + i * dout, m->b[l], dout * sizeof(float));
    sgemm(0, 1, n, dout, din, 1.f, w->a[l], din, m->w[l], din, 1.f, z, dout);
    if (l + 1 < m->nl) {
      float *a = w->a[l + 1];
      for (size_t i = 0; i < n * dout; i++) a[i] = z[i] > 0.f ? z[i] : 0.f;
    }
  }
}

int demo_mlp_line_accuracy(const demo_mlp *m, const demo_mlp *u,
                           const float *alphas, size_t nalpha,
                           const demo_data *d, double *acc) {
  const size_t cap = 500, c = m->dims[m->nl], h = m->dims[1], N = d->n;
  demo_work w;
  demo_mlp cand;
  float *p = malloc((N ? N : 1) * h * sizeof *p), *q = malloc((N ? N : 1) * h * sizeof *q);
  int ok = p && q && demo_work_alloc(&w, m, cap) == 0;
  if (ok && demo_mlp_copy(&cand, m) != 0) {
    demo_work_free(&w);
    ok = 0;
  }
  if (!ok) {
    free(p);
    free(q);
    return -1;
  }
  /* the first layer (most of the work) is linear in alpha:
   * x (W + alpha U)^T + b + alpha u = P + alpha Q, computed once */
  for (size_t i = 0; i < N; i++) {
    memcpy(p + i * h, m->b[0], h * sizeof *p);
    memcpy(q + i * h, u->b[0], h * sizeof *q);
  }
  sgemm(0, 1, N, h, m->dims[0], 1.f, d->x, m->dims[0], m->w[0], m->dims[0], 1.f, p, h);
  sgemm(0, 1, N, h, m->dims[0], 1.f, d->x, m->dims[0], u->w[0], m->dims[0], 1.f, q, h);
  for (size_t k = 0; k < nalpha; k++) {
    size_t right = 0;
    demo_mlp_axpy(&cand, m, alphas[k], u, NULL);
    for (size_t lo = 0; lo < N; lo += cap) {
      size_t n = N - lo < cap ? N - lo : cap;
      float *z = w.z[0];
      const float *pp = p + lo * h, *qq = q + lo * h;
      for (size_t i = 0; i < n * h; i++) z[i] = pp[i] + alphas[k] * qq[i];
      if (m->nl > 1) {
        for (size_t i = 0; i < n * h; i++) w.a[1][i] = z[i] > 0.f ? z[i] : 0.f;
        forward_from(&cand, &w, n, 1);
      }
      for (size_t i = 0; i < n; i++)
        right += argmax(w.z[m->nl - 1] + i * c, c) == d->y[lo + i];
    }
    acc[k] = N ? 100.0 * (double)right / (double)N : 0.0;
  }
  demo_mlp_free(&cand);
  demo_work_free(&w);
  free(p);
  free(q);
  return 0;
}

/* ---- optimizers ---- */

int demo_opt_init(demo_opt *o, const demo_mlp *m, int adam, float beta1) {
  memset(o, 0, sizeof *o);
  o->adam = adam;
  o->beta1 = beta1;
  o->beta2 = 0.999f;
  o->eps = 1e-8f;
  if (demo_mlp_alloc(&o->m1, m->nl, m->dims) != 0) return -1;
  if (adam && demo_mlp_alloc(&o->m2, m->nl, m->dims) != 0) {
    demo_mlp_free(&o->m1);
    return -1;
  }
  return 0;
}

void demo_opt_free(demo_opt *o) {
  demo_mlp_free(&o->m1);
  demo_mlp_free(&o->m2);
  memset(o, 0, sizeof *o);
}

/* One tensor: heavy-ball SGD (v = beta1 v + g; x -= lr v) or Adam with bias
 * correction c1 = 1 - beta1^t, c2 = 1 - beta2^t. */
static void opt_tensor(const demo_opt *o, size_t n, float *x, const float *g,
                       float *m1, float *m2, float lr, float c1, float c2) {
  if (!o->adam) {
    for (size_t i = 0; i < n; i++) {
      m1[i] = o->beta1 * m1[i] + g[i];
      x[i] -= lr * m1[i];
    }
    return;
  }
  const float b1 = o->beta1, b2 = o->beta2, step = lr / c1, rc2 = 1.f / c2;
  for (size_t i = 0; i < n; i++) {
    m1[i] = b1 * m1[i] + (1.f - b1) * g[i];
    m2[i] = b2 * m2[i] + (1.f - b2) * g[i] * g[i];
    x[i] -= step * m1[i] / (sqrtf(m2[i] * rc2) + o->eps);
  }
}

void demo_opt_step(demo_opt *o, demo_mlp *m, const demo_mlp *g, float lr) {
  o->t++;
  float c1 = 1.f, c2 = 1.f;
  if (o->adam) {
    c1 = 1.f - (float)pow((double)o->beta1, (double)o->t);
    c2 = 1.f - (float)pow((double)o->beta2, (double)o->t);
  }
  for (int l = 0; l < m->nl; l++) {
    size_t nw = m->dims[l + 1] * m->dims[l], nb = m->dims[l + 1];
    opt_tensor(o, nw, m->w[l], g->w[l], o->m1.w[l], o->adam ? o->m2.w[l] : NULL,
               lr, c1, c2);
    opt_tensor(o, nb, m->b[l], g->b[l], o->m1.b[l], o->adam ? o->m2.b[l] : NULL,
               lr, c1, c2);
  }
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int demo_mlp_train(demo_mlp *m, const demo_data *d, const demo_train_cfg *cfg,
                   const char *label) {
  size_t bs = cfg->batch, c = m->dims[m->nl];
  demo_work w;
  demo_mlp g;
  demo_opt opt;
  size_t *order = malloc(d->n * sizeof *order);
  float *xb = malloc(bs * DEMO_PIX * sizeof *xb);
  uint8_t *yb = malloc(bs);
  int ok = order && xb && yb && demo_work_alloc(&w, m, bs) == 0;
  if (ok && demo_mlp_alloc(&g, m->nl, m->dims) != 0) {
    demo_work_free(&w);
    ok = 0;
  }
  if (ok && demo_opt_init(&opt, m, 0, cfg->momentum) != 0) {
    demo_work_free(&w);
    demo_mlp_free(&g);
    ok = 0;
  }
  if (!ok) {
    free(order);
    free(xb);
    free(yb);
    fprintf(stderr, "demo: out of memory training %s\n", label);
    return -1;
  }
  demo_rng r = {cfg->seed};
  size_t steps_per = (d->n + bs - 1) / bs, total = steps_per * (size_t)cfg->epochs;
  size_t step = 0;
  double t0 = now();
  for (int e = 0; e < cfg->epochs; e++) {
    demo_rng_perm(&r, d->n, order);
    double loss = 0;
    size_t right = 0;
    for (size_t lo = 0; lo < d->n; lo += bs, step++) {
      size_t n = d->n - lo < bs ? d->n - lo : bs;
      for (size_t i = 0; i < n; i++) {
        memcpy(xb + i * DEMO_PIX, d->x + order[lo + i] * DEMO_PIX,
               DEMO_PIX * sizeof *xb);
        yb[i] = d->y[order[lo + i]];
      }
      demo_mlp_forward(m, &w, n, xb);
      for (size_t i = 0; i < n; i++)
        right += argmax(w.z[m->nl - 1] + i * c, c) == yb[i];
      loss += demo_mlp_backward(m, &w, n, yb);
      demo_mlp_param_grad(m, &w, n, 1.f / (float)n, &g);
      /* cosine decay: large steps early, settling at the end */
      float lr = cfg->lr * 0.5f *
                 (1.f + (float)cos(3.141592653589793 * (double)step / (double)total));
      demo_opt_step(&opt, m, &g, lr);
    }
    fprintf(stderr, "  %-28s epoch %d/%d  loss %.4f  train acc %5.2f%%  (%.1f s)\n",
            label, e + 1, cfg->epochs, loss / (double)d->n,
            100.0 * (double)right / (double)d->n, now() - t0);
  }
  demo_work_free(&w);
  demo_mlp_free(&g);
  demo_opt_free(&opt);
  free(order);
  free(xb);
  free(yb);
  return 0;
}

/* ---- model files (native byte order; a cache, not an exchange format) ---- */

static const char MAGIC[8] = {'B', 'I', 'C', 'O', 'D', 'E', 'M', 'O'};
#define FILE_VERSION 1u

int demo_mlp_save(const demo_mlp *m, const char *path, uint64_t fingerprint) {
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "wb");
  if (f == NULL) {
    fprintf(stderr, "demo: cannot write %s\n", tmp);
    return -1;
  }
  uint32_t hdr[2] = {FILE_VERSION, (uint32_t)m->nl};
  int ok = fwrite(MAGIC, 1, 8, f) == 8 && fwrite(hdr, 4, 2, f) == 2 &&
           fwrite(&fingerprint, 8, 1, f) == 1;
  for (int l = 0; ok && l <= m->nl; l++) {
    uint64_t dim = m->dims[l];
    ok = fwrite(&dim, 8, 1, f) == 1;
  }
  for (int l = 0; ok && l < m->nl; l++) {
    size_t nw = m->dims[l + 1] * m->dims[l], nb = m->dims[l + 1];
    ok = fwrite(m->w[l], sizeof(float), nw, f) == nw &&
         fwrite(m->b[l], sizeof(float), nb, f) == nb;
  }
  if (fclose(f) != 0) ok = 0;
  /* rename only a complete file into place: an interrupted run leaves no
   * truncated cache behind */
  if (!ok || rename(tmp, path) != 0) {
    remove(tmp);
    fprintf(stderr, "demo: writing %s failed\n", path);
    return -1;
  }
  return 0;
}

int demo_mlp_load(demo_mlp *m, const char *path, uint64_t fingerprint) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return -1;
  char magic[8];
  uint32_t hdr[2];
  uint64_t fp, dims64[DEMO_MAXL + 1];
  size_t dims[DEMO_MAXL + 1];
  int ok = fread(magic, 1, 8, f) == 8 && memcmp(magic, MAGIC, 8) == 0 &&
           fread(hdr, 4, 2, f) == 2 && hdr[0] == FILE_VERSION &&
           hdr[1] >= 1 && hdr[1] <= DEMO_MAXL && fread(&fp, 8, 1, f) == 1 &&
           fp == fingerprint;
  int nl = ok ? (int)hdr[1] : 0;
  if (ok) ok = fread(dims64, 8, (size_t)nl + 1, f) == (size_t)nl + 1;
  for (int l = 0; ok && l <= nl; l++) {
    ok = dims64[l] >= 1 && dims64[l] <= 100000;
    dims[l] = (size_t)dims64[l];
  }
  if (ok) ok = demo_mlp_alloc(m, nl, dims) == 0;
  else memset(m, 0, sizeof *m);
  for (int l = 0; ok && l < nl; l++) {
    size_t nw = dims[l + 1] * dims[l], nb = dims[l + 1];
    ok = fread(m->w[l], sizeof(float), nw, f) == nw &&
         fread(m->b[l], sizeof(float), nb, f) == nb;
  }
  if (ok) ok = fgetc(f) == EOF; /* no trailing bytes */
  fclose(f);
  if (!ok) {
    demo_mlp_free(m);
    return -1;
  }
  return 0;
}
