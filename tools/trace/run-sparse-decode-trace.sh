#!/usr/bin/env bash
# Build tools/trace/sparse_decode_trace.cu (the sparse FP8 decode wgmma producer kernel with its
# FLASHMLA_TRACE events) and run it on the sparse-decode benchmark shapes where the kernel is slowest
# against FlashMLA (on an sm_90a machine, from anywhere; needs .deps/cutlass_include, e.g. carried to the
# device machine).
#   OUT=/tmp/o bash tools/trace/run-sparse-decode-trace.sh
# CASES: ';'-separated argument lists of the program (format b [h_q] [every]); "@plain" / "@cluster" in a
# case forces that kernel variant (FLASHMLA_TRACE_CLUSTER=0 / 1; unmarked: the library's choice,
# the cluster kernel for these shapes). Default: V3.2 b64, b128, MODEL1 config2 b128 (the library's
# choice), then V3.2 b128 and MODEL1 config2 b128 with the plain kernel, then V3.2 b128 with the trace
# window at blocks 64 .. 103 of every CTA ("@step0=N": FLASHMLA_TRACE_STEP0=N). NVCC_DEFS: extra nvcc flags.
# CASE_TIMEOUT: seconds per case (default 150). Writes $OUT/trace-sparse-decode.txt (everything) and
# prints each case's summary lines.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}
CASES=${CASES:-"v32 64;v32 128;model1 128;v32 128 @plain;model1 128 @plain;v32 128 @step0=64"}
BIN=/tmp/trace-bin/sparse_decode_trace
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
LOG=$OUT/trace-sparse-decode.txt
mkdir -p "$OUT" /tmp/trace-bin
: >"$LOG"
echo "=== build $(date +%T) ($(git rev-parse --short HEAD 2>/dev/null || echo '?'), $("$NVCC" --version | tail -1))" | tee -a "$LOG"
# shellcheck disable=SC2086  # NVCC_DEFS: a list of flags
timeout 300 "$NVCC" ${NVCC_DEFS:-} -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc -I.deps/cutlass_include \
  -DFLASHMLA_WITH_CUDA -DFLASHMLA_TRACE --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math \
  -Xptxas=-v,--warn-on-spills -o "$BIN" tools/trace/sparse_decode_trace.cu src/sm90/common/scheduler.cu src/core/scheduler.cpp \
  >/tmp/trace-bin/sparse_decode_trace.log 2>&1
rc=$?
grep -E "error|warning|C75[0-9][0-9]" /tmp/trace-bin/sparse_decode_trace.log | tee -a "$LOG"
if [ $rc -ne 0 ] || [ ! -x "$BIN" ]; then
  echo "build failed (rc $rc)" | tee -a "$LOG"
  tail -30 /tmp/trace-bin/sparse_decode_trace.log | tee -a "$LOG"
  exit 1
fi
echo "=== build done $(date +%T)" | tee -a "$LOG"
# No GPU needed: the index generation's rules and the statistics on synthetic records.
timeout 60 "$BIN" selftest >/tmp/trace-bin/selftest.txt 2>&1
r=$?
cat /tmp/trace-bin/selftest.txt >>"$LOG"
grep -E "^selftest: " /tmp/trace-bin/selftest.txt || echo "selftest: no result (rc $r)" | tee -a "$LOG"
command -v nvidia-smi >/dev/null &&
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
IFS=';' read -ra cs <<<"$CASES"
status=0
for c in "${cs[@]}"; do
  envs=()
  args=$c
  case $c in
    *@plain*) envs+=(FLASHMLA_TRACE_CLUSTER=0); args=${args//@plain/} ;;
    *@cluster*) envs+=(FLASHMLA_TRACE_CLUSTER=1); args=${args//@cluster/} ;;
  esac
  if [[ $c =~ @step0=([0-9]+) ]]; then
    envs+=(FLASHMLA_TRACE_STEP0="${BASH_REMATCH[1]}")
    args=${args//${BASH_REMATCH[0]}/}
  fi
  echo "=== sparse_decode_trace $c $(date +%T)" | tee -a "$LOG"
  # shellcheck disable=SC2086  # args: the program's argument list
  env ${envs[@]+"${envs[@]}"} timeout "${CASE_TIMEOUT:-60}" "$BIN" $args >/tmp/trace-bin/case.txt 2>&1
  r=$?
  cat /tmp/trace-bin/case.txt >>"$LOG"
  grep -E "^(case|kernel|traced|sanity|verdict|WG0 \(|WG1 \(|producer:|  WG0 waits|  WG1 waits|  producer (waits|dequant))" \
    /tmp/trace-bin/case.txt | grep -v "\[rank"
  if [ $r -ne 0 ]; then
    echo "case '$c' failed: rc $r$([ $r = 124 ] && echo ' (timeout)')" | tee -a "$LOG"
    tail -5 /tmp/trace-bin/case.txt
    status=1
    # A hang would repeat in every later case (one binary): stop here.
    if [ $r -eq 124 ] || [ $r -eq 137 ]; then echo "timed out: the remaining cases are skipped" | tee -a "$LOG"; break; fi
  fi
done
echo "=== done $(date +%T)" | tee -a "$LOG"
exit $status
