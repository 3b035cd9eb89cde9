// Tests of reference::sparse_decode (spec §2.3, §3.2-§3.4) against a naive float64
// oracle that decodes the FP8 byte formats on its own.
//
// The packed caches are built byte by byte here (random e4m3 codes, random
// power-of-two scales, random bf16 RoPE) so these tests do not depend on the
// quantizer. Every byte that no valid slot refers to is 0xFF (NaN as e4m3, as a
// float32 scale, as an e8m0 scale and as bf16), including the block padding.
// Indices contain -1, duplicates, whole rows of -1, and — beyond topk_length —
// garbage (INT_MAX, INT_MIN, the sentinel, out-of-range values and a valid index
// pointing at a NaN token). attn_sink has +inf and -inf entries.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
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

/// Packed FP8 cache with its own (independent) implementation of the byte layouts.
struct PackedCache {
  KVFormat fmt = KVFormat::kFP8V32;
  int64_t num_blocks = 0, pbs = 0, block_stride = 0, bpt = 0;
  std::vector<uint8_t> bytes;

  PackedCache(KVFormat f, int64_t nb, int64_t page) : fmt(f), num_blocks(nb), pbs(page) {
    if (fmt == KVFormat::kFP8V32) {
      bpt = 656;
      block_stride = (pbs + 1) * 656;  // one padding token per block, like FlashMLA's tests
    } else {
      bpt = 584;
      block_stride = (pbs * 584 + 575) / 576 * 576;  // padded to a multiple of 576 bytes
    }
    bytes.assign(static_cast<size_t>(num_blocks * block_stride), 0xFF);
  }
  bool model1() const { return fmt == KVFormat::kFP8Model1; }
  int64_t d_qk() const { return model1() ? 512 : 576; }
  int64_t nope() const { return model1() ? 448 : 512; }
  int64_t tile() const { return model1() ? 64 : 128; }
  int64_t num_tokens() const { return num_blocks * pbs; }
  int64_t token_base(int64_t idx) const {  // V32 token record / MODEL1 data record
    const int64_t blk = idx / pbs, row = idx % pbs;
    return blk * block_stride + row * (model1() ? 576 : 656);
  }
  int64_t scale_off(int64_t idx) const {
    const int64_t blk = idx / pbs, row = idx % pbs;
    return model1() ? blk * block_stride + pbs * 576 + row * 8 : token_base(idx) + 512;
  }
  int64_t rope_off(int64_t idx) const { return token_base(idx) + (model1() ? 448 : 528); }

  TensorRef ref() const {
    TensorRef r = make_tensor_ref(const_cast<uint8_t*>(bytes.data()), DType::kFloat8E4M3,
                                  {num_blocks, pbs, 1, bpt}, {block_stride, bpt, bpt, 1});
    return r;
  }

  void write_random_token(int64_t idx, Rng& rng) {
    for (int64_t d = 0; d < nope(); ++d) {
      uint8_t code;
      do code = static_cast<uint8_t>(rng.randint(0, 255));
      while ((code & 0x7F) == 0x7F || (code & 0x7F) == 0);  // no NaN, no zero
      bytes[static_cast<size_t>(token_base(idx) + d)] = code;
    }
    for (int64_t t = 0; t < nope() / tile(); ++t) {
      const int k = static_cast<int>(rng.randint(-10, -8));
      if (model1()) {
        bytes[static_cast<size_t>(scale_off(idx) + t)] = static_cast<uint8_t>(127 + k);
      } else {
        const float s = std::ldexp(1.0f, k);
        std::memcpy(&bytes[static_cast<size_t>(scale_off(idx) + 4 * t)], &s, 4);
      }
    }
    for (int64_t d = 0; d < 64; ++d) {
      double v;
      do v = rng.uniform(-1, 1);
      while (std::fabs(v) < 1e-3);
      const uint16_t h = bf16_trunc(static_cast<float>(v));
      std::memcpy(&bytes[static_cast<size_t>(rope_off(idx) + 2 * d)], &h, 2);
    }
  }

