// src/sm90/common/mma_core.cuh — the mma.sync m16n8k16 attention core of the small-tile kernels (dense
// decode mma_sync_kernel.cuh, sparse FP8 decode mma_sync_kernel.cuh and mma_small_heads_kernel.cuh,
// sparse prefill mma_sync_kernel.cuh), written once: per 64-key block, S = Q K^T for a warp's share of
// the keys, the base-2 online softmax with the row max exchanged among the warps of a row group, P
// through shared memory, O += P V for the warp's share of the 512 value columns. What differs between
// the kernels — how K gets into shared memory, which keys are masked — stays in the kernels, between
// qk() and softmax_p(); the sparse kernels, whose mask is a validity byte per key slot, take the whole
// block as valid_key_block().
//
// Layout all four share: 256 threads = 8 warps = R row groups of 16 rows x C = 8 / R column warps;
// warp (rg, cw) owns keys [cw * KW, cw * KW + KW) of S and value columns [cw * VW, cw * VW + VW) of O.
// Q and K tiles have 1152-byte rows (576 elements of 2 bytes, also for d_qk 512) whose 16-byte chunks
// are XOR-swizzled by (row & 7) within each group of 8 (ldmatrix without bank conflicts); the P tile
// has 128-byte rows (64 keys), swizzled the same way. V is the first 512 dims of the K rows.
#pragma once

#include <cmath>
#include <cstdint>

#include "sm90/common/utils.cuh"

namespace flashmla::sm90::mma_core {

constexpr int kRowBytes = 1152;  // shared-memory bytes per Q / K row
constexpr int kBlockN = 64;      // keys per block
constexpr int kDimV = 512;       // value columns (O's width)

/// The tile of a kernel on this core with R row groups (R = 1, 2 or 4; see the layout above) and the
/// shared-memory bytes of its Q, K, P and row-reduction buffers. The kernels add their own buffers
/// (a K double buffer, staging, masks, barriers) in their Cfg.
template <int R>
struct Tile {
  static constexpr int BM = 16 * R;       // rows per CTA tile (query rows or heads)
  static constexpr int C = 8 / R;         // warps per row group
  static constexpr int KW = kBlockN / C;  // keys per warp for S
  static constexpr int NT_S = KW / 8;     // n-tiles of S per warp
  static constexpr int VW = kDimV / C;    // V columns per warp
  static constexpr int NT_O = VW / 8;     // n-tiles of O per warp
  static constexpr int kSmemQ = BM * kRowBytes;
  static constexpr int kSmemK = kBlockN * kRowBytes;
  static constexpr int kSmemP = BM * kBlockN * 2;
  static constexpr int kSmemRed = BM * C * 4;
  static_assert(NT_S >= 1, "at least one n-tile of keys per warp");
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a Q / K tile.
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}
// Byte offset of 16-byte chunk `chunk` of row `row` in the P tile.
__device__ __forceinline__ uint32_t swz_p(int row, int chunk) {
  return static_cast<uint32_t>(row * (kBlockN * 2) + ((chunk ^ (row & 7)) << 4));
}

/// s = Q K^T (unscaled, fp32) for this warp's KW keys: rows rg * 16 ... + 15 of the Q tile at sQ_u
/// against the K tile at sK_u, over k_steps k-steps of 16 (d_qk / 16: 36 or 32, even). With few
/// n-tiles per warp the k-loop is a serial chain of dependent mma; NACC independent accumulators
/// (even / odd k-steps) halve its latency.
template <class T, int NT_S, int KW>
__device__ __forceinline__ void qk(float (&s)[NT_S][4], uint32_t sQ_u, uint32_t sK_u, int rg, int cw, int lane,
                                   int k_steps) {
  constexpr int NACC = NT_S >= 4 ? 1 : 2;
  float sacc[NACC][NT_S][4];
#pragma unroll
  for (int a = 0; a < NACC; ++a)
#pragma unroll
    for (int j = 0; j < NT_S; ++j) sacc[a][j][0] = sacc[a][j][1] = sacc[a][j][2] = sacc[a][j][3] = 0.f;
  {
    const int a_row = rg * 16 + (lane & 15);
    const int a_cbit = lane >> 4;
    const uint32_t a_base = sQ_u + a_row * kRowBytes;
    const int a_x = a_row & 7;
    // B (K rows): key within the warp's share, chunk bit
    const int b_key = cw * KW + (lane & 7) + (NT_S >= 2 ? ((lane >> 4) << 3) : 0);
    const int b_cbit = (lane >> 3) & 1;
    const uint32_t b_base = sK_u + b_key * kRowBytes;
    const int b_x = b_key & 7;
    auto k_step = [&](int ks, float (&sa)[NT_S][4]) {
      uint32_t a[4];
      ldmatrix_x4(a, a_base + (((ks * 2 + a_cbit) ^ a_x) << 4));
      if constexpr (NT_S >= 2) {
#pragma unroll
        for (int np = 0; np < NT_S / 2; ++np) {
          uint32_t bfr[4];
          ldmatrix_x4(bfr, b_base + np * 16 * kRowBytes + (((ks * 2 + b_cbit) ^ b_x) << 4));
          HalfTraits<T>::mma(sa[2 * np], a, bfr[0], bfr[1]);
          HalfTraits<T>::mma(sa[2 * np + 1], a, bfr[2], bfr[3]);
        }
      } else {
        uint32_t bfr[2];
        ldmatrix_x2(bfr, b_base + (((ks * 2 + b_cbit) ^ b_x) << 4));
        HalfTraits<T>::mma(sa[0], a, bfr[0], bfr[1]);
      }
    };
#pragma unroll 2
    for (int ks = 0; ks < k_steps; ks += 2) {
      k_step(ks, sacc[0]);
      k_step(ks + 1, sacc[NACC - 1]);
    }
  }
#pragma unroll
  for (int j = 0; j < NT_S; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = NACC == 2 ? sacc[0][j][e] + sacc[1][j][e] : sacc[0][j][e];
}

/// Scale s to base 2 (times scale_log2), set the keys whose validity byte valid[key] is 0 to -inf and
/// take this thread's row maxima mx (the sparse kernels: a slot's validity comes from its index).
template <int NT_S, int KW>
__device__ __forceinline__ void scale_mask_valid_rowmax(float (&s)[NT_S][4], float scale_log2, const uint8_t* valid,
                                                        int cw, int tq, float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < NT_S; ++j) {
    const int key = cw * KW + j * 8 + 2 * tq;
    const bool v0 = valid[key] != 0, v1 = valid[key + 1] != 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v = ((e & 1) ? v1 : v0) ? s[j][e] * scale_log2 : -INFINITY;
      s[j][e] = v;
      mx[e >> 1] = fmaxf(mx[e >> 1], v);
    }
  }
}

