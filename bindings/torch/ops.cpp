// PyTorch op library of flash_mla, built on PyTorch's stable ABI only.
//
// Registers `torch.ops.flash_mla.<op>` (schemas below) with CPU kernels (the
// reference backend) and, in CUDA builds, CUDA kernels (the sm90 backend), over
// the framework-free core (include/flashmla/ops.h). Everything torch-specific
// goes through torch/csrc/stable/* and torch/headeronly/* (the stable C shim:
// aoti_torch_* / torch_*), compiled with TORCH_TARGET_VERSION, so one binary
// loads under every torch >= the target. No CPython symbols are used at all:
// python/flash_mla/_torch_ops.py loads it with torch.ops.load_library.
//
// Outputs, scheduler metadata and workspace are allocated through torch (the
// caching allocator: CUDA-graph capture works); CUDA kernels run on torch's
// current stream of q's device, under a device guard for that device.
//
// Errors: the core's Status becomes a C++ exception carrying the message; its
// Python class is encoded as a "[flash_mla:<Class>] " prefix, because the
// stable ABI has no way to pick the Python exception class (every std::exception
// surfaces as RuntimeError). The Python layer re-raises with the right class.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "flashmla/flashmla.h"
#include "../common/op_params.h"

#include <dlfcn.h>

namespace {

using flashmla::DType;
using flashmla::Status;
using flashmla::TensorRef;
using torch::headeronly::ScalarType;
using Tensor = torch::stable::Tensor;
using OptTensor = std::optional<torch::stable::Tensor>;

[[noreturn]] void raise(const char* cls, const std::string& msg) {
  throw std::runtime_error(std::string("[flash_mla:") + cls + "] " + msg);
}

void check(const Status& st) {
  if (st.ok()) return;
  raise(flashmla::error_kind_name(st.kind), st.message);
}

/// A dtype as Python spells it (torch.float64 -> "float64").
std::string torch_dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Double: return "float64";
    case ScalarType::Bool: return "bool";
    case ScalarType::Short: return "int16";
    case ScalarType::ComplexFloat: return "complex64";
    case ScalarType::ComplexDouble: return "complex128";
    case ScalarType::ComplexHalf: return "complex32";
    case ScalarType::Float8_e5m2: return "float8_e5m2";
    case ScalarType::Float8_e4m3fnuz: return "float8_e4m3fnuz";
    case ScalarType::Float8_e5m2fnuz: return "float8_e5m2fnuz";
    case ScalarType::Float8_e8m0fnu: return "float8_e8m0fnu";
    case ScalarType::UInt16: return "uint16";
    case ScalarType::UInt32: return "uint32";
    case ScalarType::UInt64: return "uint64";
    default: return torch::headeronly::toString(t);
  }
}

DType to_dtype(ScalarType t, const char* name) {
  switch (t) {
    case ScalarType::BFloat16: return DType::kBFloat16;
    case ScalarType::Half: return DType::kFloat16;
    case ScalarType::Float: return DType::kFloat32;
    case ScalarType::Int: return DType::kInt32;
    case ScalarType::Long: return DType::kInt64;
    case ScalarType::Byte: return DType::kUInt8;
    case ScalarType::Char: return DType::kInt8;
    case ScalarType::Float8_e4m3fn: return DType::kFloat8E4M3;
    default: break;
  }
  raise("TypeError", std::string(name) + ": unsupported dtype " + torch_dtype_name(t) +
                         "; flash_mla takes bfloat16/float16 q and KV, int32 indices, lengths and block tables, "
                         "float32 attn_sink, and uint8/int8/float8_e4m3fn FP8 cache bytes");
}

