"""FlashMLA-compatible Python API (spec §1: signatures, defaults, checks, results).

Every function accepts tensors of any DLPack framework (PyTorch, JAX, CuPy,
PaddlePaddle, NumPy with ml_dtypes for bfloat16) and returns results in the
framework of ``q``. CPU tensors run on the reference backend; CUDA tensors on a
compute-capability-9.0 GPU run the Hopper kernels where they exist (otherwise
``NotImplementedError`` says so).

Errors: bad arguments raise ``ValueError`` (shapes, values), ``TypeError``
(dtypes) or ``NotImplementedError`` (valid input with no backend for it); each
message names the argument, what was expected and what was given. Misuse of a
scheduler object raises :class:`SchedMetaMismatchError`, which is both a
``ValueError`` and an ``AssertionError`` (FlashMLA raises the latter). The other checks that
FlashMLA's wrapper makes with Python ``assert`` (spec §1.3 steps 0, 3 and 4: the scheduler
object's type, ``num_splits`` None, no ``causal`` and an FP8 cache for sparse decoding, no
sparse-only argument and both ``block_table`` and ``cache_seqlens`` for dense decoding) raise
exceptions that are also ``AssertionError``, so code written for FlashMLA that catches
``AssertionError`` behaves the same.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import threading
from math import isfinite as _isfinite
from typing import Any, Optional, Tuple

import numpy as np

from . import _cupy, _ffi
from . import _torch_ops

_EAGER = _torch_ops.EAGER

__all__ = [
    "FlashMLASchedMeta",
    "SchedMetaMismatchError",
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_backward",
]


class SchedMetaMismatchError(ValueError, AssertionError):
    """A FlashMLASchedMeta was reused for a call it was not computed for."""


class _AssertValueError(ValueError, AssertionError):
    """A value check that FlashMLA's wrapper makes with ``assert`` (spec §1.3 steps 0, 3, 4)."""


class _AssertTypeError(TypeError, AssertionError):
    """A type check that FlashMLA's wrapper makes with ``assert`` (spec §1.3 step 0)."""


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Split-KV scheduler state, filled lazily by the first decode call (spec §1.2, §4).

    Fields (FlashMLA's): ``have_initialized``; ``config`` (the shapes and flags of
    the first call); ``tile_scheduler_metadata`` (int32 ``(num_sm_parts, 8)``) and
    ``num_splits`` (int32 ``(b + 1,)``), in the framework of ``q``.

    Reuse is legal only for calls with the same ``config`` and the same values of
    ``cache_seqlens`` (dense) / ``topk_length`` and ``extra_topk_length`` (sparse).
    Changed shapes, flags or optional-length presence raise
    :class:`SchedMetaMismatchError`. On the CPU changed length values raise it too, and a
    schedule that a call on another device filled (a GPU, torch's meta device) is recomputed.
    On the GPU lengths are never read back (that would synchronise): torch calls reuse
    the schedule only while the length tensors are the same objects, unmodified since
    (torch version counters), within the same CUDA-graph capture; otherwise, and for
    every other framework, the call recomputes it on its stream. So writes through torch
    never leave stale metadata there, including inside CUDA graphs replayed with new
    lengths, while the layers of one decoding step share one schedule as in FlashMLA.
    Writes torch does not see (custom/Triton kernels, ``.data``, DLPack aliases, a graph
    replay between eager calls) need a new ``get_mla_metadata()``, as in FlashMLA. JAX calls (XLA custom calls,
    also under ``jax.jit``) keep the metadata inside the call and recompute it every time,
    so there ``tile_scheduler_metadata`` and ``num_splits`` stay None.

    Threads may share one object: a call reads its fields as one consistent state and records its own only if
    no other call recorded meanwhile, so each call is correct or a :class:`SchedMetaMismatchError`, and of
    racing first calls the first to finish fills the object.
    """

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[Any] = None
    num_splits: Optional[Any] = None
    # Private state (not constructor arguments: get_mla_metadata() makes the object with the class defaults,
    # which __init__ then need not assign).
    _lengths: Optional[Tuple[Optional[np.ndarray], ...]] = dataclasses.field(default=None, repr=False, init=False)
    _presence: Optional[Tuple[bool, bool]] = dataclasses.field(default=None, repr=False, init=False)
    _gpu_key: Optional[tuple] = dataclasses.field(default=None, repr=False, init=False)
    _config_key: Optional[tuple] = dataclasses.field(default=None, repr=False, init=False)
    # What the fast path of flash_mla_with_kvcache needs to repeat the last torch call that reused the schedule on
    # a device (_reuse_record), or None.
    _reuse: Optional[tuple] = dataclasses.field(default=None, repr=False, init=False)
    # Bumped by every call that records state (first call, a new schedule, the reference lengths), under
    # _SCHED_LOCK: a call records only if nothing else did since it read the object (_sched_state).
    _generation: int = dataclasses.field(default=0, repr=False, init=False, compare=False)


# Guards the scheduler objects' fields across threads (the C++ calls release the GIL, so the layers of a step
# may run in threads that share one FlashMLASchedMeta): a call reads them as one consistent state before its op
# and records its own after it only if no other call recorded meanwhile. Never held while an op runs.
_SCHED_LOCK = threading.Lock()


def _sched_state(sched: FlashMLASchedMeta) -> tuple:
    """The fields a decode call reads, as one consistent tuple (taken under _SCHED_LOCK by the caller)."""
    return (sched.have_initialized, sched._config_key, sched.config, sched._presence, sched._lengths,
            sched.tile_scheduler_metadata, sched.num_splits, sched._gpu_key, sched._generation)


def get_mla_metadata(*args: Any, **kwargs: Any) -> Tuple[FlashMLASchedMeta, None]:
    """Return ``(FlashMLASchedMeta(), None)``.

    All arguments are accepted and ignored, so both the current argument-less
    form and the legacy ``get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv, ...)``
    form work (spec §1.2). The metadata is computed inside the first
    :func:`flash_mla_with_kvcache` call that receives the object.
    """
    return FlashMLASchedMeta(), None


def _host_copy(x: Any) -> Optional[np.ndarray]:
    """A NumPy copy of a small int tensor if it lives on the CPU, else None."""
    if x is None:
        return None
    try:
        if x.__dlpack_device__()[0] not in (1, 3):  # kDLCPU, kDLCUDAHost
            return None
    except (AttributeError, ValueError):  # (ValueError: a device DLPack has no code for, torch's meta)
        return None
    try:
        if _ffi.framework_of(x) == "torch":
            return x.detach().numpy().copy()
        return np.array(np.from_dlpack(x), copy=True)
    except Exception:  # unsupported dtype etc.: the C++ validation reports it, naming the argument
        return None


def _on_device(x: Any) -> bool:
    """True for tensors in accelerator memory (DLPack device other than CPU / pinned host)."""
    try:
        return x.__dlpack_device__()[0] not in (1, 3)
    except AttributeError:
        return False
    except ValueError:  # a device DLPack has no code for (torch's meta device): not host memory
        return True
    except BufferError:  # a sharded JAX array has no single DLPack device: ask JAX
        devices = getattr(x, "devices", None)
        return devices is not None and any(d.platform != "cpu" for d in devices())


def _elsewhere(x: Any) -> bool:
    """True for a tensor not in host memory: torch tensors by ``is_cpu`` (a meta tensor has no DLPack
    device), the others by their DLPack device."""
    is_cpu = getattr(x, "is_cpu", None)
    return (not is_cpu) if isinstance(is_cpu, bool) else _on_device(x)


def _jax_use_xla(q: Any, **others: Any) -> bool:
    from . import _jax

    return _jax.use_xla(q, tuple(others.items()))


def _array_shape(value: Any) -> Optional[Tuple[int, ...]]:
    """The shape of an array / tensor of one or more dimensions (any framework: NumPy, torch, JAX, ...), else None
    (0-d arrays and tensors, scalars, other objects). The scalar-argument helpers reject the former whatever their
    size: a one-element array is a container, as a one-element list is (NumPy already refused ``float`` of one,
    torch took it)."""
    shape = getattr(value, "shape", None)
    if shape is None or isinstance(value, type):
        return None
    try:
        return tuple(int(d) for d in shape) or None
    except TypeError:  # (a shape attribute that is no sequence of sizes: not an array)
        return None


def _reject_traced(name: str, value: Any, kind: str) -> None:
    """TypeError naming a scalar argument given as a traced JAX value (an argument of a jax.jit-ed function):
    the scalars are static -- they size the results or are attributes of the XLA custom call -- so there is no
    value to read while tracing. Without this, ``int()`` / ``bool()`` of the tracer raised "expected an int, got
    DynamicJaxprTracer" or JAX's TracerBoolConversionError, which names no argument. Skipped while torch.compile
    traces (no JAX tracer there): Dynamo cannot trace ``str.startswith`` of a type's ``__module__``, so under
    ``fullgraph=True`` a bad scalar (``softmax_scale="x"``) failed with "Unsupported method call" naming no
    argument, instead of the TypeError that the eager call raises."""
    if _compiling():
        return
    if type(value).__module__.startswith("jax"):
        import jax

        if isinstance(value, jax.core.Tracer):
            raise TypeError(f"{name}: expected a Python {kind}, got a traced JAX value ({type(value).__name__}); the "
                            "scalar arguments are static under jax.jit: close over the value or mark the argument "
                            "static (jax.jit(..., static_argnums=...) / static_argnames=...)")


def _int_arg(name: str, value: Any) -> int:
    """An integer argument (Python / NumPy / 0-d array and tensor integers, via ``operator.index``), with a
    TypeError naming the argument for anything else: None, strings and floats such as 512.9 are not
    truncated (FlashMLA's C++ ``int`` parameters reject them too), nor are booleans (``True`` is an int to
    Python, not a length or a head dim: the same rule as _float_arg's), nor arrays / tensors of one or more
    dimensions (``torch.tensor([512])`` included, as NumPy's ``np.array([512])``)."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool {value!r}")
    if isinstance(value, int):  # the common case, and the one torch.compile traces
        return int(value)
    if type(value) is float:  # (before _array_shape: Dynamo cannot trace hasattr of a dynamic=True SymFloat)
        raise TypeError(f"{name}: expected an int, got float {float(value)!r}")
    _reject_traced(name, value, "int")
    shape = _array_shape(value)
    if shape is not None:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} of shape {shape}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}") from None


