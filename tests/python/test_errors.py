"""Bad input raises a clear Python exception naming the argument — never a
crash, a hang or a silent wrong answer. (Mixed CPU/CUDA tensors: tests/gpu.)"""

import re

import numpy as np
import pytest

import flash_mla
import oracle
from mla_test_utils import BF16, FP16, gen_dense_case, gen_prefill_case, gen_sparse_decode_case


@pytest.fixture
def dense(rng):
    return gen_dense_case(rng, b=2, s_q=1, h_q=16, h_kv=2, d=576, s_k=100, varlen=True)


@pytest.fixture
def sparse(rng):
    return gen_sparse_decode_case(rng, b=2, s_q=1, h_q=16, d_qk=576, s_k=100, topk=64, pbs=64, noncontig=False)


@pytest.fixture
def prefill(rng):
    return gen_prefill_case(rng, s_q=3, s_kv=80, topk=64, h_q=16, d_qk=512, noncontig=False)


def call_dense(c, **over):
    args = dict(q=c.q, k_cache=c.k_cache, block_table=c.block_table, cache_seqlens=c.cache_seqlens, head_dim_v=512,
                tile_scheduler_metadata=flash_mla.get_mla_metadata()[0], causal=c.causal)
    args.update(over)
    return flash_mla.flash_mla_with_kvcache(**args)


def call_sparse(c, **over):
    args = dict(q=c.q, k_cache=c.main.packed, block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=flash_mla.get_mla_metadata()[0], **c.kwargs())
    args.update(over)
    return flash_mla.flash_mla_with_kvcache(**args)


def call_prefill(c, **over):
    args = dict(q=c.q, kv=c.kv, indices=c.indices, sm_scale=c.sm_scale)
    args.update(over)
    return flash_mla.flash_mla_sparse_fwd(**args)


def as_dtype(x, dt):
    return np.asarray(x).astype(np.float32).astype(dt)


def strided_last(x):
    """Same values, last-dim stride 2 (not contiguous)."""
    x = np.asarray(x)
    buf = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    v = buf[..., ::2]
    v[...] = x
    return v


# ----------------------------------------------------------------------------- dtype -> TypeError

DENSE_DTYPE = {
    "q_float32": ("q", lambda c: dict(q=as_dtype(c.q, np.float32))),
    "q_float64": ("q", lambda c: dict(q=as_dtype(c.q, np.float64))),
    "k_cache_fp16_with_bf16_q": ("k_cache", lambda c: dict(k_cache=as_dtype(c.k_cache, FP16))),
    "block_table_int64": ("block_table", lambda c: dict(block_table=c.block_table.astype(np.int64))),
    "cache_seqlens_int64": ("cache_seqlens", lambda c: dict(cache_seqlens=c.cache_seqlens.astype(np.int64))),
    "cache_seqlens_float": ("cache_seqlens", lambda c: dict(cache_seqlens=c.cache_seqlens.astype(np.float32))),
}


@pytest.mark.parametrize("case", list(DENSE_DTYPE))
def test_dense_wrong_dtype(dense, case):
    name, change = DENSE_DTYPE[case]
    with pytest.raises(TypeError, match=name):
        call_dense(dense, **change(dense))


def test_sparse_wrong_dtypes(sparse):
    with pytest.raises(TypeError, match="q"):
        call_sparse(sparse, q=as_dtype(sparse.q, FP16))
    with pytest.raises(TypeError, match="indices"):
        call_sparse(sparse, indices=sparse.main.indices.astype(np.int64))
    with pytest.raises(TypeError, match="k_cache"):
        call_sparse(sparse, k_cache=np.zeros(sparse.main.packed.shape, np.float16))
    with pytest.raises(TypeError, match="attn_sink"):
        call_sparse(sparse, attn_sink=np.zeros(16, np.float64))
    with pytest.raises(TypeError, match="topk_length"):
        call_sparse(sparse, topk_length=np.zeros(2, np.int64))


def test_prefill_wrong_dtypes(prefill):
    with pytest.raises(TypeError, match="q"):
        call_prefill(prefill, q=as_dtype(prefill.q, np.float32))
    with pytest.raises(TypeError, match="kv"):
        call_prefill(prefill, kv=as_dtype(prefill.kv, FP16))
    with pytest.raises(TypeError, match="indices"):
        call_prefill(prefill, indices=prefill.indices.astype(np.int64))
    with pytest.raises(TypeError, match="attn_sink"):
        call_prefill(prefill, attn_sink=np.zeros(16, np.float16))
    with pytest.raises(TypeError, match="topk_length"):
        call_prefill(prefill, topk_length=np.zeros(3, np.uint32))


