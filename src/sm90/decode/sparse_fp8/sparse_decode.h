// src/sm90/decode/sparse_fp8/sparse_decode.h — internal interface of the sm90 sparse FP8 decode
// kernels (plain parameter structs and launchers). Not part of the public API.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flashmla/ops.h"
#include "sm90/common/combine_buffers.h"

namespace flashmla::sm90 {

/// One FP8 cache (main or extra) with its index list, as the kernel sees it.
struct SparseScope {
  const uint8_t* cache = nullptr;  // page block B starts at cache + B * block_stride (bytes)
  int64_t block_stride = 0;        // bytes
  int page_block_size = 1;
  uint32_t pbs_magic = 0;  // core::page_div_magic(page_block_size): the kernels' page division by multiply
  int num_tokens = 0;              // num_blocks * page_block_size (< 2^31)
  const int32_t* indices = nullptr;  // (b, s_q, topk) int32
  int64_t idx_stride_b = 0, idx_stride_s = 0, idx_stride_k = 1;
  int topk = 0;
  const int32_t* topk_length = nullptr;  // optional (b,)
  int vec = 1;  // base and block stride 16-byte aligned: 16-byte cp.async gathers
};

/// The sparse decode main kernels (sparse_decode.cu picks one per call by shape). The small-heads and
/// wgmma producer kernels need 16-byte aligned caches; the mma.sync kernel serves any call they cannot.
enum class SparseDecodeMainKernel : int {
  kMmaSync,        // mma_sync_kernel.cuh: mma.sync, all threads dequantize; 16 < h_q <= 32 with few query
                   // tokens, and any h_q over caches that are not 16-byte aligned
  kMmaSmallHeads,  // mma_small_heads_kernel.cuh: producer warpgroup + mma.sync consumers; h_q <= 16 with
                   // few query tokens
  kWgmmaProducer,  // wgmma_producer_kernel.cuh: producer warpgroup + two wgmma consumer warpgroups over
                   // two whole-block K buffers; h_q > 32, and any h_q with many query tokens
};

/// Parameters of the sparse decode main kernels (`flash_fwd_splitkv_mla_fp8_sparse_kernel*`). Strides
/// in elements.
struct SparseDecodeKernelParams {
  const void* q;  // (b, s_q, h_q, d_qk) bf16
  int64_t q_stride_b, q_stride_s, q_stride_h;
  SparseScope main, extra;
  int has_extra;
  const float* attn_sink;  // optional (h_q,)
  void* out;               // (b, s_q, h_q, 512) bf16
  int64_t o_stride_b, o_stride_s, o_stride_h, o_stride_d;
  float* lse;  // (b, h_q, s_q)
  int64_t lse_stride_b, lse_stride_h, lse_stride_s;
  float* o_accum;    // (num_splits_total, s_q, h_q, 512) fp32, O/L per split
  float* lse_accum;  // (num_splits_total, s_q, h_q) fp32, base-2 log2(L) + m per split
  const int32_t* tile_scheduler_metadata;  // (num_sm_parts, 8)
  const int32_t* num_splits;               // (b + 1,)
  int b, s_q, h_q, num_head_tiles;
  int q_vec;       // q 16-byte aligned rows: cp.async
  int out_vec_ok;  // out's last dim contiguous and 4-byte aligned pairs; else every request goes through the combine
  int out_vec16;   // out_vec_ok and out's rows 16-byte aligned (rows_16b_aligned): the wgmma kernel's 16-byte stores
  float scale_log2;  // softmax_scale * log2(e)
  SparseDecodeMainKernel main_kernel;  // chosen by shape in sparse_decode.cu (sparse_decode_main_kernel)
};

struct SparseCombineParams : CombineBuffers {
  const float* attn_sink;
  int b, s_q, h_q;
  int out_vec_ok;  // 0: also combine requests with a single split (the main kernel wrote only partials)
};

/// Which stages `sparse_decode_launch` runs (benchmarks time the main kernel alone).
enum SparseDecodeStage : int { kSparseStageScheduler = 1, kSparseStageMain = 2, kSparseStageCombine = 4,
                               kSparseStageAll = 7 };

/// Spec §4.2-§4.3 on the device for sparse decode: per-request work from topk /
/// topk_length / extra_topk / extra_topk_length (either length pointer may be null).
cudaError_t launch_sparse_tile_scheduler(const int32_t* topk_length, const int32_t* extra_topk_length, int topk,
                                         int extra_topk, int b, int num_sm_parts, int32_t* metadata,
                                         int32_t* num_splits, cudaStream_t stream);

cudaError_t launch_sparse_main_v32(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream);
cudaError_t launch_sparse_main_model1(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream);
/// `metadata` / `num_sm_parts`: the schedule of the main kernel (the compact grid reads it).
cudaError_t launch_sparse_combine(const SparseCombineParams& cp, const int32_t* metadata, int num_sm_parts,
                                  cudaStream_t stream);

Status sparse_decode_launch(const SparseDecodeParams& p, int64_t num_sm_parts, int stages);

}  // namespace flashmla::sm90
