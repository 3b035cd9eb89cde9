// src/sm90/sparse_decode_kernel_v4.cuh — sparse FP8 MLA decode v4 for 64-row head tiles (h_q > 32):
// one 64-slot block per step over two whole-block K buffers, so the producers fill block g + 1
// while the consumers work on block g (session 4's v3 ran the prefill's seesaw over block pairs,
// which keeps both buffers busy in every step; bench/NOTES.md "sparse FP8 decode v4").
//
// CTA = (query token sq, head tile of 64 heads, scheduler partition), grid (s_q * head_tiles,
// num_sm_parts) as v1, walking the same (request, 64-slot block) range; the CTA's blocks are
// numbered g = 0, 1, ... across its requests, block g uses buffer g & 1. 512 threads:
//   * warpgroup 0 (setmaxnreg kWg0Regs): per block S = Q K^T (m64n64k16 chains over the 9 or 8
//     slabs; two parts: slabs 0-3, slabs 4-8), masking (spec §2.7 invalid slots), the online
//     softmax (m, l for whole rows), P (bf16) into registers and into slab 8 of the block's buffer
//     (for d_qk 576 that is the RoPE slab S is done with; d_qk 512 leaves slab 8 free), the row
//     rescale factor into sScale[buffer]; then O[:, 0:256] = O * scale + P V[:, 0:256] and the release
//     of part A (slabs 0-3).
//   * warpgroup 1 (setmaxnreg kWg1Regs): per block, after warpgroup 0's P barrier, O[:, 256:512] =
//     O * scale + P V[:, 256:512] from slab 8 and slabs 4-7, then the release of part B (slabs 4-8).
//   * warpgroups 2 and 3 (producers, setmaxnreg kProdRegs): each thread owns two rows of every
//     block (rows rg + 16 (2 half + i), 8 threads per row, 16 dims of each 128-dim half per
//     thread). Per block the first 64 producer threads write the next block's record / scale
//     addresses to a shared table (and prefetch the records to L2), one block ahead, behind one
//     producer barrier per block; each thread loads both parts' FP8 bytes and scales into
//     registers before its first wait, then per part waits until the consumers released it,
//     dequantizes exactly (spec §2.7: fp8 -> f16 -> f32 -> bf16, times the tile scale in bf16,
//     v1's dequant8) into the 128B-swizzled slabs, copies the RoPE bf16 bytes (part B) by cp.async
//     and arrives on the part's full barrier (256 plain + 256 cp.async noinc arrivals).
// Per request: Q reload behind a consumer barrier (both consumer warpgroups copy), then its blocks,
// then out + lse (attention sink) or fp32 partials for the combine (spec §4.5).
// Only for 16-byte aligned caches (v1 keeps the byte-copy path); q rows may be unaligned.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <type_traits>

#include "sm90/host_utils.h"
#include "sm90/seesaw.cuh"
#include "sm90/sparse_decode_kernel.cuh"
#include "sm90/wgmma.cuh"

