// src/reference/sparse_decode.cpp — CPU reference of sparse (top-k) FP8 MLA decode
// (spec §2.3, §3.2-§3.5).
//
//   q                        (b, s_q, h_q, d_qk)        bf16; d_qk 576 -> V32, 512 -> MODEL1
//   k_cache                  (num_blocks, pbs, 1, 656|584) 1-byte elements (block stride = stride(0) bytes)
//   indices                  (b, s_q, topk)             int32 flat token index block*pbs + row, -1 invalid
//   topk_length              optional (b,)              int32: slots p >= topk_length[i] invalid
//   attn_sink                optional (h_q,)            float32, may be +-inf
//   extra_k_cache            optional, same format, own page size
//   extra_indices_in_kvcache optional (b, s_q, extra_topk) int32
//   extra_topk_length        optional (b,)              int32
//   out                      (b, s_q, h_q, 512)         bf16, written
//   lse                      (b, h_q, s_q)              float32, natural log, sink NOT included, written
//
// Per (request i, query token r, head h) the valid main slots followed by the valid
// extra slots form ONE softmax over the dequantized bf16 keys (spec §3.5). Duplicate
// valid indices count once per occurrence. Invalid slots are never dereferenced.
// Sink: out *= 1 / (1 + exp(sink[h] - lse)). No valid slot: out = 0, lse = +inf.
//
// Index validity: spec §2.3 defines -1 (and positions >= topk_length) as invalid and
// leaves other out-of-range values undefined (the GPU kernels would read out of
// bounds). The reference must never crash, so any index < 0 or >= num_blocks * pbs
// is also treated as invalid.
#include <algorithm>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "reference/attention_core.h"
#include "reference/fp8_cache.h"
#include "reference/reference.h"
#include "reference/thread_pool.h"

namespace flashmla::reference {

namespace {

constexpr int64_t kHeadChunk = 16;  // query heads per work item

/// One FP8 cache (main or extra) with its index list.
struct Scope {
  bool present = false;
  uint8_t* base = nullptr;
  int64_t pbs = 0, num_tokens = 0, block_stride = 0, token_stride = 0;
  const TensorRef* indices = nullptr;      ///< (b, s_q, topk) int32
  const TensorRef* topk_length = nullptr;  ///< optional (b,) int32
  int64_t topk = 0;
};

Scope make_scope(const TensorRef& cache, const TensorRef& indices, const TensorRef& topk_length) {
  Scope s;
  if (!cache.defined || !indices.defined) return s;
  s.present = true;
  s.base = static_cast<uint8_t*>(cache.data);
  s.pbs = cache.shape[1];
  s.num_tokens = cache.shape[0] * cache.shape[1];
  s.block_stride = cache.stride[0];  // 1-byte elements: element stride == byte stride
  s.token_stride = cache.stride[1];
  s.indices = &indices;
  s.topk_length = topk_length.defined ? &topk_length : nullptr;
  s.topk = indices.shape[2];
  return s;
}

/// Append the locations of the valid slots of row (i, r) of `s` to `out`.
void collect_valid_slots(const Scope& s, KVFormat fmt, int64_t i, int64_t r, std::vector<Fp8TokenBytes>& out) {
  if (!s.present) return;
  int64_t n = s.topk;
  if (s.topk_length) n = std::clamp<int64_t>(*elem<const int32_t>(*s.topk_length, i), 0, s.topk);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t idx = *elem<const int32_t>(*s.indices, i, r, p);
    if (idx < 0 || idx >= s.num_tokens) continue;  // -1 (spec) or out of range (see header)
    uint8_t* block_base = s.base + (idx / s.pbs) * s.block_stride;
    out.push_back(fp8_token_bytes(fmt, block_base, s.pbs, s.token_stride, idx % s.pbs));
  }
}

}  // namespace

Status sparse_decode(const SparseDecodeParams& p) {
  return run_guarded("sparse_decode", [&] {
    const TensorRef& q = p.q;
    const int64_t b = q.shape[0], s_q = q.shape[1], h_q = q.shape[2], d_qk = q.shape[3];
    const int64_t d_v = kDimV;
    const KVFormat fmt = fp8_format_for_head_dim(d_qk);
    const Scope main_scope = make_scope(p.k_cache, p.indices, p.topk_length);
    const Scope extra_scope = make_scope(p.extra_k_cache, p.extra_indices_in_kvcache, p.extra_topk_length);
    const float scale = p.softmax_scale;
    const int64_t chunks = (h_q + kHeadChunk - 1) / kHeadChunk;

    // Work item = (request i, query token r, chunk of heads).
    parallel_for(b * s_q * chunks, [&](int64_t item) {
      const int64_t c = item % chunks;
      const int64_t r = (item / chunks) % s_q;
      const int64_t i = item / (chunks * s_q);
      const int64_t h_begin = c * kHeadChunk;
      const int64_t nh = std::min(kHeadChunk, h_q - h_begin);

      std::vector<Fp8TokenBytes> slots;  // main slots first, then extra slots: one joint softmax
      collect_valid_slots(main_scope, fmt, i, r, slots);
      collect_valid_slots(extra_scope, fmt, i, r, slots);

      std::vector<float> qf(static_cast<size_t>(nh * d_qk));
      for (int64_t hl = 0; hl < nh; ++hl)
        load_half_row(elem<const uint16_t>(q, i, r, h_begin + hl, 0), q.stride[3], d_qk, false,
                      qf.data() + hl * d_qk);

      auto load_key = [&](int64_t j, float* dst) { fp8_dequant_token(fmt, slots[j], dst); };
      std::vector<float> o(static_cast<size_t>(nh * d_v)), lse(static_cast<size_t>(nh));
      attend_rows(nh, d_qk, d_v, qf.data(), scale, static_cast<int64_t>(slots.size()), load_key, o.data(),
                  lse.data(), nullptr);

      for (int64_t hl = 0; hl < nh; ++hl) {
        const int64_t h = h_begin + hl;
        store_half_row(o.data() + hl * d_v, row_sink_factor(p.attn_sink, h, lse[hl]), d_v, /*is_fp16=*/false,
                       elem<uint16_t>(p.out, i, r, h, 0), p.out.stride[3]);
        *elem<float>(p.lse, i, h, r) = lse[hl];
      }
    });
  });
}

}  // namespace flashmla::reference
