// src/sm90/prefill/sparse/sparse_prefill.h — internal interface of the sm90 sparse MLA prefill
// kernels (`flash_mla_sparse_fwd`, spec §1.4, §2.4): plain parameter struct and
// launchers. Not part of the public API.
#pragma once

#include <cuda.h>  // CUtensorMap (type only; encoded on the host through the driver entry point)
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
  int out_bulk_ok; // out's last dim contiguous and every (s, h) row 16-byte aligned: bulk row copies
  float scale_log2;  // sm_scale * log2(e)
  int prefetch_ahead;  // > 0: each CTA prefetches into L2 the Q rows and indices of CTA blockIdx.x + this (the SM count)
  int out_tma;  // set by the v3w launcher: out_map is valid, the epilogue writes O with 3D TMA tensor stores
  // out as (512 cols, h_q, s_q) bf16, box 64 cols x 64 heads x 1 token, 128-byte swizzle (the slab
  // layout). Read by the kernel from parameter space (__grid_constant__).
  CUtensorMap out_map;  // 64-byte aligned by its type
};

/// Kernel choice for 64-row head tiles (h_q > 32; 16/32-row tiles always use the mma.sync
/// kernel), env FLASHMLA_SPARSE_PREFILL_KERNEL read per call: 0 automatic (= "v3w": seesaw with
/// a producer warpgroup, 8 threads per gathered row, any alignment), 1 = "mma" (the mma.sync
/// kernel on 64-row tiles too). Other values = automatic. (v1, v2, v3, v4p and the L2-hint
/// variant were removed: bench/NOTES.md "sparse prefill ...".)
int sparse_prefill_kernel_choice();

cudaError_t launch_sparse_prefill_v3w_576(const SparsePrefillKernelParams& kp, cudaStream_t stream);
cudaError_t launch_sparse_prefill_v3w_512(const SparsePrefillKernelParams& kp, cudaStream_t stream);
/// bm = rows per head tile (16, 32 or 64).
cudaError_t launch_sparse_prefill_mma_576(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream);
cudaError_t launch_sparse_prefill_mma_512(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream);

}  // namespace flashmla::sm90
