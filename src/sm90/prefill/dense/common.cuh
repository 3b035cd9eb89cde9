// src/sm90/prefill/dense/common.cuh — pieces shared by the dense MHA prefill kernels (forward,
// backward): the 128B-swizzled shared-memory tile layout, its wgmma descriptors, the producer
// warpgroup's cp.async tile loader, the per-request sequence bounds and the kernel parameters.
//
// Tile layout: a tile of R rows x D dims (bf16 / fp16, D a multiple of 64) is stored as D / 64 column
// slabs of R rows x 128 bytes, 128B-swizzled (16-byte chunk c of row r at chunk position c ^ (r % 8)),
// slab after slab. As a K-major wgmma operand (rows = M or N, dims = K) a 64- or N-row window starts
// at row0 * 128 bytes into each slab; as an MN-major B operand (rows = K, dims = N) the leading byte
// offset is the slab size R * 128 (PTX ISA "Matrix Descriptor Format", "Shared Memory Matrix Layout").
#pragma once

#include <cuda.h>  // CUtensorMap (the type; maps are encoded on the host)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flashmla/ops.h"
#include "sm90/common/host_utils.h"
#include "sm90/common/seesaw.cuh"
#include "sm90/common/utils.cuh"
#include "sm90/common/wgmma.cuh"

