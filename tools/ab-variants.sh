#!/usr/bin/env bash
# A/B several source variants of the library in one device call.
#
# Usage (on the GPU machine, from the repository root, carry [".deps", ".whl"] and the variants):
#   bash tools/ab-variants.sh VARIANTS_DIR COMMAND...
# VARIANTS_DIR holds one folder per variant whose files replace the same paths of the tree
# (e.g. VARIANTS_DIR/reread/src/sm90/decode/sparse_fp8/wgmma_producer_kernel.cuh); an empty folder (or the name
# given in AB_TREE, default "main") is the tree as is.
# Git does not carry empty directories to the device machine, so name the tree variant "main" (the
# script creates that folder there) rather than relying on another empty folder.
# Every variant is copied to its own source tree (/tmp/ab-src-<name>) and all of them are built in
# parallel with pip into /tmp/ab-<name>; then COMMAND runs once per variant, one after another, with
# that build first on PYTHONPATH and AB_VARIANT=<name> in the environment, e.g.
#   bash tools/ab-variants.sh tools/tmp/variants python3 bench/quick_sparse_decode.py
# Logs: $OUT/ab-<name>-build.log and $OUT/ab-<name>.log (OUT defaults to /tmp/out).
# A variant may hold a file `env` (KEY=VALUE lines): exported for its runs (switches read per call).
# A variant may also (or only) hold a file `cuda-flags` (e.g. "-DFLASHMLA_SOME_SWITCH=1"):
# its content becomes CMAKE_CUDA_FLAGS of that build and AB_CUDA_FLAGS of its runs (for builds the
# command makes itself, e.g. the C++ GPU tests) — the way to A/B the opt-in macros of the kernels.
# To fill VARIANTS_DIR from git branches (here, before the device call):
#   for b in reread early-a; do for f in $(git diff --name-only main $b -- src); do
#     mkdir -p tools/tmp/variants/$b/$(dirname $f); git show $b:$f > tools/tmp/variants/$b/$f; done; done
set -uo pipefail
cd "$(dirname "$0")/.."
VARIANTS=${1:?variants folder}
shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$VARIANTS/${AB_TREE:-main}"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # tvm_ffi for the build and the runs
CUTLASS=$PWD/.deps/cutlass_include
names=()
for vdir in "$VARIANTS"/*/; do names+=("$(basename "$vdir")"); done
# A variant whose folder holds only an `env` file runs the tree's build (no build of its own).
env_only() { [ -f "$VARIANTS/$1/env" ] && [ "$(ls -A "$VARIANTS/$1")" = env ]; }
nbuild=0
for name in "${names[@]}"; do env_only "$name" || nbuild=$((nbuild + 1)); done
# Parallel level per build: the cores shared among the variants (at least 4).
per=$(( $(nproc) / nbuild )); [ "$per" -lt 4 ] && per=4
echo "=== building ${names[*]} ($nbuild builds, $per jobs each) $(date +%T)"
for name in "${names[@]}"; do
  if env_only "$name"; then
    rm -rf "/tmp/ab-$name" "/tmp/ab-src-$name"
    ln -s "/tmp/ab-${AB_TREE:-main}" "/tmp/ab-$name"; ln -s "/tmp/ab-src-${AB_TREE:-main}" "/tmp/ab-src-$name"
    echo 0 > "$OUT/ab-$name-build.rc"
    continue
  fi
  src=/tmp/ab-src-$name
  rm -rf "$src"; mkdir -p "$src"
  tar --exclude=./build --exclude=./.git --exclude="./$VARIANTS" -cf - . | tar -xf - -C "$src"
  cp -r "$VARIANTS/$name/." "$src/"
  flags=$(cat "$VARIANTS/$name/cuda-flags" 2>/dev/null | tr '\n' ' ')
  ( cd "$src" && CMAKE_BUILD_PARALLEL_LEVEL=$per python3 -m pip install -q --no-build-isolation --no-deps \
      --no-index --target "/tmp/ab-$name" --upgrade . -C cmake.define.FLASHMLA_CUTLASS_INCLUDE_DIR="$CUTLASS" \
      ${flags:+-C "cmake.define.CMAKE_CUDA_FLAGS=$flags"} \
      -C build-dir="build/ab" >"$OUT/ab-$name-build.log" 2>&1; echo $? > "$OUT/ab-$name-build.rc" ) &
done
wait
echo "=== built $(date +%T)"
rc=0
for name in "${names[@]}"; do
  if [ "$(cat "$OUT/ab-$name-build.rc")" != 0 ]; then
    echo "build of $name failed (tail of $OUT/ab-$name-build.log):"; tail -20 "$OUT/ab-$name-build.log"; rc=1; continue
  fi
  echo "=== $name: run $(date +%T)"
  ( [ -f "$VARIANTS/$name/env" ] && while read -r kv; do [ -n "$kv" ] && export "$kv"; done < "$VARIANTS/$name/env"
    AB_CUDA_FLAGS=$(cat "$VARIANTS/$name/cuda-flags" 2>/dev/null | tr '\n' ' ') AB_VARIANT=$name \
      PYTHONPATH="/tmp/ab-$name:$PYTHONPATH" "$@" ) 2>&1 | tee "$OUT/ab-$name.log"
  rc=$((rc | ${PIPESTATUS[0]}))
done
exit $rc
