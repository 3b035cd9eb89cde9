// flashmla/ops.h — the MLA operators of the core library.
//
// Every operator takes one parameter struct of non-owning TensorRefs and returns
// a Status; it never throws, never allocates device memory and never
// synchronises the stream. Inputs are validated in one place (the core's validation)
// before dispatch to a backend chosen by the device of `q`:
//   CPU  -> reference backend (src/reference/, float32 accumulation, multithreaded)
//   CUDA -> sm90 backend (src/sm90/) when built with CUDA and the device is
//           compute capability 9.0; otherwise kNotImplemented.
//
// Calling sequence used by every binding:
//   1. fill the inputs of the params struct;
//   2. call `<op>_plan(params, &plan)`: validates the inputs (only: the output fields may still be
//      empty) and returns the sizes of the buffers the caller must provide (outputs, metadata,
//      workspace; on the CPU every workspace size is 0);
//   3. allocate them on the device of `q`, fill the output fields;
//   4. call `<op>_fwd(params)`.
//
// Errors (every function returns a Status, never throws):
//   kType           a tensor has the wrong dtype;
//   kValue          wrong shape / rank / head dim, non-contiguous last dim, tensors on
//                   different devices, h_q % h_kv != 0, non-finite scale, and — for CPU
//                   tensors, where values are cheap to read — cache_seqlens / block_table /
//                   index values out of range or a block table too short; outputs, metadata
//                   or workspace that do not match the plan; a TensorRef with a negative size,
//                   an unknown device type or ndim == kInvalidTensorDims (make_tensor_ref with
//                   too many dims or a stride list of another length) or a data pointer that is not a
//                   multiple of its element size (a byte offset into a buffer); in `<op>_fwd` only (the
//                   plans also take shapes-only refs), a null `data` for a tensor with elements,
//                   and outputs with negative strides or two elements at one address;
//   kNotImplemented valid input on a device without a backend (no CUDA build, not sm_90);
//   kRuntime        CUDA launch / runtime failures (fwd only).
//   Also kValue: a null `plan` / `workspace_bytes` pointer, sizes or strides whose element
//   count or byte offsets overflow int64, an unset scale (the NaN default), and in `<op>_fwd` an
//   output (or the workspace, or metadata being computed) whose memory range overlaps an input
//   or another output: outputs are written while inputs are read, so every output must be its
//   own buffer.
// Messages name the argument, what was expected and what was given.
//
// Streams and devices: `stream` is the cudaStream_t the GPU work is queued on (nullptr: the
// device's legacy default stream); the call makes the device of `q` current and restores the
// previous device before it returns. CPU calls are synchronous and ignore `stream`.
//
// Threads and memory: the operators keep no state between calls; concurrent calls from several
// threads are safe when they write different outputs and no thread writes their inputs meanwhile (a CPU
// call validates the integer inputs -- lengths, block tables, indices -- and then reads them again, so a
// value another thread changes in between is not reported and may be read out of range). A CPU call computes on
// `reference_num_threads()` std::threads started for the call (see there) and
// allocates host scratch memory; out of host memory gives kRuntime. GPU calls allocate nothing.
//
// Never read (so they may hold anything, NaN included): K/V tokens at or past a request's
// `cache_seqlens` and block-table entries past its last used page (dense decode); index slots
// at or past `topk_length` or equal to -1 and the tokens they would name (sparse decode); slots
// with an index < 0 or >= s_kv or at or past `topk_length` (sparse prefill); FP8 padding bytes.
// On the CPU the scheduler metadata (`tile_scheduler_metadata`, `num_splits`) is computed as
// specified but the reference computes each row directly; on the GPU the kernels follow it.
//
// GPU layout requirements: dense decode needs `q` and `k_cache` bases and non-last strides that
// are multiples of 16 bytes (kValue otherwise); sparse decode and prefill accept any alignment
// (unaligned tensors take slower kernels); `workspace` must be 16-byte aligned.
//
// Semantics follow FlashMLA (github.com/deepseek-ai/FlashMLA) at commit 9241ae3. "spec §N" below
// names the section of FlashMLA's behaviour that a statement reproduces; docs/README.md lists the
// sections and the FlashMLA files they come from. What a caller needs is stated in these comments.
#pragma once

#include <cstdint>
#include <limits>

