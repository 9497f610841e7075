/* bico inspect: tensors, dtypes, shapes, modules and blocks of a file;
 * with two models, what a transfer from the first to the second would do
 * and why (the library's plan: bico_transfer_explain). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bico_help.h"
#include "cli.h"

static const char *const CMD = "inspect";

/* Generated from docs/bico.1.md (scripts/gen-help.py). */
static const char HELP[] = BICO_HELP_INSPECT;

/* Length of a valid UTF-8 sequence at p (1..4), or 0. */
static size_t utf8_len(const unsigned char *p) {
  size_t n = p[0] < 0x80 ? 1 : p[0] >= 0xc2 && p[0] <= 0xdf ? 2
           : p[0] >= 0xe0 && p[0] <= 0xef ? 3 : p[0] >= 0xf0 && p[0] <= 0xf4 ? 4 : 0;
  for (size_t k = 1; k < n; k++)
    if ((p[k] & 0xc0) != 0x80) return 0;
  if (n == 3 && ((p[0] == 0xe0 && p[1] < 0xa0) || (p[0] == 0xed && p[1] >= 0xa0)))
    return 0;
  if (n == 4 && ((p[0] == 0xf0 && p[1] < 0x90) || (p[0] == 0xf4 && p[1] >= 0x90)))
    return 0;
  return n;
}

/* Names, paths and metadata come from files and the command line: their
 * control characters (C0, DEL, C1: terminal escape sequences) never reach
 * the terminal raw.  JSON: \u00NN escapes (and U+FFFD for a byte that is
 * not UTF-8); text: \xNN for control bytes and bytes that are not UTF-8,
 * \u00NN for C1 characters, and a backslash doubled. */
static void json_str(const char *s) {
  if (s == NULL) {
    fputs("null", stdout);
    return;
  }
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    size_t n = utf8_len(p);
    if (*p == '"' || *p == '\\') printf("\\%c", *p);
    else if (*p < 0x20 || *p == 0x7f) printf("\\u%04x", *p);
    else if (n == 2 && p[0] == 0xc2 && p[1] < 0xa0) printf("\\u%04x", p[1]);
    else if (n == 0) fputs("\\ufffd", stdout);
    else fwrite(p, 1, n, stdout);
    p += n ? n : 1;
  }
  putchar('"');
}

/* s with its control characters escaped (see json_str), in one of four
 * rotating buffers: up to four results may be used at once. */
static const char *text(const char *s) {
  static char *buf[4];
  static size_t cap[4];
  static int slot;
  if (s == NULL) return "(null)";
  size_t len = strlen(s), need = 6 * len + 1;
  slot = (slot + 1) % 4;
  if (cap[slot] < need) {
    char *b = realloc(buf[slot], need);
    if (b == NULL) return "(out of memory)";
    buf[slot] = b;
    cap[slot] = need;
  }
  char *o = buf[slot];
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    size_t n = utf8_len(p);
    if (*p == '\\') o += sprintf(o, "\\\\");
    else if (*p < 0x20 || *p == 0x7f || n == 0) o += sprintf(o, "\\x%02x", *p);
    else if (n == 2 && p[0] == 0xc2 && p[1] < 0xa0) o += sprintf(o, "\\u%04x", p[1]);
    else {
      memcpy(o, p, n);
      o += n;
    }
    p += n ? n : 1;
  }
  *o = '\0';
  return buf[slot];
}

static const char *handling_name(int h) {
  const char *s = bico_transfer_handling_name(h);
  return s != NULL ? s : "?";
}

static void maps_str(const bico_transfer_decision *d, char *buf, size_t cap) {
  if (!d->in_map && d->out_maps == 0) {
    snprintf(buf, cap, "%s", d->handling == BICO_HANDLING_UNCHANGED ? "-" : "identity");
    return;
  }
  if (d->out_maps > 1)
    snprintf(buf, cap, "%sout x%d", d->in_map ? "in+" : "", d->out_maps);
  else
    snprintf(buf, cap, "%s%s%s", d->in_map ? "in" : "",
             d->in_map && d->out_maps ? "+" : "", d->out_maps ? "out" : "");
}

