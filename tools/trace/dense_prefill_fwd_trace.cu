// tools/trace/dense_prefill_fwd_trace.cu — event timeline of the dense MHA prefill forward's roles (diagnostic).
//
// Question it answers: in the persistent forward (src/sm90/prefill/dense/fwd.cu, kPersistentTma, the shipped form),
// which stretch of a consumer warpgroup's key-block step is longer than the other warpgroup's GEMMs, so that the tensor
// pipe drains between the two warpgroups' turns (the ncu profile beside FA3: docs/dense-prefill.md, "Forward: a
// dynamic tile walk for the persistent grid")? Builds fwd.cu with FLASHMLA_TRACE (the events listed at the top of
// fwd.cu), runs dense_prefill_fwd's kernel on random bf16 inputs of one benchmark shape (b 2, equal lengths), times it
// (CUDA events, 20 runs, no L2 flush), runs it once more with the trace buffer set and prints, per role, the median
// and p10 / p90 cycles of each stretch of a step over the traced CTAs' steps 2-39 (the ring blocks of the CTA's first
// tiles; a tile's first block has no step events), the cross-warpgroup turn times, the TMA thread's waits for free
// stages and the per-tile Q wait and epilogue. Not a test: the output is not checked (tests/gpu and
// tools/dense_prefill_check cover correctness).
//
// Build and run on an sm_90a machine (from the repository root):
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc -DFLASHMLA_WITH_CUDA=1 -DFLASHMLA_TRACE \
//        --expt-relaxed-constexpr --use_fast_math -o /tmp/dense_prefill_fwd_trace \
//        tools/trace/dense_prefill_fwd_trace.cu src/core/status.cpp
//   /tmp/dense_prefill_fwd_trace 8192 128 128 128 1     # s h h_kv d causal(0|1) [every=1]
//   /tmp/dense_prefill_fwd_trace selftest               # no GPU: the statistics on synthetic records
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "trace_host.cuh"
#include "sm90/prefill/dense/fwd.cu"
#include "../dense_prefill_check/standalone.h"

