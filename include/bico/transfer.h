/* libbico: whole-model transfer and calibration statistics.
 *
 * bico_transfer carries a task vector from a source checkpoint to a target
 * checkpoint, tensor by tensor, and writes the result as a safetensors
 * file; it is what the `bico transfer` command runs.  Files are named with
 * bico_transfer_set_file, options set with bico_transfer_set_param and the
 * splits/ties added one by one; bico_transfer_run does the work.
 *
 * Methods (BICO_TRANSFER_METHOD):
 *   BICO_METHOD_BICO      per linear target module M paired with source
 *                         module S: tau_B = R_out^T tau_S R_in, R_in from
 *                         the input statistics of (S, M), R_out from the
 *                         output-gradient statistics; biases R_out^T b;
 *   BICO_METHOD_BICO_IN   input map only (R_out the rectangular identity);
 *   BICO_METHOD_BICO_OUT  output map only (R_in the rectangular identity);
 *   BICO_METHOD_GRADFIX   sign-vote masks from the target's votes file;
 *   BICO_METHOD_NAIVE     theta_B + alpha tau (every paired shape equal);
 *   BICO_METHOD_PAD       tau zero-padded/truncated to the target shape.
 * For the three BiCo methods, element-wise modules (norms) are carried by
 * the map chosen with BICO_TRANSFER_NORM_MAP (their input activations'
 * map, default, or their output gradients'), and token tensors (cls_token,
 * pos_embed, embedding tables: role TOKEN) along their last dimension by
 * the output map of the module they are tied to (bico_transfer_add_tie;
 * default: the linear "stem" module outside the blocks whose output width
 * equals the token width and whose name contains "embed", "stem" or
 * "patch"; an element-wise module tied this way lends its norm map).  A
 * token with no such module is left unchanged and reported.
 *
 * Statistics come from two calibration files (source and target: tensors
 * "<module>.input" and "<module>.output_grad", [rows, d] or [..., d],
 * rows corresponding) or from one statistics file ("<target
 * module>.in_xcov" [d_A,in, d_B,in] and ".out_xcov" [d_A,out, d_B,out]),
 * see docs/formats.md.  Pairing of target and source modules and tensors is
 * bico_model's (name outside the blocks, depth map inside).
 *
 * Threads: the BLIS thread count is the context's (BICO_CTX_THREADS).
 * Memory: maps are computed when the first tensor needing them comes up and
 * freed after the last; calibration rows are streamed in chunks.
 *
 * The output holds every tensor of the target base with its name, shape
 * and dtype: theta_B + alpha tau_B where a method produced an update,
 * theta_B otherwise; it is written atomically (nothing is written, and an
 * existing file is untouched, when the run fails).  An output path that
 * names one of the inputs is refused.  Its "__metadata__" is the target
 * base's plus provenance: "bico.version", "bico.method", "bico.alpha" and
 * the input files as given ("bico.source_base", "bico.source_tuned",
 * "bico.task_vector", "bico.source_adapter", "bico.target_base"). */
#ifndef BICO_TRANSFER_H
#define BICO_TRANSFER_H

#include <stddef.h>
#include "ctx.h"
#include "votes.h"
#include "xcov.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_transfer bico_transfer;

typedef enum bico_transfer_method {
  BICO_METHOD_BICO = 1,
  BICO_METHOD_BICO_IN = 2,
  BICO_METHOD_BICO_OUT = 3,
  BICO_METHOD_GRADFIX = 4,
  BICO_METHOD_NAIVE = 5,
  BICO_METHOD_PAD = 6
} bico_transfer_method;

typedef enum bico_transfer_norm_map {
  /* 0 asks for the default, ACT (docs/api.md's enumeration rule) */
  BICO_NORM_MAP_ACT = 1, /* map of the norm's input activations */
  BICO_NORM_MAP_GRAD = 2 /* map of the norm's output gradients */
} bico_transfer_norm_map;

/* Names of the methods ("bico", "bico-in", "bico-out", "gradfix", "naive",
 * "pad") and norm maps ("act", "grad"), as the bico command, the report
 * and the bindings spell them: FFI callers take them from here rather than
 * copying the table.  *_name gives NULL for an unknown value (static
 * text otherwise); *_from_name gives BICO_E_NULL for a NULL argument and
 * BICO_E_NOTFOUND for an unknown name (leaving *out alone), as every
 * lookup of status.h does. */
BICO_API const char *bico_transfer_method_name(int method);
BICO_API bico_status bico_transfer_method_from_name(const char *name, int *method);
BICO_API const char *bico_transfer_norm_map_name(int norm_map);
BICO_API bico_status bico_transfer_norm_map_from_name(const char *name, int *norm_map);

