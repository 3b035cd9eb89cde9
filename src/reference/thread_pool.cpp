// src/reference/thread_pool.cpp — see thread_pool.h.
#include "reference/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "flashmla/ops.h"

namespace flashmla {

namespace {

int hardware_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

// The default thread count: FLASHMLA_NUM_THREADS as the process saw it at the first CPU call (read
// once: glibc answers hardware_concurrency by reading sysfs, and the environment is not the library's
// to re-read per call). A value that is not a positive integer is reported once on stderr.
int default_threads() {
  static const int n = [] {
    std::string warning;
    const int v = reference::threads_from_env(std::getenv("FLASHMLA_NUM_THREADS"), hardware_threads(), &warning);
    if (!warning.empty()) std::fprintf(stderr, "%s\n", warning.c_str());
    return v;
  }();
  return n;
}

std::atomic<int> g_threads_override{0};  // set_reference_num_threads; 0: the default

}  // namespace

int reference_num_threads() {
  const int n = g_threads_override.load(std::memory_order_relaxed);
  return n > 0 ? n : default_threads();
}

void set_reference_num_threads(int n) {
  g_threads_override.store(n > 0 ? std::min(n, reference::kMaxThreads) : 0, std::memory_order_relaxed);
}

namespace reference {

int threads_from_env(const char* value, int fallback, std::string* warning) {
  if (value == nullptr) return fallback;
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value, &end, 10);
  if (end != value && *end == '\0' && errno == 0 && v >= 1) return static_cast<int>(std::min<long>(v, kMaxThreads));
  if (warning != nullptr)
    *warning = std::string("flash_mla: FLASHMLA_NUM_THREADS='") + value +
               "' is not a positive integer; the CPU reference backend uses " + std::to_string(fallback) +
               " threads (the hardware's) instead";
  return fallback;
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, int num_threads) {
  if (n <= 0) return;
  if (num_threads <= 0) num_threads = reference_num_threads();
  const int64_t workers = std::min<int64_t>(num_threads, n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }

  // ~8 chunks per worker: cheap to hand out, fine enough to balance uneven rows.
  const int64_t chunk = std::max<int64_t>(1, n / (workers * 8));
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;

  auto work = [&]() {
    try {
      while (!failed.load(std::memory_order_relaxed)) {
        const int64_t begin = next.fetch_add(chunk, std::memory_order_relaxed);
        if (begin >= n) break;
        const int64_t end = std::min(n, begin + chunk);
        for (int64_t i = begin; i < end; ++i) fn(i);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!first_error) first_error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  try {
    for (int64_t t = 1; t < workers; ++t) threads.emplace_back(work);
  } catch (...) {
    // Could not start (all) threads: the calling thread and those already
    // started still drain the whole counter, so the result is unchanged.
  }
  work();  // the calling thread participates
  for (auto& th : threads) th.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace reference
}  // namespace flashmla
