/* libbico: carry fine-tuning from one pretrained model to another.
 *
 * The umbrella header: include this one.  C99; the public headers use only
 * <stddef.h> and <stdint.h>. */
#ifndef BICO_BICO_H
#define BICO_BICO_H

#include "version.h"
#include "status.h"
#include "params.h"
#include "ctx.h"
#include "xcov.h"
#include "procrustes.h"
#include "transport.h"
#include "votes.h"
#include "gradfix.h"
#include "baseline.h"
#include "depthmap.h"
#include "dtype.h"
#include "safetensors.h"
#include "folder.h"
#include "model.h"
#include "transfer.h"
#include "stats.h"
#include "lora.h"
#include "merge.h"
#include "fit.h"
/* Declares nothing unless BICO_EXPERIMENTAL is defined: interfaces without
 * an ABI promise (experimental.h). */
#include "experimental.h"

#endif
