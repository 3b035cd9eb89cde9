// src/sm90/decode/dense/dense_decode.h — internal interface of the sm90 dense-decode kernels
// (plain parameter structs and launchers). Used by src/sm90/*.cu and by the GPU
// tests in tests/gpu/cpp; not part of the public API.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flashmla/ops.h"

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
  int out_bulk_ok;  // out's last dim contiguous, base and strides 16-byte aligned (v4: rows by bulk copy)
  int accum_bulk_ok;  // o_accum 16-byte aligned (v4: split partial rows by bulk copy)
  int staged_epilogue;  // v4: the kernel whose epilogue stages O in shared memory (short requests)
  float scale_log2;  // softmax_scale * log2(e)
  int flags;         // DenseTuning bits
  int tma_ok;        // v4: a K tensor map was encoded (strides / page size allow TMA)
  int tma_box_tok;   // v4: tokens per TMA box = min(page_block_size, 64)
};

/// Tuning switches of the main kernels (benchmarks A/B them in one process).
/// kTuneL2Prefetch: v1/v2 L2 prefetch two tiles ahead (slower on the H200, off by default);
/// kTuneNoTma: no K tensor map (v4 is not used; the automatic choice falls back to v1/v2).
/// (Bit 4 was kTunePdl, the Programmatic Dependent Launch combine, removed after its A/B:
/// bench/NOTES.md "dense decode v5".)
/// kTuneStagedEpilogue / kTuneDirectEpilogue: force v4's staged / direct epilogue (default: staged
/// when b >= 2, no request can exceed kStagedEpilogueMaxTokens and out's rows are 16-byte aligned,
/// see dense_decode_launch).
enum DenseTuning : int { kTuneL2Prefetch = 1, kTuneNoTma = 2, kTuneStagedEpilogue = 8, kTuneDirectEpilogue = 16 };

/// v4 writes O through shared memory and bulk copies (the "staged" epilogue) when every request
/// of the batch is at most this long (block_table width x page size): there the epilogue is a large
/// part of a call (session 10: b 128, s_k 256: 47.4 -> 40.0 us), while on long contexts the direct
/// epilogue's kernel is faster (its pair loop keeps more addresses in registers; 2-4%). The bound
/// is the block table's capacity, not the actual lengths (the host does not read them): a server
/// whose table is sized for its longest context gets the direct kernel.
constexpr int64_t kStagedEpilogueMaxTokens = 1024;

/// Parameters of the combine kernel (`flash_fwd_mla_combine_kernel`).
struct DenseCombineParams {
  void* out;
  int64_t o_stride_b, o_stride_s, o_stride_h, o_stride_d;
  float* lse;
  int64_t lse_stride_b, lse_stride_h, lse_stride_s;
  const float* o_accum;
  const float* lse_accum;
  const int32_t* num_splits;
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

/// Kernel choice for tests and benchmarks: 0 = automatic (default: v4 when a K tensor
/// map can be made, else v2 for M > 32 and v1 below), 1 = force the mma.sync kernel (v1),
/// 2 = force the wgmma kernel (v2, 64-row tiles), 4 = force v4 (seesaw; falls back as 0
/// without a tensor map); any other number is treated as 0. (v3, TMA-fed wgmma, and v5, v4
/// pipelined across block pairs, were removed: bench/NOTES.md.)
/// With version 0 the environment variable FLASHMLA_DENSE_DECODE_KERNEL (read on every
/// call: "v1", "v2" or "v4") picks the kernel as the matching number would; unset or any
/// other value = automatic. The explicit setting wins over the environment.
void set_dense_kernel_version(int version);
int dense_kernel_version();
/// dense_kernel_version(), or the environment's choice when that is 0 (see above).
int dense_effective_kernel_version();
void set_dense_tuning(int flags);
int dense_tuning();

/// dense_decode with a choice of stages (`stages` is a DenseDecodeStage mask).
Status dense_decode_launch(const DenseDecodeParams& p, int64_t num_sm_parts, int stages);

}  // namespace flashmla::sm90
