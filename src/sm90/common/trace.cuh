// src/sm90/common/trace.cuh — optional event timeline of a kernel's roles, for diagnostics only.
//
// Off by default: FLASHMLA_TRACE_EVENT(...) expands to nothing and the kernels' machine code is
// unchanged. A diagnostic program (tools/trace/) defines FLASHMLA_TRACE before including a kernel,
// sets the device symbols below with cudaMemcpyToSymbol, runs the kernel, and reads the buffer back.
// Record layout: g_trace[((slot * kRoles + role) * kMaxSteps + step) * kEvents + event] = clock64()
// of the SM the CTA runs on (cycles), written by one thread of each role for the CTAs with
// blockIdx.x % g_trace_every == 0 (slot = blockIdx.x / g_trace_every < g_trace_slots); steps past
// kMaxSteps are dropped. A kernel says FLASHMLA_TRACE_DECL(); once at its start (the CTA's record
// pointer, loaded once) before any FLASHMLA_TRACE_EVENT.
// Additions for kernels with a 3-D grid and cross-SM questions (the dense decode seesaw kernel, tools/trace/dense_trace.cu):
//   FLASHMLA_TRACE_DECL_CTA(cta)   as FLASHMLA_TRACE_DECL with a given linear CTA index instead of blockIdx.x;
//   FLASHMLA_TRACE_EVENT_NS(...)   as FLASHMLA_TRACE_EVENT, the value %globaltimer (ns, one clock for all SMs;
//                                  its update interval depends on the GPU / driver: the tool measures it);
//   FLASHMLA_TRACE_VALUE(..., v)   stores the value v (a request index, a count, %smid: flashmla_trace_smid());
//   FLASHMLA_TRACE_ACTIVE()        true in a traced CTA (for trace-only code in FLASHMLA_TRACE_ONLY);
//   FLASHMLA_TRACE_ONLY(...)       its arguments with FLASHMLA_TRACE, nothing without (trace-only counters).
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

__device__ __forceinline__ unsigned long long flashmla_trace_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned int flashmla_trace_smid() {
  unsigned int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
// Once at kernel start, with this CTA's linear index `cta` (0 .. CTAs - 1) in place of blockIdx.x.
#define FLASHMLA_TRACE_DECL_CTA(cta)                                                                   \
  unsigned long long* const flashmla_trace_cta_ =                                                      \
      (g_trace != nullptr && static_cast<long long>(cta) % g_trace_every == 0 &&                       \
       static_cast<long long>(cta) / g_trace_every < g_trace_slots)                                    \
          ? g_trace + (static_cast<long long>(cta) / g_trace_every) * ::flashmla::sm90::trace::kRoles *  \
                          ::flashmla::sm90::trace::kMaxSteps * ::flashmla::sm90::trace::kEvents        \
          : nullptr
// Record `value` (evaluated only in the writing thread of a traced CTA) at (role, step, event).
#define FLASHMLA_TRACE_VALUE(role, step, event, first_thread, value)                                  \
  do {                                                                                               \
    if (flashmla_trace_cta_ != nullptr && (first_thread) && (step) < ::flashmla::sm90::trace::kMaxSteps) \
      flashmla_trace_cta_[((role) * ::flashmla::sm90::trace::kMaxSteps + (step)) * ::flashmla::sm90::trace::kEvents + \
                          (event)] = static_cast<unsigned long long>(value);                         \
  } while (0)
#define FLASHMLA_TRACE_EVENT_NS(role, step, event, first_thread) \
  FLASHMLA_TRACE_VALUE(role, step, event, first_thread, flashmla_trace_globaltimer())
#define FLASHMLA_TRACE_ACTIVE() (flashmla_trace_cta_ != nullptr)
#define FLASHMLA_TRACE_ONLY(...) __VA_ARGS__
#else
#define FLASHMLA_TRACE_DECL() static_assert(true, "")
#define FLASHMLA_TRACE_DECL_CTA(cta) static_assert(true, "")
#define FLASHMLA_TRACE_VALUE(role, step, event, first_thread, value) \
  do {                                                              \
  } while (0)
#define FLASHMLA_TRACE_EVENT_NS(role, step, event, first_thread) \
  do {                                                           \
  } while (0)
#define FLASHMLA_TRACE_ACTIVE() false
#define FLASHMLA_TRACE_ONLY(...)
#define FLASHMLA_TRACE_EVENT(role, step, event, first_thread) \
  do {                                                        \
  } while (0)
#endif
