/* bico-mpi stats: calibration rows divided among ranks, sums reduced.
 *
 * `--source-calib A --target-calib B` may be repeated: the i-th source file
 * pairs with the i-th target file, and the statistics sum over every pair's
 * rows (the calibration set may come in shards).  For each statistic
 * (module and side: the library's plan, bico_stats_plan_create, the one
 * bico_stats_from_calib computes) the rows of all pairs, taken in order as
 * one sequence, are cut into one contiguous range per rank; each rank
 * accumulates its range into a bico_xcov and the d_A x d_B sums are added
 * up on rank 0 with MPI_Reduce, in pieces of at most BICO_MPI_CHUNK
 * elements (MPI counts are ints).  Rank 0 writes the statistics file
 * through the library's atomic writer.  Memory per rank: one statistic's
 * accumulator and its copy (2 d_A d_B doubles) plus a chunk of rows.
 * `--merge` runs on rank 0 alone (it is I/O bound). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "cli.h"
#include "mpicli.h"

static const char HELP[] =
    "usage: mpirun -np N bico-mpi stats --source-calib A.calib.safetensors\n"
    "                  --target-calib B.calib.safetensors\n"
    "                  [--source-calib A2 --target-calib B2 ...]\n"
    "                  [--blocks NAME] --output S.safetensors\n"
    "       bico-mpi stats --merge S1.safetensors S2.safetensors ... "
    "--output S.safetensors\n";

#define MAXPAIRS 256
#define CHUNK_FLOATS ((size_t)1 << 22)

typedef struct item {
  const char *name;       /* output tensor (the plan's) */
  size_t da, db;
  size_t *ia, *ib, *rows; /* per pair */
  size_t total;
} item;

/* One `bico-mpi stats` run: its options, open inputs, plan and output,
 * shared by the steps below. */
typedef struct stats_run {
  int rank, size;
  const char *src[MAXPAIRS], *tgt[MAXPAIRS], *out, *blocks;
  size_t nsrc, ntgt, np;
  int merge;
  const char **inputs;
  size_t ninputs;
  bico_ctx *ctx;
  bico_stfile *fa[MAXPAIRS], *fb[MAXPAIRS];
  bico_stats_plan *plan;
  item *items;
  size_t nitems;
  bico_stwriter *w;
  char msg[1200], all[1300];
  double secs_acc, secs_red;
  size_t bytes_red;
} stats_run;

/* Not an exit code: go on with the run. */
#define GO_ON (-1)

/* Options into s; GO_ON or the exit code (help, usage errors). */
static int parse_args(int argc, char **argv, stats_run *s) {
  const int rank = s->rank;
  s->inputs = (const char **)argv;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v;
    int r;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(HELP, stdout);
      return 0;
    }
    if (strcmp(a, "--merge") == 0) {
      s->merge = 1;
      continue;
    }
#define VALUE(name, stmt)                                                  \
  if ((r = cli_opt(argc, argv, &i, name, &v)) != 0) {                      \
    if (r < 0)                                                             \
      return rank ? CLI_USAGE                                              \
                  : cli_error("stats", CLI_USAGE, "option %s needs a value", \
                              name);                                       \
    stmt;                                                                  \
    continue;                                                              \
  }
    VALUE("--source-calib", if (s->nsrc < MAXPAIRS) s->src[s->nsrc++] = v)
    VALUE("--target-calib", if (s->ntgt < MAXPAIRS) s->tgt[s->ntgt++] = v)
    VALUE("--output", s->out = v)
    VALUE("-o", s->out = v)
    VALUE("--blocks", s->blocks = v)
#undef VALUE
    if (a[0] == '-' && a[1] != '\0')
      return rank ? CLI_USAGE
                  : cli_error("stats", CLI_USAGE, "unknown option %s", a);
    s->inputs[s->ninputs++] = a;
  }
  return GO_ON;
}

/* What is missing or contradictory: GO_ON or a usage error. */
static int check_usage(const stats_run *s) {
  const char *usage = NULL;
  char ubuf[256];
  const size_t nsrc = s->nsrc, ntgt = s->ntgt;
  if (s->out == NULL) usage = "missing --output";
  else if (s->merge && (nsrc || ntgt || s->blocks))
    usage = "--merge takes statistics files, not calibration options";
  else if (s->merge && s->ninputs == 0) usage = "--merge needs statistics files";
  else if (!s->merge && s->ninputs > 0) {
    snprintf(ubuf, sizeof ubuf, "unexpected argument %s (use --merge to merge "
             "statistics files)", s->inputs[0]);
    usage = ubuf;
  } else if (!s->merge && (nsrc == 0 || ntgt == 0))
    usage = nsrc == 0 ? "missing --source-calib" : "missing --target-calib";
  else if (!s->merge && nsrc != ntgt) {
    snprintf(ubuf, sizeof ubuf, "%zu --source-calib and %zu --target-calib: "
             "they go in pairs", nsrc, ntgt);
    usage = ubuf;
  } else if (nsrc >= MAXPAIRS)
    usage = "too many calibration files";
  if (usage)
    return s->rank ? CLI_USAGE : cli_error("stats", CLI_USAGE, "%s", usage);
  return GO_ON;
}

