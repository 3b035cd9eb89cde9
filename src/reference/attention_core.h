// src/reference/attention_core.h — pieces shared by the reference operators: strided element access,
// 16-bit row loads / stores, the float32 softmax-attention kernel of spec §2.1, the sink factor, and the
// operators' exception-to-Status guard.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "flashmla/status.h"
#include "flashmla/tensor.h"
#include "reference/numeric.h"

namespace flashmla::reference {

constexpr float kInf = std::numeric_limits<float>::infinity();

/// Pointer to element (i0, i1, ...) of a strided tensor (element strides, spec'd
/// by TensorRef). Offsets are accumulated in int64.
template <typename T, typename... Idx>
inline T* elem(const TensorRef& t, Idx... idx) {
  int64_t off = 0;
  int k = 0;
  ((off += static_cast<int64_t>(idx) * t.stride[k++]), ...);
  return static_cast<T*>(t.data) + off;
}

/// 16-bit float (bf16 or fp16) bits -> float.
inline float half_to_float(uint16_t h, bool is_fp16) { return is_fp16 ? fp16_to_float(h) : bf16_to_float(h); }
/// float -> 16-bit float bits (bf16 or fp16), RNE.
inline uint16_t float_to_half(float f, bool is_fp16) { return is_fp16 ? float_to_fp16(f) : float_to_bf16(f); }

/// Load `n` 16-bit floats spaced `stride` elements apart into `dst` as float.
inline void load_half_row(const uint16_t* src, int64_t stride, int64_t n, bool is_fp16, float* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = half_to_float(src[d * stride], is_fp16);
}
/// Store `n` floats times `factor` as 16-bit floats (RNE) spaced `stride` elements apart at `dst`.
inline void store_half_row(const float* src, float factor, int64_t n, bool is_fp16, uint16_t* dst, int64_t stride) {
  for (int64_t d = 0; d < n; ++d) dst[d * stride] = float_to_half(src[d] * factor, is_fp16);
}

/// float32 dot product. Eight interleaved partial sums (fixed order, so the
/// result is deterministic) let the compiler vectorise without -ffast-math.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[d + k] * b[d + k];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

/// Softmax attention of `num_heads` query rows over `n` gathered keys (spec §2.1),
/// everything in float32:
///   x_j = (q . k_j) * scale,  lse = ln sum_j exp(x_j),  out = sum_j exp(x_j - lse) k_j[0:d_v].
///
/// q          : num_heads x d_qk floats, row-major.
/// load_key   : callable `(int64_t j, float* dst)` writing the d_qk float values of
///              key j; called twice per key (scores pass, then V pass).
/// out        : num_heads x d_v floats — normalised output, sink NOT applied.
/// lse        : num_heads floats, natural log; +inf for a row without keys.
/// max_logit  : num_heads floats (may be null); -inf for a row without keys.
/// A row "without keys" (n == 0, or every score -inf) gets out = 0 exactly.
/// A NaN score (a NaN in the query row or in a key it uses) makes that row's out, lse and
/// max_logit NaN, as the formula gives: the row maximum propagates NaN (std::max would drop it
/// and turn the row into an empty one). An inf in the query row gives scores of +inf and -inf
/// (NaN where the key's element is 0): exp(+inf - +inf) makes the sum, lse and out NaN, and
/// max_logit is NaN too (not the +inf row maximum), so that a row without a defined softmax is NaN
/// in all three, as the GPU kernels write it (row_max_or_nan, src/sm90/common/utils.cuh). A row whose
/// scores are all -inf (an inf in q against keys of one sign in that dimension) stays an empty row.
template <typename LoadKey>
void attend_rows(int64_t num_heads, int64_t d_qk, int64_t d_v, const float* q, float scale, int64_t n,
                 LoadKey&& load_key, float* out, float* lse, float* max_logit) {
  std::fill(out, out + num_heads * d_v, 0.f);
  for (int64_t h = 0; h < num_heads; ++h) {
    lse[h] = kInf;
    if (max_logit) max_logit[h] = -kInf;
  }
  if (n <= 0) return;

  std::vector<float> key(static_cast<size_t>(d_qk));
  std::vector<float> s(static_cast<size_t>(num_heads * n));  // scores, then probabilities
  for (int64_t j = 0; j < n; ++j) {
    load_key(j, key.data());
    for (int64_t h = 0; h < num_heads; ++h) s[h * n + j] = dot_f32(q + h * d_qk, key.data(), d_qk) * scale;
  }

  std::vector<float> row_sum(static_cast<size_t>(num_heads), 0.f);
  std::vector<char> has_keys(static_cast<size_t>(num_heads), 0);
  for (int64_t h = 0; h < num_heads; ++h) {
    float* sh = s.data() + h * n;
    float m = -kInf;
    for (int64_t j = 0; j < n; ++j) m = (sh[j] > m || std::isnan(sh[j])) && !std::isnan(m) ? sh[j] : m;
    if (m == -kInf) continue;  // every score -inf: treated like an empty row (a NaN m is not: it flows on)
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sh[j] = std::exp(sh[j] - m);
      sum += sh[j];
    }
    row_sum[h] = sum;
    has_keys[h] = 1;
    lse[h] = m + std::log(sum);
    if (max_logit) max_logit[h] = std::isnan(lse[h]) ? lse[h] : m;  // +inf max with a NaN lse: NaN
  }

  for (int64_t j = 0; j < n; ++j) {
    load_key(j, key.data());
    for (int64_t h = 0; h < num_heads; ++h) {
      if (!has_keys[h]) continue;
      const float w = s[h * n + j];
      float* oh = out + h * d_v;
      for (int64_t d = 0; d < d_v; ++d) oh[d] += w * key[d];
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    if (!has_keys[h]) continue;
    float* oh = out + h * d_v;
    for (int64_t d = 0; d < d_v; ++d) oh[d] /= row_sum[h];
  }
}

/// Attention-sink factor of spec §2.3: out *= 1 / (1 + exp(sink - lse)).
/// sink = -inf -> 1; sink = +inf -> 0. Only meaningful for rows with keys.
inline float sink_factor(float sink, float lse) { return 1.f / (1.f + std::exp(sink - lse)); }
/// The factor of head h's output row with the optional per-head sinks attn_sink (float32 [h_q]): 1 without
/// sinks, and for a row without keys (lse = +inf: out = 0, lse = +inf whatever the sink, spec §2.3).
inline float row_sink_factor(const TensorRef& attn_sink, int64_t h, float lse) {
  return attn_sink.defined && lse != kInf ? sink_factor(*elem<const float>(attn_sink, h), lse) : 1.f;
}

/// Runs an operator's body fn(), turning an exception into a runtime-error Status that names the
/// operator `what` (out of memory, the exception's message, or unknown).
template <typename Fn>
Status run_guarded(const char* what, Fn&& fn) {
  try {
    fn();
    return Status::Ok();
  } catch (const std::bad_alloc&) {
    return Status::Error(ErrorKind::kRuntime, std::string(what) + " (reference): out of memory");
  } catch (const std::exception& e) {
    return Status::Error(ErrorKind::kRuntime, std::string(what) + " (reference): " + e.what());
  } catch (...) {
    return Status::Error(ErrorKind::kRuntime, std::string(what) + " (reference): unknown error");
  }
}

}  // namespace flashmla::reference
