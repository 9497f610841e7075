/* bico transfer: options -> bico_transfer -> run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bico_help.h"
#include "cli.h"

static const char *const CMD = "transfer";

/* Generated from docs/bico.1.md (scripts/gen-help.py). */
static const char HELP[] = BICO_HELP_TRANSFER;

static const struct {
  const char *opt;
  int file;
} FILES[] = {
    {"--source-base", BICO_FILE_SOURCE_BASE},
    {"--source-tuned", BICO_FILE_SOURCE_TUNED},
    {"--task-vector", BICO_FILE_TASK_VECTOR},
    {"--target-base", BICO_FILE_TARGET_BASE},
    {"--source-calib", BICO_FILE_SOURCE_CALIB},
    {"--target-calib", BICO_FILE_TARGET_CALIB},
    {"--stats", BICO_FILE_STATS},
    {"--target-votes", BICO_FILE_TARGET_VOTES},
    {"--output", BICO_FILE_OUTPUT},
    {"--delta-output", BICO_FILE_DELTA_OUTPUT},
    {"--report", BICO_FILE_REPORT},
    {"--lora", BICO_FILE_LORA},               /* LoRA: index 11 */
    {"--output-lora", BICO_FILE_LORA_OUTPUT}, /* LoRA: index 12 */
    {"--source-config", BICO_FILE_SOURCE_CONFIG},
    {"--target-config", BICO_FILE_TARGET_CONFIG},
};
#define NFILE_OPTS (sizeof FILES / sizeof FILES[0])

int (*cli_transfer_runner)(bico_transfer *t, bico_ctx *ctx, int quiet);

static void log_line(void *opaque, const char *line) {
  (void)opaque;
  cli_progress_clear();
  cli_put_escaped(stderr, line);
  fputc('\n', stderr);
}

/* Splits "A=B" at the last '=' into a (NUL-terminated copy) and b. */
static int split_eq(const char *s, char *a, size_t cap, const char **b) {
  const char *eq = strrchr(s, '=');
  if (eq == NULL || eq == s || eq[1] == '\0' || (size_t)(eq - s) >= cap)
    return -1;
  memcpy(a, s, (size_t)(eq - s));
  a[eq - s] = '\0';
  *b = eq + 1;
  return 0;
}

/* "123", "600M", "2G": bytes (K, M, G are powers of 1024). */
static int parse_bytes(const char *s, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || !(v >= 0) || v > 9e15) return -1;
  double unit = 1;
  if (*end == 'K' || *end == 'k') unit = 1024.0, end++;
  else if (*end == 'M' || *end == 'm') unit = 1024.0 * 1024, end++;
  else if (*end == 'G' || *end == 'g') unit = 1024.0 * 1024 * 1024, end++;
  if (*end != '\0' || v * unit > 9e15) return -1;
  *out = (double)(long long)(v * unit);
  return 0;
}

/* What the command line says, before any library call. */
typedef struct {
  const char *files[NFILE_OPTS];
  const char *method, *blocks, *norm_map, *null_mode, *proc_method;
  const char *rename; /* --source-rename OLD=NEW */
  double alpha, rank_tol, whiten, solve_memory;
  double max_shard; /* --max-shard-size, bytes (0: as the target) */
  int center, quiet, merge_into_base, allow_partial;
  size_t threads, workers;
  const char *splits[256], *ties[256];
  size_t nsplits, nties;
  /* Resolved by check_usage. */
  int m, bico, nm, nl, pm;
  size_t blas_threads;
  /* Decoder families (docs/llm.md). */
  const char *structure, *rope;
  size_t heads, kv_heads, head_dim;
  int structure_v, rope_v; /* resolved by check_usage */
} transfer_opts;

/* Not an exit code: parsing went through and the command goes on. */
#define GO_ON (-1)

static int parse_loop(int argc, char **argv, transfer_opts *o,
                      cli_once_t *seen);

/* Reads argv into o; GO_ON, or the exit code (--help, usage errors).  A
 * single-valued option given twice (on the command line, or both there
 * and in --config) is a usage error; --split and --tie repeat. */
