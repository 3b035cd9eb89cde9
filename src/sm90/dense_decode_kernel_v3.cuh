// src/sm90/dense_decode_kernel_v3.cuh — split-KV dense MLA decode, version 3:
// v2's 64-row wgmma schedule (dense_decode_kernel_v2.cuh) with
//   * K tiles fetched by the bulk tensor copy engine (TMA): one thread issues one
//     64-dim x 64-token box per slab (or per page when page_block_size < 64) into the
//     same 128B-swizzled slabs, each slab completing on its own mbarrier, so S = Q K^T
//     starts slab by slab; partial tiles (the last of a request) keep the zero-filling
//     cp.async path, so tokens >= cache_seqlens are never read;
//   * d_qk a template parameter: the S chain is fully unrolled (v2's partially unrolled
//     runtime loop made ptxas insert warpgroup.arrive between the wgmma of the chain,
//     C7519, serialising them);
//   * the O rescale skipped when no row of the warp changed its running max.
// Superseded by v4 (seesaw) for the automatic choice; kept selectable (version 3) for
// comparison. Without a tensor map (or with kTuneNoTma) it gathers every tile with cp.async.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "sm90/dense_decode.h"
#include "sm90/dense_decode_tma.cuh"
#include "sm90/utils.cuh"
#include "sm90/wgmma.cuh"

