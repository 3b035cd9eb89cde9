"""torch.ops.flash_mla: the native PyTorch op library (stable ABI), on the CPU.

Values against the float64 oracle and bit-identity with the TVM-FFI path, routing of the
public functions, ``torch.library.opcheck`` on every op, ``torch.compile(fullgraph=True)``
of every public function (backends eager / aot_eager), and error classes. GPU versions:
tests/gpu/test_torch_ops_gpu.py.

Skips without torch or without the op library (package built without torch), unless
FLASHMLA_REQUIRE_TORCH_OPS=1 (CI), which turns a missing op library into a failure.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flash_mla  # noqa: E402
import oracle  # noqa: E402
from flash_mla import _torch_ops, quant  # noqa: E402
from mla_test_utils import (BF16, FP16, bits, check_lse, check_out, count_torch_calls,  # noqa: E402,F401
                            gen_dense_case, gen_prefill_case, gen_sparse_decode_case)

if not _torch_ops.available():
    if os.environ.get("FLASHMLA_REQUIRE_TORCH_OPS", "") not in ("", "0"):
        raise RuntimeError(f"torch.ops.flash_mla is required but unavailable: {_torch_ops.load_error()}")
    pytest.skip(f"torch.ops.flash_mla unavailable: {_torch_ops.load_error()}", allow_module_level=True)

OPS = ["dense_decode_fwd", "dense_decode_fwd_scheduled", "sparse_decode_fwd", "sparse_decode_fwd_scheduled",
       "sparse_prefill_fwd", "dense_prefill_fwd", "dense_prefill_bwd", "quantize_kv_cache", "dequantize_kv_cache"]


# ----------------------------------------------------------------------------- conversion helpers
def T(x):
    """NumPy -> torch (CPU), keeping strides (bf16 through an int16 view); None passes through."""
    if x is None:
        return None
    x = np.asarray(x)
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def N(t):
    """torch -> NumPy (bf16 through ml_dtypes)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


# ----------------------------------------------------------------------------- cases
def dense_case(rng, dtype=BF16, causal=False, s_q=1):
    return gen_dense_case(rng, b=3, s_q=s_q, h_q=16, h_kv=1, d=576, s_k=150, dtype=dtype, varlen=True, causal=causal,
                          zero=[False, True, False], noncontig=True)


def dense_args(c, sched):
    return (T(c.q), T(c.k_cache), T(c.block_table), T(c.cache_seqlens), 512, sched, None, c.softmax_scale, c.causal)


def sparse_case(rng, d_qk=576, extra=True):
    return gen_sparse_decode_case(rng, b=2, s_q=2, h_q=64, d_qk=d_qk, s_k=200, topk=64, pbs=64, have_topk_length=True,
                                  extra=dict(s_k=100, topk=32, pbs=32, have_topk_length=True) if extra else None)


def sparse_kwargs(c):
    return {k: T(v) if isinstance(v, np.ndarray) else v for k, v in c.kwargs().items()}


def prefill_case(rng):
    return gen_prefill_case(rng, s_q=5, s_kv=90, topk=64, h_q=16, d_qk=576, sink=True, have_topk_length=True,
                            invalid_frac=0.2)


# ----------------------------------------------------------------------------- registration
def test_every_op_registered_with_schema():
    for name in OPS:
        op = getattr(torch.ops.flash_mla, name).default
        schema = str(op._schema)
        assert schema.startswith(f"flash_mla::{name}("), schema
    assert "Tensor(a!) packed" in str(torch.ops.flash_mla.quantize_kv_cache.default._schema)


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("dtype,causal,s_q", [(BF16, False, 1), (FP16, True, 2), (BF16, True, 3)])
def test_dense_decode_values(rng, count_torch_calls, dtype, causal, s_q):
    c = dense_case(rng, dtype, causal, s_q)
    out, lse = flash_mla.flash_mla_with_kvcache(*dense_args(c, flash_mla.get_mla_metadata()[0]))
    assert count_torch_calls == ["flash_mla.dense_decode_fwd.default"]
    assert isinstance(out, torch.Tensor) and out.dtype == (torch.bfloat16 if dtype == BF16 else torch.float16)
    ref_out, ref_lse = oracle.dense_decode(c.q, c.k_cache, c.block_table, c.cache_seqlens, causal=c.causal)
    check_out("out", N(out), ref_out, dtype)
    check_lse("lse", N(lse), ref_lse)
    # Bit-identical to the TVM-FFI path (same core, same reference backend).
    out_np, lse_np = flash_mla.flash_mla_with_kvcache(c.q, c.k_cache, c.block_table, c.cache_seqlens, 512,
                                                      flash_mla.get_mla_metadata()[0], None, c.softmax_scale, c.causal)
    np.testing.assert_array_equal(bits(N(out)), bits(out_np))
    np.testing.assert_array_equal(N(lse), lse_np)