def _float_arg(name: str, value: Any) -> float:
    """A real-number argument (Python / NumPy floats and integers, 0-d numeric arrays and tensors) as a finite
    float. TypeError naming the argument for anything else -- None, strings and bytes (``"0.1"`` is not parsed),
    booleans (``True`` is an int to Python, not a scale), complex numbers, arrays / tensors of one or more
    dimensions (``torch.tensor([0.1])`` as ``np.array([0.1])`` and ``[0.1]``); ValueError for NaN / +-inf."""
    if type(value) is not float:  # the common case, and the one torch.compile traces
        _reject_traced(name, value, "float")
        if (value is None or isinstance(value, (str, bytes, bytearray, bool, np.bool_))
                or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")):
            raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
        shape = _array_shape(value)
        if shape is not None:
            raise TypeError(f"{name}: expected a float, got {type(value).__name__} of shape {shape}")
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}") from None
        except OverflowError:  # a Python int beyond float64 (10**400): finite as given, but no float holds it
            raise ValueError(f"{name}: the {type(value).__name__} is too large for a float: it overflows float32 "
                             "(the kernels take a float32 scale)") from None
    if value - value != 0:  # not finite (see _traceable_finite)
        raise ValueError(f"{name}: must be finite, got {value}")
    return value


# _traceable_finite: the operators' check of a float scale is ``x - x != 0`` (True exactly for NaN and +-inf), not
# ``math.isfinite``, which Dynamo cannot trace for a symbolic float (a scale passed to a function compiled with
# dynamic=True, or with the default dynamic=None once a second scale recompiles): fullgraph=True failed on valid
# scales with "torch.* op returned non-Tensor". Dynamo then specialises the scale where the op takes it (a guard per
# distinct scale, as with dynamic=False), so a non-finite one still raises the eager ValueError while tracing.


def _bool_arg(name: str, value: Any) -> bool:
    """A flag argument as a bool. Bools, None, numbers, 0-d arrays / tensors and other objects with a truth value
    of their own are taken by truth (as FlashMLA's C++ ``bool`` parameters take them); strings, bytes and
    containers, whose truth is their length (``"False"`` is true), are a TypeError naming the argument, and so
    are arrays / tensors of one or more dimensions, one element (``np.array([True])``, ``torch.tensor([True])``)
    included."""
    if type(value) is bool:  # the common case, and the one torch.compile traces
        return value
    _reject_traced(name, value, "bool")
    kind = type(value)
    if isinstance(value, (str, bytes, bytearray)) or (not hasattr(kind, "__bool__") and hasattr(kind, "__len__")):
        raise TypeError(f"{name}: expected a bool, got {kind.__name__} {value!r}")
    shape = _array_shape(value)
    if shape is not None:
        raise TypeError(f"{name}: expected a bool, got {kind.__name__} of shape {shape}")
    try:
        return bool(value)
    except (ValueError, RuntimeError):  # a tensor / array of several elements: "truth value ... is ambiguous"
        shape = tuple(int(s) for s in getattr(value, "shape", ()))
        raise TypeError(f"{name}: expected a bool, got {kind.__name__} of shape {shape}") from None


def _default_softmax_scale(d_qk: Any) -> float:
    """FlashMLA's default softmax scale ``d_qk ** -0.5`` (1.0 for d_qk 0, which the C++ validation rejects).
    ``operator.index`` turns a symbolic size of torch.compile's dynamic shapes into a concrete int (Dynamo
    specialises it, with a guard), so the scale is a constant of the graph as in eager, not a symbolic
    float that the finiteness check of the scale cannot trace."""
    d = operator.index(d_qk)
    return d ** (-0.5) if d > 0 else 1.0


def _require_tensors(**tensors: Any) -> None:
    """TypeError naming the first required argument that is None or not a tensor (no ``.shape``)."""
    for name, val in tensors.items():
        if val is None or not hasattr(val, "shape"):
            raise TypeError(f"{name}: expected a tensor, got {type(val).__name__}")


def _shape(x: Any) -> Tuple[int, ...]:
    """The sizes of ``x`` as ints for error messages. ``operator.index`` (not ``int``) makes torch.compile's
    symbolic sizes (dynamic=True) concrete, so a message under compile reads "got shape (2, 128)" as in eager,
    not "got shape (s60, s94)"."""
    return tuple(operator.index(s) for s in x.shape)


