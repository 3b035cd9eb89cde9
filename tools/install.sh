#!/usr/bin/env bash
# Install flash_mla's build and runtime dependencies from PyPI (pinned ranges),
# then build and install the package (C++ core, CPU reference backend, sm_90a
# kernels when nvcc is present, TVM-FFI module) into the current Python -- a venv
# is advised (README). FLASHMLA_PIP_ARGS adds pip arguments, e.g.
# "-C cmake.define.FLASHMLA_ENABLE_CUDA=OFF" to skip the sm_90a kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# Flaky networks: more connection retries and resumed downloads (the torch venvs pull ~3 GB of
# CUDA wheels; a dropped connection once failed a whole CI run). Older pips ignore the last one.
export PIP_RETRIES=${PIP_RETRIES:-10} PIP_TIMEOUT=${PIP_TIMEOUT:-60} PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-20}

echo "== Python build and runtime dependencies (PyPI)"
$PY -m pip install -q --upgrade "pip>=23"
$PY -m pip install -q \
  "scikit-build-core>=0.10,<2" "apache-tvm-ffi>=0.1.11,<0.2,!=0.1.12" "cmake>=3.28,<5" "ninja>=1.11,<2" \
  "numpy>=1.24,<3" "ml_dtypes>=0.4,<1" "rich>=13,<16" "tqdm>=4.60,<5"

# The sm_90a kernels are compiled when nvcc is present, unless FLASHMLA_PIP_ARGS switches CUDA off.
cuda=0
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then cuda=1; fi
case " ${FLASHMLA_PIP_ARGS:-} " in *FLASHMLA_ENABLE_CUDA=OFF*|*FLASHMLA_ENABLE_CUDA=0*) cuda=0 ;; esac
if [ "$cuda" = 1 ]; then
  # CUTLASS/CuTe headers into .deps/cutlass_include (found by CMakeLists.txt): the wheel only, installed
  # into no Python (its Python dependencies are not needed, and pip would report them missing).
  echo "== CUTLASS/CuTe headers (tools/fetch-cutlass.sh)"
  bash tools/fetch-cutlass.sh
fi

# --no-build-isolation: the build sees the packages installed above (and torch, when installed: the
# torch op library is built then). The build's step lines are shown as it goes; the whole log is kept.
mkdir -p build
if [ "$cuda" = 1 ]; then what="C++ core, TVM-FFI module and the sm_90a kernels (the kernels take minutes)"
else what="C++ core and TVM-FFI module"; fi
echo "== building flash_mla: $what; full log: build/install.log"
start=$SECONDS
set +o pipefail
$PY -m pip install -v --no-build-isolation --no-deps . ${FLASHMLA_PIP_ARGS:-} 2>&1 | tee build/install.log |
  { grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\] ' | sed -u -E 's/^ */   /' || true; }
rc=${PIPESTATUS[0]}
set -o pipefail
if [ "$rc" -ne 0 ]; then
  echo "pip install failed (exit $rc); the end of build/install.log:" >&2
  tail -60 build/install.log >&2
  exit "$rc"
fi
echo "   built and installed in $((SECONDS - start)) s"
$PY -c "import flash_mla; print('flash_mla', flash_mla.__version__, '| sm_90a kernels built:', flash_mla.has_cuda_backend(), '(used when a compute-capability 9.0 GPU is present)')"
# torch.ops.flash_mla (stable-ABI op library) is built when torch is importable here; else torch tensors use TVM-FFI.
$PY -c "import importlib.util as u, flash_mla._torch_ops as t; print('torch.ops.flash_mla:', 'available' if u.find_spec('torch') and t.available() else 'not built/loaded (%s)' % (t.load_error() or 'torch not installed'))"
