// src/sm90/decode/dense/wgmma_seesaw_kernel.cuh — split-KV dense MLA decode, the seesaw kernel:
// FlashMLA's "seesaw" schedule (spec §7.1) on 64-row tiles, K fed by the tensor copy
// engine. Two 64-token blocks per step, block 0 in stage 0 and block 1 in stage 1;
// warpgroup 0 owns O[:, 0:256] (O_L), warpgroup 1 owns O[:, 256:512] (O_R), and the
// running max m is shared through shared memory:
//   WG0: S0 = Q K0^T (m64n64, 36 wgmma); m0 = max(m, rowmax S0); scale0 = 2^(m - m0);
//        P0 = 2^(S0 - m0); O_L = O_L*scale0 + P0 V0_L (P0 from registers)
//   WG1: S1 = Q K1^T; m1 = max(m0, rowmax S1); scale1 = 2^(m0 - m1); P1 = 2^(S1 - m1);
//        O_R = O_R*scale0*scale1 + P1 V1_R (P1 from registers); P1 -> smem
//   WG0: P0 *= scale1 -> smem; O_L = O_L*scale1 + P1 V1_L (P1 from smem)
//   WG1: O_R += P0 V0_R (P0 from smem)
// so one warpgroup's softmax runs under the other's tensor-core work, and S uses
// m64n64 (Q read once per 64 keys instead of once per 32 as in wgmma_kernel.cuh).
// Row sums: WG0 keeps the part of P0, WG1 the part of P1; added in the epilogue.
// P0 / P1 live in slab 8 of their K stage (the RoPE dims, free once S is done; unused
// for d_qk 512). The next pair's K slabs are issued as soon as their readers are done:
// stage 0 slabs 0-3 after WG0's P0 V0_L, slabs 4-8 after WG1's P0 V0_R; stage 1 slabs
// 4-7 after WG1's P1 V1_R, slabs 0-3 and 8 after WG0's P1 V1_L. Each slab completes on
// its own mbarrier, so S of the next block starts slab by slab.
// Partial blocks (tokens >= cache_seqlens): boxes that start past seqlen are not loaded
// (their pages may not exist); the V rows past seqlen are zeroed in shared memory
// before the P V products (they may hold NaN), and S masks those keys.
// Request prologue: Q (64 rows x d_qk) by cp.async, 4 threads per row (one index division per
// thread), the first two blocks by TMA. Epilogue (template flag kStaged): direct register stores
// of O / the fp32 split partials, or — for batches of short requests, where the epilogue is a
// large part of the call — O staged in shared memory (the K stages) and each row written by one
// bulk copy. Two kernels rather than one runtime branch: the staged epilogue's per-thread
// constants changed the register allocation of the pair loop.
// Requires a K tensor map (the host runs wgmma_kernel.cuh / mma_sync_kernel.cuh otherwise). Design
// notes and measurements: docs/dense-decode.md.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "sm90/decode/dense/dense_decode.h"
#include "sm90/decode/dense/thread_rows.cuh"
#include "sm90/common/decode_schedule.cuh"
#include "sm90/common/tma.cuh"
#include "sm90/common/utils.cuh"
#include "sm90/common/wgmma.cuh"
#include "sm90/common/host_utils.h"
#include "sm90/common/seesaw.cuh"
#include "sm90/common/trace.cuh"

// ---- Optional event timeline (diagnostics only: tools/trace/dense_trace.cu). Without FLASHMLA_TRACE every
// trace macro below expands to nothing and the machine code is unchanged. Record layout of trace.cuh
// (g_trace[((slot * kRoles + role) * kMaxSteps + step) * kEvents + event]) with the linear CTA index
// blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z) (FLASHMLA_TRACE_DECL_CTA). Roles 0-2 are
// keyed by the CTA's running pair counter (0, 1, ... over all its requests; pairs >= kMaxSteps dropped),
// values clock64() of the CTA's SM. Role 3 holds records of 3 steps each: record 0 the CTA, record 1 + k
// the CTA's k-th request (k < 12): step 3r = %globaltimer (ns) of events 0..6, step 3r + 1 = clock64() of
// the same events (read right after), step 3r + 2 = values. Every (role, step, event) has one writer
// thread (tid 0 or tid 128 as listed); events are plain global stores, no barrier or fence. The only
// trace-only actions besides the stores, in traced CTAs: tid 0 waits on stage 0's slab-0 barrier after a
// request's Q __syncthreads (role 3 event 3), and with pair events tid 0 / tid 128 wait on their
// warpgroup's first slab barrier before each S chain; in both places the thread's next wait is the S
// chain's wait on that same barrier and parity, so the order of the kernel's waits is unchanged.
//   role 0 (WG0, tid 0):    0 pair top, 1 stage 0 slab 0 full (the wait above), 2 S0 done (wgmma wait),
//                           3 Scale0 published (bar.arrive), 4 P0 V0_L issued, 5 Scale1 received,
//                           6 P0 stored + announced, 7 P0 V0_L done, 8 P1 received, 9 P1 V1_L issued,
//                           10 P1 V1_L done, 11 pair end (after the stage 1 reloads)
//   role 1 (WG1, tid 128):  0 pair top, 1 stage 1 slab 4 full, 2 S1 done, 3 Scale0 received, 4 Scale1
//                           published, 5 P1 V1_R issued, 6 P1 announced, 7 P0 received, 8 P0 V0_R
//                           issued, 9 P1 V1_R done, 10 P0 V0_R done, 11 pair end (after the reload)
//                           (1, 2, 5, 9 only with a block 1)
//   role 2 (TMA issue):     0 tid 0 stage 0 slabs 0-3 reloaded, 1 tid 0 stage 1 slabs 0-3 + 8 reloaded,
//                           2 tid 128 stage 1 slabs 4-7 reloaded, 3 tid 128 stage 0 slabs 4-8 reloaded
//                           (for the next pair, after the issue); at the request's first pair (tid 0):
//                           4 Q cp.async issued, 5 the request's first two blocks issued
//   role 3 record 0 (tid 0): events 0 entry, 1 barriers initialised (after __syncthreads), 2 metadata
//                           read (after the early-exit test), 3 exit; values 0 %smid, 1 begin_req,
//                           2 end_req, 3 begin_blk, 4 end_blk, 5 requests done, 6 first / last splitted
//                           (bits 0 / 1)
//   role 3 record 1 + k (tid 0): events 0 request top, 1 shared memory free (after the request's first
//                           __syncthreads), 2 Q in shared memory, 3 first block's slab 0 full, 4 epilogue
//                           start (tid 0 leaves warpgroup 0's pair loop; warpgroup 1 may still be in its last P·V), 5 L exchanged (after the epilogue __syncthreads), 6 epilogue end (O / L
//                           stores or bulk copies issued); values 0 req, 1 n_blk, 2 no_split, 3 first pair
//                           index (roles 0-2), 4 blk_lo, 5 split_slot, 6 seqlen (2, 3, 5 only with blocks)
// Role 3 record `rec`, event `ev`: %globaltimer then clock64 (tid 0).
#define FLASHMLA_DENSE_TRACE_CTA(rec, ev)                  \
  do {                                                   \
    FLASHMLA_TRACE_EVENT_NS(3, 3 * (rec), ev, tid == 0 && (rec) <= 12); \
    FLASHMLA_TRACE_EVENT(3, 3 * (rec) + 1, ev, tid == 0 && (rec) <= 12); \
  } while (0)
