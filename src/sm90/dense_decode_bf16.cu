// Instantiation of the dense-decode main kernels for bf16 (compiled in parallel with the other dtype).
#include "sm90/dense_decode_kernel.cuh"
#include "sm90/dense_decode_kernel_v2.cuh"

namespace flashmla::sm90 {
cudaError_t launch_dense_main_bf16(const DenseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  // v2 (wgmma, 64-row tiles) when the rows of a KV head exceed 32; v1 (mma.sync,
  // 16/32-row tiles) for small head counts, where decode is memory-bound.
  const int version = dense_kernel_version();
  if (version == 2 || (version == 0 && kp.m_rows > 32)) return dense_v2::launch_main<__nv_bfloat16>(kp, num_sm_parts, stream);
  return dense_v1::launch_main<__nv_bfloat16>(kp, num_sm_parts, stream);
}
}  // namespace flashmla::sm90