@pytest.mark.parametrize("d_qk,extra", [(576, True), (512, True), (576, False)])
def test_sparse_decode_values(rng, count_torch_calls, d_qk, extra):
    c = sparse_case(rng, d_qk, extra)
    sched = flash_mla.get_mla_metadata()[0]
    out, lse = flash_mla.flash_mla_with_kvcache(T(c.q), T(c.main.packed), None, None, 512, sched, **sparse_kwargs(c))
    assert count_torch_calls == ["flash_mla.sparse_decode_fwd.default"]
    ref_out, ref_lse = c.reference()
    check_out("out", N(out), ref_out, BF16)
    check_lse("lse", N(lse), ref_lse)
    out_np, lse_np = flash_mla.flash_mla_with_kvcache(c.q, c.main.packed, None, None, 512,
                                                      flash_mla.get_mla_metadata()[0], **c.kwargs())
    np.testing.assert_array_equal(bits(N(out)), bits(out_np))
    np.testing.assert_array_equal(N(lse), lse_np)
    # Scheduler object: filled in the framework of q, reused by the next call (CPU: metadata passed back in).
    assert sched.have_initialized and isinstance(sched.tile_scheduler_metadata, torch.Tensor)
    assert sched.tile_scheduler_metadata.dtype == torch.int32 and sched.tile_scheduler_metadata.shape[1] == 8
    tsm_before = sched.tile_scheduler_metadata.clone()
    out2, lse2 = flash_mla.flash_mla_with_kvcache(T(c.q), T(c.main.packed), None, None, 512, sched, **sparse_kwargs(c))
    # (the reusing call runs the op that takes the schedule and returns (out, lse) only)
    assert count_torch_calls == ["flash_mla.sparse_decode_fwd.default", "flash_mla.sparse_decode_fwd_scheduled.default"]
    assert torch.equal(out2.view(torch.int16), out.view(torch.int16)) and torch.equal(lse2, lse)
    assert torch.equal(sched.tile_scheduler_metadata, tsm_before)


def _flashmla_decode_lse_strides(b, s_q, h_q, h_kv, sparse):
    """The strides of FlashMLA's decode lse (spec §1.3.1, §1.3.2): sparse decode, and dense decode with h_kv == 1,
    return the transpose of a contiguous (b, s_q, h_q) buffer, strides (s_q * h_q, 1, h_q); dense decode with
    h_kv > 1 reshapes a transposed view, a copy (contiguous) when s_q > 1 (with s_q == 1 the stride of the
    size-1 dim is immaterial: contiguous here)."""
    if sparse or h_kv == 1:
        return (s_q * h_q, 1, h_q)
    return (h_q * s_q, s_q, 1)


@pytest.mark.parametrize("h_kv,s_q", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_dense_decode_lse_has_flashmlas_strides(h_kv, s_q):
    """FlashMLA's lse of a dense decode with h_kv == 1 is the non-contiguous (b, h_q, s_q) view with strides
    (s_q * h_q, 1, h_q) (so lse.transpose(1, 2).view(b, -1) works); the op's real and fake kernels, first and
    reusing call, return those strides, and the values stay the contiguous result's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    b, h_q = 2, 8
    q = torch.randn(b, s_q, h_q, 576).to(torch.bfloat16)
    kc = torch.randn(4, 64, h_kv, 576).to(torch.bfloat16)
    bt = torch.arange(4, dtype=torch.int32).view(2, 2)
    lens = torch.tensor([70, 5], dtype=torch.int32)
    want = _flashmla_decode_lse_strides(b, s_q, h_q, h_kv, False)
    sched = flash_mla.get_mla_metadata()[0]
    out, lse = flash_mla.flash_mla_with_kvcache(q, kc, bt, lens, 512, sched, causal=True)
    out2, lse2 = flash_mla.flash_mla_with_kvcache(q, kc, bt, lens, 512, sched, causal=True)  # reusing call
    assert lse.shape == (b, h_q, s_q) and lse.stride() == want and lse2.stride() == want
    assert out.is_contiguous() and torch.equal(lse, lse2)
    ref_out, ref_lse = oracle.dense_decode(N(q), N(kc), N(bt), N(lens), causal=True)
    check_lse("lse", N(lse), ref_lse)
    with FakeTensorMode() as mode:
        fake = torch.ops.flash_mla.dense_decode_fwd(*(mode.from_tensor(t) for t in (q, kc)), 512,
                                                    mode.from_tensor(lens), mode.from_tensor(bt), 0.1, True, None, None)
    assert fake[1].stride() == want


@pytest.mark.parametrize("s_q", [1, 2])
def test_sparse_decode_lse_has_flashmlas_strides(rng, s_q):
    """FlashMLA returns the sparse decode's lse as lse.transpose(1, 2) of a contiguous (b, s_q, h_q) buffer:
    strides (s_q * h_q, 1, h_q), in the real and the fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = gen_sparse_decode_case(rng, b=2, s_q=s_q, h_q=64, d_qk=576, s_k=100, topk=64, pbs=64, have_topk_length=True)
    sched = flash_mla.get_mla_metadata()[0]
    want = _flashmla_decode_lse_strides(2, s_q, 64, 1, True)
    out, lse = flash_mla.flash_mla_with_kvcache(T(c.q), T(c.main.packed), None, None, 512, sched, **sparse_kwargs(c))
    out2, lse2 = flash_mla.flash_mla_with_kvcache(T(c.q), T(c.main.packed), None, None, 512, sched, **sparse_kwargs(c))
    assert lse.stride() == want and lse2.stride() == want and torch.equal(lse, lse2)
    check_lse("lse", N(lse), c.reference()[1])
    kw = sparse_kwargs(c)
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
             for t in (T(c.q), T(c.main.packed), kw["indices"], kw["topk_length"], kw["attn_sink"])]
        fake = torch.ops.flash_mla.sparse_decode_fwd(*f, None, None, None, None, None, 512, 0.1)
    assert fake[1].stride() == want


def test_sparse_prefill_values(rng, count_torch_calls):
    c = prefill_case(rng)
    res = flash_mla.flash_mla_sparse_fwd(T(c.q), T(c.kv), T(c.indices), c.sm_scale, 512, T(c.attn_sink),
                                         T(c.topk_length))
    assert count_torch_calls == ["flash_mla.sparse_prefill_fwd.default"]
    assert isinstance(res, list) and len(res) == 3
    out, max_logits, lse = c.reference()
    check_out("out", N(res[0]), out, BF16)
    check_lse("max_logits", N(res[1]), max_logits)
    check_lse("lse", N(res[2]), lse)
    res_np = flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, c.sm_scale, 512, c.attn_sink, c.topk_length)
    for a, b in zip(res, res_np):
        np.testing.assert_array_equal(bits(N(a)), bits(b))


