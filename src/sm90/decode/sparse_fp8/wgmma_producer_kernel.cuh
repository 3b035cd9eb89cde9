// src/sm90/decode/sparse_fp8/wgmma_producer_kernel.cuh — sparse FP8 MLA decode with a producer warpgroup
// and two wgmma consumer warpgroups, for 64-row head tiles (rows past h_q masked):
// one 64-slot block per step over two whole-block K buffers, so the producers fill block g + 1
// while the consumers work on block g, which keeps both buffers busy in every step (x1.24 over
// running the prefill's seesaw over block pairs; docs/sparse-fp8-decode.md).
//
// CTA = (query token sq, head tile of 64 heads, scheduler partition), grid (s_q * head_tiles,
// num_sm_parts) as the mma.sync kernel (mma_sync_kernel.cuh), walking the same (request, 64-slot
// block) range; the CTA's blocks are numbered g = 0, 1, ... across its requests, block g uses buffer
// g & 1. 384 threads:
//   * warpgroup 0 (setmaxnreg kWg0Regs): per block S = Q K^T (m64n64k16 chains over the 9 or 8
//     slabs; two parts: slabs 0-3, slabs 4-8), masking (spec §2.7 invalid slots), the online
//     softmax (m, l for whole rows), P (bf16) into registers and into slab 8 of the block's buffer
//     (for d_qk 576 that is the RoPE slab S is done with; d_qk 512 leaves slab 8 free), the row
//     rescale factor into sScale[buffer]; then O[:, 0:256] = O * scale + P V[:, 0:256] and the release
//     of part A (slabs 0-3).
//   * warpgroup 1 (setmaxnreg kWg1Regs): per block, after warpgroup 0's P barrier, O[:, 256:512] =
//     O * scale + P V[:, 256:512] from slab 8 and slabs 4-7, then the release of part B (slabs 4-8).
//   * warpgroup 2 (producer, setmaxnreg kProdRegs; FlashMLA's mapping): lanes 8q + i of warp w
//     own rows 8w + i and 8w + i + 32 of every block and the 16-byte quarter q of each 64-dim
//     group of them. Each thread loads its rows' cache indices one block ahead and computes their
//     record addresses itself (after part A; FLASHMLA_SPARSE_DECODE_NO_L2_PREFETCH=0 adds an L2
//     prefetch of the next block's records there), loads both parts' FP8 bytes and scales (and, by
//     default, its rows' RoPE bytes) into registers before its first wait, then per part waits until
//     the consumers released it, dequantizes exactly (spec §2.7: fp8 -> f16 -> f32 -> bf16, times
//     the tile scale in bf16, mma_sync_kernel.cuh's dequant8) into the 128B-swizzled slabs (8
//     consecutive rows per store: no bank conflict), stores the RoPE bf16 bytes (part B;
//     FLASHMLA_SPARSE_DECODE_ROPE_MODE) and arrives on the part's full barrier (one arrival per warp
//     + 128 cp.async noinc arrivals).
//     One producer warpgroup at 128 registers with this mapping and one arrival per warp beat two
//     at 64 registers (8 threads per row, a shared address table): anchor geomean 0.699 -> 0.844.
// Per request: Q reload behind a consumer barrier (both consumer warpgroups copy), then its blocks,
// then out + lse (attention sink) or fp32 partials for the combine (spec §4.5).
// Only for 16-byte aligned caches (other caches take the mma.sync kernel's byte-copy path); q rows
// may be unaligned.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/page_division.h"
#include "sm90/common/host_utils.h"
#include "sm90/common/decode_schedule.cuh"
#include "sm90/common/seesaw.cuh"
#include "sm90/decode/sparse_fp8/mma_sync_kernel.cuh"
#include "sm90/common/trace.cuh"
#include "sm90/common/wgmma.cuh"

// ---- Optional event timeline (diagnostics only: tools/trace/sparse_decode_trace.cu). Without
// FLASHMLA_TRACE every FLASHMLA_SPARSE_DECODE_TRACE_* below expands to nothing and the machine code is unchanged.
// Uses trace.cuh's buffer, constants and symbols (g_trace, g_trace_every, g_trace_slots) with this
// kernel's own CTA numbering: the grid is (s_q * head tiles, num_sm_parts), so the traced CTA id is
// blockIdx.y * gridDim.x + blockIdx.x (trace.cuh's FLASHMLA_TRACE_DECL keys on blockIdx.x alone, which
// would make the partitions of one head tile write the same records). Record layout as trace.cuh:
// g_trace[((slot * kRoles + role) * kMaxSteps + step) * kEvents + event], slot = id / g_trace_every.
// Roles 0, 1: consumer warpgroups 0, 1; role 2: the producer warpgroup; all three keyed by the CTA's
// running block counter g (0, 1, ... across all of the CTA's (request, split) items, the same sequence
// in every role) minus g_sparse_decode_trace_step0 (a window offset; steps outside 0 .. kMaxSteps-1 are
// dropped). Role 3 (CTA): step r = the request's ordinal in the CTA (req - begin_req, r < kMaxSteps - 1),
// step kMaxSteps - 1 the CTA's summary. Values are clock64() of the CTA's SM unless noted. Each
// (role, step, event) has exactly one writer thread (thread 0 of the role's warpgroup; role 3 as
// listed). The events are plain global stores, no barrier or fence.
//   role 0 (WG0, tid 0):   0 step start = before the full wait of part A, 1 part A full, 2 S part-A
//                          wgmmas issued, 3 part B full, 4 S done (wgmma wait), 5 softmax done (P stored,
//                          fenced), 6 P V_L issued (commit), 7 P announced (bar.arrive), 8 P V_L done,
//                          9 part A released
//   role 1 (WG1, tid 128): 0 step start = before the P barrier, 1 P barrier passed, 2 before the full
//                          wait of part B (after the O rescale in program order; the compiler may move
//                          the FMULs), 3 part B full, 4 P V_R issued, 5 P V_R done, 6 part B released
//   role 2 (producer, tid 256): 0 block start, 1 part A and B FP8 loads issued = before the free wait
//                          of part A, 2 part A free, 3 part A dequantized + stored, 4 part A arrived,
//                          5 next addresses = before the free wait of part B, 6 part B free, 7 part B
//                          (and RoPE cp.async) stored, 8 part B arrived, 9 step done (after the next
//                          block's addresses where they are computed late, kLateAddr)
//   role 3, step r (request r of the CTA): 0 WG0 request start, 1 WG0 first consumer barrier passed
//                          (Q copy starts), 2 WG0 Q loaded (second barrier passed), 3 WG0 epilogue start,
//                          4 WG0 epilogue barrier passed, 5 WG0 epilogue end, 6 WG1 epilogue start
//                          (tid 128), 7 WG1 epilogue end (tid 128) (events 0-7 only when the request has
//                          blocks), 8 value: g of the request's first block, 9 value: its block count
//                          n_blk, 10 value: req, 11 value: no_split (8-11 always)
//   role 3, step kMaxSteps - 1 (tid 0): 0 entry, 1 barriers initialised, 2 consumers done (warpgroup 0 only), 3 exit (after
//                          the cluster sync), 4 %globaltimer (ns) at entry, 5 %globaltimer at exit,
//                          6 value %smid, 7 value cluster rank, 8 value blocks of the CTA (final g),
//                          9 value begin_req, 10 value end_req, 11 value 0x100 | 2 * (V32) | kCluster
#ifdef FLASHMLA_TRACE
__device__ int g_sparse_decode_trace_step0 = 0;  // window: blocks step0 .. step0 + kMaxSteps - 1 of every CTA
__device__ __forceinline__ unsigned long long flashmla_sparse_decode_trace_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long flashmla_sparse_decode_trace_smid() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(r));
  return r;
}
#define FLASHMLA_SPARSE_DECODE_TRACE_DECL()                                                          \
  const unsigned flashmla_sparse_decode_trace_id_ = blockIdx.y * gridDim.x + blockIdx.x;             \
  unsigned long long* const flashmla_sparse_decode_trace_cta_ =                                      \
      (g_trace != nullptr &&                                                                         \
       flashmla_sparse_decode_trace_id_ % static_cast<unsigned>(g_trace_every) == 0u &&              \
       static_cast<int>(flashmla_sparse_decode_trace_id_ / static_cast<unsigned>(g_trace_every)) <   \
           g_trace_slots)                                                                            \
          ? g_trace + static_cast<long long>(flashmla_sparse_decode_trace_id_ /                      \
                                             static_cast<unsigned>(g_trace_every)) *                 \
                          (::flashmla::sm90::trace::kRoles * ::flashmla::sm90::trace::kMaxSteps *    \
                           ::flashmla::sm90::trace::kEvents)                                         \
          : nullptr;                                                                                 \
  const int flashmla_sparse_decode_trace_step0_ = g_sparse_decode_trace_step0
// `value` is evaluated only by the writing thread of a traced CTA, after the checks.
#define FLASHMLA_SPARSE_DECODE_TRACE_PUT(role, step, event, first_thread, value)                     \
  do {                                                                                               \
    const int flashmla_sparse_decode_trace_s_ = (step);                                              \
    if (flashmla_sparse_decode_trace_cta_ != nullptr && (first_thread) &&                            \
        flashmla_sparse_decode_trace_s_ >= 0 &&                                                      \
        flashmla_sparse_decode_trace_s_ < ::flashmla::sm90::trace::kMaxSteps)                        \
      flashmla_sparse_decode_trace_cta_[((role) * ::flashmla::sm90::trace::kMaxSteps +               \
                                         flashmla_sparse_decode_trace_s_) *                          \
                                            ::flashmla::sm90::trace::kEvents +                       \
                                        (event)] = static_cast<unsigned long long>(value);           \
  } while (0)
