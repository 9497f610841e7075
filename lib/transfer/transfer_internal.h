/* The transfer driver's private types (internal).
 *
 * bico_transfer_run is split by concept into layers; a file calls only
 * files listed below it (no cycle: checked from the object files), and
 * each section below declares what the file it names defines:
 *   transfer.c          the driver: the handle, its options,
 *                       bico_transfer_run and the LoRA branch's hand-over;
 *   transfer_bridge.c   making a bridge file (bico_transfer_bridge): every
 *                       map of the plan solved and written;
 *   lora_transfer.c     the LoRA route: an adapter's factors carried by the
 *                       maps; its saved tensors by bico__xfer_carry;
 *   transfer_assemble.c the multi-process plan (groups, costs) and the
 *                       assembler (bico_transfer_plan, _assemble_*);
 *   transfer_explain.c  bico_transfer_explain: the plan with its reasons;
 *   transfer_setup.c    a run's life: init, setup (checks, inputs, models,
 *                       solver, families, vocabulary, plan), free;
 *   transfer_output.c   the report entries, the output writers and the
 *                       partial-run sink;
 *   transfer_update.c   the update of one tensor, by method and role (the
 *                       one "carry this tensor by its route" step), and
 *                       row tables streamed in pieces;
 *   transfer_maps.c     solving maps: on demand in the calling thread or
 *                       ahead of need in the solver pool (or read from a
 *                       bridge file);
 *   bridge_file.c       reading a bridge file: its options adopted or
 *                       compared, the bases' fingerprints and the plan
 *                       verified, its maps loaded; what a bridge records;
 *   transfer_plan.c     checks of the setup, which module's maps each target
 *                       tensor takes (pairing, ties, splits, routes), and
 *                       the plan's costs;
 *   transfer_heads.c    structure-aware maps for decoder blocks (heads,
 *                       RoPE) when both families are known;
 *   transfer_names.c    the parameters' names and bounds; name
 *                       diagnostics: the source rename, the prefix
 *                       offer, a checkpoint given as the task vector;
 *   transfer_mem.c      statistics and votes lent by the host
 *                       (bico_transfer_set_xcov, _set_votes);
 *   transfer_base.c     what every step uses: the log line, error
 *                       wrapping, tensor and module names (the names of
 *                       file slots, methods and handlings are
 *                       lib/base/names.c's public functions).
 * The handle (struct bico_transfer) holds the options (set before a run)
 * and what outlives a run, each part owned and freed by one file: the
 * counts (transfer.c), the multi-process plan and assembler
 * (transfer_assemble.c), the explain answers (transfer_explain.c) and the
 * lent statistics (transfer_mem.c).  A run's state (struct bico__run)
 * lives for one bico_transfer_run, _plan or _explain call
 * (transfer_setup.c). */
#ifndef BICO_TRANSFER_INTERNAL_H
#define BICO_TRANSFER_INTERNAL_H

#include <stdio.h>

#include "family.h"
#include "internal.h"
#include "report.h"

#define BICO__NONE SIZE_MAX
#define BICO__NFILES 18
#define BICO__NPARAMS 21
#define BICO__NSTRINGS 5

typedef struct bico__split_rec {
  char *suffix;
  size_t k;
} bico__split_rec;

typedef struct bico__tie_rec {
  char *tensor, *module;
} bico__tie_rec;

/* The multi-process plan (bico_transfer_plan; transfer_assemble.c):
 * target tensors by group, start holding ng + 1 offsets. */
typedef struct bico__xfer_groups {
  int planned;
  size_t nt, ng;
  size_t *tensors, *start;
  double *cost;
} bico__xfer_groups;

struct bico_transfer {
  bico_ctx *ctx;
  /* The options (transfer.c's setters), read by every step. */
  char *files[BICO__NFILES];
  double param[BICO__NPARAMS];
  unsigned char pset[BICO__NPARAMS]; /* set with bico_transfer_set_param
                                        (a bridge's options apply to the
                                        others) */
  char *strings[BICO__NSTRINGS];
  bico__split_rec *splits;
  size_t nsplits;
  bico__tie_rec *ties;
  size_t nties;
  bico_transfer_log_fn log;
  void *log_opaque;
  bico_progress_fn progress;
  void *progress_opaque;
  unsigned char *select; /* partial runs: tensors to compute, or NULL */
  size_t nselect;
  bico_transfer_sink_fn sink;
  void *sink_opaque;
  /* What outlives a run: the last run's counts (bico_transfer_counts;
   * set where a run's outputs are committed), then parts each owned and
   * freed by one file. */
  int ran;
  size_t updated, unchanged;
  bico__xfer_groups plan;   /* transfer_assemble.c */
  struct bico__asm *as;     /* the assembler, between begin and commit
                               (transfer_assemble.c) */
  struct bico__explain *ex; /* bico_transfer_explain's answers
                               (transfer_explain.c) */
  struct bico__mem *mem;    /* lent statistics and votes (transfer_mem.c) */
};

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

