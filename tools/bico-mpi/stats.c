/* bico-mpi stats: calibration rows divided among ranks, sums reduced.
 *
 * `--source-calib A --target-calib B` may be repeated: the i-th source file
 * pairs with the i-th target file, and the statistics sum over every pair's
 * rows (the calibration set may come in shards).  For each statistic
 * (module and side, planned from the first pair exactly as
 * bico_stats_from_calib plans it) the rows of all pairs, taken in order as
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
  char *name;          /* output tensor */
  char *key_a, *key_b; /* calibration tensors */
  size_t da, db;
  size_t *ia, *ib, *rows; /* per pair */
  size_t total;
} item;

static int is_float(int dtype) {
  return dtype == BICO_DTYPE_F32 || dtype == BICO_DTYPE_F16 ||
         dtype == BICO_DTYPE_BF16 || dtype == BICO_DTYPE_F64;
}

static char *fmt(const char *a, const char *b) {
  size_t n = strlen(a) + strlen(b) + 2;
  char *p = malloc(n);
  if (p) snprintf(p, n, "%s%s%s", a, *a ? "." : "", b);
  return p;
}

/* Checks calibration tensor `key` of file f (path) and gets its width and
 * row count; message into msg on failure. */
static int calib_tensor(const bico_stfile *f, const char *path,
                        const char *key, size_t want_width, size_t *index,
                        size_t *width, size_t *rows, char *msg, size_t cap) {
  size_t i, ndim, numel;
  int dtype;
  const size_t *shape;
  if (bico_stfile_find(f, key, &i) != BICO_OK) {
    snprintf(msg, cap, "calibration file %s has no tensor %s", path, key);
    return -1;
  }
  bico_stfile_tensor_info(f, i, NULL, &dtype, &ndim, &shape);
  bico_stfile_tensor_size(f, i, &numel, NULL);
  if (!is_float(dtype)) {
    snprintf(msg, cap, "calibration file %s: tensor %s has dtype %s, expected "
             "a floating-point type", path, key, bico_dtype_name(dtype));
    return -1;
  }
  size_t w = ndim ? shape[ndim - 1] : 0;
  if (ndim == 0 || w == 0 || (want_width && w != want_width)) {
    snprintf(msg, cap, "calibration file %s: tensor %s has last dimension %zu, "
             "expected %zu", path, key, w, want_width);
    return -1;
  }
  *index = i;
  *width = w;
  *rows = numel / w;
  return 0;
}