def flash_mla_with_kvcache(
    q: Any,
    k_cache: Any,
    block_table: Any,
    cache_seqlens: Any,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Any = None,
    attn_sink: Any = None,
    extra_k_cache: Any = None,
    extra_indices_in_kvcache: Any = None,
    topk_length: Any = None,
    extra_topk_length: Any = None,
) -> Tuple[Any, Any]:
    """MLA decoding over a paged KV cache (FlashMLA's ``flash_mla_with_kvcache``).

    Dense mode (``indices is None``; spec §2.2): ``q`` ``(b, s_q, h_q, d_qk)`` bf16/fp16
    with d_qk 576 or 512; ``k_cache`` ``(num_blocks, page_block_size, h_kv, d_qk)`` of
    q's dtype (V is ``k_cache[..., :512]``); ``block_table`` ``(b, max_blocks)`` int32;
    ``cache_seqlens`` ``(b,)`` int32; ``causal`` masks bottom-right aligned when s_q > 1;
    ``is_fp8_kvcache`` is not used (as in FlashMLA's dense path).

    Sparse mode (``indices`` given; spec §2.3): ``is_fp8_kvcache=True``; ``q`` bf16;
    ``k_cache`` ``(num_blocks, page_block_size, 1, 656)`` (V32, d_qk 576) or ``(..., 584)``
    (MODEL1, d_qk 512) bytes (uint8/int8/float8_e4m3fn); ``indices`` ``(b, s_q, topk)``
    int32 flat token indices (``block * page_block_size + row``; -1 = invalid);
    optional ``topk_length`` ``(b,)`` int32, ``attn_sink`` ``(h_q,)`` float32,
    ``extra_k_cache`` + ``extra_indices_in_kvcache`` ``(b, s_q, extra_topk)`` +
    ``extra_topk_length`` ``(b,)``, attended in one joint softmax.

    ``head_dim_v`` must be 512; ``softmax_scale`` defaults to ``d_qk ** -0.5``, which is not a
    DeepSeek model's scale: with absorbed queries pass the model's (``(qk_nope + qk_rope) ** -0.5``, times
    YaRN's ``mscale ** 2``; README "In a DeepSeek-V3 model"); ``num_splits`` must be None (FlashMLA's legacy
    argument).

    Returns ``(out, lse)``: ``out`` ``(b, s_q, h_q, 512)`` in q's dtype (bf16 for sparse);
    ``lse`` ``(b, h_q, s_q)`` float32, natural log. Rows with no valid key give
    ``out = 0`` and ``lse = +inf``. ``attn_sink`` scales ``out`` only.

    Raises (each message names the argument): ``TypeError`` for a missing / non-tensor ``q`` or
    ``k_cache``, a non-tensor optional argument, a wrong dtype or a non-numeric / non-integer scalar
    (a ``softmax_scale`` that is a string, bytes or a boolean included), a ``causal`` or ``is_fp8_kvcache`` that
    is a string, bytes or a container (``"False"`` is truthy); ``ValueError`` for a NaN /
    infinite ``softmax_scale``, wrong ranks or shapes, a missing ``block_table`` / ``cache_seqlens`` in dense
    mode, a sparse-only argument in dense mode, ``head_dim_v`` other than 512, tensors on
    different devices, a non-contiguous last dimension, block-table entries or indices out of
    range, negative lengths; :class:`SchedMetaMismatchError` when the scheduler object is reused
    with other shapes, flags or lengths. The checks FlashMLA makes with ``assert`` raise exceptions
    that are also ``AssertionError`` (module docstring).
    """
    if type(tile_scheduler_metadata) is FlashMLASchedMeta:
        rec = tile_scheduler_metadata._reuse
        if rec is not None and num_splits is None and not _torch_ops._is_compiling():
            # Fast path: a torch call that repeats the last call made with this FlashMLASchedMeta -- the layers
            # of one decoding step. `rec` (`_reuse_record`, made by the full path below after a call that reused
            # the schedule) holds what that call established; each check here stands for one of the full
            # path (argument types, shapes and flags, hence the config; the scheduler object's fields; the
            # length tensors, their versions and the device, hence the schedule key; no capture), so a call that
            # passes them runs the op that the full path would run, with the same arguments, and raises the same
            # errors. Anything else (and torch.compile, checked above) takes the full path.
            tensor, shapes, flags, lengths, dev, tsm, splits, default_scale, run, eager = rec
            if indices is None:  # dense decode: no sparse-only argument, block_table and cache_seqlens tensors
                hit = (type(q) is tensor and type(k_cache) is tensor and type(block_table) is tensor
                       and cache_seqlens is lengths[0] and cache_seqlens._version == lengths[1]
                       and cache_seqlens.data_ptr() == lengths[2]
                       and attn_sink is None and extra_k_cache is None and extra_indices_in_kvcache is None
                       and topk_length is None and extra_topk_length is None
                       and (q.shape, k_cache.shape, None) == shapes)
            else:  # sparse decode without the extra cache
                hit = (type(q) is tensor and type(k_cache) is tensor and type(indices) is tensor
                       and topk_length is lengths[0]
                       and (topk_length is None or (topk_length._version == lengths[1]
                                                    and topk_length.data_ptr() == lengths[2]))
                       and extra_k_cache is None and extra_indices_in_kvcache is None and extra_topk_length is None
                       and (attn_sink is None or type(attn_sink) is tensor)
                       and (block_table is None or type(block_table) is tensor)
                       and (cache_seqlens is None or type(cache_seqlens) is tensor)
                       and (q.shape, k_cache.shape, indices.shape) == shapes)
            if (hit and causal is flags[0] and is_fp8_kvcache is flags[1]
                    and tile_scheduler_metadata.tile_scheduler_metadata is tsm
                    and tile_scheduler_metadata.num_splits is splits and tile_scheduler_metadata.have_initialized
                    and q.get_device() == dev
                    # (a CUDA device: the current one, no capture and the route the record was made on -- a CUDA
                    # record is eager exactly when the eager route was on, set_eager_route may have switched it
                    # since; -1: torch's meta device, never the CPU)
                    and (not _torch_ops._cuda_capturing() and _torch_ops._cuda_current_device() == dev
                         and eager is _torch_ops._eager_route if dev >= 0 else not q.is_cpu)
                    and not (eager and _torch_ops.mode_active())):  # (the eager route: nothing may intercept)
                if type(head_dim_v) is not int:  # (the full path's checks of the two scalars, in its order)
                    head_dim_v = _int_arg("head_dim_v", head_dim_v)
                if softmax_scale is None:
                    softmax_scale = default_scale
                elif type(softmax_scale) is not float or not _isfinite(softmax_scale):
                    softmax_scale = _float_arg("softmax_scale", softmax_scale)
                try:
                    if indices is None:
                        return run(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal, tsm,
                                   splits)
                    return run(q, k_cache, indices, topk_length, attn_sink, tsm, splits, None, None, None,
                               head_dim_v, softmax_scale)
                except RuntimeError as e:  # the op library's "[flash_mla:<Class>]" errors as that class
                    mapped = _torch_ops.mapped_error(e)
                    if mapped is None:
                        raise
                    raise mapped from None
    elif not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise _AssertTypeError(
            "tile_scheduler_metadata: expected the FlashMLASchedMeta returned by get_mla_metadata(), "
            f"got {type(tile_scheduler_metadata).__name__}"
        )
    if num_splits is not None:
        raise _AssertValueError("num_splits: must be None (the scheduler object carries the splits)")
    sched = tile_scheduler_metadata
    try:  # (each shape read once: a torch.Size is made on every access)
        q_shape, k_shape = q.shape, k_cache.shape
    except AttributeError:
        _require_tensors(q=q, k_cache=k_cache)  # raises, naming the argument
        raise
    if len(q_shape) != 4:
        raise ValueError(f"q: expected a 4-D tensor (b, s_q, h_q, d_qk), got shape {_shape(q)}")
    if len(k_shape) != 4:
        raise ValueError(
            f"k_cache: expected a 4-D tensor (num_blocks, page_block_size, h_kv, last), got shape {_shape(k_cache)}"
        )
    if indices is not None or extra_k_cache is not None or extra_indices_in_kvcache is not None:
        for name, t, rank, layout in (("indices", indices, 3, "(b, s_q, topk)"),
                                      ("extra_k_cache", extra_k_cache, 4, "(num_blocks, page_block_size, 1, last)"),
                                      ("extra_indices_in_kvcache", extra_indices_in_kvcache, 3, "(b, s_q, extra_topk)")):
            if t is not None and not hasattr(t, "shape"):
                raise TypeError(f"{name}: expected a {rank}-D tensor {layout} or None, got {type(t).__name__}")
            if t is not None and len(t.shape) != rank:
                raise ValueError(f"{name}: expected a {rank}-D tensor {layout}, got shape {_shape(t)}")
    b, s_q, h_q = int(q_shape[0]), int(q_shape[1]), int(q_shape[2])
    if softmax_scale is None:
        softmax_scale = _default_softmax_scale(q_shape[3])
    if type(head_dim_v) is not int:
        head_dim_v = _int_arg("head_dim_v", head_dim_v)
    if type(softmax_scale) is not float or softmax_scale - softmax_scale != 0:  # (_traceable_finite)
        softmax_scale = _float_arg("softmax_scale", softmax_scale)
    causal = _bool_arg("causal", causal)
    is_fp8_kvcache = _bool_arg("is_fp8_kvcache", is_fp8_kvcache)
    topk = int(indices.shape[-1]) if indices is not None else None
    extra_pbs = int(extra_k_cache.shape[1]) if extra_k_cache is not None else None
    extra_topk = int(extra_indices_in_kvcache.shape[-1]) if extra_indices_in_kvcache is not None else None
    config_key = (  # FlashMLASchedMeta.Config's fields; a plain tuple compares ~10x faster than the dataclass
        b, s_q, h_q, int(k_shape[1]), int(k_shape[2]), causal, is_fp8_kvcache, topk, extra_pbs, extra_topk,
    )
    # torch tensors take the torch.ops path or, eager on CUDA, the TVM-FFI function directly (_torch_ops.route),
    # JAX arrays XLA custom calls (flash_mla/_jax.py, also under jax.jit), everything else TVM-FFI.
    torch_route = _torch_ops.route(q, k_cache, block_table, cache_seqlens, indices, attn_sink, extra_k_cache,
                                   extra_indices_in_kvcache, topk_length, extra_topk_length)
    use_torch = torch_route != 0
    eager = torch_route == _EAGER
    use_jax = not use_torch and _ffi.framework_of(q) == "jax" and _jax_use_xla(
        q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens, indices=indices,
        attn_sink=attn_sink, extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices_in_kvcache,
        topk_length=topk_length, extra_topk_length=extra_topk_length)
    # Host copies of the length tensors (CPU tensors only; None for device tensors and on the XLA path,
    # which recomputes the schedule every call). `host_lengths`: whether any was copied.
    if use_jax or eager:
        lengths = (None,) if topk is None else (None, None)
        host_lengths = False
    else:
        host_copy = _torch_ops.host_copy if use_torch else _host_copy
        if topk is None:
            lengths = (host_copy(cache_seqlens),)
            host_lengths = lengths[0] is not None
        else:
            lengths = (host_copy(topk_length), host_copy(extra_topk_length))
            host_lengths = lengths[0] is not None or lengths[1] is not None
    presence = (topk_length is not None, extra_topk_length is not None)
    # The scheduler object's fields as one consistent state: another thread may record its own call meanwhile
    # (see _SCHED_LOCK; torch.compile traces without the lock, its calls run as one graph).
    if _compiling():
        state = _sched_state(sched)
    else:
        with _SCHED_LOCK:
            state = _sched_state(sched)
    (initialized, old_config_key, old_config, old_presence, old_lengths, tsm, old_splits, old_gpu_key,
     generation) = state
    if initialized:
        if old_config_key != config_key:
            if not isinstance(old_config, FlashMLASchedMeta.Config):
                raise SchedMetaMismatchError(
                    f"sched_meta: have_initialized is True but config is {type(old_config).__name__}, not a "
                    "FlashMLASchedMeta.Config; a FlashMLASchedMeta is filled by the first decode call that takes it: "
                    "pass a new get_mla_metadata()[0]"
                )
            config = FlashMLASchedMeta.Config(*config_key)
            if old_config != config:
                for field in dataclasses.fields(config):
                    old, new = getattr(old_config, field.name), getattr(config, field.name)
                    if old != new:
                        raise SchedMetaMismatchError(
                            f"sched_meta.config.{field.name}: this FlashMLASchedMeta was computed for "
                            f"{field.name}={old!r}, got {new!r}; a FlashMLASchedMeta "
                            "can only be reused for calls with the same shapes and flags; call get_mla_metadata() again"
                        )
        if old_presence is not None and old_presence != presence:
            raise SchedMetaMismatchError(
                "topk_length / extra_topk_length: this FlashMLASchedMeta was computed "
                f"{'with' if old_presence[0] else 'without'} topk_length and "
                f"{'with' if old_presence[1] else 'without'} extra_topk_length; its split schedule would be "
                "stale. Call get_mla_metadata() again"
            )
        if host_lengths and old_lengths is not None:
            names = ("cache_seqlens",) if topk is None else ("topk_length", "extra_topk_length")
            for name, old, new in zip(names, old_lengths, lengths):
                # (a length tensor of another shape or dtype is malformed, not changed: the op's validation
                # reports it, naming what was expected)
                if (old is not None and new is not None and old.shape == new.shape and old.dtype == new.dtype
                        and not np.array_equal(old, new)):
                    raise SchedMetaMismatchError(
                        f"{name}: values differ from the call that computed this FlashMLASchedMeta; its split "
                        "schedule would be stale. Call get_mla_metadata() again when lengths change"
                    )
    # On the CPU the schedule is reused (changed lengths raise above). On the GPU the lengths are
    # never read back: torch calls reuse it only while the length tensors are the same objects at
    # the same versions, in the same CUDA-graph capture (see _torch_ops.schedule_key); every other
    # GPU call recomputes it on its stream (a one-CTA kernel, capturable). So a reused
    # FlashMLASchedMeta is never stale there, even after the lengths changed (CUDA-graph replays with new
    # lengths included: tests/gpu/test_torch_ops_gpu.py).
    gpu_key = None
    if eager:
        on_device = True
        gpu_key = _torch_ops.eager_schedule_key(
            q, (cache_seqlens,) if topk is None else (topk_length, extra_topk_length))
    else:
        on_device = (not q.is_cpu) if use_torch else _on_device(q)
        if use_torch and on_device:
            gpu_key = _torch_ops.schedule_key(
                q, (cache_seqlens,) if topk is None else (topk_length, extra_topk_length))
    reuse = not use_jax and initialized and tsm is not None and (
        _torch_ops.same_schedule_key(old_gpu_key, gpu_key) if on_device else True)
    if reuse and use_torch and type(tsm) is not _torch_ops._Tensor and _ffi.framework_of(tsm) != "torch":
        # Filled by a call of another framework (NumPy, ...): the torch op takes torch tensors only. On
        # the CPU the lengths were checked above, so recomputing gives the same schedule.
        reuse = False
    if reuse and not on_device and _elsewhere(tsm):
        # Filled by a call on another device (a GPU, torch's meta device): the config holds no device, so
        # the call is a legal reuse, but the schedule is not in this call's memory. Recomputed here.
        reuse = False
    if use_torch:  # (a reusing call runs the *_scheduled op: no empty metadata outputs)
        meta_in = (tsm, old_splits) if reuse else (None, None)
    else:
        meta_in = (
            (_ffi.to_ffi(tsm, "tile_scheduler_metadata"), _ffi.to_ffi(old_splits, "num_splits"))
            if reuse
            else (None, None)
        )
    if topk is not None:
        if causal:
            raise _AssertValueError("causal: sparse decoding (indices given) does not support causal=True")
        if not is_fp8_kvcache:
            raise _AssertValueError(
                "is_fp8_kvcache: sparse decoding (indices given) needs an FP8 cache: pass is_fp8_kvcache=True")
        if eager:  # the TVM-FFI function on the torch tensors (outputs from torch's allocator, current stream)
            res = _torch_ops.eager_sparse_decode_fwd(
                q, k_cache, indices, topk_length, attn_sink, meta_in[0], meta_in[1], extra_k_cache,
                extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale)
        elif use_torch:
            res = (_torch_ops.sparse_decode_fwd_scheduled if reuse else _torch_ops.sparse_decode_fwd)(
                q, k_cache, indices, topk_length, attn_sink, meta_in[0], meta_in[1], extra_k_cache,
                extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale)
        elif use_jax:
            from . import _jax

            res = _jax.sparse_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                     extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale)
        else:
            try:
                with _ffi.stream_scope(q):
                    res = _ffi.lib.sparse_decode_fwd(
                        _ffi.to_ffi(q, "q"), _ffi.to_ffi(k_cache, "k_cache"), _ffi.to_ffi(indices, "indices"),
                        _ffi.to_ffi(topk_length, "topk_length"), _ffi.to_ffi(attn_sink, "attn_sink"), meta_in[0],
                        meta_in[1], _ffi.to_ffi(extra_k_cache, "extra_k_cache"),
                        _ffi.to_ffi(extra_indices_in_kvcache, "extra_indices_in_kvcache"),
                        _ffi.to_ffi(extra_topk_length, "extra_topk_length"), head_dim_v, softmax_scale,
                    )
            except RuntimeError:  # (a torch tensor on a device DLPack cannot carry: the error naming it)
                _ffi.raise_device_error("q", q, k_cache=k_cache, indices=indices, topk_length=topk_length,
                                        attn_sink=attn_sink, tile_scheduler_metadata=meta_in[0],
                                        num_splits=meta_in[1], extra_k_cache=extra_k_cache,
                                        extra_indices_in_kvcache=extra_indices_in_kvcache,
                                        extra_topk_length=extra_topk_length)
                raise
    else:
        if (attn_sink is not None or extra_k_cache is not None or extra_indices_in_kvcache is not None
                or topk_length is not None or extra_topk_length is not None):
            for name, val in (("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
                              ("extra_indices_in_kvcache", extra_indices_in_kvcache),
                              ("topk_length", topk_length), ("extra_topk_length", extra_topk_length)):
                if val is not None:
                    raise _AssertValueError(f"{name}: only supported by sparse decoding (pass indices), got a tensor")
        if block_table is None or cache_seqlens is None:
            raise _AssertValueError("block_table and cache_seqlens: required for dense decoding, got None")
        # is_fp8_kvcache is not used by dense decoding (FlashMLA's wrapper does not pass it on either, spec
        # §1.3 step 4): a BF16/FP16 cache runs as usual, an FP8 cache fails k_cache's dtype check (q's dtype).
        if eager:  # (as the sparse call above)
            res = _torch_ops.eager_dense_decode_fwd(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale,
                                                    causal, meta_in[0], meta_in[1])
        elif use_torch:
            res = (_torch_ops.dense_decode_fwd_scheduled if reuse else _torch_ops.dense_decode_fwd)(
                q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal, meta_in[0], meta_in[1])
        elif use_jax:
            from . import _jax

            res = _jax.dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)
        elif head_dim_v == 512 and _cupy.handles(q):  # outputs from CuPy's memory pool (flash_mla/_cupy.py)
            res = _cupy.dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                                     causal) + (None, None)
        else:
            try:
                with _ffi.stream_scope(q):
                    res = _ffi.lib.dense_decode_fwd(
                        _ffi.to_ffi(q, "q"), _ffi.to_ffi(k_cache, "k_cache"), head_dim_v,
                        _ffi.to_ffi(cache_seqlens, "cache_seqlens"), _ffi.to_ffi(block_table, "block_table"),
                        softmax_scale, causal, meta_in[0], meta_in[1],
                    )
            except RuntimeError:  # (as the sparse call above)
                _ffi.raise_device_error("q", q, k_cache=k_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                                        tile_scheduler_metadata=meta_in[0], num_splits=meta_in[1])
                raise
    if use_torch and reuse:
        out, lse = res
    elif use_torch or use_jax or res[2] is None:
        out, lse, tsm, splits = res  # (JAX, CuPy: the metadata stays inside the call, tsm = splits = None)
    else:
        out, lse, tsm, splits = (_ffi.from_ffi(t, q) for t in res)
    # Recorded for the fast path: a torch call that reused the schedule (so a second call repeating the first
    # records, and calls that never reuse -- new length tensors each time -- pay nothing for it). A torch.ops
    # call only where the eager route is out of the question: one that took the op because a mode or a subclass
    # intercepted it must not send the next plain call to the op.
    record_reuse = (reuse and use_torch and gpu_key is not None and extra_k_cache is None
                    and (eager or not _torch_ops.eager_possible(q)))
    args = (sched, generation, initialized, old_lengths, config_key, lengths, presence, host_lengths, reuse, tsm,
            splits if not reuse else None, gpu_key, (q_shape, k_shape, indices, causal, is_fp8_kvcache, eager)
            if record_reuse else None)
    if _compiling():
        _sched_record(*args)
    else:
        with _SCHED_LOCK:
            _sched_record(*args)
    return out, lse