namespace flashmla::sm90::sparse::v4 {

using namespace seesaw;

constexpr int kThreads = 512;
constexpr int kConsumers = 256;
constexpr int kProducers = 256;
// Register split of the CTA's pool (512 x 128, moved by setmaxnreg): S + softmax + half of O /
// half of O / producers.
constexpr int kLaunchRegs = 128;
constexpr int kWg0Regs = 216;
constexpr int kWg1Regs = 160;
constexpr int kProdRegs = 64;
static_assert(128 * kWg0Regs + 128 * kWg1Regs + kProducers * kProdRegs <= kThreads * kLaunchRegs,
              "register pool of the CTA");
constexpr int kTileBytes = 9 * kSlabBytes;  // 64 rows x 576 dims (slab 8 also holds P)

/// Where part PT of a block gets its data, per format. FP8 16-byte units u (16 dims, bf16 chunks
/// 2u and 2u + 1): part A units 0-15, part B units 16..kNope/16 - 1. Thread c8 of a row (0..7)
/// takes units lo + c8 and lo + 8 + c8 (the second only below kNope/16). RoPE (bf16, 8 chunks, one
/// per thread) belongs to part B: slab 8 (V32, chunks 64-71) or slab 7 (MODEL1, chunks 56-63).
template <Fmt F, int PT>
struct PartMap {
  using FC = FmtCfg<F>;
  static constexpr int kLo = PT == 0 ? 0 : 16;
  static constexpr int kNopeUnits = FC::kNope / 16;  // 32 (V32) or 28 (MODEL1)
  static constexpr bool kRope = PT == 1;
  static constexpr int kRopeChunk0 = FC::kNope / 8;  // 64 or 56
  static constexpr int kRecBytes = F == Fmt::kV32 ? 656 : 576;
};

/// Byte address of the record (and, MODEL1, of the 8-byte scale record) of cache token `idx`
/// (valid: 0 <= idx < num_tokens; spec §3.2-3.4 layouts).
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

/// A producer thread's two rows of the current block: record / scale addresses (0 = invalid slot).
struct RowAddr {
  uint64_t rec[2], scl[2];
};

/// FP8 data and scales of one part of a thread's two rows.
struct PartRegs {
  uint4 u0[2], u1[2];
  uint2 sc[2];  // V32: 2 fp32 scales (tiles lo/8, lo/8 + 1); MODEL1: the 8-byte e8m0 record
};

template <Fmt F, int PT>
__device__ __forceinline__ void part_load(PartRegs& r, const RowAddr& ra, int c8) {
  using M = PartMap<F, PT>;
  const bool has_u1 = M::kLo + 8 + c8 < M::kNopeUnits;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint8_t* a = reinterpret_cast<const uint8_t*>(ra.rec[i]);
    r.u0[i] = make_uint4(0u, 0u, 0u, 0u);
    r.u1[i] = make_uint4(0u, 0u, 0u, 0u);
    r.sc[i] = make_uint2(0u, 0u);
    if (a != nullptr) {
      r.u0[i] = ldg16(a + 16 * (M::kLo + c8));
      if (has_u1) r.u1[i] = ldg16(a + 16 * (M::kLo + 8 + c8));
      const uint8_t* sa = reinterpret_cast<const uint8_t*>(ra.scl[i]);
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

/// Dequantize a part of the thread's two rows into the buffer (spec §2.7, v1's dequant8); part A
/// also writes the rows' validity bytes.
template <Fmt F, int PT>
__device__ __forceinline__ void part_store(const PartRegs& r, const RowAddr& ra, const int (&row)[2], int c8,
                                           uint8_t* sKx, uint8_t* sValid_x) {
  using M = PartMap<F, PT>;
  const bool has_u1 = M::kLo + 8 + c8 < M::kNopeUnits;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int ua = M::kLo + c8, ub = M::kLo + 8 + c8;
    const __nv_bfloat162 sa = unit_scale<F>(r.sc[i], 0, ua);
    *reinterpret_cast<uint4*>(sKx + slab_off(row[i], 2 * ua)) = dequant8(make_uint2(r.u0[i].x, r.u0[i].y), sa);
    *reinterpret_cast<uint4*>(sKx + slab_off(row[i], 2 * ua + 1)) = dequant8(make_uint2(r.u0[i].z, r.u0[i].w), sa);
    if (has_u1) {
      const __nv_bfloat162 sb = unit_scale<F>(r.sc[i], 1, ub);
      *reinterpret_cast<uint4*>(sKx + slab_off(row[i], 2 * ub)) = dequant8(make_uint2(r.u1[i].x, r.u1[i].y), sb);
      *reinterpret_cast<uint4*>(sKx + slab_off(row[i], 2 * ub + 1)) = dequant8(make_uint2(r.u1[i].z, r.u1[i].w), sb);
    }
    if (PT == 0 && c8 == 0) sValid_x[row[i]] = ra.rec[i] != 0 ? 1 : 0;
  }
}

/// RoPE of the thread's two rows (bf16, no conversion) by cp.async; invalid rows are zero-filled.
template <Fmt F>
__device__ __forceinline__ void part_rope(const RowAddr& ra, const int (&row)[2], int c8, uint32_t sKx_u,
                                          const void* any_global) {
  using M = PartMap<F, 1>;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint8_t* a = reinterpret_cast<const uint8_t*>(ra.rec[i]);
    cp_async_16(sKx_u + slab_off(row[i], M::kRopeChunk0 + c8),
                a != nullptr ? a + FmtCfg<F>::kRopeRaw + 16 * c8 : static_cast<const uint8_t*>(any_global),
                a != nullptr);
  }
}

// ---- 2-CTA cluster variant (kCluster; head tiles paired, h_q = 128; the default for both formats
// since session 7, bench/NOTES.md "sparse FP8 decode v4, session 7"): the two head-tile CTAs of a
// (query token, partition) walk the same blocks. Each CTA's
// producers dequantize half of every block's rows (thread row row[rank]) into their own slabs
// (st.shared) and the peer's (st.async to the peer's mapa address, completing 16 bytes of
// transaction on the peer's full barrier of that part, as FlashMLA's 2-CTA path does), copy all 64
// rows' RoPE and write all 64 validity bytes locally. A full barrier counts the 512 local arrivals
// (256 plain, one of them arrive.expect_tx for the peer's bytes of the part, + 256 cp.async noinc)
// and the peer's transaction bytes; the consumers release a part on both CTAs' free barriers
// (count 256), so a part is refilled only when both CTAs' consumers are done with it. (Session 6's
// first cluster variant, commit 027b0c0, used st.shared::cluster plus 256 remote arrivals per part
// and was slower than the plain kernel.)
namespace cl {
__device__ __forceinline__ uint32_t rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
/// Shared::cluster address of shared::cta address `addr` in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t mapa(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
/// 16 bytes into the peer's shared memory (async proxy), completing 16 bytes of transaction on
/// the peer's mbarrier `mbar` (both shared::cluster addresses).
__device__ __forceinline__ void st16_async(uint32_t addr, uint4 v, uint32_t mbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n"
               ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(mbar)
               : "memory");
}
/// This thread's arrival on a local mbarrier that also expects `bytes` of transaction this phase.
__device__ __forceinline__ void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
/// Arrival (release at cluster scope) on an mbarrier of the peer CTA.
__device__ __forceinline__ void arrive_remote(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}
/// Wait with acquire at cluster scope (sees the peer's writes released by its arrivals).
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
/// Every thread of both CTAs (barrier.cluster, aligned).
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
/// Generic-proxy writes (local or the peer's shared memory) -> the async proxy (wgmma).
}  // namespace cl

