// Tests of dense MHA prefill (spec §1.5, §2.5) through the public operators (validation included)
// against a naive float64 oracle: forward (out, lse) from the 16-bit inputs, backward (dq, dk, dv)
// from the inputs and the out / lse the forward wrote (the operator's definition, ops.h).
//
// Cases: varlen batches with empty requests (s_q = 0 and s_k = 0), lengths 1, 7, 63, 129,
// s_q != s_k both ways, bottom-right causal (rows without keys), GQA, bf16 and fp16, both head-dim
// pairs, strided inputs, FlashMLA's lse layout (strides (1, total_q)), outputs poisoned with NaN and
// padded (no write outside the view), NaN propagation, determinism across thread counts, and the
// validation errors (kind and argument name).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "flashmla/ops.h"
#include "reference_test_util.h"

using namespace flashmla;
using namespace flashmla::testing;

namespace {

struct PrefillCase {
  std::string name;
  std::vector<int64_t> s_q, s_k;  // per request
  int64_t h_q, h_kv, d_qk, d_v;
  bool causal, fp16;
  uint64_t seed;
};

struct PrefillData {
  PrefillCase c;
  int64_t total_q = 0, total_k = 0;
  std::vector<int32_t> cu_q, cu_k;
  StridedTensor<uint16_t> q, k, v, out, dout, dq, dk, dv;
  StridedTensor<int32_t> cu_q_t, cu_k_t;
  StridedTensor<float> lse;
  DensePrefillParams fwd;
  DensePrefillBwdParams bwd;
};

double half_value(uint16_t h, bool fp16) { return fp16 ? fp16_bits_to_double(h) : bf16_bits_to_double(h); }

uint16_t half_bits(double x, bool fp16) {
  if (!fp16) return bf16_trunc(static_cast<float>(x));
  // fp16 by brute-force truncation of the float to 10 mantissa bits (inputs only need to be some fp16 value).
  const float f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);  // tiny values: zero
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((u >> 13) & 0x3FFu));
}

/// Padded 3-D tensor (tokens, heads, dim); the poison fills what the view does not cover.
StridedTensor<uint16_t> make3(DType dt, int64_t n, int64_t h, int64_t d, uint16_t poison) {
  return StridedTensor<uint16_t>(dt, {n, h, d}, {1, 1, 8}, poison);
}

PrefillData make_prefill(const PrefillCase& c) {
  PrefillData d;
  d.c = c;
  Rng rng(c.seed);
  const DType dt = c.fp16 ? DType::kFloat16 : DType::kBFloat16;
  d.cu_q = {0};
  d.cu_k = {0};
  for (size_t i = 0; i < c.s_q.size(); ++i) {
    d.cu_q.push_back(d.cu_q.back() + static_cast<int32_t>(c.s_q[i]));
    d.cu_k.push_back(d.cu_k.back() + static_cast<int32_t>(c.s_k[i]));
  }
  d.total_q = d.cu_q.back();
  d.total_k = d.cu_k.back();
  const int64_t b = static_cast<int64_t>(c.s_q.size());
  auto fill = [&](StridedTensor<uint16_t>& t) {
    for (int64_t a = 0; a < t.shape[0]; ++a)
      for (int64_t h = 0; h < t.shape[1]; ++h)
        for (int64_t e = 0; e < t.shape[2]; ++e) t.at({a, h, e}) = half_bits(rng.normal(), c.fp16);
  };
  d.q = make3(dt, d.total_q, c.h_q, c.d_qk, kHalfNaN);
  d.k = make3(dt, d.total_k, c.h_kv, c.d_qk, kHalfNaN);
  d.v = make3(dt, d.total_k, c.h_kv, c.d_v, kHalfNaN);
  d.dout = make3(dt, d.total_q, c.h_q, c.d_v, kHalfNaN);
  fill(d.q);
  fill(d.k);
  fill(d.v);
  fill(d.dout);
  d.out = make3(dt, d.total_q, c.h_q, c.d_v, kHalfNaN);
  d.dq = make3(dt, d.total_q, c.h_q, c.d_qk, kHalfNaN);
  d.dk = make3(dt, d.total_k, c.h_kv, c.d_qk, kHalfNaN);
  d.dv = make3(dt, d.total_k, c.h_kv, c.d_v, kHalfNaN);
  // FlashMLA's lse layout: (total_q, h_q) with strides (1, total_q + 3) (a padded transposed buffer).
  d.lse = StridedTensor<float>::with_strides(DType::kFloat32, {d.total_q, c.h_q}, {1, d.total_q + 3}, f32_nan());
  d.cu_q_t = StridedTensor<int32_t>(DType::kInt32, {b + 1}, {}, 0);
  d.cu_k_t = StridedTensor<int32_t>(DType::kInt32, {b + 1}, {}, 0);
  for (int64_t i = 0; i <= b; ++i) {
    d.cu_q_t.at({i}) = d.cu_q[i];
    d.cu_k_t.at({i}) = d.cu_k[i];
  }
  int64_t max_q = 0, max_k = 0;
  for (size_t i = 0; i < c.s_q.size(); ++i) {
    max_q = std::max(max_q, c.s_q[i]);
    max_k = std::max(max_k, c.s_k[i]);
  }
  DensePrefillParams& p = d.fwd;
  p.q = d.q.ref();
  p.k = d.k.ref();
  p.v = d.v.ref();
  p.cu_seqlens_qo = d.cu_q_t.ref();
  p.cu_seqlens_kv = d.cu_k_t.ref();
  p.max_seqlen_qo = max_q;
  p.max_seqlen_kv = max_k;
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d_qk)));
  p.causal = c.causal;
  p.out = d.out.ref();
  p.lse = d.lse.ref();
  d.bwd.fwd = p;
  d.bwd.dout = d.dout.ref();
  d.bwd.dq = d.dq.ref();
  d.bwd.dk = d.dk.ref();
  d.bwd.dv = d.dv.ref();
  return d;
}