# ----------------------------------------------------------------------------- shapes / values -> ValueError


def test_dense_wrong_head_dims(dense, rng):
    q = np.asarray(dense.q)[..., :128].copy()
    with pytest.raises(ValueError, match="q"):
        call_dense(dense, q=q, k_cache=np.asarray(dense.k_cache)[..., :128].copy())
    with pytest.raises(ValueError, match="k_cache"):
        call_dense(dense, k_cache=np.asarray(dense.k_cache)[..., :512].copy())
    with pytest.raises(ValueError, match="head_dim_v"):
        call_dense(dense, head_dim_v=576)
    with pytest.raises(ValueError, match="head_dim_v"):
        call_dense(dense, head_dim_v=256)


def test_dense_non_contiguous_last_dim(dense):
    for name in ("q", "k_cache", "block_table"):
        with pytest.raises(ValueError, match=name):
            call_dense(dense, **{name: strided_last(getattr(dense, name))})


def test_dense_heads_not_divisible(rng):
    c = gen_dense_case(rng, b=2, s_q=1, h_q=6, h_kv=1, d=576, s_k=64)
    k = np.repeat(np.asarray(c.k_cache), 4, axis=2)  # h_kv = 4 does not divide h_q = 6
    with pytest.raises(ValueError, match="h_kv"):
        call_dense(c, k_cache=k)


def test_dense_block_table_too_short(dense):
    bt = np.asarray(dense.block_table)
    lens = dense.cache_seqlens.copy()
    lens[1] = bt.shape[1] * 64 + 1  # needs one page more than the table has
    with pytest.raises(ValueError, match="block_table"):
        call_dense(dense, cache_seqlens=lens)


def test_dense_block_table_entry_out_of_range(dense):
    bt = np.array(dense.block_table)
    bt[0, 0] = dense.k_cache.shape[0]  # one past the last page
    with pytest.raises(ValueError, match="block_table"):
        call_dense(dense, block_table=bt)
    bt[0, 0] = -1
    with pytest.raises(ValueError, match="block_table"):
        call_dense(dense, block_table=bt)
    bt[0, 0] = 2147480000  # the sentinel inside the used range
    with pytest.raises(ValueError, match="block_table"):
        call_dense(dense, block_table=bt)


def test_dense_negative_cache_seqlens(dense):
    lens = dense.cache_seqlens.copy()
    lens[0] = -1
    with pytest.raises(ValueError, match="cache_seqlens"):
        call_dense(dense, cache_seqlens=lens)


def test_dense_mismatched_batch(dense):
    with pytest.raises(ValueError, match="block_table"):
        call_dense(dense, block_table=np.asarray(dense.block_table)[:1].copy())
    with pytest.raises(ValueError, match="cache_seqlens"):
        call_dense(dense, cache_seqlens=np.zeros(3, np.int32))


def test_dense_missing_tables(dense):
    with pytest.raises(ValueError, match="block_table"):
        call_dense(dense, block_table=None)
    with pytest.raises(ValueError, match="cache_seqlens"):
        call_dense(dense, cache_seqlens=None)
    with pytest.raises(ValueError, match="attn_sink"):
        call_dense(dense, attn_sink=np.zeros(16, np.float32))
    with pytest.raises(ValueError, match="topk_length"):
        call_dense(dense, topk_length=np.zeros(2, np.int32))


def test_dense_wrong_ndim(dense):
    with pytest.raises(ValueError, match="q"):
        call_dense(dense, q=np.asarray(dense.q)[:, 0].copy())


def test_sparse_index_out_of_range(sparse):
    num_tokens = sparse.main.packed.shape[0] * sparse.main.packed.shape[1]
    for bad in (num_tokens, -2, 2147483647):
        idx = sparse.main.indices.copy()
        idx[1, 0, 5] = bad
        with pytest.raises(ValueError, match="indices"):
            call_sparse(sparse, indices=idx)


def test_sparse_mismatched_batch_and_shapes(sparse):
    with pytest.raises(ValueError, match="indices"):
        call_sparse(sparse, indices=sparse.main.indices[:1].copy())
    with pytest.raises(ValueError, match="topk_length"):
        call_sparse(sparse, topk_length=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="attn_sink"):
        call_sparse(sparse, attn_sink=np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="attn_sink"):
        call_sparse(sparse, attn_sink=np.zeros((16, 1), np.float32))
    with pytest.raises(ValueError, match="head_dim_v"):
        call_sparse(sparse, head_dim_v=576)


