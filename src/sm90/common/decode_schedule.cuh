// src/sm90/common/decode_schedule.cuh — a decode main kernel's share of the split-KV schedule: one
// row of tile_scheduler_metadata (spec §4.2-§4.3, written by common/scheduler.cu) per CTA part, read
// the same way by the dense and the sparse FP8 decode kernels.
#pragma once

#include <cstdint>

namespace flashmla::sm90 {

// A part's schedule row: it processes requests begin_req .. end_req, from block begin_blk of begin_req
// to block end_blk (exclusive) of end_req; begin_split is the split index of begin_req that the part
// computes; first_splitted / last_splitted say whether its first / last request is shared with another
// part (then this part writes a split partial for the combine kernel, not out). The kernels read the
// row into locals and the helpers take the fields they need (a struct holding the row changed the
// kernels' machine code).

/// True when the part holds request req whole (its O and LSE go straight to out and lse).
__device__ __forceinline__ bool part_holds_whole_request(int req, int begin_req, int end_req, int first_splitted,
                                                         int last_splitted) {
  bool whole;
  if (req == begin_req) whole = !first_splitted;
  else if (req == end_req) whole = !last_splitted;
  else whole = true;
  return whole;
}

/// The index in o_accum / lse_accum of the split of request req that the part computes; num_splits:
/// the scheduler's prefix sums of splits per request (b + 1 entries).
__device__ __forceinline__ int part_split_slot(const int32_t* num_splits, int req, int begin_req, int begin_split) {
  return num_splits[req] + (req == begin_req ? begin_split : 0);
}

/// One past the last block of request req (n_blocks blocks in all) that the part processes: block
/// end_blk of its last request end_req, else the request's end.
__device__ __forceinline__ int part_end_block(int req, int n_blocks, int end_req, int end_blk) {
  int blk_hi = req == end_req ? end_blk : n_blocks;
  return min(blk_hi, n_blocks);
}

}  // namespace flashmla::sm90
