/* The LoRA branch of the transfer driver (internal).
 *
 * bico_transfer_run hands a planned run to bico__lora_transfer_run when a
 * source adapter is set: the driver owns files, options and the maps
 * (computed on demand, freed with release); lib/lora_transfer.c owns what is
 * done with an adapter.  The callbacks keep transfer.c's run private. */
#ifndef BICO_LORA_INTERNAL_H
#define BICO_LORA_INTERNAL_H

#include "internal.h"

typedef struct bico__lora_hook {
  bico_ctx *ctx;
  const bico_model *ms, *mt;       /* source and target base models */
  const bico_stfile *sb, *tb;      /* source and target base files */
  const bico_stfile *votes;        /* GradFix votes (or NULL) */
  const char *votes_path;
  int method;                      /* bico_method */
  float alpha;
  const char *adapter_dir;         /* source adapter folder */
  const char *out_dir;             /* output adapter folder, or NULL */
  const char *out_ckpt;            /* full target checkpoint, or NULL */
  const char *report_path;         /* JSON report, or NULL */
  void *opaque;
  /* Output split (k) of target module mi. */
  size_t (*split)(void *opaque, size_t mi);
  /* Map `block` of target module mi on `side` (0: input, one block; 1:
   * output, k blocks), computed on first use; *r is da x db row-major. */
  bico_status (*map)(void *opaque, size_t mi, int side, size_t block,
                     const float **r, size_t *da, size_t *db, size_t *rank);
  /* The module and side whose map carries target tensor ti (role TOKEN or
   * VECTOR) along its last dimension, as the driver's tie and norm-map
   * rules choose; *identity set when the method leaves that side alone
   * (input-map-only transfer of a token tied to a linear module).
   * BICO_E_NOTFOUND (no message) when none. */
  bico_status (*vector_map)(void *opaque, size_t ti, size_t *mi, int *side,
                            int *identity);
  /* Frees the maps of target module mi. */
  void (*release)(void *opaque, size_t mi);
  void (*log)(void *opaque, const char *line);
  /* Out: target tensors that received an update (bico_transfer_counts). */
  size_t updated;
} bico__lora_hook;

bico_status bico__lora_transfer_run(bico__lora_hook *h);

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
