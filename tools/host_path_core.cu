// tools/host_path_core.cu — host microseconds per call of the C++ core's decode path, layer by layer,
// without torch or Python: what is left of an eager call once the framework is gone (issue 25, item 4).
//
// Links the installed static core (flash_mla/lib/libflashmla_core.a of a CUDA build) and the sm90
// launcher's stage entry point (src/sm90/decode/dense/dense_decode.h). Buffers are cudaMalloc'd once;
// every row calls one layer `calls` times back to back without synchronising (host time: the clock
// stops when the last call returns), median over `rounds`; then the same with a synchronisation after
// each call (wall: host + GPU). Rows:
//   cuda-get-device            cudaGetDevice
//   cuda-set-device-same       cudaSetDevice(current)
//   cuda-stream-is-capturing   cudaStreamIsCapturing(stream)
//   launch-empty               an empty kernel <<<1, 32>>> (the launch floor)
//   launch-empty-132x256-param512  an empty kernel, 132 CTAs, a 512-byte parameter (a decode launch's shape)
//   tensor-map-encode          cuTensorMapEncodeTiled of k_cache (what the seesaw kernel needs per call)
//   dense plan                 flashmla::dense_decode_plan (validation + sizes)
//   dense launch main          sm90::dense_decode_launch, split-KV kernel only (tensor map + launch)
//   dense launch combine       sm90::dense_decode_launch, combine only
//   dense fwd (reused schedule)  flashmla::dense_decode_fwd, metadata_ready (validation, plan, 2 launches)
//   dense fwd (schedule)       the same computing the schedule (3 launches)
//   sparse plan / sparse fwd (reused schedule)   the same for sparse FP8 decode (V3.2 cache, zeros)
// Cases: dense b1 h16 s_k64 and b1 h128 s_k2048 (bf16, d 576, page 64), sparse b1 h64 topk 2048.
//
// Build (tools/profile-host-path.sh does this):
//   nvcc -O2 -std=c++20 -gencode arch=compute_90a,code=sm_90a -I<pkg>/include -Isrc tools/host_path_core.cu \
//     <pkg>/lib/libflashmla_core.a -lpthread -ldl
// Usage: host_path_core [calls=200] [rounds=9]   (prints one line per row and a JSON line "JSON {...}")
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "flashmla/flashmla.h"
#include "sm90/decode/dense/dense_decode.h"
#include "trace/trace_host.cuh"  // CHECK

namespace {

using flashmla::DType;
using flashmla::Device;
using flashmla::DeviceType;
using flashmla::TensorRef;


struct Param512 {
  unsigned char bytes[512];
};
__global__ void empty_kernel() {}
__global__ void empty_kernel_param(Param512 p) {
  if (p.bytes[threadIdx.x] == 255 && blockIdx.x == 100000) printf("never\n");
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Row {
  std::string name;
  double host_us, wall_us;
};
std::vector<Row> g_rows;
int g_calls = 200, g_rounds = 9;
cudaStream_t g_stream = nullptr;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// `fn` returns false on failure (the row is reported and skipped).
void time_row(const std::string& name, const std::function<bool()>& fn) {
  for (int i = 0; i < 20; ++i)
    if (!fn()) {
      std::printf("%-44s failed\n", name.c_str());
      return;
    }
  CHECK(cudaStreamSynchronize(g_stream));
  std::vector<double> host, wall;
  for (int r = 0; r < g_rounds; ++r) {
    const double t0 = now_us();
    for (int i = 0; i < g_calls; ++i) fn();
    const double t1 = now_us();
    CHECK(cudaStreamSynchronize(g_stream));
    host.push_back((t1 - t0) / g_calls);
  }
  for (int r = 0; r < g_rounds; ++r) {
    const int n = std::max(1, g_calls / 4);
    const double t0 = now_us();
    for (int i = 0; i < n; ++i) {
      fn();
      cudaStreamSynchronize(g_stream);
    }
    wall.push_back((now_us() - t0) / n);
  }
  const Row row{name, median(host), median(wall)};
  std::printf("%-44s host %8.2f us/call   synchronised %8.2f us/call\n", name.c_str(), row.host_us, row.wall_us);
  g_rows.push_back(row);
}

void* dmalloc(int64_t bytes) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 16));
  CHECK(cudaMemset(p, 0, bytes > 0 ? bytes : 16));
  return p;
}

TensorRef dev_ref(void* data, DType dt, std::initializer_list<int64_t> shape) {
  return flashmla::make_tensor_ref(data, dt, shape, Device{DeviceType::kCUDA, 0});
}

