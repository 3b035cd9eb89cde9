// src/sm90/decode/dense/thread_rows.cuh — the two rows of a tile that each thread of the dense decode
// kernels holds in its mma-layout fragments (rows gq and gq + 8 of its 16-row group): their indices,
// their causal key limits (with the part's share of a request: dense_request), and the register
// epilogue that writes them, divided by their row sums, to out (whole request) or to the split
// partials o_accum / lse_accum (spec §4.3), with the rows' LSE.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "sm90/decode/dense/dense_decode.h"
#include "sm90/common/decode_schedule.cuh"
#include "sm90/common/utils.cuh"

namespace flashmla::sm90 {

/// A per-thread predicate given as a bool, or as a callable returning it that is evaluated where it
/// is used.
template <typename Predicate>
__device__ __forceinline__ bool lane_predicate(Predicate pred) {
  if constexpr (std::is_invocable_v<Predicate>) {
    return pred();
  } else {
    return pred;
  }
}

/// The rows of this thread (lane / 4 = gq) in 16-row group row_group of the tile starting at row
/// tile_row0 of the M = s_q * group rows: row_local (in the tile), row_global (in M), row_sq (query
/// position = row_global / group).
__device__ __forceinline__ void thread_rows(int row_group, int gq, int tile_row0, int group, int (&row_local)[2],
                                            int (&row_global)[2], int (&row_sq)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_local[hh] = row_group * 16 + gq + 8 * hh;
    row_global[hh] = tile_row0 + row_local[hh];
    row_sq[hh] = row_global[hh] / group;
  }
}

/// The keys each of the thread's rows may see in a request of seqlen keys (limit: keys < limit): all
/// of them, or with p.causal the bottom-right causal mask (query position sq of s_q sees
/// seqlen - (s_q - 1 - sq)); padded rows (sq >= s_q) see everything. Returns the smaller limit.
__device__ __forceinline__ int causal_key_limits(const DenseDecodeKernelParams& p, const int (&row_sq)[2], int seqlen,
                                                 int (&limit)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    int lim = seqlen;
    if (p.causal && row_sq[hh] < p.s_q) lim = seqlen - (p.s_q - 1 - row_sq[hh]);
    limit[hh] = lim;
  }
  return min(limit[0], limit[1]);
}

/// Request req of part ps as this thread's rows (query positions row_sq) see it: its keys seqlen
/// (cache_seqlens[req], a negative length read as 0), the part's share of its blocks of kBlockN keys
/// (part_request: blk_lo, n_blk, no_split, split_slot) and the rows' key limits (causal_key_limits:
/// into limit, min_limit the smaller). limit stays the caller's array: held in the returned struct, the
/// masks that read it compiled differently.
struct DenseRequest {
  int seqlen, blk_lo, n_blk;
  bool no_split;
  int split_slot, min_limit;
};
template <int kBlockN>
__device__ __forceinline__ DenseRequest dense_request(const DenseDecodeKernelParams& p, const PartSchedule& ps, int req,
                                                      const int (&row_sq)[2], int (&limit)[2]) {
  const int seqlen = max(p.seqlens[req], 0);
  const PartRequest share = part_request<kBlockN>(ps, p.num_splits, req, seqlen);
  const int min_limit = causal_key_limits(p, row_sq, seqlen, limit);
  return {seqlen, share.blk_lo, share.n_blk, share.no_split, share.split_slot, min_limit};
}

/// Writes the rows row_global[hh] (hh = 0, 1; rows >= m_rows are padding and skipped) that this thread
/// holds in an mma-layout accumulator: kFrags fragments of 8 columns in the column group col_group (the
/// warp's or warpgroup's kGroupCols columns), of which the thread holds columns
/// col_group * kGroupCols + 8j + 2tq and +1, read as o_at(j, 2hh) and o_at(j, 2hh + 1). L: the row sums
/// (0 = no visible key: O 0, LSE +inf; NaN stays NaN); m_run: the base-2 row maxima; row_sq: the rows'
/// query positions; writes_lse: whether this thread writes the rows' LSE (one thread per row), a bool or
/// a callable returning it (lane_predicate): where it is evaluated changes a kernel's register
/// assignment, and each kernel passes the form that keeps the machine code it was verified and timed
/// with (bench/results/2026-12-03-sass-dedup.log). out gets O/L in T (4-byte pairs when out_vec_ok, else element by element along o_stride_d) and lse the natural-log
/// LSE; a split partial gets O/L in fp32 at o_accum row (split_slot, kv_head, row) and its base-2 LSE.
template <typename T, int kFrags, int kGroupCols, typename FragmentAt, typename WritesLse>
__device__ __forceinline__ void store_dense_decode_rows(const DenseDecodeKernelParams& p, FragmentAt o_at,
                                                        const float (&L)[2], const float (&m_run)[2],
                                                        const int (&row_global)[2], const int (&row_sq)[2], int req,
                                                        int kv_head, int split_slot, bool no_split, int col_group,
                                                        WritesLse writes_lse, int tq) {
  constexpr int kDimV = 512;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int grow = row_global[hh];
    if (grow >= p.m_rows) continue;
    const bool empty = row_sum_empty(L[hh]);  // no visible key (a NaN L is not empty)
    const float inv = empty ? 0.f : 1.f / L[hh];
    const float lse2 = empty ? (no_split ? INFINITY : -INFINITY) : log2f(L[hh]) + m_run[hh];
    const int sq = row_sq[hh];
    const int h = kv_head * p.group + grow % p.group;
    if (no_split) {
      T* out = static_cast<T*>(p.out) + req * p.o_stride_b + sq * p.o_stride_s + h * p.o_stride_h;
#pragma unroll
      for (int j = 0; j < kFrags; ++j) {
        const int col = col_group * kGroupCols + j * 8 + 2 * tq;
        const float v0 = o_at(j, 2 * hh) * inv, v1 = o_at(j, 2 * hh + 1) * inv;
        if (p.out_vec_ok) {
          *reinterpret_cast<uint32_t*>(out + col) = HalfTraits<T>::pack(v0, v1);
        } else {
          out[col * p.o_stride_d] = HalfTraits<T>::from_float(v0);
          out[(col + 1) * p.o_stride_d] = HalfTraits<T>::from_float(v1);
        }
      }
      if (lane_predicate(writes_lse))
        p.lse[req * p.lse_stride_b + h * p.lse_stride_h + sq * p.lse_stride_s] = empty ? INFINITY : lse2 * kLn2;
    } else {
      const int64_t arow = (static_cast<int64_t>(split_slot) * p.h_kv + kv_head) * p.m_rows + grow;
      float* oa = p.o_accum + arow * kDimV;
#pragma unroll
      for (int j = 0; j < kFrags; ++j) {
        const int col = col_group * kGroupCols + j * 8 + 2 * tq;
        *reinterpret_cast<float2*>(oa + col) = make_float2(o_at(j, 2 * hh) * inv, o_at(j, 2 * hh + 1) * inv);
      }
      if (lane_predicate(writes_lse)) p.lse_accum[arow] = lse2;
    }
  }
}

}  // namespace flashmla::sm90
