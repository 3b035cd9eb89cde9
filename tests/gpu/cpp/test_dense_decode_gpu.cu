// tests/gpu/cpp/test_dense_decode_gpu.cu — GPU test and quick benchmark of the sm90
// dense MLA decode (spec §5.4 grid; edge cases: zero-length requests, NaN in unused slots and pages,
// scattered block tables, s_q > 1, b*s_q > 65535, tensor-parallel head counts, views with offsets;
// extra page sizes, d_qk 512).
//
// Oracle: a naive float32 GPU reference (one thread block per output row, online
// softmax in fp32, accurate expf/logf), itself checked against the CPU reference
// flashmla::reference::dense_decode on small cases. Tolerances of spec §5.1.
// Data: randn/10 clamped to [-1, 1] from a counter-based RNG on the device, NaN in
// every unused KV slot and page, sentinel 2147480000 past each request's last page,
// randomly permuted block tables, outputs poisoned with NaN before every run.
//
// Usage: test_dense_decode_gpu [--quick] [--no-perf] [--perf-only] [--max-cases N]
// Exit status 0 iff every check passed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/scheduler.h"
#include "flashmla/flashmla.h"
#include "reference/reference.h"
#include "sm90/decode/dense/dense_decode.h"
#include "sm90/sm90.h"

using namespace flashmla;

#define CUDA_CHECK(expr)                                                                                  \
  do {                                                                                                    \
    cudaError_t _e = (expr);                                                                              \
    if (_e != cudaSuccess) {                                                                              \
      std::fprintf(stderr, "CUDA error %s (%s) at %s:%d: %s\n", cudaGetErrorName(_e), cudaGetErrorString(_e), \
                   __FILE__, __LINE__, #expr);                                                            \
      std::exit(2);                                                                                       \
    }                                                                                                     \
  } while (0)

namespace {

constexpr int32_t kSentinel = 2147480000;
constexpr int kDv = 512;

// ------------------------------------------------------------------ device buffers
struct DevBuf {
  void* ptr = nullptr;
  size_t bytes = 0;
  void* get(size_t need) {
    if (need > bytes) {
      if (ptr) CUDA_CHECK(cudaFree(ptr));
      size_t n = std::max(need, bytes + bytes / 4);
      n = (n + 255) / 256 * 256;
      CUDA_CHECK(cudaMalloc(&ptr, n));
      bytes = n;
    }
    return ptr;
  }
  ~DevBuf() {
    if (ptr) cudaFree(ptr);
  }
};

// ------------------------------------------------------------------ RNG + fills
__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__device__ __forceinline__ float randn_at(uint64_t seed, uint64_t i) {
  const uint64_t h = mix64(seed * 0x632BE59BD9B4E019ull + mix64(i));
  const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1]
  const float u2 = static_cast<float>((h >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

template <typename T>
__device__ __forceinline__ T to_half(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 to_half<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half to_half<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
__global__ void fill_randn_kernel(T* dst, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float v = fminf(fmaxf(randn_at(seed, i) / 10.0f, -1.0f), 1.0f);
    dst[i] = to_half<T>(v);
  }
}

// NaN into every cache token that no request may read (token index >= its length).
template <typename T>
__global__ void poison_kcache_kernel(T* k, int64_t num_blocks, int pbs, int h_kv, int d, int64_t s_blk,
                                     int64_t s_tok, int64_t s_h, const int64_t* owner, const int32_t* seqlens,
                                     int bps) {
  const int64_t total = num_blocks * pbs;
  for (int64_t it = blockIdx.x; it < total; it += gridDim.x) {
    const int64_t blk = it / pbs;
    const int tok = static_cast<int>(it % pbs);
    const int64_t own = owner[blk];
    bool poison = true;
    if (own >= 0) {
      const int64_t req = own / bps, j = own % bps;
      poison = j * pbs + tok >= seqlens[req];
    }
    if (!poison) continue;
    const T nanv = to_half<T>(__int_as_float(0x7fc00000));
    for (int e = threadIdx.x; e < h_kv * d; e += blockDim.x) {
      const int hh = e / d, dd = e % d;
      k[blk * s_blk + tok * s_tok + hh * s_h + dd] = nanv;
    }
  }
}

// ------------------------------------------------------------------ float32 GPU reference
struct RefParams {
  const void* q;
  int64_t qs0, qs1, qs2;
  const void* k;
  int64_t ks0, ks1, ks2;
  const int32_t* bt;
  int64_t bts0, bts1;
  const int32_t* seqlens;
  int b, s_q, h_q, h_kv, d, pbs, causal;
  float scale;
  float* out;  // (b, s_q, h_q, 512) contiguous fp32
  float* lse;  // (b, h_q, s_q) contiguous fp32, natural log, +inf if empty
};

template <typename T>
__device__ __forceinline__ float ldf(const T* p) {
  return static_cast<float>(*p);
}

template <typename T>
__global__ void __launch_bounds__(256) ref_dense_decode_kernel(const RefParams p) {
  constexpr int kChunk = 256;
  __shared__ float qs[576];
  __shared__ float sc[kChunk];
  __shared__ int64_t rowoff[kChunk];
  __shared__ float red[8];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t row = blockIdx.x;  // ((bi * s_q) + sq) * h_q + h
  const int h = static_cast<int>(row % p.h_q);
  const int sq = static_cast<int>((row / p.h_q) % p.s_q);
  const int bi = static_cast<int>(row / ((int64_t)p.h_q * p.s_q));
  const int g = h / (p.h_q / p.h_kv);
  const T* q = static_cast<const T*>(p.q) + bi * p.qs0 + sq * p.qs1 + h * p.qs2;
  for (int d = tid; d < p.d; d += 256) qs[d] = ldf(q + d);
  const int seqlen = max(p.seqlens[bi], 0);
  int n_vis = seqlen;
  if (p.causal) n_vis = min(max(seqlen - p.s_q + sq + 1, 0), seqlen);
  const T* kb = static_cast<const T*>(p.k) + g * p.ks2;
  float m = -INFINITY, l = 0.f, acc0 = 0.f, acc1 = 0.f;
  __syncthreads();
  for (int base = 0; base < n_vis; base += kChunk) {
    const int n = min(kChunk, n_vis - base);
    if (tid < n) {
      const int t = base + tid;
      const int64_t page = p.bt[bi * p.bts0 + (int64_t)(t / p.pbs) * p.bts1];
      rowoff[tid] = page * p.ks0 + (int64_t)(t % p.pbs) * p.ks1;
    }
    __syncthreads();
    for (int kk = warp; kk < n; kk += 8) {
      const T* kr = kb + rowoff[kk];
      float dot = 0.f;
      for (int d = lane; d < p.d; d += 32) dot += qs[d] * ldf(kr + d);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0) sc[kk] = dot * p.scale;
    }
    __syncthreads();
    float cm = tid < n ? sc[tid] : -INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
    if (lane == 0) red[warp] = cm;
    __syncthreads();
    cm = red[0];
    for (int w = 1; w < 8; ++w) cm = fmaxf(cm, red[w]);
    const float m_new = fmaxf(m, cm);
    const float alpha = m == -INFINITY ? 0.f : expf(m - m_new);
    l *= alpha;
    acc0 *= alpha;
    acc1 *= alpha;
    __syncthreads();  // everyone read red[] and sc[] maxima
    if (tid < n) {
      const float e = expf(sc[tid] - m_new);
      sc[tid] = e;
      l += e;  // per-thread partial sum, reduced at the end
    }
    __syncthreads();
    for (int j = 0; j < n; ++j) {
      const float pj = sc[j];
      const T* vr = kb + rowoff[j];
      acc0 += pj * ldf(vr + tid);
      acc1 += pj * ldf(vr + tid + 256);
    }
    m = m_new;
    __syncthreads();
  }
  // total L
  float lt = l;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lt += __shfl_xor_sync(0xffffffffu, lt, o);
  if (lane == 0) red[warp] = lt;
  __syncthreads();
  float L = 0.f;
  for (int w = 0; w < 8; ++w) L += red[w];
  float* out = p.out + row * kDv;
  if (n_vis == 0 || !(L > 0.f)) {
    out[tid] = 0.f;
    out[tid + 256] = 0.f;
    if (tid == 0) p.lse[((int64_t)bi * p.h_q + h) * p.s_q + sq] = INFINITY;
  } else {
    out[tid] = acc0 / L;
    out[tid + 256] = acc1 / L;
    if (tid == 0) p.lse[((int64_t)bi * p.h_q + h) * p.s_q + sq] = m + logf(L);
  }
}

// ------------------------------------------------------------------ comparison
struct CmpAcc {
  unsigned long long n_fail, n_anom, first_bad;
  double sum_ar, sum_aa, sum_rr, max_err;
};

__device__ __forceinline__ int anomaly_class(float x) {
  if (isnan(x)) return 3;
  if (isinf(x)) return x > 0 ? 1 : 2;
  return 0;
}

__device__ __forceinline__ void atomic_max_double(double* addr, double v) {
  unsigned long long* a = reinterpret_cast<unsigned long long*>(addr);
  unsigned long long old = *a;
  while (__longlong_as_double(old) < v) {
    const unsigned long long prev = atomicCAS(a, old, __double_as_longlong(v));
    if (prev == old) break;
    old = prev;
  }
}

// ans[i] vs ref[i] (both float, contiguous), spec §5.1 rules.
__global__ void compare_kernel(const float* ans, const float* ref, int64_t n, float abs_tol, float rel_tol,
                               CmpAcc* acc) {
  double ar = 0, aa = 0, rr = 0, me = 0;
  unsigned long long nf = 0, na = 0, first = ~0ull;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float a = ans[i], r = ref[i];
    const int ca = anomaly_class(a), cr = anomaly_class(r);
    if (ca != cr) {
      ++na;
      first = min(first, (unsigned long long)i);
      continue;
    }
    if (ca != 0) continue;  // matching +inf / -inf / NaN positions are zeroed
    const float diff = fabsf(a - r);
    const bool ok = diff < abs_tol || diff / (fabsf(r) + 1e-6f) < rel_tol;
    if (!ok) {
      ++nf;
      first = min(first, (unsigned long long)i);
    }
    me = fmax(me, (double)diff);
    ar += (double)a * r;
    aa += (double)a * a;
    rr += (double)r * r;
  }
  // warp reduce then atomics
  for (int o = 16; o > 0; o >>= 1) {
    ar += __shfl_xor_sync(0xffffffffu, ar, o);
    aa += __shfl_xor_sync(0xffffffffu, aa, o);
    rr += __shfl_xor_sync(0xffffffffu, rr, o);
    me = fmax(me, __shfl_xor_sync(0xffffffffu, me, o));
    nf += __shfl_xor_sync(0xffffffffu, nf, o);
    na += __shfl_xor_sync(0xffffffffu, na, o);
    first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&acc->sum_ar, ar);
    atomicAdd(&acc->sum_aa, aa);
    atomicAdd(&acc->sum_rr, rr);
    atomic_max_double(&acc->max_err, me);
    if (nf) atomicAdd(&acc->n_fail, nf);
    if (na) atomicAdd(&acc->n_anom, na);
    if (first != ~0ull) atomicMin(&acc->first_bad, first);
  }
}

// Strided output (b, s_q, h_q, 512) of dtype T -> contiguous float; also rounds the
// float reference to T (the reference casts its output to q's dtype).
template <typename T>
__global__ void gather_out_kernel(const T* out, int64_t s0, int64_t s1, int64_t s2, int64_t s3, int s_q, int h_q,
                                  int64_t n, float* dst, const float* ref, float* ref_rounded) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t d = i % kDv, h = (i / kDv) % h_q, sq = (i / ((int64_t)kDv * h_q)) % s_q,
                  bi = i / ((int64_t)kDv * h_q * s_q);
    dst[i] = static_cast<float>(out[bi * s0 + sq * s1 + h * s2 + d * s3]);
    if (ref) ref_rounded[i] = static_cast<float>(to_half<T>(ref[i]));
  }
}
__global__ void gather_lse_kernel(const float* lse, int64_t s0, int64_t s1, int64_t s2, int h_q, int s_q, int64_t n,
                                  float* dst) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t sq = i % s_q, h = (i / s_q) % h_q, bi = i / ((int64_t)s_q * h_q);
    dst[i] = lse[bi * s0 + h * s1 + sq * s2];
  }
}
__global__ void count_bit_diff_kernel(const uint32_t* a, const uint32_t* b, int64_t n, unsigned long long* cnt) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    c += a[i] != b[i];
  if (c) atomicAdd(cnt, c);
}
__global__ void flush_kernel(int* p, int64_t n, int v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = v;
}

