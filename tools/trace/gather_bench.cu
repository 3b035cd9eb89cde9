// tools/trace/gather_bench.cu — how fast can one warpgroup per SM gather V3.2 FP8 records (656 bytes each,
// the sparse decode's access pattern) with each load method? A diagnostic for the sparse-decode producer
// (docs/sparse-fp8-decode.md: its gathers take 3000+ cycles from issue to use while DRAM moves only
// ~0.8 TB/s). Results: bench/results/2026-12-03-gather-bench.txt, docs/sparse-fp8-decode.md.
//
// One CTA of 128 threads per SM (the producer warpgroup's size; the dynamic shared memory forces one CTA
// per SM), each gathering `blocks` blocks of 64 random records (uniform over a `gb`-GB buffer, so nearly
// every record comes from DRAM) and reading their first 528 bytes (512 FP8 + 16 scale bytes), as the
// producer does (FlashMLA's token mapping: thread t takes rows 8 (t / 32) + t % 8 and that + 32, quarter
// (t % 32) / 8 of each 64-byte group). Methods (argument 1, or all):
//   0 ldg         per block: the rows' indices, then the 18 loads per thread, then their use
//   1 ldg-ahead   indices one block ahead (the kernel's order: loads of block g issued at its step start)
//   2 ldg-l2pf    1 + a cp.async.bulk.prefetch.L2 of block g + 2's records at step g (indices two ahead;
//                 the kernel prefetches g + 1 after its part A, with the rest of its step as lead time)
//   3 ldg-regs2   the loads of block g + 1 issued before block g is used (two register sets, indices
//                 one block ahead; check the SASS: the LDGs of g + 1 must precede the first use of g)
//   4 bulk        one 528-byte cp.async.bulk per row into a two-stage shared buffer, one block ahead
//   5 cpasync     16-byte cp.async per thread chunk into the same buffer, one block ahead
//   6 ldg-policy  1 with the shipped producer's cache policy (utils.cuh's ldg16_evict_last_l2_256)
//   7 bulk-3      4 with three stages, two blocks ahead
// Every timed launch follows a 256 MB memset (L2 flush) and reads its own slice of the index array, so a
// single-CTA run does not re-read records from L2. Prints per method: the best of 5 launches' time, GB/s
// of record bytes (64 x 528 per block) and that launch's cycles per block per CTA.
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Isrc -Itools/trace -o /tmp/gather_bench \
//        tools/trace/gather_bench.cu && /tmp/gather_bench [method|-1] [blocks] [gb] [ctas]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sm90/common/utils.cuh"
#include "trace_host.cuh"

using namespace flashmla::sm90;

constexpr int kRec = 656;           // V3.2 record bytes (spec §3.3)
constexpr int kUse = 528;           // bytes the producer reads by LDG (FP8 + scales; RoPE goes by cp.async)
constexpr int kRows = 64;           // records per block
constexpr int kStage = kRows * kUse;  // 33792 bytes per shared-memory stage (methods 4, 5)
constexpr int kSmem = 3 * kStage + 64;  // > half of the SM: one CTA per SM

__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

struct Loaded {
  uint4 u[2][8];
  uint2 s[2];
};