namespace flashmla::sm90::dense_prefill {

using gmma::Wgmma;
using seesaw::setmaxnreg_dec;
using seesaw::setmaxnreg_inc;

// 384 threads: consumer warpgroups 0 and 1 (tensor cores, softmax), producer warpgroup 2 (cp.async).
// setmaxnreg moves registers within the launch pool of 384 x 168: 4 producer warps x 24 + 8 consumer
// warps x 240 = 64512 exactly. 240 keeps the d_qk 192 dkdv kernel free of spills and of wgmma
// serialisation (ptxas C7512), which it is not at 232.
constexpr int kThreads = 384;
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = (3 * 168 - kProducerRegs) / 2 / 8 * 8;
static_assert(kConsumerRegs == 240, "setmaxnreg budget");

/// Byte offset of 16-byte chunk `chunk` (8 elements) of row `row` in a tile of kRows rows.
template <int kRows>
__device__ __forceinline__ uint32_t tile_off(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

/// MN-major B operand descriptor: the kRows-row tile's rows are the K dimension, its dims the N
/// dimension; k-step kk = rows 16 kk .. 16 kk + 15.
template <int kRows>
__device__ __forceinline__ uint64_t desc_mn(uint32_t tile, int kk) {
  return gmma::make_desc_sw128(tile + kk * 16 * 128, kRows * 128, 1024);
}

/// m64n128k16 wgmmas (fp32 accumulators d[64]) whose k-step descriptors are a base descriptor plus a compile-time
/// offset (byte offset >> 4), added inside the asm: each wgmma then costs one add on the uniform datapath instead
/// of rebuilding its descriptors from addresses (add, shift, two masks each) or holding the loop-invariant ones
/// in registers. base + off is the descriptor of the base address + offset because the 14-bit address field
/// cannot carry: every shared-memory address is below 256 KiB.
///   ss<kOffA, kOffB, kScaleD>(d, desc_a, desc_b): A and B K-major from shared memory; kScaleD = 0 overwrites d.
///   rs<kOffB>(d, a, desc_b): d += A B, A from registers, B MN-major.
template <class T>
struct WgmmaOff128;
#define FLASHMLA_DENSE_WGMMA_OFF128(T, PTX_T)                                                                    \
  template <>                                                                                                    \
  struct WgmmaOff128<T> {                                                                                        \
    template <int kOffA, int kOffB, int kScaleD>                                                                 \
    __device__ __forceinline__ static void ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {                \
      asm volatile("{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %66, 0;\n"                               \
                   "add.s64 da, %64, %67;\nadd.s64 db, %65, %68;\n"                                              \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_T "." PTX_T " " FLASHMLA_WGMMA_ACC_64      \
                   ", da, db, p, 1, 1, 0, 0;\n}\n"                                                               \
                   : FLASHMLA_WGMMA_ACC_OUT_64(d)                                                                \
                   : "l"(desc_a), "l"(desc_b), "n"(kScaleD), "n"(kOffA), "n"(kOffB));                            \
    }                                                                                                            \
    template <int kOffB>                                                                                         \
    __device__ __forceinline__ static void rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {         \
      asm volatile("{\n.reg .pred p;\n.reg .b64 db;\nsetp.eq.u32 p, 1, 1;\nadd.s64 db, %68, %69;\n"              \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_T "." PTX_T " " FLASHMLA_WGMMA_ACC_64      \
                   ", {%64, %65, %66, %67}, db, p, 1, 1, 1;\n}\n"                                                \
                   : FLASHMLA_WGMMA_ACC_OUT_64(d)                                                                \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kOffB));                       \
    }                                                                                                            \
  };
FLASHMLA_DENSE_WGMMA_OFF128(__nv_bfloat16, "bf16")
FLASHMLA_DENSE_WGMMA_OFF128(__half, "f16")
#undef FLASHMLA_DENSE_WGMMA_OFF128

/// WgmmaOff128::ss for m64n176k16 (d[88]): S = Q K^T over 176-key blocks (the forward's wide key blocks).
template <class T>
struct WgmmaOff176;
#define FLASHMLA_DENSE_WGMMA_OFF176(T, PTX_T)                                                                    \
  template <>                                                                                                    \
  struct WgmmaOff176<T> {                                                                                        \
    template <int kOffA, int kOffB, int kScaleD>                                                                 \
    __device__ __forceinline__ static void ss(float (&d)[88], uint64_t desc_a, uint64_t desc_b) {                \
      asm volatile("{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %90, 0;\n"                               \
                   "add.s64 da, %88, %91;\nadd.s64 db, %89, %92;\n"                                              \
                   "wgmma.mma_async.sync.aligned.m64n176k16.f32." PTX_T "." PTX_T " " FLASHMLA_WGMMA_ACC_88      \
                   ", da, db, p, 1, 1, 0, 0;\n}\n"                                                               \
                   : FLASHMLA_WGMMA_ACC_OUT_88(d)                                                                \
                   : "l"(desc_a), "l"(desc_b), "n"(kScaleD), "n"(kOffA), "n"(kOffB));                            \
    }                                                                                                            \
  };
FLASHMLA_DENSE_WGMMA_OFF176(__nv_bfloat16, "bf16")
FLASHMLA_DENSE_WGMMA_OFF176(__half, "f16")
#undef FLASHMLA_DENSE_WGMMA_OFF176

/// acc = A B^T over kDim / 16 k-steps of m64n128k16 (WgmmaOff128, both operands K-major), A = the 64 rows of the
/// kRowsA-row tile whose first row's descriptor is desc_a (gmma::make_desc_sw128(row address, 16, 1024)), B = the
/// first 128 rows of the kRowsB-row tile with descriptor desc_b. k-step kK's operands start kK >> 2 64-dim slabs
/// (kRows x 128 bytes each) and (kK & 3) x 32 bytes into their first row; the first k-step overwrites acc.
template <class T, int kDim, int kRowsA, int kRowsB, int kK = 0>
__device__ __forceinline__ void issue_abt_off128(float (&acc)[64], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (kK < kDim / 16) {
    constexpr int kOffA = ((kK >> 2) * (kRowsA * 128) + (kK & 3) * 32) >> 4;
    constexpr int kOffB = ((kK >> 2) * (kRowsB * 128) + (kK & 3) * 32) >> 4;
    WgmmaOff128<T>::template ss<kOffA, kOffB, (kK > 0 ? 1 : 0)>(acc, desc_a, desc_b);
    issue_abt_off128<T, kDim, kRowsA, kRowsB, kK + 1>(acc, desc_a, desc_b);
  }
}
/// issue_abt_off128 with B's first kN rows, kN = 128 (WgmmaOff128) or 176 (WgmmaOff176; acc[88]).
template <class T, int kDim, int kRowsA, int kRowsB, int kN, int kK = 0>
__device__ __forceinline__ void issue_abt_off(float (&acc)[kN / 2], uint64_t desc_a, uint64_t desc_b) {
  static_assert(kN == 128 || kN == 176, "S GEMM width");
  if constexpr (kN == 128) {
    issue_abt_off128<T, kDim, kRowsA, kRowsB>(acc, desc_a, desc_b);
  } else if constexpr (kK < kDim / 16) {
    constexpr int kOffA = ((kK >> 2) * (kRowsA * 128) + (kK & 3) * 32) >> 4;
    constexpr int kOffB = ((kK >> 2) * (kRowsB * 128) + (kK & 3) * 32) >> 4;
    WgmmaOff176<T>::template ss<kOffA, kOffB, (kK > 0 ? 1 : 0)>(acc, desc_a, desc_b);
    issue_abt_off<T, kDim, kRowsA, kRowsB, kN, kK + 1>(acc, desc_a, desc_b);
  }
}

/// Ends the basic block after x and y are computed, so that a `wgmma.wait_group` that follows stays after the
/// code computing them. ptxas schedules such a wait near the top of its basic block, ahead of independent
/// arithmetic that precedes it in the source, but does not move it into an earlier block. In the forward's
/// overlapped step the softmax of key block n then waited for the P V of block n - 1 before its exp2 stage,
/// the overlap the schedule is built for (docs/dense-prefill.md, "Forward: softmax overlapping its own P V").
/// The branch tests the bits of x and y through an asm the front end cannot fold; its body, a zero-length
/// nanosleep, has no effect, so it does not matter whether it is ever taken (both all ones: a negative NaN,
/// which the forward's row sums are not). Costs a LOP3, an ISETP and a branch that is not taken.
__device__ __forceinline__ void end_block_after(float x, float y) {
  uint32_t bx, by;
  asm("mov.b32 %0, %1;" : "=r"(bx) : "f"(x));
  asm("mov.b32 %0, %1;" : "=r"(by) : "f"(y));
  if ((bx & by) == 0xFFFFFFFFu) asm volatile("nanosleep.u32 0;");
}

/// Thread 0 initialises the kernel's mbarriers, then the CTA syncs. They lie 8 bytes apart from `bar`:
/// kGroups pairs of per-stage barriers (group g's stage-s barrier at bar + 16 g + 8 s, counts[g] arrivals;
/// e.g. full and empty of a streamed tile), then the barrier of the tiles loaded once (once_count producer
/// arrivals: 128 cp.async threads, or 1 TMA thread). Stage 0's barriers are initialised before stage 1's.
template <int kGroups>
__device__ __forceinline__ void init_barriers(int tid, uint32_t bar, const int (&counts)[kGroups], int once_count = 128) {
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) mbar_init(bar + 16 * g + 8 * s, counts[g]);
    }
    mbar_init(bar + 16 * kGroups, once_count);
    fence_barrier_init();
  }
  __syncthreads();
}

