// src/sm90/sparse_prefill_kernel_v4.cuh — sparse MLA prefill "v4p" (opt-in,
// FLASHMLA_SPARSE_PREFILL_KERNEL=v4p): v3w (sparse_prefill_kernel_v2.cuh, kProd + kWide) made
// persistent. Design and invariants: bench/NOTES.md "sparse prefill v4p".
//
// Grid = min(#tiles, #SMs) CTAs (one per SM: 219 KB smem); CTA b processes the tiles
// (query token, head tile) t = b, b + G, b + 2G, ... (G = gridDim.x; same tile -> (sq, ht) map as
// v3w: ht = t % head_tiles, sq = t / head_tiles), so every (row, head tile) exactly once.
// Same 384 threads and roles as v3w; the producer warpgroup treats the CTA's tiles as one
// stream of block pairs and also loads Q:
//   * Q (single buffer) of tile k+1 is loaded by the producer as soon as both consumer
//     warpgroups have finished the last S of tile k (mbarrier q_free, count 256), and
//     completes on q_full (count 256: 128 cp.async noinc + 128 release arrivals).
//   * The first pair of tile k+1 is gathered into the stage parts as tile k's last pair frees
//     them (same free barriers as inside a tile), i.e. under tile k's last P*V and epilogue.
// Barrier phases are counted per barrier across tiles: u0 = uses of stage 0 so far (every
// pair), u1 = uses of stage 1 (pairs with a second block only), uq = Q loads (tiles with at
// least one block). A stage part is filled once per use; consumers wait full(s, part) with
// parity u_s & 1 and arrive free(s, part) after every use (unconditionally, unlike v3w); the
// producer waits free(s, part) with parity (u_s - 1) & 1 before every fill but the first.
// Semantics identical to v3w (validity, topk_length, sink, lse / max_logits, empty rows);
// results bitwise equal to v3w (same arithmetic in the same order per tile).
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "sm90/sparse_prefill.h"
#include "sm90/sparse_prefill_kernel.cuh"
#include "sm90/sparse_prefill_kernel_v2.cuh"
#include "sm90/utils.cuh"
#include "sm90/wgmma.cuh"