/// Keys visible to row r of a request (spec §2.5; bottom-right causal).
int64_t visible(int64_t r, int64_t s_q, int64_t s_k, bool causal) {
  if (!causal) return s_k;
  return std::clamp<int64_t>(r + s_k - s_q + 1, 0, s_k);
}

struct Grads {
  std::vector<double> dq, dk, dv;
};

/// A 3-D 16-bit tensor decoded to float64, row-major (t, h, e).
struct Dense3 {
  int64_t h = 0, dim = 0;
  std::vector<double> v;
  Dense3(const StridedTensor<uint16_t>& t, bool fp16) : h(t.shape[1]), dim(t.shape[2]) {
    v.resize(static_cast<size_t>(t.shape[0] * h * dim));
    for (int64_t a = 0; a < t.shape[0]; ++a)
      for (int64_t b = 0; b < h; ++b)
        for (int64_t e = 0; e < dim; ++e) v[(a * h + b) * dim + e] = half_value(t.at({a, b, e}), fp16);
  }
  const double* row(int64_t t, int64_t head) const { return v.data() + (t * h + head) * dim; }
};

/// float64 oracle. Forward: out / lse into `out`, `lse` ([t][h][e], [t][h]). Backward from the out and lse
/// the operator wrote (its definition), into `g`.
void oracle(const PrefillData& d, std::vector<double>* out, std::vector<double>* lse, Grads* g) {
  const PrefillCase& c = d.c;
  const int64_t group = c.h_q / c.h_kv;
  const double scale = d.fwd.softmax_scale;
  const Dense3 q(d.q, c.fp16), k(d.k, c.fp16), v(d.v, c.fp16), dout(d.dout, c.fp16), o_given(d.out, c.fp16);
  out->assign(d.total_q * c.h_q * c.d_v, 0.0);
  lse->assign(d.total_q * c.h_q, -kInfD);
  g->dq.assign(d.total_q * c.h_q * c.d_qk, 0.0);
  g->dk.assign(d.total_k * c.h_kv * c.d_qk, 0.0);
  g->dv.assign(d.total_k * c.h_kv * c.d_v, 0.0);
  for (size_t i = 0; i < c.s_q.size(); ++i) {
    const int64_t s_q = c.s_q[i], s_k = c.s_k[i], q0 = d.cu_q[i], k0 = d.cu_k[i];
    for (int64_t h = 0; h < c.h_q; ++h) {
      const int64_t g_kv = h / group;
      for (int64_t r = 0; r < s_q; ++r) {
        const int64_t t = q0 + r, n = visible(r, s_q, s_k, c.causal);
        if (n == 0) continue;
        const double* qr = q.row(t, h);
        const double* dor = dout.row(t, h);
        std::vector<double> x(n);
        for (int64_t j = 0; j < n; ++j) {
          const double* kj = k.row(k0 + j, g_kv);
          double acc = 0;
          for (int64_t e = 0; e < c.d_qk; ++e) acc += qr[e] * kj[e];
          x[j] = acc * scale;
        }
        double sum = 0;
        for (double xj : x) sum += std::exp(xj);
        const double l = std::log(sum);
        (*lse)[t * c.h_q + h] = l;
        double* orow = out->data() + (t * c.h_q + h) * c.d_v;
        for (int64_t j = 0; j < n; ++j) {
          const double* vj = v.row(k0 + j, g_kv);
          const double p = std::exp(x[j] - l);
          for (int64_t e = 0; e < c.d_v; ++e) orow[e] += p * vj[e];
        }
        // Backward with the operator's own out / lse.
        const double lse_given = d.lse.at({t, h});
        const double* og = o_given.row(t, h);
        double delta = 0;
        for (int64_t e = 0; e < c.d_v; ++e) delta += dor[e] * og[e];
        for (int64_t j = 0; j < n; ++j) {
          const double* kj = k.row(k0 + j, g_kv);
          const double* vj = v.row(k0 + j, g_kv);
          const double p = std::exp(x[j] - lse_given);
          double dp = 0;
          for (int64_t e = 0; e < c.d_v; ++e) dp += dor[e] * vj[e];
          const double ds = p * (dp - delta) * scale;
          double* dvj = g->dv.data() + ((k0 + j) * c.h_kv + g_kv) * c.d_v;
          double* dkj = g->dk.data() + ((k0 + j) * c.h_kv + g_kv) * c.d_qk;
          double* dqr = g->dq.data() + (t * c.h_q + h) * c.d_qk;
          for (int64_t e = 0; e < c.d_v; ++e) dvj[e] += p * dor[e];
          for (int64_t e = 0; e < c.d_qk; ++e) {
            dqr[e] += ds * kj[e];
            dkj[e] += ds * qr[e];
          }
        }
      }
    }
  }
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

void check_grad(const char* name, const StridedTensor<uint16_t>& got, const std::vector<double>& ref, bool fp16,
                const std::string& case_name) {
  // Half-ulp output rounding (relative) plus float32 accumulation over cancelling terms (absolute,
  // relative to the tensor's largest entry).
  const Tol tol{fp16 ? 1.0 / 512 : 1.0 / 64, 2e-3 * max_abs(ref) + 1e-6};
  Checker ck(case_name + " " + name, tol);
  const int64_t h = got.shape[1], dim = got.shape[2];
  for (int64_t t = 0; t < got.shape[0]; ++t)
    for (int64_t a = 0; a < h; ++a)
      for (int64_t e = 0; e < dim; ++e)
        ck.check(half_value(got.at({t, a, e}), fp16), ref[(t * h + a) * dim + e], at_str(t, a, e));
  EXPECT_EQ(got.count_modified_padding(kHalfNaN), 0) << name;
}

void run_case(const PrefillCase& c) {
  SCOPED_TRACE(c.name);
  PrefillData d = make_prefill(c);
  int64_t ws = -1;
  ASSERT_TRUE(dense_prefill_plan(d.fwd, &ws).ok());
  EXPECT_EQ(ws, 0);
  Status st = dense_prefill_fwd(d.fwd);
  ASSERT_TRUE(st.ok()) << st.message;
  ASSERT_TRUE(dense_prefill_bwd_plan(d.bwd, &ws).ok());
  EXPECT_EQ(ws, 0);
  st = dense_prefill_bwd(d.bwd);
  ASSERT_TRUE(st.ok()) << st.message;

  std::vector<double> out, lse;
  Grads g;
  oracle(d, &out, &lse, &g);
  Checker out_ck(c.name + " out", c.fp16 ? kTolOutFp16 : kTolOutBf16);
  Checker lse_ck(c.name + " lse", kTolLse);
  int64_t empty_rows = 0;
  for (int64_t t = 0; t < d.total_q; ++t)
    for (int64_t h = 0; h < c.h_q; ++h) {
      const double l = lse[t * c.h_q + h];
      if (l == -kInfD) ++empty_rows;
      lse_ck.check(d.lse.at({t, h}), l, at_str(t, h));
      for (int64_t e = 0; e < c.d_v; ++e) {
        const double got = half_value(d.out.at({t, h, e}), c.fp16);
        if (l == -kInfD) out_ck.check_exact(got, 0.0, at_str(t, h, e));
        else out_ck.check(got, out[(t * c.h_q + h) * c.d_v + e], at_str(t, h, e));
      }
    }
  std::printf("    [%s] %lld of %lld (row, head) pairs without a visible key\n", c.name.c_str(),
              static_cast<long long>(empty_rows), static_cast<long long>(d.total_q * c.h_q));
  EXPECT_EQ(d.out.count_modified_padding(kHalfNaN), 0);
  EXPECT_EQ(d.lse.count_modified_padding(f32_nan()), 0);
  check_grad("dq", d.dq, g.dq, c.fp16, c.name);
  check_grad("dk", d.dk, g.dk, c.fp16, c.name);
  check_grad("dv", d.dv, g.dv, c.fp16, c.name);
}

}  // namespace

