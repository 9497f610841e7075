// The experimental section (experimental.h): bico_procrustes_solve_blocks.
#define BICO_EXPERIMENTAL
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

namespace {

// A caller-side statistic served block by block, counting what was asked.
struct Served {
  const bt::Mat *c;
  size_t reads = 0, releases = 0, cells = 0;
  size_t fail_at = 0;  // > 0: the fail_at-th read fails with BICO_E_IO
};

bico_status read_block(void *o, size_t i0, size_t ni, size_t j0, size_t nj,
                       double *out, size_t ld) {
  Served *s = static_cast<Served *>(o);
  if (++s->reads == s->fail_at) return BICO_E_IO;
  if (i0 + ni > s->c->r || j0 + nj > s->c->c) return BICO_E_INTERNAL;
  for (size_t i = 0; i < ni; i++)
    for (size_t j = 0; j < nj; j++) out[i * ld + j] = (*s->c)(i0 + i, j0 + j);
  s->cells += ni * nj;
  return BICO_OK;
}

void release_block(void *o) { static_cast<Served *>(o)->releases++; }

// Served block by block, the solve is the held-matrix solve, bit for bit,
// for every method, square and rectangular both ways, full rank and not.
TEST(Experimental, SolveBlocksEqualsSolveMatrix) {
  bt::Ctx ctx;
  bt::Rng g(77);
  const size_t shapes[][2] = {{6, 6}, {4, 9}, {9, 4}, {300, 280}};
  for (auto &sh : shapes) {
    const size_t da = sh[0], db = sh[1];
    bt::Mat c = bt::randn(g, da, db);
    if (da == 6) {  // rank 3: the solve falls back to the SVD
      bt::Mat u = bt::randn(g, da, 3), v = bt::randn(g, 3, db);
      c = bt::matmul(u, v);
    }
    for (int method : {BICO_PROC_EIG, BICO_PROC_SVD, BICO_PROC_POLAR}) {
      bico_procrustes *p = nullptr;
      ASSERT_EQ(BICO_OK, bico_procrustes_create(ctx, &p));
      ASSERT_EQ(BICO_OK, bico_procrustes_set_param(p, BICO_PROC_METHOD, method));
      std::vector<float> r1(da * db), r2(da * db, -7.0f);
      size_t k1 = 0, k2 = 0;
      ASSERT_EQ(BICO_OK, bico_procrustes_solve_matrix(p, da, db, c.v.data(), db,
                                                      r1.data(), db, &k1));
      Served s{&c};
      ASSERT_EQ(BICO_OK, bico_procrustes_solve_blocks(p, da, db, read_block,
                                                      release_block, &s,
                                                      r2.data(), db, &k2))
          << bico_ctx_errmsg(ctx);
      EXPECT_EQ(k1, k2);
      EXPECT_EQ(0, std::memcmp(r1.data(), r2.data(), r1.size() * sizeof(float)))
          << da << "x" << db << " method " << method;
      EXPECT_GE(s.cells, da * db);  // every entry of C was read
      EXPECT_GE(s.releases, 1u);
      bico_procrustes_free(p);
    }
  }
}

TEST(Experimental, SolveBlocksErrors) {
  bt::Ctx ctx;
  bt::Rng g(78);
  bt::Mat c = bt::randn(g, 5, 7);
  bico_procrustes *p = nullptr;
  ASSERT_EQ(BICO_OK, bico_procrustes_create(ctx, &p));
  std::vector<float> r(5 * 7);
  Served s{&c};
  s.fail_at = 1;
  // The reader's failure comes back unchanged and is on record.
  EXPECT_EQ(BICO_E_IO, bico_procrustes_solve_blocks(p, 5, 7, read_block,
                                                    nullptr, &s, r.data(), 7,
                                                    nullptr));
  EXPECT_EQ(BICO_E_IO, bico_ctx_errcode(ctx));
  EXPECT_STRNE(bico_ctx_errmsg(ctx), "");
  EXPECT_EQ(BICO_E_NULL, bico_procrustes_solve_blocks(p, 5, 7, nullptr, nullptr,
                                                      &s, r.data(), 7, nullptr));
  EXPECT_EQ(BICO_E_NULL, bico_ctx_errcode(ctx));
  EXPECT_EQ(BICO_E_NULL, bico_procrustes_solve_blocks(nullptr, 5, 7, read_block,
                                                      nullptr, &s, r.data(), 7,
                                                      nullptr));
  EXPECT_EQ(BICO_E_SHAPE, bico_procrustes_solve_blocks(p, 0, 7, read_block,
                                                       nullptr, &s, r.data(), 7,
                                                       nullptr));
  ASSERT_EQ(BICO_OK, bico_procrustes_set_param(p, BICO_PROC_CENTER, 1));
  s.fail_at = 0;
  EXPECT_EQ(BICO_E_STATE, bico_procrustes_solve_blocks(p, 5, 7, read_block,
                                                       nullptr, &s, r.data(), 7,
                                                       nullptr));
  bico_procrustes_free(p);
}

}  // namespace
