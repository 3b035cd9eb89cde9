// src/sm90/decode/dense/instantiations_fp16.cu — the dense-decode main kernels for fp16 (one file per
// dtype so the two compile in parallel). The choice of kernel is made in dense_decode.cu.
#include "sm90/decode/dense/main_kernels.cuh"

namespace flashmla::sm90 {
cudaError_t launch_dense_main_fp16(const DenseDecodeKernelParams& kp, const CUtensorMap* tmap, int num_sm_parts,
                                   DenseKernel kernel, cudaStream_t stream) {
  return launch_dense_main<__half>(kp, tmap, num_sm_parts, kernel, stream);
}
}  // namespace flashmla::sm90
