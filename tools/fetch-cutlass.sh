#!/usr/bin/env bash
# The CUTLASS / CuTe C++ headers of the PyPI package nvidia-cutlass (4.x) into .deps/cutlass_include,
# where CMakeLists.txt and tools/check-ptxas.py look for them. Only the wheel is downloaded (no
# install into any Python: its Python dependencies are not needed for the headers). ~6 MB download.
# Skipped when the headers are already there. Usage: bash tools/fetch-cutlass.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -f .deps/cutlass_include/cute/tensor.hpp ]; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m pip download -q --no-deps -d "$tmp" 'nvidia-cutlass>=4.2,<5'
$PY -m zipfile -e "$tmp"/nvidia_cutlass-*.whl "$tmp/x" >/dev/null
mkdir -p .deps
rm -rf .deps/cutlass_include
cp -r "$tmp/x/cutlass_library/source/include" .deps/cutlass_include
echo "CUTLASS headers: .deps/cutlass_include ($(du -sh .deps/cutlass_include | cut -f1))"
