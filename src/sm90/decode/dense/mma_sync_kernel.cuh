// src/sm90/decode/dense/mma_sync_kernel.cuh — split-KV dense MLA decode on mma.sync m16n8k16, 16- or
// 32-row tiles, cp.async double buffering: the kernel for M <= 32 when no K tensor map can be made.
//
// One CTA = (row tile, KV head, scheduler partition). It walks the (request,
// 64-token block) range of its partition (spec §4.4). Per request:
//   sQ  : BM x d_qk tile of query rows (rows = s_q-major (token, head-in-group) pairs)
//   sK  : 2 stages of 64 tokens x d_qk gathered through block_table with cp.async;
//         tokens >= cache_seqlens are zero-filled and never read from memory,
//         so NaN in unused slots / pages and sentinel table entries never matter.
// 8 warps = R row groups (16 rows each) x C = 8/R column warps. Warp (r, c)
//   S   = Q[r] . K[keys c*64/C ...]^T        (its share of the 64 keys)
//   row max exchanged through smem inside the row group (named barrier),
//   P   = exp2(S*scale*log2e - m) rounded to the input dtype -> sP (smem),
//   O[r][:, c*512/C ...] += P[r] . V          (V = first 512 dims of K).
// Online softmax in base 2; the row sum L accumulates unrounded fp32 P.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "sm90/decode/dense/dense_decode.h"
#include "sm90/decode/dense/thread_rows.cuh"
#include "sm90/decode/dense/tile_loads.cuh"
#include "sm90/common/decode_schedule.cuh"
#include "sm90/common/mma_core.cuh"
#include "sm90/common/utils.cuh"
#include "sm90/common/host_utils.h"

