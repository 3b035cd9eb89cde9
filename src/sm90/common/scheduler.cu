// src/sm90/common/scheduler.cu — device version of the split-KV tile scheduler
// (spec §4.2-§4.3). Runs on the op's stream so it is CUDA-graph capturable;
// its output equals core::compute_tile_schedule (src/core/scheduler.cpp) with
// the same per-request overhead element for element: dense decode's kernel uses
// core::kDenseDecodeSchedOverheadBlocks, sparse decode's
// core::kSparseDecodeSchedOverheadBlocks.
// The GPU decode paths take their metadata from these kernels only.
#include <cstdint>

#include "core/tile_schedule_greedy.h"
#include "sm90/decode/dense/dense_decode.h"
#include "sm90/common/host_utils.h"
#include "sm90/decode/sparse_fp8/sparse_decode.h"

namespace flashmla::sm90 {

namespace {

using core::sched_num_blocks;
constexpr int64_t kBlockN = core::kSchedBlockSizeN;
constexpr int kSchedThreads = 256;
/// Batches whose per-request arrays (block counts, pe, ps, t, num_splits: 5b + 1 int32) fit in
/// this much shared memory are scheduled request by request (b <= 8191); larger ones run the
/// part-by-part greedy in one thread straight against global memory (slow, but exact).
constexpr int64_t kSchedMaxSmemBytes = 160 * 1024;

/// Shared memory of the staged path for a batch of b requests.
__host__ __device__ inline int64_t sched_smem_bytes(int64_t b, int64_t /*num_sm_parts*/) { return 4 * (5 * b + 1); }

// One CTA, three phases (staged path):
//  1. all threads read the lengths (coalesced), stage block counts in shared memory (-1 encodes
//     an empty request: 1 block) and sum the work;
//  2. thread 0 runs core::schedule_requests: one O(1) step per request (no loop over parts),
//     recording where each request starts and ends and the num_splits prefix sums;
//  3. every thread computes rows core::schedule_part_row for its parts (binary search over
//     the requests' end parts) and copies num_splits out.
// overhead: the path's per-request overhead in blocks (core::kDenseDecodeSchedOverheadBlocks or
// core::kSparseDecodeSchedOverheadBlocks).
// Equal to the greedy of spec §4.3 element for element (tests/cpp: RequestWisePassEqualsTheGreedy;
// on the GPU, the C++ test program's device-vs-host scheduler check). Not the part-by-part greedy in
// one thread: ~350 clk per part, 23 µs at b = 1 and 36 µs at b = 128 on the H200
// (bench/results/2026-11-30-profile-decode-call-serial-scheduler.log), more than a short decode's kernel.
template <class Work>
__device__ void schedule_kernel_body(const Work& work, int64_t overhead, int b, int num_sm_parts,
                                     int32_t* __restrict__ metadata, int32_t* __restrict__ num_splits) {
  extern __shared__ int32_t smem[];
  __shared__ long long s_warp_total[kSchedThreads / 32];
  __shared__ long long s_payload;
  const bool staged = sched_smem_bytes(b, num_sm_parts) <= kSchedMaxSmemBytes;
  int32_t* s_blocks = smem;      // b
  int32_t* s_pe = smem + b;      // b
  int32_t* s_ps = s_pe + b;      // b
  int32_t* s_t = s_ps + b;       // b
  int32_t* s_splits = s_t + b;   // b + 1
  long long total = 0;
  for (int i = threadIdx.x; i < b; i += blockDim.x) {
    const int64_t s = work(i);
    const int32_t nb = static_cast<int32_t>(sched_num_blocks(s));
    if (staged) s_blocks[i] = s == 0 ? -1 : nb;
    total += nb + overhead;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if ((threadIdx.x & 31) == 0) s_warp_total[threadIdx.x >> 5] = total;
  __syncthreads();
  auto nb_staged = [&](int64_t i) -> int64_t { const int32_t v = s_blocks[i]; return v < 0 ? 1 : v; };
  if (threadIdx.x == 0) {
    total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += s_warp_total[w];
    if (staged) {
      s_payload = core::schedule_requests(b, num_sm_parts, total, overhead, nb_staged, s_pe, s_ps, s_t,
                                          [&](int64_t i, int32_t v) { s_splits[i] = v; });
    } else {
      auto* rows = reinterpret_cast<TileSchedulerMetadataRow*>(metadata);
      core::greedy_tile_schedule(
          b, num_sm_parts, total, overhead, [&](int64_t i) -> int64_t { return sched_num_blocks(work(i)); },
          [&](int64_t i) -> bool { return work(i) == 0; },
          [&](int64_t part, const TileSchedulerMetadataRow& row) { rows[part] = row; },
          [&](int64_t i, int32_t v) { num_splits[i] = v; });
    }
  }
  if (!staged) return;
  __syncthreads();
  const int64_t payload = s_payload;
  auto* rows = reinterpret_cast<TileSchedulerMetadataRow*>(metadata);
  for (int q = threadIdx.x; q < num_sm_parts; q += blockDim.x) {
    rows[q] = core::schedule_part_row(
        q, b, payload, overhead, nb_staged, [&](int64_t i) -> bool { return s_blocks[i] < 0; },
        [&](int64_t i) -> int64_t { return s_pe[i]; }, s_ps, s_t);
  }
  for (int i = threadIdx.x; i <= b; i += blockDim.x) num_splits[i] = s_splits[i];
}

__global__ void __launch_bounds__(kSchedThreads) get_mla_metadata_kernel(const int32_t* __restrict__ seqlens, int b,
                                                                         int num_sm_parts,
                                                                         int32_t* __restrict__ metadata,
                                                                         int32_t* __restrict__ num_splits) {
  schedule_kernel_body([&](int64_t i) -> int64_t { return seqlens[i]; }, core::kDenseDecodeSchedOverheadBlocks, b,
                       num_sm_parts, metadata, num_splits);
}

// Sparse decode work of spec §4.2: s = topk_length[i] (or topk), 0 -> 1; with an
// extra cache s = ceil64(s) + (extra_topk_length[i] or extra_topk). Negative
// lengths (not validated on the GPU) count as 0. Must match the main kernel's
// block count (src/sm90/decode/sparse_fp8/mma_sync_kernel.cuh, request_blocks).
__device__ __forceinline__ int64_t sparse_work(const int32_t* topk_length, const int32_t* extra_topk_length,
                                               int topk, int extra_topk, int64_t i) {
  int64_t s = topk_length != nullptr ? max(topk_length[i], 0) : topk;
  if (s == 0) s = 1;
  if (extra_topk != 0) {
    s = (s + kBlockN - 1) / kBlockN * kBlockN +
        (extra_topk_length != nullptr ? max(extra_topk_length[i], 0) : extra_topk);
  }
  return s;
}

__global__ void __launch_bounds__(kSchedThreads) get_mla_metadata_sparse_kernel(
    const int32_t* __restrict__ topk_length, const int32_t* __restrict__ extra_topk_length, int topk,
    int extra_topk, int b, int num_sm_parts, int32_t* __restrict__ metadata, int32_t* __restrict__ num_splits) {
  schedule_kernel_body(
      [&](int64_t i) -> int64_t { return sparse_work(topk_length, extra_topk_length, topk, extra_topk, i); },
      core::kSparseDecodeSchedOverheadBlocks, b, num_sm_parts, metadata, num_splits);
}


}  // namespace

cudaError_t probe_sm90_image() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, get_mla_metadata_kernel);
}

