// src/sm90/prefill/dense/dense_prefill.h — host-side internals of the sm90 dense MHA prefill shared
// between the launchers and the standalone GPU check (tools/dense_prefill_check/shim.cpp). Not public API.
#pragma once

#include "flashmla/ops.h"

namespace flashmla::sm90::dense_prefill {

/// Forward consumer schedules (fwd.cu): kSerial = per key block S, softmax, P V one after the other;
/// kOverlap = S of block n issued with P V of block n - 1, softmax under that P V.
enum class FwdSchedule { kSerial, kOverlap };
/// The schedule dense_prefill_fwd uses (kSerial until kOverlap has passed the GPU check on an H200).
constexpr FwdSchedule kFwdSchedule = FwdSchedule::kSerial;

/// dense_prefill_fwd with a given schedule (the GPU check times and verifies both).
Status fwd_with_schedule(const DensePrefillParams& p, FwdSchedule schedule);

}  // namespace flashmla::sm90::dense_prefill
