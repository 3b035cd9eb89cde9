// Tests of src/reference/numeric.h (bf16/fp16/e4m3/e8m0 conversions) and
// src/reference/thread_pool.h (parallel_for, reference_num_threads) and attend_rows's NaN handling.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "flashmla/ops.h"
#include "reference/attention_core.h"
#include "reference/numeric.h"
#include "reference/thread_pool.h"
#include "reference_test_util.h"

namespace ref = flashmla::reference;
using flashmla::testing::e4m3_bits_to_double;
using flashmla::testing::fp16_bits_to_double;
using flashmla::testing::Rng;
using flashmla::testing::e4m3_brute_force;

namespace {

float bits_f(uint32_t u) { return ref::f32_from_bits(u); }

}  // namespace

TEST(ReferenceNumeric, Bf16RoundToNearestEven) {
  EXPECT_EQ(ref::float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(ref::float_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(ref::float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(ref::float_to_bf16(bits_f(0x3F808000)), 0x3F80);  // tie -> even (down)
  EXPECT_EQ(ref::float_to_bf16(bits_f(0x3F818000)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(ref::float_to_bf16(bits_f(0x3F808001)), 0x3F81);  // just above the tie
  EXPECT_EQ(ref::float_to_bf16(bits_f(0x3F807FFF)), 0x3F80);  // just below the tie
  EXPECT_EQ(ref::float_to_bf16(INFINITY), 0x7F80);
  EXPECT_EQ(ref::float_to_bf16(-INFINITY), 0xFF80);
  EXPECT_EQ(ref::float_to_bf16(bits_f(0x7F7FFFFF)), 0x7F80);  // FLT_MAX overflows to inf
  EXPECT_EQ(ref::float_to_bf16(bits_f(0x00010000)), 0x0001);  // subnormal kept
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(ref::float_to_bf16(NAN))));
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(ref::float_to_bf16(bits_f(0x7F800001)))));  // payload in low bits
  // Every non-NaN bf16 value round-trips.
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = ref::bf16_to_float(static_cast<uint16_t>(h));
    const double expect = flashmla::testing::bf16_bits_to_double(static_cast<uint16_t>(h));
    if (std::isnan(expect)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_TRUE(std::isnan(ref::bf16_to_float(ref::float_to_bf16(f)))) << h;  // NaN stays NaN
      continue;
    }
    ASSERT_EQ(f, expect) << h;
    ASSERT_EQ(ref::float_to_bf16(f), h);
  }
}

TEST(ReferenceNumeric, Fp16Conversions) {
  EXPECT_EQ(ref::float_to_fp16(1.0f), 0x3C00);
  EXPECT_EQ(ref::float_to_fp16(-2.0f), 0xC000);
  EXPECT_EQ(ref::float_to_fp16(65504.0f), 0x7BFF);
  EXPECT_EQ(ref::float_to_fp16(65519.0f), 0x7BFF);
  EXPECT_EQ(ref::float_to_fp16(65520.0f), 0x7C00);  // tie at the top rounds to inf
  EXPECT_EQ(ref::float_to_fp16(1e10f), 0x7C00);
  EXPECT_EQ(ref::float_to_fp16(-INFINITY), 0xFC00);
  EXPECT_EQ(ref::float_to_fp16(std::ldexp(1.0f, -14)), 0x0400);       // smallest normal
  EXPECT_EQ(ref::float_to_fp16(std::ldexp(1.0f, -24)), 0x0001);       // smallest subnormal
  EXPECT_EQ(ref::float_to_fp16(std::ldexp(1.0f, -25)), 0x0000);       // tie -> even (0)
  EXPECT_EQ(ref::float_to_fp16(std::ldexp(3.0f, -25)), 0x0002);       // tie -> even (2)
  EXPECT_EQ(ref::float_to_fp16(std::ldexp(1023.5f, -24)), 0x0400);    // subnormal rounds up to normal
  EXPECT_EQ(ref::float_to_fp16(1.0f / 3.0f), 0x3555);
  EXPECT_TRUE(std::isnan(ref::fp16_to_float(ref::float_to_fp16(NAN))));
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = ref::fp16_to_float(static_cast<uint16_t>(h));
    const double expect = fp16_bits_to_double(static_cast<uint16_t>(h));
    if (std::isnan(expect)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      continue;
    }
    ASSERT_EQ(f, expect) << h;
    ASSERT_EQ(ref::float_to_fp16(f), h);
  }
  // Random floats: the result is a nearest fp16 value, ties to even.
  Rng rng(7);
  for (int n = 0; n < 200000; ++n) {
    const float x = static_cast<float>(std::ldexp(rng.uniform(-1, 1), static_cast<int>(rng.randint(-27, 16))));
    const uint16_t h = ref::float_to_fp16(x);
    const double v = fp16_bits_to_double(h);
    if (std::isinf(v)) {
      ASSERT_GE(std::fabs(x), 65520.0f);
      continue;
    }
    const double err = std::fabs(v - x);
    for (int step : {-1, 1}) {
      const uint16_t nb = static_cast<uint16_t>(h + step);
      if (((nb >> 10) & 0x1F) == 0x1F || ((h & 0x7FFF) == 0 && step < 0)) continue;
      const double e2 = std::fabs(fp16_bits_to_double(nb) - x);
      ASSERT_TRUE(err < e2 || (err == e2 && (h % 2 == 0))) << x;
    }
  }
}

