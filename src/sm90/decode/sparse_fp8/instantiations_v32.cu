// src/sm90/decode/sparse_fp8/instantiations_v32.cu — the sparse FP8 decode main kernels for
// the V32 format (d_qk 576, 656 bytes/token). One file per format so the two compile in parallel.
#include "sm90/decode/sparse_fp8/main_kernels.cuh"

namespace flashmla::sm90 {

cudaError_t launch_sparse_main_v32(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  return sparse::launch_chosen_main<sparse::Fmt::kV32>(kp, num_sm_parts, stream);
}

}  // namespace flashmla::sm90
