/* docs/api.md's rule for arrays of pointers, checked by the compiler:
 * what a C program naturally holds passes without a cast -- handles made
 * by bico_X_create (bico_xcov *xc[3]) and buffers it filled (float *r[3])
 * go in as T *const *; paths are const char *const *, which a table of
 * string literals (const char *files[]) converts to, and argv (char **)
 * with the one cast that only adds const.  Compiled by make header-check
 * as C99 and C++11 (-pedantic -Werror) and with the compiler's default
 * dialect and flags plus -Werror (GCC 14 makes incompatible pointer types
 * an error by default; GCC 12 warns). */
#include <bico/bico.h>

int bico_pointer_arrays_check(int argc, char **argv);
int bico_pointer_arrays_check(int argc, char **argv) {
  bico_ctx *ctx = 0;
  bico_transfer *t = 0;
  bico_xcov *xc[3] = {0, 0, 0};
  float r0[4] = {1, 0, 0, 1}, r1[4] = {1, 0, 0, 1}, tau[8] = {0}, out[8];
  float *routs[2] = {r0, r1};
  float *taus[2] = {tau, tau};
  double w[2] = {1, 1};
  const char *files[2] = {"a.safetensors", "b.safetensors"};
  int st = 0;
  st |= bico_transfer_set_xcov(t, "m", BICO_SIDE_OUT, xc, 3);
  st |= bico_transport_weight_split(ctx, 2, 4, 2, 4, 2, 1.0f, tau, 2, routs,
                                    2, 0, 0, 0.0f, out, 2);
  st |= bico_merge_tensor(ctx, BICO_MERGE_LINEAR, 2, 8, taus, w, 0, 0, out);
  st |= bico_stats_merge(ctx, files, 2, "out.safetensors");
  if (argc > 2)
    st |= bico_stats_merge(ctx, (const char *const *)(argv + 1),
                           (size_t)(argc - 2), argv[argc - 1]);
  return st;
}
