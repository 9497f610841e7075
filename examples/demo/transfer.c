/* Every transfer method of the demo, through libbico's public API only: the
 * same calls an outside program makes.  The example owns the model (its
 * tensors, forward and backward passes); libbico owns the statistics, the
 * maps and the transported updates. */
#include <stdlib.h>
#include <string.h>

#include <bico/bico.h>

#include "demo.h"

static const char *const NAMES[DEMO_NMETHODS] = {
    "zero-shot", "naive", "pad", "gradfix", "bico", "bico-in", "bico-out",
    "fit", "distill", "fine-tuned"};

const char *demo_method_name(int method) {
  return method >= 0 && method < DEMO_NMETHODS ? NAMES[method] : "?";
}

void demo_updates_free(demo_updates *u) {
  for (int k = 0; k < DEMO_NMETHODS; k++) demo_mlp_free(&u->upd[k]);
  memset(u, 0, sizeof *u);
}

#define CK(call)                                                         \
  do {                                                                   \
    int rc_ = (call);                                                    \
    if (rc_ != BICO_OK) {                                                \
      fprintf(stderr, "demo: %s failed: %s: %s\n", #call,                \
              bico_strerror(rc_), bico_ctx_errmsg(ctx));                 \
      goto fail;                                                         \
    }                                                                    \
  } while (0)

/* Target layer l takes source layer src[l]: the first layer (784 inputs in
 * both) and the head (10 outputs in both) pair by name; the hidden-to-hidden
 * layers are the repeated blocks and pair by the depth map. */
static int pair_layers(bico_ctx *ctx, const demo_mlp *a, const demo_mlp *b,
                       int *src) {
  size_t la = (size_t)a->nl - 2, lb = (size_t)b->nl - 2;
  if (a->nl < 2 || b->nl < 2 || (la == 0) != (lb == 0)) {
    fprintf(stderr, "demo: cannot pair a %d-layer source with a %d-layer "
                    "target\n", a->nl, b->nl);
    return -1;
  }
  src[0] = 0;
  src[b->nl - 1] = a->nl - 1;
  if (lb > 0) {
    for (size_t j = 0; j < lb; j++) {
      size_t i = 0;
      CK(bico_depthmap_source(la, lb, j, &i));
      src[j + 1] = (int)i + 1;
    }
  }
  return 0;
fail:
  return -1;
}

/* GradFix votes: per-sample gradients of the calibration loss on the target
 * (one forward/backward per sample), one accumulator per parameter tensor. */
static int gradfix(bico_ctx *ctx, const demo_mlp *b, const demo_mlp *tau,
                   const demo_data *cal, demo_mlp *upd, double *kept_frac) {
  bico_votes *vw[DEMO_MAXL] = {0}, *vb[DEMO_MAXL] = {0};
  demo_work w;
  demo_mlp g;
  int ret = -1;
  if (demo_work_alloc(&w, b, 1) != 0) return -1;
  if (demo_mlp_alloc(&g, b->nl, b->dims) != 0) {
    demo_work_free(&w);
    return -1;
  }
  for (int l = 0; l < b->nl; l++) {
    CK(bico_votes_create(ctx, b->dims[l + 1] * b->dims[l], 0, &vw[l]));
    CK(bico_votes_create(ctx, b->dims[l + 1], 0, &vb[l]));
  }
  for (size_t k = 0; k < cal->n; k++) {
    demo_mlp_forward(b, &w, 1, cal->x + k * DEMO_PIX);
    demo_mlp_backward(b, &w, 1, cal->y + k);
    demo_mlp_param_grad(b, &w, 1, 1.f, &g);
    for (int l = 0; l < b->nl; l++) {
      CK(bico_votes_add_grad(vw[l], g.w[l]));
      CK(bico_votes_add_grad(vb[l], g.b[l]));
    }
  }
  size_t kept_all = 0, total = 0;
  for (int l = 0; l < b->nl; l++) {
    size_t kw = 0, kb = 0;
    CK(bico_gradfix_apply(vw[l], BICO_GRADFIX_MAJORITY, 1.f, tau->w[l], 0.f,
                          upd->w[l], &kw));
    CK(bico_gradfix_apply(vb[l], BICO_GRADFIX_MAJORITY, 1.f, tau->b[l], 0.f,
                          upd->b[l], &kb));
    kept_all += kw + kb;
    total += b->dims[l + 1] * (b->dims[l] + 1);
  }
  *kept_frac = (double)kept_all / (double)total;
  ret = 0;
fail:
  for (int l = 0; l < DEMO_MAXL; l++) {
    bico_votes_free(vw[l]);
    bico_votes_free(vb[l]);
  }
  demo_mlp_free(&g);
  demo_work_free(&w);
  return ret;
}

