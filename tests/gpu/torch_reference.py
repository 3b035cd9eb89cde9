"""Float32 PyTorch references for sparse MLA decode / prefill, a torch FP8 quantizer and the comparator.

Device-agnostic: every function runs on the device of its inputs (CUDA in the full-grid GPU
suites, CPU in tests/python/test_torch_reference.py, which validates this module against
flash_mla's C++ reference backend). Nothing here calls flash_mla.

* :func:`dequant_tokens` decodes packed FP8 token records (spec §3.3 "V32", §3.4 "MODEL1")
  with plain torch byte views, gathering only the requested flat token indices.
* :func:`ref_sparse_decode` — spec §2.3 (joint softmax over main + extra cache, ``-1`` /
  beyond-``topk_length`` slots invalid, sink, empty rows ``out = 0`` / ``lse = +inf``;
  returns ``out`` bf16 ``(b, s_q, h_q, 512)`` and ``lse`` ``(b, h_q, s_q)``).
* :func:`ref_sparse_prefill` — spec §2.4 (slots with ``idx < 0``, ``idx >= s_kv`` or beyond
  ``topk_length`` invalid; ``max_logits``, ``lse``, sink; returns ``out`` float32).
* :func:`quantize_k_cache` — spec §3.5 on the tensor's own device, with FlashMLA's padded
  block strides (§5.2); bit-exact to ``flash_mla.quant.quantize_k_cache`` on every finite token.
* :func:`check_close` — FlashMLA's ``kernelkit.check_is_allclose`` (spec §5.1).

Work is batched over heads and query rows (gather + bmm in float32, full fp32 precision, no
TF32) and chunked so that at most ``token_budget`` gathered K rows are materialised at once.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

D_V = 512
BYTES_PER_TOKEN = {576: 656, 512: 584}  # d_qk -> bytes per token (V32, MODEL1)
TOKEN_BUDGET = 1 << 17  # gathered K rows per chunk (576 dims fp32: ~300 MB)

# Spec §5.1 tolerances: (abs_tol, rel_tol, cos_diff_tol)
TOL_DECODE_OUT = (1e-3, 2.01 / 128, 5e-6)
TOL_DECODE_LSE = (1e-6, 8.01 / 65536, 1e-7)
TOL_PREFILL_OUT = (8e-4, 3.01 / 128, 7e-6)
TOL_PREFILL_MAX_LOGITS = (1e-6, 2.01 / 65536, 1e-7)
TOL_PREFILL_LSE = (1e-6, 2.01 / 65536, 1e-7)


# ----------------------------------------------------------------------------- comparator (§5.1)
def check_close(name: str, ans: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float,
                cos_tol: float = 1e-7) -> None:
    """FlashMLA's ``kernelkit.check_is_allclose`` (spec §5.1), raising AssertionError on failure.

    Equal shape and dtype; identical +inf / -inf / NaN positions (then zeroed); every element
    ``|a-r| < abs_tol`` or ``|a-r| / (|r| + 1e-6) < rel_tol``; ``|cos_diff| <= cos_tol`` with
    ``cos_diff = 1 - 2 sum(a r) / sum(a^2 + r^2)`` in float64 (0 if ``sum(r^2) < 1e-12``).
    Runs on the tensors' device (``ref`` is moved to ``ans``'s device).
    """
    assert ans.shape == ref.shape, f"{name}: shape {tuple(ans.shape)} vs reference {tuple(ref.shape)}"
    assert ans.dtype == ref.dtype, f"{name}: dtype {ans.dtype} vs reference {ref.dtype}"
    a = ans.detach().float().clone()
    r = ref.detach().to(a.device).float().clone()
    for what, m_a, m_r in (("+inf", a == math.inf, r == math.inf), ("-inf", a == -math.inf, r == -math.inf),
                           ("nan", a.isnan(), r.isnan())):
        if not torch.equal(m_a, m_r):
            first = (m_a != m_r).nonzero()[0].tolist()
            raise AssertionError(f"{name}: {what} positions differ: {int(m_a.sum())} in answer, {int(m_r.sum())} "
                                 f"in reference; first mismatch at {first}: ans={a[tuple(first)].item()} "
                                 f"ref={r[tuple(first)].item()}")
        a[m_a] = 0
        r[m_r] = 0
    diff = (a - r).abs()
    ok = (diff < abs_tol) | (diff / (r.abs() + 1e-6) < rel_tol)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int((~ok).sum())} of {ok.numel()} elements out of tolerance "
                             f"(abs {abs_tol:g} / rel {rel_tol:g}); max abs diff {diff.max().item():.3e}; first at "
                             f"{bad}: ans={a[tuple(bad)].item()!r} ref={r[tuple(bad)].item()!r}")
    a64, r64 = a.double(), r.double()
    rr = (r64 * r64).sum().item()
    cos_diff = 0.0 if rr < 1e-12 else 1 - 2 * (a64 * r64).sum().item() / ((a64 * a64).sum().item() + rr)
    assert abs(cos_diff) <= cos_tol, f"{name}: cos_diff {cos_diff:.3e} > {cos_tol:g}"


# ----------------------------------------------------------------------------- FP8 formats (§3.3-§3.5)
def _e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte -> float32 ``2^(e-127)``; 0xFF is NaN (float8_e8m0fnu)."""
    val = torch.exp2(e.float() - 127.0)
    return torch.where(e == 255, torch.full_like(val, math.nan), val)


