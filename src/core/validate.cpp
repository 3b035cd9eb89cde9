// Input validation shared by every binding (design: "Validation (one place)").
// Spec references: §1.3.1 (dense decode), §1.3.2 (sparse decode), §1.4 (sparse
// prefill), §3 (KV formats), §8 (easy-to-miss requirements).
#include "core/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace flashmla::core {
namespace {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

Status value_error(const std::string& msg) { return Status::Error(ErrorKind::kValue, msg); }
Status type_error(const std::string& msg) { return Status::Error(ErrorKind::kType, msg); }

/// A softmax scale: finite. NaN is also the params structs' "not set" default, which the message says.
Status check_scale(float scale, const char* name) {
  if (std::isnan(scale))
    return value_error(cat(name, ": must be finite, got nan (also the params struct's default when it is not set; "
                                 "FlashMLA's bindings pass d_qk^-0.5 when the caller gives none)"));
  if (!std::isfinite(scale))  // (the bindings take a double: a finite one beyond float32's range arrives as inf)
    return value_error(cat(name, ": must be finite, got ", scale,
                           " (the scale is a float32: a magnitude above 3.4e38 overflows float32 to inf)"));
  return Status::Ok();
}

/// Each (tensor, name) pair must be given: the first missing one's error.
template <typename... More>
Status require(const TensorRef& t, const char* name, const More&... more) {
  if (!t.defined) return value_error(cat(name, ": a tensor is required, got None"));
  if constexpr (sizeof...(more) > 0) return require(more...);
  return Status::Ok();
}

Status check_ndim(const TensorRef& t, const char* name, int ndim, const char* layout) {
  if (t.ndim != ndim)
    return value_error(cat(name, ": expected a ", ndim, "-D tensor ", layout, ", got shape ",
                           shape_string(t)));
  return Status::Ok();
}

Status check_dtype(const TensorRef& t, const char* name, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return Status::Ok();
  std::string list;
  for (DType d : allowed) list += std::string(list.empty() ? "" : " or ") + dtype_name(d);
  return type_error(cat(name, ": expected dtype ", list, ", got ", dtype_name(t.dtype)));
}

/// Shape check; -1 in `expected` is a wildcard.
Status check_shape(const TensorRef& t, const char* name, std::initializer_list<int64_t> expected,
                   const char* layout) {
  bool ok = t.ndim == static_cast<int>(expected.size());
  int i = 0;
  for (int64_t e : expected) {
    if (ok && e >= 0 && t.shape[i] != e) ok = false;
    ++i;
  }
  if (ok) return Status::Ok();
  std::ostringstream want;
  want << "(";
  i = 0;
  for (int64_t e : expected) {
    want << (i ? ", " : "");
    if (e >= 0) want << e; else want << "*";
    ++i;
  }
  if (expected.size() == 1) want << ",";
  want << ")";
  return value_error(cat(name, ": expected shape ", want.str(), " ", layout, ", got ", shape_string(t)));
}

Status check_last_dim_contiguous(const TensorRef& t, const char* name) {
  if (t.numel() == 0) return Status::Ok();  // empty tensors have arbitrary strides (NumPy reports 0)
  if (t.ndim > 0 && t.shape[t.ndim - 1] != 1 && t.stride[t.ndim - 1] != 1)
    return value_error(cat(name, ": the last dimension must be contiguous (stride 1), got stride ",
                           t.stride[t.ndim - 1]));
  return Status::Ok();
}

Status check_contiguous(const TensorRef& t, const char* name) {
  if (t.numel() > 0 && !t.is_contiguous()) return value_error(cat(name, ": expected a contiguous tensor"));
  return Status::Ok();
}

Status check_same_device(const TensorRef& t, const char* name, const TensorRef& q, const char* q_name) {
  if (t.defined && t.device != q.device)
    return value_error(cat(name, " is on ", device_name(t.device), " but ", q_name, " is on ",
                           device_name(q.device), ": all tensors must be on the same device"));
  return Status::Ok();
}

/// Strides must be non-negative (overlapping/negative views are not supported).
Status check_strides(const TensorRef& t, const char* name) {
  if (t.numel() == 0) return Status::Ok();
  for (int i = 0; i < t.ndim; ++i)
    if (t.stride[i] < 0)
      return value_error(cat(name, ": negative strides are not supported (dim ", i, " has stride ",
                             t.stride[i], ")"));
  return Status::Ok();
}

/// Every tensor argument: a rank the TensorRef can hold (kInvalidTensorDims marks what
/// make_tensor_ref could not build), no negative sizes, a known device type.
Status check_ref(const TensorRef& t, const char* name) {
  if (!t.defined) return Status::Ok();
  if (t.ndim < 0 || t.ndim > kMaxTensorDims)
    return value_error(cat(name, ": invalid tensor: expected 0 to ", kMaxTensorDims,
                           " dimensions with one stride per dimension, got ndim = ", t.ndim));
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] < 0)
      return value_error(cat(name, ": negative size in dim ", i, " of shape ", shape_string(t)));
  // Element counts (and products of any sizes, zeros skipped: the checks multiply pairs of them)
  // and byte sizes must fit int64, or numel() would wrap and hide a null pointer.
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] > 0 && __builtin_mul_overflow(n, t.shape[i], &n))
      return value_error(cat(name, ": shape ", shape_string(t), " has more elements than 64-bit sizes can count"));
  if (__builtin_mul_overflow(n, static_cast<int64_t>(dtype_size(t.dtype)), &n))
    return value_error(cat(name, ": shape ", shape_string(t), " has more bytes than 64-bit sizes can count"));
  // Bytes between the first and the farthest element through the strides (unsigned: |INT64_MIN|
  // is representable): (reach + 1) * element size must fit int64, so span_of cannot overflow.
  // Tensors without elements have arbitrary strides and are not checked.
  bool empty = false;
  for (int i = 0; i < t.ndim; ++i) empty = empty || t.shape[i] == 0;
  const uint64_t es = static_cast<uint64_t>(dtype_size(t.dtype));
  const uint64_t max_reach = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / es - 1;
  uint64_t reach = 0;
  for (int i = 0; i < t.ndim && !empty; ++i) {
    if (t.shape[i] <= 1) continue;
    const uint64_t st = t.stride[i] < 0 ? 0 - static_cast<uint64_t>(t.stride[i]) : static_cast<uint64_t>(t.stride[i]);
    uint64_t r = 0;
    if (__builtin_mul_overflow(st, static_cast<uint64_t>(t.shape[i] - 1), &r) || __builtin_add_overflow(reach, r, &reach) ||
        reach > max_reach)
      return value_error(cat(name, ": stride ", t.stride[i], " of dim ", i, " reaches beyond 64-bit byte offsets"));
  }
  if (t.device.type != DeviceType::kCPU && t.device.type != DeviceType::kCUDA)
    return value_error(cat(name, ": ", device_name(t.device), " (expected cpu or cuda)"));
  // Elements are read and written through typed pointers (the CPU reference, the host value checks, the
  // kernels): a data pointer off its element size (a byte offset into a buffer) is undefined behaviour there,
  // which may work, fault in a vectorised loop, or give other values. Empty tensors are never dereferenced.
  if (t.data != nullptr && !empty && reinterpret_cast<uintptr_t>(t.data) % es != 0)
    return value_error(cat(name, ": the data pointer is not aligned to its elements (", t.data, " is not a multiple of ",
                           es, " bytes, the size of ", dtype_name(t.dtype), "); pass a buffer aligned to its dtype"));
  return Status::Ok();
}
Status check_refs(std::initializer_list<std::pair<const TensorRef*, const char*>> ts) {
  for (const auto& [t, n] : ts) FLASHMLA_RETURN_IF_ERROR(check_ref(*t, n));
  return Status::Ok();
}