/// torch tensor -> core TensorRef (data pointer already includes the storage offset).
TensorRef to_ref(const Tensor& t, const char* name) {
  TensorRef r;
  r.defined = true;
  r.dtype = to_dtype(t.scalar_type(), name);
  const int64_t ndim = t.dim();
  if (ndim > flashmla::kMaxTensorDims)
    raise("ValueError", std::string(name) + ": at most " + std::to_string(flashmla::kMaxTensorDims) +
                            " dimensions, got " + std::to_string(ndim));
  r.ndim = static_cast<int32_t>(ndim);
  // (one shim call each for the sizes and the strides, not one per dimension: this runs for every tensor
  // argument of every call)
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  int64_t numel = 1;
  for (int64_t i = 0; i < ndim; ++i) {
    r.shape[i] = sizes[i];
    r.stride[i] = strides[i];
    numel *= sizes[i];
  }
  r.data = numel == 0 ? nullptr : t.data_ptr();
  if (t.is_cpu()) {
    r.device = {flashmla::DeviceType::kCPU, 0};
  } else if (t.is_cuda()) {
    r.device = {flashmla::DeviceType::kCUDA, t.get_device_index()};
  } else {
    raise("ValueError", std::string(name) + ": unsupported device (expected a CPU or CUDA tensor)");
  }
  return r;
}

TensorRef to_ref(const OptTensor& t, const char* name) { return t.has_value() ? to_ref(*t, name) : TensorRef{}; }

/// Converter handed to bindings/common/op_params.h.
constexpr auto kRef = [](const auto& t, const char* name) { return to_ref(t, name); };

/// aoti_torch_dtype_* code of a core dtype (the stable C shim's dtype numbering).
int32_t shim_dtype(DType d) {
  switch (d) {
    case DType::kBFloat16: return aoti_torch_dtype_bfloat16();
    case DType::kFloat16: return aoti_torch_dtype_float16();
    case DType::kFloat32: return aoti_torch_dtype_float32();
    case DType::kInt32: return aoti_torch_dtype_int32();
    case DType::kInt64: return aoti_torch_dtype_int64();
    case DType::kUInt8: return aoti_torch_dtype_uint8();
    case DType::kInt8: return aoti_torch_dtype_int8();
    case DType::kFloat8E4M3: return aoti_torch_dtype_float8_e4m3fn();
  }
  return aoti_torch_dtype_float32();
}

/// New uninitialised contiguous tensor on `dev` (a core Device: CPU, or CUDA with its index),
/// through torch's caching allocator. Calls the stable C shim's aoti_torch_empty_strided
/// directly: torch::stable::new_empty goes through the boxed dispatcher (an operator lookup by
/// name and an IValue stack per call, ~2-3 µs each; an op allocates 4-5 tensors).
/// New uninitialised tensor of the given shape and element strides on `dev` (see alloc below).
Tensor alloc_strided(flashmla::Device dev, int64_t ndim, const int64_t* shape, const int64_t* stride, DType dtype) {
  int64_t step = 1;
  for (int64_t i = 0; i < ndim; ++i) step *= shape[i];
  const bool cuda = dev.type == flashmla::DeviceType::kCUDA;
  AtenTensorHandle h = nullptr;
  if (aoti_torch_empty_strided(ndim, shape, stride, shim_dtype(dtype),
                               cuda ? aoti_torch_device_type_cuda() : aoti_torch_device_type_cpu(),
                               cuda ? dev.id : 0, &h) != AOTI_TORCH_SUCCESS)
    raise("RuntimeError", "torch could not allocate an output tensor of " + std::to_string(step) + " elements");
  return Tensor(h);
}

