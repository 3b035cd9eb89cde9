// src/sm90/prefill/dense/bwd.cu — sm90 dense MHA prefill backward (the gradient of fwd.cu's
// out; the gradient through lse is not propagated, as FlashMLA): dq, dk, dv for d_qk in {128, 192},
// d_v 128, varlen, GQA (dk / dv summed over each kv head's query heads), causal, bf16 / fp16.
//
// Kernels on the caller's stream (both schedules, dense_prefill.h):
//  1. preprocess: per (query row, head) lse2 = lse * log2(e) (+inf for rows without a visible key,
//     so their P is 0) and D = rowsum(dout * out) in fp32, into the workspace, per (request, head) padded to a
//     multiple of 64 rows (padding: lse2 +inf, D 0);
//  2. dq: one CTA per (128 query rows, query head, request), the forward's structure: the
//     producer warpgroup streams K / V blocks of 64 keys; each consumer warpgroup (64 rows) computes S = Q K^T and
//     dP = dO V^T (wgmma, shared-memory operands), P = exp2(S scale log2e - lse2), dS = P (dP - D),
//     dQ += dS K (wgmma, dS from registers, K MN-major); dq = scale dQ;
//  3. dkdv: one CTA per (128 keys, kv head, request); K / V stay in shared memory, the producer streams (Q, dO,
//     lse2, D) blocks of 64 query rows over the group's query heads in order, then over the query blocks in order;
//     each consumer warpgroup (64 keys) computes S^T = K Q^T, dP^T = V dO^T, P^T, dS^T and dV += P^T dO,
//     dK += dS^T Q (wgmma, P^T / dS^T from registers, dO / Q MN-major); dk = scale dK.
// dq is computed from its own recomputation of S and dP (7 GEMMs per block pair instead of 5), so the backward is
// deterministic by construction: no atomics, every gradient element accumulated by one thread in a fixed order.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "sm90/common/host_utils.h"
#include "sm90/prefill/dense/common.cuh"
#include "sm90/prefill/dense/dense_prefill.h"
#include "sm90/sm90.h"

namespace flashmla::sm90 {
namespace dense_prefill {

constexpr int kBwdDV = 128;

// Within a consumer warpgroup, the exp2 / dS work of a plain step (any step but the checked ones below) runs while
// GEMMs of its own are on the tensor cores, not only where the other warpgroup's GEMMs happen to run (two-kernel
// schedule; docs/dense-prefill.md, "Backward: exp2 and dS under the warpgroup's own GEMMs"):
//  * dq kernel: S, dP and dQ += dS K of the previous key block are three commit groups; exp2 runs under dP and that
//    dQ, dS = P (dP - D) under that dQ, which is waited for (and its stage released) after dS.
//  * dk / dv kernel: dP^T is issued before dV += P^T dO, so dS^T runs under dV; at d_qk 128 also dK += dS^T Q of the
//    previous query block runs under the exp2 of S^T (d_qk 192: too few registers).
//  * end_block_after_all() before each of those waits, so ptxas does not schedule a wait above the work (as in the
//    forward, "Forward: softmax overlapping its own P V"); the masked / unmasked element loops chosen per block.
//  * the rings of the kernels that defer a GEMM get a third stage (Ring), so the late release of a block's stage
//    does not hold back the load of the block after next.
// The checked steps (the causal diagonal blocks, in the dk / dv kernel also a partial last query block: they also
// keep inf / NaN out of the rows and keys that do not see each other) wait for each wgmma batch right after issuing
// it. The overlap changes no GEMM, no order of the products added to an accumulator (block n - 1's before block n's)
// and no per-element operation, so dq, dk and dv have the bits of the order that waits for each batch at once, and
// stay deterministic.

/// acc = A B^T over kDim / 16 k-steps of m64n64k16, both operands K-major: A = the 64 rows whose first row's
/// descriptor is desc_a in a kRowsA-row tile, B = the first 64 rows of the kRowsB-row tile with descriptor desc_b.
/// k-step kK's descriptors are the base descriptors plus the byte offset of its 16 dims (64-dim slabs of kRows x 128
/// bytes, 32 bytes per k-step within a slab) >> 4, added inside the asm, as in issue_abt_off128. The first k-step
/// overwrites acc.
template <class T, int kDim, int kRowsA, int kRowsB, int kK = 0>
__device__ __forceinline__ void issue_abt_off64(float (&acc)[32], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (kK < kDim / 16) {
    constexpr int kOffA = ((kK >> 2) * (kRowsA * 128) + (kK & 3) * 32) >> 4;
    constexpr int kOffB = ((kK >> 2) * (kRowsB * 128) + (kK & 3) * 32) >> 4;
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      gmma::mma_m64n64k16_off_bf16<0, kOffA, kOffB, (kK > 0 ? 1 : 0)>(acc, desc_a, desc_b);
    else
      gmma::mma_m64n64k16_off_f16<0, kOffA, kOffB, (kK > 0 ? 1 : 0)>(acc, desc_a, desc_b);
    issue_abt_off64<T, kDim, kRowsA, kRowsB, kK + 1>(acc, desc_a, desc_b);
  }
}
/// acc = A B^T (m64n64k16, both operands K-major): A = the 64 rows from a_row0 of the kRowsA-row tile at a, B = the
/// first 64 rows of the kRowsB-row tile at b, through issue_abt_off64. A's row address is read from lane 0 so that
/// ptxas knows it is warp-uniform and keeps the descriptors on the uniform datapath, as the forward does
/// (WgmmaOff128): building both descriptors from addresses before each wgmma costs ~12 instructions, 2 of them R2UR.
/// Issues only: the caller fences before, commits and waits after.
template <class T, int kDim, int kRowsA, int kRowsB>
__device__ __forceinline__ void issue_abt64(float (&acc)[32], uint32_t a, int a_row0, uint32_t b) {
  const uint32_t a0 = __shfl_sync(0xFFFFFFFFu, a + a_row0 * 128, 0);  // warp-uniform for ptxas
  issue_abt_off64<T, kDim, kRowsA, kRowsB>(acc, gmma::make_desc_sw128(a0, 16, 1024),
                                           gmma::make_desc_sw128(b, 16, 1024));
}

/// Ends the basic block once every value of x is computed, so that the wgmma wait that follows stays
/// below all of that work. end_block_after() alone orders only the two values its branch tests: the rest could
/// still be computed after the wait (LLVM sinks them there). The register fence (an empty volatile asm that reads
/// and writes every element) keeps all of x before the wait's asm, and with it before the branch.
template <int N>
__device__ __forceinline__ void end_block_after_all(float (&x)[N]) {
  gmma::reg_fence(x);
  end_block_after(x[N - 2], x[N - 1]);
}
__device__ __forceinline__ void end_block_after_all(uint32_t (&x)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
  }
  end_block_after(__uint_as_float(x[3][2]), __uint_as_float(x[3][3]));
}

/// A step's deferred last GEMM, acc += A B over 4 k-steps (A fragments `a` in registers, B the
/// MN-major tile of kRowsB rows at shared address `b`), issued and waited, then the ring stage that held B
/// released on its empty barrier `empty`. The dq kernel defers dQ += dS K, the dk / dv kernel dK += dS^T Q.
template <class T, int kD, int kRowsB, int N>
__device__ __forceinline__ void finish_deferred_rs(float (&acc)[N], const uint32_t (&a)[4][4], uint32_t b,
                                                   uint32_t empty) {
  gmma::reg_fence(acc);
  gmma::fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) Wgmma<T, kD>::template rs<1>(acc, a[kk], desc_mn<kRowsB>(b, kk));
  gmma::commit_wait(acc);
  mbar_arrive(empty);
}

