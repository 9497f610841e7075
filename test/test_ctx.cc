// Context, status and version API: allocator hooks, parameters, messages.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <set>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

namespace {

TEST(Status, VersionMacrosMatchLibrary) {
  EXPECT_EQ(bico_version_number(), (unsigned)BICO_VERSION_NUMBER);
  EXPECT_STREQ(bico_version_string(), BICO_VERSION_STRING);
  std::string s = std::to_string(BICO_VERSION_MAJOR) + "." +
                  std::to_string(BICO_VERSION_MINOR) + "." +
                  std::to_string(BICO_VERSION_PATCH);
  EXPECT_EQ(s, bico_version_string());
  EXPECT_EQ(bico_version_number(),
            (unsigned)(BICO_VERSION_MAJOR * 10000 + BICO_VERSION_MINOR * 100 +
                       BICO_VERSION_PATCH));
}

TEST(Status, StrerrorTextsAreDistinct) {
  std::set<std::string> seen;
  for (int c = BICO_OK; c <= BICO_E_INTERNAL; c++) {
    const char *t = bico_strerror(c);
    ASSERT_NE(t, nullptr);
    EXPECT_GT(std::strlen(t), 0u) << c;
    EXPECT_STRNE(t, "unknown status") << c;
    EXPECT_TRUE(seen.insert(t).second) << "duplicate text for " << c;
  }
  for (int c : {-1, BICO_E_INTERNAL + 1, 9999})
    EXPECT_STREQ(bico_strerror(c), "unknown status");
}

TEST(Ctx, CreateAndFree) {
  EXPECT_EQ(BICO_E_NULL, bico_ctx_create(nullptr));
  bico_ctx *ctx = nullptr;
  ASSERT_EQ(BICO_OK, bico_ctx_create(&ctx));
  ASSERT_NE(ctx, nullptr);
  EXPECT_STREQ(bico_ctx_errmsg(ctx), "");
  double th = 0;
  ASSERT_EQ(BICO_OK, bico_ctx_get_param(ctx, BICO_CTX_THREADS, &th));
  EXPECT_EQ(th, 1);  // documented default
  bico_ctx_free(ctx);
  bico_ctx_free(nullptr);
  EXPECT_NE(bico_ctx_errmsg(nullptr), nullptr);
}

struct Counter {
  long allocs = 0, frees = 0;
  size_t bytes = 0;
  long limit = -1;  // >= 0: refuse every allocation after this many
};
void *count_alloc(void *o, size_t n) {
  Counter *c = static_cast<Counter *>(o);
  if (c->limit >= 0 && c->allocs >= c->limit) return nullptr;
  c->allocs++;
  c->bytes += n;
  return std::malloc(n);
}
void count_free(void *o, void *p) {
  if (p != nullptr) static_cast<Counter *>(o)->frees++;
  std::free(p);
}

TEST(Ctx, AllocatorHooksAreUsed) {
  Counter c;
  bico_ctx *ctx = nullptr;
  EXPECT_EQ(BICO_E_NULL,
            bico_ctx_create_with_allocator(&ctx, nullptr, count_free, &c));
  EXPECT_EQ(BICO_E_NULL,
            bico_ctx_create_with_allocator(&ctx, count_alloc, nullptr, &c));
  EXPECT_EQ(BICO_E_NULL,
            bico_ctx_create_with_allocator(nullptr, count_alloc, count_free, &c));
  ASSERT_EQ(BICO_OK,
            bico_ctx_create_with_allocator(&ctx, count_alloc, count_free, &c));
  EXPECT_EQ(c.allocs, 1);  // the context itself

  // A weight transport with both maps needs one temporary.
  bt::Rng g(51);
  auto tau = bt::randn(g, 6, 5).f32(), ro = bt::randn(g, 6, 4).f32(),
       ri = bt::randn(g, 5, 3).f32();
  std::vector<float> out(12);
  long a0 = c.allocs, f0 = c.frees;
  ASSERT_EQ(BICO_OK, bico_transport_weight(ctx, 6, 5, 4, 3, 1.0f,
                                           tau.data(), 5, ro.data(), 4, ri.data(), 3, 0.0f,
                                           out.data(), 3));
  EXPECT_EQ(c.allocs - a0, 1);
  EXPECT_EQ(c.frees - f0, 1);
  // One-sided transports need none.
  a0 = c.allocs;
  ASSERT_EQ(BICO_OK, bico_transport_weight(ctx, 6, 5, 4, 3, 1.0f,
                                           tau.data(), 5, nullptr, 4, ri.data(), 3, 0.0f,
                                           out.data(), 3));
  EXPECT_EQ(c.allocs, a0);

  // Handles allocate through their context too.
  bico_votes *v = nullptr;
  a0 = c.allocs;
  ASSERT_EQ(BICO_OK, bico_votes_create(ctx, 10, BICO_VOTES_MEAN, &v));
  EXPECT_GT(c.allocs, a0);
  bico_votes_free(v);
  EXPECT_EQ(c.allocs, c.frees + 1);  // only the context is left
  bico_ctx_free(ctx);
  EXPECT_EQ(c.allocs, c.frees);
}

// An allocator that refuses: creation fails, and so does a transport whose
// temporary cannot be had, with a message, leaving out untouched.
TEST(Ctx, AllocationFailureIsReported) {
  Counter c;
  c.limit = 0;
  bico_ctx *ctx = nullptr;
  ASSERT_EQ(BICO_E_NOMEM,
            bico_ctx_create_with_allocator(&ctx, count_alloc, count_free, &c));
  EXPECT_EQ(ctx, nullptr);
  c.limit = 1;
  ASSERT_EQ(BICO_OK,
            bico_ctx_create_with_allocator(&ctx, count_alloc, count_free, &c));
  float tau[4] = {1, 2, 3, 4}, r[4] = {1, 0, 0, 1}, out[4] = {7, 7, 7, 7};
  EXPECT_EQ(BICO_E_NOMEM, bico_transport_weight(ctx, 2, 2, 2, 2, 1.0f, tau, 2, r,
                                                2, r, 2, 0.0f, out, 2));
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("out of memory"),
            std::string::npos);
  for (float x : out) EXPECT_EQ(x, 7.0f);
  bico_votes *v = nullptr;
  EXPECT_EQ(BICO_E_NOMEM, bico_votes_create(ctx, 4, 0, &v));
  EXPECT_EQ(v, nullptr);
  // votes_create's second allocation fails: the first is given back.
  c.limit = 2;
  EXPECT_EQ(BICO_E_NOMEM, bico_votes_create(ctx, 4, 0, &v));
  EXPECT_EQ(c.allocs, c.frees + 1);
  bico_ctx_free(ctx);
  EXPECT_EQ(c.allocs, c.frees);
}