#include "flashmla/kv_format.h"
#include "flashmla/status.h"
#include "flashmla/tensor.h"

namespace flashmla {

/// One row of `tile_scheduler_metadata` (spec §4.3): the slice of the
/// (request, 64-token block) work list given to one SM partition.
struct TileSchedulerMetadataRow {
  int32_t begin_req_idx;          ///< first request
  int32_t end_req_idx;            ///< last request (inclusive)
  int32_t begin_block_idx;        ///< first block of the first request (inclusive)
  int32_t end_block_idx;          ///< last block of the last request (exclusive)
  int32_t begin_split_idx;        ///< split index of the first request's first piece
  int32_t is_first_req_splitted;  ///< first request shared with another partition
  int32_t is_last_req_splitted;   ///< last request shared with another partition
  int32_t pad;
};
static_assert(sizeof(TileSchedulerMetadataRow) == 32, "metadata row is 8 int32");
constexpr int kTileSchedulerMetadataWidth = 8;

/// What a caller must allocate before `<op>_fwd` (all on the device of `q`).
struct DecodePlan {
  int64_t num_sm_parts = 0;     ///< rows of tile_scheduler_metadata: (num_sm_parts, 8) int32
  int64_t num_splits_len = 0;   ///< length of num_splits: b + 1, int32
  int64_t workspace_bytes = 0;  ///< size of `workspace` (split-KV partials), may be 0
};

// ---------------------------------------------------------------------------
// Dense decode over a paged BF16/FP16 KV cache (spec §1.3.1, §2.2, §3.1).
// ---------------------------------------------------------------------------
struct DenseDecodeParams {
  TensorRef q;              ///< (b, s_q, h_q, d_qk) bf16|fp16, last dim contiguous; d_qk in {512, 576};
                            ///< b, s_q, h_q > 0 (kValue otherwise: decode has no empty form, unlike the prefills)
  TensorRef k_cache;        ///< (num_blocks, page_block_size, h_kv, d_qk), dtype of q, last dim contiguous
  TensorRef block_table;    ///< (b, max_blocks_per_seq) int32, last dim contiguous
  TensorRef cache_seqlens;  ///< (b,) int32, contiguous; 0 is legal (out 0, lse +inf)
  int64_t head_dim_v = kDimV;  ///< must be 512; V = k_cache[..., :512]
  /// Multiplies q.k; must be set (the NaN default is rejected as "not set"). FlashMLA's Python
  /// default is d_qk^-0.5 (the bindings apply it); 0 is legal (uniform weights over the valid keys).
  float softmax_scale = std::numeric_limits<float>::quiet_NaN();
  bool causal = false;         ///< bottom-right aligned causal mask; ignored when s_q == 1

  /// Split-KV scheduler metadata (spec §4): (num_sm_parts, 8) int32 and (b+1,) int32, num_sm_parts from
  /// DecodePlan (on the CPU it is the reference backend's thread count at plan time, so
  /// set_reference_num_threads with another count makes earlier metadata the wrong shape; a CPU call that
  /// computes the metadata, metadata_ready false, fills a buffer of any (rows >= 1, 8) shape).
  /// If `metadata_ready` is false the op computes them (on the op's stream)
  /// into these buffers; otherwise it reads them as computed by an earlier call
  /// with identical shapes and cache_seqlens. The shapes are checked; the contents are not: on the GPU
  /// the split of every request's key blocks among the SM parts is read from them, so with metadata computed
  /// for other cache_seqlens the result is unspecified; the CPU reference does not read the metadata.
  /// (The Python layer checks the lengths it was computed for: SchedMetaMismatchError.)
  TensorRef tile_scheduler_metadata;
  TensorRef num_splits;
  bool metadata_ready = false;

  TensorRef out;  ///< (b, s_q, h_q, 512), dtype of q, written
  TensorRef lse;  ///< (b, h_q, s_q) float32, natural log, +inf for rows with no key, written (any non-overlapping strides)

