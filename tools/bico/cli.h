/* The bico command: shared helpers of the subcommands. */
#ifndef BICO_CLI_H
#define BICO_CLI_H

#include <stddef.h>
#include <stdio.h>
#include "bico/bico.h"

/* Exit codes: 0 success, 1 failure, 2 usage error. */
#define CLI_FAIL 1
#define CLI_USAGE 2

int cmd_transfer(int argc, char **argv);
/* `bico bridge`: cmd_transfer's options without a fine-tune; --output is
 * the bridge file (bico_transfer_bridge). */
int cmd_bridge(int argc, char **argv);
/* The command's dispatcher (main in tools/bico/bico.c calls it; bico-mpi
 * reuses it for the commands it does not divide). */
int bico_cli_main(int argc, char **argv);
/* cmd_transfer runs the configured transfer with this when set (bico-mpi
 * divides it among ranks), else with bico_transfer_run; it returns the
 * exit code and prints its own messages. */
extern int (*cli_transfer_runner)(bico_transfer *t, bico_ctx *ctx, int quiet);
int cmd_stats(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_merge(int argc, char **argv); /* tools/bico/merge.c */
/* 1 when paths a and b name the same model by file identity, whatever the
 * spelling ("./m", "m/", links, hard links): the same file or folder, or a
 * folder and its model.safetensors or model.safetensors.index.json
 * (tools/bico/merge.c). */
int cli_same_model(const char *a, const char *b);

/* `bico transfer --lora`'s own flag (tools/bico/lora_opts.c): --output
 * with --lora needs --merge-into-base and the reverse; 0, else the usage
 * error's exit code.  Which files go together is bico_transfer_check's. */
int lora_cli_check(const char *cmd, const char *output, int merge_into_base);

/* Writes s to f with its control characters (C0, DEL, C1: terminal escape
 * sequences from names in files or arguments) as \xNN / \u00NN. */
void cli_put_escaped(FILE *f, const char *s);

/* Prints "bico <cmd>: <message>" to stderr (escaped: cli_put_escaped) and
 * returns code. */
int cli_error(const char *cmd, int code, const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Matches argv[*i] against a long option "--name" taking a value, given
 * either as "--name=value" or as the next argument.  Returns 1 and sets
 * *value when it matches, 0 when not, -1 when the value is missing. */
int cli_opt(int argc, char **argv, int *i, const char *name,
            const char **value);

/* Parses a finite double / a positive size; 0 on success. */
int cli_double(const char *s, double *out);
int cli_size(const char *s, size_t *out);
/* A size option's byte count (--max-shard-size, --solve-memory), the one
 * grammar of both commands and bico-mpi: a number with K, M, G, KiB, MiB,
 * GiB (powers of 1024) or KB, MB, GB (powers of 1000); 0 on success.  The
 * range is the library's (set_param): cli_bytes_option's usage error
 * names the option and the grammar, cli_param_refused (after set_param
 * refused the value) the option, the value and the library's reason. */
int cli_bytes(const char *s, double *out);
int cli_bytes_option(const char *cmd, const char *opt, const char *v,
                     double *out);
int cli_param_refused(const char *cmd, bico_ctx *ctx, const char *opt,
                      const char *v);
/* --wait SECONDS (v; NULL: not given) onto ctx's BICO_CTX_FOLDER_WAIT: how
 * long a run waits for another process writing its output folder before
 * it refuses (the library's range); 0, or the usage error's code. */
int cli_wait(const char *cmd, bico_ctx *ctx, const char *v);

/* Signals (tools/bico/cleanup.c): cli_cleanup_add registers the folder of
 * an output file (is_dir: the path is itself a folder, as an output
 * adapter); cli_cleanup_install makes SIGINT, SIGTERM and SIGHUP remove
 * this process's temporary files there before the process dies. */
void cli_cleanup_add(const char *path, int is_dir);
void cli_cleanup_install(void);
/* After a successful run: warns on stderr, naming each, about this
 * process's temporaries that could not be removed; returns their count. */
int cli_cleanup_warn_leftovers(const char *cmd);

/* Parses an --alpha value: a positive number that a float holds (the
 * library computes in float: 1e39 would be +Inf).  0 on success. */
int cli_alpha(const char *s, double *out);

/* Chooses BLIS's kernels for the process before BLIS starts (may execute
 * the program again with BLIS_ARCH_TYPE set); tools/bico/blisarch.c. */
void cli_blis_arch(char **argv, int verbose);
/* Replaces `--config F.yaml` in a subcommand's arguments (argv[0] the
 * subcommand) by the options the YAML file stands for; 0, or the exit code
 * of an error already printed.  tools/bico/config.c. */
int cli_config_expand(const char *cmd, int *argc, char ***argv);
/* Progress (tools/bico/progress.c): cli_progress_install gives t a
 * progress function that draws a bar redrawn in place when stderr is a
 * terminal, else a plain line at most every 5 seconds, each with elapsed
 * time and an estimate of what is left; cli_progress_finish ends a bar
 * left mid-line (after a failure).  cli_progress_text renders one line. */
bico_status cli_progress_install(bico_transfer *t, int lora); /* lora: a
                                  run of an adapter counts its modules */
bico_status cli_progress_install_merge(bico_merge *m); /* bico merge's */
void cli_progress_finish(void);
void cli_progress_clear(void); /* erases a drawn bar before other text */
void cli_progress_text(const bico_progress *p, int bar, const char *unit,
                       char *buf, size_t cap);

/* Where the expanded arguments came from (tools/bico/argsource.c, set by
 * config.c's expansion): the --config file, or NULL when none was given;
 * cli_from_config(i) is 1 when argument i (of the subcommand's expanded
 * argv) came from that file, the arguments [lo, hi). */
void cli_args_from_config(const char *file, int lo, int hi);
const char *cli_config_file(void);
int cli_from_config(int i);

/* The argument a subcommand's parser is reading (an index into its argv,
 * -1 when none): a usage error printed while it is set, for an argument
 * that came from --config, names the file (cli_error appends it). */
extern int cli_arg_at;

/* Single-valued options: the first use of each name is recorded; a second
 * use is a usage error naming the option and where both came from (the
 * command line, the --config file).  cli_once returns 0 or CLI_USAGE. */
typedef struct {
  const char *name[64];
  int at[64];
  size_t n;
} cli_once_t;
int cli_once(const char *cmd, cli_once_t *seen, const char *name, int at);

/* Reports a library failure: the status text and the context's detail,
 * without the library's API function names; cli_lib_error_files also
 * names the option (opts[k]) whose file (paths[k]) the message is about,
 * when the message names one of the paths and no option. */
int cli_lib_error(const char *cmd, bico_ctx *ctx, bico_status st);
/* A library message without the API function names it carries
 * ("transfer_run: "): what cli_lib_error prints. */
void cli_user_message(const char *in, char *out, size_t cap);
int cli_lib_error_files(const char *cmd, bico_ctx *ctx, bico_status st,
                        const char *const *opts, const char *const *paths,
                        size_t n);

#endif