using Named = std::pair<const TensorRef*, const char*>;
/// Every tensor argument of an operator, with its name: inputs first, then metadata and outputs.
std::vector<Named> tensors_of(const DenseDecodeParams& p) {
  return {{&p.q, "q"}, {&p.k_cache, "k_cache"}, {&p.block_table, "block_table"}, {&p.cache_seqlens, "cache_seqlens"},
          {&p.tile_scheduler_metadata, "tile_scheduler_metadata"}, {&p.num_splits, "num_splits"},
          {&p.out, "out"}, {&p.lse, "lse"}};
}
std::vector<Named> tensors_of(const SparseDecodeParams& p) {
  return {{&p.q, "q"}, {&p.k_cache, "k_cache"}, {&p.indices, "indices"}, {&p.topk_length, "topk_length"},
          {&p.attn_sink, "attn_sink"}, {&p.extra_k_cache, "extra_k_cache"},
          {&p.extra_indices_in_kvcache, "extra_indices_in_kvcache"}, {&p.extra_topk_length, "extra_topk_length"},
          {&p.tile_scheduler_metadata, "tile_scheduler_metadata"}, {&p.num_splits, "num_splits"},
          {&p.out, "out"}, {&p.lse, "lse"}};
}
std::vector<Named> tensors_of(const SparsePrefillParams& p) {
  return {{&p.q, "q"}, {&p.kv, "kv"}, {&p.indices, "indices"}, {&p.attn_sink, "attn_sink"},
          {&p.topk_length, "topk_length"}, {&p.out, "out"}, {&p.max_logits, "max_logits"}, {&p.lse, "lse"}};
}
std::vector<Named> tensors_of(const DensePrefillParams& p) {
  return {{&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.cu_seqlens_qo, "cu_seqlens_qo"},
          {&p.cu_seqlens_kv, "cu_seqlens_kv"}, {&p.out, "out"}, {&p.lse, "lse"}};
}
std::vector<Named> tensors_of(const DensePrefillBwdParams& p) {
  const DensePrefillParams& f = p.fwd;
  return {{&f.q, "q"}, {&f.k, "k"}, {&f.v, "v"}, {&f.cu_seqlens_qo, "cu_seqlens_qo"},
          {&f.cu_seqlens_kv, "cu_seqlens_kv"}, {&f.out, "out"}, {&f.lse, "lse"}, {&p.dout, "dout"},
          {&p.dq, "dq"}, {&p.dk, "dk"}, {&p.dv, "dv"}};
}
/// check_ref over an operator's arguments (absent ones, e.g. outputs not yet filled by a plan
/// call, are skipped).
template <typename Params>
Status check_all_refs(const Params& p) {
  for (const auto& [t, n] : tensors_of(p)) FLASHMLA_RETURN_IF_ERROR(check_ref(*t, n));
  return Status::Ok();
}
Status check_data(const std::vector<Named>& tensors) {
  for (const auto& [t, n] : tensors) {
    FLASHMLA_RETURN_IF_ERROR(check_ref(*t, n));  // a valid rank and sizes before numel() reads them
    if (t->defined && t->numel() > 0 && t->data == nullptr)
      return value_error(cat(n, ": the data pointer is null for a tensor of shape ", shape_string(*t)));
  }
  return Status::Ok();
}

/// Bytes [lo, hi) a tensor with elements can touch through its strides (negative strides included).
/// check_ref bounds (reach + 1) * element size by INT64_MAX, so the offsets below do not overflow;
/// false when the range wraps around the address space (no real allocation does).
struct Span {
  uintptr_t lo = 0, hi = 0;
};
bool span_of(const TensorRef& t, Span* span) {
  const int64_t es = dtype_size(t.dtype);
  int64_t lo = 0, hi = 0;  // element offsets of the lowest and highest element
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] <= 1) continue;
    const int64_t reach = t.stride[i] * (t.shape[i] - 1);
    (reach < 0 ? lo : hi) += reach;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  const auto below = static_cast<uintptr_t>(-lo) * static_cast<uintptr_t>(es);
  const auto above = static_cast<uintptr_t>(hi + 1) * static_cast<uintptr_t>(es);
  if (below > base || base + above < base) return false;
  *span = {base - below, base + above};
  return true;
}
bool has_bytes(const TensorRef& t) { return t.defined && t.data != nullptr && t.numel() > 0; }

/// No output may share bytes with another argument: the operators read their inputs while they
/// write the outputs (the CPU backend from several threads), so an overlap gives a wrong answer
/// that depends on the timing. Spans are compared, so two interleaved strided tensors in one
/// buffer are rejected too, even if no element is shared.
Status check_outputs_disjoint(const std::vector<Named>& inputs, const std::vector<Named>& outputs,
                              const void* workspace, int64_t workspace_bytes) {
  std::vector<std::pair<Span, const char*>> ins, outs;
  for (auto [list, dst] : {std::pair{&inputs, &ins}, {&outputs, &outs}})
    for (const auto& [t, n] : *list) {
      Span sp;
      if (!has_bytes(*t)) continue;
      if (!span_of(*t, &sp))
        return value_error(cat(n, ": the tensor's byte range wraps around the address space (data pointer and "
                                  "strides)"));
      dst->push_back({sp, n});
    }
  if (workspace != nullptr && workspace_bytes > 0) {
    const auto w = reinterpret_cast<uintptr_t>(workspace);
    if (w + static_cast<uintptr_t>(workspace_bytes) < w)
      return value_error("workspace: the byte range wraps around the address space");
    outs.push_back({Span{w, w + static_cast<uintptr_t>(workspace_bytes)}, "workspace"});
  }
  auto overlap = [](const Span& a, const Span& b) { return a.lo < b.hi && b.lo < a.hi; };
  for (size_t i = 0; i < outs.size(); ++i) {
    for (const auto& [s, n] : ins)
      if (overlap(outs[i].first, s))
        return value_error(cat(outs[i].second, ": the output's memory overlaps the input ", n,
                               "; pass separate buffers"));
    for (size_t j = 0; j < i; ++j)
      if (overlap(outs[i].first, outs[j].first))
        return value_error(cat(outs[i].second, ": the output's memory overlaps the output ", outs[j].second,
                               "; pass separate buffers"));
  }
  return Status::Ok();
}

