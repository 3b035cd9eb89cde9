// src/sm90/decode/sparse_fp8/mma_small_heads_kernel.cuh — sparse FP8 MLA decode for h_q <= 16 (one
// 16-row head tile): warp-specialised, a producer warpgroup gathers and dequantizes while two
// consumer warpgroups run the mma.sync core of mma_sync_kernel.cuh.
//
// 384 threads. Warps 0-7 (consumers, 256 threads) compute as the mma.sync kernel: R = 1 row group of
// 16 heads x 8 column warps, S = Q K^T with mma.sync m16n8k16, base-2 online softmax with the row
// max exchanged through smem, P (bf16) via smem, O += P V. Warps 8-11 (the producer warpgroup, 128
// threads, 2 per token slot) load each block's FP8 records straight from global memory into
// registers (ld.global.nc, 16 bytes), the loads of block i+1 being issued before waiting for its
// buffer, then dequantize them exactly (spec §2.7: fp8 -> f16 -> f32 -> bf16, x scale in bf16) into
// one of two bf16 K buffers. Full / empty mbarriers per buffer (producer: 128 arrivals; the
// consumers: 256) replace the mma.sync kernel's two CTA-wide barriers per block, so the dequant and
// gather of the next block run under the MMAs of the current one. 16-row tiles fit the launch's
// 168 registers per thread in both roles, so there is no setmaxnreg split. Slot validity, the joint
// main/extra block order and the outputs are the mma.sync kernel's.
// Only for 16-byte aligned caches (the mma.sync kernel keeps the byte-copy path).
#pragma once

#include "core/page_division.h"
#include "sm90/decode/sparse_fp8/mma_sync_kernel.cuh"
#include "sm90/common/host_utils.h"
#include "sm90/common/decode_schedule.cuh"

