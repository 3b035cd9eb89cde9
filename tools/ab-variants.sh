#!/usr/bin/env bash
# A/B several source variants of the library in one device call (each built into its own folder).
#
# Usage (on the GPU machine, from the repository root, carry [".deps", ".whl"] and the variants):
#   bash tools/ab-variants.sh VARIANTS_DIR COMMAND...
# VARIANTS_DIR holds one folder per variant whose files replace the same paths of the tree
# (e.g. VARIANTS_DIR/reread/src/sm90/sparse_decode_kernel_v4.cuh); an empty folder is the tree as is.
# Each variant is built with pip into /tmp/ab-<name> (build dir build/ab-<name>) and COMMAND runs
# with that build first on PYTHONPATH and AB_VARIANT=<name> in the environment, e.g.
#   bash tools/ab-variants.sh tools/tmp/variants python3 tools/tmp/quick.py
# The tree is restored after each build. Logs: $OUT/ab-<name>.log (OUT defaults to /tmp/out).
# To fill VARIANTS_DIR from git branches (here, before the device call):
#   for b in reread early-a; do for f in $(git diff --name-only main $b -- src); do
#     mkdir -p tools/tmp/variants/$b/$(dirname $f); git show $b:$f > tools/tmp/variants/$b/$f; done; done
set -uo pipefail
cd "$(dirname "$0")/.."
VARIANTS=${1:?variants folder}
shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
CUTLASS=$PWD/.deps/cutlass_include
rc=0
for vdir in "$VARIANTS"/*/; do
  name=$(basename "$vdir")
  backup=$(mktemp -d)
  # Swap the variant's files in (keeping the originals), build, swap back.
  (cd "$vdir" && find . -type f) | while read -r f; do
    mkdir -p "$backup/$(dirname "$f")"
    cp "$f" "$backup/$f" 2>/dev/null || true
    mkdir -p "$(dirname "$f")"
    cp "$vdir/$f" "$f"
  done
  echo "=== $name: build $(date +%T)"
  python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "/tmp/ab-$name" --upgrade . \
    -C cmake.define.FLASHMLA_CUTLASS_INCLUDE_DIR="$CUTLASS" -C build-dir="build/ab-$name" >"$OUT/ab-$name-build.log" 2>&1
  brc=$?
  (cd "$vdir" && find . -type f) | while read -r f; do
    if [ -f "$backup/$f" ]; then cp "$backup/$f" "$f"; else rm -f "$f"; fi
  done
  rm -rf "$backup"
  if [ $brc -ne 0 ]; then
    echo "build of $name failed (tail of $OUT/ab-$name-build.log):"; tail -20 "$OUT/ab-$name-build.log"; rc=1; continue
  fi
  echo "=== $name: run $(date +%T)"
  AB_VARIANT=$name PYTHONPATH="/tmp/ab-$name:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" "$@" 2>&1 | tee "$OUT/ab-$name.log"
  rc=$((rc | ${PIPESTATUS[0]}))
done
exit $rc
