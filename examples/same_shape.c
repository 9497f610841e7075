/* For models of the same shape: sign votes and the GradFix mask
 * (bico_votes, bico_gradfix), and the two baselines every comparison
 * needs, naive addition and zero padding (bico_baseline).
 *
 * GradFix keeps the coordinates of the task vector tau whose sign agrees
 * with the target's own descent direction, estimated by a vote over
 * per-sample gradients: vote_i = sum_k sign(-g_k,i).  Planted here: the
 * target's gradients agree with tau on coordinates 0-3 (in 4 samples out
 * of 5) and disagree on 4-7, so the mask is 1 1 1 1 0 0 0 0.
 *
 * Every kernel computes out = alpha * update + beta * out, as BLAS does:
 * with beta = 1 and out holding the target's weights, the update lands on
 * them directly. */
#include <stdio.h>
#include <string.h>
#include <bico/bico.h>

enum { N = 8, SAMPLES = 5 };

static int fail(bico_ctx *ctx, const char *what) {
  fprintf(stderr, "%s: %s\n", what, bico_ctx_errmsg(ctx));
  return 1;
}

int main(void) {
  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK) return 1;
  const float tau[N] = {0.5f, -0.25f, 1.0f, -2.0f, 0.75f, -0.5f, 0.125f, -1.0f};
  float theta[N], out[N];
  for (int i = 0; i < N; i++) theta[i] = (float)i;

  /* One accumulator per target tensor; one gradient per sample. */
  bico_votes *v = NULL;
  if (bico_votes_create(ctx, N, 0, &v) != BICO_OK) return fail(ctx, "votes_create");
  for (int k = 0; k < SAMPLES; k++) {
    float g[N];
    for (int i = 0; i < N; i++) {
      int agree = (i < 4) == (k != 2); /* sample 2 is the odd one out */
      /* descent is -g: agreeing means g has the opposite sign of tau */
      g[i] = (agree ? -1.0f : 1.0f) * (tau[i] > 0 ? 1.0f : -1.0f) * (1 + k);
    }
    if (bico_votes_add_grad(v, g) != BICO_OK) return fail(ctx, "votes_add_grad");
  }
  uint8_t mask[N];
  size_t kept = 0;
  if (bico_gradfix_mask(v, BICO_GRADFIX_MAJORITY, tau, mask, &kept) != BICO_OK)
    return fail(ctx, "gradfix_mask");
  /* The masked update onto the target's weights: theta + alpha (m * tau). */
  memcpy(out, theta, sizeof out);
  if (bico_gradfix_apply(v, 0 /* the default mode */, 2.0f, tau, 1.0f, out, NULL) != BICO_OK)
    return fail(ctx, "gradfix_apply");
  int bad = kept != 4;
  printf("mask:");
  for (int i = 0; i < N; i++) {
    printf(" %d", mask[i]);
    bad |= mask[i] != (i < 4);
    bad |= out[i] != theta[i] + (i < 4 ? 2.0f * tau[i] : 0.0f);
  }
  printf("  (%zu kept)\n", kept);

  /* Naive addition: the update is tau itself; the shapes must be equal. */
  size_t s1[1] = {N}, s24[2] = {2, 4}, s35[2] = {3, 5};
  memcpy(out, theta, sizeof out);
  if (bico_baseline_naive(ctx, 1, s1, 1, s1, 1.0f, tau, 1.0f, out) != BICO_OK)
    return fail(ctx, "baseline_naive");
  for (int i = 0; i < N; i++) bad |= out[i] != theta[i] + tau[i];
  bico_status st = bico_baseline_naive(ctx, 2, s24, 2, s35, 1.0f, tau, 0.0f, out);
  printf("naive across shapes: %s (%s)\n", bico_status_name(st), bico_ctx_errmsg(ctx));
  bad |= st != BICO_E_SHAPE;

  /* Zero padding: tau [2, 4] into a [3, 5] target, new entries zero. */
  float padded[15];
  if (bico_baseline_pad(ctx, 2, s24, 2, s35, 1.0f, tau, 0.0f, padded) != BICO_OK)
    return fail(ctx, "baseline_pad");
  for (int r = 0; r < 3; r++)
    for (int c = 0; c < 5; c++)
      bad |= padded[r * 5 + c] != (r < 2 && c < 4 ? tau[r * 4 + c] : 0.0f);

  bico_votes_free(v);
  bico_ctx_free(ctx);
  printf("same_shape: %s\n", bad ? "WRONG" : "ok");
  return bad;
}
