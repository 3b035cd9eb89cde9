// src/sm90/sparse_prefill.h — internal interface of the sm90 sparse MLA prefill
// kernels (`flash_mla_sparse_fwd`, spec §1.4, §2.4): plain parameter struct and
// launchers. Not part of the public API.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flashmla/ops.h"

namespace flashmla::sm90 {

/// Parameters of the `sparse_attn_fwd*` kernels. Strides in elements.
struct SparsePrefillKernelParams {
  const void* q;  // (s_q, h_q, d_qk) bf16
  int64_t q_stride_s, q_stride_h;
  const void* kv;  // (s_kv, 1, d_qk) bf16
  int64_t kv_stride_s;
  const int32_t* indices;  // (s_q, 1, topk) int32
  int64_t idx_stride_s, idx_stride_k;
  const int32_t* topk_length;  // optional (s_q,)
  int64_t tl_stride;
  const float* attn_sink;  // optional (h_q,)
  int64_t sink_stride;
  void* out;  // (s_q, h_q, 512) bf16
  int64_t o_stride_s, o_stride_h, o_stride_d;
  float* max_logits;  // (s_q, h_q)
  int64_t ml_stride_s, ml_stride_h;
  float* lse;  // (s_q, h_q)
  int64_t lse_stride_s, lse_stride_h;
  int s_q, h_q, s_kv, topk;
  int num_head_tiles;
  int q_vec;       // q rows 16-byte aligned: cp.async, else 2-byte loads
  int kv_vec;      // kv base and row stride 16-byte aligned: cp.async gathers, else 2-byte loads
  int out_vec_ok;  // out's last dim contiguous with 4-byte aligned pairs
  float scale_log2;  // sm_scale * log2(e)
};

/// Kernel choice (env FLASHMLA_SPARSE_PREFILL_KERNEL) for 64-row head tiles (16/32-row tiles
/// always use the mma.sync kernel): 0 automatic (= v3w), 1 = "mma" (mma.sync kernel), 2 = "v1"
/// (v1 wgmma kernel), 3 = "v2" (seesaw, gathers issued by the compute warpgroups; v1 when q or
/// kv rows are not 16-byte aligned), 4 = "v3" (seesaw with a producer warpgroup, 2 threads per
/// gathered row), 5 = "v3w" (same, 8 threads per gathered row), 6 = "v4p" (v3w made persistent:
/// one CTA per SM loops over (token, head tile) tiles, loading the next tile's Q and first pair
/// under the current tile's tail; opt-in, bench/NOTES.md "sparse prefill v4p").
int sparse_prefill_kernel_choice();
/// Env FLASHMLA_SPARSE_PREFILL_L2HINT=1 (opt-in): the v3w / v4p producer's KV gathers carry an L2
/// evict_last cache policy (v4p's Q loads evict_first).
bool sparse_prefill_l2_hint();

cudaError_t launch_sparse_prefill_wgmma_576(const SparsePrefillKernelParams& kp, cudaStream_t stream);
cudaError_t launch_sparse_prefill_wgmma_512(const SparsePrefillKernelParams& kp, cudaStream_t stream);
/// variant 0: v2 (256 threads, aligned rows only); 1: v3 (producer warpgroup, 384 threads, 2 threads
/// per gathered row); 2: v3 with 8 threads per gathered row (whole 128-byte lines per instruction);
/// 3: variant 2 with the L2 evict_last hint on the KV gathers.
cudaError_t launch_sparse_prefill_seesaw_576(const SparsePrefillKernelParams& kp, int variant, cudaStream_t stream);
cudaError_t launch_sparse_prefill_seesaw_512(const SparsePrefillKernelParams& kp, int variant, cudaStream_t stream);
/// v4p (persistent v3w); grid = min(tiles, grid_cap) CTAs (grid_cap = SM count).
cudaError_t launch_sparse_prefill_persist_576(const SparsePrefillKernelParams& kp, bool l2_hint, int grid_cap,
                                              cudaStream_t stream);
cudaError_t launch_sparse_prefill_persist_512(const SparsePrefillKernelParams& kp, bool l2_hint, int grid_cap,
                                              cudaStream_t stream);
/// bm = rows per head tile (16, 32 or 64).
cudaError_t launch_sparse_prefill_mma_576(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream);
cudaError_t launch_sparse_prefill_mma_512(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream);

}  // namespace flashmla::sm90
