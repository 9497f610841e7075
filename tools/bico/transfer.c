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
};
#define NFILE_OPTS (sizeof FILES / sizeof FILES[0])

int (*cli_transfer_runner)(bico_transfer *t, bico_ctx *ctx, int quiet);

static void log_line(void *opaque, const char *line) {
  (void)opaque;
  cli_progress_clear();
  fprintf(stderr, "%s\n", line);
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

int cmd_transfer(int argc, char **argv) {
  const char *files[NFILE_OPTS] = {0};
  const char *method = NULL, *blocks = NULL, *norm_map = NULL, *null_mode = NULL;
  const char *rename = NULL;
  double alpha = 1.0, rank_tol = -1, whiten = 0;
  int center = 0, quiet = 0, merge_into_base = 0, allow_partial = 0;
  size_t threads = 1, workers = 0;
  double solve_memory = 0, max_shard = 0;
  const char *proc_method = NULL;
  const char *splits[256], *ties[256];
  size_t nsplits = 0, nties = 0;

  for (int i = 1; i < argc; i++) {
    const char *v = NULL;
    const char *a = argv[i];
    int r = 0;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(HELP, stdout);
      return 0;
    }
    if (strcmp(a, "--center") == 0) {
      center = 1;
      continue;
    }
    if (strcmp(a, "--allow-partial") == 0) {
      allow_partial = 1;
      continue;
    }
    if (strcmp(a, "--merge-into-base") == 0) {
      merge_into_base = 1;
      continue;
    }
    if (strcmp(a, "--quiet") == 0 || strcmp(a, "-q") == 0) {
      quiet = 1;
      continue;
    }
    size_t f;
    for (f = 0; f < NFILE_OPTS; f++)
      if ((r = cli_opt(argc, argv, &i, FILES[f].opt, &v)) != 0) break;
    if (f == NFILE_OPTS && (r = cli_opt(argc, argv, &i, "-o", &v)) != 0)
      f = 8; /* --output */
    if (r < 0) return cli_error(CMD, CLI_USAGE, "option %s needs a value", a);
    if (r > 0) {
      if (files[f] != NULL)
        return cli_error(CMD, CLI_USAGE, "option %s given twice", FILES[f].opt);
      if (v[0] == '\0')
        return cli_error(CMD, CLI_USAGE, "option %s has an empty path",
                         FILES[f].opt);
      files[f] = v;
      continue;
    }
#define VALUE(name, var)                                                   \
  if ((r = cli_opt(argc, argv, &i, name, &v)) != 0) {                      \
    if (r < 0) return cli_error(CMD, CLI_USAGE, "option %s needs a value", \
                                name);                                     \
    var;                                                                   \
    continue;                                                              \
  }
    VALUE("--method", method = v)
    VALUE("--blocks", blocks = v)
    VALUE("--source-rename",
          if (strchr(v, '=') == NULL || strcmp(v, "=") == 0) return cli_error(
              CMD, CLI_USAGE,
              "--source-rename %s: expected OLD=NEW (a name prefix of the "
              "source and what replaces it, e.g. module.= or bert.=roberta.)",
              v);
          rename = v)
    VALUE("--norm-map", norm_map = v)
    VALUE("--null", null_mode = v)
    VALUE("--alpha", if (cli_alpha(v, &alpha)) return cli_error(
                         CMD, CLI_USAGE,
                         "--alpha %s: expected a positive number of at most "
                         "3.4e38 (float range)", v))
    VALUE("--rank-tol",
          if (cli_double(v, &rank_tol) || rank_tol < 0 || rank_tol >= 1)
              return cli_error(CMD, CLI_USAGE,
                               "--rank-tol %s: expected a number in [0, 1)", v))
    VALUE("--whiten",
          if (cli_double(v, &whiten) || whiten < 0 || whiten > 0.5)
              return cli_error(CMD, CLI_USAGE,
                               "--whiten %s: expected a number in [0, 0.5]", v))
    VALUE("--threads",
          if (cli_size(v, &threads) || threads > 1024) return cli_error(
              CMD, CLI_USAGE, "--threads %s: expected an integer in 1..1024",
              v))
    VALUE("--workers",
          if (cli_size(v, &workers) || workers > 1024) return cli_error(
              CMD, CLI_USAGE, "--workers %s: expected an integer in 1..1024",
              v))
    VALUE("--proc-method", proc_method = v)
    VALUE("--solve-memory",
          if (parse_bytes(v, &solve_memory)) return cli_error(
              CMD, CLI_USAGE,
              "--solve-memory %s: expected bytes, optionally with K, M or G "
              "(powers of 1024)",
              v))
    VALUE("--max-shard-size",
          if (cli_shard_size(v, &max_shard)) return cli_error(
              CMD, CLI_USAGE,
              "--max-shard-size %s: expected bytes, or a whole number with "
              "KB, MB, GB (powers of 1000) or KiB, MiB, GiB", v))
    VALUE("--split", if (nsplits == 256) return cli_error(
                         CMD, CLI_USAGE, "too many --split options");
          splits[nsplits++] = v)
    VALUE("--tie", if (nties == 256) return cli_error(
                       CMD, CLI_USAGE, "too many --tie options");
          ties[nties++] = v)
#undef VALUE
    if (a[0] == '-')
      return cli_error(CMD, CLI_USAGE, "unknown option %s", a);
    return cli_error(CMD, CLI_USAGE, "unexpected argument %s", a);
  }

  /* Usage checks: what is missing or contradictory is a usage error (2). */
  if (method == NULL)
    return cli_error(CMD, CLI_USAGE, "missing --method");
  int m = 0;
  if (bico_method_from_name(method, &m) != BICO_OK)
    return cli_error(CMD, CLI_USAGE,
                     "unknown method '%s' (bico, bico-in, bico-out, gradfix, "
                     "naive or pad)",
                     method);
  if (files[0] == NULL) return cli_error(CMD, CLI_USAGE, "missing --source-base");
  if (files[3] == NULL) return cli_error(CMD, CLI_USAGE, "missing --target-base");
  if (files[11] != NULL) {
    /* LoRA: lora_cli_check (tools/bico/lora_opts.c) owns these rules. */
    int rc = lora_cli_check(CMD, files[1], files[2], files[8], files[9],
                            files[12], merge_into_base);
    if (rc) return rc;
  } else {
    if (files[12] != NULL || merge_into_base)
      return cli_error(CMD, CLI_USAGE, "%s needs --lora",
                       files[12] != NULL ? "--output-lora" : "--merge-into-base");
    if (files[8] == NULL) return cli_error(CMD, CLI_USAGE, "missing --output");
    if ((files[1] == NULL) == (files[2] == NULL))
      return cli_error(CMD, CLI_USAGE,
                       "give one of --source-tuned and --task-vector");
  }
  int bico = m <= BICO_METHOD_BICO_OUT;
  int calib = files[4] != NULL || files[5] != NULL;
  if (bico) {
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
                       method);
    if (files[6] != NULL && (center || whiten > 0))
      return cli_error(CMD, CLI_USAGE,
                       "--center and --whiten need calibration files, not "
                       "--stats");
  }
  if (m == BICO_METHOD_GRADFIX && files[7] == NULL)
    return cli_error(CMD, CLI_USAGE, "method gradfix needs --target-votes");
  if (m != BICO_METHOD_GRADFIX && files[7] != NULL)
    return cli_error(CMD, CLI_USAGE,
                     "--target-votes is read by method gradfix only; method "
                     "%s would ignore it", method);
  int nm = -1, nl = -1;
  if (norm_map != NULL) {
    if (bico_norm_map_from_name(norm_map, &nm) != BICO_OK)
      return cli_error(CMD, CLI_USAGE, "--norm-map %s: expected act or grad",
                          norm_map);
  }
  if (null_mode != NULL) {
    if (strcmp(null_mode, "keep") == 0) nl = BICO_NULL_KEEP;
    else if (strcmp(null_mode, "drop") == 0) nl = BICO_NULL_DROP;
    else return cli_error(CMD, CLI_USAGE, "--null %s: expected keep or drop",
                          null_mode);
  }

  int pm = BICO_PROC_EIG;
  if (proc_method) {
    if (strcmp(proc_method, "eig") == 0) pm = BICO_PROC_EIG;
    else if (strcmp(proc_method, "svd") == 0) pm = BICO_PROC_SVD;
    else if (strcmp(proc_method, "polar") == 0) pm = BICO_PROC_POLAR;
    else return cli_error(CMD, CLI_USAGE,
                          "--proc-method %s: expected eig, svd or polar",
                          proc_method);
  }
  /* Only the BiCo methods solve maps; the others keep N BLIS threads. */
  if (workers == 0) workers = bico ? threads : 1;
  size_t blas_threads = threads;
  if (workers > 1) {
    /* N threads in all: each solver (and the writing thread) runs BLIS with
     * its share, and so do the BLAS calls inside LAPACK, which follow
     * BLIS's process-wide count, read when BLIS first starts. */
    blas_threads = threads / workers ? threads / workers : 1;
    char share[32];
    snprintf(share, sizeof share, "%zu", blas_threads);
    setenv("BLIS_NUM_THREADS", share, 1);
  }

  bico_ctx *ctx = NULL;
  bico_transfer *t = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK)
    return cli_error(CMD, CLI_FAIL, "out of memory");
  bico_status st = bico_ctx_set_param(ctx, BICO_CTX_THREADS, (long)blas_threads);
  if (st == BICO_OK) st = bico_transfer_create(ctx, &t);
  for (size_t f = 0; f < NFILE_OPTS && st == BICO_OK; f++)
    if (files[f]) st = bico_transfer_set_file(t, FILES[f].file, files[f]);
  if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_METHOD, m);
  if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, alpha);
  if (st == BICO_OK && nm >= 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_NORM_MAP, nm);
  if (st == BICO_OK && nl >= 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_NULL, nl);
  if (st == BICO_OK && rank_tol >= 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_RANK_TOL, rank_tol);
  if (st == BICO_OK && center)
    st = bico_transfer_set_param(t, BICO_TRANSFER_CENTER, 1);
  if (st == BICO_OK && allow_partial)
    st = bico_transfer_set_param(t, BICO_TRANSFER_MIN_PAIRED, 0);
  if (st == BICO_OK && whiten > 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_WHITEN, whiten);
  if (st == BICO_OK && blocks)
    st = bico_transfer_set_string(t, BICO_TRANSFER_BLOCKS, blocks);
  if (st == BICO_OK && rename)
    st = bico_transfer_set_string(t, BICO_TRANSFER_SOURCE_RENAME, rename);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_PROC_METHOD, pm);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_WORKERS, (double)workers);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_SOLVE_MEMORY, solve_memory);
  if (st == BICO_OK && max_shard > 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_MAX_SHARD_SIZE, max_shard);
  int code = CLI_FAIL;
  for (size_t k = 0; k < nsplits && st == BICO_OK; k++) {
    char suffix[1024];
    const char *kv;
    size_t kk;
    if (split_eq(splits[k], suffix, sizeof suffix, &kv) || cli_size(kv, &kk)) {
      code = cli_error(CMD, CLI_USAGE,
                       "--split %s: expected SUFFIX=K with K a positive integer",
                       splits[k]);
      goto out;
    }
    st = bico_transfer_add_split(t, suffix, kk);
  }
  for (size_t k = 0; k < nties && st == BICO_OK; k++) {
    char tensor[1024];
    const char *module;
    if (split_eq(ties[k], tensor, sizeof tensor, &module)) {
      code = cli_error(CMD, CLI_USAGE, "--tie %s: expected TENSOR=MODULE",
                       ties[k]);
      goto out;
    }
    st = bico_transfer_add_tie(t, tensor, module);
  }
  if (st == BICO_OK && cli_transfer_runner != NULL) {
    code = cli_transfer_runner(t, ctx, quiet);
    goto out;
  }
  if (st == BICO_OK && !quiet) st = bico_transfer_set_log(t, log_line, NULL);
  if (st == BICO_OK && !quiet) st = cli_progress_install(t);
  cli_cleanup_add(files[8], bico_output_is_folder(files[8], files[3]));
  cli_cleanup_add(files[9], bico_output_is_folder(files[9], files[3]));
  cli_cleanup_add(files[10], 0); /* --report */
  cli_cleanup_add(files[12], 1); /* --output-lora */
  cli_cleanup_install();
  if (st == BICO_OK) st = bico_transfer_run(t);
  cli_progress_finish();
  code = st == BICO_OK ? 0 : cli_lib_error(CMD, ctx, st);
out:
  bico_transfer_free(t);
  bico_ctx_free(ctx);
  return code;
}
