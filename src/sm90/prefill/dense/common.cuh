// src/sm90/prefill/dense/common.cuh — pieces shared by the dense MHA prefill kernels (forward,
// backward): the 128B-swizzled shared-memory tile layout, its wgmma descriptors, the producer
// warpgroup's cp.async tile loader, the per-request sequence bounds and the kernel parameters.
//
// Tile layout: a tile of R rows x D dims (bf16 / fp16, D a multiple of 64) is stored as D / 64 column
// slabs of R rows x 128 bytes, 128B-swizzled (16-byte chunk c of row r at chunk position c ^ (r % 8)),
// slab after slab. As a K-major wgmma operand (rows = M or N, dims = K) a 64- or N-row window starts
// at row0 * 128 bytes into each slab; as an MN-major B operand (rows = K, dims = N) the leading byte
// offset is the slab size R * 128 (PTX ISA "Matrix Descriptor Format", "Shared Memory Matrix Layout").
#pragma once

#include <cuda.h>  // CUtensorMap (the type; maps are encoded on the host)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "flashmla/ops.h"
#include "sm90/common/seesaw.cuh"
#include "sm90/common/utils.cuh"
#include "sm90/common/wgmma.cuh"

namespace flashmla::sm90::dense_prefill {

using gmma::Wgmma;
using seesaw::setmaxnreg_dec;
using seesaw::setmaxnreg_inc;

// 384 threads: consumer warpgroups 0 and 1 (tensor cores, softmax), producer warpgroup 2 (cp.async).
// setmaxnreg moves registers within the launch pool of 384 x 168: 4 producer warps x 24 + 8 consumer
// warps x 240 = 64512 exactly. 240 keeps the d_qk 192 dkdv kernel free of spills and of wgmma
// serialisation (ptxas C7512), which it is not at 232.
constexpr int kThreads = 384;
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = (3 * 168 - kProducerRegs) / 2 / 8 * 8;
static_assert(kConsumerRegs == 240, "setmaxnreg budget");

/// Byte offset of 16-byte chunk `chunk` (8 elements) of row `row` in a tile of kRows rows.
template <int kRows>
__device__ __forceinline__ uint32_t tile_off(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

/// K-major operand descriptor: rows [row0, row0 + 64 or N) of a kRows-row tile at `tile`, k-step kk
/// (elements 16 kk .. 16 kk + 15 of the dims).
template <int kRows>
__device__ __forceinline__ uint64_t desc_k(uint32_t tile, int row0, int kk) {
  return gmma::make_desc_sw128(tile + (kk >> 2) * (kRows * 128) + row0 * 128 + (kk & 3) * 32, 16, 1024);
}
/// MN-major B operand descriptor: the kRows-row tile's rows are the K dimension, its dims the N
/// dimension; k-step kk = rows 16 kk .. 16 kk + 15.
template <int kRows>
__device__ __forceinline__ uint64_t desc_mn(uint32_t tile, int kk) {
  return gmma::make_desc_sw128(tile + kk * 16 * 128, kRows * 128, 1024);
}

/// acc (+)= A B^T over kDim / 16 k-steps (wgmma m64nNk16, both operands K-major): A = the 64 rows from
/// a_row0 of the kRowsA-row tile at a, B = the first N rows of the kRowsB-row tile at b. The first k-step
/// overwrites acc. Issues only: the caller fences before, commits and waits after.
template <class T, int N, int kDim, int kRowsA, int kRowsB>
__device__ __forceinline__ void issue_abt(float (&acc)[N / 2], uint32_t a, int a_row0, uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk)
    Wgmma<T, N>::template ss<0, 0>(acc, desc_k<kRowsA>(a, a_row0, kk), desc_k<kRowsB>(b, 0, kk), kk > 0 ? 1 : 0);
}

/// Thread 0 initialises the kernel's mbarriers, then the CTA syncs. They lie 8 bytes apart from `bar`:
/// kGroups pairs of per-stage barriers (group g's stage-s barrier at bar + 16 g + 8 s, counts[g] arrivals;
/// e.g. full and empty of a streamed tile), then the barrier of the tiles loaded once (128 producer
/// arrivals). Stage 0's barriers are initialised before stage 1's.
template <int kGroups>
__device__ __forceinline__ void init_barriers(int tid, uint32_t bar, const int (&counts)[kGroups]) {
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) mbar_init(bar + 16 * g + 8 * s, counts[g]);
    }
    mbar_init(bar + 16 * kGroups, 128);
    fence_barrier_init();
  }
  __syncthreads();
}

/// Producer warpgroup (pt = 0..127): cp.async of kRows x kDim elements, row r from src + r * row_stride,
/// into the tile at `dst`; rows >= valid_rows are zero-filled without reading (padding past a request's
/// end never carries another request's data, NaN included).
template <class T, int kRows, int kDim>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* src, int64_t row_stride, int valid_rows, int pt) {
  constexpr int kChunks = kDim / 8;
  static_assert((kChunks & (kChunks - 1)) == 0 || kChunks == 24, "chunks per row");
#pragma unroll 1
  for (int idx = pt; idx < kRows * kChunks; idx += 128) {
    const int row = idx / kChunks, ch = idx % kChunks;
    const bool ok = row < valid_rows;
    const T* s = ok ? src + row * row_stride + ch * 8 : src;
    cp_async_16(dst + tile_off<kRows>(row, ch), s, ok);
  }
}

/// 3-D tiled TMA load global -> shared (box of the map at coordinates c0, c1, c2), completing on the
/// mbarrier `bar` with complete_tx bytes.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