/// Producer warpgroup (pt = 0..127): cp.async of kRows x kDim elements, row r from src + r * row_stride,
/// into the tile at `dst`; rows >= valid_rows are zero-filled without reading (padding past a request's
/// end never carries another request's data, NaN included).
template <class T, int kRows, int kDim>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* src, int64_t row_stride, int valid_rows, int pt) {
  constexpr int kChunks = kDim / 8;
  static_assert((kChunks & (kChunks - 1)) == 0 || kChunks == 24, "chunks per row");
#pragma unroll 1
  for (int idx = pt; idx < kRows * kChunks; idx += 128) {
    const int row = idx / kChunks, ch = idx % kChunks;
    const bool ok = row < valid_rows;
    const T* s = ok ? src + row * row_stride + ch * 8 : src;
    cp_async_16(dst + tile_off<kRows>(row, ch), s, ok);
  }
}

/// Threads st = 0 .. nt - 1: rows [r0, kRows) of a kRows x kDim tile (generic pointer to shared memory) set to zero.
/// The TMA loaders' tiles past a request's end hold the next request's rows; the consumers zero them where the
/// cp.async loaders would have zero-filled, so that a NaN or inf there cannot reach this request through 0 * NaN.
template <int kRows, int kDim>
__device__ __forceinline__ void zero_tile_rows(uint8_t* tile, int r0, int st, int nt) {
  for (int idx = st; idx < (kRows - r0) * (kDim / 8); idx += nt)
    *reinterpret_cast<uint4*>(tile + tile_off<kRows>(r0 + idx / (kDim / 8), idx % (kDim / 8))) = make_uint4(0u, 0u, 0u, 0u);
}

