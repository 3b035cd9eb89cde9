// src/sm90/scheduler.cu — device version of the split-KV tile scheduler
// (spec §4.2-§4.3). Runs on the op's stream so it is CUDA-graph capturable;
// its output equals core::compute_tile_schedule (src/core/scheduler.cpp)
// element for element.
#include <cstdint>

#include "sm90/dense_decode.h"
#include "sm90/sparse_decode.h"

namespace flashmla::sm90 {

namespace {

constexpr int64_t kBlockN = 64;
constexpr int64_t kOverhead = 5;

__device__ __forceinline__ int64_t num_blocks_of(int64_t s) {
  return (s > 1 ? s - 1 : 0) / kBlockN + 1;
}

// Greedy partition of spec §4.3, run by one thread. `work(i)` returns s'_i
// (tokens) of request i (spec §4.2); `total` is sum_i (num_blocks_i + overhead).
template <class Work>
__device__ void greedy_schedule(const Work& work, int b, int num_sm_parts, long long total,
                                int32_t* __restrict__ metadata, int32_t* __restrict__ num_splits) {
  const int64_t payload = (total + num_sm_parts - 1) / num_sm_parts + kOverhead;
  int64_t req = 0, block = 0, split = 0, cum = 0;
  num_splits[0] = 0;
  for (int64_t part = 0; part < num_sm_parts; ++part) {
    int32_t row[8];
    row[0] = static_cast<int32_t>(req);
    row[2] = static_cast<int32_t>(block);
    row[4] = static_cast<int32_t>(split);
    row[5] = block != 0;
    int64_t remain = payload;
    while (req < b) {
      const int64_t left = num_blocks_of(work(req)) - block;
      if (remain >= left + kOverhead) {
        cum += split + 1;
        num_splits[req + 1] = static_cast<int32_t>(cum);
        remain -= left + kOverhead;
        ++req;
        block = 0;
        split = 0;
      } else {
        if (remain - kOverhead > 0) {
          block += remain - kOverhead;
          split += 1;
        }
        break;
      }
    }
    const int64_t end_req = block > 0 ? req : req - 1;
    int64_t end_block;
    if (block > 0) {
      end_block = block;
    } else if (req >= 1) {
      const int64_t s_prev = work(req - 1);
      end_block = s_prev == 0 ? 0 : num_blocks_of(s_prev);
    } else {
      end_block = 0;
    }
    bool last_splitted = false;
    if (end_req >= 0 && end_req < b) {
      const int64_t s_end = work(end_req);
      last_splitted = end_block != num_blocks_of(s_end) && s_end != 0;
    }
    row[1] = static_cast<int32_t>(end_req);
    row[3] = static_cast<int32_t>(end_block);
    row[6] = last_splitted;
    if (row[0] == row[1]) {
      const int32_t either = row[5] || row[6];
      row[5] = either;
      row[6] = either;
    }
    row[7] = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) metadata[part * 8 + k] = row[k];
  }
}

// One warp: the warp sums the work, lane 0 runs the greedy partition.
__global__ void __launch_bounds__(32) get_mla_metadata_kernel(const int32_t* __restrict__ seqlens, int b,
                                                              int num_sm_parts, int32_t* __restrict__ metadata,
                                                              int32_t* __restrict__ num_splits) {
  const int lane = threadIdx.x;
  long long total = 0;
  for (int i = lane; i < b; i += 32) total += num_blocks_of(seqlens[i]) + kOverhead;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (lane != 0) return;
  greedy_schedule([&](int64_t i) -> int64_t { return seqlens[i]; }, b, num_sm_parts, total, metadata, num_splits);
}

// Sparse decode work of spec §4.2: s = topk_length[i] (or topk), 0 -> 1; with an
// extra cache s = ceil64(s) + (extra_topk_length[i] or extra_topk). Negative
// lengths (not validated on the GPU) count as 0. Must match the main kernel's
// block count (src/sm90/sparse_decode_kernel.cuh, request_blocks).
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

__global__ void __launch_bounds__(32) get_mla_metadata_sparse_kernel(const int32_t* __restrict__ topk_length,
                                                                     const int32_t* __restrict__ extra_topk_length,
                                                                     int topk, int extra_topk, int b,
                                                                     int num_sm_parts, int32_t* __restrict__ metadata,
                                                                     int32_t* __restrict__ num_splits) {
  const int lane = threadIdx.x;
  long long total = 0;
  for (int i = lane; i < b; i += 32)
    total += num_blocks_of(sparse_work(topk_length, extra_topk_length, topk, extra_topk, i)) + kOverhead;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (lane != 0) return;
  greedy_schedule(
      [&](int64_t i) -> int64_t { return sparse_work(topk_length, extra_topk_length, topk, extra_topk, i); }, b,
      num_sm_parts, total, metadata, num_splits);
}

}  // namespace

cudaError_t probe_sm90_image() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, get_mla_metadata_kernel);
}

cudaError_t launch_tile_scheduler(const int32_t* seqlens, int b, int num_sm_parts, int32_t* metadata,
                                  int32_t* num_splits, cudaStream_t stream) {
  get_mla_metadata_kernel<<<1, 32, 0, stream>>>(seqlens, b, num_sm_parts, metadata, num_splits);
  return cudaGetLastError();
}

}  // namespace flashmla::sm90

namespace flashmla::sm90 {

cudaError_t launch_sparse_tile_scheduler(const int32_t* topk_length, const int32_t* extra_topk_length, int topk,
                                         int extra_topk, int b, int num_sm_parts, int32_t* metadata,
                                         int32_t* num_splits, cudaStream_t stream) {
  get_mla_metadata_sparse_kernel<<<1, 32, 0, stream>>>(topk_length, extra_topk_length, topk, extra_topk, b,
                                                       num_sm_parts, metadata, num_splits);
  return cudaGetLastError();
}

}  // namespace flashmla::sm90
