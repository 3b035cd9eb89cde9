"""The same calls from NumPy, JAX (CPU) and — when installed — PyTorch (CPU) give identical
values, agree with the oracle, and come back in the caller's framework (that of ``q``).
JAX arrays run as XLA custom calls when jax-tvm-ffi is installed (jax.jit: test_jax_jit.py)."""

import numpy as np
import pytest

import flash_mla
import flash_mla._jax
from mla_test_utils import (BF16, LSE_TOL, assert_same, bits, check_allclose, check_lse, check_out, gen_dense_case,
                            gen_prefill_case, gen_sparse_decode_case, to_jax_cpu)

jax = pytest.importorskip("jax")
jnp = jax.numpy
# These tests run on the CPU reference backend: pin JAX arrays to JAX's CPU device even where JAX
# has a GPU (numpy vs JAX must then agree bit for bit). GPU JAX is covered in tests/gpu.
to_jax = to_jax_cpu


def dense_call(case, conv, sched=None):
    sched = sched if sched is not None else flash_mla.get_mla_metadata()[0]
    return flash_mla.flash_mla_with_kvcache(conv(case.q), conv(case.k_cache), conv(case.block_table),
                                            conv(case.cache_seqlens), 512, sched, None, case.softmax_scale,
                                            case.causal)


@pytest.fixture
def dense(rng):
    return gen_dense_case(rng, b=3, s_q=2, h_q=16, h_kv=2, d=576, s_k=120, varlen=True, zero=[False, True, False],
                          causal=True, softmax_scale=0.3)


@pytest.fixture
def prefill(rng):
    return gen_prefill_case(rng, s_q=6, s_kv=150, topk=128, h_q=16, d_qk=512, sink=True, have_topk_length=True,
                            invalid_frac=0.2, noncontig=False)


def test_dense_decode_numpy_vs_jax(dense):
    import oracle
    out_np, lse_np = dense_call(dense, np.asarray)
    sched = flash_mla.get_mla_metadata()[0]
    out_j, lse_j = dense_call(dense, to_jax, sched)
    assert isinstance(out_np, np.ndarray) and isinstance(lse_np, np.ndarray)
    assert isinstance(out_j, jax.Array) and isinstance(lse_j, jax.Array)
    assert out_j.dtype == jnp.bfloat16 and lse_j.dtype == jnp.float32
    assert out_j.shape == (3, 2, 16, 512) and lse_j.shape == (3, 16, 2)
    assert_same([out_np, lse_np], [out_j, lse_j])
    # Through XLA (jax-tvm-ffi) the schedule lives inside the custom call and is recomputed by every
    # call; through DLPack it comes back in the caller's framework and is reused from there.
    if flash_mla._jax.use_xla(to_jax(dense.q)):
        assert sched.have_initialized and sched.tile_scheduler_metadata is None and sched.num_splits is None
    else:
        assert isinstance(sched.tile_scheduler_metadata, jax.Array) and isinstance(sched.num_splits, jax.Array)
    assert_same([out_np, lse_np], dense_call(dense, to_jax, sched))
    ref_out, ref_lse = oracle.dense_decode(dense.q, dense.k_cache, dense.block_table, dense.cache_seqlens, True, 0.3)
    check_out("out", np.asarray(out_j), ref_out, BF16)
    check_lse("lse", np.asarray(lse_j), ref_lse)


