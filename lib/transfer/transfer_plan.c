/* The transfer driver's plan: checks of the setup before anything is
 * opened or written, and which target module's maps each target tensor
 * takes (pairing with the source, splits, ties and the stem rule). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib.h"
#include "family.h"
#include "fileio.h"
#include "transfer_internal.h"
#include "vocab.h"

static int ends_with_component(const char *name, const char *suffix) {
  size_t n = strlen(name), s = strlen(suffix);
  if (s > n || strcmp(name + n - s, suffix) != 0) return 0;
  return s == n || name[n - s - 1] == '.';
}

/* The user's split for a module, else its family's default (GPT-2's
 * fused c_attn: 3). */
static size_t split_for(const bico_transfer *t, int family,
                        const char *module) {
  for (size_t i = t->nsplits; i-- > 0;)
    if (ends_with_component(module, t->splits[i].suffix)) return t->splits[i].k;
  return bico__family_split(family, module);
}

bico_status bico__xfer_open_file(bico__run *r, int which, bico_stfile **f) {
  const char *path = r->t->files[which];
  if (path == NULL) return BICO_OK;
  bico_status st = bico_stfile_open(r->ctx, path, f);
  if (st == BICO_OK) st = bico__xfer_rename_source(r->t, which, *f);
  if (st != BICO_OK) return bico__xfer_wrap_file(r->ctx, st, which, path);
  return BICO_OK;
}

/* The module whose map carries a token tensor of the given width when the
 * user named none: the first module, in this order, whose map lives in the
 * space the token is added to:
 * 1. the stem: a linear module outside the blocks, of that output width,
 *    named embed/stem/patch (ViT's patch_embed.proj: cls_token, pos_embed);
 * 2. an element-wise module outside the blocks, of that width, named
 *    embed* (BERT's embeddings.LayerNorm reads the sum of the word,
 *    position and token-type embeddings): its norm map;
 * 3. the first element-wise module of the first block, by name, of that
 *    width (pre-norm decoders: Llama's model.layers.0.input_layernorm and
 *    GPT-2's h.0.ln_1 read the embeddings first): its norm map.
 * BICO__NONE when there is none: the token is left unchanged and the
 * report says so. */
static size_t default_tie(bico__run *r, const char *token, size_t width,
                          int *rule) {
  size_t elem_embed = BICO__NONE, first_block = BICO__NONE;
  long first_index = -1;
  /* A family with towers (CLIP) ties a token within its own tower. */
  size_t tower = bico__family_tower(r->kind[1], token);
  for (size_t m = 0; m < r->nm; m++) {
    const char *n;
    int kind;
    long block;
    bico_model_module(r->mt, m, &n, &kind, &block, NULL);
    if (tower > 0 && strncmp(n, token, tower) != 0) continue;
    size_t dout;
    bico_model_module_dims(r->mt, m, &dout, NULL);
    if (dout != width) continue;
    if (kind == BICO_MODULE_LINEAR && block < 0 &&
        (strstr(n, "embed") || strstr(n, "stem") || strstr(n, "patch"))) {
      *rule = BICO__TIE_STEM;
      return m;
    }
    if (kind != BICO_MODULE_ELEMENTWISE) continue;
    if (block < 0 && strstr(n, "embed") && elem_embed == BICO__NONE)
      elem_embed = m;
    if (block >= 0 &&
        (first_index < 0 || block < first_index ||
         (block == first_index &&
          strcmp(n, bico__xfer_mname(r->mt, first_block)) < 0))) {
      first_index = block;
      first_block = m;
    }
  }
  *rule = elem_embed != BICO__NONE    ? BICO__TIE_EMBED_NORM
          : first_block != BICO__NONE ? BICO__TIE_FIRST_NORM
                                      : BICO__TIE_NONE;
  return elem_embed != BICO__NONE ? elem_embed : first_block;
}