namespace {

namespace tr = flashmla::sm90::trace;
using Rec = std::vector<unsigned long long>;  // slots x kRoles x kMaxSteps x kEvents

unsigned long long at(const Rec& r, int slot, int role, int step, int ev) {
  return r[((static_cast<size_t>(slot) * tr::kRoles + role) * tr::kMaxSteps + step) * tr::kEvents + ev];
}

struct Stat {
  std::vector<double> v;
  void add(double x) { v.push_back(x); }
  std::string str() {
    if (v.empty()) return "      -";
    std::sort(v.begin(), v.end());
    auto q = [&](double f) { return v[std::min(v.size() - 1, static_cast<size_t>(f * (v.size() - 1) + 0.5))]; };
    char b[96];
    std::snprintf(b, sizeof b, "%7.0f (p10 %6.0f, p90 %6.0f, n %zu)", q(0.5), q(0.1), q(0.9), v.size());
    return b;
  }
};

// Per role, the stretches of a consumer step (events 0-7 of fwd.cu's list), the step period, the turn hand-offs,
// the TMA thread's waits and the per-tile stretches, over steps [first_step, kMaxSteps) of `slots` CTAs.
void analyse(const Rec& r, int slots, int first_step) {
  static const char* kStretch[] = {"wait K / V full", "wait for the turn", "issue S + P V", "wait for S",
                                   "softmax", "wait for P V", "rescale + pack P"};
  for (int wg = 0; wg < 2; ++wg) {
    Stat st[7], period, gap;
    for (int c = 0; c < slots; ++c)
      for (int s = first_step; s < tr::kMaxSteps; ++s) {
        if (at(r, c, wg, s, 0) == 0 || at(r, c, wg, s, 7) == 0) continue;
        for (int e = 0; e < 7; ++e) st[e].add(double(at(r, c, wg, s, e + 1)) - double(at(r, c, wg, s, e)));
        if (s + 1 < tr::kMaxSteps && at(r, c, wg, s + 1, 0) != 0) {
          period.add(double(at(r, c, wg, s + 1, 0)) - double(at(r, c, wg, s, 0)));
          gap.add(double(at(r, c, wg, s + 1, 0)) - double(at(r, c, wg, s, 7)));
        }
      }
    std::printf("consumer warpgroup %d, cycles per key-block step:\n", wg);
    for (int e = 0; e < 7; ++e) std::printf("  %-20s %s\n", kStretch[e], st[e].str().c_str());
    std::printf("  %-20s %s\n", "end -> next start", gap.str().c_str());
    std::printf("  %-20s %s\n", "step period", period.str().c_str());
  }
  // Turn hand-offs: warpgroup 1 gets its turn after warpgroup 0 issued (same step), warpgroup 0 after warpgroup 1
  // issued (warpgroup 0's next step). Positive: the other warpgroup waited; the issue-to-issue times say how long the
  // tensor pipe had each warpgroup's batch.
  Stat w1_after_w0, w0_after_w1, issue01, issue10;
  for (int c = 0; c < slots; ++c)
    for (int s = first_step; s + 1 < tr::kMaxSteps; ++s) {
      const auto a2 = at(r, c, 0, s, 2), a3 = at(r, c, 0, s, 3), b2 = at(r, c, 1, s, 2), b3 = at(r, c, 1, s, 3);
      const auto a2n = at(r, c, 0, s + 1, 2);
      if (a3 && b2) w1_after_w0.add(double(b2) - double(a3));
      if (b3 && a2n) w0_after_w1.add(double(a2n) - double(b3));
      if (a2 && b2) issue01.add(double(b2) - double(a2));
      if (b2 && a2n) issue10.add(double(a2n) - double(b2));
    }
  std::printf("turns:\n  %-36s %s\n  %-36s %s\n  %-36s %s\n  %-36s %s\n", "wg1 turn - wg0 issued (same step)",
              w1_after_w0.str().c_str(), "wg0 next turn - wg1 issued", w0_after_w1.str().c_str(),
              "wg0 turn -> wg1 turn", issue01.str().c_str(), "wg1 turn -> wg0 next turn", issue10.str().c_str());
  Stat kwait, kv;
  for (int c = 0; c < slots; ++c)
    for (int s = first_step; s < tr::kMaxSteps; ++s) {
      if (at(r, c, 2, s, 0) == 0 || at(r, c, 2, s, 2) == 0) continue;
      kwait.add(double(at(r, c, 2, s, 1)) - double(at(r, c, 2, s, 0)));
      kv.add(double(at(r, c, 2, s, 2)) - double(at(r, c, 2, s, 1)));
    }
  std::printf("TMA thread per ring block:\n  %-20s %s\n  %-20s %s\n", "wait K stage + issue", kwait.str().c_str(),
              "V stage + issue", kv.str().c_str());
  Stat qwait, epi, between;
  for (int c = 0; c < slots; ++c)
    for (int s = 0; s < tr::kMaxSteps; ++s) {
      if (at(r, c, 3, s, 0) == 0 || at(r, c, 3, s, 3) == 0) continue;
      qwait.add(double(at(r, c, 3, s, 1)) - double(at(r, c, 3, s, 0)));
      epi.add(double(at(r, c, 3, s, 3)) - double(at(r, c, 3, s, 2)));
      if (s + 1 < tr::kMaxSteps && at(r, c, 3, s + 1, 0)) between.add(double(at(r, c, 3, s + 1, 0)) - double(at(r, c, 3, s, 3)));
    }
  std::printf("per tile (warpgroup 0):\n  %-20s %s\n  %-20s %s\n  %-20s %s\n", "Q wait", qwait.str().c_str(),
              "epilogue", epi.str().c_str(), "end -> next start", between.str().c_str());
}

// Synthetic records with known stretches: the medians printed must be the ones written here.
int selftest() {
  const int slots = 3;
  Rec r(static_cast<size_t>(slots) * tr::kRoles * tr::kMaxSteps * tr::kEvents, 0);
  auto put = [&](int c, int role, int s, int e, unsigned long long v) {
    r[((static_cast<size_t>(c) * tr::kRoles + role) * tr::kMaxSteps + s) * tr::kEvents + e] = v;
  };
  const int d[7] = {10, 20, 30, 400, 900, 50, 60};  // per stretch; a step: 1470 + 30 cycles to the next start
  for (int c = 0; c < slots; ++c)
    for (int wg = 0; wg < 2; ++wg)
      for (int s = 1; s < tr::kMaxSteps; ++s) {
        unsigned long long t = 1000 + 1500ull * s + 700ull * wg;
        put(c, wg, s, 0, t);
        for (int e = 0; e < 7; ++e) put(c, wg, s, e + 1, t += d[e]);
      }
  analyse(r, slots, 2);
  std::printf("selftest: expect 10 20 30 400 900 50 60, end -> next start 30, step period 1500, wg1 turn - wg0 issued "
              "670, wg0 next turn - wg1 issued 770\n");
  return 0;
}

flashmla::TensorRef ref(void* data, flashmla::DType dt, int ndim, const int64_t* shape, const int64_t* stride) {
  int64_t meta[8];
  for (int i = 0; i < ndim; ++i) {
    meta[i] = shape[i];
    meta[ndim + i] = stride[i];
  }
  return flashmla::standalone::cuda_ref(data, dt, ndim, meta, 0);
}

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += gridDim.x * static_cast<int64_t>(blockDim.x))
    p[i] = __float2bfloat16((mix(i * 2654435761ULL + seed) / 4294967296.0f - 0.5f) * 2.f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "selftest") == 0) return selftest();
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s s h h_kv d causal(0|1) [every=1] | selftest\n", argv[0]);
    return 2;
  }
  const int64_t s = std::atoll(argv[1]), h = std::atoll(argv[2]), hk = std::atoll(argv[3]), d = std::atoll(argv[4]);
  const bool causal = std::atoi(argv[5]) != 0;
  const int every = argc > 6 ? std::max(1, std::atoi(argv[6])) : 1;
  const int64_t b = 2, dv = 128, total = b * s;
  __nv_bfloat16 *q, *k, *v, *out;
  float* lse;
  int32_t* cu;
  CHECK(cudaMalloc(&q, total * h * d * 2));
  CHECK(cudaMalloc(&k, total * hk * d * 2));
  CHECK(cudaMalloc(&v, total * hk * dv * 2));
  CHECK(cudaMalloc(&out, total * h * dv * 2));
  CHECK(cudaMalloc(&lse, total * h * 4));
  CHECK(cudaMalloc(&cu, 3 * 4));
  fill_bf16<<<1024, 256>>>(q, total * h * d, 1);
  fill_bf16<<<1024, 256>>>(k, total * hk * d, 2);
  fill_bf16<<<1024, 256>>>(v, total * hk * dv, 3);
  const int32_t cu_h[3] = {0, static_cast<int32_t>(s), static_cast<int32_t>(2 * s)};
  CHECK(cudaMemcpy(cu, cu_h, sizeof cu_h, cudaMemcpyHostToDevice));

  flashmla::DensePrefillParams p;
  const auto bf = flashmla::DType::kBFloat16;
  const int64_t qs[3] = {total, h, d}, qst[3] = {h * d, d, 1}, ks[3] = {total, hk, d}, kst[3] = {hk * d, d, 1};
  const int64_t vs[3] = {total, hk, dv}, vst[3] = {hk * dv, dv, 1}, os[3] = {total, h, dv}, ost[3] = {h * dv, dv, 1};
  const int64_t ls[2] = {total, h}, lst[2] = {h, 1}, cs[1] = {3}, cst[1] = {1};
  p.q = ref(q, bf, 3, qs, qst);
  p.k = ref(k, bf, 3, ks, kst);
  p.v = ref(v, bf, 3, vs, vst);
  p.out = ref(out, bf, 3, os, ost);
  p.lse = ref(lse, flashmla::DType::kFloat32, 2, ls, lst);
  p.cu_seqlens_qo = ref(cu, flashmla::DType::kInt32, 1, cs, cst);
  p.cu_seqlens_kv = ref(cu, flashmla::DType::kInt32, 1, cs, cst);
  p.max_seqlen_qo = p.max_seqlen_kv = s;
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(d));
  p.causal = causal;
  auto run = [&] {
    const flashmla::Status st = flashmla::sm90::dense_prefill_fwd(p);
    if (!st.ok()) {
      std::fprintf(stderr, "dense_prefill_fwd: %s\n", st.message.c_str());
      std::exit(1);
    }
  };
  for (int i = 0; i < 3; ++i) run();
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const int reps = 20;
  CHECK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) run();
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  ms /= reps;
  const double pairs = causal ? b * (s * (s + 1) / 2.0) : b * double(s) * s;
  std::printf("case s %lld h %lld/%lld d %lld %s: %.3f ms, %.1f TFLOP/s\n", (long long)s, (long long)h, (long long)hk,
              (long long)d, causal ? "causal" : "full", ms, pairs * h * 2 * (d + dv) / ms / 1e9);

  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int slots = (sms + every - 1) / every;
  const size_t n = static_cast<size_t>(slots) * tr::kRoles * tr::kMaxSteps * tr::kEvents;
  unsigned long long* buf;
  CHECK(cudaMalloc(&buf, n * 8));
  CHECK(cudaMemset(buf, 0, n * 8));
  CHECK(cudaMemcpyToSymbol(g_trace, &buf, sizeof buf));
  CHECK(cudaMemcpyToSymbol(g_trace_every, &every, sizeof every));
  CHECK(cudaMemcpyToSymbol(g_trace_slots, &slots, sizeof slots));
  run();
  CHECK(cudaDeviceSynchronize());
  Rec r(n);
  CHECK(cudaMemcpy(r.data(), buf, n * 8, cudaMemcpyDeviceToHost));
  std::printf("traced CTAs: %d (every %d of %d SMs), steps 2-%d of each\n", slots, every, sms, tr::kMaxSteps - 1);
  analyse(r, slots, 2);
  return 0;
}
