"""CuPy arrays on the GPU: outputs from CuPy's own memory pool, destination-passing calls.

The plain TVM-FFI functions allocate their outputs themselves; with no framework allocator
registered (CuPy registers none) that is a cudaMalloc per output and a cudaFree when it is
released, and cudaFree synchronises the device: 140-200 µs per call on the H200
(bench/results/2026-11-30-call-overhead.json). Here the outputs, and the one scratch
buffer that holds the split schedule and the split-KV workspace, come from CuPy's memory
pool on the data's device, and the ``*_fwd_dps`` functions of the C++ module write into
them on CuPy's current stream. The split schedule is recomputed by every call (as on the
XLA path), so FlashMLASchedMeta keeps no tensors for CuPy calls. Dense decode only: CuPy
has no bfloat16, which sparse decode and prefill need (their CuPy calls keep the plain path).
"""

from __future__ import annotations

from typing import Any

from . import _ffi

_SCRATCH: dict = {}  # (sparse, device, b, s_q, h_q, h_kv) -> bytes


def handles(q: Any) -> bool:
    """True for a CuPy array (the GPU is the only place CuPy arrays live)."""
    return _ffi.framework_of(q) == "cupy"


def _scratch(cp: Any, sparse: bool, dev: int, b: int, s_q: int, h_q: int, h_kv: int) -> Any:
    key = (sparse, dev, b, s_q, h_q, h_kv)
    n = _SCRATCH.get(key)
    if n is None:
        try:
            n = int(_ffi.lib.decode_scratch_bytes(sparse, 2, dev, b, s_q, h_q, h_kv))
        except Exception:  # shapes the plan rejects (b = 0, h_q % h_kv != 0, ...): the call's own
            # validation runs before scratch is read and raises naming the argument (not cached)
            return cp.empty((1,), dtype=cp.uint8)
        _SCRATCH[key] = n
    return cp.empty((max(n, 1),), dtype=cp.uint8)


def dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v: int, softmax_scale: float, causal: bool):
    """Dense decode of CuPy arrays (spec §2.2; arguments as flash_mla_with_kvcache's, q float16 or
    bfloat16 bits). Returns CuPy ``out`` ``(b, s_q, h_q, head_dim_v)`` in q's dtype and ``lse``
    ``(b, h_q, s_q)`` float32 (natural log), on q's device. Bad input raises the core's
    ValueError / TypeError naming the argument (validated by dense_decode_fwd_dps)."""
    import cupy as cp

    dev = int(q.device.id)
    q_shape = q.shape
    b, s_q, h_q = int(q_shape[0]), int(q_shape[1]), int(q_shape[2])
    with cp.cuda.Device(dev):  # one switch to q's device: outputs from its pool, its current stream
        out = cp.empty((b, s_q, h_q, head_dim_v), dtype=q.dtype)
        # FlashMLA's lse layout (bindings/common/op_params.h decode_lse_transposed): with h_kv == 1 the transpose
        # of a (b, s_q, h_q) buffer, strides (s_q * h_q, 1, h_q); contiguous with h_kv > 1.
        if int(k_cache.shape[2]) == 1:
            lse = cp.empty((b, s_q, h_q), dtype=cp.float32).transpose(0, 2, 1)
        else:
            lse = cp.empty((b, h_q, s_q), dtype=cp.float32)
        scratch = _scratch(cp, False, dev, b, s_q, h_q, int(k_cache.shape[2]))
        stream = int(cp.cuda.get_current_stream().ptr)
    with _ffi.raw_stream_scope(dev, stream):
        if type(k_cache) is type(q) and type(block_table) is type(q) and type(cache_seqlens) is type(q):
            # CuPy arrays go into the call as they are: TVM-FFI takes each through its DLPack export inside
            # the call, as _ffi.to_ffi would in Python (one Python call and one tvm_ffi.Tensor per array).
            # An export that fails (BufferError; the C++ side never raises it) is redone below, where the
            # error names the argument.
            try:
                _ffi.call_tagged(_ffi.lib.dense_decode_fwd_dps, q, k_cache, block_table, cache_seqlens, head_dim_v,
                                 softmax_scale, causal, out, lse, scratch)
                return out, lse
            except BufferError:
                pass
        _ffi.call_tagged(
            _ffi.lib.dense_decode_fwd_dps,
            _ffi.to_ffi(q, "q"), _ffi.to_ffi(k_cache, "k_cache"), _ffi.to_ffi(block_table, "block_table"),
            _ffi.to_ffi(cache_seqlens, "cache_seqlens"), head_dim_v, softmax_scale, causal,
            _ffi.to_ffi(out), _ffi.to_ffi(lse), _ffi.to_ffi(scratch))
    return out, lse
