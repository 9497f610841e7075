/* safetensors internals shared by its sources (never installed):
 *   lib/io/st_convert.c  dtypes and element conversion
 *   lib/io/st_header.c   one file: open, header validation
 *   lib/io/st_index.c    sharded checkpoints (model.safetensors.index.json)
 *   lib/io/safetensors.c the reader's public functions (pread, no mapping)
 *   lib/io/st_writer.c   the atomic writer */
#ifndef BICO_ST_INTERNAL_H
#define BICO_ST_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"
#include "json.h"

#define BICO__ST_HEADER_LIMIT 100000000u
#define BICO__ST_MAX_NDIM 64

typedef struct bico__st_tensor {
  const char *name;
  int dtype;
  size_t ndim;
  size_t *shape;
  size_t numel, nbytes;
  uint64_t begin; /* offset in the data buffer */
  uint64_t off;   /* offset of the first byte in its file */
  size_t file;    /* index into files */
} bico__st_tensor;

typedef struct bico__st_file {
  char *path;
  int fd; /* -1 when not open */
  uint64_t size;
  /* What bico_stfile_check_unchanged compares: the file's identity and
   * modification time when opened, and a digest of its header's bytes
   * (the length field and the JSON). */
  uint64_t dev, ino;
  int64_t mtime_sec, mtime_nsec;
  char head[65];
} bico__st_file;

typedef struct bico__st_meta {
  const char *key, *value;
} bico__st_meta;

struct bico_stfile {
  bico_ctx *ctx;
  const char *path; /* as opened (the index, for a sharded checkpoint) */
  bico__arena arena; /* names, shapes, metadata, paths */
  bico__st_file *files;
  size_t nfiles;
  bico__st_tensor *tensors;
  size_t count, cap;
  size_t *by_name; /* tensor indices sorted by name */
  bico__st_meta *meta;
  size_t nmeta;
  /* bico_stfile_data's copy of the last tensor asked for. */
  void *raw;
  size_t rawcap;
};

/* A name for messages: long ones cut with "...". */
const char *bico__st_shortname(const char *s, char *buf, size_t cap);

uint64_t bico__st_load_le(const unsigned char *p, size_t n);
void bico__st_store_le(unsigned char *p, uint64_t v, size_t n);
/* Nearest value (ties to even) of a binary format with ebits exponent and
 * mbits mantissa bits, as its bit pattern (overflow: Inf). */
uint64_t bico__st_round(double x, int ebits, int mbits);
/* One element of dtype d at p (little-endian, any alignment). */
double bico__st_elem_f64(const unsigned char *p, int d);
float bico__st_elem_f32(const unsigned char *p, int d);

/* The digest of a header as bico_stfile_check_unchanged compares it:
 * SHA-256 of the 8-byte length field and the n bytes of JSON. */
void bico__st_header_digest(const unsigned char lenb[8], const char *json,
                            size_t n, char hex[65]);

/* Opens files[file] (its path already set) and validates its header,
 * appending its tensors; want_meta keeps "__metadata__". */
bico_status bico__st_load_one(bico_stfile *f, size_t file, int want_meta);
/* Opens every shard an index names (f->files allocated here). */
bico_status bico__st_load_index(bico_stfile *f, const char *path);

/* ---- output folders (lib/io/st_folder.c) ---- */

struct bico__tmpfile;
#include "fileio.h"

/* One file a writer writes: a file writer has one, a folder writer one
 * per shard. */
typedef struct bico__wshard {
  char *name;          /* file name inside the folder (folder writers) */
  bico__tmpfile tf;    /* its temporary file */
  uint64_t data_start; /* 8 + padded header length once laid out */
  uint64_t bytes;      /* its tensors' bytes */
} bico__wshard;

typedef struct bico__wfolder bico__wfolder;

/* Starts the output folder dir (its parent must exist): everything is
 * written into a temporary sibling folder (lib/io/fileio.h, "Folder
 * commit"), swapped in at the commit; a symbolic link to a folder stands
 * for the folder it leads to.  like (NULL: none) is the model file or
 * folder whose shard layout is followed (max_shard 0) and, for a folder,
 * whose other files are copied (checked here: a symbolic link leading out
 * of the folder, other than a Hugging Face cache snapshot's link into its
 * blobs/, is BICO_E_IO).  dir the same folder as like is BICO_E_ARG. */
bico_status bico__wfolder_open(bico_ctx *ctx, const char *fn, const char *dir,
                               const char *like, uint64_t max_shard,
                               bico__wfolder **out);
/* Removes what was not committed (and the folder, if this writer made
 * it and nothing else is in it); accepts NULL. */
void bico__wfolder_free(bico_ctx *ctx, bico__wfolder *f);
/* The shard plan for n tensors (names, byte sizes, in declaration
 * order): of[k] gets tensor k's shard; *sh (nsh entries, ctx memory)
 * their names and temporary files. */
bico_status bico__wfolder_layout(bico_ctx *ctx, const char *fn,
                                 bico__wfolder *f, size_t n,
                                 const char *const *names,
                                 const uint64_t *sizes, size_t *of,
                                 bico__wshard **sh, size_t *nsh);
/* After the shards are finished: the index (several shards, or one not
 * named model.safetensors), the copies, and the user's files of the old
 * folder carried over (everything but the weights the new model replaces:
 * model.safetensors, the index, model-NNNNN-of-NNNNN.safetensors, files
 * with a weight suffix the old index names), the folder's mode. */
bico_status bico__wfolder_finish(bico_ctx *ctx, const char *fn,
                                 bico__wfolder *f, size_t n,
                                 const char *const *names,
                                 const uint64_t *sizes, const size_t *of,
                                 const bico__wshard *sh, size_t nsh);
/* What to commit: one entry, the new folder (isdir). */
bico_status bico__wfolder_files(bico_ctx *ctx, bico__wfolder *f,
                                bico__wshard *sh, size_t nsh,
                                bico__tmpfile ***list, size_t *n);
/* After the commit: the folder's files are in place (nothing to remove
 * any more). */
void bico__wfolder_committed(bico__wfolder *f);

/* What every derived checkpoint says about itself (transfer, merge): the
 * base's "__metadata__" kept except "bico.*" keys and a sharded base's
 * total_size (it describes the base's files), "format": "pt" added when
 * absent (transformers refuses metadata without it), then "bico.version",
 * "bico.method" (when not NULL) and "bico.alpha" (nine significant digits,
 * '.' whatever the locale).  The caller adds its own inputs' keys. */
bico_status bico__stwriter_provenance(bico_stwriter *w,
                                      const bico_stfile *base,
                                      const char *method, double alpha);

/* A "__metadata__" value known only once the data is written (a digest
 * of it): replaces the value of `key`, added before the first write with a
 * placeholder of the same length, and rewrites the header(s) in place.
 * Both values must be printable ASCII without '"' or '\\' (their JSON is
 * themselves); else, or for a key never added, BICO_E_STATE.  Before the
 * commit. */
bico_status bico__stwriter_set_metadata(bico_stwriter *w, const char *key,
                                        const char *value);

#endif
