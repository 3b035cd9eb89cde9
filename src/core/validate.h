// src/core/validate.h — the one place where user-facing input checks live.
//
// Every binding (TVM-FFI, torch stable ABI, C++ users) goes through these
// before any backend runs. Messages name the argument, what was expected and
// what was given; the ErrorKind selects the Python exception class.
#pragma once

#include "flashmla/ops.h"

namespace flashmla::core {

Status validate_dense_decode_inputs(const DenseDecodeParams& p);
Status validate_sparse_decode_inputs(const SparseDecodeParams& p);
Status validate_sparse_prefill_inputs(const SparsePrefillParams& p);
/// Dense MHA prefill: q, k, v, cu_seqlens_qo / cu_seqlens_kv, max_seqlen_*, scale (the outputs are
/// checked by validate_dense_prefill_outputs).
Status validate_dense_prefill_inputs(const DensePrefillParams& p);
/// Its backward: the forward's inputs, its out / lse (read here) and dout.
Status validate_dense_prefill_bwd_inputs(const DensePrefillBwdParams& p);

/// Checks the caller-provided outputs, metadata buffers and workspace against `plan`.
Status validate_decode_outputs(const TensorRef& q, const TensorRef& out, const TensorRef& lse,
                               DType out_dtype, const TensorRef& tile_scheduler_metadata,
                               const TensorRef& num_splits, const DecodePlan& plan,
                               int64_t workspace_bytes, const void* workspace);
Status validate_sparse_prefill_outputs(const SparsePrefillParams& p);
/// out / lse of the forward, workspace against `workspace_bytes_needed`.
Status validate_dense_prefill_outputs(const DensePrefillParams& p, int64_t workspace_bytes_needed);
/// dq / dk / dv of the backward, workspace against `workspace_bytes_needed`.
Status validate_dense_prefill_bwd_outputs(const DensePrefillBwdParams& p, int64_t workspace_bytes_needed);

Status validate_kv_quant_args(KVFormat format, const TensorRef& kv_bf16, const TensorRef& packed);

/// For the operator calls (`<op>_fwd`; not the shapes-only `<op>_plan`, which JAX calls while
/// tracing with no data): every defined tensor argument with elements has data.
Status validate_data(const DenseDecodeParams& p);
Status validate_data(const SparseDecodeParams& p);
Status validate_data(const SparsePrefillParams& p);
Status validate_data(const DensePrefillParams& p);
Status validate_data(const DensePrefillBwdParams& p);
/// For the operator calls, after the outputs are validated: no output (nor the workspace, nor the
/// metadata buffers unless `metadata_ready`) shares memory with an input or another output.
Status validate_no_aliasing(const DenseDecodeParams& p);
Status validate_no_aliasing(const SparseDecodeParams& p);
Status validate_no_aliasing(const SparsePrefillParams& p);
Status validate_no_aliasing(const DensePrefillParams& p);
Status validate_no_aliasing(const DensePrefillBwdParams& p);
/// The FP8 conversions: both tensors have data, and the one written (`packed` when quantizing,
/// `kv_bf16` when dequantizing) has non-negative strides mapping no two elements to one address
/// and shares no memory with the other.
Status validate_kv_quant_data(const TensorRef& kv_bf16, const TensorRef& packed, bool packed_is_output);

}  // namespace flashmla::core
