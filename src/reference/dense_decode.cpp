// src/reference/dense_decode.cpp — CPU reference of dense paged MLA decode (spec §2.2, §3.1).
//
//   q             (b, s_q, h_q, d_qk)              bf16 | fp16, d_qk in {512, 576}
//   k_cache       (num_blocks, pbs, h_kv, d_qk)    dtype of q, any page_block_size pbs
//   block_table   (b, max_blocks_per_seq)          int32
//   cache_seqlens (b,)                             int32
//   out           (b, s_q, h_q, 512)               dtype of q (RNE), written
//   lse           (b, h_q, s_q)                    float32, natural log, written
//
// For (request i, query token r, head h): KV head g = h / (h_q / h_kv); keys
// t in [0, cache_seqlens[i]) live at k_cache[block_table[i][t / pbs], t % pbs, g, :].
// Causal (only when causal && s_q > 1) is bottom-right aligned: key t is visible
// iff t <= s_k - s_q + r. V = K[..., :512]. Rows without a visible key: out = 0,
// lse = +inf. Tokens >= cache_seqlens[i] and block-table entries past the last
// used page are never read (they hold NaN / the 2147480000 sentinel in tests).
// Every tensor, outputs included, is accessed through its strides.
// The split-KV scheduler metadata fields are not touched (the core fills them).
#include <algorithm>
#include <exception>
#include <new>
#include <vector>

#include "reference/attention_core.h"
#include "reference/reference.h"
#include "reference/thread_pool.h"

namespace flashmla::reference {

namespace {
constexpr int64_t kHeadChunk = 16;  // query heads per work item (bounds scratch, adds parallelism)
}  // namespace

Status dense_decode(const DenseDecodeParams& p) {
  return run_guarded("dense_decode", [&] {
    const TensorRef& q = p.q;
    const TensorRef& kc = p.k_cache;
    const int64_t b = q.shape[0], s_q = q.shape[1], h_q = q.shape[2], d_qk = q.shape[3];
    const int64_t pbs = kc.shape[1], h_kv = kc.shape[2];
    const int64_t d_v = kDimV;
    const int64_t group = h_q / h_kv;  // query heads per KV head (GQA)
    const int64_t chunks_per_group = (group + kHeadChunk - 1) / kHeadChunk;
    const bool is_fp16 = q.dtype == DType::kFloat16;
    const bool causal = p.causal && s_q > 1;  // spec §2.2: causal is ignored for s_q == 1
    const float scale = p.softmax_scale;

    // Work item = (request i, query token r, KV head g, chunk of that group's heads).
    const int64_t num_items = b * s_q * h_kv * chunks_per_group;
    parallel_for(num_items, [&](int64_t item) {
      const int64_t c = item % chunks_per_group;
      const int64_t g = (item / chunks_per_group) % h_kv;
      const int64_t r = (item / (chunks_per_group * h_kv)) % s_q;
      const int64_t i = item / (chunks_per_group * h_kv * s_q);
      const int64_t h_begin = g * group + c * kHeadChunk;
      const int64_t nh = std::min(kHeadChunk, (g + 1) * group - h_begin);

      // Number of visible keys: [0, s_k), shortened by the bottom-right causal mask.
      const int64_t s_k = std::max<int64_t>(0, *elem<const int32_t>(p.cache_seqlens, i));
      int64_t n_vis = s_k;
      if (causal) n_vis = std::clamp<int64_t>(s_k - s_q + r + 1, 0, s_k);

      std::vector<float> qf(static_cast<size_t>(nh * d_qk));
      for (int64_t hl = 0; hl < nh; ++hl)
        load_half_row(elem<const uint16_t>(q, i, r, h_begin + hl, 0), q.stride[3], d_qk, is_fp16,
                      qf.data() + hl * d_qk);

      // Key t of request i: page block_table[i][t / pbs], row t % pbs, KV head g.
      auto load_key = [&](int64_t t, float* dst) {
        const int64_t block = *elem<const int32_t>(p.block_table, i, t / pbs);
        load_half_row(elem<const uint16_t>(kc, block, t % pbs, g, 0), kc.stride[3], d_qk, is_fp16, dst);
      };

      std::vector<float> o(static_cast<size_t>(nh * d_v)), lse(static_cast<size_t>(nh));
      attend_rows(nh, d_qk, d_v, qf.data(), scale, n_vis, load_key, o.data(), lse.data(), nullptr);

      for (int64_t hl = 0; hl < nh; ++hl) {
        const int64_t h = h_begin + hl;
        store_half_row(o.data() + hl * d_v, 1.f, d_v, is_fp16, elem<uint16_t>(p.out, i, r, h, 0), p.out.stride[3]);
        *elem<float>(p.lse, i, h, r) = lse[hl];
      }
    });
  });
}

}  // namespace flashmla::reference
