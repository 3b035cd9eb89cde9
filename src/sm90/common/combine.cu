// src/sm90/common/combine.cu — merges the split-KV partials of dense decode (spec §4.5).
//
// Grid (b*s_q, ceil(h_q/8), 4/J): b*s_q on x (no 65535 limit), one warp per query
// head and slice of 128*J output dims (J float4 per lane; small grids split the 512 dims
// over z so that more SMs share the partials' bytes). Requests with a single split were written by the main kernel and are
// skipped. Partials: lse_accum[k] = log2(L_k) + m_k (base 2, -inf if empty),
// o_accum[k] = O_k / L_k. Result: lse = ln2 * log2(sum_k 2^lse_k) (+inf if
// every split is empty), out = sum_k 2^(lse_k - lse2) * o_accum[k].
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "sm90/decode/dense/dense_decode.h"
#include "sm90/sm90.h"
#include "sm90/common/combine.cuh"
#include "sm90/common/utils.cuh"

namespace flashmla::sm90 {

namespace {

template <typename T, int J>
__global__ void __launch_bounds__(256) flash_fwd_mla_combine_kernel(const DenseCombineParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bs = blockIdx.x;
  const int bi = static_cast<int>(bs / p.s_q), sq = static_cast<int>(bs % p.s_q);
  const int h = blockIdx.y * 8 + warp;
  if (h >= p.h_q) return;
  const int start = p.num_splits[bi];
  const int n = p.num_splits[bi + 1] - start;
  if (n <= 1) return;  // the main kernel wrote this request directly

  const int g = h / p.group;
  const int64_t row = static_cast<int64_t>(sq) * p.group + (h % p.group);
  const int64_t split_stride = static_cast<int64_t>(p.h_kv) * p.m_rows;  // rows between splits
  const int64_t base_row = (static_cast<int64_t>(start) * p.h_kv + g) * p.m_rows + row;
  const float* la = p.lse_accum + base_row;

  float mx;
  const float s = combine_split_sum(la, n, split_stride, lane, mx);
  const float lse2 = row_sum_empty(s) ? INFINITY : log2f(s) + mx;  // a NaN split makes s NaN
  if (lane == 0 && blockIdx.z == 0) {
    p.lse[bi * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = lse2 == INFINITY ? INFINITY : lse2 * kLn2;
  }

  const int f4 = static_cast<int>(blockIdx.z) * 32 * J + lane;  // this lane's first float4 of the row
  float4 acc[J];
#pragma unroll
  for (int j = 0; j < J; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  // Splits in chunks of 32: lane k computes split c + k's weight once, the loop takes it with a
  // shuffle, so the partials' loads do not wait for a per-split lse load and up to 16 / J of them
  // are in flight per lane (b = 1 has ~33 splits per row: one memory latency per 4 splits before).
  for (int c = 0; c < n; c += 32) {
    const int m = min(32, n - c);
    const float w_lane = lane < m ? exp2f(la[(c + lane) * split_stride] - lse2) : 0.f;
    const float4* o = reinterpret_cast<const float4*>(p.o_accum + (base_row + c * split_stride) * 512);
#pragma unroll (16 / J)
    for (int k = 0; k < m; ++k) {
      const float w = __shfl_sync(0xffffffffu, w_lane, k);
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const float4 v = o[k * split_stride * 128 + f4 + 32 * j];
        acc[j].x += w * v.x;
        acc[j].y += w * v.y;
        acc[j].z += w * v.z;
        acc[j].w += w * v.w;
      }
    }
  }
  T* out = static_cast<T*>(p.out) + bi * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int d = (f4 + 32 * j) * 4;
    if (p.out_vec_ok) {
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
      out[(d + 0) * p.o_stride_d] = HalfTraits<T>::from_float(acc[j].x);
      out[(d + 1) * p.o_stride_d] = HalfTraits<T>::from_float(acc[j].y);
      out[(d + 2) * p.o_stride_d] = HalfTraits<T>::from_float(acc[j].z);
      out[(d + 3) * p.o_stride_d] = HalfTraits<T>::from_float(acc[j].w);
    }
  }
}

}  // namespace

int combine_float4s_per_lane(int64_t ctas) {
  int device = 0;
  const int sms = cudaGetDevice(&device) == cudaSuccess ? num_sms(device) : 132;
  if (ctas * 4 <= 2LL * sms) return 1;
  if (ctas * 2 <= 2LL * sms) return 2;
  return 4;
}

cudaError_t launch_dense_combine(const DenseCombineParams& cp, bool is_fp16, cudaStream_t stream) {
  const int64_t x = static_cast<int64_t>(cp.b) * cp.s_q, y = (cp.h_q + 7) / 8;
  const int j = combine_float4s_per_lane(x * y);
  const dim3 grid(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(4 / j));
  auto go = [&](auto kernel) { kernel<<<grid, 256, 0, stream>>>(cp); };
  if (is_fp16) {
    if (j == 1) go(flash_fwd_mla_combine_kernel<__half, 1>);
    else if (j == 2) go(flash_fwd_mla_combine_kernel<__half, 2>);
    else go(flash_fwd_mla_combine_kernel<__half, 4>);
  } else {
    if (j == 1) go(flash_fwd_mla_combine_kernel<__nv_bfloat16, 1>);
    else if (j == 2) go(flash_fwd_mla_combine_kernel<__nv_bfloat16, 2>);
    else go(flash_fwd_mla_combine_kernel<__nv_bfloat16, 4>);
  }
  return cudaGetLastError();
}

}  // namespace flashmla::sm90