def _token_records(packed: torch.Tensor, flat_idx: torch.Tensor, d_qk: int):
    """Bytes of the tokens ``flat_idx`` (int64, all in range) of a packed cache.

    Returns ``(data, scales)``: V32 — ``data`` (n, 656) whole records, ``scales`` None;
    MODEL1 — ``data`` (n, 576) [448 e4m3 | 64 bf16], ``scales`` (n, 8) e8m0 (+ pad), read from
    the per-block layout of §3.4 inside each block (``stride(0)`` bytes apart).
    """
    nb, pbs, h_kv, bpt = packed.shape
    assert h_kv == 1 and bpt == BYTES_PER_TOKEN[d_qk], (tuple(packed.shape), d_qk)
    assert packed.element_size() == 1 and packed.stride(1) == bpt and packed.stride(3) == 1
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    blk, row = flat_idx // pbs, flat_idx % pbs
    if d_qk == 576:
        return packed[:, :, 0, :][blk, row], None
    s0, off = packed.stride(0), packed.storage_offset()
    data = packed.as_strided((nb, pbs, 576), (s0, 576, 1), off)
    scales = packed.as_strided((nb, pbs, 8), (s0, 8, 1), off + pbs * 576)
    return data[blk, row], scales[blk, row]


def dequant_tokens(packed: torch.Tensor, flat_idx: torch.Tensor, d_qk: int) -> torch.Tensor:
    """Dequantized bf16 K rows ``(n, d_qk)`` of the tokens ``flat_idx`` (spec §3.3 / §3.4 / §3.5).

    V32: ``K[d] = e4m3[d] * f32scale[d // 128]`` (d < 512), ``K[512:576]`` = bf16 RoPE.
    MODEL1: ``K[d] = e4m3[d] * 2^(e[d // 64] - 127)`` (d < 448, a bf16 multiply), ``K[448:512]`` = RoPE.
    """
    data, scales = _token_records(packed, flat_idx, d_qk)
    n = data.shape[0]
    if d_qk == 576:
        fp8 = data[:, :512].view(torch.float8_e4m3fn).float().view(n, 4, 128)
        scale = data[:, 512:528].view(torch.float32)  # (n, 4)
        nope = (fp8 * scale[:, :, None]).view(n, 512).to(torch.bfloat16)
        rope = data[:, 528:656].view(torch.bfloat16)
    else:
        fp8 = data[:, :448].view(torch.float8_e4m3fn).to(torch.bfloat16).view(n, 7, 64)
        scale = _e8m0_to_float(scales[:, :7]).to(torch.bfloat16)  # exact: powers of two
        nope = (fp8 * scale[:, :, None]).view(n, 448)
        rope = data[:, 448:576].view(torch.bfloat16)
    return torch.cat([nope, rope], dim=1)


