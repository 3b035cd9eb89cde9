// Validation (src/core/validate.cpp) and host scheduler (src/core/scheduler.cpp) tests.
// Every bad input must come back as a Status with the right ErrorKind and a
// message that names the offending argument.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/scheduler.h"
#include "core/validate.h"
#include "flashmla/flashmla.h"

namespace flashmla {
namespace {

struct DenseCase {
  int64_t b = 2, s_q = 1, h_q = 16, h_kv = 1, d = 576, pbs = 64, num_blocks = 4, max_blocks = 2;
  std::vector<uint16_t> q, k;
  std::vector<int32_t> block_table, seqlens;
  DenseDecodeParams p;

  DenseCase() { build(); }
  void build() {
    q.assign(b * s_q * h_q * d, 0x3f80);
    k.assign(num_blocks * pbs * h_kv * d, 0x3f80);
    block_table.assign(b * max_blocks, 0);
    for (int64_t i = 0; i < b * max_blocks; ++i) block_table[i] = static_cast<int32_t>(i % num_blocks);
    seqlens.assign(b, 70);
    p = DenseDecodeParams{};
    p.q = make_tensor_ref(q.data(), DType::kBFloat16, {b, s_q, h_q, d});
    p.k_cache = make_tensor_ref(k.data(), DType::kBFloat16, {num_blocks, pbs, h_kv, d});
    p.block_table = make_tensor_ref(block_table.data(), DType::kInt32, {b, max_blocks});
    p.cache_seqlens = make_tensor_ref(seqlens.data(), DType::kInt32, {b});
    p.softmax_scale = 0.05f;
  }
};

void expect_error(const Status& st, ErrorKind kind, const std::string& needle) {
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.kind, kind) << st.message;
  EXPECT_NE(st.message.find(needle), std::string::npos) << "message: " << st.message << "\nexpected to contain: " << needle;
}

TEST(ValidationDense, AcceptsValidInput) {
  DenseCase c;
  DecodePlan plan;
  ASSERT_TRUE(dense_decode_plan(c.p, &plan).ok());
  EXPECT_EQ(plan.num_splits_len, 3);
  EXPECT_GE(plan.num_sm_parts, 1);
}

TEST(ValidationDense, WrongDtypeIsTypeError) {
  DenseCase c;
  c.p.q.dtype = DType::kFloat32;
  DecodePlan plan;
  expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kType, "q: expected dtype bfloat16 or float16, got float32");
  c.build();
  c.p.k_cache.dtype = DType::kFloat16;
  expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kType, "k_cache");
  c.build();
  c.p.block_table.dtype = DType::kInt64;
  expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kType, "block_table");
  c.build();
  c.p.cache_seqlens.dtype = DType::kInt64;
  expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kType, "cache_seqlens");
}

TEST(ValidationDense, ShapeErrorsNameTheArgument) {
  DecodePlan plan;
  {
    DenseCase c;
    c.p.q.shape[3] = 128;
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "q: head dim d_qk");
  }
  {
    DenseCase c;
    c.p.head_dim_v = 576;
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "head_dim_v");
  }
  {
    DenseCase c;
    c.h_q = 6;
    c.h_kv = 4;
    c.build();
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "h_q % h_kv");
  }
  {
    DenseCase c;
    c.p.q.stride[3] = 2;
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "q: the last dimension must be contiguous");
  }
  {
    DenseCase c;
    c.p.cache_seqlens.shape[0] = 3;
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "cache_seqlens: expected shape (2,)");
  }
  {
    DenseCase c;
    c.p.q.ndim = 3;
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "q: expected a 4-D tensor");
  }
  {
    DenseCase c;
    c.p.cache_seqlens.defined = false;
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "cache_seqlens: a tensor is required");
  }
}

TEST(ValidationDense, ValueChecksOnTheHost) {
  DecodePlan plan;
  {
    DenseCase c;
    c.seqlens[1] = 129;  // 3 pages of 64, table has 2 columns
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "block_table too short for cache_seqlens");
  }
  {
    DenseCase c;
    c.block_table[1] = 2147480000;  // sentinel inside the used range
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "block_table[0, 1] = 2147480000 is out of range");
  }
  {
    DenseCase c;
    c.seqlens[0] = 64;
    c.block_table[1] = 2147480000;  // sentinel past the last used page: legal
    EXPECT_TRUE(dense_decode_plan(c.p, &plan).ok());
  }
  {
    DenseCase c;
    c.seqlens[0] = -1;
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "cache_seqlens[0] = -1");
  }
}

/// A dense case with its outputs and metadata buffers allocated as the plan asks.
struct DenseRun {
  DenseCase c;
  DecodePlan plan;
  std::vector<uint16_t> out;
  std::vector<float> lse;
  std::vector<int32_t> tsm, splits;
  DenseRun() {
    EXPECT_TRUE(dense_decode_plan(c.p, &plan).ok());
    out.assign(c.b * c.s_q * c.h_q * 512, 0);
    lse.assign(c.b * c.h_q * c.s_q, 0.f);
    tsm.assign(plan.num_sm_parts * 8, 0);
    splits.assign(plan.num_splits_len, 0);
    c.p.out = make_tensor_ref(out.data(), DType::kBFloat16, {c.b, c.s_q, c.h_q, 512});
    c.p.lse = make_tensor_ref(lse.data(), DType::kFloat32, {c.b, c.h_q, c.s_q});
    c.p.tile_scheduler_metadata = make_tensor_ref(tsm.data(), DType::kInt32, {plan.num_sm_parts, 8});
    c.p.num_splits = make_tensor_ref(splits.data(), DType::kInt32, {plan.num_splits_len});
  }
};

TEST(ValidationDense, MixedDevicesAndOutputs) {
  DecodePlan plan;
  DenseCase c;
  c.p.block_table.device = {DeviceType::kCUDA, 0};
  expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "block_table is on cuda:0 but q is on cpu");

  DenseRun r;
  // Metadata given as computed (metadata_ready) must have this call's shape. On the CPU num_sm_parts is the
  // reference thread count: the message says so.
  r.c.p.metadata_ready = true;
  r.c.p.tile_scheduler_metadata.shape[0] = r.plan.num_sm_parts + 1;
  expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "tile_scheduler_metadata: expected shape");
  expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "the same reference thread count");
  r.c.p.tile_scheduler_metadata.shape[0] = r.plan.num_sm_parts;
  r.c.p.metadata_ready = false;
  EXPECT_TRUE(dense_decode_fwd(r.c.p).ok());

  // CPU device ids: a mismatch names both ids (all tensors on one non-zero CPU id are accepted).
  DenseCase d;
  d.p.k_cache.device = {DeviceType::kCPU, 1};
  expect_error(dense_decode_plan(d.p, &plan), ErrorKind::kValue, "k_cache is on cpu:1 but q is on cpu:");
}

