/* Open a model folder and read its graph (bico_model): blocks, modules
 * and their kinds, tensor roles, how a shallower model's modules pair with
 * it; then its family and tied tensors as a transfer sees them
 * (bico_transfer_explain).
 *
 * libbico reads a checkpoint through its tensor names and shapes only: a
 * tensor's module is its name minus the last component, a module with a
 * 2-D "weight" is LINEAR, one with only 1-D parameters ELEMENTWISE (a
 * norm), and the repeated blocks are the prefix P of most names "P.<i>.".
 * The program writes its two models (a file and a Hugging Face folder with
 * config.json) in a temporary folder, so it needs no file of yours. */
/* mkdtemp is POSIX.1-2008, not C99: ask for it before any header */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <bico/bico.h>

/* Every call returns a bico_status; on failure the context holds the
 * detail.  One helper prints it and stops the program. */
static void ok(bico_ctx *ctx, bico_status st, const char *what) {
  if (st == BICO_OK) return;
  fprintf(stderr, "%s: %s (%s)\n", what, bico_ctx_errmsg(ctx),
          bico_status_name(st));
  exit(1);
}

/* A model of `depth` blocks of width d: an embedding table, per block a
 * norm and an MLP of two linear layers.  Declare every tensor, then write
 * each (zeros: the graph does not look at values), then commit. */
static void write_model(bico_ctx *ctx, const char *path, int depth, size_t d) {
  static float zeros[64 * 16];
  bico_stwriter *w = NULL;
  char name[64];
  size_t shapes[4][2] = {{32, d}, {d, 0}, {4 * d, d}, {d, 4 * d}};
  const char *part[4] = {"embed.weight", "norm.weight", "mlp.fc1.weight",
                         "mlp.fc2.weight"};
  ok(ctx, bico_stwriter_create(ctx, path, &w), "stwriter_create");
  for (int pass = 0; pass < 2; pass++)
    for (int i = -1; i < depth; i++)
      for (int k = i < 0 ? 0 : 1; k < (i < 0 ? 1 : 4); k++) {
        if (i < 0) snprintf(name, sizeof name, "%s", part[k]);
        else snprintf(name, sizeof name, "blocks.%d.%s", i, part[k]);
        size_t nd = shapes[k][1] ? 2 : 1;
        size_t n = shapes[k][0] * (nd == 2 ? shapes[k][1] : 1);
        ok(ctx, pass == 0 ? bico_stwriter_declare(w, name, BICO_DTYPE_F32, nd, shapes[k])
                          : bico_stwriter_write_f32(w, name, zeros, n), name);
      }
  ok(ctx, bico_stwriter_commit(w), "commit"); /* renamed into place here */
  bico_stwriter_free(w);
}

static bico_model *open_model(bico_ctx *ctx, const char *path) {
  bico_stfile *f = NULL; /* a file, an index, or a model folder */
  bico_model *m = NULL;
  ok(ctx, bico_stfile_open(ctx, path, &f), "stfile_open");
  ok(ctx, bico_model_from_stfile(ctx, f, &m), "model_from_stfile");
  bico_stfile_free(f); /* the model copied the names and shapes */
  return m;
}

int main(void) {
  bico_ctx *ctx = NULL;
  if (bico_ctx_create(&ctx) != BICO_OK) return 1;
  char dir[] = "/tmp/bico-example-XXXXXX", a[64], b[64], bw[128], bc[128];
  if (mkdtemp(dir) == NULL) return 1;
  snprintf(a, sizeof a, "%s/small.safetensors", dir);
  snprintf(b, sizeof b, "%s/deep", dir); /* a model folder */
  snprintf(bw, sizeof bw, "%s/model.safetensors", b);
  snprintf(bc, sizeof bc, "%s/config.json", b);
  mkdir(b, 0700);
  write_model(ctx, a, 2, 8);
  write_model(ctx, bw, 5, 16);
  FILE *cf = fopen(bc, "w");
  if (cf == NULL) return 1;
  fputs("{\"model_type\": \"llama\"}\n", cf);
  fclose(cf);
  bico_model *src = open_model(ctx, a), *tgt = open_model(ctx, b);

  const char *prefix = NULL;
  size_t nblocks = 0, nmod = 0;
  ok(ctx, bico_model_blocks(tgt, &prefix, &nblocks), "model_blocks");
  ok(ctx, bico_model_module_count(tgt, &nmod), "module_count");
  printf("target: %zu blocks under \"%s\", %zu modules\n", nblocks, prefix, nmod);
  int bad = nblocks != 5 || strcmp(prefix, "blocks") != 0;
  /* Each module: kind, block, widths, and the source module it pairs with
   * (by the depth map inside the blocks, by name outside them). */
  for (size_t i = 0; i < nmod; i++) {
    const char *name, *paired = "(none)";
    int kind;
    long block;
    size_t d_out = 0, d_in = 0, si;
    ok(ctx, bico_model_module(tgt, i, &name, &kind, &block, NULL), "module");
    bico_model_module_dims(tgt, i, &d_out, &d_in); /* BICO_E_ARG: no widths */
    if (bico_model_pair_module(tgt, i, src, &si) == BICO_OK)
      bico_model_module(src, si, &paired, NULL, NULL, NULL);
    printf("  %-17s %-11s block %2ld  [%2zu, %2zu]  <- %s\n", name,
           bico_model_module_kind_name(kind), block, d_out, d_in, paired);
    if (strstr(name, ".fc") && kind != BICO_MODULE_LINEAR) bad = 1;
    if (strstr(name, ".norm") && kind != BICO_MODULE_ELEMENTWISE) bad = 1;
  }
  /* Target block j takes source block round(j (2 - 1) / (5 - 1)). */
  char mapped[64];
  ok(ctx, bico_model_map_name(tgt, src, "blocks.3.mlp.fc1.weight", mapped,
                              sizeof mapped, NULL), "map_name");
  bad |= strcmp(mapped, "blocks.1.mlp.fc1.weight") != 0;

  /* The family (config.json's model_type) and the tied tensors: a token
   * table is carried by the map of the module it is tied to. */
  bico_transfer *t = NULL;
  ok(ctx, bico_transfer_create(ctx, &t), "transfer_create");
  ok(ctx, bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, a), "set_file");
  ok(ctx, bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, b), "set_file");
  ok(ctx, bico_transfer_explain(t), "transfer_explain");
  bico_transfer_model_info mi = {0};
  mi.size = sizeof mi; /* the fields this program knows of */
  ok(ctx, bico_transfer_explain_model(t, 1, &mi), "explain_model");
  printf("target family: %s (from %s)\n", mi.family, mi.family_from);
  bad |= strcmp(mi.family, "llama") != 0;
  size_t nt = 0;
  ok(ctx, bico_transfer_explain_count(t, &nt), "explain_count");
  for (size_t i = 0; i < nt; i++) {
    bico_transfer_decision dd = {0};
    dd.size = sizeof dd;
    ok(ctx, bico_transfer_explain_tensor(t, i, &dd), "explain_tensor");
    if (dd.role != BICO_ROLE_TOKEN) continue;
    printf("  %s is tied to %s (%s)\n", dd.name, dd.module ? dd.module : "-",
           dd.rule);
    bad |= dd.module == NULL || strcmp(dd.module, "blocks.0.norm") != 0;
  }
  bico_transfer_free(t);
  bico_model_free(src);
  bico_model_free(tgt);
  unlink(a);
  unlink(bw);
  unlink(bc);
  rmdir(b);
  rmdir(dir);
  bico_ctx_free(ctx);
  printf("model_graph: %s\n", bad ? "WRONG" : "ok");
  return bad;
}
