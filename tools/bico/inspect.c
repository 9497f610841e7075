/* bico inspect: tensors, dtypes, shapes, modules and blocks of a file. */
#include <stdio.h>
#include <string.h>

#include "bico_help.h"
#include "cli.h"

static const char *const CMD = "inspect";

/* Generated from docs/bico.1.md (scripts/gen-help.py). */
static const char HELP[] = BICO_HELP_INSPECT;

static const char *const KINDS[] = {"?", "linear", "elementwise", "embedding",
                                    "other"};
static const char *const ROLES[] = {"?", "weight", "bias", "vector", "token",
                                    "other"};

int cmd_inspect(int argc, char **argv) {
  const char *path = NULL, *blocks = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v;
    int r;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(HELP, stdout);
      return 0;
    }
    if ((r = cli_opt(argc, argv, &i, "--blocks", &v)) != 0) {
      if (r < 0) return cli_error(CMD, CLI_USAGE, "option --blocks needs a value");
      blocks = v;
      continue;
    }
    if (a[0] == '-' && a[1] != '\0')
      return cli_error(CMD, CLI_USAGE, "unknown option %s", a);
    if (path != NULL)
      return cli_error(CMD, CLI_USAGE, "one file at a time (got %s and %s)",
                       path, a);
    path = a;
  }
  if (path == NULL) return cli_error(CMD, CLI_USAGE, "missing FILE");
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
  if (st != BICO_OK) {
    int code = cli_lib_error(CMD, ctx, st);
    bico_model_free(m);
    bico_stfile_close(f);
    bico_ctx_free(ctx);
    return code;
  }
  size_t nt = bico_stfile_count(f), nmd = bico_stfile_metadata_count(f);
  printf("file: %s\n", path);
  printf("tensors: %zu\n", nt);
  for (size_t i = 0; i < nmd; i++) {
    const char *k, *v;
    if (bico_stfile_metadata_at(f, i, &k, &v) == BICO_OK)
      printf("metadata: %s = %s\n", k, v);
  }
  if (prefix)
    printf("blocks: %s%s<i> (%zu blocks)\n", prefix, prefix[0] ? "." : "",
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
    printf("%-48s %-5s ", name, bico_dtype_name(dtype));
    int w = 0;
    char buf[64];
    w = snprintf(buf, sizeof buf, "[");
    for (size_t d = 0; d < ndim && w < (int)sizeof buf; d++)
      w += snprintf(buf + w, sizeof buf - (size_t)w, "%s%zu", d ? ", " : "",
                    shape[d]);
    if (w < (int)sizeof buf) snprintf(buf + w, sizeof buf - (size_t)w, "]");
    printf("%-22s %s\n", buf, ROLES[role >= 1 && role <= 5 ? role : 0]);
  }
  size_t nm = bico_model_module_count(m);
  printf("\n%-48s %-11s %-6s %s\n", "MODULE", "KIND", "BLOCK", "D_OUT x D_IN");
  for (size_t i = 0; i < nm; i++) {
    const char *name;
    int kind;
    long block;
    bico_model_module(m, i, &name, &kind, &block, NULL);
    printf("%-48s %-11s ", name[0] ? name : "(root)",
           KINDS[kind >= 1 && kind <= 4 ? kind : 0]);
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
  bico_stfile_close(f);
  bico_ctx_free(ctx);
  return 0;
}
