// Tests of reference::quantize_kv_cache / dequantize_kv_cache (spec §3.3-§3.5):
// hand-computed bytes, a byte-exact comparison with an independent float64
// quantizer (brute-force nearest-even e4m3), block-stride padding left untouched,
// the dequantization round trip and re-quantization of the dequantized cache.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "flashmla/ops.h"
#include "reference/reference.h"
#include "reference_test_util.h"

namespace ref = flashmla::reference;
using namespace flashmla;
using namespace flashmla::testing;

namespace {

constexpr uint8_t kPadPoison = 0xAB;

struct Layout {
  KVFormat fmt;
  int64_t num_blocks, pbs, block_stride, bpt, d, nope, tile, num_scales;
  explicit Layout(KVFormat f, int64_t nb, int64_t page) : fmt(f), num_blocks(nb), pbs(page) {
    const bool m1 = f == KVFormat::kFP8Model1;
    bpt = m1 ? 584 : 656;
    d = m1 ? 512 : 576;
    nope = m1 ? 448 : 512;
    tile = m1 ? 64 : 128;
    num_scales = nope / tile;
    block_stride = m1 ? (pbs * 584 + 575) / 576 * 576 + 576 : (pbs + 1) * 656;  // always some padding
  }
  bool m1() const { return fmt == KVFormat::kFP8Model1; }
  // Independent byte offsets (spec §3.3 / §3.4).
  int64_t nope_off(int64_t blk, int64_t row) const { return blk * block_stride + row * (m1() ? 576 : 656); }
  int64_t rope_off(int64_t blk, int64_t row) const { return nope_off(blk, row) + (m1() ? 448 : 528); }
  int64_t scale_off(int64_t blk, int64_t row) const {
    return m1() ? blk * block_stride + pbs * 576 + row * 8 : nope_off(blk, row) + 512;
  }
  /// Which bytes of the packed buffer belong to token payloads (the rest is padding).
  std::vector<char> payload_mask() const {
    std::vector<char> m(static_cast<size_t>(num_blocks * block_stride), 0);
    for (int64_t b = 0; b < num_blocks; ++b)
      for (int64_t k = 0; k < pbs * bpt; ++k) m[static_cast<size_t>(b * block_stride + k)] = 1;
    return m;
  }
  TensorRef packed_ref(std::vector<uint8_t>& bytes) const {
    return make_tensor_ref(bytes.data(), DType::kUInt8, {num_blocks, pbs, 1, bpt}, {block_stride, bpt, bpt, 1});
  }
};

/// Spec §3.5 scale, computed independently: smallest power of two >= max(float(amax)/448, 1e-4).
double oracle_scale(float amax) {
  const float s_inv = amax / 448.0f;
  if (std::isnan(s_inv)) return kNaND;
  const float clamped = std::max(s_inv, 1e-4f);
  int e;
  const double m = std::frexp(static_cast<double>(clamped), &e);  // clamped = m * 2^e, m in [0.5, 1)
  return m == 0.5 ? std::ldexp(1.0, e - 1) : std::ldexp(1.0, e);
}

/// bf16 input cache (num_blocks, pbs, 1, d) with padded strides.
StridedTensor<uint16_t> make_input(const Layout& L) {
  return StridedTensor<uint16_t>(DType::kBFloat16, {L.num_blocks, L.pbs, 1, L.d}, {1, 1, 1, 32}, kHalfNaN);
}

void check_against_oracle(const Layout& L, const StridedTensor<uint16_t>& x, const std::vector<uint8_t>& bytes,
                          const std::string& name) {
  int64_t mismatches = 0;
  for (int64_t b = 0; b < L.num_blocks; ++b)
    for (int64_t r = 0; r < L.pbs; ++r) {
      for (int64_t t = 0; t < L.num_scales; ++t) {
        float amax = 0.f;
        bool nan = false;
        for (int64_t k = 0; k < L.tile; ++k) {
          const double v = bf16_bits_to_double(x.at({b, r, 0, t * L.tile + k}));
          if (std::isnan(v)) nan = true;
          else amax = std::max(amax, static_cast<float>(std::fabs(v)));
        }
        const double scale = nan ? kNaND : oracle_scale(amax);
        // Stored scale.
        if (L.m1()) {
          const uint8_t e = bytes[static_cast<size_t>(L.scale_off(b, r) + t)];
          const uint8_t want = std::isnan(scale) ? 0xFF : static_cast<uint8_t>(std::ilogb(scale) + 127);
          if (e != want && ++mismatches < 5) ADD_FAILURE() << name << " e8m0 scale " << at_str(b, r, t);
        } else {
          float s;
          std::memcpy(&s, &bytes[static_cast<size_t>(L.scale_off(b, r) + 4 * t)], 4);
          const bool ok = std::isnan(scale) ? std::isnan(s) : static_cast<double>(s) == scale;
          if (!ok && ++mismatches < 5) ADD_FAILURE() << name << " f32 scale " << at_str(b, r, t) << " " << s;
        }
        // Quantized values.
        for (int64_t k = 0; k < L.tile; ++k) {
          const int64_t dim = t * L.tile + k;
          const uint8_t got = bytes[static_cast<size_t>(L.nope_off(b, r) + dim)];
          const double v = bf16_bits_to_double(x.at({b, r, 0, dim}));
          bool ok;
          if (std::isnan(scale)) ok = (got & 0x7F) == 0x7F;  // NaN (sign unspecified)
          else ok = got == e4m3_brute_force(static_cast<float>(v / scale));
          if (!ok && ++mismatches < 5) ADD_FAILURE() << name << " e4m3 byte " << at_str(b, r, dim) << " v=" << v;
        }
      }
      for (int64_t k = 0; k < 64; ++k) {
        uint16_t h;
        std::memcpy(&h, &bytes[static_cast<size_t>(L.rope_off(b, r) + 2 * k)], 2);
        if (h != x.at({b, r, 0, L.nope + k}) && ++mismatches < 5) ADD_FAILURE() << name << " rope " << at_str(b, r, k);
      }
      if (L.m1() && bytes[static_cast<size_t>(L.scale_off(b, r) + 7)] != 0 && ++mismatches < 5)
        ADD_FAILURE() << name << " MODEL1 pad byte not zero " << at_str(b, r);
    }
  EXPECT_EQ(mismatches, 0) << name;
  const std::vector<char> payload = L.payload_mask();
  int64_t touched = 0;
  for (size_t k = 0; k < bytes.size(); ++k) touched += !payload[k] && bytes[k] != kPadPoison;
  EXPECT_EQ(touched, 0) << name << ": block padding bytes modified";
}

/// Random cache with tiles of very different magnitudes (exercising every scale
/// exponent incl. the 1e-4 clamp), exact-power tiles and one NaN token.
StridedTensor<uint16_t> random_input(const Layout& L, Rng& rng) {
  StridedTensor<uint16_t> x = make_input(L);
  for (int64_t b = 0; b < L.num_blocks; ++b)
    for (int64_t r = 0; r < L.pbs; ++r) {
      for (int64_t t = 0; t < L.num_scales; ++t) {
        const int kind = static_cast<int>(rng.randint(0, 9));
        const double mag = std::ldexp(1.0, static_cast<int>(rng.randint(-24, 12)));
        for (int64_t k = 0; k < L.tile; ++k) {
          double v = rng.normal() * mag;
          if (kind == 0) v = 0.0;                               // all-zero tile -> clamp -> 2^-13
          if (kind == 1 && k == 7) v = -448.0 * mag / 256.0;    // amax an exact 448 * 2^k
          x.at({b, r, 0, t * L.tile + k}) = bf16_trunc(static_cast<float>(v));
        }
      }
      for (int64_t k = 0; k < 64; ++k) x.at({b, r, 0, L.nope + k}) = bf16_trunc(static_cast<float>(rng.normal()));
    }
  // A NaN-poisoned token, as in FlashMLA's tests (poisoning happens before quantization).
  for (int64_t dim = 0; dim < L.d; ++dim) x.at({L.num_blocks - 1, L.pbs - 1, 0, dim}) = 0x7FC0;
  return x;
}

void run_random_roundtrip(KVFormat fmt, int64_t nb, int64_t pbs, uint64_t seed) {
  const Layout L(fmt, nb, pbs);
  const std::string name = std::string(L.m1() ? "MODEL1" : "V32") + " pbs" + std::to_string(pbs);
  SCOPED_TRACE(name);
  Rng rng(seed);
  StridedTensor<uint16_t> x = random_input(L, rng);
  std::vector<uint8_t> bytes(static_cast<size_t>(nb * L.block_stride), kPadPoison);
  ASSERT_TRUE(ref::quantize_kv_cache(fmt, x.ref(), L.packed_ref(bytes)).ok());
  check_against_oracle(L, x, bytes, name);

  // Dequantize: exact values fp8 * scale (spec §3.5), RoPE bit-exact, within the quantization error.
  StridedTensor<uint16_t> y = make_input(L);
  ASSERT_TRUE(ref::dequantize_kv_cache(fmt, L.packed_ref(bytes), y.ref()).ok());
  EXPECT_EQ(y.count_modified_padding(kHalfNaN), 0);
  int64_t bad = 0;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t r = 0; r < pbs; ++r) {
      const bool nan_token = b == nb - 1 && r == pbs - 1;
      for (int64_t dim = 0; dim < L.d; ++dim) {
        const double xv = bf16_bits_to_double(x.at({b, r, 0, dim}));
        const double yv = bf16_bits_to_double(y.at({b, r, 0, dim}));
        if (nan_token && dim < L.nope) {
          bad += !std::isnan(yv);
          continue;
        }
        if (dim >= L.nope) {  // RoPE: bit-exact
          bad += x.at({b, r, 0, dim}) != y.at({b, r, 0, dim});
          continue;
        }
        const int64_t t = dim / L.tile;
        double scale;
        if (L.m1()) {
          scale = e8m0_bits_to_double(bytes[static_cast<size_t>(L.scale_off(b, r) + t)]);
        } else {
          float s;
          std::memcpy(&s, &bytes[static_cast<size_t>(L.scale_off(b, r) + 4 * t)], 4);
          scale = s;
        }
        const double expect = e4m3_bits_to_double(bytes[static_cast<size_t>(L.nope_off(b, r) + dim)]) * scale;
        // |x - q*scale| <= half an e4m3 ulp: |x|/16 in the normal range, 2^-10*scale for subnormals.
        const double bound = std::fabs(xv) / 16.0 + std::ldexp(scale, -10);
        if (yv != expect || std::fabs(yv - xv) > bound) {
          if (++bad < 5) ADD_FAILURE() << "dequant " << at_str(b, r, dim) << " x=" << xv << " y=" << yv;
        }
      }
    }
  EXPECT_EQ(bad, 0);

