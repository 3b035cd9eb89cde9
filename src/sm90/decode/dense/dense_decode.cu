// src/sm90/decode/dense/dense_decode.cu — host side of the sm90 backend: device queries and
// the dense-decode entry points of src/sm90/sm90.h (scheduler -> split-KV main
// kernel -> combine, all on the caller's stream, no synchronisation, no allocation).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "sm90/common/host_utils.h"
#include "sm90/decode/dense/dense_decode.h"
#include "sm90/sm90.h"

namespace flashmla::sm90 {

// The main kernel `kernel` (never kAuto) for one dtype (instantiations_bf16.cu / _fp16.cu).
cudaError_t launch_dense_main_bf16(const DenseDecodeKernelParams& kp, const CUtensorMap* tmap, int num_sm_parts,
                                   DenseKernel kernel, cudaStream_t stream);
cudaError_t launch_dense_main_fp16(const DenseDecodeKernelParams& kp, const CUtensorMap* tmap, int num_sm_parts,
                                   DenseKernel kernel, cudaStream_t stream);
cudaError_t probe_sm90_image();

DenseKernel choose_dense_kernel(int64_t m_rows, bool k_tensor_map) {
  if (k_tensor_map) return DenseKernel::kSeesaw;
  return m_rows > 32 ? DenseKernel::kWgmma : DenseKernel::kMmaSync;
}

namespace {

Status cuda_error(const char* what, cudaError_t e) { return cuda_error_status("flash_mla dense decode", what, e); }


struct Dims {
  int64_t b, s_q, h_q, d_qk, h_kv, pbs, group, m_rows;
};

Dims dims_of(const DenseDecodeParams& p) {
  Dims d;
  d.b = p.q.shape[0];
  d.s_q = p.q.shape[1];
  d.h_q = p.q.shape[2];
  d.d_qk = p.q.shape[3];
  d.pbs = p.k_cache.shape[1];
  d.h_kv = p.k_cache.shape[2];
  d.group = d.h_q / d.h_kv;
  d.m_rows = d.s_q * d.group;
  return d;
}

// The shape fields that the main kernel's and the combine's parameters share (DenseDecodeKernelParams,
// DenseCombineParams): batch, query length and heads, KV heads, query heads per KV head, and the
// query rows per KV head (s_q * group).
template <class Params>
void set_decode_dims(Params& kp, const Dims& d) {
  kp.b = static_cast<int>(d.b);
  kp.s_q = static_cast<int>(d.s_q);
  kp.h_q = static_cast<int>(d.h_q);
  kp.h_kv = static_cast<int>(d.h_kv);
  kp.group = static_cast<int>(d.group);
  kp.m_rows = static_cast<int>(d.m_rows);
}

constexpr int64_t kAlign = 256;
int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int64_t lse_accum_bytes(const Dims& d, int64_t num_sm_parts) {
  return align_up((d.b + num_sm_parts) * d.h_kv * d.m_rows * static_cast<int64_t>(sizeof(float)));
}

// Tensor map of k_cache for the seesaw kernel: dims (d_qk, h_kv, page_block_size, num_blocks),
// box 64 dims x 1 head x min(pbs, 64) tokens x 1 page, 128-byte swizzle (= the kernels'
// slab layout). False when the strides or the page size do not allow it.
bool make_k_tensor_map(const DenseDecodeParams& p, const Dims& d, CUtensorMap* map, int* box_tok) {
  const TensorRef& k = p.k_cache;
  const int64_t pbs = d.pbs;
  if (!(pbs % 64 == 0 || (64 % pbs == 0 && pbs >= 16))) return false;  // <= 4 boxes per slab
  if (d.d_qk != 576 && d.d_qk != 512) return false;
  if (reinterpret_cast<uintptr_t>(k.data) % 16 != 0) return false;
  const int64_t s_tok = k.stride[1], s_h = k.stride[2], s_blk = k.stride[0];
  for (int64_t st : {s_tok, s_h, s_blk})
    if (st <= 0 || (st * 2) % 16 != 0 || st * 2 >= (int64_t{1} << 40)) return false;
  if (k.stride[3] != 1) return false;
  if (k.shape[0] <= 0 || k.shape[0] > 0xFFFFFFFFLL) return false;
  EncodeTiledFn fn = encode_tiled_fn();
  if (fn == nullptr) return false;
  const int bt = static_cast<int>(pbs < 64 ? pbs : 64);
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d.d_qk), static_cast<cuuint64_t>(d.h_kv),
                              static_cast<cuuint64_t>(pbs), static_cast<cuuint64_t>(k.shape[0])};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(s_h * 2), static_cast<cuuint64_t>(s_tok * 2),
                                 static_cast<cuuint64_t>(s_blk * 2)};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(bt), 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  std::memset(map, 0, sizeof(*map));
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(k.data), dims, strides, box, estr,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;
  *box_tok = bt;
  return true;
}