/// Schedule, out (b, s_q, h_q, 512) bf16, lse (b, h_q, s_q) float32 and workspace of a decode call, sized
/// by its plan (dense and sparse decode parameters share these fields).
template <class Params>
void set_decode_outputs(Params& p, const flashmla::DecodePlan& plan, int64_t b, int64_t s_q, int64_t h_q) {
  p.tile_scheduler_metadata = dev_ref(dmalloc(plan.num_sm_parts * 32), DType::kInt32, {plan.num_sm_parts, 8});
  p.num_splits = dev_ref(dmalloc(plan.num_splits_len * 4), DType::kInt32, {plan.num_splits_len});
  p.out = dev_ref(dmalloc(b * s_q * h_q * 512 * 2), DType::kBFloat16, {b, s_q, h_q, 512});
  p.lse = dev_ref(dmalloc(b * h_q * s_q * 4), DType::kFloat32, {b, h_q, s_q});
  p.workspace = dmalloc(plan.workspace_bytes);
  p.workspace_bytes = plan.workspace_bytes;
  p.metadata_ready = false;
}


bool ok(const flashmla::Status& st, const char* what) {
  if (st.ok()) return true;
  static int reported = 0;
  if (reported++ < 8) std::fprintf(stderr, "%s: %s\n", what, st.message.c_str());
  return false;
}

void dense_rows(int64_t b, int64_t h_q, int64_t s_k) {
  const int64_t s_q = 1, d = 576, pbs = 64, blocks = (s_k + pbs - 1) / pbs;
  const std::string tag = "dense b" + std::to_string(b) + " h" + std::to_string(h_q) + " s_k" + std::to_string(s_k);
  flashmla::DenseDecodeParams p;
  p.q = dev_ref(dmalloc(b * s_q * h_q * d * 2), DType::kBFloat16, {b, s_q, h_q, d});
  p.k_cache = dev_ref(dmalloc(b * blocks * pbs * d * 2), DType::kBFloat16, {b * blocks, pbs, 1, d});
  std::vector<int32_t> bt(b * blocks), sl(b, static_cast<int32_t>(s_k));
  for (int64_t i = 0; i < b * blocks; ++i) bt[i] = static_cast<int32_t>(i);
  void* bt_d = dmalloc(bt.size() * 4);
  void* sl_d = dmalloc(sl.size() * 4);
  CHECK(cudaMemcpy(bt_d, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(sl_d, sl.data(), sl.size() * 4, cudaMemcpyHostToDevice));
  p.block_table = dev_ref(bt_d, DType::kInt32, {b, blocks});
  p.cache_seqlens = dev_ref(sl_d, DType::kInt32, {b});
  p.head_dim_v = 512;
  p.softmax_scale = 1.0f / 24.0f;
  p.stream = g_stream;
  flashmla::DecodePlan plan;
  if (!ok(flashmla::dense_decode_plan(p, &plan), "dense_decode_plan")) return;
  set_decode_outputs(p, plan, b, s_q, h_q);
  if (!ok(flashmla::dense_decode_fwd(p), "dense_decode_fwd (schedule)")) return;
  CHECK(cudaStreamSynchronize(g_stream));

  time_row(tag + " plan", [&] {
    flashmla::DecodePlan pl;
    return flashmla::dense_decode_plan(p, &pl).ok();
  });
  flashmla::DenseDecodeParams ready = p;
  ready.metadata_ready = true;
  time_row(tag + " launch main", [&] {
    return flashmla::sm90::dense_decode_launch(ready, plan.num_sm_parts, flashmla::sm90::kStageMain).ok();
  });
  time_row(tag + " launch combine", [&] {
    return flashmla::sm90::dense_decode_launch(ready, plan.num_sm_parts, flashmla::sm90::kStageCombine).ok();
  });
  time_row(tag + " launch scheduler", [&] {
    return flashmla::sm90::dense_decode_launch(p, plan.num_sm_parts, flashmla::sm90::kStageScheduler).ok();
  });
  time_row(tag + " fwd (reused schedule)", [&] { return flashmla::dense_decode_fwd(ready).ok(); });
  time_row(tag + " fwd (schedule)", [&] { return flashmla::dense_decode_fwd(p).ok(); });

  // cuTensorMapEncodeTiled alone, with the seesaw kernel's arguments (dense_decode.cu make_k_tensor_map).
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess && b == 1 && h_q == 16) {
    using Fn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                            const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    auto encode = reinterpret_cast<Fn>(fn);
    const cuuint64_t dims[4] = {576, 1, 64, static_cast<cuuint64_t>(b * blocks)};
    const cuuint64_t strides[3] = {576 * 2, 576 * 2, 64 * 576 * 2};
    const cuuint32_t box[4] = {64, 1, 64, 1}, estr[4] = {1, 1, 1, 1};
    time_row("tensor-map-encode", [&] {
      alignas(64) CUtensorMap map;
      return encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, p.k_cache.data, dims, strides, box, estr,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
    });
  }
}