/// Host: the (d, h, rows) tensor map of a (rows, heads, d) q / k / v / dout tensor with boxes of 64 dims x 1 head x
/// box_rows rows and 128B swizzle, i.e. one 64-dim slab of the tile layout above per load; rows past the tensor's end
/// come as zeros. False when the driver entry point is missing or the layout does not allow a map (the caller then
/// takes its cp.async producer).
inline bool make_tile_map(const TensorRef& t, int box_rows, CUtensorMap* map) {
  EncodeTiledFn fn = encode_tiled_fn();
  if (fn == nullptr || t.shape[0] <= 0 || t.shape[0] > 0xFFFFFFFFLL) return false;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0 || t.stride[2] != 1) return false;
  for (int i = 0; i < 2; ++i)
    if (t.stride[i] <= 0 || (t.stride[i] * 2) % 16 != 0 || t.stride[i] * 2 >= (int64_t{1} << 40)) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(t.shape[2]), static_cast<cuuint64_t>(t.shape[1]),
                              static_cast<cuuint64_t>(t.shape[0])};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(t.stride[1] * 2), static_cast<cuuint64_t>(t.stride[0] * 2)};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estr[3] = {1, 1, 1};
  std::memset(map, 0, sizeof(*map));
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(t.data), dims, strides, box, estr,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/// 3-D tiled TMA load global -> shared (box of the map at coordinates c0, c1, c2), completing on the
/// mbarrier `bar` with complete_tx bytes.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

/// TMA loads of one tile of kRows rows x kDim dims (the tile layout above: kDim / 64 slabs of kRows x 128 bytes) from a
/// (d, h, rows) map (make_tile_map with box_rows = kRows): rows [row, row + kRows) of head `head`, onto `bar` (the
/// caller's expect_tx counts the tile's bytes).
template <int kRows, int kDim>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int head, int row) {
#pragma unroll
  for (int c = 0; c < kDim / 64; ++c) tma_load_3d(dst + c * (kRows * 128), map, bar, c * 64, head, row);
}

/// 1-D bulk copy global -> shared of `bytes` (a multiple of 16; both addresses 16-byte aligned), completing on the
/// mbarrier `bar` with complete_tx bytes.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