/* Files (bico_transfer_set_file).  NULL unsets. */
typedef enum bico_transfer_file {
  BICO_FILE_SOURCE_BASE = 1,   /* required */
  BICO_FILE_SOURCE_TUNED = 2,  /* this or TASK_VECTOR */
  BICO_FILE_TASK_VECTOR = 3,   /* tau itself, named like the source */
  BICO_FILE_TARGET_BASE = 4,   /* required */
  BICO_FILE_SOURCE_CALIB = 5,  /* with TARGET_CALIB, or STATS: BiCo */
  BICO_FILE_TARGET_CALIB = 6,
  BICO_FILE_STATS = 7,
  BICO_FILE_TARGET_VOTES = 8,  /* GradFix */
  BICO_FILE_OUTPUT = 9,        /* required */
  BICO_FILE_DELTA_OUTPUT = 10, /* optional: alpha tau_B alone */
  BICO_FILE_REPORT = 11,       /* optional: JSON report */
  /* LoRA (see lora.h): a source PEFT adapter folder instead of SOURCE_TUNED
   * or TASK_VECTOR; the result is a PEFT adapter folder for the target
   * (LORA_OUTPUT), a full target checkpoint (OUTPUT: the adapter merged
   * into the target base), or both.  DELTA_OUTPUT is not used; after such
   * a run bico_transfer_counts counts as updated the target weights that
   * received an adapter module and the modules_to_save tensors. */
  BICO_FILE_LORA = 12,
  BICO_FILE_LORA_OUTPUT = 13,
  /* Hugging Face config.json of each model (see "Decoder families"
   * below); optional: by default the config.json inside a base given as a
   * model folder is read. */
  BICO_FILE_SOURCE_CONFIG = 14,
  BICO_FILE_TARGET_CONFIG = 15,
  /* A bridge file (bico_transfer_bridge, below): read by a run in place of
   * the statistics (BRIDGE), written by bico_transfer_bridge
   * (BRIDGE_OUTPUT). */
  BICO_FILE_BRIDGE = 16,
  BICO_FILE_BRIDGE_OUTPUT = 17
} bico_transfer_file;

/* Names of the file slots ("source base", "source tuned", "task vector",
 * "target base", "source calib", "target calib", "stats", "target votes",
 * "output", "delta output", "report", "source adapter", "output adapter",
 * "source config", "target config", "bridge", "bridge output"): the
 * library's messages name a slot's
 * file as "the <name> file", so a front end can put its own spelling of
 * the option in its place.  _from_name also takes the bindings' spelling,
 * an underscore for each space ("source_base").  NULL / BICO_E_NOTFOUND
 * otherwise. */
BICO_API const char *bico_transfer_file_name(int which);
BICO_API bico_status bico_transfer_file_from_name(const char *name,
                                                  int *which);

/* Numeric options (bico_transfer_set_param), with bounds from
 * bico_transfer_param_bounds. */
typedef enum bico_transfer_param {
  BICO_TRANSFER_METHOD = 1,       /* bico_transfer_method; 0 = default (BICO) */
  BICO_TRANSFER_ALPHA = 2,        /* (0, FLT_MAX]; default 1 */
  BICO_TRANSFER_NORM_MAP = 3,     /* bico_transfer_norm_map; default ACT */
  BICO_TRANSFER_NULL = 4,         /* bico_null_completion; default KEEP */
  BICO_TRANSFER_RANK_TOL = 5,     /* [0, 1); default 1e-5 */
  BICO_TRANSFER_CENTER = 6,       /* 0 or 1; default 0 */
  BICO_TRANSFER_WHITEN = 7,       /* [0, 0.5]; default 0 */
  BICO_TRANSFER_PROC_METHOD = 8,  /* bico_procrustes_method; 0 = default (EIG) */
  BICO_TRANSFER_WORKERS = 9,      /* solver threads, 1..1024; default 1 */
  BICO_TRANSFER_SOLVE_MEMORY = 10, /* bytes, >= 0; default 0 (no limit) */
  BICO_TRANSFER_MIN_PAIRED = 11,  /* [0, 1]; default 0.5: the run fails
                                     (BICO_E_NOTFOUND) when fewer than this
                                     share of the target's floating-point
                                     parameters have a source partner (a
                                     BERT source for a ViT target pairs
                                     nothing); 0 allows any pairing */
  BICO_TRANSFER_GRADFIX_MODE = 12, /* bico_gradfix_mode; 0 = default
                                     (MAJORITY); MEAN needs votes lent with
                                     bico_transfer_set_votes from
                                     accumulators made with BICO_VOTES_MEAN
                                     (a votes file holds counts only) */
  BICO_TRANSFER_MAX_SHARD_SIZE = 13, /* bytes, >= 0; default 0: an output
                                     folder (bico_stwriter_output_is_folder) is
                                     sharded as the target is; else
                                     greedily by this size
                                     (bico_stwriter_create_folder) */
  BICO_TRANSFER_STRUCTURE = 14,   /* bico_transfer_structure; 0 = default (FREE) */
  BICO_TRANSFER_ROPE = 15,        /* bico_transfer_rope; 0 (default): from config.json */
  BICO_TRANSFER_HEADS = 16,       /* query heads of both models; 0 (default):
                                     from config.json */
  BICO_TRANSFER_KV_HEADS = 17,    /* key/value heads; 0: from config.json
                                     (absent there: the query heads) */
  BICO_TRANSFER_HEAD_DIM = 18,    /* head width; 0: from config.json
                                     (absent there: hidden / heads) */
  BICO_TRANSFER_ROW_CHUNK = 19,   /* rows per piece when a table of rows
                                     carried row by row (a tied token
                                     embedding) is streamed through the
                                     output (whole runs, BiCo methods);
                                     0 (default): about 64 MiB of work
                                     space per piece.  Results do not
                                     depend on it */
  BICO_TRANSFER_FINGERPRINT = 20  /* bico_transfer_fingerprint: how a
                                     bridge fingerprints the two bases
                                     (made and read: see "Bridges"
                                     below); 0 = default (SAMPLED), with
                                     a bridge the bridge's.  No effect
                                     on a run without a bridge */
} bico_transfer_param;

