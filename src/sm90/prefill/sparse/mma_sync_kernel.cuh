// src/sm90/prefill/sparse/mma_sync_kernel.cuh — sparse MLA prefill, `flash_mla_sparse_fwd`
// (spec §1.4, §2.4, §7.3), bf16 KV rows gathered by index.
//
// One CTA = (query token s, head tile of BM rows); grid x = s_q * head_tiles (no
// 65535 limit: s_q up to 2^31 / head_tiles). Each CTA walks all of its row's top-k
// slots in blocks of 64 (no split-KV): per block
//   1. gather (one block ahead, double-buffered K tile): slot p of block b is valid iff
//      p < min(topk, topk_length[s]) and 0 <= idx < s_kv; valid rows are copied with
//      16-byte cp.async (or 2-byte loads when kv is not 16-byte aligned), invalid ones
//      zero-filled WITHOUT reading memory (indices such as INT_MIN / INT_MAX /
//      2147480000 are never dereferenced; addresses are built in int64 only for valid
//      rows). The indices of the next block are loaded one gather ahead.
//   2. S = Q K^T, validity mask -> -inf, online softmax in base 2 (running max, row sum
//      of the un-rounded fp32 exponentials), P rounded to bf16, O += P V (V = first 512
//      dims of the same K rows).
// Epilogue: out = O / L * 1/(1 + 2^(sink*log2e - lse2)) (sink optional, +-inf safe),
// max_logits = m * ln2, lse = lse2 * ln2 (natural units); rows without a valid slot get
// out 0, max_logits -inf, lse +inf.
//
// This header: the helpers shared by the prefill kernels and
//   * sparse_attn_fwd_mma_kernel<d_qk, R>: 16- or 32-row head tiles (R row groups of 16) with
//     mma.sync m16n8k16 (the sparse-decode schedule), so h_q 16 / 32 are not padded to 64; the
//     kernel for h_q <= 32. 64-row head tiles (h_q > 32) use the seesaw kernel
//     (wgmma_seesaw_kernel.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "sm90/prefill/sparse/sparse_prefill.h"
#include "sm90/common/mma_core.cuh"
#include "sm90/common/utils.cuh"
#include "sm90/common/wgmma.cuh"
#include "sm90/common/host_utils.h"

