// tests/cpp/reference_test_util.h — helpers shared by the reference-backend tests:
// a seeded RNG, strided test tensors (padded like FlashMLA's `non_contiguousify`,
// poisoned with NaN), scalar decoders written independently of src/reference/numeric.h,
// and a tolerance checker with exact +-inf / NaN position matching (spec §5.1).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "flashmla/tensor.h"

namespace flashmla::testing {

constexpr double kInfD = std::numeric_limits<double>::infinity();
constexpr double kNaND = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------- RNG
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen); }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen); }
  /// Uniform integer in [lo, hi] (inclusive).
  int64_t randint(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); }
  bool chance(double p) { return uniform(0.0, 1.0) < p; }
};

// ---------------------------------------------------------------- independent scalar decoders
inline double bf16_bits_to_double(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline double fp16_bits_to_double(uint16_t h) {
  const int sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  double v;
  if (exp == 0x1F) v = man ? kNaND : kInfD;
  else if (exp == 0) v = std::ldexp(man, -24);
  else v = std::ldexp(1024 + man, exp - 25);
  return sign ? -v : v;
}
/// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; S.1111.111 = NaN, no inf.
inline double e4m3_bits_to_double(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  if (exp == 0xF && man == 7) return kNaND;
  const double v = exp == 0 ? std::ldexp(man, -9) : std::ldexp(8 + man, exp - 10);
  return sign ? -v : v;
}
inline double e8m0_bits_to_double(uint8_t e) { return e == 0xFF ? kNaND : std::ldexp(1.0, e - 127); }

/// Independent e4m3 encoder: nearest of the 127 non-negative finite codes plus a
/// virtual code 0x7F worth 480 (anything rounding there becomes NaN, as PyTorch's
/// non-saturating cast does); ties go to the even code (= even mantissa).
inline uint8_t e4m3_brute_force(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (std::isnan(x) || a >= 480.0) return 0x7F | sign;
  int best = 0;
  double best_err = kInfD;
  for (int c = 0; c <= 0x7F; ++c) {
    const double v = c == 0x7F ? 480.0 : e4m3_bits_to_double(static_cast<uint8_t>(c));
    const double err = std::fabs(v - a);
    if (err < best_err || (err == best_err && (c % 2 == 0))) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best | sign);
}


/// bf16 bits of a float by truncation (used only to *generate* random bf16 inputs).
inline uint16_t bf16_trunc(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
constexpr uint16_t kHalfNaN = 0xFFFF;    ///< NaN in both bf16 and fp16
constexpr int32_t kBlockSentinel = 2147480000;

// ---------------------------------------------------------------- strided tensors
/// Owning strided tensor for tests. Storage is larger than the view (every dim
/// padded), and padding holds a known poison value so stray writes are detected.
template <typename T>
struct StridedTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape, stride;
  std::vector<T> storage;

  StridedTensor() = default;
  /// Row-major over the padded extents `shape[d] + pad[d]` (pad of the last dim
  /// keeps stride 1 there), storage filled with `fill`.
  StridedTensor(DType dt, std::vector<int64_t> shp, std::vector<int64_t> pad, T fill) : dtype(dt), shape(shp) {
    stride.assign(shape.size(), 1);
    int64_t s = 1;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      stride[d] = s;
      s *= shape[d] + (pad.empty() ? 0 : pad[d]);
    }
    storage.assign(static_cast<size_t>(s + 1), fill);  // +1: never zero-sized
  }
  /// Explicit strides (storage sized to cover the view).
  static StridedTensor with_strides(DType dt, std::vector<int64_t> shp, std::vector<int64_t> str, T fill) {
    StridedTensor t;
    t.dtype = dt;
    t.shape = shp;
    t.stride = str;
    int64_t max_off = 0;
    for (size_t d = 0; d < shp.size(); ++d) max_off += (shp[d] - 1) * str[d];
    t.storage.assign(static_cast<size_t>(max_off + 1), fill);
    return t;
  }

  int64_t offset(std::initializer_list<int64_t> idx) const {
    int64_t o = 0;
    size_t d = 0;
    for (int64_t i : idx) o += i * stride[d++];
    return o;
  }
  T& at(std::initializer_list<int64_t> idx) { return storage[static_cast<size_t>(offset(idx))]; }
  const T& at(std::initializer_list<int64_t> idx) const { return storage[static_cast<size_t>(offset(idx))]; }

  TensorRef ref() const {
    TensorRef r;
    r.defined = true;
    r.data = const_cast<T*>(storage.data());
    r.dtype = dtype;
    r.ndim = static_cast<int32_t>(shape.size());
    for (size_t d = 0; d < shape.size(); ++d) {
      r.shape[d] = shape[d];
      r.stride[d] = stride[d];
    }
    return r;
  }

  /// Mask of storage elements that belong to the view.
  std::vector<char> view_mask() const {
    std::vector<char> m(storage.size(), 0);
    std::vector<int64_t> idx(shape.size(), 0);
    int64_t total = 1;
    for (int64_t s : shape) total *= s;
    for (int64_t n = 0; n < total; ++n) {
      int64_t o = 0;
      for (size_t d = 0; d < shape.size(); ++d) o += idx[d] * stride[d];
      m[static_cast<size_t>(o)] = 1;
      for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
      }
    }
    return m;
  }
  /// Number of storage elements outside the view whose bits differ from `poison`.
  int64_t count_modified_padding(T poison) const {
    const std::vector<char> m = view_mask();
    int64_t n = 0;
    for (size_t k = 0; k < storage.size(); ++k)
      if (!m[k] && std::memcmp(&storage[k], &poison, sizeof(T)) != 0) ++n;
    return n;
  }
};