  void* workspace = nullptr;    ///< DecodePlan::workspace_bytes bytes on the device of q
  int64_t workspace_bytes = 0;
  void* stream = nullptr;       ///< cudaStream_t for CUDA tensors; ignored on CPU
};
/// Validates the inputs and fills `plan` (num_sm_parts from the device's SM count, spec §4.1).
Status dense_decode_plan(const DenseDecodeParams& p, DecodePlan* plan);
/// The same sizes from shapes alone, for callers that must allocate before they
/// hold any tensor (XLA custom calls traced under jax.jit): b, s_q, h_q of q and
/// h_kv of k_cache on `device`. Errors: kValue for non-positive sizes, h_q % h_kv != 0,
/// b >= 2^31 or b * s_q * h_q * 4096 >= 2^60, or a null `plan`; kNotImplemented for a GPU
/// without the sm90 backend.
Status dense_decode_plan_for_shapes(Device device, int64_t b, int64_t s_q, int64_t h_q, int64_t h_kv,
                                    DecodePlan* plan);
/// Validates inputs and outputs, computes the metadata unless `metadata_ready`, writes out/lse.
/// Asynchronous on `p.stream` for CUDA tensors; synchronous on the CPU.
Status dense_decode_fwd(const DenseDecodeParams& p);

// ---------------------------------------------------------------------------
// Sparse (top-k) decode over an FP8 KV cache (spec §1.3.2, §2.3, §3.2-§3.4).
// ---------------------------------------------------------------------------
struct SparseDecodeParams {
  TensorRef q;        ///< (b, s_q, h_q, d_qk) bf16; d_qk 576 -> V32 format, 512 -> MODEL1; b, s_q, h_q > 0
  TensorRef k_cache;  ///< (num_blocks, page_block_size, 1, 656|584) 1-byte dtype, stride(1) == 656|584 (tokens
                      ///< packed), stride(0) >= page_block_size * 656|584 (blocks do not overlap),
                      ///< num_blocks * page_block_size < 2^31 (token indices are int32); kValue otherwise
  TensorRef indices;  ///< (b, s_q, topk) int32: flat token index block*pbs+row, -1 = invalid
  TensorRef topk_length;  ///< optional (b,) int32: slots >= topk_length[i] are invalid; values > topk act as
                          ///< topk; a negative value is rejected on the CPU (kValue) and acts as 0 on the GPU
                          ///< (whose values the host does not read)
  TensorRef attn_sink;    ///< optional (h_q,) float32 (may hold +-inf; NaN gives NaN rows, as in FlashMLA):
                          ///< out *= 1/(1+exp(sink-lse))
  TensorRef extra_k_cache;           ///< optional second FP8 cache, same format, any page size
  TensorRef extra_indices_in_kvcache;  ///< optional (b, s_q, extra_topk) int32 into extra_k_cache
  TensorRef extra_topk_length;       ///< optional (b,) int32: as topk_length, for extra_indices_in_kvcache
  int64_t head_dim_v = kDimV;        ///< must be 512
  float softmax_scale = std::numeric_limits<float>::quiet_NaN();  ///< as in DenseDecodeParams

  TensorRef tile_scheduler_metadata;  ///< as in DenseDecodeParams
  TensorRef num_splits;
  bool metadata_ready = false;

  TensorRef out;  ///< (b, s_q, h_q, 512) bf16, written
  TensorRef lse;  ///< (b, h_q, s_q) float32, natural log (sink not included), +inf for rows with no valid slot
                  ///< (out 0 there), written

  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  void* stream = nullptr;
};
/// As dense_decode_plan; num_sm_parts per spec §4.1's sparse rule.
Status sparse_decode_plan(const SparseDecodeParams& p, DecodePlan* plan);
/// Shapes-only form of sparse_decode_plan (see dense_decode_plan_for_shapes).
Status sparse_decode_plan_for_shapes(Device device, int64_t b, int64_t s_q, int64_t h_q, DecodePlan* plan);
/// As dense_decode_fwd; per-request work for the scheduler per spec §4.2.
Status sparse_decode_fwd(const SparseDecodeParams& p);

// ---------------------------------------------------------------------------
// Sparse prefill, `flash_mla_sparse_fwd` (spec §1.4, §2.4).
// ---------------------------------------------------------------------------
struct SparsePrefillParams {
  TensorRef q;        ///< (s_q, h_q, d_qk) bf16, d_qk in {512, 576}, last dim contiguous
  TensorRef kv;       ///< (s_kv, 1, d_qk) bf16, last dim contiguous
  TensorRef indices;  ///< (s_q, 1, topk) int32; slot invalid iff idx < 0 or idx >= s_kv
  TensorRef attn_sink;    ///< optional (h_q,) float32
  TensorRef topk_length;  ///< optional (s_q,) int32: per query token, slots >= topk_length[i] are invalid;
                          ///< values > topk act as topk; a negative value is rejected on the CPU (kValue) and
                          ///< acts as 0 on the GPU (whose values the host does not read)
  float sm_scale = std::numeric_limits<float>::quiet_NaN();  ///< must be set (no default, as FlashMLA)
  int64_t d_v = kDimV;  ///< must be 512

