// src/sm90/common/decode_schedule.cuh — a decode main kernel's share of the split-KV schedule: one
// row of tile_scheduler_metadata (spec §4.2-§4.3, written by common/scheduler.cu) per CTA part, read
// the same way by the dense and the sparse FP8 decode kernels.
#pragma once

#include <cstdint>

namespace flashmla::sm90 {

// A part's schedule row: it processes requests begin_req .. end_req, from block begin_blk of begin_req
// to block end_blk (exclusive) of end_req; begin_split is the split index of begin_req that the part
// computes; first_splitted / last_splitted say whether its first / last request is shared with another
// part (then this part writes a split partial for the combine kernel, not out). The sparse kernels
// read the row into locals and call the helpers below; the dense kernels read it as a PartSchedule and
// take each request's share from part_request. The helpers compare req with the row's fields as int
// parameters: a comparison of req with a struct field inside a helper comes out with its operands the
// other way round and changes the dense kernels' register allocation.

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

/// The first block of request req that the part processes: block begin_blk of its first request
/// begin_req, else the request's first.
__device__ __forceinline__ int part_begin_block(int req, int begin_req, int begin_blk) {
  return req == begin_req ? begin_blk : 0;
}

/// One past the last block of request req (n_blocks blocks in all) that the part processes: block
/// end_blk of its last request end_req, else the request's end.
__device__ __forceinline__ int part_end_block(int req, int n_blocks, int end_req, int end_blk) {
  int blk_hi = req == end_req ? end_blk : n_blocks;
  return min(blk_hi, n_blocks);
}

/// A part's schedule row, the fields as above.
struct PartSchedule {
  int begin_req, end_req, begin_blk, end_blk, begin_split, first_splitted, last_splitted;
};

/// The schedule row of part `part` in tile_scheduler_metadata (8 ints a part).
__device__ __forceinline__ PartSchedule part_schedule(const int32_t* tile_scheduler_metadata, int part) {
  const int32_t* meta = tile_scheduler_metadata + part * 8;
  return {meta[0], meta[1], meta[2], meta[3], meta[4], meta[5], meta[6]};
}

/// Request req's share of a part: its blocks blk_lo .. blk_lo + n_blk - 1 (n_blk 0: none), whether the part holds the request whole (no_split) and the index of its split in
/// o_accum / lse_accum (split_slot).
struct PartRequest {
  int blk_lo, n_blk;
  bool no_split;
  int split_slot;
};

/// Request req's share of part ps, for a request of n_keys keys in blocks of kBlockN (num_splits as
/// part_split_slot's).
template <int kBlockN>
__device__ __forceinline__ PartRequest part_request(const PartSchedule& ps, const int32_t* num_splits, int req,
                                                    int n_keys) {
  const int n_blocks = (n_keys + kBlockN - 1) / kBlockN;
  const int blk_lo = part_begin_block(req, ps.begin_req, ps.begin_blk);
  const int blk_hi = part_end_block(req, n_blocks, ps.end_req, ps.end_blk);
  const int n_blk = max(blk_hi - blk_lo, 0);
  const bool no_split = part_holds_whole_request(req, ps.begin_req, ps.end_req, ps.first_splitted, ps.last_splitted);
  const int split_slot = part_split_slot(num_splits, req, ps.begin_req, ps.begin_split);
  return {blk_lo, n_blk, no_split, split_slot};
}

}  // namespace flashmla::sm90
