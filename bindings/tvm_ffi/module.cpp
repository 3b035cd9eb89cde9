// TVM-FFI module of flash_mla: one shared library with no CPython or torch
// symbols. Any DLPack producer (PyTorch, JAX, CuPy, PaddlePaddle, NumPy) can
// call it; outputs are allocated with the caller framework's allocator when
// TVM-FFI provides one (torch), else with plain malloc / cudaMalloc, and are
// returned zero-copy through DLPack. The stream is TVM-FFI's env stream for
// the device of `q` (the framework's current stream for torch and Paddle;
// python/flash_mla/_ffi.py sets it for CuPy/JAX).
//
// Exported functions mirror FlashMLA's raw extension (spec §1.6):
//   dense_decode_fwd, sparse_decode_fwd, sparse_prefill_fwd, dense_prefill_fwd, dense_prefill_bwd,
// plus FP8 KV conversion helpers and backend queries, and destination-passing
// forms (*_dps, decode_scratch_bytes) that XLA custom calls use under jax.jit.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <string>

#include "flashmla/flashmla.h"
#include "../common/op_params.h"

#ifdef FLASHMLA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

namespace ffi = tvm::ffi;
using flashmla::DType;
using flashmla::Status;
using flashmla::TensorRef;

[[noreturn]] void throw_status(const Status& st) {
  switch (st.kind) {
    case flashmla::ErrorKind::kValue: TVM_FFI_THROW(ValueError) << st.message;
    case flashmla::ErrorKind::kType: TVM_FFI_THROW(TypeError) << st.message;
    case flashmla::ErrorKind::kNotImplemented: TVM_FFI_THROW(NotImplementedError) << st.message;
    default: TVM_FFI_THROW(RuntimeError) << st.message;
  }
  std::abort();  // unreachable
}

void check(const Status& st) {
  if (!st.ok()) throw_status(st);
}

// The dense prefill's arguments as the public function the caller called names them
// (python/flash_mla/flash_mla_interface.py: VARLEN_ARG_NAMES / QKVPACKED_ARG_NAMES, QKVPACKED_TENSOR_NAMES /
// KVPACKED_TENSOR_NAMES): the XLA custom calls' value errors surface when a jitted function runs, after the Python
// frame that renames them for eager calls (call_naming_seqlens). `names`: 0 the core's, which are
// flash_attn_varlen_func's (cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv; q, k, v), so 1 (that
// function's) keeps the message as it is; 2 the qkv-packed function's (one cu_seqlens / max_seqlen; q, k and v are
// slices of qkv), 3 the kv-packed function's (flash_attn_varlen_func's sequence names; k and v are slices of kv).
// Whole words only: the q of h_q and of total_q is left alone; "qkv / qkv" becomes "qkv", as in the Python frame.
std::string with_seqlen_names(const std::string& msg, int64_t names) {
  static const char* const kCore[4] = {"cu_seqlens_qo", "cu_seqlens_kv", "max_seqlen_qo", "max_seqlen_kv"};
  static const char* const kQkvPacked[4] = {"cu_seqlens", "cu_seqlens", "max_seqlen", "max_seqlen"};
  static const char* const kCoreTensors[3] = {"q", "k", "v"};
  static const char* const kQkvTensors[3] = {"qkv", "qkv", "qkv"};
  static const char* const kKvTensors[3] = {"q", "kv", "kv"};
  if (names < 2 || names > 3) return msg;
  auto word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  // Each whole word of `from` in `text` replaced by the same entry of `to`.
  auto rename = [&](const std::string& text, const char* const* from, const char* const* to, int n_words) {
    std::string r;
    for (size_t i = 0; i < text.size();) {
      bool replaced = false;
      if (i == 0 || !word_char(text[i - 1])) {
        for (int a = 0; a < n_words; ++a) {
          const size_t n = std::strlen(from[a]);
          if (text.compare(i, n, from[a]) == 0 && (i + n == text.size() || !word_char(text[i + n]))) {
            r += to[a];
            i += n;
            replaced = true;
            break;
          }
        }
      }
      if (!replaced) r += text[i++];
    }
    return r;
  };
  std::string r = names == 2 ? rename(msg, kCore, kQkvPacked, 4) : msg;
  r = rename(r, kCoreTensors, names == 2 ? kQkvTensors : kKvTensors, 3);
  const std::string twice = names == 2 ? "qkv / qkv" : "kv / kv";
  for (size_t at = r.find(twice); at != std::string::npos; at = r.find(twice, at + 1)) {
    const size_t end = at + twice.size();
    if ((at == 0 || !word_char(r[at - 1])) && (end == r.size() || !word_char(r[end])))
      r.replace(at, twice.size(), names == 2 ? "qkv" : "kv");
  }
  return r;
}

/// For the destination-passing forms (XLA custom calls): jax-tvm-ffi hands XLA the message only,
/// so the Python class travels as a "[flash_mla:<Class>] " prefix that python/flash_mla/_jax.py
/// turns back into that class (as the torch op library does). `seqlen_names`: see with_seqlen_names (0 for every
/// operator but the dense prefill's).
void check_tagged(const Status& st, int64_t seqlen_names = 0) {
  if (!st.ok())
    TVM_FFI_THROW(RuntimeError) << "[flash_mla:" << flashmla::error_kind_name(st.kind) << "] "
                                << with_seqlen_names(st.message, seqlen_names);
}