/// FP8 data and scales of one part of one row (cluster variant).
struct PartRegs1 {
  uint4 u0, u1;
  uint2 sc;
};

template <Fmt F, int PT>
__device__ __forceinline__ void part_load1(PartRegs1& r, uint64_t rec, uint64_t scl, int c8) {
  using M = PartMap<F, PT>;
  const bool has_u1 = M::kLo + 8 + c8 < M::kNopeUnits;
  const uint8_t* a = reinterpret_cast<const uint8_t*>(rec);
  r.u0 = make_uint4(0u, 0u, 0u, 0u);
  r.u1 = make_uint4(0u, 0u, 0u, 0u);
  r.sc = make_uint2(0u, 0u);
  if (a != nullptr) {
    r.u0 = ldg16(a + 16 * (M::kLo + c8));
    if (has_u1) r.u1 = ldg16(a + 16 * (M::kLo + 8 + c8));
    const uint8_t* sa = reinterpret_cast<const uint8_t*>(scl);
    if constexpr (F == Fmt::kV32) r.sc = ldg8(sa + 4 * (M::kLo / 8));
    else r.sc = ldg8(sa);
  }
}

/// Bytes one CTA's producers write into the peer's buffer for part PT of a block: 32 rows x the
/// part's dequantized units x 32 bytes (each thread stores every unit it owns, valid row or not).
template <Fmt F, int PT>
constexpr uint32_t kPeerPartBytes = 32u * 32u *
    static_cast<uint32_t>((PT == 0 ? 16 : PartMap<F, 1>::kNopeUnits - 16));

/// part_store for one row into this CTA's buffer (sKx) and the peer's (r_sKx_u: shared::cluster
/// address of the same offset; r_full: the peer's full barrier of the part).
template <Fmt F, int PT>
__device__ __forceinline__ void part_store1_cluster(const PartRegs1& r, int row, int c8, uint8_t* sKx,
                                                    uint32_t r_sKx_u, uint32_t r_full) {
  using M = PartMap<F, PT>;
  const bool has_u1 = M::kLo + 8 + c8 < M::kNopeUnits;
  auto put = [&](uint32_t off, uint4 v) {
    *reinterpret_cast<uint4*>(sKx + off) = v;
    cl::st16_async(r_sKx_u + off, v, r_full);
  };
  const int ua = M::kLo + c8, ub = M::kLo + 8 + c8;
  const __nv_bfloat162 sa = unit_scale<F>(r.sc, 0, ua);
  put(slab_off(row, 2 * ua), dequant8(make_uint2(r.u0.x, r.u0.y), sa));
  put(slab_off(row, 2 * ua + 1), dequant8(make_uint2(r.u0.z, r.u0.w), sa));
  if (has_u1) {
    const __nv_bfloat162 sb = unit_scale<F>(r.sc, 1, ub);
    put(slab_off(row, 2 * ub), dequant8(make_uint2(r.u1.x, r.u1.y), sb));
    put(slab_off(row, 2 * ub + 1), dequant8(make_uint2(r.u1.z, r.u1.w), sb));
  }
}

