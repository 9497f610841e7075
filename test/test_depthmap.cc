// Depth map against round-half-up of j (l_a - 1) / (l_b - 1) computed here
// in 128-bit integers, plus its structural properties.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

namespace {

struct Map {
  size_t la, lb;
  Map(bico_ctx *, size_t la_, size_t lb_) : la(la_), lb(lb_) {}
  size_t at(size_t j) const {
    size_t i = SIZE_MAX;
    EXPECT_EQ(BICO_OK, bico_depthmap_source(la, lb, j, &i));
    return i;
  }
  std::vector<size_t> all(size_t lb) const {
    std::vector<size_t> v;
    for (size_t j = 0; j < lb; j++) v.push_back(at(j));
    return v;
  }
};

// floor(j p / q + 1/2), exact in 128 bits: j p < 2^128, and the remainder
// r < q < 2^64 so 2 r fits.
size_t expected(size_t la, size_t lb, size_t j) {
  if (la == 1 || lb == 1) return 0;
  unsigned __int128 p = la - 1, q = lb - 1, jp = (unsigned __int128)j * p;
  unsigned __int128 quot = jp / q, rem = jp % q;
  return (size_t)(quot + (2 * rem >= q ? 1 : 0));
}

TEST(Depthmap, FourToSix) {
  bt::Ctx ctx;
  Map m(ctx, 4, 6);
  EXPECT_EQ(m.all(6), (std::vector<size_t>{0, 1, 1, 2, 2, 3}));
}

TEST(Depthmap, HalvesRoundUp) {
  bt::Ctx ctx;
  // 2 -> 3: j = 1 gives exactly 1/2.
  EXPECT_EQ(Map(ctx, 2, 3).all(3), (std::vector<size_t>{0, 1, 1}));
  // 3 -> 5: j = 1 and 3 give 0.5 and 1.5.
  EXPECT_EQ(Map(ctx, 3, 5).all(5), (std::vector<size_t>{0, 1, 1, 2, 2}));
}

TEST(Depthmap, SingleBlockCases) {
  bt::Ctx ctx;
  for (size_t la : {1, 2, 12, 1000}) EXPECT_EQ(Map(ctx, la, 1).at(0), 0u);
  for (size_t lb : {1, 2, 7, 48})
    EXPECT_EQ(Map(ctx, 1, lb).all(lb), std::vector<size_t>(lb, 0));
}

TEST(Depthmap, EqualDepthIsIdentity) {
  bt::Ctx ctx;
  for (size_t l = 1; l <= 40; l++) {
    Map m(ctx, l, l);
    for (size_t j = 0; j < l; j++) ASSERT_EQ(m.at(j), j);
  }
}

TEST(Depthmap, EndpointsMonotoneAndNearest) {
  bt::Ctx ctx;
  for (size_t la = 1; la <= 40; la++)
    for (size_t lb = 1; lb <= 40; lb++) {
      Map m(ctx, la, lb);
      auto v = m.all(lb);
      ASSERT_EQ(v.front(), 0u);
      if (lb > 1) {
        ASSERT_EQ(v.back(), la - 1) << la << " -> " << lb;
      }
      for (size_t j = 0; j < lb; j++) {
        ASSERT_LT(v[j], la);
        if (j > 0) {
          ASSERT_LE(v[j - 1], v[j]) << la << " -> " << lb;
        }
        ASSERT_EQ(v[j], expected(la, lb, j)) << la << " -> " << lb << " j " << j;
      }
      // Growing the depth never skips a source block.
      if (lb >= la && lb > 1) {
        for (size_t j = 1; j < lb; j++) ASSERT_LE(v[j] - v[j - 1], 1u);
      }
    }
}

// Exact for counts where j (l_a - 1) overflows 64 bits.
TEST(Depthmap, HugeCountsStayExact) {
  bt::Ctx ctx;
  const size_t big[] = {SIZE_MAX, SIZE_MAX - 1, (size_t(1) << 63) + 12345,
                        (size_t(1) << 40) + 7, 3};
  for (size_t la : big)
    for (size_t lb : big) {
      Map m(ctx, la, lb);
      for (size_t j : {size_t(0), size_t(1), lb / 3, lb / 2, lb - 2, lb - 1})
        ASSERT_EQ(m.at(j), expected(la, lb, j))
            << la << " -> " << lb << " j " << j;
    }
}

TEST(DepthmapErrors, Arguments) {
  // A function of the two counts: the status says what is wrong and *i is
  // left alone.
  size_t i = 77;
  EXPECT_EQ(BICO_E_SHAPE, bico_depthmap_source(0, 3, 0, &i));
  EXPECT_EQ(BICO_E_SHAPE, bico_depthmap_source(3, 0, 0, &i));
  EXPECT_EQ(BICO_E_ARG, bico_depthmap_source(3, 4, 4, &i));
  EXPECT_EQ(BICO_E_ARG, bico_depthmap_source(3, 4, SIZE_MAX, &i));
  EXPECT_EQ(i, 77u);
  EXPECT_EQ(BICO_E_NULL, bico_depthmap_source(3, 4, 0, nullptr));
  EXPECT_EQ(BICO_OK, bico_depthmap_source(3, 4, 3, &i));
  EXPECT_EQ(i, 2u);
}

}  // namespace