DType to_dtype(DLDataType t, const char* name) {
  if (t.lanes == 1) {
    if (t.code == kDLBfloat && t.bits == 16) return DType::kBFloat16;
    if (t.code == kDLFloat && t.bits == 16) return DType::kFloat16;
    if (t.code == kDLFloat && t.bits == 32) return DType::kFloat32;
    if (t.code == kDLInt && t.bits == 32) return DType::kInt32;
    if (t.code == kDLInt && t.bits == 64) return DType::kInt64;
    if (t.code == kDLUInt && t.bits == 8) return DType::kUInt8;
    if (t.code == kDLInt && t.bits == 8) return DType::kInt8;
    if (t.code == kDLFloat8_e4m3fn && t.bits == 8) return DType::kFloat8E4M3;
  }
  // Named as torch / ml_dtypes spell them (the torch op library's to_dtype names the same dtypes the same way,
  // so both ways in of a torch call raise the same message).
  static const char* kCodeNames[] = {"int", "uint", "float", "opaque_handle", "bfloat", "complex", "bool"};
  static const char* kFloat8Names[] = {"float8_e3m4",   "float8_e4m3",     "float8_e4m3b11fnuz", "float8_e4m3fn",
                                       "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",    "float8_e8m0fnu"};
  std::string given = t.code < 7 ? std::string(kCodeNames[t.code]) + std::to_string(t.bits)
                      : t.code >= kDLFloat8_e3m4 && t.code <= kDLFloat8_e8m0fnu && t.bits == 8
                          ? std::string(kFloat8Names[t.code - kDLFloat8_e3m4])
                          : "DLPack type code " + std::to_string(int(t.code)) + "/" + std::to_string(t.bits);
  if (t.code == kDLBfloat && t.bits == 16) given = "bfloat16";
  if (t.code == kDLBool) given = "bool";  // as torch and NumPy spell it (the torch op library says the same)
  if (t.lanes != 1) given += "x" + std::to_string(t.lanes);
  TVM_FFI_THROW(TypeError) << name << ": unsupported dtype " << given
                           << "; flash_mla takes bfloat16/float16 q and KV, int32 indices, lengths and block tables, "
                              "float32 attn_sink, and uint8/int8/float8_e4m3fn FP8 cache bytes";
}

DLDataType to_dl(DType d) {
  switch (d) {
    case DType::kBFloat16: return {kDLBfloat, 16, 1};
    case DType::kFloat16: return {kDLFloat, 16, 1};
    case DType::kFloat32: return {kDLFloat, 32, 1};
    case DType::kInt32: return {kDLInt, 32, 1};
    case DType::kInt64: return {kDLInt, 64, 1};
    case DType::kUInt8: return {kDLUInt, 8, 1};
    case DType::kInt8: return {kDLInt, 8, 1};
    case DType::kFloat8E4M3: return {kDLFloat8_e4m3fn, 8, 1};
  }
  return {kDLFloat, 32, 1};
}

/// DLPack view -> core TensorRef (byte_offset folded into the data pointer once, here).
TensorRef to_ref(const ffi::TensorView& t, const char* name) {
  TensorRef r;
  r.defined = true;
  r.dtype = to_dtype(t.dtype(), name);
  if (t.ndim() > flashmla::kMaxTensorDims)
    TVM_FFI_THROW(ValueError) << name << ": at most " << flashmla::kMaxTensorDims << " dimensions, got " << t.ndim();
  r.ndim = t.ndim();
  for (int i = 0; i < r.ndim; ++i) {
    r.shape[i] = t.size(i);
    r.stride[i] = t.stride(i);
  }
  r.data = t.data_ptr() == nullptr ? nullptr : static_cast<char*>(t.data_ptr()) + t.byte_offset();
  const DLDevice dev = t.device();
  if (dev.device_type == kDLCPU || dev.device_type == kDLCUDAHost) {
    r.device = {flashmla::DeviceType::kCPU, 0};
  } else if (dev.device_type == kDLCUDA) {
    r.device = {flashmla::DeviceType::kCUDA, dev.device_id};
  } else {
    TVM_FFI_THROW(ValueError) << name << ": unsupported device type " << int(dev.device_type)
                              << " (expected a CPU or CUDA tensor)";
  }
  return r;
}

TensorRef to_ref(const ffi::Optional<ffi::TensorView>& t, const char* name) {
  return t.has_value() ? to_ref(*t, name) : TensorRef{};
}

TensorRef to_ref(const ffi::Tensor& t, const char* name) { return to_ref(ffi::TensorView(t), name); }

/// Converter handed to bindings/common/op_params.h.
constexpr auto kRef = [](const auto& t, const char* name) { return to_ref(t, name); };

/// An always-passed destination-passing argument as an optional: absent unless `present`.
ffi::Optional<ffi::TensorView> if_present(const ffi::TensorView& t, bool present) {
  return present ? ffi::Optional<ffi::TensorView>(t) : ffi::Optional<ffi::TensorView>();
}

DLDevice to_dl(flashmla::Device d) {
  return d.type == flashmla::DeviceType::kCPU ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, d.id};
}