def _compiling() -> bool:
    """True while torch.compile traces (False where the op library is not loaded)."""
    is_compiling = _torch_ops._is_compiling
    return is_compiling is not None and is_compiling()


def _sched_record(sched, generation, initialized, old_lengths, config_key, lengths, presence, host_lengths, reuse,
                  tsm, splits, gpu_key, reuse_args) -> None:
    """Records what a decode call established in its scheduler object (under _SCHED_LOCK), unless another call
    recorded since this one read the object (``generation``): then that call's config, lengths and schedule stay
    -- a schedule is never stored under the config or the lengths of another call -- and this call, whose
    results are its own, records nothing (a later call that differs from what is recorded raises or recomputes
    as usual)."""
    if sched._generation != generation:
        return
    changed = False
    if not initialized:
        sched.have_initialized = True
        sched.config = FlashMLASchedMeta.Config(*config_key)
        sched._config_key = config_key
        sched._lengths = lengths
        sched._presence = presence
        changed = True
    elif host_lengths and old_lengths is not None and any(
            old is None and new is not None for old, new in zip(old_lengths, lengths)):
        # A first call that could not read the lengths (JAX, GPU, torch.compile) leaves None; the first
        # call that can read them becomes the reference, so later CPU reuse is still checked.
        sched._lengths = tuple(new if old is None else old for old, new in zip(old_lengths, lengths))
        changed = True
    if not reuse:  # this call computed the schedule (a reusing call returns no metadata of its own)
        sched.tile_scheduler_metadata = tsm
        sched.num_splits = splits
        sched._gpu_key = gpu_key
        changed = True
    if changed:
        sched._generation = generation + 1
    sched._reuse = None if reuse_args is None else _reuse_record(sched, *reuse_args)


def _reuse_record(sched, q_shape, k_shape, indices, causal, is_fp8_kvcache, eager):
    """What the fast path of :func:`flash_mla_with_kvcache` needs to repeat a torch call that reused the schedule
    of ``sched`` (its schedule key ``sched._gpu_key``, outside a CUDA-graph capture, on the current device), or
    None.

    ``(torch.Tensor, (q.shape, k_cache.shape, indices.shape or None), (causal, is_fp8_kvcache), (length tensor,
    its version, its data pointer) of the key, q's device index, tile_scheduler_metadata, num_splits, the default softmax scale,
    the function that runs a reusing call, whether that is the eager TVM-FFI route)``. The reusing call's op is
    called without OpOverload's Python frame (``OpOverload.__call__`` is ``self._op(*args)``)."""
    key, tsm = sched._gpu_key, sched.tile_scheduler_metadata
    tensor = _torch_ops._Tensor
    if key is None or key[1] != 0 or type(tsm) is not tensor or (indices is not None and key[5] is not None):
        return None  # (in a capture, a schedule from another framework, extra_topk_length given: the full path)
    if key[0] >= 0 and key[0] != _torch_ops._cuda_current_device():
        return None  # (q on another device than the current one: the fast path checks the current one only)
    if indices is None:
        run = _torch_ops.eager_dense_decode_fwd if eager else _torch_ops._ops.dense_decode_fwd_scheduled
    else:
        run = _torch_ops.eager_sparse_decode_fwd if eager else _torch_ops._ops.sparse_decode_fwd_scheduled
    return (tensor, (q_shape, k_shape, None if indices is None else indices.shape), (causal, is_fp8_kvcache),
            key[2:5], key[0], tsm, sched.num_splits, _default_softmax_scale(q_shape[3]), getattr(run, "_op", run),
            eager)