namespace flashmla::sm90::sparse_prefill::ps {

using ss::kSlabBytes;
using ss::kSmemK;
using ss::kSmemQ;
using ss::kSmemRed;
using ss::kSmemValid;
constexpr int kSmemBar = 10 * 8;  // full[stage][part], free[stage][part], q_full, q_free
constexpr int kSmemBytes = 1024 /*alignment slack*/ + kSmemQ + 2 * kSmemK + kSmemRed + kSmemValid + kSmemBar;
static_assert(kSmemBytes <= 232448, "shared memory");
using ss::kBarConsumers;
using ss::kBarP0;
using ss::kBarP1;
using ss::kBarScale0;
using ss::kBarScale1;
using ss::kThreadsProd;

template <int kD, bool kHint>
__global__ void __launch_bounds__(kThreadsProd, 1) sparse_attn_fwd_persist_kernel(const SparsePrefillKernelParams p) {
  using namespace ss;
  constexpr int kSlabs = kD / 64;  // 9 or 8
  constexpr int kChunks = kD / 8;  // 72 or 64
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw_u = smem_u32(smem_raw);
  const uint32_t base_u = (raw_u + 1023u) & ~1023u;
  uint8_t* base = smem_raw + (base_u - raw_u);
  const uint32_t sQ_u = base_u;
  const uint32_t sK_u = sQ_u + kSmemQ;
  uint8_t* sK = base + kSmemQ;
  float* sRed = reinterpret_cast<float*>(base + kSmemQ + 2 * kSmemK);
  float* sM0 = sRed;
  float* sS0 = sRed + 64;
  float* sM1 = sRed + 128;
  float* sS1 = sRed + 192;
  float* sL = sRed + 256;
  uint8_t* sValid = reinterpret_cast<uint8_t*>(sRed + 6 * 64);  // [stage][64]
  const uint32_t bar_u = sK_u + 2 * kSmemK + kSmemRed + kSmemValid;
  auto bar = [&](int stage, int part) { return bar_u + 8u * static_cast<uint32_t>(2 * stage + part); };
  auto bar_free = [&](int stage, int part) { return bar_u + 8u * static_cast<uint32_t>(4 + 2 * stage + part); };
  const uint32_t q_full = bar_u + 64u, q_free = bar_u + 72u;

  const unsigned n_tiles = static_cast<unsigned>(p.s_q) * static_cast<unsigned>(p.num_head_tiles);  // < 2^31
  const unsigned nht = static_cast<unsigned>(p.num_head_tiles);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4, t_wg = tid % 128;
  const int gq = lane / 4, tq = lane % 4;
  const __nv_bfloat16* kvb = static_cast<const __nv_bfloat16*>(p.kv);

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) mbar_init(bar_u + 8 * i, 256);
#pragma unroll
    for (int i = 4; i < 8; ++i) mbar_init(bar_u + 8 * i, 128);
    mbar_init(q_full, 256);
    mbar_init(q_free, 256);
    fence_barrier_init();
  }
  __syncthreads();  // barriers initialised (the only CTA-wide barrier)

  if (wg == 2) {
    // ================= producer warpgroup: Q of every tile and every gather
    setmaxnreg_dec<40>();
    uint64_t kv_pol = 0, q_pol = 0;
    if constexpr (kHint) {
      kv_pol = l2_policy_evict_last();
      q_pol = l2_policy_evict_first();
    }
    const int w_rg = t_wg >> 3, w_c8 = t_wg & 7;  // 8 threads per row, rows w_rg + 16 i
    uint32_t u0 = 0, u1 = 0, uq = 0;
#pragma unroll 1
    for (unsigned tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
      const int ht = static_cast<int>(tile % nht);
      const int sq = static_cast<int>(tile / nht);
      const int lim = row_limit(p, sq);
      const int n_blk = (lim + kBlockN - 1) / kBlockN;
      if (n_blk == 0) continue;
      auto gather_w = [&](int stage, int part, const int (&idx)[4]) {
        const uint32_t dst = sK_u + stage * kSmemK;
        uint8_t* dsts = sK + stage * kSmemK;
#pragma unroll 1
        for (int i = 0; i < 4; ++i) {
          const int row = w_rg + 16 * i;
          const bool valid = idx[i] >= 0 && idx[i] < p.s_kv;
          const __nv_bfloat16* src = valid ? kvb + static_cast<int64_t>(idx[i]) * p.kv_stride_s : kvb;
          if (p.kv_vec) {
            if (part == 0) {
              gather_chunks_w<0, 32, kHint>(dst, src, valid, row, w_c8, kv_pol);
              if (stage == 1) gather_chunks_w<64, kChunks, kHint>(dst, src, valid, row, w_c8, kv_pol);
            } else {
              if (stage == 0) gather_chunks_w<32, kChunks, kHint>(dst, src, valid, row, w_c8, kv_pol);
              else gather_chunks_w<32, 64, kHint>(dst, src, valid, row, w_c8, kv_pol);
            }
          } else {
            const int lo = part == 0 ? 0 : 32, hi = part == 0 ? 32 : (stage == 0 ? kChunks : 64);
#pragma unroll 1
            for (int c = lo + w_c8; c < hi; c += 8)
              *reinterpret_cast<uint4*>(dsts + slab_off(row, c)) =
                  valid ? load8_u16(src + c * 8) : make_uint4(0, 0, 0, 0);
            if (part == 0 && stage == 1)
#pragma unroll 1
              for (int c = 64 + w_c8; c < kChunks; c += 8)
                *reinterpret_cast<uint4*>(dsts + slab_off(row, c)) =
                    valid ? load8_u16(src + c * 8) : make_uint4(0, 0, 0, 0);
          }
          if (part == 0 && w_c8 == 0) sValid[stage * kBlockN + row] = valid ? 1 : 0;
        }
        mbar_arrive_cp_async(bar(stage, part));
        mbar_arrive(bar(stage, part));
      };
      auto idx_w = [&](int blk, int (&idx)[4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) idx[i] = blk < n_blk ? fetch_index(p, sq, blk * kBlockN + w_rg + 16 * i, lim) : -1;
      };
      int ia[4], ib[4];
      idx_w(0, ia);
      idx_w(1, ib);

      // ---- Q of this tile (after both consumer warpgroups finished the previous tile's last S)
      if (uq > 0) mbar_wait(q_free, (uq - 1) & 1u);
      {
        const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + static_cast<int64_t>(sq) * p.q_stride_s;
#pragma unroll 1
        for (int i = 0; i < 4; ++i) {
          const int r = w_rg + 16 * i;
          const int h = ht * 64 + r;
          const bool valid = h < p.h_q;
          const __nv_bfloat16* src = valid ? qb + static_cast<int64_t>(h) * p.q_stride_h : static_cast<const __nv_bfloat16*>(p.q);
          if (p.q_vec) {
#pragma unroll
            for (int c = w_c8; c < kChunks; c += 8) {
              if constexpr (kHint) cp_async_16_l2pf_hint(sQ_u + slab_off(r, c), valid ? src + c * 8 : src, valid, q_pol);
              else cp_async_16_l2pf(sQ_u + slab_off(r, c), valid ? src + c * 8 : src, valid);
            }
          } else {
#pragma unroll 1
            for (int c = w_c8; c < kChunks; c += 8)
              *reinterpret_cast<uint4*>(base + slab_off(r, c)) = valid ? load8_u16(src + c * 8) : make_uint4(0, 0, 0, 0);
          }
        }
        mbar_arrive_cp_async(q_full);
        mbar_arrive(q_full);
        ++uq;
      }

      // ---- block pairs of this tile; parts in the order the consumers free them
#pragma unroll 1
      for (int j = 0; 2 * j < n_blk; ++j) {
        const bool has1 = 2 * j + 1 < n_blk;
        if (j > 0) {
          idx_w(2 * j, ia);
          idx_w(2 * j + 1, ib);
        }
        if (u0 == 0) {  // very first pair of this CTA: nothing to wait for, S0's parts first
          gather_w(0, 0, ia);
          gather_w(0, 1, ia);
          if (has1) {
            gather_w(1, 0, ib);
            gather_w(1, 1, ib);
          }
        } else {
          mbar_wait(bar_free(0, 0), (u0 - 1) & 1u);
          gather_w(0, 0, ia);
          if (has1) {
            if (u1 > 0) mbar_wait(bar_free(1, 1), (u1 - 1) & 1u);
            gather_w(1, 1, ib);
          }
          mbar_wait(bar_free(0, 1), (u0 - 1) & 1u);
          gather_w(0, 1, ia);
          if (has1) {
            if (u1 > 0) mbar_wait(bar_free(1, 0), (u1 - 1) & 1u);
            gather_w(1, 0, ib);
          }
        }
        ++u0;
        if (has1) ++u1;
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  setmaxnreg_inc<232>();

  // ================= consumer warpgroups (256 threads)
  int row_local[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) row_local[hh] = wq * 16 + gq + 8 * hh;
  const uint64_t dq = gmma::make_desc_sw128(sQ_u, 16, 1024);
  // Only the parities of the use counts matter here: bit 0 = u0 & 1, bit 1 = u1 & 1, bit 2 = uq & 1.
  uint32_t phs = 0;

#pragma unroll 1
  for (unsigned tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
    const int n_blk = (row_limit(p, static_cast<int>(tile / nht)) + kBlockN - 1) / kBlockN;
    const uint32_t phq = (phs >> 2) & 1u;

    float o[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) o[j] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};

#pragma unroll 1
    for (int j = 0; 2 * j < n_blk; ++j) {
      const bool has1 = 2 * j + 1 < n_blk, last = 2 * j + 2 >= n_blk;
      const uint32_t ph0 = phs & 1u, ph1 = (phs >> 1) & 1u;
      float s[32];
      if (wg == 0) {
        // ---------------- warpgroup 0: block 2j (stage 0), O[:, 0:256]
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
        gmma::reg_fence(s);
        {
          const uint64_t db = gmma::make_desc_sw128(sK_u, 16, 1024);
          if (j == 0) mbar_wait(q_full, phq);
          mbar_wait(bar(0, 0), ph0);
          gmma::fence_proxy_async();
          gmma::fence();
          s_chain<0, 4>(s, dq, db);
          mbar_wait(bar(0, 1), ph0);
          gmma::fence_proxy_async();
          gmma::fence();
          s_chain<4, kSlabs>(s, dq, db);
        }
        gmma::commit();
        gmma::wait<0>();
        gmma::reg_fence(s);
        if (last) mbar_arrive(q_free);  // this warpgroup's last read of Q in this tile is done

        float mx[2] = {-INFINITY, -INFINITY};
        mask_rowmax(s, sValid, p.scale_log2, tq, mx);
        float m0u[2], sc0[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float m0 = fmaxf(m_run[hh], mx[hh]);
          m0u[hh] = m0 == -INFINITY ? 0.f : m0;
          sc0[hh] = exp2f(m_run[hh] - m0u[hh]);
          if (tq == 0) {
            sM0[row_local[hh]] = m0;
            sS0[row_local[hh]] = sc0[hh];
          }
        }
        bar_arrive(kBarScale0, kThreads);

        float rs[2] = {0.f, 0.f};
        uint32_t a[4][4];
#pragma unroll
        for (int t = 0; t < 8; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[4 * t + e] = exp2f(s[4 * t + e] - m0u[e >> 1]);
            rs[e >> 1] += s[4 * t + e];
          }
          a[t >> 1][(t & 1) * 2 + 0] = HalfTraits<__nv_bfloat16>::pack(s[4 * t + 0], s[4 * t + 1]);
          a[t >> 1][(t & 1) * 2 + 1] = HalfTraits<__nv_bfloat16>::pack(s[4 * t + 2], s[4 * t + 3]);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] = l_run[hh] * sc0[hh] + rs[hh];
        scale_o(o, sc0);
        gmma::reg_fence(o);
        gmma::fence();
        pv_rs_chain(o, a, gmma::make_desc_sw128(sK_u, kSlabBytes, 1024));
        gmma::commit();

        named_barrier_sync(kBarScale1, kThreads);
        float sc1[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          sc1[hh] = sS1[row_local[hh]];
          m_run[hh] = sM1[row_local[hh]];
        }
        uint8_t* sP0 = sK + 8 * kSlabBytes;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const int key = 8 * t + 2 * tq;
          *reinterpret_cast<uint32_t*>(sP0 + slab_off(row_local[0], key >> 3) + (key & 7) * 2) =
              HalfTraits<__nv_bfloat16>::pack(s[4 * t + 0] * sc1[0], s[4 * t + 1] * sc1[0]);
          *reinterpret_cast<uint32_t*>(sP0 + slab_off(row_local[1], key >> 3) + (key & 7) * 2) =
              HalfTraits<__nv_bfloat16>::pack(s[4 * t + 2] * sc1[1], s[4 * t + 3] * sc1[1]);
        }
        gmma::fence_proxy_async();
        bar_arrive(kBarP0, kThreads);

        gmma::wait<0>();
        gmma::reg_fence(o);
        mbar_arrive(bar_free(0, 0));  // stage 0 slabs 0-3 free (every use is released)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] *= sc1[hh];
        scale_o(o, sc1);
        named_barrier_sync(kBarP1, kThreads);
        if (has1) {
          mbar_wait(bar(1, 0), ph1);  // completed (WG1 waited for it); orders the cp.async writes
          gmma::fence_proxy_async();
          gmma::reg_fence(o);
          gmma::fence();
          pv_ss_chain(o, gmma::make_desc_sw128(sK_u + kSmemK + 8 * kSlabBytes, 16, 1024),
                      gmma::make_desc_sw128(sK_u + kSmemK, kSlabBytes, 1024));
          gmma::commit();
          gmma::wait<0>();
          gmma::reg_fence(o);
          mbar_arrive(bar_free(1, 0));  // stage 1 slabs 0-3 and 8 free
        }
      } else {
        // ---------------- warpgroup 1: block 2j+1 (stage 1), O[:, 256:512]
        float mx[2] = {-INFINITY, -INFINITY};
        if (has1) {
#pragma unroll
          for (int i = 0; i < 32; ++i) s[i] = 0.f;
          gmma::reg_fence(s);
          {
            const uint64_t db = gmma::make_desc_sw128(sK_u + kSmemK, 16, 1024);
            if (j == 0) mbar_wait(q_full, phq);
            mbar_wait(bar(1, 0), ph1);
            gmma::fence_proxy_async();
            gmma::fence();
            s_chain<0, 4>(s, dq, db);
            mbar_wait(bar(1, 1), ph1);
            gmma::fence_proxy_async();
            gmma::fence();
            s_chain<4, kSlabs>(s, dq, db);
          }
          gmma::commit();
          gmma::wait<0>();
          gmma::reg_fence(s);
        }
        if (last) mbar_arrive(q_free);  // S1 (if any) done: this warpgroup is done with Q
        if (has1) mask_rowmax(s, sValid + kBlockN, p.scale_log2, tq, mx);
        named_barrier_sync(kBarScale0, kThreads);
        float m1u[2], c[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float m0 = sM0[row_local[hh]];
          const float sc0 = sS0[row_local[hh]];
          const float m1 = fmaxf(m0, mx[hh]);
          m1u[hh] = m1 == -INFINITY ? 0.f : m1;
          const float sc1 = exp2f(m0 - m1u[hh]);
          if (tq == 0) {
            sM1[row_local[hh]] = m1;
            sS1[row_local[hh]] = sc1;
          }
          c[hh] = sc0 * sc1;
          m_run[hh] = m1;
        }
        bar_arrive(kBarScale1, kThreads);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] *= c[hh];
        scale_o(o, c);
        uint32_t a[4][4];
        if (has1) {
          float rs[2] = {0.f, 0.f};
          uint8_t* sP1 = sK + kSmemK + 8 * kSlabBytes;
#pragma unroll
          for (int t = 0; t < 8; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              s[4 * t + e] = exp2f(s[4 * t + e] - m1u[e >> 1]);
              rs[e >> 1] += s[4 * t + e];
            }
            a[t >> 1][(t & 1) * 2 + 0] = HalfTraits<__nv_bfloat16>::pack(s[4 * t + 0], s[4 * t + 1]);
            a[t >> 1][(t & 1) * 2 + 1] = HalfTraits<__nv_bfloat16>::pack(s[4 * t + 2], s[4 * t + 3]);
            const int key = 8 * t + 2 * tq;
            *reinterpret_cast<uint32_t*>(sP1 + slab_off(row_local[0], key >> 3) + (key & 7) * 2) =
                a[t >> 1][(t & 1) * 2 + 0];
            *reinterpret_cast<uint32_t*>(sP1 + slab_off(row_local[1], key >> 3) + (key & 7) * 2) =
                a[t >> 1][(t & 1) * 2 + 1];
          }
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) l_run[hh] += rs[hh];
          gmma::fence_proxy_async();
        }
        bar_arrive(kBarP1, kThreads);
        if (has1) {
          gmma::reg_fence(o);
          gmma::fence();
          pv_rs_chain(o, a, gmma::make_desc_sw128(sK_u + kSmemK + 4 * kSlabBytes, kSlabBytes, 1024));
          gmma::commit();
        }
        named_barrier_sync(kBarP0, kThreads);
        mbar_wait(bar(0, 1), ph0);  // completed (WG0 waited for it); orders the cp.async writes
        gmma::fence_proxy_async();
        gmma::fence();
        pv_ss_chain(o, gmma::make_desc_sw128(sK_u + 8 * kSlabBytes, 16, 1024),
                    gmma::make_desc_sw128(sK_u + 4 * kSlabBytes, kSlabBytes, 1024));
        gmma::commit();
        if (has1) {
          gmma::wait<1>();  // P1 V1_R done: stage 1 slabs 4-7 are free
          mbar_arrive(bar_free(1, 1));
        }
        gmma::wait<0>();
        gmma::reg_fence(o);
        mbar_arrive(bar_free(0, 1));  // stage 0 slabs 4-8 free
      }
      phs ^= has1 ? 3u : 1u;  // ++u0; if (has1) ++u1;
    }
    if (n_blk > 0) phs ^= 4u;  // ++uq
    const int ht = static_cast<int>(tile % nht);
    const int sq = static_cast<int>(tile / nht);

    // ---- epilogue: L = WG0's part + WG1's part
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 1);
      l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 2);
    }
    float L[2] = {0.f, 0.f};
    if (n_blk > 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (tq == 0) sL[wg * 64 + row_local[hh]] = l_run[hh];
      named_barrier_sync(kBarConsumers, kThreads);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) L[hh] = sL[row_local[hh]] + sL[64 + row_local[hh]];
    }

