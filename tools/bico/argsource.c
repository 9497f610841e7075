/* Where a subcommand's expanded arguments came from: the --config file or
 * the command line.  config.c records it when it expands --config; cli.c's
 * messages read it (a usage error for an argument from the file names the
 * file).  Its own file so that each of the two depends on this one and
 * config.c on cli.c's parsing helpers, never cli.c back on config.c. */
#include <stddef.h>

#include "cli.h"

static const char *config_file;        /* NULL: no --config */
static int from_lo = -1, from_hi = -1; /* the file's arguments: [lo, hi) */

void cli_args_from_config(const char *file, int lo, int hi) {
  config_file = file;
  from_lo = lo;
  from_hi = hi;
}

const char *cli_config_file(void) { return config_file; }

int cli_from_config(int i) {
  return config_file != NULL && i >= from_lo && i < from_hi;
}
