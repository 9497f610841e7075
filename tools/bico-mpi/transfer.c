/* bico-mpi transfer: the whole-model transfer divided among ranks.
 *
 * Rank 0 plans: target tensors are grouped by the module whose maps they
 * use (a linear or element-wise module with its weight, bias and vectors;
 * a token with its tie module), each group gets an estimated cost (the
 * SVDs of its maps, O(d^3), plus the transport and the bytes), and the
 * groups go to the ranks greedily, largest first, to the least loaded rank
 * (rank 0, which also writes, counts at half capacity with 2 or 3 ranks
 * and gets nothing from 4 on).  Every rank then runs
 * a partial bico_transfer (bico_transfer_set_partial) over its tensors,
 * computing the maps they need; the other ranks send each update to rank
 * 0, which writes it at its place in the output (the writer lays tensors
 * out in the target's order and accepts them in any order), one tensor at
 * a time.  Only rank 0 writes, through the library's atomic writer: any
 * failure, on any rank, ends the run with that rank's message and no
 * output (rank 0 removes its temporary files, then MPI_Abort). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#include <sys/resource.h>

#include "mpicli.h"

/* ---- the configuration, recorded from the serial command's calls ---- */

#define NSLOTS 12
static bico_ctx *g_ctx;
static const char *g_files[NSLOTS];
static const char *g_blocks[4];
static struct {
  const char *tensor, *module;
} g_ties[256];
static size_t g_nties;
static bico_transfer_log_fn g_log;
static void *g_log_opaque;
static int g_rank, g_size;

bico_status mpi_transfer_create(bico_ctx *ctx, bico_transfer **out) {
  g_ctx = ctx;
  mpi_restore_stderr(); /* the options parsed: the run's messages count */
  return bico_transfer_create(ctx, out);
}

static char *dup_or_null(const char *s) {
  if (s == NULL) return NULL;
  size_t n = strlen(s) + 1;
  char *p = malloc(n);
  if (p) memcpy(p, s, n);
  return p;
}

bico_status mpi_transfer_set_file(bico_transfer *t, int which,
                                  const char *path) {
  bico_status st = bico_transfer_set_file(t, which, path);
  if (st == BICO_OK && which > 0 && which < NSLOTS) g_files[which] = dup_or_null(path);
  return st;
}

bico_status mpi_transfer_set_string(bico_transfer *t, int which,
                                    const char *value) {
  bico_status st = bico_transfer_set_string(t, which, value);
  if (st == BICO_OK && which > 0 && which < 4) g_blocks[which] = dup_or_null(value);
  return st;
}

bico_status mpi_transfer_add_tie(bico_transfer *t, const char *tensor,
                                 const char *module) {
  bico_status st = bico_transfer_add_tie(t, tensor, module);
  if (st == BICO_OK && g_nties < 256) {
    g_ties[g_nties].tensor = dup_or_null(tensor);
    g_ties[g_nties].module = dup_or_null(module);
    g_nties++;
  }
  return st;
}

static void log_rank(void *opaque, const char *line) {
  (void)opaque;
  if (g_log == NULL) return;
  char buf[640];
  if (g_size > 1) {
    snprintf(buf, sizeof buf, "[rank %d] %s", g_rank, line);
    g_log(g_log_opaque, buf);
  } else {
    g_log(g_log_opaque, line);
  }
}

bico_status mpi_transfer_set_log(bico_transfer *t, bico_transfer_log_fn fn,
                                 void *opaque) {
  g_log = fn;
  g_log_opaque = opaque;
  return bico_transfer_set_log(t, fn ? log_rank : NULL, NULL);
}

static void say(const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 1, 2)))
#endif
    ;
#include <stdarg.h>
static void say(const char *fmt, ...) {
  if (g_log == NULL) return;
  char line[640];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  g_log(g_log_opaque, line);
}

/* ---- planning (rank 0) ---- */

static const char *const HANDLING[7] = {"unchanged", "linear", "vector",
                                        "tied",      "naive",  "padded",
                                        "masked"};
static const char *const METHOD[7] = {NULL,      "bico",  "bico-in", "bico-out",
                                      "gradfix", "naive", "pad"};

typedef struct group {
  size_t id;
  double cost;
} group;

