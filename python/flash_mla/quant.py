"""FP8 KV-cache helpers: BF16 <-> the V32 and MODEL1 byte formats (spec §3.3-§3.5).

Bit-exact to FlashMLA's ``tests/quant.py``: per tile (V32: 4 x 128 dims, MODEL1:
7 x 64 dims) ``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` and
``fp8 = e4m3fn(x / scale)`` rounded to nearest even; RoPE dims are copied as bf16.
The conversion runs on the CPU (the C++ reference backend); tensors may be of
any framework the rest of the API takes (PyTorch, NumPy with ml_dtypes bfloat16,
JAX, PaddlePaddle, other DLPack producers), on any device: they are
copied to the host when needed, and results come back in the caller's framework
on the caller's device.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _ffi
from . import _torch_ops
from .flash_mla_interface import _int_arg

FORMAT_V32 = 2  # flashmla::KVFormat::kFP8V32  (d_qk = 576, 656 bytes/token)
FORMAT_MODEL1 = 3  # flashmla::KVFormat::kFP8Model1 (d_qk = 512, 584 bytes/token)

_BYTES = {FORMAT_V32: 656, FORMAT_MODEL1: 584}
_DIM = {FORMAT_V32: 576, FORMAT_MODEL1: 512}


def format_for_head_dim(d_qk: int) -> int:
    """576 -> FORMAT_V32, 512 -> FORMAT_MODEL1; ValueError otherwise."""
    for fmt, d in _DIM.items():
        if d == d_qk:
            return fmt
    raise ValueError(f"d_qk: FP8 KV caches exist for head dims 576 (V32) and 512 (MODEL1), got {d_qk}")


def default_block_stride(fmt: int, page_block_size: int) -> int:
    """Bytes between page blocks as FlashMLA's tests lay them out: V32 ``(pbs + 1) * 656``
    (one padding token), MODEL1 ``pbs * 584`` rounded up to a multiple of 576."""
    if fmt == FORMAT_V32:
        return (page_block_size + 1) * 656
    return -(-page_block_size * 584 // 576) * 576


class _Caller:
    """One tensor argument of a helper: ``host``, what the CPU conversion reads (a CPU tensor of the
    caller's framework when it can travel by DLPack, else a NumPy copy), and ``result``, which hands a
    result computed into NumPy / torch CPU memory back in the caller's framework, on its device."""

    def __init__(self, x: Any, name: str):
        self.fw = _ffi.framework_of(x)
        self.x = x
        if self.fw == "torch":
            self.host = x.detach().cpu()
        elif self.fw == "jax":  # any device: JAX copies to the host (bfloat16 as ml_dtypes)
            self.host = np.asarray(x)
        elif self.fw == "cupy":  # (CuPy has no bfloat16: only bytes reach here, and the core names the dtype)
            self.host = x.get()
        elif self.fw == "paddle":
            self.host = x if x.place.is_cpu_place() else x.cpu()
        elif self.fw == "numpy" or hasattr(x, "__dlpack__"):
            self.host = x  # NumPy, or another DLPack producer (read in place: CPU memory only)
        else:
            raise TypeError(f"{name}: expected a tensor of a DLPack framework (PyTorch, NumPy, JAX, CuPy, "
                            f"PaddlePaddle, ...), got {type(x).__name__}")

    def empty(self, shape, dtype: str, block_stride: Optional[int] = None):
        """A zeroed result of `shape` (bytes "u8" or "bf16") computed on the CPU; uint8 results with
        their page blocks `block_stride` elements apart (None: contiguous)."""
        n = shape[0] * block_stride if block_stride is not None else int(np.prod(shape))
        if self.fw == "torch":
            import torch

            buf = torch.zeros(n, dtype=torch.uint8 if dtype == "u8" else torch.bfloat16)
        else:
            buf = np.zeros(n, dtype=np.uint8 if dtype == "u8" else _ffi._NP_BF16)
        if block_stride is None:
            return buf.reshape(shape)
        strides = (block_stride, shape[3], shape[3], 1)
        if self.fw == "torch":
            return buf.as_strided(shape, strides)
        return np.lib.stride_tricks.as_strided(buf, shape, tuple(st * buf.itemsize for st in strides))

    def result(self, r: Any) -> Any:
        fw, x = self.fw, self.x
        if fw == "torch":
            return r.to(x.device) if str(x.device) != "cpu" else r
        if fw == "numpy":
            return r
        if fw == "jax":  # (JAX arrays have no strides: uint8 results are allocated contiguous for JAX)
            import jax

            devs = list(x.devices()) if hasattr(x, "devices") else []
            return jax.device_put(r, devs[0]) if len(devs) == 1 else jax.numpy.asarray(r)
        out = _ffi.from_ffi(_ffi.to_ffi(r, "result"), x)  # PaddlePaddle (strides kept), other DLPack: CPU
        if fw == "paddle" and not x.place.is_cpu_place():
            out = out.cuda(x.place.gpu_device_id())
        return out


def quantize_k_cache(kv_cache: Any, d_qk: Optional[int] = None, block_stride: Optional[int] = None):
    """Quantize a bf16 cache ``(num_blocks, page_block_size, 1, d_qk)`` to FP8 bytes.

    ``kv_cache`` may be a tensor of any framework the rest of the API takes (PyTorch, NumPy with
    ml_dtypes bfloat16, JAX, PaddlePaddle, another DLPack producer), on any device; the conversion
    runs on the CPU and the result comes back in the framework and on the device of ``kv_cache``.

    ``d_qk`` (default: ``kv_cache.shape[-1]``) picks the format: 576 -> V32, 512 -> MODEL1.
    Returns uint8 ``(num_blocks, page_block_size, 1, 656 | 584)`` with ``stride(1)`` equal
    to the bytes per token and ``stride(0) = block_stride`` bytes (default
    :func:`default_block_stride`). JAX arrays have no strides: for JAX the result is contiguous
    (``block_stride`` must then be None or ``page_block_size`` times the bytes per token), which the
    decode accepts as well.

    Raises ``ValueError`` for a head dim other than 576 / 512, a shape other than
    ``(num_blocks, page_block_size > 0, 1, d_qk)`` or a ``block_stride`` below
    ``page_block_size`` times the bytes per token (or, for JAX, another than that); ``TypeError``
    for a dtype other than bf16, an argument that is not a tensor, or a ``d_qk`` / ``block_stride`` that
    is not an integer (``576.9`` and ``"576"`` are not truncated or parsed).
    """
    c = _Caller(kv_cache, "kv_cache")
    x = c.host
    if len(x.shape) != 4:  # (before the head dim is read from the last dim: a 0-d tensor has none)
        raise ValueError(f"kv_cache: expected a 4-D tensor (num_blocks, page_block_size, 1, d_qk), got shape "
                         f"{tuple(int(s) for s in x.shape)}")
    fmt = format_for_head_dim(int(x.shape[-1]) if d_qk is None else _int_arg("d_qk", d_qk))
    if block_stride is not None:
        block_stride = _int_arg("block_stride", block_stride)
    nb, pbs = int(x.shape[0]), int(x.shape[1])  # (page_block_size > 0 is checked by the core, naming kv_cache)
    compact = pbs * _BYTES[fmt]
    if c.fw == "jax":
        if block_stride is not None and block_stride != compact:
            raise ValueError(f"block_stride: JAX arrays have no strides, so the result is contiguous: must be None or "
                             f"page_block_size * {_BYTES[fmt]} = {compact}, got {block_stride}")
        stride = compact
    else:
        stride = block_stride if block_stride is not None else default_block_stride(fmt, pbs)
    if stride < compact:
        raise ValueError(f"block_stride: must be >= page_block_size * {_BYTES[fmt]} = {compact}, got {stride}")
    packed = c.empty((nb, pbs, 1, _BYTES[fmt]), "u8", stride)
    if _torch_ops.handles(x, packed):  # torch tensors: torch.ops.flash_mla
        _torch_ops.quantize_kv_cache(x, packed, fmt)
    else:
        _ffi.lib.quantize_kv_cache(_ffi.to_ffi(x, "kv_cache"), _ffi.to_ffi(packed, "packed"), fmt)
    return c.result(packed)


def dequantize_k_cache(packed: Any, d_qk: int = 576):
    """Inverse of :func:`quantize_k_cache`: FP8 bytes -> bf16 ``(num_blocks, pbs, 1, d_qk)``.

    ``packed`` may be uint8 / int8 / float8_e4m3fn, a tensor of any framework the rest of the API takes
    (as :func:`quantize_k_cache`); the result is a contiguous bf16 tensor of that framework, on its
    device. ``d_qk`` 576 reads V32, 512 MODEL1.
    Raises ``ValueError`` for another head dim or a ``packed`` shape / stride that is not the
    format's ``(num_blocks, page_block_size, 1, 656 | 584)`` layout, ``TypeError`` for another dtype,
    an argument that is not a tensor, a ``d_qk`` that is not an integer, or a CuPy array (CuPy has no
    bfloat16 for the result).
    """
    fmt = format_for_head_dim(_int_arg("d_qk", d_qk))
    if _ffi.framework_of(packed) == "cupy":
        raise TypeError("packed: the result is bfloat16, which CuPy does not have; pass the bytes as another "
                        "framework's tensor (e.g. torch.from_dlpack(packed)) or as NumPy (packed.get())")
    c = _Caller(packed, "packed")
    p = c.host
    if len(p.shape) != 4:
        raise ValueError(f"packed: expected a 4-D tensor (num_blocks, page_block_size, 1, bytes per token), got "
                         f"shape {tuple(int(s) for s in p.shape)}")
    out = c.empty((int(p.shape[0]), int(p.shape[1]), 1, _DIM[fmt]), "bf16")
    if _torch_ops.handles(p, out):  # torch tensors: torch.ops.flash_mla
        _torch_ops.dequantize_kv_cache(p, out, fmt)
    else:
        _ffi.lib.dequantize_kv_cache(_ffi.to_ffi(p, "packed"), _ffi.to_ffi(out, "kv_cache"), fmt)
    return c.result(out)