/* The tie module of target tensor ti (role TOKEN): explicit or default_tie. */
static bico_status tie_module(bico__run *r, size_t ti, size_t *mi,
                              int *rule) {
  const char *name = bico__xfer_tname(r->mt, ti);
  *mi = BICO__NONE;
  *rule = BICO__TIE_USER;
  for (size_t i = r->t->nties; i-- > 0;)
    if (strcmp(r->t->ties[i].tensor, name) == 0) {
      bico_status st = bico_model_find_module(r->mt, r->t->ties[i].module, mi);
      if (st != BICO_OK)
        return bico__fail(r->ctx, BICO_E_NOTFOUND,
                          "--tie %s=%s: the target has no module %s", name,
                          r->t->ties[i].module, r->t->ties[i].module);
      int kind;
      bico_model_module(r->mt, *mi, NULL, &kind, NULL, NULL);
      if (kind != BICO_MODULE_LINEAR && kind != BICO_MODULE_ELEMENTWISE)
        return bico__fail(r->ctx, BICO_E_ARG,
                          "--tie %s=%s: module %s is neither linear nor "
                          "element-wise, so it has no map",
                          name, r->t->ties[i].module, r->t->ties[i].module);
      return BICO_OK;
    }
  size_t ndim;
  const size_t *shape;
  bico_model_tensor(r->mt, ti, NULL, NULL, &ndim, &shape);
  *mi = default_tie(r, name, ndim ? shape[ndim - 1] : 0, rule);
  return BICO_OK;
}

/* Which module's maps each target tensor uses (BICO__NONE: none), and the
 * reference counts that free them after the last user. */
bico_status bico__xfer_plan(bico__run *r) {
  bico_ctx *ctx = r->ctx;
  size_t nt = bico__model_ntensors(r->mt);
  r->nm = 0;
  bico_status cs = bico_model_module_count(r->mt, &r->nm);
  if (cs != BICO_OK) return cs;
  r->mods = bico__calloc(ctx, r->nm ? r->nm : 1, sizeof *r->mods);
  r->owner = bico__alloc(ctx, (nt ? nt : 1) * sizeof *r->owner);
  r->tie_rule = bico__calloc(ctx, nt ? nt : 1, 1);
  if (r->mods == NULL || r->owner == NULL || r->tie_rule == NULL)
    return BICO_E_NOMEM;
  for (size_t m = 0; m < r->nm; m++) {
    size_t src;
    bico_status st = bico_model_pair_module(r->mt, m, r->ms, &src);
    if (st != BICO_OK && st != BICO_E_NOTFOUND) return st;
    r->mods[m].src = st == BICO_OK ? src : BICO__NONE;
    r->mods[m].k = split_for(r->t, r->kind[1], bico__xfer_mname(r->mt, m));
  }
  bico__clear(ctx);
  /* A split that matches no linear module is a typo worth stopping for. */
  for (size_t i = 0; i < r->t->nsplits; i++) {
    int hit = 0;
    for (size_t m = 0; m < r->nm && !hit; m++) {
      int kind;
      bico_model_module(r->mt, m, NULL, &kind, NULL, NULL);
      hit = kind == BICO_MODULE_LINEAR &&
            ends_with_component(bico__xfer_mname(r->mt, m), r->t->splits[i].suffix);
    }
    if (!hit)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "--split %s=%zu: no linear module of the target base "
                        "ends in %s",
                        r->t->splits[i].suffix, r->t->splits[i].k,
                        r->t->splits[i].suffix);
  }
  int bico = r->method == BICO_METHOD_BICO || r->method == BICO_METHOD_BICO_IN ||
             r->method == BICO_METHOD_BICO_OUT;
  for (size_t ti = 0; ti < nt; ti++) {
    r->owner[ti] = BICO__NONE;
    if (!bico) continue;
    size_t mi;
    int role, dtype;
    bico_status st = bico_model_tensor_module(r->mt, ti, &mi, &role);
    if (st != BICO_OK) return st;
    bico_model_tensor(r->mt, ti, NULL, &dtype, NULL, NULL);
    size_t owner = BICO__NONE;
    if (role == BICO_ROLE_WEIGHT || role == BICO_ROLE_BIAS ||
        role == BICO_ROLE_VECTOR)
      owner = mi;
    else if (role == BICO_ROLE_TOKEN) {
      int rule = BICO__TIE_NONE;
      if ((st = tie_module(r, ti, &owner, &rule)) != BICO_OK) return st;
      r->tie_rule[ti] = (unsigned char)rule;
    }
    if (owner != BICO__NONE && r->mods[owner].src == BICO__NONE) owner = BICO__NONE;
    r->owner[ti] = owner;
    if (owner != BICO__NONE) r->mods[owner].refs++;
  }
  /* Ties that name nothing, or a tensor that is not a token, are mistakes
   * worth stopping for. */
  for (size_t i = 0; i < r->t->nties; i++) {
    const bico__tie_rec *tie = &r->t->ties[i];
    size_t ti, mi;
    int role;
    if (bico_model_find_tensor(r->mt, tie->tensor, &ti) != BICO_OK)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "--tie %s=%s: the target base has no tensor %s",
                        tie->tensor, tie->module, tie->tensor);
    if (bico_model_find_module(r->mt, tie->module, &mi) != BICO_OK)
      return bico__fail(ctx, BICO_E_NOTFOUND,
                        "--tie %s=%s: the target base has no module %s",
                        tie->tensor, tie->module, tie->module);
    bico_model_tensor_module(r->mt, ti, NULL, &role);
    if (role != BICO_ROLE_TOKEN)
      return bico__fail(ctx, BICO_E_ARG,
                        "--tie %s=%s: %s is not a token or embedding tensor "
                        "(it is carried by its own module's maps)",
                        tie->tensor, tie->module, tie->tensor);
  }
  return BICO_OK;
}