static int by_cost(const void *a, const void *b) {
  const group *x = a, *y = b;
  if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

/* Rank 0's capacity relative to the others: it also receives and writes,
 * and while it computes a tensor the others' sends wait for it.  So with
 * 2 or 3 ranks it computes half a share, and from 4 ranks on it only
 * writes (what it would add is less than what its stalls would cost).
 * BICO_MPI_RANK0_SHARE in [0, 1] overrides. */
static double rank0_share(void) {
  const char *e = getenv("BICO_MPI_RANK0_SHARE");
  if (e != NULL && e[0] != '\0') {
    char *end;
    double v = strtod(e, &end);
    if (*end == '\0' && v >= 0 && v <= 1) return v > 0 ? v : 1e-9;
  }
  return g_size >= 4 ? 1e-9 : 0.5;
}

static double svd_cost(size_t a, size_t b) {
  double m = (double)(a < b ? a : b);
  return (double)a * (double)b * m;
}

/* The module whose maps target tensor ti (a token) uses: an explicit tie,
 * else the stem (the library's rule: a linear module outside the blocks
 * whose output width is the token's and whose name says embed, stem or
 * patch).  A wrong guess costs only a duplicated map, never a wrong
 * result: every rank computes the maps its tensors need. */
static size_t token_module(const bico_model *mt, size_t ti) {
  const char *name;
  size_t ndim, mi;
  const size_t *shape;
  bico_model_tensor(mt, ti, &name, NULL, &ndim, &shape);
  for (size_t i = g_nties; i-- > 0;)
    if (strcmp(g_ties[i].tensor, name) == 0)
      return bico_model_find_module(mt, g_ties[i].module, &mi) == BICO_OK
                 ? mi
                 : SIZE_MAX;
  size_t width = ndim ? shape[ndim - 1] : 0, nm = bico_model_module_count(mt);
  for (size_t m = 0; m < nm; m++) {
    const char *n;
    int kind;
    long block;
    size_t dout;
    bico_model_module(mt, m, &n, &kind, &block, NULL);
    if (kind != BICO_MODULE_LINEAR || block >= 0) continue;
    if (bico_model_module_dims(mt, m, &dout, NULL) != BICO_OK || dout != width)
      continue;
    if (strstr(n, "embed") || strstr(n, "stem") || strstr(n, "patch")) return m;
  }
  return SIZE_MAX;
}

/* owner[ti] = the rank computing target tensor ti; est[r] = rank r's
 * estimated cost. */
static bico_status plan(bico_ctx *ctx, const bico_model *ms,
                        const bico_model *mt, int method, int norm_grad,
                        int *owner, double *est, size_t *ngroups_out) {
  size_t nt = bico_model_tensor_count(mt), nm = bico_model_module_count(mt);
  int bico = method <= BICO_METHOD_BICO_OUT;
  size_t *gid = malloc((nt ? nt : 1) * sizeof *gid);
  group *g = calloc(nm + nt + 1, sizeof *g);
  double *load = calloc((size_t)g_size, sizeof *load);
  if (gid == NULL || g == NULL || load == NULL) {
    free(gid);
    free(g);
    free(load);
    return BICO_E_NOMEM;
  }
  (void)ctx;
  for (size_t i = 0; i < nm + nt; i++) g[i].id = i;
  for (size_t ti = 0; ti < nt; ti++) {
    size_t mi = SIZE_MAX, ndim;
    int role = BICO_ROLE_OTHER;
    const size_t *shape;
    bico_model_tensor(mt, ti, NULL, NULL, &ndim, &shape);
    bico_model_tensor_module(mt, ti, &mi, &role);
    size_t numel = 1;
    for (size_t d = 0; d < ndim; d++) numel *= shape[d];
    size_t grp = nm + ti; /* alone */
    if (bico && (role == BICO_ROLE_WEIGHT || role == BICO_ROLE_BIAS ||
                 role == BICO_ROLE_VECTOR))
      grp = mi;
    else if (bico && role == BICO_ROLE_TOKEN) {
      size_t tm = token_module(mt, ti);
      if (tm != SIZE_MAX) grp = tm;
    }
    gid[ti] = grp;
    g[grp].cost += (double)numel + 1.0; /* reading, adding, sending */
  }
  /* The maps: one or two SVDs per paired module that some tensor uses. */
  for (size_t m = 0; m < nm && bico; m++) {
    if (g[m].cost == 0) continue;
    size_t sm, dob, dib, doa, dia;
    int kind;
    if (bico_model_pair_module(mt, m, ms, &sm) != BICO_OK) continue;
    bico_model_module(mt, m, NULL, &kind, NULL, NULL);
    if (bico_model_module_dims(mt, m, &dob, &dib) != BICO_OK ||
        bico_model_module_dims(ms, sm, &doa, &dia) != BICO_OK)
      continue;
    if (kind == BICO_MODULE_ELEMENTWISE) {
      g[m].cost += norm_grad ? svd_cost(doa, dob) : svd_cost(dia, dib);
      continue;
    }
    if (method != BICO_METHOD_BICO_OUT) g[m].cost += svd_cost(dia, dib);
    if (method != BICO_METHOD_BICO_IN) g[m].cost += svd_cost(doa, dob);
    g[m].cost += (double)doa * (double)dia * (double)dib +
                 (double)dob * (double)doa * (double)dib;
  }
  size_t ng = nm + nt;
  double *gcost = malloc(ng * sizeof *gcost);
  if (gcost == NULL) {
    free(gid);
    free(g);
    free(load);
    return BICO_E_NOMEM;
  }
  for (size_t i = 0; i < ng; i++) gcost[i] = g[i].cost;
  qsort(g, ng, sizeof *g, by_cost);
  int *grank = malloc(ng * sizeof *grank);
  size_t used = 0;
  for (size_t i = 0; i < ng && grank; i++) {
    if (g[i].cost == 0) continue;
    used++;
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
    grank[g[i].id] = best;
  }
  if (grank)
    for (size_t ti = 0; ti < nt; ti++) owner[ti] = grank[gid[ti]];
  for (int r = 0; r < g_size; r++) est[r] = load[r];
  *ngroups_out = used;
  bico_status st = grank ? BICO_OK : BICO_E_NOMEM;
  free(grank);
  free(gcost);
  free(gid);
  free(g);
  free(load);
  return st;
}

/* ---- rank 0: the writer ---- */

typedef struct rank_info {
  double seconds, est, rss_mb, cpu;
  size_t tensors, updated;
  char host[MPI_MAX_PROCESSOR_NAME + 1];
  int done;
} rank_info;

typedef struct writer0 {
  bico_ctx *ctx;
  bico_stfile *tb;
  bico_stwriter *w, *wd;
  size_t nt, written;
  char **entries;
  size_t count[7];
  rank_info *ranks;
  int ndone;
  char msg[1200]; /* the first failure, "rank R: ..." */
  size_t unit;    /* tensors handled on this rank (test hook) */
} writer0;

static int handling_index(const char *h) {
  for (int i = 0; i < 7; i++)
    if (strcmp(h, HANDLING[i]) == 0) return i;
  return 0;
}

static int is_float(int dtype) {
  return dtype == BICO_DTYPE_F32 || dtype == BICO_DTYPE_F16 ||
         dtype == BICO_DTYPE_BF16 || dtype == BICO_DTYPE_F64;
}

/* One tensor into the outputs, as the single-process run writes it:
 * theta_B + update in double, rounded once to the target's dtype;
 * unchanged tensors byte for byte. */
static int put_tensor(writer0 *s, int from, size_t ti, int h,
                      const float *upd, size_t count, const char *entry) {
  bico_ctx *ctx = s->ctx;
  const char *name;
  int dtype;
  size_t numel;
  bico_status st;
  if (ti >= s->nt || s->entries[ti] != NULL) {
    snprintf(s->msg, sizeof s->msg, "rank %d: tensor %zu sent twice or out of "
             "range (internal error)", from, ti);
    return -1;
  }
  st = bico_stfile_tensor_info(s->tb, ti, &name, &dtype, NULL, NULL);
  if (st == BICO_OK) st = bico_stfile_tensor_size(s->tb, ti, &numel, NULL);
  if (st == BICO_OK && upd != NULL && count != numel)
    st = BICO_E_SHAPE;
  if (st == BICO_OK && upd != NULL) {
    double *base = malloc((numel ? numel : 1) * sizeof *base);
    if (base == NULL) st = BICO_E_NOMEM;
    if (st == BICO_OK) st = bico_stfile_read_f64(s->tb, ti, base, numel);
    if (st == BICO_OK) st = bico_stfile_check_finite(s->tb, ti);
    for (size_t e = 0; e < numel && st == BICO_OK; e++) base[e] += (double)upd[e];
    if (st == BICO_OK) st = bico_stwriter_write_f64(s->w, name, base, numel);
    if (st == BICO_OK && s->wd)
      st = bico_stwriter_write_f32(s->wd, name, upd, numel);
    free(base);
  } else if (st == BICO_OK) {
    const void *data;
    size_t nbytes;
    st = bico_stfile_data(s->tb, ti, &data, &nbytes);
    if (st == BICO_OK) st = bico_stwriter_write_raw(s->w, name, data, nbytes);
    if (st == BICO_OK && s->wd && is_float(dtype)) {
      float *zero = calloc(numel ? numel : 1, sizeof *zero);
      st = zero ? bico_stwriter_write_f32(s->wd, name, zero, numel)
                : BICO_E_NOMEM;
      free(zero);
    }
  }
  if (st != BICO_OK) {
    snprintf(s->msg, sizeof s->msg, "rank 0: writing tensor %s: %s", name,
             bico_ctx_errmsg(ctx)[0] ? bico_ctx_errmsg(ctx) : bico_strerror(st));
    return -1;
  }
  /* The entry, with the rank that computed it. */
  size_t n = strlen(entry) + 32;
  s->entries[ti] = malloc(n);
  if (s->entries[ti] == NULL) {
    snprintf(s->msg, sizeof s->msg, "rank 0: out of memory");
    return -1;
  }
  if (entry[0] == '{' && entry[1] != '}')
    snprintf(s->entries[ti], n, "{\"rank\": %d, %s", from, entry + 1);
  else
    snprintf(s->entries[ti], n, "%s", entry);
  s->count[h]++;
  s->written++;
  return 0;
}

/* Handles one message from a worker (already probed). */
static int handle(writer0 *s, const MPI_Status *ps) {
  int src = ps->MPI_SOURCE;
  if (ps->MPI_TAG == TAG_HEAD) {
    int64_t head[4];
    MPI_Recv(head, 4, MPI_INT64_T, src, TAG_HEAD, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
    size_t ti = (size_t)head[0], count = (size_t)head[1], elen = (size_t)head[3];
    int h = (int)head[2];
    char *entry = malloc(elen + 1);
    float *upd = count ? malloc(count * sizeof *upd) : NULL;
    if (entry == NULL || (count && upd == NULL) || h < 0 || h > 6) {
      free(entry);
      free(upd);
      snprintf(s->msg, sizeof s->msg, "rank 0: out of memory receiving a "
               "tensor of %zu elements from rank %d", count, src);
      return -1;
    }
    MPI_Recv(entry, (int)elen + 1, MPI_CHAR, src, TAG_BODY, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
    entry[elen] = '\0';
    if (count) mpi_recv_long(upd, count, MPI_FLOAT, sizeof(float), src, TAG_BODY);
    int rc = put_tensor(s, src, ti, h, count ? upd : NULL, count, entry);
    free(entry);
    free(upd);
    return rc;
  }
  if (ps->MPI_TAG == TAG_DONE) {
    char line[512];
    MPI_Recv(line, (int)sizeof line, MPI_CHAR, src, TAG_DONE, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
    line[sizeof line - 1] = '\0';
    rank_info *ri = &s->ranks[src];
    unsigned long long nt = 0, nu = 0;
    sscanf(line, "%lf %llu %llu %lf %lf", &ri->seconds, &nt, &nu, &ri->rss_mb,
           &ri->cpu);
    ri->tensors = (size_t)nt;
    ri->updated = (size_t)nu;
    ri->done = 1;
    s->ndone++;
    return 0;
  }
  if (ps->MPI_TAG == TAG_ERROR) {
    char line[1024];
    MPI_Recv(line, (int)sizeof line, MPI_CHAR, src, TAG_ERROR, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
    line[sizeof line - 1] = '\0';
    snprintf(s->msg, sizeof s->msg, "rank %d: %s", src, line);
    return -1;
  }
  snprintf(s->msg, sizeof s->msg, "rank 0: unexpected message tag %d from "
           "rank %d", ps->MPI_TAG, src);
  return -1;
}

/* Takes every message already waiting. */
static int drain(writer0 *s) {
  for (;;) {
    int flag = 0;
    MPI_Status ps;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, &ps);
    if (!flag) return 0;
    if (handle(s, &ps) != 0) return -1;
  }
}

static bico_status sink0(void *opaque, size_t ti, const char *name,
                         const char *handling, const float *upd, size_t count,
                         const char *entry) {
  writer0 *s = opaque;
  (void)name;
  if (mpi_test_hook(0, s->unit++)) {
    snprintf(s->msg, sizeof s->msg, "rank 0: injected failure at tensor %s "
             "(BICO_MPI_TEST_FAIL)", name);
    return BICO_E_ARG;
  }
  if (put_tensor(s, 0, ti, handling_index(handling), upd, count, entry) != 0)
    return BICO_E_IO;
  /* Keep the other ranks going between this rank's own tensors. */
  return drain(s) == 0 ? BICO_OK : BICO_E_IO;
}

/* ---- the other ranks ---- */

typedef struct worker {
  size_t tensors, updated, unit;
  char msg[1024];
} worker;

static bico_status sinkw(void *opaque, size_t ti, const char *name,
                         const char *handling, const float *upd, size_t count,
                         const char *entry) {
  worker *s = opaque;
  if (mpi_test_hook(g_rank, s->unit++)) {
    snprintf(s->msg, sizeof s->msg, "injected failure at tensor %s "
             "(BICO_MPI_TEST_FAIL)", name);
    return BICO_E_ARG;
  }
  size_t elen = strlen(entry);
  int64_t head[4] = {(int64_t)ti, (int64_t)count,
                     (int64_t)handling_index(handling), (int64_t)elen};
  MPI_Send(head, 4, MPI_INT64_T, 0, TAG_HEAD, MPI_COMM_WORLD);
  MPI_Send(entry, (int)elen + 1, MPI_CHAR, 0, TAG_BODY, MPI_COMM_WORLD);
  if (count) mpi_send_long(upd, count, MPI_FLOAT, sizeof(float), 0, TAG_BODY);
  s->tensors++;
  if (upd) s->updated++;
  return BICO_OK;
}

/* ---- the report ---- */

static void number(FILE *f, double x) {
  if (x == (double)(long long)x && x < 9e15 && x > -9e15)
    fprintf(f, "%.0f", x);
  else
    fprintf(f, "%.9g", x);
}

/* Writes the report to a temporary file next to path; its name into tmp. */
static int write_report(const writer0 *s, const char *path, int method,
                        double alpha, char *tmp,
                        size_t cap) {
  const char *slash = strrchr(path, '/');
  if (slash)
    snprintf(tmp, cap, "%.*s/.%s.bico-tmp.XXXXXX", (int)(slash - path), path,
             slash + 1);
  else
    snprintf(tmp, cap, ".%s.bico-tmp.XXXXXX", path);
  int fd = mkstemp(tmp);
  if (fd < 0) return -1;
  mpi_tmp_add(tmp);
  FILE *f = fdopen(fd, "w");
  if (f == NULL) {
    close(fd);
    unlink(tmp);
    return -1;
  }
  fprintf(f, "{\n  \"method\": \"%s\",\n  \"alpha\": ", METHOD[method]);
  number(f, (double)(float)alpha); /* the run uses alpha as a float */
  fprintf(f, ",\n  \"tensors\": [");
  for (size_t i = 0; i < s->nt; i++)
    fprintf(f, "%s\n    %s", i ? "," : "", s->entries[i]);
  fprintf(f, "],\n  \"summary\": {");
  for (int h = 0; h < 7; h++)
    fprintf(f, "%s\n    \"%s\": %zu", h ? "," : "", HANDLING[h], s->count[h]);
  fprintf(f, "},\n  \"ranks\": [");
  for (int r = 0; r < g_size; r++) {
    const rank_info *ri = &s->ranks[r];
    fprintf(f, "%s\n    {\"rank\": %d, \"host\": \"%s\", \"tensors\": %zu, "
            "\"updated\": %zu, \"estimated_cost\": ",
            r ? "," : "", r, ri->host, ri->tensors, ri->updated);
    number(f, ri->est);
    fprintf(f, ", \"seconds\": %.3f, \"cpu_seconds\": %.3f, "
            "\"peak_rss_mb\": %.1f}", ri->seconds, ri->cpu, ri->rss_mb);
  }
  fprintf(f, "]\n}\n");
  int bad = fflush(f) != 0 || fsync(fileno(f)) != 0;
  bad |= fclose(f) != 0;
  if (bad) {
    unlink(tmp);
    return -1;
  }
  return 0;
}

/* ---- the run ---- */

/* Prints the failure, removes rank 0's temporaries and stops every rank. */
static void fail_all(writer0 *s, const char *msg) {
  fprintf(stderr, "bico transfer: %s\n", msg);
  fflush(stderr);
  if (s) {
    bico_stwriter_free(s->w);
    bico_stwriter_free(s->wd);
    s->w = s->wd = NULL;
  }
  mpi_tmp_forget();
  MPI_Abort(MPI_COMM_WORLD, 1);
}

/* This process's peak resident memory (Linux: ru_maxrss in KiB). */
static double peak_rss_mb(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return (double)ru.ru_maxrss / 1024.0;
}

/* This process's CPU time so far (user and system). */
static double cpu_seconds(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec +
         (double)ru.ru_stime.tv_sec + 1e-6 * (double)ru.ru_stime.tv_usec;
}

/* Host names of every rank into rank 0's table. */
static void gather_hosts(rank_info *ranks) {
  char host[MPI_MAX_PROCESSOR_NAME + 1] = {0};
  int len = 0;
  MPI_Get_processor_name(host, &len);
  char *all = g_rank == 0 ? calloc((size_t)g_size, sizeof host) : NULL;
  MPI_Gather(host, (int)sizeof host, MPI_CHAR, all, (int)sizeof host, MPI_CHAR,
             0, MPI_COMM_WORLD);
  if (g_rank == 0 && all)
    for (int r = 0; r < g_size; r++)
      snprintf(ranks[r].host, sizeof ranks[r].host, "%s", all + (size_t)r * sizeof host);
  free(all);
}

bico_status mpi_transfer_run(bico_transfer *t) {
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  bico_ctx *ctx = g_ctx;
  double t0 = mpi_now();
  double mv = 0, alpha = 1, nmv = 0;
  bico_transfer_get_param(t, BICO_TRANSFER_METHOD, &mv);
  bico_transfer_get_param(t, BICO_TRANSFER_ALPHA, &alpha);
  bico_transfer_get_param(t, BICO_TRANSFER_NORM_MAP, &nmv);
  int method = (int)mv;

  /* Rank 0 plans and opens the outputs; the plan goes to every rank. */
  writer0 s;
  memset(&s, 0, sizeof s);
  s.ctx = ctx;
  bico_stfile *sb = NULL;
  bico_model *ms = NULL, *mt = NULL;
  int *owner = NULL;
  double *est = NULL;
  int64_t nt64 = -1;
  bico_status st = BICO_OK;
  char msg[1200] = "";
  if (g_rank == 0) {
    mpi_install_handlers();
    s.ranks = calloc((size_t)g_size, sizeof *s.ranks);
    est = calloc((size_t)g_size, sizeof *est);
    if (s.ranks == NULL || est == NULL) st = BICO_E_NOMEM;
    if (st == BICO_OK) st = bico_stfile_open(ctx, g_files[BICO_FILE_TARGET_BASE], &s.tb);
    if (st == BICO_OK) st = bico_stfile_open(ctx, g_files[BICO_FILE_SOURCE_BASE], &sb);
    if (st == BICO_OK) st = bico_model_from_stfile(ctx, sb, &ms);
    if (st == BICO_OK) st = bico_model_from_stfile(ctx, s.tb, &mt);
    const char *bs = g_blocks[BICO_TRANSFER_SOURCE_BLOCKS]
                         ? g_blocks[BICO_TRANSFER_SOURCE_BLOCKS]
                         : g_blocks[BICO_TRANSFER_BLOCKS];
    const char *bt = g_blocks[BICO_TRANSFER_TARGET_BLOCKS]
                         ? g_blocks[BICO_TRANSFER_TARGET_BLOCKS]
                         : g_blocks[BICO_TRANSFER_BLOCKS];
    if (st == BICO_OK && bs) st = bico_model_set_blocks(ms, bs);
    if (st == BICO_OK && bt) st = bico_model_set_blocks(mt, bt);
    if (st == BICO_OK) st = bico_model_blocks(ms, NULL, NULL);
    if (st == BICO_OK) st = bico_model_blocks(mt, NULL, NULL);
    if (st == BICO_OK) {
      s.nt = bico_model_tensor_count(mt);
      owner = malloc((s.nt ? s.nt : 1) * sizeof *owner);
      s.entries = calloc(s.nt ? s.nt : 1, sizeof *s.entries);
      if (owner == NULL || s.entries == NULL) st = BICO_E_NOMEM;
    }
    size_t used = 0;
    if (st == BICO_OK)
      st = plan(ctx, ms, mt, method, nmv == BICO_NORM_MAP_GRAD, owner, est,
                &used);
    /* The outputs' temporaries exist from here on (and only on rank 0). */
    const char *out = g_files[BICO_FILE_OUTPUT], *dout = g_files[BICO_FILE_DELTA_OUTPUT];
    if (st == BICO_OK) {
      mpi_tmp_before(out);
      st = bico_stwriter_create(ctx, out, &s.w);
      mpi_tmp_after(out);
    }
    if (st == BICO_OK && dout) {
      mpi_tmp_before(dout);
      st = bico_stwriter_create(ctx, dout, &s.wd);
      mpi_tmp_after(dout);
    }
    for (size_t ti = 0; ti < s.nt && st == BICO_OK; ti++) {
      const char *name;
      int dtype;
      size_t ndim;
      const size_t *shape;
      st = bico_stfile_tensor_info(s.tb, ti, &name, &dtype, &ndim, &shape);
      if (st == BICO_OK) st = bico_stwriter_declare(s.w, name, dtype, ndim, shape);
      if (st == BICO_OK && s.wd && is_float(dtype))
        st = bico_stwriter_declare(s.wd, name, dtype, ndim, shape);
    }
    if (st == BICO_OK) {
      nt64 = (int64_t)s.nt;
      say("bico: %d ranks; %zu target tensors in %zu groups by map; estimated "
          "cost per rank:", g_size, s.nt, used);
      for (int r = 0; r < g_size; r++) {
        size_t n = 0;
        for (size_t ti = 0; ti < s.nt; ti++) n += owner[ti] == r;
        s.ranks[r].est = est[r];
        say("bico:   rank %d: %zu tensors, %.3g", r, n, est[r]);
      }
    } else {
      snprintf(msg, sizeof msg, "%s",
               bico_ctx_errmsg(ctx)[0] ? bico_ctx_errmsg(ctx) : bico_strerror(st));
    }
    bico_model_free(ms);
    bico_model_free(mt);
    bico_stfile_close(sb);
  }
  MPI_Bcast(&nt64, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  if (nt64 < 0) {
    /* Nothing was started: every rank leaves, rank 0 with the message. */
    if (g_rank == 0) {
      bico_stwriter_free(s.w);
      bico_stwriter_free(s.wd);
      mpi_tmp_forget();
      fprintf(stderr, "bico transfer: %s\n", msg);
    }
    free(owner);
    free(s.entries);
    free(s.ranks);
    free(est);
    bico_stfile_close(s.tb);
    MPI_Finalize();
    exit(1);
  }
  size_t nt = (size_t)nt64;
  if (g_rank != 0) owner = malloc((nt ? nt : 1) * sizeof *owner);
  unsigned char *select = malloc(nt ? nt : 1);
  if (owner == NULL || select == NULL) {
    /* Cannot take part in the broadcast below: stop everyone. */
    char m[200];
    snprintf(m, sizeof m, "rank %d: out of memory for the plan of %zu tensors",
             g_rank, nt);
    fail_all(g_rank == 0 ? &s : NULL, m);
  }
  /* In pieces: a model may have more tensors than an int counts. */
  size_t chunk = mpi_chunk_elems();
  for (size_t off = 0; off < nt; off += chunk)
    MPI_Bcast(owner + off, (int)(nt - off < chunk ? nt - off : chunk), MPI_INT,
              0, MPI_COMM_WORLD);
  for (size_t ti = 0; ti < nt; ti++) select[ti] = owner[ti] == g_rank;
  gather_hosts(s.ranks);

  worker wk;
  memset(&wk, 0, sizeof wk);
  if (g_rank == 0) {
    st = bico_transfer_set_partial(t, select, nt, sink0, &s);
    if (st == BICO_OK) st = bico_transfer_run(t);
  } else {
    st = bico_transfer_set_partial(t, select, nt, sinkw, &wk);
    if (st == BICO_OK) st = bico_transfer_run(t);
  }
  double secs = mpi_now() - t0;
  if (g_rank != 0) {
    char line[1024];
    if (st != BICO_OK) {
      snprintf(line, sizeof line, "%s",
               wk.msg[0] ? wk.msg
               : bico_ctx_errmsg(ctx)[0] ? bico_ctx_errmsg(ctx)
                                         : bico_strerror(st));
      MPI_Send(line, (int)strlen(line) + 1, MPI_CHAR, 0, TAG_ERROR, MPI_COMM_WORLD);
      /* Rank 0 ends the run (MPI_Abort); wait for it. */
      int dummy;
      MPI_Recv(&dummy, 1, MPI_INT, 0, TAG_MSG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      exit(1);
    }
    snprintf(line, sizeof line, "%.6f %zu %zu %.1f %.6f", secs, wk.tensors,
             wk.updated, peak_rss_mb(), cpu_seconds());
    MPI_Send(line, (int)strlen(line) + 1, MPI_CHAR, 0, TAG_DONE, MPI_COMM_WORLD);
    free(owner);
    free(select);
    /* The outcome is rank 0's to report. */
    int code = 0;
    MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD);
    return code == 0 ? BICO_OK : BICO_E_IO;
  }

  /* Rank 0: its own share is done; the others' updates keep coming. */
  if (st != BICO_OK)
    fail_all(&s, s.msg[0] ? s.msg : (snprintf(msg, sizeof msg, "rank 0: %s",
                                              bico_ctx_errmsg(ctx)[0]
                                                  ? bico_ctx_errmsg(ctx)
                                                  : bico_strerror(st)),
                                     msg));
  rank_info *r0 = &s.ranks[0];
  r0->seconds = secs;
  r0->rss_mb = peak_rss_mb();
  r0->cpu = cpu_seconds();
  for (size_t ti = 0; ti < nt; ti++)
    if (owner[ti] == 0 && s.entries[ti] != NULL) {
      r0->tensors++;
      if (strstr(s.entries[ti], "\"handling\": \"unchanged\"") == NULL) r0->updated++;
    }
  while (s.ndone < g_size - 1) {
    /* Polls with short sleeps rather than MPI_Probe's busy wait: rank 0
     * usually shares its node with computing ranks. */
    MPI_Status ps;
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, &ps);
    if (!flag) {
      struct timespec ts = {0, 200000};
      nanosleep(&ts, NULL);
      continue;
    }
    if (handle(&s, &ps) != 0) fail_all(&s, s.msg);
  }
  if (s.written != nt) {
    snprintf(msg, sizeof msg, "rank 0: %zu of %zu tensors arrived (internal "
             "error)", s.written, nt);
    fail_all(&s, msg);
  }
  /* Commit order as in the single-process run: the report's temporary,
   * the delta output, the output, then the report's rename. */
  char rtmp[4200] = "";
  const char *rpath = g_files[BICO_FILE_REPORT];
  if (rpath && write_report(&s, rpath, method, alpha, rtmp, sizeof rtmp) != 0) {
    snprintf(msg, sizeof msg, "rank 0: cannot write the report next to %s",
             rpath);
    fail_all(&s, msg);
  }
  st = BICO_OK;
  if (s.wd) st = bico_stwriter_commit(s.wd);
  if (st == BICO_OK) st = bico_stwriter_commit(s.w);
  if (st == BICO_OK && rpath && rename(rtmp, rpath) != 0) st = BICO_E_IO;
  if (st != BICO_OK) {
    if (rtmp[0]) unlink(rtmp);
    snprintf(msg, sizeof msg, "rank 0: %s",
             bico_ctx_errmsg(ctx)[0] ? bico_ctx_errmsg(ctx) : "cannot commit");
    fail_all(&s, msg);
  }
  mpi_tmp_forget();
  size_t updated = nt - s.count[0];
  for (int r = 0; r < g_size; r++)
    say("bico: rank %d (%s): %zu tensors (%zu updated), estimated cost %.3g, "
        "%.3f s (CPU %.3f s), peak RSS %.1f MB", r, s.ranks[r].host,
        s.ranks[r].tensors, s.ranks[r].updated, s.ranks[r].est,
        s.ranks[r].seconds, s.ranks[r].cpu, s.ranks[r].rss_mb);
  say("bico: %zu tensors updated (linear %zu, vector %zu, tied %zu, naive %zu, "
      "padded %zu, masked %zu), %zu unchanged; wrote %s (%d ranks, %.3f s)",
      updated, s.count[1], s.count[2], s.count[3], s.count[4], s.count[5],
      s.count[6], s.count[0], g_files[BICO_FILE_OUTPUT], g_size,
      mpi_now() - t0);
  int code = 0;
  MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD);
  bico_stwriter_free(s.w);
  bico_stwriter_free(s.wd);
  for (size_t ti = 0; ti < nt; ti++) free(s.entries[ti]);
  free(s.entries);
  free(s.ranks);
  free(est);
  free(owner);
  free(select);
  bico_stfile_close(s.tb);
  return BICO_OK;
}
