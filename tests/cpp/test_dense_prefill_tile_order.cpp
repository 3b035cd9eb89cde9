// The dense prefill kernels' tile-order rules (src/sm90/prefill/dense/dense_prefill.h) on the grids of the
// benchmark shapes (bench/bench_dense_prefill.py: b 2, s 4096 / 8192, h 128/128 and 32/4) on a 132-SM H100 / H200.
// The rules are host code; what they pick was measured (docs/dense-prefill.md, "The tiles' order", Result): the
// backward's by-block order gains x1.04-1.36 on the GQA causal grids and loses x0.79-0.84 on the h 128 grids, the
// forward's by-block order gains nothing outside the noise.
#include <gtest/gtest.h>

#include <cstdint>

#include "sm90/prefill/dense/dense_prefill.h"

namespace {

using flashmla::sm90::dense_prefill::bwd_tile_order;
using flashmla::sm90::dense_prefill::fwd_tile_order;
using flashmla::sm90::dense_prefill::TileOrder;

constexpr int kSms = 132;
constexpr int64_t kB = 2;
constexpr int64_t kRows = 128;  // the dq kernel's query rows and the dk / dv kernel's key rows per CTA (bwd.cu)

int64_t blocks(int64_t s) { return (s + kRows - 1) / kRows; }

TEST(DensePrefillTileOrder, BackwardTakesBlocksFirstOnTheGqaCausalGrids) {
  for (int64_t s : {4096, 8192}) {
    const int64_t dq_ctas = blocks(s) * 32 * kB, dkdv_ctas = blocks(s) * 4 * kB;  // h_q 32, h_kv 4
    EXPECT_EQ(bwd_tile_order(true, dq_ctas, kSms), TileOrder::kByBlock) << "s " << s;
    EXPECT_EQ(bwd_tile_order(true, dkdv_ctas, kSms), TileOrder::kByBlock) << "s " << s;
    EXPECT_EQ(bwd_tile_order(false, dq_ctas, kSms), TileOrder::kByHead) << "non-causal s " << s;
    EXPECT_EQ(bwd_tile_order(false, dkdv_ctas, kSms), TileOrder::kByHead) << "non-causal s " << s;
  }
}

TEST(DensePrefillTileOrder, BackwardKeepsOneHeadsTilesTogetherAtManyHeads) {
  // h 128: by block, the resident CTAs would each stream another head's Q / dO or K / V (no L2 sharing).
  for (int64_t s : {4096, 8192})
    for (bool causal : {false, true})
      EXPECT_EQ(bwd_tile_order(causal, blocks(s) * 128 * kB, kSms), TileOrder::kByHead)
          << "s " << s << " causal " << causal;
  EXPECT_EQ(bwd_tile_order(true, 256, 0), TileOrder::kByHead) << "no SM count: the launch order";
}

TEST(DensePrefillTileOrder, ForwardKeepsTheLaunchOrder) {
  for (int64_t s : {4096, 8192})
    for (int64_t h_q : {32, 128})
      for (bool causal : {false, true})
        EXPECT_EQ(fwd_tile_order(causal, blocks(s) * h_q * kB, kSms, h_q == 32 ? 8 : 1), TileOrder::kByHead)
            << "s " << s << " h_q " << h_q << " causal " << causal;
}

}  // namespace
