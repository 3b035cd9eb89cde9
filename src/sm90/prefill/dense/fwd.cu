// src/sm90/prefill/dense/fwd.cu — sm90 dense MHA prefill forward (`flash_attn_varlen_func`, spec §1.5,
// §2.5): out = softmax(q k^T * scale [+ bottom-right causal mask]) v and lse (natural log) per query
// row and head, varlen (cu_seqlens), GQA, bf16 / fp16, d_qk in {128, 192}, d_v 128.
//
// One CTA per (128-row query tile, query head, request), or with the persistent schedule one CTA per SM
// walking those tiles (dense_prefill_fwd_kernel's kPersistent); 384 threads, warp-specialised:
//   producer warpgroup 2: the Q tile (cp.async, or TMA in the persistent schedule), then K / V blocks of 128 keys
//     (176 in the persistent schedule's wide form at d_qk 128: fwd_key_block, dense_prefill.h)
//     (TMA from one thread, or cp.async) into a two-stage ring (mbarriers "full" per stage, released through
//     "empty");
//   consumer warpgroups 0 / 1: 64 query rows each; per key block S = Q K^T (wgmma m64n128k16, both
//     operands from shared memory), mask, online softmax in base 2, O += P V (wgmma m64n128k16 with P
//     from registers, V MN-major). In the default (persistent) schedule S of one block is issued with P V of the
//     one before, and the two warpgroups take turns to issue, so one's softmax runs under the other's GEMMs.
// The running max moves lazily (seesaw::lazy_max): P <= 2^8, O / l rescaled only when it moves.
// Rows with no visible key give out 0 and lse -inf (rows whose visible keys all score -inf: out and lse
// NaN); NaN in q or a visible k / v row reaches that row's out and lse (fmaxf skips NaN in the max, the
// NaN then flows through P, l and O).
// Causal grids run their query tiles last-to-first so the longest CTAs start first.
// Trace (tools/trace/dense_prefill_fwd_trace.cu; FLASHMLA_TRACE only, else no code): step = the CTA's ring block rb.
// Roles 0 / 1, a consumer warpgroup's step (rb >= the tile's second block): 0 start, 1 K full (and V's: cp.async schedules), 2 its turn,
// 3 S and P V issued, 4 S complete, 5 softmax done, 6 P V complete, 7 end. Role 2, the TMA thread: 0 before the wait for
// K's stage, 1 K issued, 2 V issued. Role 3, warpgroup 0 per tile with key blocks (step = its Q tile count): 0 start,
// 1 Q full, 2 epilogue start, 3 end.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "sm90/common/host_utils.h"
#include "sm90/common/trace.cuh"
#include "sm90/prefill/dense/common.cuh"
#include "sm90/prefill/dense/dense_prefill.h"
#include "sm90/sm90.h"

namespace flashmla::sm90 {
namespace dense_prefill {

constexpr int kFwdBM = 128, kDV = 128;
// Diagnostic build switch (default 0; NOT a usable form): 1 skips the producer's cleaning of the causal diagonal tiles'
// V rows (inf / NaN of masked keys -> 0; FwdTile's "checked" blocks), so their V goes straight to the consumers like
// any other block's. Measures what the NaN-safety of those tiles costs (docs/dense-prefill.md, "What the checked tiles
// cost"); with it an inf / NaN in a V row that some row of the tile does not see reaches that row's out as NaN.
#ifndef FLASHMLA_DENSE_PREFILL_FWD_NO_V_CLEAN
#define FLASHMLA_DENSE_PREFILL_FWD_NO_V_CLEAN 0
#endif
constexpr bool kFwdCleanCheckedV = FLASHMLA_DENSE_PREFILL_FWD_NO_V_CLEAN == 0;
// Build switch (default 0 = ascending key blocks): 1 walks a causal tile's key blocks from the diagonal down in the
// persistent schedule (kPersistent with 128-key blocks only; non-causal tiles and the other schedules keep the
// ascending order), so that the checked blocks (the diagonal ones, FwdTile) are the tile's first: their V lands first
// and its scan for inf / NaN runs under the tile's first S and softmax (and the tile before it) instead of before the
// tile's last P V; their global-memory prescan runs under the CTA's previous tile (docs/dense-prefill.md, "Forward:
// the diagonal key blocks first"). Another summation order for causal rows: the outputs change in the last bits.
#ifndef FLASHMLA_DENSE_PREFILL_FWD_DIAG_FIRST
#define FLASHMLA_DENSE_PREFILL_FWD_DIAG_FIRST 0
#endif
constexpr bool kFwdDiagFirst = FLASHMLA_DENSE_PREFILL_FWD_DIAG_FIRST != 0;
/// The key block at walk position j of a tile of n_blocks key blocks: j, or with kDiagFirst (the persistent kernel
/// under the switch) in a causal tile n_blocks - 1 - j.
template <bool kDiagFirst>
__device__ __forceinline__ int fwd_walk_block(int j, int n_blocks, int causal) {
  if constexpr (kDiagFirst) return causal ? n_blocks - 1 - j : j;
  else return j;
}
// The key block at walk position j of the kernel's tile t. The default build spells it j, so that its kernels are token
// for token the ones before the switch; with the switch, the constant condition keeps the kernels without kDiagFirst
// (the non-persistent schedules) as they were too (the same SASS, tools/compare-sass.py).
#if FLASHMLA_DENSE_PREFILL_FWD_DIAG_FIRST
#define FLASHMLA_FWD_KEY_BLOCK(j) (kDiagFirst ? fwd_walk_block<kDiagFirst>(j, t.n_blocks, p.causal) : (j))
#else
#define FLASHMLA_FWD_KEY_BLOCK(j) (j)
#endif
/// A producer wait on an mbarrier phase (polling; sleeping between polls measured x0.997, 2026-12-05).
__device__ __forceinline__ void producer_wait(uint32_t bar, uint32_t parity) { mbar_wait(bar, parity); }
// The persistent forward's producer walks the tiles as well (tile and ring counters live across its loop), which
// does not fit in kProducerRegs; its consumers get 8 fewer (the same 504-register pool).
constexpr int kPersistentProducerRegs = 40;
constexpr int kPersistentConsumerRegs = (3 * 168 - kPersistentProducerRegs) / 2 / 8 * 8;
static_assert(kPersistentConsumerRegs == 232, "setmaxnreg budget");

/// Key blocks of kBN keys (a template parameter of the kernel; fwd_key_block in dense_prefill.h): 128, or 176 at d_qk 128
/// (S m64n176k16, P V over 11 k-steps; shared memory allows no 176 at d_qk 192).
template <int kD, int kBN = 128>
struct FwdSmem {
  static_assert(kBN == 128 || kBN == 176, "key block");
  static constexpr int kQ = kFwdBM * kD * 2;
  static constexpr int kK = kBN * kD * 2;
  static constexpr int kV = kBN * kDV * 2;
  static constexpr int kStage = kK + kV;
  // k_full[2], k_empty[2], v_full[2], v_empty[2], q_full, v_loaded[2], q_empty
  static constexpr int kBars = 12 * 8;
  static constexpr int kMaskWords = kBN <= 128 ? 4 : 8;  // per stage: a bit per V row of a masked key that held inf / NaN
  static constexpr int kMasks = 2 * 4 * kMaskWords;
  static constexpr int kBytes = 1024 + kQ + 2 * kStage + kBars + kMasks;
  static_assert(kBytes <= 232448, "shared memory");
};

/// One key block's online-softmax step on the thread's S fragment (64 rows x kBN keys of the warpgroup,
/// two rows per thread): scale to base 2, mask invisible keys to -inf (kMask), move the running max
/// m_run lazily, leave P = exp2(S - m) in s, the factor that rescales O in sc, and l = l * sc + rowsum(P)
/// (the thread's partial row sums; reduced over the quad in the epilogue). kMask: the block has keys some row
/// does not see (softmax_step picks the form per block, so the unmasked form carries no per-element tests).
/// kFold (scale_log2 > 0 only): the scale is folded into the exponent's FMA, P = exp2(fma(S, scale_log2, -m)), and the
/// row max is taken over the unscaled scores, then scaled (the same value: x -> x * scale_log2 is monotone); one
/// instruction per score less, and the exponent's argument rounded once instead of twice.
template <bool kMask, bool kFold, int kBN>
__device__ __forceinline__ void softmax_block(float (&s)[kBN / 2], int n0, const int (&row)[2], int tq, int s_k,
                                              bool causal, int off, float scale_log2, float (&m_run)[2], float (&l)[2],
                                              float (&sc)[2]) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < kBN / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = kFold ? s[4 * i + e] : s[4 * i + e] * scale_log2;
      if constexpr (kMask) {
        const int col = n0 + 8 * i + 2 * tq + (e & 1);
        const bool vis = col < s_k && (!causal || col <= row[e >> 1] + off);
        x = vis ? x : -INFINITY;
      }
      s[4 * i + e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);  // fmaxf skips NaN: a NaN score flows on through P and l
    }
  }
  seesaw::quad_rowmax(mx);
  if constexpr (kFold) {
#pragma unroll
    for (int e = 0; e < 2; ++e) mx[e] *= scale_log2;
  }
  float m_use[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    sc[e] = advance_row_max(m_run[e], seesaw::lazy_max(m_run[e], mx[e]), m_use[e]);
    l[e] *= sc[e];
  }
