// tools/trace/dense_trace.cu — event timeline of the dense MLA decode seesaw kernel (diagnostic, not a test).
//
// The library's own host path runs the call: src/sm90/decode/dense/dense_decode.cu (kernel parameters, K tensor map,
// staged / direct epilogue choice, stage order), src/sm90/common/scheduler.cu (the device split-KV scheduler) and
// src/sm90/common/combine.cu are compiled into this program unchanged; only the two main-kernel entry points that
// dense_decode.cu calls (launch_dense_main_bf16 / _fp16, normally src/sm90/decode/dense/instantiations_{bf16,fp16}.cu) are
// defined here, launching the seesaw kernel (src/sm90/decode/dense/wgmma_seesaw_kernel.cuh) compiled in this file with
// FLASHMLA_TRACE. num_sm_parts is the library's rule (core::dense_decode_num_sm_parts).
//
// Inputs as bench/bench_dense_decode.py: bf16, d_qk 576, h_kv 1, uniform lengths s_k, q / k = randn / 10
// clamped to [-1, 1], block table = a random permutation of b * ceil(s_k / 256) * 256 / pbs pages.
// Prints: the kernel (direct / staged epilogue) and grid that ran; times (CUDA events, L2 flushed before
// each run, median; the trace build with tracing off) of main, main + combine (the whole call with the
// schedule reused, as the anchors' whole-call graph), scheduler + main + combine; then one traced main +
// combine run: per-CTA timeline summary (%globaltimer / calibrated clock64, ns from the earliest CTA
// start), one line per traced CTA, per-role median times of the pair loop's events (cycles), and the
// timeline of the CTA that exits last. Checks only: no CUDA error, device schedule == host schedule,
// outputs not all NaN.
//
// Cross-SM clock: each CTA event is stored as %globaltimer and clock64. %globaltimer may advance in coarse
// steps (the step is measured and printed), so each SM's clock64 is mapped to %globaltimer ns by two
// calibration kernels, one CTA per SM, run right before and after the traced run (each records clock64
// at a %globaltimer step edge); the mapping is used when it agrees with the CTAs' own %globaltimer reads
// (residuals printed), else a per-CTA offset fitted to those reads.
//
// Build and run on an sm_90a machine (from the repository root; tools/trace/run-dense-trace.sh does both):
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc -I.deps/cutlass_include
//        -DFLASHMLA_WITH_CUDA=1 -DFLASHMLA_TRACE --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
//        -o /tmp/dense_trace tools/trace/dense_trace.cu src/sm90/decode/dense/dense_decode.cu src/sm90/common/scheduler.cu
//        src/sm90/common/combine.cu src/core/scheduler.cpp          (one command line)
//   /tmp/dense_trace 128 1 8 256          # b s_q h_q s_k [pbs=64] [staged=auto|0|1] [every=1]
// With -DFLASHMLA_DENSE_TRACE_CTA_ONLY as well: only the CTA-level events (no trace code in the pair loop).
// Environment: DTRACE_REPS (timed runs, default 20), DTRACE_CTA_LINES=0 (no per-CTA lines),
// DTRACE_SELFTEST=1|2|3 (no GPU: the analysis on synthetic records, see selftest()).
// The trace build's kernel differs from the library's (the record pointer and counters take registers; with
// pair events the staged kernel's pair loop has a few spill loads): compare its "tracing off" times with the
// library's before reading small differences into the timeline.
#include <cuda.h>
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
#include "sm90/decode/dense/dense_decode.h"
#include "sm90/decode/dense/wgmma_seesaw_kernel.cuh"
#include "sm90/sm90.h"

#ifndef FLASHMLA_TRACE
#error "build with -DFLASHMLA_TRACE (see the header comment)"
#endif

namespace tr = flashmla::sm90::trace;

// ------------------------------------------------------------------ main-kernel entry points (the traced seesaw kernel)
namespace flashmla::sm90 {
namespace dtrace {
DenseDecodeKernelParams last_kp{};
int last_parts = 0, launches = 0;
bool last_tma = false;
}  // namespace dtrace

cudaError_t launch_dense_main_bf16(const DenseDecodeKernelParams& kp, const CUtensorMap* tmap, int num_sm_parts,
                                   DenseKernel /*kernel*/, cudaStream_t stream) {
  dtrace::last_kp = kp;
  dtrace::last_parts = num_sm_parts;
  dtrace::last_tma = tmap != nullptr && kp.tma_ok;
  ++dtrace::launches;
  if (!dtrace::last_tma || kp.d_qk != 576) return cudaErrorNotSupported;  // this tool builds the seesaw kernel, d_qk 576 only
  return dense_seesaw::launch_main_d<__nv_bfloat16, 576>(kp, *tmap, num_sm_parts, stream);
}
cudaError_t launch_dense_main_fp16(const DenseDecodeKernelParams&, const CUtensorMap*, int, DenseKernel, cudaStream_t) {
  return cudaErrorNotSupported;
}
}  // namespace flashmla::sm90

namespace {

using namespace flashmla;


__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// randn / 10 clamped to [-1, 1] (bench/bench_dense_decode.py's inputs), counter-based.
__global__ void fill_randn_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(seed * 0x632BE59BD9B4E019ull + mix64(static_cast<uint64_t>(i)));
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777217.0f);
    const float u2 = static_cast<float>((h >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
    const float v = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2) * 0.1f;
    p[i] = __float2bfloat16(fminf(fmaxf(v, -1.f), 1.f));
  }
}

// One CTA per SM (the dynamic shared memory allows one): thread 0 spins until %globaltimer changes and
// records clock64 at that edge, then at the next edge. rec[5 * cta ..]: smid, gt1, clk1, gt2, clk2.
constexpr int kCalibSmem = 160 * 1024;
__global__ void calib_kernel(unsigned long long* rec) {
  extern __shared__ uint8_t calib_smem[];
  (void)calib_smem;  // only its size matters: one CTA per SM
  if (threadIdx.x != 0) return;
  const unsigned long long g0 = flashmla_trace_globaltimer();
  unsigned long long g1, c1, g2, c2;
  do {
    c1 = clock64();
    g1 = flashmla_trace_globaltimer();
  } while (g1 == g0);
  do {
    c2 = clock64();
    g2 = flashmla_trace_globaltimer();
  } while (g2 == g1);
  unsigned long long* r = rec + 5 * blockIdx.x;
  r[0] = flashmla_trace_smid();
  r[1] = g1;
  r[2] = c1;
  r[3] = g2;
  r[4] = c2;
}

