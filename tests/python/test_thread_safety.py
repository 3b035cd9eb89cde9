"""Concurrent calls from several Python threads (CPU reference backend).

The C++ calls release the GIL, so threads really run the operators at the same time. What must hold: every
call gives the bits of the same call run alone, and a FlashMLASchedMeta shared by threads -- its first call
(which records the schedule) racing with others included -- answers each call either correctly or with
SchedMetaMismatchError, and is never left holding the schedule of one call under the config of another.
Every thread is joined with a timeout, so a hang fails the test instead of stalling CI.
"""

import sys
import threading

import numpy as np
import pytest

import flash_mla
from flash_mla import flash_mla_interface as fmi
from mla_test_utils import gen_dense_case, gen_prefill_case, gen_sparse_decode_case, randn_bf16
from oracle import BF16

JOIN_S = 60


def _bits(x):
    if hasattr(x, "detach"):  # torch
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        return tuple(x.shape), x.contiguous().numpy().tobytes()
    a = np.asarray(x)
    if a.dtype == BF16:
        a = a.view(np.uint16)
    return a.shape, np.ascontiguousarray(a).tobytes()


def _run_threads(target, args_list):
    """Runs target(*args) in one thread per args, all released at once; returns the errors raised."""
    errors = []
    start = threading.Barrier(len(args_list))

    def body(*args):
        try:
            start.wait(JOIN_S)
            target(*args)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=body, args=args, daemon=True) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.fixture
def fast_switching():
    """Thread switches every few bytecodes: makes Python-level interleavings likely."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _dense_cases(seed):
    rng = np.random.default_rng(seed)
    return [gen_dense_case(rng, b=b, s_q=1, h_q=16, h_kv=1, d=576, s_k=100, pbs=64, varlen=True) for b in (2, 3, 2)]


def _dense_call(case, sched, conv=lambda x: x):
    return flash_mla.flash_mla_with_kvcache(conv(case.q), conv(case.k_cache), conv(case.block_table),
                                            conv(case.cache_seqlens), 512, sched)


def test_first_call_losing_the_race_does_not_overwrite_the_schedule(monkeypatch):
    """Deterministic interleaving: thread A (b=2) makes the first call on a fresh scheduler object and is held
    after its op ran; thread B (b=3) makes its own first call and records the object; then A finishes. The
    object must still hold B's schedule under B's config (A's result stays correct), so B's shapes reuse it and
    A's are a SchedMetaMismatchError -- not the ValueError of a schedule of b=2 recorded under config b=3."""
    a_case, b_case, _ = _dense_cases(0)
    ref_a = [_bits(x) for x in _dense_call(a_case, flash_mla.get_mla_metadata()[0])]
    ref_b = [_bits(x) for x in _dense_call(b_case, flash_mla.get_mla_metadata()[0])]
    sched = flash_mla.get_mla_metadata()[0]
    a_ran, b_done = threading.Event(), threading.Event()
    real = fmi._ffi.from_ffi

    def held_from_ffi(t, like):  # (A's op returned; A waits here, before it records anything)
        if threading.current_thread().name == "A" and not a_ran.is_set():
            a_ran.set()
            assert b_done.wait(JOIN_S)
        return real(t, like)

    monkeypatch.setattr(fmi._ffi, "from_ffi", held_from_ffi)
    got = {}

    def run(name, case):
        if name == "B":
            assert a_ran.wait(JOIN_S)
        try:
            got[name] = [_bits(x) for x in _dense_call(case, sched)]
        finally:
            if name == "B":
                b_done.set()

    threads = [threading.Thread(target=run, args=(n, c), name=n, daemon=True) for n, c in (("A", a_case),
                                                                                          ("B", b_case))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    monkeypatch.undo()
    assert got == {"A": ref_a, "B": ref_b}
    assert sched.config.b == 3
    assert [_bits(x) for x in _dense_call(b_case, sched)] == ref_b
    with pytest.raises(flash_mla.SchedMetaMismatchError, match="config.b"):
        _dense_call(a_case, sched)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_shared_scheduler_object_under_contention(framework, fast_switching):
    """Threads with different shapes / lengths share fresh scheduler objects: every call is correct or a
    SchedMetaMismatchError, and afterwards the object still serves its recorded config."""
    if framework == "torch":
        torch = pytest.importorskip("torch")

        def conv(x):
            x = np.ascontiguousarray(x)
            return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16) if x.dtype == BF16 else \
                torch.from_numpy(x.copy())
    else:
        def conv(x):
            return x
    cases = _dense_cases(1)  # b 2, b 3, b 2 with other lengths
    refs = [[_bits(x) for x in _dense_call(c, flash_mla.get_mla_metadata()[0], conv)] for c in cases]
    outcomes = []

    def worker(ci, sched):
        for _ in range(3):
            try:
                ok = [_bits(x) for x in _dense_call(cases[ci], sched, conv)] == refs[ci]
                outcomes.append("ok" if ok else f"WRONG result (case {ci})")
            except flash_mla.SchedMetaMismatchError:
                outcomes.append("mismatch")

    for _ in range(25):
        sched = flash_mla.get_mla_metadata()[0]
        errors = _run_threads(worker, [(t % 3, sched) for t in range(4)])
        assert not errors, errors[0]
        # The object recorded one config and its lengths: the case with both reuses it.
        owner = [ci for ci, c in enumerate(cases)
                 if c.q.shape[0] == sched.config.b and np.array_equal(c.cache_seqlens, sched._lengths[0])]
        assert len(owner) == 1
        assert [_bits(x) for x in _dense_call(cases[owner[0]], sched, conv)] == refs[owner[0]]
    assert all(o in ("ok", "mismatch") for o in outcomes), sorted(set(outcomes))
    assert "ok" in outcomes


def _all_ops(seed):
    rng = np.random.default_rng(seed)
    dense = gen_dense_case(rng, b=3, s_q=2, h_q=16, h_kv=1, d=576, s_k=200, pbs=64, varlen=True, causal=True)
    sparse = gen_sparse_decode_case(rng, b=2, s_q=1, h_q=16, d_qk=576, s_k=300, topk=64, pbs=64,
                                    have_topk_length=True)
    prefill = gen_prefill_case(rng, s_q=8, s_kv=100, topk=32, h_q=16, d_qk=576, sink=True)
    cu_q, cu_k = np.array([0, 7, 7, 20], np.int32), np.array([0, 9, 15, 30], np.int32)
    mha = (randn_bf16(rng, (20, 4, 128)), randn_bf16(rng, (30, 2, 128)), randn_bf16(rng, (30, 2, 128)), cu_q, cu_k,
           randn_bf16(rng, (20, 4, 128)))

    def run(conv):
        res = list(flash_mla.flash_mla_with_kvcache(conv(dense.q), conv(dense.k_cache), conv(dense.block_table),
                                                    conv(dense.cache_seqlens), 512, flash_mla.get_mla_metadata()[0],
                                                    causal=True))
        kw = {k: conv(v) if isinstance(v, np.ndarray) else v for k, v in sparse.kwargs().items()}
        res += flash_mla.flash_mla_with_kvcache(conv(sparse.q), conv(sparse.main.packed), None, None, 512,
                                                flash_mla.get_mla_metadata()[0], **kw)
        res += flash_mla.flash_mla_sparse_fwd(conv(prefill.q), conv(prefill.kv), conv(prefill.indices),
                                              prefill.sm_scale, attn_sink=conv(prefill.attn_sink))
        q, k, v, cq, ck, dout = (conv(x) for x in mha)
        out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cq, ck, 13, 15, causal=True)
        res += [out, lse]
        res += flash_mla.flash_attn_varlen_backward(dout, q, k, v, out, lse, cq, ck, 13, 15, causal=True)
        return [_bits(x) for x in res]

    return run