def flash_mla_sparse_fwd(
    q: Any,
    kv: Any,
    indices: Any,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Any = None,
    topk_length: Any = None,
):
    """Sparse MLA prefill (FlashMLA's ``flash_mla_sparse_fwd``; spec §1.4, §2.4).

    ``q`` ``(s_q, h_q, d_qk)`` bf16 (d_qk 512 or 576); ``kv`` ``(s_kv, 1, d_qk)`` bf16;
    ``indices`` ``(s_q, 1, topk)`` int32 — a slot is invalid iff its index is < 0 or
    >= s_kv, or its position is >= ``topk_length[s]`` (optional ``(s_q,)`` int32);
    ``attn_sink`` optional ``(h_q,)`` float32 scales ``out`` only; ``d_v`` must be 512.

    Returns ``[out, max_logits, lse]``: ``out`` ``(s_q, h_q, 512)`` bf16, ``max_logits``
    and ``lse`` ``(s_q, h_q)`` float32 in natural units. Rows with no valid slot give
    ``out = 0``, ``lse = +inf``, ``max_logits = -inf``.

    Raises (each message names the argument): ``TypeError`` for a missing / non-tensor ``q``,
    ``kv`` or ``indices``, a wrong dtype or a missing / non-numeric ``sm_scale`` (strings, bytes and
    booleans included); ``ValueError`` for a NaN / infinite ``sm_scale``, wrong shapes, ``d_v`` other than 512, tensors on different devices or a non-contiguous
    last dimension.
    """
    tensor = _torch_ops._Tensor  # (None until the op library is loaded)
    plain = (type(q) is tensor and type(kv) is tensor and type(indices) is tensor
             and (attn_sink is None or type(attn_sink) is tensor) and (topk_length is None or type(topk_length) is tensor))
    if not plain and not (hasattr(q, "shape") and hasattr(kv, "shape") and hasattr(indices, "shape")):
        _require_tensors(q=q, kv=kv, indices=indices)  # raises, naming the argument
    if type(sm_scale) is not float or sm_scale - sm_scale != 0:  # (not finite: see _traceable_finite)
        sm_scale = _float_arg("sm_scale", sm_scale)  # (FlashMLA has no default: None is a TypeError)
    if type(d_v) is not int:
        d_v = _int_arg("d_v", d_v)
    if plain and not _torch_ops._is_compiling():
        # Plain torch tensors, eager (what _torch_ops.handles answers PLAIN for): the op's C function at once (the
        # one OpOverload.__call__ calls; the op checks everything else), its errors mapped as _torch_ops.call does.
        try:
            return list(_torch_ops._ops.sparse_prefill_fwd._op(q, kv, indices, sm_scale, d_v, attn_sink,
                                                                topk_length))
        except RuntimeError as e:
            mapped = _torch_ops.mapped_error(e)
            if mapped is None:
                raise
            raise mapped from None
    if plain or _torch_ops.handles(q, kv, indices, attn_sink, topk_length):
        return list(_torch_ops.sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length))
    if _ffi.framework_of(q) == "jax" and _jax_use_xla(q, kv=kv, indices=indices, attn_sink=attn_sink,
                                                       topk_length=topk_length):  # XLA custom call (works under jax.jit): _jax.py
        from . import _jax

        return _jax.sparse_prefill(q, kv, indices, float(sm_scale), int(d_v), attn_sink, topk_length)
    try:
        with _ffi.stream_scope(q):
            res = _ffi.lib.sparse_prefill_fwd(
                _ffi.to_ffi(q, "q"), _ffi.to_ffi(kv, "kv"), _ffi.to_ffi(indices, "indices"), float(sm_scale),
                int(d_v), _ffi.to_ffi(attn_sink, "attn_sink"), _ffi.to_ffi(topk_length, "topk_length"),
            )
    except RuntimeError:  # (a torch tensor on a device DLPack cannot carry: the error naming it)
        _ffi.raise_device_error("q", q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length)
        raise
    return [_ffi.from_ffi(t, q) for t in res]


# ----------------------------------------------------------------------------- dense MHA prefill
def _dense_prefill_check_flags(dropout_p: Any, deterministic: Any) -> None:
    """FlashMLA's ``assert dropout_p == 0.0`` and ``assert not deterministic`` (spec §1.5)."""
    deterministic = _bool_arg("deterministic", deterministic)
    if dropout_p != 0.0:
        raise _AssertValueError(f"dropout_p: dropout is not supported, expected 0.0, got {dropout_p!r}")
    if deterministic:
        raise _AssertValueError(
            "deterministic: FlashMLA's API takes deterministic=False only (the backward here is deterministic "
            "anyway: dq, dk and dv are bitwise reproducible)")


def _uniform_cu_seqlens(like: Any, b: int, s: int) -> Any:
    """int32 ``[0, s, 2s, ..., b*s]`` on the device and in the framework of ``like`` (is_varlen=False)."""
    fw = _ffi.framework_of(like)
    if fw == "torch":
        import torch

        return torch.arange(b + 1, dtype=torch.int32, device=like.device) * s
    host = np.arange(b + 1, dtype=np.int32) * np.int32(s)
    if fw == "jax":
        import jax.numpy as jnp

        return jnp.asarray(host)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(int(like.device.id)):
            return cupy.asarray(host)
    if fw == "paddle":
        import paddle

        return paddle.to_tensor(host, place=like.place)
    return host


# The packed-sequence arguments of the dense prefill have other names in some ways in: the core's,
# torch.ops.flash_mla's and flash_attn_varlen_func's are cu_seqlens_qo / cu_seqlens_kv / max_seqlen_qo / max_seqlen_kv
# (so a compiled call, whose errors surface from the op after this frame, names them as an eager one), flash_mla.cuda's
# cu_seqlens_q / cu_seqlens_kv / max_seqlen_q / max_seqlen_kv, and one cu_seqlens / max_seqlen in
# flash_attn_varlen_qkvpacked_func. Errors are raised again naming the arguments as the function the caller called
# names them: a tuple of the (cu_seqlens of q, of k, max_seqlen of q, of k) names.
_SEQLEN_ARG = re.compile(r"\b(cu_seqlens|max_seqlen)_(qo|kv|q|k)\b")
VARLEN_ARG_NAMES = ("cu_seqlens_qo", "cu_seqlens_kv", "max_seqlen_qo", "max_seqlen_kv")
QKVPACKED_ARG_NAMES = ("cu_seqlens", "cu_seqlens", "max_seqlen", "max_seqlen")
# The packed variants pass slices of the caller's tensor as q, k and v: their errors name that tensor instead
# (whole words only: h_q, d_qk, total_q and cu_seqlens_qo are left alone; "qkv / qkv" becomes "qkv").
_TENSOR_ARG = re.compile(r"(?<!\w)(q|k|v)(?!\w)")
_REPEATED_ARG = re.compile(r"\b(\w+) / \1\b")
QKVPACKED_TENSOR_NAMES = {"q": "qkv", "k": "qkv", "v": "qkv"}
KVPACKED_TENSOR_NAMES = {"k": "kv", "v": "kv"}


def call_naming_seqlens(names: Tuple[str, str, str, str], fn: Any, *args: Any, tensors: Optional[dict] = None) -> Any:
    """``fn(*args)``; a ValueError, TypeError or NotImplementedError whose message names a packed-sequence argument
    is raised again (same class) with that argument's name in ``names``, and, given ``tensors`` (the packed
    variants: ``{"k": "kv", "v": "kv"}``), with the tensors q / k / v named as the caller passed them
    (``total_q = q.shape[0]`` becomes ``total_q = qkv.shape[0]``). While torch.compile traces a call on torch
    tensors (``args[0]`` one): ``fn(*args)`` as it is for the unpacked function; for the packed variants, a failure
    is repeated on meta tensors of the same shapes, strides and dtypes (``_traced_call_error``) and the eager call's
    error raised after the try block."""
    if _ffi.framework_of(args[0]) == "torch":
        import torch

        if torch.compiler.is_compiling():
            if not tensors:
                return fn(*args)
            try:
                return fn(*args)
            except (RuntimeError, ValueError, TypeError, NotImplementedError):
                # A packed variant's bad input while Dynamo traces: the fake kernel's error (which Dynamo raises as a
                # RuntimeError of its own) or one of _dense_prefill_args names q / k / v and cu_seqlens_qo.
                err = _traced_call_error(names, tensors, *(_traced_spec(torch, a) for a in args[:5]), *args[5:10])
                if err is None:
                    raise
            # Raise what the eager call raises instead, outside the try block: Dynamo breaks the graph at this raise
            # (fullgraph=False) and raises it from the code after the break, or (fullgraph=True) fails naming it.
            raise _TRACED_ERROR_CLASSES[err[0]](err[1])
    try:
        return fn(*args)
    except (ValueError, TypeError, NotImplementedError) as e:
        msg = str(e)
        renamed = _named_as_called(msg, names, tensors)
        if renamed == msg:
            raise
        try:
            err = type(e)(renamed)
        except Exception:  # an exception class that does not take one message
            raise e from None
        raise err from None


def _named_as_called(msg: str, names: Tuple[str, str, str, str], tensors: Optional[dict]) -> str:
    """``msg`` with the packed-sequence arguments named as in ``names`` and, given ``tensors``, q / k / v named as the
    packed variant's caller passed them (see call_naming_seqlens)."""
    renamed = _SEQLEN_ARG.sub(lambda m: names[(2 if m.group(1) == "max_seqlen" else 0)
                                              + (1 if m.group(2) in ("k", "kv") else 0)], msg)
    if tensors:
        renamed = _TENSOR_ARG.sub(lambda m: tensors.get(m.group(1), m.group(1)), renamed)
        renamed = _REPEATED_ARG.sub(r"\1", renamed)
    return renamed


_TRACED_ERROR_CLASSES = {"ValueError": ValueError, "TypeError": TypeError, "NotImplementedError": NotImplementedError}