#pragma unroll
  for (int i = 0; i < kBN / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float arg = kFold ? fmaf(s[4 * i + e], scale_log2, -m_use[e >> 1]) : s[4 * i + e] - m_use[e >> 1];
      s[4 * i + e] = exp2f(arg);
      l[e >> 1] += s[4 * i + e];
    }
  }
}
template <bool kFold, int kBN>
__device__ __forceinline__ void softmax_step(float (&s)[kBN / 2], bool need_mask, int n0, const int (&row)[2], int tq,
                                             int s_k, bool causal, int off, float scale_log2, float (&m_run)[2],
                                             float (&l)[2], float (&sc)[2]) {
  if (need_mask)
    softmax_block<true, kFold, kBN>(s, n0, row, tq, s_k, causal, off, scale_log2, m_run, l, sc);
  else
    softmax_block<false, kFold, kBN>(s, n0, row, tq, s_k, causal, off, scale_log2, m_run, l, sc);
}

/// One tile of the forward: query rows [m0, m0 + 128) of head h of one request, and the key blocks it sees.
struct FwdTile {
  SeqBounds sb;
  int h, hk, m0;
  int off;       // s_k - s_q: key j visible to query i iff j <= i + off (causal)
  int n_blocks;  // key blocks of kBN the tile sees
  // Causal: keys from masked_lo on are not seen by some row of the tile (row m0 sees keys <= m0 + off). The
  // key blocks from check_first on (at most the last two: the visible key end is <= m0 + 128 + off, kBN >= 128) are
  // "checked": before the consumers see their V (v_full), the producer replaces the inf / NaN elements of the V
  // rows in [masked_lo, s_k) by 0 and marks those rows; a consumer warpgroup that finds a mark adds the products
  // of the rows that do see the key after the block's P V. Other blocks (all of them when not causal) go as before.
  int masked_lo, check_first;
};
template <int kBN>
__device__ __forceinline__ FwdTile fwd_tile(const KernelParams& p, int b, int h, int m0) {
  FwdTile t;
  t.sb = seq_bounds(p.cu_q, p.cu_k, p.cu_q_stride, p.cu_k_stride, b);
  t.h = h;
  t.m0 = m0;
  t.off = t.sb.s_k - t.sb.s_q;
  t.n_blocks = (visible_key_end<kFwdBM>(p, t.sb.s_k, m0, t.off) + kBN - 1) / kBN;
  t.hk = h / p.group;
  t.masked_lo = max(m0 + t.off + 1, 0);
  t.check_first = p.causal && t.masked_lo < t.sb.s_k ? t.masked_lo / kBN : t.n_blocks;
  return t;
}

/// kOverlap = false: per key block S = Q K^T, wait, softmax, O += P V, wait.
/// kOverlap = true (FlashAttention-3's intra-warpgroup pipelining, our own code): S_n = Q K_n^T is issued
/// together with O += P_{n-1} V_{n-1}, and the softmax of block n runs while that P V is on the tensor
/// cores; O is rescaled once the P V has landed. K and V have separate full / empty barriers, so K_{n+1}
/// streams in as soon as S_{n-1} is done.
/// kPingpong (with kOverlap; FlashAttention-3's inter-warpgroup scheduling, our own code): the two consumer
/// warpgroups take turns to issue their GEMMs of a step (named barriers 2 and 3: a warpgroup syncs on its
/// own before issuing and arrives on the other's after), so one's softmax runs under the other's GEMMs.
/// Warpgroup 0 goes first (warpgroup 1 arrives once up front and not after its last step, so that every
/// arrival meets a sync; the arrivals balance within each tile).
/// kTma: K / V blocks come by TMA (tmap_k / tmap_v: (d, h_kv, total_k), boxes of 64 dims x 1 head x 128 rows,
/// 128B swizzle = the tile layout), one producer thread issuing them; rows past total_k are zero-filled, rows
/// past the request's end (the next request's) are loaded: masked in S (-> -inf, P = 0), zeroed in V by the
/// consumers (zero_v_tail). Without kTma the producer warpgroup copies with cp.async and zero-fills every row
/// past the request's end; the maps are unused.
/// kPersistent (with kTma and kPingpong): grid = min(tiles, SMs), each CTA walks num_tiles = m_tiles x h_q x b
/// tiles (for_each_tile). Q comes by TMA too (tmap_q: (d, h_q, total_q), the same boxes; rows past the request's
/// end are other rows, never stored). The K / V ring counts key blocks across the CTA's tiles (ring block rb:
/// stage rb & 1, round rb >> 1), Q's buffer has a "Q free" barrier (q_empty) that both consumer warpgroups arrive
/// on after their tile's last S, so the producer loads the next tile's first K, Q and V while the consumers run
/// the last P V and the epilogue. Tiles with no key block touch no barrier (their rows get out 0, lse -inf).
/// kTilesByBlock (kPersistent only): the tiles in TileOrder::kByBlock's order (for_each_tile).
template <class T, int kD, bool kOverlap, bool kPingpong, bool kTma, bool kPersistent, bool kFold = false, int kBN = 128,
          bool kTilesByBlock = false>
