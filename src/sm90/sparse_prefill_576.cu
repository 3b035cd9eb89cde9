// src/sm90/sparse_prefill_576.cu — instantiations of the sparse prefill kernels for
// d_qk 576 (V3.2). One file per head dim so the two compile in parallel.
#include "sm90/sparse_prefill_kernel.cuh"
#include "sm90/sparse_prefill_kernel_v2.cuh"
#include "sm90/sparse_prefill_kernel_v4.cuh"

namespace flashmla::sm90 {

cudaError_t launch_sparse_prefill_wgmma_576(const SparsePrefillKernelParams& kp, cudaStream_t stream) {
  return sparse_prefill::wg::launch<576>(kp, stream);
}
cudaError_t launch_sparse_prefill_seesaw_576(const SparsePrefillKernelParams& kp, int variant, cudaStream_t stream) {
  if (variant == 3) return sparse_prefill::ss::launch<576, true, true, true>(kp, stream);
  if (variant == 2) return sparse_prefill::ss::launch<576, true, true>(kp, stream);
  if (variant == 1) return sparse_prefill::ss::launch<576, true, false>(kp, stream);
  return sparse_prefill::ss::launch<576, false>(kp, stream);
}
cudaError_t launch_sparse_prefill_persist_576(const SparsePrefillKernelParams& kp, bool l2_hint, int grid_cap,
                                              cudaStream_t stream) {
  return l2_hint ? sparse_prefill::ps::launch<576, true>(kp, grid_cap, stream)
                 : sparse_prefill::ps::launch<576, false>(kp, grid_cap, stream);
}
cudaError_t launch_sparse_prefill_mma_576(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream) {
  return sparse_prefill::ms::launch<576>(kp, bm, stream);
}

}  // namespace flashmla::sm90
