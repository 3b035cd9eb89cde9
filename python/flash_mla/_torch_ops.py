"""The PyTorch way in: ``torch.ops.flash_mla.*``, a native op library on torch's stable ABI.

``libflashmla_torch.so`` (bindings/torch/ops.cpp) registers the ops below with CPU kernels
(the reference backend) and, in CUDA builds, CUDA kernels (the sm90 backend). This module
loads it, registers their fake (meta) kernels for torch.compile / FakeTensor, and offers
the helpers that :mod:`flash_mla.flash_mla_interface` uses to send torch tensors here
(everything else goes through TVM-FFI, :mod:`flash_mla._ffi`).

Ops (schemas in ops.cpp):
  dense_decode_fwd, sparse_decode_fwd -> (out, lse, tile_scheduler_metadata, num_splits)
      (the last two are the schedule the call computed, or empty when the caller passed one)
  dense_decode_fwd_scheduled, sparse_decode_fwd_scheduled -> (out, lse)
      (the same with the schedule of an earlier call required: what a call that reuses a
      FlashMLASchedMeta runs, without the two empty outputs)
  sparse_prefill_fwd                  -> (out, max_logits, lse)
  dense_prefill_fwd                   -> (out, lse); lse (total_q, h_q) with FlashMLA's strides (1, total_q);
                                         differentiable in q, k, v (torch.library.register_autograd)
  dense_prefill_bwd                   -> (dq, dk, dv)
  quantize_kv_cache, dequantize_kv_cache (write into their second argument; CPU tensors)

The op library reports the core's error classes as a ``[flash_mla:<Class>]`` prefix of a
RuntimeError (the stable ABI cannot choose Python exception classes); :func:`call` re-raises
them as ValueError / TypeError / NotImplementedError with the plain message, so both ways in
raise the same exceptions.

Eager TVM-FFI route (internal, off by default): once :func:`set_eager_route` switched it on, eager decode calls
on CUDA (:func:`route` answers :data:`EAGER`) skip the op library: when every tensor is a plain ``torch.Tensor``
on CUDA, nothing traces (torch.compile) and no dispatch, torch-function or functorch mode is active,
``flash_mla_with_kvcache`` calls the TVM-FFI function of the same C++ core directly
(:func:`eager_dense_decode_fwd`, :func:`eager_sparse_decode_fwd`), as FlashMLA calls its pybind11 extension.
It is off by default because its outputs come back through DLPack: torch's ``Tensor.record_stream`` is a no-op
on them (a program that hands them to another stream could see their memory reused early) and eager calls
leave no ``flash_mla::`` op in profiler traces; measured on the H200 host it saved 1.8 us of a 41 us
public-API call (docs/host-path.md). The host-overhead benchmarks switch it on to compare the two routes.

Environment, read once when the op library loads (never per call): ``FLASHMLA_DISABLE_TORCH_OPS=1`` sends
torch tensors through TVM-FFI always (no op library); ``FLASHMLA_TORCH_LIB`` names the op library to load
instead of the package's own.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Any, Optional

_LIB_NAME = "libflashmla_torch.so"
_state: dict = {"loaded": None, "error": None}
# Set by load() once the op library is loaded: the torch module (so that calls need no import
# statement), torch.Tensor, and the OpOverloads that the entry points call (one attribute chain
# through torch.ops, resolved once).
_torch: Any = None
_Tensor: Any = None
_ops: Any = None
# torch's current CUDA device and whether the current stream is capturing (the C functions behind
# torch.cuda.current_device / is_current_stream_capturing, bound once; schedule_key asks both on every
# CUDA call), or the public functions where a torch build lacks the former.
_cuda_current_device: Any = None
_cuda_capturing: Any = None

# route(): what a public decode call on torch tensors runs. OPS: torch.ops.flash_mla (torch.compile, FakeTensor,
# dispatch and torch-function modes, functorch transforms, tensor subclasses, CPU and meta tensors); EAGER: the
# TVM-FFI function of the same C++ core, called directly (plain CUDA tensors, nothing intercepting the call).
OPS, EAGER = 1, 2
# handles() of arguments that are all exactly torch.Tensor (or None).
PLAIN = 2
# _eager_route: whether the EAGER route is on (set_eager_route; off by default). Set by _bind(): whether it can
# be on in this process (_eager_available: a CUDA build, torch's C-level mode queries present), torch's checks
# for what could intercept a call (bound once), and the TVM-FFI decode functions with tvm_ffi's element getter
# of the array they return.
_eager_route = False
_eager_available = False
_is_compiling: Any = None
_dispatch_stack_len: Any = None
_function_mode_enabled: Any = None
_function_stack_len: Any = None
_function_stack_at: Any = None
_device_context: Any = None
_functorch_interpreter: Any = None
_ffi_dense_decode: Any = None
_ffi_sparse_decode: Any = None
_ffi_item: Any = None
_ERROR_CLASSES = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "NotImplementedError": NotImplementedError,
    "RuntimeError": RuntimeError,
}
_PREFIX = re.compile(r"\[flash_mla:(\w+)\] ")


def library_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.environ.get("FLASHMLA_TORCH_LIB", os.path.join(here, _LIB_NAME))


def load() -> bool:
    """Load the op library once (needs torch); True if ``torch.ops.flash_mla`` is usable."""
    if _state["loaded"] is not None:
        return _state["loaded"]
    ok = False
    if os.environ.get("FLASHMLA_DISABLE_TORCH_OPS", "") not in ("", "0"):
        _state["error"] = "disabled by FLASHMLA_DISABLE_TORCH_OPS"
    elif not os.path.exists(library_path()):
        _state["error"] = f"{library_path()} not found (package built without torch)"
    else:
        try:
            import torch

            torch.ops.load_library(library_path())
            _register_fakes(torch)
            _bind(torch)
            ok = True
        except Exception as e:  # an incompatible torch (older than the ABI target) etc.
            _state["error"] = f"{type(e).__name__}: {e}"
    _state["loaded"] = ok
    return ok


# torch.compile: Dynamo runs load() eagerly and treats its result as a constant (what
# torch._dynamo.assume_constant_result does; set directly so torch need not be imported here).
# So the first call of a public function may happen inside a compiled region, fullgraph included.
load._dynamo_marked_constant = True  # type: ignore[attr-defined]


class _Ops:
    """The OpOverloads of torch.ops.flash_mla that the entry points call."""

    def __init__(self, torch: Any) -> None:
        ns = torch.ops.flash_mla
        for name in ("dense_decode_fwd", "dense_decode_fwd_scheduled", "sparse_decode_fwd",
                     "sparse_decode_fwd_scheduled", "sparse_prefill_fwd", "dense_prefill_fwd", "dense_prefill_bwd",
                     "quantize_kv_cache", "dequantize_kv_cache"):
            setattr(self, name, getattr(ns, name).default)


def _bind(torch: Any) -> None:
    global _torch, _Tensor, _ops, _cuda_current_device, _cuda_capturing
    global _is_compiling
    _ops = _Ops(torch)
    _torch, _Tensor = torch, torch.Tensor
    _is_compiling = torch.compiler.is_compiling
    # (torch.cuda.current_device() is _lazy_init() + this; a CUDA tensor in hand means CUDA is initialised)
    _cuda_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    _cuda_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
    _bind_eager(torch)


def _bind_eager(torch: Any) -> None:
    """Bind what the EAGER route (module docstring) needs, once. The route cannot be switched on without CUDA
    kernels in this build (both routes would raise the same NotImplementedError), or where this torch or
    tvm_ffi lacks one of the functions below; it stays off until :func:`set_eager_route` switches it on."""
    global _eager_route, _eager_available, _dispatch_stack_len, _function_mode_enabled, _function_stack_len
    global _function_stack_at, _device_context, _functorch_interpreter, _ffi_dense_decode, _ffi_sparse_decode
    global _ffi_item
    _eager_route = _eager_available = False
    try:
        from torch.utils._device import DeviceContext
        from tvm_ffi import _ffi_api

        from . import _ffi

        _dispatch_stack_len = torch._C._len_torch_dispatch_stack  # TorchDispatchModes, infra modes included
        _function_mode_enabled = torch._C._is_torch_function_mode_enabled
        _function_stack_len = torch._C._len_torch_function_stack
        _function_stack_at = torch._C._get_function_stack_at
        _functorch_interpreter = torch._C._functorch.peek_interpreter_stack  # vmap / grad / functionalize
        _device_context = DeviceContext
        _ffi_dense_decode = _ffi.lib.dense_decode_fwd
        _ffi_sparse_decode = _ffi.lib.sparse_decode_fwd
        _ffi_item = _ffi_api.ArrayGetItem  # (one element, no len() and no Python __getitem__ frames)
        has_cuda = _ffi.has_cuda_backend()
    except Exception as e:  # noqa: BLE001 - an older / different torch or tvm_ffi: torch.ops for everything
        _state["eager"] = f"off: {type(e).__name__}: {e}"
        return
    if not has_cuda:
        _state["eager"] = "off: this build has no CUDA kernels"
    else:
        _eager_available = True
        _state["eager"] = _EAGER_OFF


_EAGER_OFF = "off: not switched on (set_eager_route(True))"


def eager_route_state() -> str:
    """Whether eager CUDA decode calls take the TVM-FFI route in this process ("on") or why not ("off: ...")."""
    load()
    return _state.get("eager", "off: " + str(_state["error"]))


def set_eager_route(enabled: bool) -> None:
    """Switch the EAGER route of torch decode calls (module docstring) on or off for this process; off by default.

    An internal switch for the host-overhead benchmarks and their tests (bench/bench_call_overhead.py,
    tools/host_path_layers.py ``--eager-route``), not part of the public API. It takes effect from the next call,
    including calls that reuse a ``FlashMLASchedMeta`` (their fast path re-routes). ``enabled`` must be a bool
    (else TypeError). Switching it on raises RuntimeError, with the reason (:func:`eager_route_state`), where the
    route cannot exist: no op library, no CUDA kernels in this build, or a torch / tvm_ffi without the functions
    it needs. Switching it off always succeeds.
    """
    global _eager_route
    if type(enabled) is not bool:
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    load()
    if enabled and not _eager_available:
        raise RuntimeError(f"the eager TVM-FFI route is unavailable in this process ({eager_route_state()})")
    _eager_route = enabled
    if _eager_available:
        _state["eager"] = "on" if enabled else _EAGER_OFF


def available() -> bool:
    """True if torch is installed and the op library loads (``torch.ops.flash_mla`` exists)."""
    return load()


def load_error() -> Optional[str]:
    """Why :func:`available` is False (None when it is True or not tried yet)."""
    return _state["error"]


def handles(*tensors: Any) -> Any:
    """True if every non-None argument is a torch.Tensor and the op library is loaded: :data:`PLAIN` (a true
    value) when each is exactly ``torch.Tensor`` (no subclass), True when some are subclasses, else False.

    Only then does a public function take the torch.ops path (or, for a decode, :func:`route`'s EAGER
    one); mixed frameworks, NumPy, JAX, ... keep the TVM-FFI path. (torch is never imported here: a
    torch.Tensor implies it is.)
    """
    # No sys.modules lookup here: this runs inside torch.compile, and Dynamo tracing a read of
    # sys.modules can fail ("dictionary changed size during iteration"). Before the op library is
    # loaded, a tensor whose type lives in a torch module loads it (cheap to test without importing
    # torch for other frameworks); once loaded, any torch.Tensor counts, a user's subclass included.
    tensor = _Tensor
    if tensor is not None:  # (the op library is loaded) the common case first: plain tensors and None
        seen = False
        for t in tensors:
            if t is not None:
                if type(t) is not tensor:
                    break
                seen = True
        else:
            return PLAIN if seen else False
    for first in tensors:
        if first is not None:
            break
    else:
        return False
    if tensor is None:  # the op library is not loaded (yet)
        mod = type(first).__module__
        if mod != "torch" and not mod.startswith("torch."):
            return False
        import torch  # (imported already: `first` is a torch object)

        tensor = torch.Tensor
    for t in tensors:
        if t is not None and not isinstance(t, tensor):
            return False
    return load()


def route(*tensors: Any) -> int:
    """How a public decode call runs for its tensor arguments (q first; None for absent ones): 0 when they
    are not all torch tensors (TVM-FFI or XLA), else :data:`OPS` or :data:`EAGER` (module docstring).

    EAGER needs every tensor of exact type ``torch.Tensor`` (:func:`handles`; a subclass -- FakeTensor,
    FunctionalTensor, DTensor, a user's -- may intercept the op), the route on in this process, q on CUDA and
    nothing that may intercept the op (:func:`intercepted`). The other tensors' devices are the core's to check:
    a CPU tensor among them fails its same-device check, a meta one the DLPack export; either way the eager
    function then answers as the op does (:func:`eager_dense_decode_fwd`).
    """
    kind = handles(*tensors)
    if not kind:
        return 0
    if kind is not PLAIN or not _eager_route or not tensors[0].is_cuda:
        return OPS
    # (intercepted(), its common answer inline: one Python call less per decode call)
    if _is_compiling() or _dispatch_stack_len() or _functorch_interpreter() is not None or (
            _function_mode_enabled() and intercepted()):
        return OPS
    return EAGER


def eager_possible(q: Any) -> bool:
    """True when a decode call with this q may take the EAGER route: the route on (set_eager_route) and q on CUDA."""
    return _eager_route and q.is_cuda


def intercepted() -> bool:
    """True when something may intercept a torch op called here: torch.compile tracing, a TorchDispatchMode
    (FakeTensorMode, ProxyTorchDispatchMode and other infra modes included), a TorchFunctionMode other than
    the DeviceContext of ``torch.set_default_device`` / ``with torch.device(...)`` (it changes the device of
    factory functions only), or a functorch transform (vmap, grad, functionalize). C-level queries of torch's
    thread-local state, bound once; under torch.compile the first one is a constant of the trace."""
    return _is_compiling() or mode_active()


def mode_active() -> bool:
    """:func:`intercepted` less its torch.compile check (for callers that made it already): a dispatch mode, a
    torch-function mode other than a DeviceContext, or a functorch transform is active."""
    if _dispatch_stack_len() or _functorch_interpreter() is not None:
        return True
    if _function_mode_enabled():
        for i in range(_function_stack_len()):
            if type(_function_stack_at(i)) is not _device_context:
                return True
    return False


def eager_dense_decode_fwd(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal, tsm,
                           num_splits):
    """The EAGER route of a dense decode: the TVM-FFI function on the torch tensors themselves (TVM-FFI takes
    them through torch's DLPack exchange API, launches on torch's current stream of q's device and allocates
    the outputs and the workspace through torch's allocator, i.e. its caching allocator on that stream).
    Returns ``(out, lse)`` when given a schedule, else ``(out, lse, tile_scheduler_metadata, num_splits)``,
    torch tensors. On any error the op runs instead and answers: its error (class and message; the core's
    validation raised it before any launch) or, where only TVM-FFI's DLPack export failed (a meta tensor among
    CUDA ones), its result."""
    try:
        res = _ffi_dense_decode(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal, tsm,
                                num_splits)
    except Exception:
        return (dense_decode_fwd if tsm is None else dense_decode_fwd_scheduled)(
            q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal, tsm, num_splits)
    item = _ffi_item
    if tsm is None:
        return item(res, 0), item(res, 1), item(res, 2), item(res, 3)
    return item(res, 0), item(res, 1)


def eager_sparse_decode_fwd(q, k_cache, indices, topk_length, attn_sink, tsm, num_splits, extra_k_cache,
                            extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale):
    """The EAGER route of a sparse decode; as :func:`eager_dense_decode_fwd`."""
    try:
        res = _ffi_sparse_decode(q, k_cache, indices, topk_length, attn_sink, tsm, num_splits, extra_k_cache,
                                 extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale)
    except Exception:
        return (sparse_decode_fwd if tsm is None else sparse_decode_fwd_scheduled)(
            q, k_cache, indices, topk_length, attn_sink, tsm, num_splits, extra_k_cache, extra_indices_in_kvcache,
            extra_topk_length, head_dim_v, softmax_scale)
    item = _ffi_item
    if tsm is None:
        return item(res, 0), item(res, 1), item(res, 2), item(res, 3)
    return item(res, 0), item(res, 1)


def call(op: Any, *args: Any) -> Any:
    """Run ``op(*args)``; a ``[flash_mla:<Class>]`` RuntimeError is re-raised as that class."""
    torch = _torch
    if torch is None:
        import torch
    if torch.compiler.is_compiling():
        try:
            return op(*args)
        except RuntimeError as e:
            # The fake kernel's error while Dynamo traces (its TorchRuntimeError) or the op's own, which Dynamo raises
            # as a hard error wherever no traced frame handles it: raised again as a plain RuntimeError, Dynamo instead
            # breaks the graph (fullgraph=False) and runs the call eagerly, which raises the error of an eager call
            # (class and names). Other RuntimeErrors (e.g. the tracer's data-dependent guards) pass unchanged.
            if type(e).__name__ != "TorchRuntimeError" and mapped_error(e) is None:
                raise
            raise RuntimeError(*e.args) from None
    try:
        return op(*args)
    except RuntimeError as e:
        mapped = mapped_error(e)
        if mapped is None:
            raise
        raise mapped from None


def mapped_error(e: RuntimeError) -> Optional[Exception]:
    """The exception that a ``[flash_mla:<Class>] message`` RuntimeError of the op library stands for (that class,
    the plain message), or None for any other RuntimeError."""
    msg = str(e)
    m = _PREFIX.search(msg)
    if m is None:
        return None
    cls = _ERROR_CLASSES.get(m.group(1), RuntimeError)
    text = msg[m.end():]
    # torch may append a C++ backtrace / "Exception raised from" trailer; keep the message line(s).
    for marker in ("\nException raised from", "\nFrame "):
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    return cls(text.rstrip())


def host_copy(x: Any):
    """NumPy copy of a small CPU int tensor (None for device tensors and while compiling)."""
    if x is None or not x.is_cpu:
        return None
    torch = _torch
    if torch is None:
        import torch
    if torch.compiler.is_compiling():
        return None
    try:
        return x.detach().numpy().copy()
    except Exception:  # unsupported dtype: the op reports it, naming the argument
        return None


def on_device(x: Any) -> bool:
    return not x.is_cpu


def schedule_key(q: Any, lengths: tuple) -> Optional[tuple]:
    """Key under which a split schedule computed on the GPU may be reused, or None (never reuse).

    A schedule depends on the values of the length tensors (``cache_seqlens``, or ``topk_length``
    and ``extra_topk_length``), which live on the GPU and are never read back. Its key holds each
    length tensor itself (identity, compared with ``is``; the reference keeps it alive, so its
    memory cannot be handed to another tensor meanwhile), its version counter (bumped by every
    in-place write through torch: ``copy_``, ``fill_``, indexing) and its data pointer (which
    ``t.data = other`` and ``torch.utils.swap_tensors`` change without a version bump), q's device, and the id of the
    CUDA-graph capture in progress (0 outside one): a schedule computed inside a capture is
    recomputed by every replay of that graph, so only calls of the same capture reuse it, and
    one computed outside a capture is never baked into a graph. Under torch.compile nothing is
    reused (the op stays functional), nor for length tensors made under ``torch.inference_mode()``
    (inference tensors have no version counter: reading ``_version`` raises, and their in-place
    writes could not be seen). Writes that bypass torch's dispatcher (Triton or other custom
    kernels, ``.data``, a DLPack alias, a CUDA-graph replay) do not bump the version either:
    reuse then needs unchanged values, as in FlashMLA.
    """
    torch = _torch
    if torch is None:
        import torch
    if torch.compiler.is_compiling():
        return None
    return eager_schedule_key(q, lengths)


def eager_schedule_key(q: Any, lengths: tuple) -> Optional[tuple]:
    """:func:`schedule_key` of a call known not to be traced by torch.compile (the EAGER route checked it)."""
    dev = q.get_device()
    key: Any
    try:  # (an inference tensor has no version counter: reading _version raises)
        if len(lengths) == 1 and lengths[0] is not None:  # dense decode: (cache_seqlens,)
            t = lengths[0]
            key = (dev, 0, t, t._version, t.data_ptr())
        else:
            key = (dev, 0)
            for t in lengths:
                key += (None, 0, 0) if t is None else (t, t._version, t.data_ptr())
    except RuntimeError:
        return None
    if dev >= 0 and (dev != (_cuda_current_device or _torch.cuda.current_device)()
                     or (_cuda_capturing or _torch.cuda.is_current_stream_capturing)()):
        from . import _ffi  # (the fast check above only sees the current device's stream)

        key = (dev, int(_ffi.lib.stream_capture_id(_torch.cuda.current_stream(dev).cuda_stream))) + key[2:]
    return key


def same_schedule_key(a: Optional[tuple], b: Optional[tuple]) -> bool:
    """True if two :func:`schedule_key` keys are both set and name the same tensors at the same versions."""
    if a is None or b is None or len(a) != len(b) or a[0] != b[0] or a[1] != b[1]:
        return False
    for i in range(2, len(a), 3):  # (tensor, version, data pointer) per length tensor
        if a[i] is not b[i] or a[i + 1] != b[i + 1] or a[i + 2] != b[i + 2]:
            return False
    return True


def once_differentiable_grads(grads: tuple, inputs: tuple) -> tuple:
    """The gradients a dense prefill backward computed, made safe for ``create_graph=True``.

    The backward op has no backward of its own. When autograd records the backward (``create_graph=True``, e.g.
    a gradient penalty) and any tensor it read requires grad, plain results would look constant to autograd:
    a second-order term through them would silently count as zero (or fail later with "does not require grad"
    where the penalty is the whole loss). Then the results are returned as aliases whose backward raises
    RuntimeError ("... differentiate twice ..."), as ``torch.autograd.function.once_differentiable`` does; unlike
    that decorator this also looks at the saved q / k / v, not only at the incoming gradient (which is constant
    for ``out.sum()``). Otherwise (the common case: no create_graph) the results come back unchanged."""
    torch = _torch
    if torch is None:  # (torch tensors without the op library: FlashAttnVarlenFunc over TVM-FFI)
        import torch
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
        return grads
    err = torch._C._functions.DelayedError(
        b"flash_mla dense prefill: trying to differentiate twice (double backward / create_graph=True through "
        b"flash_attn_varlen_func); its backward is not differentiable", len(grads))
    return err(*[g.detach().requires_grad_() for g in grads])


# ----------------------------------------------------------------------------- fake kernels
_NUM_SMS: dict = {}
# DLPack's device type of the CPU: the dense prefill's shapes-only check (dense_prefill_check) applies the CPU's
# rules, which hold on every device (a CUDA placement adds only the GPU-support check, answered when the op runs).
_DL_CPU = 1


def _num_sms(device: Any) -> int:
    """SMs of a CUDA device; the reference backend's worker count on the CPU (as the core's num_sms)."""
    key = (device.type, device.index)
    if key not in _NUM_SMS:
        if device.type == "cuda":
            import torch

            _NUM_SMS[key] = int(torch.cuda.get_device_properties(device).multi_processor_count)
        else:
            from . import _ffi

            _NUM_SMS[key] = _ffi.reference_num_threads()
    return _NUM_SMS[key]


def _dense_num_sm_parts(torch, num_sms, s_q, h_q, h_kv):
    rows = s_q * (h_q // h_kv)
    return torch.sym_max(num_sms // h_kv // ((rows + 63) // 64), 1)


def _sparse_num_sm_parts(torch, num_sms, s_q, h_q):
    return torch.sym_max(num_sms // s_q // torch.sym_max(h_q // 64, 1), 1)


def _decode_outputs(torch, q, out_dtype, head_dim_v, num_sm_parts, metadata_given, lse_transposed):
    """Output shapes of a decode op; given metadata is not returned again (empty (0, 8) and (0,)). lse has the
    op's strides (bindings/common/op_params.h decode_lse_transposed): FlashMLA's (s_q * h_q, 1, h_q) for sparse decode
    and dense decode with h_kv == 1 (``lse_transposed``), contiguous otherwise."""
    b, s_q, h_q = q.shape[0], q.shape[1], q.shape[2]
    lse_stride = (s_q * h_q, 1, h_q) if lse_transposed else (s_q * h_q, s_q, 1)
    return (
        q.new_empty((b, s_q, h_q, head_dim_v), dtype=out_dtype),
        torch.empty_strided((b, h_q, s_q), lse_stride, dtype=torch.float32, device=q.device),
        q.new_empty((0 if metadata_given else num_sm_parts, 8), dtype=torch.int32),
        q.new_empty((0 if metadata_given else b + 1,), dtype=torch.int32),
    )


def _check_same_device(q_name: str, q: Any, **tensors: Any) -> None:
    """The core's device rule (src/core/validate.cpp check_same_device) in the fake kernels.

    A call with one tensor on the ``meta`` device and the rest on the CPU (or CUDA) is routed by
    torch's dispatcher to these fake kernels, which would otherwise return uninitialised outputs
    (a silent wrong answer for a mixed-device call): raise the core's ValueError instead. Under torch.compile every fake
    tensor shares q's device and this passes.
    """
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {q_name} is on {q.device}: all tensors must be on the "
                             "same device")


def _size_hint(x: Any) -> Any:
    """A size or scalar as a plain number for the core's checks: ints and floats as they are, a symbolic one
    (torch.compile with dynamic shapes) as its example value, read without installing a guard (the check must not
    specialise the graph); None for a symbolic value without one (an unbacked size)."""
    if isinstance(x, (int, float)):  # (bool included)
        return x
    node = getattr(x, "node", None)
    return node.hint if node is not None and node.has_hint() else None


def _abstract_spec(*tensors: Any) -> Optional[tuple]:
    """(shapes, dtype names) of the tensors (None = absent: an empty dtype name), what the core's shapes-only checks
    take (bindings/tvm_ffi/module.cpp ``*_check``), or None when a size has no example value."""
    shapes, dtypes = [], []
    for t in tensors:
        if t is None:
            shapes.append([])
            dtypes.append("")
            continue
        shape = [_size_hint(d) for d in t.shape]
        if None in shape:
            return None
        shapes.append(shape)
        dtypes.append(str(t.dtype).removeprefix("torch."))  # ("torch.bfloat16" -> "bfloat16", as DLPack spells it)
    return shapes, dtypes


def _check_inputs(check: Any, tensors: tuple, *scalars: Any) -> None:
    """The core's validation of an operator's inputs, shapes and dtypes only, in a fake (meta) kernel.

    ``check`` is the TVM-FFI module's ``<op>_check`` (the one the JAX path runs while tracing): the core's own rules
    (src/core/validate.cpp: dtypes, ranks, shapes, head dims, h_q % h_kv, cu_seqlens dtype / rank / length, ...) on
    tensors without data, raising the ValueError / TypeError / NotImplementedError and message of a CPU call. So
    FakeTensor, the meta device, torch.compile and torch.export reject bad input while tracing instead of returning
    outputs of a call that fails when it runs. Checked as on the CPU: the GPU's extra rules (16-byte aligned data
    pointers and strides) need data, and the values (lengths, indices, cu_seqlens) are read when the op runs.
    Skipped where a size or scalar is symbolic without an example value."""
    spec = _abstract_spec(*tensors)
    values = [_size_hint(x) for x in scalars]
    if spec is None or None in values:
        return
    check(*spec, *values)


def _check_last_dim_contiguous(**tensors: Any) -> None:
    """The core's rule that q, k and v have a contiguous last dimension (src/core/validate.cpp
    check_last_dim_contiguous: stride 1 unless empty or of size 1), which its shapes-only check cannot see: strides need
    no data, so the fake kernel raises the CPU call's ValueError. Read without guards (as _size_hint); skipped where a
    size or stride is symbolic without an example value."""
    for name, t in tensors.items():
        if t is None or t.dim() == 0:
            continue
        numel, last, stride = _size_hint(t.numel()), _size_hint(t.shape[-1]), _size_hint(t.stride(-1))
        if None not in (numel, last, stride) and numel != 0 and last != 1 and stride != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got stride {stride}")


def _register_fakes(torch) -> None:
    from . import _ffi

    lib = "flash_mla::"
    ffi = _ffi.lib

    @torch.library.register_fake(lib + "dense_decode_fwd")
    def _dense_decode_fake(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal,
                           tile_scheduler_metadata=None, num_splits=None):
        _check_same_device("q", q, k_cache=k_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                           tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits)
        _check_inputs(ffi.dense_decode_check, (q, k_cache, block_table, cache_seqlens), head_dim_v, softmax_scale,
                      causal)
        parts = _dense_num_sm_parts(torch, _num_sms(q.device), q.shape[1], q.shape[2], k_cache.shape[2])
        return _decode_outputs(torch, q, q.dtype, head_dim_v, parts, tile_scheduler_metadata is not None,
                               k_cache.shape[2] == 1)

    @torch.library.register_fake(lib + "dense_decode_fwd_scheduled")
    def _dense_decode_scheduled_fake(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal,
                                     tile_scheduler_metadata, num_splits):
        _check_same_device("q", q, k_cache=k_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                           tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits)
        _check_inputs(ffi.dense_decode_check, (q, k_cache, block_table, cache_seqlens), head_dim_v, softmax_scale,
                      causal)
        return _decode_outputs(torch, q, q.dtype, head_dim_v, 0, True, k_cache.shape[2] == 1)[:2]

    @torch.library.register_fake(lib + "sparse_decode_fwd")
    def _sparse_decode_fake(q, k_cache, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits,
                            extra_k_cache, extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale):
        _check_same_device("q", q, k_cache=k_cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                           tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits,
                           extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices_in_kvcache,
                           extra_topk_length=extra_topk_length)
        _check_inputs(ffi.sparse_decode_check, (q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                                extra_indices_in_kvcache, extra_topk_length), head_dim_v, softmax_scale)
        parts = _sparse_num_sm_parts(torch, _num_sms(q.device), q.shape[1], q.shape[2])
        return _decode_outputs(torch, q, torch.bfloat16, head_dim_v, parts, tile_scheduler_metadata is not None,
                               True)

    @torch.library.register_fake(lib + "sparse_decode_fwd_scheduled")
    def _sparse_decode_scheduled_fake(q, k_cache, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits,
                                      extra_k_cache, extra_indices_in_kvcache, extra_topk_length, head_dim_v,
                                      softmax_scale):
        _check_same_device("q", q, k_cache=k_cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                           tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits,
                           extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices_in_kvcache,
                           extra_topk_length=extra_topk_length)
        _check_inputs(ffi.sparse_decode_check, (q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                                extra_indices_in_kvcache, extra_topk_length), head_dim_v, softmax_scale)
        return _decode_outputs(torch, q, torch.bfloat16, head_dim_v, 0, True, True)[:2]

    @torch.library.register_fake(lib + "sparse_prefill_fwd")
    def _sparse_prefill_fake(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        _check_same_device("q", q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length)
        _check_inputs(ffi.sparse_prefill_check, (q, kv, indices, attn_sink, topk_length), sm_scale, d_v)
        s_q, h_q = q.shape[0], q.shape[1]
        return (
            q.new_empty((s_q, h_q, d_v), dtype=torch.bfloat16),
            q.new_empty((s_q, h_q), dtype=torch.float32),
            q.new_empty((s_q, h_q), dtype=torch.float32),
        )

    @torch.library.register_fake(lib + "dense_prefill_fwd")
    def _dense_prefill_fake(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale, causal):
        _check_same_device("q", q, k=k, v=v, cu_seqlens_qo=cu_seqlens_qo, cu_seqlens_kv=cu_seqlens_kv)
        _check_inputs(functools.partial(ffi.dense_prefill_check, False, _DL_CPU, 0),
                      (q, k, v, cu_seqlens_qo, cu_seqlens_kv), max_seqlen_qo, max_seqlen_kv, softmax_scale, causal)
        _check_last_dim_contiguous(q=q, k=k, v=v)
        total_q, h_q = q.shape[0], q.shape[1]
        out = q.new_empty((total_q, h_q, v.shape[2]))
        lse = torch.empty_strided((total_q, h_q), (1, torch.sym_max(total_q, 1)), dtype=torch.float32,
                                  device=q.device)
        return out, lse

    @torch.library.register_fake(lib + "dense_prefill_bwd")
    def _dense_prefill_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv,
                                softmax_scale, causal):
        _check_same_device("q", q, dout=dout, k=k, v=v, out=out, lse=lse, cu_seqlens_qo=cu_seqlens_qo,
                           cu_seqlens_kv=cu_seqlens_kv)
        _check_inputs(functools.partial(ffi.dense_prefill_check, True, _DL_CPU, 0),
                      (dout, q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv), max_seqlen_qo, max_seqlen_kv,
                      softmax_scale, causal)
        _check_last_dim_contiguous(q=q, k=k, v=v, out=out, dout=dout)  # the core's order
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _dense_prefill_setup(ctx, inputs, output):
        q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale, causal = inputs
        out, lse = output
        # lse carries no gradient (as FlashMLA's FlashAttnVarlenFunc marks it): a loss of lse alone raises instead of
        # giving zero gradients for q, k and v.
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv)
        ctx.scalars = (max_seqlen_qo, max_seqlen_kv, softmax_scale, causal)

    def _dense_prefill_backward(ctx, dout, dlse):
        # The gradient through lse is not propagated (as FlashMLA's FlashAttnVarlenFunc).
        q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = call(torch.ops.flash_mla.dense_prefill_bwd.default,
                          dout.contiguous(), q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv, *ctx.scalars)
        dq, dk, dv = once_differentiable_grads((dq, dk, dv), (dout, q, k, v))
        return dq, dk, dv, None, None, None, None, None, None

    torch.library.register_autograd(lib + "dense_prefill_fwd", _dense_prefill_backward,
                                    setup_context=_dense_prefill_setup)

    # The attention ops have no backward and, as FlashMLA's, outputs that never require grad. Without an
    # Autograd kernel torch's fallback gives them a grad_fn whose backward only warns ("silently
    # incorrect") and leaves q.grad None. A fallthrough kernel (C++, no per-call cost; a Python autograd
    # kernel from register_autograd costs ~3 us a call) skips autograd for them, as torch's warning advises.
    impl = torch.library.Library("flash_mla", "IMPL")
    # (dense_prefill_bwd: no double backward; its outputs do not require grad either.)
    for name in ("dense_decode_fwd", "dense_decode_fwd_scheduled", "sparse_decode_fwd", "sparse_decode_fwd_scheduled",
                 "sparse_prefill_fwd", "dense_prefill_bwd"):
        impl.impl(name, torch.library.fallthrough_kernel, "Autograd")
    _state["autograd_impl"] = impl  # the registrations live as long as this object

    @torch.library.register_fake(lib + "quantize_kv_cache")
    def _quantize_fake(kv_cache, packed, format):
        _check_same_device("kv_cache", kv_cache, packed=packed)
        return None

    @torch.library.register_fake(lib + "dequantize_kv_cache")
    def _dequantize_fake(packed, kv_cache, format):
        _check_same_device("packed", packed, kv_cache=kv_cache)
        return None


# ----------------------------------------------------------------------------- entry points
def dense_decode_fwd(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal, tsm, num_splits):
    return call(_ops.dense_decode_fwd, q, k_cache, head_dim_v, cache_seqlens, block_table,
                softmax_scale, causal, tsm, num_splits)


def dense_decode_fwd_scheduled(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal, tsm,
                               num_splits):
    return call(_ops.dense_decode_fwd_scheduled, q, k_cache, head_dim_v, cache_seqlens, block_table,
                softmax_scale, causal, tsm, num_splits)


def sparse_decode_fwd(q, k_cache, indices, topk_length, attn_sink, tsm, num_splits, extra_k_cache,
                      extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale):
    return call(_ops.sparse_decode_fwd, q, k_cache, indices, topk_length, attn_sink, tsm,
                num_splits, extra_k_cache, extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale)


def sparse_decode_fwd_scheduled(q, k_cache, indices, topk_length, attn_sink, tsm, num_splits, extra_k_cache,
                                extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale):
    return call(_ops.sparse_decode_fwd_scheduled, q, k_cache, indices, topk_length, attn_sink, tsm,
                num_splits, extra_k_cache, extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale)


def sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    return call(_ops.sparse_prefill_fwd, q, kv, indices, sm_scale, d_v, attn_sink,
                topk_length)


def dense_prefill_fwd(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, softmax_scale, causal):
    return call(_ops.dense_prefill_fwd, q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo,
                max_seqlen_kv, softmax_scale, causal)


def dense_prefill_bwd(dout, q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv,
                      softmax_scale, causal):
    return call(_ops.dense_prefill_bwd, dout, q, k, v, out, lse, cu_seqlens_qo, cu_seqlens_kv,
                max_seqlen_qo, max_seqlen_kv, softmax_scale, causal)


def quantize_kv_cache(kv_cache, packed, fmt):
    return call(_ops.quantize_kv_cache, kv_cache, packed, fmt)


def dequantize_kv_cache(packed, kv_cache, fmt):
    return call(_ops.dequantize_kv_cache, packed, kv_cache, fmt)


if "torch" in sys.modules:  # torch imported first: register torch.ops.flash_mla right away
    load()