#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = ht * 64 + row_local[hh];
      if (h >= p.h_q) continue;
      const bool empty = !(L[hh] > 0.f);  // no valid slot
      const float lse2 = empty ? INFINITY : log2f(L[hh]) + m_run[hh];
      const float inv = empty ? 0.f : sink_factor(p, h, lse2) / L[hh];
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(sq) * p.o_stride_s +
                           static_cast<int64_t>(h) * p.o_stride_h;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = wg * 256 + j * 8 + 2 * tq;
        const float v0 = o[4 * j + 2 * hh] * inv, v1 = o[4 * j + 2 * hh + 1] * inv;
        if (p.out_vec_ok) {
          *reinterpret_cast<uint32_t*>(out + col) = HalfTraits<__nv_bfloat16>::pack(v0, v1);
        } else {
          out[col * p.o_stride_d] = __float2bfloat16_rn(v0);
          out[(col + 1) * p.o_stride_d] = __float2bfloat16_rn(v1);
        }
      }
      if (wg == 0 && tq == 0) {
        p.lse[static_cast<int64_t>(sq) * p.lse_stride_s + static_cast<int64_t>(h) * p.lse_stride_h] =
            empty ? INFINITY : lse2 * kLn2;
        p.max_logits[static_cast<int64_t>(sq) * p.ml_stride_s + static_cast<int64_t>(h) * p.ml_stride_h] =
            empty ? -INFINITY : m_run[hh] * kLn2;
      }
    }
  }
}

/// grid_cap: CTAs to launch at most (the SM count; one CTA per SM).
template <int kD, bool kHint>
cudaError_t launch(const SparsePrefillKernelParams& kp, int grid_cap, cudaStream_t stream) {
  auto kernel = sparse_attn_fwd_persist_kernel<kD, kHint>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return e;
  const int64_t tiles = static_cast<int64_t>(kp.s_q) * kp.num_head_tiles;
  const int64_t g = tiles < grid_cap ? tiles : (grid_cap > 0 ? grid_cap : 1);
  kernel<<<dim3(static_cast<unsigned>(g), 1, 1), kThreadsProd, kSmemBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace flashmla::sm90::sparse_prefill::ps
