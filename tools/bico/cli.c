/* The command's shared helpers: options, numbers, messages (library
 * errors put in the user's words), model identity.  Every sub-command
 * (transfer.c, merge.c, stats.c, inspect.c, config.c) calls these; main.c
 * only dispatches, so the arrows go one way. */
#define _DEFAULT_SOURCE 1 /* realpath */
#include <dlfcn.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "cli.h"

int cli_arg_at = -1;

void cli_put_escaped(FILE *f, const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p < 0x20 || *p == 0x7f) fprintf(f, "\\x%02x", *p);
    else if (p[0] == 0xc2 && p[1] >= 0x80 && p[1] < 0xa0) /* C1 */
      fprintf(f, "\\u%04x", *++p);
    else fputc(*p, f);
  }
}

int cli_error(const char *cmd, int code, const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "bico%s%s: ", cmd ? " " : "", cmd ? cmd : "");
  char msg[4096];
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  cli_put_escaped(stderr, msg); /* names from files and arguments */
  if (code == CLI_USAGE && cli_arg_at >= 0 && cli_from_config(cli_arg_at))
    fprintf(stderr, " (from --config %s)", cli_config_file());
  fputc('\n', stderr);
  if (code == CLI_USAGE)
    fprintf(stderr, "run 'bico %s --help' for the options\n", cmd ? cmd : "");
  return code;
}

int cli_opt(int argc, char **argv, int *i, const char *name,
            const char **value) {
  const char *a = argv[*i];
  size_t n = strlen(name);
  if (strncmp(a, name, n) != 0) return 0;
  if (a[n] == '=') {
    *value = a + n + 1;
    return 1;
  }
  if (a[n] != '\0') return 0;
  if (*i + 1 >= argc) return -1;
  *value = argv[++*i];
  return 1;
}

int cli_once(const char *cmd, cli_once_t *seen, const char *name, int at) {
  size_t k;
  for (k = 0; k < seen->n; k++)
    if (strcmp(seen->name[k], name) == 0) break;
  if (k == seen->n) {
    if (seen->n < sizeof seen->name / sizeof *seen->name) {
      seen->name[seen->n] = name;
      seen->at[seen->n++] = at;
    }
    return 0;
  }
  int a = cli_from_config(seen->at[k]), b = cli_from_config(at);
  cli_arg_at = -1; /* the message says where */
  if (a && b)
    return cli_error(cmd, CLI_USAGE, "option %s given twice in --config %s",
                     name, cli_config_file());
  if (a || b)
    return cli_error(cmd, CLI_USAGE,
                     "option %s given twice: in --config %s and on the "
                     "command line (a single-valued option is given once)",
                     name, cli_config_file());
  return cli_error(cmd, CLI_USAGE,
                   "option %s given twice (a single-valued option is given "
                   "once)", name);
}

int cli_double(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || *end != '\0' || errno == ERANGE) return -1;
  *out = v;
  return 0;
}

int cli_alpha(const char *s, double *out) {
  double v;
  if (cli_double(s, &v) || !(v > 0) || v > FLT_MAX) return -1;
  *out = v;
  return 0;
}

int cli_size(const char *s, size_t *out) {
  char *end;
  errno = 0;
  if (s[0] == '-' || s[0] == '\0') return -1;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end != '\0' || errno == ERANGE || v == 0) return -1;
  *out = (size_t)v;
  return 0;
}

/* The one byte-count grammar of the size options (--max-shard-size,
 * --solve-memory; bico and bico-mpi): a decimal number (digits, an
 * optional fraction, an optional sign) with an optional unit, any case:
 * K, M, G, KiB, MiB, GiB (powers of 1024) or KB, MB, GB (powers of 1000,
 * Hugging Face's max_shard_size), except that a lowercase final "b" after
 * K/M/G means bits ("5Gb" is 5e9 / 8 bytes), as there.  With a unit,
 * fractions of a byte are dropped.  Only the grammar: the range (a
 * negative count, one beyond 2^53, a fraction without a unit) is the
 * library's set_param's to refuse. */
