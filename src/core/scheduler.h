// src/core/scheduler.h — host implementation of FlashMLA's split-KV tile
// scheduler (spec §4.2-§4.3). Used by the CPU backend to fill the metadata
// object and by tests as the oracle for the device-side scheduler.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tile_schedule_greedy.h"
#include "flashmla/ops.h"

namespace flashmla::core {

/// num_sm_parts for dense decode on a device with `num_sms` SMs (spec §4.1).
int64_t dense_decode_num_sm_parts(int num_sms, int64_t s_q, int64_t h_q, int64_t h_kv);
/// num_sm_parts for sparse decode (SM90 rule of spec §4.1).
int64_t sparse_decode_num_sm_parts(int num_sms, int64_t s_q, int64_t h_q);

/// Greedy partition of per-request work `seqlens` (tokens; spec §4.2 `s'_i`)
/// into `num_sm_parts` rows, with `overhead` (>= 0) blocks per request: the path's
/// constant, kDenseDecodeSchedOverheadBlocks or kSparseDecodeSchedOverheadBlocks.
/// Writes `metadata` (num_sm_parts rows) and `num_splits` (b+1 entries, exclusive
/// prefix sum of splits per request).
void compute_tile_schedule(const std::vector<int64_t>& seqlens, int64_t num_sm_parts, int64_t overhead,
                           TileSchedulerMetadataRow* metadata, int32_t* num_splits);

}  // namespace flashmla::core
