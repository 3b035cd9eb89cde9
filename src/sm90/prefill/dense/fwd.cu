// src/sm90/prefill/dense/fwd.cu — sm90 dense MHA prefill forward (`flash_attn_varlen_func`, spec §1.5,
// §2.5): out = softmax(q k^T * scale [+ bottom-right causal mask]) v and lse (natural log) per query
// row and head, varlen (cu_seqlens), GQA, bf16 / fp16, d_qk in {128, 192}, d_v 128.
//
// One CTA per (128-row query tile, query head, request); 384 threads, warp-specialised:
//   producer warpgroup 2: cp.async of the Q tile once, then K / V blocks of 128 keys into a
//     two-stage ring (mbarriers "full" per stage, released through "empty");
//   consumer warpgroups 0 / 1: 64 query rows each; per key block S = Q K^T (wgmma m64n128k16, both
//     operands from shared memory), mask, online softmax in base 2, O += P V (wgmma m64n128k16 with P
//     from registers, V MN-major). The two consumer warpgroups run independently, so one's softmax
//     overlaps the other's GEMMs on the tensor cores.
// The running max moves lazily (seesaw::lazy_max): P <= 2^8, O / l rescaled only when it moves.
// Rows with no visible key give out 0 and lse -inf; NaN in q or a visible k / v row reaches that
// row's out and lse (fmaxf skips NaN in the max, the NaN then flows through P, l and O).
// Causal grids run their query tiles last-to-first so the longest CTAs start first.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "sm90/host_utils.h"
#include "sm90/prefill/dense/common.cuh"
#include "sm90/sm90.h"

