// Tests of reference::sparse_prefill (spec §2.4) against a naive float64 oracle.
//
// Indices mix valid tokens with every invalid kind of FlashMLA's tests (INT_MIN,
// -123456, -1, s_kv, 114514, 1919810, 2147480000, INT_MAX); some rows are
// entirely invalid; topk_length (per query token) is random incl. 0 with garbage
// beyond it, including a *valid* index of a NaN kv row that must never be read.
// attn_sink has +inf / -inf entries. All tensors are strided, outputs poisoned.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "flashmla/ops.h"
#include "reference/reference.h"
#include "reference_test_util.h"

namespace ref = flashmla::reference;
using namespace flashmla;
using namespace flashmla::testing;

namespace {

struct PrefillCase {
  std::string name;
  int64_t s_q, h_q, d_qk, s_kv, topk;
  bool with_sink, with_length;
  float scale;
  uint64_t seed;
};

struct PrefillData {
  StridedTensor<uint16_t> q, kv, out;
  StridedTensor<int32_t> indices, length;
  StridedTensor<float> sink, max_logits, lse;
  SparsePrefillParams params;
  int64_t nan_row = -1;  ///< kv row full of NaN, referenced only beyond topk_length
};

PrefillData make_prefill(const PrefillCase& c) {
  Rng rng(c.seed);
  PrefillData d;
  auto rand_bf16 = [&]() {
    double v;
    do v = rng.normal() / 10 + (rng.uniform(0, 1) - 0.5) / 10;
    while (std::fabs(v) < 1e-4);
    return bf16_trunc(static_cast<float>(v));
  };
  d.q = StridedTensor<uint16_t>(DType::kBFloat16, {c.s_q, c.h_q, c.d_qk}, {1, 1, 128}, kHalfNaN);
  d.kv = StridedTensor<uint16_t>(DType::kBFloat16, {c.s_kv, 1, c.d_qk}, {1, 1, 128}, kHalfNaN);
  for (int64_t s = 0; s < c.s_q; ++s)
    for (int64_t h = 0; h < c.h_q; ++h)
      for (int64_t e = 0; e < c.d_qk; ++e) d.q.at({s, h, e}) = rand_bf16();
  // With topk_length the last kv row is NaN and only referenced beyond the length.
  d.nan_row = c.with_length ? c.s_kv - 1 : -1;
  for (int64_t t = 0; t < c.s_kv; ++t)
    for (int64_t e = 0; e < c.d_qk; ++e) d.kv.at({t, 0, e}) = t == d.nan_row ? kHalfNaN : rand_bf16();

  const int64_t usable = c.with_length ? c.s_kv - 1 : c.s_kv;
  const int32_t invalid[] = {INT_MIN, -123456, -1, static_cast<int32_t>(c.s_kv), 114514, 1919810, kBlockSentinel,
                             INT_MAX};
  d.indices = StridedTensor<int32_t>(DType::kInt32, {c.s_q, 1, c.topk}, {1, 1, 128}, INT_MIN);
  d.length = StridedTensor<int32_t>(DType::kInt32, {c.s_q}, {}, 0);
  for (int64_t s = 0; s < c.s_q; ++s) {
    // Distinct tokens in random order; surplus slots (topk > usable) invalid; a few extra invalid slots.
    std::vector<int32_t> perm(static_cast<size_t>(usable));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.gen);
    std::vector<int32_t> row(static_cast<size_t>(c.topk));
    for (int64_t p = 0; p < c.topk; ++p)
      row[p] = (p < usable && !rng.chance(0.1)) ? perm[p] : invalid[rng.randint(0, 7)];
    std::shuffle(row.begin(), row.end(), rng.gen);
    if (s % 5 == 2) std::fill(row.begin(), row.end(), invalid[rng.randint(0, 7)]);  // whole row invalid
    int64_t len = c.topk;
    if (c.with_length) {
      len = rng.randint(0, c.topk);
      if (s == 0) len = c.topk;
      if (s == 1) len = 0;
      d.length.at({s}) = static_cast<int32_t>(len);
      for (int64_t p = len; p < c.topk; ++p)  // garbage: valid NaN row, in-range indices, invalid values
        row[p] = rng.chance(0.3) ? static_cast<int32_t>(d.nan_row)
                                 : (rng.chance(0.5) ? invalid[rng.randint(0, 7)] : static_cast<int32_t>(rng.randint(0, usable - 1)));
    }
    for (int64_t p = 0; p < c.topk; ++p) d.indices.at({s, 0, p}) = row[p];
  }

  d.sink = StridedTensor<float>(DType::kFloat32, {c.h_q}, {}, 0.f);
  for (int64_t h = 0; h < c.h_q; ++h) d.sink.at({h}) = static_cast<float>(rng.normal() + 3.0);
  d.sink.at({0}) = INFINITY;
  d.sink.at({1}) = -INFINITY;

  d.out = StridedTensor<uint16_t>(DType::kBFloat16, {c.s_q, c.h_q, kDimV}, {1, 1, 8}, kHalfNaN);
  d.max_logits = StridedTensor<float>(DType::kFloat32, {c.s_q, c.h_q}, {1, 1}, f32_nan());
  d.lse = StridedTensor<float>(DType::kFloat32, {c.s_q, c.h_q}, {1, 3}, f32_nan());