/* Where the maps come from (BiCo methods): both calibration files, a
 * statistics file, or statistics lent from memory; or, for a run, a
 * bridge file instead of all of them. */
static bico_status check_statistics(bico__run *r) {
  bico_transfer *t = r->t;
  bico_ctx *ctx = r->ctx;
  const char *const *f = (const char *const *)t->files;
  int calib = f[BICO_FILE_SOURCE_CALIB] != NULL || f[BICO_FILE_TARGET_CALIB] != NULL;
  int lent = bico__xfer_mem_nxcov(t) > 0;
  if (f[BICO_FILE_BRIDGE] != NULL && (calib || f[BICO_FILE_STATS] || lent))
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: the bridge file holds the maps: %s "
                      "would not be read; drop it",
                      f[BICO_FILE_SOURCE_CALIB] ? "the source calib file"
                      : f[BICO_FILE_TARGET_CALIB] ? "the target calib file"
                      : f[BICO_FILE_STATS] ? "the stats file"
                                           : "the statistics held in memory");
  if (f[BICO_FILE_BRIDGE] != NULL) return BICO_OK;
  if (calib && (f[BICO_FILE_SOURCE_CALIB] == NULL ||
                f[BICO_FILE_TARGET_CALIB] == NULL))
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: missing the %s calib file (the source "
                      "calib file and the target calib file go together)",
                      f[BICO_FILE_SOURCE_CALIB] == NULL ? "source" : "target");
  /* Statistics lent from memory (bico_transfer_set_xcov) stand in for
   * both kinds of file. */
  if (calib ? f[BICO_FILE_STATS] != NULL : f[BICO_FILE_STATS] == NULL && !lent)
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: method %s needs either the source "
                      "calib file and the target calib file, or the stats "
                      "file%s",
                      bico_transfer_method_name(r->method),
                      calib ? ", not both"
                            : " (or, from a program using the library, "
                              "the statistics held in memory; or a bridge "
                              "file)");
  if (f[BICO_FILE_STATS] != NULL &&
      (t->param[BICO_TRANSFER_CENTER] != 0 || t->param[BICO_TRANSFER_WHITEN] > 0))
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: the %s parameter needs the source "
                      "calib file and the target calib file; the stats file "
                      "holds only the cross-covariances",
                      t->param[BICO_TRANSFER_CENTER] != 0 ? "center"
                                                          : "whiten");
  return BICO_OK;
}

/* Making a bridge (bico_transfer_bridge): the inputs of a BiCo transfer
 * without its fine-tune and outputs, and the bridge output. */