  // Re-quantizing the dequantized cache gives the same values; the bytes are identical
  // except in tiles whose largest code rounded down to exactly 224 * scale: there
  // amax' / 448 == scale / 2 and the new scale halves (every code doubles; same values).
  std::vector<uint8_t> bytes2(bytes.size(), kPadPoison);
  ASSERT_TRUE(ref::quantize_kv_cache(fmt, y.ref(), L.packed_ref(bytes2)).ok());
  StridedTensor<uint16_t> z = make_input(L);
  ASSERT_TRUE(ref::dequantize_kv_cache(fmt, L.packed_ref(bytes2), z.ref()).ok());
  int64_t value_diff = 0, halved_tiles = 0, byte_diff = 0;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t r = 0; r < pbs; ++r) {
      if (b == nb - 1 && r == pbs - 1) continue;  // NaN token
      for (int64_t dim = 0; dim < L.d; ++dim) value_diff += y.at({b, r, 0, dim}) != z.at({b, r, 0, dim});
      for (int64_t t = 0; t < L.num_scales; ++t) {
        const int64_t sb = L.m1() ? 1 : 4;
        const bool same_scale = std::memcmp(&bytes[static_cast<size_t>(L.scale_off(b, r) + sb * t)],
                                            &bytes2[static_cast<size_t>(L.scale_off(b, r) + sb * t)], sb) == 0;
        double tile_max = 0;
        for (int64_t k = 0; k < L.tile; ++k)
          tile_max = std::max(tile_max, std::fabs(e4m3_bits_to_double(
                                            bytes[static_cast<size_t>(L.nope_off(b, r) + t * L.tile + k)])));
        if (!same_scale) {
          ++halved_tiles;
          EXPECT_EQ(tile_max, 224.0) << "scale changed on re-quantization " << at_str(b, r, t);
          continue;
        }
        byte_diff += std::memcmp(&bytes[static_cast<size_t>(L.nope_off(b, r) + t * L.tile)],
                                 &bytes2[static_cast<size_t>(L.nope_off(b, r) + t * L.tile)], L.tile) != 0;
      }
    }
  EXPECT_EQ(value_diff, 0);
  EXPECT_EQ(byte_diff, 0);
  std::printf("    [%s] re-quantization: %lld tiles with halved scale (max code 224), all others bit-identical\n",
              name.c_str(), static_cast<long long>(halved_tiles));
}

