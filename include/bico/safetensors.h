/* libbico: safetensors files (reader, sharded checkpoints, atomic writer).
 *
 * The format (huggingface/safetensors): an 8-byte little-endian unsigned
 * header length N, N bytes of JSON header, then the data buffer.  The header
 * maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
 * (offsets relative to the start of the data buffer) and may hold a
 * "__metadata__" object of string values.  Data are little-endian and
 * row-major.
 *
 * Reading: bico_stfile_open opens the file read-only and validates the
 * whole header before returning: header length (at most 100,000,000 bytes
 * and within the file), strict JSON (RFC 8259: no trailing commas, no NaN
 * literals, valid escapes and UTF-8, duplicate keys rejected, nesting depth
 * limited), unique tensor names, known dtypes, shapes of non-negative
 * integers whose byte size does not overflow, data_offsets with
 * end - begin == byte size, offsets that tile the data buffer from 0 with no
 * gap, overlap or trailing byte, unknown keys in a tensor entry rejected,
 * and "__metadata__" holding strings only.  Zero-size tensors (a 0 in the
 * shape) are allowed.  A rejection is BICO_E_FORMAT (BICO_E_IO for an OS
 * error, BICO_E_UNSUPPORTED for a valid dtype this version cannot read such
 * as F8_E4M3) with a message naming the file, the tensor (if any) and the
 * reason.  Only a regular file is opened (after following symbolic links):
 * a FIFO, device or folder is BICO_E_IO, and opening never blocks.  Tensor
 * data are read with pread into the caller's buffers, never mapped, so a
 * file truncated while open makes the read fail with BICO_E_IO instead of
 * raising SIGBUS in the host process.  The file stays open until
 * bico_stfile_free: replace it by renaming a new file into place, as
 * bico_stwriter does.
 *
 * Writing: a bico_stwriter writes into a temporary file in the output's
 * folder, named ".<basename>.bico-tmp.<pid>.XXXXXX" (the basename cut to
 * 200 bytes), and bico_stwriter_commit renames it into place only once
 * complete (after fsync; the folder is then fsynced too).  The final path
 * is never opened for writing, so on any failure an existing file there
 * stays byte-identical; freeing an uncommitted writer removes the temporary
 * file, and creating a writer removes the temporary files for the same
 * output that runs no longer running left behind (a kill -9, a power
 * cut).  A writer holds an exclusive flock(2) on its temporary file until
 * it is committed or freed, and only a temporary whose lock can be taken
 * is removed: never by the pid in its name alone, which a run in another
 * pid namespace (a container sharing the folder) does not share.  A
 * symbolic link at the output path is replaced by the new file,
 * not followed; a folder, FIFO, device or socket there is refused.
 *
 * Signals: libbico installs no signal handlers.  A write beyond the process's
 * file-size limit (`ulimit -f`, RLIMIT_FSIZE) raises SIGXFSZ, which kills the
 * process by default; callers that set such a limit should ignore SIGXFSZ
 * (signal(SIGXFSZ, SIG_IGN)) so that the write fails with EFBIG and the
 * writer reports BICO_E_IO instead. */
#ifndef BICO_SAFETENSORS_H
#define BICO_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>
#include "ctx.h"
#include "dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Reading ---- */

typedef struct bico_stfile bico_stfile;

/* Opens and validates a safetensors file (O_RDONLY, O_CLOEXEC; regular
 * files only).  A
 * path ending in ".json" is a sharded checkpoint's index
 * (model.safetensors.index.json): its "weight_map" maps each tensor name to
 * a shard file name in the index's own folder (no '/' allowed); every shard
 * is opened and validated, and together they read as one file.  A tensor
 * the weight_map lists but its shard lacks, or a tensor a shard holds that
 * the weight_map does not assign to that shard, is BICO_E_FORMAT naming the
 * files and the tensor.  A folder (a Hugging Face model folder) stands for
 * its model.safetensors.index.json, else its model.safetensors, else its
 * single *.safetensors file; a folder holding a PEFT adapter or PyTorch
 * pickles is BICO_E_FORMAT, one with nothing to read BICO_E_NOTFOUND, and a
 * PyTorch pickle given as a file is BICO_E_FORMAT with the conversion
 * command in the message.  The handle keeps a pointer to ctx (which must
 * outlive it) and reports failures there. */
BICO_API bico_status bico_stfile_open(bico_ctx *ctx, const char *path,
                                      bico_stfile **out);