void sparse_rows(int64_t b, int64_t h_q, int64_t topk) {
  const int64_t s_q = 1, d = 576, pbs = 64, s_kv = 4096;
  const std::string tag = "sparse-fp8 b" + std::to_string(b) + " h" + std::to_string(h_q) + " topk" +
                          std::to_string(topk);
  flashmla::SparseDecodeParams p;
  p.q = dev_ref(dmalloc(b * s_q * h_q * d * 2), DType::kBFloat16, {b, s_q, h_q, d});
  p.k_cache = dev_ref(dmalloc(s_kv * 656), DType::kUInt8, {s_kv / pbs, pbs, 1, 656});
  std::vector<int32_t> idx(b * s_q * topk);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>((i * 7919) % s_kv);
  void* idx_d = dmalloc(idx.size() * 4);
  CHECK(cudaMemcpy(idx_d, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
  p.indices = dev_ref(idx_d, DType::kInt32, {b, s_q, topk});
  p.head_dim_v = 512;
  p.softmax_scale = 1.0f / 24.0f;
  p.stream = g_stream;
  flashmla::DecodePlan plan;
  if (!ok(flashmla::sparse_decode_plan(p, &plan), "sparse_decode_plan")) return;
  set_decode_outputs(p, plan, b, s_q, h_q);
  if (!ok(flashmla::sparse_decode_fwd(p), "sparse_decode_fwd (schedule)")) return;
  CHECK(cudaStreamSynchronize(g_stream));
  time_row(tag + " plan", [&] {
    flashmla::DecodePlan pl;
    return flashmla::sparse_decode_plan(p, &pl).ok();
  });
  flashmla::SparseDecodeParams ready = p;
  ready.metadata_ready = true;
  time_row(tag + " fwd (reused schedule)", [&] { return flashmla::sparse_decode_fwd(ready).ok(); });
  time_row(tag + " fwd (schedule)", [&] { return flashmla::sparse_decode_fwd(p).ok(); });
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) g_calls = std::max(1, std::atoi(argv[1]));
  if (argc > 2) g_rounds = std::max(1, std::atoi(argv[2]));
  CHECK(cudaSetDevice(0));
  CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; calls %d, rounds %d\n", prop.name, prop.multiProcessorCount, g_calls, g_rounds);

  time_row("cuda-get-device", [] {
    int d = 0;
    return cudaGetDevice(&d) == cudaSuccess;
  });
  time_row("cuda-set-device-same", [] { return cudaSetDevice(0) == cudaSuccess; });
  time_row("cuda-stream-is-capturing", [] {
    cudaStreamCaptureStatus s;
    return cudaStreamIsCapturing(g_stream, &s) == cudaSuccess;
  });
  time_row("launch-empty", [] {
    empty_kernel<<<1, 32, 0, g_stream>>>();
    return cudaGetLastError() == cudaSuccess;
  });
  Param512 big{};
  time_row("launch-empty-132x256-param512", [&] {
    empty_kernel_param<<<132, 256, 0, g_stream>>>(big);
    return cudaGetLastError() == cudaSuccess;
  });
  dense_rows(1, 16, 64);
  dense_rows(1, 128, 2048);
  sparse_rows(1, 64, 2048);

  std::string js = "{\"calls\": " + std::to_string(g_calls) + ", \"rounds\": " + std::to_string(g_rounds) +
                   ", \"rows\": [";
  for (size_t i = 0; i < g_rows.size(); ++i) {
    char buf[256];
    std::snprintf(buf, sizeof(buf), "%s{\"name\": \"%s\", \"host_us\": %.3f, \"synchronised_us\": %.3f}",
                  i ? ", " : "", g_rows[i].name.c_str(), g_rows[i].host_us, g_rows[i].wall_us);
    js += buf;
  }
  js += "]}";
  std::printf("JSON %s\n", js.c_str());
  return 0;
}