__global__ void __launch_bounds__(kThreads, 1)
    dense_prefill_fwd_kernel(const KernelParams p, const __grid_constant__ CUtensorMap tmap_k,
                             const __grid_constant__ CUtensorMap tmap_v, const __grid_constant__ CUtensorMap tmap_q,
                             int m_tiles, int num_tiles) {
  static_assert(kOverlap || !kPingpong, "pingpong needs the overlapped schedule");
  static_assert(!kPersistent || (kTma && kPingpong), "the persistent forward is the TMA pingpong schedule");
  using Smem = FwdSmem<kD, kBN>;
  constexpr int kMaskWords = Smem::kMaskWords;
  // kDiagFirst (FLASHMLA_DENSE_PREFILL_FWD_DIAG_FIRST, persistent only): a causal tile's walk position j (ring block
  // rb0 + j) holds key block n_blocks - 1 - j, so its checked blocks (check_first .. n_blocks - 1) are walked first;
  // every role (the TMA thread, warps 1-3, the consumers) maps positions to key blocks alike
  // (FLASHMLA_FWD_KEY_BLOCK). Without it, or for a non-causal tile, position j is key block j. 128-key blocks only:
  // in the 176-key kernels (a check schedule, not the default) the reversed walk cost ptxas the uniform descriptors
  // (R2UR 37 -> 104) and spills (stack 64 -> 288 bytes), so those keep the ascending order.
  constexpr bool kDiagFirst = kPersistent && kBN == 128 && kFwdDiagFirst;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t base;
  smem_align_1024(smem_raw, base);
  const uint32_t sQ = base;
  auto sK = [&](int stage) { return base + Smem::kQ + stage * Smem::kStage; };
  auto sV = [&](int stage) { return base + Smem::kQ + stage * Smem::kStage + Smem::kK; };
  const uint32_t bar = base + Smem::kQ + 2 * Smem::kStage;
  auto k_full = [&](int s) { return bar + 8 * s; };
  auto k_empty = [&](int s) { return bar + 16 + 8 * s; };
  auto v_full = [&](int s) { return bar + 32 + 8 * s; };
  auto v_empty = [&](int s) { return bar + 48 + 8 * s; };
  const uint32_t q_bar = bar + 64;
  auto v_loaded = [&](int s) { return bar + 72 + 8 * s; };  // kTma: V of a checked tile landed, not yet cleaned
  const uint32_t q_empty = bar + 88;                        // kPersistent: Q's tile done with (see above)
  uint32_t* const nonfinite_rows = reinterpret_cast<uint32_t*>(smem_raw + (bar + Smem::kBars - smem_u32(smem_raw)));

  FLASHMLA_TRACE_DECL();
  // The tile: this CTA's (blockIdx) without kPersistent; with it, set by for_each_tile before each call of f.
  FwdTile t;
  if constexpr (!kPersistent) {
    t = fwd_tile<kBN>(p, blockIdx.z, blockIdx.y, query_block_row0<kFwdBM>(p));
    if (t.m0 >= t.sb.s_q) return;
  }
  // kPersistent: tile i of the non-persistent grid's order (query tile fastest, then head, then request: the
  // query tiles of one (head, request) run together and share its K / V in L2; causal: the last query tile, which
  // sees the most keys, first) goes to CTA i % grid in even rounds of grid tiles and to CTA grid - 1 - i % grid in
  // odd ones, so that a CTA given a long tile in one round gets a short one in the next. kTilesByBlock: tile i is
  // query tile i / (h_q x b) of (head, request) i % (h_q x b) instead (TileOrder::kByBlock, dense_prefill.h: every
  // round deals tiles of a few adjacent query tiles, one key block apart under a causal mask when the requests are
  // equally long). Tiles without query rows (a short request's) are skipped. Every role of the CTA walks the same
  // tiles.
  auto for_each_tile = [&](auto&& f) {
    const int grid = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
    bool reverse = false;
    for (int r0 = 0; r0 < num_tiles; r0 += grid, reverse = !reverse) {
      const int i = r0 + (reverse ? grid - 1 - cta : cta);
      if (i >= num_tiles) continue;
      int x, hb;
      if constexpr (kTilesByBlock) {
        const int pairs = num_tiles / m_tiles;
        x = i / pairs;
        hb = i - x * pairs;
      } else {
        x = i % m_tiles;
        hb = i / m_tiles;
      }
      t = fwd_tile<kBN>(p, hb / p.h_q, hb % p.h_q, (p.causal ? m_tiles - 1 - x : x) * kFwdBM);
      if (t.m0 < t.sb.s_q) f();
    }
  };

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(k_full(s), kTma ? 1 : 128);
      mbar_init(k_empty(s), 256);
      mbar_init(v_full(s), kTma ? 1 : 128);
      mbar_init(v_empty(s), 256);
      mbar_init(v_loaded(s), 1);
    }
    mbar_init(q_bar, kPersistent ? 1 : 128);
    if constexpr (kPersistent) mbar_init(q_empty, 256);
    for (int i = 0; i < 2 * kMaskWords; ++i) nonfinite_rows[i] = 0u;
    fence_barrier_init();
  }
  __syncthreads();

  // Key block n of the tile: the rows [lo, hi) of its masked keys within it (the rows that both scans of a checked
  // block test, in shared and in global memory: keys that some query row of the tile does not see).
  auto masked_rows_lo = [&](int n) { return max(t.masked_lo - n * kBN, 0); };
  auto masked_rows_hi = [&](int n) { return min(t.sb.s_k - n * kBN, kBN); };
  // Producer threads st = 0 .. nt - 1, checked key block n of the tile in stage: inf / NaN of the V rows of its
  // masked keys -> 0, rows marked; the writes ordered before the consumers' wgmma reads (async proxy).
  auto clean_v = [&](int stage, int n, int st, int nt) {
    zero_nonfinite_rows<T, kBN, kDV>(smem_raw + (sV(stage) - smem_u32(smem_raw)), masked_rows_lo(n),
                                     masked_rows_hi(n), nonfinite_rows + kMaskWords * stage, st, nt);
    gmma::fence_proxy_async();
  };

  if (tid >= 256) {  // ---------------------------------------------------------------- producer
    setmaxnreg_dec<kPersistent ? kPersistentProducerRegs : kProducerRegs>();
    const int pt = tid - 256;
    if constexpr (!kPersistent) {
      const T* q = static_cast<const T*>(p.q) + (static_cast<int64_t>(t.sb.q0) + t.m0) * p.q_row + t.h * p.q_head;
      load_tile<T, kFwdBM, kD>(sQ, q, p.q_row, t.sb.s_q - t.m0, pt);
      mbar_arrive_cp_async(q_bar);
    }
    if constexpr (kTma) {
      if (pt == 0) {
        // The tile's K / V blocks at walk positions j (key blocks n = FLASHMLA_FWD_KEY_BLOCK(j)) as ring blocks
        // rb = rb0 + j; load_q() right after the first K block.
        auto load_kv = [&](int rb0, auto&& load_q) {
          for (int j = 0; j < t.n_blocks; ++j) {
            const int n = FLASHMLA_FWD_KEY_BLOCK(j), rb = rb0 + j, stage = rb & 1, row = t.sb.k0 + n * kBN;
            FLASHMLA_TRACE_EVENT(2, rb, 0, true);
            if (rb >= 2) producer_wait(k_empty(stage), ((rb >> 1) - 1) & 1);
            mbar_arrive_expect_tx(k_full(stage), Smem::kK);
            tma_load_tile<kBN, kD>(sK(stage), &tmap_k, k_full(stage), t.hk, row);
            FLASHMLA_TRACE_EVENT(2, rb, 1, true);
            if (j == 0) load_q();
            if (rb >= 2) producer_wait(v_empty(stage), ((rb >> 1) - 1) & 1);
            const uint32_t vb =
                kFwdCleanCheckedV && n >= t.check_first ? v_loaded(stage) : v_full(stage);  // checked: to warps 1-3 first
            mbar_arrive_expect_tx(vb, Smem::kV);
            tma_load_tile<kBN, kDV>(sV(stage), &tmap_v, vb, t.hk, row);
            FLASHMLA_TRACE_EVENT(2, rb, 2, true);
          }
        };
        if constexpr (kPersistent) {
          int rb0 = 0, q_tiles = 0;  // ring blocks and Q tiles loaded so far
          for_each_tile([&] {
            if (t.n_blocks == 0) return;
            load_kv(rb0, [&] {
              if (q_tiles > 0) producer_wait(q_empty, (q_tiles - 1) & 1);
              mbar_arrive_expect_tx(q_bar, Smem::kQ);
              tma_load_tile<kFwdBM, kD>(sQ, &tmap_q, q_bar, t.h, t.sb.q0 + t.m0);
              ++q_tiles;
            });
            rb0 += t.n_blocks;
          });
        } else {
          load_kv(0, [] {});
        }
      } else if (pt >= 32) {
        // Warps 1-3 clean the checked blocks, then release them to the consumers (v_full, one arrival). Without
        // kPersistent each stage holds at most one checked block (v_loaded parity 0); with it, bit s of `rounds`
        // is the parity of stage s's next one, and the stage's marks are cleared first.
        // kPersistent: a checked block with at least kPrescanAfter blocks before it in the tile is first scanned in
        // global memory (L2), while the consumers work through those blocks; if none of its masked rows holds an inf
        // / NaN (the common case), its V goes to the consumers as soon as it lands, without the shared-memory scan
        // (which otherwise sits between V's arrival and the tile's last P V). Either way the marks and V in shared
        // memory are what the scan alone would leave.
        constexpr int kPrescanAfter = 3;
        auto clean_tile = [&](int rb0, uint32_t& rounds) {
          for (int n = t.check_first; n < t.n_blocks; ++n) {
            const int stage = (rb0 + n) & 1;
            const bool prescan = kPersistent && n >= kPrescanAfter;  // the same in all 96 threads
            bool dirty = true;
            if (prescan)
              dirty = any_nonfinite_rows_global<T, kDV>(
                  static_cast<const T*>(p.v) + (static_cast<int64_t>(t.sb.k0) + n * kBN) * p.v_row +
                      static_cast<int64_t>(t.hk) * p.v_head,
                  p.v_row, masked_rows_lo(n), masked_rows_hi(n), pt - 32, 96);
            producer_wait(v_loaded(stage), kPersistent ? (rounds >> stage) & 1 : 0);
            if constexpr (kPersistent) {
              rounds ^= 1u << stage;
              if (pt == 32) {
#pragma unroll
                for (int w = 0; w < kMaskWords; w += 4)
                  *reinterpret_cast<uint4*>(nonfinite_rows + kMaskWords * stage + w) = make_uint4(0u, 0u, 0u, 0u);
              }
              if (prescan) dirty = bar_red_or(6, 96, dirty);  // also the barrier after the marks' clearing
              else named_barrier_sync(6, 96);
            }
            if (dirty) {
              clean_v(stage, n, pt - 32, 96);
              named_barrier_sync(6, 96);
            }
            if (pt == 32) mbar_arrive(v_full(stage));
          }
        };
#if FLASHMLA_DENSE_PREFILL_FWD_DIAG_FIRST
        // kDiagFirst: the tile's checked blocks are its first walk positions j = 0 .. n_chk - 1 (key blocks
        // n_blocks - 1 down to check_first). Their masked rows are one stretch of keys, [masked_lo, min(s_k,
        // n_blocks * kBN)), scanned in global memory at once before the first of them is waited for, so while the
        // consumers run the plain blocks and the epilogue of the CTA's previous tile: done when that tile had at least
        // kPrescanAfter plain blocks (prev_plain). Otherwise (the CTA's first tile, a tile after a short one) each is
        // scanned in shared memory when its V lands, which is now under the previous tile's end and this tile's first
        // S and softmax rather than before its last P V. The marks and V in shared memory are what the scan alone
        // would leave, as in clean_tile.
        auto clean_tile_diag_first = [&](int rb0, uint32_t& rounds, int& prev_plain) {
          const int n_chk = t.n_blocks - t.check_first;  // 0 when not causal
          const bool prescan = n_chk > 0 && prev_plain >= kPrescanAfter;  // the same in all 96 threads
          bool dirty = true;
          if (prescan)
            dirty = any_nonfinite_rows_global<T, kDV>(
                static_cast<const T*>(p.v) + (static_cast<int64_t>(t.sb.k0) + t.check_first * kBN) * p.v_row +
                    static_cast<int64_t>(t.hk) * p.v_head,
                p.v_row, masked_rows_lo(t.check_first), min(t.sb.s_k, t.n_blocks * kBN) - t.check_first * kBN,
                pt - 32, 96);
          for (int j = 0; j < n_chk; ++j) {
            const int stage = (rb0 + j) & 1;
            producer_wait(v_loaded(stage), (rounds >> stage) & 1);
            rounds ^= 1u << stage;
            if (pt == 32) {
#pragma unroll
              for (int w = 0; w < kMaskWords; w += 4)
                *reinterpret_cast<uint4*>(nonfinite_rows + kMaskWords * stage + w) = make_uint4(0u, 0u, 0u, 0u);
            }
            bool block_dirty = true;
            if (prescan) block_dirty = bar_red_or(6, 96, dirty);  // also the barrier after the marks' clearing
            else named_barrier_sync(6, 96);
            if (block_dirty) {
              clean_v(stage, FLASHMLA_FWD_KEY_BLOCK(j), pt - 32, 96);
              named_barrier_sync(6, 96);
            }
            if (pt == 32) mbar_arrive(v_full(stage));
          }
          if (t.n_blocks > 0) prev_plain = t.check_first;  // the tile's plain blocks, walked after its checked ones
        };
#endif
        uint32_t rounds = 0;
        if constexpr (kPersistent) {
          int rb0 = 0;
#if FLASHMLA_DENSE_PREFILL_FWD_DIAG_FIRST
          int prev_plain = 0;  // plain blocks of the CTA's last tile with key blocks
          for_each_tile([&] {
            if constexpr (kFwdCleanCheckedV) {
              if constexpr (kDiagFirst) clean_tile_diag_first(rb0, rounds, prev_plain);
              else clean_tile(rb0, rounds);
            }
            rb0 += t.n_blocks;
          });
#else
          for_each_tile([&] {
            if constexpr (kFwdCleanCheckedV) clean_tile(rb0, rounds);
            rb0 += t.n_blocks;
          });
#endif
        } else {
          if constexpr (kFwdCleanCheckedV) clean_tile(0, rounds);
        }
      }
    } else {
      const T* k = static_cast<const T*>(p.k) + static_cast<int64_t>(t.sb.k0) * p.k_row + t.hk * p.k_head;
      const T* v = static_cast<const T*>(p.v) + static_cast<int64_t>(t.sb.k0) * p.v_row + t.hk * p.v_head;
      for (int n = 0; n < t.n_blocks; ++n) {
        const int stage = n & 1;
        const int64_t r0 = static_cast<int64_t>(n) * kBN;
        if (n >= 2) mbar_wait(k_empty(stage), ((n >> 1) - 1) & 1);
        load_tile<T, kBN, kD>(sK(stage), k + r0 * p.k_row, p.k_row, t.sb.s_k - n * kBN, pt);
        mbar_arrive_cp_async(k_full(stage));
        if (n >= 2) mbar_wait(v_empty(stage), ((n >> 1) - 1) & 1);
        load_tile<T, kBN, kDV>(sV(stage), v + r0 * p.v_row, p.v_row, t.sb.s_k - n * kBN, pt);
        if (n < t.check_first) {
          mbar_arrive_cp_async(v_full(stage));
        } else {  // checked tile: cleaned by the producer warpgroup before the consumers see it
          cp_async_commit();  // wait_group waits for committed groups only
          cp_async_wait<0>();
          named_barrier_sync(6, 128);  // every producer thread's rows have landed
          clean_v(stage, n, pt, 128);
          mbar_arrive(v_full(stage));
        }
      }
    }
    cp_async_wait<0>();
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<kPersistent ? kPersistentConsumerRegs : kConsumerRegs>();
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  int row[2];  // this thread's two query rows (request-local indices)
  const bool causal = p.causal != 0;
  float o[64];
  float m_run[2], l[2];
  // The tile's row state: its rows, O = 0, the running max and sum.
  auto start_tile = [&] {
    row[0] = t.m0 + wg * 64 + warp * 16 + g;
    row[1] = row[0] + 8;
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      m_run[e] = -INFINITY;
      l[e] = 0.f;
    }
  };
  if constexpr (!kPersistent) start_tile();
  auto need_mask = [&](int n) {
    return n * kBN + kBN > t.sb.s_k || (causal && n * kBN + kBN - 1 > t.m0 + t.off);
  };
  // This warpgroup's 64 rows of Q; its address read from lane 0 so that ptxas knows it is warp-uniform and keeps
  // the descriptor arithmetic on the uniform datapath.
  const uint64_t q_desc = gmma::make_desc_sw128(__shfl_sync(0xffffffffu, sQ + wg * 64 * 128, 0), 16, 1024);
  auto issue_s = [&](float (&s)[kBN / 2], int stage) {
    issue_abt_off<T, kD, kFwdBM, kBN, kBN>(s, q_desc, gmma::make_desc_sw128(sK(stage), 16, 1024));
  };
  // kTma: the V rows of a request's last block past its end hold the next request's rows (masked, P = 0);
  // each warpgroup zeroes them before its P V reads the tile, so that a NaN or inf there cannot reach this
  // request through 0 * NaN. Both warpgroups write the same zeros; each orders its own writes before its
  // wgmma (fence.proxy.async + a barrier of its 128 threads).
  auto zero_v_tail = [&](int stage, int nb) {
    if constexpr (kTma) {
      const int r0 = t.sb.s_k - nb * kBN;
      if (r0 < kBN) {
        uint8_t* tile = smem_raw + (sV(stage) - smem_u32(smem_raw));
        for (int idx = (tid & 127); idx < (kBN - r0) * (kDV / 8); idx += 128)
          *reinterpret_cast<uint4*>(tile + tile_off<kBN>(r0 + idx / (kDV / 8), idx % (kDV / 8))) =
              make_uint4(0u, 0u, 0u, 0u);
        gmma::fence_proxy_async();
        named_barrier_sync(4 + wg, 128);
      }
    }
  };
  auto issue_pv = [&](const uint32_t (&a)[kBN / 16][4], int stage) {
    const uint64_t v_desc = desc_mn<kBN>(sV(stage), 0);  // k-step kk: + kk * 16 rows * 128 bytes
    [&]<int... kK>(std::integer_sequence<int, kK...>) {
      (WgmmaOff128<T>::template rs<kK * 16 * 128 / 16>(o, a[kK], v_desc), ...);
    }(std::make_integer_sequence<int, kBN / 16>{});
  };
  // S = Q K^T of ring block rb on its own (waited), K's stage released.
  auto s_block = [&](float (&s)[kBN / 2], int rb) {
    const int stage = rb & 1;
    mbar_wait(k_full(stage), (rb >> 1) & 1);
    // cp.async (generic proxy) writes -> wgmma (async proxy) reads. TMA writes are async-proxy ones, and the generic
    // writes of a TMA schedule (zero_v_tail, the producer's clean_v) are fenced by their writers before they signal.
    if constexpr (!kTma) gmma::fence_proxy_async();
    gmma::fence();
    issue_s(s, stage);
    gmma::commit_wait(s);
    mbar_arrive(k_empty(stage));
  };
  // After the P V of checked key block nv (in stage) has landed in o: where the producer zeroed inf / NaN elements
  // of its V rows, the rows of this thread that see such a key add its products (V read from global memory).
  // Warpgroup-uniform branch (the marks are in shared memory); the common path reads 4 words.
  auto fix_pv = [&](const uint32_t (&a)[kBN / 16][4], int stage, int nv) {
    const uint4 rows = *reinterpret_cast<const uint4*>(nonfinite_rows + kMaskWords * stage);
    uint4 rows_hi = make_uint4(0u, 0u, 0u, 0u);  // rows 128 .. kBN - 1
    if constexpr (kMaskWords > 4) rows_hi = *reinterpret_cast<const uint4*>(nonfinite_rows + kMaskWords * stage + 4);
    if ((rows.x | rows.y | rows.z | rows.w | rows_hi.x | rows_hi.y | rows_hi.z | rows_hi.w) == 0u) return;
    const int n0 = nv * kBN;
    const T* vg = static_cast<const T*>(p.v) + (static_cast<int64_t>(t.sb.k0) + n0) * p.v_row + t.hk * p.v_head;
    auto brow = [&](int c) { return vg + c * p.v_row; };
    auto visible = [&](int c, int e) { return n0 + c <= row[e] + t.off; };  // marked rows are < s_k
    add_nonfinite_products<T, kDV, kBN / 16>(o, a, rows, brow, visible, lane);
    if constexpr (kMaskWords > 4) add_nonfinite_products<T, kDV, kBN / 16, 128>(o, a, rows_hi, brow, visible, lane);
  };
  // O += P V of the block in `stage` on its own (waited; V's stage full). The caller adds fix_pv for a checked
  // tile, then releases V's stage.
  auto pv_block = [&](const uint32_t (&a)[kBN / 16][4], int stage) {
    if constexpr (!kTma) gmma::fence_proxy_async();  // as in s_block
    gmma::reg_fence(o);
    gmma::fence();
    issue_pv(a, stage);
    gmma::commit_wait(o);
  };

  // The tile t: key block n is ring block rb0 + n; Q's tile number q_tile (the parity of q_bar's phase).
  [[maybe_unused]] const bool trace_thread = (tid & 127) == 0;  // the writer of a warpgroup's trace events
  auto run_tile = [&](int rb0, int q_tile) {
    FLASHMLA_TRACE_EVENT(3, q_tile, 0, tid == 0);
    if constexpr (kPersistent) start_tile();
    if (!kPersistent || t.n_blocks > 0) mbar_wait(q_bar, kPersistent ? q_tile & 1 : 0);
    FLASHMLA_TRACE_EVENT(3, q_tile, 1, tid == 0);
    if constexpr (!kOverlap) {
      for (int n = 0; n < t.n_blocks; ++n) {
        const int stage = n & 1;
        float s[kBN / 2];
        s_block(s, n);
        float sc[2];
        softmax_step<kFold, kBN>(s, need_mask(n), n * kBN, row, tq, t.sb.s_k, causal, t.off, p.scale_log2, m_run, l, sc);
        seesaw::scale_rows(o, sc);
        uint32_t a[kBN / 16][4];
        pack_a<T, kBN>(s, a);
        mbar_wait(v_full(stage), (n >> 1) & 1);
        pv_block(a, stage);
        if (n >= t.check_first) fix_pv(a, stage, n);
        mbar_arrive(v_empty(stage));
      }
    } else if (t.n_blocks > 0) {
      uint32_t a[kBN / 16][4];  // P of the previous block, the A operand of its P V
      {
        float s[kBN / 2], sc[2];
        s_block(s, rb0);
        if constexpr (kPersistent) {
          if (t.n_blocks == 1) mbar_arrive(q_empty);  // the tile's last S
        }
        // Key block 0, or kDiagFirst's causal tile: its last key block.
        softmax_step<kFold, kBN>(s, need_mask(FLASHMLA_FWD_KEY_BLOCK(0)), FLASHMLA_FWD_KEY_BLOCK(0) * kBN, row, tq,
                                 t.sb.s_k, causal, t.off, p.scale_log2, m_run, l, sc);
        pack_a<T, kBN>(s, a);  // O is still 0: no rescale
      }
      if (kPingpong && wg == 1 && t.n_blocks > 1) seesaw::bar_arrive(2, 256);  // warpgroup 0's first turn
      // Step n: S_n with P_{n-1} V_{n-1}. kChecked (the step whose P V is of a checked tile, at most one: the last)
      // adds fix_pv; the loop over the other steps is the plain one. n is the walk position (ring block rb0 + n), its
      // key block FLASHMLA_FWD_KEY_BLOCK(n): n but in kDiagFirst's causal tiles, whose checked P Vs (at most two) are
      // those of their first steps instead.
      auto step = [&](int n, auto checked) {
        constexpr bool kChecked = decltype(checked)::value;
        const int rb = rb0 + n, stage = rb & 1, pstage = stage ^ 1;
        float s[kBN / 2], sc[2];
        FLASHMLA_TRACE_EVENT(wg, rb, 0, trace_thread);
        mbar_wait(k_full(stage), (rb >> 1) & 1);
        // cp.async schedules: V's generic writes are fenced once with K's, before the turn. TMA schedules wait for
        // V after issuing S (below), so that the wait is off the path from the turn to S.
        if constexpr (!kTma) mbar_wait(v_full(pstage), ((rb - 1) >> 1) & 1);
        FLASHMLA_TRACE_EVENT(wg, rb, 1, trace_thread);
        if constexpr (!kTma) gmma::fence_proxy_async();  // as in s_block
        if constexpr (kPingpong) named_barrier_sync(2 + wg, 256);  // this warpgroup's turn
        FLASHMLA_TRACE_EVENT(wg, rb, 2, trace_thread);
        gmma::reg_fence(o);
        gmma::fence();
        issue_s(s, stage);
        gmma::commit();
        if constexpr (kTma) {
          mbar_wait(v_full(pstage), ((rb - 1) >> 1) & 1);
          zero_v_tail(pstage, FLASHMLA_FWD_KEY_BLOCK(n - 1));
          gmma::reg_fence(o);
          gmma::fence();
        }
        issue_pv(a, pstage);
        gmma::commit();
        FLASHMLA_TRACE_EVENT(wg, rb, 3, trace_thread);
        if constexpr (kPingpong) {
          if (!(wg == 1 && n == t.n_blocks - 1)) seesaw::bar_arrive(3 - wg, 256);  // the other's turn
        }
        gmma::wait<1>();  // S_n done (groups complete in order); P_{n-1} V_{n-1} may still run
        gmma::reg_fence(s);
        FLASHMLA_TRACE_EVENT(wg, rb, 4, trace_thread);
        mbar_arrive(k_empty(stage));
        if constexpr (kPersistent) {
          if (n == t.n_blocks - 1) mbar_arrive(q_empty);  // the tile's last S
        }
        softmax_step<kFold, kBN>(s, need_mask(FLASHMLA_FWD_KEY_BLOCK(n)), FLASHMLA_FWD_KEY_BLOCK(n) * kBN, row, tq,
                                 t.sb.s_k, causal, t.off, p.scale_log2, m_run, l, sc);
        // The wait below must stay after the softmax: the softmax runs while P_{n-1} V_{n-1} is in flight. The
        // masked / unmasked forms of softmax_step already end in a join; end_block_after makes the order not
        // depend on that.
        end_block_after(l[0], l[1]);
        FLASHMLA_TRACE_EVENT(wg, rb, 5, trace_thread);
        gmma::wait<0>();
        gmma::reg_fence(o);
        FLASHMLA_TRACE_EVENT(wg, rb, 6, trace_thread);
        if constexpr (kChecked) fix_pv(a, pstage, FLASHMLA_FWD_KEY_BLOCK(n - 1));
        mbar_arrive(v_empty(pstage));
        // Once the lazy max has settled sc is exactly 1 (seesaw::lazy_max): the warp skips its 64 multiplies.
        if (__any_sync(0xffffffffu, sc[0] != 1.f || sc[1] != 1.f)) seesaw::scale_rows(o, sc);
        pack_a<T, kBN>(s, a);
        FLASHMLA_TRACE_EVENT(wg, rb, 7, trace_thread);
      };
#if FLASHMLA_DENSE_PREFILL_FWD_DIAG_FIRST
      if constexpr (kDiagFirst) {
        // Steps 1 .. n_blocks - check_first take the P V of a checked block (walk positions 0 .. n_chk - 1), the
        // rest are plain; a non-causal tile (no checked block, ascending order) runs the plain loop only.
        const int n_checked = min(t.n_blocks, t.n_blocks - t.check_first + 1);
        for (int n = 1; n < n_checked; ++n) step(n, std::true_type{});
        for (int n = n_checked; n < t.n_blocks; ++n) step(n, std::false_type{});
      } else {
        const int n_plain = min(t.n_blocks, t.check_first + 1);
        for (int n = 1; n < n_plain; ++n) step(n, std::false_type{});
        for (int n = n_plain; n < t.n_blocks; ++n) step(n, std::true_type{});
      }
#else
      const int n_plain = min(t.n_blocks, t.check_first + 1);
      for (int n = 1; n < n_plain; ++n) step(n, std::false_type{});
      for (int n = n_plain; n < t.n_blocks; ++n) step(n, std::true_type{});
#endif
      const int rb_last = rb0 + t.n_blocks - 1, last = rb_last & 1;
      mbar_wait(v_full(last), (rb_last >> 1) & 1);
      zero_v_tail(last, FLASHMLA_FWD_KEY_BLOCK(t.n_blocks - 1));
      pv_block(a, last);
      if (FLASHMLA_FWD_KEY_BLOCK(t.n_blocks - 1) >= t.check_first)
        fix_pv(a, last, FLASHMLA_FWD_KEY_BLOCK(t.n_blocks - 1));
      mbar_arrive(v_empty(last));
    }

    // Epilogue: out = O / l (0 for rows without a visible key), lse = ln(l) + m ln 2.
    FLASHMLA_TRACE_EVENT(3, q_tile, 2, tid == 0);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
      l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
    }
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (row[e] >= t.sb.s_q) continue;
      // l == 0: no visible score above -inf. A row without a visible key gets out 0 and lse -inf; a row whose
      // visible keys all score -inf (an inf in q or k: not an empty row) gets out and lse NaN, as the CPU
      // reference (exp(-inf - -inf)) and the softmax of all -inf do.
      const bool has_key = t.sb.s_k > 0 && (!causal || row[e] + t.off >= 0);
      const float inv = l[e] == 0.f ? (has_key ? __int_as_float(0x7fc00000) : 0.f) : 1.f / l[e];
      const int64_t qi = static_cast<int64_t>(t.sb.q0) + row[e];
      T* orow = out + qi * p.o_row + t.h * p.o_head;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int col = 8 * i + 2 * tq;
        *reinterpret_cast<uint32_t*>(orow + col) =
            HalfTraits<T>::pack(o[4 * i + 2 * e] * inv, o[4 * i + 2 * e + 1] * inv);
      }
      if (tq == 0) {
        const float m = m_run[e] == -INFINITY ? 0.f : m_run[e];
        p.lse[qi * p.lse_row + t.h * p.lse_head] =
            l[e] == 0.f ? (has_key ? __int_as_float(0x7fc00000) : -INFINITY) : (m + log2f(l[e])) * kLn2;
      }
    }
    FLASHMLA_TRACE_EVENT(3, q_tile, 3, tid == 0);
  };

  if constexpr (kPersistent) {
    int rb0 = 0, q_tiles = 0;  // ring blocks and Q tiles consumed so far
    for_each_tile([&] {
      run_tile(rb0, q_tiles);
      rb0 += t.n_blocks;
      q_tiles += t.n_blocks > 0;
    });
  } else {
    run_tile(0, 0);
  }
}