/* The sequential functional fit through bico_fit_run: the demo is the host
 * that owns the model and runs its forward passes; libbico accumulates,
 * solves and hands back each layer's update before the next layer's rows
 * are asked for (docs/fit.md). */
typedef struct fit_host {
  const demo_mlp *a, *b; /* the source and the original target */
  demo_mlp cur;          /* b plus the updates fitted so far */
  demo_mlp *upd;         /* where the updates go */
  const demo_data *cal;
  const int *src;        /* source layer of each target layer */
  const demo_work *wa, *wf, *wb; /* A, A_ft, B on the calibration rows */
  float *const *rout;    /* R_out per target layer, [d_out,A x d_out,B] */
  demo_work wc;          /* forward pass of cur */
  float *d;              /* D_B of one layer, [n x d_out,B] */
  int orig_inputs;       /* ablation: X' = X_B (no recalibration) */
  char *log;
  size_t log_cap, log_off;
} fit_host;

static bico_status fit_layer(void *o, size_t l, size_t *d_out, size_t *d_in,
                             const float **w, size_t *ld_w, const float **b) {
  fit_host *h = o;
  *d_in = h->b->dims[l];
  *d_out = h->b->dims[l + 1];
  *w = h->b->w[l]; /* not updated yet: layers are fitted in forward order */
  *ld_w = *d_in;
  *b = h->b->b[l];
  return BICO_OK;
}

static bico_status fit_rows(void *o, size_t l, bico_fit *fit) {
  fit_host *h = o;
  const size_t n = h->cal->n, s = (size_t)h->src[l];
  const size_t doa = h->a->dims[s + 1], dob = h->b->dims[l + 1];
  const size_t din = h->b->dims[l];
  /* X': layer l's inputs on the target with layers < l updated */
  demo_mlp_forward(&h->cur, &h->wc, n, h->cal->x);
  /* D_B = (Y_{A_ft,s} - Y_{A,s}) R_out: what fine-tuning changed in the
   * source partner's output (A_ft on its own forward pass), carried into
   * B's output coordinates by BiCo's output map */
  const float *zf = h->wf->z[s], *za = h->wa->z[s], *r = h->rout[l];
  for (size_t i = 0; i < n; i++) {
    float *di = h->d + i * dob;
    for (size_t j = 0; j < dob; j++) di[j] = 0.f;
    for (size_t k = 0; k < doa; k++) {
      const float dk = zf[i * doa + k] - za[i * doa + k];
      if (dk == 0.f) continue;
      const float *rk = r + k * dob;
      for (size_t j = 0; j < dob; j++) di[j] += dk * rk[j];
    }
  }
  const float *xn = h->orig_inputs ? h->wb->a[l] : h->wc.a[l];
  return bico_fit_add(fit, n, xn, din, h->wb->a[l], din, h->d, dob);
}

static bico_status fit_update(void *o, size_t l, const float *dw, size_t ld,
                              const float *db, size_t rank) {
  fit_host *h = o;
  const size_t din = h->b->dims[l], dout = h->b->dims[l + 1];
  for (size_t i = 0; i < dout; i++) {
    for (size_t j = 0; j < din; j++) {
      h->upd->w[l][i * din + j] = dw[i * ld + j];
      h->cur.w[l][i * din + j] = h->b->w[l][i * din + j] + dw[i * ld + j];
    }
    h->upd->b[l][i] = db[i];
    h->cur.b[l][i] = h->b->b[l][i] + db[i];
  }
  if (h->log_off < h->log_cap)
    h->log_off += (size_t)snprintf(h->log + h->log_off,
                                   h->log_cap - h->log_off, " L%zu %zu/%zu", l,
                                   rank, din + 1);
  if (h->log_off >= h->log_cap) h->log_off = h->log_cap - 1;
  return BICO_OK;
}