def _traced_spec(torch: Any, x: Any) -> Any:
    """A tensor argument as (shape, strides, dtype), what _traced_call_error rebuilds it from (Python constants for
    Dynamo when the sizes are static); anything else as it is."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), tuple(x.stride()), x.dtype
    return x


def _traced_call_error(names, tensors, q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv,
                       softmax_scale, causal, is_varlen) -> Optional[Tuple[str, str]]:
    """(class name, message) of the error that a packed variant's eager call raises for tensors of these
    (shape, strides, dtype) specs and these scalars, or None. Run by Dynamo as Python while it traces (marked
    constant below: its arguments are Python constants), only after the traced call failed: the call on meta tensors
    of the same specs runs the checks an eager call runs before reading data (the fake kernel's are the core's)."""
    import torch

    def meta(x):
        if isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], torch.dtype):
            return torch.empty_strided(x[0], x[1], dtype=x[2], device="meta")
        return x

    try:
        _dense_prefill(*(meta(x) for x in (q, k, v, cu_seqlens_qo, cu_seqlens_kv)), max_seqlen_qo, max_seqlen_kv,
                       softmax_scale, causal, is_varlen)
    except (ValueError, TypeError, NotImplementedError) as e:
        return type(e).__name__, _named_as_called(str(e), names, tensors)
    return None


# (torch._dynamo.assume_constant_result, as _make_flash_attn_varlen_function below)
_traced_call_error._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _dense_prefill_args(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale,
                        causal, is_varlen):
    """Checks and normalises the arguments shared by the forward and the backward; returns
    ``(cu_q, cu_k, max_q, max_k, scale, causal)``. With ``is_varlen=False`` every request has
    total / b tokens (FlashMLA's SM100 kernels ignore the values of cu_seqlens then; so does this):
    uniform cu_seqlens are made on q's device."""
    if not (hasattr(q, "shape") and hasattr(k, "shape") and hasattr(v, "shape") and hasattr(cu_seqlens_qo, "shape")
            and hasattr(cu_seqlens_kv, "shape")):
        _require_tensors(q=q, k=k, v=v, cu_seqlens_qo=cu_seqlens_qo, cu_seqlens_kv=cu_seqlens_kv)  # raises
    q_shape = q.shape
    if len(q_shape) != 3 or len(k.shape) != 3 or len(v.shape) != 3:
        for name, t, layout in (("q", q, "(total_q, h_q, d_qk)"), ("k", k, "(total_k, h_kv, d_qk)"),
                                ("v", v, "(total_k, h_kv, d_v)")):
            if len(t.shape) != 3:
                raise ValueError(f"{name}: expected a 3-D tensor {layout}, got shape {_shape(t)}")
    if softmax_scale is None:
        softmax_scale = _default_softmax_scale(q_shape[-1])
    scale = softmax_scale
    if type(scale) is not float or scale - scale != 0:  # (not finite: see _traceable_finite)
        scale = _float_arg("softmax_scale", scale)
    max_q, max_k = max_seqlen_qo, max_seqlen_kv
    if type(max_q) is not int:
        max_q = _int_arg("max_seqlen_qo", max_q)
    if type(max_k) is not int:
        max_k = _int_arg("max_seqlen_kv", max_k)
    cu_q, cu_k = cu_seqlens_qo, cu_seqlens_kv
    if not _bool_arg("is_varlen", is_varlen):
        if len(cu_q.shape) != 1 or int(cu_q.shape[0]) < 2:
            raise ValueError(f"cu_seqlens_qo: expected shape (b + 1,) with b >= 1, got {_shape(cu_q)}")
        b = int(cu_q.shape[0]) - 1
        total_q, total_k = int(q.shape[0]), int(k.shape[0])
        if total_q % b or total_k % b:
            raise ValueError(
                f"is_varlen=False: every request has the same length, so q.shape[0] = {total_q} and k.shape[0] = "
                f"{total_k} must be multiples of b = {b} (cu_seqlens_qo.shape[0] - 1)")
        max_q, max_k = total_q // b, total_k // b
        cu_q, cu_k = _uniform_cu_seqlens(q, b, max_q), _uniform_cu_seqlens(q, b, max_k)
    return cu_q, cu_k, max_q, max_k, scale, _bool_arg("causal", causal)


def _dense_prefill_fwd_call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    """One forward (no autograd) on the torch.ops or TVM-FFI path: ``(out, lse)`` in q's framework,
    lse ``(total_q, h_q)`` with strides ``(1, total_q)`` where the framework has strides."""
    if _torch_ops.handles(q, k, v, cu_q, cu_k):
        return tuple(_torch_ops.dense_prefill_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal))
    try:
        with _ffi.stream_scope(q):
            out, lse_t = _ffi.lib.dense_prefill_fwd(
                _ffi.to_ffi(q, "q"), _ffi.to_ffi(k, "k"), _ffi.to_ffi(v, "v"), _ffi.to_ffi(cu_q, "cu_seqlens_qo"),
                _ffi.to_ffi(cu_k, "cu_seqlens_kv"), max_q, max_k, scale, causal)
    except RuntimeError:  # (a torch tensor on a device DLPack cannot carry: the error naming it)
        _ffi.raise_device_error("q", q, k=k, v=v, cu_seqlens_qo=cu_q, cu_seqlens_kv=cu_k)
        raise
    lse_t = _ffi.from_ffi(lse_t, q)
    return _ffi.from_ffi(out, q), (lse_t.t() if _ffi.framework_of(q) == "torch" else lse_t.T)


def _dense_prefill_bwd_call(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
    """One backward on the torch.ops or TVM-FFI path: ``(dq, dk, dv)`` in q's framework."""
    if _torch_ops.handles(dout, q, k, v, out, lse, cu_q, cu_k):
        return tuple(_torch_ops.dense_prefill_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal))
    try:
        with _ffi.stream_scope(q):
            res = _ffi.lib.dense_prefill_bwd(
                _ffi.to_ffi(dout, "dout"), _ffi.to_ffi(q, "q"), _ffi.to_ffi(k, "k"), _ffi.to_ffi(v, "v"),
                _ffi.to_ffi(out, "out"), _ffi.to_ffi(lse, "lse"), _ffi.to_ffi(cu_q, "cu_seqlens_qo"),
                _ffi.to_ffi(cu_k, "cu_seqlens_kv"), max_q, max_k, scale, causal)
    except RuntimeError:  # (as the forward's)
        _ffi.raise_device_error("q", q, dout=dout, k=k, v=v, out=out, lse=lse, cu_seqlens_qo=cu_q,
                                cu_seqlens_kv=cu_k)
        raise
    return tuple(_ffi.from_ffi(t, q) for t in res)


_FlashAttnVarlenFunc = None


def _flash_attn_varlen_function():
    """FlashMLA's ``FlashAttnVarlenFunc`` (a torch.autograd.Function), made on first use so that
    flash_mla imports without torch."""
    # (called before the global is read: Dynamo keeps the value of a global it has read once in a trace)
    _make_flash_attn_varlen_function()
    return _FlashAttnVarlenFunc


def _make_flash_attn_varlen_function() -> bool:
    """Makes ``_FlashAttnVarlenFunc`` once; True. Marked constant for torch.compile (below), so that a first
    call inside a compiled region runs it eagerly: Dynamo cannot trace the class statement (a graph break, an
    error under fullgraph=True), and reads the global it set afterwards."""
    global _FlashAttnVarlenFunc
    if _FlashAttnVarlenFunc is None:
        import torch

        class FlashAttnVarlenFunc(torch.autograd.Function):
            """Dense varlen MHA prefill with autograd: ``out.backward(grad)`` fills q / k / v ``.grad``
            (GQA included); the gradient through lse is discarded, as in FlashMLA."""

            @staticmethod
            def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
                out, lse = _dense_prefill_fwd_call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
                ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
                ctx.scalars = (max_q, max_k, scale, causal)
                ctx.mark_non_differentiable(lse)
                return out, lse

            @staticmethod
            def backward(ctx, dout, dlse):
                del dlse  # not propagated (FlashMLA: "LSE doesn't support backward currently")
                q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
                dq, dk, dv = _dense_prefill_bwd_call(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k,
                                                     *ctx.scalars)
                if torch.is_grad_enabled():  # create_graph=True: a second derivative must raise, not be 0
                    dq, dk, dv = _torch_ops.once_differentiable_grads((dq, dk, dv), (dout, q, k, v))
                return dq, dk, dv, None, None, None, None, None, None

        _FlashAttnVarlenFunc = FlashAttnVarlenFunc
    return True


# (what torch._dynamo.assume_constant_result sets; set directly so that torch need not be imported here)
_make_flash_attn_varlen_function._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _distinct_tensors(*tensors):
    """The torch tensors with each repeat of an earlier one replaced by a view of it: one tensor given in two roles
    (one cu_seqlens for queries and keys, as qkvpacked always passes; q is k) is legal, but Dynamo refuses one
    tensor given twice to autograd.Function.apply ("duplicate tensor input"), which failed
    torch.compile(fullgraph=True). A view reads the same memory, and its gradient reaches the tensor."""
    out = list(tensors)
    for i in range(1, len(out)):
        if any(out[i] is out[j] for j in range(i)):
            out[i] = out[i].view_as(out[i])
    return out


def _dense_prefill(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale, causal,
                   is_varlen, names=VARLEN_ARG_NAMES, tensors=None):
    """The forward of the flash_attn_varlen_* functions (errors name the arguments flash_attn_varlen_func's way:
    the callers rename them as theirs, `names` and the packed variants' `tensors`; the XLA custom calls, whose value
    errors surface when a jitted function runs, after the caller's frame, are given both to use themselves)."""
    cu_q, cu_k, max_q, max_k, scale, causal = _dense_prefill_args(
        q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale, causal, is_varlen)
    fw = _ffi.framework_of(q)
    if fw == "torch":
        import torch

        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and isinstance(cu_q, torch.Tensor)
                and isinstance(cu_k, torch.Tensor)):
            # A call that mixes frameworks (a torch q with NumPy cu_seqlens, say), which the other operators take:
            # the autograd.Function below saves its inputs for the backward (torch tensors only) and
            # _distinct_tensors views repeated ones, so the others become torch tensors over their memory
            # (DLPack, zero-copy: what the TVM-FFI path reads), or a TypeError naming the argument.
            k, v, cu_q, cu_k = (t if isinstance(t, torch.Tensor) else _ffi.from_ffi(_ffi.to_ffi(t, name), q)
                                for name, t in (("k", k), ("v", v), ("cu_seqlens_qo", cu_q), ("cu_seqlens_kv", cu_k)))
        q, k, v, cu_q, cu_k = _distinct_tensors(q, k, v, cu_q, cu_k)
        return tuple(_flash_attn_varlen_function().apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal))
    if fw == "jax" and _jax_use_xla(q, k=k, v=v, cu_seqlens_qo=cu_q, cu_seqlens_kv=cu_k):
        from . import _jax  # XLA custom calls with a jax.custom_vjp (jax.grad, jax.jit)

        return _jax.dense_prefill(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, names, tensors)
    if fw == "paddle" and _paddle_needs_grad(q, k, v):
        return tuple(_paddle_flash_attn_varlen_layer().apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal))
    return _dense_prefill_fwd_call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)


def _paddle_needs_grad(*tensors) -> bool:
    """True when Paddle records gradients and one of the Paddle tensors among ``tensors`` wants one."""
    import paddle

    return paddle.is_grad_enabled() and any(isinstance(t, paddle.Tensor) and not t.stop_gradient for t in tensors)


_PaddleFlashAttnVarlen = None