namespace flashmla::sm90::dense_mma {

constexpr int kThreads = 256;
constexpr int kBlockN = 64;        // tokens per K tile (= scheduler block)
constexpr int kRowBytes = 1152;    // smem bytes per Q/K row (576 bf16), also for d_qk 512
constexpr int kDimV = 512;

template <int R>
struct Cfg : mma_core::Tile<R> {
  using Tile = mma_core::Tile<R>;
  static constexpr int kSmemBytes = Tile::kSmemQ + 2 * Tile::kSmemK + Tile::kSmemP + Tile::kSmemRed;
  static_assert(kSmemBytes <= 232448, "shared memory");
};

using mma_core::swz;  // Q / K tile addressing (1152-byte rows, swizzled chunks)

template <typename T, int R>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_splitkv_mla_kernel(const DenseDecodeKernelParams p) {
  launch_dependent_grids();  // the combine after this kernel may be scheduled now (utils.cuh)
  using CF = Cfg<R>;
  constexpr int BM = CF::BM, C = CF::C, KW = CF::KW, NT_S = CF::NT_S, VW = CF::VW, NT_O = CF::NT_O;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + CF::kSmemQ;
  uint8_t* sP = sK + 2 * CF::kSmemK;
  float* sRed = reinterpret_cast<float*>(sP + CF::kSmemP);
  const uint32_t sQ_u = smem_u32(sQ), sK_u = smem_u32(sK), sP_u = smem_u32(sP);

  const int m_tile = blockIdx.x, kv_head = blockIdx.y, part = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rg = warp / C, cw = warp % C;
  const int gq = lane / 4, tq = lane % 4;  // mma fragment coordinates

  const PartSchedule ps = part_schedule(p.tile_scheduler_metadata, part);
  if (ps.begin_req >= p.b) return;

  const int d_qk = p.d_qk;
  const int n_chunks = d_qk / 8;  // 16-byte chunks per row: 72 or 64
  const int k_steps = d_qk / 16;  // QK^T mma k-steps: 36 or 32
  const T* __restrict__ kbase = static_cast<const T*>(p.k) + kv_head * p.k_stride_h;
  const auto chunk_off = [](int r, int c) { return swz(r, c); };  // 16-byte chunk c of tile row r

  // Rows of this thread inside the tile (fragment rows gq and gq+8 of its row group).
  int row_local[2], row_global[2], row_sq[2];
  thread_rows(rg, gq, m_tile * BM, p.group, row_local, row_global, row_sq);

  for (int req = ps.begin_req; req <= ps.end_req; ++req) {
    int limit[2];  // per-row key limit (bottom-right causal mask); padded rows see everything
    const auto [seqlen, blk_lo, n_blk, no_split, split_slot, min_limit] = dense_request<kBlockN>(p, ps, req, row_sq, limit);

    cp_async_wait<0>();
    __syncthreads();  // the previous request is done with sQ / sK / sP / sRed

    // K tiles: the pages of the next two are read ahead (pg1, pg2); the one two steps ahead is
    // prefetched to L2 (kTuneL2Prefetch).
    const auto kt =
        k_tiles<kBlockN, CF::kSmemK>(p, kbase, p.block_table + req * p.bt_stride_b, seqlen, tid, d_qk, sK_u, chunk_off);

    if (n_blk > 0) {
      // Q tile.
      load_q_tile<T, BM, kThreads>(p, sQ_u, req, kv_head, m_tile * BM, n_chunks, tid, chunk_off);
      kt.load(blk_lo, 0, kt.page(blk_lo));
      cp_async_commit();
    }

    float o[NT_O][4], m_run[2], l_run[2];
    mma_core::reset_rows(o, m_run, l_run);
    int pg1 = n_blk > 1 ? kt.page(blk_lo + 1) : -1;
    int pg2 = n_blk > 2 ? kt.page(blk_lo + 2) : -1;

    for (int i = 0; i < n_blk; ++i) {
      cp_async_wait<0>();
      __syncthreads();  // tile i visible to all; everyone is done with tile i-1
      if (i + 1 < n_blk) kt.load(blk_lo + i + 1, (i + 1) & 1, pg1);
      cp_async_commit();
      if ((p.flags & kTuneL2Prefetch) && i + 2 < n_blk) kt.prefetch(blk_lo + i + 2, pg2);
      pg1 = pg2;
      pg2 = i + 3 < n_blk ? kt.page(blk_lo + i + 3) : -1;

      const uint32_t sKs = sK_u + (i & 1) * CF::kSmemK;
      const int tok0 = (blk_lo + i) * kBlockN;

      // ---- S = Q K^T for this warp's KW keys
      float s[NT_S][4];
      mma_core::qk<T, NT_S, KW>(s, sQ_u, sKs, rg, cw, lane, k_steps);

      // ---- scale, mask, row max (this warp's keys)
      const bool need_mask = tok0 + kBlockN > min_limit;
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < NT_S; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[j][e] * p.scale_log2;
          if (need_mask) {
            const int key = tok0 + cw * KW + j * 8 + 2 * tq + (e & 1);
            if (key >= limit[e >> 1]) v = -INFINITY;
          }
          s[j][e] = v;
          mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
      }
      mma_core::softmax_p<T, NT_S, NT_O, C, KW>(s, mx, m_run, l_run, o, sRed, sP, row_local, rg, cw, tq);

      // ---- O += P V for this warp's VW columns
      mma_core::pv<T, NT_O, VW>(o, sP_u, sKs, rg, cw, lane);
    }

    // ---- epilogue: total row sum across the row group's warps (sRed was last read before the second
    // barrier of the last tile: safe to overwrite)
    float L[2];
    mma_core::row_sums<C>(l_run, L, n_blk, sRed, row_local, rg, cw, tq);

    store_dense_decode_rows<T, NT_O, VW>(
        p, [&](int j, int e) { return o[j][e]; }, L, m_run, row_global, row_sq, req, kv_head, split_slot, no_split,
        cw, [&] { return cw == 0 && tq == 0; }, tq);
  }
}

template <typename T, int R>
cudaError_t launch_main_r(const DenseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  constexpr int smem = Cfg<R>::kSmemBytes;
  auto kernel = flash_fwd_splitkv_mla_kernel<T, R>;
  cudaError_t e = set_max_dynamic_smem(kernel, smem);
  if (e != cudaSuccess) return e;
  const int m_tiles = (kp.m_rows + Cfg<R>::BM - 1) / Cfg<R>::BM;
  const dim3 grid(m_tiles, kp.h_kv, num_sm_parts);
  kernel<<<grid, kThreads, smem, stream>>>(kp);
  return cudaGetLastError();
}

/// 16-row tiles for M <= 16, 32-row tiles for M <= 32; larger M is the wgmma kernels' (64-row tiles).
template <typename T>
cudaError_t launch_main(const DenseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  if (kp.m_rows <= 16) return launch_main_r<T, 1>(kp, num_sm_parts, stream);
  if (kp.m_rows <= 32) return launch_main_r<T, 2>(kp, num_sm_parts, stream);
  return cudaErrorInvalidValue;
}

}  // namespace flashmla::sm90::dense_mma