constexpr int kSmemQ = kTileBytes;
constexpr int kSmemK = kTileBytes;
constexpr int kSmemRed = 4 * 64 * 4;  // sM[64], sL[64], sScale[2][64]
constexpr int kSmemValid = 2 * kBlockN;
constexpr int kSmemBar = 8 * 8;  // full[buffer][part], free[buffer][part]
constexpr int kSmemAddr = 2 * 2 * 64 * 8;  // producers' address table: [block parity][record / scale][row]
constexpr int kSmemBytes =
    1024 /*alignment slack*/ + kSmemQ + 2 * kSmemK + kSmemRed + kSmemValid + kSmemBar + kSmemAddr;
static_assert(kSmemBytes <= 232448, "shared memory");

enum : int { kBarP0 = 1, kBarP1 = 2, kBarConsumers = 3, kBarProducer = 4 };

template <Fmt F, bool kCluster>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_splitkv_mla_fp8_sparse_kernel_v4(const SparseDecodeKernelParams p) {
  constexpr int kD = FmtCfg<F>::kDQK;
  constexpr int kSlabs = kD / 64;  // 9 or 8
  constexpr int kChunks = kD / 8;  // 72 or 64
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t base_u;
  uint8_t* base = smem_align_1024(smem_raw, base_u);
  const uint32_t sQ_u = base_u;
  const uint32_t sK_u = sQ_u + kSmemQ;
  uint8_t* sK = base + kSmemQ;
  float* sRed = reinterpret_cast<float*>(base + kSmemQ + 2 * kSmemK);
  float* sM = sRed;
  float* sL = sRed + 64;
  float* sScale = sRed + 128;  // [buffer][64]
  uint8_t* sValid = reinterpret_cast<uint8_t*>(sRed + 4 * 64);  // [buffer][64]
  const uint32_t bar_u = sK_u + 2 * kSmemK + kSmemRed + kSmemValid;
  uint64_t* sAddr = reinterpret_cast<uint64_t*>(base + kSmemQ + 2 * kSmemK + kSmemRed + kSmemValid + kSmemBar);
  auto bar_full = [&](int buf, int part) { return bar_u + 8u * static_cast<uint32_t>(2 * buf + part); };
  auto bar_free = [&](int buf, int part) { return bar_u + 8u * static_cast<uint32_t>(4 + 2 * buf + part); };

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
    // full: 256 plain + 256 cp.async noinc producer arrivals; free: the part's consumer warpgroup.
#pragma unroll
    for (int i = 0; i < 4; ++i) mbar_init(bar_u + 8 * i, 2 * kProducers);
#pragma unroll
    for (int i = 4; i < 8; ++i) mbar_init(bar_u + 8 * i, kCluster ? 256 : 128);
    fence_barrier_init();
  }
  if constexpr (kCluster) cl::sync();  // both CTAs' barriers initialised before any remote arrival
  else __syncthreads();
  // Cluster variant: this CTA's rank and the peer's barriers (shared::cluster addresses).
  const uint32_t rank = kCluster ? cl::rank() : 0u;
  const uint32_t r_bar_u = kCluster ? cl::mapa(bar_u, rank ^ 1u) : 0u;
  auto r_bar_full = [&](int buf, int part) { return r_bar_u + 8u * static_cast<uint32_t>(2 * buf + part); };
  auto r_bar_free = [&](int buf, int part) { return r_bar_u + 8u * static_cast<uint32_t>(4 + 2 * buf + part); };
  // Waits on full barriers (cluster: acquire at cluster scope, the peer's producers write here too).
  auto full_wait = [&](uint32_t bar, uint32_t parity) {
    if constexpr (kCluster) cl::wait(bar, parity);
    else mbar_wait(bar, parity);
  };

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
    // ============================ producer warpgroups ============================
    setmaxnreg_dec<kProdRegs>();
    const int t = tid - kConsumers;
    const int half = t >> 7, rg = (t & 127) >> 3, c8 = t & 7;
    const int row[2] = {rg + 32 * half, rg + 32 * half + 16};  // this thread's rows of every block
    const int a_row = t & 63;                                    // address table entry (threads t < 64)
    // Look-ahead: (nreq, nb) is the block whose address table is written next, one block ahead of the fills.
    int nreq = begin_req, nb = 0;
    ReqInfo nri = req_info(begin_req);
    auto skip_empty = [&]() {
      while (nreq <= end_req && nb >= nri.n_blk) {
        ++nreq;
        nb = 0;
        if (nreq <= end_req) nri = req_info(nreq);
      }
    };
    auto load_index = [&]() {  // this thread's slot of block (nreq, nb): cache index, -1 if invalid
      int v = -1;
      const int blk = nri.blk_lo + nb;
      if (t < 64) {
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
    auto write_entry = [&](int v, int parity) {  // table entry + L2 prefetch of the record
      if (t < 64) {
        uint64_t rec = 0, scl = 0;
        if (v >= 0) {
          const bool is_extra = p.has_extra && nri.blk_lo + nb >= nri.n_main;
          row_addr<F>(is_extra ? p.extra : p.main, v, rec, scl);
          prefetch_l2_bulk(reinterpret_cast<const void*>(rec), PartMap<F, 0>::kRecBytes);
          if constexpr (F != Fmt::kV32) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(scl));
        }
        uint64_t* tab = sAddr + parity * 128;  // [rec / scale][row]
        tab[a_row] = rec;
        tab[64 + a_row] = scl;
      }
    };
    skip_empty();
    if (nreq <= end_req) {
      write_entry(load_index(), 0);
      named_barrier_sync(kBarProducer, kProducers);  // the first block's table is complete
      for (int g = 0;; ++g) {
        ++nb;
        skip_empty();
        const bool more = nreq <= end_req;
        const int v_next = more ? load_index() : -1;
        const uint64_t* tab = sAddr + (g & 1) * 128;
        // The rows' addresses are re-read from the table at each use (not held in registers
        // across the block: v4.1 did so and ran ~15% faster than holding them, bench/NOTES.md).
        auto cur = [&]() {
          RowAddr r;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            r.rec[i] = tab[row[i]];
            r.scl[i] = tab[64 + row[i]];
          }
          return r;
        };
        const int x = g & 1, use = g >> 1;
        uint8_t* sKx = sK + x * kSmemK;
        const uint32_t sKx_u = sK_u + static_cast<uint32_t>(x * kSmemK);
        // Both parts' FP8 bytes and scales are loaded before the first wait; the next block's
        // table goes into the slot of block g - 1, whose fills every producer finished before this
        // block's barrier.
        if constexpr (kCluster) {
          // One row (row[rank]) dequantized into both CTAs; the RoPE of both rows locally.
          const int my = rank != 0 ? row[1] : row[0];
          const uint32_t r_sKx_u = cl::mapa(sKx_u, rank ^ 1u);
          PartRegs1 ra, rb;
          part_load1<F, 0>(ra, tab[my], tab[64 + my], c8);
          part_load1<F, 1>(rb, tab[my], tab[64 + my], c8);
          if (use > 0) cl::wait(bar_free(x, 0), static_cast<uint32_t>((use - 1) & 1));
          part_store1_cluster<F, 0>(ra, my, c8, sKx, r_sKx_u, r_bar_full(x, 0));
          if (c8 == 0) {  // both rows' validity bytes, locally (the table holds every row)
            sValid[x * kBlockN + row[0]] = tab[row[0]] != 0 ? 1 : 0;
            sValid[x * kBlockN + row[1]] = tab[row[1]] != 0 ? 1 : 0;
          }
          gmma::fence_proxy_async();  // the local generic stores -> the consumers' wgmma
          mbar_arrive_cp_async(bar_full(x, 0));
          if (t == 0) cl::arrive_expect_tx(bar_full(x, 0), kPeerPartBytes<F, 0>);  // the peer's bytes
          else mbar_arrive(bar_full(x, 0));
          if (more) write_entry(v_next, (g + 1) & 1);
          if (use > 0) cl::wait(bar_free(x, 1), static_cast<uint32_t>((use - 1) & 1));
          part_rope<F>(cur(), row, c8, sKx_u, p.q);
          part_store1_cluster<F, 1>(rb, my, c8, sKx, r_sKx_u, r_bar_full(x, 1));
          gmma::fence_proxy_async();
          mbar_arrive_cp_async(bar_full(x, 1));
          if (t == 0) cl::arrive_expect_tx(bar_full(x, 1), kPeerPartBytes<F, 1>);
          else mbar_arrive(bar_full(x, 1));
          if (!more) break;
          named_barrier_sync(kBarProducer, kProducers);  // the next block's table is complete
          continue;
        }
        PartRegs ra, rb;
        part_load<F, 0>(ra, cur(), c8);
        part_load<F, 1>(rb, cur(), c8);
        if (use > 0) mbar_wait(bar_free(x, 0), static_cast<uint32_t>((use - 1) & 1));
        part_store<F, 0>(ra, cur(), row, c8, sKx, sValid + x * kBlockN);
        gmma::fence_proxy_async();  // generic-proxy stores -> the consumers' wgmma (async proxy)
        mbar_arrive_cp_async(bar_full(x, 0));
        mbar_arrive(bar_full(x, 0));
        if (more) write_entry(v_next, (g + 1) & 1);
        if (use > 0) mbar_wait(bar_free(x, 1), static_cast<uint32_t>((use - 1) & 1));
        part_rope<F>(cur(), row, c8, sKx_u, p.q);
        part_store<F, 1>(rb, cur(), row, c8, sKx, sValid + x * kBlockN);
        gmma::fence_proxy_async();
        mbar_arrive_cp_async(bar_full(x, 1));
        mbar_arrive(bar_full(x, 1));
        if (!more) break;
        named_barrier_sync(kBarProducer, kProducers);  // the next block's table is complete
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if constexpr (kCluster) cl::sync();  // the peer may still write / arrive into this CTA
    return;
  }

  // ============================ consumer warpgroups ============================
  // Each consumer warpgroup runs its own copy of the request loop (kWg a constant), so that ptxas
  // compiles each under its own setmaxnreg budget.
  // Release a buffer part: this CTA's free barrier and, in a cluster, the peer's (whose producers
  // write half of this part's rows here).
  auto release = [&](int buf, int part) {
    mbar_arrive(bar_free(buf, part));
    if constexpr (kCluster) cl::arrive_remote(r_bar_free(buf, part));
  };
  auto consumer = [&](auto wg_c) {
  constexpr int kWg = decltype(wg_c)::value;
  int row_local[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) row_local[hh] = wq * 16 + gq + 8 * hh;
  const uint64_t dq = gmma::make_desc_sw128(sQ_u, 16, 1024);
  int g = 0;  // the CTA's block counter (same sequence as the producers')

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
      named_barrier_sync(kBarConsumers, kConsumers);  // S of the previous request done, its sM / sL read
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

    if constexpr (kWg == 0) {
      // MODEL1 plain kernel (kSAhead): S of block g + 1 is issued right behind P V_L of block g
      // (same request), so the tensor pipe does not drain while this warpgroup waits for P V_L and
      // starts the next S; the wait for both comes at the top of the next step, which then
      // releases part A of block g. Everything else waits for P V_L at once. Measured on the H200
      // (bench/NOTES.md, sessions 6 and 7): the look-ahead spills ~1 KB; it ran 7% slower on V3.2
      // b128 (plain) and 24% slower under the cluster (V3.2 b128 502 -> 623 us), 3-4% faster on
      // MODEL1 config1 b128 (plain, 120 vs 123 us) but 18% slower on MODEL1 config2 b128 under
      // the cluster (338 vs 287 us).
      constexpr bool kSAhead = F == Fmt::kModel1 && !kCluster;
      float s[32];
      auto issue_s = [&](int gg) {
        const int xx = gg & 1;
        const uint32_t phh = static_cast<uint32_t>((gg >> 1) & 1);
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
        gmma::reg_fence(s);
        const uint64_t db = gmma::make_desc_sw128(sK_u + static_cast<uint32_t>(xx * kSmemK), 16, 1024);
        full_wait(bar_full(xx, 0), phh);
        gmma::fence_proxy_async();
        gmma::fence();
        s_chain<0, 4>(s, dq, db);
        full_wait(bar_full(xx, 1), phh);
        gmma::fence_proxy_async();
        gmma::fence();
        s_chain<4, kSlabs>(s, dq, db);
        gmma::commit();
      };
      if (kSAhead && n_blk > 0) issue_s(g);
      for (int j = 0; j < n_blk; ++j, ++g) {
        const int x = g & 1;
        const uint32_t sKx_u = sK_u + static_cast<uint32_t>(x * kSmemK);
        if (!kSAhead) issue_s(g);
        gmma::wait<0>();  // S of block g (kSAhead: and P V_L of block g - 1, issued before it)
        gmma::reg_fence(s);
        if (kSAhead) {
          gmma::reg_fence(o);
          if (j > 0) release(x ^ 1, 0);  // block g - 1's slabs 0-3 are free
        }

        float mx[2] = {-INFINITY, -INFINITY};
        mask_rowmax(s, sValid + x * kBlockN, p.scale_log2, tq, mx);
        float mu[2], sc[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float m_new = fmaxf(m_run[hh], mx[hh]);
          mu[hh] = m_new == -INFINITY ? 0.f : m_new;
          sc[hh] = exp2f(m_run[hh] - mu[hh]);
          m_run[hh] = m_new;
          if (tq == 0) sScale[x * 64 + row_local[hh]] = sc[hh];
        }
        float rs[2] = {0.f, 0.f};
        uint32_t a[4][4];
        uint8_t* sP = sK + x * kSmemK + 8 * kSlabBytes;  // slab 8: S is done with it
        exp_pack_store_p(s, mu, rs, a, sP, row_local, tq);
        gmma::fence_proxy_async();  // P (generic stores) -> warpgroup 1's wgmma
        bar_arrive(kBarP0 + x, kConsumers);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] = l_run[hh] * sc[hh] + rs[hh];
        scale_o(o, sc);
        gmma::reg_fence(o);
        gmma::fence();
        pv_rs_chain_n128(o, a, gmma::make_desc_sw128(sKx_u, kSlabBytes, 1024));
        gmma::commit();
        if (kSAhead) {
          if (j + 1 < n_blk) issue_s(g + 1);
        } else {
          gmma::wait<0>();
          gmma::reg_fence(o);
          release(x, 0);  // slabs 0-3 of the buffer are free
        }
      }
      if (kSAhead && n_blk > 0) {
        gmma::wait<0>();
        gmma::reg_fence(o);
        release((g - 1) & 1, 0);  // the request's last block's slabs 0-3 are free
      }
    } else {
      for (int j = 0; j < n_blk; ++j, ++g) {
        const int x = g & 1;
        const uint32_t ph = static_cast<uint32_t>((g >> 1) & 1);
        const uint32_t sKx_u = sK_u + static_cast<uint32_t>(x * kSmemK);
        named_barrier_sync(kBarP0 + x, kConsumers);  // P and the rescale factors of block g
        float sc[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) sc[hh] = sScale[x * 64 + row_local[hh]];
        scale_o(o, sc);
        full_wait(bar_full(x, 1), ph);  // completed (warpgroup 0 waited for it); orders the producers' writes
        gmma::fence_proxy_async();
        gmma::reg_fence(o);
        gmma::fence();
        pv_ss_chain_n128(o, gmma::make_desc_sw128(sKx_u + 8 * kSlabBytes, 16, 1024),
                         gmma::make_desc_sw128(sKx_u + 4 * kSlabBytes, kSlabBytes, 1024));
        gmma::commit();
        gmma::wait<0>();
        gmma::reg_fence(o);
        release(x, 1);  // slabs 4-8 of the buffer are free
      }
    }

    // ---- epilogue: warpgroup 0 holds the rows' m and l; warpgroup 1 reads them from shared memory
    float L[2] = {0.f, 0.f};
    if (n_blk > 0) {
      if constexpr (kWg == 0) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 1);
          l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 2);
          if (tq == 0) {
            sL[row_local[hh]] = l_run[hh];
            sM[row_local[hh]] = m_run[hh];
          }
        }
      }
      named_barrier_sync(kBarConsumers, kConsumers);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        L[hh] = sL[row_local[hh]];
        m_run[hh] = sM[row_local[hh]];
      }
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
          const int col = kWg * 256 + jj * 8 + 2 * tq;
          *reinterpret_cast<uint32_t*>(out + col) =
              HalfTraits<__nv_bfloat16>::pack(o[4 * jj + 2 * hh] * inv, o[4 * jj + 2 * hh + 1] * inv);
        }
        if (kWg == 0 && tq == 0)
          p.lse[req * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = empty ? INFINITY : lse2 * kLn2;
      } else {
        const float inv = empty ? 0.f : 1.f / L[hh];
        const int64_t arow = (static_cast<int64_t>(split_slot) * p.s_q + sq) * p.h_q + h;
        float* oa = p.o_accum + arow * kDimV;
#pragma unroll
        for (int jj = 0; jj < 32; ++jj) {
          const int col = kWg * 256 + jj * 8 + 2 * tq;
          *reinterpret_cast<float2*>(oa + col) = make_float2(o[4 * jj + 2 * hh] * inv, o[4 * jj + 2 * hh + 1] * inv);
        }
        if (kWg == 0 && tq == 0) p.lse_accum[arow] = lse2;
      }
    }
  }
  };
  if (wg == 0) {
    setmaxnreg_inc<kWg0Regs>();
    consumer(std::integral_constant<int, 0>{});
  } else {
    setmaxnreg_inc<kWg1Regs>();
    consumer(std::integral_constant<int, 1>{});
  }
  if constexpr (kCluster) cl::sync();  // the peer may still write / arrive into this CTA
}

