// src/sm90/decode/sparse_fp8/sparse_decode.cu — host side of sm90 sparse FP8 decode (spec §2.3):
// device scheduler (unless metadata_ready) -> split-KV kernel
// (`flash_fwd_splitkv_mla_fp8_sparse_kernel`, sparse_decode_kernel.cuh) -> combine
// (`flash_fwd_mla_combine_kernel`, below, with the attention sink), all on the
// caller's stream, no synchronisation, no allocation.
//
// Partials (spec §4.4): lse_accum (S, s_q, h_q) and o_accum (S, s_q, h_q, 512)
// fp32 with S = b + num_sm_parts; lse_accum is base 2 (log2 L + m, -inf if empty),
// o_accum = O / L.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/page_division.h"
#include "core/tile_schedule_greedy.h"
#include "sm90/common/host_utils.h"
#include "sm90/sm90.h"
#include "sm90/decode/sparse_fp8/sparse_decode.h"
#include "sm90/common/combine.cuh"
#include "sm90/common/utils.cuh"

namespace flashmla::sm90 {

namespace sparse_combine {

/// One warp merges the n splits (from split index `start`) of row (bi, sq, h) over output dims
/// [512 / (4 / J) * slice, ...): lane `lane` takes float4s slice * 32 J + lane + 32 j, j < J (J = 4, slice 0:
/// the whole row). Writes out (bf16, round to nearest) and, from slice 0's lane 0, lse (natural log; +inf for
/// an empty row, whose out is 0). The attention sink scales the row by 1 / (1 + exp(sink_h - lse)).
/// P: any parameter struct with the combine's buffers (CombineBuffers' fields), attn_sink, s_q, h_q and
/// out_vec_ok. The partials must be visible to the calling thread (the combine kernel waits for the main
/// kernel first).
template <int J, class P>
__device__ __forceinline__ void sparse_combine_row(const P& p, int bi, int sq, int h, int start, int n, int slice,
                                                   int lane) {
  const int64_t split_stride = static_cast<int64_t>(p.s_q) * p.h_q;
  const int64_t base_row = (static_cast<int64_t>(start) * p.s_q + sq) * p.h_q + h;
  const int f4 = slice * 32 * J + lane;  // this lane's first float4 of the row
  const bool has_sink = p.attn_sink != nullptr;
  float4 acc[J];
  const float lse2 = combine_merge_row<J>(p.lse_accum + base_row, reinterpret_cast<const float4*>(p.o_accum) + base_row * 128, n,
                                          split_stride, f4, lane, has_sink, has_sink ? p.attn_sink[h] * kLog2e : 0.f, acc);
  if (lane == 0 && slice == 0)
    p.lse[bi * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = lse2 == INFINITY ? INFINITY : lse2 * kLn2;
  combine_store_row(static_cast<__nv_bfloat16*>(p.out) + bi * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h,
                    p.o_stride_d, p.out_vec_ok, f4, acc);
}


// Grid (b*s_q, ceil(h_q/8), 4/J): b*s_q on x (no 65535 limit), one warp per query head and
// slice of 128*J output dims (J float4 per lane; see combine_float4s_per_lane).
// Requests with a single split were written by the main kernel and are skipped
// (unless out is strided: then the main kernel writes partials for all requests).
// kCompact (the default, see launch_sparse_combine): x = num_sm_parts * s_q instead. Only a request that
// crosses a part boundary has several splits, so there are at most num_sm_parts - 1 of them, and part q
// takes the request it begins inside (begin_block_idx > 0) unless part q - 1 began inside it too; each
// split request is combined exactly once, and batches larger than num_sm_parts launch fewer CTAs.
// kCompact: the parameters plus the schedule (its own struct: a larger SparseCombineParams would change
// the default kernel's SASS).
struct CompactParams : SparseCombineParams {
  const int32_t* tile_scheduler_metadata;  // (num_sm_parts, 8)
};

template <int J, bool kCompact, class Params = SparseCombineParams>
__global__ void __launch_bounds__(256) flash_fwd_mla_combine_kernel(const Params p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bs = static_cast<int>(blockIdx.x);  // < 2^31: 32-bit division, no call
  int bi_ = bs / p.s_q;
  if constexpr (kCompact) bi_ = core::split_request_of_part(p.tile_scheduler_metadata, bi_, p.b);
  const int bi = bi_, sq = static_cast<int>(bs % p.s_q);
  if (kCompact && bi < 0) return;
  const int h = blockIdx.y * 8 + warp;
  if (h >= p.h_q) return;
  const int start = p.num_splits[bi];
  const int n = p.num_splits[bi + 1] - start;
  if (n <= 1 && p.out_vec_ok) return;  // strided out: the main kernel wrote partials for every request
  wait_prerequisite_grids();  // the main kernel's partials (launched as its programmatic dependent)
  sparse_combine_row<J>(p, bi, sq, h, start, n, static_cast<int>(blockIdx.z), lane);
}

}  // namespace sparse_combine

// The compact combine grid (see the kernel) when out is vector-writable and b > num_sm_parts, else the
// per-request grid. Why: with
// the per-request grid the combine took 3.7 / 6.2 / 11.2 us for V3.2 b64, b128 and MODEL1 config2 b256,
// batches whose schedule splits no request at all (every part ends on a request boundary): that time was
// the launch of b * s_q * h_q / 8 CTAs (8192 at b256) that read num_splits and exit, ~8 waves. The compact
// grid launches num_sm_parts * s_q * h_q / 8 (1056), one wave; batches with split requests (b74, b148)
// also launch 2-4x fewer CTAs. Measured on the H200: whole call x1.008-1.011 geomean; the sparse pytest
// and the 4748-case spec §5.2 grid pass with it.
cudaError_t launch_sparse_combine(const SparseCombineParams& cp, const int32_t* metadata, int num_sm_parts,
                                  cudaStream_t stream) {
  const bool compact = cp.out_vec_ok && metadata != nullptr && num_sm_parts > 0 && num_sm_parts < cp.b;
  const int64_t x = static_cast<int64_t>(compact ? num_sm_parts : cp.b) * cp.s_q, y = (cp.h_q + 7) / 8;
  const int j = combine_float4s_per_lane(x * y);
  const dim3 grid(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(4 / j));
  // One of the three J instantiations, with the default or the compact grid's parameters.
  auto go = [&](auto compact_tag, const auto& params) {
    constexpr bool kC = decltype(compact_tag)::value;
    using P = std::decay_t<decltype(params)>;
    auto kernel = j == 1   ? sparse_combine::flash_fwd_mla_combine_kernel<1, kC, P>
                  : j == 2 ? sparse_combine::flash_fwd_mla_combine_kernel<2, kC, P>
                           : sparse_combine::flash_fwd_mla_combine_kernel<4, kC, P>;
    return launch_programmatic_dependent(kernel, grid, dim3(256), 0, stream, params);
  };
  if (compact) {
    sparse_combine::CompactParams pc;
    static_cast<SparseCombineParams&>(pc) = cp;
    pc.tile_scheduler_metadata = metadata;
    return go(std::true_type{}, pc);
  }
  return go(std::false_type{}, cp);
}

namespace {

Status cuda_error(const char* what, cudaError_t e) { return cuda_error_status("flash_mla sparse decode", what, e); }
Status value_error(const std::string& what) { return value_error_status("flash_mla sparse decode", what); }


constexpr int64_t kAlign = 256;
int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int64_t lse_accum_bytes(int64_t splits, int64_t s_q, int64_t h_q) {
  return align_up(splits * s_q * h_q * static_cast<int64_t>(sizeof(float)));
}

/// q rows 16-byte aligned (cp.async path).
bool q_vec_ok(const TensorRef& q) { return rows_16b_aligned(q, 3); }

SparseScope make_scope(const TensorRef& cache, const TensorRef& indices, const TensorRef& topk_length) {
  SparseScope s;
  s.cache = static_cast<const uint8_t*>(cache.data);
  s.block_stride = cache.stride[0];  // 1-byte elements
  s.page_block_size = static_cast<int>(cache.shape[1]);
  s.pbs_magic = core::page_div_magic(static_cast<uint32_t>(s.page_block_size));
  s.num_tokens = static_cast<int>(cache.shape[0] * cache.shape[1]);
  s.indices = static_cast<const int32_t*>(indices.data);
  s.idx_stride_b = indices.stride[0];
  s.idx_stride_s = indices.stride[1];
  s.idx_stride_k = indices.stride[2];
  s.topk = static_cast<int>(indices.shape[2]);
  s.topk_length = topk_length.defined ? static_cast<const int32_t*>(topk_length.data) : nullptr;
  const bool base_ok = reinterpret_cast<uintptr_t>(cache.data) % 16 == 0;
  const bool stride_ok = cache.shape[0] <= 1 || cache.stride[0] % 16 == 0;
  s.vec = base_ok && stride_ok ? 1 : 0;
  return s;
}

/// Main-kernel choice by shape (q_tokens = b * s_q, the query tokens of the call). The wgmma producer
/// kernel (one producer warpgroup dequantizing into two whole-block 128B-swizzled K buffers + two
/// wgmma consumer warpgroups, 64-row head tiles with the rows past h_q masked) serves h_q > 32, and
/// smaller h_q once there are enough query tokens for its dequantization pipeline to outweigh the unused
/// rows of its head tile: 8 for 16 < h_q <= 32, 32 for h_q <= 16. Below that, the small-heads kernel
/// (warp-specialised producer, mma.sync consumers on 16-row tiles) serves h_q <= 16 and the mma.sync
/// kernel (all threads dequantize, 32-row tiles) 16 < h_q <= 32. Caches that are not 16-byte aligned
/// take the mma.sync kernel whatever this says (the other two launchers fall back to it).
/// Measured on an H200, V3.2 topk 2048, whole call, the library's kernel against our wgmma kernel on q
/// zero-padded to 64 heads (bench/results/2026-12-03-sparse-decode-tp-vs-flashmla.json, rows b 4-128,
/// s_q 1-2, h_q 1-48): small-heads 1.02-1.12x at 4-16 tokens; wgmma on h_q 1-32 1.04-1.13x from 16
/// tokens (small heads ran 0.86-0.90x at 128 tokens); mma.sync for h_q 24-32 1.04-1.07x at 4 tokens,
/// 0.99-1.00x at 8, 0.96x at 16.
SparseDecodeMainKernel sparse_decode_main_kernel(int64_t b, int64_t s_q, int64_t h_q) {
  const int64_t q_tokens = b * s_q;
  if (h_q > 32) return SparseDecodeMainKernel::kWgmmaProducer;
  if (h_q > 16) return q_tokens >= 8 ? SparseDecodeMainKernel::kWgmmaProducer : SparseDecodeMainKernel::kMmaSync;
  return q_tokens >= 32 ? SparseDecodeMainKernel::kWgmmaProducer : SparseDecodeMainKernel::kMmaSmallHeads;
}

}  // namespace

int64_t sparse_decode_workspace_bytes(const SparseDecodeParams& p, int64_t num_sm_parts) {
  const int64_t b = p.q.shape[0], s_q = p.q.shape[1], h_q = p.q.shape[2];
  const int64_t splits = b + num_sm_parts;
  return lse_accum_bytes(splits, s_q, h_q) + align_up(splits * s_q * h_q * 512 * int64_t{4});
}

Status sparse_decode_launch(const SparseDecodeParams& p, int64_t num_sm_parts, int stages) {
  const int64_t b = p.q.shape[0], s_q = p.q.shape[1], h_q = p.q.shape[2], d_qk = p.q.shape[3];
  if (num_sm_parts <= 0 || num_sm_parts > 65535) return value_error("invalid num_sm_parts");
  const int64_t head_tiles = (h_q + 63) / 64;
  if (b * s_q > 2147483647LL || s_q * head_tiles > 2147483647LL || h_q > 65535 * 8LL)
    return value_error("b * s_q or h_q is too large");
  if (p.indices.shape[2] > 2147483647LL - 64 ||
      (p.extra_k_cache.defined && p.extra_indices_in_kvcache.shape[2] > 2147483647LL - 64))
    return value_error("topk is too large");
  const int64_t need = sparse_decode_workspace_bytes(p, num_sm_parts);
  if (p.workspace_bytes < need || p.workspace == nullptr)
    return value_error("workspace of " + std::to_string(need) + " bytes required, got " +
                       std::to_string(p.workspace_bytes));

  DeviceGuard guard(p.q.device.id);
  if (guard.error() != cudaSuccess) return cuda_error("cudaSetDevice", guard.error());
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  int32_t* metadata = static_cast<int32_t*>(p.tile_scheduler_metadata.data);
  int32_t* num_splits = static_cast<int32_t*>(p.num_splits.data);
  float* lse_accum = static_cast<float*>(p.workspace);
  float* o_accum = reinterpret_cast<float*>(static_cast<char*>(p.workspace) +
                                            lse_accum_bytes(b + num_sm_parts, s_q, h_q));
  const bool vec = element_pairs_aligned(p.out, 4);
  const bool has_extra = p.extra_k_cache.defined;
  const float* sink = p.attn_sink.defined ? static_cast<const float*>(p.attn_sink.data) : nullptr;

  if ((stages & kSparseStageScheduler) && !p.metadata_ready) {
    const cudaError_t e = launch_sparse_tile_scheduler(
        p.topk_length.defined ? static_cast<const int32_t*>(p.topk_length.data) : nullptr,
        has_extra && p.extra_topk_length.defined ? static_cast<const int32_t*>(p.extra_topk_length.data) : nullptr,
        static_cast<int>(p.indices.shape[2]), has_extra ? static_cast<int>(p.extra_indices_in_kvcache.shape[2]) : 0,
        static_cast<int>(b), static_cast<int>(num_sm_parts), metadata, num_splits, stream);
    if (e != cudaSuccess) return cuda_error("sparse tile scheduler launch", e);
  }

  if (stages & kSparseStageMain) {
    SparseDecodeKernelParams kp{};
    set_decode_query(kp, p.q);
    kp.main = make_scope(p.k_cache, p.indices, p.topk_length);
    kp.has_extra = has_extra ? 1 : 0;
    if (has_extra) kp.extra = make_scope(p.extra_k_cache, p.extra_indices_in_kvcache, p.extra_topk_length);
    kp.attn_sink = sink;
    set_decode_outputs(kp, p.out, p.lse, o_accum, lse_accum, num_splits);
    kp.tile_scheduler_metadata = metadata;
    kp.b = static_cast<int>(b);
    kp.s_q = static_cast<int>(s_q);
    kp.h_q = static_cast<int>(h_q);
    // Head tiles of the mma.sync kernels (16 / 32 / 64 rows); the wgmma kernel's launcher sets its own.
    const int bm = h_q <= 16 ? 16 : (h_q <= 32 ? 32 : 64);
    kp.num_head_tiles = static_cast<int>((h_q + bm - 1) / bm);
    kp.q_vec = q_vec_ok(p.q) ? 1 : 0;
    kp.out_vec_ok = vec ? 1 : 0;
    kp.out_vec16 = vec && rows_16b_aligned(p.out, 3) ? 1 : 0;
    kp.scale_log2 = p.softmax_scale * 1.4426950408889634f;
    kp.main_kernel = sparse_decode_main_kernel(b, s_q, h_q);
    const cudaError_t e = d_qk == 576 ? launch_sparse_main_v32(kp, static_cast<int>(num_sm_parts), stream)
                                      : launch_sparse_main_model1(kp, static_cast<int>(num_sm_parts), stream);
    if (e != cudaSuccess) return cuda_error("flash_fwd_splitkv_mla_fp8_sparse_kernel launch", e);
  }

  if (stages & kSparseStageCombine) {
    SparseCombineParams cp{};
    set_decode_outputs(cp, p.out, p.lse, o_accum, lse_accum, num_splits);
    cp.attn_sink = sink;
    cp.b = static_cast<int>(b);
    cp.s_q = static_cast<int>(s_q);
    cp.h_q = static_cast<int>(h_q);
    cp.out_vec_ok = vec ? 1 : 0;
    const cudaError_t e = launch_sparse_combine(cp, metadata, static_cast<int>(num_sm_parts), stream);
    if (e != cudaSuccess) return cuda_error("flash_fwd_mla_combine_kernel (sparse) launch", e);
  }
  return Status::Ok();
}

Status sparse_decode(const SparseDecodeParams& p, int64_t num_sm_parts) {
  return sparse_decode_launch(p, num_sm_parts, kSparseStageAll);
}

}  // namespace flashmla::sm90
