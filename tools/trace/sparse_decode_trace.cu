// tools/trace/sparse_decode_trace.cu — event timeline of the sparse FP8 decode producer kernel (wgmma_producer_kernel.cuh; diagnostic).
//
// Question it answers: do the consumer warpgroups of src/sm90/decode/sparse_fp8/wgmma_producer_kernel.cuh wait for the
// producer warpgroup (its FP8 dequantization into the two K buffers), and where in the block step?
//
// Builds the producer kernel with FLASHMLA_TRACE defined (the events of the header's
// FLASHMLA_SPARSE_DECODE_TRACE_* list), makes random inputs the way bench/bench_sparse_decode.py does
// (s_q 2, varlen lengths N(s_kv, s_kv / 2), per-request random page tables, topk distinct tokens per
// (request, row) in random order with -1 for the slots past a short request's length, FP8 caches in the
// exact V32 / MODEL1 byte layouts of spec §3.3 / §3.4 with FlashMLA's padded block strides,
// power-of-two scales 2^-7, RoPE ~ N(0, 1) / 10, q ~ N(0, 1) clamped to [-1, 1], attention sink on,
// softmax scale d_qk^-0.55),
// runs the project's device scheduler (src/sm90/common/scheduler.cu) with num_sm_parts from
// core::sparse_decode_num_sm_parts, picks the plain or 2-CTA cluster kernel with the library's rule
// (sparse::wgmma_producer::launch: head-tile pairs, clusters resident; FLASHMLA_TRACE_CLUSTER=0|1 forces one), times the
// main kernel alone (CUDA events, an L2 flush of FLASHMLA_TRACE_FLUSH_GB GB, default 8 as the benchmark,
// before every run), then runs it once more with the trace buffer set and prints, per role, the median
// cycles between the events of a block step over the traced CTAs' inner steps, the fraction of each
// consumer step spent waiting for the producer, the producer's fraction waiting for free buffers, the
// cross-role alignment, every CTA's first block and first request from its entry (the whole life of a
// b = 2 CTA) and one CTA's timeline. Not a test: the output is not checked (tests/gpu covers
// correctness); a sanity line counts the unsplit requests' lse values the kernel left unwritten.
//
// Build (from the repository root; sm_90a; SPARSE_TRACE_FMT=1 builds only the V32 kernels, 2 only
// MODEL1's, 0 or unset both) and run:
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc -I.deps/cutlass_include
//        -DFLASHMLA_WITH_CUDA -DFLASHMLA_TRACE --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
//        -o /tmp/sparse_decode_trace tools/trace/sparse_decode_trace.cu src/sm90/common/scheduler.cu src/core/scheduler.cpp
//   (one command line; tools/trace/run-sparse-decode-trace.sh runs it)
//   /tmp/sparse_decode_trace v32 128            # format(v32|model1|model1c4) [b=128] [h_q=128] [every=1]
// model1 = MODEL1 config2 (topk 128 in a page-256 cache + extra_topk 1024 in a page-64 cache);
// model1c4 = config4 (extra page 2, random extra_topk_length). Environment (of this tool):
// FLASHMLA_TRACE_CLUSTER=0|1 (the cluster variant off / on; on, it still runs only where the library's rule
// allows it: head-tile pairs, clusters resident; unset: the library's default), FLASHMLA_TRACE_STEP0=N (trace blocks N .. N + 39 of every CTA instead of 0 .. 39),
// FLASHMLA_TRACE_REPS (timed runs, default 20), FLASHMLA_TRACE_FLUSH_GB, FLASHMLA_TRACE_SEED. every: trace the
// CTAs whose linear id blockIdx.y * gridDim.x + blockIdx.x is a multiple of it (default 1: all; the
// cluster-peer lines need both CTAs of a pair). `sparse_decode_trace selftest` (no GPU) checks the index
// generation's rules and runs the statistics on synthetic records with known waits.
//
// Steps: the kernel's trace step of roles 0-2 is the CTA's running block counter g (0, 1, ... over all of
// the CTA's (request, split) items; 64 slots per block), so one traced CTA records its blocks
// step0 .. step0 + 39. "Inner" steps, the ones the statistics use: g >= 2 (both buffers have been used, so
// the producer's free waits are real), not the first or last block of a request (those include the Q
// reload / the epilogue), and with the next step recorded (for the period).
//
// Caveats: the clocks are each SM's clock64 (cycles), so cross-role comparisons are within a CTA only;
// the cluster peers are compared by %globaltimer at entry / exit alone. The "kernel time" is that of this
// traced build with the trace off (a null record pointer: every event is a skipped predicated store); the
// traced run's own time is printed next to it. ptxas (CUDA 13) spills a little more in the traced build:
// V32 plain 16 B in the producer's part-B stores (4 STL + 4 LDL per block and thread) and 16 B in warpgroup
// 1's epilogue; the other three variants 16 B in warpgroup 1's epilogue only (once per request). The
// events are plain stores between the kernel's own statements; the compiler may still move independent
// arithmetic across a clock read (e.g. WG1's O rescale across its event 2).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "trace_host.cuh"
#include "core/scheduler.h"
#include "sm90/decode/sparse_fp8/sparse_decode.h"
#include "sm90/decode/sparse_fp8/wgmma_producer_kernel.cuh"

#ifndef FLASHMLA_TRACE
#error "build with -DFLASHMLA_TRACE"
#endif
#ifndef SPARSE_TRACE_FMT
#define SPARSE_TRACE_FMT 0
#endif

namespace {

namespace tr = flashmla::sm90::trace;
namespace wp = flashmla::sm90::sparse::wgmma_producer;
using flashmla::sm90::SparseDecodeKernelParams;
using flashmla::sm90::SparseDecodeMainKernel;
using flashmla::sm90::SparseScope;
using flashmla::sm90::sparse::Fmt;


// ---------------------------------------------------------------- inputs
// ~N(0, 1) from four uniforms (Irwin-Hall; the values do not affect the speed).
__device__ inline float normalish(uint64_t key) {
  const uint32_t a = mix(key * 4 + 0), b = mix(key * 4 + 1), c = mix(key * 4 + 2), d = mix(key * 4 + 3);
  const float s = (a + 0.5f) * 2.3283064e-10f + (b + 0.5f) * 2.3283064e-10f + (c + 0.5f) * 2.3283064e-10f +
                  (d + 0.5f) * 2.3283064e-10f;
  return (s - 2.f) * 1.7320508f;
}
// Four e4m3 bytes, each uniform over 0..254 without 0x7F (the benchmark: randint(0, 254), +1 from 127 on;
// 0x7F / 0xFF are the NaN codes).
__device__ inline uint32_t fp8x4(uint64_t key) {
  const uint32_t h = mix(key);
  uint32_t w = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t r = ((h >> (8 * k)) & 0xFFu) % 254u;
    r += r >= 127u ? 1u : 0u;
    w |= r << (8 * k);
  }
  return w;
}
__device__ inline uint32_t bf16x2_rope(uint64_t key) {
  const __nv_bfloat16 lo = __float2bfloat16(normalish(2 * key) * 0.1f);
  const __nv_bfloat16 hi = __float2bfloat16(normalish(2 * key + 1) * 0.1f);
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}
// The whole cache, word by word: n_blocks blocks of `stride` bytes (a multiple of 16).
// V32 (spec §3.3): token r of a block at r * 656: 512 e4m3, 4 fp32 scales (2^-7), 64 bf16 RoPE; the
// padding row (the block stride is (pbs + 1) * 656) random bytes. MODEL1 (§3.4): token r at r * 576:
// 448 e4m3 + 64 bf16 RoPE; at pbs * 576 + 8 r its 7 e8m0 scales + pad (all 120 = 2^-7, as the
// benchmark); the rest of the 576-padded block random bytes.
__global__ void fill_cache(uint32_t* w, int64_t n_words, int64_t stride_bytes, int pbs, int v32, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t off = (i * 4) % stride_bytes;  // byte offset inside the page block
    const uint64_t key = static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ULL + seed;
    uint32_t v = fp8x4(key);
    if (v32) {
      if (off < static_cast<int64_t>(pbs) * 656) {
        const int pos = static_cast<int>(off % 656);
        if (pos >= 512 && pos < 528) v = 0x3C000000u;  // fp32 2^-7
        else if (pos >= 528) v = bf16x2_rope(key);
      }
    } else {
      if (off < static_cast<int64_t>(pbs) * 576) {
        if (off % 576 >= 448) v = bf16x2_rope(key);
      } else if (off < static_cast<int64_t>(pbs) * 584) {
        v = 0x78787878u;  // e8m0 120 = 2^-7 (and the pad byte)
      }
    }
    w[i] = v;
  }
}
__global__ void fill_q(__nv_bfloat16* q, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    q[i] = __float2bfloat16(fminf(fmaxf(normalish(static_cast<uint64_t>(i) + seed), -1.f), 1.f));
}