/// Streamed-tile ring of kStages stages: the stage of block n, the phase of its full barrier, the phase of its
/// stage's empty barrier to wait for before refilling it (n >= kStages). The rings whose consumer defers a block's
/// last GEMM (dq; dk / dv at d_qk 128) have three stages: their stage n - 1 is released only late in step n, so with
/// two stages block n + 1 could not start loading before step n had nearly finished. The others have two.
template <int kStages>
struct Ring {
  __device__ __forceinline__ static int stage(int n) {
    if constexpr (kStages == 2) return n & 1;
    else return static_cast<int>(static_cast<unsigned>(n) % kStages);
  }
  __device__ __forceinline__ static uint32_t full_phase(int n) {
    if constexpr (kStages == 2) return (n >> 1) & 1;
    else return (static_cast<unsigned>(n) / kStages) & 1;
  }
  __device__ __forceinline__ static uint32_t empty_phase(int n) {
    if constexpr (kStages == 2) return ((n >> 1) - 1) & 1;
    else return (static_cast<unsigned>(n) / kStages - 1) & 1;
  }
};
/// kStages pairs of full and empty (256 consumer arrivals) barriers, then the barrier of the tiles loaded once: full[s]
/// at bar + 8 s, empty[s] at bar + 8 (kStages + s), the last at bar + 16 kStages. Producer arrivals: 128 (cp.async
/// threads) or 1 (the TMA thread), `count` for both kinds.
template <int kStages>
__device__ __forceinline__ void init_ring_barriers(int tid, uint32_t bar, int count = 128) {
  if constexpr (kStages == 2) {
    init_barriers(tid, bar, {count, 256}, count);
  } else {
    if (tid == 0) {
      for (int s = 0; s < kStages; ++s) {
        mbar_init(bar + 8 * s, count);
        mbar_init(bar + 8 * (kStages + s), 256);
      }
      mbar_init(bar + 16 * kStages, count);
      fence_barrier_init();
    }
    __syncthreads();
  }
}
constexpr int kWsAlign = 64;  // workspace rows per (request, head): max_seqlen_qo rounded up to this

// ------------------------------------------------------------------------------------ preprocess
// 256 threads: 16 rows x 16 threads, each thread 8 of the 128 d_v elements.
template <class T>
__global__ void __launch_bounds__(256) dense_prefill_bwd_preprocess_kernel(const KernelParams p) {
  const int b = blockIdx.z, h = blockIdx.y;
  const SeqBounds sb = seq_bounds(p.cu_q, p.cu_k, p.cu_q_stride, p.cu_k_stride, b);
  const int row = blockIdx.x * 16 + (threadIdx.x >> 4), l16 = threadIdx.x & 15;
  if (row >= p.ws_rows) return;
  float dsum = 0.f, lse2 = INFINITY;
  if (row < sb.s_q) {
    const int64_t qi = static_cast<int64_t>(sb.q0) + row;
    const uint4 ov = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.out_in) + qi * p.o_row + h * p.o_head + l16 * 8);
    const uint4 dv = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + qi * p.do_row + h * p.do_head + l16 * 8);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int i = 0; i < 8; ++i) dsum += static_cast<float>(oe[i]) * static_cast<float>(de[i]);
    const float lse = p.lse[qi * p.lse_row + h * p.lse_head];
    lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) dsum += __shfl_xor_sync(0xffffffffu, dsum, o);
  if (l16 == 0) {
    const int64_t w = (static_cast<int64_t>(b) * p.h_q + h) * p.ws_rows + row;
    p.ws_lse2[w] = lse2;
    p.ws_dsum[w] = dsum;
  }
}

/// Bytes of a backward kernel's tiles (16-bit elements): Q (kD dims) and dO (kBwdDV) of kQRows query
/// rows, K (kD) and V (kBwdDV) of kKRows key rows.
template <int kD, int kQRows, int kKRows>
struct BwdTiles {
  static constexpr int kQ = kQRows * kD * 2, kDO = kQRows * kBwdDV * 2;
  static constexpr int kK = kKRows * kD * 2, kV = kKRows * kBwdDV * 2;
};

/// A backward CTA's (block, head, request) in a grid launched as (blocks, heads, requests). kByBlock: the linear
/// block index, the hardware's dispatch order, walks the blocks outermost (TileOrder::kByBlock, dense_prefill.h: with
/// equally long requests every (head, request)'s heaviest causal block is dispatched before any lighter one; the order
/// is by block index, not by work); else blockIdx as launched.
/// (bwd_with_schedule takes kByBlock only for grids of fewer than 2^31 CTAs.)
struct BwdCta {
  int blk, head, b;
};
template <bool kByBlock>
__device__ __forceinline__ BwdCta bwd_cta() {
  if constexpr (!kByBlock) {
    return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
  } else {
    const int heads = static_cast<int>(gridDim.y), per_block = heads * static_cast<int>(gridDim.z);
    const int lin = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
    const int rest = lin % per_block;
    return {lin / per_block, rest % heads, rest / heads};
  }
}

// ------------------------------------------------------------------------------------------- dq
constexpr int kDqBM = 128, kDqBN = 64;

template <int kD>
struct DqSmem : BwdTiles<kD, kDqBM, kDqBN> {
  using Tiles = BwdTiles<kD, kDqBM, kDqBN>;
  static constexpr int kStage = Tiles::kK + Tiles::kV;
  static constexpr int kScratch = 16 * kD * 2;  // per consumer warpgroup: 16 K rows without inf / NaN (rare path)
  static constexpr int kStages = 3;  // Ring: dQ += dS K is deferred
  static constexpr int kBars = (2 * kStages + 1) * 8;  // full[kStages], empty[kStages], q_full
  static constexpr int kBytes = 1024 + Tiles::kQ + Tiles::kDO + kStages * kStage + 2 * kScratch + kBars;
  static_assert(kBytes <= 232448, "shared memory");
};

