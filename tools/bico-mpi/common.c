/* bico-mpi: chunked messages, collective error agreement, temporary-file
 * cleanup on termination signals, test hooks. */
#include <dirent.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mpicli.h"

size_t mpi_chunk_elems(void) {
  const char *e = getenv("BICO_MPI_CHUNK");
  if (e != NULL && e[0] != '\0') {
    char *end;
    unsigned long long v = strtoull(e, &end, 10);
    if (*end == '\0' && v > 0 && v <= (unsigned long long)INT_MAX)
      return (size_t)v;
  }
  return (size_t)1 << 24;
}

int mpi_send_long(const void *buf, size_t count, MPI_Datatype type,
                  size_t elem_size, int dest, int tag) {
  size_t chunk = mpi_chunk_elems();
  const char *p = buf;
  for (size_t off = 0; off < count; off += chunk) {
    size_t n = count - off < chunk ? count - off : chunk;
    int rc = MPI_Send(p + off * elem_size, (int)n, type, dest, tag,
                      MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

int mpi_recv_long(void *buf, size_t count, MPI_Datatype type,
                  size_t elem_size, int src, int tag) {
  size_t chunk = mpi_chunk_elems();
  char *p = buf;
  for (size_t off = 0; off < count; off += chunk) {
    size_t n = count - off < chunk ? count - off : chunk;
    int rc = MPI_Recv(p + off * elem_size, (int)n, type, src, tag,
                      MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

int mpi_reduce_sum_long(double *buf, size_t count, int root, int rank) {
  size_t chunk = mpi_chunk_elems();
  for (size_t off = 0; off < count; off += chunk) {
    int n = (int)(count - off < chunk ? count - off : chunk);
    int rc = rank == root
                 ? MPI_Reduce(MPI_IN_PLACE, buf + off, n, MPI_DOUBLE, MPI_SUM,
                              root, MPI_COMM_WORLD)
                 : MPI_Reduce(buf + off, NULL, n, MPI_DOUBLE, MPI_SUM, root,
                              MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

int mpi_any_failed(int local_failed, const char *local_msg, char *msg,
                   size_t cap) {
  int rank, size, mine, first;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  mine = local_failed ? rank : size;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (first == size) return 0;
  char text[1024];
  if (rank == first) {
    snprintf(text, sizeof text, "rank %d: %s", rank,
             local_msg && local_msg[0] ? local_msg : "failed");
    if (rank != 0)
      MPI_Send(text, (int)strlen(text) + 1, MPI_CHAR, 0, TAG_MSG,
               MPI_COMM_WORLD);
  }
  if (rank == 0) {
    if (first != 0)
      MPI_Recv(text, (int)sizeof text, MPI_CHAR, first, TAG_MSG,
               MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    text[sizeof text - 1] = '\0';
    if (msg && cap) snprintf(msg, cap, "%s", text);
  }
  return 1;
}

/* ---- temporary files ---- */

#define MAX_SEEN 64
#define MAX_TMP 4
static char seen[MAX_SEEN][256];
static size_t nseen;
static char tmp_paths[MAX_TMP][4096 + 300];
static volatile sig_atomic_t ntmp;

/* Folder and temporary-name prefix of an output path. */
static void split_path(const char *path, char *dir, size_t dcap, char *prefix,
                       size_t pcap) {
  const char *slash = strrchr(path, '/');
  if (slash == NULL) {
    snprintf(dir, dcap, ".");
    snprintf(prefix, pcap, ".%s.bico-tmp.", path);
  } else {
    snprintf(dir, dcap, "%.*s", (int)(slash - path) + (slash == path), path);
    snprintf(prefix, pcap, ".%s.bico-tmp.", slash + 1);
  }
}

/* ---- the watchdog ----
 * A signal handler cannot run when mpirun's SIGKILL comes before (or
 * instead of) its SIGTERM, which happens on a loaded machine.  So rank 0
 * forks a small process in its own session that holds the list of
 * temporary files ("+path" adds one, "-" clears the list after a commit)
 * and removes them when the connection to rank 0 closes, however rank 0
 * ended.  It uses only async-signal-safe calls (rank 0 has threads). */
static int watch_fd = -1;

static void tell_watchdog(char op, const char *path) {
  if (watch_fd < 0) return;
  char line[4096 + 320];
  int n = snprintf(line, sizeof line, "%c%s\n", op, path ? path : "");
  if (n > 0 && (size_t)n < sizeof line)
    (void)!send(watch_fd, line, (size_t)n, MSG_NOSIGNAL);
}

static void watchdog(int fd) {
  static char list[MAX_TMP][4096 + 300], cur[4096 + 300];
  static char buf[4096];
  size_t nlist = 0, len = 0;
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; i++) {
      if (buf[i] != '\n') {
        if (len + 1 < sizeof cur) cur[len++] = buf[i];
        continue;
      }
      cur[len] = '\0';
      if (cur[0] == '-') nlist = 0;
      if (cur[0] == '+' && nlist < MAX_TMP) {
        memcpy(list[nlist], cur + 1, len);
        nlist++;
      }
      len = 0;
    }
  }
  for (size_t i = 0; i < nlist; i++) unlink(list[i]);
  _exit(0);
}

static void start_watchdog(void) {
  int sv[2];
  if (watch_fd >= 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return;
  pid_t pid = fork();
  if (pid < 0) {
    close(sv[0]);
    close(sv[1]);
    return;
  }
  if (pid == 0) {
    /* Out of rank 0's process group (mpirun's kills), stdio detached so
     * that mpirun does not wait for it. */
    setsid();
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    for (int f = 0; f < 1024; f++)
      if (f != sv[1]) close(f);
    watchdog(sv[1]);
  }
  close(sv[1]);
  watch_fd = sv[0];
  for (int i = 0; i < ntmp; i++) tell_watchdog('+', tmp_paths[i]);
}

static void scan(const char *path, int record) {
  char dir[4096], prefix[512];
  split_path(path, dir, sizeof dir, prefix, sizeof prefix);
  DIR *d = opendir(dir);
  if (d == NULL) return;
  struct dirent *e;
  size_t pl = strlen(prefix);
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, prefix, pl) != 0) continue;
    if (!record) {
      if (nseen < MAX_SEEN) snprintf(seen[nseen++], sizeof seen[0], "%s", e->d_name);
      continue;
    }
    int old = 0;
    for (size_t i = 0; i < nseen && !old; i++) old = strcmp(seen[i], e->d_name) == 0;
    if (!old && ntmp < MAX_TMP) {
      snprintf(tmp_paths[ntmp], sizeof tmp_paths[0], "%s/%s", dir, e->d_name);
      ntmp++;
      tell_watchdog('+', tmp_paths[ntmp - 1]);
      break;
    }
  }
  closedir(d);
}

void mpi_tmp_before(const char *path) {
  nseen = 0;
  scan(path, 0);
}

void mpi_tmp_after(const char *path) { scan(path, 1); }

void mpi_tmp_add(const char *path) {
  if (ntmp < MAX_TMP) {
    snprintf(tmp_paths[ntmp], sizeof tmp_paths[0], "%s", path);
    ntmp++;
    tell_watchdog('+', path);
  }
}

void mpi_tmp_forget(void) {
  ntmp = 0;
  tell_watchdog('-', NULL);
}

static void on_signal(int sig) {
  static const char msg[] =
      "bico-mpi: rank 0 stopped by a signal (a rank failed or the job was "
      "cancelled); the unfinished output was removed\n";
  for (int i = 0; i < ntmp; i++) unlink(tmp_paths[i]);
  if (ntmp > 0 && write(2, msg, sizeof msg - 1) < 0) {
    /* nothing more to do in a signal handler */
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

/* MPI errors stay fatal, but rank 0's temporaries go first. */
static void on_mpi_error(MPI_Comm *comm, int *code, ...) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0, rank = -1;
  for (int i = 0; i < ntmp; i++) unlink(tmp_paths[i]);
  ntmp = 0;
  MPI_Error_string(*code, text, &len);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  fprintf(stderr, "bico-mpi: rank %d: MPI error: %s\n", rank, text);
  MPI_Abort(*comm, 1);
}

void mpi_install_error_handler(void) {
  MPI_Errhandler eh;
  if (MPI_Comm_create_errhandler(on_mpi_error, &eh) == MPI_SUCCESS)
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, eh);
}

void mpi_install_handlers(void) {
  start_watchdog();
  /* SIGPIPE too: when a rank dies, mpirun may close rank 0's output
   * pipes before it sends SIGTERM, and rank 0's next progress line would
   * then kill it without a cleanup. */
  signal(SIGPIPE, on_signal);
  signal(SIGTERM, on_signal);
  signal(SIGINT, on_signal);
  signal(SIGHUP, on_signal);
}

int mpi_test_hook(int rank, size_t unit) {
  const char *names[2] = {"BICO_MPI_TEST_KILL", "BICO_MPI_TEST_FAIL"};
  for (int k = 0; k < 2; k++) {
    const char *e = getenv(names[k]);
    int r;
    unsigned long n;
    if (e == NULL || sscanf(e, "%d:%lu", &r, &n) != 2) continue;
    if (r != rank || (size_t)n != unit) continue;
    if (k == 0) raise(SIGKILL);
    return 1;
  }
  return 0;
}

double mpi_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int saved_stderr = -1;

void mpi_quiet_stderr(void) {
  int null = open("/dev/null", O_WRONLY);
  if (null < 0) return;
  fflush(stderr);
  saved_stderr = dup(2);
  if (saved_stderr >= 0) dup2(null, 2);
  close(null);
}

void mpi_restore_stderr(void) {
  if (saved_stderr < 0) return;
  fflush(stderr);
  dup2(saved_stderr, 2);
  close(saved_stderr);
  saved_stderr = -1;
}

/* ---- one plan on every rank ---- */

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++) {
    h ^= c[i];
    h *= 1099511628211ull;
  }
  return h;
}

/* Out of memory inside a collective step: the ranks cannot agree on a
 * count any more; end the job. */
static void *must(void *p) {
  if (p == NULL) {
    fprintf(stderr, "bico-mpi: out of memory comparing the ranks' plans\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return p;
}

int mpi_same_args(int argc, char **argv, char *msg, size_t cap) {
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  size_t len = 0;
  for (int i = 1; i < argc; i++) len += strlen(argv[i]) + 1;
  char *mine = must(malloc(len ? len : 1));
  int bad = 0;
  char text[1024] = "";
  size_t o = 0;
  for (int i = 1; i < argc; i++) {
    size_t k = strlen(argv[i]) + 1;
    memcpy(mine + o, argv[i], k);
    o += k;
  }
  /* rank 0's arguments, NUL-separated, to every rank */
  long long n0 = rank == 0 ? (long long)len : 0;
  MPI_Bcast(&n0, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  if (n0 < 0 || n0 > INT_MAX) must(NULL);
  char *theirs = rank == 0 ? mine : must(malloc(n0 > 0 ? (size_t)n0 : 1));
  MPI_Bcast(theirs, (int)n0, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (!bad && rank != 0) {
    /* the first argument that differs */
    size_t a = 0, b = 0, tlen = (size_t)n0;
    int k = 1;
    while (a < len || b < tlen) {
      const char *x = a < len ? mine + a : NULL;
      const char *y = b < tlen ? theirs + b : NULL;
      if (x == NULL || y == NULL || strcmp(x, y) != 0) {
        if (x == NULL)
          snprintf(text, sizeof text,
                   "its command line ends after %d arguments; rank 0's goes "
                   "on with '%.200s'", k - 1, y);
        else if (y == NULL)
          snprintf(text, sizeof text,
                   "its command line has more arguments than rank 0's, from "
                   "'%.200s' (argument %d) on", x, k);
        else
          snprintf(text, sizeof text,
                   "its command line differs from rank 0's: argument %d is "
                   "'%.200s' here, '%.200s' on rank 0", k, x, y);
        size_t t = strlen(text);
        snprintf(text + t, sizeof text - t,
                 "; every rank must be given the same command (nothing was "
                 "written)");
        bad = 1;
        break;
      }
      a += strlen(x) + 1;
      b += strlen(y) + 1;
      k++;
    }
  }
  if (rank != 0) free(theirs);
  free(mine);
  return mpi_any_failed(bad, text, msg, cap);
}

/* A node-independent fingerprint of a file: its size, its first 64 KiB
 * (a safetensors header, a small file whole), 16 pieces of 256 bytes
 * spread over the rest and its last 4 KiB.  Content sampled, not read
 * whole: a copy that differs in size, header or the sampled bytes is
 * caught; device, inode and mtime are left out, since each node may hold
 * its own copy. */
static uint64_t fingerprint_file(uint64_t h, int fd, uint64_t size) {
  static unsigned char buf[65536];
  h = fnv(h, &size, sizeof size);
  uint64_t offs[18], lens[18];
  size_t n = 0;
  offs[n] = 0;
  lens[n++] = size < sizeof buf ? size : sizeof buf;
  if (size > sizeof buf) {
    for (int k = 0; k < 16; k++) {
      offs[n] = sizeof buf + (size - sizeof buf) / 16 * (uint64_t)k;
      lens[n++] = 256;
    }
    offs[n] = size >= 4096 ? size - 4096 : 0;
    lens[n++] = 4096;
  }
  for (size_t i = 0; i < n; i++) {
    uint64_t len = lens[i];
    if (offs[i] + len > size) len = size - offs[i];
    ssize_t r = pread(fd, buf, (size_t)len, (off_t)offs[i]);
    if (r > 0) h = fnv(h, buf, (size_t)r);
    h = fnv(h, &r, sizeof r);
  }
  return h;
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The fingerprint of a path: a file's, or for a folder its regular files'
 * (names not starting with '.') in name order, each with its name. */
static uint64_t fingerprint(const char *path) {
  uint64_t h = 14695981039346656037ull;
  struct stat st;
  if (stat(path, &st) != 0) return fnv(h, "missing", 7);
  if (S_ISREG(st.st_mode)) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return fnv(h, "unreadable", 10);
    h = fingerprint_file(h, fd, (uint64_t)st.st_size);
    close(fd);
    return h;
  }
  if (!S_ISDIR(st.st_mode)) return fnv(h, "special", 7);
  DIR *d = opendir(path);
  if (d == NULL) return fnv(h, "unreadable folder", 17);
  char **names = NULL;
  size_t n = 0, cap = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 64;
      char **v = realloc(names, cap * sizeof *v);
      if (v == NULL) break;
      names = v;
    }
    if ((names[n] = strdup(e->d_name)) != NULL) n++;
  }
  closedir(d);
  if (n > 0) qsort(names, n, sizeof *names, by_name);
  h = fnv(h, "folder", 6);
  for (size_t i = 0; i < n; i++) {
    size_t pl = strlen(path) + strlen(names[i]) + 2;
    char *p = malloc(pl);
    struct stat fs;
    if (p != NULL) {
      snprintf(p, pl, "%s/%s", path, names[i]);
      if (stat(p, &fs) == 0 && S_ISREG(fs.st_mode)) {
        uint64_t f = fingerprint(p);
        h = fnv(h, names[i], strlen(names[i]) + 1);
        h = fnv(h, &f, sizeof f);
      }
      free(p);
    }
    free(names[i]);
  }
  free(names);
  return h;
}

int mpi_same_files(const char *const *what, const char *const *paths,
                   size_t n, char *msg, size_t cap) {
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  uint64_t *mine = must(calloc(n ? n : 1, sizeof *mine));
  uint64_t *theirs = must(calloc(n ? n : 1, sizeof *theirs));
  int bad = 0;
  char text[1024] = "";
  for (size_t i = 0; i < n; i++) mine[i] = paths[i] ? fingerprint(paths[i]) : 0;
  memcpy(theirs, mine, n * sizeof *mine);
  /* n is the same on every rank: the same command */
  MPI_Bcast(theirs, (int)n, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  for (size_t i = 0; !bad && rank != 0 && i < n; i++)
    if (mine[i] != theirs[i]) {
      snprintf(text, sizeof text,
               "the %s %.300s differs from rank 0's (its size or content); "
               "every rank must read the same files (nothing was written)",
               what[i], paths[i]);
      bad = 1;
    }
  free(mine);
  free(theirs);
  return mpi_any_failed(bad, text, msg, cap);
}