TEST(ReferenceDensePrefill, VarlenEmptyRequestsNonCausal) {
  // Requests with s_q = 0, s_k = 0 (rows without keys: out 0, lse -inf, zero grads), lengths 1 and 7.
  run_case({"d128 varlen empty", {1, 0, 7, 5, 3}, {7, 4, 7, 0, 1}, 4, 4, 128, 128, false, false, 31});
}

TEST(ReferenceDensePrefill, CausalBottomRightBothWays) {
  // s_q > s_k (the first rows see no key) and s_q < s_k (every row sees the prefix).
  run_case({"d128 causal", {7, 5, 1, 3}, {3, 9, 1, 0}, 2, 2, 128, 128, true, false, 32});
}

TEST(ReferenceDensePrefill, MlaDimsGqaFp16) {
  run_case({"d192 gqa fp16", {63, 2}, {65, 2}, 6, 2, 192, 128, false, true, 33});
}

TEST(ReferenceDensePrefill, MlaDimsGqaCausalLong) {
  // 129 rows cross the reference's 32-row blocks; GQA group 4.
  run_case({"d192 gqa causal 129", {129, 33}, {129, 40}, 4, 1, 192, 128, true, false, 34});
}

TEST(ReferenceDensePrefill, SequencesAcrossSeveralTiles) {
  // Keys (forward, dq) and query rows (dk / dv) past the reference's 512-row tiles, causal both ways and not, GQA.
  run_case({"d128 gqa causal tiles", {530, 2, 1}, {1030, 600, 0}, 2, 1, 128, 128, true, false, 44});
  run_case({"d192 tiles", {3, 520}, {1030, 40}, 2, 2, 192, 128, false, false, 45});
}

