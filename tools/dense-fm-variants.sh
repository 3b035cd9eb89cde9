#!/usr/bin/env bash
# Branch dense-fm: fill tools/tmp/variants for tools/ab-variants.sh with
#   main = this branch (kWg1SlabOrder and kV1REarly on), order = kWg1SlabOrder only,
#   early = kV1REarly only, ship = main's dense_decode_kernel_v4.cuh (both off: SASS identical).
# Then on the GPU machine (carry .deps .whl):
#   OUT=/tmp/o bash tools/ab-variants.sh tools/tmp/variants python3 bench/bench_dense_decode.py --filter compute,memory,call --out /tmp/o
# plus tests/gpu/test_dense_decode_gpu.py for the winner and the C++ grid program (device-run.sh cpp-gpu-tests).
set -euo pipefail
cd "$(dirname "$0")/.."
K=src/sm90/dense_decode_kernel_v4.cuh
rm -rf tools/tmp/variants
mkdir -p tools/tmp/variants/main tools/tmp/variants/order/src/sm90 tools/tmp/variants/early/src/sm90 tools/tmp/variants/ship/src/sm90
sed "s/constexpr bool kV1REarly = true;/constexpr bool kV1REarly = false;/" $K > tools/tmp/variants/order/$K
sed "s/constexpr bool kWg1SlabOrder = true;/constexpr bool kWg1SlabOrder = false;/" $K > tools/tmp/variants/early/$K
grep -q "kV1REarly = false;" tools/tmp/variants/order/$K
grep -q "kWg1SlabOrder = false;" tools/tmp/variants/early/$K
git show main:$K > tools/tmp/variants/ship/$K
find tools/tmp/variants -type f