  TensorRef out;         ///< (s_q, h_q, 512) bf16, written
  TensorRef max_logits;  ///< (s_q, h_q) float32, max over valid keys of sm_scale * q.k, -inf for empty rows
  TensorRef lse;         ///< (s_q, h_q) float32, natural log, +inf for empty rows

  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  void* stream = nullptr;
};
/// Validates inputs; `*workspace_bytes` receives the workspace size needed.
Status sparse_prefill_plan(const SparsePrefillParams& p, int64_t* workspace_bytes);
/// Validates inputs and outputs, writes out / max_logits / lse (asynchronous on `p.stream` on the GPU).
Status sparse_prefill_fwd(const SparsePrefillParams& p);

// ---------------------------------------------------------------------------
// Dense MHA prefill (`flash_attn_varlen_func`, spec §1.5, §2.5): varlen multi-head attention,
// GQA (h_q a multiple of h_kv), bottom-right-aligned causal mask, natural-log lse.
// The packed-sequence arguments carry FlashMLA's public names (cu_seqlens_qo / cu_seqlens_kv,
// max_seqlen_qo / max_seqlen_kv), and so do the error messages that name them.
// Packed sequences: request i owns rows [cu_seqlens_qo[i], cu_seqlens_qo[i+1]) of q / out / lse
// and rows [cu_seqlens_kv[i], cu_seqlens_kv[i+1]) of k / v. Key j of a request is visible to its
// query i iff !causal or j <= i + s_k - s_q (s_q, s_k that request's lengths). A query row with
// no visible key (s_k == 0, or causal with i + s_k - s_q < 0) gives out = 0 and lse = -inf
// (what torch's logsumexp gives for an all-masked row, and what FlashMLA's SM100 kernel writes for
// a fully masked tile; spec §2.6 leaves it untested), and zero gradients. A NaN in q, or in a key
// or value the row sees, gives NaN in that row; keys a row does not see are never read.
// Supported (d_qk, d_v): (128, 128) and (192, 128) on every backend; other pairs are kValue
// "no kernel for d_qk=… d_v=…" (outputs untouched).
// cu_seqlens_* are contiguous int32 tensors of b + 1 >= 2 entries on the device of q. For CPU
// tensors their values are checked (kValue): start 0, non-decreasing, last entry == total_q
// (total_k), every length <= max_seqlen_*. On the GPU they are not read back: values that break
// these rules leave rows unwritten or read out of bounds, as in FlashMLA / FlashAttention.
// FlashMLA's is_varlen = false (every request total / b tokens) is cu_seqlens = i * (total / b).
// GPU tensors (q, k, v, dout and the 16-bit outputs) need 16-byte aligned bases and non-last
// strides (kValue otherwise); lse may have any strides.
// ---------------------------------------------------------------------------
struct DensePrefillParams {
  TensorRef q;  ///< (total_q, h_q, d_qk) bf16 or fp16, last dim contiguous; d_qk in {128, 192}
  TensorRef k;  ///< (total_k, h_kv, d_qk) dtype of q, last dim contiguous
  TensorRef v;  ///< (total_k, h_kv, d_v) dtype of q, last dim contiguous; d_v == 128
  TensorRef cu_seqlens_qo;  ///< (b + 1,) int32, non-decreasing from 0 to total_q
  TensorRef cu_seqlens_kv;  ///< (b + 1,) int32, non-decreasing from 0 to total_k
  int64_t max_seqlen_qo = 0;  ///< >= every request's s_q (upper bound used for the launch grid)
  int64_t max_seqlen_kv = 0;  ///< >= every request's s_k
  float softmax_scale = std::numeric_limits<float>::quiet_NaN();  ///< must be set (finite)
  bool causal = false;

