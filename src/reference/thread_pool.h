// src/reference/thread_pool.h — minimal parallel loop for the CPU reference backend.
//
// `parallel_for(n, fn)` calls `fn(i)` exactly once for every i in [0, n), spread
// over `reference_num_threads()` std::threads (set_reference_num_threads, else env
// FLASHMLA_NUM_THREADS read once per process, else the hardware's thread count). Work is
// handed out in contiguous chunks from an atomic counter, so uneven rows (causal
// masks, varying sequence lengths) balance automatically. Each `fn(i)` must be
// independent of the others; results are therefore bit-identical for any thread count.
//
// Exceptions thrown by `fn` (e.g. std::bad_alloc) are caught in the worker, the
// remaining work is abandoned, and the first exception is rethrown on the calling
// thread after all workers have joined, so it never reaches std::terminate.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace flashmla::reference {

/// Upper bound of the reference backend's thread count (larger requests are clamped).
constexpr int kMaxThreads = 1024;

/// The thread count a FLASHMLA_NUM_THREADS value asks for: a positive decimal integer (clamped to
/// kMaxThreads); null (unset) gives `fallback` silently; anything else ("0", "-3", "abc", "", "4x")
/// gives `fallback` and, when `warning` is not null, a message naming the value.
int threads_from_env(const char* value, int fallback, std::string* warning);

/// Run fn(0) ... fn(n-1) on up to `num_threads` threads (<= 0: reference_num_threads()).
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, int num_threads = 0);

}  // namespace flashmla::reference