/* The public bico_transfer_handling values (0 is none: index 0 of the
 * per-handling counts is unused; bico_transfer_handling_name the words). */
enum bico__handling {
  BICO__H_UNCHANGED = BICO_HANDLING_UNCHANGED,
  BICO__H_LINEAR = BICO_HANDLING_LINEAR,
  BICO__H_VECTOR = BICO_HANDLING_VECTOR,
  BICO__H_TIED = BICO_HANDLING_TIED,
  BICO__H_NAIVE = BICO_HANDLING_NAIVE,
  BICO__H_PADDED = BICO_HANDLING_PADDED,
  BICO__H_MASKED = BICO_HANDLING_MASKED,
  BICO__H_FIRST = BICO__H_UNCHANGED,
  BICO__H_COUNT = BICO__H_MASKED + 1
};

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
  int vocab;    /* rows matched by token string (lib/model/vocab.c) */
  size_t vocab_shared, vocab_new;
} bico__tinfo;

/* Which maps carry target tensor ti (role dispatch, BiCo methods): the
 * one rule the whole-model driver, its solver pool and the LoRA route
 * follow (bico__xfer_route). */
enum bico__route_kind {
  BICO__ROUTE_NONE = 0, /* left unchanged: `reason` says why */
  BICO__ROUTE_WEIGHT,   /* R_out^T tau R_in with module's maps */
  BICO__ROUTE_BIAS,     /* R_out^T b, block-wise for a split output */
  BICO__ROUTE_ROWS      /* each row along its last dimension by one map */
};
typedef struct bico__route {
  int kind;        /* bico__route_kind */
  int role;        /* the tensor's bico_role */
  size_t module;   /* target module whose maps carry it */
  int need[2];     /* sides it asks for: 0 input map, 1 output map(s) */
  int side;        /* ROWS: the side of the one map */
  int identity;    /* ROWS: the method leaves that side alone (no map) */
  int vocab;       /* rows matched by token string (lib/model/vocab.c) */
  int tokens;      /* WEIGHT: a vocabulary head (rows are tokens: no
                      output map) */
  int scale;       /* ROWS: a norm's scale, an operator diag(g): moved as
                      diag(R^T diag(tau) R) = (R o R)^T tau, not R^T tau */
  char reason[192];
} bico__route;


struct bico__pool;
typedef struct bico__bridge bico__bridge;
/* The format of bridge files this library writes and reads (metadata
 * "bico.bridge"). */
#define BICO__BRIDGE_FORMAT "1"
/* The metadata key of a bridge's digest (docs/formats.md, "Bridge
 * files"): 64 hexadecimal digits; bridges made before it lack it. */
#define BICO__BRIDGE_DIGEST_KEY "bico.bridge.sha256"

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
  /* Both models' config.json as read once (lib/model/family.c, by
   * bico__xfer_load_models) and where each came from (for messages); the
   * structure-aware maps (transfer_heads.c) check their geometry and hand
   * out the layers' maps. */
  bico__family fam[2];
  char fam_path[2][512];
  int structure_on;
  struct bico__hcache *hc;
  /* Naming kinds (lib/model/family.c: storage layout, towers, splits) of source
   * and target, and what decided them. */
  int kind[2];
  char kind_why[2][192];
  struct bico__vocab *vocab; /* token rows by token string, or NULL */
  unsigned char *tie_rule;   /* per target tensor: bico__tie_rule */
  /* Bridges: the one a run reads its maps from (bridge_file.c), or making
   * one (bico_transfer_bridge: the setup's rules are a bridge's). */
  bico__bridge *bridge;
  int making_bridge;
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
/* (only public entry points) */

/* ---- transfer_bridge.c ---- */
/* Solves every map the set-up run r plans and writes the bridge file. */
bico_status bico__bridge_write(bico__run *r);

/* ---- lora_transfer.c ---- */
/* The LoRA route of a planned run (the source adapter set): the output
 * adapter, checkpoint and report as the options name them; *updated gets
 * the target tensors that received an update. */
