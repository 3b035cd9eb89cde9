// src/reference/dense_prefill.cpp — CPU reference of dense MHA prefill, forward and backward
// (`flash_attn_varlen_func`, spec §1.5, §2.5).
//
//   q     (total_q, h_q, d_qk)   bf16 | fp16        request i: rows [cu_seqlens_qo[i], cu_seqlens_qo[i+1])
//   k     (total_k, h_kv, d_qk)  dtype of q         request i: rows [cu_seqlens_kv[i], cu_seqlens_kv[i+1])
//   v     (total_k, h_kv, d_v)   dtype of q
//   out   (total_q, h_q, d_v)    dtype of q, written
//   lse   (total_q, h_q)         float32, natural log, written (any strides)
//
// Query head h reads KV head h / (h_q / h_kv) (GQA as repeat_interleave). Query row r of a request
// with lengths (s_q, s_k) sees keys j < n(r), n(r) = s_k, or with `causal` (bottom-right aligned)
// n(r) = clamp(r + s_k - s_q + 1, 0, s_k). With x_j = (q_r . k_j) * scale:
//   lse = ln sum_j exp(x_j),   out = sum_j exp(x_j - lse) v_j.
// A row with n(r) = 0 gives out = 0, lse = -inf (torch's logsumexp of an empty row); a NaN in q, or in
// a visible key or value, gives NaN in that row. Keys a row does not see are never read.
//
// Backward (the gradient through lse is not propagated), with P_rj = exp(x_rj - lse_r) from the given
// lse, D_r = sum_d dout_r[d] out_r[d] from the given out:
//   dv_j = sum_r P_rj dout_r,   dS_rj = P_rj (dout_r . v_j - D_r),
//   dq_r = scale sum_j dS_rj k_j,   dk_j = scale sum_r dS_rj q_r,
// summed over the query heads of a KV head for dk / dv. Every sum runs in a fixed order in float32, so
// the results are bitwise reproducible for any thread count. Outputs are rounded once to q's dtype.
#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "reference/attention_core.h"
#include "reference/reference.h"
#include "reference/thread_pool.h"

namespace flashmla::reference {
namespace {

constexpr int64_t kRowBlock = 32;  // query rows (forward, dq) or key rows (dk / dv) per work item
// Rows of the other sequence (keys for the forward and dq, query rows for dk / dv) converted to float32 at a time, so
// that a work item's memory does not grow with the sequence: ~kTile x (d_qk + d_v) x 4 bytes per thread besides the
// item's own rows. The tiles are walked in order, so every sum adds its terms in the order of the untiled loops.
constexpr int64_t kTile = 512;

struct Problem {
  int64_t b = 0, h_q = 0, h_kv = 0, group = 1, d_qk = 0, d_v = 0;
  float scale = 1.f;
  bool causal = false, fp16 = false;
  std::vector<int64_t> cu_q, cu_k;

