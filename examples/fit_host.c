/* A fit host: the program owns a two-layer network and runs its forward
 * passes itself; bico_fit_run asks it, layer by layer, for rows through
 * callbacks and hands each layer's update back before it asks for the next
 * layer's rows -- the shape of a model server that keeps its own forward
 * pass (docs/fit.md).
 *
 * Network: y = W1 relu(W0 x).  A fine-tuned copy has W0 + U0, W1 + U1.  For
 * layer l the host gives the layer's inputs with the earlier updates
 * applied (X'), its inputs in the original network (X_B) and the change the
 * fine-tune made to the layer's output (D); the fit solves
 *   min ||X' (W + dW)^T - (X_B W^T + D)||^2   (ridge 0)
 * so with enough rows it recovers the planted update: dW0 = U0, dW1 = U1. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <bico/bico.h>

enum { DX = 4, DH = 6, DY = 3, N = 64 };

typedef struct host {
  float w0[DH * DX], w1[DY * DH];      /* the weights the host serves */
  float w0_orig[DH * DX], w1_orig[DY * DH];
  float u0[DH * DX], u1[DY * DH];      /* the planted fine-tune */
  float x[N * DX];                     /* calibration inputs */
} host;

static float lcg(unsigned *s) {
  *s = *s * 1103515245u + 12345u;
  return (float)((*s >> 8) % 2001) / 1000.0f - 1.0f;
}

/* y[n, dout] = relu?(x[n, din] w^T) */
static void layer_fwd(const float *x, const float *w, int din, int dout,
                      int relu, float *y) {
  for (int r = 0; r < N; r++)
    for (int o = 0; o < dout; o++) {
      float s = 0;
      for (int i = 0; i < din; i++) s += x[r * din + i] * w[o * din + i];
      y[r * dout + o] = relu && s < 0 ? 0 : s;
    }
}

/* The layer's widths (its weight is [d_out, d_in]) and current weights. */
static bico_status on_layer(void *o, size_t l, size_t *d_out, size_t *d_in,
                            const float **w, size_t *ld_w, const float **b) {
  host *h = o;
  *d_out = l ? DY : DH;
  *d_in = *ld_w = l ? DH : DX;
  *w = l ? h->w1 : h->w0;
  *b = NULL; /* no bias in this network */
  return BICO_OK;
}

/* The rows of layer l, from the host's own forward passes. */
static bico_status on_rows(void *o, size_t l, bico_fit *fit) {
  host *h = o;
  float w0ft[DH * DX], w1ft[DY * DH], hb[N * DH], hft[N * DH], hnew[N * DH];
  float yb[N * DY], yft[N * DY], d[N * DH];
  for (int i = 0; i < DH * DX; i++) w0ft[i] = h->w0_orig[i] + h->u0[i];
  for (int i = 0; i < DY * DH; i++) w1ft[i] = h->w1_orig[i] + h->u1[i];
  if (l == 0) { /* inputs: x in both; D = x U0^T */
    layer_fwd(h->x, h->u0, DX, DH, 0, d);
    return bico_fit_add(fit, N, h->x, DX, h->x, DX, d, DH);
  }
  layer_fwd(h->x, h->w0, DX, DH, 1, hnew);      /* X': layer 0 updated */
  layer_fwd(h->x, h->w0_orig, DX, DH, 1, hb);   /* X_B: the original */
  layer_fwd(h->x, w0ft, DX, DH, 1, hft);        /* the fine-tune's */
  layer_fwd(hb, h->w1_orig, DH, DY, 0, yb);
  layer_fwd(hft, w1ft, DH, DY, 0, yft);
  for (int i = 0; i < N * DY; i++) d[i] = yft[i] - yb[i];
  /* in two batches, as a server streaming its data would */
  bico_status st = bico_fit_add(fit, N / 2, hnew, DH, hb, DH, d, DY);
  if (st == BICO_OK)
    st = bico_fit_add(fit, N / 2, hnew + N / 2 * DH, DH, hb + N / 2 * DH, DH,
                      d + N / 2 * DY, DY);
  return st;
}

/* The solved update: the host applies it before the next layer's rows. */
static bico_status on_update(void *o, size_t l, const float *dw, size_t ld_dw,
                             const float *db, size_t rank) {
  host *h = o;
  (void)db;
  (void)rank; /* BICO_FIT_NO_RANK: not asked for */
  size_t dout = l ? DY : DH, din = l ? DH : DX;
  float *w = l ? h->w1 : h->w0;
  for (size_t r = 0; r < dout; r++)
    for (size_t c = 0; c < din; c++) w[r * din + c] += dw[r * ld_dw + c];
  return BICO_OK;
}

int main(void) {
  static host h;
  unsigned s = 7;
  for (int i = 0; i < DH * DX; i++) h.w0[i] = lcg(&s), h.u0[i] = 0.1f * lcg(&s);
  for (int i = 0; i < DY * DH; i++) h.w1[i] = lcg(&s), h.u1[i] = 0.1f * lcg(&s);
  for (int i = 0; i < N * DX; i++) h.x[i] = lcg(&s) + (i % DX == 0 ? 1.0f : 0.0f);
  memcpy(h.w0_orig, h.w0, sizeof h.w0);
  memcpy(h.w1_orig, h.w1, sizeof h.w1);

  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK) return 1;
  bico_fit_runner r = {0}; /* C++: bico_fit_runner r{}; */
  r.size = sizeof r;       /* later versions append fields: say which we know */
  r.opaque = &h;
  r.layers = 2;
  r.layer = on_layer;
  r.rows = on_rows;
  r.update = on_update;
  bico_status st = bico_fit_run(ctx, &r, 0.0 /* ridge c: plain least squares */);
  if (st != BICO_OK) {
    fprintf(stderr, "fit_run: %s\n", bico_ctx_errmsg(ctx));
    return 1;
  }
  double err = 0;
  for (int i = 0; i < DH * DX; i++)
    err = fmax(err, fabs(h.w0[i] - (h.w0_orig[i] + h.u0[i])));
  for (int i = 0; i < DY * DH; i++)
    err = fmax(err, fabs(h.w1[i] - (h.w1_orig[i] + h.u1[i])));
  printf("2 layers fitted; largest distance to the planted weights %.2g\n", err);
  bico_ctx_free(ctx);
  printf("fit_host: %s\n", err < 1e-4 ? "ok" : "WRONG");
  return err < 1e-4 ? 0 : 1;
}