template <class T, int kD, FwdSchedule kSchedule, bool kFold = false, int kBN = 128, bool kTilesByBlock = false>
cudaError_t launch_fwd(const KernelParams& kp, const CUtensorMap& tmap_k, const CUtensorMap& tmap_v,
                       const CUtensorMap& tmap_q, int m_tiles, int b, int persistent_ctas, cudaStream_t stream) {
  constexpr bool kPersistent = kSchedule == FwdSchedule::kPersistentTma;
  constexpr bool kTma = kSchedule == FwdSchedule::kPingpongTma || kPersistent;
  constexpr bool kPing = kSchedule == FwdSchedule::kPingpong || kTma;
  auto kernel =
      dense_prefill_fwd_kernel<T, kD, kSchedule != FwdSchedule::kSerial, kPing, kTma, kPersistent, kFold, kBN, kTilesByBlock>;
  constexpr int kSmemBytes = FwdSmem<kD, kBN>::kBytes;
  cudaError_t e = set_max_dynamic_smem(kernel, kSmemBytes);
  if (e != cudaSuccess) return e;
  const dim3 grid = kPersistent ? dim3(persistent_ctas) : dim3(m_tiles, kp.h_q, b);
  const int num_tiles = kPersistent ? m_tiles * kp.h_q * b : 0;  // num_tiles + grid < 2^31 (fwd_with_schedule)
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(kp, tmap_k, tmap_v, tmap_q, m_tiles, num_tiles);
  return cudaGetLastError();
}

}  // namespace dense_prefill