  /// Dequantized key (spec §3.3/§3.4): d_qk doubles.
  std::vector<double> dequant(int64_t idx) const {
    std::vector<double> k(static_cast<size_t>(d_qk()));
    for (int64_t d = 0; d < nope(); ++d) {
      const int64_t t = d / tile();
      double scale;
      if (model1()) {
        scale = e8m0_bits_to_double(bytes[static_cast<size_t>(scale_off(idx) + t)]);
      } else {
        float s;
        std::memcpy(&s, &bytes[static_cast<size_t>(scale_off(idx) + 4 * t)], 4);
        scale = s;
      }
      k[d] = e4m3_bits_to_double(bytes[static_cast<size_t>(token_base(idx) + d)]) * scale;
    }
    for (int64_t d = 0; d < 64; ++d) {
      uint16_t h;
      std::memcpy(&h, &bytes[static_cast<size_t>(rope_off(idx) + 2 * d)], 2);
      k[nope() + d] = bf16_bits_to_double(h);
    }
    return k;
  }
};

struct ScopeSpec {
  int64_t pbs, num_blocks, topk;
  bool with_length;
};

/// One KV scope (main or extra): cache, indices (b, s_q, topk), optional lengths (b,).
struct Scope {
  PackedCache cache;
  StridedTensor<int32_t> indices, length;
  bool with_length = false;
  int64_t topk = 0;

  Scope(KVFormat fmt, const ScopeSpec& s) : cache(fmt, s.num_blocks, s.pbs), with_length(s.with_length), topk(s.topk) {}

  int64_t valid_len(int64_t i) const {
    return with_length ? std::clamp<int64_t>(length.at({i}), 0, topk) : topk;
  }
  /// Oracle validity of slot p of row (i, r): spec §2.3.
  bool slot_valid(int64_t i, int64_t r, int64_t p) const {
    return p < valid_len(i) && indices.at({i, r, p}) != -1;
  }
};

Scope make_scope(KVFormat fmt, const ScopeSpec& spec, int64_t b, int64_t s_q, bool empty_last_row, Rng& rng) {
  Scope sc(fmt, spec);
  const int64_t n_tok = sc.cache.num_tokens();
  const int64_t poison_token = n_tok - 1;  // never written: stays NaN
  sc.indices = StridedTensor<int32_t>(DType::kInt32, {b, s_q, spec.topk}, {1, 1, 5}, INT_MIN);
  sc.length = StridedTensor<int32_t>(DType::kInt32, {b}, {}, 0);
  if (spec.with_length) {
    for (int64_t i = 0; i < b; ++i) sc.length.at({i}) = static_cast<int32_t>(rng.randint(0, spec.topk));
    sc.length.at({0}) = static_cast<int32_t>(spec.topk);
    if (b > 1) sc.length.at({b - 1}) = 0;
  }
  const int32_t garbage[] = {INT_MAX, INT_MIN, kBlockSentinel, static_cast<int32_t>(poison_token), -1,
                             static_cast<int32_t>(n_tok + 7), -123456};
  for (int64_t i = 0; i < b; ++i)
    for (int64_t r = 0; r < s_q; ++r)
      for (int64_t p = 0; p < spec.topk; ++p) {
        int32_t v;
        if (p >= sc.valid_len(i)) v = garbage[rng.randint(0, 6)];
        else if (rng.chance(0.2)) v = -1;
        else v = static_cast<int32_t>(rng.randint(0, n_tok - 2));
        sc.indices.at({i, r, p}) = v;
      }
  // A duplicated valid index (counts twice) and a row made only of -1.
  if (sc.valid_len(0) >= 2) {
    sc.indices.at({0, 0, 0}) = 5;
    sc.indices.at({0, 0, 1}) = 5;
  }
  if (empty_last_row)
    for (int64_t p = 0; p < spec.topk; ++p) sc.indices.at({b - 1, s_q - 1, p}) = -1;

  // Write only the tokens referenced by valid slots; all other bytes stay NaN.
  std::vector<char> written(static_cast<size_t>(n_tok), 0);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t r = 0; r < s_q; ++r)
      for (int64_t p = 0; p < spec.topk; ++p) {
        if (!sc.slot_valid(i, r, p)) continue;
        const int64_t idx = sc.indices.at({i, r, p});
        if (!written[idx]) sc.cache.write_random_token(idx, rng);
        written[idx] = 1;
      }
  return sc;
}

