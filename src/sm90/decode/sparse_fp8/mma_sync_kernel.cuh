// src/sm90/decode/sparse_fp8/mma_sync_kernel.cuh — split-KV sparse (top-k) FP8 MLA decode
// (spec §2.3, §3.2-§3.4, §4.4), mma.sync m16n8k16 tensor cores.
//
// One CTA = (query token sq, head tile of BM = 16/32/64 heads, scheduler
// partition); grid (s_q * head_tiles, num_sm_parts). It walks the (request,
// 64-slot block) range of its partition: a request's blocks are its main
// top-k blocks followed by its extra-cache blocks (one joint softmax; the
// block count matches the scheduler's work of spec §4.2).
//
// Per 64-slot block:
//   1. (issued NS blocks ahead) gather: for each slot, read its index; a slot is
//      valid iff it lies below min(topk, topk_length) and its index is in
//      [0, num_blocks * page_block_size). Valid tokens' FP8 records are copied
//      with cp.async into a raw staging tile (sRaw); invalid ones are zero-filled
//      without reading memory (NaN-poisoned or garbage slots are never touched).
//   2. dequant sRaw -> sK (bf16, 64 x d_qk, swizzled): fp8 -> f16 -> f32 -> bf16
//      (exact), times the tile scale converted to bf16, in bf16 (spec §2.7);
//      RoPE copied. Invalid tokens are all zero, and their scores are set to -inf.
//   3. as the dense mma.sync kernel: 8 warps = R row groups x C column warps;
//      S = Q K^T, online softmax in base 2 (row max exchanged through smem),
//      P (bf16) -> smem, O += P V (V = first 512 dims of K).
// Output: unsplit requests write out (with the attention sink factor) and lse;
// split ones write fp32 partials O/L and log2(L) + m for the combine kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

#include "core/page_division.h"
#include "sm90/decode/sparse_fp8/sparse_decode.h"
#include "sm90/common/decode_schedule.cuh"
#include "sm90/common/mma_core.cuh"
#include "sm90/common/utils.cuh"
#include "sm90/common/host_utils.h"