template <int kMethod>
__global__ void __launch_bounds__(128, 1)
    gather_kernel(const uint8_t* __restrict__ recs, const int32_t* __restrict__ idx, int blocks,
                  unsigned long long* cycles, uint32_t* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int t = threadIdx.x, j = (t & 31) >> 3;
  const int row[2] = {(t >> 5) * 8 + (t & 7), (t >> 5) * 8 + (t & 7) + 32};
  const int32_t* my = idx + static_cast<int64_t>(blockIdx.x) * blocks * kRows;
  const uint32_t s_u = smem_u32(smem), bar_u = s_u + 3 * kStage;
  uint32_t acc = 0;
  auto rec_of = [&](int g, int i) { return recs + static_cast<int64_t>(my[g * kRows + row[i]]) * kRec; };
  auto load = [&](Loaded& L, const uint8_t* a0, const uint8_t* a1) {
    const uint8_t* a[2] = {a0, a1};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int d = 0; d < 8; ++d)
        L.u[i][d] = kMethod == 6 ? ldg16_evict_last_l2_256(a[i] + 64 * d + 16 * j) : ldg16(a[i] + 64 * d + 16 * j);
      L.s[i] = kMethod == 6 ? ldg8_evict_last(a[i] + 512 + 8 * (j & 1)) : ldg8(a[i] + 512 + 8 * (j & 1));
    }
  };
  auto use = [&](const Loaded& L) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int d = 0; d < 8; ++d) acc ^= L.u[i][d].x + L.u[i][d].y * 3u + L.u[i][d].z * 5u + L.u[i][d].w * 7u;
      acc ^= L.s[i].x + L.s[i].y;
    }
  };
  constexpr int kStages = kMethod == 7 ? 3 : 2;
  if ((kMethod == 4 || kMethod == 5 || kMethod == 7) && t == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(bar_u + 8 * s, 1);
    fence_barrier_init();
  }
  __syncthreads();
  const unsigned long long c0 = clock64();
  if constexpr (kMethod == 0) {
    for (int g = 0; g < blocks; ++g) {
      Loaded L;
      load(L, rec_of(g, 0), rec_of(g, 1));
      use(L);
    }
  } else if constexpr (kMethod == 1 || kMethod == 2 || kMethod == 6) {
    auto ix = [&](int g, int i) { return g < blocks ? my[g * kRows + row[i]] : 0; };
    int v0 = ix(0, 0), v1 = ix(0, 1);
    int p0 = ix(1, 0), p1 = ix(1, 1);  // method 2: block g + 1's indices (its prefetch was issued at g - 1)
    if (kMethod == 2 && j == 0) {
      prefetch_l2_bulk(recs + static_cast<int64_t>(p0) * kRec, kRec);
      prefetch_l2_bulk(recs + static_cast<int64_t>(p1) * kRec, kRec);
    }
    for (int g = 0; g < blocks; ++g) {
      const int n0 = ix(g + 1, 0), n1 = ix(g + 1, 1);
      Loaded L;
      load(L, recs + static_cast<int64_t>(v0) * kRec, recs + static_cast<int64_t>(v1) * kRec);
      if constexpr (kMethod == 2) {
        const int q0 = ix(g + 2, 0), q1 = ix(g + 2, 1);
        if (g + 2 < blocks && j == 0) {
          prefetch_l2_bulk(recs + static_cast<int64_t>(q0) * kRec, kRec);
          prefetch_l2_bulk(recs + static_cast<int64_t>(q1) * kRec, kRec);
        }
      }
      use(L);
      v0 = n0;
      v1 = n1;
    }
  } else if constexpr (kMethod == 3) {
    // Indices one block ahead; block g + 1's loads (clamped to the last block, so unconditional) are
    // issued before block g's first use.
    auto addr = [&](int g, int i) {
      const int gg = g < blocks ? g : blocks - 1;
      return recs + static_cast<int64_t>(my[gg * kRows + row[i]]) * kRec;
    };
    Loaded A, B;
    load(A, addr(0, 0), addr(0, 1));
    const uint8_t* n0 = addr(1, 0);
    const uint8_t* n1 = addr(1, 1);
    for (int g = 0; g < blocks; g += 2) {
      load(B, n0, n1);
      n0 = addr(g + 2, 0);
      n1 = addr(g + 2, 1);
      use(A);
      if (g + 1 >= blocks) break;
      load(A, n0, n1);
      n0 = addr(g + 3, 0);
      n1 = addr(g + 3, 1);
      use(B);
    }
  } else {
    // Stage g % kStages holds block g's 64 x 528 bytes (row r at r * 528); filled kStages - 1 blocks ahead.
    auto issue = [&](int g) {
      const uint32_t st = s_u + static_cast<uint32_t>((g % kStages) * kStage), bar = bar_u + 8u * (g % kStages);
      if constexpr (kMethod == 4 || kMethod == 7) {
        if (t == 0) mbar_arrive_expect_tx(bar, kStage);
        __syncwarp();
        if (t < kRows) bulk_load(st + t * kUse, recs + static_cast<int64_t>(my[g * kRows + t]) * kRec, kUse, bar);
      } else {
        // 33 16-byte chunks per row: thread t copies chunks t % 33 ... of rows, strided over the CTA.
        for (int c = t; c < kRows * (kUse / 16); c += 128) {
          const int r = c / (kUse / 16), k = c % (kUse / 16);
          cp_async_16(st + r * kUse + 16 * k, recs + static_cast<int64_t>(my[g * kRows + r]) * kRec + 16 * k, true);
        }
        cp_async_commit();
      }
    };
    for (int g = 0; g < kStages - 1 && g < blocks; ++g) issue(g);
    for (int g = 0; g < blocks; ++g) {
      if (g + kStages - 1 < blocks) {
        __syncthreads();  // everyone is done reading stage (g + kStages - 1) % kStages (block g - 1)
        issue(g + kStages - 1);
      }
      if constexpr (kMethod == 4 || kMethod == 7) {
        mbar_wait(bar_u + 8u * (g % kStages), static_cast<uint32_t>((g / kStages) & 1));
      } else {
        if (g + 1 < blocks) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();
      }
      const uint8_t* st = smem + (g % kStages) * kStage;
      Loaded L;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int d = 0; d < 8; ++d) L.u[i][d] = *reinterpret_cast<const uint4*>(st + row[i] * kUse + 64 * d + 16 * j);
        L.s[i] = *reinterpret_cast<const uint2*>(st + row[i] * kUse + 512 + 8 * (j & 1));
      }
      use(L);
    }
  }
  const unsigned long long c1 = clock64();
  if (t == 0) cycles[blockIdx.x] = c1 - c0;
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads alive
}

