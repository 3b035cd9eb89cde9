#!/usr/bin/env bash
# GPU check of the kernels whose machine code changed when their mma.sync core moved to
# src/sm90/common/mma_core.cuh (the dense mma.sync kernel, the sparse decode mma.sync and small-heads
# kernels, the sparse prefill mma.sync kernel; every other kernel's SASS is unchanged). One device call,
# every step under a timeout. On the GPU machine, from the repository root (carry [".deps", ".whl"]):
#   OUT=$OUT bash tools/gpu-check-mma-core.sh
# Passes when every step passes: the three families' GPU pytest (their small-head, unaligned-cache and
# M <= 32 cases run these kernels), the dense C++ grid with the K tensor map off (so every case runs the
# mma.sync or the wgmma kernel) and with the mma.sync kernel forced (cases of more than 32 rows per KV
# head are skipped), then the tensor-parallel benchmark cases that run the changed kernels, to compare
# with bench/results/2026-12-02-*.json (same case names).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rc=0
step() { local name=$1; shift; echo "=== $name $(date +%T)"; timeout "$@" 2>&1 | tee "$OUT/$name.log"; local r=${PIPESTATUS[0]}; rc=$((rc | r)); echo "=== $name rc=$r"; }
OUT=$OUT timeout 600 bash tools/device-run.sh build || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
step pytest-dense 300 python3 -m pytest tests/gpu/test_dense_decode_gpu.py -q -rs
step pytest-sparse-decode 300 python3 -m pytest tests/gpu/test_sparse_decode_gpu.py -q -rs
step pytest-sparse-prefill 300 python3 -m pytest tests/gpu/test_sparse_prefill_gpu.py -q -rs
cmake -S . -B build/gpu-tests -G Ninja -DFLASHMLA_ENABLE_CUDA=ON -DFLASHMLA_CUTLASS_INCLUDE_DIR="$PWD/.deps/cutlass_include" \
  -DFLASHMLA_BUILD_GPU_TESTS=ON >/dev/null && timeout 600 cmake --build build/gpu-tests 2>&1 | tail -3
step cpp-grid-no-tma 600 build/gpu-tests/tests/gpu/cpp/test_dense_decode_gpu --no-perf --tune 2
step cpp-grid-mma 600 build/gpu-tests/tests/gpu/cpp/test_dense_decode_gpu --no-perf --kernel mma
step bench-sparse-prefill-tp 300 python3 bench/bench_sparse_prefill.py --out "$OUT" --filter tp
step bench-sparse-decode 400 python3 bench/bench_sparse_decode.py --out "$OUT" --quick
exit $rc
