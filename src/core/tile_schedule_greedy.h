// src/core/tile_schedule_greedy.h — the greedy split-KV partition of spec §4.3, written once for
// the host (core::compute_tile_schedule, the CPU backend and the tests' oracle) and the device
// (src/sm90/common/scheduler.cu, which runs it in one thread out of shared memory).
#pragma once

#include <cstdint>

#include "flashmla/ops.h"

#if defined(__CUDACC__)
#define FLASHMLA_HOST_DEVICE __host__ __device__
#else
#define FLASHMLA_HOST_DEVICE
#endif

namespace flashmla::core {

constexpr int kSchedBlockSizeN = 64;  ///< tokens per scheduling block

// Per-request overhead of the greedy (spec §4.3), in scheduling blocks: the cost charged for each
// request piece on top of its blocks. It stands for a CTA's fixed cost per piece (loading the query,
// the epilogue, writing a split's partials) and is passed to every function below as `overhead`
// (any value >= 0). A larger value gives fewer, longer parts; a smaller one spreads a few requests
// over more parts. Spec §4 gives FlashMLA's value, 5, for dense and sparse decode alike.

/// Dense decode's overhead: FlashMLA's 5.
constexpr int kDenseDecodeSchedOverheadBlocks = 5;

/// Sparse FP8 decode's overhead: FlashMLA's 5 as well. Measured against 1 on the H200
/// (docs/sparse-fp8-decode.md, "The scheduler's per-request overhead for sparse decode"): 1 shortens
/// some main kernels by spreading a request over more parts, but the extra splits cost the combine
/// more than that saves on the call (V3.2 b 2, b 128 and MODEL1 b 128 all slower end to end).
constexpr int kSparseDecodeSchedOverheadBlocks = 5;

/// Scheduling blocks of a request of `s` tokens: ceil(max(s - 1, 0) / 64) + 1 (an empty request
/// still costs one block; spec §4.2).
FLASHMLA_HOST_DEVICE inline int64_t sched_num_blocks(int64_t s) {
  return (s > 1 ? s - 1 : 0) / kSchedBlockSizeN + 1;
}

/// Fills the end fields of a part's row (its begin fields set) from the greedy's state (request
/// `req`, block offset `block`) when the part is done, and applies spec §4.3's rule that a part
/// holding one request marks it split at both ends if either is.
template <class NumBlocks, class Empty>
FLASHMLA_HOST_DEVICE void finish_tile_row(TileSchedulerMetadataRow& row, int64_t b, int64_t req, int64_t block,
                                          const NumBlocks& num_blocks, const Empty& empty) {
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
}

/// Greedy partition of b requests into num_sm_parts rows (spec §4.3). `num_blocks(i)` gives
/// request i's block count (sched_num_blocks of its length), `empty(i)` whether its length is 0;
/// `overhead` >= 0 is the per-request overhead in blocks and `total` = sum_i (num_blocks(i) +
/// overhead). Each part's budget is ceil(total / num_sm_parts) + overhead, so each part does at
/// least ceil(total / num_sm_parts) of the total and every request is placed for any overhead >= 0;
/// at most num_sm_parts - 1 parts begin inside a request, so there are at most b + num_sm_parts - 1
/// splits (the partials buffers' size). Each part's row goes to `write_row(part, row)`,
/// num_splits[i] (b + 1 entries, exclusive prefix sum of pieces per request) to
/// `write_split(i, value)`; every entry is written exactly once.
template <class NumBlocks, class Empty, class WriteRow, class WriteSplit>
FLASHMLA_HOST_DEVICE void greedy_tile_schedule(int64_t b, int64_t num_sm_parts, int64_t total, int64_t overhead,
                                               const NumBlocks& num_blocks, const Empty& empty,
                                               const WriteRow& write_row, const WriteSplit& write_split) {
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
    finish_tile_row(row, b, req, block, num_blocks, empty);
    write_row(part, row);
  }
}

/// The request whose split partials part q (of a schedule's metadata rows, 8 int32 each) combines, or
/// -1: a request has several splits exactly when a part begins inside it (begin_block_idx > 0), and the
/// first such part takes it (part q - 1 did not begin inside it too). So every split request is named
/// by exactly one part, at most num_sm_parts - 1 of them (the sparse combine's compact grid, its default;
/// tests/cpp: Scheduler.SplitRequestOfPartNamesEachSplitRequestOnce).
FLASHMLA_HOST_DEVICE inline int split_request_of_part(const int32_t* rows, int64_t q, int64_t b) {
  if (q <= 0) return -1;
  const int32_t* row = rows + q * 8;
  const int32_t r = row[0];  // begin_req_idx
  if (r >= b || row[2] <= 0) return -1;       // begins at a request's start (or past the last request)
  if (row[-8] == r && row[-6] > 0) return -1;  // part q - 1 began inside r too: it names r
  return r;
}

