// src/sm90/common/seesaw.cuh — pieces shared by the sm90 "seesaw" kernels (spec §7.1): two
// consumer warpgroups on one 64-row tile, S = Q K^T with a fully unrolled m64n64k16 wgmma chain
// over 128B-swizzled 64-dim slabs, O by columns with m64n256k16 (P from registers or smem),
// named-barrier / setmaxnreg wrappers (the mbarrier ones are in utils.cuh), the lazy running max and
// the two warpgroups' row-max steps. Used by the seesaw kernels of dense decode
// (decode/dense/wgmma_seesaw_kernel.cuh) and sparse prefill (prefill/sparse/wgmma_seesaw_kernel.cuh) and
// by the sparse FP8 decode wgmma producer kernel (decode/sparse_fp8/wgmma_producer_kernel.cuh); the dense
// decode wgmma kernel and the dense prefill kernels take the rescale, row-max and barrier pieces.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "sm90/common/utils.cuh"
#include "sm90/common/wgmma.cuh"

namespace flashmla::sm90::seesaw {

constexpr int kSlabBytes = 64 * 128;  // one 64-row x 64-dim bf16 slab, 128B swizzle

__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

__device__ __forceinline__ uint32_t slab_off(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * kSlabBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// S (+)= Q K^T over slabs [kSl, kEnd), fully unrolled (immediate descriptor offsets). The chain's
// first wgmma (slab kFirst, k 0) overwrites S (scale-d 0); every other one accumulates, so a chain
// may run its slabs in any order as long as kFirst names the slab issued first.
template <int kSl, int kK, int kFirst = 0>
__device__ __forceinline__ void s_step(float (&s)[32], uint64_t da0, uint64_t db0) {
  constexpr int kOff = (kSl * kSlabBytes + kK * 32) >> 4;
  gmma::mma_m64n64k16_off_bf16<0, kOff, kOff, (kSl != kFirst || kK != 0) ? 1 : 0>(s, da0, db0);
  if constexpr (kK + 1 < 4) s_step<kSl, kK + 1, kFirst>(s, da0, db0);
}
template <int kSl, int kEnd, int kFirst = 0>
__device__ __forceinline__ void s_chain(float (&s)[32], uint64_t da0, uint64_t db0) {
  s_step<kSl, 0, kFirst>(s, da0, db0);
  if constexpr (kSl + 1 < kEnd) s_chain<kSl + 1, kEnd, kFirst>(s, da0, db0);
}
template <int kK = 0>
__device__ __forceinline__ void pv_rs_chain(float (&o)[128], const uint32_t (&a)[4][4], uint64_t db0) {
  gmma::mma_m64n256k16_rs_bf16<1, ((kK * 16 * 128) >> 4)>(o, a[kK], db0);
  if constexpr (kK + 1 < 4) pv_rs_chain<kK + 1>(o, a, db0);
}
template <int kK = 0>
__device__ __forceinline__ void pv_ss_chain(float (&o)[128], uint64_t da0, uint64_t db0) {
  gmma::mma_m64n256k16_off_bf16<1, ((kK * 32) >> 4), ((kK * 16 * 128) >> 4)>(o, da0, db0);
  if constexpr (kK + 1 < 4) pv_ss_chain<kK + 1>(o, da0, db0);
}

// Lazy rescaling (as FlashAttention-4): the running max m that P = exp2(S - m), O and the row sum l
// are taken against moves only when a block's row max exceeds it by more than kRescaleSlack (log2
// units). P then stays <= 2^kRescaleSlack (representable in bf16 / fp16, far from overflow), and once m
// has settled the rescale factors exp2(m_old - m_new) are exactly 1, so scale_o skips its 128
// multiplies. The softmax is unchanged (O and l share m; lse = log2 l + m); a kernel that reports
// the row max itself (sparse prefill's max_logits) tracks the true max separately.
// FLASHMLA_RESCALE_SLACK=0 moves m on every increase (the exact online-softmax schedule).
#ifndef FLASHMLA_RESCALE_SLACK
#define FLASHMLA_RESCALE_SLACK 8
#endif
constexpr float kRescaleSlack = FLASHMLA_RESCALE_SLACK;
static_assert(kRescaleSlack >= 0.f && kRescaleSlack <= 10.f,
              "P <= 2^slack must stay far below fp16's 65504 (dense decode packs P to fp16)");
__device__ __forceinline__ float lazy_max(float m_run, float block_max) {
  return block_max > m_run + kRescaleSlack ? block_max : m_run;
}

// O *= per-row factors over one thread's accumulator fragment: elements 4i, 4i+1 are its first
// row, 4i+2, 4i+3 its second (the wgmma / mma.sync C layout), so one loop serves every O width.
template <int N>
__device__ __forceinline__ void scale_rows(float (&o)[N], const float (&sc)[2]) {
  static_assert(N % 4 == 0, "an accumulator fragment holds whole groups of 4 (2 rows x 2 columns)");
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    o[4 * i + 0] *= sc[0];
    o[4 * i + 1] *= sc[0];
    o[4 * i + 2] *= sc[1];
    o[4 * i + 3] *= sc[1];
  }
}

__device__ __forceinline__ void scale_o(float (&o)[128], const float (&sc)[2]) {
  if (__any_sync(0xffffffffu, sc[0] != 1.f || sc[1] != 1.f)) scale_rows(o, sc);
}

// Warpgroup 0's row max after the first key block, per row: the caller's step row_step(hh) on the
// block's row max mx[hh] (dense decode reduces it over the quad; sparse prefill, whose mx comes
// reduced, folds it into its true row max), m0 = lazy_max(m_run, mx), m0u (m0 with -inf read as 0),
// sc0 = exp2(m_run - m0u) the factor of warpgroup 0's O and l, and m0, sc0 published for warpgroup 1
// (sM0, sS0; one step the dense decode and sparse prefill seesaw kernels share). m_run is not moved.
template <class RowStep>
__device__ __forceinline__ void first_block_row_max(float* sM0, float* sS0, const int (&row_local)[2], int tq,
                                                    float (&mx)[2], const float (&m_run)[2], float (&m0u)[2],
                                                    float (&sc0)[2], RowStep row_step) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_step(hh);
    const float m0 = lazy_max(m_run[hh], mx[hh]);
    m0u[hh] = m0 == -INFINITY ? 0.f : m0;
    sc0[hh] = exp2f(m_run[hh] - m0u[hh]);
    if (tq == 0) {
      sM0[row_local[hh]] = m0;
      sS0[row_local[hh]] = sc0[hh];
    }
  }
}