def test_flash_mla_cuda_module_matches_public_api(rng):
    """flash_mla.cuda (spec §1.1): FlashMLA's native entry points, argument order and returns; values
    against the float64 oracle (fresh random inputs, unused slots poisoned by the generators) and
    bit-identical to the public functions."""
    import flash_mla.cuda as fc

    c = dense_case(rng, BF16, True, 2)
    scale = c.softmax_scale if c.softmax_scale is not None else 576 ** -0.5
    res = fc.dense_decode_fwd(T(c.q), T(c.k_cache), 512, T(c.cache_seqlens), T(c.block_table), scale, c.causal,
                              None, None)
    assert len(res) == 4 and res[2].dtype == torch.int32 and res[2].shape[1] == 8 and res[3].shape == (4,)
    ref_out, ref_lse = oracle.dense_decode(c.q, c.k_cache, c.block_table, c.cache_seqlens, causal=c.causal)
    check_out("out", N(res[0]), ref_out, BF16)
    check_lse("lse", N(res[1]), ref_lse)
    out, lse = flash_mla.flash_mla_with_kvcache(*dense_args(c, flash_mla.get_mla_metadata()[0]))
    assert torch.equal(res[0].view(torch.int16), out.view(torch.int16)) and torch.equal(res[1], lse)
    again = fc.dense_decode_fwd(T(c.q), T(c.k_cache), 512, T(c.cache_seqlens), T(c.block_table), scale, c.causal,
                                res[2], res[3])  # metadata passed back in, as FlashMLA's wrapper does
    assert torch.equal(again[0].view(torch.int16), out.view(torch.int16))
    assert again[2] is res[2] and again[3] is res[3]  # handed back, as FlashMLA's wrapper stores them

    s = sparse_case(rng)
    kw = sparse_kwargs(s)
    res = fc.sparse_decode_fwd(T(s.q), T(s.main.packed), kw["indices"], kw["topk_length"], kw["attn_sink"], None,
                               None, kw["extra_k_cache"], kw["extra_indices_in_kvcache"], kw["extra_topk_length"], 512,
                               kw["softmax_scale"])
    ref_out, ref_lse = s.reference()
    check_out("out", N(res[0]), ref_out, BF16)
    check_lse("lse", N(res[1]), ref_lse)
    out, lse = flash_mla.flash_mla_with_kvcache(T(s.q), T(s.main.packed), None, None, 512,
                                                flash_mla.get_mla_metadata()[0], **kw)
    assert torch.equal(res[0].view(torch.int16), out.view(torch.int16)) and torch.equal(res[1], lse)

    p = prefill_case(rng)
    res = fc.sparse_prefill_fwd(T(p.q), T(p.kv), T(p.indices), p.sm_scale, 512, T(p.attn_sink), T(p.topk_length))
    ref_out, ref_max, ref_lse = p.reference()
    check_out("out", N(res[0]), ref_out, BF16)
    check_lse("max_logits", N(res[1]), ref_max)
    check_lse("lse", N(res[2]), ref_lse)
    ref = flash_mla.flash_mla_sparse_fwd(T(p.q), T(p.kv), T(p.indices), p.sm_scale, 512, T(p.attn_sink),
                                         T(p.topk_length))
    for a, b in zip(res, ref):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)

    with pytest.raises(ValueError, match="d_v"):
        fc.sparse_prefill_fwd(T(p.q), T(p.kv), T(p.indices), p.sm_scale, 256)
    with pytest.raises(TypeError, match=r"^kv: expected a torch.Tensor, got ndarray"):
        fc.sparse_prefill_fwd(T(p.q), p.kv, T(p.indices), p.sm_scale)
    with pytest.raises(TypeError, match=r"^softmax_scale: expected a float"):
        fc.dense_decode_fwd(T(c.q), T(c.k_cache), 512, T(c.cache_seqlens), T(c.block_table), None, c.causal)


