/* bico-mpi: the bico command under MPI (shared helpers).  The library is
 * MPI-free; this front end divides the work among the ranks of
 * MPI_COMM_WORLD and lets rank 0 write every file. */
#ifndef BICO_MPICLI_H
#define BICO_MPICLI_H

#include <stddef.h>
#include <mpi.h>

#include "bico/bico.h"

/* The serial command (tools/bico), reused as it is. */
#include "cli.h"

/* The transfer divided among ranks (cli_transfer_runner). */
int mpi_transfer_run(bico_transfer *t, bico_ctx *ctx, int quiet);

int mpi_cmd_stats(int argc, char **argv);

/* Message tags between ranks. */
enum { TAG_HEAD = 1, TAG_BODY = 2, TAG_DONE = 3, TAG_ERROR = 4, TAG_MSG = 5 };

/* Elements per MPI message: at most INT_MAX, 2^24 by default; the
 * environment variable BICO_MPI_CHUNK overrides it (tests force tiny
 * chunks so that the splitting is exercised). */
size_t mpi_chunk_elems(void);

/* Sends / receives / reduces long arrays in pieces of mpi_chunk_elems(). */
int mpi_send_long(const void *buf, size_t count, MPI_Datatype type,
                  size_t elem_size, int dest, int tag);
int mpi_recv_long(void *buf, size_t count, MPI_Datatype type,
                  size_t elem_size, int src, int tag);
/* Sums `count` doubles of every rank into root's buf (in place there). */
int mpi_reduce_sum_long(double *buf, size_t count, int root, int rank);

/* All ranks: agrees on whether any rank failed (local_failed != 0).  When
 * one did, rank 0 gets the lowest failing rank's message into msg (cap
 * bytes), prefixed "rank R: "; returns 1 on every rank then, 0 otherwise. */
int mpi_any_failed(int local_failed, const char *local_msg, char *msg,
                   size_t cap);

/* Temporary files of rank 0's writers, removed by the termination-signal
 * handler (mpirun sends SIGTERM to the survivors when a rank dies).
 * mpi_tmp_before(path) notes the temporaries already next to path;
 * mpi_tmp_after(path) registers the one that appeared since. */
void mpi_tmp_before(const char *path);
void mpi_tmp_after(const char *path);
void mpi_tmp_add(const char *path);
void mpi_tmp_forget(void);
void mpi_install_handlers(void);
/* MPI errors: remove the temporaries, print the error, MPI_Abort. */
void mpi_install_error_handler(void);

/* Test hook: BICO_MPI_TEST_KILL=R:N makes rank R raise SIGKILL on itself
 * when it reaches its N-th unit of work (tensor or statistic), and
 * BICO_MPI_TEST_FAIL=R:N makes it fail there with an error instead.
 * Returns 1 when the failure should be injected now. */
int mpi_test_hook(int rank, size_t unit);

/* One plan on every rank (collective; every rank calls them with the same
 * n).  mpi_same_args compares each rank's arguments (argv[1..]) with rank
 * 0's; mpi_same_files each path's fingerprint (size and sampled content of
 * a file, of each file of a folder: node-independent, no inode or mtime)
 * with rank 0's, naming the file by its role (what[i]).  Both return 1 on
 * every rank when a rank differs, rank 0 getting that rank's message in
 * msg (as mpi_any_failed), 0 otherwise. */
int mpi_same_args(int argc, char **argv, char *msg, size_t cap);
int mpi_same_files(const char *const *what, const char *const *paths,
                   size_t n, char *msg, size_t cap);

double mpi_now(void);

/* Ranks other than 0 silence stderr while the serial command parses its
 * options (a usage error is then printed once, by rank 0) and get it back
 * once the run is configured. */
void mpi_quiet_stderr(void);
void mpi_restore_stderr(void);

#endif
