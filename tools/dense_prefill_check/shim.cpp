// tools/dense_prefill_check/shim.cpp — a C entry point into the sm90 dense MHA prefill kernels
// (src/sm90/prefill/dense/) for the standalone GPU check (check.py, through ctypes): raw device pointers,
// shapes and element strides in, the sm90 launcher's Status message out. It skips the core's validation
// (check.py passes valid inputs), so the check runs without the Python package or its bindings.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "flashmla/ops.h"
#include "sm90/prefill/dense/dense_prefill.h"
#include "standalone.h"

namespace {
using flashmla::DType;
using flashmla::TensorRef;

TensorRef ref(void* data, DType dt, int ndim, const int64_t* meta, int device) {
  return flashmla::standalone::cuda_ref(data, dt, ndim, meta, device);
}

int report(const flashmla::Status& s, char* err, int errlen) {
  if (s.ok()) return 0;
  std::strncpy(err, s.message.c_str(), errlen - 1);
  err[errlen - 1] = 0;
  return 1;
}

// ptrs: q, k, v, cu_q, cu_k, out, lse; meta: q(6) k(6) v(6) out(6) lse(4) cu_q(2) cu_k(2) max_q max_k
flashmla::DensePrefillParams fwd_params(void** ptrs, const int64_t* meta, float scale, int causal, int dtype,
                                        int device, void* stream) {
  const DType dt = dtype == 0 ? DType::kBFloat16 : DType::kFloat16;
  flashmla::DensePrefillParams p;
  p.q = ref(ptrs[0], dt, 3, meta + 0, device);
  p.k = ref(ptrs[1], dt, 3, meta + 6, device);
  p.v = ref(ptrs[2], dt, 3, meta + 12, device);
  p.out = ref(ptrs[5], dt, 3, meta + 18, device);
  p.lse = ref(ptrs[6], DType::kFloat32, 2, meta + 24, device);
  p.cu_seqlens_qo = ref(ptrs[3], DType::kInt32, 1, meta + 28, device);
  p.cu_seqlens_kv = ref(ptrs[4], DType::kInt32, 1, meta + 30, device);
  p.max_seqlen_qo = meta[32];
  p.max_seqlen_kv = meta[33];
  p.softmax_scale = scale;
  p.causal = causal != 0;
  p.stream = stream;
  return p;
}
}  // namespace

extern "C" {

// schedule: -1 = the library's (dense_prefill_fwd), 0 = serial, 1 = overlap, 2 = pingpong,
// 3 = pingpong_tma, 4 = persistent_tma, 5 = persistent_tma on 2 CTAs, 6 = persistent_tma with the scale folded into
// the exponent's FMA, 7 = 6 with 176-key blocks (d_qk 128; 128 elsewhere), 8 = 7 on 2 CTAs, 9 = 6 with the tiles in
// TileOrder::kByBlock's order for every shape, 10 = 9 on 2 CTAs (4-8: the shape's order, fwd_tile_order;
// dense_prefill.h); any other value is rejected.
int dense_prefill_check_fwd(void** ptrs, const int64_t* meta, float scale, int causal, int dtype, int device,
                            void* stream, int schedule, char* err, int errlen) {
  namespace dp = flashmla::sm90::dense_prefill;
  if (schedule < -1 || schedule > 10) {
    std::snprintf(err, errlen, "dense_prefill_check_fwd: unknown schedule %d", schedule);
    return 1;
  }
  const flashmla::DensePrefillParams p = fwd_params(ptrs, meta, scale, causal, dtype, device, stream);
  if (schedule < 0) return report(flashmla::sm90::dense_prefill_fwd(p), err, errlen);
  const dp::FwdSchedule sched = schedule == 0   ? dp::FwdSchedule::kSerial
                                : schedule == 1 ? dp::FwdSchedule::kOverlap
                                : schedule == 2 ? dp::FwdSchedule::kPingpong
                                : schedule == 3 ? dp::FwdSchedule::kPingpongTma
                                                : dp::FwdSchedule::kPersistentTma;
  // 5: kPersistentTma on 2 CTAs, so that every case walks many tiles per CTA (state carried across tiles);
  // 6: kPersistentTma with the scale folded into the exponent's FMA; 7 / 8: 6 / 6 on 2 CTAs with 176-key blocks;
  // 9 / 10: 6 / 6 on 2 CTAs with the tiles by block.
  const bool wide = schedule == 7 || schedule == 8;
  const dp::TileOrder order = schedule >= 9 ? dp::TileOrder::kByBlock : dp::TileOrder::kShapeRule;
  const int ctas = schedule == 5 || schedule == 8 || schedule == 10 ? 2 : 0;
  return report(dp::fwd_with_schedule(p, sched, ctas, schedule >= 6, wide ? 176 : 128, order), err, errlen);
}

// ptrs: the forward's 7, then dout, dq, dk, dv, workspace; meta: the forward's 34, then dout(6) dq(6) dk(6) dv(6)
// workspace_bytes. With workspace == nullptr: writes the workspace size to *ws_bytes and returns.
// schedule: -1 = the library's (dense_prefill_bwd), 0 = two kernels, 1 = two kernels with the tiles by TMA, 2 / 3 =
// 1 with both kernels' CTAs in the order kByHead / kByBlock for every shape (0 and 1: the shape's order,
// bwd_tile_order; dense_prefill.h); any other value is rejected.
int dense_prefill_check_bwd(void** ptrs, const int64_t* meta, float scale, int causal, int dtype, int device,
                            void* stream, int schedule, int64_t* ws_bytes, char* err, int errlen) {
  namespace dp = flashmla::sm90::dense_prefill;
  const DType dt = dtype == 0 ? DType::kBFloat16 : DType::kFloat16;
  flashmla::DensePrefillBwdParams bp;
  bp.fwd = fwd_params(ptrs, meta, scale, causal, dtype, device, stream);
  bp.dout = ref(ptrs[7], dt, 3, meta + 34, device);
  bp.dq = ref(ptrs[8], dt, 3, meta + 40, device);
  bp.dk = ref(ptrs[9], dt, 3, meta + 46, device);
  bp.dv = ref(ptrs[10], dt, 3, meta + 52, device);
  bp.workspace = ptrs[11];
  bp.workspace_bytes = meta[58];
  bp.stream = stream;
  if (schedule < -1 || schedule > 3) {
    std::snprintf(err, errlen, "dense_prefill_check_bwd: unknown schedule %d", schedule);
    return 1;
  }
  if (ptrs[11] == nullptr) {  // the workspace is the same for every schedule
    *ws_bytes = flashmla::sm90::dense_prefill_bwd_workspace_bytes(bp);
    return 0;
  }
  if (schedule < 0) return report(flashmla::sm90::dense_prefill_bwd(bp), err, errlen);
  const dp::BwdSchedule sched = schedule >= 1 ? dp::BwdSchedule::kTwoKernelTma : dp::BwdSchedule::kTwoKernel;
  const dp::TileOrder order = schedule == 2   ? dp::TileOrder::kByHead
                                 : schedule == 3 ? dp::TileOrder::kByBlock
                                                 : dp::TileOrder::kShapeRule;
  return report(dp::bwd_with_schedule(bp, sched, order), err, errlen);
}
}
