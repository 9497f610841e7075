// bico_transfer_set_partial: partial runs hand each selected tensor's
// update to a callback and write nothing.  The fixture is a planted chain
// (the target is the source with its hidden space rotated by Q), so the
// expected updates come from Q, not from the code under test: tau_B of the
// first layer is Q tau0 (bias Q taub0), of the second tau1 Q^T (bias taub1).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

#include "st_testutil.h"
#include "testutil.h"
#include "transfer_testutil.h"

namespace {

using bt::Mat;

// This suite's files: a matrix of one column is a bias vector.
void write(const std::string &path,
           const std::vector<std::pair<std::string, Mat>> &f) {
  ttu::write_mats(path, f, true);
}

struct Planted {
  std::string dir, A, B, tau, calA, calB, out, report;
  size_t d = 6, n = 64;
  std::map<std::string, Mat> want;  // expected alpha tau_B, alpha = 1
  Planted() {
    char tmpl[] = "/tmp/bico_partial_XXXXXX";
    dir = mkdtemp(tmpl);
    bt::Rng g(5);
    Mat W0 = bt::randn(g, d, d, 0.5), b0 = bt::randn(g, d, 1);
    Mat W1 = bt::randn(g, d, d, 0.5), b1 = bt::randn(g, d, 1);
    Mat Q = bt::rand_orth(g, d), Qt = bt::transpose(Q);
    Mat t0 = bt::randn(g, d, d, 0.1), tb0 = bt::randn(g, d, 1, 0.1);
    Mat t1 = bt::randn(g, d, d, 0.1), tb1 = bt::randn(g, d, 1, 0.1);
    Mat X = bt::randn(g, n, d), Z = bt::randn(g, n, d);
    Mat H = bt::matmul(X, bt::transpose(W0)), G0 = bt::matmul(Z, W1);
    A = dir + "/A.st"; B = dir + "/B.st"; tau = dir + "/tau.st";
    calA = dir + "/calA.st"; calB = dir + "/calB.st";
    out = dir + "/out.st"; report = dir + "/report.json";
    write(A, {{"blocks.0.fc.weight", W0}, {"blocks.0.fc.bias", b0},
              {"blocks.1.fc.weight", W1}, {"blocks.1.fc.bias", b1}});
    write(tau, {{"blocks.0.fc.weight", t0}, {"blocks.0.fc.bias", tb0},
                {"blocks.1.fc.weight", t1}, {"blocks.1.fc.bias", tb1}});
    write(B, {{"blocks.0.fc.weight", bt::matmul(Q, W0)},
              {"blocks.0.fc.bias", bt::matmul(Q, b0)},
              {"blocks.1.fc.weight", bt::matmul(W1, Qt)},
              {"blocks.1.fc.bias", b1}});
    write(calA, {{"blocks.0.fc.input", X}, {"blocks.0.fc.output_grad", G0},
                 {"blocks.1.fc.input", H}, {"blocks.1.fc.output_grad", Z}});
    write(calB, {{"blocks.0.fc.input", X},
                 {"blocks.0.fc.output_grad", bt::matmul(G0, Qt)},
                 {"blocks.1.fc.input", bt::matmul(H, Qt)},
                 {"blocks.1.fc.output_grad", Z}});
    want["blocks.0.fc.weight"] = bt::matmul(Q, t0);
    want["blocks.0.fc.bias"] = bt::matmul(Q, tb0);
    want["blocks.1.fc.weight"] = bt::matmul(t1, Qt);
    want["blocks.1.fc.bias"] = tb1;
  }
  ~Planted() {
    for (auto &p : {A, B, tau, calA, calB, out, report}) std::remove(p.c_str());
    rmdir(dir.c_str());
  }
  bico_transfer *make(bico_ctx *ctx) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, A.c_str());
    bico_transfer_set_file(t, BICO_FILE_TASK_VECTOR, tau.c_str());
    bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, B.c_str());
    bico_transfer_set_file(t, BICO_FILE_SOURCE_CALIB, calA.c_str());
    bico_transfer_set_file(t, BICO_FILE_TARGET_CALIB, calB.c_str());
    bico_transfer_set_file(t, BICO_FILE_OUTPUT, out.c_str());
    bico_transfer_set_file(t, BICO_FILE_REPORT, report.c_str());
    return t;
  }
};

