/* libbico: merging several task vectors in the target's coordinates.
 *
 * Once each task has been carried to the target (bico transfer --delta-output,
 * a fine-tuned target checkpoint, or a target LoRA adapter), the tasks can
 * be combined into one update, with the methods and options mergekit users
 * know:
 *
 *   LINEAR (task arithmetic)  merged = sum_t w_t tau_t
 *                             (divided by sum_t w_t when normalising)
 *   TIES                      1. trim: keep the round-down(density_t * n)
 *                                entries of tau_t largest in magnitude
 *                                (ties by position: the earlier entry),
 *                                zero the rest (density 1 keeps all);
 *                             2. elect: per entry, the sign of
 *                                sum_t w_t trim(tau_t) (mass; a zero sum
 *                                elects +);
 *                             3. disjoint mean: sum over the tasks whose
 *                                weighted entry has the elected sign of
 *                                w_t trim(tau_t), divided by the sum of
 *                                their weights when normalising (default
 *                                for TIES; a zero divisor counts as 1).
 * and finally  theta = theta_base + alpha * merged.  Weights may be any
 * finite numbers (negative ones subtract a task); densities lie in (0, 1].
 *
 * bico_merge_tensor is the kernel for one tensor; a bico_merge handle runs
 * it over whole checkpoints, with the no-data-loss rules of bico_transfer:
 * every input tensor must name a target base tensor of the same shape
 * (else an error naming both), tensors an input lacks contribute zero for
 * that task, the output is written atomically, outputs that name an input
 * are refused, and a JSON report lists what each tensor got. */
#ifndef BICO_MERGE_H
#define BICO_MERGE_H

#include <stddef.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum bico_merge_method {
  BICO_MERGE_LINEAR = 1,
  BICO_MERGE_TIES = 2
} bico_merge_method;
/* "linear", "ties" (NULL for an unknown value); from_name also takes
 * mergekit's "task_arithmetic" for LINEAR (BICO_E_NOTFOUND otherwise). */
BICO_API const char *bico_merge_method_name(int method);
BICO_API bico_status bico_merge_method_from_name(const char *name,
                                                 int *method);

/* One tensor: out[n] = merged (see above), from ntasks task vectors
 * taus[t][n] with weights[t] and densities[t] (densities may be NULL: all
 * 1; LINEAR requires density 1).  normalize: 0 or 1. */
BICO_API bico_status bico_merge_tensor(bico_ctx *ctx, int method,
                                       size_t ntasks, size_t n,
                                       float *const *taus,
                                       const double *weights,
                                       const double *densities, int normalize,
                                       float *out);

typedef struct bico_merge bico_merge;

/* Kinds of input (bico_merge_add_input). */
typedef enum bico_merge_input {
  BICO_MERGE_TASK_VECTOR = 1, /* a safetensors file of tau (target names) */
  BICO_MERGE_TUNED = 2,       /* a fine-tuned target checkpoint: tau =
                                 tuned - base */
  BICO_MERGE_LORA = 3         /* a PEFT adapter folder for the target: tau
                                 = s B A per module (and saved tensors minus
                                 the base) */
} bico_merge_input;

typedef enum bico_merge_file {
  BICO_MERGE_FILE_BASE = 1,         /* target base checkpoint (required) */
  BICO_MERGE_FILE_OUTPUT = 2,       /* merged checkpoint (required) */
  BICO_MERGE_FILE_DELTA_OUTPUT = 3, /* alpha * merged alone (optional) */
  BICO_MERGE_FILE_REPORT = 4        /* JSON report (optional) */
} bico_merge_file;
/* Names of the input kinds ("task_vector", "tuned", "lora") and files
 * ("base", "output", "delta_output", "report"), as the bindings spell
 * them; NULL / BICO_E_NOTFOUND otherwise. */
BICO_API const char *bico_merge_input_name(int kind);
BICO_API bico_status bico_merge_input_from_name(const char *name, int *kind);
BICO_API const char *bico_merge_file_name(int which);
BICO_API bico_status bico_merge_file_from_name(const char *name, int *which);

