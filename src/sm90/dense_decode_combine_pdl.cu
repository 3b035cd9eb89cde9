// src/sm90/dense_decode_combine_pdl.cu — opt-in (FLASHMLA_DENSE_DECODE_PDL=1) variant of the
// dense-decode combine (src/sm90/combine.cu) launched with Programmatic Dependent Launch.
//
// Same arithmetic and output as combine.cu's kernel (spec §4.5: lse = ln2 * log2(sum_k
// 2^lse_k), out = sum_k 2^(lse_k - lse2) * o_accum[k]; +inf / zeros when every split is
// empty; single-split requests were written by the main kernel and are skipped). The one
// difference: the kernel is launched with cudaLaunchAttributeProgrammaticStreamSerialization,
// so its grid may be scheduled while the main kernel is still running (the v5 main kernel
// triggers its dependents early with griddepcontrol.launch_dependents); every CTA executes
// griddepcontrol.wait FIRST — before any global read and before any early return — which
// blocks until the preceding grid has completed and its memory is visible. A CTA never
// finishes before the main kernel does, so work queued after the combine stays ordered
// after the main kernel too. Kept separate from combine.cu so the default path is
// untouched; fold into combine.cu if the A/B run shows a gain.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "sm90/dense_decode.h"
#include "sm90/utils.cuh"

namespace flashmla::sm90 {

namespace {

template <typename T>
__global__ void __launch_bounds__(256) flash_fwd_mla_combine_kernel_pdl(const DenseCombineParams p) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bs = blockIdx.x;
  const int bi = static_cast<int>(bs / p.s_q), sq = static_cast<int>(bs % p.s_q);
  const int h = blockIdx.y * 8 + warp;
  if (h >= p.h_q) return;
  const int first = p.num_splits[bi];
  const int n = p.num_splits[bi + 1] - first;
  if (n <= 1) return;  // written by the main kernel

  const int kvh = h / p.group;
  const int64_t row = static_cast<int64_t>(sq) * p.group + (h % p.group);
  const int64_t step = static_cast<int64_t>(p.h_kv) * p.m_rows;  // rows from one split to the next
  const int64_t row0 = (static_cast<int64_t>(first) * p.h_kv + kvh) * p.m_rows + row;
  const float* lse_k = p.lse_accum + row0;

  float mx = -INFINITY;
  for (int k = lane; k < n; k += 32) mx = fmaxf(mx, lse_k[k * step]);
  mx = warp_max(mx);
  if (mx == -INFINITY) mx = 0.f;
  float sum = 0.f;
  for (int k = lane; k < n; k += 32) sum += exp2f(lse_k[k * step] - mx);
  sum = warp_sum(sum);
  const float lse2 = (sum == 0.f || sum != sum) ? INFINITY : log2f(sum) + mx;
  if (lane == 0)
    p.lse[bi * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = lse2 == INFINITY ? INFINITY : lse2 * kLn2;

  float4 acc[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int k = 0; k < n; ++k) {
    const float w = exp2f(lse_k[k * step] - lse2);
    const float4* src = reinterpret_cast<const float4*>(p.o_accum + (row0 + k * step) * 512);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 v = src[lane + 32 * j];
      acc[j].x += w * v.x;
      acc[j].y += w * v.y;
      acc[j].z += w * v.z;
      acc[j].w += w * v.w;
    }
  }
  T* out = static_cast<T*>(p.out) + bi * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int d = (lane + 32 * j) * 4;
    if (p.out_vec_ok) {
      const uint32_t lo = HalfTraits<T>::pack(acc[j].x, acc[j].y), hi = HalfTraits<T>::pack(acc[j].z, acc[j].w);
      if ((reinterpret_cast<uintptr_t>(out + d) & 7) == 0) {
        *reinterpret_cast<uint2*>(out + d) = make_uint2(lo, hi);
      } else {
        reinterpret_cast<uint32_t*>(out + d)[0] = lo;
        reinterpret_cast<uint32_t*>(out + d)[1] = hi;
      }
    } else {
      out[(d + 0) * p.o_stride_d] = HalfTraits<T>::from_float(acc[j].x);
      out[(d + 1) * p.o_stride_d] = HalfTraits<T>::from_float(acc[j].y);
      out[(d + 2) * p.o_stride_d] = HalfTraits<T>::from_float(acc[j].z);
      out[(d + 3) * p.o_stride_d] = HalfTraits<T>::from_float(acc[j].w);
    }
  }
}

template <typename T>
cudaError_t launch_pdl(const DenseCombineParams& cp, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(static_cast<int64_t>(cp.b) * cp.s_q), (cp.h_q + 7) / 8, 1);
  cfg.blockDim = dim3(256, 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, flash_fwd_mla_combine_kernel_pdl<T>, cp);
}

}  // namespace

cudaError_t launch_dense_combine_pdl(const DenseCombineParams& cp, bool is_fp16, cudaStream_t stream) {
  const cudaError_t e = is_fp16 ? launch_pdl<__half>(cp, stream) : launch_pdl<__nv_bfloat16>(cp, stream);
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace flashmla::sm90