Tensor alloc(flashmla::Device dev, std::initializer_list<int64_t> shape_il, DType dtype) {
  int64_t shape[flashmla::kMaxTensorDims], stride[flashmla::kMaxTensorDims];
  const int64_t ndim = static_cast<int64_t>(shape_il.size());
  int64_t i = 0;
  for (int64_t v : shape_il) shape[i++] = v;
  int64_t step = 1;
  for (i = ndim - 1; i >= 0; --i) {
    stride[i] = step;
    step *= shape[i] > 1 ? shape[i] : 1;
  }
  const bool cuda = dev.type == flashmla::DeviceType::kCUDA;
  AtenTensorHandle h = nullptr;
  if (aoti_torch_empty_strided(ndim, shape, stride, shim_dtype(dtype),
                               cuda ? aoti_torch_device_type_cuda() : aoti_torch_device_type_cpu(),
                               cuda ? dev.id : 0, &h) != AOTI_TORCH_SUCCESS)
    raise("RuntimeError", "torch could not allocate an output tensor of " + std::to_string(step) + " elements");
  return Tensor(h);
}

/// Sets the current device to q's for CUDA tensors (the kernels launch on the tensors' device even when
/// another one is current), no-op on the CPU.
struct MaybeDeviceGuard {
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  explicit MaybeDeviceGuard(const TensorRef& q) {
    if (q.device.type == flashmla::DeviceType::kCUDA) guard.emplace(q.device.id);
  }
};

/// aoti_torch_get_current_cuda_stream of the stable C shim. It lives in libtorch_cuda, which a
/// CPU-only torch lacks, so it is looked up in the already-loaded library instead of being linked:
/// the op library then loads under every torch build.
using GetStreamFn = int32_t (*)(int32_t, void**);
GetStreamFn get_current_cuda_stream_fn() {
  static const GetStreamFn fn = []() -> GetStreamFn {
    void* h = dlopen("libtorch_cuda.so", RTLD_LAZY | RTLD_NOLOAD);
    void* sym = h != nullptr ? dlsym(h, "aoti_torch_get_current_cuda_stream") : nullptr;
    if (sym == nullptr) sym = dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
    return reinterpret_cast<GetStreamFn>(sym);
  }();
  return fn;
}

void* stream_for(const TensorRef& q) {
  if (q.device.type != flashmla::DeviceType::kCUDA) return nullptr;
  const GetStreamFn get_stream = get_current_cuda_stream_fn();
  if (get_stream == nullptr)
    raise("RuntimeError", "this torch has no CUDA support (aoti_torch_get_current_cuda_stream not found)");
  void* s = nullptr;
  if (get_stream(q.device.id, &s) != 0)
    raise("RuntimeError", "cannot get the current CUDA stream of device " + std::to_string(q.device.id));
  return s;
}

using DecodeResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using ScheduledDecodeResult = std::tuple<Tensor, Tensor>;

/// Shared tail of the decode ops: plan, allocate, run. `tsm_in` / `num_splits_in`: the schedule an earlier
/// call computed (both or neither; validated by the core), or null. Without it the schedule is computed into
/// *tsm_out / *splits_out, allocated here, on the stream (for the caller to reuse). Returns (out, lse).
template <typename Params>
ScheduledDecodeResult run_decode(Params& p, DType out_dtype, const Tensor* tsm_in, const Tensor* num_splits_in,
                                 std::optional<Tensor>* tsm_out, std::optional<Tensor>* splits_out,
                                 Status (*plan_fn)(const Params&, flashmla::DecodePlan*),
                                 Status (*fwd_fn)(const Params&)) {
  MaybeDeviceGuard guard(p.q);
  flashmla::DecodePlan plan;
  check(plan_fn(p, &plan));
  const int64_t b = p.q.shape[0], s_q = p.q.shape[1], h_q = p.q.shape[2];
  Tensor out = alloc(p.q.device, {b, s_q, h_q, p.head_dim_v}, out_dtype);
  const int64_t lse_shape[3] = {b, h_q, s_q};
  const bool transposed = flashmla::bindings::decode_lse_transposed(p);
  const int64_t lse_stride[3] = {s_q * h_q, transposed ? 1 : s_q, transposed ? h_q : 1};
  Tensor lse = alloc_strided(p.q.device, 3, lse_shape, lse_stride, DType::kFloat32);
  if (tsm_in != nullptr) {
    // Validated by the core (shape / dtype / device) before the copy is read.
    p.tile_scheduler_metadata = to_ref(*tsm_in, "tile_scheduler_metadata");
    p.num_splits = to_ref(*num_splits_in, "num_splits");
    p.metadata_ready = true;
  } else {
    tsm_out->emplace(alloc(p.q.device, {plan.num_sm_parts, flashmla::kTileSchedulerMetadataWidth}, DType::kInt32));
    splits_out->emplace(alloc(p.q.device, {plan.num_splits_len}, DType::kInt32));
    p.tile_scheduler_metadata = to_ref(**tsm_out, "tile_scheduler_metadata");
    p.num_splits = to_ref(**splits_out, "num_splits");
    p.metadata_ready = false;
  }
  Tensor ws = alloc(p.q.device, {plan.workspace_bytes > 0 ? plan.workspace_bytes : 1}, DType::kUInt8);
  p.out = to_ref(out, "out");
  p.lse = to_ref(lse, "lse");
  p.workspace = ws.data_ptr();
  p.workspace_bytes = plan.workspace_bytes;
  p.stream = stream_for(p.q);
  check(fwd_fn(p));
  return {out, lse};
}

