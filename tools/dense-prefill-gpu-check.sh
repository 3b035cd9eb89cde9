#!/usr/bin/env bash
# Standalone GPU check of the sm90 dense MHA prefill kernels (src/sm90/prefill/dense/), independent of the
# Python package and its bindings: builds build/dense-prefill-check/libdense_prefill_check.so with nvcc
# (the kernels + tools/dense_prefill_check/shim.cpp), runs a smoke test of the default schedules and one of
# every schedule, each under a 120 s timeout (a hang costs two minutes, not the call; a hanging variant is
# left out of the rest), then tools/dense_prefill_check/check.py: correctness against a float32 torch
# reference (spec §5.5 configurations and the extra cases), determinism, and TFLOPS against torch SDPA's
# cuDNN backend on the 16 shapes of the anchors table. Needs nvcc, torch with CUDA and an sm_90 GPU.
# Logs and dense-prefill-check.json (rewritten after every case) go to $OUT (default /tmp/out); the full
# check runs under timeout $CHECK_TIMEOUT (default 420 s).
# Usage: [BENCH=1] bash tools/dense-prefill-gpu-check.sh [check.py options, e.g. --no-perf, --no-big]
# (BENCH=1 then runs bench/bench_dense_prefill.py on the same library, with FA3 from .whl/ when carried.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
B=build/dense-prefill-check; mkdir -p "$B"
FLAGS=(-std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -DFLASHMLA_WITH_CUDA=1 --expt-relaxed-constexpr
       -lineinfo -Xptxas=-v,--warn-on-spills --use_fast_math -Xcompiler -fPIC -Iinclude -Isrc)
LIB="$B/libdense_prefill_check.so"
SRCS=(src/sm90/prefill/dense/*.cu src/sm90/prefill/dense/*.cuh src/sm90/prefill/dense/*.h tools/dense_prefill_check/shim.cpp tools/dense_prefill_check/standalone.h
      src/sm90/common/*.cuh src/sm90/common/*.h include/flashmla/*.h)
if [ -f "$LIB" ] && [ -z "$(find "${SRCS[@]}" -newer "$LIB" 2>/dev/null)" ]; then
  echo "=== build: $LIB is up to date"
else
echo "=== build $(date +%T)"
"$NVCC" "${FLAGS[@]}" -c src/sm90/prefill/dense/fwd.cu -o "$B/fwd.o" > "$OUT/ptxas-fwd.log" 2>&1 & p1=$!
"$NVCC" "${FLAGS[@]}" -c src/sm90/prefill/dense/bwd.cu -o "$B/bwd.o" > "$OUT/ptxas-bwd.log" 2>&1 & p2=$!
"$NVCC" "${FLAGS[@]}" -x cu -c tools/dense_prefill_check/shim.cpp -o "$B/shim.o" > "$OUT/shim.log" 2>&1 & p3=$!
"$NVCC" "${FLAGS[@]}" -x cu -c src/core/status.cpp -o "$B/status.o" > "$OUT/status.log" 2>&1 & p4=$!
rc=0; for p in $p1 $p2 $p3 $p4; do wait $p || rc=1; done
grep -h "spill\|C75\|error" "$OUT"/ptxas-*.log | sort | uniq -c
if [ $rc != 0 ]; then cat "$OUT"/*.log; echo "build failed"; exit 1; fi
"$NVCC" -shared "$B/fwd.o" "$B/bwd.o" "$B/shim.o" "$B/status.o" -o "$LIB" || exit 1
fi
echo "=== smoke, default schedules $(date +%T)"
timeout 120 python3 tools/dense_prefill_check/check.py --lib "$B/libdense_prefill_check.so" --out "$OUT/smoke" --quick \
  --no-variants 2>&1 | tee "$OUT/dense-prefill-smoke.log"
r=${PIPESTATUS[0]}
if [ "$r" = 124 ]; then echo "smoke test timed out (hang?)"; exit 124; fi
echo "=== smoke, all schedules $(date +%T)"
VAR=""
timeout 120 python3 tools/dense_prefill_check/check.py --lib "$B/libdense_prefill_check.so" --out "$OUT/smoke-variants" \
  --quick 2>&1 | tee "$OUT/dense-prefill-smoke-variants.log"
[ "${PIPESTATUS[0]}" = 124 ] && { echo "variant smoke test timed out (hang?): full check without variants"; VAR=--no-variants; }
echo "=== check $(date +%T)"
timeout ${CHECK_TIMEOUT:-420} python3 tools/dense_prefill_check/check.py --lib "$B/libdense_prefill_check.so" --out "$OUT" \
  $VAR "$@" 2>&1 | tee "$OUT/dense-prefill-check.log"
r2=${PIPESTATUS[0]}
r3=0
if [ "${BENCH:-0}" = 1 ]; then  # also bench/bench_dense_prefill.py (JSON + plot under $OUT)
  echo "=== bench $(date +%T)"
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 bench/bench_dense_prefill.py --lib "$B/libdense_prefill_check.so" --out "$OUT" 2>&1 | tee "$OUT/bench-dense-prefill.log"
  r3=${PIPESTATUS[0]}
fi
echo "=== done $(date +%T) smoke rc=$r check rc=$r2 bench rc=$r3"
exit $((r | r2 | r3))
