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
  int out_tma;  // set by the seesaw launcher: out_map is valid, the epilogue writes O with 3D TMA tensor stores
  // out as (512 cols, h_q, s_q) bf16, box 64 cols x 64 heads x 1 token, 128-byte swizzle (the slab
  // layout). Read by the kernel from parameter space (__grid_constant__).
  CUtensorMap out_map;  // 64-byte aligned by its type
};

/// The kernel choice, a function of h_q alone: 64-row head tiles (h_q > 32) run the seesaw kernel
/// (wgmma_seesaw_kernel.cuh: two wgmma consumer warpgroups + a producer warpgroup that gathers,
/// any alignment); 16- and 32-row tiles (h_q <= 16, h_q <= 32) the mma.sync kernel
/// (mma_sync_kernel.cuh), which does not pad them to 64 rows.
/// bm = rows per head tile (64, 32 or 16). One function per head dim (instantiations_d576.cu / _d512.cu).
cudaError_t launch_sparse_prefill_576(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream);
cudaError_t launch_sparse_prefill_512(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream);

}  // namespace flashmla::sm90
