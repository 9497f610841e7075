/* The transfer driver's private types (internal).
 *
 * bico_transfer_run is split by concept, one section below per file:
 *   transfer.c          the handle, its options, and the run's top level;
 *   transfer_plan.c     checks of the setup, which module's maps each target
 *                       tensor takes (pairing, ties, splits);
 *   transfer_maps.c     solving maps: on demand in the calling thread or
 *                       ahead of need in the solver pool;
 *   transfer_heads.c    structure-aware maps for decoder blocks (heads,
 *                       RoPE) when both families are known;
 *   transfer_mem.c      statistics and votes lent by the host
 *                       (bico_transfer_set_xcov, _set_votes);
 *   transfer_names.c    name diagnostics: the source rename, the prefix
 *                       offer, a checkpoint given as the task vector;
 *   transfer_update.c   the update of one tensor, by method and role, and
 *                       row tables streamed in pieces;
 *   transfer_output.c   the report entries, the output writers and the
 *                       partial-run sink;
 *   transfer_assemble.c the multi-process plan (groups, costs) and the
 *                       assembler;
 *   transfer_explain.c  bico_transfer_explain: the plan with its reasons.
 * The LoRA branch (lib/lora_transfer.c) reaches the run through the hook
 * of lora_internal.h.
 * A run's state (struct run) lives for one bico_transfer_run call. */
#ifndef BICO_TRANSFER_INTERNAL_H
#define BICO_TRANSFER_INTERNAL_H

#include <stdio.h>

#include "family.h"
#include "internal.h"
#include "lora_internal.h"
#include "report.h"

#define BICO__NONE SIZE_MAX
#define BICO__NFILES 16
#define BICO__NPARAMS 20
#define BICO__NSTRINGS 5

typedef struct bico__split_rec {
  char *suffix;
  size_t k;
} bico__split_rec;

typedef struct bico__tie_rec {
  char *tensor, *module;
} bico__tie_rec;

struct bico_transfer {
  bico_ctx *ctx;
  char *files[BICO__NFILES];
  double param[BICO__NPARAMS];
  char *strings[BICO__NSTRINGS];
  bico__split_rec *splits;
  size_t nsplits;
  bico__tie_rec *ties;
  size_t nties;
  bico_transfer_log_fn log;
  void *log_opaque;
  bico_progress_fn progress;
  void *progress_opaque;
  int ran;
  size_t updated, unchanged;
  unsigned char *select; /* partial runs: tensors to compute, or NULL */
  size_t nselect;
  bico_transfer_sink_fn sink;
  void *sink_opaque;
  /* bico_transfer_plan: tensors by group (plan_start: ng + 1 offsets) */
  int planned;
  size_t plan_nt, plan_ng;
  size_t *plan_tensors, *plan_start;
  double *plan_cost;
  struct bico__asm *as; /* the assembler, between begin and commit */
  struct bico__explain *ex; /* bico_transfer_explain's answers */
  struct bico__mem *mem; /* lent statistics and votes (transfer_mem.c) */
};

/* What each file slot is called in messages. */
extern const char *const bico__xfer_file_option[BICO__NFILES];

typedef struct bico__map {
  float *r; /* da x db; NULL before computed */
  size_t da, db, rank;
  int thin; /* solved from the calibration rows (thin solve) */
} bico__map;

/* Per target module: its source partner, its maps once solved. */
typedef struct bico__modstate {
  size_t src; /* paired source module or BICO__NONE */
  size_t k;   /* output split */
  int have_in, have_out;
  bico__map in;
  bico__map *out; /* k maps */
  size_t refs;    /* target tensors still to use the maps */
  size_t job[2];  /* solver pool job index + 1 per side, 0 = none */
} bico__modstate;

/* Short names of the public bico_handling (transfer.h holds the values,
 * bico_handling_name the words). */
#define BICO__H_UNCHANGED BICO_HANDLING_UNCHANGED
#define BICO__H_LINEAR BICO_HANDLING_LINEAR
#define BICO__H_VECTOR BICO_HANDLING_VECTOR
#define BICO__H_TIED BICO_HANDLING_TIED
#define BICO__H_NAIVE BICO_HANDLING_NAIVE
#define BICO__H_PADDED BICO_HANDLING_PADDED
#define BICO__H_MASKED BICO_HANDLING_MASKED
#define BICO__H_COUNT (BICO_HANDLING_MASKED + 1)

/* What happened to one tensor, for the report. */
typedef struct bico__tinfo {
  int handling;
  const char *source; /* source tensor name or NULL */
  char reason[256];
  const bico__map *maps[2]; /* in/out (or the one map used) */
  const char *map_names[2];
  const bico__map *split_maps; /* k output maps of a split module */
  size_t nsplit;
  double kept; /* GradFix kept fraction; < 0 when none */
  double norm;
  int vocab;    /* rows matched by token string (lib/vocab.c) */
  size_t vocab_shared, vocab_new;
} bico__tinfo;

struct bico__pool;

