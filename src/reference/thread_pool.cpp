// src/reference/thread_pool.cpp — see thread_pool.h.
#include "reference/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "flashmla/ops.h"

namespace flashmla {

int reference_num_threads() {
  if (const char* env = std::getenv("FLASHMLA_NUM_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v >= 1) return static_cast<int>(std::min<long>(v, 1024));
  }
  // Once per process: glibc answers hardware_concurrency by reading sysfs (~5 µs, a file open per
  // call), and every CPU call plans with this number.
  static const int hw = [] {
    const unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : static_cast<int>(n);
  }();
  return hw;
}

namespace reference {

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
