"""JAX path: flash_mla's operators as XLA custom calls, usable inside ``jax.jit``.

JAX arrays (concrete or traced) go through ``jax.ffi.ffi_call`` to the
destination-passing functions of the TVM-FFI module (``*_fwd_dps`` in
bindings/tvm_ffi/module.cpp), registered as XLA FFI targets with the
``jax-tvm-ffi`` package. XLA allocates every result (sized here from shapes via
``decode_scratch_bytes``) and gives the call its own stream, so the kernels run on
JAX's stream and the call can sit inside ``jax.jit`` (and XLA's CUDA graphs).
The split schedule is recomputed by every call (on the GPU by a small kernel on
that stream), so nothing depends on values at trace time. Dense MHA prefill is a
``jax.custom_vjp`` over two custom calls (forward; backward for ``jax.grad`` / ``jax.vjp``),
each with a workspace result sized from shapes for every device the call may land on.

Errors: shapes and dtypes are checked while tracing, by the core's own validation
(``*_check`` in module.cpp), so they raise the ValueError / TypeError of the other paths,
also under ``jax.jit``. Value checks (CPU: lengths, pages, indices) run with the call:
eagerly they raise the same class; inside ``jax.jit`` they surface when the compiled function
runs, always as ``jax.errors.JaxRuntimeError`` (JAX's class for errors of a running computation,
a RuntimeError) whose message starts with ``[flash_mla:ValueError]`` after XLA's status
(``INTERNAL: ``). One class whatever the call order: JAX >= 0.7.2 raises a builtin ValueError
instead from its C++ fast path, i.e. once the function has run without error (jax-ml/jax#34083),
so on the CPU backend -- the only one whose calls raise value errors -- the traced custom call is
marked side-effecting, which keeps JAX on its Python dispatch path (slower per call, by tens of
microseconds; the CPU reference attention takes milliseconds). The GPU kernels never read the
values back, so GPU calls keep the fast path. (Not done with several JAX devices, where XLA cannot
partition a side-effecting FFI call: there the class depends on the call order as described. Nor for
the forward of the dense MHA prefill, which training steps wrap in ``jax.checkpoint``: remat's partial
evaluation refuses side-effecting calls, so its value errors follow the call order too -- the first run
of a jitted function raises JaxRuntimeError, a run after a good one may raise a builtin ValueError, both
with the same prefixed message.) ``jax.vmap`` maps the call sequentially.

Needs ``pip install jax-tvm-ffi`` (an ImportError saying so is raised otherwise).
"""

from __future__ import annotations

import functools
import re
from typing import Any, List, Optional, Tuple

import numpy as np

from . import _ffi

# Bits of the `present` attribute (module.cpp).
_SD_TOPK_LENGTH, _SD_SINK, _SD_EXTRA, _SD_EXTRA_TOPK_LENGTH = 1, 2, 4, 8
_SP_SINK, _SP_TOPK_LENGTH = 1, 2

# Errors of the custom calls reach Python as XLA errors carrying the message only; module.cpp puts
# the class in a "[flash_mla:<Class>] " prefix (see _ffi_call).
_PREFIX = re.compile(r"\[flash_mla:(\w+)\] ")
_ERROR_CLASSES = {"ValueError": ValueError, "TypeError": TypeError, "NotImplementedError": NotImplementedError}


def _spec(*tensors: Any) -> Tuple[List[List[int]], List[str]]:
    """(shapes, dtype names) of the arguments as XLA will see them; None = absent (empty name)."""
    import jax

    shapes, dtypes = [], []
    for t in tensors:
        if t is None:
            shapes.append([])
            dtypes.append("")
            continue
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            raise TypeError(f"expected a tensor (JAX or NumPy array), got {type(t).__name__}")
        shapes.append([int(d) for d in t.shape])
        # A NumPy argument is checked with its own dtype (JAX would silently narrow an int64 block table
        # or length array to int32 without jax_enable_x64; the NumPy path raises TypeError for it).
        dt = t.dtype if isinstance(t, np.ndarray) else jax.dtypes.canonicalize_dtype(np.dtype(t.dtype))
        dtypes.append(str(np.dtype(dt)))
    return shapes, dtypes