static bico_status check_bridge_setup(bico__run *r) {
  const char *const *f = (const char *const *)r->t->files;
  static const int NOT[] = {BICO_FILE_SOURCE_TUNED, BICO_FILE_TASK_VECTOR,
                            BICO_FILE_LORA,         BICO_FILE_TARGET_VOTES,
                            BICO_FILE_OUTPUT,       BICO_FILE_DELTA_OUTPUT,
                            BICO_FILE_LORA_OUTPUT,  BICO_FILE_REPORT,
                            BICO_FILE_BRIDGE};
  if (f[BICO_FILE_SOURCE_BASE] == NULL || f[BICO_FILE_TARGET_BASE] == NULL ||
      f[BICO_FILE_BRIDGE_OUTPUT] == NULL)
    return bico__fail(r->ctx, BICO_E_ARG, "transfer_run: missing the %s file",
                      f[BICO_FILE_SOURCE_BASE] == NULL   ? "source base"
                      : f[BICO_FILE_TARGET_BASE] == NULL ? "target base"
                                                         : "bridge output");
  for (size_t i = 0; i < sizeof NOT / sizeof *NOT; i++)
    if (f[NOT[i]] != NULL)
      return bico__fail(r->ctx, BICO_E_ARG,
                        "transfer_run: the %s file does not apply to making "
                        "a bridge (it holds the maps of the two bases, for "
                        "any fine-tune: give the %s file to the transfers "
                        "that read the bridge)",
                        bico_transfer_file_name(NOT[i]),
                        bico_transfer_file_name(NOT[i]));
  if (!bico__xfer_is_bico(r->method))
    return bico__fail(r->ctx, BICO_E_ARG,
                      "transfer_run: method %s solves no maps: a bridge "
                      "holds the maps of bico, bico-in or bico-out",
                      bico_transfer_method_name(r->method));
  return check_statistics(r);
}

bico_status bico__xfer_check_setup(bico__run *r) {
  bico_transfer *t = r->t;
  bico_ctx *ctx = r->ctx;
  const char *const *f = (const char *const *)t->files;
  int lora = f[BICO_FILE_LORA] != NULL, bridge = f[BICO_FILE_BRIDGE] != NULL;
  if (r->making_bridge) return check_bridge_setup(r);
  /* Files are named "the <slot> file" with the slot's name
   * (bico_transfer_file_name): a front end maps the phrase to its own
   * spelling of the option (tools/bico/transfer.c).  A bridge file names
   * the bases when the handle does not. */
  if (!bridge &&
      (f[BICO_FILE_SOURCE_BASE] == NULL || f[BICO_FILE_TARGET_BASE] == NULL))
    return bico__fail(ctx, BICO_E_ARG, "transfer_run: missing the %s file",
                      f[BICO_FILE_SOURCE_BASE] == NULL ? "source base"
                                                       : "target base");
  if (f[BICO_FILE_BRIDGE_OUTPUT] != NULL)
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: the bridge output file is written by "
                      "bico_transfer_bridge (`bico bridge`), not by a "
                      "transfer");
  if (bridge && !bico__xfer_is_bico(r->method))
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: method %s reads no maps; the bridge "
                      "file holds the maps of bico, bico-in or bico-out",
                      bico_transfer_method_name(r->method));
  if (lora) {
    if (f[BICO_FILE_SOURCE_TUNED] != NULL || f[BICO_FILE_TASK_VECTOR] != NULL)
      return bico__fail(ctx, BICO_E_ARG,
                        "transfer_run: the source adapter file replaces the "
                        "source tuned file and the task vector file; give "
                        "only one source of the task");
    if (f[BICO_FILE_DELTA_OUTPUT] != NULL)
      return bico__fail(ctx, BICO_E_ARG,
                        "transfer_run: the delta output file does not apply "
                        "to the source adapter file: the adapter written as "
                        "the output adapter file is the update");
    if (f[BICO_FILE_OUTPUT] == NULL && f[BICO_FILE_LORA_OUTPUT] == NULL)
      return bico__fail(ctx, BICO_E_ARG,
                        "transfer_run: the source adapter file needs the "
                        "output adapter file (the target's adapter), the "
                        "output file (the adapter merged into the target "
                        "base), or both");
  } else if (f[BICO_FILE_LORA_OUTPUT] != NULL) {
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: the output adapter file needs the "
                      "source adapter file");
  } else if (f[BICO_FILE_OUTPUT] == NULL) {
    return bico__fail(ctx, BICO_E_ARG, "transfer_run: missing the output file");
  } else if ((f[BICO_FILE_SOURCE_TUNED] == NULL) ==
             (f[BICO_FILE_TASK_VECTOR] == NULL)) {
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: give exactly one of the source tuned "
                      "file and the task vector file");
  }
  int bico = bico__xfer_is_bico(r->method);
  if (bico) {
    bico_status st = check_statistics(r);
    if (st != BICO_OK) return st;
  }
  if (r->method == BICO_METHOD_GRADFIX && lora &&
      t->param[BICO_TRANSFER_GRADFIX_MODE] == BICO_GRADFIX_MEAN)
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: gradfix mode mean needs votes with "
                      "their means held in memory; a LoRA transfer reads "
                      "the target votes file, which holds counts only");
  if (r->method == BICO_METHOD_GRADFIX && f[BICO_FILE_TARGET_VOTES] == NULL &&
      (bico__xfer_mem_nvotes(t) == 0 || lora))
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: method gradfix needs the target votes "
                      "file");
  /* A votes file with another method would be silently unread: the user
   * meant GradFix, or left an option from an earlier command. */
  if (r->method != BICO_METHOD_GRADFIX && f[BICO_FILE_TARGET_VOTES] != NULL)
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: the target votes file is read by method "
                      "gradfix only; method %s would ignore it: drop it or "
                      "choose gradfix",
                      bico_transfer_method_name(r->method));
  if (lora && t->strings[BICO_TRANSFER_SOURCE_RENAME] != NULL)
    return bico__fail(ctx, BICO_E_ARG,
                      "transfer_run: the source rename applies to "
                      "checkpoints, not to a LoRA adapter's module names");
  /* Outputs must be distinct from each other. */
  const int outs[3] = {BICO_FILE_OUTPUT, BICO_FILE_DELTA_OUTPUT, BICO_FILE_REPORT};
  for (int i = 0; i < 3; i++)
    for (int j = i + 1; j < 3; j++)
      if (f[outs[i]] && f[outs[j]] && strcmp(f[outs[i]], f[outs[j]]) == 0)
        return bico__fail(ctx, BICO_E_ARG,
                          "transfer_run: the %s file and the %s file are the "
                          "same path %s",
                          bico_transfer_file_name(outs[i]),
                          bico_transfer_file_name(outs[j]), f[outs[i]]);
  return BICO_OK;
}