def test_sparse_non_contiguous_last_dim(sparse):
    with pytest.raises(ValueError, match="q"):
        call_sparse(sparse, q=strided_last(sparse.q))
    with pytest.raises(ValueError, match="indices"):
        call_sparse(sparse, indices=strided_last(sparse.main.indices))


def test_sparse_wrong_bytes_per_token(sparse):
    packed = sparse.main.packed
    nb, pbs = packed.shape[:2]
    with pytest.raises(ValueError, match="k_cache"):
        call_sparse(sparse, k_cache=np.zeros((nb, pbs, 1, 584), np.uint8))  # MODEL1 bytes for a d_qk=576 query
    with pytest.raises(ValueError, match="k_cache"):
        call_sparse(sparse, k_cache=np.zeros((nb, pbs, 1, 600), np.uint8))
    with pytest.raises(ValueError, match="k_cache"):  # tokens of a block not packed
        call_sparse(sparse, k_cache=np.zeros((nb, pbs, 1, 700), np.uint8)[..., :656])
    with pytest.raises(ValueError, match="k_cache"):
        call_sparse(sparse, k_cache=np.zeros((nb, pbs, 2, 656), np.uint8))


def test_sparse_extra_cache_arguments(sparse, rng):
    extra = oracle.quantize_cache(np.zeros((2, 16, 1, 576), np.float32).astype(BF16))
    with pytest.raises(ValueError, match="extra_indices_in_kvcache"):
        call_sparse(sparse, extra_k_cache=extra)
    with pytest.raises(ValueError, match="extra_k_cache"):
        call_sparse(sparse, extra_indices_in_kvcache=np.zeros((2, 1, 64), np.int32))
    with pytest.raises(ValueError, match="extra_k_cache"):
        call_sparse(sparse, extra_topk_length=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="extra_indices_in_kvcache"):
        call_sparse(sparse, extra_k_cache=extra, extra_indices_in_kvcache=np.full((2, 1, 64), 32, np.int32))
    with pytest.raises(ValueError, match="extra_k_cache"):
        call_sparse(sparse, extra_k_cache=oracle.quantize_cache(np.zeros((2, 16, 1, 512), np.float32).astype(BF16)),
                    extra_indices_in_kvcache=np.zeros((2, 1, 64), np.int32))


def test_sparse_negative_topk_length(sparse):
    with pytest.raises(ValueError, match="topk_length"):
        call_sparse(sparse, topk_length=np.array([-1, 3], np.int32))


def test_prefill_bad_shapes(prefill):
    with pytest.raises(ValueError, match="d_v"):
        call_prefill(prefill, d_v=576)
    with pytest.raises(ValueError, match="d_v"):
        call_prefill(prefill, d_v=128)
    with pytest.raises(ValueError, match="q"):
        call_prefill(prefill, q=prefill.q[..., :256].copy(), kv=prefill.kv[..., :256].copy())
    with pytest.raises(ValueError, match="kv"):
        call_prefill(prefill, kv=np.concatenate([prefill.kv] * 2, axis=1))  # h_kv = 2
    with pytest.raises(ValueError, match="kv"):
        call_prefill(prefill, kv=np.zeros((80, 1, 576), np.float32).astype(BF16))
    with pytest.raises(ValueError, match="indices"):
        call_prefill(prefill, indices=prefill.indices[:2].copy())
    with pytest.raises(ValueError, match="attn_sink"):
        call_prefill(prefill, attn_sink=np.zeros(15, np.float32))
    with pytest.raises(ValueError, match="topk_length"):
        call_prefill(prefill, topk_length=np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="q"):
        call_prefill(prefill, q=strided_last(prefill.q))
    with pytest.raises(ValueError, match="indices"):
        call_prefill(prefill, indices=strided_last(prefill.indices))


def test_prefill_sm_scale_required(prefill):
    with pytest.raises(TypeError):
        flash_mla.flash_mla_sparse_fwd(prefill.q, prefill.kv, prefill.indices)


