// src/sm90/common/combine.cuh — pieces of the split-KV merge shared by the dense and the sparse decode
// combine kernels (spec §4.5). A split k's partial LSE is lse_k = log2(L_k) + m_k (base 2, -inf for an
// empty split); the splits of one output row lie split_stride rows apart.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "sm90/common/utils.cuh"

namespace flashmla::sm90 {

/// Sum over the n splits of 2^(lse_k - mx), reduced over the warp; `mx` is set to the largest lse_k
/// (0 when every split is empty, so that the sum is then 0). A NaN split makes the sum NaN.
__device__ __forceinline__ float combine_split_sum(const float* la, int n, int64_t split_stride, int lane, float& mx) {
  mx = -INFINITY;
  for (int k = lane; k < n; k += 32) mx = fmaxf(mx, la[k * split_stride]);
  mx = warp_max(mx);
  if (mx == -INFINITY) mx = 0.f;
  float s = 0.f;
  for (int k = lane; k < n; k += 32) s += exp2f(la[k * split_stride] - mx);
  return warp_sum(s);
}

}  // namespace flashmla::sm90
