"""The eager route of torch decode calls (flash_mla._torch_ops.route, docs/host-path.md), on the CPU.

Eager ``flash_mla_with_kvcache`` calls on plain CUDA tensors run the TVM-FFI function of the C++ core
instead of ``torch.ops.flash_mla``; everything that may intercept a torch op keeps the op. Here, without
a GPU: the interception checks themselves (dispatch modes, infra modes, torch-function modes, functorch,
torch.compile), that CPU, meta and subclass tensors keep the op, and the eager functions
(``_torch_ops.eager_*_decode_fwd``: the TVM-FFI function on torch tensors, the outputs converted back
through torch's DLPack exchange API) on CPU tensors against the op: bit-identical results, the schedule
passed back in, the same error class and message for every torch dtype and for bad shapes.
tests/gpu/test_torch_eager_route_gpu.py runs the route itself on CUDA tensors.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flash_mla  # noqa: E402
from flash_mla import _torch_ops  # noqa: E402
from mla_test_utils import BF16, count_torch_calls, gen_dense_case, gen_sparse_decode_case  # noqa: E402,F401

if not _torch_ops.available():
    if os.environ.get("FLASHMLA_REQUIRE_TORCH_OPS", "") not in ("", "0"):
        raise RuntimeError(f"torch.ops.flash_mla is required but unavailable: {_torch_ops.load_error()}")
    pytest.skip(f"torch.ops.flash_mla unavailable: {_torch_ops.load_error()}", allow_module_level=True)

from torch.overrides import TorchFunctionMode  # noqa: E402
from test_torch_ops import T  # noqa: E402  (NumPy -> torch, the torch.ops tests' helper)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class PassThroughDispatch(TorchDispatchMode):
    """Records the ops it sees and runs them."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class PassThroughFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class MyTensor(torch.Tensor):
    """A tensor subclass that changes nothing (the op still sees it through __torch_function__)."""


def dense_case(rng):
    return gen_dense_case(rng, b=3, s_q=1, h_q=16, h_kv=1, d=576, s_k=150, dtype=BF16, varlen=True, causal=False,
                          zero=[False, True, False], noncontig=True)


def dense_op_args(c):
    """The op's argument order (q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal)."""
    scale = c.softmax_scale if c.softmax_scale is not None else c.q.shape[-1] ** -0.5
    return (T(c.q), T(c.k_cache), 512, T(c.cache_seqlens), T(c.block_table), scale, bool(c.causal))


# ----------------------------------------------------------------------------- what may intercept a call
def test_eager_route_state_is_reported():
    state = _torch_ops.eager_route_state()
    assert state == "on" or state.startswith("off: ")
    if not flash_mla.has_cuda_backend():
        assert state == "off: this build has no CUDA kernels"


def test_nothing_intercepts_a_plain_call():
    assert _torch_ops.intercepted() is False
    with torch.device("cpu"):  # the DeviceContext TorchFunctionMode of torch.set_default_device: not an interceptor
        assert torch._C._is_torch_function_mode_enabled()
        assert _torch_ops.intercepted() is False
    with torch.inference_mode(), torch.no_grad():
        assert _torch_ops.intercepted() is False


def test_dispatch_modes_intercept():
    with PassThroughDispatch():
        assert _torch_ops.intercepted() is True
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # an infra mode
        assert _torch_ops.intercepted() is True
    assert _torch_ops.intercepted() is False


def test_function_modes_intercept():
    with PassThroughFunction():
        assert _torch_ops.intercepted() is True
    with torch.device("cpu"), PassThroughFunction():  # a DeviceContext does not hide another mode
        assert _torch_ops.intercepted() is True
    with PassThroughFunction(), torch.device("cpu"):
        assert _torch_ops.intercepted() is True


def test_functorch_transforms_intercept():
    seen = []

    def f(x):
        seen.append(_torch_ops.intercepted())
        return x * 2

    torch.func.vmap(f)(torch.ones(3, 2))
    torch.func.grad(lambda x: f(x).sum())(torch.ones(3))
    assert seen == [True, True]