/* Closes the file and frees the handle (nothing is mapped: reads use
 * pread); accepts NULL.  Pointers obtained from the handle die with it. */
BICO_API void bico_stfile_free(bico_stfile *f);

/* The number of tensors into *n; BICO_E_NULL for a NULL handle or n.
 * Tensors are indexed 0..n-1 in header order (for a sharded checkpoint:
 * shards in order of first appearance in the weight_map, each in its
 * header order). */
BICO_API bico_status bico_stfile_count(const bico_stfile *f, size_t *n);

/* Describes tensor `index`; any out-pointer may be NULL.  *name, *shape stay
 * valid until bico_stfile_free.  ndim may be 0 (a scalar, one element). */
BICO_API bico_status bico_stfile_tensor_info(const bico_stfile *f,
                                             size_t index, const char **name,
                                             int *dtype, size_t *ndim,
                                             const size_t **shape);
/* Element count (product of the shape) and byte size of tensor `index`;
 * either out-pointer may be NULL. */
BICO_API bico_status bico_stfile_tensor_size(const bico_stfile *f,
                                             size_t index, size_t *numel,
                                             size_t *nbytes);
/* The path of the file holding tensor `index` (the shard, for a sharded
 * checkpoint); valid until close. */
BICO_API bico_status bico_stfile_tensor_path(const bico_stfile *f,
                                             size_t index, const char **path);

/* Looks a tensor up by name (O(log n)); BICO_E_NOTFOUND naming it if
 * absent. */
BICO_API bico_status bico_stfile_find(const bico_stfile *f, const char *name,
                                      size_t *index);

/* The raw little-endian bytes of tensor `index`, copied into a buffer the
 * handle owns: valid until the next bico_stfile_data call on the same
 * handle or close (copy them to keep them).  Not to be called from two
 * threads at once on one handle; the read functions below may be. */
BICO_API bico_status bico_stfile_data(const bico_stfile *f, size_t index,
                                      const void **data, size_t *nbytes);

/* Converts tensor `index` to float into out; count must equal its element
 * count (else BICO_E_SHAPE).  Every dtype converts: F16/BF16 exactly, F64
 * and the integer types rounded to nearest (F64 beyond float's range gives
 * +-Inf), BOOL to 0/1.  NaN and Inf in the file are passed through: use
 * bico_stfile_check_finite to refuse them. */
BICO_API bico_status bico_stfile_read_f32(const bico_stfile *f, size_t index,
                                          float *out, size_t count);
/* Elements [first, first + count) of tensor `index` in row-major order
 * (for streaming large tensors row block by row block); the range must lie
 * inside the tensor (else BICO_E_SHAPE).  As everywhere in this header
 * (read_f32, the writer's write_f32 and write_f32_range), the element
 * count follows the buffer it sizes. */
BICO_API bico_status bico_stfile_read_f32_range(const bico_stfile *f,
                                                size_t index, size_t first,
                                                float *out, size_t count);
/* The same into double (F64 exactly; I64/U64 rounded to nearest). */
BICO_API bico_status bico_stfile_read_f64(const bico_stfile *f, size_t index,
                                          double *out, size_t count);
BICO_API bico_status bico_stfile_read_f64_range(const bico_stfile *f,
                                                size_t index, size_t first,
                                                double *out, size_t count);

/* BICO_OK if tensor `index` holds no NaN or Inf (integer dtypes always
 * pass); else BICO_E_NONFINITE naming the file, tensor and element. */
BICO_API bico_status bico_stfile_check_finite(const bico_stfile *f,
                                              size_t index);

/* Whether every file the handle reads is still the file it opened, for a
 * front end that reads a model a tensor at a time over a long run (a shard
 * rewritten in place meanwhile would give an output of two versions):
 * each file's size and modification time (through the open descriptor),
 * its path still naming that file (device and inode), and its header's
 * bytes read again, all as when the handle opened it (the tensors' bytes
 * are not read again: a rewrite that keeps the size, the header and the
 * modification time goes unseen).  BICO_OK, or BICO_E_IO naming the file
 * and what changed.  bico_transfer_run, bico_merge_run and
 * bico_lora_transfer check their inputs so before they commit. */
BICO_API bico_status bico_stfile_check_unchanged(const bico_stfile *f);

/* The "__metadata__" entries, in header order.  For a sharded checkpoint:
 * the index's "metadata" object, strings as they are and numbers as their
 * JSON text (other values are skipped).  The count into *n (BICO_E_NULL for
 * a NULL handle or n). */
