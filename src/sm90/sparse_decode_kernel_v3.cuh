// src/sm90/sparse_decode_kernel_v3.cuh — sparse FP8 MLA decode v3 for 64-row head tiles:
// the seesaw wgmma schedule of the sparse prefill kernel (seesaw.cuh, spec §7.1 / §7.3) fed by
// a producer warpgroup that gathers the FP8 records and dequantizes them (spec §2.7).
//
// CTA = (query token sq, head tile of 64 heads, scheduler partition), grid (s_q * head_tiles,
// num_sm_parts) as v1; it walks the (request, 64-slot block) range of its partition, a
// request's blocks being its main top-k blocks then its extra-cache blocks (one joint softmax,
// block counts as the scheduler's spec §4.2 work). 512 threads:
//   * warpgroups 0 and 1 (consumers, setmaxnreg kConsRegs): per request, load Q (64 x d_qk)
//     into shared memory, then two 64-slot blocks per step exactly as the prefill seesaw:
//       WG0: S0 = Q K0^T; m0, scale0, P0 (registers); O_L = O_L*scale0 + P0 V0_L
//       WG1: S1 = Q K1^T; m1 = max(m0, .), scale1; O_R = O_R*scale0*scale1 + P1 V1_R; P1 -> smem
//       WG0: P0*scale1 -> smem; O_L = O_L*scale1 + P1 V1_L;  WG1: O_R += P0 V0_R
//     (P.V as pairs of m64n128k16: at 512 threads the launch bound is 128 registers, below the 158
//     an m64n256 instruction needs), then the request's epilogue (out + lse with the sink factor,
//     or fp32 partials for the combine).
//   * warpgroups 2 and 3 (producers, setmaxnreg kProdRegs): walk the same (request, block)
//     sequence; per pair the first 128 producer threads write a table of the 128 slots' record /
//     scale addresses to shared memory (producer barrier); per stage part (stage 0: A = slabs 0-3,
//     B = slabs 4-8; stage 1: A = slabs 0-3 + 8, B = 4-7, the prefill kernel's parts and release
//     points; 8 threads per slot row, each producer warpgroup two of the four 16-row groups) a
//     thread
//       1. loads its two rows' FP8 bytes and scales into registers (ld.global.nc, 16 B per thread
//          and row: a warp instruction reads 4 whole 128-byte lines) before waiting for the part;
//       2. waits until the consumers have released the part (its previous use), copies the RoPE
//          bf16 bytes with cp.async, dequantizes exactly as v1 (fp8 -> f16 -> f32 -> bf16, times
//          the tile scale in bf16) into the 128B-swizzled slabs, writes the slot validity bytes
//          (part A);
//       3. arrives on the part's full barrier (256 plain arrivals after a proxy fence + 256
//          cp.async noinc arrivals for the RoPE copies).
// The producers are bound by the dequant's dependent instruction chains, not by memory: one
// producer warpgroup (session 4's first version) made v3 1.24x slower than v1; two make it 1.07x
// faster (bench/NOTES.md "sparse FP8 decode v3"). A 2-CTA cluster variant (below; automatic for
// MODEL1 with 128 heads, FLASHMLA_SPARSE_DECODE_CLUSTER=0/1 overrides) shares each block's dequant
// between the two head-tile CTAs.
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
#include <cstdlib>

#include "sm90/host_utils.h"
#include "sm90/seesaw.cuh"
#include "sm90/sparse_decode_kernel.cuh"
#include "sm90/wgmma.cuh"