struct SparseDecodeCase {
  std::string name;
  KVFormat fmt;
  int64_t b, s_q, h_q;
  ScopeSpec main;
  bool with_extra;
  ScopeSpec extra;
  bool with_sink;
  float scale;
  uint64_t seed;
};

void run_sparse_decode_case(const SparseDecodeCase& c) {
  SCOPED_TRACE(c.name);
  Rng rng(c.seed);
  const int64_t d_qk = c.fmt == KVFormat::kFP8Model1 ? 512 : 576;
  Scope main_scope = make_scope(c.fmt, c.main, c.b, c.s_q, true, rng);
  Scope extra_scope = c.with_extra ? make_scope(c.fmt, c.extra, c.b, c.s_q, true, rng) : Scope(c.fmt, {1, 1, 1, false});

  StridedTensor<uint16_t> q(DType::kBFloat16, {c.b, c.s_q, c.h_q, d_qk}, {1, 1, 1, 128}, kHalfNaN);
  for (int64_t i = 0; i < c.b; ++i)
    for (int64_t r = 0; r < c.s_q; ++r)
      for (int64_t h = 0; h < c.h_q; ++h)
        for (int64_t e = 0; e < d_qk; ++e) {
          double v;
          do v = rng.uniform(-1, 1);
          while (std::fabs(v) < 1e-3);
          q.at({i, r, h, e}) = bf16_trunc(static_cast<float>(v));
        }
  StridedTensor<float> sink(DType::kFloat32, {c.h_q}, {}, 0.f);
  for (int64_t h = 0; h < c.h_q; ++h) sink.at({h}) = static_cast<float>(rng.normal() * 1.5 + 3.0);
  sink.at({0}) = INFINITY;
  sink.at({1}) = -INFINITY;

  StridedTensor<uint16_t> out(DType::kBFloat16, {c.b, c.s_q, c.h_q, kDimV}, {1, 1, 1, 8}, kHalfNaN);
  auto lse = StridedTensor<float>::with_strides(DType::kFloat32, {c.b, c.h_q, c.s_q}, {c.s_q * c.h_q, 1, c.h_q},
                                                f32_nan());

  SparseDecodeParams p;
  p.q = q.ref();
  p.k_cache = main_scope.cache.ref();
  p.indices = main_scope.indices.ref();
  if (c.main.with_length) p.topk_length = main_scope.length.ref();
  if (c.with_sink) p.attn_sink = sink.ref();
  if (c.with_extra) {
    p.extra_k_cache = extra_scope.cache.ref();
    p.extra_indices_in_kvcache = extra_scope.indices.ref();
    if (c.extra.with_length) p.extra_topk_length = extra_scope.length.ref();
  }
  p.softmax_scale = c.scale;
  p.out = out.ref();
  p.lse = lse.ref();
  const Status st = ref::sparse_decode(p);
  ASSERT_TRUE(st.ok()) << st.message;

  // Float64 oracle, one (i, r) row of keys at a time.
  Checker out_check(c.name + " out", kTolOutBf16);
  Checker lse_check(c.name + " lse", kTolLse);
  int64_t empty_rows = 0, total_keys = 0;
  for (int64_t i = 0; i < c.b; ++i)
    for (int64_t r = 0; r < c.s_q; ++r) {
      std::vector<std::vector<double>> keys;  // main then extra: one joint softmax
      for (int64_t pp = 0; pp < c.main.topk; ++pp)
        if (main_scope.slot_valid(i, r, pp)) keys.push_back(main_scope.cache.dequant(main_scope.indices.at({i, r, pp})));
      if (c.with_extra)
        for (int64_t pp = 0; pp < c.extra.topk; ++pp)
          if (extra_scope.slot_valid(i, r, pp))
            keys.push_back(extra_scope.cache.dequant(extra_scope.indices.at({i, r, pp})));
      total_keys += static_cast<int64_t>(keys.size());
      if (keys.empty()) empty_rows++;
      for (int64_t h = 0; h < c.h_q; ++h) {
        std::vector<double> o(kDimV, 0.0);
        double l = kInfD;
        if (!keys.empty()) {
          std::vector<double> s(keys.size());
          double m = -kInfD;
          for (size_t j = 0; j < keys.size(); ++j) {
            double acc = 0;
            for (int64_t e = 0; e < d_qk; ++e) acc += bf16_bits_to_double(q.at({i, r, h, e})) * keys[j][e];
            s[j] = acc * c.scale;
            m = std::max(m, s[j]);
          }
          double sum = 0;
          for (double x : s) sum += std::exp(x - m);
          l = m + std::log(sum);
          const double factor = c.with_sink ? 1.0 / (1.0 + std::exp(static_cast<double>(sink.at({h})) - l)) : 1.0;
          for (size_t j = 0; j < keys.size(); ++j)
            for (int64_t e = 0; e < kDimV; ++e) o[e] += std::exp(s[j] - l) * keys[j][e] * factor;
        }
        for (int64_t e = 0; e < kDimV; ++e) {
          const double got = bf16_bits_to_double(out.at({i, r, h, e}));
          if (keys.empty()) out_check.check_exact(got, 0.0, at_str(i, r, h, e));
          else out_check.check(got, o[e], at_str(i, r, h, e));
        }
        lse_check.check(lse.at({i, h, r}), l, at_str(i, h, r));
      }
    }
  std::printf("    [%s] %lld empty rows, %lld valid keys gathered\n", c.name.c_str(), static_cast<long long>(empty_rows),
              static_cast<long long>(total_keys));
  EXPECT_GT(empty_rows, 0) << "case should contain a row without valid slots";
  EXPECT_EQ(out.count_modified_padding(kHalfNaN), 0) << "writes outside the out view";
}