def _paddle_flash_attn_varlen_layer():
    """A ``paddle.autograd.PyLayer`` for flash_attn_varlen_func (made on first use: flash_mla imports without
    Paddle): the forward on the TVM-FFI path, the backward :func:`flash_attn_varlen_backward`'s kernels; lse is
    not differentiable (as the torch and JAX paths)."""
    global _PaddleFlashAttnVarlen
    if _PaddleFlashAttnVarlen is None:
        import paddle

        class _Layer(paddle.autograd.PyLayer):
            @staticmethod
            def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
                out, lse = _dense_prefill_fwd_call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
                ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
                ctx.args = (max_q, max_k, scale, causal)
                ctx.wants = [isinstance(t, paddle.Tensor) and not t.stop_gradient for t in (q, k, v)]
                ctx.mark_non_differentiable(lse)
                return out, lse

            @staticmethod
            def backward(ctx, dout, _dlse):
                q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensor()
                if dout is None:
                    dout = paddle.zeros_like(out)
                grads = _dense_prefill_bwd_call(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
                # One gradient per tensor input; Paddle wants None for an input with stop_gradient (the int32
                # cu_seqlens always).
                return (*(g if w else None for g, w in zip(grads, ctx.wants)), None, None)

        _PaddleFlashAttnVarlen = _Layer
    return _PaddleFlashAttnVarlen


def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_qo: Any,
    cu_seqlens_kv: Any,
    max_seqlen_qo: int,
    max_seqlen_kv: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
    is_varlen: bool = True,
) -> Tuple[Any, Any]:
    """Dense varlen multi-head attention, forward with autograd (FlashMLA's ``flash_attn_varlen_func``;
    spec §1.5, §2.5).

    ``q`` ``(total_q, h_q, d_qk)``, ``k`` ``(total_k, h_kv, d_qk)``, ``v`` ``(total_k, h_kv, d_v)``:
    bfloat16 or float16 (one dtype), last dim contiguous, ``(d_qk, d_v)`` = ``(128, 128)`` or
    ``(192, 128)``; ``h_q`` a multiple of ``h_kv`` (GQA: query head h reads KV head
    ``h // (h_q // h_kv)``). ``cu_seqlens_qo`` / ``cu_seqlens_kv`` ``(b + 1,)`` int32 cumulative lengths
    (request i: rows ``cu[i]:cu[i+1]``; empty requests allowed) on q's device; ``max_seqlen_*`` at
    least every request's length. ``softmax_scale`` defaults to ``d_qk ** -0.5``. ``causal`` masks
    bottom-right aligned: key j is visible to query i of a request iff ``j <= i + s_k - s_q``.
    ``is_varlen=False``: every request has ``total / b`` tokens (b = ``len(cu_seqlens_qo) - 1``; the
    values of cu_seqlens are not used). ``dropout_p`` must be 0.0 and ``deterministic`` False
    (FlashMLA's asserts; AssertionError).

    Returns ``(out, lse)``: ``out`` ``(total_q, h_q, d_v)`` in q's dtype; ``lse`` ``(total_q, h_q)``
    float32 natural log with FlashMLA's strides ``(1, total_q)`` (torch). A query row that sees no
    key gives out 0 and lse -inf; a NaN in q or in a visible key / value gives NaN in that row.

    Gradients: torch tensors go through a ``torch.autograd.Function`` (``out.backward(g)`` fills
    ``q.grad``, ``k.grad``, ``v.grad``; GQA included, which FlashMLA's SM100 backward rejects); JAX
    arrays through a ``jax.custom_vjp`` (``jax.grad``, ``jax.jit``); Paddle tensors that want a gradient
    (``stop_gradient=False``, outside ``paddle.no_grad()``) through a ``paddle.autograd.PyLayer``
    (``loss.backward()`` fills ``.grad``); NumPy and CuPy call :func:`flash_attn_varlen_backward`. The
    gradient through ``lse`` is not propagated. The backward is deterministic (bitwise equal dq / dk / dv
    across runs) and not differentiable itself: with ``create_graph=True`` the gradients it returns raise
    RuntimeError ("... differentiate twice ...")
    when a second backward reaches them, instead of counting as constants. Memory: the outputs, one workspace and, in
    the backward, dq / dk / dv. The workspace is 0 bytes for the forward and on the CPU; the Hopper backward's holds
    two float32 rows per (request, query head), ``8 * b * h_q * ceil(max_seqlen_qo / 64) * 64`` bytes (the lse in base
    2 and rowsum(dout * out)). The CPU reference's float32 scratch is
    about (512 + 32 * h_q / h_kv) * (d_qk + d_v) * 4 bytes per thread, independent of the sequence lengths.

    Raises (each message names the argument): ``TypeError`` for non-tensors, wrong dtypes and flags
    (``causal``, ``is_varlen``, ``deterministic``) given as strings, bytes or containers;
    ``ValueError`` for wrong shapes, unsupported head dims ("no kernel for d_qk=… d_v=…"),
    ``h_q % h_kv != 0``, tensors on different devices, a non-contiguous last dim, and on the CPU
    cu_seqlens values that do not start at 0, decrease, do not end at total_q / total_k or exceed
    max_seqlen; ``NotImplementedError`` for GPU tensors without the Hopper backend.
    """
    _dense_prefill_check_flags(dropout_p, deterministic)
    return call_naming_seqlens(VARLEN_ARG_NAMES, _dense_prefill, q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo,
                               max_seqlen_kv, softmax_scale, causal, is_varlen)


def _packed_head_dim(head_dim_qk: Any, packed: Any, name: str, parts: int) -> int:
    """``head_dim_qk`` of a packed variant as an int that splits ``packed`` (last dim: ``parts`` head dims of
    q / k, then v) into non-empty pieces; ValueError naming it otherwise (a negative one would slice from the
    end and could run on a wrong split, one too large would leave v empty)."""
    d = _int_arg("head_dim_qk", head_dim_qk)
    width = int(packed.shape[2])
    if not 0 < parts * d < width:
        times = f"{parts} * " if parts > 1 else ""
        raise ValueError(f"head_dim_qk: expected 0 < {times}head_dim_qk < {name}.shape[2] = {width}, got {d}")
    return d


def flash_attn_varlen_qkvpacked_func(
    qkv: Any,
    cu_seqlens: Any,
    max_seqlen: int,
    head_dim_qk: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
    is_varlen: bool = True,
) -> Tuple[Any, Any]:
    """:func:`flash_attn_varlen_func` on one packed tensor ``qkv`` ``(total, h, 2 * head_dim_qk + d_v)``:
    q = ``qkv[:, :, :head_dim_qk]``, k = ``qkv[:, :, head_dim_qk:2 * head_dim_qk]``,
    v = ``qkv[:, :, 2 * head_dim_qk:]``, with one ``cu_seqlens`` / ``max_seqlen`` for queries and keys.
    Gradients flow back into ``qkv``. Returns ``(out, lse)``; errors as flash_attn_varlen_func, naming ``qkv``
    where that names q, k or v (``cu_seqlens[b] = 9 must equal total_q = qkv.shape[0] = 10 ...``), and ValueError
    unless ``0 < 2 * head_dim_qk < qkv.shape[2]``."""
    _dense_prefill_check_flags(dropout_p, deterministic)
    _require_tensors(qkv=qkv)
    if len(qkv.shape) != 3:
        raise ValueError(f"qkv: expected a 3-D tensor (total, h, 2 * head_dim_qk + d_v), got shape {_shape(qkv)}")
    d = _packed_head_dim(head_dim_qk, qkv, "qkv", 2)
    return call_naming_seqlens(QKVPACKED_ARG_NAMES, _dense_prefill, qkv[:, :, :d], qkv[:, :, d:2 * d],
                               qkv[:, :, 2 * d:], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, causal,
                               is_varlen, QKVPACKED_ARG_NAMES, QKVPACKED_TENSOR_NAMES, tensors=QKVPACKED_TENSOR_NAMES)


def flash_attn_varlen_kvpacked_func(
    q: Any,
    kv: Any,
    cu_seqlens_qo: Any,
    cu_seqlens_kv: Any,
    max_seqlen_qo: int,
    max_seqlen_kv: int,
    head_dim_qk: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
    is_varlen: bool = True,
) -> Tuple[Any, Any]:
    """:func:`flash_attn_varlen_func` with k and v packed in ``kv`` ``(total_k, h_kv, head_dim_qk + d_v)``:
    k = ``kv[:, :, :head_dim_qk]``, v = ``kv[:, :, head_dim_qk:]``. Gradients flow back into ``kv``.
    Returns ``(out, lse)``; errors as flash_attn_varlen_func, naming ``kv`` where that names k or v
    (``total_k = kv.shape[0]``), and ValueError unless ``0 < head_dim_qk < kv.shape[2]`` and
    ``head_dim_qk == q.shape[2]``."""
    _dense_prefill_check_flags(dropout_p, deterministic)
    _require_tensors(kv=kv)
    if len(kv.shape) != 3:
        raise ValueError(f"kv: expected a 3-D tensor (total_k, h_kv, head_dim_qk + d_v), got shape {_shape(kv)}")
    d = _packed_head_dim(head_dim_qk, kv, "kv", 1)
    if hasattr(q, "shape") and len(q.shape) == 3 and int(q.shape[2]) != d:  # (k's last dim: named as given)
        raise ValueError(f"head_dim_qk: expected q's head dim d_qk = q.shape[2] = {int(q.shape[2])}, got {d}")
    return call_naming_seqlens(VARLEN_ARG_NAMES, _dense_prefill, q, kv[:, :, :d], kv[:, :, d:], cu_seqlens_qo,
                               cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale, causal, is_varlen,
                               VARLEN_ARG_NAMES, KVPACKED_TENSOR_NAMES, tensors=KVPACKED_TENSOR_NAMES)


def flash_attn_varlen_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    cu_seqlens_qo: Any,
    cu_seqlens_kv: Any,
    max_seqlen_qo: int,
    max_seqlen_kv: int,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_varlen: bool = True,
) -> Tuple[Any, Any, Any]:
    """Backward of :func:`flash_attn_varlen_func` as a plain function (any framework; what NumPy, CuPy
    and Paddle callers use): ``dout`` ``(total_q, h_q, d_v)`` and the forward's ``out`` / ``lse``
    (as it returned them) with its other arguments. Returns ``(dq, dk, dv)`` shaped and typed like
    q, k, v. With P = softmax of the scaled scores (from ``lse``) and D = rowsum(dout * out):
    dv = P^T dout, dS = P (dout v^T - D), dq = scale dS k, dk = scale dS^T q, summed over the
    query heads of each KV head. Deterministic. Errors as flash_attn_varlen_func."""
    return call_naming_seqlens(VARLEN_ARG_NAMES, _dense_prefill_bwd, dout, q, k, v, out, lse, cu_seqlens_qo,
                               cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale, causal, is_varlen)