struct Calib {
  bool ok = false;
  unsigned long long g_raw = 0, c_raw = 0;  // one (globaltimer ns, clock64) pair at an edge
  double g = 0, c = 0;  // the same relative to the time base (see below): doubles hold 2^53 exactly, not ~1.7e18
  double tick = 0;      // globaltimer step seen
};
void launch_calib(int n_sm, unsigned long long* dbuf) {
  calib_kernel<<<n_sm, 32, kCalibSmem>>>(dbuf);
  CHECK(cudaGetLastError());
}
std::vector<Calib> read_calib(int n_sm, const unsigned long long* dbuf, int max_smid) {
  std::vector<unsigned long long> h(static_cast<size_t>(5) * n_sm);
  CHECK(cudaMemcpy(h.data(), dbuf, h.size() * 8, cudaMemcpyDeviceToHost));
  std::vector<Calib> out(max_smid + 1);
  for (int i = 0; i < n_sm; ++i) {
    const unsigned long long* r = &h[5 * static_cast<size_t>(i)];
    if (r[1] == 0 || r[0] > static_cast<unsigned long long>(max_smid) || out[r[0]].ok) continue;  // unwritten / seen
    Calib& c = out[r[0]];
    c.ok = true;
    c.g_raw = r[1];
    c.c_raw = r[2];
    c.tick = static_cast<double>(r[3] - r[1]);
  }
  return out;
}

double pct(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}
double median(const std::vector<double>& v) { return pct(v, 0.5); }

void print_dist(const char* name, const std::vector<double>& v, double scale, const char* unit) {
  if (v.empty()) {
    std::printf("  %-44s   (no samples)\n", name);
    return;
  }
  std::printf("  %-44s n %4zu  p10 %8.2f  p50 %8.2f  p90 %8.2f  max %8.2f %s\n", name, v.size(), pct(v, 0.1) * scale,
              pct(v, 0.5) * scale, pct(v, 0.9) * scale, pct(v, 1.0) * scale, unit);
}

float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TensorRef tref(void* data, DType dt, std::initializer_list<int64_t> shape) {
  TensorRef t;
  t.defined = true;
  t.data = data;
  t.dtype = dt;
  t.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = st;
    st *= t.shape[d];
  }
  t.device = Device{DeviceType::kCUDA, 0};
  return t;
}

// Record layout of src/sm90/decode/dense/wgmma_seesaw_kernel.cuh (its header comment).
constexpr int kCtaRecReqMax = 12;  // request records per CTA (role 3 records 1 .. 12)
const char* kEvNames[3][12] = {
    {"pair top", "stage0 slab0 full", "S0 done", "Scale0 published", "P0V0_L issued", "Scale1 received",
     "P0 stored+announced", "P0V0_L done", "P1 received", "P1V1_L issued", "P1V1_L done", "pair end"},
    {"pair top", "stage1 slab4 full", "S1 done", "Scale0 received", "Scale1 published", "P1V1_R issued",
     "P1 announced", "P0 received", "P0V0_R issued", "P1V1_R done", "P0V0_R done", "pair end"},
    {"t0: st0 slabs0-3 reload", "t0: st1 slabs0-3,8 reload", "t128: st1 slabs4-7 reload",
     "t128: st0 slabs4-8 reload", "t0: Q cp.async issued", "t0: first 2 blocks issued", "", "", "", "", "", ""}};
const char* kRoleNames[3] = {"WG0 (tid 0)", "WG1 (tid 128)", "TMA issue"};

// Raw values are kept as integers: %globaltimer is ~1.7e18 ns (since the epoch), beyond a double's exact
// integers; times are converted to doubles only relative to a base (G0 / the SM's clock base).
struct ReqRec {
  int req = 0, n_blk = 0, no_split = 0, first_pair = 0, blk_lo = 0, split_slot = 0, seqlen = 0;
  bool has[7] = {};
  unsigned long long gt_raw[7] = {}, ck_raw[7] = {};
  double t[7] = {};    // ns from G0: first the globaltimer read, then the common time base
  double clk[7] = {};  // clock64 - the CTA's clock base
};
struct CtaRec {
  int slot = 0, cta = 0, smid = -1, n_req = 0, begin_req = 0, end_req = 0, begin_blk = 0, end_blk = 0, splitted = 0;
  bool valid = false, has[4] = {};
  unsigned long long gt_raw[4] = {}, ck_raw[4] = {};
  double t[4] = {};  // entry, barriers initialised, metadata read, exit (as ReqRec::t)
  double clk[4] = {};
  double f = 0;       // cycles per ns used for this CTA
  std::vector<ReqRec> reqs;
};
double idiff(unsigned long long a, unsigned long long b) { return static_cast<double>(static_cast<long long>(a - b)); }

}  // namespace

// Trace run facts the analysis needs.
struct TraceInfo {
  int slots, every, n_cta, m_tiles, h_kv, d, clock_khz, max_smid;
  bool cta_lines;
  double t_traced_us;
};

