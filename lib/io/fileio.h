/* File plumbing shared by every reader and writer of the library (internal),
 * one concept a file:
 *
 * - Strings (lib/io/strings.c): bico__strdup / bico__strndup through the
 *   context's allocator, paths and their parts, a file's kind, a shape.
 * - Inputs (lib/io/input.c): bico__open_input opens without blocking (a FIFO would hang a
 *   plain open) and refuses anything but a regular file after following
 *   symbolic links; bico__read_file reads a whole small file through it.
 * - Identity (lib/io/identity.c): two paths name the same file when they lead to the same
 *   device and inode (what exists) or to the same folder and name (what a
 *   commit will create or replace); bico__check_files applies that rule
 *   across every input and output of a run.
 * - Atomic multi-file commit (lib/io/tmpfile.c: the temporaries, their
 *   locks and the stale ones' removal; lib/io/commit.c: the commit): each
 *   output is written into a temporary file
 *   in its destination folder, named ".<base>.bico-tmp.<pid>.XXXXXX" (base
 *   cut to 200 bytes); bico__commit checks every destination, then renames
 *   each temporary file into place and fsyncs each folder.  The run holds
 *   an exclusive flock(2) on each of its temporaries (a file, or a
 *   folder's descriptor; the old folder a swap moves to a temporary name
 *   too) from just after it is made until it is renamed or removed.
 *   Creating a temporary file removes the stale ones that runs left for
 *   the same destination (files, and folders with everything in them):
 *   this user's entries whose lock the scan can take (LOCK_EX|LOCK_NB),
 *   never by the pid in the name alone (a run in another pid namespace
 *   has a pid this process cannot see); an entry whose pid is a live
 *   process here stays as well.
 * - Folder commit (lib/io/folder_guard.c: the lock, the checks and the new
 *   folder's attributes; lib/io/folder_swap.c: the swap, the user's files
 *   carried, the old tree retired; lib/io/st_folder.c builds a model
 *   folder, lib/lora/lora_io.c an adapter's): a model folder is
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
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>

#include "internal.h"

/* A copy of s (or of its first n bytes, NUL added); NULL with a NOMEM
 * failure on ctx. */
char *bico__strdup(bico_ctx *ctx, const char *s);
char *bico__strndup(bico_ctx *ctx, const char *s, size_t n);
/* path without its trailing '/'s ("/" stays); plain malloc (free() it),
 * NULL when out of memory. */
char *bico__trim_slashes(const char *path);

/* dir + "/" + file (no second '/' when dir ends in one). */
char *bico__path_join(bico_ctx *ctx, const char *dir, const char *file);

/* The folder part of path ("." when none; "/" for "/x") into buf. */
void bico__dir_of(const char *path, char *buf, size_t cap);
/* The last component of path (inside it). */
const char *bico__base_of(const char *path);
/* A file mode's kind for messages: "a file", "a folder", "a FIFO", ... */
const char *bico__kind_of(mode_t m);

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
  /* What the swap may do with an existing folder (isdir): carried (the
   * record of bico__carry_files: the old tree is then retired entry by
   * entry, bico__retire_tree), replace (its contents are dropped), or
   * neither (a folder that appeared meanwhile is refused: EEXIST). */
  const struct bico__carried *carried;
  int replace;
  /* Where the old tree goes when it holds entries that were neither
   * carried nor dropped (preallocated: the commit allocates nothing after
   * its first rename); kept is set once it went there. */
  char *keptname;
  int kept;
  /* Descriptors holding the run's exclusive flock(2), plus 1 (0: none, so
   * that a zeroed t holds none): lock on the temporary (the file, through
   * a second descriptor that outlives fd; the new folder), oldlock on the
   * old folder a swap moved to a temporary name.  Closed once nothing of
   * the run is left under a temporary name (bico__commit,
   * bico__tmp_discard): another run's scan removes only what it can
   * lock. */
  int lock, oldlock;
} bico__tmpfile;

/* Creates the temporary file for destination `path` (what names the role
 * for messages), locked (t->lock), after removing the stale ones that no
 * live run holds.  A path that ends in '/' or names a folder is
 * BICO_E_ARG. */
bico_status bico__tmp_create(bico_ctx *ctx, const char *fn, const char *what,
                             const char *path, bico__tmpfile *t);
/* A temporary file at a chosen name `tmp` (inside a temporary folder of
 * this run, which the folder's lock covers: no stale scan, no lock of its
 * own, O_EXCL, mode 0600 until finished) for the destination `path`
 * (named in messages). */
bico_status bico__tmp_create_in(bico_ctx *ctx, const char *fn,
                                const char *what, const char *path,
                                const char *tmp, bico__tmpfile *t);