/* Decoder families and structure-aware maps (BiCo methods).
 *
 * When both models are decoders of a known family (config.json's
 * model_type "llama", "mistral", "qwen2", "gemma" or "gemma2",
 * read from BICO_FILE_*_CONFIG or from inside a base given as a model
 * folder) and BICO_TRANSFER_STRUCTURE is BICO_STRUCTURE_HEADS (not the
 * default: on small Llama LMs trained apart, docs/llm.md, free-form maps
 * carried more of the fine-tune), the maps inside each decoder layer (modules named
 * <layer>.self_attn.{q,k,v,o}_proj and <layer>.mlp.{gate,up,down}_proj)
 * respect the architecture instead of being free-form:
 *   - q_proj's and k_proj's output maps: per key/value group one map on
 *     head_dim, shared by the key head and every query head of the group,
 *     made of one 2x2 rotation per RoPE frequency pair (closed form from
 *     the pair's statistic summed over the group); heads and groups are
 *     matched between the models by an assignment on head-level scores;
 *   - v_proj's output and o_proj's input maps: per group one orthogonal map
 *     on head_dim (o_proj's heads matched as the query heads);
 *   - gate_proj's and up_proj's output and down_proj's input maps: one map
 *     of the intermediate space from the three statistics together.
 * Residual-stream maps (the other sides) are as without structure.  With
 * more heads or groups in the target than the source, the unmatched target
 * heads get no update; with different head widths or RoPE layouts the
 * attention maps fall back to free-form (logged).  Centering and whitening
 * have no structured form: with either set the maps are free-form.  A
 * config.json of a known family that lacks hidden_size,
 * num_attention_heads, num_hidden_layers or intermediate_size, or whose
 * head counts do not divide, fails the run (BICO_E_FORMAT naming the file
 * and the field); widths that disagree with the tensors fail with
 * BICO_E_SHAPE.  BICO_TRANSFER_HEADS/KV_HEADS/HEAD_DIM/ROPE override the
 * configs of both models (with HEADS set, a model without a config.json
 * counts as a known family).  docs/llm.md has the rules. */
typedef enum bico_transfer_structure { /* 0 = default: FREE */
  BICO_STRUCTURE_HEADS = 1, /* structure-aware where the family is known */
  BICO_STRUCTURE_FREE = 2   /* one free-form map per module side */
} bico_transfer_structure;

typedef enum bico_transfer_rope {     /* 0 = default: the family's layout (HALF) */
  BICO_ROPE_HALF = 1,        /* HF rotate_half: dims i and i + head_dim/2 */
  BICO_ROPE_INTERLEAVED = 2, /* dims 2i and 2i + 1 (GPT-J, Meta's layout) */
  BICO_ROPE_NONE = 3         /* no rotary embedding: one free orthogonal
                                map per group on head_dim */
} bico_transfer_rope;

/* Names of the structures ("heads", "free") and RoPE layouts ("half",
 * "interleaved", "none"), as bico transfer spells them; same conventions
 * as bico_transfer_method_name / bico_transfer_method_from_name. */
BICO_API const char *bico_transfer_structure_name(int structure);
BICO_API bico_status bico_transfer_structure_from_name(const char *name,
                                              int *structure);
BICO_API const char *bico_transfer_rope_name(int rope);
BICO_API bico_status bico_transfer_rope_from_name(const char *name, int *rope);

/* How a bridge fingerprints a base (BICO_TRANSFER_FINGERPRINT; "Bridges"
 * below, docs/formats.md "Bridge files"):
 *   SAMPLED  every tensor's name, dtype, shape and byte size and 192 of
 *            its bytes (64 at its start, middle and end; all of a tensor
 *            of at most 192 bytes), and the config.json and
 *            tokenizer.json: cheap, but a change confined to unsampled
 *            bytes passes;
 *   FULL     the same with every byte of every tensor: reads the whole
 *            of both bases each time a bridge is made or read. */