struct ScopeCfg {
  int s_kv, topk, pbs;
  bool with_len;
};
struct CaseCfg {
  const char* name;
  int d_qk;
  ScopeCfg main;
  bool has_extra;
  ScopeCfg extra;
  int b_default;
};

/// One cache + its indices, built as bench_sparse_decode.py's make_scope.
struct Scope {
  int pbs = 1, topk = 0;
  int64_t n_blocks = 0, stride = 0;
  std::vector<int32_t> idx;  // (b, s_q, topk)
  std::vector<int32_t> len;  // (b,) or empty
  std::vector<int> lens;     // per request: the sequence length the indices were drawn from
  std::vector<int32_t> bt;   // (b, max_pad / pbs) page table
  int64_t pages = 0;         // pages per request
  int64_t n_invalid = 0;
  uint8_t* d_cache = nullptr;
  int32_t* d_idx = nullptr;
  int32_t* d_len = nullptr;
};

Scope gen_scope(int b, int s_q, const ScopeCfg& c, int d_qk, std::mt19937_64& rng) {
  Scope sc;
  sc.pbs = c.pbs;
  sc.topk = c.topk;
  std::normal_distribution<double> nd(c.s_kv, c.s_kv / 2.0);
  std::vector<int> lens(b);
  for (int i = 0; i < b; ++i) lens[i] = std::max(static_cast<int>(nd(rng)), s_q);  // Python int(): toward 0
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  const int64_t unit = 4LL * c.pbs;
  const int64_t max_pad = std::max<int64_t>((max_len + unit - 1) / unit, 1) * unit;
  const int64_t pages = max_pad / c.pbs;
  sc.n_blocks = b * pages;
  if (sc.n_blocks * c.pbs >= (1LL << 31)) {
    std::fprintf(stderr, "cache too large for int32 indices\n");
    std::exit(2);
  }
  sc.stride = d_qk == 576 ? (c.pbs + 1) * 656LL : (c.pbs * 584LL + 575) / 576 * 576;
  sc.pages = pages;
  std::vector<int32_t>& bt = sc.bt;
  bt.resize(sc.n_blocks);
  std::iota(bt.begin(), bt.end(), 0);
  std::shuffle(bt.begin(), bt.end(), rng);  // torch.randperm(nb).view(b, -1)
  sc.idx.assign(static_cast<size_t>(b) * s_q * c.topk, -1);
  std::vector<uint8_t> seen;
  std::vector<int32_t> perm;
  for (int i = 0; i < b; ++i) {
    const int L = lens[i];
    seen.assign(L, 0);
    for (int s = 0; s < s_q; ++s) {
      int32_t* row = sc.idx.data() + (static_cast<size_t>(i) * s_q + s) * c.topk;
      // topk smallest of random keys over [0, max_pad), keys of t >= L set to 2: the first min(topk, L)
      // slots are distinct tokens of [0, L) in random order, the rest (t >= L) invalid, -1; all invalid
      // when topk > max_pad (the benchmark's fallback).
      const int n_valid = c.topk > max_pad ? 0 : std::min(c.topk, L);
      std::vector<int32_t> tok(n_valid);
      if (2LL * n_valid <= L) {
        for (int k = 0; k < n_valid;) {
          const int t = static_cast<int>(rng() % static_cast<uint64_t>(L));
          if (seen[t]) continue;
          seen[t] = 1;
          tok[k++] = t;
        }
        for (int k = 0; k < n_valid; ++k) seen[tok[k]] = 0;
      } else {
        perm.resize(L);
        std::iota(perm.begin(), perm.end(), 0);
        for (int k = 0; k < n_valid; ++k) {
          const int r = k + static_cast<int>(rng() % static_cast<uint64_t>(L - k));
          std::swap(perm[k], perm[r]);
          tok[k] = perm[k];
        }
      }
      for (int k = 0; k < n_valid; ++k)
        row[k] = bt[static_cast<size_t>(i) * pages + tok[k] / c.pbs] * c.pbs + tok[k] % c.pbs;
      sc.n_invalid += c.topk - n_valid;
    }
  }
  if (c.with_len) {
    sc.len.resize(b);
    for (int i = 0; i < b; ++i) sc.len[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(c.topk + 1));
  }
  sc.lens = lens;
  return sc;
}