static int explain_usage(const char *opt) {
  return cli_error(CMD, CLI_USAGE, "%s expects NAME=VALUE", opt);
}

/* What bico_transfer_explain decided, gathered for printing. */
typedef struct explained {
  const char *paths[2];
  int method;
  bico_transfer_model_info mi[2];
  size_t vs, vt, vsh, vnew; /* vocabulary: source, target, shared, new */
  bico_transfer_decision *d;
  size_t nt;
  size_t pair[6][2]; /* by role: tensors, and those with a partner */
} explained;

static const char *const SIDES[2] = {"source", "target"};
static const char *const KIND[6] = {"?", "weights", "biases", "norm vectors",
                                    "tokens", "other"};

/* The run's options from the command line: a CLI exit code (0: fine). */
static int explain_setup(bico_ctx *ctx, bico_transfer *t, const char *method,
                         int *m, const char *blocks, const char **splits,
                         size_t nsplits, const char **ties, size_t nties,
                         const char *src, const char *tgt) {
  *m = BICO_METHOD_BICO;
  if (method && bico_transfer_method_from_name(method, m) != BICO_OK)
    return cli_error(CMD, CLI_USAGE, "unknown method %s", method);
  bico_status st = bico_transfer_set_param(t, BICO_TRANSFER_METHOD, *m);
  if (st == BICO_OK) st = bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, src);
  if (st == BICO_OK) st = bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, tgt);
  if (st == BICO_OK && blocks)
    st = bico_transfer_set_string(t, BICO_TRANSFER_BLOCKS, blocks);
  for (size_t k = 0; k < nsplits && st == BICO_OK; k++) {
    char suffix[512];
    const char *eq = strrchr(splits[k], '=');
    size_t kk;
    if (eq == NULL || (size_t)(eq - splits[k]) >= sizeof suffix ||
        cli_size(eq + 1, &kk))
      return explain_usage("--split");
    snprintf(suffix, sizeof suffix, "%.*s", (int)(eq - splits[k]), splits[k]);
    st = bico_transfer_add_split(t, suffix, kk);
  }
  for (size_t k = 0; k < nties && st == BICO_OK; k++) {
    char tensor[512];
    const char *eq = strchr(ties[k], '=');
    if (eq == NULL || (size_t)(eq - ties[k]) >= sizeof tensor)
      return explain_usage("--tie");
    snprintf(tensor, sizeof tensor, "%.*s", (int)(eq - ties[k]), ties[k]);
    st = bico_transfer_add_tie(t, tensor, eq + 1);
  }
  if (st == BICO_OK) st = bico_transfer_explain(t);
  return st == BICO_OK ? 0 : cli_lib_error(CMD, ctx, st);
}

/* Models, vocabulary, per-tensor decisions and pairing by kind. */
static int explain_gather(bico_ctx *ctx, bico_transfer *t, explained *e) {
  bico_status st = bico_transfer_explain_count(t, &e->nt);
  if (st != BICO_OK) return cli_lib_error(CMD, ctx, st);
  for (int k = 0; k < 2; k++) {
    e->mi[k].size = sizeof e->mi[k];
    bico_transfer_explain_model(t, k, &e->mi[k]);
  }
  bico_transfer_explain_vocab(t, &e->vs, &e->vt, &e->vsh, &e->vnew);
  e->d = calloc(e->nt ? e->nt : 1, sizeof *e->d);
  if (e->d == NULL) return cli_error(CMD, CLI_FAIL, "out of memory");
  for (size_t i = 0; i < e->nt; i++) {
    e->d[i].size = sizeof e->d[i];
    bico_transfer_explain_tensor(t, i, &e->d[i]);
    int r = e->d[i].role >= 1 && e->d[i].role <= 5 ? e->d[i].role : 0;
    e->pair[r][0]++;
    e->pair[r][1] += e->d[i].source != NULL;
  }
  return 0;
}

