"""flash_mla.quant (FP8 KV-cache formats, spec §3.3-§3.5) vs the oracle's independent NumPy codec."""

import ml_dtypes
import numpy as np
import pytest

import flash_mla
import oracle
from flash_mla import quant
from mla_test_utils import BF16, cdiv, non_contiguousify

FMT = {"V32": 576, "MODEL1": 512}
BPT = {"V32": 656, "MODEL1": 584}


def bf16_bits(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(BF16).view(np.uint16)


def varied_cache(rng, nb, pbs, d):
    """bf16 cache whose quantization tiles span many magnitudes (incl. all-zero tiles,
    fp8-subnormal results and exact powers of two)."""
    tile = 128 if d == 576 else 64
    x = rng.standard_normal((nb, pbs, 1, d))
    n_tiles = (512 if d == 576 else 448) // tile
    mag = 10.0 ** rng.uniform(-7, 4, (nb, pbs, 1, n_tiles))
    x[..., : n_tiles * tile] *= np.repeat(mag, tile, axis=-1)
    zero_tiles = rng.random((nb, pbs, 1, n_tiles)) < 0.1
    x[..., : n_tiles * tile][np.repeat(zero_tiles, tile, axis=-1)] = 0.0
    x.reshape(-1)[rng.choice(x.size, 50, replace=False)] = 448.0 * 2.0 ** rng.integers(-20, 5, 50)
    return x.astype(np.float32).astype(BF16)


def test_e4m3_codec_agrees_with_ml_dtypes(rng):
    e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
    all_bytes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(oracle.e4m3_decode(all_bytes), all_bytes.view(e4m3).astype(np.float64))
    finite = oracle.E4M3_TABLE[np.isfinite(oracle.E4M3_TABLE)]
    mids = (np.sort(finite)[1:] + np.sort(finite)[:-1]) / 2  # exact ties
    x = np.concatenate([finite, mids, rng.uniform(-448, 448, 5000), rng.standard_normal(5000) * 2.0**-8,
                        [464.0, -464.0, 0.0, -0.0]]).astype(np.float32)
    np.testing.assert_array_equal(oracle.e4m3_encode(x), x.astype(e4m3).view(np.uint8))
    e8m0 = np.dtype(ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(oracle.e8m0_decode(all_bytes), all_bytes.view(e8m0).astype(np.float64))


@pytest.mark.parametrize("nb,pbs", [(3, 64), (2, 53), (4, 2), (1, 1)])
@pytest.mark.parametrize("fmt", list(FMT))
def test_quantize_bit_exact(rng, fmt, nb, pbs):
    kv = varied_cache(rng, nb, pbs, FMT[fmt])
    packed = quant.quantize_k_cache(kv)
    assert isinstance(packed, np.ndarray) and packed.dtype == np.uint8
    assert packed.shape == (nb, pbs, 1, BPT[fmt])
    expected = oracle.quantize_cache(kv, pad_byte=0)
    assert packed.strides == expected.strides
    got_bytes, exp_bytes = oracle.block_bytes(packed), oracle.block_bytes(expected)
    if fmt == "MODEL1":  # the pad byte after the 7 scales is unspecified by FlashMLA: ignore it
        pad = pbs * 576 + np.arange(pbs) * 8 + 7
        got_bytes, exp_bytes = np.delete(got_bytes, pad, axis=1), np.delete(exp_bytes, pad, axis=1)
    mism = np.argwhere(got_bytes != exp_bytes)
    assert len(mism) == 0, f"{len(mism)} bytes differ, first at (block, byte) {tuple(mism[0])}"
    # d_qk may also be passed explicitly; a strided bf16 input gives the same bytes.
    again = quant.quantize_k_cache(non_contiguousify(kv), d_qk=FMT[fmt])
    np.testing.assert_array_equal(oracle.block_bytes(again), oracle.block_bytes(packed))


@pytest.mark.parametrize("fmt", list(FMT))
def test_dequantize_bit_exact(rng, fmt):
    d = FMT[fmt]
    kv = varied_cache(rng, 3, 17, d)
    kv[1, 4] = np.float32(np.nan).astype(BF16)  # a poisoned token: NaN payload and scales
    packed = oracle.quantize_cache(kv, fill=rng, pad_byte=None)  # garbage in the block padding
    got = quant.dequantize_k_cache(packed, d_qk=d)
    assert isinstance(got, np.ndarray) and got.dtype == BF16 and got.shape == (3, 17, 1, d)
    ref = oracle.dequantize_cache(packed, d).reshape(3, 17, 1, d)
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_array_equal(got.view(np.uint16)[ok], bf16_bits(ref[ok]))
    assert np.isnan(got[1, 4].astype(np.float32)).all()


@pytest.mark.parametrize("fmt", list(FMT))
def test_round_trip_error_bound_and_rope_exact(rng, fmt):
    d = FMT[fmt]
    nope, tile = (512, 128) if fmt == "V32" else (448, 64)
    kv = varied_cache(rng, 2, 40, d)
    back = quant.dequantize_k_cache(quant.quantize_k_cache(kv), d_qk=d)
    np.testing.assert_array_equal(back[..., nope:].view(np.uint16), kv[..., nope:].view(np.uint16))
    x = kv[..., :nope].astype(np.float64).reshape(-1, nope // tile, tile)
    y = back[..., :nope].astype(np.float64).reshape(-1, nope // tile, tile)
    scale = oracle.tile_scales(x.astype(np.float32)).astype(np.float64)[..., None]
    # e4m3 keeps 3 mantissa bits: |err| <= 2^-4 |x| for normal values, half a subnormal step otherwise.
    bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scale) * (1 + 1e-9) + 2.0**-9 * np.abs(y)
    assert np.all(np.abs(y - x) <= bound)
    assert np.all(np.abs(y).max(axis=-1) <= 448 * scale[..., 0])


@pytest.mark.parametrize("fmt", list(FMT))
def test_requantization_idempotent(rng, fmt):
    d = FMT[fmt]
    kv = varied_cache(rng, 2, 33, d)
    once = quant.dequantize_k_cache(quant.quantize_k_cache(kv), d_qk=d)
    twice = quant.dequantize_k_cache(quant.quantize_k_cache(once), d_qk=d)
    np.testing.assert_array_equal(twice.view(np.uint16), once.view(np.uint16))
    q2 = quant.quantize_k_cache(once)
    q3 = quant.quantize_k_cache(quant.dequantize_k_cache(q2, d_qk=d))
    np.testing.assert_array_equal(oracle.block_bytes(q3), oracle.block_bytes(q2))


@pytest.mark.parametrize("pbs", [1, 2, 53, 64, 69, 256])
@pytest.mark.parametrize("fmt", list(FMT))
def test_default_block_strides(fmt, pbs):
    kv = np.ones((2, pbs, 1, FMT[fmt]), np.float32).astype(BF16)
    packed = quant.quantize_k_cache(kv)
    bpt = BPT[fmt]
    expected = (pbs + 1) * 656 if fmt == "V32" else cdiv(pbs * 584, 576) * 576
    assert packed.strides == (expected, bpt, bpt, 1)
    if fmt == "MODEL1":
        assert expected % 576 == 0 and expected >= pbs * 584
    fmt_code = quant.format_for_head_dim(FMT[fmt])
    assert quant.default_block_stride(fmt_code, pbs) == expected
    custom = quant.quantize_k_cache(kv, block_stride=pbs * bpt + 32)
    assert custom.strides[0] == pbs * bpt + 32
    np.testing.assert_array_equal(oracle.block_bytes(custom), oracle.block_bytes(packed))
    with pytest.raises(ValueError, match="block_stride"):
        quant.quantize_k_cache(kv, block_stride=pbs * bpt - 1)


def _hand_token(d):
    """One token whose bytes are worked out by hand below."""
    tile = 128 if d == 576 else 64
    x = np.zeros(d, np.float64)
    x[0 * tile: 0 * tile + 3] = [1.0, -2.0, 0.5]  # amax 2: 2/448 in (2^-8, 2^-7] -> scale 2^-7
    # tile 1 all zero: max(0, 1e-4) -> scale 2^ceil(log2 1e-4) = 2^-13
    x[2 * tile: 2 * tile + 3] = [448.0, -448.0, 1.0]  # amax 448 -> scale 1
    x[3 * tile: 3 * tile + 4] = [3.0, 2.0**-7, 2.0**-16, -3 * 2.0**-16]  # scale 2^-7; e4m3 subnormals
    if d == 512:
        x[4 * 64: 7 * 64] = 1.0  # amax 1: 1/448 in (2^-9, 2^-8] -> scale 2^-8
    rope = d - 64
    x[rope: rope + 3] = [1.0, -2.0, 0.375]
    return x


def test_hand_checked_bytes_v32():
    x = _hand_token(576)
    kv = np.zeros((2, 3, 1, 576), np.float32)
    kv[1, 2, 0] = x
    packed = quant.quantize_k_cache(kv.astype(BF16))
    tok = oracle.block_bytes(packed)[1, 2 * 656: 3 * 656]  # block 1, row 2
    assert tok[0:4].tolist() == [0x70, 0xF8, 0x68, 0x00]  # 128 = 2^7, -256, 64, 0
    assert not tok[128:256].any()
    assert tok[256:260].tolist() == [0x7E, 0xFE, 0x38, 0x00]  # 448, -448, 1.0
    assert tok[384:389].tolist() == [0x7C, 0x38, 0x01, 0x83, 0x00]  # 384, 1.0, 2^-9, -3*2^-9
    scales = [bytes(tok[512 + 4 * t: 516 + 4 * t]).hex() for t in range(4)]
    assert scales == ["0000003c", "00000039", "0000803f", "0000003c"]  # 2^-7, 2^-13, 1.0, 2^-7 (float32 LE)
    assert bytes(tok[528:534]).hex() == "803f00c0c03e"  # bf16 LE 1.0, -2.0, 0.375
    assert not tok[534:656].any()
    # The other tokens (all zero): scale 2^-13, zero payload.
    other = oracle.block_bytes(packed)[0, :656]
    assert not other[:512].any() and bytes(other[512:516]).hex() == "00000039"


def test_hand_checked_bytes_model1():
    pbs = 3
    x = _hand_token(512)
    kv = np.zeros((2, pbs, 1, 512), np.float32)
    kv[1, 2, 0] = x
    packed = quant.quantize_k_cache(kv.astype(BF16))
    blk = oracle.block_bytes(packed)[1]
    data = blk[2 * 576: 3 * 576]  # token 2's data record: 448 e4m3 then 64 bf16
    assert data[0:4].tolist() == [0x70, 0xF8, 0x68, 0x00]
    assert not data[64:128].any()
    assert data[128:132].tolist() == [0x7E, 0xFE, 0x38, 0x00]
    assert data[192:197].tolist() == [0x7C, 0x38, 0x01, 0x83, 0x00]
    assert np.all(data[256:448] == 0x78)  # 1.0 / 2^-8 = 256 = 2^8
    assert bytes(data[448:454]).hex() == "803f00c0c03e"
    sc = blk[pbs * 576 + 2 * 8: pbs * 576 + 2 * 8 + 7]  # scales live after all data records
    assert sc.tolist() == [0x78, 0x72, 0x7F, 0x78, 0x77, 0x77, 0x77]  # e8m0: 2^-7, 2^-13, 1, 2^-7, 2^-8 x3
    assert blk[pbs * 576: pbs * 576 + 7].tolist() == [0x72] * 7  # token 0 (zeros): 2^-13


@pytest.mark.parametrize("fmt", list(FMT))
def test_nan_token_quantizes_to_nan(fmt):
    d = FMT[fmt]
    kv = np.zeros((1, 2, 1, d), np.float32)
    kv[0, 1] = np.nan
    packed = quant.quantize_k_cache(kv.astype(BF16))
    ref = oracle.quantize_cache(kv.astype(BF16), pad_byte=0)
    deq = oracle.dequantize_cache(packed, d)
    assert np.isnan(deq[1]).all() and np.isfinite(deq[0]).all()
    np.testing.assert_array_equal(np.isnan(oracle.dequantize_cache(ref, d)), np.isnan(deq))


def test_bad_head_dim_rejected():
    with pytest.raises(ValueError, match="d_qk"):
        quant.quantize_k_cache(np.zeros((1, 2, 1, 128), np.float32).astype(BF16))
    with pytest.raises(ValueError, match="d_qk"):
        quant.dequantize_k_cache(np.zeros((1, 2, 1, 656), np.uint8), d_qk=128)


@pytest.mark.parametrize("bad", [576.9, "576", b"576"])
def test_quant_integer_arguments_are_named_and_not_truncated(bad):
    kv = np.zeros((1, 2, 1, 576), np.float32).astype(BF16)
    packed = quant.quantize_k_cache(kv)
    with pytest.raises(TypeError, match=r"^d_qk: expected an int, got "):
        quant.quantize_k_cache(kv, d_qk=bad)
    with pytest.raises(TypeError, match=r"^d_qk: expected an int, got "):
        quant.dequantize_k_cache(packed, d_qk=bad)
    with pytest.raises(TypeError, match=r"^block_stride: expected an int, got "):
        quant.quantize_k_cache(kv, block_stride=3000.5 if isinstance(bad, float) else bad)
    with pytest.raises(TypeError, match=r"^d_qk: expected an int, got NoneType"):
        quant.dequantize_k_cache(packed, d_qk=None)
    # NumPy integers are integers
    again = quant.quantize_k_cache(kv, d_qk=np.int64(576), block_stride=np.int32(3 * 656))
    np.testing.assert_array_equal(again, quant.quantize_k_cache(kv, block_stride=3 * 656))
    np.testing.assert_array_equal(quant.dequantize_k_cache(packed, d_qk=np.int16(576)).view(np.uint16),
                                  quant.dequantize_k_cache(packed).view(np.uint16))


@pytest.mark.parametrize("shape", [(), (576,)])
def test_quantize_low_rank_cache_names_kv_cache(shape):
    # (the head dim is read from the last dim: a 0-d tensor has none)
    with pytest.raises(ValueError, match=r"^kv_cache: expected a 4-D tensor \(num_blocks, page_block_size, 1, d_qk\)"):
        quant.quantize_k_cache(np.zeros(shape, np.float32).astype(BF16))


def test_quant_module_exported():
    assert flash_mla.quant is quant
    assert quant.format_for_head_dim(576) != quant.format_for_head_dim(512)


# ----------------------------------------------------------------------------- frameworks (issue 28)
def _frameworks():
    out = ["numpy"]
    for mod in ("jax", "paddle", "torch"):
        try:
            __import__(mod)
            out.append(mod)
        except ImportError:
            out.append(pytest.param(mod, marks=pytest.mark.skip(reason=f"{mod} is not installed")))
    return out


def _to_fw(fw, x):
    if fw == "numpy":
        return x
    if fw == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x)
    if fw == "paddle":
        import paddle

        if x.dtype == BF16:
            return paddle.to_tensor(x.astype(np.float32)).astype(paddle.bfloat16)
        return paddle.to_tensor(x)
    import torch

    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def _np(fw, t):
    if fw == "paddle":
        import paddle

        return t.view(paddle.uint16).numpy().view(BF16) if t.dtype == paddle.bfloat16 else t.numpy()
    if fw == "torch":
        import torch

        return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()
    return np.asarray(t)


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
@pytest.mark.parametrize("fw", _frameworks())
def test_quant_helpers_take_every_framework(rng, fw, fmt):
    """quantize_k_cache / dequantize_k_cache take the frameworks the rest of the API takes and return
    the caller's framework, with the NumPy path's bytes and values (JAX: contiguous, no strides)."""
    d = FMT[fmt]
    x = varied_cache(rng, 3, 16, d)
    ref_packed = quant.quantize_k_cache(x)
    packed = quant.quantize_k_cache(_to_fw(fw, x))
    assert _ffi_fw(packed) == fw
    assert tuple(packed.shape) == (3, 16, 1, BPT[fmt])
    np.testing.assert_array_equal(_np(fw, packed), np.asarray(ref_packed))  # token bytes (strided views)
    if fw != "jax":  # the padded block stride of FlashMLA's tests
        assert _strides(packed)[0] == quant.default_block_stride(quant.format_for_head_dim(d), 16)
    kv = quant.dequantize_k_cache(packed, d)
    assert _ffi_fw(kv) == fw
    np.testing.assert_array_equal(_np(fw, kv).view(np.uint16), quant.dequantize_k_cache(ref_packed, d).view(np.uint16))
    with pytest.raises(TypeError, match="kv_cache"):  # float32, not bf16: the core names the argument
        quant.quantize_k_cache(_to_fw(fw, x.astype(np.float32)))


def _ffi_fw(t):
    from flash_mla import _ffi

    return _ffi.framework_of(t)


def _strides(t):
    if isinstance(t, np.ndarray):
        return tuple(s // t.itemsize for s in t.strides)
    s = t.strides if hasattr(t, "strides") else t.stride()
    return tuple(s() if callable(s) else s)


def test_quant_jax_result_is_contiguous_and_decodes(rng):
    """JAX arrays have no strides: the packed cache is contiguous, a padded block_stride is refused with
    a message saying why, and the contiguous cache decodes exactly as NumPy's padded one."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    # (moderate values: XLA runs the CPU call with subnormals flushed to zero, NumPy's call does not)
    x = (rng.standard_normal((2, 64, 1, 512)) / 10).astype(np.float32).astype(BF16)
    packed = quant.quantize_k_cache(jnp.asarray(x))
    with pytest.raises(ValueError, match=r"block_stride: JAX arrays have no strides"):
        quant.quantize_k_cache(jnp.asarray(x), block_stride=64 * 584 + 8)
    q = (rng.standard_normal((1, 1, 16, 512)) / 10).astype(np.float32).astype(BF16)
    idx = rng.choice(128, (1, 1, 64), replace=False).astype(np.int32)
    run = lambda pk, qq, ii: flash_mla.flash_mla_with_kvcache(qq, pk, None, None, 512, flash_mla.get_mla_metadata()[0],
                                                             is_fp8_kvcache=True, indices=ii)
    out_j, lse_j = run(packed, jnp.asarray(q), jnp.asarray(idx))
    out_n, lse_n = run(quant.quantize_k_cache(x), q, idx)
    np.testing.assert_array_equal(np.asarray(out_j).view(np.uint16), out_n.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse_j), lse_n)


def test_quant_rejects_non_tensors():
    with pytest.raises(TypeError, match=r"^kv_cache: expected a tensor of a DLPack framework .* got list"):
        quant.quantize_k_cache([[1.0]])
    with pytest.raises(TypeError, match=r"^packed: expected a tensor of a DLPack framework .* got str"):
        quant.dequantize_k_cache("bytes", 576)
