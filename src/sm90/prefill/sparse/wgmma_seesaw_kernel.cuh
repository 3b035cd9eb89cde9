// src/sm90/prefill/sparse/wgmma_seesaw_kernel.cuh — sparse MLA prefill for 64-row head tiles (h_q > 32):
// the dense decode's "seesaw" schedule (spec §7.1, §7.3) fed by a producer warpgroup's cp.async gather.
//
// Same semantics as the mma.sync kernel (mma_sync_kernel.cuh: slot validity, zero-filled invalid rows
// that are never read, topk_length, sink, max_logits / lse conventions, grid x = s_q *
// head_tiles). Two 64-slot blocks per step, block 2j in K stage 0 and 2j+1 in stage 1;
// warpgroup 0 owns O[:, 0:256], warpgroup 1 O[:, 256:512]:
//   WG0: S0 = Q K0^T (m64n64); m0, scale0, P0 (registers); O_L = O_L*scale0 + P0 V0_L
//   WG1: S1 = Q K1^T; m1 = max(m0, .), scale1; O_R = O_R*scale0*scale1 + P1 V1_R; P1 -> smem
//   WG0: P0*scale1 -> smem; O_L = O_L*scale1 + P1 V1_L (P1 from smem)
//   WG1: O_R += P0 V0_R (P0 from smem)
// P0 / P1 live in slab 8 of their stage (the RoPE dims of d576, free once S is done).
// Order on the tensor pipe (as FlashMLA's phase1 kernel): WG0 issues the next pair's S0 right behind
// its P1 V1_L, so it enters each pair with S0 done and its softmax overlaps WG1's S1; WG1 runs S1 over
// stage 1 part B (freed by its own P1 V1_R) before part A (freed last, by WG0's P1 V1_L), and announces
// P1 only after issuing P0 V0_R, so P0 V0_R (whose slabs WG0's next S0 waits for) goes first (the three
// together: -4.3 to -4.7% on the H200; each alone 0-1%). The running max moves lazily
// (seesaw::lazy_max), so most rescales are skipped; max_logits comes from the true row max (m_true).
// Gather: a third, producer warpgroup does every gather (FlashMLA's sm90 layout, spec §7.3): 384
// threads, setmaxnreg 232 for the two consumer warpgroups and 40 for the producer. Each stage is split
// in two parts, each completing on its own mbarrier (count 256: 128 cp.async.mbarrier.arrive.noinc
// arrivals for the copies + 128 release arrivals that publish the slot-validity bytes):
//   stage 0 part A = slabs 0-3 (freed by WG0 after its P0 V0_L);
//   stage 0 part B = slabs 4-8 (freed by WG1 after its P0 V0_R);
//   stage 1 part A = slabs 0-3 and 8 (freed by WG0 after its P1 V1_L);
//   stage 1 part B = slabs 4-7 (freed by WG1 after its P1 V1_R).
// The consumers arrive on a "free" mbarrier per stage part (count 128) when the next pair needs it;
// the producer waits on it and gathers the part of the next pair (order s0A, s1B, s0B, s1A = the
// order in which they are freed), 8 threads per gathered row so one warp instruction copies 4 whole
// 128-byte lines, 16-byte cp.async with the L2::256B prefetch hint. The producer keeps each pair's 8
// slot indices in registers and issues every copy as one cp.async at a compile-time offset from a
// per-thread base (per-chunk address arithmetic had made the producer's instruction stream the
// bottleneck, ~1700 cycles per stage part). Every barrier completes once per processed pair, so the
// wait parity is the pair's parity. Consumers wait on the barrier and issue fence.proxy.async before
// their wgmma reads (cp.async writes are generic-proxy writes). Unaligned q / kv rows are handled too
// (2-byte loads and st.shared, published by the same release arrival), so results do not depend on
// alignment. Design notes and measurements: docs/sparse-prefill.md.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "sm90/prefill/sparse/sparse_prefill.h"
#include "sm90/prefill/sparse/mma_sync_kernel.cuh"
#include "sm90/common/utils.cuh"
#include "sm90/common/wgmma.cuh"
#include "sm90/common/host_utils.h"
#include "sm90/common/seesaw.cuh"
#include "sm90/common/trace.cuh"

