// src/sm90/decode/dense/main_kernels.cuh — the dense-decode main kernels and the launch of the one
// dense_decode.cu chose, for element type T. Instantiated once per dtype (instantiations_bf16.cu /
// instantiations_fp16.cu) so that the two compile in parallel.
#pragma once

#include "sm90/decode/dense/mma_sync_kernel.cuh"
#include "sm90/decode/dense/wgmma_kernel.cuh"
#include "sm90/decode/dense/wgmma_seesaw_kernel.cuh"

namespace flashmla::sm90 {

/// Launches main kernel `kernel` (never kAuto; the seesaw kernel needs tmap) for T = __nv_bfloat16 or
/// __half; cudaErrorInvalidValue for kAuto or a seesaw call without a map.
template <typename T>
cudaError_t launch_dense_main(const DenseDecodeKernelParams& kp, const CUtensorMap* tmap, int num_sm_parts,
                              DenseKernel kernel, cudaStream_t stream) {
  switch (kernel) {
    case DenseKernel::kSeesaw:
      if (tmap == nullptr) return cudaErrorInvalidValue;
      return dense_seesaw::launch_main<T>(kp, *tmap, num_sm_parts, stream);
    case DenseKernel::kWgmma:
      return dense_wgmma::launch_main<T>(kp, num_sm_parts, stream);
    case DenseKernel::kMmaSync:
      return dense_mma::launch_main<T>(kp, num_sm_parts, stream);
    case DenseKernel::kAuto:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace flashmla::sm90
