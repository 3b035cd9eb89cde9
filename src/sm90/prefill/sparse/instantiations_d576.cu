// src/sm90/prefill/sparse/instantiations_d576.cu — instantiations of the sparse prefill kernels for
// d_qk 576 (V3.2). One file per head dim so the two compile in parallel.
#include "sm90/prefill/sparse/mma_sync_kernel.cuh"
#include "sm90/prefill/sparse/wgmma_seesaw_kernel.cuh"

namespace flashmla::sm90 {

cudaError_t launch_sparse_prefill_seesaw_576(const SparsePrefillKernelParams& kp, cudaStream_t stream) {
  return sparse_prefill::wgmma_seesaw::launch<576>(kp, stream);
}
cudaError_t launch_sparse_prefill_mma_576(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream) {
  return sparse_prefill::mma_sync::launch<576>(kp, bm, stream);
}

}  // namespace flashmla::sm90