namespace flashmla::sm90::sparse_prefill::wgmma_seesaw {

using namespace seesaw;  // slab layout, wgmma chains, barrier wrappers

constexpr int kTileBytes = 9 * kSlabBytes;
constexpr int kSmemQ = kTileBytes;
constexpr int kSmemK = kTileBytes;
constexpr int kSmemRed = 9 * 64 * 4;  // sM0, sS0, sM1, sS1, sL[2][64], sMx[2][64], sSink[64]
// Validity bytes [stage][64], then one any-invalid flag per stage and producer warp: a block whose
// 64 slots are all valid skips the masking (seesaw::scale_rowmax instead of mask_rowmax;
// -1.2 to -1.9% in the trace tool).
constexpr int kSmemValid = 2 * kBlockN + 8;
constexpr int kSmemBar = 9 * 8;  // full[stage][part], free[stage][part], q_full
constexpr int kSmemBytes = 1024 /*alignment slack*/ + kSmemQ + 2 * kSmemK + kSmemRed + kSmemValid + kSmemBar;
static_assert(kSmemBytes <= 232448, "shared memory");

// Diagnostic builds only (tools/trace): FLASHMLA_PREFILL_DIAG=1 issues no KV gather copies (the
// barriers still complete; the consumers compute on stale shared memory), =2 issues no wgmma (the
// gathers and the barrier protocol run alone), =3 copies no Q (stale shared memory), =4 issues no
// output row copies. Results are wrong in all; undefined (0) = the kernel.
#ifndef FLASHMLA_PREFILL_DIAG
#define FLASHMLA_PREFILL_DIAG 0
#endif
constexpr bool kDiagNoGather = FLASHMLA_PREFILL_DIAG == 1;
constexpr bool kDiagNoMma = FLASHMLA_PREFILL_DIAG == 2;
constexpr bool kDiagNoQ = FLASHMLA_PREFILL_DIAG == 3;
constexpr bool kDiagNoStore = FLASHMLA_PREFILL_DIAG == 4;

// Registers per thread after setmaxnreg: 2 * consumer + producer <= 3 * 168 (the launch allocation).
// The producer keeps each pair's slot indices as 32-bit ints and turns a row into its source address
// after the free-barrier wait, which fits in 40 (48 / 56 measured neutral). Overridable for
// experiments (tools/trace/run-prefill-trace.sh). (Building the 16 addresses ahead at the top of the
// pair with a budget of 48 lost on the H200: 0.951 vs 0.962.)
#ifndef FLASHMLA_PREFILL_PRODUCER_REGS
#define FLASHMLA_PREFILL_PRODUCER_REGS 40
#endif
constexpr int kProducerRegs = FLASHMLA_PREFILL_PRODUCER_REGS;
constexpr int kConsumerRegs = (3 * 168 - kProducerRegs) / 2 / 8 * 8;
// setmaxnreg takes multiples of 8 in [24, 256]; the producer may only give registers back and the
// consumers only take (both from the 168 of the launch).
static_assert(kProducerRegs % 8 == 0 && kProducerRegs >= 24 && kProducerRegs <= 168,
              "FLASHMLA_PREFILL_PRODUCER_REGS: a multiple of 8 in [24, 168]");
static_assert(kConsumerRegs >= 168 && kConsumerRegs <= 256, "consumer registers out of setmaxnreg's range");

enum : int { kBarScale0 = 1, kBarScale1 = 2, kBarP0 = 3, kBarP1 = 4, kBarConsumers = 5 };
// Epilogue, when out's rows are 16-byte aligned (p.out_bulk_ok): O staged as bf16 rows in Q's
// buffer, each 1 KB row written with one bulk copy (H200: -4% time at d_qk 576 h_q 128,
// -7% at d_qk 512 h_q 128, -12% at d_qk 512 h_q 64, against every thread storing its 4-byte pairs,
// which is still the path for other layouts). Once its gathers are issued, the producer's first warp
// prefetches into L2 the Q rows and index row of CTA blockIdx.x + p.prefetch_ahead (the SM count:
// the CTA that starts about when this one ends; -0.5 to -1.5% at s_kv 8192, neutral at 65536).
constexpr int kStageRowBytes = 512 * 2 + 16;  // one output row + 16 B: conflict-free 4-byte stores
static_assert(64 * kStageRowBytes <= kSmemQ, "staged O fits in Q's buffer");
constexpr int kThreadsProd = 384;
// Epilogue with a TMA tensor store (p.out_tma, out's rows 16-byte aligned): each consumer warpgroup
// stages its 256 output columns as four 128B-swizzled 64 x 64 slabs in Q's buffer and one of its threads
// writes them with four 8 KB tensor stores, as soon as that warpgroup is done: warpgroup 1 (whose last
// P0 V0_R precedes warpgroup 0's last P1 V1_L on the tensor pipe) writes its half while warpgroup 0 still
// computes, and there is no CTA-wide barrier in the epilogue. The row sums and the true row max are
// exchanged in the last pair instead (sL, sMx; see "epilogue" below), and attn_sink is staged in shared
// memory with Q. 8 copies per CTA instead of 64 (one 64 KB copy instead of 64 x 1 KB rows saved ~850
// cycles per CTA).
enum : int { kBarEpi0 = 6 };  // + warpgroup: the warpgroup's slabs staged

// 4-byte cp.async (zero-fill when !valid).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 3D TMA tensor store from shared memory (bulk-group completion).
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// 16-byte cp.async with a 256-byte L2 prefetch hint (src-size 0 zero-fills, no read).
__device__ __forceinline__ void cp_async_16_l2pf(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// The P stores (warpgroup 0's P0, warpgroup 1's P1) address their slab from one per-thread offset,
// p_off = row * 128 + ((row & 7) << 4) + 4 * tq (row = the thread's first row r): the 4-byte pair of
// key 8 t + 2 tq of rows r and r + 8 is at sP + (p_off ^ (t << 4)) and 1024 bytes further (rows r and
// r + 8 share r & 7, so the swizzle is the same). That is slab_off(row, key >> 3) + (key & 7) * 2, but
// from slab_off the compiler, not knowing tq < 4, rebuilt all 16 addresses in every pair (~125 integer
// instructions per thread and warpgroup, in warpgroup 0 ahead of its P0 stores, in warpgroup 1 among
// P1's exps); this way it is 7 LOP3 per pair (x1.011 on the H200).
// exp_pack_store_p_xor: seesaw::exp_pack_store_p with that addressing.
__device__ __forceinline__ void exp_pack_store_p_xor(float (&s)[32], const float (&m)[2], float (&rs)[2],
                                                     uint32_t (&a)[4][4], uint8_t* sP, uint32_t p_off) {
  seesaw::exp_pack(s, m, rs, a);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    uint8_t* q = sP + (p_off ^ static_cast<uint32_t>(t << 4));
    *reinterpret_cast<uint32_t*>(q) = a[t >> 1][(t & 1) * 2 + 0];
    *reinterpret_cast<uint32_t*>(q + 1024) = a[t >> 1][(t & 1) * 2 + 1];
  }
}
template <int kD>
__global__ void __launch_bounds__(kThreadsProd, 1)
    sparse_attn_fwd_seesaw_kernel(const __grid_constant__ SparsePrefillKernelParams p) {
  constexpr int kSlabs = kD / 64;  // 9 or 8
  constexpr int kChunks = kD / 8;  // 72 or 64
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const auto [sQ_u, sK_u, sQ, sK, sRed] = seesaw::smem_tiles<kSmemQ, kSmemK>(smem_raw);
  float* sM0 = sRed;
  float* sS0 = sRed + 64;
  float* sM1 = sRed + 128;
  float* sS1 = sRed + 192;
  float* sL = sRed + 256;
  float* sMx = sRed + 384;
  float* sSink = sRed + 512;  // attn_sink of the tile's 64 heads (0 past h_q), when p.attn_sink
  uint8_t* sValid = reinterpret_cast<uint8_t*>(sRed + 9 * 64);  // [stage][64]
  uint8_t* sInval = sValid + 2 * kBlockN;  // [stage][producer warp]: 1 if any of its rows is invalid
  const uint32_t bar_u = sK_u + 2 * kSmemK + kSmemRed + kSmemValid;
  // barriers: bar_u + 8 * (2 * stage + part)
  auto bar = [&](int stage, int part) { return bar_u + 8u * static_cast<uint32_t>(2 * stage + part); };
  auto bar_free = [&](int stage, int part) { return bar_u + 8u * static_cast<uint32_t>(4 + 2 * stage + part); };

  const int ht = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.num_head_tiles));
  const int sq = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.num_head_tiles));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4, t_wg = tid % 128;
  const int gq = lane / 4, tq = lane % 4;

  int row_local[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) row_local[hh] = wq * 16 + gq + 8 * hh;
  // Byte offset of the thread's first P pair in a P slab (row_local[0] & 7 == gq; exp_pack_store_p_xor).
  const uint32_t p_off = static_cast<uint32_t>(row_local[0] * 128 + (gq << 4) + 4 * tq);

  const int lim = row_limit(p, sq);
  const int n_blk = (lim + kBlockN - 1) / kBlockN;
  const __nv_bfloat16* kvb = static_cast<const __nv_bfloat16*>(p.kv);

  // Producer mapping: 4 rows per thread, 8 threads per row; thread (w_rg = t / 8, w_c8 = t % 8)
  // copies rows w_rg + 16 i (i < 4), 16-byte chunk w_c8 of every 64-dim slab. Within a row the
  // swizzled chunk is (w_c8 ^ (row & 7)) and row & 7 = w_rg & 7 for all four rows, so every copy of
  // the thread lands at a compile-time offset from one per-thread base address.
  const int w_rg = t_wg >> 3, w_c8 = t_wg & 7;
  // One block's four rows for this thread: the token index of each slot, -1 for an invalid slot
  // (never read; zero-filled). Kept as 32-bit indices so the producer fits in few registers; each
  // copy_slabs turns a row into its source address with one wide multiply-add.
  struct Rows {
    int idx[4];
  };
  const __nv_bfloat16* const kv_c8 = kvb + w_c8 * 8;  // chunk w_c8 of slab 0 of token 0
  // Source of chunk w_c8 of slab 0 of a row's token (the tensor's base for an invalid slot).
  auto idx_src = [&](int idx) { return kv_c8 + (idx >= 0 ? static_cast<int64_t>(idx) * p.kv_stride_s : 0); };
  auto load_rows = [&](int blk, Rows& r) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = blk < n_blk ? fetch_index(p, sq, blk * kBlockN + w_rg + 16 * i, lim) : -1;
      r.idx[i] = idx >= 0 && idx < p.s_kv ? idx : -1;
    }
  };
  // Row i's slot is valid (its copies read the source; else they zero-fill).
  auto row_ok = [&](const Rows& r, int i) { return r.idx[i] >= 0; };
  auto row_src = [&](const Rows& r, int i) { return idx_src(r.idx[i]); };
  const uint32_t w_dst = sK_u + static_cast<uint32_t>(w_rg * 128 + ((w_c8 ^ (w_rg & 7)) << 4));
  // Slabs [kLo, kHi) of the four rows into stage kStage: one cp.async each, immediate offsets.
  auto copy_slabs = [&](auto stage_c, auto lo_c, auto hi_c, const Rows& r) {
    constexpr int kStage = decltype(stage_c)::value, kLo = decltype(lo_c)::value, kHi = decltype(hi_c)::value;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat16* src = row_src(r, i);
#pragma unroll
      for (int sl = kLo; sl < kHi; ++sl)
        if constexpr (!kDiagNoGather)
          cp_async_16_l2pf(w_dst + static_cast<uint32_t>(kStage * kSmemK + sl * kSlabBytes + i * 16 * 128),
                           src + sl * 64, row_ok(r, i));
    }
  };
  // Part kPart of stage kStage (slab sets in the file comment), then the two arrivals on its full
  // barrier; part A also publishes the slot-validity bytes of the stage.
  auto fill = [&](auto vec_c, auto stage_c, auto part_c, const Rows& r) {
    constexpr int kStage = decltype(stage_c)::value, kPart = decltype(part_c)::value;
    using I0 = std::integral_constant<int, 0>;
    using I4 = std::integral_constant<int, 4>;
    using I8 = std::integral_constant<int, 8>;
    if constexpr (decltype(vec_c)::value) {
      if constexpr (kPart == 0) {
        copy_slabs(stage_c, I0{}, I4{}, r);
        if constexpr (kStage == 1 && kSlabs > 8) copy_slabs(stage_c, I8{}, std::integral_constant<int, kSlabs>{}, r);
      } else if constexpr (kStage == 0) {
        copy_slabs(stage_c, I4{}, std::integral_constant<int, kSlabs>{}, r);
      } else {
        copy_slabs(stage_c, I4{}, I8{}, r);
      }
    } else {  // rows not 16-byte aligned: 2-byte loads and st.shared
      uint8_t* dsts = sK + kStage * kSmemK;
      constexpr int lo = kPart == 0 ? 0 : 32, hi = kPart == 0 ? 32 : (kStage == 0 ? kChunks : 64);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = w_rg + 16 * i;
        const __nv_bfloat16* src = row_src(r, i) - w_c8 * 8;
        const bool ok = row_ok(r, i);
#pragma unroll 1
        for (int c = lo + w_c8; c < hi; c += 8)
          *reinterpret_cast<uint4*>(dsts + slab_off(row, c)) = ok ? load8_u16(src + c * 8) : make_uint4(0, 0, 0, 0);
        if (kPart == 0 && kStage == 1)
#pragma unroll 1
          for (int c = 64 + w_c8; c < kChunks; c += 8)
            *reinterpret_cast<uint4*>(dsts + slab_off(row, c)) = ok ? load8_u16(src + c * 8) : make_uint4(0, 0, 0, 0);
      }
    }
    if (kPart == 0 && w_c8 == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sValid[kStage * kBlockN + w_rg + 16 * i] = row_ok(r, i) ? 1 : 0;
    }
    if (kPart == 0) {  // the whole producer warpgroup is here (fill calls are uniform)
      const bool inv = w_c8 == 0 && (r.idx[0] < 0 || r.idx[1] < 0 || r.idx[2] < 0 || r.idx[3] < 0);
      const bool any = __any_sync(0xffffffffu, inv);
      if (lane == 0) sInval[kStage * 4 + (t_wg >> 5)] = any ? 1 : 0;
    }
    mbar_arrive_cp_async(bar(kStage, kPart));
    mbar_arrive(bar(kStage, kPart));
  };

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) mbar_init(bar_u + 8 * i, 256);
#pragma unroll
    for (int i = 4; i < 8; ++i) mbar_init(bar_u + 8 * i, 128);
    mbar_init(bar_u + 8 * 8, 128);  // q_full: the producer's 128 cp.async arrivals
    fence_barrier_init();
  }
  __syncthreads();  // barriers initialised
  // Trace roles (tools/trace): 0 = warpgroup 0, 1 = warpgroup 1, 2 = producer, 3 = CTA.
  FLASHMLA_TRACE_DECL();
  FLASHMLA_TRACE_EVENT(3, 0, 1, tid == 0);
  if (wg == 2) {
    // ================= producer warpgroup: every gather
    setmaxnreg_dec<kProducerRegs>();
    // Every gather of the CTA, in the order the consumers free the stage parts (file comment);
    // instantiated once for 16-byte-aligned rows (cp.async) and once for the 2-byte path.
    auto produce = [&](auto vec_c) {
      using S0 = std::integral_constant<int, 0>;
      using S1 = std::integral_constant<int, 1>;
      Rows r0, r1;
      // Part part_c of stage stage_c is free again (the consumers' arrival of phase fph): gather rows r
      // into it. Trace: producer events ev (free) and ev + 1 (gathers issued) of pair j.
      auto refill = [&](auto stage_c, auto part_c, const Rows& r, uint32_t fph, int j, int ev) {
        mbar_wait(bar_free(stage_c, part_c), fph);
        FLASHMLA_TRACE_EVENT(2, j, ev, t_wg == 0);
        fill(vec_c, stage_c, part_c, r);
        FLASHMLA_TRACE_EVENT(2, j, ev + 1, t_wg == 0);
      };
      // Q first (16-byte-aligned rows; else the consumers copy it): rows w_rg + 16 i of the head tile
      // in the gathers' mapping, completing on q_full. Issued ahead of the first pair's gathers it is
      // in shared memory after ~1400 cycles instead of ~4500 when the consumers copied it alongside
      // them (H200: -1% d_qk 576 h_q 128 topk 2048, -4% d_qk 512 h_q 64 topk 512).
      if constexpr (!kDiagNoQ) {
        if (p.q_vec) {
          const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + static_cast<int64_t>(sq) * p.q_stride_s +
                                    w_c8 * 8;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int h = ht * 64 + w_rg + 16 * i;
            const bool ok = h < p.h_q;
            const __nv_bfloat16* src = ok ? qb + static_cast<int64_t>(h) * p.q_stride_h : qb;
#pragma unroll
            for (int sl = 0; sl < kSlabs; ++sl)
              cp_async_16_l2pf(w_dst - sK_u + sQ_u + static_cast<uint32_t>(sl * kSlabBytes + i * 16 * 128), src + sl * 64,
                               ok);
          }
          if (p.attn_sink != nullptr && t_wg < 64) {  // the epilogue's sinks, complete with Q (q_full)
            const int h = ht * 64 + t_wg;
            cp_async_4(static_cast<uint32_t>(__cvta_generic_to_shared(sSink + t_wg)),
                       h < p.h_q ? p.attn_sink + static_cast<int64_t>(h) * p.sink_stride : p.attn_sink, h < p.h_q);
          }
          mbar_arrive_cp_async(bar_u + 8 * 8);
        }
      }
      load_rows(0, r0);
      load_rows(1, r1);
      fill(vec_c, S0{}, S0{}, r0);
      fill(vec_c, S0{}, S1{}, r0);
      if (n_blk > 1) {
        fill(vec_c, S1{}, S0{}, r1);
        fill(vec_c, S1{}, S1{}, r1);
      }
      FLASHMLA_TRACE_EVENT(2, 0, 8, t_wg == 0);
#pragma unroll 1
      for (int j = 1; 2 * j < n_blk; ++j) {
        const uint32_t fph = static_cast<uint32_t>((j - 1) & 1);
        const bool has1 = 2 * j + 1 < n_blk;
        // (A prefetch.global.L2 of these rows here lost on the H200: 0.920 vs 0.946.)
        load_rows(2 * j, r0);
        load_rows(2 * j + 1, r1);
        FLASHMLA_TRACE_EVENT(2, j, 0, t_wg == 0);
        refill(S0{}, S0{}, r0, fph, j, 1);
        if (has1) refill(S1{}, S1{}, r1, fph, j, 3);
        refill(S0{}, S1{}, r0, fph, j, 5);
        if (has1) refill(S1{}, S0{}, r1, fph, j, 7);
      }
    };
    if (n_blk > 0) {
      if (p.kv_vec) produce(std::true_type{});
      else produce(std::false_type{});
    }
    if (t_wg < 32 && p.prefetch_ahead > 0 &&
        blockIdx.x + static_cast<unsigned>(p.prefetch_ahead) < gridDim.x) {
      // The CTA that starts about when this one ends: its Q rows (2 per lane) and index row.
      const unsigned b2 = blockIdx.x + static_cast<unsigned>(p.prefetch_ahead);
      const int ht2 = static_cast<int>(b2 % static_cast<unsigned>(p.num_head_tiles));
      const int sq2 = static_cast<int>(b2 / static_cast<unsigned>(p.num_head_tiles));
      if (p.q_vec) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int h = ht2 * 64 + 2 * t_wg + r;
          if (h < p.h_q)
            prefetch_l2_bulk(static_cast<const __nv_bfloat16*>(p.q) + static_cast<int64_t>(sq2) * p.q_stride_s +
                                 static_cast<int64_t>(h) * p.q_stride_h,
                             kD * 2);
        }
      }
      if (ht2 == 0 && p.idx_stride_k == 1) {
        // Every 128-byte line of the index row (64-bit arithmetic: topk is only bounded by int32).
        const uint64_t row0 = reinterpret_cast<uint64_t>(p.indices + static_cast<int64_t>(sq2) * p.idx_stride_s);
        const uint64_t row1 = row0 + 4ull * static_cast<uint64_t>(p.topk);
        for (uint64_t line = (row0 & ~127ull) + 128ull * static_cast<uint64_t>(t_wg); line < row1; line += 128ull * 32)
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(line));
      }
    }
    if (n_blk > 0) {
      asm volatile("cp.async.wait_all;\n" ::: "memory");
    }
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();
  const bool q_by_producer = p.q_vec != 0;  // the producer copies Q (q_full)
  if (n_blk > 0 && !kDiagNoQ && !q_by_producer) {
    const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + static_cast<int64_t>(sq) * p.q_stride_s;
    for (int id = tid; id < 64 * kChunks; id += kThreads) {
      const int r = id / kChunks, c = id % kChunks;
      const int h = ht * 64 + r;
      const bool valid = h < p.h_q;
      const __nv_bfloat16* src = valid ? qb + static_cast<int64_t>(h) * p.q_stride_h + c * 8
                                       : static_cast<const __nv_bfloat16*>(p.q);
      *reinterpret_cast<uint4*>(sQ + slab_off(r, c)) = valid ? load8_u16(src) : make_uint4(0, 0, 0, 0);
    }
    if (p.attn_sink != nullptr && tid < 64) {  // published by the barrier below
      const int h = ht * 64 + tid;
      sSink[tid] = h < p.h_q ? p.attn_sink[static_cast<int64_t>(h) * p.sink_stride] : 0.f;
    }
  }
  if (n_blk > 0 && q_by_producer && !kDiagNoQ) {
    mbar_wait(bar_u + 8 * 8, 0);
    gmma::fence_proxy_async();
  } else if (n_blk > 0) {  // Q stored by the consumers (st.shared above)
    gmma::fence_proxy_async();
    named_barrier_sync(kBarConsumers, kThreads);  // Q in shared memory, visible to wgmma
  }
  FLASHMLA_TRACE_EVENT(3, 0, 2, tid == 0);

  float o[128];