#define FLASHMLA_DENSE_TRACE_VAL(rec, ev, value) FLASHMLA_TRACE_VALUE(3, 3 * (rec) + 2, ev, tid == 0 && (rec) <= 12, value)
// Roles 0-2: event `ev` of the current pair. With FLASHMLA_DENSE_TRACE_CTA_ONLY as well, role 3 alone is
// recorded (no trace code in the pair loop: the closest timing of the CTA-level events; request value 3,
// the first pair index, is not written).
#if defined(FLASHMLA_TRACE) && !defined(FLASHMLA_DENSE_TRACE_CTA_ONLY)
#define FLASHMLA_DENSE_TRACE_STEP(role, ev, first_thread) FLASHMLA_TRACE_EVENT(role, dtrace_step, ev, first_thread)
#define FLASHMLA_DENSE_STEP_ONLY(...) __VA_ARGS__
#else
#define FLASHMLA_DENSE_TRACE_STEP(role, ev, first_thread) \
  do {                                                  \
  } while (0)
#define FLASHMLA_DENSE_STEP_ONLY(...)
#endif

// FLASHMLA_DENSE_DECODE_QREG (A/B build switch, default 0; docs/dense-decode.md "Q's last slab in
// registers"): each consumer thread holds its A fragment of Q's last 64-dim slab (slab 8, the RoPE dims, for
// d_qk 576; slab 7 for 512) in 16 registers, loaded once per request, and S's 4 wgmma over that slab take A
// from registers (m64n64k16 RS) instead of from shared memory, as FlashMLA's dense decode does with its slab
// 8. Per pair that removes 8 of the 72 S wgmma's A reads (16 KiB of ~590 KiB of shared-memory traffic).
// Same products, same order: an RS wgmma computes the same 64x64x16 product from the same bf16 / fp16
// values (the fragment is the exact bytes of the Q tile) with the same fp32 accumulation into S, and the
// chain keeps its slab order, so S is bitwise what the SS chain gives up to the tensor core's internal
// summation order within one k16 step (the same for both operand sources). Masked keys, NaN / inf: S is
// masked after the chain exactly as before (scale_mask_rowmax), so keys past seqlen are -inf whatever Q
// or K hold; a NaN / inf in Q's last slab reaches S through the register operand as it did through
// shared memory. Zero-padded rows (past m_rows) load zeros into the fragment as the cp.async zero-fill
// wrote them. The 16 registers come from the P stores: P0 / P1 go to their slab by 4 stmatrix.x4 per
// thread (store_p_stsm) instead of 16 32-bit stores whose 16 slab_off addresses the pair loop held; the
// same packed values at the same addresses (so P.V reads the same bytes; NaN / inf / 0 in P are stored as
// they were), one recomputed row offset instead. Without that the Q fragment spilled (88 B, bf16 576).
// The lifetime of the fragment: written before the pair loop, only read (as wgmma A operands, after the
// chain's wgmma.fence) until the request's last wait<0>, so no wgmma in flight sees it change.
// Default 0: none of the code below is compiled and the kernels' SASS is unchanged.
#ifndef FLASHMLA_DENSE_DECODE_QREG
#define FLASHMLA_DENSE_DECODE_QREG 0
#endif

namespace flashmla::sm90::dense_seesaw {

constexpr int kThreads = 256;
constexpr int kBlockM = 64;
constexpr int kBlockN = 64;
constexpr int kDimV = 512;
constexpr int kSlabBytes = 64 * 128;
constexpr int kTileBytes = 9 * kSlabBytes;
constexpr int kSmemQ = kTileBytes;
constexpr int kSmemK = kTileBytes;
constexpr int kSmemRed = 6 * 64 * 4;  // sM0, sS0, sM1, sS1, sL[2][64]
constexpr int kSmemBar = 2 * 9 * 8;
constexpr int kSmemBytes = 1024 /*alignment slack*/ + kSmemQ + 2 * kSmemK + kSmemRed + kSmemBar;
static_assert(kSmemBytes <= 232448, "shared memory");

// Named barriers (0 is __syncthreads).
enum : int { kBarScale0 = 1, kBarScale1 = 2, kBarP0 = 3, kBarP1 = 4, kBarWG0 = 5, kBarWG1 = 6 };

__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

__device__ __forceinline__ uint32_t slab_off(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * kSlabBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// The kernel's wgmma shapes for element type T (__nv_bfloat16 or __half), fp32 accumulation, with
// compile-time descriptor offsets: S (64x64, K 16, both operands from shared memory), O += P V
// (64x256, K 16) with P from registers (pv_rs) or from shared memory (pv_ss).
template <typename T>
struct Mma {
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  template <int kOff, int kScaleD>
  __device__ __forceinline__ static void s(float (&d)[32], uint64_t a, uint64_t b) {
    if constexpr (kBf16) gmma::mma_m64n64k16_off_bf16<0, kOff, kOff, kScaleD>(d, a, b);
    else gmma::mma_m64n64k16_off_f16<0, kOff, kOff, kScaleD>(d, a, b);
  }
  template <int kOffB>
  __device__ __forceinline__ static void pv_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
    if constexpr (kBf16) gmma::mma_m64n256k16_rs_bf16<1, kOffB>(d, a, b);
    else gmma::mma_m64n256k16_rs_f16<1, kOffB>(d, a, b);
  }
  template <int kOffA, int kOffB>
  __device__ __forceinline__ static void pv_ss(float (&d)[128], uint64_t a, uint64_t b) {
    if constexpr (kBf16) gmma::mma_m64n256k16_off_bf16<1, kOffA, kOffB>(d, a, b);
    else gmma::mma_m64n256k16_off_f16<1, kOffA, kOffB>(d, a, b);
  }
#if FLASHMLA_DENSE_DECODE_QREG
  // S += Q_frag K^T (64x64, K 16), A (this thread's m16n8k16-layout fragment of Q) from registers, B (K,
  // K-major) from the descriptor plus a compile-time offset; always accumulates (scale-d 1).
  template <int kOffB>
  __device__ __forceinline__ static void s_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    if constexpr (kBf16)
      asm volatile("{\n.reg .pred p;\n.reg .b64 db;\nsetp.eq.u32 p, 1, 1;\nadd.s64 db, %36, %37;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FLASHMLA_WGMMA_ACC_32
                   ", {%32, %33, %34, %35}, db, p, 1, 1, 0;\n}\n"
                   : FLASHMLA_WGMMA_ACC_OUT_32(d)
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kOffB));
    else
      asm volatile("{\n.reg .pred p;\n.reg .b64 db;\nsetp.eq.u32 p, 1, 1;\nadd.s64 db, %36, %37;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " FLASHMLA_WGMMA_ACC_32
                   ", {%32, %33, %34, %35}, db, p, 1, 1, 0;\n}\n"
                   : FLASHMLA_WGMMA_ACC_OUT_32(d)
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kOffB));
  }
#endif
};

