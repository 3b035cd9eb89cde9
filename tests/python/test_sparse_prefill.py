"""Sparse MLA prefill (flash_mla_sparse_fwd) on the reference backend vs the float64 oracle (spec §1.4, §2.4).

Inputs follow FlashMLA's generator (spec §5.3): padded non-contiguous q/kv/indices, invalid
indices drawn from [INT_MIN, -123456, -1, s_kv, 114514, 1919810, 2147480000, INT_MAX]."""

import numpy as np
import pytest

import flash_mla
from mla_test_utils import BF16, INT_MAX, INT_MIN, LSE_TOL, check_allclose, check_out, gen_prefill_case


def run_prefill(case, **kw):
    res = flash_mla.flash_mla_sparse_fwd(case.q, case.kv, case.indices, sm_scale=case.sm_scale,
                                         attn_sink=case.attn_sink, topk_length=case.topk_length, **kw)
    return res


def check_prefill(case, res):
    assert isinstance(res, list) and len(res) == 3
    out, max_logits, lse = res
    s_q, h_q, _ = case.q.shape
    assert out.shape == (s_q, h_q, 512) and out.dtype == BF16
    assert max_logits.shape == (s_q, h_q) and max_logits.dtype == np.float32
    assert lse.shape == (s_q, h_q) and lse.dtype == np.float32
    assert not np.isnan(out.astype(np.float32)).any()
    ref_out, ref_max, ref_lse = case.reference()
    check_out("out", out, ref_out, BF16)
    check_allclose("max_logits", max_logits, ref_max, dtype=np.float32, **LSE_TOL)
    check_allclose("lse", lse, ref_lse, dtype=np.float32, **LSE_TOL)
    return ref_out, ref_max, ref_lse


# (s_q, s_kv, topk, h_q, d_qk)
SHAPES = [
    (5, 128, 128, 16, 512),
    (7, 95, 128, 64, 576),  # topk > s_kv: surplus slots invalid
    (4, 600, 192, 128, 512),
    (9, 153, 256, 16, 576),
    (3, 1000, 512, 64, 512),
    (6, 114, 100, 128, 576),  # topk not a multiple of 64
    (8, 300, 64, 64, 576),
    (2, 70, 77, 16, 512),
]


@pytest.mark.parametrize("features", ["plain", "sink", "topk_length", "sink+topk_length+invalid"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"sq{s}-skv{k}-topk{t}-h{h}-d{d}" for s, k, t, h, d in SHAPES])
def test_sparse_prefill(rng, shape, features):
    s_q, s_kv, topk, h_q, d_qk = shape
    case = gen_prefill_case(rng, s_q=s_q, s_kv=s_kv, topk=topk, h_q=h_q, d_qk=d_qk, sink="sink" in features,
                            have_topk_length="topk_length" in features,
                            invalid_frac=0.2 if "invalid" in features else 0.0)
    check_prefill(case, run_prefill(case))


@pytest.mark.parametrize("value", [INT_MIN, -123456, -1, "s_kv", 114514, 1919810, 2147480000, INT_MAX],
                         ids=lambda v: f"idx{v}")
def test_each_invalid_index_value(rng, value):
    s_kv = 80
    case = gen_prefill_case(rng, s_q=4, s_kv=s_kv, topk=64, h_q=16, d_qk=512)
    v = s_kv if value == "s_kv" else value
    case.indices[0, 0, :] = v  # row 0 entirely invalid
    case.indices[1, 0, ::3] = v  # row 1 partially invalid
    out, max_logits, lse = res = run_prefill(case)
    check_prefill(case, res)
    assert np.all(out[0].astype(np.float32) == 0) and np.all(lse[0] == np.inf) and np.all(max_logits[0] == -np.inf)
    assert np.all(np.isfinite(lse[1:]))


@pytest.mark.parametrize("d_qk", [512, 576])
def test_all_invalid_rows_with_sink_and_topk_length(rng, d_qk):
    case = gen_prefill_case(rng, s_q=12, s_kv=200, topk=128, h_q=64, d_qk=d_qk, sink=True, have_topk_length=True,
                            all_invalid_frac=0.3)
    case.topk_length[-1] = 0  # empty by length
    out, max_logits, lse = res = run_prefill(case)
    ref_out, ref_max, ref_lse = check_prefill(case, res)
    empty = np.isinf(ref_lse[:, 0])
    assert empty[0] and empty[-1]
    assert np.all(out[empty].astype(np.float32) == 0)
    assert np.all(lse[empty] == np.inf) and np.all(max_logits[empty] == -np.inf)


def test_topk_length_ignores_garbage_beyond(rng):
    case = gen_prefill_case(rng, s_q=4, s_kv=100, topk=128, h_q=16, d_qk=576, have_topk_length=True)
    case.topk_length[:] = [0, 5, 64, 128]
    res1 = run_prefill(case)
    check_prefill(case, res1)
    idx = case.indices
    for s, n in enumerate(case.topk_length):
        idx[s, 0, n:] = np.resize(np.array([INT_MAX, 3, -1, 99, INT_MIN], np.int32), 128 - n)
    res2 = run_prefill(case)
    for a, b in zip(res1, res2):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16 if a.dtype == BF16 else np.uint32),
                                      np.asarray(b).view(np.uint16 if b.dtype == BF16 else np.uint32))