uint16_t bf(float f) { return bf16_trunc(f); }

}  // namespace

TEST(ReferenceQuant, HandComputedV32) {
  const Layout L(KVFormat::kFP8V32, 1, 2);
  StridedTensor<uint16_t> x = make_input(L);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t dim = 0; dim < 576; ++dim) x.at({0, r, 0, dim}) = bf(0.f);
  // Token 0. Tile 0: amax 448 -> scale 1.
  x.at({0, 0, 0, 0}) = bf(448.f);
  x.at({0, 0, 0, 1}) = bf(1.f);
  x.at({0, 0, 0, 2}) = bf(-2.f);
  x.at({0, 0, 0, 3}) = bf(0.5f);
  x.at({0, 0, 0, 4}) = bf(300.f);  // -> 288
  // Tile 1: amax 1 -> s_inv = 1/448, log2 = -8.8 -> scale 2^-8; 1.0 -> 256, -0.5 -> -128.
  x.at({0, 0, 0, 128}) = bf(1.f);
  x.at({0, 0, 0, 129}) = bf(-0.5f);
  // Tile 2: all zero -> clamp 1e-4 -> scale 2^-13. Tile 3: a NaN -> NaN scale.
  x.at({0, 0, 0, 400}) = 0x7FC0;
  for (int k = 0; k < 64; ++k) x.at({0, 0, 0, 512 + k}) = static_cast<uint16_t>(0x3C00 + 37 * k);  // RoPE bits
  // Token 1. Tile 0: amax 14 = 448 * 2^-5 -> scale exactly 2^-5; 14 -> 448.
  x.at({0, 1, 0, 5}) = bf(-14.f);
  x.at({0, 1, 0, 6}) = bf(7.f);

  std::vector<uint8_t> bytes(static_cast<size_t>(L.block_stride), kPadPoison);
  ASSERT_TRUE(ref::quantize_kv_cache(KVFormat::kFP8V32, x.ref(), L.packed_ref(bytes)).ok());
  auto scale_bits = [&](int64_t r, int t) {
    uint32_t u;
    std::memcpy(&u, &bytes[static_cast<size_t>(L.scale_off(0, r) + 4 * t)], 4);
    return u;
  };
  auto q = [&](int64_t r, int64_t dim) { return bytes[static_cast<size_t>(L.nope_off(0, r) + dim)]; };
  EXPECT_EQ(scale_bits(0, 0), 0x3F800000u);  // 1.0
  EXPECT_EQ(scale_bits(0, 1), 0x3B800000u);  // 2^-8
  EXPECT_EQ(scale_bits(0, 2), 0x39000000u);  // 2^-13
  EXPECT_EQ(scale_bits(0, 3) & 0x7F800000u, 0x7F800000u);  // NaN scale
  EXPECT_NE(scale_bits(0, 3) & 0x007FFFFFu, 0u);
  EXPECT_EQ(q(0, 0), 0x7E);
  EXPECT_EQ(q(0, 1), 0x38);
  EXPECT_EQ(q(0, 2), 0xC0);
  EXPECT_EQ(q(0, 3), 0x30);
  EXPECT_EQ(q(0, 4), 0x79);
  EXPECT_EQ(q(0, 5), 0x00);
  EXPECT_EQ(q(0, 128), 0x78);
  EXPECT_EQ(q(0, 129), 0xF0);
  EXPECT_EQ(q(0, 300), 0x00);
  EXPECT_EQ(q(0, 400) & 0x7F, 0x7F);
  EXPECT_EQ(q(0, 401) & 0x7F, 0x7F);  // 0 / NaN scale is NaN as well
  for (int k = 0; k < 64; ++k) {
    uint16_t h;
    std::memcpy(&h, &bytes[static_cast<size_t>(L.rope_off(0, 0) + 2 * k)], 2);
    EXPECT_EQ(h, 0x3C00 + 37 * k);
  }
  EXPECT_EQ(scale_bits(1, 0), 0x3D000000u);  // 2^-5
  EXPECT_EQ(q(1, 5), 0xFE);                  // -448
  EXPECT_EQ(q(1, 6), 0x76);                  // 224
  // Padding token of the block untouched.
  for (int64_t k = 2 * 656; k < 3 * 656; ++k) EXPECT_EQ(bytes[static_cast<size_t>(k)], kPadPoison);
}

