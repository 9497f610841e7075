/* bico-mpi transfer: the whole-model transfer divided among ranks.
 *
 * The library plans (bico_transfer_plan: groups of target tensors that
 * share maps, each with an estimated cost); every rank plans the same run,
 * so every rank derives the same assignment: groups, largest first, each
 * to the least loaded rank (BICO_MPI_RANK0_SHARE scales rank 0's capacity,
 * 1 by default below 4 ranks, 0.5 from 4 on).  Each rank computes its
 * tensors with a partial run (bico_transfer_set_partial).  Rank 0 puts its
 * own into the library's assembler (bico_transfer_assemble_*) as they
 * come; the other ranks send theirs with non-blocking sends and keep
 * computing, and rank 0 receives them once its own share is done.  So no
 * rank waits for another while it has work: a rank 0 that received between
 * its tensors would stall a sender for a whole map solve, and a sender
 * that waited for rank 0 would stall itself (that is what made two ranks
 * no faster than one).  A sender keeps at most BICO_MPI_SEND_BUDGET bytes
 * (default 1 GiB) of updates in flight, then waits for rank 0.  Any
 * failure ends the run on every rank with the failing rank's message and
 * no output. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/resource.h>

#include "mpicli.h"

static int g_rank, g_size, g_quiet;

static void say(const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 1, 2)))
#endif
    ;
static void say(const char *fmt, ...) {
  if (g_quiet) return;
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (g_size > 1 && g_rank != 0)
    fprintf(stderr, "[rank %d] %s\n", g_rank, line);
  else
    fprintf(stderr, "%s\n", line);
}

static void log_line(void *opaque, const char *line) {
  (void)opaque;
  say("%s", line);
}

/* ---- the assignment ---- */

typedef struct group {
  size_t id;
  double cost;
} group;