// Rows of out can be written by 16-byte-aligned bulk copies (the seesaw kernel's epilogue).
bool out_bulk_ok(const TensorRef& out) {  // out is bf16 / fp16 (q's dtype)
  return out.stride[3] == 1 && rows_16b_aligned(out, 3);
}

}  // namespace

namespace {
// Per-device answers of the two queries below, computed once: every call plans with them
// (host overhead budget of a tiny decode is a few µs; the probes cost more than that).
constexpr int kMaxCachedDevices = 64;
std::atomic<int> g_supported[kMaxCachedDevices];  // 0 unknown, 1 yes, 2 no
std::atomic<int> g_num_sms[kMaxCachedDevices];    // 0 unknown

bool probe_device_supported(int device_id) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_id) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_id) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major != 9 || minor != 0) return false;
  DeviceGuard guard(device_id);
  if (guard.error() != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const bool ok = probe_sm90_image() == cudaSuccess;
  cudaGetLastError();
  return ok;
}

int probe_num_sms(int device_id) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device_id) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return n;
}
}  // namespace

bool device_supported(int device_id) {
  if (device_id < 0 || device_id >= kMaxCachedDevices) return probe_device_supported(device_id);
  int v = g_supported[device_id].load(std::memory_order_relaxed);
  if (v == 0) {
    v = probe_device_supported(device_id) ? 1 : 2;
    g_supported[device_id].store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

int num_sms(int device_id) {
  if (device_id < 0 || device_id >= kMaxCachedDevices) return probe_num_sms(device_id);
  int n = g_num_sms[device_id].load(std::memory_order_relaxed);
  if (n == 0) {
    n = probe_num_sms(device_id);
    g_num_sms[device_id].store(n, std::memory_order_relaxed);
  }
  return n;
}

int64_t dense_decode_workspace_bytes(const DenseDecodeParams& p, int64_t num_sm_parts) {
  const Dims d = dims_of(p);
  const int64_t splits = d.b + num_sm_parts;
  return lse_accum_bytes(d, num_sm_parts) + align_up(splits * d.h_kv * d.m_rows * 512 * int64_t{4});
}

Status dense_decode_launch(const DenseDecodeParams& p, int64_t num_sm_parts, int stages,
                           const DenseDecodeOptions& options) {
  const Dims d = dims_of(p);
  if (num_sm_parts <= 0 || num_sm_parts > 65535)
    return Status::Error(ErrorKind::kValue, "flash_mla dense decode (sm90): invalid num_sm_parts");
  if (d.b * d.s_q > 2147483647LL || d.m_rows > 2147483647LL / 64)
    return Status::Error(ErrorKind::kValue, "flash_mla dense decode (sm90): b * s_q * h_q is too large");
  // Grid y: the main kernels put h_kv there, the combine ceil(h_q / 8) (limit 65535).
  if (d.h_kv > 65535 || d.h_q > 65535LL * 8)
    return Status::Error(ErrorKind::kValue, "flash_mla dense decode (sm90): h_kv must be <= 65535 and h_q <= " +
                                                std::to_string(65535LL * 8) + ", got h_kv = " +
                                                std::to_string(d.h_kv) + ", h_q = " + std::to_string(d.h_q));
  const int64_t need = dense_decode_workspace_bytes(p, num_sm_parts);
  if (p.workspace_bytes < need || p.workspace == nullptr)
    return Status::Error(ErrorKind::kValue, "flash_mla dense decode (sm90): workspace of " + std::to_string(need) +
                                                " bytes required, got " + std::to_string(p.workspace_bytes));
  if (reinterpret_cast<uintptr_t>(p.q.data) % 16 != 0 || reinterpret_cast<uintptr_t>(p.k_cache.data) % 16 != 0)
    return Status::Error(ErrorKind::kValue, "flash_mla dense decode (sm90): q and k_cache must be 16-byte aligned");

  DeviceGuard guard(p.q.device.id);
  if (guard.error() != cudaSuccess) return cuda_error("cudaSetDevice", guard.error());
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const bool is_fp16 = p.q.dtype == DType::kFloat16;
  int32_t* metadata = static_cast<int32_t*>(p.tile_scheduler_metadata.data);
  int32_t* num_splits = static_cast<int32_t*>(p.num_splits.data);
  float* lse_accum = static_cast<float*>(p.workspace);
  float* o_accum = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + lse_accum_bytes(d, num_sm_parts));
  const bool vec = element_pairs_aligned(p.out, 4);
  const int tuning = options.tuning;

  if ((stages & kStageScheduler) && !p.metadata_ready) {
    const cudaError_t e = launch_tile_scheduler(static_cast<const int32_t*>(p.cache_seqlens.data),
                                                static_cast<int>(d.b), static_cast<int>(num_sm_parts), metadata,
                                                num_splits, stream);
    if (e != cudaSuccess) return cuda_error("tile scheduler launch", e);
  }

  if (stages & kStageMain) {
    DenseDecodeKernelParams kp{};
    set_decode_query(kp, p.q);
    kp.k = p.k_cache.data;
    kp.k_stride_blk = p.k_cache.stride[0];
    kp.k_stride_tok = p.k_cache.stride[1];
    kp.k_stride_h = p.k_cache.stride[2];
    kp.block_table = static_cast<const int32_t*>(p.block_table.data);
    kp.bt_stride_b = p.block_table.stride[0];
    kp.bt_stride_j = p.block_table.stride[1];
    kp.seqlens = static_cast<const int32_t*>(p.cache_seqlens.data);
    set_decode_outputs(kp, p.out, p.lse, o_accum, lse_accum, num_splits);
    kp.tile_scheduler_metadata = metadata;
    set_decode_dims(kp, d);
    kp.d_qk = static_cast<int>(d.d_qk);
    kp.page_block_size = static_cast<int>(d.pbs);
    kp.causal = (p.causal && d.s_q > 1) ? 1 : 0;
    kp.out_vec_ok = vec ? 1 : 0;
    kp.out_bulk_ok = out_bulk_ok(p.out) ? 1 : 0;
    kp.accum_bulk_ok = reinterpret_cast<uintptr_t>(o_accum) % 16 == 0 ? 1 : 0;
    // (Only with 16-byte-aligned output rows: otherwise the staged kernel would copy element by
    // element, slower than the direct kernel's 4-byte stores.)
    const bool short_requests =
        d.b >= 2 && p.block_table.shape[1] * d.pbs <= kStagedEpilogueMaxTokens && kp.out_bulk_ok;
    kp.staged_epilogue =
        !(tuning & kTuneDirectEpilogue) && ((tuning & kTuneStagedEpilogue) || short_requests) ? 1 : 0;
    kp.scale_log2 = p.softmax_scale * 1.4426950408889634f;
    kp.flags = tuning;
    alignas(64) CUtensorMap tmap;
    int box_tok = 64;
    const DenseKernel forced = options.kernel;
    const bool want_tma = forced == DenseKernel::kAuto || forced == DenseKernel::kSeesaw;
    const bool tma = want_tma && !(tuning & kTuneNoTma) && make_k_tensor_map(p, d, &tmap, &box_tok);
    if (!tma) std::memset(&tmap, 0, sizeof(tmap));
    kp.tma_ok = tma ? 1 : 0;
    kp.tma_box_tok = box_tok;
    const DenseKernel kernel = forced == DenseKernel::kAuto ? choose_dense_kernel(d.m_rows, tma) : forced;
    if (kernel == DenseKernel::kSeesaw && !tma)
      return Status::Error(ErrorKind::kValue, "flash_mla dense decode (sm90): the seesaw kernel needs a K tensor map, "
                                              "which this k_cache's page size, strides or alignment do not allow");
    if (kernel == DenseKernel::kMmaSync && d.m_rows > 32)
      return Status::Error(ErrorKind::kValue, "flash_mla dense decode (sm90): the mma.sync kernel serves at most 32 "
                                              "query rows per KV head, got " + std::to_string(d.m_rows));
    const CUtensorMap* tm = tma ? &tmap : nullptr;
    const cudaError_t e = is_fp16 ? launch_dense_main_fp16(kp, tm, static_cast<int>(num_sm_parts), kernel, stream)
                                  : launch_dense_main_bf16(kp, tm, static_cast<int>(num_sm_parts), kernel, stream);
    if (e != cudaSuccess) return cuda_error("flash_fwd_splitkv_mla_kernel launch", e);
  }

  if (stages & kStageCombine) {
    DenseCombineParams cp{};
    set_decode_outputs(cp, p.out, p.lse, o_accum, lse_accum, num_splits);
    set_decode_dims(cp, d);
    cp.out_vec_ok = vec ? 1 : 0;
    const cudaError_t e = launch_dense_combine(cp, is_fp16, stream);
    if (e != cudaSuccess) return cuda_error("flash_fwd_mla_combine_kernel launch", e);
  }
  return Status::Ok();
}

Status dense_decode(const DenseDecodeParams& p, int64_t num_sm_parts) {
  return dense_decode_launch(p, num_sm_parts, kStageAll);
}

}  // namespace flashmla::sm90
