// flashmla/kv_format.h — KV-cache byte formats (spec §3).
#pragma once

#include <cstdint>

namespace flashmla {

/// Layout of one KV-cache token.
///
/// kBF16 / kFP16: dense paged cache `(num_blocks, page_block_size, h_kv, d_qk)` of
///   the query dtype; V is `k[..., :d_v]` (spec §3.1).
/// kFP8V32 (DeepSeek-V3.2, d_qk = 576): 656 bytes per token = 512 e4m3 NoPE values,
///   4 float32 scales (one per 128 dims), 64 bf16 RoPE values (spec §3.3).
/// kFP8Model1 (d_qk = 512): per page block, `pbs` records of 576 bytes
///   (448 e4m3 NoPE + 64 bf16 RoPE) followed by `pbs` records of 8 bytes
///   (7 UE8M0 scales, one per 64 dims, + 1 pad); presented as 584 bytes per
///   token (spec §3.4). V includes the RoPE part.
enum class KVFormat : int32_t { kBF16 = 0, kFP16, kFP8V32, kFP8Model1 };

namespace v32 {
constexpr int kDimQK = 576, kDimNope = 512, kDimRope = 64, kQuantTile = 128, kNumScales = 4;
constexpr int kBytesPerToken = 656;  // 512 + 4*4 + 64*2
constexpr int kScaleOffset = 512, kRopeOffset = 528;
}  // namespace v32

namespace model1 {
constexpr int kDimQK = 512, kDimNope = 448, kDimRope = 64, kQuantTile = 64, kNumScales = 7;
constexpr int kBytesPerToken = 584;  // 448 + 64*2 + 7 + 1
constexpr int kDataBytesPerToken = 576;  // 448 + 64*2, the first part of a page block
constexpr int kScaleBytesPerToken = 8;   // 7 e8m0 + 1 pad, the second part of a page block
}  // namespace model1

constexpr int kDimV = 512;

/// FP8 format implied by a head dim: 576 -> kFP8V32, 512 -> kFP8Model1; any other head dim has
/// no FP8 format and gives kBF16 (check `is_fp8_format` of the result).
inline KVFormat fp8_format_for_head_dim(int64_t d_qk) {
  return d_qk == model1::kDimQK ? KVFormat::kFP8Model1 : d_qk == v32::kDimQK ? KVFormat::kFP8V32 : KVFormat::kBF16;
}
inline bool is_fp8_format(KVFormat f) { return f == KVFormat::kFP8V32 || f == KVFormat::kFP8Model1; }
/// Bytes per token of an FP8 format (656 V32, 584 MODEL1); 0 for the non-FP8 formats.
inline int64_t fp8_bytes_per_token(KVFormat f) {
  return f == KVFormat::kFP8Model1 ? model1::kBytesPerToken : f == KVFormat::kFP8V32 ? v32::kBytesPerToken : 0;
}

}  // namespace flashmla
