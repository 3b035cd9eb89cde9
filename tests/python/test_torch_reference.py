"""Validates tests/gpu/torch_reference.py (the float32 torch references used by the full-grid GPU
suites) against flash_mla's C++ reference backend (CPU tensors), on small random cases built
with the grid generators of tests/gpu/grid_data.py (spec §5.2 / §5.3 data rules).

Covered: both FP8 formats (§3.3 V32, §3.4 MODEL1: bit-exact torch quantizer and byte decoder vs
flash_mla.quant), extra cache with its own page size, topk_length / extra_topk_length, sinks
with +-inf (random and all-+inf / all--inf), -1 and garbage invalid indices, all-invalid rows,
zero-length sequences (empty rows: out 0, lse +inf, max_logits -inf), NaN-poisoned unused tokens,
non-contiguous inputs. Values must agree within bf16 output rounding; +-inf / NaN positions exactly.
"""

import dataclasses
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import flash_mla  # noqa: E402
import flash_mla.quant as fq  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
import grid_data as gd  # noqa: E402
import torch_reference as tr  # noqa: E402
from grid_cases import DecodeParam, PrefillParam  # noqa: E402

# Agreement between two float32 implementations of the same math: outputs differ by bf16 rounding
# of `out` (one ulp, 2^-8 relative) and float32 reassociation in lse / max_logits.
OUT_TOL = (2e-5, 1.01 / 128, 1e-5)  # abs, rel, cos
LSE_TOL = (1e-5, 1e-5, 1e-9)


# ----------------------------------------------------------------------------- FP8 formats
@pytest.mark.parametrize("d_qk,pbs", [(576, 2), (576, 61), (512, 3), (512, 64), (512, 1)])
def test_quantizer_and_decoder_match_flash_mla(d_qk, pbs):
    g = torch.Generator().manual_seed(d_qk + pbs)
    cache = (torch.randn(5, pbs, 1, d_qk, generator=g) * torch.rand(5, pbs, 1, 1, generator=g) * 3)
    cache = cache.clamp(-4, 4).to(torch.bfloat16)
    cache[0, 0, 0, :7] = 0  # all-zero and tiny tiles: minimum scale 2^-13
    cache[1, 0, 0, :] = 1e-6
    cache[2, pbs - 1, 0, :] = float("nan")  # poisoned token
    mine = tr.quantize_k_cache(cache)
    ref = fq.quantize_k_cache(cache)
    assert mine.shape == ref.shape and mine.stride() == ref.stride(), (mine.stride(), ref.stride())
    nan_tok = torch.zeros(5, pbs, dtype=torch.bool)
    nan_tok[2, pbs - 1] = True
    if d_qk == 576:  # per-token records: every finite token bit-exact
        assert torch.equal(mine[~nan_tok], ref[~nan_tok])
    else:  # per-block layout: compare the whole payload of blocks without NaN tokens
        s0 = ref.stride(0)
        blk = lambda t: t.as_strided((5, pbs * 584), (s0, 1))  # noqa: E731
        keep = ~nan_tok.any(1)
        assert torch.equal(blk(mine)[keep], blk(ref)[keep])
    flat = torch.arange(5 * pbs)
    deq = tr.dequant_tokens(mine, flat, d_qk).view(5, pbs, 1, d_qk)
    deq_ref = fq.dequantize_k_cache(ref, d_qk)
    fin = ~nan_tok
    assert torch.equal(deq[fin], deq_ref[fin])
    assert bool(deq[nan_tok][:, :, : (512 if d_qk == 576 else 448)].isnan().all())  # NaN payload / scales
    # decoding flash_mla's own bytes gives the same values
    assert torch.equal(tr.dequant_tokens(ref, flat, d_qk).view(5, pbs, 1, d_qk)[fin], deq_ref[fin])


# ----------------------------------------------------------------------------- sparse decode
def D(**kw):
    base = dict(b=3, h_q=64, s_q=2, s_kv=200, is_varlen=True, topk=64, block_size=16, d_qk=576, kind="val", num_runs=0)
    base.update(kw)
    return DecodeParam(**base)