struct CPUAlloc {
  void AllocData(DLTensor* t) {
    size_t n = ffi::GetDataSize(*t);
    t->data = std::aligned_alloc(64, (n + 63) / 64 * 64 + 64);
    if (t->data == nullptr) TVM_FFI_THROW(RuntimeError) << "out of host memory allocating " << n << " bytes";
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

#ifdef FLASHMLA_WITH_CUDA
struct CUDAAlloc {
  void AllocData(DLTensor* t) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(t->device.device_id);
    size_t n = ffi::GetDataSize(*t);
    cudaError_t err = cudaMalloc(&t->data, n == 0 ? 16 : n);
    cudaSetDevice(prev);
    if (err != cudaSuccess) TVM_FFI_THROW(RuntimeError) << "cudaMalloc(" << n << ") failed: " << cudaGetErrorString(err);
  }
  void FreeData(DLTensor* t) {
    if (t->data) cudaFree(t->data);
  }
};
#endif

/// Allocate an output on `dev`, through the caller framework's allocator when available.
ffi::Tensor alloc(std::initializer_list<int64_t> shape_il, DType dtype, flashmla::Device dev) {
  ffi::Shape shape(shape_il);
  const DLDevice dl_dev = to_dl(dev);
  if (dev.type == flashmla::DeviceType::kCUDA && TVMFFIEnvGetDLPackManagedTensorAllocator() != nullptr) {
    return ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc, shape, to_dl(dtype), dl_dev);
  }
  if (dev.type == flashmla::DeviceType::kCPU) return ffi::Tensor::FromNDAlloc(CPUAlloc(), shape, to_dl(dtype), dl_dev);
#ifdef FLASHMLA_WITH_CUDA
  return ffi::Tensor::FromNDAlloc(CUDAAlloc(), shape, to_dl(dtype), dl_dev);
#else
  TVM_FFI_THROW(NotImplementedError) << "this build of flash_mla has no CUDA backend";
#endif
}

void* stream_for(const TensorRef& q) {
  if (q.device.type != flashmla::DeviceType::kCUDA) return nullptr;
  return TVMFFIEnvGetStream(kDLCUDA, q.device.id);
}

/// Scheduler metadata: reuse the caller's tensors, or allocate fresh ones to be filled.
struct Metadata {
  ffi::Tensor tsm, num_splits;
  bool ready = false;
};
Metadata metadata_for(const ffi::Optional<ffi::Tensor>& tsm, const ffi::Optional<ffi::Tensor>& num_splits,
                      const flashmla::DecodePlan& plan, flashmla::Device dev) {
  Metadata m;
  if (tsm.has_value() != num_splits.has_value())
    TVM_FFI_THROW(ValueError) << "tile_scheduler_metadata and num_splits must be given together";
  if (tsm.has_value()) {
    m.tsm = *tsm;
    m.num_splits = *num_splits;
    m.ready = true;
  } else {
    m.tsm = alloc({plan.num_sm_parts, flashmla::kTileSchedulerMetadataWidth}, DType::kInt32, dev);
    m.num_splits = alloc({plan.num_splits_len}, DType::kInt32, dev);
  }
  return m;
}

ffi::Tensor workspace_for(int64_t bytes, flashmla::Device dev) {
  return alloc({bytes > 0 ? bytes : 1}, DType::kUInt8, dev);
}

/// Shared tail of both decode entry points: plan, allocate outputs / metadata /
/// workspace on q's device, run. Returns [out, lse, tile_scheduler_metadata, num_splits].
template <typename Params>
ffi::Array<ffi::Tensor> run_decode(Params& p, DType out_dtype, const ffi::Optional<ffi::Tensor>& tsm_in,
                                   const ffi::Optional<ffi::Tensor>& num_splits_in,
                                   Status (*plan_fn)(const Params&, flashmla::DecodePlan*),
                                   Status (*fwd_fn)(const Params&)) {
  flashmla::DecodePlan plan;
  check(plan_fn(p, &plan));
  const auto dev = p.q.device;
  const int64_t b = p.q.shape[0], s_q = p.q.shape[1], h_q = p.q.shape[2];
  ffi::Tensor out = alloc({b, s_q, h_q, p.head_dim_v}, out_dtype, dev);
  // (a transposed lse: a (b, s_q, h_q) buffer and its (b, h_q, s_q) view, which keeps the buffer alive)
  ffi::Tensor lse = flashmla::bindings::decode_lse_transposed(p)
                        ? alloc({b, s_q, h_q}, DType::kFloat32, dev).as_strided({b, h_q, s_q}, {s_q * h_q, 1, h_q})
                        : alloc({b, h_q, s_q}, DType::kFloat32, dev);
  Metadata m = metadata_for(tsm_in, num_splits_in, plan, dev);
  ffi::Tensor ws = workspace_for(plan.workspace_bytes, dev);
  p.out = to_ref(out, "out");
  p.lse = to_ref(lse, "lse");
  p.tile_scheduler_metadata = to_ref(m.tsm, "tile_scheduler_metadata");
  p.num_splits = to_ref(m.num_splits, "num_splits");
  p.metadata_ready = m.ready;
  p.workspace = ws.data_ptr();
  p.workspace_bytes = plan.workspace_bytes;
  p.stream = stream_for(p.q);
  check(fwd_fn(p));
  return ffi::Array<ffi::Tensor>{out, lse, m.tsm, m.num_splits};
}

// ------------------------------------------------------------------ ops
ffi::Array<ffi::Tensor> dense_decode_fwd(ffi::TensorView q, ffi::TensorView k_cache, int64_t head_dim_v,
                                         ffi::TensorView cache_seqlens, ffi::TensorView block_table,
                                         double softmax_scale, bool causal,
                                         ffi::Optional<ffi::Tensor> tile_scheduler_metadata,
                                         ffi::Optional<ffi::Tensor> num_splits) {
  auto p = flashmla::bindings::dense_decode_params(kRef, q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                  softmax_scale, causal);
  return run_decode(p, p.q.dtype, tile_scheduler_metadata, num_splits, flashmla::dense_decode_plan,
                    flashmla::dense_decode_fwd);
}

