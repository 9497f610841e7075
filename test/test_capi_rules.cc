// What a C programmer met (issue 33), each rule docs/api.md now states,
// tested through the public API: lent statistics checked at
// bico_transfer_check(INPUTS); "0 takes the default" for every choice; a
// failed create writes NULL; merges across contexts; the staleness of
// bico_ctx_errcode; messages that start with their entry point and name
// file slots; and the bridge through the C API (made from lent
// statistics, read back, the handle's settings untouched, refusals;
// edited maps, ranks and descriptions refused by range and digest; the
// full fingerprint of the bases).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "st_testutil.h"
#include "testutil.h"
#include "transfer_testutil.h"

namespace {

bool has(const char *msg, const char *needle) {
  return std::strstr(msg, needle) != nullptr;
}

// A source of 2 blocks (width 4) and a target of 3 (width 6), each block
// a linear module "blocks.<i>.fc" with a bias, and a fine-tune of the
// source; random calibration-like rows for the lent statistics.
struct Pair {
  stt::TempDir dir;
  std::string A, Aft, B;
  size_t da, db;
  explicit Pair(size_t da_ = 4, size_t db_ = 6) : da(da_), db(db_) {
    bt::Rng g(5);
    A = dir / "A.safetensors";
    Aft = dir / "Aft.safetensors";
    B = dir / "B.safetensors";
    std::vector<ttu::Named> a, aft, b;
    for (int i = 0; i < 2; i++) {
      std::string m = "blocks." + std::to_string(i) + ".fc.";
      auto w = bt::randn(g, da, da).f32(), bias = bt::randn(g, 1, da).f32();
      a.push_back({m + "weight", {da, da}, w});
      a.push_back({m + "bias", {da}, bias});
      for (auto &x : w) x += 0.1f;
      for (auto &x : bias) x -= 0.1f;
      aft.push_back({m + "weight", {da, da}, w});
      aft.push_back({m + "bias", {da}, bias});
    }
    for (int i = 0; i < 3; i++) {
      std::string m = "blocks." + std::to_string(i) + ".fc.";
      b.push_back({m + "weight", {db, db}, bt::randn(g, db, db).f32()});
      b.push_back({m + "bias", {db}, bt::randn(g, 1, db).f32()});
    }
    ttu::write_f32(A, a);
    ttu::write_f32(Aft, aft);
    ttu::write_f32(B, b);
  }
};

// Accumulators of random rows (n of them) for every target module side.
struct Lent {
  std::vector<bico_xcov *> xs;
  ~Lent() {
    for (auto *x : xs) bico_xcov_free(x);
  }
  void all(bico_ctx *ctx, bico_transfer *t, const Pair &p, size_t rows) {
    bt::Rng g(9);
    for (int i = 0; i < 3; i++)
      for (int side : {BICO_SIDE_IN, BICO_SIDE_OUT}) {
        bico_xcov *x = nullptr;
        ASSERT_EQ(bico_xcov_create(ctx, p.da, p.db, 0, &x), BICO_OK);
        xs.push_back(x);
        auto ra = bt::randn(g, rows ? rows : 1, p.da).f32();
        auto rb = bt::randn(g, rows ? rows : 1, p.db).f32();
        ASSERT_EQ(bico_xcov_add(x, rows, ra.data(), p.da, rb.data(), p.db),
                  BICO_OK);
        std::string m = "blocks." + std::to_string(i) + ".fc";
        ASSERT_EQ(bico_transfer_set_xcov(t, m.c_str(), side, &x, 1), BICO_OK);
      }
  }
};

struct Transfer {
  bico_transfer *t = nullptr;
  explicit Transfer(bico_ctx *ctx) { bico_transfer_create(ctx, &t); }
  ~Transfer() { bico_transfer_free(t); }
  void files(const Pair &p, const std::string &out) {
    ASSERT_EQ(bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, p.A.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(t, BICO_FILE_SOURCE_TUNED, p.Aft.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, p.B.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(t, BICO_FILE_OUTPUT, out.c_str()), BICO_OK);
  }
};

TEST(CApiRules, LentStatisticsAreCheckedAtTheInputsLevel) {
  Pair p;
  bt::Ctx ctx;
  std::string out = p.dir / "out.safetensors";
  {  // zero rows: refused by check(INPUTS) naming the module and the side
    Transfer tr(ctx);
    tr.files(p, out);
    Lent lent;
    lent.all(ctx, tr.t, p, 0);
    EXPECT_EQ(bico_transfer_check(tr.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_OK);
    EXPECT_EQ(bico_transfer_check(tr.t, BICO_TRANSFER_CHECK_INPUTS), BICO_E_STATE);
    const char *m = bico_ctx_errmsg(ctx);
    EXPECT_TRUE(has(m, "transfer_check: statistics lent for module blocks.0.fc "
                       "(side in) hold no rows")) << m;
    EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_STATE);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "transfer_run:"));
  }
  {  // a name that is no module (a tensor's name, a typo): refused at check
    Transfer tr(ctx);
    tr.files(p, out);
    Lent lent;
    lent.all(ctx, tr.t, p, 5);
    bico_xcov *x = lent.xs[0];
    ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.1.fc.weight", BICO_SIDE_IN, &x, 1),
              BICO_OK);
    EXPECT_EQ(bico_transfer_check(tr.t, 0), BICO_E_NOTFOUND);  // 0: INPUTS
    const char *m = bico_ctx_errmsg(ctx);
    EXPECT_TRUE(has(m, "statistics lent for module blocks.1.fc.weight (side "
                       "in) name no module of the target base")) << m;
    EXPECT_TRUE(has(m, "lend its module's statistics as \"blocks.1.fc\"")) << m;
    ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.1.fc.weight", BICO_SIDE_IN, nullptr, 0),
              BICO_OK);
    ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.9.fc", BICO_SIDE_OUT, &x, 1), BICO_OK);
    EXPECT_EQ(bico_transfer_check(tr.t, BICO_TRANSFER_CHECK_INPUTS), BICO_E_NOTFOUND);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "blocks.9.fc (side out)")) << bico_ctx_errmsg(ctx);
    // withdrawn: the check and the run pass
    ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.9.fc", BICO_SIDE_OUT, nullptr, 0), BICO_OK);
    EXPECT_EQ(bico_transfer_check(tr.t, BICO_TRANSFER_CHECK_INPUTS), BICO_OK)
        << bico_ctx_errmsg(ctx);
    EXPECT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  }
}

