/* The LoRA container's layout, shared by lib/lora/lora.c (container),
 * lib/lora/lora_io.c (PEFT reading and writing) and lib/lora/lora_kernels.c
 * (dense, transport, truncation); never installed. */
#ifndef BICO_LORA_IMPL_H
#define BICO_LORA_IMPL_H

#include "internal.h"
#include "strindex.h"

#define PREFIX "base_model.model."
#define PREFIX_LEN 17
#define NSTR 3

typedef struct lmod {
  char *name;
  int kind;
  size_t rank, dout, din;
  double alpha;
  float *b, *a;
} lmod;

typedef struct lsaved {
  char *name, *module;
  size_t ndim, numel;
  size_t *shape;
  float *data;
} lsaved;

struct bico_lora {
  bico_ctx *ctx;
  lmod *mods;
  size_t nmods, capm;
  lsaved *saved;
  size_t nsaved, caps;
  int rslora, fifo;
  double dropout; /* lora_dropout: training only, carried to outputs */
  char *strings[NSTR];
  bico__strindex by_name; /* module name -> index into mods */
};

/* Appends a module / saved tensor, taking ownership of name (modules),
 * b, a and data (freed on failure too). */
bico_status bico__lora_push_module(bico_lora *l, char *name, int kind,
                                   size_t rank, double alpha, size_t dout,
                                   size_t din, float *b, float *a);
bico_status bico__lora_push_saved(bico_lora *l, const char *name,
                                  const char *module, size_t ndim,
                                  const size_t *shape, size_t numel,
                                  float *data);
/* alpha / r, or alpha / sqrt(r) for rsLoRA. */
double bico__lora_scale(const bico_lora *l, const lmod *m);

#endif