/// Outputs are written through their strides: non-negative strides and no two elements at one
/// address (sorted by stride, each dimension's stride at least the extent of the smaller ones).
Status check_output_layout(const TensorRef& t, const char* name) {
  FLASHMLA_RETURN_IF_ERROR(check_strides(t, name));
  if (t.numel() <= 1) return Status::Ok();
  int order[kMaxTensorDims];
  int n = 0;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] > 1) order[n++] = i;
  for (int a = 1; a < n; ++a)  // insertion sort by stride
    for (int c = a; c > 0 && t.stride[order[c]] < t.stride[order[c - 1]]; --c) std::swap(order[c], order[c - 1]);
  int64_t extent = 1;  // elements spanned by the dimensions sorted so far
  for (int a = 0; a < n; ++a) {
    const int d = order[a];
    if (t.stride[d] < extent)
      return value_error(cat(name, ": output strides overlap (dim ", d, " has stride ", t.stride[d],
                             " inside the ", extent, " elements spanned by the smaller strides); pass an output "
                             "whose elements have distinct addresses"));
    extent = t.stride[d] * (t.shape[d] - 1) + extent;
  }
  return Status::Ok();
}

/// TMA/vector loads on the GPU need 16-byte aligned bases and row strides.
Status check_cuda_alignment(const TensorRef& t, const char* name) {
  if (t.device.type != DeviceType::kCUDA || !t.defined) return Status::Ok();
  const int64_t es = dtype_size(t.dtype);
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    return value_error(cat(name, ": the data pointer must be 16-byte aligned on the GPU"));
  for (int i = 0; i + 1 < t.ndim; ++i)
    if (t.shape[i] > 1 && (t.stride[i] * es) % 16 != 0)
      return value_error(cat(name, ": stride of dim ", i, " is ", t.stride[i] * es,
                             " bytes; the GPU kernels need a multiple of 16 bytes"));
  return Status::Ok();
}

const int32_t* host_i32(const TensorRef& t) { return static_cast<const int32_t*>(t.data); }
/// Values can be read (absent, empty, or with data): the value checks run only when every tensor
/// they read has data (the shapes-only plans may pass none; the operators reject null data first).
bool readable(const TensorRef& t) { return !t.defined || t.numel() == 0 || t.data != nullptr; }