// Role 0-2 event of block g (window offset applied).
#define FLASHMLA_SPARSE_DECODE_TRACE_BLK(role, g, event, first_thread) \
  FLASHMLA_SPARSE_DECODE_TRACE_PUT(role, (g) - flashmla_sparse_decode_trace_step0_, event, first_thread, clock64())
// Role 3 event / value of request ordinal r (only r < kMaxSteps - 1).
#define FLASHMLA_SPARSE_DECODE_TRACE_REQ(r, event, first_thread)                                        \
  FLASHMLA_SPARSE_DECODE_TRACE_PUT(3, r, event, (first_thread) && (r) < ::flashmla::sm90::trace::kMaxSteps - 1, \
                                   clock64())
#define FLASHMLA_SPARSE_DECODE_TRACE_REQ_VAL(r, event, first_thread, value)                             \
  FLASHMLA_SPARSE_DECODE_TRACE_PUT(3, r, event, (first_thread) && (r) < ::flashmla::sm90::trace::kMaxSteps - 1, \
                                   value)
// Role 3 summary step.
#define FLASHMLA_SPARSE_DECODE_TRACE_CTA(event, first_thread, value) \
  FLASHMLA_SPARSE_DECODE_TRACE_PUT(3, ::flashmla::sm90::trace::kMaxSteps - 1, event, first_thread, value)
#else
#define FLASHMLA_SPARSE_DECODE_TRACE_DECL() static_assert(true, "")
#define FLASHMLA_SPARSE_DECODE_TRACE_BLK(...) static_cast<void>(0)
#define FLASHMLA_SPARSE_DECODE_TRACE_REQ(...) static_cast<void>(0)
#define FLASHMLA_SPARSE_DECODE_TRACE_REQ_VAL(...) static_cast<void>(0)
#define FLASHMLA_SPARSE_DECODE_TRACE_CTA(...) static_cast<void>(0)
#endif

namespace flashmla::sm90::sparse::wgmma_producer {

using namespace seesaw;

constexpr int kThreads = 384;
constexpr int kConsumers = 256;
constexpr int kProducers = 128;
// Register split of the CTA's pool (384 x 168, moved by setmaxnreg): S + softmax + half of O /
// half of O / producers.
constexpr int kLaunchRegs = 168;
// Build switch (A/B): 0 adds the producer's L2 bulk prefetch of the next block's records (and, MODEL1,
// a prefetch.global.L2 of their scale records). Off by default: on an H200 the gathers alone were
// 3-4 % faster (V3.2 b 128, peak case), the prefetch's extra L2 traffic costing more than it hid.
#ifndef FLASHMLA_SPARSE_DECODE_NO_L2_PREFETCH
#define FLASHMLA_SPARSE_DECODE_NO_L2_PREFETCH 1
#endif
// The setmaxnreg split: warpgroup 0 / warpgroup 1 / producer. The producer-bound kernel runs fastest with
// the producer's budget as wide as the consumers allow: warpgroup 0 spills below 208, warpgroup 1
// serializes its wgmma below 160 (C7512), and the producer gets the rest of the 384 x 168 pool (on an H200
// 0.9-1.8 % faster on the h_q 128 cases than 216 / 160 / 128; docs/sparse-fp8-decode.md, "A wider producer
// register budget").
constexpr int kWg0Regs = 208;
constexpr int kWg1Regs = 160;
constexpr int kProdRegs = 136;
static_assert(128 * kWg0Regs + 128 * kWg1Regs + kProducers * kProdRegs <= kThreads * kLaunchRegs,
              "register pool of the CTA");
static_assert(kWg0Regs >= kLaunchRegs && kProdRegs <= kLaunchRegs, "setmaxnreg directions");
// Barrier arrivals: one lane per warp after __syncwarp (the consumers' releases, the producers'
// plain arrivals; every thread arriving was 2-3% slower on V3.2); the cp.async arrivals
// stay per thread. Full barrier: 4 warp arrivals + 128 cp.async noinc arrivals.
constexpr int kFullCount = kProducers / 32 + kProducers;
constexpr int kTileBytes = 9 * kSlabBytes;  // 64 rows x 576 dims (slab 8 also holds P)

// (Variants of warpgroup 0's block step that were measured and not kept: a tree row max of the raw S
// with P = exp2(fma(S, c, -m)) lost, x0.992 kernel geomean; P's proxy fence after the P V_L issue
// was neutral, x1.002; S(g + 1) issued ahead: at warpgroup 0's loop.)

/// Where part PT of a block gets its data, per format. The FP8 bytes of a record come in 64-dim
/// groups (64 bytes, bf16 chunks 8d .. 8d + 7); part A is groups 0-3 (dims 0-255), part B groups
/// 4..kNope/64 - 1. A producer thread takes the 16-byte quarter j (dims 16j .. 16j + 15, chunks
/// 8d + 2j and 8d + 2j + 1) of every group of its rows. RoPE (bf16, 8 chunks, two per thread:
/// j and 4 + j) belongs to part B: slab 8 (V32, chunks 64-71) or slab 7 (MODEL1, chunks 56-63).
template <Fmt F, int PT>
struct PartMap {
  using FC = FmtCfg<F>;
  static constexpr int kG0 = PT == 0 ? 0 : 4;                       // first 64-dim group
  static constexpr int kGroups = PT == 0 ? 4 : FC::kNope / 64 - 4;  // 4, then 4 (V32) or 3 (MODEL1)
  static constexpr int kRopeChunk0 = FC::kNope / 8;                 // 64 or 56
  static constexpr int kRecBytes = F == Fmt::kV32 ? 656 : 576;
};

/// The fields of a cache scope that address its records, held in registers by the producer (a
/// reference into the kernel parameters selected by main / extra made each an indexed constant load
/// on the address path).
struct ScopeAddr {
  const uint8_t* cache;
  int64_t block_stride;  // bytes
  uint32_t pbs, pbs_magic;  // page_block_size and ceil(2^32 / page_block_size) (0 when it is 1)
  int num_tokens;
};

__device__ __forceinline__ ScopeAddr scope_addr(const SparseScope& sc) {
  return {sc.cache, sc.block_stride, static_cast<uint32_t>(sc.page_block_size), sc.pbs_magic, sc.num_tokens};
}

/// Byte address of the record (and, MODEL1, of the 8-byte scale record) of cache token `u`
/// (0 <= u < num_tokens < 2^31; spec §3.2-3.4 layouts), its page block by multiplication
/// (core/page_division.h: the GPU has no integer divider, and the division's ~25 dependent
/// instructions per row sat on the producer's critical path).
template <Fmt F>
__device__ __forceinline__ void row_addr(const ScopeAddr& sc, uint32_t u, uint64_t& rec, uint64_t& scale) {
  uint32_t blk;
  int32_t row;
  core::split_page_token(u, sc.pbs, sc.pbs_magic, blk, row);
  const uint8_t* base = sc.cache + static_cast<int64_t>(blk) * sc.block_stride;
  if constexpr (F == Fmt::kV32) {
    rec = reinterpret_cast<uint64_t>(base + static_cast<int64_t>(row) * 656);
    scale = rec + FmtCfg<F>::kScaleRaw;
  } else {
    rec = reinterpret_cast<uint64_t>(base + static_cast<int64_t>(row) * 576);
    scale = reinterpret_cast<uint64_t>(base + static_cast<int64_t>(sc.pbs) * 576 + static_cast<int64_t>(row) * 8);
  }
}

/// A producer thread's two rows of the current block: record / scale addresses (0 = invalid slot).
struct RowAddr {
  uint64_t rec[2], scl[2];
};

/// One row's FP8 bytes of a part (this thread's quarter of each group) and its scales.
template <Fmt F, int PT>
struct RowPart {
  uint4 u[PartMap<F, PT>::kGroups];
  uint2 sc;  // V32: the fp32 scales of the part's two 128-dim tiles; MODEL1: the 8-byte e8m0 record
};

// Cache policy of the producer's FP8 gathers (build switch, default 1):
//   0: ldg16 / ldg8, L1::no_allocate (each 64-byte group goes to L2 on its own);
//   1: ldg16_evict_last_l2_256 / ldg8_evict_last (utils.cuh): the record's lines are allocated in L1,
//      so the groups of one record that share a 128-byte line (V3.2 records are 656 bytes, only
//      16-byte aligned) are one L2 request, and L2 fetches 256-byte neighbourhoods from DRAM.
//   (L1::evict_last without the L2 hint measured no better than 1; docs/sparse-fp8-decode.md.)
// Where the cluster kernel's producer turns the next block's cache indices into record addresses
// (build switch, default 1): 0 right after part A's arrival (where the L2 prefetch of
// FLASHMLA_SPARSE_DECODE_NO_L2_PREFETCH=0 needs them), 1 after part B's arrival, so that waiting for
// the index loads does not delay part B. With indices two blocks ahead (below) the cluster kernel ran
// V3.2 b128 -3.9 %, peak h128 d576 -4.3 %; the plain kernel keeps 0 and one block ahead (the same
// pair made its V3.2 h64 peak case 11.5 % slower). docs/sparse-fp8-decode.md.
#ifndef FLASHMLA_SPARSE_DECODE_NEXT_ADDR_LATE
#define FLASHMLA_SPARSE_DECODE_NEXT_ADDR_LATE 1
#endif
// How far ahead the cluster kernel's producer loads its rows' cache indices (build switch, default 2):
// 1 = block g + 1's at the start of step g; 2 = block g + 2's, a whole step earlier.
#ifndef FLASHMLA_SPARSE_DECODE_INDEX_AHEAD
#define FLASHMLA_SPARSE_DECODE_INDEX_AHEAD 2
#endif
// Where the RoPE bf16 bytes of a block come from (build switch, default 2):
//   0: cp.async.cg of all 64 rows into each CTA (L2 -> shared memory, no L1 allocation);
//   1: the same with cp.async.ca (allocated in L1: the CTA's own rows' RoPE lines are also the lines
//      of their scales and last FP8 group);
//   2: through registers, loaded with the FP8 bytes under FLASHMLA_SPARSE_DECODE_FP8_LOAD_POLICY; a
//      cluster CTA loads only the rows it dequantizes and sends them to the peer (bulk copy, V3.2 st.async).
#ifndef FLASHMLA_SPARSE_DECODE_ROPE_MODE
#define FLASHMLA_SPARSE_DECODE_ROPE_MODE 2
#endif
// Block 0's gathers before the producer's index look-ahead (build switch, default 0; docs/sparse-fp8-decode.md,
// "Block 0's gathers before the look-ahead"). 0: as every step, the producer's first step walks the schedule to
// the next blocks and issues their index loads (cluster: block 1's before the loop and block 2's at the top of
// step 0; plain: block 1's at the top of step 0) before it issues block 0's gathers, so ~250 instructions of
// request walk and index address arithmetic (V3.2 cluster SASS) run between block 0's index arriving and block
// 0's first gather, on the chain to the CTA's first S. 1: in step 0 only, block 0's gathers are issued first and
// the same walks and index loads follow them (hidden under the gathers' round trip); steps g > 0 keep the
// order of 0. Only the issue order changes: the same loads from the same addresses under the same predicates,
// and no barrier, wait, arrival or copy moves (see the step-0 comment in the producer).
#ifndef FLASHMLA_SPARSE_DECODE_B0_GATHERS_FIRST
#define FLASHMLA_SPARSE_DECODE_B0_GATHERS_FIRST 0
#endif
#ifndef FLASHMLA_SPARSE_DECODE_FP8_LOAD_POLICY
#define FLASHMLA_SPARSE_DECODE_FP8_LOAD_POLICY 1
#endif
__device__ __forceinline__ uint4 ldg16_fp8(const uint8_t* a) {
  return FLASHMLA_SPARSE_DECODE_FP8_LOAD_POLICY == 0 ? ldg16(a) : ldg16_evict_last_l2_256(a);
}
__device__ __forceinline__ uint2 ldg8_fp8(const uint8_t* a) {
  return FLASHMLA_SPARSE_DECODE_FP8_LOAD_POLICY == 0 ? ldg8(a) : ldg8_evict_last(a);
}

/// Loads part PT of the row at `rec` (zeros for an invalid row: rec == 0).
template <Fmt F, int PT>
__device__ __forceinline__ void row_part_load(RowPart<F, PT>& r, uint64_t rec, uint64_t scl, int j) {
  using M = PartMap<F, PT>;
  const uint8_t* a = reinterpret_cast<const uint8_t*>(rec);
#pragma unroll
  for (int d = 0; d < M::kGroups; ++d) r.u[d] = make_uint4(0u, 0u, 0u, 0u);
  r.sc = make_uint2(0u, 0u);
  if (a != nullptr) {
#pragma unroll
    for (int d = 0; d < M::kGroups; ++d) r.u[d] = ldg16_fp8(a + 64 * (M::kG0 + d) + 16 * j);
    if constexpr (F == Fmt::kV32) r.sc = ldg8_fp8(a + FmtCfg<F>::kScaleRaw + 4 * (M::kG0 / 2));
    else r.sc = ldg8_fp8(reinterpret_cast<const uint8_t*>(scl));
  }
}

/// The bf16 scale of group kG0 + d (spec §2.7: V32 fp32 tile scale rounded to bf16; MODEL1 e8m0).
template <Fmt F, int PT>
__device__ __forceinline__ __nv_bfloat162 group_scale(uint2 sc, int d) {
  if constexpr (F == Fmt::kV32) {
    return __float2bfloat162_rn(__uint_as_float(d < 2 ? sc.x : sc.y));  // 128-dim tiles kG0 / 2 + d / 2
  } else {
    const int g = PartMap<F, PT>::kG0 + d;  // 64-dim tiles
    const uint32_t word = g < 4 ? sc.x : sc.y;
    __nv_bfloat16_raw br;
    br.x = e8m0_to_bf16_bits((word >> (8 * (g & 3))) & 0xFFu);
    const __nv_bfloat16 b1(br);
    return __nv_bfloat162(b1, b1);
  }
}

/// Dequantizes part PT of one row exactly (spec §2.7, mma_sync_kernel.cuh's dequant8) and hands each
/// 16-byte chunk to put(byte offset in the buffer, value).
template <Fmt F, int PT, class Put>
__device__ __forceinline__ void row_part_store(const RowPart<F, PT>& r, int row, int j, Put&& put) {
  using M = PartMap<F, PT>;
#pragma unroll
  for (int d = 0; d < M::kGroups; ++d) {
    const __nv_bfloat162 s = group_scale<F, PT>(r.sc, d);
    const int c = 8 * (M::kG0 + d) + 2 * j;
    put(slab_off(row, c), dequant8(make_uint2(r.u[d].x, r.u[d].y), s));
    put(slab_off(row, c + 1), dequant8(make_uint2(r.u[d].z, r.u[d].w), s));
  }
}

/// RoPE of one row (bf16, no conversion) by cp.async: chunks j and 4 + j; an invalid row is
/// zero-filled (MODEL1's RoPE dims are part of V).
template <Fmt F>
__device__ __forceinline__ void row_rope(uint64_t rec, int row, int j, uint32_t sKx_u, const void* any_global) {
  const uint8_t* a = reinterpret_cast<const uint8_t*>(rec);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int c = 4 * k + j;
    const uint32_t dst = sKx_u + slab_off(row, PartMap<F, 1>::kRopeChunk0 + c);
    const uint8_t* src = a != nullptr ? a + FmtCfg<F>::kRopeRaw + 16 * c : static_cast<const uint8_t*>(any_global);
#if FLASHMLA_SPARSE_DECODE_ROPE_MODE == 1
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(a != nullptr ? 16 : 0)
                 : "memory");
#else
    cp_async_16(dst, src, a != nullptr);
#endif
  }
}