/* The temporary folder for the folder `path` (its real path: a sibling in
 * the same parent), created mode 0700 after one scan for leftovers, and
 * locked (t->lock, a descriptor of the folder).
 * BICO_E_IO naming `shown` (the user's spelling) when the parent folder
 * is missing or not writable. */
bico_status bico__tmp_folder(bico_ctx *ctx, const char *fn, const char *shown,
                             const char *path, bico__tmpfile *t);
/* Removes path and everything under it without following symbolic links
 * (a folder it cannot enter is made 0700 first when it is the caller's);
 * what cannot be removed stays.  Never crosses into another file system:
 * a sub-folder on another device than path's parent folder (a mount
 * point, or path itself mounted on) is left with everything in it
 * (EXDEV).  Returns 0 or the first errno. */
int bico__remove_tree(const char *path);
/* Makes everything written under the folder path durable at once
 * (syncfs of its file system, fsync of the folder where that is missing):
 * one call for thousands of small files.  0 or an errno. */
int bico__sync_folder(const char *path);
/* Swaps the complete folder t->tmp in for t->path (lib/io/folder_swap.c): 0 or
 * an errno, with t->oldtree set when an old folder was moved out (locked
 * first: t->oldlock). */
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
 * it), lets its locks go and frees the names; accepts a zeroed t. */
void bico__tmp_discard(bico_ctx *ctx, bico__tmpfile *t);
/* Closes t's lock descriptors (lock, oldlock); accepts a zeroed t. */
void bico__tmp_unlock(bico__tmpfile *t);

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
 * handlers: ".<base>" BICO__TMP_MARK "<pid>.XXXXXX".  An old tree kept
 * because it holds entries that were not carried (bico__retire_tree) is
 * renamed to the same name with BICO__KEPT_MARK: the leftover scan of
 * later runs never removes it. */
#define BICO__TMP_MARK ".bico-tmp."
#define BICO__KEPT_MARK ".bico-kept."
/* The lock file of an output folder: ".<base>" BICO__LOCK_SUFFIX in the
 * folder's real parent (base cut to 200 bytes). */
#define BICO__LOCK_SUFFIX ".bico-lock"

/* ---- output folders (lib/io/folder_guard.c) ----
 *
 * The run's lock: one writer of an output folder at a time, between
 * processes.  The lock is an exclusive flock(2) on the hidden file
 * ".<name>.bico-lock" in the folder's real parent (the folder a symbolic
 * link leads to, so that every spelling meets one lock), which holds the
 * holder's pid and command line; the holder removes it when it lets go
 * (a file left by a killed holder is reused and removed by the next run).
 * After the lock is taken, the lock file and the folder's real path are
 * checked again (a holder that let go meanwhile removed the file; a link
 * that now leads elsewhere): on a change the lock is taken again.
 * Another process holding it: BICO_E_IO naming the folder, the holder's
 * pid, how long it has held it and its command, after waiting up to the
 * context's folder_wait seconds (0: refuse at once).
 * Within one process: a run (bico_transfer_run, bico_merge_run, a
 * bico_folder) takes the lock for its whole length (join 0) and the
 * writers it creates join it (join 1: the lock file names this process;
 * nothing of their own is taken); a run meeting this process's own lock is
 * refused at once.  A parent folder where no lock file can be created
 * (missing, read-only) gives no lock and no error: the commit, which
 * needs that folder too, fails there with its own reason. */
typedef struct bico__lock bico__lock;
bico_status bico__lock_take(bico_ctx *ctx, const char *dir, int join,
                            bico__lock **out);
/* Removes the lock file (when it is still this lock's) and lets go;
 * accepts NULL. */
void bico__lock_release(bico__lock *l);

/* An entry the carry copied instead of linking: its identity then, so
 * that the old tree's retirement knows it was carried. */
typedef struct bico__copied {
  dev_t dev;
  ino_t ino;
  off_t size;
  struct timespec mtime;
} bico__copied;

/* The record of a carry (bico__carry_files) for the old tree's
 * retirement after the swap: the keep rule of the top level (entries it
 * refuses were dropped on purpose), the old folder's device, the entries
 * carried as copies. */
typedef int (*bico__keep_fn)(void *arg, const char *name);
typedef struct bico__carried {
  bico__keep_fn keep;
  void *arg;
  dev_t dev;
  bico__copied *copies;
  size_t ncopies, capcopies;
} bico__carried;
void bico__carried_free(bico_ctx *ctx, bico__carried *r);

