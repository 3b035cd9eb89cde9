"""Inputs from two frameworks in one call, and argument errors that must name the argument:
non-tensor or wrongly typed lengths, a missing or NaN scale, float64 q, a scheduler object reused with
topk_length added. Tests that need PyTorch skip without it.
"""

import math

import ml_dtypes
import numpy as np
import pytest

import flash_mla

BF16 = np.dtype(ml_dtypes.bfloat16)


def _dense_np(seq=10):
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((1, 1, 2, 576)) / 10).astype(BF16)
    kc = (rng.standard_normal((1, 64, 1, 576)) / 10).astype(BF16)
    bt = np.zeros((1, 1), np.int32)
    sl = np.array([seq], np.int32)
    return q, kc, bt, sl


def _dense(q, kc, bt, sl, **kw):
    sched, _ = flash_mla.get_mla_metadata()
    return flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, sched, **kw)


def _prefill_np():
    rng = np.random.default_rng(1)
    q = (rng.standard_normal((2, 64, 576)) / 10).astype(BF16)
    kv = (rng.standard_normal((8, 1, 576)) / 10).astype(BF16)
    idx = np.arange(8, dtype=np.int32).reshape(1, 1, 8).repeat(2, 0)
    return q, kv, idx


# --- 1. Mixed frameworks: NumPy q + a torch tensor elsewhere -------------------------------------------------------

def test_numpy_bf16_q_with_torch_cache_dense_decode():
    """README: 'any DLPack tensor works ... Results come back in the framework of q'. With a NumPy
    (ml_dtypes bf16) q and a torch k_cache, the call computes and then dies in _ffi.from_ffi with
    `RuntimeError: Unsupported dtype in DLTensor` (the result is a torch bf16 tensor; str(dtype) is
    'torch.bfloat16', so the NumPy bf16 branch is skipped and np.from_dlpack rejects bf16)."""
    torch = pytest.importorskip("torch")
    q, kc, bt, sl = _dense_np()
    ref_out, ref_lse = _dense(q, kc, bt, sl)
    out, lse = _dense(q, torch.from_numpy(kc.view(np.uint16)).view(torch.bfloat16), torch.from_numpy(bt),
                      torch.from_numpy(sl))
    assert isinstance(out, np.ndarray) and out.dtype == BF16
    np.testing.assert_array_equal(out.view(np.uint16), ref_out.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), ref_lse)


def test_numpy_bf16_q_with_torch_kv_sparse_prefill():
    """Same as above for flash_mla_sparse_fwd (NumPy q, torch kv)."""
    torch = pytest.importorskip("torch")
    q, kv, idx = _prefill_np()
    ref = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.5)
    res = flash_mla.flash_mla_sparse_fwd(q, torch.from_numpy(kv.view(np.uint16)).view(torch.bfloat16), idx, 0.5)
    assert isinstance(res[0], np.ndarray) and res[0].dtype == BF16
    np.testing.assert_array_equal(res[0].view(np.uint16), ref[0].view(np.uint16))


# --- 2. Wrong-dtype length tensors: the error does not name the argument -----------------------------------------

def test_bf16_cache_seqlens_numpy_error_names_argument():
    """A bf16 cache_seqlens (NumPy/ml_dtypes) raises `BufferError: DLPack only supports ...` from
    _host_copy (run before validation) instead of a TypeError naming cache_seqlens."""
    q, kc, bt, sl = _dense_np()
    with pytest.raises(TypeError, match="cache_seqlens"):
        _dense(q, kc, bt, sl.astype(BF16))


def test_bf16_cache_seqlens_torch_error_names_argument():
    """A torch bf16 cache_seqlens raises `TypeError: Got unsupported ScalarType BFloat16` (from
    tensor.numpy() in _host_copy), which does not name the argument. Same for topk_length."""
    torch = pytest.importorskip("torch")
    q, kc, bt, sl = _dense_np()
    with pytest.raises(TypeError, match="cache_seqlens"):
        _dense(q, kc, bt, torch.from_numpy(sl).to(torch.bfloat16))


