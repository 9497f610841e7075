/* The LoRA adapter's internals shared by lib/lora/lora.c and lib/lora/lora_io.c
 * (internal).  The LoRA route of the transfer driver (lib/transfer/lora_transfer.c)
 * is declared in transfer_internal.h with the steps it uses. */
#ifndef BICO_LORA_INTERNAL_H
#define BICO_LORA_INTERNAL_H

#include "internal.h"

/* The adapter's lora_dropout (training only; carried to outputs). */
double bico__lora_dropout(const bico_lora *l);
void bico__lora_set_dropout(bico_lora *l, double dropout);

/* bico_lora_save in two steps, so that a run commits the adapter together
 * with its other outputs (lib/io/fileio.h): begin checks both destinations,
 * takes the folder's lock (joining a run's) and builds the whole adapter
 * folder beside it (lib/io/folder_guard.c: adapter_model.safetensors,
 * adapter_config.json, the old folder's other entries carried); the caller
 * passes &o->st.t (one folder, swapped in whole) to bico__commit, then
 * calls end (which removes the new folder unless committed and lets the
 * lock go).  end is safe after a failed begin. */
#include "fileio.h"
typedef struct bico__lora_out {
  bico_ctx *ctx;
  bico__stage st;
} bico__lora_out;
bico_status bico__lora_save_begin(const bico_lora *l, const char *fn,
                                  const char *dir, bico__lora_out *o);
void bico__lora_save_end(bico__lora_out *o, int committed);

#endif