typedef enum bico_transfer_fingerprint { /* 0 = default: SAMPLED */
  BICO_FINGERPRINT_SAMPLED = 1,
  BICO_FINGERPRINT_FULL = 2
} bico_transfer_fingerprint;
/* Names: "sampled", "full" (NULL / BICO_E_NOTFOUND otherwise). */
BICO_API const char *bico_transfer_fingerprint_name(int fingerprint);
BICO_API bico_status bico_transfer_fingerprint_from_name(const char *name,
                                                         int *fingerprint);

/* Pipelining (BICO_TRANSFER_WORKERS > 1, BiCo methods on checkpoints;
 * LoRA adapters are solved in the calling thread): the maps are solved by that many threads, each with its own
 * context (the caller's allocator, which must then be thread-safe), its
 * own Procrustes solver and its own handles on the statistics or
 * calibration files, while the calling thread reads task vectors, applies
 * the maps and writes the output in the target's order.  Workers solve the
 * maps in the order the tensors need them, at most WORKERS maps ahead of
 * the tensor being written; the output is byte-identical to a run with one
 * worker.  BLIS threads: every GEMM of a worker, like the calling
 * thread's, uses the context's BICO_CTX_THREADS; the BLAS calls inside
 * LAPACK follow BLIS's process-wide setting (BLIS_NUM_THREADS).  With
 * WORKERS > 1, keep both at (cores / WORKERS): BLIS teams spin at their
 * barriers, and oversubscribed cores stall them (bico transfer does this
 * for --threads N --workers W).  BICO_TRANSFER_SOLVE_MEMORY caps the estimated working set
 * of the solves in flight (statistic, eigen- or SVD workspace, maps): a
 * worker waits while starting its next solve would exceed it, unless no
 * other solve is running. */

/* String options (bico_transfer_set_string).  NULL restores the default. */
typedef enum bico_transfer_string {
  BICO_TRANSFER_BLOCKS = 1,       /* block container of both models */
  BICO_TRANSFER_SOURCE_BLOCKS = 2,/* of the source only */
  BICO_TRANSFER_TARGET_BLOCKS = 3,/* of the target only */
  BICO_TRANSFER_SOURCE_RENAME = 4 /* "OLD=NEW": the source's tensor names
                                     (source base, tuned checkpoint, task
                                     vector, source calibration) that begin
                                     with OLD begin with NEW instead, so
                                     that they pair with the target's
                                     ("module.=" strips a DataParallel
                                     prefix, "bert.=roberta." swaps one,
                                     "=model." adds one); names in the
                                     report are the renamed ones.  Not with
                                     a LoRA adapter (BICO_E_ARG). */
} bico_transfer_string;
/* Names: "blocks", "source_blocks", "target_blocks", "source_rename"
 * (NULL / BICO_E_NOTFOUND otherwise). */
BICO_API const char *bico_transfer_string_name(int which);
BICO_API bico_status bico_transfer_string_from_name(const char *name,
                                                    int *which);

/* A line of progress or summary text (no trailing newline). */
typedef void (*bico_transfer_log_fn)(void *opaque, const char *line);

BICO_API bico_status bico_transfer_create(bico_ctx *ctx, bico_transfer **out);
/* Accepts NULL. */
BICO_API void bico_transfer_free(bico_transfer *t);

BICO_API bico_status bico_transfer_set_file(bico_transfer *t, int which,
                                            const char *path);
BICO_API bico_status bico_transfer_set_param(bico_transfer *t, int param,
                                             double value);
BICO_API bico_status bico_transfer_get_param(const bico_transfer *t,
                                             int param, double *value);
/* The option grammar of params.h: the accepted set of each parameter
 * (BICO_TRANSFER_ALPHA is (0, FLT_MAX]: BICO_PARAM_LO_OPEN), and the
 * parameters' names ("method", "alpha", "norm_map", "null", "rank_tol",
 * "center", "whiten", "proc_method", "workers", "solve_memory",
 * "min_paired", "gradfix_mode", "max_shard_size", "structure", "rope",
 * "heads", "kv_heads", "head_dim", "row_chunk", "fingerprint"; NULL /
 * BICO_E_NOTFOUND otherwise).  Every choice has a default and takes 0 for
 * it (METHOD, NORM_MAP, NULL, PROC_METHOD, GRADFIX_MODE, STRUCTURE,
 * FINGERPRINT), and get_param reports the member it resolved to; ROPE's 0
 * stays 0 ("from config.json"). */
BICO_API bico_status bico_transfer_param_bounds(int param, double *lo,
                                                double *hi, unsigned *flags);
BICO_API const char *bico_transfer_param_name(int param);
BICO_API bico_status bico_transfer_param_from_name(const char *name,
                                                   int *param);
BICO_API bico_status bico_transfer_set_string(bico_transfer *t, int which,
                                              const char *value);
/* Target modules whose names end in `suffix` (at a dot boundary, e.g.
 * "attn.qkv") have their output split in k >= 1 equal blocks, each with
 * its own output map (fused q, k, v projections: k = 3).  A later call for
 * the same suffix replaces k. */