TEST(Ctx, ThreadsParameter) {
  bt::Ctx ctx;
  double lo = 0, hi = 0, v = 0;
  unsigned fl = 0;
  ASSERT_EQ(BICO_OK, bico_ctx_param_bounds(BICO_CTX_THREADS, &lo, &hi, &fl));
  EXPECT_EQ(lo, 1);
  EXPECT_EQ(hi, 1024);
  EXPECT_EQ(fl, unsigned(BICO_PARAM_INTEGER));
  EXPECT_EQ(BICO_E_NULL, bico_ctx_param_bounds(BICO_CTX_THREADS, nullptr, &hi, &fl));
  EXPECT_EQ(BICO_E_NULL, bico_ctx_param_bounds(BICO_CTX_THREADS, &lo, &hi, nullptr));
  EXPECT_EQ(BICO_E_ARG, bico_ctx_param_bounds(999, &lo, &hi, &fl));

  for (double t : {lo, 2.0, hi}) {
    ASSERT_EQ(BICO_OK, bico_ctx_set_param(ctx, BICO_CTX_THREADS, t));
    ASSERT_EQ(BICO_OK, bico_ctx_get_param(ctx, BICO_CTX_THREADS, &v));
    EXPECT_EQ(v, t);
  }
  ASSERT_EQ(BICO_OK, bico_ctx_set_param(ctx, BICO_CTX_THREADS, 3));
  for (long bad : {0L, 1025L, -5L}) {
    EXPECT_EQ(BICO_E_ARG, bico_ctx_set_param(ctx, BICO_CTX_THREADS, (double)bad));
    std::string msg = bico_ctx_errmsg(ctx);
    EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
    EXPECT_NE(msg.find("[1, 1024]"), std::string::npos) << msg;
  }
  // Not an integer, or not finite: refused by the same grammar.
  for (double bad : {2.5, (double)NAN, (double)INFINITY}) {
    EXPECT_EQ(BICO_E_ARG, bico_ctx_set_param(ctx, BICO_CTX_THREADS, bad));
    EXPECT_EQ(BICO_E_ARG, bico_ctx_errcode(ctx));
  }
  ASSERT_EQ(BICO_OK, bico_ctx_get_param(ctx, BICO_CTX_THREADS, &v));
  EXPECT_EQ(v, 3);  // a rejected value changes nothing
  EXPECT_EQ(BICO_E_ARG, bico_ctx_set_param(ctx, 42, 1));
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("unknown parameter 42"),
            std::string::npos);
  EXPECT_EQ(BICO_E_ARG, bico_ctx_get_param(ctx, 42, &v));
  EXPECT_EQ(BICO_E_NULL, bico_ctx_get_param(ctx, BICO_CTX_THREADS, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_ctx_set_param(nullptr, BICO_CTX_THREADS, 1));
}

// More threads must not change the answer beyond rounding.
TEST(Ctx, ThreadedTransportAgrees) {
  bt::Rng g(52);
  bt::Ctx one, two;
  ASSERT_EQ(BICO_OK, bico_ctx_set_param(two, BICO_CTX_THREADS, 2));
  const size_t m = 96, n = 80;
  auto tau = bt::randn(g, m, n).f32(), ro = bt::randn(g, m, m).f32(),
       ri = bt::randn(g, n, n).f32();
  std::vector<float> a(m * n), b(m * n);
  ASSERT_EQ(BICO_OK, bico_transport_weight(one, m, n, m, n, 1.0f,
                                           tau.data(), n, ro.data(), m, ri.data(), n, 0.0f,
                                           a.data(), n));
  ASSERT_EQ(BICO_OK, bico_transport_weight(two, m, n, m, n, 1.0f,
                                           tau.data(), n, ro.data(), m, ri.data(), n, 0.0f,
                                           b.data(), n));
  bt::Mat ma = bt::Mat::from(a.data(), m, n, n), mb = bt::Mat::from(b.data(), m, n, n);
  EXPECT_LT(bt::relerr(ma, mb), 1e-5);
}