int cli_bytes(const char *s, double *out) {
  static const struct {
    const char *unit;
    double mul;
  } U[] = {{"k", 1024.0},  {"m", 1048576.0}, {"g", 1073741824.0},
           {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0},
           {"kb", 1e3},     {"mb", 1e6},         {"gb", 1e9}};
  size_t i = 0, digits = 0;
  if (s[i] == '-' || s[i] == '+') i++;
  while (s[i] >= '0' && s[i] <= '9') i++, digits++;
  if (s[i] == '.') {
    i++;
    while (s[i] >= '0' && s[i] <= '9') i++, digits++;
  }
  if (digits == 0) return -1;
  char num[64];
  if (i >= sizeof num) {
    /* more digits than any byte count has: beyond the range, for the
     * library to say so */
    *out = s[0] == '-' ? -HUGE_VAL : HUGE_VAL;
  } else {
    memcpy(num, s, i);
    num[i] = '\0';
    *out = strtod(num, NULL);
  }
  const char *u = s + i;
  if (*u == '\0') return 0;
  size_t k, ul = strlen(u);
  for (k = 0; k < sizeof U / sizeof *U; k++)
    if (ul == strlen(U[k].unit) && strncasecmp(u, U[k].unit, ul) == 0) break;
  if (k == sizeof U / sizeof *U) return -1;
  double mul = U[k].mul;
  if (ul == 2 && u[1] == 'b') mul /= 8; /* bits */
  *out = floor(*out * mul);
  return 0;
}

int cli_bytes_option(const char *cmd, const char *opt, const char *v,
                     double *out) {
  if (cli_bytes(v, out) == 0) return 0;
  return cli_error(cmd, CLI_USAGE,
                   "%s %s: expected bytes: a number, optionally with K, M, "
                   "G, KiB, MiB, GiB (powers of 1024) or KB, MB, GB (powers "
                   "of 1000)",
                   opt, v);
}

int cli_wait(const char *cmd, bico_ctx *ctx, const char *v) {
  double x;
  if (v == NULL) return 0;
  if (cli_double(v, &x))
    return cli_error(cmd, CLI_USAGE, "--wait %s: expected a number of seconds",
                     v);
  if (bico_ctx_set_param(ctx, BICO_CTX_FOLDER_WAIT, x) != BICO_OK)
    return cli_param_refused(cmd, ctx, "--wait", v);
  return 0;
}

int cli_param_refused(const char *cmd, bico_ctx *ctx, const char *opt,
                      const char *v) {
  char msg[2048];
  cli_user_message(bico_ctx_errmsg(ctx), msg, sizeof msg);
  return cli_error(cmd, CLI_USAGE, "%s %s: %s", opt, v, msg);
}

/* 1 when "bico_" + the n characters at s name a function the library
 * exports (a real API name such as stfile_open or transfer_run), looked up
 * in the process's symbols: a user's file "task_a" in a message is not
 * one, and stays. */
static int api_name(const char *s, size_t n) {
  static void *self;
  char sym[128];
  if (n + 6 > sizeof sym) return 0;
  memcpy(sym, "bico_", 5);
  memcpy(sym + 5, s, n);
  sym[5 + n] = '\0';
  if (self == NULL) self = dlopen(NULL, RTLD_LAZY);
  return self != NULL && dlsym(self, sym) != NULL;
}

/* Length of a library function's name followed by ": " at s (an API name
 * such as stfile_open or stwriter_create_folder: lowercase words joined by
 * '_', with "bico_" before it a symbol of the library), or 0. */