/// Packs 16 accumulator columns (k-step kk of a 64-row x N accumulator, N / 16 k-steps) into the
/// m16n8k16 A fragment that the RS wgmma takes: the accumulator layout of columns 16 kk .. 16 kk + 15
/// is that fragment's layout.
template <class T, int N>
__device__ __forceinline__ void pack_a(const float (&s)[N / 2], uint32_t (&a)[N / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[kk][j] = HalfTraits<T>::pack(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
  }
}

/// The two floats of a packed bf16 / fp16 pair (HalfTraits<T>::pack's inverse, exact).
template <class T>
__device__ __forceinline__ void unpack2(uint32_t v, float& lo, float& hi) {
  if constexpr (sizeof(T) == 2 && std::is_same_v<T, __nv_bfloat16>) {
    lo = __uint_as_float(v << 16);
    hi = __uint_as_float(v & 0xFFFF0000u);
  } else {
    const __half2 h = *reinterpret_cast<const __half2*>(&v);
    const float2 f = __half22float2(h);
    lo = f.x;
    hi = f.y;
  }
}

/// One request's bounds: rows [q0, q0 + s_q) of q / out, [k0, k0 + s_k) of k / v.
struct SeqBounds {
  int q0, s_q, k0, s_k;
};
__device__ __forceinline__ SeqBounds seq_bounds(const int32_t* cu_q, const int32_t* cu_k, int64_t cu_q_stride,
                                                int64_t cu_k_stride, int b) {
  SeqBounds r;
  r.q0 = cu_q[b * cu_q_stride];
  r.s_q = cu_q[(b + 1) * cu_q_stride] - r.q0;
  r.k0 = cu_k[b * cu_k_stride];
  r.s_k = cu_k[(b + 1) * cu_k_stride] - r.k0;
  return r;
}

/// Kernel parameters (element strides). Forward: q, k, v -> out, lse. Backward: also dout, dq, dk, dv
/// and the workspace (per (request, head) rows of lse * log2(e) and D = rowsum(dout * out), padded to
/// ws_rows = a multiple of 64).
struct KernelParams {
  const void* q;
  const void* k;
  const void* v;
  const void* out_in;  // backward: the forward's out
  void* out;           // forward: out
  float* lse;          // forward: written; backward: read
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  float* ws_lse2;  // backward workspace: (b, h_q, ws_rows) lse * log2(e), +inf for rows without keys / padding
  float* ws_dsum;  // backward workspace: (b, h_q, ws_rows) D = rowsum(dout * out), 0 for padding
  float* dq_accum;  // backward, fused dQ: (total_q, h_q, d_qk) fp32 accumulator, zeroed before
  int* dq_sem;      // backward, fused dQ: (b, h_q, ws_rows / 64) counters of key blocks added, zeroed before
  const int32_t* cu_q;
  const int32_t* cu_k;
  int64_t cu_q_stride, cu_k_stride;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  int64_t o_row, o_head;      // out (forward) / out_in (backward)
  int64_t lse_row, lse_head;  // lse
  int64_t do_row, do_head, dq_row, dq_head, dk_row, dk_head, dv_row, dv_head;
  int h_q, group;  // group = h_q / h_kv
  int ws_rows;
  int causal;
  float scale;       // softmax_scale
  float scale_log2;  // softmax_scale * log2(e)
};

/// First row of the query block this CTA computes: block blockIdx.x, or counted from the end when causal
/// (the last query blocks see the most keys, so they start first).
template <int kBM>
__device__ __forceinline__ int query_block_row0(const KernelParams& p) {
  const int mblk = p.causal ? static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x) : blockIdx.x;
  return mblk * kBM;
}
/// End (exclusive) of the keys that the query block of kBM rows from m0 sees: all s_k keys, or when causal
/// those up to its last row's (key j is visible to query i iff j <= i + off, off = s_k - s_q).
template <int kBM>
__device__ __forceinline__ int visible_key_end(const KernelParams& p, int s_k, int m0, int off) {
  const int n_end = p.causal ? min(s_k, m0 + kBM + off) : s_k;
  return max(n_end, 0);
}

/// The fields of KernelParams the forward and the backward take alike from the forward's arguments p:
/// q, k, v, lse, cu_seqlens_q / _k and their strides (out's strides into o_row / o_head; where out goes,
/// out or out_in, is the caller's), h_q, group, causal, scale and scale_log2. Host code.
inline KernelParams attention_kernel_params(const DensePrefillParams& p) {
  KernelParams kp{};
  kp.q = p.q.data;
  kp.k = p.k.data;
  kp.v = p.v.data;
  kp.lse = static_cast<float*>(p.lse.data);
  kp.cu_q = static_cast<const int32_t*>(p.cu_seqlens_q.data);
  kp.cu_k = static_cast<const int32_t*>(p.cu_seqlens_k.data);
  kp.cu_q_stride = p.cu_seqlens_q.stride[0];
  kp.cu_k_stride = p.cu_seqlens_k.stride[0];
  kp.q_row = p.q.stride[0];
  kp.q_head = p.q.stride[1];
  kp.k_row = p.k.stride[0];
  kp.k_head = p.k.stride[1];
  kp.v_row = p.v.stride[0];
  kp.v_head = p.v.stride[1];
  kp.o_row = p.out.stride[0];
  kp.o_head = p.out.stride[1];
  kp.lse_row = p.lse.stride[0];
  kp.lse_head = p.lse.stride[1];
  kp.h_q = static_cast<int>(p.q.shape[1]);
  kp.group = static_cast<int>(p.q.shape[1] / p.k.shape[1]);
  kp.causal = p.causal ? 1 : 0;
  kp.scale = p.softmax_scale;
  kp.scale_log2 = p.softmax_scale * kLog2e;
  return kp;
}

}  // namespace flashmla::sm90::dense_prefill
