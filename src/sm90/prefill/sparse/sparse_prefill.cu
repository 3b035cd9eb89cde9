// src/sm90/prefill/sparse/sparse_prefill.cu — host side of sm90 sparse MLA prefill (`flash_mla_sparse_fwd`,
// spec §1.4, §2.4): one kernel launch on the caller's stream, no workspace, no
// synchronisation, no allocation. Kernels (chosen by h_q, see sparse_prefill.h): mma_sync_kernel.cuh
// (mma.sync, h_q <= 32) and wgmma_seesaw_kernel.cuh (64-row head tiles, h_q > 32).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "sm90/common/host_utils.h"
#include "sm90/sm90.h"
#include "sm90/prefill/sparse/sparse_prefill.h"

namespace flashmla::sm90 {

namespace {

Status cuda_error(const char* what, cudaError_t e) { return cuda_error_status("flash_mla_sparse_fwd", what, e); }
Status value_error(const std::string& what) { return value_error_status("flash_mla_sparse_fwd", what); }

}  // namespace

Status sparse_prefill(const SparsePrefillParams& p) {
  const int64_t s_q = p.q.shape[0], h_q = p.q.shape[1], d_qk = p.q.shape[2];
  const int64_t s_kv = p.kv.shape[0], topk = p.indices.shape[2];
  if (s_q == 0) return Status::Ok();
  const int bm = h_q <= 16 ? 16 : (h_q <= 32 ? 32 : 64);
  const int64_t head_tiles = (h_q + bm - 1) / bm;
  if (s_q * head_tiles > 2147483647LL) return value_error("s_q * ceil(h_q / 64) must be < 2^31");
  if (topk > 2147483647LL - 64) return value_error("topk is too large");
  if (s_kv > 2147483647LL) return value_error("s_kv must be < 2^31");

  SparsePrefillKernelParams kp{};
  kp.q = p.q.data;
  kp.q_stride_s = p.q.stride[0];
  kp.q_stride_h = p.q.stride[1];
  kp.kv = p.kv.data;
  kp.kv_stride_s = p.kv.stride[0];
  kp.indices = static_cast<const int32_t*>(p.indices.data);
  kp.idx_stride_s = p.indices.stride[0];
  kp.idx_stride_k = p.indices.stride[2];
  kp.topk_length = p.topk_length.defined ? static_cast<const int32_t*>(p.topk_length.data) : nullptr;
  kp.tl_stride = p.topk_length.defined ? p.topk_length.stride[0] : 0;
  kp.attn_sink = p.attn_sink.defined ? static_cast<const float*>(p.attn_sink.data) : nullptr;
  kp.sink_stride = p.attn_sink.defined ? p.attn_sink.stride[0] : 0;
  kp.out = p.out.data;
  kp.o_stride_s = p.out.stride[0];
  kp.o_stride_h = p.out.stride[1];
  kp.o_stride_d = p.out.stride[2];
  kp.max_logits = static_cast<float*>(p.max_logits.data);
  kp.ml_stride_s = p.max_logits.stride[0];
  kp.ml_stride_h = p.max_logits.stride[1];
  kp.lse = static_cast<float*>(p.lse.data);
  kp.lse_stride_s = p.lse.stride[0];
  kp.lse_stride_h = p.lse.stride[1];
  kp.s_q = static_cast<int>(s_q);
  kp.h_q = static_cast<int>(h_q);
  kp.s_kv = static_cast<int>(s_kv);
  kp.topk = static_cast<int>(topk);
  kp.num_head_tiles = static_cast<int>(head_tiles);
  kp.q_vec = rows_16b_aligned(p.q, 2) ? 1 : 0;
  kp.kv_vec = rows_16b_aligned(p.kv, 1) ? 1 : 0;
  kp.out_vec_ok = element_pairs_aligned(p.out, 3) ? 1 : 0;
  kp.out_bulk_ok = p.out.stride[2] == 1 && rows_16b_aligned(p.out, 2) ? 1 : 0;
  kp.scale_log2 = p.sm_scale * 1.4426950408889634f;

  DeviceGuard guard(p.q.device.id);
  if (guard.error() != cudaSuccess) return cuda_error("cudaSetDevice", guard.error());
  kp.prefetch_ahead = num_sms(p.q.device.id);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const cudaError_t e =
      d_qk == 576 ? launch_sparse_prefill_576(kp, bm, stream) : launch_sparse_prefill_512(kp, bm, stream);
  if (e != cudaSuccess)
    return cuda_error(bm == 64 ? "sparse_attn_fwd_seesaw_kernel launch" : "sparse_attn_fwd_mma_kernel launch", e);
  return Status::Ok();
}

}  // namespace flashmla::sm90