// Warpgroup 1's row max after the second key block: m1 = lazy_max(m0, mx) against warpgroup 0's m0
// (sM0), sc1 = exp2(m0 - m1) published with m1 for warpgroup 0 (sM1, sS1), c = sc0 * sc1 the factor of
// warpgroup 1's own O and l (one step the dense decode and sparse prefill seesaw kernels share).
// m1u is m1 with -inf read as 0, so an all-masked row's exp2 gives 0, not NaN.
__device__ __forceinline__ void second_block_row_max(const float* sM0, const float* sS0, float* sM1, float* sS1,
                                                     const int (&row_local)[2], int tq, const float (&mx)[2],
                                                     float (&m_run)[2], float (&m1u)[2], float (&c)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float m0 = sM0[row_local[hh]];
    const float sc0 = sS0[row_local[hh]];
    const float m1 = lazy_max(m0, mx[hh]);
    m1u[hh] = m1 == -INFINITY ? 0.f : m1;
    const float sc1 = exp2f(m0 - m1u[hh]);
    if (tq == 0) {
      sM1[row_local[hh]] = m1;
      sS1[row_local[hh]] = sc1;
    }
    c[hh] = sc0 * sc1;
    m_run[hh] = m1;
  }
}

// Fragment t (keys 8t + 2tq, +1 of both rows) of exp_pack / exp_pack_store_p: P = exp2(S - m), the
// row sums added to rs, packed to T (bf16 or fp16) into a[t / 2].
template <class T>
__device__ __forceinline__ void exp_pack_fragment(float (&s)[32], const float (&m)[2], float (&rs)[2],
                                                  uint32_t (&a)[4][4], int t) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    s[4 * t + e] = exp2f(s[4 * t + e] - m[e >> 1]);
    rs[e >> 1] += s[4 * t + e];
  }
  a[t >> 1][(t & 1) * 2 + 0] = HalfTraits<T>::pack(s[4 * t + 0], s[4 * t + 1]);
  a[t >> 1][(t & 1) * 2 + 1] = HalfTraits<T>::pack(s[4 * t + 2], s[4 * t + 3]);
}

// Fragment t of `a` (keys 8t + 2tq, +1 of both rows) into the 128B-swizzled P slab sP.
__device__ __forceinline__ void store_p_fragment(const uint32_t (&a)[4][4], uint8_t* sP, const int (&row_local)[2],
                                                 int tq, int t) {
  const int key = 8 * t + 2 * tq;
  *reinterpret_cast<uint32_t*>(sP + slab_off(row_local[0], key >> 3) + (key & 7) * 2) = a[t >> 1][(t & 1) * 2 + 0];
  *reinterpret_cast<uint32_t*>(sP + slab_off(row_local[1], key >> 3) + (key & 7) * 2) = a[t >> 1][(t & 1) * 2 + 1];
}