@pytest.mark.parametrize("missing", ["q", "kv", "indices"])
def test_prefill_none_tensor_names_the_argument(prefill, missing):
    """None for a required tensor once surfaced as a binding-level
    message (TVM-FFI argument #0 / torch's "Not yet supported ScalarType") without the name."""
    args = dict(q=prefill.q, kv=prefill.kv, indices=prefill.indices)
    args[missing] = None
    with pytest.raises(TypeError, match=rf"^{missing}: expected a tensor, got NoneType"):
        flash_mla.flash_mla_sparse_fwd(args["q"], args["kv"], args["indices"], prefill.sm_scale)


def test_flash_mla_cuda_module_import():
    """flash_mla.cuda (spec §1.1) needs torch.ops.flash_mla; without it the import says why."""
    import importlib
    import sys

    from flash_mla import _torch_ops

    names = ("sparse_decode_fwd", "dense_decode_fwd", "sparse_prefill_fwd", "dense_prefill_fwd", "dense_prefill_bwd")

    def forget():
        sys.modules.pop("flash_mla.cuda", None)
        flash_mla.__dict__.pop("cuda", None)

    forget()
    if _torch_ops.available():
        mod = importlib.import_module("flash_mla.cuda")
        assert all(callable(getattr(mod, f)) for f in names)
        forget()  # as FlashMLA: `import flash_mla` is enough for flash_mla.cuda.<fn>
        assert all(callable(getattr(flash_mla.cuda, f)) for f in names)
    else:
        with pytest.raises(ImportError, match=r"^flash_mla.cuda needs PyTorch and torch.ops.flash_mla"):
            importlib.import_module("flash_mla.cuda")
        forget()
        with pytest.raises(AttributeError, match=r"no attribute 'cuda': flash_mla.cuda needs PyTorch"):
            flash_mla.cuda  # noqa: B018
        assert not hasattr(flash_mla, "cuda")
    with pytest.raises(AttributeError, match=r"has no attribute 'nonexistent'"):
        flash_mla.nonexistent  # noqa: B018


def test_readonly_numpy_inputs_are_accepted(dense):
    """Read-only arrays (np.asarray of a JAX array, memory maps, broadcasts) are valid inputs."""
    ref = call_dense(dense)
    ro = {}
    for name in ("q", "k_cache", "block_table", "cache_seqlens"):
        a = np.array(getattr(dense, name))
        a.flags.writeable = False
        ro[name] = a
    out, lse = call_dense(dense, **ro)
    np.testing.assert_array_equal(out.view(np.uint16), ref[0].view(np.uint16))
    np.testing.assert_array_equal(lse, ref[1])


def _unaligned(a):
    """A copy of ``a`` one byte into a buffer: not aligned to its elements (NumPy's flags.aligned is False)."""
    a = np.asarray(a)
    buf = np.zeros(a.nbytes + 1, np.uint8)
    u = buf[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    assert not u.flags.aligned
    return u


def test_unaligned_numpy_inputs_are_accepted(dense, prefill):
    """NumPy arrays whose data is not aligned to their elements (np.frombuffer at an odd offset, a field of a
    packed record) are valid inputs: the C++ core refuses such pointers (typed access to them is undefined
    behaviour), so the NumPy path passes an aligned copy of them. Same bits as aligned arrays."""
    ref = call_dense(dense)
    out, lse = call_dense(dense, **{n: _unaligned(getattr(dense, n))
                                    for n in ("q", "k_cache", "block_table", "cache_seqlens")})
    np.testing.assert_array_equal(out.view(np.uint16), ref[0].view(np.uint16))
    np.testing.assert_array_equal(lse, ref[1])
    cu = np.array([0, 1, 3], np.int32)
    q = np.asarray(prefill.q)[:3, :2, :128].copy()
    want = flash_mla.flash_attn_varlen_func(q, q, q, cu, cu, 2, 2, causal=True)
    got = flash_mla.flash_attn_varlen_func(_unaligned(q), _unaligned(q), _unaligned(q), _unaligned(cu), cu, 2, 2,
                                           causal=True)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def test_zero_head_dim_is_a_clear_error(dense):
    with pytest.raises(ValueError, match="q"):
        call_dense(dense, q=np.asarray(dense.q)[..., :0].copy())


def test_degenerate_sizes_rejected(dense, sparse):
    with pytest.raises(ValueError, match="q"):
        call_dense(dense, q=np.asarray(dense.q)[:0].copy(), block_table=np.asarray(dense.block_table)[:0].copy(),
                   cache_seqlens=dense.cache_seqlens[:0].copy())
    with pytest.raises(ValueError, match="s_q"):
        call_dense(dense, q=np.asarray(dense.q)[:, :0].copy())
    with pytest.raises(ValueError, match="topk"):
        call_sparse(sparse, indices=sparse.main.indices[:, :, :0].copy())


@pytest.mark.parametrize("name", ["q", "k_cache", "indices"])
def test_scalar_tensors_name_the_argument(dense, sparse, name):
    """0-d arrays get the rank error naming the argument (once an IndexError from q.shape[-1])."""
    with pytest.raises(ValueError, match=f"^{name}: expected a"):
        if name == "indices":
            call_sparse(sparse, indices=np.array(3, np.int32))
        else:
            call_dense(dense, **{name: np.asarray(getattr(dense, name)).reshape(-1)[:1].reshape(())})


def test_ndarray_subclass_results_are_numpy(dense):
    """A user's own ndarray subclass counts as NumPy: the results are NumPy arrays, equal to plain ones."""

    class MyArray(np.ndarray):
        pass

    ref = call_dense(dense)
    out, lse = call_dense(dense, q=np.asarray(dense.q).view(MyArray))
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), ref[0].view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), ref[1])


