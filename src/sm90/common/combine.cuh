// src/sm90/common/combine.cuh — pieces of the split-KV merge shared by the dense and the sparse decode
// combine kernels (spec §4.5). A split k's partial LSE is lse_k = log2(L_k) + m_k (base 2, -inf for an
// empty split); the splits of one output row lie split_stride rows apart.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "sm90/common/utils.cuh"

namespace flashmla::sm90 {

/// One warp's merge of the n >= 1 splits of one output row: this lane's J float4 slices of the 512-float
/// row (float4s f4 + 32 j), acc = sum_k w_k o_k with w_k = 2^(lse_k - lse2) * factor, in split order.
/// `la`: split 0's partial lse (base 2, -inf for an empty split), `o`: split 0's partial row (float4s);
/// split k's lie k * split_stride rows further. Returns lse2 = log2(sum_k 2^lse_k) (+inf when every split
/// is empty, acc then 0; NaN when a split's lse is NaN). factor = 1 / (1 + 2^(sink_log2 - lse2)) when
/// has_sink (the attention sink, base 2), else 1.
/// Latency order: the partial rows of the first kAhead splits and the first 32 lse are loaded at once,
/// before the weights are known, so a row of few splits (the common case: a request cut by one or two
/// part boundaries) waits for one memory round trip, not three (lse, then the weights, then the rows).
/// Each lane keeps its split's lse in a register (l_lane) for the max, the sum and its weight. kAhead * J = 8
/// float4 a lane whatever J (split 0's in acc). nvcc 13.0: 64-78 registers, no spill; capping the sparse kernels
/// at 64 (`__launch_bounds__(256, 4)`) spilled and ran slower (H100). 16 / J ahead for J = 1 / 2 (102-107
/// registers) shortened the h_q 128 b = 2 calls but lengthened the h_q 64 ones on the H100 (docs/sparse-fp8-decode.md
/// "The combine's merge, one round trip"). A row whose splits are all empty gives exactly 0 (before: 0 * o_k).
template <int J>
__device__ __forceinline__ float combine_merge_row(const float* la, const float4* o, int n, int64_t split_stride,
                                                   int f4, int lane, bool has_sink, float sink_log2,
                                                   float4 (&acc)[J]) {
  constexpr int kAhead = 8 / J;  // splits whose partial rows load before the weights (split 0 into acc)
  const int64_t row_step = split_stride * 128;  // float4s between two splits' rows
  float4 ahead[kAhead - 1][J];
#pragma unroll
  for (int j = 0; j < J; ++j) acc[j] = n > 0 ? o[f4 + 32 * j] : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 1; k < kAhead; ++k) {
    if (k < n) {
#pragma unroll
      for (int j = 0; j < J; ++j) ahead[k - 1][j] = o[k * row_step + f4 + 32 * j];
    }
  }
  const float l_lane = lane < n ? la[lane * split_stride] : -INFINITY;
  float mx = l_lane;
#pragma unroll 1
  for (int k = lane + 32; k < n; k += 32) mx = fmaxf(mx, la[k * split_stride]);
  mx = warp_max(mx);
  if (mx == -INFINITY) mx = 0.f;  // every split empty: the sum is 0
  float s = exp2f(l_lane - mx);   // 0 for lanes >= n; NaN for a NaN split
#pragma unroll 1
  for (int k = lane + 32; k < n; k += 32) s += exp2f(la[k * split_stride] - mx);
  s = warp_sum(s);
  const bool empty = row_sum_empty(s);
  const float lse2 = empty ? INFINITY : log2f(s) + mx;
  if (empty) {
#pragma unroll
    for (int j = 0; j < J; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    return lse2;
  }
  const float factor = has_sink ? 1.f / (1.f + exp2f(sink_log2 - lse2)) : 1.f;
  const float w0 = lane < n ? exp2f(l_lane - lse2) * factor : 0.f;
  {
    const float w = __shfl_sync(0xffffffffu, w0, 0);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      acc[j].x *= w;
      acc[j].y *= w;
      acc[j].z *= w;
      acc[j].w *= w;
    }
  }
#pragma unroll
  for (int k = 1; k < kAhead; ++k) {
    if (k < n) {
      const float w = __shfl_sync(0xffffffffu, w0, k);
#pragma unroll
      for (int j = 0; j < J; ++j) {
        acc[j].x += w * ahead[k - 1][j].x;
        acc[j].y += w * ahead[k - 1][j].y;
        acc[j].z += w * ahead[k - 1][j].z;
        acc[j].w += w * ahead[k - 1][j].w;
      }
    }
  }
  // The rest in chunks of 32 splits: lane k holds split c + k's weight, the loop takes it by a shuffle,
  // and up to kAhead splits' rows are in flight per lane.
  for (int c = 0; c < n; c += 32) {
    const int m = min(32, n - c);
    const float w_lane = c == 0 ? w0 : (lane < m ? exp2f(la[(c + lane) * split_stride] - lse2) * factor : 0.f);
    int k = c == 0 ? kAhead : 0;
    const float4* row = o + (c + k) * row_step + f4;
#pragma unroll(kAhead)
    for (; k < m; ++k, row += row_step) {
      const float w = __shfl_sync(0xffffffffu, w_lane, k);
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const float4 v = row[32 * j];
        acc[j].x += w * v.x;
        acc[j].y += w * v.y;
        acc[j].z += w * v.z;
        acc[j].w += w * v.w;
      }
    }
  }
  return lse2;
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
