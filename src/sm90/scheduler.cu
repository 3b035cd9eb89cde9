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

// Greedy partition of spec §4.3, run by one thread. `nb(i)` returns request i's block count
// ceil(max(s_i - 1, 0) / 64) + 1 and `empty(i)` whether s_i == 0 (spec §4.2: s_i tokens);
// `total` is sum_i (num_blocks_i + overhead).
template <class Blocks, class Empty>
__device__ void greedy_schedule(const Blocks& nb, const Empty& empty, int b, int num_sm_parts, long long total,
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
      const int64_t left = nb(req) - block;
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
      end_block = empty(req - 1) ? 0 : nb(req - 1);
    } else {
      end_block = 0;
    }
    bool last_splitted = false;
    if (end_req >= 0 && end_req < b) last_splitted = end_block != nb(end_req) && !empty(end_req);
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

// Requests whose block counts are staged in shared memory (4 bytes each, under the 48 KB default limit);
// larger batches read their lengths from global memory inside the serial loop.
constexpr int kSchedThreads = 256;
constexpr int kSchedSmemRequests = 12000;

// Encoded block count of one request: -1 when s == 0 (its block count is 1), else num_blocks_of(s).
__device__ __forceinline__ int32_t encode_blocks(int64_t s) {
  return s == 0 ? -1 : static_cast<int32_t>(num_blocks_of(s));
}

// One CTA. All threads read the lengths (coalesced, in parallel), stage their block counts in
// shared memory and sum the work; thread 0 then runs the serial greedy partition out of shared
// memory. (Run by one lane straight from global memory, the partition was a chain of dependent
// loads: ~30-50 µs per call at b = 1..128, more than a short decode's main kernel.)
template <class Work>
__device__ void schedule_kernel_body(const Work& work, int b, int num_sm_parts, int32_t* __restrict__ metadata,
                                     int32_t* __restrict__ num_splits) {
  extern __shared__ int32_t s_blocks[];
  __shared__ long long s_warp_total[kSchedThreads / 32];
  const bool staged = b <= kSchedSmemRequests;
  long long total = 0;
  for (int i = threadIdx.x; i < b; i += blockDim.x) {
    const int32_t v = encode_blocks(work(i));
    if (staged) s_blocks[i] = v;
    total += (v < 0 ? 1 : v) + kOverhead;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if ((threadIdx.x & 31) == 0) s_warp_total[threadIdx.x >> 5] = total;
  __syncthreads();
  if (threadIdx.x != 0) return;
  total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += s_warp_total[w];
  if (staged) {
    greedy_schedule([&](int64_t i) -> int64_t { const int32_t v = s_blocks[i]; return v < 0 ? 1 : v; },
                    [&](int64_t i) -> bool { return s_blocks[i] < 0; }, b, num_sm_parts, total, metadata,
                    num_splits);
  } else {
    greedy_schedule([&](int64_t i) -> int64_t { return num_blocks_of(work(i)); },
                    [&](int64_t i) -> bool { return work(i) == 0; }, b, num_sm_parts, total, metadata, num_splits);
  }
}

__global__ void __launch_bounds__(kSchedThreads) get_mla_metadata_kernel(const int32_t* __restrict__ seqlens, int b,
                                                                         int num_sm_parts,
                                                                         int32_t* __restrict__ metadata,
                                                                         int32_t* __restrict__ num_splits) {
  schedule_kernel_body([&](int64_t i) -> int64_t { return seqlens[i]; }, b, num_sm_parts, metadata, num_splits);
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

__global__ void __launch_bounds__(kSchedThreads) get_mla_metadata_sparse_kernel(
    const int32_t* __restrict__ topk_length, const int32_t* __restrict__ extra_topk_length, int topk,
    int extra_topk, int b, int num_sm_parts, int32_t* __restrict__ metadata, int32_t* __restrict__ num_splits) {
  schedule_kernel_body(
      [&](int64_t i) -> int64_t { return sparse_work(topk_length, extra_topk_length, topk, extra_topk, i); }, b,
      num_sm_parts, metadata, num_splits);
}

/// Dynamic shared memory of a scheduler launch for batch size b.
size_t sched_smem_bytes(int b) {
  return b <= kSchedSmemRequests ? static_cast<size_t>(b > 0 ? b : 1) * sizeof(int32_t) : 0;
}

}  // namespace

cudaError_t probe_sm90_image() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, get_mla_metadata_kernel);
}

cudaError_t launch_tile_scheduler(const int32_t* seqlens, int b, int num_sm_parts, int32_t* metadata,
                                  int32_t* num_splits, cudaStream_t stream) {
  get_mla_metadata_kernel<<<1, kSchedThreads, sched_smem_bytes(b), stream>>>(seqlens, b, num_sm_parts, metadata, num_splits);
  return cudaGetLastError();
}

}  // namespace flashmla::sm90

namespace flashmla::sm90 {

cudaError_t launch_sparse_tile_scheduler(const int32_t* topk_length, const int32_t* extra_topk_length, int topk,
                                         int extra_topk, int b, int num_sm_parts, int32_t* metadata,
                                         int32_t* num_splits, cudaStream_t stream) {
  get_mla_metadata_sparse_kernel<<<1, kSchedThreads, sched_smem_bytes(b), stream>>>(topk_length, extra_topk_length, topk, extra_topk, b,
                                                       num_sm_parts, metadata, num_splits);
  return cudaGetLastError();
}

}  // namespace flashmla::sm90
