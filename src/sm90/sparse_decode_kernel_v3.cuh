// src/sm90/sparse_decode_kernel_v3.cuh — sparse FP8 MLA decode v3 for 64-row head tiles:
// the seesaw wgmma schedule of the sparse prefill kernel (seesaw.cuh, spec §7.1 / §7.3) fed by
// a producer warpgroup that gathers the FP8 records and dequantizes them (spec §2.7).
//
// CTA = (query token sq, head tile of 64 heads, scheduler partition), grid (s_q * head_tiles,
// num_sm_parts) as v1; it walks the (request, 64-slot block) range of its partition, a
// request's blocks being its main top-k blocks then its extra-cache blocks (one joint softmax,
// block counts as the scheduler's spec §4.2 work). 384 threads:
//   * warpgroups 0 and 1 (consumers, setmaxnreg kConsRegs): per request, load Q (64 x d_qk)
//     into shared memory, then two 64-slot blocks per step exactly as the prefill seesaw:
//       WG0: S0 = Q K0^T; m0, scale0, P0 (registers); O_L = O_L*scale0 + P0 V0_L
//       WG1: S1 = Q K1^T; m1 = max(m0, .), scale1; O_R = O_R*scale0*scale1 + P1 V1_R; P1 -> smem
//       WG0: P0*scale1 -> smem; O_L = O_L*scale1 + P1 V1_L;  WG1: O_R += P0 V0_R
//     then the request's epilogue (out + lse with the sink factor, or fp32 partials for the combine).
//   * warpgroup 2 (producer, setmaxnreg kProdRegs): walks the same (request, block) sequence; per
//     block it reads the 64 slot indices (8 threads per slot row, 4 rows per thread), and per
//     stage part (stage 0: A = slabs 0-3, B = slabs 4-8; stage 1: A = slabs 0-3 + 8, B = 4-7, the
//     same parts and release points as the prefill kernel) it
//       1. loads the part's FP8 bytes and scales into registers (ld.global.nc, 16 B per thread and
//          row: a warp instruction reads 4 whole 128-byte lines) and prefetches the part's RoPE
//          bytes to L2 — all before waiting for the part to be free, so the loads fly during the wait;
//       2. waits until the consumers have released the part (its previous use), copies the RoPE
//          bf16 bytes with cp.async, dequantizes the FP8 bytes exactly as v1 (fp8 -> f16 -> f32 ->
//          bf16, times the tile scale in bf16) into the 128B-swizzled slabs, writes the slot
//          validity bytes (part A);
//       3. arrives on the part's full barrier (128 plain arrivals after a proxy fence + 128
//          cp.async noinc arrivals for the RoPE copies).
// Invalid slots (past min(topk, topk_length), negative or >= num_blocks * page_block_size) are
// zero-filled without a read and masked to -inf. Stage uses are counted per stage across
// requests (a pair without a second block leaves stage 1 unused), both roles derive the same
// counts; consumers release every use, the producer waits for the release of use n - 1 before
// fill n.
// Only for 16-byte aligned caches (v1 keeps the byte-copy path); q rows may be unaligned.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "sm90/host_utils.h"
#include "sm90/seesaw.cuh"
#include "sm90/sparse_decode_kernel.cuh"
#include "sm90/wgmma.cuh"

