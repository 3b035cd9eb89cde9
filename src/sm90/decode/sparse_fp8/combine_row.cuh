// src/sm90/decode/sparse_fp8/combine_row.cuh — the sparse FP8 decode's split-KV merge of one output row
// (request bi, query token sq, head h): the body of the combine kernel (sparse_decode.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "sm90/common/combine.cuh"
#include "sm90/common/utils.cuh"

namespace flashmla::sm90 {

/// One warp merges the n splits (from split index `start`) of row (bi, sq, h) over output dims
/// [512 / (4 / J) * slice, ...): lane `lane` takes float4s slice * 32 J + lane + 32 j, j < J (J = 4, slice 0:
/// the whole row). Writes out (bf16, round to nearest) and, from slice 0's lane 0, lse (natural log; +inf for
/// an empty row, whose out is 0). The attention sink scales the row by 1 / (1 + exp(sink_h - lse)).
/// P: any parameter struct with the combine's buffers (CombineBuffers' fields), attn_sink, s_q, h_q and
/// out_vec_ok. The partials must be visible to the calling thread (the combine kernel waits for the main
/// kernel first).
template <int J, class P>
__device__ __forceinline__ void sparse_combine_row(const P& p, int bi, int sq, int h, int start, int n, int slice,
                                                   int lane) {
  const int64_t split_stride = static_cast<int64_t>(p.s_q) * p.h_q;
  const int64_t base_row = (static_cast<int64_t>(start) * p.s_q + sq) * p.h_q + h;
  const float* la = p.lse_accum + base_row;
  const float4* o = reinterpret_cast<const float4*>(p.o_accum + base_row * 512);
  const int f4 = slice * 32 * J + lane;  // this lane's first float4 of the row
  float4 first[J];
  if (n > 0) combine_load_slices(o, f4, first);

  float mx;
  const float s = combine_split_sum(la, n, split_stride, lane, mx);
  const bool empty = row_sum_empty(s);  // a NaN split makes s NaN: not empty
  const float lse2 = empty ? INFINITY : log2f(s) + mx;
  if (lane == 0 && slice == 0)
    p.lse[bi * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = empty ? INFINITY : lse2 * kLn2;
  float factor = empty ? 0.f : 1.f;
  if (p.attn_sink != nullptr && !empty) factor = 1.f / (1.f + exp2f(p.attn_sink[h] * kLog2e - lse2));

  float4 acc[J];
  if (empty) {
#pragma unroll
    for (int j = 0; j < J; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  } else {
    combine_accumulate(la, o, n, split_stride, f4, lse2, factor, lane, first, acc);
  }
  combine_store_row(static_cast<__nv_bfloat16*>(p.out) + bi * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h,
                    p.o_stride_d, p.out_vec_ok, f4, acc);
}

}  // namespace flashmla::sm90