def test_results_follow_the_framework_of_q(dense):
    out_np, _ = dense_call(dense, np.asarray)
    sched = flash_mla.get_mla_metadata()[0]
    out, lse = flash_mla.flash_mla_with_kvcache(to_jax(dense.q), np.asarray(dense.k_cache),
                                                np.asarray(dense.block_table), dense.cache_seqlens, 512, sched,
                                                softmax_scale=0.3, causal=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert_same([out_np], [out])
    out2, _ = flash_mla.flash_mla_with_kvcache(np.asarray(dense.q), to_jax(dense.k_cache),
                                               to_jax(dense.block_table), to_jax(dense.cache_seqlens), 512,
                                               flash_mla.get_mla_metadata()[0], softmax_scale=0.3, causal=True)
    assert isinstance(out2, np.ndarray)
    assert_same([out_np], [out2])


def test_sparse_prefill_numpy_vs_jax(prefill):
    c = prefill
    res_np = flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, sm_scale=c.sm_scale, attn_sink=c.attn_sink,
                                            topk_length=c.topk_length)
    res_j = flash_mla.flash_mla_sparse_fwd(to_jax(c.q), to_jax(c.kv), to_jax(c.indices),
                                           sm_scale=c.sm_scale, attn_sink=to_jax(c.attn_sink),
                                           topk_length=to_jax(c.topk_length))
    assert isinstance(res_j, list) and len(res_j) == 3 and all(isinstance(r, jax.Array) for r in res_j)
    assert all(isinstance(r, np.ndarray) for r in res_np)
    assert_same(res_np, res_j)
    ref_out, ref_max, ref_lse = c.reference()
    check_out("out", np.asarray(res_j[0]), ref_out, BF16)
    check_allclose("max_logits", np.asarray(res_j[1]), ref_max, dtype=np.float32, **LSE_TOL)
    check_allclose("lse", np.asarray(res_j[2]), ref_lse, dtype=np.float32, **LSE_TOL)


def test_sparse_decode_numpy_vs_jax(rng):
    c = gen_sparse_decode_case(rng, b=2, s_q=2, h_q=16, d_qk=512, s_k=150, topk=64, pbs=53, have_topk_length=True,
                               noncontig=False)
    out_np, lse_np = flash_mla.flash_mla_with_kvcache(c.q, c.main.packed, None, None, 512,
                                                      flash_mla.get_mla_metadata()[0], **c.kwargs())
    kw = {k: (to_jax(v) if isinstance(v, np.ndarray) else v) for k, v in c.kwargs().items()}
    # JAX arrays are dense: the padded block stride becomes pbs * 584 (still a valid layout).
    out_j, lse_j = flash_mla.flash_mla_with_kvcache(to_jax(c.q), to_jax(c.main.packed), None, None, 512,
                                                    flash_mla.get_mla_metadata()[0], **kw)
    assert isinstance(out_j, jax.Array)
    assert_same([out_np, lse_np], [out_j, lse_j])
    ref_out, ref_lse = c.reference()
    check_out("out", np.asarray(out_j), ref_out, BF16)
    check_lse("lse", np.asarray(lse_j), ref_lse)


def _memory_owner(a):
    """Walk ``.base`` to the object that owns the memory of a NumPy array."""
    while isinstance(a, np.ndarray):
        assert not a.flags.owndata, "result memory was copied into a NumPy-owned buffer"
        assert a.base is not None
        a = a.base
    return a


def test_numpy_results_are_zero_copy(dense, prefill):
    out, lse = dense_call(dense, np.asarray)
    res = flash_mla.flash_mla_sparse_fwd(prefill.q, prefill.kv, prefill.indices, prefill.sm_scale)
    for arr in (out, lse, *res):
        # NumPy does not own the data: it views the C++ allocation through a DLPack capsule.
        owner = _memory_owner(arr)
        assert type(owner).__name__ == "PyCapsule", type(owner)
    assert out.dtype == BF16 and res[0].dtype == BF16  # bf16 through ml_dtypes, viewing the same bytes


def test_torch_cpu_same_values(dense, prefill):
    torch = pytest.importorskip("torch")
    out_np, lse_np = dense_call(dense, np.asarray)

    def to_torch(x):
        x = np.ascontiguousarray(x)
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)

    out_t, lse_t = dense_call(dense, to_torch)
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.bfloat16
    np.testing.assert_array_equal(out_t.view(torch.int16).numpy().view(np.uint16), bits(out_np))
    np.testing.assert_array_equal(lse_t.numpy(), lse_np)
    c = prefill
    res_np = flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, c.sm_scale)
    res_t = flash_mla.flash_mla_sparse_fwd(to_torch(c.q), to_torch(c.kv), to_torch(c.indices), c.sm_scale)
    np.testing.assert_array_equal(res_t[0].view(torch.int16).numpy().view(np.uint16), bits(res_np[0]))
    np.testing.assert_array_equal(res_t[2].numpy(), res_np[2])


