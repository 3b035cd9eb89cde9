// tools/dense_prefill_check/standalone.h — what a program that builds the sm90 dense MHA prefill kernels without the
// package needs beside them (the standalone check's shim.cpp, tools/trace/dense_prefill_fwd_trace.cu). Include it in
// exactly one translation unit of the program: it defines flashmla::sm90::num_sms.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flashmla/ops.h"
#include "sm90/sm90.h"

// The persistent forward sizes its grid by the SM count; the package's cached num_sms lives in the dense decode
// launcher, which these programs do not build.
namespace flashmla::sm90 {
int num_sms(int device_id) {
  int n = 0;
  return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device_id) == cudaSuccess && n > 0 ? n : 132;
}
}  // namespace flashmla::sm90

namespace flashmla::standalone {
/// A TensorRef of a CUDA buffer; meta: ndim shape entries then ndim stride entries (elements).
inline TensorRef cuda_ref(void* data, DType dt, int ndim, const int64_t* meta, int device) {
  TensorRef t;
  t.defined = true;
  t.data = data;
  t.dtype = dt;
  t.ndim = ndim;
  for (int i = 0; i < ndim; ++i) {
    t.shape[i] = meta[i];
    t.stride[i] = meta[ndim + i];
  }
  t.device.type = DeviceType::kCUDA;
  t.device.id = device;
  return t;
}
}  // namespace flashmla::standalone