// Decodes and prints the records of one traced run (h: the trace buffer; cal0 / cal1: the calibrations
// before / after it).
int analyze(const std::vector<unsigned long long>& h, std::vector<Calib> cal0, std::vector<Calib> cal1,
            const TraceInfo& ti) {
  const int slots = ti.slots, every = ti.every, n_cta = ti.n_cta, m_tiles = ti.m_tiles, h_kv = ti.h_kv, d = ti.d;
  const int clock_khz = ti.clock_khz, max_smid = ti.max_smid;
  const bool cta_lines = ti.cta_lines;
  const double t_traced_us = ti.t_traced_us;
  auto at = [&](int slot, int role, int step, int ev) -> unsigned long long {
    if (step < 0 || step >= tr::kMaxSteps) return 0;
    return h[((static_cast<size_t>(slot) * tr::kRoles + role) * tr::kMaxSteps + step) * tr::kEvents + ev];
  };

  // ---- clock calibration: per SM, clock64 -> globaltimer ns
  std::vector<double> ticks, freqs;
  for (int s = 0; s <= max_smid; ++s) {
    if (cal0[s].ok) ticks.push_back(cal0[s].tick);
    if (cal0[s].ok && cal1[s].ok && cal1[s].g_raw > cal0[s].g_raw && cal1[s].c_raw > cal0[s].c_raw)
      freqs.push_back(idiff(cal1[s].c_raw, cal0[s].c_raw) / idiff(cal1[s].g_raw, cal0[s].g_raw));
  }
  const double tick = ticks.empty() ? 0 : median(ticks);
  const double f_ref = freqs.empty() ? clock_khz * 1e-6 : median(freqs);  // cycles per ns
#ifdef FLASHMLA_DENSE_TRACE_CTA_ONLY
  const char* build = "CTA events only (FLASHMLA_DENSE_TRACE_CTA_ONLY)";
#else
  const char* build = "CTA + pair events";
#endif
  std::printf("traced run (main+combine; build: %s) %.2f us; %d of %d CTAs traced (every %d-th); "
              "%%globaltimer step %.0f ns (median over SMs); SM clock %.3f GHz from calibration over %zu SMs "
              "(p10 %.3f, p90 %.3f; attribute %.3f)\n",
              build, t_traced_us, slots, n_cta, every, tick, f_ref, freqs.size(), pct(freqs, 0.1), pct(freqs, 0.9),
              clock_khz * 1e-6);

  // ---- decode the records
  std::vector<CtaRec> ctas;
  for (int s = 0; s < slots; ++s) {
    CtaRec c;
    c.slot = s;
    c.cta = s * every;
    if (!at(s, 3, 0, 0)) continue;  // never ran (should not happen)
    c.valid = true;
    c.smid = static_cast<int>(at(s, 3, 2, 0));
    c.begin_req = static_cast<int>(at(s, 3, 2, 1));
    c.end_req = static_cast<int>(at(s, 3, 2, 2));
    c.begin_blk = static_cast<int>(at(s, 3, 2, 3));
    c.end_blk = static_cast<int>(at(s, 3, 2, 4));
    c.n_req = static_cast<int>(at(s, 3, 2, 5));
    c.splitted = static_cast<int>(at(s, 3, 2, 6));
    for (int e = 0; e < 4; ++e) {
      c.has[e] = at(s, 3, 0, e) != 0;
      c.gt_raw[e] = at(s, 3, 0, e);
      c.ck_raw[e] = at(s, 3, 1, e);
    }
    for (int r = 0; r < std::min(c.n_req, kCtaRecReqMax); ++r) {
      ReqRec q;
      const int st = 3 * (1 + r);
      q.req = static_cast<int>(at(s, 3, st + 2, 0));
      q.n_blk = static_cast<int>(at(s, 3, st + 2, 1));
      q.no_split = static_cast<int>(at(s, 3, st + 2, 2));
      q.first_pair = static_cast<int>(at(s, 3, st + 2, 3));
      q.blk_lo = static_cast<int>(at(s, 3, st + 2, 4));
      q.split_slot = static_cast<int>(at(s, 3, st + 2, 5));
      q.seqlen = static_cast<int>(at(s, 3, st + 2, 6));
      for (int e = 0; e < 7; ++e) {
        q.has[e] = at(s, 3, st, e) != 0;
        q.gt_raw[e] = at(s, 3, st, e);
        q.ck_raw[e] = at(s, 3, st + 1, e);
      }
      c.reqs.push_back(q);
    }
    ctas.push_back(c);
  }
  if (ctas.empty()) {
    std::printf("no traced CTA recorded anything\n");
    return 1;
  }
  // Bases: G0 = the earliest globaltimer value seen; per CTA, clock base = its SM's pre-run calibration
  // clock when both calibrations saw the SM, else the CTA's entry clock.
  unsigned long long G0 = ~0ull;
  for (const CtaRec& c : ctas) {
    for (int e = 0; e < 4; ++e)
      if (c.has[e]) G0 = std::min(G0, c.gt_raw[e]);
    for (const ReqRec& q : c.reqs)
      for (int e = 0; e < 7; ++e)
        if (q.has[e]) G0 = std::min(G0, q.gt_raw[e]);
  }
  for (const Calib& a : cal0)
    if (a.ok) G0 = std::min(G0, a.g_raw);
  auto sm_calibrated = [&](int smid) {
    return smid >= 0 && smid <= max_smid && cal0[smid].ok && cal1[smid].ok && cal1[smid].c_raw > cal0[smid].c_raw &&
           cal1[smid].g_raw > cal0[smid].g_raw;
  };
  for (int sm = 0; sm <= max_smid; ++sm) {
    if (cal0[sm].ok) cal0[sm].g = idiff(cal0[sm].g_raw, G0), cal0[sm].c = 0;
    if (cal1[sm].ok) cal1[sm].g = idiff(cal1[sm].g_raw, G0);
    if (cal0[sm].ok && cal1[sm].ok) cal1[sm].c = idiff(cal1[sm].c_raw, cal0[sm].c_raw);
  }
  for (CtaRec& c : ctas) {
    const unsigned long long cb = sm_calibrated(c.smid) ? cal0[c.smid].c_raw : c.ck_raw[0];
    for (int e = 0; e < 4; ++e)
      if (c.has[e]) c.t[e] = idiff(c.gt_raw[e], G0), c.clk[e] = idiff(c.ck_raw[e], cb);
    for (ReqRec& q : c.reqs)
      for (int e = 0; e < 7; ++e)
        if (q.has[e]) q.t[e] = idiff(q.gt_raw[e], G0), q.clk[e] = idiff(q.ck_raw[e], cb);
  }

  // Time base. Mode A: per-SM calibration (clock64 at %globaltimer edges before / after the run), checked
  // against each event's own %globaltimer read: residual = mapped clock - globaltimer, expected in
  // [0, step) (the globaltimer value lags the true time by up to one step). Mode B (A fails): per-CTA offset
  // fitted to the CTA's own reads with f_ref.
  std::vector<double> resid;
  bool calib_all = true;
  auto map_a = [&](const CtaRec& c, double clk) {
    const Calib &a = cal0[c.smid], &z = cal1[c.smid];
    return a.g + (clk - a.c) * (z.g - a.g) / (z.c - a.c);
  };
  for (const CtaRec& c : ctas) {
    if (!sm_calibrated(c.smid)) {
      calib_all = false;
      continue;
    }
    for (int e = 0; e < 4; ++e)
      if (c.has[e]) resid.push_back(map_a(c, c.clk[e]) - c.t[e]);
    for (const ReqRec& q : c.reqs)
      for (int e = 0; e < 7; ++e)
        if (q.has[e]) resid.push_back(map_a(c, q.clk[e]) - q.t[e]);
  }
  size_t in_band = 0;
  for (double r : resid) in_band += r > -300.0 && r < tick + 300.0;
  const bool mode_a = calib_all && !resid.empty() && in_band >= resid.size() * 95 / 100;
  std::printf("time base: %s; calibrated-minus-globaltimer residuals (ns): min %.0f p50 %.0f max %.0f, %zu of %zu in "
              "[-300, step + 300]%s\n",
              mode_a ? "A (per-SM clock64 calibration)" : "B (per-CTA offset fitted to its globaltimer reads)",
              resid.empty() ? NAN : pct(resid, 0.0), median(resid), resid.empty() ? NAN : pct(resid, 1.0), in_band,
              resid.size(), calib_all ? "" : " (some SMs not calibrated)");
  std::vector<double> fit_width;
  for (CtaRec& c : ctas) {
    double off;  // ns = off + clk / f
    if (mode_a) {
      const Calib &a = cal0[c.smid], &z = cal1[c.smid];
      c.f = (z.c - a.c) / (z.g - a.g);
      off = a.g - a.c / c.f;
    } else {
      c.f = f_ref;
      double lo = -INFINITY, hi = INFINITY;  // true time in [gt, gt + step): off in [gt - clk/f, gt + step - clk/f]
      auto add = [&](double gt, double clk) {
        lo = std::max(lo, gt - clk / c.f);
        hi = std::min(hi, gt + std::max(tick, 1.0) - clk / c.f);
      };
      for (int e = 0; e < 4; ++e)
        if (c.has[e]) add(c.t[e], c.clk[e]);
      for (const ReqRec& q : c.reqs)
        for (int e = 0; e < 7; ++e)
          if (q.has[e]) add(q.t[e], q.clk[e]);
      fit_width.push_back(hi - lo);
      off = hi >= lo ? 0.5 * (lo + hi) : lo;
    }
    for (int e = 0; e < 4; ++e)
      if (c.has[e]) c.t[e] = off + c.clk[e] / c.f;
    for (ReqRec& q : c.reqs)
      for (int e = 0; e < 7; ++e)
        if (q.has[e]) q.t[e] = off + q.clk[e] / c.f;
  }
  if (!mode_a)
    std::printf("  per-CTA fit: interval width p50 %.0f ns (negative: the reads disagree with f = %.3f GHz)\n",
                median(fit_width), f_ref);

  // ---- CTA timeline summary (ns from the earliest CTA entry)
  double t0 = INFINITY, t_end = -INFINITY;
  for (const CtaRec& c : ctas) {
    t0 = std::min(t0, c.t[0]);
    if (c.has[3]) t_end = std::max(t_end, c.t[3]);
  }
  std::vector<double> v_entry, v_exit, v_busy, v_init, v_meta, v_sync, v_q, v_kv, v_topkv, v_comp, v_epi_l, v_epi_st,
      v_epi, v_gap, v_exitlat, v_sync2, v_comp_pair, v_first_kv_abs, v_q_abs;
  int n_empty = 0;
  for (const CtaRec& c : ctas) {
    v_entry.push_back(c.t[0] - t0);
    if (c.has[3]) v_exit.push_back(c.t[3] - t0), v_busy.push_back(c.t[3] - c.t[0]);
    if (c.has[1]) v_init.push_back(c.t[1] - c.t[0]);
    if (c.has[2]) v_meta.push_back(c.t[2] - c.t[0]);
    if (c.n_req == 0) ++n_empty;
    for (size_t r = 0; r < c.reqs.size(); ++r) {
      const ReqRec& q = c.reqs[r];
      if (q.has[0] && q.has[1]) (r == 0 ? v_sync : v_sync2).push_back(q.t[1] - q.t[0]);
      if (q.has[1] && q.has[2]) v_q.push_back(q.t[2] - q.t[1]);
      if (q.has[2] && q.has[3]) v_kv.push_back(q.t[3] - q.t[2]);
      if (q.has[0] && q.has[3]) v_topkv.push_back(q.t[3] - q.t[0]);
      if (r == 0 && q.has[2]) v_q_abs.push_back(q.t[2] - t0);
      if (r == 0 && q.has[3]) v_first_kv_abs.push_back(q.t[3] - t0);
      if (q.has[3] && q.has[4]) {
        v_comp.push_back(q.t[4] - q.t[3]);
        if (q.n_blk > 0) v_comp_pair.push_back((q.t[4] - q.t[3]) / ((q.n_blk + 1) / 2));
      }
      if (q.has[4] && q.has[5]) v_epi_l.push_back(q.t[5] - q.t[4]);
      if (q.has[5] && q.has[6]) v_epi_st.push_back(q.t[6] - q.t[5]);
      if (q.has[4] && q.has[6]) v_epi.push_back(q.t[6] - q.t[4]);
      if (r + 1 < c.reqs.size() && q.has[6] && c.reqs[r + 1].has[0]) v_gap.push_back(c.reqs[r + 1].t[0] - q.t[6]);
    }
    if (!c.reqs.empty() && c.reqs.back().has[6] && c.has[3] && c.n_req <= kCtaRecReqMax)
      v_exitlat.push_back(c.t[3] - c.reqs.back().t[6]);
  }
  std::printf("CTA timeline (us; %zu CTAs, %d without work; span first entry -> last exit %.2f us):\n", ctas.size(),
              n_empty, (t_end - t0) * 1e-3);
  print_dist("entry (from the earliest CTA entry)", v_entry, 1e-3, "us");
  print_dist("exit (from the earliest CTA entry)", v_exit, 1e-3, "us");
  print_dist("CTA busy (entry -> exit)", v_busy, 1e-3, "us");
  print_dist("entry -> barriers initialised", v_init, 1e-3, "us");
  print_dist("entry -> metadata read", v_meta, 1e-3, "us");
  print_dist("req top -> smem free (1st request)", v_sync, 1e-3, "us");
  print_dist("req top -> smem free (later requests)", v_sync2, 1e-3, "us");
  print_dist("smem free -> Q in smem", v_q, 1e-3, "us");
  print_dist("Q in smem -> first KV slab full", v_kv, 1e-3, "us");
  print_dist("req top -> first KV slab full", v_topkv, 1e-3, "us");
  print_dist("1st request: Q in smem (from earliest entry)", v_q_abs, 1e-3, "us");
  print_dist("1st request: first KV (from earliest entry)", v_first_kv_abs, 1e-3, "us");
  print_dist("request compute (first KV -> WG0 leaves the pair loop)", v_comp, 1e-3, "us");
  print_dist("  the same per pair of blocks", v_comp_pair, 1e-3, "us");
  print_dist("WG0 pair loop end -> L exchanged (incl. WG1's tail)", v_epi_l, 1e-3, "us");
  print_dist("L exchanged -> epilogue end (stores issued)", v_epi_st, 1e-3, "us");
  print_dist("epilogue (start -> end)", v_epi, 1e-3, "us");
  print_dist("epilogue end -> next request top", v_gap, 1e-3, "us");
  print_dist("last epilogue end -> exit", v_exitlat, 1e-3, "us");

  if (cta_lines) {
    std::printf("per CTA (us from the earliest entry; request: [req blocks split | top smem Q KV epi L end]):\n");
    for (const CtaRec& c : ctas) {
      const int m_tile = c.cta % m_tiles, part = c.cta / (m_tiles * h_kv);
      std::printf("  cta %4d (tile %d part %3d) sm %3d: entry %6.2f meta %6.2f", c.cta, m_tile, part, c.smid,
                  (c.t[0] - t0) * 1e-3, c.has[2] ? (c.t[2] - t0) * 1e-3 : NAN);
      for (const ReqRec& q : c.reqs) {
        std::printf(" [%d %d %s |", q.req, q.n_blk, q.no_split ? "whole" : "split");
        for (int e = 0; e < 7; ++e) {
          if (q.has[e]) std::printf(" %.2f", (q.t[e] - t0) * 1e-3);
          else std::printf(" -");
        }
        std::printf("]");
      }
      if (c.n_req > kCtaRecReqMax) std::printf(" (+%d requests not recorded)", c.n_req - kCtaRecReqMax);
      std::printf(" exit %6.2f\n", c.has[3] ? (c.t[3] - t0) * 1e-3 : NAN);
    }
  }

  // ---- pair loop: per role, event times relative to WG0's pair top of the same pair (cycles)
  struct PairRef {
    int slot, step, j, n_pairs;
  };
  std::vector<PairRef> pairs;
  for (const CtaRec& c : ctas)
    for (const ReqRec& q : c.reqs) {
      const int np = (q.n_blk + 1) / 2;
      for (int j = 0; j < np; ++j) {
        const int g = q.first_pair + j;
        if (g >= tr::kMaxSteps) break;
        pairs.push_back({c.slot, g, j, np});
      }
    }
  size_t n_mid = 0, n_with_events = 0;
  for (const PairRef& pr : pairs) n_mid += pr.j >= 1 && pr.j + 1 < pr.n_pairs;
  for (const PairRef& pr : pairs) n_with_events += at(pr.slot, 0, pr.step, 0) != 0;
  if (n_with_events == 0) std::printf("pair loop: no pair events recorded (%s)\n", build);
  if (n_with_events > 0) {
    const bool use_mid = n_mid >= 8;
    auto sel = [&](const PairRef& pr) { return !use_mid || (pr.j >= 1 && pr.j + 1 < pr.n_pairs); };
    std::printf("pair loop (%s: %zu pairs of %zu recorded; cycles, / %.3f GHz for ns):\n",
                use_mid ? "middle pairs of each request (not its first / last)" : "all recorded pairs",
                use_mid ? n_mid : pairs.size(), pairs.size(), f_ref);
    {
      std::vector<double> per0, per1;
      for (const PairRef& pr : pairs) {
        if (!sel(pr) || pr.j + 1 >= pr.n_pairs) continue;
        const unsigned long long a0 = at(pr.slot, 0, pr.step, 0), b0 = at(pr.slot, 0, pr.step + 1, 0);
        const unsigned long long a1 = at(pr.slot, 1, pr.step, 0), b1 = at(pr.slot, 1, pr.step + 1, 0);
        if (a0 && b0) per0.push_back(idiff(b0, a0));
        if (a1 && b1) per1.push_back(idiff(b1, a1));
      }
      print_dist("period WG0 (pair top -> next pair top)", per0, 1.0, "cyc");
      print_dist("period WG1 (pair top -> next pair top)", per1, 1.0, "cyc");
      if (!per0.empty())
        std::printf("  => %.1f ns per pair (128 keys) for WG0, %.1f GB/s of K per CTA\n", median(per0) / f_ref,
                    128.0 * d * 2 / (median(per0) / f_ref));
    }
    for (int role = 0; role < 3; ++role) {
      std::printf("  %s: event, from WG0 pair top (p10 / p50 / p90), from the role's previous event (p50)\n",
                  kRoleNames[role]);
      for (int ev = 0; ev < (role == 2 ? 6 : 12); ++ev) {
        std::vector<double> v, dprev;
        for (const PairRef& pr : pairs) {
          if (!sel(pr)) continue;
          const unsigned long long r0 = at(pr.slot, 0, pr.step, 0), x = at(pr.slot, role, pr.step, ev);
          if (!r0 || !x) continue;
          v.push_back(idiff(x, r0));
          // The role's latest earlier event that was recorded (role 2: events 4-5, the request prologue, apart).
        for (int pe = ev - 1; pe >= (role == 2 && ev >= 4 ? 4 : 0) && !(role == 2 && ev == 4); --pe) {
            const unsigned long long y = at(pr.slot, role, pr.step, pe);
            if (y) {
              dprev.push_back(idiff(x, y));
              break;
            }
          }
        }
        if (v.empty()) continue;
        std::printf("    e%-2d %-27s %8.0f %8.0f %8.0f   %8.0f\n", ev, kEvNames[role][ev], pct(v, 0.1), pct(v, 0.5),
                    pct(v, 0.9), dprev.empty() ? NAN : median(dprev));
      }
    }
    {
      // Reload -> full: slab issued in pair g-1 (role 2) to the probe's return in pair g (only when the probe
      // waited: otherwise the data was there before it and this is an upper bound of the latency).
      std::vector<double> l0, l1, w0, w1;
      for (const PairRef& pr : pairs) {
        if (!sel(pr)) continue;
        const unsigned long long p0 = at(pr.slot, 0, pr.step, 0), f0 = at(pr.slot, 0, pr.step, 1);
        const unsigned long long p1 = at(pr.slot, 1, pr.step, 0), f1 = at(pr.slot, 1, pr.step, 1);
        if (p0 && f0) w0.push_back(idiff(f0, p0));
        if (p1 && f1) w1.push_back(idiff(f1, p1));
        if (pr.j == 0) continue;
        const unsigned long long i0 = at(pr.slot, 2, pr.step - 1, 0), i1 = at(pr.slot, 2, pr.step - 1, 2);
        if (i0 && f0) l0.push_back(idiff(f0, i0));
        if (i1 && f1) l1.push_back(idiff(f1, i1));
      }
      print_dist("WG0 wait for stage0 slab0 at pair top", w0, 1.0, "cyc");
      print_dist("WG1 wait for stage1 slab4 at pair top", w1, 1.0, "cyc");
      print_dist("stage0 slab0: reload issued -> seen full", l0, 1.0, "cyc");
      print_dist("stage1 slab4: reload issued -> seen full", l1, 1.0, "cyc");
    }
  }  // n_with_events > 0

  // ---- one CTA's timeline (the one that exits last: the tail), ns from its entry
  {
    const CtaRec* tail = &ctas[0];
    for (const CtaRec& c : ctas)
      if (c.has[3] && (!tail->has[3] || c.t[3] > tail->t[3])) tail = &c;
    const unsigned long long c_entry = at(tail->slot, 3, 1, 0);
    std::printf("timeline of the last CTA to exit (cta %d, sm %d; ns from its entry, clock64 / %.3f GHz):\n",
                tail->cta, tail->smid, tail->f);
    const double k0 = tail->clk[0];  // the entry, relative to the CTA's clock base
    std::printf("  CTA: barriers %.0f, metadata %.0f, exit %.0f\n", (tail->clk[1] - k0) / tail->f,
                (tail->clk[2] - k0) / tail->f, (tail->clk[3] - k0) / tail->f);
    for (const ReqRec& q : tail->reqs) {
      std::printf("  request %d (%d blocks from %d, %s, first pair %d):", q.req, q.n_blk, q.blk_lo,
                  q.no_split ? "whole" : "split", q.first_pair);
      for (int e = 0; e < 7; ++e) {
        if (q.has[e]) std::printf(" %.0f", (q.clk[e] - k0) / tail->f);
        else std::printf(" -");
      }
      std::printf("  (top smem Q KV epi L end)\n");
    }
    for (int g = 0; g < tr::kMaxSteps && g < 8; ++g) {
      if (!at(tail->slot, 0, g, 0)) break;
      for (int role = 0; role < 3; ++role) {
        std::printf("  pair %2d %-13s", g, kRoleNames[role]);
        for (int ev = 0; ev < (role == 2 ? 6 : 12); ++ev) {
          const unsigned long long v = at(tail->slot, role, g, ev);
          if (v) std::printf(" %7.0f", idiff(v, c_entry) / tail->f);
          else std::printf("       -");
        }
        std::printf("\n");
      }
    }
  }
  return 0;
}