/* The fit over every layer of b, with the output maps routs[l]. */
static int run_fit(bico_ctx *ctx, const demo_mlp *a, const demo_mlp *a_ft,
                   const demo_mlp *b, const demo_data *cal, const int *src,
                   const demo_work *wa, const demo_work *wb,
                   float *const *routs, double ridge, int orig_inputs,
                   demo_mlp *upd, demo_updates *out, size_t *off) {
  fit_host h;
  demo_work wf = {0};
  size_t dmax = 0;
  int ret = -1;
  memset(&h, 0, sizeof h);
  for (int l = 0; l < b->nl; l++)
    if (b->dims[l + 1] > dmax) dmax = b->dims[l + 1];
  h.a = a;
  h.b = b;
  h.upd = upd;
  h.cal = cal;
  h.src = src;
  h.wa = wa;
  h.wb = wb;
  h.wf = &wf;
  h.rout = routs;
  h.orig_inputs = orig_inputs;
  h.log = out->ranks + *off;
  h.log_cap = sizeof out->ranks - *off;
  if (demo_mlp_copy(&h.cur, b) != 0 || demo_work_alloc(&h.wc, b, cal->n) != 0 ||
      demo_work_alloc(&wf, a_ft, cal->n) != 0 ||
      (h.d = malloc(cal->n * dmax * sizeof *h.d)) == NULL)
    goto fail;
  demo_mlp_forward(a_ft, &wf, cal->n, cal->x);
  h.log_off = (size_t)snprintf(h.log, h.log_cap, "; fit ranks:");
  bico_fit_runner r;
  memset(&r, 0, sizeof r);
  r.size = sizeof r;
  r.opaque = &h;
  r.layers = (size_t)b->nl;
  r.layer = fit_layer;
  r.rows = fit_rows;
  r.update = fit_update;
  r.want_rank = 1; /* the log shows each layer's rank */
  CK(bico_fit_run(ctx, &r, ridge));
  *off += h.log_off;
  ret = 0;
fail:
  free(h.d);
  demo_work_free(&wf);
  demo_work_free(&h.wc);
  demo_mlp_free(&h.cur);
  return ret;
}

/* The calibration pass of one pretrained model: input activations and
 * output gradients of every layer for the calibration rows, in order. */
static int calib_pass(const demo_mlp *m, const demo_data *cal, demo_work *w) {
  if (demo_work_alloc(w, m, cal->n) != 0) return -1;
  demo_mlp_forward(m, w, cal->n, cal->x);
  demo_mlp_backward(m, w, cal->n, cal->y);
  return 0;
}