bico_status bico__lora_transfer_run(bico__run *r, size_t *updated);

/* ---- transfer_assemble.c ---- */
void bico__xfer_plan_clear(bico_transfer *t);
void bico__xfer_asm_free(bico_transfer *t);

/* ---- transfer_explain.c ---- */
void bico__xfer_explain_free(bico_transfer *t);

/* ---- transfer_setup.c ---- */
void bico__xfer_run_init(bico__run *r, bico_transfer *t);
/* Everything before the first tensor: checks, inputs, models, the solver,
 * the plan. */
bico_status bico__xfer_setup(bico__run *r);
void bico__xfer_run_free(bico__run *r);
/* The source and target models with their families and block
 * containers. */
bico_status bico__xfer_load_models(bico__run *r);

/* ---- transfer_output.c ---- */
/* Every value the driver writes is finite: BICO_E_NONFINITE naming `what`
 * ("tensor", "adapter module", ...) `name` and the first bad element of
 * v[0..n) otherwise. */
bico_status bico__xfer_check_finite(bico_ctx *ctx, const float *v, size_t n,
                                    const char *what, const char *name);
bico_status bico__xfer_check_finite_f64(bico_ctx *ctx, const double *v,
                                        size_t n, const char *what,
                                        const char *name);
bico_status bico__xfer_locate(bico_ctx *ctx, const bico_stfile *tb, size_t i,
                              bico__xfer_tensor *x);
/* The writer for an output path: a model folder when
 * bico_stwriter_output_is_folder says so (like the target, sharded by
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
/* The report around the tensors' entries; the tail's summary has the
 * vocabulary map's counts (vocab may be NULL). */
void bico__xfer_report_head(bico__report *rep, int method, float alpha);
void bico__xfer_report_tail_vocab(bico__report *rep, const size_t *count,
                                  const struct bico__vocab *vocab);
/* Report to its temporary, then wd, w, then the report's rename. */
bico_status bico__xfer_commit(bico_ctx *ctx, const bico__report *rep,
                              const char *report, bico_stwriter *w,
                              bico_stwriter *wd);
bico_status bico__xfer_report_tensor(bico__report *rep, const bico_model *mt,
                                     size_t ti, const bico__tinfo *info);
/* Every target tensor: updated and written (or handed to the sink), the
 * report and the commit. */
bico_status bico__xfer_write_all(bico__run *r);

/* ---- transfer_update.c ---- */
/* The update alpha tau_B of target tensor ti into upd (its numel floats),
 * or info->handling BICO__H_UNCHANGED with a reason. */
bico_status bico__xfer_update(bico__run *r, size_t ti, float *upd,
                              bico__tinfo *info);
/* The one step that carries a tensor by its route (BiCo methods), for the
 * checkpoint path and the LoRA route's saved tensors alike: task vector
 * *tau (source tensor si's shape, allocated in r->ctx; replaced when its
 * rows are gathered by token) of target tensor ti by route rt (weight,
 * bias or rows, transposed layouts, vocabulary rows, the dead-map rule)
 * into upd (ti's numel floats), or info->handling BICO__H_UNCHANGED with
 * info->reason (upd then means nothing). */
bico_status bico__xfer_carry(bico__run *r, size_t ti, size_t si,
                             const bico__route *rt, float **tau, float *upd,
                             bico__tinfo *info);
/* naive, pad or gradfix (the run's method) on task vector tau (source
 * tensor si's shape; a checkpoint's or the LoRA route's dense update) of
 * target tensor ti into upd (ti's numel floats), with the votes lent or
 * read for ti; info gets the handling, source and GradFix's kept
 * fraction. */
bico_status bico__xfer_elementwise(bico__run *r, size_t ti, size_t si,
                                   const float *tau, float *upd,
                                   bico__tinfo *info);
/* The dead-map rule, one for every path that carries a tensor by its maps
 * (bico__xfer_carry and the LoRA route's factors): a map fitted on an
 * all-zero statistic (rank 0: no activation or no gradient reached the
 * layer) identifies nothing, and its completion would move the update
 * arbitrarily, so what it would carry is left unchanged.  Returns 1 and
 * writes the reason, naming the map's side ("in" or "out"), into
 * reason[cap] when rank is 0. */
int bico__map_dead(size_t rank, const char *side, char *reason, size_t cap);
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

