// src/reference/reference.h — CPU reference backend (the test oracle).
//
// Readable C++ with float32 accumulation, parallel over independent
// (batch, query token) rows with a std::thread pool. Inputs are assumed
// validated by src/core/validate.cpp. Semantics: spec §2.
#pragma once

#include "flashmla/ops.h"

namespace flashmla::reference {

Status dense_decode(const DenseDecodeParams& p);
Status sparse_decode(const SparseDecodeParams& p);
Status sparse_prefill(const SparsePrefillParams& p);
Status dense_prefill_fwd(const DensePrefillParams& p);
Status dense_prefill_bwd(const DensePrefillBwdParams& p);
Status quantize_kv_cache(KVFormat format, const TensorRef& kv_bf16, const TensorRef& packed);
Status dequantize_kv_cache(KVFormat format, const TensorRef& packed, const TensorRef& kv_bf16);

}  // namespace flashmla::reference
