#include "flashmla/tensor.h"

#include <limits>
#include <sstream>

namespace flashmla {

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kFloat8E4M3: return 1;
  }
  return 1;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat32: return "float32";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

std::string device_name(Device d) {
  if (d.type == DeviceType::kCPU) return d.id == 0 ? "cpu" : "cpu:" + std::to_string(d.id);
  if (d.type == DeviceType::kCUDA) return "cuda:" + std::to_string(d.id);
  return "unknown device type " + std::to_string(static_cast<int32_t>(d.type));
}

static TensorRef make_ref(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorRef t;
  t.defined = true;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  if (shape.size() > static_cast<size_t>(kMaxTensorDims)) {
    t.ndim = kInvalidTensorDims;  // rejected by every operator (core/validate.cpp)
    return t;
  }
  t.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  return t;
}

TensorRef make_tensor_ref(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorRef t = make_ref(data, dtype, shape, device);
  // Row-major strides. A product of sizes beyond int64 (a shape with more elements than 64-bit sizes
  // count) would be signed overflow here: the strides saturate at INT64_MAX instead, and the operators
  // reject such a tensor with a kValue Status naming it (or accept it when another size is 0: no elements).
  int64_t s = 1;
  bool saturated = false;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.stride[i] = saturated ? std::numeric_limits<int64_t>::max() : s;
    if (!saturated && __builtin_mul_overflow(s, t.shape[i], &s)) saturated = true;
  }
  return t;
}

TensorRef make_tensor_ref(void* data, DType dtype, std::initializer_list<int64_t> shape,
                          std::initializer_list<int64_t> stride, Device device) {
  TensorRef t = make_ref(data, dtype, shape, device);
  if (t.ndim == kInvalidTensorDims || stride.size() != shape.size()) {
    t.ndim = kInvalidTensorDims;  // one stride per dimension, or the tensor is rejected
    return t;
  }
  int i = 0;
  for (int64_t s : stride) t.stride[i++] = s;
  return t;
}

std::string shape_string(const TensorRef& t) {
  std::ostringstream os;
  os << "(";
  for (int i = 0; i < t.ndim; ++i) os << (i ? ", " : "") << t.shape[i];
  if (t.ndim == 1) os << ",";
  os << ")";
  return os.str();
}

}  // namespace flashmla