def default_block_stride(d_qk: int, pbs: int) -> int:
    """FlashMLA's test layouts (§3.3 / §3.4 / §5.2): V32 ``(pbs+1)*656``, MODEL1 ``ceil(pbs*584/576)*576``."""
    if d_qk == 576:
        return (pbs + 1) * 656
    return -(-pbs * 584 // 576) * 576


def quantize_k_cache(cache: torch.Tensor, block_stride: Optional[int] = None) -> torch.Tensor:
    """Spec §3.5 on ``cache``'s device: bf16 ``(nb, pbs, 1, d_qk)`` -> uint8 ``(nb, pbs, 1, 656|584)``
    with ``stride(1)`` = bytes per token and ``stride(0) = block_stride`` (default: FlashMLA's
    padded layout); padding bytes are 0. NaN tokens give NaN scales and NaN payloads.
    """
    nb, pbs, h_kv, d_qk = cache.shape
    assert h_kv == 1 and cache.dtype == torch.bfloat16
    bpt = BYTES_PER_TOKEN[d_qk]
    stride = default_block_stride(d_qk, pbs) if block_stride is None else block_stride
    nope_dims, tile = (512, 128) if d_qk == 576 else (448, 64)
    buf = torch.zeros(nb * stride + max(0, pbs * bpt - stride), dtype=torch.uint8, device=cache.device)
    out = buf.as_strided((nb, pbs, 1, bpt), (stride, bpt, bpt, 1))
    x = cache.view(nb, pbs, d_qk)
    step = max(1, (1 << 20) // pbs)  # blocks per chunk: bounded fp32 temporaries (~2 GB at 576 dims)
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        xc = x[b0:b1]
        nope = xc[..., :nope_dims].float().reshape(b1 - b0, pbs, -1, tile)
        amax = nope.abs().amax(dim=-1)  # NaN propagates
        scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448.0, min=1e-4))))
        q8 = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(b1 - b0, pbs, nope_dims)
        rope = xc[..., nope_dims:].contiguous().view(torch.uint8)  # (.., pbs, 128)
        if d_qk == 576:
            rec = torch.cat([q8, scale.contiguous().view(torch.uint8), rope], dim=-1)  # (.., pbs, 656)
            out[b0:b1, :, 0, :] = rec
        else:
            blocks = buf.as_strided((b1 - b0, pbs * 584), (stride, 1), b0 * stride)
            blocks[:, :pbs * 576] = torch.cat([q8, rope], dim=-1).reshape(b1 - b0, pbs * 576)
            e8 = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # exponent; NaN -> 0xFF
            e8 = torch.cat([e8, torch.zeros_like(e8[..., :1])], dim=-1)
            blocks[:, pbs * 576:] = e8.reshape(b1 - b0, pbs * 8)
    return out