/* ---- transfer_maps.c ---- */
void bico__xfer_free_maps(bico__run *r, bico__modstate *s);
/* Drops target tensor ti's reference to its maps (freed after the last). */
void bico__xfer_release(bico__run *r, size_t ti);
bico_status bico__xfer_pool_start(bico__run *r, const unsigned char *select);
void bico__xfer_pool_stop(bico__run *r);
/* Makes the maps of one side of target module mi available in r->mods. */
bico_status bico__xfer_need_side(bico__run *r, size_t mi, int side);

/* ---- bridge_file.c ---- */
/* Opens the bridge file the handle names (none: nothing to do) and takes
 * its options and files for what the handle leaves unset, comparing the
 * rest; r->method follows.  bico__bridge_end gives the handle back as it
 * was (run_free calls it). */
bico_status bico__bridge_begin(bico__run *r);
void bico__bridge_end(bico__run *r);
/* After the plan: both bases' fingerprints and the plan against the
 * bridge's (BICO_E_ARG naming the file and what differs); then one pass
 * over the maps and ranks: their ranges and the bridge's digest
 * (BICO_E_FORMAT naming the file, the tensor and the element). */
bico_status bico__bridge_verify(bico__run *r);
/* The open bridge file (NULL without one), for the check that it is
 * unchanged before a commit. */
const bico_stfile *bico__bridge_file(const bico__run *r);
/* The maps of one side of target module mi, read from the bridge (k of
 * them for a split output), into a new array (*out). */
bico_status bico__bridge_load(bico__run *r, size_t mi, int side,
                              bico__map **out);
/* What a bridge records (transfer_bridge.c writes them): the options that
 * shape the maps, the plan (per target tensor [name, source, handling,
 * module, maps]), a base's fingerprint (side 0 source, 1 target: its
 * weights with the config.json and tokenizer.json the run reads), and the
 * map tensors' names ("<module>:in", "<module>:out", ":rank" added for
 * their ranks). */
void bico__bridge_options(const bico_transfer *t, bico__jw *w);
void bico__bridge_plan(const bico__run *r, bico__jw *w);
bico_status bico__bridge_fingerprint(bico__run *r, int side, char hex[65]);
void bico__bridge_key(char *buf, size_t cap, const char *module, int side,
                      int rank);
/* The digest (metadata BICO__BRIDGE_DIGEST_KEY), made by the writer as
 * it writes and by the reader in its one pass: begun with the description
 * (metadata "bico.bridge.json"), then per entry of the description's maps
 * the map tensor and then its rank tensor, each as its name and byte size
 * (_tensor) followed by its values as stored, little-endian (_f32 for a
 * map, _f64 for ranks; any number of calls). */
struct bico__sha256;
void bico__bridge_digest_begin(struct bico__sha256 *h, const char *desc);
void bico__bridge_digest_tensor(struct bico__sha256 *h, const char *name,
                                size_t nbytes);
void bico__bridge_digest_f32(struct bico__sha256 *h, const float *x,
                             size_t n);
void bico__bridge_digest_f64(struct bico__sha256 *h, const double *x,
                             size_t n);

/* ---- transfer_plan.c ---- */
bico_status bico__xfer_open_file(bico__run *r, int which, bico_stfile **f);
/* Every file the run reads a tensor at a time (the bases, the tuned
 * source, the statistics, calibration and votes files, the bridge) is
 * still the file it opened (bico_stfile_check_unchanged): checked before
 * the commit, so that an input rewritten during the run never gives an
 * output of two versions.  BICO_E_IO naming the file otherwise. */
bico_status bico__xfer_check_unchanged(bico__run *r);
bico_status bico__xfer_check_setup(bico__run *r);
bico_status bico__xfer_check_outputs(bico__run *r);
bico_status bico__xfer_plan(bico__run *r);
/* Counts which target tensors pair with a source tensor, logs the summary
 * and fails when too few parameters pair (BICO_TRANSFER_MIN_PAIRED). */
bico_status bico__xfer_check_pairing(bico__run *r);
/* Role dispatch: which maps carry target tensor ti (after
 * bico__xfer_plan; BiCo methods). */
void bico__xfer_route(const bico__run *r, size_t ti, bico__route *out);
/* The handling (bico_transfer_handling) a tensor carried by route rt
 * gets: linear (WEIGHT), vector (BIAS, or ROWS of a vector), tied (ROWS of
 * a token table); unchanged for no route.  The one rule for the checkpoint
 * path, the LoRA route's factors, bico_transfer_explain and bridges. */
int bico__xfer_route_handling(const bico__route *rt);
/* Which sides of which module target tensor ti will ask for (the pool
 * solves them ahead). */