// S = Q K^T over all slabs, each slab after its TMA barrier; fully unrolled. The first wgmma of
// slab kOverwrite overwrites s (scale-d 0).
template <typename T, int kSl, int kK, int kOverwrite = 0>
__device__ __forceinline__ void s_step(float (&s)[32], uint64_t da0, uint64_t db0) {
  constexpr int kOff = (kSl * kSlabBytes + kK * 32) >> 4;
  Mma<T>::template s<kOff, (kSl == kOverwrite && kK == 0) ? 0 : 1>(s, da0, db0);
  if constexpr (kK + 1 < 4) s_step<T, kSl, kK + 1, kOverwrite>(s, da0, db0);
}
// S over the slabs kSls in that order (the first one overwrites s), each after its TMA barrier.
template <typename T, int kFirst, int... kSls>
__device__ __forceinline__ void s_chain_seq(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0, uint32_t parity) {
  ((tma::mbar_wait(bar0 + 8 * kSls, parity), gmma::fence(), s_step<T, kSls, 0, kFirst>(s, da0, db0)), ...);
}
// Warpgroup 0 (block 0, stage 0): slabs in order. Warpgroup 1 (block 1, stage 1): slabs in the order
// stage 1 is reloaded — 4-7 (freed by its own P1 V1_R) before 0-3 and 8 (freed by warpgroup 0's
// P1 V1_L) — as FlashMLA's dense decode does (H200: compute anchors 2-5% faster together with the early
// reload of slabs 4-7, either alone slower).
template <typename T, int kSlabs>
__device__ __forceinline__ void s_chain_wg0(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0, uint32_t parity) {
  if constexpr (kSlabs == 9) s_chain_seq<T, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8>(s, da0, db0, bar0, parity);
  else s_chain_seq<T, 0, 0, 1, 2, 3, 4, 5, 6, 7>(s, da0, db0, bar0, parity);
}
template <typename T, int kSlabs>
__device__ __forceinline__ void s_chain_wg1(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0, uint32_t parity) {
  if constexpr (kSlabs == 9) s_chain_seq<T, 4, 4, 5, 6, 7, 0, 1, 2, 3, 8>(s, da0, db0, bar0, parity);
  else s_chain_seq<T, 4, 4, 5, 6, 7, 0, 1, 2, 3>(s, da0, db0, bar0, parity);
}
#if FLASHMLA_DENSE_DECODE_QREG
// The chains above with Q's slab kQSl (the last one) from the registers q (q[k] the A fragment of k-step
// k of that slab) instead of from shared memory. The slab order, the barrier waits and the fences are
// those of s_chain_wg0 / s_chain_wg1; the first slab of either chain (0 / 4) is never kQSl, so the RS
// wgmma always accumulates.
template <typename T, int kSl, int kK, int kOverwrite, int kQSl>
__device__ __forceinline__ void s_step_q(float (&s)[32], uint64_t da0, uint64_t db0, const uint32_t (&q)[4][4]) {
  constexpr int kOff = (kSl * kSlabBytes + kK * 32) >> 4;
  if constexpr (kSl == kQSl) {
    static_assert(kSl != kOverwrite, "the register-Q slab is never a chain's first");
    Mma<T>::template s_rs<kOff>(s, q[kK], db0);
  } else {
    Mma<T>::template s<kOff, (kSl == kOverwrite && kK == 0) ? 0 : 1>(s, da0, db0);
  }
  if constexpr (kK + 1 < 4) s_step_q<T, kSl, kK + 1, kOverwrite, kQSl>(s, da0, db0, q);
}
template <typename T, int kQSl, int kFirst, int... kSls>
__device__ __forceinline__ void s_chain_seq_q(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0,
                                              uint32_t parity, const uint32_t (&q)[4][4]) {
  ((tma::mbar_wait(bar0 + 8 * kSls, parity), gmma::fence(), s_step_q<T, kSls, 0, kFirst, kQSl>(s, da0, db0, q)), ...);
}
template <typename T, int kSlabs>
__device__ __forceinline__ void s_chain_wg0_q(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0,
                                              uint32_t parity, const uint32_t (&q)[4][4]) {
  if constexpr (kSlabs == 9) s_chain_seq_q<T, 8, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8>(s, da0, db0, bar0, parity, q);
  else s_chain_seq_q<T, 7, 0, 0, 1, 2, 3, 4, 5, 6, 7>(s, da0, db0, bar0, parity, q);
}
template <typename T, int kSlabs>
__device__ __forceinline__ void s_chain_wg1_q(float (&s)[32], uint64_t da0, uint64_t db0, uint32_t bar0,
                                              uint32_t parity, const uint32_t (&q)[4][4]) {
  if constexpr (kSlabs == 9) s_chain_seq_q<T, 8, 4, 4, 5, 6, 7, 0, 1, 2, 3, 8>(s, da0, db0, bar0, parity, q);
  else s_chain_seq_q<T, 7, 4, 4, 5, 6, 7, 0, 1, 2, 3>(s, da0, db0, bar0, parity, q);
}
#endif
// O += P V over the 64 keys of a block, P from registers (A fragments), V = 4 slabs.
template <typename T, int kK = 0>
__device__ __forceinline__ void pv_rs_chain(float (&o)[128], const uint32_t (&a)[4][4], uint64_t db0) {
  Mma<T>::template pv_rs<((kK * 16 * 128) >> 4)>(o, a[kK], db0);
  if constexpr (kK + 1 < 4) pv_rs_chain<T, kK + 1>(o, a, db0);
}
// O += P V, P from shared memory (K-major slab).
template <typename T, int kK = 0>
__device__ __forceinline__ void pv_ss_chain(float (&o)[128], uint64_t da0, uint64_t db0) {
  Mma<T>::template pv_ss<((kK * 32) >> 4), ((kK * 16 * 128) >> 4)>(o, da0, db0);
  if constexpr (kK + 1 < 4) pv_ss_chain<T, kK + 1>(o, da0, db0);
}

#if FLASHMLA_DENSE_DECODE_QREG
// P (this thread's A fragments a[k], k-steps of 16 keys) into the 128B-swizzled P slab at shared address
// sP_u, by 4 stmatrix.x4 instead of store_p's 16 32-bit stores: the same bytes at the same addresses
// (matrix j of k-step k is a[k][j]: j = 0 / 1 rows 0-7 / 8-15 of the warp's 16 at keys 16k .. 16k + 7, j = 2 /
// 3 the same rows at keys 16k + 8 .. 16k + 15, as the A fragment layout places them), so the P.V that
// reads the slab is unchanged. poff (p_stsm_off) is lane's row address within the slab for k = 0; k-step k
// XORs 32 k into it: chunk 2k + h of row r sits at ((2k + h) ^ (r & 7)) << 4 = ((h ^ (r & 7)) << 4) ^ (k << 5).
// One address register instead of the 16 slab_off addresses the STS form holds through the pair loop:
// the registers the Q fragment above needs.
__device__ __forceinline__ uint32_t p_stsm_off(int wq, int lane) {
  const int r = 16 * wq + (lane & 7) + 8 * ((lane >> 3) & 1), h = lane >> 4;
  return static_cast<uint32_t>(r * 128 + ((h ^ (r & 7)) << 4));
}
__device__ __forceinline__ void store_p_stsm(const uint32_t (&a)[4][4], uint32_t sP_u, uint32_t poff) {
#pragma unroll
  for (int k = 0; k < 4; ++k) stmatrix_x4(sP_u + (poff ^ (k << 5)), a[k][0], a[k][1], a[k][2], a[k][3]);
}
#endif
// Zeroes rows [valid, 64) of the 4 V slabs at `slab0` (128 threads of one warpgroup),
// then makes the stores visible to the warpgroup's wgmma.
__device__ __forceinline__ void zero_v_rows(uint8_t* slab0, int valid, int t, int bar_id) {
  for (int idx = t; idx < 4 * 64 * 8; idx += 128) {
    const int sl = idx >> 9, row = (idx >> 3) & 63, ch = idx & 7;
    if (row >= valid) *reinterpret_cast<uint4*>(slab0 + sl * kSlabBytes + row * 128 + ch * 16) = make_uint4(0, 0, 0, 0);
  }
  gmma::fence_proxy_async();
  named_barrier_sync(bar_id, 128);
}

