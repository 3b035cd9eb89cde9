"""The fast path of flash_mla_with_kvcache (docs/host-path.md): a torch call that repeats the previous call made
with its FlashMLASchedMeta runs the reusing op straight away, from what that call recorded (``_reuse``).

Device tensors only take it (the CPU branch compares host copies of the lengths on every call), so it is tested
here on torch's meta device, whose calls take the device branch as CUDA ones do (without the current-device and
capture queries, which tests/gpu/test_dense_decode_gpu.py and test_torch_ops_gpu.py exercise). What must hold: a
repeated call skips the full path and runs the op the full path would run; every change that the full path would
see (shapes, flags, argument types, length writes, another device, the scheduler object's fields) takes the full
path, with its errors; errors of the op raised on the fast path are the full path's; torch.compile never takes it.
"""

import os

import pytest

torch = pytest.importorskip("torch")

import flash_mla  # noqa: E402
from flash_mla import _torch_ops  # noqa: E402
from flash_mla.flash_mla_interface import SchedMetaMismatchError  # noqa: E402

if not _torch_ops.available():
    if os.environ.get("FLASHMLA_REQUIRE_TORCH_OPS", "") not in ("", "0"):
        raise RuntimeError(f"torch.ops.flash_mla is required but unavailable: {_torch_ops.load_error()}")
    pytest.skip(f"torch.ops.flash_mla unavailable: {_torch_ops.load_error()}", allow_module_level=True)

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

META = torch.device("meta")


