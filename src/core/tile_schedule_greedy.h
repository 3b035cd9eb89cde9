// src/core/tile_schedule_greedy.h — the greedy split-KV partition of spec §4.3, written once for
// the host (core::compute_tile_schedule, the CPU backend and the tests' oracle) and the device
// (src/sm90/scheduler.cu, which runs it in one thread out of shared memory).
#pragma once

#include <cstdint>

#include "flashmla/ops.h"

#if defined(__CUDACC__)
#define FLASHMLA_HOST_DEVICE __host__ __device__
#else
#define FLASHMLA_HOST_DEVICE
#endif

namespace flashmla::core {

constexpr int kSchedBlockSizeN = 64;          ///< tokens per scheduling block
constexpr int kSchedFixedOverheadBlocks = 5;  ///< per-request overhead, in blocks

/// Scheduling blocks of a request of `s` tokens: ceil(max(s - 1, 0) / 64) + 1 (an empty request
/// still costs one block; spec §4.2).
FLASHMLA_HOST_DEVICE inline int64_t sched_num_blocks(int64_t s) {
  return (s > 1 ? s - 1 : 0) / kSchedBlockSizeN + 1;
}

/// Greedy partition of b requests into num_sm_parts rows (spec §4.3). `num_blocks(i)` gives
/// request i's block count (sched_num_blocks of its length), `empty(i)` whether its length is 0;
/// `total` = sum_i (num_blocks(i) + overhead). Each part's row goes to `write_row(part, row)`,
/// num_splits[i] (b + 1 entries, exclusive prefix sum of pieces per request) to
/// `write_split(i, value)`; every entry is written exactly once.
template <class NumBlocks, class Empty, class WriteRow, class WriteSplit>
FLASHMLA_HOST_DEVICE void greedy_tile_schedule(int64_t b, int64_t num_sm_parts, int64_t total,
                                               const NumBlocks& num_blocks, const Empty& empty,
                                               const WriteRow& write_row, const WriteSplit& write_split) {
  const int64_t overhead = kSchedFixedOverheadBlocks;
  const int64_t payload = (total + num_sm_parts - 1) / num_sm_parts + overhead;
  int64_t req = 0, block = 0, split = 0, cum = 0;
  write_split(0, 0);
  for (int64_t part = 0; part < num_sm_parts; ++part) {
    TileSchedulerMetadataRow row{};
    row.begin_req_idx = static_cast<int32_t>(req);
    row.begin_block_idx = static_cast<int32_t>(block);
    row.begin_split_idx = static_cast<int32_t>(split);
    row.is_first_req_splitted = block != 0;
    int64_t remain = payload;
    while (req < b) {
      const int64_t left = num_blocks(req) - block;
      if (remain >= left + overhead) {  // the request finishes in this part
        cum += split + 1;
        write_split(req + 1, static_cast<int32_t>(cum));
        remain -= left + overhead;
        ++req;
        block = 0;
        split = 0;
      } else {
        if (remain - overhead > 0) {
          block += remain - overhead;
          split += 1;
        }
        break;
      }
    }
    const int64_t end_req = block > 0 ? req : req - 1;
    int64_t end_block = 0;
    if (block > 0) {
      end_block = block;
    } else if (req >= 1) {
      end_block = empty(req - 1) ? 0 : num_blocks(req - 1);
    }
    bool last_splitted = false;
    if (end_req >= 0 && end_req < b) last_splitted = end_block != num_blocks(end_req) && !empty(end_req);
    row.end_req_idx = static_cast<int32_t>(end_req);
    row.end_block_idx = static_cast<int32_t>(end_block);
    row.is_last_req_splitted = last_splitted;
    if (row.begin_req_idx == row.end_req_idx) {
      const int32_t either = row.is_first_req_splitted || row.is_last_req_splitted;
      row.is_first_req_splitted = either;
      row.is_last_req_splitted = either;
    }
    row.pad = 0;
    write_row(part, row);
  }
}

}  // namespace flashmla::core
