// src/sm90/prefill/dense/dense_prefill.h — host-side internals of the sm90 dense MHA prefill shared
// between the launchers and the standalone GPU check (tools/dense_prefill_check/shim.cpp). Not public API.
#pragma once

#include "flashmla/ops.h"

namespace flashmla::sm90::dense_prefill {

/// Forward schedules (fwd.cu): kSerial = per key block S, softmax, P V one after the other;
/// kOverlap = S of block n issued with P V of block n - 1, softmax under that P V; kPingpong = kOverlap
/// with the two consumer warpgroups taking turns to issue their GEMMs; kPingpongTma = kPingpong with K / V
/// loaded by TMA instead of the producer warpgroup's cp.async (kPingpong where no tensor map can be made);
/// kPersistentTma = kPingpongTma in a persistent grid (one CTA per SM walking the tiles; Q by TMA too), so that
/// the producer loads the next tile's Q and first K / V while the consumers finish the current tile
/// (kPingpongTma where no tensor map of q can be made).
enum class FwdSchedule { kSerial, kOverlap, kPingpong, kPingpongTma, kPersistentTma };
/// The schedule dense_prefill_fwd uses: kPersistentTma, 1.007-1.147x kPingpongTma's TFLOP/s on the 16 benchmark
/// shapes (geomean 1.078; H200, same call, out and lse bitwise equal: bench/results/2026-12-04-dense-prefill-fwd-persistent-ab.log);
/// kPingpongTma was 363-511 TFLOP/s against kSerial 240-306, kOverlap 246-323, kPingpong 252-328
/// (bench/results/2026-12-03-dense-prefill-schedules.log).
constexpr FwdSchedule kFwdSchedule = FwdSchedule::kPersistentTma;

/// kPersistentTma with the softmax scale folded into the exponent's FMA (scale > 0; docs/dense-prefill.md, "The
/// forward's instruction mix beside FA3's"): one instruction per score less; out / lse are not bitwise equal to the
/// unfolded form (the exponent's argument rounds once). 0.966-1.065x the unfolded form's TFLOP/s on the 16 benchmark
/// shapes, geomean 1.030 (H200, same call: bench/results/2026-12-04-dense-prefill-fwd-fold-ab.log).
constexpr bool kFwdFoldScale = true;

/// Key blocks of kPersistentTma at d_qk 128: 176 keys instead of 128 (S by m64n176k16, P V over 11 k-steps; shared
/// memory holds no 176-key stages at d_qk 192). FlashAttention-3's block for d 128 without a causal mask: the per-step
/// waits, rescale and barriers spread over 37 % more GEMM work. Built and compiled (ptxas: the folded persistent
/// kernel spills 4 bytes stored / 20 loaded, one store and one load per step, the unfolded one, for scales <= 0,
/// 72 / 88; the 128-key ones spill none), not yet run on a GPU, so the library keeps 128 (docs/dense-prefill.md,
/// "Forward: 176-key blocks at d 128").
constexpr bool kFwdWideKeyBlocks = false;
/// The forward's key block for a shape: 176 where kFwdWideKeyBlocks, d_qk 128 and no causal mask, else 128.
inline int fwd_key_block(int64_t d_qk, bool causal) { return kFwdWideKeyBlocks && d_qk == 128 && !causal ? 176 : 128; }

/// Backward schedules (bwd.cu): kTwoKernel = a dq kernel (per query block, over key blocks) and a dk / dv
/// kernel (per key block, over query blocks), each recomputing S and dP (7 GEMMs per block pair), deterministic.
/// kTwoKernelTma = kTwoKernel with the streamed blocks loaded by TMA instead of the producer warpgroup's cp.async: the
/// dq kernel's K / V, the dk / dv kernel's Q, dO (and lse2 / D by bulk copies); kTwoKernel where no tensor map can be
/// made. Both use the workspace of dense_prefill_bwd_workspace_bytes.
enum class BwdSchedule { kTwoKernel, kTwoKernelTma };
/// The schedule dense_prefill_bwd uses: kTwoKernelTma, x1.35-1.62 kTwoKernel's backward TFLOP/s on the 16 benchmark
/// shapes (geomean x1.429; H200, same call, dq / dk / dv bitwise equal: bench/results/2026-12-04-dense-prefill-bwd-tma-ab.log;
/// the dq kernel's TMA alone: x1.191, ...-bwd-dq-tma-ab.log).
constexpr BwdSchedule kBwdSchedule = BwdSchedule::kTwoKernelTma;

/// The order of a grid's tiles: the backward's CTAs (the hardware hands a grid's CTAs out in linear index order) and
/// the persistent forward's tiles (dealt to its CTAs in rounds of the grid, for_each_tile in fwd.cu). kByHead: block
/// fastest, then head, then request. Under a causal mask each (head, request) comes heaviest block first, but the
/// heaviest blocks of the last (head, request)s come after most of the work, a tail when the grid is a few waves.
/// The backward's dk / dv grids of GQA shapes are that few: one CTA per KV head walks the query blocks of all its query heads,
/// so s 4096 h 32/4 is 256 CTAs, the heaviest as long as a whole SM's fair share (a list schedule of the benchmark
/// shapes' block-pair counts on 132 SMs: 1.59x the fair share there, 1.24x at s 8192, 1.007-1.07x for the other
/// backward grids; the forward's static deal 1.03x on every causal shape). kByBlock: the blocks outermost, every
/// (head, request)'s heaviest block before any lighter one (1.000-1.007x) when the requests are equally long (the
/// order is by block index, not by work: in a varlen batch a short request's block 0 is lighter than a long one's
/// later blocks). kByHead keeps one head's tiles together,
/// so that they share its K / V (forward, dq kernel) or Q / dO (dk / dv kernel) in L2; kByBlock spreads the SMs over
/// (head, request)s, which share only what a GQA group shares. kShapeRule: the rule below.
/// tools/dense_prefill_check/grid_order_model.py; docs/dense-prefill.md, "The tiles' order".
enum class TileOrder { kShapeRule, kByHead, kByBlock };
/// kByBlock only for a causal grid of at most this many waves of one CTA per SM (the benchmark shapes' GQA grids:
/// 2-31 waves; their h 128 grids, 62-124 waves, lose at most 1.8 % (backward) / 3 % (forward) to the tail and keep
/// their L2 sharing).
constexpr int64_t kByBlockMaxWaves = 32;
/// The forward, which reads each K / V block once per tile and so leans on L2 more than the backward's kernels, takes
/// kByBlock only where at least this many query heads share a KV head (and with it the K / V).
constexpr int64_t kFwdByBlockMinGroup = 4;
/// Whether the library takes kByBlock where the rules say so (H100, 2026-12-05, same process, bitwise equal outputs;
/// docs/dense-prefill.md, "The tiles' order"). Backward, on: the GQA causal shapes x1.04-1.36, the grids the rule
/// leaves by head lose there (h 128: x0.79-0.84, the one head's Q / dO no longer shared in L2; non-causal GQA
/// x0.99-1.03). Forward, off: s 4096 GQA causal x1.009-1.016, s 8192 GQA causal x0.95-1.02 (three processes of five
/// rounds, session 38), h 128 forced x0.50-0.70: no net gain.
constexpr bool kBwdByBlockOrder = true;
constexpr bool kFwdByBlockOrder = false;
/// The order of a backward kernel's grid of `ctas` CTAs on `sms` SMs (one CTA per SM).
inline TileOrder bwd_tile_order(bool causal, int64_t ctas, int sms) {
  return kBwdByBlockOrder && causal && sms > 0 && ctas <= kByBlockMaxWaves * sms ? TileOrder::kByBlock
                                                                                  : TileOrder::kByHead;
}
/// The order of the persistent forward's `tiles` tiles on `sms` SMs, `group` query heads per KV head.
inline TileOrder fwd_tile_order(bool causal, int64_t tiles, int sms, int64_t group) {
  return kFwdByBlockOrder && causal && sms > 0 && tiles <= kByBlockMaxWaves * sms && group >= kFwdByBlockMinGroup
             ? TileOrder::kByBlock
             : TileOrder::kByHead;
}

/// dense_prefill_fwd with a given schedule (the GPU check times and verifies each). max_persistent_ctas > 0 caps
/// kPersistentTma's grid below the SM count, so that the check makes each CTA walk many tiles on small cases too;
/// fold_scale: kFwdFoldScale's form (kPersistentTma with a positive scale only); key_block: 0 = fwd_key_block's, or
/// 128 / 176 (176 only where kPersistentTma runs at d_qk 128; elsewhere 128); order: the persistent grid's tile order
/// (kShapeRule: fwd_tile_order's; kByBlock only with the folded scale and 128-key blocks, else kByHead).
Status fwd_with_schedule(const DensePrefillParams& p, FwdSchedule schedule, int max_persistent_ctas = 0,
                         bool fold_scale = kFwdFoldScale, int key_block = 0, TileOrder order = TileOrder::kShapeRule);

/// dense_prefill_bwd with a given schedule and CTA order (the GPU check verifies and times each; `order` kByHead /
/// kByBlock: both kernels in that order, for any shape; kByBlock with the TMA loaders only).
Status bwd_with_schedule(const DensePrefillBwdParams& p, BwdSchedule schedule, TileOrder order = TileOrder::kShapeRule);

}  // namespace flashmla::sm90::dense_prefill