/// RoPE mode 2: a row's RoPE chunks j and 4 + j through registers (loaded with the FP8 bytes, with
/// the same cache policy, so they share the record's L1 lines), zeros for an invalid row.
struct RowRope {
  uint4 v[2];
};
template <Fmt F>
__device__ __forceinline__ void row_rope_load(RowRope& r, uint64_t rec, int j) {
  const uint8_t* a = reinterpret_cast<const uint8_t*>(rec);
  r.v[0] = r.v[1] = make_uint4(0u, 0u, 0u, 0u);
  if (a != nullptr) {
#pragma unroll
    for (int k = 0; k < 2; ++k) r.v[k] = ldg16_fp8(a + FmtCfg<F>::kRopeRaw + 16 * (4 * k + j));
  }
}
template <Fmt F, class Put>
__device__ __forceinline__ void row_rope_store(const RowRope& r, int row, int j, Put&& put) {
#pragma unroll
  for (int k = 0; k < 2; ++k) put(slab_off(row, PartMap<F, 1>::kRopeChunk0 + 4 * k + j), r.v[k]);
}

// ---- 2-CTA cluster variant (kCluster; head tiles paired, h_q = 128; the default for both formats,
// kClusterDefault; docs/sparse-fp8-decode.md): the two head-tile CTAs of a
// (query token, partition) walk the same blocks. Each CTA's
// producers dequantize half of every block's rows (thread row row[rank]) into their own slabs
// (st.shared) and send them to the peer's: per producer warp and slab of a part, one 1 KB bulk copy
// shared::cta -> shared::cluster completing as transaction bytes on the peer's full barrier of that
// part (FlashMLA's 2-CTA path stores each 16 bytes by st.async instead, as this kernel did before:
// 10% slower here), send the RoPE of those rows the same way (FLASHMLA_SPARSE_DECODE_ROPE_MODE 2;
// V3.2's RoPE by st.async, see send_part_to_peer; modes 0 and 1 copy all 64 rows' RoPE locally) and
// write all 64 validity bytes locally. A full barrier counts the 132 local arrivals
// (one per producer warp, warp 0's an arrive.expect_tx for the peer's bytes of the part, + 128
// cp.async noinc) and the peer's transaction bytes; the consumers release a part on both CTAs'
// free barriers (one arrival per consumer warp on each: count 8), so a part is refilled only when
// both CTAs' consumers are done with it. (Sharing the dequantization by st.shared::cluster plus 256
// remote arrivals per part, commit 027b0c0, was slower than the plain kernel.)
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
/// 16 bytes into the peer's shared memory, completing 16 bytes of transaction on the peer's
/// mbarrier `mbar` (both shared::cluster addresses). PTX performs st.async in the generic proxy:
/// the consumers' fence.proxy.async after their full-barrier wait is what orders these bytes for
/// wgmma (keep it).
__device__ __forceinline__ void st16_async(uint32_t addr, uint4 v, uint32_t mbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n"
               ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(mbar)
               : "memory");
}
/// `bytes` (a multiple of 16) from this CTA's shared memory at `src` (16-byte aligned) into the peer's at
/// `dst` (shared::cluster), completing them as transaction bytes on the peer's mbarrier `mbar`
/// (shared::cluster). The source is read through the async proxy: the writers' fence.proxy.async and a
/// barrier with them come first.
__device__ __forceinline__ void bulk_copy_to_peer(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t mbar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "r"(src), "r"(bytes), "r"(mbar)
               : "memory");
}
/// Arrival on an mbarrier of the peer CTA: release at CTA scope (the PTX default, as
/// CUTLASS's ClusterBarrier::arrive(cta_id) issues it); the cluster-scope release cost an ERRBAR
/// per arrival (12% of the V3.2 kernel's stall samples). What it orders: the consumers' reads of a
/// part, which are complete (wgmma.wait_group) before the arrival.
__device__ __forceinline__ void arrive_remote(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}
/// Wait (acquire at CTA scope, the PTX default, as CUTLASS's cluster barriers wait; the peer's
/// bytes arrive by bulk copy or st.async, whose complete_tx is applied once they are in this CTA's shared
/// memory). Acquire at cluster scope cost an L1 invalidation (CCTL.IVALL) per try; CTA scope for both
/// the arrival and the wait measured V3.2 -3.2%, peak h128 -5.3%.
/// Formally, PTX's scoped model pairs a cross-CTA release only with a cluster-scope acquire; the
/// CTA-scope pair relies on the same hardware behaviour as CUTLASS's multicast pipelines and
/// FlashMLA's 2-CTA sparse decode (docs/sparse-fp8-decode.md).
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) { mbar_wait(bar, parity); }
/// Every thread of both CTAs (barrier.cluster, aligned).
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
/// The exit barrier in two halves (every thread of both CTAs, aligned): arrive() once this thread has nothing
/// left to send to the peer (its last remote arrival issued), wait_all() before the CTA's shared memory may go.
__device__ __forceinline__ void arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wait_all() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
/// The prologue's barrier: every thread of both CTAs, after thread 0's mbarrier.init and
/// fence.mbarrier_init.release.cluster (PTX's pattern for publishing barrier inits to the cluster: a
/// relaxed arrival, since that fence is the release). No thread has written anything else by then, so
/// no GPU-scope membar (the release arrival's), which would also wait for the producers' loads in flight.
__device__ __forceinline__ void sync_after_init() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
/// Generic-proxy writes (local or the peer's shared memory) -> the async proxy (wgmma).
}  // namespace cl

