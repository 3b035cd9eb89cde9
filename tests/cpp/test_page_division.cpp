// The sparse decode producer's page division by multiplication (src/core/page_division.h) against
// integer / and %, over every page block size up to 4096, random large sizes, and the tokens next to
// every multiple that matters (block boundaries, the top of the 31-bit range).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "core/page_division.h"

namespace {

using flashmla::core::page_div_magic;
using flashmla::core::split_page_token;

::testing::AssertionResult splits_exactly(uint32_t u, uint32_t d) {
  uint32_t block = 0;
  int32_t row = -1;
  split_page_token(u, d, page_div_magic(d), block, row);
  if (block == u / d && row == static_cast<int32_t>(u % d)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "u=" << u << " page_block_size=" << d << ": block " << block << " row " << row
                                       << ", expected " << u / d << " / " << u % d;
}

TEST(PageDivision, MagicIsCeilOfTwoToThe32OverSize) {
  EXPECT_EQ(page_div_magic(1), 0u);
  EXPECT_EQ(page_div_magic(2), 0x80000000u);
  EXPECT_EQ(page_div_magic(64), 0x04000000u);
  EXPECT_EQ(page_div_magic(3), 0x55555556u);
  EXPECT_EQ(page_div_magic(0x7fffffffu), 3u);
}

TEST(PageDivision, EverySizeUpTo4096) {
  std::mt19937 g(7);
  for (uint32_t d = 1; d <= 4096; ++d) {
    for (int k = 0; k < 300; ++k) ASSERT_TRUE(splits_exactly(g() & 0x7fffffffu, d));
    for (uint64_t q : {uint64_t{0}, uint64_t{1}, uint64_t{1000}, uint64_t{0x7fffffffu / d}})
      for (int e = -1; e <= 1; ++e) {
        const int64_t u = static_cast<int64_t>(q * d) + e;
        if (u >= 0 && u <= 0x7fffffff) {
          ASSERT_TRUE(splits_exactly(static_cast<uint32_t>(u), d));
        }
      }
  }
}

TEST(PageDivision, LargeSizesAndTheTopOfTheRange) {
  std::mt19937_64 g(11);
  for (int k = 0; k < 200000; ++k)
    ASSERT_TRUE(splits_exactly(static_cast<uint32_t>(g() & 0x7fffffffu), 1 + static_cast<uint32_t>(g() % 0x7ffffffeu)));
  for (uint32_t u = 0x7ffff000u; u <= 0x7fffffffu; ++u)
    for (uint32_t d : {3u, 53u, 61u, 64u, 69u, 576u, 1000003u, 0x40000000u, 0x7fffffffu}) {
      ASSERT_TRUE(splits_exactly(u, d));
    }
}

}  // namespace
