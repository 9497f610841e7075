/* bico transfer and bico bridge: options -> bico_transfer -> run (or
 * bico_transfer_bridge: the same options without a fine-tune, --output
 * naming the bridge file). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bico_help.h"
#include "cli.h"

static const char *CMD = "transfer";
/* `bico bridge`: --output is the bridge file (BICO_FILE_BRIDGE_OUTPUT) and
 * bico_transfer_bridge runs instead of bico_transfer_run. */
static int bridge_mode;

/* Generated from docs/bico.1.md (scripts/gen-help.py). */
static const char HELP[] = BICO_HELP_TRANSFER;
static const char HELP_BRIDGE[] = BICO_HELP_BRIDGE;

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
    {"--bridge", BICO_FILE_BRIDGE},           /* index 15 */
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

/* A number for option opt within the accepted set of transfer parameter
 * param (bico_transfer_param_bounds: the library's bounds, not a copy):
 * 0, or -1 after a usage error naming the option and the set. */
static int param_value(const char *opt, int param, const char *v,
                       double *out) {
  double lo, hi, x;
  unsigned fl;
  if (bico_transfer_param_bounds(param, &lo, &hi, &fl) != BICO_OK) return -1;
  int integer = (fl & BICO_PARAM_INTEGER) != 0;
  int ok = cli_double(v, &x) == 0 && x == x;
  if (ok) ok = (fl & BICO_PARAM_LO_OPEN) ? x > lo : x >= lo;
  if (ok) ok = (fl & BICO_PARAM_HI_OPEN) ? x < hi : x <= hi;
  if (ok && integer) ok = x == (double)(long long)x;
  if (!ok) {
    cli_error(CMD, CLI_USAGE, "%s %s: expected %s in %c%.15g, %.15g%c", opt, v,
              integer ? "an integer" : "a number",
              (fl & BICO_PARAM_LO_OPEN) ? '(' : '[', lo, hi,
              (fl & BICO_PARAM_HI_OPEN) ? ')' : ']');
    return -1;
  }
  *out = x;
  return 0;
}

/* --threads within the context's bounds (BICO_CTX_THREADS). */
static int threads_value(const char *v, size_t *out) {
  double lo = 1, hi = 1024;
  unsigned fl;
  bico_ctx_param_bounds(BICO_CTX_THREADS, &lo, &hi, &fl);
  if (cli_size(v, out) == 0 && (double)*out >= lo && (double)*out <= hi)
    return 0;
  cli_error(CMD, CLI_USAGE, "--threads %s: expected an integer in [%.15g, %.15g]",
            v, lo, hi);
  return -1;
}

/* What the command line says, before any library call. */
typedef struct {
  const char *files[NFILE_OPTS];
  const char *method, *blocks, *norm_map, *null_mode, *proc_method;
  const char *rename; /* --source-rename OLD=NEW */
  double alpha, rank_tol, whiten, solve_memory, workers;
  double max_shard; /* --max-shard-size, bytes (0: as the target) */
  /* the size options as given (NULL: not given), for the messages */
  const char *max_shard_text, *solve_memory_text;
  const char *wait_text; /* --wait SECONDS (NULL: refuse at once) */
  int center, quiet, merge_into_base, allow_partial;
  int alpha_set; /* --alpha given (on the command line or in --config) */
  size_t threads;
  const char *splits[256], *ties[256];
  size_t nsplits, nties;
  /* Resolved by check_usage. */
  int m, bico, nm, nl, pm;
  size_t blas_threads;
  /* Decoder families (docs/llm.md). */
  const char *structure, *rope;
  double heads, kv_heads, head_dim;
  int structure_v, rope_v; /* resolved by check_usage */
  /* Bridges: how the bases are fingerprinted (NULL: the default, or the
   * bridge's). */
  const char *fingerprint;
  int fingerprint_v; /* resolved by check_usage */
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
      fputs(bridge_mode ? HELP_BRIDGE : HELP, stdout);
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
          if (cli_bytes_option(CMD, "--max-shard-size", v, &o->max_shard))
              return CLI_USAGE;
          o->max_shard_text = v)
    VALUE("--norm-map", o->norm_map = v)
    VALUE("--wait", o->wait_text = v)
    VALUE("--null", o->null_mode = v)
    VALUE("--alpha", if (cli_alpha(v, &o->alpha)) return cli_error(
                         CMD, CLI_USAGE,
                         "--alpha %s: expected a positive number of at most "
                         "3.4e38 (float range)", v);
          o->alpha_set = 1)
    VALUE("--rank-tol",
          if (param_value("--rank-tol", BICO_TRANSFER_RANK_TOL, v,
                          &o->rank_tol)) return CLI_USAGE)
    VALUE("--whiten",
          if (param_value("--whiten", BICO_TRANSFER_WHITEN, v, &o->whiten))
              return CLI_USAGE)
    VALUE("--threads", if (threads_value(v, &o->threads)) return CLI_USAGE)
    VALUE("--workers",
          if (param_value("--workers", BICO_TRANSFER_WORKERS, v, &o->workers))
              return CLI_USAGE)
    VALUE("--proc-method", o->proc_method = v)
    VALUE("--solve-memory",
          if (cli_bytes_option(CMD, "--solve-memory", v, &o->solve_memory))
              return CLI_USAGE;
          o->solve_memory_text = v)
    VALUE("--structure", o->structure = v)
    VALUE("--rope", o->rope = v)
    VALUE("--fingerprint", o->fingerprint = v)
    /* 0 is the library's "from config.json", not a value to give */