def _named(names: Tuple[str, ...], tensors: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """`tensors` with a TypeError naming the argument for anything that is not an array."""
    for name, t in zip(names, tensors):
        if t is not None and not (hasattr(t, "shape") and hasattr(t, "dtype")):
            raise TypeError(f"{name}: expected a tensor (any DLPack framework), got {type(t).__name__}")
    return tensors


def _ffi_call(target: str, results: Any, *args: Any, remat: bool = False, **attrs: Any) -> Any:
    """jax.ffi.ffi_call of one of our targets. Outside jax.jit, an error of the call is re-raised
    with the class the other paths raise (ValueError / TypeError / NotImplementedError); inside
    jax.jit it surfaces when the compiled function runs, as XLA's error with the prefixed message.
    Under jax.vmap the call is applied sequentially, once per mapped element. ``remat``: the call may
    be inside ``jax.checkpoint``, whose partial evaluation rejects side-effecting calls
    (NotImplementedError "Effects not supported in partial-eval of checkpoint/remat"), so it is never
    marked side-effecting (see _raises_at_run_time)."""
    import jax

    try:
        return jax.ffi.ffi_call(target, results, vmap_method="sequential",
                                has_side_effect=not remat and _raises_at_run_time(args))(*args, **attrs)
    except Exception as e:  # noqa: BLE001 - only errors carrying our prefix are translated
        msg = str(e)
        m = _PREFIX.search(msg)
        if m is None:
            raise
        raise _ERROR_CLASSES.get(m.group(1), RuntimeError)(msg[m.end():].rstrip()) from None


def _raises_at_run_time(args: Tuple[Any, ...]) -> bool:
    """Whether this call is traced into a computation whose runs may raise value errors: one
    compiled for the CPU (JAX's default backend), where the reference backend checks lengths, pages
    and indices. Such calls are marked side-effecting so that every run goes through JAX's Python
    dispatch, whose runtime errors are JaxRuntimeError (the C++ fast path's are ValueError: module
    docstring). Not with several devices: XLA's SPMD partitioner requires a sharding on a
    side-effecting op, which an FFI call has no way to state (there the class follows JAX's path).
    Eager calls need nothing: _ffi_call translates their errors itself."""
    import jax

    return (any(isinstance(a, jax.core.Tracer) for a in args) and jax.default_backend() == "cpu"
            and jax.device_count() == 1)


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
        "dense_prefill_fwd_dps": ["args", "attrs.max_seqlen_q", "attrs.max_seqlen_k", "attrs.softmax_scale",
                                  "attrs.causal", "attrs.seqlen_names", "rets"],
        "dense_prefill_bwd_dps": ["args", "attrs.max_seqlen_q", "attrs.max_seqlen_k", "attrs.softmax_scale",
                                  "attrs.causal", "attrs.seqlen_names", "rets"],
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


def use_xla(q: Any, others: Tuple[Tuple[str, Any], ...] = ()) -> bool:
    """Whether a call with this `q` goes through XLA: every JAX array when jax-tvm-ffi is
    installed; otherwise concrete JAX arrays take the DLPack path and traced ones raise
    ImportError (from _register) saying what to install.

    `others` are the other tensor arguments as (name, value). XLA takes JAX and NumPy arrays
    only: with a tensor of another framework (torch, CuPy, ...) a concrete call takes the
    DLPack path (as mixed calls of other frameworks do); a traced one raises TypeError naming
    the argument."""
    if q is None or _ffi.framework_of(q) != "jax":
        return False
    import jax

    traced = isinstance(q, jax.core.Tracer)
    for name, t in others:
        if t is None or isinstance(t, (jax.Array, np.ndarray)):
            continue
        if not traced and hasattr(t, "__dlpack__"):
            return False
        if traced or not hasattr(t, "shape"):
            raise TypeError(f"{name}: expected a JAX or NumPy array inside a JAX transformation (jax.jit, "
                            f"jax.vmap, ...), got {type(t).__module__}.{type(t).__name__}")
    return _have_jax_tvm_ffi() or traced


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
    tensors = _named(("q", "k_cache", "block_table", "cache_seqlens"), (q, k_cache, block_table, cache_seqlens))
    # Shapes and dtypes are checked now, by the core's own validation (same classes and messages as
    # the other paths, also while tracing under jax.jit); values (CPU) when the call runs.
    _ffi.lib.dense_decode_check(*_spec(*tensors), int(head_dim_v), float(softmax_scale), bool(causal))
    h_kv = int(k_cache.shape[2])
    results = _decode_results(q, q.dtype, False, h_kv)
    res = _ffi_call("flash_mla.dense_decode_fwd_dps", results,
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
    tensors = _named(("q", "k_cache", "indices", "topk_length", "attn_sink", "extra_k_cache",
                      "extra_indices_in_kvcache", "extra_topk_length"),
                     (q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                      extra_topk_length))
    _ffi.lib.sparse_decode_check(*_spec(*tensors), int(head_dim_v), float(softmax_scale))  # see dense_decode
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
    res = _ffi_call("flash_mla.sparse_decode_fwd_dps", results,
        *args, head_dim_v=np.int64(head_dim_v), softmax_scale=np.float64(softmax_scale), present=np.int64(present),
    )
    return res[0], res[1], None, None


def sparse_prefill(q, kv, indices, sm_scale: float, d_v: int, attn_sink: Optional[Any], topk_length: Optional[Any]):
    """Sparse prefill as an XLA custom call. Returns [out, max_logits, lse]."""
    import jax
    import jax.numpy as jnp

    _register()
    q = jnp.asarray(q)
    tensors = _named(("q", "kv", "indices", "attn_sink", "topk_length"), (q, kv, indices, attn_sink, topk_length))
    _ffi.lib.sparse_prefill_check(*_spec(*tensors), float(sm_scale), int(d_v))  # see dense_decode
    s_q, h_q = int(q.shape[0]), int(q.shape[1])
    present = (_SP_SINK if attn_sink is not None else 0) | (_SP_TOPK_LENGTH if topk_length is not None else 0)
    results = [
        jax.ShapeDtypeStruct((s_q, h_q, int(d_v)), jnp.bfloat16),
        jax.ShapeDtypeStruct((s_q, h_q), jnp.float32),
        jax.ShapeDtypeStruct((s_q, h_q), jnp.float32),
    ]
    res = _ffi_call("flash_mla.sparse_prefill_fwd_dps", results,
        q, kv, indices,
        attn_sink if attn_sink is not None else _placeholder(jnp.float32),
        topk_length if topk_length is not None else _placeholder(jnp.int32),
        sm_scale=np.float64(sm_scale), d_v=np.int64(d_v), present=np.int64(present),
    )
    return list(res)


# ----------------------------------------------------------------------------- dense MHA prefill
def _prefill_workspace(bwd: bool, tensors: Tuple[Any, ...], scalars: Tuple[int, int, float, bool]) -> int:
    """Checks shapes and dtypes (raising what the other paths raise) and returns the workspace bytes,
    sized for every device the call may be placed on (see _scratch_bytes)."""
    shapes, dtypes = _spec(*tensors)
    sizes = []
    for dev_type, dev_id in _candidate_devices():
        try:
            sizes.append(int(_ffi.lib.dense_prefill_check(bwd, dev_type, dev_id, shapes, dtypes, *scalars)))
        except NotImplementedError:  # a GPU without the sm90 kernels: calls placed there raise anyway
            pass
    return max(sizes) if sizes else 0


def _seqlen_names_code(names: Tuple[str, ...], tensors: Tuple[Tuple[str, str], ...], args: Tuple[Any, ...]) -> np.int64:
    """The dps functions' `seqlen_names` (bindings/tvm_ffi/module.cpp, with_seqlen_names): which names their value
    errors give the arguments. Traced calls (jax.jit), whose errors surface when the computation runs, after the
    caller's frame: 1 flash_attn_varlen_func's (cu_seqlens_qo, ...; q, k, v), 2 the qkv-packed one's (cu_seqlens,
    max_seqlen; qkv), 3 the kv-packed one's (cu_seqlens_qo, ...; q, kv). Eager calls: 0, the core's names, which the
    caller's frame renames (call_naming_seqlens). `tensors`: the packed function's renaming of q / k / v as
    (name, packed name) pairs, () for flash_attn_varlen_func."""
    import jax

    if not any(isinstance(a, jax.core.Tracer) for a in args):
        return np.int64(0)
    if names[0] == "cu_seqlens":
        return np.int64(2)
    return np.int64(3 if dict(tensors).get("k") == "kv" else 1)


def _prefill_fwd(q, k, v, cu_q, cu_k, scalars, names, tensors):
    import jax
    import jax.numpy as jnp

    _named(("q", "k", "v", "cu_seqlens_qo", "cu_seqlens_kv"), (q, k, v, cu_q, cu_k))
    ws = _prefill_workspace(False, (q, k, v, cu_q, cu_k), scalars)
    total_q, h_q, d_v = int(q.shape[0]), int(q.shape[1]), int(v.shape[2])
    results = [
        jax.ShapeDtypeStruct((total_q, h_q, d_v), q.dtype),
        jax.ShapeDtypeStruct((h_q, total_q), jnp.float32),  # lse, transposed (module.cpp)
        jax.ShapeDtypeStruct((max(ws, 1),), jnp.uint8),
    ]
    max_q, max_k, scale, causal = scalars
    # remat: the forward is what jax.checkpoint recomputes in a training step (the backward is not traced
    # inside a checkpoint's partial evaluation and keeps the error class of the other operators).
    out, lse_t, _ = _ffi_call("flash_mla.dense_prefill_fwd_dps", results, q, k, v, cu_q, cu_k, remat=True,
                              max_seqlen_q=np.int64(max_q), max_seqlen_k=np.int64(max_k),
                              softmax_scale=np.float64(scale), causal=np.bool_(causal),
                              seqlen_names=_seqlen_names_code(names, tensors, (q, k, v, cu_q, cu_k)))
    return out, lse_t


def _prefill_bwd(dout, q, k, v, out, lse_t, cu_q, cu_k, scalars, names, tensors):
    import jax
    import jax.numpy as jnp

    _named(("dout", "q", "k", "v", "out", "lse", "cu_seqlens_qo", "cu_seqlens_kv"),
           (dout, q, k, v, out, lse_t, cu_q, cu_k))
    # The check sees lse as (total_q, h_q), the layout the operator documents.
    lse_spec = jax.ShapeDtypeStruct((int(lse_t.shape[1]), int(lse_t.shape[0])), lse_t.dtype) \
        if len(lse_t.shape) == 2 else lse_t
    ws = _prefill_workspace(True, (dout, q, k, v, out, lse_spec, cu_q, cu_k), scalars)
    results = [jax.ShapeDtypeStruct(tuple(int(d) for d in t.shape), q.dtype) for t in (q, k, v)]
    results.append(jax.ShapeDtypeStruct((max(ws, 1),), jnp.uint8))
    max_q, max_k, scale, causal = scalars
    dq, dk, dv, _ = _ffi_call("flash_mla.dense_prefill_bwd_dps", results, dout, q, k, v, out, lse_t, cu_q, cu_k,
                              max_seqlen_q=np.int64(max_q), max_seqlen_k=np.int64(max_k),
                              softmax_scale=np.float64(scale), causal=np.bool_(causal),
                              seqlen_names=_seqlen_names_code(names, tensors, (dout, q, k, v, out, lse_t, cu_q, cu_k)))
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _prefill_vjp(scalars: Tuple[int, int, float, bool], names: Tuple[str, ...],
                 tensors: Tuple[Tuple[str, str], ...]):
    """The dense prefill of these static arguments as a jax.custom_vjp of (q, k, v, cu_seqlens_q, cu_seqlens_k)
    -> (out, lse); the cotangent of lse is discarded (as FlashMLA's), cu_seqlens get none."""
    import jax

    @jax.custom_vjp
    def attention(q, k, v, cu_q, cu_k):
        out, lse_t = _prefill_fwd(q, k, v, cu_q, cu_k, scalars, names, tensors)
        return out, lse_t.T

    def fwd(q, k, v, cu_q, cu_k):
        out, lse_t = _prefill_fwd(q, k, v, cu_q, cu_k, scalars, names, tensors)
        return (out, lse_t.T), (q, k, v, cu_q, cu_k, out, lse_t)

    def bwd(res, cotangents):
        q, k, v, cu_q, cu_k, out, lse_t = res
        dout, _ = cotangents
        dq, dk, dv = _prefill_bwd(dout.astype(q.dtype), q, k, v, out, lse_t, cu_q, cu_k, scalars, names,
                                  tensors)
        return dq, dk, dv, None, None

    attention.defvjp(fwd, bwd)
    return attention


def dense_prefill(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                  names: Tuple[str, ...], tensors: Optional[dict] = None):
    """Dense MHA prefill as XLA custom calls with a jax.custom_vjp (jax.grad / jax.vjp give dq, dk, dv;
    usable under jax.jit). Returns (out, lse), lse (total_q, h_q). `names`: the caller's names of
    (cu_seqlens of q, of k, max_seqlen of q, of k), and `tensors` the packed variants' names of q / k / v
    ({"k": "kv", "v": "kv"}; None: q, k, v), which the value errors raised when the call runs give."""
    import jax.numpy as jnp

    _register()
    scalars = (int(max_q), int(max_k), float(scale), bool(causal))
    # Shapes and dtypes are checked here, on the caller's arrays: jax.custom_vjp converts NumPy arguments to JAX
    # arrays before _prefill_fwd sees them, which without jax_enable_x64 narrows an int64 cu_seqlens to int32 (that
    # the other paths reject) and a float64 k to float32 (which the error would name instead).
    _named(("q", "k", "v", "cu_seqlens_qo", "cu_seqlens_kv"), (q, k, v, cu_q, cu_k))
    _prefill_workspace(False, (q, k, v, cu_q, cu_k), scalars)
    return _prefill_vjp(scalars, tuple(names), tuple(sorted((tensors or {}).items())))(
        jnp.asarray(q), k, v, cu_q, cu_k)


def dense_prefill_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                      names: Tuple[str, ...]):
    """The backward as a plain XLA custom call: ``lse`` is the forward's (total_q, h_q). Returns (dq, dk, dv).
    `names` as in dense_prefill."""
    import jax.numpy as jnp

    _register()
    lse = jnp.asarray(lse)
    if lse.ndim != 2:
        raise ValueError(f"lse: expected a 2-D tensor (total_q, h_q), got shape {tuple(lse.shape)}")
    return _prefill_bwd(dout, jnp.asarray(q), k, v, out, lse.T, cu_q, cu_k,
                        (int(max_q), int(max_k), float(scale), bool(causal)), tuple(names), ())