namespace flashmla::sm90::dense_v3 {

constexpr int kThreads = 256;
constexpr int kBlockM = 64;
constexpr int kBlockN = 64;
constexpr int kDimV = 512;
constexpr int kSlabBytes = 64 * 128;        // one [64 rows][64 dims] slab
constexpr int kTileBytes = 9 * kSlabBytes;  // 64 x 576
constexpr int kSmemQ = kTileBytes;
constexpr int kSmemK = kTileBytes;
constexpr int kSmemP = kSlabBytes;
constexpr int kSmemRed = kBlockM * 2 * 4;
constexpr int kSmemBar = 2 * 9 * 8;  // 2 stages x 9 slabs
constexpr int kSmemBytes = 1024 /*alignment slack*/ + kSmemQ + 2 * kSmemK + kSmemP + kSmemRed + kSmemBar;
static_assert(kSmemBytes <= 232448, "shared memory");

__device__ __forceinline__ uint32_t slab_off(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * kSlabBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  template <int kOff, int kScaleD>
  __device__ __forceinline__ static void s(float (&d)[16], uint64_t a, uint64_t b) {
    gmma::mma_m64n32k16_off_bf16<0, kOff, kOff, kScaleD>(d, a, b);
  }
  __device__ __forceinline__ static void pv(float (&d)[128], uint64_t a, uint64_t b) {
    gmma::mma_m64n256k16_bf16<1>(d, a, b, 1);
  }
};
template <>
struct Mma<__half> {
  template <int kOff, int kScaleD>
  __device__ __forceinline__ static void s(float (&d)[16], uint64_t a, uint64_t b) {
    gmma::mma_m64n32k16_off_f16<0, kOff, kOff, kScaleD>(d, a, b);
  }
  __device__ __forceinline__ static void pv(float (&d)[128], uint64_t a, uint64_t b) {
    gmma::mma_m64n256k16_f16<1>(d, a, b, 1);
  }
};

// The S chain of one tile: per slab, wait for its TMA box (if the tile came by TMA),
// then 4 wgmma k-steps. Fully unrolled through templates so every descriptor offset
// and scale-d flag is an immediate.
template <typename T, int kSl, int kK>
__device__ __forceinline__ void s_step(float (&s)[16], uint64_t da0, uint64_t db0) {
  constexpr int kOff = (kSl * kSlabBytes + kK * 32) >> 4;
  Mma<T>::template s<kOff, (kSl | kK) != 0 ? 1 : 0>(s, da0, db0);
  if constexpr (kK + 1 < 4) s_step<T, kSl, kK + 1>(s, da0, db0);
}
template <typename T, int kSlabs, int kSl = 0>
__device__ __forceinline__ void s_chain(float (&s)[16], uint64_t da0, uint64_t db0, bool wait_tma, uint32_t bar0,
                                        uint32_t parity) {
  if (wait_tma) dense_tma::mbar_wait(bar0 + 8 * kSl, parity);
  gmma::fence();
  s_step<T, kSl, 0>(s, da0, db0);
  if constexpr (kSl + 1 < kSlabs) s_chain<T, kSlabs, kSl + 1>(s, da0, db0, wait_tma, bar0, parity);
}

template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, 1)
    flash_fwd_splitkv_mla_kernel_v3(const DenseDecodeKernelParams p, const __grid_constant__ CUtensorMap tmap_k) {
  constexpr int kSlabs = kD / 64;     // 9 or 8
  constexpr int kChunks = kD / 8;     // 16-byte chunks per row
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw_u = smem_u32(smem_raw);
  const uint32_t base_u = (raw_u + 1023u) & ~1023u;
  uint8_t* base = smem_raw + (base_u - raw_u);
  const uint32_t sQ_u = base_u;
  const uint32_t sK_u = sQ_u + kSmemQ;
  const uint32_t sP_u = sK_u + 2 * kSmemK;
  uint8_t* sP = base + kSmemQ + 2 * kSmemK;
  float* sRed = reinterpret_cast<float*>(sP + kSmemP);
  const uint32_t bar_u = sP_u + kSmemP + kSmemRed;  // 8-byte aligned

  const int m_tile = blockIdx.x, kv_head = blockIdx.y, part = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4;
  const int gq = lane / 4, tq = lane % 4;

  const bool use_tma = p.tma_ok && !(p.flags & kTuneNoTma);
  const bool prefetch = use_tma && (p.flags & kTuneL2Prefetch);
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 18; ++i) dense_tma::mbar_init(bar_u + 8 * i, 1);
    dense_tma::fence_barrier_init();
    if (use_tma) dense_tma::prefetch_tensormap(&tmap_k);
  }
  __syncthreads();
  uint32_t phase_bits = 0;  // bit s: parity of the next phase of stage s's barriers

  const int32_t* meta = p.tile_scheduler_metadata + part * 8;
  const int begin_req = meta[0], end_req = meta[1], begin_blk = meta[2], end_blk = meta[3];
  const int begin_split = meta[4], first_splitted = meta[5], last_splitted = meta[6];
  if (begin_req >= p.b) return;

  const T* __restrict__ kbase = static_cast<const T*>(p.k) + kv_head * p.k_stride_h;
  const int pbs = p.page_block_size;
  const int box_tok = p.tma_box_tok;               // min(pbs, 64)
  const int n_sub = use_tma ? kBlockN / box_tok : 1;  // boxes per slab

  int row_local[2], row_global[2], row_sq[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_local[hh] = wq * 16 + gq + 8 * hh;
    row_global[hh] = m_tile * kBlockM + row_local[hh];
    row_sq[hh] = row_global[hh] / p.group;
  }
  const int pair_bar = 1 + wq;  // warps wq and wq+4 own the same 16 rows

  for (int req = begin_req; req <= end_req; ++req) {
    const int seqlen = max(p.seqlens[req], 0);
    const int n_blk_req = (seqlen + kBlockN - 1) / kBlockN;
    const int blk_lo = req == begin_req ? begin_blk : 0;
    int blk_hi = req == end_req ? end_blk : n_blk_req;
    blk_hi = min(blk_hi, n_blk_req);
    const int n_blk = max(blk_hi - blk_lo, 0);
    bool no_split;
    if (req == begin_req) no_split = !first_splitted;
    else if (req == end_req) no_split = !last_splitted;
    else no_split = true;
    const int split_slot = p.num_splits[req] + (req == begin_req ? begin_split : 0);

    int limit[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      int lim = seqlen;
      if (p.causal && row_sq[hh] < p.s_q) lim = seqlen - (p.s_q - 1 - row_sq[hh]);
      limit[hh] = lim;
    }
    const int min_limit = min(limit[0], limit[1]);

    cp_async_wait<0>();
    __syncthreads();  // the previous request is done with sQ / sK / sP / sRed

    const int32_t* bt_row = p.block_table + req * p.bt_stride_b;
    // A tile goes through TMA when all its 64 tokens are < seqlen; otherwise (the last,
    // partial tile) every thread gathers it with zero-filling cp.async.
    auto tile_is_tma = [&](int blk) { return use_tma && (blk + 1) * kBlockN <= seqlen; };
    // prefetch_only: the same boxes into L2 only (kTuneL2Prefetch, a tile two steps ahead).
    auto issue_tile = [&](int blk, int stage, bool prefetch_only) {
      const uint32_t dst = sK_u + stage * kSmemK;
      if (tile_is_tma(blk)) {
        if (tid == 0) {
          const int tok0 = blk * kBlockN;
          int page[4], tip[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (j < n_sub) {
              const int t = tok0 + j * box_tok;
              page[j] = bt_row[static_cast<int64_t>(t / pbs) * p.bt_stride_j];
              tip[j] = t % pbs;
            }
          }
          const uint32_t bar0 = bar_u + stage * (9 * 8);
          if (prefetch_only) {
#pragma unroll
            for (int s = 0; s < kSlabs; ++s)
#pragma unroll
              for (int j = 0; j < 4; ++j)
                if (j < n_sub) dense_tma::tma_prefetch_4d(&tmap_k, 64 * s, kv_head, tip[j], page[j]);
            return;
          }
#pragma unroll
          for (int s = 0; s < kSlabs; ++s) {
            dense_tma::mbar_arrive_expect_tx(bar0 + 8 * s, kSlabBytes);
#pragma unroll
            for (int j = 0; j < 4; ++j)
              if (j < n_sub)
                dense_tma::tma_load_4d(dst + s * kSlabBytes + j * box_tok * 128, &tmap_k, bar0 + 8 * s, 64 * s,
                                       kv_head, tip[j], page[j]);
          }
        }
      } else {
        if (prefetch_only) return;
        const int t_local = tid / 4, q4 = tid % 4;
        const int token = blk * kBlockN + t_local;
        const bool valid = token < seqlen;
        const T* src = kbase;
        if (valid) {
          const int page = bt_row[static_cast<int64_t>(token / pbs) * p.bt_stride_j];
          src = kbase + static_cast<int64_t>(page) * p.k_stride_blk + static_cast<int64_t>(token % pbs) * p.k_stride_tok;
        }
#pragma unroll 1
        for (int c = q4; c < kChunks; c += 4)
          cp_async_16(dst + slab_off(t_local, c), valid ? static_cast<const void*>(src + c * 8) : p.k, valid);
      }
    };

    if (n_blk > 0) {
      const T* qb = static_cast<const T*>(p.q) + req * p.q_stride_b;
      for (int idx = tid; idx < kBlockM * kChunks; idx += kThreads) {
        const int r = idx / kChunks, c = idx % kChunks;
        const int grow = m_tile * kBlockM + r;
        const bool valid = grow < p.m_rows;
        const T* src = static_cast<const T*>(p.q);
        if (valid) {
          const int sq = grow / p.group, h = kv_head * p.group + grow % p.group;
          src = qb + sq * p.q_stride_s + h * p.q_stride_h + c * 8;
        }
        cp_async_16(sQ_u + slab_off(r, c), src, valid);
      }
      issue_tile(blk_lo, 0, false);
      cp_async_commit();
      if (prefetch && n_blk > 1) issue_tile(blk_lo + 1, 1, true);
    }

    float o[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) o[j] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};

    for (int i = 0; i < n_blk; ++i) {
      cp_async_wait<0>();
      gmma::fence_proxy_async();  // cp.async writes -> visible to wgmma (async proxy)
      __syncthreads();            // everyone is done with tile i-1 (its stage, sP, sRed)

      const int stage = i & 1;
      const uint32_t sKs = sK_u + stage * kSmemK;
      const int tok0 = (blk_lo + i) * kBlockN;
      const bool tma_i = tile_is_tma(blk_lo + i);
      const uint32_t parity = (phase_bits >> stage) & 1u;
      const uint32_t bar0 = bar_u + stage * (9 * 8);

      // ---- S = Q K^T, this warpgroup's 32 keys, slab by slab as the TMA boxes land
      float s[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) s[j] = 0.f;
      gmma::reg_fence(s);
      {
        const uint64_t da0 = gmma::make_desc_sw128(sQ_u, 16, 1024);
        const uint64_t db0 = gmma::make_desc_sw128(sKs + wg * 32 * 128, 16, 1024);
        s_chain<T, kSlabs>(s, da0, db0, tma_i, bar0, parity);
      }
      gmma::commit();
      if (tma_i) phase_bits ^= 1u << stage;
      // While the tensor cores run S: start the next tile's loads (its stage was last
      // read by the PV of tile i-1, finished before the barrier above).
      if (i + 1 < n_blk) issue_tile(blk_lo + i + 1, stage ^ 1, false);
      cp_async_commit();
      if (prefetch && i + 2 < n_blk) issue_tile(blk_lo + i + 2, stage, true);
      gmma::wait<0>();
      gmma::reg_fence(s);

      // ---- scale, mask, row max
      const bool need_mask = tok0 + kBlockN > min_limit;
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[4 * j + e] * p.scale_log2;
          if (need_mask) {
            const int key = tok0 + wg * 32 + j * 8 + 2 * tq + (e & 1);
            if (key >= limit[e >> 1]) v = -INFINITY;
          }
          s[4 * j + e] = v;
          mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
        if (tq == 0) sRed[row_local[hh] * 2 + wg] = mx[hh];
      }
      named_barrier_sync(pair_bar, 64);
      float m_use[2], alpha[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float bm = fmaxf(sRed[row_local[hh] * 2], sRed[row_local[hh] * 2 + 1]);
        const float m_new = fmaxf(m_run[hh], bm);
        m_use[hh] = m_new == -INFINITY ? 0.f : m_new;
        alpha[hh] = exp2f(m_run[hh] - m_use[hh]);
        m_run[hh] = m_new;
      }

      // ---- P -> smem, row sums, rescale O
      float rs[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p0 = exp2f(s[4 * j + 0] - m_use[0]);
        const float p1 = exp2f(s[4 * j + 1] - m_use[0]);
        const float p2 = exp2f(s[4 * j + 2] - m_use[1]);
        const float p3 = exp2f(s[4 * j + 3] - m_use[1]);
        rs[0] += p0 + p1;
        rs[1] += p2 + p3;
        const int key = wg * 32 + j * 8 + 2 * tq;
        *reinterpret_cast<uint32_t*>(sP + slab_off(row_local[0], key >> 3) + (key & 7) * 2) =
            HalfTraits<T>::pack(p0, p1);
        *reinterpret_cast<uint32_t*>(sP + slab_off(row_local[1], key >> 3) + (key & 7) * 2) =
            HalfTraits<T>::pack(p2, p3);
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) l_run[hh] = l_run[hh] * alpha[hh] + rs[hh];
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j + 0] *= alpha[0];
          o[4 * j + 1] *= alpha[0];
          o[4 * j + 2] *= alpha[1];
          o[4 * j + 3] *= alpha[1];
        }
      }
      gmma::fence_proxy_async();  // P stores -> visible to wgmma
      __syncthreads();            // both warpgroups' halves of P are in smem

      // ---- O[:, 256*wg ..] += P V
      gmma::reg_fence(o);
      gmma::fence();
      {
        const uint64_t da0 = gmma::make_desc_sw128(sP_u, 16, 1024);
        const uint64_t db0 = gmma::make_desc_sw128(sKs + (4 * wg) * kSlabBytes, kSlabBytes, 1024);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) Mma<T>::pv(o, da0 + ((kk * 32) >> 4), db0 + ((kk * 16 * 128) >> 4));
      }
      gmma::commit();
      gmma::wait<0>();
      gmma::reg_fence(o);
    }

    // ---- epilogue
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 1);
      l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 2);
    }
    float L[2] = {0.f, 0.f};
    if (n_blk > 0) {
      __syncthreads();  // every warp is past its last read of sRed
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (tq == 0) sRed[row_local[hh] * 2 + wg] = l_run[hh];
      named_barrier_sync(pair_bar, 64);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) L[hh] = sRed[row_local[hh] * 2] + sRed[row_local[hh] * 2 + 1];
    }