static void explain_json(const explained *e) {
  printf("{");
  for (int k = 0; k < 2; k++) {
    printf("%s\"%s\": {\"path\": ", k ? ", " : "", SIDES[k]);
    json_str(e->paths[k]);
    printf(", \"family\": ");
    json_str(e->mi[k].family);
    printf(", \"family_from\": ");
    json_str(e->mi[k].family_from);
    printf(", \"blocks\": ");
    json_str(e->mi[k].blocks);
    printf(", \"nblocks\": %zu, \"tensors\": %zu}", e->mi[k].nblocks,
           e->mi[k].tensors);
  }
  printf(", \"method\": ");
  json_str(bico_transfer_method_name(e->method));
  if (e->vt)
    printf(", \"vocab\": {\"source_tokens\": %zu, \"target_tokens\": %zu, "
           "\"shared\": %zu, \"new\": %zu}", e->vs, e->vt, e->vsh, e->vnew);
  else
    printf(", \"vocab\": null");
  printf(", \"pairing\": {");
  for (int r = 1, first = 1; r <= 5; r++)
    if (e->pair[r][0]) {
      printf("%s\"%s\": [%zu, %zu]", first ? "" : ", ", KIND[r], e->pair[r][1],
             e->pair[r][0]);
      first = 0;
    }
  printf("}, \"tensors\": [");
  for (size_t i = 0; i < e->nt; i++) {
    printf("%s\n  {\"name\": ", i ? "," : "");
    json_str(e->d[i].name);
    printf(", \"role\": ");
    json_str(bico_model_tensor_role_name(e->d[i].role));
    printf(", \"handling\": ");
    json_str(handling_name(e->d[i].handling));
    printf(", \"source\": ");
    json_str(e->d[i].source);
    printf(", \"module\": ");
    json_str(e->d[i].module);
    printf(", \"in_map\": %s, \"out_maps\": %d, \"transposed\": %s, "
           "\"vocab\": %s, \"rule\": ",
           e->d[i].in_map ? "true" : "false", e->d[i].out_maps,
           e->d[i].transposed ? "true" : "false", e->d[i].vocab ? "true" : "false");
    json_str(e->d[i].rule);
    printf("}");
  }
  printf("\n]}\n");
}

static void explain_text(const explained *e) {
  for (int k = 0; k < 2; k++) {
    printf("%s: %s\n  family: %s", SIDES[k], text(e->paths[k]),
           text(e->mi[k].family));
    if (e->mi[k].family_from[0])
      printf(" (from %s)", text(e->mi[k].family_from));
    if (e->mi[k].blocks)
      printf("\n  blocks: %s%s<i> (%zu blocks)", text(e->mi[k].blocks),
             e->mi[k].blocks[0] ? "." : "", e->mi[k].nblocks);
    else
      printf("\n  blocks: none detected");
    printf("\n  tensors: %zu\n", e->mi[k].tensors);
  }
  printf("method: %s\n", bico_transfer_method_name(e->method));
  if (e->vt)
    printf("vocabulary: the tokenizers differ (%zu source, %zu target "
           "tokens): %zu shared, rows carried by token string; %zu new, "
           "left unchanged\n", e->vs, e->vt, e->vsh, e->vnew);
  else
    printf("vocabulary: not mapped (identical, no tokenizer.json on both "
           "sides, or not a BiCo method)\n");
  printf("pairing:");
  for (int r = 1, first = 1; r <= 5; r++)
    if (e->pair[r][0]) {
      printf("%s %s %zu/%zu", first ? "" : ",", KIND[r], e->pair[r][1],
             e->pair[r][0]);
      first = 0;
    }
  printf("\nsplits:");
  int any = 0;
  for (size_t i = 0; i < e->nt; i++)
    if (e->d[i].out_maps > 1 && e->d[i].role == BICO_ROLE_WEIGHT) {
      printf("\n  %s: output in %d blocks", text(e->d[i].module),
             e->d[i].out_maps);
      any = 1;
    }
  printf("%s\nties:", any ? "" : " none");
  any = 0;
  for (size_t i = 0; i < e->nt; i++)
    if (e->d[i].role == BICO_ROLE_TOKEN) {
      printf("\n  %s -> %s", text(e->d[i].name),
             e->d[i].module ? text(e->d[i].module) : "(none)");
      any = 1;
    }
  printf("%s\n\n%-44s %-7s %-9s %-11s %s\n", any ? "" : " none", "TENSOR",
         "ROLE", "HANDLING", "MAPS", "SOURCE / RULE");
  for (size_t i = 0; i < e->nt; i++) {
    char maps[32];
    maps_str(&e->d[i], maps, sizeof maps);
    printf("%-44s %-7s %-9s %-11s %s\n%44s   %s\n", text(e->d[i].name),
           bico_model_tensor_role_name(e->d[i].role), handling_name(e->d[i].handling),
           maps, e->d[i].source ? text(e->d[i].source) : "(no partner)", "",
           text(e->d[i].rule));
  }
}