namespace flashmla::sm90::sparse::v3 {

using namespace seesaw;

constexpr int kThreads = 384;
constexpr int kConsumers = 256;
// setmaxnreg moves registers inside the CTA's pool: 384 threads x 168 = 64512 (see v2).
constexpr int kLaunchRegs = 168;
constexpr int kProdRegs = 40;
constexpr int kConsRegs = 232;
static_assert(128 * kProdRegs + kConsumers * kConsRegs <= kThreads * kLaunchRegs, "register pool of the CTA");

constexpr int kTileBytes = 9 * kSlabBytes;  // 64 rows x 576 dims (slab 8 also holds P for d_qk 512)
constexpr int kSmemQ = kTileBytes;
constexpr int kSmemK = kTileBytes;
constexpr int kSmemRed = 6 * 64 * 4;  // sM0, sS0, sM1, sS1, sL[2][64]
constexpr int kSmemValid = 2 * kBlockN;
constexpr int kSmemBar = 8 * 8;  // full[stage][part], free[stage][part]
// Producer's per-pair table of record / scale addresses: [pair parity][block of the pair][row], 0 = invalid.
constexpr int kSmemAddr = 2 * 2 * 2 * 64 * 8;
// Scales of each stage part's rows as copied from the cache: [stage][part][row] x 8 bytes.
constexpr int kSmemScale = 2 * 2 * 64 * 8;
constexpr int kSmemBytes =
    1024 /*alignment slack*/ + kSmemQ + 2 * kSmemK + kSmemRed + kSmemValid + kSmemBar + kSmemAddr + kSmemScale;
static_assert(kSmemBytes <= 232448, "shared memory");

enum : int { kBarScale0 = 1, kBarScale1 = 2, kBarP0 = 3, kBarP1 = 4, kBarConsumers = 5, kBarProducer = 6 };

__device__ __forceinline__ uint4 ldg16(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg8(const uint8_t* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/// Where stage part (S, PT) gets its data, per format. FP8 16-byte units u (16 dims, bf16 chunks
/// 2u and 2u + 1): part A units 0-15, part B units 16..kNope/16 - 1. Each thread of a row (c8 =
/// 0..7) takes units lo + c8 and lo + 8 + c8 (the second only below kNope/16). RoPE (bf16, 8
/// chunks, one per thread) sits in slab 8 (V32: stage 0 part B, stage 1 part A) or in slab 7
/// (MODEL1: chunks 56-63, part B of both stages).
template <Fmt F, int S, int PT>
struct PartMap {
  using FC = FmtCfg<F>;
  static constexpr int kLo = PT == 0 ? 0 : 16;
  static constexpr int kNopeUnits = FC::kNope / 16;  // 32 (V32) or 28 (MODEL1)
  static constexpr bool kRope = F == Fmt::kV32 ? ((S == 0) == (PT == 1)) : (PT == 1);
  static constexpr int kRopeChunk0 = FC::kNope / 8;  // 64 or 56
  static constexpr int kRecBytes = F == Fmt::kV32 ? 656 : 576;
  // FP8 16-byte units of the part (16 or 12) and how they are dequantized: the raw bytes land
  // (cp.async, row pitch 256 B) in slabs kStage .. kStage + 1 of the part's own region; units
  // [0, kN1) are converted first into slabs that do not overlap that staging area, units
  // [kN1, kUnits) are read into registers, then (after a producer barrier) written over it.
  static constexpr int kUnits = (PT == 0 ? 16 : kNopeUnits - 16);
  static constexpr int kN1 = (F == Fmt::kModel1 && PT == 1) ? 4 : 8;
  static constexpr int kStage = PT == 0 ? 2 : (F == Fmt::kV32 ? 6 : 5);
  static_assert(kUnits - kN1 == 8, "phase 2: one unit per thread and row");
  static_assert(2 * (16 * (PT == 0 ? 0 : 1) + kN1) <= 8 * kStage, "phase 1 targets below the staging area");
};

/// Byte address of the record (and, MODEL1, of the 8-byte scale record) of cache token `idx`
/// (valid: 0 <= idx < num_tokens).
template <Fmt F>
__device__ __forceinline__ void row_addr(const SparseScope& sc, int idx, uint64_t& rec, uint64_t& scale) {
  const uint32_t u = static_cast<uint32_t>(idx);
  const uint32_t pbs = static_cast<uint32_t>(sc.page_block_size);
  const uint32_t blk = u / pbs, row = u - blk * pbs;
  const uint8_t* base = sc.cache + static_cast<int64_t>(blk) * sc.block_stride;
  if constexpr (F == Fmt::kV32) {
    rec = reinterpret_cast<uint64_t>(base + static_cast<int64_t>(row) * 656);
    scale = rec + FmtCfg<F>::kScaleRaw;
  } else {
    rec = reinterpret_cast<uint64_t>(base + static_cast<int64_t>(row) * 576);
    scale = reinterpret_cast<uint64_t>(base + static_cast<int64_t>(pbs) * 576 + static_cast<int64_t>(row) * 8);
  }
}

template <Fmt F>
__device__ __forceinline__ __nv_bfloat162 unit_scale(uint2 sc, int tile_v32_k, int unit) {
  if constexpr (F == Fmt::kV32) {
    return __float2bfloat162_rn(__uint_as_float(tile_v32_k == 0 ? sc.x : sc.y));
  } else {
    const int tile = unit / 4;  // 64-dim tiles
    const uint32_t word = tile < 4 ? sc.x : sc.y;
    __nv_bfloat16_raw br;
    br.x = e8m0_to_bf16_bits((word >> (8 * (tile & 3))) & 0xFFu);
    const __nv_bfloat16 b1(br);
    return __nv_bfloat162(b1, b1);
  }
}

/// Copy one stage part (its previous use released): the FP8 bytes of the part's units into the
/// staging slabs, the row's scales into the part's scale slot, the RoPE bf16 bytes (if the part
/// holds them) straight to their slab; invalid slots zero-filled without a read. One commit group.
template <Fmt F, int S, int PT>
__device__ __forceinline__ void part_issue(const uint64_t* rec, const uint64_t* scl, int rg, int c8,
                                           uint32_t sK_stage_u, uint32_t sScale_u, const uint8_t* dummy) {
  using M = PartMap<F, S, PT>;
  const uint32_t stg = sK_stage_u + M::kStage * kSlabBytes;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = rg + 16 * i;
    const uint8_t* a = reinterpret_cast<const uint8_t*>(rec[row]);
    const bool valid = a != nullptr;
    const uint8_t* src = valid ? a : dummy;
    cp_async_16(stg + row * 256 + 16 * c8, src + 16 * (M::kLo + c8), valid);
    if (8 + c8 < M::kUnits) cp_async_16(stg + row * 256 + 16 * (8 + c8), src + 16 * (M::kLo + 8 + c8), valid);
    if (c8 == 0) {
      const uint8_t* ss = valid ? reinterpret_cast<const uint8_t*>(scl[row]) : dummy;
      if constexpr (F == Fmt::kV32) cp_async_8(sScale_u + row * 8, ss + 4 * (M::kLo / 8), valid);
      else cp_async_8(sScale_u + row * 8, ss, valid);
    }
    if constexpr (M::kRope)
      cp_async_16(sK_stage_u + slab_off(row, M::kRopeChunk0 + c8), src + FmtCfg<F>::kRopeRaw + 16 * c8, valid);
  }
  cp_async_commit();
}

template <Fmt F, int S, int PT>
__device__ __forceinline__ void unit_store(uint8_t* sK_stage, int row, int u, uint4 raw, uint2 sc) {
  using M = PartMap<F, S, PT>;
  const int U = M::kLo + u;  // unit within the row
  const __nv_bfloat162 s2 = unit_scale<F>(sc, u / 8, U);
  *reinterpret_cast<uint4*>(sK_stage + slab_off(row, 2 * U)) = dequant8(make_uint2(raw.x, raw.y), s2);
  *reinterpret_cast<uint4*>(sK_stage + slab_off(row, 2 * U + 1)) = dequant8(make_uint2(raw.z, raw.w), s2);
}

/// Finish a part whose copies were issued: wait for them (cp.async groups: kPending of this
/// thread's later groups may stay in flight), dequantize (spec §2.7, v1's dequant8) in two phases
/// around the staging area, write the validity bytes (part A), fence, arrive (128 producers).
template <Fmt F, int S, int PT, int kPending>
__device__ __forceinline__ void part_finish(const uint64_t* rec, int rg, int c8, uint8_t* sK_stage,
                                            const uint8_t* sScale, uint8_t* sValid_stage, uint32_t bar_full) {
  using M = PartMap<F, S, PT>;
  const uint8_t* stg = sK_stage + M::kStage * kSlabBytes;
  cp_async_wait<kPending>();
  named_barrier_sync(kBarProducer, 128);  // every producer thread's copies of the part have landed
  uint4 raw2[4];
  uint2 sc[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = rg + 16 * i;
    sc[i] = *reinterpret_cast<const uint2*>(sScale + row * 8);
    if (c8 < M::kN1) unit_store<F, S, PT>(sK_stage, row, c8, *reinterpret_cast<const uint4*>(stg + row * 256 + 16 * c8), sc[i]);
    raw2[i] = *reinterpret_cast<const uint4*>(stg + row * 256 + 16 * (M::kN1 + c8));
  }
  named_barrier_sync(kBarProducer, 128);  // nobody reads the staging area any more
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = rg + 16 * i;
    unit_store<F, S, PT>(sK_stage, row, M::kN1 + c8, raw2[i], sc[i]);
    if (PT == 0 && c8 == 0) sValid_stage[row] = rec[row] != 0 ? 1 : 0;
  }
  fence_proxy_async_shared();  // generic-proxy writes -> visible to the consumers' wgmma (async proxy)
  mbar_arrive(bar_full);
}

template <Fmt F>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_splitkv_mla_fp8_sparse_kernel_v3(const SparseDecodeKernelParams p) {
  constexpr int kD = FmtCfg<F>::kDQK;
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
  uint64_t* sAddr = reinterpret_cast<uint64_t*>(base + kSmemQ + 2 * kSmemK + kSmemRed + kSmemValid + kSmemBar);
  uint8_t* sScale = reinterpret_cast<uint8_t*>(sAddr) + kSmemAddr;  // [stage][part][64] x 8 B
  auto bar_full = [&](int stage, int part) { return bar_u + 8u * static_cast<uint32_t>(2 * stage + part); };
  auto bar_free = [&](int stage, int part) { return bar_u + 8u * static_cast<uint32_t>(4 + 2 * stage + part); };

  const int ht = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.num_head_tiles));
  const int sq = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.num_head_tiles));
  const int part_id = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4;
  const int gq = lane / 4, tq = lane % 4;

  const int32_t* meta = p.tile_scheduler_metadata + part_id * 8;
  const int begin_req = meta[0], end_req = meta[1], begin_blk = meta[2], end_blk = meta[3];
  const int begin_split = meta[4], first_splitted = meta[5], last_splitted = meta[6];
  if (begin_req >= p.b) return;

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) mbar_init(bar_u + 8 * i, 128);  // full: the 128 producer threads
#pragma unroll
    for (int i = 4; i < 8; ++i) mbar_init(bar_u + 8 * i, 128);  // free: one consumer warpgroup
    fence_barrier_init();
  }
  __syncthreads();

  struct ReqInfo {
    int n_main, blk_lo, n_blk, lim_main, lim_extra;
  };
  auto req_info = [&](int req) {
    ReqInfo r;
    int n_total;
    request_blocks(p, req, r.n_main, n_total);
    r.blk_lo = req == begin_req ? begin_blk : 0;
    const int blk_hi = min(req == end_req ? end_blk : n_total, n_total);
    r.n_blk = max(blk_hi - r.blk_lo, 0);
    r.lim_main = p.main.topk_length != nullptr ? min(max(p.main.topk_length[req], 0), p.main.topk) : p.main.topk;
    r.lim_extra = 0;
    if (p.has_extra)
      r.lim_extra =
          p.extra.topk_length != nullptr ? min(max(p.extra.topk_length[req], 0), p.extra.topk) : p.extra.topk;
    return r;
  };

  if (wg == 2) {
    // ============================ producer warpgroup ============================
    setmaxnreg_dec<kProdRegs>();
    const int t = tid - kConsumers;
    const int rg = t >> 3, c8 = t & 7;  // fills rows rg + 16 i (i < 4) as thread c8 of the row
    const int a_blk = t >> 6, a_row = t & 63;  // address table entry this thread computes
    int u0 = 0, u1 = 0;                 // fills of stage 0 / stage 1 so far
    int pair = 0;                       // pairs so far (address table parity)
    for (int req = begin_req; req <= end_req; ++req) {
      const ReqInfo ri = req_info(req);
      for (int j = 0; 2 * j < ri.n_blk; ++j, ++pair) {
        const bool has1 = 2 * j + 1 < ri.n_blk;
        uint64_t* tab = sAddr + (pair & 1) * 256;  // [rec / scale][block][row]
        {
          // This thread's slot: block a_blk of the pair, row a_row -> record and scale addresses.
          const int blk = ri.blk_lo + 2 * j + a_blk;
          uint64_t rec = 0, scl = 0;
          if (a_blk == 0 || has1) {
            const bool is_extra = p.has_extra && blk >= ri.n_main;
            const SparseScope& sc = is_extra ? p.extra : p.main;
            const int lim = is_extra ? ri.lim_extra : ri.lim_main;
            const int64_t slot = static_cast<int64_t>(is_extra ? blk - ri.n_main : blk) * kBlockN + a_row;
            if (slot < lim) {
              const int v = __ldg(sc.indices + (req * sc.idx_stride_b + sq * sc.idx_stride_s + slot * sc.idx_stride_k));
              if (v >= 0 && v < sc.num_tokens) row_addr<F>(sc, v, rec, scl);
            }
          }
          tab[a_blk * 64 + a_row] = rec;
          tab[128 + a_blk * 64 + a_row] = scl;
        }
        named_barrier_sync(kBarProducer, 128);  // the pair's table is complete (and the one of pair - 2 unused)
        const uint64_t *rec0 = tab, *rec1 = tab + 64, *scl0 = tab + 128, *scl1 = tab + 192;
        // Parts in the order the consumers release them: s0A (WG0 after P0 V0_L), s1B (WG1 after
        // P1 V1_R), s0B (WG1 after P0 V0_R), s1A (WG0 after P1 V1_L). Each part's copies are issued
        // as soon as it is free and finished (dequantized) after the next part's copies are issued,
        // so one part's loads are always in flight. Not across pairs: the pair's first part (s0A)
        // is released only after the consumers used the previous pair's parts, so everything is
        // finished before waiting for it (no cycle).
        const uint8_t* dummy = p.main.cache;
        uint8_t* sK1 = sK + kSmemK;
        const uint32_t sK1_u = sK_u + kSmemK;
        const uint32_t sScale_u = smem_u32(sScale);
        auto wait_free = [&](int stage, int part, int use) {
          if (use > 0) mbar_wait(bar_free(stage, part), static_cast<uint32_t>((use - 1) & 1));
        };
        wait_free(0, 0, u0);
        part_issue<F, 0, 0>(rec0, scl0, rg, c8, sK_u, sScale_u + 0 * 512, dummy);
        if (has1) {
          wait_free(1, 1, u1);
          part_issue<F, 1, 1>(rec1, scl1, rg, c8, sK1_u, sScale_u + 3 * 512, dummy);
          part_finish<F, 0, 0, 1>(rec0, rg, c8, sK, sScale + 0 * 512, sValid, bar_full(0, 0));
          wait_free(0, 1, u0);
          part_issue<F, 0, 1>(rec0, scl0, rg, c8, sK_u, sScale_u + 1 * 512, dummy);
          part_finish<F, 1, 1, 1>(rec1, rg, c8, sK1, sScale + 3 * 512, sValid + kBlockN, bar_full(1, 1));
          wait_free(1, 0, u1);
          part_issue<F, 1, 0>(rec1, scl1, rg, c8, sK1_u, sScale_u + 2 * 512, dummy);
          part_finish<F, 0, 1, 1>(rec0, rg, c8, sK, sScale + 1 * 512, sValid, bar_full(0, 1));
          part_finish<F, 1, 0, 0>(rec1, rg, c8, sK1, sScale + 2 * 512, sValid + kBlockN, bar_full(1, 0));
        } else {
          wait_free(0, 1, u0);
          part_issue<F, 0, 1>(rec0, scl0, rg, c8, sK_u, sScale_u + 1 * 512, dummy);
          part_finish<F, 0, 0, 1>(rec0, rg, c8, sK, sScale + 0 * 512, sValid, bar_full(0, 0));
          part_finish<F, 0, 1, 0>(rec0, rg, c8, sK, sScale + 1 * 512, sValid, bar_full(0, 1));
        }
        ++u0;
        if (has1) ++u1;
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // ============================ consumer warpgroups ============================
  setmaxnreg_inc<kConsRegs>();
  int row_local[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) row_local[hh] = wq * 16 + gq + 8 * hh;
  const uint64_t dq = gmma::make_desc_sw128(sQ_u, 16, 1024);
  int u0 = 0, u1 = 0;  // uses of stage 0 / stage 1 so far (same sequence as the producer's fills)

  for (int req = begin_req; req <= end_req; ++req) {
    const ReqInfo ri = req_info(req);
    const int n_blk = ri.n_blk;
    bool no_split;
    if (req == begin_req) no_split = !first_splitted;
    else if (req == end_req) no_split = !last_splitted;
    else no_split = true;
    if (!p.out_vec_ok) no_split = false;
    const int split_slot = p.num_splits[req] + (req == begin_req ? begin_split : 0);

    if (n_blk > 0) {
      named_barrier_sync(kBarConsumers, kConsumers);  // every consumer's S of the previous request is done
      const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + req * p.q_stride_b + sq * p.q_stride_s;
      for (int id = tid; id < 64 * kChunks; id += kConsumers) {
        const int r = id / kChunks, c = id % kChunks;
        const int h = ht * 64 + r;
        const bool valid = h < p.h_q;
        const __nv_bfloat16* src = valid ? qb + h * p.q_stride_h + c * 8 : static_cast<const __nv_bfloat16*>(p.q);
        if (p.q_vec) {
          cp_async_16(sQ_u + slab_off(r, c), src, valid);
        } else {
          uint16_t v[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = valid ? reinterpret_cast<const uint16_t*>(src)[e] : 0;
          *reinterpret_cast<uint4*>(base + slab_off(r, c)) =
              make_uint4(v[0] | (uint32_t(v[1]) << 16), v[2] | (uint32_t(v[3]) << 16), v[4] | (uint32_t(v[5]) << 16),
                         v[6] | (uint32_t(v[7]) << 16));
        }
      }
      cp_async_commit();
      cp_async_wait<0>();
      gmma::fence_proxy_async();
      named_barrier_sync(kBarConsumers, kConsumers);  // Q in shared memory, visible to wgmma
    }

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};

    for (int j = 0; 2 * j < n_blk; ++j) {
      const bool has1 = 2 * j + 1 < n_blk;
      const uint32_t ph0 = static_cast<uint32_t>(u0 & 1), ph1 = static_cast<uint32_t>(u1 & 1);
      float s[32];
      if (wg == 0) {
        // ---------------- warpgroup 0: block 2j (stage 0), O[:, 0:256]
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
        gmma::reg_fence(s);
        {
          const uint64_t db = gmma::make_desc_sw128(sK_u, 16, 1024);
          mbar_wait(bar_full(0, 0), ph0);
          gmma::fence_proxy_async();
          gmma::fence();
          s_chain<0, 4>(s, dq, db);
          mbar_wait(bar_full(0, 1), ph0);
          gmma::fence_proxy_async();
          gmma::fence();
          s_chain<4, kSlabs>(s, dq, db);
        }
        gmma::commit();
        gmma::wait<0>();
        gmma::reg_fence(s);

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
        bar_arrive(kBarScale0, kConsumers);

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

        named_barrier_sync(kBarScale1, kConsumers);
        float sc1[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          sc1[hh] = sS1[row_local[hh]];
          m_run[hh] = sM1[row_local[hh]];
        }
        // P0 * scale1 -> slab 8 of stage 0 (S0 is done with it)
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
        bar_arrive(kBarP0, kConsumers);

        gmma::wait<0>();
        gmma::reg_fence(o);
        mbar_arrive(bar_free(0, 0));  // stage 0 slabs 0-3 are free
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] *= sc1[hh];
        scale_o(o, sc1);
        named_barrier_sync(kBarP1, kConsumers);
        if (has1) {
          mbar_wait(bar_full(1, 0), ph1);  // completed (WG1 waited for it); orders the producer's writes
          gmma::fence_proxy_async();
          gmma::reg_fence(o);
          gmma::fence();
          pv_ss_chain(o, gmma::make_desc_sw128(sK_u + kSmemK + 8 * kSlabBytes, 16, 1024),
                      gmma::make_desc_sw128(sK_u + kSmemK, kSlabBytes, 1024));
          gmma::commit();
          gmma::wait<0>();
          gmma::reg_fence(o);
          mbar_arrive(bar_free(1, 0));  // stage 1 slabs 0-3 and 8 are free
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
            mbar_wait(bar_full(1, 0), ph1);
            gmma::fence_proxy_async();
            gmma::fence();
            s_chain<0, 4>(s, dq, db);
            mbar_wait(bar_full(1, 1), ph1);
            gmma::fence_proxy_async();
            gmma::fence();
            s_chain<4, kSlabs>(s, dq, db);
          }
          gmma::commit();
          gmma::wait<0>();
          gmma::reg_fence(s);
          mask_rowmax(s, sValid + kBlockN, p.scale_log2, tq, mx);
        }
        named_barrier_sync(kBarScale0, kConsumers);
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
        bar_arrive(kBarScale1, kConsumers);
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
        bar_arrive(kBarP1, kConsumers);
        if (has1) {
          gmma::reg_fence(o);
          gmma::fence();
          pv_rs_chain(o, a, gmma::make_desc_sw128(sK_u + kSmemK + 4 * kSlabBytes, kSlabBytes, 1024));
          gmma::commit();
        }
        named_barrier_sync(kBarP0, kConsumers);
        mbar_wait(bar_full(0, 1), ph0);  // completed (WG0 waited for it); orders the producer's writes
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
        mbar_arrive(bar_free(0, 1));  // stage 0 slabs 4-8 are free
      }
      ++u0;
      if (has1) ++u1;
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
      named_barrier_sync(kBarConsumers, kConsumers);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) L[hh] = sL[row_local[hh]] + sL[64 + row_local[hh]];
    }

#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = ht * 64 + row_local[hh];
      if (h >= p.h_q) continue;
      const bool empty = !(L[hh] > 0.f);  // no valid key (or NaN)
      const float lse2 = empty ? (no_split ? INFINITY : -INFINITY) : log2f(L[hh]) + m_run[hh];
      if (no_split) {
        float inv = empty ? 0.f : 1.f / L[hh];
        if (p.attn_sink != nullptr && !empty) inv *= 1.f / (1.f + exp2f(p.attn_sink[h] * kLog2e - lse2));
        __nv_bfloat16* out =
            static_cast<__nv_bfloat16*>(p.out) + req * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h;
#pragma unroll
        for (int jj = 0; jj < 32; ++jj) {
          const int col = wg * 256 + jj * 8 + 2 * tq;
          *reinterpret_cast<uint32_t*>(out + col) =
              HalfTraits<__nv_bfloat16>::pack(o[4 * jj + 2 * hh] * inv, o[4 * jj + 2 * hh + 1] * inv);
        }
        if (wg == 0 && tq == 0)
          p.lse[req * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = empty ? INFINITY : lse2 * kLn2;
      } else {
        const float inv = empty ? 0.f : 1.f / L[hh];
        const int64_t arow = (static_cast<int64_t>(split_slot) * p.s_q + sq) * p.h_q + h;
        float* oa = p.o_accum + arow * kDimV;
#pragma unroll
        for (int jj = 0; jj < 32; ++jj) {
          const int col = wg * 256 + jj * 8 + 2 * tq;
          *reinterpret_cast<float2*>(oa + col) = make_float2(o[4 * jj + 2 * hh] * inv, o[4 * jj + 2 * hh + 1] * inv);
        }
        if (wg == 0 && tq == 0) p.lse_accum[arow] = lse2;
      }
    }
  }
}

