// src/sm90/decode/sparse_fp8/main_kernels.cuh — the sparse FP8 decode main kernels and the launch of
// the one sparse_decode.cu chose, for FP8 format F. Instantiated once per format
// (instantiations_v32.cu / instantiations_model1.cu) so that the two compile in parallel.
#pragma once

#include "sm90/decode/sparse_fp8/mma_small_heads_kernel.cuh"
#include "sm90/decode/sparse_fp8/wgmma_producer_kernel.cuh"

namespace flashmla::sm90::sparse {

/// The wgmma producer kernel when kp.main_kernel asks for it and it can run the call; else the mma.sync
/// kernels (launch_main_auto).
template <Fmt F>
cudaError_t launch_chosen_main(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  if (kp.main_kernel == SparseDecodeMainKernel::kWgmmaProducer && wgmma_producer::usable(kp)) {
    // The wgmma producer kernel refuses (cudaErrorInvalidConfiguration) when its compiled register
    // count cannot fund the setmaxnreg split; the mma.sync kernel serves the call then.
    const cudaError_t e = wgmma_producer::launch<F>(kp, num_sm_parts, stream);
    if (e != cudaErrorInvalidConfiguration) return e;
  }
  return launch_main_auto<F>(kp, num_sm_parts, stream);
}

}  // namespace flashmla::sm90::sparse