// DTRACE_SELFTEST=1|2|3 (no GPU): the analysis on synthetic records in the kernel's layout (132 CTAs on
// shuffled SMs, 2 requests of 2 pairs each, SM clocks at 1.98 GHz with per-SM offsets); 1: %globaltimer
// steps of 1000 ns, 2: steps of 32 ns, 3: as 1 without the post-run calibration (time base B). Expected:
// entry spread 0-1.31 us, entry -> metadata 1.50 us, smem free -> Q 0.80 us, Q -> first KV 0.70 us, compute
// 2.50 us, epilogue 0.50 us, last epilogue end -> exit 0.20 us, WG0 period 3960 cycles.
int selftest(int mode) {
  const int n_sm = 132, slots = 132, max_smid = 4 * n_sm + 64;
  const double f = 1.98, tick = mode == 2 ? 32.0 : 1000.0;
  const unsigned long long G = 1700000000000000000ull;
  auto gt = [&](double t) { return G + static_cast<unsigned long long>(std::floor(t / tick) * tick); };
  auto sm_of = [&](int s) { return (s * 7) % n_sm; };
  auto ck = [&](int sm, double t) {
    return 1000000000000ull + 123456789ull * sm + static_cast<unsigned long long>(t * f);
  };
  std::vector<unsigned long long> h(static_cast<size_t>(slots) * tr::kRoles * tr::kMaxSteps * tr::kEvents, 0);
  auto put = [&](int slot, int role, int step, int ev, unsigned long long v) {
    h[((static_cast<size_t>(slot) * tr::kRoles + role) * tr::kMaxSteps + step) * tr::kEvents + ev] = v;
  };
  auto cta_ev = [&](int slot, int rec, int ev, double t) {
    put(slot, 3, 3 * rec, ev, gt(t));
    put(slot, 3, 3 * rec + 1, ev, ck(sm_of(slot), t));
  };
  for (int s = 0; s < slots; ++s) {
    const int sm = sm_of(s);
    double t = 5000.0 + 10.0 * s;  // entry
    cta_ev(s, 0, 0, t);
    cta_ev(s, 0, 1, t + 300);
    cta_ev(s, 0, 2, t + 1500);
    put(s, 3, 2, 0, sm);
    double top = t + 1600;
    int pair = 0;
    for (int r = 0; r < 2; ++r) {
      const double tq = top + 50 + 800, tkv = tq + 700, te = tkv + 2500;
      cta_ev(s, 1 + r, 0, top);
      cta_ev(s, 1 + r, 1, top + 50);
      cta_ev(s, 1 + r, 2, tq);
      cta_ev(s, 1 + r, 3, tkv);
      cta_ev(s, 1 + r, 4, te);
      cta_ev(s, 1 + r, 5, te + 100);
      cta_ev(s, 1 + r, 6, te + 500);
      const int st = 3 * (1 + r) + 2;
      put(s, 3, st, 0, s + r);
      put(s, 3, st, 1, 4);
      put(s, 3, st, 2, r);
      put(s, 3, st, 3, pair);
      put(s, 3, st, 6, 256);
      for (int j = 0; j < 2; ++j, ++pair) {
        const double p0 = tkv + 2000.0 * j;
        for (int ev = 0; ev < 12; ++ev) {
          put(s, 0, pair, ev, ck(sm, p0 + 150.0 * ev));
          put(s, 1, pair, ev, ck(sm, p0 + 50 + 150.0 * ev));
        }
        for (int ev = 0; ev < 4; ++ev) put(s, 2, pair, ev, ck(sm, p0 + 1000 + 100.0 * ev));
        if (j == 0) put(s, 2, pair, 4, ck(sm, tq - 500)), put(s, 2, pair, 5, ck(sm, tq - 400));
      }
      top = te + 500 + 100;
    }
    cta_ev(s, 0, 3, top - 100 + 200);
    put(s, 3, 2, 1, s);
    put(s, 3, 2, 2, s + 1);
    put(s, 3, 2, 5, 2);
  }
  std::vector<Calib> cal0(max_smid + 1), cal1(max_smid + 1);
  for (int sm = 0; sm < n_sm; ++sm) {
    const double e0 = 2.0 * tick, e1 = std::ceil(40000.0 / tick) * tick;  // edges before / after the run
    cal0[sm] = Calib{true, gt(e0), ck(sm, e0), 0, 0, tick};
    if (mode != 3) cal1[sm] = Calib{true, gt(e1), ck(sm, e1), 0, 0, tick};
  }
  std::printf("self-test %d: synthetic records, globaltimer step %.0f ns%s\n", mode, tick,
              mode == 3 ? ", no post-run calibration" : "");
  const TraceInfo ti{slots, 1, slots, 1, 1, 576, 1980000, max_smid, true, 30.0};
  return analyze(h, cal0, cal1, ti);
}