def test_torch_compile_intercepts():
    def f(x):
        return x + 1 if _torch_ops.intercepted() else x - 1

    x = torch.zeros(2)
    assert torch.equal(f(x), x - 1)
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x + 1)


def test_handles_tells_plain_tensors(rng):
    c = dense_case(rng)
    q, k = T(c.q), T(c.k_cache)
    assert _torch_ops.handles(q, k, None) is _torch_ops.PLAIN and _torch_ops.handles(q, k) is _torch_ops.PLAIN
    assert _torch_ops.handles(q.as_subclass(MyTensor), k, None) is True
    assert _torch_ops.handles(np.asarray(c.q), k) is False and _torch_ops.handles(None, None) is False


def test_route_of_cpu_meta_and_subclass_tensors(rng):
    c = dense_case(rng)
    q, k, bt, sl = T(c.q), T(c.k_cache), T(c.block_table), T(c.cache_seqlens)
    nones = (None,) * 6
    assert _torch_ops.route(q, k, bt, sl, *nones) == _torch_ops.OPS  # CPU: the op (the reference backend)
    assert _torch_ops.route(q.to("meta"), k.to("meta"), bt.to("meta"), sl.to("meta"), *nones) == _torch_ops.OPS
    assert _torch_ops.route(q.as_subclass(MyTensor), k, bt, sl, *nones) == _torch_ops.OPS
    assert _torch_ops.route(np.asarray(c.q), k, bt, sl, *nones) == 0  # mixed frameworks: TVM-FFI
    assert _torch_ops.route(np.asarray(c.q), None, None, None, *nones) == 0


def test_dispatch_mode_sees_the_public_call(rng, count_torch_calls):
    """A public call under a TorchDispatchMode reaches the mode as flash_mla.dense_decode_fwd."""
    c = dense_case(rng)
    q, k, bt, sl = T(c.q), T(c.k_cache), T(c.block_table), T(c.cache_seqlens)
    ref = flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, flash_mla.get_mla_metadata()[0], None, c.softmax_scale)
    mode = PassThroughDispatch()
    with mode:
        out, lse = flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, flash_mla.get_mla_metadata()[0], None,
                                                    c.softmax_scale)
    assert "flash_mla.dense_decode_fwd.default" in mode.seen
    assert torch.equal(out.view(torch.int16), ref[0].view(torch.int16)) and torch.equal(lse, ref[1])


def test_subclass_takes_the_op(rng, count_torch_calls):
    c = dense_case(rng)
    q = T(c.q).as_subclass(MyTensor)
    flash_mla.flash_mla_with_kvcache(q, T(c.k_cache), T(c.block_table), T(c.cache_seqlens), 512,
                                     flash_mla.get_mla_metadata()[0])
    assert count_torch_calls == ["flash_mla.dense_decode_fwd.default"]


@pytest.fixture
def restore_eager_route():
    was_on, was_available, was_state = _torch_ops._eager_route, _torch_ops._eager_available, _torch_ops._state["eager"]
    yield
    _torch_ops._eager_route, _torch_ops._eager_available = was_on, was_available
    _torch_ops._state["eager"] = was_state


def test_route_is_off_by_default_and_ignores_the_environment():
    """Off in a fresh process, whatever the environment says (no variable switches it; set_eager_route does)."""
    code = ("import torch, flash_mla; from flash_mla import _torch_ops; print(_torch_ops.eager_route_state()); "
            "print(_torch_ops._eager_route); print(flash_mla.has_cuda_backend())")
    env = dict(os.environ, FLASHMLA_EAGER_TVM_FFI="1")  # (no environment variable switches the route)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    state, on, has_cuda = res.stdout.split("\n")[:3]
    assert on == "False"
    assert state == ("off: not switched on (set_eager_route(True))" if has_cuda == "True"
                     else "off: this build has no CUDA kernels")