static int parse_args(int argc, char **argv, transfer_opts *o) {
  memset(o, 0, sizeof *o);
  o->alpha = 1.0;
  o->rank_tol = -1;
  o->threads = 1;
  cli_once_t seen = {{NULL}, {0}, 0};
  int rc = parse_loop(argc, argv, o, &seen);
  cli_arg_at = -1;
  return rc;
}

static int parse_loop(int argc, char **argv, transfer_opts *o,
                      cli_once_t *seen) {
  for (int i = 1; i < argc; i++) {
    const char *v = NULL;
    const char *a = argv[i];
    int r = 0, start = i;
    cli_arg_at = i;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(HELP, stdout);
      return 0;
    }
    if (strcmp(a, "--center") == 0) {
      o->center = 1;
      continue;
    }
    if (strcmp(a, "--allow-partial") == 0) {
      o->allow_partial = 1;
      continue;
    }
    if (strcmp(a, "--merge-into-base") == 0) {
      o->merge_into_base = 1;
      continue;
    }
    if (strcmp(a, "--quiet") == 0 || strcmp(a, "-q") == 0) {
      o->quiet = 1;
      continue;
    }
    size_t f;
    for (f = 0; f < NFILE_OPTS; f++)
      if ((r = cli_opt(argc, argv, &i, FILES[f].opt, &v)) != 0) break;
    if (f == NFILE_OPTS && (r = cli_opt(argc, argv, &i, "-o", &v)) != 0)
      f = 8; /* --output */
    if (r < 0) return cli_error(CMD, CLI_USAGE, "option %s needs a value", a);
    if (r > 0) {
      if (cli_once(CMD, seen, FILES[f].opt, start)) return CLI_USAGE;
      if (v[0] == '\0')
        return cli_error(CMD, CLI_USAGE, "option %s has an empty path",
                         FILES[f].opt);
      o->files[f] = v;
      continue;
    }
#define REPEATED(name, var)                                                \
  if ((r = cli_opt(argc, argv, &i, name, &v)) != 0) {                      \
    if (r < 0) return cli_error(CMD, CLI_USAGE, "option %s needs a value", \
                                name);                                     \
    var;                                                                   \
    continue;                                                              \
  }
#define VALUE(name, var)                                                   \
  REPEATED(name, if (cli_once(CMD, seen, name, start)) return CLI_USAGE; var)
    VALUE("--method", o->method = v)
    VALUE("--blocks", o->blocks = v)
    VALUE("--source-rename",
          if (strchr(v, '=') == NULL || strcmp(v, "=") == 0) return cli_error(
              CMD, CLI_USAGE,
              "--source-rename %s: expected OLD=NEW (a name prefix of the "
              "source and what replaces it, e.g. module.= or bert.=roberta.)",
              v);
          o->rename = v)
    VALUE("--max-shard-size",
          if (cli_shard_size(v, &o->max_shard)) return cli_error(
              CMD, CLI_USAGE,
              "--max-shard-size %s: expected bytes, or a whole number with "
              "KB, MB, GB (powers of 1000) or KiB, MiB, GiB", v))
    VALUE("--norm-map", o->norm_map = v)
    VALUE("--null", o->null_mode = v)
    VALUE("--alpha", if (cli_alpha(v, &o->alpha)) return cli_error(
                         CMD, CLI_USAGE,
                         "--alpha %s: expected a positive number of at most "
                         "3.4e38 (float range)", v))
    VALUE("--rank-tol",
          if (cli_double(v, &o->rank_tol) || o->rank_tol < 0 ||
              o->rank_tol >= 1)
              return cli_error(CMD, CLI_USAGE,
                               "--rank-tol %s: expected a number in [0, 1)", v))
    VALUE("--whiten",
          if (cli_double(v, &o->whiten) || o->whiten < 0 || o->whiten > 0.5)
              return cli_error(CMD, CLI_USAGE,
                               "--whiten %s: expected a number in [0, 0.5]", v))
    VALUE("--threads",
          if (cli_size(v, &o->threads) || o->threads > 1024) return cli_error(
              CMD, CLI_USAGE, "--threads %s: expected an integer in 1..1024",
              v))
    VALUE("--workers",
          if (cli_size(v, &o->workers) || o->workers > 1024) return cli_error(
              CMD, CLI_USAGE, "--workers %s: expected an integer in 1..1024",
              v))
    VALUE("--proc-method", o->proc_method = v)
    VALUE("--solve-memory",
          if (parse_bytes(v, &o->solve_memory)) return cli_error(
              CMD, CLI_USAGE,
              "--solve-memory %s: expected bytes, optionally with K, M or G "
              "(powers of 1024)",
              v))
    VALUE("--structure", o->structure = v)
    VALUE("--rope", o->rope = v)
#define COUNT_OPT(name, var)                                               \
  VALUE(name, if (cli_size(v, &var) || var == 0 || var > 1048576)          \
                  return cli_error(CMD, CLI_USAGE,                         \
                                   "%s %s: expected a positive integer",   \
                                   name, v))
    COUNT_OPT("--heads", o->heads)
    COUNT_OPT("--kv-heads", o->kv_heads)
    COUNT_OPT("--head-dim", o->head_dim)
#undef COUNT_OPT
    REPEATED("--split", if (o->nsplits == 256) return cli_error(
                         CMD, CLI_USAGE, "too many --split options");
          o->splits[o->nsplits++] = v)
    REPEATED("--tie", if (o->nties == 256) return cli_error(
                       CMD, CLI_USAGE, "too many --tie options");
          o->ties[o->nties++] = v)
#undef VALUE
#undef REPEATED
    if (a[0] == '-')
      return cli_error(CMD, CLI_USAGE, "unknown option %s", a);
    return cli_error(CMD, CLI_USAGE, "unexpected argument %s", a);
  }
  return GO_ON;
}