namespace flashmla::sm90::sparse::v3 {

using namespace seesaw;

constexpr int kThreads = 512;
constexpr int kConsumers = 256;
constexpr int kProducers = 256;  // two producer warpgroups, two of the four row groups each
// setmaxnreg moves registers inside the CTA's pool: 512 threads x 128 = 65536 (see v2's note).
constexpr int kLaunchRegs = 128;
constexpr int kProdRegs = 40;
constexpr int kConsRegs = 216;
static_assert(kProducers * kProdRegs + kConsumers * kConsRegs <= kThreads * kLaunchRegs, "register pool of the CTA");

constexpr int kTileBytes = 9 * kSlabBytes;  // 64 rows x 576 dims (slab 8 also holds P for d_qk 512)
constexpr int kSmemQ = kTileBytes;
constexpr int kSmemK = kTileBytes;
constexpr int kSmemRed = 6 * 64 * 4;  // sM0, sS0, sM1, sS1, sL[2][64]
constexpr int kSmemValid = 2 * kBlockN;
constexpr int kSmemBar = 8 * 8;  // full[stage][part], free[stage][part]
// Producer's per-pair table of record / scale addresses: [pair parity][block of the pair][row], 0 = invalid.
constexpr int kSmemAddr = 2 * 2 * 2 * 64 * 8;
constexpr int kSmemBytes =
    1024 /*alignment slack*/ + kSmemQ + 2 * kSmemK + kSmemRed + kSmemValid + kSmemBar + kSmemAddr;
static_assert(kSmemBytes <= 232448, "shared memory");

enum : int { kBarScale0 = 1, kBarScale1 = 2, kBarP0 = 3, kBarP1 = 4, kBarConsumers = 5, kBarProducer = 6 };


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

/// FP8 data and scales of one producer warpgroup's share of a stage part (rows rg + 16 i, i = 2 half + {0, 1}).
struct HalfRegs {
  uint4 u0[2], u1[2];
  uint2 sc[2];  // V32: 2 fp32 scales (tiles lo/8, lo/8 + 1); MODEL1: the 8-byte e8m0 record
};

/// Load one half of the part into registers; `rec` / `scl`: the block's address table (0 = invalid slot).
template <Fmt F, int S, int PT>
__device__ __forceinline__ void half_load(HalfRegs& r, const uint64_t* rec, const uint64_t* scl, int rg, int c8,
                                          int half) {
  using M = PartMap<F, S, PT>;
  const bool has_u1 = M::kLo + 8 + c8 < M::kNopeUnits;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = rg + 16 * (2 * half + i);
    const uint8_t* a = reinterpret_cast<const uint8_t*>(rec[row]);
    r.u0[i] = make_uint4(0u, 0u, 0u, 0u);
    r.u1[i] = make_uint4(0u, 0u, 0u, 0u);
    r.sc[i] = make_uint2(0u, 0u);
    if (a != nullptr) {
      r.u0[i] = ldg16(a + 16 * (M::kLo + c8));
      if (has_u1) r.u1[i] = ldg16(a + 16 * (M::kLo + 8 + c8));
      const uint8_t* sa = reinterpret_cast<const uint8_t*>(scl[row]);
      if constexpr (F == Fmt::kV32) r.sc[i] = ldg8(sa + 4 * (M::kLo / 8));
      else r.sc[i] = ldg8(sa);
    }
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

/// After the part is free: RoPE of this thread's two rows (half) by cp.async (bf16, no conversion).
template <Fmt F, int S, int PT>
__device__ __forceinline__ void part_rope(const uint64_t* rec, int rg, int c8, int half, uint32_t sK_stage_u) {
  using M = PartMap<F, S, PT>;
  if constexpr (M::kRope) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = rg + 16 * (2 * half + i);
      const uint8_t* a = reinterpret_cast<const uint8_t*>(rec[row]);
      cp_async_16(sK_stage_u + slab_off(row, M::kRopeChunk0 + c8),
                  a != nullptr ? a + FmtCfg<F>::kRopeRaw + 16 * c8 : reinterpret_cast<const uint8_t*>(rec), a != nullptr);
    }
  }
}

/// Dequantize one half into the stage (spec §2.7, v1's dequant8) and write its validity bytes (part A).
template <Fmt F, int S, int PT>
__device__ __forceinline__ void half_store(const HalfRegs& r, const uint64_t* rec, int rg, int c8, int half,
                                           uint8_t* sK_stage, uint8_t* sValid_stage) {
  using M = PartMap<F, S, PT>;
  const bool has_u1 = M::kLo + 8 + c8 < M::kNopeUnits;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = rg + 16 * (2 * half + i);
    const int ua = M::kLo + c8, ub = M::kLo + 8 + c8;
    const __nv_bfloat162 sa = unit_scale<F>(r.sc[i], 0, ua);
    *reinterpret_cast<uint4*>(sK_stage + slab_off(row, 2 * ua)) = dequant8(make_uint2(r.u0[i].x, r.u0[i].y), sa);
    *reinterpret_cast<uint4*>(sK_stage + slab_off(row, 2 * ua + 1)) = dequant8(make_uint2(r.u0[i].z, r.u0[i].w), sa);
    if (has_u1) {
      const __nv_bfloat162 sb = unit_scale<F>(r.sc[i], 1, ub);
      *reinterpret_cast<uint4*>(sK_stage + slab_off(row, 2 * ub)) = dequant8(make_uint2(r.u1[i].x, r.u1[i].y), sb);
      *reinterpret_cast<uint4*>(sK_stage + slab_off(row, 2 * ub + 1)) =
          dequant8(make_uint2(r.u1[i].z, r.u1[i].w), sb);
    }
    if (PT == 0 && c8 == 0) sValid_stage[row] = rec[row] != 0 ? 1 : 0;
  }
}

