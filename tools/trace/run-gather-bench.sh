#!/usr/bin/env bash
# Build and run tools/trace/gather_bench.cu (the sparse-decode producer's gather pattern by eight load
# methods) on an sm_90a machine: one CTA per SM, then a single CTA (the latency-bound case), then the
# producer's load of ~128 blocks per CTA over an 8 GB buffer. Every timed launch is L2-flushed and reads
# its own indices (the single-CTA run is latency-bound on DRAM, not on L2). Needs no CUTLASS. Writes $OUT/gather-bench.txt.
#   OUT=/tmp/o bash tools/trace/run-gather-bench.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
LOG=$OUT/gather-bench.txt
{ echo "# $(date -u) $(git rev-parse --short HEAD 2>/dev/null)"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader; } | tee "$LOG"
timeout 120 "$NVCC" -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Isrc -Itools/trace -o /tmp/gather_bench \
  tools/trace/gather_bench.cu 2>&1 | tee -a "$LOG" || exit 1
for args in "-1 256 4" "-1 256 4 1" "-1 128 8"; do
  # shellcheck disable=SC2086  # args: a word list
  timeout 120 /tmp/gather_bench $args 2>&1 | tee -a "$LOG"
done
# Does the producer's proxy fence wait for global loads in flight? (tools/trace/fence_probe.cu)
timeout 120 "$NVCC" -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Isrc -Itools/trace -o /tmp/fence_probe tools/trace/fence_probe.cu 2>&1 | tee -a "$LOG" &&
  timeout 60 /tmp/fence_probe 2>&1 | tee -a "$LOG"