/// The online-softmax step of one block, after the caller has scaled s to base 2, set its masked keys
/// to -inf and taken this thread's row maxima mx (not yet reduced over the quad): the row max over
/// the row group's C warps (quad shuffles, then sRed[row * C + cw] and named barrier 1 + rg), the new
/// running max m_run, P = exp2(s - m) rounded to T into the P tile at sP (rows row_local), the row
/// sums l_run (of the unrounded fp32 P) and O rescaled by 2^(m_old - m_new); a second barrier makes
/// P visible to the row group. Rows whose every key so far is masked keep m_run = -inf and
/// contribute P = 0.
template <class T, int NT_S, int NT_O, int C, int KW>
__device__ __forceinline__ void softmax_p(float (&s)[NT_S][4], float (&mx)[2], float (&m_run)[2], float (&l_run)[2],
                                          float (&o)[NT_O][4], float* sRed, uint8_t* sP, const int (&row_local)[2],
                                          int rg, int cw, int tq) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
    mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
    if (tq == 0) sRed[row_local[hh] * C + cw] = mx[hh];
  }
  named_barrier_sync(1 + rg, 32 * C);
  float m_use[2], alpha[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float bm = sRed[row_local[hh] * C];
#pragma unroll
    for (int c = 1; c < C; ++c) bm = fmaxf(bm, sRed[row_local[hh] * C + c]);
    alpha[hh] = advance_row_max(m_run[hh], fmaxf(m_run[hh], bm), m_use[hh]);
  }

  // P = exp2(S - m), row sums, P -> smem
  float rs[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < NT_S; ++j) {
    const float p0 = exp2f(s[j][0] - m_use[0]);
    const float p1 = exp2f(s[j][1] - m_use[0]);
    const float p2 = exp2f(s[j][2] - m_use[1]);
    const float p3 = exp2f(s[j][3] - m_use[1]);
    rs[0] += p0 + p1;
    rs[1] += p2 + p3;
    const int key = cw * KW + j * 8 + 2 * tq;  // key within the block
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t pk = hh == 0 ? HalfTraits<T>::pack(p0, p1) : HalfTraits<T>::pack(p2, p3);
      *reinterpret_cast<uint32_t*>(sP + swz_p(row_local[hh], key >> 3) + (key & 7) * 2) = pk;
    }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) l_run[hh] = l_run[hh] * alpha[hh] + rs[hh];
#pragma unroll
  for (int j = 0; j < NT_O; ++j) {
    o[j][0] *= alpha[0];
    o[j][1] *= alpha[0];
    o[j][2] *= alpha[1];
    o[j][3] *= alpha[1];
  }
  named_barrier_sync(1 + rg, 32 * C);
}

