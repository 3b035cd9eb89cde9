"""torch.ops.flash_mla on the GPU (sm90): opcheck on CUDA, torch.compile with inductor, CUDA
graphs (capture a decode step once, replay with new lengths and a smaller real batch), ordering on
a non-default stream, and inputs on a second GPU (the kernels run on the tensors' device).

Skipped without an sm90 GPU and a CUDA build (conftest.py); the 2-GPU tests also skip with
fewer than two GPUs. CPU versions: tests/python/test_torch_ops.py.
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
import flash_mla  # noqa: E402
from flash_mla import _torch_ops  # noqa: E402
from torch_reference import check_close  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from mla_test_utils import count_torch_calls  # noqa: E402,F401  (fixture)

import test_dense_decode_gpu as dense_t  # noqa: E402  (data generator + CPU-reference comparator)
import test_sparse_decode_gpu as sparse_t  # noqa: E402

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2 if torch.cuda.is_available() else True,
                              reason="needs two GPUs")


@pytest.fixture(autouse=True)
def _need_ops():
    assert _torch_ops.available(), _torch_ops.load_error()


def dense_inputs(b=4, lens=(300, 0, 4000, 77), s_q=1, h_q=64, device="cuda", seed=3):
    q, k, bt, ln = dense_t.make_case(b, s_q, h_q, 1, 576, list(lens), seed=seed)
    return (q, k, bt, ln), tuple(t.to(device) for t in (q, k, bt, ln))


def sparse_case(b=4, seed=5):
    return sparse_t.Case(seed, b=b, s_q=2, h_q=64, d_qk=576, main=(600, 256, 64), extra=(300, 128, 2), topk_len=True,
                         extra_topk_len=True, poison_beyond_length=False)


def prefill_inputs(device, seed=7, s_q=33, s_kv=300, topk=128, h_q=64):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(s_q, h_q, 576, generator=g) / 10).to(torch.bfloat16)
    kv = (torch.randn(s_kv, 1, 576, generator=g) / 10).to(torch.bfloat16)
    idx = torch.randint(-1, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    sink = torch.randn(h_q, generator=g)
    tl = torch.randint(0, topk + 1, (s_q,), generator=g, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, kv, idx, sink, tl))


def prefill_check(res, cpu_args, sm_scale=0.1):
    ref = flash_mla.flash_mla_sparse_fwd(cpu_args[0], cpu_args[1], cpu_args[2], sm_scale, 512, *cpu_args[3:])
    # Tolerances of tests/gpu/test_sparse_prefill_gpu.py.
    check_close("out", res[0].float(), ref[0].float(), 8e-4, 3.01 / 128, 7e-6)
    check_close("max_logits", res[1], ref[1], 1e-6, 2.01 / 65536, 1e-7)
    check_close("lse", res[2], ref[2], 1e-6, 2.01 / 65536, 1e-7)


# ----------------------------------------------------------------------------- routing + values
def test_public_functions_use_torch_ops_on_cuda(count_torch_calls):
    """By default every public call on CUDA torch tensors runs torch.ops.flash_mla (the eager TVM-FFI route is
    off unless set_eager_route switches it on: tests/gpu/test_torch_eager_route_gpu.py)."""
    cpu, cu = dense_inputs()
    out, lse = dense_t.run(*cu, False)
    dense_t.compare(*cpu, False, out, lse)
    c = sparse_case()
    q, k, kw = c.args("cuda")
    out, lse = sparse_t.run_sparse(q, k, kw)
    sparse_t.compare(out, lse, *sparse_t.reference(c))
    res = flash_mla.flash_mla_sparse_fwd(*prefill_inputs("cuda")[:3], 0.1, 512, *prefill_inputs("cuda")[3:])
    prefill_check(res, prefill_inputs("cpu"))
    assert {"flash_mla.dense_decode_fwd.default", "flash_mla.sparse_decode_fwd.default",
            "flash_mla.sparse_prefill_fwd.default"} <= set(count_torch_calls)


def _count_full_path(monkeypatch):
    """Counts the public decode calls that take the full path of flash_mla_with_kvcache (each asks route())."""
    calls = []
    real = _torch_ops.route
    monkeypatch.setattr(_torch_ops, "route", lambda *t: calls.append(1) or real(*t))
    return calls


def test_repeated_calls_take_the_fast_path_on_cuda(monkeypatch):
    """flash_mla_with_kvcache's fast path (docs/host-path.md) on CUDA: once a call has reused the schedule of a
    FlashMLASchedMeta, the calls repeating it run the reusing op straight away -- the same bits, the schedule
    kept; a CUDA-graph capture, a length write and another current device take the full path."""
    cpu, (q, k, bt, ln) = dense_inputs()
    sched = flash_mla.get_mla_metadata()[0]
    out1, lse1 = dense_t.run(q, k, bt, ln, False, sched)  # computes the schedule
    dense_t.run(q, k, bt, ln, False, sched)  # reuses it: recorded
    tsm = sched.tile_scheduler_metadata
    assert sched._reuse is not None
    full = _count_full_path(monkeypatch)
    for _ in range(3):
        out, lse = dense_t.run(q, k, bt, ln, False, sched)
        assert torch.equal(out.view(torch.int16), out1.view(torch.int16)) and torch.equal(lse, lse1)
    assert full == [] and sched.tile_scheduler_metadata is tsm
    dense_t.compare(*cpu, False, out, lse)  # (its CPU reference call takes the full path too)
    full.clear()
    # inside a capture: the full path, which recomputes the schedule inside it
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = dense_t.run(q, k, bt, ln, False, sched)
    assert full == [1] and sched.tile_scheduler_metadata is not tsm
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_g.view(torch.int16), out1.view(torch.int16)) and torch.equal(lse_g, lse1)
    dense_t.run(q, k, bt, ln, False, sched)  # recomputed outside the capture
    dense_t.run(q, k, bt, ln, False, sched)  # reused: recorded
    assert len(full) == 3
    new = torch.tensor([1, 0, 2000, 77], dtype=torch.int32)  # within each request's pages
    ln.copy_(new)  # a write through torch: the full path recomputes
    out, lse = dense_t.run(q, k, bt, ln, False, sched)
    assert len(full) == 4
    dense_t.compare(cpu[0], cpu[1], cpu[2], new, False, out, lse)
    if torch.cuda.device_count() > 1:  # q on the current device only: another current device takes the full path
        n = len(full)
        dense_t.run(q, k, bt, ln, False, sched)
        with torch.cuda.device(1):
            out, lse = dense_t.run(q, k, bt, ln, False, sched)
        assert len(full) == n + 2
        dense_t.compare(cpu[0], cpu[1], cpu[2], new, False, out, lse)
    # sparse decode (no extra cache): the same
    c = sparse_t.Case(11, b=4, s_q=2, h_q=64, d_qk=576, main=(600, 256, 64), topk_len=True,
                      poison_beyond_length=False)
    sq, sk, kw = c.args("cuda")
    sched = flash_mla.get_mla_metadata()[0]
    sparse_t.run_sparse(sq, sk, kw, sched)
    sout1, slse1 = sparse_t.run_sparse(sq, sk, kw, sched)
    n = len(full)
    sout, slse = sparse_t.run_sparse(sq, sk, kw, sched)
    assert len(full) == n and sched._reuse is not None
    assert torch.equal(sout.view(torch.int16), sout1.view(torch.int16)) and torch.equal(slse, slse1)
    sparse_t.compare(sout, slse, *sparse_t.reference(c))


def test_flash_mla_cuda_module_on_cuda():
    """flash_mla.cuda (spec §1.1) on CUDA tensors: same values as the public functions (values of
    both checked against the CPU reference above), metadata returned and accepted back; a CUDA q
    with a CPU k_cache raises the core's device error."""
    import flash_mla.cuda as fc

    _, (q, k, bt, ln) = dense_inputs(b=2, lens=(100, 700))
    res = fc.dense_decode_fwd(q, k, 512, ln, bt, 576 ** -0.5, False, None, None)
    out, lse = flash_mla.flash_mla_with_kvcache(q, k, bt, ln, 512, flash_mla.get_mla_metadata()[0])
    assert torch.equal(res[0], out) and torch.equal(res[1], lse)
    again = fc.dense_decode_fwd(q, k, 512, ln, bt, 576 ** -0.5, False, res[2], res[3])
    assert torch.equal(again[0], out) and again[2] is res[2] and again[3] is res[3]
    pq, pkv, pidx, sink, tl = prefill_inputs("cuda")
    res = fc.sparse_prefill_fwd(pq, pkv, pidx, 0.1, 512, sink, tl)
    prefill_check(res, prefill_inputs("cpu"))
    with pytest.raises(ValueError, match="all tensors must be on the same device"):
        fc.sparse_prefill_fwd(pq, pkv.cpu(), pidx, 0.1, 512, sink, tl)


