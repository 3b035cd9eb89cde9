// src/sm90/host_utils.h — host-side helpers shared by the sm90 launchers.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flashmla/status.h"

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

}  // namespace flashmla::sm90
