// Tests of reference::dense_decode (spec §2.2, §3.1) against a naive float64 oracle.
//
// Every case: random q / cache values (never zeros), NaN in every cache slot that
// is not a valid token of its request (partial last pages, unused pages, spare
// pages), randomly permuted page assignment, block-table entries past the last
// used page set to the sentinel 2147480000, padded (non-contiguous) strides on
// every tensor, outputs poisoned with NaN (including their padding, which must
// stay untouched) and lse written through the transposed (b, h_q, s_q) view that
// FlashMLA returns.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "flashmla/ops.h"
#include "reference/numeric.h"
#include "reference/reference.h"
#include "reference_test_util.h"

namespace ref = flashmla::reference;
using namespace flashmla;
using namespace flashmla::testing;

namespace {

struct DenseCase {
  std::string name;
  int64_t s_q, h_q, h_kv, d_qk, pbs;
  bool fp16, causal;
  std::vector<int32_t> seqlens;  // b = seqlens.size()
  float scale;
  uint64_t seed;
};

struct DenseData {
  StridedTensor<uint16_t> q, k_cache, out;
  StridedTensor<int32_t> block_table, cache_seqlens;
  StridedTensor<float> lse;
  DenseDecodeParams params;
};

DenseData make_dense(const DenseCase& c) {
  Rng rng(c.seed);
  const int64_t b = static_cast<int64_t>(c.seqlens.size());
  const DType dt = c.fp16 ? DType::kFloat16 : DType::kBFloat16;
  auto to_half = [&](double v) {
    return c.fp16 ? ref::float_to_fp16(static_cast<float>(v)) : bf16_trunc(static_cast<float>(v));
  };
  auto nonzero_uniform = [&](double lo, double hi) {
    double v;
    do v = rng.uniform(lo, hi);
    while (std::fabs(v) < 1e-3);
    return v;
  };

  std::vector<int64_t> pages(static_cast<size_t>(b));
  int64_t used_pages = 0, max_pages = 0;
  for (int64_t i = 0; i < b; ++i) {
    pages[i] = (c.seqlens[i] + c.pbs - 1) / c.pbs;
    used_pages += pages[i];
    max_pages = std::max(max_pages, pages[i]);
  }
  const int64_t num_blocks = used_pages + 3;     // 3 spare NaN pages belonging to nobody
  const int64_t max_blocks_per_seq = max_pages + 2;  // always some sentinel columns

  DenseData d;
  d.k_cache = StridedTensor<uint16_t>(dt, {num_blocks, c.pbs, c.h_kv, c.d_qk}, {1, 1, 1, 8}, kHalfNaN);
  d.block_table = StridedTensor<int32_t>(DType::kInt32, {b, max_blocks_per_seq}, {1, 3}, kBlockSentinel);
  d.cache_seqlens = StridedTensor<int32_t>(DType::kInt32, {b}, {}, 0);
  d.q = StridedTensor<uint16_t>(dt, {b, c.s_q, c.h_q, c.d_qk}, {1, 1, 1, 128}, kHalfNaN);
  d.out = StridedTensor<uint16_t>(dt, {b, c.s_q, c.h_q, kDimV}, {1, 1, 1, 16}, kHalfNaN);
  // FlashMLA returns lse as a transposed view: shape (b, h_q, s_q), strides (s_q*h_q, 1, h_q).
  d.lse = StridedTensor<float>::with_strides(DType::kFloat32, {b, c.h_q, c.s_q}, {c.s_q * c.h_q, 1, c.h_q}, f32_nan());

  // Random physical page assignment.
  std::vector<int32_t> perm(static_cast<size_t>(num_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.gen);
  int64_t next = 0;
  for (int64_t i = 0; i < b; ++i) {
    d.cache_seqlens.at({i}) = c.seqlens[i];
    for (int64_t j = 0; j < pages[i]; ++j) d.block_table.at({i, j}) = perm[next++];
    for (int64_t t = 0; t < c.seqlens[i]; ++t) {
      const int64_t blk = d.block_table.at({i, t / c.pbs});
      for (int64_t g = 0; g < c.h_kv; ++g)
        for (int64_t e = 0; e < c.d_qk; ++e) d.k_cache.at({blk, t % c.pbs, g, e}) = to_half(nonzero_uniform(-1, 1));
    }
  }
  for (int64_t i = 0; i < b; ++i)
    for (int64_t r = 0; r < c.s_q; ++r)
      for (int64_t h = 0; h < c.h_q; ++h)
        for (int64_t e = 0; e < c.d_qk; ++e) d.q.at({i, r, h, e}) = to_half(nonzero_uniform(-1, 1));

  DenseDecodeParams& p = d.params;
  p.q = d.q.ref();
  p.k_cache = d.k_cache.ref();
  p.block_table = d.block_table.ref();
  p.cache_seqlens = d.cache_seqlens.ref();
  p.softmax_scale = c.scale;
  p.causal = c.causal;
  p.out = d.out.ref();
  p.lse = d.lse.ref();
  return d;
}

/// Naive float64 oracle of spec §2.2 for one (i, r, h): out (512) and lse.
void dense_oracle(const DenseCase& c, const DenseData& d, int64_t i, int64_t r, int64_t h, std::vector<double>& out,
                  double& lse) {
  auto val = [&](uint16_t bits) { return c.fp16 ? fp16_bits_to_double(bits) : bf16_bits_to_double(bits); };
  const int64_t s_k = c.seqlens[i];
  const int64_t g = h / (c.h_q / c.h_kv);
  std::vector<int64_t> keys;
  for (int64_t t = 0; t < s_k; ++t) {
    const bool visible = !(c.causal && c.s_q > 1) || t <= s_k - c.s_q + r;
    if (visible) keys.push_back(t);
  }
  out.assign(kDimV, 0.0);
  lse = kInfD;
  if (keys.empty()) return;
  std::vector<double> score(keys.size());
  double m = -kInfD;
  for (size_t j = 0; j < keys.size(); ++j) {
    const int64_t t = keys[j];
    const int64_t blk = d.block_table.at({i, t / c.pbs});
    double acc = 0;
    for (int64_t e = 0; e < c.d_qk; ++e) acc += val(d.q.at({i, r, h, e})) * val(d.k_cache.at({blk, t % c.pbs, g, e}));
    score[j] = acc * c.scale;
    m = std::max(m, score[j]);
  }
  double sum = 0;
  for (double s : score) sum += std::exp(s - m);
  lse = m + std::log(sum);
  for (size_t j = 0; j < keys.size(); ++j) {
    const int64_t t = keys[j];
    const int64_t blk = d.block_table.at({i, t / c.pbs});
    const double w = std::exp(score[j] - lse);
    for (int64_t e = 0; e < kDimV; ++e) out[e] += w * val(d.k_cache.at({blk, t % c.pbs, g, e}));
  }
}

void run_dense_case(const DenseCase& c) {
  SCOPED_TRACE(c.name);
  DenseData d = make_dense(c);
  const Status st = ref::dense_decode(d.params);
  ASSERT_TRUE(st.ok()) << st.message;

  const int64_t b = static_cast<int64_t>(c.seqlens.size());
  Checker out_check(c.name + " out", c.fp16 ? kTolOutFp16 : kTolOutBf16);
  Checker lse_check(c.name + " lse", kTolLse);
  std::vector<double> o;
  double lse;
  int64_t empty_rows = 0;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t r = 0; r < c.s_q; ++r)
      for (int64_t h = 0; h < c.h_q; ++h) {
        dense_oracle(c, d, i, r, h, o, lse);
        const bool empty = std::isinf(lse);
        empty_rows += empty;
        for (int64_t e = 0; e < kDimV; ++e) {
          const uint16_t bits = d.out.at({i, r, h, e});
          const double got = c.fp16 ? fp16_bits_to_double(bits) : bf16_bits_to_double(bits);
          if (empty) out_check.check_exact(got, 0.0, at_str(i, r, h, e));
          else out_check.check(got, o[e], at_str(i, r, h, e));
        }
        lse_check.check(d.lse.at({i, h, r}), lse, at_str(i, h, r));
      }
  std::printf("    [%s] %lld of %lld rows have no visible key\n", c.name.c_str(), static_cast<long long>(empty_rows),
              static_cast<long long>(b * c.s_q * c.h_q));
  EXPECT_EQ(d.out.count_modified_padding(kHalfNaN), 0) << "writes outside the out view";
}

}  // namespace