/* lib/io/folder_swap.c: carries the entries of folder `from` for which keep(arg,
 * name) says 1 (every entry of its sub-folders) into the folder `to`: a
 * hard link for each file and link (a copy with its mode, times and
 * extended attributes when linking is refused: EXDEV, EPERM, ...), each
 * sub-folder recreated with its mode, extended attributes (ACLs
 * included), access and modification times (and owner, as root).  An
 * entry that vanishes while it is carried, a sub-folder on another file
 * system, or one nested deeper than 64 levels is BICO_E_IO, as is any
 * entry that cannot be carried, naming `shown` and the entry.  rec (zeroed
 * by the caller) records the copies and the keep rule for the old tree's
 * retirement (bico__retire_tree); the caller frees it with
 * bico__carried_free. */
bico_status bico__carry_files(bico_ctx *ctx, const char *fn,
                              const char *shown, const char *from,
                              const char *to, bico__keep_fn keep, void *arg,
                              bico__carried *rec);
/* After the swap (lib/io/commit.c): removes the old tree `old` of
 * t (t->carried set) entry by entry, and only what was carried or dropped
 * on purpose: a top-level entry that t->carried's keep rule refuses (the
 * weights the new folder replaces), an entry whose new folder holds the
 * same file (a hard link) or its copy (unchanged since), a sub-folder once
 * its entries are retired.  An entry that is not in the new folder (made
 * by another process during the run) is moved into it; one whose name the
 * new folder holds as another file (changed during the run) stays.  When
 * anything of the user's stays, the old tree is renamed to t->keptname
 * and t->kept set.  Never crosses into another file system. */
void bico__retire_tree(bico__tmpfile *t, const char *old);

/* A folder commit: the output folder resolved and checked, the run's lock,
 * the new folder built beside it (lib/io/folder_guard.c). */
typedef struct bico__stage {
  char *dir;  /* as the caller spelt it, trailing '/'s removed */
  char *real; /* its real path: what the commit replaces */
  int exists; /* an old folder is there */
  struct stat old;
  bico__lock *lock; /* NULL: joined, or none could be taken */
  bico__tmpfile t;  /* the new folder (isdir) once made */
  bico__carried rec;
} bico__stage;

/* Takes the folder's lock (join as for bico__lock_take) and checks what
 * no folder commit may replace, before anything is written: something
 * that is not a folder (BICO_E_ARG), a dangling symbolic link (BICO_E_ARG,
 * naming where it leads), a folder that cannot be written (BICO_E_IO), a
 * mount point or a folder holding one at any depth (BICO_E_IO: the
 * removal of the old tree must never reach into another file system),
 * the working directory or a folder holding it (BICO_E_ARG: the swap
 * would leave the process in a removed folder), a new folder whose
 * parent is missing (BICO_E_IO).  Messages name `dir`.  s is zeroed
 * first; bico__stage_free is safe after a failure. */
bico_status bico__stage_open(bico_ctx *ctx, const char *fn, const char *dir,
                             int join, bico__stage *s);
/* Creates the new folder (bico__tmp_folder) of an opened stage. */
bico_status bico__stage_make(bico_ctx *ctx, const char *fn, bico__stage *s);
/* Once the new folder is complete: with keep (and an old folder), the old
 * folder's entries keep(arg, name) accepts are carried into the new one
 * (bico__carry_files) and the swap retires the old tree by that record;
 * without keep, the swap replaces the old folder (its contents dropped).
 * Then the new folder gets the old folder's mode, owner (as root) and
 * extended attributes (ACLs included), or the mode mkdir would give, and
 * everything in it is made durable at once. */
bico_status bico__stage_finish(bico_ctx *ctx, const char *fn, bico__stage *s,
                               bico__keep_fn keep, void *arg);
/* Removes the new folder unless committed, lets the lock go, frees. */
void bico__stage_free(bico_ctx *ctx, bico__stage *s);
/* Lets the lock go early (after the commit); bico__stage_free after. */
void bico__stage_unlock(bico__stage *s);

/* Extended attributes of the folder or file `from` onto `to` (both open
 * descriptors): every attribute of from set on to, every one of to that
 * from lacks removed (an inherited default ACL).  Attributes outside the
 * user and system namespaces that this process may not read or set
 * (trusted, security as a non-root user) are passed over.  0, or an errno
 * with the attribute's name in name (cap bytes). */
int bico__copy_xattrs(int from, int to, char *name, size_t cap);

/* ---- fingerprints (lib/io/fingerprint.c) ---- */

/* The fingerprint of an open model f (docs/formats.md, "Bridge files"):
 * SHA-256, as 64 hexadecimal digits, of its tensors in name order (each
 * one's name, dtype, shape, byte size and the bytes at its start, middle
 * and end; with full, all its bytes) and of nfiles whole files (files[k]
 * with role roles[k], NULL entries skipped: a config.json, a
 * tokenizer.json). */
bico_status bico__fingerprint(bico_ctx *ctx, const bico_stfile *f, int full,
                              const char *const *files,
                              const char *const *roles, size_t nfiles,
                              char hex[65]);

#endif