/// v4 serves 64-row head tiles (h_q > 32) over 16-byte aligned caches; v1 / v2 the rest.
inline bool usable(const SparseDecodeKernelParams& kp) {
  return kp.h_q > 32 && kp.main.vec != 0 && (!kp.has_extra || kp.extra.vec != 0);
}

template <Fmt F, bool kCluster>
cudaError_t launch_k(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  auto kernel = flash_fwd_splitkv_mla_fp8_sparse_kernel_v4<F, kCluster>;
  // The setmaxnreg split needs the launch's register pool (compiled registers x 512), else
  // setmaxnreg.inc would wait forever: refuse with cudaErrorInvalidConfiguration (the callers in
  // sparse_decode_v32.cu / sparse_decode_model1.cu then run v1).
  static const int regs = [] {
    cudaFuncAttributes a{};
    return cudaFuncGetAttributes(&a, flash_fwd_splitkv_mla_fp8_sparse_kernel_v4<F, kCluster>) == cudaSuccess
               ? a.numRegs
               : 0;
  }();
  if (regs * kThreads < 128 * kWg0Regs + 128 * kWg1Regs + kProducers * kProdRegs)
    return cudaErrorInvalidConfiguration;
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
    attr[0].val.clusterDim.x = 2;  // the two head tiles of a (query token, partition)
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, kp);
  }
}