/* Appends every file an open input reads (the shards of an index). */
static size_t add_shards(bico__fileuse *u, size_t n, const char *what,
                         const bico_stfile *f) {
  const char *last = NULL;
  size_t nt = bico__stfile_ntensors(f);
  for (size_t i = 0; i < nt; i++) {
    const char *p;
    if (bico_stfile_tensor_path(f, i, &p) != BICO_OK) continue;
    if (last != NULL && strcmp(p, last) == 0) continue;
    last = p;
    u[n++] = (bico__fileuse){what, p, 0, 0, 0};
  }
  return n;
}

/* Every input and output of the run compared by identity (lib/io/identity.c):
 * "ad/", "./ad", links and hard links are the same file; outputs must be
 * regular files in existing folders.  LoRA adapters count with both of
 * their files. */
bico_status bico__xfer_check_outputs(bico__run *r) {
  static const int ins[11] = {BICO_FILE_SOURCE_BASE,  BICO_FILE_SOURCE_TUNED,
                              BICO_FILE_TASK_VECTOR,  BICO_FILE_TARGET_BASE,
                              BICO_FILE_SOURCE_CALIB, BICO_FILE_TARGET_CALIB,
                              BICO_FILE_STATS,        BICO_FILE_TARGET_VOTES,
                              BICO_FILE_SOURCE_CONFIG,
                              BICO_FILE_TARGET_CONFIG, BICO_FILE_BRIDGE};
  static const int outs[4] = {BICO_FILE_OUTPUT, BICO_FILE_DELTA_OUTPUT,
                              BICO_FILE_REPORT, BICO_FILE_BRIDGE_OUTPUT};
  bico_ctx *ctx = r->ctx;
  const char *const *f = (const char *const *)r->t->files;
  bico_stfile *fs[11] = {r->sb, r->sft,   r->tv,    r->tb, r->sc, r->tc,
                         r->stats, r->votes, NULL, NULL, NULL};
  size_t cap = 52;
  for (int i = 0; i < 11; i++) cap += bico__stfile_ntensors(fs[i]);
  bico__fileuse *u = bico__alloc(ctx, cap * sizeof *u);
  char *lp[4] = {NULL, NULL, NULL, NULL}, *fo[4] = {NULL, NULL, NULL, NULL};
  const char *ld[2] = {f[BICO_FILE_LORA], f[BICO_FILE_LORA_OUTPUT]};
  for (int k = 0; k < 2; k++)
    if (ld[k] != NULL) {
      lp[2 * k] = bico__path_join(ctx, ld[k], "adapter_model.safetensors");
      lp[2 * k + 1] = bico__path_join(ctx, ld[k], "adapter_config.json");
    }
  bico_status st = u == NULL ? BICO_E_NOMEM : BICO_OK;
  for (int k = 0; k < 4; k++)
    if (ld[k / 2] != NULL && lp[k] == NULL) st = BICO_E_NOMEM;
  size_t n = 0;
  if (st == BICO_OK) {
    for (int i = 0; i < 11; i++) {
      if (f[ins[i]] == NULL) continue;
      const char *what = bico_transfer_file_name(ins[i]);
      u[n++] = (bico__fileuse){what, f[ins[i]], 0, 0, 0};
      /* a model folder (or the folder of an index): no output file in it */
      if (i < 8) u[n++] = (bico__fileuse){what, f[ins[i]], 0, 0, 3};
      if (fs[i] != NULL) n = add_shards(u, n, what, fs[i]);
    }
    static const char *const lw[4] = {
        "source adapter weights", "source adapter config",
        "output adapter weights", "output adapter config"};
    for (int k = 0; k < 4; k++)
      if (lp[k] != NULL) u[n++] = (bico__fileuse){lw[k], lp[k], k >= 2, 1, 0};
    if (ld[0] != NULL)
      u[n++] = (bico__fileuse){"source adapter", ld[0], 0, 0, 3};
    for (int o = 0; o < 4 && st == BICO_OK; o++) {
      if (f[outs[o]] == NULL) continue;
      /* an output folder: its weights file stands for it */
      int dir = o < 2 && bico_stwriter_output_is_folder(f[outs[o]],
                                               f[BICO_FILE_TARGET_BASE]);
      if (dir && (fo[o] = bico__path_join(ctx, f[outs[o]],
                                          "model.safetensors")) == NULL)
        st = BICO_E_NOMEM;
      else
        u[n++] = (bico__fileuse){bico_transfer_file_name(outs[o]),
                                 dir ? fo[o] : f[outs[o]], 1, dir, dir ? 2 : 0};
      /* ... and the folder itself: it may neither be nor hold any other
       * file of the run */
      if (dir && st == BICO_OK)
        u[n++] = (bico__fileuse){bico_transfer_file_name(outs[o]), f[outs[o]],
                                 1, 1, 1};
    }
    if (st == BICO_OK) st = bico__check_files(ctx, "transfer_run", u, n);
  }
  for (int k = 0; k < 4; k++) bico__free(ctx, fo[k]);
  for (int k = 0; k < 4; k++) bico__free(ctx, lp[k]);
  bico__free(ctx, u);
  return st;
}