/// The ops that return the schedule: (out, lse, tile_scheduler_metadata, num_splits). Without given metadata the
/// last two are the schedule this call computed; with given metadata they are empty tensors of shapes (0, 8) and
/// (0,): the op's outputs never alias its inputs, and reusing a schedule costs neither an allocation of its size
/// nor a copy kernel. (The *_scheduled ops below return (out, lse) only: what a reusing caller needs.)
template <typename Params>
DecodeResult run_decode_returning_schedule(Params& p, DType out_dtype, const OptTensor& tsm_in,
                                           const OptTensor& num_splits_in,
                                           Status (*plan_fn)(const Params&, flashmla::DecodePlan*),
                                           Status (*fwd_fn)(const Params&)) {
  if (tsm_in.has_value() != num_splits_in.has_value())
    raise("ValueError", "tile_scheduler_metadata and num_splits must be given together");
  if (tsm_in.has_value()) {
    auto [out, lse] = run_decode(p, out_dtype, &*tsm_in, &*num_splits_in, nullptr, nullptr, plan_fn, fwd_fn);
    return {out, lse, alloc(p.q.device, {0, flashmla::kTileSchedulerMetadataWidth}, DType::kInt32),
            alloc(p.q.device, {0}, DType::kInt32)};
  }
  std::optional<Tensor> tsm, splits;
  auto [out, lse] = run_decode(p, out_dtype, nullptr, nullptr, &tsm, &splits, plan_fn, fwd_fn);
  return {out, lse, *tsm, *splits};
}

// ------------------------------------------------------------------ ops
DecodeResult dense_decode_fwd(Tensor q, Tensor k_cache, int64_t head_dim_v, Tensor cache_seqlens, Tensor block_table,
                              double softmax_scale, bool causal, OptTensor tile_scheduler_metadata,
                              OptTensor num_splits) {
  auto p = flashmla::bindings::dense_decode_params(kRef, q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                  softmax_scale, causal);
  return run_decode_returning_schedule(p, p.q.dtype, tile_scheduler_metadata, num_splits,
                                       flashmla::dense_decode_plan, flashmla::dense_decode_fwd);
}

/// dense_decode_fwd with the schedule of an earlier call (the reusing call of the Python layer): (out, lse).
ScheduledDecodeResult dense_decode_fwd_scheduled(Tensor q, Tensor k_cache, int64_t head_dim_v, Tensor cache_seqlens,
                                                 Tensor block_table, double softmax_scale, bool causal,
                                                 Tensor tile_scheduler_metadata, Tensor num_splits) {
  auto p = flashmla::bindings::dense_decode_params(kRef, q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                  softmax_scale, causal);
  return run_decode(p, p.q.dtype, &tile_scheduler_metadata, &num_splits, nullptr, nullptr,
                    flashmla::dense_decode_plan, flashmla::dense_decode_fwd);
}