TEST(Ctx, ErrmsgClearedBySuccessfulCall) {
  bt::Ctx ctx;
  EXPECT_EQ(BICO_E_ARG, bico_ctx_set_param(ctx, BICO_CTX_THREADS, 0));
  EXPECT_STRNE(bico_ctx_errmsg(ctx), "");
  ASSERT_EQ(BICO_OK, bico_ctx_set_param(ctx, BICO_CTX_THREADS, 1));
  EXPECT_STREQ(bico_ctx_errmsg(ctx), "");

  // Across functions: a failed transport, then a successful baseline.
  float tau[4] = {1, 2, 3, 4}, out[4];
  EXPECT_EQ(BICO_E_SHAPE, bico_transport_weight(ctx, 2, 2, 2, 2, 1.0f, tau,
                                                1, nullptr, 2, nullptr, 2, 0.0f,
                                                out, 2));
  EXPECT_STRNE(bico_ctx_errmsg(ctx), "");
  const size_t s[] = {4};
  ASSERT_EQ(BICO_OK,
            bico_baseline_naive(ctx, 1, s, 1, s, 1.0f, tau, 0.0f, out));
  EXPECT_STREQ(bico_ctx_errmsg(ctx), "");
  EXPECT_EQ(BICO_OK, bico_ctx_errcode(ctx));
}

TEST(Ctx, ErrcodeIsTheStatusOfTheLastFailure) {
  bt::Ctx ctx;
  EXPECT_EQ(BICO_OK, bico_ctx_errcode(ctx));  // fresh context: nothing failed
  EXPECT_EQ(BICO_E_NULL, bico_ctx_errcode(nullptr));
  bico_xcov *xc = nullptr;
  ASSERT_EQ(BICO_OK, bico_xcov_create(ctx, 2, 3, 0, &xc));
  float a[2] = {1, NAN}, b[3] = {1, 2, 3}, out[6];
  double sa[2], sb[3];
  // Each failing call, of several kinds and handles, leaves exactly its own
  // status and a non-empty message; a successful action then clears both.
  const bico_status want[4] = {BICO_E_NONFINITE, BICO_E_ARG, BICO_E_SHAPE,
                               BICO_E_STATE};
  for (int k = 0; k < 4; k++) {
    bico_status got = BICO_OK;
    switch (k) {
      case 0: got = bico_xcov_add(xc, 1, a, 2, b, 3); break;
      case 1: got = bico_ctx_set_param(ctx, BICO_CTX_THREADS, 5000); break;
      case 2:
        got = bico_transport_weight(ctx, 2, 2, 2, 2, 1.0f, a, 1, nullptr,
                                    2, nullptr, 2, 0.0f, out, 2);
        break;
      case 3: got = bico_xcov_sums(xc, sa, sb); break;
    }
    EXPECT_EQ(want[k], got);
    EXPECT_EQ(got, bico_ctx_errcode(ctx)) << k;
    EXPECT_STRNE(bico_ctx_errmsg(ctx), "") << k;
    ASSERT_EQ(BICO_OK, bico_ctx_set_param(ctx, BICO_CTX_THREADS, 1));
    EXPECT_EQ(BICO_OK, bico_ctx_errcode(ctx));
    EXPECT_STREQ(bico_ctx_errmsg(ctx), "");
  }
  bico_xcov_free(xc);
}