namespace flashmla::sm90::sparse {

constexpr int kThreads = 256;
constexpr int kBlockN = 64;      // index slots per block (= scheduler block)
constexpr int kRowBytes = 1152;  // smem bytes per Q/K row (576 bf16), also for d_qk 512
constexpr int kRawStride = 656;  // smem bytes per token of the raw FP8 staging tile
constexpr int kDimV = 512;

enum class Fmt { kV32, kModel1 };

template <Fmt F>
struct FmtCfg;
/// A format's head dims and what follows from them: 16-byte chunks of a bf16 row (kChunks), k-steps of
/// S = Q K^T (kKSteps), 16-byte bf16 chunks of the NoPE part (kNopeChunks).
template <int kDQK_, int kNope_>
struct FmtDims {
  static constexpr int kDQK = kDQK_, kNope = kNope_;
  static constexpr int kChunks = kDQK / 8, kKSteps = kDQK / 16, kNopeChunks = kNope / 8;
};
template <>
struct FmtCfg<Fmt::kV32> : FmtDims<576, 512> {
  static constexpr int kTile = 128;
  static constexpr int kRawChunks = 41;  // 16-byte chunks of the 656-byte token record
  static constexpr int kRopeRaw = 528;   // raw offsets of RoPE and scales
  static constexpr int kScaleRaw = 512;
};
template <>
struct FmtCfg<Fmt::kModel1> : FmtDims<512, 448> {
  static constexpr int kTile = 64;
  static constexpr int kRawChunks = 36;  // the 576-byte data record; the 8-byte scale record goes to raw 576
  static constexpr int kRopeRaw = 448;
  static constexpr int kScaleRaw = 576;
};

template <int R, int NS>
struct Cfg : mma_core::Tile<R> {
  using Tile = mma_core::Tile<R>;
  static constexpr int kSmemRawStage = kBlockN * kRawStride;
  static constexpr int kSmemValid = kBlockN * (NS + 1);
  static constexpr int kSmemBytes =
      Tile::kSmemQ + Tile::kSmemK + Tile::kSmemP + Tile::kSmemRed + NS * kSmemRawStage + kSmemValid;
  static_assert(kSmemBytes <= 232448, "shared memory");
};

using mma_core::swz;  // Q / K tile addressing (1152-byte rows, swizzled chunks)

// Gathers of flash_fwd_splitkv_mla_fp8_sparse_kernel, as the small-heads and wgmma producers' gathers
// (docs/sparse-fp8-decode.md): the 16-byte aligned path copies records by cp.async.ca with the L2::256B
// prefetch size (cp_async_16_ca_l2_256): a record's lines are allocated in L1, so a sector that two
// warp instructions share is fetched from L2 once, and L2 fetches 256-byte neighbourhoods from DRAM.
// cp.async has no L1 eviction-priority qualifier; .ca, its L1-allocating form, is the closest to the
// producers' ld L1::evict_last. A token's page block and row come from core::split_page_token (a
// multiply-high by the scope's pbs_magic instead of the ~30 instructions of an integer division and
// remainder), exact for every token index, so the unaligned byte-copy path takes it too. MODEL1's 8-byte
// scale copy is cp.async.ca (cp_async_8).
// H200 (bench/side_by_side_tp.py, the kernel's TP rows, main kernel + combine): ~1.3 % less time than cp.async.cg with
// integer division; the division alone, or with cp.async.cg.L2::256B (no L1 allocation), was within noise.

// cp_async_16 allocating in L1 (.ca), with the L2::256B prefetch size; zero-fills without reading `src`
// when !valid.
__device__ __forceinline__ void cp_async_16_ca_l2_256(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_8(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Byte-wise copy of `n` (multiple of 4) bytes global -> shared, zero if !valid
// (fallback for caches whose base / block stride are not 16-byte aligned).
__device__ __forceinline__ void copy_bytes(uint8_t* dst, const uint8_t* src, int n, bool valid) {
  for (int k = 0; k < n; k += 4) {
    uint32_t w = 0;
    if (valid) {
      w = static_cast<uint32_t>(src[k]) | (static_cast<uint32_t>(src[k + 1]) << 8) |
          (static_cast<uint32_t>(src[k + 2]) << 16) | (static_cast<uint32_t>(src[k + 3]) << 24);
    }
    *reinterpret_cast<uint32_t*>(dst + k) = w;
  }
}

// 8 e4m3 values (little-endian in `w`) -> 8 bf16 (exact), each times `sc` in bf16.
__device__ __forceinline__ uint4 dequant8(uint2 w, __nv_bfloat162 sc) {
  uint32_t r[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t word = j < 2 ? w.x : w.y;
    const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>((word >> (16 * (j & 1))) & 0xFFFFu);
    const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
    const float2 f = __half22float2(h);
    __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    b = __hmul2(b, sc);
    r[j] = *reinterpret_cast<uint32_t*>(&b);
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}

// UE8M0 byte -> bf16 bits of 2^(e-127) (0xFF -> NaN).
__device__ __forceinline__ uint16_t e8m0_to_bf16_bits(uint32_t e) {
  if (e == 0xFFu) return 0x7FC0u;
  if (e == 0u) return 0x0040u;
  return static_cast<uint16_t>(e << 7);
}

/// Blocks of request `req` (spec §4.2 / §4.4): main blocks first, then extra blocks.
/// Must match sparse_work() in src/sm90/common/scheduler.cu.
__device__ __forceinline__ void request_blocks(const SparseDecodeKernelParams& p, int req, int& n_main,
                                               int& n_total) {
  int64_t s = p.main.topk_length != nullptr ? max(p.main.topk_length[req], 0) : p.main.topk;
  if (s == 0) s = 1;
  n_main = static_cast<int>((s + kBlockN - 1) / kBlockN);
  n_total = n_main;
  if (p.has_extra) {
    const int64_t se = p.extra.topk_length != nullptr ? max(p.extra.topk_length[req], 0) : p.extra.topk;
    n_total = n_main + static_cast<int>((se + kBlockN - 1) / kBlockN);
  }
}

/// Request req's valid slot bounds (slots >= a bound are never read): lim_main for the main index set
/// (topk_length[req] clamped to [0, topk], or topk without topk_length), lim_extra for the extra one (0
/// without one).
__device__ __forceinline__ void request_slot_limits(const SparseDecodeKernelParams& p, int req, int& lim_main,
                                                    int& lim_extra) {
  lim_main = p.main.topk_length != nullptr ? min(max(p.main.topk_length[req], 0), p.main.topk) : p.main.topk;
  lim_extra = 0;
  if (p.has_extra)
    lim_extra = p.extra.topk_length != nullptr ? min(max(p.extra.topk_length[req], 0), p.extra.topk) : p.extra.topk;
}

/// topk_length[req] of the main and the extra index set (0 for a set without one), loaded apart from
/// request_blocks / request_slot_limits (below, from the lengths) so that a kernel can issue the loads
/// early (the wgmma producer kernel's prologue, wgmma_producer_kernel.cuh).
struct RequestLengths {
  int main, extra;
};
__device__ __forceinline__ RequestLengths request_lengths(const SparseDecodeKernelParams& p, int req) {
  RequestLengths len{0, 0};
  if (p.main.topk_length != nullptr) len.main = p.main.topk_length[req];
  if (p.has_extra && p.extra.topk_length != nullptr) len.extra = p.extra.topk_length[req];
  return len;
}
/// request_blocks and request_slot_limits of a request whose lengths are `len` (request_lengths).
__device__ __forceinline__ void request_blocks(const SparseDecodeKernelParams& p, RequestLengths len, int& n_main,
                                               int& n_total) {
  int64_t s = p.main.topk_length != nullptr ? max(len.main, 0) : p.main.topk;
  if (s == 0) s = 1;
  n_main = static_cast<int>((s + kBlockN - 1) / kBlockN);
  n_total = n_main;
  if (p.has_extra) {
    const int64_t se = p.extra.topk_length != nullptr ? max(len.extra, 0) : p.extra.topk;
    n_total = n_main + static_cast<int>((se + kBlockN - 1) / kBlockN);
  }
}
__device__ __forceinline__ void request_slot_limits(const SparseDecodeKernelParams& p, RequestLengths len,
                                                    int& lim_main, int& lim_extra) {
  lim_main = p.main.topk_length != nullptr ? min(max(len.main, 0), p.main.topk) : p.main.topk;
  lim_extra = 0;
  if (p.has_extra)
    lim_extra = p.extra.topk_length != nullptr ? min(max(len.extra, 0), p.extra.topk) : p.extra.topk;
}

/// The Q tile of the mma.sync kernels: heads ht * BM .. ht * BM + BM - 1 of query position sq of request
/// req, N_CHUNKS 16-byte chunks a row, into sQ (swz layout; sQ_u its shared address): by cp.async where
/// p.q_vec, else element by element; zeros for heads >= h_q. kThreads threads share it, this one tid;
/// the caller commits and waits for the cp.async group.
template <int BM, int N_CHUNKS, int kThreads>
__device__ __forceinline__ void load_q_tile(const SparseDecodeKernelParams& p, uint8_t* sQ, uint32_t sQ_u, int req,
                                            int sq, int ht, int tid) {
  const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + req * p.q_stride_b + sq * p.q_stride_s;
  for (int id = tid; id < BM * N_CHUNKS; id += kThreads) {
    const int r = id / N_CHUNKS, c = id % N_CHUNKS;
    const int h = ht * BM + r;
    const bool valid = h < p.h_q;
    const __nv_bfloat16* src = valid ? qb + h * p.q_stride_h + c * 8 : static_cast<const __nv_bfloat16*>(p.q);
    if (p.q_vec) {
      cp_async_16(sQ_u + swz(r, c), src, valid);
    } else {
      *reinterpret_cast<uint4*>(sQ + swz(r, c)) = load_chunk16_by_elements(src, valid);
    }
  }
}

/// Head h's output row scale in the main kernel's epilogue: 1 / L (0 for a row without a valid key), times
/// the attention sink's share 1 / (1 + exp(sink - lse)) when the row is final (no_split) and attn_sink is
/// given. lse2: the row's base-2 LSE, log2(L) + m_run (+inf for an empty final row, -inf for an empty split). The
/// same as store_sparse_decode_rows computes inline (kept there as is: its machine code is the measured one).
__device__ __forceinline__ float sparse_decode_row_scale(const SparseDecodeKernelParams& p, float L, float m_run, int h,
                                                         bool no_split, float& lse2) {
  const bool empty = row_sum_empty(L);  // no valid key (a NaN L is not empty)
  lse2 = empty ? (no_split ? INFINITY : -INFINITY) : log2f(L) + m_run;
  float inv = empty ? 0.f : 1.f / L;
  if (no_split && p.attn_sink != nullptr && !empty) inv *= 1.f / (1.f + exp2f(p.attn_sink[h] * kLog2e - lse2));
  return inv;
}

/// Writes the heads head[hh] (hh = 0, 1; heads >= h_q are padding and skipped) of query position sq
/// that this thread holds in an mma-layout accumulator: kFrags fragments of 8 columns in the column
/// group col_group (the warp's or warpgroup's kGroupCols columns), of which the thread holds columns
/// col_group * kGroupCols + 8j + 2tq and +1, read as o_at(j, 2hh) and o_at(j, 2hh + 1). L: the row sums
/// (0 = no valid key: O 0, LSE +inf; NaN stays NaN); m_run: the base-2 row maxima. The threads with
/// col_group 0 and tq 0 write the LSE (one per row). out gets O/L in bf16, scaled by the attention
/// sink's share 1 / (1 + exp(sink - lse)) when attn_sink is given, and lse the natural-log LSE; a split
/// partial gets O/L in fp32 at o_accum row (split_slot, sq, head) and its base-2 LSE.
template <int kFrags, int kGroupCols, typename FragmentAt>
__device__ __forceinline__ void store_sparse_decode_rows(const SparseDecodeKernelParams& p, FragmentAt o_at,
                                                         const float (&L)[2], const float (&m_run)[2],
                                                         const int (&head)[2], int sq, int req, int split_slot,
                                                         bool no_split, int col_group, int tq) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int h = head[hh];
    if (h >= p.h_q) continue;
    const bool empty = row_sum_empty(L[hh]);  // no valid key (a NaN L is not empty)
    const float lse2 = empty ? (no_split ? INFINITY : -INFINITY) : log2f(L[hh]) + m_run[hh];
    if (no_split) {
      float inv = empty ? 0.f : 1.f / L[hh];
      if (p.attn_sink != nullptr && !empty) inv *= 1.f / (1.f + exp2f(p.attn_sink[h] * kLog2e - lse2));
      // out_vec_ok: out's last dim is contiguous with 4-byte aligned pairs.
      __nv_bfloat16* out =
          static_cast<__nv_bfloat16*>(p.out) + req * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h;
#pragma unroll
      for (int j = 0; j < kFrags; ++j) {
        const int col = col_group * kGroupCols + j * 8 + 2 * tq;
        const float v0 = o_at(j, 2 * hh) * inv, v1 = o_at(j, 2 * hh + 1) * inv;
        *reinterpret_cast<uint32_t*>(out + col) = HalfTraits<__nv_bfloat16>::pack(v0, v1);
      }
      if (col_group == 0 && tq == 0)
        p.lse[req * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = empty ? INFINITY : lse2 * kLn2;
    } else {
      const float inv = empty ? 0.f : 1.f / L[hh];
      const int64_t arow = (static_cast<int64_t>(split_slot) * p.s_q + sq) * p.h_q + h;
      float* oa = p.o_accum + arow * kDimV;
#pragma unroll
      for (int j = 0; j < kFrags; ++j) {
        const int col = col_group * kGroupCols + j * 8 + 2 * tq;
        *reinterpret_cast<float2*>(oa + col) = make_float2(o_at(j, 2 * hh) * inv, o_at(j, 2 * hh + 1) * inv);
      }
      if (col_group == 0 && tq == 0) p.lse_accum[arow] = lse2;
    }
  }
}

template <Fmt F, int R, int NS>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_splitkv_mla_fp8_sparse_kernel(const SparseDecodeKernelParams p) {
  launch_dependent_grids();  // the combine after this kernel may be scheduled now (utils.cuh)
  using FC = FmtCfg<F>;
  using CF = Cfg<R, NS>;
  constexpr int BM = CF::BM, C = CF::C, KW = CF::KW, NT_S = CF::NT_S, VW = CF::VW, NT_O = CF::NT_O;
  constexpr int D_QK = FC::kDQK, N_CHUNKS = FC::kChunks, K_STEPS = FC::kKSteps, NOPE_UNITS = FC::kNopeChunks;
  static_assert(NOPE_UNITS % 4 == 0 && (N_CHUNKS - NOPE_UNITS) == 8, "dequant work split");

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + CF::kSmemQ;
  uint8_t* sP = sK + CF::kSmemK;
  float* sRed = reinterpret_cast<float*>(sP + CF::kSmemP);
  uint8_t* sRaw = sP + CF::kSmemP + CF::kSmemRed;
  uint8_t* sValid = sRaw + NS * CF::kSmemRawStage;  // NS x 64 flags (per raw stage)
  uint8_t* sValidCur = sValid + NS * kBlockN;       // 64 flags of the block in sK
  const uint32_t sQ_u = smem_u32(sQ), sK_u = smem_u32(sK), sP_u = smem_u32(sP), sRaw_u = smem_u32(sRaw);

  const int ht = blockIdx.x % p.num_head_tiles;
  const int sq = blockIdx.x / p.num_head_tiles;
  const int part = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rg = warp / C, cw = warp % C;
  const int gq = lane / 4, tq = lane % 4;

  const int32_t* meta = p.tile_scheduler_metadata + part * 8;
  const int begin_req = meta[0], end_req = meta[1], begin_blk = meta[2], end_blk = meta[3];
  const int begin_split = meta[4], first_splitted = meta[5], last_splitted = meta[6];
  if (begin_req >= p.b) return;

  int row_local[2], head[2];
  mma_core::fragment_rows(rg, gq, ht * BM, row_local, head);

  // Gather mapping: 4 threads per token slot.
  const int g_tok = tid / 4, g_q4 = tid % 4;
  // Dequant mapping: 8 consecutive threads = 8 different tokens (conflict-free sK stores).
  const int d_tok = (tid & 7) | ((tid >> 5) << 3), d_sub = (tid >> 3) & 3;

  for (int req = begin_req; req <= end_req; ++req) {
    int n_main, n_total;
    request_blocks(p, req, n_main, n_total);
    const int blk_lo = req == begin_req ? begin_blk : 0;
    const int blk_hi = part_end_block(req, n_total, end_req, end_blk);
    const int n_blk = max(blk_hi - blk_lo, 0);
    bool no_split = part_holds_whole_request(req, begin_req, end_req, first_splitted, last_splitted);
    if (!p.out_vec_ok) no_split = false;  // strided out: every request goes through the combine kernel
    const int split_slot = part_split_slot(p.num_splits, req, begin_req, begin_split);

    int lim_main, lim_extra;
    request_slot_limits(p, req, lim_main, lim_extra);

    cp_async_wait<0>();
    __syncthreads();  // the previous request is done with every buffer

    // Index of slot g_tok of block `blk` (index within the request), -1 past the valid bound.
    auto fetch_idx = [&](int blk) -> int {
      const bool is_extra = p.has_extra && blk >= n_main;
      // int64: the block count comes from topk_length (not clamped to topk), so with a
      // topk_length near INT32_MAX an int slot would wrap negative and pass the bound check.
      const int64_t slot = static_cast<int64_t>(is_extra ? blk - n_main : blk) * kBlockN + g_tok;
      const int lim = is_extra ? lim_extra : lim_main;
      if (slot >= lim) return -1;
      const int32_t* ind = is_extra ? p.extra.indices : p.main.indices;
      const int64_t isb = is_extra ? p.extra.idx_stride_b : p.main.idx_stride_b;
      const int64_t iss = is_extra ? p.extra.idx_stride_s : p.main.idx_stride_s;
      const int64_t isk = is_extra ? p.extra.idx_stride_k : p.main.idx_stride_k;
      return __ldg(ind + (req * isb + sq * iss + static_cast<int64_t>(slot) * isk));
    };
    // The index of the next block to gather is loaded one gather ahead (it is
    // consumed an iteration later), so no gather waits on an index load.
    int pf_idx = -1;

    // Issue the gather of block `blk` (index within the request) into raw stage `st`.
    // Blocks are gathered in order blk_lo, blk_lo + 1, ...; pf_idx holds blk's index.
    auto load_raw = [&](int blk, int st) {
      const int idx = pf_idx;
      if (blk + 1 < blk_hi) pf_idx = fetch_idx(blk + 1);
      const bool is_extra = p.has_extra && blk >= n_main;
      const int num_tokens = is_extra ? p.extra.num_tokens : p.main.num_tokens;
      const uint8_t* cache = is_extra ? p.extra.cache : p.main.cache;
      const int64_t bstride = is_extra ? p.extra.block_stride : p.main.block_stride;
      const int pbs = is_extra ? p.extra.page_block_size : p.main.page_block_size;
      const int vec = is_extra ? p.extra.vec : p.main.vec;
      const bool valid = idx >= 0 && idx < num_tokens;
      const uint32_t u_idx = valid ? static_cast<uint32_t>(idx) : 0u;
      uint32_t blk_id;
      int32_t row;
      core::split_page_token(u_idx, static_cast<uint32_t>(pbs), is_extra ? p.extra.pbs_magic : p.main.pbs_magic,
                             blk_id, row);  // no integer divider
      const uint8_t* block_base = cache + static_cast<int64_t>(blk_id) * bstride;
      const uint8_t* rec = block_base + static_cast<int64_t>(row) * (F == Fmt::kV32 ? 656 : 576);
      uint8_t* dst = sRaw + st * CF::kSmemRawStage + g_tok * kRawStride;
      const uint32_t dst_u = sRaw_u + st * CF::kSmemRawStage + g_tok * kRawStride;
      if (vec) {
        for (int c = g_q4; c < FC::kRawChunks; c += 4)
          cp_async_16_ca_l2_256(dst_u + c * 16, valid ? static_cast<const void*>(rec + c * 16) : cache, valid);
        if constexpr (F == Fmt::kModel1) {
          if (g_q4 == 0)
            cp_async_8(dst_u + FC::kScaleRaw,
                       valid ? static_cast<const void*>(block_base + static_cast<int64_t>(pbs) * 576 + row * 8)
                             : cache,
                       valid);
        }
      } else {
        for (int c = g_q4; c < FC::kRawChunks; c += 4) copy_bytes(dst + c * 16, rec + c * 16, 16, valid);
        if constexpr (F == Fmt::kModel1) {
          if (g_q4 == 0)
            copy_bytes(dst + FC::kScaleRaw, block_base + static_cast<int64_t>(pbs) * 576 + row * 8, 8, valid);
        }
      }
      if (g_q4 == 0) sValid[st * kBlockN + g_tok] = valid ? 1 : 0;
    };

    if (n_blk > 0) {
      pf_idx = fetch_idx(blk_lo);
      load_q_tile<BM, N_CHUNKS, kThreads>(p, sQ, sQ_u, req, sq, ht, tid);
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        if (s < n_blk) load_raw(blk_lo + s, s);
        cp_async_commit();
      }
    }

    float o[NT_O][4], m_run[2], l_run[2];
    mma_core::reset_rows(o, m_run, l_run);

    for (int i = 0; i < n_blk; ++i) {
      const int st = i % NS;
      cp_async_wait<NS - 1>();
      __syncthreads();  // raw block i landed (all threads); everyone is done with sK / sP of block i-1

      // ---- dequant sRaw[st] -> sK
      {
        const uint8_t* rt = sRaw + st * CF::kSmemRawStage + d_tok * kRawStride;
        if (d_sub == 0) sValidCur[d_tok] = sValid[st * kBlockN + d_tok];
#pragma unroll
        for (int j = 0; j < NOPE_UNITS / 4; ++j) {
          const int u = d_sub + 4 * j;
          const int tile = (u * 8) / FC::kTile;
          __nv_bfloat162 sc;
          if constexpr (F == Fmt::kV32) {
            const float s = *reinterpret_cast<const float*>(rt + FC::kScaleRaw + 4 * tile);
            sc = __float2bfloat162_rn(s);
          } else {
            const uint16_t bits = e8m0_to_bf16_bits(rt[FC::kScaleRaw + tile]);
            __nv_bfloat16_raw br;
            br.x = bits;
            const __nv_bfloat16 b1(br);
            sc = __nv_bfloat162(b1, b1);
          }
          const uint2 w = *reinterpret_cast<const uint2*>(rt + u * 8);
          *reinterpret_cast<uint4*>(sK + swz(d_tok, u)) = dequant8(w, sc);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int u = d_sub + 4 * j;  // RoPE chunk 0..7
          *reinterpret_cast<uint4*>(sK + swz(d_tok, NOPE_UNITS + u)) =
              *reinterpret_cast<const uint4*>(rt + FC::kRopeRaw + u * 16);
        }
      }
      __syncthreads();  // sK / sValidCur ready; raw stage st is free
      if (i + NS < n_blk) load_raw(blk_lo + i + NS, st);
      cp_async_commit();

      // ---- S = Q K^T, validity mask, online softmax, O += P V for this warp's keys and value columns
      mma_core::valid_key_block<__nv_bfloat16, NT_S, NT_O, C, KW, VW>(
          o, m_run, l_run, sQ_u, sK_u, sValidCur, p.scale_log2, sRed, sP, sP_u, row_local, rg, cw, lane, tq, K_STEPS);
    }

    // ---- epilogue: total row sum across the row group's warps
    float L[2];
    mma_core::row_sums<C>(l_run, L, n_blk, sRed, row_local, rg, cw, tq);

    store_sparse_decode_rows<NT_O, VW>(
        p, [&](int j, int e) { return o[j][e]; }, L, m_run, head, sq, req, split_slot, no_split, cw, tq);
  }
}

template <Fmt F, int R, int NS>
cudaError_t launch_main_r(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  constexpr int smem = Cfg<R, NS>::kSmemBytes;
  auto kernel = flash_fwd_splitkv_mla_fp8_sparse_kernel<F, R, NS>;
  cudaError_t e = set_max_dynamic_smem(kernel, smem);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(kp.s_q) * static_cast<unsigned>(kp.num_head_tiles),
                  static_cast<unsigned>(num_sm_parts), 1);
  kernel<<<grid, kThreads, smem, stream>>>(kp);
  return cudaGetLastError();
}

/// Rows per CTA tile from h_q (16-row mma tiles: no padding of small head counts to 64).
inline int tile_rows_for(int h_q) { return h_q <= 16 ? 16 : (h_q <= 32 ? 32 : 64); }

template <Fmt F>
cudaError_t launch_main(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  const int bm = tile_rows_for(kp.h_q);
  if (bm == 16) return launch_main_r<F, 1, 3>(kp, num_sm_parts, stream);
  if (bm == 32) return launch_main_r<F, 2, 2>(kp, num_sm_parts, stream);
  return launch_main_r<F, 4, 1>(kp, num_sm_parts, stream);
}

}  // namespace flashmla::sm90::sparse