#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int grow = row_global[hh];
      if (grow >= p.m_rows) continue;
      const bool empty = !(L[hh] > 0.f);
      const float inv = empty ? 0.f : 1.f / L[hh];
      const float lse2 = empty ? (no_split ? INFINITY : -INFINITY) : log2f(L[hh]) + m_run[hh];
      const int sq = row_sq[hh];
      const int h = kv_head * p.group + grow % p.group;
      if (no_split) {
        T* out = static_cast<T*>(p.out) + req * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int col = wg * 256 + j * 8 + 2 * tq;
          const float v0 = o[4 * j + 2 * hh] * inv, v1 = o[4 * j + 2 * hh + 1] * inv;
          if (p.out_vec_ok) {
            *reinterpret_cast<uint32_t*>(out + col) = HalfTraits<T>::pack(v0, v1);
          } else {
            out[col * p.o_stride_d] = HalfTraits<T>::from_float(v0);
            out[(col + 1) * p.o_stride_d] = HalfTraits<T>::from_float(v1);
          }
        }
        if (wg == 0 && tq == 0)
          p.lse[req * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = empty ? INFINITY : lse2 * kLn2;
      } else {
        const int64_t arow = (static_cast<int64_t>(split_slot) * p.h_kv + kv_head) * p.m_rows + grow;
        float* oa = p.o_accum + arow * kDimV;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int col = wg * 256 + j * 8 + 2 * tq;
          *reinterpret_cast<float2*>(oa + col) = make_float2(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
        }
        if (wg == 0 && tq == 0) p.lse_accum[arow] = lse2;
      }
    }
  }
}

template <typename T, int kD>
cudaError_t launch_main_d(const DenseDecodeKernelParams& kp, const CUtensorMap& tmap, int num_sm_parts,
                          cudaStream_t stream) {
  auto kernel = flash_fwd_splitkv_mla_kernel_v3<T, kD>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return e;
  const int m_tiles = (kp.m_rows + kBlockM - 1) / kBlockM;
  const dim3 grid(m_tiles, kp.h_kv, num_sm_parts);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(kp, tmap);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_main(const DenseDecodeKernelParams& kp, const CUtensorMap& tmap, int num_sm_parts,
                        cudaStream_t stream) {
  if (kp.d_qk == 512) return launch_main_d<T, 512>(kp, tmap, num_sm_parts, stream);
  return launch_main_d<T, 576>(kp, tmap, num_sm_parts, stream);
}

}  // namespace flashmla::sm90::dense_v3
