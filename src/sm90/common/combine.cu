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
#include "sm90/common/host_utils.h"
#include "sm90/common/combine.cuh"
#include "sm90/common/utils.cuh"

namespace flashmla::sm90 {

namespace {

template <typename T, int J>
__global__ void __launch_bounds__(256) flash_fwd_mla_combine_kernel(const DenseCombineParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bs = static_cast<int>(blockIdx.x);  // < 2^31: 32-bit division, no call
  const int bi = bs / p.s_q, sq = bs % p.s_q;
  const int h = blockIdx.y * 8 + warp;
  if (h >= p.h_q) return;
  const int start = p.num_splits[bi];
  const int n = p.num_splits[bi + 1] - start;
  if (n <= 1) return;  // the main kernel wrote this request directly
  wait_prerequisite_grids();  // the main kernel's partials (launched as its programmatic dependent)

  const int g = h / p.group;
  const int64_t row = static_cast<int64_t>(sq) * p.group + (h % p.group);
  const int64_t split_stride = static_cast<int64_t>(p.h_kv) * p.m_rows;  // rows between splits
  const int64_t base_row = (static_cast<int64_t>(start) * p.h_kv + g) * p.m_rows + row;
  const int f4 = static_cast<int>(blockIdx.z) * 32 * J + lane;  // this lane's first float4 of the row
  float4 acc[J];
  const float lse2 = combine_merge_row<J>(p.lse_accum + base_row, reinterpret_cast<const float4*>(p.o_accum) + base_row * 128,
                                          n, split_stride, f4, lane, false, 0.f, acc);
  if (lane == 0 && blockIdx.z == 0) {
    p.lse[bi * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = lse2 == INFINITY ? INFINITY : lse2 * kLn2;
  }
  combine_store_row(static_cast<T*>(p.out) + bi * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h, p.o_stride_d,
                    p.out_vec_ok, f4, acc);
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
  auto go = [&](auto kernel) { return launch_programmatic_dependent(kernel, grid, dim3(256), 0, stream, cp); };
  if (is_fp16) {
    if (j == 1) return go(flash_fwd_mla_combine_kernel<__half, 1>);
    if (j == 2) return go(flash_fwd_mla_combine_kernel<__half, 2>);
    return go(flash_fwd_mla_combine_kernel<__half, 4>);
  }
  if (j == 1) return go(flash_fwd_mla_combine_kernel<__nv_bfloat16, 1>);
  if (j == 2) return go(flash_fwd_mla_combine_kernel<__nv_bfloat16, 2>);
  return go(flash_fwd_mla_combine_kernel<__nv_bfloat16, 4>);
}

}  // namespace flashmla::sm90
