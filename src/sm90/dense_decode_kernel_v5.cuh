// src/sm90/dense_decode_kernel_v5.cuh — split-KV dense MLA decode, version 5 (opt-in:
// FLASHMLA_DENSE_DECODE_KERNEL=v5 or set_dense_kernel_version(5); v4 stays the default).
//
// v4's seesaw (see dense_decode_kernel_v4.cuh: same shared-memory layout, same slab
// barriers, same softmax arithmetic, P0 / P1 in slab 8 of their K stage) with the
// tensor-core work software-pipelined across block pairs:
//   * S of a pair is issued at the END of the previous step (a prologue computes the
//     first pair's S), so each warpgroup's next S enters the tensor pipe behind its own
//     last P·V instead of after a wait + TMA issue + wgmma.fence round trip;
//   * WG0 issues S0' (next block 0, slabs 0-3: loaded since the middle of the step)
//     right after P1·V1_L WITHOUT waiting for it, then waits for P1·V1_L only (wait<1>),
//     issues the loads that P1·V1_L was holding back (stage 1 slabs 0-3 and 8), and
//     continues S0' with slabs 4-8;
//   * WG1 issues P0·V0_R BEFORE P1·V1_R (v4: after), so stage 0's slabs 4-8 are released
//     one P·V earlier (wait<1>), stage 1's slabs 4-7 after P1·V1_R (wait<0>); its next
//     S1' reads slabs 4-7 first (released first), then 0-3 and 8;
//   * WG1 signals "P1 ready" only after it has issued P0·V0_R (named barrier kBarP1), so
//     WG0's P1·V1_L always enters the pipe after P0·V0_R: the pipe order of a step is
//     P0·V0_L, P0·V0_R, {P1·V1_R, P1·V1_L}, S0', S1'.
// Per-step protocol (j = pair index; "S(j)" = S of pair j, already in registers at the
// top of step j):
//   WG0: softmax0 -> arrive Scale0 -> P0 V0_L (RS) -> sync Scale1 -> P0*scale1 to stage0
//        slab 8, fence.proxy.async -> arrive P0 -> wait<0> -> [load stage0 slabs 0-3 of
//        pair j+1] -> O_L *= scale1 -> sync P1 -> P1 V1_L (SS) -> S0'(slabs 0-3) ->
//        wait<1> -> [load stage1 slabs 0-3, 8 of pair j+1] -> S0'(slabs 4-8) -> wait<0>
//   WG1: rowmax S1 -> sync Scale0 -> m1, scale1 -> arrive Scale1 -> O_R *= scale0*scale1
//        -> P1 to stage1 slab 8, fence.proxy.async -> sync P0 -> P0 V0_R (SS) -> arrive P1
//        -> P1 V1_R (RS) -> wait<1> -> [load stage0 slabs 4-8] -> wait<0> -> [load stage1
//        slabs 4-7] -> S1'(slabs 4-7, 0-3, 8) -> wait<0>
// Invariants (why it is race free; see also bench/NOTES.md "dense decode v5"):
//   I1 a K slab is re-loaded only after every wgmma that reads it has completed, as seen
//      by the issuing thread through its own wgmma.wait_group (stage0 0-3: S0, P0V0_L —
//      WG0; stage0 4-8: S0 (WG0 waited before arriving P0, which WG1 synced), P0V0_R —
//      WG1; stage1 4-7: S1, P1V1_R — WG1; stage1 0-3, 8: S1 (done before WG1 arrived P1),
//      P1V1_L — WG0). Hence each slab barrier completes exactly one phase per load and a
//      waiter never falls two phases behind (parity waits stay unambiguous).
//   I2 every load of a block arms all of its slab barriers exactly once; stage 0 takes
//      blocks blk_lo, blk_lo+2, ..., stage 1 blk_lo+1, ...; each S on a stage flips that
//      warpgroup's parity once (WG0 only reads stage 0 in S, WG1 only stage 1).
//   I3 named barriers: each of Scale0, Scale1, P0, P1 is passed once per step by both
//      warpgroups (arrive on one side, sync on the other), unconditionally; WG0 arrives
//      P0 before it syncs P1 and WG1 syncs P0 before it arrives P1, so no cycle.
//   I4 sM0/sS0 (written by WG0 before arriving Scale0 of step j+1) are read by WG1 before
//      it arrives Scale1 of step j, which WG0 syncs first; sM1/sS1 likewise with Scale0.
//   I5 at the end of a request both warpgroups have waited all their wgmma groups and no
//      load is in flight (loads of pair j+1 are issued only when it exists).
// Requires a K tensor map (the host falls back to v3 / v2 / v1 otherwise).
#pragma once

