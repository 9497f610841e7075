/* libbico: output folders committed in one step, for front ends.
 *
 * The rules the library's own writers follow (bico_stwriter_create_folder,
 * bico_lora_save, bico_transfer_run, bico_merge_run), offered to a front
 * end that writes a whole folder itself (an adapter, a converted model, a
 * folder of its own files), so that it keeps no copy of them:
 *
 *   bico_folder *f;
 *   bico_folder_create(ctx, &f);
 *   bico_folder_add_input(f, "source model", "models/src");  (every input)
 *   size_t k;
 *   bico_folder_add_output(f, "output adapter", "out/ad",
 *                          BICO_FOLDER_REFUSE, &k);
 *   bico_folder_add_file(f, "--report", "out/report.json");  (checked only)
 *   bico_folder_begin(f);     checks and locks, before anything is loaded
 *   ... load, compute ...
 *   const char *tmp;
 *   bico_folder_path(f, k, &tmp);  a new hidden folder beside out/ad
 *   ... write the folder's files into tmp ...
 *   bico_folder_commit(f);    swapped in whole
 *   bico_folder_free(f);      without a commit: tmp removed, nothing changed
 *
 * Checks (bico_folder_begin, before the front end reads or writes
 * anything), each a failure naming the role (`what`) and the path as the
 * caller spelt it, with "nothing was written":
 *   - identity, whatever the spelling ("./x", "x/", symbolic links, hard
 *     links): an output folder that is the same folder as an input or as
 *     another output, or that holds an input at any depth (by the real
 *     folder the input lies in, after following its final link), is
 *     BICO_E_ARG; an existing output that is not a folder is BICO_E_ARG;
 *     an output folder or file inside an input folder at any depth
 *     (models/src/adapter) is BICO_E_ARG.  Output files
 *     (bico_folder_add_file) by the same rule: one that is the same file
 *     as an input or another output (device and inode, or folder and
 *     name), that lies inside an output folder, or directly in a model
 *     folder an input names (the folder, or the folder of its
 *     model.safetensors.index.json: a shard, config.json, the tokenizer)
 *     is BICO_E_ARG; a destination that is not a regular file (a folder,
 *     FIFO, device or socket, after following a symbolic link) is
 *     BICO_E_ARG, one whose folder is missing BICO_E_IO.  This is the rule
 *     of bico_transfer_run and bico_merge_run;
 *   - what no folder commit may replace: a dangling symbolic link
 *     (BICO_E_ARG, naming where it leads), a folder that cannot be written
 *     (BICO_E_IO), a mount point or a folder holding one at any depth
 *     (BICO_E_IO: the old folder's removal never reaches into another file
 *     system), the working directory or a folder holding it (BICO_E_ARG),
 *     a new folder whose parent is missing (BICO_E_IO);
 *   - the policy: BICO_FOLDER_REFUSE (the default) refuses an existing
 *     folder that holds anything (BICO_E_ARG, naming one of its entries);
 *   - the lock, below.
 *
 * Locks.  bico_folder_begin takes each output folder's lock and the handle
 * holds it until bico_folder_free: an exclusive flock(2) on the hidden file
 * ".<name>.bico-lock" in the folder's real parent, which names the
 * holder's pid and command line and which the holder removes when it lets
 * go.  The bico command, bico-mpi and every folder commit of the library
 * take the same lock, so two writers of one folder never run at once:
 * another process holding it is BICO_E_IO naming the holder (pid, how long
 * it has held it, its command), after waiting up to the context's
 * BICO_CTX_FOLDER_WAIT seconds (ctx.h; 0, the default, refuses at once).
 * Within this process, a model folder or adapter written into a begun
 * handle's output by bico_stwriter_create_folder or bico_lora_save joins
 * the handle's lock (the folder is written as that call documents, under
 * the handle's lock); a second bico_folder, bico_transfer_run or
 * bico_merge_run on that folder is refused (BICO_E_IO).  A parent folder
 * that cannot hold the lock file (read-only) gives no lock: the commit
 * fails there with its own reason.
 *
 * Commit (bico_folder_commit): every output whose new folder was asked
 * for (bico_folder_path) is swapped in with one renameat2(RENAME_EXCHANGE)
 * (rename for a new folder; two renames where the file system refuses the
 * exchange, the folder then absent, never mixed, for a moment): a reader
 * sees the old folder or the complete new one.  Before the swap the new
 * folder gets the old folder's mode, owner (as root) and extended
 * attributes (ACLs included), or 0777 less the umask for a new folder,
 * and everything in it is made durable (syncfs).  By the policy:
 *   - BICO_FOLDER_REPLACE: the old folder's contents go;
 *   - BICO_FOLDER_CARRY: every entry of the old folder whose name the new
 *     folder does not hold is carried into it (hard links; a copy with its
 *     mode, times and attributes where linking is refused; sub-folders
 *     recreated with their mode, attributes and times), as a model folder
 *     commit carries the user's files;
 *   - BICO_FOLDER_REFUSE: as CARRY (the folder was empty or absent at
 *     begin: what another process put there meanwhile is kept).
 * After the swap the old tree is removed, but only what was carried (the
 * same file is in the new folder) or dropped by the policy: an entry made
 * in the old folder during the run is moved into the new one, and when
 * anything of the user's cannot be placed (a name the new folder holds as
 * another file) the old tree is kept as ".<name>.bico-kept.<pid>.XXXXXX"
 * beside the folder (bico_folder_kept names it).  A folder that appeared
 * where none was at begin is left alone (BICO_E_IO).  An entry that
 * vanishes during the carry, or cannot be carried, fails the commit
 * (BICO_E_IO naming it; the old folder stays as it was).  A failed commit
 * removes the new folders that were not swapped in; only
 * bico_folder_free remains.
 *
 * Threads: as every handle, one thread at a time (ctx.h). */