def test_set_eager_route_switches_the_route(restore_eager_route):
    """set_eager_route(True) turns the route on where it can exist (forced here: _eager_available), False turns it
    off; the state reports it. CPU tensors keep the op either way (the route needs q on CUDA)."""
    _torch_ops._eager_available = True
    _torch_ops.set_eager_route(True)
    assert _torch_ops._eager_route is True and _torch_ops.eager_route_state() == "on"
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    assert _torch_ops.route(q, q, None, None) == _torch_ops.OPS and not _torch_ops.eager_possible(q)
    _torch_ops.set_eager_route(False)
    assert _torch_ops._eager_route is False
    assert _torch_ops.eager_route_state() == "off: not switched on (set_eager_route(True))"
    _torch_ops.set_eager_route(False)  # (idempotent)
    assert _torch_ops._eager_route is False


def test_set_eager_route_refuses_where_the_route_cannot_exist(restore_eager_route):
    _torch_ops._eager_route = _torch_ops._eager_available = False
    _torch_ops._state["eager"] = "off: this build has no CUDA kernels"
    with pytest.raises(RuntimeError, match=r"eager TVM-FFI route is unavailable in this process "
                                           r"\(off: this build has no CUDA kernels\)"):
        _torch_ops.set_eager_route(True)
    assert _torch_ops._eager_route is False
    _torch_ops.set_eager_route(False)  # switching off always succeeds
    assert _torch_ops.eager_route_state() == "off: this build has no CUDA kernels"
    if not flash_mla.has_cuda_backend():  # the real state of a CPU build, unforced
        with pytest.raises(RuntimeError, match="no CUDA kernels"):
            _torch_ops.set_eager_route(True)


@pytest.mark.parametrize("bad", [1, 0, "1", None, np.bool_(True)])
def test_set_eager_route_needs_a_bool(bad, restore_eager_route):
    with pytest.raises(TypeError, match=f"enabled: expected a bool, got {type(bad).__name__}"):
        _torch_ops.set_eager_route(bad)
    assert _torch_ops._eager_route is False


# ----------------------------------------------------------------------------- the eager functions on torch tensors
def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def test_eager_dense_decode_equals_the_op(rng):
    c = dense_case(rng)
    args = dense_op_args(c)
    ref = torch.ops.flash_mla.dense_decode_fwd(*args, None, None)
    res = _torch_ops.eager_dense_decode_fwd(*args, None, None)
    assert len(res) == 4 and all(type(t) is torch.Tensor for t in res)
    for a, b in zip(res, ref):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(_bits(a), _bits(b))
    again = _torch_ops.eager_dense_decode_fwd(*args, res[2], res[3])  # the schedule given: (out, lse)
    assert len(again) == 2 and torch.equal(_bits(again[0]), _bits(ref[0])) and torch.equal(again[1], ref[1])
    assert not again[0].requires_grad and again[0].is_contiguous()


def test_eager_sparse_decode_equals_the_op(rng):
    c = gen_sparse_decode_case(rng, b=2, s_q=2, h_q=64, d_qk=576, s_k=200, topk=64, pbs=64, have_topk_length=True,
                               extra=dict(s_k=100, topk=32, pbs=32, have_topk_length=True))
    kw = {k: T(v) if isinstance(v, np.ndarray) else v for k, v in c.kwargs().items()}
    args = (T(c.q), T(c.main.packed), kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), None, None,
            kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"), 512,
            kw.get("softmax_scale") or c.q.shape[-1] ** -0.5)
    ref = torch.ops.flash_mla.sparse_decode_fwd(*args)
    res = _torch_ops.eager_sparse_decode_fwd(*args)
    for a, b in zip(res, ref):
        assert torch.equal(_bits(a), _bits(b))
    again = _torch_ops.eager_sparse_decode_fwd(*args[:5], res[2], res[3], *args[7:])
    assert len(again) == 2 and torch.equal(_bits(again[0]), _bits(ref[0])) and torch.equal(again[1], ref[1])


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None, None


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.int16, torch.int64, torch.uint8, torch.bool,
           torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