void bico__xfer_route(const bico__run *r, size_t ti, bico__route *out) {
  memset(out, 0, sizeof *out);
  out->module = BICO__NONE;
  size_t mi;
  int role = BICO_ROLE_OTHER;
  bico_model_tensor_module(r->mt, ti, &mi, &role);
  out->role = role;
  if (role == BICO_ROLE_OTHER) {
    snprintf(out->reason, sizeof out->reason,
             "no method changes this kind of tensor");
    return;
  }
  size_t owner = r->owner[ti];
  if (owner == BICO__NONE) {
    snprintf(out->reason, sizeof out->reason, "%s",
             role == BICO_ROLE_TOKEN ? "no module is tied to it (see --tie)"
                                     : "its module has no partner in the "
                                       "source");
    return;
  }
  int do_in = r->method != BICO_METHOD_BICO_OUT;
  int do_out = r->method != BICO_METHOD_BICO_IN;
  out->module = owner;
  if (role == BICO_ROLE_WEIGHT) {
    out->kind = BICO__ROUTE_WEIGHT;
    out->need[0] = do_in;
    out->need[1] = do_out;
    /* An output head whose rows are the vocabulary (an untied lm_head):
     * its rows are tokens, the same token in both models, or matched by
     * token string when the tokenizers differ (r->vocab); never a map of
     * the vocabulary space, which identifies nothing a token's identity
     * does not already say (and would be V x V: 151936^2 floats for a
     * Qwen2 head).  Only the input map applies. */
    const char *wn;
    size_t nd;
    const size_t *sh;
    bico_model_tensor(r->mt, ti, &wn, NULL, &nd, &sh);
    if (bico__vocab_tensor(wn, nd, sh)) {
      out->need[1] = 0;
      out->tokens = 1;
      out->vocab = r->vocab != NULL;
    }
    return;
  }
  if (role == BICO_ROLE_BIAS) {
    out->kind = BICO__ROUTE_BIAS;
    out->need[1] = do_out;
    return;
  }
  /* A norm's vector by its norm map; a token by its tie module's output
   * map (an element-wise tie module lends its norm map). */
  int kind;
  bico_model_module(r->mt, owner, NULL, &kind, NULL, NULL);
  out->side = kind == BICO_MODULE_ELEMENTWISE
                  ? r->t->param[BICO_TRANSFER_NORM_MAP] == BICO_NORM_MAP_GRAD
                  : 1;
  out->identity = role == BICO_ROLE_TOKEN && kind == BICO_MODULE_LINEAR &&
                  !do_out;
  if (out->side == 1 && r->mods[owner].k != 1 && !out->identity) {
    snprintf(out->reason, sizeof out->reason,
             "its map's module %s has a split output",
             bico__xfer_mname(r->mt, owner));
    out->module = BICO__NONE;
    return;
  }
  out->kind = BICO__ROUTE_ROWS;
  out->need[out->side] = !out->identity;
  /* An element-wise module's "weight" is its scale (LayerNorm, RMSNorm):
   * an operator, not a vector; its "bias" and tokens are vectors. */
  const char *tname = NULL;
  bico_model_tensor(r->mt, ti, &tname, NULL, NULL, NULL);
  size_t len = tname ? strlen(tname) : 0;
  out->scale = role == BICO_ROLE_VECTOR && kind == BICO_MODULE_ELEMENTWISE &&
               (len == 6 ? strcmp(tname, "weight") == 0
                         : len > 6 && strcmp(tname + len - 7, ".weight") == 0);
}

