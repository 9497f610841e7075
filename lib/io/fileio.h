/* File plumbing shared by every reader and writer of the library (internal).
 *
 * - Strings: bico__strdup / bico__strndup through the context's allocator.
 * - Inputs: bico__open_input opens without blocking (a FIFO would hang a
 *   plain open) and refuses anything but a regular file after following
 *   symbolic links; bico__read_file reads a whole small file through it.
 * - Identity: two paths name the same file when they lead to the same
 *   device and inode (what exists) or to the same folder and name (what a
 *   commit will create or replace); bico__check_files applies that rule
 *   across every input and output of a run.
 * - Atomic multi-file commit: each output is written into a temporary file
 *   in its destination folder, named ".<base>.bico-tmp.<pid>.XXXXXX" (base
 *   cut to 200 bytes); bico__commit checks every destination, then renames
 *   each temporary file into place and fsyncs each folder.  Creating a
 *   temporary file removes the stale ones that dead processes left for the
 *   same destination (files, and folders with everything in them).
 * - Folder commit (lib/io/st_folder.c, lib/io/st_swap.c): a model folder is
 *   built complete as a sibling temporary folder of the same name form
 *   (".<folder>.bico-tmp.<pid>.XXXXXX", mode 0700 while it is built), the
 *   user's own files of the old folder carried into it by hard link; its
 *   bico__tmpfile has `isdir` set, and bico__commit swaps it in with one
 *   renameat2(RENAME_EXCHANGE) (rename for a new folder), then removes the
 *   old tree, which the exchange left under the temporary name.  A reader
 *   sees the old folder or the complete new one, never a mixture.  Where
 *   the file system refuses RENAME_EXCHANGE (EINVAL, ENOSYS) the old
 *   folder is renamed aside first and the new one renamed in: for that
 *   moment the folder is absent, never mixed.  A file output of the same
 *   commit whose folder is the swapped folder is moved into the new folder
 *   before the swap. */
#ifndef BICO_FILEIO_H
#define BICO_FILEIO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "internal.h"

/* A copy of s (or of its first n bytes, NUL added); NULL with a NOMEM
 * failure on ctx. */
char *bico__strdup(bico_ctx *ctx, const char *s);
char *bico__strndup(bico_ctx *ctx, const char *s, size_t n);

/* dir + "/" + file (no second '/' when dir ends in one). */
char *bico__path_join(bico_ctx *ctx, const char *dir, const char *file);

/* Opens `path` read-only (O_CLOEXEC) without blocking and checks that it
 * is a regular file; *fd gets the descriptor (blocking again) and *size its
 * length.  BICO_E_IO naming fn and the path otherwise ("is a FIFO, not a
 * regular file"). */
bico_status bico__open_input(bico_ctx *ctx, const char *fn, const char *path,
                             int *fd, uint64_t *size);

/* Reads all of fd's n bytes at offset off into buf, retrying EINTR and
 * short reads.  Returns 0, or an errno value (EIO when the file ends
 * early: it shrank since it was opened). */
int bico__pread_all(int fd, void *buf, size_t n, uint64_t off);

/* Reads a whole regular file of at most `limit` bytes into ctx memory,
 * NUL-terminated (*len excludes the NUL).  Larger: BICO_E_FORMAT naming
 * `what` (for example "index") and the limit. */
bico_status bico__read_file(bico_ctx *ctx, const char *fn, const char *what,
                            const char *path, size_t limit, char **out,
                            size_t *len);

/* ---- identity ---- */

/* One file of a run: its role ("output", "report", "source adapter
 * weights", ...) for messages, its path, and whether the run writes it. */
typedef struct bico__fileuse {
  const char *what;
  const char *path;
  int output;
  int newdir; /* output whose folder may not exist yet */
  int folder; /* output: 1, a model folder the run writes into (path is
               * the folder itself; it may not exist yet); 2, a file such a
               * folder output writes (compared as a file, never as
               * lying inside its own folder).  input: 3, a model folder
               * the run reads (given as the folder or by its index): no
               * output file may be written directly inside it */
} bico__fileuse;

/* Refuses (BICO_E_ARG, naming both roles and paths) any output that is the
 * same file as another entry, by identity (device and inode; folder and
 * name), whatever the spelling ("ad/", "./ad", symbolic links, hard links).
 * A folder output (`folder`) is refused when it is the same folder as
 * another entry (an input given as a folder), or when any other entry, input
 * or output, lies inside it at any depth (its real folder, after following
 * a final symbolic link, is the output folder or beneath it): a run never
 * writes into a folder that holds one of its inputs or another of its
 * outputs.  An existing folder output that is not a folder is BICO_E_ARG.
 * An output file lying directly in an input model folder (`folder` 3: a
 * folder, or the folder of a model.safetensors.index.json; its
 * config.json, tokenizer or any other file of that model) is refused
 * too.
 * Refuses (BICO_E_IO) an output whose destination is not a regular file
 * (folder, FIFO, device, socket, after following a symbolic link) or whose
 * folder is missing (unless `newdir`: a folder the run creates).  Entries with a NULL path are skipped. */
bico_status bico__check_files(bico_ctx *ctx, const char *fn,
                              const bico__fileuse *u, size_t n);