  SparsePrefillParams& p = d.params;
  p.q = d.q.ref();
  p.kv = d.kv.ref();
  p.indices = d.indices.ref();
  if (c.with_sink) p.attn_sink = d.sink.ref();
  if (c.with_length) p.topk_length = d.length.ref();
  p.sm_scale = c.scale;
  p.out = d.out.ref();
  p.max_logits = d.max_logits.ref();
  p.lse = d.lse.ref();
  return d;
}

void run_prefill_case(const PrefillCase& c) {
  SCOPED_TRACE(c.name);
  PrefillData d = make_prefill(c);
  const Status st = ref::sparse_prefill(d.params);
  ASSERT_TRUE(st.ok()) << st.message;

  Checker out_check(c.name + " out", kTolOutBf16);
  Checker lse_check(c.name + " lse", kTolLse);
  Checker max_check(c.name + " max_logits", kTolLse);
  int64_t empty_rows = 0;
  for (int64_t s = 0; s < c.s_q; ++s) {
    // Valid slots (spec §2.4): 0 <= idx < s_kv and p < topk_length[s].
    const int64_t n = c.with_length ? d.length.at({s}) : c.topk;
    std::vector<int64_t> rows;
    for (int64_t p = 0; p < n; ++p) {
      const int64_t idx = d.indices.at({s, 0, p});
      if (idx >= 0 && idx < c.s_kv) rows.push_back(idx);
    }
    if (rows.empty()) empty_rows++;
    for (int64_t h = 0; h < c.h_q; ++h) {
      std::vector<double> o(kDimV, 0.0);
      double m = -kInfD, l = kInfD;
      if (!rows.empty()) {
        std::vector<double> sc(rows.size());
        for (size_t j = 0; j < rows.size(); ++j) {
          double acc = 0;
          for (int64_t e = 0; e < c.d_qk; ++e)
            acc += bf16_bits_to_double(d.q.at({s, h, e})) * bf16_bits_to_double(d.kv.at({rows[j], 0, e}));
          sc[j] = acc * c.scale;
          m = std::max(m, sc[j]);
        }
        double sum = 0;
        for (double x : sc) sum += std::exp(x - m);
        l = m + std::log(sum);
        // lse' = ln(exp(lse) + exp(sink)); computed stably as lse + log1p(exp(sink - lse)).
        const double lse_sink = c.with_sink ? l + std::log1p(std::exp(static_cast<double>(d.sink.at({h})) - l)) : l;
        for (size_t j = 0; j < rows.size(); ++j)
          for (int64_t e = 0; e < kDimV; ++e)
            o[e] += std::exp(sc[j] - lse_sink) * bf16_bits_to_double(d.kv.at({rows[j], 0, e}));
      }
      for (int64_t e = 0; e < kDimV; ++e) {
        const double got = bf16_bits_to_double(d.out.at({s, h, e}));
        if (rows.empty()) out_check.check_exact(got, 0.0, at_str(s, h, e));
        else out_check.check(got, o[e], at_str(s, h, e));
      }
      lse_check.check(d.lse.at({s, h}), l, at_str(s, h));
      max_check.check(d.max_logits.at({s, h}), m, at_str(s, h));
    }
  }
  std::printf("    [%s] %lld of %lld query tokens without valid index\n", c.name.c_str(),
              static_cast<long long>(empty_rows), static_cast<long long>(c.s_q));
  EXPECT_GT(empty_rows, 0);
  EXPECT_EQ(d.out.count_modified_padding(kHalfNaN), 0);
  // Float poison is NaN: compare bit patterns through count_modified_padding.
  EXPECT_EQ(d.lse.count_modified_padding(f32_nan()), 0);
  EXPECT_EQ(d.max_logits.count_modified_padding(f32_nan()), 0);
}

}  // namespace

TEST(ReferenceSparsePrefill, D576SinkAndTopkLength) {
  // topk > s_kv: surplus slots are invalid.
  run_prefill_case({"d576 sink+length", 11, 16, 576, 80, 128, true, true, 0.5f, 21});
}

TEST(ReferenceSparsePrefill, D512Heads64Plain) {
  run_prefill_case({"d512 h64 plain", 6, 64, 512, 500, 256, false, false, 0.5f, 22});
}

TEST(ReferenceSparsePrefill, D512SinkOnly) {
  run_prefill_case({"d512 sink", 7, 16, 512, 300, 128, true, false, 0.5f, 23});
}

TEST(ReferenceSparsePrefill, D576LengthOnlySharp) {
  run_prefill_case({"d576 length sharp", 8, 16, 576, 200, 128, false, true, 4.0f, 24});
}

TEST(ReferenceSparsePrefill, DeterministicAcrossThreadCounts) {
  const PrefillCase c{"threads", 9, 32, 576, 150, 128, true, true, 0.5f, 25};
  PrefillData d1 = make_prefill(c), d2 = make_prefill(c);
  flashmla::set_reference_num_threads(1);
  const bool ok1 = ref::sparse_prefill(d1.params).ok();
  flashmla::set_reference_num_threads(4);
  const bool ok2 = ref::sparse_prefill(d2.params).ok();
  flashmla::set_reference_num_threads(0);
  ASSERT_TRUE(ok1 && ok2);
  EXPECT_EQ(d1.out.storage, d2.out.storage);
  EXPECT_EQ(0, std::memcmp(d1.lse.storage.data(), d2.lse.storage.data(), d1.lse.storage.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(d1.max_logits.storage.data(), d2.max_logits.storage.data(),
                           d1.max_logits.storage.size() * sizeof(float)));
}