/* Which files go together: GO_ON or a usage error (2). */
static int check_files(const transfer_opts *o) {
  const char *const *files = o->files;
  if (files[0] == NULL) return cli_error(CMD, CLI_USAGE, "missing --source-base");
  if (files[3] == NULL) return cli_error(CMD, CLI_USAGE, "missing --target-base");
  if (files[11] != NULL) {
    /* LoRA: lora_cli_check (tools/bico/lora_opts.c) owns these rules. */
    int rc = lora_cli_check(CMD, files[1], files[2], files[8], files[9],
                            files[12], o->merge_into_base);
    if (rc) return rc;
  } else {
    if (files[12] != NULL || o->merge_into_base)
      return cli_error(CMD, CLI_USAGE, "%s needs --lora",
                       files[12] != NULL ? "--output-lora" : "--merge-into-base");
    if (files[8] == NULL) return cli_error(CMD, CLI_USAGE, "missing --output");
    if ((files[1] == NULL) == (files[2] == NULL))
      return cli_error(CMD, CLI_USAGE,
                       "give one of --source-tuned and --task-vector");
  }
  int calib = files[4] != NULL || files[5] != NULL;
  if (o->bico) {
    if (calib && (files[4] == NULL || files[5] == NULL))
      return cli_error(CMD, CLI_USAGE, "missing --%s-calib (source and target "
                       "calibration files go together)",
                       files[4] == NULL ? "source" : "target");
    if (calib && files[6] != NULL)
      return cli_error(CMD, CLI_USAGE,
                       "give calibration files or --stats, not both");
    if (!calib && files[6] == NULL)
      return cli_error(CMD, CLI_USAGE,
                       "method %s needs --source-calib and --target-calib, or "
                       "--stats",
                       o->method);
    if (files[6] != NULL && (o->center || o->whiten > 0))
      return cli_error(CMD, CLI_USAGE,
                       "--center and --whiten need calibration files, not "
                       "--stats");
  }
  if (o->m == BICO_METHOD_GRADFIX && files[7] == NULL)
    return cli_error(CMD, CLI_USAGE, "method gradfix needs --target-votes");
  if (o->m != BICO_METHOD_GRADFIX && files[7] != NULL)
    return cli_error(CMD, CLI_USAGE,
                     "--target-votes is read by method gradfix only; method "
                     "%s would ignore it", o->method);
  return GO_ON;
}

/* Usage checks: what is missing or contradictory is a usage error (2).
 * Resolves names to enum values and the thread split. */