typedef enum bico_merge_param {
  BICO_MERGE_METHOD = 1,    /* bico_merge_method; 0 = default (LINEAR) */
  BICO_MERGE_ALPHA = 2,     /* finite, > 0; default 1 (mergekit's lambda) */
  BICO_MERGE_NORMALIZE = 3, /* -1: the method's default (TIES 1, LINEAR 0),
                               0 or 1; default -1 */
  BICO_MERGE_MAX_SHARD_SIZE = 4 /* bytes, >= 0; default 0: an output
                                   folder (bico_stwriter_output_is_folder, like the
                                   base) is sharded as the base is; else
                                   greedily by this size */
} bico_merge_param;

BICO_API bico_status bico_merge_create(bico_ctx *ctx, bico_merge **out);
/* Accepts NULL. */
BICO_API void bico_merge_free(bico_merge *m);
BICO_API bico_status bico_merge_set_file(bico_merge *m, int which,
                                         const char *path);
BICO_API bico_status bico_merge_set_param(bico_merge *m, int param,
                                          double value);
/* The option grammar of params.h: METHOD [0, 2] (0: the default,
 * LINEAR; get_param reports the member), ALPHA (0, FLT_MAX]
 * (BICO_PARAM_LO_OPEN; used as a float), NORMALIZE [-1, 1] (integers),
 * MAX_SHARD_SIZE (bytes); names "method", "alpha", "normalize",
 * "max_shard_size". */
BICO_API bico_status bico_merge_get_param(const bico_merge *m, int param,
                                          double *value);
BICO_API bico_status bico_merge_param_bounds(int param, double *lo,
                                             double *hi, unsigned *flags);
BICO_API const char *bico_merge_param_name(int param);
BICO_API bico_status bico_merge_param_from_name(const char *name,
                                                int *param);
/* Adds an input (kind: bico_merge_input) with its weight (finite) and
 * density (in (0, 1]). */
BICO_API bico_status bico_merge_add_input(bico_merge *m, int kind,
                                          const char *path, double weight,
                                          double density);
/* Progress lines; fn NULL for silence (the default). */
BICO_API bico_status bico_merge_set_log(bico_merge *m,
                                        void (*fn)(void *opaque,
                                                   const char *line),
                                        void *opaque);
/* Calls fn (ctx.h's bico_progress) after every tensor of the base: work
 * in elements + 1 per tensor, items in tensors, the last call with done ==
 * total; NULL (the default) for none. */
BICO_API bico_status bico_merge_set_progress(bico_merge *m,
                                             bico_progress_fn fn,
                                             void *opaque);
/* How far bico_merge_check goes (0 asks for the default, INPUTS); the
 * values and names ("options", "inputs") of bico_transfer_check_level. */
typedef enum bico_merge_check_level {
  /* The options alone, no file opened: the base and the output given, at
   * least one input, no two outputs (output, delta output, report) on one
   * path, no input with a density below 1 under LINEAR.  Weights,
   * densities and parameters are checked where they are set. */
  BICO_MERGE_CHECK_OPTIONS = 1,
  /* Also every check bico_merge_run makes on the files before it writes
   * anything: the base and every input opened (a missing or unreadable
   * one), each input's tensors on base tensors of their shape (floating
   * point in the base, finite in the input; an adapter's modules and saved
   * tensors alike), and inputs and outputs compared by file identity (an
   * output naming an input, under any spelling).  The files are closed
   * again. */
  BICO_MERGE_CHECK_INPUTS = 2
} bico_merge_check_level;

/* Validates the configured merge without running it, to `level`: BICO_OK
 * when a run would get past those checks, else the status and message the
 * run would fail with (the message starts with "merge_check:" and names
 * the file, as "the <bico_merge_file_name> file" with "delta output"
 * spelled with a space, or the input and its tensor).  Nothing is written.
 * A front end calls it with BICO_MERGE_CHECK_OPTIONS to tell a usage
 * error from a failure on the files; an unknown level is BICO_E_ARG. */
BICO_API bico_status bico_merge_check(bico_merge *m, int level);
/* Runs the merge; on failure nothing is written.  A folder output is
 * locked before any input is read, as for bico_transfer_run (folder.h). */
BICO_API bico_status bico_merge_run(bico_merge *m);

#ifdef __cplusplus
}
#endif
#endif