/* --merge: rank 0 alone (it is I/O bound); every rank gets the code. */
static int run_merge(stats_run *s) {
  int code = 0;
  if (s->rank == 0) {
    bico_status st = bico_stats_merge(s->ctx, s->inputs, s->ninputs, s->out);
    code = st == BICO_OK ? 0 : cli_lib_error("stats", s->ctx, st);
    if (st == BICO_OK) fprintf(stderr, "bico stats: wrote %s\n", s->out);
  }
  MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return code;
}

/* The context's message without the library's function names. */
static const char *user_msg(bico_ctx *ctx) {
  static char m[1024]; /* the context's message is at most this long */
  cli_user_message(bico_ctx_errmsg(ctx), m, sizeof m);
  return m;
}

/* The library's message about the inputs, without its function names. */
static int lib_failed(stats_run *s) {
  cli_user_message(bico_ctx_errmsg(s->ctx), s->msg, sizeof s->msg);
  return -1;
}

/* Every rank plans from the headers (cheap and identical): the library's
 * plan (which statistics, their calibration tensors, rows per pair, every
 * pair checked), then the tensors' indices in this rank's open files.  0,
 * or -1 with s->msg set. */
static int plan(stats_run *s) {
  if (bico_stats_plan_create(s->ctx, s->src, s->tgt, s->np, s->blocks,
                             &s->plan) != BICO_OK)
    return lib_failed(s);
  for (size_t p = 0; p < s->np; p++)
    if (bico_stfile_open(s->ctx, s->src[p], &s->fa[p]) != BICO_OK ||
        bico_stfile_open(s->ctx, s->tgt[p], &s->fb[p]) != BICO_OK)
      return lib_failed(s);
  size_t n;
  bico_stats_plan_size(s->plan, &n, NULL);
  s->items = calloc(n ? n : 1, sizeof *s->items);
  if (s->items == NULL) {
    snprintf(s->msg, sizeof s->msg, "out of memory");
    return -1;
  }
  for (size_t i = 0; i < n; i++) {
    item *it = &s->items[s->nitems++];
    const char *ka, *kb;
    bico_stats_plan_item(s->plan, i, &it->name, &ka, &kb, &it->da, &it->db);
    it->ia = calloc(s->np, sizeof *it->ia);
    it->ib = calloc(s->np, sizeof *it->ib);
    it->rows = calloc(s->np, sizeof *it->rows);
    if (!it->ia || !it->ib || !it->rows) {
      snprintf(s->msg, sizeof s->msg, "out of memory");
      return -1;
    }
    for (size_t p = 0; p < s->np; p++) {
      bico_stats_plan_rows(s->plan, i, p, &it->rows[p]);
      it->total += it->rows[p];
      if (bico_stfile_find(s->fa[p], ka, &it->ia[p]) != BICO_OK ||
          bico_stfile_find(s->fb[p], kb, &it->ib[p]) != BICO_OK)
        return lib_failed(s); /* the plan found them: a file changed */
    }
  }
  return 0;
}

/* Rank 0 opens the output (its temporary file) and declares every
 * statistic; every rank learns whether that failed (1) or not (0). */