# ----------------------------------------------------------------------------- opcheck
def test_opcheck_cuda():
    _, (q, k, bt, ln) = dense_inputs(b=2, lens=(100, 700))
    torch.library.opcheck(torch.ops.flash_mla.dense_decode_fwd.default, (q, k, 512, ln, bt, 576**-0.5, False))
    c = sparse_case(b=2)
    sq, sk, kw = c.args("cuda")
    torch.library.opcheck(torch.ops.flash_mla.sparse_decode_fwd.default,
                          (sq, sk, kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), None, None,
                           kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"),
                           512, 0.05))
    pq, pkv, pidx, sink, tl = prefill_inputs("cuda")
    torch.library.opcheck(torch.ops.flash_mla.sparse_prefill_fwd.default, (pq, pkv, pidx, 0.1, 512, sink, tl))


def test_opcheck_cuda_scheduled_ops():
    """The *_scheduled ops (what a reusing call runs) on CUDA, with the schedule a first call computed."""
    _, (q, k, bt, ln) = dense_inputs(b=2, lens=(100, 700))
    args = (q, k, 512, ln, bt, 576**-0.5, False)
    _, _, tsm, ns = torch.ops.flash_mla.dense_decode_fwd(*args)
    torch.library.opcheck(torch.ops.flash_mla.dense_decode_fwd_scheduled.default, args + (tsm, ns))
    c = sparse_case(b=2)
    sq, sk, kw = c.args("cuda")
    args = (sq, sk, kw["indices"], kw.get("topk_length"), kw.get("attn_sink"), None, None, kw.get("extra_k_cache"),
            kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"), 512, 0.05)
    _, _, tsm, ns = torch.ops.flash_mla.sparse_decode_fwd(*args)
    torch.library.opcheck(torch.ops.flash_mla.sparse_decode_fwd_scheduled.default, args[:5] + (tsm, ns) + args[7:])


def test_sched_meta_filled_on_cuda_reused_by_a_cpu_call():
    """A FlashMLASchedMeta filled by a CUDA call, then a CPU call of the same shapes and lengths: the CPU call
    recomputes the schedule on the CPU (it raised a device error on tile_scheduler_metadata), values as the
    reference; then a CUDA call again recomputes on the GPU."""
    cpu, cu = dense_inputs(b=2, lens=(100, 700))
    sched = flash_mla.get_mla_metadata()[0]
    out_cu, lse_cu = dense_t.run(*cu, False, sched=sched)
    dense_t.compare(*cpu, False, out_cu, lse_cu)
    out, lse = dense_t.run(*cpu, False, sched=sched)
    ref_out, ref_lse = dense_t.run(*cpu, False)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and sched.tile_scheduler_metadata.is_cpu
    out_cu2, lse_cu2 = dense_t.run(*cu, False, sched=sched)
    dense_t.compare(*cpu, False, out_cu2, lse_cu2)
    assert sched.tile_scheduler_metadata.is_cuda


# ----------------------------------------------------------------------------- torch.compile (inductor)
def test_compile_inductor_fullgraph():
    torch._dynamo.reset()
    cpu, cu = dense_inputs()

    def dense_fn(q, k, bt, ln):
        sched, _ = flash_mla.get_mla_metadata()
        out, lse = flash_mla.flash_mla_with_kvcache(q * 1, k, bt, ln, 512, sched)
        return out.float() + 1, lse

    ref = dense_fn(*cu)
    got = torch.compile(dense_fn, fullgraph=True)(*cu)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])

    c = sparse_case()
    q, k, kw = c.args("cuda")

    def sparse_fn(q, k):
        sched, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(q, k, None, None, 512, sched, **kw)

    ref = sparse_fn(q, k)
    got = torch.compile(sparse_fn, fullgraph=True)(q, k)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])

    pargs = prefill_inputs("cuda")

    def prefill_fn(q, kv, idx, sink, tl):
        out, ml, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.1, 512, sink, tl)
        return out, ml.exp(), lse

    ref = prefill_fn(*pargs)
    got = torch.compile(prefill_fn, fullgraph=True)(*pargs)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- CUDA graphs