/// kTma: every tile by TMA, one producer thread issuing: the CTA's Q / dO (tmap_q / tmap_do: (d, h_q, total_q), boxes
/// of 64 dims x 1 head x 128 rows) and the K / V blocks (tmap_k / tmap_v: (d, h_kv, total_k), 64-row boxes). K / V
/// rows past the request's end (the next request's) are zeroed by the consumers before their first use, so those
/// tiles hold what the cp.async loader writes; Q / dO rows past it need not be (a query row reaches only its own dq,
/// which is not stored, and its lse2 is +inf). Without kTma the maps are unused.
template <class T, int kD, bool kTma, bool kByBlock = false>
__global__ void __launch_bounds__(kThreads, 1)
    dense_prefill_bwd_dq_kernel(const KernelParams p, const __grid_constant__ CUtensorMap tmap_k,
                                const __grid_constant__ CUtensorMap tmap_v, const __grid_constant__ CUtensorMap tmap_q,
                                const __grid_constant__ CUtensorMap tmap_do) {
  using Smem = DqSmem<kD>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t base;
  smem_align_1024(smem_raw, base);
  const uint32_t sQ = base, sDO = base + Smem::kQ;
  const uint32_t sStage0 = sDO + Smem::kDO;
  using R = Ring<Smem::kStages>;
  const uint32_t sScratch = sStage0 + Smem::kStages * Smem::kStage;  // + wg * kScratch
  const uint32_t bar = sScratch + 2 * Smem::kScratch;
  auto full_bar = [&](int s) { return bar + 8 * s; };
  auto empty_bar = [&](int s) { return bar + 8 * Smem::kStages + 8 * s; };
  const uint32_t q_bar = bar + 16 * Smem::kStages;

  const BwdCta cta = bwd_cta<kByBlock>();
  const int b = cta.b, h = cta.head;
  const SeqBounds sb = seq_bounds(p.cu_q, p.cu_k, p.cu_q_stride, p.cu_k_stride, b);
  // The query block, counted from the end when causal (the last blocks see the most keys), as query_block_row0 counts
  // blockIdx.x.
  const int m0 = kByBlock ? (p.causal ? static_cast<int>(gridDim.x) - 1 - cta.blk : cta.blk) * kDqBM
                          : query_block_row0<kDqBM>(p);
  if (m0 >= sb.s_q) return;
  const int off = sb.s_k - sb.s_q;
  const int n_blocks = (visible_key_end<kDqBM>(p, sb.s_k, m0, off) + kDqBN - 1) / kDqBN;
  const int hk = h / p.group;

  const int tid = threadIdx.x;
  init_ring_barriers<Smem::kStages>(tid, bar, kTma ? 1 : 128);  // full[], empty[], q_bar

  if (tid >= 256) {  // ---------------------------------------------------------------- producer
    setmaxnreg_dec<kProducerRegs>();
    const int pt = tid - 256;
    const int64_t qi0 = static_cast<int64_t>(sb.q0) + m0;
    if constexpr (kTma) {
      if (pt == 0) {
        mbar_arrive_expect_tx(q_bar, Smem::kQ + Smem::kDO);
        tma_load_tile<kDqBM, kD>(sQ, &tmap_q, q_bar, h, sb.q0 + m0);
        tma_load_tile<kDqBM, kBwdDV>(sDO, &tmap_do, q_bar, h, sb.q0 + m0);
        for (int n = 0; n < n_blocks; ++n) {
          const int stage = R::stage(n), row = sb.k0 + n * kDqBN;
          if (n >= Smem::kStages) mbar_wait(empty_bar(stage), R::empty_phase(n));
          const uint32_t sK = sStage0 + stage * Smem::kStage;
          mbar_arrive_expect_tx(full_bar(stage), Smem::kK + Smem::kV);
          tma_load_tile<kDqBN, kD>(sK, &tmap_k, full_bar(stage), hk, row);
          tma_load_tile<kDqBN, kBwdDV>(sK + Smem::kK, &tmap_v, full_bar(stage), hk, row);
        }
      }
      return;
    }
    load_tile<T, kDqBM, kD>(sQ, static_cast<const T*>(p.q) + qi0 * p.q_row + h * p.q_head, p.q_row, sb.s_q - m0, pt);
    load_tile<T, kDqBM, kBwdDV>(sDO, static_cast<const T*>(p.dout) + qi0 * p.do_row + h * p.do_head, p.do_row,
                                sb.s_q - m0, pt);
    mbar_arrive_cp_async(q_bar);
    const T* k = static_cast<const T*>(p.k) + static_cast<int64_t>(sb.k0) * p.k_row + hk * p.k_head;
    const T* v = static_cast<const T*>(p.v) + static_cast<int64_t>(sb.k0) * p.v_row + hk * p.v_head;
    for (int n = 0; n < n_blocks; ++n) {
      const int stage = R::stage(n);
      if (n >= Smem::kStages) mbar_wait(empty_bar(stage), R::empty_phase(n));
      const uint32_t sK = sStage0 + stage * Smem::kStage;
      const int64_t r0 = static_cast<int64_t>(n) * kDqBN;
      load_tile<T, kDqBN, kD>(sK, k + r0 * p.k_row, p.k_row, sb.s_k - n * kDqBN, pt);
      load_tile<T, kDqBN, kBwdDV>(sK + Smem::kK, v + r0 * p.v_row, p.v_row, sb.s_k - n * kDqBN, pt);
      mbar_arrive_cp_async(full_bar(stage));
    }
    cp_async_wait<0>();
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<kConsumerRegs>();
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  int row[2];
  row[0] = m0 + wg * 64 + warp * 16 + g;
  row[1] = row[0] + 8;
  float lse2[2], dsum[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int64_t w = (static_cast<int64_t>(b) * p.h_q + h) * p.ws_rows + row[e];
    lse2[e] = row[e] < sb.s_q ? p.ws_lse2[w] : INFINITY;
    dsum[e] = row[e] < sb.s_q ? p.ws_dsum[w] : 0.f;
  }

  float dq[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) dq[i] = 0.f;

  // Causal: keys from masked_lo on are not seen by some row of this CTA; the key blocks from check_first on (at
  // most three) are "checked": their step (kChecked) also keeps inf / NaN of masked keys (in v: dP; in k: S, and
  // dS K) out of the rows that do not see them. The body is one; the other steps run the plain instantiation,
  // which has no rare branch.
  const int masked_lo = max(m0 + off + 1, 0);
  const int check_first = p.causal && masked_lo < sb.s_k ? masked_lo / kDqBN : n_blocks;
  // The plain step leaves its dQ += dS K pending (A fragments a_prev, K tile sk_prev of stage stage_prev); the next
  // plain step (kPrev) issues it after its S and dP, finish_pending() otherwise. Whether a step has one pending is a
  // compile-time property of the call: a wgmma issued under a run-time condition on accumulators still in flight at
  // the join makes ptxas insert warpgroup.arrive and serialize (C7519 / C7520).
  uint32_t a_prev[4][4];
  uint32_t sk_prev = 0;
  int stage_prev = 0;
  auto finish_pending = [&]() {
    finish_deferred_rs<T, kD, kDqBN>(dq, a_prev, sk_prev, empty_bar(stage_prev));
  };
  auto step = [&](int n, auto checked, auto prev) {
    constexpr bool kChecked = decltype(checked)::value;
    [[maybe_unused]] constexpr bool kPrev = decltype(prev)::value;  // the previous block's dQ is pending
    const int stage = R::stage(n);
    const uint32_t sK = sStage0 + stage * Smem::kStage;
    const uint32_t sV = sK + Smem::kK;
    mbar_wait(full_bar(stage), R::full_phase(n));
    const int n0 = n * kDqBN;
    if constexpr (kTma) {
      if (n0 + kDqBN > sb.s_k) {  // the request's last block: its rows past s_k are the next request's
        const int r0 = sb.s_k - n0;
        zero_tile_rows<kDqBN, kD>(smem_ptr(sK), r0, tid & 127, 128);
        zero_tile_rows<kDqBN, kBwdDV>(smem_ptr(sV), r0, tid & 127, 128);
        gmma::fence_proxy_async();
        named_barrier_sync(4 + wg, 128);
      }
    }
    gmma::fence_proxy_async();

    float s[32], dp[32];
    bool nonfinite = false;
    gmma::fence();
    if constexpr (!kChecked) {
      // S, dP and (kPrev) the previous block's dQ += dS K, each its own group: P = exp2(S scale log2e - lse2) runs
      // while dP and that dQ are in flight, dS = P (dP - D) while that dQ is. The masked and the unmasked form
      // chosen per block.
      issue_abt64<T, kD, kDqBM, kDqBN>(s, sQ, wg * 64, sK);  // S = Q K^T
      gmma::commit();
      issue_abt64<T, kBwdDV, kDqBM, kDqBN>(dp, sDO, wg * 64, sV);  // dP = dO V^T
      gmma::commit();
      if constexpr (kPrev) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wgmma<T, kD>::template rs<1>(dq, a_prev[kk], desc_mn<kDqBN>(sk_prev, kk));
        gmma::commit();
        gmma::wait<2>();
      } else {
        gmma::wait<1>();
      }
      gmma::reg_fence(s);
      auto p_block = [&](auto masked) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            float pr = exp2f(s[4 * i + e] * p.scale_log2 - lse2[r]);
            if constexpr (decltype(masked)::value) {
              const int col = n0 + 8 * i + 2 * tq + (e & 1);
              const bool vis = col < sb.s_k && (!p.causal || col <= row[r] + off);
              pr = vis ? pr : 0.f;
            }
            s[4 * i + e] = pr;
          }
        }
      };
      if (n0 + kDqBN > sb.s_k || (p.causal && n0 + kDqBN - 1 > m0 + off))
        p_block(std::true_type{});
      else
        p_block(std::false_type{});
      end_block_after_all(s);  // the wait for dP stays below the exp2 stage
      if constexpr (kPrev)
        gmma::wait<1>();
      else
        gmma::wait<0>();
      gmma::reg_fence(dp);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * i + e] = s[4 * i + e] * (dp[4 * i + e] - dsum[e >> 1]);  // dS
      }
    } else {
      issue_abt64<T, kD, kDqBM, kDqBN>(s, sQ, wg * 64, sK);         // S = Q K^T
      issue_abt64<T, kBwdDV, kDqBM, kDqBN>(dp, sDO, wg * 64, sV);  // dP = dO V^T
      gmma::commit_wait(s);
      gmma::reg_fence(dp);
      // A key that a row does not see gets dS = 0 with dP's sign (the bits of P (dP - D) with P = 0), also
      // where its v makes dP inf / NaN. nonfinite: some masked S is inf / NaN, which a key with inf / NaN in k
      // makes of every row's S (0 * inf included).
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float sv = s[4 * i + e];
          const float dd = dp[4 * i + e] - dsum[r];
          float ds = exp2f(sv * p.scale_log2 - lse2[r]) * dd;  // dS = P (dP - D)
          const int col = n0 + 8 * i + 2 * tq + (e & 1);
          if (!(col < sb.s_k && col <= row[r] + off)) {
            ds = copysignf(0.f, dd);
            nonfinite |= col < sb.s_k && float_is_nonfinite(sv);
          }
          s[4 * i + e] = ds;
        }
      }
    }
    if constexpr (kPrev) {
      // The previous block's dQ has run under this block's dS: wait for it here, not above the dS work. dS is packed
      // after the wait (reg_fence orders it): packed before, its registers would be a_prev's (the loop carries them),
      // written while the wgmma that reads a_prev is in flight, and ptxas would serialize every wgmma (C7513).
      end_block_after_all(s);
      gmma::wait<0>();
      gmma::reg_fence(dq);
      gmma::reg_fence(s);
      mbar_arrive(empty_bar(stage_prev));
    }
    uint32_t a[4][4];
    pack_a<T, 64>(s, a);
    if constexpr (!kChecked) {  // leave this block's dQ += dS K to the next step
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int j = 0; j < 4; ++j) a_prev[kk][j] = a[kk][j];
      }
      sk_prev = sK;
      stage_prev = stage;
      return;
    }
    // Checked: keys [wg_lo, wg_hi) of the block are not seen by some row of this warpgroup. Where one of their k
    // rows holds inf / NaN (found by the warpgroup: bar.red.or), dS K reads their k-steps from a copy without it
    // and the rows that see such a key add its products (k from global memory) afterwards.
    uint32_t ks = 0;
    const int wg_lo = max(m0 + wg * 64 + off + 1 - n0, 0), wg_hi = min(sb.s_k - n0, kDqBN);
    if (wg_lo < wg_hi && bar_red_or(4 + wg, 128, nonfinite)) ks = ksteps_in(wg_lo, wg_hi);
    gmma::reg_fence(dq);
    if (ks == 0) {
      gmma::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Wgmma<T, kD>::template rs<1>(dq, a[kk], desc_mn<kDqBN>(sK, kk));
      gmma::commit_wait(dq);
    } else {
      mma_b_finite<T, kDqBN, kD, 4>(dq, a, sK, sScratch + wg * Smem::kScratch, ks, 4 + wg, tid & 127);
      const T* kg = static_cast<const T*>(p.k) + (static_cast<int64_t>(sb.k0) + n0) * p.k_row + hk * p.k_head;
      auto brow = [&](int c) { return kg + c * p.k_row; };
      auto visible = [&](int c, int e) { return n0 + c <= row[e] + off; };  // rows < wg_hi <= s_k - n0
      // Every row of the k-steps read from the copy (from wg_lo's k-step on) had its inf / NaN zeroed there.
      add_nonfinite_products<T, kD, 4>(dq, a, row_bits(wg_lo & ~15, wg_hi), brow, visible, lane);
    }
    mbar_arrive(empty_bar(stage));
  };
  mbar_wait(q_bar, 0);
  const int n_plain = min(check_first, n_blocks);
  if (n_plain > 0) {
    step(0, std::false_type{}, std::false_type{});
    for (int n = 1; n < n_plain; ++n) step(n, std::false_type{}, std::true_type{});
    finish_pending();  // the last plain block's dQ += dS K
  }
  for (int n = check_first; n < n_blocks; ++n) step(n, std::true_type{}, std::false_type{});

  T* dqp = static_cast<T*>(p.dq);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (row[e] >= sb.s_q) continue;
    T* r = dqp + (static_cast<int64_t>(sb.q0) + row[e]) * p.dq_row + h * p.dq_head;
