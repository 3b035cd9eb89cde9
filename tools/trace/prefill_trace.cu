// tools/trace/prefill_trace.cu — timeline of the sparse-prefill seesaw kernel's roles (diagnostic).
//
// Builds the seesaw kernel (src/sm90/prefill/sparse/wgmma_seesaw_kernel.cuh) with FLASHMLA_TRACE defined, runs it on
// random inputs of one benchmark shape, times it (CUDA events, L2 flushed between runs), then runs it
// once more with the event buffer set and prints, per role, the median cycles between the events of one
// pipeline step (a pair of 64-key blocks) over the traced CTAs' middle steps. Not a test: the output is
// not checked (tests/gpu covers correctness).
//
// Build and run on an sm_90a machine (from the repository root):
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc -I.deps/cutlass_include \
//        -DFLASHMLA_WITH_CUDA -DFLASHMLA_TRACE --expt-relaxed-constexpr --use_fast_math -o /tmp/prefill_trace \
//        tools/trace/prefill_trace.cu
//   /tmp/prefill_trace 576 128 2048 8192     # d_qk h_q topk s_kv [s_q=4096] [every=97]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "trace_host.cuh"
#include "sm90/prefill/sparse/wgmma_seesaw_kernel.cuh"

namespace {


__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * static_cast<int64_t>(blockDim.x))
    p[i] = __float2bfloat16((mix(i * 2654435761ULL + seed) / 4294967296.0f - 0.5f) * 0.3f);
}
// Random token per slot (repeats possible within a row; the benchmark draws distinct tokens).
__global__ void fill_idx(int32_t* p, int64_t n, int s_kv, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * static_cast<int64_t>(blockDim.x))
    p[i] = static_cast<int32_t>(mix(i * 0x9E3779B97F4A7C15ULL + seed) % static_cast<uint32_t>(s_kv));
}

}  // namespace