/// Packs 16 accumulator columns (k-step kk of a 64-row x N accumulator, N / 16 k-steps) into the
/// m16n8k16 A fragment that the RS wgmma takes: the accumulator layout of columns 16 kk .. 16 kk + 15
/// is that fragment's layout.
template <class T, int N>
__device__ __forceinline__ void pack_a(const float (&s)[N / 2], uint32_t (&a)[N / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[kk][j] = HalfTraits<T>::pack(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
  }
}

/// The two floats of a packed bf16 / fp16 pair (HalfTraits<T>::pack's inverse, exact).
template <class T>
__device__ __forceinline__ void unpack2(uint32_t v, float& lo, float& hi) {
  if constexpr (sizeof(T) == 2 && std::is_same_v<T, __nv_bfloat16>) {
    lo = __uint_as_float(v << 16);
    hi = __uint_as_float(v & 0xFFFF0000u);
  } else {
    const __half2 h = *reinterpret_cast<const __half2*>(&v);
    const float2 f = __half22float2(h);
    lo = f.x;
    hi = f.y;
  }
}

// ---- Keys that some rows of a tile do not see, holding inf or NaN (docs/dense-prefill.md, "Masking, empty rows,
// NaN"). Masking sets P of such a (row, key) to 0, but the tile's MMA still multiplies that 0 by the key's row of
// the B operand, and 0 * inf = 0 * NaN = NaN. The forward's producer replaces those elements by 0 in the shared
// tile (for the tiles that can hold such keys: the causal diagonal ones) and marks the rows; the consumers then
// add, after the tile's MMA, the products of the rows that do see the key with its values read from global memory.

/// The exponent bits of a bf16 / fp16 element: all ones for inf and NaN.
template <class T>
constexpr uint32_t kNonfiniteExp = std::is_same_v<T, __nv_bfloat16> ? 0x7F80u : 0x7C00u;

/// The pair w with its inf / NaN bf16 / fp16 elements (exponent all ones) replaced by +0.
template <class T>
__device__ __forceinline__ uint32_t pair_zero_nonfinite(uint32_t w) {
  constexpr uint32_t e = kNonfiniteExp<T>;
  uint32_t keep = 0xFFFFFFFFu;
  if ((w & e) == e) keep &= 0xFFFF0000u;
  if (((w >> 16) & e) == e) keep &= 0x0000FFFFu;
  return w & keep;
}
__device__ __forceinline__ bool float_is_nonfinite(float x) {
  return (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u;
}

/// Threads st = 0 .. nt - 1: whether rows [lo, hi) of a row-major global array (row r at rows + r * row_stride
/// elements, kDim contiguous elements each, 16-byte aligned) hold an inf / NaN element in this thread's share of the
/// 16-byte chunks (the caller reduces over its threads). Two chunks a thread in flight at a time.
template <class T, int kDim>
__device__ __forceinline__ bool any_nonfinite_rows_global(const T* rows, int64_t row_stride, int lo, int hi, int st,
                                                          int nt) {
  constexpr int kChunks = kDim / 8;
  constexpr uint32_t e2 = kNonfiniteExp<T> | (kNonfiniteExp<T> << 16);
  auto chunk = [&](int idx) {
    return __ldg(reinterpret_cast<const uint4*>(rows + (lo + idx / kChunks) * row_stride + (idx % kChunks) * 8));
  };
  auto bad = [&](uint32_t w) { return __vcmpeq2(w & e2, e2); };  // 0xFFFF in each half whose exponent is all ones
  uint32_t any = 0;
  const int n = (hi - lo) * kChunks;
#pragma unroll 1
  for (int idx = st; idx < n; idx += 2 * nt) {
    const uint4 x = chunk(idx);
    const uint4 y = idx + nt < n ? chunk(idx + nt) : make_uint4(0u, 0u, 0u, 0u);
    any |= bad(x.x) | bad(x.y) | bad(x.z) | bad(x.w) | bad(y.x) | bad(y.y) | bad(y.z) | bad(y.w);
  }
  return any != 0;
}

/// Threads st = 0 .. nt - 1: in rows [lo, hi) of a kRows x kDim tile (generic pointer to shared memory), replaces
/// every inf / NaN element by 0 and sets bit r of mask (4 words, shared memory) for each row r that held one.
template <class T, int kRows, int kDim>
__device__ __forceinline__ void zero_nonfinite_rows(uint8_t* tile, int lo, int hi, uint32_t* mask, int st, int nt) {
  constexpr int kChunks = kDim / 8;
#pragma unroll 1
  for (int idx = st; idx < (hi - lo) * kChunks; idx += nt) {
    const int r = lo + idx / kChunks, ch = idx % kChunks;
    uint4* ptr = reinterpret_cast<uint4*>(tile + tile_off<kRows>(r, ch));
    const uint4 x = *ptr;
    const uint4 y = make_uint4(pair_zero_nonfinite<T>(x.x), pair_zero_nonfinite<T>(x.y), pair_zero_nonfinite<T>(x.z),
                               pair_zero_nonfinite<T>(x.w));
    if (y.x != x.x || y.y != x.y || y.z != x.z || y.w != x.w) {
      *ptr = y;
      atomicOr(mask + (r >> 5), 1u << (r & 31));
    }
  }
}

/// Generic pointer of a shared::cta address.
__device__ __forceinline__ uint8_t* smem_ptr(uint32_t addr) {
  return static_cast<uint8_t*>(__cvta_shared_to_generic(addr));
}
/// bar.red.or over the num_threads threads of named barrier id: true where pred is true in any of them.
__device__ __forceinline__ bool bar_red_or(int id, int num_threads, bool pred) {
  uint32_t r;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, %3, p;\nselp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(num_threads)
      : "memory");
  return r != 0;
}
/// Bits [lo, hi) of a 128-bit row mask (0 <= lo <= hi <= 128).
__device__ __forceinline__ uint4 row_bits(int lo, int hi) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int a = min(max(lo - 32 * i, 0), 32), b = min(max(hi - 32 * i, 0), 32);
    const uint32_t below_b = b >= 32 ? 0xFFFFFFFFu : (1u << b) - 1u;
    const uint32_t below_a = a >= 32 ? 0xFFFFFFFFu : (1u << a) - 1u;
    w[i] = below_b & ~below_a;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
/// The 16-row k-steps of a tile that hold a row in [lo, hi) (lo < hi).
__device__ __forceinline__ uint32_t ksteps_in(int lo, int hi) {
  const uint32_t upto = (hi + 15) / 16, from = lo / 16;
  return ((upto >= 32 ? 0xFFFFFFFFu : (1u << upto) - 1u)) & ~((1u << from) - 1u);
}

/// One warpgroup (t = 0..127): acc += A B, B the kRows x kN MN-major tile at `tile` (rows = the K dimension),
/// A the register fragments a (k-step kk = rows 16 kk .. 16 kk + 15 of B), one k-step at a time in order. The
/// k-steps in `ksteps` read a copy of their 16 rows in `scratch` (16 x kN, this warpgroup's own) with inf /
/// NaN replaced by 0. The accumulation order is the batched issue's, so acc gets the bits it would get from
/// B with 0 in those places. Uses named barrier bar_id (this warpgroup's 128 threads). Returns with the
/// wgmma complete. Rare path (the backward's checked tiles holding inf / NaN).
template <class T, int kRows, int kN, int kKSteps>
__device__ __forceinline__ void mma_b_finite(float (&acc)[kN / 2], const uint32_t (&a)[kKSteps][4], uint32_t tile,
                                             uint32_t scratch, uint32_t ksteps, int bar_id, int t) {
  constexpr int kChunks = kN / 8;
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    uint64_t desc = desc_mn<kRows>(tile, kk);
    if ((ksteps >> kk) & 1u) {
      named_barrier_sync(bar_id, 128);  // the warpgroup's previous wgmma on the scratch has completed
      const uint8_t* src = smem_ptr(tile);
      uint8_t* dst = smem_ptr(scratch);
#pragma unroll 1
      for (int idx = t; idx < 16 * kChunks; idx += 128) {
        const int r = idx / kChunks, ch = idx % kChunks;
        uint4 x = *reinterpret_cast<const uint4*>(src + tile_off<kRows>(16 * kk + r, ch));
        x.x = pair_zero_nonfinite<T>(x.x);
        x.y = pair_zero_nonfinite<T>(x.y);
        x.z = pair_zero_nonfinite<T>(x.z);
        x.w = pair_zero_nonfinite<T>(x.w);
        *reinterpret_cast<uint4*>(dst + tile_off<16>(r, ch)) = x;  // same swizzle phase: 16 kk % 8 == 0
      }
      gmma::fence_proxy_async();
      named_barrier_sync(bar_id, 128);
      desc = desc_mn<16>(scratch, 0);
    }
    gmma::reg_fence(acc);
    gmma::fence();
    Wgmma<T, kN>::template rs<1>(acc, a[kk], desc);
    gmma::commit_wait(acc);
  }
}

