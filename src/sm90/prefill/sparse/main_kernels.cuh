// src/sm90/prefill/sparse/main_kernels.cuh — the sparse prefill kernels and the launch of the one
// sparse_prefill.cu chose, for head dim kD. Instantiated once per head dim (instantiations_d576.cu /
// instantiations_d512.cu) so that the two compile in parallel.
#pragma once

#include "sm90/prefill/sparse/mma_sync_kernel.cuh"
#include "sm90/prefill/sparse/wgmma_seesaw_kernel.cuh"

namespace flashmla::sm90::sparse_prefill {

/// bm = rows per head tile: 64 runs the seesaw kernel, 16 or 32 the mma.sync kernel (sparse_prefill.h).
template <int kD>
cudaError_t launch_main(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream) {
  return bm == 64 ? wgmma_seesaw::launch<kD>(kp, stream) : mma_sync::launch<kD>(kp, bm, stream);
}

}  // namespace flashmla::sm90::sparse_prefill
