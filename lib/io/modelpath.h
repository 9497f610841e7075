/* Model paths as users hold them (lib/io/modelpath.c). */
#ifndef BICO_MODELPATH_H
#define BICO_MODELPATH_H

#include <stddef.h>

#include "internal.h"

/* path, or the weights file of the Hugging Face model folder path names
 * (model.safetensors.index.json, model.safetensors, or the folder's single
 * *.safetensors file), written into buf[cap].  A folder holding a PEFT
 * adapter or PyTorch pickles, or nothing to read, fails with a message that
 * says so and what to do. */
bico_status bico__model_file(bico_ctx *ctx, const char *path, char *buf,
                             size_t cap, const char **file);

/* 1 when the file at path is a PyTorch checkpoint (torch.save's zip
 * archive, or a pickle under a .bin/.pt/.pth/.ckpt name). */
int bico__looks_like_pickle(const char *path);

#endif