/// One stage part, this thread's two rows (producer warpgroup `half` owns rows rg + 16 (2 half + i)):
/// FP8 bytes and scales into registers before waiting for the part to be free (use `use` > 0: the
/// consumers' release of use - 1), then RoPE cp.async, dequant, proxy fence, arrivals (256 plain +
/// 256 cp.async noinc on the full barrier).
template <Fmt F, int S, int PT>
__device__ __forceinline__ void fill_part(const uint64_t* rec, const uint64_t* scl, int rg, int c8, int half,
                                          uint8_t* sK_stage, uint32_t sK_stage_u, uint8_t* sValid_stage,
                                          uint32_t bar_full, uint32_t bar_free, int use) {
  HalfRegs r;
  half_load<F, S, PT>(r, rec, scl, rg, c8, half);
  if (use > 0) mbar_wait(bar_free, static_cast<uint32_t>((use - 1) & 1));
  part_rope<F, S, PT>(rec, rg, c8, half, sK_stage_u);
  half_store<F, S, PT>(r, rec, rg, c8, half, sK_stage, sValid_stage);
  gmma::fence_proxy_async();  // generic-proxy stores -> visible to the consumers' wgmma (async proxy)
  mbar_arrive_cp_async(bar_full);
  mbar_arrive(bar_full);
}

