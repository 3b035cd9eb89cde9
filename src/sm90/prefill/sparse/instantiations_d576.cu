// src/sm90/sparse_prefill_576.cu — instantiations of the sparse prefill kernels for
// d_qk 576 (V3.2). One file per head dim so the two compile in parallel.
#include "sm90/sparse_prefill_kernel.cuh"
#include "sm90/sparse_prefill_kernel_v2.cuh"

namespace flashmla::sm90 {

cudaError_t launch_sparse_prefill_v3w_576(const SparsePrefillKernelParams& kp, cudaStream_t stream) {
  return sparse_prefill::ss::launch<576>(kp, stream);
}
cudaError_t launch_sparse_prefill_mma_576(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream) {
  return sparse_prefill::ms::launch<576>(kp, bm, stream);
}

}  // namespace flashmla::sm90
