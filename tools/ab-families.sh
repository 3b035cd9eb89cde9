#!/usr/bin/env bash
# Per-variant command for tools/ab-variants.sh: benchmarks and tests chosen by the variant's name.
#   main  -> the benchmarks of AB_FAMILIES (default: dense sparse prefill; also mha: dense MHA prefill) and, unless
#            AB_SKIP_SUITE=1, the whole GPU pytest suite (tests/gpu)
#   sd*   -> sparse decode: benchmark + tests/gpu/test_sparse_decode_gpu.py
#            (AB_GRID=1: also the 4748-case spec §5.2 grid, ~130 s)
#   d*    -> dense decode: benchmark + tests/gpu/test_dense_decode_gpu.py + the C++ §5.4 grid
#            (tests/gpu/cpp, built in the variant's source tree with its AB_CUDA_FLAGS)
#   p*    -> sparse prefill: benchmark + tests/gpu/test_sparse_prefill_gpu.py + the 617-case §5.3 grid
#   mha*  -> dense MHA prefill (flash_attn_varlen_func forward + backward): bench_dense_prefill.py (16 shapes,
#            ours, cuDNN and FA3 in the same run; AB_MHA_ONLY="NAME ..." passes --only) +
#            tests/gpu/test_dense_prefill_gpu.py
# AB_TESTS=0: benchmarks and a smoke test only (a first call over many variants; the winners get the
# full tests in the next one).
# Benchmark JSONs go to $AB_JSON/<variant>/ (default /tmp/j); compare them with bench/compare.py.
set -uo pipefail
v=${AB_VARIANT:?run under tools/ab-variants.sh}
J=${AB_JSON:-/tmp/j}/$v
mkdir -p "$J"
rc=0
case $v in main) fam=all ;; mha*) fam=mha ;; sd*) fam=sparse ;; d*) fam=dense ;; p*) fam=prefill ;; *) fam=all ;; esac
# Every step under a timeout: a variant that deadlocks must not eat the rest of the device call.
bench() { timeout 180 python3 "bench/$1" --out "$J" 2>&1 | tail -1; rc=$((rc | ${PIPESTATUS[0]})); }
# main's benchmarks: the families in AB_FAMILIES (default the three MLA families; e.g. "sparse prefill" when
# the call A/Bs only those, "mha" for dense MHA prefill).
fams=${AB_FAMILIES:-dense sparse prefill}
want() { [ $fam = "$1" ] || { [ $fam = all ] && [[ " $fams " == *" $1 "* ]]; }; }
want dense && bench bench_dense_decode.py
want sparse && bench bench_sparse_decode.py
want prefill && bench bench_sparse_prefill.py
# Dense MHA prefill: 16 shapes x (ours forward + backward, cuDNN forward + backward, FA3 forward), ~2-4 min.
# Also the bits of out / lse / dq / dk / dv on fixed inputs ($J/grad-hash.txt; tools/ab-call.sh compares each
# variant's with main's): a variant that keeps the operations and their order must match main exactly.
if want mha; then
  timeout 420 python3 bench/bench_dense_prefill.py --out "$J" ${AB_MHA_ONLY:+--only $AB_MHA_ONLY} 2>&1 | tail -17
  rc=$((rc | ${PIPESTATUS[0]}))
  timeout 120 python3 bench/dense_prefill_grad_hash.py --out "$J/grad-hash.txt" > /dev/null 2>&1 \
    || { echo "dense_prefill_grad_hash.py failed"; rc=1; }
fi
# AB_TESTS=0: only a smoke test of the variant's family (a few pytest cases, ~10 s), unless AB_SMOKE=0,
# so that a variant that computes wrong results is caught in the benchmark call already.
if [ "${AB_TESTS:-1}" = 0 ]; then
  if [ "${AB_SMOKE:-1}" = 1 ]; then
    case $fam in
      dense) sel=(tests/gpu/test_dense_decode_gpu.py -k "page_block_sizes or regression4 or rescale") ;;
      sparse) sel=(tests/gpu/test_sparse_decode_gpu.py -k "correctness_grid or non_positive or rescale") ;;
      prefill) sel=(tests/gpu/test_sparse_prefill_gpu.py -k "rescale_mid_row or (correctness_grid and h128)") ;;
      mha) sel=(tests/gpu/test_dense_prefill_gpu.py -k "short_ragged and (mixed or sq_gt_sk)") ;;
      *) sel=() ;;
    esac
    if [ ${#sel[@]} -gt 0 ]; then
      timeout 120 python3 -m pytest "${sel[@]}" -q -x 2>&1 | tail -2; rc=$((rc | ${PIPESTATUS[0]}))
    fi
  fi
  exit $rc
fi
case $fam in
  all)
    if [ "${AB_SKIP_SUITE:-0}" != 1 ]; then
      timeout 400 python3 -m pytest tests/gpu -q -x 2>&1 | grep -v "^SKIPPED" | tail -4; rc=$((rc | ${PIPESTATUS[0]}))
    fi ;;
  dense)
    timeout 180 python3 -m pytest tests/gpu/test_dense_decode_gpu.py -q 2>&1 | tail -2; rc=$((rc | ${PIPESTATUS[0]}))
    src=/tmp/ab-src-$v
    ( cd "$src" && cmake -S . -B build/gpu-tests -G Ninja -DFLASHMLA_ENABLE_CUDA=ON \
        -DFLASHMLA_CUTLASS_INCLUDE_DIR="$src/.deps/cutlass_include" -DFLASHMLA_BUILD_GPU_TESTS=ON \
        ${AB_CUDA_FLAGS:+"-DCMAKE_CUDA_FLAGS=$AB_CUDA_FLAGS"} >/dev/null && cmake --build build/gpu-tests 2>&1 | tail -1 ) \
      || rc=1
    for t in "$src"/build/gpu-tests/tests/gpu/cpp/test_*; do
      [ -x "$t" ] || continue
      timeout 240 "$t" > "$J/$(basename "$t").log" 2>&1; r=$?; rc=$((rc | r))
      echo "$(basename "$t"): rc $r; $(grep -ci "fail" "$J/$(basename "$t").log") lines mention a failure"; tail -3 "$J/$(basename "$t").log"
    done ;;
  sparse)
    timeout 180 python3 -m pytest tests/gpu/test_sparse_decode_gpu.py -q -x 2>&1 | tail -2; rc=$((rc | ${PIPESTATUS[0]}))
    if [ "${AB_GRID:-0}" = 1 ]; then
      FLASHMLA_FULL_GRID=1 FLASHMLA_GRID_SLICE=0:4748 timeout 300 python3 -m pytest tests/gpu/test_sparse_decode_grid_gpu.py -q --tb=line \
        2>&1 | tail -4; rc=$((rc | ${PIPESTATUS[0]}))
    fi ;;
  prefill)
    timeout 120 python3 -m pytest tests/gpu/test_sparse_prefill_gpu.py -q -x 2>&1 | tail -2; rc=$((rc | ${PIPESTATUS[0]}))
    FLASHMLA_FULL_GRID=1 timeout 120 python3 -m pytest tests/gpu/test_sparse_prefill_grid_gpu.py -q --tb=line \
      2>&1 | tail -4; rc=$((rc | ${PIPESTATUS[0]})) ;;
  mha)
    timeout 400 python3 -m pytest tests/gpu/test_dense_prefill_gpu.py -q 2>&1 | tail -3; rc=$((rc | ${PIPESTATUS[0]})) ;;
esac
exit $rc