# --- 3. Non-tensor arguments: the error does not name the argument -----------------------------------------------

def test_python_list_cache_seqlens_error_names_argument():
    """cache_seqlens=[10] raises tvm_ffi's `TypeError: Expect from_dlpack to take either a compatible
    tensor or PyCapsule` — no argument name (same for attn_sink=[...], topk_length=[...])."""
    q, kc, bt, _ = _dense_np()
    with pytest.raises(TypeError, match="cache_seqlens"):
        _dense(q, kc, bt, [10])


def test_prefill_sm_scale_none_error_names_argument():
    """flash_mla_sparse_fwd(q, kv, idx, None) raises `TypeError: float() argument must be ... not
    'NoneType'` without naming sm_scale."""
    q, kv, idx = _prefill_np()
    with pytest.raises(TypeError, match="sm_scale"):
        flash_mla.flash_mla_sparse_fwd(q, kv, idx, None)


# --- 4. Unsupported dtypes are reported as raw DLPack codes -------------------------------------------------------

def test_float64_q_error_says_float64_and_what_is_expected():
    """README: errors name 'what was expected and what was given'. float64 q gives
    `q: unsupported dtype (DLPack code 2, 64 bits, 1 lanes)`: neither 'float64' nor the expected dtypes."""
    q, kc, bt, sl = _dense_np()
    with pytest.raises(TypeError) as ei:
        _dense(q.astype(np.float64), kc, bt, sl)
    msg = str(ei.value)
    assert "q" in msg and "float64" in msg and "bfloat16" in msg


# --- 5. Non-finite softmax scale: silent 'empty' result ---------------------------------------------------------

def test_nan_softmax_scale_is_rejected_dense():
    """softmax_scale=nan silently returns out = 0 and lse = +inf for every row (indistinguishable
    from 'no valid key'); softmax_scale=inf returns NaN. A non-finite scale should be a ValueError."""
    q, kc, bt, sl = _dense_np()
    with pytest.raises(ValueError, match="softmax_scale"):
        _dense(q, kc, bt, sl, softmax_scale=math.nan)


def test_nan_sm_scale_is_rejected_prefill():
    """sm_scale=nan in flash_mla_sparse_fwd silently gives out 0, lse +inf, max_logits -inf."""
    q, kv, idx = _prefill_np()
    with pytest.raises(ValueError, match="sm_scale"):
        flash_mla.flash_mla_sparse_fwd(q, kv, idx, math.nan)


# --- 6. Scheduler reuse: adding topk_length is not detected -----------------------------------------------------

def test_sched_reuse_adding_topk_length_is_detected():
    """README: a FlashMLASchedMeta may be reused only with the same lengths; on the CPU a change
    raises SchedMetaMismatchError. Reusing an object computed without topk_length for a call with
    topk_length (i.e. different work per request) is silently accepted (only value changes are compared,
    and None is skipped). On the GPU backend that would be a stale split schedule."""
    from flash_mla import quant

    rng = np.random.default_rng(2)
    kv = (rng.standard_normal((2, 64, 1, 512)) / 10).astype(BF16)
    packed = quant.quantize_k_cache(kv)
    q = (rng.standard_normal((2, 1, 64, 512)) / 10).astype(BF16)
    idx = rng.integers(0, 128, (2, 1, 64)).astype(np.int32)
    sched, _ = flash_mla.get_mla_metadata()
    flash_mla.flash_mla_with_kvcache(q, packed, None, None, 512, sched, is_fp8_kvcache=True, indices=idx)
    with pytest.raises(flash_mla.SchedMetaMismatchError):
        flash_mla.flash_mla_with_kvcache(q, packed, None, None, 512, sched, is_fp8_kvcache=True, indices=idx,
                                         topk_length=np.array([1, 2], np.int32))
