// src/sm90/decode/sparse_fp8/instantiations_model1.cu — instantiations of the sparse FP8 decode kernels
// for the MODEL1 format (d_qk 512, per-page-block data + scale records).
#include "sm90/decode/sparse_fp8/mma_small_heads_kernel.cuh"
#include "sm90/decode/sparse_fp8/wgmma_producer_kernel.cuh"

namespace flashmla::sm90 {

cudaError_t launch_sparse_main_model1(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  if (kp.main_kernel == SparseDecodeMainKernel::kWgmmaProducer && sparse::wgmma_producer::usable(kp)) {
    // The wgmma producer kernel refuses (cudaErrorInvalidConfiguration) when its compiled register
    // count cannot fund the setmaxnreg split; the mma.sync kernel serves the call then.
    const cudaError_t e = sparse::wgmma_producer::launch<sparse::Fmt::kModel1>(kp, num_sm_parts, stream);
    if (e != cudaErrorInvalidConfiguration) return e;
  }
  return sparse::launch_main_auto<sparse::Fmt::kModel1>(kp, num_sm_parts, stream);
}

}  // namespace flashmla::sm90