// P = exp2(S - m) for the thread's two rows (row sums added to rs), packed to T (bf16 or fp16) as
// the P.V A-operand fragments `a`, and stored into the 128B-swizzled slab sP (64 rows x 64 keys)
// for the other consumer warpgroup's SS P.V.
template <class T = __nv_bfloat16>
__device__ __forceinline__ void exp_pack_store_p(float (&s)[32], const float (&m)[2], float (&rs)[2],
                                                 uint32_t (&a)[4][4], uint8_t* sP, const int (&row_local)[2], int tq) {
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    exp_pack_fragment<T>(s, m, rs, a, t);
    store_p_fragment(a, sP, row_local, tq, t);
  }
}

// exp_pack_store_p in two steps, for kernels that do other work between computing P and storing it
// (dense decode: the partial-block V zeroing) or store it at their own addresses (sparse prefill).
// (exp_pack_store_p is not written as exp_pack + store_p: storing after all the exps instead of after
// each t changes ptxas's schedule of the sparse decode wgmma producer kernel, the measured kernel.)
// P = exp2(S - m) (S already scaled to base 2) for the thread's two rows, row sums into rs, packed to T
// as the P.V A-operand fragments `a`;
template <class T = __nv_bfloat16>
__device__ __forceinline__ void exp_pack(float (&s)[32], const float (&m)[2], float (&rs)[2], uint32_t (&a)[4][4]) {
#pragma unroll
  for (int t = 0; t < 8; ++t) exp_pack_fragment<T>(s, m, rs, a, t);
}
// and the fragments `a` into the 128B-swizzled slab sP as exp_pack_store_p stores them.
__device__ __forceinline__ void store_p(const uint32_t (&a)[4][4], uint8_t* sP, const int (&row_local)[2], int tq) {
#pragma unroll
  for (int t = 0; t < 8; ++t) store_p_fragment(a, sP, row_local, tq, t);
}

// The thread's two row maxima reduced over its quad (the 4 threads that share the rows).
__device__ __forceinline__ void quad_rowmax(float (&mx)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
    mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
  }
}
// S *= scale_log2 with the thread's own row maxima into mx (no masking, not reduced over the quad).
__device__ __forceinline__ void scale_rowmax_local(float (&s)[32], float scale_log2, float (&mx)[2]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    s[i] *= scale_log2;
    mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
  }
}

// Scale to base 2 and mask invalid slots (validity bytes of the stage) -> row maxima.
__device__ __forceinline__ void mask_rowmax(float (&s)[32], const uint8_t* vf, float scale_log2, int tq,
                                            float (&mx)[2]) {
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const uint32_t vv = *reinterpret_cast<const uint16_t*>(vf + 8 * t + 2 * tq);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool ok = (e & 1) ? (vv >> 8) != 0 : (vv & 0xFFu) != 0;
      const float v = ok ? s[4 * t + e] * scale_log2 : -INFINITY;
      s[4 * t + e] = v;
      mx[e >> 1] = fmaxf(mx[e >> 1], v);
    }
  }
  quad_rowmax(mx);
}

// mask_rowmax for a block whose slots are all valid: scale to base 2 -> row maxima, no masking.
__device__ __forceinline__ void scale_rowmax(float (&s)[32], float scale_log2, float (&mx)[2]) {
  scale_rowmax_local(s, scale_log2, mx);
  quad_rowmax(mx);
}

/// A seesaw kernel's tiles in dynamic shared memory, from its 1024-byte aligned start (128B-swizzle
/// atoms and wgmma descriptors need it): the Q tile (kSmemQ bytes), the two K stages (kSmemK each),
/// then the float reduction area sRed. sQ_u / sK_u: the shared::cta addresses of Q and of K stage 0;
/// sQ / sK: their generic pointers.
struct SmemTiles {
  uint32_t sQ_u, sK_u;
  uint8_t *sQ, *sK;
  float* sRed;
};
template <int kSmemQ, int kSmemK>
__device__ __forceinline__ SmemTiles smem_tiles(uint8_t* smem_raw) {
  uint32_t base_u;
  uint8_t* base = smem_align_1024(smem_raw, base_u);
  return {base_u, base_u + kSmemQ, base, base + kSmemQ, reinterpret_cast<float*>(base + kSmemQ + 2 * kSmemK)};
}

}  // namespace flashmla::sm90::seesaw
