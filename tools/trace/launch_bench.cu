// tools/trace/launch_bench.cu — what one launch and one grid barrier cost on this GPU and host (diagnostic).
//
// Question it answers (docs/sparse-fp8-decode.md, "One launch per call"): would a decode call that folds the split-KV
// combine into a cooperative main kernel save what the second launch costs? It measures
//   1. host time per launch of an empty kernel (the launch loop's wall time / launches; the GPU time per launch is
//      printed beside it, to show whether the loop was bound by the host): a plain <<<>>> launch; cudaLaunchKernelEx
//      plain; with a 2-CTA cluster; cooperative; cooperative with a 2-CTA cluster; with programmatic stream
//      serialization (the decode combines' attribute);
//   2. the GPU time of one grid-wide barrier among one CTA per SM (dynamic shared memory sized so that only one fits),
//      as the difference of two kernels' durations (CUDA events, median of 50 runs): each CTA spins on clock64 for a
//      fixed number of cycles, with and without a barrier after it: an atomic counter in global memory, every CTA
//      arriving once and polling until all have (the counter reset by the host between runs); and cooperative groups'
//      grid.sync() under a cooperative launch.
// Not a test: nothing is checked beyond the CUDA errors.
//
// Build (from the repository root; sm_90a) and run:
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/launch_bench tools/trace/launch_bench.cu
//   /tmp/launch_bench
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "trace_host.cuh"  // CHECK

__global__ void empty_kernel(int) {}

// Each CTA spins `cycles` cycles (thread 0), then optionally meets the others at a barrier.
// mode 0: no barrier; 1: a counter in global memory (arrive with an atomic, poll with volatile loads until it
// reaches gridDim.x);
// 2: cooperative groups' grid.sync() (cooperative launch only).
__global__ void spin_kernel(long long cycles, int mode, unsigned int* counter) {
  extern __shared__ unsigned char smem[];
  if (threadIdx.x == 0) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
    smem[0] = 1;
  }
  __syncthreads();
  if (mode == 1) {
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(counter, 1u);
      while (*reinterpret_cast<volatile unsigned int*>(counter) < gridDim.x) {
      }
      __threadfence();
    }
    __syncthreads();
  } else if (mode == 2) {
    cooperative_groups::this_grid().sync();
  }
}

template <class Launch>
double host_us_per_launch(Launch&& launch, int n) {
  for (int i = 0; i < 50; ++i) launch();
  CHECK(cudaDeviceSynchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) launch();
  const auto t1 = std::chrono::steady_clock::now();
  CHECK(cudaDeviceSynchronize());
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
}

template <class Launch>
double gpu_us(Launch&& launch, int runs, unsigned int* counter) {
  std::vector<float> ms;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < runs; ++i) {
    CHECK(cudaMemset(counter, 0, sizeof(unsigned int)));
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0.f;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1e3;
}

int main() {
  int dev = 0;
  CHECK(cudaSetDevice(dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  const int sms = prop.multiProcessorCount;
  std::printf("device %s, %d SMs\n", prop.name, sms);

  // 1. Host time per launch (an empty kernel on 2 x sms CTAs of 128 threads).
  const int n = 5000;
  const dim3 grid(2 * sms), block(128);
  auto ex = [&](bool cluster, bool coop, bool pdl) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = 0;
    cfg.stream = 0;
    cudaLaunchAttribute attr[3];
    int k = 0;
    if (cluster) {
      attr[k].id = cudaLaunchAttributeClusterDimension;
      attr[k].val.clusterDim.x = 2;
      attr[k].val.clusterDim.y = 1;
      attr[k].val.clusterDim.z = 1;
      ++k;
    }
    if (coop) {
      attr[k].id = cudaLaunchAttributeCooperative;
      attr[k].val.cooperative = 1;
      ++k;
    }
    if (pdl) {
      attr[k].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[k].val.programmaticStreamSerializationAllowed = 1;
      ++k;
    }
    cfg.numAttrs = k;
    // The closure owns its copy of the attributes: cfg.attrs must not point into this call's frame.
    return [cfg, attr]() mutable {
      cfg.attrs = attr;
      CHECK(cudaLaunchKernelEx(&cfg, empty_kernel, 0));
    };
  };
  struct Row {
    const char* name;
    double host, gpu;
  };
  std::vector<Row> rows;
  unsigned int* counter = nullptr;
  CHECK(cudaMalloc(&counter, sizeof(unsigned int)));
  auto add = [&](const char* name, auto launch) {
    rows.push_back({name, host_us_per_launch(launch, n), gpu_us(launch, 50, counter)});
  };
  add("<<<>>>", [&] {
    empty_kernel<<<grid, block>>>(0);
    CHECK(cudaGetLastError());
  });
  add("cudaLaunchKernelEx", ex(false, false, false));
  add("... + 2-CTA cluster", ex(true, false, false));
  add("... + cooperative", ex(false, true, false));
  add("... + cooperative + 2-CTA cluster", ex(true, true, false));
  add("... + programmatic serialization", ex(false, false, true));
  std::printf("launch of an empty kernel (%u CTAs x %u threads): host us per launch (loop of %d), GPU us (events, "
              "median of 50)\n",
              grid.x, block.x, n);
  for (const Row& r : rows) std::printf("  %-36s host %6.2f us   gpu %6.2f us\n", r.name, r.host, r.gpu);

  // 2. One grid-wide barrier among one CTA per SM.
  int smem = static_cast<int>(prop.sharedMemPerMultiprocessor) / 2 + 1024;  // only one CTA fits on an SM
  smem = std::min(smem, static_cast<int>(prop.sharedMemPerBlockOptin));
  CHECK(cudaFuncSetAttribute(spin_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const long long spin = 20000;  // cycles, ~10 us: every CTA is resident before the first one arrives
  auto spin_launch = [&](int mode, bool coop) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(sms);
    cfg.blockDim = dim3(128);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = 0;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    cfg.numAttrs = coop ? 1 : 0;
    return [cfg, attr, mode, spin, counter]() mutable {
      cfg.attrs = attr;  // the closure's own copy (see above)
      CHECK(cudaLaunchKernelEx(&cfg, spin_kernel, spin, mode, counter));
    };
  };
  const double t_none = gpu_us(spin_launch(0, false), 50, counter);
  const double t_counter = gpu_us(spin_launch(1, false), 50, counter);
  const double t_none_coop = gpu_us(spin_launch(0, true), 50, counter);
  const double t_grid_sync = gpu_us(spin_launch(2, true), 50, counter);
  std::printf("grid barrier among %d CTAs (one per SM, %d B of shared memory each; %lld cycles of spin first): kernel "
              "us, median of 50\n",
              sms, smem, spin);
  std::printf("  no barrier %.2f, global counter %.2f (+%.2f); cooperative launch: no barrier %.2f, grid.sync %.2f "
              "(+%.2f)\n",
              t_none, t_counter, t_counter - t_none, t_none_coop, t_grid_sync, t_grid_sync - t_none_coop);
  CHECK(cudaFree(counter));
  return 0;
}