/// Bytes one CTA's producers write into the peer's buffer for part PT of a block: 32 rows x the
/// part's 64-dim groups x 128 bytes (each thread stores every chunk it owns, valid row or not).
template <Fmt F, int PT>
constexpr uint32_t kPeerPartBytes = 32u * 128u * static_cast<uint32_t>(PartMap<F, PT>::kGroups) +
                                    (PT == 1 && FLASHMLA_SPARSE_DECODE_ROPE_MODE == 2 ? 32u * 128u : 0u);

constexpr int kSmemQ = kTileBytes;
constexpr int kSmemK = kTileBytes;
constexpr int kSmemRed = 4 * 64 * 4;  // sM[64], sL[64], sScale[2][64]
// validity bytes [buffer][64], then the any-invalid flags [buffer][4 producer warps]
constexpr int kSmemValid = 2 * kBlockN + 8;
constexpr int kSmemBar = 8 * 8;  // full[buffer][part], free[buffer][part]
constexpr int kSmemBytes =
    1024 /*alignment slack*/ + kSmemQ + 2 * kSmemK + kSmemRed + kSmemValid + kSmemBar;
static_assert(kSmemBytes <= 232448, "shared memory");

enum : int { kBarP0 = 1, kBarP1 = 2, kBarConsumers = 3, kBarStage0 = 4 /* and 5: one per consumer warpgroup */ };

// The kernel's two request-boundary forms (template parameter kBatched, chosen by shape in `launch`):
// * batched (from kBatchedMinTokens query tokens, where a CTA walks several requests): an unsplit request's bf16 O
//   goes through Q's buffer (stmatrix, then 16-byte loads and stores of whole 512-byte row halves) instead of 64
//   4-byte stores per thread straight from the accumulator (each filling half of 8 sectors), and at each request's
//   top warpgroup 0 prefetches the next request's Q tile into L2 (one bulk prefetch where its rows are contiguous);
// * otherwise (few query tokens: latency-bound, mostly split requests), in the cluster kernel warpgroup 0 copies
//   the next request's Q (cp.async) after the last block's P V, under the epilogue, so that only the copy's wait is
//   left at the boundary. Not in the plain kernel, where ptxas spills inside the consumers' block loop with it.
// The two use Q's buffer at the boundary and exclude each other. Measured in docs/sparse-fp8-decode.md, "O through
// shared memory, and the next Q in L2": the batched form x1.02-1.05 on FlashMLA's b >= 64 cases but x0.92-0.95 on
// its b = 2 cases, where the early Q copy gains x1.04 (V3.2) and is neutral above.
constexpr int kBatchedMinTokens = 32;
/// The request-boundary form for a call's shapes (the kernel's kBatched).
inline bool batched_form(const SparseDecodeKernelParams& kp) {
  return static_cast<long long>(kp.b) * kp.s_q >= kBatchedMinTokens;
}
// Batched form: a consumer warpgroup's 64 x 256 bf16 half of O in Q's buffer, rows padded by 16 bytes so that the 8
// rows of a stmatrix matrix fall in 8 different 16-byte bank groups.
constexpr int kStageRowBytes = 256 * 2 + 16;
constexpr int kStageWgBytes = 64 * kStageRowBytes;
static_assert(2 * kStageWgBytes <= kSmemQ, "both warpgroups' O halves fit in Q's buffer");