/// q of the decode operators: (b, s_q, h_q, d_qk) of one of `dtypes`, b, s_q, h_q > 0, d_qk 576 or 512
/// (`head_dims` says so in the message); and their two scalars, head_dim_v (512) and softmax_scale.
Status check_decode_q(const TensorRef& q, std::initializer_list<DType> dtypes, const char* head_dims,
                      int64_t head_dim_v, float softmax_scale) {
  FLASHMLA_RETURN_IF_ERROR(check_ndim(q, "q", 4, "(b, s_q, h_q, d_qk)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(q, "q", dtypes));
  const int64_t b = q.shape[0], s_q = q.shape[1], h_q = q.shape[2], d_qk = q.shape[3];
  if (b <= 0) return value_error(cat("q: batch size b = q.shape[0] must be > 0, got ", b));
  if (s_q <= 0) return value_error(cat("q: s_q = q.shape[1] must be > 0, got ", s_q));
  if (h_q <= 0) return value_error(cat("q: h_q = q.shape[2] must be > 0, got ", h_q));
  if (d_qk != 576 && d_qk != 512)
    return value_error(cat("q: head dim d_qk = q.shape[3] must be ", head_dims, ", got ", d_qk));
  if (head_dim_v != kDimV) return value_error(cat("head_dim_v: must be 512, got ", head_dim_v));
  return check_scale(softmax_scale, "softmax_scale");
}

/// A vector argument: dtype `dtype`, shape (n,) (`layout` names it), contiguous.
Status check_vector(const TensorRef& t, const char* name, DType dtype, int64_t n, const char* layout) {
  FLASHMLA_RETURN_IF_ERROR(check_dtype(t, name, {dtype}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(t, name, {n}, layout));
  return check_contiguous(t, name);
}

}  // namespace

// ------------------------------------------------------------------ dense decode
Status validate_dense_decode_inputs(const DenseDecodeParams& p) {
  FLASHMLA_RETURN_IF_ERROR(check_all_refs(p));
  FLASHMLA_RETURN_IF_ERROR(require(p.q, "q", p.k_cache, "k_cache", p.block_table, "block_table",
                                   p.cache_seqlens, "cache_seqlens"));
  FLASHMLA_RETURN_IF_ERROR(
      check_decode_q(p.q, {DType::kBFloat16, DType::kFloat16}, "576 or 512", p.head_dim_v, p.softmax_scale));
  const int64_t b = p.q.shape[0], h_q = p.q.shape[2], d_qk = p.q.shape[3];

  FLASHMLA_RETURN_IF_ERROR(check_ndim(p.k_cache, "k_cache", 4, "(num_blocks, page_block_size, h_kv, d_qk)"));
  if (p.k_cache.dtype != p.q.dtype) {
    // An FP8 cache (its bytes as uint8 / int8 / float8_e4m3fn) passed without indices: say which operator reads it.
    const bool fp8_bytes = p.k_cache.dtype == DType::kUInt8 || p.k_cache.dtype == DType::kInt8 ||
                           p.k_cache.dtype == DType::kFloat8E4M3;
    return type_error(cat("k_cache: expected the dtype of q (", dtype_name(p.q.dtype), "), got ",
                          dtype_name(p.k_cache.dtype),
                          fp8_bytes ? " (an FP8 cache is read by the sparse decode only: pass indices)" : ""));
  }
  const int64_t num_blocks = p.k_cache.shape[0], pbs = p.k_cache.shape[1], h_kv = p.k_cache.shape[2];
  if (pbs <= 0) return value_error(cat("k_cache: page_block_size = k_cache.shape[1] must be > 0, got ", pbs));
  if (h_kv <= 0) return value_error(cat("k_cache: h_kv = k_cache.shape[2] must be > 0, got ", h_kv));
  if (p.k_cache.shape[3] != d_qk)
    return value_error(cat("k_cache: last dim must equal q's head dim ", d_qk, ", got shape ",
                           shape_string(p.k_cache)));
  if (h_q % h_kv != 0)
    return value_error(cat("h_q % h_kv != 0: q has h_q = ", h_q, " heads, k_cache has h_kv = ", h_kv,
                           "; h_q must be a multiple of h_kv"));

  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.block_table, "block_table", {DType::kInt32}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(p.block_table, "block_table", {b, -1}, "(b, max_blocks_per_seq)"));
  FLASHMLA_RETURN_IF_ERROR(check_vector(p.cache_seqlens, "cache_seqlens", DType::kInt32, b, "(b,)"));
  for (auto [t, n] : {std::pair{&p.q, "q"}, {&p.k_cache, "k_cache"}, {&p.block_table, "block_table"}}) {
    FLASHMLA_RETURN_IF_ERROR(check_last_dim_contiguous(*t, n));
    FLASHMLA_RETURN_IF_ERROR(check_strides(*t, n));
  }
  FLASHMLA_RETURN_IF_ERROR(check_same_device(p.k_cache, "k_cache", p.q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_same_device(p.block_table, "block_table", p.q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_same_device(p.cache_seqlens, "cache_seqlens", p.q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_cuda_alignment(p.q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_cuda_alignment(p.k_cache, "k_cache"));

  // Values: cheap on the host. On the GPU they stay on the device (reading them
  // would synchronise the stream); the kernels never index past a request's
  // last page, so only the user's own block_table contents can be wrong there.
  // (No data: a shapes-and-dtypes-only check, e.g. while JAX traces; a real cache_seqlens has b >= 1
  // elements and so always has data.)
  if (p.q.device.type == DeviceType::kCPU && p.cache_seqlens.data != nullptr && readable(p.block_table)) {
    const int64_t max_blocks = p.block_table.shape[1];
    const int32_t* seqlens = host_i32(p.cache_seqlens);
    for (int64_t i = 0; i < b; ++i) {
      const int64_t len = seqlens[i];
      if (len < 0) return value_error(cat("cache_seqlens[", i, "] = ", len, " is negative"));
      const int64_t pages = (len + pbs - 1) / pbs;
      if (pages > max_blocks)
        return value_error(cat("block_table too short for cache_seqlens: request ", i, " has cache_seqlens = ",
                               len, " which needs ", pages, " pages of ", pbs,
                               " tokens, but block_table has ", max_blocks, " columns"));
      if (pages == 0) continue;  // (an empty block table may have no data: no pointer arithmetic on it)
      const int32_t* row = host_i32(p.block_table) + i * p.block_table.stride[0];
      for (int64_t j = 0; j < pages; ++j) {
        const int64_t blk = row[j * p.block_table.stride[1]];
        if (blk < 0 || blk >= num_blocks)
          return value_error(cat("block_table[", i, ", ", j, "] = ", blk, " is out of range [0, ", num_blocks,
                                 ") (k_cache has ", num_blocks, " blocks)"));
      }
    }
  }
  return Status::Ok();
}

// ------------------------------------------------------------------ sparse decode
namespace {
Status check_fp8_cache(const TensorRef& cache, const char* name, KVFormat format) {
  FLASHMLA_RETURN_IF_ERROR(check_ndim(cache, name, 4, "(num_blocks, page_block_size, 1, bytes_per_token)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(cache, name, {DType::kFloat8E4M3, DType::kInt8, DType::kUInt8}));
  const int64_t bpt = fp8_bytes_per_token(format);
  const char* fmt = format == KVFormat::kFP8V32 ? "V32 (d_qk = 576)" : "MODEL1 (d_qk = 512)";
  if (cache.shape[2] != 1)
    return value_error(cat(name, ": sparse decoding supports only h_kv = 1 (MQA), got k_cache shape ",
                           shape_string(cache)));
  if (cache.shape[3] != bpt)
    return value_error(cat(name, ": the ", fmt, " FP8 format has ", bpt, " bytes per token, so the last dim must be ",
                           bpt, ", got shape ", shape_string(cache)));
  if (cache.shape[1] <= 0) return value_error(cat(name, ": page_block_size must be > 0"));
  FLASHMLA_RETURN_IF_ERROR(check_last_dim_contiguous(cache, name));
  FLASHMLA_RETURN_IF_ERROR(check_strides(cache, name));
  if (cache.shape[1] > 1 && cache.stride[1] != bpt)
    return value_error(cat(name, ": the tokens of a page block must be packed: stride(1) must be ", bpt,
                           " bytes, got ", cache.stride[1]));
  if (cache.shape[0] > 1 && cache.stride[0] < cache.shape[1] * bpt)
    return value_error(cat(name, ": page blocks overlap: stride(0) = ", cache.stride[0],
                           " bytes is less than page_block_size * ", bpt));
  if (cache.shape[0] * cache.shape[1] > std::numeric_limits<int32_t>::max())
    return value_error(cat(name, ": num_blocks * page_block_size must be < 2^31 (token indices are int32)"));
  return Status::Ok();
}

/// The values of optional (b,) int32 lengths, contiguous on the host: none negative.
Status check_lengths_nonnegative(const TensorRef& lengths, const char* name) {
  if (!lengths.defined) return Status::Ok();
  for (int64_t i = 0; i < lengths.shape[0]; ++i)
    if (host_i32(lengths)[i] < 0) return value_error(cat(name, "[", i, "] = ", host_i32(lengths)[i], " is negative"));
  return Status::Ok();
}

Status check_index_values(const TensorRef& idx, const TensorRef& lengths, const char* name,
                          int64_t num_tokens) {
  const int64_t b = idx.shape[0], s_q = idx.shape[1], topk = idx.shape[2];
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = lengths.defined ? host_i32(lengths)[i] : topk;
    for (int64_t r = 0; r < s_q; ++r) {
      const int32_t* row = host_i32(idx) + i * idx.stride[0] + r * idx.stride[1];
      for (int64_t k = 0; k < std::min(len, topk); ++k) {
        const int64_t v = row[k * idx.stride[2]];
        if (v != -1 && (v < 0 || v >= num_tokens))
          return value_error(cat(name, "[", i, ", ", r, ", ", k, "] = ", v, " is out of range: valid token indices are -1 ",
                                 "(invalid slot) or [0, num_blocks * page_block_size = ", num_tokens, ")"));
      }
    }
  }
  return Status::Ok();
}
}  // namespace

Status validate_sparse_decode_inputs(const SparseDecodeParams& p) {
  FLASHMLA_RETURN_IF_ERROR(check_all_refs(p));
  FLASHMLA_RETURN_IF_ERROR(require(p.q, "q", p.k_cache, "k_cache", p.indices, "indices"));
  FLASHMLA_RETURN_IF_ERROR(
      check_decode_q(p.q, {DType::kBFloat16}, "576 (V32) or 512 (MODEL1)", p.head_dim_v, p.softmax_scale));
  const int64_t b = p.q.shape[0], s_q = p.q.shape[1], h_q = p.q.shape[2], d_qk = p.q.shape[3];
  const KVFormat format = fp8_format_for_head_dim(d_qk);
  FLASHMLA_RETURN_IF_ERROR(check_fp8_cache(p.k_cache, "k_cache", format));

  FLASHMLA_RETURN_IF_ERROR(check_ndim(p.indices, "indices", 3, "(b, s_q, topk)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.indices, "indices", {DType::kInt32}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(p.indices, "indices", {b, s_q, -1}, "(b, s_q, topk)"));
  if (p.indices.shape[2] <= 0) return value_error("indices: topk = indices.shape[2] must be > 0");
  FLASHMLA_RETURN_IF_ERROR(check_last_dim_contiguous(p.indices, "indices"));
  FLASHMLA_RETURN_IF_ERROR(check_strides(p.indices, "indices"));
  FLASHMLA_RETURN_IF_ERROR(check_last_dim_contiguous(p.q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_strides(p.q, "q"));
  if (p.topk_length.defined)
    FLASHMLA_RETURN_IF_ERROR(check_vector(p.topk_length, "topk_length", DType::kInt32, b, "(b,)"));
  if (p.attn_sink.defined)
    FLASHMLA_RETURN_IF_ERROR(check_vector(p.attn_sink, "attn_sink", DType::kFloat32, h_q, "(h_q,)"));
  if (p.extra_k_cache.defined && !p.extra_indices_in_kvcache.defined)
    return value_error("extra_indices_in_kvcache: required when extra_k_cache is given");
  if (!p.extra_k_cache.defined && (p.extra_indices_in_kvcache.defined || p.extra_topk_length.defined))
    return value_error("extra_k_cache: extra_indices_in_kvcache / extra_topk_length were given without extra_k_cache");
  if (p.extra_k_cache.defined) {
    FLASHMLA_RETURN_IF_ERROR(check_fp8_cache(p.extra_k_cache, "extra_k_cache", format));
    FLASHMLA_RETURN_IF_ERROR(check_ndim(p.extra_indices_in_kvcache, "extra_indices_in_kvcache", 3, "(b, s_q, extra_topk)"));
    FLASHMLA_RETURN_IF_ERROR(check_dtype(p.extra_indices_in_kvcache, "extra_indices_in_kvcache", {DType::kInt32}));
    FLASHMLA_RETURN_IF_ERROR(check_shape(p.extra_indices_in_kvcache, "extra_indices_in_kvcache", {b, s_q, -1},
                                         "(b, s_q, extra_topk)"));
    if (p.extra_indices_in_kvcache.shape[2] <= 0)
      return value_error("extra_indices_in_kvcache: extra_topk = shape[2] must be > 0");
    FLASHMLA_RETURN_IF_ERROR(check_last_dim_contiguous(p.extra_indices_in_kvcache, "extra_indices_in_kvcache"));
    FLASHMLA_RETURN_IF_ERROR(check_strides(p.extra_indices_in_kvcache, "extra_indices_in_kvcache"));
    if (p.extra_topk_length.defined)
      FLASHMLA_RETURN_IF_ERROR(check_vector(p.extra_topk_length, "extra_topk_length", DType::kInt32, b, "(b,)"));
  }
  for (auto [t, n] : {std::pair{&p.k_cache, "k_cache"}, {&p.indices, "indices"}, {&p.topk_length, "topk_length"},
                      {&p.attn_sink, "attn_sink"}, {&p.extra_k_cache, "extra_k_cache"},
                      {&p.extra_indices_in_kvcache, "extra_indices_in_kvcache"},
                      {&p.extra_topk_length, "extra_topk_length"}})
    FLASHMLA_RETURN_IF_ERROR(check_same_device(*t, n, p.q, "q"));

  // (No data: a shapes-and-dtypes-only check; real indices have b * s_q * topk >= 1 elements.)
  if (p.q.device.type == DeviceType::kCPU && p.indices.data != nullptr && readable(p.topk_length) &&
      readable(p.extra_indices_in_kvcache) && readable(p.extra_topk_length)) {
    FLASHMLA_RETURN_IF_ERROR(check_lengths_nonnegative(p.topk_length, "topk_length"));
    FLASHMLA_RETURN_IF_ERROR(check_index_values(p.indices, p.topk_length, "indices",
                                                p.k_cache.shape[0] * p.k_cache.shape[1]));
    if (p.extra_k_cache.defined) {
      FLASHMLA_RETURN_IF_ERROR(check_lengths_nonnegative(p.extra_topk_length, "extra_topk_length"));
      FLASHMLA_RETURN_IF_ERROR(check_index_values(p.extra_indices_in_kvcache, p.extra_topk_length,
                                                  "extra_indices_in_kvcache",
                                                  p.extra_k_cache.shape[0] * p.extra_k_cache.shape[1]));
    }
  }
  return Status::Ok();
}

// ------------------------------------------------------------------ sparse prefill
Status validate_sparse_prefill_inputs(const SparsePrefillParams& p) {
  FLASHMLA_RETURN_IF_ERROR(check_all_refs(p));
  FLASHMLA_RETURN_IF_ERROR(require(p.q, "q", p.kv, "kv", p.indices, "indices"));
  FLASHMLA_RETURN_IF_ERROR(check_ndim(p.q, "q", 3, "(s_q, h_q, d_qk)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.q, "q", {DType::kBFloat16}));
  const int64_t s_q = p.q.shape[0], h_q = p.q.shape[1], d_qk = p.q.shape[2];
  if (h_q <= 0) return value_error(cat("q: h_q = q.shape[1] must be > 0, got ", h_q));
  if (d_qk != 576 && d_qk != 512)
    return value_error(cat("q: head dim d_qk = q.shape[2] must be 576 or 512, got ", d_qk));
  if (p.d_v != kDimV) return value_error(cat("d_v: must be 512, got ", p.d_v));
  FLASHMLA_RETURN_IF_ERROR(check_scale(p.sm_scale, "sm_scale"));
  FLASHMLA_RETURN_IF_ERROR(check_ndim(p.kv, "kv", 3, "(s_kv, h_kv, d_qk)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.kv, "kv", {DType::kBFloat16}));
  if (p.kv.shape[1] != 1)
    return value_error(cat("kv: sparse prefill supports only h_kv = 1 (MQA), got kv shape ", shape_string(p.kv)));
  if (p.kv.shape[2] != d_qk)
    return value_error(cat("kv: last dim must equal q's head dim ", d_qk, ", got shape ", shape_string(p.kv)));
  FLASHMLA_RETURN_IF_ERROR(check_ndim(p.indices, "indices", 3, "(s_q, h_kv, topk)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.indices, "indices", {DType::kInt32}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(p.indices, "indices", {s_q, 1, -1}, "(s_q, h_kv, topk)"));
  if (p.indices.shape[2] <= 0) return value_error("indices: topk = indices.shape[2] must be > 0");
  if (p.attn_sink.defined) {
    FLASHMLA_RETURN_IF_ERROR(check_dtype(p.attn_sink, "attn_sink", {DType::kFloat32}));
    FLASHMLA_RETURN_IF_ERROR(check_shape(p.attn_sink, "attn_sink", {h_q}, "(h_q,)"));
  }
  if (p.topk_length.defined) {
    FLASHMLA_RETURN_IF_ERROR(check_dtype(p.topk_length, "topk_length", {DType::kInt32}));
    FLASHMLA_RETURN_IF_ERROR(check_shape(p.topk_length, "topk_length", {s_q}, "(s_q,)"));
  }
  for (auto [t, n] : {std::pair{&p.q, "q"}, {&p.kv, "kv"}, {&p.indices, "indices"},
                      {&p.attn_sink, "attn_sink"}, {&p.topk_length, "topk_length"}}) {
    if (!t->defined) continue;
    FLASHMLA_RETURN_IF_ERROR(check_last_dim_contiguous(*t, n));
    FLASHMLA_RETURN_IF_ERROR(check_strides(*t, n));
    FLASHMLA_RETURN_IF_ERROR(check_same_device(*t, n, p.q, "q"));
  }
  if (p.kv.shape[0] > std::numeric_limits<int32_t>::max())
    return value_error("kv: s_kv must be < 2^31 (indices are int32)");
  if (p.topk_length.defined && p.topk_length.data != nullptr && p.q.device.type == DeviceType::kCPU)
    for (int64_t s = 0; s < s_q; ++s) {
      const int32_t len = host_i32(p.topk_length)[s * p.topk_length.stride[0]];
      if (len < 0) return value_error(cat("topk_length[", s, "] = ", len, " is negative"));
    }
  return Status::Ok();
}

// ------------------------------------------------------------------ dense MHA prefill
namespace {
/// (d_qk, d_v) pairs with kernels (FlashMLA's SM100 set, spec §1.5); the CPU reference takes the same.
bool dense_prefill_dims_supported(int64_t d_qk, int64_t d_v) {
  return (d_qk == 128 && d_v == 128) || (d_qk == 192 && d_v == 128);
}

/// cu_seqlens: a (b + 1,) int32 contiguous vector of b >= 1 requests.
Status check_cu_seqlens_shape(const TensorRef& cu, const char* name) {
  FLASHMLA_RETURN_IF_ERROR(check_dtype(cu, name, {DType::kInt32}));
  FLASHMLA_RETURN_IF_ERROR(check_ndim(cu, name, 1, "(b + 1,)"));
  if (cu.shape[0] < 2)
    return value_error(cat(name, ": expected shape (b + 1,) with b >= 1 requests, got ", shape_string(cu)));
  return check_contiguous(cu, name);
}

/// cu_seqlens' values (checked by check_cu_seqlens_shape first), on the CPU: they start at 0, never decrease,
/// end at `total` (every row of q / k belongs to a request) and give lengths <= max_seqlen.
Status check_cu_seqlens_values(const TensorRef& cu, const char* name, int64_t total, const char* total_what,
                               int64_t max_seqlen, const char* max_name) {
  if (cu.device.type != DeviceType::kCPU || cu.data == nullptr) return Status::Ok();
  const int32_t* v = host_i32(cu);
  const int64_t b = cu.shape[0] - 1;
  if (v[0] != 0) return value_error(cat(name, "[0] = ", v[0], ": cumulative lengths must start at 0"));
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = static_cast<int64_t>(v[i + 1]) - v[i];
    if (len < 0)
      return value_error(cat(name, ": cumulative lengths must not decrease, got ", name, "[", i, "] = ", v[i], " > ",
                             name, "[", i + 1, "] = ", v[i + 1]));
    if (len > max_seqlen)
      return value_error(cat(name, ": request ", i, " has ", len, " tokens, more than ", max_name, " = ",
                             max_seqlen));
  }
  if (v[b] != total)
    return value_error(cat(name, "[b] = ", v[b], " must equal ", total_what, " = ", total,
                           " (every row belongs to one request)"));
  return Status::Ok();
}

/// One input tensor of the prefill: 3-D, q's dtype, last dim contiguous, no negative strides, q's device,
/// 16-byte aligned on the GPU (TMA).
Status check_prefill_tensor(const TensorRef& t, const char* name, const char* layout, const TensorRef& q) {
  FLASHMLA_RETURN_IF_ERROR(require(t, name));
  FLASHMLA_RETURN_IF_ERROR(check_ndim(t, name, 3, layout));
  if (t.dtype != q.dtype)
    return type_error(cat(name, ": expected the dtype of q (", dtype_name(q.dtype), "), got ", dtype_name(t.dtype)));
  FLASHMLA_RETURN_IF_ERROR(check_last_dim_contiguous(t, name));
  FLASHMLA_RETURN_IF_ERROR(check_strides(t, name));
  FLASHMLA_RETURN_IF_ERROR(check_same_device(t, name, q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_cuda_alignment(t, name));
  return Status::Ok();
}
}  // namespace

Status validate_dense_prefill_inputs(const DensePrefillParams& p) {
  FLASHMLA_RETURN_IF_ERROR(check_all_refs(p));
  FLASHMLA_RETURN_IF_ERROR(require(p.q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_ndim(p.q, "q", 3, "(total_q, h_q, d_qk)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.q, "q", {DType::kBFloat16, DType::kFloat16}));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_tensor(p.q, "q", "(total_q, h_q, d_qk)", p.q));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_tensor(p.k, "k", "(total_k, h_kv, d_qk)", p.q));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_tensor(p.v, "v", "(total_k, h_kv, d_v)", p.q));
  const int64_t total_q = p.q.shape[0], h_q = p.q.shape[1], d_qk = p.q.shape[2];
  const int64_t total_k = p.k.shape[0], h_kv = p.k.shape[1], d_v = p.v.shape[2];
  if (h_q <= 0) return value_error(cat("q: h_q = q.shape[1] must be > 0, got ", h_q));
  if (h_kv <= 0) return value_error(cat("k: h_kv = k.shape[1] must be > 0, got ", h_kv));
  if (p.k.shape[2] != d_qk)
    return value_error(cat("k: last dim must equal q's head dim d_qk = ", d_qk, ", got shape ", shape_string(p.k)));
  if (p.v.shape[0] != total_k || p.v.shape[1] != h_kv)
    return value_error(cat("v: expected shape (", total_k, ", ", h_kv, ", d_v) to match k ", shape_string(p.k),
                           ", got ", shape_string(p.v)));
  if (h_q % h_kv != 0)
    return value_error(cat("h_q % h_kv != 0: q has h_q = ", h_q, " heads, k has h_kv = ", h_kv,
                           "; h_q must be a multiple of h_kv"));
  if (!dense_prefill_dims_supported(d_qk, d_v))
    return value_error(cat("q / v: no kernel for d_qk=", d_qk, " d_v=", d_v,
                           "; dense MHA prefill supports (d_qk, d_v) = (128, 128) and (192, 128)"));
  FLASHMLA_RETURN_IF_ERROR(check_scale(p.softmax_scale, "softmax_scale"));
  if (p.max_seqlen_qo < 0 || p.max_seqlen_qo > std::numeric_limits<int32_t>::max())
    return value_error(cat("max_seqlen_qo: must be in [0, 2^31), got ", p.max_seqlen_qo));
  if (p.max_seqlen_kv < 0 || p.max_seqlen_kv > std::numeric_limits<int32_t>::max())
    return value_error(cat("max_seqlen_kv: must be in [0, 2^31), got ", p.max_seqlen_kv));
  if (total_q > std::numeric_limits<int32_t>::max() || total_k > std::numeric_limits<int32_t>::max())
    return value_error(cat("q / k: total_q and total_k must be < 2^31 (cu_seqlens are int32), got ", total_q, " and ",
                           total_k));
  FLASHMLA_RETURN_IF_ERROR(require(p.cu_seqlens_qo, "cu_seqlens_qo", p.cu_seqlens_kv, "cu_seqlens_kv"));
  FLASHMLA_RETURN_IF_ERROR(check_same_device(p.cu_seqlens_qo, "cu_seqlens_qo", p.q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_same_device(p.cu_seqlens_kv, "cu_seqlens_kv", p.q, "q"));
  // Every shape before any value, so that a check without data (a plan of shapes only, torch's fake kernels)
  // raises what the call would.
  FLASHMLA_RETURN_IF_ERROR(check_cu_seqlens_shape(p.cu_seqlens_qo, "cu_seqlens_qo"));
  FLASHMLA_RETURN_IF_ERROR(check_cu_seqlens_shape(p.cu_seqlens_kv, "cu_seqlens_kv"));
  if (p.cu_seqlens_kv.shape[0] != p.cu_seqlens_qo.shape[0])
    return value_error(cat("cu_seqlens_kv: expected shape (", p.cu_seqlens_qo.shape[0],
                           ",) like cu_seqlens_qo (b + 1 = ", p.cu_seqlens_qo.shape[0], "), got ",
                           shape_string(p.cu_seqlens_kv)));
  FLASHMLA_RETURN_IF_ERROR(check_cu_seqlens_values(p.cu_seqlens_qo, "cu_seqlens_qo", total_q, "total_q = q.shape[0]",
                                                   p.max_seqlen_qo, "max_seqlen_qo"));
  return check_cu_seqlens_values(p.cu_seqlens_kv, "cu_seqlens_kv", total_k, "total_k = k.shape[0]", p.max_seqlen_kv,
                                 "max_seqlen_kv");
}

Status validate_dense_prefill_bwd_inputs(const DensePrefillBwdParams& p) {
  FLASHMLA_RETURN_IF_ERROR(check_all_refs(p));
  FLASHMLA_RETURN_IF_ERROR(validate_dense_prefill_inputs(p.fwd));
  const TensorRef& q = p.fwd.q;
  const int64_t total_q = q.shape[0], h_q = q.shape[1], d_v = p.fwd.v.shape[2];
  // out and lse as the forward wrote them: read here.
  FLASHMLA_RETURN_IF_ERROR(require(p.fwd.out, "out"));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_tensor(p.fwd.out, "out", "(total_q, h_q, d_v)", q));
  FLASHMLA_RETURN_IF_ERROR(check_shape(p.fwd.out, "out", {total_q, h_q, d_v}, "(total_q, h_q, d_v)"));
  FLASHMLA_RETURN_IF_ERROR(require(p.fwd.lse, "lse"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.fwd.lse, "lse", {DType::kFloat32}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(p.fwd.lse, "lse", {total_q, h_q}, "(total_q, h_q)"));
  FLASHMLA_RETURN_IF_ERROR(check_strides(p.fwd.lse, "lse"));
  FLASHMLA_RETURN_IF_ERROR(check_same_device(p.fwd.lse, "lse", q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_tensor(p.dout, "dout", "(total_q, h_q, d_v)", q));
  FLASHMLA_RETURN_IF_ERROR(check_shape(p.dout, "dout", {total_q, h_q, d_v}, "(total_q, h_q, d_v)"));
  return Status::Ok();
}

namespace {
Status check_workspace(const void* workspace, int64_t given, int64_t needed) {
  if (given < needed || (needed > 0 && workspace == nullptr))
    return value_error(cat("workspace: ", needed, " bytes required, got ", given));
  if (needed > 0 && reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    return value_error("workspace: the pointer must be 16-byte aligned");
  return Status::Ok();
}

/// A written prefill tensor: given shape and dtype, q's device, layout without overlaps, aligned on the GPU.
Status check_prefill_output(const TensorRef& t, const char* name, std::initializer_list<int64_t> shape,
                            const char* layout, DType dtype, const TensorRef& q) {
  FLASHMLA_RETURN_IF_ERROR(require(t, name));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(t, name, {dtype}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(t, name, shape, layout));
  FLASHMLA_RETURN_IF_ERROR(check_same_device(t, name, q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_output_layout(t, name));
  if (dtype != DType::kFloat32) {  // (lse keeps any strides, e.g. FlashMLA's (1, total_q))
    FLASHMLA_RETURN_IF_ERROR(check_last_dim_contiguous(t, name));
    FLASHMLA_RETURN_IF_ERROR(check_cuda_alignment(t, name));
  }
  return Status::Ok();
}
}  // namespace

Status validate_dense_prefill_outputs(const DensePrefillParams& p, int64_t workspace_bytes_needed) {
  const int64_t total_q = p.q.shape[0], h_q = p.q.shape[1], d_v = p.v.shape[2];
  FLASHMLA_RETURN_IF_ERROR(check_refs({std::pair{&p.out, "out"}, {&p.lse, "lse"}}));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_output(p.out, "out", {total_q, h_q, d_v}, "(total_q, h_q, d_v)", p.q.dtype, p.q));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_output(p.lse, "lse", {total_q, h_q}, "(total_q, h_q)", DType::kFloat32, p.q));
  return check_workspace(p.workspace, p.workspace_bytes, workspace_bytes_needed);
}

Status validate_dense_prefill_bwd_outputs(const DensePrefillBwdParams& p, int64_t workspace_bytes_needed) {
  const TensorRef& q = p.fwd.q;
  const int64_t total_q = q.shape[0], h_q = q.shape[1], d_qk = q.shape[2];
  const int64_t total_k = p.fwd.k.shape[0], h_kv = p.fwd.k.shape[1], d_v = p.fwd.v.shape[2];
  FLASHMLA_RETURN_IF_ERROR(check_refs({std::pair{&p.dq, "dq"}, {&p.dk, "dk"}, {&p.dv, "dv"}}));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_output(p.dq, "dq", {total_q, h_q, d_qk}, "(total_q, h_q, d_qk)", q.dtype, q));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_output(p.dk, "dk", {total_k, h_kv, d_qk}, "(total_k, h_kv, d_qk)", q.dtype, q));
  FLASHMLA_RETURN_IF_ERROR(check_prefill_output(p.dv, "dv", {total_k, h_kv, d_v}, "(total_k, h_kv, d_v)", q.dtype, q));
  return check_workspace(p.workspace, p.workspace_bytes, workspace_bytes_needed);
}

// ------------------------------------------------------------------ outputs
Status validate_decode_outputs(const TensorRef& q, const TensorRef& out, const TensorRef& lse, DType out_dtype,
                               const TensorRef& tsm, const TensorRef& num_splits, const DecodePlan& plan,
                               int64_t workspace_bytes, const void* workspace) {
  const int64_t b = q.shape[0], s_q = q.shape[1], h_q = q.shape[2];
  FLASHMLA_RETURN_IF_ERROR(require(out, "out", lse, "lse"));
  FLASHMLA_RETURN_IF_ERROR(check_refs({std::pair{&out, "out"}, {&lse, "lse"}, {&tsm, "tile_scheduler_metadata"},
                                       {&num_splits, "num_splits"}}));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(out, "out", {out_dtype}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(out, "out", {b, s_q, h_q, kDimV}, "(b, s_q, h_q, 512)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(lse, "lse", {DType::kFloat32}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(lse, "lse", {b, h_q, s_q}, "(b, h_q, s_q)"));
  FLASHMLA_RETURN_IF_ERROR(require(tsm, "tile_scheduler_metadata", num_splits, "num_splits"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(tsm, "tile_scheduler_metadata", {DType::kInt32}));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(num_splits, "num_splits", {DType::kInt32}));
  if (tsm.ndim != 2 || tsm.shape[0] != plan.num_sm_parts || tsm.shape[1] != kTileSchedulerMetadataWidth)
    return value_error(cat("tile_scheduler_metadata: expected shape (", plan.num_sm_parts,
                           ", 8) for this call, got ", shape_string(tsm),
                           "; scheduler metadata can only be reused for calls with the same shapes",
                           q.device.type == DeviceType::kCPU
                               ? " and, on the CPU, the same reference thread count (set_reference_num_threads, "
                                 "FLASHMLA_NUM_THREADS), which is its num_sm_parts"
                               : ""));
  if (num_splits.ndim != 1 || num_splits.shape[0] != plan.num_splits_len)
    return value_error(cat("num_splits: expected shape (", plan.num_splits_len, ",) for this call, got ",
                           shape_string(num_splits),
                           "; scheduler metadata can only be reused for calls with the same shapes"));
  for (auto [t, n] : {std::pair{&out, "out"}, {&lse, "lse"}, {&tsm, "tile_scheduler_metadata"},
                      {&num_splits, "num_splits"}})
    FLASHMLA_RETURN_IF_ERROR(check_same_device(*t, n, q, "q"));
  FLASHMLA_RETURN_IF_ERROR(check_output_layout(out, "out"));
  FLASHMLA_RETURN_IF_ERROR(check_output_layout(lse, "lse"));
  FLASHMLA_RETURN_IF_ERROR(check_contiguous(tsm, "tile_scheduler_metadata"));
  FLASHMLA_RETURN_IF_ERROR(check_contiguous(num_splits, "num_splits"));
  if (workspace_bytes < plan.workspace_bytes || (plan.workspace_bytes > 0 && workspace == nullptr))
    return value_error(cat("workspace: ", plan.workspace_bytes, " bytes required, got ", workspace_bytes));
  // The split-KV partials are written / read as float2 / float4.
  if (plan.workspace_bytes > 0 && reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    return value_error("workspace: the pointer must be 16-byte aligned");
  return Status::Ok();
}

Status validate_sparse_prefill_outputs(const SparsePrefillParams& p) {
  const int64_t s_q = p.q.shape[0], h_q = p.q.shape[1];
  FLASHMLA_RETURN_IF_ERROR(require(p.out, "out", p.max_logits, "max_logits", p.lse, "lse"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.out, "out", {DType::kBFloat16}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(p.out, "out", {s_q, h_q, kDimV}, "(s_q, h_q, 512)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.max_logits, "max_logits", {DType::kFloat32}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(p.max_logits, "max_logits", {s_q, h_q}, "(s_q, h_q)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(p.lse, "lse", {DType::kFloat32}));
  FLASHMLA_RETURN_IF_ERROR(check_shape(p.lse, "lse", {s_q, h_q}, "(s_q, h_q)"));
  for (auto [t, n] : {std::pair{&p.out, "out"}, {&p.max_logits, "max_logits"}, {&p.lse, "lse"}}) {
    FLASHMLA_RETURN_IF_ERROR(check_same_device(*t, n, p.q, "q"));
    FLASHMLA_RETURN_IF_ERROR(check_output_layout(*t, n));
  }
  return Status::Ok();
}

// ------------------------------------------------------------------ FP8 conversion
Status validate_kv_quant_args(KVFormat format, const TensorRef& kv, const TensorRef& packed) {
  if (format != KVFormat::kFP8V32 && format != KVFormat::kFP8Model1)
    return value_error("format: expected an FP8 KV format (V32 or MODEL1)");
  FLASHMLA_RETURN_IF_ERROR(require(kv, "kv_cache", packed, "packed"));
  FLASHMLA_RETURN_IF_ERROR(check_refs({std::pair{&kv, "kv_cache"}, {&packed, "packed"}}));
  const int64_t d = format == KVFormat::kFP8V32 ? v32::kDimQK : model1::kDimQK;
  FLASHMLA_RETURN_IF_ERROR(check_ndim(kv, "kv_cache", 4, "(num_blocks, page_block_size, 1, d_qk)"));
  FLASHMLA_RETURN_IF_ERROR(check_dtype(kv, "kv_cache", {DType::kBFloat16}));
  if (kv.shape[2] != 1)
    return value_error(cat("kv_cache: FP8 KV caches have h_kv = 1, got shape ", shape_string(kv)));
  if (kv.shape[1] <= 0)
    return value_error(cat("kv_cache: page_block_size (dim 1) must be > 0, got shape ", shape_string(kv)));
  if (kv.shape[3] != d)
    return value_error(cat("kv_cache: the ", format == KVFormat::kFP8V32 ? "V32" : "MODEL1",
                           " format needs d_qk = ", d, ", got shape ", shape_string(kv)));
  FLASHMLA_RETURN_IF_ERROR(check_fp8_cache(packed, "packed", format));
  FLASHMLA_RETURN_IF_ERROR(check_last_dim_contiguous(kv, "kv_cache"));
  FLASHMLA_RETURN_IF_ERROR(check_strides(kv, "kv_cache"));
  if (packed.shape[0] != kv.shape[0] || packed.shape[1] != kv.shape[1])
    return value_error(cat("packed: expected ", kv.shape[0], " blocks of ", kv.shape[1], " tokens, got shape ",
                           shape_string(packed)));
  if (kv.device.type != DeviceType::kCPU || packed.device.type != DeviceType::kCPU)
    return Status::Error(ErrorKind::kNotImplemented,
                         "FP8 KV-cache conversion runs on the CPU: pass CPU tensors");
  return Status::Ok();
}

namespace {
/// Splits an operator's arguments (tensors_of order: inputs, metadata, outputs) into what it reads
/// and what it writes; the metadata buffers are written unless `metadata_ready`.
template <typename Params>
Status check_aliasing(const Params& p, size_t num_outputs, size_t num_metadata, bool metadata_ready) {
  const std::vector<Named> all = tensors_of(p);
  const size_t first_written = all.size() - num_outputs - (metadata_ready ? 0 : num_metadata);
  std::vector<Named> ins(all.begin(), all.begin() + first_written), outs(all.begin() + first_written, all.end());
  return check_outputs_disjoint(ins, outs, p.workspace, p.workspace_bytes);
}
}  // namespace

Status validate_data(const DenseDecodeParams& p) { return check_data(tensors_of(p)); }
Status validate_data(const SparseDecodeParams& p) { return check_data(tensors_of(p)); }
Status validate_data(const SparsePrefillParams& p) { return check_data(tensors_of(p)); }
Status validate_data(const DensePrefillParams& p) { return check_data(tensors_of(p)); }
Status validate_data(const DensePrefillBwdParams& p) { return check_data(tensors_of(p)); }
Status validate_no_aliasing(const DenseDecodeParams& p) { return check_aliasing(p, 2, 2, p.metadata_ready); }
Status validate_no_aliasing(const SparseDecodeParams& p) { return check_aliasing(p, 2, 2, p.metadata_ready); }
Status validate_no_aliasing(const SparsePrefillParams& p) { return check_aliasing(p, 3, 0, true); }
Status validate_no_aliasing(const DensePrefillParams& p) { return check_aliasing(p, 2, 0, true); }
Status validate_no_aliasing(const DensePrefillBwdParams& p) { return check_aliasing(p, 3, 0, true); }
Status validate_kv_quant_data(const TensorRef& kv_bf16, const TensorRef& packed, bool packed_is_output) {
  FLASHMLA_RETURN_IF_ERROR(check_data({{&kv_bf16, "kv_cache"}, {&packed, "packed"}}));
  const Named kv{&kv_bf16, "kv_cache"}, pk{&packed, "packed"};
  FLASHMLA_RETURN_IF_ERROR(packed_is_output ? check_outputs_disjoint({kv}, {pk}, nullptr, 0)
                                            : check_outputs_disjoint({pk}, {kv}, nullptr, 0));
  return packed_is_output ? check_output_layout(packed, "packed") : check_output_layout(kv_bf16, "kv_cache");
}

}  // namespace flashmla::core