  explicit Problem(const DensePrefillParams& p)
      : b(p.cu_seqlens_qo.shape[0] - 1), h_q(p.q.shape[1]), h_kv(p.k.shape[1]), group(h_q / h_kv), d_qk(p.q.shape[2]),
        d_v(p.v.shape[2]), scale(p.softmax_scale), causal(p.causal), fp16(p.q.dtype == DType::kFloat16) {
    for (int64_t i = 0; i <= b; ++i) {
      cu_q.push_back(*elem<const int32_t>(p.cu_seqlens_qo, i));
      cu_k.push_back(*elem<const int32_t>(p.cu_seqlens_kv, i));
    }
  }
  int64_t s_q(int64_t i) const { return cu_q[i + 1] - cu_q[i]; }
  int64_t s_k(int64_t i) const { return cu_k[i + 1] - cu_k[i]; }
  /// Keys visible to query row r of request i: [0, visible(i, r)).
  int64_t visible(int64_t i, int64_t r) const {
    if (!causal) return s_k(i);
    return std::clamp<int64_t>(r + s_k(i) - s_q(i) + 1, 0, s_k(i));
  }
  /// First query row of request i that sees key j (causal), 0 otherwise.
  int64_t first_row_seeing(int64_t i, int64_t j) const {
    if (!causal) return 0;
    return std::max<int64_t>(0, j - s_k(i) + s_q(i));
  }
};

/// One work item: request, KV head, first row of a block of kRowBlock rows.
struct Item {
  int64_t req, kv_head, row0;
};

/// Blocks of kRowBlock rows of every (request, KV head); `rows(i)` gives the rows of request i.
template <typename Rows>
std::vector<Item> make_items(const Problem& pb, Rows&& rows) {
  std::vector<Item> items;
  for (int64_t i = 0; i < pb.b; ++i)
    for (int64_t g = 0; g < pb.h_kv; ++g)
      for (int64_t r = 0; r < rows(i); r += kRowBlock) items.push_back({i, g, r});
  return items;
}

/// Rows [row0, row0 + n) of head `head` of a (tokens, heads, dim) 16-bit tensor as n x dim floats.
void load_rows(const TensorRef& t, int64_t row0, int64_t n, int64_t head, bool fp16, float* dst) {
  const int64_t dim = t.shape[2];
  for (int64_t r = 0; r < n; ++r)
    load_half_row(elem<const uint16_t>(t, row0 + r, head, 0), t.stride[2], dim, fp16, dst + r * dim);
}

void store_row(const TensorRef& t, int64_t row, int64_t head, const float* src, bool fp16) {
  store_half_row(src, 1.f, t.shape[2], fp16, elem<uint16_t>(t, row, head, 0), t.stride[2]);
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

}  // namespace

Status dense_prefill_fwd(const DensePrefillParams& p) {
  return run_guarded("dense_prefill_fwd", [&] {
    const Problem pb(p);
    const std::vector<Item> items = make_items(pb, [&](int64_t i) { return pb.s_q(i); });
    parallel_for(static_cast<int64_t>(items.size()), [&](int64_t it) {
      const Item& w = items[it];
      const int64_t i = w.req, g = w.kv_head, q0 = pb.cu_q[i], k0 = pb.cu_k[i];
      const int64_t row_end = std::min(w.row0 + kRowBlock, pb.s_q(i)), nrow = row_end - w.row0;
      const int64_t n_max = pb.visible(i, row_end - 1);  // visible() grows with the row
      const int64_t pairs = nrow * pb.group;             // (row, head) of the item: row-major, heads fastest
      // Per (row, head): q, the running max m, then sum and o. Two passes over the key tiles: the max of the scores,
      // then exp(score - m) summed and accumulated into o (the scores recomputed: the same values).
      std::vector<float> q(static_cast<size_t>(pairs * pb.d_qk)), m(static_cast<size_t>(pairs), -kInf),
          sum(static_cast<size_t>(pairs), 0.f), o(static_cast<size_t>(pairs * pb.d_v), 0.f);
      for (int64_t r = w.row0; r < row_end; ++r)
        for (int64_t hh = 0; hh < pb.group; ++hh)
          load_rows(p.q, q0 + r, 1, g * pb.group + hh, pb.fp16, q.data() + ((r - w.row0) * pb.group + hh) * pb.d_qk);
      std::vector<float> k(static_cast<size_t>(kTile * pb.d_qk)), v(static_cast<size_t>(kTile * pb.d_v));
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t j0 = 0; j0 < n_max; j0 += kTile) {
          const int64_t nt = std::min(kTile, n_max - j0);
          load_rows(p.k, k0 + j0, nt, g, pb.fp16, k.data());
          if (pass == 1) load_rows(p.v, k0 + j0, nt, g, pb.fp16, v.data());
          for (int64_t r = w.row0; r < row_end; ++r) {
            const int64_t n = std::min(pb.visible(i, r), j0 + nt);
            for (int64_t hh = 0; hh < pb.group; ++hh) {
              const int64_t x = (r - w.row0) * pb.group + hh;
              const float* qx = q.data() + x * pb.d_qk;
              for (int64_t j = j0; j < n; ++j) {
                const float s = dot_f32(qx, k.data() + (j - j0) * pb.d_qk, pb.d_qk) * pb.scale;
                if (pass == 0) {
                  if (s > m[x]) m[x] = s;  // the running max skips NaN scores (exp(NaN) still reaches the sum)
                } else {
                  const float e = std::exp(s - m[x]);
                  sum[x] += e;
                  axpy(e, v.data() + (j - j0) * pb.d_v, o.data() + x * pb.d_v, pb.d_v);
                }
              }
            }
          }
        }
      }
      for (int64_t r = w.row0; r < row_end; ++r) {
        const bool seen = pb.visible(i, r) > 0;
        for (int64_t hh = 0; hh < pb.group; ++hh) {
          const int64_t x = (r - w.row0) * pb.group + hh, h = g * pb.group + hh;
          float* ox = o.data() + x * pb.d_v;
          if (seen)
            for (int64_t d = 0; d < pb.d_v; ++d) ox[d] /= sum[x];
          store_row(p.out, q0 + r, h, ox, pb.fp16);
          *elem<float>(p.lse, q0 + r, h) = seen ? m[x] + std::log(sum[x]) : -kInf;
        }
      }
    });
  });
}