# ----------------------------------------------------------------------------- softmax core
def _attend(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, scale: float,
            sink: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (R, h, d) f32, k (R, T, d) f32 with invalid rows already zero, valid (R, T) bool.

    Returns out (R, h, 512) f32 (sink applied, 0 on empty rows), max_logits (R, h) (-inf if
    empty) and lse (R, h) natural log (+inf if empty; sink not included).
    """
    s = torch.bmm(q, k.transpose(1, 2)) * scale  # (R, h, T)
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    max_logits = s.amax(dim=-1) if s.shape[-1] else torch.full(s.shape[:2], -math.inf, device=s.device)
    empty = max_logits == -math.inf
    lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else max_logits.clone()
    lse_safe = torch.where(empty, torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe[..., None])  # exp(-inf) = 0 on invalid slots and empty rows
    out = torch.bmm(p, k[:, :, :D_V])
    if sink is not None:
        out = out / (1 + torch.exp(sink[None, :].float() - lse_safe))[..., None]
    out = torch.where(empty[..., None], torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    return out, max_logits, lse


def _row_chunks(n_rows: int, tokens_per_row: int, budget: int):
    step = max(1, budget // max(1, tokens_per_row))
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


# ----------------------------------------------------------------------------- sparse decode (§2.3)
def _decode_scope(packed, indices, topk_length, d_qk, r0, r1, s_q):
    """Gathered, dequantized f32 K (R, topk, d_qk) and validity (R, topk) of query rows [r0, r1)."""
    nb, pbs = packed.shape[0], packed.shape[1]
    b, _, topk = indices.shape
    idx = indices.reshape(b * s_q, topk)[r0:r1].long()
    valid = (idx != -1)
    if topk_length is not None:
        batch = torch.arange(r0, r1, device=idx.device) // s_q
        valid &= torch.arange(topk, device=idx.device)[None, :] < topk_length.long()[batch][:, None]
    # Other negative / out-of-range values are undefined for the kernels (§2.3); never gathered here.
    valid &= (idx >= 0) & (idx < nb * pbs)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    k = dequant_tokens(packed, safe.reshape(-1), d_qk).float().view(r1 - r0, topk, d_qk)
    k = torch.where(valid[..., None], k, torch.zeros_like(k))  # NaN-safe (poisoned tokens)
    return k, valid


@torch.no_grad()
def ref_sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                      attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
                      extra_k_cache: Optional[torch.Tensor] = None, extra_indices: Optional[torch.Tensor] = None,
                      extra_topk_length: Optional[torch.Tensor] = None,
                      token_budget: int = TOKEN_BUDGET) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse FP8 decode, spec §2.3. ``q`` (b, s_q, h_q, d_qk) bf16; ``k_cache`` packed uint8
    (nb, pbs, 1, 656|584); ``indices`` (b, s_q, topk) flat token indices (``-1`` invalid);
    ``topk_length`` (b,) per batch; optional extra cache with its own indices / lengths (one
    joint softmax). Returns ``out`` bf16 (b, s_q, h_q, 512), ``lse`` f32 (b, h_q, s_q).
    """
    b, s_q, h_q, d_qk = q.shape
    topk = indices.shape[-1] + (0 if extra_indices is None else extra_indices.shape[-1])
    qf = q.reshape(b * s_q, h_q, d_qk)
    out = torch.empty(b * s_q, h_q, D_V, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b * s_q, h_q, dtype=torch.float32, device=q.device)
    for r0, r1 in _row_chunks(b * s_q, topk, token_budget):
        k, valid = _decode_scope(k_cache, indices, topk_length, d_qk, r0, r1, s_q)
        if extra_indices is not None:
            k2, valid2 = _decode_scope(extra_k_cache, extra_indices, extra_topk_length, d_qk, r0, r1, s_q)
            k, valid = torch.cat([k, k2], dim=1), torch.cat([valid, valid2], dim=1)
        o, _, l = _attend(qf[r0:r1].float(), k, valid, softmax_scale, attn_sink)
        out[r0:r1] = o.to(torch.bfloat16)
        lse[r0:r1] = l
        del k, valid, o
    return out.view(b, s_q, h_q, D_V), lse.view(b, s_q, h_q).transpose(1, 2)


# ----------------------------------------------------------------------------- sparse prefill (§2.4)
@torch.no_grad()
def ref_sparse_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                       attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
                       rows: Optional[torch.Tensor] = None, token_budget: int = TOKEN_BUDGET
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill, spec §2.4. ``q`` (s_q, h_q, d_qk) bf16, ``kv`` (s_kv, 1, d_qk) bf16,
    ``indices`` (s_q, 1, topk): slot invalid iff ``idx < 0``, ``idx >= s_kv`` or (``topk_length``
    (s_q,) given) position ``>= topk_length[s]``. ``rows`` optionally restricts to some query rows.
    Returns ``out`` f32 (R, h_q, 512), ``max_logits`` and ``lse`` f32 (R, h_q).
    """
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    rows = torch.arange(s_q, device=q.device) if rows is None else rows.to(q.device).long()
    n = rows.numel()
    out = torch.empty(n, h_q, D_V, dtype=torch.float32, device=q.device)
    ml = torch.empty(n, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty(n, h_q, dtype=torch.float32, device=q.device)
    kv2 = kv[:, 0, :]
    for r0, r1 in _row_chunks(n, topk, token_budget):
        rr = rows[r0:r1]
        idx = indices[rr, 0, :].long()
        valid = (idx >= 0) & (idx < s_kv)
        if topk_length is not None:
            valid &= torch.arange(topk, device=q.device)[None, :] < topk_length.to(q.device).long()[rr][:, None]
        safe = torch.where(valid, idx, torch.zeros_like(idx))
        k = kv2[safe.reshape(-1)].float().view(r1 - r0, topk, d_qk)
        k = torch.where(valid[..., None], k, torch.zeros_like(k))
        o, m, l = _attend(q[rr].float(), k, valid, sm_scale, attn_sink)
        out[r0:r1], ml[r0:r1], lse[r0:r1] = o, m, l
        del k, valid, o
    return out, ml, lse


# ----------------------------------------------------------------------------- result checks
def compare_decode(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """Sparse decode answer vs reference with spec §5.1 tolerances (out bf16 vs bf16; lse)."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32, (out.dtype, lse.dtype)
    check_close("out", out, ref_out, *TOL_DECODE_OUT)
    check_close("lse", lse, ref_lse, *TOL_DECODE_LSE)


def compare_prefill(out, max_logits, lse, ref_out, ref_ml, ref_lse) -> None:
    """Sparse prefill answer vs reference with spec §5.1 tolerances (``out.float()`` vs f32 ref)."""
    assert out.dtype == torch.bfloat16 and max_logits.dtype == torch.float32 and lse.dtype == torch.float32
    check_close("out", out.float(), ref_out.float(), *TOL_PREFILL_OUT)
    check_close("max_logits", max_logits, ref_ml, *TOL_PREFILL_MAX_LOGITS)
    check_close("lse", lse, ref_lse, *TOL_PREFILL_LSE)