@pytest.mark.parametrize("sink_value", [np.inf, -np.inf, 1.5], ids=["+inf", "-inf", "1.5"])
def test_attn_sink_scales_out_only(rng, sink_value):
    case = gen_prefill_case(rng, s_q=5, s_kv=90, topk=64, h_q=16, d_qk=512)
    case.indices[2, 0, :] = -1
    plain = run_prefill(case)
    case.attn_sink = np.full(16, sink_value, np.float32)
    out, max_logits, lse = res = run_prefill(case)
    check_prefill(case, res)
    np.testing.assert_array_equal(lse, plain[2])
    np.testing.assert_array_equal(max_logits, plain[1])
    assert np.all(out[2].astype(np.float32) == 0) and lse[2, 0] == np.inf
    if sink_value == np.inf:
        assert np.all(out.astype(np.float32) == 0)
    if sink_value == -np.inf:
        np.testing.assert_array_equal(out.view(np.uint16), plain[0].view(np.uint16))


def test_returns_list_of_three_and_unpacks(rng):
    case = gen_prefill_case(rng, s_q=2, s_kv=64, topk=64, h_q=16, d_qk=576, noncontig=False)
    res = flash_mla.flash_mla_sparse_fwd(case.q, case.kv, case.indices, case.sm_scale)
    assert type(res) is list and len(res) == 3
    out, max_logits, lse = res
    assert isinstance(out, np.ndarray)
    # positional d_v and the default d_v agree
    res2 = flash_mla.flash_mla_sparse_fwd(case.q, case.kv, case.indices, case.sm_scale, 512)
    np.testing.assert_array_equal(out.view(np.uint16), res2[0].view(np.uint16))
    check_prefill(case, res)


def test_max_logits_and_lse_are_natural_units(rng):
    # A single valid key: max_logits == lse == q.k * scale exactly (no log2(e) factor).
    case = gen_prefill_case(rng, s_q=1, s_kv=10, topk=64, h_q=16, d_qk=512, noncontig=False, sm_scale=0.7)
    case.indices[:] = -1
    case.indices[0, 0, 17] = 4
    out, max_logits, lse = run_prefill(case)
    x = case.q.astype(np.float64)[0] @ case.kv.astype(np.float64)[4, 0] * 0.7
    np.testing.assert_allclose(max_logits[0], x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse[0], x, rtol=1e-5, atol=1e-5)
    check_out("out", out[0], np.broadcast_to(case.kv.astype(np.float64)[4, 0, :512], (16, 512)), BF16)




def test_empty_kv_gives_empty_rows(rng):
    case = gen_prefill_case(rng, s_q=3, s_kv=1, topk=64, h_q=16, d_qk=512, noncontig=False)
    case.kv = case.kv[:0].copy()  # s_kv = 0: every index is invalid
    out, max_logits, lse = res = run_prefill(case)
    check_prefill(case, res)
    assert np.all(lse == np.inf) and np.all(max_logits == -np.inf) and not out.astype(np.float32).any()


def test_zero_query_tokens(rng):
    case = gen_prefill_case(rng, s_q=1, s_kv=80, topk=64, h_q=16, d_qk=512, noncontig=False)
    case.q, case.indices = case.q[:0].copy(), case.indices[:0].copy()
    out, max_logits, lse = run_prefill(case)
    assert out.shape == (0, 16, 512) and max_logits.shape == lse.shape == (0, 16)


@pytest.mark.parametrize("d_qk", [512, 576])
def test_sparse_prefill_larger(rng, d_qk):
    """h_q 128, topk 1024 (> s_kv for some configurations of FlashMLA's list), sink and topk_length."""
    case = gen_prefill_case(rng, s_q=16, s_kv=1592, topk=1024, h_q=128, d_qk=d_qk, sink=True, have_topk_length=True)
    check_prefill(case, run_prefill(case))


def test_inputs_that_are_views_with_an_offset(rng):
    """q, kv and indices given as views that start inside larger buffers (a storage offset; what lies before
    them is NaN or an out-of-range index) give the reference's results."""
    case = gen_prefill_case(rng, s_q=5, s_kv=100, topk=64, h_q=16, d_qk=576, noncontig=False, sink=True)
    big_q = np.concatenate([case.q[:2], case.q])
    big_kv = np.concatenate([np.full((3, 1, 576), np.nan, np.float32).astype(BF16), case.kv])
    big_idx = np.concatenate([np.full((1, 1, 64), INT_MAX, np.int32), case.indices])
    res = flash_mla.flash_mla_sparse_fwd(big_q[2:], big_kv[3:], big_idx[1:], sm_scale=case.sm_scale,
                                         attn_sink=case.attn_sink)
    check_prefill(case, res)