typedef struct bico__run {
  bico_transfer *t;
  bico_ctx *ctx;
  int method;
  float alpha;
  bico_stfile *sb, *sft, *tv, *tb, *sc, *tc, *stats, *votes;
  bico_model *ms, *mt;
  bico_procrustes *proc;
  bico__modstate *mods;
  size_t nm;
  size_t *owner; /* per target tensor: the module whose maps it uses */
  bico_stwriter *w, *wd;
  bico__report rep;
  size_t count[BICO__H_COUNT];
  struct bico__pool *pool; /* solver threads, or NULL */
  /* Structure-aware maps (transfer_heads.c): both models' families, where
   * each came from (for messages), and the layers' maps being handed out. */
  bico__family fam[2];
  char fam_path[2][512];
  int structure_on;
  struct bico__hcache *hc;
  /* Naming families (lib/family_names.c: storage layout, towers, splits) of source and target, and what decided
   * them. */
  int kind[2];
  char kind_why[2][192];
  struct bico__vocab *vocab; /* token rows by token string, or NULL */
  unsigned char *tie_rule;   /* per target tensor: bico__tie_rule */
} bico__run;

/* Which rule tied a token to its module (bico__xfer_plan). */
enum bico__tie_rule {
  BICO__TIE_NONE = 0,
  BICO__TIE_USER,        /* --tie */
  BICO__TIE_STEM,        /* linear stem outside the blocks */
  BICO__TIE_EMBED_NORM,  /* element-wise embed* module outside the blocks */
  BICO__TIE_FIRST_NORM   /* first element-wise module of the first block */
};

/* Target tensor index i as the target base's file holds it
 * (transfer_output.c's bico__xfer_locate; streamed by transfer_update.c). */
typedef struct bico__xfer_tensor {
  const char *name;
  int dtype, fl; /* fl: a floating-point dtype */
  size_t ndim, nb, fi;
  const size_t *shape;
} bico__xfer_tensor;

/* ---- transfer.c ---- */
void bico__xfer_run_init(bico__run *r, bico_transfer *t);
/* Everything before the first tensor: checks, inputs, models, the solver,
 * the plan. */
bico_status bico__xfer_setup(bico__run *r);
void bico__xfer_run_free(bico__run *r);
/* The source and target models with their families and block
 * containers. */
bico_status bico__xfer_load_models(bico__run *r);