def test_flash_mla_cuda_metadata_and_optional_arguments_errors(rng):
    """flash_mla.cuda: the scheduler metadata handed back in and the optional tensors of sparse decode / prefill
    that are not torch tensors raise TypeError naming the argument (as its required tensors do), not the
    dispatcher's RuntimeError; wrong dtypes / shapes / devices of given metadata raise the core's errors."""
    import flash_mla.cuda as fc

    c = dense_case(rng)
    args = (T(c.q), T(c.k_cache), 512, T(c.cache_seqlens), T(c.block_table), 576 ** -0.5, c.causal)
    _, _, tsm, ns = fc.dense_decode_fwd(*args)
    for bad_tsm, bad_ns, name in ((tsm.numpy(), ns, "tile_scheduler_metadata"), (tsm, ns.tolist(), "num_splits"),
                                  ([1, 2], ns, "tile_scheduler_metadata")):
        with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor or None, got "):
            fc.dense_decode_fwd(*args, bad_tsm, bad_ns)
    with pytest.raises(TypeError, match=r"^tile_scheduler_metadata: expected dtype int32, got int64"):
        fc.dense_decode_fwd(*args, tsm.long(), ns)
    with pytest.raises(ValueError, match=r"^num_splits: expected shape \(4,\) for this call"):
        fc.dense_decode_fwd(*args, tsm, ns[:-1])
    with pytest.raises(ValueError, match=r"^tile_scheduler_metadata is on meta but q is on cpu"):
        fc.dense_decode_fwd(*args, tsm.to("meta"), ns)
    with pytest.raises(ValueError, match=r"^tile_scheduler_metadata and num_splits must be given together"):
        fc.dense_decode_fwd(*args, tsm, None)

    s = sparse_case(rng)
    kw = sparse_kwargs(s)
    names = ("topk_length", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")
    sargs = dict(q=T(s.q), k_cache=T(s.main.packed), indices=kw["indices"], tile_scheduler_metadata=None,
                 num_splits=None, head_dim_v=512, softmax_scale=kw["softmax_scale"], **{n: kw[n] for n in names})
    for name in names + ("tile_scheduler_metadata",):
        bad = dict(sargs)
        bad[name] = np.zeros(3, np.int32)
        with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor or None, got ndarray"):
            fc.sparse_decode_fwd(**bad)
    p = prefill_case(rng)
    for i, name in ((5, "attn_sink"), (6, "topk_length")):
        pargs = [T(p.q), T(p.kv), T(p.indices), p.sm_scale, 512, None, None]
        pargs[i] = np.zeros(3, np.float32)
        with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor or None, got ndarray"):
            fc.sparse_prefill_fwd(*pargs)


@pytest.mark.parametrize("d_qk", [576, 512])
def test_quant_helpers_through_torch_ops(rng, count_torch_calls, d_qk):
    kv = np.clip(rng.standard_normal((3, 16, 1, d_qk)) * 0.3, -2, 2).astype(np.float32).astype(BF16)
    packed_t = quant.quantize_k_cache(T(kv))
    dq_t = quant.dequantize_k_cache(packed_t, d_qk=d_qk)
    assert count_torch_calls == ["flash_mla.quantize_kv_cache.default", "flash_mla.dequantize_kv_cache.default"]
    packed_np = quant.quantize_k_cache(kv)
    assert tuple(packed_t.stride()) == tuple(s // packed_np.itemsize for s in packed_np.strides)
    np.testing.assert_array_equal(N(packed_t), np.asarray(packed_np))
    np.testing.assert_array_equal(N(packed_t), oracle.quantize_cache(kv))
    np.testing.assert_array_equal(bits(N(dq_t)), bits(quant.dequantize_k_cache(packed_np, d_qk=d_qk)))


def test_reusing_call_runs_the_scheduled_op(rng, count_torch_calls):
    """A call that reuses a FlashMLASchedMeta runs dense_decode_fwd_scheduled (the schedule in, (out, lse) out:
    no empty metadata outputs); same bits as the call that computed the schedule, the schedule kept."""
    c = dense_case(rng)
    sched = flash_mla.get_mla_metadata()[0]
    out, lse = flash_mla.flash_mla_with_kvcache(*dense_args(c, sched))
    tsm, ns = sched.tile_scheduler_metadata, sched.num_splits
    out2, lse2 = flash_mla.flash_mla_with_kvcache(*dense_args(c, sched))
    assert count_torch_calls == ["flash_mla.dense_decode_fwd.default", "flash_mla.dense_decode_fwd_scheduled.default"]
    assert torch.equal(out2.view(torch.int16), out.view(torch.int16)) and torch.equal(lse2, lse)
    assert sched.tile_scheduler_metadata is tsm and sched.num_splits is ns
    # The op validates the given schedule as dense_decode_fwd does (the core's ValueError, naming it).
    args = (T(c.q), T(c.k_cache), 512, T(c.cache_seqlens), T(c.block_table), 576 ** -0.5, c.causal)
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        _torch_ops.dense_decode_fwd_scheduled(*args, tsm[:-1], ns)
    with pytest.raises(ValueError, match="num_splits"):
        _torch_ops.dense_decode_fwd_scheduled(*args, tsm, ns[:-1])


def test_disabled_torch_ops_fall_back_to_tvm_ffi(rng, count_torch_calls, monkeypatch):
    c = dense_case(rng)
    ref = flash_mla.flash_mla_with_kvcache(*dense_args(c, flash_mla.get_mla_metadata()[0]))
    monkeypatch.setattr(_torch_ops, "handles", lambda *a: False)
    out, lse = flash_mla.flash_mla_with_kvcache(*dense_args(c, flash_mla.get_mla_metadata()[0]))
    assert count_torch_calls == ["flash_mla.dense_decode_fwd.default"]  # only the first call
    assert isinstance(out, torch.Tensor) and torch.equal(out.view(torch.int16), ref[0].view(torch.int16))


def test_mixed_frameworks_take_tvm_ffi(rng, count_torch_calls):
    c = dense_case(rng)
    out, _ = flash_mla.flash_mla_with_kvcache(T(c.q), c.k_cache, T(c.block_table), c.cache_seqlens, 512,
                                              flash_mla.get_mla_metadata()[0], None, c.softmax_scale, c.causal)
    assert count_torch_calls == [] and isinstance(out, torch.Tensor)


# ----------------------------------------------------------------------------- FlashMLASchedMeta semantics
def test_sched_meta_changed_lengths_raise_on_cpu(rng):
    c = dense_case(rng)
    sched = flash_mla.get_mla_metadata()[0]
    flash_mla.flash_mla_with_kvcache(*dense_args(c, sched))
    c.cache_seqlens = c.cache_seqlens.copy()
    c.cache_seqlens[0] -= 1
    with pytest.raises(flash_mla.SchedMetaMismatchError, match="cache_seqlens"):
        flash_mla.flash_mla_with_kvcache(*dense_args(c, sched))
    with pytest.raises(AssertionError):
        flash_mla.flash_mla_with_kvcache(*dense_args(dense_case(rng, s_q=2), sched))


def test_sched_meta_filled_on_another_device_is_recomputed_on_cpu(rng):
    """A FlashMLASchedMeta holds no device in its config, so a CPU call of the same shapes and lengths may reuse
    one that a call on another device filled (here a shape pass on the ``meta`` device; on a GPU host a CUDA
    call): the CPU call recomputes the schedule on its own device and matches the reference (it raised a device
    error naming tile_scheduler_metadata)."""
    c = dense_case(rng)
    sched = flash_mla.get_mla_metadata()[0]
    args = dense_args(c, sched)
    meta_out, _ = flash_mla.flash_mla_with_kvcache(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    assert meta_out.device.type == "meta" and sched.tile_scheduler_metadata.device.type == "meta"
    ref_out, ref_lse = oracle.dense_decode(c.q, c.k_cache, c.block_table, c.cache_seqlens, causal=c.causal)
    for _ in range(2):  # the recomputing call, then one that reuses the CPU schedule it stored
        out, lse = flash_mla.flash_mla_with_kvcache(*args)
        check_out("out", N(out), ref_out, BF16)
        check_lse("lse", N(lse), ref_lse)
        assert sched.tile_scheduler_metadata.is_cpu and sched.num_splits.is_cpu
    # NumPy on the CPU likewise
    sched = flash_mla.get_mla_metadata()[0]
    flash_mla.flash_mla_with_kvcache(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in dense_args(c, sched)])
    out, lse = flash_mla.flash_mla_with_kvcache(c.q, c.k_cache, c.block_table, c.cache_seqlens, 512, sched, None,
                                                c.softmax_scale, c.causal)
    check_out("out", out, ref_out, BF16)
    check_lse("lse", lse, ref_lse)


def test_sched_meta_reuse_with_malformed_lengths_reports_the_malformation(rng):
    """A reusing call whose length tensor has the wrong shape or dtype gets the error a fresh call gets
    (naming cache_seqlens / topk_length and what was expected), not "values differ" from the schedule check."""
    c = dense_case(rng)
    sched = flash_mla.get_mla_metadata()[0]
    args = list(dense_args(c, sched))
    flash_mla.flash_mla_with_kvcache(*args)
    lens = args[3]
    for bad, err, msg in ((torch.cat([lens, lens[:1] + 1]), ValueError, r"^cache_seqlens: expected shape \(3,\)"),
                          (lens.reshape(3, 1), ValueError, r"^cache_seqlens: expected"),
                          ((lens + 1).long(), TypeError, r"^cache_seqlens: expected dtype int32, got int64")):
        args[3] = bad
        with pytest.raises(err, match=msg) as info:
            flash_mla.flash_mla_with_kvcache(*args)
        assert not isinstance(info.value, flash_mla.SchedMetaMismatchError)
    s = sparse_case(rng)
    kw = sparse_kwargs(s)
    sched = flash_mla.get_mla_metadata()[0]
    flash_mla.flash_mla_with_kvcache(T(s.q), T(s.main.packed), None, None, 512, sched, **kw)
    kw["topk_length"] = kw["topk_length"][:1] + 1
    with pytest.raises(ValueError, match=r"^topk_length: expected shape") as info:
        flash_mla.flash_mla_with_kvcache(T(s.q), T(s.main.packed), None, None, 512, sched, **kw)
    assert not isinstance(info.value, flash_mla.SchedMetaMismatchError)


# ----------------------------------------------------------------------------- opcheck
def _op_samples(rng):
    d = gen_dense_case(rng, b=2, s_q=2, h_q=16, h_kv=1, d=576, s_k=70, varlen=True, causal=True)
    s = sparse_case(rng, 576, True)
    m = sparse_case(rng, 512, False)
    p = prefill_case(rng)
    kv = np.clip(rng.standard_normal((2, 8, 1, 576)) * 0.3, -2, 2).astype(np.float32).astype(BF16)
    packed = T(oracle.quantize_cache(kv)).clone()
    sc = s.kwargs()
    samples = {
        "dense_decode_fwd": [
            (T(d.q), T(d.k_cache), 512, T(d.cache_seqlens), T(d.block_table), 576**-0.5, True, None, None),
        ],
        "sparse_decode_fwd": [
            (T(s.q), T(s.main.packed), T(s.main.indices), T(sc["topk_length"]), T(sc["attn_sink"]), None, None,
             T(sc["extra_k_cache"]), T(sc["extra_indices_in_kvcache"]), T(sc["extra_topk_length"]), 512,
             s.softmax_scale),
            (T(m.q), T(m.main.packed), T(m.main.indices), T(m.main.topk_length), None, None, None, None, None, None,
             512, 0.1),
        ],
        "sparse_prefill_fwd": [
            (T(p.q), T(p.kv), T(p.indices), p.sm_scale, 512, T(p.attn_sink), T(p.topk_length)),
            (T(p.q), T(p.kv), T(p.indices), p.sm_scale, 512, None, None),
        ],
        "quantize_kv_cache": [(T(kv), torch.zeros_like(packed), 2)],
        "dequantize_kv_cache": [(packed, torch.empty(2, 8, 1, 576, dtype=torch.bfloat16), 2)],
    }
    # Dense MHA prefill: bf16 MHA and fp16 GQA, varlen with an empty request, causal and not.
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 5, 7, 12], dtype=torch.int32)
    for dt, h_kv, d_qk, causal in ((torch.bfloat16, 4, 192, True), (torch.float16, 2, 128, False)):
        q, k, v = (torch.randn(n, h, d).to(dt) for n, h, d in ((8, 4, d_qk), (12, h_kv, d_qk), (12, h_kv, 128)))
        fwd_args = (q, k, v, cu_q, cu_k, 5, 5, d_qk ** -0.5, causal)
        samples.setdefault("dense_prefill_fwd", []).append(fwd_args)
        out, lse = torch.ops.flash_mla.dense_prefill_fwd(*fwd_args)
        samples.setdefault("dense_prefill_bwd", []).append(
            (torch.randn(8, 4, 128).to(dt), q, k, v, out, lse, cu_q, cu_k, 5, 5, d_qk ** -0.5, causal))
    # Metadata passed back in (the CPU reuse path): outputs are fresh copies, never aliases.
    _, _, tsm, ns = torch.ops.flash_mla.dense_decode_fwd(*samples["dense_decode_fwd"][0])
    samples["dense_decode_fwd"].append(samples["dense_decode_fwd"][0][:7] + (tsm, ns))
    samples["dense_decode_fwd_scheduled"] = [samples["dense_decode_fwd"][0][:7] + (tsm, ns)]
    # The *_scheduled ops: the schedule an earlier call of the same shapes and lengths computed.
    samples["sparse_decode_fwd_scheduled"] = []
    for args in samples["sparse_decode_fwd"]:
        _, _, tsm, ns = torch.ops.flash_mla.sparse_decode_fwd(*args)
        samples["sparse_decode_fwd_scheduled"].append(args[:5] + (tsm, ns) + args[7:])
    return samples


