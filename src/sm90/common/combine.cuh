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

/// This lane's J float4 slices of one 512-float partial row: float4s f4 + 32 j of `row`. The combines
/// load split 0's slices right after their wait for the main kernel, before the split weights are known,
/// so that those loads overlap the lse loads and the reductions (one memory latency less per row).
template <int J>
__device__ __forceinline__ void combine_load_slices(const float4* row, int f4, float4 (&v)[J]) {
#pragma unroll
  for (int j = 0; j < J; ++j) v[j] = row[f4 + 32 * j];
}

/// acc = sum over the n splits of w_k * o_k (this lane's J slices), w_k = 2^(la[k] - lse2) * factor;
/// `o` is split 0's partial row (float4s; split k's row lies k * split_stride rows further) and `first`
/// its slices already loaded (combine_load_slices). Splits in chunks of 32: lane k computes split
/// c + k's weight once and the loop takes it with a shuffle, so the partials' loads do not wait for a
/// per-split lse load and up to 16 / J of them are in flight per lane. Accumulates in split order.
template <int J>
__device__ __forceinline__ void combine_accumulate(const float* la, const float4* o, int n, int64_t split_stride,
                                                   int f4, float lse2, float factor, int lane,
                                                   const float4 (&first)[J], float4 (&acc)[J]) {
#pragma unroll
  for (int j = 0; j < J; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int c = 0; c < n; c += 32) {
    const int m = min(32, n - c);
    const float w_lane = lane < m ? exp2f(la[(c + lane) * split_stride] - lse2) * factor : 0.f;
    int k = 0;
    if (c == 0) {
      const float w = __shfl_sync(0xffffffffu, w_lane, 0);
#pragma unroll
      for (int j = 0; j < J; ++j) {
        acc[j].x += w * first[j].x;
        acc[j].y += w * first[j].y;
        acc[j].z += w * first[j].z;
        acc[j].w += w * first[j].w;
      }
      k = 1;
    }
#pragma unroll(16 / J)
    for (; k < m; ++k) {
      const float w = __shfl_sync(0xffffffffu, w_lane, k);
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const float4 v = o[(c + k) * split_stride * 128 + f4 + 32 * j];
        acc[j].x += w * v.x;
        acc[j].y += w * v.y;
        acc[j].z += w * v.z;
        acc[j].w += w * v.w;
      }
    }
  }
}

/// Stores this lane's J slices of a merged row to `out` (T = bf16 / fp16; the row's first element),
/// round to nearest: 8-byte stores where out is vector-writable (4-byte pairs where the row is only
/// 4-byte aligned), element by element with stride o_stride_d otherwise.
template <typename T, int J>
__device__ __forceinline__ void combine_store_row(T* out, int64_t o_stride_d, bool out_vec_ok, int f4,
                                                  const float4 (&acc)[J]) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int d = (f4 + 32 * j) * 4;
    if (out_vec_ok) {
      uint2 pk;
      pk.x = HalfTraits<T>::pack(acc[j].x, acc[j].y);
      pk.y = HalfTraits<T>::pack(acc[j].z, acc[j].w);
      if ((reinterpret_cast<uintptr_t>(out + d) & 7) == 0) {
        *reinterpret_cast<uint2*>(out + d) = pk;
      } else {
        reinterpret_cast<uint32_t*>(out + d)[0] = pk.x;
        reinterpret_cast<uint32_t*>(out + d)[1] = pk.y;
      }
    } else {
      out[(d + 0) * o_stride_d] = HalfTraits<T>::from_float(acc[j].x);
      out[(d + 1) * o_stride_d] = HalfTraits<T>::from_float(acc[j].y);
      out[(d + 2) * o_stride_d] = HalfTraits<T>::from_float(acc[j].z);
      out[(d + 3) * o_stride_d] = HalfTraits<T>::from_float(acc[j].w);
    }
  }
}

}  // namespace flashmla::sm90
