"""GPU tests: run only with PyTorch, a CUDA build of flash_mla and a compute-capability-9.0 GPU.

Everything here is skipped (not failed) elsewhere, e.g. in CI. Exception: with
FLASHMLA_GRID_DEVICE=cpu the full-grid files (*_grid_gpu.py) dry-run on the CPU (see grid_data.py).
"""

import os

# JAX must not grab 75% of GPU memory on import (it starves the torch tests that follow).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import sys

import pytest

# Shared helpers of the GPU tests (torch_reference.py, grid_*.py) import by module name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _gpu_reason():
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"GPU is compute capability {torch.cuda.get_device_capability()}, the kernels are sm_90a"
    import flash_mla

    if not flash_mla.has_cuda_backend():
        return "flash_mla was built without nvcc (no CUDA backend)"
    return None


_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if _REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {_REASON}")
    grid_cpu = os.environ.get("FLASHMLA_GRID_DEVICE") == "cpu"
    for item in items:
        if grid_cpu and str(item.fspath).endswith("_grid_gpu.py"):
            continue
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_current_cuda_device():
    """Each GPU test starts on device 0 and leaves it so.

    Another framework's call on the second GPU (JAX's runtime, a CuPy device context) may
    leave the thread's current CUDA device at 1; torch then puts "cuda" tensors there while
    torch.cuda.graph's shared capture stream lives on device 0, and the capture fails. Whether
    flash_mla itself preserves the caller's device is tested on its own in
    test_current_device_gpu.py, which checks the device right after each call.
    """
    if _REASON is not None:
        yield
        return
    import torch

    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)


@pytest.fixture(scope="module")
def jax_gpu():
    """(jax, its GPU devices); skips without JAX's GPU backend or jax-tvm-ffi."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax_tvm_ffi")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        pytest.skip("this JAX has no GPU backend")
    return jax, gpus