TEST(ReferenceDenseDecode, Bf16D576Page64NonCausal) {
  run_dense_case({"bf16 d576 pbs64", 1, 16, 1, 576, 64, false, false, {130, 0, 64, 1, 200}, 1.f / 24.f, 1});
}

TEST(ReferenceDenseDecode, Bf16GqaCausalPage61) {
  // s_q = 4 causal: requests shorter than s_q have rows without any visible key.
  run_dense_case({"bf16 gqa causal pbs61", 4, 9, 3, 576, 61, false, true, {0, 2, 3, 130, 61, 4}, 0.3f, 2});
}

TEST(ReferenceDenseDecode, Bf16CausalSingleTokenIgnoresMask) {
  // s_q == 1: causal is a no-op (spec §2.2).
  run_dense_case({"bf16 causal s_q=1", 1, 8, 2, 576, 16, false, true, {33, 1, 0}, 0.2f, 3});
}

TEST(ReferenceDenseDecode, Fp16D512Page16Causal) {
  run_dense_case({"fp16 d512 pbs16 causal", 3, 8, 2, 512, 16, true, true, {47, 0, 16, 2, 100}, 0.5f, 4});
}

TEST(ReferenceDenseDecode, Fp16SharpSoftmax) {
  // Large scale: the softmax is dominated by a few keys (exercises max subtraction).
  run_dense_case({"fp16 sharp", 2, 4, 4, 576, 64, true, false, {70, 129}, 2.0f, 5});
}

TEST(ReferenceDenseDecode, AllRequestsEmpty) {
  run_dense_case({"all empty", 2, 6, 2, 576, 64, false, true, {0, 0, 0}, 0.04f, 6});
}

TEST(ReferenceDenseDecode, LongSequenceManyPages) {
  run_dense_case({"long", 2, 16, 1, 576, 64, false, true, {1000, 777}, 1.f / 24.f, 7});
}

TEST(ReferenceDenseDecode, DeterministicAcrossThreadCounts) {
  const DenseCase c{"threads", 3, 12, 3, 576, 61, false, true, {150, 3, 90}, 0.3f, 8};
  DenseData d1 = make_dense(c), d2 = make_dense(c);
  flashmla::set_reference_num_threads(1);
  const bool ok1 = ref::dense_decode(d1.params).ok();
  flashmla::set_reference_num_threads(5);
  const bool ok2 = ref::dense_decode(d2.params).ok();
  flashmla::set_reference_num_threads(0);
  ASSERT_TRUE(ok1 && ok2);
  EXPECT_EQ(d1.out.storage, d2.out.storage);
  EXPECT_EQ(0, std::memcmp(d1.lse.storage.data(), d2.lse.storage.data(), d1.lse.storage.size() * sizeof(float)));
}
