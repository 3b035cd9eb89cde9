#!/usr/bin/env bash
# The eager host path of torch decode calls on the GPU (issue 25 item 4; docs/host-path.md), in < 150 s after
# `bash tools/device-run.sh build` (our package installed, /tmp/site holding TVM-FFI):
#   1. the torch GPU tests of this path: the eager route (tests/gpu/test_torch_eager_route_gpu.py), the torch.ops
#      file whose public calls now take it (CUDA graphs, streams, torch.compile, second GPU), the current-device
#      file (2 GPUs), and the CPU route tests;                                  -> $OUT/pytest-host-path.log
#   2. bench/bench_call_overhead.py, side by side with FlashMLA when /tmp/anchor/flashmla is built (bash
#      .anchor/build.sh; without it our rows only);             -> $OUT/<date>-call-overhead.json, call-overhead.log
#   3. tools/profile-host-path.sh until 125 s (layers of ours and FlashMLA; the C++-core-alone step is skipped:
#      this change does not touch it)                                       -> $OUT/summary.txt and the rest
#   4. test_torch_ops_gpu.py's torch.compile-with-inductor test, with the time left (up to 148 s in all)
# The eager TVM-FFI route is off by default (flash_mla._torch_ops.set_eager_route): the tests switch it on where
# they test it, bench_call_overhead measures both routes (api-torch, api-torch-eager); EAGER_ROUTE=1 runs the
# side-by-side and the layers of steps 2-3 with it on.
# Usage: bash tools/host-path-gpu-check.sh     (env: OUT, default /tmp/out; ANCHOR_DIR, default /tmp/anchor/flashmla;
#        EAGER_ROUTE=1)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
ANCHOR_DIR=${ANCHOR_DIR:-/tmp/anchor/flashmla}
T0=$SECONDS
rc=0

echo "=== 1. pytest, torch on the host path ($(date +%T))"
python3 -c "import flash_mla._torch_ops as t; print('eager route at import:', t.eager_route_state())"
EAGER=(); [ "${EAGER_ROUTE:-0}" != 0 ] && EAGER=(--eager-route)
pytest_step() {  # pytest_step LIMIT_S LOG ARGS...
  local limit=$1 log=$2; shift 2
  FLASHMLA_REQUIRE_TORCH_OPS=1 timeout -k 5 "$limit" python3 -m pytest -q -rs --tb=short -p no:cacheprovider "$@" \
    2>&1 | tee -a "$OUT/$log"
  local r=${PIPESTATUS[0]}
  [ "$r" -ne 0 ] && { echo "=== pytest $*: rc $r$([ "$r" = 124 ] && echo ' (timed out)')"; rc=1; }
}
: > "$OUT/pytest-host-path.log"
pytest_step 40 pytest-host-path.log tests/gpu/test_torch_eager_route_gpu.py tests/python/test_torch_eager_route.py
# (the inductor compile, the slow one, runs last, when time is left)
pytest_step 45 pytest-host-path.log tests/gpu/test_torch_ops_gpu.py tests/gpu/test_current_device_gpu.py \
  -k "not inductor"

echo "=== 2. bench_call_overhead ($(date +%T), $((SECONDS - T0)) s used)"
anchor=()
if ls "$ANCHOR_DIR"/flash_mla/cuda*.so >/dev/null 2>&1; then anchor=(--anchor-path "$ANCHOR_DIR")
else echo "no FlashMLA build under $ANCHOR_DIR (bash .anchor/build.sh): our rows only"; fi
timeout -k 5 60 python3 bench/bench_call_overhead.py --out "$OUT" ${anchor[@]+"${anchor[@]}"} ${EAGER[@]+"${EAGER[@]}"} 2>&1 |
  tee "$OUT/call-overhead.log"
r=${PIPESTATUS[0]}; [ "$r" -ne 0 ] && { echo "=== bench_call_overhead: rc $r"; rc=1; }

left=$((125 - (SECONDS - T0)))
echo "=== 3. profile-host-path.sh, ${left} s ($(date +%T))"
if [ "$left" -gt 20 ]; then
  PROFILE_SKIP_CORE=1 PROFILE_BUDGET_S=$left PROFILE_EAGER_ROUTE=${EAGER_ROUTE:-0} ANCHOR_DIR=$ANCHOR_DIR OUT=$OUT \
    bash tools/profile-host-path.sh \
    > "$OUT/profile-host-path.log" 2>&1
  grep -E "route|api |python-layer|eager function|route\(\)|tvm-ffi|opoverload dense|cuda-direct|=== done" \
    "$OUT/profile-host-path.log" | head -60
else
  echo "skipped: no time left"
fi
left=$((148 - (SECONDS - T0)))
if [ "$left" -gt 15 ]; then
  echo "=== 4. pytest, torch.compile with inductor on CUDA (${left} s)"
  pytest_step "$left" pytest-host-path.log tests/gpu/test_torch_ops_gpu.py -k inductor
fi
echo "=== done in $((SECONDS - T0)) s, rc $rc"
exit $rc