/// Clusters of 2 CTAs of the cluster variant the current device keeps resident at once (0 if
/// unknown).
template <Fmt F>
int max_active_clusters() {
  static int cache[64] = {};
  static bool done[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (!done[dev]) {
    auto kernel = flash_fwd_splitkv_mla_fp8_sparse_kernel_v4<F, true>;
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

/// The default for the 2-CTA cluster variant per format (FLASHMLA_SPARSE_DECODE_CLUSTER=0|1, read
/// per call, overrides it): on for both, see bench/NOTES.md "sparse FP8 decode v4, session 7"
/// (V3.2 b128 574 -> 503 us, MODEL1 config2 b128 372 -> 337 us on one H200).
template <Fmt F>
constexpr bool kClusterDefault = true;

/// v4 for a call: the cluster variant when the head tiles pair up (an even number of 64-head
/// tiles), it is on for the format, and the device keeps every cluster of the grid resident at
/// once (a second wave would cost more than the shared dequant saves); else the plain kernel.
template <Fmt F>
cudaError_t launch(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  bool on = kClusterDefault<F>;
  if (const char* env = std::getenv("FLASHMLA_SPARSE_DECODE_CLUSTER"); env != nullptr && env[0] != '\0')
    on = env[0] != '0';
  if (on && kp.num_head_tiles % 2 == 0) {
    const long long clusters = static_cast<long long>(kp.s_q) * kp.num_head_tiles / 2 * num_sm_parts;
    if (clusters <= max_active_clusters<F>()) return launch_k<F, true>(kp, num_sm_parts, stream);
  }
  return launch_k<F, false>(kp, num_sm_parts, stream);
}

}  // namespace flashmla::sm90::sparse::v4
