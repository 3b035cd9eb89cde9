"""flash_mla.quant with GPU tensors of other frameworks than torch (issue 28, item 5): the
conversion runs on the CPU and the result comes back on the caller's GPU, bit-identical to NumPy's.
(CPU frameworks: tests/python/test_quant.py.)"""

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")  # the GPU test gate (tests/gpu/conftest.py) needs it
from flash_mla import quant  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def _cache(d):
    x = np.random.default_rng(d).standard_normal((3, 16, 1, d)) / 10
    return x.astype(np.float32).astype(BF16)


@pytest.mark.parametrize("d", [576, 512])
def test_quant_jax_gpu(d):
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("this JAX has no GPU backend")
    x = _cache(d)
    packed = quant.quantize_k_cache(jax.device_put(x, gpu))
    assert packed.devices() == {gpu}
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(quant.quantize_k_cache(x)))
    kv = quant.dequantize_k_cache(packed, d)
    assert kv.devices() == {gpu} and kv.dtype == BF16
    np.testing.assert_array_equal(np.asarray(kv).view(np.uint16),
                                  quant.dequantize_k_cache(quant.quantize_k_cache(x), d).view(np.uint16))


def test_quant_cupy_gpu():
    cupy = pytest.importorskip("cupy")
    x = _cache(576)
    ref = quant.quantize_k_cache(x)
    # CuPy has no bfloat16: the bf16 result cannot be CuPy's, which the error says; bytes of another dtype
    # are the core's TypeError naming kv_cache.
    with pytest.raises(TypeError, match="CuPy does not have"):
        quant.dequantize_k_cache(cupy.asarray(np.ascontiguousarray(ref)), 576)
    with pytest.raises(TypeError, match="kv_cache"):
        quant.quantize_k_cache(cupy.asarray(x.astype(np.float32)))


def test_quant_paddle_gpu():
    paddle = pytest.importorskip("paddle")
    if not paddle.device.is_compiled_with_cuda():
        pytest.skip("this PaddlePaddle has no CUDA")
    x = _cache(512)
    t = paddle.to_tensor(x.astype(np.float32), place=paddle.CUDAPlace(0)).astype(paddle.bfloat16)
    packed = quant.quantize_k_cache(t)
    assert not packed.place.is_cpu_place()
    np.testing.assert_array_equal(packed.cpu().numpy(), np.asarray(quant.quantize_k_cache(x)))