BICO_API bico_status bico_stfile_metadata_count(const bico_stfile *f,
                                                size_t *n);
BICO_API bico_status bico_stfile_metadata_at(const bico_stfile *f, size_t i,
                                             const char **key,
                                             const char **value);
/* The value for `key`; BICO_E_NOTFOUND if absent. */
BICO_API bico_status bico_stfile_metadata_get(const bico_stfile *f,
                                              const char *key,
                                              const char **value);

/* ---- Writing ---- */

typedef struct bico_stwriter bico_stwriter;

/* Starts writing `path`: creates the temporary file in its folder at once
 * (so an unwritable folder fails here, BICO_E_IO).  A path that is an
 * existing directory, or that ends in ".json" (the reader's name for a
 * sharded index), is BICO_E_ARG.  Then: bico_stwriter_add_metadata and
 * bico_stwriter_declare for every tensor, then one write per tensor (any
 * order), then bico_stwriter_commit. */
BICO_API bico_status bico_stwriter_create(bico_ctx *ctx, const char *path,
                                          bico_stwriter **out);
/* Starts writing a Hugging Face model folder `dir` (created when missing;
 * its parent must exist; a symbolic link to a folder stands for that
 * folder).  The same calls as for a file follow; the commit writes:
 *  - the weights: with max_shard_size > 0, shards filled greedily in
 *    declaration order (a new shard when the next tensor would pass
 *    max_shard_size bytes; a larger tensor gets a shard of its own) named
 *    model-00001-of-0000N.safetensors, or model.safetensors when one shard
 *    holds everything; with 0, the tensor-to-shard assignment and the file
 *    names of `like` when it is sharded (a tensor it lacks goes with the
 *    one declared before it), else one model.safetensors.  Every shard
 *    carries the metadata.
 *  - model.safetensors.index.json when the weights are not one
 *    model.safetensors: metadata.total_size (the tensors' bytes) and
 *    weight_map (tensor -> file).
 *  - when `like` (a model file or folder, may be NULL) is a folder, a copy
 *    of each of its regular files other than weights and indexes
 *    (*.safetensors, *.bin, *.pt, *.pth, *.ckpt, *.h5, *.msgpack, *.gguf,
 *    *.onnx, *.index.json) and hidden files: config.json, tokenizer
 *    files, generation_config.json, README.md and the like (not its
 *    sub-folders, nor the files its index names as shards), each with its
 *    permission bits.  A symbolic link there whose real path leaves the
 *    folder (other than a Hugging Face cache snapshot's link into its
 *    repository's blobs/) is BICO_E_IO here, naming it.
 * The folder is committed in one step: it is built complete as a hidden
 * sibling ".<dir>.bico-tmp.<pid>.XXXXXX" and swapped in with
 * renameat2(RENAME_EXCHANGE) (rename for a new folder), so a reader sees
 * the old folder or the new one, never a mixture; a failure before that
 * leaves nothing.  Everything of the old folder the commit does not write
 * is carried into the new one (hard links; sub-folders and dot files
 * too), except an earlier model's weights that would mislead a reader:
 * model.safetensors, the index, model-NNNNN-of-NNNNN.safetensors files and
 * the old index's shards that have a weight suffix (never a file of
 * another name).  Sub-folders are recreated with their mode, owner (as
 * root), extended attributes (ACLs included) and access and modification
 * times; a file that cannot be linked is copied with the same.  An entry
 * that vanishes while it is carried fails the commit (BICO_E_IO).  After
 * the swap the old tree is removed entry by entry, only what was carried
 * or replaced: an entry another process made there during the run is
 * moved into the new folder, and one that cannot be placed keeps the old
 * tree as ".<dir>.bico-kept.<pid>.XXXXXX" (never removed by a later run).
 * The folder keeps its mode and extended attributes.  `dir` naming the
 * same folder as `like` is BICO_E_ARG; `dir` naming something that is not
 * a folder is BICO_E_ARG, a dangling symbolic link too (naming where it
 * leads); a mount point, a folder holding one at any depth (BICO_E_IO)
 * and the working directory or a folder holding it (BICO_E_ARG) are
 * refused here, before anything is written.  The writer takes the
 * folder's lock (folder.h) from here until the commit has removed the old
 * tree (or until freed): another process writing the folder is BICO_E_IO
 * naming it; a bico_folder, bico_transfer_run or bico_merge_run of this
 * process that holds the folder is joined. */