template <Fmt F, bool kCluster, bool kBatched>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_splitkv_mla_fp8_sparse_kernel_wgmma_producer(const SparseDecodeKernelParams p) {
  launch_dependent_grids();  // the combine after this kernel may be scheduled now (utils.cuh)
  constexpr int kD = FmtCfg<F>::kDQK;
  constexpr int kSlabs = kD / 64;  // 9 or 8
  constexpr int kChunks = kD / 8;  // 72 or 64
  constexpr bool kQAhead = kCluster && !kBatched;  // the small-batch form's early Q copy (see kBatchedMinTokens)
  constexpr bool kLateAddr = kCluster && FLASHMLA_SPARSE_DECODE_NEXT_ADDR_LATE != 0;
  constexpr int kIndexAhead = kCluster ? FLASHMLA_SPARSE_DECODE_INDEX_AHEAD : 1;
  // FLASHMLA_SPARSE_DECODE_B0_GATHERS_FIRST: the small-batch form only (the batched form's machine code stays the
  // tree's; its CTAs walk many blocks, where block 0's chain is a small share of the CTA's life).
  [[maybe_unused]] constexpr bool kB0First = FLASHMLA_SPARSE_DECODE_B0_GATHERS_FIRST != 0 && !kBatched;
  // Cluster kernel: the RoPE slab goes to the peer by the bulk copy too where P does not share it (MODEL1: RoPE in
  // slab 7, P in 8); V3.2's RoPE slab 8 goes by st.async (see send_part_to_peer).
  [[maybe_unused]] constexpr bool kRopeBulk = F != Fmt::kV32 && FLASHMLA_SPARSE_DECODE_ROPE_MODE == 2;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const auto [sQ_u, sK_u, sQ, sK, sRed] = seesaw::smem_tiles<kSmemQ, kSmemK>(smem_raw);
  float* sM = sRed;
  float* sL = sRed + 64;
  float* sScale = sRed + 128;  // [buffer][64]
  uint8_t* sValid = reinterpret_cast<uint8_t*>(sRed + 4 * 64);  // [buffer][64]
  uint8_t* sInval = sValid + 2 * kBlockN;  // [buffer][producer warp]: any slot of the warp's rows invalid
  const uint32_t bar_u = sK_u + 2 * kSmemK + kSmemRed + kSmemValid;
  auto bar_full = [&](int buf, int part) { return bar_u + 8u * static_cast<uint32_t>(2 * buf + part); };
  auto bar_free = [&](int buf, int part) { return bar_u + 8u * static_cast<uint32_t>(4 + 2 * buf + part); };

  const int ht = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.num_head_tiles));
  const int sq = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.num_head_tiles));
  const int part_id = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4;
  const int gq = lane / 4, tq = lane % 4;
  FLASHMLA_SPARSE_DECODE_TRACE_DECL();
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(0, tid == 0, clock64());
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(4, tid == 0, flashmla_sparse_decode_trace_globaltimer());

  const int32_t* meta = p.tile_scheduler_metadata + part_id * 8;
  const int begin_req = meta[0], end_req = meta[1], begin_blk = meta[2], end_blk = meta[3];
  const int begin_split = meta[4], first_splitted = meta[5], last_splitted = meta[6];
  if (begin_req >= p.b) {
    return;
  }

  // Block 0's chain (metadata -> the first request's topk lengths -> its rows' cache indices ->
  // gathers: dependent round trips) is started here, before the barrier set-up, the cluster barrier
  // and setmaxnreg, so that its second round trip overlaps them: each producer thread loads the
  // first request's lengths and, speculatively, its rows' indices as main-cache slots of block
  // begin_blk (read only where slot < topk, so inside the index tensor). The producer keeps an index
  // only where block 0 turns out to be that block and the slot lies below the request's limit
  // (block_indices), so no record of an invalid slot is read.
  RequestLengths first_len{0, 0};
  int first_idx[2] = {-1, -1};
  if (wg >= 2) {
    first_len = request_lengths(p, begin_req);
    const int t = tid - kConsumers;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t slot = static_cast<int64_t>(begin_blk) * kBlockN + (t >> 5) * 8 + (t & 7) + 32 * i;  // row[i]
      if (slot < p.main.topk)
        first_idx[i] = __ldg(p.main.indices + (begin_req * p.main.idx_stride_b + sq * p.main.idx_stride_s +
                                               slot * p.main.idx_stride_k));
    }
    // The first request's Q tile into L2, so that the consumers' copy after their request set-up does
    // not wait for DRAM: one bulk prefetch by one thread where the tile's rows are contiguous and 16-byte
    // aligned (a bulk prefetch per row, 64 lanes with different addresses, compiled to a serial loop of
    // uniform-register issues); none otherwise.
    if (t == 0 && p.q_vec && p.q_stride_h == kD)
      prefetch_l2_bulk(static_cast<const __nv_bfloat16*>(p.q) + begin_req * p.q_stride_b + sq * p.q_stride_s +
                           ht * 64 * p.q_stride_h,
                       static_cast<uint32_t>(min(64, p.h_q - ht * 64) * kD * 2));
  }

  if (tid == 0) {
    // full: kFullCount producer arrivals; free: one per warp of the part's consumer warpgroup(s).
#pragma unroll
    for (int i = 0; i < 4; ++i) mbar_init(bar_u + 8 * i, kFullCount);
#pragma unroll
    for (int i = 4; i < 8; ++i) mbar_init(bar_u + 8 * i, 4 * (kCluster ? 2 : 1));
    fence_barrier_init();
  }
  if constexpr (kCluster) cl::sync_after_init();  // both CTAs' barriers initialised before any remote arrival
  else __syncthreads();
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(1, tid == 0, clock64());
  // Cluster variant: this CTA's rank and the peer's barriers (shared::cluster addresses).
  const uint32_t rank = kCluster ? cl::rank() : 0u;
  const uint32_t r_bar_u = kCluster ? cl::mapa(bar_u, rank ^ 1u) : 0u;
  auto r_bar_full = [&](int buf, int part) { return r_bar_u + 8u * static_cast<uint32_t>(2 * buf + part); };
  auto r_bar_free = [&](int buf, int part) { return r_bar_u + 8u * static_cast<uint32_t>(4 + 2 * buf + part); };
  // Waits on full barriers (cluster: cl::wait, acquire at CTA scope as CUTLASS's cluster pipelines
  // wait; the peer's producers write here too, by bulk copy and st.async; see cl::wait).
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
    request_slot_limits(p, req, r.lim_main, r.lim_extra);
    return r;
  };

  if (wg >= 2) {
    // ============================ producer warpgroup ============================
    // FlashMLA's token mapping: the 8 lanes of a warp quarter take 8 consecutive rows (so their
    // 16-byte stores of one chunk fall on 8 different 128B-swizzle positions: no bank conflict),
    // the 4 quarters j the 4 16-byte pieces of each 64-dim group; each thread loads its rows' cache
    // indices one block ahead and computes their record addresses itself (no shared table).
    setmaxnreg_dec<kProdRegs>();
    const int t = tid - kConsumers;
    const int j = (t & 31) >> 3;
    const int tok = (t >> 5) * 8 + (t & 7);
    const int row[2] = {tok, tok + 32};  // this thread's rows of every block
    // (nreq, nb): the block whose indices are loaded next, one block ahead of the fills.
    int nreq = begin_req, nb = 0;
    ReqInfo nri;
    {
      // The first request's lengths loaded above (broadcast from lane 0: uniform, so that the request
      // walk stays in uniform registers).
      const RequestLengths len{__shfl_sync(0xffffffffu, first_len.main, 0),
                               __shfl_sync(0xffffffffu, first_len.extra, 0)};
      int n_total;
      request_blocks(p, len, nri.n_main, n_total);
      nri.blk_lo = begin_blk;
      const int blk_hi = min(begin_req == end_req ? end_blk : n_total, n_total);
      nri.n_blk = max(blk_hi - nri.blk_lo, 0);
      request_slot_limits(p, len, nri.lim_main, nri.lim_extra);
    }
    auto skip_empty = [&]() {
      while (nreq <= end_req && nb >= nri.n_blk) {
        ++nreq;
        nb = 0;
        if (nreq <= end_req) nri = req_info(nreq);
      }
    };
    // Cache indices of this thread's rows of block (nreq, nb) (-1: slot past the request's
    // topk_length); returns whether the block is in the extra cache. `first`: the block is block
    // begin_blk of the first request, whose main-cache indices were loaded before the barrier set-up.
    auto block_indices = [&](int (&v)[2], bool first = false) {
      const int blk = nri.blk_lo + nb;
      const bool is_extra = p.has_extra && blk >= nri.n_main;
      const SparseScope& sc = is_extra ? p.extra : p.main;
      const int lim = is_extra ? nri.lim_extra : nri.lim_main;
      const int64_t slot0 = static_cast<int64_t>(is_extra ? blk - nri.n_main : blk) * kBlockN;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int64_t slot = slot0 + row[i];
        v[i] = slot < lim ? (first && !is_extra ? first_idx[i]
                                                : __ldg(sc.indices + (nreq * sc.idx_stride_b + sq * sc.idx_stride_s +
                                                                      slot * sc.idx_stride_k)))
                          : -1;
      }
      return is_extra;
    };
    // Record addresses of the rows (0 for an invalid slot: negative or past the cache, spec §2.7),
    // both rows computed without a branch so that their dependent chains overlap.
    const ScopeAddr addr_main = scope_addr(p.main), addr_extra = scope_addr(p.extra);
    auto addresses = [&](const int (&v)[2], bool is_extra, RowAddr& ra) {
      // Field by field (register selects; a reference to either struct would put both in local memory).
      ScopeAddr sc;
      sc.cache = is_extra ? addr_extra.cache : addr_main.cache;
      sc.block_stride = is_extra ? addr_extra.block_stride : addr_main.block_stride;
      sc.pbs = is_extra ? addr_extra.pbs : addr_main.pbs;
      sc.pbs_magic = is_extra ? addr_extra.pbs_magic : addr_main.pbs_magic;
      sc.num_tokens = is_extra ? addr_extra.num_tokens : addr_main.num_tokens;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const bool ok = v[i] >= 0 && v[i] < sc.num_tokens;
        uint64_t rec, scl;
        row_addr<F>(sc, ok ? static_cast<uint32_t>(v[i]) : 0u, rec, scl);
        ra.rec[i] = ok ? rec : 0;
        ra.scl[i] = ok ? scl : 0;
      }
    };
    // The plain arrival on a part's full barrier (after this thread's fence.proxy.async); thread 0
    // of a cluster CTA also expects the peer's `peer_bytes` of the part.
    auto producer_arrive = [&](uint32_t bar, uint32_t peer_bytes) {
      __syncwarp();
      if ((t & 31) != 0) return;
      if (kCluster && t == 0) mbar_arrive_expect_tx(bar, peer_bytes);
      else mbar_arrive(bar);
    };
    skip_empty();
    if (nreq <= end_req) {
      RowAddr ra;
      {
        int v[2];
        const bool ext = block_indices(v, nreq == begin_req);  // nb is 0 while nreq == begin_req
        addresses(v, ext, ra);
      }
      // One any-invalid flag per producer warp for buffer x (warpgroup 0 skips the masking of a block
      // whose 64 slots are all valid); every producer lane calls this, before the part-A arrivals
      // that publish it.
      auto publish_any_invalid = [&](const RowAddr& r, int x) {
        const bool any = __any_sync(0xffffffffu, j == 0 && (r.rec[0] == 0 || r.rec[1] == 0));
        if ((t & 31) == 0) sInval[x * 4 + (t >> 5)] = any ? 1 : 0;
      };
      // kIndexAhead 2: block 1's indices before the loop; step g loads block g + 2's.
      int va[2] = {-1, -1};
      bool exta = false, more_a = false;
      // Block 1's indices (kIndexAhead 2): here, or with kB0First in step 0 right after block 0's gathers are
      // issued (below). It reads and advances only the walk's state (nreq, nb, nri) and va / exta / more_a; block 0's
      // gathers read only ra, computed above, so issuing them first reads the same records.
      auto ahead_first = [&]() {
        if constexpr (kIndexAhead == 2) {
          ++nb;
          skip_empty();
          more_a = nreq <= end_req;
          if (more_a) exta = block_indices(va);
        }
      };
      if constexpr (!kB0First) ahead_first();
      for (int g = 0;; ++g) {
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 0, t == 0);
        bool more;
        int vn[2] = {-1, -1};
        bool extn = false;
        // The step's look-ahead (more, vn, extn: block g + 1's indices; cluster: block g + 2's loaded), here in
        // every step; with kB0First, step 0 runs it after block 0's gathers instead (ahead_first first, so the
        // walk visits blocks 1 and 2 in the same order). Its results are first read by next_addresses (after
        // part A's arrival, plain; after part B's, cluster) and by the `more` test at the step's end, both
        // after the gathers, so every value is the tree's. No synchronisation is involved: the walk and the
        // index loads touch no shared memory and no barrier, so the mbarrier / cluster-barrier protocol (waits,
        // parities, arrivals, the peer's bulk copies and st.async, the exit barrier) is the tree's, unchanged.
        auto ahead_step = [&]() {
          if constexpr (kIndexAhead == 2) {
            more = more_a;
            vn[0] = va[0];
            vn[1] = va[1];
            extn = exta;
            if (more_a) {
              ++nb;
              skip_empty();
              more_a = nreq <= end_req;
              va[0] = va[1] = -1;
              exta = false;
              if (more_a) exta = block_indices(va);
            }
          } else {
            ++nb;
            skip_empty();
            more = nreq <= end_req;
            if (more) extn = block_indices(vn);
          }
        };
        if (!kB0First || g > 0) ahead_step();
        const int x = g & 1, use = g >> 1;
        uint8_t* sKx = sK + x * kSmemK;
        const uint32_t sKx_u = sK_u + static_cast<uint32_t>(x * kSmemK);
        // The next block's addresses (its indices have arrived by the time part A is stored) and
        // an L2 prefetch of the records of this thread's rows i_lo <= i < i_hi (the cluster kernel
        // prefetches only the row it dequantizes).
        RowAddr rn;
        auto next_addresses = [&](int i_lo, int i_hi) {
          if (!more) return;
          addresses(vn, extn, rn);
          if (j == 0 && !FLASHMLA_SPARSE_DECODE_NO_L2_PREFETCH)
#pragma unroll
            for (int i = 0; i < 2; ++i)
              if (i >= i_lo && i < i_hi && rn.rec[i] != 0) {
                prefetch_l2_bulk(reinterpret_cast<const void*>(rn.rec[i]), PartMap<F, 0>::kRecBytes);
                if constexpr (F != Fmt::kV32) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(rn.scl[i]));
              }
        };
        if constexpr (kCluster) {
          // One row (row[rank]: this CTA's half of the block) dequantized into both CTAs; the
          // RoPE and validity of both rows locally.
          const bool hi = rank != 0;
          const int my = hi ? row[1] : row[0];
          const uint64_t my_rec = hi ? ra.rec[1] : ra.rec[0], my_scl = hi ? ra.scl[1] : ra.scl[0];
          const uint32_t r_sKx_u = cl::mapa(sKx_u, rank ^ 1u);
          // The peer's copy of this CTA's rows: every thread stores locally only; after a part's stores each
          // producer warp sends part pt's slabs (part A: 0-3; part B: its FP8 groups' slabs and, MODEL1 with the RoPE
          // through registers, slab 7 that holds the RoPE), its 8 rows of each (rows 32 rank + 8 w ..: 1 KB at
          // 4 KB x rank + 1 KB x w into the slab), by one bulk shared::cta -> shared::cluster copy per slab (lane s
          // of the warp), completing on the peer's full barrier, with no wait for the other producer warps. So the
          // next block's gathers do not queue behind ~36 KB of st.async operands per step in the MIO queue
          // (docs/sparse-fp8-decode.md, "The peer's half by bulk copies": x1.06-1.14 on the cluster cases). V3.2's
          // RoPE slab 8 goes by st.async beside the local store: this CTA's warpgroup 0 writes P there once its own
          // part B is full, which does not wait for this CTA's outgoing copy to have read it.
          auto send_part_to_peer = [&](int xb, int pt) {
            __syncwarp();  // the warp's stores, each after its own fence.proxy.async
            const int s0 = pt == 0 ? 0 : 4;
            const int n = pt == 0 ? 4 : PartMap<F, 1>::kGroups + (kRopeBulk ? 1 : 0);
            const int lane = t & 31;
            if (lane < n) {
              const uint32_t off = static_cast<uint32_t>((s0 + lane) * kSlabBytes) + 4096u * rank + 1024u * (t >> 5);
              cl::bulk_copy_to_peer(r_sKx_u + off, sKx_u + off, 1024u, r_bar_full(xb, pt));
            }
          };
          RowPart<F, 0> pa;
          RowPart<F, 1> pb;
          row_part_load<F, 0>(pa, my_rec, my_scl, j);
          row_part_load<F, 1>(pb, my_rec, my_scl, j);
#if FLASHMLA_SPARSE_DECODE_ROPE_MODE == 2
          RowRope rr;
          row_rope_load<F>(rr, my_rec, j);
#endif
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 1, t == 0);
          if constexpr (kB0First) {
            if (g == 0) {
              ahead_first();  // block 1's indices
              ahead_step();   // block 2's
            }
          }
          if (use > 0) cl::wait(bar_free(x, 0), static_cast<uint32_t>((use - 1) & 1));
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 2, t == 0);
          row_part_store<F, 0>(pa, my, j, [&](uint32_t off, uint4 v) {
            *reinterpret_cast<uint4*>(sKx + off) = v;
          });
          if (j == 0) {
            sValid[x * kBlockN + row[0]] = ra.rec[0] != 0 ? 1 : 0;
            sValid[x * kBlockN + row[1]] = ra.rec[1] != 0 ? 1 : 0;
          }
          publish_any_invalid(ra, x);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 3, t == 0);
          gmma::fence_proxy_async();  // the local generic stores -> the consumers' wgmma (and the bulk copy)
          send_part_to_peer(x, 0);
          mbar_arrive_cp_async(bar_full(x, 0));
          producer_arrive(bar_full(x, 0), kPeerPartBytes<F, 0>);  // t == 0: + the peer's bytes
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 4, t == 0);
          if (!kLateAddr) next_addresses(hi ? 1 : 0, hi ? 2 : 1);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 5, t == 0);
          if (use > 0) cl::wait(bar_free(x, 1), static_cast<uint32_t>((use - 1) & 1));
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 6, t == 0);
#if FLASHMLA_SPARSE_DECODE_ROPE_MODE == 2
          row_rope_store<F>(rr, my, j, [&](uint32_t off, uint4 v) {
            *reinterpret_cast<uint4*>(sKx + off) = v;
            if constexpr (!kRopeBulk) cl::st16_async(r_sKx_u + off, v, r_bar_full(x, 1));
          });
