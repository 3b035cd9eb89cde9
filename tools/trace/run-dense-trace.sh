#!/usr/bin/env bash
# Build tools/trace/dense_trace.cu twice (CTA + pair events; CTA events only, -DFLASHMLA_DENSE_TRACE_CTA_ONLY:
# fewer trace instructions in the pair loop) and run it on the dense-decode whole-call shapes where the
# seesaw kernel (wgmma_seesaw_kernel.cuh) is 0.72-0.83x of FlashMLA (b 128, s_q 1, s_k 256 / 1024) and
# on one compute-bound shape (b 128, h_q 128, s_k 8192: the pair loop's per-role step times). On an
# sm_90a machine, from anywhere in the repository:
#   OUT=/tmp/o bash tools/trace/run-dense-trace.sh
# Writes $OUT/trace-dense.txt (everything: per-CTA lines, per-role tables, one CTA's timeline) and prints
# a few summary lines per run (the file is what to read). Device call: carry [".deps"] (CUTLASS headers). CASES / LONG_CASES (';'-separated argument lists of dense_trace:
# b s_q h_q s_k [pbs] [staged=auto|0|1] [every]) override the shapes.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}
BIN=${BIN:-/tmp/trace-bin}
mkdir -p "$OUT" "$BIN"
LOG="$OUT/trace-dense.txt"
: >"$LOG"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CASES=${CASES:-"128 1 8 256;128 1 16 256;128 1 64 256;128 1 128 256;128 1 16 1024;128 1 128 1024;128 1 8 256 64 0"}
LONG_CASES=${LONG_CASES:-"128 1 128 8192"}
SRCS="tools/trace/dense_trace.cu src/sm90/decode/dense/dense_decode.cu src/sm90/common/scheduler.cu src/sm90/common/combine.cu src/core/scheduler.cpp"
FLAGS="-std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc -I.deps/cutlass_include -DFLASHMLA_WITH_CUDA=1
  -DFLASHMLA_TRACE --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math -Xptxas=--warn-on-spills"

{ echo "# $(date -u) $(git rev-parse --short HEAD 2>/dev/null) (+ working tree)"
  timeout 20 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv 2>&1
  timeout 20 "$NVCC" --version | tail -2; } | tee -a "$LOG"

build() {  # name extra-flags
  # shellcheck disable=SC2086  # FLAGS, extra flags and SRCS are word lists
  timeout 300 "$NVCC" $FLAGS $2 -o "$BIN/$1" $SRCS >"$BIN/$1.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "build $1 failed (rc $rc)" | tee -a "$LOG"
    tail -30 "$BIN/$1.log" | tee -a "$LOG"
    rm -f "$BIN/$1"
  else
    grep -i "spill\|warning" "$BIN/$1.log" | sed "s/^/[$1 build] /" | tee -a "$LOG"
  fi
}
build dense_trace "" &
build dense_trace_cta "-DFLASHMLA_DENSE_TRACE_CTA_ONLY" &
wait

SUMMARY='^(case|time \(|traced run|time base|  entry \(|  exit \(|  request compute|  epilogue \(start|  => )|ALL NaN|NO,'
run() {  # binary timeout args...
  local bin=$1 t=$2
  shift 2
  [ -x "$BIN/$bin" ] || { echo "=== $bin: $* (not built)" | tee -a "$LOG"; return; }
  echo "=== $bin: $*" | tee -a "$LOG"
  timeout "$t" "$BIN/$bin" "$@" >"$BIN/run.txt" 2>&1
  local rc=$?
  cat "$BIN/run.txt" >>"$LOG"
  grep -E "$SUMMARY" "$BIN/run.txt"
  [ $rc -eq 0 ] || echo "    (exit status $rc)" | tee -a "$LOG"
  # A hang (timeout) would repeat in every later case of the same binary: drop that binary.
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "    $bin timed out: its remaining cases are skipped" | tee -a "$LOG"
    rm -f "$BIN/$bin"
  fi
}
IFS=';' read -ra cs <<<"$CASES"
for bin in dense_trace_cta dense_trace; do
  for c in "${cs[@]}"; do
    # shellcheck disable=SC2086
    run "$bin" "${CASE_TIMEOUT:-30}" $c
  done
done
IFS=';' read -ra ls <<<"$LONG_CASES"
for c in "${ls[@]}"; do
  # shellcheck disable=SC2086
  run dense_trace "${LONG_TIMEOUT:-60}" $c
done
echo "log: $LOG ($(wc -l <"$LOG") lines)"