TEST(CApiRules, ZeroTakesTheDefaultOfEveryChoice) {
  bt::Ctx ctx;
  bico_transfer *t = nullptr;
  bico_merge *m = nullptr;
  bico_procrustes *pr = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  ASSERT_EQ(bico_merge_create(ctx, &m), BICO_OK);
  ASSERT_EQ(bico_procrustes_create(ctx, &pr), BICO_OK);
  double v = -1, lo = -1, hi = -1;
  unsigned fl = 0;
  struct {
    int param, def;
  } tp[] = {{BICO_TRANSFER_METHOD, BICO_METHOD_BICO},
            {BICO_TRANSFER_PROC_METHOD, BICO_PROC_EIG},
            {BICO_TRANSFER_NORM_MAP, BICO_NORM_MAP_ACT},
            {BICO_TRANSFER_NULL, BICO_NULL_KEEP},
            {BICO_TRANSFER_GRADFIX_MODE, BICO_GRADFIX_MAJORITY},
            {BICO_TRANSFER_STRUCTURE, BICO_STRUCTURE_FREE}};
  for (auto &c : tp) {
    SCOPED_TRACE(bico_transfer_param_name(c.param));
    ASSERT_EQ(bico_transfer_param_bounds(c.param, &lo, &hi, &fl), BICO_OK);
    EXPECT_EQ(lo, 0.0);
    ASSERT_EQ(bico_transfer_set_param(t, c.param, 2), BICO_OK);  // another member
    ASSERT_EQ(bico_transfer_set_param(t, c.param, 0), BICO_OK);
    ASSERT_EQ(bico_transfer_get_param(t, c.param, &v), BICO_OK);
    EXPECT_EQ(v, c.def);
  }
  ASSERT_EQ(bico_merge_set_param(m, BICO_MERGE_METHOD, BICO_MERGE_TIES), BICO_OK);
  ASSERT_EQ(bico_merge_set_param(m, BICO_MERGE_METHOD, 0), BICO_OK);
  ASSERT_EQ(bico_merge_get_param(m, BICO_MERGE_METHOD, &v), BICO_OK);
  EXPECT_EQ(v, BICO_MERGE_LINEAR);
  ASSERT_EQ(bico_procrustes_set_param(pr, BICO_PROC_METHOD, 0), BICO_OK);
  ASSERT_EQ(bico_procrustes_get_param(pr, BICO_PROC_METHOD, &v), BICO_OK);
  EXPECT_EQ(v, BICO_PROC_EIG);
  // a choice without a default still refuses 0
  double c[4] = {1, 0, 0, 1}, out[4];
  bico_xcov *x = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, 2, 2, 0, &x), BICO_OK);
  ASSERT_EQ(bico_xcov_add_matrix(x, 1, c, 2), BICO_OK);
  EXPECT_EQ(bico_xcov_matrix(x, 0, 0, out, 2), BICO_E_ARG);
  bico_xcov_free(x);
  bico_procrustes_free(pr);
  bico_merge_free(m);
  bico_transfer_free(t);
}