TEST(ValidationDense, ComputingCallTakesAnyMetadataRowsOnTheCpu) {
  // A binding sizes the metadata from its own plan; set_reference_num_threads in another thread may change the
  // CPU's count before the call plans again (ops.h: calls in flight keep their count). A call that computes the
  // metadata fills whatever (rows >= 1, 8) buffer it gets, with the same outputs (the reference does not read it).
  DenseRun a, r;
  ASSERT_TRUE(dense_decode_fwd(a.c.p).ok());
  for (int64_t rows : {int64_t{1}, a.plan.num_sm_parts + 3}) {
    std::vector<int32_t> tsm(rows * 8, -7);
    r.c.p.tile_scheduler_metadata = make_tensor_ref(tsm.data(), DType::kInt32, {rows, 8});
    ASSERT_TRUE(dense_decode_fwd(r.c.p).ok()) << rows;
    EXPECT_EQ(a.out, r.out) << rows;
    EXPECT_EQ(0, std::memcmp(a.lse.data(), r.lse.data(), a.lse.size() * sizeof(float))) << rows;
    EXPECT_EQ(tsm[0], 0) << rows;  // part 0 begins at request 0: the schedule was written
  }
}

TEST(ValidationDense, MisalignedWorkspaceIsValueError) {
  // The GPU kernels write / read the split-KV partials as float2 / float4.
  DenseRun r;
  const DenseDecodeParams& p = r.c.p;
  alignas(16) unsigned char ws[64 + 16];
  r.plan.workspace_bytes = 64;  // as a GPU plan would ask for
  EXPECT_TRUE(core::validate_decode_outputs(p.q, p.out, p.lse, DType::kBFloat16, p.tile_scheduler_metadata,
                                            p.num_splits, r.plan, 64, ws).ok());
  expect_error(core::validate_decode_outputs(p.q, p.out, p.lse, DType::kBFloat16, p.tile_scheduler_metadata,
                                             p.num_splits, r.plan, 64, ws + 4),
               ErrorKind::kValue, "workspace: the pointer must be 16-byte aligned");
}

struct SparseCase {
  int64_t b = 2, s_q = 1, h_q = 64, pbs = 64, num_blocks = 2, topk = 64;
  std::vector<uint16_t> q;
  std::vector<uint8_t> cache;
  std::vector<int32_t> indices;
  SparseDecodeParams p;
  SparseCase() {
    q.assign(b * s_q * h_q * 576, 0x3f80);
    cache.assign(num_blocks * pbs * 656, 0);
    indices.assign(b * s_q * topk, -1);
    for (int64_t i = 0; i < b * s_q * topk; ++i) indices[i] = static_cast<int32_t>(i % (num_blocks * pbs));
    p.q = make_tensor_ref(q.data(), DType::kBFloat16, {b, s_q, h_q, 576});
    p.k_cache = make_tensor_ref(cache.data(), DType::kUInt8, {num_blocks, pbs, 1, 656});
    p.indices = make_tensor_ref(indices.data(), DType::kInt32, {b, s_q, topk});
    p.softmax_scale = 0.05f;
  }
};

TEST(ValidationSparse, Checks) {
  DecodePlan plan;
  {
    SparseCase c;
    EXPECT_TRUE(sparse_decode_plan(c.p, &plan).ok());
  }
  {
    SparseCase c;
    c.p.k_cache.shape[3] = 584;
    expect_error(sparse_decode_plan(c.p, &plan), ErrorKind::kValue, "656 bytes per token");
  }
  {
    SparseCase c;
    c.p.q.dtype = DType::kFloat16;
    expect_error(sparse_decode_plan(c.p, &plan), ErrorKind::kType, "q: expected dtype bfloat16");
  }
  {
    SparseCase c;
    c.indices[5] = 128;  // == num_blocks * pbs
    expect_error(sparse_decode_plan(c.p, &plan), ErrorKind::kValue, "indices[0, 0, 5] = 128 is out of range");
  }
  {
    SparseCase c;
    c.indices[5] = -7;  // only -1 marks an invalid decode slot
    expect_error(sparse_decode_plan(c.p, &plan), ErrorKind::kValue, "indices[0, 0, 5] = -7");
  }
  {
    SparseCase c;
    std::vector<int32_t> lens = {3, 64};
    c.indices[10] = 2147483647;  // garbage beyond topk_length[0] = 3 is legal
    c.p.topk_length = make_tensor_ref(lens.data(), DType::kInt32, {2});
    EXPECT_TRUE(sparse_decode_plan(c.p, &plan).ok());
  }
  {
    SparseCase c;
    std::vector<float> sink(3);
    c.p.attn_sink = make_tensor_ref(sink.data(), DType::kFloat32, {3});
    expect_error(sparse_decode_plan(c.p, &plan), ErrorKind::kValue, "attn_sink: expected shape (64,)");
  }
  {
    SparseCase c;
    c.p.extra_k_cache = c.p.k_cache;
    expect_error(sparse_decode_plan(c.p, &plan), ErrorKind::kValue, "extra_indices_in_kvcache: required");
  }
  {
    SparseCase c;
    c.p.k_cache.stride[1] = 700;
    expect_error(sparse_decode_plan(c.p, &plan), ErrorKind::kValue, "stride(1) must be 656");
  }
}

TEST(ValidationPrefill, Checks) {
  std::vector<uint16_t> q(4 * 16 * 512), kv(32 * 512);
  std::vector<int32_t> idx(4 * 64, 0);
  SparsePrefillParams p;
  p.sm_scale = 0.05f;
  p.q = make_tensor_ref(q.data(), DType::kBFloat16, {4, 16, 512});
  p.kv = make_tensor_ref(kv.data(), DType::kBFloat16, {32, 1, 512});
  p.indices = make_tensor_ref(idx.data(), DType::kInt32, {4, 1, 64});
  int64_t ws = 0;
  EXPECT_TRUE(sparse_prefill_plan(p, &ws).ok());
  p.d_v = 576;
  expect_error(sparse_prefill_plan(p, &ws), ErrorKind::kValue, "d_v: must be 512");
  p.d_v = 512;
  p.kv.shape[1] = 2;
  expect_error(sparse_prefill_plan(p, &ws), ErrorKind::kValue, "kv: sparse prefill supports only h_kv = 1");
  p.kv.shape[1] = 1;
  p.indices.shape[0] = 5;
  expect_error(sparse_prefill_plan(p, &ws), ErrorKind::kValue, "indices: expected shape (4, 1, *)");
  p.indices.shape[0] = 4;
  p.indices.dtype = DType::kInt64;
  expect_error(sparse_prefill_plan(p, &ws), ErrorKind::kType, "indices: expected dtype int32");
}

