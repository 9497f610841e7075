/* Included (-include) before the serial command's sources when they are
 * compiled into bico-mpi: the transfer command's option parsing stays the
 * serial one (same options, same checks, same messages), while the calls
 * that configure and run the transfer go to the MPI driver (transfer.c
 * here), which records the configuration and forwards each call. */
#define main bico_serial_main
#define bico_transfer_create mpi_transfer_create
#define bico_transfer_set_file mpi_transfer_set_file
#define bico_transfer_set_string mpi_transfer_set_string
#define bico_transfer_add_tie mpi_transfer_add_tie
#define bico_transfer_set_log mpi_transfer_set_log
#define bico_transfer_run mpi_transfer_run