TEST(CApiRules, AFailedCreateWritesNull) {
  bt::Ctx ctx;
  stt::TempDir dir;
  void *junk = &dir;  // what the caller's variable held before
#define EXPECT_NULLED(T, call)                          \
  do {                                                  \
    T *h = static_cast<T *>(junk);                      \
    EXPECT_NE(call, BICO_OK) << #call;                  \
    EXPECT_EQ(h, nullptr) << #call;                     \
  } while (0)
  EXPECT_NULLED(bico_ctx, bico_ctx_create_with_allocator(&h, nullptr, nullptr, nullptr));
  EXPECT_NULLED(bico_xcov, bico_xcov_create(nullptr, 2, 2, 0, &h));
  EXPECT_NULLED(bico_xcov, bico_xcov_create(ctx, 0, 2, 0, &h));
  EXPECT_NULLED(bico_xcov, bico_xcov_deserialize(nullptr, "x", 1, &h));
  EXPECT_NULLED(bico_procrustes, bico_procrustes_create(nullptr, &h));
  EXPECT_NULLED(bico_votes, bico_votes_create(nullptr, 3, 0, &h));
  EXPECT_NULLED(bico_votes, bico_votes_create(ctx, 0, 0, &h));
  EXPECT_NULLED(bico_fit, bico_fit_create(nullptr, 2, 2, 0, &h));
  EXPECT_NULLED(bico_fit, bico_fit_create(ctx, 0, 2, 0, &h));
  EXPECT_NULLED(bico_stfile, bico_stfile_open(nullptr, "x", &h));
  EXPECT_NULLED(bico_stfile, bico_stfile_open(ctx, (dir / "none").c_str(), &h));
  EXPECT_NULLED(bico_stwriter, bico_stwriter_create(nullptr, "x", &h));
  EXPECT_NULLED(bico_stwriter, bico_stwriter_create(ctx, dir.path.c_str(), &h));
  EXPECT_NULLED(bico_stwriter, bico_stwriter_create_folder(nullptr, "x", nullptr, 0, &h));
  EXPECT_NULLED(bico_model, bico_model_create(nullptr, &h));
  EXPECT_NULLED(bico_model, bico_model_from_stfile(ctx, nullptr, &h));
  EXPECT_NULLED(bico_lora, bico_lora_create(nullptr, &h));
  EXPECT_NULLED(bico_lora, bico_lora_open(ctx, (dir / "none").c_str(), &h));
  EXPECT_NULLED(bico_merge, bico_merge_create(nullptr, &h));
  EXPECT_NULLED(bico_transfer, bico_transfer_create(nullptr, &h));
  const char *none[1] = {"none"};
  EXPECT_NULLED(bico_stats_plan, bico_stats_plan_create(ctx, none, none, 1, nullptr, &h));
#undef EXPECT_NULLED
}

TEST(CApiRules, MergesJoinHandlesOfDifferentContextsAndReportOnDst) {
  bt::Ctx c1, c2;
  bt::Rng g(3);
  auto xa = bt::randn(g, 20, 3).f32(), xb = bt::randn(g, 20, 2).f32();
  bico_xcov *all = nullptr, *h1 = nullptr, *h2 = nullptr, *odd = nullptr;
  ASSERT_EQ(bico_xcov_create(c1, 3, 2, 0, &all), BICO_OK);
  ASSERT_EQ(bico_xcov_create(c1, 3, 2, 0, &h1), BICO_OK);
  ASSERT_EQ(bico_xcov_create(c2, 3, 2, 0, &h2), BICO_OK);
  ASSERT_EQ(bico_xcov_create(c2, 2, 2, 0, &odd), BICO_OK);
  ASSERT_EQ(bico_xcov_add(all, 20, xa.data(), 3, xb.data(), 2), BICO_OK);
  ASSERT_EQ(bico_xcov_add(h1, 10, xa.data(), 3, xb.data(), 2), BICO_OK);
  ASSERT_EQ(bico_xcov_add(h2, 10, xa.data() + 30, 3, xb.data() + 20, 2), BICO_OK);
  // c2 holds a failure of its own; the merge must not touch it
  EXPECT_EQ(bico_xcov_add(h2, 1, nullptr, 3, xb.data(), 2), BICO_E_NULL);
  ASSERT_EQ(bico_xcov_merge(h1, h2), BICO_OK);
  double m1[6], m2[6];
  ASSERT_EQ(bico_xcov_matrix(h1, BICO_XCOV_CROSS, 0, m1, 2), BICO_OK);
  ASSERT_EQ(bico_xcov_matrix(all, BICO_XCOV_CROSS, 0, m2, 2), BICO_OK);
  for (int i = 0; i < 6; i++) EXPECT_NEAR(m1[i], m2[i], 1e-12);
  EXPECT_EQ(bico_ctx_errcode(c2), BICO_E_NULL);  // src's context untouched
  EXPECT_EQ(bico_xcov_merge(h1, odd), BICO_E_SHAPE);  // dst's context records
  EXPECT_EQ(bico_ctx_errcode(c1), BICO_E_SHAPE);
  EXPECT_TRUE(has(bico_ctx_errmsg(c1), "xcov_merge"));
  EXPECT_EQ(bico_ctx_errcode(c2), BICO_E_NULL);
  // fits and votes likewise
  bico_fit *f1 = nullptr, *f2 = nullptr;
  bico_votes *v1 = nullptr, *v2 = nullptr;
  ASSERT_EQ(bico_fit_create(c1, 2, 3, 0, &f1), BICO_OK);
  ASSERT_EQ(bico_fit_create(c2, 2, 3, 0, &f2), BICO_OK);
  ASSERT_EQ(bico_fit_add(f2, 4, xa.data(), 3, xa.data(), 3, xb.data(), 2), BICO_OK);
  ASSERT_EQ(bico_fit_merge(f1, f2), BICO_OK);
  uint64_t rows = 0;
  ASSERT_EQ(bico_fit_info(f1, nullptr, nullptr, &rows, nullptr), BICO_OK);
  EXPECT_EQ(rows, 4u);
  ASSERT_EQ(bico_votes_create(c1, 3, 0, &v1), BICO_OK);
  ASSERT_EQ(bico_votes_create(c2, 3, 0, &v2), BICO_OK);
  ASSERT_EQ(bico_votes_add_grad(v2, xa.data()), BICO_OK);
  ASSERT_EQ(bico_votes_merge(v1, v2), BICO_OK);
  ASSERT_EQ(bico_votes_info(v1, nullptr, &rows, nullptr), BICO_OK);
  EXPECT_EQ(rows, 1u);
  for (auto *x : {all, h1, h2, odd}) bico_xcov_free(x);
  bico_fit_free(f1);
  bico_fit_free(f2);
  bico_votes_free(v1);
  bico_votes_free(v2);
}