// C++ callers hand the core raw pointers and strides, so null
// data, too many dimensions, negative sizes and overlapping outputs must come back as a Status.

TEST(ValidationCpp, NullDataIsValueErrorInTheOperatorsOnly) {
  {
    DenseRun r;
    ASSERT_TRUE(dense_decode_fwd(r.c.p).ok());
  }
  for (int which = 0; which < 8; ++which) {
    DenseRun r;
    TensorRef* ts[] = {&r.c.p.q, &r.c.p.k_cache, &r.c.p.block_table, &r.c.p.cache_seqlens, &r.c.p.out,
                       &r.c.p.lse, &r.c.p.tile_scheduler_metadata, &r.c.p.num_splits};
    const char* names[] = {"q", "k_cache", "block_table", "cache_seqlens", "out", "lse",
                           "tile_scheduler_metadata", "num_splits"};
    ts[which]->data = nullptr;
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue,
                 std::string(names[which]) + ": the data pointer is null");
  }
  // The shapes-only plan (what JAX calls while tracing) still accepts tensors without data.
  DenseCase c;
  c.p.cache_seqlens.data = nullptr;
  DecodePlan plan;
  EXPECT_TRUE(dense_decode_plan(c.p, &plan).ok());

  SparseCase s;
  std::vector<uint16_t> out(s.b * s.s_q * s.h_q * 512);
  std::vector<float> lse(s.b * s.h_q * s.s_q);
  ASSERT_TRUE(sparse_decode_plan(s.p, &plan).ok());
  std::vector<int32_t> tsm(plan.num_sm_parts * 8), splits(plan.num_splits_len);
  s.p.out = make_tensor_ref(out.data(), DType::kBFloat16, {s.b, s.s_q, s.h_q, 512});
  s.p.lse = make_tensor_ref(lse.data(), DType::kFloat32, {s.b, s.h_q, s.s_q});
  s.p.tile_scheduler_metadata = make_tensor_ref(tsm.data(), DType::kInt32, {plan.num_sm_parts, 8});
  s.p.num_splits = make_tensor_ref(splits.data(), DType::kInt32, {plan.num_splits_len});
  ASSERT_TRUE(sparse_decode_fwd(s.p).ok());
  s.p.indices.data = nullptr;
  expect_error(sparse_decode_fwd(s.p), ErrorKind::kValue, "indices: the data pointer is null");
}

TEST(ValidationCpp, OutputStridesMustNotOverlapOrBeNegative) {
  {
    DenseRun r;
    r.c.p.out.stride[3] = 0;  // every column of a row at one address
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "out: output strides overlap");
  }
  {
    DenseRun r;
    r.c.p.out.stride[0] = -r.c.p.out.stride[0];
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "out: negative strides are not supported");
  }
  {
    DenseRun r;
    r.c.p.lse.stride[1] = 0;
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "lse: output strides overlap");
  }
  {
    DenseRun r;  // padded rows are fine
    std::vector<uint16_t> padded(r.c.b * r.c.s_q * r.c.h_q * 600, 0);
    r.c.p.out = make_tensor_ref(padded.data(), DType::kBFloat16, {r.c.b, r.c.s_q, r.c.h_q, 512},
                                {r.c.s_q * r.c.h_q * 600, r.c.h_q * 600, 600, 1});
    EXPECT_TRUE(dense_decode_fwd(r.c.p).ok());
  }
  std::vector<uint16_t> q(4 * 16 * 512), kv(32 * 512), out(4 * 16 * 512);
  std::vector<int32_t> idx(4 * 64, 0);
  std::vector<float> ml(4 * 16), lse(4 * 16);
  SparsePrefillParams p;
  p.sm_scale = 0.05f;
  p.q = make_tensor_ref(q.data(), DType::kBFloat16, {4, 16, 512});
  p.kv = make_tensor_ref(kv.data(), DType::kBFloat16, {32, 1, 512});
  p.indices = make_tensor_ref(idx.data(), DType::kInt32, {4, 1, 64});
  p.out = make_tensor_ref(out.data(), DType::kBFloat16, {4, 16, 512});
  p.max_logits = make_tensor_ref(ml.data(), DType::kFloat32, {4, 16});
  p.lse = make_tensor_ref(lse.data(), DType::kFloat32, {4, 16});
  ASSERT_TRUE(sparse_prefill_fwd(p).ok());
  p.max_logits.stride[0] = 8;  // rows of 16 overlap
  expect_error(sparse_prefill_fwd(p), ErrorKind::kValue, "max_logits: output strides overlap");
}

TEST(ValidationCpp, BadTensorRefsAreValueErrors) {
  DecodePlan plan;
  {
    DenseCase c;  // 7 dimensions: make_tensor_ref marks the ref invalid instead of writing past shape[]
    c.p.q = make_tensor_ref(c.q.data(), DType::kBFloat16, {c.b, c.s_q, c.h_q, 576, 1, 1, 1});
    EXPECT_EQ(c.p.q.ndim, kInvalidTensorDims);
    EXPECT_EQ(c.p.q.device.type, DeviceType::kCPU);
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "q: invalid tensor");
  }
  {
    DenseCase c;  // a stride list of the wrong length
    c.p.block_table = make_tensor_ref(c.block_table.data(), DType::kInt32, {c.b, c.max_blocks}, {c.max_blocks});
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "block_table: invalid tensor");
  }
  {
    DenseCase c;
    c.p.k_cache.shape[0] = -3;
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "k_cache: negative size in dim 0");
  }
  {
    DenseCase c;
    c.p.q.device.type = static_cast<DeviceType>(7);
    expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "q: unknown device type 7");
  }
  std::vector<uint16_t> q(4 * 16 * 512), kv(32 * 512);
  std::vector<int32_t> idx(4 * 64, 0);
  SparsePrefillParams p;  // a negative s_q (the shape check's wildcards once let it through)
  p.sm_scale = 0.05f;
  p.q = make_tensor_ref(q.data(), DType::kBFloat16, {-2, 16, 512});
  p.kv = make_tensor_ref(kv.data(), DType::kBFloat16, {32, 1, 512});
  p.indices = make_tensor_ref(idx.data(), DType::kInt32, {-2, 1, 64});
  int64_t ws = 0;
  expect_error(sparse_prefill_plan(p, &ws), ErrorKind::kValue, "q: negative size in dim 0");
}