BICO_API bico_status bico_transfer_add_split(bico_transfer *t,
                                             const char *suffix, size_t k);
/* Target tensor `tensor` (role TOKEN) lives, along its last dimension, in
 * the output space of target module `module`. */
BICO_API bico_status bico_transfer_add_tie(bico_transfer *t,
                                           const char *tensor,
                                           const char *module);
/* ---- Statistics and votes from memory ----
 *
 * A host that collected statistics itself (the Python binding's Collector)
 * lends the driver its accumulators instead of writing files.  The handle
 * keeps the pointers, not copies (a module side's statistic is the largest
 * thing a run holds; a copy would double it): the accumulators must stay
 * alive and unchanged until bico_transfer_free, or until the same module
 * side (tensor) is set again.  A run only reads them, from the thread that
 * calls bico_transfer_run or its solver threads (one accumulator is read by
 * one thread at a time unless the same one is lent twice).
 *
 * The side of a module whose map a statistic gives: */
typedef enum bico_transfer_side {
  BICO_SIDE_IN = 1, /* input activations: the map R_in (one block) */
  BICO_SIDE_OUT = 2 /* output gradients: R_out (k blocks when split) */
} bico_transfer_side;
/* Names: "in", "out" (NULL / BICO_E_NOTFOUND otherwise). */
BICO_API const char *bico_transfer_side_name(int side);
BICO_API bico_status bico_transfer_side_from_name(const char *name,
                                                  int *side);

/* Lends the statistics of one side of target module `module` (the name the
 * statistics file would key as "<module>.in_xcov" / ".out_xcov"): each
 * accumulator is [d_a, d_b] with the source module's width first.  nblocks
 * is 1 (the side's full widths; a module split in k blocks solves block b
 * from diagonal block b, sums and Gram matrices included), or, for
 * BICO_SIDE_OUT of a split module, k accumulators of [d_a/k, d_b/k], one
 * per block; 0 (blocks may be NULL) withdraws what was lent.  The run
 * solves from lent statistics first and falls back to the statistics or
 * calibration files for module sides without any (BICO_E_NOTFOUND when
 * there are none either).  With only lent statistics the BiCo methods need
 * no file; centering and whitening (BICO_TRANSFER_CENTER, _WHITEN) need
 * accumulators made with BICO_XCOV_SUMS / BICO_XCOV_GRAMS.  Widths are
 * checked when the run solves the module. */
BICO_API bico_status bico_transfer_set_xcov(bico_transfer *t,
                                            const char *module, int side,
                                            bico_xcov *const *blocks,
                                            size_t nblocks);
/* Lends GradFix votes for target tensor `tensor` (as many elements as the
 * tensor; NULL withdraws).  Used before the votes file: with votes lent
 * for every tensor GradFix needs no file.  The LoRA branch reads only the
 * votes file. */
BICO_API bico_status bico_transfer_set_votes(bico_transfer *t,
                                             const char *tensor,
                                             const bico_votes *votes);

/* Progress and summary lines; fn NULL for silence (the default). */
BICO_API bico_status bico_transfer_set_log(bico_transfer *t,
                                           bico_transfer_log_fn fn,
                                           void *opaque);

/* Calls fn (ctx.h's bico_progress) after every target tensor of a whole
 * run, the last call with done == total; work in the plan's cost units
 * (each target tensor costs 4 x its elements + 1, and the first tensor of
 * a module that needs maps also the maps' solve operations: the costs of
 * bico_transfer_plan_group).  A LoRA run reports once per target module
 * (done, total and tensors_* then count modules; `tensor` names the
 * module).  Partial runs report nothing.  NULL (the default) for none.
 * With a progress function set, the run logs no progress text of its own
 * (its summary lines stay). */
BICO_API bico_status bico_transfer_set_progress(bico_transfer *t,
                                                bico_progress_fn fn,
                                                void *opaque);

/* Runs the transfer.  On failure nothing is written (the report neither)
 * and ctx's message names the file, tensor, module or option at fault.
 * Each folder output (--output or --delta-output written as a model
 * folder, the output adapter) is locked before any input is read and
 * until its old tree is removed (folder.h: another process writing it is
 * BICO_E_IO naming that process, after BICO_CTX_FOLDER_WAIT seconds); a
 * partial run (bico_transfer_set_partial) writes nothing and locks
 * nothing. */
BICO_API bico_status bico_transfer_run(bico_transfer *t);

/* How far bico_transfer_check goes (0 asks for the default, INPUTS). */
typedef enum bico_transfer_check_level {
  /* The options alone, no file opened: which files go together (a source
   * base, a target base and an output; exactly one of source tuned and
   * task vector, or a source adapter; both calibration files or a
   * statistics file for the BiCo methods; the votes for GradFix and for
   * it only), options that contradict each other, distinct output
   * paths.  Parameter bounds are set_param's. */
  BICO_TRANSFER_CHECK_OPTIONS = 1,
  /* Also every check a run makes before its first map: the inputs opened
   * and their headers read, outputs compared with inputs by file
   * identity, the models' families, blocks, splits and ties resolved, the
   * share of the target paired with the source (MIN_PAIRED), a partial
   * run's selection. */
  BICO_TRANSFER_CHECK_INPUTS = 2
} bico_transfer_check_level;

