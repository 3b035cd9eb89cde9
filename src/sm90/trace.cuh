// src/sm90/trace.cuh — optional event timeline of a kernel's roles, for diagnostics only.
//
// Off by default: FLASHMLA_TRACE_EVENT(...) expands to nothing and the kernels' machine code is
// unchanged. A diagnostic program (tools/trace/) defines FLASHMLA_TRACE before including a kernel,
// sets the device symbols below with cudaMemcpyToSymbol, runs the kernel, and reads the buffer back.
// Record layout: g_trace[((slot * kRoles + role) * kMaxSteps + step) * kEvents + event] = clock64()
// of the SM the CTA runs on (cycles), written by one thread of each role for the CTAs with
// blockIdx.x % g_trace_every == 0 (slot = blockIdx.x / g_trace_every < g_trace_slots); steps past
// kMaxSteps are dropped. A kernel says FLASHMLA_TRACE_DECL(); once at its start (the CTA's record
// pointer, loaded once) before any FLASHMLA_TRACE_EVENT.
#pragma once

#include <cstdint>

namespace flashmla::sm90::trace {

constexpr int kRoles = 4;     // e.g. consumer warpgroup 0, consumer warpgroup 1, producer, CTA
constexpr int kMaxSteps = 40; // pipeline steps (pairs of key blocks) per CTA
constexpr int kEvents = 12;   // events per role and step

}  // namespace flashmla::sm90::trace

#ifdef FLASHMLA_TRACE
__device__ unsigned long long* g_trace = nullptr;
__device__ int g_trace_every = 1;
__device__ int g_trace_slots = 0;

// Once at kernel start: this CTA's records (nullptr when the CTA is not traced).
#define FLASHMLA_TRACE_DECL()                                                                          \
  unsigned long long* const flashmla_trace_cta_ =                                                      \
      (g_trace != nullptr && blockIdx.x % g_trace_every == 0 &&                                        \
       static_cast<int>(blockIdx.x / g_trace_every) < g_trace_slots)                                   \
          ? g_trace + static_cast<long long>(blockIdx.x / g_trace_every) * ::flashmla::sm90::trace::kRoles * \
                          ::flashmla::sm90::trace::kMaxSteps * ::flashmla::sm90::trace::kEvents        \
          : nullptr
#define FLASHMLA_TRACE_EVENT(role, step, event, first_thread)                                         \
  do {                                                                                               \
    if (flashmla_trace_cta_ != nullptr && (first_thread) && (step) < ::flashmla::sm90::trace::kMaxSteps) \
      flashmla_trace_cta_[((role) * ::flashmla::sm90::trace::kMaxSteps + (step)) * ::flashmla::sm90::trace::kEvents + \
                          (event)] = static_cast<unsigned long long>(clock64());                     \
  } while (0)
#else
#define FLASHMLA_TRACE_DECL() static_assert(true, "")
#define FLASHMLA_TRACE_EVENT(role, step, event, first_thread) \
  do {                                                        \
  } while (0)
#endif