def test_every_operator_from_several_threads_numpy(fast_switching):
    """Dense and sparse decode, sparse prefill, dense prefill forward and backward from 4 threads at once,
    on NumPy arrays: the bits of the same calls run alone."""
    runs = [_all_ops(seed) for seed in range(2)]
    refs = [run(lambda x: x) for run in runs]
    errors = _run_threads(lambda t: [(runs[(t + i) % 2](lambda x: x) == refs[(t + i) % 2]) or
                                     pytest.fail(f"thread {t}: other bits") for i in range(3)],
                          [(t,) for t in range(4)])
    assert not errors, errors[0]


def test_varlen_autograd_from_several_threads(fast_switching):
    """torch autograd through flash_attn_varlen_func in 4 threads at once: out and the gradients are the bits of
    a lone run."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(3)
    q0, k0, v0 = (torch.randn(*s, generator=gen).bfloat16() for s in ((20, 4, 128), (30, 2, 128), (30, 2, 128)))
    dout = torch.randn(20, 4, 128, generator=gen).bfloat16()
    cu_q, cu_k = torch.tensor([0, 7, 7, 20], dtype=torch.int32), torch.tensor([0, 9, 15, 30], dtype=torch.int32)
    del rng

    def grads():
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out, _ = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 15, causal=True)
        out.backward(dout)
        return [_bits(x) for x in (out, q.grad, k.grad, v.grad)]

    ref = grads()

    def worker():
        for _ in range(5):
            assert grads() == ref

    errors = _run_threads(worker, [()] * 4)
    assert not errors, errors[0]