TEST(ReferenceQuant, HandComputedModel1) {
  const Layout L(KVFormat::kFP8Model1, 2, 3);
  StridedTensor<uint16_t> x = make_input(L);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t dim = 0; dim < 512; ++dim) x.at({b, r, 0, dim}) = bf(0.25f);
  // Block 1, token 2 (exercises the per-block data-then-scales layout).
  const int64_t B = 1, R = 2;
  x.at({B, R, 0, 0}) = bf(448.f);                          // tile 0: scale 1   -> e8m0 127
  for (int k = 64; k < 128; ++k) x.at({B, R, 0, k}) = bf(1.f);  // tile 1: scale 2^-8 -> 119
  for (int k = 128; k < 192; ++k) x.at({B, R, 0, k}) = bf(0.f);  // tile 2: clamp 2^-13 -> 114
  x.at({B, R, 0, 200}) = 0x7FC0;                            // tile 3: NaN -> 0xFF
  for (int k = 256; k < 320; ++k) x.at({B, R, 0, k}) = bf(0.5f);  // tile 4: 2^-9 -> 118
  for (int k = 320; k < 384; ++k) x.at({B, R, 0, k}) = bf(1e-6f);  // tile 5: clamp -> 114
  x.at({B, R, 0, 384}) = bf(std::ldexp(1.0f, 127));        // tile 6: 2^127/448 -> 2^119 -> 246
  for (int k = 0; k < 64; ++k) x.at({B, R, 0, 448 + k}) = static_cast<uint16_t>(0xBC00 + 11 * k);

  std::vector<uint8_t> bytes(static_cast<size_t>(2 * L.block_stride), kPadPoison);
  ASSERT_TRUE(ref::quantize_kv_cache(KVFormat::kFP8Model1, x.ref(), L.packed_ref(bytes)).ok());
  const uint8_t* scales = &bytes[static_cast<size_t>(B * L.block_stride + 3 * 576 + R * 8)];
  const uint8_t expect_scales[8] = {127, 119, 114, 0xFF, 118, 114, 246, 0};
  for (int t = 0; t < 8; ++t) EXPECT_EQ(scales[t], expect_scales[t]) << t;
  const uint8_t* data = &bytes[static_cast<size_t>(B * L.block_stride + R * 576)];
  EXPECT_EQ(data[0], 0x7E);    // 448
  EXPECT_EQ(data[1], 0x28);    // 0.25 / 1 = 2^-2
  EXPECT_EQ(data[64], 0x78);   // 1 / 2^-8 = 256
  EXPECT_EQ(data[128], 0x00);
  EXPECT_EQ(data[256], 0x78);  // 0.5 / 2^-9 = 256
  EXPECT_EQ(data[384], 0x78);  // 2^127 / 2^119 = 256
  for (int k = 0; k < 64; ++k) {
    uint16_t h;
    std::memcpy(&h, &data[448 + 2 * k], 2);
    EXPECT_EQ(h, 0xBC00 + 11 * k);
  }
}

TEST(ReferenceQuant, V32RandomPage61) { run_random_roundtrip(KVFormat::kFP8V32, 3, 61, 31); }
TEST(ReferenceQuant, V32RandomPage5) { run_random_roundtrip(KVFormat::kFP8V32, 4, 5, 32); }
TEST(ReferenceQuant, Model1RandomPage64) { run_random_roundtrip(KVFormat::kFP8Model1, 3, 64, 33); }
TEST(ReferenceQuant, Model1RandomPage5) { run_random_roundtrip(KVFormat::kFP8Model1, 4, 5, 34); }