# ----------------------------------------------------------------------------- edge cases of the argument checks
@pytest.mark.parametrize("name,bad", [("indices", "list"), ("indices", "tuple"), ("indices", "str"),
                                      ("extra_k_cache", "list"), ("extra_indices_in_kvcache", "list")])
def test_sparse_non_tensor_optional_arguments_name_the_argument(sparse, name, bad):
    # Once a bare AttributeError ('list' object has no attribute 'shape') from the wrapper.
    value = {"list": [[[0, 1]]], "tuple": (1, 2, 3), "str": "abc"}[bad]
    over = {name: value}
    if name == "extra_indices_in_kvcache":
        over["extra_k_cache"] = sparse.main.packed
    with pytest.raises(TypeError, match=f"^{name}: expected a "):
        call_sparse(sparse, **over)


@pytest.mark.parametrize("value", [512.9, 512.0, "512", b"512", None, True])
def test_integer_arguments_are_not_truncated(dense, sparse, prefill, value):
    # int(512.9) == 512 once made head_dim_v=512.9 run; FlashMLA's int parameters reject floats. A bool is an int
    # to Python but not a head dim (as softmax_scale rejects it).
    with pytest.raises(TypeError, match="^head_dim_v: expected an int"):
        call_dense(dense, head_dim_v=value)
    with pytest.raises(TypeError, match="^head_dim_v: expected an int"):
        call_sparse(sparse, head_dim_v=value)
    with pytest.raises(TypeError, match="^d_v: expected an int"):
        call_prefill(prefill, d_v=value)


def test_numpy_integer_arguments_are_accepted(dense, prefill):
    out, _ = call_dense(dense, head_dim_v=np.int64(512))
    ref_out, _ = call_dense(dense)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(ref_out).view(np.uint16))
    call_prefill(prefill, d_v=np.array(512, np.int32))


def _assertion_class(err):
    return isinstance(err, AssertionError) and isinstance(err, (ValueError, TypeError))


def test_flashmla_asserts_are_also_assertion_errors(dense, sparse):
    # FlashMLA's wrapper checks these with Python `assert` (spec §1.3 steps 0, 3, 4): code that
    # catches AssertionError must behave the same here; the class stays ValueError / TypeError.
    cases = [
        lambda: call_dense(dense, tile_scheduler_metadata=None),
        lambda: call_dense(dense, num_splits=np.zeros(3, np.int32)),
        lambda: call_sparse(sparse, causal=True),
        lambda: call_sparse(sparse, is_fp8_kvcache=False),
        lambda: call_dense(dense, attn_sink=np.zeros(16, np.float32)),
        lambda: call_dense(dense, topk_length=np.zeros(2, np.int32)),
        lambda: call_dense(dense, block_table=None),
        lambda: call_dense(dense, cache_seqlens=None),
    ]
    for i, fn in enumerate(cases):
        with pytest.raises(AssertionError) as info:
            fn()
        assert _assertion_class(info.value), (i, type(info.value).__mro__)
    with pytest.raises(TypeError, match="^tile_scheduler_metadata"):
        call_dense(dense, tile_scheduler_metadata=object())
    with pytest.raises(ValueError, match="^block_table and cache_seqlens"):
        call_dense(dense, block_table=None)