namespace flashmla::sm90::sparse {

namespace small_heads {

constexpr int kThreads = 384;
constexpr int kConsumers = 256;
constexpr int kBarConsumers = 5;  // named barrier of the 256 consumer threads (1..4: row groups)

template <int R>
struct Cfg2 {
  using Base = Cfg<R, 1>;
  static constexpr int kSmemQ = Base::kSmemQ;
  static constexpr int kSmemK = Base::kSmemK;  // per buffer
  static constexpr int kSmemP = Base::kSmemP;
  static constexpr int kSmemRed = Base::kSmemRed;
  static constexpr int kOffK = kSmemQ;
  static constexpr int kOffP = kOffK + 2 * kSmemK;
  static constexpr int kOffRed = kOffP + kSmemP;
  static constexpr int kOffValid = kOffRed + kSmemRed;   // 2 x 64 flags
  static constexpr int kOffBar = kOffValid + 2 * kBlockN;  // full[2], empty[2]
  static constexpr int kSmemBytes = kOffBar + 32;
  static_assert(kOffBar % 8 == 0, "mbarrier alignment");
  static_assert(kSmemBytes <= 232448, "shared memory");
};

}  // namespace small_heads

template <Fmt F, int R>
__global__ void __launch_bounds__(small_heads::kThreads, 1) flash_fwd_splitkv_mla_fp8_sparse_kernel_small_heads(const SparseDecodeKernelParams p) {
  launch_dependent_grids();  // the combine after this kernel may be scheduled now (utils.cuh)
  using FC = FmtCfg<F>;
  using CF = Cfg<R, 1>;
  using C2 = small_heads::Cfg2<R>;
  constexpr int BM = CF::BM, C = CF::C, KW = CF::KW, NT_S = CF::NT_S, VW = CF::VW, NT_O = CF::NT_O;
  constexpr int D_QK = FC::kDQK, N_CHUNKS = FC::kChunks, K_STEPS = FC::kKSteps, NOPE_UNITS = FC::kNopeChunks;
  constexpr int NOPE_RAW16 = FC::kNope / 16;  // 16-byte FP8 chunks of the NoPE part (32 / 28)
  constexpr int PER_THR = NOPE_RAW16 / 2;     // per producer thread (2 per token)
  static_assert(NOPE_RAW16 % 2 == 0 && (N_CHUNKS - NOPE_UNITS) == 8, "producer work split");

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sQ = smem;
  uint8_t* sK = smem + C2::kOffK;
  uint8_t* sP = smem + C2::kOffP;
  float* sRed = reinterpret_cast<float*>(smem + C2::kOffRed);
  uint8_t* sValid = smem + C2::kOffValid;
  const uint32_t sQ_u = smem_u32(sQ), sK_u = smem_u32(sK), sP_u = smem_u32(sP);
  const uint32_t bar_full = smem_u32(smem + C2::kOffBar), bar_empty = bar_full + 16;  // + 8 * buffer

  const int ht = blockIdx.x % p.num_head_tiles;
  const int sq = blockIdx.x / p.num_head_tiles;
  const int part = blockIdx.y;
  const int tid = threadIdx.x;

  const int32_t* meta = p.tile_scheduler_metadata + part * 8;
  const int begin_req = meta[0], end_req = meta[1], begin_blk = meta[2], end_blk = meta[3];
  const int begin_split = meta[4], first_splitted = meta[5], last_splitted = meta[6];
  if (begin_req >= p.b) return;

  if (tid == 0) {
    mbar_init(bar_full, 128);
    mbar_init(bar_full + 8, 128);
    mbar_init(bar_empty, small_heads::kConsumers);
    mbar_init(bar_empty + 8, small_heads::kConsumers);
    fence_barrier_init();
  }
  __syncthreads();

  // Per-request quantities shared by both roles.
  struct ReqInfo {
    int n_main, n_total, blk_lo, blk_hi, n_blk, lim_main, lim_extra;
  };
  auto req_info = [&](int req) {
    ReqInfo r;
    request_blocks(p, req, r.n_main, r.n_total);
    r.blk_lo = req == begin_req ? begin_blk : 0;
    r.blk_hi = min(req == end_req ? end_blk : r.n_total, r.n_total);
    r.n_blk = max(r.blk_hi - r.blk_lo, 0);
    request_slot_limits(p, req, r.lim_main, r.lim_extra);
    return r;
  };

  if (tid >= small_heads::kConsumers) {
    // ======================= producer warpgroup =======================
    const int ptid = tid - small_heads::kConsumers;
    const int tok = ptid >> 1, hf = ptid & 1;
    int kc = 0;  // blocks produced so far (buffer kc & 1, phase (kc >> 1) & 1)
    for (int req = begin_req; req <= end_req; ++req) {
      const ReqInfo ri = req_info(req);
      auto fetch_idx = [&](int blk) -> int {
        const bool is_extra = p.has_extra && blk >= ri.n_main;
        const int64_t slot = static_cast<int64_t>(is_extra ? blk - ri.n_main : blk) * kBlockN + tok;
        const int lim = is_extra ? ri.lim_extra : ri.lim_main;
        if (slot >= lim) return -1;
        const int32_t* ind = is_extra ? p.extra.indices : p.main.indices;
        const int64_t isb = is_extra ? p.extra.idx_stride_b : p.main.idx_stride_b;
        const int64_t iss = is_extra ? p.extra.idx_stride_s : p.main.idx_stride_s;
        const int64_t isk = is_extra ? p.extra.idx_stride_k : p.main.idx_stride_k;
        return __ldg(ind + (req * isb + sq * iss + slot * isk));
      };
      int idx_next = ri.n_blk > 0 ? fetch_idx(ri.blk_lo) : -1;
      for (int i = 0; i < ri.n_blk; ++i, ++kc) {
        const int blk = ri.blk_lo + i;
        const int idx = idx_next;
        if (i + 1 < ri.n_blk) idx_next = fetch_idx(blk + 1);
        const bool is_extra = p.has_extra && blk >= ri.n_main;
        const int num_tokens = is_extra ? p.extra.num_tokens : p.main.num_tokens;
        const uint8_t* cache = is_extra ? p.extra.cache : p.main.cache;
        const int64_t bstride = is_extra ? p.extra.block_stride : p.main.block_stride;
        const int pbs = is_extra ? p.extra.page_block_size : p.main.page_block_size;
        const uint32_t pbs_magic = is_extra ? p.extra.pbs_magic : p.main.pbs_magic;
        const bool valid = idx >= 0 && idx < num_tokens;
        const uint32_t u_idx = valid ? static_cast<uint32_t>(idx) : 0u;
        uint32_t blk_id;
        int32_t row;
        core::split_page_token(u_idx, static_cast<uint32_t>(pbs), pbs_magic, blk_id, row);  // no integer divider
        const uint8_t* block_base = cache + static_cast<int64_t>(blk_id) * bstride;
        const uint8_t* rec = block_base + static_cast<int64_t>(row) * (F == Fmt::kV32 ? 656 : 576);

        // Loads first (they fly while we wait for the buffer).
        uint4 raw[PER_THR];
        uint4 rope[4];
        uint4 scl = make_uint4(0u, 0u, 0u, 0u);  // V32: 4 floats; MODEL1: 8 e8m0 bytes in x, y
#pragma unroll
        for (int k = 0; k < PER_THR; ++k) raw[k] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int k = 0; k < 4; ++k) rope[k] = make_uint4(0u, 0u, 0u, 0u);
        if (valid) {
          // Record lines kept in L1 and 256-byte L2 fetches, as the wgmma producer kernel's gathers.
          if constexpr (F == Fmt::kV32) {
            scl = ldg16_evict_last_l2_256(rec + FC::kScaleRaw);
          } else {
            const uint2 s8 = ldg8_evict_last(block_base + static_cast<int64_t>(pbs) * 576 + row * 8);
            scl.x = s8.x;
            scl.y = s8.y;
          }
#pragma unroll
          for (int k = 0; k < PER_THR; ++k) raw[k] = ldg16_evict_last_l2_256(rec + (2 * k + hf) * 16);
#pragma unroll
          for (int k = 0; k < 4; ++k) rope[k] = ldg16_evict_last_l2_256(rec + FC::kRopeRaw + (2 * k + hf) * 16);
        }

        const int buf = kc & 1;
        mbar_wait(bar_empty + 8 * buf, ((kc >> 1) & 1) ^ 1);
        // Swizzled destinations (swz): unit u = 4k + 2hf + e has (u ^ x) = 8 (k >> 1) + ((4 (k & 1) + 2hf + e) ^ x),
        // x = tok & 7, so four row offsets plus immediates cover all stores (no hoisted per-k addresses).
        uint8_t* dK = sK + buf * C2::kSmemK + tok * kRowBytes;
        const int x7 = tok & 7;
#pragma unroll
        for (int k = 0; k < PER_THR; ++k) {
          const int c = 2 * k + hf;              // FP8 chunk: units 2c, 2c + 1
          const int tile = (c * 16) / FC::kTile;  // both units lie in one tile
          __nv_bfloat162 s2;
          if constexpr (F == Fmt::kV32) {
            const uint32_t sb = tile == 0 ? scl.x : tile == 1 ? scl.y : tile == 2 ? scl.z : scl.w;
            s2 = __float2bfloat162_rn(__uint_as_float(sb));
          } else {
            const uint32_t word = tile < 4 ? scl.x : scl.y;
            const uint16_t bits = e8m0_to_bf16_bits((word >> (8 * (tile & 3))) & 0xFFu);
            __nv_bfloat16_raw br;
            br.x = bits;
            const __nv_bfloat16 b1(br);
            s2 = __nv_bfloat162(b1, b1);
          }
          uint8_t* d = dK + (k >> 1) * 128;
          *reinterpret_cast<uint4*>(d + (((4 * (k & 1) + 2 * hf) ^ x7) << 4)) =
              dequant8(make_uint2(raw[k].x, raw[k].y), s2);
          *reinterpret_cast<uint4*>(d + (((4 * (k & 1) + 2 * hf + 1) ^ x7) << 4)) =
              dequant8(make_uint2(raw[k].z, raw[k].w), s2);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k)
          *reinterpret_cast<uint4*>(dK + NOPE_UNITS * 16 + (((2 * k + hf) ^ x7) << 4)) = rope[k];
        if (hf == 0) sValid[buf * kBlockN + tok] = valid ? 1 : 0;
        mbar_arrive(bar_full + 8 * buf);
      }
    }
    return;
  }