#else
          row_rope<F>(ra.rec[0], row[0], j, sKx_u, p.q);
          row_rope<F>(ra.rec[1], row[1], j, sKx_u, p.q);
#endif
          row_part_store<F, 1>(pb, my, j, [&](uint32_t off, uint4 v) {
            *reinterpret_cast<uint4*>(sKx + off) = v;
          });
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 7, t == 0);
          gmma::fence_proxy_async();
          send_part_to_peer(x, 1);
          mbar_arrive_cp_async(bar_full(x, 1));
          producer_arrive(bar_full(x, 1), kPeerPartBytes<F, 1>);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 8, t == 0);
          if (kLateAddr) next_addresses(hi ? 1 : 0, hi ? 2 : 1);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 9, t == 0);
        } else {
          RowPart<F, 0> pa0, pa1;
          RowPart<F, 1> pb0, pb1;
          row_part_load<F, 0>(pa0, ra.rec[0], ra.scl[0], j);
          row_part_load<F, 0>(pa1, ra.rec[1], ra.scl[1], j);
          row_part_load<F, 1>(pb0, ra.rec[0], ra.scl[0], j);
          row_part_load<F, 1>(pb1, ra.rec[1], ra.scl[1], j);
#if FLASHMLA_SPARSE_DECODE_ROPE_MODE == 2
          RowRope rr0, rr1;
          row_rope_load<F>(rr0, ra.rec[0], j);
          row_rope_load<F>(rr1, ra.rec[1], j);
#endif
          auto put = [&](uint32_t off, uint4 v) { *reinterpret_cast<uint4*>(sKx + off) = v; };
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 1, t == 0);
          if constexpr (kB0First) {
            if (g == 0) {
              ahead_first();  // empty for kIndexAhead 1 (the plain kernel's)
              ahead_step();   // block 1's indices
            }
          }
          if (use > 0) mbar_wait(bar_free(x, 0), static_cast<uint32_t>((use - 1) & 1));
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 2, t == 0);
          row_part_store<F, 0>(pa0, row[0], j, put);
          row_part_store<F, 0>(pa1, row[1], j, put);
          if (j == 0) {
            sValid[x * kBlockN + row[0]] = ra.rec[0] != 0 ? 1 : 0;
            sValid[x * kBlockN + row[1]] = ra.rec[1] != 0 ? 1 : 0;
          }
          publish_any_invalid(ra, x);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 3, t == 0);
          gmma::fence_proxy_async();  // generic-proxy stores -> the consumers' wgmma (async proxy)
          mbar_arrive_cp_async(bar_full(x, 0));
          producer_arrive(bar_full(x, 0), 0);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 4, t == 0);
          if (!kLateAddr) next_addresses(0, 2);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 5, t == 0);
          if (use > 0) mbar_wait(bar_free(x, 1), static_cast<uint32_t>((use - 1) & 1));
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 6, t == 0);
#if FLASHMLA_SPARSE_DECODE_ROPE_MODE == 2
          row_rope_store<F>(rr0, row[0], j, put);
          row_rope_store<F>(rr1, row[1], j, put);
#else
          row_rope<F>(ra.rec[0], row[0], j, sKx_u, p.q);
          row_rope<F>(ra.rec[1], row[1], j, sKx_u, p.q);
