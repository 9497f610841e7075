/* bico-mpi: `mpirun -np N bico-mpi stats|transfer ...` divides the work of
 * the bico command among N ranks; the other commands run on rank 0. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "mpicli.h"

int main(int argc, char **argv) {
  /* The same BLIS kernels as the serial command, chosen before BLIS (and
   * MPI) start: results then agree with `bico` to rounding. */
  cli_blis_arch(argv, 0);
  MPI_Init(&argc, &argv);
  mpi_install_error_handler();
  signal(SIGXFSZ, SIG_IGN);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int code, help = 0;
  for (int i = 1; i < argc; i++)
    help |= strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0;
  /* One plan on every rank: the same command line first (the input files
   * are compared once the command has named them). */
  char msg[1400];
  if (mpi_same_args(argc, argv, msg, sizeof msg)) {
    if (rank == 0)
      fprintf(stderr, "bico %s: %s\n", argc >= 2 ? argv[1] : "", msg);
    code = 1;
  } else if (help && argc >= 2 && strcmp(argv[1], "stats") == 0)
    code = rank == 0 ? mpi_cmd_stats(argc - 1, argv + 1) : 0;
  else if (help)
    code = rank == 0 ? bico_cli_main(argc, argv) : 0;
  else if (argc >= 2 && strcmp(argv[1], "stats") == 0)
    code = mpi_cmd_stats(argc - 1, argv + 1);
  else if (argc >= 2 && strcmp(argv[1], "transfer") == 0) {
    if (rank != 0) mpi_quiet_stderr();
    /* --config F.yaml as in the serial command; then the options it stood
     * for compared once more (the file may differ between nodes) */
    int sub_argc = argc - 1;
    char **sub_argv = argv + 1;
    int rc = cli_config_expand("transfer", &sub_argc, &sub_argv);
    if (mpi_any_failed(rc != 0, "its --config file could not be read",
                       msg, sizeof msg)) {
      if (rank == 0 && rc == 0) fprintf(stderr, "bico transfer: %s\n", msg);
      code = rc ? rc : 1;
    } else if (mpi_same_args(sub_argc, sub_argv, msg, sizeof msg)) {
      if (rank == 0) fprintf(stderr, "bico transfer: %s (after --config)\n",
                             msg);
      code = 1;
    } else {
      cli_transfer_runner = mpi_transfer_run;
      code = cmd_transfer(sub_argc, sub_argv);
    }
    mpi_restore_stderr();
  }
  else
    code = rank == 0 ? bico_cli_main(argc, argv) : 0;
  MPI_Finalize();
  return code;
}