struct Got {
  size_t tensor;
  std::string name, handling, entry;
  std::vector<float> update;
  bool null_update;
};

struct Sink {
  std::vector<Got> got;
  int fail_at = -1;  // refuse the call with this index
  static bico_status fn(void *o, const bico_transfer_tensor *x) {
    Sink *s = static_cast<Sink *>(o);
    EXPECT_GE(x->size, sizeof *x);
    if ((int)s->got.size() == s->fail_at) return BICO_E_IO;
    const char *h = bico_transfer_handling_name(x->handling);
    EXPECT_NE(h, nullptr);
    Got g{x->index, x->name, h ? h : "", x->report_entry,
          x->update ? std::vector<float>(x->update, x->update + x->count)
                    : std::vector<float>(),
          x->update == nullptr};
    s->got.push_back(g);
    return BICO_OK;
  }
};

bool exists(const std::string &p) { return access(p.c_str(), F_OK) == 0; }

TEST(TransferPartial, TwoHalvesGiveThePlantedUpdatesAndWriteNothing) {
  Planted p;
  bt::Ctx ctx;
  const char *names[4] = {"blocks.0.fc.weight", "blocks.0.fc.bias",
                          "blocks.1.fc.weight", "blocks.1.fc.bias"};
  std::map<std::string, int> seen;
  for (int half = 0; half < 2; half++) {
    bico_transfer *t = p.make(ctx);
    // Splits each module's weight from its bias: maps are computed by
    // whichever run needs them.
    unsigned char sel[4] = {(unsigned char)(half == 0), (unsigned char)(half == 1),
                            (unsigned char)(half == 1), (unsigned char)(half == 0)};
    Sink s;
    ASSERT_EQ(bico_transfer_set_partial(t, sel, 4, Sink::fn, &s), BICO_OK);
    ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
    ASSERT_EQ(s.got.size(), 2u);
    EXPECT_LT(s.got[0].tensor, s.got[1].tensor);  // the target's order
    for (auto &g : s.got) {
      ASSERT_LT(g.tensor, 4u);
      EXPECT_TRUE(sel[g.tensor]);
      EXPECT_EQ(g.name, names[g.tensor]);
      EXPECT_EQ(g.handling, g.tensor % 2 ? "vector" : "linear");
      ASSERT_FALSE(g.null_update);
      const Mat &w = p.want[g.name];
      ASSERT_EQ(g.update.size(), w.r * w.c);
      EXPECT_LT(bt::relerr(Mat::from(g.update.data(), w.r, w.c, w.c), w), 1e-4) << g.name;
      EXPECT_EQ(g.entry.front(), '{');
      EXPECT_EQ(g.entry.back(), '}');
      EXPECT_NE(g.entry.find("\"name\": \"" + g.name + "\""), std::string::npos) << g.entry;
      EXPECT_EQ(g.entry.find('\n'), std::string::npos);
      seen[g.name]++;
    }
    size_t updated = 0, unchanged = 9;
    ASSERT_EQ(bico_transfer_counts(t, &updated, &unchanged), BICO_OK);
    EXPECT_EQ(updated, 2u);
    EXPECT_EQ(unchanged, 0u);
    bico_transfer_free(t);
    EXPECT_FALSE(exists(p.out));
    EXPECT_FALSE(exists(p.report));
  }
  for (auto n : names) EXPECT_EQ(seen[n], 1) << n;
}

TEST(TransferPartial, NothingSelectedComputesNothing) {
  Planted p;
  bt::Ctx ctx;
  bico_transfer *t = p.make(ctx);
  unsigned char sel[4] = {0, 0, 0, 0};
  Sink s;
  ASSERT_EQ(bico_transfer_set_partial(t, sel, 4, Sink::fn, &s), BICO_OK);
  ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_TRUE(s.got.empty());
  EXPECT_FALSE(exists(p.out));
  // NULL restores the whole run, which writes the output.
  ASSERT_EQ(bico_transfer_set_partial(t, nullptr, 0, nullptr, nullptr), BICO_OK);
  ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_TRUE(exists(p.out));
  EXPECT_TRUE(s.got.empty());
  bico_transfer_free(t);
}

