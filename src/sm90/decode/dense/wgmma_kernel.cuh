// src/sm90/decode/dense/wgmma_kernel.cuh — split-KV dense MLA decode on wgmma, 64-row tiles, K by
// cp.async: the kernel for M = s_q*h_q/h_kv > 32 when no K tensor map can be made (dense_decode.cu).
//
// Same schedule, masking and epilogue as the mma.sync kernel (mma_sync_kernel.cuh); the
// matrix work moves from mma.sync to asynchronous warpgroup MMA:
//   2 warpgroups; WG c computes S[:, 32c .. 32c+31] = Q . K^T with 36 (32 for
//   d_qk 512) wgmma m64n32k16 (A = Q, B = K rows, both K-major in smem);
//   row max exchanged through smem between the two warps owning the same 16
//   rows (named barrier per warp pair); P (input dtype) -> smem;
//   WG c: O[:, 256c .. 256c+255] += P . V with 4 wgmma m64n256k16
//   (A = P K-major, B = V = K tile read MN-major: no transpose copy).
// Shared-memory tiles are stored as 64-dim "slabs" of [64 rows][128 B], each
// 16-byte chunk XOR-swizzled with (row & 7): exactly the 128B-swizzle canonical
// layout wgmma descriptors describe (1024-byte aligned atoms of 8 rows).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "sm90/decode/dense/dense_decode.h"
#include "sm90/decode/dense/thread_rows.cuh"
#include "sm90/decode/dense/tile_loads.cuh"
#include "sm90/common/decode_schedule.cuh"
#include "sm90/common/seesaw.cuh"
#include "sm90/common/utils.cuh"
#include "sm90/common/wgmma.cuh"
#include "sm90/common/host_utils.h"