ffi::Array<ffi::Tensor> sparse_decode_fwd(ffi::TensorView q, ffi::TensorView k_cache, ffi::TensorView indices,
                                          ffi::Optional<ffi::TensorView> topk_length,
                                          ffi::Optional<ffi::TensorView> attn_sink,
                                          ffi::Optional<ffi::Tensor> tile_scheduler_metadata,
                                          ffi::Optional<ffi::Tensor> num_splits,
                                          ffi::Optional<ffi::TensorView> extra_k_cache,
                                          ffi::Optional<ffi::TensorView> extra_indices_in_kvcache,
                                          ffi::Optional<ffi::TensorView> extra_topk_length, int64_t head_dim_v,
                                          double softmax_scale) {
  auto p = flashmla::bindings::sparse_decode_params(kRef, q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                                   extra_indices_in_kvcache, extra_topk_length, head_dim_v,
                                                   softmax_scale);
  return run_decode(p, DType::kBFloat16, tile_scheduler_metadata, num_splits, flashmla::sparse_decode_plan,
                    flashmla::sparse_decode_fwd);
}

ffi::Array<ffi::Tensor> sparse_prefill_fwd(ffi::TensorView q, ffi::TensorView kv, ffi::TensorView indices,
                                           double sm_scale, int64_t d_v, ffi::Optional<ffi::TensorView> attn_sink,
                                           ffi::Optional<ffi::TensorView> topk_length) {
  auto p = flashmla::bindings::sparse_prefill_params(kRef, q, kv, indices, attn_sink, topk_length, sm_scale, d_v);
  int64_t ws_bytes = 0;
  check(flashmla::sparse_prefill_plan(p, &ws_bytes));
  const auto dev = p.q.device;
  const int64_t s_q = p.q.shape[0], h_q = p.q.shape[1];
  ffi::Tensor out = alloc({s_q, h_q, d_v}, DType::kBFloat16, dev);
  ffi::Tensor max_logits = alloc({s_q, h_q}, DType::kFloat32, dev);
  ffi::Tensor lse = alloc({s_q, h_q}, DType::kFloat32, dev);
  ffi::Tensor ws = workspace_for(ws_bytes, dev);
  p.out = to_ref(out, "out");
  p.max_logits = to_ref(max_logits, "max_logits");
  p.lse = to_ref(lse, "lse");
  p.workspace = ws.data_ptr();
  p.workspace_bytes = ws_bytes;
  p.stream = stream_for(p.q);
  check(flashmla::sparse_prefill_fwd(p));
  return ffi::Array<ffi::Tensor>{out, max_logits, lse};
}

// Dense MHA prefill. lse is kept as FlashMLA allocates it: a (h_q, total_q) buffer whose transpose is
// the (total_q, h_q) lse with strides (1, total_q); these functions take and return that buffer
// (`lse_t`), the Python layer hands out its transpose.
TensorRef transposed(TensorRef t) {
  std::swap(t.shape[0], t.shape[1]);
  std::swap(t.stride[0], t.stride[1]);
  return t;
}

ffi::Array<ffi::Tensor> dense_prefill_fwd(ffi::TensorView q, ffi::TensorView k, ffi::TensorView v,
                                          ffi::TensorView cu_seqlens_qo, ffi::TensorView cu_seqlens_kv,
                                          int64_t max_seqlen_qo, int64_t max_seqlen_kv, double softmax_scale,
                                          bool causal) {
  auto p = flashmla::bindings::dense_prefill_params(kRef, q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo,
                                                   max_seqlen_kv, softmax_scale, causal);
  int64_t ws_bytes = 0;
  check(flashmla::dense_prefill_plan(p, &ws_bytes));
  const auto dev = p.q.device;
  const int64_t total_q = p.q.shape[0], h_q = p.q.shape[1], d_v = p.v.shape[2];
  ffi::Tensor out = alloc({total_q, h_q, d_v}, p.q.dtype, dev);
  ffi::Tensor lse_t = alloc({h_q, total_q}, DType::kFloat32, dev);
  ffi::Tensor ws = workspace_for(ws_bytes, dev);
  p.out = to_ref(out, "out");
  p.lse = transposed(to_ref(lse_t, "lse"));
  p.workspace = ws.data_ptr();
  p.workspace_bytes = ws_bytes;
  p.stream = stream_for(p.q);
  check(flashmla::dense_prefill_fwd(p));
  return ffi::Array<ffi::Tensor>{out, lse_t};
}

/// `lse` is the forward's (total_q, h_q) lse (any strides, e.g. the transpose of lse_t).
ffi::Array<ffi::Tensor> dense_prefill_bwd(ffi::TensorView dout, ffi::TensorView q, ffi::TensorView k,
                                          ffi::TensorView v, ffi::TensorView out, ffi::TensorView lse,
                                          ffi::TensorView cu_seqlens_qo, ffi::TensorView cu_seqlens_kv,
                                          int64_t max_seqlen_qo, int64_t max_seqlen_kv, double softmax_scale,
                                          bool causal) {
  auto p = flashmla::bindings::dense_prefill_bwd_params(kRef, dout, q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv,
                                                       max_seqlen_qo, max_seqlen_kv, softmax_scale, causal);
  int64_t ws_bytes = 0;
  check(flashmla::dense_prefill_bwd_plan(p, &ws_bytes));
  const auto dev = p.fwd.q.device;
  const TensorRef &qr = p.fwd.q, &kr = p.fwd.k, &vr = p.fwd.v;
  ffi::Tensor dq = alloc({qr.shape[0], qr.shape[1], qr.shape[2]}, qr.dtype, dev);
  ffi::Tensor dk = alloc({kr.shape[0], kr.shape[1], kr.shape[2]}, qr.dtype, dev);
  ffi::Tensor dv = alloc({vr.shape[0], vr.shape[1], vr.shape[2]}, qr.dtype, dev);
  ffi::Tensor ws = workspace_for(ws_bytes, dev);
  p.dq = to_ref(dq, "dq");
  p.dk = to_ref(dk, "dk");
  p.dv = to_ref(dv, "dv");
  p.workspace = ws.data_ptr();
  p.workspace_bytes = ws_bytes;
  p.stream = stream_for(p.fwd.q);
  check(flashmla::dense_prefill_bwd(p));
  return ffi::Array<ffi::Tensor>{dq, dk, dv};
}