X = dict(extra_s_k=150, extra_topk=48, extra_block_size=5)
DECODE = [
    D(seed=1),
    D(seed=2, s_q=1, is_varlen=False, block_size=2),
    D(seed=3, h_q=128, s_kv=40, topk=100, block_size=61),  # topk > lengths: -1 padding
    D(seed=4, is_all_indices_invalid=True),
    D(seed=5, have_zero_seqlen_k=True, b=4),
    D(seed=6, enable_attn_sink=False, s_q=3),
    D(seed=7, d_qk=512),
    D(seed=8, d_qk=512, have_topk_length=True, block_size=69),
    D(seed=9, d_qk=512, h_q=128, s_q=3, **X),
    D(seed=10, d_qk=512, have_topk_length=True, have_extra_topk_length=True, **X),
    D(seed=11, d_qk=512, have_extra_topk_length=True, s_kv=30, topk=70, **X),
    D(seed=12, d_qk=512, have_topk_length=True, b=5, s_q=1, block_size=2, **X),
    D(seed=13, d_qk=512, is_all_indices_invalid=True, have_topk_length=True, **X),
    D(seed=14, d_qk=512, have_zero_seqlen_k=True, enable_attn_sink=False, b=4, **X),
    D(seed=15, d_qk=512, have_zero_seqlen_k=True, have_topk_length=True, have_extra_topk_length=True, b=4, **X),
    D(seed=16, d_qk=576, h_q=128, s_kv=300, topk=256, block_size=64, s_q=1),
    D(seed=17, d_qk=512, s_kv=90, topk=64, block_size=1, extra_s_k=20, extra_topk=32, extra_block_size=3),
    D(seed=18, d_qk=576, have_zero_seqlen_k=True, is_all_indices_invalid=True, b=2),
    D(seed=19, d_qk=512, h_q=128, have_topk_length=True, s_kv=500, topk=128, block_size=53, **X),
    D(seed=20, d_qk=576, s_kv=64, topk=64, is_varlen=False),
]


def _decode_check(case):
    out, lse = case.run_flash_mla()
    ref_out, ref_lse = case.reference()
    assert ref_out.shape == out.shape and ref_lse.shape == lse.shape
    assert not ref_out.isnan().any() and not ref_lse.isnan().any()
    tr.check_close("out", out, ref_out, *OUT_TOL)
    tr.check_close("lse", lse, ref_lse, *LSE_TOL)
    tr.compare_decode(out, lse, ref_out, ref_lse)  # the grid comparator passes too
    empty = ref_lse == math.inf  # (b, h_q, s_q)
    assert bool((ref_out.permute(0, 2, 1, 3)[empty] == 0).all())
    return out, lse, ref_out, ref_lse


@pytest.mark.parametrize("p", DECODE, ids=lambda p: p.id)
def test_decode_reference_matches_cpu_backend(p):
    case = gd.DecodeCase(p, "cpu")
    out, lse, ref_out, ref_lse = _decode_check(case)
    if p.is_all_indices_invalid:
        assert bool((ref_lse == math.inf).all()) and bool((ref_out == 0).all())
    if p.have_zero_seqlen_k:
        zero = (case.main.cache_seqlens == 0)
        if case.extra is not None:
            zero &= case.extra.cache_seqlens == 0
        assert bool((ref_lse[zero] == math.inf).all())
    if p.enable_attn_sink:
        assert case.sink.isinf().any()


@pytest.mark.parametrize("sink_value", [math.inf, -math.inf])
def test_decode_reference_uniform_sinks(sink_value):
    case = gd.DecodeCase(D(seed=30, d_qk=512, have_topk_length=True, **X), "cpu")
    case.sink = torch.full((64,), sink_value)
    out, lse, ref_out, ref_lse = _decode_check(case)
    if sink_value == math.inf:
        assert bool((ref_out == 0).all())
    plain = gd.DecodeCase(D(seed=30, d_qk=512, have_topk_length=True, **X), "cpu")
    plain.sink = None
    p_out, p_lse = plain.reference()
    assert torch.equal(p_lse, ref_lse)
    if sink_value == -math.inf:
        assert torch.equal(p_out, ref_out)


def test_decode_reference_garbage_beyond_topk_length_and_poisoned_tokens():
    """Slots beyond topk_length holding INT_MAX / negative garbage / NaN tokens are never read."""
    case = gd.DecodeCase(D(seed=31, d_qk=512, have_topk_length=True, have_extra_topk_length=True, **X), "cpu")
    for scope in (case.main, case.extra):
        idx = scope.indices.clone()
        topk = idx.shape[-1]
        beyond = torch.arange(topk)[None, None, :] >= scope.topk_length.long()[:, None, None]
        garbage = torch.tensor([gd.INT_MAX, -2, -123456, 2147480000], dtype=torch.int32)
        pick = garbage[torch.randint(0, 4, idx.shape, generator=torch.Generator().manual_seed(3))]
        scope.indices = gd.non_contiguousify(torch.where(beyond, pick, idx))
    _decode_check(case)


def test_decode_reference_nan_tokens_would_show():
    """Sanity of the poisoning: tokens referenced by no valid slot are NaN in the packed cache."""
    case = gd.DecodeCase(D(seed=32, d_qk=576, have_zero_seqlen_k=False), "cpu")
    n = case.main.packed.shape[0] * case.main.packed.shape[1]
    deq = tr.dequant_tokens(case.main.packed, torch.arange(n), 576)
    used = torch.zeros(n, dtype=torch.bool)
    used[case.main.indices.reshape(-1).long()] = True
    assert bool(deq[~used][:, :512].isnan().all()) and not deq[used].isnan().any()