inline float f32_nan() { return std::numeric_limits<float>::quiet_NaN(); }

// ---------------------------------------------------------------- comparison
/// |got - ref| <= abs + rel * |ref|; +-inf must match exactly; NaN never allowed.
struct Tol {
  double rel, abs;
};

/// Accumulates element comparisons and reports the first failures with context.
class Checker {
 public:
  Checker(std::string name, Tol tol) : name_(std::move(name)), tol_(tol) {}
  ~Checker() { report(); }

  void check(double got, double ref, const std::string& where) {
    ++count_;
    bool ok;
    if (std::isnan(got) || std::isnan(ref)) ok = false;
    else if (std::isinf(ref) || std::isinf(got)) ok = got == ref;
    else {
      const double err = std::fabs(got - ref);
      ok = err <= tol_.abs + tol_.rel * std::fabs(ref);
      max_abs_ = std::max(max_abs_, err);
      if (std::fabs(ref) > 1e-3) max_rel_ = std::max(max_rel_, err / std::fabs(ref));
    }
    if (!ok && ++failures_ <= 8) {
      ADD_FAILURE() << name_ << " mismatch at " << where << ": got " << got << ", expected " << ref;
    }
  }
  /// Exact check (bit-level semantics such as out == 0, lse == +inf).
  void check_exact(double got, double ref, const std::string& where) {
    ++count_;
    if (!(got == ref) && ++failures_ <= 8)
      ADD_FAILURE() << name_ << " exact mismatch at " << where << ": got " << got << ", expected " << ref;
  }
  int64_t failures() const { return failures_; }

 private:
  void report() const {
    if (failures_ > 8) ADD_FAILURE() << name_ << ": " << failures_ << " mismatches in total";
    std::printf("    [%s] %lld elements, max abs err %.3g, max rel err (|ref|>1e-3) %.3g\n", name_.c_str(),
                static_cast<long long>(count_), max_abs_, max_rel_);
  }
  std::string name_;
  Tol tol_;
  int64_t count_ = 0, failures_ = 0;
  double max_abs_ = 0, max_rel_ = 0;
};

template <typename... A>
std::string at_str(A... a) {
  std::ostringstream os;
  os << "(";
  int k = 0;
  ((os << (k++ ? "," : "") << a), ...);
  os << ")";
  return os.str();
}

// Tolerances: the reference accumulates in float32 and rounds `out` once to
// bf16/fp16 (RNE), so out is within half an output ulp (relative <= 2^-9 for
// bf16, 2^-12 for fp16) plus float32 noise of the float64 oracle. The bounds
// below leave a 4x margin on the rounding term.
constexpr Tol kTolOutBf16{1.0 / 128, 2e-5};   // 2^-7 relative
constexpr Tol kTolOutFp16{1.0 / 1024, 2e-5};  // 2^-10 relative
constexpr Tol kTolLse{1e-5, 1e-5};             // float32 lse / max_logits

}  // namespace flashmla::testing
