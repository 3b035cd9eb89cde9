"""FP8 KV-cache helpers: BF16 <-> the V32 and MODEL1 byte formats (spec §3.3-§3.5).

Bit-exact to FlashMLA's ``tests/quant.py``: per tile (V32: 4 x 128 dims, MODEL1:
7 x 64 dims) ``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` and
``fp8 = e4m3fn(x / scale)`` rounded to nearest even; RoPE dims are copied as bf16.
The conversion runs on the CPU (the C++ reference backend); tensors may be
PyTorch (any device: moved to the CPU and back) or NumPy (bfloat16 from ml_dtypes).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _ffi
from . import _torch_ops

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


def _alloc_packed(like: Any, num_blocks: int, pbs: int, fmt: int, block_stride: int):
    bpt = _BYTES[fmt]
    if _ffi.framework_of(like) == "torch":
        import torch

        buf = torch.zeros(num_blocks * block_stride, dtype=torch.uint8)
        return buf.as_strided((num_blocks, pbs, 1, bpt), (block_stride, bpt, bpt, 1))
    buf = np.zeros(num_blocks * block_stride, dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(buf, (num_blocks, pbs, 1, bpt), (block_stride, bpt, bpt, 1))


def _to_cpu(x: Any):
    fw = _ffi.framework_of(x)
    if fw == "torch":
        return x.detach().cpu(), x.device
    if fw == "numpy":
        return x, None
    raise TypeError(f"FP8 KV helpers take PyTorch or NumPy tensors, got {type(x).__name__}")


def quantize_k_cache(kv_cache: Any, d_qk: Optional[int] = None, block_stride: Optional[int] = None):
    """Quantize a bf16 cache ``(num_blocks, page_block_size, 1, d_qk)`` to FP8 bytes.

    ``d_qk`` (default: ``kv_cache.shape[-1]``) picks the format: 576 -> V32, 512 -> MODEL1.
    Returns uint8 ``(num_blocks, page_block_size, 1, 656 | 584)`` with ``stride(1)`` equal
    to the bytes per token and ``stride(0) = block_stride`` bytes (default
    :func:`default_block_stride`), on the device and in the framework of ``kv_cache``.

    Raises ``ValueError`` for a head dim other than 576 / 512, a shape other than
    ``(num_blocks, page_block_size > 0, 1, d_qk)`` or a ``block_stride`` below
    ``page_block_size`` times the bytes per token; ``TypeError`` for a dtype other than bf16 or a
    tensor of another framework than PyTorch / NumPy.
    """
    x, device = _to_cpu(kv_cache)
    fmt = format_for_head_dim(int(d_qk if d_qk is not None else x.shape[-1]))
    if len(x.shape) != 4:
        raise ValueError(f"kv_cache: expected a 4-D tensor (num_blocks, page_block_size, 1, d_qk), got shape "
                         f"{tuple(int(s) for s in x.shape)}")
    nb, pbs = int(x.shape[0]), int(x.shape[1])  # (page_block_size > 0 is checked by the core, naming kv_cache)
    stride = block_stride if block_stride is not None else default_block_stride(fmt, pbs)
    if stride < pbs * _BYTES[fmt]:
        raise ValueError(f"block_stride: must be >= page_block_size * {_BYTES[fmt]} = {pbs * _BYTES[fmt]}, got {stride}")
    packed = _alloc_packed(x, nb, pbs, fmt, stride)
    if _torch_ops.handles(x, packed):  # torch tensors: torch.ops.flash_mla
        _torch_ops.quantize_kv_cache(x, packed, fmt)
    else:
        _ffi.lib.quantize_kv_cache(_ffi.to_ffi(x, "kv_cache"), _ffi.to_ffi(packed, "packed"), fmt)
    return packed.to(device) if device is not None and str(device) != "cpu" else packed


def dequantize_k_cache(packed: Any, d_qk: int = 576):
    """Inverse of :func:`quantize_k_cache`: FP8 bytes -> bf16 ``(num_blocks, pbs, 1, d_qk)``.

    ``packed`` may be uint8 / int8 / float8_e4m3fn. ``d_qk`` 576 reads V32, 512 MODEL1.
    Raises ``ValueError`` for another head dim or a ``packed`` shape / stride that is not the
    format's ``(num_blocks, page_block_size, 1, 656 | 584)`` layout, ``TypeError`` for another dtype.
    """
    fmt = format_for_head_dim(int(d_qk))
    p, device = _to_cpu(packed)
    nb, pbs = int(p.shape[0]), int(p.shape[1])
    if _ffi.framework_of(p) == "torch":
        import torch

        out = torch.empty((nb, pbs, 1, _DIM[fmt]), dtype=torch.bfloat16)
    else:
        out = np.empty((nb, pbs, 1, _DIM[fmt]), dtype=_ffi._NP_BF16)
    if _torch_ops.handles(p, out):  # torch tensors: torch.ops.flash_mla
        _torch_ops.dequantize_kv_cache(p, out, fmt)
    else:
        _ffi.lib.dequantize_kv_cache(_ffi.to_ffi(p, "packed"), _ffi.to_ffi(out, "kv_cache"), fmt)
    return out.to(device) if device is not None and str(device) != "cpu" else out
