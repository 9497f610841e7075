/* The bico commands own their process, so they choose BLIS's kernels
 * before BLIS starts: BLIS 0.9 detects 'haswell' (AVX2) on AVX-512 Xeons
 * and 'generic' (plain C) on CPUs it does not know (AMD family 26), 1.4-4x
 * slower than the kernels the CPU can run (docs/performance.md).  BLIS
 * reads BLIS_ARCH_TYPE once, when it initialises, so the command sets it
 * and executes itself again; a user's own BLIS_ARCH_TYPE always wins, and
 * BICO_BLIS_ARCH=auto keeps BLIS's choice. */
#include <blis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

#define CHOSEN_ENV "BICO_BLIS_ARCH_CHOSEN"

static int best_arch(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return BLIS_ARCH_SKX;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return BLIS_ARCH_HASWELL;
  return -1;
}

void cli_blis_arch(char **argv, int verbose) {
  const char *user = getenv("BLIS_ARCH_TYPE");
  const char *chosen = getenv(CHOSEN_ENV);
  if (user != NULL) {
    if (verbose)
      fprintf(stderr, "bico: BLIS kernels: BLIS_ARCH_TYPE=%s (%s)\n", user,
              chosen ? chosen : "set by the user");
    return;
  }
  const char *mode = getenv("BICO_BLIS_ARCH");
  int best = best_arch();
  int detected = (int)bli_arch_query_id();
  int upgrade = best >= 0 && best != detected &&
                (detected == BLIS_ARCH_GENERIC ||
                 (detected == BLIS_ARCH_HASWELL && best == BLIS_ARCH_SKX));
  if ((mode != NULL && strcmp(mode, "auto") == 0) || !upgrade) {
    if (verbose)
      fprintf(stderr, "bico: BLIS kernels: '%s' (detected by BLIS)\n",
              bli_arch_string((arch_t)detected));
    return;
  }
  char id[16], why[160];
  snprintf(id, sizeof id, "%d", best);
  snprintf(why, sizeof why,
           "chosen by bico: BLIS detected '%s' on a CPU that runs '%s'; "
           "BICO_BLIS_ARCH=auto keeps BLIS's choice",
           bli_arch_string((arch_t)detected), bli_arch_string((arch_t)best));
  if (setenv("BLIS_ARCH_TYPE", id, 1) != 0 || setenv(CHOSEN_ENV, why, 1) != 0)
    return;
  execv("/proc/self/exe", argv);
  /* No re-execution (no /proc): BLIS keeps its own choice. */
  unsetenv("BLIS_ARCH_TYPE");
  unsetenv(CHOSEN_ENV);
  if (verbose)
    fprintf(stderr, "bico: BLIS kernels: '%s' (could not restart with '%s')\n",
            bli_arch_string((arch_t)detected), bli_arch_string((arch_t)best));
}
