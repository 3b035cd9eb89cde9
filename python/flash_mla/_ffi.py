"""Loading of the TVM-FFI module and conversion between frameworks.

Arguments may be tensors of any DLPack producer (PyTorch, JAX, CuPy,
PaddlePaddle, NumPy). Results are created by the C++ module and handed back in
the framework of the first tensor argument, zero-copy through DLPack.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import numpy as np
import tvm_ffi

try:  # NumPy has no native bfloat16 / float8; ml_dtypes provides them.
    import ml_dtypes

    _NP_BF16 = np.dtype(ml_dtypes.bfloat16)
    _NP_FP8 = {np.dtype(ml_dtypes.float8_e4m3fn)}
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    ml_dtypes = None
    _NP_BF16 = None
    _NP_FP8 = set()

# DLPack type codes (dlpack.h)
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT = 0, 1, 2, 4

# TVM-FFI knows the common Python exception kinds; add the one we use beyond them.
try:
    tvm_ffi.register_error("NotImplementedError", NotImplementedError)
except Exception:  # already registered by another TVM-FFI user in this process
    pass

_LIB_NAME = "libflashmla_tvm_ffi.so"


def _load():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("FLASHMLA_TVM_FFI_LIB", os.path.join(here, _LIB_NAME))
    if not os.path.exists(path):
        raise ImportError(
            f"flash_mla: native module {path} not found; install the package with `pip install .`"
        )
    return tvm_ffi.load_module(path)


lib = _load()


def framework_of(x: Any) -> str:
    """Name of the framework a tensor belongs to: torch, numpy, jax, cupy, paddle or dlpack.

    Subclasses of ``numpy.ndarray`` defined elsewhere (a user's own array type) count as NumPy, so
    results come back as NumPy arrays.
    """
    mod = type(x).__module__
    if mod == "torch":  # torch.Tensor (the common case first)
        return mod
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = mod.split(".")[0]
    if mod in ("torch", "numpy", "cupy", "paddle"):
        return mod
    if mod in ("jax", "jaxlib"):
        return "jax"
    return "dlpack"


def _np_from_dlpack(x: np.ndarray) -> Any:
    """tvm_ffi.from_dlpack for a NumPy array, read-only arrays included.

    NumPy refuses to export a read-only array (np.asarray of a JAX array, a memory map,
    a broadcast view) through the legacy DLPack capsule that TVM-FFI asks for; the
    versioned capsule (NumPy >= 2.1) carries the read-only flag and works, zero-copy.
    Older NumPy gets a copy.
    """
    if x.flags.writeable:
        return tvm_ffi.from_dlpack(x)
    try:
        capsule = x.__dlpack__(max_version=(1, 0))
    except TypeError:  # NumPy < 2.1: no versioned export
        return tvm_ffi.from_dlpack(np.array(x, copy=True))
    return tvm_ffi.from_dlpack(capsule)


def to_ffi(x: Any, name: str = "tensor") -> Any:
    """Prepare one tensor argument for the C++ module (None passes through).

    Raises TypeError naming the argument if `x` is not a DLPack tensor."""
    if x is None:
        return None
    if not (hasattr(x, "__dlpack__") or hasattr(x, "__dlpack_c_exchange_api__")):
        raise TypeError(f"{name}: expected a tensor (any DLPack framework), got {type(x).__name__}")
    try:
        return _to_ffi(x)
    except (BufferError, TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name}: cannot pass this {type(x).__name__} through DLPack: {e}") from e


def _to_ffi(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        if not x.flags.aligned:
            # Data off its element size (np.frombuffer at an odd offset, a field of a packed record): the core
            # refuses such pointers (typed access to them is undefined behaviour), so pass an aligned copy. NumPy
            # arguments are only ever read: the results are the module's own arrays.
            x = np.array(x, copy=True)
        if _NP_BF16 is not None and x.dtype == _NP_BF16:
            t = _np_from_dlpack(x.view(np.uint16))
            return lib.reinterpret_dtype(t, _DL_BFLOAT, 16)
        if x.dtype in _NP_FP8:
            return _np_from_dlpack(x.view(np.uint8))
        return _np_from_dlpack(x)
    if framework_of(x) == "torch":
        return x  # TVM-FFI's fast path for torch (DLPack exchange API, current stream)
    return tvm_ffi.from_dlpack(x)


def from_ffi(t: Any, like: Any) -> Any:
    """Convert a result of the C++ module into the framework of `like`, zero-copy."""
    fw = framework_of(like)
    if fw != "torch" and framework_of(t) == "torch":
        # TVM-FFI hands results back as torch tensors when any argument was one.
        t = tvm_ffi.from_dlpack(t)
    if fw == "torch":
        import torch

        return t if isinstance(t, torch.Tensor) else torch.from_dlpack(t)
    if fw == "numpy":
        dt = t.dtype
        if str(dt) == "bfloat16":
            u16 = np.from_dlpack(lib.reinterpret_dtype(t, _DL_UINT, 16))
            return u16.view(_NP_BF16)
        return np.from_dlpack(t)
    if fw == "jax":
        import jax

        return jax.dlpack.from_dlpack(t)
    if fw == "cupy":
        import cupy

        return cupy.from_dlpack(t)
    if fw == "paddle":
        import paddle

        return paddle.from_dlpack(t)
    return t


def stream_scope(x: Any):
    """Context in which the C++ module launches on the current stream of `x`'s framework.

    torch tensors need nothing (TVM-FFI reads torch's current stream itself) and JAX
    goes through XLA (python/flash_mla/_jax.py). For a CuPy array on the GPU this sets
    TVM-FFI's stream for that device to CuPy's current stream there. Other frameworks
    run on the device's default stream."""
    if framework_of(x) != "cupy":
        return contextlib.nullcontext()
    import cupy

    dev_id = int(x.device.id)
    with cupy.cuda.Device(dev_id):
        ptr = int(cupy.cuda.get_current_stream().ptr)
    return raw_stream_scope(dev_id, ptr)


_CUDA_DEVICES: dict = {}  # device id -> tvm_ffi.Device("cuda", id), made once


def raw_stream_scope(dev_id: int, stream: int):
    """Context in which the C++ module launches on CUDA device `dev_id` on the raw stream `stream`."""
    dev = _CUDA_DEVICES.get(dev_id)
    if dev is None:
        dev = _CUDA_DEVICES[dev_id] = tvm_ffi.device("cuda", dev_id)
    return tvm_ffi.use_raw_stream(dev, stream)


_TAG = re.compile(r"\[flash_mla:(\w+)\] ")
_TAGGED_CLASSES = {"ValueError": ValueError, "TypeError": TypeError, "NotImplementedError": NotImplementedError}


def call_tagged(fn: Any, *args: Any) -> Any:
    """Call one of the module's destination-passing functions (``*_fwd_dps``). They report the core's
    errors as a RuntimeError whose message starts with ``[flash_mla:<Class>] `` (the form that reaches
    Python through XLA, python/flash_mla/_jax.py); here that becomes the error of that class with the
    plain message, as the other functions of the module raise it."""
    try:
        return fn(*args)
    except RuntimeError as e:
        msg = str(e)
        m = _TAG.search(msg)
        if m is None or m.group(1) not in _TAGGED_CLASSES:
            raise
        raise _TAGGED_CLASSES[m.group(1)](msg[m.end():].rstrip()) from None


def _device_name(x: Any) -> str:
    """The device of a tensor as the core's messages name it: "cpu", "cuda:0"; other torch devices by torch's name
    ("meta")."""
    if framework_of(x) == "torch":
        return str(x.device)
    try:
        kind, idx = x.__dlpack_device__()
    except Exception:  # (no DLPack device: the framework's own name, if any)
        return str(getattr(x, "device", "an unknown device"))
    return {1: "cpu", 2: f"cuda:{idx}", 3: "cpu"}.get(int(kind), f"DLPack device type {int(kind)}:{idx}")


def raise_device_error(q_name: str, q: Any, **tensors: Any) -> None:
    """Called where a call of the module failed: raises the error naming the argument when it failed because a torch
    tensor is on a device that DLPack cannot carry (torch's ``meta`` device: TVM-FFI raises its own "Cannot pack
    tensors on meta" RuntimeError, with a C++ trace and no argument named); returns otherwise (the caller re-raises
    the original error). The errors are those of the torch.ops route: a tensor on another device than ``q_name``,
    the first in the order given (the op library's fake kernels' order), is the core's ValueError ("k is on meta
    but q is on cpu: all tensors must be on the same device"); tensors all on such a device (a shape-only call,
    which the op library answers with its fake kernels) are a NotImplementedError naming ``q_name``: this route
    has no kernels for them. ``tensors``: the other tensor arguments by name (None for absent ones)."""
    named = ((q_name, q), *tensors.items())
    if not any(t is not None and framework_of(t) == "torch" and t.device.type not in ("cpu", "cuda")
               for _, t in named):
        return
    q_dev = _device_name(q)
    for name, t in tensors.items():
        if t is not None and _device_name(t) != q_dev:
            raise ValueError(f"{name} is on {_device_name(t)} but {q_name} is on {q_dev}: all tensors must be on "
                             "the same device") from None
    from . import _torch_ops

    why = _torch_ops.load_error() or "torch.ops.flash_mla not used for this call"
    raise NotImplementedError(
        f"{q_name}: tensors on torch's {q_dev} device are not supported on the TVM-FFI route, which takes CPU and "
        f"CUDA memory only (torch.ops.flash_mla, which answers them with its fake kernels, is unavailable: {why})"
    ) from None


def has_cuda_backend() -> bool:
    """True if this build contains the Hopper (sm_90a) CUDA kernels."""
    return bool(lib.has_cuda_backend())


def reference_num_threads() -> int:
    """Worker threads of the CPU reference backend: FLASHMLA_NUM_THREADS as read at the first CPU call
    (once per process; a value that is not a positive integer is reported on stderr and ignored),
    else the hardware's thread count."""
    return int(lib.reference_num_threads())


def set_reference_num_threads(n: int) -> None:
    """Thread count of this module's CPU calls (n <= 0: back to the default). Used by the tests; the
    torch op library holds its own copy of the setting."""
    lib.set_reference_num_threads(int(n))