// A data pointer that is not a multiple of its element size (a byte offset into a buffer): the CPU
// reference reads and writes elements through typed pointers, which is undefined behaviour there
// (UBSan: "load of misaligned address"; a vectorised loop may fault), so every operator refuses it,
// in the plans too (they read the length and index values).
TEST(ValidationCpp, DataNotAlignedToItsElementsIsValueError) {
  const char* names[] = {"q", "k_cache", "block_table", "cache_seqlens", "out", "lse",
                         "tile_scheduler_metadata", "num_splits"};
  for (int which = 0; which < 8; ++which) {
    DenseRun r;
    TensorRef* ts[] = {&r.c.p.q, &r.c.p.k_cache, &r.c.p.block_table, &r.c.p.cache_seqlens, &r.c.p.out,
                       &r.c.p.lse, &r.c.p.tile_scheduler_metadata, &r.c.p.num_splits};
    ts[which]->data = static_cast<char*>(ts[which]->data) + 1;
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue,
                 std::string(names[which]) + ": the data pointer is not aligned to its elements");
    if (which < 4) {
      DecodePlan plan;
      expect_error(dense_decode_plan(r.c.p, &plan), ErrorKind::kValue,
                   std::string(names[which]) + ": the data pointer is not aligned to its elements");
    }
  }
  {
    DenseRun r;  // (an empty tensor's pointer is never dereferenced: any value is accepted)
    r.c.seqlens.assign(r.c.b, 0);
    r.c.p.block_table.shape[1] = 0;
    r.c.p.block_table.data = reinterpret_cast<void*>(uintptr_t{1});
    EXPECT_TRUE(dense_decode_fwd(r.c.p).ok());
  }
  // The FP8 conversion (1-byte packed cache: only the bf16 side can be misaligned).
  std::vector<uint16_t> kv(2 * 64 * 576 + 1, 0x3f80);
  std::vector<uint8_t> packed(2 * 64 * 656);
  const TensorRef good = make_tensor_ref(kv.data(), DType::kBFloat16, {2, 64, 1, 576});
  const TensorRef odd = make_tensor_ref(reinterpret_cast<char*>(kv.data()) + 1, DType::kBFloat16, {2, 64, 1, 576});
  const TensorRef pk = make_tensor_ref(packed.data(), DType::kUInt8, {2, 64, 1, 656});
  ASSERT_TRUE(quantize_kv_cache(KVFormat::kFP8V32, good, pk).ok());
  expect_error(quantize_kv_cache(KVFormat::kFP8V32, odd, pk), ErrorKind::kValue,
               "kv_cache: the data pointer is not aligned to its elements");
  expect_error(dequantize_kv_cache(KVFormat::kFP8V32, pk, odd), ErrorKind::kValue,
               "kv_cache: the data pointer is not aligned to its elements");
}

// Aliasing outputs, null plan pointers, sizes that
// overflow int64, a hand-set ndim read before it was checked, an unset scale.
TEST(ValidationCpp, OutputsMustNotShareMemoryWithOtherArguments) {
  {
    DenseRun r;  // out over the KV cache: once accepted, with a thread-timing-dependent answer
    std::vector<uint16_t> big(r.c.k.size() + r.out.size());
    std::memcpy(big.data(), r.c.k.data(), r.c.k.size() * 2);
    r.c.p.k_cache.data = big.data();
    r.c.p.out.data = big.data() + 64;
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "out: the output's memory overlaps the input k_cache");
  }
  {
    DenseRun r;  // lse inside out
    r.c.p.lse.data = r.out.data();
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "lse: the output's memory overlaps the output out");
  }
  {
    DenseRun r;  // metadata written over q when not ready; read-only (allowed to be anywhere) when ready
    r.c.p.num_splits.data = r.c.q.data();
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "num_splits: the output's memory overlaps the input q");
  }
  {
    DenseRun r;
    ASSERT_TRUE(dense_decode_fwd(r.c.p).ok());
    r.c.p.metadata_ready = true;  // reused metadata is an input: two readers may share it
    EXPECT_TRUE(dense_decode_fwd(r.c.p).ok());
  }
  {
    DenseRun r;  // out and lse in one buffer, side by side: fine
    std::vector<uint16_t> both(r.out.size() + 2 * r.lse.size());
    r.c.p.out.data = both.data();
    r.c.p.lse.data = both.data() + r.out.size();
    EXPECT_TRUE(dense_decode_fwd(r.c.p).ok());
  }
  SparseCase s;
  std::vector<uint16_t> out(s.b * s.s_q * s.h_q * 512);
  std::vector<float> lse(s.b * s.h_q * s.s_q);
  DecodePlan plan;
  ASSERT_TRUE(sparse_decode_plan(s.p, &plan).ok());
  std::vector<int32_t> tsm(plan.num_sm_parts * 8), splits(plan.num_splits_len);
  s.p.out = make_tensor_ref(out.data(), DType::kBFloat16, {s.b, s.s_q, s.h_q, 512});
  s.p.lse = make_tensor_ref(s.indices.data(), DType::kFloat32, {s.b, s.h_q, s.s_q});
  s.p.tile_scheduler_metadata = make_tensor_ref(tsm.data(), DType::kInt32, {plan.num_sm_parts, 8});
  s.p.num_splits = make_tensor_ref(splits.data(), DType::kInt32, {plan.num_splits_len});
  expect_error(sparse_decode_fwd(s.p), ErrorKind::kValue, "lse: the output's memory overlaps the input indices");
  s.p.lse = make_tensor_ref(lse.data(), DType::kFloat32, {s.b, s.h_q, s.s_q});
  EXPECT_TRUE(sparse_decode_fwd(s.p).ok());

  std::vector<uint16_t> kv(2 * 4 * 512, 0x3f80);
  std::vector<uint8_t> packed(2 * 4 * 584 + 4096);
  const TensorRef kv_ref = make_tensor_ref(kv.data(), DType::kBFloat16, {2, 4, 1, 512});
  EXPECT_TRUE(quantize_kv_cache(KVFormat::kFP8Model1, kv_ref,
                                make_tensor_ref(packed.data(), DType::kUInt8, {2, 4, 1, 584})).ok());
  expect_error(quantize_kv_cache(KVFormat::kFP8Model1, kv_ref,
                                 make_tensor_ref(kv.data(), DType::kUInt8, {2, 4, 1, 584})),
               ErrorKind::kValue, "packed: the output's memory overlaps the input kv_cache");
  // A page size of 0 is named on the input (once on the internal `packed` buffer of the Python helper).
  expect_error(quantize_kv_cache(KVFormat::kFP8Model1, make_tensor_ref(kv.data(), DType::kBFloat16, {2, 0, 1, 512}),
                                 make_tensor_ref(packed.data(), DType::kUInt8, {2, 0, 1, 584})),
               ErrorKind::kValue, "kv_cache: page_block_size (dim 1) must be > 0");
}