TEST(TransferPartial, BadArgumentsAreRefusedWithAMessage) {
  Planted p;
  bt::Ctx ctx;
  unsigned char sel[4] = {1, 1, 1, 1};
  Sink s;
  EXPECT_EQ(bico_transfer_set_partial(nullptr, sel, 4, Sink::fn, &s), BICO_E_NULL);
  bico_transfer *t = p.make(ctx);
  EXPECT_EQ(bico_transfer_set_partial(t, sel, 4, nullptr, &s), BICO_E_NULL);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("sink"), std::string::npos);
  EXPECT_EQ(bico_transfer_set_partial(t, sel, 0, Sink::fn, &s), BICO_E_SHAPE);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("n is 0"), std::string::npos);
  // A selection of the wrong length is found at the run.
  ASSERT_EQ(bico_transfer_set_partial(t, sel, 3, Sink::fn, &s), BICO_OK);
  EXPECT_EQ(bico_transfer_run(t), BICO_E_SHAPE);
  std::string m = bico_ctx_errmsg(ctx);
  EXPECT_NE(m.find("covers 3 tensors"), std::string::npos) << m;
  EXPECT_NE(m.find("has 4"), std::string::npos) << m;
  EXPECT_TRUE(s.got.empty());
  bico_transfer_free(t);
}

TEST(TransferPartial, ARefusingSinkStopsTheRun) {
  Planted p;
  bt::Ctx ctx;
  bico_transfer *t = p.make(ctx);
  unsigned char sel[4] = {1, 1, 1, 1};
  Sink s;
  s.fail_at = 1;
  ASSERT_EQ(bico_transfer_set_partial(t, sel, 4, Sink::fn, &s), BICO_OK);
  EXPECT_EQ(bico_transfer_run(t), BICO_E_IO);
  EXPECT_EQ(s.got.size(), 1u);  // nothing after the refusal
  std::string m = bico_ctx_errmsg(ctx);
  EXPECT_NE(m.find("blocks.0.fc.bias"), std::string::npos) << m;
  EXPECT_FALSE(exists(p.out));
  bico_transfer_free(t);
}

using bt::Failing;
using bt::fail_free;
const bico_alloc_fn fail_alloc = bt::fail_once_alloc;

TEST(TransferPartial, EveryAllocationFailureIsReportedAndCleanedUp) {
  Planted p;
  bool done = false;
  long k;
  for (k = 1; k < 100000 && !done; k++) {
    Failing f;
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, fail_alloc, fail_free, &f), BICO_OK);
    f.fail_at = f.count + k;
    bico_transfer *t = nullptr;
    bico_status st = bico_transfer_create(ctx, &t);
    const std::pair<int, std::string> files[] = {
        {BICO_FILE_SOURCE_BASE, p.A},     {BICO_FILE_TASK_VECTOR, p.tau},
        {BICO_FILE_TARGET_BASE, p.B},     {BICO_FILE_SOURCE_CALIB, p.calA},
        {BICO_FILE_TARGET_CALIB, p.calB}, {BICO_FILE_OUTPUT, p.out}};
    for (auto &fl : files)
      if (st == BICO_OK) st = bico_transfer_set_file(t, fl.first, fl.second.c_str());
    unsigned char sel[4] = {0, 1, 1, 0};
    Sink s;
    if (st == BICO_OK) st = bico_transfer_set_partial(t, sel, 4, Sink::fn, &s);
    if (st == BICO_OK) st = bico_transfer_run(t);
    if (st == BICO_OK) {
      done = true;
      EXPECT_EQ(s.got.size(), 2u);
    } else {
      EXPECT_EQ(st, BICO_E_NOMEM) << "allocation " << k << ": " << bico_ctx_errmsg(ctx);
    }
    EXPECT_FALSE(exists(p.out)) << "allocation " << k;
    bico_transfer_free(t);
    EXPECT_EQ(f.live, 1) << "leak after failing allocation " << k;
    bico_ctx_free(ctx);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_TRUE(done);
  EXPECT_GT(k, 20);
}

}  // namespace

// ---------------------------------------------------------------------------
// The plan and the assembler (what bico-mpi builds on).

// A sink that forwards straight into an assembler on another handle.
struct Forward {
  bico_transfer *to;
  static bico_status fn(void *o, const bico_transfer_tensor *x) {
    return bico_transfer_assemble_put(static_cast<Forward *>(o)->to, x->index,
                                      x->handling, x->update, x->count,
                                      x->report_entry);
  }
};