int demo_transfer(const demo_mlp *a, const demo_mlp *a_ft, const demo_mlp *b,
                  const demo_data *cal, int null_mode, int bico_only,
                  double fit_ridge, int fit_orig_inputs, demo_updates *out) {
  memset(out, 0, sizeof *out);
  bico_ctx *ctx = NULL;
  bico_procrustes *pr = NULL;
  bico_xcov *xin = NULL, *xout = NULL;
  demo_work wa = {0}, wb = {0};
  demo_mlp tau = {0};
  float *rin = NULL, *rout = NULL;
  float *routs[DEMO_MAXL] = {0}; /* kept for the fit */
  int src[DEMO_MAXL];
  int ret = -1;
  size_t off = 0;

  if (bico_ctx_create(&ctx) != BICO_OK) return -1;
  if (pair_layers(ctx, a, b, src) != 0) goto fail;
  if (demo_mlp_copy(&tau, a_ft) != 0) goto fail;
  demo_mlp_axpy(&tau, &tau, -1.f, a, NULL); /* tau = A_ft - A */
  for (int k = 0; k < DEMO_NMETHODS; k++) /* distill: trained (distill.c) */
    if (k != DEMO_M_DISTILL && k != DEMO_M_FT &&
        demo_mlp_alloc(&out->upd[k], b->nl, b->dims) != 0)
      goto fail;
  int same = demo_mlp_same_shape(a, b);
  out->valid[DEMO_M_ZERO] = 1; /* the zero update */

  for (int l = 0; l < b->nl && !bico_only; l++) {
    int s = src[l];
    size_t sw[2] = {a->dims[s + 1], a->dims[s]}, sb[1] = {a->dims[s + 1]};
    size_t tw[2] = {b->dims[l + 1], b->dims[l]}, tb[1] = {b->dims[l + 1]};
    if (same) {
      CK(bico_baseline_naive(ctx, 2, sw, 2, tw, 1.f, tau.w[s], 0.f,
                             out->upd[DEMO_M_NAIVE].w[l]));
      CK(bico_baseline_naive(ctx, 1, sb, 1, tb, 1.f, tau.b[s], 0.f,
                             out->upd[DEMO_M_NAIVE].b[l]));
    }
    CK(bico_baseline_pad(ctx, 2, sw, 2, tw, 1.f, tau.w[s], 0.f,
                         out->upd[DEMO_M_PAD].w[l]));
    CK(bico_baseline_pad(ctx, 1, sb, 1, tb, 1.f, tau.b[s], 0.f,
                         out->upd[DEMO_M_PAD].b[l]));
  }
  out->valid[DEMO_M_NAIVE] = same && !bico_only;
  out->valid[DEMO_M_PAD] = !bico_only;

  if (same && !bico_only) {
    double kept = 0;
    if (gradfix(ctx, b, &tau, cal, &out->upd[DEMO_M_GRADFIX], &kept) != 0)
      goto fail;
    out->valid[DEMO_M_GRADFIX] = 1;
    off += (size_t)snprintf(out->ranks + off, sizeof out->ranks - off,
                            "gradfix keeps %.1f%%; ", 100.0 * kept);
  }

  /* BiCo: statistics on the pretrained models, one map per side per layer */
  if (calib_pass(a, cal, &wa) != 0 || calib_pass(b, cal, &wb) != 0) goto fail;
  CK(bico_procrustes_create(ctx, &pr));
  CK(bico_procrustes_set_param(pr, BICO_PROC_NULL, null_mode));
  off += (size_t)snprintf(out->ranks + off, sizeof out->ranks - off,
                          "map ranks (in/out):");
  for (int l = 0; l < b->nl; l++) {
    int s = src[l];
    size_t dia = a->dims[s], doa = a->dims[s + 1];
    size_t dib = b->dims[l], dob = b->dims[l + 1];
    size_t rk_in = 0, rk_out = 0;
    rin = malloc(dia * dib * sizeof *rin);
    rout = malloc(doa * dob * sizeof *rout);
    if (rin == NULL || rout == NULL) goto fail;
    CK(bico_xcov_create(ctx, dia, dib, 0, &xin));
    CK(bico_xcov_add(xin, cal->n, wa.a[s], dia, wb.a[l], dib));
    CK(bico_procrustes_solve(pr, xin, rin, dib, &rk_in));
    CK(bico_xcov_create(ctx, doa, dob, 0, &xout));
    CK(bico_xcov_add(xout, cal->n, wa.dz[s], doa, wb.dz[l], dob));
    CK(bico_procrustes_solve(pr, xout, rout, dob, &rk_out));
    off += (size_t)snprintf(out->ranks + off, sizeof out->ranks - off,
                            " L%d<-L%d %zu/%zu %zu/%zu", l, s, rk_in,
                            dia < dib ? dia : dib, rk_out,
                            doa < dob ? doa : dob);
    if (off >= sizeof out->ranks) off = sizeof out->ranks - 1;

    /* tau_B = R_out^T tau R_in; the bias lives in the output space */
    demo_mlp *u = &out->upd[DEMO_M_BICO];
    CK(bico_transport_weight(ctx, doa, dia, dob, dib, 1.f, tau.w[s], dia,
                             rout, dob, rin, dib, 0.f, u->w[l], dib));
    CK(bico_transport_vector(ctx, doa, dob, 1.f, tau.b[s], rout, dob, 0.f,
                             u->b[l]));
    /* ablations: the other side's map is the (rectangular) identity */
    u = &out->upd[DEMO_M_BICO_IN];
    CK(bico_transport_weight(ctx, doa, dia, dob, dib, 1.f, tau.w[s], dia, NULL,
                             dob, rin, dib, 0.f, u->w[l], dib));
    CK(bico_transport_vector(ctx, doa, dob, 1.f, tau.b[s], NULL, dob, 0.f,
                             u->b[l]));
    u = &out->upd[DEMO_M_BICO_OUT];
    CK(bico_transport_weight(ctx, doa, dia, dob, dib, 1.f, tau.w[s], dia,
                             rout, dob, NULL, dib, 0.f, u->w[l], dib));
    CK(bico_transport_vector(ctx, doa, dob, 1.f, tau.b[s], rout, dob, 0.f,
                             u->b[l]));
    bico_xcov_free(xin);
    bico_xcov_free(xout);
    xin = xout = NULL;
    free(rin);
    routs[l] = rout;
    rin = rout = NULL;
  }
  out->valid[DEMO_M_BICO] = out->valid[DEMO_M_BICO_IN] =
      out->valid[DEMO_M_BICO_OUT] = 1;

  if (!bico_only) {
    if (run_fit(ctx, a, a_ft, b, cal, src, &wa, &wb, routs, fit_ridge,
                fit_orig_inputs, &out->upd[DEMO_M_FIT], out, &off) != 0)
      goto fail;
    out->valid[DEMO_M_FIT] = 1;
  }
  ret = 0;
fail:
  for (int l = 0; l < DEMO_MAXL; l++) free(routs[l]);
  free(rin);
  free(rout);
  bico_xcov_free(xin);
  bico_xcov_free(xout);
  bico_procrustes_free(pr);
  demo_work_free(&wa);
  demo_work_free(&wb);
  demo_mlp_free(&tau);
  bico_ctx_free(ctx);
  if (ret != 0) demo_updates_free(out);
  return ret;
}