TEST(ValidationCpp, NullPlanPointersAreValueErrors) {
  DenseCase c;
  expect_error(dense_decode_plan(c.p, nullptr), ErrorKind::kValue, "plan: the DecodePlan pointer is null");
  expect_error(dense_decode_plan_for_shapes(c.p.q.device, 2, 1, 16, 1, nullptr), ErrorKind::kValue, "plan:");
  SparseCase s;
  expect_error(sparse_decode_plan(s.p, nullptr), ErrorKind::kValue, "plan: the DecodePlan pointer is null");
  expect_error(sparse_decode_plan_for_shapes(s.p.q.device, 2, 1, 64, nullptr), ErrorKind::kValue, "plan:");
  SparsePrefillParams p;
  expect_error(sparse_prefill_plan(p, nullptr), ErrorKind::kValue, "workspace_bytes: the pointer is null");
}

TEST(ValidationCpp, SizesBeyondInt64AndBadRanksInTheOperators) {
  {
    DenseRun r;  // 2^32 * 2^32 elements once wrapped to 0 and let a null pointer through
    r.c.p.k_cache.shape[0] = r.c.p.k_cache.shape[1] = int64_t{1} << 32;
    r.c.p.k_cache.data = nullptr;
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "k_cache: shape");
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "64-bit");
  }
  {
    DenseRun r;  // a stride whose reach overflows byte offsets
    r.c.p.k_cache.stride[0] = int64_t{1} << 62;
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "k_cache: stride");
  }
  {
    DenseRun r;  // a hand-set rank beyond kMaxTensorDims is rejected before numel() reads shape[6..]
    r.c.p.q.ndim = 100;
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "q: invalid tensor");
  }
  SparseCase s;  // (2^32, 2^32, 1, 656) bytes: the int32 token-count check once overflowed
  s.p.k_cache.shape[0] = s.p.k_cache.shape[1] = int64_t{1} << 32;
  DecodePlan plan;
  expect_error(sparse_decode_plan(s.p, &plan), ErrorKind::kValue, "k_cache: shape");
}

TEST(ValidationCpp, MakeTensorRefOfSizesBeyondInt64SaturatesItsStrides) {
  // make_tensor_ref computes row-major strides as products of the sizes: for a shape with more elements
  // than int64 counts they once overflowed inside the library (signed overflow: UBSan's "signed integer
  // overflow" at src/core/tensor.cpp) and wrapped -- here to stride(0) = 576 * 2^80 mod 2^64 = 0. The
  // strides saturate instead, and every operator rejects the shape by its element count.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t big = int64_t{1} << 40;
  std::vector<uint16_t> buf(16);
  const TensorRef t = make_tensor_ref(buf.data(), DType::kBFloat16, {2, big, big, 576});
  ASSERT_EQ(t.ndim, 4);
  EXPECT_EQ(t.stride[3], 1);
  EXPECT_EQ(t.stride[2], 576);
  EXPECT_EQ(t.stride[1], 576 * big);
  EXPECT_EQ(t.stride[0], kMax);
  const TensorRef u = make_tensor_ref(buf.data(), DType::kBFloat16, {3, 5, big, big, big, 1});
  EXPECT_EQ(u.stride[5], 1);
  EXPECT_EQ(u.stride[4], 1);
  EXPECT_EQ(u.stride[3], big);
  EXPECT_EQ(u.stride[2], kMax);
  EXPECT_EQ(u.stride[1], kMax);
  EXPECT_EQ(u.stride[0], kMax);
  // Sizes whose product fits keep exact row-major strides, up to the largest.
  const TensorRef v = make_tensor_ref(buf.data(), DType::kUInt8, {2, int64_t{1} << 31, int64_t{1} << 31});
  EXPECT_EQ(v.stride[0], int64_t{1} << 62);
  {
    DenseRun r;
    r.c.p.q = make_tensor_ref(r.c.q.data(), DType::kBFloat16, {2, big, big, 576});
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "q: shape");
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "64-bit");
  }
  {
    DenseRun r;  // a zero size: no elements, so the saturated strides are never used and the tensor is valid
    r.c.p.block_table = make_tensor_ref(nullptr, DType::kInt32, {r.c.b, 0});
    const TensorRef e = make_tensor_ref(nullptr, DType::kInt32, {0, big, big, big});
    EXPECT_EQ(e.stride[0], kMax);
    r.c.seqlens.assign(r.c.b, 0);
    EXPECT_TRUE(dense_decode_fwd(r.c.p).ok());
  }
}

TEST(ValidationCpp, OverflowEdgesOfTheSizeChecks) {
  // Edges of the checks above.
  DecodePlan plan;
  const Device cpu{};
  for (auto [b, s_q, h_q] : {std::tuple<int64_t, int64_t, int64_t>{1, int64_t{1} << 32, int64_t{1} << 32},
                             {1, int64_t{1} << 62, 4}, {INT64_MAX, 1, 1}}) {
    // rows = s_q * h_q once wrapped to 0 and divided by zero (SIGFPE); b + 1 wrapped num_splits_len
    expect_error(dense_decode_plan_for_shapes(cpu, b, s_q, h_q, 1, &plan), ErrorKind::kValue, "sizes too large");
    expect_error(sparse_decode_plan_for_shapes(cpu, b, s_q, h_q, &plan), ErrorKind::kValue, "sizes too large");
  }
  {
    SparseCase s;  // a 1-byte cache whose reach is INT64_MAX: (reach + 1) once overflowed and passed
    s.p.k_cache = make_tensor_ref(s.cache.data(), DType::kUInt8, {2, 1, 1, 656}, {INT64_MAX - 655, 656, 656, 1});
    expect_error(sparse_decode_plan(s.p, &plan), ErrorKind::kValue, "k_cache: stride");
    s.p.k_cache = make_tensor_ref(s.cache.data(), DType::kUInt8, {2, 1, 1, 656}, {INT64_MIN, 656, 656, 1});
    expect_error(sparse_decode_plan(s.p, &plan), ErrorKind::kValue, "k_cache: stride");
  }
  {
    DenseRun r;  // a range that wraps around the address space hides no overlap
    r.c.p.k_cache.stride[0] = int64_t{1} << 59;  // 3 * 2^60 bytes from the first block to the last
    r.c.p.k_cache.data = reinterpret_cast<void*>(~uintptr_t{0} - 4095);
    expect_error(dense_decode_fwd(r.c.p), ErrorKind::kValue, "k_cache: the tensor's byte range wraps");
  }
  {
    DenseRun r;  // tensors without elements keep arbitrary strides
    r.c.p.block_table = make_tensor_ref(nullptr, DType::kInt32, {r.c.b, 0}, {INT64_MAX / 2, 1});
    r.c.seqlens.assign(r.c.b, 0);
    EXPECT_TRUE(dense_decode_fwd(r.c.p).ok());
  }
}