TEST(TransferPlan, GroupsCoverEveryTensorOnceAndKeepModulesTogether) {
  Planted p;
  bt::Ctx ctx;
  bico_transfer *t = p.make(ctx);
  size_t nt = 9, ng = 9;
  EXPECT_EQ(bico_transfer_plan_size(t, &nt, &ng), BICO_E_STATE);
  ASSERT_EQ(bico_transfer_plan(t), BICO_OK) << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bico_transfer_plan_size(t, &nt, &ng), BICO_OK);
  EXPECT_EQ(nt, 4u);
  EXPECT_EQ(ng, 2u);  // blocks.0.fc and blocks.1.fc, weight with bias
  std::vector<int> group_of(nt, -1);
  for (size_t g = 0; g < ng; g++) {
    double cost = 0;
    size_t n = 0;
    const size_t *ts = nullptr;
    ASSERT_EQ(bico_transfer_plan_group(t, g, &cost, &n, &ts), BICO_OK);
    // At least the two d x d map solves of the module (d^3 each).
    EXPECT_GE(cost, 2.0 * p.d * p.d * p.d);
    for (size_t k = 0; k < n; k++) {
      ASSERT_LT(ts[k], nt);
      EXPECT_EQ(group_of[ts[k]], -1);
      group_of[ts[k]] = (int)g;
      if (k) {
        EXPECT_LT(ts[k - 1], ts[k]);
      }
    }
  }
  for (size_t i = 0; i < nt; i++) EXPECT_NE(group_of[i], -1) << i;
  EXPECT_EQ(group_of[0], group_of[1]);  // blocks.0.fc.weight, .bias
  EXPECT_EQ(group_of[2], group_of[3]);
  EXPECT_NE(group_of[0], group_of[2]);
  EXPECT_EQ(bico_transfer_plan_group(t, ng, nullptr, nullptr, nullptr), BICO_E_ARG);
  bico_transfer_free(t);
}