#endif
          row_part_store<F, 1>(pb0, row[0], j, put);
          row_part_store<F, 1>(pb1, row[1], j, put);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 7, t == 0);
          gmma::fence_proxy_async();
          mbar_arrive_cp_async(bar_full(x, 1));
          producer_arrive(bar_full(x, 1), 0);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 8, t == 0);
          if (kLateAddr) next_addresses(0, 2);
          FLASHMLA_SPARSE_DECODE_TRACE_BLK(2, g, 9, t == 0);
        }
        if (!more) break;
        ra = rn;
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
    __syncwarp();
    if (lane != 0) return;
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

  // Row r (0-63) of request rq's Q tile: its address and whether it exists (h < h_q; q's base otherwise).
  auto q_row = [&](int rq, int r, bool& valid) {
    const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + rq * p.q_stride_b + sq * p.q_stride_s;
    const int h = ht * 64 + r;
    valid = h < p.h_q;
    return valid ? qb + h * p.q_stride_h : static_cast<const __nv_bfloat16*>(p.q);
  };
  // cp.async of every kStep-th 16-byte chunk of that row from chunk c0 into sQ (zero-filled where !valid).
  auto copy_q_row = [&](const __nv_bfloat16* qrow, bool valid, int r, int c0, auto step) {
    constexpr int kStep = decltype(step)::value;
#pragma unroll
    for (int c = c0; c < kChunks; c += kStep) cp_async_16(sQ_u + slab_off(r, c), valid ? qrow + c * 8 : qrow, valid);
  };
  // kQAhead: whether request `req`'s Q was copied by warpgroup 0 during the previous request (same rule in both
  // warpgroups: the previous request had blocks, this one has, and q is 16-byte aligned).
  [[maybe_unused]] int prev_n_blk = 0;
  // Cluster: the consumers arrive on the exit barrier right after the CTA's last block, before the last
  // request's epilogue (nothing remote follows: every peer free barrier released, every peer byte consumed
  // by a full wait), so the release arrival's membar finds no partials outstanding and the barrier's round
  // trip runs under the epilogue's stores; they wait after the stores (docs/sparse-fp8-decode.md, "The exit
  // barrier under the last epilogue").
  [[maybe_unused]] bool exit_arrived = false;
  for (int req = begin_req; req <= end_req; ++req) {
    const ReqInfo ri = req_info(req);
    const int n_blk = ri.n_blk;
    [[maybe_unused]] const bool q_ahead =
        kQAhead && p.q_vec && req > begin_req && prev_n_blk > 0 && n_blk > 0;
    bool no_split;
    if (req == begin_req) no_split = !first_splitted;
    else if (req == end_req) no_split = !last_splitted;
    else no_split = true;
    if (!p.out_vec_ok) no_split = false;
    const int split_slot = part_split_slot(p.num_splits, req, begin_req, begin_split);
    FLASHMLA_SPARSE_DECODE_TRACE_REQ_VAL(req - begin_req, 8, tid == 0, g);
    FLASHMLA_SPARSE_DECODE_TRACE_REQ_VAL(req - begin_req, 9, tid == 0, n_blk);
    FLASHMLA_SPARSE_DECODE_TRACE_REQ_VAL(req - begin_req, 10, tid == 0, req);
    FLASHMLA_SPARSE_DECODE_TRACE_REQ_VAL(req - begin_req, 11, tid == 0, no_split ? 1 : 0);

    if (n_blk > 0) {
      FLASHMLA_SPARSE_DECODE_TRACE_REQ(req - begin_req, 0, tid == 0);
      named_barrier_sync(kBarConsumers, kConsumers);  // S of the previous request done, its sM / sL read
      FLASHMLA_SPARSE_DECODE_TRACE_REQ(req - begin_req, 1, tid == 0);
      // Q tile: 4 threads per row, each every 4th 16-byte chunk of it (the row's address once per
      // thread and request, as in the dense decode seesaw kernel, wgmma_seesaw_kernel.cuh).
      const int r = tid >> 2, c0 = tid & 3;
      bool valid;
      const __nv_bfloat16* qrow = q_row(req, r, valid);
      if (q_ahead) {
        // warpgroup 0 issued this request's copy after the previous request's last P V: the wait below completes it
      } else if (p.q_vec) {
        copy_q_row(qrow, valid, r, c0, std::integral_constant<int, 4>{});
      } else {
#pragma unroll 1
        for (int c = c0; c < kChunks; c += 4) {
          const __nv_bfloat16* src = qrow + (valid ? c * 8 : 0);
          uint16_t v[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = valid ? reinterpret_cast<const uint16_t*>(src)[e] : 0;
          *reinterpret_cast<uint4*>(sQ + slab_off(r, c)) =
              make_uint4(v[0] | (uint32_t(v[1]) << 16), v[2] | (uint32_t(v[3]) << 16), v[4] | (uint32_t(v[5]) << 16),
                         v[6] | (uint32_t(v[7]) << 16));
        }
      }
      cp_async_commit();
      cp_async_wait<0>();
      gmma::fence_proxy_async();
      named_barrier_sync(kBarConsumers, kConsumers);  // Q in shared memory, visible to wgmma
      FLASHMLA_SPARSE_DECODE_TRACE_REQ(req - begin_req, 2, tid == 0);
      if constexpr (kBatched) {
        if (tid == 0 && req < end_req && p.q_vec && p.q_stride_h == kD)
          prefetch_l2_bulk(static_cast<const __nv_bfloat16*>(p.q) + (req + 1) * p.q_stride_b + sq * p.q_stride_s +
                               ht * 64 * p.q_stride_h,
                           static_cast<uint32_t>(min(64, p.h_q - ht * 64) * kD * 2));
      }
    }

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    // Both warpgroups end a block alike: wait for this warpgroup's P.V wgmma (O final for the block),
    // then hand its part kWg of buffer x back to the producers; trace events `event`, `event + 1`.
    auto wait_pv_release = [&](int x, int event) {
      gmma::wait<0>();
      gmma::reg_fence(o);
      FLASHMLA_SPARSE_DECODE_TRACE_BLK(kWg, g, event, tid == kWg * 128);
      release(x, kWg);
      FLASHMLA_SPARSE_DECODE_TRACE_BLK(kWg, g, event + 1, tid == kWg * 128);
    };
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};

    if constexpr (kWg == 0) {
      // (S of block g + 1 is not issued behind P V_L of block g: with one producer warpgroup that
      // ran 13% slower, MODEL1 config1 b128 113 vs 98 us, ptxas serializing those wgmma (C7515);
      // docs/sparse-fp8-decode.md. Issuing only S(g + 1) part A behind P V_L(g), wait_group 1
      // releasing part A of g at once, also lost, x0.992 kernel geomean.)
      float s[32];
      auto issue_s = [&](int gg) {
        const int xx = gg & 1;
        const uint32_t phh = static_cast<uint32_t>((gg >> 1) & 1);
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
        gmma::reg_fence(s);
        const uint64_t db = gmma::make_desc_sw128(sK_u + static_cast<uint32_t>(xx * kSmemK), 16, 1024);
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(0, gg, 0, tid == 0);
        full_wait(bar_full(xx, 0), phh);
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(0, gg, 1, tid == 0);
        gmma::fence_proxy_async();
        gmma::fence();
        s_chain<0, 4>(s, dq, db);
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(0, gg, 2, tid == 0);
        full_wait(bar_full(xx, 1), phh);
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(0, gg, 3, tid == 0);
        gmma::fence_proxy_async();
        gmma::fence();
        s_chain<4, kSlabs>(s, dq, db);
        gmma::commit();
      };
      for (int j = 0; j < n_blk; ++j, ++g) {
        const int x = g & 1;
        const uint32_t sKx_u = sK_u + static_cast<uint32_t>(x * kSmemK);
        issue_s(g);
        gmma::wait<0>();  // S of block g
        gmma::reg_fence(s);
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(0, g, 4, tid == 0);

        float mx[2] = {-INFINITY, -INFINITY};
        if (*reinterpret_cast<const uint32_t*>(sInval + x * 4) == 0) {
          scale_rowmax(s, p.scale_log2, mx);
        } else {
          mask_rowmax(s, sValid + x * kBlockN, p.scale_log2, tq, mx);
        }
        float mu[2], sc[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          sc[hh] = advance_row_max(m_run[hh], lazy_max(m_run[hh], mx[hh]), mu[hh]);
          if (tq == 0) sScale[x * 64 + row_local[hh]] = sc[hh];
        }
        float rs[2] = {0.f, 0.f};
        uint32_t a[4][4];
        uint8_t* sP = sK + x * kSmemK + 8 * kSlabBytes;  // slab 8: S is done with it
        exp_pack_store_p(s, mu, rs, a, sP, row_local, tq);
        gmma::fence_proxy_async();  // P (generic stores) -> warpgroup 1's wgmma
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(0, g, 5, tid == 0);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] = l_run[hh] * sc[hh] + rs[hh];
        scale_o(o, sc);
        gmma::reg_fence(o);
        gmma::fence();
        pv_rs_chain(o, a, gmma::make_desc_sw128(sKx_u, kSlabBytes, 1024));
        gmma::commit();
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(0, g, 6, tid == 0);
        // P is announced only now, so P.V_L enters the tensor pipe before warpgroup 1's P.V_R
        // (FlashMLA's order; with the two changes above x1.013 kernel geomean).
        bar_arrive(kBarP0 + x, kConsumers);  // P stored and fenced above
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(0, g, 7, tid == 0);
        wait_pv_release(x, 8);  // slabs 0-3 of the buffer are free
      }
      if constexpr (kQAhead) {
        // The request's S are done with Q: copy the next request's Q now, under the epilogue (the rule of q_ahead
        // above). 2 threads per row, each every 2nd 16-byte chunk. (Issued here rather than right after the last
        // S: there, beside S, P and O in registers, it cost ptxas 36-44 bytes of spill.)
        if (n_blk > 0 && p.q_vec && req < end_req && req_info(req + 1).n_blk > 0) {
          const int r = tid >> 1, c0 = tid & 1;
          bool valid;
          const __nv_bfloat16* qrow = q_row(req + 1, r, valid);
          copy_q_row(qrow, valid, r, c0, std::integral_constant<int, 2>{});
          cp_async_commit();
        }
      }
    } else {
      for (int j = 0; j < n_blk; ++j, ++g) {
        const int x = g & 1;
        const uint32_t ph = static_cast<uint32_t>((g >> 1) & 1);
        const uint32_t sKx_u = sK_u + static_cast<uint32_t>(x * kSmemK);
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(1, g, 0, tid == 128);
        named_barrier_sync(kBarP0 + x, kConsumers);  // P and the rescale factors of block g
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(1, g, 1, tid == 128);
        float sc[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) sc[hh] = sScale[x * 64 + row_local[hh]];
        scale_o(o, sc);
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(1, g, 2, tid == 128);
        full_wait(bar_full(x, 1), ph);  // completed (warpgroup 0 waited for it); orders the producers' writes
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(1, g, 3, tid == 128);
        gmma::fence_proxy_async();
        gmma::reg_fence(o);
        gmma::fence();
        pv_ss_chain(o, gmma::make_desc_sw128(sKx_u + 8 * kSlabBytes, 16, 1024),
                    gmma::make_desc_sw128(sKx_u + 4 * kSlabBytes, kSlabBytes, 1024));
        gmma::commit();
        FLASHMLA_SPARSE_DECODE_TRACE_BLK(1, g, 4, tid == 128);
        wait_pv_release(x, 5);  // slabs 4-8 of the buffer are free
      }
    }

    // ---- epilogue: warpgroup 0 holds the rows' m and l; warpgroup 1 reads them from shared memory
    if constexpr (kCluster) {
      if (req == end_req) {
        cl::arrive();
        exit_arrived = true;
      }
    }
    FLASHMLA_SPARSE_DECODE_TRACE_REQ(req - begin_req, kWg == 0 ? 3 : 6, n_blk > 0 && tid == kWg * 128);
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
      FLASHMLA_SPARSE_DECODE_TRACE_REQ(req - begin_req, 4, tid == 0);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        L[hh] = sL[row_local[hh]];
        m_run[hh] = sM[row_local[hh]];
      }
    }

    const int head[2] = {ht * 64 + row_local[0], ht * 64 + row_local[1]};
    if (kBatched && n_blk > 0 && no_split && p.out_vec16) {
      // Q's buffer is free: warpgroup 0's last S completed before the barrier above, and the next writer of the
      // buffer (the next request's Q copy, or its epilogue) comes after a barrier of both warpgroups.
      float inv[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        inv[hh] = 0.f;
        if (head[hh] < p.h_q) {
          float lse2;
          inv[hh] = sparse_decode_row_scale(p, L[hh], m_run[hh], head[hh], true, lse2);
          if (kWg == 0 && tq == 0)
            p.lse[req * p.lse_stride_b + head[hh] * p.lse_stride_h + sq * p.lse_stride_s] = lse2 * kLn2;
        }
      }
      // stmatrix x4 of matrices (rows hh 0 / 1) x (columns 8j / 8j + 8): lane l gives row (l & 7) of matrix l / 8.
      const uint32_t stage_u = sQ_u + static_cast<uint32_t>(kWg * kStageWgBytes);
      const uint32_t st_u = stage_u + static_cast<uint32_t>((wq * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) *
                                                                kStageRowBytes + (lane >> 4) * 16);
      using H = HalfTraits<__nv_bfloat16>;
#pragma unroll
      for (int j = 0; j < 32; j += 2)
        stmatrix_x4(st_u + static_cast<uint32_t>(j * 16), H::pack(o[4 * j] * inv[0], o[4 * j + 1] * inv[0]),
                    H::pack(o[4 * j + 2] * inv[1], o[4 * j + 3] * inv[1]),
                    H::pack(o[4 * j + 4] * inv[0], o[4 * j + 5] * inv[0]),
                    H::pack(o[4 * j + 6] * inv[1], o[4 * j + 7] * inv[1]));
      named_barrier_sync(kBarStage0 + kWg, 128);
      // Warp wq writes rows wq, wq + 4, ...: lane l the row's 16-byte chunk l (the warpgroup's 512-byte half of
      // the row is contiguous in out). (One bulk copy per row half instead: x0.994, docs.)
      const uint8_t* stage = sQ + kWg * kStageWgBytes;
      __nv_bfloat16* ob = static_cast<__nv_bfloat16*>(p.out) + req * p.o_stride_b + sq * p.o_stride_s + kWg * 256 +
                          lane * 8;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int r = 4 * i + wq, h = ht * 64 + r;
        if (h < p.h_q)
          *reinterpret_cast<uint4*>(ob + h * p.o_stride_h) =
              *reinterpret_cast<const uint4*>(stage + r * kStageRowBytes + lane * 16);
      }
    } else {
      store_sparse_decode_rows<32, 256>(
          p, [&](int j, int e) { return o[4 * j + e]; }, L, m_run, head, sq, req, split_slot, no_split, kWg, tq);
    }
    FLASHMLA_SPARSE_DECODE_TRACE_REQ(req - begin_req, kWg == 0 ? 5 : 7, n_blk > 0 && tid == kWg * 128);
    prev_n_blk = n_blk;
  }
  if constexpr (kCluster) {
    if (!exit_arrived) cl::arrive();  // a CTA without a request
  }
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(8, tid == 0, g);
  };
  if (wg == 0) {
    setmaxnreg_inc<kWg0Regs>();
    consumer(std::integral_constant<int, 0>{});
  } else {
    // setmaxnreg.inc may only raise the count and .dec only lower it (the launch gives kLaunchRegs).
    if constexpr (kWg1Regs > kLaunchRegs) setmaxnreg_inc<kWg1Regs>();
    else setmaxnreg_dec<kWg1Regs>();
    consumer(std::integral_constant<int, 1>{});
  }
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(2, tid == 0, clock64());
  if constexpr (kCluster) cl::wait_all();  // the peer may still write / arrive into this CTA
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(3, tid == 0, clock64());
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(5, tid == 0, flashmla_sparse_decode_trace_globaltimer());
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(6, tid == 0, flashmla_sparse_decode_trace_smid());
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(7, tid == 0, rank);
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(9, tid == 0, begin_req);
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(10, tid == 0, end_req);
  FLASHMLA_SPARSE_DECODE_TRACE_CTA(11, tid == 0, 0x100u | (F == Fmt::kV32 ? 2u : 0u) | (kCluster ? 1u : 0u));
}

