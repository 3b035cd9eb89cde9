// src/reference/sparse_prefill.cpp — CPU reference of sparse MLA prefill,
// `flash_mla_sparse_fwd` (spec §2.4).
//
//   q            (s_q, h_q, d_qk)   bf16, d_qk in {512, 576}
//   kv           (s_kv, 1, d_qk)    bf16; V = kv[..., :512]
//   indices      (s_q, 1, topk)     int32
//   attn_sink    optional (h_q,)    float32, may be +-inf
//   topk_length  optional (s_q,)    int32, per query token
//   out          (s_q, h_q, 512)    bf16, written
//   max_logits   (s_q, h_q)         float32, natural units, -inf for empty rows, written
//   lse          (s_q, h_q)         float32, natural log (sink NOT included), +inf for empty rows, written
//
// Slot p of query s is invalid iff idx < 0, idx >= s_kv, or (topk_length given and
// p >= topk_length[s]); invalid slots are never dereferenced.
//   P_p = (q . kv[idx_p]) * sm_scale,  max_logits = max P,  lse = ln sum exp(P),
//   out = sum exp(P - lse') kv[idx_p, :512],  lse' = ln(exp(lse) + exp(sink))
// i.e. out = softmax(P) V / (1 + exp(sink - lse)). Empty rows: out 0, lse +inf,
// max_logits -inf regardless of the sink.
#include <algorithm>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "reference/attention_core.h"
#include "reference/reference.h"
#include "reference/thread_pool.h"

namespace flashmla::reference {

namespace {
constexpr int64_t kHeadChunk = 16;  // query heads per work item
}  // namespace

Status sparse_prefill(const SparsePrefillParams& p) {
  return run_guarded("sparse_prefill", [&] {
    const TensorRef& q = p.q;
    const TensorRef& kv = p.kv;
    const int64_t s_q = q.shape[0], h_q = q.shape[1], d_qk = q.shape[2];
    const int64_t s_kv = kv.shape[0];
    const int64_t topk = p.indices.shape[2];
    const int64_t d_v = kDimV;
    const float scale = p.sm_scale;
    const int64_t chunks = (h_q + kHeadChunk - 1) / kHeadChunk;

    // Work item = (query token s, chunk of heads).
    parallel_for(s_q * chunks, [&](int64_t item) {
      const int64_t c = item % chunks;
      const int64_t s = item / chunks;
      const int64_t h_begin = c * kHeadChunk;
      const int64_t nh = std::min(kHeadChunk, h_q - h_begin);

      int64_t n_slots = topk;
      if (p.topk_length.defined) n_slots = std::clamp<int64_t>(*elem<const int32_t>(p.topk_length, s), 0, topk);
      std::vector<int64_t> rows;  // kv rows of the valid slots, in slot order
      rows.reserve(static_cast<size_t>(n_slots));
      for (int64_t slot = 0; slot < n_slots; ++slot) {
        const int64_t idx = *elem<const int32_t>(p.indices, s, 0, slot);
        if (idx >= 0 && idx < s_kv) rows.push_back(idx);
      }

      std::vector<float> qf(static_cast<size_t>(nh * d_qk));
      for (int64_t hl = 0; hl < nh; ++hl)
        load_half_row(elem<const uint16_t>(q, s, h_begin + hl, 0), q.stride[2], d_qk, false, qf.data() + hl * d_qk);

      auto load_key = [&](int64_t j, float* dst) {
        load_half_row(elem<const uint16_t>(kv, rows[j], 0, 0), kv.stride[2], d_qk, false, dst);
      };
      std::vector<float> o(static_cast<size_t>(nh * d_v)), lse(static_cast<size_t>(nh)), mx(static_cast<size_t>(nh));
      attend_rows(nh, d_qk, d_v, qf.data(), scale, static_cast<int64_t>(rows.size()), load_key, o.data(),
                  lse.data(), mx.data());

      for (int64_t hl = 0; hl < nh; ++hl) {
        const int64_t h = h_begin + hl;
        store_half_row(o.data() + hl * d_v, row_sink_factor(p.attn_sink, h, lse[hl]), d_v, /*is_fp16=*/false,
                       elem<uint16_t>(p.out, s, h, 0), p.out.stride[2]);
        *elem<float>(p.max_logits, s, h) = mx[hl];
        *elem<float>(p.lse, s, h) = lse[hl];
      }
    });
  });
}

}  // namespace flashmla::reference