// After a failure, a caller inspects its handles to explain it: no query
// (a call on const handles) may wipe the failure's code or message.
TEST(Ctx, QueriesPreserveTheLastError) {
  bt::Ctx ctx;
  bico_xcov *xc = nullptr;
  bico_procrustes *p = nullptr;
  bico_votes *v = nullptr;
  bico_model *ma = nullptr, *mb = nullptr;
  ASSERT_EQ(BICO_OK, bico_xcov_create(ctx, 2, 2, BICO_XCOV_SUMS, &xc));
  ASSERT_EQ(BICO_OK, bico_procrustes_create(ctx, &p));
  ASSERT_EQ(BICO_OK, bico_votes_create(ctx, 2, 0, &v));
  ASSERT_EQ(BICO_OK, bico_model_create(ctx, &ma));
  ASSERT_EQ(BICO_OK, bico_model_create(ctx, &mb));
  const size_t w[2] = {4, 4};
  for (int b = 0; b < 3; b++) {
    std::string n = "blocks." + std::to_string(b) + ".fc.weight";
    ASSERT_EQ(BICO_OK, bico_model_add_tensor(ma, n.c_str(), 0, 2, w));
    ASSERT_EQ(BICO_OK, bico_model_add_tensor(mb, n.c_str(), 0, 2, w));
  }
  float x[4] = {1, 2, 3, 4}, bad[2] = {1, NAN}, tau[2] = {1, -1}, o[2];
  ASSERT_EQ(BICO_OK, bico_xcov_add(xc, 2, x, 2, x, 2));
  double c[4];
  size_t rank;
  float r[4];
  ASSERT_EQ(BICO_OK, bico_procrustes_solve(p, xc, r, 2, &rank));

  // The failure to preserve.
  ASSERT_EQ(BICO_E_NONFINITE, bico_xcov_add(xc, 1, bad, 2, x, 2));
  const std::string msg = bico_ctx_errmsg(ctx);
  ASSERT_NE(msg, "");
  auto same = [&](const char *what) {
    EXPECT_EQ(BICO_E_NONFINITE, bico_ctx_errcode(ctx)) << what;
    EXPECT_EQ(msg, bico_ctx_errmsg(ctx)) << what;
  };
  size_t da, db, n, i, cnt;
  uint64_t rows;
  unsigned fl;
  double d, lo, hi, l, llo, lhi;
  unsigned bf;
  const char *name;
  int kind, dt, role;
  long block;
  uint8_t mask[2];
  int32_t counts[2];
  char buf[64];
  std::vector<unsigned char> ser(4096);
  EXPECT_EQ(BICO_OK, bico_xcov_info(xc, &da, &db, &rows, &fl)); same("xcov_info");
  EXPECT_EQ(BICO_OK, bico_xcov_matrix(xc, BICO_XCOV_CROSS, 1, c, 2)); same("xcov_matrix");
  EXPECT_EQ(BICO_OK, bico_xcov_sums(xc, c, c + 2)); same("xcov_sums");
  EXPECT_EQ(BICO_OK, bico_xcov_serialized_size(xc, &n)); same("xcov_serialized_size");
  EXPECT_EQ(BICO_OK, bico_xcov_serialize(xc, ser.data(), ser.size(), &n)); same("xcov_serialize");
  EXPECT_EQ(BICO_OK, bico_procrustes_get_param(p, BICO_PROC_RANK_TOL, &d)); same("procrustes_get_param");
  EXPECT_EQ(BICO_OK, bico_procrustes_param_bounds(BICO_PROC_WHITEN, &lo, &hi, &bf)); same("procrustes_param_bounds");
  EXPECT_EQ(BICO_OK, bico_procrustes_spectrum(p, c, 2, &cnt)); same("procrustes_spectrum");
  EXPECT_EQ(BICO_OK, bico_votes_info(v, &n, &rows, &fl)); same("votes_info");
  EXPECT_EQ(BICO_OK, bico_votes_counts(v, counts)); same("votes_counts");
  EXPECT_EQ(BICO_OK, bico_gradfix_mask(v, BICO_GRADFIX_MAJORITY, tau, mask, &n)); same("gradfix_mask");
  EXPECT_EQ(BICO_OK, bico_gradfix_apply(v, BICO_GRADFIX_MAJORITY, 1.0f, tau, 0.0f, o, &n)); same("gradfix_apply");
  EXPECT_EQ(BICO_OK, bico_depthmap_source(3, 5, 4, &i)); same("depthmap_source");
  EXPECT_EQ(BICO_OK, bico_ctx_get_param(ctx, BICO_CTX_THREADS, &l)); same("ctx_get_param");
  EXPECT_EQ(BICO_OK, bico_ctx_param_bounds(BICO_CTX_THREADS, &llo, &lhi, &bf)); same("ctx_param_bounds");
  EXPECT_EQ(BICO_OK, bico_model_tensor_count(mb, &n)); EXPECT_EQ(3u, n); same("model_tensor_count");
  EXPECT_EQ(BICO_OK, bico_model_module_count(mb, &n)); EXPECT_EQ(3u, n); same("model_module_count");
  EXPECT_EQ(BICO_OK, bico_model_tensor(mb, 1, &name, &dt, &n, nullptr)); same("model_tensor");
  EXPECT_EQ(BICO_OK, bico_model_find_tensor(mb, "blocks.2.fc.weight", &i)); same("model_find_tensor");
  EXPECT_EQ(BICO_OK, bico_model_tensor_module(mb, 1, &i, &role)); same("model_tensor_module");
  EXPECT_EQ(BICO_OK, bico_model_module(mb, 1, &name, &kind, &block, &n)); same("model_module");
  EXPECT_EQ(BICO_OK, bico_model_module_tensor(mb, 1, 0, &i)); same("model_module_tensor");
  EXPECT_EQ(BICO_OK, bico_model_find_module(mb, "blocks.1.fc", &i)); same("model_find_module");
  EXPECT_EQ(BICO_OK, bico_model_module_dims(mb, 1, &da, &db)); same("model_module_dims");
  EXPECT_EQ(BICO_OK, bico_model_blocks(mb, &name, &n)); same("model_blocks");
  EXPECT_EQ(BICO_OK, bico_model_map_name(mb, ma, "blocks.2.fc", buf, sizeof buf, &n)); same("model_map_name");
  EXPECT_EQ(BICO_OK, bico_model_pair_module(mb, 2, ma, &i)); same("model_pair_module");
  EXPECT_EQ(BICO_OK, bico_model_pair_tensor(mb, 2, ma, &i)); same("model_pair_tensor");
  (void)bico_strerror(BICO_E_ARG); same("strerror");

  // A query that fails records its own failure ...
  EXPECT_EQ(BICO_E_ARG, bico_procrustes_get_param(p, 999, &d));
  EXPECT_EQ(BICO_E_ARG, bico_ctx_errcode(ctx));
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("999"), std::string::npos);
  // ... and an action that succeeds clears the record.
  ASSERT_EQ(BICO_OK, bico_xcov_add(xc, 1, x, 2, x, 2));
  EXPECT_EQ(BICO_OK, bico_ctx_errcode(ctx));
  EXPECT_STREQ(bico_ctx_errmsg(ctx), "");
  bico_model_free(mb);
  bico_model_free(ma);
  bico_votes_free(v);
  bico_procrustes_free(p);
  bico_xcov_free(xc);
}

}  // namespace