namespace {
/// Launches a scheduler kernel with the shared memory of its staged path (when it fits).
template <class Kernel, class... Args>
cudaError_t launch_scheduler(Kernel* kernel, int b, int num_sm_parts, cudaStream_t stream, Args... args) {
  const int64_t bytes = sched_smem_bytes(b, num_sm_parts);
  const int smem = bytes <= kSchedMaxSmemBytes ? static_cast<int>(bytes) : 0;
  if (smem > 48 * 1024) {
    const cudaError_t e = set_max_dynamic_smem(kernel, smem);
    if (e != cudaSuccess) return e;
  }
  kernel<<<1, kSchedThreads, smem, stream>>>(args...);
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_tile_scheduler(const int32_t* seqlens, int b, int num_sm_parts, int32_t* metadata,
                                  int32_t* num_splits, cudaStream_t stream) {
  return launch_scheduler(get_mla_metadata_kernel, b, num_sm_parts, stream, seqlens, b, num_sm_parts, metadata,
                          num_splits);
}

}  // namespace flashmla::sm90

namespace flashmla::sm90 {

cudaError_t launch_sparse_tile_scheduler(const int32_t* topk_length, const int32_t* extra_topk_length, int topk,
                                         int extra_topk, int b, int num_sm_parts, int32_t* metadata,
                                         int32_t* num_splits, cudaStream_t stream) {
  return launch_scheduler(get_mla_metadata_sparse_kernel, b, num_sm_parts, stream, topk_length, extra_topk_length,
                          topk, extra_topk, b, num_sm_parts, metadata, num_splits);
}

}  // namespace flashmla::sm90