/* ---- transfer_plan.c ---- */
void bico__xfer_log(bico__run *r, const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Prefixes ctx's message with context ("tensor X: ...") unless it names
 * `name` already. */
bico_status bico__xfer_wrap(bico_ctx *ctx, bico_status st, const char *what,
                            const char *name);
const char *bico__xfer_tname(const bico_model *m, size_t i);
const char *bico__xfer_mname(const bico_model *m, size_t i);
size_t bico__xfer_numel(size_t ndim, const size_t *shape);
int bico__xfer_is_bico(int method);
bico_status bico__xfer_open_file(bico__run *r, int which, bico_stfile **f);
bico_status bico__xfer_check_setup(bico__run *r);
bico_status bico__xfer_check_outputs(bico__run *r);
bico_status bico__xfer_plan(bico__run *r);
/* Counts which target tensors pair with a source tensor, logs the summary
 * and fails when too few parameters pair (BICO_TRANSFER_MIN_PAIRED). */
bico_status bico__xfer_check_pairing(bico__run *r);
/* Role dispatch: which maps carry target tensor ti (after
 * bico__xfer_plan; BiCo methods). */
void bico__xfer_route(const bico__run *r, size_t ti, bico__route *out);
/* Which sides of which module target tensor ti will ask for (the pool
 * solves them ahead). */
void bico__xfer_predict_sides(bico__run *r, size_t ti, size_t *mod,
                              int need[2]);

/* ---- transfer_maps.c ---- */
void bico__xfer_free_maps(bico__run *r, bico__modstate *s);
/* Drops target tensor ti's reference to its maps (freed after the last). */
void bico__xfer_release(bico__run *r, size_t ti);
bico_status bico__xfer_pool_start(bico__run *r, const unsigned char *select);
void bico__xfer_pool_stop(bico__run *r);
/* Makes the maps of one side of target module mi available in r->mods. */
bico_status bico__xfer_need_side(bico__run *r, size_t mi, int side);

/* ---- transfer_heads.c ---- */
/* Reads the families (config.json beside a folder model, or given; the
 * overrides) and decides whether structure-aware maps are on. */
bico_status bico__xfer_families(bico__run *r);
/* 1 when side `side` of target module mi takes a structure-aware map. */
int bico__xfer_structured(const bico__run *r, size_t mi, int side);
/* That map (one, in a new array), solved with its layer in the calling
 * thread; *fallback 1 (and no map) when the layer has no structured form
 * (the caller solves the free-form map). */
bico_status bico__xfer_struct_solve(bico__run *r, size_t mi, int side,
                                    bico__map **out, int *fallback);
void bico__xfer_heads_free(bico__run *r);

/* ---- transfer_mem.c ---- */
void bico__xfer_mem_free(bico_transfer *t);
size_t bico__xfer_mem_nxcov(const bico_transfer *t);
size_t bico__xfer_mem_nvotes(const bico_transfer *t);
/* The accumulators lent for one side of a module: their count (0: none). */
size_t bico__xfer_mem_xcov(const bico_transfer *t, const char *module,
                           int side, const bico_xcov *const **blocks);
const bico_votes *bico__xfer_mem_votes(const bico_transfer *t,
                                       const char *tensor);

/* ---- transfer_names.c ---- */
/* The source rename applied to an opened input (`which` a BICO_FILE_*;
 * only the source's files are renamed); the prefix offer for a pairing
 * message (buf gets "" or "; the names differ by a prefix: ..."); the
 * warning (logged) for a checkpoint given as the task vector. */
bico_status bico__xfer_rename_source(const bico_transfer *t, int which,
                                     bico_stfile *f);
void bico__xfer_prefix_offer(bico__run *r, char *buf, size_t cap);
void bico__xfer_check_task_vector(bico__run *r);

/* ---- transfer_update.c ---- */
/* The update alpha tau_B of target tensor ti into upd (its numel floats),
 * or info->handling BICO__H_UNCHANGED with a reason. */
bico_status bico__xfer_update(bico__run *r, size_t ti, float *upd,
                              bico__tinfo *info);
/* The one step that carries a tensor by its route (BiCo methods), for the
 * checkpoint path and the LoRA branch's saved tensors alike: task vector
 * *tau (source tensor si's shape, allocated in r->ctx; replaced when its
 * rows are gathered by token) of target tensor ti by route rt (weight,
 * bias or rows, transposed layouts, vocabulary rows, the dead-map rule)
 * into upd (ti's numel floats), or info->handling BICO__H_UNCHANGED with
 * info->reason (upd then means nothing). */
bico_status bico__xfer_carry(bico__run *r, size_t ti, size_t si,
                             const bico__route *rt, float **tau, float *upd,
                             bico__tinfo *info);
/* 1 when the rows of target tensor ti and source tensor si are tokens to
 * be matched by id or token string rather than taken in order (token
 * tables or vocabulary heads, tokenizers or row counts differing). */
int bico__xfer_token_rows(const bico__run *r, size_t ti, size_t si);
/* Streams target tensor ti when it is a table of rows carried row by row
 * (a tied embedding): its update computed, added and written (r->w, r->wd)
 * piece by piece, *streamed 1 and info filled.  *streamed 0: not such a
 * tensor (or a check the whole-tensor path reports failed); nothing done. */
bico_status bico__xfer_stream_rows(bico__run *r, size_t ti,
                                   const bico__xfer_tensor *a,
                                   bico__tinfo *info, int *streamed);

/* ---- transfer_output.c ---- */
bico_status bico__xfer_locate(bico_ctx *ctx, const bico_stfile *tb, size_t i,
                              bico__xfer_tensor *x);
/* The writer for an output path: a model folder when
 * bico_output_is_folder says so (like the target, sharded by
 * BICO_TRANSFER_MAX_SHARD_SIZE), else a file. */
bico_status bico__xfer_writer(const bico_transfer *t, const char *path,
                              bico_stwriter **w);
/* Creates the output (and delta output, when wd) writers with every
 * tensor of tb declared, in its order. */
bico_status bico__xfer_declare(const bico_transfer *t, const bico_stfile *tb,
                               bico_stwriter **w, bico_stwriter **wd);
/* Writes one tensor: theta_B + upd (upd NULL: the base's bytes), and upd
 * (or zeros) to wd; *norm gets ||upd||. */
bico_status bico__xfer_write_one(bico_ctx *ctx, const bico_stfile *tb,
                                 const bico__xfer_tensor *x, bico_stwriter *w,
                                 bico_stwriter *wd, const float *upd,
                                 double *norm);
/* The report around the tensors' entries. */
void bico__xfer_report_head(bico__report *rep, int method, float alpha);
void bico__xfer_report_tail(bico__report *rep, const size_t *count);
/* The same with the vocabulary map's counts in the summary (vocab may be
 * NULL). */
void bico__xfer_report_tail_vocab(bico__report *rep, const size_t *count,
                                  const struct bico__vocab *vocab);
/* Report to its temporary, then wd, w, then the report's rename. */
bico_status bico__xfer_commit(bico_ctx *ctx, const bico__report *rep,
                              const char *report, bico_stwriter *w,
                              bico_stwriter *wd);
bico_status bico__xfer_report_tensor(bico__report *rep, const bico_model *mt,
                                     size_t ti, const bico__tinfo *info);
bico_status bico__xfer_write_all(bico__run *r);
/* (bico__xfer_check_finite and _f64 are declared in lora_internal.h.) */

/* ---- transfer_assemble.c ---- */
void bico__xfer_plan_clear(bico_transfer *t);
void bico__xfer_asm_free(bico_transfer *t);
/* Each target tensor's share of the plan's cost: its elements, and a
 * module's map solves on its first tensor. */
bico_status bico__xfer_tensor_costs(const bico__run *r, double *cost);

/* ---- transfer_explain.c ---- */
void bico__xfer_explain_free(bico_transfer *t);

#endif