#pragma unroll
  for (int j = 0; j < 128; ++j) o[j] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float m_true[2] = {-INFINITY, -INFINITY};  // true row max over this warpgroup's blocks (max_logits)
  float l_run[2] = {0.f, 0.f};
  const uint64_t dq = gmma::make_desc_sw128(sQ_u, 16, 1024);
  float s[32];
  // Warpgroup 0's S0 over stage 0 (block 2j when waited with parity j & 1): part A, part B.
  auto s0_part_a = [&](uint32_t parity) {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    gmma::reg_fence(s);
    mbar_wait(bar(0, 0), parity);
    gmma::fence_proxy_async();
    gmma::fence();
    if constexpr (!kDiagNoMma) s_chain<0, 4>(s, dq, gmma::make_desc_sw128(sK_u, 16, 1024));
    gmma::commit();
  };
  auto s0_part_b = [&](uint32_t parity) {
    mbar_wait(bar(0, 1), parity);
    gmma::fence_proxy_async();
    gmma::fence();
    if constexpr (!kDiagNoMma) s_chain<4, kSlabs>(s, dq, gmma::make_desc_sw128(sK_u, 16, 1024));
    gmma::commit();
  };
  if (wg == 0 && n_blk > 0) {  // the first pair's S0; later ones are issued one pair ahead
    s0_part_a(0);
    s0_part_b(0);
    gmma::wait<0>();
    gmma::reg_fence(s);
  }

  for (int j = 0; 2 * j < n_blk; ++j) {
    const bool has1 = 2 * j + 1 < n_blk, nxt0 = 2 * j + 2 < n_blk, nxt1 = 2 * j + 3 < n_blk;
    const uint32_t ph = static_cast<uint32_t>(j & 1);
    if (wg == 0) {
      // ---------------- warpgroup 0: block 2j (stage 0), O[:, 0:256]
      FLASHMLA_TRACE_EVENT(0, j, 0, t_wg == 0);  // S0 of block 2j is complete here

      float mx[2] = {-INFINITY, -INFINITY};
      if (*reinterpret_cast<const uint32_t*>(sInval) == 0) scale_rowmax(s, p.scale_log2, mx);
      else mask_rowmax(s, sValid, p.scale_log2, tq, mx);
      float m0u[2], sc0[2];
      first_block_row_max(sM0, sS0, row_local, tq, mx, m_run, m0u, sc0,
                          [&](int hh) { m_true[hh] = fmaxf(m_true[hh], mx[hh]); });
      // Ahead of P0's exps in the PTX (ptxas hoists their MUFU.EX2 above it). Keeping them behind it by
      // rereading m0 from sM0 measured x0.998; arriving only after P0 V0_L lost too.
      bar_arrive(kBarScale0, kThreads);
      FLASHMLA_TRACE_EVENT(0, j, 4, t_wg == 0);

      float rs[2] = {0.f, 0.f};
      uint32_t a[4][4];
      seesaw::exp_pack(s, m0u, rs, a);  // P0 (the P0 V0_L A operand)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) l_run[hh] = l_run[hh] * sc0[hh] + rs[hh];
      scale_o(o, sc0);
      gmma::reg_fence(o);
      gmma::fence();
      if constexpr (!kDiagNoMma) {
        pv_rs_chain(o, a, gmma::make_desc_sw128(sK_u, kSlabBytes, 1024));
      }
      gmma::commit();

      // P0 * scale1 -> slab 8 of stage 0, addressed from p_off (exp_pack_store_p_xor). Slab 8 of stage 0
      // is free once S0 is complete: warpgroup 1's P0 V0_R of the previous pair finished before it
      // released stage 0 part B, which S0 waited for.
      uint8_t* sP0 = sK + 8 * kSlabBytes;
      auto store_p0 = [&](float f0, float f1) {
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          uint8_t* q0 = sP0 + (p_off ^ static_cast<uint32_t>(t << 4));
          uint8_t* q1 = q0 + 1024;
          *reinterpret_cast<uint32_t*>(q0) = HalfTraits<__nv_bfloat16>::pack(s[4 * t + 0] * f0, s[4 * t + 1] * f0);
          *reinterpret_cast<uint32_t*>(q1) = HalfTraits<__nv_bfloat16>::pack(s[4 * t + 2] * f1, s[4 * t + 3] * f1);
        }
      };
      // P0 as it is, stored right after issuing P0 V0_L while warpgroup 0 waits for scale1, and rewritten
      // as P0 * scale1 after the Scale1 barrier only when some row's scale1 is not exactly 1 (with lazy
      // rescaling nearly every pair has all ones once the max has settled): the 32 FMUL + 16 F2FP + 16 STS
      // stay out of the stretch between the Scale1 barrier and the P0 arrival that warpgroup 1's P0 V0_R
      // waits for. Bit-identical (s * 1.f == s). From the fp32 s, not the packed fragments a[][]: they
      // are the A operand of P0 V0_L, in flight here, and reading them before its wait is undefined in
      // PTX. With slab_off addresses the compiler rebuilt them behind the barrier (75 -> 160
      // instructions there): p_off is what makes the early store pay.
      store_p0(1.f, 1.f);

      named_barrier_sync(kBarScale1, kThreads);
      FLASHMLA_TRACE_EVENT(0, j, 5, t_wg == 0);
      float sc1[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        sc1[hh] = sS1[row_local[hh]];
        m_run[hh] = sM1[row_local[hh]];
      }
      // Rewritten only when some row's scale1 is not 1 (the running max moved).
      if (!__all_sync(0xffffffffu, sc1[0] == 1.f && sc1[1] == 1.f)) store_p0(sc1[0], sc1[1]);
      gmma::fence_proxy_async();
      if (!nxt0) {  // the CTA's last pair: this warpgroup's row sums before scale1, and its true row max
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float l0 = l_run[hh];
          l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
          l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
          if (tq == 0) {
            sL[row_local[hh]] = l0;
            sMx[row_local[hh]] = m_true[hh];
          }
        }
      }
      bar_arrive(kBarP0, kThreads);

      gmma::wait<0>();
      gmma::reg_fence(o);
      FLASHMLA_TRACE_EVENT(0, j, 6, t_wg == 0);
      if (nxt0) {  // stage 0 slabs 0-3 are free: gather part A of block 2j+2
        mbar_arrive(bar_free(0, 0));
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) l_run[hh] *= sc1[hh];
      scale_o(o, sc1);
      named_barrier_sync(kBarP1, kThreads);
      FLASHMLA_TRACE_EVENT(0, j, 7, t_wg == 0);
      if (has1) {
        mbar_wait(bar(1, 0), ph);  // completed (WG1 waited for it); orders the cp.async writes
        gmma::fence_proxy_async();
        gmma::reg_fence(o);
        gmma::fence();
        if constexpr (!kDiagNoMma) {
          pv_ss_chain(o, gmma::make_desc_sw128(sK_u + kSmemK + 8 * kSlabBytes, 16, 1024),
                      gmma::make_desc_sw128(sK_u + kSmemK, kSlabBytes, 1024));
        }
        gmma::commit();
        if (nxt0) {  // the next pair's S0 behind P1 V1_L (P0's registers s are dead)
          s0_part_a(ph ^ 1u);
          gmma::wait<1>();  // P1 V1_L done
          gmma::reg_fence(o);
          FLASHMLA_TRACE_EVENT(0, j, 8, t_wg == 0);
          if (nxt1) mbar_arrive(bar_free(1, 0));  // stage 1 slabs 0-3 and 8: part A of block 2j+3
          s0_part_b(ph ^ 1u);
          gmma::wait<0>();
          gmma::reg_fence(s);
        } else {  // the CTA's last pair (no block 2j+3 either)
          gmma::wait<0>();
          gmma::reg_fence(o);
          FLASHMLA_TRACE_EVENT(0, j, 8, t_wg == 0);
        }
      }
    } else {
      // ---------------- warpgroup 1: block 2j+1 (stage 1), O[:, 256:512]
      FLASHMLA_TRACE_EVENT(1, j, 0, t_wg == 0);
      float mx[2] = {-INFINITY, -INFINITY};
      if (has1) {
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
        gmma::reg_fence(s);
        const uint64_t db = gmma::make_desc_sw128(sK_u + kSmemK, 16, 1024);
        // Part B (slabs 4-7, freed by this warpgroup's own P1 V1_R) first, then part A (slabs 0-3
        // and 8, freed last, by warpgroup 0's P1 V1_L): the chain starts at slab 4.
        mbar_wait(bar(1, 1), ph);
        FLASHMLA_TRACE_EVENT(1, j, 1, t_wg == 0);
        gmma::fence_proxy_async();
        gmma::fence();
        if constexpr (!kDiagNoMma) s_chain<4, 8, 4>(s, dq, db);
        mbar_wait(bar(1, 0), ph);
        FLASHMLA_TRACE_EVENT(1, j, 2, t_wg == 0);
        gmma::fence_proxy_async();
        gmma::fence();
        if constexpr (!kDiagNoMma) {
          s_chain<0, 4, 4>(s, dq, db);
          if constexpr (kSlabs > 8) s_chain<8, kSlabs, 4>(s, dq, db);
        }
        gmma::commit();
        gmma::wait<0>();
        gmma::reg_fence(s);
        FLASHMLA_TRACE_EVENT(1, j, 3, t_wg == 0);
        if (*reinterpret_cast<const uint32_t*>(sInval + 4) == 0) scale_rowmax(s, p.scale_log2, mx);
        else mask_rowmax(s, sValid + kBlockN, p.scale_log2, tq, mx);
      }
      named_barrier_sync(kBarScale0, kThreads);
      FLASHMLA_TRACE_EVENT(1, j, 4, t_wg == 0);
      float m1u[2], c[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) m_true[hh] = fmaxf(m_true[hh], mx[hh]);
      second_block_row_max(sM0, sS0, sM1, sS1, row_local, tq, mx, m_run, m1u, c);
      bar_arrive(kBarScale1, kThreads);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) l_run[hh] *= c[hh];
      scale_o(o, c);
      uint32_t a[4][4];
      if (has1) {
        float rs[2] = {0.f, 0.f};
        uint8_t* sP1 = sK + kSmemK + 8 * kSlabBytes;
        exp_pack_store_p_xor(s, m1u, rs, a, sP1, p_off);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] += rs[hh];
        // Fenced before P1 V1_R is issued. Issuing first and fencing after it, as dense decode does,
        // measured x0.998 here (H200, 17 cases; docs/sparse-prefill.md).
        gmma::fence_proxy_async();
      }
      FLASHMLA_TRACE_EVENT(1, j, 5, t_wg == 0);
      if (has1) {
        gmma::reg_fence(o);
        gmma::fence();
        if constexpr (!kDiagNoMma) {
          pv_rs_chain(o, a, gmma::make_desc_sw128(sK_u + kSmemK + 4 * kSlabBytes, kSlabBytes, 1024));
        }
        gmma::commit();
      }
      named_barrier_sync(kBarP0, kThreads);
      FLASHMLA_TRACE_EVENT(1, j, 6, t_wg == 0);
      mbar_wait(bar(0, 1), ph);  // completed (WG0 waited for it); orders the cp.async writes
      gmma::fence_proxy_async();
      gmma::fence();
      if constexpr (!kDiagNoMma) {
        pv_ss_chain(o, gmma::make_desc_sw128(sK_u + 8 * kSlabBytes, 16, 1024),
                    gmma::make_desc_sw128(sK_u + 4 * kSlabBytes, kSlabBytes, 1024));
      }
      gmma::commit();
      if (!nxt0) {  // the CTA's last pair: this warpgroup's final row sums (read by warpgroup 0 after P1)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float l1 = l_run[hh];
          l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
          l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
          if (tq == 0) sL[64 + row_local[hh]] = l1;
        }
      }
      // P1 (stored and fenced above) is announced only now, so warpgroup 0's P1 V1_L (and its next
      // S0 behind it) enter the tensor pipe after P0 V0_R, which frees stage 0 part B first.
      bar_arrive(kBarP1, kThreads);
      if (nxt1) {
        gmma::wait<1>();  // P1 V1_R done: stage 1 slabs 4-7 are free
        FLASHMLA_TRACE_EVENT(1, j, 7, t_wg == 0);
        mbar_arrive(bar_free(1, 1));
      }
      gmma::wait<0>();
      gmma::reg_fence(o);
      FLASHMLA_TRACE_EVENT(1, j, 8, t_wg == 0);
      if (nxt0) {  // stage 0 slabs 4-8 are free
        mbar_arrive(bar_free(0, 1));
      }
    }
  }

  FLASHMLA_TRACE_EVENT(3, 0, 3, tid == 0);
  // ---- epilogue, per warpgroup (no CTA-wide barrier). Row sums from the last pair's exchange:
  // L = A0 * scale1 + L1 with A0 = warpgroup 0's quad-summed l before its last scale1 (sL[row], written
  // before its P0 arrival), scale1 = sS1[row] (warpgroup 1's, before its Scale1 arrival) and L1 =
  // warpgroup 1's final quad-summed l (sL[64 + row], before its P1 arrival). Both warpgroups compute
  // the same expression from the same shared values, so both halves of a row see the same L. Warpgroup
  // 0 passed the P1 barrier after all three writes; warpgroup 1 passed the P0 barrier after warpgroup
  // 0's writes and its own sS1 write, and reads its own L1 (written by the quad's lane 0) after a
  // __syncwarp. max_logits and lse are written by warpgroup 1 (true max = its m_true and warpgroup 0's,
  // sMx[row]). m_run is the same final running max in both warpgroups (warpgroup 0 read sM1).
  float L[2] = {0.f, 0.f};
  if (n_blk > 0) {
    __syncwarp();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      L[hh] = __fmaf_rn(sL[row_local[hh]], sS1[row_local[hh]], sL[64 + row_local[hh]]);
      if (wg == 1) m_true[hh] = fmaxf(m_true[hh], sMx[row_local[hh]]);
    }
  }

  float inv[2], lse2[2];
  bool empty[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int h = min(ht * 64 + row_local[hh], p.h_q - 1);  // rows past h_q: computed, never stored
    empty[hh] = row_sum_empty(L[hh]);  // no valid slot (n_blk > 0 here: Q's wait / barrier published sSink)
    lse2[hh] = empty[hh] ? INFINITY : log2f(L[hh]) + m_run[hh];
    float f = 1.f;
    if (!empty[hh] && p.attn_sink != nullptr) {
      const float sk = kDiagNoQ ? p.attn_sink[static_cast<int64_t>(h) * p.sink_stride] : sSink[row_local[hh]];
      f = 1.f / (1.f + exp2f(sk * kLog2e - lse2[hh]));
    }
    inv[hh] = empty[hh] ? 0.f : f / L[hh];
  }
  if (wg == 1 && tq == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = ht * 64 + row_local[hh];
      if (h >= p.h_q) continue;
      p.lse[static_cast<int64_t>(sq) * p.lse_stride_s + static_cast<int64_t>(h) * p.lse_stride_h] =
          empty[hh] ? INFINITY : lse2[hh] * kLn2;
      p.max_logits[static_cast<int64_t>(sq) * p.ml_stride_s + static_cast<int64_t>(h) * p.ml_stride_h] =
          empty[hh] ? -INFINITY : row_max_or_nan(m_true[hh], L[hh]) * kLn2;
    }
  }
  if (p.out_tma && n_blk > 0) {
    // Q's buffer is free for this warpgroup's slabs wg*4 .. wg*4+3: warpgroup 0's last S0 completed
    // before its last Scale0 arrival (warpgroup 1 synced), warpgroup 1's last S1 before its last Scale1
    // arrival (warpgroup 0 synced). Column col -> slab col / 64, 16-byte chunk (col / 8) % 8 (swizzled):
    // the same conflict-free pattern as the P stores.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<uint32_t*>(sQ + slab_off(row_local[hh], wg * 32 + j) + 4 * tq) =
            HalfTraits<__nv_bfloat16>::pack(o[4 * j + 2 * hh] * inv[hh], o[4 * j + 2 * hh + 1] * inv[hh]);
    }
    gmma::fence_proxy_async();  // generic-proxy stores -> the tensor stores' reads
    named_barrier_sync(kBarEpi0 + wg, 128);
    if (t_wg == 0) {
      if constexpr (!kDiagNoStore) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          tma_store_3d(&p.out_map, sQ_u + static_cast<uint32_t>((wg * 4 + k) * kSlabBytes), wg * 256 + 64 * k, ht * 64,
                       sq);
      }
      bulk_commit();
      bulk_wait_read();  // shared memory stays valid until the stores have read it
    }
  } else if (p.out_bulk_ok && n_blk > 0) {
    // Q's buffer is free for each warpgroup's half of the rows (as for the tensor stores above). Each
    // thread writes its two rows' bf16 pairs; then, after both halves, one thread per row copies the
    // 1 KB row to out.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      uint8_t* row = sQ + row_local[hh] * kStageRowBytes + wg * 512 + 4 * tq;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<uint32_t*>(row + 16 * j) =
            HalfTraits<__nv_bfloat16>::pack(o[4 * j + 2 * hh] * inv[hh], o[4 * j + 2 * hh + 1] * inv[hh]);
    }
    gmma::fence_proxy_async();  // generic-proxy stores -> the bulk copies' reads
    named_barrier_sync(kBarConsumers, kThreads);
    if (tid < 64) {  // one 1 KB row each: out is bf16 with d_v 512 (validate.cpp enforces both)
      const int h = ht * 64 + tid;
      if (h < p.h_q && !kDiagNoStore)
        bulk_store(static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(sq) * p.o_stride_s +
                       static_cast<int64_t>(h) * p.o_stride_h,
                   sQ_u + static_cast<uint32_t>(tid * kStageRowBytes), 1024);
      bulk_commit();
      bulk_wait_read();  // shared memory stays valid until the copies have read it
    }
  } else {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = ht * 64 + row_local[hh];
      if (h >= p.h_q) continue;
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(sq) * p.o_stride_s +
                           static_cast<int64_t>(h) * p.o_stride_h;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = wg * 256 + j * 8 + 2 * tq;
        const float v0 = o[4 * j + 2 * hh] * inv[hh], v1 = o[4 * j + 2 * hh + 1] * inv[hh];
        if (p.out_vec_ok) {
          *reinterpret_cast<uint32_t*>(out + col) = HalfTraits<__nv_bfloat16>::pack(v0, v1);
        } else {
          out[col * p.o_stride_d] = __float2bfloat16_rn(v0);
          out[(col + 1) * p.o_stride_d] = __float2bfloat16_rn(v1);
        }
      }
    }
  }
  FLASHMLA_TRACE_EVENT(3, 0, 4, tid == 0);
}

