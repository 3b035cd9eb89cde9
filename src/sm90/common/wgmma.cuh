// src/sm90/common/wgmma.cuh — the sm90a wgmma instructions used by the sm90 kernels (fences, commit /
// wait, m64nNk16 multiply-accumulates with A from shared memory or registers) and shared-memory matrix
// descriptors (PTX ISA "wgmma", "Matrix Descriptor Format").
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "sm90/common/wgmma_operands.cuh"

namespace flashmla::sm90::gmma {

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes generic-proxy shared-memory writes (st.shared, cp.async) visible to wgmma.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accumulator accesses across wgmma boundaries.
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Commits the wgmma operations issued so far as a group, waits until every group is done and fences
// accumulator d: its values are final after.
template <int N>
__device__ __forceinline__ void commit_wait(float (&d)[N]) {
  commit();
  wait<0>();
  reg_fence(d);
}

// 128-byte-swizzled descriptor. `addr` = shared-memory byte address (>> 4 stored),
// lbo/sbo in bytes. K-major: lbo unused (16), sbo = 1024 (8 rows x 128 B).
// MN-major: lbo = byte stride between 64-element column blocks, sbo = 1024.
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr >> 4) & 0x3FFF);
  d |= static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // layout type 1 = 128B swizzle
  return d;
}

// ---- wgmma.mma_async (PTX ISA "wgmma.mma_async"): D(64 x N, fp32) (+)= A(64 x 16) * B(16 x N), bf16 or
// fp16 operands, the accumulators d[N / 2] in the wgmma accumulator layout. Each form is written once,
// as a macro over the instruction shape and type; its accumulator operands come from
// wgmma_operands.cuh, and the operands after them are numbered from N / 2 on: the arguments O0, O1, ...
// spell N / 2, N / 2 + 1, ... (the preprocessor cannot add).

/// Wgmma<T, N>: m64nNk16, T = __nv_bfloat16 or __half, N = 32, 64, 128, 192 or 256.
///   ss<kTnspA, kTnspB>(d, desc_a, desc_b, scale_d): A and B from shared-memory descriptors (kTnsp = 1: the
///     operand is MN-major); scale_d = 0 overwrites d, 1 accumulates.
///   rs<kTnspB>(d, a, desc_b): d += A B, A from registers (the m16n8k16 A fragment of each warp's 16 rows),
///     B from a descriptor.
template <class T, int N>
struct Wgmma;

#define FLASHMLA_GMMA_WGMMA(T, PTX_T, N, ND, O0, O1, O2, O3, O4, O5)                                              \
  template <>                                                                                                    \
  struct Wgmma<T, N> {                                                                                           \
    template <int kTnspA, int kTnspB>                                                                            \
    __device__ __forceinline__ static void ss(float (&d)[ND], uint64_t desc_a, uint64_t desc_b, int scale_d) {  \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #O2 ", 0;\n"                                             \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " " FLASHMLA_WGMMA_ACC_##ND \
                   ", %" #O0 ", %" #O1 ", p, 1, 1, %" #O3 ", %" #O4 ";\n}\n"                                    \
                   : FLASHMLA_WGMMA_ACC_OUT_##ND(d)                                                              \
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTnspA), "n"(kTnspB));                          \
    }                                                                                                            \
    template <int kTnspB>                                                                                        \
    __device__ __forceinline__ static void rs(float (&d)[ND], const uint32_t (&a)[4], uint64_t desc_b) {         \
      asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"                                                   \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " " FLASHMLA_WGMMA_ACC_##ND \
                   ", {%" #O0 ", %" #O1 ", %" #O2 ", %" #O3 "}, %" #O4 ", p, 1, 1, %" #O5 ";\n}\n"              \
                   : FLASHMLA_WGMMA_ACC_OUT_##ND(d)                                                              \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTnspB));                      \
    }                                                                                                            \
  };
#define FLASHMLA_GMMA_WGMMA_BF16_F16(N, ND, ...)                 \
  FLASHMLA_GMMA_WGMMA(__nv_bfloat16, "bf16", N, ND, __VA_ARGS__) \
  FLASHMLA_GMMA_WGMMA(__half, "f16", N, ND, __VA_ARGS__)