/// acc += a_c b for the inf / NaN elements b of row c = 16 kk + t of B (k-step kk, row t in it; the caller gives all
/// three), for this thread's accumulator rows e = 0, 1 with visible(c, e). a is the A fragment the MMA used
/// (kKSteps k-steps of 16 rows of B; lane l holds columns 2 (l % 4) + {0, 1, 8, 9} of a k-step for rows l / 4 and
/// l / 4 + 8 of its warp); acc[4 i + 2 e + h] is row e, column 8 i + 2 (lane % 4) + h. row_of(c) gives row c of
/// B as a function of i: the two elements at columns 8 i + 2 (lane % 4) + {0, 1} (32 bits). Called by whole
/// warps with the same c.
template <class T, int kN, int kKSteps, class RowOf, class Visible>
__device__ __forceinline__ void add_row_nonfinite_products(float (&acc)[kN / 2], const uint32_t (&a)[kKSteps][4], int c,
                                                           int kk, int t, RowOf row_of, Visible visible, int lane) {
  const bool upper = t >= 8;
  uint32_t w0 = 0, w1 = 0;
#pragma unroll
  for (int k2 = 0; k2 < kKSteps; ++k2) {
    if (k2 == kk) {
      w0 = upper ? a[k2][2] : a[k2][0];
      w1 = upper ? a[k2][3] : a[k2][1];
    }
  }
  const int src = (lane & ~3) | ((t & 7) >> 1);
  w0 = __shfl_sync(0xFFFFFFFFu, w0, src);
  w1 = __shfl_sync(0xFFFFFFFFu, w1, src);
  float lo0, hi0, lo1, hi1;
  unpack2<T>(w0, lo0, hi0);
  unpack2<T>(w1, lo1, hi1);
  const float p0 = (t & 1) ? hi0 : lo0, p1 = (t & 1) ? hi1 : lo1;
  const bool vis0 = visible(c, 0), vis1 = visible(c, 1);
  const auto bpair = row_of(c);
#pragma unroll
  for (int i = 0; i < kN / 8; ++i) {
    float b0, b1;
    unpack2<T>(bpair(i), b0, b1);
    if (float_is_nonfinite(b0)) {
      if (vis0) acc[4 * i] += p0 * b0;
      if (vis1) acc[4 * i + 2] += p1 * b0;
    }
    if (float_is_nonfinite(b1)) {
      if (vis0) acc[4 * i + 1] += p0 * b1;
      if (vis1) acc[4 * i + 3] += p1 * b1;
    }
  }
}

