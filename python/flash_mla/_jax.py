"""JAX path: flash_mla's operators as XLA custom calls, usable inside ``jax.jit``.

JAX arrays (concrete or traced) go through ``jax.ffi.ffi_call`` to the
destination-passing functions of the TVM-FFI module (``*_fwd_dps`` in
bindings/tvm_ffi/module.cpp), registered as XLA FFI targets with the
``jax-tvm-ffi`` package. XLA allocates every result (sized here from shapes via
``decode_scratch_bytes``) and gives the call its own stream, so the kernels run on
JAX's stream and the call can sit inside ``jax.jit`` (and XLA's CUDA graphs).
The split schedule is recomputed by every call (on the GPU by a small kernel on
that stream), so nothing depends on values at trace time.

Needs ``pip install jax-tvm-ffi`` (an ImportError saying so is raised otherwise).
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Tuple

import numpy as np

from . import _ffi

# Bits of the `present` attribute (module.cpp).
_SD_TOPK_LENGTH, _SD_SINK, _SD_EXTRA, _SD_EXTRA_TOPK_LENGTH = 1, 2, 4, 8
_SP_SINK, _SP_TOPK_LENGTH = 1, 2


@functools.lru_cache(maxsize=None)
def _register() -> Tuple[str, ...]:
    """Register the XLA FFI targets once per process; returns the platforms registered."""
    try:
        import jax_tvm_ffi
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise ImportError(
            "flash_mla: JAX arrays are run as XLA custom calls, which needs the jax-tvm-ffi package "
            "(pip install jax-tvm-ffi)"
        ) from e
    import jax

    specs = {
        "dense_decode_fwd_dps": ["args", "attrs.head_dim_v", "attrs.softmax_scale", "attrs.causal", "rets"],
        "sparse_decode_fwd_dps": ["args", "attrs.head_dim_v", "attrs.softmax_scale", "attrs.present", "rets"],
        "sparse_prefill_fwd_dps": ["args", "attrs.sm_scale", "attrs.d_v", "attrs.present", "rets"],
    }
    platforms = ["cpu"]
    if _ffi.has_cuda_backend():
        try:
            if jax.devices("gpu"):
                platforms.append("gpu")
        except RuntimeError:  # this JAX has no GPU backend
            pass
    for platform in platforms:
        for name, spec in specs.items():
            jax_tvm_ffi.register_ffi_target(
                f"flash_mla.{name}", getattr(_ffi.lib, name), spec, platform=platform,
                allow_cuda_graph=(platform == "gpu"),
            )
    return tuple(platforms)


@functools.lru_cache(maxsize=None)
def _have_jax_tvm_ffi() -> bool:
    try:
        import jax_tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


def use_xla(q: Any) -> bool:
    """Whether a call with this `q` goes through XLA: every JAX array when jax-tvm-ffi is
    installed; otherwise concrete JAX arrays take the DLPack path and traced ones raise
    ImportError (from _register) saying what to install."""
    if q is None or _ffi.framework_of(q) != "jax":
        return False
    import jax

    return _have_jax_tvm_ffi() or isinstance(q, jax.core.Tracer)


@functools.lru_cache(maxsize=None)
def _candidate_devices() -> Tuple[Tuple[int, int], ...]:
    """(DLPack device type, id) of every device a traced call may be placed on: the CPU and,
    with the CUDA backend, each GPU JAX sees."""
    import jax

    devs = [(1, 0)]
    if _ffi.has_cuda_backend():
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        for d in gpus:
            hw = getattr(d, "local_hardware_id", None)
            devs.append((2, int(hw if hw is not None else d.id)))
    return tuple(devs)


def _scratch_bytes(sparse: bool, b: int, s_q: int, h_q: int, h_kv: int) -> int:
    """Scratch for the decode custom call (metadata + split-KV workspace), sized for every
    candidate device: under jax.jit the placement is decided after the shapes are fixed."""
    sizes = []
    for dev_type, dev_id in _candidate_devices():
        try:
            sizes.append(int(_ffi.lib.decode_scratch_bytes(sparse, dev_type, dev_id, b, s_q, h_q, h_kv)))
        except NotImplementedError:  # a GPU without the sm90 kernels: calls placed there raise anyway
            pass
    return max(sizes)


def _placeholder(dtype: Any) -> Any:
    import jax.numpy as jnp

    return jnp.zeros((1,), dtype)


def _decode_results(q: Any, out_dtype: Any, sparse: bool, h_kv: int) -> List[Any]:
    import jax
    import jax.numpy as jnp

    b, s_q, h_q = (int(s) for s in q.shape[:3])
    return [
        jax.ShapeDtypeStruct((b, s_q, h_q, 512), out_dtype),
        jax.ShapeDtypeStruct((b, h_q, s_q), jnp.float32),
        jax.ShapeDtypeStruct((_scratch_bytes(sparse, b, s_q, h_q, h_kv),), jnp.uint8),
    ]


def dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v: int, softmax_scale: float, causal: bool):
    """Dense decode as an XLA custom call. Returns (out, lse, None, None): the scheduler metadata
    lives in the call's scratch buffer and is recomputed by every call."""
    import jax
    import jax.numpy as jnp

    _register()
    q = jnp.asarray(q)
    if int(head_dim_v) != 512:
        raise ValueError(f"head_dim_v: must be 512, got {head_dim_v}")
    if len(k_cache.shape) != 4 or int(k_cache.shape[2]) < 1:
        raise ValueError(f"k_cache: expected (num_blocks, page_block_size, h_kv, d_qk), got shape {tuple(k_cache.shape)}")
    h_kv = int(k_cache.shape[2])
    if int(q.shape[2]) % h_kv != 0:
        raise ValueError(f"h_q % h_kv != 0: q has h_q = {int(q.shape[2])} heads, k_cache has h_kv = {h_kv}")
    results = _decode_results(q, q.dtype, False, h_kv)
    res = jax.ffi.ffi_call("flash_mla.dense_decode_fwd_dps", results)(
        q, k_cache, block_table, cache_seqlens,
        head_dim_v=np.int64(head_dim_v), softmax_scale=np.float64(softmax_scale), causal=np.bool_(causal),
    )
    return res[0], res[1], None, None