def test_quantize_zero_page_block_size_names_kv_cache():
    from flash_mla import quant

    with pytest.raises(ValueError, match="^kv_cache: page_block_size \\(dim 1\\) must be > 0"):
        quant.quantize_k_cache(np.zeros((2, 0, 1, 512), BF16))
    with pytest.raises(ValueError, match="^kv_cache: expected a 4-D tensor"):
        quant.quantize_k_cache(np.zeros((2, 1, 512), BF16))


# ----------------------------------------------------------------------------- scale arguments
NOT_A_NUMBER = ["0.1", b"0.1", bytearray(b"0.1"), True, False, np.bool_(True), np.array(True), 0.1 + 0j, [0.1],
                object()]


@pytest.mark.parametrize("bad", NOT_A_NUMBER, ids=lambda v: type(v).__name__ + "-" + repr(v)[:12])
def test_scale_must_be_a_number_on_every_operator(dense, sparse, prefill, bad):
    """The docstrings promise TypeError for a scale that is not a number: strings and bytes are not
    parsed, booleans are not scales -- the same on every operator (issue 28: the decode path used to
    take "0.1", b"0.1" and True)."""
    with pytest.raises(TypeError, match=r"^softmax_scale: expected a float, got "):
        call_dense(dense, softmax_scale=bad)
    with pytest.raises(TypeError, match=r"^softmax_scale: expected a float, got "):
        call_sparse(sparse, softmax_scale=bad)
    with pytest.raises(TypeError, match=r"^sm_scale: expected a float, got "):
        call_prefill(prefill, sm_scale=bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), np.float32("nan")])
def test_scale_must_be_finite_on_every_operator(dense, sparse, prefill, bad):
    """A non-finite scale is a ValueError saying so (not the C++ params struct's 'not set' default)."""
    want = "nan" if np.isnan(bad) else str(float(bad))
    with pytest.raises(ValueError, match=rf"^softmax_scale: must be finite, got {want}$"):
        call_dense(dense, softmax_scale=bad)
    with pytest.raises(ValueError, match=rf"^softmax_scale: must be finite, got {want}$"):
        call_sparse(sparse, softmax_scale=bad)
    with pytest.raises(ValueError, match=rf"^sm_scale: must be finite, got {want}$"):
        call_prefill(prefill, sm_scale=bad)