namespace flashmla::sm90 {
namespace dense_prefill {

constexpr int kFwdBM = 128, kFwdBN = 128, kDV = 128;

template <int kD>
struct FwdSmem {
  static constexpr int kQ = kFwdBM * kD * 2;
  static constexpr int kK = kFwdBN * kD * 2;
  static constexpr int kV = kFwdBN * kDV * 2;
  static constexpr int kStage = kK + kV;
  static constexpr int kBars = 5 * 8;  // full[2], empty[2], q_full
  static constexpr int kBytes = 1024 + kQ + 2 * kStage + kBars;
  static_assert(kBytes <= 232448, "shared memory");
};

template <class T, int kD>
__global__ void __launch_bounds__(kThreads, 1) dense_prefill_fwd_kernel(const KernelParams p) {
  using Smem = FwdSmem<kD>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t base;
  smem_align_1024(smem_raw, base);
  const uint32_t sQ = base;
  const uint32_t bar = base + Smem::kQ + 2 * Smem::kStage;
  auto full_bar = [&](int s) { return bar + 8 * s; };
  auto empty_bar = [&](int s) { return bar + 16 + 8 * s; };
  const uint32_t q_bar = bar + 32;

  const int b = blockIdx.z, h = blockIdx.y;
  const SeqBounds sb = seq_bounds(p.cu_q, p.cu_k, p.cu_q_stride, p.cu_k_stride, b);
  const int mblk = p.causal ? static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x) : blockIdx.x;
  const int m0 = mblk * kFwdBM;
  if (m0 >= sb.s_q) return;
  const int off = sb.s_k - sb.s_q;  // key j visible to query i iff j <= i + off (causal)
  int n_end = p.causal ? min(sb.s_k, m0 + kFwdBM + off) : sb.s_k;
  n_end = max(n_end, 0);
  const int n_blocks = (n_end + kFwdBN - 1) / kFwdBN;
  const int hk = h / p.group;

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full_bar(s), 128);
      mbar_init(empty_bar(s), 256);
    }
    mbar_init(q_bar, 128);
    fence_barrier_init();
  }
  __syncthreads();

  if (tid >= 256) {  // ---------------------------------------------------------------- producer
    setmaxnreg_dec<kProducerRegs>();
    const int pt = tid - 256;
    const T* q = static_cast<const T*>(p.q) + (static_cast<int64_t>(sb.q0) + m0) * p.q_row + h * p.q_head;
    load_tile<T, kFwdBM, kD>(sQ, q, p.q_row, sb.s_q - m0, pt);
    mbar_arrive_cp_async(q_bar);
    const T* k = static_cast<const T*>(p.k) + static_cast<int64_t>(sb.k0) * p.k_row + hk * p.k_head;
    const T* v = static_cast<const T*>(p.v) + static_cast<int64_t>(sb.k0) * p.v_row + hk * p.v_head;
    for (int n = 0; n < n_blocks; ++n) {
      const int stage = n & 1;
      if (n >= 2) mbar_wait(empty_bar(stage), ((n >> 1) - 1) & 1);
      const uint32_t sK = base + Smem::kQ + stage * Smem::kStage;
      const int64_t r0 = static_cast<int64_t>(n) * kFwdBN;
      load_tile<T, kFwdBN, kD>(sK, k + r0 * p.k_row, p.k_row, sb.s_k - n * kFwdBN, pt);
      load_tile<T, kFwdBN, kDV>(sK + Smem::kK, v + r0 * p.v_row, p.v_row, sb.s_k - n * kFwdBN, pt);
      mbar_arrive_cp_async(full_bar(stage));
    }
    cp_async_wait<0>();
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<kConsumerRegs>();
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  int row[2];  // this thread's two query rows (request-local indices)
  row[0] = m0 + wg * 64 + warp * 16 + g;
  row[1] = row[0] + 8;

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  mbar_wait(q_bar, 0);
  for (int n = 0; n < n_blocks; ++n) {
    const int stage = n & 1;
    const uint32_t sK = base + Smem::kQ + stage * Smem::kStage;
    const uint32_t sV = sK + Smem::kK;
    mbar_wait(full_bar(stage), (n >> 1) & 1);
    gmma::fence_proxy_async();  // cp.async (generic proxy) writes -> wgmma (async proxy) reads

    float s[64];
    gmma::fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      Wgmma<T, 128>::template ss<0, 0>(s, desc_k<kFwdBM>(sQ, wg * 64, kk), desc_k<kFwdBN>(sK, 0, kk), kk > 0 ? 1 : 0);
    gmma::commit();
    gmma::wait<0>();
    gmma::reg_fence(s);

    // Scale to base 2, mask, row max over the quad.
    const int n0 = n * kFwdBN;
    const bool need_mask = n0 + kFwdBN > sb.s_k || (p.causal && n0 + kFwdBN - 1 > m0 + off);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[4 * i + e] * p.scale_log2;
        if (need_mask) {
          const int col = n0 + 8 * i + 2 * tq + (e & 1);
          const bool vis = col < sb.s_k && (!p.causal || col <= row[e >> 1] + off);
          x = vis ? x : -INFINITY;
        }
        s[4 * i + e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    seesaw::quad_rowmax(mx);
    float m_use[2], sc[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float m_new = seesaw::lazy_max(m_run[e], mx[e]);
      m_use[e] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet: P = 0, no NaN
      sc[e] = exp2f(m_run[e] - m_use[e]);
      m_run[e] = m_new;
      l[e] *= sc[e];
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * i + e] = exp2f(s[4 * i + e] - m_use[e >> 1]);
        l[e >> 1] += s[4 * i + e];
      }
      o[4 * i + 0] *= sc[0];
      o[4 * i + 1] *= sc[0];
      o[4 * i + 2] *= sc[1];
      o[4 * i + 3] *= sc[1];
    }
    uint32_t a[8][4];
    pack_a<T, 128>(s, a);

    gmma::reg_fence(o);
    gmma::fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) Wgmma<T, 128>::template rs<1>(o, a[kk], desc_mn<kFwdBN>(sV, kk));
    gmma::commit();
    gmma::wait<0>();
    gmma::reg_fence(o);
    mbar_arrive(empty_bar(stage));
  }

  // Epilogue: out = O / l (0 for rows without a visible key), lse = ln(l) + m ln 2.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
  }
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (row[e] >= sb.s_q) continue;
    const float inv = l[e] == 0.f ? 0.f : 1.f / l[e];
    const int64_t qi = static_cast<int64_t>(sb.q0) + row[e];
    T* orow = out + qi * p.o_row + h * p.o_head;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int col = 8 * i + 2 * tq;
      *reinterpret_cast<uint32_t*>(orow + col) =
          HalfTraits<T>::pack(o[4 * i + 2 * e] * inv, o[4 * i + 2 * e + 1] * inv);
    }
    if (tq == 0) {
      const float m = m_run[e] == -INFINITY ? 0.f : m_run[e];
      p.lse[qi * p.lse_row + h * p.lse_head] = l[e] == 0.f ? -INFINITY : (m + log2f(l[e])) * kLn2;
    }
  }
}