// Four details of the issuing threads and the pair loop, together x1.023 kernel geomean over 44 cases on
// an H200 (compute-bound cases +3-7%); each is explained where it is done:
//   `issue`'s straight-line path for one TMA box per slab;
//   the next pair's page ids read while the S chain is in flight (`read_next_pages`);
//   warpgroup 0 reads m0 back from shared memory after the Scale0 arrival;
//   warpgroup 1 issues P1 V1_R before P1's proxy fence and announcement.
// Measured and not used: the metadata and a request's first pages read speculatively up front
// (x0.998; b128 s_k 256 whole calls -2.6%); the stage reloads issued by lane 0 of every warp instead of
// by one thread (x0.995); the P stores addressed by one XOR from a per-thread offset, as sparse prefill
// does them (x1.008), and with that P0 stored before the Scale1 barrier, rewritten only when some row's
// scale1 is not 1 (x1.009): both under the 1 % a change must win by (docs/dense-decode.md).

// S -> scale_log2 * S with keys at or past each row's limit set to -inf; row maxima (per thread, not
// yet reduced over the quad) into mx. need_mask false: no key of the block reaches a limit.
__device__ __forceinline__ void scale_mask_rowmax(float (&s)[32], float scale_log2, bool need_mask, int tok, int tq,
                                                  const int (&limit)[2], float (&mx)[2]) {
  auto masked = [&]() {
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[4 * t + e] * scale_log2;
        if (need_mask && tok + 8 * t + 2 * tq + (e & 1) >= limit[e >> 1]) v = -INFINITY;
        s[4 * t + e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
  };
  // A CTA-uniform branch: blocks that need no masking (every block but the last one or two) only
  // scale S and take the row max (H200: x1.005 geomean, up to +4% on the long compute-bound
  // cases, against the compares and selects running predicated in every block).
  if (!need_mask) seesaw::scale_rowmax_local(s, scale_log2, mx);
  else masked();
}

// kStaged: the epilogue writes O through shared memory and bulk copies (see there); chosen by the
// host for batches of short requests only (DenseDecodeKernelParams::staged_epilogue).
template <typename T, int kD, bool kStaged>
__global__ void __launch_bounds__(kThreads, 1)
    flash_fwd_splitkv_mla_kernel_seesaw(const DenseDecodeKernelParams p, const __grid_constant__ CUtensorMap tmap_k) {
  launch_dependent_grids();  // the combine after this kernel may be scheduled now (utils.cuh)
  constexpr int kSlabs = kD / 64;
  constexpr int kChunks = kD / 8;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t base_u;
  uint8_t* base = smem_align_1024(smem_raw, base_u);
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
  FLASHMLA_TRACE_DECL_CTA(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
  FLASHMLA_TRACE_ONLY(int dtrace_req = 0;)       // requests begun (role 3 record 1 + dtrace_req)
  FLASHMLA_DENSE_STEP_ONLY(int dtrace_step = 0;)  // pairs begun (the step of roles 0-2)
  FLASHMLA_DENSE_TRACE_CTA(0, 0);
  FLASHMLA_DENSE_TRACE_VAL(0, 0, flashmla_trace_smid());

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 18; ++i) tma::mbar_init(bar_u + 8 * i, 1);
    tma::fence_barrier_init();
    tma::prefetch_tensormap(&tmap_k);
  }
  __syncthreads();
  FLASHMLA_DENSE_TRACE_CTA(0, 1);
  uint32_t phase = 0;  // parity of the next phase of this warpgroup's own stage (WG0: stage 0, WG1: stage 1)

  const PartSchedule ps = part_schedule(p.tile_scheduler_metadata, part);
  if (ps.begin_req >= p.b) {
    FLASHMLA_DENSE_TRACE_CTA(0, 2);
    FLASHMLA_DENSE_TRACE_CTA(0, 3);
    FLASHMLA_DENSE_TRACE_VAL(0, 1, ps.begin_req);
    return;
  }
  FLASHMLA_DENSE_TRACE_CTA(0, 2);

  const int pbs = p.page_block_size;
  const int box_tok = p.tma_box_tok;  // min(pbs, 64)
  // Token -> (page, row in page) without integer divisions on the issuing threads' path. The host
  // launches this kernel only for page sizes 16, 32 or a multiple of 64 (make_k_tensor_map), so box_tok
  // (16 / 32 / 64) is a power of two; when pbs is one too (16 ... 256, every usual size) a shift and a
  // mask replace / and % (tokens are >= 0); other multiples of 64 (192, 320, ...) keep the divisions.
  const bool pbs_pow2 = (pbs & (pbs - 1)) == 0;
  const int lg_pbs = __ffs(pbs) - 1;
  const int lg_box = __ffs(box_tok) - 1;
  // One box of 64 tokens per slab, row in page by a mask (box_tok == 64 iff pbs >= 64): `issue`'s fast path.
  const bool one_box = pbs_pow2 && box_tok == kBlockN;

  int row_local[2], row_global[2], row_sq[2];
  thread_rows(wq, gq, m_tile * kBlockM, p.group, row_local, row_global, row_sq);

  for (int req = ps.begin_req; req <= ps.end_req; ++req) {
    FLASHMLA_DENSE_TRACE_CTA(1 + dtrace_req, 0);
    int limit[2];
    const auto [seqlen, blk_lo, n_blk, no_split, split_slot, min_limit] = dense_request<kBlockN>(p, ps, req, row_sq, limit);

    cp_async_wait<0>();
    if constexpr (kStaged) tma::bulk_wait_read();  // the previous request's O rows have left shared memory
    __syncthreads();  // the previous request is done with all shared memory
    FLASHMLA_DENSE_TRACE_CTA(1 + dtrace_req, 1);

    const int32_t* bt_row = p.block_table + req * p.bt_stride_b;
    auto page_idx = [&](int tok) { return pbs_pow2 ? (tok >> lg_pbs) : tok / pbs; };
    auto page_row = [&](int tok) { return pbs_pow2 ? (tok & (pbs - 1)) : tok % pbs; };
    auto page_of = [&](int blk, int j) {
      return bt_row[static_cast<int64_t>(page_idx(blk * kBlockN + j * box_tok)) * p.bt_stride_j];
    };
    // Boxes of block `blk` that start before seqlen (later ones are not loaded); box_tok is a power of two.
    auto n_boxes = [&](int blk) {
      const int valid = min(seqlen - blk * kBlockN, kBlockN);
      return (valid + box_tok - 1) >> lg_box;
    };
    // Slabs [lo, hi) of block `blk` into `stage` (one thread). pg0 = page of the first box
    // (read ahead by the caller); with pages of 16/32 tokens the others are read here. No integer
    // division on this path when pbs is a power of two, and the slab loop is unrolled (lo / hi are
    // constants at every call site): what remains per slab is the barrier arrival and the TMA issue.
    // one_box (pbs a power of two >= 64: 64 / 128 / 256, every anchor case) takes a straight-line path
    // that does what the loop does for one box (tx = 64 rows * 128 B, same page and row) without the
    // loop's counter, the n_boxes / tx arithmetic, the `j == 0` page select, the page_row branch and
    // their reconvergence. The issuing thread's instructions are on the critical path;
    // bf16 576, pbs 64: 4 slabs ~91 -> 65 dynamic instructions, per pair tid 0 ~237 -> 159, tid 128
    // ~194 -> 142. Other page sizes (16 / 32: several boxes per slab; 192, 320, ...) keep the loop.
    auto issue = [&](int blk, int stage, int lo, int hi, int pg0) {
      if (one_box) {  // blk < n_blk: the box starts before seqlen; it ends inside its page (pbs % 64 == 0)
        const int tip = (blk * kBlockN) & (pbs - 1);
        const uint32_t fbar0 = bar_u + stage * (9 * 8), fdst = sK_u + stage * kSmemK;
#pragma unroll
        for (int s = lo; s < min(hi, kSlabs); ++s) {
          tma::mbar_arrive_expect_tx(fbar0 + 8 * s, kSlabBytes);
          tma::tma_load_4d(fdst + s * kSlabBytes, &tmap_k, fbar0 + 8 * s, 64 * s, kv_head, tip, pg0);
        }
        return;
      }
      const int nb = n_boxes(blk);
      const uint32_t tx = static_cast<uint32_t>(nb) << (lg_box + 7);  // nb * box_tok * 128 bytes
      const uint32_t bar0 = bar_u + stage * (9 * 8);
      const uint32_t dst = sK_u + stage * kSmemK;
      const int s_hi = min(hi, kSlabs);
#pragma unroll 1
      for (int j = 0; j < nb; ++j) {
        const int pg = j == 0 ? pg0 : page_of(blk, j);
        const int tip = page_row(blk * kBlockN + j * box_tok);
#pragma unroll
        for (int s = lo; s < s_hi; ++s) {
          if (j == 0) tma::mbar_arrive_expect_tx(bar0 + 8 * s, tx);
          tma::tma_load_4d(dst + s * kSlabBytes + j * box_tok * 128, &tmap_k, bar0 + 8 * s, 64 * s, kv_head,
                                 tip, pg);
        }
      }
    };
    // Slabs [lo, hi) of `stage` are free: when `go` (the issuing thread, a block two ahead exists), load
    // them with block blk (issue); trace: producer event ev.
    auto refill = [&](bool go, int blk, int stage, int lo, int hi, int pg0, int ev) {
      if (go) {
        issue(blk, stage, lo, hi, pg0);
        FLASHMLA_DENSE_TRACE_STEP(2, ev, true);
      }
    };

    if (n_blk > 0) {
      // Q tile: 4 threads per row, each every 4th 16-byte chunk of it (one division per
      // thread and request; per-chunk index arithmetic took more instructions than a pair of
      // blocks in the short-context case's profile).
      {
        const int r = tid >> 2, c0 = tid & 3;
        const int grow = m_tile * kBlockM + r;
        const bool valid = grow < p.m_rows;
        const T* src = static_cast<const T*>(p.q);
        if (valid) {
          const int sq = grow / p.group, h = kv_head * p.group + (grow - sq * p.group);
          src += req * p.q_stride_b + sq * p.q_stride_s + h * p.q_stride_h;
        }
#pragma unroll
        for (int c = c0; c < kChunks; c += 4) cp_async_16(sQ_u + slab_off(r, c), valid ? src + c * 8 : src, valid);
      }
      cp_async_commit();
      FLASHMLA_DENSE_TRACE_STEP(2, 4, tid == 0);
      if (tid == 0) {
        issue(blk_lo, 0, 0, 9, page_of(blk_lo, 0));
        if (n_blk > 1) issue(blk_lo + 1, 1, 0, 9, page_of(blk_lo + 1, 0));
        FLASHMLA_DENSE_TRACE_STEP(2, 5, true);
      }
      cp_async_wait<0>();
      gmma::fence_proxy_async();
      __syncthreads();  // Q in shared memory, visible to wgmma
      FLASHMLA_DENSE_TRACE_CTA(1 + dtrace_req, 2);
      // The first block's slab 0 (tid 0's next wait is S0's wait on it: nothing moves).
      FLASHMLA_TRACE_ONLY(if (FLASHMLA_TRACE_ACTIVE() && tid == 0) tma::mbar_wait(bar_u, phase);)
      FLASHMLA_DENSE_TRACE_CTA(1 + dtrace_req, 3);
    }

    float o[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) o[j] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};
    const uint64_t dq = gmma::make_desc_sw128(sQ_u, 16, 1024);
    float s[32];
#if FLASHMLA_DENSE_DECODE_QREG
    // This thread's A fragments of Q's last slab (wgmma / m16n8k16 A layout: q8[k][0] row_local[0] and
    // q8[k][1] row_local[1] at dims 16k + 2tq, +1 of the slab; [2] / [3] the same rows at dims 16k + 8 + 2tq,
    // +1), read from the swizzled Q tile after the request's Q __syncthreads (the cp.async data, made
    // visible by cp_async_wait + __syncthreads; plain loads, generic proxy). With n_blk == 0 the tile is
    // stale and the fragment unused (no pair runs).
    uint32_t q8[4][4];
    {
      const uint8_t* sQ = base;
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          q8[k][e] = *reinterpret_cast<const uint32_t*>(sQ + slab_off(row_local[e & 1], 8 * (kSlabs - 1) + 2 * k + (e >> 1)) + 4 * tq);
    }
#endif

    for (int j = 0; 2 * j < n_blk; ++j) {
      const int b0 = blk_lo + 2 * j, b1 = b0 + 1;
      const bool has1 = 2 * j + 1 < n_blk, nxt0 = 2 * j + 2 < n_blk, nxt1 = 2 * j + 3 < n_blk;
      const int tok0 = b0 * kBlockN, tok1 = tok0 + kBlockN;
      const int valid0 = min(seqlen - tok0, kBlockN), valid1 = min(seqlen - tok1, kBlockN);
      // Page ids of the next pair, read by the issuing threads (tid 0 / 128) between their warpgroup's S
      // chain commit and its wait. Every wgmma of the chain is issued only when all four warps reach it,
      // so these ~40 instructions (block-table loads with their 64-bit address arithmetic, two branches)
      // in front of the first S wgmma delayed the whole warpgroup, while after the commit the warp only
      // waits. The ids are first used by the reloads after P0 V0_L (warpgroup 0) / P1 V1_R (warpgroup 1),
      // far behind the S wait, so the load latency stays hidden.
      int pgA = 0, pgB = 0;
      auto read_next_pages = [&]() {
        if (t_wg == 0) {
          if (nxt0) pgA = page_of(b0 + 2, 0);
          if (nxt1) pgB = page_of(b1 + 2, 0);
        }
      };
      if (wg == 0) {
        // ---------------- warpgroup 0: block 0, O[:, 0:256]
        // S0 over stage 0, each slab after its TMA barrier; the next pair's page ids read while it runs.
        FLASHMLA_DENSE_TRACE_STEP(0, 0, t_wg == 0);
        FLASHMLA_DENSE_STEP_ONLY(if (FLASHMLA_TRACE_ACTIVE() && t_wg == 0) tma::mbar_wait(bar_u, phase);)
        FLASHMLA_DENSE_TRACE_STEP(0, 1, t_wg == 0);
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
        gmma::reg_fence(s);
#if FLASHMLA_DENSE_DECODE_QREG
        s_chain_wg0_q<T, kSlabs>(s, dq, gmma::make_desc_sw128(sK_u, 16, 1024), bar_u, phase, q8);
#else
        s_chain_wg0<T, kSlabs>(s, dq, gmma::make_desc_sw128(sK_u, 16, 1024), bar_u, phase);
#endif
        gmma::commit();
        read_next_pages();
        gmma::wait<0>();
        gmma::reg_fence(s);
        phase ^= 1u;
        FLASHMLA_DENSE_TRACE_STEP(0, 2, t_wg == 0);

        const bool need_mask = tok0 + kBlockN > min_limit;
        float mx[2] = {-INFINITY, -INFINITY};
        scale_mask_rowmax(s, p.scale_log2, need_mask, tok0, tq, limit, mx);
        float m0u[2], sc0[2];
        seesaw::first_block_row_max(sM0, sS0, row_local, tq, mx, m_run, m0u, sc0, [&](int hh) {
          mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
          mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
        });
        bar_arrive(kBarScale0, kThreads);
        FLASHMLA_DENSE_TRACE_STEP(0, 3, t_wg == 0);

        // m0 read back from sM0: warpgroup 1 waits at kBarScale0 before its whole softmax, P1 store and
        // P1 V1_R, but with the register copy of m0 ptxas scheduled all of P0's MUFU.EX2 and the row-sum
        // adds above the BAR.ARV (bf16 576: 128 instructions, 34 MUFU from the first row-max shuffle to
        // the arrival); a load after the arrival that the exps depend on keeps them below it (28
        // instructions, 2 MUFU: the scale0 exps). Cost: two LDS (and a compare / select each). A branch
        // between the arrival and the exps did not work: ptxas hoisted the exps across it. Exact: m0 is
        // the same in every lane of a quad; `__syncwarp` orders the tq == 0 lanes' stores before the loads.
        __syncwarp();
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float m0 = sM0[row_local[hh]];
          m0u[hh] = m0 == -INFINITY ? 0.f : m0;
        }
        float rs[2] = {0.f, 0.f};
        uint32_t a[4][4];
        seesaw::exp_pack<T>(s, m0u, rs, a);  // P0 (the P0 V0_L A operand)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] = l_run[hh] * sc0[hh] + rs[hh];
        seesaw::scale_o(o, sc0);
        if (valid0 < kBlockN) zero_v_rows(sK, valid0, t_wg, kBarWG0);
        gmma::reg_fence(o);
        gmma::fence();
        pv_rs_chain<T>(o, a, gmma::make_desc_sw128(sK_u, kSlabBytes, 1024));
        gmma::commit();
        FLASHMLA_DENSE_TRACE_STEP(0, 4, t_wg == 0);

        named_barrier_sync(kBarScale1, kThreads);
        FLASHMLA_DENSE_TRACE_STEP(0, 5, t_wg == 0);
        float sc1[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          sc1[hh] = sS1[row_local[hh]];
          m_run[hh] = sM1[row_local[hh]];
        }
        // P0 * scale1 -> slab 8 of stage 0 (S0 is done with it)
#if FLASHMLA_DENSE_DECODE_QREG
        // The same packed values as the STS form below (fragment t = 2k + (j >> 1), row j & 1), by stmatrix.
        // `a` is P0 V0_L's A operand, in flight: fresh registers, one k-step at a time.
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          uint32_t f[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int t = 2 * k + (j >> 1), hh = j & 1;
            f[j] = HalfTraits<T>::pack(s[4 * t + 2 * hh] * sc1[hh], s[4 * t + 2 * hh + 1] * sc1[hh]);
          }
          stmatrix_x4(sK_u + 8 * kSlabBytes + (p_stsm_off(wq, lane) ^ (k << 5)), f[0], f[1], f[2], f[3]);
        }
#else
        uint8_t* sP0 = sK + 8 * kSlabBytes;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const int key = 8 * t + 2 * tq;
          *reinterpret_cast<uint32_t*>(sP0 + slab_off(row_local[0], key >> 3) + (key & 7) * 2) =
              HalfTraits<T>::pack(s[4 * t + 0] * sc1[0], s[4 * t + 1] * sc1[0]);
          *reinterpret_cast<uint32_t*>(sP0 + slab_off(row_local[1], key >> 3) + (key & 7) * 2) =
              HalfTraits<T>::pack(s[4 * t + 2] * sc1[1], s[4 * t + 3] * sc1[1]);
        }