@pytest.mark.parametrize("name", OPS)
def test_opcheck(rng, name):
    for args in _op_samples(rng)[name]:
        torch.library.opcheck(getattr(torch.ops.flash_mla, name).default, args)


def test_schedule_key_tracks_length_tensor_identity_and_version():
    """The key under which GPU calls share a split schedule (flash_mla_interface, _torch_ops.schedule_key):
    equal only for the same length tensors at the same versions, on the same device, outside captures."""
    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    lens = torch.tensor([5, 7], dtype=torch.int32)
    k1 = _torch_ops.schedule_key(q, (lens,))
    assert _torch_ops.same_schedule_key(k1, _torch_ops.schedule_key(q, (lens,)))
    lens.copy_(torch.tensor([5, 8], dtype=torch.int32))  # in-place write: new version
    k2 = _torch_ops.schedule_key(q, (lens,))
    assert not _torch_ops.same_schedule_key(k1, k2)
    lens[0] = 6  # indexing writes bump it too
    assert not _torch_ops.same_schedule_key(k2, _torch_ops.schedule_key(q, (lens,)))
    other = lens.clone()  # equal values, another tensor
    assert not _torch_ops.same_schedule_key(_torch_ops.schedule_key(q, (lens,)), _torch_ops.schedule_key(q, (other,)))
    # optional lengths: None must match None only
    kn = _torch_ops.schedule_key(q, (lens, None))
    assert _torch_ops.same_schedule_key(kn, _torch_ops.schedule_key(q, (lens, None)))
    assert not _torch_ops.same_schedule_key(kn, _torch_ops.schedule_key(q, (lens, other)))
    assert not _torch_ops.same_schedule_key(None, kn) and not _torch_ops.same_schedule_key(kn, None)
    # storage swapped under the same tensor object without a version bump: .data assignment, swap_tensors
    k3 = _torch_ops.schedule_key(q, (lens,))
    lens.data = torch.tensor([9, 9], dtype=torch.int32)
    assert not _torch_ops.same_schedule_key(k3, _torch_ops.schedule_key(q, (lens,)))
    k4 = _torch_ops.schedule_key(q, (lens, other))
    swapped = torch.tensor([1, 2], dtype=torch.int32)
    torch.utils.swap_tensors(lens, swapped)
    assert not _torch_ops.same_schedule_key(k4, _torch_ops.schedule_key(q, (lens, other)))
    # the key keeps its tensors alive: their memory cannot pass to another tensor while it is held
    import weakref

    tmp = lens.clone()
    alive = weakref.ref(tmp)
    kt = _torch_ops.schedule_key(q, (tmp,))
    del tmp
    assert alive() is not None and _torch_ops.same_schedule_key(kt, _torch_ops.schedule_key(q, (alive(),)))
    del kt
    assert alive() is None