/* Validates the configured transfer without running it: BICO_OK when a
 * run would get past its checks, else the status and message the run
 * would fail with.  Nothing is written and no map is computed; the log
 * function (if set) receives the pairing summary a run logs.  A front end
 * calls it with BICO_TRANSFER_CHECK_OPTIONS to tell a usage error from a
 * failure on the files. */
BICO_API bico_status bico_transfer_check(bico_transfer *t, int level);
/* Names of the levels ("options", "inputs"); NULL / BICO_E_NOTFOUND
 * otherwise. */
BICO_API const char *bico_transfer_check_level_name(int level);
BICO_API bico_status bico_transfer_check_level_from_name(const char *name,
                                                         int *level);

/* ---- Bridges: the maps of a pair of base models, kept ----
 *
 * BiCo's maps depend on the two base models, the calibration data and the
 * options that shape them, never on the fine-tune they carry.
 * bico_transfer_bridge solves every map a transfer from the source base to
 * the target base would use and writes them, with the plan (each target
 * tensor's source partner, handling and maps), those options and a
 * fingerprint of each base, to the bridge output file (a safetensors file:
 * docs/formats.md, "Bridge files").  Any number of later transfers read
 * the maps from it (BICO_FILE_BRIDGE) instead of statistics -- no
 * calibration data, no solve -- and write what a run from the statistics
 * writes, bit for bit.
 *
 * Making one: the inputs of a BiCo transfer without its fine-tune -- the
 * source and target bases (and configs), the calibration files, a
 * statistics file or lent statistics -- and BICO_FILE_BRIDGE_OUTPUT; a
 * BiCo method (bico, bico-in, bico-out); the options that shape maps
 * (METHOD, NORM_MAP, NULL, RANK_TOL, CENTER, WHITEN, PROC_METHOD,
 * STRUCTURE, ROPE, HEADS, KV_HEADS, HEAD_DIM, the block strings,
 * SOURCE_RENAME, the splits and ties) as for those transfers.
 * BICO_TRANSFER_WORKERS solves maps in parallel; the progress function
 * counts maps.  BICO_TRANSFER_FINGERPRINT says how the bases are
 * fingerprinted (SAMPLED, the default, or FULL: every byte), and the
 * bridge records which.  The bridge also records a SHA-256 digest of its
 * maps and ranks (and of its description), so that a file changed after
 * it was written is refused when read.  The source tuned, task vector,
 * source adapter, target votes, output, delta output, output adapter,
 * report and bridge files do not apply (BICO_E_ARG naming the file).  The
 * file is written atomically (nothing on failure).  Messages start with
 * "transfer_bridge:".
 * bico_transfer_check checks a handle whose bridge output is set as this
 * call would (a run refuses a bridge output).
 *
 * Reading one: a run (or bico_transfer_check, _plan, _explain) with
 * BICO_FILE_BRIDGE set, the fine-tune (source tuned, task vector or
 * source adapter) and outputs as for any run, and no statistics
 * (BICO_E_ARG).  Every option that shapes maps and the source and target
 * bases and configs default to the bridge's (the paths it recorded, as
 * real paths); one the handle sets (bico_transfer_set_param, _set_string,
 * _add_split, _add_tie, _set_file) must equal the bridge's, else BICO_E_ARG
 * naming it and both values.  Setting a choice (or a structure override)
 * to 0 asks for the default, which with a bridge is the bridge's.  The handle's own settings are as before
 * after the call (bico_transfer_get_param reports what was set, not what
 * the bridge gave).  Before any map is read, a base whose fingerprint
 * (of the kind the bridge recorded) differs from the bridge's, or a plan
 * that differs (a target tensor with another partner, handling or maps),
 * is BICO_E_ARG naming the file and the difference.  Then one pass over
 * the bridge's maps checks them and its digest: a bridge whose digest
 * does not match ("changed after it was written"), a map entry that is
 * not finite or of magnitude above 1.001 (the maps are orthogonal, or
 * semi-orthogonal: their entries are at most 1), a rank that is not an
 * integer in [0, min(rows, columns)] of its map or a thin flag other than
 * 0 or 1, or a recorded option outside its bounds is BICO_E_FORMAT naming
 * the bridge file, the tensor and the element, and nothing is written.  A
 * bridge without a digest (made before there was one) is read with the
 * same range checks.  The digest is no signature: it tells a file changed
 * by accident or by a tool that did not rewrite it, not one rewritten
 * whole by someone who recomputed it.  The assembler
 * (bico_transfer_assemble_begin) takes no bases from a bridge: a divided
 * run sets them. */
BICO_API bico_status bico_transfer_bridge(bico_transfer *t);

