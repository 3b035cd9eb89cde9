// src/sm90/sparse_prefill_512.cu — instantiations of the sparse prefill kernels for
// d_qk 512 (MODEL1). One file per head dim so the two compile in parallel.
#include "sm90/sparse_prefill_kernel.cuh"
#include "sm90/sparse_prefill_kernel_v2.cuh"
#include "sm90/sparse_prefill_kernel_v4.cuh"

namespace flashmla::sm90 {

cudaError_t launch_sparse_prefill_wgmma_512(const SparsePrefillKernelParams& kp, cudaStream_t stream) {
  return sparse_prefill::wg::launch<512>(kp, stream);
}
cudaError_t launch_sparse_prefill_seesaw_512(const SparsePrefillKernelParams& kp, int variant, cudaStream_t stream) {
  if (variant == 3) return sparse_prefill::ss::launch<512, true, true, true>(kp, stream);
  if (variant == 2) return sparse_prefill::ss::launch<512, true, true>(kp, stream);
  if (variant == 1) return sparse_prefill::ss::launch<512, true, false>(kp, stream);
  return sparse_prefill::ss::launch<512, false>(kp, stream);
}
cudaError_t launch_sparse_prefill_persist_512(const SparsePrefillKernelParams& kp, bool l2_hint, int grid_cap,
                                              cudaStream_t stream) {
  return l2_hint ? sparse_prefill::ps::launch<512, true>(kp, grid_cap, stream)
                 : sparse_prefill::ps::launch<512, false>(kp, grid_cap, stream);
}
cudaError_t launch_sparse_prefill_mma_512(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream) {
  return sparse_prefill::ms::launch<512>(kp, bm, stream);
}

}  // namespace flashmla::sm90