/* Which sides of which module target tensor ti will ask for: the route,
 * for tensors with a source partner.  A wrong guess costs time, never
 * correctness: an unneeded job's result (or failure) is dropped, and a
 * side without a job is solved when asked. */
int bico__xfer_route_handling(const bico__route *rt) {
  switch (rt->kind) {
  case BICO__ROUTE_WEIGHT:
    return BICO__H_LINEAR;
  case BICO__ROUTE_BIAS:
    return BICO__H_VECTOR;
  case BICO__ROUTE_ROWS:
    return rt->role == BICO_ROLE_VECTOR ? BICO__H_VECTOR : BICO__H_TIED;
  default:
    return BICO__H_UNCHANGED;
  }
}

void bico__xfer_predict_sides(bico__run *r, size_t ti, size_t *mod,
                              int need[2]) {
  need[0] = need[1] = 0;
  *mod = BICO__NONE;
  bico__route rt;
  bico__xfer_route(r, ti, &rt);
  size_t si;
  if (rt.kind == BICO__ROUTE_NONE ||
      bico_model_pair_tensor(r->mt, ti, r->ms, &si) != BICO_OK)
    return;
  *mod = rt.module;
  need[0] = rt.need[0];
  need[1] = rt.need[1];
}

/* Which share of the target pairs with the source, by kind of tensor.  A
 * run that pairs (almost) nothing would write a copy of the target and
 * exit 0: the classic symptom of a source from another family or of
 * prefixes that differ (module., bert. against roberta.). */