FLASHMLA_GMMA_WGMMA_BF16_F16(32, 16, 16, 17, 18, 19, 20, 21)
FLASHMLA_GMMA_WGMMA_BF16_F16(64, 32, 32, 33, 34, 35, 36, 37)
FLASHMLA_GMMA_WGMMA_BF16_F16(128, 64, 64, 65, 66, 67, 68, 69)
FLASHMLA_GMMA_WGMMA_BF16_F16(192, 96, 96, 97, 98, 99, 100, 101)
FLASHMLA_GMMA_WGMMA_BF16_F16(256, 128, 128, 129, 130, 131, 132, 133)
#undef FLASHMLA_GMMA_WGMMA_BF16_F16
#undef FLASHMLA_GMMA_WGMMA

// The seesaw kernels' forms, with compile-time byte offsets (>> 4) added to the descriptors inside the
// asm block: in a fully unrolled chain the compiler then cannot hoist 2 x 36 loop-invariant 64-bit
// descriptors into registers. B is MN-major when kTnspB = 1.
//   mma_m64n64k16_off_<t><kTnspB, kOffA, kOffB, kScaleD>(d, desc_a, desc_b): S = Q K^T; kScaleD = 0
//     overwrites d, 1 accumulates.
//   mma_m64n256k16_off_<t><kTnspB, kOffA, kOffB>(d, desc_a, desc_b): d += A B.
//   mma_m64n256k16_rs_<t><kTnspB, kOffB>(d, a, desc_b): d += A B, A from registers (the m16n8k16 A
//     fragment of each warp's 16 rows); V read from the K tile as B (kTnspB = 1).
#define FLASHMLA_GMMA_SEESAW_FORMS(T_NAME, PTX_T)                                                                 \
  template <int kTnspB, int kOffA, int kOffB, int kScaleD>                                                       \
  __device__ __forceinline__ void mma_m64n64k16_off_##T_NAME(float (&d)[32], uint64_t desc_a, uint64_t desc_b) { \
    asm volatile("{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %34, 0;\n"                                \
                 "add.s64 da, %32, %35;\nadd.s64 db, %33, %36;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_T "." PTX_T " " FLASHMLA_WGMMA_ACC_32         \
                 ", da, db, p, 1, 1, 0, %37;\n}\n"                                                               \
                 : FLASHMLA_WGMMA_ACC_OUT_32(d)                                                                  \
                 : "l"(desc_a), "l"(desc_b), "n"(kScaleD), "n"(kOffA), "n"(kOffB), "n"(kTnspB));                 \
  }                                                                                                              \
  template <int kTnspB, int kOffA, int kOffB>                                                                    \
  __device__ __forceinline__ void mma_m64n256k16_off_##T_NAME(float (&d)[128], uint64_t desc_a, uint64_t desc_b) { \
    asm volatile("{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.eq.u32 p, 1, 1;\n"                                 \
                 "add.s64 da, %128, %130;\nadd.s64 db, %129, %131;\n"                                            \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_T "." PTX_T " " FLASHMLA_WGMMA_ACC_128       \
                 ", da, db, p, 1, 1, 0, %132;\n}\n"                                                              \
                 : FLASHMLA_WGMMA_ACC_OUT_128(d)                                                                 \
                 : "l"(desc_a), "l"(desc_b), "n"(kOffA), "n"(kOffB), "n"(kTnspB));                               \
  }                                                                                                              \
  template <int kTnspB, int kOffB>                                                                               \
  __device__ __forceinline__ void mma_m64n256k16_rs_##T_NAME(float (&d)[128], const uint32_t (&a)[4],            \
                                                             uint64_t desc_b) {                                  \
    asm volatile("{\n.reg .pred p;\n.reg .b64 db;\nsetp.eq.u32 p, 1, 1;\nadd.s64 db, %132, %133;\n"            \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_T "." PTX_T " " FLASHMLA_WGMMA_ACC_128       \
                 ", {%128, %129, %130, %131}, db, p, 1, 1, %134;\n}\n"                                           \
                 : FLASHMLA_WGMMA_ACC_OUT_128(d)                                                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kOffB), "n"(kTnspB));            \
  }
FLASHMLA_GMMA_SEESAW_FORMS(bf16, "bf16")
FLASHMLA_GMMA_SEESAW_FORMS(f16, "f16")
#undef FLASHMLA_GMMA_SEESAW_FORMS

}  // namespace flashmla::sm90::gmma