def test_cuda_graph_capture_once_replay_new_lengths_smaller_batch():
    b_cap = 8
    cpu, (q, k, bt, ln) = dense_inputs(b=b_cap, lens=[4096] * b_cap, h_q=128, seed=11)
    sched, _ = flash_mla.get_mla_metadata()
    dense_t.run(q, k, bt, ln, False, sched)  # warm-up (and scheduler object initialised) outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = dense_t.run(q, k, bt, ln, False, sched)
    gen = torch.Generator().manual_seed(12)
    for it in range(4):
        new = torch.randint(0, 4097, (b_cap,), generator=gen, dtype=torch.int32)
        real_b = b_cap - 1 - it  # the real batch shrinks: the tail requests are padding (length 0)
        new[real_b:] = 0
        ln.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = dense_t.run(q, k, bt, ln, False)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        dense_t.compare(cpu[0], cpu[1], cpu[2], new, False, out, lse)


def test_cuda_graph_sparse_decode_replay():
    b = 8
    c = sparse_case(b=b, seed=21)
    q, k, kw = c.args("cuda")
    sparse_t.run_sparse(q, k, kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_t.run_sparse(q, k, kw)
    gen = torch.Generator().manual_seed(22)
    for _ in range(2):
        tl = torch.randint(0, 257, (b,), generator=gen, dtype=torch.int32)
        tl[b // 2:] = 0
        kw["topk_length"].copy_(tl)
        graph.replay()
        torch.cuda.synchronize()
        eager = sparse_t.run_sparse(q, k, kw)
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
        c.main.topk_length = tl
        sparse_t.compare(out, lse, *sparse_t.reference(c))


# ----------------------------------------------------------------------------- streams
def test_runs_on_the_current_non_default_stream():
    cpu, (q, k, bt, ln) = dense_inputs(seed=31)
    pq, pkv, pidx, sink, tl = prefill_inputs("cuda")
    s = torch.cuda.Stream()
    q_late, pq_late = torch.zeros_like(q), torch.zeros_like(pq)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # the copies below land long after the ops would run on another stream
        q_late.copy_(q)
        pq_late.copy_(pq)
        out, lse = dense_t.run(q_late, k, bt, ln, False)
        res = flash_mla.flash_mla_sparse_fwd(pq_late, pkv, pidx, 0.1, 512, sink, tl)
    s.synchronize()
    dense_t.compare(*cpu, False, out, lse)
    prefill_check(res, prefill_inputs("cpu"))


# ----------------------------------------------------------------------------- second GPU
@two_gpus
def test_inputs_on_second_gpu_run_there():
    torch.cuda.set_device(0)
    cpu, (q, k, bt, ln) = dense_inputs(device="cuda:1", seed=41)
    out, lse = dense_t.run(q, k, bt, ln, False)
    assert out.device == torch.device("cuda:1") and lse.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0  # the device guard restored the caller's device
    torch.cuda.synchronize(1)
    dense_t.compare(*cpu, False, out, lse)
    c = sparse_case(seed=42)
    sq, sk, kw = c.args("cpu")
    sq, sk = sq.to("cuda:1"), sk.to("cuda:1")
    kw = {n: v.to("cuda:1") if isinstance(v, torch.Tensor) else v for n, v in kw.items()}
    sout, slse = sparse_t.run_sparse(sq, sk, kw)
    assert sout.device == torch.device("cuda:1")
    torch.cuda.synchronize(1)
    sparse_t.compare(sout, slse, *sparse_t.reference(c))
    res = flash_mla.flash_mla_sparse_fwd(*prefill_inputs("cuda:1")[:3], 0.1, 512, *prefill_inputs("cuda:1")[3:])
    assert res[0].device == torch.device("cuda:1")
    prefill_check(res, prefill_inputs("cpu"))


@two_gpus
def test_second_gpu_uses_its_current_stream():
    torch.cuda.set_device(0)
    cpu, (q, k, bt, ln) = dense_inputs(device="cuda:1", seed=43)
    s1 = torch.cuda.Stream(device=1)
    q_late = torch.zeros_like(q)
    torch.cuda.synchronize(1)
    prev = torch.cuda.current_stream(1)
    torch.cuda.set_stream(s1)  # current stream of device 1 (the current device stays 0 below)
    torch.cuda.set_device(0)
    try:
        with torch.cuda.device(1):
            torch.cuda._sleep(200_000_000)
            q_late.copy_(q)
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(1) == s1
        out, lse = dense_t.run(q_late, k, bt, ln, False)
    finally:
        torch.cuda.set_stream(prev)
        torch.cuda.set_device(0)
    s1.synchronize()
    dense_t.compare(*cpu, False, out, lse)