bico_status bico__xfer_check_pairing(bico__run *r) {
  enum { K_WEIGHT, K_BIAS, K_NORM, K_TOKEN, K_OTHER, NK };
  static const char *const KIND[NK] = {"weights", "biases", "norm vectors",
                                       "tokens", "other"};
  size_t n[NK][2] = {{0}}, params = 0, paired_params = 0;
  const char *first_unpaired = NULL;
  size_t nt = bico__model_ntensors(r->mt);
  for (size_t ti = 0; ti < nt; ti++) {
    const char *name;
    int dtype, role;
    size_t ndim;
    const size_t *shape;
    bico_model_tensor(r->mt, ti, &name, &dtype, &ndim, &shape);
    if (!bico_dtype_is_float(dtype))
      continue;
    bico_model_tensor_module(r->mt, ti, NULL, &role);
    int k = role == BICO_ROLE_WEIGHT ? K_WEIGHT
            : role == BICO_ROLE_BIAS ? K_BIAS
            : role == BICO_ROLE_VECTOR ? K_NORM
            : role == BICO_ROLE_TOKEN ? K_TOKEN : K_OTHER;
    size_t numel = bico__xfer_numel(ndim, shape), si;
    int ok = bico_model_pair_tensor(r->mt, ti, r->ms, &si) == BICO_OK;
    n[k][0]++;
    n[k][1] += (size_t)ok;
    params += numel;
    if (ok) paired_params += numel;
    else if (first_unpaired == NULL) first_unpaired = name;
  }
  bico__clear(r->ctx);
  char by_kind[256] = "";
  size_t len = 0;
  for (int k = 0; k < NK; k++)
    if (n[k][0] && len < sizeof by_kind)
      len += (size_t)snprintf(by_kind + len, sizeof by_kind - len, "%s%s %zu/%zu",
                              len ? ", " : "", KIND[k], n[k][1], n[k][0]);
  double share = params ? (double)paired_params / (double)params : 1.0;
  bico__xfer_log(r, "bico: pairing: %.1f %% of the target's %zu parameters "
                 "have a source partner (%s)", 100.0 * share, params, by_kind);
  double need = r->t->param[BICO_TRANSFER_MIN_PAIRED];
  char offer[512] = "";
  if (params > 0 && paired_params < params)
    bico__xfer_prefix_offer(r, offer, sizeof offer);
  if (params > 0 && share < need)
    return bico__fail(r->ctx, BICO_E_NOTFOUND,
                      "only %.1f %% of the target's parameters pair with a "
                      "source tensor (%s; e.g. %s has no partner): the models "
                      "are of different families or their names differ by a "
                      "prefix; allow it with --allow-partial "
                      "(BICO_TRANSFER_MIN_PAIRED, now %g)%s",
                      100.0 * share, by_kind,
                      first_unpaired ? first_unpaired : "?", need, offer);
  if (offer[0]) bico__xfer_log(r, "bico: note: %s", offer + 2);
  bico__xfer_check_task_vector(r);
  return BICO_OK;
}

/* ---- The plan's costs (bico_transfer_plan's groups, progress) ---- */

/* Operations of solving one map from a [da, db] statistic (the Gram's
 * eigen- or singular value decomposition). */
static double solve_cost(size_t da, size_t db) {
  double m = (double)(da < db ? da : db);
  return (double)da * (double)db * m;
}

double bico__xfer_maps_cost(const bico__run *r, size_t m, const int need[2]) {
  size_t dob, dib, doa, dia;
  if (bico_model_module_dims(r->mt, m, &dob, &dib) != BICO_OK ||
      bico_model_module_dims(r->ms, r->mods[m].src, &doa, &dia) != BICO_OK) {
    bico__clear(r->ctx);
    return 0;
  }
  double c = 0;
  if (need[0]) c += solve_cost(dia, dib);
  if (need[1]) c += solve_cost(doa, dob);
  return c;
}

bico_status bico__xfer_tensor_costs(const bico__run *r, double *cost) {
  size_t nt = bico__model_ntensors(r->mt), nm = r->nm;
  int bico = bico__xfer_is_bico(r->method);
  int (*need)[2] = bico__calloc(r->ctx, nm + 1, sizeof *need);
  size_t *first = bico__alloc(r->ctx, (nm + 1) * sizeof *first);
  if (need == NULL || first == NULL) {
    bico__free(r->ctx, need);
    bico__free(r->ctx, first);
    return BICO_E_NOMEM;
  }
  for (size_t m = 0; m < nm; m++) first[m] = BICO__NONE;
  for (size_t ti = 0; ti < nt; ti++) {
    size_t ndim;
    const size_t *shape;
    bico_model_tensor(r->mt, ti, NULL, NULL, &ndim, &shape);
    cost[ti] = 4.0 * (double)bico__xfer_numel(ndim, shape) + 1;
    size_t m = r->owner[ti];
    if (!bico || m == BICO__NONE) continue;
    bico__route rt;
    bico__xfer_route(r, ti, &rt);
    need[m][0] |= rt.need[0];
    need[m][1] |= rt.need[1];
    if (first[m] == BICO__NONE) first[m] = ti;
  }
  for (size_t m = 0; m < nm; m++)
    if (first[m] != BICO__NONE) cost[first[m]] += bico__xfer_maps_cost(r, m, need[m]);
  bico__free(r->ctx, need);
  bico__free(r->ctx, first);
  return BICO_OK;
}
