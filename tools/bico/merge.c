/* bico merge: options -> bico_merge -> run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bico_help.h"
#include "cli.h"

static const char *const CMD = "merge";

/* Generated from docs/bico.1.md (scripts/gen-help.py). */
static const char HELP[] = BICO_HELP_MERGE;

static void log_line(void *opaque, const char *line) {
  (void)opaque;
  cli_progress_clear();
  cli_put_escaped(stderr, line);
  fputc('\n', stderr);
}

#define MAX_INPUTS 256

typedef struct merge_input {
  int kind;
  const char *path;
  double weight, density;
} merge_input;

typedef struct merge_opts {
  const char *base, *output, *delta, *report;
  int method, normalize, quiet;
  double alpha, max_shard;
  const merge_input *in;
  size_t nin;
  const char *max_shard_text; /* as given; NULL: not given */
  const char *wait_text;      /* --wait SECONDS; NULL: not given */
} merge_opts;

/* A library message about the options in the command's words: "the
 * <file> file" (merge.h's bico_merge_check) becomes the file's option,
 * "density"/"weight" the input's --density/--weight, "the ties method"
 * --method ties. */
static void option_words(const char *in, char *out, size_t cap) {
  static const struct {
    const char *words, *opt;
  } MAP[] = {{"the base file", "--base"},
             {"the output file", "--output"},
             {"the delta output file", "--delta-output"},
             {"the report file", "--report"},
             {"the ties method", "--method ties"},
             {"a task vector, a tuned checkpoint or a LoRA adapter",
              "--task-vector, --tuned or --lora"},
             {"density", "--density"},
             {"weight", "--weight"}};
  size_t o = 0;
  const char *start = in;
  while (*in && o + 1 < cap) {
    const char *opt = NULL;
    size_t skip = 0;
    int word_start = in == start || in[-1] == ' ' || in[-1] == '(';
    for (size_t k = 0; k < sizeof MAP / sizeof *MAP && opt == NULL && word_start;
         k++) {
      size_t n = strlen(MAP[k].words);
      char after = in[n];
      if (strncmp(in, MAP[k].words, n) == 0 &&
          !(after >= 'a' && after <= 'z') && after != '_' && after != '-')
        opt = MAP[k].opt, skip = n;
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

/* Configures and runs the library's merge; the CLI exit code. */
static int merge_run(const merge_opts *o) {
  bico_ctx *ctx = NULL;
  bico_merge *mg = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK)
    return cli_error(CMD, CLI_FAIL, "out of memory");
  if (cli_wait(CMD, ctx, o->wait_text) != 0) {
    bico_ctx_free(ctx);
    return CLI_USAGE;
  }
  bico_status st = bico_merge_create(ctx, &mg);
  if (st == BICO_OK) st = bico_merge_set_file(mg, BICO_MERGE_FILE_BASE, o->base);
  if (st == BICO_OK)
    st = bico_merge_set_file(mg, BICO_MERGE_FILE_OUTPUT, o->output);
  if (st == BICO_OK && o->delta)
    st = bico_merge_set_file(mg, BICO_MERGE_FILE_DELTA_OUTPUT, o->delta);
  if (st == BICO_OK && o->report)
    st = bico_merge_set_file(mg, BICO_MERGE_FILE_REPORT, o->report);
  if (st == BICO_OK) st = bico_merge_set_param(mg, BICO_MERGE_METHOD, o->method);
  if (st == BICO_OK) st = bico_merge_set_param(mg, BICO_MERGE_ALPHA, o->alpha);
  if (st == BICO_OK)
    st = bico_merge_set_param(mg, BICO_MERGE_NORMALIZE, o->normalize);
  if (st == BICO_OK && o->max_shard_text &&
      (st = bico_merge_set_param(mg, BICO_MERGE_MAX_SHARD_SIZE,
                                 o->max_shard)) != BICO_OK) {
    /* its range is the library's */
    int code = cli_param_refused(CMD, ctx, "--max-shard-size", o->max_shard_text);
    bico_merge_free(mg);
    bico_ctx_free(ctx);
    return code;
  }
  for (size_t k = 0; k < o->nin && st == BICO_OK; k++)
    st = bico_merge_add_input(mg, o->in[k].kind, o->in[k].path,
                              o->in[k].weight, o->in[k].density);
  /* The options' rules are the library's (bico_merge_add_input: weight
   * and density; bico_merge_check at its options level: files given,
   * outputs apart, density under linear): a failure there is a usage
   * error, in option words.  What needs the files is the run's first step
   * (the inputs level of the same checks), a failure on the files. */
  if (st == BICO_OK) st = bico_merge_check(mg, BICO_MERGE_CHECK_OPTIONS);
  if (st != BICO_OK) {
    char msg[4096], words[4096];
    cli_user_message(bico_ctx_errmsg(ctx), msg, sizeof msg);
    option_words(msg, words, sizeof words);
    int code = cli_error(CMD, st == BICO_E_NOMEM ? CLI_FAIL : CLI_USAGE, "%s",
                         words);
    bico_merge_free(mg);
    bico_ctx_free(ctx);
    return code;
  }
  if (!o->quiet) st = bico_merge_set_log(mg, log_line, NULL);
  if (st == BICO_OK && !o->quiet) st = cli_progress_install_merge(mg);
  cli_cleanup_add(o->output, bico_stwriter_output_is_folder(o->output, o->base));
  cli_cleanup_add(o->delta, bico_stwriter_output_is_folder(o->delta, o->base));
  cli_cleanup_add(o->report, 0);
  cli_cleanup_install();
  if (st == BICO_OK) st = bico_merge_run(mg);
  cli_progress_finish();
  int code = 0;
  if (st != BICO_OK) {
    /* The option of each file, for the message. */
    const char *opts[4 + MAX_INPUTS], *paths[4 + MAX_INPUTS];
    static const char *const KIND_OPT[] = {NULL, "--task-vector", "--tuned",
                                           "--lora"};
    size_t n = 0;
    opts[n] = "--output", paths[n++] = o->output;
    opts[n] = "--delta-output", paths[n++] = o->delta;
    opts[n] = "--report", paths[n++] = o->report;
    opts[n] = "--base", paths[n++] = o->base;
    for (size_t k = 0; k < o->nin; k++) {
      int kind = o->in[k].kind;
      opts[n] = kind >= 1 && kind <= 3 ? KIND_OPT[kind] : NULL;
      paths[n++] = o->in[k].path;
    }
    code = cli_lib_error_files(CMD, ctx, st, opts, paths, n);
  } else {
    (void)cli_cleanup_warn_leftovers(CMD);
  }
  bico_merge_free(mg);
  bico_ctx_free(ctx);
  return code;
}

int cmd_merge(int argc, char **argv) {
  const char *base = NULL, *output = NULL, *delta = NULL, *report = NULL,
             *method = NULL;
  double alpha = 1.0;
  int normalize = -1, quiet = 0;
  double max_shard = 0;
  const char *max_shard_text = NULL, *wait_text = NULL;
  merge_input in[MAX_INPUTS];
  size_t nin = 0;
  static const struct {
    const char *opt;
    int kind;
  } KINDS[3] = {{"--task-vector", BICO_MERGE_TASK_VECTOR},
                {"--tuned", BICO_MERGE_TUNED},
                {"--lora", BICO_MERGE_LORA}};

  /* Single-valued options once (cli_once); --weight and --density once
   * per input; the inputs repeat. */
  cli_once_t seen = {{NULL}, {0}, 0};
  unsigned char wd[MAX_INPUTS] = {0}; /* bit 1: --weight, 2: --density */
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = NULL;
    int r = 0, start = i;
    cli_arg_at = i;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(HELP, stdout);
      return 0;
    }
    if (strcmp(a, "--quiet") == 0 || strcmp(a, "-q") == 0) {
      quiet = 1;
      continue;
    }
    if (strcmp(a, "--normalize") == 0 || strcmp(a, "--no-normalize") == 0) {
      if (cli_once(CMD, &seen, "--normalize", start))
        return CLI_USAGE;
      normalize = strcmp(a, "--normalize") == 0;
      continue;
    }
    int matched = 0;
    for (int k = 0; k < 3 && !matched; k++) {
      if ((r = cli_opt(argc, argv, &i, KINDS[k].opt, &v)) == 0) continue;
      if (r < 0)
        return cli_error(CMD, CLI_USAGE, "option %s needs a value", KINDS[k].opt);
      if (v[0] == '\0')
        return cli_error(CMD, CLI_USAGE, "option %s has an empty path",
                         KINDS[k].opt);
      if (nin == MAX_INPUTS)
        return cli_error(CMD, CLI_USAGE, "too many inputs (at most %d)",
                         MAX_INPUTS);
      in[nin].kind = KINDS[k].kind;
      in[nin].path = v;
      in[nin].weight = 1.0;
      in[nin].density = 1.0;
      nin++;
      matched = 1;
    }
    if (matched) continue;
#define EACH(name, var)                                                    \
  if ((r = cli_opt(argc, argv, &i, name, &v)) != 0) {                      \
    if (r < 0) return cli_error(CMD, CLI_USAGE, "option %s needs a value", \
                                name);                                     \
    var;                                                                   \
    continue;                                                              \
  }
#define VALUE(name, var)                                                   \
  EACH(name, if (cli_once(CMD, &seen, name, start)) return CLI_USAGE; var)
#define PATH(name, var)                                                     \
  VALUE(name, if (v[0] == '\0') return cli_error(CMD, CLI_USAGE,            \
                                           "option %s has an empty path",   \
                                           name);                           \
        var = v)
    PATH("--base", base)
    PATH("--output", output)
    EACH("-o", if (cli_once(CMD, &seen, "--output", start)) return CLI_USAGE;
         if (v[0] == '\0') return cli_error(CMD, CLI_USAGE,
                                            "option -o has an empty path");
         output = v)
    PATH("--delta-output", delta)
    PATH("--report", report)
    VALUE("--method", method = v)
    VALUE("--wait", wait_text = v)
    VALUE("--max-shard-size",
          if (cli_bytes_option(CMD, "--max-shard-size", v, &max_shard))
              return CLI_USAGE;
          max_shard_text = v)
    VALUE("--alpha", if (cli_alpha(v, &alpha)) return cli_error(
                         CMD, CLI_USAGE,
                         "--alpha %s: expected a positive number of at most "
                         "3.4e38 (float range)", v))
    EACH("--weight",
          if (nin == 0) return cli_error(CMD, CLI_USAGE,
                                         "--weight %s comes before any input; "
                                         "it applies to the input before it",
                                         v);
          if (wd[nin - 1] & 1) return cli_error(
              CMD, CLI_USAGE, "option --weight given twice for input %s",
              in[nin - 1].path);
          wd[nin - 1] |= 1;
          if (cli_double(v, &in[nin - 1].weight))
              return cli_error(CMD, CLI_USAGE, "--weight %s: expected a number",
                               v))
    EACH("--density",
          if (nin == 0) return cli_error(CMD, CLI_USAGE,
                                         "--density %s comes before any "
                                         "input; it applies to the input "
                                         "before it",
                                         v);
          if (wd[nin - 1] & 2) return cli_error(
              CMD, CLI_USAGE, "option --density given twice for input %s",
              in[nin - 1].path);
          wd[nin - 1] |= 2;
          if (cli_double(v, &in[nin - 1].density))
              return cli_error(CMD, CLI_USAGE,
                               "--density %s: expected a number", v))
#undef PATH
#undef VALUE
#undef EACH
    if (a[0] == '-') return cli_error(CMD, CLI_USAGE, "unknown option %s", a);
    return cli_error(CMD, CLI_USAGE, "unexpected argument %s", a);
  }
  cli_arg_at = -1;
  int m = BICO_MERGE_LINEAR;
  if (method != NULL && bico_merge_method_from_name(method, &m) != BICO_OK)
    return cli_error(CMD, CLI_USAGE,
                     "unknown method '%s' (linear, task_arithmetic or ties)",
                     method);

  merge_opts o = {base, output, delta, report, m, normalize, quiet,
                  alpha, max_shard, in, nin, max_shard_text, wait_text};
  return merge_run(&o);
}
