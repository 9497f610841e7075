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
 *   same destination. */
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
} bico__tmpfile;

/* Creates the temporary file for destination `path` (what names the role
 * for messages), after removing stale ones of dead processes.  A path that
 * ends in '/' or names a folder is BICO_E_ARG. */
bico_status bico__tmp_create(bico_ctx *ctx, const char *fn, const char *what,
                             const char *path, bico__tmpfile *t);
/* Writes len bytes at the current end (for small text files). */
bico_status bico__tmp_write(bico_ctx *ctx, const char *fn, bico__tmpfile *t,
                            const void *buf, size_t len);
/* Gives the file its mode (the existing destination's permission bits,
 * never setuid, setgid or sticky; else 0666 less the umask), fsyncs and
 * closes it. */
bico_status bico__tmp_finish(bico_ctx *ctx, const char *fn, bico__tmpfile *t);
/* Removes the temporary file (unless gone) and frees both names; accepts
 * a zeroed t. */
void bico__tmp_discard(bico_ctx *ctx, bico__tmpfile *t);

/* Commits n finished temporary files: checks every destination first (a
 * folder or other non-regular file there is BICO_E_IO naming it, and
 * nothing is renamed), then renames each into place and fsyncs each
 * folder.  On failure the temporary files not yet renamed are removed.
 * Allocates nothing, so it cannot fail for lack of memory after a rename. */
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

#endif