static size_t fn_prefix(const char *s) {
  size_t i = 0, us = 0;
  if (!(s[0] >= 'a' && s[0] <= 'z')) return 0;
  while ((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') ||
         s[i] == '_')
    us += s[i++] == '_';
  if (!(us > 0 && s[i - 1] != '_' && s[i] == ':' && s[i + 1] == ' ')) return 0;
  /* the full symbol too ("bico_stwriter_create_folder: ") */
  size_t skip = i > 5 && strncmp(s, "bico_", 5) == 0 ? 5 : 0;
  return api_name(s + skip, i - skip) ? i + 2 : 0;
}

/* The library's words for its own settings, in the command's options. */
static const struct {
  const char *lib, *cli;
} SETTINGS[] = {{"the context's folder_wait", "--wait SECONDS"}};

/* The library's message without the API function names it carries
 * ("transfer_run: ", "stfile_open: "): the command's user gave files and
 * options, not calls. */
void cli_user_message(const char *in, char *out, size_t cap) {
  size_t o = 0;
  for (size_t i = 0; in[i] && o + 1 < cap;) {
    size_t k = (i == 0 || (i >= 2 && in[i - 2] == ':' && in[i - 1] == ' '))
                   ? fn_prefix(in + i) : 0;
    if (k) {
      i += k;
      continue;
    }
    size_t w;
    for (w = 0; w < sizeof SETTINGS / sizeof *SETTINGS; w++)
      if (strncmp(in + i, SETTINGS[w].lib, strlen(SETTINGS[w].lib)) == 0)
        break;
    if (w < sizeof SETTINGS / sizeof *SETTINGS) {
      int n = snprintf(out + o, cap - o, "%s", SETTINGS[w].cli);
      o = n < 0 || (size_t)n >= cap - o ? cap - 1 : o + (size_t)n;
      i += strlen(SETTINGS[w].lib);
      continue;
    }
    out[o++] = in[i++];
  }
  out[o] = '\0';
}

static int is_edge(char c, int after) {
  return c == '\0' || c == ' ' || c == '\'' || c == '"' ||
         (after ? (c == ':' || c == '/' || c == ',' || c == ')') : c == '(');
}

int cli_lib_error_files(const char *cmd, bico_ctx *ctx, bico_status st,
                        const char *const *opts, const char *const *paths,
                        size_t n) {
  const char *detail = ctx ? bico_ctx_errmsg(ctx) : "";
  char msg[4096];
  cli_user_message(detail[0] ? detail : bico_strerror(st), msg, sizeof msg);
  /* Name the option of the file the message is about: the earliest path
   * of a file option found in it. */
  const char *best = NULL, *opt = NULL;
  size_t best_len = 0;
  int ambiguous = 0;
  for (size_t k = 0; k < n; k++) {
    if (paths[k] == NULL || opts[k] == NULL) continue;
    size_t len = strlen(paths[k]);
    while (len > 1 && paths[k][len - 1] == '/') len--;
    for (const char *p = msg; *p; p++) {
      if (strncmp(p, paths[k], len) != 0) continue;
      if (!is_edge(p == msg ? '\0' : p[-1], 0) || !is_edge(p[len], 1)) continue;
      if (best == NULL || p < best || (p == best && len > best_len)) {
        best = p;
        best_len = len;
        opt = opts[k];
        ambiguous = 0;
      } else if (p == best && len == best_len && strcmp(opt, opts[k]) != 0) {
        ambiguous = 1; /* one path for two options: the message's words */
      }
      break;
    }
  }
  /* a message that names an option before the file needs no other (one
   * after it, as a holder's command line quoted at the end, does not
   * count) */
  const char *dash = strstr(msg, "--");
  if (dash != NULL && (best == NULL || dash < best)) opt = NULL;
  if (opt != NULL && !ambiguous) return cli_error(cmd, CLI_FAIL, "%s: %s", opt, msg);
  return cli_error(cmd, CLI_FAIL, "%s", msg);
}

int cli_lib_error(const char *cmd, bico_ctx *ctx, bico_status st) {
  return cli_lib_error_files(cmd, ctx, st, NULL, NULL, 0);
}

int cli_same_model(const char *a, const char *b) {
  if (strcmp(a, b) == 0) return 1;
  struct stat sa, sb;
  if (stat(a, &sa) != 0 || stat(b, &sb) != 0) return 0;
  if (sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino) return 1;
  if (!S_ISDIR(sa.st_mode) == !S_ISDIR(sb.st_mode)) return 0;
  /* a folder and a file: the same model when the file is the folder's
   * model.safetensors or its index */
  const struct stat *sd = S_ISDIR(sa.st_mode) ? &sa : &sb;
  char *rp = realpath(S_ISDIR(sa.st_mode) ? b : a, NULL);
  if (rp == NULL) return 0;
  char *slash = strrchr(rp, '/');
  int same = 0;
  if (slash != NULL && (strcmp(slash + 1, "model.safetensors") == 0 ||
                        strcmp(slash + 1, "model.safetensors.index.json") == 0)) {
    struct stat sp;
    if (slash == rp) slash++; /* a file in "/" */
    *slash = '\0';
    same = stat(rp, &sp) == 0 && sp.st_dev == sd->st_dev &&
           sp.st_ino == sd->st_ino;
  }
  free(rp);
  return same;
}