int grid_for(int64_t n, int threads = 256) {
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>((n + threads - 1) / threads, 1), 132 * 16));
}

// ------------------------------------------------------------------ test cases
enum class Layout { kContig, kPadded, kPaddedOddOut };

struct Case {
  std::string group;
  int b = 1, s_q = 1, s_k = 64;
  bool varlen = false, causal = false, zero_seqlen = false;
  int h_q = 128, h_kv = 1, d = 576, pbs = 64;
  bool fp16 = false;
  bool perf = false;
  Layout layout = Layout::kContig;
  bool lse_flashmla = false;  // FlashMLA's (b, h_q, s_q) strides (s_q*h_q, 1, h_q); h_kv == 1 only
  bool pad256 = true;         // FlashMLA's max_seqlen_pad = cdiv(max, 256) * 256
  std::vector<int> explicit_lens;  // overrides generated lengths when not empty
  uint64_t seed = 0;
  bool cpu_check = false;  // also compare against the CPU reference (small cases)
};

std::string describe(const Case& c) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "[%s] b=%d s_q=%d s_k=%d varlen=%d causal=%d zero=%d h_q=%d h_kv=%d d=%d pbs=%d %s layout=%d "
                "lseF=%d",
                c.group.c_str(), c.b, c.s_q, c.s_k, c.varlen, c.causal, c.zero_seqlen, c.h_q, c.h_kv, c.d, c.pbs,
                c.fp16 ? "fp16" : "bf16", static_cast<int>(c.layout), c.lse_flashmla);
  return buf;
}

struct Stats {
  int cases = 0, failed = 0;
  std::vector<std::string> failures;
};

struct Pools {
  DevBuf q, k, bt, seqlens, owner, out, out_saved, lse, lse_saved, meta, nsplit, ws, ref_out, ref_lse, ans_f,
      ref_f, acc, cnt, flush;
};

struct CmpResult {
  bool ok = true;
  std::string msg;
};