TEST(ValidationCpp, UnsetScaleIsAValueError) {
  DenseCase c;
  DecodePlan plan;
  c.p.softmax_scale = DenseDecodeParams{}.softmax_scale;
  expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kValue, "softmax_scale: must be finite, got nan");
  c.p.softmax_scale = 0.f;  // legal: uniform weights
  EXPECT_TRUE(dense_decode_plan(c.p, &plan).ok());
  SparseCase s;
  s.p.softmax_scale = SparseDecodeParams{}.softmax_scale;
  expect_error(sparse_decode_plan(s.p, &plan), ErrorKind::kValue, "softmax_scale: must be finite, got nan");
  std::vector<uint16_t> q(4 * 16 * 512), kv(32 * 512);
  std::vector<int32_t> idx(4 * 64, 0);
  SparsePrefillParams p;
  p.q = make_tensor_ref(q.data(), DType::kBFloat16, {4, 16, 512});
  p.kv = make_tensor_ref(kv.data(), DType::kBFloat16, {32, 1, 512});
  p.indices = make_tensor_ref(idx.data(), DType::kInt32, {4, 1, 64});
  int64_t ws = 0;
  expect_error(sparse_prefill_plan(p, &ws), ErrorKind::kValue, "sm_scale: must be finite, got nan");
}

TEST(KvFormat, HeadDimsWithoutAnFp8Format) {
  EXPECT_EQ(fp8_format_for_head_dim(576), KVFormat::kFP8V32);
  EXPECT_EQ(fp8_format_for_head_dim(512), KVFormat::kFP8Model1);
  EXPECT_FALSE(is_fp8_format(fp8_format_for_head_dim(128)));
  EXPECT_EQ(fp8_bytes_per_token(fp8_format_for_head_dim(128)), 0);
  EXPECT_EQ(fp8_bytes_per_token(KVFormat::kFP8V32), 656);
  EXPECT_EQ(fp8_bytes_per_token(KVFormat::kFP8Model1), 584);
}

TEST(ValidationGpu, NoCudaBackendIsNotImplemented) {
  if (has_cuda_backend()) GTEST_SKIP() << "built with CUDA";
  DenseCase c;
  for (TensorRef* t : {&c.p.q, &c.p.k_cache, &c.p.block_table, &c.p.cache_seqlens}) t->device = {DeviceType::kCUDA, 0};
  DecodePlan plan;
  expect_error(dense_decode_plan(c.p, &plan), ErrorKind::kNotImplemented, "no CUDA backend");
}

// ------------------------------------------------------------------ scheduler
TEST(PlanForShapes, AgreesWithThePlanOfTensors) {
  DenseCase c;
  for (int64_t h_kv : {1, 2}) {
    c.h_kv = h_kv;
    c.build();
    DecodePlan a, b;
    ASSERT_TRUE(dense_decode_plan(c.p, &a).ok());
    ASSERT_TRUE(dense_decode_plan_for_shapes(c.p.q.device, c.b, c.s_q, c.h_q, h_kv, &b).ok());
    EXPECT_EQ(a.num_sm_parts, b.num_sm_parts);
    EXPECT_EQ(a.num_splits_len, b.num_splits_len);
    EXPECT_EQ(a.workspace_bytes, b.workspace_bytes);
  }
  DecodePlan p;
  expect_error(dense_decode_plan_for_shapes(Device{}, 2, 1, 16, 3, &p), ErrorKind::kValue, "h_q % h_kv == 0");
  expect_error(dense_decode_plan_for_shapes(Device{}, 0, 1, 16, 1, &p), ErrorKind::kValue, "got b=0");
  expect_error(sparse_decode_plan_for_shapes(Device{}, 1, 0, 16, &p), ErrorKind::kValue, "s_q=0");
  ASSERT_TRUE(sparse_decode_plan_for_shapes(Device{}, 3, 2, 64, &p).ok());
  EXPECT_EQ(p.num_splits_len, 4);
  EXPECT_GE(p.num_sm_parts, 1);
}

// Spec §4's overhead (FlashMLA's) for dense decode; sparse decode's is a build setting whose default is the same.
static_assert(core::kDenseDecodeSchedOverheadBlocks == 5, "dense decode's scheduler overhead is spec §4's 5 blocks");

TEST(Scheduler, WorkedExampleOfSpec46) {
  // s' = [1000, 64, 0, 5000], 8 parts -> num_splits = [0, 2, 3, 4, 10] (spec §4.6, overhead 5).
  std::vector<int64_t> lens = {1000, 64, 0, 5000};
  std::vector<TileSchedulerMetadataRow> rows(8);
  std::vector<int32_t> splits(5);
  core::compute_tile_schedule(lens, 8, 5, rows.data(), splits.data());
  EXPECT_EQ(splits, (std::vector<int32_t>{0, 2, 3, 4, 10}));
  EXPECT_EQ(rows[0].begin_req_idx, 0);
  EXPECT_EQ(rows[0].end_req_idx, 0);
  EXPECT_EQ(rows[0].end_block_idx, 15);
  EXPECT_EQ(rows[0].is_last_req_splitted, 1);
  EXPECT_EQ(rows[1].begin_req_idx, 0);
  EXPECT_EQ(rows[1].begin_block_idx, 15);
  EXPECT_EQ(rows[1].end_req_idx, 2);
  EXPECT_EQ(rows[1].end_block_idx, 0);
  EXPECT_EQ(rows[1].is_first_req_splitted, 1);
  EXPECT_EQ(rows[1].is_last_req_splitted, 0);
  for (int p = 2; p < 8; ++p) {
    EXPECT_EQ(rows[p].begin_req_idx, 3);
    EXPECT_EQ(rows[p].end_req_idx, 3);
    EXPECT_EQ(rows[p].begin_block_idx, 15 * (p - 2));
    EXPECT_EQ(rows[p].end_block_idx, p == 7 ? 79 : 15 * (p - 1));
    EXPECT_EQ(rows[p].begin_split_idx, p - 2);
  }
}

