#!/usr/bin/env bash
# One device call's worth of dense prefill A/B: builds the standalone check library (the kernels + shim, no package) of
# this tree and, when REV is given, of that git revision (its src/, include/ and tools/dense_prefill_check/), runs the
# standalone correctness check of every schedule on this tree's build, then the forward and backward A/Bs (ab_schedules.py), and packs
# every log into ONE file, $OUT/dense-prefill-ab.tgz (the device returns only a few files).
#
# Usage (GPU machine, repository root; carry nothing but the tree, plus an older tree in build-ab/old when the device
# copy has no git history):
#   bash tools/dense-prefill-ab.sh [--old DIR | --old-lib FILE] [--lib FILE] [--fwd "SCHEDULE ..."] [--bwd "SCHEDULE ..."]
#     [--no-check] [--rounds N]
# --old DIR: a tree to build as the "2:" side of the A/Bs (e.g. `git archive REV src include tools/dense_prefill_check |
#   tar -x -C build-ab/old` on the CPU machine); schedules named "2:NAME" run on it.
# --lib FILE: this tree's standalone library built beforehand (on the CPU machine, with the nvcc flags below:
#   `bash tools/dense-prefill-ab.sh --build-only DIR` writes DIR/lib.so), so the device call skips that build.
# --old-lib FILE: the "2:" side's library built beforehand (as --lib), instead of --old DIR.
# --build-only DIR: build this tree's library into DIR and exit (no GPU needed; NEW_FLAGS apply).
# --rounds N: timed rounds per shape, the schedules alternating in each (ab_schedules.py keeps the fastest; default
#   2; more where the GPU's clocks wander between runs, as the H100's did by 0.3-14 % per shape in one call on 2026-12-05).
# Defaults: --fwd "persistent_tma persistent_tma_fold", --bwd "two_kernel two_kernel_tma".
# NEW_FLAGS (environment): extra nvcc flags for this tree's build only, e.g. NEW_FLAGS=-DSOME_SWITCH=1
#   with --old . to A/B a build switch against the same tree without it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; W=/tmp/dense-prefill-ab; rm -rf "$W"; mkdir -p "$W" "$OUT"
OLD=""; OLD_LIB=""; LIB=""; BUILD_ONLY=""; FWD="persistent_tma persistent_tma_fold"; BWD="two_kernel two_kernel_tma"; CHECK=1; ROUNDS=2
while [ $# -gt 0 ]; do
  case $1 in
    --old) OLD=$2; shift 2 ;;
    --lib) LIB=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
    --old-lib) OLD_LIB=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
    --build-only) BUILD_ONLY=$2; shift 2 ;;
    --fwd) FWD=$2; shift 2 ;;
    --bwd) BWD=$2; shift 2 ;;
    --no-check) CHECK=0; shift ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
done
export PYTHONUNBUFFERED=1
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
FLAGS=(-std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -DFLASHMLA_WITH_CUDA=1 --expt-relaxed-constexpr
       -lineinfo -Xptxas=-v,--warn-on-spills --use_fast_math -Xcompiler -fPIC -Iinclude -Isrc)
build() {  # $1 = tree, $2 = output folder (lib.so and the ptxas logs), $3 = extra nvcc flags (one word or none)
  local T=$1 B=$2 X=${3:-}; mkdir -p "$B"
  ( cd "$T" || exit 1
    "$NVCC" "${FLAGS[@]}" ${X:+"$X"} -c src/sm90/prefill/dense/fwd.cu -o "$B/fwd.o" > "$B/ptxas-fwd.log" 2>&1 & a=$!
    "$NVCC" "${FLAGS[@]}" ${X:+"$X"} -c src/sm90/prefill/dense/bwd.cu -o "$B/bwd.o" > "$B/ptxas-bwd.log" 2>&1 & b=$!
    "$NVCC" "${FLAGS[@]}" -x cu -c tools/dense_prefill_check/shim.cpp -o "$B/shim.o" > "$B/shim.log" 2>&1 & c=$!
    "$NVCC" "${FLAGS[@]}" -x cu -c src/core/status.cpp -o "$B/status.o" > "$B/status.log" 2>&1 & d=$!
    rc=0; for p in $a $b $c $d; do wait $p || rc=1; done
    [ $rc = 0 ] && "$NVCC" -shared "$B/fwd.o" "$B/bwd.o" "$B/shim.o" "$B/status.o" -o "$B/lib.so" )
}
if [ -n "$BUILD_ONLY" ]; then
  mkdir -p "$BUILD_ONLY"; B=$(cd "$BUILD_ONLY" && pwd)
  build "$PWD" "$B" "${NEW_FLAGS:-}" || { cat "$B"/*.log; echo "build failed"; exit 1; }
  rm -f "$B"/*.o; grep -h "spill\|C75" "$B"/ptxas-*.log | sort | uniq -c; echo "built $B/lib.so"; exit 0
fi
echo "=== build $(date +%T)"
if [ -n "$LIB" ]; then
  ( mkdir -p "$W/new" && cp "$LIB" "$W/new/lib.so" && echo "this tree: $LIB (built beforehand)" ) & pn=$!
else
  build "$PWD" "$W/new" "${NEW_FLAGS:-}" & pn=$!
fi
if [ -n "$OLD" ]; then build "$(cd "$OLD" && pwd)" "$W/old" & po=$!; wait $po || { echo "build of $OLD failed"; exit 1; }; fi
wait $pn || { cat "$W"/new/*.log; echo "build failed"; exit 1; }
[ -z "$LIB" ] && grep -h "spill\|C75" "$W"/new/ptxas-*.log | sort | uniq -c
if [ -n "$OLD_LIB" ]; then mkdir -p "$W/old" && cp "$OLD_LIB" "$W/old/lib.so" && echo "2: side: $OLD_LIB (built beforehand)"; fi
LIB2=(); [ -n "$OLD$OLD_LIB" ] && LIB2=(--lib2 "$W/old/lib.so")
rc=0
if [ $CHECK = 1 ]; then
  echo "=== check $(date +%T)"
  timeout "${CHECK_TIMEOUT:-300}" python3 tools/dense_prefill_check/check.py --lib "$W/new/lib.so" --out "$W/check" --no-perf \
    > "$W/check.log" 2>&1; rc=$?
  echo "check rc=$rc, $(grep -c '^PASS' "$W/check.log") PASS"; grep "^FAIL\|failure" "$W/check.log" | head -20
fi
if [ -n "$FWD" ]; then
  echo "=== forward A/B $(date +%T): $FWD"
  timeout 300 python3 tools/dense_prefill_check/ab_schedules.py fwd "$W/new/lib.so" "${LIB2[@]}" --rounds "$ROUNDS" $FWD 2>&1 | tee "$W/ab-fwd.log"
fi
if [ -n "$BWD" ]; then
  echo "=== backward A/B $(date +%T): $BWD"
  timeout 300 python3 tools/dense_prefill_check/ab_schedules.py bwd "$W/new/lib.so" "${LIB2[@]}" --rounds "$ROUNDS" $BWD 2>&1 | tee "$W/ab-bwd.log"
fi
rm -f "$W"/*/*.o "$W"/*/lib.so
tar czf "$OUT/dense-prefill-ab.tgz" -C "$W" .
echo "=== done $(date +%T): $OUT/dense-prefill-ab.tgz"
exit $rc
