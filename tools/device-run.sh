#!/usr/bin/env bash
# Build and check flash_mla on an offline GPU machine (an H200 without network access).
# Expects the carried paths .whl/ (apache-tvm-ffi cp312 wheel) and .deps/cutlass_include
# (bash tools/fetch-device-deps.sh makes both).
# Usage: bash tools/device-run.sh [build|pytest|pytest-nan|pytest-torch|pytest-all|pytest-sparse|pytest-prefill|demo|bench|bench-sparse|bench-prefill|bench-overhead|grid-decode:A:B|grid-prefill|cpp-gpu-tests|tp:N]...   (logs under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
CUTLASS=$PWD/.deps/cutlass_include
rc=0
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    build)
      python3 -m pip install -q --no-build-isolation --no-deps --no-index . \
        -C cmake.define.FLASHMLA_CUTLASS_INCLUDE_DIR="$CUTLASS" -C build-dir=build/device 2>&1 | tail -40 | tee "$OUT/build.log"
      python3 -c "import flash_mla; assert flash_mla.has_cuda_backend(); print('flash_mla CUDA backend OK')" || exit 1
      # torch.ops.flash_mla (stable-ABI op library, built because torch is importable here) + its ABI check.
      python3 -c "import torch, flash_mla._torch_ops as t; assert t.available(), t.load_error(); print('torch', torch.__version__, 'torch.ops.flash_mla OK:', t.library_path())" || exit 1
      python3 tools/check-abi.py "$(python3 -c 'import flash_mla._torch_ops as t; print(t.library_path())')" 2>&1 | tee "$OUT/check-abi.log" ;;
    pytest-torch)    # the torch.ops path: CPU + GPU tests (opcheck, compile, CUDA graphs, streams, 2 GPUs)
      FLASHMLA_REQUIRE_TORCH_OPS=1 python3 -m pytest tests/python/test_torch_ops.py tests/gpu/test_torch_ops_gpu.py -q -rs 2>&1 | tee "$OUT/pytest-torch-ops.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    pytest)
      python3 -m pytest tests/gpu -q -rA 2>&1 | grep -v "^SKIPPED .*grid_data.py" | tee "$OUT/pytest-gpu.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    pytest-nan)      # issue 28: NaN propagation + quant helpers on GPU tensors, and the three families' own tests
      python3 -m pytest tests/gpu/test_nan_propagation_gpu.py tests/gpu/test_quant_frameworks_gpu.py \
        tests/gpu/test_dense_decode_gpu.py tests/gpu/test_sparse_decode_gpu.py tests/gpu/test_sparse_prefill_gpu.py \
        -q -rs --tb=short 2>&1 | tee "$OUT/pytest-nan.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    pytest-all)
      python3 -m pytest tests/python tests/gpu -q -rs 2>&1 | tee "$OUT/pytest-all.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    demo)
      python3 -m flash_mla demo 2>&1 | tee "$OUT/demo.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    bench)
      python3 bench/bench_dense_decode.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    pytest-sparse)
      python3 -m pytest tests/gpu/test_sparse_decode_gpu.py -q -rs -x 2>&1 | tee "$OUT/pytest-sparse-decode-gpu.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    bench-sparse)
      python3 bench/bench_sparse_decode.py --out "$OUT" 2>&1 | tee "$OUT/bench-sparse-decode.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    cpp-gpu-tests)
      cmake -S . -B build/gpu-tests -G Ninja -DFLASHMLA_ENABLE_CUDA=ON -DFLASHMLA_CUTLASS_INCLUDE_DIR="$CUTLASS" \
        -DFLASHMLA_BUILD_GPU_TESTS=ON >/dev/null && cmake --build build/gpu-tests 2>&1 | tail -5
      for t in build/gpu-tests/tests/gpu/cpp/test_*; do [ -x "$t" ] && { "$t" 2>&1 | tee "$OUT/$(basename "$t").log"; rc=$((rc | ${PIPESTATUS[0]})); }; done ;;
    grid-decode:*)   # grid-decode:START:END -> slice of the 4748-case spec §5.2 grid
      sl=${step#grid-decode:}; FLASHMLA_FULL_GRID=1 FLASHMLA_GRID_SLICE=$sl python3 -m pytest tests/gpu/test_sparse_decode_grid_gpu.py -q -rs --tb=line \
        2>&1 | tee "$OUT/grid-decode-${sl/:/-}.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    grid-prefill)    # the 617-case spec §5.3 grid
      FLASHMLA_FULL_GRID=1 python3 -m pytest tests/gpu/test_sparse_prefill_grid_gpu.py -q -rs --tb=line 2>&1 | tee "$OUT/grid-prefill.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    bench-overhead)  # host µs per tiny decode call, by way in (issue 5); side by side with FlashMLA when .anchor/
                     # was carried (issue 25: built into /tmp/anchor); the stubbed Python layer on this host's CPU
      anchor=()
      if [ -f .anchor/build.sh ]; then
        if bash .anchor/build.sh > "$OUT/anchor-build.log" 2>&1; then anchor=(--anchor-path /tmp/anchor/flashmla)
        else echo "FlashMLA anchor build failed ($OUT/anchor-build.log): no side by side"; fi
      fi
      python3 bench/bench_call_overhead.py --out "$OUT" ${anchor[@]+"${anchor[@]}"} 2>&1 | tee "$OUT/bench-call-overhead.log"
      rc=$((rc | ${PIPESTATUS[0]}))
      pl_anchor=(); [ -d .anchor/flashmla/flash_mla ] && pl_anchor=(--anchor-path .anchor/flashmla)
      python3 bench/bench_python_layer.py --json "$OUT/python-layer.json" ${pl_anchor[@]+"${pl_anchor[@]}"} 2>&1 |
        tee "$OUT/python-layer.log" ;;
    pytest-prefill)  # tests/gpu/test_sparse_prefill_gpu.py; a hang (timeout) stops the whole run
      timeout 60 python3 -m pytest tests/gpu/test_sparse_prefill_gpu.py -q -rs --tb=short 2>&1 | tee "$OUT/pytest-sparse-prefill-gpu.log"
      r=${PIPESTATUS[0]}; rc=$((rc | r)); [ "$r" = 124 ] && { echo "pytest-prefill timed out"; exit 124; } ;;
    bench-prefill)
      python3 bench/bench_sparse_prefill.py --out "$OUT" 2>&1 | tee "$OUT/bench-sparse-prefill.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    tp:*)            # examples/tensor_parallel_attention.py with N ranks (one per GPU, NCCL): checks, TP-N vs TP1 step times
                     # (more options of the example: FLASHMLA_TP_ARGS="--batch 32 ...")
      n=${step#tp:}; python3 -m torch.distributed.run --standalone --nproc-per-node "$n" examples/tensor_parallel_attention.py \
        --no-progress --json "$OUT/tp$n.json" ${FLASHMLA_TP_ARGS:-} 2>&1 | tee "$OUT/tp$n.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
exit $rc