static int check_usage(transfer_opts *o) {
  if (o->method == NULL)
    return cli_error(CMD, CLI_USAGE, "missing --method");
  o->m = 0;
  if (bico_method_from_name(o->method, &o->m) != BICO_OK)
    return cli_error(CMD, CLI_USAGE,
                     "unknown method '%s' (bico, bico-in, bico-out, gradfix, "
                     "naive or pad)",
                     o->method);
  o->bico = o->m <= BICO_METHOD_BICO_OUT;
  int rc = check_files(o);
  if (rc != GO_ON) return rc;
  o->nm = -1, o->nl = -1;
  if (o->norm_map != NULL) {
    if (bico_norm_map_from_name(o->norm_map, &o->nm) != BICO_OK)
      return cli_error(CMD, CLI_USAGE, "--norm-map %s: expected act or grad",
                          o->norm_map);
  }
  if (o->null_mode != NULL) {
    if (bico_procrustes_null_from_name(o->null_mode, &o->nl) != BICO_OK)
      return cli_error(CMD, CLI_USAGE, "--null %s: expected keep or drop",
                          o->null_mode);
  }

  o->pm = BICO_PROC_EIG;
  if (o->proc_method) {
    if (bico_procrustes_method_from_name(o->proc_method, &o->pm) != BICO_OK)
      return cli_error(CMD, CLI_USAGE,
                          "--proc-method %s: expected eig, svd or polar",
                          o->proc_method);
  }
  o->structure_v = BICO_STRUCTURE_FREE;
  o->rope_v = 0; /* from config.json */
  if (o->structure != NULL &&
      bico_structure_from_name(o->structure, &o->structure_v) != BICO_OK)
    return cli_error(CMD, CLI_USAGE, "--structure %s: expected heads or free",
                     o->structure);
  if (o->rope != NULL && bico_rope_from_name(o->rope, &o->rope_v) != BICO_OK)
    return cli_error(CMD, CLI_USAGE,
                     "--rope %s: expected half, interleaved or none", o->rope);
  return GO_ON;
}

/* Only the BiCo methods solve maps in a pool of workers; the others, and
 * an adapter's run (the LoRA branch solves each module's maps in the
 * calling thread), keep N BLIS threads. */
static void split_threads(transfer_opts *o) {
  if (o->workers == 0)
    o->workers = o->bico && o->files[BICO_FILE_LORA - 1] == NULL ? o->threads : 1;
  o->blas_threads = o->threads;
  if (o->workers > 1) {
    /* N threads in all: each solver (and the writing thread) runs BLIS with
     * its share, and so do the BLAS calls inside LAPACK, which follow
     * BLIS's process-wide count, read when BLIS first starts. */
    o->blas_threads = o->threads / o->workers ? o->threads / o->workers : 1;
    char share[32];
    snprintf(share, sizeof share, "%zu", o->blas_threads);
    setenv("BLIS_NUM_THREADS", share, 1);
  }
}

/* Files and scalar parameters onto the handle. */
static bico_status set_options(bico_transfer *t, const transfer_opts *o) {
  bico_status st = BICO_OK;
  for (size_t f = 0; f < NFILE_OPTS && st == BICO_OK; f++)
    if (o->files[f]) st = bico_transfer_set_file(t, FILES[f].file, o->files[f]);
  if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_METHOD, o->m);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, o->alpha);
  if (st == BICO_OK && o->nm >= 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_NORM_MAP, o->nm);
  if (st == BICO_OK && o->nl >= 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_NULL, o->nl);
  if (st == BICO_OK && o->rank_tol >= 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_RANK_TOL, o->rank_tol);
  if (st == BICO_OK && o->center)
    st = bico_transfer_set_param(t, BICO_TRANSFER_CENTER, 1);
  if (st == BICO_OK && o->allow_partial)
    st = bico_transfer_set_param(t, BICO_TRANSFER_MIN_PAIRED, 0);
  if (st == BICO_OK && o->whiten > 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_WHITEN, o->whiten);
  if (st == BICO_OK && o->blocks)
    st = bico_transfer_set_string(t, BICO_TRANSFER_BLOCKS, o->blocks);
  if (st == BICO_OK && o->rename)
    st = bico_transfer_set_string(t, BICO_TRANSFER_SOURCE_RENAME, o->rename);
  if (st == BICO_OK && o->max_shard > 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_MAX_SHARD_SIZE, o->max_shard);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_PROC_METHOD, o->pm);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_WORKERS, (double)o->workers);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_SOLVE_MEMORY,
                                 o->solve_memory);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_STRUCTURE, o->structure_v);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_ROPE, o->rope_v);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_HEADS, (double)o->heads);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_KV_HEADS, (double)o->kv_heads);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_HEAD_DIM, (double)o->head_dim);
  return st;
}