DecodeResult sparse_decode_fwd(Tensor q, Tensor k_cache, Tensor indices, OptTensor topk_length, OptTensor attn_sink,
                               OptTensor tile_scheduler_metadata, OptTensor num_splits, OptTensor extra_k_cache,
                               OptTensor extra_indices_in_kvcache, OptTensor extra_topk_length, int64_t head_dim_v,
                               double softmax_scale) {
  auto p = flashmla::bindings::sparse_decode_params(kRef, q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                                   extra_indices_in_kvcache, extra_topk_length, head_dim_v,
                                                   softmax_scale);
  return run_decode_returning_schedule(p, DType::kBFloat16, tile_scheduler_metadata, num_splits,
                                       flashmla::sparse_decode_plan, flashmla::sparse_decode_fwd);
}

/// sparse_decode_fwd with the schedule of an earlier call: (out, lse).
ScheduledDecodeResult sparse_decode_fwd_scheduled(Tensor q, Tensor k_cache, Tensor indices, OptTensor topk_length,
                                                  OptTensor attn_sink, Tensor tile_scheduler_metadata,
                                                  Tensor num_splits, OptTensor extra_k_cache,
                                                  OptTensor extra_indices_in_kvcache, OptTensor extra_topk_length,
                                                  int64_t head_dim_v, double softmax_scale) {
  auto p = flashmla::bindings::sparse_decode_params(kRef, q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                                   extra_indices_in_kvcache, extra_topk_length, head_dim_v,
                                                   softmax_scale);
  return run_decode(p, DType::kBFloat16, &tile_scheduler_metadata, &num_splits, nullptr, nullptr,
                    flashmla::sparse_decode_plan, flashmla::sparse_decode_fwd);
}

std::tuple<Tensor, Tensor, Tensor> sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, double sm_scale,
                                                      int64_t d_v, OptTensor attn_sink, OptTensor topk_length) {
  auto p = flashmla::bindings::sparse_prefill_params(kRef, q, kv, indices, attn_sink, topk_length, sm_scale, d_v);
  MaybeDeviceGuard guard(p.q);
  int64_t ws_bytes = 0;
  check(flashmla::sparse_prefill_plan(p, &ws_bytes));
  const int64_t s_q = p.q.shape[0], h_q = p.q.shape[1];
  Tensor out = alloc(p.q.device, {s_q, h_q, d_v}, DType::kBFloat16);
  Tensor max_logits = alloc(p.q.device, {s_q, h_q}, DType::kFloat32);
  Tensor lse = alloc(p.q.device, {s_q, h_q}, DType::kFloat32);
  Tensor ws = alloc(p.q.device, {ws_bytes > 0 ? ws_bytes : 1}, DType::kUInt8);
  p.out = to_ref(out, "out");
  p.max_logits = to_ref(max_logits, "max_logits");
  p.lse = to_ref(lse, "lse");
  p.workspace = ws.data_ptr();
  p.workspace_bytes = ws_bytes;
  p.stream = stream_for(p.q);
  check(flashmla::sparse_prefill_fwd(p));
  return {out, max_logits, lse};
}

