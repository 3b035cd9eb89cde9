#!/usr/bin/env bash
# CI stage "torch ABI" (called by tools/run-tests.sh): proves the abi3 / stable-ABI claims.
#   1. venv A gets the newest torch from PyPI; ONE wheel is built there (CPU backend,
#      torch op library compiled with TORCH_TARGET_VERSION = 2.10);
#   2. tools/check-abi.py on that wheel (no CPython symbols, no unstable torch C++ symbols,
#      cp310-abi3 tag), plus abi3audit when it can be installed;
#   3. the SAME wheel is installed into venv A and into venv B (torch 2.11) and
#      tests/python/test_torch_ops.py runs in both (opcheck, torch.compile, values, errors);
#   4. and into a small venv without torch: the TVM-FFI path works, test_torch_ops skips.
# Disk: a torch venv from PyPI is 5-6 GB (CUDA libraries); one CI run ran out of disk with both
# venvs (6.2 + 4.7 GB) and pip's cache of both torches' wheels. So pip's cache is off here (nothing of venv A's
# wheels is reused by venv B), venv A is deleted once its tests pass, and free space is printed
# before each venv. When less than FLASHMLA_CI_MIN_FREE_GB (default 8) is free before venv B, the
# torch-2.11 step is skipped with a loud message instead of dying half-way in pip (and the whole
# stage below FLASHMLA_CI_MIN_FREE_GB + 4 at its start).
# Env: PYTHON (interpreter for the venvs), FLASHMLA_CI_TORCH_NEW (default "torch"),
# FLASHMLA_CI_TORCH_OLD (default "torch==2.11.*"), FLASHMLA_CI_VENVS (default build/ci-venvs),
# FLASHMLA_CI_KEEP_VENVS=1 keeps venv A, FLASHMLA_CI_MIN_FREE_GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_NEW=${FLASHMLA_CI_TORCH_NEW:-torch}
TORCH_OLD=${FLASHMLA_CI_TORCH_OLD:-torch==2.11.*}
VENVS=$(realpath -m "${FLASHMLA_CI_VENVS:-build/ci-venvs}")
WHEELDIR=$PWD/build/ci-wheel
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}
MIN_FREE_GB=${FLASHMLA_CI_MIN_FREE_GB:-8}
# Flaky networks: more connection retries and resumed downloads (the torch venvs pull ~3 GB of
# CUDA wheels; a dropped connection once failed a whole CI run). Older pips ignore the last one.
export PIP_RETRIES=${PIP_RETRIES:-10} PIP_TIMEOUT=${PIP_TIMEOUT:-60} PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-20}
RUNTIME_DEPS=("apache-tvm-ffi>=0.1.11,<0.2,!=0.1.12" "numpy>=1.24,<3" "ml_dtypes>=0.4,<1" "rich>=13,<16"
              "tqdm>=4.60,<5" "pytest>=7,<10")
t0=$SECONDS
stamp() { echo "   [torch-abi $((SECONDS - t0)) s] $*"; }
mkdir -p "$VENVS"
free_gb() { df -Pk "$VENVS" | awk 'NR==2 {printf "%d", $4 / 1048576}'; }

