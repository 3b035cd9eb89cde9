// tests/gpu/cpp/test_dequant_bits.cu — exhaustive check of the conversion-free FP8 dequantization
// (src/sm90/sparse_decode_kernel.cuh: dequant8_bits, e4m3_nan_bytes, scale_bits_120) against the
// exact one (dequant8: fp8 -> f16 -> f32 -> bf16, times the bf16 scale; spec §2.7), on the GPU.
//
// Every e4m3 byte pair (65536 words, so every byte in both halves and both byte positions) times
//   * every MODEL1 UE8M0 scale byte 0 .. 255 (as the kernel converts it: e8m0_to_bf16_bits), and
//   * V3.2 fp32 scales: powers of two 2^-140 .. 2^20, 4096 random normal floats over 2^-30 .. 2^10,
//     and the specials 0, -0, denormals, inf, NaN, FLT_MAX (rounded to bf16 as the kernel does).
// For each (word, scale) where the precondition holds (no NaN byte, scale_bits_120 true) the fast
// result must equal dequant8's bits exactly; where e4m3_nan_bytes says "no NaN" the word must
// really hold none (and vice versa); and scale_bits_120 must accept every scale with exponent field
// 1 .. 134 (the realistic range) so the fast path is not silently unused. Exit status 0 = pass.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "sm90/sparse_decode_kernel.cuh"

using flashmla::sm90::sparse::dequant8;
using flashmla::sm90::sparse::dequant8_bits;
using flashmla::sm90::sparse::e4m3_nan_bytes;
using flashmla::sm90::sparse::scale_bits_120;

struct Counts {
  unsigned long long checked, mismatched, nan_wrong, fast_refused;
};

// One thread per e4m3 word (4 bytes: the word w and its byte-swapped halves cover every pair in both
// positions), every scale of the list.
__global__ void check_kernel(const uint16_t* scales, int n_scales, Counts* out, uint32_t* first_bad) {
  const uint32_t pair = blockIdx.x * blockDim.x + threadIdx.x;  // 0 .. 65535
  if (pair >= 65536u) return;
  const uint32_t w0 = pair | ((pair ^ 0xA5C3u) << 16);  // the pair in the low half, another pair high
  const uint32_t w1 = (pair << 16) | (pair >> 8) | ((pair & 0xFFu) << 8);
  const uint2 w = make_uint2(w0, w1);
  unsigned long long checked = 0, mismatched = 0, nan_wrong = 0, refused = 0;
  // The NaN detector against a byte-by-byte reference (on a uint4 of the two words, twice).
  bool has_nan = false;
  for (int k = 0; k < 4; ++k) {
    const uint32_t b0 = (w0 >> (8 * k)) & 0x7Fu, b1 = (w1 >> (8 * k)) & 0x7Fu;
    has_nan |= b0 == 0x7Fu || b1 == 0x7Fu;
  }
  const bool said_nan = e4m3_nan_bytes(make_uint4(w0, w1, w0, w1)) != 0;
  if (said_nan != has_nan) ++nan_wrong;
  for (int i = 0; i < n_scales; ++i) {
    const uint32_t sb = scales[i];
    uint32_t s120;
    const bool ok = scale_bits_120(sb, s120);
    const uint32_t e = (sb >> 7) & 0xFFu;
    if (!ok && e >= 1u && e <= 134u) ++refused;
    if (!ok || has_nan) continue;
    __nv_bfloat16_raw r;
    r.x = static_cast<uint16_t>(sb);
    const __nv_bfloat16 s1(r);
    const __nv_bfloat162 s(s1, s1);
    uint32_t hh = (s120 & 0xFFFFu) | ((s120 & 0xFFFFu) << 16);
    const __nv_bfloat162 s2 = *reinterpret_cast<__nv_bfloat162*>(&hh);
    const uint4 a = dequant8(w, s), b = dequant8_bits(w, s2);
    const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
    for (int k = 0; k < 4; ++k) {
      ++checked;
      if (av[k] != bv[k]) {
        ++mismatched;
        if (atomicCAS(first_bad, 0xFFFFFFFFu, pair) == 0xFFFFFFFFu) {
          first_bad[1] = sb;
          first_bad[2] = av[k];
          first_bad[3] = bv[k];
          first_bad[4] = static_cast<uint32_t>(k);
        }
      }
    }
  }
  atomicAdd(&out->checked, checked);
  atomicAdd(&out->mismatched, mismatched);
  atomicAdd(&out->nan_wrong, nan_wrong);
  atomicAdd(&out->fast_refused, refused);
}

static uint16_t f32_to_bf16_rn(float f) {  // host RN-even, NaN kept NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

int main() {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 0;
  }
  std::vector<uint16_t> scales;
  // MODEL1: the kernel's e8m0_to_bf16_bits (0xFF -> NaN, 0 -> the bf16 subnormal 2^-127, else e << 7).
  for (uint32_t e = 0; e < 256; ++e) scales.push_back(e == 0xFFu ? 0x7FC0u : e == 0u ? 0x0040u : static_cast<uint16_t>(e << 7));
  for (int k = -140; k <= 20; ++k) scales.push_back(f32_to_bf16_rn(std::ldexp(1.0f, k)));
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> ex(-30.f, 10.f);
  for (int i = 0; i < 4096; ++i) {
    const float v = std::exp2(ex(rng)) * ((i & 1) ? -1.f : 1.f);
    scales.push_back(f32_to_bf16_rn(v));
  }
  const float specials[] = {0.f, -0.f, 1e-40f, -1e-41f, INFINITY, -INFINITY, NAN, FLT_MAX, 1.17549435e-38f, 255.f, 256.f, 448.f};
  for (float v : specials) scales.push_back(f32_to_bf16_rn(v));

  uint16_t* d_scales = nullptr;
  Counts* d_counts = nullptr;
  uint32_t* d_bad = nullptr;
  cudaMalloc(&d_scales, scales.size() * sizeof(uint16_t));
  cudaMalloc(&d_counts, sizeof(Counts));
  cudaMalloc(&d_bad, 5 * sizeof(uint32_t));
  cudaMemcpy(d_scales, scales.data(), scales.size() * sizeof(uint16_t), cudaMemcpyHostToDevice);
  cudaMemset(d_counts, 0, sizeof(Counts));
  cudaMemset(d_bad, 0xFF, 5 * sizeof(uint32_t));
  check_kernel<<<256, 256>>>(d_scales, static_cast<int>(scales.size()), d_counts, d_bad);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("FAIL: kernel error %s\n", cudaGetErrorString(err));
    return 1;
  }
  Counts c;
  uint32_t bad[5];
  cudaMemcpy(&c, d_counts, sizeof(c), cudaMemcpyDeviceToHost);
  cudaMemcpy(bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost);
  std::printf("dequant8_bits vs dequant8: %llu bf16x2 words checked over %zu scales, %llu mismatched; "
              "NaN detector wrong on %llu words; normal scales refused %llu times\n",
              c.checked, scales.size(), c.mismatched, c.nan_wrong, c.fast_refused);
  if (c.mismatched != 0)
    std::printf("first mismatch: pair 0x%04x scale bits 0x%04x word %u: dequant8 0x%08x, bits 0x%08x\n", bad[0],
                bad[1], bad[4], bad[2], bad[3]);
  const bool pass = c.checked > 0 && c.mismatched == 0 && c.nan_wrong == 0 && c.fast_refused == 0;
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}