TEST(CApiRules, ErrcodeKeepsTheLastFailureUntilACallThatActs) {
  bt::Ctx ctx;
  bico_xcov *x = nullptr;
  ASSERT_EQ(bico_xcov_create(ctx, 2, 2, 0, &x), BICO_OK);
  EXPECT_EQ(bico_xcov_set_param(x, 99, 1), BICO_E_ARG);
  size_t d = 0;
  EXPECT_EQ(bico_xcov_info(x, &d, nullptr, nullptr, nullptr), BICO_OK);  // a query
  EXPECT_EQ(bico_ctx_errcode(ctx), BICO_E_ARG);  // stale, by the rule
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "xcov_set_param"));
  EXPECT_EQ(bico_xcov_set_param(x, BICO_XCOV_ADD_MODE, 0), BICO_OK);  // acts
  EXPECT_EQ(bico_ctx_errcode(ctx), BICO_OK);
  EXPECT_STREQ(bico_ctx_errmsg(ctx), "");
  bico_xcov_free(x);
}

TEST(CApiRules, RunMessagesStartWithTheirEntryPointAndNameTheSlot) {
  Pair p;
  bt::Ctx ctx;
  Transfer tr(ctx);
  tr.files(p, p.dir / "out.safetensors");
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_SOURCE_TUNED,
                                   (p.dir / "missing.safetensors").c_str()),
            BICO_OK);
  Lent lent;
  lent.all(ctx, tr.t, p, 4);
  EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_IO);
  std::string want = "transfer_run: the source tuned file " +
                     (p.dir / "missing.safetensors") + ": cannot open";
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), want.c_str())) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_transfer_check(tr.t, BICO_TRANSFER_CHECK_INPUTS), BICO_E_IO);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "transfer_check: the source tuned file"));
  // the fit runner's size: one level of parentheses at most
  bico_fit_runner r{};
  r.size = 1;
  EXPECT_EQ(bico_fit_run(ctx, &r, 0.01), BICO_E_ARG);
  const char *m = bico_ctx_errmsg(ctx);
  int depth = 0, deepest = 0;
  for (const char *c = m; *c; c++) {
    depth += *c == '(' ? 1 : *c == ')' ? -1 : 0;
    deepest = depth > deepest ? depth : deepest;
  }
  EXPECT_LE(deepest, 1) << m;
  EXPECT_TRUE(has(m, "fit_run: ")) << m;
}

// ---- bridges through the C API ----