namespace flashmla::sm90::sparse_prefill {

constexpr int kThreads = 256;
constexpr int kBlockN = 64;  // top-k slots per block
constexpr int kDimV = 512;

__device__ __forceinline__ int row_limit(const SparsePrefillKernelParams& p, int s) {
  int lim = p.topk;
  if (p.topk_length != nullptr) lim = min(max(__ldg(p.topk_length + static_cast<int64_t>(s) * p.tl_stride), 0), p.topk);
  return lim;
}

/// Index in slot `slot` of row `s`; -1 (invalid) at or past `lim` (never read there).
__device__ __forceinline__ int fetch_index(const SparsePrefillKernelParams& p, int s, int slot, int lim) {
  if (slot >= lim) return -1;
  return __ldg(p.indices + static_cast<int64_t>(s) * p.idx_stride_s + static_cast<int64_t>(slot) * p.idx_stride_k);
}

/// 8 bf16 through 2-byte loads (sources that are not 16-byte aligned).
__device__ __forceinline__ uint4 load8_u16(const __nv_bfloat16* src) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = static_cast<uint32_t>(s[2 * e]) | (static_cast<uint32_t>(s[2 * e + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// sink factor 1/(1 + exp(sink - lse)) in base 2; +inf sink -> 0, -inf sink -> 1.
__device__ __forceinline__ float sink_factor(const SparsePrefillKernelParams& p, int h, float lse2) {
  if (p.attn_sink == nullptr) return 1.f;
  const float sk = p.attn_sink[static_cast<int64_t>(h) * p.sink_stride];
  return 1.f / (1.f + exp2f(sk * kLog2e - lse2));
}

// =====================================================================================
// mma.sync kernel (16/32/64-row head tiles)
// =====================================================================================
namespace mma_sync {

constexpr int kRowBytes = 1152;  // smem bytes per Q/K row (576 bf16), also for d_qk 512

template <int R>
struct Cfg : mma_core::Tile<R> {
  using Tile = mma_core::Tile<R>;
  static constexpr int kSmemValid = 2 * kBlockN;
  static constexpr int kSmemBytes = Tile::kSmemQ + 2 * Tile::kSmemK + Tile::kSmemP + Tile::kSmemRed + kSmemValid;
  static_assert(kSmemBytes <= 232448, "shared memory");
};

using mma_core::swz;  // Q / K tile addressing (1152-byte rows, swizzled chunks)

template <int kD, int R>
__global__ void __launch_bounds__(kThreads, 1) sparse_attn_fwd_mma_kernel(const SparsePrefillKernelParams p) {
  using CF = Cfg<R>;
  constexpr int BM = CF::BM, C = CF::C, KW = CF::KW, NT_S = CF::NT_S, VW = CF::VW, NT_O = CF::NT_O;
  constexpr int kChunks = kD / 8;   // 16-byte chunks of a bf16 row
  constexpr int K_STEPS = kD / 16;  // k-steps of S = Q K^T

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + CF::kSmemQ;
  uint8_t* sP = sK + 2 * CF::kSmemK;
  float* sRed = reinterpret_cast<float*>(sP + CF::kSmemP);
  uint8_t* sValid = reinterpret_cast<uint8_t*>(sRed) + CF::kSmemRed;  // [stage][64]
  const uint32_t sQ_u = smem_u32(sQ), sK_u = smem_u32(sK), sP_u = smem_u32(sP);

  const int ht = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.num_head_tiles));
  const int sq = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.num_head_tiles));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rg = warp / C, cw = warp % C;
  const int gq = lane / 4, tq = lane % 4;

  int row_local[2], head[2];
  mma_core::fragment_rows(rg, gq, ht * BM, row_local, head);

  const int lim = row_limit(p, sq);
  const int n_blk = (lim + kBlockN - 1) / kBlockN;

  const int g_tok = tid / 4, g_q4 = tid % 4;  // gather: 4 threads per slot
  const __nv_bfloat16* kvb = static_cast<const __nv_bfloat16*>(p.kv);
  int pf_idx = -1;
  auto issue_tile = [&](int blk, int stage) {
    const int idx = pf_idx;
    if (blk + 1 < n_blk) pf_idx = fetch_index(p, sq, (blk + 1) * kBlockN + g_tok, lim);
    const bool valid = idx >= 0 && idx < p.s_kv;
    const __nv_bfloat16* src = valid ? kvb + static_cast<int64_t>(idx) * p.kv_stride_s : kvb;
    if (p.kv_vec) {
      const uint32_t dst = sK_u + stage * CF::kSmemK;
#pragma unroll 1
      for (int c = g_q4; c < kChunks; c += 4) cp_async_16(dst + swz(g_tok, c), src + c * 8, valid);
    } else {
      uint8_t* dst = sK + stage * CF::kSmemK;
#pragma unroll 1
      for (int c = g_q4; c < kChunks; c += 4)
        *reinterpret_cast<uint4*>(dst + swz(g_tok, c)) = valid ? load8_u16(src + c * 8) : make_uint4(0, 0, 0, 0);
    }
    if (g_q4 == 0) sValid[stage * kBlockN + g_tok] = valid ? 1 : 0;
  };

  if (n_blk > 0) {
    pf_idx = fetch_index(p, sq, g_tok, lim);
    const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + static_cast<int64_t>(sq) * p.q_stride_s;
    for (int id = tid; id < BM * kChunks; id += kThreads) {
      const int r = id / kChunks, c = id % kChunks;
      const int h = ht * BM + r;
      const bool valid = h < p.h_q;
      const __nv_bfloat16* src = valid ? qb + static_cast<int64_t>(h) * p.q_stride_h + c * 8
                                       : static_cast<const __nv_bfloat16*>(p.q);
      if (p.q_vec) cp_async_16(sQ_u + swz(r, c), src, valid);
      else *reinterpret_cast<uint4*>(sQ + swz(r, c)) = valid ? load8_u16(src) : make_uint4(0, 0, 0, 0);
    }
    issue_tile(0, 0);
    cp_async_commit();
  }

  float o[NT_O][4], m_run[2], l_run[2];
  mma_core::reset_rows(o, m_run, l_run);

  for (int i = 0; i < n_blk; ++i) {
    const int stage = i & 1;
    cp_async_wait<0>();
    __syncthreads();  // block i landed (all threads); everyone is done with block i-1
    if (i + 1 < n_blk) issue_tile(i + 1, stage ^ 1);
    cp_async_commit();

    const uint32_t sKs_u = sK_u + stage * CF::kSmemK;
    const uint8_t* vf = sValid + stage * kBlockN;

    // ---- S = Q K^T, validity mask, online softmax, O += P V for this warp's keys and value columns
    mma_core::valid_key_block<__nv_bfloat16, NT_S, NT_O, C, KW, VW>(
        o, m_run, l_run, sQ_u, sKs_u, vf, p.scale_log2, sRed, sP, sP_u, row_local, rg, cw, lane, tq, K_STEPS);
  }

  // ---- epilogue: total row sum across the row group's warps, after a CTA barrier (every warp is past
  // its last read of sRed)
  float L[2];
  mma_core::row_sums<C, true>(l_run, L, n_blk, sRed, row_local, rg, cw, tq);

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int h = head[hh];
    if (h >= p.h_q) continue;
    const bool empty = row_sum_empty(L[hh]);
    const float lse2 = empty ? INFINITY : log2f(L[hh]) + m_run[hh];
    const float inv = empty ? 0.f : sink_factor(p, h, lse2) / L[hh];
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(sq) * p.o_stride_s +
                         static_cast<int64_t>(h) * p.o_stride_h;
#pragma unroll
    for (int j = 0; j < NT_O; ++j) {
      const int col = cw * VW + j * 8 + 2 * tq;
      const float v0 = o[j][2 * hh] * inv, v1 = o[j][2 * hh + 1] * inv;
      if (p.out_vec_ok) {
        *reinterpret_cast<uint32_t*>(out + col) = HalfTraits<__nv_bfloat16>::pack(v0, v1);
      } else {
        out[col * p.o_stride_d] = __float2bfloat16_rn(v0);
        out[(col + 1) * p.o_stride_d] = __float2bfloat16_rn(v1);
      }
    }
    if (cw == 0 && tq == 0) {
      p.lse[static_cast<int64_t>(sq) * p.lse_stride_s + static_cast<int64_t>(h) * p.lse_stride_h] =
          empty ? INFINITY : lse2 * kLn2;
      p.max_logits[static_cast<int64_t>(sq) * p.ml_stride_s + static_cast<int64_t>(h) * p.ml_stride_h] =
          empty ? -INFINITY : row_max_or_nan(m_run[hh], L[hh]) * kLn2;
    }
  }
}

template <int kD, int R>
cudaError_t launch_r(const SparsePrefillKernelParams& kp, cudaStream_t stream) {
  constexpr int smem = Cfg<R>::kSmemBytes;
  auto kernel = sparse_attn_fwd_mma_kernel<kD, R>;
  cudaError_t e = set_max_dynamic_smem(kernel, smem);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(kp.s_q) * static_cast<unsigned>(kp.num_head_tiles), 1, 1);
  kernel<<<grid, kThreads, smem, stream>>>(kp);
  return cudaGetLastError();
}

/// bm = rows per head tile: 16 or 32 (64-row tiles are the seesaw kernel's).
template <int kD>
cudaError_t launch(const SparsePrefillKernelParams& kp, int bm, cudaStream_t stream) {
  if (bm == 16) return launch_r<kD, 1>(kp, stream);
  if (bm == 32) return launch_r<kD, 2>(kp, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mma_sync

}  // namespace flashmla::sm90::sparse_prefill