namespace {

typedef const char *(*NameFn)(int);
typedef bico_status (*FromNameFn)(const char *, int *);

struct EnumCase {
  const char *what;
  NameFn name;
  FromNameFn from;
  std::vector<int> members;  // every enumerator of the header
  bool flags;                // powers of two, else 1..N (status: 0..N)
};

// The enumerations of status.h, ctx.h, xcov.h, procrustes.h, gradfix.h,
// model.h, merge.h, transfer.h, lora.h and safetensors.h, listed here by their identifiers (an independent copy of the
// headers' lists): each value has a name, the name leads back to it, the
// names are distinct, and the values follow the rule of status.h.
TEST(Names, EveryEnumeratorRoundTripsAndFollowsTheRule) {
  const EnumCase cases[] = {
      {"status", bico_status_name, bico_status_from_name,
       {BICO_OK, BICO_E_NULL, BICO_E_ARG, BICO_E_SHAPE, BICO_E_NONFINITE,
        BICO_E_NOMEM, BICO_E_NUMERIC, BICO_E_FORMAT, BICO_E_IO,
        BICO_E_VERSION, BICO_E_NOTFOUND, BICO_E_UNSUPPORTED, BICO_E_STATE,
        BICO_E_INTERNAL},
       false},
      {"ctx_param", bico_ctx_param_name, bico_ctx_param_from_name,
       {BICO_CTX_THREADS}, false},
      {"xcov_flag", bico_xcov_flag_name, bico_xcov_flag_from_name,
       {BICO_XCOV_SUMS, BICO_XCOV_GRAMS}, true},
      {"merge_method", bico_merge_method_name, bico_merge_method_from_name,
       {BICO_MERGE_LINEAR, BICO_MERGE_TIES}, false},
      {"xcov_param", bico_xcov_param_name, bico_xcov_param_from_name,
       {BICO_XCOV_ADD_MODE}, false},
      {"xcov_add_mode", bico_xcov_add_mode_name, bico_xcov_add_mode_from_name,
       {BICO_XCOV_ADD_EXACT, BICO_XCOV_ADD_FAST}, false},
      {"xcov_which", bico_xcov_which_name, bico_xcov_which_from_name,
       {BICO_XCOV_CROSS, BICO_XCOV_GRAM_A, BICO_XCOV_GRAM_B}, false},
      {"procrustes_param", bico_procrustes_param_name,
       bico_procrustes_param_from_name,
       {BICO_PROC_CENTER, BICO_PROC_WHITEN, BICO_PROC_WHITEN_EPS,
        BICO_PROC_RANK_TOL, BICO_PROC_NULL, BICO_PROC_METHOD},
       false},
      {"procrustes_method", bico_procrustes_method_name,
       bico_procrustes_method_from_name,
       {BICO_PROC_SVD, BICO_PROC_EIG, BICO_PROC_POLAR}, false},
      {"procrustes_null", bico_procrustes_null_name,
       bico_procrustes_null_from_name, {BICO_NULL_KEEP, BICO_NULL_DROP},
       false},
      {"votes_flag", bico_votes_flag_name, bico_votes_flag_from_name,
       {BICO_VOTES_MEAN}, true},
      {"gradfix_mode", bico_gradfix_mode_name, bico_gradfix_mode_from_name,
       {BICO_GRADFIX_MAJORITY, BICO_GRADFIX_MEAN}, false},
      {"module_kind", bico_model_module_kind_name,
       bico_model_module_kind_from_name,
       {BICO_MODULE_LINEAR, BICO_MODULE_ELEMENTWISE, BICO_MODULE_EMBEDDING,
        BICO_MODULE_OTHER},
       false},
      {"tensor_role", bico_model_tensor_role_name,
       bico_model_tensor_role_from_name,
       {BICO_ROLE_WEIGHT, BICO_ROLE_BIAS, BICO_ROLE_VECTOR, BICO_ROLE_TOKEN,
        BICO_ROLE_OTHER},
       false},
      {"fit_flag", bico_fit_flag_name, bico_fit_flag_from_name,
       {BICO_FIT_BIAS}, true},
      {"fit_param", bico_fit_param_name, bico_fit_param_from_name,
       {BICO_FIT_RIDGE, BICO_FIT_RANK_TOL}, false},
      {"merge_param", bico_merge_param_name, bico_merge_param_from_name,
       {BICO_MERGE_METHOD, BICO_MERGE_ALPHA, BICO_MERGE_NORMALIZE,
        BICO_MERGE_MAX_SHARD_SIZE},
       false},
      {"merge_input", bico_merge_input_name, bico_merge_input_from_name,
       {BICO_MERGE_TASK_VECTOR, BICO_MERGE_TUNED, BICO_MERGE_LORA}, false},
      {"merge_file", bico_merge_file_name, bico_merge_file_from_name,
       {BICO_MERGE_FILE_BASE, BICO_MERGE_FILE_OUTPUT,
        BICO_MERGE_FILE_DELTA_OUTPUT, BICO_MERGE_FILE_REPORT},
       false},
      {"transfer_method", bico_transfer_method_name, bico_transfer_method_from_name,
       {BICO_METHOD_BICO, BICO_METHOD_BICO_IN, BICO_METHOD_BICO_OUT,
        BICO_METHOD_GRADFIX, BICO_METHOD_NAIVE, BICO_METHOD_PAD},
       false},
      {"transfer_norm_map", bico_transfer_norm_map_name, bico_transfer_norm_map_from_name,
       {BICO_NORM_MAP_ACT, BICO_NORM_MAP_GRAD}, false},
      {"transfer_structure", bico_transfer_structure_name, bico_transfer_structure_from_name,
       {BICO_STRUCTURE_HEADS, BICO_STRUCTURE_FREE}, false},
      {"transfer_rope", bico_transfer_rope_name, bico_transfer_rope_from_name,
       {BICO_ROPE_HALF, BICO_ROPE_INTERLEAVED, BICO_ROPE_NONE}, false},
      {"transfer_handling", bico_transfer_handling_name, bico_transfer_handling_from_name,
       {BICO_HANDLING_UNCHANGED, BICO_HANDLING_LINEAR, BICO_HANDLING_VECTOR,
        BICO_HANDLING_TIED, BICO_HANDLING_NAIVE, BICO_HANDLING_PADDED,
        BICO_HANDLING_MASKED},
       false},
      {"transfer_side", bico_transfer_side_name, bico_transfer_side_from_name,
       {BICO_SIDE_IN, BICO_SIDE_OUT}, false},
      {"transfer_file", bico_transfer_file_name, bico_transfer_file_from_name,
       {BICO_FILE_SOURCE_BASE, BICO_FILE_SOURCE_TUNED, BICO_FILE_TASK_VECTOR,
        BICO_FILE_TARGET_BASE, BICO_FILE_SOURCE_CALIB, BICO_FILE_TARGET_CALIB,
        BICO_FILE_STATS, BICO_FILE_TARGET_VOTES, BICO_FILE_OUTPUT,
        BICO_FILE_DELTA_OUTPUT, BICO_FILE_REPORT, BICO_FILE_LORA,
        BICO_FILE_LORA_OUTPUT, BICO_FILE_SOURCE_CONFIG,
        BICO_FILE_TARGET_CONFIG},
       false},
      {"transfer_check_level", bico_transfer_check_level_name,
       bico_transfer_check_level_from_name,
       {BICO_TRANSFER_CHECK_OPTIONS, BICO_TRANSFER_CHECK_INPUTS}, false},
      {"transfer_string", bico_transfer_string_name,
       bico_transfer_string_from_name,
       {BICO_TRANSFER_BLOCKS, BICO_TRANSFER_SOURCE_BLOCKS,
        BICO_TRANSFER_TARGET_BLOCKS, BICO_TRANSFER_SOURCE_RENAME},
       false},
      {"lora_kind", bico_lora_kind_name, bico_lora_kind_from_name,
       {BICO_LORA_LINEAR, BICO_LORA_EMBEDDING}, false},
      {"lora_param", bico_lora_param_name, bico_lora_param_from_name,
       {BICO_LORA_RSLORA, BICO_LORA_FAN_IN_FAN_OUT}, false},
      {"lora_string", bico_lora_string_name, bico_lora_string_from_name,
       {BICO_LORA_TASK_TYPE, BICO_LORA_BASE_MODEL}, false},
      {"dtype", bico_dtype_name, bico_dtype_from_name,
       {BICO_DTYPE_F32, BICO_DTYPE_F16, BICO_DTYPE_BF16, BICO_DTYPE_F64,
        BICO_DTYPE_I8, BICO_DTYPE_I16, BICO_DTYPE_I32, BICO_DTYPE_I64,
        BICO_DTYPE_U8, BICO_DTYPE_U16, BICO_DTYPE_U32, BICO_DTYPE_U64,
        BICO_DTYPE_BOOL},
       false},
  };
  for (const EnumCase &c : cases) {
    std::set<std::string> seen;
    std::set<int> values(c.members.begin(), c.members.end());
    // status codes and handlings start at 0 (BICO_OK, UNCHANGED)
    const bool status = std::string(c.what) == "status" ||
                        std::string(c.what) == "handling";
    for (size_t k = 0; k < c.members.size(); k++) {
      const int v = c.members[k];
      if (c.flags) {
        EXPECT_TRUE(v > 0 && (v & (v - 1)) == 0) << c.what << " " << v;
      } else {
        // Contiguous from 1 (status codes from 0, BICO_OK).
        EXPECT_EQ(v, (int)k + (status ? 0 : 1)) << c.what;
      }
      const char *n = c.name(v);
      ASSERT_NE(n, nullptr) << c.what << " " << v;
      EXPECT_TRUE(seen.insert(n).second) << c.what << " repeats " << n;
      int back = -12345;
      EXPECT_EQ(BICO_OK, c.from(n, &back)) << n;
      EXPECT_EQ(v, back) << n;
    }
    // Values that are not members have no name.
    for (int v : {-1, 0, 1000, 1 << 20}) {
      if (!values.count(v)) {
        EXPECT_EQ(c.name(v), nullptr) << c.what << " " << v;
      }
    }
    int out = 7;
    EXPECT_EQ(BICO_E_NULL, c.from(nullptr, &out)) << c.what;
    EXPECT_EQ(BICO_E_NULL, c.from(c.name(c.members[0]), nullptr)) << c.what;
    EXPECT_EQ(BICO_E_NOTFOUND, c.from("no-such-name", &out)) << c.what;
    EXPECT_EQ(BICO_E_NOTFOUND, c.from("", &out)) << c.what;
    EXPECT_EQ(out, 7) << c.what;  // untouched on failure
  }
}

// The spellings command lines, reports and bindings rely on.
TEST(Names, DocumentedSpellings) {
  EXPECT_STREQ(bico_status_name(BICO_E_SHAPE), "BICO_E_SHAPE");
  EXPECT_STREQ(bico_status_name(BICO_OK), "BICO_OK");
  EXPECT_STREQ(bico_procrustes_method_name(BICO_PROC_EIG), "eig");
  EXPECT_STREQ(bico_procrustes_method_name(BICO_PROC_SVD), "svd");
  EXPECT_STREQ(bico_procrustes_method_name(BICO_PROC_POLAR), "polar");
  EXPECT_STREQ(bico_procrustes_null_name(BICO_NULL_KEEP), "keep");
  EXPECT_STREQ(bico_procrustes_null_name(BICO_NULL_DROP), "drop");
  EXPECT_STREQ(bico_procrustes_param_name(BICO_PROC_RANK_TOL), "rank_tol");
  EXPECT_STREQ(bico_gradfix_mode_name(BICO_GRADFIX_MAJORITY), "majority");
  EXPECT_STREQ(bico_model_tensor_role_name(BICO_ROLE_TOKEN), "token");
  EXPECT_STREQ(bico_ctx_param_name(BICO_CTX_THREADS), "threads");
  // the report's and bico inspect's handling words, the CLI's words
  EXPECT_STREQ(bico_transfer_handling_name(BICO_HANDLING_UNCHANGED), "unchanged");
  EXPECT_STREQ(bico_transfer_handling_name(BICO_HANDLING_MASKED), "masked");
  EXPECT_STREQ(bico_transfer_method_name(BICO_METHOD_BICO_IN), "bico-in");
  EXPECT_STREQ(bico_transfer_rope_name(BICO_ROPE_INTERLEAVED), "interleaved");
  EXPECT_STREQ(bico_merge_param_name(BICO_MERGE_MAX_SHARD_SIZE),
               "max_shard_size");
  EXPECT_STREQ(bico_dtype_name(BICO_DTYPE_BF16), "BF16");
  int v = -1;
  // mergekit's alias, accepted but never given back as a name
  EXPECT_EQ(BICO_OK, bico_merge_method_from_name("task_arithmetic", &v));
  EXPECT_EQ(BICO_MERGE_LINEAR, v);
  // Exact spelling: no case folding, no identifier form for the words.
  EXPECT_EQ(BICO_E_NOTFOUND, bico_procrustes_method_from_name("EIG", &v));
  EXPECT_EQ(BICO_E_NOTFOUND, bico_procrustes_method_from_name("eig ", &v));
  EXPECT_EQ(BICO_E_NOTFOUND, bico_status_from_name("shape", &v));
  // No default alias has a name: 0 is not a member.
  EXPECT_EQ(bico_procrustes_method_name(0), nullptr);
  EXPECT_EQ(bico_gradfix_mode_name(0), nullptr);
}

// 0 asks for the default of a choice that has one; elsewhere it is refused.
TEST(Names, ZeroIsTheDefaultOnlyWhereOneExists) {
  bt::Ctx ctx;
  bico_votes *v = nullptr;
  ASSERT_EQ(BICO_OK, bico_votes_create(ctx, 3, 0, &v));
  const int32_t votes[3] = {2, -2, 0};
  ASSERT_EQ(BICO_OK, bico_votes_add_counts(v, votes, 2));
  const float tau[3] = {1, 1, 1};
  uint8_t m0[3], m1[3];
  size_t k0, k1;
  ASSERT_EQ(BICO_OK, bico_gradfix_mask(v, 0, tau, m0, &k0));
  ASSERT_EQ(BICO_OK, bico_gradfix_mask(v, BICO_GRADFIX_MAJORITY, tau, m1, &k1));
  EXPECT_EQ(0, std::memcmp(m0, m1, 3));
  EXPECT_EQ(k0, 1u);  // only the first vote agrees with tau's sign
  EXPECT_EQ(BICO_E_ARG, bico_gradfix_mask(v, 3, tau, m0, &k0));
  bico_votes_free(v);
  bico_xcov *xc = nullptr;
  ASSERT_EQ(BICO_OK, bico_xcov_create(ctx, 2, 2, 0, &xc));
  double c[4];
  EXPECT_EQ(BICO_E_ARG, bico_xcov_matrix(xc, 0, 0, c, 2));  // no default
  EXPECT_EQ(BICO_OK, bico_xcov_matrix(xc, BICO_XCOV_CROSS, 0, c, 2));
  bico_xcov_free(xc);
}

}  // namespace