TEST(CApiBridge, MadeFromLentStatisticsAndReadBackBitForBit) {
  Pair p;
  bt::Ctx ctx;
  std::string br = p.dir / "A_to_B.bridge", direct = p.dir / "direct.safetensors",
              via = p.dir / "via.safetensors";
  Lent lent;
  {
    Transfer tr(ctx);
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_SOURCE_BASE, p.A.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_TARGET_BASE, p.B.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE_OUTPUT, br.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_NULL, BICO_NULL_DROP), BICO_OK);
    lent.all(ctx, tr.t, p, 3);  // rows < widths: rank-deficient maps
    EXPECT_EQ(bico_transfer_check(tr.t, BICO_TRANSFER_CHECK_INPUTS), BICO_OK)
        << bico_ctx_errmsg(ctx);
    EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_ARG);  // a run refuses a bridge output
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "transfer_run: the bridge output file"));
    ASSERT_EQ(bico_transfer_bridge(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
    // the same statistics, directly
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE_OUTPUT, nullptr), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_SOURCE_TUNED, p.Aft.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_OUTPUT, direct.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  }
  Transfer tr(ctx);
  tr.files(p, via);
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE, br.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(stt::read_bytes(via), stt::read_bytes(direct));
  EXPECT_NE(stt::read_bytes(via), stt::read_bytes(p.B));  // something was carried
  // the handle is as the caller set it: NULL stays the default it was
  double v = 0;
  ASSERT_EQ(bico_transfer_get_param(tr.t, BICO_TRANSFER_NULL, &v), BICO_OK);
  EXPECT_EQ(v, BICO_NULL_KEEP);
  // setting the bridge's value is accepted; another one is refused, naming it
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_NULL, BICO_NULL_DROP), BICO_OK);
  EXPECT_EQ(bico_transfer_check(tr.t, BICO_TRANSFER_CHECK_INPUTS), BICO_OK)
      << bico_ctx_errmsg(ctx);
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_NULL, BICO_NULL_KEEP), BICO_OK);
  std::remove(via.c_str());
  EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "was made with null 2; this transfer sets 1"))
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(access(via.c_str(), F_OK), -1);  // nothing written
  // 0 asks for the default: with a bridge, the bridge's
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_NULL, 0), BICO_OK);
  EXPECT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(stt::read_bytes(via), stt::read_bytes(direct));
  // lent statistics beside the bridge: refused at the options level
  bico_xcov *x = lent.xs[0];
  ASSERT_EQ(bico_transfer_set_xcov(tr.t, "blocks.0.fc", BICO_SIDE_IN, &x, 1), BICO_OK);
  EXPECT_EQ(bico_transfer_check(tr.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "the statistics held in memory"));
}

TEST(CApiBridge, OtherModelsAndBadFilesAreRefused) {
  Pair p;
  bt::Ctx ctx;
  std::string br = p.dir / "b.bridge", out = p.dir / "o.safetensors";
  Lent lent;
  {
    Transfer tr(ctx);
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_SOURCE_BASE, p.A.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_TARGET_BASE, p.B.c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE_OUTPUT, br.c_str()), BICO_OK);
    lent.all(ctx, tr.t, p, 8);
    // what a bridge does not take
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_SOURCE_TUNED, p.Aft.c_str()), BICO_OK);
    EXPECT_EQ(bico_transfer_bridge(tr.t), BICO_E_ARG);
    EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "transfer_bridge: the source tuned file does "
                                          "not apply to making a bridge"))
        << bico_ctx_errmsg(ctx);
    ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_SOURCE_TUNED, nullptr), BICO_OK);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_METHOD, BICO_METHOD_NAIVE), BICO_OK);
    EXPECT_EQ(bico_transfer_bridge(tr.t), BICO_E_ARG);
    EXPECT_EQ(access(br.c_str(), F_OK), -1);
    ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_METHOD, 0), BICO_OK);
    ASSERT_EQ(bico_transfer_bridge(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  }
  // another target of the same names and shapes: its fingerprint differs
  std::string B2 = p.dir / "B2.safetensors";
  {
    bt::Rng g(77);
    std::vector<ttu::Named> b;
    for (int i = 0; i < 3; i++) {
      std::string m = "blocks." + std::to_string(i) + ".fc.";
      b.push_back({m + "weight", {p.db, p.db}, bt::randn(g, p.db, p.db).f32()});
      b.push_back({m + "bias", {p.db}, bt::randn(g, 1, p.db).f32()});
    }
    ttu::write_f32(B2, b);
  }
  Transfer tr(ctx);
  tr.files(p, out);
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE, br.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_TARGET_BASE, B2.c_str()), BICO_OK);
  EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "the target base file")) << bico_ctx_errmsg(ctx);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "fingerprint")) << bico_ctx_errmsg(ctx);
  // a file that is no bridge
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_TARGET_BASE, p.B.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE, p.A.c_str()), BICO_OK);
  EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_FORMAT);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "not a bridge")) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(access(out.c_str(), F_OK), -1);
  // the bases default to the bridge's: a run without them
  Transfer t2(ctx);
  ASSERT_EQ(bico_transfer_set_file(t2.t, BICO_FILE_SOURCE_TUNED, p.Aft.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_file(t2.t, BICO_FILE_OUTPUT, out.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_file(t2.t, BICO_FILE_BRIDGE, br.c_str()), BICO_OK);
  EXPECT_EQ(bico_transfer_check(t2.t, BICO_TRANSFER_CHECK_OPTIONS), BICO_OK)
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_transfer_run(t2.t), BICO_OK) << bico_ctx_errmsg(ctx);
  const char *path = nullptr;
  ASSERT_EQ(bico_transfer_get_file(t2.t, BICO_FILE_SOURCE_BASE, &path), BICO_OK);
  EXPECT_EQ(path, nullptr);  // the handle's slot stays unset
}

// ---- bridges that are not as written (issue 45) ----

