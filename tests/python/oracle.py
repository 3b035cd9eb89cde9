"""Independent float64 NumPy oracle for flash_mla (spec §2, §3).

Nothing here calls flash_mla: attention is computed in float64 from the
definitions of spec §2.1-§2.4, and the FP8 KV-cache byte formats of spec
§3.3/§3.4 are encoded/decoded with plain NumPy bit arithmetic (ml_dtypes only
supplies the bfloat16 dtype and serves as a cross-check for e4m3 in tests).

Conventions (spec §2.6): natural-log ``lse``; a row without any valid key gets
``out = 0``, ``lse = +inf`` and ``max_logits = -inf``; ``attn_sink`` scales
``out`` only: ``out / (1 + exp(sink - lse))``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
D_V = 512

V32, MODEL1 = "V32", "MODEL1"
FORMAT_OF_DIM = {576: V32, 512: MODEL1}
BYTES_PER_TOKEN = {V32: 656, MODEL1: 584}
#  format: (d_qk, nope dims, tile size, number of scales)
LAYOUT = {V32: (576, 512, 128, 4), MODEL1: (512, 448, 64, 7)}
MODEL1_DATA_BYTES = 576  # 448 e4m3 + 64 bf16 RoPE per token
MODEL1_SCALE_BYTES = 8  # 7 e8m0 + 1 pad per token


def f64(x) -> np.ndarray:
    """Any NumPy array (bf16/fp16/float/int) as float64."""
    return np.asarray(x).astype(np.float64)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float values to the nearest bfloat16 (RNE), returned as float64."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(BF16).astype(np.float64)


# ----------------------------------------------------------------------------- e4m3fn / e8m0


def _e4m3_decode_table() -> np.ndarray:
    """float64 value of every float8_e4m3fn byte (1-4-3, bias 7, 0x7F/0xFF NaN, no inf)."""
    t = np.empty(256, np.float64)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            t[b] = np.nan
        elif e == 0:
            t[b] = sign * m * 2.0**-9
        else:
            t[b] = sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return t


E4M3_TABLE = _e4m3_decode_table()
_E4M3_POS = E4M3_TABLE[:0x7F]  # codes 0x00..0x7E: finite non-negative values, increasing


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    return E4M3_TABLE[np.asarray(b, dtype=np.uint8)]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float -> float8_e4m3fn byte, round to nearest even, PyTorch's non-saturating cast:
    NaN/inf and values that round above 448 become 0x7F | sign."""
    x = np.asarray(x, dtype=np.float64)
    sign = np.signbit(x).astype(np.uint8) << 7
    a = np.abs(x)
    hi = np.clip(np.searchsorted(_E4M3_POS, a, side="left"), 0, len(_E4M3_POS) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - _E4M3_POS[lo], _E4M3_POS[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = np.where(a == _E4M3_POS[hi], hi, code).astype(np.uint8)
    # Above 448: the next (virtual) step is 480; ties at 464 go to 448 (even code 0x7E).
    overflow = ~np.isfinite(a) | (a > 464.0)
    code = np.where(overflow, 0x7F, code).astype(np.uint8)
    return code | sign


def e8m0_decode(e: np.ndarray) -> np.ndarray:
    e = np.asarray(e, dtype=np.int64)
    with np.errstate(over="ignore"):
        v = np.ldexp(1.0, e - 127)
    return np.where(e == 255, np.nan, v)


def e8m0_encode(scale: np.ndarray) -> np.ndarray:
    """Power-of-two float -> UE8M0 byte (exponent + 127); NaN/inf -> 0xFF."""
    s = np.asarray(scale, dtype=np.float64)
    bad = ~np.isfinite(s) | (s <= 0)
    m, e = np.frexp(np.where(bad, 1.0, s))
    assert np.all(m[~bad] == 0.5), "e8m0 scales must be powers of two"
    return np.where(bad, 255, e - 1 + 127).astype(np.uint8)


# ----------------------------------------------------------------------------- §3.5 quantizer


def tile_scales(x_f32: np.ndarray) -> np.ndarray:
    """Spec §3.5 steps 1-2 for tiles along the last axis: float32
    ``2 ** ceil(log2(max(amax / 448, 1e-4)))`` (NaN propagates, inf -> inf), computed
    exactly with frexp instead of a floating-point log2."""
    x = np.asarray(x_f32, dtype=np.float32)
    amax = np.max(np.abs(x), axis=-1)  # np.max propagates NaN
    s_inv = amax / np.float32(448.0)
    clamped = np.maximum(s_inv, np.float32(1e-4))  # np.maximum propagates NaN
    finite = np.isfinite(clamped)
    m, e = np.frexp(np.where(finite, clamped, np.float32(1.0)).astype(np.float64))
    ceil_log2 = np.where(m == 0.5, e - 1, e)  # clamped = m * 2^e with m in [0.5, 1)
    scale = np.ldexp(1.0, ceil_log2).astype(np.float32)
    return np.where(finite, scale, clamped).astype(np.float32)


def quantize_tokens(x_bf16: np.ndarray, fmt: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize tokens ``(N, d_qk)`` bf16. Returns (fp8 bytes (N, nope) uint8,
    float32 scales (N, n_scales), RoPE bf16 bits (N, 64) uint16)."""
    d_qk, nope, tile, n_scales = LAYOUT[fmt]
    x = np.asarray(x_bf16)
    assert x.dtype == BF16 and x.shape[-1] == d_qk, (x.dtype, x.shape)
    xf = x.astype(np.float32)
    tiles = xf[:, :nope].reshape(-1, n_scales, tile)
    scales = tile_scales(tiles)
    with np.errstate(invalid="ignore", divide="ignore"):
        scaled = tiles / scales[..., None]  # float32 division (exact: power-of-two divisor)
    fp8 = e4m3_encode(scaled).reshape(-1, nope)
    rope = np.ascontiguousarray(x[:, nope:]).view(np.uint16)
    return fp8, scales, rope


def default_block_stride(fmt: str, pbs: int) -> int:
    """FlashMLA's test layout (spec §5.2): V32 (pbs + 1) * 656; MODEL1 pbs * 584 padded to 576."""
    if fmt == V32:
        return (pbs + 1) * 656
    return -(-pbs * 584 // 576) * 576


def quantize_cache(kv: np.ndarray, block_stride: Optional[int] = None, fill=None, pad_byte=0) -> np.ndarray:
    """Pack a bf16 cache ``(num_blocks, pbs, 1, d_qk)`` into FP8 bytes (spec §3.3/§3.4).

    Returns a uint8 view ``(num_blocks, pbs, 1, bytes_per_token)`` with strides
    ``(block_stride, bytes_per_token, bytes_per_token, 1)`` into a fresh buffer.
    ``fill``: None -> zeros, else a ``numpy.random.Generator`` whose random bytes fill
    the buffer first (so block padding and the MODEL1 pad byte hold garbage, as the
    uninitialised memory of FlashMLA's tests does). ``pad_byte``: value of MODEL1's pad
    byte, or None to keep the fill.
    """
    d_qk = kv.shape[-1]
    fmt = FORMAT_OF_DIM[d_qk]
    nb, pbs, h_kv = kv.shape[:3]
    assert h_kv == 1
    bpt = BYTES_PER_TOKEN[fmt]
    bs = default_block_stride(fmt, pbs) if block_stride is None else block_stride
    assert bs >= pbs * bpt
    n = nb * bs
    buf = np.zeros(n, np.uint8) if fill is None else fill.integers(0, 256, n, dtype=np.uint8)
    fp8, scales, rope = quantize_tokens(np.asarray(kv).reshape(nb * pbs, d_qk), fmt)
    ast = np.lib.stride_tricks.as_strided
    if fmt == V32:
        tok = ast(buf, (nb, pbs, bpt), (bs, bpt, 1))
        tok[:, :, :512] = fp8.reshape(nb, pbs, 512)
        tok[:, :, 512:528] = scales.astype("<f4").view(np.uint8).reshape(nb, pbs, 16)
        tok[:, :, 528:656] = rope.astype("<u2").view(np.uint8).reshape(nb, pbs, 128)
    else:
        data = ast(buf, (nb, pbs, MODEL1_DATA_BYTES), (bs, MODEL1_DATA_BYTES, 1))
        data[:, :, :448] = fp8.reshape(nb, pbs, 448)
        data[:, :, 448:576] = rope.astype("<u2").view(np.uint8).reshape(nb, pbs, 128)
        sc = ast(buf[pbs * MODEL1_DATA_BYTES:], (nb, pbs, MODEL1_SCALE_BYTES), (bs, MODEL1_SCALE_BYTES, 1))
        sc[:, :, :7] = e8m0_encode(scales).reshape(nb, pbs, 7)
        if pad_byte is not None:
            sc[:, :, 7] = pad_byte
    return ast(buf, (nb, pbs, 1, bpt), (bs, bpt, bpt, 1))


def block_bytes(packed: np.ndarray) -> np.ndarray:
    """The ``pbs * bytes_per_token`` payload bytes of each page block, ``(num_blocks, pbs * bpt)``."""
    nb, pbs, _, bpt = packed.shape
    assert packed.dtype.itemsize == 1 and packed.strides[1] == bpt and packed.strides[3] == 1
    return np.lib.stride_tricks.as_strided(packed.view(np.uint8), (nb, pbs * bpt), (packed.strides[0], 1))


def dequantize_cache(packed: np.ndarray, d_qk: int) -> np.ndarray:
    """Decode packed FP8 bytes into float64 ``(num_blocks * pbs, d_qk)`` (flat token index
    ``block * pbs + row``). Values are the bf16 values of spec §3.3/§3.4 (``fp8 * scale``,
    exact for power-of-two scales; rounded to bf16 for safety); NaN bytes/scales give NaN."""
    fmt = FORMAT_OF_DIM[d_qk]
    _, nope, tile, n_scales = LAYOUT[fmt]
    nb, pbs, _, bpt = packed.shape
    assert bpt == BYTES_PER_TOKEN[fmt]
    raw = block_bytes(packed)
    if fmt == V32:
        tok = raw.reshape(nb * pbs, bpt)
        data = tok[:, :512]
        scales = np.ascontiguousarray(tok[:, 512:528]).view("<f4").astype(np.float64)
        rope = np.ascontiguousarray(tok[:, 528:656]).view("<u2")
    else:
        data_rec = raw[:, : pbs * MODEL1_DATA_BYTES].reshape(nb * pbs, MODEL1_DATA_BYTES)
        data = data_rec[:, :448]
        rope = np.ascontiguousarray(data_rec[:, 448:576]).view("<u2")
        sc_rec = raw[:, pbs * MODEL1_DATA_BYTES:].reshape(nb * pbs, MODEL1_SCALE_BYTES)
        scales = e8m0_decode(sc_rec[:, :7])
    vals = e4m3_decode(data).reshape(-1, n_scales, tile)
    with np.errstate(invalid="ignore", over="ignore"):
        k_nope = round_bf16((vals * scales[..., None]).reshape(-1, nope))
    k_rope = rope.astype(np.uint16).view(BF16).astype(np.float64)
    return np.concatenate([k_nope, k_rope], axis=1)


# ----------------------------------------------------------------------------- attention


def attend(q: np.ndarray, keys: np.ndarray, scale: float, sink: Optional[np.ndarray] = None):
    """Softmax attention of query rows ``q (h, d_qk)`` over ``keys (n, d_qk)`` (float64, spec §2.1).

    Returns ``(out (h, 512), lse (h,), max_logits (h,))``; empty ``keys`` -> 0 / +inf / -inf.
    ``sink (h,)``: ``out *= 1 / (1 + exp(sink - lse))`` (lse unchanged).
    """
    h = q.shape[0]
    if keys.shape[0] == 0:
        return np.zeros((h, D_V)), np.full(h, np.inf), np.full(h, -np.inf)
    assert np.all(np.isfinite(keys)), "oracle: a selected key is not finite (test data bug)"
    s = (q @ keys.T) * scale
    m = s.max(axis=1)
    p = np.exp(s - m[:, None])
    denom = p.sum(axis=1)
    lse = m + np.log(denom)
    out = (p @ keys[:, :D_V]) / denom[:, None]
    if sink is not None:
        with np.errstate(over="ignore"):
            out = out / (1.0 + np.exp(np.asarray(sink, np.float64) - lse))[:, None]
    return out, lse, m


def dense_decode(q, k_cache, block_table, cache_seqlens, causal=False, softmax_scale=None):
    """Spec §2.2. q ``(b, s_q, h_q, d)``, k_cache ``(num_blocks, pbs, h_kv, d)`` (any float dtype),
    block_table ``(b, max_blocks)``, cache_seqlens ``(b,)``. Returns float64
    ``out (b, s_q, h_q, 512)``, ``lse (b, h_q, s_q)``."""
    q = np.asarray(q)
    b, s_q, h_q, d = q.shape
    _, pbs, h_kv, _ = k_cache.shape
    group = h_q // h_kv
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    qf = f64(q)
    out = np.zeros((b, s_q, h_q, D_V))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        n = int(cache_seqlens[i])
        pages = np.asarray(block_table)[i, : -(-n // pbs)]
        keys = f64(np.asarray(k_cache)[pages]).reshape(-1, h_kv, d)[:n]  # (n, h_kv, d)
        for r in range(s_q):
            n_vis = min(max(n - s_q + r + 1, 0), n) if (causal and s_q > 1) else n
            for g in range(h_kv):
                hs = slice(g * group, (g + 1) * group)
                o, l, _ = attend(qf[i, r, hs], keys[:n_vis, g], scale)
                out[i, r, hs] = o
                lse[i, hs, r] = l
    return out, lse


def _valid_slots(row: np.ndarray, length: Optional[int], prefill_rules: bool, num_tokens: int) -> np.ndarray:
    n = len(row) if length is None else max(0, min(int(length), len(row)))
    idx = np.asarray(row[:n], dtype=np.int64)
    if prefill_rules:
        return idx[(idx >= 0) & (idx < num_tokens)]
    idx = idx[idx != -1]
    assert np.all((idx >= 0) & (idx < num_tokens)), "oracle: decode index out of range (test data bug)"
    return idx


def sparse_decode(q, kv, indices, scale, topk_length=None, attn_sink=None,
                  extra_kv=None, extra_indices=None, extra_topk_length=None):
    """Spec §2.3. ``kv``/``extra_kv``: dequantized float64 ``(num_tokens, d_qk)`` (flat index
    ``block * pbs + row``). Slots invalid iff -1 or position >= topk_length[i] (per batch).
    Main and extra slots form one joint softmax. Returns float64 ``out (b, s_q, h_q, 512)``,
    ``lse (b, h_q, s_q)``."""
    q = f64(q)
    b, s_q, h_q, d = q.shape
    out = np.zeros((b, s_q, h_q, D_V))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        for r in range(s_q):
            sel = _valid_slots(indices[i, r], None if topk_length is None else topk_length[i], False, kv.shape[0])
            keys = kv[sel]
            if extra_kv is not None:
                esel = _valid_slots(extra_indices[i, r], None if extra_topk_length is None else extra_topk_length[i],
                                    False, extra_kv.shape[0])
                keys = np.concatenate([keys, extra_kv[esel]], axis=0)
            o, l, _ = attend(q[i, r], keys, scale, attn_sink)
            out[i, r], lse[i, :, r] = o, l
    return out, lse


def sparse_prefill(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    """Spec §2.4. q ``(s_q, h_q, d)``, kv ``(s_kv, 1, d)``, indices ``(s_q, 1, topk)``; a slot is
    invalid iff idx < 0, idx >= s_kv or position >= topk_length[s]. Returns float64
    ``out (s_q, h_q, 512)``, ``max_logits (s_q, h_q)``, ``lse (s_q, h_q)``."""
    qf = f64(q)
    s_q, h_q, d = qf.shape
    kvf = f64(kv)[:, 0, :]
    ind = np.asarray(indices)
    out = np.zeros((s_q, h_q, D_V))
    lse = np.full((s_q, h_q), np.inf)
    mx = np.full((s_q, h_q), -np.inf)
    for s in range(s_q):
        sel = _valid_slots(ind[s, 0], None if topk_length is None else topk_length[s], True, kvf.shape[0])
        out[s], lse[s], mx[s] = attend(qf[s], kvf[sel], sm_scale, attn_sink)
    return out, mx, lse


# ----------------------------------------------------------------------------- scheduler (§4.2-§4.3)


def tile_schedule(work, num_sm_parts: int, block_n: int = 64, overhead: int = 5):
    """Python transcription of the greedy split-KV partition of spec §4.3.

    ``work``: per-request token counts ``s'_i`` (spec §4.2). Returns ``(metadata
    (num_sm_parts, 8) int32, num_splits (b + 1,) int32)``; metadata rows are
    ``[begin_req, end_req, begin_block, end_block, begin_split, first_splitted, last_splitted, 0]``.
    """
    work = [int(w) for w in work]
    b = len(work)
    last_block = [max(w - 1, 0) // block_n for w in work]
    nblocks = [lb + 1 for lb in last_block]
    total = sum(n + overhead for n in nblocks)
    payload = -(-total // num_sm_parts) + overhead
    meta = np.zeros((num_sm_parts, 8), np.int32)
    splits = np.zeros(b + 1, np.int32)
    req = block = split = cum = 0
    for p in range(num_sm_parts):
        begin_req, begin_block, begin_split = req, block, split
        first_splitted = int(block != 0)
        remain = payload
        while req < b:
            left = nblocks[req] - block
            if remain >= left + overhead:
                cum += split + 1
                splits[req + 1] = cum
                remain -= left + overhead
                req += 1
                block = split = 0
            else:
                if remain - overhead > 0:
                    block += remain - overhead
                    split += 1
                break
        end_req = req if block > 0 else req - 1
        if block > 0:
            end_block = block
        else:
            end_block = 0 if (req >= 1 and work[req - 1] == 0) else (last_block[req - 1] + 1 if req >= 1 else 0)
        last_splitted = 0
        if 0 <= end_req < b:
            last_splitted = int(end_block != last_block[end_req] + 1 and work[end_req] != 0)
        if begin_req == end_req:
            first_splitted = last_splitted = int(first_splitted or last_splitted)
        meta[p] = [begin_req, end_req, begin_block, end_block, begin_split, first_splitted, last_splitted, 0]
    assert req == b, "scheduler: not every request was assigned"
    return meta, splits