// ---- 2-CTA cluster variant (h_q a multiple of 128): the two head-tile CTAs of a (token,
// partition) see the same blocks; each dequantizes half of every block's rows (rows of 16-row
// groups 2 rank, 2 rank + 1) into its own and its peer's slabs (st.shared::cluster), copies all
// RoPE rows itself, and arrives on both CTAs' full barriers; consumers release a part on both
// CTAs' free barriers, so a producer refills a part only when both CTAs' consumers are done.
namespace cl {
__device__ __forceinline__ uint32_t rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
/// Shared::cluster address of the same shared-memory offset in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t mapa(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void st16(uint32_t addr, uint4 v) {
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st8(uint32_t addr, uint16_t v) {
  asm volatile("st.shared::cluster.u8 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}
/// Arrival (release at cluster scope) on an mbarrier of the peer CTA.
__device__ __forceinline__ void arrive_remote(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}
/// Wait (acquire at cluster scope: sees the peer's writes released by its arrivals).
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (ok == 0);
}
/// All threads of both CTAs (barrier.cluster, aligned).
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
}  // namespace cl

/// Cluster variant of fill_part: this thread's one row (rg + 16 (2 rank + half)) into both CTAs,
/// RoPE of two rows (rg + 16 (2 half + i)) into this CTA only. `r_*`: the peer's addresses.
template <Fmt F, int S, int PT>
__device__ __forceinline__ void fill_part_cluster(const uint64_t* rec, const uint64_t* scl, int rg, int c8, int half,
                                                  int rank, uint8_t* sK_stage, uint32_t sK_stage_u,
                                                  uint32_t r_sK_stage, uint8_t* sValid_stage,
                                                  uint32_t r_sValid_stage, uint32_t bar_full, uint32_t r_bar_full,
                                                  uint32_t bar_free, int use) {
  using M = PartMap<F, S, PT>;
  const bool has_u1 = M::kLo + 8 + c8 < M::kNopeUnits;
  const int row = rg + 16 * (2 * rank + half);
  const uint8_t* a = reinterpret_cast<const uint8_t*>(rec[row]);
  uint4 u0 = make_uint4(0u, 0u, 0u, 0u), u1 = make_uint4(0u, 0u, 0u, 0u);
  uint2 sc = make_uint2(0u, 0u);
  if (a != nullptr) {
    u0 = ldg16(a + 16 * (M::kLo + c8));
    if (has_u1) u1 = ldg16(a + 16 * (M::kLo + 8 + c8));
    const uint8_t* sa = reinterpret_cast<const uint8_t*>(scl[row]);
    if constexpr (F == Fmt::kV32) sc = ldg8(sa + 4 * (M::kLo / 8));
    else sc = ldg8(sa);
  }
  if (use > 0) cl::wait(bar_free, static_cast<uint32_t>((use - 1) & 1));
  part_rope<F, S, PT>(rec, rg, c8, half, sK_stage_u);
  const int ua = M::kLo + c8, ub = M::kLo + 8 + c8;
  {
    const __nv_bfloat162 s2 = unit_scale<F>(sc, 0, ua);
    const uint4 x0 = dequant8(make_uint2(u0.x, u0.y), s2), x1 = dequant8(make_uint2(u0.z, u0.w), s2);
    const uint32_t o0 = slab_off(row, 2 * ua), o1 = slab_off(row, 2 * ua + 1);
    *reinterpret_cast<uint4*>(sK_stage + o0) = x0;
    *reinterpret_cast<uint4*>(sK_stage + o1) = x1;
    cl::st16(r_sK_stage + o0, x0);
    cl::st16(r_sK_stage + o1, x1);
  }
  if (has_u1) {
    const __nv_bfloat162 s2 = unit_scale<F>(sc, 1, ub);
    const uint4 x0 = dequant8(make_uint2(u1.x, u1.y), s2), x1 = dequant8(make_uint2(u1.z, u1.w), s2);
    const uint32_t o0 = slab_off(row, 2 * ub), o1 = slab_off(row, 2 * ub + 1);
    *reinterpret_cast<uint4*>(sK_stage + o0) = x0;
    *reinterpret_cast<uint4*>(sK_stage + o1) = x1;
    cl::st16(r_sK_stage + o0, x0);
    cl::st16(r_sK_stage + o1, x1);
  }
  if (PT == 0 && c8 == 0) {
    const uint16_t v = a != nullptr ? 1 : 0;
    sValid_stage[row] = static_cast<uint8_t>(v);
    cl::st8(r_sValid_stage + row, v);
  }
  gmma::fence_proxy_async();  // generic-proxy stores -> visible to the consumers' wgmma (async proxy)
  mbar_arrive_cp_async(bar_full);
  mbar_arrive(bar_full);
  cl::arrive_remote(r_bar_full);
}

template <Fmt F, bool kCluster>
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
    // full: 256 plain + 256 cp.async noinc arrivals (+ 256 from the peer's producers in a cluster);
    // free: one consumer warpgroup (+ the peer's).
#pragma unroll
    for (int i = 0; i < 4; ++i) mbar_init(bar_u + 8 * i, (kCluster ? 3 : 2) * kProducers);
#pragma unroll
    for (int i = 4; i < 8; ++i) mbar_init(bar_u + 8 * i, kCluster ? 256 : 128);
    fence_barrier_init();
  }
  if constexpr (kCluster) cl::sync();  // both CTAs' barriers initialised before any remote arrival
  else __syncthreads();
  const uint32_t peer = kCluster ? (cl::rank() ^ 1u) : 0u;
  const uint32_t r_bar_u = kCluster ? cl::mapa(bar_u, peer) : 0u;  // the peer's barriers

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

  if (wg >= 2) {
    // ============================ producer warpgroup ============================
    setmaxnreg_dec<kProdRegs>();
    const int t = tid - kConsumers;
    const int half = t >> 7, rg = (t & 127) >> 3, c8 = t & 7;  // rows rg + 16 (2 half + i), i < 2
    const int a_blk = (t >> 6) & 1, a_row = t & 63;  // address table entry (threads t < 128)
    int u0 = 0, u1 = 0;  // fills of stage 0 / stage 1 so far
    // Look-ahead over the pairs: (nreq, nj) is the next pair whose address table is written, one
    // pair ahead of the fills, so its index loads and its records' L2 prefetch overlap the current
    // pair's dequant (the fills of a pair otherwise start with a dependent index -> record load chain).
    int nreq = begin_req, nj = 0;
    ReqInfo nri = req_info(begin_req);
    auto skip_empty = [&]() {  // advance (nreq, nj) to the next existing pair, nreq > end_req at the end
      while (nreq <= end_req && 2 * nj >= nri.n_blk) {
        ++nreq;
        nj = 0;
        if (nreq <= end_req) nri = req_info(nreq);
      }
    };
    // This thread's slot of pair (nreq, nj) (threads t < 128: block a_blk, row a_row): its cache
    // index, -1 if invalid or absent.
    auto load_index = [&]() {
      int v = -1;
      const int blk = nri.blk_lo + 2 * nj + a_blk;
      if (t < 128 && 2 * nj + a_blk < nri.n_blk) {
        const bool is_extra = p.has_extra && blk >= nri.n_main;
        const SparseScope& sc = is_extra ? p.extra : p.main;
        const int lim = is_extra ? nri.lim_extra : nri.lim_main;
        const int64_t slot = static_cast<int64_t>(is_extra ? blk - nri.n_main : blk) * kBlockN + a_row;
        if (slot < lim) {
          v = __ldg(sc.indices + (nreq * sc.idx_stride_b + sq * sc.idx_stride_s + slot * sc.idx_stride_k));
          if (v >= sc.num_tokens) v = -1;
        }
      }
      return v;
    };
    // Write the table entry of index v (from load_index) into table `parity`, prefetch its record to L2.
    auto write_entry = [&](int v, int parity) {
      if (t < 128) {
        uint64_t rec = 0, scl = 0;
        if (v >= 0) {
          const bool is_extra = p.has_extra && nri.blk_lo + 2 * nj + a_blk >= nri.n_main;
          row_addr<F>(is_extra ? p.extra : p.main, v, rec, scl);
          prefetch_l2_bulk(reinterpret_cast<const void*>(rec), PartMap<F, 0, 0>::kRecBytes);
          if constexpr (F != Fmt::kV32) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(scl));
        }
        uint64_t* tab = sAddr + parity * 256;  // [rec / scale][block][row]
        tab[a_blk * 64 + a_row] = rec;
        tab[128 + a_blk * 64 + a_row] = scl;
      }
    };
    skip_empty();
    if (nreq <= end_req) {
      bool has1 = 2 * nj + 1 < nri.n_blk;
      write_entry(load_index(), 0);
      named_barrier_sync(kBarProducer, kProducers);  // the first pair's table is complete
      for (int pair = 0;; ++pair) {
        ++nj;
        skip_empty();
        const bool more = nreq <= end_req;
        const bool has1_next = more && 2 * nj + 1 < nri.n_blk;
        const int v_next = more ? load_index() : -1;
        const uint64_t* tab = sAddr + (pair & 1) * 256;
        const uint64_t *rec0 = tab, *rec1 = tab + 64, *scl0 = tab + 128, *scl1 = tab + 192;
        // Order of release by the consumers: s0A (WG0 after P0 V0_L), s1B (WG1 after P1 V1_R),
        // s0B (WG1 after P0 V0_R), s1A (WG0 after P1 V1_L). The next pair's table (the slot of
        // pair - 1, whose fills every producer finished before this pair's barrier) is written
        // after the first part.
        if constexpr (kCluster) {
          const int rank = static_cast<int>(peer ^ 1u);
          const uint32_t rK = cl::mapa(sK_u, peer), rV = cl::mapa(smem_u32(sValid), peer);
          fill_part_cluster<F, 0, 0>(rec0, scl0, rg, c8, half, rank, sK, sK_u, rK, sValid, rV, bar_full(0, 0),
                                     r_bar_u + 8 * 0, bar_free(0, 0), u0);
          if (more) write_entry(v_next, (pair + 1) & 1);
          if (has1)
            fill_part_cluster<F, 1, 1>(rec1, scl1, rg, c8, half, rank, sK + kSmemK, sK_u + kSmemK, rK + kSmemK,
                                       sValid + kBlockN, rV + kBlockN, bar_full(1, 1), r_bar_u + 8 * 3,
                                       bar_free(1, 1), u1);
          fill_part_cluster<F, 0, 1>(rec0, scl0, rg, c8, half, rank, sK, sK_u, rK, sValid, rV, bar_full(0, 1),
                                     r_bar_u + 8 * 1, bar_free(0, 1), u0);
          if (has1)
            fill_part_cluster<F, 1, 0>(rec1, scl1, rg, c8, half, rank, sK + kSmemK, sK_u + kSmemK, rK + kSmemK,
                                       sValid + kBlockN, rV + kBlockN, bar_full(1, 0), r_bar_u + 8 * 2,
                                       bar_free(1, 0), u1);
        } else {
          fill_part<F, 0, 0>(rec0, scl0, rg, c8, half, sK, sK_u, sValid, bar_full(0, 0), bar_free(0, 0), u0);
          if (more) write_entry(v_next, (pair + 1) & 1);
          if (has1)
            fill_part<F, 1, 1>(rec1, scl1, rg, c8, half, sK + kSmemK, sK_u + kSmemK, sValid + kBlockN, bar_full(1, 1),
                               bar_free(1, 1), u1);
          fill_part<F, 0, 1>(rec0, scl0, rg, c8, half, sK, sK_u, sValid, bar_full(0, 1), bar_free(0, 1), u0);
          if (has1)
            fill_part<F, 1, 0>(rec1, scl1, rg, c8, half, sK + kSmemK, sK_u + kSmemK, sValid + kBlockN, bar_full(1, 0),
                               bar_free(1, 0), u1);
        }
        ++u0;
        if (has1) ++u1;
        if (!more) break;
        named_barrier_sync(kBarProducer, kProducers);  // the next pair's table is complete
        has1 = has1_next;
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if constexpr (kCluster) cl::sync();  // the peer may still write / arrive into this CTA
    return;
  }

  // ============================ consumer warpgroups ============================
  setmaxnreg_inc<kConsRegs>();
  auto full_wait = [&](uint32_t bar, uint32_t parity) {
    if constexpr (kCluster) cl::wait(bar, parity);  // also the peer producers' writes
    else mbar_wait(bar, parity);
  };
  // Release a stage part: this CTA's free barrier and, in a cluster, the peer's (whose producer
  // writes half of this part's rows here).
  auto release = [&](int stage, int part) {
    mbar_arrive(bar_free(stage, part));
    if constexpr (kCluster) cl::arrive_remote(r_bar_u + 8u * static_cast<uint32_t>(4 + 2 * stage + part));
  };
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
          full_wait(bar_full(0, 0), ph0);
          gmma::fence_proxy_async();
          gmma::fence();
          s_chain<0, 4>(s, dq, db);
          full_wait(bar_full(0, 1), ph0);
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
        pv_rs_chain_n128(o, a, gmma::make_desc_sw128(sK_u, kSlabBytes, 1024));
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
        release(0, 0);  // stage 0 slabs 0-3 are free
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] *= sc1[hh];
        scale_o(o, sc1);
        named_barrier_sync(kBarP1, kConsumers);
        if (has1) {
          full_wait(bar_full(1, 0), ph1);  // completed (WG1 waited for it); orders the producer's writes
          gmma::fence_proxy_async();
          gmma::reg_fence(o);
          gmma::fence();
          pv_ss_chain_n128(o, gmma::make_desc_sw128(sK_u + kSmemK + 8 * kSlabBytes, 16, 1024),
                      gmma::make_desc_sw128(sK_u + kSmemK, kSlabBytes, 1024));
          gmma::commit();
          gmma::wait<0>();
          gmma::reg_fence(o);
          release(1, 0);  // stage 1 slabs 0-3 and 8 are free
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
            full_wait(bar_full(1, 0), ph1);
            gmma::fence_proxy_async();
            gmma::fence();
            s_chain<0, 4>(s, dq, db);
            full_wait(bar_full(1, 1), ph1);
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
          pv_rs_chain_n128(o, a, gmma::make_desc_sw128(sK_u + kSmemK + 4 * kSlabBytes, kSlabBytes, 1024));
          gmma::commit();
        }
        named_barrier_sync(kBarP0, kConsumers);
        full_wait(bar_full(0, 1), ph0);  // completed (WG0 waited for it); orders the producer's writes
        gmma::fence_proxy_async();
        gmma::fence();
        pv_ss_chain_n128(o, gmma::make_desc_sw128(sK_u + 8 * kSlabBytes, 16, 1024),
                    gmma::make_desc_sw128(sK_u + 4 * kSlabBytes, kSlabBytes, 1024));
        gmma::commit();
        if (has1) {
          gmma::wait<1>();  // P1 V1_R done: stage 1 slabs 4-7 are free
          release(1, 1);
        }
        gmma::wait<0>();
        gmma::reg_fence(o);
        release(0, 1);  // stage 0 slabs 4-8 are free
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
  if constexpr (kCluster) cl::sync();  // the peer may still write / arrive into this CTA
}

