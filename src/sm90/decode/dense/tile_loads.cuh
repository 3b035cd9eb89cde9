// src/sm90/decode/dense/tile_loads.cuh — the cp.async tile loads of the dense decode kernels that take
// K by cp.async (mma_sync_kernel.cuh, wgmma_kernel.cuh): the Q tile, and paged K rows and tiles (spec §3:
// k_cache pages of page_block_size tokens; block_table maps a request's page j to a page of k_cache).
// Each kernel passes its shared-memory layout as a chunk-offset function (row, 16-byte chunk) -> bytes.
#pragma once

#include <cstdint>

#include "sm90/decode/dense/dense_decode.h"
#include "sm90/common/utils.cuh"

namespace flashmla::sm90 {

/// cp.async (16-byte chunks, zero-filled past m_rows) of the tile's Q rows tile_row0 .. tile_row0 +
/// kRows - 1 of request req (row = sq * group + head in group, head kv_head * group + row % group) into
/// shared memory at sQ_u, chunk c of tile row r at sQ_u + chunk_off(r, c); n_chunks = d_qk / 8 chunks a
/// row; kThreads threads, this one tid. The caller commits the group.
template <typename T, int kRows, int kThreads, typename ChunkOffset>
__device__ __forceinline__ void load_q_tile(const DenseDecodeKernelParams& p, uint32_t sQ_u, int req, int kv_head,
                                            int tile_row0, int n_chunks, int tid, ChunkOffset chunk_off) {
  const T* qb = static_cast<const T*>(p.q) + req * p.q_stride_b;
  for (int idx = tid; idx < kRows * n_chunks; idx += kThreads) {
    const int r = idx / n_chunks, c = idx % n_chunks;
    const int grow = tile_row0 + r;
    const bool valid = grow < p.m_rows;
    const T* src = static_cast<const T*>(p.q);
    if (valid) {
      const int sq = grow / p.group, h = kv_head * p.group + grow % p.group;
      src = qb + sq * p.q_stride_s + h * p.q_stride_h + c * 8;
    }
    cp_async_16(sQ_u + chunk_off(r, c), src, valid);
  }
}

/// The k_cache page holding token `token` of the request whose block_table row is bt_row; -1 for a
/// token at or past seqlen.
__device__ __forceinline__ int token_page(const DenseDecodeKernelParams& p, const int32_t* bt_row, int seqlen,
                                          int token) {
  return token < seqlen ? bt_row[static_cast<int64_t>(token / p.page_block_size) * p.bt_stride_j] : -1;
}

/// The K row of token `token` in k_cache page `page` (kbase: k_cache at this CTA's KV head).
template <typename T>
__device__ __forceinline__ const T* token_row(const DenseDecodeKernelParams& p, const T* kbase, int token, int page) {
  return kbase + static_cast<int64_t>(page) * p.k_stride_blk +
         static_cast<int64_t>(token % p.page_block_size) * p.k_stride_tok;
}

/// cp.async of this thread's chunks (q4, q4 + 4, ... < n_chunks) of the K row of token `token` in page
/// `page` to tile row t_local of the K tile at dst (chunk c at dst + chunk_off(t_local, c)); page < 0
/// (a token past seqlen) zero-fills them.
template <typename T, typename ChunkOffset>
__device__ __forceinline__ void load_k_row(const DenseDecodeKernelParams& p, const T* kbase, uint32_t dst, int token,
                                           int page, int t_local, int q4, int n_chunks, ChunkOffset chunk_off) {
  const bool valid = page >= 0;
  const T* src = valid ? token_row(p, kbase, token, page) : kbase;
  for (int c = q4; c < n_chunks; c += 4)
    cp_async_16(dst + chunk_off(t_local, c), valid ? static_cast<const void*>(src + c * 8) : p.k, valid);
}

/// The paged K tiles of one request in a kernel that double-buffers them through cp.async: this thread
/// loads token slot t_local (tid / 4) of each tile of kBlockN tokens, its 16-byte chunks q4 (tid % 4),
/// q4 + 4, ... < n_chunks (d_qk / 8), into stage `stage` at sK_u + stage * kStageBytes (chunk offsets
/// chunk_off: the kernel's K layout). bt_row: the request's block_table row; seqlen: its tokens. d_qk
/// is held, not re-read from p: re-reading it changed the kernels' machine code.
template <typename T, int kBlockN, int kStageBytes, typename ChunkOffset>
struct KTiles {
  const DenseDecodeKernelParams& p;
  const T* kbase;
  const int32_t* bt_row;
  int seqlen, t_local, q4, n_chunks, d_qk;
  uint32_t sK_u;
  ChunkOffset chunk_off;

  /// The page of this thread's token of tile blk; -1 past seqlen (its load zero-fills and reads
  /// nothing). The kernels read the next tiles' pages ahead so that no load waits on block_table.
  __device__ __forceinline__ int page(int blk) const {
    return token_page(p, bt_row, seqlen, blk * kBlockN + t_local);
  }
  /// cp.async of this thread's chunks of tile blk, its token in page `page`, into stage `stage`.
  __device__ __forceinline__ void load(int blk, int stage, int page) const {
    load_k_row(p, kbase, sK_u + stage * kStageBytes, blk * kBlockN + t_local, page, t_local, q4, n_chunks, chunk_off);
  }
  /// L2 prefetch of this thread's whole token row (d_qk * 2 bytes) of tile blk (one thread a token).
  __device__ __forceinline__ void prefetch(int blk, int page) const {
    if (q4 == 0 && page >= 0)
      prefetch_l2_bulk(token_row(p, kbase, blk * kBlockN + t_local, page), static_cast<uint32_t>(d_qk * 2));
  }
};

/// The KTiles of thread tid for the request with block_table row bt_row and seqlen tokens, d_qk dims a
/// token (kbase: k_cache at the CTA's KV head), stages at sK_u.
template <int kBlockN, int kStageBytes, typename T, typename ChunkOffset>
__device__ __forceinline__ KTiles<T, kBlockN, kStageBytes, ChunkOffset> k_tiles(
    const DenseDecodeKernelParams& p, const T* kbase, const int32_t* bt_row, int seqlen, int tid, int d_qk,
    uint32_t sK_u, ChunkOffset chunk_off) {
  return {p, kbase, bt_row, seqlen, tid / 4, tid % 4, d_qk / 8, d_qk, sK_u, chunk_off};
}

}  // namespace flashmla::sm90
