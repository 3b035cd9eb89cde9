"""Inputs from two frameworks in one call, and argument errors that must name the argument:
non-tensor or wrongly typed lengths, a missing or NaN scale, float64 q, a scheduler object reused with
topk_length added, torch tensors on the meta device on the TVM-FFI route. Tests that need PyTorch skip without it.
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


# --- 5. Tensors on torch's meta device on the TVM-FFI route ------------------------------------------------------

# Calls with torch tensors on the meta device, all or some of them; run on the torch.ops route in this process and
# on the TVM-FFI route (FLASHMLA_DISABLE_TORCH_OPS=1, what a build without torch uses) in a subprocess.
_META_CASES = r'''
import json, sys
import torch, flash_mla
from flash_mla.quant import quantize_k_cache

def meta_cases():
    bf, i32, M = torch.bfloat16, torch.int32, (lambda t: t.to("meta"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(10, 4, 128, generator=g).to(bf)
    k, v = torch.randn(12, 2, 128, generator=g).to(bf), torch.randn(12, 2, 128, generator=g).to(bf)
    cq, ck = torch.tensor([0, 4, 10], dtype=i32), torch.tensor([0, 5, 12], dtype=i32)
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cq, ck, 6, 7)
    qkv = torch.randn(10, 4, 3 * 128, generator=g).to(bf)
    qd = torch.randn(2, 1, 16, 576, generator=g).to(bf)
    kc = torch.randn(8, 64, 1, 576, generator=g).to(bf)
    bt, sl = torch.arange(8, dtype=i32).view(2, 4), torch.tensor([100, 17], dtype=i32)
    kf, idx = quantize_k_cache(kc), torch.randint(0, 8 * 64, (2, 1, 64), dtype=i32, generator=g)
    qs, kvs = torch.randn(10, 16, 576, generator=g).to(bf), torch.randn(30, 1, 576, generator=g).to(bf)
    ids = torch.randint(0, 30, (10, 1, 64), dtype=i32, generator=g)
    sched = lambda: flash_mla.get_mla_metadata()[0]
    varlen, bwd = flash_mla.flash_attn_varlen_func, flash_mla.flash_attn_varlen_backward
    dense = lambda *a: flash_mla.flash_mla_with_kvcache(*a, 512, sched())
    sparse = lambda a, b, c, **kw: flash_mla.flash_mla_with_kvcache(a, b, None, None, 512, sched(),
                                                                     is_fp8_kvcache=True, indices=c, **kw)
    prefill = flash_mla.flash_mla_sparse_fwd
    mixed = {
        "varlen cu_seqlens_qo": lambda: varlen(q, k, v, M(cq), ck, 6, 7),
        "varlen q": lambda: varlen(M(q), k, v, cq, ck, 6, 7),
        "varlen k, requires_grad q": lambda: varlen(q.clone().requires_grad_(), M(k), v, cq, ck, 6, 7),
        "qkvpacked cu_seqlens": lambda: flash_mla.flash_attn_varlen_qkvpacked_func(qkv, M(cq), 6, 128),
        "kvpacked cu_seqlens_kv": lambda: flash_mla.flash_attn_varlen_kvpacked_func(
            q, torch.cat([k, v], 2), cq, M(ck), 6, 7, 128),
        "backward lse": lambda: bwd(out, q, k, v, out, M(lse), cq, ck, 6, 7),
        "backward dout": lambda: bwd(M(out), q, k, v, out, lse, cq, ck, 6, 7),
        "dense decode cache_seqlens": lambda: dense(qd, kc, bt, M(sl)),
        "dense decode block_table": lambda: dense(qd, kc, M(bt), sl),
        "dense decode q": lambda: dense(M(qd), kc, bt, sl),
        "sparse decode indices": lambda: sparse(qd, kf, M(idx)),
        "sparse decode attn_sink": lambda: sparse(qd, kf, idx, attn_sink=M(torch.zeros(16))),
        "sparse prefill indices": lambda: prefill(qs, kvs, M(ids), 0.1),
        "sparse prefill topk_length": lambda: prefill(qs, kvs, ids, 0.1,
                                                      topk_length=M(torch.full((10,), 5, dtype=i32))),
    }
    every = {
        "varlen": lambda: varlen(M(q), M(k), M(v), M(cq), M(ck), 6, 7),
        "backward": lambda: bwd(M(out), M(q), M(k), M(v), M(out), M(lse), M(cq), M(ck), 6, 7),
        "dense decode": lambda: dense(M(qd), M(kc), M(bt), M(sl)),
        "sparse decode": lambda: sparse(M(qd), M(kf), M(idx)),
        "sparse prefill": lambda: prefill(M(qs), M(kvs), M(ids), 0.1),
    }
    return mixed, every

def outcome(fn):
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001
        return [type(e).__name__, str(e)]
    return ["ok", str(res[0].device)]

if __name__ == "__main__":
    mixed, every = meta_cases()
    print(json.dumps({"mixed": {n: outcome(f) for n, f in mixed.items()},
                      "every": {n: outcome(f) for n, f in every.items()}}))
'''


@pytest.fixture(scope="module")
def meta_outcomes_tvm_ffi():
    """The outcome of each meta-device case with FLASHMLA_DISABLE_TORCH_OPS=1 (the TVM-FFI route), in a subprocess."""
    pytest.importorskip("torch")
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, FLASHMLA_DISABLE_TORCH_OPS="1")
    proc = subprocess.run([sys.executable, "-c", _META_CASES], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_meta_tensor_among_cpu_ones_is_the_same_value_error_on_the_tvm_ffi_route(meta_outcomes_tvm_ffi):
    """A torch tensor on the meta device among CPU ones: on the torch.ops route the fake kernels' ValueError naming
    it ("cu_seqlens_qo is on meta but q is on cpu: ..."); on the TVM-FFI route (FLASHMLA_DISABLE_TORCH_OPS=1, or a
    build without torch) TVM-FFI's RuntimeError "Cannot pack tensors on meta" with a C++ trace, naming nothing.
    Now the same class and message on both routes, for every public entry point."""
    got = meta_outcomes_tvm_ffi["mixed"]
    for name, (cls, msg) in got.items():
        assert cls == "ValueError" and "all tensors must be on the same device" in msg, (name, cls, msg)
    assert got["varlen cu_seqlens_qo"][1] == ("cu_seqlens_qo is on meta but q is on cpu: all tensors must be on "
                                              "the same device")
    assert got["qkvpacked cu_seqlens"][1].startswith("cu_seqlens is on meta")
    assert got["varlen q"][1].startswith("k is on cpu but q is on meta")
    from flash_mla import _torch_ops

    if not _torch_ops.available():
        return
    ns: dict = {}
    exec(_META_CASES, ns)
    mixed, _ = ns["meta_cases"]()
    for name, fn in mixed.items():
        assert ns["outcome"](fn) == got[name], name


def test_meta_tensors_only_are_a_not_implemented_error_on_the_tvm_ffi_route(meta_outcomes_tvm_ffi):
    """Every tensor on the meta device: the torch.ops route answers with its fake kernels (meta outputs); the TVM-FFI
    route has no kernels for them and raised TVM-FFI's raw RuntimeError (or, for a decode, DLPack's "Unknown device
    type meta" ValueError): now a NotImplementedError naming q and saying why."""
    for name, (cls, msg) in meta_outcomes_tvm_ffi["every"].items():
        assert cls == "NotImplementedError", (name, cls, msg)
        assert msg.startswith("q: tensors on torch's meta device are not supported on the TVM-FFI route"), (name, msg)
        assert "FLASHMLA_DISABLE_TORCH_OPS" in msg, (name, msg)


def test_numpy_q_with_a_torch_meta_tensor_names_it():
    """Mixed frameworks take the TVM-FFI route whatever the op library: a NumPy q with a torch tensor on the meta
    device raised TVM-FFI's "Cannot pack tensors on meta"; now the same-device ValueError naming the tensor."""
    torch = pytest.importorskip("torch")
    q, kv, idx = _prefill_np()
    with pytest.raises(ValueError, match="^kv is on meta but q is on cpu: all tensors must be on the same device$"):
        flash_mla.flash_mla_sparse_fwd(q, torch.empty(kv.shape, dtype=torch.bfloat16, device="meta"), idx, 0.5)
    q, kc, bt, sl = _dense_np()
    with pytest.raises(ValueError, match="^cache_seqlens is on meta but q is on cpu"):
        _dense(q, kc, bt, torch.from_numpy(sl).to("meta"))