make_venv() {  # make_venv DIR TORCH_SPEC
  local dir=$1 spec=$2
  [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade "pip>=23"
  local i
  for i in 1 2 3; do  # whole-install retries on top of pip's own (a download can still fail midway)
    "$dir/bin/python" -m pip install -q "$spec" "${RUNTIME_DEPS[@]}" && break
    [ "$i" = 3 ] && return 1
    echo "   pip install of $spec failed (attempt $i); retrying in 20 s"; sleep 20
  done
  stamp "$dir: $("$dir/bin/python" -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])')"
}

echo "== torch ABI: venv A ($TORCH_NEW), build one wheel ($(free_gb) GB free under $VENVS)"
if [ "$(free_gb)" -lt $((MIN_FREE_GB + 4)) ] && [ ! -x "$VENVS/torch-new/bin/python" ]; then
  # venv A (torch + JAX + transformers, ~6 GB) plus pip's unpacking needs more than venv B.
  echo "   !!! SKIPPED: the torch ABI stage needs ~$((MIN_FREE_GB + 4)) GB and only $(free_gb) GB is free;"
  echo "   !!! the abi3 wheel and the torch.ops path were not tested in this run"
  exit 0
fi
make_venv "$VENVS/torch-new" "$TORCH_NEW"
A="$VENVS/torch-new/bin/python"
"$A" -m pip install -q "scikit-build-core>=0.10,<2" "cmake>=3.28,<5" "ninja>=1.11,<2"
rm -rf "$WHEELDIR" && mkdir -p "$WHEELDIR"
"$A" -m pip wheel -q --no-build-isolation --no-deps . -w "$WHEELDIR" \
  -C cmake.define.FLASHMLA_ENABLE_CUDA=OFF -C cmake.define.FLASHMLA_BUILD_TORCH=ON -C build-dir=build/ci-wheel-build
WHL=$(ls "$WHEELDIR"/flash_mla-*.whl)
stamp "built $(basename "$WHL")"

echo "== torch ABI: check the wheel's libraries"
"$A" tools/check-abi.py "$WHL"
if "$A" -m pip install -q "abi3audit>=0.0.20" 2>/dev/null; then
  "$VENVS/torch-new/bin/abi3audit" --strict --report "$WHL"
else
  echo "abi3audit could not be installed: skipped (tools/check-abi.py has checked the CPython symbols)"
fi

run_tests() {  # run_tests PYTHON LABEL [TEST PATHS...]
  local py=$1 label=$2
  shift 2
  "$py" -m pip install -q --force-reinstall --no-deps "$WHL"
  # From outside the source tree, so the installed wheel (not python/) is imported.
  (cd tests/python && FLASHMLA_REQUIRE_TORCH_OPS=1 "$py" -c \
    'import torch, flash_mla, flash_mla._torch_ops as t; assert t.available(), t.load_error(); print("   torch", torch.__version__, "loads", t.library_path())')
  local paths=("$@")
  [ ${#paths[@]} -gt 0 ] || paths=(tests/python/test_torch_ops.py tests/python/test_quant.py)
  FLASHMLA_REQUIRE_TORCH_OPS=1 "$py" -m pytest -q -p no:cacheprovider -rs "${paths[@]}"
  stamp "tests passed under $label"
}

# Venv A also gets JAX and transformers, and runs the whole CPU suite: the tests that need torch
# together with JAX (tests/python/test_torch_ops_and_jax_parity.py) or transformers (the DeepSeek-V3 example),
# and the torch.distributed example (2 gloo ranks under torchrun), run nowhere else in CI (the main
# environment has JAX but no torch).
"$A" -m pip install -q "jax[cpu]>=0.4.31,<1" "jax-tvm-ffi>=0.1.3,<0.2" "transformers>=5,<6"
echo "== torch ABI: the same wheel under $TORCH_NEW (+ JAX, transformers): the whole tests/python"
run_tests "$A" "$TORCH_NEW" tests/python
if [ "${FLASHMLA_CI_KEEP_VENVS:-0}" = "0" ]; then
  rm -rf "$VENVS/torch-new"
  stamp "venv A deleted (FLASHMLA_CI_KEEP_VENVS=1 keeps it)"
fi
echo "== torch ABI: the same wheel under $TORCH_OLD ($(free_gb) GB free under $VENVS)"
if [ "$(free_gb)" -lt "$MIN_FREE_GB" ] && [ ! -x "$VENVS/torch-old/bin/python" ]; then
  echo "   !!! SKIPPED: the torch 2.11 venv needs ~${MIN_FREE_GB} GB and only $(free_gb) GB is free;"
  echo "   !!! the wheel was tested under $TORCH_NEW only in this run"
else
  make_venv "$VENVS/torch-old" "$TORCH_OLD"
  run_tests "$VENVS/torch-old/bin/python" "$TORCH_OLD"
fi

echo "== torch ABI: the same wheel without torch (TVM-FFI path only; a small venv)"
NT="$VENVS/no-torch"
[ -x "$NT/bin/python" ] || "$PY" -m venv "$NT"
"$NT/bin/python" -m pip install -q "${RUNTIME_DEPS[@]}"
"$NT/bin/python" -m pip install -q --force-reinstall --no-deps "$WHL"
(cd tests/python && "$NT/bin/python" -c \
  'import importlib.util as u, flash_mla, flash_mla._torch_ops as t; assert u.find_spec("torch") is None; assert not t.available(); print("   no torch:", t.load_error())')
"$NT/bin/python" -m pytest -q -p no:cacheprovider tests/python/test_dense_decode.py tests/python/test_torch_ops.py
stamp "done"
