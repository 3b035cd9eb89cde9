// Host implementation of the split-KV tile scheduler (spec §4.2-§4.3).
#include "core/scheduler.h"

#include <algorithm>

namespace flashmla::core {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

int64_t dense_decode_num_sm_parts(int num_sms, int64_t s_q, int64_t h_q, int64_t h_kv) {
  const int64_t rows = s_q * (h_q / h_kv);
  return std::max<int64_t>(num_sms / h_kv / ceil_div(rows, 64), 1);
}

int64_t sparse_decode_num_sm_parts(int num_sms, int64_t s_q, int64_t h_q) {
  return std::max<int64_t>(num_sms / s_q / std::max<int64_t>(h_q / 64, 1), 1);
}

void compute_tile_schedule(const std::vector<int64_t>& seqlens, int64_t num_sm_parts, int64_t overhead,
                           TileSchedulerMetadataRow* metadata, int32_t* num_splits) {
  const int64_t b = static_cast<int64_t>(seqlens.size());
  std::vector<int64_t> num_blocks(b);
  int64_t total = 0;
  for (int64_t i = 0; i < b; ++i) {
    num_blocks[i] = sched_num_blocks(seqlens[i]);
    total += num_blocks[i] + overhead;
  }
  greedy_tile_schedule(
      b, num_sm_parts, total, overhead, [&](int64_t i) { return num_blocks[i]; },
      [&](int64_t i) { return seqlens[i] == 0; },
      [&](int64_t part, const TileSchedulerMetadataRow& row) { metadata[part] = row; },
      [&](int64_t i, int32_t v) { num_splits[i] = v; });
}

}  // namespace flashmla::core
