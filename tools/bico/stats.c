/* bico stats: calibration files -> statistics file; merging. */
#include <stdio.h>
#include <string.h>

#include "bico_help.h"
#include "cli.h"

static const char *const CMD = "stats";

/* Generated from docs/bico.1.md (scripts/gen-help.py). */
static const char HELP[] = BICO_HELP_STATS;

int cmd_stats(int argc, char **argv) {
  const char *src = NULL, *tgt = NULL, *out = NULL, *blocks = NULL;
  int merge = 0;
  const char **inputs = (const char **)argv; /* reuses argv's storage */
  size_t ninputs = 0;
  cli_once_t seen = {{NULL}, {0}, 0};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v;
    int r, start = i;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(HELP, stdout);
      return 0;
    }
    if (strcmp(a, "--merge") == 0) {
      merge = 1;
      continue;
    }
#define VALUE(name, once, var)                                             \
  if ((r = cli_opt(argc, argv, &i, name, &v)) != 0) {                      \
    if (r < 0) return cli_error(CMD, CLI_USAGE, "option %s needs a value", \
                                name);                                     \
    if (cli_once(CMD, &seen, once, start)) return CLI_USAGE;               \
    var = v;                                                               \
    continue;                                                              \
  }
    VALUE("--source-calib", "--source-calib", src)
    VALUE("--target-calib", "--target-calib", tgt)
    VALUE("--output", "--output", out)
    VALUE("-o", "--output", out)
    VALUE("--blocks", "--blocks", blocks)
#undef VALUE
    if (a[0] == '-' && a[1] != '\0')
      return cli_error(CMD, CLI_USAGE, "unknown option %s", a);
    inputs[ninputs++] = a;
  }
  if (out == NULL) return cli_error(CMD, CLI_USAGE, "missing --output");
  if (merge) {
    if (src || tgt || blocks)
      return cli_error(CMD, CLI_USAGE,
                       "--merge takes statistics files, not calibration "
                       "options");
    if (ninputs == 0)
      return cli_error(CMD, CLI_USAGE, "--merge needs statistics files");
  } else {
    if (ninputs > 0)
      return cli_error(CMD, CLI_USAGE, "unexpected argument %s (use --merge "
                       "to merge statistics files)", inputs[0]);
    if (src == NULL || tgt == NULL)
      return cli_error(CMD, CLI_USAGE, "missing --%s-calib",
                       src == NULL ? "source" : "target");
  }
  bico_ctx *ctx;
  if (bico_ctx_create(&ctx) != BICO_OK)
    return cli_error(CMD, CLI_FAIL, "out of memory");
  cli_cleanup_add(out, 0);
  cli_cleanup_install();
  bico_status st = merge ? bico_stats_merge(ctx, inputs, ninputs, out)
                         : bico_stats_from_calib(ctx, src, tgt, blocks, out);
  int code = st == BICO_OK ? 0 : cli_lib_error(CMD, ctx, st);
  if (st == BICO_OK) fprintf(stderr, "bico stats: wrote %s\n", out);
  bico_ctx_free(ctx);
  return code;
}
