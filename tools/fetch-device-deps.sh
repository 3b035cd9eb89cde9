#!/usr/bin/env bash
# Fetch what a device call must carry (the GPU machine has no network), into the two ignored folders
# that tools/device-run.sh, tools/ab-variants.sh and tools/ab-call.sh expect (carry [".deps", ".whl"]):
#   .whl/                  the apache-tvm-ffi wheel for the device's Python (cp312, manylinux x86_64)
#   .deps/cutlass_include  the CUTLASS / CuTe headers of the PyPI package nvidia-cutlass (4.x)
# Usage: bash tools/fetch-device-deps.sh   (about 30 MB; run here, before the first device call)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DEVICE_PY:-3.12}
mkdir -p .whl .deps
rm -f .whl/apache_tvm_ffi-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl 'apache-tvm-ffi>=0.1.11,<0.2,!=0.1.12'
bash tools/fetch-cutlass.sh
ls .whl; du -sh .deps/cutlass_include
