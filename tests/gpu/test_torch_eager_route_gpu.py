"""The eager route of torch decode calls on CUDA (flash_mla._torch_ops.route; docs/host-path.md): plain CUDA
tensors, nothing intercepting -> the TVM-FFI function of the core, not torch.ops.flash_mla. Checked here: the
route taken (no flash_mla op reaches torch: neither the op wrapper nor the profiler sees one), the same bits as
the torch.ops route (forced by a pass-through TorchDispatchMode, which must see the op), subclasses and
torch.compile on the op, the schedule kept and recomputed as on the op's route, the outputs from torch's
caching allocator (counted by torch.cuda.memory_allocated, freed with the tensors), the same errors as the op.
The route is off by default (flash_mla._torch_ops.set_eager_route switches it); a fixture turns it on here.
Skipped without an sm90 GPU (conftest.py).
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
import flash_mla  # noqa: E402
from flash_mla import _torch_ops  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from mla_test_utils import count_torch_calls  # noqa: E402,F401  (fixture)

import test_dense_decode_gpu as dense_t  # noqa: E402
import test_sparse_decode_gpu as sparse_t  # noqa: E402
from test_torch_eager_route import PassThroughDispatch  # noqa: E402  (records and runs the ops it sees)


class MyTensor(torch.Tensor):
    pass


@pytest.fixture(autouse=True)
def eager_route_on():
    """set_eager_route(True) for each test, switched off again after it."""
    try:
        _torch_ops.set_eager_route(True)
    except RuntimeError as e:  # (a build without CUDA kernels, a torch / tvm_ffi without what the route needs)
        pytest.skip(str(e))
    assert _torch_ops.eager_route_state() == "on"
    yield
    _torch_ops.set_eager_route(False)


def decode_calls(counted):
    """The decode ops among the torch op calls counted (the sparse case's set-up quantizes through torch.ops)."""
    return [n for n in counted if "decode" in n]


def dense_inputs(b=4, lens=(300, 0, 4000, 77), h_q=64, seed=3):
    q, k, bt, ln = dense_t.make_case(b, 1, h_q, 1, 576, list(lens), seed=seed)
    return (q, k, bt, ln), tuple(t.cuda() for t in (q, k, bt, ln))


def sparse_case(b=4, seed=5):
    return sparse_t.Case(seed, b=b, s_q=2, h_q=64, d_qk=576, main=(600, 256, 64), extra=(300, 128, 2), topk_len=True,
                         extra_topk_len=True, poison_beyond_length=False)


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    return torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.dtype == torch.bfloat16 else torch.equal(a, b)


def test_route_is_eager_on_cuda():
    _, (q, k, bt, ln) = dense_inputs()
    nones = (None,) * 6
    assert _torch_ops.route(q, k, bt, ln, *nones) == _torch_ops.EAGER
    with torch.device("cuda"):  # torch.set_default_device's DeviceContext changes nothing for the op
        assert _torch_ops.route(q, k, bt, ln, *nones) == _torch_ops.EAGER
    # (another tensor's device is the core's to check, or the op's where DLPack fails: test_errors_same_as_the_op)
    assert _torch_ops.route(q, k.cpu(), bt, ln, *nones) == _torch_ops.EAGER
    assert _torch_ops.route(q.cpu(), k, bt, ln, *nones) == _torch_ops.OPS
    assert _torch_ops.route(q, k, bt, ln.as_subclass(MyTensor), *nones) == _torch_ops.OPS
    with PassThroughDispatch():
        assert _torch_ops.route(q, k, bt, ln, *nones) == _torch_ops.OPS


def test_eager_calls_skip_the_op_and_match_it(count_torch_calls):
    cpu, cu = dense_inputs()
    out, lse = dense_t.run(*cu, False)
    c = sparse_case()
    sq, sk, kw = c.args("cuda")
    sout, slse = sparse_t.run_sparse(sq, sk, kw)
    assert decode_calls(count_torch_calls) == []  # neither decode op wrapper ran
    mode = PassThroughDispatch()
    with mode:  # the torch.ops route, same inputs
        out_op, lse_op = dense_t.run(*cu, False)
        sout_op, slse_op = sparse_t.run_sparse(sq, sk, kw)
    assert "flash_mla.dense_decode_fwd.default" in mode.seen and "flash_mla.sparse_decode_fwd.default" in mode.seen
    assert same_bits(out, out_op) and same_bits(lse, lse_op)
    assert same_bits(sout, sout_op) and same_bits(slse, slse_op)
    dense_t.compare(*cpu, False, out, lse)
    sparse_t.compare(sout, slse, *sparse_t.reference(c))
    assert out.device == cu[0].device and type(out) is torch.Tensor and not out.requires_grad


def test_profiler_sees_no_flash_mla_op_in_eager_calls():
    _, cu = dense_inputs()
    sched = flash_mla.get_mla_metadata()[0]
    dense_t.run(*cu, False, sched)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dense_t.run(*cu, False, sched)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert not any("flash_mla::" in n for n in names), names
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, PassThroughDispatch():
        dense_t.run(*cu, False, sched)
        torch.cuda.synchronize()
    assert any("flash_mla::dense_decode_fwd" in e.name for e in prof.events())


def test_repeated_eager_calls_take_the_fast_path(count_torch_calls, monkeypatch):
    """flash_mla_with_kvcache's fast path on the eager route: the calls repeating one that reused the schedule call
    the eager function straight away (no route(), no op), same bits; under a dispatch mode the full path gives the
    mode the op."""
    cpu, cu = dense_inputs()
    sched = flash_mla.get_mla_metadata()[0]
    out1, lse1 = dense_t.run(*cu, False, sched)
    dense_t.run(*cu, False, sched)  # reuses: recorded
    assert sched._reuse is not None and sched._reuse[9] is True  # (the eager route's record)
    routed = []
    real = _torch_ops.route
    monkeypatch.setattr(_torch_ops, "route", lambda *t: routed.append(1) or real(*t))
    for _ in range(3):
        out, lse = dense_t.run(*cu, False, sched)
        assert same_bits(out, out1) and same_bits(lse, lse1)
    assert routed == [] and decode_calls(count_torch_calls) == []
    dense_t.compare(*cpu, False, out, lse)  # (its CPU reference call takes the full path too)
    routed.clear()
    mode = PassThroughDispatch()
    with mode:
        out_op, _ = dense_t.run(*cu, False, sched)
    assert routed == [1] and "flash_mla.dense_decode_fwd_scheduled.default" in mode.seen
    assert same_bits(out_op, out1)


def test_switching_the_route_reroutes_recorded_calls(count_torch_calls):
    """A FlashMLASchedMeta's fast-path record follows set_eager_route: switched off, the next repeating call takes
    the op (*_scheduled, the schedule kept), and the record made then is the op's; switched on again, the eager
    function again. Same bits throughout."""
    _, cu = dense_inputs()
    sched = flash_mla.get_mla_metadata()[0]
    out1, lse1 = dense_t.run(*cu, False, sched)
    dense_t.run(*cu, False, sched)
    assert sched._reuse[9] is True and decode_calls(count_torch_calls) == []
    _torch_ops.set_eager_route(False)
    for _ in range(3):
        out, lse = dense_t.run(*cu, False, sched)
        assert same_bits(out, out1) and same_bits(lse, lse1)
    assert decode_calls(count_torch_calls) == ["flash_mla.dense_decode_fwd_scheduled.default"] * 3
    assert sched._reuse[9] is False
    _torch_ops.set_eager_route(True)
    for _ in range(2):
        out, lse = dense_t.run(*cu, False, sched)
        assert same_bits(out, out1) and same_bits(lse, lse1)
    assert len(decode_calls(count_torch_calls)) == 3 and sched._reuse[9] is True


def test_subclass_takes_the_op(count_torch_calls):
    cpu, (q, k, bt, ln) = dense_inputs()
    out, lse = dense_t.run(q.as_subclass(MyTensor), k, bt, ln, False)
    assert count_torch_calls == ["flash_mla.dense_decode_fwd.default"]
    dense_t.compare(*cpu, False, out.as_subclass(torch.Tensor), lse.as_subclass(torch.Tensor))


def test_compiled_calls_keep_the_op():
    torch._dynamo.reset()
    _, cu = dense_inputs()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def fn(q, k, bt, ln):
        return flash_mla.flash_mla_with_kvcache(q, k, bt, ln, 512, flash_mla.get_mla_metadata()[0])

    got = torch.compile(fn, backend=backend, fullgraph=True)(*cu)
    ref = fn(*cu)
    assert any("flash_mla.dense_decode_fwd" in g for g in graphs), graphs
    assert same_bits(got[0], ref[0]) and same_bits(got[1], ref[1])


def test_schedule_reused_and_recomputed_as_on_the_op():
    """Same length tensor, unchanged: the schedule is kept (same tensors). An in-place write: recomputed, values
    of the new lengths. A new length tensor: recomputed."""
    cpu, (q, k, bt, ln) = dense_inputs(lens=(300, 0, 4000, 77))
    sched = flash_mla.get_mla_metadata()[0]
    dense_t.run(q, k, bt, ln, False, sched)
    tsm, ns = sched.tile_scheduler_metadata, sched.num_splits
    assert tsm.is_cuda and type(tsm) is torch.Tensor
    out, lse = dense_t.run(q, k, bt, ln, False, sched)
    assert sched.tile_scheduler_metadata is tsm and sched.num_splits is ns
    dense_t.compare(*cpu, False, out, lse)
    new = torch.tensor([250, 0, 3000, 1], dtype=torch.int32)  # within each request's blocks of the table
    ln.copy_(new)
    out, lse = dense_t.run(q, k, bt, ln, False, sched)
    assert sched.tile_scheduler_metadata is not tsm
    dense_t.compare(cpu[0], cpu[1], cpu[2], new, False, out, lse)
    tsm = sched.tile_scheduler_metadata
    out, lse = dense_t.run(q, k, bt, ln.clone(), False, sched)
    assert sched.tile_scheduler_metadata is not tsm
    dense_t.compare(cpu[0], cpu[1], cpu[2], new, False, out, lse)


def test_outputs_come_from_the_caching_allocator_and_are_freed():
    _, cu = dense_inputs(b=8, lens=[4000] * 8, h_q=128)
    sched = flash_mla.get_mla_metadata()[0]
    dense_t.run(*cu, False, sched)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out, lse = dense_t.run(*cu, False, sched)
    held = torch.cuda.memory_allocated() - base
    assert held >= out.numel() * out.element_size() + lse.numel() * lse.element_size()
    del out, lse
    assert torch.cuda.memory_allocated() == base
    for _ in range(50):
        dense_t.run(*cu, False, sched)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


@pytest.mark.parametrize("bad", ["q_float32", "k_cpu", "lens_meta", "bt_int64", "q_head_dim", "head_dim_v"])
def test_errors_same_as_the_op(bad):
    _, (q, k, bt, ln) = dense_inputs()
    hdv = 512
    if bad == "q_float32":
        q = q.float()
    elif bad == "k_cpu":
        k = k.cpu()
    elif bad == "lens_meta":
        ln = ln.to("meta")
    elif bad == "bt_int64":
        bt = bt.long()
    elif bad == "q_head_dim":
        q = q[..., :500].contiguous()
    elif bad == "head_dim_v":
        hdv = 256

    def call():
        return flash_mla.flash_mla_with_kvcache(q, k, bt, ln, hdv, flash_mla.get_mla_metadata()[0])

    errors = []
    for mode in (None, PassThroughDispatch()):
        try:
            if mode is None:
                call()
            else:
                with mode:
                    call()
        except Exception as e:  # noqa: BLE001
            errors.append((type(e), str(e)))
        else:
            errors.append((None, None))
    assert errors[0][0] in (ValueError, TypeError) and errors[0] == errors[1], errors