#pragma unroll
    for (int i = 0; i < kD / 8; ++i)
      *reinterpret_cast<uint32_t*>(r + 8 * i + 2 * tq) =
          HalfTraits<T>::pack(dq[4 * i + 2 * e] * p.scale, dq[4 * i + 2 * e + 1] * p.scale);
  }
}

// ----------------------------------------------------------------------------------------- dkdv
constexpr int kKvBN = 128, kKvBM = 64;

/// dk / dv kernel: dK += dS^T Q of a query block is deferred into the next step at d_qk 128 (not at 192: registers),
/// and that ring gets a third stage (Ring).
template <int kD>
constexpr bool kv_defers_dk() {
  return kD == 128;
}
template <int kD>
struct KvSmem : BwdTiles<kD, kKvBM, kKvBN> {
  using Tiles = BwdTiles<kD, kKvBM, kKvBN>;
  static constexpr int kStages = kv_defers_dk<kD>() ? 3 : 2;  // Ring
  static constexpr int kVec = 2 * kKvBM * 4;  // lse2[64], D[64]
  static constexpr int kStage = Tiles::kQ + Tiles::kDO + kVec;
  static constexpr int kBars = (2 * kStages + 1) * 8;  // full[kStages], empty[kStages], kv_full
  static_assert(kStage % 1024 == 512 || kStage % 1024 == 0, "stage size");
  static constexpr int kStageAligned = (kStage + 1023) / 1024 * 1024;  // tiles stay 1024-aligned
  // Per consumer warpgroup, 16 rows of a B operand without inf / NaN (mma_b_finite, rare path of the checked steps),
  // both in a 16 KB region (more than the 2 x 4 / 6 KB they need: the layout the kernels were measured with).
  static constexpr int kScratch = 16 * kD * 2;
  static constexpr int kScratchRegion = 16 * 1024;
  static_assert(2 * kScratch <= kScratchRegion, "scratch");
  static constexpr int kBytesAligned = 1024 + Tiles::kK + Tiles::kV + kStages * kStageAligned + kScratchRegion + kBars;
  static_assert(kBytesAligned <= 232448, "shared memory");
};

