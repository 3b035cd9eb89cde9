// Public operator entry points: validate once, plan, dispatch to a backend.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "core/scheduler.h"
#include "core/validate.h"
#include "flashmla/ops.h"
#include "reference/reference.h"
#ifdef FLASHMLA_WITH_CUDA
#include "sm90/sm90.h"
#endif

namespace flashmla {
namespace {

Status no_gpu_backend(const char* op, Device d) {
#ifdef FLASHMLA_WITH_CUDA
  return Status::Error(ErrorKind::kNotImplemented,
                       std::string(op) + ": " + device_name(d) +
                           " is not a compute capability 9.0 (Hopper) GPU; this build has kernels for sm_90a only. "
                           "Pass CPU tensors to use the reference backend.");
#else
  return Status::Error(ErrorKind::kNotImplemented,
                       std::string(op) + ": this build of flash_mla has no CUDA backend (built without nvcc), "
                                         "so tensors on " + device_name(d) +
                           " are not supported. Pass CPU tensors to use the reference backend.");
#endif
}

/// A plan's GPU check: OK for a device the sm90 backend supports; otherwise (another GPU, or a build
/// without the CUDA backend) no_gpu_backend's error for `op`.
Status gpu_supported(const char* op, Device d) {
#ifdef FLASHMLA_WITH_CUDA
  if (sm90::device_supported(d.id)) return Status::Ok();
#endif
  return no_gpu_backend(op, d);
}

// An operator's GPU dispatch: the sm90 backend's `call` in a build with the CUDA backend, else
// no_gpu_backend's error for `op` on `dev` (the call is then not compiled).
#ifdef FLASHMLA_WITH_CUDA
#define FLASHMLA_ON_GPU(call, op, dev) (call)
#else
#define FLASHMLA_ON_GPU(call, op, dev) no_gpu_backend(op, dev)
#endif

[[maybe_unused]] Status not_yet_on_gpu(const char* op) {
  return Status::Error(ErrorKind::kNotImplemented,
                       std::string(op) + ": the Hopper (sm90) kernel for this operator is not implemented yet; "
                                         "pass CPU tensors to use the reference backend.");
}

/// The shapes-only plans' sizes: b + 1 entries of num_splits are int32, and b * s_q * h_q rows of
/// 512 float32 partials (per split) must stay far from int64 overflow in the workspace sizing.
Status check_plan_sizes(const char* what, int64_t b, int64_t s_q, int64_t h_q) {
  int64_t n = 0;
  if (b >= std::numeric_limits<int32_t>::max() || __builtin_mul_overflow(b, s_q, &n) ||
      __builtin_mul_overflow(n, h_q, &n) || __builtin_mul_overflow(n, int64_t{4096}, &n) || n > (int64_t{1} << 60))
    return Status::Error(ErrorKind::kValue,
                         std::string(what) + ": sizes too large (b must be < 2^31 and b * s_q * h_q * 4096 < 2^60), got b=" +
                             std::to_string(b) + " s_q=" + std::to_string(s_q) + " h_q=" + std::to_string(h_q));
  return Status::Ok();
}

/// Host schedule written into CPU metadata buffers (spec §4), with the path's per-request overhead
/// (core::kDenseDecodeSchedOverheadBlocks or core::kSparseDecodeSchedOverheadBlocks).
void fill_host_schedule(const std::vector<int64_t>& work, int64_t overhead, const TensorRef& tsm,
                        const TensorRef& num_splits) {
  core::compute_tile_schedule(work, tsm.shape[0], overhead, static_cast<TileSchedulerMetadataRow*>(tsm.data),
                              static_cast<int32_t*>(num_splits.data));
}

const int32_t* i32(const TensorRef& t) { return static_cast<const int32_t*>(t.data); }

/// On the CPU a call that computes its schedule fills the metadata it is given for that buffer's row count
/// (fill_host_schedule; the reference backend never reads the metadata back), so any (rows >= 1, 8) buffer is right
/// for it. The bindings size that buffer from a plan of their own, and set_reference_num_threads in another thread
/// may change the count between that plan and this call's (ops.h: calls in flight keep their count). Metadata
/// given as ready keeps the check against this call's count.
void cpu_schedule_rows(const TensorRef& q, const TensorRef& tsm, bool metadata_ready, DecodePlan* plan) {
  if (q.device.type == DeviceType::kCPU && !metadata_ready && tsm.ndim == 2 && tsm.shape[0] >= 1)
    plan->num_sm_parts = tsm.shape[0];
}

}  // namespace

bool has_cuda_backend() {
#ifdef FLASHMLA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int num_sms(Device d) {
#ifdef FLASHMLA_WITH_CUDA
  if (d.type == DeviceType::kCUDA) return sm90::num_sms(d.id);
#endif
  (void)d;
  return reference_num_threads();
}

// ------------------------------------------------------------------ dense decode
Status dense_decode_plan_for_shapes(Device device, int64_t b, int64_t s_q, int64_t h_q, int64_t h_kv,
                                    DecodePlan* plan) {
  if (plan == nullptr) return Status::Error(ErrorKind::kValue, "plan: the DecodePlan pointer is null");
  if (b < 1 || s_q < 1 || h_kv < 1 || h_q < 1 || h_q % h_kv != 0)
    return Status::Error(ErrorKind::kValue,
                         "dense decode plan: expected b, s_q, h_q, h_kv >= 1 with h_q % h_kv == 0, got b=" +
                             std::to_string(b) + " s_q=" + std::to_string(s_q) + " h_q=" + std::to_string(h_q) +
                             " h_kv=" + std::to_string(h_kv));
  FLASHMLA_RETURN_IF_ERROR(check_plan_sizes("dense decode plan", b, s_q, h_q));
  plan->num_splits_len = b + 1;
  plan->num_sm_parts = core::dense_decode_num_sm_parts(num_sms(device), s_q, h_q, h_kv);
  plan->workspace_bytes = 0;
  if (device.type == DeviceType::kCUDA) {
    FLASHMLA_RETURN_IF_ERROR(gpu_supported("flash_mla_with_kvcache (dense)", device));
#ifdef FLASHMLA_WITH_CUDA
    // The sm90 sizing reads shapes only: q (b, s_q, h_q, ·) and k_cache (·, ·, h_kv, ·).
    DenseDecodeParams shapes;
    shapes.q.ndim = 4;
    shapes.q.shape[0] = b;
    shapes.q.shape[1] = s_q;
    shapes.q.shape[2] = h_q;
    shapes.q.shape[3] = 576;
    shapes.k_cache.ndim = 4;
    shapes.k_cache.shape[1] = 64;
    shapes.k_cache.shape[2] = h_kv;
    shapes.k_cache.shape[3] = 576;
    plan->workspace_bytes = sm90::dense_decode_workspace_bytes(shapes, plan->num_sm_parts);
#endif
  }
  return Status::Ok();
}

Status dense_decode_plan(const DenseDecodeParams& p, DecodePlan* plan) {  // (null plan: *_plan_for_shapes)
  FLASHMLA_RETURN_IF_ERROR(core::validate_dense_decode_inputs(p));
  return dense_decode_plan_for_shapes(p.q.device, p.q.shape[0], p.q.shape[1], p.q.shape[2], p.k_cache.shape[2], plan);
}

Status dense_decode_fwd(const DenseDecodeParams& p) {
  FLASHMLA_RETURN_IF_ERROR(core::validate_data(p));
  DecodePlan plan;
  FLASHMLA_RETURN_IF_ERROR(dense_decode_plan(p, &plan));
  cpu_schedule_rows(p.q, p.tile_scheduler_metadata, p.metadata_ready, &plan);
  FLASHMLA_RETURN_IF_ERROR(core::validate_decode_outputs(p.q, p.out, p.lse, p.q.dtype, p.tile_scheduler_metadata,
                                                         p.num_splits, plan, p.workspace_bytes, p.workspace));
  FLASHMLA_RETURN_IF_ERROR(core::validate_no_aliasing(p));
  if (p.q.device.type == DeviceType::kCPU) {
    if (!p.metadata_ready) {
      std::vector<int64_t> work(p.q.shape[0]);
      for (size_t i = 0; i < work.size(); ++i) work[i] = i32(p.cache_seqlens)[i];
      fill_host_schedule(work, core::kDenseDecodeSchedOverheadBlocks, p.tile_scheduler_metadata, p.num_splits);
    }
    return reference::dense_decode(p);
  }
  return FLASHMLA_ON_GPU(sm90::dense_decode(p, plan.num_sm_parts), "flash_mla_with_kvcache (dense)", p.q.device);
}

// ------------------------------------------------------------------ sparse decode
Status sparse_decode_plan_for_shapes(Device device, int64_t b, int64_t s_q, int64_t h_q, DecodePlan* plan) {
  if (plan == nullptr) return Status::Error(ErrorKind::kValue, "plan: the DecodePlan pointer is null");
  if (b < 1 || s_q < 1 || h_q < 1)
    return Status::Error(ErrorKind::kValue, "sparse decode plan: expected b, s_q, h_q >= 1, got b=" +
                                                std::to_string(b) + " s_q=" + std::to_string(s_q) +
                                                " h_q=" + std::to_string(h_q));
  FLASHMLA_RETURN_IF_ERROR(check_plan_sizes("sparse decode plan", b, s_q, h_q));
  plan->num_splits_len = b + 1;
  plan->num_sm_parts = core::sparse_decode_num_sm_parts(num_sms(device), s_q, h_q);
  plan->workspace_bytes = 0;
  if (device.type == DeviceType::kCUDA) {
    FLASHMLA_RETURN_IF_ERROR(gpu_supported("flash_mla_with_kvcache (sparse)", device));
#ifdef FLASHMLA_WITH_CUDA
    SparseDecodeParams shapes;  // the sm90 sizing reads q's shape only
    shapes.q.ndim = 4;
    shapes.q.shape[0] = b;
    shapes.q.shape[1] = s_q;
    shapes.q.shape[2] = h_q;
    shapes.q.shape[3] = 576;
    plan->workspace_bytes = sm90::sparse_decode_workspace_bytes(shapes, plan->num_sm_parts);
#endif
  }
  return Status::Ok();
}

Status sparse_decode_plan(const SparseDecodeParams& p, DecodePlan* plan) {  // (null plan: *_plan_for_shapes)
  FLASHMLA_RETURN_IF_ERROR(core::validate_sparse_decode_inputs(p));
  return sparse_decode_plan_for_shapes(p.q.device, p.q.shape[0], p.q.shape[1], p.q.shape[2], plan);
}

Status sparse_decode_fwd(const SparseDecodeParams& p) {
  FLASHMLA_RETURN_IF_ERROR(core::validate_data(p));
  DecodePlan plan;
  FLASHMLA_RETURN_IF_ERROR(sparse_decode_plan(p, &plan));
  cpu_schedule_rows(p.q, p.tile_scheduler_metadata, p.metadata_ready, &plan);
  FLASHMLA_RETURN_IF_ERROR(core::validate_decode_outputs(p.q, p.out, p.lse, DType::kBFloat16,
                                                         p.tile_scheduler_metadata, p.num_splits, plan,
                                                         p.workspace_bytes, p.workspace));
  FLASHMLA_RETURN_IF_ERROR(core::validate_no_aliasing(p));
  // Metadata (when not ready) is computed on the device, on the op's stream.
  if (p.q.device.type != DeviceType::kCPU)
    return FLASHMLA_ON_GPU(sm90::sparse_decode(p, plan.num_sm_parts), "flash_mla_with_kvcache (sparse)", p.q.device);
  if (!p.metadata_ready) {
    // Per-request work of spec §4.2, in tokens.
    const int64_t b = p.q.shape[0], topk = p.indices.shape[2];
    const int64_t extra_topk = p.extra_k_cache.defined ? p.extra_indices_in_kvcache.shape[2] : 0;
    std::vector<int64_t> work(b);
    for (int64_t i = 0; i < b; ++i) {
      int64_t s = p.topk_length.defined ? i32(p.topk_length)[i] : topk;
      if (s == 0) s = 1;
      if (extra_topk != 0) {
        s = (s + 63) / 64 * 64 + (p.extra_topk_length.defined ? i32(p.extra_topk_length)[i] : extra_topk);
      }
      work[i] = s;
    }
    fill_host_schedule(work, core::kSparseDecodeSchedOverheadBlocks, p.tile_scheduler_metadata, p.num_splits);
  }
  return reference::sparse_decode(p);
}

// ------------------------------------------------------------------ sparse prefill
Status sparse_prefill_plan(const SparsePrefillParams& p, int64_t* workspace_bytes) {
  if (workspace_bytes == nullptr) return Status::Error(ErrorKind::kValue, "workspace_bytes: the pointer is null");
  FLASHMLA_RETURN_IF_ERROR(core::validate_sparse_prefill_inputs(p));
  *workspace_bytes = 0;
  if (p.q.device.type == DeviceType::kCUDA) FLASHMLA_RETURN_IF_ERROR(gpu_supported("flash_mla_sparse_fwd", p.q.device));
  return Status::Ok();
}

Status sparse_prefill_fwd(const SparsePrefillParams& p) {
  FLASHMLA_RETURN_IF_ERROR(core::validate_data(p));
  int64_t ws = 0;
  FLASHMLA_RETURN_IF_ERROR(sparse_prefill_plan(p, &ws));
  FLASHMLA_RETURN_IF_ERROR(core::validate_sparse_prefill_outputs(p));
  FLASHMLA_RETURN_IF_ERROR(core::validate_no_aliasing(p));
  if (p.q.device.type != DeviceType::kCPU)
    return FLASHMLA_ON_GPU(sm90::sparse_prefill(p), "flash_mla_sparse_fwd", p.q.device);
  return reference::sparse_prefill(p);
}

// ------------------------------------------------------------------ dense MHA prefill
Status dense_prefill_plan(const DensePrefillParams& p, int64_t* workspace_bytes) {
  if (workspace_bytes == nullptr) return Status::Error(ErrorKind::kValue, "workspace_bytes: the pointer is null");
  FLASHMLA_RETURN_IF_ERROR(core::validate_dense_prefill_inputs(p));
  *workspace_bytes = 0;
  if (p.q.device.type == DeviceType::kCUDA) {
    FLASHMLA_RETURN_IF_ERROR(gpu_supported("flash_attn_varlen_func", p.q.device));
#ifdef FLASHMLA_WITH_CUDA
    *workspace_bytes = sm90::dense_prefill_fwd_workspace_bytes(p);
#endif
  }
  return Status::Ok();
}

Status dense_prefill_fwd(const DensePrefillParams& p) {
  FLASHMLA_RETURN_IF_ERROR(core::validate_data(p));
  int64_t ws = 0;
  FLASHMLA_RETURN_IF_ERROR(dense_prefill_plan(p, &ws));
  FLASHMLA_RETURN_IF_ERROR(core::validate_dense_prefill_outputs(p, ws));
  FLASHMLA_RETURN_IF_ERROR(core::validate_no_aliasing(p));
  if (p.q.device.type != DeviceType::kCPU)
    return FLASHMLA_ON_GPU(sm90::dense_prefill_fwd(p), "flash_attn_varlen_func", p.q.device);
  return reference::dense_prefill_fwd(p);
}

Status dense_prefill_bwd_plan(const DensePrefillBwdParams& p, int64_t* workspace_bytes) {
  if (workspace_bytes == nullptr) return Status::Error(ErrorKind::kValue, "workspace_bytes: the pointer is null");
  FLASHMLA_RETURN_IF_ERROR(core::validate_dense_prefill_bwd_inputs(p));
  *workspace_bytes = 0;
  if (p.fwd.q.device.type == DeviceType::kCUDA) {
    FLASHMLA_RETURN_IF_ERROR(gpu_supported("flash_attn_varlen_func (backward)", p.fwd.q.device));
#ifdef FLASHMLA_WITH_CUDA
    *workspace_bytes = sm90::dense_prefill_bwd_workspace_bytes(p);
#endif
  }
  return Status::Ok();
}

Status dense_prefill_bwd(const DensePrefillBwdParams& p) {
  FLASHMLA_RETURN_IF_ERROR(core::validate_data(p));
  int64_t ws = 0;
  FLASHMLA_RETURN_IF_ERROR(dense_prefill_bwd_plan(p, &ws));
  FLASHMLA_RETURN_IF_ERROR(core::validate_dense_prefill_bwd_outputs(p, ws));
  FLASHMLA_RETURN_IF_ERROR(core::validate_no_aliasing(p));
  if (p.fwd.q.device.type != DeviceType::kCPU)
    return FLASHMLA_ON_GPU(sm90::dense_prefill_bwd(p), "flash_attn_varlen_func (backward)", p.fwd.q.device);
  return reference::dense_prefill_bwd(p);
}

// ------------------------------------------------------------------ FP8 conversion
Status quantize_kv_cache(KVFormat format, const TensorRef& kv_bf16, const TensorRef& packed) {
  FLASHMLA_RETURN_IF_ERROR(core::validate_kv_quant_args(format, kv_bf16, packed));
  FLASHMLA_RETURN_IF_ERROR(core::validate_kv_quant_data(kv_bf16, packed, /*packed_is_output=*/true));
  return reference::quantize_kv_cache(format, kv_bf16, packed);
}

Status dequantize_kv_cache(KVFormat format, const TensorRef& packed, const TensorRef& kv_bf16) {
  FLASHMLA_RETURN_IF_ERROR(core::validate_kv_quant_args(format, kv_bf16, packed));
  FLASHMLA_RETURN_IF_ERROR(core::validate_kv_quant_data(kv_bf16, packed, /*packed_is_output=*/false));
  return reference::dequantize_kv_cache(format, packed, kv_bf16);
}

}  // namespace flashmla