int mpi_cmd_stats(int argc, char **argv) {
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const char *src[MAXPAIRS], *tgt[MAXPAIRS], *out = NULL, *blocks = NULL;
  size_t nsrc = 0, ntgt = 0;
  int merge = 0;
  const char **inputs = (const char **)argv;
  size_t ninputs = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v;
    int r;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(HELP, stdout);
      return 0;
    }
    if (strcmp(a, "--merge") == 0) {
      merge = 1;
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
    VALUE("--source-calib", if (nsrc < MAXPAIRS) src[nsrc++] = v)
    VALUE("--target-calib", if (ntgt < MAXPAIRS) tgt[ntgt++] = v)
    VALUE("--output", out = v)
    VALUE("-o", out = v)
    VALUE("--blocks", blocks = v)
#undef VALUE
    if (a[0] == '-' && a[1] != '\0')
      return rank ? CLI_USAGE
                  : cli_error("stats", CLI_USAGE, "unknown option %s", a);
    inputs[ninputs++] = a;
  }
  const char *usage = NULL;
  char ubuf[256];
  if (out == NULL) usage = "missing --output";
  else if (merge && (nsrc || ntgt || blocks))
    usage = "--merge takes statistics files, not calibration options";
  else if (merge && ninputs == 0) usage = "--merge needs statistics files";
  else if (!merge && ninputs > 0) {
    snprintf(ubuf, sizeof ubuf, "unexpected argument %s (use --merge to merge "
             "statistics files)", inputs[0]);
    usage = ubuf;
  } else if (!merge && (nsrc == 0 || ntgt == 0))
    usage = nsrc == 0 ? "missing --source-calib" : "missing --target-calib";
  else if (!merge && nsrc != ntgt) {
    snprintf(ubuf, sizeof ubuf, "%zu --source-calib and %zu --target-calib: "
             "they go in pairs", nsrc, ntgt);
    usage = ubuf;
  } else if (nsrc >= MAXPAIRS)
    usage = "too many calibration files";
  if (usage) return rank ? CLI_USAGE : cli_error("stats", CLI_USAGE, "%s", usage);

  bico_ctx *ctx;
  if (bico_ctx_create(&ctx) != BICO_OK)
    return cli_error("stats", CLI_FAIL, "out of memory");
  char msg[1200] = "", all[1300] = "";
  if (merge) {
    int code = 0;
    if (rank == 0) {
      bico_status st = bico_stats_merge(ctx, inputs, ninputs, out);
      code = st == BICO_OK ? 0 : cli_lib_error("stats", ctx, st);
      if (st == BICO_OK) fprintf(stderr, "bico stats: wrote %s\n", out);
    }
    MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD);
    bico_ctx_free(ctx);
    return code;
  }
  double t0 = mpi_now();
  size_t np = nsrc;
  bico_stfile *fa[MAXPAIRS] = {0}, *fb[MAXPAIRS] = {0};
  bico_model *ma = NULL, *mb = NULL;
  item *items = NULL;
  size_t nitems = 0;
  bico_status st = BICO_OK;
  int failed = 0;
  /* Every rank plans from the headers (cheap and identical). */
  for (size_t p = 0; p < np && st == BICO_OK; p++) {
    st = bico_stfile_open(ctx, src[p], &fa[p]);
    if (st == BICO_OK) st = bico_stfile_open(ctx, tgt[p], &fb[p]);
  }
  if (st == BICO_OK) st = bico_model_from_stfile(ctx, fa[0], &ma);
  if (st == BICO_OK) st = bico_model_from_stfile(ctx, fb[0], &mb);
  if (st == BICO_OK && blocks) st = bico_model_set_blocks(ma, blocks);
  if (st == BICO_OK && blocks) st = bico_model_set_blocks(mb, blocks);
  if (st == BICO_OK) st = bico_model_blocks(ma, NULL, NULL);
  if (st == BICO_OK) st = bico_model_blocks(mb, NULL, NULL);
  if (st != BICO_OK) {
    snprintf(msg, sizeof msg, "%s", bico_ctx_errmsg(ctx));
    failed = 1;
  }
  size_t nmod = failed ? 0 : bico_model_module_count(mb);
  items = calloc(2 * (nmod ? nmod : 1), sizeof *items);
  if (items == NULL && !failed) {
    snprintf(msg, sizeof msg, "out of memory");
    failed = 1;
  }
  static const char *const SIDES[2][2] = {{"input", "in_xcov"},
                                          {"output_grad", "out_xcov"}};
  for (size_t m = 0; m < nmod && !failed; m++) {
    const char *mname;
    bico_model_module(mb, m, &mname, NULL, NULL, NULL);
    for (int sd = 0; sd < 2 && !failed; sd++) {
      char *key = fmt(mname, SIDES[sd][0]);
      size_t ib;
      if (key == NULL || bico_stfile_find(fb[0], key, &ib) != BICO_OK) {
        free(key);
        continue;
      }
      item *it = &items[nitems++];
      it->key_b = key;
      size_t cap = strlen(key) + 4096;
      it->key_a = malloc(cap);
      it->name = fmt(mname, SIDES[sd][1]);
      it->ia = calloc(np, sizeof *it->ia);
      it->ib = calloc(np, sizeof *it->ib);
      it->rows = calloc(np, sizeof *it->rows);
      if (!it->key_a || !it->name || !it->ia || !it->ib || !it->rows) {
        snprintf(msg, sizeof msg, "out of memory");
        failed = 1;
        break;
      }
      if (bico_model_map_name(mb, ma, key, it->key_a, cap, NULL) != BICO_OK) {
        snprintf(msg, sizeof msg, "%s", bico_ctx_errmsg(ctx));
        failed = 1;
        break;
      }
      for (size_t p = 0; p < np && !failed; p++) {
        size_t ra, rb;
        if (p == 0 && bico_stfile_find(fa[0], it->key_a, &ib) != BICO_OK) {
          snprintf(msg, sizeof msg, "stats: target calibration %s has %s, but "
                   "source calibration %s lacks its partner %s", tgt[0], key,
                   src[0], it->key_a);
          failed = 1;
          break;
        }
        if (calib_tensor(fa[p], src[p], it->key_a, it->da, &it->ia[p], &it->da,
                         &ra, msg, sizeof msg) ||
            calib_tensor(fb[p], tgt[p], key, it->db, &it->ib[p], &it->db, &rb,
                         msg, sizeof msg)) {
          failed = 1;
          break;
        }
        if (ra != rb) {
          snprintf(msg, sizeof msg, "module %s: source calibration (%s) has "
                   "%zu rows, target calibration (%s) has %zu", mname, src[p],
                   ra, tgt[p], rb);
          failed = 1;
          break;
        }
        it->rows[p] = ra;
        it->total += ra;
      }
    }
  }
  if (!failed && nitems == 0) {
    snprintf(msg, sizeof msg, "stats: target calibration %s holds no "
             "\"<module>.input\" or \"<module>.output_grad\" tensor", tgt[0]);
    failed = 1;
  }
  /* Rank 0 opens the output (its temporary file) only when all agree. */
  bico_stwriter *w = NULL;
  int agreed_fail = mpi_any_failed(failed, msg, all, sizeof all);
  if (!agreed_fail) {
    int wfail = 0;
    if (rank == 0) {
      mpi_install_handlers();
      mpi_tmp_before(out);
      st = bico_stwriter_create(ctx, out, &w);
      mpi_tmp_after(out);
      if (st == BICO_OK) st = bico_stwriter_add_metadata(w, "format", "bico-stats");
      for (size_t i = 0; i < nitems && st == BICO_OK; i++) {
        size_t shape[2] = {items[i].da, items[i].db};
        st = bico_stwriter_declare(w, items[i].name, BICO_DTYPE_F64, 2, shape);
      }
      if (st != BICO_OK) {
        snprintf(all, sizeof all, "rank 0: %s", bico_ctx_errmsg(ctx));
        wfail = 1;
      }
    }
    MPI_Bcast(&wfail, 1, MPI_INT, 0, MPI_COMM_WORLD);
    agreed_fail = wfail;
  }

  double secs_acc = 0, secs_red = 0;
  size_t bytes_red = 0;
  size_t chunk_floats = CHUNK_FLOATS;
  for (size_t i = 0; i < nitems && !agreed_fail; i++) {
    item *it = &items[i];
    /* This rank's rows of the concatenated pairs. */
    size_t lo = (size_t)((unsigned long long)it->total * (unsigned)rank / (unsigned)size);
    size_t hi = (size_t)((unsigned long long)it->total * (unsigned)(rank + 1) / (unsigned)size);
    bico_xcov *xc = NULL;
    double *c = NULL;
    int bad = 0;
    double ta = mpi_now();
    if (mpi_test_hook(rank, i)) {
      snprintf(msg, sizeof msg, "injected failure at statistic %s "
               "(BICO_MPI_TEST_FAIL)", it->name);
      bad = 1;
    }
    if (!bad && bico_xcov_create(ctx, it->da, it->db, 0, &xc) != BICO_OK) bad = 1;
    size_t wide = it->da > it->db ? it->da : it->db;
    size_t chunk = chunk_floats / wide ? chunk_floats / wide : 1;
    float *xa = bad ? NULL : malloc(chunk * it->da * sizeof *xa);
    float *xb = bad ? NULL : malloc(chunk * it->db * sizeof *xb);
    if (!bad && (xa == NULL || xb == NULL)) {
      snprintf(msg, sizeof msg, "out of memory for %zu calibration rows", chunk);
      bad = 1;
    }
    size_t base = 0;
    for (size_t p = 0; p < np && !bad; p++) {
      size_t plo = lo > base ? lo - base : 0;
      size_t phi = hi - base < it->rows[p] ? hi - base : it->rows[p];
      if (hi <= base) break;
      for (size_t r = plo; r < phi && !bad; r += chunk) {
        size_t n = phi - r < chunk ? phi - r : chunk;
        st = bico_stfile_read_f32_range(fa[p], it->ia[p], r * it->da, n * it->da, xa);
        if (st == BICO_OK)
          st = bico_stfile_read_f32_range(fb[p], it->ib[p], r * it->db, n * it->db, xb);
        if (st == BICO_OK) st = bico_xcov_add(xc, n, xa, it->da, xb, it->db);
        if (st != BICO_OK) {
          snprintf(msg, sizeof msg, "statistic %s, calibration files %s and "
                   "%s, rows %zu..%zu: %s", it->name, src[p], tgt[p], r,
                   r + n - 1, bico_ctx_errmsg(ctx));
          bad = 1;
        }
      }
      base += it->rows[p];
    }
    free(xa);
    free(xb);
    size_t nel = it->da * it->db;
    if (!bad) {
      c = malloc((nel ? nel : 1) * sizeof *c);
      if (c == NULL || bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, c, it->db) != BICO_OK) {
        snprintf(msg, sizeof msg, "no memory for the statistic %s (%zu x %zu)",
                 it->name, it->da, it->db);
        bad = 1;
      }
    }
    if (bad && !msg[0]) snprintf(msg, sizeof msg, "%s", bico_ctx_errmsg(ctx));
    bico_xcov_free(xc);
    secs_acc += mpi_now() - ta;
    /* Every rank agrees before the reduction, so none waits forever. */
    if (mpi_any_failed(bad, msg, all, sizeof all)) {
      free(c);
      agreed_fail = 1;
      break;
    }
    double tr = mpi_now();
    mpi_reduce_sum_long(c, nel, 0, rank);
    secs_red += mpi_now() - tr;
    bytes_red += nel * sizeof(double);
    if (rank == 0) {
      st = bico_stwriter_write_f64(w, it->name, c, nel);
      if (st != BICO_OK) {
        /* Rank 0 alone failed: the others are told at the next check. */
        snprintf(msg, sizeof msg, "%s", bico_ctx_errmsg(ctx));
      }
    }
    free(c);
    int wfail = rank == 0 && st != BICO_OK;
    if (mpi_any_failed(wfail, msg, all, sizeof all)) {
      agreed_fail = 1;
      break;
    }
  }
  if (!agreed_fail && rank == 0) {
    st = bico_stwriter_commit(w);
    if (st != BICO_OK) {
      snprintf(all, sizeof all, "rank 0: %s", bico_ctx_errmsg(ctx));
      agreed_fail = 1;
    }
  }
  {
    int f = agreed_fail;
    MPI_Bcast(&f, 1, MPI_INT, 0, MPI_COMM_WORLD);
    agreed_fail = f;
  }
  /* Who did what: rows, accumulation time and peak memory of each rank. */
  double mine[3] = {secs_acc, 0, 0}, *every = NULL;
  {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0) mine[1] = (double)ru.ru_maxrss / 1024.0;
    for (size_t i = 0; i < nitems; i++)
      mine[2] += (double)((unsigned long long)items[i].total * (unsigned)(rank + 1) / (unsigned)size -
                          (unsigned long long)items[i].total * (unsigned)rank / (unsigned)size);
    if (rank == 0) every = malloc((size_t)size * sizeof mine);
    MPI_Gather(mine, 3, MPI_DOUBLE, every, 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  }
  int code = 0;
  if (rank == 0) {
    bico_stwriter_free(w); /* removes the temporary unless committed */
    mpi_tmp_forget();
    if (agreed_fail) {
      code = cli_error("stats", CLI_FAIL, "%s", all[0] ? all : "failed");
    } else {
      double total = mpi_now() - t0;
      fprintf(stderr, "bico stats: %d ranks, %zu statistics; accumulation "
              "%.3f s, reduction %.3f s (%.1f MB, %.1f MB/s) on rank 0; total "
              "%.3f s\n", size, nitems, secs_acc, secs_red, bytes_red / 1e6,
              secs_red > 0 ? bytes_red / 1e6 / secs_red : 0.0, total);
      for (int r = 0; r < size && every; r++)
        fprintf(stderr, "bico stats: rank %d: %.0f rows (all statistics), "
                "accumulation %.3f s, peak RSS %.1f MB\n", r, every[3 * r + 2],
                every[3 * r], every[3 * r + 1]);
      fprintf(stderr, "bico stats: wrote %s\n", out);
    }
  } else {
    code = agreed_fail ? CLI_FAIL : 0;
  }
  for (size_t i = 0; i < nitems; i++) {
    free(items[i].name);
    free(items[i].key_a);
    free(items[i].key_b);
    free(items[i].ia);
    free(items[i].ib);
    free(items[i].rows);
  }
  free(items);
  free(every);
  bico_model_free(ma);
  bico_model_free(mb);
  for (size_t p = 0; p < np; p++) {
    bico_stfile_close(fa[p]);
    bico_stfile_close(fb[p]);
  }
  bico_ctx_free(ctx);
  return code;
}