/// v3 serves 64-row head tiles (h_q > 32) over 16-byte aligned caches; v1 / v2 the rest.
inline bool usable(const SparseDecodeKernelParams& kp) {
  return kp.h_q > 32 && kp.main.vec != 0 && (!kp.has_extra || kp.extra.vec != 0);
}

template <Fmt F, bool kCluster>
cudaError_t launch_k(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  auto kernel = flash_fwd_splitkv_mla_fp8_sparse_kernel_v3<F, kCluster>;
  // The setmaxnreg split needs the launch's register pool (compiled registers x 512) to cover it;
  // with fewer, setmaxnreg.inc would wait forever. Refuse instead.
  static const int regs = [] {
    cudaFuncAttributes a{};
    return cudaFuncGetAttributes(&a, flash_fwd_splitkv_mla_fp8_sparse_kernel_v3<F, kCluster>) == cudaSuccess
               ? a.numRegs
               : 0;
  }();
  if (regs * kThreads < kProducers * kProdRegs + kConsumers * kConsRegs) return cudaErrorInvalidConfiguration;
  cudaError_t e = set_max_dynamic_smem(kernel, kSmemBytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(kp.s_q) * static_cast<unsigned>(kp.num_head_tiles),
                  static_cast<unsigned>(num_sm_parts), 1);
  if constexpr (!kCluster) {
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(kp);
    return cudaGetLastError();
  } else {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = kSmemBytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, kp);
  }
}