// A bridge of p's bases from lent statistics (rows rows per module side;
// rows >= the widths: maps of full rank), with the fingerprint kind fp.
void make_bridge(bico_ctx *ctx, const Pair &p, const std::string &br,
                 size_t rows, int fp = 0) {
  Lent lent;
  Transfer tr(ctx);
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_SOURCE_BASE, p.A.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_TARGET_BASE, p.B.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE_OUTPUT, br.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_FINGERPRINT, fp), BICO_OK);
  lent.all(ctx, tr.t, p, rows);
  ASSERT_EQ(bico_transfer_bridge(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
}

// What an edit does to a bridge: element `at` of tensor `tensor` set to
// `value` (no tensor: none), the description's first `from` replaced by
// `to` (empty: none), the digest dropped (a bridge made before bridges
// had one) or kept as it was.
struct Edit {
  std::string tensor;
  size_t at;
  double value;
  std::string from, to;
  bool drop_digest;
};

// A copy of bridge `src` at `dst` with edit e, rewritten with the
// library's writer: every tensor (name, dtype, shape, values) and every
// metadata entry as they are but for the edit.
void rewrite(const std::string &src, const std::string &dst, const Edit &e) {
  bt::Ctx ctx;
  bico_stfile *f = nullptr;
  ASSERT_EQ(bico_stfile_open(ctx, src.c_str(), &f), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, dst.c_str(), &w), BICO_OK);
  size_t nmeta = 0, n = 0;
  ASSERT_EQ(bico_stfile_metadata_count(f, &nmeta), BICO_OK);
  for (size_t i = 0; i < nmeta; i++) {
    const char *k, *v;
    ASSERT_EQ(bico_stfile_metadata_at(f, i, &k, &v), BICO_OK);
    std::string val = v;
    if (e.drop_digest && std::strcmp(k, "bico.bridge.sha256") == 0) continue;
    if (!e.from.empty() && std::strcmp(k, "bico.bridge.json") == 0) {
      size_t at = val.find(e.from);
      ASSERT_NE(at, std::string::npos) << e.from << " in " << val;
      val.replace(at, e.from.size(), e.to);
    }
    ASSERT_EQ(bico_stwriter_add_metadata(w, k, val.c_str()), BICO_OK);
  }
  ASSERT_EQ(bico_stfile_count(f, &n), BICO_OK);
  for (size_t i = 0; i < n; i++) {
    const char *name;
    int dt;
    size_t nd;
    const size_t *sh;
    ASSERT_EQ(bico_stfile_tensor_info(f, i, &name, &dt, &nd, &sh), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, name, dt, nd, sh), BICO_OK);
  }
  bool edited = e.tensor.empty();
  for (size_t i = 0; i < n; i++) {
    const char *name;
    int dt;
    size_t numel;
    ASSERT_EQ(bico_stfile_tensor_info(f, i, &name, &dt, nullptr, nullptr), BICO_OK);
    ASSERT_EQ(bico_stfile_tensor_size(f, i, &numel, nullptr), BICO_OK);
    bool here = e.tensor == name;
    edited = edited || here;
    if (dt == BICO_DTYPE_F64) {  // ranks: (rank, thin) per block
      std::vector<double> v(numel);
      ASSERT_EQ(bico_stfile_read_f64(f, i, v.data(), numel), BICO_OK);
      if (here) v.at(e.at) = e.value;
      ASSERT_EQ(bico_stwriter_write_f64(w, name, v.data(), numel), BICO_OK);
    } else {  // maps
      ASSERT_EQ(dt, BICO_DTYPE_F32);
      std::vector<float> v(numel);
      ASSERT_EQ(bico_stfile_read_f32(f, i, v.data(), numel), BICO_OK);
      if (here) v.at(e.at) = (float)e.value;
      ASSERT_EQ(bico_stwriter_write_f32(w, name, v.data(), numel), BICO_OK);
    }
  }
  ASSERT_TRUE(edited) << "no tensor " << e.tensor;
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
  bico_stfile_free(f);
}

// A run of p's fine-tune through bridge br into out: its status.
bico_status run_via(bico_ctx *ctx, const Pair &p, const std::string &br,
                    const std::string &out, const std::string &target = "") {
  Transfer tr(ctx);
  tr.files(p, out);
  if (!target.empty()) {
    EXPECT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_TARGET_BASE, target.c_str()),
              BICO_OK);
  }
  EXPECT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE, br.c_str()), BICO_OK);
  return bico_transfer_run(tr.t);
}

