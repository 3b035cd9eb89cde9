// src/sm90/decode/dense/dense_decode.h — internal interface of the sm90 dense-decode kernels
// (plain parameter structs and launchers). Used by src/sm90/*.cu and by the GPU
// tests in tests/gpu/cpp; not part of the public API.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flashmla/ops.h"
#include "sm90/common/combine_buffers.h"

namespace flashmla::sm90 {

/// Parameters of the split-KV main kernel (`flash_fwd_splitkv_mla_kernel`).
/// Rows of one (request, KV head) are the `M = s_q * G` (query token, head in
/// group) pairs, s_q-major, G = h_q / h_kv. Strides are in elements.
struct DenseDecodeKernelParams {
  const void* q;  // (b, s_q, h_q, d_qk)
  int64_t q_stride_b, q_stride_s, q_stride_h;
  const void* k;  // (num_blocks, pbs, h_kv, d_qk)
  int64_t k_stride_blk, k_stride_tok, k_stride_h;
  const int32_t* block_table;  // (b, max_blocks)
  int64_t bt_stride_b, bt_stride_j;
  const int32_t* seqlens;  // (b,)
  void* out;               // (b, s_q, h_q, 512)
  int64_t o_stride_b, o_stride_s, o_stride_h, o_stride_d;
  float* lse;  // (b, h_q, s_q)
  int64_t lse_stride_b, lse_stride_h, lse_stride_s;
  float* o_accum;    // (num_splits_total, h_kv, M, 512) fp32, O/L per split
  float* lse_accum;  // (num_splits_total, h_kv, M) fp32, base-2 log2(L) + m per split
  const int32_t* tile_scheduler_metadata;  // (num_sm_parts, 8)
  const int32_t* num_splits;               // (b + 1,)
  int b, s_q, h_q, h_kv, group, m_rows, d_qk, page_block_size;
  int causal;
  int out_vec_ok;  // out's last dim contiguous and 4-byte aligned pairs
  int out_bulk_ok;  // out's last dim contiguous, base and strides 16-byte aligned (seesaw kernel: rows by bulk copy)
  int accum_bulk_ok;  // o_accum 16-byte aligned (seesaw kernel: split partial rows by bulk copy)
  int staged_epilogue;  // seesaw kernel: the kernel whose epilogue stages O in shared memory (short requests)
  float scale_log2;  // softmax_scale * log2(e)
  int flags;         // DenseTuning bits
  int tma_ok;        // seesaw kernel: a K tensor map was encoded (strides / page size allow TMA)
  int tma_box_tok;   // seesaw kernel: tokens per TMA box = min(page_block_size, 64)
};

/// Tuning switches of the main kernels, for tests and benchmarks (DenseDecodeOptions::tuning; 0 in
/// the library's calls):
/// kTuneL2Prefetch: the mma.sync / wgmma kernels prefetch K two tiles ahead into L2 (slower on the
/// H200, hence off);
/// kTuneNoTma: no K tensor map, so the automatic choice takes the kernels without TMA;
/// kTuneStagedEpilogue / kTuneDirectEpilogue: force the seesaw kernel's staged / direct epilogue
/// (default: staged when b >= 2, no request can exceed kStagedEpilogueMaxTokens and out's rows are
/// 16-byte aligned, see dense_decode_launch).
enum DenseTuning : int { kTuneL2Prefetch = 1, kTuneNoTma = 2, kTuneStagedEpilogue = 8, kTuneDirectEpilogue = 16 };

/// The seesaw kernel writes O through shared memory and bulk copies (the "staged" epilogue) when every
/// request of the batch is at most this long (block_table width x page size): there the epilogue is a
/// large part of a call (H200, b 128, s_k 256: 47.4 -> 40.0 us), while on long contexts the direct
/// epilogue's kernel is faster (its pair loop keeps more addresses in registers; 2-4%). The bound
/// is the block table's capacity, not the actual lengths (the host does not read them): a server
/// whose table is sized for its longest context gets the direct kernel.
constexpr int64_t kStagedEpilogueMaxTokens = 1024;

/// Parameters of the combine kernel (`flash_fwd_mla_combine_kernel`).
struct DenseCombineParams : CombineBuffers {
  int b, s_q, h_q, h_kv, group, m_rows;
  int out_vec_ok;
};

/// Which stages `dense_decode_launch` runs (tests and benchmarks time the main kernel alone).
enum DenseDecodeStage : int { kStageScheduler = 1, kStageMain = 2, kStageCombine = 4, kStageAll = 7 };

/// Spec §4.2-§4.3 on the device: one warp, reads `seqlens[0..b)` and writes
/// `metadata` ((num_sm_parts, 8) int32) and `num_splits` ((b+1,) int32).
cudaError_t launch_tile_scheduler(const int32_t* seqlens, int b, int num_sm_parts, int32_t* metadata,
                                  int32_t* num_splits, cudaStream_t stream);

cudaError_t launch_dense_combine(const DenseCombineParams& cp, bool is_fp16, cudaStream_t stream);

/// The main kernels of dense decode. M = s_q * h_q / h_kv query rows share one KV head.
enum class DenseKernel : int {
  kAuto = 0,     // choose_dense_kernel (what the library runs)
  kMmaSync = 1,  // mma_sync_kernel.cuh: mma.sync m16n8k16 on 16- or 32-row tiles (M <= 32 only)
  kWgmma = 2,    // wgmma_kernel.cuh: wgmma on 64-row tiles, K gathered by cp.async
  kSeesaw = 4,   // wgmma_seesaw_kernel.cuh: the seesaw schedule on 64-row tiles, K fed by TMA (needs a
                 // K tensor map)
};

/// The kernel the library runs, a function of the shapes alone: the seesaw kernel whenever a K
/// tensor map can be encoded (d_qk 576 or 512, page_block_size a multiple of 64 or 16 / 32, k_cache
/// 16-byte aligned with 16-byte multiple strides: make_k_tensor_map in dense_decode.cu); otherwise
/// the wgmma kernel when M > 32 and the mma.sync kernel (which does not pad 16 or 32 rows to 64)
/// for M <= 32.
DenseKernel choose_dense_kernel(int64_t m_rows, bool k_tensor_map);

/// Explicit choices of dense_decode_launch for tests and benchmarks (the library uses the defaults).
struct DenseDecodeOptions {
  /// kAuto: choose_dense_kernel. A forced kernel that cannot serve the call (kSeesaw without a K
  /// tensor map, kMmaSync with M > 32) makes the launch return a kValue error.
  DenseKernel kernel = DenseKernel::kAuto;
  int tuning = 0;  // DenseTuning bits
};

/// dense_decode with a choice of stages (`stages` is a DenseDecodeStage mask).
Status dense_decode_launch(const DenseDecodeParams& p, int64_t num_sm_parts, int stages,
                           const DenseDecodeOptions& options = {});

}  // namespace flashmla::sm90