int main(int argc, char** argv) {
  if (std::getenv("DTRACE_SELFTEST")) return selftest(std::atoi(std::getenv("DTRACE_SELFTEST")));
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s b s_q h_q s_k [pbs=64] [staged=auto|0|1] [every=1]\n", argv[0]);
    return 2;
  }
  const int b = std::atoi(argv[1]), s_q = std::atoi(argv[2]), h_q = std::atoi(argv[3]), s_k = std::atoi(argv[4]);
  const int pbs = argc > 5 ? std::atoi(argv[5]) : 64;
  const std::string staged_arg = argc > 6 ? argv[6] : "auto";
  const int every = argc > 7 ? std::max(1, std::atoi(argv[7])) : 1;
  const int reps = std::getenv("DTRACE_REPS") ? std::max(2, std::atoi(std::getenv("DTRACE_REPS"))) : 20;
  const bool cta_lines = !(std::getenv("DTRACE_CTA_LINES") && std::atoi(std::getenv("DTRACE_CTA_LINES")) == 0);
  const int d = 576, h_kv = 1;
  if (b < 1 || s_q < 1 || h_q < 1 || s_k < 1 || pbs < 1 ||
      (staged_arg != "auto" && staged_arg != "0" && staged_arg != "1")) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  int n_sm = 0, clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const int64_t parts = core::dense_decode_num_sm_parts(n_sm, s_q, h_q, h_kv);
  const int64_t max_pad = (s_k + 255) / 256 * 256;
  const int64_t bt_cols = (max_pad + pbs - 1) / pbs;
  const int64_t n_pages = b * bt_cols;

  // ---- inputs
  __nv_bfloat16 *q, *k, *out;
  int32_t *bt, *seqlens, *meta, *nsplit;
  float* lse;
  CHECK(cudaMalloc(&q, sizeof(__nv_bfloat16) * b * s_q * h_q * d));
  CHECK(cudaMalloc(&k, sizeof(__nv_bfloat16) * n_pages * pbs * h_kv * d));
  CHECK(cudaMalloc(&out, sizeof(__nv_bfloat16) * b * s_q * h_q * 512));
  CHECK(cudaMalloc(&lse, sizeof(float) * b * h_q * s_q));
  CHECK(cudaMalloc(&bt, sizeof(int32_t) * n_pages));
  CHECK(cudaMalloc(&seqlens, sizeof(int32_t) * b));
  CHECK(cudaMalloc(&meta, sizeof(int32_t) * parts * 8));
  CHECK(cudaMalloc(&nsplit, sizeof(int32_t) * (b + 1)));
  fill_randn_bf16<<<1024, 256>>>(q, static_cast<int64_t>(b) * s_q * h_q * d, 1);
  fill_randn_bf16<<<4096, 256>>>(k, n_pages * pbs * h_kv * d, 2);
  CHECK(cudaGetLastError());
  {
    std::vector<int32_t> perm(n_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 rng(12345);
    std::shuffle(perm.begin(), perm.end(), rng);
    CHECK(cudaMemcpy(bt, perm.data(), sizeof(int32_t) * n_pages, cudaMemcpyHostToDevice));
    std::vector<int32_t> lens(b, s_k);
    CHECK(cudaMemcpy(seqlens, lens.data(), sizeof(int32_t) * b, cudaMemcpyHostToDevice));
  }
  CHECK(cudaMemset(out, 0xff, sizeof(__nv_bfloat16) * b * s_q * h_q * 512));  // NaN until written

  DenseDecodeParams p;
  p.q = tref(q, DType::kBFloat16, {b, s_q, h_q, d});
  p.k_cache = tref(k, DType::kBFloat16, {n_pages, pbs, h_kv, d});
  p.block_table = tref(bt, DType::kInt32, {b, bt_cols});
  p.cache_seqlens = tref(seqlens, DType::kInt32, {b});
  p.head_dim_v = 512;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.causal = false;
  p.tile_scheduler_metadata = tref(meta, DType::kInt32, {parts, 8});
  p.num_splits = tref(nsplit, DType::kInt32, {b + 1});
  p.metadata_ready = false;
  p.out = tref(out, DType::kBFloat16, {b, s_q, h_q, 512});
  p.lse = tref(lse, DType::kFloat32, {b, h_q, s_q});
  const int64_t ws_bytes = sm90::dense_decode_workspace_bytes(p, parts);
  void* ws;
  CHECK(cudaMalloc(&ws, ws_bytes));
  p.workspace = ws;
  p.workspace_bytes = ws_bytes;
  p.stream = nullptr;
  void* flush;
  const size_t flush_bytes = size_t(256) << 20;
  CHECK(cudaMalloc(&flush, flush_bytes));

  sm90::DenseDecodeOptions options;
  options.kernel = sm90::DenseKernel::kSeesaw;
  options.tuning = staged_arg == "1" ? sm90::kTuneStagedEpilogue : staged_arg == "0" ? sm90::kTuneDirectEpilogue : 0;
  auto call = [&](int stages) {
    const Status st = sm90::dense_decode_launch(p, parts, stages, options);
    if (!st.ok()) {
      std::fprintf(stderr, "dense_decode_launch: %s\n", st.message.c_str());
      if (sm90::dtrace::launches > 0 && !sm90::dtrace::last_tma)
        std::fprintf(stderr, "(no K tensor map: the seesaw kernel cannot run)\n");
      std::exit(1);
    }
  };

  // ---- schedule (device) vs the host scheduler
  call(sm90::kStageScheduler);
  CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> h_meta(parts * 8), h_ns(b + 1);
  CHECK(cudaMemcpy(h_meta.data(), meta, sizeof(int32_t) * parts * 8, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(h_ns.data(), nsplit, sizeof(int32_t) * (b + 1), cudaMemcpyDeviceToHost));
  {
    std::vector<TileSchedulerMetadataRow> rows(parts);
    std::vector<int32_t> ns(b + 1);
    core::compute_tile_schedule(std::vector<int64_t>(b, s_k), parts, core::kDenseDecodeSchedOverheadBlocks, rows.data(),
                                ns.data());
    const bool same = std::memcmp(rows.data(), h_meta.data(), sizeof(int32_t) * parts * 8) == 0 && ns == h_ns;
    int split_reqs = 0, rq_min = 1 << 30, rq_max = 0, bl_min = 1 << 30, bl_max = 0;
    for (int i = 0; i < b; ++i) split_reqs += h_ns[i + 1] - h_ns[i] > 1;
    for (int64_t pt = 0; pt < parts; ++pt) {
      const int32_t* r = &h_meta[pt * 8];
      if (r[0] >= b) continue;
      const int nr = r[1] - r[0] + 1;
      // blocks of the part: whole requests in between plus the partial ends
      int64_t nbk = 0;
      const int nb_req = (s_k + 63) / 64;
      for (int rq = r[0]; rq <= r[1]; ++rq) {
        const int lo = rq == r[0] ? r[2] : 0, hi = rq == r[1] ? std::min(r[3], nb_req) : nb_req;
        nbk += std::max(hi - lo, 0);
      }
      rq_min = std::min(rq_min, nr);
      rq_max = std::max(rq_max, nr);
      bl_min = std::min<int>(bl_min, static_cast<int>(nbk));
      bl_max = std::max<int>(bl_max, static_cast<int>(nbk));
    }
    std::printf("schedule: num_sm_parts %lld, device == host scheduler: %s, splits %d (requests split: %d of %d), "
                "requests per part %d-%d, 64-token blocks per part %d-%d\n",
                static_cast<long long>(parts), same ? "yes" : "NO", h_ns[b], split_reqs, b, rq_min, rq_max, bl_min,
                bl_max);
  }

  // ---- one run, kernel choice, output sanity
  call(sm90::kStageMain | sm90::kStageCombine);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  const sm90::DenseDecodeKernelParams kp = sm90::dtrace::last_kp;
  const int m_tiles = (kp.m_rows + sm90::dense_seesaw::kBlockM - 1) / sm90::dense_seesaw::kBlockM;
  const int n_cta = m_tiles * kp.h_kv * sm90::dtrace::last_parts;
  auto check_out = [&](const char* when) {
    std::vector<uint16_t> ho(static_cast<size_t>(b) * s_q * h_q * 512);
    std::vector<float> hl(static_cast<size_t>(b) * h_q * s_q);
    CHECK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hl.data(), lse, hl.size() * 4, cudaMemcpyDeviceToHost));
    size_t bad = 0, bad_l = 0;
    double sum = 0;
    for (uint16_t v : ho) {
      const float f = bf16_to_float(v);
      if (!std::isfinite(f)) ++bad;
      else sum += std::fabs(f);
    }
    for (float v : hl) bad_l += !std::isfinite(v);
    std::printf("output (%s): %zu of %zu out values not finite, mean |out| %.4g; %zu of %zu lse not finite%s\n", when,
                bad, ho.size(), ho.size() > bad ? sum / (ho.size() - bad) : 0.0, bad_l, hl.size(),
                bad == ho.size() ? "  <-- ALL NaN" : "");
  };
  std::printf("case b %d s_q %d h_q %d s_k %d pbs %d bf16 d_qk %d h_kv %d: seesaw kernel, %s epilogue (staged=%s), "
              "grid (%d, %d, %d) = %d CTAs on %d SMs, m_rows %d, tma box %d tokens, out_bulk_ok %d\n",
              b, s_q, h_q, s_k, pbs, d, h_kv, kp.staged_epilogue ? "STAGED" : "DIRECT", staged_arg.c_str(), m_tiles,
              kp.h_kv, sm90::dtrace::last_parts, n_cta, n_sm, kp.m_rows, kp.tma_box_tok, kp.out_bulk_ok);
  check_out("first run");

  // ---- timing (trace buffer unset: the trace branches are taken as "off")
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  auto time_us = [&](int stages) {
    std::vector<double> ts;
    for (int r = 0; r <= reps; ++r) {
      CHECK(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
      CHECK(cudaEventRecord(e0));
      call(stages);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float t;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (r > 0) ts.push_back(t * 1e3);
    }
    return median(ts);
  };
  const double t_main = time_us(sm90::kStageMain);
  const double t_mc = time_us(sm90::kStageMain | sm90::kStageCombine);
  const double t_all = time_us(sm90::kStageAll);
  const double t_comb = time_us(sm90::kStageCombine);
  const double t_sched = time_us(sm90::kStageScheduler);
  const double kv_bytes = static_cast<double>(b) * s_k * d * 2;
  std::printf("time (trace build, tracing off, L2 flushed, median of %d; us): main %.2f, main+combine %.2f, "
              "sched+main+combine %.2f, combine alone %.2f, scheduler alone %.2f; KV %.1f MB = %.0f GB/s over main\n",
              reps, t_main, t_mc, t_all, t_comb, t_sched, kv_bytes * 1e-6, kv_bytes / t_main * 1e-3);
  CHECK(cudaDeviceSynchronize());

  // ---- traced run (main + combine, the schedule reused)
  const int slots = (n_cta + every - 1) / every;
  const size_t per_slot = static_cast<size_t>(tr::kRoles) * tr::kMaxSteps * tr::kEvents;
  const size_t n_rec = static_cast<size_t>(slots) * per_slot;
  unsigned long long *buf, *calib_buf0, *calib_buf1;
  CHECK(cudaMalloc(&buf, n_rec * 8));
  CHECK(cudaMalloc(&calib_buf0, static_cast<size_t>(5) * n_sm * 8));
  CHECK(cudaMalloc(&calib_buf1, static_cast<size_t>(5) * n_sm * 8));
  CHECK(cudaFuncSetAttribute(calib_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kCalibSmem));
  CHECK(cudaMemcpyToSymbol(g_trace, &buf, sizeof(buf)));
  CHECK(cudaMemcpyToSymbol(g_trace_every, &every, sizeof(int)));
  CHECK(cudaMemcpyToSymbol(g_trace_slots, &slots, sizeof(int)));
  const int max_smid = 4 * n_sm + 64;  // %smid is < the SM count on current GPUs; headroom for gaps
  float t_traced = 0;
  std::vector<Calib> cal0, cal1;
  // Back to back on the stream (no idle gap for the clocks): flush, calibration, main + combine, calibration.
  for (int warm = 0; warm < 2; ++warm) {  // the first traced run warms the trace path; the second is kept
    CHECK(cudaMemset(buf, 0, n_rec * 8));
    CHECK(cudaMemset(out, 0xff, sizeof(__nv_bfloat16) * b * s_q * h_q * 512));  // NaN: the traced run must write all
    CHECK(cudaMemset(lse, 0xff, sizeof(float) * b * h_q * s_q));
    CHECK(cudaMemset(calib_buf0, 0, static_cast<size_t>(5) * n_sm * 8));
    CHECK(cudaMemset(calib_buf1, 0, static_cast<size_t>(5) * n_sm * 8));
    CHECK(cudaMemsetAsync(flush, 7 + warm, flush_bytes));
    launch_calib(n_sm, calib_buf0);
    CHECK(cudaEventRecord(e0));
    call(sm90::kStageMain | sm90::kStageCombine);
    CHECK(cudaEventRecord(e1));
    launch_calib(n_sm, calib_buf1);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaEventElapsedTime(&t_traced, e0, e1));
  }
  cal0 = read_calib(n_sm, calib_buf0, max_smid);
  cal1 = read_calib(n_sm, calib_buf1, max_smid);
  const unsigned long long* null_buf = nullptr;
  CHECK(cudaMemcpyToSymbol(g_trace, &null_buf, sizeof(null_buf)));
  std::vector<unsigned long long> h(n_rec);
  CHECK(cudaMemcpy(h.data(), buf, n_rec * 8, cudaMemcpyDeviceToHost));
  check_out("traced run");
  const TraceInfo ti{slots, every, n_cta, m_tiles, kp.h_kv, d, clock_khz, max_smid, cta_lines, t_traced * 1e3};
  const int rc = analyze(h, cal0, cal1, ti);
  CHECK(cudaDeviceSynchronize());
  std::printf("done\n");
  return rc;
}