TEST(ReferenceDensePrefill, D128GqaCausalFp16) {
  run_case({"d128 gqa causal fp16", {40, 7}, {33, 12}, 4, 2, 128, 128, true, true, 35});
}

TEST(ReferenceDensePrefill, NaNPropagatesToTheRowsThatSeeIt) {
  // One request, causal, s_q = s_k = 8: a NaN in key 5 reaches rows 5..7 (all heads of its KV head) only;
  // a NaN in q row 1 head 0 reaches that (row, head) only; a NaN in v of key 6 reaches rows 6..7.
  PrefillCase c{"nan", {8}, {8}, 2, 1, 128, 128, true, false, 36};
  PrefillData d = make_prefill(c);
  d.k.at({5, 0, 3}) = kHalfNaN;
  d.q.at({1, 0, 7}) = kHalfNaN;
  d.v.at({6, 0, 0}) = kHalfNaN;
  ASSERT_TRUE(dense_prefill_fwd(d.fwd).ok());
  for (int64_t r = 0; r < 8; ++r)
    for (int64_t h = 0; h < 2; ++h) {
      const bool nan_row = r >= 5 || (r == 1 && h == 0);
      EXPECT_EQ(std::isnan(d.lse.at({r, h})), nan_row) << "lse row " << r << " head " << h;
      EXPECT_EQ(std::isnan(half_value(d.out.at({r, h, 1}), false)), nan_row) << "out row " << r << " head " << h;
      // v's NaN sits in dim 0 of key 6: rows 6 and 7 see it there.
      EXPECT_EQ(std::isnan(half_value(d.out.at({r, h, 0}), false)), nan_row || r >= 6);
    }
  // A NaN in a key of another request, or past the causal limit, is never read.
  PrefillCase c2{"nan elsewhere", {4, 4}, {4, 6}, 2, 2, 128, 128, true, false, 37};
  PrefillData d2 = make_prefill(c2);
  d2.k.at({9, 1, 0}) = kHalfNaN;  // request 1, key 5 (the last): visible to its last row only
  d2.v.at({9, 1, 0}) = kHalfNaN;
  ASSERT_TRUE(dense_prefill_fwd(d2.fwd).ok());
  for (int64_t t = 0; t < 8; ++t)
    for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(std::isnan(d2.lse.at({t, h})), t == 7 && h == 1) << t << "," << h;
  ASSERT_TRUE(dense_prefill_bwd(d2.bwd).ok());
  for (int64_t e = 0; e < 128; ++e) EXPECT_FALSE(std::isnan(half_value(d2.dk.at({0, 0, e}), false)));
}