// Two partial runs (one per group) assembled on a third handle give the
// whole run's output and report byte for byte.
TEST(TransferPlan, AssembledHalvesEqualTheWholeRun) {
  Planted p;
  bt::Ctx ctx;
  bico_transfer *whole = p.make(ctx);
  ASSERT_EQ(bico_transfer_run(whole), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_transfer_free(whole);
  std::string want_out = stt::read_bytes(p.out), want_rep = stt::read_bytes(p.report);
  std::remove(p.out.c_str());
  std::remove(p.report.c_str());

  bico_transfer *as = p.make(ctx);
  EXPECT_EQ(bico_transfer_assemble_begin(as), BICO_E_STATE);  // no plan yet
  ASSERT_EQ(bico_transfer_plan(as), BICO_OK);
  ASSERT_EQ(bico_transfer_assemble_begin(as), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_transfer_assemble_commit(as), BICO_E_STATE);  // nothing put
  Forward fw{as};
  for (size_t g = 0; g < 2; g++) {
    size_t n;
    const size_t *ts;
    ASSERT_EQ(bico_transfer_plan_group(as, 1 - g, nullptr, &n, &ts), BICO_OK);
    unsigned char sel[4] = {0, 0, 0, 0};
    for (size_t k = 0; k < n; k++) sel[ts[k]] = 1;
    bt::Ctx c2;
    bico_transfer *part = p.make(c2);
    ASSERT_EQ(bico_transfer_set_partial(part, sel, 4, Forward::fn, &fw), BICO_OK);
    ASSERT_EQ(bico_transfer_run(part), BICO_OK) << bico_ctx_errmsg(c2) << bico_ctx_errmsg(ctx);
    bico_transfer_free(part);
  }
  EXPECT_FALSE(exists(p.out));  // nothing before the commit
  ASSERT_EQ(bico_transfer_assemble_commit(as), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(stt::read_bytes(p.out), want_out);
  EXPECT_EQ(stt::read_bytes(p.report), want_rep);
  size_t updated = 0;
  ASSERT_EQ(bico_transfer_counts(as, &updated, nullptr), BICO_OK);
  EXPECT_EQ(updated, 4u);
  bico_transfer_free(as);
}

TEST(TransferPlan, BadPutsAreRefusedAndAnAbandonedAssemblyLeavesNothing) {
  Planted p;
  bt::Ctx ctx;
  bico_transfer *t = p.make(ctx);
  std::vector<float> upd(p.d * p.d, 0.5f);
  EXPECT_EQ(bico_transfer_assemble_put(t, 0, BICO_HANDLING_LINEAR, upd.data(),
                                       upd.size(), "{}"),
            BICO_E_STATE);
  ASSERT_EQ(bico_transfer_plan(t), BICO_OK);
  ASSERT_EQ(bico_transfer_assemble_begin(t), BICO_OK);
  const char *e = "{\"name\": \"x\"}";
  EXPECT_EQ(bico_transfer_assemble_put(t, 4, BICO_HANDLING_LINEAR, upd.data(), upd.size(), e),
            BICO_E_ARG);  // out of range
  for (int bad : {0, BICO_HANDLING_MASKED + 1})  // not a handling
    EXPECT_EQ(bico_transfer_assemble_put(t, 0, bad, upd.data(), upd.size(), e), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_assemble_put(t, 0, BICO_HANDLING_UNCHANGED, upd.data(), upd.size(), e),
            BICO_E_ARG);  // unchanged with an update
  EXPECT_EQ(bico_transfer_assemble_put(t, 0, BICO_HANDLING_LINEAR, upd.data(), 5, e),
            BICO_E_SHAPE);
  EXPECT_EQ(bico_transfer_assemble_put(t, 0, BICO_HANDLING_LINEAR, upd.data(), upd.size(),
                                       nullptr),
            BICO_E_NULL);
  upd[3] = INFINITY;
  EXPECT_EQ(bico_transfer_assemble_put(t, 0, BICO_HANDLING_LINEAR, upd.data(), upd.size(), e),
            BICO_E_NONFINITE);
  upd[3] = 0.5f;
  ASSERT_EQ(bico_transfer_assemble_put(t, 0, BICO_HANDLING_LINEAR, upd.data(), upd.size(), e),
            BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_transfer_assemble_put(t, 0, BICO_HANDLING_LINEAR, upd.data(), upd.size(), e),
            BICO_E_ARG);  // twice
  EXPECT_EQ(bico_transfer_assemble_commit(t), BICO_E_STATE);  // 1 of 4
  bico_transfer_free(t);
  EXPECT_FALSE(exists(p.out));
  EXPECT_FALSE(exists(p.report));
  // Nothing else in the folder: the temporaries went with the handle.
  std::vector<std::string> left;
  for (auto &f : std::filesystem::directory_iterator(p.dir))
    left.push_back(f.path().filename().string());
  std::sort(left.begin(), left.end());
  std::vector<std::string> want = {"A.st", "B.st", "calA.st", "calB.st", "tau.st"};
  EXPECT_EQ(left, want);
}

TEST(TransferPlan, HandlingNamesAndFileGetter) {
  EXPECT_STREQ(bico_transfer_handling_name(BICO_HANDLING_UNCHANGED), "unchanged");
  EXPECT_STREQ(bico_transfer_handling_name(BICO_HANDLING_MASKED), "masked");
  EXPECT_EQ(bico_transfer_handling_name(BICO_HANDLING_MASKED + 1), nullptr);
  EXPECT_EQ(bico_transfer_handling_name(0), nullptr);  // choices count from 1
  EXPECT_EQ(bico_transfer_handling_name(-1), nullptr);
  Planted p;
  bt::Ctx ctx;
  bico_transfer *t = p.make(ctx);
  const char *path = nullptr;
  ASSERT_EQ(bico_transfer_get_file(t, BICO_FILE_OUTPUT, &path), BICO_OK);
  EXPECT_EQ(std::string(path), p.out);
  ASSERT_EQ(bico_transfer_get_file(t, BICO_FILE_DELTA_OUTPUT, &path), BICO_OK);
  EXPECT_EQ(path, nullptr);
  EXPECT_EQ(bico_transfer_get_file(t, 0, &path), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_get_file(t, BICO_FILE_BRIDGE_OUTPUT + 1, &path), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_get_file(t, 1, nullptr), BICO_E_NULL);
  bico_transfer_free(t);
}