  TensorRef out;  ///< (total_q, h_q, d_v) dtype of q, written
  TensorRef lse;  ///< (total_q, h_q) float32, natural log, written (any strides, e.g. FlashMLA's (1, total_q))

  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  void* stream = nullptr;
};
/// Validates inputs; `*workspace_bytes` receives the workspace size the forward needs.
Status dense_prefill_plan(const DensePrefillParams& p, int64_t* workspace_bytes);
/// Validates inputs and outputs, writes out / lse (asynchronous on `p.stream` on the GPU).
Status dense_prefill_fwd(const DensePrefillParams& p);

/// Backward of dense_prefill_fwd: the forward's inputs and outputs plus dout; writes dq, dk, dv.
/// The gradient through lse is not propagated (as FlashMLA). Deterministic: dk / dv (and dq) are
/// bitwise equal across runs on the same inputs. With P = exp(q.k * scale - lse) from the given lse
/// and D = dout . out from the given out: dv = P^T dout, dS = P * (dout v^T - D),
/// dq = scale * dS k, dk = scale * dS^T q (dk / dv summed over the query heads of a KV head).
/// `fwd.workspace`, `fwd.workspace_bytes` and `fwd.stream` are not used (the fields below are).
struct DensePrefillBwdParams {
  DensePrefillParams fwd;  ///< q, k, v, cu_seqlens, max_seqlen, scale, causal; out and lse as the forward wrote them
  TensorRef dout;  ///< (total_q, h_q, d_v) dtype of q, last dim contiguous
  TensorRef dq;    ///< (total_q, h_q, d_qk) dtype of q, written
  TensorRef dk;    ///< (total_k, h_kv, d_qk) dtype of q, written
  TensorRef dv;    ///< (total_k, h_kv, d_v) dtype of q, written

  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  void* stream = nullptr;
};
/// Validates inputs; `*workspace_bytes` receives the workspace size the backward needs.
Status dense_prefill_bwd_plan(const DensePrefillBwdParams& p, int64_t* workspace_bytes);
/// Validates inputs and outputs, writes dq / dk / dv.
Status dense_prefill_bwd(const DensePrefillBwdParams& p);

// ---------------------------------------------------------------------------
// FP8 KV-cache conversion (spec §3.5), CPU tensors only.
// ---------------------------------------------------------------------------
/// Quantize a bf16 cache `(num_blocks, pbs, 1, d)` (d = 576 for kFP8V32, 512 for
/// kFP8Model1) into `packed` `(num_blocks, pbs, 1, 656|584)` 1-byte elements with
/// stride(1) == bytes per token and any block stride >= pbs * bytes per token.
/// Bit-exact to FlashMLA's tests/quant.py (UE8M0 power-of-two scales, RNE e4m3).
Status quantize_kv_cache(KVFormat format, const TensorRef& kv_bf16, const TensorRef& packed);
/// Inverse: packed bytes -> bf16 `(num_blocks, pbs, 1, d)`.
/// Both run on CPU tensors only (kNotImplemented otherwise); other errors as listed at the top
/// (kType for dtypes, kValue for shapes, null data, or an output whose elements overlap).
Status dequantize_kv_cache(KVFormat format, const TensorRef& packed, const TensorRef& kv_bf16);

// ---------------------------------------------------------------------------
// Backend information.
// ---------------------------------------------------------------------------
/// True if this build contains the sm90 CUDA backend.
bool has_cuda_backend();
/// Number of SMs of a CUDA device (CPU: number of reference worker threads).
int num_sms(Device d);
/// Number of worker threads used by the reference backend: the value of the last
/// set_reference_num_threads(n > 0), else the environment variable FLASHMLA_NUM_THREADS as it was
/// at the first call of this function (read once per process; a value that is not a positive
/// integer is reported once on stderr, naming it, and ignored), else
/// std::thread::hardware_concurrency(). At most 1024.
int reference_num_threads();
/// Sets the reference backend's thread count for later CPU calls of this process (n > 1024 acts as
/// 1024); n <= 0 returns to the default above. Thread-safe; calls in flight keep their count. It is also
/// the CPU's num_sms, hence the num_sm_parts of later CPU decode plans: metadata made before a change of
/// count no longer has the shape those calls expect when given as ready (a call computing its metadata takes
/// any row count, so a count changed between a binding's plan and its call is harmless).
void set_reference_num_threads(int n);

}  // namespace flashmla