template <class T, int kD>
cudaError_t launch_fwd(const KernelParams& kp, int m_tiles, int b, cudaStream_t stream) {
  auto kernel = dense_prefill_fwd_kernel<T, kD>;
  cudaError_t e = set_max_dynamic_smem(kernel, FwdSmem<kD>::kBytes);
  if (e != cudaSuccess) return e;
  kernel<<<dim3(m_tiles, kp.h_q, b), kThreads, FwdSmem<kD>::kBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace dense_prefill

namespace {
Status fwd_value_error(const std::string& what) { return value_error_status("flash_attn_varlen_func", what); }
/// Last dim contiguous, other strides even and base 4-byte aligned: the epilogue's 2-element stores.
bool pairs_ok(const TensorRef& t) {
  if (t.stride[2] != 1 || reinterpret_cast<uintptr_t>(t.data) % 4 != 0) return false;
  for (int i = 0; i < 2; ++i)
    if (t.shape[i] > 1 && t.stride[i] % 2 != 0) return false;
  return true;
}
}  // namespace

int64_t dense_prefill_fwd_workspace_bytes(const DensePrefillParams&) { return 0; }

Status dense_prefill_fwd(const DensePrefillParams& p) {
  using namespace dense_prefill;
  const int64_t total_q = p.q.shape[0], h_q = p.q.shape[1], d_qk = p.q.shape[2];
  const int64_t h_kv = p.k.shape[1], d_v = p.v.shape[2];
  const int64_t b = p.cu_seqlens_q.shape[0] - 1;
  if (total_q == 0 || b <= 0 || p.max_seqlen_q <= 0) return Status::Ok();
  if (!((d_qk == 128 || d_qk == 192) && d_v == 128))
    return fwd_value_error("no kernel for head_dim_qk=" + std::to_string(d_qk) + " head_dim_vo=" + std::to_string(d_v));
  if (!rows_16b_aligned(p.q, 2) || !rows_16b_aligned(p.k, 2) || !rows_16b_aligned(p.v, 2))
    return fwd_value_error("q, k and v rows must start 16-byte aligned (strides multiples of 8 elements)");
  if (!pairs_ok(p.out)) return fwd_value_error("out must have an even row / head stride and a 4-byte aligned start");
  if (b > 65535 || h_q > 65535) return fwd_value_error("batch size and h_q must be <= 65535");
  if (p.max_seqlen_q > (int64_t{1} << 30) || total_q >= (int64_t{1} << 31) || p.k.shape[0] >= (int64_t{1} << 31))
    return fwd_value_error("sequence lengths must be < 2^31");

  KernelParams kp{};
  kp.q = p.q.data;
  kp.k = p.k.data;
  kp.v = p.v.data;
  kp.out = p.out.data;
  kp.lse = static_cast<float*>(p.lse.data);
  kp.cu_q = static_cast<const int32_t*>(p.cu_seqlens_q.data);
  kp.cu_k = static_cast<const int32_t*>(p.cu_seqlens_k.data);
  kp.cu_q_stride = p.cu_seqlens_q.stride[0];
  kp.cu_k_stride = p.cu_seqlens_k.stride[0];
  kp.q_row = p.q.stride[0];
  kp.q_head = p.q.stride[1];
  kp.k_row = p.k.stride[0];
  kp.k_head = p.k.stride[1];
  kp.v_row = p.v.stride[0];
  kp.v_head = p.v.stride[1];
  kp.o_row = p.out.stride[0];
  kp.o_head = p.out.stride[1];
  kp.lse_row = p.lse.stride[0];
  kp.lse_head = p.lse.stride[1];
  kp.h_q = static_cast<int>(h_q);
  kp.group = static_cast<int>(h_q / h_kv);
  kp.causal = p.causal ? 1 : 0;
  kp.scale = p.softmax_scale;
  kp.scale_log2 = p.softmax_scale * kLog2e;

  DeviceGuard guard(p.q.device.id);
  if (guard.error() != cudaSuccess) return cuda_error_status("flash_attn_varlen_func", "cudaSetDevice", guard.error());
  const int m_tiles = static_cast<int>((p.max_seqlen_q + kFwdBM - 1) / kFwdBM);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const bool bf16 = p.q.dtype == DType::kBFloat16;
  cudaError_t e;
  if (d_qk == 128)
    e = bf16 ? launch_fwd<__nv_bfloat16, 128>(kp, m_tiles, static_cast<int>(b), stream)
             : launch_fwd<__half, 128>(kp, m_tiles, static_cast<int>(b), stream);
  else
    e = bf16 ? launch_fwd<__nv_bfloat16, 192>(kp, m_tiles, static_cast<int>(b), stream)
             : launch_fwd<__half, 192>(kp, m_tiles, static_cast<int>(b), stream);
  if (e != cudaSuccess) return cuda_error_status("flash_attn_varlen_func", "dense_prefill_fwd_kernel launch", e);
  return Status::Ok();
}

}  // namespace flashmla::sm90