#define COUNT_OPT(name, param, var)                                        \
  VALUE(name, if (param_value(name, param, v, &var)) return CLI_USAGE;     \
        if (var == 0) return cli_error(CMD, CLI_USAGE,                     \
                                       "%s %s: expected a positive integer", \
                                       name, v))
    COUNT_OPT("--heads", BICO_TRANSFER_HEADS, o->heads)
    COUNT_OPT("--kv-heads", BICO_TRANSFER_KV_HEADS, o->kv_heads)
    COUNT_OPT("--head-dim", BICO_TRANSFER_HEAD_DIM, o->head_dim)
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

/* Which files go together is the library's rule (bico_transfer_check in
 * run_transfer); the command adds only its own flag: with --lora,
 * --output writes the merged checkpoint only when --merge-into-base says
 * so (lora_cli_check, tools/bico/lora_opts.c).  GO_ON or a usage error. */
static int check_files(const transfer_opts *o) {
  const char *const *files = o->files;
  if (bridge_mode) return GO_ON; /* the library names what does not apply */
  if (files[BICO_FILE_LORA - 1] == NULL) {
    if (o->merge_into_base)
      return cli_error(CMD, CLI_USAGE, "--merge-into-base needs --lora");
    return GO_ON;
  }
  int rc = lora_cli_check(CMD, files[BICO_FILE_OUTPUT - 1], o->merge_into_base);
  return rc ? rc : GO_ON;
}

/* The options `bico bridge` does not take (a bridge holds maps, not an
 * update): a usage error naming the first given. */
static int check_bridge_usage(const transfer_opts *o) {
  const char *bad = o->alpha_set         ? "--alpha"
                    : o->merge_into_base ? "--merge-into-base"
                    : o->max_shard_text  ? "--max-shard-size"
                                         : NULL;
  if (bad != NULL)
    return cli_error(CMD, CLI_USAGE,
                     "%s does not apply to a bridge (give it to the `bico "
                     "transfer --bridge` that reads it)",
                     bad);
  if (o->files[8] == NULL)
    return cli_error(CMD, CLI_USAGE, "missing --output (the bridge file)");
  return GO_ON;
}

/* Usage checks: what is missing or contradictory is a usage error (2).
 * Resolves names to enum values and the thread split. */