def _dense_prefill_bwd(dout, q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv,
                       softmax_scale, causal, is_varlen):
    _require_tensors(dout=dout, out=out, lse=lse)
    cu_q, cu_k, max_q, max_k, scale, causal = _dense_prefill_args(
        q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale, causal, is_varlen)
    if _ffi.framework_of(q) == "jax" and _jax_use_xla(q, dout=dout, k=k, v=v, out=out, lse=lse, cu_seqlens_qo=cu_q,
                                                       cu_seqlens_kv=cu_k):
        from . import _jax

        return _jax.dense_prefill_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal,
                                      VARLEN_ARG_NAMES)
    return _dense_prefill_bwd_call(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, out=None,
                               lse=None, causal=False, softmax_scale=None, is_varlen=True):
    """FlashMLA's private forward helper (no autograd): ``(out, lse)``; given ``out`` / ``lse``
    (torch) are filled and returned."""
    return call_naming_seqlens(VARLEN_ARG_NAMES, _dense_prefill_into, q, k, v, cu_seqlens_qo, cu_seqlens_kv,
                               max_seqlen_qo, max_seqlen_kv, out, lse, causal, softmax_scale, is_varlen)


def _dense_prefill_into(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, out, lse, causal,
                        softmax_scale, is_varlen):
    cu_q, cu_k, max_q, max_k, scale, causal = _dense_prefill_args(
        q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale, causal, is_varlen)
    res = _dense_prefill_fwd_call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
    return _into(("out", "lse"), (out, lse), res)


def _flash_attn_varlen_backward(do, q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv,
                                dq=None, dk=None, dv=None, causal=False, softmax_scale=None, is_varlen=True):
    """FlashMLA's private backward helper: ``(dq, dk, dv)``; given ``dq`` / ``dk`` / ``dv`` (torch)
    are filled and returned. GQA is supported (FlashMLA raises ValueError for it)."""
    res = flash_attn_varlen_backward(do, q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo,
                                     max_seqlen_kv, softmax_scale=softmax_scale, causal=causal, is_varlen=is_varlen)
    return _into(("dq", "dk", "dv"), (dq, dk, dv), res)


def _check_destinations(names, given, results):
    """ValueError naming the first caller-given destination whose shape or dtype is not its result's (None:
    not given), then the first one whose elements overlap each other (a stride-0 / expanded view: the copy into
    it would fail in torch, or write one element twice), then the first two that share an element (one tensor
    given as dk and dv: the second copy overwrote the first, a silent wrong answer). Disjoint views of one
    buffer, FlashMLA's kvpacked form (``dk = dkv[:, 0]``, ``dv = dkv[:, 1]``, or ``dkv[..., :d]`` and
    ``dkv[..., d:]``), share no element and are fine: the results are copied from buffers of their own, so unlike
    the core's outputs (whose byte ranges must be disjoint) interleaved destinations are exact. Every
    destination is checked before any is written, so a bad one leaves all untouched."""
    for name, g, r in zip(names, given, results):
        if g is not None and (tuple(g.shape) != tuple(r.shape) or g.dtype != r.dtype):
            raise ValueError(f"{name}: expected a {r.dtype} tensor of shape {tuple(r.shape)}, got "
                             f"{getattr(g, 'dtype', type(g).__name__)} {tuple(g.shape)}")
    named = [(name, g) for name, g in zip(names, given) if g is not None]
    for name, g in named:
        if _self_overlapping(g):
            raise ValueError(f"{name}: the destination's elements overlap (shape {tuple(g.shape)}, strides "
                             f"{tuple(g.stride())}: an expanded / stride-0 or self-overlapping view); pass a tensor "
                             "whose elements have distinct addresses")
    for i, (a_name, a) in enumerate(named):
        for b_name, b in named[:i]:
            if _share_elements(b, a):
                raise ValueError(f"{b_name} and {a_name}: the destinations share memory (the same tensor, or "
                                 "overlapping views); pass separate tensors (disjoint views of one buffer are fine)")


def _dims(t):
    """``[(stride, size)]`` of the dims of size > 1 of a strided tensor, in elements, by increasing stride."""
    return sorted((int(st), int(sz)) for sz, st in zip(t.shape, t.stride()) if int(sz) > 1)


def _offsets(dims):
    """Every element offset of the lattice ``dims`` (``[(stride, size)]``), NumPy int64."""
    offs = np.zeros(1, np.int64)
    for st, sz in dims:
        offs = (offs[:, None] + np.arange(sz, dtype=np.int64) * st).ravel()
    return offs


def _self_overlapping(t) -> bool:
    """True if two elements of a strided tensor (non-negative strides, as torch's) are at one address. The core's
    rule for outputs (src/core/validate.cpp check_output_layout: by increasing stride, each stride at least the
    extent of the smaller ones) proves most layouts free of overlap; a stride 0 of a dim of size > 1 is an
    overlap; any other layout (strides that interleave, such as (2, 3) for shape (3, 2)) is decided exactly by
    listing its element offsets."""
    dims = _dims(t)
    extent = 1
    for st, sz in dims:
        if st < extent:
            break
        extent += st * (sz - 1)
    else:
        return False
    if any(st == 0 for st, _ in dims):
        return True
    offs = _offsets(dims)
    return np.unique(offs).size != offs.size


def _share_elements(a, b) -> bool:
    """True if two strided tensors, each free of internal overlap, have a byte in common. Tensors on different
    devices, on torch's meta device (no memory) or empty share nothing; nor do tensors whose byte ranges are
    disjoint. Two views with one element size and the same stride in each dim of size > 1 (the views of one
    buffer that FlashMLA's packed forms pass) are decided by a search over the difference of their base
    offsets (:func:`_lattice_meets`); other pairs by listing the contiguous runs of both."""
    if a.device != b.device or a.device.type == "meta" or a.numel() == 0 or b.numel() == 0:
        return False
    es_a, es_b = a.element_size(), b.element_size()
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    da, db = _dims(a), _dims(b)
    hi_a = lo_a + (sum(st * (sz - 1) for st, sz in da) + 1) * es_a
    hi_b = lo_b + (sum(st * (sz - 1) for st, sz in db) + 1) * es_b
    if hi_a <= lo_b or hi_b <= lo_a:
        return False
    if es_a == es_b and (lo_b - lo_a) % es_a == 0 and len(a.shape) == len(b.shape):
        ranges = []  # (stride, lowest, highest multiple of it in b - a), per dim
        for na, nb, sa, sb in zip(a.shape, b.shape, a.stride(), b.stride()):
            na, nb, sa, sb = int(na), int(nb), int(sa), int(sb)
            if na > 1 and nb > 1 and sa != sb:
                break
            if na > 1 or nb > 1:
                ranges.append((sa if na > 1 else sb, -(nb - 1), na - 1))
        else:
            found = (_lattice_meets((lo_b - lo_a) // es_a, sorted(ranges)) if all(r[0] > 0 for r in ranges)
                     else None)
            if found is not None:
                return found
    return _runs_meet(a, da, lo_a, es_a, b, db, lo_b, es_b)


def _lattice_meets(delta, ranges, budget=4096):
    """Whether ``delta = sum(j_k * s_k)`` has a solution with ``lo_k <= j_k <= hi_k`` (``ranges``:
    ``[(s_k, lo_k, hi_k)]`` by increasing stride): element ``x`` of a and ``y`` of b at one address, ``j = x - y``
    per dim. A depth-first search from the largest stride, keeping what is left within the reach of the smaller
    ones: at most two choices a dim for layouts that pass the core's rule. None when the search takes more than
    ``budget`` steps (the caller then lists offsets)."""
    reach_lo, reach_hi = [0], [0]  # reach of dims [0, k)
    for s, lo, hi in ranges:
        reach_lo.append(reach_lo[-1] + s * lo)
        reach_hi.append(reach_hi[-1] + s * hi)
    steps = 0
    stack = [(len(ranges), delta)]
    while stack:
        k, r = stack.pop()
        if k == 0:
            if r == 0:
                return True
            continue
        steps += 1
        if steps > budget:
            return None
        s, lo, hi = ranges[k - 1]
        # r - j * s within [reach_lo[k - 1], reach_hi[k - 1]]
        j_lo = max(lo, -((reach_hi[k - 1] - r) // s))
        j_hi = min(hi, (r - reach_lo[k - 1]) // s)
        stack.extend((k - 1, r - j * s) for j in range(j_lo, j_hi + 1))
    return False


def _runs_meet(a, da, lo_a, es_a, b, db, lo_b, es_b) -> bool:
    """Whether two strided tensors share a byte, by listing their contiguous runs (the inner dims that are
    contiguous merged into one run): byte intervals, sorted, overlap iff one starts before the end of an earlier
    one."""
    starts, ends = [], []
    for dims, lo, es in ((da, lo_a, es_a), (db, lo_b, es_b)):
        run, k = 1, 0
        while k < len(dims) and dims[k][0] == run:
            run *= dims[k][1]
            k += 1
        s = lo + _offsets(dims[k:]) * es
        starts.append(s)
        ends.append(s + run * es)
    starts, ends = np.concatenate(starts), np.concatenate(ends)
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    return bool(np.any(starts[1:] < ends[:-1]))


def _into(names, given, results):
    """Copy results into caller-given torch tensors (FlashMLA's preallocated-output arguments)."""
    if all(g is None for g in given):
        return tuple(results)
    if _ffi.framework_of(results[0]) != "torch":
        raise TypeError(f"{', '.join(names)}: preallocated outputs are supported for torch tensors only")
    _check_destinations(names, given, results)
    out = []
    for g, r in zip(given, results):
        if g is None:
            out.append(r)
            continue
        g.copy_(r)
        out.append(g)
    return tuple(out)
