#!/usr/bin/env bash
# The test suite: install, build and run the C++ tests (GoogleTest/CTest, again under ASan + UBSan), then pytest
# (tests/python everywhere; tests/gpu skip themselves without a Hopper GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
bash tools/install.sh
$PY -m pip install -q "pytest>=7,<10" "jax[cpu]>=0.4.31,<1" "jax-tvm-ffi>=0.1.3,<0.2"
# PaddlePaddle (CPU build from PyPI) for the framework tests; its tests skip if it cannot be installed.
$PY -m pip install -q "paddlepaddle>=3,<4" || echo "paddlepaddle not installed: its tests will skip"

echo "== C++ tests (reference backend, validation, scheduler)"
cmake -S . -B build/cpp-tests -G Ninja -DFLASHMLA_ENABLE_CUDA=OFF -DFLASHMLA_BUILD_TESTS=ON >/dev/null
cmake --build build/cpp-tests -j "$JOBS"
ctest --test-dir build/cpp-tests --output-on-failure -j "$JOBS"

# The same C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer (the validation's size and
# overlap arithmetic, the reference backend's indexing); skipped when the compiler cannot link them.
if echo 'int main() { return 0; }' | ${CXX:-c++} -fsanitize=address,undefined -x c++ - -o build/.san-probe 2>/dev/null; then
  echo "== C++ tests under ASan + UBSan"
  cmake -S . -B build/cpp-tests-san -G Ninja -DFLASHMLA_ENABLE_CUDA=OFF -DFLASHMLA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" >/dev/null
  cmake --build build/cpp-tests-san -j "$JOBS" > build/cpp-tests-san.log 2>&1 || { tail -40 build/cpp-tests-san.log; exit 1; }
  ctest --test-dir build/cpp-tests-san --output-on-failure -j "$JOBS" > build/cpp-tests-san-ctest.log 2>&1 ||
    { tail -80 build/cpp-tests-san-ctest.log; exit 1; }
  tail -3 build/cpp-tests-san-ctest.log
else
  echo "== C++ tests under ASan + UBSan: SKIPPED (the compiler cannot link -fsanitize=address,undefined)"
fi

echo "== C++ user example: install the core, find_package(flashmla), link flashmla::core, run"
cmake --install build/cpp-tests --prefix build/cpp-install >/dev/null
cmake -S examples/cpp -B build/cpp-example -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build/cpp-install" >/dev/null
cmake --build build/cpp-example -j "$JOBS" >/dev/null
./build/cpp-example/dense_decode_cpu

# With nvcc present (the sm_90a kernels were built): ptxas's report on every kernel; fails if any
# kernel's wgmma instructions are serialized for lack of registers (C7512). No GPU needed.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== sm_90a kernels: ptxas registers / spills / wgmma serialization (tools/check-ptxas.py)"
  bash tools/fetch-cutlass.sh  # (already there unless FLASHMLA_PIP_ARGS switched the CUDA build off)
  ptx_out=$($PY tools/check-ptxas.py --jobs "$JOBS" 2>&1) || { echo "$ptx_out" | tail -40; echo "tools/check-ptxas.py failed" >&2; exit 1; }
  mkdir -p build && echo "$ptx_out" > build/check-ptxas.txt
  echo "   $(echo "$ptx_out" | tail -1) (per-kernel table: build/check-ptxas.txt)"
fi

echo "== Python tests"
set +e
$PY -m pytest tests/python tests/gpu -q -rs "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi

# One abi3 wheel with the torch op library (stable ABI), ABI-checked and tested under the
# newest torch and torch 2.11 (two venvs; see the script). FLASHMLA_SKIP_TORCH_ABI=1 skips it.
if [ "${FLASHMLA_SKIP_TORCH_ABI:-0}" = "0" ]; then
  start=$SECONDS
  bash tools/torch-abi-ci.sh || rc=1
  echo "== torch ABI stage: $((SECONDS - start)) s"
fi
exit "$rc"