// Scheduler overheads the partition is checked with (any value >= 0 is valid): 0 and 1 (the smallest
// budgets, step = payload - overhead = ceil(total / parts)), 2 and spec §4's 5.
constexpr int64_t kOverheads[] = {0, 1, 2, 5};

TEST(Scheduler, CoversEveryBlockExactlyOnce) {
  std::vector<int64_t> lens = {1, 0, 4096, 63, 64, 65, 20000, 0, 0, 777};
  for (int64_t overhead : kOverheads) {
    for (int64_t parts : {1, 3, 8, 33, 66, 132}) {
      SCOPED_TRACE("overhead " + std::to_string(overhead));
      std::vector<TileSchedulerMetadataRow> rows(parts);
      std::vector<int32_t> splits(lens.size() + 1, -1);
      core::compute_tile_schedule(lens, parts, overhead, rows.data(), splits.data());
      EXPECT_EQ(splits[0], 0);
      // At most one split per part beyond one per request: the partials buffers hold b + parts.
      EXPECT_LE(splits.back(), static_cast<int32_t>(lens.size() + parts - 1));
      std::vector<int64_t> covered(lens.size(), 0);
      std::vector<int32_t> pieces(lens.size(), 0);
      for (const auto& r : rows) {
        if (r.begin_req_idx >= static_cast<int>(lens.size())) continue;
        for (int req = r.begin_req_idx; req <= r.end_req_idx; ++req) {
          const int64_t nblk = std::max<int64_t>(lens[req] - 1, 0) / 64 + 1;
          const int64_t lo = req == r.begin_req_idx ? r.begin_block_idx : 0;
          const int64_t hi =
              req == r.end_req_idx ? (r.end_block_idx == 0 && lens[req] == 0 ? 1 : r.end_block_idx) : nblk;
          covered[req] += hi - lo;
          pieces[req] += 1;
        }
      }
      for (size_t i = 0; i < lens.size(); ++i) {
        const int64_t nblk = std::max<int64_t>(lens[i] - 1, 0) / 64 + 1;
        EXPECT_EQ(covered[i], nblk) << "request " << i << " parts " << parts;
        EXPECT_EQ(splits[i + 1] - splits[i], pieces[i]) << "request " << i << " parts " << parts;
      }
    }
  }
}

// The sparse combine's compact grid (src/sm90/decode/sparse_fp8/sparse_decode.cu) launches one CTA row per part
// and lets core::split_request_of_part say which split request, if any, the part combines: every
// request with more than one split must be named by exactly one part, no other request by any.
TEST(Scheduler, SplitRequestOfPartNamesEachSplitRequestOnce) {
  std::mt19937_64 rng(15);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t b = 1 + static_cast<int64_t>(rng() % 300);
    const int64_t parts_choice[] = {1, 2, 3, 7, 33, 66, 132};
    const int64_t parts = parts_choice[rng() % 7];
    const int64_t overhead = kOverheads[trial % 4];
    std::vector<int64_t> lens(b);
    for (auto& l : lens) {
      const int kind = static_cast<int>(rng() % 4);
      l = kind == 0 ? 0 : kind == 1 ? 1 : kind == 2 ? static_cast<int64_t>(rng() % 5000) : static_cast<int64_t>(rng() % 200000);
    }
    std::vector<TileSchedulerMetadataRow> rows(parts);
    std::vector<int32_t> splits(b + 1);
    core::compute_tile_schedule(lens, parts, overhead, rows.data(), splits.data());
    std::vector<int> named(b, 0);
    const auto* words = reinterpret_cast<const int32_t*>(rows.data());
    for (int64_t q = 0; q < parts; ++q) {
      const int r = core::split_request_of_part(words, q, b);
      if (r >= 0) {
        ASSERT_LT(r, b);
        named[r] += 1;
      }
    }
    for (int64_t i = 0; i < b; ++i)
      EXPECT_EQ(named[i], splits[i + 1] - splits[i] > 1 ? 1 : 0)
          << "request " << i << " b " << b << " parts " << parts << " overhead " << overhead;
  }
}

// The device scheduler (src/sm90/common/scheduler.cu) computes the partition request by request
// (core::schedule_requests) and then each part's row independently (core::schedule_part_row);
// both must give greedy_tile_schedule's rows and num_splits exactly, for any overhead.
TEST(Scheduler, RequestWisePassEqualsTheGreedy) {
  std::mt19937_64 rng(2026);
  int cases = 0;
  for (int64_t overhead : kOverheads) {
    for (int64_t b : {1, 2, 3, 5, 8, 37, 128, 129, 1000, 3000})
      for (int64_t parts : {1, 2, 3, 7, 33, 66, 78, 132, 264})
        for (int mode = 0; mode < 5; ++mode) {
          std::vector<int64_t> lens(b);
          for (auto& x : lens) {
            const uint64_t r = rng();
            if (mode == 0) x = static_cast<int64_t>(r % 5000);
            else if (mode == 1) x = (r % 100) < 40 ? 0 : static_cast<int64_t>(r % 5000);
            else if (mode == 2) x = static_cast<int64_t>(r % 200000);
            else if (mode == 3) x = static_cast<int64_t>(r % 70);  // one or two blocks each
            else x = (r % 10) == 0 ? static_cast<int64_t>(r % 300000) : static_cast<int64_t>(r % 64);  // skewed
          }
          std::vector<int64_t> nb(b);
          int64_t total = 0;
          for (int64_t i = 0; i < b; ++i) total += (nb[i] = core::sched_num_blocks(lens[i])) + overhead;
          std::vector<TileSchedulerMetadataRow> want(parts);
          std::vector<int32_t> want_splits(b + 1, -7), got_splits(b + 1, -9);
          core::compute_tile_schedule(lens, parts, overhead, want.data(), want_splits.data());
          std::vector<int32_t> pe(b), ps(b), t(b);
          auto num_blocks = [&](int64_t i) { return nb[i]; };
          auto empty = [&](int64_t i) { return lens[i] == 0; };
          const int64_t payload =
              core::schedule_requests(b, parts, total, overhead, num_blocks, pe.data(), ps.data(), t.data(),
                                      [&](int64_t i, int32_t v) { got_splits[i] = v; });
          ASSERT_EQ(got_splits, want_splits) << "b=" << b << " parts=" << parts << " mode=" << mode
                                             << " overhead=" << overhead;
          for (int64_t q = 0; q < parts; ++q) {
            const TileSchedulerMetadataRow got = core::schedule_part_row(
                q, b, payload, overhead, num_blocks, empty, [&](int64_t i) { return pe[i]; }, ps.data(), t.data());
            ASSERT_EQ(0, std::memcmp(&got, &want[q], sizeof(got)))
                << "b=" << b << " parts=" << parts << " mode=" << mode << " overhead=" << overhead << " part " << q
                << ": got [" << got.begin_req_idx << " " << got.end_req_idx << " " << got.begin_block_idx << " " << got.end_block_idx
                << " " << got.begin_split_idx << " " << got.is_first_req_splitted << " " << got.is_last_req_splitted
                << "] want [" << want[q].begin_req_idx << " " << want[q].end_req_idx << " " << want[q].begin_block_idx
                << " " << want[q].end_block_idx << " " << want[q].begin_split_idx << " "
                << want[q].is_first_req_splitted << " " << want[q].is_last_req_splitted << "]";
          }
          ++cases;
        }
  }
  EXPECT_EQ(cases, 4 * 10 * 9 * 5);
}