constexpr float kScale576 = 0.030f;  // ~ 576^-0.55
constexpr float kScale512 = 0.032f;  // ~ 512^-0.55

}  // namespace

TEST(ReferenceSparseDecode, V32Page61WithSink) {
  run_sparse_decode_case({"v32 pbs61 sink", KVFormat::kFP8V32, 3, 2, 16, {61, 6, 128, false}, false, {}, true, 0.3f, 11});
}

TEST(ReferenceSparseDecode, V32Page64Heads64NoSink) {
  run_sparse_decode_case({"v32 pbs64 h64", KVFormat::kFP8V32, 2, 1, 64, {64, 4, 64, false}, false, {}, false,
                          kScale576, 12});
}

TEST(ReferenceSparseDecode, V32Page16TopkLength) {
  run_sparse_decode_case({"v32 pbs16 topk_length", KVFormat::kFP8V32, 4, 3, 16, {16, 20, 64, true}, false, {}, true,
                          0.3f, 13});
}

TEST(ReferenceSparseDecode, Model1Page64ExtraPage16AllLengths) {
  run_sparse_decode_case({"model1 pbs64 + extra pbs16, lengths", KVFormat::kFP8Model1, 4, 3, 16, {64, 5, 128, true},
                          true, {16, 9, 64, true}, true, 0.3f, 14});
}

TEST(ReferenceSparseDecode, Model1Page61NoExtraNoSink) {
  run_sparse_decode_case({"model1 pbs61", KVFormat::kFP8Model1, 3, 2, 32, {61, 4, 64, true}, false, {}, false,
                          kScale512, 15});
}

TEST(ReferenceSparseDecode, Model1Page2ExtraPage61NoLengths) {
  run_sparse_decode_case({"model1 pbs2 + extra pbs61", KVFormat::kFP8Model1, 2, 2, 16, {2, 100, 64, false}, true,
                          {61, 3, 128, false}, true, 0.3f, 16});
}

TEST(ReferenceSparseDecode, Model1ExtraLengthOnly) {
  run_sparse_decode_case({"model1 extra_topk_length only", KVFormat::kFP8Model1, 3, 1, 16, {64, 3, 64, false}, true,
                          {64, 3, 64, true}, true, 0.3f, 17});
}