static int check_usage(transfer_opts *o) {
  if (bridge_mode && check_bridge_usage(o) != GO_ON) return CLI_USAGE;
  /* A bridge has its method (`bico bridge`: bico unless --method says) */
  int from_bridge = bridge_mode || o->files[BICO_FILE_BRIDGE - 1] != NULL;
  if (o->method == NULL && !from_bridge)
    return cli_error(CMD, CLI_USAGE, "missing --method");
  o->m = 0;
  if (o->method != NULL &&
      bico_transfer_method_from_name(o->method, &o->m) != BICO_OK)
    return cli_error(CMD, CLI_USAGE,
                     "unknown method '%s' (bico, bico-in, bico-out, gradfix, "
                     "naive or pad)",
                     o->method);
  o->bico = o->m <= BICO_METHOD_BICO_OUT; /* 0: the bridge's, a BiCo method */
  int rc = check_files(o);
  if (rc != GO_ON) return rc;
  o->nm = -1, o->nl = -1;
  if (o->norm_map != NULL) {
    if (bico_transfer_norm_map_from_name(o->norm_map, &o->nm) != BICO_OK)
      return cli_error(CMD, CLI_USAGE, "--norm-map %s: expected act or grad",
                          o->norm_map);
  }
  if (o->null_mode != NULL &&
      bico_procrustes_null_from_name(o->null_mode, &o->nl) != BICO_OK)
    return cli_error(CMD, CLI_USAGE, "--null %s: expected keep or drop",
                     o->null_mode);
  o->pm = -1; /* the library's default */
  if (o->proc_method != NULL &&
      bico_procrustes_method_from_name(o->proc_method, &o->pm) != BICO_OK)
    return cli_error(CMD, CLI_USAGE,
                     "--proc-method %s: expected eig, svd or polar",
                     o->proc_method);
  /* Unset (0): the library's default, or a bridge's value. */
  o->structure_v = 0;
  o->rope_v = 0; /* from config.json */
  if (o->structure != NULL &&
      bico_transfer_structure_from_name(o->structure, &o->structure_v) != BICO_OK)
    return cli_error(CMD, CLI_USAGE, "--structure %s: expected heads or free",
                     o->structure);
  if (o->rope != NULL && bico_transfer_rope_from_name(o->rope, &o->rope_v) != BICO_OK)
    return cli_error(CMD, CLI_USAGE,
                     "--rope %s: expected half, interleaved or none", o->rope);
  /* Only a bridge is fingerprinted: a plain transfer would ignore it. */
  o->fingerprint_v = 0;
  if (o->fingerprint != NULL && !from_bridge)
    return cli_error(CMD, CLI_USAGE,
                     "--fingerprint applies to a bridge (`bico bridge`, or "
                     "`bico transfer --bridge`)");
  if (o->fingerprint != NULL &&
      bico_transfer_fingerprint_from_name(o->fingerprint, &o->fingerprint_v) !=
          BICO_OK)
    return cli_error(CMD, CLI_USAGE, "--fingerprint %s: expected sampled or full",
                     o->fingerprint);
  return GO_ON;
}

/* Only the BiCo methods solve maps in a pool of workers; the others, and
 * an adapter's run (the LoRA branch solves each module's maps in the
 * calling thread), keep N BLIS threads. */
static void split_threads(transfer_opts *o) {
  /* A run reading a bridge solves nothing; making one only solves. */
  int solves = bridge_mode || (o->bico && o->files[BICO_FILE_LORA - 1] == NULL &&
                               o->files[BICO_FILE_BRIDGE - 1] == NULL);
  if (o->workers == 0) o->workers = solves ? (double)o->threads : 1;
  o->blas_threads = o->threads;
  if (o->workers > 1) {
    /* N threads in all: each solver (and the writing thread) runs BLIS with
     * its share, and so do the BLAS calls inside LAPACK, which follow
     * BLIS's process-wide count, read when BLIS first starts. */
    size_t w = (size_t)o->workers;
    o->blas_threads = o->threads / w ? o->threads / w : 1;
    char share[32];
    snprintf(share, sizeof share, "%zu", o->blas_threads);
    setenv("BLIS_NUM_THREADS", share, 1);
  }
}

/* Files and scalar parameters onto the handle. */
/* *bad: the size option whose value set_param refused (its range is the
 * library's), else left alone. */