static int by_cost(const void *a, const void *b) {
  const group *x = a, *y = b;
  if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

/* Rank 0's capacity relative to the others: it also assembles the output
 * (after its own share).  BICO_MPI_RANK0_SHARE in [0, 1] overrides. */
static double rank0_share(void) {
  const char *e = getenv("BICO_MPI_RANK0_SHARE");
  if (e != NULL && e[0] != '\0') {
    char *end;
    double v = strtod(e, &end);
    if (*end == '\0' && v >= 0 && v <= 1) return v > 0 ? v : 1e-9;
  }
  return g_size >= 4 ? 0.5 : 1.0;
}

/* owner[ti]: the rank computing target tensor ti; load[r]: rank r's
 * estimated cost.  The same on every rank (the plan is deterministic). */
static bico_status assign(bico_transfer *t, size_t nt, size_t ng, int *owner,
                          double *load) {
  group *g = malloc((ng ? ng : 1) * sizeof *g);
  if (g == NULL) return BICO_E_NOMEM;
  for (size_t i = 0; i < ng; i++) {
    g[i].id = i;
    bico_transfer_plan_group(t, i, &g[i].cost, NULL, NULL);
  }
  qsort(g, ng, sizeof *g, by_cost);
  for (size_t ti = 0; ti < nt; ti++) owner[ti] = 0;
  for (size_t i = 0; i < ng; i++) {
    int best = 0;
    double bestv = 0;
    for (int r = 0; r < g_size; r++) {
      double cap = (r == 0 && g_size > 1) ? rank0_share() : 1.0;
      double v = (load[r] + g[i].cost) / cap;
      if (r == 0 || v < bestv) {
        best = r;
        bestv = v;
      }
    }
    load[best] += g[i].cost;
    size_t n;
    const size_t *ts;
    bico_transfer_plan_group(t, g[i].id, NULL, &n, &ts);
    for (size_t k = 0; k < n; k++) owner[ts[k]] = best;
  }
  free(g);
  return BICO_OK;
}

/* ---- the other ranks: non-blocking sends ---- */

typedef struct pending {
  MPI_Request req[3];
  int nreq;
  int64_t head[4];
  char *entry;
  float *upd;
  size_t bytes;
} pending;

typedef struct sender {
  pending *p;
  size_t np, cap, inflight, budget;
  size_t tensors, updated, unit;
  int stopped;
  char msg[1024];
} sender;

static void sender_reap(sender *s, int wait_all) {
  size_t keep = 0;
  for (size_t i = 0; i < s->np; i++) {
    pending *q = &s->p[i];
    int done = 0;
    if (wait_all) {
      MPI_Waitall(q->nreq, q->req, MPI_STATUSES_IGNORE);
      done = 1;
    } else {
      MPI_Testall(q->nreq, q->req, &done, MPI_STATUSES_IGNORE);
    }
    if (done) {
      s->inflight -= q->bytes;
      free(q->entry);
      free(q->upd);
    } else {
      s->p[keep++] = *q;
    }
  }
  s->np = keep;
}

/* Rank 0 asks the others to stop when the run failed elsewhere. */
static int stop_requested(void) {
  int flag = 0;
  MPI_Iprobe(0, TAG_MSG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
  return flag;
}

static bico_status sink_send(void *opaque, const bico_transfer_tensor *x) {
  sender *s = opaque;
  if (mpi_test_hook(g_rank, s->unit++)) {
    snprintf(s->msg, sizeof s->msg,
             "injected failure at tensor %s (BICO_MPI_TEST_FAIL)", x->name);
    return BICO_E_ARG;
  }
  if (stop_requested()) {
    s->stopped = 1;
    snprintf(s->msg, sizeof s->msg, "stopped: another rank failed");
    return BICO_E_STATE;
  }
  size_t chunk = mpi_chunk_elems();
  if (x->count > chunk) {
    /* A long update goes in blocking pieces (one request per message). */
    sender_reap(s, 1);
  }
  if (s->np == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 64;
    pending *p = realloc(s->p, cap * sizeof *p);
    if (p == NULL) return BICO_E_NOMEM;
    s->p = p;
    s->cap = cap;
  }
  pending *q = &s->p[s->np];
  memset(q, 0, sizeof *q);
  size_t elen = strlen(x->report_entry);
  q->entry = malloc(elen + 1);
  q->upd = x->update && x->count <= chunk
               ? malloc((x->count ? x->count : 1) * sizeof *q->upd)
               : NULL;
  if (q->entry == NULL || (x->update && x->count <= chunk && q->upd == NULL)) {
    free(q->entry);
    free(q->upd);
    return BICO_E_NOMEM;
  }
  memcpy(q->entry, x->report_entry, elen + 1);
  q->head[0] = (int64_t)x->index;
  q->head[1] = x->update ? (int64_t)x->count : 0;
  q->head[2] = x->handling;
  q->head[3] = (int64_t)elen;
  MPI_Isend(q->head, 4, MPI_INT64_T, 0, TAG_HEAD, MPI_COMM_WORLD, &q->req[0]);
  MPI_Isend(q->entry, (int)elen + 1, MPI_CHAR, 0, TAG_BODY, MPI_COMM_WORLD,
            &q->req[1]);
  q->nreq = 2;
  if (q->upd) {
    memcpy(q->upd, x->update, x->count * sizeof *q->upd);
    MPI_Isend(q->upd, (int)x->count, MPI_FLOAT, 0, TAG_BODY, MPI_COMM_WORLD,
              &q->req[2]);
    q->nreq = 3;
  }
  q->bytes = elen + (q->upd ? x->count * sizeof(float) : 0);
  s->inflight += q->bytes;
  s->np++;
  if (x->update && x->count > chunk) {
    sender_reap(s, 1);
    mpi_send_long(x->update, x->count, MPI_FLOAT, sizeof(float), 0, TAG_BODY);
  }
  s->tensors++;
  if (x->update) s->updated++;
  sender_reap(s, 0);
  if (s->inflight > s->budget) sender_reap(s, 1);
  return BICO_OK;
}

/* ---- rank 0: the assembler ---- */

typedef struct rank_info {
  double seconds, est, rss_mb, cpu;
  size_t tensors, updated;
  char host[MPI_MAX_PROCESSOR_NAME + 1];
} rank_info;

typedef struct receiver {
  bico_transfer *t;
  bico_ctx *ctx;
  rank_info *ranks;
  int ndone, failed;
  size_t unit;
  char msg[1200]; /* the first failure, "rank R: ..." */
} receiver;

static void fail_once(receiver *s, int rank, const char *what) {
  if (s->failed) return;
  s->failed = 1;
  snprintf(s->msg, sizeof s->msg, "rank %d: %s", rank, what);
  /* The others stop at their next tensor. */
  int one = 1;
  for (int r = 1; r < g_size; r++)
    MPI_Send(&one, 1, MPI_INT, r, TAG_MSG, MPI_COMM_WORLD);
}

static bico_status sink_put(void *opaque, const bico_transfer_tensor *x) {
  receiver *s = opaque;
  if (mpi_test_hook(0, s->unit++)) {
    snprintf(s->msg, sizeof s->msg,
             "rank 0: injected failure at tensor %s (BICO_MPI_TEST_FAIL)",
             x->name);
    return BICO_E_ARG;
  }
  s->ranks[0].tensors++;
  if (x->update) s->ranks[0].updated++;
  return bico_transfer_assemble_put(s->t, x->index, x->handling, x->update,
                                    x->count, x->report_entry);
}

/* One tensor from rank src (its head probed). */
static const char *message(bico_ctx *ctx, bico_status st);

static void receive_tensor(receiver *s, int src) {
  int64_t head[4];
  MPI_Recv(head, 4, MPI_INT64_T, src, TAG_HEAD, MPI_COMM_WORLD,
           MPI_STATUS_IGNORE);
  size_t count = (size_t)head[1], elen = (size_t)head[3];
  char *entry = malloc(elen + 1);
  float *upd = count ? malloc(count * sizeof *upd) : NULL;
  /* Received even when it cannot be used: the sender's requests finish. */
  if (entry) {
    MPI_Recv(entry, (int)elen + 1, MPI_CHAR, src, TAG_BODY, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
    entry[elen] = '\0';
  }
  if (count && upd)
    mpi_recv_long(upd, count, MPI_FLOAT, sizeof(float), src, TAG_BODY);
  if (entry == NULL || (count && upd == NULL)) {
    fail_once(s, 0, "out of memory receiving a tensor");
  } else if (!s->failed) {
    bico_status st = bico_transfer_assemble_put(
        s->t, (size_t)head[0], (int)head[2], count ? upd : NULL, count, entry);
    if (st != BICO_OK) fail_once(s, 0, message(s->ctx, st));
  }
  free(entry);
  free(upd);
}

/* Takes messages until every other rank reported done or failed. */
static void receive_all(receiver *s) {
  while (s->ndone < g_size - 1) {
    MPI_Status ps;
    MPI_Probe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &ps);
    int src = ps.MPI_SOURCE;
    if (ps.MPI_TAG == TAG_HEAD) {
      receive_tensor(s, src);
    } else if (ps.MPI_TAG == TAG_DONE) {
      double v[5];
      MPI_Recv(v, 5, MPI_DOUBLE, src, TAG_DONE, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
      rank_info *ri = &s->ranks[src];
      ri->seconds = v[0];
      ri->tensors = (size_t)v[1];
      ri->updated = (size_t)v[2];
      ri->rss_mb = v[3];
      ri->cpu = v[4];
      s->ndone++;
    } else if (ps.MPI_TAG == TAG_ERROR) {
      char line[1024];
      MPI_Recv(line, (int)sizeof line, MPI_CHAR, src, TAG_ERROR,
               MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      line[sizeof line - 1] = '\0';
      /* A rank that stopped because rank 0 asked it to adds nothing. */
      if (!s->failed) fail_once(s, src, line);
      s->ndone++;
    } else {
      int junk[64];
      MPI_Recv(junk, 64, MPI_INT, src, ps.MPI_TAG, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
      fail_once(s, 0, "unexpected message (internal error)");
    }
  }
}

/* ---- every rank ---- */

static double peak_rss_mb(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return (double)ru.ru_maxrss / 1024.0;
}

static double cpu_seconds(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec +
         (double)ru.ru_stime.tv_sec + 1e-6 * (double)ru.ru_stime.tv_usec;
}

static void gather_hosts(rank_info *ranks) {
  char host[MPI_MAX_PROCESSOR_NAME + 1] = {0};
  int len = 0;
  MPI_Get_processor_name(host, &len);
  char *all = g_rank == 0 ? calloc((size_t)g_size, sizeof host) : NULL;
  MPI_Gather(host, (int)sizeof host, MPI_CHAR, all, (int)sizeof host, MPI_CHAR,
             0, MPI_COMM_WORLD);
  if (g_rank == 0 && all && ranks)
    for (int r = 0; r < g_size; r++)
      snprintf(ranks[r].host, sizeof ranks[r].host, "%s",
               all + (size_t)r * sizeof host);
  free(all);
}

static const char *message(bico_ctx *ctx, bico_status st) {
  static char m[1024]; /* the context's message is at most this long */
  /* as the serial command: no library function's names */
  cli_user_message(bico_ctx_errmsg(ctx), m, sizeof m);
  return m[0] ? m : bico_strerror(st);
}

/* Rank 0 holds the lock of each output folder (folder.h) for the whole
 * run, from before the plan reads the inputs to after the commit has
 * removed the old tree; the writers of bico_transfer_assemble_begin join
 * it.  The folders' own checks (a dangling link, a mount point, the
 * working directory) come first too. */
static bico_status lock_outputs(bico_transfer *t, bico_ctx *ctx,
                                bico_folder **f) {
  const char *tb = NULL, *o[2] = {NULL, NULL};
  bico_transfer_get_file(t, BICO_FILE_TARGET_BASE, &tb);
  bico_transfer_get_file(t, BICO_FILE_OUTPUT, &o[0]);
  bico_transfer_get_file(t, BICO_FILE_DELTA_OUTPUT, &o[1]);
  static const char *const what[2] = {"output", "delta output"};
  bico_status st = bico_folder_create(ctx, f);
  for (int k = 0; k < 2 && st == BICO_OK; k++)
    if (o[k] != NULL && bico_stwriter_output_is_folder(o[k], tb))
      st = bico_folder_add_output(*f, what[k], o[k], BICO_FOLDER_CARRY, NULL);
  if (st == BICO_OK) st = bico_folder_begin(*f);
  return st;
}

/* A worker's part after its plan: compute, send, report. */
static bico_status run_worker(bico_transfer *t, bico_ctx *ctx,
                              const unsigned char *select, size_t nt,
                              double t0) {
  sender s;
  memset(&s, 0, sizeof s);
  const char *b = getenv("BICO_MPI_SEND_BUDGET");
  s.budget = b && b[0] ? (size_t)strtoull(b, NULL, 10) : (size_t)1 << 30;
  bico_status st = bico_transfer_set_partial(t, select, nt, sink_send, &s);
  if (st == BICO_OK) st = bico_transfer_run(t);
  sender_reap(&s, 1);
  free(s.p);
  if (st != BICO_OK) {
    char line[1024];
    snprintf(line, sizeof line, "%s", s.msg[0] ? s.msg : message(ctx, st));
    MPI_Send(line, (int)strlen(line) + 1, MPI_CHAR, 0, TAG_ERROR,
             MPI_COMM_WORLD);
  } else {
    double v[5] = {mpi_now() - t0, (double)s.tensors, (double)s.updated,
                   peak_rss_mb(), cpu_seconds()};
    MPI_Send(v, 5, MPI_DOUBLE, 0, TAG_DONE, MPI_COMM_WORLD);
  }
  return st;
}

/* Rank 0's part after the plan: assemble, compute its share, receive the
 * others', commit. */
static bico_status run_rank0(bico_transfer *t, bico_ctx *ctx,
                             const unsigned char *select, size_t nt,
                             receiver *s, double t0) {
  bico_status st = bico_transfer_set_partial(t, select, nt, sink_put, s);
  if (st == BICO_OK) st = bico_transfer_run(t);
  if (st != BICO_OK)
    fail_once(s, 0, s->msg[0] ? s->msg + strlen("rank 0: ")
                              : message(ctx, st));
  s->ranks[0].seconds = mpi_now() - t0;
  s->ranks[0].rss_mb = peak_rss_mb();
  s->ranks[0].cpu = cpu_seconds();
  receive_all(s);
  if (s->failed) return BICO_E_IO;
  const char *rep = NULL;
  bico_transfer_get_file(t, BICO_FILE_REPORT, &rep);
  if (rep) mpi_tmp_before(rep);
  st = bico_transfer_assemble_commit(t);
  if (st != BICO_OK) fail_once(s, 0, message(ctx, st));
  mpi_tmp_forget();
  return st;
}

/* Creates the output's (and delta output's) temporaries, registered with
 * the signal handler. */
static bico_status begin_output(bico_transfer *t) {
  const char *paths[2] = {NULL, NULL};
  bico_transfer_get_file(t, BICO_FILE_OUTPUT, &paths[0]);
  bico_transfer_get_file(t, BICO_FILE_DELTA_OUTPUT, &paths[1]);
  for (int i = 0; i < 2; i++)
    if (paths[i]) mpi_tmp_before(paths[i]);
  bico_status st = bico_transfer_assemble_begin(t);
  for (int i = 0; i < 2; i++)
    if (paths[i]) mpi_tmp_after(paths[i]);
  return st;
}

static void report_ranks(const receiver *s, const double *load, size_t nt) {
  for (int r = 0; r < g_size; r++)
    say("bico: rank %d (%s): %zu tensors (%zu updated), estimated cost %.3g, "
        "%.3f s (CPU %.3f s), peak RSS %.1f MB",
        r, s->ranks[r].host, s->ranks[r].tensors, s->ranks[r].updated, load[r],
        s->ranks[r].seconds, s->ranks[r].cpu, s->ranks[r].rss_mb);
  size_t updated = 0, unchanged = 0;
  bico_transfer_counts(s->t, &updated, &unchanged);
  say("bico: %zu of %zu tensors updated on %d ranks", updated, nt, g_size);
}

int mpi_transfer_run(bico_transfer *t, bico_ctx *ctx, int quiet) {
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  mpi_restore_stderr(); /* the options parsed: the run's messages count */
  g_quiet = quiet;
  double t0 = mpi_now();
  char msg[1400] = "";
  bico_transfer_set_log(t, quiet ? NULL : log_line, NULL);
  /* Every rank reads the same files (the command lines were compared in
   * main): rank 0 compares their fingerprints before anything is done. */
  static const int ins[11] = {BICO_FILE_SOURCE_BASE,   BICO_FILE_SOURCE_TUNED,
                              BICO_FILE_TASK_VECTOR,   BICO_FILE_TARGET_BASE,
                              BICO_FILE_SOURCE_CALIB,  BICO_FILE_TARGET_CALIB,
                              BICO_FILE_STATS,         BICO_FILE_TARGET_VOTES,
                              BICO_FILE_LORA,          BICO_FILE_SOURCE_CONFIG,
                              BICO_FILE_TARGET_CONFIG};
  static const char *const what[11] = {
      "--source-base", "--source-tuned", "--task-vector", "--target-base",
      "--source-calib", "--target-calib", "--stats", "--target-votes",
      "--lora", "--source-config", "--target-config"};
  const char *paths[11];
  for (int i = 0; i < 11; i++) {
    paths[i] = NULL;
    bico_transfer_get_file(t, ins[i], &paths[i]);
  }
  if (mpi_same_files(what, paths, 11, msg, sizeof msg)) {
    if (g_rank == 0) fprintf(stderr, "bico transfer: %s\n", msg);
    return 1;
  }
  /* Every rank plans the same run (and so checks the same setup). */
  bico_folder *lock = NULL;
  bico_status st = g_rank == 0 ? lock_outputs(t, ctx, &lock) : BICO_OK;
  if (st == BICO_OK) st = bico_transfer_plan(t);
  size_t nt = 0, ng = 0;
  if (st == BICO_OK) st = bico_transfer_plan_size(t, &nt, &ng);
  int *owner = malloc((nt ? nt : 1) * sizeof *owner);
  double *load = calloc((size_t)g_size, sizeof *load);
  unsigned char *select = malloc(nt ? nt : 1);
  receiver s;
  memset(&s, 0, sizeof s);
  s.t = t;
  s.ctx = ctx;
  s.ranks = g_rank == 0 ? calloc((size_t)g_size, sizeof *s.ranks) : NULL;
  if (st == BICO_OK && (!owner || !load || !select || (g_rank == 0 && !s.ranks)))
    st = BICO_E_NOMEM;
  if (st == BICO_OK) st = assign(t, nt, ng, owner, load);
  if (g_rank == 0 && st == BICO_OK) {
    mpi_install_handlers();
    st = begin_output(t);
  }
  if (mpi_any_failed(st != BICO_OK, message(ctx, st), msg, sizeof msg)) {
    if (g_rank == 0) fprintf(stderr, "bico transfer: %s\n", msg);
    st = BICO_E_IO;
  } else {
    for (size_t ti = 0; ti < nt; ti++) select[ti] = owner[ti] == g_rank;
    if (g_rank == 0) {
      size_t mine = 0;
      for (size_t ti = 0; ti < nt; ti++) mine += select[ti];
      say("bico: %d ranks; %zu target tensors in %zu groups by map", g_size,
          nt, ng);
    }
    gather_hosts(s.ranks);
    st = g_rank == 0 ? run_rank0(t, ctx, select, nt, &s, t0)
                     : run_worker(t, ctx, select, nt, t0);
    if (g_rank == 0 && st == BICO_OK) report_ranks(&s, load, nt);
    if (g_rank == 0 && st != BICO_OK)
      fprintf(stderr, "bico transfer: %s\n", s.msg);
    /* The outcome is rank 0's to report. */
    int code = g_rank == 0 ? st != BICO_OK : 0;
    MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (g_rank != 0 && stop_requested()) {
      int junk;
      MPI_Recv(&junk, 1, MPI_INT, 0, TAG_MSG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    st = code ? BICO_E_IO : BICO_OK;
  }
  free(owner);
  free(load);
  free(select);
  free(s.ranks);
  bico_folder_free(lock);
  return st == BICO_OK ? 0 : 1;
}