TEST(ReferenceDensePrefill, DeterministicAcrossThreadCounts) {
  const PrefillCase c{"threads", {50, 17}, {70, 17}, 4, 2, 192, 128, true, false, 38};
  PrefillData d1 = make_prefill(c), d2 = make_prefill(c);
  const char* old = std::getenv("FLASHMLA_NUM_THREADS");
  const std::string saved = old ? old : "";
  setenv("FLASHMLA_NUM_THREADS", "1", 1);
  ASSERT_TRUE(dense_prefill_fwd(d1.fwd).ok());
  ASSERT_TRUE(dense_prefill_bwd(d1.bwd).ok());
  setenv("FLASHMLA_NUM_THREADS", "3", 1);
  ASSERT_TRUE(dense_prefill_fwd(d2.fwd).ok());
  ASSERT_TRUE(dense_prefill_bwd(d2.bwd).ok());
  if (old) setenv("FLASHMLA_NUM_THREADS", saved.c_str(), 1);
  else unsetenv("FLASHMLA_NUM_THREADS");
  EXPECT_EQ(d1.out.storage, d2.out.storage);
  EXPECT_EQ(d1.dq.storage, d2.dq.storage);
  EXPECT_EQ(d1.dk.storage, d2.dk.storage);
  EXPECT_EQ(d1.dv.storage, d2.dv.storage);
  EXPECT_EQ(0, std::memcmp(d1.lse.storage.data(), d2.lse.storage.data(), d1.lse.storage.size() * sizeof(float)));
}

// ------------------------------------------------------------------ validation
namespace {
void expect_error(const Status& st, ErrorKind kind, const std::string& needle) {
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.kind, kind) << st.message;
  EXPECT_NE(st.message.find(needle), std::string::npos) << "message: " << st.message << "\nexpected to contain: " << needle;
}
}  // namespace

TEST(ValidationDensePrefill, HeadDimsWithoutAKernel) {
  PrefillCase c{"dims", {3}, {3}, 2, 2, 64, 64, false, false, 40};
  PrefillData d = make_prefill(c);
  int64_t ws = 0;
  expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "no kernel for d_qk=64 d_v=64");
  expect_error(dense_prefill_fwd(d.fwd), ErrorKind::kValue, "no kernel for d_qk=64 d_v=64");
  PrefillCase c2{"dims", {3}, {3}, 2, 2, 128, 64, false, false, 40};
  PrefillData d2 = make_prefill(c2);
  expect_error(dense_prefill_bwd(d2.bwd), ErrorKind::kValue, "no kernel for d_qk=128 d_v=64");
  // The outputs were never written.
  EXPECT_EQ(d2.dq.count_modified_padding(kHalfNaN), 0);
  for (uint16_t x : d2.dq.storage) EXPECT_EQ(x, kHalfNaN);
}