// Each edit an attack made (a map entry of 1e30 gave q_proj weights of
// 2e30, exit 0; a rank of 0 dropped a layer; a NaN or -1 rank was an
// undefined cast, which the sanitized build aborts on; a thin flag of 7;
// a NaN map entry): refused with BICO_E_FORMAT naming the bridge file and
// the tensor, nothing written -- by the range checks, which hold for a
// bridge without a digest too, or by the digest where the value is in
// range (rank 0).
TEST(CApiBridge, EditedMapsAndRanksAreRefused) {
  Pair p;
  bt::Ctx ctx;
  std::string br = p.dir / "A_to_B.bridge", out = p.dir / "out.safetensors",
              good = p.dir / "good.safetensors";
  make_bridge(ctx, p, br, 8);
  {  // the bridge records its digest: 64 hexadecimal digits
    bico_stfile *f = nullptr;
    ASSERT_EQ(bico_stfile_open(ctx, br.c_str(), &f), BICO_OK);
    const char *d = nullptr;
    ASSERT_EQ(bico_stfile_metadata_get(f, "bico.bridge.sha256", &d), BICO_OK);
    EXPECT_EQ(std::strlen(d), 64u);
    EXPECT_EQ(std::strspn(d, "0123456789abcdef"), 64u) << d;
    bico_stfile_free(f);
  }
  ASSERT_EQ(run_via(ctx, p, br, good), BICO_OK) << bico_ctx_errmsg(ctx);
  // rewritten as it was, digest and all: read, and the same output
  std::string same = p.dir / "same.bridge";
  rewrite(br, same, {"", 0, 0, "", "", false});
  ASSERT_EQ(run_via(ctx, p, same, out), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(stt::read_bytes(out), stt::read_bytes(good));
  std::remove(out.c_str());

  const double nan = std::numeric_limits<double>::quiet_NaN();
  struct Attack {
    const char *what;
    Edit edit;
    const char *said;  // in the message of a bridge with its digest
    const char *said_old;  // without it (nullptr: read, the edit in range)
  } attacks[] = {
      {"a map entry of 1e30", {"blocks.1.fc:in", 5, 1e30, "", "", false},
       "tensor blocks.1.fc:in: element [0, 5] is 1e+30",
       "tensor blocks.1.fc:in: element [0, 5] is 1e+30"},
      {"a NaN map entry", {"blocks.0.fc:out", 7, nan, "", "", false},
       "tensor blocks.0.fc:out: element [1, 1] is nan",
       "tensor blocks.0.fc:out: element [1, 1] is nan"},
      {"rank 0", {"blocks.2.fc:in:rank", 0, 0, "", "", false},
       "changed after it was written", nullptr},
      {"rank NaN", {"blocks.2.fc:in:rank", 0, nan, "", "", false},
       "tensor blocks.2.fc:in:rank: element [0, 0] is nan, not a rank",
       "tensor blocks.2.fc:in:rank: element [0, 0] is nan, not a rank"},
      {"rank -1", {"blocks.0.fc:out:rank", 0, -1, "", "", false},
       "tensor blocks.0.fc:out:rank: element [0, 0] is -1, not a rank",
       "tensor blocks.0.fc:out:rank: element [0, 0] is -1, not a rank"},
      {"rank above min(rows, columns)", {"blocks.0.fc:in:rank", 0, 5, "", "", false},
       "element [0, 0] is 5, not a rank (an integer in [0, 4] for a 4 x 6 map)",
       "element [0, 0] is 5, not a rank (an integer in [0, 4] for a 4 x 6 map)"},
      {"thin 7", {"blocks.1.fc:out:rank", 1, 7, "", "", false},
       "tensor blocks.1.fc:out:rank: element [0, 1] is 7, not a thin flag",
       "tensor blocks.1.fc:out:rank: element [0, 1] is 7, not a thin flag"},
      {"a map entry edited within range", {"blocks.1.fc:out", 3, 0.5, "", "", false},
       "changed after it was written", nullptr},
      {"the description edited", {"", 0, 0, "\"lent\":6", "\"lent\":5", false},
       "changed after it was written", nullptr},
      {"a recorded option outside its bounds",
       {"", 0, 0, "\"method\":1", "\"method\":99", false},
       "options: method 99 is outside that option's bounds",
       "options: method 99 is outside that option's bounds"},
  };
  for (const Attack &a : attacks) {
    for (bool old : {false, true}) {
      SCOPED_TRACE(std::string(a.what) + (old ? ", no digest" : ", digest kept"));
      std::string bad = p.dir / "bad.bridge";
      Edit e = a.edit;
      e.drop_digest = old;
      rewrite(br, bad, e);
      const char *said = old ? a.said_old : a.said;
      bico_status st = run_via(ctx, p, bad, out);
      if (said == nullptr) {  // in range, no digest: read as it says
        EXPECT_EQ(st, BICO_OK) << bico_ctx_errmsg(ctx);
        std::remove(out.c_str());
        continue;
      }
      EXPECT_EQ(st, BICO_E_FORMAT) << bico_ctx_errmsg(ctx);
      std::string m = bico_ctx_errmsg(ctx);
      EXPECT_TRUE(has(m.c_str(), ("the bridge file " + bad).c_str())) << m;
      EXPECT_TRUE(has(m.c_str(), said)) << m;
      EXPECT_EQ(access(out.c_str(), F_OK), -1);  // nothing written
      std::remove(out.c_str());
      // the check a front end makes first says the same
      Transfer tr(ctx);
      tr.files(p, out);
      ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE, bad.c_str()), BICO_OK);
      EXPECT_EQ(bico_transfer_check(tr.t, BICO_TRANSFER_CHECK_INPUTS), BICO_E_FORMAT);
      EXPECT_TRUE(has(bico_ctx_errmsg(ctx), said)) << bico_ctx_errmsg(ctx);
    }
  }
}