/// O += P V for this warp's VW value columns: P from the P tile at sP_u (the row group's 16 rows), V =
/// the first 512 dims of the K tile at sK_u, read MN-major by ldmatrix.trans (no transposed copy).
template <class T, int NT_O, int VW>
__device__ __forceinline__ void pv(float (&o)[NT_O][4], uint32_t sP_u, uint32_t sK_u, int rg, int cw, int lane) {
  const int a_row = rg * 16 + (lane & 15);
  const int a_cbit = lane >> 4;
  const uint32_t a_base = sP_u + a_row * (kBlockN * 2);
  const int a_x = a_row & 7;
  const int v_key = (lane & 7) + (((lane >> 3) & 1) << 3);
  const int v_cbit = lane >> 4;
  const int v_chunk0 = cw * (VW / 8);
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
    uint32_t a[4];
    ldmatrix_x4(a, a_base + (((ks * 2 + a_cbit) ^ a_x) << 4));
    const int key = ks * 16 + v_key;
    const uint32_t v_base = sK_u + key * kRowBytes;
    const int v_x = key & 7;
#pragma unroll
    for (int np = 0; np < NT_O / 2; ++np) {
      uint32_t bfr[4];
      ldmatrix_x4_trans(bfr, v_base + (((v_chunk0 + np * 2 + v_cbit) ^ v_x) << 4));
      HalfTraits<T>::mma(o[2 * np], a, bfr[0], bfr[1]);
      HalfTraits<T>::mma(o[2 * np + 1], a, bfr[2], bfr[3]);
    }
  }
}

/// A new set of rows (a request, a query position): O = 0, the running row max m_run = -inf (no key
/// seen yet) and the row sums l_run = 0.
template <int NT_O>
__device__ __forceinline__ void reset_rows(float (&o)[NT_O][4], float (&m_run)[2], float (&l_run)[2]) {
#pragma unroll
  for (int j = 0; j < NT_O; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  m_run[0] = -INFINITY;
  m_run[1] = -INFINITY;
  l_run[0] = 0.f;
  l_run[1] = 0.f;
}

/// Epilogue, after quad_sum (utils.cuh): L = the quad sums l added over the row group's C warps, through
/// sRed[row * C + cw] and named barrier 1 + rg (the caller makes sure no warp still reads sRed).
template <int C>
__device__ __forceinline__ void row_group_sum(const float (&l)[2], float (&L)[2], float* sRed,
                                              const int (&row_local)[2], int rg, int cw, int tq) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
    if (tq == 0) sRed[row_local[hh] * C + cw] = l[hh];
  named_barrier_sync(1 + rg, 32 * C);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float t = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) t += sRed[row_local[hh] * C + c];
    L[hh] = t;
  }
}

/// The epilogue's row sums: l (this thread's l_run) summed over its quad (quad_sum) and, when the rows
/// saw n_blk > 0 key blocks, over the row group's C warps (row_group_sum) into L; else L = 0 and sRed
/// is not touched. kSyncFirst: a __syncthreads() before sRed is written (sparse prefill, whose caller
/// does not otherwise order the warps' last reads of sRed before it). (It takes n_blk, not the caller's
/// n_blk > 0: a compare made before the quad shuffles changed the decode kernels' register allocation.)
template <int C, bool kSyncFirst = false>
__device__ __forceinline__ void row_sums(float (&l)[2], float (&L)[2], int n_blk, float* sRed,
                                         const int (&row_local)[2], int rg, int cw, int tq) {
  quad_sum(l);
  L[0] = 0.f;
  L[1] = 0.f;
  if (n_blk > 0) {
    if constexpr (kSyncFirst) __syncthreads();
    row_group_sum<C>(l, L, sRed, row_local, rg, cw, tq);
  }
}

/// The two rows of this thread's fragments (rows gq = lane / 4 and gq + 8 of row group rg): row_local
/// in the tile, row = row0 + row_local (the sparse kernels: the head, row0 = the head tile's first head).
__device__ __forceinline__ void fragment_rows(int rg, int gq, int row0, int (&row_local)[2], int (&row)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    row_local[hh] = rg * 16 + gq + 8 * hh;
    row[hh] = row0 + row_local[hh];
  }
}

/// One key block of the kernels whose masked keys come as a validity byte per key slot (the sparse
/// kernels): S = Q K^T for this warp's keys (qk), scale and mask by valid[key] (scale_mask_valid_rowmax),
/// the online-softmax step with P to the P tile (softmax_p), O += P V (pv). sK_u: the block's K tile
/// (V its first 512 dims); k_steps: d_qk / 16.
template <class T, int NT_S, int NT_O, int C, int KW, int VW>
__device__ __forceinline__ void valid_key_block(float (&o)[NT_O][4], float (&m_run)[2], float (&l_run)[2],
                                                uint32_t sQ_u, uint32_t sK_u, const uint8_t* valid, float scale_log2,
                                                float* sRed, uint8_t* sP, uint32_t sP_u, const int (&row_local)[2],
                                                int rg, int cw, int lane, int tq, int k_steps) {
  float s[NT_S][4];
  qk<T, NT_S, KW>(s, sQ_u, sK_u, rg, cw, lane, k_steps);
  float mx[2];
  scale_mask_valid_rowmax<NT_S, KW>(s, scale_log2, valid, cw, tq, mx);
  softmax_p<T, NT_S, NT_O, C, KW>(s, mx, m_run, l_run, o, sRed, sP, row_local, rg, cw, tq);
  pv<T, NT_O, VW>(o, sP_u, sK_u, rg, cw, lane);
}

}  // namespace flashmla::sm90::mma_core