/* After a successful run: counts of target tensors by handling; any
 * out-pointer may be NULL.  updated: tensors that received an update
 * (linear, vector, tied, naive, padded, masked); unchanged: the rest. */
BICO_API bico_status bico_transfer_counts(const bico_transfer *t,
                                          size_t *updated, size_t *unchanged);

/* ---- Dividing a run among processes (bico-mpi) ----
 *
 * A front end that divides a run plans it (bico_transfer_plan: groups of
 * target tensors that share maps, each with an estimated cost), gives each
 * process a set of groups, and lets every process compute its tensors with
 * a partial run (bico_transfer_set_partial: updates go to a callback,
 * nothing is written); one process assembles the output from the updates
 * by tensor index (bico_transfer_assemble_*).  The front end only moves
 * data: checks, pairing, maps, arithmetic, writing and the report are the
 * library's, so the output equals a single process's byte for byte. */

/* What a partial run did to one target tensor. */
typedef enum bico_transfer_handling { /* from 1 (status.h); 0 is none */
  BICO_HANDLING_UNCHANGED = 1,
  BICO_HANDLING_LINEAR = 2,
  BICO_HANDLING_VECTOR = 3,
  BICO_HANDLING_TIED = 4,
  BICO_HANDLING_NAIVE = 5,
  BICO_HANDLING_PADDED = 6,
  BICO_HANDLING_MASKED = 7
} bico_transfer_handling;
/* A LoRA transfer (BICO_FILE_LORA) reports its adapter modules and saved
 * tensors with the same words, no others: factors carried by the maps are
 * LINEAR (a linear module) or TIED (an embedding table), as the module's
 * weight would be; NAIVE copies the factors; PADDED and MASKED (pad,
 * gradfix) build the dense update, then truncate it back to the adapter's
 * rank (the report's "energy_kept"); UNCHANGED on a dead layer.
 * "unchanged", "linear", ... as in the report; NULL for an unknown value.
 * _from_name: the value of a name (BICO_E_NULL, or BICO_E_NOTFOUND for an
 * unknown name, leaving *handling alone). */
BICO_API const char *bico_transfer_handling_name(int handling);
BICO_API bico_status bico_transfer_handling_from_name(const char *name, int *handling);

/* One computed target tensor, as a partial run hands it over.  `size` is
 * sizeof(bico_transfer_tensor) in the library that filled it: later
 * versions add fields at the end only, and a caller reads a field only
 * when size covers it.  Pointers are valid during the callback. */
typedef struct bico_transfer_tensor {
  size_t size;
  size_t index;             /* header order of the target base */
  const char *name;
  int handling;             /* bico_transfer_handling */
  const float *update;      /* alpha tau_B, count floats (finite); NULL
                               when unchanged */
  size_t count;
  const char *report_entry; /* the tensor's report entry: pass it to
                               bico_transfer_assemble_put unchanged */
} bico_transfer_tensor;

/* Receives each selected target tensor, in the target's order.  A status
 * other than BICO_OK stops the run with that status. */
typedef bico_status (*bico_transfer_sink_fn)(void *opaque,
                                             const bico_transfer_tensor *t);

/* Makes later runs partial: select[i] != 0 marks the target tensors to
 * compute (n must equal the target base's tensor count: else the run fails
 * with BICO_E_SHAPE); sink (not NULL) receives them.  No output, delta
 * output or report is written.  The array is copied.  select NULL restores
 * whole runs. */
BICO_API bico_status bico_transfer_set_partial(bico_transfer *t,
                                               const unsigned char *select,
                                               size_t n,
                                               bico_transfer_sink_fn sink,
                                               void *opaque);

/* Plans the configured run without computing anything: every check of a
 * run up to the first map (inputs opened, models paired, splits and ties
 * resolved).  Then the target's tensors fall in groups: the tensors whose
 * maps one target module provides (its weight, bias, norm vectors, tied
 * tokens), and every other tensor alone; each group has an estimated cost
 * in floating-point operations (solving its maps, the transport, reading
 * and writing its tensors).  Sending each group whole to one process
 * computes every map once. */
BICO_API bico_status bico_transfer_plan(bico_transfer *t);
/* After a successful plan: the target base's tensor count and the number
 * of groups. */
BICO_API bico_status bico_transfer_plan_size(const bico_transfer *t,
                                             size_t *tensors, size_t *groups);
/* Group g (< groups): its cost and its count tensor indices (ascending;
 * valid until the next plan or free). */
BICO_API bico_status bico_transfer_plan_group(const bico_transfer *t, size_t g,
                                              double *cost, size_t *count,
                                              const size_t **tensors);