namespace {
Status fwd_value_error(const std::string& what) { return value_error_status("flash_attn_varlen_func", what); }
}  // namespace

int64_t dense_prefill_fwd_workspace_bytes(const DensePrefillParams&) { return 0; }

Status dense_prefill_fwd(const DensePrefillParams& p) {
  return dense_prefill::fwd_with_schedule(p, dense_prefill::kFwdSchedule);
}

namespace dense_prefill {

Status fwd_with_schedule(const DensePrefillParams& p, FwdSchedule schedule, int max_persistent_ctas, bool fold_scale,
                         int key_block, TileOrder order) {
  const int64_t total_q = p.q.shape[0], h_q = p.q.shape[1], d_qk = p.q.shape[2];
  const int64_t d_v = p.v.shape[2];
  const int64_t b = p.cu_seqlens_qo.shape[0] - 1;
  if (total_q == 0 || b <= 0 || p.max_seqlen_qo <= 0) return Status::Ok();
  if (!((d_qk == 128 || d_qk == 192) && d_v == 128))
    return fwd_value_error("no kernel for head_dim_qk=" + std::to_string(d_qk) + " head_dim_vo=" + std::to_string(d_v));
  if (!rows_16b_aligned(p.q, 2) || !rows_16b_aligned(p.k, 2) || !rows_16b_aligned(p.v, 2))
    return fwd_value_error("q, k and v rows must start 16-byte aligned (strides multiples of 8 elements)");
  if (!element_pairs_aligned(p.out, 3))
    return fwd_value_error("out must have an even row / head stride and a 4-byte aligned start");
  if (b > 65535 || h_q > 65535) return fwd_value_error("batch size and h_q must be <= 65535");
  if (p.max_seqlen_qo > (int64_t{1} << 30) || total_q >= (int64_t{1} << 31) || p.k.shape[0] >= (int64_t{1} << 31))
    return fwd_value_error("sequence lengths must be < 2^31");

  KernelParams kp = attention_kernel_params(p);
  kp.out = p.out.data;

  DeviceGuard guard(p.q.device.id);
  if (guard.error() != cudaSuccess) return cuda_error_status("flash_attn_varlen_func", "cudaSetDevice", guard.error());
  const int m_tiles = static_cast<int>((p.max_seqlen_qo + kFwdBM - 1) / kFwdBM);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const bool bf16 = p.q.dtype == DType::kBFloat16;
  const int bi = static_cast<int>(b);
  CUtensorMap tmap_k, tmap_v;
  std::memset(&tmap_k, 0, sizeof(tmap_k));
  std::memset(&tmap_v, 0, sizeof(tmap_v));
  CUtensorMap tmap_q;
  std::memset(&tmap_q, 0, sizeof(tmap_q));
  const int64_t num_tiles = static_cast<int64_t>(m_tiles) * h_q * b;
  // One CTA per SM (the kernel's registers and shared memory allow no second), never more than the tiles.
  int sms = schedule == FwdSchedule::kPersistentTma ? num_sms(p.q.device.id) : 0;
  if (max_persistent_ctas > 0) sms = std::min(sms, max_persistent_ctas);
  // The persistent grid needs a map of q too, and its tile walk indices (up to num_tiles + grid) in int; else the same
  // schedule, one CTA a tile.
  if (schedule == FwdSchedule::kPersistentTma &&
      !(num_tiles + sms <= INT32_MAX && make_tile_map(p.q, kFwdBM, &tmap_q)))
    schedule = FwdSchedule::kPingpongTma;
  // 176-key blocks: the persistent schedule at d_qk 128 only (fwd_key_block; the other schedules and d_qk 192 take 128).
  if (key_block == 0) key_block = fwd_key_block(d_qk, p.causal);
  if (key_block != 176 || schedule != FwdSchedule::kPersistentTma || d_qk != 128) key_block = 128;
  if ((schedule == FwdSchedule::kPingpongTma || schedule == FwdSchedule::kPersistentTma) &&
      !(make_tile_map(p.k, key_block, &tmap_k) && make_tile_map(p.v, key_block, &tmap_v)))
    schedule = FwdSchedule::kPingpong;  // no tensor maps for this layout: the same schedule with cp.async
  const int persistent_ctas = schedule == FwdSchedule::kPersistentTma ? static_cast<int>(std::min<int64_t>(num_tiles, sms)) : 0;
  // The persistent grid's tile order (kByBlock: the folded scale's 128-key kernels only).
  if (order == TileOrder::kShapeRule)
    order = fwd_tile_order(p.causal, num_tiles, sms, h_q / std::max<int64_t>(p.k.shape[1], 1));
  const bool tiles_by_block = order == TileOrder::kByBlock && key_block == 128;
  cudaError_t e;
  auto launch = [&](auto t, auto d) {
    using TT = decltype(t);
    constexpr int kDD = decltype(d)::value;
    switch (schedule) {
      case FwdSchedule::kOverlap:
        return launch_fwd<TT, kDD, FwdSchedule::kOverlap>(kp, tmap_k, tmap_v, tmap_q, m_tiles, bi, 0, stream);
      case FwdSchedule::kPingpong:
        return launch_fwd<TT, kDD, FwdSchedule::kPingpong>(kp, tmap_k, tmap_v, tmap_q, m_tiles, bi, 0, stream);
      case FwdSchedule::kPingpongTma:
        return launch_fwd<TT, kDD, FwdSchedule::kPingpongTma>(kp, tmap_k, tmap_v, tmap_q, m_tiles, bi, 0, stream);
      case FwdSchedule::kPersistentTma:  // the scale folded into the exponent's FMA needs a positive scale
        if constexpr (kDD == 128) {
          if (key_block == 176)
            return fold_scale && kp.scale_log2 > 0.f
                       ? launch_fwd<TT, kDD, FwdSchedule::kPersistentTma, true, 176>(kp, tmap_k, tmap_v, tmap_q,
                                                                                   m_tiles, bi, persistent_ctas, stream)
                       : launch_fwd<TT, kDD, FwdSchedule::kPersistentTma, false, 176>(kp, tmap_k, tmap_v, tmap_q,
                                                                                    m_tiles, bi, persistent_ctas, stream);
        }
        if (fold_scale && kp.scale_log2 > 0.f && tiles_by_block)
          return launch_fwd<TT, kDD, FwdSchedule::kPersistentTma, true, 128, true>(kp, tmap_k, tmap_v, tmap_q, m_tiles,
                                                                                  bi, persistent_ctas, stream);
        return fold_scale && kp.scale_log2 > 0.f
                   ? launch_fwd<TT, kDD, FwdSchedule::kPersistentTma, true>(kp, tmap_k, tmap_v, tmap_q, m_tiles, bi,
                                                                           persistent_ctas, stream)
                   : launch_fwd<TT, kDD, FwdSchedule::kPersistentTma>(kp, tmap_k, tmap_v, tmap_q, m_tiles, bi,
                                                                      persistent_ctas, stream);
      default: return launch_fwd<TT, kDD, FwdSchedule::kSerial>(kp, tmap_k, tmap_v, tmap_q, m_tiles, bi, 0, stream);
    }
  };
  using D128 = std::integral_constant<int, 128>;
  using D192 = std::integral_constant<int, 192>;
  if (d_qk == 128)
    e = bf16 ? launch(__nv_bfloat16{}, D128{}) : launch(__half{}, D128{});
  else
    e = bf16 ? launch(__nv_bfloat16{}, D192{}) : launch(__half{}, D192{});
  if (e != cudaSuccess) return cuda_error_status("flash_attn_varlen_func", "dense_prefill_fwd_kernel launch", e);
  return Status::Ok();
}

}  // namespace dense_prefill
}  // namespace flashmla::sm90