def test_paddle_cpu_same_values(dense, prefill):
    paddle = pytest.importorskip("paddle")
    out_np, lse_np = dense_call(dense, np.asarray)

    def to_paddle(x):
        x = np.ascontiguousarray(x)
        if x.dtype == BF16:
            return paddle.to_tensor(x.astype(np.float32)).astype("bfloat16")  # exact: bf16 -> f32 -> bf16
        return paddle.to_tensor(x)

    def bf16_bits(t):
        return t.astype("float32").numpy().astype(BF16).view(np.uint16)

    out_p, lse_p = dense_call(dense, to_paddle)
    assert isinstance(out_p, paddle.Tensor) and out_p.dtype == paddle.bfloat16
    np.testing.assert_array_equal(bf16_bits(out_p), bits(out_np))
    np.testing.assert_array_equal(lse_p.numpy(), lse_np)
    c = prefill
    res_np = flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, c.sm_scale)
    res_p = flash_mla.flash_mla_sparse_fwd(to_paddle(c.q), to_paddle(c.kv), to_paddle(c.indices), c.sm_scale)
    assert all(isinstance(r, paddle.Tensor) for r in res_p)
    np.testing.assert_array_equal(bf16_bits(res_p[0]), bits(res_np[0]))
    np.testing.assert_array_equal(res_p[1].numpy(), res_np[1])
    np.testing.assert_array_equal(res_p[2].numpy(), res_np[2])


def test_cupy_scratch_for_rejected_shapes_defers_to_the_call_validation():
    """flash_mla/_cupy.py sizes its scratch before the C++ call validates the inputs; for shapes
    the plan rejects (b = 0, h_q % h_kv != 0, h_kv = 0) it must not raise the plan's generic
    message but hand a placeholder to the call, whose validation names the argument."""
    from flash_mla import _cupy

    class _FakeCupy:
        uint8 = "uint8"

        @staticmethod
        def empty(shape, dtype):
            return ("empty", shape, dtype)

    for b, h_q, h_kv in [(0, 16, 1), (2, 16, 3), (2, 16, 0)]:
        assert _cupy._scratch(_FakeCupy, False, 0, b, 1, h_q, h_kv) == ("empty", (1,), "uint8")
        assert (False, 0, b, 1, h_q, h_kv) not in _cupy._SCRATCH


def test_cupy_destination_passing_call_errors_and_values_on_numpy(rng):
    """flash_mla/_cupy.py hands its arrays straight to the destination-passing dense decode (TVM-FFI
    converts them through DLPack inside the call) and turns the call's tagged errors into the core's
    classes. The same function with NumPy arrays on the CPU: values equal to the public API's, and a
    wrong dtype or head_dim_v raises TypeError / ValueError naming the argument, as the public API."""
    from flash_mla import _ffi

    c = gen_dense_case(rng, b=2, s_q=1, h_q=16, h_kv=1, d=576, s_k=100, dtype=np.float16, varlen=True)
    b, s_q, h_q = c.q.shape[:3]
    scale = 576 ** -0.5
    n = max(int(_ffi.lib.decode_scratch_bytes(False, 1, 0, b, s_q, h_q, 1)), 1)

    def call(cache_seqlens=c.cache_seqlens, head_dim_v=512):
        out = np.full((b, s_q, h_q, 512), np.nan, np.float16)
        lse = np.full((b, h_q, s_q), np.nan, np.float32)
        _ffi.call_tagged(_ffi.lib.dense_decode_fwd_dps, c.q, c.k_cache, c.block_table, cache_seqlens, head_dim_v,
                         scale, False, out, lse, np.zeros(n, np.uint8))
        return out, lse

    out, lse = call()
    ref = flash_mla.flash_mla_with_kvcache(c.q, c.k_cache, c.block_table, c.cache_seqlens, 512,
                                           flash_mla.get_mla_metadata()[0], None, scale)
    np.testing.assert_array_equal(out.view(np.uint16), ref[0].view(np.uint16))
    np.testing.assert_array_equal(lse, ref[1])
    with pytest.raises(TypeError, match="cache_seqlens"):
        call(cache_seqlens=c.cache_seqlens.astype(np.int64))
    with pytest.raises(ValueError, match="head_dim_v"):
        call(head_dim_v=256)
    with pytest.raises(RuntimeError, match="boom"):  # an untagged error passes through unchanged
        _ffi.call_tagged(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
