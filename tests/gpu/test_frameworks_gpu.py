"""JAX (inside jax.jit) and CuPy on the GPU: values, zero-copy, the framework's own stream, and a
second GPU. Skipped without an sm90 GPU (conftest.py); each framework skips if missing.

JAX results must be bit-identical to the torch path's on the same inputs (same kernels, same plan;
the torch path is validated against float32 references in tests/gpu/test_*_gpu.py) — the float64
oracle's §5.1 tolerances are too tight for bf16 outputs whose P was rounded to bf16 on the GPU.
CuPy (float16) is checked against the float64 oracle.
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import flash_mla  # noqa: E402
import oracle  # noqa: E402
from flash_mla import _ffi  # noqa: E402
from mla_test_utils import (BF16, LSE_TOL, check_allclose, check_lse, check_out, gen_dense_case,  # noqa: E402
                            gen_prefill_case, gen_sparse_decode_case, seed_of)

FP16 = np.dtype(np.float16)


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(seed_of(request.node.nodeid))


def _dense_ref(c, causal=False, scale=None):
    """The float64 oracle's result for a dense case (spec §5.1 compares against it)."""
    return oracle.dense_decode(c.q, c.k_cache, c.block_table, c.cache_seqlens, causal, scale)


def _check_dense(c, out, lse, causal=False, scale=None):
    ref_out, ref_lse = _dense_ref(c, causal, scale)
    check_out("out", np.asarray(out), ref_out, c.q.dtype)
    check_lse("lse", np.asarray(lse), ref_lse)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def _torch_gpu(fn, *arrays, device=0, **kw):
    """The same call with torch CUDA tensors on `device` (the path tests/gpu/test_*_gpu.py validate
    against their float32 references), results back as NumPy (bf16 via ml_dtypes)."""
    import torch

    def to_t(x):
        if not isinstance(x, np.ndarray):
            return x
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).to(f"cuda:{device}")
        return torch.from_numpy(np.ascontiguousarray(x)).to(f"cuda:{device}")

    res = fn(*(to_t(a) for a in arrays), **{k: to_t(v) for k, v in kw.items()})
    out = []
    for r in res:
        r = r.cpu()
        out.append(r.view(torch.uint16).numpy().view(BF16) if r.dtype == torch.bfloat16 else r.numpy())
    return out


def _assert_same_as_torch(jax_results, torch_results):
    """JAX (XLA custom call) and torch (torch.ops) run the same kernels with the same plan: bit-identical."""
    for name, a, b in zip(("out", "lse/max_logits", "lse"), jax_results, torch_results):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)


def _dense_torch(c, causal=False, device=0):
    return _torch_gpu(lambda q, k, bt, sl: flash_mla.flash_mla_with_kvcache(
        q, k, bt, sl, 512, flash_mla.get_mla_metadata()[0], causal=causal), c.q, c.k_cache, c.block_table,
        c.cache_seqlens, device=device)


# ----------------------------------------------------------------------------- JAX


# (the jax_gpu fixture lives in conftest.py)