def test_fake_kernels_match_real_shapes(rng):
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, cases in _op_samples(rng).items():
        if name.endswith("quantize_kv_cache"):
            continue
        op = getattr(torch.ops.flash_mla, name).default
        for args in cases:
            real = op(*args)
            with FakeTensorMode() as mode:
                fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                fake = op(*fargs)
            for r, f in zip(real, fake):
                assert r.shape == f.shape and r.dtype == f.dtype and r.device == f.device, name


# ----------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_every_public_function(rng, backend):
    torch._dynamo.reset()
    dc, sc, pc = dense_case(rng), sparse_case(rng, 576, True), prefill_case(rng)
    skw = sparse_kwargs(sc)

    def dense_fn(q, k, bt, lens):
        sched, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(q, k, bt, lens, 512, sched, None, None, dc.causal)

    def sparse_fn(q, k, sched):
        return flash_mla.flash_mla_with_kvcache(q, k, None, None, 512, sched, **skw)

    def prefill_fn(q, kv, idx, sink, lens):
        out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, pc.sm_scale, 512, sink, lens)
        return out.float() * 2, max_logits, lse

    def quant_fn(kv, packed):
        torch.ops.flash_mla.quantize_kv_cache(kv, packed, 2)
        out = torch.empty(kv.shape, dtype=torch.bfloat16)
        torch.ops.flash_mla.dequantize_kv_cache(packed, out, 2)
        return out

    dargs = (T(dc.q), T(dc.k_cache), T(dc.block_table), T(dc.cache_seqlens))
    ref = dense_fn(*dargs)
    got = torch.compile(dense_fn, fullgraph=True, backend=backend)(*dargs)
    for a, b in zip(got, ref):
        assert torch.equal(a.float(), b.float())

    sched_e, sched_c = flash_mla.get_mla_metadata()[0], flash_mla.get_mla_metadata()[0]
    compiled = torch.compile(sparse_fn, fullgraph=True, backend=backend)
    for _ in range(2):  # second call: the scheduler object is reused (metadata passed back in)
        ref = sparse_fn(T(sc.q), T(sc.main.packed), sched_e)
        got = compiled(T(sc.q), T(sc.main.packed), sched_c)
        for a, b in zip(got, ref):
            assert torch.equal(a.float(), b.float())
    assert sched_c.have_initialized and torch.equal(sched_c.tile_scheduler_metadata, sched_e.tile_scheduler_metadata)

    pargs = (T(pc.q), T(pc.kv), T(pc.indices), T(pc.attn_sink), T(pc.topk_length))
    ref = prefill_fn(*pargs)
    got = torch.compile(prefill_fn, fullgraph=True, backend=backend)(*pargs)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)

    kv = T(np.clip(rng.standard_normal((2, 8, 1, 576)) * 0.3, -2, 2).astype(np.float32).astype(BF16))
    p1, p2 = torch.zeros(2, 8, 1, 656, dtype=torch.uint8), torch.zeros(2, 8, 1, 656, dtype=torch.uint8)
    ref = quant_fn(kv, p1)
    got = torch.compile(quant_fn, fullgraph=True, backend=backend)(kv, p2)
    assert torch.equal(p1, p2) and torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_compile_dynamic_shapes_default_softmax_scale(rng):
    """torch.compile(fullgraph=True, dynamic=True): every dimension symbolic, d_qk included. The default
    softmax_scale (d_qk ** -0.5) is a constant of the graph (d_qk specialised), not a symbolic float that
    the finiteness check cannot trace (which failed with "torch.* op returned non-Tensor"); a decode step of
    three layers sharing one scheduler object, sparse decode and dense prefill, each equal to eager."""
    torch._dynamo.reset()
    dc, sc = dense_case(rng), sparse_case(rng, 576, True)
    skw = sparse_kwargs(sc)
    skw.pop("softmax_scale", None)

    def dense_step(q, k, bt, lens):
        sched, _ = flash_mla.get_mla_metadata()
        outs = [flash_mla.flash_mla_with_kvcache(q * (i + 1), k, bt, lens, 512, sched, None, None, dc.causal)
                for i in range(3)]
        return [t for o in outs for t in o]

    def sparse_fn(q, k):
        return flash_mla.flash_mla_with_kvcache(q, k, None, None, 512, flash_mla.get_mla_metadata()[0], **skw)

    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 5, 7, 12], dtype=torch.int32)

    def prefill_fn(q, k, v):
        return flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)

    pq, pk, pv = (torch.randn(n, 4, d).to(torch.bfloat16) for n, d in ((8, 192), (12, 192), (12, 128)))
    for fn, args in ((dense_step, (T(dc.q), T(dc.k_cache), T(dc.block_table), T(dc.cache_seqlens))),
                     (sparse_fn, (T(sc.q), T(sc.main.packed))), (prefill_fn, (pq, pk, pv))):
        ref = fn(*args)
        got = torch.compile(fn, fullgraph=True, backend="eager", dynamic=True)(*args)
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert torch.equal(a.float(), b.float()), fn.__name__


