// Argument lists of the exported operators -> the core's params structs (include/flashmla/ops.h),
// shared by every binding (bindings/tvm_ffi/module.cpp, bindings/torch/ops.cpp), so an argument
// means the same thing on every way in. Each binding passes `ref(tensor, name)`, which converts
// one of its own tensors (or an absent optional: an undefined TensorRef) and names it in errors.
// Argument order is FlashMLA's raw extension's (spec §1.6); outputs, metadata, workspace and
// stream are the binding's business.
#pragma once

#include <cstdint>

#include "flashmla/flashmla.h"

namespace flashmla::bindings {

/// Whether a decode's (b, h_q, s_q) lse takes FlashMLA's transposed layout, strides (s_q * h_q, 1, h_q): its sparse
/// decode returns lse.transpose(1, 2) of a contiguous (b, s_q, h_q) buffer, and its dense decode with h_kv == 1 a
/// view of the same layout (spec §1.3.1, §1.3.2); a dense decode with h_kv > 1 reshapes a transposed view, a copy,
/// so its lse is contiguous. Callers that view lse (lse.transpose(1, 2).view(b, -1), say) rely on these strides.
/// Every binding allocates lse by this rule.
inline bool decode_lse_transposed(const SparseDecodeParams&) { return true; }
inline bool decode_lse_transposed(const DenseDecodeParams& p) { return p.k_cache.shape[2] == 1; }

/// q (b, s_q, h_q, d_qk), k_cache (num_blocks, page_block_size, h_kv, d_qk), block_table, cache_seqlens.
inline DenseDecodeParams dense_decode_params(auto&& ref, const auto& q, const auto& k_cache, const auto& block_table,
                                             const auto& cache_seqlens, int64_t head_dim_v, double softmax_scale,
                                             bool causal) {
  DenseDecodeParams p;
  p.q = ref(q, "q");
  p.k_cache = ref(k_cache, "k_cache");
  p.block_table = ref(block_table, "block_table");
  p.cache_seqlens = ref(cache_seqlens, "cache_seqlens");
  p.head_dim_v = head_dim_v;
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.causal = causal;
  return p;
}

/// q, FP8 k_cache, indices, then the optional topk_length, attn_sink, extra_k_cache,
/// extra_indices_in_kvcache, extra_topk_length.
inline SparseDecodeParams sparse_decode_params(auto&& ref, const auto& q, const auto& k_cache, const auto& indices,
                                               const auto& topk_length, const auto& attn_sink,
                                               const auto& extra_k_cache, const auto& extra_indices_in_kvcache,
                                               const auto& extra_topk_length, int64_t head_dim_v,
                                               double softmax_scale) {
  SparseDecodeParams p;
  p.q = ref(q, "q");
  p.k_cache = ref(k_cache, "k_cache");
  p.indices = ref(indices, "indices");
  p.topk_length = ref(topk_length, "topk_length");
  p.attn_sink = ref(attn_sink, "attn_sink");
  p.extra_k_cache = ref(extra_k_cache, "extra_k_cache");
  p.extra_indices_in_kvcache = ref(extra_indices_in_kvcache, "extra_indices_in_kvcache");
  p.extra_topk_length = ref(extra_topk_length, "extra_topk_length");
  p.head_dim_v = head_dim_v;
  p.softmax_scale = static_cast<float>(softmax_scale);
  return p;
}

/// q (s_q, h_q, d_qk), kv (s_kv, 1, d_qk), indices (s_q, 1, topk), optional attn_sink and topk_length.
inline SparsePrefillParams sparse_prefill_params(auto&& ref, const auto& q, const auto& kv, const auto& indices,
                                                 const auto& attn_sink, const auto& topk_length, double sm_scale,
                                                 int64_t d_v) {
  SparsePrefillParams p;
  p.q = ref(q, "q");
  p.kv = ref(kv, "kv");
  p.indices = ref(indices, "indices");
  p.attn_sink = ref(attn_sink, "attn_sink");
  p.topk_length = ref(topk_length, "topk_length");
  p.sm_scale = static_cast<float>(sm_scale);
  p.d_v = d_v;
  return p;
}

/// q (total_q, h_q, d_qk), k (total_k, h_kv, d_qk), v (total_k, h_kv, d_v), cu_seqlens_qo / cu_seqlens_kv (b + 1,).
inline DensePrefillParams dense_prefill_params(auto&& ref, const auto& q, const auto& k, const auto& v,
                                               const auto& cu_seqlens_qo, const auto& cu_seqlens_kv,
                                               int64_t max_seqlen_qo, int64_t max_seqlen_kv, double softmax_scale,
                                               bool causal) {
  DensePrefillParams p;
  p.q = ref(q, "q");
  p.k = ref(k, "k");
  p.v = ref(v, "v");
  p.cu_seqlens_qo = ref(cu_seqlens_qo, "cu_seqlens_qo");
  p.cu_seqlens_kv = ref(cu_seqlens_kv, "cu_seqlens_kv");
  p.max_seqlen_qo = max_seqlen_qo;
  p.max_seqlen_kv = max_seqlen_kv;
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.causal = causal;
  return p;
}

/// The backward: dout, then the forward's arguments, then its out and lse.
inline DensePrefillBwdParams dense_prefill_bwd_params(auto&& ref, const auto& dout, const auto& q, const auto& k,
                                                      const auto& v, const auto& out, const auto& lse,
                                                      const auto& cu_seqlens_qo, const auto& cu_seqlens_kv,
                                                      int64_t max_seqlen_qo, int64_t max_seqlen_kv,
                                                      double softmax_scale, bool causal) {
  DensePrefillBwdParams p;
  p.fwd = dense_prefill_params(ref, q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale,
                               causal);
  p.fwd.out = ref(out, "out");
  p.fwd.lse = ref(lse, "lse");
  p.dout = ref(dout, "dout");
  return p;
}

}  // namespace flashmla::bindings
