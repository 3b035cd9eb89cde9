// src/core/page_division.h — a cache token's page block and row without an integer division, for the
// sparse decode producer's address path (src/sm90/decode/sparse_fp8/wgmma_producer_kernel.cuh); the
// host computes the multiplier once per call (sparse_decode.cu). Tested on the host against / and %
// (tests/cpp/test_page_division.cpp).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHMLA_PAGE_DIV_HD __host__ __device__
#else
#define FLASHMLA_PAGE_DIV_HD
#endif

namespace flashmla::core {

/// ceil(2^32 / page_block_size) for page_block_size in [2, 2^31); 0 for page_block_size 1 (where
/// the block is the token itself).
inline uint32_t page_div_magic(uint32_t page_block_size) {
  return page_block_size <= 1 ? 0u
                              : static_cast<uint32_t>(((uint64_t{1} << 32) + page_block_size - 1) / page_block_size);
}

/// Page block and row of cache token u (u < 2^31, 1 <= page_block_size < 2^31, magic =
/// page_div_magic(page_block_size)). umulhi(u, magic) is u / page_block_size or one more: magic exceeds
/// 2^32 / page_block_size by less than 1, so the product's error u * (that excess) / 2^32 is below 1.
/// One correction of the remainder makes it exact.
FLASHMLA_PAGE_DIV_HD inline void split_page_token(uint32_t u, uint32_t page_block_size, uint32_t magic, uint32_t& block,
                                                  int32_t& row) {
#if defined(__CUDA_ARCH__)
  uint32_t q = magic != 0 ? __umulhi(u, magic) : u;
#else
  uint32_t q = magic != 0 ? static_cast<uint32_t>((static_cast<uint64_t>(u) * magic) >> 32) : u;
#endif
  int32_t r = static_cast<int32_t>(u - q * page_block_size);
  if (r < 0) {
    --q;
    r += static_cast<int32_t>(page_block_size);
  }
  block = q;
  row = r;
}

}  // namespace flashmla::core
