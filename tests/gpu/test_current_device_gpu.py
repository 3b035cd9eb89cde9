"""flash_mla must leave the caller's current CUDA device as it found it (2-GPU machines).

Each way in switches to the data's device for the call (the kernels launch there) and must switch back:
a library that leaves device 1 current makes the caller's next "cuda" tensor, stream or graph
capture land on the wrong GPU. Checked right after each call, from both sides (current 0 with
data on 1, current 1 with data on 0), through torch.ops, TVM-FFI with torch tensors, CuPy and
a jitted JAX function. (conftest.py resets the device to 0 around every test, so a failure here
does not spill into other tests.)
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import flash_mla  # noqa: E402
from flash_mla import _ffi  # noqa: E402
from mla_test_utils import BF16, gen_dense_case  # noqa: E402

SIDES = [(0, 1), (1, 0)]  # (caller's current device, data's device)


@pytest.fixture
def torch_2gpu():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    return torch


def _torch_case(torch, device, seed):
    c = gen_dense_case(np.random.default_rng(seed), b=3, s_q=1, h_q=16, h_kv=1, d=576, s_k=200, varlen=True)
    q = torch.from_numpy(c.q.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    k = torch.from_numpy(c.k_cache.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    bt = torch.from_numpy(c.block_table).to(device)
    sl = torch.from_numpy(c.cache_seqlens).to(device)
    return c, (q, k, bt, sl)


def _np_to_torch(torch, x):
    x = np.ascontiguousarray(x)
    return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16) if x.dtype == BF16 else torch.from_numpy(x)


def _check_values(torch, c, out, lse):
    """The call on the other device must also be right: against the CPU reference backend on the
    same inputs, with the spec §5.1 comparator the other GPU tests use (test_dense_decode_gpu.py)."""
    from torch_reference import check_close  # needs torch: imported here, so torch-less runs still collect

    t = lambda x: _np_to_torch(torch, x)  # noqa: E731
    ref_out, ref_lse = flash_mla.flash_mla_with_kvcache(t(c.q), t(c.k_cache), t(c.block_table), t(c.cache_seqlens),
                                                        512, flash_mla.get_mla_metadata()[0])
    out = out if isinstance(out, torch.Tensor) else t(out)
    lse = lse if isinstance(lse, torch.Tensor) else t(lse)
    assert not out.isnan().any()
    check_close("out", out, ref_out, 8e-4, 2.01 / 128, 5e-6)
    check_close("lse", lse, ref_lse, 1e-6, 8.01 / 65536, 1e-7)


@pytest.mark.parametrize("current,data", SIDES)
def test_torch_ops_path_keeps_current_device(torch_2gpu, current, data):
    torch = torch_2gpu
    c, (q, k, bt, sl) = _torch_case(torch, f"cuda:{data}", 7 + current)
    torch.cuda.set_device(current)
    out, lse = flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, flash_mla.get_mla_metadata()[0])
    assert torch.cuda.current_device() == current
    assert out.device == torch.device(f"cuda:{data}")
    _check_values(torch, c, out, lse)


@pytest.mark.parametrize("current,data", SIDES)
def test_tvm_ffi_path_keeps_current_device(torch_2gpu, current, data):
    torch = torch_2gpu
    c, (q, k, bt, sl) = _torch_case(torch, f"cuda:{data}", 17 + current)
    torch.cuda.set_device(current)
    res = _ffi.lib.dense_decode_fwd(q, k, 512, sl, bt, 576 ** -0.5, False, None, None)
    assert torch.cuda.current_device() == current
    assert res[0].device.index == data  # outputs allocated on the data's GPU
    with torch.cuda.device(data):  # torch's DLPack import wants the tensor's device current
        out, lse = (torch.from_dlpack(t) for t in res[:2])
    _check_values(torch, c, out, lse)


@pytest.mark.parametrize("current,data", SIDES)
def test_cupy_path_keeps_current_device(current, data):
    cp = pytest.importorskip("cupy")
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    c = gen_dense_case(np.random.default_rng(8), b=3, s_q=1, h_q=16, h_kv=1, d=576, s_k=200, varlen=True,
                       dtype=np.dtype(np.float16))
    with cp.cuda.Device(data):
        q, k, bt, sl = (cp.asarray(x) for x in (c.q, c.k_cache, c.block_table, c.cache_seqlens))
    prev = cp.cuda.runtime.getDevice()
    try:
        cp.cuda.runtime.setDevice(current)
        out, lse = flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, flash_mla.get_mla_metadata()[0])
        assert cp.cuda.runtime.getDevice() == current
        assert out.device.id == data
        cp.cuda.Device(data).synchronize()
        _check_values(pytest.importorskip("torch"), c, cp.asnumpy(out), cp.asnumpy(lse))
    finally:
        cp.cuda.runtime.setDevice(prev)


def test_jax_path_keeps_current_device(torch_2gpu, jax_gpu):
    torch = torch_2gpu
    jax, gpus = jax_gpu
    if len(gpus) < 2:
        pytest.skip("needs two GPUs visible to JAX")
    c = gen_dense_case(np.random.default_rng(9), b=3, s_q=1, h_q=16, h_kv=1, d=576, s_k=200, varlen=True)
    put = lambda x: jax.device_put(np.asarray(x), gpus[1])  # noqa: E731
    args = [put(x) for x in (c.q, c.k_cache, c.block_table, c.cache_seqlens)]
    torch.cuda.set_device(0)
    # JAX's own runtime may make device 1 current on this thread: then the check below would
    # measure JAX, not flash_mla.
    jax.block_until_ready(jax.jit(lambda a: a * 2)(args[3]))
    if torch.cuda.current_device() != 0:
        pytest.skip("JAX itself leaves device 1 current after a plain jitted op on it")
    step = jax.jit(lambda *a: flash_mla.flash_mla_with_kvcache(*a, 512, flash_mla.get_mla_metadata()[0]))
    out, lse = step(*args)
    jax.block_until_ready(out)
    assert torch.cuda.current_device() == 0
    _check_values(torch, c, np.asarray(out), np.asarray(lse))