/// This kernel serves 16-byte aligned caches (the mma.sync kernel, mma_sync_kernel.cuh, the rest).
inline bool usable(const SparseDecodeKernelParams& kp) {
  return kp.main.vec != 0 && (!kp.has_extra || kp.extra.vec != 0);
}

template <Fmt F, bool kCluster, bool kBatched>
cudaError_t launch_k(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  auto kernel = flash_fwd_splitkv_mla_fp8_sparse_kernel_wgmma_producer<F, kCluster, kBatched>;
  // The setmaxnreg split needs the launch's register pool (compiled registers x 512), else
  // setmaxnreg.inc would wait forever: refuse with cudaErrorInvalidConfiguration (the callers in
  // instantiations_v32.cu / instantiations_model1.cu then run the mma.sync kernel).
  static const int regs = [] {
    cudaFuncAttributes a{};
    return cudaFuncGetAttributes(&a, flash_fwd_splitkv_mla_fp8_sparse_kernel_wgmma_producer<F, kCluster, kBatched>) == cudaSuccess
               ? a.numRegs
               : 0;
  }();
  if (regs * kThreads < 128 * kWg0Regs + 128 * kWg1Regs + kProducers * kProdRegs)
    return cudaErrorInvalidConfiguration;
  cudaError_t e = set_max_dynamic_smem(kernel, kSmemBytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(kp.s_q) * static_cast<unsigned>(kp.num_head_tiles),
                  static_cast<unsigned>(num_sm_parts), 1);
  // cudaLaunchKernelEx with the cluster dimension where the cluster kernel runs (the two head tiles of a (query
  // token, partition)).
  [[maybe_unused]] auto launch_ex = [&](const SparseDecodeKernelParams& args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = kSmemBytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    unsigned n = 0;
    if constexpr (kCluster) {
      attr[n].id = cudaLaunchAttributeClusterDimension;
      attr[n].val.clusterDim.x = 2;
      attr[n].val.clusterDim.y = 1;
      attr[n].val.clusterDim.z = 1;
      ++n;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    return cudaLaunchKernelEx(&cfg, kernel, args);
  };
  if constexpr (!kCluster) {
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(kp);
    return cudaGetLastError();
  } else {
    return launch_ex(kp);
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
    auto kernel = flash_fwd_splitkv_mla_fp8_sparse_kernel_wgmma_producer<F, true, false>;  // both forms alike
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

/// The 2-CTA cluster variant per format (a build-time switch): on for both, see docs/sparse-fp8-decode.md
/// (V3.2 b128 574 -> 503 us, MODEL1 config2 b128 372 -> 337 us on one H200).
template <Fmt F>
constexpr bool kClusterDefault = true;

/// This kernel for a call: the cluster variant when the head tiles pair up (an even number of 64-head
/// tiles), it is on for the format, and the device keeps every cluster of the grid resident at
/// once (a second wave would cost more than the shared dequant saves); else the plain kernel.
/// `kp.num_head_tiles` is the mma.sync kernels' tiling; this kernel's 64-row head tiles are set here.
template <Fmt F>
cudaError_t launch(const SparseDecodeKernelParams& kp_in, int num_sm_parts, cudaStream_t stream) {
  SparseDecodeKernelParams kp = kp_in;
  kp.num_head_tiles = (kp.h_q + 63) / 64;
  const bool on = kClusterDefault<F>;
  const bool batched = batched_form(kp);
  if (on && kp.num_head_tiles % 2 == 0) {
    const long long clusters = static_cast<long long>(kp.s_q) * kp.num_head_tiles / 2 * num_sm_parts;
    if (clusters <= max_active_clusters<F>())
      return batched ? launch_k<F, true, true>(kp, num_sm_parts, stream)
                     : launch_k<F, true, false>(kp, num_sm_parts, stream);
  }
  return batched ? launch_k<F, false, true>(kp, num_sm_parts, stream)
                 : launch_k<F, false, false>(kp, num_sm_parts, stream);
}

}  // namespace flashmla::sm90::sparse::wgmma_producer