// Tensor map of out (s_q, h_q, 512) bf16 for the epilogue's tensor stores: dims (512, h_q, s_q), box
// 64 x 64 x 1, 128-byte swizzle (the slab layout). Heads past h_q in the last head tile are clipped by
// the TMA unit (never written). Only with p.out_bulk_ok (last dim contiguous, base and row strides
// 16-byte aligned); false when the encoder refuses (the kernel then copies 1 KB rows).
inline bool make_out_tensor_map(const SparsePrefillKernelParams& p, CUtensorMap* map) {
  if (!p.out_bulk_ok || p.o_stride_d != 1 || reinterpret_cast<uintptr_t>(p.out) % 16 != 0) return false;
  for (int64_t st : {p.o_stride_h, p.o_stride_s})
    if (st <= 0 || (st * 2) % 16 != 0 || st * 2 >= (int64_t{1} << 40)) return false;
  if (p.h_q <= 0 || p.s_q <= 0) return false;
  EncodeTiledFn fn = encode_tiled_fn();
  if (fn == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kDimV), static_cast<cuuint64_t>(p.h_q),
                              static_cast<cuuint64_t>(p.s_q)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.o_stride_h * 2), static_cast<cuuint64_t>(p.o_stride_s * 2)};
  const cuuint32_t box[3] = {64, 64, 1};
  const cuuint32_t estr[3] = {1, 1, 1};
  std::memset(map, 0, sizeof(*map));
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(p.out), dims, strides, box, estr,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

template <int kD>
cudaError_t launch(const SparsePrefillKernelParams& kp_in, cudaStream_t stream) {
  auto kernel = sparse_attn_fwd_seesaw_kernel<kD>;
  cudaError_t e = set_max_dynamic_smem(kernel, kSmemBytes);
  if (e != cudaSuccess) return e;
  SparsePrefillKernelParams kp = kp_in;
  // O by TMA tensor stores when out's layout allows a tensor map, else by 1 KB row copies.
  kp.out_tma = make_out_tensor_map(kp, &kp.out_map) ? 1 : 0;
  const dim3 grid(static_cast<unsigned>(kp.s_q) * static_cast<unsigned>(kp.num_head_tiles), 1, 1);
  kernel<<<grid, kThreadsProd, kSmemBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace flashmla::sm90::sparse_prefill::wgmma_seesaw