/// After acc += A B with the rows of B in `rows` (bits of 4 words: rows kRow0 .. kRow0 + 127 of B, a tile of kN
/// columns whose inf / NaN elements in those rows were read as 0): acc += a b for those inf / NaN elements b, taken
/// from global memory (row c of B at brow(c)), for this thread's accumulator rows e = 0, 1 with visible(c, e); a and
/// acc as in add_row_nonfinite_products. Called by whole warps with the same `rows`. Rare path: loops at run time.
template <class T, int kN, int kKSteps, int kRow0 = 0, class RowPtr, class Visible>
__device__ __forceinline__ void add_nonfinite_products(float (&acc)[kN / 2], const uint32_t (&a)[kKSteps][4],
                                                       uint4 rows, RowPtr brow, Visible visible, int lane) {
  const int tq = lane & 3;
  auto row_of = [&](int c) {
    const T* b = brow(c);
    return [b, tq](int i) { return *reinterpret_cast<const uint32_t*>(b + 8 * i + 2 * tq); };
  };
#pragma unroll 1
  for (int i4 = 0; i4 < 4; ++i4) {
    const uint32_t word = i4 == 0 ? rows.x : i4 == 1 ? rows.y : i4 == 2 ? rows.z : rows.w;  // no local array
#pragma unroll 1
    for (uint32_t bits = word; bits != 0; bits &= bits - 1) {
      const int c = kRow0 + 32 * i4 + __ffs(bits) - 1;
      add_row_nonfinite_products<T, kN, kKSteps>(acc, a, c, c >> 4, c & 15, row_of, visible, lane);
    }
  }
}

/// After mma_b_finite: acc += a b for the inf / NaN elements b of the k-steps in `ksteps` (read from the shared
/// tile, which still holds them, generic pointer) and this thread's accumulator rows e = 0, 1 for which
/// visible(c, e) (tile row c of B is visible to that row, i.e. not masked); a and acc as in
/// add_row_nonfinite_products. Rare path: loops at run time.
template <class T, int kRows, int kN, int kKSteps, class Visible>
__device__ __forceinline__ void add_nonfinite_products_smem(float (&acc)[kN / 2], const uint32_t (&a)[kKSteps][4],
                                                            const uint8_t* tile, uint32_t ksteps, Visible visible,
                                                            int lane) {
  const int tq = lane & 3;
  auto row_of = [&](int c) {
    return [&, c](int i) { return *reinterpret_cast<const uint32_t*>(tile + tile_off<kRows>(c, i) + 4 * tq); };
  };
#pragma unroll 1
  for (; ksteps != 0; ksteps &= ksteps - 1) {
    const int kk = __ffs(ksteps) - 1;
#pragma unroll 1
    for (int t = 0; t < 16; ++t)
      add_row_nonfinite_products<T, kN, kKSteps>(acc, a, 16 * kk + t, kk, t, row_of, visible, lane);
  }
}