/* --split and --tie onto the handle: GO_ON (with *st) or a usage error. */
static int add_splits_ties(bico_transfer *t, const transfer_opts *o,
                           bico_status *st) {
  for (size_t k = 0; k < o->nsplits && *st == BICO_OK; k++) {
    char suffix[1024];
    const char *kv;
    size_t kk;
    if (split_eq(o->splits[k], suffix, sizeof suffix, &kv) ||
        cli_size(kv, &kk))
      return cli_error(CMD, CLI_USAGE,
                       "--split %s: expected SUFFIX=K with K a positive integer",
                       o->splits[k]);
    *st = bico_transfer_add_split(t, suffix, kk);
  }
  for (size_t k = 0; k < o->nties && *st == BICO_OK; k++) {
    char tensor[1024];
    const char *module;
    if (split_eq(o->ties[k], tensor, sizeof tensor, &module))
      return cli_error(CMD, CLI_USAGE, "--tie %s: expected TENSOR=MODULE",
                       o->ties[k]);
    *st = bico_transfer_add_tie(t, tensor, module);
  }
  return GO_ON;
}

/* Builds the handle from o and runs it; the exit code. */
static int run_transfer(const transfer_opts *o) {
  const char *const *files = o->files;
  bico_ctx *ctx = NULL;
  bico_transfer *t = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK)
    return cli_error(CMD, CLI_FAIL, "out of memory");
  bico_status st =
      bico_ctx_set_param(ctx, BICO_CTX_THREADS, (long)o->blas_threads);
  if (st == BICO_OK) st = bico_transfer_create(ctx, &t);
  if (st == BICO_OK) st = set_options(t, o);
  int code = add_splits_ties(t, o, &st);
  if (code != GO_ON) goto out;
  code = CLI_FAIL;
  if (st == BICO_OK && cli_transfer_runner != NULL) {
    code = cli_transfer_runner(t, ctx, o->quiet);
    goto out;
  }
  if (st == BICO_OK && !o->quiet) st = bico_transfer_set_log(t, log_line, NULL);
  if (st == BICO_OK && !o->quiet)
    st = cli_progress_install(t, files[BICO_FILE_LORA - 1] != NULL);
  /* --output, --delta-output: files or model folders */
  cli_cleanup_add(files[8], bico_output_is_folder(files[8], files[3]));
  cli_cleanup_add(files[9], bico_output_is_folder(files[9], files[3]));
  cli_cleanup_add(files[10], 0); /* --report */
  cli_cleanup_add(files[12], 1); /* --output-lora */
  cli_cleanup_install();
  if (st == BICO_OK) st = bico_transfer_run(t);
  cli_progress_finish();
  if (st != BICO_OK) {
    const char *opts[NFILE_OPTS];
    for (size_t f = 0; f < NFILE_OPTS; f++) opts[f] = FILES[f].opt;
    code = cli_lib_error_files(CMD, ctx, st, opts, files, NFILE_OPTS);
  } else {
    code = 0;
    (void)cli_cleanup_warn_leftovers(CMD);
  }
out:
  bico_transfer_free(t);
  bico_ctx_free(ctx);
  return code;
}

int cmd_transfer(int argc, char **argv) {
  transfer_opts o;
  int rc = parse_args(argc, argv, &o);
  if (rc == GO_ON) rc = check_usage(&o);
  if (rc != GO_ON) return rc;
  split_threads(&o);
  return run_transfer(&o);
}