/// kTma: every tile by TMA, one producer thread issuing: the CTA's K / V (tmap_k / tmap_v:
/// (d, h_kv, total_k), boxes of 64 dims x 1 head x 128 rows), the streamed Q and dO blocks (tmap_q / tmap_do:
/// (d, h_q, total_q), 64-row boxes) and their lse2 / D rows by two 256-byte bulk copies. Q / dO rows past the
/// request's end (the next request's) are zeroed by the consumers before their first use, so those tiles hold what the
/// cp.async loader writes; K / V rows past it need not be (a key row reaches only its own dk / dv, which are not
/// stored). Without kTma the maps are unused.
template <class T, int kD, bool kTma, bool kByBlock = false>
__global__ void __launch_bounds__(kThreads, 1)
    dense_prefill_bwd_dkdv_kernel(const KernelParams p, const __grid_constant__ CUtensorMap tmap_q,
                                  const __grid_constant__ CUtensorMap tmap_do, const __grid_constant__ CUtensorMap tmap_k,
                                  const __grid_constant__ CUtensorMap tmap_v) {
  using Smem = KvSmem<kD>;
  using R = Ring<Smem::kStages>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t base;
  uint8_t* smem = smem_align_1024(smem_raw, base);
  const uint32_t sK = base, sV = base + Smem::kK;
  const uint32_t sStage0 = sV + Smem::kV;
  const uint32_t sScratch = sStage0 + Smem::kStages * Smem::kStageAligned;
  const uint32_t bar = sScratch + Smem::kScratchRegion;
  auto full_bar = [&](int s) { return bar + 8 * s; };
  auto empty_bar = [&](int s) { return bar + 8 * Smem::kStages + 8 * s; };
  const uint32_t kv_bar = bar + 16 * Smem::kStages;

  const BwdCta cta = bwd_cta<kByBlock>();
  const int b = cta.b, hk = cta.head;
  const SeqBounds sb = seq_bounds(p.cu_q, p.cu_k, p.cu_q_stride, p.cu_k_stride, b);
  const int n0 = kByBlock ? cta.blk * kKvBN : blockIdx.x * kKvBN;
  if (n0 >= sb.s_k) return;
  const int off = sb.s_k - sb.s_q;
  // Query i sees key j iff j <= i + off: the first query block that sees key n0.
  const int m_begin = p.causal ? min(max(n0 - off, 0), sb.s_q) / kKvBM : 0;
  const int m_end = (sb.s_q + kKvBM - 1) / kKvBM;
  const int m_count = max(m_end - m_begin, 0);
  const int n_it = p.group * m_count;

  const int tid = threadIdx.x;
  init_ring_barriers<Smem::kStages>(tid, bar, kTma ? 1 : 128);  // full[], empty[], kv_bar

  if (tid >= 256) {  // ---------------------------------------------------------------- producer
    setmaxnreg_dec<kProducerRegs>();
    const int pt = tid - 256;
    const int64_t kr0 = static_cast<int64_t>(sb.k0) + n0;
    if constexpr (kTma) {
      if (pt == 0) {
        mbar_arrive_expect_tx(kv_bar, Smem::kK + Smem::kV);
        tma_load_tile<kKvBN, kD>(sK, &tmap_k, kv_bar, hk, sb.k0 + n0);
        tma_load_tile<kKvBN, kBwdDV>(sV, &tmap_v, kv_bar, hk, sb.k0 + n0);
        for (int it = 0; it < n_it; ++it) {
          const int stage = R::stage(it);
          if (it >= Smem::kStages) mbar_wait(empty_bar(stage), R::empty_phase(it));
          const int hq = hk * p.group + it / m_count;
          const int m0 = (m_begin + it % m_count) * kKvBM;
          const uint32_t sQ = sStage0 + stage * Smem::kStageAligned, full = full_bar(stage);
          const int row = sb.q0 + m0;
          mbar_arrive_expect_tx(full, Smem::kQ + Smem::kDO + Smem::kVec);
          tma_load_tile<kKvBM, kD>(sQ, &tmap_q, full, hq, row);
          tma_load_tile<kKvBM, kBwdDV>(sQ + Smem::kQ, &tmap_do, full, hq, row);
          const int64_t w = (static_cast<int64_t>(b) * p.h_q + hq) * p.ws_rows + m0;  // lse2[64] then D[64]
          bulk_load(sQ + Smem::kQ + Smem::kDO, p.ws_lse2 + w, Smem::kVec / 2, full);
          bulk_load(sQ + Smem::kQ + Smem::kDO + Smem::kVec / 2, p.ws_dsum + w, Smem::kVec / 2, full);
        }
      }
      return;
    }
    load_tile<T, kKvBN, kD>(sK, static_cast<const T*>(p.k) + kr0 * p.k_row + hk * p.k_head, p.k_row, sb.s_k - n0, pt);
    load_tile<T, kKvBN, kBwdDV>(sV, static_cast<const T*>(p.v) + kr0 * p.v_row + hk * p.v_head, p.v_row, sb.s_k - n0,
                                pt);
    mbar_arrive_cp_async(kv_bar);
    for (int it = 0; it < n_it; ++it) {
      const int stage = R::stage(it);
      if (it >= Smem::kStages) mbar_wait(empty_bar(stage), R::empty_phase(it));
      const int hq = hk * p.group + it / m_count;
      const int m0 = (m_begin + it % m_count) * kKvBM;
      const uint32_t sQ = sStage0 + stage * Smem::kStageAligned;
      const int64_t qi0 = static_cast<int64_t>(sb.q0) + m0;
      load_tile<T, kKvBM, kD>(sQ, static_cast<const T*>(p.q) + qi0 * p.q_row + hq * p.q_head, p.q_row, sb.s_q - m0, pt);
      load_tile<T, kKvBM, kBwdDV>(sQ + Smem::kQ, static_cast<const T*>(p.dout) + qi0 * p.do_row + hq * p.do_head,
                                  p.do_row, sb.s_q - m0, pt);
      if (pt < 32) {  // lse2[64] then D[64]: 16 + 16 chunks of 16 bytes
        const int64_t w = (static_cast<int64_t>(b) * p.h_q + hq) * p.ws_rows + m0 + (pt & 15) * 4;
        const float* src = (pt < 16 ? p.ws_lse2 : p.ws_dsum) + w;
        cp_async_16(sQ + Smem::kQ + Smem::kDO + pt * 16, src, true);
      }
      mbar_arrive_cp_async(full_bar(stage));
    }
    cp_async_wait<0>();
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<kConsumerRegs>();
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  int krow[2];  // this thread's two keys (request-local)
  krow[0] = n0 + wg * 64 + warp * 16 + g;
  krow[1] = krow[0] + 8;

  float dk[kD / 2], dv[kBwdDV / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) dk[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kBwdDV / 2; ++i) dv[i] = 0.f;

  // Steps whose (key, query) block has masked entries (the causal diagonal blocks, and the last query block, whose
  // rows past s_q are zero) are kChecked: they also keep inf / NaN of a query row (q, dout) or of a key's own S^T
  // out of the keys / rows that do not see each other. The body is one; the checked parts are compiled into the
  // checked instantiation only, and the other steps run the plain one (ks = 0: its rare branches fold away).
  // kDefer (kTwoKernel, d_qk 128): the plain step leaves its dK += dS^T Q pending (A fragments as_prev, Q tile
  // sq_prev of stage stage_prev); the next step issues it after its S^T.
  // d_qk 192 does not: the 16 registers of as_prev on top of dK 96, dV 64 and S^T 32 spill (52-100 bytes) and
  // serialize the wgmma (C7512).
  constexpr bool kDefer = kv_defers_dk<kD>();
  // Whether a step has one pending is a compile-time property of the call (kPrev), as in the dq kernel.
  [[maybe_unused]] uint32_t as_prev[4][4];
  [[maybe_unused]] uint32_t sq_prev = 0;
  [[maybe_unused]] int stage_prev = 0;
  [[maybe_unused]] auto finish_pending = [&]() {
    finish_deferred_rs<T, kD, kKvBM>(dk, as_prev, sq_prev, empty_bar(stage_prev));
  };
  auto step = [&](int it, auto checked, auto prev) {
    constexpr bool kChecked = decltype(checked)::value;
    [[maybe_unused]] constexpr bool kPrev = decltype(prev)::value;  // kDefer: the previous query block's dK is pending
    const int stage = R::stage(it);
    const int m0 = (m_begin + it % m_count) * kKvBM;
    const uint32_t sQ = sStage0 + stage * Smem::kStageAligned;
    const uint32_t sDO = sQ + Smem::kQ;
    const float* vec = reinterpret_cast<const float*>(smem + (sDO + Smem::kDO - base));
    mbar_wait(full_bar(stage), R::full_phase(it));
    if constexpr (kTma) {
      if (m0 + kKvBM > sb.s_q) {  // the request's last query block: its rows past s_q are the next request's
        const int r0 = sb.s_q - m0;
        zero_tile_rows<kKvBM, kD>(smem_ptr(sQ), r0, tid & 127, 128);
        zero_tile_rows<kKvBM, kBwdDV>(smem_ptr(sDO), r0, tid & 127, 128);
        gmma::fence_proxy_async();
        named_barrier_sync(4 + wg, 128);
      }
    }
    gmma::fence_proxy_async();

    // S^T first, P^T packed, then dP^T = V dO^T and dV += P^T dO; dS^T packed, then dK += dS^T Q. S^T and dP^T are
    // never live together (d_qk 192: dK 96 + dV 64 accumulators).
    // Masked: keys a query does not see (causal); checked, also the zero rows past s_q (their S^T = k . 0 is NaN
    // where k holds an inf, and lse2 = +inf does not make that P^T 0).
    const bool need_mask = (p.causal && n0 + kKvBN - 1 > m0 + off) || (kChecked && m0 + kKvBM > sb.s_q);
    uint32_t ap[4][4], as[4][4];
    bool nonfinite = false;
    {
      float st[32];  // S^T: rows = this warpgroup's 64 keys, columns = the block's 64 queries
      gmma::fence();
      issue_abt64<T, kD, kKvBN, kKvBM>(st, sK, wg * 64, sQ);
      if constexpr (kDefer) {
        gmma::commit();
        if constexpr (kPrev) {  // dK += dS^T Q of the previous query block, its own group: in flight during P^T
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) Wgmma<T, kD>::template rs<1>(dk, as_prev[kk], desc_mn<kKvBM>(sq_prev, kk));
          gmma::commit();
          gmma::wait<1>();
        } else {
          gmma::wait<0>();
        }
        gmma::reg_fence(st);
      } else {
        gmma::commit_wait(st);
      }
      if constexpr (!kChecked) {
        // The masked and the unmasked form, chosen per block (the same operations per element as below).
        auto pt_block = [&](auto masked) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = 8 * i + 2 * tq + (e & 1);
              float pr = exp2f(st[4 * i + e] * p.scale_log2 - vec[c]);
              if constexpr (decltype(masked)::value) pr = krow[e >> 1] <= m0 + c + off ? pr : 0.f;
              st[4 * i + e] = pr;
            }
          }
        };
        if (need_mask)
          pt_block(std::true_type{});
        else
          pt_block(std::false_type{});
      } else {  // checked: the mask tested per element
#pragma unroll
        for (int i = 0; i < 8; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = 8 * i + 2 * tq + (e & 1);  // query column in the block
            float pr = exp2f(st[4 * i + e] * p.scale_log2 - vec[c]);
            if (need_mask && !((!p.causal || krow[e >> 1] <= m0 + c + off) && m0 + c < sb.s_q)) {
              // A query row this key does not see: an inf / NaN in its q makes every S^T of it inf / NaN, one in
              // its dout makes D inf / NaN (a false alarm from an inf k or a row's NaN out only costs time).
              nonfinite |=
                  m0 + c < sb.s_q && (float_is_nonfinite(st[4 * i + e]) || float_is_nonfinite(vec[kKvBM + c]));
              pr = 0.f;
            }
            st[4 * i + e] = pr;
          }
        }
      }
      pack_a<T, 64>(st, ap);
    }
    if constexpr (kDefer && kPrev) {
      // The previous query block's dK has run under this block's P^T: wait for it here, not above that work.
      end_block_after_all(ap);
      gmma::wait<0>();
      gmma::reg_fence(dk);
      mbar_arrive(empty_bar(stage_prev));
    }
    // Checked, causal: where a query row that some key of this warpgroup does not see holds inf / NaN in q or dout,
    // dV += P^T dO and dK += dS^T Q take the block's k-steps from copies without them (in the warpgroup's scratch)
    // and the keys that see that row add its products afterwards.
    uint32_t ks = 0;
    if constexpr (kChecked) {
      if (p.causal && need_mask && bar_red_or(4 + wg, 128, nonfinite)) ks = 0xFu;
    }
    const uint32_t scratch = sScratch + wg * Smem::kScratch;
    auto visible = [&](int c, int e) { return krow[e] <= m0 + c + off && m0 + c < sb.s_q; };
    {
      float dpt[32];  // dP^T
      gmma::reg_fence(dv);
      // Plain step: dP^T first, then dV += P^T dO as its own group, in flight during dS^T (no extra registers: P^T
      // is read back from ap there anyway). Checked steps wait for dV and dP^T together before dS^T: a checked step's
      // ks is a run-time value, and a wgmma still in flight where its two paths join makes ptxas serialize (C7520).
      constexpr bool kDvUnderDs = !kChecked;
      if (ks == 0) {
        gmma::fence();
        if constexpr (kDvUnderDs) {
          issue_abt64<T, kBwdDV, kKvBN, kKvBM>(dpt, sV, wg * 64, sDO);
          gmma::commit();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) Wgmma<T, kBwdDV>::template rs<1>(dv, ap[kk], desc_mn<kKvBM>(sDO, kk));
          gmma::commit();
          gmma::wait<1>();
        } else {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) Wgmma<T, kBwdDV>::template rs<1>(dv, ap[kk], desc_mn<kKvBM>(sDO, kk));
          issue_abt64<T, kBwdDV, kKvBN, kKvBM>(dpt, sV, wg * 64, sDO);
          gmma::commit();
          gmma::wait<0>();
        }
      } else {  // dV first (dP^T not yet live: registers), then dP^T
        mma_b_finite<T, kKvBM, kBwdDV, 4>(dv, ap, sDO, scratch, ks, 4 + wg, tid & 127);
        add_nonfinite_products_smem<T, kKvBM, kBwdDV, 4>(dv, ap, smem_ptr(sDO), ks, visible, lane);
        gmma::reg_fence(dv);
        gmma::fence();
        issue_abt64<T, kBwdDV, kKvBN, kKvBM>(dpt, sV, wg * 64, sDO);
        gmma::commit();
        gmma::wait<0>();
      }
      if constexpr (!kDvUnderDs) gmma::reg_fence(dv);
      gmma::reg_fence(dpt);
      // dS^T = P^T (dP^T - D), P^T taken back from its packed form (the values the dV GEMM used). Checked: masked
      // entries get 0 with the sign of dP^T - D (the bits of 0 (dP^T - D)), also where dP^T - D is inf / NaN (D of
      // a row that sees a key with inf / NaN in v or k, dP^T of a key with inf / NaN in v): a query row must not
      // reach the dk of a key it does not see.
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float p0, p1;
          unpack2<T>(ap[kk][j], p0, p1);
          const int i = 2 * kk + (j >> 1), e0 = (j & 1) * 2;
          const int c = 8 * i + 2 * tq;
          const float d0 = dpt[4 * i + e0] - vec[kKvBM + c], d1 = dpt[4 * i + e0 + 1] - vec[kKvBM + c + 1];
          dpt[4 * i + e0] = p0 * d0;
          dpt[4 * i + e0 + 1] = p1 * d1;
          if (kChecked && need_mask) {
            const int kr = krow[j & 1];
            if (!((!p.causal || kr <= m0 + c + off) && m0 + c < sb.s_q)) dpt[4 * i + e0] = copysignf(0.f, d0);
            if (!((!p.causal || kr <= m0 + c + 1 + off) && m0 + c + 1 < sb.s_q))
              dpt[4 * i + e0 + 1] = copysignf(0.f, d1);
          }
        }
      }
      pack_a<T, 64>(dpt, as);
      if constexpr (kDvUnderDs) {  // dV has run under dS^T: wait for it here, not above that work
        end_block_after_all(as);
        gmma::wait<0>();
        gmma::reg_fence(dv);
      }
    }
    if constexpr (kDefer && !kChecked) {  // leave this block's dK += dS^T Q to the next step
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int j = 0; j < 4; ++j) as_prev[kk][j] = as[kk][j];
      }
      sq_prev = sQ;
      stage_prev = stage;
      return;
    }
    gmma::reg_fence(dk);
    if (ks != 0) {  // checked only
      mma_b_finite<T, kKvBM, kD, 4>(dk, as, sQ, scratch, ks, 4 + wg, tid & 127);
      add_nonfinite_products_smem<T, kKvBM, kD, 4>(dk, as, smem_ptr(sQ), ks, visible, lane);
      gmma::reg_fence(dk);
    } else {
      gmma::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Wgmma<T, kD>::template rs<1>(dk, as[kk], desc_mn<kKvBM>(sQ, kk));
      gmma::commit();
    }
    gmma::wait<0>();
    gmma::reg_fence(dk);
    mbar_arrive(empty_bar(stage));
  };
  mbar_wait(kv_bar, 0);
  if constexpr (kDefer) {
    bool pending = false;  // the previous step was plain: its dK += dS^T Q is pending
    for (int it = 0; it < n_it; ++it) {
      const int m0 = (m_begin + it % m_count) * kKvBM;
      if ((p.causal && n0 + kKvBN - 1 > m0 + off) || m0 + kKvBM > sb.s_q) {
        if (pending) finish_pending();
        step(it, std::true_type{}, std::false_type{});
        pending = false;
      } else {
        if (pending)
          step(it, std::false_type{}, std::true_type{});
        else
          step(it, std::false_type{}, std::false_type{});
        pending = true;
      }
    }
    if (pending) finish_pending();
  } else {
    for (int it = 0; it < n_it; ++it) {
      const int m0 = (m_begin + it % m_count) * kKvBM;
      if ((p.causal && n0 + kKvBN - 1 > m0 + off) || m0 + kKvBM > sb.s_q)
        step(it, std::true_type{}, std::false_type{});
      else
        step(it, std::false_type{}, std::false_type{});
    }
  }

  T* dkp = static_cast<T*>(p.dk);
  T* dvp = static_cast<T*>(p.dv);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (krow[e] >= sb.s_k) continue;
    const int64_t kj = static_cast<int64_t>(sb.k0) + krow[e];
    T* rk = dkp + kj * p.dk_row + hk * p.dk_head;
    T* rv = dvp + kj * p.dv_row + hk * p.dv_head;
