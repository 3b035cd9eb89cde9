// flashmla/tensor.h — framework-free, non-owning tensor references.
//
// A `TensorRef` describes memory owned by the caller (a framework tensor, a
// cudaMalloc'ed buffer, a std::vector): data pointer (already including any
// byte offset), dtype, shape and *element* strides. Bindings build them from
// DLPack / torch tensors; C++ users build them with `make_tensor_ref`.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

namespace flashmla {

/// Element types understood by the core. FP8 caches travel as 1-byte
/// `kUInt8` / `kInt8` / `kFloat8E4M3` bytes plus a `KVFormat` (see kv_format.h).
enum class DType : int32_t {
  kBFloat16 = 0,
  kFloat16,
  kFloat32,
  kInt32,
  kInt64,
  kUInt8,
  kInt8,
  kFloat8E4M3,
};

/// Size of one element in bytes.
int64_t dtype_size(DType dtype);
/// Human-readable dtype name as PyTorch spells it ("bfloat16", "int32", ...).
const char* dtype_name(DType dtype);

enum class DeviceType : int32_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int32_t id = 0;
  bool operator==(const Device& o) const { return type == o.type && id == o.id; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

/// "cpu" or "cuda:N".
std::string device_name(Device d);

constexpr int kMaxTensorDims = 6;
/// `ndim` of a TensorRef that `make_tensor_ref` could not build (more than kMaxTensorDims
/// dimensions, or a stride list whose length differs from the shape's); every operator rejects it
/// with a kValue Status.
constexpr int32_t kInvalidTensorDims = -1;

/// Non-owning view of a strided tensor.
///
/// `defined == false` marks an absent optional argument (FlashMLA's `None`).
/// `data` may be null for tensors with zero elements (and in the shapes-only `<op>_plan` calls);
/// the `<op>_fwd` operators reject a null `data` for a tensor with elements, and every operator a `data`
/// that is not a multiple of the element size. Strides are in
/// elements (not bytes), as in PyTorch and DLPack; outputs need non-negative strides that do not
/// map two elements to one address.
struct TensorRef {
  bool defined = false;
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int32_t ndim = 0;
  int64_t shape[kMaxTensorDims] = {0, 0, 0, 0, 0, 0};
  int64_t stride[kMaxTensorDims] = {0, 0, 0, 0, 0, 0};
  Device device{};

  int64_t size(int dim) const { return shape[dim]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  /// True if the strides describe a dense row-major layout (size-1 dims ignored).
  bool is_contiguous() const {
    int64_t expect = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && stride[i] != expect) return false;
      expect *= shape[i];
    }
    return true;
  }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

/// Build a row-major contiguous TensorRef over `data`. More than kMaxTensorDims dimensions give
/// `ndim == kInvalidTensorDims` (the operators then return a kValue Status). Strides whose products
/// overflow int64 saturate at INT64_MAX (no overflow in the call); the operators reject such a shape
/// (more elements than 64-bit sizes can count) with a kValue Status.
TensorRef make_tensor_ref(void* data, DType dtype, std::initializer_list<int64_t> shape,
                          Device device = {});
/// Build a TensorRef with explicit element strides, one per dimension (a stride list of another
/// length, or too many dimensions, give `ndim == kInvalidTensorDims`).
TensorRef make_tensor_ref(void* data, DType dtype, std::initializer_list<int64_t> shape,
                          std::initializer_list<int64_t> stride, Device device = {});

/// "(2, 3, 4)"-style rendering of a shape, for error messages.
std::string shape_string(const TensorRef& t);

}  // namespace flashmla