CmpResult compare(Pools& P, const float* ans, const float* ref, int64_t n, float abs_tol, float rel_tol,
                  double cos_tol, const char* name) {
  CmpAcc h{};
  h.first_bad = ~0ull;
  CmpAcc* d = static_cast<CmpAcc*>(P.acc.get(sizeof(CmpAcc)));
  CUDA_CHECK(cudaMemcpy(d, &h, sizeof(h), cudaMemcpyHostToDevice));
  compare_kernel<<<grid_for(n), 256>>>(ans, ref, n, abs_tol, rel_tol, d);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
  CmpResult r;
  const double cos_diff = h.sum_rr < 1e-12 ? 0.0 : 1.0 - 2.0 * h.sum_ar / (h.sum_aa + h.sum_rr);
  char buf[512];
  if (h.n_anom || h.n_fail || std::fabs(cos_diff) > cos_tol) {
    r.ok = false;
    float av = 0, rv = 0;
    if (h.first_bad != ~0ull) {
      CUDA_CHECK(cudaMemcpy(&av, ans + h.first_bad, 4, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(&rv, ref + h.first_bad, 4, cudaMemcpyDeviceToHost));
    }
    std::snprintf(buf, sizeof(buf),
                  "%s: %llu anomaly-position mismatches, %llu out of tolerance, cos_diff=%.3g, max_err=%.3g, "
                  "first bad idx %lld ans=%g ref=%g",
                  name, h.n_anom, h.n_fail, cos_diff, h.max_err, h.first_bad == ~0ull ? -1LL : static_cast<long long>(h.first_bad),
                  av, rv);
    r.msg = buf;
  }
  return r;
}

struct Generated {
  std::vector<int32_t> seqlens;
  std::vector<int32_t> bt;  // (b, bt_stride) with bt_stride >= bps
  int bps = 0;
  int64_t bt_stride = 0;
  int64_t num_blocks = 0;
  // tensors
  TensorRef q, k, block_table, cache_seqlens, out, lse;
  int64_t q_alloc = 0, k_alloc = 0;
};

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

Generated generate(const Case& c, Pools& P) {
  Generated g;
  std::mt19937_64 rng(c.seed * 7919 + 17);
  std::normal_distribution<double> nd(0.0, 1.0);
  g.seqlens.assign(c.b, c.s_k);
  if (!c.explicit_lens.empty()) {
    for (int i = 0; i < c.b; ++i) g.seqlens[i] = c.explicit_lens[i % c.explicit_lens.size()];
  } else {
    if (c.varlen)
      for (int i = 0; i < c.b; ++i)
        g.seqlens[i] = std::max(static_cast<int>(c.s_k + nd(rng) * c.s_k / 2.0), c.s_q);
    if (c.zero_seqlen)
      for (int i = 0; i < c.b; ++i)
        if (nd(rng) > 0) g.seqlens[i] = 0;
  }
  const int max_len = *std::max_element(g.seqlens.begin(), g.seqlens.end());
  const int64_t pad = c.pad256 ? std::max<int64_t>(cdiv(max_len, 256), 1) * 256
                               : std::max<int64_t>(cdiv(max_len, c.pbs), 1) * c.pbs;
  g.bps = static_cast<int>(pad / c.pbs);
  g.num_blocks = static_cast<int64_t>(c.b) * g.bps;
  g.bt_stride = c.layout == Layout::kContig ? g.bps : g.bps + 3;
  std::vector<int32_t> perm(g.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  g.bt.assign(static_cast<size_t>(c.b) * g.bt_stride, -7);
  std::vector<int64_t> owner(g.num_blocks, -1);
  for (int i = 0; i < c.b; ++i) {
    const int used = static_cast<int>(cdiv(g.seqlens[i], c.pbs));
    for (int j = 0; j < g.bps; ++j) {
      const int32_t blk = perm[static_cast<size_t>(i) * g.bps + j];
      owner[blk] = static_cast<int64_t>(i) * g.bps + j;
      g.bt[static_cast<size_t>(i) * g.bt_stride + j] = j < used ? blk : kSentinel;
    }
  }
  const Device dev{DeviceType::kCUDA, 0};
  const DType dt = c.fp16 ? DType::kFloat16 : DType::kBFloat16;
  const bool padded = c.layout != Layout::kContig;

  // q (b, s_q, h_q, d) with optional padding and a storage offset
  {
    const int64_t hs = padded ? c.d + 8 : c.d;
    const int64_t ss = c.h_q * hs + (padded ? 16 : 0);
    const int64_t bs = c.s_q * ss + (padded ? 8 : 0);
    const int64_t off = padded ? 64 : 0;
    g.q_alloc = off + c.b * bs;
    char* base = static_cast<char*>(P.q.get(g.q_alloc * 2));
    if (c.fp16)
      fill_randn_kernel<__half><<<grid_for(g.q_alloc), 256>>>((__half*)base, g.q_alloc, c.seed * 3 + 1);
    else
      fill_randn_kernel<__nv_bfloat16><<<grid_for(g.q_alloc), 256>>>((__nv_bfloat16*)base, g.q_alloc, c.seed * 3 + 1);
    CUDA_CHECK(cudaGetLastError());
    g.q = make_tensor_ref(base + off * 2, dt, {c.b, c.s_q, c.h_q, c.d}, {bs, ss, hs, 1}, dev);
  }
  // k_cache (num_blocks, pbs, h_kv, d)
  {
    const int64_t hs = padded ? c.d + 64 : c.d;
    const int64_t ts = c.h_kv * hs + (padded ? 8 : 0);
    const int64_t bs = c.pbs * ts + (padded ? 64 : 0);
    g.k_alloc = g.num_blocks * bs;
    char* base = static_cast<char*>(P.k.get(g.k_alloc * 2));
    if (c.fp16)
      fill_randn_kernel<__half><<<grid_for(g.k_alloc), 256>>>((__half*)base, g.k_alloc, c.seed * 3 + 2);
    else
      fill_randn_kernel<__nv_bfloat16><<<grid_for(g.k_alloc), 256>>>((__nv_bfloat16*)base, g.k_alloc,
                                                                     c.seed * 3 + 2);
    CUDA_CHECK(cudaGetLastError());
    int64_t* d_owner = static_cast<int64_t*>(P.owner.get(owner.size() * 8));
    CUDA_CHECK(cudaMemcpy(d_owner, owner.data(), owner.size() * 8, cudaMemcpyHostToDevice));
    int32_t* d_len = static_cast<int32_t*>(P.seqlens.get(c.b * 4));
    CUDA_CHECK(cudaMemcpy(d_len, g.seqlens.data(), c.b * 4, cudaMemcpyHostToDevice));
    const int pgrid = static_cast<int>(std::min<int64_t>(g.num_blocks * c.pbs, 132 * 64));
    if (c.fp16)
      poison_kcache_kernel<__half><<<pgrid, 256>>>((__half*)base, g.num_blocks, c.pbs, c.h_kv, c.d, bs, ts, hs,
                                                   d_owner, d_len, g.bps);
    else
      poison_kcache_kernel<__nv_bfloat16><<<pgrid, 256>>>((__nv_bfloat16*)base, g.num_blocks, c.pbs, c.h_kv, c.d,
                                                          bs, ts, hs, d_owner, d_len, g.bps);
    CUDA_CHECK(cudaGetLastError());
    g.k = make_tensor_ref(base, dt, {g.num_blocks, c.pbs, c.h_kv, c.d}, {bs, ts, hs, 1}, dev);
    g.cache_seqlens = make_tensor_ref(d_len, DType::kInt32, {c.b}, dev);
  }
  {
    int32_t* d_bt = static_cast<int32_t*>(P.bt.get(g.bt.size() * 4));
    CUDA_CHECK(cudaMemcpy(d_bt, g.bt.data(), g.bt.size() * 4, cudaMemcpyHostToDevice));
    g.block_table = make_tensor_ref(d_bt, DType::kInt32, {c.b, g.bps}, {g.bt_stride, 1}, dev);
  }
  // outputs
  {
    int64_t hs = kDv;
    if (c.layout == Layout::kPadded) hs = kDv + 8;
    if (c.layout == Layout::kPaddedOddOut) hs = kDv + 1;
    const int64_t ss = c.h_q * hs, bs = c.s_q * ss;
    void* o = P.out.get(c.b * bs * 2);
    g.out = make_tensor_ref(o, dt, {c.b, c.s_q, c.h_q, kDv}, {bs, ss, hs, 1}, dev);
    float* l = static_cast<float*>(P.lse.get(static_cast<size_t>(c.b) * c.h_q * c.s_q * 4));
    if (c.lse_flashmla)
      g.lse = make_tensor_ref(l, DType::kFloat32, {c.b, c.h_q, c.s_q},
                              {static_cast<int64_t>(c.s_q) * c.h_q, 1, c.h_q}, dev);
    else
      g.lse = make_tensor_ref(l, DType::kFloat32, {c.b, c.h_q, c.s_q}, dev);
  }
  return g;
}

void poison_outputs(const Case& c, Generated& g, Pools& P) {
  const int64_t ob = g.out.stride[0] * c.b * 2;
  CUDA_CHECK(cudaMemset(g.out.data, 0xFF, ob));  // 0xFFFF = NaN in bf16 and fp16
  CUDA_CHECK(cudaMemset(g.lse.data, 0xFF, static_cast<size_t>(c.b) * c.h_q * c.s_q * 4));
  (void)P;
}

void run_reference(const Case& c, const Generated& g, Pools& P, float scale) {
  RefParams rp{};
  rp.q = g.q.data;
  rp.qs0 = g.q.stride[0];
  rp.qs1 = g.q.stride[1];
  rp.qs2 = g.q.stride[2];
  rp.k = g.k.data;
  rp.ks0 = g.k.stride[0];
  rp.ks1 = g.k.stride[1];
  rp.ks2 = g.k.stride[2];
  rp.bt = static_cast<const int32_t*>(g.block_table.data);
  rp.bts0 = g.block_table.stride[0];
  rp.bts1 = g.block_table.stride[1];
  rp.seqlens = static_cast<const int32_t*>(g.cache_seqlens.data);
  rp.b = c.b;
  rp.s_q = c.s_q;
  rp.h_q = c.h_q;
  rp.h_kv = c.h_kv;
  rp.d = c.d;
  rp.pbs = c.pbs;
  rp.causal = c.causal && c.s_q > 1;
  rp.scale = scale;
  const int64_t rows = static_cast<int64_t>(c.b) * c.s_q * c.h_q;
  rp.out = static_cast<float*>(P.ref_out.get(rows * kDv * 4));
  rp.lse = static_cast<float*>(P.ref_lse.get(rows * 4));
  if (c.fp16)
    ref_dense_decode_kernel<__half><<<static_cast<unsigned>(rows), 256>>>(rp);
  else
    ref_dense_decode_kernel<__nv_bfloat16><<<static_cast<unsigned>(rows), 256>>>(rp);
  CUDA_CHECK(cudaGetLastError());
}

// Compares the kernel's out/lse (strided, in g) with the float reference in P.ref_*.
CmpResult check_outputs(const Case& c, const Generated& g, Pools& P) {
  const int64_t rows = static_cast<int64_t>(c.b) * c.s_q * c.h_q;
  const int64_t n_out = rows * kDv;
  float* ans = static_cast<float*>(P.ans_f.get(n_out * 4));
  float* refr = static_cast<float*>(P.ref_f.get(n_out * 4));
  const float* ref = static_cast<const float*>(P.ref_out.ptr);
  if (c.fp16)
    gather_out_kernel<__half><<<grid_for(n_out), 256>>>((const __half*)g.out.data, g.out.stride[0], g.out.stride[1],
                                                        g.out.stride[2], g.out.stride[3], c.s_q, c.h_q, n_out, ans,
                                                        ref, refr);
  else
    gather_out_kernel<__nv_bfloat16><<<grid_for(n_out), 256>>>((const __nv_bfloat16*)g.out.data, g.out.stride[0],
                                                               g.out.stride[1], g.out.stride[2], g.out.stride[3],
                                                               c.s_q, c.h_q, n_out, ans, ref, refr);
  CUDA_CHECK(cudaGetLastError());
  CmpResult r = compare(P, ans, refr, n_out, 8e-4f, 2.01f / 128, 5e-6, "out");
  if (!r.ok) return r;
  gather_lse_kernel<<<grid_for(rows), 256>>>(static_cast<const float*>(g.lse.data), g.lse.stride[0], g.lse.stride[1],
                                             g.lse.stride[2], c.h_q, c.s_q, rows, ans);
  CUDA_CHECK(cudaGetLastError());
  return compare(P, ans, static_cast<const float*>(P.ref_lse.ptr), rows, 1e-6f, 8.01f / 65536, 1e-7, "lse");
}

// CPU reference on host copies; compares it with the GPU float reference (and the kernel).
CmpResult check_cpu_reference(const Case& c, const Generated& g, Pools& P, float scale) {
  CmpResult r;
  std::vector<uint16_t> hq(g.q_alloc), hk(g.k_alloc);
  const int64_t q_off = (static_cast<char*>(g.q.data) - static_cast<char*>(P.q.ptr)) / 2;
  CUDA_CHECK(cudaMemcpy(hq.data(), P.q.ptr, g.q_alloc * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(hk.data(), g.k.data, g.k_alloc * 2, cudaMemcpyDeviceToHost));
  DenseDecodeParams hp{};
  const Device cpu{};
  auto host = [&](TensorRef t, void* data) {
    t.data = data;
    t.device = cpu;
    return t;
  };
  hp.q = host(g.q, hq.data() + q_off);
  hp.k_cache = host(g.k, hk.data());
  std::vector<int32_t> hbt = g.bt, hlen = g.seqlens;
  hp.block_table = host(g.block_table, hbt.data());
  hp.cache_seqlens = host(g.cache_seqlens, hlen.data());
  hp.head_dim_v = kDv;
  hp.softmax_scale = scale;
  hp.causal = c.causal;
  const int64_t rows = static_cast<int64_t>(c.b) * c.s_q * c.h_q;
  std::vector<uint16_t> hout(rows * kDv);
  std::vector<float> hlse(rows);
  hp.out = make_tensor_ref(hout.data(), g.q.dtype, {c.b, c.s_q, c.h_q, kDv});
  hp.lse = make_tensor_ref(hlse.data(), DType::kFloat32, {c.b, c.h_q, c.s_q});
  Status st = reference::dense_decode(hp);
  if (!st.ok()) {
    r.ok = false;
    r.msg = "CPU reference failed: " + st.message;
    return r;
  }
  // upload the CPU results as float and compare with the GPU reference (rounded to dtype)
  std::vector<float> fo(rows * kDv);
  for (int64_t i = 0; i < rows * kDv; ++i) {
    float f;
    if (c.fp16) {
      __half_raw hr;
      hr.x = hout[i];
      f = __half2float(__half(hr));
    } else {
      const uint32_t bits = static_cast<uint32_t>(hout[i]) << 16;
      std::memcpy(&f, &bits, 4);
    }
    fo[i] = f;
  }
  float* d_cpu = static_cast<float*>(P.ans_f.get(rows * kDv * 4));
  float* d_refr = static_cast<float*>(P.ref_f.get(rows * kDv * 4));
  CUDA_CHECK(cudaMemcpy(d_cpu, fo.data(), rows * kDv * 4, cudaMemcpyHostToDevice));
  // round the GPU reference to the dtype, as the CPU reference rounds its output
  std::vector<float> gref(rows * kDv);
  CUDA_CHECK(cudaMemcpy(gref.data(), P.ref_out.ptr, rows * kDv * 4, cudaMemcpyDeviceToHost));
  for (auto& v : gref) {
    if (c.fp16) {
      v = __half2float(__float2half_rn(v));
    } else {
      v = __bfloat162float(__float2bfloat16_rn(v));
    }
  }
  CUDA_CHECK(cudaMemcpy(d_refr, gref.data(), rows * kDv * 4, cudaMemcpyHostToDevice));
  r = compare(P, d_cpu, d_refr, rows * kDv, 1e-5f, 1.01f / 128, 1e-6, "gpu-ref vs cpu-ref out");
  if (!r.ok) return r;
  CUDA_CHECK(cudaMemcpy(d_cpu, hlse.data(), rows * 4, cudaMemcpyHostToDevice));
  return compare(P, d_cpu, static_cast<const float*>(P.ref_lse.ptr), rows, 1e-5f, 1e-5f, 1e-9,
                 "gpu-ref vs cpu-ref lse");
}

struct RunInfo {
  int64_t num_sm_parts = 0;
};

// Full check of one case. Returns "" on success.
// --kernel / --tune: the main kernel and tuning flags every launch of this program uses (default: the
// library's choice). With a forced choice the calls go to sm90::dense_decode_launch (after the public
// plan), which takes them as explicit options.
sm90::DenseDecodeOptions g_options;
int g_skipped = 0;  // cases the forced kernel cannot serve

std::string run_case(const Case& c, Pools& P, int num_sms, RunInfo* info = nullptr, Generated* keep = nullptr,
                     DenseDecodeParams* keep_p = nullptr) {
  Generated g = generate(c, P);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  DenseDecodeParams p{};
  p.q = g.q;
  p.k_cache = g.k;
  p.block_table = g.block_table;
  p.cache_seqlens = g.cache_seqlens;
  p.head_dim_v = kDv;
  p.softmax_scale = scale;
  p.causal = c.causal;
  p.out = g.out;
  p.lse = g.lse;
  p.stream = nullptr;
  p.metadata_ready = false;
  const Device dev{DeviceType::kCUDA, 0};
  // metadata buffers: shapes from the plan (set before plan so validation sees them later)
  DecodePlan plan;
  Status st = dense_decode_plan(p, &plan);
  if (!st.ok()) return "plan failed: " + st.message;
  if (plan.num_sm_parts != core::dense_decode_num_sm_parts(num_sms, c.s_q, c.h_q, c.h_kv))
    return "plan num_sm_parts mismatch";
  int32_t* meta = static_cast<int32_t*>(P.meta.get(plan.num_sm_parts * 32));
  int32_t* nsp = static_cast<int32_t*>(P.nsplit.get((c.b + 1) * 4));
  CUDA_CHECK(cudaMemset(meta, 0xFF, plan.num_sm_parts * 32));
  CUDA_CHECK(cudaMemset(nsp, 0xFF, (c.b + 1) * 4));
  p.tile_scheduler_metadata = make_tensor_ref(meta, DType::kInt32, {plan.num_sm_parts, 8}, dev);
  p.num_splits = make_tensor_ref(nsp, DType::kInt32, {c.b + 1}, dev);
  p.workspace = P.ws.get(std::max<int64_t>(plan.workspace_bytes, 256));
  p.workspace_bytes = plan.workspace_bytes;
  CUDA_CHECK(cudaMemset(p.workspace, 0xFF, plan.workspace_bytes));  // NaN partials unless written
  poison_outputs(c, g, P);
  CUDA_CHECK(cudaDeviceSynchronize());

  const bool forced = g_options.kernel != sm90::DenseKernel::kAuto || g_options.tuning != 0;
  st = forced ? sm90::dense_decode_launch(p, plan.num_sm_parts, sm90::kStageAll, g_options) : dense_decode_fwd(p);
  if (!st.ok() && forced && g_options.kernel != sm90::DenseKernel::kAuto && st.kind == ErrorKind::kValue &&
      (st.message.find("serves at most") != std::string::npos ||
       st.message.find("needs a K tensor map") != std::string::npos)) {
    ++g_skipped;  // the forced kernel cannot serve this shape (counted apart, not checked)
    return "";
  }
  if (!st.ok()) return "dense_decode_fwd failed: " + st.message;
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "FATAL: kernel error %s in %s\n", cudaGetErrorString(e), describe(c).c_str());
    std::exit(3);
  }
  if (info) info->num_sm_parts = plan.num_sm_parts;

  // scheduler metadata == host oracle
  {
    std::vector<TileSchedulerMetadataRow> hm(plan.num_sm_parts), dm(plan.num_sm_parts);
    std::vector<int32_t> hn(c.b + 1), dn(c.b + 1);
    std::vector<int64_t> work(g.seqlens.begin(), g.seqlens.end());
    core::compute_tile_schedule(work, plan.num_sm_parts, core::kDenseDecodeSchedOverheadBlocks, hm.data(), hn.data());
    CUDA_CHECK(cudaMemcpy(dm.data(), meta, plan.num_sm_parts * 32, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(dn.data(), nsp, (c.b + 1) * 4, cudaMemcpyDeviceToHost));
    if (std::memcmp(hm.data(), dm.data(), plan.num_sm_parts * 32) != 0 || hn != dn)
      return "device scheduler metadata differs from core::compute_tile_schedule";
  }

  run_reference(c, g, P, scale);
  CmpResult r = check_outputs(c, g, P);
  if (!r.ok) return r.msg;

  if (c.cpu_check) {
    r = check_cpu_reference(c, g, P, scale);
    if (!r.ok) return r.msg;
  }

  // reuse: metadata_ready = true must give bit-identical outputs
  {
    const int64_t ob = g.out.stride[0] * c.b * 2;
    const int64_t lb = static_cast<int64_t>(c.b) * c.h_q * c.s_q * 4;
    void* so = P.out_saved.get(ob);
    void* sl = P.lse_saved.get(lb);
    CUDA_CHECK(cudaMemcpy(so, g.out.data, ob, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaMemcpy(sl, g.lse.data, lb, cudaMemcpyDeviceToDevice));
    poison_outputs(c, g, P);
    p.metadata_ready = true;
    st = dense_decode_fwd(p);
    if (!st.ok()) return "reuse call failed: " + st.message;
    CUDA_CHECK(cudaDeviceSynchronize());
    unsigned long long* cnt = static_cast<unsigned long long*>(P.cnt.get(8));
    CUDA_CHECK(cudaMemset(cnt, 0, 8));
    // out buffers may have an odd number of halves: compare the even prefix as uint32 and the rest below
    count_bit_diff_kernel<<<grid_for(ob / 4), 256>>>((const uint32_t*)so, (const uint32_t*)g.out.data, ob / 4, cnt);
    count_bit_diff_kernel<<<grid_for(lb / 4), 256>>>((const uint32_t*)sl, (const uint32_t*)g.lse.data, lb / 4, cnt);
    CUDA_CHECK(cudaGetLastError());
    unsigned long long h = 0;
    CUDA_CHECK(cudaMemcpy(&h, cnt, 8, cudaMemcpyDeviceToHost));
    if (h) return "reuse call (metadata_ready) gave different bits in " + std::to_string(h) + " words";
  }
  if (keep) *keep = g;
  if (keep_p) *keep_p = p;
  return "";
}

// ------------------------------------------------------------------ case lists
const std::vector<std::pair<int, int>> kHeadPairs = {{1, 1},  {3, 1},  {3, 3},   {9, 1},   {9, 3},  {63, 1},
                                                     {63, 3}, {64, 1}, {64, 2},  {64, 8},  {126, 1}, {126, 2},
                                                     {126, 3}, {128, 1}, {128, 2}, {128, 8}};

std::vector<Case> spec_grid(bool fp16_subset) {
  std::vector<Case> v;
  for (int b : {1, 2, 6, 64})
    for (int s_q : {1, 2, 4})
      for (int s_k : {20, 140, 4096})
        for (auto [h_q, h_kv] : kHeadPairs)
          for (bool varlen : {false, true})
            for (bool causal : {false, true}) {
              Case c;
              c.group = fp16_subset ? "fp16" : "grid";
              c.b = b;
              c.s_q = s_q;
              c.s_k = s_k;
              c.h_q = h_q;
              c.h_kv = h_kv;
              c.varlen = varlen;
              c.causal = causal;
              c.fp16 = fp16_subset;
              if (fp16_subset) {
                if (b == 64 && s_k == 4096) continue;
                if (!varlen) continue;
                if (!(h_q == 1 || h_q == 9 || h_q == 64 || h_q == 128)) continue;
              }
              v.push_back(c);
            }
  return v;
}

std::vector<Case> corner_cases() {
  std::vector<Case> v;
  for (auto [h_q, h_kv] : kHeadPairs)
    for (bool causal : {false, true}) {
      Case c;
      c.group = "corner";
      c.b = 128;
      c.s_q = 2;
      c.s_k = 4096;
      c.varlen = true;
      c.zero_seqlen = true;
      c.h_q = h_q;
      c.h_kv = h_kv;
      c.causal = causal;
      v.push_back(c);
    }
  return v;
}

std::vector<Case> perf_cases(bool fp16) {
  std::vector<Case> v;
  for (bool causal : {false, true})
    for (int s_q : {1, 2})
      for (int s_k : {4096, 8192, 16384, 32768}) {
        Case c;
        c.group = fp16 ? "perf-fp16" : "perf";
        c.b = 128;
        c.s_q = s_q;
        c.s_k = s_k;
        c.varlen = true;
        c.causal = causal;
        c.h_q = 128;
        c.h_kv = 1;
        c.perf = true;
        c.fp16 = fp16;
        v.push_back(c);
      }
  return v;
}

std::vector<Case> extra_cases() {
  std::vector<Case> v;
  auto add = [&](Case c, const char* grp) {
    c.group = grp;
    v.push_back(c);
  };
  // Zero-length requests alone / first / last / all.
  for (int s_q : {1, 2})
    for (bool causal : {false, true}) {
      Case c;
      c.s_q = s_q;
      c.causal = causal;
      c.h_q = 16;
      c.b = 1;
      c.explicit_lens = {0};
      add(c, "zero-length");
      c.b = 4;
      c.explicit_lens = {0, 300, 70, 129};
      add(c, "zero-length");
      c.explicit_lens = {300, 70, 129, 0};
      add(c, "zero-length");
      c.explicit_lens = {0, 0, 0, 0};
      add(c, "zero-length");
      c.b = 9;
      c.h_q = 128;
      c.explicit_lens = {0, 1, 0, 64, 65, 0, 2000, 0, 3};
      add(c, "zero-length");
    }
  // s_q > 1 (speculative decode), including rows that see no key.
  for (int s_q : {3, 5, 8, 33, 64, 100, 257})
    for (int h_q : {1, 16, 128}) {
      Case c;
      c.b = 3;
      c.s_q = s_q;
      c.h_q = h_q;
      c.causal = true;
      c.explicit_lens = {s_q / 2, s_q + 37, 700};
      add(c, "s_q>1");
      c.causal = false;
      if (s_q <= 64) add(c, "s_q>1");
    }
  // Tensor-parallel head counts, h_q*s_q < 64.
  for (int h_q : {8, 16, 32, 64, 128})
    for (int s_q : {1, 2, 3, 4})
      for (int b : {1, 16, 128})
        for (int s_k : {256, 1000, 4097}) {
          if (b == 128 && s_k == 4097 && h_q >= 64) continue;
          Case c;
          c.b = b;
          c.s_q = s_q;
          c.h_q = h_q;
          c.s_k = s_k;
          c.varlen = true;
          c.causal = (s_q + b) % 2 == 0;
          add(c, "tp-heads");
        }
  // Extra page sizes and d_qk 512.
  for (int pbs : {16, 32, 64, 128, 256})
    for (int d : {576, 512})
      for (auto [h_q, h_kv] : std::vector<std::pair<int, int>>{{1, 1}, {16, 1}, {9, 3}, {64, 8}, {128, 1}, {128, 2}})
        for (int s_q : {1, 2}) {
          Case c;
          c.b = 6;
          c.s_q = s_q;
          c.s_k = (pbs * 7 + d) % 1500 + 30;
          c.varlen = true;
          c.causal = s_q == 2;
          c.h_q = h_q;
          c.h_kv = h_kv;
          c.pbs = pbs;
          c.d = d;
          add(c, "pages-d");
          c.fp16 = true;
          c.zero_seqlen = true;
          if (h_q == 128 && h_kv == 1) add(c, "pages-d-fp16");
        }
  // Layouts (views with offsets and odd strides; FlashMLA's lse strides).
  for (Layout L : {Layout::kContig, Layout::kPadded, Layout::kPaddedOddOut})
    for (auto [h_q, h_kv] : std::vector<std::pair<int, int>>{{1, 1}, {16, 1}, {128, 1}, {64, 8}})
      for (int s_q : {1, 2}) {
        Case c;
        c.b = 5;
        c.s_q = s_q;
        c.s_k = 900;
        c.varlen = true;
        c.causal = true;
        c.h_q = h_q;
        c.h_kv = h_kv;
        c.layout = L;
        c.lse_flashmla = h_kv == 1;
        c.pbs = L == Layout::kPadded ? 32 : 64;
        add(c, "layout");
      }
  // b*s_q > 65535 (combine grid on x).
  {
    Case c;
    c.b = 66000;
    c.s_q = 1;
    c.h_q = 2;
    c.s_k = 5;
    c.pbs = 16;
    c.pad256 = false;
    add(c, "b*s_q>65535");
    c.b = 17000;
    c.s_q = 4;
    c.h_q = 1;
    c.causal = true;
    c.varlen = true;
    c.s_k = 9;
    add(c, "b*s_q>65535");
  }
  return v;
}

std::vector<Case> cpu_check_cases() {
  std::vector<Case> v;
  int i = 0;
  for (int d : {576, 512})
    for (bool fp16 : {false, true})
      for (auto [h_q, h_kv] : std::vector<std::pair<int, int>>{{1, 1}, {3, 3}, {16, 1}, {9, 3}, {64, 2}})
        for (int s_q : {1, 3}) {
          Case c;
          c.group = "cpu-ref";
          c.b = 3;
          c.s_q = s_q;
          c.s_k = 40 + 37 * (i % 7);
          c.varlen = true;
          c.zero_seqlen = (i % 5) == 0;
          c.causal = (i % 2) == 1;
          c.h_q = h_q;
          c.h_kv = h_kv;
          c.d = d;
          c.fp16 = fp16;
          c.pbs = (i % 3 == 0) ? 16 : 64;
          c.layout = (i % 4 == 0) ? Layout::kPadded : Layout::kContig;
          c.cpu_check = true;
          v.push_back(c);
          ++i;
        }
  return v;
}

// ------------------------------------------------------------------ scheduler check
int scheduler_checks(Stats& stats) {
  std::mt19937_64 rng(12345);
  int failures = 0;
  DevBuf dl, dm, dn;
  for (int b : {1, 2, 3, 5, 37, 128, 1000, 5000, 8191, 8192, 20000})  // 8191 = last staged in smem
    for (int parts : {1, 2, 7, 33, 66, 132})
      for (int mode = 0; mode < 3; ++mode) {
        std::vector<int32_t> lens(b);
        for (auto& x : lens) {
          const int r = static_cast<int>(rng() % 100);
          if (mode == 1 && r < 40) x = 0;
          else if (mode == 2) x = static_cast<int>(rng() % 200000);
          else x = static_cast<int>(rng() % 5000);
        }
        int32_t* d_l = static_cast<int32_t*>(dl.get(b * 4));
        int32_t* d_m = static_cast<int32_t*>(dm.get(parts * 32));
        int32_t* d_n = static_cast<int32_t*>(dn.get((b + 1) * 4));
        CUDA_CHECK(cudaMemcpy(d_l, lens.data(), b * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemset(d_m, 0xAB, parts * 32));
        CUDA_CHECK(cudaMemset(d_n, 0xAB, (b + 1) * 4));
        CUDA_CHECK(sm90::launch_tile_scheduler(d_l, b, parts, d_m, d_n, nullptr));
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<TileSchedulerMetadataRow> hm(parts), gm(parts);
        std::vector<int32_t> hn(b + 1), gn(b + 1);
        core::compute_tile_schedule(std::vector<int64_t>(lens.begin(), lens.end()), parts,
                                    core::kDenseDecodeSchedOverheadBlocks, hm.data(), hn.data());
        CUDA_CHECK(cudaMemcpy(gm.data(), d_m, parts * 32, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(gn.data(), d_n, (b + 1) * 4, cudaMemcpyDeviceToHost));
        ++stats.cases;
        if (std::memcmp(hm.data(), gm.data(), parts * 32) != 0 || hn != gn) {
          ++failures;
          ++stats.failed;
          char buf[128];
          std::snprintf(buf, sizeof(buf), "[sched] b=%d parts=%d mode=%d: device metadata != host", b, parts, mode);
          stats.failures.push_back(buf);
          std::printf("FAIL %s\n", buf);
        }
      }
  return failures;
}

// ------------------------------------------------------------------ comparator self-test
// The checks must be able to fail: corrupt one output element (NaN, then a wrong
// value) and one lse element and expect check_outputs to reject each.
int comparator_selftest(Stats& stats, Pools& P, int num_sms) {
  Case c;
  c.group = "selftest";
  c.b = 2;
  c.s_q = 2;
  c.s_k = 300;
  c.h_q = 16;
  c.varlen = true;
  c.seed = 4242;
  Generated g;
  DenseDecodeParams p{};
  RunInfo info;
  int failures = 0;
  auto fail = [&](const std::string& m) {
    ++failures;
    ++stats.failed;
    stats.failures.push_back("[selftest] " + m);
    std::printf("FAIL [selftest] %s\n", m.c_str());
  };
  std::string err = run_case(c, P, num_sms, &info, &g, &p);
  ++stats.cases;
  if (!err.empty()) {
    fail("clean case failed: " + err);
    return failures;
  }
  if (!check_outputs(c, g, P).ok) fail("clean re-check failed");
  uint16_t orig = 0;
  CUDA_CHECK(cudaMemcpy(&orig, g.out.data, 2, cudaMemcpyDeviceToHost));
  for (uint16_t bad : {uint16_t(0x7FC0), uint16_t(0x3F00)}) {  // NaN, 0.5
    CUDA_CHECK(cudaMemcpy(g.out.data, &bad, 2, cudaMemcpyHostToDevice));
    ++stats.cases;
    if (check_outputs(c, g, P).ok) fail("corrupted out element was not detected");
  }
  CUDA_CHECK(cudaMemcpy(g.out.data, &orig, 2, cudaMemcpyHostToDevice));
  float lorig = 0, lbad = 1e30f;
  float* l3 = static_cast<float*>(g.lse.data) + 3;
  CUDA_CHECK(cudaMemcpy(&lorig, l3, 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(l3, &lbad, 4, cudaMemcpyHostToDevice));
  ++stats.cases;
  if (check_outputs(c, g, P).ok) fail("corrupted lse element was not detected");
  lbad = lorig * (1.0f + 3e-4f);
  CUDA_CHECK(cudaMemcpy(l3, &lbad, 4, cudaMemcpyHostToDevice));
  ++stats.cases;
  if (check_outputs(c, g, P).ok) fail("lse off by 3e-4 relative was not detected");
  CUDA_CHECK(cudaMemcpy(l3, &lorig, 4, cudaMemcpyHostToDevice));
  if (!check_outputs(c, g, P).ok) fail("restored outputs fail");
  return failures;
}

// ------------------------------------------------------------------ timing
struct PerfRow {
  std::string name;
  double ms_main, ms_call, tflops, gbps, mean_len, ms_mma, ms_wgmma, ms_seesaw;
};

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

PerfRow time_case(const Case& c, const Generated& g, DenseDecodeParams p, int64_t num_sm_parts, Pools& P) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  const int64_t flush_n = 64ll << 20;  // 256 MiB > L2
  int* fl = static_cast<int*>(P.flush.get(flush_n * 4));
  p.metadata_ready = true;
  // Median ms of `stages` with the given options; NaN when the forced kernel cannot serve the case.
  auto timed = [&](int stages, sm90::DenseDecodeOptions opt = g_options) -> double {
    std::vector<float> t;
    for (int it = 0; it < 23; ++it) {
      flush_kernel<<<grid_for(flush_n), 256>>>(fl, flush_n, it);
      CUDA_CHECK(cudaEventRecord(e0));
      Status st = sm90::dense_decode_launch(p, num_sm_parts, stages, opt);
      CUDA_CHECK(cudaEventRecord(e1));
      if (!st.ok() && st.kind == ErrorKind::kValue && opt.kernel != sm90::DenseKernel::kAuto) {
        CUDA_CHECK(cudaEventSynchronize(e1));
        return std::nan("");
      }
      if (!st.ok()) {
        std::printf("timing launch failed: %s\n", st.message.c_str());
        std::exit(4);
      }
      CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (it >= 3) t.push_back(ms);
    }
    return median(t);
  };
  PerfRow r;
  r.name = describe(c);
  r.ms_main = timed(sm90::kStageMain);
  r.ms_call = timed(sm90::kStageMain | sm90::kStageCombine);
  sm90::DenseDecodeOptions o = g_options;
  o.kernel = sm90::DenseKernel::kMmaSync;
  r.ms_mma = timed(sm90::kStageMain, o);
  o.kernel = sm90::DenseKernel::kWgmma;
  r.ms_wgmma = timed(sm90::kStageMain, o);
  o.kernel = sm90::DenseKernel::kSeesaw;
  r.ms_seesaw = timed(sm90::kStageMain, o);
  double mean_len = 0;
  for (int x : g.seqlens) mean_len += x;
  mean_len /= c.b;
  r.mean_len = mean_len;
  const double flop = static_cast<double>(c.b) * c.h_q * c.s_q * (2.0 * c.d * mean_len + 2.0 * mean_len * kDv);
  const double bytes = static_cast<double>(c.b) *
                       (c.s_q * c.h_q * c.d * 2.0 + mean_len * c.h_kv * c.d * 2.0 + c.s_q * c.h_q * kDv * 2.0);
  r.tflops = flop / (r.ms_main * 1e-3) / 1e12;
  r.gbps = bytes / (r.ms_main * 1e-3) / 1e9;
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, no_perf = false, perf_only = false, probe = false;
  int max_cases = 1 << 30;
  int only_perf = -1;  // run only this index of the perf list (for profilers)
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--no-perf")) no_perf = true;
    else if (!std::strcmp(argv[i], "--perf-only")) perf_only = true;
    else if (!std::strcmp(argv[i], "--probe")) probe = true;
    else if (!std::strcmp(argv[i], "--only-perf") && i + 1 < argc) only_perf = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-cases") && i + 1 < argc) max_cases = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--kernel") && i + 1 < argc) {
      const char* k = argv[++i];
      if (!std::strcmp(k, "mma")) g_options.kernel = sm90::DenseKernel::kMmaSync;
      else if (!std::strcmp(k, "wgmma")) g_options.kernel = sm90::DenseKernel::kWgmma;
      else if (!std::strcmp(k, "seesaw")) g_options.kernel = sm90::DenseKernel::kSeesaw;
      else if (std::strcmp(k, "auto") != 0) {
        std::printf("--kernel must be auto, mma, wgmma or seesaw, got %s\n", k);
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--tune") && i + 1 < argc) g_options.tuning = std::atoi(argv[++i]);
  }
  std::printf("main kernel %d (0 = automatic, 1 mma.sync, 2 wgmma, 4 seesaw), tuning flags %d\n",
              static_cast<int>(g_options.kernel), g_options.tuning);
  int ndev = 0;
  CUDA_CHECK(cudaGetDeviceCount(&ndev));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int num_sms = sm90::num_sms(0);
  std::printf("device: %s, cc %d.%d, %d SMs, supported=%d\n", prop.name, prop.major, prop.minor, num_sms,
              sm90::device_supported(0));
  if (!sm90::device_supported(0)) {
    std::printf("FAIL: device not supported\n");
    return 1;
  }
  if (probe) return 0;
  const auto t_start = std::chrono::steady_clock::now();
  Stats stats;
  Pools P;

  auto run_list = [&](const std::vector<Case>& list, const char* title) {
    int n = 0, f = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < list.size() && n < max_cases; ++i) {
      if (quick && (i % 17) != 0) continue;
      Case c = list[i];
      c.seed = static_cast<uint64_t>(stats.cases) + 1;
      std::string err = run_case(c, P, num_sms);
      ++n;
      ++stats.cases;
      if (!err.empty()) {
        ++f;
        ++stats.failed;
        const std::string line = describe(c) + ": " + err;
        stats.failures.push_back(line);
        if (f <= 30) std::printf("FAIL %s\n", line.c_str());
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-28s %5d cases, %4d failed  (%.1f s)\n", title, n, f, s);
    std::fflush(stdout);
  };

  if (!perf_only) {
    {
      const int f = scheduler_checks(stats);
      std::printf("%-28s %5d failed\n", "scheduler (device vs host)", f);
    }
    {
      const int f = comparator_selftest(stats, P, num_sms);
      std::printf("%-28s %5d failed\n", "comparator self-test", f);
    }
    run_list(cpu_check_cases(), "cpu-reference cross-check");
    run_list(extra_cases(), "edge cases/pages/layouts");
    run_list(spec_grid(false), "spec grid bf16 (2304)");
    run_list(corner_cases(), "corner bf16 (32)");
    run_list(spec_grid(true), "fp16 subset");
  }

  // Performance cases: correctness + timing.
  std::vector<PerfRow> rows;
  {
    std::vector<Case> perf = perf_cases(false);
    for (auto c : perf_cases(true))
      if (c.s_k == 8192 || c.s_k == 32768) perf.push_back(c);
    // memory-bound anchors: b=128, s_q=1, s_k=8192 fixed, h_q 16/32/64
    for (int h_q : {16, 32, 64}) {
      Case c;
      c.group = "mem";
      c.b = 128;
      c.s_q = 1;
      c.s_k = 8192;
      c.h_q = h_q;
      c.perf = true;
      perf.push_back(c);
    }
    if (only_perf >= 0 && only_perf < static_cast<int>(perf.size())) perf = {perf[only_perf]};
    int f = 0;
    for (auto& c : perf) {
      c.seed = static_cast<uint64_t>(stats.cases) + 1;
      Generated g;
      DenseDecodeParams p{};
      RunInfo info;
      std::string err = run_case(c, P, num_sms, &info, &g, &p);
      ++stats.cases;
      if (!err.empty()) {
        ++f;
        ++stats.failed;
        stats.failures.push_back(describe(c) + ": " + err);
        std::printf("FAIL %s: %s\n", describe(c).c_str(), err.c_str());
        continue;
      }
      if (!no_perf) rows.push_back(time_case(c, g, p, info.num_sm_parts, P));
    }
    std::printf("%-28s %5zu cases, %4d failed\n", "perf shapes (checked)", perf.size(), f);
  }

  if (!rows.empty()) {
    std::printf("\nTiming (median of 20, L2 flushed; main = split-KV kernel only, call = main + combine)\n");
    std::printf("(mma/wgmma/seesaw = main kernel forced to that kernel, nan where it cannot serve the case; "
                "tuning flags %d)\n", g_options.tuning);
    std::printf("%-100s %9s %9s %9s %9s %9s %9s %9s %9s\n", "case", "mean_len", "main_ms", "call_ms", "TFLOP/s",
                "GB/s", "mma_ms", "wgmma_ms", "seesaw_ms");
    for (auto& r : rows)
      std::printf("%-100s %9.0f %9.4f %9.4f %9.1f %9.0f %9.4f %9.4f %9.4f\n", r.name.c_str(), r.mean_len,
                  r.ms_main, r.ms_call, r.tflops, r.gbps, r.ms_mma, r.ms_wgmma, r.ms_seesaw);
  }

  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::printf("\nSUMMARY: %d checks, %d failed, %.1f s\n", stats.cases, stats.failed, secs);
  if (g_skipped > 0)
    std::printf("(%d of the checks skipped: the forced main kernel cannot serve their shapes)\n", g_skipped);
  for (size_t i = 0; i < stats.failures.size() && i < 50; ++i) std::printf("  %s\n", stats.failures[i].c_str());
  return stats.failed == 0 ? 0 : 1;
}
