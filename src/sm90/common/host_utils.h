// src/sm90/common/host_utils.h — host-side helpers shared by the sm90 launchers.
#pragma once

#include <cuda.h>  // CUtensorMap and the cuTensorMapEncodeTiled types (the function itself via the runtime)
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flashmla/status.h"
#include "flashmla/tensor.h"

namespace flashmla::sm90 {

/// kRuntime Status for a failed CUDA call: "<op> (sm90): <what> failed: <name>: <description>".
inline Status cuda_error_status(const char* op, const char* what, cudaError_t e) {
  return Status::Error(ErrorKind::kRuntime, std::string(op) + " (sm90): " + what + " failed: " +
                                                cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

/// kValue Status for an input the launcher cannot handle: "<op> (sm90): <what>".
inline Status value_error_status(const char* op, const std::string& what) {
  return Status::Error(ErrorKind::kValue, std::string(op) + " (sm90): " + what);
}

/// True when every row of `t`'s first `dims` dimensions starts 16-byte aligned: the base address
/// is, and each of those strides (2-byte elements: bf16 / fp16) is a multiple of 8 elements wherever
/// that dimension has more than one index. The launchers' test for cp.async / bulk-copy rows.
inline bool rows_16b_aligned(const TensorRef& t, int dims) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int i = 0; i < dims; ++i)
    if (t.shape[i] > 1 && (t.stride[i] * 2) % 16 != 0) return false;
  return true;
}

/// Fills a decode main kernel's query fields: q (b, s_q, h_q, d_qk), its pointer and its strides in
/// elements (b, s and h; the last dim is read contiguous).
template <class Params>
void set_decode_query(Params& kp, const TensorRef& q) {
  kp.q = q.data;
  kp.q_stride_b = q.stride[0];
  kp.q_stride_s = q.stride[1];
  kp.q_stride_h = q.stride[2];
}

/// Fills a decode launch's output fields (the main kernels' and the combine kernels' parameters):
/// out (b, s_q, h_q, 512) and lse (b, h_q, s_q, float32), their pointers and strides in elements, and
/// the split-KV buffers: o_accum (splits, rows, 512) and lse_accum (splits, rows) float32, num_splits
/// (b + 1) int32 prefix sums of splits per request.
template <class Params>
void set_decode_outputs(Params& kp, const TensorRef& out, const TensorRef& lse, float* o_accum, float* lse_accum,
                        const int32_t* num_splits) {
  kp.out = out.data;
  kp.o_stride_b = out.stride[0];
  kp.o_stride_s = out.stride[1];
  kp.o_stride_h = out.stride[2];
  kp.o_stride_d = out.stride[3];
  kp.lse = static_cast<float*>(lse.data);
  kp.lse_stride_b = lse.stride[0];
  kp.lse_stride_h = lse.stride[1];
  kp.lse_stride_s = lse.stride[2];
  kp.o_accum = o_accum;
  kp.lse_accum = lse_accum;
  kp.num_splits = num_splits;
}

/// True when `t` (rank dimensions, 2-byte elements: bf16 / fp16) can take 4-byte stores of element
/// pairs: its last dim is contiguous, every other stride is even wherever that dimension has more
/// than one index, and the base address is 4-byte aligned. The launchers' test for the epilogues'
/// paired stores.
inline bool element_pairs_aligned(const TensorRef& t, int rank) {
  if (t.stride[rank - 1] != 1 || reinterpret_cast<uintptr_t>(t.data) % 4 != 0) return false;
  for (int i = 0; i < rank - 1; ++i)
    if (t.shape[i] > 1 && t.stride[i] % 2 != 0) return false;
  return true;
}

/// cuTensorMapEncodeTiled, fetched once through the runtime's driver entry point (so nothing links
/// -lcuda); nullptr when the driver does not provide it (the callers then take their non-TMA path).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiledFn encode_tiled_fn() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // the failed query's error, not the caller's
      f = nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

/// Makes `device` current for the lifetime of the guard (tensors may live on any GPU).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    err_ = cudaGetDevice(&prev_);
    if (err_ == cudaSuccess && prev_ != device) {
      err_ = cudaSetDevice(device);
      switched_ = err_ == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t error() const { return err_; }

 private:
  int prev_ = 0;
  bool switched_ = false;
  cudaError_t err_ = cudaSuccess;
};

/// cudaFuncSetAttribute(func, MaxDynamicSharedMemorySize, bytes), skipped when it was already done
/// for this kernel on the current device with at least `bytes` (the attribute is per function and
/// device and stays set). Saves a runtime call per launch on the decode hot path. The set runs under
/// the lock and never lowers the value: two threads asking for different sizes of one kernel must
/// not leave the attribute below what the cache records (a later launch would then fail).
inline cudaError_t set_max_dynamic_smem_cached(const void* func, int bytes) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  static std::mutex mu;
  static std::unordered_map<const void*, std::vector<int>> done;  // per kernel: bytes set, per device
  std::lock_guard<std::mutex> lock(mu);
  std::vector<int>& v = done[func];
  if (device >= static_cast<int>(v.size())) v.resize(device + 1, 0);
  if (v[device] >= bytes) return cudaSuccess;
  e = cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return e;
  v[device] = bytes;
  return cudaSuccess;
}

template <class Kernel>
cudaError_t set_max_dynamic_smem(Kernel* kernel, int bytes) {
  return set_max_dynamic_smem_cached(reinterpret_cast<const void*>(kernel), bytes);
}

/// Launches `kernel` on `stream` as a programmatic dependent of the kernel before it on the stream
/// (cudaLaunchAttributeProgrammaticStreamSerialization): its CTAs may start once every CTA of that
/// kernel has executed `griddepcontrol.launch_dependents` or exited, so the kernel must call
/// wait_prerequisite_grids() (utils.cuh) before it reads anything the previous kernel writes. Used for
/// the decode combines after their main kernels (as FlashMLA launches its combine). Stream capture turns
/// the dependency into a programmatic graph edge (CUDA 12.3 and later).
template <class... Params, class... Args>
cudaError_t launch_programmatic_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                          cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace flashmla::sm90