#endif
        gmma::fence_proxy_async();
        bar_arrive(kBarP0, kThreads);
        FLASHMLA_DENSE_TRACE_STEP(0, 6, t_wg == 0);

        gmma::wait<0>();
        gmma::reg_fence(o);
        FLASHMLA_DENSE_TRACE_STEP(0, 7, t_wg == 0);
        refill(tid == 0 && nxt0, b0 + 2, 0, 0, 4, pgA, 0);  // stage 0 slabs 0-3 are free
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] *= sc1[hh];
        seesaw::scale_o(o, sc1);
        named_barrier_sync(kBarP1, kThreads);
        FLASHMLA_DENSE_TRACE_STEP(0, 8, t_wg == 0);
        if (has1) {
          if (valid1 < kBlockN) zero_v_rows(sK + kSmemK, valid1, t_wg, kBarWG0);
          gmma::reg_fence(o);
          gmma::fence();
          pv_ss_chain<T>(o, gmma::make_desc_sw128(sK_u + kSmemK + 8 * kSlabBytes, 16, 1024),
                         gmma::make_desc_sw128(sK_u + kSmemK, kSlabBytes, 1024));
          gmma::commit();
          FLASHMLA_DENSE_TRACE_STEP(0, 9, t_wg == 0);
          gmma::wait<0>();
          gmma::reg_fence(o);
          FLASHMLA_DENSE_TRACE_STEP(0, 10, t_wg == 0);
          if (tid == 0 && nxt1) {  // stage 1 slabs 0-3 and 8 are free
            issue(b1 + 2, 1, 0, 4, pgB);
            issue(b1 + 2, 1, 8, 9, pgB);
            FLASHMLA_DENSE_TRACE_STEP(2, 1, true);
          }
        }
        FLASHMLA_DENSE_TRACE_STEP(0, 11, t_wg == 0);
      } else {
        // ---------------- warpgroup 1: block 1, O[:, 256:512]
        float mx[2] = {-INFINITY, -INFINITY};
        FLASHMLA_DENSE_TRACE_STEP(1, 0, t_wg == 0);
        if (has1) {
          FLASHMLA_DENSE_STEP_ONLY(
              if (FLASHMLA_TRACE_ACTIVE() && t_wg == 0) tma::mbar_wait(bar_u + 9 * 8 + 4 * 8, phase);)
          FLASHMLA_DENSE_TRACE_STEP(1, 1, t_wg == 0);
#pragma unroll
          for (int i = 0; i < 32; ++i) s[i] = 0.f;
          gmma::reg_fence(s);
#if FLASHMLA_DENSE_DECODE_QREG
          s_chain_wg1_q<T, kSlabs>(s, dq, gmma::make_desc_sw128(sK_u + kSmemK, 16, 1024), bar_u + 9 * 8, phase, q8);
#else
          s_chain_wg1<T, kSlabs>(s, dq, gmma::make_desc_sw128(sK_u + kSmemK, 16, 1024), bar_u + 9 * 8, phase);
#endif
          gmma::commit();
          read_next_pages();  // while S1 is computed; without block 1 there is no next pair
          gmma::wait<0>();
          gmma::reg_fence(s);
          phase ^= 1u;
          FLASHMLA_DENSE_TRACE_STEP(1, 2, t_wg == 0);
          const bool need_mask = tok1 + kBlockN > min_limit;
          scale_mask_rowmax(s, p.scale_log2, need_mask, tok1, tq, limit, mx);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
          }
        }
        named_barrier_sync(kBarScale0, kThreads);
        FLASHMLA_DENSE_TRACE_STEP(1, 3, t_wg == 0);
        float m1u[2], c[2];
        seesaw::second_block_row_max(sM0, sS0, sM1, sS1, row_local, tq, mx, m_run, m1u, c);
        bar_arrive(kBarScale1, kThreads);
        FLASHMLA_DENSE_TRACE_STEP(1, 4, t_wg == 0);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) l_run[hh] *= c[hh];
        seesaw::scale_o(o, c);
        // P1 V1_R (P1 from registers) is issued right after P1's stores to shared memory; only then are
        // the stores fenced for the async proxy and P1 announced (kBarP1): the fence (MEMBAR), not the
        // stores, is what held the issue back. P1's announcement comes later by the four wgmma issues,
        // but warpgroup 0 consumes P1 (P1 V1_L) only behind P1 V1_R in the pipe anyway; FlashMLA's dense
        // decode orders it the same way. The stores stay in front of the issue: reading the A registers
        // of a wgmma in flight is undefined in PTX. The partial-block V zeroing (its
        // own warpgroup-1 barrier) comes before the stores.
        uint32_t a[4][4];
        if (has1) {
          float rs[2] = {0.f, 0.f};
          seesaw::exp_pack<T>(s, m1u, rs, a);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) l_run[hh] += rs[hh];
          if (valid1 < kBlockN) zero_v_rows(sK + kSmemK + 4 * kSlabBytes, valid1, t_wg, kBarWG1);