void upload_scope(Scope& sc, const ScopeCfg& c, int d_qk, uint64_t seed) {
  const int64_t bytes = sc.n_blocks * sc.stride;
  CHECK(cudaMalloc(&sc.d_cache, bytes));
  fill_cache<<<4096, 256>>>(reinterpret_cast<uint32_t*>(sc.d_cache), bytes / 4, sc.stride, c.pbs, d_qk == 576 ? 1 : 0,
                            seed);
  CHECK(cudaGetLastError());
  CHECK(cudaMalloc(&sc.d_idx, sc.idx.size() * sizeof(int32_t)));
  CHECK(cudaMemcpy(sc.d_idx, sc.idx.data(), sc.idx.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  if (!sc.len.empty()) {
    CHECK(cudaMalloc(&sc.d_len, sc.len.size() * sizeof(int32_t)));
    CHECK(cudaMemcpy(sc.d_len, sc.len.data(), sc.len.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  std::printf("  scope: pbs %d topk %d, %lld page blocks of %lld bytes (%.2f GB), lengths %s, %lld of %zu slots -1\n",
              c.pbs, c.topk, static_cast<long long>(sc.n_blocks), static_cast<long long>(sc.stride), bytes / 1e9,
              c.with_len ? "random" : "none", static_cast<long long>(sc.n_invalid), sc.idx.size());
}

/// As sparse_decode.cu's make_scope (the cache is (n_blocks, pbs, 1, bytes per token), contiguous tokens).
SparseScope kernel_scope(const Scope& s, int s_q) {
  SparseScope k;
  k.cache = s.d_cache;
  k.block_stride = s.stride;
  k.page_block_size = s.pbs;
  k.pbs_magic = flashmla::core::page_div_magic(static_cast<uint32_t>(s.pbs));
  k.num_tokens = static_cast<int>(s.n_blocks * s.pbs);
  k.indices = s.d_idx;
  k.idx_stride_b = static_cast<int64_t>(s_q) * s.topk;
  k.idx_stride_s = s.topk;
  k.idx_stride_k = 1;
  k.topk = s.topk;
  k.topk_length = s.d_len;
  const bool base_ok = reinterpret_cast<uintptr_t>(s.d_cache) % 16 == 0;
  const bool stride_ok = s.n_blocks <= 1 || s.stride % 16 == 0;
  k.vec = base_ok && stride_ok ? 1 : 0;
  return k;
}

// ---------------------------------------------------------------- kernel choice (wp::launch's rule, unless
// FLASHMLA_TRACE_CLUSTER forces the variant)
template <Fmt F>
bool library_picks_cluster(const SparseDecodeKernelParams& kp, int num_sm_parts) {
  bool on = wp::kClusterDefault<F>;
  if (const char* env = std::getenv("FLASHMLA_TRACE_CLUSTER"); env != nullptr && env[0] != '\0')
    on = env[0] != '0';
  if (on && kp.num_head_tiles % 2 == 0) {
    const long long clusters = static_cast<long long>(kp.s_q) * kp.num_head_tiles / 2 * num_sm_parts;
    if (clusters <= wp::max_active_clusters<F>()) return true;
  }
  return false;
}

template <Fmt F>
cudaError_t launch_variant(bool cluster, const SparseDecodeKernelParams& kp, int num_sm_parts) {
  if (wp::batched_form(kp))
    return cluster ? wp::launch_k<F, true, true>(kp, num_sm_parts, 0) : wp::launch_k<F, false, true>(kp, num_sm_parts, 0);
  return cluster ? wp::launch_k<F, true, false>(kp, num_sm_parts, 0) : wp::launch_k<F, false, false>(kp, num_sm_parts, 0);
}

template <Fmt F>
cudaError_t kernel_attributes(cudaFuncAttributes* fa, bool cluster, bool batched) {
  if (batched)
    return cluster ? cudaFuncGetAttributes(fa, wp::flash_fwd_splitkv_mla_fp8_sparse_kernel_wgmma_producer<F, true, true>)
                   : cudaFuncGetAttributes(fa, wp::flash_fwd_splitkv_mla_fp8_sparse_kernel_wgmma_producer<F, false, true>);
  return cluster ? cudaFuncGetAttributes(fa, wp::flash_fwd_splitkv_mla_fp8_sparse_kernel_wgmma_producer<F, true, false>)
                 : cudaFuncGetAttributes(fa, wp::flash_fwd_splitkv_mla_fp8_sparse_kernel_wgmma_producer<F, false, false>);
}

// ---------------------------------------------------------------- statistics
double quant(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(q * static_cast<double>(v.size()));
  if (i >= v.size()) i = v.size() - 1;
  return v[i];
}
double med(const std::vector<double>& v) { return quant(v, 0.5); }
double sum(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }

constexpr int kRoleEvents[3] = {10, 7, 10};
const char* const kRoleName[3] = {"WG0 (S, softmax, O[:, :256])", "WG1 (O[:, 256:])", "producer"};
const char* const kEvName[3][10] = {
    {"start = wait A", "A full", "S(A) issued", "B full", "S done", "softmax done", "PV_L issued", "P announced",
     "PV_L done", "A released"},
    {"start = wait P", "P ready", "wait B", "B full", "PV_R issued", "PV_R done", "B released", "", "", ""},
    {"block start", "loads issued", "A free", "A stored", "A arrived", "next addr", "B free", "B stored",
     "B arrived", "step done"}};

struct Cta {
  int slot = 0, id = 0, rank = 0, smid = 0, n_blk = 0, begin_req = 0, end_req = 0, W = 0;
  bool cluster = false, v32 = false;
  unsigned long long clk_entry = 0, clk_init = 0, clk_done = 0, clk_exit = 0, ns_entry = 0, ns_exit = 0;
  std::vector<int> kind;  // per local step: bit 0 first block of a request, bit 1 last block
};

/// Prints the statistics of one traced run's records h (slots CTAs). Returns 1 when no CTA has records.
int analyze(const std::vector<unsigned long long>& h, int slots, int every, int step0, bool cluster, bool v32) {
  auto at = [&](int slot, int role, int step, int ev) -> unsigned long long {
    return h[((static_cast<size_t>(slot) * tr::kRoles + role) * tr::kMaxSteps + step) * tr::kEvents + ev];
  };
  constexpr int kSum = tr::kMaxSteps - 1;  // role 3's summary step
  std::vector<Cta> ctas;
  for (int s = 0; s < slots; ++s) {
    const unsigned long long mark = at(s, 3, kSum, 11);
    if (!(mark & 0x100u)) continue;  // no work (empty partition) or not finished
    Cta c;
    c.slot = s;
    c.id = s * every;
    c.cluster = (mark & 1u) != 0;
    c.v32 = (mark & 2u) != 0;
    c.clk_entry = at(s, 3, kSum, 0);
    c.clk_init = at(s, 3, kSum, 1);
    c.clk_done = at(s, 3, kSum, 2);
    c.clk_exit = at(s, 3, kSum, 3);
    c.ns_entry = at(s, 3, kSum, 4);
    c.ns_exit = at(s, 3, kSum, 5);
    c.smid = static_cast<int>(at(s, 3, kSum, 6));
    c.rank = static_cast<int>(at(s, 3, kSum, 7));
    c.n_blk = static_cast<int>(at(s, 3, kSum, 8));
    c.begin_req = static_cast<int>(at(s, 3, kSum, 9));
    c.end_req = static_cast<int>(at(s, 3, kSum, 10));
    c.W = std::clamp(c.n_blk - step0, 0, tr::kMaxSteps);
    c.kind.assign(c.W, 0);
    const int n_req = std::min(c.end_req - c.begin_req + 1, tr::kMaxSteps - 1);
    for (int r = 0; r < n_req; ++r) {
      const int g0 = static_cast<int>(at(s, 3, r, 8)), nb = static_cast<int>(at(s, 3, r, 9));
      if (nb <= 0) continue;
      const int first = g0 - step0, last = g0 + nb - 1 - step0;
      if (first >= 0 && first < c.W) c.kind[first] |= 1;
      if (last >= 0 && last < c.W) c.kind[last] |= 2;
    }
    ctas.push_back(c);
  }
  if (ctas.empty()) {
    std::printf("no traced CTA has records\n");
    return 1;
  }
  if (ctas[0].cluster != cluster || ctas[0].v32 != v32) std::printf("WARNING: the records' variant differs from the launch\n");
  auto inner = [&](const Cta& c, int k) {
    return k + step0 >= 2 && k + 1 < c.W && c.kind[k] == 0;
  };
  auto ev = [&](const Cta& c, int role, int k, int e) -> double { return static_cast<double>(at(c.slot, role, k, e)); };
  auto has = [&](const Cta& c, int role, int k, int e) { return at(c.slot, role, k, e) != 0; };

  {  // CTA-level summary
    std::vector<double> nb, dur_clk, dur_ns, ghz, per_blk, entry_ns;
    for (const Cta& c : ctas) {
      nb.push_back(c.n_blk);
      dur_clk.push_back(double(c.clk_exit - c.clk_entry));
      if (c.ns_exit > c.ns_entry) {
        dur_ns.push_back(double(c.ns_exit - c.ns_entry));
        ghz.push_back(double(c.clk_exit - c.clk_entry) / double(c.ns_exit - c.ns_entry));
      }
      if (c.n_blk > 0) per_blk.push_back(double(c.clk_done - c.clk_init) / c.n_blk);
      entry_ns.push_back(double(c.ns_entry));
    }
    const double g = med(ghz);
    std::printf("CTAs with records %zu: blocks per CTA min %.0f median %.0f max %.0f; CTA entry->exit median %.0f cycles "
                "(max %.0f), %.1f us by %%globaltimer (max %.1f); cycles / ns %.3f; consumer cycles per block "
                "(init -> WG0 done) / blocks: median %.0f\n",
                ctas.size(), quant(nb, 0), med(nb), quant(nb, 1), med(dur_clk), quant(dur_clk, 1), med(dur_ns) / 1e3,
                quant(dur_ns, 1) / 1e3, g, med(per_blk));
    std::printf("CTA start spread (globaltimer): %.1f us between the first and the last traced CTA\n",
                (quant(entry_ns, 1) - quant(entry_ns, 0)) / 1e3);
    if (cluster) {
      std::vector<double> dstart, dend;
      for (size_t i = 0; i + 1 < ctas.size(); ++i)
        if (ctas[i].id % 2 == 0 && ctas[i + 1].id == ctas[i].id + 1) {
          dstart.push_back(std::fabs(double(ctas[i].ns_entry) - double(ctas[i + 1].ns_entry)));
          dend.push_back(std::fabs(double(ctas[i].ns_exit) - double(ctas[i + 1].ns_exit)));
        }
      if (!dstart.empty())
        std::printf("cluster peers (%zu pairs): |entry difference| median %.0f ns (max %.0f), |exit difference| "
                    "median %.0f ns (max %.0f)\n",
                    dstart.size(), med(dstart), quant(dstart, 1), med(dend), quant(dend, 1));
    }
  }

  // Per role: the step period and the events of a step, over the inner steps.
  for (int role = 0; role < 3; ++role) {
    std::vector<double> per;
    std::vector<std::vector<double>> from0(kRoleEvents[role]), dprev(kRoleEvents[role]);
    for (const Cta& c : ctas)
      for (int k = 0; k < c.W; ++k) {
        if (!inner(c, k) || !has(c, role, k, 0) || !has(c, role, k + 1, 0)) continue;
        per.push_back(ev(c, role, k + 1, 0) - ev(c, role, k, 0));
        for (int e = 1; e < kRoleEvents[role]; ++e)
          if (has(c, role, k, e) && has(c, role, k, e - 1)) {
            from0[e].push_back(ev(c, role, k, e) - ev(c, role, k, 0));
            dprev[e].push_back(ev(c, role, k, e) - ev(c, role, k, e - 1));
          }
      }
    std::printf("%s: step period (event 0 to the next step's event 0) median %.0f cycles, p10 %.0f, p90 %.0f, n %zu\n",
                kRoleName[role], med(per), quant(per, 0.1), quant(per, 0.9), per.size());
    std::printf("  %-2s %-14s %10s %10s %8s %8s  (medians; p10 / p90 of 'from e0')\n", "e", "event", "d(prev)",
                "from e0", "p10", "p90");
    for (int e = 1; e < kRoleEvents[role]; ++e)
      std::printf("  %-2d %-14s %10.0f %10.0f %8.0f %8.0f\n", e, kEvName[role][e], med(dprev[e]), med(from0[e]),
                  quant(from0[e], 0.1), quant(from0[e], 0.9));
    std::printf("  %-2s %-14s %10.0f  (rest of the period after the last event)\n", "", "to next e0",
                med(per) - med(from0[kRoleEvents[role] - 1]));
  }

  // Waiting fractions: per inner step, wait / period; "all" = sum of waits / sum of periods.
  auto frac_line = [&](const char* what, int role, auto wait_of, int rank_sel) -> double {
    std::vector<double> w, p, r;
    for (const Cta& c : ctas) {
      if (rank_sel >= 0 && c.rank != rank_sel) continue;
      for (int k = 0; k < c.W; ++k) {
        if (!inner(c, k) || !has(c, role, k + 1, 0)) continue;
        bool ok = true;
        for (int e = 0; e < kRoleEvents[role]; ++e) ok = ok && has(c, role, k, e);
        if (!ok) continue;
        const double pp = ev(c, role, k + 1, 0) - ev(c, role, k, 0), ww = wait_of(c, k);
        w.push_back(ww);
        p.push_back(pp);
        r.push_back(pp > 0 ? ww / pp : 0.0);
      }
    }
    if (p.empty()) return NAN;
    std::printf("  %-52s %5.1f%% of its step time (per-step median %5.1f%%, p90 %5.1f%%; median wait %.0f of %.0f "
                "cycles; n %zu)%s\n",
                what, 100.0 * sum(w) / sum(p), 100.0 * med(r), 100.0 * quant(r, 0.9), med(w), med(p), p.size(),
                rank_sel < 0 ? "" : (rank_sel == 0 ? " [rank 0]" : " [rank 1]"));
    return sum(w) / sum(p);
  };
  std::printf("waiting (inner steps):\n");
  const int n_rank_sel = cluster ? 3 : 1;
  double f_wg0 = NAN, f_prod = NAN, f_wg1p = NAN;
  for (int rs = -1; rs < n_rank_sel - 1; ++rs) {
    const double fw = frac_line("WG0 waits for K (parts A + B full)", 0, [&](const Cta& c, int k) {
      return (ev(c, 0, k, 1) - ev(c, 0, k, 0)) + (ev(c, 0, k, 3) - ev(c, 0, k, 2));
    }, rs);
    frac_line("WG0 waits for K part A", 0, [&](const Cta& c, int k) { return ev(c, 0, k, 1) - ev(c, 0, k, 0); }, rs);
    frac_line("WG0 waits for K part B", 0, [&](const Cta& c, int k) { return ev(c, 0, k, 3) - ev(c, 0, k, 2); }, rs);
    const double f1 = frac_line("WG1 waits for P (WG0's S + softmax of the block)", 1,
                                [&](const Cta& c, int k) { return ev(c, 1, k, 1) - ev(c, 1, k, 0); }, rs);
    frac_line("WG1 waits for K part B", 1, [&](const Cta& c, int k) { return ev(c, 1, k, 3) - ev(c, 1, k, 2); }, rs);
    const double fp = frac_line("producer waits for free buffers (A + B)", 2, [&](const Cta& c, int k) {
      return (ev(c, 2, k, 2) - ev(c, 2, k, 1)) + (ev(c, 2, k, 6) - ev(c, 2, k, 5));
    }, rs);
    if (rs == -1) {
      f_wg0 = fw;
      f_wg1p = f1;
      f_prod = fp;
    }
    frac_line("producer dequant + store (A + B, incl. load latency)", 2, [&](const Cta& c, int k) {
      return (ev(c, 2, k, 3) - ev(c, 2, k, 2)) + (ev(c, 2, k, 7) - ev(c, 2, k, 6));
    }, rs);
  }

  {
    const char* v = "no inner steps";
    if (!std::isnan(f_wg0) && !std::isnan(f_prod)) {
      if (f_wg0 >= 0.10 && f_prod < 0.10) v = "the consumers wait for the producer (producer-bound)";
      else if (f_wg0 < 0.10 && f_prod >= 0.10) v = "the producer waits for free buffers (consumer-bound)";
      else if (f_wg0 < 0.10 && f_prod < 0.10) v = "neither waits much (both busy: balanced)";
      else v = "both wait (see the handoffs: barrier latency or the cluster peer)";
    }
    std::printf("verdict (heuristic, 10%% thresholds on the aggregate fractions): WG0 K wait %.1f%%, producer free "
                "wait %.1f%%, WG1 P wait %.1f%%: %s\n",
                100.0 * f_wg0, 100.0 * f_prod, 100.0 * f_wg1p, v);
  }

  // Cross-role (one SM clock per CTA): the handoffs of block g. Each is event (ra, ea) of block k minus
  // event (rb, eb) of block k - back; "waited" = the waiting role wr spent > 200 cycles from its event w0
  // to w1 of block k.
  auto handoff = [&](const char* what, int ra, int ea, int rb, int eb, int back, int wr, int w0, int w1) {
    std::vector<double> all, wt;
    for (const Cta& c : ctas)
      for (int k = 0; k < c.W; ++k) {
        if (!inner(c, k) || k < back || !has(c, ra, k, ea) || !has(c, rb, k - back, eb)) continue;
        const double v = ev(c, ra, k, ea) - ev(c, rb, k - back, eb);
        all.push_back(v);
        if (ev(c, wr, k, w1) - ev(c, wr, k, w0) > 200) wt.push_back(v);
      }
    std::printf("  %-70s median %7.0f p10 %7.0f p90 %7.0f (n %zu); when the waiter waited > 200: median %7.0f (n %zu)\n",
                what, med(all), quant(all, 0.1), quant(all, 0.9), all.size(), med(wt), wt.size());
  };
  std::printf("handoffs of block g (cycles; the events are warp 0's of each warpgroup, the barriers wait for all "
              "warps; cluster: a wait that ends well after this CTA's own arrivals / releases was for the peer CTA):\n");
  handoff("WG0 part A full minus producer warp 0's A arrival (same block)", 0, 1, 2, 4, 0, 0, 0, 1);
  handoff("WG0 part B full minus producer warp 0's B arrival (same block)", 0, 3, 2, 8, 0, 0, 2, 3);
  handoff("producer warp 0's B arrival minus WG0's block start (< 0: in time)", 2, 8, 0, 0, 0, 0, 0, 3);
  handoff("producer part A free minus WG0 warp 0's release of A of block g - 2", 2, 2, 0, 9, 2, 2, 1, 2);
  handoff("producer part B free minus WG1 warp 4's release of B of block g - 2", 2, 6, 1, 6, 2, 2, 5, 6);

  // All roles' events relative to WG0's event 0 of the same block.
  std::printf("all roles relative to WG0 e0 of the same block (median cycles, inner steps; columns e0, e1, ...):\n");
  for (int role = 0; role < 3; ++role) {
    std::printf("  %-9s", role == 0 ? "WG0" : role == 1 ? "WG1" : "producer");
    for (int e = 0; e < kRoleEvents[role]; ++e) {
      std::vector<double> v;
      for (const Cta& c : ctas)
        for (int k = 0; k < c.W; ++k)
          if (inner(c, k) && has(c, 0, k, 0) && has(c, role, k, e)) v.push_back(ev(c, role, k, e) - ev(c, 0, k, 0));
      std::printf(" %7.0f", med(v));
    }
    std::printf("\n");
  }

  // Request boundaries: Q reload, epilogue, and the period of a request's last block (it spans the epilogue
  // and the next request's Q load).
  {
    std::vector<double> qwait, qload, epi0, epi1, last_per, first_per;
    for (const Cta& c : ctas) {
      const int n_req = std::min(c.end_req - c.begin_req + 1, tr::kMaxSteps - 1);
      for (int r = 0; r < n_req; ++r) {
        if (at(c.slot, 3, r, 9) == 0 || !at(c.slot, 3, r, 0)) continue;
        if (at(c.slot, 3, r, 1)) qwait.push_back(double(at(c.slot, 3, r, 1)) - double(at(c.slot, 3, r, 0)));
        if (at(c.slot, 3, r, 2) && at(c.slot, 3, r, 1)) qload.push_back(double(at(c.slot, 3, r, 2)) - double(at(c.slot, 3, r, 1)));
        if (at(c.slot, 3, r, 5) && at(c.slot, 3, r, 3)) epi0.push_back(double(at(c.slot, 3, r, 5)) - double(at(c.slot, 3, r, 3)));
        if (at(c.slot, 3, r, 7) && at(c.slot, 3, r, 6)) epi1.push_back(double(at(c.slot, 3, r, 7)) - double(at(c.slot, 3, r, 6)));
      }
      for (int k = 0; k + 1 < c.W; ++k) {
        if (k + step0 < 2 || !has(c, 0, k, 0) || !has(c, 0, k + 1, 0)) continue;
        if (c.kind[k] & 2) last_per.push_back(ev(c, 0, k + 1, 0) - ev(c, 0, k, 0));
        else if (c.kind[k] & 1) first_per.push_back(ev(c, 0, k + 1, 0) - ev(c, 0, k, 0));
      }
    }
    std::printf("requests (cycles, median): WG0 first consumer barrier %.0f (n %zu), Q copy %.0f, WG0 epilogue %.0f, "
                "WG1 epilogue %.0f; WG0 period of a request's last block %.0f (n %zu), of its first block %.0f (n %zu)\n",
                med(qwait), qwait.size(), med(qload), med(epi0), med(epi1), med(last_per), last_per.size(),
                med(first_per), first_per.size());
  }

  // Every CTA's first block and first request, from its entry: at b = 2 a CTA does one to three blocks, so its life is
  // this chain (metadata, barrier set-up, the first indices and gathers, Q, the first S) plus the epilogue and exit.
  if (step0 == 0) {
    auto line = [&](const char* what, const std::vector<double>& v) {
      if (!v.empty())
        std::printf("  %-34s %8.0f %8.0f %8.0f  (n %zu)\n", what, med(v), quant(v, 0.1), quant(v, 0.9), v.size());
    };
    std::printf("every CTA's start (cycles from its entry; median, p10, p90):\n");
    std::vector<double> init, done, ex;
    for (const Cta& c : ctas) {
      if (c.clk_init) init.push_back(double(c.clk_init) - double(c.clk_entry));
      if (c.clk_done) done.push_back(double(c.clk_done) - double(c.clk_entry));
      if (c.clk_exit) ex.push_back(double(c.clk_exit) - double(c.clk_entry));
    }
    line("barriers initialised", init);
    const char* const kReqEv[8] = {"req 0: WG0 request start", "req 0: first consumer barrier", "req 0: Q in shared memory",
                                   "req 0: WG0 epilogue start", "req 0: WG0 epilogue barrier", "req 0: WG0 epilogue end",
                                   "req 0: WG1 epilogue start", "req 0: WG1 epilogue end"};
    for (int role = 0; role < 4; ++role) {
      const int n_ev = role < 3 ? kRoleEvents[role] : 8;
      for (int e = 0; e < n_ev; ++e) {
        std::vector<double> v;
        for (const Cta& c : ctas)
          if (c.W > 0 && at(c.slot, role, 0, e)) v.push_back(double(at(c.slot, role, 0, e)) - double(c.clk_entry));
        char name[64];
        if (role < 3) std::snprintf(name, sizeof(name), "g 0 %s: %s", role == 0 ? "WG0" : role == 1 ? "WG1" : "prod",
                                    kEvName[role][e]);
        else std::snprintf(name, sizeof(name), "%s", kReqEv[e]);
        line(name, v);
      }
    }
    line("WG0 done", done);
    line("exit", ex);
  }

  // One CTA's timeline (the middle CTA with records), for reading by eye.
  {
    const Cta& c = ctas[ctas.size() / 2];
    std::printf("timeline of CTA %d (rank %d, SM %d, requests %d..%d, %d blocks; cycles from its entry; F / L: first / "
                "last block of a request):\n",
                c.id, c.rank, c.smid, c.begin_req, c.end_req, c.n_blk);
    std::printf("  init %lld, WG0 done %lld, exit %lld\n", static_cast<long long>(c.clk_init - c.clk_entry),
                static_cast<long long>(c.clk_done - c.clk_entry), static_cast<long long>(c.clk_exit - c.clk_entry));
    for (int k = 0; k < c.W; ++k)
      for (int role = 0; role < 3; ++role) {
        std::printf("  g %3d %c%c %-8s", k + step0, (c.kind[k] & 1) ? 'F' : ' ', (c.kind[k] & 2) ? 'L' : ' ',
                    role == 0 ? "WG0" : role == 1 ? "WG1" : "producer");
        for (int e = 0; e < kRoleEvents[role]; ++e) {
          const unsigned long long v = at(c.slot, role, k, e);
          if (v) std::printf(" %8lld", static_cast<long long>(v) - static_cast<long long>(c.clk_entry));
          else std::printf("        -");
        }
        std::printf("\n");
      }
  }
  return 0;
}


/// No GPU: checks the index generation against its rules and runs analyze() on records of a synthetic
/// pipeline whose waits are known (WG0 130 of 2000 cycles per block = 6.5%, WG1's P wait 760 = 38%,
/// the producer's free waits 750 = 37.5%).
int selftest() {
  int bad = 0;
  std::mt19937_64 rng(1);
  const ScopeCfg cs[3] = {{32768, 2048, 64, false}, {16384, 1024, 64, false}, {4096, 1024, 2, true}};
  for (const ScopeCfg& c : cs) {
    const int b = 37, s_q = 2;
    const Scope sc = gen_scope(b, s_q, c, 512, rng);
    int64_t inval = 0;
    for (int i = 0; i < b; ++i)
      for (int s = 0; s < s_q; ++s) {
        const int32_t* row = sc.idx.data() + (static_cast<size_t>(i) * s_q + s) * c.topk;
        std::vector<int> toks;
        bool seen_invalid = false;
        for (int k = 0; k < c.topk; ++k) {
          if (row[k] < 0) {
            seen_invalid = true;
            ++inval;
            continue;
          }
          if (seen_invalid) ++bad;  // -1 only at the end of a row
          const int page = row[k] / c.pbs, off = row[k] % c.pbs;
          const int32_t* bt = sc.bt.data() + static_cast<size_t>(i) * sc.pages;
          const int64_t lp = std::find(bt, bt + sc.pages, page) - bt;  // the request's logical page
          if (lp == sc.pages) ++bad;
          const int64_t t = lp * c.pbs + off;
          if (t >= sc.lens[i]) ++bad;
          toks.push_back(static_cast<int>(t));
        }
        const int want = std::min(c.topk, sc.lens[i]);
        if (static_cast<int>(toks.size()) != want) ++bad;
        std::sort(toks.begin(), toks.end());
        if (std::adjacent_find(toks.begin(), toks.end()) != toks.end()) ++bad;
      }
    if (inval != sc.n_invalid) ++bad;
    int short_rows = 0;
    for (int v : sc.lens) short_rows += v < c.topk;
    std::printf("selftest scope s_kv %d topk %d pbs %d: %lld blocks of %lld B, %d short requests, %lld -1 slots, "
                "lengths %s; errors so far %d\n",
                c.s_kv, c.topk, c.pbs, static_cast<long long>(sc.n_blocks), static_cast<long long>(sc.stride),
                short_rows, static_cast<long long>(inval), sc.len.empty() ? "none" : "drawn", bad);
  }
  // Synthetic records: 6 CTAs (3 clusters), 70 blocks each in requests of 20 / 32 / 18 blocks.
  const int slots = 6;
  std::vector<unsigned long long> h(static_cast<size_t>(slots) * tr::kRoles * tr::kMaxSteps * tr::kEvents, 0);
  auto put = [&](int slot, int role, int step, int e, unsigned long long v) {
    h[((static_cast<size_t>(slot) * tr::kRoles + role) * tr::kMaxSteps + step) * tr::kEvents + e] = v;
  };
  const int req_g0[3] = {0, 20, 52}, req_nb[3] = {20, 32, 18};
  for (int sl = 0; sl < slots; ++sl) {
    const unsigned long long base = 100000ull * (sl + 1);
    auto T = [&](int g) { return base + 5000 + 2000ull * g + (g >= 20 ? 3000 : 0) + (g >= 52 ? 3000 : 0); };
    for (int g = 0; g < tr::kMaxSteps; ++g) {
      const unsigned long long t = T(g);
      const int w0[10] = {0, 100, 150, 180, 600, 900, 950, 960, 1500, 1510};
      for (int e = 0; e < 10; ++e) put(sl, 0, g, e, t + w0[e]);
      const int w1[7] = {200, 960, 1000, 1002, 1010, 1800, 1810};
      for (int e = 0; e < 7; ++e) put(sl, 1, g, e, t + w1[e]);
      const int wp[10] = {0, 100, 600, 1000, 1010, 1050, 1300, 1400, 1410, 1420};
      for (int e = 0; e < 10; ++e) put(sl, 2, g, e, t - 1500 + wp[e]);
    }
    for (int r = 0; r < 3; ++r) {
      const unsigned long long t = r == 0 ? base + 2000 : T(req_g0[r]) - 2500;
      for (int e = 0; e < 8; ++e) put(sl, 3, r, e, t + 100 * e);
      put(sl, 3, r, 8, req_g0[r]);
      put(sl, 3, r, 9, req_nb[r]);
      put(sl, 3, r, 10, 10 + r);
      put(sl, 3, r, 11, r == 1 ? 1 : 0);
    }
    const int S = tr::kMaxSteps - 1;
    put(sl, 3, S, 0, base);
    put(sl, 3, S, 1, base + 1000);
    put(sl, 3, S, 2, T(70) + 2000);
    put(sl, 3, S, 3, T(70) + 2100);
    put(sl, 3, S, 4, 5000000000ull + 50ull * sl);
    put(sl, 3, S, 5, 5000000000ull + 50ull * sl + (T(70) + 2100 - base) / 2);
    put(sl, 3, S, 6, 7 + sl);
    put(sl, 3, S, 7, sl % 2);
    put(sl, 3, S, 8, 70);
    put(sl, 3, S, 9, 10);
    put(sl, 3, S, 10, 12);
    put(sl, 3, S, 11, 0x100u | 2u | 1u);
  }
  std::printf("selftest analyze (expect: period 2000; WG0 waits 6.5%%, A 5.0%%, B 1.5%%; WG1 waits for P 38.0%%, "
              "for B 0.1%%; producer free waits 37.5%%, dequant 25.0%%; last block of a request 5000, first 2000):\n");
  const int r = analyze(h, slots, 1, 0, true, true);
  std::printf("selftest: %s\n", bad == 0 && r == 0 ? "ok" : "FAILED");
  return bad == 0 && r == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s v32|model1|model1c4 [b=128] [h_q=128] [every=1]   (or: %s selftest, no GPU)\n",
                 argv[0], argv[0]);
    return 2;
  }
  const std::string fmt = argv[1];
  if (fmt == "selftest") return selftest();
  CaseCfg cfg;
  if (fmt == "v32") cfg = {"V3.2", 576, {32768, 2048, 64, false}, false, {}, 128};
  else if (fmt == "model1") cfg = {"MODEL1 config2", 512, {16384, 128, 256, false}, true, {16384, 1024, 64, false}, 128};
  else if (fmt == "model1c4") cfg = {"MODEL1 config4", 512, {16384, 128, 256, false}, true, {16384, 1024, 2, true}, 256};
  else {
    std::fprintf(stderr, "format: v32 | model1 (config2) | model1c4 (config4)\n");
    return 2;
  }
  const bool v32 = cfg.d_qk == 576;
  if ((SPARSE_TRACE_FMT == 1 && !v32) || (SPARSE_TRACE_FMT == 2 && v32)) {
    std::fprintf(stderr, "this binary was built with SPARSE_TRACE_FMT=%d (1: v32 only, 2: model1 only)\n",
                 SPARSE_TRACE_FMT);
    return 2;
  }
  const int b = argc > 2 ? std::atoi(argv[2]) : cfg.b_default;
  const int h_q = argc > 3 ? std::atoi(argv[3]) : 128;
  const int every = argc > 4 ? std::atoi(argv[4]) : 1;
  const int s_q = 2;
  if (b < 1 || h_q <= 32 || h_q % 64 != 0 || every < 1) {
    std::fprintf(stderr, "b >= 1, h_q a multiple of 64 (the producer kernel serves h_q > 32), every >= 1\n");
    return 2;
  }
  const int reps = std::getenv("FLASHMLA_TRACE_REPS") ? std::max(1, std::atoi(std::getenv("FLASHMLA_TRACE_REPS"))) : 20;
  const double flush_gb = std::getenv("FLASHMLA_TRACE_FLUSH_GB") ? std::atof(std::getenv("FLASHMLA_TRACE_FLUSH_GB")) : 8.0;
  const int step0 = std::getenv("FLASHMLA_TRACE_STEP0") ? std::max(0, std::atoi(std::getenv("FLASHMLA_TRACE_STEP0"))) : 0;
  const uint64_t seed = std::getenv("FLASHMLA_TRACE_SEED") ? std::strtoull(std::getenv("FLASHMLA_TRACE_SEED"), nullptr, 10) : 0;

  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int n_sm = 0, clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  std::printf("device %s, %d SMs, clock attribute %.0f MHz\n", prop.name, n_sm, clock_khz / 1e3);
  std::printf("case %s b %d s_q %d h_q %d d_qk %d (main topk %d page %d%s)\n", cfg.name, b, s_q, h_q, cfg.d_qk,
              cfg.main.topk, cfg.main.pbs,
              cfg.has_extra ? (std::string(", extra topk ") + std::to_string(cfg.extra.topk) + " page " +
                               std::to_string(cfg.extra.pbs) + (cfg.extra.with_len ? " with lengths" : ""))
                                  .c_str()
                            : "");

  // ---- inputs
  std::mt19937_64 rng(seed);
  Scope main_s = gen_scope(b, s_q, cfg.main, cfg.d_qk, rng);
  upload_scope(main_s, cfg.main, cfg.d_qk, 11 + seed);
  Scope extra_s;
  if (cfg.has_extra) {
    extra_s = gen_scope(b, s_q, cfg.extra, cfg.d_qk, rng);
    upload_scope(extra_s, cfg.extra, cfg.d_qk, 23 + seed);
  }
  __nv_bfloat16 *q, *out;
  float *sink, *lse, *o_accum, *lse_accum;
  const int64_t n_q = static_cast<int64_t>(b) * s_q * h_q * cfg.d_qk;
  CHECK(cudaMalloc(&q, n_q * 2));
  fill_q<<<2048, 256>>>(q, n_q, 5 + seed);
  CHECK(cudaGetLastError());
  {
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> hs(h_q);
    for (auto& v : hs) v = nd(rng);
    CHECK(cudaMalloc(&sink, h_q * sizeof(float)));
    CHECK(cudaMemcpy(sink, hs.data(), h_q * sizeof(float), cudaMemcpyHostToDevice));
  }
  const int num_sm_parts = static_cast<int>(flashmla::core::sparse_decode_num_sm_parts(n_sm, s_q, h_q));
  const int64_t n_out = static_cast<int64_t>(b) * s_q * h_q * 512;
  const int64_t splits = b + num_sm_parts;
  CHECK(cudaMalloc(&out, n_out * 2));
  CHECK(cudaMalloc(&lse, static_cast<size_t>(b) * h_q * s_q * sizeof(float)));
  CHECK(cudaMalloc(&o_accum, static_cast<size_t>(splits) * s_q * h_q * 512 * sizeof(float)));
  CHECK(cudaMalloc(&lse_accum, static_cast<size_t>(splits) * s_q * h_q * sizeof(float)));
  int32_t *metadata, *num_splits;
  CHECK(cudaMalloc(&metadata, static_cast<size_t>(num_sm_parts) * 8 * sizeof(int32_t)));
  CHECK(cudaMalloc(&num_splits, (b + 1) * sizeof(int32_t)));
  CHECK(flashmla::sm90::launch_sparse_tile_scheduler(main_s.d_len, cfg.has_extra ? extra_s.d_len : nullptr,
                                                     main_s.topk, cfg.has_extra ? extra_s.topk : 0, b, num_sm_parts,
                                                     metadata, num_splits, 0));
  CHECK(cudaDeviceSynchronize());

  // ---- kernel parameters, as sparse_decode_launch builds them
  SparseDecodeKernelParams kp{};
  kp.q = q;
  kp.q_stride_b = static_cast<int64_t>(s_q) * h_q * cfg.d_qk;
  kp.q_stride_s = static_cast<int64_t>(h_q) * cfg.d_qk;
  kp.q_stride_h = cfg.d_qk;
  kp.main = kernel_scope(main_s, s_q);
  kp.has_extra = cfg.has_extra ? 1 : 0;
  if (cfg.has_extra) kp.extra = kernel_scope(extra_s, s_q);
  kp.attn_sink = sink;
  kp.out = out;
  kp.o_stride_b = static_cast<int64_t>(s_q) * h_q * 512;
  kp.o_stride_s = static_cast<int64_t>(h_q) * 512;
  kp.o_stride_h = 512;
  kp.o_stride_d = 1;
  kp.lse = lse;  // (b, h_q, s_q)
  kp.lse_stride_b = static_cast<int64_t>(h_q) * s_q;
  kp.lse_stride_h = s_q;
  kp.lse_stride_s = 1;
  kp.o_accum = o_accum;
  kp.lse_accum = lse_accum;
  kp.tile_scheduler_metadata = metadata;
  kp.num_splits = num_splits;
  kp.b = b;
  kp.s_q = s_q;
  kp.h_q = h_q;
  kp.num_head_tiles = (h_q + 63) / 64;
  kp.q_vec = 1;
  kp.out_vec_ok = 1;
  kp.out_vec16 = 1;  // out below is contiguous and 16-byte aligned (the launcher's rows_16b_aligned)
  kp.scale_log2 = static_cast<float>(std::pow(static_cast<double>(cfg.d_qk), -0.55)) * 1.4426950408889634f;
  kp.main_kernel = SparseDecodeMainKernel::kWgmmaProducer;
  if (!wp::usable(kp)) {
    std::fprintf(stderr, "the producer kernel is not usable for these parameters\n");
    return 1;
  }

  bool cluster = false;
#if SPARSE_TRACE_FMT != 2
  if (v32) cluster = library_picks_cluster<Fmt::kV32>(kp, num_sm_parts);
#endif
#if SPARSE_TRACE_FMT != 1
  if (!v32) cluster = library_picks_cluster<Fmt::kModel1>(kp, num_sm_parts);
#endif
  auto run = [&]() -> cudaError_t {
#if SPARSE_TRACE_FMT != 2
    if (v32) return launch_variant<Fmt::kV32>(cluster, kp, num_sm_parts);
#endif
#if SPARSE_TRACE_FMT != 1
    if (!v32) return launch_variant<Fmt::kModel1>(cluster, kp, num_sm_parts);
#endif
    return cudaErrorInvalidValue;
  };
  const dim3 grid(static_cast<unsigned>(s_q * kp.num_head_tiles), static_cast<unsigned>(num_sm_parts));
  const int n_cta = static_cast<int>(grid.x * grid.y);
  {
    cudaFuncAttributes fa{};
#if SPARSE_TRACE_FMT != 2
    if (v32) CHECK(kernel_attributes<Fmt::kV32>(&fa, cluster, wp::batched_form(kp)));
#endif
#if SPARSE_TRACE_FMT != 1
    if (!v32) CHECK(kernel_attributes<Fmt::kModel1>(&fa, cluster, wp::batched_form(kp)));
#endif
    std::printf("kernel: wgmma_producer %s %s (FLASHMLA_TRACE_CLUSTER=%s), grid (%u, %u) = %d CTAs%s, num_sm_parts %d, "
                "%d regs, %zu B local (traced build)\n",
                v32 ? "V32" : "MODEL1", cluster ? "cluster" : "plain",
                std::getenv("FLASHMLA_TRACE_CLUSTER") ? std::getenv("FLASHMLA_TRACE_CLUSTER") : "unset",
                grid.x, grid.y, n_cta, cluster ? " in clusters of 2" : "", num_sm_parts, fa.numRegs,
                static_cast<size_t>(fa.localSizeBytes));
  }

  // ---- timing (trace buffer unset: every trace branch is taken as "off")
  void* flush = nullptr;
  const size_t flush_bytes = static_cast<size_t>(flush_gb * 1e9) / 4 * 4;
  if (flush_bytes > 0) CHECK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  auto timed = [&](int r) {
    if (flush) CHECK(cudaMemsetAsync(flush, r & 0xFF, flush_bytes));
    CHECK(cudaEventRecord(e0));
    const cudaError_t e = run();
    if (e != cudaSuccess) {
      std::fprintf(stderr, "launch: %s%s\n", cudaGetErrorString(e),
                   e == cudaErrorInvalidConfiguration ? " (the producer kernel refused: the library would run the mma.sync kernel)" : "");
      std::exit(1);
    }
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaGetLastError());
    float t;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    return t * 1e3;
  };
  for (int r = 0; r < 3; ++r) timed(r);
  std::vector<double> us;
  for (int r = 0; r < reps; ++r) us.push_back(timed(r + 3));
  const double t_med = med(us);
  const double attended = static_cast<double>(b) * s_q *
                          (cfg.main.topk + (cfg.has_extra ? (cfg.extra.with_len ? 0.0 : cfg.extra.topk) : 0.0));
  double attended_len = attended;
  if (cfg.has_extra && cfg.extra.with_len) {
    double s = 0;
    for (int v : extra_s.len) s += v;
    attended_len += s * s_q;
  }
  std::printf("kernel time (CUDA events, L2 flushed by a %.1f GB memset): median %.1f us, min %.1f, max %.1f "
              "(%d runs); %.1f TFLOP/s (spec §5.2 FLOP)\n",
              flush_gb, t_med, quant(us, 0.0), quant(us, 1.0), reps,
              2.0 * h_q * attended_len * (cfg.d_qk + 512) / t_med * 1e-6);

  // ---- one traced run
  const int slots = (n_cta + every - 1) / every;
  const size_t n_rec = static_cast<size_t>(slots) * tr::kRoles * tr::kMaxSteps * tr::kEvents;
  unsigned long long* buf;
  CHECK(cudaMalloc(&buf, n_rec * 8));
  CHECK(cudaMemset(buf, 0, n_rec * 8));
  CHECK(cudaMemset(lse, 0xFF, static_cast<size_t>(b) * h_q * s_q * sizeof(float)));  // NaN: "not written"
  CHECK(cudaMemcpyToSymbol(g_trace, &buf, sizeof(buf)));
  CHECK(cudaMemcpyToSymbol(g_trace_every, &every, sizeof(int)));
  CHECK(cudaMemcpyToSymbol(g_trace_slots, &slots, sizeof(int)));
  CHECK(cudaMemcpyToSymbol(g_sparse_decode_trace_step0, &step0, sizeof(int)));
  const double t_traced = timed(0);
  std::vector<unsigned long long> h(n_rec);
  CHECK(cudaMemcpy(h.data(), buf, n_rec * 8, cudaMemcpyDeviceToHost));
  {
    unsigned long long* null_ptr = nullptr;
    CHECK(cudaMemcpyToSymbol(g_trace, &null_ptr, sizeof(null_ptr)));
  }
  std::printf("traced run %.1f us (untraced median %.1f); %d of %d CTAs traced (every %d-th), blocks %d .. %d of "
              "each\n",
              t_traced, t_med, slots, n_cta, every, step0, step0 + tr::kMaxSteps - 1);
  {  // sanity: the unsplit requests' lse values the kernel must have written
    std::vector<float> hl(static_cast<size_t>(b) * h_q * s_q);
    std::vector<int32_t> ns(b + 1);
    CHECK(cudaMemcpy(hl.data(), lse, hl.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(ns.data(), num_splits, ns.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    long long n = 0, nan = 0, inf = 0;
    int unsplit = 0;
    for (int i = 0; i < b; ++i) {
      if (ns[i + 1] - ns[i] != 1) continue;
      ++unsplit;
      for (int k = 0; k < h_q * s_q; ++k) {
        const float v = hl[static_cast<size_t>(i) * h_q * s_q + k];
        ++n;
        nan += std::isnan(v) ? 1 : 0;
        inf += std::isinf(v) ? 1 : 0;
      }
    }
    std::printf("sanity: %d of %d requests unsplit; %lld lse values of theirs, %lld left unwritten (NaN), %lld +inf "
                "(rows without a valid key)\n",
                unsplit, b, n, nan, inf);
  }

  return analyze(h, slots, every, step0, cluster, v32);
}
