// Dense MLA decode through the C++ core, as an inference engine would call it:
// build TensorRefs over its own buffers, ask the plan for the buffer sizes,
// allocate them, run. CPU tensors use the reference backend; CUDA tensors (device
// pointers, a cudaStream_t in params.stream) the sm90 kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "flashmla/flashmla.h"

namespace {
uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

int main() {
  using namespace flashmla;
  const int64_t b = 2, s_q = 1, h_q = 16, h_kv = 1, d_qk = 576, pbs = 64, max_pages = 4;
  const std::vector<int32_t> cache_seqlens = {200, 0};  // the second request is empty: out 0, lse +inf
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.f, 1.f);  // logits of ~unit spread: a peaked softmax
  std::vector<uint16_t> q(b * s_q * h_q * d_qk), k_cache(b * max_pages * pbs * h_kv * d_qk);
  for (auto& x : q) x = to_bf16(normal(rng));
  for (auto& x : k_cache) x = to_bf16(normal(rng));
  std::vector<int32_t> block_table(b * max_pages);
  for (int64_t i = 0; i < b * max_pages; ++i) block_table[i] = static_cast<int32_t>((i * 5) % (b * max_pages));

  DenseDecodeParams p;
  p.q = make_tensor_ref(q.data(), DType::kBFloat16, {b, s_q, h_q, d_qk});
  p.k_cache = make_tensor_ref(k_cache.data(), DType::kBFloat16, {b * max_pages, pbs, h_kv, d_qk});
  p.block_table = make_tensor_ref(block_table.data(), DType::kInt32, {b, max_pages});
  p.cache_seqlens = make_tensor_ref(const_cast<int32_t*>(cache_seqlens.data()), DType::kInt32, {b});
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(d_qk));
  p.causal = false;

  DecodePlan plan;
  if (Status st = dense_decode_plan(p, &plan); !st.ok()) {
    std::fprintf(stderr, "%s: %s\n", error_kind_name(st.kind), st.message.c_str());
    return 1;
  }
  std::vector<uint16_t> out(b * s_q * h_q * kDimV);
  std::vector<float> lse(b * h_q * s_q);
  std::vector<int32_t> tsm(plan.num_sm_parts * kTileSchedulerMetadataWidth), num_splits(plan.num_splits_len);
  std::vector<uint8_t> workspace(plan.workspace_bytes);
  p.out = make_tensor_ref(out.data(), DType::kBFloat16, {b, s_q, h_q, kDimV});
  p.lse = make_tensor_ref(lse.data(), DType::kFloat32, {b, h_q, s_q});
  p.tile_scheduler_metadata = make_tensor_ref(tsm.data(), DType::kInt32, {plan.num_sm_parts, 8});
  p.num_splits = make_tensor_ref(num_splits.data(), DType::kInt32, {plan.num_splits_len});
  p.workspace = workspace.data();
  p.workspace_bytes = plan.workspace_bytes;
  if (Status st = dense_decode_fwd(p); !st.ok()) {
    std::fprintf(stderr, "%s: %s\n", error_kind_name(st.kind), st.message.c_str());
    return 1;
  }
  std::printf("request 0: lse[head 0] = %.5f, out[head 0][0..3] = %.5f %.5f %.5f %.5f\n", lse[0],
              from_bf16(out[0]), from_bf16(out[1]), from_bf16(out[2]), from_bf16(out[3]));
  std::printf("request 1 (empty): lse = %f, out[0] = %f\n", lse[h_q * s_q], from_bf16(out[s_q * h_q * kDimV]));
  // Request 0 again in double precision, every head: its keys through the block table, V = the first 512 dims of
  // each key. lse is natural log; out is bf16, so it is compared relative to the largest value.
  double lse_err = 0, out_err = 0, out_max = 0;
  for (int64_t h = 0; h < h_q; ++h) {
    const int64_t n = cache_seqlens[0];
    std::vector<double> w(n);
    double m = -INFINITY;
    auto key = [&](int64_t t) {  // request 0's token t (h_kv = 1)
      return &k_cache[(static_cast<int64_t>(block_table[t / pbs]) * pbs + t % pbs) * h_kv * d_qk];
    };
    for (int64_t t = 0; t < n; ++t) {
      double dot = 0;
      for (int64_t d = 0; d < d_qk; ++d) dot += double(from_bf16(q[h * d_qk + d])) * from_bf16(key(t)[d]);
      w[t] = dot * p.softmax_scale;
      m = std::max(m, w[t]);
    }
    double sum = 0;
    for (double& x : w) sum += (x = std::exp(x - m));
    lse_err = std::max(lse_err, std::abs(m + std::log(sum) - lse[h * s_q]));
    for (int64_t j = 0; j < kDimV; ++j) {
      double o = 0;
      for (int64_t t = 0; t < n; ++t) o += w[t] / sum * from_bf16(key(t)[j]);
      out_err = std::max(out_err, std::abs(o - from_bf16(out[h * kDimV + j])));
      out_max = std::max(out_max, std::abs(o));
    }
  }
  std::printf("request 0 against double precision: max |lse - ref| = %.2e, max |out - ref| / max |ref| = %.2e\n",
              lse_err, out_err / out_max);
  const bool ok = lse_err < 1e-3 && out_err < 1e-2 * out_max && std::isinf(lse[h_q * s_q]) &&
                  from_bf16(out[s_q * h_q * kDimV]) == 0.f;

  p.block_table.dtype = DType::kInt64;  // bad input: a Status naming the argument, never a crash
  Status bad = dense_decode_fwd(p);
  std::printf("wrong block_table dtype -> %s: %s\n", error_kind_name(bad.kind), bad.message.c_str());
  return ok && bad.kind == ErrorKind::kType ? 0 : 1;
}
