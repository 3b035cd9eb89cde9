// src/reference/numeric.h — scalar conversions used by the CPU reference backend.
//
// All conversions are bit-exact with PyTorch's CPU casts:
//   * bfloat16 / float16 <-> float32: round-to-nearest-even, NaN preserved (quiet),
//     overflow to +-inf (float16).
//   * float8_e4m3fn (1-4-3, bias 7, no inf, 0x7F/0xFF = NaN, max 448):
//     encode is PyTorch's `fp8e4m3fn_from_fp32_value` (RNE, *non-saturating*:
//     |x| that rounds above 448 -> NaN, NaN -> 0x7F | sign); decode is exact.
//   * float8_e8m0fnu (UE8M0): byte e -> 2^(e-127), 0xFF = NaN (spec §3.4).
//
// Header-only; no framework dependencies.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace flashmla::reference {

// ---------------------------------------------------------------- bit casts
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// ---------------------------------------------------------------- bfloat16
/// bf16 bits -> float (exact).
inline float bf16_to_float(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

/// float -> bf16 bits, round-to-nearest-even; NaN stays NaN (quiet bit forced).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;  // carries into the exponent correctly (overflow -> inf)
  return static_cast<uint16_t>(u >> 16);
}

/// Round a float to the nearest bf16 value (RNE) and return it as float.
inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// ---------------------------------------------------------------- float16
/// IEEE binary16 bits -> float (exact, subnormals included).
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) {  // zero / subnormal: man * 2^-24 (exact in float)
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 0x1F) return f32_from_bits(sign | 0x7F800000u | (man << 13));  // inf / NaN
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

/// float -> IEEE binary16 bits, round-to-nearest-even; overflow -> inf; NaN kept quiet.
inline uint16_t float_to_fp16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {
    // |f| < 2^-14: float16 subnormal (unit 2^-24). Scaling by 2^24 is exact; nearbyint
    // uses the default round-to-nearest-even mode. 1024 encodes the smallest normal.
    const float units = std::nearbyint(std::ldexp(f32_from_bits(a), 24));
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(units));
  }
  const uint32_t odd = (a >> 13) & 1u;
  a += 0xFFFu + odd;   // RNE on the 13 dropped mantissa bits
  a -= 112u << 23;     // re-bias exponent 127 -> 15
  return static_cast<uint16_t>(sign | (a >> 13));
}

// ---------------------------------------------------------------- float8_e4m3fn
namespace detail {
inline float e4m3_decode_slow(uint8_t b) {
  const bool neg = (b & 0x80u) != 0;
  const int exp = (b >> 3) & 0xF;
  const int man = b & 0x7;
  float v;
  if (exp == 0xF && man == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);                 // subnormal: man * 2^-9
  else v = std::ldexp(static_cast<float>(8 + man), exp - 7 - 3);              // (1 + man/8) * 2^(exp-7)
  return neg ? -v : v;
}
inline const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = e4m3_decode_slow(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}
}  // namespace detail

/// float8_e4m3fn byte -> float (exact; 0x7F / 0xFF -> NaN).
inline float e4m3_to_float(uint8_t b) { return detail::e4m3_table()[b]; }

/// float -> float8_e4m3fn byte exactly as PyTorch's `.to(torch.float8_e4m3fn)`:
/// round-to-nearest-even; |x| >= 480 (or rounding up past 448), inf and NaN -> 0x7F | sign.
inline uint8_t float_to_e4m3(float f) {
  uint32_t u = f32_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint8_t r;
  if (u >= (1087u << 20)) {  // 480.0f and above, inf, NaN
    r = 0x7F;
  } else if (u < (121u << 23)) {  // |x| < 2^-6: subnormal range
    // Adding 2^14 aligns the float ulp (2^-9) with the e4m3 subnormal unit, so
    // the hardware float addition performs the RNE rounding.
    const uint32_t denorm_mask = 141u << 23;
    const uint32_t v = f32_bits(f32_from_bits(u) + f32_from_bits(denorm_mask));
    r = static_cast<uint8_t>(v - denorm_mask);
  } else {
    const uint32_t odd = (u >> 20) & 1u;
    u += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu;  // re-bias + rounding bias
    u += odd;
    r = static_cast<uint8_t>(u >> 20);
  }
  return static_cast<uint8_t>(r | (sign >> 24));
}

// ---------------------------------------------------------------- float8_e8m0fnu
/// UE8M0 byte -> float: 2^(e-127); 0xFF -> NaN.
inline float e8m0_to_float(uint8_t e) {
  if (e == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(e) - 127);
}

/// Power-of-two float -> UE8M0 byte (exponent + 127). Anything that is not a
/// finite positive power of two in [2^-127, 2^127] (NaN, inf, 0) maps to 0xFF (NaN).
inline uint8_t float_to_e8m0(float f) {
  if (!(f > 0.f) || !std::isfinite(f)) return 0xFF;
  int e = 0;
  const float m = std::frexp(f, &e);  // f = m * 2^e, m in [0.5, 1)
  if (m != 0.5f) return 0xFF;
  const int biased = e - 1 + 127;
  return (biased < 0 || biased > 254) ? uint8_t{0xFF} : static_cast<uint8_t>(biased);
}

}  // namespace flashmla::reference