/// v3 serves 64-row head tiles (h_q > 32) over 16-byte aligned caches; v1 / v2 the rest.
inline bool usable(const SparseDecodeKernelParams& kp) {
  return kp.h_q > 32 && kp.main.vec != 0 && (!kp.has_extra || kp.extra.vec != 0);
}

template <Fmt F>
cudaError_t launch(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  auto kernel = flash_fwd_splitkv_mla_fp8_sparse_kernel_v3<F>;
  // The setmaxnreg split needs the launch's register pool (compiled registers x 384) to cover it;
  // with fewer, setmaxnreg.inc would wait forever. Refuse instead.
  static const int regs = [] {
    cudaFuncAttributes a{};
    return cudaFuncGetAttributes(&a, flash_fwd_splitkv_mla_fp8_sparse_kernel_v3<F>) == cudaSuccess ? a.numRegs : 0;
  }();
  if (regs * kThreads < 128 * kProdRegs + kConsumers * kConsRegs) return cudaErrorInvalidConfiguration;
  cudaError_t e = set_max_dynamic_smem(kernel, kSmemBytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(kp.s_q) * static_cast<unsigned>(kp.num_head_tiles),
                  static_cast<unsigned>(num_sm_parts), 1);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace flashmla::sm90::sparse::v3