def test_jax_jit_dense_decode_gpu(jax_gpu, rng):
    jax, gpus = jax_gpu
    c = gen_dense_case(rng, b=5, s_q=2, h_q=64, h_kv=1, d=576, s_k=700, varlen=True, zero=[False, True] + [False] * 3,
                       causal=True)
    put = lambda x: jax.device_put(np.asarray(x), gpus[0])  # noqa: E731

    @jax.jit
    def step(q_half, k_cache, block_table, cache_seqlens):
        q = q_half * 2  # produced by XLA on its stream just before the custom call: ordering matters
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                                flash_mla.get_mla_metadata()[0], causal=True)

    q_half = (c.q.astype(np.float32) / 2).astype(BF16)  # exact: c.q * 1/2 is representable
    out, lse = step(put(q_half), put(c.k_cache), put(c.block_table), put(c.cache_seqlens))
    assert next(iter(out.devices())).platform == "gpu"
    _assert_same_as_torch([out, lse], _dense_torch(c, causal=True))
    # New lengths: same compiled function, schedule recomputed on the GPU.
    lens2 = (c.cache_seqlens // 3 + (c.cache_seqlens > 0)).astype(np.int32)
    out2, lse2 = step(put(q_half), put(c.k_cache), put(c.block_table), put(lens2))
    c.cache_seqlens = lens2
    _assert_same_as_torch([out2, lse2], _dense_torch(c, causal=True))


def test_jax_jit_sparse_decode_and_prefill_gpu(jax_gpu, rng):
    jax, gpus = jax_gpu
    put = lambda x: jax.device_put(np.asarray(x), gpus[0])  # noqa: E731
    c = gen_sparse_decode_case(rng, b=3, s_q=2, h_q=64, d_qk=576, s_k=400, topk=128, pbs=64, have_topk_length=True,
                               extra=dict(s_k=100, topk=64, pbs=32, have_topk_length=True), noncontig=False)
    kw = c.kwargs()
    names = [k for k, v in kw.items() if isinstance(v, np.ndarray)]
    flags = {k: v for k, v in kw.items() if not isinstance(v, np.ndarray)}
    step = jax.jit(lambda q, packed, *arrs: flash_mla.flash_mla_with_kvcache(
        q, packed, None, None, 512, flash_mla.get_mla_metadata()[0], **dict(zip(names, arrs)), **flags))
    out, lse = step(put(c.q), put(c.main.packed), *[put(kw[n]) for n in names])
    _assert_same_as_torch([out, lse], _torch_gpu(
        lambda q, packed, **a: flash_mla.flash_mla_with_kvcache(q, packed, None, None, 512,
                                                                 flash_mla.get_mla_metadata()[0], **a, **flags),
        c.q, c.main.packed, **{n: kw[n] for n in names}))

    p = gen_prefill_case(rng, s_q=40, s_kv=1000, topk=256, h_q=64, d_qk=576, sink=True, have_topk_length=True)
    pstep = jax.jit(lambda q, kv, idx, sink, tl: flash_mla.flash_mla_sparse_fwd(q, kv, idx, p.sm_scale,
                                                                                attn_sink=sink, topk_length=tl))
    res = pstep(*(put(x) for x in (p.q, p.kv, p.indices, p.attn_sink, p.topk_length)))
    _assert_same_as_torch(res, _torch_gpu(
        lambda q, kv, idx, sink, tl: flash_mla.flash_mla_sparse_fwd(q, kv, idx, p.sm_scale, attn_sink=sink,
                                                                    topk_length=tl),
        p.q, p.kv, p.indices, p.attn_sink, p.topk_length))


def test_jax_second_gpu(jax_gpu, rng):
    jax, gpus = jax_gpu
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    c = gen_dense_case(rng, b=4, s_q=1, h_q=16, h_kv=1, d=576, s_k=300, varlen=True)
    put = lambda x: jax.device_put(np.asarray(x), gpus[1])  # noqa: E731
    step = jax.jit(lambda *a: flash_mla.flash_mla_with_kvcache(*a, 512, flash_mla.get_mla_metadata()[0]))
    out, lse = step(put(c.q), put(c.k_cache), put(c.block_table), put(c.cache_seqlens))
    assert next(iter(out.devices())) == gpus[1]
    _assert_same_as_torch([out, lse], _dense_torch(c, device=1))


# ----------------------------------------------------------------------------- CuPy

_SLOW_COPY = r"""
extern "C" __global__ void slow_copy(const unsigned short* src, unsigned short* dst, long long n, long long spin) {
  const long long t0 = clock64();
  while (clock64() - t0 < spin) { }
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
"""


@pytest.fixture(scope="module")
def cupy():
    cp = pytest.importorskip("cupy")
    return cp


def _cupy_dense_case(rng):
    # CuPy has no bfloat16 dtype: its dense-decode tests use float16 (a dtype the kernels take too).
    return gen_dense_case(rng, b=4, s_q=2, h_q=32, h_kv=1, d=576, s_k=500, varlen=True, zero=[False, False, True, False],
                          dtype=FP16)


def test_cupy_dense_decode_values_and_zero_copy(cupy, rng):
    cp = cupy
    c = _cupy_dense_case(rng)
    q, k, bt, sl = (cp.asarray(x) for x in (c.q, c.k_cache, c.block_table, c.cache_seqlens))
    # Inputs cross without a copy: TVM-FFI sees CuPy's own device pointers.
    for x in (q, k, bt, sl):
        assert _ffi.to_ffi(x).data_ptr() == x.data.ptr
    raw = _ffi.lib.dense_decode_fwd(_ffi.to_ffi(q), _ffi.to_ffi(k), 512, _ffi.to_ffi(sl), _ffi.to_ffi(bt),
                                    576 ** -0.5, False, None, None)
    out_raw = _ffi.from_ffi(raw[0], q)
    assert isinstance(out_raw, cp.ndarray) and out_raw.data.ptr == raw[0].data_ptr()  # results: no copy either
    out, lse = flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, flash_mla.get_mla_metadata()[0])
    assert isinstance(out, cp.ndarray) and out.dtype == cp.float16 and isinstance(lse, cp.ndarray)
    _check_dense(c, cp.asnumpy(out), cp.asnumpy(lse))


def test_cupy_runs_on_the_current_stream(cupy, rng):
    """q is written by a slow kernel on a non-blocking CuPy stream; flash_mla called under that
    stream must wait for it. On any other stream it would read the NaN placeholder."""
    cp = cupy
    c = _cupy_dense_case(rng)
    k, bt, sl = (cp.asarray(x) for x in (c.k_cache, c.block_table, c.cache_seqlens))
    src = cp.asarray(c.q.view(np.uint16))
    slow_copy = cp.RawKernel(_SLOW_COPY, "slow_copy")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        q = cp.full(c.q.shape, np.nan, dtype=cp.float16)
        stream.synchronize()
        slow_copy((64,), (256,), (src, q.view(cp.uint16), np.int64(q.size), np.int64(200_000_000)))  # ~0.1 s
        out, lse = flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, flash_mla.get_mla_metadata()[0])
    stream.synchronize()
    _check_dense(c, cp.asnumpy(out), cp.asnumpy(lse))


def test_cupy_second_gpu(cupy, rng):
    cp = cupy
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    c = _cupy_dense_case(rng)
    with cp.cuda.Device(1):
        q, k, bt, sl = (cp.asarray(x) for x in (c.q, c.k_cache, c.block_table, c.cache_seqlens))
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            out, lse = flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, flash_mla.get_mla_metadata()[0])
        stream.synchronize()
    assert out.device.id == 1 and lse.device.id == 1
    with cp.cuda.Device(0):  # the caller's current device is not the data's: results must not depend on it
        out0, lse0 = flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, flash_mla.get_mla_metadata()[0])
        cp.cuda.Device(1).synchronize()
    _check_dense(c, cp.asnumpy(out), cp.asnumpy(lse))
    _check_dense(c, cp.asnumpy(out0), cp.asnumpy(lse0))