class SeenOps(TorchDispatchMode):
    """Records the flash_mla ops it sees and runs them."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "flash_mla" in str(func):
            self.seen.append(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


class MyTensor(torch.Tensor):
    pass


@pytest.fixture
def full_path_calls(monkeypatch):
    """Counts the calls that take the full path (each asks _torch_ops.route for the route)."""
    calls = []
    real = _torch_ops.route

    def spy(*t):
        calls.append(1)
        return real(*t)

    monkeypatch.setattr(_torch_ops, "route", spy)
    return calls


def dense(b=2, s_q=1, h_q=16, blocks=4, device=META):
    q = torch.zeros(b, s_q, h_q, 576, dtype=torch.bfloat16, device=device)
    k = torch.zeros(blocks, 64, 1, 576, dtype=torch.bfloat16, device=device)
    bt = torch.zeros(b, 2, dtype=torch.int32, device=device)
    sl = torch.zeros(b, dtype=torch.int32, device=device)
    return q, k, bt, sl


def sparse(b=2, device=META, topk_length=False):
    q = torch.zeros(b, 1, 64, 576, dtype=torch.bfloat16, device=device)
    k = torch.zeros(4, 64, 1, 656, dtype=torch.uint8, device=device)
    idx = torch.zeros(b, 1, 128, dtype=torch.int32, device=device)
    tl = torch.zeros(b, dtype=torch.int32, device=device) if topk_length else None
    return q, k, idx, tl


def run_dense(q, k, bt, sl, sched, **kw):
    return flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, sched, **kw)


def run_sparse(q, k, idx, tl, sched, **kw):
    return flash_mla.flash_mla_with_kvcache(q, k, None, None, 512, sched, None, None, False, True, indices=idx,
                                            topk_length=tl, **kw)


def warm(run, *args):
    """A FlashMLASchedMeta after a call that computed its schedule and one that reused it (the second records)."""
    sched = flash_mla.get_mla_metadata()[0]
    run(*args, sched)
    assert sched._reuse is None  # (a computing call records nothing)
    run(*args, sched)
    assert sched._reuse is not None
    return sched


def test_repeated_dense_call_takes_the_fast_path(full_path_calls):
    q, k, bt, sl = dense()
    sched = warm(run_dense, q, k, bt, sl)
    first = run_dense(q, k, bt, sl, sched)
    assert len(full_path_calls) == 2
    tsm = sched.tile_scheduler_metadata
    mode = SeenOps()
    with mode:  # (a dispatch mode sees the op of a fast call too)
        for _ in range(3):  # the layers of one decoding step: new q each, same lengths
            out, lse = run_dense(torch.zeros_like(q), k, bt, sl, sched)
    assert len(full_path_calls) == 2 and mode.seen == ["dense_decode_fwd_scheduled"] * 3
    assert type((out, lse)) is type(first) and out.shape == first[0].shape and lse.shape == first[1].shape
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert sched.tile_scheduler_metadata is tsm


def test_repeated_sparse_call_takes_the_fast_path(full_path_calls):
    for tl_given in (False, True):
        q, k, idx, tl = sparse(topk_length=tl_given)
        sched = warm(run_sparse, q, k, idx, tl)
        n = len(full_path_calls)
        mode = SeenOps()
        with mode:
            out, lse = run_sparse(q, k, idx, tl, sched, attn_sink=torch.zeros(64, device=META))
            run_sparse(q, k, idx, tl, sched)
        assert len(full_path_calls) == n and mode.seen == ["sparse_decode_fwd_scheduled"] * 2
        assert out.shape == (2, 1, 64, 512) and lse.shape == (2, 64, 1)


def test_changes_take_the_full_path(full_path_calls):
    """Each change the full path would see takes it: with its result (a recomputed schedule) or its error."""
    q, k, bt, sl = dense()
    sched = warm(run_dense, q, k, bt, sl)

    def full(fn):
        n = len(full_path_calls)
        mode = SeenOps()
        with mode:
            fn()
        assert len(full_path_calls) == n + 1
        return mode.seen

    sl.add_(1)  # a write through torch: new version, the schedule is recomputed (then reused again)
    assert full(lambda: run_dense(q, k, bt, sl, sched)) == ["dense_decode_fwd"]
    assert full(lambda: run_dense(q, k, bt, sl.clone(), sched)) == ["dense_decode_fwd"]  # another length tensor
    assert sched._reuse is None
    sl2 = sched._gpu_key[2]
    assert full(lambda: run_dense(q, dense(blocks=8)[1], bt, sl2, sched)) == ["dense_decode_fwd_scheduled"]
    assert full(lambda: run_dense(q, k, bt, sl2, sched)) == ["dense_decode_fwd_scheduled"]  # (k's shape again)
    assert full(lambda: run_dense(q.as_subclass(MyTensor), k, bt, sl2, sched)) == ["dense_decode_fwd_scheduled"]
    sched.tile_scheduler_metadata = sched.tile_scheduler_metadata.clone()  # the scheduler object's fields
    assert full(lambda: run_dense(q, k, bt, sl2, sched)) == ["dense_decode_fwd_scheduled"]
    assert run_dense(q, k, bt, sl2, sched) and len(full_path_calls) == 8  # (recorded again: fast)
    # the full path's errors
    with pytest.raises(SchedMetaMismatchError, match="config.b"):
        full(lambda: run_dense(*dense(b=3), sched))
    with pytest.raises(SchedMetaMismatchError, match="config.causal"):
        full(lambda: run_dense(q, k, bt, sl2, sched, causal=True))
    with pytest.raises(SchedMetaMismatchError, match="topk_length"):
        full(lambda: flash_mla.flash_mla_with_kvcache(q, k, bt, sl2, 512, sched, topk_length=sl2))
    with pytest.raises(ValueError, match="num_splits: must be None"):
        full(lambda: run_dense(q, k, bt, sl2, sched, num_splits=sl2))
    with pytest.raises(ValueError, match="block_table and cache_seqlens: required"):
        full(lambda: run_dense(q, k, None, sl2, sched))
    with pytest.raises(ValueError, match="q: expected a 4-D tensor"):
        full(lambda: run_dense(q[0], k, bt, sl2, sched))


def test_fast_path_argument_errors_are_the_full_paths():
    q, k, bt, sl = dense()
    sched = warm(run_dense, q, k, bt, sl)
    fresh = lambda: flash_mla.get_mla_metadata()[0]  # noqa: E731  (a first call: the full path)
    for kw, exc, match in ((dict(softmax_scale=float("nan")), ValueError, "softmax_scale: must be finite"),
                           (dict(softmax_scale="0.1"), TypeError, "softmax_scale: expected a float"),
                           (dict(softmax_scale=True), TypeError, "softmax_scale: expected a float")):
        for s in (sched, fresh()):
            with pytest.raises(exc, match=match):
                run_dense(q, k, bt, sl, s, **kw)
    for s in (sched, fresh()):
        with pytest.raises(TypeError, match="head_dim_v: expected an int"):
            flash_mla.flash_mla_with_kvcache(q, k, bt, sl, "512", s)
    # a tensor on another device: the fake kernel's error, on both paths
    for s in (sched, fresh()):
        with pytest.raises(ValueError, match="block_table is on cpu but q is on meta"):
            run_dense(q, k, torch.zeros(2, 2, dtype=torch.int32), sl, s)
    # numpy / Python scalars the full path converts are accepted on the fast path the same way
    import numpy as np

    out, _ = run_dense(q, k, bt, sl, sched, softmax_scale=np.float32(0.04))
    assert out.shape == (2, 1, 16, 512)
    out, _ = flash_mla.flash_mla_with_kvcache(q, k, bt, sl, np.int64(512), sched)
    assert out.shape == (2, 1, 16, 512)


def test_fast_path_maps_the_op_library_errors():
    """The op library's "[flash_mla:<Class>]" RuntimeErrors come out as that class on the fast path, as `call`
    maps them on the full path; other RuntimeErrors pass unchanged."""
    q, k, bt, sl = dense()
    sched = warm(run_dense, q, k, bt, sl)

    def raising(msg):
        def run(*a):
            raise RuntimeError(msg)
        return run

    rec = sched._reuse
    sched._reuse = rec[:8] + (raising("[flash_mla:ValueError] block_table: bad\nException raised from x"),) + rec[9:]
    with pytest.raises(ValueError) as e:
        run_dense(q, k, bt, sl, sched)
    assert str(e.value) == "block_table: bad"
    sched._reuse = rec[:8] + (raising("CUDA error: something"),) + rec[9:]
    with pytest.raises(RuntimeError, match="CUDA error: something"):
        run_dense(q, k, bt, sl, sched)
    assert _torch_ops.mapped_error(RuntimeError("plain")) is None
    m = _torch_ops.mapped_error(RuntimeError("[flash_mla:NotImplementedError] no kernel"))
    assert type(m) is NotImplementedError and str(m) == "no kernel"


def test_cpu_calls_never_record():
    q, k, bt, sl = dense(device=torch.device("cpu"))
    sl.fill_(64)
    sched = flash_mla.get_mla_metadata()[0]
    run_dense(q, k, bt, sl, sched)
    run_dense(q, k, bt, sl, sched)
    assert sched._reuse is None  # (the CPU branch compares the lengths' values on every call)


def test_meta_record_is_not_taken_by_cpu_tensors(full_path_calls):
    """q.get_device() is -1 on the CPU as on the meta device: a CPU call never takes a meta call's record."""
    q, k, bt, sl = dense()
    sched = warm(run_dense, q, k, bt, sl)
    qc, kc, btc, _ = dense(device=torch.device("cpu"))
    slc = torch.full((2,), 64, dtype=torch.int32)
    sched._reuse = sched._reuse[:3] + ((slc, slc._version, slc.data_ptr()),) + sched._reuse[4:]  # even with the same lengths
    out, _ = run_dense(qc, kc, btc, slc, sched)
    assert len(full_path_calls) == 3 and out.device.type == "cpu"