static bico_status set_options(bico_transfer *t, const transfer_opts *o,
                               const char **bad) {
  bico_status st = BICO_OK;
  for (size_t f = 0; f < NFILE_OPTS && st == BICO_OK; f++)
    if (o->files[f])
      st = bico_transfer_set_file(t, bridge_mode && FILES[f].file == BICO_FILE_OUTPUT
                                         ? BICO_FILE_BRIDGE_OUTPUT
                                         : FILES[f].file,
                                  o->files[f]);
  /* Only what the command line gives: a bridge supplies the rest. */
  if (st == BICO_OK && o->method)
    st = bico_transfer_set_param(t, BICO_TRANSFER_METHOD, o->m);
  if (st == BICO_OK && !bridge_mode)
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
  if (st == BICO_OK && o->max_shard_text &&
      (st = bico_transfer_set_param(t, BICO_TRANSFER_MAX_SHARD_SIZE,
                                    o->max_shard)) != BICO_OK)
    *bad = "--max-shard-size";
  if (st == BICO_OK && o->pm >= 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_PROC_METHOD, o->pm);
  if (st == BICO_OK)
    st = bico_transfer_set_param(t, BICO_TRANSFER_WORKERS, o->workers);
  if (st == BICO_OK && o->solve_memory_text &&
      (st = bico_transfer_set_param(t, BICO_TRANSFER_SOLVE_MEMORY,
                                    o->solve_memory)) != BICO_OK)
    *bad = "--solve-memory";
  if (st == BICO_OK && o->structure)
    st = bico_transfer_set_param(t, BICO_TRANSFER_STRUCTURE, o->structure_v);
  if (st == BICO_OK && o->rope)
    st = bico_transfer_set_param(t, BICO_TRANSFER_ROPE, o->rope_v);
  if (st == BICO_OK && o->fingerprint)
    st = bico_transfer_set_param(t, BICO_TRANSFER_FINGERPRINT, o->fingerprint_v);
  if (st == BICO_OK && o->heads > 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_HEADS, o->heads);
  if (st == BICO_OK && o->kv_heads > 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_KV_HEADS, o->kv_heads);
  if (st == BICO_OK && o->head_dim > 0)
    st = bico_transfer_set_param(t, BICO_TRANSFER_HEAD_DIM, o->head_dim);
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

/* A library message about the options in the command's words: "the
 * <slot> file" (bico_transfer_file_name) becomes the slot's option, "the
 * <param> parameter" (bico_transfer_param_name) its option. */
static void option_words(const char *in, char *out, size_t cap) {
  size_t o = 0;
  while (*in && o + 1 < cap) {
    const char *opt = NULL;
    size_t skip = 0;
    if (strncmp(in, "the ", 4) == 0) {
      for (size_t f = 0; f < NFILE_OPTS && opt == NULL; f++) {
        const char *w = bico_transfer_file_name(FILES[f].file);
        size_t n = w ? strlen(w) : 0;
        if (n && strncmp(in + 4, w, n) == 0 && strncmp(in + 4 + n, " file", 5) == 0 &&
            !(in[9 + n] >= 'a' && in[9 + n] <= 'z'))
          opt = FILES[f].opt, skip = 9 + n;
      }
      static const int PARAMS[] = {BICO_TRANSFER_CENTER, BICO_TRANSFER_WHITEN};
      for (size_t k = 0; k < 2 && opt == NULL; k++) {
        const char *w = bico_transfer_param_name(PARAMS[k]);
        size_t n = strlen(w);
        if (strncmp(in + 4, w, n) == 0 && strncmp(in + 4 + n, " parameter", 10) == 0)
          opt = PARAMS[k] == BICO_TRANSFER_CENTER ? "--center" : "--whiten",
          skip = 14 + n;
      }
    }
    if (opt != NULL) {
      int k = snprintf(out + o, cap - o, "%s", opt);
      o = k < 0 || (size_t)k >= cap - o ? cap - 1 : o + (size_t)k;
      in += skip;
    } else {
      out[o++] = *in++;
    }
  }
  out[o] = '\0';
}

/* No --alpha and a causal language model as the target (its config.json,
 * as the library reads it), other than the source base itself: a usage
 * error.  On decoder LMs the whole update
 * (alpha 1) left the target worse than untouched in most measured cells
 * (docs/llm.md), and the command runs no model to choose alpha on text.
 * GO_ON otherwise, or when the plan cannot be made (the run says why). */
static int check_lm_alpha(bico_transfer *t, const transfer_opts *o) {
  /* Onto its own base (an adapter or fine-tune of that model, merged):
   * nothing is carried between models, alpha 1 is that fine-tune. */
  struct stat a, b;
  if (bridge_mode) return GO_ON; /* a bridge carries nothing yet */
  if (o->files[0] && o->files[3] && stat(o->files[0], &a) == 0 &&
      stat(o->files[3], &b) == 0 && a.st_dev == b.st_dev &&
      a.st_ino == b.st_ino)
    return GO_ON;
  if (bico_transfer_explain(t) != BICO_OK) return GO_ON;
  bico_transfer_model_info mi;
  memset(&mi, 0, sizeof mi);
  mi.size = sizeof mi;
  if (bico_transfer_explain_model(t, 1, &mi) != BICO_OK || !mi.causal_lm)
    return GO_ON;
  return cli_error(
      CMD, CLI_USAGE,
      "the target is a causal language model (%s) and --alpha is not "
      "given: on decoder language models the whole update (alpha 1) often "
      "leaves the target worse than untouched (docs/llm.md), and this "
      "command runs no model to choose alpha.  Choose it on held-out "
      "calibration text with `python3 -m bico.llm` or "
      "bico.torch.transfer_model (alpha=\"heldout\"), or give --alpha A "
      "(--alpha 1: the whole update, as before)",
      mi.causal_from);
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
  int code = GO_ON;
  if (st == BICO_OK && cli_wait(CMD, ctx, o->wait_text) != 0) {
    code = CLI_USAGE;
    goto out;
  }
  if (st == BICO_OK) st = bico_transfer_create(ctx, &t);
  const char *bad = NULL;
  if (st == BICO_OK) st = set_options(t, o, &bad);
  if (bad != NULL) {
    code = cli_param_refused(CMD, ctx, bad,
                             strcmp(bad, "--max-shard-size") == 0
                                 ? o->max_shard_text
                                 : o->solve_memory_text);
    goto out;
  }
  code = add_splits_ties(t, o, &st);
  if (code != GO_ON) goto out;
  /* Which files go together, contradictions: the library's rules, checked
   * before any file is opened; a failure there is a usage error. */
  if (st == BICO_OK &&
      (st = bico_transfer_check(t, BICO_TRANSFER_CHECK_OPTIONS)) != BICO_OK) {
    char msg[4096], words[4096];
    cli_user_message(bico_ctx_errmsg(ctx), msg, sizeof msg);
    option_words(msg, words, sizeof words);
    code = cli_error(CMD, CLI_USAGE, "%s", words);
    goto out;
  }
  if (st == BICO_OK && !o->alpha_set && (code = check_lm_alpha(t, o)) != GO_ON)
    goto out;
  code = CLI_FAIL;
  if (st == BICO_OK && cli_transfer_runner != NULL) {
    code = cli_transfer_runner(t, ctx, o->quiet);
    goto out;
  }
  if (st == BICO_OK && !o->quiet) st = bico_transfer_set_log(t, log_line, NULL);
  if (st == BICO_OK && !o->quiet)
    st = cli_progress_install(t, files[BICO_FILE_LORA - 1] != NULL);
  /* --output, --delta-output: files or model folders */
  cli_cleanup_add(files[8], !bridge_mode &&
                                bico_stwriter_output_is_folder(files[8], files[3]));
  cli_cleanup_add(files[9], bico_stwriter_output_is_folder(files[9], files[3]));
  cli_cleanup_add(files[10], 0); /* --report */
  cli_cleanup_add(files[12], 1); /* --output-lora */
  cli_cleanup_install();
  if (st == BICO_OK) st = bridge_mode ? bico_transfer_bridge(t) : bico_transfer_run(t);
  cli_progress_finish();
  if (st != BICO_OK) {
    /* A message that names a file by its slot ("the source tuned file X")
     * says the option itself; else the option whose path it names. */
    char msg[4096], words[4096];
    cli_user_message(bico_ctx_errmsg(ctx), msg, sizeof msg);
    option_words(msg, words, sizeof words);
    const char *opts[NFILE_OPTS];
    for (size_t f = 0; f < NFILE_OPTS; f++) opts[f] = FILES[f].opt;
    code = strcmp(msg, words) != 0
               ? cli_error(CMD, CLI_FAIL, "%s", words)
               : cli_lib_error_files(CMD, ctx, st, opts, files, NFILE_OPTS);
  } else {
    code = 0;
    (void)cli_cleanup_warn_leftovers(CMD);
  }
out:
  bico_transfer_free(t);
  bico_ctx_free(ctx);
  return code;
}

int cmd_bridge(int argc, char **argv) {
  CMD = "bridge";
  bridge_mode = 1;
  return cmd_transfer(argc, argv);
}

int cmd_transfer(int argc, char **argv) {
  transfer_opts o;
  int rc = parse_args(argc, argv, &o);
  if (rc == GO_ON) rc = check_usage(&o);
  if (rc != GO_ON) return rc;
  split_threads(&o);
  return run_transfer(&o);
}