template <int kM>
static void run(const char* name, const uint8_t* recs, const int32_t* idx, int blocks, int ctas,
                unsigned long long* d_cyc, uint32_t* d_sink, void* flush, size_t flush_bytes) {
  auto k = gather_kernel<kM>;
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const int64_t slice = static_cast<int64_t>(ctas) * blocks * kRows;  // indices per launch
  k<<<ctas, 128, kSmem>>>(recs, idx, blocks, d_cyc, d_sink);  // warm-up (slice 0)
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  float best = 1e30f;
  std::vector<unsigned long long> cyc(ctas), best_cyc(ctas);
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaMemset(flush, rep, flush_bytes));  // L2 flush
    CHECK(cudaEventRecord(e0));
    k<<<ctas, 128, kSmem>>>(recs, idx + (rep + 1) * slice, blocks, d_cyc, d_sink);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    CHECK(cudaMemcpy(cyc.data(), d_cyc, ctas * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    if (ms < best) {
      best = ms;
      best_cyc = cyc;
    }
  }
  double mean = 0;
  for (auto c : best_cyc) mean += static_cast<double>(c);
  mean /= ctas;
  const double bytes = static_cast<double>(ctas) * blocks * kRows * kUse;
  std::printf("%-10s ctas %4d blocks %5d: %8.1f us  %7.1f GB/s of record bytes  %7.0f cycles per block per CTA\n",
              name, ctas, blocks, best * 1e3, bytes / (best * 1e-3) / 1e9, mean / blocks);
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
}

int main(int argc, char** argv) {
  const int method = argc > 1 ? std::atoi(argv[1]) : -1;
  const int blocks = argc > 2 ? std::atoi(argv[2]) : 256;
  const double gb = argc > 3 ? std::atof(argv[3]) : 4.0;
  int n_sm = 0;
  CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
  const int ctas = argc > 4 ? std::atoi(argv[4]) : n_sm;
  if (blocks < 1 || ctas < 1 || gb <= 0.0) {
    std::fprintf(stderr, "usage: gather_bench [method|-1] [blocks >= 1] [gb > 0] [ctas >= 1]\n");
    return 2;
  }
  const int64_t n_rec = static_cast<int64_t>(gb * 1e9 / kRec);
  uint8_t* recs = nullptr;
  int32_t* idx = nullptr;
  unsigned long long* d_cyc = nullptr;
  uint32_t* d_sink = nullptr;
  CHECK(cudaMalloc(&recs, n_rec * kRec));
  CHECK(cudaMemset(recs, 0x3C, n_rec * kRec));
  const int64_t n_idx = 6 * static_cast<int64_t>(ctas) * blocks * kRows;  // warm-up + 5 timed slices
  const size_t flush_bytes = size_t{256} << 20;
  void* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  std::vector<int32_t> h(n_idx);
  for (int64_t i = 0; i < n_idx; ++i) h[i] = static_cast<int32_t>(mix(static_cast<uint64_t>(i) + 17) % n_rec);
  CHECK(cudaMalloc(&idx, n_idx * sizeof(int32_t)));
  CHECK(cudaMemcpy(idx, h.data(), n_idx * sizeof(int32_t), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&d_cyc, ctas * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&d_sink, sizeof(uint32_t)));
  std::printf("gather bench: %lld records of %d bytes (%.1f GB), %d CTAs x %d blocks x %d rows, %d bytes read per row\n",
              static_cast<long long>(n_rec), kRec, gb, ctas, blocks, kRows, kUse);
  if (method < 0 || method == 0) run<0>("ldg", recs, idx, blocks, ctas, d_cyc, d_sink, flush, flush_bytes);
  if (method < 0 || method == 1) run<1>("ldg-ahead", recs, idx, blocks, ctas, d_cyc, d_sink, flush, flush_bytes);
  if (method < 0 || method == 2) run<2>("ldg-l2pf", recs, idx, blocks, ctas, d_cyc, d_sink, flush, flush_bytes);
  if (method < 0 || method == 3) run<3>("ldg-regs2", recs, idx, blocks, ctas, d_cyc, d_sink, flush, flush_bytes);
  if (method < 0 || method == 4) run<4>("bulk", recs, idx, blocks, ctas, d_cyc, d_sink, flush, flush_bytes);
  if (method < 0 || method == 5) run<5>("cpasync", recs, idx, blocks, ctas, d_cyc, d_sink, flush, flush_bytes);
  if (method < 0 || method == 6) run<6>("ldg-policy", recs, idx, blocks, ctas, d_cyc, d_sink, flush, flush_bytes);
  if (method < 0 || method == 7) run<7>("bulk-3", recs, idx, blocks, ctas, d_cyc, d_sink, flush, flush_bytes);
  return 0;
}
