// src/sm90/common/combine_buffers.h — the tensors a split-KV decode combine reads and writes, shared by
// the dense and the sparse FP8 decode combines' parameter structs (a plain struct, host and device).
#pragma once

#include <cstdint>

namespace flashmla::sm90 {

/// A split-KV combine's buffers (filled by set_decode_outputs, common/host_utils.h; strides in
/// elements): out (b, s_q, h_q, 512) in the query's dtype, lse (b, h_q, s_q) float32, the per-split
/// partials o_accum (splits, rows, 512) float32 (O / L) and lse_accum (splits, rows) float32 (base-2
/// log2(L) + m), and num_splits (b + 1) int32, the prefix sums of splits per request.
/// The combine parameter structs derive from it and add their fields after it: the kernels see the
/// same layout as a flat struct with these fields first.
struct CombineBuffers {
  void* out;
  int64_t o_stride_b, o_stride_s, o_stride_h, o_stride_d;
  float* lse;
  int64_t lse_stride_b, lse_stride_h, lse_stride_s;
  const float* o_accum;
  const float* lse_accum;
  const int32_t* num_splits;
};

}  // namespace flashmla::sm90