#ifndef BICO_FOLDER_H
#define BICO_FOLDER_H

#include <stddef.h>
#include "ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bico_folder bico_folder;

/* What the commit does with an existing output folder (see above). */
typedef enum bico_folder_policy {
  BICO_FOLDER_REFUSE = 1,  /* a non-empty folder is refused at begin
                              (the default: 0 asks for it) */
  BICO_FOLDER_REPLACE = 2, /* the old contents are dropped */
  BICO_FOLDER_CARRY = 3    /* the old entries the new folder lacks are
                              carried over */
} bico_folder_policy;
/* Names: "refuse", "replace", "carry"; NULL / BICO_E_NOTFOUND otherwise. */
BICO_API const char *bico_folder_policy_name(int policy);
BICO_API bico_status bico_folder_policy_from_name(const char *name,
                                                  int *policy);

/* A handle with no inputs and no outputs. */
BICO_API bico_status bico_folder_create(bico_ctx *ctx, bico_folder **out);
/* Removes the new folders not committed and lets the locks go; accepts
 * NULL. */
BICO_API void bico_folder_free(bico_folder *f);

/* An input of the run: a file or a folder (it need not exist: a missing
 * input is the front end's to report).  what (NULL: "input") names its
 * role in messages ("source model").  Before begin only (else
 * BICO_E_STATE); an empty path is BICO_E_ARG. */
BICO_API bico_status bico_folder_add_input(bico_folder *f, const char *what,
                                           const char *path);
/* An output file of the run (it need not exist; its folder must by
 * begin), checked at bico_folder_begin with the inputs and output folders
 * by the rule above, and nothing more: the handle never writes, locks or
 * commits it (the front end writes it, with bico_stwriter_create or
 * another atomic writer, once begin succeeded).  what (NULL: "output
 * file") names its role in messages ("--output").  Before begin only
 * (else BICO_E_STATE); an empty path is BICO_E_ARG. */
BICO_API bico_status bico_folder_add_file(bico_folder *f, const char *what,
                                          const char *path);
/* An output folder (it need not exist; its parent must by begin) with its
 * policy (bico_folder_policy; 0: BICO_FOLDER_REFUSE); *index (may be NULL)
 * gets its index for bico_folder_path and bico_folder_kept, counted from 0
 * in the order added.  what (NULL: "output") names its role.  At most 8
 * outputs; before begin only (else BICO_E_STATE). */
BICO_API bico_status bico_folder_add_output(bico_folder *f, const char *what,
                                            const char *dir, int policy,
                                            size_t *index);
/* The checks and the locks (see above); once (else BICO_E_STATE).  On
 * failure nothing is held: only bico_folder_free remains. */
BICO_API bico_status bico_folder_begin(bico_folder *f);
/* The new folder of output `index` (made on the first call, mode 0700
 * until the commit; an absolute path, valid until bico_folder_free): the
 * front end writes the complete folder into it.  After begin, before the
 * commit (else BICO_E_STATE); an unknown index is BICO_E_ARG. */
BICO_API bico_status bico_folder_path(bico_folder *f, size_t index,
                                      const char **tmp);
/* Swaps in every output whose new folder was asked for (see above); an
 * output without one is left as it is (a writer may have written it under
 * the handle's lock).  Once, after begin (else BICO_E_STATE). */
BICO_API bico_status bico_folder_commit(bico_folder *f);
/* After a commit: where the old tree of output `index` was kept because it
 * held entries that could not be placed in the new folder (see above), or
 * NULL when it was removed.  BICO_E_ARG for an unknown index. */
BICO_API bico_status bico_folder_kept(const bico_folder *f, size_t index,
                                      const char **path);

#ifdef __cplusplus
}
#endif
#endif
