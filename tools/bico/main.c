/* bico: carry fine-tuning between checkpoints.  The command is a thin
 * front end: every decision is the library's (bico_transfer, bico_model,
 * bico_stats_*). */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "bico_help.h"
#include "cli.h"

/* Generated from docs/bico.1.md (scripts/gen-help.py). */
static const char USAGE[] = BICO_HELP_MAIN;

int cli_error(const char *cmd, int code, const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "bico%s%s: ", cmd ? " " : "", cmd ? cmd : "");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  if (code == CLI_USAGE)
    fprintf(stderr, "run 'bico %s --help' for the options\n", cmd ? cmd : "");
  return code;
}

int cli_opt(int argc, char **argv, int *i, const char *name,
            const char **value) {
  const char *a = argv[*i];
  size_t n = strlen(name);
  if (strncmp(a, name, n) != 0) return 0;
  if (a[n] == '=') {
    *value = a + n + 1;
    return 1;
  }
  if (a[n] != '\0') return 0;
  if (*i + 1 >= argc) return -1;
  *value = argv[++*i];
  return 1;
}

int cli_double(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || *end != '\0' || errno == ERANGE) return -1;
  *out = v;
  return 0;
}

int cli_alpha(const char *s, double *out) {
  double v;
  if (cli_double(s, &v) || !(v > 0) || v > FLT_MAX) return -1;
  *out = v;
  return 0;
}

int cli_size(const char *s, size_t *out) {
  char *end;
  errno = 0;
  if (s[0] == '-' || s[0] == '\0') return -1;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end != '\0' || errno == ERANGE || v == 0) return -1;
  *out = (size_t)v;
  return 0;
}

/* Hugging Face's size grammar (max_shard_size): an integer of bytes, or an
 * integer with KB, MB, GB (powers of 1000) or KiB, MiB, GiB (powers of
 * 1024), any case, except that a lowercase final "b" after K/M/G means
 * bits ("5Gb" is 5e9 / 8 bytes), as there. */
int cli_shard_size(const char *s, double *out) {
  static const struct {
    const char *unit;
    double mul;
  } U[] = {{"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0},
           {"kb", 1e3},     {"mb", 1e6},         {"gb", 1e9}};
  size_t n = strlen(s), digits = 0;
  while (digits < n && s[digits] >= '0' && s[digits] <= '9') digits++;
  if (digits == 0 || digits > 15) return -1;
  double v = (double)strtoull(s, NULL, 10), mul = 1;
  const char *u = s + digits;
  if (*u != '\0') {
    size_t k, ul = strlen(u);
    for (k = 0; k < sizeof U / sizeof *U; k++)
      if (ul == strlen(U[k].unit) && strncasecmp(u, U[k].unit, ul) == 0) break;
    if (k == sizeof U / sizeof *U) return -1;
    mul = U[k].mul;
    if (ul == 2 && u[1] == 'b') mul /= 8; /* bits */
  }
  v = floor(v * mul);
  if (!(v > 0) || v > 9007199254740992.0) return -1;
  *out = v;
  return 0;
}

int cli_lib_error(const char *cmd, bico_ctx *ctx, bico_status st) {
  const char *detail = ctx ? bico_ctx_errmsg(ctx) : "";
  /* "bico transfer: transfer_run: ..." says the command twice, once by a
   * library function's name: the command's name is enough */
  static const char *const RUNS[] = {"transfer_run: ", "merge_run: "};
  for (size_t k = 0; k < sizeof RUNS / sizeof *RUNS; k++)
    if (strncmp(detail, RUNS[k], strlen(RUNS[k])) == 0 &&
        detail[strlen(RUNS[k])] != '\0')
      detail += strlen(RUNS[k]);
  return cli_error(cmd, CLI_FAIL, "%s", detail[0] ? detail : bico_strerror(st));
}

int bico_cli_main(int argc, char **argv) {
  /* A file-size limit (ulimit -f) then makes a write fail with EFBIG,
   * reported as an error, instead of killing the process mid-write. */
  signal(SIGXFSZ, SIG_IGN);
  /* --verbose anywhere: say which BLIS kernels run (and why). */
  int verbose = 0;
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--verbose") == 0) verbose = 1;
  cli_blis_arch(argv, verbose);
  if (verbose) {
    int k = 1;
    for (int i = 1; i < argc; i++)
      if (strcmp(argv[i], "--verbose") != 0) argv[k++] = argv[i];
    argv[k] = NULL;
    argc = k;
  }
  if (argc < 2) {
    fputs(USAGE, stderr);
    return CLI_USAGE;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 ||
      strcmp(cmd, "help") == 0) {
    fputs(USAGE, stdout);
    return 0;
  }
  if (strcmp(cmd, "--version") == 0) {
    printf("bico %s\n", bico_version_string());
    return 0;
  }
  if (strcmp(cmd, "transfer") == 0 || strcmp(cmd, "merge") == 0) {
    int sub_argc = argc - 1;
    char **sub_argv = argv + 1;
    int r = cli_config_expand(cmd, &sub_argc, &sub_argv);
    if (r != 0) return r;
    return strcmp(cmd, "merge") == 0 ? cmd_merge(sub_argc, sub_argv)
                                     : cmd_transfer(sub_argc, sub_argv);
  }
  if (strcmp(cmd, "stats") == 0) return cmd_stats(argc - 1, argv + 1);
  if (strcmp(cmd, "inspect") == 0) return cmd_inspect(argc - 1, argv + 1);
  fprintf(stderr, "bico: unknown command '%s'\n\n", cmd);
  fputs(USAGE, stderr);
  return CLI_USAGE;
}
