// src/sm90/prefill/sparse/instantiations_d512.cu — the sparse prefill kernels for d_qk 512 (MODEL1).
// One file per head dim so the two compile in parallel.
#include "sm90/prefill/sparse/main_kernels.cuh"

namespace flashmla::sm90 {

cudaError_t launch_sparse_prefill_512(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream) {
  return sparse_prefill::launch_main<512>(kp, bm, stream);
}

}  // namespace flashmla::sm90