Status dense_prefill_bwd(const DensePrefillBwdParams& bp) {
  return run_guarded("dense_prefill_bwd", [&] {
    const DensePrefillParams& p = bp.fwd;
    const Problem pb(p);
    const int64_t total_q = p.q.shape[0];

    // D[t, h] = dout[t, h] . out[t, h]
    std::vector<float> delta(static_cast<size_t>(total_q * pb.h_q));
    parallel_for(total_q, [&](int64_t t) {
      std::vector<float> a(static_cast<size_t>(pb.d_v)), c(static_cast<size_t>(pb.d_v));
      for (int64_t h = 0; h < pb.h_q; ++h) {
        load_rows(bp.dout, t, 1, h, pb.fp16, a.data());
        load_rows(p.out, t, 1, h, pb.fp16, c.data());
        delta[t * pb.h_q + h] = dot_f32(a.data(), c.data(), pb.d_v);
      }
    });

    // dq: blocks of query rows; per (row, head) dq accumulated over the key tiles in order.
    const std::vector<Item> q_items = make_items(pb, [&](int64_t i) { return pb.s_q(i); });
    parallel_for(static_cast<int64_t>(q_items.size()), [&](int64_t it) {
      const Item& w = q_items[it];
      const int64_t i = w.req, g = w.kv_head, q0 = pb.cu_q[i], k0 = pb.cu_k[i];
      const int64_t row_end = std::min(w.row0 + kRowBlock, pb.s_q(i)), nrow = row_end - w.row0;
      const int64_t n_max = pb.visible(i, row_end - 1);
      const int64_t pairs = nrow * pb.group;  // (row, head) of the item: row-major, heads fastest
      std::vector<float> q(static_cast<size_t>(pairs * pb.d_qk)), dout(static_cast<size_t>(pairs * pb.d_v)),
          dq(static_cast<size_t>(pairs * pb.d_qk), 0.f);
      for (int64_t r = w.row0; r < row_end; ++r)
        for (int64_t hh = 0; hh < pb.group; ++hh) {
          const int64_t x = (r - w.row0) * pb.group + hh, h = g * pb.group + hh;
          load_rows(p.q, q0 + r, 1, h, pb.fp16, q.data() + x * pb.d_qk);
          load_rows(bp.dout, q0 + r, 1, h, pb.fp16, dout.data() + x * pb.d_v);
        }
      std::vector<float> k(static_cast<size_t>(kTile * pb.d_qk)), v(static_cast<size_t>(kTile * pb.d_v));
      for (int64_t j0 = 0; j0 < n_max; j0 += kTile) {
        const int64_t nt = std::min(kTile, n_max - j0);
        load_rows(p.k, k0 + j0, nt, g, pb.fp16, k.data());
        load_rows(p.v, k0 + j0, nt, g, pb.fp16, v.data());
        for (int64_t r = w.row0; r < row_end; ++r) {
          const int64_t n = std::min(pb.visible(i, r), j0 + nt);
          for (int64_t hh = 0; hh < pb.group; ++hh) {
            const int64_t x = (r - w.row0) * pb.group + hh, h = g * pb.group + hh, t = q0 + r;
            const float lse = *elem<const float>(p.lse, t, h), dlt = delta[t * pb.h_q + h];
            const float *qx = q.data() + x * pb.d_qk, *dox = dout.data() + x * pb.d_v;
            for (int64_t j = j0; j < n; ++j) {
              const float* kj = k.data() + (j - j0) * pb.d_qk;
              const float pr = std::exp(dot_f32(qx, kj, pb.d_qk) * pb.scale - lse);
              const float ds = pr * (dot_f32(dox, v.data() + (j - j0) * pb.d_v, pb.d_v) - dlt);
              axpy(ds, kj, dq.data() + x * pb.d_qk, pb.d_qk);
            }
          }
        }
      }
      for (int64_t r = w.row0; r < row_end; ++r) {
        const bool seen = pb.visible(i, r) > 0;  // a row without keys keeps dq = 0 (not 0 * scale)
        for (int64_t hh = 0; hh < pb.group; ++hh) {
          const int64_t x = (r - w.row0) * pb.group + hh;
          float* dqx = dq.data() + x * pb.d_qk;
          if (seen)
            for (int64_t d = 0; d < pb.d_qk; ++d) dqx[d] *= pb.scale;
          store_row(bp.dq, q0 + r, g * pb.group + hh, dqx, pb.fp16);
        }
      }
    });

    // dk / dv: blocks of key rows; the query heads of the KV head, then the rows, in order.
    const std::vector<Item> k_items = make_items(pb, [&](int64_t i) { return pb.s_k(i); });
    parallel_for(static_cast<int64_t>(k_items.size()), [&](int64_t it) {
      const Item& w = k_items[it];
      const int64_t i = w.req, g = w.kv_head, q0 = pb.cu_q[i], k0 = pb.cu_k[i], s_q = pb.s_q(i);
      const int64_t j_end = std::min(w.row0 + kRowBlock, pb.s_k(i)), nj = j_end - w.row0;
      const int64_t r_lo = std::min(pb.first_row_seeing(i, w.row0), s_q), nr = s_q - r_lo;
      std::vector<float> k(static_cast<size_t>(nj * pb.d_qk)), v(static_cast<size_t>(nj * pb.d_v));
      load_rows(p.k, k0 + w.row0, nj, g, pb.fp16, k.data());
      load_rows(p.v, k0 + w.row0, nj, g, pb.fp16, v.data());
      std::vector<float> dk(static_cast<size_t>(nj * pb.d_qk), 0.f), dv(static_cast<size_t>(nj * pb.d_v), 0.f);
      // Query rows in tiles of kTile (each row's products added in the order of the untiled loop: head, then row).
      std::vector<float> q(static_cast<size_t>(kTile * pb.d_qk)), dout(static_cast<size_t>(kTile * pb.d_v));
      for (int64_t hh = 0; hh < pb.group && nr > 0; ++hh) {
        const int64_t h = g * pb.group + hh;
        for (int64_t t0 = r_lo; t0 < s_q; t0 += kTile) {
          const int64_t nt = std::min(kTile, s_q - t0);
          load_rows(p.q, q0 + t0, nt, h, pb.fp16, q.data());
          load_rows(bp.dout, q0 + t0, nt, h, pb.fp16, dout.data());
          for (int64_t jl = 0; jl < nj; ++jl) {
            const float* kj = k.data() + jl * pb.d_qk;
            const float* vj = v.data() + jl * pb.d_v;
            for (int64_t r = std::max(pb.first_row_seeing(i, w.row0 + jl), t0); r < t0 + nt; ++r) {
              const int64_t t = q0 + r, rl = r - t0;
              const float* qr = q.data() + rl * pb.d_qk;
              const float* dor = dout.data() + rl * pb.d_v;
              const float pr = std::exp(dot_f32(qr, kj, pb.d_qk) * pb.scale - *elem<const float>(p.lse, t, h));
              const float ds = pr * (dot_f32(dor, vj, pb.d_v) - delta[t * pb.h_q + h]);
              axpy(pr, dor, dv.data() + jl * pb.d_v, pb.d_v);
              axpy(ds, qr, dk.data() + jl * pb.d_qk, pb.d_qk);
            }
          }
        }
      }
      for (float& e : dk) e *= pb.scale;
      for (int64_t jl = 0; jl < nj; ++jl) {
        store_row(bp.dk, k0 + w.row0 + jl, g, dk.data() + jl * pb.d_qk, pb.fp16);
        store_row(bp.dv, k0 + w.row0 + jl, g, dv.data() + jl * pb.d_v, pb.fp16);
      }
    });
  });
}

}  // namespace flashmla::reference