#if FLASHMLA_DENSE_DECODE_QREG
          store_p_stsm(a, sK_u + kSmemK + 8 * kSlabBytes, p_stsm_off(wq, lane));  // P1 -> slab 8 of stage 1
#else
          seesaw::store_p(a, sK + kSmemK + 8 * kSlabBytes, row_local, tq);  // P1 -> slab 8 of stage 1
#endif
          gmma::reg_fence(o);
          gmma::fence();
          pv_rs_chain<T>(o, a, gmma::make_desc_sw128(sK_u + kSmemK + 4 * kSlabBytes, kSlabBytes, 1024));
          gmma::commit();
          FLASHMLA_DENSE_TRACE_STEP(1, 5, t_wg == 0);
          gmma::fence_proxy_async();
        }
        bar_arrive(kBarP1, kThreads);
        FLASHMLA_DENSE_TRACE_STEP(1, 6, t_wg == 0);
        named_barrier_sync(kBarP0, kThreads);
        FLASHMLA_DENSE_TRACE_STEP(1, 7, t_wg == 0);
        if (valid0 < kBlockN) zero_v_rows(sK + 4 * kSlabBytes, valid0, t_wg, kBarWG1);
        gmma::fence();
        pv_ss_chain<T>(o, gmma::make_desc_sw128(sK_u + 8 * kSlabBytes, 16, 1024),
                       gmma::make_desc_sw128(sK_u + 4 * kSlabBytes, kSlabBytes, 1024));
        gmma::commit();
        FLASHMLA_DENSE_TRACE_STEP(1, 8, t_wg == 0);
        gmma::wait<1>();  // P1 V1_R done: stage 1's slabs 4-7 are free (s_chain_wg1 reads them first)
        FLASHMLA_DENSE_TRACE_STEP(1, 9, t_wg == 0 && has1);  // (without block 1 there is no P1 V1_R)
        refill(tid == 128 && nxt1, b1 + 2, 1, 4, 8, pgB, 2);
        gmma::wait<0>();
        gmma::reg_fence(o);
        FLASHMLA_DENSE_TRACE_STEP(1, 10, t_wg == 0);
        refill(tid == 128 && nxt0, b0 + 2, 0, 4, 9, pgA, 3);  // stage 0 slabs 4-8 are free
        FLASHMLA_DENSE_TRACE_STEP(1, 11, t_wg == 0);
      }
      FLASHMLA_DENSE_STEP_ONLY(++dtrace_step;)
    }

    // ---- epilogue: L = WG0's part + WG1's part
    FLASHMLA_DENSE_TRACE_CTA(1 + dtrace_req, 4);
    quad_sum(l_run);
    float L[2] = {0.f, 0.f};
    if (n_blk > 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (tq == 0) sL[wg * 64 + row_local[hh]] = l_run[hh];
      __syncthreads();
      FLASHMLA_DENSE_TRACE_CTA(1 + dtrace_req, 5);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) L[hh] = sL[row_local[hh]] + sL[64 + row_local[hh]];
    }

    if constexpr (kStaged) {
      // O through shared memory: each warpgroup stages its 256 columns of the 64 rows (O / L, bf16 /
      // fp16 for out, fp32 for a split's partial) in the K stage it reads last (free: every wgmma
      // finished before the barrier above), rows padded by 16 / 32 B (conflict-free stores); then one
      // warp writes each row with one bulk copy when the rows are 16-byte aligned (split partials
      // always are), else the warpgroup copies element by element. The direct register
      // stores (8 rows x 16 B per warp instruction) were ~1/4 of a short-context call.
      {
        const int rstride = no_split ? kDimV + 16 : 4 * 256 + 32;  // bytes per staged row
        // Every per-thread offset below is made to depend on req (rq0 = 0 for every valid request
        // index). As plain per-thread constants the compiler hoists them out of the request loop
        // and holds them through the pair loop, which then recomputes its own P-store addresses
        // (+10% instructions in the pair loop, 5% slower on long contexts).
        const int rq0 = static_cast<int>(static_cast<uint32_t>(req) >> 31);
        uint8_t* stg = sK + (wg + rq0) * kSmemK;
        const int rl[2] = {row_local[0] + rq0, row_local[1] + rq0}, tq_e = tq + rq0;
        const int tid_e = tid + rq0;
        const int lane_e = tid_e & 31, wq_e = (tid_e >> 5) & 3, row0 = row_global[0] - row_local[0] + rq0;
        float inv[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) inv[hh] = row_sum_empty(L[hh]) ? 0.f : 1.f / L[hh];
        if (no_split) {
#pragma unroll
          for (int j = 0; j < 32; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
              *reinterpret_cast<uint32_t*>(stg + rl[hh] * rstride + (j * 8 + 2 * tq_e) * 2) =
                  HalfTraits<T>::pack(o[4 * j + 2 * hh] * inv[hh], o[4 * j + 2 * hh + 1] * inv[hh]);
        } else {
#pragma unroll
          for (int j = 0; j < 32; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
              *reinterpret_cast<float2*>(stg + rl[hh] * rstride + (j * 8 + 2 * tq_e) * 4) =
                  make_float2(o[4 * j + 2 * hh] * inv[hh], o[4 * j + 2 * hh + 1] * inv[hh]);
        }
        gmma::fence_proxy_async();  // generic stores -> the bulk copies' (async proxy) reads
        if (wg == 0) named_barrier_sync(kBarWG0, 128);
        else named_barrier_sync(kBarWG1, 128);
        if (no_split ? p.out_bulk_ok : p.accum_bulk_ok) {
          if (wq_e == 0) {
            for (int rr = lane_e; rr < kBlockM; rr += 32) {
              const int grow = row0 + rr;
              if (grow >= p.m_rows) continue;
              void* dst;
              if (no_split) {
                const int sq = grow / p.group, h = kv_head * p.group + (grow - sq * p.group);
                dst = static_cast<T*>(p.out) + req * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h + wg * 256;
              } else {
                const int64_t arow = (static_cast<int64_t>(split_slot) * p.h_kv + kv_head) * p.m_rows + grow;
                dst = p.o_accum + arow * kDimV + wg * 256;
              }
              tma::bulk_store(dst, sK_u + wg * kSmemK + rr * rstride, no_split ? 512u : 1024u);
            }
            tma::bulk_commit();
          }
        } else {
#pragma unroll 1
          for (int i = t_wg; i < kBlockM * 256; i += 128) {
            const int rr = i >> 8, col = i & 255;
            const int grow = row0 + rr;
            if (grow >= p.m_rows) continue;
            if (no_split) {
              const int sq = grow / p.group, h = kv_head * p.group + (grow - sq * p.group);
              static_cast<T*>(p.out)[req * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h +
                                     static_cast<int64_t>(wg * 256 + col) * p.o_stride_d] =
                  *reinterpret_cast<const T*>(stg + rr * rstride + col * 2);
            } else {
              const int64_t arow = (static_cast<int64_t>(split_slot) * p.h_kv + kv_head) * p.m_rows + grow;
              p.o_accum[arow * kDimV + wg * 256 + col] = *reinterpret_cast<const float*>(stg + rr * rstride + col * 4);
            }
          }
        }
      }
      // LSE (natural log for out, base 2 for a split's partial; empty: +inf / -inf)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int grow = row_global[hh];
        if (grow >= p.m_rows || wg != 0 || tq != 0) continue;
        const bool empty = row_sum_empty(L[hh]);
        const float lse2 = empty ? (no_split ? INFINITY : -INFINITY) : log2f(L[hh]) + m_run[hh];
        if (no_split) {
          const int sq = row_sq[hh], h = kv_head * p.group + grow % p.group;
          p.lse[req * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = empty ? INFINITY : lse2 * kLn2;
        } else {
          p.lse_accum[(static_cast<int64_t>(split_slot) * p.h_kv + kv_head) * p.m_rows + grow] = lse2;
        }
      }
    } else {
      store_dense_decode_rows<T, 32, 256>(
          p, [&](int j, int e) { return o[4 * j + e]; }, L, m_run, row_global, row_sq, req, kv_head, split_slot,
          no_split, wg, wg == 0 && tq == 0, tq);
    }
    FLASHMLA_DENSE_TRACE_CTA(1 + dtrace_req, 6);
    FLASHMLA_TRACE_ONLY({
      FLASHMLA_DENSE_TRACE_VAL(1 + dtrace_req, 0, req);
      FLASHMLA_DENSE_TRACE_VAL(1 + dtrace_req, 1, n_blk);
      FLASHMLA_DENSE_TRACE_VAL(1 + dtrace_req, 2, no_split);
      FLASHMLA_DENSE_STEP_ONLY(FLASHMLA_DENSE_TRACE_VAL(1 + dtrace_req, 3, dtrace_step - (n_blk + 1) / 2);)
      FLASHMLA_DENSE_TRACE_VAL(1 + dtrace_req, 4, blk_lo);
      FLASHMLA_DENSE_TRACE_VAL(1 + dtrace_req, 5, split_slot);
      FLASHMLA_DENSE_TRACE_VAL(1 + dtrace_req, 6, seqlen);
      ++dtrace_req;
    })
  }
  if constexpr (kStaged) tma::bulk_wait_read();  // shared memory stays allocated until the bulk copies have read it
  FLASHMLA_DENSE_TRACE_CTA(0, 3);
  FLASHMLA_TRACE_ONLY({
    FLASHMLA_DENSE_TRACE_VAL(0, 1, ps.begin_req);
    FLASHMLA_DENSE_TRACE_VAL(0, 2, ps.end_req);
    FLASHMLA_DENSE_TRACE_VAL(0, 3, ps.begin_blk);
    FLASHMLA_DENSE_TRACE_VAL(0, 4, ps.end_blk);
    FLASHMLA_DENSE_TRACE_VAL(0, 5, dtrace_req);
    FLASHMLA_DENSE_TRACE_VAL(0, 6, (ps.first_splitted ? 1 : 0) | (ps.last_splitted ? 2 : 0));
  })
}