def sparse_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                  extra_topk_length, head_dim_v: int, softmax_scale: float):
    """Sparse FP8 decode as an XLA custom call. Returns (out, lse, None, None) (see dense_decode)."""
    import jax
    import jax.numpy as jnp

    _register()
    q = jnp.asarray(q)
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache: must be given together")
    if extra_topk_length is not None and extra_k_cache is None:
        raise ValueError("extra_topk_length: given without extra_k_cache")
    present = ((_SD_TOPK_LENGTH if topk_length is not None else 0) | (_SD_SINK if attn_sink is not None else 0)
               | (_SD_EXTRA if extra_k_cache is not None else 0)
               | (_SD_EXTRA_TOPK_LENGTH if extra_topk_length is not None else 0))
    i32, f32, u8 = jnp.int32, jnp.float32, jnp.uint8
    args = [
        q, k_cache, indices,
        topk_length if topk_length is not None else _placeholder(i32),
        attn_sink if attn_sink is not None else _placeholder(f32),
        extra_k_cache if extra_k_cache is not None else _placeholder(u8),
        extra_indices_in_kvcache if extra_indices_in_kvcache is not None else _placeholder(i32),
        extra_topk_length if extra_topk_length is not None else _placeholder(i32),
    ]
    results = _decode_results(q, jnp.bfloat16, True, 1)
    res = jax.ffi.ffi_call("flash_mla.sparse_decode_fwd_dps", results)(
        *args, head_dim_v=np.int64(head_dim_v), softmax_scale=np.float64(softmax_scale), present=np.int64(present),
    )
    return res[0], res[1], None, None


def sparse_prefill(q, kv, indices, sm_scale: float, d_v: int, attn_sink: Optional[Any], topk_length: Optional[Any]):
    """Sparse prefill as an XLA custom call. Returns [out, max_logits, lse]."""
    import jax
    import jax.numpy as jnp

    _register()
    q = jnp.asarray(q)
    if len(q.shape) != 3:
        raise ValueError(f"q: expected a 3-D tensor (s_q, h_q, d_qk), got shape {tuple(q.shape)}")
    s_q, h_q = int(q.shape[0]), int(q.shape[1])
    present = (_SP_SINK if attn_sink is not None else 0) | (_SP_TOPK_LENGTH if topk_length is not None else 0)
    results = [
        jax.ShapeDtypeStruct((s_q, h_q, int(d_v)), jnp.bfloat16),
        jax.ShapeDtypeStruct((s_q, h_q), jnp.float32),
        jax.ShapeDtypeStruct((s_q, h_q), jnp.float32),
    ]
    res = jax.ffi.ffi_call("flash_mla.sparse_prefill_fwd_dps", results)(
        q, kv, indices,
        attn_sink if attn_sink is not None else _placeholder(jnp.float32),
        topk_length if topk_length is not None else _placeholder(jnp.int32),
        sm_scale=np.float64(sm_scale), d_v=np.int64(d_v), present=np.int64(present),
    )
    return list(res)