/* bico inspect SOURCE TARGET. */
static int explain_pair(const char *src, const char *tgt, int json,
                        const char *method, const char *blocks,
                        const char **splits, size_t nsplits,
                        const char **ties, size_t nties) {
  bico_ctx *ctx;
  if (bico_ctx_create(&ctx) != BICO_OK)
    return cli_error(CMD, CLI_FAIL, "out of memory");
  bico_transfer *t = NULL;
  explained e;
  memset(&e, 0, sizeof e);
  e.paths[0] = src;
  e.paths[1] = tgt;
  int code = bico_transfer_create(ctx, &t) == BICO_OK
                 ? 0
                 : cli_error(CMD, CLI_FAIL, "out of memory");
  if (code == 0)
    code = explain_setup(ctx, t, method, &e.method, blocks, splits, nsplits,
                         ties, nties, src, tgt);
  if (code == 0) code = explain_gather(ctx, t, &e);
  if (code == 0) {
    if (json)
      explain_json(&e);
    else
      explain_text(&e);
  }
  free(e.d);
  bico_transfer_free(t);
  bico_ctx_free(ctx);
  return code;
}

/* The library's names of module kinds and tensor roles ("?" if none). */
static const char *or_unknown(const char *name) { return name ? name : "?"; }

int cmd_inspect(int argc, char **argv) {
  const char *path = NULL, *path2 = NULL, *blocks = NULL, *method = NULL;
  const char *splits[256], *ties[256];
  size_t nsplits = 0, nties = 0;
  int json = 0;
  cli_once_t seen = {{NULL}, {0}, 0};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v;
    int r, start = i;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(HELP, stdout);
      return 0;
    }
    if (strcmp(a, "--json") == 0) {
      json = 1;
      continue;
    }
    if ((r = cli_opt(argc, argv, &i, "--blocks", &v)) != 0) {
      if (r < 0) return cli_error(CMD, CLI_USAGE, "option --blocks needs a value");
      if (cli_once(CMD, &seen, "--blocks", start)) return CLI_USAGE;
      blocks = v;
      continue;
    }
    if ((r = cli_opt(argc, argv, &i, "--method", &v)) != 0) {
      if (r < 0) return cli_error(CMD, CLI_USAGE, "option --method needs a value");
      if (cli_once(CMD, &seen, "--method", start)) return CLI_USAGE;
      method = v;
      continue;
    }
    if ((r = cli_opt(argc, argv, &i, "--split", &v)) != 0) {
      if (r < 0 || nsplits == 256)
        return cli_error(CMD, CLI_USAGE, "option --split needs a value");
      splits[nsplits++] = v;
      continue;
    }
    if ((r = cli_opt(argc, argv, &i, "--tie", &v)) != 0) {
      if (r < 0 || nties == 256)
        return cli_error(CMD, CLI_USAGE, "option --tie needs a value");
      ties[nties++] = v;
      continue;
    }
    if (a[0] == '-' && a[1] != '\0')
      return cli_error(CMD, CLI_USAGE, "unknown option %s", a);
    if (path2 != NULL)
      return cli_error(CMD, CLI_USAGE, "one file, or a source and a target "
                       "(got a third: %s)", a);
    if (path != NULL) path2 = a;
    else path = a;
  }
  if (path == NULL) return cli_error(CMD, CLI_USAGE, "missing FILE");
  if (path2 != NULL)
    return explain_pair(path, path2, json, method, blocks, splits, nsplits,
                        ties, nties);
  if (json || method || nsplits || nties)
    return cli_error(CMD, CLI_USAGE, "--json, --method, --split and --tie "
                     "need a source and a target");
  bico_ctx *ctx;
  if (bico_ctx_create(&ctx) != BICO_OK)
    return cli_error(CMD, CLI_FAIL, "out of memory");
  bico_stfile *f = NULL;
  bico_model *m = NULL;
  bico_status st = bico_stfile_open(ctx, path, &f);
  if (st == BICO_OK) st = bico_model_from_stfile(ctx, f, &m);
  if (st == BICO_OK && blocks) st = bico_model_set_blocks(m, blocks);
  const char *prefix = NULL;
  size_t nblocks = 0;
  if (st == BICO_OK) st = bico_model_blocks(m, &prefix, &nblocks);
  size_t nt = 0, nmd = 0, nm = 0;
  if (st == BICO_OK) st = bico_stfile_count(f, &nt);
  if (st == BICO_OK) st = bico_stfile_metadata_count(f, &nmd);
  if (st == BICO_OK) st = bico_model_module_count(m, &nm);
  if (st != BICO_OK) {
    int code = cli_lib_error(CMD, ctx, st);
    bico_model_free(m);
    bico_stfile_free(f);
    bico_ctx_free(ctx);
    return code;
  }
  printf("file: %s\n", text(path));
  printf("tensors: %zu\n", nt);
  for (size_t i = 0; i < nmd; i++) {
    const char *k, *v;
    if (bico_stfile_metadata_at(f, i, &k, &v) == BICO_OK)
      printf("metadata: %s = %s\n", text(k), text(v));
  }
  if (prefix)
    printf("blocks: %s%s<i> (%zu blocks)\n", text(prefix), prefix[0] ? "." : "",
           nblocks);
  else
    printf("blocks: none detected\n");
  printf("\n%-48s %-5s %-22s %s\n", "TENSOR", "DTYPE", "SHAPE", "ROLE");
  for (size_t i = 0; i < nt; i++) {
    const char *name;
    int dtype, role = 0;
    size_t ndim;
    const size_t *shape;
    bico_stfile_tensor_info(f, i, &name, &dtype, &ndim, &shape);
    bico_model_tensor_module(m, i, NULL, &role);
    printf("%-48s %-5s ", text(name), bico_dtype_name(dtype));
    int w = 0;
    char buf[64];
    w = snprintf(buf, sizeof buf, "[");
    for (size_t d = 0; d < ndim && w < (int)sizeof buf; d++)
      w += snprintf(buf + w, sizeof buf - (size_t)w, "%s%zu", d ? ", " : "",
                    shape[d]);
    if (w < (int)sizeof buf) snprintf(buf + w, sizeof buf - (size_t)w, "]");
    printf("%-22s %s\n", buf, or_unknown(bico_model_tensor_role_name(role)));
  }
  printf("\n%-48s %-11s %-6s %s\n", "MODULE", "KIND", "BLOCK", "D_OUT x D_IN");
  for (size_t i = 0; i < nm; i++) {
    const char *name;
    int kind;
    long block;
    bico_model_module(m, i, &name, &kind, &block, NULL);
    printf("%-48s %-11s ", name[0] ? text(name) : "(root)",
           or_unknown(bico_model_module_kind_name(kind)));
    if (block >= 0)
      printf("%-6ld ", block);
    else
      printf("%-6s ", "-");
    size_t dout, din;
    if (kind == BICO_MODULE_LINEAR &&
        bico_model_module_dims(m, i, &dout, &din) == BICO_OK)
      printf("%zu x %zu", dout, din);
    else if (kind == BICO_MODULE_ELEMENTWISE &&
             bico_model_module_dims(m, i, &dout, &din) == BICO_OK)
      printf("%zu", dout);
    printf("\n");
  }
  bico_model_free(m);
  bico_stfile_free(f);
  bico_ctx_free(ctx);
  return 0;
}