# ----------------------------------------------------------------------------- errors
def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None, None


@pytest.mark.parametrize("bad", ["q_dtype", "q_head_dim", "lens_dtype", "head_dim_v", "block_table_shape",
                                 "noncontig_last"])
def test_dense_errors_same_as_tvm_ffi(rng, bad, count_torch_calls):
    c = dense_case(rng)
    args = dict(q=c.q, k_cache=c.k_cache, block_table=c.block_table, cache_seqlens=c.cache_seqlens, head_dim_v=512)
    if bad == "q_dtype":
        args["q"] = c.q.astype(np.float32)
    elif bad == "q_head_dim":
        args["q"] = np.ascontiguousarray(c.q[..., :500])
    elif bad == "lens_dtype":
        args["cache_seqlens"] = c.cache_seqlens.astype(np.int64)
    elif bad == "head_dim_v":
        args["head_dim_v"] = 256
    elif bad == "block_table_shape":
        args["block_table"] = np.ascontiguousarray(c.block_table[:1])
    elif bad == "noncontig_last":
        args["k_cache"] = np.ascontiguousarray(np.swapaxes(c.k_cache, 0, 1)).swapaxes(0, 1)[..., ::1].copy()
        args["q"] = np.zeros(c.q.shape[:-1] + (c.q.shape[-1] * 2,), c.q.dtype)[..., ::2]

    def run(conv):
        a = {k: conv(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
        return lambda: flash_mla.flash_mla_with_kvcache(tile_scheduler_metadata=flash_mla.get_mla_metadata()[0], **a)

    if bad == "noncontig_last":  # torch.from_numpy of a stride-2 bf16 view: build the torch tensor directly
        tq = torch.zeros(c.q.shape[:-1] + (c.q.shape[-1] * 2,), dtype=torch.bfloat16)[..., ::2]
        t_err = _error_of(lambda: flash_mla.flash_mla_with_kvcache(
            tq, T(c.k_cache), T(c.block_table), T(c.cache_seqlens), 512, flash_mla.get_mla_metadata()[0]))
    else:
        t_err = _error_of(run(T))
    n_err = _error_of(run(lambda x: x))
    assert n_err[0] is not None and t_err[0] is n_err[0], (t_err, n_err)
    assert t_err[1] == n_err[1]
    assert not t_err[1].startswith("[flash_mla:")
    assert count_torch_calls  # the torch call did reach torch.ops.flash_mla


def test_prefill_and_sparse_errors(rng):
    p = prefill_case(rng)
    with pytest.raises(TypeError, match="indices"):
        flash_mla.flash_mla_sparse_fwd(T(p.q), T(p.kv), T(p.indices.astype(np.int64)), p.sm_scale)
    with pytest.raises(ValueError, match="d_v"):
        flash_mla.flash_mla_sparse_fwd(T(p.q), T(p.kv), T(p.indices), p.sm_scale, d_v=256)
    with pytest.raises(ValueError, match="attn_sink"):
        flash_mla.flash_mla_sparse_fwd(T(p.q), T(p.kv), T(p.indices), p.sm_scale, 512, torch.zeros(3))
    s = sparse_case(rng)
    kw = sparse_kwargs(s)
    kw["indices"] = kw["indices"][:, :1]
    with pytest.raises(ValueError, match="indices"):
        flash_mla.flash_mla_with_kvcache(T(s.q), T(s.main.packed), None, None, 512, flash_mla.get_mla_metadata()[0],
                                         **kw)
    # The raw op carries the class as a prefix of a RuntimeError (the stable ABI cannot pick the class).
    with pytest.raises(RuntimeError, match=r"^\[flash_mla:ValueError\] d_v"):
        torch.ops.flash_mla.sparse_prefill_fwd(T(p.q), T(p.kv), T(p.indices), p.sm_scale, 256)
    with pytest.raises(RuntimeError, match=r"\[flash_mla:ValueError\] format"):
        torch.ops.flash_mla.quantize_kv_cache(torch.zeros(1, 1, 1, 576, dtype=torch.bfloat16),
                                              torch.zeros(1, 1, 1, 656, dtype=torch.uint8), 7)


def test_meta_device_tensors_use_fake_kernels():
    q = torch.empty(4, 2, 64, 576, dtype=torch.bfloat16, device="meta")
    k = torch.empty(10, 64, 1, 656, dtype=torch.uint8, device="meta")
    idx = torch.empty(4, 2, 128, dtype=torch.int32, device="meta")
    out, lse, tsm, ns = torch.ops.flash_mla.sparse_decode_fwd(q, k, idx, None, None, None, None, None, None, None,
                                                               512, 0.1)
    assert out.shape == (4, 2, 64, 512) and out.dtype == torch.bfloat16 and lse.shape == (4, 64, 2)
    assert tsm.shape[1] == 8 and ns.shape == (5,) and out.device.type == "meta"


def test_mixed_meta_and_cpu_tensors_raise(rng):
    """One tensor on ``meta`` and the rest on the CPU raises the core's device error instead of going
    to the fake kernels (which would return uninitialised outputs)."""
    q = torch.randn(2, 1, 4, 576).to(torch.bfloat16)
    kc = torch.randn(4, 64, 1, 576).to(torch.bfloat16)
    bt = torch.arange(4, dtype=torch.int32).reshape(2, 2)
    sl = torch.tensor([70, 3], dtype=torch.int32)
    dense = dict(q=q, k_cache=kc, block_table=bt, cache_seqlens=sl)
    for name in dense:
        args = dict(dense)
        args[name] = args[name].to("meta")
        other = "k_cache" if name == "q" else name
        with pytest.raises(ValueError, match=rf"^{other} is on .* but q is on .*: all tensors must be on the same device"):
            flash_mla.flash_mla_with_kvcache(args["q"], args["k_cache"], args["block_table"], args["cache_seqlens"],
                                             512, flash_mla.get_mla_metadata()[0])
    s = sparse_case(rng)
    kw = sparse_kwargs(s)
    kw["indices"] = kw["indices"].to("meta")
    with pytest.raises(ValueError, match=r"^indices is on meta but q is on cpu"):
        flash_mla.flash_mla_with_kvcache(T(s.q), T(s.main.packed), None, None, 512, flash_mla.get_mla_metadata()[0],
                                         **kw)
    p = prefill_case(rng)
    with pytest.raises(ValueError, match=r"^kv is on meta but q is on cpu"):
        flash_mla.flash_mla_sparse_fwd(T(p.q), T(p.kv).to("meta"), T(p.indices), p.sm_scale)
    with pytest.raises(ValueError, match=r"^packed is on meta but kv_cache is on cpu"):
        torch.ops.flash_mla.quantize_kv_cache(torch.zeros(1, 1, 1, 576, dtype=torch.bfloat16),
                                              torch.zeros(1, 1, 1, 656, dtype=torch.uint8, device="meta"), 0)
    # every tensor on meta still takes the fake kernel (torch.compile / FakeTensor)
    out = flash_mla.flash_mla_sparse_fwd(T(p.q).to("meta"), T(p.kv).to("meta"), T(p.indices).to("meta"), p.sm_scale)
    assert out[0].device.type == "meta"


def test_first_call_inside_torch_compile_fresh_process(tmp_path):
    """flash_mla imported before torch, first call of the process inside torch.compile(fullgraph=True):
    the op library is loaded during tracing (as a Dynamo constant) without a graph break."""
    import subprocess
    import sys

    script = tmp_path / "first_call.py"
    script.write_text(
        "import flash_mla, torch\n"
        "q = torch.randn(2, 1, 16, 576).to(torch.bfloat16)\n"
        "k = torch.randn(4, 64, 1, 576).to(torch.bfloat16)\n"
        "bt = torch.arange(4, dtype=torch.int32).reshape(2, 2)\n"
        "ln = torch.tensor([70, 100], dtype=torch.int32)\n"
        "def f(q, k, bt, ln):\n"
        "    s, _ = flash_mla.get_mla_metadata()\n"
        "    return flash_mla.flash_mla_with_kvcache(q, k, bt, ln, 512, s)\n"
        "out, lse = torch.compile(f, fullgraph=True, backend='eager')(q, k, bt, ln)\n"
        "ref = f(q, k, bt, ln)\n"
        "assert torch.equal(out.view(torch.int16), ref[0].view(torch.int16)) and torch.equal(lse, ref[1])\n"
        "print('OK')\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_schedule_key_with_inference_mode_lengths_never_reuses():
    """Length tensors made under torch.inference_mode() (how serving engines run decode) have no
    version counter: reading t._version raises, so schedule_key must not read it and must never
    allow reuse (an in-place write to such a tensor cannot be detected)."""
    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        lens = torch.tensor([5, 7], dtype=torch.int32)
        k1 = _torch_ops.schedule_key(q, (lens,))
        k2 = _torch_ops.schedule_key(q, (lens,))
        assert not _torch_ops.same_schedule_key(k1, k2)
        lens.add_(1)  # invisible to any version check
        assert not _torch_ops.same_schedule_key(k1, _torch_ops.schedule_key(q, (lens, None)))