// What each path's device kernel computes (src/sm90/common/scheduler.cu, schedule_kernel_body with the
// path's overhead): staged, block counts in shared memory (-1 for an empty request), the request-wise
// pass and one row per part; unstaged (large batches), the greedy straight from the lengths.
void device_body_schedule(const std::vector<int64_t>& lens, int64_t parts, int64_t overhead, bool staged,
                          std::vector<TileSchedulerMetadataRow>& rows, std::vector<int32_t>& splits) {
  const int64_t b = static_cast<int64_t>(lens.size());
  std::vector<int32_t> blocks(b), pe(b), ps(b), t(b);
  int64_t total = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int32_t nb = static_cast<int32_t>(core::sched_num_blocks(lens[i]));
    blocks[i] = lens[i] == 0 ? -1 : nb;
    total += nb + overhead;
  }
  auto write_split = [&](int64_t i, int32_t v) { splits[i] = v; };
  if (!staged) {
    core::greedy_tile_schedule(
        b, parts, total, overhead, [&](int64_t i) { return core::sched_num_blocks(lens[i]); },
        [&](int64_t i) { return lens[i] == 0; },
        [&](int64_t part, const TileSchedulerMetadataRow& row) { rows[part] = row; }, write_split);
    return;
  }
  auto nb_staged = [&](int64_t i) -> int64_t { return blocks[i] < 0 ? 1 : blocks[i]; };
  const int64_t payload = core::schedule_requests(b, parts, total, overhead, nb_staged, pe.data(), ps.data(),
                                                  t.data(), write_split);
  for (int64_t q = 0; q < parts; ++q)
    rows[q] = core::schedule_part_row(
        q, b, payload, overhead, nb_staged, [&](int64_t i) { return blocks[i] < 0; },
        [&](int64_t i) -> int64_t { return pe[i]; }, ps.data(), t.data());
}

// The host schedule (core::compute_tile_schedule: the CPU backend, the tests' oracle) and both device kernel
// paths agree for dense decode's and sparse decode's overheads (and the values an A/B build may choose).
TEST(Scheduler, DeviceKernelPathsEqualTheHostScheduleForEachDecodePath) {
  std::mt19937_64 rng(77);
  const int64_t path_overheads[] = {core::kDenseDecodeSchedOverheadBlocks, core::kSparseDecodeSchedOverheadBlocks, 0,
                                    1, 2, 3};
  int cases = 0;
  for (int64_t overhead : path_overheads)
    for (int trial = 0; trial < 60; ++trial) {
      const int64_t b = 1 + static_cast<int64_t>(rng() % (trial % 3 == 0 ? 4 : 400));
      const int64_t parts = 1 + static_cast<int64_t>(rng() % 140);
      std::vector<int64_t> lens(b);
      for (auto& l : lens) {
        const int kind = static_cast<int>(rng() % 4);
        l = kind == 0 ? 0 : kind == 1 ? static_cast<int64_t>(rng() % 130) : static_cast<int64_t>(rng() % 70000);
      }
      std::vector<TileSchedulerMetadataRow> want(parts);
      std::vector<int32_t> want_splits(b + 1, -7);
      core::compute_tile_schedule(lens, parts, overhead, want.data(), want_splits.data());
      for (bool staged : {true, false}) {
        std::vector<TileSchedulerMetadataRow> got(parts);
        std::vector<int32_t> got_splits(b + 1, -9);
        device_body_schedule(lens, parts, overhead, staged, got, got_splits);
        ASSERT_EQ(got_splits, want_splits) << "overhead " << overhead << " b " << b << " parts " << parts;
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), sizeof(TileSchedulerMetadataRow) * parts))
            << "overhead " << overhead << " b " << b << " parts " << parts << " staged " << staged;
        ++cases;
      }
    }
  EXPECT_EQ(cases, 6 * 60 * 2);
}

// V3.2 sparse decode at b = 2, s_q 2, h_q 128 on 132 SMs: num_sm_parts 33, topk 2048 = 32 blocks a request.
// Overhead 5: payload ceil(74 / 33) + 5 = 8, three blocks a part, 22 parts busy, 11 splits a request;
// overhead 1: payload ceil(66 / 33) + 1 = 3, two blocks a part, 32 parts busy, 16 splits a request.
TEST(Scheduler, SparseDecodeBatchTwoSpreadsOverMorePartsWithASmallerOverhead) {
  const int64_t parts = core::sparse_decode_num_sm_parts(132, 2, 128);
  ASSERT_EQ(parts, 33);
  const std::vector<int64_t> lens = {2048, 2048};
  struct Want {
    int64_t overhead, busy_parts, max_blocks;
    std::vector<int32_t> splits;
  };
  for (const Want& w : {Want{5, 22, 3, {0, 11, 22}}, Want{1, 32, 2, {0, 16, 32}}}) {
    std::vector<TileSchedulerMetadataRow> rows(parts);
    std::vector<int32_t> splits(3);
    core::compute_tile_schedule(lens, parts, w.overhead, rows.data(), splits.data());
    EXPECT_EQ(splits, w.splits) << "overhead " << w.overhead;
    int64_t busy = 0, max_blocks = 0;
    for (const auto& r : rows) {
      int64_t blocks = 0;
      for (int req = r.begin_req_idx; req <= r.end_req_idx && req < 2; ++req) {
        const int64_t lo = req == r.begin_req_idx ? r.begin_block_idx : 0;
        const int64_t hi = req == r.end_req_idx ? r.end_block_idx : 32;
        blocks += hi - lo;
      }
      busy += blocks > 0;
      max_blocks = std::max(max_blocks, blocks);
    }
    EXPECT_EQ(busy, w.busy_parts) << "overhead " << w.overhead;
    EXPECT_EQ(max_blocks, w.max_blocks) << "overhead " << w.overhead;
  }
}

}  // namespace
}  // namespace flashmla