/// Dense MHA prefill forward -> (out (total_q, h_q, d_v), lse (total_q, h_q) float32 with FlashMLA's strides
/// (1, total_q)).
std::tuple<Tensor, Tensor> dense_prefill_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_qo, Tensor cu_seqlens_kv,
                                             int64_t max_seqlen_qo, int64_t max_seqlen_kv, double softmax_scale,
                                             bool causal) {
  auto p = flashmla::bindings::dense_prefill_params(kRef, q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo,
                                                   max_seqlen_kv, softmax_scale, causal);
  MaybeDeviceGuard guard(p.q);
  int64_t ws_bytes = 0;
  check(flashmla::dense_prefill_plan(p, &ws_bytes));
  const int64_t total_q = p.q.shape[0], h_q = p.q.shape[1], d_v = p.v.shape[2];
  Tensor out = alloc(p.q.device, {total_q, h_q, d_v}, p.q.dtype);
  const int64_t lse_shape[2] = {total_q, h_q}, lse_stride[2] = {1, total_q > 1 ? total_q : 1};
  Tensor lse = alloc_strided(p.q.device, 2, lse_shape, lse_stride, DType::kFloat32);
  Tensor ws = alloc(p.q.device, {ws_bytes > 0 ? ws_bytes : 1}, DType::kUInt8);
  p.out = to_ref(out, "out");
  p.lse = to_ref(lse, "lse");
  p.workspace = ws.data_ptr();
  p.workspace_bytes = ws_bytes;
  p.stream = stream_for(p.q);
  check(flashmla::dense_prefill_fwd(p));
  return {out, lse};
}

/// Dense MHA prefill backward -> (dq, dk, dv), shaped and typed like q, k, v.
std::tuple<Tensor, Tensor, Tensor> dense_prefill_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                     Tensor lse, Tensor cu_seqlens_qo, Tensor cu_seqlens_kv,
                                                     int64_t max_seqlen_qo, int64_t max_seqlen_kv, double softmax_scale,
                                                     bool causal) {
  auto p = flashmla::bindings::dense_prefill_bwd_params(kRef, dout, q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv,
                                                       max_seqlen_qo, max_seqlen_kv, softmax_scale, causal);
  MaybeDeviceGuard guard(p.fwd.q);
  int64_t ws_bytes = 0;
  check(flashmla::dense_prefill_bwd_plan(p, &ws_bytes));
  const TensorRef &qr = p.fwd.q, &kr = p.fwd.k, &vr = p.fwd.v;
  Tensor dq = alloc(qr.device, {qr.shape[0], qr.shape[1], qr.shape[2]}, qr.dtype);
  Tensor dk = alloc(qr.device, {kr.shape[0], kr.shape[1], kr.shape[2]}, qr.dtype);
  Tensor dv = alloc(qr.device, {vr.shape[0], vr.shape[1], vr.shape[2]}, qr.dtype);
  Tensor ws = alloc(qr.device, {ws_bytes > 0 ? ws_bytes : 1}, DType::kUInt8);
  p.dq = to_ref(dq, "dq");
  p.dk = to_ref(dk, "dk");
  p.dv = to_ref(dv, "dv");
  p.workspace = ws.data_ptr();
  p.workspace_bytes = ws_bytes;
  p.stream = stream_for(qr);
  check(flashmla::dense_prefill_bwd(p));
  return {dq, dk, dv};
}

flashmla::KVFormat to_format(int64_t format) {
  if (format != static_cast<int64_t>(flashmla::KVFormat::kFP8V32) &&
      format != static_cast<int64_t>(flashmla::KVFormat::kFP8Model1))
    raise("ValueError", "format: expected 2 (V32) or 3 (MODEL1), got " + std::to_string(format));
  return static_cast<flashmla::KVFormat>(format);
}

/// Writes the FP8 bytes of `kv_cache` (bf16) into `packed` (CPU tensors).
void quantize_kv_cache(Tensor kv_cache, Tensor packed, int64_t format) {
  check(flashmla::quantize_kv_cache(to_format(format), to_ref(kv_cache, "kv_cache"), to_ref(packed, "packed")));
}

/// Writes the bf16 values of `packed` into `kv_cache` (CPU tensors).
void dequantize_kv_cache(Tensor packed, Tensor kv_cache, int64_t format) {
  check(flashmla::dequantize_kv_cache(to_format(format), to_ref(packed, "packed"), to_ref(kv_cache, "kv_cache")));
}

}  // namespace