/// One request's bounds: rows [q0, q0 + s_q) of q / out, [k0, k0 + s_k) of k / v.
struct SeqBounds {
  int q0, s_q, k0, s_k;
};
__device__ __forceinline__ SeqBounds seq_bounds(const int32_t* cu_q, const int32_t* cu_k, int64_t cu_q_stride,
                                                int64_t cu_k_stride, int b) {
  SeqBounds r;
  r.q0 = cu_q[b * cu_q_stride];
  r.s_q = cu_q[(b + 1) * cu_q_stride] - r.q0;
  r.k0 = cu_k[b * cu_k_stride];
  r.s_k = cu_k[(b + 1) * cu_k_stride] - r.k0;
  return r;
}

/// Kernel parameters (element strides). Forward: q, k, v -> out, lse. Backward: also dout, dq, dk, dv
/// and the workspace (per (request, head) rows of lse * log2(e) and D = rowsum(dout * out), padded to
/// ws_rows = a multiple of 64).
struct KernelParams {
  const void* q;
  const void* k;
  const void* v;
  const void* out_in;  // backward: the forward's out
  void* out;           // forward: out
  float* lse;          // forward: written; backward: read
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  float* ws_lse2;  // backward workspace: (b, h_q, ws_rows) lse * log2(e), +inf for rows without keys / padding
  float* ws_dsum;  // backward workspace: (b, h_q, ws_rows) D = rowsum(dout * out), 0 for padding
  const int32_t* cu_q;
  const int32_t* cu_k;
  int64_t cu_q_stride, cu_k_stride;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  int64_t o_row, o_head;      // out (forward) / out_in (backward)
  int64_t lse_row, lse_head;  // lse
  int64_t do_row, do_head, dq_row, dq_head, dk_row, dk_head, dv_row, dv_head;
  int h_q, group;  // group = h_q / h_kv
  int ws_rows;
  int causal;
  float scale;       // softmax_scale
  float scale_log2;  // softmax_scale * log2(e)
};

/// First row of the query block this CTA computes: block blockIdx.x, or counted from the end when causal
/// (the last query blocks see the most keys, so they start first).
template <int kBM>
__device__ __forceinline__ int query_block_row0(const KernelParams& p) {
  const int mblk = p.causal ? static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x) : blockIdx.x;
  return mblk * kBM;
}
/// End (exclusive) of the keys that the query block of kBM rows from m0 sees: all s_k keys, or when causal
/// those up to its last row's (key j is visible to query i iff j <= i + off, off = s_k - s_q).
template <int kBM>
__device__ __forceinline__ int visible_key_end(const KernelParams& p, int s_k, int m0, int off) {
  const int n_end = p.causal ? min(s_k, m0 + kBM + off) : s_k;
  return max(n_end, 0);
}

/// The fields of KernelParams the forward and the backward take alike from the forward's arguments p:
/// q, k, v, lse, cu_seqlens_qo / _k and their strides (out's strides into o_row / o_head; where out goes,
/// out or out_in, is the caller's), h_q, group, causal, scale and scale_log2. Host code.
inline KernelParams attention_kernel_params(const DensePrefillParams& p) {
  KernelParams kp{};
  kp.q = p.q.data;
  kp.k = p.k.data;
  kp.v = p.v.data;
  kp.lse = static_cast<float*>(p.lse.data);
  kp.cu_q = static_cast<const int32_t*>(p.cu_seqlens_qo.data);
  kp.cu_k = static_cast<const int32_t*>(p.cu_seqlens_kv.data);
  kp.cu_q_stride = p.cu_seqlens_qo.stride[0];
  kp.cu_k_stride = p.cu_seqlens_kv.stride[0];
  kp.q_row = p.q.stride[0];
  kp.q_head = p.q.stride[1];
  kp.k_row = p.k.stride[0];
  kp.k_head = p.k.stride[1];
  kp.v_row = p.v.stride[0];
  kp.v_head = p.v.stride[1];
  kp.o_row = p.out.stride[0];
  kp.o_head = p.out.stride[1];
  kp.lse_row = p.lse.stride[0];
  kp.lse_head = p.lse.stride[1];
  kp.h_q = static_cast<int>(p.q.shape[1]);
  kp.group = static_cast<int>(p.q.shape[1] / p.k.shape[1]);
  kp.causal = p.causal ? 1 : 0;
  kp.scale = p.softmax_scale;
  kp.scale_log2 = p.softmax_scale * kLog2e;
  return kp;
}

}  // namespace flashmla::sm90::dense_prefill