/* ---- atomic commit ---- */

typedef struct bico__tmpfile {
  char *path; /* destination */
  char *tmp;  /* temporary file */
  int fd;     /* -1 once closed */
  int gone;   /* the temporary file was renamed or removed */
  int setmode; /* bico__tmp_finish gives `mode`, not the destination's */
  mode_t mode;
  int nosync; /* no fsync: a folder commit syncs the whole new folder once
                 (bico__sync_folder), not file by file */
  /* A folder (bico__tmp_folder): tmp is the complete new folder, path the
   * folder it replaces; aside (ctx memory) where the old folder goes when
   * RENAME_EXCHANGE is refused; oldtree: tmp (1) or aside (2) holds the
   * old folder after the swap, to remove. */
  int isdir, oldtree;
  char *aside;
} bico__tmpfile;

/* Creates the temporary file for destination `path` (what names the role
 * for messages), after removing stale ones of dead processes.  A path that
 * ends in '/' or names a folder is BICO_E_ARG. */
bico_status bico__tmp_create(bico_ctx *ctx, const char *fn, const char *what,
                             const char *path, bico__tmpfile *t);
/* A temporary file at a chosen name `tmp` (inside a temporary folder of
 * this run: no stale scan, O_EXCL, mode 0600 until finished) for the
 * destination `path` (named in messages). */
bico_status bico__tmp_create_in(bico_ctx *ctx, const char *fn,
                                const char *what, const char *path,
                                const char *tmp, bico__tmpfile *t);
/* The temporary folder for the folder `path` (its real path: a sibling in
 * the same parent), created mode 0700 after one scan for leftovers.
 * BICO_E_IO naming `shown` (the user's spelling) when the parent folder
 * is missing or not writable. */
bico_status bico__tmp_folder(bico_ctx *ctx, const char *fn, const char *shown,
                             const char *path, bico__tmpfile *t);
/* Removes path and everything under it without following symbolic links
 * (a folder it cannot enter is made 0700 first when it is the caller's);
 * what cannot be removed stays.  Returns 0 or the first errno. */
int bico__remove_tree(const char *path);
/* Makes everything written under the folder path durable at once
 * (syncfs of its file system, fsync of the folder where that is missing):
 * one call for thousands of small files.  0 or an errno. */
int bico__sync_folder(const char *path);
/* Swaps the complete folder t->tmp in for t->path (lib/io/st_swap.c): 0 or
 * an errno, with t->oldtree set when an old folder was moved out. */
int bico__swap_folder(bico__tmpfile *t);
/* The process's umask, read without changing it (022 when unknown). */
mode_t bico__umask(void);
/* Writes len bytes at the current end (for small text files). */
bico_status bico__tmp_write(bico_ctx *ctx, const char *fn, bico__tmpfile *t,
                            const void *buf, size_t len);
/* Gives the file its mode (the existing destination's permission bits,
 * never setuid, setgid or sticky; else 0666 less the umask), fsyncs and
 * closes it. */
bico_status bico__tmp_finish(bico_ctx *ctx, const char *fn, bico__tmpfile *t);
/* Removes the temporary file (unless gone; a folder with everything in
 * it) and frees the names; accepts a zeroed t. */
void bico__tmp_discard(bico_ctx *ctx, bico__tmpfile *t);

/* Commits n finished temporary files: checks every destination first (a
 * folder or other non-regular file there is BICO_E_IO naming it, a file
 * where a folder entry goes too, and nothing is renamed), moves the files
 * whose folder is a folder entry's destination into that entry's new
 * folder, then renames each into place (swaps each folder in) and fsyncs
 * each folder, and last removes the old folders the swaps moved out.  On
 * failure the temporary files not yet renamed are removed.  Allocates
 * only before the first rename, so it cannot fail for lack of memory
 * after one. */
bico_status bico__commit(bico_ctx *ctx, const char *fn, bico__tmpfile *const *t,
                         size_t n);

/* bico__commit of two writers' lists (bico__stwriter_finish_all; either
 * may be empty) and one more file (NULL: none), when st is BICO_OK;
 * returns st otherwise.  The list is gathered before anything is
 * renamed. */
bico_status bico__commit_lists(bico_ctx *ctx, const char *fn, bico_status st,
                               bico__tmpfile *const *a, size_t na,
                               bico__tmpfile *const *b, size_t nb,
                               bico__tmpfile *c);

/* The temporary-name marker and its form, for the commands' signal
 * handlers: ".<base>" BICO__TMP_MARK "<pid>.XXXXXX". */
#define BICO__TMP_MARK ".bico-tmp."

/* ---- fingerprints (lib/io/fingerprint.c) ---- */

/* The fingerprint of an open model f (docs/formats.md, "Bridge files"):
 * SHA-256, as 64 hexadecimal digits, of its tensors in name order (each
 * one's name, dtype, shape, byte size and the bytes at its start, middle
 * and end) and of nfiles whole files (files[k] with role roles[k], NULL
 * entries skipped: a config.json, a tokenizer.json). */
bico_status bico__fingerprint(bico_ctx *ctx, const bico_stfile *f,
                              const char *const *files,
                              const char *const *roles, size_t nfiles,
                              char hex[65]);

#endif