#pragma unroll
    for (int i = 0; i < kD / 8; ++i)
      *reinterpret_cast<uint32_t*>(rk + 8 * i + 2 * tq) =
          HalfTraits<T>::pack(dk[4 * i + 2 * e] * p.scale, dk[4 * i + 2 * e + 1] * p.scale);
#pragma unroll
    for (int i = 0; i < kBwdDV / 8; ++i)
      *reinterpret_cast<uint32_t*>(rv + 8 * i + 2 * tq) = HalfTraits<T>::pack(dv[4 * i + 2 * e], dv[4 * i + 2 * e + 1]);
  }
}

/// tmaps: the maps of the TMA loads, or nullptr for the cp.async loaders: k, v with 64-row boxes and q, dout with
/// 64-row boxes (the blocks streamed by the dq and the dk / dv kernel), q, dout with 128-row boxes (the dq kernel's
/// tile) and k, v with 128-row boxes (the dk / dv kernel's). dq_by_block / kv_by_block: the kernels' CTA orders
/// (bwd_cta; kByBlock with the TMA loaders only, which every grid with tensor maps runs).
template <class T, int kD>
cudaError_t launch_bwd(const KernelParams& kp, int64_t max_seqlen_qo, int64_t max_seqlen_kv, int b, int h_kv,
                       const CUtensorMap* tmaps, bool dq_by_block, bool kv_by_block, cudaStream_t stream,
                       const char** failed) {
  cudaError_t e = cudaSuccess;
  if (max_seqlen_qo > 0) {  // else no query rows: dq is empty, the dkdv loops are empty (dk = dv = 0)
    *failed = "dense_prefill_bwd_preprocess_kernel launch";
    dense_prefill_bwd_preprocess_kernel<T><<<dim3(kp.ws_rows / 16, kp.h_q, b), 256, 0, stream>>>(kp);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    *failed = "dense_prefill_bwd_dq_kernel launch";
    auto dq_kernel = tmaps == nullptr ? dense_prefill_bwd_dq_kernel<T, kD, false>
                     : dq_by_block    ? dense_prefill_bwd_dq_kernel<T, kD, true, true>
                                      : dense_prefill_bwd_dq_kernel<T, kD, true>;
    e = set_max_dynamic_smem(dq_kernel, DqSmem<kD>::kBytes);
    if (e != cudaSuccess) return e;
    const CUtensorMap none{};
    dq_kernel<<<dim3(static_cast<int>((max_seqlen_qo + kDqBM - 1) / kDqBM), kp.h_q, b), kThreads, DqSmem<kD>::kBytes,
                stream>>>(kp, tmaps != nullptr ? tmaps[0] : none, tmaps != nullptr ? tmaps[1] : none,
                          tmaps != nullptr ? tmaps[4] : none, tmaps != nullptr ? tmaps[5] : none);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (max_seqlen_kv > 0) {  // else no keys: dk / dv are empty
    *failed = "dense_prefill_bwd_dkdv_kernel launch";
    auto kv_kernel = tmaps == nullptr ? dense_prefill_bwd_dkdv_kernel<T, kD, false>
                     : kv_by_block    ? dense_prefill_bwd_dkdv_kernel<T, kD, true, true>
                                      : dense_prefill_bwd_dkdv_kernel<T, kD, true>;
    e = set_max_dynamic_smem(kv_kernel, KvSmem<kD>::kBytesAligned);
    if (e != cudaSuccess) return e;
    const CUtensorMap none{};
    kv_kernel<<<dim3(static_cast<int>((max_seqlen_kv + kKvBN - 1) / kKvBN), h_kv, b), kThreads,
                KvSmem<kD>::kBytesAligned, stream>>>(kp, tmaps != nullptr ? tmaps[2] : none,
                                                     tmaps != nullptr ? tmaps[3] : none,
                                                     tmaps != nullptr ? tmaps[6] : none,
                                                     tmaps != nullptr ? tmaps[7] : none);
    e = cudaGetLastError();
  }
  return e;
}

namespace {
const char* const kBwdOp = "flash_attn_varlen_func backward";
Status bwd_value_error(const std::string& what) { return value_error_status(kBwdOp, what); }
int64_t ws_rows_for(int64_t max_seqlen_qo) { return (max_seqlen_qo + kWsAlign - 1) / kWsAlign * kWsAlign; }

/// Workspace layout: lse2 and D, (b, h_q, ws_rows) fp32 each.
struct WsLayout {
  int64_t ws_rows = 0, total = 0;
};
WsLayout ws_layout(const DensePrefillBwdParams& bp) {
  const DensePrefillParams& p = bp.fwd;
  WsLayout w;
  const int64_t b = p.cu_seqlens_qo.shape[0] - 1, h_q = p.q.shape[1];
  if (b <= 0 || p.max_seqlen_qo <= 0) return w;
  w.ws_rows = ws_rows_for(p.max_seqlen_qo);
  w.total = 2 * b * h_q * w.ws_rows * static_cast<int64_t>(sizeof(float));
  return w;
}
}  // namespace

Status bwd_with_schedule(const DensePrefillBwdParams& bp, BwdSchedule schedule, TileOrder order) {
  const DensePrefillParams& p = bp.fwd;
  const int64_t total_q = p.q.shape[0], h_q = p.q.shape[1], d_qk = p.q.shape[2];
  const int64_t total_k = p.k.shape[0], h_kv = p.k.shape[1], d_v = p.v.shape[2];
  const int64_t b = p.cu_seqlens_qo.shape[0] - 1;
  if (b <= 0 || (total_q == 0 && total_k == 0)) return Status::Ok();
  if (!((d_qk == 128 || d_qk == 192) && d_v == 128))
    return bwd_value_error("no kernel for head_dim_qk=" + std::to_string(d_qk) + " head_dim_vo=" + std::to_string(d_v));
  if (!rows_16b_aligned(p.q, 2) || !rows_16b_aligned(p.k, 2) || !rows_16b_aligned(p.v, 2) ||
      !rows_16b_aligned(bp.dout, 2) || !rows_16b_aligned(p.out, 2))
    return bwd_value_error("q, k, v, out and dout rows must start 16-byte aligned (strides multiples of 8 elements)");
  if (!element_pairs_aligned(bp.dq, 3) || !element_pairs_aligned(bp.dk, 3) || !element_pairs_aligned(bp.dv, 3))
    return bwd_value_error("dq, dk and dv must have even row / head strides and 4-byte aligned starts");
  if (b > 65535 || h_q > 65535) return bwd_value_error("batch size and h_q must be <= 65535");
  if (p.max_seqlen_qo > (int64_t{1} << 30) || p.max_seqlen_kv > (int64_t{1} << 30) || total_q >= (int64_t{1} << 31) ||
      total_k >= (int64_t{1} << 31))
    return bwd_value_error("sequence lengths must be < 2^30");
  // kTwoKernelTma: the tiles by TMA where the maps can be made, else kTwoKernel (cp.async loaders).
  CUtensorMap maps[8];
  const bool tma = schedule == BwdSchedule::kTwoKernelTma && make_tile_map(p.k, kDqBN, &maps[0]) &&
                   make_tile_map(p.v, kDqBN, &maps[1]) && make_tile_map(p.q, kKvBM, &maps[2]) &&
                   make_tile_map(bp.dout, kKvBM, &maps[3]) && make_tile_map(p.q, kDqBM, &maps[4]) &&
                   make_tile_map(bp.dout, kDqBM, &maps[5]) && make_tile_map(p.k, kKvBN, &maps[6]) &&
                   make_tile_map(p.v, kKvBN, &maps[7]);
  const CUtensorMap* tm = tma ? maps : nullptr;
  const WsLayout ws = ws_layout(bp);  // what dense_prefill_bwd_workspace_bytes asked for
  if (bp.workspace_bytes < ws.total || (ws.total > 0 && bp.workspace == nullptr))
    return bwd_value_error("workspace must hold " + std::to_string(ws.total) + " bytes");
  if (reinterpret_cast<uintptr_t>(bp.workspace) % 16 != 0) return bwd_value_error("workspace must be 16-byte aligned");

  KernelParams kp = attention_kernel_params(p);
  kp.out_in = p.out.data;
  kp.dout = bp.dout.data;
  kp.dq = bp.dq.data;
  kp.dk = bp.dk.data;
  kp.dv = bp.dv.data;
  kp.do_row = bp.dout.stride[0];
  kp.do_head = bp.dout.stride[1];
  kp.dq_row = bp.dq.stride[0];
  kp.dq_head = bp.dq.stride[1];
  kp.dk_row = bp.dk.stride[0];
  kp.dk_head = bp.dk.stride[1];
  kp.dv_row = bp.dv.stride[0];
  kp.dv_head = bp.dv.stride[1];
  kp.ws_rows = static_cast<int>(ws.ws_rows);
  uint8_t* wsb = static_cast<uint8_t*>(bp.workspace);
  kp.ws_lse2 = reinterpret_cast<float*>(wsb);
  kp.ws_dsum = kp.ws_lse2 + b * h_q * ws.ws_rows;

  DeviceGuard guard(p.q.device.id);
  if (guard.error() != cudaSuccess) return cuda_error_status(kBwdOp, "cudaSetDevice", guard.error());
  cudaStream_t stream = static_cast<cudaStream_t>(bp.stream);
  const bool bf16 = p.q.dtype == DType::kBFloat16;
  const char* failed = "";
  const int bi = static_cast<int>(b), hk = static_cast<int>(h_kv);
  const int64_t mq = p.max_seqlen_qo, mk = p.max_seqlen_kv;
  // The CTA orders of the dq grid (query blocks, h_q, b) and the dk / dv grid (key blocks, h_kv, b); kByBlock's
  // linear index is an int (bwd_cta).
  const int64_t dq_ctas = (mq + kDqBM - 1) / kDqBM * h_q * b, kv_ctas = (mk + kKvBN - 1) / kKvBN * h_kv * b;
  auto by_block = [&](int64_t ctas) {
    const TileOrder o = order != TileOrder::kShapeRule ? order
                                                             : bwd_tile_order(p.causal, ctas, num_sms(p.q.device.id));
    return o == TileOrder::kByBlock && ctas < (int64_t{1} << 31);
  };
  const bool dq_by_block = by_block(dq_ctas), kv_by_block = by_block(kv_ctas);
  auto launch_d = [&](auto t) {
    using T = decltype(t);
    if (d_qk == 128) return launch_bwd<T, 128>(kp, mq, mk, bi, hk, tm, dq_by_block, kv_by_block, stream, &failed);
    return launch_bwd<T, 192>(kp, mq, mk, bi, hk, tm, dq_by_block, kv_by_block, stream, &failed);
  };
  cudaError_t e = bf16 ? launch_d(__nv_bfloat16{}) : launch_d(__half{});
  if (e != cudaSuccess) return cuda_error_status(kBwdOp, failed, e);
  return Status::Ok();
}

}  // namespace dense_prefill

int64_t dense_prefill_bwd_workspace_bytes(const DensePrefillBwdParams& bp) {
  return dense_prefill::ws_layout(bp).total;
}

Status dense_prefill_bwd(const DensePrefillBwdParams& bp) {
  return dense_prefill::bwd_with_schedule(bp, dense_prefill::kBwdSchedule);
}

}  // namespace flashmla::sm90