int main(int argc, char** argv) {
  namespace tr = flashmla::sm90::trace;
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s d_qk h_q topk s_kv [s_q=4096] [every=97]\n", argv[0]);
    return 2;
  }
  const int d = std::atoi(argv[1]), h_q = std::atoi(argv[2]), topk = std::atoi(argv[3]), s_kv = std::atoi(argv[4]);
  const int s_q = argc > 5 ? std::atoi(argv[5]) : 4096;
  const int every = argc > 6 ? std::atoi(argv[6]) : 97;
  if ((d != 576 && d != 512) || h_q % 64 != 0 || topk % 64 != 0) {
    std::fprintf(stderr, "d_qk 576|512, h_q a multiple of 64, topk a multiple of 64\n");
    return 2;
  }
  __nv_bfloat16 *q, *kv, *out;
  int32_t* idx;
  float *sink, *ml, *lse;
  CHECK(cudaMalloc(&q, sizeof(__nv_bfloat16) * s_q * h_q * d));
  CHECK(cudaMalloc(&kv, sizeof(__nv_bfloat16) * static_cast<int64_t>(s_kv) * d));
  CHECK(cudaMalloc(&out, sizeof(__nv_bfloat16) * s_q * h_q * 512));
  CHECK(cudaMalloc(&idx, sizeof(int32_t) * s_q * topk));
  CHECK(cudaMalloc(&sink, sizeof(float) * h_q));
  CHECK(cudaMalloc(&ml, sizeof(float) * s_q * h_q));
  CHECK(cudaMalloc(&lse, sizeof(float) * s_q * h_q));
  fill_bf16<<<1024, 256>>>(q, static_cast<int64_t>(s_q) * h_q * d, 1);
  fill_bf16<<<1024, 256>>>(kv, static_cast<int64_t>(s_kv) * d, 2);
  fill_idx<<<1024, 256>>>(idx, static_cast<int64_t>(s_q) * topk, s_kv, 3);
  CHECK(cudaMemset(sink, 0, sizeof(float) * h_q));
  void* flush;
  const size_t flush_bytes = size_t(256) << 20;
  CHECK(cudaMalloc(&flush, flush_bytes));

  flashmla::sm90::SparsePrefillKernelParams kp{};
  kp.q = q;
  kp.q_stride_s = static_cast<int64_t>(h_q) * d;
  kp.q_stride_h = d;
  kp.kv = kv;
  kp.kv_stride_s = d;
  kp.indices = idx;
  kp.idx_stride_s = topk;
  kp.idx_stride_k = 1;
  kp.attn_sink = sink;
  kp.sink_stride = 1;
  kp.out = out;
  kp.o_stride_s = static_cast<int64_t>(h_q) * 512;
  kp.o_stride_h = 512;
  kp.o_stride_d = 1;
  kp.max_logits = ml;
  kp.ml_stride_s = h_q;
  kp.ml_stride_h = 1;
  kp.lse = lse;
  kp.lse_stride_s = h_q;
  kp.lse_stride_h = 1;
  kp.s_q = s_q;
  kp.h_q = h_q;
  kp.s_kv = s_kv;
  kp.topk = topk;
  kp.num_head_tiles = h_q / 64;
  kp.q_vec = kp.kv_vec = kp.out_vec_ok = 1;
  // FLASHMLA_TRACE_NOBULK=1: the per-thread epilogue stores instead of the staged bulk row copies.
  kp.out_bulk_ok = std::getenv("FLASHMLA_TRACE_NOBULK") ? 0 : 1;
  kp.scale_log2 = 0.5f * 1.4426950408889634f;
  int n_sm = 0;
  CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
  kp.prefetch_ahead = std::getenv("FLASHMLA_TRACE_NOQPF") ? 0 : n_sm;  // =1: no L2 prefetch of the next CTA's Q
  auto run = [&]() {
    CHECK(d == 576 ? flashmla::sm90::sparse_prefill::wgmma_seesaw::launch<576>(kp, 0)
                   : flashmla::sm90::sparse_prefill::wgmma_seesaw::launch<512>(kp, 0));
  };

  // Timing (trace buffer unset: the trace branches are taken as "off").
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < 8; ++r) {
    CHECK(cudaMemsetAsync(flush, r, flush_bytes));
    CHECK(cudaEventRecord(e0));
    run();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float t;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (r > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double t_us = ms[ms.size() / 2] * 1e3;
  const double flop = 2.0 * s_q * static_cast<double>(topk) * h_q * (d + 512);
  int dev_clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&dev_clock_khz, cudaDevAttrClockRate, 0));
  std::printf("case d_qk %d h_q %d topk %d s_kv %d s_q %d: %.1f us, %.1f TFLOP/s (median of %zu)\n", d, h_q, topk,
              s_kv, s_q, t_us, flop / t_us * 1e-6, ms.size());

  // One traced run.
  const int n_cta = s_q * (h_q / 64);
  const int slots = (n_cta + every - 1) / every;
  const size_t n_rec = static_cast<size_t>(slots) * tr::kRoles * tr::kMaxSteps * tr::kEvents;
  unsigned long long* buf;
  CHECK(cudaMalloc(&buf, n_rec * 8));
  CHECK(cudaMemset(buf, 0, n_rec * 8));
  CHECK(cudaMemcpyToSymbol(g_trace, &buf, sizeof(buf)));
  CHECK(cudaMemcpyToSymbol(g_trace_every, &every, sizeof(int)));
  CHECK(cudaMemcpyToSymbol(g_trace_slots, &slots, sizeof(int)));
  CHECK(cudaMemsetAsync(flush, 7, flush_bytes));
  CHECK(cudaEventRecord(e0));
  run();
  CHECK(cudaEventRecord(e1));
  CHECK(cudaDeviceSynchronize());
  float t_traced;
  CHECK(cudaEventElapsedTime(&t_traced, e0, e1));
  std::vector<unsigned long long> h(n_rec);
  CHECK(cudaMemcpy(h.data(), buf, n_rec * 8, cudaMemcpyDeviceToHost));
  std::printf("traced run %.1f us; %d traced CTAs (every %d-th); SM clock attribute %.0f MHz\n", t_traced * 1e3,
              slots, every, dev_clock_khz / 1e3);
  auto at = [&](int slot, int role, int step, int ev) {
    return h[((static_cast<size_t>(slot) * tr::kRoles + role) * tr::kMaxSteps + step) * tr::kEvents + ev];
  };
  const int n_pairs = (topk / 64 + 1) / 2;
  const char* role_names[3] = {"WG0", "WG1", "producer"};
  // Per role: median over traced CTAs and middle steps (1 .. n_pairs-2) of event k minus event 0 of
  // the step, and of the step period (event 0 of step j+1 minus event 0 of step j).
  for (int role = 0; role < 3; ++role) {
    std::printf("%s (cycles after the step's event 0; period = event 0 to the next step's event 0):\n",
                role_names[role]);
    std::vector<double> per;
    for (int s = 0; s < slots; ++s)
      for (int j = 1; j + 2 < n_pairs && j + 1 < tr::kMaxSteps; ++j)
        if (at(s, role, j, 0) && at(s, role, j + 1, 0)) per.push_back(double(at(s, role, j + 1, 0) - at(s, role, j, 0)));
    std::sort(per.begin(), per.end());
    if (!per.empty()) std::printf("  period median %.0f (p10 %.0f, p90 %.0f, n %zu)\n", per[per.size() / 2],
                                  per[per.size() / 10], per[per.size() * 9 / 10], per.size());
    for (int ev = 1; ev < tr::kEvents; ++ev) {
      std::vector<double> v;
      for (int s = 0; s < slots; ++s)
        for (int j = 1; j + 2 < n_pairs && j < tr::kMaxSteps; ++j)
          if (at(s, role, j, 0) && at(s, role, j, ev)) v.push_back(double(at(s, role, j, ev)) - double(at(s, role, j, 0)));
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      std::printf("  e%-2d median %7.0f  p10 %7.0f  p90 %7.0f\n", ev, v[v.size() / 2], v[v.size() / 10],
                  v[v.size() * 9 / 10]);
    }
  }
  // Cross-role alignment: events of all roles relative to WG0's event 0 of the same step.
  std::printf("all roles relative to WG0 e0 of the same step (median cycles):\n");
  for (int role = 0; role < 3; ++role) {
    std::printf("  %-8s", role_names[role]);
    for (int ev = 0; ev < 9; ++ev) {
      std::vector<double> v;
      for (int s = 0; s < slots; ++s)
        for (int j = 1; j + 2 < n_pairs && j < tr::kMaxSteps; ++j)
          if (at(s, 0, j, 0) && at(s, role, j, ev)) v.push_back(double(at(s, role, j, ev)) - double(at(s, 0, j, 0)));
      if (v.empty()) {
        std::printf("       -");
        continue;
      }
      std::sort(v.begin(), v.end());
      std::printf(" %7.0f", v[v.size() / 2]);
    }
    std::printf("\n");
  }
  // CTA: start -> Q loaded -> loop done -> end.
  std::vector<double> q_us, loop_us, epi_us;
  for (int s = 0; s < slots; ++s) {
    if (!at(s, 3, 0, 1) || !at(s, 3, 0, 4)) continue;
    q_us.push_back(double(at(s, 3, 0, 2) - at(s, 3, 0, 1)));
    loop_us.push_back(double(at(s, 3, 0, 3) - at(s, 3, 0, 2)));
    epi_us.push_back(double(at(s, 3, 0, 4) - at(s, 3, 0, 3)));
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v.empty() ? 0.0 : v[v.size() / 2]; };
  std::printf("CTA (cycles, median): start->Q ready %.0f, pair loop %.0f, epilogue %.0f\n", med(q_us), med(loop_us),
              med(epi_us));
  // One CTA's full timeline (middle slot), for reading by eye.
  const int s0 = slots / 2;
  const unsigned long long t0 = at(s0, 3, 0, 1);
  std::printf("timeline of traced CTA %d (cycles from its start):\n", s0 * every);
  for (int j = 0; j < n_pairs && j < tr::kMaxSteps; ++j) {
    for (int role = 0; role < 3; ++role) {
      std::printf("  pair %2d %-8s", j, role_names[role]);
      for (int ev = 0; ev < 9; ++ev) {
        const unsigned long long v = at(s0, role, j, ev);
        if (v) std::printf(" %7lld", static_cast<long long>(v - t0));
        else std::printf("       -");
      }
      std::printf("\n");
    }
  }
  return 0;
}
