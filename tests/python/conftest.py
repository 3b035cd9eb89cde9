"""Fixtures of the flash_mla Python tests (CPU: the C++ reference backend).

Shared helpers (comparator, data generators, non_contiguousify) live in
mla_test_utils.py and the float64 oracle in oracle.py; both are re-exported here.
"""

import os

# JAX must not grab 75% of GPU memory on import (it starves the torch tests that follow).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import oracle  # noqa: E402,F401
from mla_test_utils import *  # noqa: E402,F401,F403
from mla_test_utils import seed_of  # noqa: E402


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test id: fresh inputs per case, reproducible per id."""
    return np.random.default_rng(seed_of(request.node.nodeid))


@pytest.fixture
def reference_threads():
    """Setter of the CPU reference backend's thread count for one test (TVM-FFI module: NumPy and JAX
    calls); the default (FLASHMLA_NUM_THREADS as read once, else the hardware's) comes back after."""
    import flash_mla

    yield flash_mla._ffi.set_reference_num_threads
    flash_mla._ffi.set_reference_num_threads(0)