// The same rule for the queries of the file, adapter, fit and transfer
// handles: success leaves the last failure as it was.
TEST(Ctx, FileAdapterFitAndTransferQueriesPreserveTheLastError) {
  bt::Ctx ctx;
  char tmpl[] = "/tmp/bico_ctxq_XXXXXX";
  std::string dir = mkdtemp(tmpl), path = dir + "/m.safetensors";
  {
    bico_stwriter *w = nullptr;
    const size_t shape[2] = {2, 2};
    const float v[4] = {1, 2, 3, 4};
    ASSERT_EQ(BICO_OK, bico_stwriter_create(ctx, path.c_str(), &w));
    ASSERT_EQ(BICO_OK, bico_stwriter_add_metadata(w, "k", "v"));
    ASSERT_EQ(BICO_OK, bico_stwriter_declare(w, "fc.weight", BICO_DTYPE_F32, 2, shape));
    ASSERT_EQ(BICO_OK, bico_stwriter_write_f32(w, "fc.weight", v, 4));
    ASSERT_EQ(BICO_OK, bico_stwriter_commit(w));
    bico_stwriter_free(w);
  }
  bico_stfile *f = nullptr;
  bico_lora *l = nullptr;
  bico_fit *fit = nullptr;
  bico_transfer *t = nullptr;
  bico_xcov *xc = nullptr;
  ASSERT_EQ(BICO_OK, bico_stfile_open(ctx, path.c_str(), &f));
  ASSERT_EQ(BICO_OK, bico_lora_create(ctx, &l));
  const float b[2] = {1, 2}, a[2] = {3, 4};
  ASSERT_EQ(BICO_OK, bico_lora_add_module(l, "fc", BICO_LORA_LINEAR, 1, 2, 2, 1.0, b, a));
  ASSERT_EQ(BICO_OK, bico_fit_create(ctx, 2, 2, 0, &fit));
  ASSERT_EQ(BICO_OK, bico_transfer_create(ctx, &t));
  ASSERT_EQ(BICO_OK, bico_xcov_create(ctx, 2, 2, 0, &xc));
  float x[4] = {1, 2, 3, 4}, bad[2] = {1, NAN};
  ASSERT_EQ(BICO_E_NONFINITE, bico_xcov_add(xc, 1, bad, 2, x, 2));
  const std::string msg = bico_ctx_errmsg(ctx);
  auto same = [&](const char *what) {
    EXPECT_EQ(BICO_E_NONFINITE, bico_ctx_errcode(ctx)) << what;
    EXPECT_EQ(msg, bico_ctx_errmsg(ctx)) << what;
  };
  size_t i, n, r, d1, d2;
  const char *s;
  const float *pb, *pa;
  double d, al, sc;
  uint64_t rows;
  unsigned fl;
  float out[4];
  EXPECT_EQ(BICO_OK, bico_stfile_find(f, "fc.weight", &i)); same("stfile_find");
  EXPECT_EQ(BICO_OK, bico_stfile_metadata_get(f, "k", &s)); same("stfile_metadata_get");
  EXPECT_EQ(BICO_OK, bico_stfile_read_f32(f, 0, out, 4)); same("stfile_read_f32");
  EXPECT_EQ(BICO_OK, bico_lora_get_param(l, BICO_LORA_RSLORA, &d)); same("lora_get_param");
  EXPECT_EQ(BICO_OK, bico_lora_get_string(l, BICO_LORA_TASK_TYPE, &s)); same("lora_get_string");
  EXPECT_EQ(BICO_OK, bico_lora_module(l, 0, &s, nullptr, &r, &d1, &d2, &al, &sc)); same("lora_module");
  EXPECT_EQ(BICO_OK, bico_lora_find_module(l, "fc", &i)); same("lora_find_module");
  EXPECT_EQ(BICO_OK, bico_lora_factors(l, 0, &pb, &pa)); same("lora_factors");
  EXPECT_EQ(BICO_OK, bico_fit_get_param(fit, BICO_FIT_RIDGE, &d)); same("fit_get_param");
  EXPECT_EQ(BICO_OK, bico_fit_info(fit, &d1, &d2, &rows, &fl)); same("fit_info");
  EXPECT_EQ(BICO_OK, bico_transfer_get_param(t, BICO_TRANSFER_ALPHA, &d)); same("transfer_get_param");
  EXPECT_EQ(BICO_E_STATE, bico_transfer_counts(t, &n, &n));  // no run yet: its own failure
  bico_xcov_free(xc);
  bico_transfer_free(t);
  bico_fit_free(fit);
  bico_lora_free(l);
  bico_stfile_free(f);
  std::remove(path.c_str());
  rmdir(dir.c_str());
}