static int open_output(stats_run *s) {
  int wfail = 0;
  if (s->rank == 0) {
    mpi_install_handlers();
    mpi_tmp_before(s->out);
    bico_status st = bico_stwriter_create(s->ctx, s->out, &s->w);
    mpi_tmp_after(s->out);
    if (st == BICO_OK)
      st = bico_stwriter_add_metadata(s->w, "format", "bico-stats");
    for (size_t i = 0; i < s->nitems && st == BICO_OK; i++) {
      size_t shape[2] = {s->items[i].da, s->items[i].db};
      st = bico_stwriter_declare(s->w, s->items[i].name, BICO_DTYPE_F64, 2,
                                 shape);
    }
    if (st != BICO_OK) {
      snprintf(s->all, sizeof s->all, "rank 0: %s", user_msg(s->ctx));
      wfail = 1;
    }
  }
  MPI_Bcast(&wfail, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return wfail;
}

/* This rank's rows [lo, hi) of the concatenated pairs of statistic i. */
static void rank_rows(const stats_run *s, size_t i, int rank, size_t *lo,
                      size_t *hi) {
  const unsigned long long total = s->items[i].total;
  *lo = (size_t)(total * (unsigned)rank / (unsigned)s->size);
  *hi = (size_t)(total * (unsigned)(rank + 1) / (unsigned)s->size);
}

/* Accumulates this rank's rows of statistic i into *c (a new d_a x d_b
 * double array): 0, or -1 with s->msg set (or empty: the context's). */
static int accumulate(stats_run *s, size_t i, double **c) {
  item *it = &s->items[i];
  size_t lo, hi;
  rank_rows(s, i, s->rank, &lo, &hi);
  bico_xcov *xc = NULL;
  int bad = 0;
  *c = NULL;
  if (mpi_test_hook(s->rank, i)) {
    snprintf(s->msg, sizeof s->msg, "injected failure at statistic %s "
             "(BICO_MPI_TEST_FAIL)", it->name);
    bad = 1;
  }
  if (!bad && bico_xcov_create(s->ctx, it->da, it->db, 0, &xc) != BICO_OK)
    bad = 1;
  size_t wide = it->da > it->db ? it->da : it->db;
  size_t chunk = CHUNK_FLOATS / wide ? CHUNK_FLOATS / wide : 1;
  float *xa = bad ? NULL : malloc(chunk * it->da * sizeof *xa);
  float *xb = bad ? NULL : malloc(chunk * it->db * sizeof *xb);
  if (!bad && (xa == NULL || xb == NULL)) {
    snprintf(s->msg, sizeof s->msg, "out of memory for %zu calibration rows",
             chunk);
    bad = 1;
  }
  size_t base = 0;
  for (size_t p = 0; p < s->np && !bad; p++) {
    size_t plo = lo > base ? lo - base : 0;
    size_t phi = hi - base < it->rows[p] ? hi - base : it->rows[p];
    if (hi <= base) break;
    for (size_t r = plo; r < phi && !bad; r += chunk) {
      size_t n = phi - r < chunk ? phi - r : chunk;
      bico_status st = bico_stfile_read_f32_range(s->fa[p], it->ia[p],
                                                  r * it->da, xa, n * it->da);
      if (st == BICO_OK)
        st = bico_stfile_read_f32_range(s->fb[p], it->ib[p], r * it->db, xb,
                                        n * it->db);
      if (st == BICO_OK) st = bico_xcov_add(xc, n, xa, it->da, xb, it->db);
      if (st != BICO_OK) {
        snprintf(s->msg, sizeof s->msg, "statistic %s, calibration files %s "
                 "and %s, rows %zu..%zu: %s", it->name, s->src[p], s->tgt[p],
                 r, r + n - 1, user_msg(s->ctx));
        bad = 1;
      }
    }
    base += it->rows[p];
  }
  free(xa);
  free(xb);
  size_t nel = it->da * it->db;
  if (!bad) {
    *c = malloc((nel ? nel : 1) * sizeof **c);
    if (*c == NULL ||
        bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, *c, it->db) != BICO_OK) {
      snprintf(s->msg, sizeof s->msg, "no memory for the statistic %s "
               "(%zu x %zu)", it->name, it->da, it->db);
      bad = 1;
    }
  }
  if (bad && !s->msg[0])
    snprintf(s->msg, sizeof s->msg, "%s", user_msg(s->ctx));
  bico_xcov_free(xc);
  return bad ? -1 : 0;
}

/* Each statistic: accumulated by every rank, agreed on, reduced onto rank
 * 0, written there.  1 when any rank failed (s->all has the message). */
static int compute_all(stats_run *s) {
  for (size_t i = 0; i < s->nitems; i++) {
    item *it = &s->items[i];
    double *c = NULL;
    double ta = mpi_now();
    int bad = accumulate(s, i, &c) != 0;
    s->secs_acc += mpi_now() - ta;
    /* Every rank agrees before the reduction, so none waits forever. */
    if (mpi_any_failed(bad, s->msg, s->all, sizeof s->all)) {
      free(c);
      return 1;
    }
    size_t nel = it->da * it->db;
    double tr = mpi_now();
    mpi_reduce_sum_long(c, nel, 0, s->rank);
    s->secs_red += mpi_now() - tr;
    s->bytes_red += nel * sizeof(double);
    bico_status st = BICO_OK;
    if (s->rank == 0) {
      st = bico_stwriter_write_f64(s->w, it->name, c, nel);
      if (st != BICO_OK) {
        /* Rank 0 alone failed: the others are told at the next check. */
        snprintf(s->msg, sizeof s->msg, "%s", user_msg(s->ctx));
      }
    }
    free(c);
    int wfail = s->rank == 0 && st != BICO_OK;
    if (mpi_any_failed(wfail, s->msg, s->all, sizeof s->all)) return 1;
  }
  return 0;
}

