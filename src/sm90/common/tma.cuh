// src/sm90/common/tma.cuh — PTX wrappers for the bulk tensor copy engine (TMA)
// (with the transaction-count mbarrier arrival it completes on), used by the dense decode seesaw kernel.
// Own namespace so that other sm90 kernels can define their own helpers without clashes.
#pragma once

#include <cuda.h>  // CUtensorMap (type only; encoding happens on the host through the driver entry point)

#include <cstdint>

#include "sm90/common/utils.cuh"

namespace flashmla::sm90::tma {

// The mbarrier wrappers are shared (utils.cuh).
using flashmla::sm90::fence_barrier_init;
using flashmla::sm90::mbar_init;
using flashmla::sm90::mbar_try_wait;
using flashmla::sm90::mbar_wait;
using flashmla::sm90::mbar_arrive_expect_tx;

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 4-D tiled bulk tensor copy global -> shared, completing on `bar` (complete_tx bytes).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Bulk shared -> global copies: the shared helpers of utils.cuh (also used by the sparse prefill).
using ::flashmla::sm90::bulk_commit;
using ::flashmla::sm90::bulk_store;
using ::flashmla::sm90::bulk_wait_read;

// L2 prefetch of the same 4-D box (no shared-memory destination, no barrier).
__device__ __forceinline__ void tma_prefetch_4d(const CUtensorMap* map, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

}  // namespace flashmla::sm90::tma