#include "sm90/dense_decode_kernel_v4.cuh"

namespace flashmla::sm90::dense_v5 {

using dense_v4::bar_arrive;
using dense_v4::kBarP0;
using dense_v4::kBarP1;
using dense_v4::kBarScale0;
using dense_v4::kBarScale1;
using dense_v4::kBarWG0;
using dense_v4::kBarWG1;
using dense_v4::kBlockM;
using dense_v4::kBlockN;
using dense_v4::kDimV;
using dense_v4::kSlabBytes;
using dense_v4::kSmemBytes;
using dense_v4::kSmemK;
using dense_v4::kSmemQ;
using dense_v4::kSmemRed;
using dense_v4::kThreads;
using dense_v4::Mma;
using dense_v4::pv_rs_chain;
using dense_v4::pv_ss_chain;
using dense_v4::slab_off;
using dense_v4::zero_v_rows;

// 4 k-steps of S over slab kSl; kZero: the first one overwrites the accumulators.
template <typename T, int kSl, int kK, bool kZero>
__device__ __forceinline__ void s_step(float (&s)[32], uint64_t da0, uint64_t db0) {
  constexpr int kOff = (kSl * kSlabBytes + kK * 32) >> 4;
  Mma<T>::template s<kOff, (kZero && kK == 0) ? 0 : 1>(s, da0, db0);
  if constexpr (kK + 1 < 4) s_step<T, kSl, kK + 1, kZero>(s, da0, db0);
}
// S over the listed slabs in that order, each after its TMA barrier; fully unrolled.
template <typename T, bool kZero, int kSl, int... kRest>
__device__ __forceinline__ void s_slabs(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0, uint32_t parity) {
  dense_tma::mbar_wait(bar0 + 8 * kSl, parity);
  gmma::fence();
  s_step<T, kSl, 0, kZero>(s, da0, db0);
  if constexpr (sizeof...(kRest) > 0) s_slabs<T, false, kRest...>(s, da0, db0, bar0, parity);
}
// All slabs in order (prologue).
template <typename T, int kSlabs>
__device__ __forceinline__ void s_all(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0, uint32_t parity) {
  if constexpr (kSlabs == 9) s_slabs<T, true, 0, 1, 2, 3, 4, 5, 6, 7, 8>(s, da0, db0, bar0, parity);
  else s_slabs<T, true, 0, 1, 2, 3, 4, 5, 6, 7>(s, da0, db0, bar0, parity);
}
// WG0's next S, part A: slabs 0-3 (released after P0 V0_L).
template <typename T>
__device__ __forceinline__ void s_wg0_a(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0, uint32_t parity) {
  s_slabs<T, true, 0, 1, 2, 3>(s, da0, db0, bar0, parity);
}
// WG0's next S, part B: slabs 4-7 (and 8) (released after P0 V0_R).
template <typename T, int kSlabs>
__device__ __forceinline__ void s_wg0_b(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0, uint32_t parity) {
  if constexpr (kSlabs == 9) s_slabs<T, false, 4, 5, 6, 7, 8>(s, da0, db0, bar0, parity);
  else s_slabs<T, false, 4, 5, 6, 7>(s, da0, db0, bar0, parity);
}
// WG1's next S: slabs 4-7 (released after P1 V1_R) first, then 0-3 and 8 (after P1 V1_L).
template <typename T, int kSlabs>
__device__ __forceinline__ void s_wg1(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0, uint32_t parity) {
  if constexpr (kSlabs == 9) s_slabs<T, true, 4, 5, 6, 7, 0, 1, 2, 3, 8>(s, da0, db0, bar0, parity);
  else s_slabs<T, true, 4, 5, 6, 7, 0, 1, 2, 3>(s, da0, db0, bar0, parity);
}

// P tile (64 rows x 64 keys, one 128B-swizzled slab): the thread (gq, tq) of warp wq
// writes rows r = 16 wq + gq and r + 8, keys 8t + 2tq (+1), t = 0..7. Byte offset
// r*128 + ((t ^ (r & 7)) << 4) + 4 tq, and r & 7 = gq for both rows, so the address is
// (slab + r*128 + (gq << 4) + 4 tq) ^ (t << 4), + 1024 for the second row. `base` is
// laundered through an empty asm once per step, so the compiler cannot hoist 16
// precomputed addresses out of the loop (v4 spilled them).
__device__ __forceinline__ uint32_t p_base(uint32_t slab_u, int row0, int gq, int tq) {
  uint32_t b = slab_u + static_cast<uint32_t>(row0 * 128 + (gq << 4) + 4 * tq);
  asm volatile("" : "+r"(b));
  return b;
}
template <int kT, int kHh>
__device__ __forceinline__ void st_p(uint32_t base, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"((base ^ (kT << 4)) + kHh * 1024), "r"(v) : "memory");
}

template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, 1)
    flash_fwd_splitkv_mla_kernel_v5(const DenseDecodeKernelParams p, const __grid_constant__ CUtensorMap tmap_k) {
  constexpr int kSlabs = kD / 64;
  constexpr int kChunks = kD / 8;
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
  const uint32_t bar_u = sK_u + 2 * kSmemK + kSmemRed;

  const int m_tile = blockIdx.x, kv_head = blockIdx.y, part = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4, t_wg = tid % 128;
  const int gq = lane / 4, tq = lane % 4;

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 18; ++i) dense_tma::mbar_init(bar_u + 8 * i, 1);
    dense_tma::fence_barrier_init();
    dense_tma::prefetch_tensormap(&tmap_k);
  }
  // Programmatic Dependent Launch (kTunePdl; no-ops otherwise): wait for the preceding
  // grid (the scheduler) before the first global read, then let the combine's grid be
  // scheduled (it waits for this grid's completion itself, before reading anything).
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  __syncthreads();
  uint32_t phase = 0;  // parity of the next phase of this warpgroup's stage (WG0: 0, WG1: 1)

  const int32_t* meta = p.tile_scheduler_metadata + part * 8;
  const int begin_req = meta[0], end_req = meta[1], begin_blk = meta[2], end_blk = meta[3];
  const int begin_split = meta[4], first_splitted = meta[5], last_splitted = meta[6];
  if (begin_req >= p.b) return;

  const int pbs = p.page_block_size;
  const int box_tok = p.tma_box_tok;  // min(pbs, 64)

  int row_local[2], row_global[2], row_sq[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_local[hh] = wq * 16 + gq + 8 * hh;
    row_global[hh] = m_tile * kBlockM + row_local[hh];
    row_sq[hh] = row_global[hh] / p.group;
  }

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
    __syncthreads();  // the previous request is done with all shared memory

    const int32_t* bt_row = p.block_table + req * p.bt_stride_b;
    // Boxes of block `blk` that start before seqlen (later ones are not loaded).
    auto n_boxes = [&](int blk) {
      const int valid = min(seqlen - blk * kBlockN, kBlockN);
      return (valid + box_tok - 1) / box_tok;
    };
    auto page_of = [&](int blk, int j) {
      return bt_row[static_cast<int64_t>((blk * kBlockN + j * box_tok) / pbs) * p.bt_stride_j];
    };
    // Slabs [lo, hi) of block `blk` into `stage` (one thread). pg0 = page of the first box
    // (read ahead by the caller); with pages of 16/32 tokens the others are read here.
    auto issue = [&](int blk, int stage, int lo, int hi, int pg0) {
      const int nb = n_boxes(blk);
      const uint32_t bar0 = bar_u + stage * (9 * 8);
      const uint32_t dst = sK_u + stage * kSmemK;
      const int s_hi = min(hi, kSlabs);
#pragma unroll 1
      for (int j = 0; j < nb; ++j) {
        const int pg = j == 0 ? pg0 : page_of(blk, j);
        const int tip = (blk * kBlockN + j * box_tok) % pbs;
#pragma unroll 1
        for (int s = lo; s < s_hi; ++s) {
          if (j == 0) dense_tma::mbar_arrive_expect_tx(bar0 + 8 * s, static_cast<uint32_t>(nb * box_tok * 128));
          dense_tma::tma_load_4d(dst + s * kSlabBytes + j * box_tok * 128, &tmap_k, bar0 + 8 * s, 64 * s, kv_head,
                                 tip, pg);
        }
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
      cp_async_commit();
      if (tid == 0) {
        issue(blk_lo, 0, 0, 9, page_of(blk_lo, 0));
        if (n_blk > 1) issue(blk_lo + 1, 1, 0, 9, page_of(blk_lo + 1, 0));
      }
      cp_async_wait<0>();
      gmma::fence_proxy_async();
      __syncthreads();  // Q in shared memory, visible to wgmma
    }

    float o[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) o[j] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};
    const uint64_t dq = gmma::make_desc_sw128(sQ_u, 16, 1024);
    // K-major descriptors of this warpgroup's S stage (WG0: stage 0, WG1: stage 1).
    const uint64_t dk_own = gmma::make_desc_sw128(sK_u + wg * kSmemK, 16, 1024);
    const uint32_t bar_own = bar_u + wg * (9 * 8);

    // ---- prologue: S of the first pair (WG0: block blk_lo, WG1: blk_lo + 1)
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    if (wg == 0 ? n_blk > 0 : n_blk > 1) {
      gmma::reg_fence(s);
      s_all<T, kSlabs>(s, dq, dk_own, bar_own, phase);
      gmma::commit();
      gmma::wait<0>();
      gmma::reg_fence(s);
      phase ^= 1u;
    }

    for (int j = 0; 2 * j < n_blk; ++j) {
      const int b0 = blk_lo + 2 * j, b1 = b0 + 1;
      const bool has1 = 2 * j + 1 < n_blk, nxt0 = 2 * j + 2 < n_blk, nxt1 = 2 * j + 3 < n_blk;
      const int tok0 = b0 * kBlockN, tok1 = tok0 + kBlockN;
      const int valid0 = min(seqlen - tok0, kBlockN), valid1 = min(seqlen - tok1, kBlockN);
      // Page ids of the next pair, read early by the two issuing threads.
      int pgA = 0, pgB = 0;
      if (t_wg == 0) {
        if (nxt0) pgA = page_of(b0 + 2, 0);
        if (nxt1) pgB = page_of(b1 + 2, 0);
      }
      if (wg == 0) {
        // ---------------- warpgroup 0: block 0, O[:, 0:256]; S0 is in s
        const bool need_mask = tok0 + kBlockN > min_limit;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float v = s[4 * t + e] * p.scale_log2;
            if (need_mask && tok0 + 8 * t + 2 * tq + (e & 1) >= limit[e >> 1]) v = -INFINITY;
            s[4 * t + e] = v;
            mx[e >> 1] = fmaxf(mx[e >> 1], v);
          }
        float m0u[2], sc0[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
          mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
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
          a[t >> 1][(t & 1) * 2 + 0] = HalfTraits<T>::pack(s[4 * t + 0], s[4 * t + 1]);
          a[t >> 1][(t & 1) * 2 + 1] = HalfTraits<T>::pack(s[4 * t + 2], s[4 * t + 3]);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] = l_run[hh] * sc0[hh] + rs[hh];
        if (__any_sync(0xffffffffu, sc0[0] != 1.f || sc0[1] != 1.f)) {
#pragma unroll
          for (int i = 0; i < 32; ++i) {
            o[4 * i + 0] *= sc0[0];
            o[4 * i + 1] *= sc0[0];
            o[4 * i + 2] *= sc0[1];
            o[4 * i + 3] *= sc0[1];
          }
        }
        if (valid0 < kBlockN) zero_v_rows(sK, valid0, t_wg, kBarWG0);
        gmma::reg_fence(o);
        gmma::fence();
        pv_rs_chain<T>(o, a, gmma::make_desc_sw128(sK_u, kSlabBytes, 1024));
        gmma::commit();

        named_barrier_sync(kBarScale1, kThreads);
        float sc1[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          sc1[hh] = sS1[row_local[hh]];
          m_run[hh] = sM1[row_local[hh]];
        }
        // P0 * scale1 -> slab 8 of stage 0 (S0 is done with it)
        {
          const uint32_t pb = p_base(sK_u + 8 * kSlabBytes, row_local[0], gq, tq);
#define FLASHMLA_V5_ST_P0(t)                                                          \
  st_p<t, 0>(pb, HalfTraits<T>::pack(s[4 * t + 0] * sc1[0], s[4 * t + 1] * sc1[0])); \
  st_p<t, 1>(pb, HalfTraits<T>::pack(s[4 * t + 2] * sc1[1], s[4 * t + 3] * sc1[1]));
          FLASHMLA_V5_ST_P0(0) FLASHMLA_V5_ST_P0(1) FLASHMLA_V5_ST_P0(2) FLASHMLA_V5_ST_P0(3)
          FLASHMLA_V5_ST_P0(4) FLASHMLA_V5_ST_P0(5) FLASHMLA_V5_ST_P0(6) FLASHMLA_V5_ST_P0(7)
#undef FLASHMLA_V5_ST_P0
        }
        gmma::fence_proxy_async();
        bar_arrive(kBarP0, kThreads);

        gmma::wait<0>();
        gmma::reg_fence(o);
        if (tid == 0 && nxt0) issue(b0 + 2, 0, 0, 4, pgA);  // stage 0 slabs 0-3 are free
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] *= sc1[hh];
        if (__any_sync(0xffffffffu, sc1[0] != 1.f || sc1[1] != 1.f)) {
#pragma unroll
          for (int i = 0; i < 32; ++i) {
            o[4 * i + 0] *= sc1[0];
            o[4 * i + 1] *= sc1[0];
            o[4 * i + 2] *= sc1[1];
            o[4 * i + 3] *= sc1[1];
          }
        }
        // P1 in smem and (v5) P0 V0_R already issued by WG1.
        named_barrier_sync(kBarP1, kThreads);
        if (has1) {
          if (valid1 < kBlockN) zero_v_rows(sK + kSmemK, valid1, t_wg, kBarWG0);
          gmma::reg_fence(o);
          gmma::fence();
          pv_ss_chain<T>(o, gmma::make_desc_sw128(sK_u + kSmemK + 8 * kSlabBytes, 16, 1024),
                         gmma::make_desc_sw128(sK_u + kSmemK, kSlabBytes, 1024));
          gmma::commit();
        }
        if (nxt0) {
          // S0' of the next pair enters the pipe behind P1 V1_L (no wait in between).
#pragma unroll
          for (int i = 0; i < 32; ++i) s[i] = 0.f;
          gmma::reg_fence(s);
          s_wg0_a<T>(s, dq, dk_own, bar_own, phase);
          gmma::commit();
          gmma::wait<1>();  // P1 V1_L done (nxt0 implies has1: it is the older group)
          if (tid == 0 && nxt1) {  // stage 1 slabs 0-3 and 8 are free
            issue(b1 + 2, 1, 0, 4, pgB);
            issue(b1 + 2, 1, 8, 9, pgB);
          }
          s_wg0_b<T, kSlabs>(s, dq, dk_own, bar_own, phase);
          gmma::commit();
          gmma::wait<0>();
          gmma::reg_fence(s);
          gmma::reg_fence(o);
          phase ^= 1u;
        } else {
          gmma::wait<0>();
          gmma::reg_fence(o);
        }
      } else {
        // ---------------- warpgroup 1: block 1, O[:, 256:512]; S1 is in s (if has1)
        float mx[2] = {-INFINITY, -INFINITY};
        if (has1) {
          const bool need_mask = tok1 + kBlockN > min_limit;
#pragma unroll
          for (int t = 0; t < 8; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float v = s[4 * t + e] * p.scale_log2;
              if (need_mask && tok1 + 8 * t + 2 * tq + (e & 1) >= limit[e >> 1]) v = -INFINITY;
              s[4 * t + e] = v;
              mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
          }
        }
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
        if (__any_sync(0xffffffffu, c[0] != 1.f || c[1] != 1.f)) {
#pragma unroll
          for (int i = 0; i < 32; ++i) {
            o[4 * i + 0] *= c[0];
            o[4 * i + 1] *= c[0];
            o[4 * i + 2] *= c[1];
            o[4 * i + 3] *= c[1];
          }
        }
        uint32_t a[4][4];
        if (has1) {
          float rs[2] = {0.f, 0.f};
#pragma unroll
          for (int t = 0; t < 8; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              s[4 * t + e] = exp2f(s[4 * t + e] - m1u[e >> 1]);
              rs[e >> 1] += s[4 * t + e];
            }
            a[t >> 1][(t & 1) * 2 + 0] = HalfTraits<T>::pack(s[4 * t + 0], s[4 * t + 1]);
            a[t >> 1][(t & 1) * 2 + 1] = HalfTraits<T>::pack(s[4 * t + 2], s[4 * t + 3]);
          }
          {
            const uint32_t pb = p_base(sK_u + kSmemK + 8 * kSlabBytes, row_local[0], gq, tq);
#define FLASHMLA_V5_ST_P1(t)                           \
  st_p<t, 0>(pb, a[(t) >> 1][((t) & 1) * 2 + 0]); \
  st_p<t, 1>(pb, a[(t) >> 1][((t) & 1) * 2 + 1]);
            FLASHMLA_V5_ST_P1(0) FLASHMLA_V5_ST_P1(1) FLASHMLA_V5_ST_P1(2) FLASHMLA_V5_ST_P1(3)
            FLASHMLA_V5_ST_P1(4) FLASHMLA_V5_ST_P1(5) FLASHMLA_V5_ST_P1(6) FLASHMLA_V5_ST_P1(7)
#undef FLASHMLA_V5_ST_P1
          }
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) l_run[hh] += rs[hh];
          // Partial block 1: its V rows past seqlen (stage 1 slabs 4-7) are zeroed here,
          // before P1 V1_R; zero_v_rows ends with fence.proxy.async + a WG1 barrier, which
          // also publishes P1. (valid0 < 64 and valid1 < 64 never hold together.)
          if (valid1 < kBlockN) zero_v_rows(sK + kSmemK + 4 * kSlabBytes, valid1, t_wg, kBarWG1);
          else gmma::fence_proxy_async();
        }
        named_barrier_sync(kBarP0, kThreads);
        if (valid0 < kBlockN) zero_v_rows(sK + 4 * kSlabBytes, valid0, t_wg, kBarWG1);
        gmma::reg_fence(o);
        gmma::fence();
        pv_ss_chain<T>(o, gmma::make_desc_sw128(sK_u + 8 * kSlabBytes, 16, 1024),
                       gmma::make_desc_sw128(sK_u + 4 * kSlabBytes, kSlabBytes, 1024));
        gmma::commit();
        // "P1 ready" is signalled only now, so WG0's P1 V1_L enters the pipe after P0 V0_R.
        bar_arrive(kBarP1, kThreads);
        if (has1) {
          gmma::fence();
          pv_rs_chain<T>(o, a, gmma::make_desc_sw128(sK_u + kSmemK + 4 * kSlabBytes, kSlabBytes, 1024));
          gmma::commit();
          gmma::wait<1>();  // P0 V0_R done
        } else {
          gmma::wait<0>();
        }
        if (tid == 128 && nxt0) issue(b0 + 2, 0, 4, 9, pgA);  // stage 0 slabs 4-8 are free
        gmma::wait<0>();                                       // P1 V1_R done
        gmma::reg_fence(o);
        if (tid == 128 && nxt1) issue(b1 + 2, 1, 4, 8, pgB);  // stage 1 slabs 4-7 are free
        if (nxt1) {
#pragma unroll
          for (int i = 0; i < 32; ++i) s[i] = 0.f;
          gmma::reg_fence(s);
          s_wg1<T, kSlabs>(s, dq, dk_own, bar_own, phase);
          gmma::commit();
          gmma::wait<0>();
          gmma::reg_fence(s);
          phase ^= 1u;
        }
      }
    }

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
      __syncthreads();
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) L[hh] = sL[row_local[hh]] + sL[64 + row_local[hh]];
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
  auto kernel = flash_fwd_splitkv_mla_kernel_v5<T, kD>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return e;
  const int m_tiles = (kp.m_rows + kBlockM - 1) / kBlockM;
  const dim3 grid(m_tiles, kp.h_kv, num_sm_parts);
  if (kp.flags & kTunePdl) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = kSmemBytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    e = cudaLaunchKernelEx(&cfg, kernel, kp, tmap);
    if (e != cudaSuccess) return e;
  } else {
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(kp, tmap);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_main(const DenseDecodeKernelParams& kp, const CUtensorMap& tmap, int num_sm_parts,
                        cudaStream_t stream) {
  if (kp.d_qk == 512) return launch_main_d<T, 512>(kp, tmap, num_sm_parts, stream);
  return launch_main_d<T, 576>(kp, tmap, num_sm_parts, stream);
}

}  // namespace flashmla::sm90::dense_v5