TEST(ReferenceNumeric, E4m3DecodeAllCodes) {
  EXPECT_EQ(ref::e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(ref::e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(ref::e4m3_to_float(0xC0), -2.0f);
  EXPECT_EQ(ref::e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(ref::e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(ref::e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(ref::e4m3_to_float(0xFF)));
  EXPECT_TRUE(std::signbit(ref::e4m3_to_float(0x80)));
  for (int c = 0; c < 256; ++c) {
    const double expect = e4m3_bits_to_double(static_cast<uint8_t>(c));
    const float got = ref::e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(expect)) EXPECT_TRUE(std::isnan(got)) << c;
    else EXPECT_EQ(got, expect) << c;
  }
}

TEST(ReferenceNumeric, E4m3EncodeMatchesPyTorchCast) {
  // Hand-computed bytes.
  EXPECT_EQ(ref::float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(ref::float_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(ref::float_to_e4m3(-2.0f), 0xC0);
  EXPECT_EQ(ref::float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(ref::float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(ref::float_to_e4m3(256.0f), 0x78);
  EXPECT_EQ(ref::float_to_e4m3(std::ldexp(1.0f, -9)), 0x01);
  EXPECT_EQ(ref::float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);        // tie -> even (0)
  EXPECT_EQ(ref::float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);        // tie -> even (2)
  EXPECT_EQ(ref::float_to_e4m3(464.0f), 0x7E);                      // tie between 448 and "480" -> 448
  EXPECT_EQ(ref::float_to_e4m3(464.5f), 0x7F);                      // non-saturating: NaN
  EXPECT_EQ(ref::float_to_e4m3(480.0f), 0x7F);
  EXPECT_EQ(ref::float_to_e4m3(-1e9f), 0xFF);
  EXPECT_EQ(ref::float_to_e4m3(INFINITY), 0x7F);
  EXPECT_EQ(ref::float_to_e4m3(NAN), 0x7F);
  // Every finite code round-trips.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    ASSERT_EQ(ref::float_to_e4m3(ref::e4m3_to_float(static_cast<uint8_t>(c))), c);
  }
  // Every bf16 value, and the exact midpoints between adjacent codes (+- 1 float ulp).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float x = ref::bf16_to_float(static_cast<uint16_t>(h));
    ASSERT_EQ(ref::float_to_e4m3(x), e4m3_brute_force(x)) << x;
  }
  for (int c = 0; c < 0x7E; ++c) {
    const float mid = static_cast<float>(
        (e4m3_bits_to_double(static_cast<uint8_t>(c)) + e4m3_bits_to_double(static_cast<uint8_t>(c + 1))) / 2);
    for (float x : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1000.f), -mid}) {
      ASSERT_EQ(ref::float_to_e4m3(x), e4m3_brute_force(x)) << x;
    }
  }
  Rng rng(11);
  for (int n = 0; n < 100000; ++n) {
    const float x = static_cast<float>(std::ldexp(rng.uniform(-1, 1), static_cast<int>(rng.randint(-12, 10))));
    ASSERT_EQ(ref::float_to_e4m3(x), e4m3_brute_force(x)) << x;
  }
}

TEST(ReferenceNumeric, E8m0) {
  EXPECT_EQ(ref::e8m0_to_float(127), 1.0f);
  EXPECT_EQ(ref::e8m0_to_float(114), std::ldexp(1.0f, -13));
  EXPECT_EQ(ref::e8m0_to_float(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(ref::e8m0_to_float(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(ref::e8m0_to_float(255)));
  for (int e = 0; e < 255; ++e) EXPECT_EQ(ref::float_to_e8m0(ref::e8m0_to_float(static_cast<uint8_t>(e))), e);
  EXPECT_EQ(ref::float_to_e8m0(NAN), 0xFF);
  EXPECT_EQ(ref::float_to_e8m0(INFINITY), 0xFF);
}

TEST(ReferenceThreadPool, EveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 8}) {
    for (int64_t n : {0, 1, 2, 7, 1000, 100003}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      for (auto& h : hits) h = 0;
      ref::parallel_for(n, [&](int64_t i) { hits[static_cast<size_t>(i)]++; }, threads);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << n << " " << i;
    }
  }
}

TEST(ReferenceThreadPool, ExceptionReachesCaller) {
  EXPECT_THROW(ref::parallel_for(
                   1000, [](int64_t i) { if (i == 517) throw std::runtime_error("boom"); }, 4),
               std::runtime_error);
  EXPECT_THROW(ref::parallel_for(
                   10, [](int64_t i) { if (i == 3) throw std::runtime_error("boom"); }, 1),
               std::runtime_error);
}

TEST(ReferenceThreadPool, NumThreadsFromEnvironmentValue) {
  std::string w;
  EXPECT_EQ(ref::threads_from_env(nullptr, 7, &w), 7);
  EXPECT_TRUE(w.empty());
  EXPECT_EQ(ref::threads_from_env("3", 7, &w), 3);
  EXPECT_TRUE(w.empty());
  EXPECT_EQ(ref::threads_from_env("100000", 7, &w), ref::kMaxThreads);
  EXPECT_TRUE(w.empty());
  for (const char* bad : {"0", "-3", "abc", "", "4x", "99999999999999999999999"}) {
    w.clear();
    EXPECT_EQ(ref::threads_from_env(bad, 7, &w), 7) << bad;
    EXPECT_NE(w.find(std::string("FLASHMLA_NUM_THREADS='") + bad + "'"), std::string::npos) << w;
    EXPECT_NE(w.find("7 threads"), std::string::npos) << w;
  }
  EXPECT_EQ(ref::threads_from_env("abc", 5, nullptr), 5);
}

TEST(ReferenceThreadPool, SetNumThreads) {
  const int dflt = flashmla::reference_num_threads();
  EXPECT_GE(dflt, 1);
  flashmla::set_reference_num_threads(3);
  EXPECT_EQ(flashmla::reference_num_threads(), 3);
  flashmla::set_reference_num_threads(5000);
  EXPECT_EQ(flashmla::reference_num_threads(), ref::kMaxThreads);
  flashmla::set_reference_num_threads(0);
  EXPECT_EQ(flashmla::reference_num_threads(), dflt);
  // The environment is read once: changing it later has no effect.
  setenv("FLASHMLA_NUM_THREADS", dflt == 3 ? "4" : "3", 1);
  EXPECT_EQ(flashmla::reference_num_threads(), dflt);
  unsetenv("FLASHMLA_NUM_THREADS");
  flashmla::set_reference_num_threads(-2);
  EXPECT_EQ(flashmla::reference_num_threads(), dflt);
}

// NaN in, NaN out (attend_rows, shared by the three reference operators): a NaN in a query row makes
// that row's out / lse / max_logit NaN and leaves the other rows alone; a NaN in a used key makes
// every row NaN; a row without keys keeps out = 0, lse = +inf, max_logit = -inf whatever q holds.
TEST(ReferenceAttendRows, NaNPropagates) {
  const int64_t heads = 3, d = 4, dv = 2, n = 5;
  std::vector<float> q(heads * d), keys(n * d);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.1f * static_cast<float>(i % 7) - 0.2f;
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = 0.05f * static_cast<float>(i % 11) - 0.3f;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  q[1 * d + 2] = nan;  // head 1's query
  auto run = [&](int64_t nk, std::vector<float>& out, std::vector<float>& lse, std::vector<float>& mx) {
    out.assign(heads * dv, -7.f);
    lse.assign(heads, -7.f);
    mx.assign(heads, -7.f);
    ref::attend_rows(heads, d, dv, q.data(), 0.5f, nk,
                     [&](int64_t j, float* dst) { std::copy_n(keys.data() + j * d, d, dst); }, out.data(), lse.data(),
                     mx.data());
  };
  std::vector<float> out, lse, mx;
  run(n, out, lse, mx);
  for (int64_t h = 0; h < heads; ++h) {
    const bool expect_nan = h == 1;
    EXPECT_EQ(std::isnan(lse[h]), expect_nan) << h;
    EXPECT_EQ(std::isnan(mx[h]), expect_nan) << h;
    for (int64_t c = 0; c < dv; ++c) EXPECT_EQ(std::isnan(out[h * dv + c]), expect_nan) << h;
    if (!expect_nan) {
      EXPECT_TRUE(std::isfinite(lse[h]) && std::isfinite(mx[h]));
    }
  }
  run(0, out, lse, mx);  // no keys: the empty-row convention, NaN query or not
  for (int64_t h = 0; h < heads; ++h) {
    EXPECT_EQ(lse[h], std::numeric_limits<float>::infinity());
    EXPECT_EQ(mx[h], -std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < dv; ++c) EXPECT_EQ(out[h * dv + c], 0.f);
  }
  q[1 * d + 2] = 0.3f;
  keys[3 * d + 1] = nan;  // a used key (its score, not only its V part)
  run(n, out, lse, mx);
  for (int64_t h = 0; h < heads; ++h) EXPECT_TRUE(std::isnan(lse[h]) && std::isnan(mx[h]) && std::isnan(out[h * dv]));
  run(3, out, lse, mx);  // key 3 not used: finite
  for (int64_t h = 0; h < heads; ++h) EXPECT_TRUE(std::isfinite(lse[h]) && std::isfinite(out[h * dv]));
}

// An inf in a query row (+inf or -inf, one element): the row's scores are +inf and -inf (NaN where a key's
// element is 0), so its softmax is undefined: out, lse and max_logit NaN (max_logit not the +inf row maximum,
// as the GPU kernels' row_max_or_nan), the other rows untouched. Against keys whose element in that dimension
// has one sign only, every score is -inf (q -inf, keys > 0): the row stays an empty row (out 0, lse +inf,
// max_logit -inf), as the decode and sparse prefill kernels give for a row sum of 0.
TEST(ReferenceAttendRows, InfInQueryGivesNaN) {
  const int64_t heads = 3, d = 4, dv = 2, n = 5;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> keys(n * d);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < d; ++c) keys[j * d + c] = 0.05f * static_cast<float>(j + 1) * (c == 1 ? 1.f : -1.f) +
                                                     (j % 2 ? 0.12f : -0.12f) * static_cast<float>(c == 2);
  // dim 1: every key > 0; dim 2: keys of both signs, none 0 (-0.17, 0.02, -0.27, -0.08, -0.37)
  auto run = [&](const std::vector<float>& q, std::vector<float>& out, std::vector<float>& lse,
                 std::vector<float>& mx) {
    out.assign(heads * dv, -7.f);
    lse.assign(heads, -7.f);
    mx.assign(heads, -7.f);
    ref::attend_rows(heads, d, dv, q.data(), 0.5f, n,
                     [&](int64_t j, float* dst) { std::copy_n(keys.data() + j * d, d, dst); }, out.data(), lse.data(),
                     mx.data());
  };
  std::vector<float> q0(heads * d);
  for (size_t i = 0; i < q0.size(); ++i) q0[i] = 0.1f * static_cast<float>(i % 7) - 0.2f;
  std::vector<float> out0, lse0, mx0, out, lse, mx;
  run(q0, out0, lse0, mx0);
  for (const float v : {inf, -inf}) {
    std::vector<float> q = q0;
    q[1 * d + 2] = v;  // head 1, dim 2: scores of both signs
    run(q, out, lse, mx);
    for (int64_t h = 0; h < heads; ++h) {
      if (h == 1) {
        EXPECT_TRUE(std::isnan(lse[h]) && std::isnan(mx[h])) << v << " lse " << lse[h] << " max " << mx[h];
        for (int64_t c = 0; c < dv; ++c) EXPECT_TRUE(std::isnan(out[h * dv + c])) << v;
      } else {
        EXPECT_EQ(lse[h], lse0[h]);
        EXPECT_EQ(mx[h], mx0[h]);
        for (int64_t c = 0; c < dv; ++c) EXPECT_EQ(out[h * dv + c], out0[h * dv + c]);
      }
    }
  }
  std::vector<float> q = q0;
  q[1 * d + 1] = inf;  // dim 1, every key > 0: every score +inf, no NaN: NaN (exp(inf - inf))
  run(q, out, lse, mx);
  EXPECT_TRUE(std::isnan(lse[1]) && std::isnan(mx[1]) && std::isnan(out[1 * dv]));
  q[1 * d + 1] = -inf;  // every score -inf: the empty row
  run(q, out, lse, mx);
  EXPECT_EQ(lse[1], inf);
  EXPECT_EQ(mx[1], -inf);
  for (int64_t c = 0; c < dv; ++c) EXPECT_EQ(out[1 * dv + c], 0.f);
}
