// Instantiation of the dense-decode main kernel for fp16 (compiled in parallel with bf16).
#include "sm90/dense_decode_kernel.cuh"

namespace flashmla::sm90 {
cudaError_t launch_dense_main_fp16(const DenseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  return dense_v1::launch_main<__half>(kp, num_sm_parts, stream);
}
}  // namespace flashmla::sm90
