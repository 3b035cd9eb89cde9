#!/usr/bin/env bash
# Build tools/trace/prefill_trace.cu for several variants in parallel and run each on the three
# sparse-prefill benchmark shapes at s_kv 8192 (on an sm_90a machine, from the repository root).
#   OUT=/tmp/o bash tools/trace/run-prefill-trace.sh NAME[:DIAG[:INCDIR[:DEFINES]]] ...
# NAME: label; DIAG: FLASHMLA_PREFILL_DIAG (0 kernel, 1 no gather, 2 no wgmma, 3 no Q copy, 4 no output
# copies); INCDIR: a folder
# holding sm90/prefill/sparse/wgmma_seesaw_kernel.cuh (a variant of the kernel) searched before src/;
# DEFINES: extra nvcc flags separated by commas (e.g. -DFLASHMLA_PREFILL_PRODUCER_REGS=56).
# Writes $OUT/trace-NAME.txt; prints each run's summary lines (not the per-CTA timeline).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
CASES=${CASES:-"576 128 2048 8192;512 64 512 8192;512 128 1024 8192"}
mkdir -p "$OUT" /tmp/trace-bin
for spec in "$@"; do
  IFS=: read -r name diag inc defs <<<"$spec"
  ( nvcc ${defs//,/ } -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a ${inc:+-I$inc} -Iinclude -Isrc -I.deps/cutlass_include \
      -DFLASHMLA_WITH_CUDA -DFLASHMLA_TRACE -DFLASHMLA_PREFILL_DIAG=${diag:-0} --expt-relaxed-constexpr \
      --expt-extended-lambda --use_fast_math \
      -o /tmp/trace-bin/$name tools/trace/prefill_trace.cu >/tmp/trace-bin/$name.log 2>&1 || { echo "build $name failed"; tail /tmp/trace-bin/$name.log; } ) &
done
wait
for spec in "$@"; do
  IFS=: read -r name diag inc <<<"$spec"
  [ -x /tmp/trace-bin/$name ] || continue
  IFS=';' read -ra cs <<<"$CASES"
  for c in "${cs[@]}"; do
    echo "=== $name: $c" | tee -a "$OUT/trace-$name.txt"
    timeout 60 /tmp/trace-bin/$name $c 2>&1 | tee -a "$OUT/trace-$name.txt" | grep -E "^case|^traced"
  done
done