namespace flashmla::sm90::dense_wgmma {

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
constexpr int kSmemBytes = 1024 /*alignment slack*/ + kSmemQ + 2 * kSmemK + kSmemP + kSmemRed;
static_assert(kSmemBytes <= 232448, "shared memory");

// Byte offset of 16-byte chunk `chunk` (8 elements) of row `row` in a slab-major tile.
__device__ __forceinline__ uint32_t slab_off(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * kSlabBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// The kernel's two wgmma shapes for element type T (__nv_bfloat16 or __half): S (64x32, K 16) and
// O += P V (64x256, K 16), fp32 accumulation.
template <typename T>
struct Mma {
  __device__ __forceinline__ static void s(float (&d)[16], uint64_t a, uint64_t b, int scale_d) {
    gmma::Wgmma<T, 32>::template ss<0, 0>(d, a, b, scale_d);
  }
  __device__ __forceinline__ static void pv(float (&d)[128], uint64_t a, uint64_t b) {
    gmma::Wgmma<T, 256>::template ss<0, 1>(d, a, b, 1);
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_splitkv_mla_kernel_wgmma(const DenseDecodeKernelParams p) {
  launch_dependent_grids();  // the combine after this kernel may be scheduled now (utils.cuh)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t base_u;
  uint8_t* base = smem_align_1024(smem_raw, base_u);
  const uint32_t sQ_u = base_u;
  const uint32_t sK_u = sQ_u + kSmemQ;
  const uint32_t sP_u = sK_u + 2 * kSmemK;
  uint8_t* sP = base + kSmemQ + 2 * kSmemK;
  float* sRed = reinterpret_cast<float*>(sP + kSmemP);

  const int m_tile = blockIdx.x, kv_head = blockIdx.y, part = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4;  // warpgroup, warp inside it (rows 16*wq ..)
  const int gq = lane / 4, tq = lane % 4;

  const PartSchedule ps = part_schedule(p.tile_scheduler_metadata, part);
  if (ps.begin_req >= p.b) return;

  const int d_qk = p.d_qk;
  const int n_chunks = d_qk / 8;  // 72 or 64
  const int k_steps = d_qk / 16;  // 36 or 32
  const T* __restrict__ kbase = static_cast<const T*>(p.k) + kv_head * p.k_stride_h;
  const auto chunk_off = [](int r, int c) { return slab_off(r, c); };  // 16-byte chunk c of tile row r

  int row_local[2], row_global[2], row_sq[2];
  thread_rows(wq, gq, m_tile * kBlockM, p.group, row_local, row_global, row_sq);
  const int pair_bar = 1 + wq;  // warps wq and wq+4 own the same 16 rows

  for (int req = ps.begin_req; req <= ps.end_req; ++req) {
    int limit[2];
    const auto [seqlen, blk_lo, n_blk, no_split, split_slot, min_limit] = dense_request<kBlockN>(p, ps, req, row_sq, limit);

    cp_async_wait<0>();
    __syncthreads();

    // K tiles: the pages of the next two are read ahead (pg1, pg2); the one two steps ahead is
    // prefetched to L2 (kTuneL2Prefetch).
    const auto kt =
        k_tiles<kBlockN, kSmemK>(p, kbase, p.block_table + req * p.bt_stride_b, seqlen, tid, d_qk, sK_u, chunk_off);

    if (n_blk > 0) {
      load_q_tile<T, kBlockM, kThreads>(p, sQ_u, req, kv_head, m_tile * kBlockM, n_chunks, tid, chunk_off);
      kt.load(blk_lo, 0, kt.page(blk_lo));
      cp_async_commit();
    }

    float o[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) o[j] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};
    int pg1 = n_blk > 1 ? kt.page(blk_lo + 1) : -1;
    int pg2 = n_blk > 2 ? kt.page(blk_lo + 2) : -1;

    for (int i = 0; i < n_blk; ++i) {
      cp_async_wait<0>();
      gmma::fence_proxy_async();  // cp.async writes -> visible to wgmma (async proxy)
      __syncthreads();

      const uint32_t sKs = sK_u + (i & 1) * kSmemK;
      const int tok0 = (blk_lo + i) * kBlockN;

      // ---- S = Q K^T, this warpgroup's 32 keys
      float s[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) s[j] = 0.f;
      gmma::reg_fence(s);
      gmma::fence();
      {
        // Descriptors advance by adding (byte offset >> 4) to the start-address field.
        const uint64_t da0 = gmma::make_desc_sw128(sQ_u, 16, 1024);
        const uint64_t db0 = gmma::make_desc_sw128(sKs + wg * 32 * 128, 16, 1024);
#pragma unroll 4
        for (int ks = 0; ks < k_steps; ++ks) {
          const uint32_t koff = ((ks >> 2) * kSlabBytes + (ks & 3) * 32) >> 4;
          Mma<T>::s(s, da0 + koff, db0 + koff, ks > 0 ? 1 : 0);
        }
      }
      gmma::commit();
      // While the tensor cores run S: start the next tile's loads (its stage was
      // last read by the PV of tile i-1, finished before the barrier above).
      if (i + 1 < n_blk) kt.load(blk_lo + i + 1, (i + 1) & 1, pg1);
      cp_async_commit();
      if ((p.flags & kTuneL2Prefetch) && i + 2 < n_blk) kt.prefetch(blk_lo + i + 2, pg2);
      pg1 = pg2;
      pg2 = i + 3 < n_blk ? kt.page(blk_lo + i + 3) : -1;
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
        alpha[hh] = advance_row_max(m_run[hh], fmaxf(m_run[hh], bm), m_use[hh]);
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
      seesaw::scale_rows(o, alpha);
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
    quad_sum(l_run);
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

    store_dense_decode_rows<T, 32, 256>(
        p, [&](int j, int e) { return o[4 * j + e]; }, L, m_run, row_global, row_sq, req, kv_head, split_slot,
        no_split, wg, wg == 0 && tq == 0, tq);
  }
}

template <typename T>
cudaError_t launch_main(const DenseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  auto kernel = flash_fwd_splitkv_mla_kernel_wgmma<T>;
  cudaError_t e = set_max_dynamic_smem(kernel, kSmemBytes);  // once per device, not per launch
  if (e != cudaSuccess) return e;
  const int m_tiles = (kp.m_rows + kBlockM - 1) / kBlockM;
  const dim3 grid(m_tiles, kp.h_kv, num_sm_parts);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace flashmla::sm90::dense_wgmma
