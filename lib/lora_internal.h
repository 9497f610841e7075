/* The LoRA branch of the transfer driver (internal).
 *
 * bico_transfer_run hands a planned run to bico__lora_transfer_run when a
 * source adapter is set: the driver owns files, options and the maps
 * (computed on demand, freed with release); lib/lora_transfer.c owns what is
 * done with an adapter.  The callbacks keep transfer.c's run private. */
#ifndef BICO_LORA_INTERNAL_H
#define BICO_LORA_INTERNAL_H

#include "internal.h"

/* Which maps carry target tensor ti (role dispatch, BiCo methods): the
 * one rule the whole-model driver, its solver pool and the LoRA branch
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
  int vocab;       /* rows matched by token string (lib/vocab.c) */
  int tokens;      /* WEIGHT: a vocabulary head (rows are tokens: no
                      output map) */
  int scale;       /* ROWS: a norm's scale, an operator diag(g): moved as
                      diag(R^T diag(tau) R) = (R o R)^T tau, not R^T tau */
  char reason[192];
} bico__route;

/* The dead-map rule, one for every path that carries a tensor by its maps
 * (the checkpoint driver and the LoRA branch): a map fitted on an all-zero
 * statistic (rank 0: no activation or no gradient reached the layer)
 * identifies nothing, and its completion would move the update
 * arbitrarily, so what it would carry is left unchanged.  Returns 1 and
 * writes the reason, naming the map's side ("in" or "out"), into
 * reason[cap] when rank is 0 (lib/transfer_update.c). */
int bico__map_dead(size_t rank, const char *side, char *reason, size_t cap);

/* The adapter's lora_dropout (training only; carried to outputs). */
double bico__lora_dropout(const bico_lora *l);
void bico__lora_set_dropout(bico_lora *l, double dropout);

typedef struct bico__lora_hook {
  bico_ctx *ctx;
  const bico_model *ms, *mt;       /* source and target base models */
  const bico_stfile *sb, *tb;      /* source and target base files */
  const bico_stfile *votes;        /* GradFix votes (or NULL) */
  const char *votes_path;
  int method;                      /* bico_transfer_method */
  float alpha;
  const char *adapter_dir;         /* source adapter folder */
  const char *target_path;         /* target base as given: the output
                                      adapter's base_model_name_or_path */
  const char *out_dir;             /* output adapter folder, or NULL */
  const char *out_ckpt;            /* full target checkpoint, or NULL */
  const char *report_path;         /* JSON report, or NULL */
  void *opaque;
  /* Output split (k) of target module mi. */
  size_t (*split)(void *opaque, size_t mi);
  /* Map `block` of target module mi on `side` (0: input, one block; 1:
   * output, k blocks), computed on first use; *r is da x db row-major;
   * *thin 1 when it was solved from the rows (docs/methods.md). */
  bico_status (*map)(void *opaque, size_t mi, int side, size_t block,
                     const float **r, size_t *da, size_t *db, size_t *rank,
                     int *thin);
  /* Carries task vector *tau (source base tensor si's shape, allocated in
   * ctx; the call may replace it) of target tensor ti by its route, by the
   * checkpoint path's own step (bico__xfer_carry: the weight/bias/rows
   * dispatch, layouts, the dead-map rule): upd (ti's numel floats) gets
   * alpha tau_B, or reason[cap] says why the tensor is left unchanged
   * (reason[0] is 0 otherwise). */
  bico_status (*carry)(void *opaque, size_t ti, size_t si, float **tau,
                       float *upd, char *reason, size_t cap);
  /* The route of target tensor ti (see bico__route). */
  void (*route)(void *opaque, size_t ti, bico__route *out);
  /* Frees the maps of target module mi. */
  void (*release)(void *opaque, size_t mi);
  void (*log)(void *opaque, const char *line);
  /* Structured progress per target module (bico_transfer_set_progress),
   * or NULL. */
  bico_progress_fn progress;
  void *progress_opaque;
  /* Out: target tensors that received an update (bico_transfer_counts). */
  size_t updated;
} bico__lora_hook;

bico_status bico__lora_transfer_run(bico__lora_hook *h);

/* Every value the driver writes is finite: BICO_E_NONFINITE naming `what`
 * ("tensor", "adapter module", ...) `name` and the first bad element of
 * v[0..n) otherwise (lib/transfer_output.c). */
bico_status bico__xfer_check_finite(bico_ctx *ctx, const float *v, size_t n,
                                    const char *what, const char *name);
bico_status bico__xfer_check_finite_f64(bico_ctx *ctx, const double *v,
                                        size_t n, const char *what,
                                        const char *name);

/* bico_lora_save in two steps, so that a run commits the adapter together
 * with its other outputs (lib/fileio.h): begin checks both destinations,
 * creates the folder if missing and leaves both files complete in
 * temporary files (weights, cfg); the caller passes them to bico__commit,
 * then calls end (which removes what was not committed, and the folder if
 * begin created it and nothing landed).  end is safe after a failed
 * begin. */
#include "fileio.h"
typedef struct bico__lora_out {
  bico_ctx *ctx;
  bico_stwriter *w;
  bico__tmpfile *weights; /* inside w, once finished */
  bico__tmpfile cfg;
  char *dir;
  int made;
} bico__lora_out;
bico_status bico__lora_save_begin(const bico_lora *l, const char *fn,
                                  const char *dir, bico__lora_out *o);
void bico__lora_save_end(bico__lora_out *o, int committed);

#endif