@pytest.mark.parametrize("arg", [0, 1, 3, 4])
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_eager_dense_errors_same_as_the_op(rng, arg, dtype):
    """Every torch dtype in each tensor argument: the eager function raises what the op raises (class and message)."""
    c = dense_case(rng)
    args = list(dense_op_args(c))
    if args[arg].dtype == dtype:
        pytest.skip("the argument's own dtype")
    args[arg] = torch.zeros(args[arg].shape, dtype=dtype)
    op_err = _error_of(lambda: _torch_ops.dense_decode_fwd(*args, None, None))
    # the TVM-FFI function itself raises what the op raises (so the eager function's fallback to the op, which
    # guarantees it, is taken only on the error path)
    direct_err = _error_of(lambda: _torch_ops._ffi_dense_decode(*args, None, None))
    eager_err = _error_of(lambda: _torch_ops.eager_dense_decode_fwd(*args, None, None))
    assert op_err[0] is not None and direct_err == op_err and eager_err == op_err


@pytest.mark.parametrize("bad", ["q_rank", "q_head_dim", "k_rank", "block_table_rows", "lens_len", "head_dim_v",
                                 "q_last_stride", "schedule_shape"])
def test_eager_dense_shape_errors_same_as_the_op(rng, bad):
    c = dense_case(rng)
    args = list(dense_op_args(c))
    meta = (None, None)
    if bad == "q_rank":
        args[0] = args[0][0]
    elif bad == "q_head_dim":
        args[0] = args[0][..., :500].contiguous()
    elif bad == "k_rank":
        args[1] = args[1][0]
    elif bad == "block_table_rows":
        args[4] = args[4][:1]
    elif bad == "lens_len":
        args[3] = args[3][:2]
    elif bad == "head_dim_v":
        args[2] = 256
    elif bad == "q_last_stride":
        args[0] = torch.zeros(args[0].shape[:-1] + (args[0].shape[-1] * 2,), dtype=torch.bfloat16)[..., ::2]
    elif bad == "schedule_shape":
        _, _, tsm, ns = torch.ops.flash_mla.dense_decode_fwd(*args)
        meta = (tsm[:-1], ns)
    op_err = _error_of(lambda: (_torch_ops.dense_decode_fwd_scheduled if meta[0] is not None
                                else _torch_ops.dense_decode_fwd)(*args, *meta))
    direct_err = _error_of(lambda: _torch_ops._ffi_dense_decode(*args, *meta))
    eager_err = _error_of(lambda: _torch_ops.eager_dense_decode_fwd(*args, *meta))
    assert op_err[0] in (ValueError, TypeError) and direct_err == op_err and eager_err == op_err


def test_eager_function_answers_as_the_op_where_dlpack_fails(rng, count_torch_calls):
    """A meta tensor among the others: TVM-FFI's DLPack export fails (not the op's error); the eager function
    then runs the op, whose fake kernel raises the core's device error."""
    c = dense_case(rng)
    args = list(dense_op_args(c))
    args[4] = args[4].to("meta")
    direct_err = _error_of(lambda: _torch_ops._ffi_dense_decode(*args, None, None))
    op_err = _error_of(lambda: _torch_ops.dense_decode_fwd(*args, None, None))
    assert op_err[0] is ValueError and "block_table is on meta" in op_err[1] and direct_err != op_err
    count_torch_calls.clear()
    assert _error_of(lambda: _torch_ops.eager_dense_decode_fwd(*args, None, None)) == op_err
    assert count_torch_calls == ["flash_mla.dense_decode_fwd.default"]
    count_torch_calls.clear()
    good = dense_op_args(c)
    _torch_ops.eager_dense_decode_fwd(*good, None, None)
    assert count_torch_calls == []  # (no fallback when the TVM-FFI call succeeds)
