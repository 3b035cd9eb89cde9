// src/reference/fp8_cache.h — token-level access to the FP8 KV-cache byte formats
// (spec §3.3 V32, §3.4 MODEL1) and the quantization recipe of spec §3.5.
//
// A packed cache is a 1-byte tensor (num_blocks, pbs, 1, 656|584). Page block B
// starts at byte B * stride(0) (any block stride >= pbs * bytes_per_token).
//   V32    token r of a block: bytes [r*stride(1), +656): 512 e4m3 | 4 float32 scales | 64 bf16 RoPE
//   MODEL1 token r of a block: [r*576, +448) e4m3 NoPE, [r*576+448, +128) bf16 RoPE,
//          [pbs*576 + r*8, +7) e8m0 scales, pbs*576 + r*8 + 7 padding byte.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "flashmla/kv_format.h"
#include "reference/numeric.h"

namespace flashmla::reference {

/// Byte locations of one token of an FP8 cache.
struct Fp8TokenBytes {
  uint8_t* nope;    ///< V32: 512 e4m3; MODEL1: 448 e4m3
  uint8_t* scales;  ///< V32: 4 float32 (unaligned); MODEL1: 7 e8m0 + 1 pad
  uint8_t* rope;    ///< 64 bf16 (unaligned)
};

/// Locate token `row` of the page block starting at `block_base`.
/// `token_stride` (= stride(1), 656 for V32) is only used by V32; MODEL1's layout
/// is fixed by `pbs` (data records first, then scale records).
inline Fp8TokenBytes fp8_token_bytes(KVFormat fmt, uint8_t* block_base, int64_t pbs, int64_t token_stride,
                                     int64_t row) {
  if (fmt == KVFormat::kFP8Model1) {
    uint8_t* data = block_base + row * model1::kDataBytesPerToken;
    return {data, block_base + pbs * model1::kDataBytesPerToken + row * model1::kScaleBytesPerToken,
            data + model1::kDimNope};
  }
  uint8_t* tok = block_base + row * token_stride;
  return {tok, tok + v32::kScaleOffset, tok + v32::kRopeOffset};
}

/// Dequantize one token into `d_qk` floats (576 for V32, 512 for MODEL1), each an
/// exact bf16 value (spec §3.5 dequantize / §2.3 "dequantized bf16"):
///   V32    K[d] = bf16(float(fp8[d]) * scale_f32[d / 128]),  d < 512;  K[512:576] = RoPE
///   MODEL1 K[d] = bf16(float(fp8[d]) * 2^(e[d / 64] - 127)), d < 448;  K[448:512] = RoPE
inline void fp8_dequant_token(KVFormat fmt, const Fp8TokenBytes& tb, float* dst) {
  const bool m1 = fmt == KVFormat::kFP8Model1;
  const int nope = m1 ? model1::kDimNope : v32::kDimNope;
  const int tile = m1 ? model1::kQuantTile : v32::kQuantTile;
  const int num_scales = m1 ? model1::kNumScales : v32::kNumScales;
  float scale[8];
  for (int t = 0; t < num_scales; ++t) {
    if (m1) {
      scale[t] = e8m0_to_float(tb.scales[t]);
    } else {
      std::memcpy(&scale[t], tb.scales + 4 * t, sizeof(float));
    }
  }
  for (int d = 0; d < nope; ++d) dst[d] = round_to_bf16(e4m3_to_float(tb.nope[d]) * scale[d / tile]);
  for (int d = 0; d < v32::kDimRope; ++d) {
    uint16_t h;
    std::memcpy(&h, tb.rope + 2 * d, sizeof(h));
    dst[nope + d] = bf16_to_float(h);
  }
}

/// Same as fp8_dequant_token but writes bf16 bits (bit-exact RoPE copy).
inline void fp8_dequant_token_bf16(KVFormat fmt, const Fp8TokenBytes& tb, uint16_t* dst, int64_t dst_stride) {
  float k[v32::kDimQK];
  fp8_dequant_token(fmt, tb, k);
  const int nope = fmt == KVFormat::kFP8Model1 ? model1::kDimNope : v32::kDimNope;
  for (int d = 0; d < nope; ++d) dst[d * dst_stride] = float_to_bf16(k[d]);
  for (int d = 0; d < v32::kDimRope; ++d) std::memcpy(&dst[(nope + d) * dst_stride], tb.rope + 2 * d, 2);
}

/// Power-of-two scale of one quantization tile (spec §3.5 steps 1-2):
///   amax = max |x| (NaN propagates), s_inv = amax / 448,
///   scale = 2^ceil(log2(max(s_inv, 1e-4)))  in float32.
/// NaN amax -> NaN scale; inf amax -> inf scale. Finite results are exact powers of two.
inline float fp8_tile_scale(const uint16_t* x, int64_t stride, int n) {
  float amax = 0.f;
  for (int d = 0; d < n; ++d) {
    const float a = std::fabs(bf16_to_float(x[d * stride]));
    if (std::isnan(a) || std::isnan(amax)) amax = std::numeric_limits<float>::quiet_NaN();
    else if (a > amax) amax = a;
  }
  const float s_inv = amax / 448.0f;
  const float clamped = std::isnan(s_inv) ? s_inv : std::max(s_inv, 1e-4f);
  const float e = std::ceil(std::log2(clamped));
  if (!std::isfinite(e)) return std::exp2(e);  // NaN -> NaN, +inf -> inf
  return std::ldexp(1.0f, static_cast<int>(e));
}

/// Quantize one token of `d_qk` bf16 values (`x`, element stride `x_stride`) into
/// its packed bytes (spec §3.5): q = e4m3(float(x) / scale) (RNE, PyTorch cast),
/// V32 scales stored as float32, MODEL1 scales as e8m0 (+ pad byte 0), RoPE copied bit-exactly.
inline void fp8_quant_token(KVFormat fmt, const uint16_t* x, int64_t x_stride, const Fp8TokenBytes& tb) {
  const bool m1 = fmt == KVFormat::kFP8Model1;
  const int tile = m1 ? model1::kQuantTile : v32::kQuantTile;
  const int num_scales = m1 ? model1::kNumScales : v32::kNumScales;
  const int nope = m1 ? model1::kDimNope : v32::kDimNope;
  for (int t = 0; t < num_scales; ++t) {
    const uint16_t* xt = x + static_cast<int64_t>(t) * tile * x_stride;
    const float scale = fp8_tile_scale(xt, x_stride, tile);
    for (int d = 0; d < tile; ++d)
      tb.nope[t * tile + d] = float_to_e4m3(bf16_to_float(xt[d * x_stride]) / scale);
    if (m1) tb.scales[t] = float_to_e8m0(scale);
    else std::memcpy(tb.scales + 4 * t, &scale, sizeof(float));
  }
  if (m1) tb.scales[model1::kNumScales] = 0;  // padding byte
  for (int d = 0; d < v32::kDimRope; ++d) std::memcpy(tb.rope + 2 * d, &x[(nope + d) * x_stride], 2);
}

}  // namespace flashmla::reference