/* Rank 0 commits the output; every rank learns the outcome (1 failed). */
static int commit(stats_run *s, int failed) {
  if (!failed && s->rank == 0) {
    bico_status st = bico_stwriter_commit(s->w);
    if (st != BICO_OK) {
      snprintf(s->all, sizeof s->all, "rank 0: %s", user_msg(s->ctx));
      failed = 1;
    }
  }
  MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return failed;
}

/* Who did what: rows, accumulation time and peak memory of each rank,
 * gathered on rank 0, which prints them with the totals; the exit code. */
static int report(stats_run *s, int failed, double t0) {
  double mine[3] = {s->secs_acc, 0, 0}, *every = NULL;
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) == 0) mine[1] = (double)ru.ru_maxrss / 1024.0;
  for (size_t i = 0; i < s->nitems; i++) {
    size_t lo, hi;
    rank_rows(s, i, s->rank, &lo, &hi);
    mine[2] += (double)(hi - lo);
  }
  if (s->rank == 0) every = malloc((size_t)s->size * sizeof mine);
  MPI_Gather(mine, 3, MPI_DOUBLE, every, 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  int code = 0;
  if (s->rank == 0) {
    bico_stwriter_free(s->w); /* removes the temporary unless committed */
    s->w = NULL;
    mpi_tmp_forget();
    if (failed) {
      code = cli_error("stats", CLI_FAIL, "%s", s->all[0] ? s->all : "failed");
    } else {
      double total = mpi_now() - t0;
      fprintf(stderr, "bico stats: %d ranks, %zu statistics; accumulation "
              "%.3f s, reduction %.3f s (%.1f MB, %.1f MB/s) on rank 0; total "
              "%.3f s\n", s->size, s->nitems, s->secs_acc, s->secs_red,
              s->bytes_red / 1e6,
              s->secs_red > 0 ? s->bytes_red / 1e6 / s->secs_red : 0.0, total);
      for (int r = 0; r < s->size && every; r++)
        fprintf(stderr, "bico stats: rank %d: %.0f rows (all statistics), "
                "accumulation %.3f s, peak RSS %.1f MB\n", r, every[3 * r + 2],
                every[3 * r], every[3 * r + 1]);
      fprintf(stderr, "bico stats: wrote %s\n", s->out);
    }
  } else {
    code = failed ? CLI_FAIL : 0;
  }
  free(every);
  return code;
}

static void free_run(stats_run *s) {
  for (size_t i = 0; i < s->nitems; i++) {
    free(s->items[i].ia);
    free(s->items[i].ib);
    free(s->items[i].rows);
  }
  free(s->items);
  bico_stats_plan_free(s->plan);
  for (size_t p = 0; p < s->np; p++) {
    bico_stfile_free(s->fa[p]);
    bico_stfile_free(s->fb[p]);
  }
  bico_ctx_free(s->ctx);
}

int mpi_cmd_stats(int argc, char **argv) {
  static stats_run zero;
  stats_run *s = malloc(sizeof *s);
  if (s == NULL) return cli_error("stats", CLI_FAIL, "out of memory");
  *s = zero;
  MPI_Comm_rank(MPI_COMM_WORLD, &s->rank);
  MPI_Comm_size(MPI_COMM_WORLD, &s->size);
  int code = parse_args(argc, argv, s);
  if (code == GO_ON) code = check_usage(s);
  if (code != GO_ON) {
    free(s);
    return code;
  }
  if (bico_ctx_create(&s->ctx) != BICO_OK) {
    free(s);
    return cli_error("stats", CLI_FAIL, "out of memory");
  }
  if (s->merge) {
    code = run_merge(s);
  } else {
    double t0 = mpi_now();
    s->np = s->nsrc;
    /* every rank reads the same calibration files */
    const char *what[2 * MAXPAIRS], *paths[2 * MAXPAIRS];
    for (size_t i = 0; i < s->nsrc; i++) {
      what[2 * i] = "--source-calib";
      paths[2 * i] = s->src[i];
      what[2 * i + 1] = "--target-calib";
      paths[2 * i + 1] = s->tgt[i];
    }
    if (mpi_same_files(what, paths, 2 * s->nsrc, s->all, sizeof s->all)) {
      if (s->rank == 0) fprintf(stderr, "bico stats: %s\n", s->all);
      free_run(s);
      free(s);
      return 1;
    }
    int failed = plan(s) != 0;
    failed = mpi_any_failed(failed, s->msg, s->all, sizeof s->all);
    if (!failed) failed = open_output(s);
    if (!failed) failed = compute_all(s);
    failed = commit(s, failed);
    code = report(s, failed, t0);
  }
  free_run(s);
  free(s);
  return code;
}
