#!/usr/bin/env bash
# Install flash_mla's build and runtime dependencies from PyPI (pinned ranges),
# then build and install the package (C++ core, CPU reference backend, sm_90a
# kernels when nvcc is present, TVM-FFI module) into the current Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# Flaky networks: more connection retries and resumed downloads (the torch venvs pull ~3 GB of
# CUDA wheels; a dropped connection once failed a whole CI run). Older pips ignore the last one.
export PIP_RETRIES=${PIP_RETRIES:-10} PIP_TIMEOUT=${PIP_TIMEOUT:-60} PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-20}

$PY -m pip install -q --upgrade "pip>=23"
$PY -m pip install -q \
  "scikit-build-core>=0.10,<2" "apache-tvm-ffi>=0.1.11,<0.2,!=0.1.12" "cmake>=3.28,<5" "ninja>=1.11,<2" \
  "numpy>=1.24,<3" "ml_dtypes>=0.4,<1" "rich>=13,<16" "tqdm>=4.60,<5"
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  # CUTLASS/CuTe C++ headers only: its Python dependencies are not needed.
  $PY -m pip install -q --no-deps "nvidia-cutlass>=4.2,<5"
fi
# --no-build-isolation: the build sees the packages installed above (CUTLASS headers).
$PY -m pip install -q --no-build-isolation --no-deps . ${FLASHMLA_PIP_ARGS:-}
$PY -c "import flash_mla; print('flash_mla', flash_mla.__version__, '| sm_90a kernels built:', flash_mla.has_cuda_backend(), '(used when a compute-capability 9.0 GPU is present)')"
# torch.ops.flash_mla (stable-ABI op library) is built when torch is importable here; else torch tensors use TVM-FFI.
$PY -c "import importlib.util as u, flash_mla._torch_ops as t; print('torch.ops.flash_mla:', 'available' if u.find_spec('torch') and t.available() else 'not built/loaded (%s)' % (t.load_error() or 'torch not installed'))"
