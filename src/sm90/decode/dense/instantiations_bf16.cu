// src/sm90/decode/dense/instantiations_bf16.cu — the dense-decode main kernels for bf16 (one file per
// dtype so the two compile in parallel). The choice of kernel is made in dense_decode.cu.
#include "sm90/decode/dense/mma_sync_kernel.cuh"
#include "sm90/decode/dense/wgmma_kernel.cuh"
#include "sm90/decode/dense/wgmma_seesaw_kernel.cuh"

namespace flashmla::sm90 {
cudaError_t launch_dense_main_bf16(const DenseDecodeKernelParams& kp, const CUtensorMap* tmap, int num_sm_parts,
                                   DenseKernel kernel, cudaStream_t stream) {
  switch (kernel) {
    case DenseKernel::kSeesaw:
      if (tmap == nullptr) return cudaErrorInvalidValue;
      return dense_seesaw::launch_main<__nv_bfloat16>(kp, *tmap, num_sm_parts, stream);
    case DenseKernel::kWgmma:
      return dense_wgmma::launch_main<__nv_bfloat16>(kp, num_sm_parts, stream);
    case DenseKernel::kMmaSync:
      return dense_mma::launch_main<__nv_bfloat16>(kp, num_sm_parts, stream);
    case DenseKernel::kAuto:
      break;
  }
  return cudaErrorInvalidValue;
}
}  // namespace flashmla::sm90