TEST(ValidationDensePrefill, ShapesDtypesAndValues) {
  const PrefillCase c{"val", {3, 2}, {4, 2}, 4, 2, 128, 128, true, false, 41};
  int64_t ws = 0;
  {
    PrefillData d = make_prefill(c);
    d.k.dtype = DType::kFloat16;
    d.fwd.k = d.k.ref();
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kType, "k: expected the dtype of q");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.q.dtype = DType::kFloat32;
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kType, "q: expected dtype bfloat16 or float16");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.q.shape[1] = 3;  // h_q % h_kv
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "h_q % h_kv != 0");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.v.shape[0] = 5;
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "v: expected shape (6, 2, d_v)");
  }
  {
    PrefillData d = make_prefill(c);
    d.cu_q_t.at({1}) = -1;
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue,
                 "cu_seqlens_qo: cumulative lengths must not decrease");
  }
  {
    PrefillData d = make_prefill(c);
    d.cu_k_t.at({2}) = 5;
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "cu_seqlens_kv[b] = 5 must equal total_k");
  }
  {
    PrefillData d = make_prefill(c);
    d.cu_q_t.at({0}) = 1;
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "cu_seqlens_qo[0] = 1");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.max_seqlen_kv = 3;
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "more than max_seqlen_kv = 3");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.cu_seqlens_kv.shape[0] = 2;
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "cu_seqlens_kv");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.cu_seqlens_qo.dtype = DType::kInt64;
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kType, "cu_seqlens_qo: expected dtype int32");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.softmax_scale = std::numeric_limits<float>::infinity();
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "softmax_scale");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.q.stride[2] = 2;
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "q: the last dimension must be contiguous");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.lse.shape[1] = 2;
    expect_error(dense_prefill_fwd(d.fwd), ErrorKind::kValue, "lse: expected shape");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.out.dtype = DType::kFloat16;
    expect_error(dense_prefill_fwd(d.fwd), ErrorKind::kType, "out: expected dtype bfloat16");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.out = d.fwd.q;  // aliasing an input (same shape with d_qk == d_v)
    expect_error(dense_prefill_fwd(d.fwd), ErrorKind::kValue, "out: the output's memory overlaps the input q");
  }
  {
    PrefillData d = make_prefill(c);
    d.bwd.dout.shape[2] = 64;
    expect_error(dense_prefill_bwd(d.bwd), ErrorKind::kValue, "dout: expected shape");
  }
  {
    PrefillData d = make_prefill(c);
    d.bwd.fwd.lse = TensorRef{};
    expect_error(dense_prefill_bwd(d.bwd), ErrorKind::kValue, "lse: a tensor is required");
  }
  {
    PrefillData d = make_prefill(c);
    d.bwd.dk = d.bwd.dq;  // (dq's shape differs: a shape error naming dk)
    expect_error(dense_prefill_bwd(d.bwd), ErrorKind::kValue, "dk: expected shape");
  }
  {
    PrefillData d = make_prefill(c);
    d.bwd.dq.data = nullptr;
    expect_error(dense_prefill_bwd(d.bwd), ErrorKind::kValue, "dq: the data pointer is null");
  }
  {
    PrefillData d = make_prefill(c);
    d.fwd.k.device = {DeviceType::kCUDA, 0};
    expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kValue, "k is on cuda:0 but q is on cpu");
  }
  {
    PrefillData d = make_prefill(c);
    expect_error(dense_prefill_plan(d.fwd, nullptr), ErrorKind::kValue, "workspace_bytes");
    expect_error(dense_prefill_bwd_plan(d.bwd, nullptr), ErrorKind::kValue, "workspace_bytes");
  }
}

TEST(ValidationDensePrefill, ShapesOnlyPlanSkipsValues) {
  // The plans take refs without data (JAX tracing): shapes and dtypes are checked, values are not.
  const PrefillCase c{"shapes", {3, 2}, {4, 2}, 4, 2, 192, 128, false, false, 42};
  PrefillData d = make_prefill(c);
  d.fwd.cu_seqlens_qo.data = nullptr;
  d.fwd.cu_seqlens_kv.data = nullptr;
  d.fwd.q.data = d.fwd.k.data = d.fwd.v.data = nullptr;
  int64_t ws = -1;
  EXPECT_TRUE(dense_prefill_plan(d.fwd, &ws).ok());
  EXPECT_EQ(ws, 0);
  expect_error(dense_prefill_fwd(d.fwd), ErrorKind::kValue, "the data pointer is null");
}

TEST(ValidationDensePrefill, GpuWithoutBackendIsNotImplemented) {
  if (has_cuda_backend()) GTEST_SKIP() << "built with CUDA";
  const PrefillCase c{"gpu", {3}, {3}, 2, 2, 128, 128, false, false, 43};
  PrefillData d = make_prefill(c);
  auto on_gpu = [](TensorRef& t) { t.device = {DeviceType::kCUDA, 0}; };
  for (TensorRef* t : {&d.fwd.q, &d.fwd.k, &d.fwd.v, &d.fwd.cu_seqlens_qo, &d.fwd.cu_seqlens_kv}) on_gpu(*t);
  int64_t ws = 0;
  expect_error(dense_prefill_plan(d.fwd, &ws), ErrorKind::kNotImplemented, "no CUDA backend");
}