// ------------------------------------------------------------------ destination-passing forms
// For XLA custom calls (jax.jit through jax-tvm-ffi): the caller preallocates every
// result. Decode calls also get one `scratch` byte buffer of at least
// decode_scratch_bytes(...) bytes, carved here into the scheduler metadata and the
// split-KV workspace. (Under jax.jit the platform is chosen after the shapes are
// fixed, so the caller sizes scratch for every platform it may run on.) The split
// schedule is always recomputed, on the env stream XLA provides. Argument order:
// inputs, then attributes, then results. Optional inputs are always passed (any
// placeholder when absent) and `present` says which are real: bit 0 topk_length,
// 1 attn_sink, 2 extra_k_cache + extra_indices_in_kvcache, 3 extra_topk_length
// (sparse decode); bit 0 attn_sink, 1 topk_length (sparse prefill).

constexpr int64_t kScratchAlign = 256;
int64_t scratch_align(int64_t x) { return (x + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

flashmla::DecodePlan plan_for_shapes(bool sparse, flashmla::Device dev, int64_t b, int64_t s_q, int64_t h_q,
                                     int64_t h_kv) {
  flashmla::DecodePlan plan;
  check(sparse ? flashmla::sparse_decode_plan_for_shapes(dev, b, s_q, h_q, &plan)
               : flashmla::dense_decode_plan_for_shapes(dev, b, s_q, h_q, h_kv, &plan));
  return plan;
}

int64_t scratch_bytes(const flashmla::DecodePlan& plan) {
  return scratch_align(plan.num_sm_parts * flashmla::kTileSchedulerMetadataWidth * 4) +
         scratch_align(plan.num_splits_len * 4) + scratch_align(plan.workspace_bytes);
}

/// Bytes of `scratch` a destination-passing decode call of these shapes needs on the device
/// (device_type 1 = CPU, 2 = CUDA; sparse != 0: sparse decode, h_kv ignored).
int64_t decode_scratch_bytes(bool sparse, int64_t device_type, int64_t device_id, int64_t b, int64_t s_q,
                             int64_t h_q, int64_t h_kv) {
  if (device_type != kDLCPU && device_type != kDLCUDA)
    TVM_FFI_THROW(ValueError) << "device_type: expected 1 (CPU) or 2 (CUDA), got " << device_type;
  flashmla::Device dev{device_type == kDLCUDA ? flashmla::DeviceType::kCUDA : flashmla::DeviceType::kCPU,
                       static_cast<int>(device_id)};
  return scratch_bytes(plan_for_shapes(sparse, dev, b, s_q, h_q, h_kv));
}

template <typename Params>
void bind_decode_results(Params& p, bool sparse, int64_t h_kv, ffi::TensorView out, ffi::TensorView lse,
                         ffi::TensorView scratch) {
  p.out = to_ref(out, "out");
  p.lse = to_ref(lse, "lse");
  const int64_t b = p.q.shape[0];
  const flashmla::DecodePlan plan = plan_for_shapes(sparse, p.q.device, b, p.q.shape[1], p.q.shape[2], h_kv);
  TensorRef s = to_ref(scratch, "scratch");
  if (s.ndim != 1 || s.shape[0] < scratch_bytes(plan) || s.device != p.q.device)
    TVM_FFI_THROW(ValueError) << "scratch: expected a 1-D byte buffer of at least " << scratch_bytes(plan)
                              << " bytes on the device of q, got " << (s.ndim == 1 ? s.shape[0] : -1) << " bytes";
  char* base = static_cast<char*>(s.data);
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0)
    TVM_FFI_THROW(ValueError) << "scratch: the buffer must be 16-byte aligned";
  const int64_t tsm_bytes = scratch_align(plan.num_sm_parts * flashmla::kTileSchedulerMetadataWidth * 4);
  const int64_t splits_bytes = scratch_align(plan.num_splits_len * 4);
  p.tile_scheduler_metadata = flashmla::make_tensor_ref(base, DType::kInt32,
                                                        {plan.num_sm_parts, flashmla::kTileSchedulerMetadataWidth},
                                                        p.q.device);
  p.num_splits = flashmla::make_tensor_ref(base + tsm_bytes, DType::kInt32, {plan.num_splits_len}, p.q.device);
  p.metadata_ready = false;
  p.workspace = plan.workspace_bytes > 0 ? base + tsm_bytes + splits_bytes : nullptr;
  p.workspace_bytes = plan.workspace_bytes;
  p.stream = stream_for(p.q);
}

void dense_decode_fwd_dps(ffi::TensorView q, ffi::TensorView k_cache, ffi::TensorView block_table,
                          ffi::TensorView cache_seqlens, int64_t head_dim_v, double softmax_scale, bool causal,
                          ffi::TensorView out, ffi::TensorView lse, ffi::TensorView scratch) {
  auto p = flashmla::bindings::dense_decode_params(kRef, q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                  softmax_scale, causal);
  flashmla::DecodePlan checked;
  check_tagged(flashmla::dense_decode_plan(p, &checked));  // validates the inputs before scratch is carved
  bind_decode_results(p, false, p.k_cache.shape[2], out, lse, scratch);
  check_tagged(flashmla::dense_decode_fwd(p));
}

void sparse_decode_fwd_dps(ffi::TensorView q, ffi::TensorView k_cache, ffi::TensorView indices,
                           ffi::TensorView topk_length, ffi::TensorView attn_sink, ffi::TensorView extra_k_cache,
                           ffi::TensorView extra_indices_in_kvcache, ffi::TensorView extra_topk_length,
                           int64_t head_dim_v, double softmax_scale, int64_t present, ffi::TensorView out,
                           ffi::TensorView lse, ffi::TensorView scratch) {
  auto p = flashmla::bindings::sparse_decode_params(
      kRef, q, k_cache, indices, if_present(topk_length, present & 1), if_present(attn_sink, present & 2),
      if_present(extra_k_cache, present & 4), if_present(extra_indices_in_kvcache, present & 4),
      if_present(extra_topk_length, present & 8), head_dim_v, softmax_scale);
  flashmla::DecodePlan checked;
  check_tagged(flashmla::sparse_decode_plan(p, &checked));
  bind_decode_results(p, true, 1, out, lse, scratch);
  check_tagged(flashmla::sparse_decode_fwd(p));
}

void sparse_prefill_fwd_dps(ffi::TensorView q, ffi::TensorView kv, ffi::TensorView indices,
                            ffi::TensorView attn_sink, ffi::TensorView topk_length, double sm_scale, int64_t d_v,
                            int64_t present, ffi::TensorView out, ffi::TensorView max_logits, ffi::TensorView lse) {
  auto p = flashmla::bindings::sparse_prefill_params(kRef, q, kv, indices, if_present(attn_sink, present & 1),
                                                    if_present(topk_length, present & 2), sm_scale, d_v);
  int64_t ws_bytes = 0;
  check_tagged(flashmla::sparse_prefill_plan(p, &ws_bytes));
  if (ws_bytes != 0)
    TVM_FFI_THROW(RuntimeError) << "sparse_prefill_fwd_dps: this build needs a " << ws_bytes
                                << "-byte workspace, which the destination-passing form does not take";
  p.out = to_ref(out, "out");
  p.max_logits = to_ref(max_logits, "max_logits");
  p.lse = to_ref(lse, "lse");
  p.stream = stream_for(p.q);
  check_tagged(flashmla::sparse_prefill_fwd(p));
}

/// The workspace as the core wants it: `workspace` is a 1-D byte buffer of at least `needed` bytes.
void bind_workspace(const ffi::TensorView& workspace, int64_t needed, flashmla::Device dev, void** ptr,
                    int64_t* bytes) {
  TensorRef w = to_ref(workspace, "workspace");
  if (w.ndim != 1 || w.shape[0] < needed || w.device != dev)
    TVM_FFI_THROW(ValueError) << "workspace: expected a 1-D byte buffer of at least " << needed
                              << " bytes on the device of q, got " << (w.ndim == 1 ? w.shape[0] : -1) << " bytes";
  *ptr = needed > 0 ? w.data : nullptr;
  *bytes = needed;
}

/// Dense MHA prefill forward into XLA's buffers: out (total_q, h_q, d_v), lse_t (h_q, total_q) float32,
/// workspace (>= dense_prefill_check(...) bytes). `seqlen_names`: the names its value errors give the packed-sequence
/// arguments (with_seqlen_names).
void dense_prefill_fwd_dps(ffi::TensorView q, ffi::TensorView k, ffi::TensorView v, ffi::TensorView cu_seqlens_qo,
                           ffi::TensorView cu_seqlens_kv, int64_t max_seqlen_qo, int64_t max_seqlen_kv,
                           double softmax_scale, bool causal, int64_t seqlen_names, ffi::TensorView out,
                           ffi::TensorView lse_t, ffi::TensorView workspace) {
  auto p = flashmla::bindings::dense_prefill_params(kRef, q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo,
                                                   max_seqlen_kv, softmax_scale, causal);
  int64_t ws_bytes = 0;
  check_tagged(flashmla::dense_prefill_plan(p, &ws_bytes), seqlen_names);
  p.out = to_ref(out, "out");
  p.lse = transposed(to_ref(lse_t, "lse"));
  bind_workspace(workspace, ws_bytes, p.q.device, &p.workspace, &p.workspace_bytes);
  p.stream = stream_for(p.q);
  check_tagged(flashmla::dense_prefill_fwd(p), seqlen_names);
}

/// Dense MHA prefill backward into XLA's buffers; `lse_t` is the forward's (h_q, total_q) buffer.
void dense_prefill_bwd_dps(ffi::TensorView dout, ffi::TensorView q, ffi::TensorView k, ffi::TensorView v,
                           ffi::TensorView out, ffi::TensorView lse_t, ffi::TensorView cu_seqlens_qo,
                           ffi::TensorView cu_seqlens_kv, int64_t max_seqlen_qo, int64_t max_seqlen_kv,
                           double softmax_scale, bool causal, int64_t seqlen_names, ffi::TensorView dq,
                           ffi::TensorView dk, ffi::TensorView dv, ffi::TensorView workspace) {
  auto ref = [](const ffi::TensorView& t, const char* name) {
    return std::strcmp(name, "lse") == 0 ? transposed(to_ref(t, name)) : to_ref(t, name);
  };
  auto p = flashmla::bindings::dense_prefill_bwd_params(ref, dout, q, k, v, out, lse_t, cu_seqlens_qo, cu_seqlens_kv,
                                                       max_seqlen_qo, max_seqlen_kv, softmax_scale, causal);
  int64_t ws_bytes = 0;
  check_tagged(flashmla::dense_prefill_bwd_plan(p, &ws_bytes), seqlen_names);
  p.dq = to_ref(dq, "dq");
  p.dk = to_ref(dk, "dk");
  p.dv = to_ref(dv, "dv");
  bind_workspace(workspace, ws_bytes, p.fwd.q.device, &p.workspace, &p.workspace_bytes);
  p.stream = stream_for(p.fwd.q);
  check_tagged(flashmla::dense_prefill_bwd(p), seqlen_names);
}

// ------------------------------------------------------------------ shape/dtype checks without data
// The XLA path (python/flash_mla/_jax.py) runs these while tracing, where only shapes and dtypes
// exist, so that a bad shape or dtype raises the same Python class and message as on the other
// paths, also under jax.jit. Each tensor is (shape, dtype name); an empty dtype name = absent.
// The refs have row-major strides and no data (the core then skips its value checks).
TensorRef abstract_ref(const ffi::Array<ffi::Array<int64_t>>& shapes, const ffi::Array<ffi::String>& dtypes,
                       size_t i, const char* name) {
  if (i >= shapes.size() || i >= dtypes.size())
    TVM_FFI_THROW(ValueError) << "internal: no shape/dtype given for " << name;
  if (dtypes[i].empty()) return TensorRef{};
  TensorRef r;
  r.defined = true;
  r.dtype = to_dtype(ffi::StringToDLDataType(dtypes[i]), name);
  const ffi::Array<int64_t> shape = shapes[i];
  if (static_cast<int64_t>(shape.size()) > flashmla::kMaxTensorDims)
    TVM_FFI_THROW(ValueError) << name << ": at most " << flashmla::kMaxTensorDims << " dimensions, got "
                              << shape.size();
  r.ndim = static_cast<int32_t>(shape.size());
  int64_t stride = 1;
  for (int d = r.ndim - 1; d >= 0; --d) {
    r.shape[d] = shape[d];
    r.stride[d] = stride;
    stride *= shape[d] > 1 ? shape[d] : 1;
  }
  r.data = nullptr;
  r.device = {flashmla::DeviceType::kCPU, 0};
  return r;
}

/// Tensors: q, k_cache, block_table, cache_seqlens.
void dense_decode_check(ffi::Array<ffi::Array<int64_t>> shapes, ffi::Array<ffi::String> dtypes, int64_t head_dim_v,
                        double softmax_scale, bool causal) {
  auto ref = [&](int i, const char* name) { return abstract_ref(shapes, dtypes, i, name); };
  auto p = flashmla::bindings::dense_decode_params(ref, 0, 1, 2, 3, head_dim_v, softmax_scale, causal);
  flashmla::DecodePlan plan;
  check(flashmla::dense_decode_plan(p, &plan));
}

/// Tensors: q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache, extra_topk_length.
void sparse_decode_check(ffi::Array<ffi::Array<int64_t>> shapes, ffi::Array<ffi::String> dtypes, int64_t head_dim_v,
                         double softmax_scale) {
  auto ref = [&](int i, const char* name) { return abstract_ref(shapes, dtypes, i, name); };
  auto p = flashmla::bindings::sparse_decode_params(ref, 0, 1, 2, 3, 4, 5, 6, 7, head_dim_v, softmax_scale);
  flashmla::DecodePlan plan;
  check(flashmla::sparse_decode_plan(p, &plan));
}

/// Tensors: q, kv, indices, attn_sink, topk_length.
void sparse_prefill_check(ffi::Array<ffi::Array<int64_t>> shapes, ffi::Array<ffi::String> dtypes, double sm_scale,
                          int64_t d_v) {
  auto ref = [&](int i, const char* name) { return abstract_ref(shapes, dtypes, i, name); };
  auto p = flashmla::bindings::sparse_prefill_params(ref, 0, 1, 2, 3, 4, sm_scale, d_v);
  int64_t ws_bytes = 0;
  check(flashmla::sparse_prefill_plan(p, &ws_bytes));
}

/// Dense MHA prefill, shapes and dtypes only, as placed on a device (device_type 1 = CPU, 2 = CUDA):
/// raises what the operator would, else returns the workspace bytes it needs there. Tensors: forward
/// (bwd == false) q, k, v, cu_seqlens_qo, cu_seqlens_kv; backward dout, q, k, v, out, lse (total_q, h_q),
/// cu_seqlens_qo, cu_seqlens_kv.
int64_t dense_prefill_check(bool bwd, int64_t device_type, int64_t device_id, ffi::Array<ffi::Array<int64_t>> shapes,
                            ffi::Array<ffi::String> dtypes, int64_t max_seqlen_qo, int64_t max_seqlen_kv,
                            double softmax_scale, bool causal) {
  if (device_type != kDLCPU && device_type != kDLCUDA)
    TVM_FFI_THROW(ValueError) << "device_type: expected 1 (CPU) or 2 (CUDA), got " << device_type;
  const flashmla::Device dev{device_type == kDLCUDA ? flashmla::DeviceType::kCUDA : flashmla::DeviceType::kCPU,
                             static_cast<int>(device_id)};
  auto ref = [&](int i, const char* name) {
    TensorRef r = abstract_ref(shapes, dtypes, i, name);
    r.device = dev;
    return r;
  };
  int64_t ws_bytes = 0;
  if (bwd) {
    auto p = flashmla::bindings::dense_prefill_bwd_params(ref, 0, 1, 2, 3, 4, 5, 6, 7, max_seqlen_qo, max_seqlen_kv,
                                                         softmax_scale, causal);
    check(flashmla::dense_prefill_bwd_plan(p, &ws_bytes));
  } else {
    auto p = flashmla::bindings::dense_prefill_params(ref, 0, 1, 2, 3, 4, max_seqlen_qo, max_seqlen_kv, softmax_scale,
                                                     causal);
    check(flashmla::dense_prefill_plan(p, &ws_bytes));
  }
  return ws_bytes;
}

flashmla::KVFormat to_format(int64_t format) {
  if (format != static_cast<int64_t>(flashmla::KVFormat::kFP8V32) &&
      format != static_cast<int64_t>(flashmla::KVFormat::kFP8Model1))
    TVM_FFI_THROW(ValueError) << "format: expected 2 (V32) or 3 (MODEL1), got " << format;
  return static_cast<flashmla::KVFormat>(format);
}

/// Writes the FP8 bytes of `kv_bf16` into the caller's `packed` buffer (CPU).
void quantize_kv_cache(ffi::TensorView kv_bf16, ffi::TensorView packed, int64_t format) {
  check(flashmla::quantize_kv_cache(to_format(format), to_ref(kv_bf16, "kv_cache"), to_ref(packed, "packed")));
}

/// Writes the bf16 values of `packed` into the caller's `kv_bf16` buffer (CPU).
void dequantize_kv_cache(ffi::TensorView packed, ffi::TensorView kv_bf16, int64_t format) {
  check(flashmla::dequantize_kv_cache(to_format(format), to_ref(packed, "packed"), to_ref(kv_bf16, "kv_cache")));
}

/// Holds a source tensor alive and exposes its memory under another dtype of the same size.
struct ViewAlloc {
  ffi::Tensor source;
  void AllocData(DLTensor* t) {
    t->data = static_cast<char*>(source.data_ptr()) + source.byte_offset();
  }
  void FreeData(DLTensor*) {}
};

/// Zero-copy view of `t` with element type (code, bits). Used by the Python layer
/// for frameworks whose DLPack export lacks a dtype (NumPy has no bfloat16).
ffi::Tensor reinterpret_dtype(ffi::Tensor t, int64_t code, int64_t bits) {
  if (bits != t.dtype().bits || t.dtype().lanes != 1)
    TVM_FFI_THROW(ValueError) << "reinterpret_dtype: element size must stay " << int(t.dtype().bits) << " bits";
  DLDataType dt{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  return ffi::Tensor::FromNDAllocStrided(ViewAlloc{t}, t.shape(), t.strides(), dt, t.device());
}

bool has_cuda_backend() { return flashmla::has_cuda_backend(); }
int64_t reference_num_threads() { return flashmla::reference_num_threads(); }
void set_reference_num_threads(int64_t n) {
  flashmla::set_reference_num_threads(static_cast<int>(std::clamp<int64_t>(n, -1, 1 << 20)));
}

}  // namespace

/// Unique id of the CUDA stream capture (CUDA graph) that the stream `stream` (a cudaStream_t
/// as an integer) is in, 0 when it is not capturing or in builds without CUDA. The Python layer
/// keys a reused split schedule by it: a schedule computed inside one capture is replayed with
/// that graph, so only calls of the same capture may reuse it.
int64_t stream_capture_id(int64_t stream) {
#ifdef FLASHMLA_WITH_CUDA
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaError_t e = cudaStreamGetCaptureInfo(reinterpret_cast<cudaStream_t>(stream), &status, &id);
  if (e != cudaSuccess) {
    cudaGetLastError();
    TVM_FFI_THROW(RuntimeError) << "cudaStreamGetCaptureInfo failed: " << cudaGetErrorString(e);
  }
  return status == cudaStreamCaptureStatusActive ? static_cast<int64_t>(id) : 0;
#else
  (void)stream;
  return 0;
#endif
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(dense_decode_fwd, dense_decode_fwd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_decode_fwd, sparse_decode_fwd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_prefill_fwd, sparse_prefill_fwd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dense_prefill_fwd, dense_prefill_fwd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dense_prefill_bwd, dense_prefill_bwd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dense_prefill_fwd_dps, dense_prefill_fwd_dps);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dense_prefill_bwd_dps, dense_prefill_bwd_dps);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dense_prefill_check, dense_prefill_check);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(quantize_kv_cache, quantize_kv_cache);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dequantize_kv_cache, dequantize_kv_cache);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(has_cuda_backend, has_cuda_backend);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(stream_capture_id, stream_capture_id);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(reinterpret_dtype, reinterpret_dtype);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(reference_num_threads, reference_num_threads);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_reference_num_threads, set_reference_num_threads);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode_scratch_bytes, decode_scratch_bytes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dense_decode_fwd_dps, dense_decode_fwd_dps);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_decode_fwd_dps, sparse_decode_fwd_dps);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_prefill_fwd_dps, sparse_prefill_fwd_dps);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dense_decode_check, dense_decode_check);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_decode_check, sparse_decode_check);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_prefill_check, sparse_prefill_check);