  // ======================= consumer warpgroups (the mma.sync kernel's compute) =======================
  const int warp = tid / 32, lane = tid % 32;
  const int rg = warp / C, cw = warp % C;
  const int gq = lane / 4, tq = lane % 4;
  int row_local[2], head[2];
  mma_core::fragment_rows(rg, gq, ht * BM, row_local, head);

  int kc = 0;  // blocks consumed so far
  for (int req = begin_req; req <= end_req; ++req) {
    const ReqInfo ri = req_info(req);
    const int n_blk = ri.n_blk;
    bool no_split = part_holds_whole_request(req, begin_req, end_req, first_splitted, last_splitted);
    if (!p.out_vec_ok) no_split = false;
    const int split_slot = part_split_slot(p.num_splits, req, begin_req, begin_split);

    if (n_blk > 0) {
      named_barrier_sync(small_heads::kBarConsumers, small_heads::kConsumers);  // every consumer is done with sQ
      load_q_tile<BM, N_CHUNKS, small_heads::kConsumers>(p, sQ, sQ_u, req, sq, ht, tid);
      cp_async_commit();
      cp_async_wait<0>();
      named_barrier_sync(small_heads::kBarConsumers, small_heads::kConsumers);  // Q visible to all consumers
    }

    float o[NT_O][4], m_run[2], l_run[2];
    mma_core::reset_rows(o, m_run, l_run);

    for (int i = 0; i < n_blk; ++i, ++kc) {
      const int buf = kc & 1;
      mbar_wait(bar_full + 8 * buf, (kc >> 1) & 1);
      const uint32_t sKb_u = sK_u + buf * C2::kSmemK;
      const uint8_t* sValidCur = sValid + buf * kBlockN;

      // ---- S = Q K^T, validity mask, online softmax, O += P V for this warp's keys and value columns
      mma_core::valid_key_block<__nv_bfloat16, NT_S, NT_O, C, KW, VW>(
          o, m_run, l_run, sQ_u, sKb_u, sValidCur, p.scale_log2, sRed, sP, sP_u, row_local, rg, cw, lane, tq, K_STEPS);
      mbar_arrive(bar_empty + 8 * buf);  // this thread is done with K buffer `buf`
    }

    // ---- epilogue (as the mma.sync kernel): total row sum across the row group's warps
    float L[2];
    mma_core::row_sums<C>(l_run, L, n_blk, sRed, row_local, rg, cw, tq);

    store_sparse_decode_rows<NT_O, VW>(
        p, [&](int j, int e) { return o[j][e]; }, L, m_run, head, sq, req, split_slot, no_split, cw, tq);
  }
}

