// Instantiation of the dense-decode main kernels for fp16 (compiled in parallel with the other dtype).
#include "sm90/decode/dense/mma_sync_kernel.cuh"
#include "sm90/decode/dense/wgmma_kernel.cuh"
#include "sm90/decode/dense/wgmma_seesaw_kernel.cuh"

namespace flashmla::sm90 {
cudaError_t launch_dense_main_fp16(const DenseDecodeKernelParams& kp, const CUtensorMap* tmap, int num_sm_parts,
                                   int version, cudaStream_t stream) {
  // Automatic choice: v4 (seesaw, TMA-fed wgmma) whenever the host could encode a K
  // tensor map; otherwise v2 (wgmma) when the rows of a KV head exceed 32 and v1
  // (mma.sync, 16/32-row tiles) below. 1 / 2 / 4 force v1 / v2 / v4 (v4 needs the tensor
  // map, else automatic). `version` = dense_effective_kernel_version() (explicit setting or
  // FLASHMLA_DENSE_DECODE_KERNEL).
  const bool tma = tmap != nullptr && kp.tma_ok;
  if (tma && (version == 0 || version == 4)) return dense_seesaw::launch_main<__half>(kp, *tmap, num_sm_parts, stream);
  if (version == 2 || (version != 1 && kp.m_rows > 32)) return dense_wgmma::launch_main<__half>(kp, num_sm_parts, stream);
  return dense_mma::launch_main<__half>(kp, num_sm_parts, stream);
}
}  // namespace flashmla::sm90