BICO_API bico_status bico_stwriter_create_folder(bico_ctx *ctx,
                                                 const char *dir,
                                                 const char *like,
                                                 uint64_t max_shard_size,
                                                 bico_stwriter **out);

/* The rule every front end uses for an output path: 1 when `output` is
 * to be written as a model folder (bico_stwriter_create_folder), 0 for a
 * safetensors file.  A folder when `output` is an existing folder, ends
 * in '/', or (nothing existing there) `like` is a folder and `output`
 * ends neither in ".safetensors" nor in ".json".  NULL output: 0. */
BICO_API int bico_stwriter_output_is_folder(const char *output, const char *like);

/* Removes the temporary file unless committed, and frees; accepts NULL. */
BICO_API void bico_stwriter_free(bico_stwriter *w);

/* Adds a "__metadata__" entry (UTF-8 strings; a repeated key is
 * BICO_E_ARG).  Only before the first write (else BICO_E_STATE). */
BICO_API bico_status bico_stwriter_add_metadata(bico_stwriter *w,
                                                const char *key,
                                                const char *value);

/* Declares a tensor: name (UTF-8, not "__metadata__", unique: else
 * BICO_E_ARG), dtype (any bico_dtype), ndim (0..64) extents (0 allowed).
 * Tensors are laid out in declaration order.  Only before the first write
 * (else BICO_E_STATE). */
BICO_API bico_status bico_stwriter_declare(bico_stwriter *w, const char *name,
                                           int dtype, size_t ndim,
                                           const size_t *shape);

/* Writes a declared tensor's data once (a second write is BICO_E_STATE;
 * an undeclared name BICO_E_NOTFOUND).  count must equal the element count
 * (else BICO_E_SHAPE).  write_f32/write_f64 convert to the declared dtype,
 * which must be F32, F16, BF16 or F64 (else BICO_E_ARG), rounding to nearest
 * even; NaN and Inf pass through, but a finite value that overflows the
 * declared dtype (70000 into F16) is BICO_E_NONFINITE naming the tensor and
 * element.  write_raw copies nbytes little-endian bytes as they are (nbytes
 * must equal the byte size: BICO_E_SHAPE).  A failed write leaves the
 * tensor unwritten, so it may be retried. */
BICO_API bico_status bico_stwriter_write_f32(bico_stwriter *w,
                                             const char *name,
                                             const float *data, size_t count);
BICO_API bico_status bico_stwriter_write_f64(bico_stwriter *w,
                                             const char *name,
                                             const double *data,
                                             size_t count);
BICO_API bico_status bico_stwriter_write_raw(bico_stwriter *w,
                                             const char *name,
                                             const void *data, size_t nbytes);

/* Streaming a large tensor in pieces: elements [first, first + count) in
 * row-major order, converted as write_f32/write_f64 convert.  Ranges go in
 * order, each starting where the last ended (first must equal the count
 * written so far, else BICO_E_STATE; a range past the end is
 * BICO_E_SHAPE); the tensor counts as written with its last element, and
 * a commit before then is refused as for an unwritten tensor.  A failed
 * range write leaves the count where it was, so it may be retried.  With
 * bico_stfile_read_f32_range this carries a tensor through a fixed amount
 * of memory. */
BICO_API bico_status bico_stwriter_write_f32_range(bico_stwriter *w,
                                                   const char *name,
                                                   size_t first,
                                                   const float *data,
                                                   size_t count);
BICO_API bico_status bico_stwriter_write_f64_range(bico_stwriter *w,
                                                   const char *name,
                                                   size_t first,
                                                   const double *data,
                                                   size_t count);

/* Finishes: every declared tensor must have been written (else
 * BICO_E_STATE naming the first missing one; a tensor of zero bytes needs
 * no write).  Writes the header (padded
 * with spaces to a multiple of 8 bytes), fsyncs, renames into place,
 * fsyncs the folder.  A new file gets mode 0666 less the umask; an existing
 * one keeps its permission bits (never setuid, setgid or sticky).  A
 * destination that became a folder or another non-regular file meanwhile
 * is BICO_E_IO and nothing is renamed.  A commit refused for a missing tensor (BICO_E_STATE)
 * may be retried after writing it; after any other outcome only
 * bico_stwriter_free is allowed. */
BICO_API bico_status bico_stwriter_commit(bico_stwriter *w);

#ifdef __cplusplus
}
#endif
#endif