/* The assembler: begin opens the target base and creates the output (and
 * delta output) as a whole run would, under temporary names; put takes
 * one tensor's result (update NULL when unchanged), in any order, and
 * writes it (theta_B + update, rounded once to the target's dtype, or the
 * base's bytes); commit, once every tensor is in, writes the report and
 * renames the files into place (the report last).  A failure, or free
 * before commit, leaves nothing.  A put of an index twice, out of range,
 * with a count other than the tensor's, or with a non-finite value fails
 * with BICO_E_ARG / BICO_E_SHAPE / BICO_E_NONFINITE.  A LoRA run cannot be
 * assembled (BICO_E_UNSUPPORTED). */
BICO_API bico_status bico_transfer_assemble_begin(bico_transfer *t);
BICO_API bico_status bico_transfer_assemble_put(bico_transfer *t, size_t index,
                                                int handling,
                                                const float *update,
                                                size_t count,
                                                const char *report_entry);
BICO_API bico_status bico_transfer_assemble_commit(bico_transfer *t);

/* The path set for a file slot (NULL when unset), valid until the slot
 * changes. */
BICO_API bico_status bico_transfer_get_file(const bico_transfer *t, int which,
                                            const char **path);

/* ---- Explaining the plan (bico inspect SOURCE TARGET) ----
 *
 * What the rules decide for a transfer, without running it: the family of
 * each model and what it was detected from (config.json beside the
 * weights of a model folder, or the tensor names), the block containers,
 * and per target tensor its role, source partner, the module whose maps
 * carry it, which maps, and the rule that chose this.  The answers are the
 * plan a run would make (the same functions), not a re-derivation.
 *
 * bico_transfer_explain needs only BICO_FILE_SOURCE_BASE and
 * BICO_FILE_TARGET_BASE (files or model folders; the other files are not
 * opened); the method, splits, ties and block options count as for a run.
 * Vocabulary mapping (both folders hold a tokenizer.json that differ) is
 * part of the plan for the BiCo methods.  The answers stay valid until the
 * next explain, or bico_transfer_free.  Out-structs: the caller sets
 * `size` to sizeof its struct; the library fills the fields that size
 * covers (later versions add fields at the end only). */
BICO_API bico_status bico_transfer_explain(bico_transfer *t);

typedef struct bico_transfer_model_info {
  size_t size;
  const char *family;      /* the model's family, the one a run uses:
                              config.json's model_type when the library
                              knows it ("llama", "mistral", "qwen2",
                              "gemma", "gemma2", "gpt2", "clip"), else
                              what the tensor names give away ("gpt2",
                              "clip"), else "none" */
  const char *family_from; /* what decided it: config.json's model_type
                              or the tensor names, in words; "" for
                              "none" */
  const char *blocks;      /* block container ("" for bare "<i>.") or NULL */
  size_t nblocks;
  size_t tensors;
  /* Since 1.0.0 (read them only with size covering them): */
  const char *model_type;  /* config.json's model_type, "" when there is
                              no config.json (BICO_FILE_*_CONFIG, or one
                              inside a base folder) or no model_type */
  int causal_lm;           /* 1: a causal (decoder) language model by its
                              config.json: an "architectures" entry ending
                              in ForCausalLM or LMHeadModel, or model_type
                              llama, mistral, qwen2, gemma, gemma2 */
  const char *causal_from; /* "PATH: architectures \"LlamaForCausalLM\""
                              (what decided causal_lm); "" when 0 */
} bico_transfer_model_info;
/* side 0: the source base, 1: the target base. */
BICO_API bico_status bico_transfer_explain_model(const bico_transfer *t,
                                                 int side,
                                                 bico_transfer_model_info *out);

typedef struct bico_transfer_decision {
  size_t size;
  const char *name;   /* target tensor */
  const char *source; /* its source partner, or NULL */
  int role;           /* bico_tensor_role */
  int handling;       /* bico_transfer_handling a run would report (predicted: a
                         dead layer's maps, found only when solving, still
                         leave a tensor unchanged) */
  const char *module; /* target module whose maps carry it, or NULL */
  int in_map;         /* 1: the input map applies */
  int out_maps;       /* output maps applied: 0, 1, or k of a split output */
  int transposed;     /* stored [in, out] (GPT-2 Conv1D) */
  int vocab;          /* rows matched by token string */
  const char *rule;   /* the rule that decided, in words */
} bico_transfer_decision;
/* The target base's tensor count into *n after a successful explain
 * (BICO_E_STATE before one). */
BICO_API bico_status bico_transfer_explain_count(const bico_transfer *t,
                                                 size_t *n);
/* Tensor i (header order of the target base). */
BICO_API bico_status bico_transfer_explain_tensor(const bico_transfer *t,
                                                  size_t i,
                                                  bico_transfer_decision *out);
/* The vocabulary map: token counts of the two tokenizers and how many
 * target tokens the source shares; all zero when rows are not mapped
 * (identical vocabularies, no tokenizer.json, or not a BiCo method). */
BICO_API bico_status bico_transfer_explain_vocab(const bico_transfer *t,
                                                 size_t *source_tokens,
                                                 size_t *target_tokens,
                                                 size_t *shared,
                                                 size_t *fresh);

#ifdef __cplusplus
}
#endif
#endif
