// src/reference/quant.cpp — FP8 KV-cache quantization / dequantization (spec §3.5),
// bit-exact with FlashMLA's tests/quant.py.
//
//   kv_bf16  (num_blocks, pbs, 1, d)          bf16, d = 576 (kFP8V32) or 512 (kFP8Model1)
//   packed   (num_blocks, pbs, 1, 656|584)    1-byte elements; token stride stride(1)
//            (= bytes per token), block stride stride(0) >= pbs * bytes per token.
//
// Quantize, per token and NoPE tile (V32: 4 x 128 dims, MODEL1: 7 x 64 dims):
//   amax = max |x|, s_inv = amax / 448, scale = 2^ceil(log2(max(s_inv, 1e-4)))  (float32),
//   q = e4m3(float(x) / scale) (RNE); V32 stores scale as float32, MODEL1 as e8m0
//   (exponent + 127, NaN -> 0xFF) plus a zero pad byte; RoPE copied bit-exactly.
// Bytes between pbs * bytes_per_token and the block stride (padding) are left untouched.
// Dequantize: V32 bf16(float(fp8) * scale), MODEL1 bf16(float(fp8) * 2^(e-127)); RoPE copied.
#include <exception>
#include <new>
#include <string>

#include "reference/attention_core.h"
#include "reference/fp8_cache.h"
#include "reference/reference.h"
#include "reference/thread_pool.h"

namespace flashmla::reference {

namespace {

/// Byte locations of token (block, row) of a packed cache tensor.
Fp8TokenBytes packed_token(KVFormat fmt, const TensorRef& packed, int64_t block, int64_t row) {
  uint8_t* block_base = static_cast<uint8_t*>(packed.data) + block * packed.stride[0];
  return fp8_token_bytes(fmt, block_base, packed.shape[1], packed.stride[1], row);
}

}  // namespace

Status quantize_kv_cache(KVFormat format, const TensorRef& kv_bf16, const TensorRef& packed) {
  return run_guarded("quantize_kv_cache", [&] {
    const int64_t pbs = kv_bf16.shape[1];
    parallel_for(kv_bf16.shape[0] * pbs, [&](int64_t token) {
      const int64_t block = token / pbs, row = token % pbs;
      const uint16_t* x = elem<const uint16_t>(kv_bf16, block, row, 0, 0);
      fp8_quant_token(format, x, kv_bf16.stride[3], packed_token(format, packed, block, row));
    });
  });
}

Status dequantize_kv_cache(KVFormat format, const TensorRef& packed, const TensorRef& kv_bf16) {
  return run_guarded("dequantize_kv_cache", [&] {
    const int64_t pbs = packed.shape[1];
    parallel_for(packed.shape[0] * pbs, [&](int64_t token) {
      const int64_t block = token / pbs, row = token % pbs;
      uint16_t* x = elem<uint16_t>(kv_bf16, block, row, 0, 0);
      fp8_dequant_token_bf16(format, packed_token(format, packed, block, row), x, kv_bf16.stride[3]);
    });
  });
}

}  // namespace flashmla::reference