STABLE_TORCH_LIBRARY(flash_mla, m) {
  m.def(
      "dense_decode_fwd(Tensor q, Tensor k_cache, int head_dim_v, Tensor cache_seqlens, Tensor block_table, "
      "float softmax_scale, bool causal, Tensor? tile_scheduler_metadata=None, Tensor? num_splits=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "dense_decode_fwd_scheduled(Tensor q, Tensor k_cache, int head_dim_v, Tensor cache_seqlens, "
      "Tensor block_table, float softmax_scale, bool causal, Tensor tile_scheduler_metadata, Tensor num_splits) "
      "-> (Tensor, Tensor)");
  m.def(
      "sparse_decode_fwd(Tensor q, Tensor k_cache, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
      "Tensor? tile_scheduler_metadata, Tensor? num_splits, Tensor? extra_k_cache, Tensor? extra_indices_in_kvcache, "
      "Tensor? extra_topk_length, int head_dim_v, float softmax_scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "sparse_decode_fwd_scheduled(Tensor q, Tensor k_cache, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
      "Tensor tile_scheduler_metadata, Tensor num_splits, Tensor? extra_k_cache, Tensor? extra_indices_in_kvcache, "
      "Tensor? extra_topk_length, int head_dim_v, float softmax_scale) -> (Tensor, Tensor)");
  m.def(
      "sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v=512, Tensor? attn_sink=None, "
      "Tensor? topk_length=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "dense_prefill_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_qo, Tensor cu_seqlens_kv, int max_seqlen_qo, "
      "int max_seqlen_kv, float softmax_scale, bool causal) -> (Tensor, Tensor)");
  m.def(
      "dense_prefill_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_qo, "
      "Tensor cu_seqlens_kv, int max_seqlen_qo, int max_seqlen_kv, float softmax_scale, bool causal) "
      "-> (Tensor, Tensor, Tensor)");
  m.def("quantize_kv_cache(Tensor kv_cache, Tensor(a!) packed, int format) -> ()");
  m.def("dequantize_kv_cache(Tensor packed, Tensor(a!) kv_cache, int format) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(flash_mla, CPU, m) {
  m.impl("dense_decode_fwd", TORCH_BOX(&dense_decode_fwd));
  m.impl("dense_decode_fwd_scheduled", TORCH_BOX(&dense_decode_fwd_scheduled));
  m.impl("sparse_decode_fwd", TORCH_BOX(&sparse_decode_fwd));
  m.impl("sparse_decode_fwd_scheduled", TORCH_BOX(&sparse_decode_fwd_scheduled));
  m.impl("sparse_prefill_fwd", TORCH_BOX(&sparse_prefill_fwd));
  m.impl("dense_prefill_fwd", TORCH_BOX(&dense_prefill_fwd));
  m.impl("dense_prefill_bwd", TORCH_BOX(&dense_prefill_bwd));
  m.impl("quantize_kv_cache", TORCH_BOX(&quantize_kv_cache));
  m.impl("dequantize_kv_cache", TORCH_BOX(&dequantize_kv_cache));
}

#ifdef FLASHMLA_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(flash_mla, CUDA, m) {
  m.impl("dense_decode_fwd", TORCH_BOX(&dense_decode_fwd));
  m.impl("dense_decode_fwd_scheduled", TORCH_BOX(&dense_decode_fwd_scheduled));
  m.impl("sparse_decode_fwd", TORCH_BOX(&sparse_decode_fwd));
  m.impl("sparse_decode_fwd_scheduled", TORCH_BOX(&sparse_decode_fwd_scheduled));
  m.impl("sparse_prefill_fwd", TORCH_BOX(&sparse_prefill_fwd));
  m.impl("dense_prefill_fwd", TORCH_BOX(&dense_prefill_fwd));
  m.impl("dense_prefill_bwd", TORCH_BOX(&dense_prefill_bwd));
}
#endif