// The sampled fingerprint (the default) reads 192 bytes of a tensor: a
// target changed elsewhere passes it, as docs/formats.md says.  A bridge
// made with BICO_FINGERPRINT_FULL fingerprints every byte, records so,
// and a run recomputes the same kind: the same change is refused.
TEST(CApiBridge, FullFingerprintTellsAByteTheSamplesMiss) {
  Pair p(4, 16);  // target weights of 16 x 16 floats: 1024 bytes
  bt::Ctx ctx;
  // B2: B with bytes 200..203 of blocks.1.fc.weight changed (the samples
  // are bytes 0..63, 480..543 and 960..1023)
  std::string B2 = p.dir / "B2.safetensors";
  {
    bico_stfile *f = nullptr;
    ASSERT_EQ(bico_stfile_open(ctx, p.B.c_str(), &f), BICO_OK);
    size_t n = 0;
    ASSERT_EQ(bico_stfile_count(f, &n), BICO_OK);
    std::vector<ttu::Named> b;
    for (size_t i = 0; i < n; i++) {
      const char *name;
      size_t nd, numel;
      const size_t *sh;
      ASSERT_EQ(bico_stfile_tensor_info(f, i, &name, nullptr, &nd, &sh), BICO_OK);
      ASSERT_EQ(bico_stfile_tensor_size(f, i, &numel, nullptr), BICO_OK);
      ttu::Named t{name, std::vector<size_t>(sh, sh + nd), std::vector<float>(numel)};
      ASSERT_EQ(bico_stfile_read_f32(f, i, t.v.data(), numel), BICO_OK);
      if (t.name == "blocks.1.fc.weight") t.v.at(50) += 1.0f;
      b.push_back(t);
    }
    bico_stfile_free(f);
    ttu::write_f32(B2, b);
  }
  std::string sampled = p.dir / "sampled.bridge", full = p.dir / "full.bridge",
              out = p.dir / "out.safetensors", ref = p.dir / "ref.safetensors";
  make_bridge(ctx, p, sampled, 20);
  make_bridge(ctx, p, full, 20, BICO_FINGERPRINT_FULL);
  // the kind is recorded with the options
  {
    bico_stfile *f = nullptr;
    ASSERT_EQ(bico_stfile_open(ctx, full.c_str(), &f), BICO_OK);
    const char *d = nullptr;
    ASSERT_EQ(bico_stfile_metadata_get(f, "bico.bridge.json", &d), BICO_OK);
    EXPECT_TRUE(has(d, "\"fingerprint\":2")) << d;
    bico_stfile_free(f);
  }
  // the sampled fingerprint misses the change: the run reads the bridge
  ASSERT_EQ(run_via(ctx, p, sampled, ref), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(run_via(ctx, p, sampled, out, B2), BICO_OK) << bico_ctx_errmsg(ctx);
  std::remove(out.c_str());
  // the full one tells it
  EXPECT_EQ(run_via(ctx, p, full, out, B2), BICO_E_ARG);
  std::string m = bico_ctx_errmsg(ctx);
  EXPECT_TRUE(has(m.c_str(), "the target base file")) << m;
  EXPECT_TRUE(has(m.c_str(), "fingerprint")) << m;
  EXPECT_TRUE(has(m.c_str(), "every byte")) << m;
  EXPECT_EQ(access(out.c_str(), F_OK), -1);
  // ... and passes the unchanged bases, with the same maps' output
  ASSERT_EQ(run_via(ctx, p, full, out), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(stt::read_bytes(out), stt::read_bytes(ref));
  std::remove(out.c_str());
  // the kind is the bridge's: another one set is refused, naming both
  Transfer tr(ctx);
  tr.files(p, out);
  ASSERT_EQ(bico_transfer_set_file(tr.t, BICO_FILE_BRIDGE, full.c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_FINGERPRINT,
                                    BICO_FINGERPRINT_SAMPLED), BICO_OK);
  EXPECT_EQ(bico_transfer_run(tr.t), BICO_E_ARG);
  EXPECT_TRUE(has(bico_ctx_errmsg(ctx), "was made with fingerprint full; this "
                                        "transfer sets sampled"))
      << bico_ctx_errmsg(ctx);
  // 0 asks for the default, with a bridge the bridge's; get_param reports
  // what the handle set
  ASSERT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_FINGERPRINT, 0), BICO_OK);
  EXPECT_EQ(bico_transfer_run(tr.t), BICO_OK) << bico_ctx_errmsg(ctx);
  double v = 0;
  ASSERT_EQ(bico_transfer_get_param(tr.t, BICO_TRANSFER_FINGERPRINT, &v), BICO_OK);
  EXPECT_EQ(v, BICO_FINGERPRINT_SAMPLED);
  EXPECT_EQ(bico_transfer_set_param(tr.t, BICO_TRANSFER_FINGERPRINT, 3), BICO_E_ARG);
  EXPECT_STREQ(bico_transfer_param_name(BICO_TRANSFER_FINGERPRINT), "fingerprint");
  EXPECT_STREQ(bico_transfer_fingerprint_name(BICO_FINGERPRINT_FULL), "full");
}

}  // namespace
