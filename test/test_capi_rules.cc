// What a C programmer met (issue 33), each rule docs/api.md now states,
// tested through the public API: lent statistics checked at
// bico_transfer_check(INPUTS); "0 takes the default" for every choice; a
// failed create writes NULL; merges across contexts; the staleness of
// bico_ctx_errcode; messages that start with their entry point and name
// file slots; and the bridge through the C API (made from lent
// statistics, read back, the handle's settings untouched, refusals).
#include <gtest/gtest.h>

#include <cstring>
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
  size_t da = 4, db = 6;
  Pair() {
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

}  // namespace
