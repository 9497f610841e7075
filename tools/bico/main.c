/* bico: carry fine-tuning between checkpoints.  The command is a thin
 * front end: every decision is the library's (bico_transfer, bico_model,
 * bico_stats_*). */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "bico_help.h"
#include "cli.h"

/* Generated from docs/bico.1.md (scripts/gen-help.py). */
static const char USAGE[] = BICO_HELP_MAIN;

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
  if (strcmp(cmd, "transfer") == 0 || strcmp(cmd, "merge") == 0 ||
      strcmp(cmd, "bridge") == 0) {
    int sub_argc = argc - 1;
    char **sub_argv = argv + 1;
    int r = cli_config_expand(cmd, &sub_argc, &sub_argv);
    if (r != 0) return r;
    return strcmp(cmd, "merge") == 0    ? cmd_merge(sub_argc, sub_argv)
           : strcmp(cmd, "bridge") == 0 ? cmd_bridge(sub_argc, sub_argv)
                                        : cmd_transfer(sub_argc, sub_argv);
  }
  if (strcmp(cmd, "stats") == 0) return cmd_stats(argc - 1, argv + 1);
  if (strcmp(cmd, "inspect") == 0) return cmd_inspect(argc - 1, argv + 1);
  fprintf(stderr, "bico: unknown command '%s'\n\n", cmd);
  fputs(USAGE, stderr);
  return CLI_USAGE;
}