template <typename T, int kD>
cudaError_t launch_main_d(const DenseDecodeKernelParams& kp, const CUtensorMap& tmap, int num_sm_parts,
                          cudaStream_t stream) {
  auto kernel = kp.staged_epilogue ? flash_fwd_splitkv_mla_kernel_seesaw<T, kD, true>
                                   : flash_fwd_splitkv_mla_kernel_seesaw<T, kD, false>;
  cudaError_t e = set_max_dynamic_smem(kernel, kSmemBytes);
  if (e != cudaSuccess) return e;
  const int m_tiles = (kp.m_rows + kBlockM - 1) / kBlockM;
  const dim3 grid(m_tiles, kp.h_kv, num_sm_parts);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(kp, tmap);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_main(const DenseDecodeKernelParams& kp, const CUtensorMap& tmap, int num_sm_parts,
                        cudaStream_t stream) {
  if (kp.d_qk == 512) return launch_main_d<T, 512>(kp, tmap, num_sm_parts, stream);
  return launch_main_d<T, 576>(kp, tmap, num_sm_parts, stream);
}

}  // namespace flashmla::sm90::dense_seesaw

#undef FLASHMLA_DENSE_TRACE_CTA
#undef FLASHMLA_DENSE_TRACE_VAL
#undef FLASHMLA_DENSE_TRACE_STEP
#undef FLASHMLA_DENSE_STEP_ONLY
