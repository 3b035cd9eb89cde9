// src/sm90/common/utils.cuh — small PTX helpers shared by the sm90 kernels
// (cp.async, ldmatrix, mma.sync m16n8k16, named barriers, type traits).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace flashmla::sm90 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous global->shared copy; `src_bytes` = 0 zero-fills the
// destination without reading `src` (used for tokens past cache_seqlens).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// The 16-byte chunk of eight 2-byte elements at src read element by element (src only 2-byte
// aligned: a strided q the cp.async path cannot take); zeros, without reading src, when !valid.
__device__ __forceinline__ uint4 load_chunk16_by_elements(const void* src, bool valid) {
  uint16_t v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = valid ? static_cast<const uint16_t*>(src)[e] : 0;
  return make_uint4(v[0] | (uint32_t(v[1]) << 16), v[2] | (uint32_t(v[3]) << 16), v[4] | (uint32_t(v[5]) << 16),
                    v[6] | (uint32_t(v[7]) << 16));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Asynchronous prefetch of `bytes` (multiple of 16, 16-byte aligned) into L2.
__device__ __forceinline__ void prefetch_l2_bulk(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}

// Bulk (non-tensor) copy shared -> global of `bytes` (multiple of 16; both addresses 16-byte
// aligned), tracked by the issuing thread's bulk async-groups.
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(reinterpret_cast<uint64_t>(dst)),
               "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk stores have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// 16 / 8 bytes from global memory through the read-only path (ld.global.nc) with the cache qualifiers
// Q16 / Q8 (PTX ISA "ld"): NAME16(p) -> uint4, NAME8(p) -> uint2.
#define FLASHMLA_LDG_NC(NAME16, Q16, NAME8, Q8)                                            \
  __device__ __forceinline__ uint4 NAME16(const uint8_t* p) {                              \
    uint4 v;                                                                               \
    asm volatile("ld.global.nc" Q16 ".v4.u32 {%0, %1, %2, %3}, [%4];\n"                    \
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                               \
                 : "l"(p));                                                                \
    return v;                                                                              \
  }                                                                                        \
  __device__ __forceinline__ uint2 NAME8(const uint8_t* p) {                               \
    uint2 v;                                                                               \
    asm volatile("ld.global.nc" Q8 ".v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p)); \
    return v;                                                                              \
  }
// Not kept in L1 (streamed FP8 records).
FLASHMLA_LDG_NC(ldg16, ".L1::no_allocate", ldg8, ".L1::no_allocate")
// Kept in L1 (evict_last): the 16-byte pieces of one gathered record that share a 128-byte line become
// one L2 request; the 16-byte load also asks L2 to fetch the 256-byte neighbourhood from DRAM (the sparse
// FP8 decode producer's gathers, docs/sparse-fp8-decode.md).
FLASHMLA_LDG_NC(ldg16_evict_last_l2_256, ".L1::evict_last.L2::256B", ldg8_evict_last, ".L1::evict_last")
#undef FLASHMLA_LDG_NC

// ---- shared-memory mbarriers (PTX ISA "mbarrier"), addresses are shared::cta byte addresses
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes mbarrier.init visible to the async proxy (TMA complete_tx) and other threads.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrival (release) of this thread.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// This thread's arrival, also expecting `bytes` of transaction count (TMA / bulk copies / st.async
// completing on the barrier) in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrival once all prior cp.async of this thread have completed (count not incremented).
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
// Blocks until the phase with parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// Dynamic shared memory rounded up to a 1024-byte boundary (128B-swizzle atoms and wgmma
// descriptors need it): the generic pointer and the shared::cta address of that boundary.
__device__ __forceinline__ uint8_t* smem_align_1024(uint8_t* raw, uint32_t& base_u) {
  const uint32_t raw_u = smem_u32(raw);
  base_u = (raw_u + 1023u) & ~1023u;
  return raw + (base_u - raw_u);
}

__device__ __forceinline__ void named_barrier_sync(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(num_threads) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
// stmatrix m8n8 x4 (b16): r[k] is this thread's fragment of matrix k (row lane / 4, columns 2 (lane % 4)
// and + 1, as in an mma / wgmma accumulator); lanes 8k .. 8k + 7 give the shared addresses of matrix k's rows.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The 16-bit element types' conversions and tensor-core MMA: T is __nv_bfloat16 or __half.
template <typename T>
struct HalfTraits {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "HalfTraits: bf16 or fp16");
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;

  // (lo, hi) rounded to nearest even, lo in the low 16 bits.
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    if constexpr (kBf16) {
      __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&v);
    } else {
      __half2 v = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&v);
    }
  }
  __device__ __forceinline__ static T from_float(float x) {
    if constexpr (kBf16) return __float2bfloat16_rn(x);
    else return __float2half_rn(x);
  }
  // D = A * B + D, m16n8k16, fp32 accumulation.
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (kBf16)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// One step of a softmax row's running max (base 2) to m_new: m_use is the max the block's scores are
// shifted by (m_new, or 0 while the row has seen only -inf, so that P = 2^(-inf - 0) = 0 rather than
// NaN); returns alpha = 2^(m_run - m_use), the factor that rescales the row's O and L; m_run = m_new.
__device__ __forceinline__ float advance_row_max(float& m_run, float m_new, float& m_use) {
  m_use = m_new == -INFINITY ? 0.f : m_new;
  const float alpha = exp2f(m_run - m_use);
  m_run = m_new;
  return alpha;
}

// A finished softmax row's sum L = sum over its valid keys of 2^(s - m), m the running max used for
// P (at most the row max, so the largest term is >= 1): L == 0 exactly when the row has no valid key
// (the empty row of spec §2.6: out 0, lse +inf, max_logits -inf). A NaN score (a NaN in q or in a
// key the row uses; fmaxf drops it from m) makes L NaN: such a row is NOT empty, and its out, lse
// and max_logits come out NaN, as the formula gives (NaN in, NaN out).
__device__ __forceinline__ bool row_sum_empty(float L) { return L == 0.f; }
// The row max to report as max_logits: NaN for a row whose sum L is NaN (see row_sum_empty).
__device__ __forceinline__ float row_max_or_nan(float m, float L) { return isnan(L) ? L : m; }

// Programmatic dependent launch (PTX ISA `griddepcontrol`, sm_90; CUDA programming guide,
// "Programmatic Dependent Launch and Synchronization"). The decode main kernels call
// launch_dependent_grids() when they start: the combine that follows them on the stream, launched with
// cudaLaunchAttributeProgrammaticStreamSerialization (launch_programmatic_dependent, host_utils.h), may
// then be scheduled once every CTA of the main grid has started (executed it) or exited, instead of after
// the whole grid has drained, so its launch and prologue overlap the main kernel's tail. The combine
// calls wait_prerequisite_grids() before it reads the main kernel's partials: that waits until the
// prerequisite grid has completed and its memory operations are visible (a no-op for a grid launched
// without the attribute). Neither changes what is computed, only when the combine's CTAs start.
__device__ __forceinline__ void launch_dependent_grids() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void wait_prerequisite_grids() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The thread's values of its two fragment rows (mma.sync / wgmma accumulator layout: the 4 threads of
// a quad share a row) summed over the quad: a softmax row's sum l in the epilogues.
__device__ __forceinline__ void quad_sum(float (&v)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    v[hh] += __shfl_xor_sync(0xffffffffu, v[hh], 1);
    v[hh] += __shfl_xor_sync(0xffffffffu, v[hh], 2);
  }
}

}  // namespace flashmla::sm90