/// Clusters of 2 CTAs that the current device keeps resident at once (0 if unknown), per kernel.
template <Fmt F>
int max_active_clusters() {
  static int cache[64] = {};
  static bool done[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (!done[dev]) {
    auto kernel = flash_fwd_splitkv_mla_fp8_sparse_kernel_v3<F, true>;
    int n = 0;
    if (set_max_dynamic_smem(kernel, kSmemBytes) == cudaSuccess) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(2, 1, 1);
      cfg.blockDim = dim3(kThreads, 1, 1);
      cfg.dynamicSmemBytes = kSmemBytes;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = 2;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) n = 0;
    }
    (void)cudaGetLastError();
    cache[dev] = n;
    done[dev] = true;
  }
  return cache[dev];
}

/// The 2-CTA cluster variant is automatic for MODEL1 (d_qk 512) with paired head tiles (h_q 128):
/// on the H200 it is 1.08-1.10x faster than the plain v3 there, but 0.92-0.93x for V3.2 (d_qk 576),
/// whose records add 4 scales and a RoPE part each CTA still copies whole (bench/NOTES.md "sparse
/// FP8 decode v3"; the full §5.2 grid passed with it forced, session 5). FLASHMLA_SPARSE_DECODE_CLUSTER
/// (read per call) overrides: "1" on wherever the head tiles pair up, "0" off. It also needs every
/// cluster of the grid resident at once (else a second wave would cost more than the shared dequant saves).
template <Fmt F>
cudaError_t launch(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  const char* env = std::getenv("FLASHMLA_SPARSE_DECODE_CLUSTER");
  const bool on = env != nullptr && (env[0] == '0' || env[0] == '1') ? env[0] == '1' : F == Fmt::kModel1;
  const int64_t clusters = static_cast<int64_t>(kp.s_q) * kp.num_head_tiles / 2 * num_sm_parts;
  if (on && kp.num_head_tiles % 2 == 0 && clusters <= max_active_clusters<F>())
    return launch_k<F, true>(kp, num_sm_parts, stream);
  return launch_k<F, false>(kp, num_sm_parts, stream);
}

}  // namespace flashmla::sm90::sparse::v3
