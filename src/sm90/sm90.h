// src/sm90/sm90.h — Hopper (compute capability 9.0, sm_90a) backend entry points.
//
// Only declared when the library is built with CUDA (FLASHMLA_WITH_CUDA).
// Inputs are validated by src/core/validate.cpp before these are called.
#pragma once

#include "flashmla/ops.h"

namespace flashmla::sm90 {

/// True if device `device_id` is compute capability 9.0 and the sm_90a code can run on it.
bool device_supported(int device_id);
int num_sms(int device_id);
/// Float4s per lane (1, 2 or 4) of a split-KV combine launch over `ctas` (request, 8-head)
/// blocks on the current device: the combines split the 512 output dims over grid z (4/J
/// slices) while that grid alone would not give every SM two blocks (src/sm90/common/combine.cu).
int combine_float4s_per_lane(int64_t ctas);

/// Workspace needed by dense decode for the given plan (split-KV partials).
int64_t dense_decode_workspace_bytes(const DenseDecodeParams& p, int64_t num_sm_parts);
/// Dense decode: scheduler metadata (unless metadata_ready), split-KV kernel, combine.
Status dense_decode(const DenseDecodeParams& p, int64_t num_sm_parts);

/// Workspace needed by sparse FP8 decode for the given plan (split-KV partials).
int64_t sparse_decode_workspace_bytes(const SparseDecodeParams& p, int64_t num_sm_parts);
/// Sparse FP8 decode: scheduler metadata (unless metadata_ready), split-KV kernel, combine.
Status sparse_decode(const SparseDecodeParams& p, int64_t num_sm_parts);

/// Sparse prefill (`flash_mla_sparse_fwd`): one kernel, no workspace.
Status sparse_prefill(const SparsePrefillParams& p);

/// Dense MHA prefill (src/sm90/prefill/dense/). Inputs and outputs validated by the core;
/// the GPU code may still return kValue for shapes it has no kernel for.
int64_t dense_prefill_fwd_workspace_bytes(const DensePrefillParams& p);
Status dense_prefill_fwd(const DensePrefillParams& p);
int64_t dense_prefill_bwd_workspace_bytes(const DensePrefillBwdParams& p);
Status dense_prefill_bwd(const DensePrefillBwdParams& p);

}  // namespace flashmla::sm90
