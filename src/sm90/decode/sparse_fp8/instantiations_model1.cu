// src/sm90/decode/sparse_fp8/instantiations_model1.cu — the sparse FP8 decode main kernels for
// the MODEL1 format (d_qk 512, per-page-block data + scale records). One file per format so the two compile in parallel.
#include "sm90/decode/sparse_fp8/main_kernels.cuh"

namespace flashmla::sm90 {

cudaError_t launch_sparse_main_model1(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  return sparse::launch_chosen_main<sparse::Fmt::kModel1>(kp, num_sm_parts, stream);
}

}  // namespace flashmla::sm90