void bico__xfer_predict_sides(bico__run *r, size_t ti, size_t *mod,
                              int need[2]);
/* The operations of solving the maps of module m's sides need[0] (input)
 * and need[1] (output). */
double bico__xfer_maps_cost(const bico__run *r, size_t m, const int need[2]);
/* Each target tensor's share of the plan's cost: its elements, and a
 * module's map solves on its first tensor. */
bico_status bico__xfer_tensor_costs(const bico__run *r, double *cost);

/* ---- transfer_heads.c ---- */
/* Checks the families' attention geometry (r->fam, read by
 * bico__xfer_load_models; the overrides) and decides whether
 * structure-aware maps are on. */
bico_status bico__xfer_families(bico__run *r);
/* The config.json of one side: the file given as which_cfg
 * (BICO_FILE_*_CONFIG), else <which_base>/config.json when that base is a
 * folder holding one; *out NULL when neither (freed by the caller). */
bico_status bico__xfer_config_path(bico__run *r, int which_cfg,
                                   int which_base, char **out);
/* 1 when side `side` of target module mi takes a structure-aware map. */
int bico__xfer_structured(const bico__run *r, size_t mi, int side);
/* That map (one, in a new array), solved with its layer in the calling
 * thread; *fallback 1 (and no map) when the layer has no structured form
 * (the caller solves the free-form map). */
bico_status bico__xfer_struct_solve(bico__run *r, size_t mi, int side,
                                    bico__map **out, int *fallback);
void bico__xfer_heads_free(bico__run *r);

/* ---- transfer_names.c ---- */
/* Each bico_transfer_param's name and accepted set (params.h's grammar):
 * bico_transfer_set_param's, and the bounds a bridge's recorded options
 * are checked against. */
extern const bico__param_spec bico__xfer_params[BICO__NPARAMS];
/* The source rename applied to an opened input (`which` a BICO_FILE_*;
 * only the source's files are renamed); the prefix offer for a pairing
 * message (buf gets "" or "; the names differ by a prefix: ..."); the
 * warning (logged) for a checkpoint given as the task vector. */
bico_status bico__xfer_rename_source(const bico_transfer *t, int which,
                                     bico_stfile *f);
void bico__xfer_prefix_offer(bico__run *r, char *buf, size_t cap);
void bico__xfer_check_task_vector(bico__run *r);

/* ---- transfer_mem.c ---- */
void bico__xfer_mem_free(bico_transfer *t);
size_t bico__xfer_mem_nxcov(const bico_transfer *t);
size_t bico__xfer_mem_nvotes(const bico_transfer *t);
/* The accumulators lent for one side of a module: their count (0: none). */
size_t bico__xfer_mem_xcov(const bico_transfer *t, const char *module,
                           int side, const bico_xcov *const **blocks);
const bico_votes *bico__xfer_mem_votes(const bico_transfer *t,
                                       const char *tensor);
/* The lent statistics and votes against the target model (r->mt): names
 * that are no module or tensor of it, accumulators without rows, votes
 * without samples (bico_transfer_check's inputs level and every run). */
bico_status bico__xfer_mem_check(bico__run *r);

/* ---- transfer_base.c ---- */
/* The log line (the names of file slots and handlings are
 * bico_transfer_file_name's and bico_transfer_handling_name's). */
void bico__xfer_log(bico__run *r, const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Prefixes ctx's message with context ("tensor X: ...") unless it names
 * `name` already. */
bico_status bico__xfer_wrap(bico_ctx *ctx, bico_status st, const char *what,
                            const char *name);
/* A failure on the file of slot `which` (a BICO_FILE_*) named by its slot,
 * "the source tuned file PATH: reason" (the message of the call that
 * failed, without its function's name and the path it repeats). */
bico_status bico__xfer_wrap_file(bico_ctx *ctx, bico_status st, int which,
                                 const char *path);
/* Every message of an entry point starts with its name ("transfer_run: "):
 * a message that starts with another function's name gets fn's instead,
 * one without a name gets fn's in front. */
bico_status bico__xfer_prefix(bico_ctx *ctx, bico_status st, const char *fn);
const char *bico__xfer_tname(const bico_model *m, size_t i);
const char *bico__xfer_mname(const bico_model *m, size_t i);
size_t bico__xfer_numel(size_t ndim, const size_t *shape);
int bico__xfer_is_bico(int method);
/* dst [cols, rows] = src [rows, cols] transposed. */
void bico__xfer_transpose(const float *src, size_t rows, size_t cols,
                          float *dst);

#endif