# ----------------------------------------------------------------------------- sparse prefill
def P(**kw):
    base = dict(s_q=9, s_kv=150, topk=64, h_q=64, d_qk=512, num_runs=0, kind="val")
    base.update(kw)
    return PrefillParam(**base)


PREFILL = [
    P(seed=1),
    P(seed=2, d_qk=576, h_q=128),
    P(seed=3, s_kv=40, topk=128),  # topk > s_kv: invalid-list padding
    P(seed=4, have_attn_sink=True),
    P(seed=5, have_topk_length=True),
    P(seed=6, have_attn_sink=True, have_topk_length=True, d_qk=576),
    P(seed=7, is_all_indices_invalid=True, have_attn_sink=True, have_topk_length=True, s_q=200, topk=32),
    P(seed=8, s_q=1, s_kv=128, topk=128, have_attn_sink=True, have_topk_length=True),
    P(seed=9, s_kv=32, topk=512, have_attn_sink=True, have_topk_length=True, s_q=20),
    P(seed=10, h_q=16, d_qk=576, s_kv=95, topk=128),
    P(seed=11, h_q=32, s_kv=114, topk=384, have_topk_length=True),
    P(seed=12, h_q=128, s_q=30, s_kv=300, topk=100, have_attn_sink=True),
    P(seed=13, s_kv=500, topk=1, have_topk_length=True),
    P(seed=14, s_q=62, s_kv=153, topk=256, d_qk=576, have_attn_sink=True, have_topk_length=True),
    P(seed=15, s_q=5, s_kv=64, topk=2048, have_attn_sink=True, have_topk_length=True),
    P(seed=16, s_q=3, s_kv=1000, topk=77),
    P(seed=17, is_all_indices_invalid=True, s_q=300, topk=16, d_qk=576, h_q=16),
    P(seed=18, s_q=4, s_kv=20, topk=20),
    P(seed=19, s_q=13, s_kv=600, topk=200, h_q=128, d_qk=576, have_topk_length=True),
    P(seed=20, s_q=7, s_kv=256, topk=256, have_attn_sink=True),
]


def _prefill_check(case):
    out, ml, lse = case.run_flash_mla()
    ref_out, ref_ml, ref_lse = case.reference()
    assert not ref_out.isnan().any() and not ref_ml.isnan().any() and not ref_lse.isnan().any()
    tr.check_close("out", out.float(), ref_out.to(torch.bfloat16).float(), *OUT_TOL)
    tr.check_close("max_logits", ml, ref_ml, *LSE_TOL)
    tr.check_close("lse", lse, ref_lse, *LSE_TOL)
    tr.compare_prefill(out, ml, lse, ref_out, ref_ml, ref_lse)  # the grid comparator passes too
    empty = ref_lse == math.inf
    assert torch.equal(empty, ref_ml == -math.inf) and bool((ref_out[empty] == 0).all())
    return out, ml, lse, ref_out, ref_ml, ref_lse


@pytest.mark.parametrize("p", PREFILL, ids=lambda p: p.id)
def test_prefill_reference_matches_cpu_backend(p):
    case = gd.PrefillCase(p, "cpu")
    _prefill_check(case)
    if p.s_kv < p.topk:
        assert bool((case.indices >= p.s_kv).any() | (case.indices < 0).any())


@pytest.mark.parametrize("sink_value", [math.inf, -math.inf])
def test_prefill_reference_uniform_sinks(sink_value):
    case = gd.PrefillCase(P(seed=40, have_topk_length=True, have_attn_sink=True), "cpu")
    case.sink = torch.full((64,), sink_value)
    *_, ref_out, ref_ml, ref_lse = _prefill_check(case)
    if sink_value == math.inf:
        assert bool((ref_out == 0).all())


def test_prefill_reference_rows_subset():
    case = gd.PrefillCase(P(seed=41, s_q=40, have_topk_length=True, have_attn_sink=True), "cpu")
    full = case.reference()
    rows = torch.tensor([0, 7, 39])
    part = tr.ref_sparse_prefill(case.q, case.kv, case.indices, case.sm_scale, case.sink, case.topk_length, rows=rows)
    for a, b in zip(full, part):
        assert torch.equal(a[rows], b)


def test_chunking_does_not_change_results():
    case = gd.DecodeCase(D(seed=42, d_qk=512, have_topk_length=True, **X), "cpu")
    e = case.extra
    args = (case.q, case.main.packed, case.main.indices, case.sm_scale, case.sink, case.main.topk_length,
            e.packed, e.indices, e.topk_length)
    a = tr.ref_sparse_decode(*args)
    b = tr.ref_sparse_decode(*args, token_budget=1)
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1], rtol=1e-6, atol=0)
    assert dataclasses.is_dataclass(DecodeParam)