def test_length_tensor_with_other_storage_takes_the_full_path(full_path_calls):
    """The record holds the length tensor's data pointer: the same tensor object given other storage without a
    version bump (``t.data = other``, ``torch.utils.swap_tensors``) takes the full path. (Meta tensors all have
    data pointer 0, so the record's pointer is changed here instead; the key's own check is in test_torch_ops.)"""
    q, k, bt, sl = dense()
    sched = warm(run_dense, q, k, bt, sl)
    t, ver, ptr = sched._reuse[3]
    sched._reuse = sched._reuse[:3] + ((t, ver, ptr + 64),) + sched._reuse[4:]
    n = len(full_path_calls)
    run_dense(q, k, bt, sl, sched)
    assert len(full_path_calls) == n + 1


def test_compile_never_takes_the_fast_path():
    """A FlashMLASchedMeta with a record, then a compiled call with it: the graph holds the op computing the
    schedule (the full path under torch.compile never reuses), in one graph."""
    torch._dynamo.reset()
    q, k, bt, sl = dense()
    sched = warm(run_dense, q, k, bt, sl)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    fn = torch.compile(lambda q, k, bt, sl: run_dense(q, k, bt, sl, sched), backend=backend, fullgraph=True)
    out, lse = fn(q, k, bt, sl)
    assert out.shape == (2, 1, 16, 512) and len(graphs) == 1
    assert "flash_mla.dense_decode_fwd.default" in graphs[0] and "_scheduled" not in graphs[0]
    torch._dynamo.reset()


def test_eager_record_defers_to_the_full_path_under_a_mode(monkeypatch):
    """A record of the eager TVM-FFI route (CUDA only; forced here on meta tensors, the TVM-FFI function failing so
    that the eager function answers through the op) is taken only while nothing may intercept the op: under a
    dispatch mode the call takes the full path, whose route gives the mode the op."""
    real_route = _torch_ops.route
    routed = []

    def route(*t):  # the EAGER answer of a CUDA call wherever nothing intercepts
        routed.append(1)
        r = real_route(*t)
        return _torch_ops.EAGER if r and not _torch_ops.intercepted() else r

    def ffi_fails(*a):
        raise RuntimeError("no DLPack export of meta tensors")

    monkeypatch.setattr(_torch_ops, "route", route)
    monkeypatch.setattr(_torch_ops, "eager_possible", lambda q: True)
    monkeypatch.setattr(_torch_ops, "_ffi_dense_decode", ffi_fails)
    q, k, bt, sl = dense()
    sched = warm(run_dense, q, k, bt, sl)
    assert sched._reuse[9] is True  # (the eager flag)
    out, lse = run_dense(q, k, bt, sl, sched)
    assert len(routed) == 2 and out.shape == (2, 1, 16, 512)
    mode = SeenOps()
    with mode:
        run_dense(q, k, bt, sl, sched)
    assert len(routed) == 3 and mode.seen == ["dense_decode_fwd_scheduled"]
    assert sched._reuse is None  # (the op taken because of the mode: not recorded, the next call routes again)
    run_dense(q, k, bt, sl, sched)
    assert len(routed) == 4 and sched._reuse[9] is True
    run_dense(q, k, bt, sl, sched)
    assert len(routed) == 4