// ------------------------------------------------------------------ the same partition, request by request
// greedy_tile_schedule walks parts and, inside each, requests: run by one GPU thread that is
// ~350 clk per part (23 µs at b = 1 over 132 parts on the H200). The functions below give the
// identical result with a serial pass over requests only, O(1) each, and then one independent
// computation per part (run in parallel on the GPU). Part budget P = payload, overhead O.
// Request i starts in part ps[i] with r blocks of that part's budget left:
//  * r >= nb + O: it finishes in ps[i] (pe[i] = ps[i]) and leaves r - nb - O;
//  * else it takes t = max(r - O, 0) blocks there (t > 0: a first piece, one split), then
//    k = max(ceil((nb - t) / (P - O)) - 1, 0) whole parts of P - O blocks, and finishes in
//    pe[i] = ps[i] + 1 + k, leaving P - (nb - t - k (P - O)) - O.
// The part a request starts in is where the previous one finished (part 0 for the first).
// Part q begins inside request i = min{i : pe[i] >= q} (b if none); if ps[i] < q its block and
// split offsets are t[i] + (q - ps[i] - 1)(P - O) and (t[i] > 0) + (q - ps[i] - 1), else 0, 0.
// Part q's end state is part q + 1's begin state (with q + 1 = num_sm_parts: all done).

/// Serial pass over the requests. Writes pe[i], ps[i], t[i] (int32, b entries each) and
/// num_splits through `write_split` (as greedy_tile_schedule, with the same `total` and `overhead`).
/// Returns the payload P.
template <class NumBlocks, class WriteSplit>
FLASHMLA_HOST_DEVICE int64_t schedule_requests(int64_t b, int64_t num_sm_parts, int64_t total, int64_t overhead,
                                               const NumBlocks& num_blocks, int32_t* pe, int32_t* ps, int32_t* t,
                                               const WriteSplit& write_split) {
  const int64_t payload = (total + num_sm_parts - 1) / num_sm_parts + overhead;
  // step = ceil(total / num_sm_parts) > 0 for b >= 1 (every request adds >= 1 block to total), for
  // any overhead >= 0; the loop below (the only user of step) does not run for b = 0.
  const int64_t step = payload - overhead;
  int64_t part = 0, r = payload, cum = 0;
  write_split(0, 0);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t nb = num_blocks(i);
    ps[i] = static_cast<int32_t>(part);
    int64_t pieces;
    if (r >= nb + overhead) {
      r -= nb + overhead;
      t[i] = 0;
      pieces = 1;
    } else {
      const int64_t first = r > overhead ? r - overhead : 0;
      const int64_t left = nb - first;
      const int64_t k = left > step ? (left + step - 1) / step - 1 : 0;
      part += 1 + k;
      r = payload - (left - k * step) - overhead;
      t[i] = static_cast<int32_t>(first);
      pieces = (first > 0) + k + 1;
    }
    pe[i] = static_cast<int32_t>(part);
    cum += pieces;
    write_split(i + 1, static_cast<int32_t>(cum));
  }
  return payload;
}

/// State of the greedy when it enters part q: (request, block offset, split offset).
struct SchedPartStart {
  int64_t req, block, split;
};

template <class Pe>
FLASHMLA_HOST_DEVICE SchedPartStart schedule_part_start(int64_t q, int64_t b, int64_t payload, int64_t overhead,
                                                        const Pe& pe, const int32_t* ps, const int32_t* t) {
  int64_t lo = 0, hi = b;  // first i with pe[i] >= q (pe is non-decreasing)
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (pe(mid) >= q) hi = mid;
    else lo = mid + 1;
  }
  if (lo == b || ps[lo] >= q) return {lo, 0, 0};
  const int64_t whole = q - ps[lo] - 1;
  return {lo, t[lo] + whole * (payload - overhead), (t[lo] > 0) + whole};
}

/// Metadata row of part q from the serial pass's arrays (equal to greedy_tile_schedule's row q);
/// `payload` is schedule_requests' result and `overhead` the value passed to it.
template <class NumBlocks, class Empty, class Pe>
FLASHMLA_HOST_DEVICE TileSchedulerMetadataRow schedule_part_row(int64_t q, int64_t b, int64_t payload,
                                                                int64_t overhead, const NumBlocks& num_blocks,
                                                                const Empty& empty, const Pe& pe, const int32_t* ps,
                                                                const int32_t* t) {
  const SchedPartStart begin = schedule_part_start(q, b, payload, overhead, pe, ps, t);
  const SchedPartStart end = schedule_part_start(q + 1, b, payload, overhead, pe, ps, t);
  TileSchedulerMetadataRow row{};
  row.begin_req_idx = static_cast<int32_t>(begin.req);
  row.begin_block_idx = static_cast<int32_t>(begin.block);
  row.begin_split_idx = static_cast<int32_t>(begin.split);
  row.is_first_req_splitted = begin.block != 0;
  finish_tile_row(row, b, end.req, end.block, num_blocks, empty);
  return row;
}

}  // namespace flashmla::core