@pytest.mark.parametrize("big", [1e300, -1e39, np.float64(4e38), 10**400])
def test_scale_beyond_float32_says_it_overflows(dense, sparse, prefill, big):
    """A finite Python / NumPy scale too large for the float32 the kernels use is a ValueError that says so,
    on every operator, not "must be finite, got inf" for a value the caller gave as finite. An int beyond float64
    (10**400: float() raises OverflowError) is the same case."""
    for name, call in (("softmax_scale", lambda: call_dense(dense, softmax_scale=big)),
                       ("softmax_scale", lambda: call_sparse(sparse, softmax_scale=big)),
                       ("sm_scale", lambda: call_prefill(prefill, sm_scale=big))):
        with pytest.raises(ValueError, match=rf"^{name}: .*overflows float32"):
            call()
    torch = pytest.importorskip("torch")
    cu = torch.tensor([0, 3], dtype=torch.int32)
    x = torch.zeros(3, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^softmax_scale: .*overflows float32"):
        flash_mla.flash_attn_varlen_func(x, x, x, cu, cu, 3, 3, softmax_scale=big)


@pytest.mark.parametrize("good", [0.25, 1, np.float32(0.25), np.float64(0.25), np.int64(1), np.array(0.25)],
                         ids=lambda v: type(v).__name__)
def test_scale_accepts_real_numbers(dense, prefill, good):
    out, lse = call_dense(dense, softmax_scale=good)
    ref_out, ref_lse = call_dense(dense, softmax_scale=float(good))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
    res = call_prefill(prefill, sm_scale=good)
    ref = call_prefill(prefill, sm_scale=float(good))
    np.testing.assert_array_equal(np.asarray(res[2]), np.asarray(ref[2]))


# ----------------------------------------------------------------------------- flag arguments
NOT_A_FLAG = ["False", "True", "", b"0", bytearray(b"0"), [False], ()]


@pytest.mark.parametrize("bad", NOT_A_FLAG, ids=lambda v: type(v).__name__ + "-" + repr(v)[:12])
def test_decode_flags_must_not_be_strings_or_containers(dense, sparse, bad):
    """causal="False" is truthy: taken as a flag it ran a causal decode silently. Strings, bytes and containers
    (whose truth is their length) are a TypeError naming the flag; bools, None and numbers stay accepted, as
    FlashMLA's C++ bool parameters take them."""
    with pytest.raises(TypeError, match=r"^causal: expected a bool, got "):
        call_dense(dense, causal=bad)
    with pytest.raises(TypeError, match=r"^is_fp8_kvcache: expected a bool, got "):
        call_sparse(sparse, is_fp8_kvcache=bad)


def test_decode_flags_accept_bools_numbers_and_none(dense):
    ref = call_dense(dense, causal=False)
    for ok in (None, 0, np.bool_(False), np.int64(0)):
        np.testing.assert_array_equal(np.asarray(call_dense(dense, causal=ok)[1]), np.asarray(ref[1]))


# ----------------------------------------------------------------------------- FLASHMLA_NUM_THREADS
_THREADS_PROBE = r"""
import numpy as np, flash_mla, sys
sys.path.insert(0, sys.argv[1])
from mla_test_utils import gen_dense_case
c = gen_dense_case(np.random.default_rng(0), b=2, s_q=1, h_q=16, h_kv=1, d=576, s_k=64)
for _ in range(3):
    flash_mla.flash_mla_with_kvcache(c.q, c.k_cache, c.block_table, c.cache_seqlens, 512,
                                     flash_mla.get_mla_metadata()[0])
print("threads", flash_mla.reference_num_threads())
"""


@pytest.mark.parametrize("value,valid", [("0", False), ("-3", False), ("abc", False), ("", False), ("3", True)])
def test_num_threads_env_is_read_once_and_a_bad_value_named_once(value, valid):
    """FLASHMLA_NUM_THREADS: a value that is not a positive integer is reported once on stderr, naming it
    (not silently replaced by the hardware's count), however many calls follow."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, FLASHMLA_NUM_THREADS=value)
    proc = subprocess.run([sys.executable, "-c", _THREADS_PROBE, os.path.dirname(os.path.abspath(__file__))],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "FLASHMLA_NUM_THREADS" in ln]
    threads = int(proc.stdout.split("threads")[-1])
    if valid:
        assert warnings == [] and threads == int(value), proc.stderr
    else:
        assert len(warnings) == 1, proc.stderr
        assert f"FLASHMLA_NUM_THREADS='{value}' is not a positive integer" in warnings[0]
        assert f"uses {threads} threads" in warnings[0]


def test_flag_given_as_a_multi_element_array_is_a_type_error_naming_it(dense):
    """A NumPy array (or torch tensor) of several elements has no truth value: bool() raised NumPy's ValueError /
    torch's RuntimeError ("... is ambiguous"), which does not name the argument. It is a container given as a
    flag: a TypeError naming the flag, as for lists and tuples."""
    with pytest.raises(TypeError, match=r"^causal: expected a bool, got ndarray of shape \(2,\)$"):
        call_dense(dense, causal=np.array([True, False]))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^causal: expected a bool, got Tensor of shape \(2,\)$"):
        call_dense(dense, causal=torch.tensor([True, False]))
    cu = torch.tensor([0, 3], dtype=torch.int32)
    x = torch.zeros(3, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^causal: expected a bool, got Tensor of shape \(2,\)$"):
        flash_mla.flash_attn_varlen_func(x, x, x, cu, cu, 3, 3, causal=torch.tensor([True, False]))
    ref = call_dense(dense, causal=False)  # 0-d arrays / tensors keep their truth value (one-element ones: below)
    np.testing.assert_array_equal(np.asarray(call_dense(dense, causal=np.array(False))[1]), np.asarray(ref[1]))
    np.testing.assert_array_equal(np.asarray(call_dense(dense, causal=torch.tensor(False))[1]), np.asarray(ref[1]))


def _one_element_containers(x):
    """``x`` in arrays / tensors of one element and one or more dimensions: NumPy, torch (if installed)."""
    out = [np.array([x]), np.array([[x]])]
    try:
        import torch
    except ImportError:
        return out
    return out + [torch.tensor([x]), torch.tensor([[x]])]


def _zero_d(x):
    out = [np.array(x)]
    try:
        import torch
    except ImportError:
        return out
    return out + [torch.tensor(x)]


def test_scalar_arguments_given_as_one_element_arrays_are_a_type_error_naming_them(dense, sparse, prefill):
    """README: flags take bools, None and numbers; strings, bytes and containers are a TypeError. A list was one,
    but np.array([True]) / torch.tensor([True]) were taken by their truth, and torch.tensor([0.1]) /
    torch.tensor([5]) as a scale / an int while np.array([0.1]) / np.array([5]) were a TypeError: an array or tensor
    of one or more dimensions is a container whatever its size, on every framework. 0-d arrays and tensors stay
    accepted as the scalars they hold (FlashMLA hands them to its C++ op, whose float / int / bool parameters
    take them)."""
    # (value held, expected kind, [(argument, operator call)])
    cases = [(True, "a bool", [("causal", lambda v: call_dense(dense, causal=v)),
                               ("is_fp8_kvcache", lambda v: call_sparse(sparse, is_fp8_kvcache=v))]),
             (0.1, "a float", [("softmax_scale", lambda v: call_dense(dense, softmax_scale=v)),
                               ("softmax_scale", lambda v: call_sparse(sparse, softmax_scale=v)),
                               ("sm_scale", lambda v: call_prefill(prefill, sm_scale=v))]),
             (512, "an int", [("head_dim_v", lambda v: call_dense(dense, head_dim_v=v)),
                              ("d_v", lambda v: call_prefill(prefill, d_v=v))])]
    for value, kind_word, calls in cases:
        for bad in _one_element_containers(value):
            shape = re.escape(str(tuple(bad.shape)))
            kind = type(bad).__name__
            for arg, call in calls:
                with pytest.raises(TypeError, match=rf"^{arg}: expected {kind_word}, got {kind} of shape {shape}$"):
                    call(bad)
    ref_dense, ref_prefill = call_dense(dense, causal=True), call_prefill(prefill, d_v=512)
    for ok in _zero_d(True):
        np.testing.assert_array_equal(np.asarray(call_dense(dense, causal=ok)[1]), np.asarray(ref_dense[1]))
    for ok in _zero_d(512):
        np.testing.assert_array_equal(np.asarray(call_dense(dense, causal=True, head_dim_v=ok)[1]),
                                      np.asarray(ref_dense[1]))
        np.testing.assert_array_equal(np.asarray(call_prefill(prefill, d_v=ok)[2]), np.asarray(ref_prefill[2]))
    for ok in _zero_d(0.25):
        np.testing.assert_array_equal(np.asarray(call_prefill(prefill, sm_scale=ok)[2]),
                                      np.asarray(call_prefill(prefill, sm_scale=0.25)[2]))


def test_prefill_scalar_arguments_given_as_one_element_tensors_are_a_type_error_naming_them():
    """As above for the dense MHA prefill (flash_attn_varlen_func and its backward): causal, is_varlen,
    deterministic, softmax_scale, max_seqlen_qo / _kv."""
    torch = pytest.importorskip("torch")
    cu = torch.tensor([0, 3], dtype=torch.int32)
    x = torch.randn(3, 1, 128).to(torch.bfloat16)
    f = flash_mla.flash_attn_varlen_func
    ref_out, ref_lse = f(x, x, x, cu, cu, 3, 3, causal=True, softmax_scale=0.25)
    for wrap in (lambda v: np.array([v]), lambda v: torch.tensor([v])):
        for flag in ("causal", "is_varlen", "deterministic"):
            with pytest.raises(TypeError, match=rf"^{flag}: expected a bool, got \w+ of shape \(1,\)$"):
                f(x, x, x, cu, cu, 3, 3, **{flag: wrap(False)})
        with pytest.raises(TypeError, match=r"^softmax_scale: expected a float, got \w+ of shape \(1,\)$"):
            f(x, x, x, cu, cu, 3, 3, softmax_scale=wrap(0.25))
        with pytest.raises(TypeError, match=r"^max_seqlen_kv: expected an int, got \w+ of shape \(1,\)$"):
            f(x, x, x, cu, cu, 3, wrap(3))
        with pytest.raises(TypeError, match=r"^causal: expected a bool, got \w+ of shape \(1,\)$"):
            flash_mla.flash_attn_varlen_backward(x, x, x, x, ref_out, ref_lse, cu, cu, 3, 3, causal=wrap(True))
    for zero_d in (np.array, torch.tensor):
        out, lse = f(x, x, x, cu, cu, zero_d(3), zero_d(3), causal=zero_d(True), softmax_scale=zero_d(0.25))
        assert torch.equal(lse, ref_lse)
