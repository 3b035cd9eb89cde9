// tools/trace/fence_probe.cu — does `fence.proxy.async.shared::cta` wait for the thread's global loads in
// flight? It compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S. The sparse-decode producer publishes each
// part of a block with this fence (its shared-memory stores must reach the consumers' wgmma); if the
// MEMBAR waits for outstanding loads, gathers issued early for the next block are waited for at the
// current block's fence, and loading ahead cannot hide their latency (docs/sparse-fp8-decode.md).
//
// One warpgroup per SM. Each step: issue kLoads 16-byte loads of random 656-byte records (DRAM misses),
// store 16 bytes to shared memory, then time (clock64) a) the fence alone, with the loads still in
// flight; then use the loaded values. Variant `none` times the same fence with no load in flight (the
// loads are consumed before the store). Prints the median cycles of the fence per variant.
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Isrc -Itools/trace -o /tmp/fence_probe \
//        tools/trace/fence_probe.cu
//   /tmp/fence_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "sm90/common/utils.cuh"
#include "trace_host.cuh"

using flashmla::sm90::ldg16_evict_last_l2_256;

constexpr int kLoads = 8;
constexpr int kSteps = 64;
constexpr int kRec = 656;

// kInFlight: the fence runs while the step's loads are outstanding; else after they were consumed.
template <bool kInFlight>
__global__ void __launch_bounds__(128, 1) probe(const uint8_t* __restrict__ recs, const int32_t* __restrict__ idx,
                                                 unsigned long long* fence_cycles, uint32_t* sink) {
  __shared__ uint4 s[128];
  const int t = threadIdx.x;
  const int32_t* my = idx + (static_cast<int64_t>(blockIdx.x) * 128 + t) * kSteps * kLoads;
  uint32_t acc = 0;
  for (int step = 0; step < kSteps; ++step) {
    uint4 v[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) v[i] = ldg16_evict_last_l2_256(recs + static_cast<int64_t>(my[step * kLoads + i]) * kRec);
    if constexpr (!kInFlight) {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) acc += v[i].x ^ v[i].w;
    }
    s[t] = make_uint4(acc, step, t, 0);
    const unsigned long long c0 = clock64();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const unsigned long long c1 = clock64();
    if constexpr (kInFlight) {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) acc += v[i].x ^ v[i].w;
    }
    if (t == 0) fence_cycles[static_cast<int64_t>(blockIdx.x) * kSteps + step] = c1 - c0;
  }
  if (acc == 0x12345678u) sink[0] = acc + s[(t * 7) & 127].x;
}

int main() {
  int n_sm = 0;
  CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
  const int64_t n_rec = static_cast<int64_t>(4e9 / kRec);
  const int64_t n_idx = static_cast<int64_t>(n_sm) * 128 * kSteps * kLoads;
  uint8_t* recs = nullptr;
  int32_t* idx = nullptr;
  unsigned long long* cyc = nullptr;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&recs, n_rec * kRec));
  CHECK(cudaMemset(recs, 0x3C, n_rec * kRec));
  std::vector<int32_t> h(n_idx);
  uint64_t x = 88172645463325252ull;
  for (auto& v : h) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = static_cast<int32_t>(x % static_cast<uint64_t>(n_rec));
  }
  CHECK(cudaMalloc(&idx, n_idx * sizeof(int32_t)));
  CHECK(cudaMemcpy(idx, h.data(), n_idx * sizeof(int32_t), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&cyc, static_cast<size_t>(n_sm) * kSteps * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&sink, sizeof(uint32_t)));
  std::vector<unsigned long long> c(static_cast<size_t>(n_sm) * kSteps);
  for (int variant = 0; variant < 2; ++variant) {
    for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
      if (variant == 0) probe<true><<<n_sm, 128>>>(recs, idx, cyc, sink);
      else probe<false><<<n_sm, 128>>>(recs, idx, cyc, sink);
      CHECK(cudaDeviceSynchronize());
    }
    CHECK(cudaMemcpy(c.data(), cyc, c.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    std::sort(c.begin(), c.end());
    std::printf("fence.proxy.async.shared::cta, %s: median %llu cycles, p10 %llu, p90 %llu (%d CTAs x %d steps, %d loads "
                "of 16 bytes per thread per step)\n",
                variant == 0 ? "with the step's loads in flight" : "no load in flight      ", c[c.size() / 2],
                c[c.size() / 10], c[c.size() * 9 / 10], n_sm, kSteps, kLoads);
  }
  return 0;
}