template <Fmt F, int R>
cudaError_t launch_main_ws_r(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  constexpr int smem = small_heads::Cfg2<R>::kSmemBytes;
  auto kernel = flash_fwd_splitkv_mla_fp8_sparse_kernel_small_heads<F, R>;
  cudaError_t e = set_max_dynamic_smem(kernel, smem);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(kp.s_q) * static_cast<unsigned>(kp.num_head_tiles),
                  static_cast<unsigned>(num_sm_parts), 1);
  kernel<<<grid, small_heads::kThreads, smem, stream>>>(kp);
  return cudaGetLastError();
}

/// This kernel (one 16-row head tile) when kp.main_kernel is kMmaSmallHeads (h_q <= 16, sparse_decode.cu)
/// and both caches are 16-byte aligned; else the mma.sync kernel of mma_sync_kernel.cuh.
template <Fmt F>
cudaError_t launch_main_auto(const SparseDecodeKernelParams& kp, int num_sm_parts, cudaStream_t stream) {
  const bool vec_ok = kp.main.vec != 0 && (!kp.has_extra || kp.extra.vec != 0);
  if (kp.main_kernel != SparseDecodeMainKernel::kMmaSmallHeads || !vec_ok || tile_rows_for(kp.h_q) != 16)
    return launch_main<F>(kp, num_sm_parts, stream);
  return launch_main_ws_r<F, 1>(kp, num_sm_parts, stream);
}

}  // namespace flashmla::sm90::sparse
